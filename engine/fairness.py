"""Admission order across tenants: first come first served, or fair by Virtual Token Counters.

The VTC policy follows Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024). Each tenant has
a counter of the service it has received, in weighted tokens: every prompt token computed adds
`PREFILL_WEIGHT / weight`, every decoded token `DECODE_WEIGHT / weight` (`weight` is the tenant's share,
default 1). When seats free up, the next request comes from the backlogged tenant (one with requests waiting)
whose counter is smallest, oldest request first. A tenant that becomes backlogged is lifted to the smallest
counter of the tenants already backlogged, so idle time banks no credit. Counters are charged as the scheduler
hands out tokens, prefill chunks included, so one step's admissions already see each other's cost.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator

from engine.sequence import Sequence

POLICIES = ("fcfs", "fair")
PREFILL_WEIGHT = 1.0  # the paper's w_p
DECODE_WEIGHT = 2.0  # the paper's w_d: a decoded token costs a step of the whole batch


def tenant_of(seq: Sequence) -> str:
    return seq.group.tenant or ""


def cost(num_tokens: int, prefill: bool) -> float:
    """The weighted service of `num_tokens` computed tokens, before the tenant's weight."""
    return num_tokens * (PREFILL_WEIGHT if prefill else DECODE_WEIGHT)


class FirstComeFirstServed:
    """Admission in arrival order (the waiting queue's own order); keeps the service tally for metrics."""

    def __init__(self):
        self.service: dict[str, float] = defaultdict(float)  # tenant -> weighted tokens received

    def order(self, waiting: Iterable[Sequence]) -> Iterator[Sequence]:
        yield from list(waiting)

    def on_arrival(self, seq: Sequence, waiting: Iterable[Sequence]) -> None:
        pass

    def charge(self, seq: Sequence, num_tokens: int, prefill: bool) -> None:
        self.service[tenant_of(seq)] += cost(num_tokens, prefill)


class VirtualTokenCounter(FirstComeFirstServed):
    """VTC: `counters` are the weighted service each tenant has received, lifted on becoming backlogged."""

    def __init__(self):
        super().__init__()
        self.counters: dict[str, float] = defaultdict(float)

    def order(self, waiting: Iterable[Sequence]) -> Iterator[Sequence]:
        """Resumed (preempted) sequences first, then each next one from the tenant with the smallest counter
        (read afresh at each step of the iteration, so `charge` between steps re-ranks the tenants)."""
        queues: dict[str, list[Sequence]] = defaultdict(list)
        for seq in list(waiting):
            if seq.group.num_cached_tokens is not None:  # admitted before: it already paid, and holds its row
                yield seq
            else:
                queues[tenant_of(seq)].append(seq)
        heads = {tenant: 0 for tenant in queues}
        while heads:
            tenant = min(heads, key=lambda t: (self.counters[t], queues[t][heads[t]].group.arrival))
            yield queues[tenant][heads[tenant]]
            heads[tenant] += 1
            if heads[tenant] == len(queues[tenant]):
                del heads[tenant]

    def on_arrival(self, seq: Sequence, waiting: Iterable[Sequence]) -> None:
        """Lifts a tenant that was not backlogged to the smallest counter of those that are."""
        tenant = tenant_of(seq)
        backlogged = {tenant_of(s) for s in waiting}
        if tenant in backlogged:
            return
        floor = min((self.counters[t] for t in backlogged), default=None)
        if floor is not None and self.counters[tenant] < floor:
            self.counters[tenant] = floor

    def charge(self, seq: Sequence, num_tokens: int, prefill: bool) -> None:
        super().charge(seq, num_tokens, prefill)
        self.counters[tenant_of(seq)] += cost(num_tokens, prefill) / seq.group.tenant_weight


def make_policy(name: str) -> FirstComeFirstServed:
    if name == "fcfs":
        return FirstComeFirstServed()
    if name == "fair":
        return VirtualTokenCounter()
    raise ValueError(f"unknown scheduling policy '{name}'; choose one of {', '.join(POLICIES)}")
