"""`loraplex bench cpu-linear`: a model's body linears alone, kernels/linear's fp32 panels against oneDNN's
prepacked linear, by row count, as figures.

    loraplex bench cpu-linear [--shape w1|smollm2] [--layers N] [--rows 1,8,21,32,64,256,2048] [--repeat 15]
                              [--threads 2] [--warm] [--json F]
    python -m bench.cpu_linear ...       (the same, without the CLI's gateway imports)

Each decoder layer's four GEMMs (qkv, o, gate_up, down; W1's 8 layers by default, `smollm2` the demo's 30 layers of
hidden 576) with random fp32 weights, packed both ways: kernels/linear's panels (what PackedLinear packs where
`engine.cpu_features.panel_linear_wins`) and oneDNN's opaque layout (`mkldnn._reorder_linear_weight`, what it packs
elsewhere). For each row count (a decode step's sequences, or a prefill chunk's tokens): the median time of one pass
over every layer's GEMMs on each side, the two sides taking turns pass by pass, GFLOP/s, and panels / oneDNN. Before
each pass 64 MB are written, so the weights come from memory as a decode step's do; --warm leaves them cached. Both
sides' outputs of the first GEMM are compared first (they differ only in the order of each sum). To compare two
builds of the kernel, run it in each checkout in turn, a few times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.cpu_lora import CONFIGS, FLUSH_BYTES, LayerShape


def gemm_shapes(layer: LayerShape) -> list[tuple[int, int]]:
    """(N, K) of one decoder layer's four linears: qkv, o, gate_up, down."""
    return [(sum(slices), h_in) for h_in, slices in layer.modules()]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="loraplex bench cpu-linear", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(CONFIGS), default="w1")
    parser.add_argument("--layers", type=int, help="decoder layers (default: the shape's)")
    parser.add_argument("--rows", default="1,8,21,32,64,256,2048", help="row counts, comma separated")
    parser.add_argument("--repeat", type=int, default=15, help="passes timed per side and figure; the median")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warm", action="store_true", help="no cache flush before a pass")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from kernels.linear import panel_linear_ops

    ops = panel_linear_ops()
    if ops is None:
        raise SystemExit("kernels/linear is not built here (no compiler, no AVX2 / FMA, or LORAPLEX_CPU_KERNELS=0)")
    if not torch.backends.mkldnn.is_available():
        raise SystemExit("this torch has no oneDNN to compare against")
    torch.set_num_threads(args.threads)
    layer, default_layers = LayerShape.of(CONFIGS[args.shape]), CONFIGS[args.shape]["num_hidden_layers"]
    layers = args.layers or default_layers
    shapes = gemm_shapes(layer)
    g = torch.Generator().manual_seed(0)
    weights = [[torch.randn(n, k, generator=g) * k**-0.5 for n, k in shapes] for _ in range(layers)]  # [N, K] each
    sides = {
        "panels": ([[ops.pack_linear_weight_cpu(w) for w in ws] for ws in weights], ops.packed_linear_cpu),
        "onednn": (
            [[torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in ws] for ws in weights],
            lambda x, packed, bias: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], ""),
        ),
    }
    results = {
        "shape": args.shape,
        "layers": layers,
        "gemms": [list(s) for s in shapes],
        "threads": args.threads,
        "warm": args.warm,
        "rows": [measure(sides, shapes, args, int(m)) for m in args.rows.split(",")],
    }
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
        print(f"saved {args.json}")
    return results


def measure(sides: dict, shapes: list[tuple[int, int]], args: argparse.Namespace, rows: int) -> dict:
    """Each side's median ms of a pass over every layer's GEMMs at `rows` rows, GFLOP/s, panels / oneDNN, and the
    largest difference of the two sides' outputs of the first GEMM."""
    g = torch.Generator().manual_seed(rows)
    xs = [torch.randn(rows, k, generator=g) for _, k in shapes]  # [M, K] each
    first = [call(xs[0], packed[0][0], None) for packed, call in sides.values()]
    row: dict = {"rows": rows, "max_abs_diff": (first[0] - first[1]).abs().max().item() if rows else 0.0}

    def one_pass(side: str) -> float:
        packed, call = sides[side]
        start = time.perf_counter()
        for layer_weights in packed:
            for x, weight in zip(xs, layer_weights):
                call(x, weight, None)
        return time.perf_counter() - start

    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8)
    times: dict[str, list[float]] = {side: [] for side in sides}
    for side in sides:
        one_pass(side)  # warm-up
    for i in range(args.repeat):
        for side in list(sides) if i % 2 == 0 else list(sides)[::-1]:  # taking turns: a drift favours neither
            if not args.warm:
                flush.add_(1)
            times[side].append(one_pass(side))
    flops = 2 * rows * sum(n * k for n, k in shapes) * len(sides["panels"][0])
    for side, measured in times.items():
        row[f"{side}_ms"] = statistics.median(measured) * 1e3
        row[f"{side}_gflop_per_s"] = flops / (row[f"{side}_ms"] * 1e-3) / 1e9
    row["panels_over_onednn"] = row["panels_ms"] / row["onednn_ms"]
    return row


def print_table(results: dict) -> None:
    print(
        f"{results['shape']}: {results['layers']} layers x 4 GEMMs (N x K: "
        f"{', '.join(f'{n}x{k}' for n, k in results['gemms'])}), fp32, {results['threads']} threads, "
        f"{'warm' if results['warm'] else 'caches flushed before each pass'}"
    )
    print(f"{'rows':>6} {'panels ms':>10} {'oneDNN ms':>10} {'panels GF/s':>12} {'oneDNN GF/s':>12} {'ratio':>6}")
    for row in results["rows"]:
        print(
            f"{row['rows']:>6} {row['panels_ms']:>10.3f} {row['onednn_ms']:>10.3f} {row['panels_gflop_per_s']:>12.1f} "
            f"{row['onednn_gflop_per_s']:>12.1f} {row['panels_over_onednn']:>6.2f}"
        )


if __name__ == "__main__":
    main()
