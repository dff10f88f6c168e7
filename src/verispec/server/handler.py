"""The one request path of both OpenAI endpoints: parse (pydantic, before this) -> check ->
build the prompts -> sampling parameters -> submit the jobs -> stream or collect -> shape.

What differs between /v1/completions and /v1/chat/completions (how prompts are built, how a
choice looks) is the ``Endpoint``'s (``endpoints.py``); every failure is an ``ApiError``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from .endpoints import Endpoint
from .generation import Generation, best_choices, collect, merge_stats, sse_events, stream_chunks, usage
from .validation import check_common, sampling_params
from .worker import Event


async def handle_request(endpoint: Endpoint, request: Request) -> dict[str, Any] | StreamingResponse:
    """Serve one request to ``endpoint``: a whole answer (JSON), or SSE chunks when ``stream``;
    ``n`` choices per prompt."""
    out = await run_request(endpoint, request)
    return out if isinstance(out, dict) else sse_response(sse_events(out))


async def run_request(endpoint: Endpoint, request: Request) -> dict[str, Any] | AsyncIterator[dict[str, Any]]:
    """The answer to one request as a dict, or when ``stream`` its chunks as they come (an
    engine failure ends them with an error body): what ``handle_request`` sends, before JSON;
    the Responses API (``responses.py``) translates a chat's."""
    state, body = endpoint.state, endpoint.body
    drafter, draft_limit = check_common(state, body)
    endpoint.check_size()
    prompts = await endpoint.prompts()
    prediction = await endpoint.prediction()
    params = sampling_params(body, endpoint.max_tokens(prompts), state.model.backend.info.vocab_size,
                             endpoint.logprobs, await endpoint.constraint())
    gen = Generation(state, f"{endpoint.id_prefix}-{uuid.uuid4().hex}", prompts, params, drafter, endpoint.samples,
                     draft_limit, prediction, endpoint.prompt_logprobs, endpoint.score_only)
    gen.submit()
    head = {"id": gen.base_id, "object": endpoint.object, "created": int(time.time()), "model": state.name}
    if body.stream:
        head |= {"object": endpoint.chunk_object}
        first = tuple(head | {"choices": [c]} for c in endpoint.opening_choices(len(gen.ids)))

        def chunk(index: int, ev: Event) -> dict | None:
            if not (ev.text or ev.finished or ev.prompt_logprobs is not None
                    or (ev.token_ids and (body.return_token_ids or endpoint.shows_logprobs))):
                return None
            choice = endpoint.stream_choice(index, ev)
            if choice is None:  # held back (a tool call's text is sent once parsed)
                return None
            if body.return_token_ids:
                choice["token_ids"] = ev.token_ids
            return head | {"choices": [choice]} | ({"verispec": ev.stats} if ev.stats else {})

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return stream_chunks(gen, chunk, include_usage, lambda u: head | {"choices": [], "usage": u}, first)
    outs, stats = await collect(gen, request)
    choices = []
    for index, (prompt, out) in enumerate(best_choices(outs, endpoint.samples, body.n)):
        choice = endpoint.choice(index, prompt, out)
        if body.return_token_ids:
            choice |= {"prompt_token_ids": prompts[prompt], "token_ids": out["token_ids"]}
        choices.append(choice)
    tokens = sum(len(out["token_ids"]) for out in outs)  # best_of: every generated token counts
    return head | {"choices": choices, "usage": usage(prompts, tokens, stats), "verispec": merge_stats(stats)}


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
