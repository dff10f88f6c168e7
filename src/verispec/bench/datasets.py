"""Benchmark prompts: Spec-Bench / MT-Bench JSONL, our multi-turn agentic workload, and the
workloads built from real material (issue 34): code edits, agent-session replays, fill-in-the-middle.

Spec-Bench and ``agentic`` use Spec-Bench's ``question.jsonl`` format, one object per line:
``question_id``, ``category``, ``turns`` (the user turns of one conversation, in order); the
harness runs every turn in order with the method's own earlier answers in context. The workloads
of ``bench/data`` rebuilt by ``scripts/build_*_workload.py`` add fields:

* ``edit`` (``edit.jsonl``): one turn (a real function and the instruction its commit's message
  gives) and ``prediction``, the original function (sent by methods with ``prediction=yes``);
* ``agent`` (``agent.jsonl``): ``messages``, a recorded coding-agent session (system prompt, task,
  answers, tool outputs); every assistant turn is regenerated from the recorded history before it;
* ``fim`` (``fim.jsonl``): ``prefix`` and ``suffix`` around a cut-out function body, sent as the
  model's fill-in-the-middle prompt (``verispec.fim``).

    load_prompts(None, ("rag", "agentic"), 3)  # 3 Spec-Bench rag prompts + 3 agentic sessions
    load_prompts(None, ("edit", "agent", "fim"), 5)
    load_data_file("my_edits.jsonl")  # a user's rows of any of these formats (verispec bench --data)
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
EDIT, AGENT, FIM = "edit", "agent", "fim"  # built from real material: bench/data/<name>.jsonl
REAL_WORKLOADS = (EDIT, AGENT, FIM)
WORKLOADS = (AGENTIC, *REAL_WORKLOADS)
ALL_GROUPS = GROUPS + WORKLOADS
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class BenchPrompt:
    """One conversation. ``turns``: user turns answered in order with the method's own answers,
    unless ``messages`` (a recorded session: each assistant turn is regenerated from the recorded
    history before it) or ``fim`` (prefix, suffix: one fill-in-the-middle completion) is set."""

    question_id: int | str
    category: str  # one of ALL_GROUPS
    turns: tuple[str, ...]
    prediction: str | None = None  # Predicted Outputs: text the answer is expected to repeat
    messages: tuple[dict[str, str], ...] | None = None
    fim: tuple[str, str] | None = None

    @property
    def replayed(self) -> tuple[int, ...]:
        """Indices of the recorded assistant messages a replay regenerates."""
        return tuple(i for i, m in enumerate(self.messages or ()) if m["role"] == "assistant")

    @property
    def num_turns(self) -> int:
        return len(self.replayed) if self.messages is not None else len(self.turns)


def group_of(category: str) -> str:
    if category in MT_BENCH_CATEGORIES:
        return "mt_bench"
    return AGENTIC if category in AGENTIC_CATEGORIES else category


def agentic_path() -> Path:
    """The shipped agentic workload file."""
    return workload_path(AGENTIC)


def workload_path(name: str) -> Path:
    """A shipped workload file (bench/data/<name>.jsonl)."""
    return Path(str(resources.files("verispec.bench") / "data" / f"{name}.jsonl"))


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


def _text(row: dict, key: str, where: str) -> str:
    value = row.get(key)
    if not isinstance(value, str):
        raise ValueError(f"{where}: {key} must be a string")
    return value


def _real_prompt(row: dict, where: str) -> BenchPrompt:
    """One row of a workload built from real material, checked (ValueError naming file and line)."""
    qid, kind = row.get("question_id"), row.get("category")
    if not isinstance(qid, str) or kind not in REAL_WORKLOADS:
        raise ValueError(f"{where}: expected a string question_id and a category in {', '.join(REAL_WORKLOADS)}")
    if kind == FIM:
        return BenchPrompt(qid, kind, ("",), fim=(_text(row, "prefix", where), _text(row, "suffix", where)))
    if kind == AGENT:
        msgs = row.get("messages")
        ok = isinstance(msgs, list) and all(
            isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) and m["content"].strip()
            for m in msgs)
        if not ok or not any(m["role"] == "assistant" for m in msgs[1:]):
            raise ValueError(f"{where}: messages must be system/user/assistant messages with non-empty contents, "
                             "an assistant turn after the first")
        return BenchPrompt(qid, kind, (), messages=tuple({"role": m["role"], "content": m["content"]} for m in msgs))
    turns = row.get("turns")
    if not isinstance(turns, list) or len(turns) != 1 or not isinstance(turns[0], str) or not turns[0].strip():
        raise ValueError(f"{where}: an edit has one non-empty turn")
    return BenchPrompt(qid, kind, (turns[0],), prediction=_text(row, "prediction", where))


def load_workload(name: str, limit: int | None = None) -> list[BenchPrompt]:
    """A shipped workload built from real material (``edit``, ``agent``, ``fim``), in file order."""
    from ..paths import parse_json_line, read_text_file

    path, out = workload_path(name), []
    for number, line in enumerate(read_text_file(path, "benchmark file").splitlines(), 1):
        if line.strip() and (limit is None or len(out) < limit):
            out.append(_real_prompt(parse_json_line(line, f"{path} line {number}"), f"{path} line {number}"))
    return out


def load_data_file(path: str | Path, categories: tuple[str, ...] = (), limit: int | None = None) -> list[BenchPrompt]:
    """The prompts of a user's file (``verispec bench --data``), in file order: Spec-Bench rows
    (``question_id``, ``category``, ``turns``) and rows of the real-material workloads in the shipped
    format (``category`` edit, agent or fim, with their fields: the module docstring), at most
    ``limit`` per group; ``categories`` selects groups (empty: every group the file has). Every
    row is checked, selected or not (ValueError naming file and line; question_ids are unique)."""
    from ..paths import parse_json_line, read_text_file

    check_groups(categories)
    path, out, seen, counts = Path(path), [], {}, {}
    for number, line in enumerate(read_text_file(path, "benchmark file").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        row = parse_json_line(line, where)
        if isinstance(row, dict) and row.get("category") in REAL_WORKLOADS:
            prompt = _real_prompt(row, where)
        else:
            row = _row(path, number, line)
            prompt = BenchPrompt(row["question_id"], group_of(row["category"]), tuple(row["turns"]))
            if prompt.category not in ALL_GROUPS:
                raise ValueError(f"{where}: unknown category {row['category']!r:.40}")
        if prompt.question_id in seen:  # records are keyed by it: a duplicate would mix two conversations
            raise ValueError(f"{where}: question_id {prompt.question_id!r} repeats line {seen[prompt.question_id]}")
        seen[prompt.question_id] = number
        group = prompt.category
        if (categories and group not in categories) or (limit is not None and counts.get(group, 0) >= limit):
            continue
        counts[group] = counts.get(group, 0) + 1
        out.append(prompt)
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
    for name in REAL_WORKLOADS:
        if name in categories:
            out += load_workload(name, limit_per_category)
    return out
