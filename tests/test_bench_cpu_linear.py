"""`loraplex bench cpu-linear`: the GEMM shapes it times, checked by hand, and a small run through the real panel
kernel and oneDNN, whose outputs it compares."""

import json

from bench import cpu_linear, cpu_lora


def test_the_gemms_are_a_layers_qkv_o_gate_up_and_down():
    layer = cpu_lora.LayerShape(hidden=8, intermediate=12, q_width=8, kv_width=4)
    assert cpu_linear.gemm_shapes(layer) == [(16, 8), (8, 8), (24, 8), (8, 12)]  # (N, K)
    w1 = cpu_lora.LayerShape.of(cpu_lora.CONFIGS["w1"])
    assert cpu_linear.gemm_shapes(w1) == [(1024, 512), (512, 512), (2816, 512), (512, 1408)]


def test_a_small_run_reports_every_row_count(tmp_path, require_cpu_kernel, capsys):
    out = tmp_path / "cpu_linear.json"
    argv = ["--layers", "1", "--rows", "1,15,33", "--repeat", "2", "--threads", "1"]
    results = cpu_linear.main([*argv, "--json", str(out)])
    assert json.loads(out.read_text()) == results
    assert [row["rows"] for row in results["rows"]] == [1, 15, 33]
    flops_per_row = 2 * sum(n * k for n, k in results["gemms"])
    for row in results["rows"]:
        assert row["max_abs_diff"] < 1e-3  # the same linear both ways, summed in another order
        assert row["panels_ms"] > 0 and row["onednn_ms"] > 0
        expected = flops_per_row * row["rows"] / (row["panels_ms"] * 1e-3) / 1e9
        assert abs(row["panels_gflop_per_s"] - expected) < 1e-6 * expected
        assert abs(row["panels_over_onednn"] - row["panels_ms"] / row["onednn_ms"]) < 1e-9
    assert "oneDNN GF/s" in capsys.readouterr().out
