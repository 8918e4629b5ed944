"""Benchmarks. Offline (no HTTP): `loraplex bench engine` (engine.py, vs transformers) and `loraplex bench lora`
(lora.py, multi-LoRA vs peft, or a given model such as the demo); over the real HTTP API: `loraplex bench serve`
and `loraplex bench sweep`; `loraplex bench fairness` (fairness.py: two tenants under fcfs and fair).
tokenizer.py trains the small BPE of the random-weight models.

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
"""


class BenchError(RuntimeError):
    """A problem the user must fix (bad option, unreachable server, too few adapters); main prints it and exits."""
