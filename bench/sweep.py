"""`loraplex bench sweep`: throughput against the number of adapters served at once (S-LoRA's headline plot).

    loraplex bench sweep --url http://127.0.0.1:8000 --admin-key KEY --model /models/base \\
        --adapter-dir /srv/adapters/bench --adapter-counts 1,8,32,128,512 --rank 8

Writes max(K) random rank-r adapters for the base model's config (`--model`, the served model's directory)
into --adapter-dir, a directory the server reads (under its allowed adapter roots; the default, a temporary
directory, only works for a server on this machine), registers them through the admin API, runs
`bench serve`'s workload once per K over the first K of them, then deletes what it registered (unless
--keep-adapters). Writes sweep.json, throughput_vs_adapters.png, latency_vs_adapters.png, latency_cdf.png.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from bench import BenchError
from bench.admin import AdminClient
from bench.client import base_and_adapters, list_models
from bench.random_adapters import ALL_MODULES, DTYPES, AdapterShape, write_random_adapters
from bench.report import print_runs_by_count, write_result
from bench.serve import (
    add_common_options,
    check_common_options,
    draw_plots,
    parse_counts,
    result_config,
    run_once,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loraplex bench sweep",
        description=__doc__.split("\n\n")[0],
    )
    sweep = parser.add_argument_group("sweep")
    sweep.add_argument("--model", type=Path, required=True, help="the served base model's directory (its config)")
    sweep.add_argument("--adapter-dir", type=Path, help="where adapters are written; default a temporary directory")
    sweep.add_argument("--adapter-counts", default="1,8,32,128,512", help="the K of each run (%(default)s)")
    sweep.add_argument("--rank", type=int, default=8, help="of every adapter (%(default)s)")
    sweep.add_argument("--lora-alpha", type=float, help="default 2 * rank")
    sweep.add_argument("--target-modules", default=",".join(ALL_MODULES), help="(%(default)s)")
    sweep.add_argument("--adapter-dtype", default="float16", choices=list(DTYPES), help="(%(default)s)")
    sweep.add_argument("--admin-key", help="sent as Authorization: Bearer to /admin/adapters")
    sweep.add_argument("--keep-adapters", action="store_true", help="leave them registered and on disk")
    add_common_options(parser)
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    try:
        return sweep(args)
    except BenchError as e:
        raise SystemExit(f"loraplex bench sweep: {e}") from None


def sweep(args: argparse.Namespace) -> dict:
    target, workload, limits = check_common_options(args)
    counts = parse_counts(args.adapter_counts)
    if args.rank < 1:
        raise BenchError("--rank must be >= 1")
    base, _ = base_and_adapters(list_models(target), args.base_model)
    shape = AdapterShape(
        rank=args.rank,
        lora_alpha=args.lora_alpha or 2.0 * args.rank,
        target_modules=tuple(m.strip() for m in args.target_modules.split(",") if m.strip()),
        dtype=args.adapter_dtype,
    )
    adapter_dir = (args.adapter_dir or Path(tempfile.mkdtemp(prefix="loraplex-sweep-"))).resolve()
    admin = AdminClient(target.url, args.admin_key)
    registered: list[str] = []
    try:
        paths = write_random_adapters(args.model, adapter_dir, max(counts), shape, not args.disable_tqdm)
        names = [p.name for p in paths]
        for path in paths:
            if admin.register(path.name, str(path), f"loraplex bench sweep: random rank-{args.rank} adapter"):
                registered.append(path.name)
        runs = [run_once(workload, target, limits, base, names[:k], i) for i, k in enumerate(counts)]
    finally:
        if not args.keep_adapters:
            _clean_up(admin, registered, adapter_dir if args.adapter_dir is None else None)
        admin.close()
    return _write_outputs(args, base, runs, adapter_dir)


def _clean_up(admin: AdminClient, registered: list[str], temporary_dir: Path | None) -> None:
    """Best effort: a failure here is reported, never raised over the error that may have brought us here."""
    for name in registered:
        try:
            admin.delete(name)
        except BenchError as e:
            print(f"warning: {e}", file=sys.stderr)
    if temporary_dir is not None:
        shutil.rmtree(temporary_dir, ignore_errors=True)


def _write_outputs(args: argparse.Namespace, base: str, runs: list[dict], adapter_dir: Path) -> dict:
    print_runs_by_count(runs)
    pngs = [] if args.no_plots else draw_plots(runs, args.result_dir, vs_adapters=True)
    config = {**result_config(args, base), "adapter_dir": str(adapter_dir)}
    path = write_result(args.result_dir / "sweep.json", config, runs, pngs)
    print(f"saved {path}" + "".join(f"\nsaved {p}" for p in pngs))
    if args.keep_adapters:
        print(f"adapters kept, registered and in {adapter_dir}")
    return {"config": config, "runs": runs, "plots": [str(p) for p in pngs], "result_json": path}


if __name__ == "__main__":
    main()
