"""POST /tokenize and POST /detokenize in vLLM's shapes (llama.cpp's field names accepted too):
clients count a prompt's tokens before sending it, or turn ids back into text.

- ``/tokenize`` ``{"model"?, "prompt": str, "add_special_tokens": true}`` (a completions prompt,
  tokenized as /v1/completions does: BOS and the like added unless false) or ``{"model"?,
  "messages": [...], "add_generation_prompt": true}`` (a chat, through the same template and
  literal-content tokenization as /v1/chat/completions) -> ``{"count", "max_model_len",
  "tokens"}``, with ``"token_strs"`` when ``return_token_strs``; llama.cpp's ``content`` (no
  special tokens unless ``add_special``) and ``with_pieces`` (then ``tokens`` are ``{"id",
  "piece"}``) also work.
- ``/detokenize`` ``{"model"?, "tokens": [ids]}`` -> ``{"prompt": text}`` (and llama.cpp's
  ``content``, the same text).

Bounded like every input: a text longer than the context can hold, or more ids than the
context, is a 400 before any tokenizing; ids must be in the vocabulary. The work runs on the
tokenizer thread (a chat's rendering on the render thread), never on the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

from .endpoints import encode_completion_prompt, off_loop, render_chat_prompt, tokenize_chat_prompt
from .openai_logprobs import token_bytes, token_text
from .schemas import ApiError, ChatMessage, UnicodeBody
from .state import ServerState
from .validation import check_chat_size, check_prompt_sizes


class TokenizeRequest(UnicodeBody):
    """A text (``prompt``, llama.cpp: ``content``) or a chat (``messages``), exactly one."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    content: StrictStr | None = None  # llama.cpp's name of the prompt
    add_special_tokens: StrictBool | None = None
    add_special: StrictBool | None = None  # llama.cpp's name
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False
    with_pieces: StrictBool = False  # llama.cpp: tokens as {"id", "piece"}

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        given = [k for k in ("prompt", "content", "messages") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("send exactly one of prompt (a text) or messages (a chat)")
        return self

    def text(self) -> str | None:
        return self.prompt if self.prompt is not None else self.content

    def special(self, default: bool) -> bool:
        flag = self.add_special_tokens if self.add_special_tokens is not None else self.add_special
        return default if flag is None else flag


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    tokens: list[StrictInt]


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model not in (state.name, state.model.name):
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {state.name!r}", "model",
                       "model_not_found")


def encode_text(state: ServerState, text: str, special: bool) -> list[int]:
    """A completions prompt's ids (``special``: as /v1/completions encodes it, BOS included)."""
    if special:
        return encode_completion_prompt(state, text)
    return list(state.model.tokenizer(text, add_special_tokens=False)["input_ids"])


async def tokenize(state: ServerState, body: TokenizeRequest) -> dict[str, Any]:
    check_model(state, body.model)
    text = body.text()
    if text is not None:
        check_prompt_sizes(state, [text], [], "prompt")
        # vLLM's prompt adds BOS and the like unless told not to; llama.cpp's content only when told (add_special)
        ids = await off_loop(state, encode_text, state, text, body.special(body.prompt is not None))
    else:
        messages = [m.as_template_message() for m in body.messages or ()]
        check_chat_size(state, messages)
        loop = asyncio.get_running_loop()
        rendered = await loop.run_in_executor(state.render_pool, render_chat_prompt, state, messages, None,
                                              body.add_generation_prompt)
        ids = await off_loop(state, tokenize_chat_prompt, state, messages, rendered)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": state.max_len, "tokens": ids}
    if body.with_pieces or body.return_token_strs:
        table = token_bytes(state.model.tokenizer)
        pieces = [token_text(table(i)) for i in ids]
        if body.with_pieces:
            out["tokens"] = [{"id": i, "piece": p} for i, p in zip(ids, pieces)]
        if body.return_token_strs:
            out["token_strs"] = pieces
    return out


async def detokenize(state: ServerState, body: DetokenizeRequest) -> dict[str, Any]:
    check_model(state, body.model)
    vocab = state.model.backend.info.vocab_size
    if len(body.tokens) > state.max_len:
        raise ApiError(400, f"{len(body.tokens)} tokens; at most the context ({state.max_len}) per request", "tokens")
    if body.tokens and not 0 <= min(body.tokens) <= max(body.tokens) < vocab:
        raise ApiError(400, f"token ids must be in [0, {vocab})", "tokens")
    text = await off_loop(state, state.model.tokenizer.decode, body.tokens)
    return {"prompt": text, "content": text}


def add_token_routes(app: FastAPI, state: ServerState) -> None:
    """POST /tokenize and /detokenize (where vLLM and llama.cpp serve them)."""

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest) -> dict[str, Any]:
        return await tokenize(state, body)

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest) -> dict[str, Any]:
        return await detokenize(state, body)
