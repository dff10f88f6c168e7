"""The edit aligner (drafters/edit_align.py): the text written so far, aligned line by line with a
source, drafts the source's continuation as the edit writes it: through a constant re-indentation,
consistent renames (learned from whole lines and from the line being written), inserted, deleted and
moved lines, and an edit inside a line; before anything is aligned, a prose preamble drafts nothing."""

from __future__ import annotations

from verispec.drafters.edit_align import BLOCK, CONTINUED, IN_STRING, EditAligner, line_kinds

METHOD = '''    def _split(self, text):
        """Split the text into chunks."""
        if self.break_on_hyphens is True:
            chunks = self.wordsep_re.split(text)
        else:
            chunks = self.wordsep_simple_re.split(text)
        chunks = [c for c in chunks if c]
        return chunks
'''
FUNCTION = '''def _split(wrapper, text):
    """Split the text into chunks."""
    if wrapper.break_on_hyphens is True:
        chunks = wrapper.wordsep_re.split(text)
    else:
        chunks = wrapper.wordsep_simple_re.split(text)
    chunks = [c for c in chunks if c]
    return chunks
'''


def follow(source: str, answer: str, max_chars: int = 200) -> tuple[int, list[int]]:
    """Write ``answer`` character by character as far as the drafts carry it: (characters written
    by the drafts, start offsets of the lines whose first character no draft predicted)."""
    aligner, at, drafted, missed = EditAligner(source), 0, 0, []
    while at < len(answer):
        draft = aligner.draft(answer[:at], max_chars) or ""
        n = 0
        while n < len(draft) and at + n < len(answer) and draft[n] == answer[at + n]:
            n += 1
        if n == 0 and (at == 0 or answer[at - 1] == "\n"):
            missed.append(at)
        drafted += n
        at += max(n, 1)
    return drafted, missed


def lines_missed(answer: str, missed: list[int]) -> list[str]:
    return [answer[m:].split("\n", 1)[0] for m in missed]


def test_a_method_made_a_function_is_drafted_through_the_dedent_and_the_rename():
    """Every line 4 spaces less and ``self`` renamed: after the first line, whose new parameter name
    nothing could predict, every line start is drafted right and nearly every character is drafted."""
    drafted, missed = follow(METHOD, FUNCTION)
    assert lines_missed(FUNCTION, missed) == ["def _split(wrapper, text):"]
    assert drafted >= len(FUNCTION) - 20


def test_the_delta_and_the_renames_are_learned_from_the_lines_written():
    aligner = EditAligner(METHOD)
    assert aligner.draft(FUNCTION.split("\n    if")[0] + "\n", 40).startswith("    if wrapper.break_on_hyphens")
    assert (aligner.delta, aligner.renames, aligner.pointer) == (-4, {"self": "wrapper"}, 1)


def test_a_rename_is_read_from_the_line_being_written():
    """The first line renames ``self``: once its parameter is written, the rest of the line and the
    lines after it are drafted with the new name before the line is complete."""
    aligner = EditAligner(METHOD)
    draft = aligner.draft("def _split(wrapper,", 200)
    assert draft.startswith(' text):\n    """Split') and "wrapper.break_on_hyphens" in draft


def test_a_re_indentation_the_other_way_and_a_moved_block():
    """Code moved into a ``try`` (every line 4 more) and a block moved before the line it followed."""
    source = "x = load()\ny = x + 1\nprint(y)\nsave(y)\n"
    answer = "try:\n    x = load()\n    save(x + 1)\n    y = x + 1\n    print(y)\nexcept OSError:\n    pass\n"
    aligner = EditAligner(source)
    assert aligner.draft("try:\n    x = load()\n", 100) == "    y = x + 1\n    print(y)\n    save(y)\n"
    # the model inserts a line: the next line start waits for its first characters, then line 2 goes on
    assert aligner.draft("try:\n    x = load()\n    save(x + 1)\n", 100) is None
    assert aligner.draft("try:\n    x = load()\n    save(x + 1)\n    y =", 100).startswith(" x + 1\n    print(y)")
    assert follow(source, answer)[0] >= 20


def test_inserted_and_deleted_lines_re_anchor_on_content():
    source = "a = 1\nb = 2\nc = 3\nd = 4\ne = 5\n"
    inserted = EditAligner(source)
    assert inserted.draft("a = 1\nb = 2\nlog(b)\n", 100) is None  # after an inserted line: wait for evidence
    assert inserted.draft("a = 1\nb = 2\nlog(b)\nc =", 100) == " 3\nd = 4\ne = 5\n"  # the place stayed
    deleted = EditAligner(source)
    assert deleted.draft("a = 1\nb = 2\nd = 4\n", 100) == "e = 5\n"  # the place jumps over the deletion
    partial = EditAligner(source.replace("d = ", "delta = "))
    assert partial.draft("a = 1\nd", 100) is None  # one character proves nothing
    assert partial.draft("a = 1\ndelta", 100) == " = 4\ne = 5\n"  # re-anchored inside the line being written


def test_an_edit_inside_a_line_continues_after_it():
    source = "result = compute(alpha, beta, gamma)\nreturn result\n"
    aligner = EditAligner(source)
    assert aligner.draft("result = compute(alpha, BETA, gamma", 100) == ")\nreturn result\n"


def test_short_or_repeated_lines_re_anchor_only_near_the_place():
    """``else:`` written where the source has one far ahead proves nothing: the place stays."""
    source = "\n".join([f"x{i} = {i}" for i in range(20)] + ["else:", "y = 0"]) + "\n"
    aligner = EditAligner(source)
    aligner.draft("x0 = 0\nx1 = 1\nelse:\n", 100)
    assert aligner.pointer == 1


def test_a_rename_the_output_does_not_make_is_forgotten():
    source = "def f(self):\n    self.a = 1\n    self.b = 2\n    self.c = 3\n"
    aligner = EditAligner(source)
    aligner.draft("def f(obj):\n", 100)
    assert aligner.renames == {"self": "obj"}
    assert aligner.draft("def f(obj):\n    self.a = 1\n", 100) == "    self.b = 2\n    self.c = 3\n"
    assert aligner.renames == {}


def test_nothing_is_drafted_before_the_source_shows_up():
    """A chat answer's preamble: line starts draft nothing until a line's first characters match."""
    aligner = EditAligner(METHOD)
    assert aligner.draft("", 100) is None
    assert aligner.draft("Here is the function:\n\n```python\n", 100) is None
    assert aligner.draft("Here is the function:\n\n```python\nde", 100).startswith("f _split(self, text):")


def test_continuation_and_docstring_lines_are_marked():
    assert line_kinds(["x = f(a,", "      b)", 'y = "("', "z = [1,  # (", "  2]", "w"]) == [
        BLOCK, CONTINUED, BLOCK, BLOCK, CONTINUED, BLOCK]
    lines = ['    """Doc (', "    more ' text", '    """', "    f('''x''', [", "      y])", "s = '''a", "(b", "'''"]
    assert line_kinds(lines) == [BLOCK, IN_STRING, IN_STRING, BLOCK, CONTINUED, BLOCK, IN_STRING, IN_STRING]


def test_hostile_text_is_bounded():
    """A huge written line is not compared (nothing to align), a binary-looking source is just text."""
    aligner = EditAligner("\x00\x01 weird\n" * 50)
    assert aligner.draft("z" * 100_000 + "\n", 100) is None
    assert aligner.draft("\x00\x01 we", 30).startswith("ird\n")


def test_the_renamed_index_follows_every_rename_change():
    """Renames learned, kept against a line that does not make them, forgotten: the index of renamed
    lines (updated only where a changed name occurs) equals one built from scratch."""
    source = "def f(self, a):\n    self.a = a\n    b = self.a + a\n    return b  # self\n    self.c = b\n"
    aligner = EditAligner(source)
    written = "def f(obj, x):\n    obj.a = x\n    b = obj.a + x\n    return b  # self\n    obj.c = b\n"
    aligner.draft(written, 100)
    assert aligner.renames == {"self": "obj", "a": "x"}  # "obj.a": the attribute too (one name, one rename)
    fresh: dict[str, list[int]] = {}
    for j, c in enumerate(aligner.content):
        fresh.setdefault(aligner.rename(c), []).append(j)
    assert aligner._renamed_index() == fresh


def test_long_lines_and_many_renames_stay_cheap():
    """A 3,000-line source, an answer renaming something new on every line, and lines of 2,000
    characters: every draft is bounded work (pieces compared at most MAX_PIECES, the index updated
    only where a changed name occurs)."""
    import time

    source = "".join(f"    self.v{i} = foo(self.a{i}, bar)\n" for i in range(3000)) + "x = " + "a, " * 700 + "\n"
    aligner = EditAligner(source)
    answer = "".join(f"z.v{i * 7} = foo(z.a{i}, baz)\n" for i in range(40)) + "y = " + "b, " * 700 + "\n"
    start = time.process_time()
    for at in range(0, len(answer), 9):
        aligner.draft(answer[:at], 128)
    assert time.process_time() - start < 20  # about 1 s on one loaded core; quadratic work would take minutes


TIMED = '''    def print_exc(self, file=None):
        """Print a traceback.

            t.print_exc()

        The optional file argument.
        """
        if self.src is not None:
            cache[name] = (len(self.src),
                           None,
                           name)
        traceback.print_exc(file=file)
'''


def test_docstring_and_continuation_lines_keep_their_own_indentation():
    """The answer dedents the code by 4 but keeps the docstring's and a bracket's columns: each kind's
    offset is learned from its last line written and applies to the next ones of its kind."""
    aligner = EditAligner(TIMED)
    written = 'def print_exc(obj, file=None):\n    """Print a traceback.\n\n            t.print_exc()\n'
    assert aligner.draft(written, 200).startswith('\n        The optional file argument.\n        """\n    if obj.src')
    written += '\n        The optional file argument.\n        """\n    if obj.src is not None:\n'
    written += "        cache[name] = (len(obj.src),\n                           None,\n"
    assert aligner.draft(written, 200) == "                           name)\n    traceback.print_exc(file=file)\n"


def test_a_line_written_further_in_is_drafted_at_that_indentation():
    """Indentation wider than the next line's (a token of spaces; tokenizers leave its last space to
    the word after it): that line is drafted one space further in, and so are the lines after it."""
    aligner = EditAligner("if x:\n    a = 1\n    b = 2\nc = 3\n")
    assert aligner.draft("if x:\n       ", 100) == " a = 1\n        b = 2\n    c = 3\n"  # the whole block
    assert aligner.draft("if x:\n", 100) == "    a = 1\n    b = 2\nc = 3\n"  # not further in: as before
