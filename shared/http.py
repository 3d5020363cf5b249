"""HTTP conventions shared by the three services (FastAPI apps): error bodies and their OpenAPI
description, a request-body cap, inline request-body schemas, and the bind rule.

Every error answer is `{"detail": "<one readable line>"}`, validation errors included, and is
described in the OpenAPI documents, so clients and fuzzers see the same contract.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from shared.schemas import one_line_error

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_REASONS = {
    400: "Bad request",
    401: "Missing or wrong bearer token",
    404: "Not found",
    408: "The request body did not arrive in time",
    409: "Conflict with the current state",
    413: "Body or field too large",
    415: "Unsupported content type",
    416: "Range not satisfiable",
    422: "Invalid input",
    429: "Queue full",
    503: "Not ready yet",
    507: "Storage full: retry later (Retry-After)",
}


# OpenAPI of GET /metrics: Prometheus' text exposition format, not JSON.
PROMETHEUS_TEXT: dict[int | str, dict[str, Any]] = {
    200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}}


class ErrorBody(BaseModel):
    """What every 4xx/5xx answer of sparsecast carries."""

    detail: str


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for these error statuses (each an ErrorBody)."""
    return {code: {"model": ErrorBody, "description": _REASONS[code]} for code in codes}


def install_error_handling(app: FastAPI) -> None:
    """Validation errors answer 422 with a one-line string `detail`, like every other error."""

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": one_line_error(exc, "body")}, status_code=422)


def inline_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The JSON schema of `model` with its `$defs` inlined, to describe a body in openapi_extra
    (where `#/$defs/...` references would point nowhere). Models must not be recursive."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return resolve(defs[ref.removeprefix("#/$defs/")])
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    return resolve(schema)


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` is answered 413, by its Content-Length
    before the handler runs, or as soon as a streamed (chunked) body passes the cap — never held
    whole first. Install with app.add_middleware so that the 413 raised mid-stream reaches
    FastAPI's exception handling."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        declared = dict(scope.get("headers", [])).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            body = json.dumps(
                {"detail": f"request body of {int(declared)} bytes exceeds the limit of {limit}"}
            ).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            await send({"type": "http.response.start", "status": 413, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise HTTPException(413, f"request body exceeds the limit of {limit} bytes")
            return message

        await self.app(scope, limited, send)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name other than localhost may resolve to anything


class InsecureBind(SystemExit):
    """Raised at startup: a non-loopback bind without an API token (exits with the message)."""


def require_token_off_loopback(service: str, host: str, token: str | None) -> None:
    """Secure by default: anyone who can reach a non-loopback address could write without a token."""
    if not token and not is_loopback(host):
        raise InsecureBind(
            f"sparsecast {service}: refusing to listen on {host} without an API token. "
            f"Set SPARSECAST_API_TOKEN (every write then needs it), or listen on 127.0.0.1 "
            f"(SPARSECAST_HOST, the default)."
        )
