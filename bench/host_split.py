"""Where an engine step's host time goes: `timed_parts` adds up the wall time of each of a step's parts (scheduling,
the runner's inputs and metadata, filling the decode graphs' buffers and copying them, the graph replay or the CPU's
decode stack, the forward, the LM head or the sampler, committing the tokens) while inside, for `bench gpu
--host-split` and `bench engine --host-split` (CPU).

On a GPU a W1 step is mostly the host's (on an H200, 2026-11-28: ~1.9 ms a decode step, 0.58 of it the graph on the
device), so what LoRA adds to the host's parts shows here, where torch.profiler's tables only show the launches. On
a CPU it shows what runs between the kernels: on a 2-core Zen 4 (2026-11-28) it found the LoRA meta's 0.25-0.32 ms
a W1 decode step, built by numpy run cold after the step's weights streamed through the caches."""

from __future__ import annotations

import contextlib
import functools
import importlib
import time
from collections.abc import Iterator

# (module, class, method): the parts timed, each with its callees (so the step holds the others)
PARTS = (
    ("engine.llm_engine", "LLMEngine", "step"),
    ("engine.scheduler", "Scheduler", "schedule"),
    ("engine.llm_engine", "LLMEngine", "_commit"),
    ("engine.model_runner", "ModelRunner", "execute"),
    ("engine.model_runner", "ModelRunner", "_prepare"),
    ("engine.model_runner", "ModelRunner", "_step_lora_meta"),
    ("engine.layers.decode_stack", "DecodeStack", "__call__"),
    ("engine.model_runner", "ModelRunner", "greedy_tokens"),
    ("engine.model_runner", "ModelRunner", "logits"),
    ("engine.sampler", "Sampler", "__call__"),
    ("engine.decode_graphs", "DecodeGraphs", "_fill"),
    ("engine.decode_graphs", "DecodeGraphs", "_copy"),
    ("torch.cuda", "CUDAGraph", "replay"),
)


@contextlib.contextmanager
def timed_parts(totals: dict[str, float], calls: dict[str, int] | None = None) -> Iterator[dict[str, float]]:
    """While inside, each part's calls add their seconds to totals["Class.method"] (and count in calls[...] when
    given); the methods are restored after."""
    originals = []
    for module, class_name, method in PARTS:
        owner = getattr(importlib.import_module(module), class_name)
        original = owner.__dict__[method]
        originals.append((owner, method, original))
        setattr(owner, method, _timed(original, f"{class_name}.{method}", totals, calls))
    try:
        yield totals
    finally:
        for owner, method, original in originals:
            setattr(owner, method, original)


def _timed(fn, key: str, totals: dict[str, float], calls: dict[str, int] | None):
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[key] = totals.get(key, 0.0) + time.perf_counter() - start
            if calls is not None:
                calls[key] = calls.get(key, 0) + 1

    return timed
