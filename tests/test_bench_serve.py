"""`loraplex bench serve | sweep` (bench) against a real socket on 127.0.0.1.

The server here is tests/openai_stub_server.py, a stand-in that streams canned tokens; `check_result` is
written to be reused unchanged against a live loraplex server.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread
from transformers import AutoConfig

from adapters.base_spec import BaseModelSpec
from adapters.lora_weights import load_lora
from bench import serve, sweep
from bench.client import Target, list_models
from bench.workload import (
    WorkloadOptions,
    arrival_times,
    build_requests,
    choose_adapters,
    parse_popularity,
    synthetic_prompt,
)
from tests.hf_models import make_model
from tests.openai_stub_server import StubServer

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SUMMARY_KEYS = {
    "num_adapters",
    "adapters",
    "base_model",
    "duration_s",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "ttft_ms",
    "tpot_ms",
    "e2e_ms",
    "errors",
    "per_adapter",
    "requests",
}


def check_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE, path
    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100, path


def check_result(result_json: Path, num_prompts: int, counts: list[int]) -> dict:
    """The result file's schema, each run's request records, and every PNG it names; returns the parsed JSON."""
    result = json.loads(result_json.read_text())
    assert set(result) == {"config", "runs", "plots"}
    assert "api_key" not in result["config"] and "admin_key" not in result["config"]
    assert [run["num_adapters"] for run in result["runs"]] == counts
    for run in result["runs"]:
        assert set(run) == SUMMARY_KEYS
        assert run["completed"] + run["failed"] == len(run["requests"]) == num_prompts
        for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
            assert set(run[key]) == {"mean", "p50", "p90", "p99", "max"}
        if run["completed"]:
            assert 0 < run["ttft_ms"]["p50"] <= run["e2e_ms"]["p50"]
            assert run["request_throughput"] > 0 and run["output_throughput"] > 0
        assert sum(row["requests"] for row in run["per_adapter"].values()) == num_prompts
        for record in run["requests"]:
            if record["ok"]:
                assert 0 < record["ttft_s"] <= record["e2e_s"] and record["output_tokens"] > 0
    assert result["plots"]
    for png in result["plots"]:
        check_png(Path(png))
    return result


def run_serve(url: str, tmp_path: Path, *options: str) -> dict:
    argv = ["--url", url, "--result-dir", str(tmp_path), "--result-json", "out.json", "--disable-tqdm", *options]
    serve.main(argv)
    return json.loads((tmp_path / "out.json").read_text())


def test_two_adapters_zipf_all_at_once(tmp_path, capsys):
    with StubServer(api_key="user-key") as stub:
        options = ["--api-key", "user-key", "--num-prompts", "16", "--output-len", "5", "--input-len", "12"]
        run_serve(stub.url, tmp_path, *options, "--adapters", "2", "--popularity", "zipf:1.5")
    result = check_result(tmp_path / "out.json", 16, [2])
    (run,) = result["runs"]
    assert run["completed"] == 16 and run["failed"] == 0 and run["errors"] == []
    assert run["base_model"] == "stub-base" and run["adapters"] == ["stub-a0", "stub-a1"]
    assert run["total_output_tokens"] == 16 * 5 and run["total_input_tokens"] == 16 * 12  # from usage
    per = run["per_adapter"]
    assert set(per) <= {"stub-a0", "stub-a1"} and per["stub-a0"]["requests"] > per.get("stub-a1", {}).get("requests", 0)
    assert max(r["start_s"] for r in run["requests"]) < 0.5  # rate inf: all sent at once
    assert all(r["tpot_s"] > 0 for r in run["requests"])
    body = stub.state.received[0]
    assert body["stream"] and body["ignore_eos"] and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 5 and body["temperature"] == 0 and body["authorization"] == "Bearer user-key"
    out = capsys.readouterr().out
    assert "Successful requests:" in out and "P99 TTFT (ms):" in out and "stub-a0" in out


def test_several_adapter_counts_plot_against_k(tmp_path):
    with StubServer() as stub:
        run_serve(stub.url, tmp_path, "--num-prompts", "9", "--output-len", "3", "--adapters", "0,1,3")
    result = check_result(tmp_path / "out.json", 9, [0, 1, 3])
    assert list(result["runs"][0]["per_adapter"]) == ["stub-base"]
    assert list(result["runs"][1]["per_adapter"]) == ["stub-a0"]
    assert set(result["runs"][2]["per_adapter"]) == {"stub-a0", "stub-a1", "stub-a2"}
    names = sorted(Path(p).name for p in result["plots"])
    assert names == ["out_latency_cdf.png", "out_latency_vs_adapters.png", "out_throughput_vs_adapters.png"]


def test_poisson_arrivals_follow_the_rate(tmp_path):
    gaps = np.diff(arrival_times(4000, 50.0, np.random.default_rng(1)))
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.05) and gaps.std() == pytest.approx(1 / 50, rel=0.1)
    options = WorkloadOptions(num_prompts=15, request_rate=20.0, popularity="uniform", input_len=4, output_len=2)
    schedule = [spec.arrival_s for spec in build_requests(options, "stub-base", ["stub-a0"])]
    assert 0.2 < schedule[-1] < 2.0  # 14 gaps of 1/20 s on average
    with StubServer() as stub:
        start = time.perf_counter()
        run_serve(
            stub.url, tmp_path, "--num-prompts", "15", "--request-rate", "20", "--output-len", "2", "--input-len", "4"
        )
        elapsed = time.perf_counter() - start
    (run,) = json.loads((tmp_path / "out.json").read_text())["runs"]
    assert run["completed"] == 15
    sent = [r["start_s"] for r in run["requests"]]
    assert all(at - 0.01 <= s <= at + 0.5 for s, at in zip(sent, schedule))  # on schedule (loosely)
    assert schedule[-1] <= run["duration_s"] < schedule[-1] + 2.0 and elapsed < schedule[-1] + 5.0


def test_errors_are_counted_and_named(tmp_path):
    with StubServer() as stub:
        options = ["--num-prompts", "6", "--output-len", "2", "--popularity", "distinct"]
        run_serve(stub.url, tmp_path, *options, "--adapter-names", "stub-a0,ghost")
    (run,) = check_result(tmp_path / "out.json", 6, [2])["runs"]
    assert run["completed"] == 3 and run["failed"] == 3
    assert run["errors"] == [{"error": "HTTP 404: The model `ghost` does not exist.", "count": 3}]
    assert run["per_adapter"]["ghost"] == {
        "requests": 3,
        "completed": 0,
        "failed": 3,
        "mean_ttft_ms": None,
        "mean_e2e_ms": None,
        "output_tokens": 0,
    }
    assert all(r["status"] == 404 for r in run["requests"] if r["model"] == "ghost")


def test_per_request_timeout_and_run_time_limit_bound_the_run(tmp_path):
    with StubServer(token_delay_s=0.5) as slow:
        start = time.perf_counter()
        run_serve(slow.url, tmp_path, "--num-prompts", "4", "--output-len", "8", "--timeout", "0.3", "--adapters", "1")
        assert time.perf_counter() - start < 5.0
    (run,) = json.loads((tmp_path / "out.json").read_text())["runs"]
    assert run["failed"] == 4 and run["errors"][0]["error"].startswith("timeout")
    with StubServer() as stub:
        start = time.perf_counter()
        options = ["--num-prompts", "40", "--request-rate", "10", "--max-duration", "0.5", "--output-len", "2"]
        run_serve(stub.url, tmp_path, *options)
        assert time.perf_counter() - start < 5.0
    (run,) = json.loads((tmp_path / "out.json").read_text())["runs"]
    assert run["completed"] > 0 and run["failed"] > 10 and run["completed"] + run["failed"] == 40
    assert "time limit" in run["errors"][0]["error"] and run["duration_s"] < 1.5


def test_max_concurrency_caps_requests_in_flight(tmp_path):
    with StubServer(token_delay_s=0.01) as stub:
        run_serve(stub.url, tmp_path, "--num-prompts", "8", "--output-len", "4", "--max-concurrency", "2")
        assert stub.state.max_in_flight == 2
    (run,) = json.loads((tmp_path / "out.json").read_text())["runs"]
    assert run["completed"] == 8


def test_chat_endpoint_counts_tokens_without_a_usage_chunk(tmp_path):
    with StubServer(include_usage=False) as stub:
        run_serve(
            stub.url, tmp_path, "--endpoint", "chat", "--num-prompts", "3", "--output-len", "4", "--adapters", "1"
        )
        assert stub.state.received[0]["messages"][0]["role"] == "user"
    (run,) = check_result(tmp_path / "out.json", 3, [1])["runs"]
    assert run["completed"] == 3 and run["total_output_tokens"] == 12
    assert all(r["input_tokens"] is None for r in run["requests"])


def test_dataset_prompts_and_output_lengths(tmp_path):
    dataset = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "one two three", "output_len": 2}, {"prompt": "four five"}, {"prompt": "six", "output_len": 5}]
    dataset.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    with StubServer() as stub:
        run_serve(stub.url, tmp_path, "--dataset", str(dataset), "--num-prompts", "5", "--output-len", "3")
    (run,) = json.loads((tmp_path / "out.json").read_text())["runs"]
    assert [r["output_tokens"] for r in run["requests"]] == [2, 3, 5, 2, 3]
    assert [r["input_tokens"] for r in run["requests"]] == [3, 2, 1, 3, 2]


def test_clear_errors_for_bad_options_and_servers(tmp_path):
    with StubServer(api_key="right") as stub:
        with pytest.raises(SystemExit, match=r"--adapters 5 needs 5 adapters, but .* lists 3"):
            serve.main(["--url", stub.url, "--api-key", "right", "--adapters", "5"])
        with pytest.raises(SystemExit, match="HTTP 401: invalid API key"):
            serve.main(["--url", stub.url, "--api-key", "wrong"])
        with pytest.raises(SystemExit, match="--popularity"):
            serve.main(["--url", stub.url, "--api-key", "right", "--popularity", "zipf:-1"])
        url = stub.url
    with pytest.raises(SystemExit, match=r"cannot reach http://127\.0\.0\.1:\d+/v1/models"):
        serve.main(["--url", url, "--timeout", "2"])
    assert not list(tmp_path.iterdir())


def test_popularity_laws():
    rng = np.random.default_rng(0)
    assert choose_adapters("distinct", 7, 3, rng) == [0, 1, 2, 0, 1, 2, 0]
    assert choose_adapters("identical", 4, 3, rng) == [0, 0, 0, 0]
    assert choose_adapters("uniform", 5, 0, rng) == [-1] * 5  # K = 0: the base model
    uniform = np.bincount(choose_adapters("uniform", 6000, 3, rng), minlength=3)
    assert np.allclose(uniform / 6000, 1 / 3, atol=0.03)
    zipf = np.bincount(choose_adapters("zipf:1.0", 11000, 3, rng), minlength=3) / 11000
    assert np.allclose(zipf, np.array([1, 1 / 2, 1 / 3]) / (11 / 6), atol=0.02)
    again = choose_adapters("zipf:1.5", 50, 8, np.random.default_rng(3))
    assert again == choose_adapters("zipf:1.5", 50, 8, np.random.default_rng(3))  # seeded
    assert parse_popularity("zipf:1.5") == 1.5 and parse_popularity("uniform") is None
    for bad in ("zipf", "zipf:0", "zipf:inf", "skewed"):
        with pytest.raises(Exception, match="--popularity"):
            parse_popularity(bad)
    assert math.isclose(arrival_times(3, math.inf, rng)[-1], 0.0)


def test_tokenizer_gives_exact_prompt_lengths(tokenizer):
    rng = np.random.default_rng(0)
    for n in (1, 17, 64):
        prompt = synthetic_prompt(n, 8, rng, tokenizer)
        assert prompt.prompt_len == n == len(tokenizer.encode(prompt.text, add_special_tokens=False))


def test_sweep_registers_random_adapters_that_load_and_cleans_up(tmp_path, tokenizer):
    make_model(tmp_path / "base", tokenizer, "llama")
    adapter_dir, results = tmp_path / "adapters", tmp_path / "results"
    argv = ["--model", str(tmp_path / "base"), "--adapter-dir", str(adapter_dir), "--adapter-counts", "1,2"]
    argv += ["--rank", "4", "--num-prompts", "4", "--output-len", "2", "--disable-tqdm", "--result-dir", str(results)]
    with StubServer(admin_key="adm") as stub:
        with pytest.raises(SystemExit, match="refused the admin key"):
            sweep.main(["--url", stub.url, "--admin-key", "wrong", *argv])
        sweep.main(["--url", stub.url, "--admin-key", "adm", *argv])
        assert stub.state.registered == {} and stub.state.deleted == ["bench-r4-0", "bench-r4-1"]
        assert {b["model"] for b in stub.state.received} == {"bench-r4-0", "bench-r4-1"}
    result = check_result(results / "sweep.json", 4, [1, 2])
    assert result["runs"][1]["adapters"] == ["bench-r4-0", "bench-r4-1"] and result["runs"][1]["failed"] == 0
    check_png(results / "throughput_vs_adapters.png")
    spec = BaseModelSpec.from_hf_config(AutoConfig.from_pretrained(tmp_path / "base"))
    loaded = [load_lora(adapter_dir / f"bench-r4-{i}", spec, max_lora_rank=8) for i in range(2)]
    assert all(lora.rank == 4 and len(lora.target_modules) == 7 for lora in loaded)
    assert len(loaded[0].weights) == 2 * 7 and loaded[0].digest != loaded[1].digest


def test_serve_and_sweep_against_a_live_loraplex_server(tmp_path, tokenizer):
    """The real gateway (tests/gateway_server.py) on a tiny random Llama with three adapters, no stand-in."""
    from tests.gateway_server import ADMIN_KEY, ServerThread, build_tiny, settings_for

    root, _, adapters = build_tiny(tmp_path / "tiny", tokenizer, {"a0": 8, "a1": 8, "a2": 4})
    with ServerThread(settings_for(root, adapters, adapter_root=[str(tmp_path / "sweep")])) as server:
        options = ["--num-prompts", "8", "--input-len", "16", "--output-len", "6", "--timeout", "60"]
        result = run_serve(server.url, tmp_path, *options, "--adapters", "0,3", "--popularity", "zipf:1.2")
        argv = ["--url", server.url, "--admin-key", ADMIN_KEY, "--model", str(root / "base"), "--rank", "4"]
        argv += ["--adapter-dir", str(tmp_path / "sweep"), "--adapter-counts", "1,2", "--result-dir", str(tmp_path)]
        sweep.main([*argv, *options, "--disable-tqdm"])
        listed = [m["id"] for m in list_models(Target(server.url))]
    assert sorted(listed) == ["a0", "a1", "a2", "tiny-llama"]  # the sweep's adapters deleted again
    check_result(tmp_path / "out.json", 8, [0, 3])
    swept = check_result(tmp_path / "sweep.json", 8, [1, 2])
    for run in [*result["runs"], *swept["runs"]]:
        assert run["failed"] == 0 and run["total_output_tokens"] == 8 * 6
    assert list(result["runs"][0]["per_adapter"]) == ["tiny-llama"]
    assert set(result["runs"][1]["per_adapter"]) <= {"a0", "a1", "a2"}
