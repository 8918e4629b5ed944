"""Our forward pass and engine against transformers on the same weights (fp32): logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.step_meta import StepMeta
from kernels.lora import LoraMeta
from kernels.paged_attention import PagedAttentionMeta
from tests.hf_models import make_model

VARIANTS = {
    "llama": ("llama", {}),
    "llama-tied-llama3-rope": (
        "llama",
        {
            "tie_word_embeddings": True,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "llama-linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
}


def prompts(vocab_size: int, count: int = 16, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 2, 3, 5, 8, 13, 16, 17, 21, 31, 32, 33, 47, 64, 80, 100][:count]
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module", params=list(VARIANTS))
def model_pair(request, tmp_path_factory, tokenizer):
    arch, overrides = VARIANTS[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    hf = make_model(directory, tokenizer, arch, **overrides)
    hf.generation_config.eos_token_id = None  # generate exactly max_new_tokens, as ignore_eos does
    llm = LLM(model=str(directory), dtype="float32", device="cpu", num_kv_blocks=256, max_num_batched_tokens=256)
    return hf, llm


def our_prompt_logits(llm: LLM, token_ids: list[int], lora: LoraMeta | None = None) -> torch.Tensor:
    """Every position's logits from our model for one prompt, through the paged cache: [L, V]."""
    runner = llm.engine.runner
    bs = runner.block_size
    blocks = list(range(-(-len(token_ids) // bs)))
    pos = torch.arange(len(token_ids))
    attn = PagedAttentionMeta.build(
        slot_mapping=torch.tensor(blocks)[pos // bs] * bs + pos % bs,
        block_size=bs,
        prefill_q_lens=[len(token_ids)],
        prefill_context_lens=[len(token_ids)],
        prefill_block_tables=[blocks],
        decode_context_lens=[],
        decode_block_tables=[],
        device="cpu",
    )
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(token_ids), pos, StepMeta(attn, lora))
        return runner.model.compute_logits(hidden)


def test_prefill_logits_match_transformers(model_pair):
    hf, llm = model_pair
    token_ids = prompts(hf.config.vocab_size)[-1]
    with torch.no_grad():
        expected = hf(torch.tensor([token_ids])).logits[0]
    torch.testing.assert_close(our_prompt_logits(llm, token_ids), expected, atol=1e-4, rtol=1e-4)


def test_batched_greedy_generation_matches_transformers(model_pair):
    hf, llm = model_pair
    batch = prompts(hf.config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ours = llm.generate(batch, params)  # all 16 in one continuous batch
    assert llm.engine.stats.num_steps < 16 * 12  # they really ran together
    for prompt, out in zip(batch, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist(), f"prompt of {len(prompt)} tokens"
        assert out.outputs[0].finish_reason == "length"


def test_prompt_steps_run_the_last_layer_on_each_sequences_last_row_only(model_pair):
    """Steps with prompt tokens (chunks of long prompts beside other seqs' decodes) run the first layer's MLP on every
    token and the last layer's on one row per seq; the greedy tokens stay transformers'."""
    hf, llm = model_pair
    batch = prompts(hf.config.vocab_size, seed=7)[-6:]  # 375 new prompt tokens: chunked under a 256-token budget
    layers = llm.engine.runner.model.model.layers
    rows: dict[str, list[int]] = {"first": [], "last": []}
    hooks = [
        layer.mlp.register_forward_hook(lambda _m, args, _out, key=key: rows[key].append(args[0].shape[0]))
        for key, layer in (("first", layers[0]), ("last", layers[-1]))
    ]
    try:
        ours = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    finally:
        for hook in hooks:
            hook.remove()
    prompt_steps = [(t, b) for t, b in zip(rows["first"], rows["last"]) if t > b]
    assert len(prompt_steps) >= 2 and all(t <= 256 for t, _ in prompt_steps)  # the prompts took several steps
    assert sum(b for _, b in prompt_steps) < sum(t for t, _ in prompt_steps) // 10
    for prompt, out in zip(batch, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist(), f"prompt of {len(prompt)} tokens"


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cuda_triton_attention_matches_transformers(arch, tmp_path, tokenizer):
    hf = make_model(tmp_path, tokenizer, arch)
    hf.generation_config.eos_token_id = None
    llm = LLM(model=str(tmp_path), dtype="float32", device="cuda", attention_backend="triton", num_kv_blocks=256)
    batch = prompts(hf.config.vocab_size)
    ours = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(batch, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist()
