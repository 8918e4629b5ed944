"""Offline engine throughput: loraplex vs transformers' own `generate` on the same requests, in one run.

    loraplex bench engine [--num-prompts 64] [--output-len 64] [--threads 2] [--json out.json] [--profile]
                          [--host-split]

A random Llama of about 56M parameters (hidden 512, 8 layers, 8 heads / 4 KV heads, intermediate 1408,
vocab 32000), fp32 on CPU. Workloads: `fixed` (every prompt 128 random tokens) and `varied` (prompt lengths
uniform in [16, 512]); every request generates exactly `output_len` tokens (ignore_eos), all submitted at once.
transformers runs all requests as one left-padded batch. `--profile` adds where loraplex's time goes by op
(torch.profiler), `--host-split` by part of the step, each part's wall time over one more run (bench/host_split.py:
scheduling, the runner's inputs and metadata, the decode stack, the LM head, the commit; a part holds its callees).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams

MODEL_56M = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=2048,
)
# The same Llama cut to one layer of width 64 (the same vocabulary and tokenizer): its engine costs next to nothing,
# so what a server spends on it is its gateway's own (HTTP, SSE, accounting, the event loop).
MODEL_TINY = dict(
    MODEL_56M, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2
)


def build_model(directory: Path, seed: int = 0, config: dict = MODEL_56M):
    """A random Llama of `config` (the 56M one by default) saved to `directory` with its tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.tokenizer import save_tokenizer

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**config)).eval()
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens (ignore_eos)
    model.generation_config.pad_token_id = 0
    model.save_pretrained(directory)
    save_tokenizer(directory, config["vocab_size"])  # one text per id: streams show their first token
    return model


def workload(name: str, num_prompts: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [128] * num_prompts if name == "fixed" else torch.randint(16, 513, (num_prompts,), generator=g).tolist()
    return [torch.randint(3, MODEL_56M["vocab_size"], (n,), generator=g).tolist() for n in lengths]


def run_loraplex(llm: LLM, prompts: list[list[int]], output_len: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
    return elapsed


def run_transformers(model, prompts: list[list[int]], output_len: int) -> float:
    longest = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), longest, dtype=torch.long)  # [B, L], left padded
    attention_mask = torch.zeros_like(input_ids)
    for i, p in enumerate(prompts):
        input_ids[i, longest - len(p) :] = torch.tensor(p)
        attention_mask[i, longest - len(p) :] = 1
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=output_len, do_sample=False
        )
    elapsed = time.perf_counter() - start
    assert out.shape[1] == longest + output_len
    return elapsed


def op_category(name: str) -> str:
    """Which part of a step a profiled op is: the decode stack (every layer of a decode step in one C++ op, so its
    matmuls and attention are not told apart), matmuls, attention, LoRA, or the other ops."""
    op = name.rsplit("::", 1)[-1]  # without its namespace (loraplex:: holds "lora")
    if "decode_layers" in op:
        return "decode steps' layers (one C++ op: linears, attention, norms, LoRA)"
    if "lora" in op:
        return "LoRA (shrink, expand, add), outside the decode stack"
    if "linear" in name or name in ("aten::addmm", "aten::mm", "aten::matmul", "aten::bmm"):
        return "matmul (prefill's linear layers, the LM head)"
    if "attention" in name or name in ("aten::index_select", "aten::index_copy_"):
        return "attention (sdpa, K/V gather and store)"
    return "other torch ops (norms, rotary, activations, sampling)"


def profile_steps(llm: LLM, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    """Where a run's time goes, by category of op (self CPU time, seconds)."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(prompts, params)
    wall = time.perf_counter() - start
    categories: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        categories[op_category(event.key)] += event.self_cpu_time_total / 1e6
    torch_total = sum(categories.values())
    categories["python + scheduling (wall - torch)"] = max(wall - torch_total, 0.0)
    categories["wall"] = wall
    return dict(categories)


def split_steps(llm: LLM, prompts: list[list[int]], output_len: int) -> dict[str, dict]:
    """One run's wall time by part of the step: {"seconds": {"Class.method": s, ..., "wall": s}, "calls": {part:
    calls}} (each part's time holds its callees'), and the run's engine "steps"."""
    from bench.host_split import timed_parts

    seconds: dict[str, float] = {}
    calls: dict[str, int] = {}
    steps_before = llm.engine.stats.num_steps
    with timed_parts(seconds, calls):
        seconds["wall"] = run_loraplex(llm, prompts, output_len)
    return {"seconds": seconds, "calls": calls, "steps": llm.engine.stats.num_steps - steps_before}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="loraplex bench engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each; the median is reported")
    parser.add_argument("--workloads", default="fixed,varied")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--profile", action="store_true", help="also print where loraplex's time goes, by op")
    parser.add_argument("--host-split", action="store_true", help="also by part of the step (one more run)")
    parser.add_argument("--json", type=Path, default=Path("bench-results/engine.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    results: dict = {
        "model": MODEL_56M,
        "threads": args.threads,
        "output_len": args.output_len,
        "workloads": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        hf_model = build_model(Path(tmp))
        # no prefix caching: repeated runs of the same prompts must not get cheaper
        llm = LLM(
            model=tmp,
            dtype="float32",
            device="cpu",
            cpu_threads=args.threads,
            max_num_seqs=args.num_prompts,
            enable_prefix_caching=False,
        )
        run_loraplex(llm, workload("fixed", 4, seed=99), 4)  # warm-up
        for name in args.workloads.split(","):
            prompts = workload(name, args.num_prompts)
            num_tokens = len(prompts) * args.output_len
            row = {"prompt_tokens": sum(map(len, prompts)), "output_tokens": num_tokens}
            ours, theirs = [], []
            for _ in range(args.repeat):  # interleaved, so a noisy neighbour hits both alike
                ours.append(run_loraplex(llm, prompts, args.output_len))
                if not args.skip_transformers:
                    theirs.append(run_transformers(hf_model, prompts, args.output_len))
            row["loraplex_s"] = statistics.median(ours)
            row["loraplex_runs_s"] = ours
            row["loraplex_tok_s"] = num_tokens / row["loraplex_s"]
            if theirs:
                row["transformers_s"] = statistics.median(theirs)
                row["transformers_runs_s"] = theirs
                row["transformers_tok_s"] = num_tokens / row["transformers_s"]
                row["speedup"] = row["loraplex_tok_s"] / row["transformers_tok_s"]
            results["workloads"][name] = row
            if args.profile:
                row["profile_s"] = profile_steps(llm, prompts, args.output_len)
            if args.host_split:
                row["host_split"] = split_steps(llm, prompts, args.output_len)
    print_table(results)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    print(f"saved {args.json}")
    return results


def print_table(results: dict) -> None:
    print(f"\n{'workload':<10}{'prompt tok':>12}{'loraplex tok/s':>16}{'transformers tok/s':>20}{'ratio':>8}")
    for name, row in results["workloads"].items():
        hf = row.get("transformers_tok_s")
        ratio = f"{row['speedup']:.2f}x" if hf else "-"
        hf_s = f"{hf:.1f}" if hf else "-"
        print(f"{name:<10}{row['prompt_tokens']:>12}{row['loraplex_tok_s']:>16.1f}{hf_s:>20}{ratio:>8}")
        for cat, secs in row.get("profile_s", {}).items():
            print(f"    {cat:<56}{secs:8.2f} s")
        if "host_split" in row:
            split = row["host_split"]
            print(f"    by part of the step, one run of {split['steps']} steps (a part holds its callees):")
            for part, secs in split["seconds"].items():
                calls = split["calls"].get(part)
                each = f"{secs / calls * 1e3:9.3f} ms a call, {calls} calls" if calls else ""
                print(f"    {part:<40}{secs * 1e3:9.1f} ms {each}")


if __name__ == "__main__":
    main()
