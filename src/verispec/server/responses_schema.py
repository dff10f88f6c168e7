"""The request body of the OpenAI Responses API (POST /v1/responses) and its translation into a
chat-completions request, which the chat path then serves (``responses.py``).

The subset agent frameworks (the OpenAI Agents SDK, Codex, pydantic-ai, LangChain) send:
``input`` as a string or items (messages with text parts, ``function_call``,
``function_call_output``; ``reasoning`` items are skipped: this server makes none),
``instructions`` (a system message first; not carried over by ``previous_response_id``, as
OpenAI's), function ``tools`` in the Responses' flat shape, ``tool_choice``,
``parallel_tool_calls``, ``text.format`` (text, json_object, json_schema),
``max_output_tokens``, ``temperature``, ``top_p``, ``stream``, ``store``,
``previous_response_id``, ``metadata`` (echoed). What would change the output in a way the engine
does not implement is refused in one line naming the field (hosted tools, images and files,
``background``, ``conversation``, stored ``prompt`` templates, ``truncation: auto``, logprobs
in ``include``, ``max_tool_calls``); fields that ask for nothing this server produces
(``reasoning`` settings, other ``include`` values, ``service_tier``, ...) are ignored. verispec's chat extensions (``seed``,
``top_k``, ``drafter``, ``speculation``, ...: ``schemas.py``) pass through to the chat request.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictFloat, StrictInt, StrictStr, Tag,
                      model_validator)

from ..types import MAX_TEMPERATURE
from .schemas import FUNCTION_NAME, UnicodeBody

MAX_ITEMS = 1024  # input items of one request (a stored conversation adds its own; the chat's bounds apply after)
MAX_PARTS = 256  # content parts of one message
MAX_TOOLS = 128  # as the chat's
MAX_ID_CHARS = 128  # ids a client sends back (call ids, previous_response_id)
# verispec's chat extensions a Responses request may carry (checked by the chat request's schema)
CHAT_EXTENSIONS = ("seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                   "logit_bias", "stop", "stop_token_ids", "drafter", "num_draft_tokens", "speculation", "ignore_eos",
                   "prediction")


class _Item(BaseModel):
    model_config = ConfigDict(extra="ignore")  # ids, status, annotations of items sent back


class TextContent(_Item):
    """A text part: ``input_text`` (a client's), ``output_text`` (an answer sent back)."""

    type: Literal["input_text", "output_text", "text"]
    text: StrictStr


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Annotated[list[TextContent], Field(max_length=MAX_PARTS)] | StrictStr

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Item):
    """A call the model made (sent back so the next turn sees it)."""

    type: Literal["function_call"]
    call_id: StrictStr = Field(min_length=1, max_length=MAX_ID_CHARS)
    name: StrictStr = Field(pattern=FUNCTION_NAME)
    arguments: StrictStr


class FunctionCallOutputItem(_Item):
    """A tool's result for the call ``call_id``."""

    type: Literal["function_call_output"]
    call_id: StrictStr = Field(min_length=1, max_length=MAX_ID_CHARS)
    output: Annotated[list[TextContent], Field(max_length=MAX_PARTS)] | StrictStr

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningItem(_Item):
    """A reasoning item of another model's answer: skipped (it carries nothing this model reads)."""

    type: Literal["reasoning"]


def _item_kind(value: Any) -> str | None:
    """An input item's type; a message may omit it (the "easy" message ``{"role", "content"}``)."""
    if isinstance(value, dict):
        kind = value.get("type", "message")
        return kind if isinstance(kind, str) else None
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind, custom_error_type="invalid_item",
                  custom_error_message="an input item is a message, function_call, function_call_output or reasoning "
                                       "item (others are not supported)")]


class FunctionTool(BaseModel):
    """A function tool in the Responses' flat shape (hosted tools are refused by ``type``)."""

    type: Literal["function"]
    name: StrictStr = Field(pattern=FUNCTION_NAME)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None

    def as_chat_tool(self) -> dict[str, Any]:
        return {"type": "function", "function": self.model_dump(exclude={"type"}, exclude_none=True)}


class FunctionChoice(BaseModel):
    type: Literal["function"]
    name: StrictStr


class TextFormat(BaseModel):
    """``text.format``: ``{"type": "json_schema", "name", "schema", "strict"}`` or text / json_object."""

    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError('a json_schema format needs {"name": ..., "schema": {...}}')
        return self

    def as_response_format(self) -> dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        spec = {"name": self.name or "response", "schema": self.schema_, "strict": self.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")  # verbosity

    format: TextFormat | None = None


class ResponsesRequest(UnicodeBody):
    """POST /v1/responses. Unknown fields are kept (``model_extra``) only to pass verispec's
    chat extensions on; the rest are ignored, as OpenAI clients send extras."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr
    input: Annotated[list[InputItem], Field(max_length=MAX_ITEMS)] | StrictStr
    instructions: StrictStr | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    stream: StrictBool = False
    store: StrictBool | None = None
    previous_response_id: StrictStr | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS)
    metadata: dict[str, StrictStr] | None = Field(default=None, max_length=16)
    user: StrictStr | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[StrictStr] | None = Field(default=None, max_length=32)
    background: StrictBool | None = None
    max_tool_calls: StrictInt | None = None
    conversation: Any = None
    prompt: Any = None

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) of the first field set to something verispec cannot do."""
        checks = [
            ("background", bool(self.background), "background responses are not supported"),
            ("conversation", self.conversation is not None,
             "conversations are not supported; chain responses with previous_response_id"),
            ("prompt", self.prompt is not None, "stored prompt templates are not supported"),
            ("truncation", self.truncation == "auto", "truncation 'auto' is not supported (the input must fit)"),
            ("include", "message.output_text.logprobs" in (self.include or ()), "logprobs are not supported here"),
            ("max_tool_calls", self.max_tool_calls is not None,
             "max_tool_calls is not supported; parallel_tool_calls = false allows one call"),
            ("tool_choice", self.tool_choice not in (None, "none", "auto") and not self.tools,
             "tool_choice needs tools"),
        ]
        return next(((p, m) for p, bad, m in checks if bad), None)

    @property
    def stored(self) -> bool:
        """Whether the response is kept for ``previous_response_id`` and GET (OpenAI's default: yes)."""
        return self.store is not False

    def input_items(self) -> list[dict[str, Any]]:
        """This request's input as items (a string is one user message), as they are stored."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return [item.model_dump(by_alias=True, exclude_none=True) for item in self.input]

    def chat_body(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat-completions request serving this one, ``history`` (a stored conversation's
        items) before its input; checked by ``ChatCompletionRequest`` after this."""
        body: dict[str, Any] = {"model": self.model, "messages": chat_messages(self.instructions,
                                                                             history + self.input_items()),
                                "stream": self.stream}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.tools:
            body["tools"] = [t.as_chat_tool() for t in self.tools]
        if self.tool_choice is not None:
            choice = self.tool_choice
            body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                          "function": {"name": choice.name}}
        if self.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = self.parallel_tool_calls
        if self.text is not None and self.text.format is not None:
            body["response_format"] = self.text.format.as_response_format()
        fields = {"max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
                  "top_p": self.top_p, "user": self.user}
        body |= {k: v for k, v in fields.items() if v is not None}
        return body | {k: v for k, v in (self.model_extra or {}).items() if k in CHAT_EXTENSIONS}


def chat_messages(instructions: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages of Responses items (validated, as ``input_items`` dumps them): a message's
    text parts joined; ``function_call`` items join the assistant message just before them (one
    turn's text and calls) or start one; a ``function_call_output`` is a tool message;
    ``reasoning`` items are skipped. ``instructions`` is a system message first (empty: none)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            content = item["content"]
            text = content if isinstance(content, str) else "".join(p["text"] for p in content)
            messages.append({"role": item["role"], "content": text})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                if not last["content"]:
                    last["content"] = None
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item["output"]
            text = output if isinstance(output, str) else "".join(p["text"] for p in output)
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
    return messages
