"""Where an engine step's host time goes: `timed_parts` adds up the wall time of each of a step's parts (scheduling,
filling the decode graphs' buffers and copying them, the graph replay, the forward, the sampler, which waits for
the device's tokens, committing them) while inside, for `bench gpu --host-split`.

On a GPU a W1 step is mostly the host's (on an H200, 2026-11-28: ~1.9 ms a decode step, 0.58 of it the graph on the
device), so what LoRA adds to the host's parts shows here, where torch.profiler's tables only show the launches."""

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
    ("engine.model_runner", "ModelRunner", "logits"),
    ("engine.sampler", "Sampler", "__call__"),
    ("engine.decode_graphs", "DecodeGraphs", "_fill"),
    ("engine.decode_graphs", "DecodeGraphs", "_copy"),
    ("torch.cuda", "CUDAGraph", "replay"),
)


@contextlib.contextmanager
def timed_parts(totals: dict[str, float]) -> Iterator[dict[str, float]]:
    """While inside, each part's calls add their seconds to totals["Class.method"]; the methods are restored after."""
    originals = []
    for module, class_name, method in PARTS:
        owner = getattr(importlib.import_module(module), class_name)
        original = owner.__dict__[method]
        originals.append((owner, method, original))
        setattr(owner, method, _timed(original, f"{class_name}.{method}", totals))
    try:
        yield totals
    finally:
        for owner, method, original in originals:
            setattr(owner, method, original)


def _timed(fn, key: str, totals: dict[str, float]):
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[key] = totals.get(key, 0.0) + time.perf_counter() - start

    return timed
