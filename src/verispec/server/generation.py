"""The jobs of one HTTP request and their events, on the event loop: ``Generation`` submits a
request's jobs (one per prompt and sample) to the engine thread and receives their events;
``collect`` waits for a whole answer (stopping the jobs when the client disconnects),
``stream_chunks`` turns the events into chunks as they come (``stream_events``: as SSE). Both endpoints use them
(``handler.py``); what a choice looks like is the endpoint's (``endpoints.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from fastapi import Request

from ..types import SamplingParams, TokenLogprob, sample_seed
from .schemas import ApiError, error_body
from .state import ServerState
from .worker import Event, Job, QueueFull, ShuttingDown

KEEPALIVE_S = 1.0  # a stream silent this long gets an SSE comment line (clients skip comments)

# the engine's finish reasons -> OpenAI's finish_reason
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "grammar": "length",
          "cancelled": "stop"}


class Generation:
    """The jobs of one HTTP request and the event queue they report to (on the event loop)."""

    def __init__(self, state: ServerState, base_id: str, prompts: list[list[int]], params: SamplingParams,
                 drafter: str, n: int = 1, draft_limit: int | None = None, prediction: tuple[int, ...] | None = None,
                 prompt_logprobs: int | None = None, score_only: bool = False):
        """``n`` samples per prompt: choice ``i * n + j`` is sample j of prompt i, seeded
        ``sample_seed(seed, j)`` = ``seed + j`` wrapping past 2^63 - 1 to 0 (as vLLM seeds n > 1
        children), sharing prompt i's prefill. ``prompt_logprobs``: score each prompt (that many
        alternatives per token); ``score_only``: generate nothing (``worker.Job``)."""
        loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        self.state, self.prompts, self.base_id = state, prompts, base_id
        total = len(prompts) * n
        self.ids = [base_id if total == 1 else f"{base_id}-{k}" for k in range(total)]
        self.open = set(self.ids)

        def sink(index: int) -> Callable[[Event], None]:
            return lambda ev: loop.call_soon_threadsafe(self.queue.put_nowait, (index, ev))

        self.jobs = [Job(self.ids[k], prompts[k // n], replace(params, seed=sample_seed(params.seed, k % n)), drafter,
                         sink(k), draft_limit=draft_limit, fork_of=self.ids[k - k % n] if k % n else None,
                         prediction=prediction, prompt_logprobs=prompt_logprobs, score_only=score_only)
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


PREDICTION_USAGE = ("accepted_prediction_tokens", "rejected_prediction_tokens")


def usage(prompts: list[list[int]], completion_tokens: int, stats: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI's usage; ``prompt_tokens_details.cached_tokens``: prompt tokens the prefix cache gave
    (``stats`` in choice order, a prompt's samples together: its first sample's count); with a
    prediction, ``completion_tokens_details`` counts its accepted and rejected tokens (summed over
    the choices, from their statistics)."""
    p = sum(len(x) for x in prompts)
    out: dict[str, Any] = {"prompt_tokens": p, "completion_tokens": completion_tokens,
                           "total_tokens": p + completion_tokens,
                           "prompt_tokens_details": {"cached_tokens": cached_tokens(len(prompts), stats)}}
    if any(PREDICTION_USAGE[1] in s for s in stats):
        out["completion_tokens_details"] = {k: sum(s.get(k, 0) for s in stats) for k in PREDICTION_USAGE}
    return out


def cached_tokens(num_prompts: int, stats: list[dict[str, Any]]) -> int:
    """Prompt tokens reused from the prefix cache: per prompt, its first sample's (the others share
    its prefill); ``stats`` holds each prompt's samples together, in choice order."""
    if not num_prompts or len(stats) % num_prompts:
        return 0
    n = len(stats) // num_prompts
    return sum(int(stats[i * n].get("cached_tokens", 0)) for i in range(num_prompts))


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
    scored: list[list[TokenLogprob] | None] = [None] * n
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
        if ev.prompt_logprobs is not None:
            scored[index] = ev.prompt_logprobs
        if ev.finished:
            done[index] = {"finish_reason": FINISH[ev.finished], "stats": ev.stats}
    choices = [{"text": "".join(t), "token_ids": i, "logprobs": lp, "finish_reason": d["finish_reason"],
                "prompt_logprobs": s} for t, i, lp, d, s in zip(texts, ids, logprobs, done, scored)]  # type: ignore[index]
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


async def stream_chunks(gen: Generation, chunk: Callable[[int, Event], dict | None], include_usage: bool,
                        usage_chunk: Callable[[dict], dict], first: tuple[dict, ...] = ()) -> AsyncIterator[dict | str]:
    """The chunks of a generation as they come (an error event ends it with an error body); a
    client disconnect (the consumer closes it) cancels the jobs. After ``KEEPALIVE_S`` without an
    event (queued, a long prefill, another request's prefill stalling the batch) an SSE comment
    line (a str) says the request is alive: ``: queued or prefilling, 3 s`` before the first
    token, ``: keep-alive`` after; SSE clients skip comments, and proxies with idle timeouts keep
    the connection."""
    completion_tokens = 0
    by_choice: dict[int, dict[str, Any]] = {}
    started, t0 = False, time.monotonic()
    try:
        for c in first:
            yield c
        while gen.open:
            try:
                index, ev = await asyncio.wait_for(gen.next(), KEEPALIVE_S)
            except TimeoutError:
                yield ": keep-alive\n\n" if started else f": queued or prefilling, {time.monotonic() - t0:.0f} s\n\n"
                continue
            started = True
            if ev.error:
                gen.cancel()
                yield error_body(ev.error, "server_error" if ev.status >= 500 else "invalid_request_error")
                break
            completion_tokens += len(ev.token_ids)
            if ev.stats:
                by_choice[index] = ev.stats
            c = chunk(index, ev)
            if c is not None:
                yield c
        else:
            if include_usage:
                stats = [by_choice[i] for i in sorted(by_choice)]
                yield usage_chunk(usage(gen.prompts, completion_tokens, stats)) | {"verispec": merge_stats(stats)}
    finally:
        gen.cancel()


async def sse_events(chunks: AsyncIterator[dict | str]) -> AsyncIterator[str]:
    """``chunks`` as SSE ``data:`` lines (comment lines as they are), then ``[DONE]``; closing it
    closes ``chunks``."""
    async with contextlib.aclosing(chunks):
        async for c in chunks:
            yield c if isinstance(c, str) else sse(c)
    yield "data: [DONE]\n\n"


def stream_events(gen: Generation, chunk: Callable[[int, Event], dict | None], include_usage: bool,
                  usage_chunk: Callable[[dict], dict], first: tuple[dict, ...] = ()) -> AsyncIterator[str]:
    """SSE stream of a generation (``stream_chunks`` serialized); a client disconnect (the task is
    cancelled) cancels the jobs."""
    return sse_events(stream_chunks(gen, chunk, include_usage, usage_chunk, first))
