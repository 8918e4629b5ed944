"""Multi-LoRA fidelity: every sequence of a mixed-adapter batch matches peft on that adapter alone (fp32)."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, PeftModel

from adapters.ref import LoRARequest
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from kernels.lora import LoraMeta
from tests.hf_models import make_adapter, make_model
from tests.test_oracle import our_prompt_logits, prompts

ADAPTERS = {
    "r4-qv": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "r8-all-linear": LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
    "r16-rslora-mlp": LoraConfig(
        r=16, lora_alpha=16, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj"]
    ),
    "r8-alpha3-attn": LoraConfig(r=8, lora_alpha=3, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
}
BASES = ["llama", "qwen2"]


@pytest.fixture(scope="module", params=BASES)
def setup(request, tmp_path_factory, tokenizer):
    directory = tmp_path_factory.mktemp(f"lora-{request.param}")
    hf = make_model(directory / "base", tokenizer, request.param)
    hf.generation_config.eos_token_id = None
    paths = {name: make_adapter(hf, directory / name, 1 + i, config=c) for i, (name, c) in enumerate(ADAPTERS.items())}
    peft_model = PeftModel.from_pretrained(copy.deepcopy(hf), paths["r4-qv"], adapter_name="r4-qv")
    for name in list(ADAPTERS)[1:]:
        peft_model.load_adapter(paths[name], adapter_name=name)
    peft_model.eval()
    llm = cpu_llm(directory / "base", "float32", num_kv_blocks=512)
    loras = {name: LoRARequest(name, path) for name, path in paths.items()}
    return hf, peft_model, llm, loras


def cpu_llm(model, dtype: str, num_kv_blocks: int, **options) -> LLM:
    """Our engine on the CPU with 4 adapter rows of rank up to 16 (the largest of ADAPTERS)."""
    return LLM(
        model=str(model),
        device="cpu",
        dtype=dtype,
        num_kv_blocks=num_kv_blocks,
        enable_lora=True,
        max_loras=4,
        max_lora_rank=16,
        **options,
    )


def peft_logits(peft_model, token_ids: list[int], adapter: str | None) -> torch.Tensor:
    with torch.no_grad():
        return peft_model(torch.tensor([token_ids]), adapter_names=[adapter or "__base__"]).logits[0]


def our_logits(llm: LLM, token_ids: list[int], lora: LoRARequest | None) -> torch.Tensor:
    runner, cache = llm.engine.runner, llm.engine.adapter_cache
    idx = -1
    if lora is not None:
        cache.load(lora)
        idx = cache.acquire(lora)
    meta = LoraMeta.build([idx] * len(token_ids), runner.device) if idx >= 0 else None  # None, as the runner passes
    try:
        return our_prompt_logits(llm, token_ids, meta)
    finally:
        if idx >= 0:
            cache.release(idx)


@pytest.mark.parametrize("adapter", [None, *ADAPTERS])
def test_prefill_logits_match_peft(setup, adapter):
    _, peft_model, llm, loras = setup
    token_ids = prompts(llm.engine.runner.arch.vocab_size)[-3]
    expected = peft_logits(peft_model, token_ids, adapter)
    if adapter is not None:  # the adapter really changes the logits
        assert (expected - peft_logits(peft_model, token_ids, None)).abs().max() > 1e-2
    got = our_logits(llm, token_ids, loras.get(adapter))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_mixed_batch_greedy_matches_peft_per_adapter(setup):
    _, peft_model, llm, loras = setup
    names = [None, *ADAPTERS] * 2  # 10 sequences: every adapter and the base, twice
    batch = prompts(llm.engine.runner.arch.vocab_size, len(names), seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    ours = llm.generate(batch, params, lora_request=[loras.get(n) for n in names])
    for prompt, name, out in zip(batch, names, ours):
        with torch.no_grad():
            if name is None:
                with peft_model.disable_adapter():
                    ref = peft_model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=10, do_sample=False)
            else:
                peft_model.set_adapter(name)
                ref = peft_model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=10, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist(), f"adapter {name}"
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and llm.engine.adapter_cache.num_pinned == 0


def test_mixed_batch_last_token_logits_match_peft_adapter_names(setup):
    """peft's own mixed-batch forward (adapter_names=[...]) against one step of ours, row by row."""
    _, peft_model, llm, loras = setup
    names = [None, *ADAPTERS]
    token_ids = prompts(llm.engine.runner.arch.vocab_size, 16, seed=9)[9]  # 31 tokens for every row
    with torch.no_grad():
        expected = peft_model(
            torch.tensor([token_ids] * len(names)), adapter_names=[n or "__base__" for n in names]
        ).logits[:, -1]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=5)
    ours = llm.generate([token_ids] * len(names), params, lora_request=[loras.get(n) for n in names])
    for row, out in enumerate(ours):
        top = out.outputs[0].logprobs[0].top_logprobs
        ref = torch.log_softmax(expected[row], -1)
        for token_id, logprob in top.items():
            assert logprob == pytest.approx(ref[token_id].item(), abs=1e-4)
        assert out.outputs[0].token_ids[0] == int(expected[row].argmax())


def test_bfloat16_lora_on_cpu_stays_close_to_peft_fp32(setup, cpu_kernel):
    """bf16 weights, K/V and LoRA (on CPU the C++ kernels where they build): each adapter's prefill logits within
    bf16 error of peft's fp32 ones, and much nearer them than to the base model's (the delta is applied)."""
    _, peft_model, fp32_llm, loras = setup
    llm = cpu_llm(fp32_llm.engine.config.model, "bfloat16", num_kv_blocks=64)
    assert llm.engine.config.lora_backend == ("cpu" if cpu_kernel is not None else "torch")
    token_ids = prompts(llm.engine.runner.arch.vocab_size)[-3]
    base = peft_logits(peft_model, token_ids, None)
    for name in ADAPTERS:
        expected = peft_logits(peft_model, token_ids, name)
        error = (our_logits(llm, token_ids, loras[name]) - expected).abs().max()
        assert error < 0.1 * expected.abs().max(), name  # as bf16 is from fp32 without adapters (~5% here)
        assert error < 0.25 * (expected - base).abs().max(), name


@pytest.mark.gpu
def test_cuda_triton_lora_mixed_batch_matches_peft(setup):
    _, peft_model, cpu_llm, loras = setup
    llm = LLM(
        model=cpu_llm.engine.config.model,
        device="cuda",
        dtype="float32",
        enable_lora=True,
        max_loras=4,
        max_lora_rank=16,
        lora_backend="triton",
        attention_backend="triton",
        num_kv_blocks=256,
    )
    names = [None, *ADAPTERS]
    batch = prompts(llm.engine.runner.arch.vocab_size, len(names), seed=5)
    ours = llm.generate(
        batch,
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        lora_request=[loras.get(n) for n in names],
    )
    for prompt, name, out in zip(batch, names, ours):
        with torch.no_grad():
            logits = peft_model(torch.tensor([prompt]), adapter_names=[name or "__base__"]).logits[0, -1]
        assert out.outputs[0].token_ids[0] == int(logits.argmax())


def test_a_step_reuses_the_last_lora_meta_only_while_every_row_is_the_same(setup, monkeypatch):
    """Two sequence slots, three requests on three adapters: when the first finishes, the third, a one-token prompt,
    takes its slot, so two-token steps run over rows (a, b), then (c, b) with no step of another size between. Each
    step's meta must describe that step's rows (a meta reused past the change would apply the wrong adapter), and
    steady steps reuse one meta."""
    _, peft_model, shared, loras = setup
    llm = cpu_llm(shared.engine.config.model, "float32", num_kv_blocks=512, max_num_seqs=2)
    runner = llm.engine.runner
    used: list[tuple[list[int], LoraMeta]] = []
    step_meta = runner._step_lora_meta

    def recording(token_adapter_idx):
        meta = step_meta(token_adapter_idx)
        used.append((token_adapter_idx.tolist(), meta))
        return meta

    monkeypatch.setattr(runner, "_step_lora_meta", recording)
    names = ["r4-qv", "r8-all-linear", "r8-alpha3-attn"]
    batch = prompts(runner.arch.vocab_size, 3, seed=11)
    batch[2] = batch[2][:1]
    lengths = [4, 12, 6]
    outs = llm.generate(
        batch,
        [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths],
        lora_request=[loras[n] for n in names],
    )
    for prompt, name, n, out in zip(batch, names, lengths, outs):
        peft_model.set_adapter(name)
        with torch.no_grad():
            ref = peft_model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist(), f"adapter {name}"
    for rows, meta in used:  # every step ran on a meta of its own rows
        assert meta.token_adapter_idx.tolist() == rows
    decode_rows = {tuple(rows) for rows, _ in used if len(rows) == 2}
    assert len(decode_rows) >= 2  # the slot changed hands between two decode batches
    assert len({id(meta) for _, meta in used}) < len(used)  # and steady steps shared their meta
