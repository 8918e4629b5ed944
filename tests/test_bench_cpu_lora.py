"""`loraplex bench cpu-lora`: its count of multiply-adds, which its GFMA/s rest on, checked by hand, and a small run
through the real C++ kernels."""

import json

from bench import cpu_lora


def test_multiply_adds_are_the_shrinks_and_expands_math():
    layer = cpu_lora.LayerShape(hidden=8, intermediate=12, q_width=8, kv_width=4)
    modules = layer.modules()
    assert modules == [(8, (8, 4, 4)), (8, (8,)), (8, (12, 12)), (12, (8,))]
    rank, tokens = 2, 3
    shrink = 3 * rank * 8 + 1 * rank * 8 + 2 * rank * 8 + 1 * rank * 12  # S R H_in a module
    expand = rank * (16 + 8 + 24 + 8)  # R H_out a module
    assert cpu_lora.fused_multiply_adds(modules, rank, tokens) == tokens * (shrink + expand)


def test_a_small_run_reports_every_token_count(tmp_path, require_cpu_kernel, capsys):
    out = tmp_path / "cpu_lora.json"
    argv = ["--layers", "1", "--tokens", "1,5", "--adapters", "3", "--repeat", "2", "--threads", "1"]
    results = cpu_lora.main([*argv, "--json", str(out)])
    assert json.loads(out.read_text()) == results
    assert [row["tokens"] for row in results["rows"]] == [1, 5]
    w1 = cpu_lora.LayerShape.of(cpu_lora.CONFIGS["w1"])
    for row in results["rows"]:
        assert row["add_ms"] > 0 and row["shrink_ms"] > 0 and row["expand_ms"] > 0
        assert row["multiply_adds"] == cpu_lora.fused_multiply_adds(w1.modules(), 8, row["tokens"])
        assert abs(row["add_gfma_per_s"] - row["multiply_adds"] / row["add_ms"] / 1e6) < 1e-6 * row["add_gfma_per_s"]
    assert "add GFMA/s" in capsys.readouterr().out
