"""Benchmarks, each a `loraplex bench <name>` command (its module's docstring has its options and what it prints).

Offline, no HTTP: `engine` (engine.py, vs transformers), `lora` (lora.py, multi-LoRA vs peft, or a given model such as
the demo), `fairness` (fairness.py: two tenants under fcfs and fair), `peer` (peer.py: against vLLM-CPU in one window,
as ratios), `gpu` (gpu.py and gpu_check.sh: the Triton kernels and the engine on a CUDA device), `cpu-lora`
(cpu_lora.py: the C++ LoRA kernels alone), `head` (head.py: the screened greedy head on and off in one engine, paired).
Over the real HTTP API: `serve`, `sweep`, `latency` (the server against the offline engine; TTFT and TPOT by
concurrency) and `replicas` (replicas.py: Ray Serve's multiplexed routing).

workload.py         prompts, output lengths, the adapter of each request (popularity law), arrival times
client.py           the target server: /v1/models, one streamed request timed (TTFT, E2E, tokens)
runner.py           one run: every request sent on schedule, bounded in concurrency and time, with tqdm
metrics.py          records -> summary (throughputs, percentiles, per adapter, errors)
report.py           the terminal table and the result JSON
plots.py            PNGs: latency CDFs, throughput and latency against the number of adapters
random_adapters.py  random PEFT LoRA adapters for a base model's config (no weights downloaded)
admin.py            registering and deleting adapters through the admin API
serve.py            `loraplex bench serve` (main)
sweep.py            `loraplex bench sweep` (main)
tokenizer.py        the small BPE of the random-weight models
peer_workload.py    the peer comparison's workload file, read by both drivers
offline_driver.py   loraplex's side of a peer comparison, in a process of its own
vllm_driver.py      vLLM's side, run with the vLLM venv's Python
server_process.py   `loraplex serve` in a subprocess, on 127.0.0.1
background_load.py  busy processes beside a benchmark (`--background-load`, at `--background-nice`)
process_group.py    drivers in process groups of their own, killed whole when they end
idle_check.py       the other processes that keep the machine busy, named before a comparison starts
RESULTS.md          every measurement window so far (the README's "Benchmarks" summarises the latest)
"""


class BenchError(RuntimeError):
    """A problem the user must fix (bad option, unreachable server, too few adapters); main prints it and exits."""
