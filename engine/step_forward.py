"""IsolatedForward: one step's model forward and sampling, such that a request that makes it raise is found and
blamed alone.

The whole batch runs first. If that raises, its requests run again in halves, recursively, until each failure is
pinned on one request; every part that runs is kept, so a step that raised once is merely retried. A forward
changes no engine state (it rewrites the same K/V slots), so running a part again is safe.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.model_runner import ModelRunner
from engine.outputs import TokenLogprob
from engine.sampler import SampledToken, Sampler, SamplingRow, prompt_token_logprobs
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from engine.structured_outputs import allowed_tokens

logger = logging.getLogger(__name__)

# Prompt positions whose logits one pass makes for prompt logprobs: a 2,048-token chunk's at once were 400 MB of fp32
# logits (and as much again for their log-softmax) with a 49K vocabulary; 256 rows are 50 MB.
PROMPT_LOGITS_ROWS = 256
# Rows that want their argmax alone, beside rows that need full logits, take the screened head instead once there are
# this many: below it, reading the head's bf16 (or int8) screen as well as its fp32 weights costs more than the fp32
# GEMM's compute for the few rows saves.
SPLIT_HEAD_MIN_ROWS = 16


@dataclass(slots=True)
class Outcome:
    """A scheduled seq's result: its hidden state is finite; its rows' tokens; the prompt logprobs it computed
    (for prompt_logprob_positions of its step, in order; None: none)."""

    finite: bool
    tokens: list[SampledToken]
    prompt_logprobs: list[TokenLogprob] | None = None


def sampling_row(seq: Sequence) -> SamplingRow:
    return SamplingRow(seq.params, seq.group.prompt_token_ids, seq.output_token_ids, seq.generator)


def _argmax_bans(sampler: Sampler, seqs: list[Sequence]) -> set[int] | None:
    """For a hidden row whose one sequence takes its logits' argmax and nothing else (no fork), the tokens it may not
    take (min_tokens' stop tokens; its grammar's are its matcher's); None: not such a row."""
    return sampler.argmax_bans(sampling_row(seqs[0])) if len(seqs) == 1 else None


class IsolatedForward:
    def __init__(self, runner: ModelRunner, sampler: Sampler):
        self.runner, self.sampler = runner, sampler

    def run(
        self, batch: ScheduledBatch, rows: list[list[Sequence]], step: int
    ) -> tuple[dict[int, Outcome], dict[str, Exception]]:
        """({batch index: Outcome} of the seqs that ran, {request_id: error} of the requests that raise alone).
        `rows[i]`: the seqs that sample from batch.seqs[i]'s logits (empty: it does not sample this step)."""
        try:
            return self._forward(batch, list(range(len(batch.seqs))), rows), {}
        except Exception as error:
            by_request: dict[str, list[int]] = {}
            for i, seq in enumerate(batch.seqs):
                by_request.setdefault(seq.request_id, []).append(i)
            logger.warning("step %d raised %r; running its %d requests apart", step, error, len(by_request))
            results: dict[int, Outcome] = {}
            raised: dict[str, Exception] = {}
            self._bisect(batch, rows, list(by_request.values()), error, results, raised)
            return results, raised

    def _bisect(self, batch, rows, groups: list[list[int]], error: Exception, results: dict, raised: dict) -> None:
        """`groups` (batch indices, one list per request) raised `error` together: blames it on a lone request, or
        runs each half apart."""
        if len(groups) == 1:
            raised[batch.seqs[groups[0][0]].request_id] = error
            return
        for part in (groups[: len(groups) // 2], groups[len(groups) // 2 :]):
            try:
                results.update(self._forward(batch, sorted(i for group in part for i in group), rows))
            except Exception as e:
                self._bisect(batch, rows, part, e, results, raised)

    def _tokens(self, hidden: torch.Tensor, sampling: list[list[Sequence]]) -> list[SampledToken]:
        """Each sampling sequence's token, in order; hidden [S, H]: row j the last hidden state of the sequences
        sampling[j] (one, or a prompt's n samples). Rows that want their argmax alone take it from the screened head
        where it pays: all of them, or at least SPLIT_HEAD_MIN_ROWS beside the others, which take the full logits
        (one sampled or constrained request among 64 greedy ones made every row's head the fp32 GEMM: 0.85 of the
        all-greedy step rate on the demo, Intel Xeon 2 cores). Greedy rows held to a grammar or banned tokens
        (min_tokens) count among them, the screen's kernels reading the refused tokens' bits: the demo's 32 rows held
        to a regex ran at their free rate, where the full logits kept 0.88 of it."""
        if self.runner.greedy_head is None:
            return self._sampled(hidden, sampling)
        bans = [_argmax_bans(self.sampler, seqs) for seqs in sampling]
        plain = [j for j, banned in enumerate(bans) if banned is not None]
        if len(plain) == len(sampling) or len(plain) >= SPLIT_HEAD_MIN_ROWS:
            # what the plain rows' grammars and bans refuse: the screen's kernel never takes those as candidates
            matchers = [sampling[j][0].matcher for j in plain]
            mask = allowed_tokens(matchers, self.runner.arch.vocab_size, hidden.device, [bans[j] for j in plain])
            plain_hidden = hidden if len(plain) == len(sampling) else hidden[plain]  # [P, H]
            token_ids = self.runner.greedy_tokens(plain_hidden, mask)  # [P]
            if token_ids is not None:  # else no screened head, or it cannot tell: the full logits for every row
                if len(plain) == len(sampling):
                    return self.sampler.argmax_tokens(token_ids)
                return self._merged(hidden, sampling, plain, self.sampler.argmax_tokens(token_ids))
        return self._sampled(hidden, sampling)

    def _merged(self, hidden, sampling, plain: list[int], argmax: list[SampledToken]) -> list[SampledToken]:
        """The plain rows' argmax tokens (in plain's order) and the other rows' sampled ones, back in row order."""
        plain_set = set(plain)
        rest = [j for j in range(len(sampling)) if j not in plain_set]
        sampled = iter(self._sampled(hidden[rest], [sampling[j] for j in rest]))
        argmax_tokens = iter(argmax)
        tokens: list[SampledToken] = []
        for j, seqs in enumerate(sampling):
            tokens.extend([next(argmax_tokens)] if j in plain_set else [next(sampled) for _ in seqs])
        return tokens

    def _sampled(self, hidden: torch.Tensor, sampling: list[list[Sequence]]) -> list[SampledToken]:
        """The sampler over the rows' full fp32 logits, their grammars' masks applied."""
        seqs = [s for r in sampling for s in r]
        mask = None  # what the grammars of the rows with a structured output allow
        if any(s.matcher is not None for s in seqs):
            mask = allowed_tokens([s.matcher for s in seqs], self.runner.arch.vocab_size, hidden.device)
        logits = self.runner.logits(hidden)  # [S, V]
        if any(len(r) > 1 for r in sampling):  # new samples each draw from their parent's row
            repeat = torch.tensor([len(r) for r in sampling], device=logits.device)
            logits = logits.repeat_interleave(repeat, dim=0)
        return self.sampler(logits, [sampling_row(s) for s in seqs], mask)

    def _forward(self, batch: ScheduledBatch, part: list[int], rows: list[list[Sequence]]) -> dict[int, Outcome]:
        """Runs the model and the sampler on the seqs batch.seqs[part] (ascending)."""
        if len(part) < len(batch.seqs):
            batch = ScheduledBatch(
                seqs=[batch.seqs[i] for i in part],
                num_new_tokens=[batch.num_new_tokens[i] for i in part],
                num_prefills=sum(1 for i in part if i < batch.num_prefills),
            )
        hidden, finite, prompt_hidden = self.runner.execute(batch)  # [S, H], [B], {index: (positions, [m, H])}
        tokens = iter(self._tokens(hidden, [rows[i] for i in part if rows[i]]))
        outcomes = {i: Outcome(ok, [next(tokens) for _ in rows[i]]) for i, ok in zip(part, finite.tolist())}
        for local, (positions, states) in prompt_hidden.items():
            seq = batch.seqs[local]
            next_ids = seq.group.prompt_token_ids[positions.start + 1 : positions.stop + 1]
            top = seq.params.prompt_logprobs
            scored: list[TokenLogprob] = []
            for at in range(0, len(next_ids), PROMPT_LOGITS_ROWS):
                logits = self.runner.logits(states[at : at + PROMPT_LOGITS_ROWS])  # [<= PROMPT_LOGITS_ROWS, V]
                scored += prompt_token_logprobs(logits, next_ids[at : at + PROMPT_LOGITS_ROWS], top)
            outcomes[part[local]].prompt_logprobs = scored
        return outcomes
