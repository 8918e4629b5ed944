"""Runs a peer-workload file through loraplex's offline `LLM` and prints one JSON line of timings: loraplex's side
of `loraplex bench peer`, in its own process (its own thread team) like vLLM's driver.

    python -m bench.offline_driver --workload W.json [--threads N] [--no-lora]
"""

from __future__ import annotations

import argparse
import json
import time

from adapters.ref import LoRARequest
from engine.llm import LLM
from engine.sampling_params import SamplingParams, StructuredOutputsParams


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.offline_driver")
    parser.add_argument("--workload", required=True)
    parser.add_argument("--threads", type=int, help="cpu_threads (default: the engine's)")
    parser.add_argument("--no-lora", action="store_true", help="the base model only")
    parser.add_argument("--fixed-threads", action="store_true", help="keep the team at --threads under load")
    args = parser.parse_args(argv)
    with open(args.workload) as f:
        workload = json.load(f)
    adapters = [LoRARequest(name, path) for name, path in workload["adapters"]]
    use_lora = bool(adapters) and not args.no_lora
    llm = LLM(
        model=workload["model"],
        dtype=workload.get("dtype", "float32"),
        device="cpu",
        cpu_threads=args.threads,
        cpu_threads_adapt=not args.fixed_threads,
        max_model_len=workload["max_model_len"],
        max_num_seqs=workload["max_num_seqs"],
        max_num_batched_tokens=max(2048, workload["max_num_seqs"]),
        enable_lora=use_lora,
        max_loras=workload.get("max_loras", max(1, len(adapters))),
        max_cpu_loras=workload.get("max_cpu_loras", max(1, len(adapters))),
        max_lora_rank=workload["max_lora_rank"],
    )
    output_len = workload["output_len"]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    if workload.get("regex"):  # held to it for exactly output_len tokens: EOS banned until then, as in vLLM's driver
        held = StructuredOutputsParams(regex=workload["regex"])
        params = SamplingParams(
            temperature=0.0, max_tokens=output_len, min_tokens=output_len, detokenize=False, structured_outputs=held
        )

    stats = llm.engine.stats

    def run(requests) -> tuple[float, float, int, int]:
        prompts = [ids for ids, _ in requests]
        lora = [adapters[a] for _, a in requests] if use_lora else None
        start, cpu_start, steps_start = time.perf_counter(), time.process_time(), stats.num_steps
        outputs = llm.generate(prompts, params, lora_request=lora)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        return elapsed, cpu, sum(len(o.outputs[0].token_ids) for o in outputs), stats.num_steps - steps_start

    governor = llm.engine.thread_governor  # None where the team is fixed
    run(workload["warmup"])
    walls, cpus, steps, teams, tokens = [], [], [], [], 0
    for requests in workload["runs"]:
        resizes_before = governor.resizes if governor else 0
        elapsed, cpu, tokens, num_steps = run(requests)
        walls.append(elapsed)
        cpus.append(cpu)
        steps.append(num_steps)
        if governor:  # the team's sizes through the run: the one it started with, then each change
            teams.append(list(governor.sizes)[-(governor.resizes - resizes_before + 1) :])
    result = {
        "system": "loraplex",
        "mode": "lora" if use_lora else "base",
        "threads": llm.engine.config.cpu_threads,
        "walls_s": walls,
        "cpu_s": cpus,  # each run's CPU time, every thread of this process (user + system)
        "steps": steps,  # each run's engine steps
        "team_sizes": teams,  # each run's OpenMP team sizes, in order ([] where the team is fixed)
        "output_tokens": tokens,
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
