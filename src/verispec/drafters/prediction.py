"""Predicted Outputs (OpenAI's ``prediction``): a request may carry the text it expects most
of the answer to repeat (the file being edited), and drafts come from it for free.

``PredictionDrafter`` wraps the engine's drafter. For a request with a prediction it drafts
the prediction's continuation after the place where the recent output matches it; for a
request without one, or where the output has left the prediction, it asks the wrapped
drafter. The place is found again after every divergence (an inserted line, a renamed
variable): the longest run of the output's last tokens that occurs in the prediction, the
occurrence nearest after the previous place winning ties, so an edit is followed as an edit
and not only as a common prefix (the idea of prompt lookup, Saxena 2023, with the prediction
as the only source; the same as llama.cpp's and vLLM's n-gram drafters over a given text).

Each draft is sized by the target's measured cost curve t(n) where the wrapped drafter has one
(the hybrid's, a draft model's): the n of the highest rate ``(E(n) + 1) / t(n)`` (Sequoia's
hardware-aware rule, as ``policies/draft_budget.py``), with E(n) from this request's own acceptance
of its prediction drafts (each drafted token accepted with probability p, p tracked per request from
a prior of 0.97). A long match in step is drafted long where t(n) pays for it (on a compute-bound CPU,
t(32) is about 5 decode steps: a draft that fails at its first token costs all of them), and short
where the request's prediction keeps being left. Without a curve, the whole budget is drafted.

Where drafting starts: the prediction's start counts as the place, so the answer's first two tokens
that spell the prediction's first two (after a chat answer's "```python" line) start drafting; the
prefill's token equal to the prediction's first is taken as that start at once. Where the output
has followed the prediction to its end (or to its last token: the answer's "\n```" is one token
where the prediction's last line ends in "\n"), the next step drafts nothing: the answer ends there or
departs from it, and the wrapped drafter's drafts would copy what follows the code in the prompt
(a chat prompt's instructions: on the edit workload such a draft of 16 tokens was always rejected,
at the cost of t(16), three decode steps).

Drafts that follow an edit (``edit_align.py``): given the target's tokenizer, the text written so far
is also aligned line by line with the prediction's text, through the re-indentation and renames the
edit makes, and that alignment's draft (the prediction's continuation as the edit writes it, tokenized
as the target would continue the committed tokens) is proposed where it differs from the token-id
place's draft or is longer; where they agree, or the alignment has none, the token-id place drafts
(its tokens carry prediction positions, which usage counts; an aligned draft's accepted tokens are
counted as accepted prediction tokens without them). A method made a top-level function (every line 4 spaces less, ``self``
renamed) loses the token-id place at every line's first token; the text alignment keeps it.

A prediction is only a draft: the target verifies every token, so a wrong, empty or hostile
prediction costs speed at worst, never output. Its size is bounded like a prompt's by the
caller (the engine refuses one longer than the context).

Usage (``prediction_usage``): OpenAI counts ``accepted_prediction_tokens`` (prediction tokens
that appeared in the completion) and ``rejected_prediction_tokens`` (those that did not).
Here the accepted ones are the prediction's drafted tokens the target accepted, and the token
the target added after them where it continues the prediction, each position counted once and
only where it lies inside the completion returned (a stop string or ``max_tokens`` cuts what
the engine accepted past it); the rejected ones are the rest of the prediction. A request that
drafts nothing from its prediction (speculation off, one token) accepts none.

    d = PredictionDrafter(SuffixDrafter())
    engine = Engine(target, d, 16)
    req = engine.add_request(prompt_ids, params, prediction=tuple(tok(old_code)))
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..policies.draft_budget import best_size
from ..tree import DraftTree
from ..types import RequestStats
from ..cost_model import CostModel
from .base import DraftContext, Drafter, Features, Observation, RequestTable, WrappingDrafter
from .cross_tokenizer import DETOKENIZE_WINDOW, UTF8_HOLD, continuation_tokens, text_after
from .edit_align import EditAligner

MIN_MATCH = 2  # output tokens that must match the prediction before its continuation is drafted
RESYNC_MATCH = 4  # ...and, away from the place drafting stands at, this many (2 tokens recur by chance)
MAX_MATCH = 64  # a match is not extended further back than this (it only ranks candidates)
MAX_CANDIDATES = 256  # occurrences of the output's last tokens ranked per step (those nearest the place)
KEPT_USAGE = 4096  # finished requests whose prediction usage is kept until read
PRIOR_ACCEPT, PRIOR_WEIGHT = 0.97, 10.0  # a drafted prediction token's acceptance before a request's own evidence
CODE_BLOCK = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)  # a Markdown code block's code
CHARS_PER_TOKEN = 8  # an aligned draft's text: this many characters per token of the budget (and a line more)


@dataclass
class _Written:
    """A request's output as text, for the edit aligner: decoded incrementally."""

    source: str  # the prediction's text
    aligner: EditAligner
    start: int  # the first output token (the prompt's length)
    synced: int  # tokens whose text ``text`` holds
    text: str = ""


@dataclass
class _Place:
    """A request's prediction, indexed by its ``MIN_MATCH``-grams, and where drafting stands."""

    prediction: tuple[int, ...]
    index: dict[tuple[int, ...], list[int]]  # n-gram -> its start positions, ascending
    next_pos: int = 0  # the prediction position after the last drafted/accepted one
    drafted: dict[int, int] = field(default_factory=dict)  # this step's tree node -> prediction position
    accepted: dict[int, int] = field(default_factory=dict)  # prediction position accepted -> its index in the tokens
    base: int = 0  # this step's root's index in the request's tokens (prompt first) + 1
    from_prediction: bool = False  # did this step's tree come from the prediction?
    guessed_start: bool = False  # was the prefill's token looked at as the prediction's start?
    ended: bool = False  # has the step after the output reached the prediction's end been drafted (plain)?
    hits: int = 0  # drafted prediction tokens accepted (drafted by token-id place)
    misses: int = 0  # prediction drafts cut short by a rejection (the same)
    aligned_hits: int = 0  # accepted tokens of drafts from the text alignment (no prediction positions)
    aligned_misses: int = 0  # ... and those drafts cut short by a rejection
    aligned_at: list[int] = field(default_factory=list)  # their accepted tokens' indices in the request's tokens
    written: _Written | None = None  # the output's text and its alignment (with a tokenizer)

    def acceptance(self, aligned: bool = False) -> float:
        """p, the probability that a drafted prediction token is accepted given those before it were,
        of the token-id place's drafts or (``aligned``) the text alignment's: tracked apart, so the
        alignment's misses where the answer left the prediction do not shorten the other's drafts."""
        hits, misses = (self.aligned_hits, self.aligned_misses) if aligned else (self.hits, self.misses)
        return (hits + PRIOR_WEIGHT * PRIOR_ACCEPT) / (hits + misses + PRIOR_WEIGHT)


def _index(prediction: tuple[int, ...]) -> dict[tuple[int, ...], list[int]]:
    index: dict[tuple[int, ...], list[int]] = {}
    for p in range(len(prediction) - MIN_MATCH + 1):
        index.setdefault(prediction[p:p + MIN_MATCH], []).append(p)
    return index


def find_place(prediction: tuple[int, ...], index: dict[tuple[int, ...], list[int]], tokens: Sequence[int],
               hint: int) -> int | None:
    """The prediction position right after the occurrence of ``tokens``' last tokens that
    matches longest (at least MIN_MATCH at ``hint``, RESYNC_MATCH elsewhere), the occurrence
    nearest at or after ``hint`` winning ties; None when there is none. In step (the output
    ends where the prediction does at ``hint`` or one past it: the bonus token; or, before
    anything matched, at the prediction's first MIN_MATCH tokens) costs O(1); otherwise at most
    ``MAX_CANDIDATES`` occurrences around ``hint`` are ranked.

    Example: prediction (5, 6, 7, 8, 5, 6, 9), output ending (.., 5, 6), hint 3 -> 6 (the
    second "5 6" is nearer after the hint; both match two tokens).
    """
    if len(tokens) < MIN_MATCH:
        return None
    tail = tuple(tokens[-MIN_MATCH:])
    for h in (hint + 1, hint, MIN_MATCH if hint < MIN_MATCH else -1):
        if MIN_MATCH <= h <= len(prediction) and prediction[h - MIN_MATCH:h] == tail:
            return h
    starts = index.get(tail)
    if not starts:
        return None
    at = bisect_left(starts, hint - MIN_MATCH)
    window = starts[max(0, at - MAX_CANDIDATES // 2):at + MAX_CANDIDATES // 2]
    best, best_key = None, None
    for s in window:
        after, n = s + MIN_MATCH, MIN_MATCH  # prediction[s:after] == the output's last n tokens; extend n backwards
        while n < MAX_MATCH and after - n > 0 and n < len(tokens) and prediction[after - n - 1] == tokens[-n - 1]:
            n += 1
        key = (n, after >= hint, -abs(after - hint))
        if n >= RESYNC_MATCH and (best_key is None or key > best_key):
            best, best_key = after, key
    return best


class PredictionDrafter(WrappingDrafter):
    """Drafts a request's prediction where the output follows it; ``inner`` drafts elsewhere
    (and observes every step, so it stays in step with the request). ``cost``: the target's cost
    model (``registry.cost_model``) that sizes its drafts; None: they fill the budget. Declares what ``inner``
    declares (its features, memory, reset) and answers to its name (statistics name the
    method a request ran; the prediction is the request's, not a method). ``tokenizer``: the
    target's; with it, drafts also follow an edit through the text (module docstring).
    ``prompt_code`` (with a tokenizer): a request without a prediction has the last Markdown code
    block of its prompt aligned instead, drafting once a line of the answer is aligned with it."""

    def __init__(self, inner: Drafter, cost: CostModel | None = None, tokenizer: Any = None,
                 prompt_code: bool = False):
        self.inner = inner
        self.cost = None if cost is None else cost.curve  # t(n), or None: drafts fill the budget
        self.tokenizer = tokenizer  # the target's: drafts that follow an edit (edit_align.py); None: token ids only
        self.prompt_code = prompt_code and tokenizer is not None
        self._prompt_lengths: dict[str, int] = {}
        self.name = inner.name
        self.features: Features = inner.features  # drafters declare theirs at construction
        self._places: RequestTable[_Place] = RequestTable()
        # finished requests' (accepted tokens' indices, prediction tokens), oldest first, until read (bounded)
        self._usage: OrderedDict[str, tuple[tuple[int, ...], int]] = OrderedDict()
        # verified proposals from predictions, their drafted and accepted tokens (as ``HybridDrafter``'s by source)
        self.steps: Counter[str] = Counter()
        self.drafted: Counter[str] = Counter()
        self.accepted: Counter[str] = Counter()

    # ---- lifecycle -------------------------------------------------------------------
    def start(self, request_id: str, prompt_ids: list[int]) -> None:
        if self.tokenizer is not None:
            self._prompt_lengths[request_id] = len(prompt_ids)
        self.inner.start(request_id, prompt_ids)

    def finish(self, request_id: str) -> None:
        place = self._places.pop(request_id)
        self._prompt_lengths.pop(request_id, None)
        if place is not None and place.prediction:
            # accepted: the prediction's positions (their token indices), then the aligned drafts' tokens
            at = sorted(set(place.accepted.values()) | set(place.aligned_at))[:len(place.prediction)]
            self._usage[request_id] = (tuple(at), len(place.prediction))
            while len(self._usage) > KEPT_USAGE:
                self._usage.popitem(last=False)
        self.inner.finish(request_id)

    def prediction_usage(self, request_id: str, end: int | None = None) -> tuple[int, int] | None:
        """(accepted, rejected) prediction tokens of a finished request that had a prediction
        (OpenAI's ``accepted_prediction_tokens`` / ``rejected_prediction_tokens``), counting only
        accepted tokens before index ``end`` of its tokens (prompt first: the completion's end);
        read once."""
        usage = self._usage.pop(request_id, None)
        if usage is None:
            return None
        accepted = sum(1 for i in usage[0] if end is None or i < end)
        return accepted, usage[1] - accepted

    def record_usage(self, request_id: str, stats: RequestStats) -> None:
        """Put a finished request's prediction usage (if it had a prediction) into its statistics,
        counting only its completion's ``stats.new_tokens`` tokens."""
        usage = self.prediction_usage(request_id, stats.prompt_tokens + stats.new_tokens)
        if usage is not None:
            stats.accepted_prediction_tokens, stats.rejected_prediction_tokens = usage

    def observe(self, obs: Observation) -> None:
        place = self._places.find(obs.request_id)
        if place is not None and place.from_prediction:
            on_path = [place.drafted[node] for node in obs.path if node in place.drafted]
            if place.drafted:
                at = [place.base + i for i, node in enumerate(obs.path) if node in place.drafted]
                after = on_path[-1] + 1 if on_path else min(place.drafted.values())
                # the step's last token (the target's own) may continue the prediction too: it appeared in the answer
                if after < len(place.prediction) and obs.new_tokens[-1] == place.prediction[after]:
                    on_path.append(after)
                    at.append(place.base + len(obs.path))
                for pos, index in zip(on_path, at):
                    place.accepted.setdefault(pos, index)
                place.hits += len(obs.path)
                place.misses += len(obs.path) < obs.tree.num_drafted
            else:  # drafted from the text alignment: tokens, not prediction positions
                place.aligned_at += [place.base + i for i in range(len(obs.path))]
                place.aligned_hits += len(obs.path)
                place.aligned_misses += len(obs.path) < obs.tree.num_drafted
            self.steps["prediction"] += 1
            self.drafted["prediction"] += obs.tree.num_drafted
            self.accepted["prediction"] += len(obs.path)
            if on_path:
                place.next_pos = on_path[-1] + 1
            place.from_prediction = False  # observed: a step without a proposal (budget 0) counts nothing
        self.inner.observe(obs)

    # ---- proposing -------------------------------------------------------------------
    def propose(self, ctx: DraftContext) -> DraftTree:
        return self.propose_batch([ctx])[0]

    def propose_batch(self, ctxs: Sequence[DraftContext]) -> list[DraftTree]:
        """Prediction drafts where a request's output follows its prediction; ``inner`` drafts
        the others in one ``propose_batch`` call (a draft model: one forward for all)."""
        trees: list[DraftTree | None] = [self._from_prediction(c) for c in ctxs]
        rest = [c for c, t in zip(ctxs, trees) if t is None]
        inner = iter(self.inner.propose_batch(rest) if rest else [])
        return [t if t is not None else next(inner) for t in trees]

    def _from_prediction(self, ctx: DraftContext) -> DraftTree | None:
        if not ctx.prediction and not self.prompt_code:
            return None
        place = self._places.find(ctx.request_id)
        if place is None:
            place = _Place(ctx.prediction, _index(ctx.prediction))
            self._places.add(ctx.request_id, place)
        if not place.prediction:  # the prompt's code block: its text alignment alone
            return self._sized(ctx, place, self._aligned(ctx, place), aligned=True)
        pos = find_place(place.prediction, place.index, ctx.tokens, place.next_pos)
        if pos is None and not place.guessed_start and not place.accepted:
            place.guessed_start = True  # once: the prefill's token may be the prediction's first
            if place.prediction[0] == ctx.tokens[-1]:
                pos = 1
                place.accepted[0] = len(ctx.tokens) - 1  # the prefill's token: it appeared in the answer
        # followed to its end (or to its last token, which the answer may spell otherwise, e.g. "\n```"): once, a
        # plain step (see the module docstring)
        at_end = pos == len(place.prediction) or (pos is None and 0 < place.next_pos >= len(place.prediction) - 1)
        if at_end and not place.ended:
            place.ended, place.from_prediction = True, False
            return DraftTree.chain(ctx.tokens[-1], [])
        by_ids = [] if pos is None else list(place.prediction[pos:pos + ctx.budget])
        aligned = self._aligned(ctx, place) if self.tokenizer is not None else []
        n = min(len(aligned), len(by_ids))
        if aligned and (aligned[:n] != by_ids[:n] or len(aligned) > len(by_ids)):  # the alignment knows better
            return self._sized(ctx, place, aligned, True)
        return self._sized(ctx, place, by_ids, False, pos)  # the same tokens: drafted with their positions

    def _sized(self, ctx: DraftContext, place: _Place, draft: list[int], aligned: bool,
               pos: int | None = None) -> DraftTree | None:
        """``draft`` (from prediction position ``pos``, or the text alignment) cut to the cost
        curve's size, as this step's tree; None (the inner drafter drafts) when nothing is left."""
        if draft and self.cost is not None:  # the size of the highest rate on the target's cost curve
            p = place.acceptance(aligned)
            draft = draft[:best_size([p ** (i + 1) for i in range(len(draft))], self.cost)[0]]
        place.from_prediction = bool(draft)
        if not draft:
            return None
        # chain node i + 1 drafts position pos + i (an aligned draft: no positions)
        place.drafted = {} if aligned else {i + 1: pos + i for i in range(len(draft))}
        place.base = len(ctx.tokens)
        return DraftTree.chain(ctx.tokens[-1], draft)

    def _aligned(self, ctx: DraftContext, place: _Place) -> list[int]:
        """The edit aligner's draft (``edit_align.py``) as target tokens continuing ``ctx.tokens``, or []."""
        written = place.written
        if written is None:
            start = self._prompt_lengths.get(ctx.request_id, len(ctx.tokens) - 1)
            if place.prediction:
                source, after = self._decode(list(place.prediction)), 0
            else:  # the prompt's last code block, followed once a line of the answer is aligned with it
                blocks = CODE_BLOCK.findall(self._decode(ctx.tokens[:start]))
                source, after = (blocks[-1] if blocks else ""), 1
            written = place.written = _Written(source, EditAligner(source, after), start, start)
        if not written.source:
            return []
        if not self._sync(written, ctx.tokens):
            return []
        text = written.aligner.draft(written.text, CHARS_PER_TOKEN * ctx.budget)
        if not text:
            return []
        return continuation_tokens(self.tokenizer, ctx.tokens[written.start:], text, fresh=True)[:ctx.budget]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _sync(self, written: _Written, tokens: list[int]) -> bool:
        """Bring the output's text up to ``tokens`` (holding back tokens that end inside a UTF-8
        character, as the cross-tokenizer drafter does); True when it holds them all."""
        end, held = len(tokens), 0
        if end <= written.synced:
            return end == written.synced
        context = tokens[max(written.start, written.synced - DETOKENIZE_WINDOW):written.synced]
        new = text_after(self.tokenizer, context, tokens[written.synced:end])
        while new is not None and new.endswith("\ufffd") and held < UTF8_HOLD:
            end, held = end - 1, held + 1
            if end == written.synced:
                return False
            new = text_after(self.tokenizer, context, tokens[written.synced:end])
        if new is None:  # not an extension of the text so far: decoded whole, aligned again
            written.text = self.tokenizer.decode(tokens[written.start:end], skip_special_tokens=False,
                                                 clean_up_tokenization_spaces=False)
            written.aligner = EditAligner(written.source, written.aligner.min_aligned)
        else:
            written.text += new
        written.synced = end
        return end == len(tokens)
