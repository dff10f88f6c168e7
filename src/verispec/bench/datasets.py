"""Spec-Bench / MT-Bench JSONL prompts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..models.loading import _find_shared_file

SPEC_BENCH = "data/spec_bench/question.jsonl"
# Spec-Bench's six task groups; mt_bench is its eight MT-Bench categories.
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
GROUPS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


@dataclass(frozen=True)
class BenchPrompt:
    question_id: int | str
    category: str  # one of GROUPS
    turns: tuple[str, ...]


def group_of(category: str) -> str:
    return "mt_bench" if category in MT_BENCH_CATEGORIES else category


def load_spec_bench(path: str | Path | None = None, categories: tuple[str, ...] = GROUPS,
                    limit_per_category: int | None = None) -> list[BenchPrompt]:
    """Prompts in file order, grouped by Spec-Bench group, at most ``limit`` per group."""
    path = Path(path) if path else _find_shared_file(SPEC_BENCH)
    if not path.is_file():
        raise ValueError(f"benchmark file {path} not found (expected Spec-Bench question.jsonl)")
    unknown = set(categories) - set(GROUPS)
    if unknown:
        raise ValueError(f"unknown categories {sorted(unknown)}; choose from {', '.join(GROUPS)}")
    out, counts = [], {c: 0 for c in categories}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        group = group_of(row["category"])
        if group not in counts or (limit_per_category is not None and counts[group] >= limit_per_category):
            continue
        counts[group] += 1
        out.append(BenchPrompt(row["question_id"], group, tuple(row["turns"])))
    return out
