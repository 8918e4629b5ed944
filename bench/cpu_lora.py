"""`loraplex bench cpu-lora`: the C++ CPU LoRA kernels alone (kernels/lora/csrc/lora_cpu.cpp), as figures.

    loraplex bench cpu-lora [--shape w1|smollm2] [--tokens 1,8,64,256,2048] [--adapters 8] [--rank 8]
                            [--dtype float32] [--repeat 9] [--threads 2] [--warm] [--json F]
    python -m bench.cpu_lora ...       (the same, without the CLI's gateway imports)

The LoRA modules of a model's decoder layers, W1's by default (8 layers of hidden 512, intermediate 1408, 8 query
and 4 kv heads of 64: qkv 512 -> 512 + 256 + 256, o 512 -> 512, gate_up 512 -> 2 x 1408, down 1408 -> 512;
`smollm2`: the demo's 30 layers of hidden 576), each with a stack of `--adapters` random rank-`--rank` adapters,
the tokens on the rows in turn (token t on row t mod N, as a decode batch's adapters are spread). For each token
count: the median time of one pass over every module's lora_add (shrink and expand in one call: what a LoRA layer
makes), and of its shrinks and its expands as calls of their own. Before each pass 64 MB are written, so the
adapters' weights come from memory as a decode step's do (the step's base weights pass through the caches between
two LoRA adds); --warm leaves them cached. GFMA/s counts the adds' multiply-adds, T (S R H_in + R H_out) a module.
Each call also pays ~3-4 us of Python dispatch that the decode stack (one C++ op a step) does not: at one token
that is most of the figure. To compare two builds, run it in each checkout in turn, a few times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.engine import MODEL_56M
from engine.config import DTYPES

FLUSH_BYTES = 64 << 20


@dataclass(frozen=True)
class LayerShape:
    """One decoder layer's LoRA modules: (H_in, output slices) of qkv, o, gate_up and down."""

    hidden: int
    intermediate: int
    q_width: int  # query heads x head_dim
    kv_width: int  # kv heads x head_dim

    @classmethod
    def of(cls, config: dict) -> LayerShape:
        """The layer of a Llama config (transformers' keys)."""
        head_dim = config["hidden_size"] // config["num_attention_heads"]
        return cls(
            hidden=config["hidden_size"],
            intermediate=config["intermediate_size"],
            q_width=config["num_attention_heads"] * head_dim,
            kv_width=config["num_key_value_heads"] * head_dim,
        )

    def modules(self) -> list[tuple[int, tuple[int, ...]]]:
        return [
            (self.hidden, (self.q_width, self.kv_width, self.kv_width)),
            (self.q_width, (self.hidden,)),
            (self.hidden, (self.intermediate, self.intermediate)),
            (self.intermediate, (self.hidden,)),
        ]


# SmolLM2-135M's decoder (the demo's model), in the same keys as bench.engine's W1 (MODEL_56M)
SMOLLM2_135M = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3
)
CONFIGS = {"w1": MODEL_56M, "smollm2": SMOLLM2_135M}


def fused_multiply_adds(modules: list[tuple[int, tuple[int, ...]]], rank: int, tokens: int) -> int:
    """The multiply-adds of one lora_add pass over `modules` for `tokens` tokens: shrink S R H_in, expand R H_out."""
    return tokens * sum(len(slices) * rank * h_in + rank * sum(slices) for h_in, slices in modules)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="loraplex bench cpu-lora", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(CONFIGS), default="w1")
    parser.add_argument("--layers", type=int, help="decoder layers (default: the shape's)")
    parser.add_argument("--tokens", default="1,8,64,256,2048", help="token counts, comma separated")
    parser.add_argument("--adapters", type=int, default=8, help="adapter rows in each module's stack")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--repeat", type=int, default=9, help="passes timed per figure; the median is reported")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warm", action="store_true", help="no cache flush before a pass")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from kernels import cpu_native

    if cpu_native.load() is None:
        raise SystemExit("the C++ CPU kernels are not built here (no compiler, or LORAPLEX_CPU_KERNELS=0)")
    torch.set_num_threads(args.threads)
    layer, default_layers = LayerShape.of(CONFIGS[args.shape]), CONFIGS[args.shape]["num_hidden_layers"]
    modules = layer.modules() * (args.layers or default_layers)
    token_counts = [int(t) for t in args.tokens.split(",")]
    results = {
        "shape": args.shape,
        "layer": asdict(layer),
        "layers": args.layers or default_layers,
        "adapters": args.adapters,
        "rank": args.rank,
        "dtype": args.dtype,
        "threads": args.threads,
        "warm": args.warm,
        "rows": [measure(modules, args, tokens) for tokens in token_counts],
    }
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
        print(f"saved {args.json}")
    return results


def measure(modules: list[tuple[int, tuple[int, ...]]], args: argparse.Namespace, tokens: int) -> dict:
    """The median ms of a pass over every module's lora_add, shrink and expand for `tokens` tokens, and GFMA/s."""
    from kernels.lora import LoraMeta, cpu_ops

    dtype = DTYPES[args.dtype]
    g = torch.Generator().manual_seed(tokens)
    meta = LoraMeta.build([t % args.adapters for t in range(tokens)], "cpu", max_rank=args.rank, torch_layouts=False)
    stacks = []
    for h_in, slices in modules:
        width = len(slices) * args.rank
        lora_a = (torch.randn(args.adapters, width, h_in, generator=g) * h_in**-0.5).to(dtype)  # [N, S R, H_in]
        lora_b = (torch.randn(args.adapters, sum(slices), args.rank, generator=g) * 0.1).to(dtype)  # [N, H_out, R]
        x = torch.randn(tokens, h_in, generator=g).to(dtype)  # [T, H_in]
        y = torch.zeros(tokens, sum(slices), dtype=dtype)  # [T, H_out]
        z = torch.zeros(tokens, width, dtype=dtype)  # [T, S R]
        stacks.append((slices, lora_a, lora_b, x, y, z))
    ops = {
        "add": lambda s: cpu_ops.add_lora(s[4], s[3], s[1], s[2], meta, s[0]),
        "shrink": lambda s: cpu_ops.lora_shrink(s[5], s[3], s[1], meta),
        "expand": lambda s: cpu_ops.lora_expand(s[4], s[5], s[2], meta, s[0]),
    }
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8)
    row: dict = {"tokens": tokens}
    for name, op in ops.items():
        for stack in stacks:  # warm-up: the expand's transposed copy of each B is made on its first call
            op(stack)
        times = []
        for _ in range(args.repeat):
            if not args.warm:
                flush.add_(1)
            start = time.perf_counter()
            for stack in stacks:
                op(stack)
            times.append(time.perf_counter() - start)
        row[f"{name}_ms"] = statistics.median(times) * 1e3
    row["multiply_adds"] = fused_multiply_adds(modules, args.rank, tokens)
    row["add_gfma_per_s"] = row["multiply_adds"] / (row["add_ms"] * 1e-3) / 1e9
    return row


def print_table(results: dict) -> None:
    print(
        f"{results['shape']}: {results['layers']} layers x 4 modules, {results['adapters']} adapters of rank "
        f"{results['rank']}, {results['dtype']}, {results['threads']} threads, "
        f"{'warm' if results['warm'] else 'caches flushed before each pass'}"
    )
    print(f"{'tokens':>7} {'add ms':>9} {'shrink ms':>10} {'expand ms':>10} {'add GFMA/s':>11}")
    for row in results["rows"]:
        print(
            f"{row['tokens']:>7} {row['add_ms']:>9.3f} {row['shrink_ms']:>10.3f} {row['expand_ms']:>10.3f} "
            f"{row['add_gfma_per_s']:>11.1f}"
        )


if __name__ == "__main__":
    main()
