"""The OpenAI Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

An adapter over the chat path, so a response gets everything a chat completion does
(speculation, the prefix cache, structured outputs, tool calls): the request becomes a chat
request (``responses_schema.py``), the chat endpoint serves it (``handler.run_request``), and
its answer becomes the Responses' shape:

- ``output``: a ``message`` item (one ``output_text`` part) when the answer has text or no
  call, then one ``function_call`` item (``call_id``, ``name``, ``arguments``) per tool call;
  ``output_text`` (the text, also on the JSON: the openai client computes it); ``status``
  "completed", or "incomplete" with ``incomplete_details.reason`` "max_output_tokens" when the
  answer was cut by the token budget; ``usage`` with ``input_tokens_details.cached_tokens`` (the
  prompt tokens the prefix cache gave) and ``output_tokens_details.reasoning_tokens`` (0);
  ``verispec``: the speculation statistics, as on a chat completion.
- ``stream``: typed SSE events (``event: <type>`` and data with ``type`` and
  ``sequence_number``, from 0): ``response.created``, ``response.in_progress``, per item
  ``response.output_item.added``, for text ``response.content_part.added``,
  ``response.output_text.delta`` ..., ``response.output_text.done``,
  ``response.content_part.done``, for a call ``response.function_call_arguments.delta`` ...,
  ``response.function_call_arguments.done``, then ``response.output_item.done``; last
  ``response.completed`` (``response.incomplete`` when cut, ``response.failed`` when the engine
  fails), carrying the whole response. The chat stream's tool calls are read as OpenAI streams
  them (a call's id and name first, then its arguments in pieces) or whole in one chunk.
- ``previous_response_id``: the stored conversation (``responses_store.py``: per API key,
  bounded) comes before the new input; an id the key did not store is a 404.

Errors are the chat path's, OpenAI-shaped, with the chat's parameter names mapped to the
Responses' (``messages`` -> ``input``, ``response_format`` -> ``text.format``, ...).
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from pydantic import ValidationError

from .endpoints import Chat
from .handler import run_request, sse_response
from .responses_schema import ResponsesRequest
from .responses_store import ResponseStore, owner_of
from .schemas import ApiError, ChatCompletionRequest
from .state import ServerState

# the chat request's parameters as a Responses request names them
PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
          "response_format": "text.format"}


def add_response_routes(app: FastAPI, state: ServerState, store: ResponseStore | None = None) -> None:
    """Register the Responses API on ``app``; its store is ``app.state.responses``."""
    app.state.responses = store or ResponseStore()

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        return await respond(state, request.app.state.responses, body, request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> dict:
        entry = request.app.state.responses.get(owner_of(request.headers.get("authorization")), response_id)
        if entry is None:
            raise _not_found(response_id)
        return entry.response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> dict:
        if not request.app.state.responses.delete(owner_of(request.headers.get("authorization")), response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", None, "response_not_found",
                    "invalid_request_error")


async def respond(state: ServerState, store: ResponseStore, body: ResponsesRequest, request: Request):
    """Serve one Responses request through the chat path: a response dict, or its SSE events."""
    bad = body.unsupported()
    if bad:
        raise ApiError(400, bad[1], bad[0])
    owner = owner_of(request.headers.get("authorization"))
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = store.get(owner, body.previous_response_id)
        if previous is None:
            raise ApiError(404, f"Previous response with id '{body.previous_response_id}' not found.",
                           "previous_response_id", "previous_response_not_found")
        history = previous.conversation
    try:
        chat = ChatCompletionRequest.model_validate(body.chat_body(history))
    except ValidationError as e:  # an extension's value (the Responses' own fields were checked before)
        first = e.errors()[0]
        param = ".".join(str(x) for x in first["loc"][:1]) or None
        param = PARAMS.get(param or "", param)
        raise ApiError(400, f"{param}: {first['msg']}" if param else str(first["msg"]), param, "invalid_value") from None
    turn = Turn(state, body, history)
    try:
        out = await run_request(Chat(state, chat), request)
    except ApiError as e:
        e.param = PARAMS.get(e.param or "", e.param)
        raise
    if isinstance(out, dict):
        choice = out["choices"][0]
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        output = output_items(choice["message"], status)
        return turn.finish(store, owner, status, output, response_usage(out["usage"], out.get("verispec")),
                           out.get("verispec"))
    return sse_response(stream_response(turn, out, store, owner))


def output_items(message: dict[str, Any], status: str) -> list[dict[str, Any]]:
    """A chat answer's message as output items: its text (also an empty answer's), then its calls."""
    calls = message.get("tool_calls") or []
    text = [message_item(message["content"] or "", status)] if message["content"] or not calls else []
    return text + [call_item(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]


class Turn:
    """One Responses request being served: its id and what its response object repeats."""

    def __init__(self, state: ServerState, body: ResponsesRequest, history: list[dict[str, Any]]):
        self.body, self.history, self.model = body, history, state.name
        self.id, self.created = f"resp_{uuid.uuid4().hex}", int(time.time())

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        b = self.body
        fmt = b.text.format if b.text is not None and b.text.format is not None else None
        choice = b.tool_choice if b.tool_choice is None or isinstance(b.tool_choice, str) else b.tool_choice.model_dump()
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": self.model,
            "output": output, "output_text": "".join(p["text"] for item in output if item["type"] == "message"
                                                     for p in item["content"]),
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id, "store": b.stored,
            "temperature": 1.0 if b.temperature is None else b.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": choice or "auto", "tools": [t.model_dump() for t in b.tools or ()],
            "top_p": 1.0 if b.top_p is None else b.top_p, "truncation": "disabled", "usage": usage,
            "user": b.user, "metadata": b.metadata or {},
        }

    def finish(self, store: ResponseStore, owner: str, status: str, output: list[dict[str, Any]],
               usage: dict[str, Any], stats: dict[str, Any] | None) -> dict[str, Any]:
        """The final response, kept in ``store`` unless ``store: false``; ``verispec``: the
        speculation statistics, as a chat completion has them."""
        response = self.response(status, output, usage) | {"completed_at": int(time.time())}
        if stats:
            response["verispec"] = stats
        if self.body.stored:
            store.put(owner, response, self.history + self.body.input_items() + output)
        return response


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "status": status,
            "content": [text_part(text)]}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call_id: str | None, name: str, arguments: str, status: str = "completed",
              item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": status,
            "call_id": call_id or f"call_{uuid.uuid4().hex[:24]}", "name": name, "arguments": arguments}


def response_usage(usage: dict[str, Any], stats: dict[str, Any] | None) -> dict[str, Any]:
    """The Responses' usage of a chat's (cached tokens: OpenAI's field, else the engine's statistics)."""
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens", (stats or {}).get("cached_tokens", 0))
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


class EventWriter:
    """The typed events of one streamed response, numbered from 0, and its output items."""

    def __init__(self) -> None:
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.text: dict[str, Any] | None = None  # the open message item
        self.calls: dict[int, dict[str, Any]] = {}  # the chat stream's tool-call index -> its item
        self.open_call: dict[str, Any] | None = None

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence} | fields
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    def add_text(self, delta: str) -> list[str]:
        out = self.close_call()
        if self.text is None:
            self.text = message_item("", "in_progress")
            self.text["content"] = []
            self.output.append(self.text)
            index = len(self.output) - 1
            out += [self.event("response.output_item.added", output_index=index, item=self.text),
                    self.event("response.content_part.added", item_id=self.text["id"], output_index=index,
                               content_index=0, part=text_part(""))]
            self.text["content"].append(text_part(""))
        if delta:
            self.text["content"][0]["text"] += delta
            out.append(self.event("response.output_text.delta", item_id=self.text["id"],
                                  output_index=self.output.index(self.text), content_index=0, delta=delta,
                                  logprobs=[]))
        return out

    def close_text(self, status: str = "completed") -> list[str]:
        item, self.text = self.text, None
        if item is None:
            return []
        index, part = self.output.index(item), item["content"][0]
        item["status"] = status
        return [self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                           text=part["text"], logprobs=[]),
                self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                           part=part),
                self.event("response.output_item.done", output_index=index, item=item)]

    def add_call(self, call: dict[str, Any]) -> list[str]:
        """One ``delta.tool_calls`` entry: a new index opens an item (id and name), arguments extend it."""
        out: list[str] = []
        function = call.get("function") or {}
        item = self.calls.get(call.get("index", 0))
        if item is None:
            out += self.close_text() + self.close_call()
            item = call_item(call.get("id"), function.get("name") or "", "", "in_progress")
            self.calls[call.get("index", 0)] = self.open_call = item
            self.output.append(item)
            out.append(self.event("response.output_item.added", output_index=len(self.output) - 1, item=item))
        piece = function.get("arguments") or ""
        if piece:
            item["arguments"] += piece
            out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                  output_index=self.output.index(item), delta=piece))
        return out

    def close_call(self, status: str = "completed") -> list[str]:
        item, self.open_call = self.open_call, None
        if item is None:
            return []
        index = self.output.index(item)
        item["status"] = status
        return [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                           name=item["name"], arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=index, item=item)]


async def stream_response(turn: Turn, chunks: AsyncIterator[dict[str, Any] | str], store: ResponseStore,
                          owner: str) -> AsyncIterator[str]:
    """The typed events of ``turn`` from its chat stream's ``chunks`` (closed with this stream)."""
    w = EventWriter()
    opening = turn.response("in_progress", [])
    yield w.event("response.created", response=opening)
    yield w.event("response.in_progress", response=opening)
    finish, usage, stats = None, None, None
    try:
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                if isinstance(chunk, str):  # an SSE comment (a keep-alive during a long prefill): as it is
                    yield chunk
                    continue
                if "error" in chunk:
                    error = {"code": "server_error", "message": chunk["error"]["message"]}
                    yield w.event("response.failed", response=turn.response("failed", w.output, None, error))
                    return
                if chunk.get("usage"):
                    usage, stats = chunk["usage"], chunk.get("verispec")
                for choice in chunk.get("choices") or ():
                    delta = choice.get("delta") or {}
                    for event in w.add_text(delta["content"]) if delta.get("content") else ():
                        yield event
                    for call in delta.get("tool_calls") or ():
                        for event in w.add_call(call):
                            yield event
                    finish = choice.get("finish_reason") or finish
    except Exception as e:  # noqa: BLE001 -- the stream has begun: end it with response.failed, never a cut
        error = {"code": "server_error", "message": f"internal error: {type(e).__name__}"}
        yield w.event("response.failed", response=turn.response("failed", w.output, None, error))
        return
    status = "incomplete" if finish == "length" else "completed"
    if not w.output:  # an empty answer is an empty message, as when not streamed
        for event in w.add_text(""):
            yield event
    for event in w.close_text(status) + w.close_call(status):
        yield event
    usage = usage or {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    response = turn.finish(store, owner, status, w.output, response_usage(usage, stats), stats)
    yield w.event("response.completed" if status == "completed" else "response.incomplete", response=response)
