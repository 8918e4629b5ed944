"""Fuzzing the whole HTTP surface from its own `/openapi.json`: 1,000 generated requests (schemathesis draws them
from each operation's schema, hypothesis picks operations and twists one value in most of them: NaN, Infinity,
huge or negative numbers, lone surrogates, wrong types, empty or deep values) against a real server. None may
get a 5xx, and the server serves a normal completion afterwards.

Deterministic (derandomized, no example database) and bounded: a tiny model, a 64-token context, n <= 4.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.gateway_server import ADMIN_KEY, BASE, ServerThread, build_tiny, settings_for

EXAMPLES = 1000
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
HOSTILE_LEAVES: list[object] = [
    math.nan,
    math.inf,
    -math.inf,
    10**30,
    -(10**12),
    -1,
    0,
    1e-300,
    1e308,
    "a\udfffb",
    "\ud800",
    "",
    "x" * 5000,
    None,
    True,
    [],
    {},
    [[[[[[[[[["deep"]]]]]]]]]],
    {"nested": {"nested": {"nested": "deep"}}},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokenizer):
    root, _, adapters = build_tiny(tmp_path_factory.mktemp("fuzz"), tokenizer, {"sql": 4})
    settings = settings_for(
        root,
        adapters,
        max_model_len=64,
        max_n=4,
        max_sequences_per_request=8,
        adapter_root=[str(root / "adapters")],
        chat_template_timeout=2.0,
    )
    with ServerThread(settings) as running:
        yield running


def twist(value: object, path: list[int | str], leaf: object) -> object:
    """`value` with the item at `path` replaced by `leaf`."""
    if not path:
        return leaf
    head, *rest = path
    if isinstance(value, dict):
        return {**value, head: twist(value[head], rest, leaf)}
    copied = list(value)
    copied[head] = twist(copied[head], rest, leaf)
    return copied


def paths_of(value: object, prefix: tuple = ()) -> list[list[int | str]]:
    found = [list(prefix)]
    if isinstance(value, dict):
        for key, item in value.items():
            found += paths_of(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += paths_of(item, (*prefix, index))
    return found


@st.composite
def requests(draw, operations: list) -> tuple[str, str, dict, str | None]:
    """(method, path, query, JSON text or None): a schema-drawn case with, mostly, one value twisted."""
    case = draw(st.sampled_from(operations).flatmap(lambda op: op.as_strategy()))
    body = case.body if isinstance(case.body, dict | list) else None
    if body is not None and draw(st.booleans() | st.just(True)):  # 2 in 3 bodies get a hostile value
        path = draw(st.sampled_from(paths_of(body)))
        body = twist(body, path, draw(st.sampled_from(HOSTILE_LEAVES)))
    # allow_nan writes NaN / Infinity (Python's json reads them); ensure_ascii writes lone surrogates as \\udXXX
    text = json.dumps(body, allow_nan=True, ensure_ascii=True) if body is not None else None
    return case.method.upper(), case.formatted_path, dict(case.query or {}), text


def test_a_thousand_generated_requests_get_no_5xx(server):
    spec = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    operations = [result.ok() for result in schemathesis.openapi.from_dict(spec).get_all_operations()]
    assert len(operations) >= 15, "the schema lost its operations"
    failures: list[str] = []
    statuses: dict[int, int] = {}
    previous = [""]
    # a connection per request: an idle keep-alive connection that the server closes just as the next request
    # goes out is a reset that says nothing about the request (keep-alive after errors: test_gateway_hardening)
    client = httpx.Client(
        base_url=server.url, headers=ADMIN, timeout=60, limits=httpx.Limits(max_keepalive_connections=0)
    )

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(request=requests(operations))
    def send(request: tuple[str, str, dict, str | None]) -> None:
        method, path, query, text = request
        content = text.encode() if text is not None else None
        headers = {"Content-Type": "application/json"} if content is not None else {}
        label = f"{method} {path} {query} {text!r:.300}"
        try:
            response = client.request(method, path, params=query, content=content, headers=headers)
        except httpx.TransportError as e:
            failures.append(f"{label} -> {type(e).__name__}: {e} (the request before: {previous[0]})")
            previous[0] = label
            return
        previous[0] = label
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        if response.status_code >= 500:
            failures.append(f"{label} -> {response.status_code} {response.text:.300}")

    run: Callable[[], None] = send
    run()
    client.close()
    print("statuses:", dict(sorted(statuses.items())))
    assert sum(statuses.values()) >= EXAMPLES
    assert not failures, f"{len(failures)} responses >= 500:\n" + "\n".join(failures[:30])
    with httpx.Client(base_url=server.url, timeout=60) as after:
        assert after.get("/health").status_code == 200
        response = after.post("/v1/completions", json={"model": BASE, "prompt": "hello", "max_tokens": 3})
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
