"""The grammar engine behind constrained decoding: llguidance (Microsoft's guidance-ai, MIT),
adapted to verispec's token ids. The only module that imports it.

llguidance was chosen by measurement (docs/structured.md, "The grammar engine"): on
Qwen2.5-Coder's 151,936-token vocabulary a token mask costs ~15 us (a 1.5B decode step here
is ~70-90 ms), a matcher rolls back any number of tokens exactly and forks (``deep_copy``) in
~10 us, it reads JSON Schema, Lark, GBNF, regexes and choice lists, it bounds the work a hostile
grammar can ask for (``LLParserLimits``: lexer fuel, Earley items, grammar size), and it has no
dependency (xgrammar pulls triton and a TVM runtime into a CPU engine).

A ``Matcher`` is one request's grammar state: it ``advance``s over committed tokens, ``rollback``s,
``fork``s, and gives the ``allowed`` tokens (a bool row over the target's vocabulary) and the
tokens the grammar ``forced`` next. Errors of a grammar or a schema are ``GrammarError``,
one line.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

MAX_GRAMMAR_BYTES = 256 * 1024  # a grammar or schema longer than this is refused before compiling


class GrammarError(ValueError):
    """A grammar, schema or pattern the engine refuses (syntax, unsupported feature, limits); one line."""


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(str(text).replace("<non-verbose/>", "").split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def parser_limits() -> Any:
    """The work one grammar may ask for: llguidance's own bounds, with errors kept short (no
    parser state in messages: they go back to clients). Compilation and every mask step are
    bounded by fuel, so a hostile schema is refused in bounded time, not run."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


class GrammarVocabulary:
    """The target's vocabulary as the grammar engine sees it: token bytes from the model's
    tokenizer, ``vocab_size`` rows (a padded LM head's extra rows are never allowed), the EOS
    ids that end a grammar. Built once per tokenizer (~1-2.5 s on a 150k vocabulary): ``of``."""

    _cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    _lock = threading.Lock()

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: tuple[int, ...]):
        import llguidance.hf

        if not eos_ids:
            raise GrammarError("constrained decoding needs a model with an end-of-sequence token")
        self.vocab_size, self.eos_ids = vocab_size, tuple(eos_ids)
        self.ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_ids))
        # added tokens (<tool_call>, <|im_start|>, ...): llguidance consumes them only where a grammar
        # names them (``<[id]>``), though its mask may allow one where a grammar spells its text
        self.added_ids = tuple(sorted(t for t in tokenizer.added_tokens_decoder if t < vocab_size and t not in eos_ids))

    @classmethod
    def of(cls, tokenizer: Any, vocab_size: int, eos_ids: tuple[int, ...]) -> GrammarVocabulary:
        with cls._lock:
            by_shape = cls._cache.setdefault(tokenizer, {})
            key = (vocab_size, tuple(eos_ids))
            if key not in by_shape:
                by_shape[key] = cls(tokenizer, vocab_size, eos_ids)
            return by_shape[key]


class Matcher:
    """One request's grammar state over the tokens committed (and, while a draft tree is
    walked, drafted) so far.

    llguidance bounds each step's work (``parser_limits``); a step past its limits (a huge
    alternation's Earley row, a lexer that would build too many states) puts its matcher in an
    error state it cannot roll back from. A ``Matcher`` never stays there: it keeps its start
    state and the tokens it consumed, and a step that fails is undone by replaying them (rare:
    only a grammar at the limits' edge). So a token the mask allowed but the engine could not
    consume makes ``advance`` return False with the state unchanged (the answer cannot go past
    it: it ends there), and a mask the engine could not compute allows EOS alone."""

    def __init__(self, ll_matcher: Any, vocab: GrammarVocabulary, start: Any = None,
                 consumed: list[int] | None = None):
        self._m, self.vocab, self.vocab_size = ll_matcher, vocab, vocab.vocab_size
        self._words = (vocab.vocab_size + 31) // 32
        self._start = ll_matcher.deep_copy() if start is None else start  # never advanced: only copied
        self._consumed: list[int] = [] if consumed is None else consumed
        self._spent = False

    @classmethod
    def compile(cls, grammar: str, vocab: GrammarVocabulary) -> Matcher:
        """A fresh matcher of an llguidance grammar (``compile.py`` makes them); GrammarError
        with the engine's message when it does not compile within the limits."""
        import llguidance

        if len(grammar) > MAX_GRAMMAR_BYTES:
            raise GrammarError(f"the grammar is {len(grammar)} characters; at most {MAX_GRAMMAR_BYTES} are accepted")
        limits = parser_limits()
        error = llguidance.LLMatcher.validate_grammar(grammar, vocab.ll, limits=limits)
        if error:
            raise GrammarError(_one_line(error))
        m = llguidance.LLMatcher(vocab.ll, grammar, log_level=0, limits=limits)
        if m.is_error():
            raise GrammarError(_one_line(m.get_error()))
        matcher = cls(m, vocab)
        matcher._check_start()
        return matcher

    def _check_start(self) -> None:
        """GrammarError unless the start state allows a token the engine can consume: a grammar
        whose language is empty (``{"$ref": "#"}``, a ``$ref`` cycle) leaves nothing allowed, and
        one past the parser's limits (thousands of alternatives as rules, ``a{1000000}``) fails
        on its first token."""
        bits = self.new_bitmask(1)
        probe = self._m.deep_copy()
        probe.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * 4)
        if probe.is_error():
            error = probe.get_error()
            raise GrammarError("the grammar allows no answer: its language is empty (a rule or $ref that only "
                               f"refers to itself?) ({_one_line(error, 200)})")
        self.fill_bitmask(bits[0])  # without the added tokens the engine would refuse
        allowed = unpack_bitmask(bits, self.vocab_size)[0]
        for t in self.vocab.eos_ids:
            allowed[t] = False
        first = allowed.nonzero().flatten()[:1].tolist()
        if not first:
            if not self._m.is_accepting():
                raise GrammarError("the grammar allows no answer: no token of the model's vocabulary can start it "
                                  "(or its first step is past the grammar engine's limits)")
            return
        probe = self._m.deep_copy()
        if not probe.consume_tokens(first) or probe.is_error():
            raise GrammarError("the grammar asks more of the grammar engine than its limits allow "
                               f"({_one_line(probe.get_error(), 200)}); use fewer alternatives or repetitions")

    def fork(self) -> Matcher:
        """An independent copy in the same state (a request's own state from a compiled template)."""
        copy = Matcher(self._m.deep_copy(), self.vocab, self._start, list(self._consumed))
        copy._spent = self._spent
        return copy

    def _recover(self) -> None:
        """Back to the state before the failed step: the start state, then the tokens consumed. Where
        the replay fails too (a limit counted over the grammar's life, as the lexer's states), the
        matcher is spent: it allows EOS alone from then on, so its request ends."""
        if self._spent:
            return
        m = self._start.deep_copy()
        if self._consumed and (not m.consume_tokens(self._consumed) or m.is_error()):
            self._spent = True
            return
        self._m = m

    def advance(self, tokens: list[int]) -> bool:
        """Consume ``tokens``; False, and the state unchanged, if the grammar forbids one or the
        engine's limits stop it there. EOS, which a mask allows only where the answer may end, is
        not consumed (llguidance refuses it)."""
        tokens = [t for t in tokens if t not in self.vocab.eos_ids]
        if not tokens:
            return True
        if self._spent:
            return False
        if self._m.consume_tokens(tokens) and not self._m.is_error():
            self._consumed.extend(tokens)
            return True
        self._recover()
        return False

    def ends_at(self, token: int) -> bool:
        """Does ``token`` end the answer (EOS, allowed where the grammar is complete)?"""
        return token in self.vocab.eos_ids

    def fill_eos_only(self, out: torch.Tensor) -> None:
        """``out`` (a bitmask row) allowing EOS alone: the state after the grammar's end."""
        out.zero_()
        for t in self.vocab.eos_ids:
            _set_bit(out, t, True)

    def rollback(self, n: int) -> None:
        if not n:
            return
        if n > len(self._consumed):
            raise RuntimeError(f"the grammar matcher could not roll back {n} tokens: it consumed {len(self._consumed)}")
        del self._consumed[-n:]
        if not self._spent and not self._m.rollback(n):
            self._recover()

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens``, in order, the grammar allows from here (nothing consumed)."""
        return self._m.validate_tokens(list(tokens)) if tokens and not self._spent else 0

    def text(self, tokens: list[int]) -> bytes:
        """The bytes ``tokens`` spell."""
        return self.vocab.ll.decode_bytes(list(tokens))

    def forced(self) -> list[int]:
        """Tokens the grammar forces from here (a schema's keys and punctuation), possibly none
        (also where the engine's limits stop it)."""
        if self._spent:
            return []
        forced = list(self._m.compute_ff_tokens())
        if self._m.is_error():
            self._recover()
            return []
        return forced

    @property
    def stopped(self) -> bool:
        """The grammar is complete and takes nothing more but EOS (or the matcher is spent)."""
        return self._spent or self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        """May the answer end here (EOS allowed by the grammar itself, not for want of anything else)?"""
        return not self._spent and self._m.is_accepting()

    @property
    def failed(self) -> bool:
        """Spent: the grammar engine's limits stopped it for good (it allows EOS alone)."""
        return self._spent or self._m.is_error()

    def fill_bitmask(self, out: torch.Tensor) -> None:
        """Write the allowed next tokens into ``out``, a contiguous int32 [ceil(V / 32)] CPU row
        (bit j of word w: token 32 w + j). An added token the mask allows but the grammar would
        not consume (llguidance 1.9: a grammar spelling ``<tool_call>`` as text, where the token
        exists, allows the token and then refuses it) is cleared, so the mask holds exactly what
        ``advance`` takes; a state left with nothing, or whose mask the engine could not compute
        within its limits, allows EOS (the request ends there)."""
        if not self._spent:
            self._m.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * 4)
            if not self._m.is_error():
                cleared = False
                for t in self.vocab.added_ids:
                    if has_bit(out, t) and not self._m.validate_tokens([t]):
                        _set_bit(out, t, False)
                        cleared = True
                if cleared and not bool(out.any()):
                    self.fill_eos_only(out)
                return
            self._recover()
        self.fill_eos_only(out)

    def new_bitmask(self, rows: int) -> torch.Tensor:
        return torch.zeros(rows, self._words, dtype=torch.int32)

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens the grammar allows next."""
        bits = self.new_bitmask(1)
        self.fill_bitmask(bits[0])
        return unpack_bitmask(bits, self.vocab_size)[0]


# byte value -> its 8 bits, least significant first: unpacking a [N, W] int32 mask is one gather
# of its bytes (little-endian: token 8 b + k is bit k of byte b), 8x less memory traffic than
# shifting int32 words
_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()  # [256, 8]


def unpack_bitmask(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, W] int32 bitmask -> [N, vocab_size] bool."""
    as_bytes = bits.contiguous().view(torch.uint8).reshape(-1).long()  # [N * 4 W]
    return _BYTE_BITS.index_select(0, as_bytes).reshape(bits.shape[0], -1)[:, :vocab_size]


def _set_bit(row: torch.Tensor, token: int, on: bool) -> None:
    word = int(row[token >> 5]) & 0xFFFFFFFF
    word = word | (1 << (token & 31)) if on else word & ~(1 << (token & 31))
    row[token >> 5] = word - (1 << 32) if word >= 1 << 31 else word  # back to a signed int32


def has_bit(row: torch.Tensor, token: int) -> bool:
    """Is ``token`` allowed in a [W] int32 bitmask row?"""
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)
