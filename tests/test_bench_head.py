"""`loraplex bench head`: a small run through a real engine, its screened head on and off in turn: every stream count
reported, the ratio the median of its pairs, the tokens compared, and the head that ran named."""

import json

import pytest
import torch

from bench import head as bench_head
from engine.layers.greedy_head import Int8ScreenedGreedyHead
from kernels.sampling import int8_logits_available
from tests.hf_models import make_model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_small_run_pairs_the_screened_head_with_the_full_one(dtype, tmp_path, tokenizer, require_cpu_kernel, capsys):
    if dtype == "bfloat16" and not int8_logits_available():
        pytest.skip("a bf16 model's screened head needs the one-pass int8 GEMV (AVX512-VNNI or AVX2)")
    make_model(tmp_path / "model", tokenizer, "llama")
    out = tmp_path / "head.json"
    argv = ["--model", str(tmp_path / "model"), "--dtype", dtype, "--streams", "1,2", "--output-len", "5"]
    results = bench_head.main([*argv, "--input-len", "6", "--pairs", "3", "--threads", "1", "--json", str(out)])
    assert json.loads(out.read_text()) == results
    assert [row["streams"] for row in results["rows"]] == [1, 2]
    for row in results["rows"]:
        assert len(row["pair_ratios"]) == 3 and row["ratio"] == sorted(row["pair_ratios"])[1]
        assert row["screened_ms_per_token"] > 0 and row["full_ms_per_token"] > 0
        assert row["same_tokens"]
    if dtype == "bfloat16":
        assert results["head"].startswith(Int8ScreenedGreedyHead.__name__ + " (a bf16 model's)")
    assert "screened/full" in capsys.readouterr().out


def test_the_head_is_described_with_its_calibration(require_cpu_kernel):
    g = torch.Generator().manual_seed(0)
    head = Int8ScreenedGreedyHead.for_bf16_model(torch.randn(20, 16, generator=g).bfloat16())
    head.gather(torch.randn(8, 16, generator=g))  # calibrated: 20 tokens are too few for the screen to pay
    assert head.off
    assert bench_head.describe(head) == (
        "Int8ScreenedGreedyHead (a bf16 model's), int8 screen off (calibrated: it would not pay), steps of up to 3 rows"
    )
    assert bench_head.describe(None).startswith("none")
