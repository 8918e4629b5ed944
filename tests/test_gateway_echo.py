"""Completions' `echo` and prompt logprobs through a live server with the `openai` client: the prompt before the
text, its tokens' logprobs before the choice's (the first without one) equal to peft's on the adapter's weights,
streamed or not, and vLLM's `prompt_logprobs` layout; what lm-eval-harness's loglikelihood requests send
(echo, logprobs=1, max_tokens=1)."""

from __future__ import annotations

import copy

import httpx
import openai
import pytest
import torch
from peft import PeftModel

from tests.gateway_server import BASE, ServerThread, build_tiny, settings_for

PROMPT = "Alice was beginning to get very tired of sitting by her sister on the bank"
SCORE = {"echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}  # lm-eval-harness's loglikelihood request


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer):
    return build_tiny(tmp_path_factory.mktemp("echo"), tokenizer, {"sql": 8})


@pytest.fixture(scope="module")
def server(tiny):
    with ServerThread(settings_for(tiny[0], tiny[2])) as running:  # the prefix cache on, as by default
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def peft_logprobs(tiny, tokenizer):
    """model -> peft's logprob of each token of PROMPT after the first, given those before it [P - 1]."""
    _, hf, adapters = tiny
    peft_model = PeftModel.from_pretrained(copy.deepcopy(hf), adapters["sql"], adapter_name="sql").eval()
    ids = tokenizer.encode(PROMPT)
    result = {}
    for model, adapter in ((BASE, "__base__"), ("sql", "sql")):
        with torch.no_grad():
            logits = peft_model(torch.tensor([ids]), adapter_names=[adapter]).logits[0]
        logprobs = logits.log_softmax(dim=-1)[:-1]  # [P - 1, V]
        result[model] = logprobs.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    return result


def test_echo_puts_the_prompt_before_the_same_completion(client, tokenizer):
    plain = client.completions.create(model="sql", prompt=PROMPT, max_tokens=6, temperature=0)
    echoed = client.completions.create(model="sql", prompt=PROMPT, max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    assert echoed.usage.prompt_tokens == plain.usage.prompt_tokens  # nothing more is counted
    ids = tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model="sql", prompt=ids, max_tokens=6, temperature=0, echo=True)
    assert by_ids.choices[0].text == tokenizer.decode(ids) + plain.choices[0].text
    stream = client.completions.create(model="sql", prompt=PROMPT, max_tokens=6, temperature=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == echoed.choices[0].text
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        client.completions.create(
            model="sql", prompt=PROMPT, max_tokens=6, temperature=0, echo=True, stream=True, stream_options=options
        )
    )
    assert chunks[0].choices[0].text == PROMPT and all(c.usage is not None for c in chunks)  # the echo's chunk too


@pytest.mark.parametrize("model", [BASE, "sql"])
def test_scoring_a_prompt_gives_peft_logprobs(client, tokenizer, peft_logprobs, model):
    ids = tokenizer.encode(PROMPT)
    for _ in range(2):  # the second time its blocks are in the prefix cache: the logprobs are computed all the same
        response = client.completions.create(model=model, prompt=PROMPT, **SCORE)
        assert response.usage.prompt_tokens_details.cached_tokens == 0
        choice = response.choices[0]
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids) + 1  # the prompt's tokens, then the one generated
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        got = torch.tensor(lp.token_logprobs[1 : len(ids)])
        torch.testing.assert_close(got, peft_logprobs[model], atol=1e-4, rtol=1e-4)
        assert lp.text_offset[len(ids)] == len(PROMPT) and lp.text_offset == sorted(lp.text_offset)
        assert all(len(top) >= 1 for top in lp.top_logprobs[1:])
        assert choice.text.startswith(PROMPT)
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=1)
    assert plain.usage.prompt_tokens_details.cached_tokens >= 16  # what the scored requests computed, cached


def test_every_streamed_choice_starts_with_its_prompt(client):
    prompts = [PROMPT, "The rabbit"]
    stream = client.completions.create(
        model="sql", prompt=prompts, n=2, max_tokens=4, echo=True, stream=True, extra_body={"ignore_eos": True}
    )
    texts: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert sorted(texts) == [0, 1, 2, 3]
    for index, text in texts.items():
        prompt = prompts[index // 2]
        assert text.startswith(prompt) and len(text) > len(prompt)


def test_a_streamed_score_is_the_whole_ones(client):
    whole = client.completions.create(model="sql", prompt=PROMPT, **SCORE).choices[0].logprobs
    chunks = [c.choices[0] for c in client.completions.create(model="sql", prompt=PROMPT, stream=True, **SCORE)]
    streamed = [c.logprobs for c in chunks if c.logprobs is not None]
    assert [t for lp in streamed for t in lp.tokens] == whole.tokens
    assert [t for lp in streamed for t in lp.token_logprobs] == whole.token_logprobs
    assert [t for lp in streamed for t in lp.text_offset] == whole.text_offset


def test_vllm_prompt_logprobs_layout(client, tokenizer, peft_logprobs):
    ids = tokenizer.encode(PROMPT)
    response = client.completions.create(
        model="sql", prompt=[PROMPT, PROMPT], max_tokens=2, temperature=0, n=2, extra_body={"prompt_logprobs": 2}
    )
    assert len(response.choices) == 4
    for choice in response.choices:
        assert choice.text and not choice.text.startswith(PROMPT)  # no echo asked
        layout = choice.prompt_logprobs
        assert len(layout) == len(ids) and layout[0] is None
        for position, entry in enumerate(layout[1:]):
            token = str(ids[position + 1])
            assert token in entry and len(entry) <= 3  # the token itself and the 2 best
            assert sorted(e["rank"] for e in entry.values())[:2] == [1, 2]  # the best two, ranked
            assert (entry[token]["rank"] <= 2) == (len(entry) == 2)  # the token is listed once, with its rank
            assert entry[token]["decoded_token"] == tokenizer.decode([ids[position + 1]])
            assert entry[token]["logprob"] == pytest.approx(peft_logprobs["sql"][position].item(), abs=1e-4)


def test_max_tokens_zero_scores_the_prompt_alone(client, tokenizer, peft_logprobs):
    """The older form of a loglikelihood request (lm-eval-harness before 0.4, OpenAI's legacy API): nothing is
    generated, nothing is counted as completion tokens."""
    response = client.completions.create(model="sql", prompt=PROMPT, echo=True, logprobs=0, max_tokens=0)
    choice = response.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    ids = tokenizer.encode(PROMPT)
    assert len(choice.logprobs.token_logprobs) == len(ids) and choice.logprobs.token_logprobs[0] is None
    got = torch.tensor(choice.logprobs.token_logprobs[1:])
    torch.testing.assert_close(got, peft_logprobs["sql"], atol=1e-4, rtol=1e-4)
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(ids), 0)
    without_echo = client.completions.create(model="sql", prompt=PROMPT, max_tokens=0)
    assert without_echo.choices[0].text == "" and without_echo.usage.completion_tokens == 0


def test_a_chats_prompt_logprobs_are_its_rendered_prompts(server, client):
    """vLLM's `prompt_logprobs` on a chat (the response's, and its stream's first chunk's): those of the prompt its
    template rendered, as /v1/completions scores those tokens."""
    messages = [{"role": "user", "content": PROMPT}]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        ids = http.post("/tokenize", json={"model": "sql", "messages": messages}).json()["tokens"]
        chat = http.post(
            "/v1/chat/completions", json={"model": "sql", "messages": messages, "max_tokens": 2, "prompt_logprobs": 0}
        ).json()
    layout = chat["prompt_logprobs"]
    assert len(layout) == len(ids) == chat["usage"]["prompt_tokens"] and layout[0] is None
    scored = client.completions.create(model="sql", prompt=ids, echo=True, logprobs=0, max_tokens=0).choices[0]
    got = [entry[str(token)]["logprob"] for entry, token in zip(layout[1:], ids[1:])]
    assert got == pytest.approx(scored.logprobs.token_logprobs[1:], abs=1e-6)
    stream = client.chat.completions.create(
        model="sql", messages=messages, max_tokens=2, stream=True, extra_body={"prompt_logprobs": 0}
    )
    first = next(iter(stream))
    assert first.model_extra["prompt_logprobs"] == layout
    assert all("prompt_logprobs" not in chunk.model_extra for chunk in stream)  # once


def test_echo_of_a_chat_is_refused(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="sql", messages=[{"role": "user", "content": "x"}], extra_body={"echo": True}
        )
    assert caught.value.body["param"] == "echo"
