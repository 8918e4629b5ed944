"""The embedded demo on real weights: SmolLM2-135M-Instruct from its GGUF file and the three adapters trained here.

Fidelity: our engine against transformers + peft loading the same GGUF file and the same adapter directories
(fp32), the base and every adapter in ONE mixed batch of ours, each compared with the reference running that
sequence alone. Behaviour: each adapter shows its behaviour on held-out prompts, the base does not.
"""

from __future__ import annotations

import copy

import pytest
import torch

from adapters.ref import LoRARequest
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from loraplex.demo import RECIPE
from loraplex.demo.behaviours import BEHAVIOURS, HELD_OUT_PROMPTS

GREEDY_TOKENS = 32


@pytest.fixture(scope="module")
def llm(demo):
    return LLM(model=str(demo.model), enable_lora=True, max_lora_rank=RECIPE.rank, max_loras=4, device="cpu")


@pytest.fixture(scope="module")
def reference(demo, smollm2_transformers):
    """transformers (dequantizing the same GGUF file) + peft with the three demo adapters."""
    from peft import PeftModel

    names = list(demo.adapters)
    hf = copy.deepcopy(smollm2_transformers)  # peft wraps the modules it is given
    model = PeftModel.from_pretrained(hf, str(demo.adapters[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(demo.adapters[name]), adapter_name=name)
    return model.eval()


def chat_ids(llm: LLM, prompt: str) -> list[int]:
    return llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=False
    )


def reference_argmax(reference, rows: list[list[int]], adapters: list[str | None]) -> list[list[int]]:
    """transformers + peft's greedy choice after every prefix of each row (one forward per row, right-padded: a
    causal model's logits at a real position never see the padding after it), each row with its own adapter."""
    width = max(map(len, rows))
    ids = torch.tensor([row + [0] * (width - len(row)) for row in rows])  # [B, L]
    with torch.no_grad():
        logits = reference(ids, adapter_names=[a or "__base__" for a in adapters]).logits  # [B, L, V]
    return logits.argmax(-1).tolist()


def test_greedy_tokens_match_transformers_and_peft_in_one_mixed_batch(demo, llm, reference):
    """Ours: the base and each adapter on the 8 held-out prompts in ONE mixed batch, greedy, up to 32 tokens.
    Theirs: at every step, the token transformers + peft would pick after the same prefix (teacher forcing is
    greedy decoding's own check: equal choices at every step make equal sequences)."""
    variants = [None, *demo.adapters]
    loras = {name: LoRARequest(name, str(path)) for name, path in demo.adapters.items()}
    batch = [(name, prompt) for prompt in HELD_OUT_PROMPTS for name in variants]  # 32 sequences, interleaved
    prompt_ids = [chat_ids(llm, prompt) for _, prompt in batch]
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS)
    ours = [
        o.outputs[0].token_ids for o in llm.generate(prompt_ids, params, lora_request=[loras.get(n) for n, _ in batch])
    ]
    assert sum(map(len, ours)) > len(batch) * GREEDY_TOKENS // 2  # real answers, not an immediate stop
    choices = reference_argmax(reference, [p + o for p, o in zip(prompt_ids, ours)], [n for n, _ in batch])
    for (name, prompt), ids, tokens, picked in zip(batch, prompt_ids, ours, choices):
        expected = picked[len(ids) - 1 : len(ids) - 1 + len(tokens)]
        assert tokens == expected, f"{name or 'base'} on {prompt!r}"
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_last_position_logprobs_match_peft_for_the_base_and_each_adapter(demo, llm, reference):
    """One short prompt, the base and the three adapters in one step: top-20 logprobs within 1e-4 (fp32)."""
    variants = [None, *demo.adapters]
    loras = {name: LoRARequest(name, str(path)) for name, path in demo.adapters.items()}
    ids = chat_ids(llm, "Hi!")
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)
    ours = llm.generate([ids] * len(variants), params, lora_request=[loras.get(n) for n in variants])
    with torch.no_grad():
        logits = reference(torch.tensor([ids] * len(variants)), adapter_names=[n or "__base__" for n in variants])
    expected = torch.log_softmax(logits.logits[:, -1], -1)
    assert (expected[1:] - expected[0]).abs().max() > 1e-2  # each adapter really changes the distribution
    for row, out in enumerate(ours):
        for token_id, logprob in out.outputs[0].logprobs[0].top_logprobs.items():
            assert logprob == pytest.approx(expected[row, token_id].item(), abs=1e-4), f"{variants[row]}"


def test_each_adapter_shows_its_behaviour_and_the_base_does_not(demo, llm):
    loras = {name: LoRARequest(name, str(path)) for name, path in demo.adapters.items()}
    params = SamplingParams(temperature=0.0, max_tokens=100)
    conversations = [[{"role": "user", "content": p}] for p in HELD_OUT_PROMPTS]
    base = [o.outputs[0].text for o in llm.chat(conversations, params)]
    for name, behaviour in BEHAVIOURS.items():
        replies = [o.outputs[0].text for o in llm.chat(conversations, params, lora_request=loras[name])]
        assert sum(map(behaviour.check, replies)) >= 7, f"{name}: {replies}"
        assert sum(map(behaviour.check, base)) == 0, f"the base shows {name}'s behaviour: {base}"


def test_the_demo_as_a_hugging_face_directory_serves_the_same_tokens(demo, llm):
    """`loraplex bench peer --demo` hands vLLM this directory: the same weights and tokenizer as the GGUF file."""
    from loraplex.demo import hf_directory

    directory = hf_directory(demo)
    assert hf_directory(demo) == directory  # written once
    from_dir = LLM(model=str(directory), device="cpu", dtype="float32", num_kv_blocks=64)
    assert from_dir.tokenizer.encode("Hello, world") == llm.tokenizer.encode("Hello, world")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [chat_ids(llm, p) for p in HELD_OUT_PROMPTS[:2]]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in from_dir.generate(prompts, params)] == expected
