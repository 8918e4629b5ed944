"""Structured outputs in the engine: the output of a constrained request follows its JSON schema, regex, choice or
grammar; greedy tokens and logprobs are those of transformers + peft with the same grammar's mask applied step by
step (llguidance's own matcher, driven here), in mixed batches of adapters, constrained and free rows; a grammar
that does not compile is refused at the door; nothing else in the batch changes."""

from __future__ import annotations

import copy
import json
import math
import re

import llguidance
import llguidance.hf
import llguidance.torch
import pytest
import torch
from peft import LoraConfig, PeftModel

from adapters.ref import LoRARequest
from engine.llm import LLM
from engine.sampling_params import SamplingParams, StructuredOutputError, StructuredOutputsParams
from engine.structured_outputs import GrammarCompiler, allowed_tokens
from tests.hf_models import make_adapter, make_model
from tests.test_oracle import prompts

EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2}"
CHOICES = ["yes", "no", "maybe"]
LARK = 'start: "(" num ("," num)* ")"\nnum: /[0-9]/'
GBNF = 'root ::= "<" [a-c]+ ">"'


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tokenizer):
    directory = tmp_path_factory.mktemp("structured")
    hf = make_model(directory / "base", tokenizer)
    hf.generation_config.eos_token_id = None
    paths = {
        "r8": make_adapter(hf, directory / "r8", 1, config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")),
        "r4": make_adapter(hf, directory / "r4", 2, config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])),
    }
    peft_model = PeftModel.from_pretrained(copy.deepcopy(hf), paths["r8"], adapter_name="r8")
    peft_model.load_adapter(paths["r4"], adapter_name="r4")
    peft_model.eval()
    llm = LLM(
        model=str(directory / "base"), device="cpu", dtype="float32", num_kv_blocks=256, enable_lora=True, max_loras=2
    )
    loras = {name: LoRARequest(name, path) for name, path in paths.items()}
    return peft_model, llm, loras, tokenizer


def reference(peft_model, tokenizer, adapter, prompt, grammar, max_tokens, num_logprobs=None):
    """Greedy decoding with transformers + peft, the grammar's mask applied to each step's logits by a matcher of
    llguidance's own; returns the tokens and each one's logprob under the masked logits."""
    vocab = peft_model.config.vocab_size
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=[EOS])
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0) if grammar else None
    ids, tokens, logprobs = list(prompt), [], []
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = peft_model(torch.tensor([ids]), adapter_names=[adapter or "__base__"]).logits[0, -1]
        if matcher is not None:
            words = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
            llguidance.torch.fill_next_token_bitmask(matcher, words, 0)
            allowed = torch.tensor([(int(words[0, t // 32]) >> (t % 32)) & 1 == 1 for t in range(vocab)])
            logits = logits.masked_fill(~allowed, -math.inf)
        token = int(logits.argmax())
        tokens.append(token)
        logprobs.append(torch.log_softmax(logits, -1)[token].item())
        ids.append(token)
        if matcher is not None:
            assert matcher.consume_token(token)
            if matcher.is_stopped():
                break
        if token == EOS:
            break
    return tokens, logprobs


def grammar_of(kind: str, value) -> str:
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(value))
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(value))
    return llguidance.grammar_from("grammar", value)


def test_params_shape_is_checked():
    assert StructuredOutputsParams(regex="a+").kind == "regex"
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    for options, words in [
        ({}, "exactly one"),
        ({"regex": "a", "choice": ["a"]}, "regex, choice"),
        ({"choice": []}, "non-empty list"),
        ({"choice": ["a", ""]}, "non-empty string"),
        ({"choice": "abc"}, "list"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": [1]}, "JSON schema"),
        ({"regex": ""}, "non-empty"),
        ({"grammar": "  "}, "non-empty"),
    ]:
        with pytest.raises(ValueError, match=words):
            StructuredOutputsParams(**options)


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"regex": "a(b"}, "unclosed group"),
        ({"json": {"type": "object", "properties": 5}}, "properties must be an object"),
        ({"grammar": "start: undefined_rule"}, "undefined_rule"),
        ({"json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}, "nowhere"),
    ],
)
def test_a_grammar_that_does_not_compile_is_refused_naming_why(setup, options, words):
    _, llm, _, _ = setup
    with pytest.raises(StructuredOutputError, match=words):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**options)))
    assert not llm.engine.has_unfinished


def test_outputs_follow_their_schema_regex_choice_and_grammars(setup):
    _, llm, _, _ = setup
    cases = {  # JSON without whitespace: random weights would take any whitespace allowed (the oracle test does)
        "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
        "compact": StructuredOutputsParams(json=json.dumps(SCHEMA), disable_any_whitespace=True),
        "regex": StructuredOutputsParams(regex=REGEX),
        "choice": StructuredOutputsParams(choice=CHOICES),
        "lark": StructuredOutputsParams(grammar=LARK),
        "gbnf": StructuredOutputsParams(grammar=GBNF),
    }
    batch = prompts(llm.engine.runner.arch.vocab_size, len(cases), seed=3)
    params = [SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=so) for so in cases.values()]
    outs = dict(zip(cases, (o.outputs[0] for o in llm.generate(batch, params))))
    for name, out in outs.items():
        assert out.finish_reason == "stop", (name, out.text)
    for name in ("json", "compact"):
        value = json.loads(outs[name].text)
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 9, outs[name].text
    assert not re.search(r"\s", outs["json"].text + outs["compact"].text)
    assert re.fullmatch(REGEX, outs["regex"].text)
    assert outs["choice"].text in CHOICES
    assert re.fullmatch(r"\([0-9](,[0-9])*\)", outs["lark"].text)
    assert re.fullmatch(r"<[a-c]+>", outs["gbnf"].text)


@pytest.mark.parametrize(
    ("options", "form"),
    [
        ({"json": SCHEMA}, '{"ok": true, "n": 3}'),
        ({"regex": REGEX}, "123-ab"),
        ({"choice": CHOICES}, "maybe"),
        ({"grammar": LARK}, "(1,2)"),
        ({"grammar": GBNF}, "<abc>"),
    ],
)
def test_reasoning_first_leaves_room_to_think_before_the_form(setup, options, form):
    """reasoning_first: "required" takes any text up to the first </think> (and whitespace) before the form, and
    not the form alone; "optional" the form alone or after <think>...</think>; neither lets the reasoning hold a
    second </think> nor lets the form be skipped; the engine's greedy tokens are transformers + peft's under the
    composed grammar's mask."""
    peft_model, llm, _, tokenizer = setup
    compiler = GrammarCompiler(tokenizer, llm.engine.runner.arch.vocab_size, {EOS})

    def takes(params: StructuredOutputsParams, text: str) -> bool:
        matcher = llguidance.LLMatcher(compiler.tokenizer(), compiler.compile(params), log_level=0)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()

    texts = [form, "Let me see.</think>\n\n" + form, "<think>Hmm: <b>.</think>" + form, "a</think>b</think>" + form]
    texts.append("Thinking, and never done")
    expected = {None: [True] + [False] * 4, "required": [False, True, True, False, False]}
    expected["optional"] = [True, False, True, False, False]
    for first, verdicts in expected.items():
        params = StructuredOutputsParams(**options, reasoning_first=first)
        assert [takes(params, t) for t in texts] == verdicts, first
    with pytest.raises(ValueError, match="reasoning_first"):
        StructuredOutputsParams(**options, reasoning_first="always")
    so = StructuredOutputsParams(**options, reasoning_first="required")
    prompt = prompts(llm.engine.runner.arch.vocab_size, 1, seed=5)[0]
    (out,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=so))
    tokens, _ = reference(peft_model, tokenizer, None, prompt, compiler.compile(so), 12)
    assert out.outputs[0].token_ids == tokens


def test_sampled_and_n_samples_follow_the_grammar(setup):
    _, llm, _, _ = setup
    so = StructuredOutputsParams(regex=r"[a-z]{2,5}[0-9]")
    params = SamplingParams(temperature=1.5, top_k=50, seed=7, n=4, max_tokens=16, structured_outputs=so)
    (out,) = llm.generate([prompts(llm.engine.runner.arch.vocab_size, 1, seed=4)[0]], params)
    texts = [c.text for c in out.outputs]
    assert len(texts) == 4 and all(re.fullmatch(r"[a-z]{2,5}[0-9]", t) for t in texts), texts
    assert len(set(texts)) > 1  # each sample drew its own tokens under its own matcher


def test_mixed_batch_matches_peft_with_the_grammar_mask(setup):
    """Constrained and free rows, on the base and both adapters, in one batch: greedy tokens identical to the
    reference, and the constrained rows' logprobs those of the masked logits (fp32, 1e-4)."""
    peft_model, llm, loras, tokenizer = setup
    jobs = [
        (None, "regex", REGEX),
        ("r8", "json", SCHEMA),
        (None, None, None),
        ("r8", "choice", CHOICES),
        ("r4", "grammar", LARK),
        ("r4", None, None),
        (None, "grammar", GBNF),
    ]
    batch = prompts(llm.engine.runner.arch.vocab_size, len(jobs), seed=11)
    params = []
    for _, kind, value in jobs:
        so = StructuredOutputsParams(**{kind: value}) if kind else None
        params.append(SamplingParams(temperature=0.0, max_tokens=24, logprobs=0, structured_outputs=so))
    ours = llm.generate(batch, params, lora_request=[loras.get(adapter) for adapter, _, _ in jobs])
    for prompt, (adapter, kind, value), out in zip(batch, jobs, ours):
        grammar = grammar_of(kind, value) if kind else None
        tokens, logprobs = reference(peft_model, tokenizer, adapter, prompt, grammar, 24)
        got = out.outputs[0]
        assert got.token_ids == tokens, (adapter, kind)
        assert [lp.logprob for lp in got.logprobs] == pytest.approx(logprobs, abs=1e-4), (adapter, kind)
    assert llm.engine.adapter_cache.num_pinned == 0 and not llm.engine.groups


def test_a_constrained_row_leaves_the_free_rows_as_they_run_alone(setup):
    _, llm, loras, _ = setup
    batch = prompts(llm.engine.runner.arch.vocab_size, 3, seed=21)
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    alone = llm.generate(batch[:2], free, lora_request=[None, loras["r8"]])
    constrained = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex="x+"))
    mixed = llm.generate(batch, [free, free, constrained], lora_request=[None, loras["r8"], None])
    for a, m in zip(alone, mixed[:2]):
        assert a.outputs[0].token_ids == m.outputs[0].token_ids
        assert [lp.logprob for lp in a.outputs[0].logprobs] == [lp.logprob for lp in m.outputs[0].logprobs]
    assert re.fullmatch("x+", mixed[2].outputs[0].text)


def test_allowed_tokens_unpacks_each_bit_to_its_token(setup):
    """The mask of a choice grammar at its start allows exactly the tokens that begin some choice (by their text)."""
    _, llm, _, tokenizer = setup
    compiler = GrammarCompiler(tokenizer, llm.engine.runner.arch.vocab_size, {EOS})
    matcher = compiler.matcher(compiler.compile(StructuredOutputsParams(choice=CHOICES)))
    mask = allowed_tokens([None, matcher, None], compiler.vocab_size, torch.device("cpu"))
    assert mask.rows == [1] and mask.refused.shape == (1, compiler.vocab_size)
    allowed = set((~mask.refused[0]).nonzero().squeeze(1).tolist())
    texts = {t: tokenizer.decode([t]) for t in range(len(tokenizer))}
    expected = {t for t, text in texts.items() if text and any(c.startswith(text) for c in CHOICES)}
    assert allowed == expected


def test_bans_join_the_grammars_mask(setup):
    """min_tokens' banned tokens are refused beside a grammar's, on rows with a grammar and without."""
    _, llm, _, tokenizer = setup
    compiler = GrammarCompiler(tokenizer, llm.engine.runner.arch.vocab_size, {EOS})
    matcher = compiler.matcher(compiler.compile(StructuredOutputsParams(regex="[a-z]+")))
    vocab = compiler.vocab_size
    mask = allowed_tokens([None, matcher, None], vocab, torch.device("cpu"), [{EOS, 7}, {9}, set()])
    assert mask.rows == [0, 1]
    assert set(mask.refused[0].nonzero().squeeze(1).tolist()) == {EOS, 7}
    grammar_only = allowed_tokens([matcher], vocab, torch.device("cpu")).refused[0]
    assert mask.refused[1].tolist() == grammar_only.index_fill(0, torch.tensor([9]), True).tolist()
    assert allowed_tokens([None], vocab, torch.device("cpu"), [set()]) is None


def test_a_token_the_grammar_refuses_fails_that_request_alone(setup, monkeypatch):
    """Were the sampler to give a token outside the grammar (a bug), that request fails with a message naming the
    grammar, and the request beside it finishes."""
    _, llm, _, _ = setup
    import engine.step_forward as step_forward

    monkeypatch.setattr(step_forward, "allowed_tokens", lambda *args: None)  # the mask is lost
    engine = llm.engine
    batch = prompts(engine.runner.arch.vocab_size, 2, seed=31)
    constrained = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="x"))
    free = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(batch, [constrained, free])
    assert outs[0].error is not None and "grammar" in str(outs[0].error)
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 8
