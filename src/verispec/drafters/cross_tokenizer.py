"""Drafting with a model whose tokenizer is not the target's, through text: the method of
transformers' Universal Assisted Generation (Timor et al. 2025, "Accelerating LLM Inference with
Lossless Speculative Decoding Algorithms for Heterogeneous Vocabularies", arXiv 2502.05202, its
string-level algorithm) and of llama.cpp's speculative decoding with ``--spec-replace``.

The draft keeps its own token stream and K/V cache (a ``DraftModelDrafter`` over the draft's
tokens). Before each proposal the target's newly committed tokens are detokenized (incrementally,
from a few tokens back, holding back an incomplete UTF-8 character) and the new text is appended
to the draft's stream by re-tokenizing only the last few draft tokens with it (the re-sync window:
a token boundary may move when text is appended, e.g. "hel" + "lo"); a re-tokenization that does
not keep its first token falls back to re-tokenizing the whole text. The draft then drafts a
greedy chain in its own tokens, the chain's text is appended to the last committed target tokens'
text and re-tokenized with the target's tokenizer, and the target tokens after the committed ones
are proposed, less the last (the draft's text may end inside a target token).

Exactness. The proposal is a chain with no draft probabilities: for a greedy request the target
verifies every token (a token is accepted only if it is the target's argmax), so the output is
token-identical to plain decoding. For a sampled request the engine verifies a chain without
probabilities as a point-mass draft (``verify.rejection``): x is accepted with probability p(x),
otherwise the next token is drawn from p with x removed and renormalised, so the committed token
has law p(y) = [y = x] p(x) + (1 - p(x)) p(y) / (1 - p(x)) for any x chosen from the context
alone; the draft is a deterministic function of the committed tokens (greedy drafting), so the
output law is exactly the target's, the argument that makes prompt lookup exact. Token-level
intersection (the paper's other algorithms, which carry q over the shared vocabulary) would accept
more often at T > 0 but needs the draft's distribution mapped to target tokens; it is not built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..models.base import CausalLM
from ..tree import DraftTree
from ..types import SamplingParams
from .base import DraftContext, Observation, RequestTable, WrappingDrafter
from .draft_model import DraftModelDrafter, DraftModelOptions

DETOKENIZE_WINDOW = 4  # tokens decoded before the new ones, so a token's text is read in context (vLLM's prefix offset)
RESYNC_WINDOW = 3  # the draft's last tokens re-tokenized with appended text (a boundary may move)
RESYNC_TRIES = 8  # further start points tried before re-tokenizing the whole text
UTF8_HOLD = 4  # at most this many trailing tokens held back for an incomplete UTF-8 character
GREEDY = SamplingParams(temperature=0.0)
DEFAULT_MAX_DRAFT = DraftModelOptions.max_draft  # target tokens proposed per step at most (draft_model.py)


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def text_after(tokenizer: Any, context: list[int], new: list[int]) -> str | None:
    """The text ``new`` adds after ``context`` (a few tokens suffice: their text is read in
    context, e.g. a leading space a decoder strips from the first token); None when the
    decoded text is not an extension (a byte sequence completed across the boundary)."""
    before = _decode(tokenizer, context)
    after = _decode(tokenizer, context + new)
    return after[len(before):] if after.startswith(before) else None


def continuation_tokens(tokenizer: Any, committed: list[int], drafted: str, fresh: bool = False) -> list[int]:
    """The tokens that follow ``committed`` when its text is followed by ``drafted``, the last
    dropped (the text may end inside a token): the longest window of committed tokens whose text
    re-tokenizes, with the drafted text, to those same tokens first; else (the last committed token
    would merge with the draft's first, e.g. "\n" with an indentation) nothing, or with ``fresh``
    the drafted text tokenized alone (the boundary where the committed tokens put it).

    Example: committed "...re" "turn", drafted " x" -> the tokens of " x" less the last: []."""
    for w in range(min(DETOKENIZE_WINDOW, len(committed)), 0, -1):
        tail = committed[-w:]
        ids = _encode(tokenizer, _decode(tokenizer, tail) + drafted)
        if ids[:w] == tail:
            return ids[w:-1]
    return _encode(tokenizer, drafted)[:-1] if fresh else []


@dataclass
class _Stream:
    """One request's draft-side view of the committed text."""

    first: int  # the first target token with text (1 past a leading BOS)
    prefix: list[int]  # the draft's own leading special tokens (its BOS)
    synced: int  # committed target tokens whose text the draft's tokens hold
    text: str  # that text
    ids: list[int] = field(default_factory=list)  # the draft's tokens: prefix + a tokenization of text


class CrossTokenizerDrafter(WrappingDrafter):
    """Chain drafts for a target from ``draft``, a causal LM with its own ``draft_tokenizer``,
    through text (module docstring); ``target_tokenizer`` is the target's. ``max_draft``: target
    tokens proposed at most (the engine's budget may be larger); ``min_confidence``: as
    ``DraftModelDrafter``'s, on the draft's own tokens."""

    name: ClassVar[str] = "draft"

    def __init__(self, draft: CausalLM, draft_tokenizer: Any, target_tokenizer: Any, target_bos: int | None = None,
                 max_draft: int = DEFAULT_MAX_DRAFT, min_confidence: float = DraftModelOptions.min_confidence):
        if max_draft < 1:
            raise ValueError("max_draft must be >= 1")
        self.model, self.max_draft = draft, max_draft
        self.inner = DraftModelDrafter(draft, min_confidence=min_confidence)
        self.draft_tok, self.target_tok, self.target_bos = draft_tokenizer, target_tokenizer, target_bos
        self._prefix = draft_tokenizer.encode("", add_special_tokens=True)
        self._streams: RequestTable[_Stream] = RequestTable()

    def cost_signature(self) -> str:
        return f"{type(self).__name__}:{self.inner.cost_signature()}"

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self, request_id: str, prompt_ids: list[int]) -> None:
        first = 1 if prompt_ids and prompt_ids[0] == self.target_bos else 0
        stream = _Stream(first, list(self._prefix), synced=first, text="", ids=list(self._prefix))
        self._sync(stream, prompt_ids)
        self._streams.add(request_id, stream)
        self.inner.start(request_id, stream.ids[:self.inner.max_length])  # a longer prompt: no drafts (propose)

    def finish(self, request_id: str) -> None:
        if self._streams.pop(request_id) is not None:
            self.inner.finish(request_id)

    def observe(self, obs: Observation) -> None:
        pass  # the stream is brought up to date in propose

    # ---- one proposal ----------------------------------------------------------------------
    def propose(self, ctx: DraftContext) -> DraftTree:
        stream = self._streams.get(ctx.request_id)
        self._sync(stream, ctx.tokens)
        root = ctx.tokens[-1]
        # one draft token more than the budget: the last target token is dropped as possibly partial
        want = min(ctx.budget, self.max_draft)
        budget = min(want + 1, self.inner.max_length - len(stream.ids))
        if budget < 2 or not stream.ids or stream.synced < len(ctx.tokens):
            return DraftTree.chain(root, [])  # nothing to draft from, a character incomplete, or the draft's context full
        chain = self.inner.propose(DraftContext(ctx.request_id, list(stream.ids), budget, GREEDY, ctx.generator))
        drafted = text_after(self.draft_tok, stream.ids[-DETOKENIZE_WINDOW:], list(chain.tokens[1:]))
        if not drafted:
            return DraftTree.chain(root, [])
        return DraftTree.chain(root, continuation_tokens(self.target_tok, ctx.tokens[stream.first:], drafted)[:want])

    # ---- the draft's stream ----------------------------------------------------------------
    def _sync(self, stream: _Stream, tokens: list[int]) -> None:
        """Append the text of the committed target tokens not yet synced to the draft's tokens."""
        end = len(tokens)
        if end <= stream.synced:
            return
        context = tokens[max(stream.first, stream.synced - DETOKENIZE_WINDOW):stream.synced]
        new = text_after(self.target_tok, context, tokens[stream.synced:end])
        held = 0  # hold back tokens ending inside a UTF-8 character: their text is not known yet
        while new is not None and new.endswith("\ufffd") and held < UTF8_HOLD:
            end, held = end - 1, held + 1
            if end == stream.synced:
                return
            new = text_after(self.target_tok, context, tokens[stream.synced:end])
        if new is None:  # not an extension of the text so far: decode it whole
            stream.text, stream.synced = _decode(self.target_tok, tokens[stream.first:end]), end
            stream.ids = stream.prefix + _encode(self.draft_tok, stream.text)
            return
        stream.text, stream.synced = stream.text + new, end
        stream.ids = self._extend(stream, new)

    def _extend(self, stream: _Stream, new: str) -> list[int]:
        """The draft's tokens with ``new`` appended: the last tokens (``RESYNC_WINDOW``, or a few
        further back) re-tokenized with it, where that keeps the first of them (a boundary both
        tokenizations share), else the whole text re-tokenized."""
        ids, floor = stream.ids, len(stream.prefix)
        if len(ids) == floor:
            return ids + _encode(self.draft_tok, new)
        start = max(floor, len(ids) - RESYNC_WINDOW)
        for a in range(start, max(floor, start - RESYNC_TRIES) - 1, -1):
            again = _encode(self.draft_tok, _decode(self.draft_tok, ids[a:]) + new)
            if again[:1] == ids[a:a + 1]:
                return ids[:a] + again
        return stream.prefix + _encode(self.draft_tok, stream.text)
