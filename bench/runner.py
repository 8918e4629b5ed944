"""One run: every request sent at its arrival time over one HTTP client, bounded in concurrency and duration.

Requests still running when `max_duration_s` is up are cancelled, and those not yet sent are never sent; both
come back as failed records, so a run always returns one record per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import aiohttp
from tqdm import tqdm

try:
    import uvloop
except ImportError:  # Windows
    uvloop = None

from bench.client import RequestRecord, Target, send_request
from bench.workload import RequestSpec


@dataclass(frozen=True, slots=True)
class RunLimits:
    max_concurrency: int | None = None  # requests in flight at once; None: unbounded
    max_duration_s: float = 1800.0  # the whole run
    show_progress: bool = True
    label: str = "requests"  # the progress bar's description


def run_requests(specs: list[RequestSpec], target: Target, limits: RunLimits) -> tuple[list[RequestRecord], float]:
    """(one record per spec, in spec order; the run's wall time in seconds). On uvloop where it is installed: the
    client's CPU is taken from the server under test when both run on one machine."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop if uvloop is not None else None) as runner:
        return runner.run(_run(specs, target, limits))


async def _run(specs: list[RequestSpec], target: Target, limits: RunLimits) -> tuple[list[RequestRecord], float]:
    pool = aiohttp.TCPConnector(limit=limits.max_concurrency or 0)  # 0: no limit
    gate = asyncio.Semaphore(limits.max_concurrency) if limits.max_concurrency else contextlib.nullcontext()
    records: dict[int, RequestRecord] = {}
    with tqdm(total=len(specs), desc=limits.label, unit="req", disable=not limits.show_progress) as bar:
        async with aiohttp.ClientSession(connector=pool, timeout=aiohttp.ClientTimeout(total=None)) as client:
            t0 = time.perf_counter()

            async def one(spec: RequestSpec) -> None:
                await asyncio.sleep(max(0.0, t0 + spec.arrival_s - time.perf_counter()))
                async with gate:
                    records[spec.index] = await send_request(client, target, spec, t0)
                bar.update()

            tasks = [asyncio.create_task(one(spec)) for spec in specs]
            done, pending = await asyncio.wait(tasks, timeout=limits.max_duration_s) if tasks else (set(), set())
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            duration = time.perf_counter() - t0
            for task in done:
                task.result()  # a bug in the client surfaces here rather than as a missing record
    late = f"not finished within the run's time limit ({limits.max_duration_s:g} s)"
    return [records.get(s.index) or _unfinished(s, late) for s in specs], duration


def _unfinished(spec: RequestSpec, error: str) -> RequestRecord:
    return RequestRecord(spec.index, spec.model, spec.prompt_len, spec.output_len, spec.arrival_s, error=error)
