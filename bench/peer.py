"""`loraplex bench peer`: loraplex against vLLM-CPU on the same offline workload, in one window, as ratios.

    loraplex bench peer [--vllm-venv /tmp/peers/vllm-venv] [--threads 2] [--background-load 1 [--background-duty 0.5]
                        [--background-nice 10] [--versus-idle]]
                        [--modes base,lora] [--adapters 8] [--model DIR --lora NAME=PATH ...]
                        [--max-loras 16 --max-cpu-loras 32]      (fewer adapter rows than adapters)
                        [--dtype bfloat16]                       (both engines; float32 by default)
                        [--pairs 3]                              (loraplex's paired LoRA / base; 0: none)
                        [--turns 4]                              (loraplex / vLLM from runs taking turns; 0: none)
    loraplex bench peer --demo [...]      (the embedded demo's SmolLM2, as an HF directory, and its adapters)

Default workload (W1 of ../shared/peers): the random 56M Llama of `bench engine`, K=8 random rank-8 adapters on
all seven linear modules, 64 requests of 128 random prompt ids, 64 greedy output tokens each (ignore_eos), each
request's adapter drawn uniformly; one untimed warm-up, then --runs timed runs with fresh prompts; the median
counts. Each system runs in its own process (python -m bench.offline_driver; VENV/bin/python
bench/vllm_driver.py), the two interleaved mode by mode, with --threads threads each (vLLM's bound to cores
0..threads-1) and --background-load busy processes running beside both the whole time (each busy
--background-duty of every 10 ms: 1, all the time, by default; each in a session of its own at --background-nice,
0 by default: the drivers' priority); with --versus-idle every system and mode also runs on the idle machine first,
before the busy processes start, and what each keeps of its idle speed is printed (loaded / idle, the same threads).
vLLM is never installed here: without --vllm-venv only loraplex runs.

Then loraplex's own LoRA / base once more, from --pairs pairs of one-run processes, base and LoRA back to back (the
first of each pair taking turns), the median of the pairs' ratios: the mode-by-mode runs lie minutes apart, and on a
host whose speed drifts by 20% in minutes their ratio read 0.78 where pairs read 0.98 (2026-11-27, Zen 3).
With --turns N, each mode's loraplex / vLLM once more from N rounds of one-run processes of both systems, the first
of each round taking turns, the median of the rounds' ratios: on a host whose speed drifted by half in minutes
(2026-11-28, Intel Xeon with AMX) two `bench peer` runs read W1's base at 1.68x and 0.95x, rounds at 1.16-1.32x.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

from bench import BenchError
from bench.background_load import background_load, check_background_load
from bench.idle_check import warn_if_busy
from bench.peer_workload import PeerWorkload
from bench.process_group import run_in_group
from engine.cpu_threads import usable_cores

REPO_ROOT = Path(__file__).resolve().parent.parent
MODES = ("base", "lora")
PAIRED = "loraplex lora/base (paired)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraplex bench peer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-venv", type=Path, help="a virtual environment with vllm (CPU) installed")
    parser.add_argument("--vllm-preload", help="LD_PRELOAD for vLLM (default: the venv's libiomp5 and a tcmalloc)")
    parser.add_argument("--threads", type=int, default=usable_cores(), help="per system (%(default)s)")
    parser.add_argument(
        "--fixed-threads", action="store_true", help="loraplex keeps --threads under load (default: adapts)"
    )
    parser.add_argument("--background-load", type=int, default=0, help="busy processes beside (%(default)s)")
    parser.add_argument(
        "--background-duty", type=float, default=1.0, help="share of the time each one is busy (%(default)s)"
    )
    parser.add_argument(
        "--background-nice",
        type=int,
        default=0,
        help="their nice, 0-19: 0 the drivers' priority, 10 a batch job's (%(default)s)",
    )
    parser.add_argument(
        "--versus-idle", action="store_true", help="also run on the idle machine first: loaded / idle ratios"
    )
    parser.add_argument("--modes", default="base,lora", help="base, lora or both (%(default)s)")
    add_model_options(parser)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3, help="timed runs per system and mode (%(default)s)")
    parser.add_argument("--max-loras", type=int, help="adapter rows in each engine (default: one per adapter)")
    parser.add_argument("--max-cpu-loras", type=int, help="adapters in host memory (default: every adapter)")
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="both engines' (%(default)s)"
    )
    parser.add_argument(
        "--pairs", type=int, default=3, help="loraplex base / LoRA pairs of one-run processes (%(default)s; 0: none)"
    )
    parser.add_argument(
        "--turns", type=int, default=0, help="rounds of loraplex and vLLM taking turns, per mode (%(default)s: none)"
    )
    parser.add_argument(
        "--regex", help="hold every output to this regex, both engines (structured outputs), e.g. '[A-Za-z ,.]+'"
    )
    parser.add_argument("--skip-loraplex", action="store_true", help="vLLM only")
    parser.add_argument("--json", type=Path, default=Path("bench-results/peer.json"))
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    try:
        return compare(args)
    except BenchError as e:
        raise SystemExit(f"loraplex bench peer: {e}") from None


def compare(args: argparse.Namespace) -> dict:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise BenchError(f"--modes takes {' and '.join(MODES)}, got {args.modes!r}")
    if args.threads < 1:
        raise BenchError(f"--threads must be positive, got {args.threads}")
    vllm_python = vllm_interpreter(args.vllm_venv) if args.vllm_venv else None
    if any(n is not None and n < 1 for n in (args.max_loras, args.max_cpu_loras)):
        raise BenchError("--max-loras and --max-cpu-loras must be positive")
    if args.pairs < 0 or args.turns < 0:
        raise BenchError(f"--pairs and --turns must be 0 or more, got {args.pairs} and {args.turns}")
    if args.turns and (vllm_python is None or args.skip_loraplex):
        raise BenchError("--turns has loraplex and vLLM take turns: it needs --vllm-venv and loraplex's runs")
    try:  # before the model is built: a bad setting fails at once
        check_background_load(args.background_load, args.background_duty, args.background_nice)
    except ValueError as e:
        raise BenchError(str(e)) from None
    if args.versus_idle and not args.background_load:
        raise BenchError("--versus-idle compares runs beside --background-load busy processes with idle ones")
    workload = PeerWorkload(
        args.num_prompts,
        args.input_len,
        args.output_len,
        args.runs,
        max_loras=args.max_loras,
        max_cpu_loras=args.max_cpu_loras,
        dtype=args.dtype,
        regex=args.regex,
    )
    pairs: list[dict[str, float]] = []
    turns: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="loraplex-peer-") as tmp:
        model, adapters, rank = prepare_model(args, Path(tmp))
        workload_file = workload.write(Path(tmp) / "workload.json", model, adapters, rank)
        busy_before = warn_if_busy()
        idle_results = run_modes(modes, args, workload_file, vllm_python) if args.versus_idle else []
        with background_load(args.background_load, args.background_duty, args.background_nice):
            results = run_modes(modes, args, workload_file, vllm_python)
            paired = not args.skip_loraplex and set(modes) == set(MODES) and bool(adapters)
            if paired or args.turns:
                pair_file = replace(workload, runs=1).write(Path(tmp) / "pair-workload.json", model, adapters, rank)
                pairs = run_pairs(pair_file, args) if paired else []
                turns = run_turns(modes, pair_file, args, vllm_python) if args.turns else []
    summary = summarize(results, args, workload, pairs, idle_results, turns)
    summary["busy_before"] = busy_before
    print_summary(summary)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary, indent=2))
    print(f"saved {args.json}")
    return summary


def vllm_interpreter(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not python.exists():
        raise BenchError(f"--vllm-venv {venv}: no bin/python there")
    check = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True)
    if check.returncode:
        raise BenchError(f"--vllm-venv {venv}: vllm does not import there ({check.stderr.strip().splitlines()[-1]})")
    return python


def add_model_options(parser: argparse.ArgumentParser, adapters: int = 8) -> None:
    """What `prepare_model` reads: a model and its adapters, or K random rank-R adapters on the random 56M Llama (or
    its one-layer cut, --tiny)."""
    parser.add_argument("--model", type=Path, help="a model directory instead of the random 56M Llama")
    parser.add_argument("--lora", action="append", default=[], metavar="NAME=PATH", help="an adapter of --model")
    parser.add_argument("--adapters", type=int, default=adapters, help="K random adapters (%(default)s)")
    parser.add_argument("--rank", type=int, default=8, help="of the random adapters (%(default)s)")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="the random Llama cut to one layer of width 64: the engine costs next to nothing, so a server's "
        "figures (its event loop's CPU a token) are the gateway's own",
    )


def prepare_model(args: argparse.Namespace, tmp: Path) -> tuple[Path, list[tuple[str, str]], int]:
    """(model directory, [(adapter name, path)], max rank): the given model and adapters, or random ones."""
    if args.model and args.tiny:
        raise BenchError("--tiny cuts the random Llama down; it does not apply to a --model")
    if args.model:
        from adapters.ref import parse_lora_module

        try:
            adapters = [parse_lora_module(spec, flag="--lora")[:2] for spec in args.lora]
        except ValueError as e:
            raise BenchError(str(e)) from None
        return args.model, adapters, max([adapter_rank(Path(p)) for _, p in adapters], default=args.rank)
    from bench.engine import MODEL_56M, MODEL_TINY, build_model
    from bench.lora import make_adapters

    hf_model = build_model(tmp / "base", config=MODEL_TINY if args.tiny else MODEL_56M)
    loras = make_adapters(hf_model, tmp, args.adapters, args.rank) if args.adapters else []
    return tmp / "base", [(lora.adapter_id, lora.path) for lora in loras], args.rank


def adapter_rank(path: Path) -> int:
    return int(json.loads((path / "adapter_config.json").read_text())["r"])


def run_modes(modes: list[str], args: argparse.Namespace, workload_file: Path, vllm_python: Path | None) -> list[dict]:
    """Each mode's run of each system, interleaved mode by mode."""
    results = []
    for mode in modes:
        if not args.skip_loraplex:
            results.append(run_loraplex(workload_file, mode, args.threads, args.fixed_threads))
        if vllm_python:
            results.append(run_vllm(vllm_python, args, workload_file, mode))
    return results


def run_loraplex(workload_file: Path, mode: str, threads: int, fixed_threads: bool = False) -> dict:
    command = [sys.executable, "-m", "bench.offline_driver", "--workload", str(workload_file)]
    command += ["--threads", str(threads)] + (["--no-lora"] if mode == "base" else [])
    command += ["--fixed-threads"] if fixed_threads else []
    return run_driver(command, dict(os.environ), "loraplex", mode)


def run_pairs(pair_file: Path, args: argparse.Namespace) -> list[dict[str, float]]:
    """--pairs pairs of loraplex runs, base and LoRA back to back, one run per process, the first of each pair
    taking turns (so a steady drift favours neither mode): [{mode: output tok/s}] per pair."""
    pairs = []
    for i in range(args.pairs):
        order = MODES if i % 2 == 0 else MODES[::-1]
        runs = {mode: run_loraplex(pair_file, mode, args.threads, args.fixed_threads) for mode in order}
        pairs.append({mode: runs[mode]["output_tok_s"] for mode in MODES})
    return pairs


def run_turns(modes: list[str], pair_file: Path, args: argparse.Namespace, vllm_python: Path) -> list[dict]:
    """--turns rounds per mode of one-run processes of loraplex and vLLM, the first of each round taking turns:
    [{"mode": mode, "loraplex": output tok/s, "vllm": output tok/s}] per round."""

    def run_one(system: str, mode: str) -> float:
        if system == "loraplex":
            return run_loraplex(pair_file, mode, args.threads, args.fixed_threads)["output_tok_s"]
        return run_vllm(vllm_python, args, pair_file, mode)["output_tok_s"]

    turns = []
    for mode in modes:
        for i in range(args.turns):
            order = ("loraplex", "vllm") if i % 2 == 0 else ("vllm", "loraplex")
            turns.append({"mode": mode, **{system: run_one(system, mode) for system in order}})
    return turns


def turns_by_mode(turns: Sequence[dict]) -> dict[str, list[dict]]:
    """The --turns rounds of each mode that has any, in mode order."""
    return {mode: rounds for mode in MODES if (rounds := [turn for turn in turns if turn["mode"] == mode])}


def run_vllm(python: Path, args: argparse.Namespace, workload_file: Path, mode: str) -> dict:
    command = [str(python), str(REPO_ROOT / "bench" / "vllm_driver.py"), "--workload", str(workload_file)]
    command += ["--threads-bind", f"0-{args.threads - 1}" if args.threads > 1 else "0"]
    command += ["--no-lora"] if mode == "base" else []
    env = dict(os.environ)
    preload = args.vllm_preload if args.vllm_preload is not None else default_vllm_preload(args.vllm_venv)
    if preload:
        env["LD_PRELOAD"] = preload
    return run_driver(command, env, "vllm", mode)


def default_vllm_preload(venv: Path) -> str:
    """The Intel OpenMP runtime vLLM-CPU ships, and tcmalloc where one lies in or beside the venv (its docs'
    recommendation); empty when neither is found."""
    found = [venv / "lib" / "libiomp5.so"] if (venv / "lib" / "libiomp5.so").exists() else []
    tcmalloc = sorted(venv.parent.glob("**/libtcmalloc_minimal.so.4"))
    return ":".join(str(p) for p in tcmalloc[:1] + found)


def run_driver(command: list, env: dict, system: str, mode: str) -> dict:
    print(f"[{time.strftime('%H:%M:%S')}] {system} {mode}: {' '.join(map(str, command))}", flush=True)
    proc = run_in_group(command, env, REPO_ROOT, timeout_s=3600)  # vLLM's engine core and worker die with it
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise BenchError(f"the {system} driver failed (exit {proc.returncode}):\n{tail}")
    result = json.loads(lines[-1])
    result.update(system_name=system, mode=mode)
    result["wall_s"] = statistics.median(result["walls_s"])
    result["output_tok_s"] = result["output_tokens"] / result["wall_s"]
    print(f"    {result['output_tok_s']:.1f} tok/s (runs {', '.join(f'{w:.2f}' for w in result['walls_s'])} s)")
    if any(len(sizes) > 1 for sizes in result.get("team_sizes", [])):  # the governor resized the team mid-run
        print(f"    cpu threads by run: {', '.join(' -> '.join(map(str, sizes)) for sizes in result['team_sizes'])}")
    return result


def summarize(
    results: list[dict],
    args: argparse.Namespace,
    workload: PeerWorkload,
    pairs: Sequence[dict[str, float]] = (),
    idle_results: Sequence[dict] = (),
    turns: Sequence[dict] = (),
) -> dict:
    """`results` beside the busy processes (if any); `idle_results` the same runs on the idle machine before them."""
    tok_s = {(r["system_name"], r["mode"]): r["output_tok_s"] for r in results}
    ratios = {}
    for mode in MODES:
        if ("loraplex", mode) in tok_s and ("vllm", mode) in tok_s:
            ratios[f"loraplex/vllm {mode}"] = tok_s["loraplex", mode] / tok_s["vllm", mode]
    for system in ("loraplex", "vllm"):
        if (system, "lora") in tok_s and (system, "base") in tok_s:
            ratios[f"{system} lora/base"] = tok_s[system, "lora"] / tok_s[system, "base"]
    if pairs:
        ratios[PAIRED] = statistics.median(pair["lora"] / pair["base"] for pair in pairs)
    for mode, rounds in turns_by_mode(turns).items():
        ratios[taking_turns(mode)] = statistics.median(turn["loraplex"] / turn["vllm"] for turn in rounds)
    for r in idle_results:
        key = (r["system_name"], r["mode"])
        if key in tok_s:
            ratios[f"{key[0]} loaded/idle {key[1]}"] = tok_s[key] / r["output_tok_s"]
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{usable_cores()} usable cores",
        "threads": args.threads,
        "background_load": args.background_load,
        "background_duty": args.background_duty,
        "background_nice": args.background_nice,
        "loraplex_threads": "fixed" if args.fixed_threads else "adaptive",
        "workload": {**asdict(workload), "adapters": len(args.lora) if args.model else args.adapters},
        "results": results,
        "idle_results": list(idle_results),  # with --versus-idle: the same runs before the busy processes started
        "pairs": list(pairs),  # [{mode: output tok/s}]: loraplex's base and LoRA runs back to back
        "turns": list(turns),  # [{"mode", "loraplex", "vllm"}]: one-run processes of both systems taking turns
        "ratios": ratios,
    }


def print_summary(summary: dict) -> None:
    load = f"{summary['background_load']} busy process(es)"
    if summary["background_load"] and summary["background_duty"] < 1:
        load += f", {100 * summary['background_duty']:.0f}% of the time"
    if summary["background_load"] and summary["background_nice"]:
        load += f", at nice {summary['background_nice']}"
    print(f"\nthreads {summary['threads']}, background load {load}")
    if summary["workload"].get("regex"):
        print(f"every output held to the regex {summary['workload']['regex']!r} (structured outputs)")
    print(f"{'system':<12}{'mode':<6}{'tok/s':>10}{'median s':>10}")
    for r in summary["results"]:
        print(f"{r['system_name']:<12}{r['mode']:<6}{r['output_tok_s']:>10.1f}{r['wall_s']:>10.2f}")
    for r in summary.get("idle_results", []):
        print(f"{r['system_name']:<12}{r['mode']:<6}{r['output_tok_s']:>10.1f}{r['wall_s']:>10.2f}  idle")
    for name, value in summary["ratios"].items():
        print(f"{name:<34}{value:>6.2f}")
    if summary["pairs"]:
        ratios = ", ".join(f"{p['lora']:.1f}/{p['base']:.1f}" for p in summary["pairs"])
        print(f"  {PAIRED}: the median of lora/base tok/s {ratios}")
    for mode, rounds in turns_by_mode(summary.get("turns", [])).items():
        ratios = ", ".join(f"{turn['loraplex']:.1f}/{turn['vllm']:.1f}" for turn in rounds)
        print(f"  {taking_turns(mode)}: the median of loraplex/vllm tok/s {ratios}")


def taking_turns(mode: str) -> str:
    return f"loraplex/vllm {mode} (taking turns)"


if __name__ == "__main__":
    main()
