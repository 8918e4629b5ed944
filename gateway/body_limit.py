"""BodyLimit: an ASGI middleware that refuses a request body over `max_bytes` with a 413, before anything reads it.

A declared `Content-Length` over the limit is refused at once, without reading a byte; a chunked body is counted
as it arrives and refused when it crosses the limit. So a 10 MB prompt costs the server nothing: no JSON parse,
no tokenization, and the event loop never spends seconds on it.
"""

from __future__ import annotations

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import APIError, error_response


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def _error(self) -> APIError:
        return APIError(
            413,
            f"the request body is larger than this server accepts ({self.max_bytes} bytes; --max-request-body-bytes)",
            code="request_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await error_response(self._error())(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # an HTTPException passes FastAPI's body parsing unchanged
                    raise HTTPException(413, self._error().message)
            return message

        await self.app(scope, limited_receive, send)
