"""``verispec serve``: an OpenAI-compatible HTTP server over the batched speculative engine.

Thin by design: parse and validate (pydantic + ``SamplingParams``) -> tokenize -> submit
jobs to the engine thread (``worker.py``) -> serialize its events as OpenAI JSON or SSE
chunks. Routes: POST /v1/completions, POST /v1/chat/completions (both streaming and not),
GET /v1/models, GET /v1/models/{id}, POST /tokenize and /detokenize (``tokens.py``), GET /health,
GET /metrics (Prometheus text). This module
is the ASGI app, its error handlers and uvicorn; the rest of the package, in request order:
``guard.py`` (body size and time, API key), ``schemas.py`` (request bodies, ``ApiError``),
``handler.py`` (the one request path of both endpoints) with ``validation.py``,
``endpoints.py`` (prompts and choices per endpoint) and ``generation.py`` (jobs, events, SSE);
``state.py`` is the start-up (``ServerConfig`` -> ``build_state``).

Every error is OpenAI-shaped ``{"error": {"message", "type", "param", "code"}}``: 400 for
malformed JSON, wrong types, invalid Unicode, impossible parameters and prompts over the
context; 401 without the API key (``guard.py``); 404 for an unknown model; 408 / 413 for a
body that is too slow / too large; 429 (with ``Retry-After``) when the admission queue is
full; 503 while shutting down, also for requests still running when the grace period ends;
500 when one request fails inside the engine (the others carry on).

Tokenization runs on one tokenizer thread, never on the event loop: a long prompt does not
stall other clients or /health. What one request may cost is bounded before its work starts
(characters per prompt, messages per chat, the rendered chat's length), and its work goes to
that thread in slices of one prompt each, so another request's tokenization waits at most one
slice (a fraction of a second), never a whole request.

The chat template is the model file's code: it is compiled at start-up (a broken one is a
warning, and chat requests get its one-line error as a 400 while completions are served) and
rendered in the server's own worker process (``chat_template.py``) under a time, memory and
size bound. Waiting for a render happens on a render thread, not the tokenizer thread, so a
runaway template delays only chat requests and shutdown (an in-flight request like any
other), each by at most its timeout.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .endpoints import Chat, Completions
from .guard import RequestGuard, header_timeout_protocol
from .handler import handle_request
from .responses import add_response_routes
from .schemas import ApiError, ChatCompletionRequest, CompletionRequest, FieldError, error_body
from .state import ServerConfig, ServerState, build_state
from .tokens import add_token_routes
from .worker import EngineWorker


def create_app(state: ServerState) -> FastAPI:
    """The ASGI app serving ``state``: its routes, the request guard and the OpenAI-shaped errors;
    its lifespan starts and stops the engine thread."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.start()
        try:
            yield
        finally:
            state.close()

    app = FastAPI(title="verispec", lifespan=lifespan)
    app.state.verispec = state
    app.add_middleware(RequestGuard, limits=state.config.limits)
    cors = state.config.cors.middleware_options()
    if cors is not None:  # added last, so outermost: a preflight is answered before the guard's key check
        app.add_middleware(CORSMiddleware, **cors)
    _install_error_handlers(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        snap = state.worker.snapshot()
        ok = state.worker.alive
        return JSONResponse({"status": "ok" if ok else "unavailable", **snap}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")

    def card() -> dict:
        return {"id": state.name, "object": "model", "created": state.created, "owned_by": "verispec",
                "max_model_len": state.max_len, "drafters": list(state.worker.engine.engines)}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id not in (state.name, state.model.name):
            raise ApiError(404, f"the model {model_id!r} does not exist; this server serves {state.name!r}",
                           "model", "model_not_found")
        return card()

    add_token_routes(app, state)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await handle_request(Completions(state, body), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await handle_request(Chat(state, body), request)

    add_response_routes(app, state)  # POST /v1/responses, GET and DELETE /v1/responses/{id}
    return app


def _is_type_tag(loc: Any) -> bool:
    """pydantic names the union member in error locations ("str", "list[int]", ...): not a param."""
    return isinstance(loc, str) and ("[" in loc or loc in ("str", "int", "float", "bool") or "-" in loc)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in first.get("loc", ()) if x != "body" and not _is_type_tag(x)]
        if first.get("type") == "json_invalid":
            return JSONResponse(error_body(f"malformed JSON: {first.get('msg')}", param=None, code="invalid_json"), 400)
        param = ".".join(loc) or None
        msg = str(first.get("msg"))
        error = (first.get("ctx") or {}).get("error")
        if isinstance(error, FieldError):  # a model validator's: the field it names, its own message
            param, msg = error.param, str(error)
        elif isinstance(error, ValueError):  # a validator's ValueError: its message, not pydantic's "Value error, "
            msg = str(error)
        if param and not msg.startswith(param):
            msg = f"{param}: {msg}"
        return JSONResponse(error_body(msg, param=param, code="invalid_value"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), kind), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception) -> JSONResponse:
        # Starlette re-raises the error after this response and uvicorn then drops the
        # connection: say so, or a pooled client's next request on it fails with a reset
        return JSONResponse(error_body(f"internal error: {type(e).__name__}", "server_error"), status_code=500,
                            headers={"Connection": "close"})


SHUTDOWN_FLUSH_S = 2.0  # after the grace period: time for the final 503s / error events to reach clients


class GracefulServer(uvicorn.Server):
    """uvicorn, plus the end of the grace period: requests still running are failed by the
    worker (JSON 503, or a final error event and ``[DONE]`` on a stream) instead of being cut
    off; uvicorn cancels what is left ``SHUTDOWN_FLUSH_S`` later."""

    def __init__(self, config: uvicorn.Config, worker: EngineWorker, grace_s: float):
        super().__init__(config)
        self.worker, self.grace_s = worker, grace_s

    async def shutdown(self, sockets: list | None = None) -> None:
        timer = asyncio.get_running_loop().call_later(self.grace_s, self.worker.stop, 0.0)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def make_server(state: ServerState, graceful_timeout: float = 30.0, **uvicorn_options: Any) -> GracefulServer:
    """The app behind uvicorn with this server's limits (header timeout) and shutdown."""
    if not graceful_timeout >= 0:
        raise ValueError(f"graceful timeout must be >= 0 seconds, got {graceful_timeout}")
    limits = state.config.limits
    config = uvicorn.Config(create_app(state), http=header_timeout_protocol(limits.header_timeout_s),
                            timeout_graceful_shutdown=graceful_timeout + SHUTDOWN_FLUSH_S, **uvicorn_options)
    return GracefulServer(config, state.worker, graceful_timeout)


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the listening address first (before loading the model): a busy port or a bad
    host fails at once with one line."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {port}")
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ValueError(f"cannot resolve --host {host!r}: {e.strerror}") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def serve(config: ServerConfig, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
          graceful_timeout: float = 30.0) -> None:
    """Bind, load, build and run until SIGINT/SIGTERM; in-flight requests get
    ``graceful_timeout`` seconds to finish, then they end with 503 and the worker frees
    their caches."""
    import signal
    import threading

    if not graceful_timeout >= 0:
        raise ValueError(f"--graceful-timeout must be >= 0 seconds, got {graceful_timeout}")
    sock = bind_socket(host, port)
    try:
        server = make_server(build_state(config), graceful_timeout, log_level=log_level)
        # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal under the
        # handler that was installed before it: a no-op one makes a clean shutdown exit with 0
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: None)
        server.run(sockets=[sock])
    finally:
        sock.close()
