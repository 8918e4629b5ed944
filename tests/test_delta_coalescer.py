"""DeltaCoalescer: a stream's deltas joined over `stream_interval` steps, its first and last at once, nothing lost."""

from __future__ import annotations

from engine.delta_coalescer import DeltaCoalescer
from engine.outputs import CompletionOutput, RequestOutput, SequenceFailed, TokenLogprob


def delta(step: int, finish: str | None = None, samples: tuple[int, ...] = (0,), logprobs: bool = False):
    """Request "r"'s delta of one step: token 100 + step, text "t<step>", for each sample index."""
    outputs = [
        CompletionOutput(
            index,
            f"t{step}",
            [100 + step],
            [TokenLogprob(100 + step, -float(step))] if logprobs else None,
            finish,
            None,
        )
        for index in samples
    ]
    metrics = {"queue_s": 0.5} if step == 0 else {}
    return RequestOutput("r", None, [1, 2], outputs, finished=finish is not None, metrics=metrics)


def run(coalescer: DeltaCoalescer, deltas: list[RequestOutput], interval: int) -> list[list[RequestOutput]]:
    return [coalescer.push(d, interval) for d in deltas]


def token_ids(handed: list[list[RequestOutput]]) -> list[list[int]]:
    return [out.outputs[0].token_ids for step in handed for out in step]


def test_interval_1_hands_every_delta_over_as_it_is():
    coalescer = DeltaCoalescer()
    deltas = [delta(i) for i in range(3)] + [delta(3, "length")]
    handed = run(coalescer, deltas, 1)
    assert [step[0] for step in handed] == deltas and len(coalescer) == 0


def test_first_tokens_at_once_then_every_interval_steps_and_the_rest_with_the_last():
    coalescer = DeltaCoalescer()
    handed = run(coalescer, [delta(i) for i in range(8)] + [delta(8, "length")], 3)
    assert [len(step) for step in handed] == [1, 0, 0, 1, 0, 0, 1, 0, 1]
    assert token_ids(handed) == [[100], [101, 102, 103], [104, 105, 106], [107, 108]]
    texts = [out.outputs[0].text for step in handed for out in step]
    assert texts == ["t0", "t1t2t3", "t4t5t6", "t7t8"]
    last = handed[-1][0]
    assert last.finished and last.outputs[0].finish_reason == "length"
    assert len(coalescer) == 0  # nothing held for a finished request


def test_joined_deltas_keep_each_sample_apart_with_its_logprobs_and_the_earlier_metrics():
    coalescer = DeltaCoalescer()
    first = delta(0, samples=(0, 1), logprobs=True)
    assert coalescer.push(first, 4) == [first]
    assert coalescer.push(delta(1, samples=(0, 1), logprobs=True), 4) == []
    assert coalescer.push(delta(2, samples=(1,), logprobs=True), 4) == []  # sample 0 made nothing this step
    (joined,) = coalescer.push(delta(3, "stop", samples=(0, 1), logprobs=True), 4)
    assert [o.index for o in joined.outputs] == [0, 1]
    assert joined.outputs[0].token_ids == [101, 103] and joined.outputs[1].token_ids == [101, 102, 103]
    assert [lp.token_id for lp in joined.outputs[1].logprobs] == [101, 102, 103]
    assert joined.outputs[0].finish_reason == joined.outputs[1].finish_reason == "stop"
    assert joined.finished
    assert delta(0).extended(delta(1)).metrics == {"queue_s": 0.5}  # what the first step said is kept


def test_a_failure_comes_after_the_tokens_held_before_it():
    coalescer = DeltaCoalescer()
    run(coalescer, [delta(0), delta(1), delta(2)], 4)
    failed = RequestOutput("r", None, [1, 2], [], finished=True, error=SequenceFailed("r", "NaN"))
    held, error = coalescer.push(failed, 4)
    assert held.outputs[0].token_ids == [101, 102] and not held.finished
    assert error is failed and len(coalescer) == 0


def test_a_dropped_stream_is_forgotten():
    coalescer = DeltaCoalescer()
    run(coalescer, [delta(0), delta(1)], 4)
    assert len(coalescer) == 1
    coalescer.drop("r")
    assert len(coalescer) == 0
    again = delta(2)
    assert coalescer.push(again, 4) == [again]  # the held tokens are gone; the next delta starts a new stream
