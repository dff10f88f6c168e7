"""Benchmark prompts: Spec-Bench / MT-Bench JSONL, and our own multi-turn agentic workload.

Both use Spec-Bench's ``question.jsonl`` format, one object per line: ``question_id``,
``category``, ``turns`` (the user turns of one conversation, in order). The harness runs
every turn of a conversation in order with the method's own earlier answers in context.

    load_prompts(None, ("rag", "agentic"), 3)  # 3 Spec-Bench rag prompts + 3 agentic sessions
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

SPEC_BENCH = "spec_bench/question.jsonl"  # shipped with verispec (verispec.data), Apache-2.0
# Spec-Bench's six task groups; mt_bench is its eight MT-Bench categories.
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
GROUPS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
# Our repetitive, agentic workload (bench/data/agentic.jsonl, shipped with the package; not
# derived from Spec-Bench): multi-turn sessions whose turns revise the previous answer
# (code edit loops, "rewrite it with X changed") or are JSON tool-call steps of one agent
# task with a repeated structure. Its categories form the group ``agentic``.
AGENTIC = "agentic"
AGENTIC_CATEGORIES = ("code_revision", "rewrite", "tool_calls")
WORKLOADS = (AGENTIC,)
ALL_GROUPS = GROUPS + WORKLOADS


@dataclass(frozen=True)
class BenchPrompt:
    question_id: int | str
    category: str  # one of ALL_GROUPS
    turns: tuple[str, ...]


def group_of(category: str) -> str:
    if category in MT_BENCH_CATEGORIES:
        return "mt_bench"
    return AGENTIC if category in AGENTIC_CATEGORIES else category


def agentic_path() -> Path:
    """The shipped agentic workload file."""
    return Path(str(resources.files("verispec.bench") / "data" / "agentic.jsonl"))


def _row(path: Path, number: int, line: str) -> dict:
    """One question.jsonl row, checked: an object with ``question_id``, a ``category``
    string and ``turns``, a non-empty list of strings (ValueError naming file and line)."""
    from ..paths import parse_json_line

    row = parse_json_line(line, f"{path} line {number}")
    if not isinstance(row, dict) or "question_id" not in row or not isinstance(row.get("category"), str):
        raise ValueError(f"{path} line {number}: expected an object with question_id, category and turns")
    qid = row["question_id"]
    if isinstance(qid, bool) or not isinstance(qid, (int, str)):
        raise ValueError(f"{path} line {number}: question_id must be an integer or a string, got {qid!r:.40}")
    turns = row.get("turns")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise ValueError(f"{path} line {number}: turns must be a non-empty list of non-empty strings")
    return row


def _read(path: Path, counts: dict[str, int], limit: int | None) -> list[BenchPrompt]:
    from ..paths import read_text_file

    out, seen = [], {}
    for number, line in enumerate(read_text_file(path, "benchmark file").splitlines(), 1):
        if not line.strip():
            continue
        row = _row(path, number, line)
        if row["question_id"] in seen:  # records are keyed by it: a duplicate would mix two conversations
            raise ValueError(f"{path} line {number}: question_id {row['question_id']!r} repeats line "
                             f"{seen[row['question_id']]}")
        seen[row["question_id"]] = number
        group = group_of(row["category"])
        if group not in counts or (limit is not None and counts[group] >= limit):
            continue
        counts[group] += 1
        out.append(BenchPrompt(row["question_id"], group, tuple(row["turns"])))
    return out


def check_groups(categories: tuple[str, ...]) -> None:
    unknown = set(categories) - set(ALL_GROUPS)
    if unknown:
        raise ValueError(f"unknown categories {sorted(unknown)}; choose from {', '.join(ALL_GROUPS)}")


def load_spec_bench(path: str | Path | None = None, categories: tuple[str, ...] = GROUPS,
                    limit_per_category: int | None = None) -> list[BenchPrompt]:
    """Spec-Bench prompts in file order, grouped by Spec-Bench group, at most ``limit`` per group
    (``path``: a question.jsonl; default: the one shipped with verispec)."""
    from ..data import data_file

    path = Path(path) if path else data_file(SPEC_BENCH)
    if not path.is_file():
        raise ValueError(f"benchmark file {path} not found (expected Spec-Bench question.jsonl)")
    unknown = set(categories) - set(GROUPS)
    if unknown:
        raise ValueError(f"unknown Spec-Bench groups {sorted(unknown)}; choose from {', '.join(GROUPS)}")
    return _read(path, {c: 0 for c in categories}, limit_per_category)


def load_spec_bench_category(category: str, limit: int | None = None) -> list[BenchPrompt]:
    """The shipped Spec-Bench conversations of one original category (e.g. ``coding``, one of
    MT_BENCH_CATEGORIES), all turns, in file order, at most ``limit``."""
    from ..data import data_file
    from ..paths import read_text_file

    path, out = data_file(SPEC_BENCH), []
    for number, line in enumerate(read_text_file(path, "benchmark file").splitlines(), 1):
        if line.strip() and (limit is None or len(out) < limit):
            row = _row(path, number, line)
            if row["category"] == category:
                out.append(BenchPrompt(row["question_id"], category, tuple(row["turns"])))
    return out


def load_agentic(limit: int | None = None) -> list[BenchPrompt]:
    """Our agentic sessions in file order (the categories interleave, so any prefix mixes them)."""
    return _read(agentic_path(), {AGENTIC: 0}, limit)


def load_prompts(path: str | Path | None = None, categories: tuple[str, ...] = GROUPS,
                 limit_per_category: int | None = None) -> list[BenchPrompt]:
    """Spec-Bench groups from ``path`` (read only when one is selected), then the selected
    workloads of our own, at most ``limit`` prompts per group."""
    check_groups(categories)
    spec = tuple(c for c in categories if c in GROUPS)
    out = load_spec_bench(path, spec, limit_per_category) if spec else []
    if AGENTIC in categories:
        out += load_agentic(limit_per_category)
    return out
