"""``verispec serve``: an OpenAI-compatible HTTP server over the batched speculative engine.

Thin by design: parse and validate (pydantic + ``SamplingParams``) -> tokenize -> submit
jobs to the engine thread (``worker.py``) -> serialize its events as OpenAI JSON or SSE
chunks. Routes: POST /v1/completions, POST /v1/chat/completions (both streaming and not),
GET /v1/models, GET /v1/models/{id}, GET /health, GET /metrics (Prometheus text).

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
import json
import secrets
import socket
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..api import LoadedModel, encode_prompt, load_model
from ..chat import ChatTooLong, RenderedChat, max_text_chars, render_chat, template_of, tokenize_chat
from ..chat_template import (DEFAULT_MEMORY_MB, DEFAULT_TIMEOUT_S, ChatTemplate, RenderBounds, RenderWorker,
                             TemplateError)
from ..drafters.base import Drafter
from ..engine import Engine
from ..engine.batch import BatchEngine, SpecSchedule
from ..engine.prefix_cache import DEFAULT_MAX_MB as DEFAULT_PREFIX_CACHE_MB
from ..engine.prefix_cache import PrefixCache
from ..models.catalog import DEFAULT_MODEL
from ..registry import best_method, make_drafter
from ..types import SamplingParams, TokenLogprob, sample_seed
from .guard import Limits, RequestGuard, header_timeout_protocol
from .metrics import ServerMetrics
from .openai_logprobs import TextOffsets, chat_logprobs, completion_logprobs
from .schemas import ChatCompletionRequest, CompletionRequest, error_body
from .worker import EngineWorker, Event, Job, QueueFull, ShuttingDown

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "cancelled": "stop"}


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``verispec serve`` can set. ``drafters``: the drafter names requests may
    pick (the first is the default); ``drafter_options`` apply to the default drafter."""

    model: str = DEFAULT_MODEL
    backend: str = "auto"
    dtype: str = "float32"
    quant: str = "auto"
    drafters: tuple[str, ...] = ("auto", "none")
    drafter_options: tuple[tuple[str, str], ...] = ()
    num_draft_tokens: int = 4
    policy: str = "fixed"
    max_batch: int = 16
    max_queue: int = 64
    max_model_len: int = 2048  # 0: what fits (fits_context)
    default_max_tokens: int = 256
    spec_schedule: str = "goodput"
    fixed_cost_rows: float = SpecSchedule.fixed_cost_rows  # a forward's fixed cost in token rows (derived there)
    token_budget: int = 32
    disable_spec_at: int = 0
    served_model_name: str | None = None
    prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB  # 0 = off (engine/prefix_cache.py)
    chat_template_timeout_s: float = DEFAULT_TIMEOUT_S  # one chat's rendering through the template (400 after)
    chat_template_memory_mb: int = DEFAULT_MEMORY_MB  # what that rendering may allocate (400 beyond)
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        if not self.drafters:
            raise ValueError("serve needs at least one drafter")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        self.template_bounds()  # checks them

    def template_bounds(self) -> RenderBounds:
        return RenderBounds(self.chat_template_timeout_s, self.chat_template_memory_mb)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.headers = headers


@dataclass
class ServerState:
    config: ServerConfig
    model: LoadedModel
    worker: EngineWorker
    metrics: ServerMetrics
    name: str
    max_len: int
    created: int
    max_prompt_chars: int  # longer text cannot fit the context: refused before tokenizing
    tokenizer_pool: ThreadPoolExecutor  # one thread: a HF fast tokenizer must not be shared across threads
    aliases: dict[str, str] = field(default_factory=dict)  # a drafter name requests may use -> its engine ("auto")
    chat_template: ChatTemplate | None = None  # None: the model has none, or it does not compile (chat_error)
    chat_error: str | None = None  # why a model with a chat template cannot chat
    render_pool: ThreadPoolExecutor = field(  # one thread (started on first use): waits for chat renders
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="verispec-chat-render"))

    def start(self) -> None:
        """Start the engine thread (the app's lifespan, or a Ray replica, calls it)."""
        self.worker.start()

    def close(self) -> None:
        """Stop the engine thread (failing what still runs), the tokenizer and render threads and
        the render process (a render in progress ends now)."""
        self.worker.stop()
        self.tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        self.render_pool.shutdown(wait=False, cancel_futures=True)
        if self.chat_template is not None:
            self.chat_template.worker.stop()


def build_state(config: ServerConfig, model: LoadedModel | None = None,
                extra_drafters: dict[str, Drafter] | None = None, replica: str | None = None) -> ServerState:
    """Load the model (unless given) and drafters, build the batch engine and its worker.
    ``extra_drafters`` adds ready-made drafters by name (tests use it); ``replica`` names this
    engine in every response's ``verispec`` statistics (a Ray Serve replica)."""
    model = model or load_model(config.model, dtype=config.dtype, backend=config.backend, quant=config.quant)
    target = model.backend
    prefix = PrefixCache.from_mb(config.prefix_cache_mb)  # one for all drafters: they share the target
    engines: dict[str, Engine] = {}
    aliases = {"auto": best_method(model, batched=True)[0]} if "auto" in config.drafters else {}
    for i, name in enumerate(config.drafters):
        opts = dict(config.drafter_options) if i == 0 else {}
        key = aliases.get(name, name)  # auto runs (and is reported) as the method it resolves to
        if key not in engines:
            engines[key] = Engine(target, make_drafter(name, model, opts, batched=True), config.num_draft_tokens,
                                  config.policy, prefix)
    config = replace(config, drafters=tuple(dict.fromkeys(aliases.get(n, n) for n in config.drafters)))
    for name, drafter in (extra_drafters or {}).items():
        engines[name] = Engine(target, drafter, config.num_draft_tokens, config.policy, prefix)
    drafters = [e.drafter for e in engines.values()]
    max_len = (fits_context(target, config.max_batch, drafters) if config.max_model_len == 0
               else min(config.max_model_len, target.info.max_length))
    reserve_drafters(target, engines, config.max_batch, max_len)
    batch = BatchEngine(target, engines, config.max_batch, max_len,
                        SpecSchedule(config.spec_schedule, config.token_budget, config.disable_spec_at,
                                     config.fixed_cost_rows))
    name = config.served_model_name or config.model
    metrics = ServerMetrics(name)
    worker = EngineWorker(batch, model.tokenizer, metrics, config.max_queue, replica)
    pool = ThreadPoolExecutor(1, thread_name_prefix="verispec-tokenize")
    state = ServerState(config, model, worker, metrics, name, max_len, int(time.time()),
                        max_text_chars(model.tokenizer, max_len), pool, aliases)
    if model.has_chat_template:
        try:
            state.chat_template = template_of(model.tokenizer, config.template_bounds(), RenderWorker())
        except ValueError as e:  # TemplateError: a completion-only user of this model file is still served
            state.chat_error = str(e)
            warnings.warn(f"{e}; /v1/chat/completions will answer 400, /v1/completions is served", stacklevel=2)
    return state


def reserve_drafters(target, engines: dict[str, Engine], max_batch: int, max_len: int) -> None:
    """Size the drafters' context-sized state (a draft model's K/V) to the server's context and
    allocate it now, after checking that it fits beside the target's batch (one line if not):
    sized by the draft's own context on its first request, it took memory nothing had counted,
    and under a memory cap every drafted request failed while /health said ok."""
    from ..engine.batch import batch_bytes, supports_batching
    from ..memory import check_fits

    drafts = sum(e.drafter.context_bytes(max_len, max_batch) for e in engines.values())
    if drafts:  # the batch engine checks the target's rows alone
        rows = batch_bytes(target, engines, max_batch, max_len) if supports_batching(target) else 0
        check_fits(rows + drafts, f"a batch of {max_batch} requests x {max_len} tokens with its draft caches",
                   "lower --max-batch or --max-model-len")
    for engine in engines.values():
        engine.drafter.reserve(max_len, max_batch)


def fits_context(target, max_batch: int, drafters: Sequence[Drafter] = (), share: float = 0.6) -> int:
    """The longest context (a multiple of 64, at most the model's) whose K/V for ``max_batch``
    requests (the target's and the ``drafters``' draft caches) takes at most ``share`` of the
    memory available now; at least 2048 (or the model's context), which the start-up then
    refuses in one line if it cannot hold."""
    from ..memory import available_bytes, cache_pool_bytes

    per_token = (cache_pool_bytes(target, max_batch, 64) + sum(d.context_bytes(64, max_batch) for d in drafters)) / 64
    fit = int(available_bytes() * share / per_token) // 64 * 64
    ctx = target.info.max_length
    return min(ctx, max(fit, 2048))


# ----------------------------------------------------------------------------- validation


def sampling_params(body: CompletionRequest | ChatCompletionRequest, max_tokens: int, vocab: int,
                    logprobs: int | None = None) -> SamplingParams:
    """The request's sampling parameters; penalties, bias, min-p and stop ids are checked
    here (HTTP 400 naming the field) so the engine thread never sees an invalid value."""
    bias = _logit_bias(body.logit_bias, vocab)
    if any(not 0 <= t < vocab for t in body.stop_token_ids or ()):
        raise ApiError(400, f"stop_token_ids must be token ids in [0, {vocab})", "stop_token_ids")
    try:
        return SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            max_new_tokens=max_tokens,
            seed=secrets.randbits(62) if body.seed is None else body.seed,
            stop=body.stop_strings(),
            ignore_eos=body.ignore_eos,
            min_p=float(body.min_p),
            presence_penalty=float(body.presence_penalty),
            frequency_penalty=float(body.frequency_penalty),
            repetition_penalty=float(body.repetition_penalty),
            logit_bias=bias,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            logprobs=logprobs,
        )
    except ValueError as e:
        known = ("temperature", "top_p", "top_k", "seed", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "logit_bias")
        first = str(e).split(" ", 1)[0]  # SamplingParams' messages mostly start with the field's name
        param = first if first in known else next((f for f in known if f in str(e)), None)
        raise ApiError(400, str(e), param) from None


def _logit_bias(bias: dict[str, float] | None, vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} -> ((id, bias), ...); ids must be ASCII digits naming a token
    of the vocabulary (``str.isdigit`` also takes "²", "١٢" or "１２"; a key is checked for
    length before ``int`` so a 5,000-digit one costs nothing)."""
    out = []
    for key, value in (bias or {}).items():
        digits = key.strip()
        if not (digits.isascii() and digits.isdigit() and len(digits) <= len(str(vocab))) or int(digits) >= vocab:
            raise ApiError(400, f"logit_bias keys must be token ids in [0, {vocab}), got {key!r}", "logit_bias")
        if not -100.0 <= value <= 100.0:
            raise ApiError(400, f"logit_bias values must be in [-100, 100], got {value}", "logit_bias")
        out.append((int(digits), float(value)))
    return tuple(out)


def max_new_tokens(requested: int | None, default: int, prompt_len: int, max_len: int, param: str) -> int:
    """The request's token budget, refusing prompts that do not fit the context.

    ``max_new_tokens(None, 256, 100, 2048, "max_tokens") == 256``; ``(None, 256, 2000, 2048)``
    -> 48 (the default shrinks to the room left); ``(100, 256, 2000, 2048)`` -> HTTP 400.
    """
    room = max_len - prompt_len
    if room < 1:
        raise ApiError(400, f"the prompt has {prompt_len} tokens; this server's context is {max_len} "
                       "(prompt + at least one new token)", param, "context_length_exceeded")
    if requested is None:
        return min(default, room)
    if requested > room:
        raise ApiError(400, f"prompt ({prompt_len} tokens) + max_tokens ({requested}) exceeds this server's "
                       f"context of {max_len}", "max_tokens", "context_length_exceeded")
    return requested


def check_common(state: ServerState, body: CompletionRequest | ChatCompletionRequest) -> tuple[str, int | None]:
    """Model name, unsupported fields and speculation control; returns the drafter name
    and the request's draft cap (None = the server's; 0 = speculation off)."""
    if body.model not in (state.name, state.model.name):
        raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {state.name!r}",
                       "model", "model_not_found")
    bad = body.unsupported()
    if bad:
        raise ApiError(400, bad[1], bad[0])
    drafter = state.aliases.get(body.drafter, body.drafter) or state.config.drafters[0]
    if not state.worker.engine.engines.get(drafter):
        raise ApiError(400, f"unknown drafter {drafter!r}; this server has: {', '.join(state.worker.engine.engines)}",
                       "drafter")
    if not body.speculation and body.num_draft_tokens:
        raise ApiError(400, "speculation = false contradicts num_draft_tokens > 0", "num_draft_tokens")
    return drafter, 0 if not body.speculation else body.num_draft_tokens


def check_prompt_sizes(state: ServerState, texts: list[str], token_lists: list[list[int]], param: str) -> None:
    """Refuse what cannot fit before any tokenization: token-id prompts over the context and
    texts longer than ``max_prompt_chars``."""
    for ids in token_lists:
        if len(ids) >= state.max_len:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this server's context is {state.max_len}",
                           param, "context_length_exceeded")
    if any(len(t) > state.max_prompt_chars for t in texts):
        raise ApiError(400, f"the prompt is longer than {state.max_prompt_chars} characters, more than this "
                       f"server's context of {state.max_len} tokens can hold", param, "context_length_exceeded")


def check_chat_size(state: ServerState, messages: list[dict[str, str]]) -> None:
    """Refuse a chat that cannot fit before rendering it: every message has a non-empty
    content (at least one token), so more messages than context tokens never fit; nor
    do contents longer than ``max_prompt_chars`` in all."""
    if len(messages) >= state.max_len:
        raise ApiError(400, f"{len(messages)} messages cannot fit this server's context of {state.max_len} tokens",
                       "messages", "context_length_exceeded")
    check_prompt_sizes(state, ["".join(m["content"] for m in messages)], [], "messages")


def render_chat_prompt(state: ServerState, messages: list[dict[str, str]]) -> RenderedChat:
    """A chat through the model's template (``api.encode_prompt``'s checks), on the render
    thread: refuses a rendering longer than ``max_prompt_chars`` (the template's own text
    counts), or past the template's time or memory bound, in one line."""
    if any(not m["content"].strip() for m in messages):
        raise ApiError(400, "chat messages must be non-empty", "messages")
    if state.chat_error is not None:
        raise ApiError(400, state.chat_error, "messages", "chat_template_error")
    if state.chat_template is None:
        raise ApiError(400, f"model {state.model.name} has no chat template; use /v1/completions", "messages")
    try:
        return render_chat(state.model.tokenizer, messages, state.max_prompt_chars, state.chat_template)
    except ChatTooLong as e:
        raise ApiError(400, str(e), "messages", "context_length_exceeded") from None
    except TemplateError as e:
        raise ApiError(400, str(e), "messages", "chat_template_error") from None


def tokenize_chat_prompt(state: ServerState, messages: list[dict[str, str]], rendered: RenderedChat) -> list[int]:
    """Token ids of a rendered chat, its message contents literal (on the tokenizer thread)."""
    try:
        return tokenize_chat(state.model.tokenizer, messages, rendered)
    except ValueError as e:
        raise ApiError(400, str(e), "messages") from None


def encode_completion_prompt(state: ServerState, prompt: str | list[int]) -> list[int]:
    vocab = state.model.backend.info.vocab_size
    if isinstance(prompt, list):
        if not prompt or min(prompt) < 0 or max(prompt) >= vocab:
            raise ApiError(400, f"prompt token ids must be a non-empty list in [0, {vocab})", "prompt")
        return prompt
    try:
        return encode_prompt(state.model, prompt, chat=False)
    except ValueError as e:
        raise ApiError(400, str(e), "prompt") from None


async def off_loop(state: ServerState, fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` on the tokenizer thread (the event loop keeps serving others)."""
    return await asyncio.get_running_loop().run_in_executor(state.tokenizer_pool, fn, *args)


# ----------------------------------------------------------------------------- jobs


class Generation:
    """The jobs of one HTTP request and the event queue they report to (on the event loop)."""

    def __init__(self, state: ServerState, base_id: str, prompts: list[list[int]], params: SamplingParams,
                 drafter: str, n: int = 1, draft_limit: int | None = None):
        """``n`` samples per prompt: choice ``i * n + j`` is sample j of prompt i, seeded
        ``sample_seed(seed, j)`` = ``seed + j`` wrapping past 2^63 - 1 to 0 (as vLLM seeds n > 1
        children), sharing prompt i's prefill."""
        loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        self.state, self.prompts, self.base_id = state, prompts, base_id
        total = len(prompts) * n
        self.ids = [base_id if total == 1 else f"{base_id}-{k}" for k in range(total)]
        self.open = set(self.ids)

        def sink(index: int) -> Callable[[Event], None]:
            return lambda ev: loop.call_soon_threadsafe(self.queue.put_nowait, (index, ev))

        self.jobs = [Job(self.ids[k], prompts[k // n], replace(params, seed=sample_seed(params.seed, k % n)), drafter,
                         sink(k), draft_limit=draft_limit, fork_of=self.ids[k - k % n] if k % n else None)
                     for k in range(total)]

    def submit(self) -> None:
        try:
            self.state.worker.submit(self.jobs)
        except QueueFull as e:
            self.state.metrics.request_done("rejected")
            raise ApiError(429, str(e), None, "queue_full", "rate_limit_error", {"Retry-After": "1"}) from None
        except ShuttingDown as e:
            self.state.metrics.request_done("rejected")
            raise ApiError(503, str(e), None, "shutting_down", "server_error", {"Retry-After": "5"}) from None

    async def next(self) -> tuple[int, Event]:
        index, ev = await self.queue.get()
        if ev.finished or ev.error:
            self.open.discard(ev.request_id)
        return index, ev

    def cancel(self) -> None:
        for rid in list(self.open):
            self.state.worker.cancel(rid)
        self.open.clear()


def usage(prompts: list[list[int]], completion_tokens: int) -> dict[str, int]:
    p = sum(len(x) for x in prompts)
    return {"prompt_tokens": p, "completion_tokens": completion_tokens, "total_tokens": p + completion_tokens}


def merge_stats(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """Speculation statistics of a response: the single choice's, or sums over choices."""
    if len(stats) == 1:
        return stats[0]
    keys = ("prompt_tokens", "new_tokens", "target_forwards", "steps", "drafted", "accepted")
    out = {k: sum(s[k] for s in stats) for k in keys}
    out["tau"] = round((out["accepted"] + out["steps"]) / out["steps"], 4) if out["steps"] else 0.0
    out["alpha"] = round(out["accepted"] / out["drafted"], 4) if out["drafted"] else 0.0
    if "replica" in stats[0]:  # one request's choices all run on one engine
        out["replica"] = stats[0]["replica"]
    return out | {"choices": stats}


async def collect(gen: Generation, request: Request) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Wait for every choice; returns (choices with text/token_ids/finish_reason, stats).
    Polls for a client disconnect so an abandoned request stops generating."""
    n = len(gen.ids)
    texts: list[list[str]] = [[] for _ in range(n)]
    ids: list[list[int]] = [[] for _ in range(n)]
    logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
    done: list[dict[str, Any] | None] = [None] * n
    next_check = time.monotonic() + 0.5
    while gen.open:
        try:
            index, ev = await asyncio.wait_for(gen.next(), timeout=0.5)
        except TimeoutError:
            index, ev = -1, None
        if time.monotonic() >= next_check:  # events may never pause: check on a clock
            next_check = time.monotonic() + 0.5
            if await request.is_disconnected():
                gen.cancel()
                raise ApiError(499, "client disconnected") from None
        if ev is None:
            continue
        if ev.error:
            gen.cancel()
            raise ApiError(ev.status, ev.error, None, None, "server_error" if ev.status >= 500 else "invalid_request_error")
        texts[index].append(ev.text)
        ids[index].extend(ev.token_ids)
        logprobs[index].extend(ev.logprobs or [])
        if ev.finished:
            done[index] = {"finish_reason": FINISH[ev.finished], "stats": ev.stats}
    choices = [{"text": "".join(t), "token_ids": i, "logprobs": lp, "finish_reason": d["finish_reason"]}
               for t, i, lp, d in zip(texts, ids, logprobs, done)]  # type: ignore[index]
    return choices, [d["stats"] for d in done]  # type: ignore[index]


def best_choices(choices: list[dict[str, Any]], best_of: int, n: int) -> list[tuple[int, dict[str, Any]]]:
    """(prompt index, choice) of the ``n`` choices per prompt with the highest cumulative
    logprob among its ``best_of`` samples (OpenAI's best_of; ties keep sample order).
    ``best_of == n`` returns every choice in order."""
    out = []
    for p in range(len(choices) // best_of):
        group = choices[p * best_of:(p + 1) * best_of]
        if best_of > n:
            group = sorted(group, key=lambda c: -sum(lp.logprob for lp in c["logprobs"]))[:n]
        out += [(p, c) for c in group]
    return out


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def stream_events(gen: Generation, chunk: Callable[[int, Event], dict | None], include_usage: bool,
                        usage_chunk: Callable[[dict], dict], first: tuple[dict, ...] = ()) -> AsyncIterator[str]:
    """SSE stream of a generation; a client disconnect (the task is cancelled) cancels the jobs."""
    completion_tokens = 0
    stats: list[dict[str, Any]] = []
    try:
        for c in first:
            yield sse(c)
        while gen.open:
            index, ev = await gen.next()
            if ev.error:
                gen.cancel()
                yield sse(error_body(ev.error, "server_error" if ev.status >= 500 else "invalid_request_error"))
                break
            completion_tokens += len(ev.token_ids)
            if ev.stats:
                stats.append(ev.stats)
            c = chunk(index, ev)
            if c is not None:
                yield sse(c)
        else:
            if include_usage:
                yield sse(usage_chunk(usage(gen.prompts, completion_tokens)) | {"verispec": merge_stats(stats)})
        yield "data: [DONE]\n\n"
    finally:
        gen.cancel()


# ----------------------------------------------------------------------------- app


def create_app(state: ServerState) -> FastAPI:
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

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await handle_completion(state, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await handle_chat(state, body, request)

    return app


# ----------------------------------------------------------------------------- routes


async def handle_completion(state: ServerState, body: CompletionRequest, request: Request):
    """POST /v1/completions: ``n`` choices per prompt; SSE when ``stream``."""
    drafter, draft_limit = check_common(state, body)
    raw_prompts = body.prompts()
    samples = len(raw_prompts) * (body.best_of or body.n)
    if samples > state.worker.max_queue:
        raise ApiError(400, f"{len(raw_prompts)} prompts x {body.best_of or body.n} samples in one request; this "
                       f"server queues at most {state.worker.max_queue}", "prompt", "too_many_prompts")
    check_prompt_sizes(state, [p for p in raw_prompts if isinstance(p, str)],
                       [p for p in raw_prompts if isinstance(p, list)], "prompt")
    prompts = [await off_loop(state, encode_completion_prompt, state, p) for p in raw_prompts]  # one slice each
    lens = [max_new_tokens(body.max_tokens, 16, len(p), state.max_len, "prompt") for p in prompts]
    best_of = body.best_of or body.n  # > n: generate best_of, return the n most likely (needs logprobs)
    logprobs = body.logprobs if best_of == body.n or body.logprobs is not None else 0
    params = sampling_params(body, min(lens), state.model.backend.info.vocab_size, logprobs)
    gen = Generation(state, f"cmpl-{uuid.uuid4().hex}", prompts, params, drafter, best_of, draft_limit)
    gen.submit()
    tok = state.model.tokenizer
    echoes = [(p if isinstance(p, str) else tok.decode(p)) if body.echo else "" for p in raw_prompts]
    head = {"id": gen.base_id, "object": "text_completion", "created": int(time.time()), "model": state.name}
    if body.stream:
        offsets = [TextOffsets(len(echoes[k // best_of])) for k in range(len(gen.ids))]  # text_offset per choice

        def chunk(i: int, ev: Event) -> dict | None:
            if not (ev.text or ev.finished or (ev.token_ids and (body.return_token_ids or body.logprobs is not None))):
                return None
            choice = {"index": i, "text": ev.text, "logprobs": None, "finish_reason": FINISH.get(ev.finished or "")}
            if body.logprobs is not None:
                choice["logprobs"] = completion_logprobs(tok, ev.logprobs or [], offsets[i])  # advances offsets[i]
            if body.return_token_ids:
                choice["token_ids"] = ev.token_ids
            return head | {"choices": [choice]} | ({"verispec": ev.stats} if ev.stats else {})
        first = tuple(head | {"choices": [{"index": k, "text": echoes[k // best_of], "logprobs": None,
                                           "finish_reason": None}]}
                      for k in range(len(gen.ids)) if body.echo)
        return _sse_response(stream_events(gen, chunk, _include_usage(body),
                                           lambda u: head | {"choices": [], "usage": u}, first))
    choices, stats = await collect(gen, request)
    tokens = sum(len(c["token_ids"]) for c in choices)  # best_of: every generated token counts
    out = []
    for i, (p, c) in enumerate(best_choices(choices, best_of, body.n)):
        echo = echoes[p]
        choice = {"index": i, "text": echo + c["text"], "logprobs": None, "finish_reason": c["finish_reason"]}
        if body.logprobs is not None:
            choice["logprobs"] = completion_logprobs(tok, c["logprobs"], len(echo))
        if body.return_token_ids:
            choice |= {"prompt_token_ids": prompts[p], "token_ids": c["token_ids"]}
        out.append(choice)
    return head | {"choices": out, "usage": usage(prompts, tokens), "verispec": merge_stats(stats)}


async def handle_chat(state: ServerState, body: ChatCompletionRequest, request: Request):
    """POST /v1/chat/completions: the model's chat template, ``n`` choices; SSE chunks when ``stream``."""
    drafter, draft_limit = check_common(state, body)
    if body.n > state.worker.max_queue:
        raise ApiError(400, f"n = {body.n} samples in one request; this server queues at most "
                       f"{state.worker.max_queue}", "n", "too_many_prompts")
    messages = body.chat_messages()
    check_chat_size(state, messages)
    loop = asyncio.get_running_loop()
    rendered = await loop.run_in_executor(state.render_pool, render_chat_prompt, state, messages)  # the render thread
    prompt = await off_loop(state, tokenize_chat_prompt, state, messages, rendered)
    budget = max_new_tokens(body.max_completion_tokens or body.max_tokens, state.config.default_max_tokens,
                            len(prompt), state.max_len, "messages")
    want_lp = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(body, budget, state.model.backend.info.vocab_size, want_lp)
    gen = Generation(state, f"chatcmpl-{uuid.uuid4().hex}", [prompt], params, drafter, body.n, draft_limit)
    gen.submit()
    tok = state.model.tokenizer
    head = {"id": gen.base_id, "object": "chat.completion", "created": int(time.time()), "model": state.name}
    if body.stream:
        chead = head | {"object": "chat.completion.chunk"}
        first = tuple(chead | {"choices": [{"index": k, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]} for k in range(body.n))

        def chunk(i: int, ev: Event) -> dict | None:
            if not (ev.text or ev.finished or (ev.token_ids and (body.return_token_ids or want_lp is not None))):
                return None
            choice = {"index": i, "delta": {"content": ev.text} if ev.text else {}, "logprobs": None,
                      "finish_reason": FINISH.get(ev.finished or "")}
            if want_lp is not None:
                choice["logprobs"] = chat_logprobs(tok, ev.logprobs or [])
            if body.return_token_ids:
                choice["token_ids"] = ev.token_ids
            return chead | {"choices": [choice]} | ({"verispec": ev.stats} if ev.stats else {})
        return _sse_response(stream_events(gen, chunk, _include_usage(body),
                                           lambda u: chead | {"choices": [], "usage": u}, first))
    choices, stats = await collect(gen, request)
    out = []
    for i, c in enumerate(choices):
        choice = {"index": i, "message": {"role": "assistant", "content": c["text"]},
                  "logprobs": chat_logprobs(tok, c["logprobs"]) if want_lp is not None else None,
                  "finish_reason": c["finish_reason"]}
        if body.return_token_ids:
            choice |= {"prompt_token_ids": prompt, "token_ids": c["token_ids"]}
        out.append(choice)
    tokens = sum(len(c["token_ids"]) for c in choices)
    return head | {"choices": out, "usage": usage([prompt], tokens), "verispec": merge_stats(stats)}


def _include_usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def _is_type_tag(loc: Any) -> bool:
    """pydantic names the union member in error locations ("str", "list[int]", ...): not a param."""
    return isinstance(loc, str) and ("[" in loc or loc in ("str", "int", "float", "bool") or "-" in loc)


def _sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


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
        msg = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
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
