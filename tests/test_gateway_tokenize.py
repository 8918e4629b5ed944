"""vLLM's /tokenize and /detokenize, and OpenAI's retrieve (`GET /v1/models/{id}`), through a live server: the ids
are the served tokenizer's and a chat's are the ones its completion is given (the adapter's own template
included), a prompt over the context is counted rather than refused, bad input is a 4xx naming the field."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from tokenizers import processors
from transformers import AutoTokenizer

from tests.gateway_server import BASE, ServerThread, build_tiny, settings_for
from tests.test_gateway_admin import assert_openai_error

ADAPTER_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] | upper }} {% endfor %}"
MAX_MODEL_LEN = 64
TEXT = "Alice was beginning to get very tired of sitting by her sister"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a rabbit hole?"}]
RENDERED = "<system> BE BRIEF. <user> WHAT IS A RABBIT HOLE? "  # MESSAGES in ADAPTER_TEMPLATE


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer):
    root, hf, adapters = build_tiny(tmp_path_factory.mktemp("tokenize"), tokenizer, {"sql": 4, "templated": 8})
    (root / "adapters" / "templated" / "chat_template.jinja").write_text(ADAPTER_TEMPLATE)
    return root, hf, adapters


@pytest.fixture(scope="module")
def served_tokenizer(tiny):
    """The base's tokenizer, made to start every text with <s> as Llama's does (so add_special_tokens shows)."""
    root = tiny[0]
    served = AutoTokenizer.from_pretrained(root / "base")
    served._tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", served.bos_token_id)]
    )
    served.save_pretrained(root / "base")
    return AutoTokenizer.from_pretrained(root / "base")


@pytest.fixture(scope="module")
def server(tiny, served_tokenizer):
    root, _, adapters = tiny
    with ServerThread(settings_for(root, adapters, max_model_len=MAX_MODEL_LEN)) as running:
        yield running


def test_a_prompt_gets_the_served_tokenizers_ids(http, served_tokenizer):
    with_special = served_tokenizer.encode(TEXT)
    body = http.post("/tokenize", json={"prompt": TEXT}).json()
    assert body == {
        "count": len(with_special),
        "max_model_len": MAX_MODEL_LEN,
        "tokens": with_special,
        "token_strs": None,
    }
    plain = served_tokenizer.encode(TEXT, add_special_tokens=False)
    assert with_special == [served_tokenizer.bos_token_id, *plain]
    body = http.post(
        "/tokenize", json={"model": "sql", "prompt": TEXT, "add_special_tokens": False, "return_token_strs": True}
    )
    assert body.json()["tokens"] == plain
    assert body.json()["token_strs"] == served_tokenizer.convert_ids_to_tokens(plain)


def test_a_prompt_over_the_context_is_counted_where_a_completion_is_refused(http, served_tokenizer):
    long = " ".join([TEXT] * 8)
    body = http.post("/tokenize", json={"prompt": long}).json()
    assert body["count"] == len(served_tokenizer.encode(long)) > MAX_MODEL_LEN
    refused = http.post("/v1/completions", json={"model": BASE, "prompt": long, "max_tokens": 1})
    assert assert_openai_error(refused, 400, "prompt")["code"] == "context_length_exceeded"


@pytest.mark.parametrize("model", [BASE, "sql", "templated"])
def test_a_chat_counts_the_tokens_its_completion_is_given(http, served_tokenizer, model):
    body = http.post("/tokenize", json={"model": model, "messages": MESSAGES}).json()
    if model == "templated":  # the adapter's own template, as for its chat completions
        expected = RENDERED
    else:
        expected = served_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        assert expected != RENDERED
    assert body["tokens"] == served_tokenizer.encode(expected, add_special_tokens=False)
    chat = http.post("/v1/chat/completions", json={"model": model, "messages": MESSAGES, "max_tokens": 1})
    assert chat.json()["usage"]["prompt_tokens"] == body["count"]
    without = http.post("/tokenize", json={"model": model, "messages": MESSAGES, "add_generation_prompt": False})
    if model != "templated":  # the base template writes an assistant header when asked to
        assert without.json()["count"] < body["count"]


def test_detokenize_gives_the_tokenizers_text(http, served_tokenizer):
    ids = http.post("/tokenize", json={"prompt": TEXT, "add_special_tokens": False}).json()["tokens"]
    body = http.post("/detokenize", json={"model": "sql", "tokens": ids}).json()
    assert body == {"prompt": served_tokenizer.decode(ids)} and body["prompt"].strip() == TEXT
    assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


def test_bad_input_is_a_4xx_naming_the_field_and_the_server_goes_on(http, served_tokenizer):
    vocab = len(served_tokenizer)
    cases = [
        ("/tokenize", {}, 400, "prompt", "either prompt or messages"),
        ("/tokenize", {"prompt": "x", "messages": MESSAGES}, 400, "messages", "not both"),
        ("/tokenize", {"prompt": 5}, 400, "prompt", ""),
        ("/tokenize", {"messages": []}, 400, "messages", ""),
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model", "does not exist"),
        ("/tokenize", {"messages": MESSAGES, "tools": [{"type": "function"}]}, 400, "tools", "tools[0] must be"),
        ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, 400, "continue_final_message", ""),
        ("/tokenize", {"prompt": "\udfff"}, 400, "prompt", "unicode"),
        ("/detokenize", {"tokens": [1, vocab]}, 400, "tokens", f"token {vocab} at index 1"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens", "not in the vocabulary"),
        ("/detokenize", {"tokens": ["a"]}, 400, "tokens.0", ""),
        ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model", ""),
    ]
    for route, body, status, param, text in cases:  # json.dumps writes the lone surrogate as JSON's \udfff
        response = http.post(route, content=json.dumps(body), headers={"Content-Type": "application/json"})
        assert_openai_error(response, status, param, text)
    assert http.post("/tokenize", json={"prompt": TEXT}).status_code == 200
    assert http.post("/v1/completions", json={"model": "sql", "prompt": TEXT, "max_tokens": 2}).status_code == 200


def test_models_are_retrieved_by_id_with_the_openai_client(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    listed = {m.id: m for m in client.models.list().data}
    for model in (BASE, "sql", "templated"):
        assert client.models.retrieve(model) == listed[model]
    assert client.models.retrieve(BASE).max_model_len == MAX_MODEL_LEN
    versioned = client.models.retrieve("sql@1")
    assert (versioned.id, versioned.root, versioned.parent) == ("sql@1", "sql@1", BASE)
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("sql@9")
    assert caught.value.body["code"] == "model_not_found"
    with httpx.Client(base_url=server.url, timeout=60) as http:  # a slash in an id is part of the id
        assert_openai_error(http.get("/v1/models/org/nope"), 404, "model", "'org/nope'")
