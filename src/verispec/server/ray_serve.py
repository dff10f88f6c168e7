"""``verispec serve --ray``: replicas of the OpenAI-compatible server on Ray Serve (docs/ray.md).

Two deployments:

- ``VerispecEngine`` (N replicas, or autoscaled): each replica is one whole single-process
  server (``app.build_state`` + ``app.create_app``: batching engine, drafters, prefix cache,
  request validation, errors, SSE, /metrics) with no HTTP socket of its own: the frontend
  hands it each request as an ``HttpCall`` and it runs the request through the very same ASGI
  app (``asgi_call``), streaming the response back. Its thread count is its Ray ``num_cpus``.
- ``VerispecFrontend`` (the HTTP ingress, 0 CPUs): applies the request guard (body size,
  API key), computes the request's prefix keys (``routing.py``), forwards it through a
  deployment handle and streams the answer out. A replica that dies before any byte of its
  answer was sent gets the request retried on another replica (``retries`` times); after
  that the client gets an OpenAI-shaped 503, or, mid-stream, a final ``{"error": ...}``
  event and ``data: [DONE]``.

``PrefixAwareRouter`` is the engine deployment's Ray Serve ``RequestRouter``. A request that
continues an earlier prompt (a conversation's next turn, the same prompt again) goes to the
replica that served it, whose prefix cache holds that prompt and its answer, unless that
replica's queue is longer than the shortest by more than ``imbalanced_threshold``. A request
that only shares a prefix with earlier ones (a common system prompt) goes to that prefix's
replica when its queue is among the shortest. Everything else goes to the least-loaded replica.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from . import ray_reaper
from .app import create_app
from .guard import Cors, Limits, RequestGuard
from .ray_network import (check_reachable, is_loopback, loopback_ray, no_usage_stats, replica_grpc_on_loopback,
                          warn_if_exposed)
from .routing import BLOCK_CHARS, MAX_BLOCKS, PrefixTable, prefix_keys, routing_text
from .schemas import error_body
from .state import ServerConfig, build_state

ENGINE = "VerispecEngine"
FRONTEND = "VerispecFrontend"
APP_NAME = "verispec"
ROUTER = "verispec.server.ray_serve:PrefixAwareRouter"
DEFAULT_ROUTER = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"
REPLICA_HEADER = "x-verispec-replica"
ROUTE_CHARS = (MAX_BLOCKS + 1) * BLOCK_CHARS  # the routing text's keys and the tail after them
RETRIES_HEADER = "x-verispec-retries"  # set when the answer comes from a retry (its replica died)
logger = logging.getLogger("ray.serve")
QUIET = {"log_level": "WARNING", "enable_access_log": False}  # `verispec serve --ray`: warnings and errors only


@dataclass(frozen=True)
class HttpCall:
    """One HTTP request as the frontend forwards it (the body already read and bounded)."""

    method: str
    path: str
    query: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    text: str = ""  # routing.routing_text of the request's prompt (at most ROUTE_CHARS)
    prefix: tuple[int, ...] = ()  # routing.prefix_keys(text)


@dataclass(frozen=True)
class RayConfig:
    """A Ray Serve deployment of the server. ``replicas``: a fixed count, unless ``autoscaling``
    (Ray Serve's ``min_replicas`` / ``max_replicas`` / ``target_ongoing_requests`` ...) is set;
    ``num_cpus``: Ray CPUs per replica, which is also its thread count; ``prefix_routing``:
    the prefix-aware router, else Ray's default (power of two choices by queue length);
    ``imbalanced_threshold``: how many more queued requests than the least-loaded replica a
    conversation's replica may have and still get its next turn (default ``max_batch``: a
    batch absorbs a few more requests cheaply, a lost cache costs the whole history's prefill);
    ``retries``: times a request is sent again when its replica died before answering."""

    server: ServerConfig = field(default_factory=ServerConfig)
    replicas: int = 1
    num_cpus: float = 1.0
    autoscaling: dict[str, Any] | None = None
    prefix_routing: bool = True
    imbalanced_threshold: int | None = None  # None: the server's max_batch
    retries: int = 1

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if not self.num_cpus > 0:
            raise ValueError(f"CPUs per replica must be > 0, got {self.num_cpus}")
        if self.retries < 0 or (self.imbalanced_threshold or 0) < 0:
            raise ValueError("retries and imbalanced_threshold must be >= 0")
        if self.autoscaling is not None:
            lo, hi = self.autoscaling.get("min_replicas", 1), self.autoscaling.get("max_replicas", 1)
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
                raise ValueError(f"autoscaling needs 1 <= min_replicas <= max_replicas, got {lo} and {hi}")

    @property
    def max_replicas(self) -> int:
        return self.autoscaling.get("max_replicas", 1) if self.autoscaling else self.replicas

    @property
    def min_replicas(self) -> int:
        return self.autoscaling.get("min_replicas", 1) if self.autoscaling else self.replicas


# ----------------------------------------------------------------------------- the engine replica


def replica_threads() -> int:
    """Threads for this replica: the CPUs Ray assigned it (at least one)."""
    import ray

    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
    return max(1, int(cpus))


class EngineReplica:
    """One verispec server (engine thread + ASGI app) inside a Ray Serve replica."""

    def __init__(self, config: ServerConfig):
        import torch

        replica_grpc_on_loopback()
        torch.set_num_threads(replica_threads())  # before loading: the compiled runtime's pool takes it
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.state = build_state(config, replica=self.replica)
        self.state.start()
        self.app = create_app(self.state)  # its lifespan is not run: start/close are ours

    async def __call__(self, call: HttpCall) -> AsyncIterator[Any]:
        async for item in asgi_call(self.app, call, ((REPLICA_HEADER.encode(), self.replica.encode()),)):
            yield item

    def check_health(self) -> None:
        """Ray Serve calls it periodically; a dead engine thread makes Ray replace the replica."""
        if not self.state.worker.alive:
            raise RuntimeError("the engine thread stopped")

    def __del__(self) -> None:
        state = getattr(self, "state", None)
        if state is not None:
            state.close()


def _scope(call: HttpCall) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": call.method, "scheme": "http", "path": call.path, "raw_path": call.path.encode(),
            "root_path": "", "query_string": call.query, "headers": list(call.headers),
            "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0), "state": {}}


async def asgi_call(app: Any, call: HttpCall, extra_headers: tuple[tuple[bytes, bytes], ...] = ()
                    ) -> AsyncIterator[Any]:
    """Run one request through an ASGI app. Yields ``(status, headers, first body chunk)``
    once the first chunk exists (so a non-streamed answer arrives whole), then each further
    chunk (bytes). Closing the generator early (the client went away) makes the app see
    ``http.disconnect``, so it cancels the request's jobs as on a dropped connection."""
    sent: asyncio.Queue[dict | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_given = False

    async def receive() -> dict:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await sent.put(message)

    task = asyncio.create_task(app(_scope(call), receive, send))
    task.add_done_callback(lambda _: sent.put_nowait(None))
    head: dict | None = None
    started = False
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                head = message
                continue
            chunk = message.get("body", b"")
            if not started and head is not None:
                started = True
                yield head["status"], [*head.get("headers", []), *extra_headers], chunk
            elif chunk:
                yield chunk
            if not message.get("more_body", False):
                return
        if not started:  # the app ended without answering (it raised before its error handler)
            payload = json.dumps(error_body("internal error", "server_error")).encode()
            yield 500, [(b"content-type", b"application/json"), *extra_headers], payload
    finally:
        gone.set()
        if not task.done():
            done, _ = await asyncio.wait({task}, timeout=2.0)  # the app notices the disconnect and cancels
            if not done:
                task.cancel()


# ----------------------------------------------------------------------------- the router


class PrefixAwareRouter(RequestRouter):
    """Prefix-aware routing (``routing.PrefixTable``), load balancing by queue length otherwise.

    Runs where the deployment handle is (the frontend replica): its table is that
    frontend's view of which replica holds which prefix."""

    def initialize_state(self, imbalanced_threshold: int = 16, capacity: int = 200_000, **_: Any) -> None:
        self._table = PrefixTable(capacity)
        self._imbalanced_threshold = imbalanced_threshold

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        try:  # an exception here would leave the request unrouted for ever: never raise
            keys, text = _route_of(pending_request)
            by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
            owner, _, continues = self._table.match(keys, text, by_id.keys()) if keys else (None, 0, False)
            # a continuation stays unless its replica is overloaded; a shared prefix only breaks
            # ties, and only between known queue lengths (a burst must not all follow one owner)
            if owner is not None and (self._excess(by_id[owner], candidate_replicas) <= self._imbalanced_threshold
                                      if continues else self._excess(by_id[owner], candidate_replicas, 0) == 0):
                rest = [r for r in candidate_replicas if r is not by_id[owner]]
                return [[by_id[owner]], rest] if rest else [[by_id[owner]]]
        except Exception:
            logger.exception("prefix-aware routing failed; routing by queue length")
        return [candidate_replicas]  # one rank: the base class takes the shortest queue

    def _excess(self, replica: RunningReplica, candidates: list[RunningReplica], unknown: int | None = None) -> int:
        """How many more requests ``replica`` has queued than the least-loaded candidate.
        An unknown queue length counts as 0, or with ``unknown`` set, the answer is ``unknown + 1``
        when any is unknown (so it is never taken for a tie)."""
        cache = self.replica_queue_len_cache
        lens = [cache.get(r.replica_id) for r in candidates]
        mine = cache.get(replica.replica_id)
        if unknown is not None and (mine is None or None in lens):
            return unknown + 1
        return (mine or 0) - min(q or 0 for q in lens)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        keys, text = _route_of(pending_request)
        if keys:
            self._table.insert(keys, text, replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._table.drop(replica_id.unique_id)  # its prefix cache died with it


def _route_of(pending_request: PendingRequest | None) -> tuple[tuple[int, ...], str]:
    """(prefix keys, routing text) of a request; an HttpCall is duck-typed (Ray may ship a
    copy of the class)."""
    if pending_request is None or not pending_request.args:
        return (), ""
    call = pending_request.args[0]
    keys, text = getattr(call, "prefix", ()), getattr(call, "text", "")
    return (keys, text) if isinstance(keys, tuple) and isinstance(text, str) else ((), "")


# ----------------------------------------------------------------------------- the frontend


REPLICA_GONE = (RayActorError, ActorUnavailableError)


@serve.ingress()
class Frontend:
    """The HTTP ingress: request guard, prefix keys, forwarding with retries (0 CPUs)."""

    def __init__(self, engine: Any, limits: Limits, retries: int = 1):
        replica_grpc_on_loopback()
        self.engine = engine.options(stream=True)
        self.limits, self.retries = limits, retries

    def __serve_build_asgi_app__(self) -> Any:
        return RequestGuard(self.asgi, self.limits)

    async def asgi(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        if scope["method"] not in ("GET", "HEAD", "OPTIONS", "DELETE"):
            body = (await receive()).get("body", b"")  # the guard replays the whole, bounded body
        path, root = scope["path"], scope.get("root_path", "")
        if root and path.startswith(root):  # an app under a route prefix: the replica's routes start at /
            path = path[len(root):] or "/"
        text = routing_text(path, body)[:ROUTE_CHARS] if body else ""
        call = HttpCall(scope["method"], path, scope.get("query_string", b""), tuple(scope.get("headers", ())),
                        body, text, prefix_keys(text))
        await self.forward(call, send)

    async def forward(self, call: HttpCall, send: Any) -> None:
        """Send ``call`` to a replica and its answer to the client; retried while nothing was sent."""
        for attempt in range(self.retries + 1):
            gen = self.engine.remote(call)
            try:
                status, headers, first = await gen.__anext__()
            except REPLICA_GONE:
                gen.cancel()
                if attempt < self.retries:
                    continue
                return await _send_json(send, 503, error_body(
                    "the replica serving this request died; retry", "server_error", None, "replica_unavailable"),
                    [(b"retry-after", b"1")])
            except StopAsyncIteration:
                return await _send_json(send, 500, error_body("the replica sent no answer", "server_error"))
            break
        if attempt:
            headers = [*headers, (RETRIES_HEADER.encode(), str(attempt).encode())]
        try:
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": first, "more_body": True})
            try:
                async for chunk in gen:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except REPLICA_GONE:
                if (b"content-type", b"text/event-stream") in [(k.lower(), v.split(b";")[0]) for k, v in headers]:
                    event = error_body("the replica serving this stream died", "server_error", None,
                                       "replica_unavailable")
                    await send({"type": "http.response.body", "more_body": True,
                                "body": f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            gen.cancel()  # a no-op once finished; else the client left: the replica cancels the jobs


async def _send_json(send: Any, status: int, payload: dict, headers: list | None = None) -> None:
    data = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": data})


# ----------------------------------------------------------------------------- the application


def build_app(config: RayConfig) -> Any:
    """The Ray Serve application (frontend -> engine replicas) for ``serve.run``."""
    router = {"request_router_class": ROUTER if config.prefix_routing else DEFAULT_ROUTER,
              "request_router_kwargs": ({"imbalanced_threshold": config.imbalanced_threshold
                                         if config.imbalanced_threshold is not None else config.server.max_batch}
                                        if config.prefix_routing else {})}
    scale = ({"autoscaling_config": config.autoscaling} if config.autoscaling
             else {"num_replicas": config.replicas})
    engine = serve.deployment(EngineReplica, name=ENGINE, ray_actor_options={"num_cpus": config.num_cpus},
                              max_ongoing_requests=config.server.max_batch + config.server.max_queue,
                              request_router_config=router, health_check_period_s=2.0,
                              **scale).bind(config.server)
    frontend = serve.deployment(Frontend, name=FRONTEND, num_replicas=1, ray_actor_options={"num_cpus": 0},
                                max_ongoing_requests=10_000)
    return frontend.bind(engine, config.server.limits, config.retries)


SERVER_KEYS = {f for f in ServerConfig.__dataclass_fields__ if f != "limits"}


def config_from_args(args: dict[str, Any]) -> RayConfig:
    """A ``RayConfig`` from a Ray Serve config file's ``args`` (deploy/ray-serve.yaml): the
    ``ServerConfig`` fields by name (``drafters`` a list, ``cors`` a mapping of lists), ``api_key``, ``max_body_bytes``,
    and ``prefix_routing`` / ``imbalanced_threshold`` / ``retries``. Replica counts,
    autoscaling and CPUs come from the file's ``deployments`` section."""
    args = dict(args)
    ray_keys = {k: args.pop(k) for k in ("prefix_routing", "imbalanced_threshold", "retries") if k in args}
    limits = {k: args.pop(k) for k in ("api_key", "max_body_bytes") if k in args}
    unknown = set(args) - SERVER_KEYS
    if unknown:
        raise ValueError(f"unknown verispec args: {', '.join(sorted(unknown))}")
    if "cors" in args:  # {"allowed_origins": [...], "allowed_methods": [...], "allowed_headers": [...]}
        cors = args["cors"]
        if (not isinstance(cors, dict) or not all(isinstance(v, list) for v in cors.values())
                or not set(cors) <= {"allowed_origins", "allowed_methods", "allowed_headers"}):
            raise ValueError("cors must map allowed_origins / allowed_methods / allowed_headers to lists")
        args["cors"] = Cors(**{k: tuple(v) for k, v in cors.items()})
    for key in ("drafters", "drafter_options"):
        if key in args:
            args[key] = tuple(tuple(x) if isinstance(x, list) else x for x in args[key])
    return RayConfig(ServerConfig(**args, limits=Limits(**limits)), **ray_keys)


def app_builder(args: dict[str, Any]) -> Any:
    """``serve run deploy/ray-serve.yaml`` (``import_path: verispec.server.ray_serve:app_builder``)."""
    config = config_from_args(args)
    check_model(config.server.model)
    return build_app(config)


# ----------------------------------------------------------------------------- verispec serve --ray


def check_model(model: str) -> None:
    """An unknown model fails here, in one line, before any replica starts."""
    from ..models.resolve import resolve_model

    resolve_model(model)


def local_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_cpus(config: RayConfig, available: float, where: str) -> None:
    need = config.min_replicas * config.num_cpus
    if need > available:
        n = config.min_replicas
        raise ValueError(f"{n} replica{'s' if n != 1 else ''} x {config.num_cpus:g} CPUs need {need:g} CPUs; "
                         f"{where} has {available:g}")


def serve_ray(config: RayConfig, host: str = "127.0.0.1", port: int = 8000,
              address: str | None = None) -> None:
    """Start (or join, with ``address`` / ``RAY_ADDRESS``) a Ray cluster, deploy, serve on
    ``host:port`` until SIGINT/SIGTERM, then remove the application. Bad configuration
    raises ``ValueError`` (one line) before anything is deployed. A local Ray instance for a
    loopback ``host`` listens on loopback only (``loopback_ray``); a cluster joined from a
    loopback ``host`` gets a warning when its nodes listen on the network."""
    import ray

    from .app import bind_socket

    address = address or os.environ.get("RAY_ADDRESS") or None
    check_model(config.server.model)
    if address is None:
        check_cpus(config, local_cpus(), "this machine")
    bind_socket(host, port).close()  # a busy port fails now, not inside Ray's proxy
    no_usage_stats()
    if address:
        check_reachable(address)
    local = {"num_cpus": local_cpus(), **(loopback_ray() if is_loopback(host) else {})}
    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False, **({} if address else local))
    except Exception as e:  # noqa: BLE001 - Ray's errors are many and long: one line
        raise ValueError(f"cannot {'join the Ray cluster at ' + address if address else 'start Ray'}: "
                         f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from None
    reaper = None if address else ray_reaper.start()  # no Ray process of ours outlives this one
    try:
        if address:
            warn_if_exposed(host, address)
        check_cpus(config, ray.cluster_resources().get("CPU", 0.0), "the Ray cluster")
        serve.start(http_options={"host": host, "port": port}, logging_config=QUIET)
        try:
            serve.run(build_app(config), name=APP_NAME, route_prefix="/", logging_config=QUIET)
        except RuntimeError as e:
            raise ValueError(f"the deployment failed: {str(e).splitlines()[0]}") from None
        print(f"verispec: serving {config.server.model} on http://{host}:{port} with "
              f"{config.replicas if not config.autoscaling else 'autoscaled'} Ray Serve replicas", flush=True)
        _wait_for_signal()
        serve.delete(APP_NAME)
        if address is None:
            serve.shutdown()
    finally:
        ray.shutdown()
        ray_reaper.stop(reaper)


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass


__all__ = [
    "EngineReplica",
    "Frontend",
    "HttpCall",
    "PrefixAwareRouter",
    "RayConfig",
    "app_builder",
    "asgi_call",
    "build_app",
    "config_from_args",
    "serve_ray",
]
