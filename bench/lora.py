"""Offline multi-LoRA throughput: loraplex with K mixed adapters vs base-only vs transformers + peft.

    loraplex bench lora [--num-prompts 64] [--rank 8] [--threads 2] [--json out.json]
    loraplex bench lora --model PATH --lora NAME=PATH [--lora ...]     (a given model and adapters)
    loraplex bench lora --demo                                          (the embedded demo: SmolLM2 + 3 adapters)

The 56M Llama of `loraplex bench engine`, fp32 on CPU; 64 requests of 128 random prompt tokens and 64 output
tokens (ignore_eos); adapters of rank 8 on all 7 linear modules, each request's drawn uniformly among K.
Rows: loraplex base-only; loraplex K=8 (max_loras=8); peft K=8 as one mixed batch (`adapter_names`) and grouped by
adapter (`set_adapter`); loraplex K=128 with max_loras=16, max_cpu_loras=32, every adapter forgotten before each of
its runs (so each run reads all of them from disk); the same with every adapter kept in host memory
(max_cpu_loras=128, read once before the runs: only the device rows' churn is left); and the base model alone in
K=128's batch shape (max_num_seqs = the mean number of sequences of K=128's decode steps): with 16 rows for ~48
distinct adapters K=128 runs three waves of ~21 sequences, and what the base model alone keeps of its speed in that
shape is about the most K=128 / K=8 can reach. The loraplex rows run interleaved, on engines kept warm alike (until
2026-11-26 each K=128 run built a fresh engine after the others had run: it paid the first touch of its KV pool's
pages, and the machine's drift went into that row alone).
With --model: the same requests on that model (a directory or a GGUF file), base-only and mixed over the
given adapters (one row per adapter in the engine, each request's drawn uniformly); no peft rows.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from adapters.ref import LoRARequest, parse_lora_module
from bench.engine import build_model, workload
from bench.idle_check import warn_if_busy
from engine.llm import LLM
from engine.sampling_params import SamplingParams

K128_ROW = "loraplex K=128 (16 rows, 32 in host memory)"
K128_HOST_ROW = "loraplex K=128 (16 rows, all in host memory)"  # no disk reads: what the rows alone cost
SHAPED_ROW = "loraplex base-only, max_num_seqs"  # + the batch shape: the base model alone in K=128's shape


def make_adapters(hf_model, directory: Path, count: int, rank: int, seed: int = 0) -> list[LoRARequest]:
    """`count` random rank-`rank` adapters on all linear modules, written by peft; one peft model reused."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", init_lora_weights=False)
    peft_model = get_peft_model(hf_model, config)
    g = torch.Generator().manual_seed(seed)
    loras = []
    for i in range(count):
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=g) * 0.02)
        path = directory / f"adapter-{i}"
        peft_model.save_pretrained(str(path))
        loras.append(LoRARequest(f"adapter-{i}", str(path)))
    peft_model.unload()  # the base modules back, unchanged
    return loras


def decode_batch_shape(llm: LLM, after_step: int) -> int:
    """The mean number of sequences of the decode-only steps the engine ran after step `after_step` (its trace)."""
    sizes = [
        len(record.scheduled)
        for record in llm.engine.step_trace
        if record.step > after_step and all(n == 1 for _, n in record.scheduled)
    ]
    return max(1, round(statistics.mean(sizes))) if sizes else 1


def time_loraplex(llm: LLM, prompts, output_len: int, loras) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, lora_request=loras)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
    return elapsed


def time_peft(peft_model, prompts, output_len: int, names: list[str], grouped: bool) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        if grouped:
            for name in sorted(set(names)):
                rows = [p for p, n in zip(prompts, names) if n == name]
                peft_model.set_adapter(name)
                peft_model.generate(input_ids=torch.tensor(rows), max_new_tokens=output_len, do_sample=False)
        else:
            peft_model.generate(
                input_ids=torch.tensor(prompts), max_new_tokens=output_len, do_sample=False, adapter_names=names
            )
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="loraplex bench lora", description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", help="a model directory or GGUF file instead of the random 56M Llama")
    parser.add_argument("--lora", action="append", default=[], metavar="NAME=PATH", help="an adapter of --model")
    parser.add_argument("--skip-peft", action="store_true")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each, interleaved; the median is reported")
    parser.add_argument("--json", type=Path, default=Path("bench-results/lora.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    prompts = workload("fixed", args.num_prompts)
    busy_before = warn_if_busy()
    runs = given_model_runs(args, prompts) if args.model else random_model_runs(args, prompts)
    num_tokens = args.num_prompts * args.output_len
    rows = {name: statistics.median(times) for name, times in runs.items()}
    results = {name: {"seconds": s, "runs_s": runs[name], "tok_s": num_tokens / s} for name, s in rows.items()}
    report(results)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    summary = {"model": args.model or "random 56M Llama", "rank": args.rank, "threads": args.threads, "rows": results}
    summary["busy_before"] = busy_before
    args.json.write_text(json.dumps(summary, indent=2))
    print(f"saved {args.json}")
    return results


def given_model_runs(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, list[float]]:
    """Base-only and a mixed batch over the given adapters, interleaved."""
    if not args.lora:
        raise SystemExit("loraplex bench lora: --model needs at least one --lora NAME=PATH")
    try:
        loras = [LoRARequest(*parse_lora_module(spec, flag="--lora")) for spec in args.lora]
    except ValueError as e:
        raise SystemExit(f"loraplex bench lora: {e}") from None
    rng = random.Random(0)
    mixed = [rng.choice(loras) for _ in prompts]
    common = dict(device="cpu", cpu_threads=args.threads, max_num_seqs=args.num_prompts, enable_prefix_caching=False)
    llm = LLM(model=args.model, enable_lora=True, max_loras=len(loras), max_lora_rank=args.rank, **common)
    time_loraplex(llm, prompts[:4], 4, mixed[:4])  # warm-up
    runs: dict[str, list[float]] = defaultdict(list)
    for _ in range(args.repeat):
        runs["loraplex base-only"].append(time_loraplex(llm, prompts, args.output_len, None))
        runs[f"loraplex K={len(loras)}"].append(time_loraplex(llm, prompts, args.output_len, mixed))
    return runs


def random_model_runs(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, list[float]]:
    rng = random.Random(0)
    runs: dict[str, list[float]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp:
        hf_model = build_model(Path(tmp) / "base")
        loras = make_adapters(hf_model, Path(tmp), 128, args.rank)
        k8 = [rng.choice(loras[:8]) for _ in prompts]
        k128 = [rng.choice(loras) for _ in prompts]
        base = str(Path(tmp) / "base")
        common = dict(
            dtype="float32",
            device="cpu",
            cpu_threads=args.threads,
            max_num_seqs=args.num_prompts,
            enable_prefix_caching=False,
        )
        llm = LLM(model=base, enable_lora=True, max_loras=8, max_lora_rank=args.rank, max_cpu_loras=32, **common)
        churn = LLM(model=base, enable_lora=True, max_loras=16, max_lora_rank=args.rank, max_cpu_loras=32, **common)
        hot = LLM(model=base, enable_lora=True, max_loras=16, max_lora_rank=args.rank, max_cpu_loras=128, **common)
        time_loraplex(llm, prompts[:4], 4, k8[:4])  # warm-up
        time_loraplex(churn, prompts[:4], 4, k128[:4])
        time_loraplex(hot, prompts[:4], 4, k128[:4])
        for lora in loras:
            hot.engine.add_adapter(lora)
        shaped = None  # the base model alone in K=128's batch shape, made once that shape is known
        for _ in range(args.repeat):  # interleaved, so a noisy neighbour or a drifting machine hits all alike
            runs["loraplex base-only"].append(time_loraplex(llm, prompts, args.output_len, None))
            runs["loraplex K=8"].append(time_loraplex(llm, prompts, args.output_len, k8))
            for lora in loras:  # forgotten in every tier: each run reads every adapter cold from disk
                churn.engine.remove_adapter(lora)
            before = churn.engine.stats.num_steps
            runs[K128_ROW].append(time_loraplex(churn, prompts, args.output_len, k128))
            runs[K128_HOST_ROW].append(time_loraplex(hot, prompts, args.output_len, k128))
            if shaped is None:
                shape = decode_batch_shape(churn, before)
                shaped = LLM(model=base, **{**common, "max_num_seqs": shape})
                time_loraplex(shaped, prompts[:4], 4, None)
            runs[f"{SHAPED_ROW} {shaped.engine.config.max_num_seqs}"].append(
                time_loraplex(shaped, prompts, args.output_len, None)
            )
        del llm, churn, hot, shaped
        if not args.skip_peft:
            from peft import PeftModel

            peft_model = PeftModel.from_pretrained(hf_model, loras[0].path, adapter_name=loras[0].adapter_id).eval()
            for lora in loras[1:8]:
                peft_model.load_adapter(lora.path, adapter_name=lora.adapter_id)
            names = [lora.adapter_id for lora in k8]
            for _ in range(args.repeat):
                runs["peft K=8 mixed batch (adapter_names)"].append(
                    time_peft(peft_model, prompts, args.output_len, names, False)
                )
                runs["peft K=8 grouped (set_adapter)"].append(
                    time_peft(peft_model, prompts, args.output_len, names, True)
                )
    return runs


def report(results: dict) -> None:
    print(f"\n{'run':<46}{'tok/s':>10}")
    for name, row in results.items():
        print(f"{name:<46}{row['tok_s']:>10.1f}")
    base = results["loraplex base-only"]["tok_s"]
    mixed = next(name for name in results if name.startswith("loraplex K=") and "128" not in name)
    print(f"\n{mixed.removeprefix('loraplex ')} / base-only: {results[mixed]['tok_s'] / base:.2f}")
    k128, k128_host = results.get(K128_ROW), results.get(K128_HOST_ROW)
    if k128:
        print(f"K=128 / K=8:     {k128['tok_s'] / results['loraplex K=8']['tok_s']:.2f}")
    if k128_host:
        print(f"K=128, all in host memory / K=8: {k128_host['tok_s'] / results['loraplex K=8']['tok_s']:.2f}")
    shaped = next((name for name in results if name.startswith(SHAPED_ROW)), None)
    if shaped:
        print(f"base-only in K=128's batch shape / base-only: {results[shaped]['tok_s'] / base:.2f}")
    peft_best = max((r["tok_s"] for n, r in results.items() if n.startswith("peft")), default=None)
    if peft_best:
        print(f"K=8 / best peft: {results['loraplex K=8']['tok_s'] / peft_best:.2f}")


if __name__ == "__main__":
    main()
