"""The target server as the benchmark sees it: its model list, and one streamed request timed.

TTFT is the time to the first chunk with non-empty text; E2E the time to `data: [DONE]`; output tokens come
from the usage chunk (`stream_options.include_usage`), else one per content chunk. The streams go over aiohttp
(its C parser), as vLLM's benchmark client does: on a small machine the client shares the server's cores, and
every core-second it spends reading chunks is one the server under test does not get.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import aiohttp
import httpx

from bench import BenchError
from bench.workload import RequestSpec

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True, slots=True)
class Target:
    url: str  # the server's root, e.g. http://127.0.0.1:8000 (a trailing /v1 is dropped)
    api_key: str | None = None
    endpoint: str = "completions"  # a key of ENDPOINTS
    timeout_s: float = 300.0  # per request, from send to [DONE]

    def __post_init__(self):
        url = self.url.rstrip("/")
        object.__setattr__(self, "url", url.removesuffix("/v1"))
        if self.endpoint not in ENDPOINTS:
            raise BenchError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(slots=True)
class RequestRecord:
    index: int
    model: str
    prompt_len: int  # as the workload counted it (words, or tokens with a tokenizer)
    max_tokens: int
    start_s: float  # when it was sent, after the run started
    ok: bool = False
    status: int | None = None  # HTTP status, None if no response came
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    input_tokens: int | None = None  # usage.prompt_tokens
    output_tokens: int = 0

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


class RequestFailed(Exception):
    """The server answered, but not with a complete stream."""


def list_models(target: Target) -> list[dict]:
    """GET /v1/models: the `data` entries, each with `id` and (loraplex, vLLM) `parent`."""
    url = f"{target.url}/v1/models"
    try:
        response = httpx.get(url, headers=target.headers(), timeout=min(target.timeout_s, 30.0))
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach {url}: {type(e).__name__}: {e}") from e
    if response.status_code != 200:
        raise BenchError(f"GET {url} failed: {response_error(response)}")
    try:
        return list(response.json()["data"])
    except (ValueError, KeyError, TypeError) as e:
        raise BenchError(f"GET {url}: expected {{'data': [...]}}, got {response.text[:200]!r}") from e


def base_and_adapters(models: list[dict], base: str | None = None) -> tuple[str, list[str]]:
    """The base model's name (the first with parent null, unless given) and its adapters, in listed order."""
    if not models:
        raise BenchError("the server lists no models")
    if base is None:
        roots = [m["id"] for m in models if m.get("parent") is None]
        base = roots[0] if roots else models[0]["id"]
    elif base not in {m["id"] for m in models}:
        raise BenchError(f"--base-model {base!r} is not among the served models: {[m['id'] for m in models]}")
    return base, [m["id"] for m in models if m.get("parent") == base and m["id"] != base]


def error_message(status: int, text: str) -> str:
    """`HTTP 404: <message>` from an OpenAI error body, FastAPI's `detail`, or the start of the text."""
    try:
        body = json.loads(text)
        message = body["error"]["message"] if "error" in body else body["detail"]
    except (ValueError, KeyError, TypeError):
        message = text[:200]
    return f"HTTP {status}: {message}"


def response_error(response: httpx.Response) -> str:
    """`error_message` of a finished httpx response (the model list, the admin API)."""
    return error_message(response.status_code, response.text)


def request_body(target: Target, spec: RequestSpec) -> dict:
    body = {
        "model": spec.model,
        "max_tokens": spec.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.endpoint == "chat":
        return {**body, "messages": [{"role": "user", "content": spec.prompt}]}
    return {**body, "prompt": spec.prompt}


async def send_request(client: aiohttp.ClientSession, target: Target, spec: RequestSpec, t0: float) -> RequestRecord:
    """Sends `spec` now and times it; failures (HTTP errors, timeouts, broken streams) land in the record."""
    start = time.perf_counter()
    record = RequestRecord(spec.index, spec.model, spec.prompt_len, spec.output_len, start - t0)
    try:
        async with asyncio.timeout(target.timeout_s):
            await _stream(client, target, spec, record, start)
        record.ok = True
    except TimeoutError:
        record.error = f"timeout: no complete answer within {target.timeout_s:g} s"
    except RequestFailed as e:
        record.error = str(e)
    except aiohttp.ClientError as e:
        record.error = f"{type(e).__name__}: {e}".rstrip(": ")
    record.e2e_s = time.perf_counter() - start
    return record


async def _stream(
    client: aiohttp.ClientSession, target: Target, spec: RequestSpec, record: RequestRecord, start: float
) -> None:
    url = f"{target.url}{ENDPOINTS[target.endpoint]}"
    async with client.post(url, json=request_body(target, spec), headers=target.headers()) as response:
        record.status = response.status
        if response.status != 200:
            raise RequestFailed(error_message(response.status, await response.text()))
        content_chunks, usage = 0, None
        async for line in response.content:  # one line per iteration, b"\n" included
            if not line.startswith(b"data:"):
                continue
            data = line[len(b"data:") :].strip()
            if data == b"[DONE]":
                break
            event = _parse_event(data)
            if _text(event, target.endpoint):
                if record.ttft_s is None:
                    record.ttft_s = time.perf_counter() - start
                content_chunks += 1
            usage = event.get("usage") or usage
        else:
            raise RequestFailed("the stream ended before data: [DONE]")
    if record.ttft_s is None:  # no visible text at all (e.g. tokens that decode to nothing): first = last
        record.ttft_s = time.perf_counter() - start
    record.output_tokens = int(usage["completion_tokens"]) if usage else content_chunks
    record.input_tokens = int(usage["prompt_tokens"]) if usage and "prompt_tokens" in usage else None


def _parse_event(data: bytes) -> dict:
    try:
        event = json.loads(data)
    except ValueError as e:
        raise RequestFailed(f"bad stream chunk: {data[:200].decode(errors='replace')!r}") from e
    if not isinstance(event, dict):
        raise RequestFailed(f"bad stream chunk: {data[:200].decode(errors='replace')!r}")
    if event.get("error"):
        error = event["error"]
        raise RequestFailed(f"error in stream: {error.get('message', error) if isinstance(error, dict) else error}")
    return event


def _text(event: dict, endpoint: str) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    if endpoint == "chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""
