"""Drafts that follow an edit: the text a model has written so far, aligned line by line with a
source text (a request's prediction, the original code), drafts the source's continuation as the
edit transforms it.

The idea of Cursor's speculative edits (Cursor, "Editing Files at 1000 Tokens per Second", 2024: the
original file drafts its rewrite) and of Blazedit (Lian et al. 2025, "Blazing-Fast Code Editing via
Multi-Layer Speculation": long drafts copied from the original where the rewrite follows it), matched
on text rather than token ids, the matching SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975) and
prompt lookup do on token ids. Token ids lose their place at every line of an edit that re-indents
(a method made a top-level function: every line 4 spaces less, so every line's first token differs)
or renames (``self`` -> ``obj``); text aligned line by line does not:

* each line the output completes is aligned with a source line: the one whose content (stripped of
  indentation, with the renames learned so far applied, or as written) equals it, the next source line
  first, then the nearest after the place, then before it (a moved block); a short or repeated line
  (``)``, ``else:``) only within ``SHORT_REACH`` lines after the place (it proves nothing further off).
  A line equal to none is compared piece by piece (identifiers, numbers, other characters) with the
  next source lines and those starting with its first piece (``def``, ``return``; a line moved back to
  where it came from): mostly equal (``difflib`` ratio >= ``FUZZY_RATIO``), it is aligned and its
  one-for-one identifier replacements are learned as renames (``self`` -> ``obj``); a rename the
  output is seen not to make (an aligned line keeps the identifier) as often as it is seen made is
  forgotten (a docstring that keeps "self" does not undo the parameter's rename). Otherwise the line
  was inserted, and the place stays;
* the indentation delta is learned from each aligned statement line (output indentation minus source
  indentation) and applied to every following source line (a constant re-indentation); a line inside
  open brackets or inside a triple-quoted string (a docstring) adds its kind's offset, learned from the
  last line of that kind aligned (an answer may dedent the code and keep a docstring's or a bracket's
  columns);
* the draft continues the line being written: the next source line, transformed, where it starts
  with what is written of the line; else the source line whose transformed content starts with the
  line's content (re-anchoring: a moved or deleted stretch; the indentation it is written at gives the
  delta; ``REANCHOR`` characters of content, ``SHORT_LINE`` after an inserted line: a novel line's
  ``if`` proves nothing, and the drafter wrapped drafts it better); else the next line (or one starting alike) whose start the line writes with identifiers
  replaced one for one (``if obj`` + ``.x`` for ``if self.x``: a rename read before the line is
  complete, applied to the rest of the draft); where only indentation is written, wider than the next
  line's, that line one space further in (byte-level BPE and SentencePiece leave a run of spaces' last
  space to the word after it; the lines after it shift alike); else the longest end of the line (``MIN_INLINE`` characters or more) found in a source line
  near the place (an edit inside the line). Then the following source lines, transformed, up to
  ``max_chars``.

Before any line is aligned, and after a line aligned with nothing (an inserted line: the answer may go
on inserting), a draft needs evidence of where the line is: ``MIN_START`` characters of its content
written (a chat answer's first line after its code fence may be anything: an import, the class it came
from); a line's start drafts nothing until then, and the drafter it wraps drafts instead.

Everything here is text; the caller tokenizes the draft (``continuation_tokens``, as the target would:
the committed tail re-tokenized with the draft, the cross-tokenizer drafter's boundary rule). It only
drafts: the target verifies every token, so a wrong alignment costs speed, never output.

    a = EditAligner("    def f(self):\\n        return self.x\\n")
    a.draft("def f(obj):\\n", 100)  # -> "    return obj.x\\n"
"""

from __future__ import annotations

import heapq
import keyword
import re
from bisect import insort
from difflib import SequenceMatcher

PIECE = re.compile(r"[A-Za-z_][A-Za-z_0-9]*|\d+|\s+|.")  # what lines are compared in
IDENT = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")
OPENS = {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}
FUZZY_RATIO = 0.6  # a line this similar (difflib's ratio over pieces) to a next source line is that line, edited
FUZZY_REACH = 3  # source lines after the place a line is compared with, piece by piece
FUZZY_MAX = 16  # ... and at most this many further ones that start with the same piece
SHORT_LINE = 8  # a line's content shorter than this (or repeated in the source) re-anchors only nearby
SHORT_REACH = 8  # ... within this many lines after the place
REANCHOR = 4  # characters of a line's content that re-anchor it away from the next line (a deletion, a move)
MIN_START = 2  # characters of a line's content written before the first line aligned drafts
MIN_INLINE = 8  # characters of a written line's end that anchor a draft inside a source line
MAX_INLINE = 64  # ... at most (a longer match only ranks candidates)
MAX_PIECES = 64  # pieces of a line compared at most (difflib is quadratic): a longer line's tail is not read
MAX_LINE_CHARS = 1000  # a longer line is not compared piece by piece (quadratic), only matched whole


def indent_of(line: str) -> int:
    """Characters of leading spaces and tabs."""
    return len(line) - len(line.lstrip(" \t"))


BLOCK, CONTINUED, IN_STRING = 0, 1, 2  # a line starts a statement, inside open brackets, inside a triple-quoted string
SCAN = re.compile(r"\"\"\"|'''|'(?:\\.|[^'\\])*'|\"(?:\\.|[^\"\\])*\"|#.*|[()\[\]{}]")


def line_kinds(lines: list[str]) -> list[int]:
    """Per line: does it start a statement (``BLOCK``), inside an open bracket of the lines before
    (``CONTINUED``) or inside a triple-quoted string (``IN_STRING``: a docstring's inner lines)?
    Brackets are counted outside string literals and comments (roughly, for any language)."""
    out, depth, quote = [], 0, None
    for line in lines:
        out.append(IN_STRING if quote else CONTINUED if depth > 0 else BLOCK)
        at = 0
        while at < len(line):
            if quote:  # inside a triple-quoted string: to its end
                end = line.find(quote, at)
                if end < 0:
                    break
                quote, at = None, end + 3
                continue
            m = SCAN.search(line, at)
            if m is None:
                break
            piece, at = m.group(), m.end()
            if piece in ('"""', "'''"):
                quote = piece
            elif piece in OPENS:
                depth = max(0, depth + OPENS[piece])
    return out


def _is_name(piece: str) -> bool:
    return bool(IDENT.fullmatch(piece)) and not keyword.iskeyword(piece)


class EditAligner:
    """One request's alignment of the written text with ``source`` (module docstring). ``draft``
    takes the whole text written so far each time (it reads only what is new) and returns the text
    to draft after it, or None; nothing before ``min_aligned`` written lines are aligned."""

    def __init__(self, source: str, min_aligned: int = 0):
        self.min_aligned = min_aligned  # lines aligned before anything is drafted (a source only maybe edited)
        lines = source.split("\n")
        self.ends_newline = source.endswith("\n")
        self.lines = lines[:-1] if self.ends_newline else lines
        self.content = [line.strip() for line in self.lines]
        self._raw: dict[str, list[int]] = {}  # content -> its lines
        self._first: dict[str, list[int]] = {}  # a content's first piece (``def``, ``return``) -> its lines
        for j, c in enumerate(self.content):
            self._raw.setdefault(c, []).append(j)
            if c:
                self._first.setdefault(PIECE.match(c).group(), []).append(j)
        self.kinds = line_kinds(self.lines)
        self.delta = 0  # output indentation minus source indentation, from the last aligned statement line
        # a continuation line's or a docstring line's indentation minus what the delta gives it, from the last of
        # its kind aligned (an answer may keep a docstring's or a bracket's columns while it dedents the code)
        self.offsets = {CONTINUED: 0, IN_STRING: 0}
        self.renames: dict[str, str] = {}  # source identifier -> the output's
        self._evidence: dict[str, int] = {}  # a rename's lines seen making it, less those seen not making it
        self._renamed: dict[str, list[int]] | None = None  # renamed content -> lines (None: not built yet)
        self._renamed_lines: list[str] = []  # each line's renamed content, as indexed
        self._dirty: set[str] = set()  # names whose rename changed since the index was brought up to date
        self._ident_lines: dict[str, list[int]] = {}  # an identifier -> the lines it occurs in
        for j, c in enumerate(self.content):
            for name in set(IDENT.findall(c)):
                self._ident_lines.setdefault(name, []).append(j)
        self.pointer = -1  # the source line the last aligned output line matched
        self.aligned = 0  # output lines aligned so far
        self.in_step = False  # was the last non-blank output line aligned?
        self._done = 0  # characters of the output read (its complete lines)

    # ---- the transformation ----------------------------------------------------------------
    def rename(self, text: str, extra: dict[str, str] | None = None) -> str:
        """``text`` with the learned renames applied, then ``extra`` (renames of renamed names)."""
        if not self.renames and not extra:
            return text

        def sub(m: re.Match) -> str:
            name = self.renames.get(m.group(), m.group())
            return extra.get(name, name) if extra else name

        return IDENT.sub(sub, text)

    def _renamed_index(self) -> dict[str, list[int]]:
        """Renamed content -> its lines, brought up to date on the lines whose names' renames changed."""
        if self._renamed is None:
            self._renamed, self._renamed_lines = {}, [self.rename(c) for c in self.content]
            for j, c in enumerate(self._renamed_lines):
                self._renamed.setdefault(c, []).append(j)
        elif self._dirty:
            for j in sorted({j for name in self._dirty for j in self._ident_lines.get(name, ())}):
                old, new = self._renamed_lines[j], self.rename(self.content[j])
                if new != old:
                    self._renamed[old].remove(j)
                    if not self._renamed[old]:
                        del self._renamed[old]
                    insort(self._renamed.setdefault(new, []), j)
                    self._renamed_lines[j] = new
        self._dirty.clear()
        return self._renamed

    def line(self, j: int, delta: int | None = None, extra: dict[str, str] | None = None,
             offsets: dict[int, int] | None = None) -> str:
        """Source line ``j`` as the edit writes it: re-indented by the delta (and its kind's offset:
        ``offsets`` before the learned ones), renamed."""
        src = self.lines[j]
        body = src.lstrip(" \t")
        if not body:
            return ""
        kind = self.kinds[j]
        offset = offsets[kind] if offsets and kind in offsets else self.offsets.get(kind, 0)
        width = max(0, indent_of(src) + (self.delta if delta is None else delta) + offset)
        return ("\t" if src.startswith("\t") else " ") * width + self.rename(body, extra)

    def _delta_at(self, j: int, width: int) -> int:
        """The delta that writes source line ``j`` at indentation ``width`` (its kind's offset kept)."""
        return width - indent_of(self.lines[j]) - self.offsets.get(self.kinds[j], 0)

    def _following(self, j: int, max_chars: int, delta: int | None = None, extra: dict[str, str] | None = None,
                   offsets: dict[int, int] | None = None) -> str:
        """Source lines ``j``.. transformed, each after a newline, to about ``max_chars``."""
        out, size = [], 0
        while j < len(self.lines) and size < max_chars:
            text = self.line(j, delta, extra, offsets)
            out.append("\n" + text)
            size += len(text) + 1
            j += 1
        if j == len(self.lines) and self.ends_newline:
            out.append("\n")
        return "".join(out)

    # ---- aligning the written lines --------------------------------------------------------
    def _nearest(self, lines: list[int], content: str) -> int | None:
        """The candidate the place prefers: the next line, the nearest after, the nearest before;
        a short or repeated line only within SHORT_REACH lines after the place."""
        nearby_only = len(content) < SHORT_LINE or len(lines) > 1
        best, best_key = None, None
        for j in lines:
            if nearby_only and not self.pointer < j <= self.pointer + SHORT_REACH:
                continue
            key = (j <= self.pointer, abs(j - self.pointer - 1))
            if best_key is None or key < best_key:
                best, best_key = j, key
        return best

    def _learn(self, j: int, written: str) -> None:
        self.pointer, self.aligned = j, self.aligned + 1
        shift = indent_of(written) - indent_of(self.lines[j])
        if self.kinds[j] == BLOCK:
            self.delta = shift
        else:  # a continuation or docstring line: its own offset from the block's delta
            self.offsets[self.kinds[j]] = shift - self.delta

    def _learn_renames(self, j: int, content: str) -> bool:
        """Align ``content`` with source line ``j`` piece by piece: mostly equal -> learn its
        one-for-one identifier replacements and forget renames it keeps (True)."""
        if len(self.content[j]) > MAX_LINE_CHARS or len(content) > MAX_LINE_CHARS:
            return False
        a, b = PIECE.findall(self.content[j])[:MAX_PIECES], PIECE.findall(content)[:MAX_PIECES]
        matcher = SequenceMatcher(None, a, b, autojunk=False)
        if matcher.ratio() < FUZZY_RATIO:
            return False
        before, seen = dict(self.renames), {}
        for tag, i1, i2, j1, j2 in matcher.get_opcodes():
            if tag == "replace" and i2 - i1 == j2 - j1:
                for x, y in zip(a[i1:i2], b[j1:j2]):
                    if _is_name(x) and _is_name(y):
                        seen[x] = y
            elif tag == "equal":
                for x in a[i1:i2]:
                    if x in self.renames:
                        seen.setdefault(x, x)  # kept as written here
        for x, y in seen.items():  # one line, one piece of evidence per name
            if self.renames.get(x) == y:
                self._evidence[x] += 1
            elif x in self.renames and self._evidence[x] > 1:
                self._evidence[x] -= 1  # seen made more often than not: kept (a docstring's "self")
            elif x == y:
                self.renames.pop(x)
            else:
                self.renames[x], self._evidence[x] = y, 1
        self._dirty.update(x for x in seen if self.renames.get(x) != before.get(x))
        return True

    def _fuzzy_candidates(self, content: str) -> list[int]:
        """Source lines a line equal to none may be an edit of: the next FUZZY_REACH lines, then
        (a line of SHORT_LINE characters or more) those starting with its first piece, nearest first."""
        near = [k for k in range(self.pointer + 1, min(len(self.lines), self.pointer + 1 + FUZZY_REACH))
                if self.content[k]]
        return near if len(content) < SHORT_LINE else near + self._same_start(content, near)

    def _same_start(self, content: str, skip: list[int] = ()) -> list[int]:
        """Source lines whose content starts with ``content``'s first piece, nearest the place
        first (FUZZY_MAX at most)."""
        return heapq.nsmallest(FUZZY_MAX, (k for k in self._first.get(PIECE.match(content).group(), ())
                                           if k not in skip), key=lambda k: (k <= self.pointer, abs(k - self.pointer - 1)))

    def _align(self, written: str) -> None:
        """Align one completed output line (module docstring)."""
        content = written.strip()
        if not content:  # a blank line: steps over a blank source line
            nxt = self.pointer + 1
            if nxt < len(self.lines) and not self.content[nxt]:
                self.pointer = nxt
            return
        renamed = self._renamed_index().get(content, []) if self.renames else []
        j = self._nearest(renamed, content)
        if j is None:
            j = self._nearest(self._raw.get(content, []), content)
            if j is not None and self.renames:  # written as the source has it: renames not made here
                self._learn_renames(j, content)
        if j is None:
            for k in self._fuzzy_candidates(content):
                if self._learn_renames(k, content):
                    j = k
                    break
        self.in_step = j is not None
        if j is not None:
            self._learn(j, written)

    def update(self, text: str) -> str:
        """Align the lines of ``text`` (everything written) completed since the last call; returns
        the line being written (after the last newline)."""
        end = text.rfind("\n")
        if end + 1 > self._done:
            for written in text[self._done:end].split("\n"):
                self._align(written)
            self._done = end + 1
        return text[end + 1:]

    # ---- drafting --------------------------------------------------------------------------
    def draft(self, text: str, max_chars: int) -> str | None:
        """The text to draft after ``text`` (all written so far), at most ``max_chars`` long, or None."""
        drafted = self._draft(self.update(text), max_chars)
        return None if drafted is None else drafted[:max_chars]

    def _draft(self, partial: str, max_chars: int) -> str | None:
        body = partial.lstrip(" \t")
        if self.aligned < self.min_aligned or (not self.in_step and len(body) < MIN_START):
            return None  # after a line aligned with nothing: the line's first characters must say where it is
        nxt = self.pointer + 1
        expected = [j for j in ((nxt, nxt + 1) if nxt + 1 < len(self.lines) and not self.content[nxt] else (nxt,))
                    if j < len(self.lines)]
        for j in expected:
            line = self.line(j)
            if line.startswith(partial) and (line or j + 1 < len(self.lines)):
                return line[len(partial):] + self._following(j + 1, max_chars)
        if partial and not body and self.in_step and " " * len(partial) == partial:
            # indentation wider than the next line's: that line, one space further (byte-level BPE and
            # SentencePiece leave a run's last space to the word after it: "   " + " return")
            for j in expected:
                if self.content[j] and len(partial) >= indent_of(self.line(j)):
                    return self._at_width(j, len(partial) + 1, max_chars, len(partial))
        # re-anchor on the line's content, at the indentation it is written at: the answer's first line on
        # MIN_START characters, a line after an aligned one on REANCHOR, after an inserted one on SHORT_LINE
        if len(body) >= (MIN_START if self.aligned == 0 else REANCHOR if self.in_step else SHORT_LINE):
            j = self._starting_with(body)
            if j is not None:
                delta = self._delta_at(j, indent_of(partial))
                return self.line(j, delta)[len(partial):] + self._following(j + 1, max_chars, delta)
            for j in expected + self._same_start(body, expected):  # renamed: the next line, or one starting alike
                renamed = self._renamed_prefix(j, partial, max_chars)
                if renamed is not None:
                    return renamed
        return self._inline(partial, max_chars)

    def _at_width(self, j: int, width: int, max_chars: int, written: int) -> str:
        """Source line ``j`` at indentation ``width`` after ``written`` characters of it, then the following lines:
        a statement line shifts the delta, a continuation or docstring line only its kind's offset."""
        kind = self.kinds[j]
        if kind == BLOCK:
            delta, offsets = self._delta_at(j, width), None
        else:
            delta, offsets = None, {kind: width - indent_of(self.lines[j]) - self.delta}
        return self.line(j, delta, offsets=offsets)[written:] + self._following(j + 1, max_chars, delta, offsets=offsets)

    def _renamed_prefix(self, j: int, partial: str, max_chars: int) -> str | None:
        """The continuation of source line ``j`` where ``partial`` writes its start with identifiers
        replaced one for one (a rename not learned yet: ``if obj`` for ``if self.x``): the pieces
        before its last equal line j's (identifiers may differ), its last piece starts line j's
        next; those replacements apply to the rest of the draft."""
        if len(self.content[j]) > MAX_LINE_CHARS or len(partial) > MAX_LINE_CHARS:
            return None
        a, b = PIECE.findall(self.rename(self.content[j])), PIECE.findall(partial.lstrip(" \t"))
        if not 2 <= len(b) <= len(a):
            return None
        extra: dict[str, str] = {}
        for x, y in zip(a, b[:-1]):
            if x != y and not (_is_name(x) and _is_name(y) and extra.setdefault(x, y) == y):
                return None
        last = extra.get(a[len(b) - 1], a[len(b) - 1])
        if not extra or not last.startswith(b[-1]):
            return None
        delta = self._delta_at(j, indent_of(partial))
        rest = [last[len(b[-1]):]] + [extra.get(x, x) if _is_name(x) else x for x in a[len(b):]]
        return "".join(rest) + self._following(j + 1, max_chars, delta, extra)

    def _starting_with(self, body: str) -> int | None:
        index = self._renamed_index() if self.renames else self._raw
        starts = sorted(j for c, lines in index.items() if c and c.startswith(body) for j in lines)
        return self._nearest(starts, body) if len(body) < SHORT_LINE or len(starts) > 1 else starts[0] if starts else None

    def _inline(self, partial: str, max_chars: int) -> str | None:
        """Continue inside a source line near the place after the longest end of ``partial`` it holds."""
        if len(partial.strip()) < MIN_INLINE or not self.aligned:
            return None  # an edit inside a line of a source being followed (not a first line's stray match)
        best = None  # (matched length, line)
        for j in (self.pointer + 1, self.pointer, self.pointer + 2):
            if not 0 <= j < len(self.lines):
                continue
            line, n = self.line(j), MIN_INLINE - 1
            while n < min(MAX_INLINE, len(partial)) and partial[-(n + 1):] in line:
                n += 1
            if n >= MIN_INLINE and (best is None or n > best[0]):
                best = (n, j)
        if best is None:
            return None
        n, j = best  # the line is source line j as written: its indentation gives the delta
        delta = self._delta_at(j, indent_of(partial))
        line = self.line(j, delta)
        return line[line.find(partial[-n:]) + n:] + self._following(j + 1, max_chars, delta)
