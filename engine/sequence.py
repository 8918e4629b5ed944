"""Sequence (one sample being generated) and SequenceGroup (a request's n samples sharing one prompt)."""

from __future__ import annotations

import itertools
import time
from enum import Enum, auto
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.detokenizer import IncrementalDetokenizer
    from engine.outputs import TokenLogprob
    from engine.request import EngineRequest
    from engine.sampling_params import SamplingParams
    from engine.structured_outputs import GrammarMatcher

_seq_counter = itertools.count()
NO_ADAPTER = -1


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """Token ids, progress and KV blocks of one sample. Only the BlockManager writes `block_table` and
    `block_hashes`; only the scheduler writes `status`."""

    def __init__(
        self,
        group: SequenceGroup,
        index: int,
        token_ids: list[int],
        detokenizer: IncrementalDetokenizer | None,
    ):
        self.seq_id = next(_seq_counter)
        self.group = group
        self.index = index
        self.token_ids = token_ids  # prompt + output
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # hash chain of the full blocks registered in the prefix cache
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.detokenizer = detokenizer
        self.logprobs: list[TokenLogprob] | None = [] if group.params.logprobs is not None else None
        self.matcher: GrammarMatcher | None = None  # its place in the request's structured output grammar
        seed = group.params.seed
        self.generator = None if seed is None else torch.Generator().manual_seed(hash((seed, index)) & (2**63 - 1))

    @property
    def request_id(self) -> str:
        return self.group.request_id

    @property
    def params(self) -> SamplingParams:
        return self.group.params

    @property
    def adapter_digest(self) -> str | None:
        return self.group.adapter_digest

    @property
    def adapter_idx(self) -> int:
        return self.group.adapter_idx

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return self.group.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, request={self.request_id}#{self.index}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )


class SequenceGroup:
    """A request inside the engine: its prompt, sampling params and n sequences. It starts with one sequence;
    when the prompt's prefill completes that sequence forks into n that share the prompt's KV blocks."""

    def __init__(self, request: EngineRequest, arrival: int):
        self.request_id = request.request_id
        self.prompt = request.prompt
        self.prompt_token_ids = list(request.prompt_token_ids)
        self.params = request.sampling
        self.lora = request.lora
        self.grammar: str | None = None  # the compiled structured output its samples follow (engine/structured_outputs)
        self.adapter_digest = request.adapter_digest  # set to the adapter's digest once it is loaded
        # the device row of its adapter, pinned ONCE for all its sequences (forks share it) from the first
        # admission until the request finishes or is aborted, so one request always runs on one adapter version
        self.adapter_idx = NO_ADAPTER
        self.tenant = request.tenant
        self.tenant_weight = request.tenant_weight
        self.arrival = arrival  # admission order: FCFS and preemption victims follow it
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None  # queue time = first_scheduled_time - arrival_time
        self.adapter_tier: str | None = None  # where its adapter was when first asked for: device, host or disk
        self.adapter_load_s = 0.0  # how long it waited for its adapter to reach a device row
        self.num_cached_tokens: int | None = None  # prompt tokens the prefix cache served at first admission
        self.seqs: list[Sequence] = []
        # params.prompt_logprobs: entry j is prompt token j's logprob given the tokens before it (None for the
        # first), filled as the prompt's chunks are computed; handed out once, with the request's first token
        self.prompt_logprobs: list[TokenLogprob | None] | None = None if self.params.prompt_logprobs is None else [None]
        self.prompt_logprobs_sent = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def metrics(self) -> dict[str, float]:
        """What a RequestOutput reports: the time, and once scheduled the queue time and the adapter's load wait."""
        metrics = {"time": time.monotonic()}
        if self.first_scheduled_time is not None:
            metrics["queue_s"] = self.first_scheduled_time - self.arrival_time
            metrics["adapter_load_s"] = self.adapter_load_s
        return metrics

    def prompt_logprob_positions(self, start: int, end: int) -> range:
        """The positions among [start, end) whose final hidden states give a prompt logprob still unknown: position
        p's logits score prompt token p + 1 (the last prompt position's pick the first output token instead)."""
        if self.prompt_logprobs is None:
            return range(0)
        return range(max(start, len(self.prompt_logprobs) - 1), min(end, self.num_prompt_tokens - 1))

    def take_prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """The prompt logprobs once all are known, the first time they are asked for; None before and after."""
        if self.prompt_logprobs is None or self.prompt_logprobs_sent or self.wants_prompt_logprobs:
            return None
        self.prompt_logprobs_sent = True
        return self.prompt_logprobs

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs are asked for and not all known: its prompt may not come from the prefix cache."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def needs_fork(self) -> bool:
        return len(self.seqs) < self.params.n

    @property
    def is_finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(s.is_finished for s in self.seqs)
