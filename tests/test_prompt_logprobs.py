"""Prompt logprobs (SamplingParams.prompt_logprobs): each prompt token's logprob given those before it, against
peft on the same weights (fp32), in a mixed-adapter batch, across chunked prefills; never from the prefix cache
(whose blocks the request still registers for others); once per request, with its first token."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import PeftModel

from adapters.ref import LoRARequest
from engine import step_forward
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.hf_models import make_adapter, make_model
from tests.test_oracle import prompts

TOP = 3


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tokenizer):
    directory = tmp_path_factory.mktemp("prompt-logprobs")
    hf = make_model(directory / "base", tokenizer)
    paths = {name: make_adapter(hf, directory / name, seed, r=r) for name, seed, r in (("a", 1, 4), ("b", 2, 8))}
    peft_model = PeftModel.from_pretrained(copy.deepcopy(hf), paths["a"], adapter_name="a")
    peft_model.load_adapter(paths["b"], adapter_name="b")
    peft_model.eval()
    loras = {name: LoRARequest(name, path) for name, path in paths.items()}
    return directory, peft_model, loras


def engine(directory, **options) -> LLM:
    # 32 tokens a step: the longer prompts are computed in chunks
    values = dict(
        device="cpu", dtype="float32", num_kv_blocks=256, max_num_batched_tokens=32, max_num_seqs=16, enable_lora=True
    )
    return LLM(model=str(directory / "base"), max_loras=2, max_lora_rank=8, **{**values, **options})


def expected(peft_model, token_ids: list[int], adapter: str | None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """peft's logprob of each prompt token after the first [P - 1], each position's TOP best ids [P - 1, TOP], and
    each token's rank (1 + how many tokens score higher)."""
    with torch.no_grad():
        logits = peft_model(torch.tensor([token_ids]), adapter_names=[adapter or "__base__"]).logits[0]
    logprobs = logits.log_softmax(dim=-1)[:-1]  # [P - 1, V]: position p scores token p + 1
    chosen = logprobs.gather(1, torch.tensor(token_ids[1:]).unsqueeze(1))  # [P - 1, 1]
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    return chosen.squeeze(1), logprobs.topk(TOP).indices, ranks


def assert_matches(output, peft_model, adapter: str | None) -> None:
    ids = output.prompt_token_ids
    got = output.prompt_logprobs
    assert got is not None and len(got) == len(ids) and got[0] is None
    assert [lp.token_id for lp in got[1:]] == ids[1:]
    want, want_top, want_ranks = expected(peft_model, ids, adapter)
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in got[1:]]), want, atol=1e-4, rtol=1e-4)
    assert [list(lp.top_logprobs) for lp in got[1:]] == want_top.tolist()  # best first
    assert [lp.rank for lp in got[1:]] == want_ranks


def test_prompt_logprobs_match_peft_in_a_mixed_batch_across_chunks(setup):
    directory, peft_model, loras = setup
    llm = engine(directory)
    token_ids = prompts(llm.engine.runner.arch.vocab_size)  # 1 to 100 tokens
    adapters = [[None, "a", "b"][i % 3] for i in range(len(token_ids))]
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=TOP, ignore_eos=True)
    outputs = llm.generate(
        [{"prompt_token_ids": ids} for ids in token_ids],
        params,
        lora_request=[loras[a] if a else None for a in adapters],
    )
    for output, adapter in zip(outputs, adapters):
        assert_matches(output, peft_model, adapter)
        assert len(output.outputs[0].token_ids) == 2
    steps = [record.scheduled for record in llm.engine.step_trace]
    assert max(n for step in steps for _, n in step) <= 32 < max(len(ids) for ids in token_ids)  # in chunks


def test_prompt_logprobs_bypass_the_prefix_cache_and_leave_it_filled(setup):
    directory, peft_model, loras = setup
    llm = engine(directory, enable_prefix_caching=True)
    ids = prompts(llm.engine.runner.arch.vocab_size)[-1]  # 100 tokens: six full blocks of 16
    plain = SamplingParams(temperature=0.0, max_tokens=1)
    first = llm.generate([{"prompt_token_ids": ids}], plain, lora_request=loras["b"])[0]
    assert first.num_cached_tokens == 0 and first.prompt_logprobs is None
    scored = llm.generate(
        [{"prompt_token_ids": ids}],
        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0),
        lora_request=loras["b"],
    )[0]
    assert scored.num_cached_tokens == 0  # every position computed, so every logprob is there
    assert_matches_own_token_only(scored, peft_model, "b")
    again = llm.generate([{"prompt_token_ids": ids}], plain, lora_request=loras["b"])[0]
    assert again.num_cached_tokens == 96  # the cache still serves the others
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == scored.outputs[0].token_ids


def assert_matches_own_token_only(output, peft_model, adapter: str) -> None:
    want, _, _ = expected(peft_model, output.prompt_token_ids, adapter)
    got = output.prompt_logprobs
    assert all(lp.top_logprobs == {} for lp in got[1:])  # prompt_logprobs=0: the token's own only
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in got[1:]]), want, atol=1e-4, rtol=1e-4)


def test_n_samples_share_one_list_given_once_with_the_first_token(setup):
    directory, peft_model, loras = setup
    llm = engine(directory)
    ids = prompts(llm.engine.runner.arch.vocab_size)[-4]  # 47 tokens: two chunks
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=4, prompt_logprobs=1, ignore_eos=True)
    llm.engine.add_adapter(loras["a"])
    llm.engine.add_request(llm.to_request({"prompt_token_ids": ids}, params, loras["a"]))
    deltas = []
    while llm.engine.has_unfinished:
        deltas += llm.engine.step()
    given = [d for d in deltas if d.prompt_logprobs is not None]
    assert len(given) == 1 and given[0].outputs  # once, in the delta with the first tokens
    assert len(given[0].outputs) == 3
    assert_matches_top1(given[0], peft_model, "a")


def assert_matches_top1(output, peft_model, adapter: str) -> None:
    want, want_top, _ = expected(peft_model, output.prompt_token_ids, adapter)
    got = output.prompt_logprobs[1:]
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in got]), want, atol=1e-4, rtol=1e-4)
    assert [next(iter(lp.top_logprobs)) for lp in got] == want_top[:, 0].tolist()


def test_max_tokens_zero_computes_the_prompt_alone(setup):
    """Nothing generated, the prompt logprobs all there, and the prompt's blocks left in the prefix cache (a prefill
    that warms the cache)."""
    directory, peft_model, loras = setup
    llm = engine(directory, enable_prefix_caching=True)
    ids = prompts(llm.engine.runner.arch.vocab_size)[-1]  # 100 tokens
    scored = llm.generate(
        [{"prompt_token_ids": ids}],
        SamplingParams(n=2, max_tokens=0, prompt_logprobs=TOP, logprobs=1),
        lora_request=loras["a"],
    )[0]
    assert [(o.token_ids, o.text, o.logprobs, o.finish_reason) for o in scored.outputs] == [([], "", [], "length")] * 2
    assert scored.finished and llm.engine.stats.num_generated_tokens == 0
    assert_matches(scored, peft_model, "a")
    after = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1), lora_request=loras["a"])[0]
    assert after.num_cached_tokens == 96
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks  # nothing held


def test_prompt_logprobs_out_of_range_are_refused():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)


def test_preempted_requests_and_sliced_logits_keep_every_prompt_logprob(setup, monkeypatch):
    """A pool too small for the batch preempts requests (their prompts computed again, the known logprobs kept, none
    twice), and the logits of a chunk's positions are made a few rows at a time."""
    monkeypatch.setattr(step_forward, "PROMPT_LOGITS_ROWS", 5)
    directory, peft_model, loras = setup
    small = engine(directory, num_kv_blocks=12, enable_prefix_caching=True)  # 192 tokens for 16 prompts
    token_ids = prompts(small.engine.runner.arch.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=TOP, ignore_eos=True)
    outputs = small.generate([{"prompt_token_ids": ids} for ids in token_ids], params, lora_request=loras["b"])
    assert small.engine.scheduler.num_preemptions > 0
    for output in outputs:
        assert_matches(output, peft_model, "b")
