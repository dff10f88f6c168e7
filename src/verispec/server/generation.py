"""The jobs of one HTTP request and their events, on the event loop: ``Generation`` submits a
request's jobs (one per prompt and sample) to the engine thread and receives their events;
``collect`` waits for a whole answer (stopping the jobs when the client disconnects),
``stream_events`` turns the events into SSE chunks as they come. Both endpoints use them
(``handler.py``); what a choice looks like is the endpoint's (``endpoints.py``).
"""

from __future__ import annotations

import asyncio
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

# the engine's finish reasons -> OpenAI's finish_reason
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "grammar": "length",
          "cancelled": "stop"}


class Generation:
    """The jobs of one HTTP request and the event queue they report to (on the event loop)."""

    def __init__(self, state: ServerState, base_id: str, prompts: list[list[int]], params: SamplingParams,
                 drafter: str, n: int = 1, draft_limit: int | None = None,
                 prediction: tuple[int, ...] | None = None):
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
                         sink(k), draft_limit=draft_limit, fork_of=self.ids[k - k % n] if k % n else None,
                         prediction=prediction)
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
    """OpenAI's usage; with a prediction, ``completion_tokens_details`` counts its accepted and
    rejected tokens (summed over the choices, from their statistics)."""
    p = sum(len(x) for x in prompts)
    out: dict[str, Any] = {"prompt_tokens": p, "completion_tokens": completion_tokens,
                           "total_tokens": p + completion_tokens}
    if any(PREDICTION_USAGE[1] in s for s in stats):
        out["completion_tokens_details"] = {k: sum(s.get(k, 0) for s in stats) for k in PREDICTION_USAGE}
    return out


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
                yield sse(usage_chunk(usage(gen.prompts, completion_tokens, stats)) | {"verispec": merge_stats(stats)})
        yield "data: [DONE]\n\n"
    finally:
        gen.cancel()
