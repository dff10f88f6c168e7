"""What a request must satisfy before the app sees it: an ASGI middleware for the body-size
limit (413), the body-read deadline (408) and the API key (401); and a uvicorn protocol that
closes connections whose request headers do not arrive in time. ``Cors``: which browser pages
of other origins may read the answers (Starlette's ``CORSMiddleware``, outside the guard, so a
preflight is answered without the API key, which browsers never send on one).

Reading the whole (bounded) body here, before routing, means a slow or oversized upload never
reaches JSON parsing or tokenization, and the app only ever sees a complete body.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from .config import DEFAULT_MAX_BODY_BYTES as DEFAULT_MAX_BODY_BYTES  # defined there
from .config import Cors as Cors  # defined there
from .config import Limits as Limits
from .config import parse_list_option as parse_list_option
from .schemas import error_body

OPEN_PATHS = ("/health", "/metrics")  # with an API key, every other path (/v1/*, /docs, /openapi.json) needs it


def is_preflight(scope: dict) -> bool:
    """A browser's CORS preflight: OPTIONS with ``Origin`` and ``Access-Control-Request-Method``."""
    return (scope["method"] == "OPTIONS" and _header(scope, b"origin") is not None
            and _header(scope, b"access-control-request-method") is not None)


class _Reject(Exception):
    def __init__(self, status: int, message: str, code: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}


class RequestGuard:
    """ASGI middleware: API key, then the body (bounded in size and time) read once and
    replayed to the app; later ``receive`` calls (disconnect detection) pass through."""

    def __init__(self, app: Any, limits: Limits):
        self.app, self.limits = app, limits

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            self._check_key(scope)
            if scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
                return await self.app(scope, receive, send)
            body = await self._read_body(scope, receive)
        except _Reject as e:
            return await _send_error(send, e)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def _check_key(self, scope: dict) -> None:
        key = self.limits.api_key
        if key is None or scope["path"] in OPEN_PATHS or is_preflight(scope):  # browsers send no key on a preflight
            return
        auth = _header(scope, b"authorization") or ""
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
            raise _Reject(401, "missing or invalid API key (send 'Authorization: Bearer <key>')", "invalid_api_key",
                          {"www-authenticate": "Bearer"})

    async def _read_body(self, scope: dict, receive: Any) -> bytes:
        limit = self.limits.max_body_bytes
        declared = _header(scope, b"content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                raise _Reject(400, "invalid Content-Length header", "invalid_request")
            if int(declared) > limit:
                raise _Reject(413, f"the request body ({int(declared)} bytes) exceeds this server's limit of "
                              f"{limit} bytes", "request_too_large")
        try:
            return await asyncio.wait_for(self._chunks(receive, limit), self.limits.body_timeout_s)
        except TimeoutError:
            raise _Reject(408, f"the request body did not arrive within {self.limits.body_timeout_s:g} s",
                          "request_timeout", {"connection": "close"}) from None

    @staticmethod
    async def _chunks(receive: Any, limit: int) -> bytes:
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Reject(400, "the client disconnected while sending the body", "client_disconnected")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:  # a chunked upload without Content-Length: counted as it arrives
                raise _Reject(413, f"the request body exceeds this server's limit of {limit} bytes",
                              "request_too_large")
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _send_error(send: Any, e: _Reject) -> None:
    payload = json.dumps(error_body(e.message, "invalid_request_error", None, e.code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in e.headers.items()]
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def header_timeout_protocol(timeout_s: float) -> type:
    """uvicorn's h11 protocol, closing a connection that has not completed its request
    headers within ``timeout_s`` of its first byte (or of connecting): slow-loris clients
    cannot hold connections open. A keep-alive connection idles under uvicorn's own timer."""

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._awaiting_headers():
                self._arm()
            super().data_received(data)
            if not self._awaiting_headers():
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _awaiting_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expire(self) -> None:
            self._header_timer = None
            if self._awaiting_headers() and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol
