"""The C++ decode stack (engine/layers/decode_stack.py): decode steps through it give the layer-by-layer forward's
results bit for bit, base and mixed-adapter batches, and it takes only the steps and models its kernels cover."""

from __future__ import annotations

import pytest
import torch

from engine.layers.packed_linear import can_pack
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.hf_models import make_adapter, make_model
from tests.test_oracle import prompts

pytestmark = pytest.mark.usefixtures("require_cpu_kernel")


def make_llm(model_dir, decode_stack: bool, dtype: str = "float32", **options) -> LLM:
    return LLM(
        model=str(model_dir),
        device="cpu",
        dtype=dtype,
        num_kv_blocks=128,
        enable_lora=True,
        max_loras=4,
        max_lora_rank=8,
        decode_stack=decode_stack,
        **options,
    )


def count_calls(llm: LLM) -> list[int]:
    """Counts the decode stack's op calls: [calls] (the engine must have one)."""
    stack = llm.engine.runner.model.model.decode_stack
    assert stack is not None
    calls, op = [0], stack.op

    def counted(*args):
        calls[0] += 1
        return op(*args)

    stack.op = counted
    return calls


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def base(request, tmp_path_factory, tokenizer):
    """A tiny random model (qwen2: with q/k/v bias) and two random adapters on all linear modules."""
    directory = tmp_path_factory.mktemp(f"stack-{request.param}")
    hf = make_model(directory / "base", tokenizer, request.param)
    adapters = [make_adapter(hf, directory / f"a{i}", seed=1 + i, r=4 + 4 * i) for i in range(2)]
    return directory / "base", adapters


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_steps_match_the_layer_by_layer_forward_bit_for_bit(base, dtype):
    if dtype == "bfloat16" and not can_pack(torch.device("cpu"), torch.bfloat16):
        pytest.skip("no native bf16 matmuls here: bf16 weights are not packed, the stack does not apply")
    from adapters.ref import LoRARequest

    model_dir, adapter_paths = base
    loras = [None, LoRARequest("a0", adapter_paths[0]), LoRARequest("a1", adapter_paths[1])]
    stacked, layered = make_llm(model_dir, True, dtype), make_llm(model_dir, False, dtype)
    assert layered.engine.runner.model.model.decode_stack is None
    calls = count_calls(stacked)
    token_ids = prompts(stacked.engine.runner.arch.vocab_size)[:6]
    requests = [{"prompt_token_ids": ids} for ids in token_ids]
    adapters = [loras[i % 3] for i in range(len(requests))]  # a batch of base, a0 and a1 rows, interleaved
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    outputs = [llm.generate(requests, params, lora_request=adapters) for llm in (stacked, layered)]
    assert calls[0] >= 11  # every step after the prompts' is a decode step through the stack
    for ours, theirs in zip(*outputs, strict=True):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        assert ours.outputs[0].logprobs == theirs.outputs[0].logprobs  # the same floats: the same hidden states


def test_prefill_and_mixed_steps_keep_the_layer_by_layer_path(base):
    model_dir, _ = base
    llm = make_llm(model_dir, True)
    calls = count_calls(llm)
    token_ids = prompts(llm.engine.runner.arch.vocab_size)[:3]
    llm.generate([{"prompt_token_ids": ids} for ids in token_ids], SamplingParams(max_tokens=1, ignore_eos=True))
    assert calls[0] == 0  # prompts only: no decode step


def test_the_stack_is_left_out_where_its_kernels_do_not_cover_the_model(base, tmp_path, tokenizer):
    model_dir, _ = base
    assert make_llm(model_dir, True).engine.runner.model.model.decode_stack is not None
    assert make_llm(model_dir, True, attention_backend="torch").engine.runner.model.model.decode_stack is None
    assert make_llm(model_dir, True, lora_backend="torch").engine.runner.model.model.decode_stack is None
    make_model(tmp_path / "qwen3", tokenizer, "qwen3")  # q/k norm: no C++ path for it
    assert make_llm(tmp_path / "qwen3", True).engine.runner.model.model.decode_stack is None
