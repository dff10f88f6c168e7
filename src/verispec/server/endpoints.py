"""The two OpenAI endpoints as the request handler (``handler.py``) sees them: how a request's
prompts are built and how its choices are shaped. The rest (checks, sampling parameters, jobs,
streaming, usage) is the handler's, the same for both.

- ``Completions`` (POST /v1/completions): one or more prompts, each text or token ids, encoded
  on the tokenizer thread one prompt per slice; ``best_of`` samples per prompt, of which the
  ``n`` most likely are returned; a choice has ``text`` (the prompt first with ``echo``) and
  OpenAI's completion logprobs (tokens with text offsets).
- ``Chat`` (POST /v1/chat/completions): messages rendered through the model's chat template
  on the render thread, then tokenized on the tokenizer thread; a choice has a ``message`` (a
  ``delta`` when streamed, the first naming the role) and OpenAI's chat logprobs.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

from ..api import encode_prediction, encode_prompt
from ..chat import ChatTooLong, RenderedChat, render_chat, tokenize_chat
from ..chat_template import TemplateError
from ..constraints import Constraint
from ..fim import fim_prompt
from . import compat_fields
from .generation import FINISH
from .openai_logprobs import TextOffsets, chat_logprobs, completion_logprobs, join_logprobs, prompt_logprobs
from .schemas import ApiError, ChatCompletionRequest, CompletionRequest
from .state import ServerState
from .structured import ConstraintRequest, compile_request, response_format_request
from .tool_calls import ArgumentsDelta, CallStart, TextEvent, ToolCallStream, ToolFormat, detect_format, parse_tool_calls
from .tool_grammar import forced_tools, tool_grammar
from .validation import check_chat_size, check_prompt_sizes, context_overflow, fim_suffix, max_new_tokens
from .worker import Event

COMPLETION_MAX_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions (chat: --default-max-tokens)


class Endpoint(ABC):
    """One request to one endpoint: its prompts, and its choices' shape. A choice is
    ``{"index", <text | message | delta>, "logprobs", "finish_reason"}``; the handler adds the
    token ids a request asks for (``return_token_ids``)."""

    prompt_logprobs: int | None = None  # score the prompts, with this many alternatives per token (echo + logprobs)
    score_only = False  # generate nothing, only the prompts' scores (max_tokens 0)
    object: ClassVar[str]  # the response's "object"
    chunk_object: ClassVar[str]  # a streamed chunk's
    id_prefix: ClassVar[str]  # of the response's "id"

    def __init__(self, state: ServerState, body: CompletionRequest | ChatCompletionRequest):
        self.state, self.body, self.tokenizer = state, body, state.model.tokenizer

    @property
    @abstractmethod
    def samples(self) -> int:
        """Samples generated per prompt; ``body.n`` of them are returned (the most likely)."""

    @property
    @abstractmethod
    def logprobs(self) -> int | None:
        """Alternatives per token the engine reports (None: no logprobs)."""

    @property
    @abstractmethod
    def shows_logprobs(self) -> bool:
        """Whether the choices carry logprobs."""

    @abstractmethod
    def check_size(self) -> None:
        """Refuse, before any tokenization, what the queue or the context cannot hold."""

    @abstractmethod
    async def prompts(self) -> list[list[int]]:
        """The prompts' token ids (built off the event loop)."""

    async def prediction(self) -> tuple[int, ...] | None:
        """The request's prediction (Predicted Outputs) as token ids, None without one (on the tokenizer thread)."""
        if self.body.prediction is None:
            return None
        return await off_loop(self.state, encode_prediction_text, self.state, self.body.prediction.text())

    def constraint_request(self) -> ConstraintRequest | None:
        """What the output must follow (``response_format``, or another server's field:
        ``compat_fields``), None for free text."""
        return compat_fields.constraint_request(self.body, response_format_request)

    async def constraint(self) -> Constraint | None:
        """The request's constraint compiled for the model (on the tokenizer thread)."""
        req = self.constraint_request()
        return None if req is None else await off_loop(self.state, compile_request, self.state, req)

    @abstractmethod
    def max_tokens(self, prompts: list[list[int]]) -> int:
        """The request's token budget; refuses prompts that leave no room in the context."""

    @abstractmethod
    def opening_choices(self, total: int) -> list[dict[str, Any]]:
        """Streamed before any token, one chunk each (``total``: the request's choices)."""

    @abstractmethod
    def stream_choice(self, index: int, ev: Event) -> dict[str, Any] | None:
        """The streamed choice ``index`` carrying one event (None: nothing to send yet)."""

    @abstractmethod
    def choice(self, index: int, prompt: int, out: dict[str, Any]) -> dict[str, Any]:
        """Choice ``index`` of a whole answer: ``out`` (``generation.collect``'s) for prompt ``prompt``."""


def render_chat_prompt(state: ServerState, messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True) -> RenderedChat:
    """A chat through the model's template (``api.encode_prompt``'s checks), on the render
    thread: refuses a rendering longer than ``max_prompt_chars`` (the template's own text
    counts), or past the template's time or memory bound, in one line. ``tools``: rendered
    by the template for a tool-calling request."""
    if any(not m["content"].strip() and not m.get("tool_calls") for m in messages):
        raise ApiError(400, "chat messages must be non-empty", "messages")
    if state.chat_error is not None:
        raise ApiError(400, state.chat_error, "messages", "chat_template_error")
    if state.chat_template is None:
        raise ApiError(400, f"model {state.model.name} has no chat template; use /v1/completions", "messages")
    try:
        return render_chat(state.model.tokenizer, messages, state.max_prompt_chars, state.chat_template, tools,
                           add_generation_prompt)
    except ChatTooLong as e:
        raise context_overflow(state.max_len, None, "messages", why=str(e).rstrip(".")) from None
    except TemplateError as e:
        raise ApiError(400, str(e), "messages", "chat_template_error") from None


def tokenize_chat_prompt(state: ServerState, messages: list[dict[str, Any]], rendered: RenderedChat) -> list[int]:
    """Token ids of a rendered chat, its message contents literal (on the tokenizer thread)."""
    try:
        return tokenize_chat(state.model.tokenizer, messages, rendered)
    except ValueError as e:
        raise ApiError(400, str(e), "messages") from None


def encode_completion_prompt(state: ServerState, prompt: str | list[int], suffix: str | None = None) -> list[int]:
    """Token ids of one completion prompt: text encoded as it is (no chat template), or token
    ids checked against the vocabulary, or with a ``suffix`` (``validation.fim_suffix``) the
    model's fill-in-the-middle prompt (on the tokenizer thread)."""
    vocab = state.model.backend.info.vocab_size
    if isinstance(prompt, list):
        if not prompt or min(prompt) < 0 or max(prompt) >= vocab:
            raise ApiError(400, f"prompt token ids must be a non-empty list in [0, {vocab})", "prompt")
        return prompt
    try:
        if suffix is not None:
            return fim_prompt(state.model.tokenizer, prompt, suffix)
        return encode_prompt(state.model, prompt, chat=False)
    except ValueError as e:
        raise ApiError(400, str(e), "prompt") from None


def encode_prediction_text(state: ServerState, text: str) -> tuple[int, ...]:
    """Token ids of a prediction, bounded like a prompt: characters before tokenizing, then tokens."""
    if len(text) > state.max_prompt_chars:
        raise ApiError(400, f"the prediction has {len(text)} characters, more than this server's context can hold",
                       "prediction")
    try:
        ids = encode_prediction(state.model, text)
    except ValueError as e:
        raise ApiError(400, str(e), "prediction") from None
    if len(ids) > state.max_len:
        raise ApiError(400, f"the prediction has {len(ids)} tokens, more than this server's context of "
                       f"{state.max_len}", "prediction")
    return tuple(ids)


async def off_loop(state: ServerState, fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` on the tokenizer thread (the event loop keeps serving others)."""
    return await asyncio.get_running_loop().run_in_executor(state.tokenizer_pool, fn, *args)

class Completions(Endpoint):
    object = chunk_object = "text_completion"
    id_prefix = "cmpl"
    body: CompletionRequest

    def __init__(self, state: ServerState, body: CompletionRequest):
        super().__init__(state, body)
        self.raw = body.prompts()
        self.echoes: list[str] = []  # per prompt: the text echoed before its choices' ("" without echo)
        self.offsets: list[TextOffsets] = []  # per streamed choice: its logprobs' text_offset
        self.suffix: str | None = None  # fill-in-the-middle: the code after the cursor (set by check_size)
        self.ids: list[list[int]] = []  # the prompts' token ids
        self.prompt_logprobs = body.logprobs if body.echo else None  # echo + logprobs: the prompt's too
        self.score_only = body.max_tokens == 0  # with echo (schemas): the prompt alone

    @property
    def samples(self) -> int:
        return self.body.best_of or self.body.n  # > n: generate best_of, return the n most likely

    @property
    def logprobs(self) -> int | None:
        return self.body.logprobs if self.samples == self.body.n or self.body.logprobs is not None else 0

    @property
    def shows_logprobs(self) -> bool:
        return self.body.logprobs is not None

    def check_size(self) -> None:
        queue = self.state.worker.max_queue
        if len(self.raw) * self.samples > queue:
            raise ApiError(400, f"{len(self.raw)} prompts x {self.samples} samples in one request; this server "
                           f"queues at most {queue}", "prompt", "too_many_prompts")
        self.suffix = fim_suffix(self.state, self.body)
        check_prompt_sizes(self.state, [p + (self.suffix or "") for p in self.raw if isinstance(p, str)],
                           [p for p in self.raw if isinstance(p, list)], "prompt")

    async def prompts(self) -> list[list[int]]:
        prompts = [await off_loop(self.state, encode_completion_prompt, self.state, p, self.suffix)  # one slice each
                   for p in self.raw]
        self.echoes = [(p if isinstance(p, str) else self.tokenizer.decode(p)) if self.body.echo else ""
                       for p in self.raw]
        self.offsets = [TextOffsets(len(echo)) for echo in self.echoes for _ in range(self.samples)]
        self.ids = prompts
        return prompts

    def max_tokens(self, prompts: list[list[int]]) -> int:
        requested = 1 if self.score_only else self.body.max_tokens  # 0: the job generates nothing (score_only)
        return min(max_new_tokens(requested, COMPLETION_MAX_TOKENS, len(p), self.state.max_len, "prompt")
                   for p in prompts)

    def opening_choices(self, total: int) -> list[dict[str, Any]]:
        return [{"index": k, "text": self.echoes[k // self.samples], "logprobs": None, "finish_reason": None}
                for k in range(total) if self.body.echo and self.prompt_logprobs is None]  # else: with the scores

    def stream_choice(self, index: int, ev: Event) -> dict[str, Any]:
        choice = {"index": index, "text": ev.text, "logprobs": None, "finish_reason": FINISH.get(ev.finished or "")}
        if self.shows_logprobs:
            offsets = self.offsets[index]  # completion_logprobs advances it
            choice["logprobs"] = completion_logprobs(self.tokenizer, ev.logprobs or [], offsets)
        if ev.prompt_logprobs is not None and self.prompt_logprobs is not None:  # the first event: the echo with its scores
            prompt = index // self.samples
            choice["text"] = self.echoes[prompt] + ev.text
            choice["logprobs"] = join_logprobs(prompt_logprobs(self.tokenizer, self.ids[prompt], ev.prompt_logprobs),
                                               choice["logprobs"])
        return choice

    def choice(self, index: int, prompt: int, out: dict[str, Any]) -> dict[str, Any]:
        echo = self.echoes[prompt]
        choice = {"index": index, "text": echo + out["text"], "logprobs": None, "finish_reason": out["finish_reason"]}
        if self.shows_logprobs:
            choice["logprobs"] = completion_logprobs(self.tokenizer, out["logprobs"], len(echo))
            if self.prompt_logprobs is not None:
                choice["logprobs"] = join_logprobs(
                    prompt_logprobs(self.tokenizer, self.ids[prompt], out["prompt_logprobs"] or []), choice["logprobs"])
        return choice


class Chat(Endpoint):
    object, chunk_object = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl"
    body: ChatCompletionRequest

    def __init__(self, state: ServerState, body: ChatCompletionRequest):
        super().__init__(state, body)
        self.messages = body.chat_messages()
        self.tool_format: ToolFormat | None = None  # the template's tool-call family (set by check_size)
        self.parsers: dict[int, ToolCallStream] = {}  # per streamed choice: its text parsed into tool calls

    @property
    def samples(self) -> int:
        return self.body.n

    @property
    def logprobs(self) -> int | None:
        return (self.body.top_logprobs or 0) if self.body.logprobs else None

    @property
    def shows_logprobs(self) -> bool:
        return self.logprobs is not None

    def check_size(self) -> None:
        if self.body.n > self.state.worker.max_queue:
            raise ApiError(400, f"n = {self.body.n} samples in one request; this server queues at most "
                           f"{self.state.worker.max_queue}", "n", "too_many_prompts")
        check_chat_size(self.state, self.messages)
        if self.body.uses_tools and self.state.chat_template is not None:
            self.tool_format = detect_format(self.state.chat_template.source)
            if self.tool_format is None:
                raise ApiError(400, f"model {self.state.model.name}'s chat template defines no tool-call format; "
                               'send tools with tool_choice "none" or none at all', "tools")

    async def prompts(self) -> list[list[int]]:
        loop = asyncio.get_running_loop()
        tools = [t.model_dump(exclude_none=True) for t in self.body.tools or ()] if self.body.uses_tools else None
        rendered = await loop.run_in_executor(self.state.render_pool, render_chat_prompt, self.state, self.messages,
                                              tools)
        return [await off_loop(self.state, tokenize_chat_prompt, self.state, self.messages, rendered)]

    def max_tokens(self, prompts: list[list[int]]) -> int:
        return max_new_tokens(self.body.max_completion_tokens or self.body.max_tokens,
                              self.state.config.default_max_tokens, len(prompts[0]), self.state.max_len, "messages")

    def opening_choices(self, total: int) -> list[dict[str, Any]]:
        return [{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for k in range(total)]

    def constraint_request(self) -> ConstraintRequest | None:
        """With tools, the tool grammar (``tool_grammar``): a required or named call, or (auto) text
        or calls, an answer without calls following ``response_format``; else ``response_format``."""
        fmt = self.tool_format
        if not self.body.uses_tools or fmt is None:
            return super().constraint_request()
        forced = forced_tools(self.body)
        if forced is not None:
            compat_fields.refuse_beside(self.body, "tool_choice")
        answer = compat_fields.constraint_request(self.body, response_format_request)  # llama.cpp's, vLLM's too
        schema = None if answer is None else True if answer.kind == "json_object" else answer.spec
        if answer is not None and answer.kind not in ("json_object", "json_schema"):
            raise ApiError(400, f"a constraint of type {answer.kind} ({answer.param}) cannot be combined with tools; "
                           "use a JSON schema or json_object", answer.param)
        grammar = tool_grammar(fmt, forced or self.body.tools or [], forced is not None,
                               self.body.parallel_tool_calls, self.tokenizer, schema)
        return ConstraintRequest("grammar", grammar, True, "tools")

    def _names(self) -> set[str]:
        return {t.function.name for t in self.body.tools or ()}

    def stream_choice(self, index: int, ev: Event) -> dict[str, Any] | None:
        finish = FINISH.get(ev.finished or "")
        logprobs = chat_logprobs(self.tokenizer, ev.logprobs or []) if self.shows_logprobs else None
        if self.tool_format is None:
            return {"index": index, "delta": {"content": ev.text} if ev.text else {}, "logprobs": logprobs,
                    "finish_reason": finish}
        parser = self.parsers.setdefault(index, ToolCallStream(self.tool_format, self._names()))
        events = parser.feed(ev.text)
        if ev.finished:
            events += parser.finish(cut=finish == "length")
        delta: dict[str, Any] = {}
        text = "".join(e.text for e in events if isinstance(e, TextEvent))
        if text:
            delta["content"] = text
        calls: dict[int, dict[str, Any]] = {}  # one entry per call in this delta (OpenAI's shape)
        for e in events:
            if isinstance(e, CallStart):
                calls[e.index] = {"index": e.index, "id": e.id, "type": "function",
                                  "function": {"name": e.name, "arguments": ""}}
            elif isinstance(e, ArgumentsDelta):
                entry = calls.setdefault(e.index, {"index": e.index, "function": {"arguments": ""}})
                entry["function"]["arguments"] += e.text
        if calls:
            delta["tool_calls"] = list(calls.values())
        if not delta and not ev.finished and logprobs is None:
            return None
        if ev.finished:
            finish = _tool_finish(finish, parser.calls())
            self.parsers.pop(index, None)
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def choice(self, index: int, prompt: int, out: dict[str, Any]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": out["text"]}
        finish = out["finish_reason"]
        if self.tool_format is not None:
            message["content"], calls = parse_tool_calls(out["text"], self.tool_format, self._names(),
                                                         cut=finish == "length")
            if calls:
                message["tool_calls"] = calls
            finish = _tool_finish(finish, calls)
        return {"index": index, "message": message,
                "logprobs": chat_logprobs(self.tokenizer, out["logprobs"]) if self.shows_logprobs else None,
                "finish_reason": finish}


def _tool_finish(finish: str | None, calls: list[dict[str, Any]]) -> str | None:
    """OpenAI's finish_reason of an answer that made calls: "tool_calls" (unless cut by length)."""
    return "tool_calls" if calls and finish == "stop" else finish
