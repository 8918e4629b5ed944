"""Runs a peer-workload file through vLLM's offline `LLM` and prints one JSON line of timings.

Standalone on purpose: `loraplex bench peer` runs it with the python of a vLLM virtual environment the user
installed (it imports only the standard library and vllm, never loraplex), so loraplex never depends on vLLM.

    VENV/bin/python bench/vllm_driver.py --workload W.json [--threads-bind 0-1] [--no-lora]

The workload file (bench/peer_workload.py writes it) holds the model directory, the adapters, the output
length and one list of requests per timed run (fresh prompt ids each run, so no run hits a prefix cache).
"""

import argparse
import json
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", required=True)
    parser.add_argument("--threads-bind", help="VLLM_CPU_OMP_THREADS_BIND, e.g. 0-1 (default: vLLM's auto)")
    parser.add_argument("--no-lora", action="store_true", help="the base model (enable_lora off)")
    parser.add_argument("--kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    args = parser.parse_args()
    with open(args.workload) as f:
        workload = json.load(f)
    if args.threads_bind:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.threads_bind
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_gib))
    for name, value in (("VLLM_HOST_IP", "127.0.0.1"), ("VLLM_NO_USAGE_STATS", "1"), ("HF_HUB_OFFLINE", "1")):
        os.environ.setdefault(name, value)

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    adapters = workload["adapters"]  # [[name, path], ...]
    use_lora = bool(adapters) and not args.no_lora
    options = dict(
        model=workload["model"],
        dtype=workload.get("dtype", "float32"),
        seed=0,
        max_model_len=workload["max_model_len"],
        max_num_seqs=workload["max_num_seqs"],
    )
    if use_lora:
        options.update(
            enable_lora=True,
            max_loras=workload.get("max_loras", len(adapters)),
            max_cpu_loras=workload.get("max_cpu_loras", len(adapters)),
            max_lora_rank=workload["max_lora_rank"],
        )
    llm = LLM(**options)
    loras = [LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters)]
    output_len = workload["output_len"]
    held = None
    if workload.get("regex"):  # structured outputs (vLLM >= 0.11's StructuredOutputsParams)
        from vllm.sampling_params import StructuredOutputsParams

        held = StructuredOutputsParams(regex=workload["regex"])
    params = SamplingParams(
        temperature=0.0,
        max_tokens=output_len,
        min_tokens=output_len,
        ignore_eos=True,
        detokenize=False,
        structured_outputs=held,
    )

    def run(requests):
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in requests]
        lora = [loras[a] for _, a in requests] if use_lora else None
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)

    run(workload["warmup"])  # every adapter loaded once, every code path traced
    walls, tokens = [], 0
    for requests in workload["runs"]:
        elapsed, tokens = run(requests)
        walls.append(elapsed)
    print(
        json.dumps(
            {
                "system": f"vllm {vllm.__version__}",
                "mode": "lora" if use_lora else "base",
                "walls_s": walls,
                "output_tokens": tokens,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
