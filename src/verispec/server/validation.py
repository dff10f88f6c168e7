"""Checks of one OpenAI request that need the server's state, before any work starts: the
model name, the drafter and speculation control, the queue and context bounds of its prompts,
and its sampling parameters (``SamplingParams`` and the logit bias against the vocabulary).

pydantic (``schemas.py``) checks types and ranges that need nothing else; what fails here is an
``ApiError`` naming the parameter (``param``) where the check is made.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any

from ..fim import fim_token_ids
from ..types import ParameterError, SamplingParams
from .schemas import ApiError, ChatCompletionRequest, CompletionRequest
from .state import ServerState

if TYPE_CHECKING:
    from ..constraints import Constraint


def sampling_params(body: CompletionRequest | ChatCompletionRequest, max_tokens: int, vocab: int,
                    logprobs: int | None = None, constraint: Constraint | None = None) -> SamplingParams:
    """The request's sampling parameters; penalties, bias, min-p and stop ids are checked
    here (HTTP 400 naming the field: ``SamplingParams`` raises a ``ParameterError`` that
    carries it) so the engine thread never sees an invalid value."""
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
            constraint=constraint,
        )
    except ParameterError as e:
        raise ApiError(400, str(e), e.param) from None


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


def context_overflow(max_len: int, prompt_len: int | None, param: str, requested: int | None = None,
                     why: str | None = None) -> ApiError:
    """A 400 ``context_length_exceeded`` in OpenAI's wording, which clients match to tell an
    overflow from other errors (litellm: "maximum context length" -> ``ContextWindowExceededError``):
    "This model's maximum context length is N tokens. However, you requested M tokens (P in the
    messages, C in the completion). Please reduce ...". ``why`` replaces the count when the prompt
    was refused before tokenizing."""
    what = "messages" if param == "messages" else "prompt"
    head = f"This model's maximum context length is {max_len} tokens. However, "
    if why is not None:
        return ApiError(400, f"{head}{why}. Please reduce the length of the {what}.", param, "context_length_exceeded")
    if requested is None:
        return ApiError(400, f"{head}your {what} resulted in {prompt_len} tokens (the context must also hold at least "
                        f"one new token). Please reduce the length of the {what}.", param, "context_length_exceeded")
    return ApiError(400, f"{head}you requested {prompt_len + requested} tokens ({prompt_len} in the {what}, "
                    f"{requested} in the completion). Please reduce the length of the {what} or completion.",
                    "max_tokens", "context_length_exceeded")


def max_new_tokens(requested: int | None, default: int, prompt_len: int, max_len: int, param: str) -> int:
    """The request's token budget, refusing prompts that do not fit the context (``context_overflow``).

    ``max_new_tokens(None, 256, 100, 2048, "max_tokens") == 256``; ``(None, 256, 2000, 2048)``
    -> 48 (the default shrinks to the room left); ``(100, 256, 2000, 2048)`` -> HTTP 400.
    """
    room = max_len - prompt_len
    if room < 1:
        raise context_overflow(max_len, prompt_len, param)
    if requested is None:
        return min(default, room)
    if requested > room:
        raise context_overflow(max_len, prompt_len, param, requested)
    return requested


def check_common(state: ServerState, body: CompletionRequest | ChatCompletionRequest) -> tuple[str, int | None]:
    """Model name, unsupported fields and speculation control; returns the drafter name
    and the request's draft cap (None = the server's; 0 = speculation off)."""
    if body.model is not None and body.model not in (state.name, state.model.name):
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
            raise context_overflow(state.max_len, len(ids), param)
    if any(len(t) > state.max_prompt_chars for t in texts):
        raise context_overflow(state.max_len, None, param, why=f"the {'messages are' if param == 'messages' else 'prompt is'} "
                               f"longer than {state.max_prompt_chars} characters, more than the context can hold")


def check_chat_size(state: ServerState, messages: list[dict[str, Any]]) -> None:
    """Refuse a chat that cannot fit before rendering it: every message has a non-empty
    content (at least one token), so more messages than context tokens never fit; nor
    do contents longer than ``max_prompt_chars`` in all."""
    if len(messages) >= state.max_len:
        raise context_overflow(state.max_len, None, "messages", why=f"{len(messages)} messages cannot fit it")
    check_prompt_sizes(state, ["".join(m["content"] for m in messages)], [], "messages")


def fim_suffix(state: ServerState, body: CompletionRequest) -> str | None:
    """The suffix of a fill-in-the-middle completion (OpenAI's ``suffix``: the prompt is the code
    before the cursor, the suffix the code after it), or None for a plain completion. It needs text
    prompts and a model with FIM tokens (``fim.py``); an empty suffix on a model without them is
    a plain completion, as before FIM existed."""
    if body.suffix is None or (not body.suffix and fim_token_ids(state.model.tokenizer) is None):
        return None
    if any(not isinstance(p, str) for p in body.prompts()):
        raise ApiError(400, "suffix needs text prompts (the code before the cursor), not token ids", "suffix")
    if fim_token_ids(state.model.tokenizer) is None:
        raise ApiError(400, f"the model {state.name} has no fill-in-the-middle tokens; send the prompt without "
                       "suffix", "suffix")
    return body.suffix
