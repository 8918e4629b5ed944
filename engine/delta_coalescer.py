"""DeltaCoalescer: how often a stream is handed its tokens (`stream_interval`, as vLLM's `--stream-interval`).

At 1 every step's delta goes to the stream's event loop at once. At N > 1 a stream's deltas are held and joined
(`RequestOutput.extended`): its first tokens still go at once (time to first token is unchanged), then N steps'
tokens in one delta, and whatever is held when the request finishes or fails goes with that last delta. Each
delta the event loop takes costs it the same Python and one socket write however many tokens it carries, so at 64
streams a larger interval leaves the engine more of the cores the server shares; the price is a burstier stream.

Runs on the engine thread only (AsyncEngine._deliver); nothing here is shared with another thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.outputs import RequestOutput


@dataclass(slots=True)
class _Held:
    started: bool = False  # its first tokens went out
    delta: RequestOutput | None = None  # the steps' deltas held since the last one handed over, joined
    steps: int = 0  # how many steps `delta` joins


class DeltaCoalescer:
    def __init__(self):
        self._held: dict[str, _Held] = {}

    def push(self, out: RequestOutput, interval: int) -> list[RequestOutput]:
        """Takes a request's delta of this step; returns what to hand its stream now, in order (none, one joined
        delta, or the held delta and then a failed request's error output)."""
        if interval <= 1:  # a stream's interval is fixed when it starts: nothing of it is ever held
            return [out]
        held = self._held.setdefault(out.request_id, _Held())
        if out.finished or out.error is not None:
            del self._held[out.request_id]
            if held.delta is None:
                return [out]
            if out.error is not None:  # the tokens it made before failing, then the failure
                return [held.delta, out]
            return [held.delta.extended(out)]
        held.delta = out if held.delta is None else held.delta.extended(out)
        held.steps += 1
        if not held.started and any(o.token_ids for o in held.delta.outputs):
            held.started = True
        elif held.steps < interval:
            return []
        ready, held.delta, held.steps = held.delta, None, 0
        return [ready]

    def drop(self, request_id: str) -> None:
        """Forgets a request whose stream is gone (aborted): nothing of it is handed over any more."""
        self._held.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._held)
