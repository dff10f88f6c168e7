"""OpenAI-compatible request bodies (pydantic) and errors (``ApiError``, ``error_body``).

Only what verispec can honour is accepted: fields of the OpenAI API that would change the
output in ways the engine does not implement (streaming ``best_of``, ...) are declared so that a non-default value is refused with HTTP 400
naming the field, instead of being silently ignored. Unknown fields are ignored (as OpenAI
clients send extras). Extensions (the openai client sends them through ``extra_body``):
``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``,
``return_token_ids`` (vLLM's names), and per-request speculation control: ``drafter`` (one
the server loaded), ``num_draft_tokens`` (cap on this request's draft budget; 0 = off) and
``speculation`` (false = plain decoding). ``response_format`` (structured outputs; regex, grammar
and choice as extensions) and ``tools`` are ``structured.py``'s.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr,
                      field_validator, model_validator)

from ..paths import lone_surrogate
from ..types import MAX_SEED, MAX_TEMPERATURE  # one range for the server, the CLI and bench


from ..types import MAX_LOGPROBS

MAX_N = 16  # samples per request (each takes a batch slot)
MAX_DRAFT_TOKENS = 64  # per-request draft budget cap a client may ask for


def _as_float(value: float | int) -> float:
    """A JSON number as a finite float: an integer too large for a float (10^400) is a 400
    naming the field, not an OverflowError later."""
    try:
        out = float(value)
    except OverflowError:
        raise ValueError("the number is too large") from None
    if not math.isfinite(out):
        raise ValueError("the number must be finite")
    return out


Number = Annotated[StrictFloat | StrictInt, AfterValidator(_as_float)]  # int or float JSON number -> float


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class PredictionPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: text the answer is expected to repeat (it only drafts)."""

    type: Literal["content"]
    content: StrictStr | list[PredictionPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FieldError(ValueError):
    """A field's error found by a model validator (which pydantic locates at the model): its
    ``param``, the dotted path of the field, is named in the 400 (``app.py``)."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


class UnicodeBody(BaseModel):
    """A request body whose strings must be valid Unicode: a lone UTF-16 surrogate anywhere is a
    400 naming the field (``FieldError``)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = lone_surrogate(data)
        if where is not None:
            raise FieldError(where or None,
                             f"{where or 'the body'} is not valid Unicode (a lone UTF-16 surrogate such as \\ud800)")
        return data


class _Sampling(UnicodeBody):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None  # None: the served model (as vLLM and llama.cpp allow)
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(default=None, ge=0)  # extension (vLLM); 0 or -1 = off
    seed: StrictInt | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    logit_bias: dict[str, Number] | None = None
    user: StrictStr | None = None
    # extensions
    min_p: Number = 0.0
    repetition_penalty: Number = 1.0
    stop_token_ids: list[StrictInt] | None = None
    drafter: StrictStr | None = None
    num_draft_tokens: StrictInt | None = Field(default=None, ge=0, le=MAX_DRAFT_TOKENS)
    speculation: StrictBool = True
    ignore_eos: StrictBool = False
    return_token_ids: StrictBool = False
    prediction: Prediction | None = None  # OpenAI's Predicted Outputs (chat; completions: an extension)
    response_format: dict[str, Any] | None = None  # structured outputs (structured.py; completions: an extension)
    # other servers' constraint fields (llama.cpp, vLLM, TGI, SGLang): mapped or refused by compat_fields.py
    grammar: Any = None
    json_schema: Any = None
    guided_json: Any = None
    guided_choice: Any = None
    guided_regex: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    regex: Any = None
    ebnf: Any = None
    guided_whitespace_pattern: Any = None
    structural_tag: Any = None


    @field_validator("top_k", mode="before")
    @classmethod
    def _top_k_off(cls, v: Any) -> Any:
        return 0 if v == -1 else v  # vLLM spells "disabled" -1

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) of the first field set to something verispec cannot do."""
        checks = [
            ("stop", any(not s for s in self.stop_strings()), "stop strings must be non-empty"),
            ("stop", len(self.stop_strings()) > 4, "at most 4 stop strings"),
            ("stream_options", self.stream_options is not None and not self.stream,
             "stream_options is only allowed when stream is true"),
        ]
        return next(((p, m) for p, bad, m in checks if bad), None)


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(default=None, ge=0)  # 0 with echo: the prompt alone (its logprobs)
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: StrictInt | None = Field(default=None, ge=1, le=MAX_N)
    suffix: StrictStr | None = None

    def unsupported(self) -> tuple[str, str] | None:
        base = super().unsupported()
        if base:
            return base
        checks = [
            ("max_tokens", self.max_tokens == 0 and not self.echo, "max_tokens = 0 needs echo (it returns the prompt)"),
            ("suffix", self.echo and self.logprobs is not None and self.suffix is not None,
             "echo with logprobs scores a plain prompt, not a fill-in-the-middle one (drop suffix)"),
            ("best_of", self.best_of is not None and self.best_of < self.n, "best_of must be >= n"),
            ("best_of", self.stream and self.best_of not in (None, self.n), "best_of > n cannot stream"),
            ("prompt", isinstance(self.prompt, list) and not self.prompt, "the prompt list is empty"),
        ]
        return next(((p, m) for p, bad, m in checks if bad), None)

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names


class FunctionCall(BaseModel):
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class Function(BaseModel):
    name: StrictStr = Field(pattern=FUNCTION_NAME)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of an object (OpenAI's rule: arguments are an object)
    strict: StrictBool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type", "object") != "object":
            raise ValueError("a function's parameters must be a JSON schema of an object: {\"type\": \"object\", ...}")
        return v


class Tool(BaseModel):
    type: Literal["function"]
    function: Function


class NamedFunction(BaseModel):
    name: StrictStr


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: StrictStr | None = None  # a tool result: the call it answers

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("a message needs content (only an assistant message with tool_calls may omit it)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def as_template_message(self) -> dict[str, Any]:
        """The message as chat templates read it (transformers' convention): "developer" is
        "system"; a call's arguments are an object when they parse as one."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True

    def unsupported(self) -> tuple[str, str] | None:
        base = super().unsupported()
        if base:
            return base
        checks = [
            ("top_logprobs", self.top_logprobs is not None and not self.logprobs,
             "top_logprobs needs logprobs = true"),
            ("tool_choice", self.tool_choice not in (None, "none", "auto") and not self.tools,
             "tool_choice needs tools"),
            ("tools", len({t.function.name for t in self.tools or ()}) != len(self.tools or ()),
             "two tools have the same name"),
            ("max_tokens", self.max_tokens is not None and self.max_completion_tokens is not None
             and self.max_tokens != self.max_completion_tokens, "max_tokens and max_completion_tokens disagree"),
        ]
        return next(((p, m) for p, bad, m in checks if bad), None)

    def chat_messages(self) -> list[dict[str, Any]]:
        return [m.as_template_message() for m in self.messages]

    @property
    def uses_tools(self) -> bool:
        """Tools are rendered and calls parsed (any tool_choice but "none")."""
        return bool(self.tools) and self.tool_choice != "none"


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class ApiError(Exception):
    """A request's failure as an OpenAI-shaped error: HTTP ``status`` and the body's ``message``,
    ``type``, ``param`` (the request field at fault, named where the check is made) and ``code``;
    ``headers`` such as ``Retry-After``. The app's exception handler answers it."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.headers = headers
