"""`loraplex bench gpu` without a GPU: its kernel sections run interpreted on tiny shapes, so the script the GPU
session runs is checked here; its byte counts, which its bandwidth figures rest on, are checked by hand."""

import json

import torch

from bench import gpu
from engine.llm_engine import LLMEngine
from engine.scheduler import Scheduler


def test_byte_counts_are_the_fewest_bytes_each_kernel_must_move():
    shape = gpu.AttentionShape(batch=3, context=40, num_heads=8, num_kv_heads=2, head_dim=16, block_size=16)
    kv = 3 * 40 * 2 * 16 * 2  # K and V of every seq's context
    q_out = 3 * 8 * 16 * 2  # q read, out written
    assert gpu.attention_bytes(shape, 2) == (kv + q_out) * 2 + 3 * 3 * 4  # + 3 block ids a seq
    lora = gpu.LoraShape(tokens=5, adapters=2, rank=4, hidden_in=64, output_slices=(64, 32))
    shrink = 2 * 8 * 64 + 5 * (64 + 8)  # A of the adapters in use, x read, z written
    expand = 2 * 96 * 4 + 5 * (8 + 2 * 96)  # B of the adapters in use, z read, y read and written
    assert gpu.lora_bytes(lora, 4) == {"shrink": shrink * 4, "expand": expand * 4}


def test_smoke_run_of_the_kernel_sections(tmp_path, monkeypatch):
    out = tmp_path / "gpu.json"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    results = gpu.main(["--sections", "attention,lora", "--dtype", "float32", "--json", str(out)])
    assert results["failures"] == {}
    assert json.loads(out.read_text())["attention"][0]["rel_error"] < 1e-5
    (attention,) = results["attention"]
    assert attention["bytes"] == gpu.attention_bytes(gpu.SMOKE_ATTENTION[0], 4) and attention["triton_ms"] > 0
    (lora,) = results["lora"]
    assert lora["rel_error_of_delta"] < 1e-5 and lora["shrink_ms"] > 0 and lora["expand_ms"] > 0
    assert lora["expand_ms_unaligned"] > 0 and lora["expand_ms_graph_unaligned"] > 0
    assert lora["fused_pays"] and all(lora[f"{way}_ms_{meta}"] > 0 for way in ("fused", "two_launches")
                                      for meta in ("plain", "graph"))  # fmt: skip
    assert [row["meta"] for row in lora["split_k"]] == ["plain", "graph"]
    assert all(row[f"{op}_{parts}"] > 0 for row in lora["split_k"] for op in ("shrink", "expand")
               for parts in gpu.SPLIT_PARTS)  # fmt: skip
    assert all(row[f"stages_{stages}_group_{group}"] > 0 for row in lora["expand_groups"] for stages in (2, 3)
               for group in gpu.EXPAND_GROUPS)  # fmt: skip


def test_kernel_totals_sum_the_named_kernels_of_a_profile():
    from types import SimpleNamespace

    events = [
        SimpleNamespace(key="_shrink_kernel", count=4, self_device_time_total=40.0),  # µs, as torch.profiler's
        SimpleNamespace(key="_expand_kernel", count=2, self_device_time_total=50.0),
        SimpleNamespace(key="nvjet_gemm", count=9, self_device_time_total=900.0),
    ]
    assert gpu.kernel_totals(events, gpu.LORA_KERNELS) == {
        "_shrink_kernel": {"calls": 4, "device_s": 40e-6, "us_per_call": 10.0},
        "_expand_kernel": {"calls": 2, "device_s": 50e-6, "us_per_call": 25.0},
    }


def test_smoke_run_of_the_engine_section_pairs_interleaved_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["--sections", "engine", "--dtype", "float32", "--unfused", "--host-split"]
    results = gpu.main([*argv, "--json", str(tmp_path / "gpu.json")])
    assert results["failures"] == {}
    (row,) = results["engine"]
    assert len(row["lora-unfused"]["walls_s"]) == 6 and row["fused_over_unfused"] > 0
    for mode in ("base", "lora"):  # the host's parts, each within the step that calls it (no CUDA graph on a CPU)
        split = row[mode]["host_split_s"]
        assert "CUDAGraph.replay" not in split and 0 < split["Scheduler.schedule"] < split["LLMEngine.step"]
        assert 0 < split["ModelRunner.execute"] < split["LLMEngine.step"] < max(row[mode]["walls_s"])
    assert not hasattr(LLMEngine.step, "__wrapped__") and not hasattr(Scheduler.schedule, "__wrapped__")
    base, lora = row["base"]["walls_s"], row["lora"]["walls_s"]
    assert len(base) == len(lora) == 6
    assert row["lora_over_base"] == gpu.paired_ratio(lora, base) > 0
    for mode, walls in (("base", base), ("lora", lora)):  # every run's steps timed, within its wall, by kind
        steps = row[mode]["steps_s"]
        assert set(steps) == {"prefill", "decode"} and 0 < steps["prefill"] + steps["decode"] < max(walls)
    assert set(row["lora_extra_s"]) == {"prefill steps", "decode steps", "outside steps"}
    assert row["max_num_batched_tokens"] == 2048  # the engine's default on a CPU


def test_step_kind_tells_decode_steps_from_steps_with_prompt_tokens():
    assert gpu.step_kind([("a", 1), ("b", 1)]) == "decode"
    assert gpu.step_kind([("a", 16), ("b", 1)]) == "prefill"


def test_paired_ratio_is_the_median_of_each_pairs_ratio():
    assert gpu.paired_ratio([2.0, 1.0, 4.0], [1.0, 1.0, 1.0]) == 0.5  # pairs 0.5, 1.0, 0.25
    assert gpu.paired_ratio([1.0, 3.0, 2.0], [2.0, 3.0, 1.0]) == 1.0  # pairs 2.0, 1.0, 0.5
