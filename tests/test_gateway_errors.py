"""Every documented error path of the OpenAI surface returns its status with an OpenAI-style body, and the
server keeps serving; chat templates: the adapter's own wins, a model without one gets a clear 400."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from tests.gateway_server import BASE, ServerThread, build_tiny, settings_for
from tests.test_gateway_admin import assert_openai_error, assert_still_serving

ADAPTER_TEMPLATE = "{% for m in messages %}{{ m['content'] | upper }} || {% endfor %}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer):
    root, hf, adapters = build_tiny(tmp_path_factory.mktemp("errors"), tokenizer, {"sql": 8, "templated": 4})
    (root / "adapters" / "templated" / "chat_template.jinja").write_text(ADAPTER_TEMPLATE)
    # a second base whose tokenizer has no chat template
    shutil.copytree(root / "base", root / "plain-base")
    config_path = root / "plain-base" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    for extra in (root / "plain-base").glob("chat_template.*"):
        extra.unlink()
    return root, hf, adapters


@pytest.fixture(scope="module")
def server(tiny):
    root, _, adapters = tiny
    with ServerThread(settings_for(root, adapters, max_model_len=64)) as running:
        yield running


CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3}


@pytest.mark.parametrize(
    ("body", "status", "param", "text"),
    [
        ({"model": "nope", "prompt": "x"}, 404, "model", "does not exist"),
        ({"model": BASE, "prompt": "x", "lora_request": {"lora_name": "nope"}}, 404, "lora_request.lora_name", ""),
        ({"model": "sql", "prompt": "x", "lora_request": {"lora_name": "sql"}}, 400, "lora_request", "base"),
        ({"model": "sql", "prompt": "x", "temperature": -1}, 400, "temperature", "non-negative"),
        ({"model": "sql", "prompt": "x", "top_p": 1.5}, 400, "top_p", ""),
        ({"model": "sql", "prompt": "x", "top_k": -5}, 400, "top_k", ""),
        ({"model": "sql", "prompt": "x", "min_p": 2}, 400, "min_p", ""),
        ({"model": "sql", "prompt": "x", "n": 0}, 400, "n", ""),
        ({"model": "sql", "prompt": "x", "presence_penalty": 3}, 400, "presence_penalty", ""),
        ({"model": "sql", "prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty", ""),
        ({"model": "sql", "prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty", ""),
        ({"model": "sql", "prompt": "x", "max_tokens": -1}, 400, "max_tokens", "non-negative"),
        ({"model": "sql", "prompt": "x", "max_tokens": "many"}, 400, "max_tokens", "integer"),
        ({"model": "sql", "prompt": "x", "logprobs": 50}, 400, "logprobs", ""),
        ({"model": "sql", "prompt": "x", "max_tokens": 2, "min_tokens": 5}, 400, "min_tokens", "at most max_tokens"),
        ({"model": "sql", "prompt": "x", "stop": [""]}, 400, "stop", ""),
        ({"model": "sql", "prompt": "x", "logit_bias": {"5": 1}}, 400, "logit_bias", "not supported"),
        ({"model": "sql", "prompt": "x", "echo": True, "logprobs": 21}, 400, "logprobs", "[0, 20]"),
        ({"model": "sql", "prompt": "x", "response_format": {"type": "yaml"}}, 400, "response_format", "'yaml'"),
        ({"model": "sql", "prompt": "x", "guided_json": {"type": "object", "properties": 5}}, 400, "guided_json", ""),
        ({"model": "sql", "prompt": "x", "guided_json": "{oops"}, 400, "guided_json", "not valid JSON"),
        ({"model": "sql", "prompt": "x", "guided_choice": []}, 400, "guided_choice", "non-empty list"),
        ({"model": "sql", "prompt": "x", "guided_regex": "a(b"}, 400, "guided_regex", "unclosed group"),
        ({"model": "sql", "prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}, 400, "guided_choice", "one"),
        (
            {"model": "sql", "prompt": "x", "structured_outputs": {"regex": "a", "json_object": 1}},
            400,
            "structured_outputs",
            "",
        ),
        ({"model": "sql", "prompt": "x", "structured_outputs": {"structural_tag": "t"}}, 400, "structured_outputs", ""),
        ({"model": "sql", "prompt": "x", "structured_outputs": "a+"}, 400, "structured_outputs", "an object"),
        ({"model": "sql", "prompt": "x", "use_beam_search": True}, 400, "use_beam_search", "not supported"),
        ({"model": "sql", "prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs", "[0, 20], got 21"),
        ({"model": "sql", "prompt": "x", "prompt_logprobs": "all"}, 400, "prompt_logprobs", "integer"),
        ({"model": "sql", "prompt": "x", "include_stop_str_in_output": True}, 400, "include_stop_str_in_output", ""),
        ({"model": "sql", "prompt": "x", "bad_words": ["no"]}, 400, "bad_words", "not supported"),
        ({"model": "sql", "prompt": "x", "allowed_token_ids": [5, 6]}, 400, "allowed_token_ids", "not supported"),
        ({"model": "sql", "prompt": "x", "truncate_prompt_tokens": 8}, 400, "truncate_prompt_tokens", "truncated"),
        ({"model": "sql", "prompt": "x", "add_special_tokens": False}, 400, "add_special_tokens", "always added"),
        ({"model": "sql", "prompt": "x " * 80}, 400, "prompt", "maximum context length is 64 tokens"),
        ({"model": "sql", "prompt": "x", "max_tokens": 100}, 400, "max_tokens", "maximum context length"),
        ({"model": "sql", "prompt": ""}, 400, "prompt", "empty"),
        ({"model": "sql", "prompt": []}, 400, "prompt", "empty"),
        ({"model": "sql", "prompt": [10**9]}, 400, "prompt", "vocabulary"),
        ({"prompt": "x"}, 400, "model", "required"),
        ({"model": "sql"}, 400, "prompt", "required"),
    ],
)
def test_completions_errors(http, body, status, param, text):
    for stream in (False, True):
        assert_openai_error(http.post("/v1/completions", json={**body, "stream": stream}), status, param, text)
    assert_still_serving(http)


@pytest.mark.parametrize(
    ("body", "status", "param", "text"),
    [
        ({"model": "sql", "messages": []}, 400, "messages", ""),
        ({"model": "sql", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role", ""),
        ({**CHAT, "model": "sql", "tools": [{"type": "function"}]}, 400, "tools", "tools[0] must be"),
        ({**CHAT, "model": "sql", "tool_choice": "required"}, 400, "tool_choice", "no tools are given"),
        ({**CHAT, "model": "sql", "functions": [{"name": "f"}]}, 400, "functions", "use tools"),
        ({**CHAT, "model": "sql", "function_call": {"name": "f"}}, 400, "function_call", "use tool_choice"),
        (
            {**CHAT, "model": "sql", "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            400,
            "response_format",
            "json_schema.schema",
        ),
        (
            {
                **CHAT,
                "model": "sql",
                "response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": 1}}},
            },
            400,
            "response_format",
            "JSON schema",
        ),
        ({**CHAT, "model": "sql", "guided_grammar": "root ::= undefined"}, 400, "guided_grammar", "undefined"),
        ({**CHAT, "model": "sql", "echo": True}, 400, "echo", "new message only"),
        ({**CHAT, "model": "sql", "prompt_logprobs": 25}, 400, "prompt_logprobs", "[0, 20], got 25"),
        ({**CHAT, "model": "sql", "continue_final_message": True}, 400, "continue_final_message", ""),
        ({**CHAT, "model": "sql", "add_special_tokens": True}, 400, "add_special_tokens", "chat template"),
        ({**CHAT, "model": "sql", "top_logprobs": 2}, 400, "top_logprobs", "logprobs"),
        ({**CHAT, "model": "sql", "logprobs": True, "top_logprobs": 30}, 400, "top_logprobs", "[0, 20], got 30"),
        ({**CHAT, "model": "sql", "min_tokens": 5}, 400, "min_tokens", "at most max_tokens (3)"),
        (
            {"model": "sql", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            400,
            "messages",
            "image_url",
        ),
        ({**CHAT, "model": "sql", "chat_template": "{{ x }}"}, 400, "chat_template", "trust-request-chat-template"),
        ({**CHAT, "model": "missing"}, 404, "model", ""),
    ],
)
def test_chat_errors(http, body, status, param, text):
    assert_openai_error(http.post("/v1/chat/completions", json=body), status, param, text)
    assert_still_serving(http)


def test_the_defaults_of_the_refused_fields_are_served(http):
    """A refused field holding the value that asks for what is served anyway (a "text" response_format, tool_choice
    "none" or "auto" with no tools, no beam search, an empty bad_words, the endpoint's own add_special_tokens) is
    served, not refused; and so is a field this server does not know."""
    served = {"response_format": {"type": "text"}, "use_beam_search": False, "bad_words": [], "prompt_logprobs": None}
    chat = {**CHAT, **served, "model": "sql", "tool_choice": "auto", "echo": False, "add_special_tokens": False}
    assert http.post("/v1/chat/completions", json=chat).status_code == 200
    assert http.post("/v1/chat/completions", json={**chat, "tool_choice": "none"}).status_code == 200
    completion = {**served, "model": "sql", "prompt": "x", "max_tokens": 2, "add_special_tokens": True}
    assert http.post("/v1/completions", json={**completion, "some_future_field": 1}).status_code == 200


def test_malformed_json_and_unknown_routes(http):
    response = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_openai_error(response, 400, text="not valid JSON")
    assert_openai_error(http.get("/v1/nothing-here"), 404, text="no route")
    assert_openai_error(http.get("/v1/completions"), 405)
    assert_still_serving(http)


def test_the_adapter_directory_template_wins(http, tokenizer):
    templated = http.post("/v1/chat/completions", json={**CHAT, "model": "templated"}).json()
    plain = http.post("/v1/chat/completions", json={**CHAT, "model": "sql"}).json()
    expected_adapter = len(tokenizer.encode("HELLO THERE || ", add_special_tokens=False))
    base_text = tokenizer.apply_chat_template(CHAT["messages"], tokenize=False, add_generation_prompt=True)
    assert templated["usage"]["prompt_tokens"] == expected_adapter
    assert plain["usage"]["prompt_tokens"] == len(tokenizer.encode(base_text, add_special_tokens=False))


def test_a_model_without_a_chat_template_gets_a_clear_400(tiny):
    root = tiny[0]
    settings = settings_for(root, {}, model=str(root / "plain-base"), database_url=f"sqlite:///{root / 'plain.db'}")
    with ServerThread(settings) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        assert_openai_error(
            http.post("/v1/chat/completions", json={**CHAT, "model": BASE}), 400, "messages", "--chat-template"
        )
        assert http.post("/v1/completions", json={"model": BASE, "prompt": "x", "max_tokens": 2}).status_code == 200
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with (
        ServerThread(settings.model_copy(update={"chat_template": template})) as server,
        httpx.Client(base_url=server.url, timeout=60) as http,
    ):
        assert http.post("/v1/chat/completions", json={**CHAT, "model": BASE}).status_code == 200


def test_a_partial_utf8_token_shows_as_bytes_in_logprobs(tokenizer):
    """OpenAI's convention: a token that is only part of a character is `bytes:\\xNN`, never a bare U+FFFD, so two
    such tokens stay two entries of `top_logprobs`; the chat layout gives the token's own bytes."""
    from gateway.openai_format import TokenText

    text = TokenText(tokenizer)
    ids = tokenizer.encode("東 é", add_special_tokens=False)
    partial = [i for i in ids if text(i).startswith("bytes:")]
    assert len(partial) >= 2 and len({text(i) for i in partial}) == len(set(partial))
    assert b"".join(text.lookup(i)[1] for i in ids) == "東 é".encode()
    assert all("\ufffd" not in text(i) for i in ids)
    assert text(tokenizer.encode(" the", add_special_tokens=False)[0]) == " the"
