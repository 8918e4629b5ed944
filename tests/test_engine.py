"""Engine behaviour on a tiny random Llama: continuous batching, preemption, prefix caching, n > 1, stops."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import STEP_TRACE_LEN
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams
from tests.hf_models import make_model
from tests.test_oracle import prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    directory = tmp_path_factory.mktemp("llama")
    make_model(directory, tokenizer, "llama")
    return directory


def make_llm(model_dir, **options) -> LLM:
    return LLM(model=str(model_dir), device="cpu", **{"dtype": "float32", "num_kv_blocks": 256, **options})


@pytest.fixture(scope="module")
def llm(model_dir):
    return make_llm(model_dir)


def assert_no_leaks(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert not llm.engine.has_unfinished
    assert bm.num_free_blocks == bm.num_blocks
    assert all(rc == 0 for rc in bm.ref_counts)


def test_request_joining_mid_decode_gets_its_first_token_before_the_others_finish(llm):
    engine = llm.engine
    vocab = engine.runner.arch.vocab_size
    for i, p in enumerate(prompts(vocab, 4)):
        engine.add_request(EngineRequest(f"early-{i}", p, GREEDY))
    for _ in range(5):  # the early ones are decoding now
        engine.step()
    first_step = engine.stats.num_steps
    engine.add_request(EngineRequest("late", prompts(vocab, 5, seed=1)[-1], GREEDY))
    while engine.has_unfinished:
        engine.step()
    trace = [r for r in engine.step_trace if r.step > first_step]
    late_first_token = next(r.step for r in trace if "late" in r.sampled)
    early_finished = [r.step for r in trace for rid in r.finished if rid.startswith("early")]
    assert len(early_finished) == 4
    assert late_first_token < min(early_finished)
    # and it ran in the same steps as the early ones (continuous batching, not a queue)
    assert any("late" in dict(r.scheduled) and "early-0" in dict(r.scheduled) for r in trace)
    assert_no_leaks(llm)


def test_small_kv_pool_preempts_and_still_gives_the_same_outputs(model_dir, llm):
    batch = prompts(llm.engine.runner.arch.vocab_size)
    expected = [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY)]
    small = make_llm(model_dir, num_kv_blocks=12, enable_prefix_caching=False)  # 192 tokens for 16 requests
    got = [o.outputs[0].token_ids for o in small.generate(batch, GREEDY)]
    assert small.engine.scheduler.num_preemptions > 0
    assert got == expected
    assert_no_leaks(small)


def test_chunked_prefill_gives_the_same_outputs(model_dir, llm):
    batch = prompts(llm.engine.runner.arch.vocab_size)
    expected = [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY)]
    chunked = make_llm(model_dir, max_num_batched_tokens=20, max_num_seqs=8)
    got = [o.outputs[0].token_ids for o in chunked.generate(batch, GREEDY)]
    assert max(n for r in chunked.engine.step_trace for _, n in r.scheduled) <= 20
    assert got == expected
    assert_no_leaks(chunked)


def test_prefix_cache_hit_computes_fewer_tokens_and_same_output(model_dir):
    llm = make_llm(model_dir)
    engine = llm.engine
    vocab = engine.runner.arch.vocab_size
    prefix = prompts(vocab, 16, seed=3)[13]  # 64 tokens
    first = [*prefix, 5, 6, 7]
    second = [*prefix, 9, 10, 11, 12]
    llm.generate([first], GREEDY)
    before = engine.stats.num_prompt_tokens_computed
    [hit] = llm.generate([second], GREEDY)
    computed = engine.stats.num_prompt_tokens_computed - before
    assert hit.num_cached_tokens == 64
    assert computed == len(second) - 64
    cold = make_llm(model_dir, enable_prefix_caching=False).generate([second], GREEDY)[0]
    assert hit.outputs[0].token_ids == cold.outputs[0].token_ids
    assert_no_leaks(llm)


def test_prefix_cache_never_hits_across_adapter_digests(model_dir):
    llm = make_llm(model_dir)
    engine = llm.engine
    prefix = prompts(engine.runner.arch.vocab_size, 16, seed=3)[13]
    engine.add_request(EngineRequest("base", [*prefix, 5], GREEDY, adapter_digest=None))
    while engine.has_unfinished:
        engine.step()
    before = engine.stats.num_prompt_tokens_computed
    engine.add_request(EngineRequest("other", [*prefix, 5], GREEDY, adapter_digest="sha256:other"))
    outputs = []
    while engine.has_unfinished:
        outputs += engine.step()
    assert outputs[-1].num_cached_tokens == 0
    assert engine.stats.num_prompt_tokens_computed - before == len(prefix) + 1
    assert_no_leaks(llm)


def test_n4_shares_prompt_blocks_and_seed_reproduces(llm):
    engine = llm.engine
    prompt = prompts(engine.runner.arch.vocab_size, 16)[14]  # 80 tokens: 5 full blocks
    params = SamplingParams(n=4, temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True)
    engine.add_request(EngineRequest("n4", prompt, params))
    free_before = engine.block_manager.num_free_blocks
    while engine.groups["n4"].needs_fork:
        engine.step()
    seqs = engine.groups["n4"].seqs
    shared = seqs[0].block_table[:5]
    assert all(s.block_table[:5] == shared for s in seqs)
    assert all(engine.block_manager.ref_counts[b] == 4 for b in shared)
    engine.step()  # each sample writes its own token into its own (copied-on-write) last block
    used = free_before - engine.block_manager.num_free_blocks
    assert used < 4 * len(seqs[0].block_table)  # sharing: far fewer blocks than 4 separate copies
    while engine.has_unfinished:
        engine.step()
    assert_no_leaks(llm)
    first = llm.generate([prompt], params)[0]
    again = llm.generate([prompt], params)[0]
    samples = [o.token_ids for o in first.outputs]
    assert len(samples) == 4 and all(len(s) == 8 for s in samples)
    assert samples == [o.token_ids for o in again.outputs]
    assert len({tuple(s) for s in samples}) > 1  # the four samples differ from each other


def test_stop_string_is_cut_and_max_tokens_respected(llm):
    engine = llm.engine
    prompt = prompts(engine.runner.arch.vocab_size, 16)[6]
    [free_run] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    text = free_run.outputs[0].text
    assert len(free_run.outputs[0].token_ids) == 20 and free_run.outputs[0].finish_reason == "length"
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    [stopped] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20, stop=[stop], ignore_eos=True))
    out = stopped.outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    assert stop not in out.text


def test_stop_token_ids(llm):
    prompt = prompts(llm.engine.runner.arch.vocab_size, 16)[6]
    [free_run] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    ids = free_run.outputs[0].token_ids
    [stopped] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[ids[4]]))
    assert stopped.outputs[0].token_ids == ids[: ids.index(ids[4]) + 1]
    assert stopped.outputs[0].stop_reason == ids[4]


def test_bad_prompts_get_clear_errors_and_harm_nobody(llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="maximum context length is 512"):
        llm.generate([[5] * 600], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[10**6]], GREEDY)
    with pytest.raises(ValueError, match="'top_p'"):
        SamplingParams(top_p=0)
    [ok] = llm.generate([[5, 6, 7]], GREEDY)
    assert len(ok.outputs[0].token_ids) == 24
    assert_no_leaks(llm)


def test_prompt_forms(llm):
    text = "Alice was beginning"
    ids = llm.tokenizer.encode(text)
    a, b, c = llm.generate([text, ids, {"prompt_token_ids": ids}], GREEDY)
    assert a.prompt_token_ids == ids and a.prompt == text
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
    assert a.num_prompt_tokens == len(ids) and a.num_completion_tokens == 24


def test_detokenize_false_gives_ids_only_and_still_finishes(llm):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, detokenize=False)
    [out] = llm.generate([[5, 6, 7]], params)
    assert len(out.outputs[0].token_ids) == 6 and out.outputs[0].text == ""
    assert out.outputs[0].finish_reason == "length"
    assert_no_leaks(llm)


def test_abort_mid_decode_frees_everything_and_others_finish(llm):
    engine = llm.engine
    batch = prompts(engine.runner.arch.vocab_size, 8)
    for i, p in enumerate(batch):
        engine.add_request(EngineRequest(f"a{i}", p, GREEDY))
    for _ in range(4):
        engine.step()
    for i in range(0, 8, 2):
        final = engine.abort(f"a{i}")
        assert final.finished and final.outputs[0].finish_reason == "abort"
    assert engine.abort("a0") is None  # already gone
    done = []
    while engine.has_unfinished:
        done += [o.request_id for o in engine.step() if o.finished]
    assert sorted(done) == [f"a{i}" for i in range(1, 8, 2)]
    assert_no_leaks(llm)


def test_budget_smaller_than_max_num_seqs_is_refused(model_dir):
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_llm(model_dir, max_num_seqs=64, max_num_batched_tokens=32)


def test_default_step_budget_follows_the_device(model_dir, monkeypatch):
    assert EngineConfig(model=str(model_dir), device="cpu").max_num_batched_tokens == 2048
    assert EngineConfig(model=str(model_dir), device="cpu", max_num_seqs=4096).max_num_batched_tokens == 4096
    assert (
        EngineConfig(
            model=str(model_dir), device="cpu", max_num_seqs=8, max_num_batched_tokens=64
        ).max_num_batched_tokens
        == 64
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the config only reads the device's name
    assert EngineConfig(model=str(model_dir), device="cuda").max_num_batched_tokens == 8192


def test_logprobs_come_with_each_token(llm):
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=3)
    [out] = llm.generate([[5, 6, 7, 8]], params)
    logprobs = out.outputs[0].logprobs
    assert len(logprobs) == 5
    for token_id, lp in zip(out.outputs[0].token_ids, logprobs):
        assert lp.token_id == token_id and len(lp.top_logprobs) == 3
        assert max(lp.top_logprobs, key=lp.top_logprobs.get) == token_id  # greedy picks the top one
        assert lp.logprob == pytest.approx(lp.top_logprobs[token_id]) and lp.logprob <= 0


def test_kv_pool_is_sized_from_the_memory_budget(model_dir):
    small = make_llm(model_dir, num_kv_blocks=None, kv_cache_memory=1 << 20)
    arch, bs = small.engine.runner.arch, small.engine.config.block_size
    per_block = 2 * arch.num_layers * bs * arch.num_kv_heads * arch.head_dim * 4  # fp32 K and V
    assert small.engine.block_manager.num_blocks == (1 << 20) // per_block
    assert small.engine.max_model_len == min(512, small.engine.block_manager.num_blocks * bs)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_fp32(model_dir, llm, dtype):
    from tests.test_oracle import our_prompt_logits

    half = make_llm(model_dir, dtype=dtype)
    prompt = prompts(llm.engine.runner.arch.vocab_size)[-1]
    expected = our_prompt_logits(llm, prompt)
    got = our_prompt_logits(half, prompt)
    assert got.dtype == torch.float32 and half.engine.runner.kv_cache.dtype == getattr(torch, dtype)
    assert (got - expected).abs().max() < 0.1 * expected.abs().max()
    [out] = half.generate([prompt], GREEDY)
    assert len(out.outputs[0].token_ids) == 24


def test_the_cpu_engine_takes_every_usable_core_unless_told(model_dir, monkeypatch):
    """By default the team is every core this process may use (its governor then gives way to other processes);
    cpu_threads caps it."""
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr("engine.config.usable_cores", lambda: 3)
        LLM(model=str(model_dir), device="cpu", num_kv_blocks=8, cpu_threads_adapt=False)
        assert torch.get_num_threads() == 3
        assert EngineConfig(model=str(model_dir), device="cpu").cpu_threads == 3
        LLM(model=str(model_dir), device="cpu", num_kv_blocks=8, cpu_threads=2)
        assert torch.get_num_threads() == 2
        with pytest.raises(ValueError, match="cpu_threads"):
            EngineConfig(model=str(model_dir), cpu_threads=0)
    finally:
        torch.set_num_threads(before)


def test_cpu_attention_is_the_cpp_decode_kernel_where_it_builds(model_dir, cpu_kernel):
    """auto on CPU: the cpu backend (torch + the C++ decode kernel) for float32 and bfloat16 where the kernel
    builds, else torch (float16 has no kernel)."""
    expected = "cpu" if cpu_kernel is not None else "torch"
    assert EngineConfig(model=str(model_dir), device="cpu").attention_backend == expected
    assert EngineConfig(model=str(model_dir), device="cpu", dtype="bfloat16").attention_backend == expected
    assert EngineConfig(model=str(model_dir), device="cpu", dtype="float16").attention_backend == "torch"
    assert EngineConfig(model=str(model_dir), device="cpu", attention_backend="torch").attention_backend == "torch"


def test_a_long_running_engine_keeps_only_its_last_steps_in_the_trace(llm):
    engine = llm.engine
    prompt = prompts(engine.runner.arch.vocab_size, 1)[0]
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    first = engine.stats.num_steps
    for i in range(3):  # one after another: ~600 steps
        engine.add_request(EngineRequest(f"long-{i}", prompt, params))
        while engine.has_unfinished:
            engine.step()
    assert engine.stats.num_steps - first > STEP_TRACE_LEN
    assert len(engine.step_trace) == STEP_TRACE_LEN
    assert [r.step for r in engine.step_trace] == list(
        range(engine.stats.num_steps - STEP_TRACE_LEN + 1, engine.stats.num_steps + 1)
    )
    assert "long-2" in engine.step_trace[-1].finished
