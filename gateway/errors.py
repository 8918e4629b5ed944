"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` for every failure the gateway returns.

Handlers turn request-validation failures into 400s naming the field, unknown routes into 404s, and
`APIError`s raised anywhere in a route into their status; nothing leaks a stack trace to the client.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from registry import errors as registry_errors

logger = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self,
        status_code: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status_code, self.message, self.param, self.code = status_code, message, param, code
        self.headers = headers


def error_body(status_code: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status_code, "invalid_request_error" if status_code < 500 else "server_error"),
            "param": param,
            "code": code if code is not None else status_code,
        }
    }


def error_response(error: APIError) -> JSONResponse:
    body = error_body(error.status_code, error.message, error.param, error.code)
    return JSONResponse(body, status_code=error.status_code, headers=error.headers)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model '{model}' does not exist", param="model", code="model_not_found")


def _field(loc: tuple) -> str | None:
    """The field a validation error's location names: without its source ("body", "query", "path", ...), which
    only the first element is (a body field may itself be called `path`)."""
    if loc and loc[0] in ("body", "query", "path", "header", "cookie"):
        loc = loc[1:]
    return ".".join(str(p) for p in loc) or None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = _field(tuple(first.get("loc", ())))
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message, param = "the request body is not valid JSON", None
        elif param:
            message = f"invalid value for '{param}': {message}"
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "error"
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}"
        return error_response(APIError(exc.status_code, message, headers=getattr(exc, "headers", None)))

    async def _registry_unavailable(request: Request, exc: Exception) -> JSONResponse:
        logger.error("registry database error on %s %s: %s", request.method, request.url.path, exc)
        message = f"the registry database is unavailable, retry later ({registry_errors.describe(exc)})"
        return error_response(APIError(503, message, code="registry_unavailable", headers={"Retry-After": "5"}))

    async def _registry_bad_value(request: Request, exc: Exception) -> JSONResponse:
        return error_response(APIError(400, f"the registry refused a value: {registry_errors.describe(exc)}"))

    async def _invalid_unicode(request: Request, exc: UnicodeError) -> JSONResponse:
        # a safety net behind RequestModel's check: text that cannot be encoded reached a codec
        return error_response(APIError(400, f"the request holds text that is not valid Unicode: {exc.reason}"))

    for cls in registry_errors.UNAVAILABLE:
        app.add_exception_handler(cls, _registry_unavailable)
    for cls in registry_errors.BAD_VALUE:
        app.add_exception_handler(cls, _registry_bad_value)
    app.add_exception_handler(UnicodeError, _invalid_unicode)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}"))
