"""LLMEngine: the synchronous core. One `step()` = schedule → run the model → sample → append and check stops.

One bad request never fails the others. A sequence whose hidden state or logits turn NaN/Inf, or that samples a
token outside the vocabulary, fails its request alone (SequenceFailed): nothing of that step is committed for it,
the blocks it wrote are zeroed and freed, and its adapter row is released. A step that raises is run again in halves,
by request, until the requests that raise alone are found; they fail, the others' results stand. When every
request of a step failed, a one-token self-test of the base model decides whether the engine itself is broken
(EngineFault: the AsyncEngine then stops) or the requests were.

Not thread-safe: the offline `LLM` drives it directly, the `AsyncEngine` from its one engine thread.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from adapters.cache import AdapterCache, AdapterCacheStats, HostAdapter
from adapters.ref import LoRARequest
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.cpu_threads import ThreadGovernor
from engine.detokenizer import IncrementalDetokenizer
from engine.gc_heap import freeze_startup_heap
from engine.gguf_reader import is_gguf, read_gguf
from engine.interface_types import AdapterInfo, EngineSnapshot, Tier
from engine.model_loader import load_tokenizer
from engine.model_runner import ModelRunner
from engine.outputs import CompletionOutput, RequestOutput, SequenceFailed, TokenLogprob
from engine.request import EngineRequest
from engine.sampler import NON_FINITE, Sampler
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import Sequence, SequenceGroup
from engine.step_forward import IsolatedForward, Outcome
from engine.structured_outputs import GrammarCompiler

logger = logging.getLogger(__name__)


class EngineFault(RuntimeError):
    """The engine itself is broken (the device, the model's weights): no request is to blame for its failed step."""


# Steps the trace keeps. Each record holds a list per step, created after the startup heap was frozen: 10,000 steps
# of 64 sequences were 49 MB that every full garbage collection walked (116 ms, the GIL held, the engine stopped).
STEP_TRACE_LEN = 512


@dataclass(slots=True)
class StepRecord:
    """What one step did, kept for tests and debugging (the engine's step trace)."""

    step: int
    scheduled: list[tuple[str, int]]  # (request_id, tokens computed)
    sampled: list[str]  # request ids that got a token
    finished: list[str]
    num_preempted: int
    failed: list[str] = field(default_factory=list)  # request ids failed alone (SequenceFailed)


@dataclass(slots=True)
class EngineStats:
    num_steps: int = 0
    num_prompt_tokens_computed: int = 0  # prompt tokens run through the model (prefix hits excluded)
    num_generated_tokens: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.tokenizer = load_tokenizer(config.model)
        self.thread_governor: ThreadGovernor | None = None
        if config.device == "cpu":
            # one OpenMP team per core it may keep: a team larger than the free cores stalls at every barrier
            # while a thread is descheduled (measured 5-7x slower with a busy neighbour on 2 cores)
            if config.cpu_threads_adapt:  # sets the team, then follows the free cores
                self.thread_governor = ThreadGovernor(config.cpu_threads)
            else:
                torch.set_num_threads(config.cpu_threads)
        self.runner = ModelRunner(config)
        arch = self.runner.arch
        self.max_model_len = min(
            config.max_model_len or arch.max_position_embeddings,
            arch.max_position_embeddings,
            arch.sliding_window or arch.max_position_embeddings,  # past the window our attention would differ
            self.runner.num_blocks * config.block_size,  # one sequence must always fit the pool
        )
        self.runner.capture_decode_graphs(self.max_model_len)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.adapter_cache = self.runner.adapter_cache
        self.scheduler = Scheduler(config, self.block_manager, self.adapter_cache)
        self.eos_token_ids = self._eos_token_ids()
        self.sampler = Sampler(self.eos_token_ids)
        self.grammars = GrammarCompiler(self.tokenizer, arch.vocab_size, self.eos_token_ids)
        self.forward = IsolatedForward(self.runner, self.sampler)
        self.groups: dict[str, SequenceGroup] = {}
        self.pinned_adapters: dict[tuple[str, str], int] = {}  # LoRARequest.key -> adapter_idx held by pin_adapter
        self.stats = EngineStats()
        self.step_trace: deque[StepRecord] = deque(maxlen=STEP_TRACE_LEN)
        self.last_step_ran = False  # whether the last step() had anything to compute
        self._arrivals = 0
        torch.manual_seed(config.seed)
        freeze_startup_heap()
        if self.thread_governor is not None:
            self.thread_governor.restart()  # the first interval is the first steps', not the model load's

    def _eos_token_ids(self) -> set[int]:
        """The tokenizer's eos plus any that generation_config.json lists (chat models often add one); for a GGUF
        file, the eos, end-of-turn and end-of-message ids of its metadata."""
        ids = {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        if is_gguf(self.config.model):
            return ids | set(read_gguf(self.config.model).eos_token_ids)
        gen_config = Path(self.config.model) / "generation_config.json"
        if gen_config.is_file():
            eos = json.loads(gen_config.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        return ids

    # ---- requests -----------------------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        """Validates and queues a request; raises ValueError naming what is wrong with it."""
        grammar = self.validate(request)
        group = SequenceGroup(request, self._arrivals)
        group.grammar = grammar
        self._arrivals += 1
        seq = self._new_seq(group, 0, list(request.prompt_token_ids))
        self.groups[request.request_id] = group
        self.scheduler.add(seq)

    def validate(self, request: EngineRequest) -> str | None:
        """Raises ValueError naming what is wrong with the request; changes nothing. Returns its structured output's
        compiled grammar (None without one)."""
        if request.lora is not None and self.adapter_cache is None:
            raise ValueError(
                f"adapter '{request.lora.adapter_id}' requested but LoRA is not enabled (enable_lora=True)"
            )
        if request.request_id in self.groups:
            raise ValueError(f"request id '{request.request_id}' is already in use")
        if not 0 < request.tenant_weight < float("inf"):
            raise ValueError(f"tenant_weight must be a positive finite number, got {request.tenant_weight}")
        num_prompt = len(request.prompt_token_ids)
        if num_prompt == 0:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.runner.arch.vocab_size
        bad = [t for t in request.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        max_tokens = request.sampling.max_tokens if request.sampling.max_tokens is not None else 1
        if num_prompt + max_tokens > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, but {num_prompt + max_tokens} "
                f"were requested ({num_prompt} in the prompt, {max_tokens} to generate)"
            )
        if request.sampling.structured_outputs is None:
            return None
        return self.grammars.compile(request.sampling.structured_outputs)  # StructuredOutputError: it does not compile

    def _new_seq(self, group: SequenceGroup, index: int, token_ids: list[int]) -> Sequence:
        params = group.params
        detok = IncrementalDetokenizer(
            self.tokenizer, params.stop, params.skip_special_tokens, prompt_token_ids=group.prompt_token_ids
        )
        seq = Sequence(group, index, token_ids, detok)
        if group.grammar is not None:  # a fork copies its parent's, still at the start (forks precede any token)
            first = group.seqs[0].matcher if group.seqs else None
            seq.matcher = first.copy() if first is not None else self.grammars.matcher(group.grammar)
        group.seqs.append(seq)
        return seq

    def abort(self, request_id: str) -> RequestOutput | None:
        """Ends a request at once and frees its blocks; returns its final (delta) output."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        outputs = []
        for seq in group.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"
                outputs.append(CompletionOutput(seq.index, "", [], [] if seq.logprobs is not None else None, "abort"))
        self.scheduler.release_adapter(group)  # also when it is aborted before its n samples were forked
        return self._request_output(group, outputs)

    def _fail(self, group: SequenceGroup, error: Exception) -> RequestOutput | None:
        output = self.abort(group.request_id)
        if output is not None:
            output.error = error
            output.finished = True  # also when it failed before its n samples were forked
        return output

    def shutdown(self) -> None:
        if self.adapter_cache is not None:
            self.adapter_cache.shutdown()

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def snapshot(self) -> EngineSnapshot:
        cache, scheduler, blocks = self.adapter_cache, self.scheduler, self.block_manager
        a = cache.stats if cache is not None else AdapterCacheStats()
        return EngineSnapshot(
            num_requests=len(self.groups),
            seqs_running=len(scheduler.running),
            seqs_waiting=len(scheduler.waiting),
            kv_blocks_total=blocks.num_blocks,
            kv_blocks_free=blocks.num_free_blocks,
            adapters_on_device=tuple(name for name, _ in cache.resident_keys()) if cache else (),
            adapters_on_host=tuple(name for name, _ in cache.host_keys()) if cache else (),
            adapter_rows_pinned=cache.num_pinned if cache else 0,
            max_loras=cache.max_loras if cache else 0,
            max_cpu_loras=cache.max_cpu_loras if cache else 0,
            adapter_loads=a.loads,
            adapter_load_seconds=a.load_seconds,
            adapter_load_failures=a.failures,
            adapter_activations=a.activations,
            adapter_device_evictions=a.device_evictions,
            adapter_host_evictions=a.host_evictions,
            steps=self.stats.num_steps,
            preemptions=scheduler.num_preemptions,
            prompt_tokens_computed=self.stats.num_prompt_tokens_computed,
            generated_tokens=self.stats.num_generated_tokens,
            tenant_service=dict(scheduler.policy.service),
            cpu_threads=torch.get_num_threads() if self.config.device == "cpu" else 0,
        )

    # ---- adapters: host memory (disk -> host) and device rows (host -> device) -------------------------
    def _adapters(self) -> AdapterCache:
        if self.adapter_cache is None:
            raise ValueError("LoRA is not enabled (enable_lora=True)")
        return self.adapter_cache

    def read_adapter(self, lora: LoRARequest) -> HostAdapter | None:
        """Reads and validates the adapter from disk (raising AdapterError) unless it is in host memory (None
        then). Changes nothing, so it may run on any thread: the slow half of `add_adapter`."""
        cache = self._adapters()
        return None if cache.host_weights(lora) is not None else cache.read(lora)

    def add_adapter(self, lora: LoRARequest, host: HostAdapter | None = None) -> AdapterInfo:
        """Puts the adapter in host memory: what `read_adapter` returned, else it reads now unless it is there."""
        cache = self._adapters()
        return AdapterInfo.of(cache.store(lora, host) if host is not None else cache.load(lora))

    def remove_adapter(self, lora: LoRARequest) -> bool:
        """Forgets the adapter in every tier (a pin too), so that its next use reads the directory again. Its
        device row is freed now, or when the requests running on it end: returns whether any still run."""
        self.unpin_adapter(lora)
        return self._adapters().evict(lora)

    def load_adapter(self, lora: LoRARequest, host: HostAdapter | None = None) -> Tier:
        """`add_adapter`, then a device row when one is free (never one a request pins); returns the tier reached."""
        self.add_adapter(lora, host)
        cache = self._adapters()
        row = cache.acquire(lora)
        if row is not None:
            cache.release(row)
        return cache.tier(lora)

    def unload_adapter(self, lora: LoRARequest) -> bool:
        """Frees the adapter's device row (a pin too), keeping it in host memory: now, or when the requests
        running on it end; returns whether any still run."""
        self.unpin_adapter(lora)
        return self._adapters().unload(lora)

    def pin_adapter(self, lora: LoRARequest, host: HostAdapter | None = None) -> Tier:
        """`load_adapter`, then holds its device row until `unpin_adapter` (or unload / remove) so that no other
        adapter can take the row. Returns "device", or the tier reached while every row is pinned."""
        cache = self._adapters()
        if lora.key not in self.pinned_adapters:
            self.add_adapter(lora, host)
            row = cache.acquire(lora)
            if row is not None:
                self.pinned_adapters[lora.key] = row
        return cache.tier(lora)

    def unpin_adapter(self, lora: LoRARequest) -> bool:
        """Lets LRU evict the adapter's row again; returns whether it was pinned."""
        row = self.pinned_adapters.pop(lora.key, None)
        if row is not None:
            self._adapters().release(row)
        return row is not None

    def tier(self, lora: LoRARequest) -> Tier:
        return self._adapters().tier(lora)

    def digest(self, lora: LoRARequest) -> str | None:
        """The adapter's content digest once read (any thread: it is kept under the cache's lock)."""
        return self._adapters().digest(lora)

    # ---- the step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one iteration; returns a delta for each request that produced tokens, finished or failed."""
        if self.thread_governor is not None:
            self.thread_governor.tick()
        batch = self.scheduler.schedule()
        outputs = [self._fail(seq.group, error) for seq, error in self.scheduler.failed]
        self.scheduler.failed.clear()
        self.last_step_ran = not batch.is_empty
        if batch.is_empty:
            return [out for out in outputs if out is not None]
        self.runner.copy_blocks(batch.block_copies)
        rows = [self._rows_of(seq) if samples else [] for seq, samples in zip(batch.seqs, batch.samples())]
        results, raised = self.forward.run(batch, rows, step=self.stats.num_steps + 1)
        failed = {request_id: f"its step raised {e!r}" for request_id, e in raised.items()}
        vocab_size = self.runner.arch.vocab_size
        for i, outcome in results.items():
            bad = [t.token_id for t in outcome.tokens if not 0 <= t.token_id < vocab_size]  # NON_FINITE is outside too
            if bad or not outcome.finite:
                seq = batch.seqs[i]
                failed.setdefault(seq.request_id, self._cause(outcome.finite, bad, vocab_size, seq.matcher is not None))
        if failed and len(failed) == len({seq.request_id for seq in batch.seqs}) and not self._self_test():
            raise EngineFault(f"every request of the step failed and the model fails its self-test: {failed}")
        outputs += self._fail_alone(batch, failed)
        deltas, late_failures = self._commit(batch, rows, results, failed)
        outputs += late_failures
        finished: list[str] = []
        for request_id, outs in deltas.items():
            group = self.groups[request_id]
            if group.is_finished:
                finished.append(request_id)
                del self.groups[request_id]
            outputs.append(self._request_output(group, outs))
        self._record(batch, deltas, finished, list(failed))
        return [out for out in outputs if out is not None]

    def _rows_of(self, seq: Sequence) -> list[Sequence]:
        """The seqs that sample from a sampling seq's logits: itself, and after its prompt the n - 1 samples it forks
        into (made now; they share its blocks once the step is committed)."""
        group = seq.group
        if not group.needs_fork or seq.num_output_tokens:
            return [seq]
        return [seq, *(self._new_seq(group, index, list(seq.token_ids)) for index in range(1, group.params.n))]

    @staticmethod
    def _cause(hidden_finite: bool, bad_token_ids: list[int], vocab_size: int, constrained: bool) -> str:
        if not hidden_finite:
            return "its hidden states hold NaN or Inf"
        if bad_token_ids[0] == NON_FINITE:
            why = "its logits hold NaN or Inf (after its sampling parameters were applied)"
            return why + (", or its grammar left no token to take" if constrained else "")
        return f"it sampled token id {bad_token_ids[0]}, outside the vocabulary [0, {vocab_size})"

    def _self_test(self) -> bool:
        try:
            return self.runner.self_test()
        except Exception:
            logger.exception("the model's self-test raised")
            return False

    def _fail_alone(self, batch: ScheduledBatch, failed: dict[str, str]) -> list[RequestOutput | None]:
        """Zeroes the blocks the step wrote for the failed requests' seqs (never committed, so never in the prefix
        cache; a shared block is copied before anyone writes it), then fails each request."""
        if not failed:
            return []
        bs, written = self.block_manager.block_size, []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.request_id in failed:
                start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
                written += seq.block_table[start // bs : -(-end // bs)]
        self.runner.scrub(written)
        outputs = []
        for request_id, cause in failed.items():
            logger.warning("request '%s' failed alone: %s", request_id, cause)
            outputs.append(self._fail(self.groups[request_id], SequenceFailed(request_id, cause)))
        return outputs

    def _commit(self, batch, rows, results: dict[int, Outcome], failed: dict[str, str]):
        """Commits the step for every request that did not fail: K/V computed, new samples forked, tokens appended.
        Returns each request's deltas, and the outputs of requests whose append raised (it runs per-request code:
        the detokenizer, stop strings), which fail alone."""
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if seq.request_id not in failed:
                if seq.num_computed_tokens < seq.num_prompt_tokens:
                    self.stats.num_prompt_tokens_computed += min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
                prompt_logprobs = results[i].prompt_logprobs
                if prompt_logprobs is not None:  # in order: the chunks of one prompt run in order
                    seq.group.prompt_logprobs.extend(prompt_logprobs)
                self.block_manager.commit(seq, n)
        for seq, seq_rows in zip(batch.seqs, rows):
            for child in seq_rows[1:] if seq.request_id not in failed else ():
                self.block_manager.fork(seq, child)
                self.scheduler.add_running(child)
        deltas: dict[str, list[CompletionOutput]] = {}
        failures: list[RequestOutput | None] = []
        for i, seq in enumerate(batch.seqs):
            request_id = seq.request_id
            if not rows[i] or request_id in failed:
                continue
            try:
                tokens = results[i].tokens
                deltas.setdefault(request_id, []).extend(self._append(s, t) for s, t in zip(rows[i], tokens))
            except Exception as e:
                logger.exception("appending a token to request '%s' raised; it fails alone", request_id)
                failed[request_id] = f"appending its token raised {e!r}"
                deltas.pop(request_id, None)
                failures.append(self._fail(seq.group, SequenceFailed(request_id, failed[request_id])))
        return deltas, failures

    def _append(self, seq: Sequence, token) -> CompletionOutput:
        """Appends a sampled token, detokenizes it and applies the stop checks; with max_tokens 0 (the prompt alone)
        ends the sample instead, the token dropped."""
        params = seq.params
        if params.max_tokens == 0:
            seq.finish_reason = "length"
            self.scheduler.finish(seq)
            return CompletionOutput(seq.index, "", [], [] if seq.logprobs is not None else None, "length")
        if seq.matcher is not None:
            seq.matcher.accept(token.token_id)  # raises where the grammar refuses it: the request fails alone
        seq.token_ids.append(token.token_id)
        self.stats.num_generated_tokens += 1
        logprob = None
        if seq.logprobs is not None:
            logprob = TokenLogprob(token.token_id, token.logprob, token.top_logprobs)
            seq.logprobs.append(logprob)
        is_stop_token = token.token_id in params.stop_token_ids
        is_eos = token.token_id in self.eos_token_ids and not params.ignore_eos
        detokenize = params.detokenize and not (is_stop_token or is_eos)
        text = seq.detokenizer.push([token.token_id]) if detokenize else ""
        if is_stop_token:
            seq.finish_reason, seq.stop_reason = "stop", token.token_id
        elif is_eos:
            seq.finish_reason = "stop"
        elif seq.detokenizer.stopped:
            seq.finish_reason, seq.stop_reason = "stop", seq.detokenizer.stop_string
        elif seq.matcher is not None and seq.matcher.is_done:  # its structured output is complete
            seq.finish_reason = "stop"
        elif (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens) or (
            seq.num_tokens >= self.max_model_len
        ):
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            text += seq.detokenizer.flush() if params.detokenize else ""
            self.scheduler.finish(seq)
        return CompletionOutput(
            seq.index,
            text,
            [token.token_id],
            [logprob] if logprob else None,
            seq.finish_reason,
            seq.stop_reason,
        )

    def _request_output(self, group: SequenceGroup, outputs: list[CompletionOutput]) -> RequestOutput:
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=outputs,
            finished=group.is_finished,
            num_cached_tokens=group.num_cached_tokens or 0,
            metrics=group.metrics(),
            adapter_tier=group.adapter_tier,
            prompt_logprobs=group.take_prompt_logprobs() if outputs else None,  # with the first token
        )

    def _record(self, batch, deltas: dict[str, list[CompletionOutput]], finished: list[str], failed: list[str]) -> None:
        self.stats.num_steps += 1
        self.step_trace.append(
            StepRecord(
                step=self.stats.num_steps,
                scheduled=[(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)],
                sampled=list(deltas),
                finished=finished,
                num_preempted=batch.num_preempted,
                failed=failed,
            )
        )
