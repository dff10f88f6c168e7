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
import re
import secrets
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from .schemas import error_body

OPEN_PATHS = ("/health", "/metrics")  # with an API key, every other path (/v1/*, /docs, /openapi.json) needs it
DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024  # 2 MiB: about 500K tokens of text, far above any context here


@dataclass(frozen=True)
class Limits:
    """``max_body_bytes``: the largest request body (413 above it). ``header_timeout_s``:
    seconds a connection may take to send its request headers. ``body_timeout_s``: seconds
    the whole body may take after the headers (408 after). ``api_key`` (printable ASCII): when
    set, every path but /health and /metrics (so /v1/*, /docs, /openapi.json) needs
    ``Authorization: Bearer <api_key>`` (401 otherwise)."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if not (self.header_timeout_s > 0 and self.body_timeout_s > 0):
            raise ValueError("header and body timeouts must be > 0 seconds")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key must not be empty")
        if self.api_key is not None and not (self.api_key.isascii() and self.api_key.isprintable()):
            # HTTP headers carry bytes; clients encode a non-ASCII key as UTF-8 or latin-1 at will
            raise ValueError("the API key must be printable ASCII (clients encode other characters differently)")


_ORIGIN = re.compile(r"^[a-z][a-z0-9+.-]*://[^/\s?#]+$")  # scheme://host[:port], as browsers send Origin


@dataclass(frozen=True)
class Cors:
    """Cross-origin access (CORS) for browser clients. ``allowed_origins``: origins
    (``scheme://host[:port]``, no path) whose pages may call the server and read its answers, or
    ``"*"`` for any; empty (the default) adds no CORS headers, so a page on another origin cannot
    read answers (nor send the JSON requests, whose preflight fails). With ``"*"`` any web page the
    user opens could use a server on their machine (its compute, and with tools its answers), which
    a default must not allow; an API key does not help there, as a page can ask for it. Methods
    and headers default to any (``*``: the preflight's requested headers are echoed, so
    ``Authorization`` passes); credentials (cookies) are never allowed: the key is a header."""

    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)

    def __post_init__(self) -> None:
        for origin in self.allowed_origins:
            if origin != "*" and not _ORIGIN.match(origin):
                hint = " (drop the trailing '/')" if origin.endswith("/") else ""
                raise ValueError(f"--allowed-origins: {origin!r} is not an origin like http://localhost:3000 "
                                 f"or '*'{hint}")
        for name, values in (("methods", self.allowed_methods), ("headers", self.allowed_headers)):
            bad = [v for v in values if not v or not re.fullmatch(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+", v)]
            if bad:
                raise ValueError(f"--allowed-{name}: {bad[0]!r} is not an HTTP token")

    def middleware_options(self) -> dict[str, Any] | None:
        """``CORSMiddleware``'s options, None when no origin is allowed (no middleware)."""
        if not self.allowed_origins:
            return None
        return {"allow_origins": list(self.allowed_origins), "allow_methods": list(self.allowed_methods),
                "allow_headers": list(self.allowed_headers), "allow_credentials": False,
                "expose_headers": ["Retry-After"], "max_age": 600}


def parse_list_option(values: list[str]) -> tuple[str, ...]:
    """A repeatable list flag: ``--x a --x b``, ``--x a,b`` or vLLM's JSON ``--x '["a", "b"]'``."""
    out: list[str] = []
    for value in values:
        text = value.strip()
        if text.startswith("["):
            try:
                items = json.loads(text)
            except ValueError:
                raise ValueError(f"{value!r} is not a JSON list of strings") from None
            if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
                raise ValueError(f"{value!r} is not a JSON list of strings")
            out += [i.strip() for i in items]
        else:
            out += [part.strip() for part in text.split(",") if part.strip()]
    return tuple(out)


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
