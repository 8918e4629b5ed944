"""`loraplex bench engine --profile` (bench/engine.py): where a run's time goes, by the part of a step each op is."""

from __future__ import annotations

import pytest

from bench.engine import op_category, profile_steps, split_steps
from engine.llm import LLM
from tests.hf_models import make_model


def test_each_profiled_op_lands_in_the_part_of_the_step_it_is():
    category = {
        name: op_category(name)
        for name in (
            "loraplex::decode_layers_cpu",
            "loraplex::packed_linear_cpu",
            "aten::addmm",
            "mkldnn::_linear_pointwise",
            "loraplex::lora_add_cpu",
            "loraplex::lora_shrink_cpu",
            "loraplex::paged_decode_attention",
            "aten::index_copy_",
            "loraplex::add_rms_norm_cpu",
            "loraplex::greedy_tokens_cpu",
        )
    }
    assert category["loraplex::decode_layers_cpu"].startswith("decode steps' layers")  # not "other ops"
    assert {category[n] for n in ("loraplex::packed_linear_cpu", "aten::addmm", "mkldnn::_linear_pointwise")} == {
        "matmul (prefill's linear layers, the LM head)"
    }
    assert category["loraplex::lora_add_cpu"] == category["loraplex::lora_shrink_cpu"]
    assert category["loraplex::lora_add_cpu"].startswith("LoRA")
    assert category["loraplex::paged_decode_attention"] == category["aten::index_copy_"]
    assert category["loraplex::paged_decode_attention"].startswith("attention")
    assert category["loraplex::add_rms_norm_cpu"] == category["loraplex::greedy_tokens_cpu"]
    assert category["loraplex::add_rms_norm_cpu"].startswith("other torch ops")


@pytest.mark.usefixtures("require_cpu_kernel")
def test_a_profiled_run_counts_the_decode_stack_as_the_decode_steps_layers(tmp_path, tokenizer):
    make_model(tmp_path / "base", tokenizer, "llama")
    llm = LLM(model=str(tmp_path / "base"), device="cpu", dtype="float32", num_kv_blocks=64, decode_stack=True)
    profile = profile_steps(llm, [[5, 6, 7, 8], [9, 10, 11]], output_len=4)
    layers = op_category("loraplex::decode_layers_cpu")
    assert profile[layers] > 0  # the decode steps went through the stack, and were counted as such
    assert profile[op_category("loraplex::packed_linear_cpu")] > 0  # the prefill's linears and every LM head
    assert 0 < profile[layers] < profile["wall"]


@pytest.mark.usefixtures("require_cpu_kernel")
def test_the_host_split_times_each_part_of_the_step_within_the_run(tmp_path, tokenizer):
    from engine.model_runner import ModelRunner

    make_model(tmp_path / "base", tokenizer, "llama")
    llm = LLM(model=str(tmp_path / "base"), device="cpu", dtype="float32", num_kv_blocks=64, decode_stack=True)
    execute = ModelRunner.__dict__["execute"]
    split = split_steps(llm, [[5, 6, 7, 8], [9, 10, 11]], output_len=4)
    parts, calls = split["seconds"], split["calls"]
    assert split["steps"] == calls["LLMEngine.step"] == 4  # both prompts in one step, then three decode steps
    assert calls["DecodeStack.__call__"] == 3  # the decode steps
    assert parts["LLMEngine.step"] <= parts["wall"]
    assert parts["ModelRunner.execute"] <= parts["LLMEngine.step"]
    assert 0 < parts["DecodeStack.__call__"] < parts["ModelRunner.execute"]  # the decode steps' layers, inside it
    assert 0 < parts["ModelRunner._prepare"] < parts["ModelRunner.execute"]
    assert parts["Scheduler.schedule"] > 0 and parts["LLMEngine._commit"] > 0
    assert "ModelRunner._step_lora_meta" not in parts  # no adapter: no LoRA meta
    assert ModelRunner.__dict__["execute"] is execute  # the methods are restored afterwards
