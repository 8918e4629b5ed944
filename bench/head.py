"""`loraplex bench head`: the screened greedy head (engine/layers/greedy_head.py) on and off in one engine, paired.

    loraplex bench head [--model DIR | --demo] [--dtype float32|bfloat16] [--streams 1,3,8] [--output-len 128]
                        [--input-len 32] [--pairs 7] [--threads 2] [--json F]
    python -m bench.head ...           (the same, without the CLI's gateway imports)

The random 56M Llama of `bench engine` (W1) by default, or a model directory or GGUF file (`--demo`: the embedded
demo's SmolLM2). One engine is built (its runner builds the head the CPU and dtype get, and calibrates it); for each
stream count, `--pairs` pairs of runs of the same greedy requests (`--input-len` random prompt tokens each,
`--output-len` tokens, ignore_eos), one with the runner's head and one without it (the full LM head and the
sampler's argmax), their order alternating from pair to pair so that a host's drift falls on both. Reported: the
median time per output token of each side, the median of the pairs' ratios (screened / full), and whether every
run gave the same tokens (the screen's argmax is the full head's: fp32 exactly; a bf16 model's, the first of its
bf16 ties, but for a sum within float rounding of a bf16 rounding boundary). Time per token is the run's wall time
over its output tokens, prefill included: it tells what the head is worth to a whole request.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.engine import build_model
from engine.llm import LLM
from engine.sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="loraplex bench head", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model directory or GGUF file (default: the random 56M Llama, W1)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--streams", default="1,3,8", help="concurrent requests, comma separated (%(default)s)")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=7, help="paired runs per stream count (%(default)s)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    streams = [int(n) for n in args.streams.split(",") if n.strip()]
    if not streams or min(streams) < 1 or args.pairs < 1 or args.output_len < 1 or args.input_len < 1:
        parser.error("--streams, --pairs, --input-len and --output-len take positive numbers")
    with tempfile.TemporaryDirectory(prefix="loraplex-bench-head-") as tmp:
        model = args.model
        if model is None:
            build_model(Path(tmp) / "w1")
            model = str(Path(tmp) / "w1")
        llm = LLM(model=model, dtype=args.dtype, device="cpu", cpu_threads=args.threads, enable_prefix_caching=False)
        results = {"model": args.model or "W1 (random 56M Llama)", "dtype": args.dtype, "threads": args.threads}
        results |= {"head": describe(llm.engine.runner.greedy_head), "rows": []}
        for n in streams:
            results["rows"].append(measure(llm, n, args))
    print_table(results)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"saved {args.json}")
    return results


def describe(head) -> str:
    """Which screened head the runner built, and its calibration's verdict."""
    if head is None:
        return "none (this CPU, dtype or build gets the full head only)"
    name = type(head).__name__
    if getattr(head, "bf16_logits", False):
        name += " (a bf16 model's)"
    few_rows = getattr(head, "few_rows", head)  # the int8 screen, alone or beside the bf16 one
    if few_rows is not None and hasattr(few_rows, "layout"):
        if few_rows.off:
            name += ", int8 screen off (calibrated: it would not pay)"
        elif few_rows.layout is not None:
            name += f", int8 screen with {few_rows.layout.exact_channels.numel()} channels exact"
    if getattr(head, "max_rows", None) is not None:
        name += f", steps of up to {head.max_rows} rows"
    return name


def measure(llm: LLM, streams: int, args: argparse.Namespace) -> dict:
    """`args.pairs` pairs of runs of `streams` requests, the runner's head on and off in turn."""
    runner = llm.engine.runner
    head = runner.greedy_head
    g = torch.Generator().manual_seed(streams)
    prompts = [
        torch.randint(3, runner.arch.vocab_size, (args.input_len,), generator=g).tolist() for _ in range(streams)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

    def run(screened: bool) -> tuple[float, list[list[int]]]:
        runner.greedy_head = head if screened else None
        try:
            start = time.perf_counter()
            outputs = llm.generate(prompts, params)
            wall = time.perf_counter() - start
        finally:
            runner.greedy_head = head
        return wall, [list(o.outputs[0].token_ids) for o in outputs]

    run(True), run(False)  # warm both paths
    on, off, same = [], [], True
    for pair in range(args.pairs):
        order = (True, False) if pair % 2 == 0 else (False, True)
        walls, tokens = {}, {}
        for screened in order:
            walls[screened], tokens[screened] = run(screened)
        on.append(walls[True])
        off.append(walls[False])
        same = same and tokens[True] == tokens[False]
    per_token = streams * args.output_len
    return {
        "streams": streams,
        "screened_ms_per_token": 1e3 * statistics.median(on) / per_token,
        "full_ms_per_token": 1e3 * statistics.median(off) / per_token,
        "ratio": statistics.median(a / b for a, b in zip(on, off)),
        "pair_ratios": [a / b for a, b in zip(on, off)],
        "same_tokens": same,
    }


def print_table(results: dict) -> None:
    print(f"{results['model']}, {results['dtype']}, {results['threads']} threads; head: {results['head']}")
    print(f"{'streams':>7} {'screened ms/tok':>15} {'full ms/tok':>11} {'screened/full':>13}  same tokens  pairs")
    for row in results["rows"]:
        pairs = " ".join(f"{r:.3f}" for r in row["pair_ratios"])
        print(
            f"{row['streams']:>7} {row['screened_ms_per_token']:>15.3f} {row['full_ms_per_token']:>11.3f} "
            f"{row['ratio']:>13.3f}  {'yes' if row['same_tokens'] else 'NO':>11}  {pairs}"
        )


if __name__ == "__main__":
    main()
