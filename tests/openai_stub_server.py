"""A STAND-IN server, used only to unit-test the benchmark client (bench): it is not loraplex.

No model runs here. It speaks just enough of the API the benchmark targets, over a real socket on 127.0.0.1
(FastAPI + uvicorn in a background thread, on a free port):
- GET /v1/models: the base model (parent null) and its adapters (parent = the base), registered ones included;
- POST /v1/completions and /v1/chat/completions, streamed as OpenAI's SSE chunks: after `first_token_delay_s`,
  one chunk per token every `token_delay_s`, then a usage chunk (unless `include_usage` is off) and
  `data: [DONE]`; 404 in OpenAI's error format for an unknown model, 401 for a wrong API key;
- POST /admin/adapters (201, 409 if the name exists, 400 if the path is no adapter directory) and
  DELETE /admin/adapters/{name}, behind the admin key.
Every completion request's body is kept in `received`, with its Authorization header; `max_in_flight` is the
most streams ever open at once.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


@dataclass
class StubConfig:
    base: str = "stub-base"
    adapters: tuple[str, ...] = ("stub-a0", "stub-a1", "stub-a2")
    api_key: str | None = None  # None: any or no key is accepted
    admin_key: str = "stub-admin-key"
    first_token_delay_s: float = 0.005
    token_delay_s: float = 0.002
    include_usage: bool = True


@dataclass
class StubState:
    received: list[dict] = field(default_factory=list)  # completion bodies, plus "authorization"
    registered: dict[str, str] = field(default_factory=dict)  # name -> path, through the admin API
    deleted: list[str] = field(default_factory=list)
    in_flight: int = 0  # streams open now
    max_in_flight: int = 0


def error(status: int, message: str) -> JSONResponse:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": status}}
    return JSONResponse(body, status_code=status)


def build_app(config: StubConfig, state: StubState) -> FastAPI:
    app = FastAPI()

    def models() -> list[str]:
        return [config.base, *config.adapters, *state.registered]

    def refused(request: Request, key: str | None) -> bool:
        return key is not None and request.headers.get("authorization") != f"Bearer {key}"

    @app.get("/v1/models")
    async def list_models(request: Request):
        if refused(request, config.api_key):
            return error(401, "invalid API key")
        data = [{"id": m, "object": "model", "parent": None if m == config.base else config.base} for m in models()]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    async def complete(request: Request, chat: bool):
        body = await request.json()
        state.received.append({**body, "authorization": request.headers.get("authorization")})
        if refused(request, config.api_key):
            return error(401, "invalid API key")
        if body.get("model") not in models():
            return error(404, f"The model `{body.get('model')}` does not exist.")
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        return StreamingResponse(counted(stream(body, chat, len(prompt.split()))), media_type="text/event-stream")

    async def counted(chunks):
        state.in_flight += 1
        state.max_in_flight = max(state.max_in_flight, state.in_flight)
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            state.in_flight -= 1

    async def stream(body: dict, chat: bool, prompt_tokens: int):
        kind = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": "stub-1", "object": kind, "created": int(time.time()), "model": body["model"]}
        if chat:
            yield sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
        await asyncio.sleep(config.first_token_delay_s)
        n = body["max_tokens"]
        for i in range(n):
            finish = "length" if i == n - 1 else None
            text = f" tok{i}"
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            yield sse({**base, "choices": [{**choice, "finish_reason": finish}]})
            if i < n - 1:
                await asyncio.sleep(config.token_delay_s)
        if config.include_usage and (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
            yield sse({**base, "choices": [], "usage": usage})
        yield "data: [DONE]\n\n"

    @app.post("/admin/adapters")
    async def register(request: Request):
        if refused(request, config.admin_key):
            return error(401, "invalid admin key")
        body = await request.json()
        name, path = body["name"], body["path"]
        if not (Path(path) / "adapter_config.json").is_file():
            return error(400, f"{path} is not an adapter directory")
        if name in models():
            return error(409, f"adapter {name} already exists")
        state.registered[name] = path
        return JSONResponse({"name": name, "path": path, "version": "1"}, status_code=201)

    @app.delete("/admin/adapters/{name}")
    async def delete(name: str, request: Request):
        if refused(request, config.admin_key):
            return error(401, "invalid admin key")
        if state.registered.pop(name, None) is None:
            return error(404, f"no adapter {name}")
        state.deleted.append(name)
        return Response(status_code=204)

    return app


def sse(event: dict) -> str:
    return f"data: {json.dumps(event)}\n\n"


class StubServer:
    """`with StubServer(token_delay_s=...) as stub:` serves on `stub.url` until the block ends."""

    def __init__(self, **config):
        self.config = StubConfig(**config)
        self.state = StubState()
        uv_config = uvicorn.Config(
            build_app(self.config, self.state), host="127.0.0.1", port=0, log_level="warning", lifespan="off"
        )
        self.server = uvicorn.Server(uv_config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = ""

    def __enter__(self) -> StubServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the stub server did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
