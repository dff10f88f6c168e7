"""``verispec bench --data FILE``: a user's prompts in any of the shipped formats (Spec-Bench rows and
the edit, agent and fim workloads' rows) load in file order, grouped and limited per group; a bad
file is one line and exit 2 before any model loads; the shipped refactoring workload (stdlib methods
made top-level functions) loads and its script rebuilds it from this interpreter's stdlib."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import pytest
from serving import one_line_exit_2

from verispec.bench.datasets import AGENT, EDIT, FIM, load_data_file, workload_path

REPO = Path(__file__).resolve().parents[2]
ROWS = [
    {"question_id": 1, "category": "qa", "turns": ["What is a stack?"]},
    {"question_id": "e1", "category": "edit", "turns": ["Rename x.\n\n```python\nx = 1\n```"], "prediction": "x = 1"},
    {"question_id": "f1", "category": "fim", "prefix": "def f():\n    ", "suffix": "\n"},
    {"question_id": "a1", "category": "agent", "messages": [{"role": "system", "content": "You fix bugs."},
                                                            {"role": "user", "content": "Fix it."},
                                                            {"role": "assistant", "content": "Done."}]},
    {"question_id": "e2", "category": "edit", "turns": ["Again."], "prediction": "y = 2"},
]


def write(tmp_path: Path, rows: list, extra: str = "") -> Path:
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + extra)
    return path


def test_every_format_loads_in_file_order(tmp_path):
    path = write(tmp_path, ROWS)
    prompts = load_data_file(path)
    assert [(p.question_id, p.category) for p in prompts] == [(1, "qa"), ("e1", EDIT), ("f1", FIM), ("a1", AGENT),
                                                              ("e2", EDIT)]
    assert prompts[1].prediction == "x = 1" and prompts[2].fim == ("def f():\n    ", "\n")
    assert prompts[3].num_turns == 1
    assert [p.question_id for p in load_data_file(path, (EDIT,), 1)] == ["e1"]
    assert [p.question_id for p in load_data_file(path, (EDIT, "qa"))] == [1, "e1", "e2"]


@pytest.mark.parametrize("row,needle", [
    ({"question_id": "e", "category": "edit", "turns": ["Do it."]}, "prediction"),
    ({"question_id": "e", "category": "edit", "turns": ["a", "b"], "prediction": "x"}, "one non-empty turn"),
    ({"question_id": 7, "category": "edit", "turns": ["a"], "prediction": "x"}, "string question_id"),
    ({"question_id": "f", "category": "fim", "prefix": "a"}, "suffix"),
    ({"question_id": "a", "category": "agent", "messages": [{"role": "tool", "content": "x"}]}, "messages"),
    ({"question_id": "p", "category": "poetry", "turns": ["a"]}, "unknown category"),
    ({"question_id": 1, "category": "qa", "turns": ["again"]}, "repeats"),
])
def test_bad_rows_are_refused_naming_the_line(tmp_path, row, needle):
    path = write(tmp_path, [ROWS[0], row])
    with pytest.raises(ValueError, match=needle):
        load_data_file(path, (EDIT,))  # rows of groups not selected are checked too
    one_line_exit_2("bench", "--model", "stories260k", "--data", str(path), "--output-dir", str(tmp_path / "out"),
                    needle="line 2")


def test_a_file_that_is_not_text_or_json_is_one_line(tmp_path):
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    one_line_exit_2("bench", "--model", "stories260k", "--data", str(binary), "--output-dir", str(tmp_path / "o"),
                    needle="UTF-8")
    deep = write(tmp_path, [], "[" * 100_000 + "\n")
    one_line_exit_2("bench", "--model", "stories260k", "--data", str(deep), "--output-dir", str(tmp_path / "o"),
                    needle="line 1")


def test_the_refactoring_workload_ships_and_rebuilds():
    path = workload_path("refactor_moves")
    prompts = load_data_file(path)
    assert 10 <= len(prompts) <= 20 and all(p.category == EDIT for p in prompts)
    for p in prompts:  # the method, indented in its class, is the prediction and is in the prompt
        assert p.prediction.startswith("    def ") and p.prediction in p.turns[0] and "self" in p.prediction
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert all(r["source"]["license"] == "PSF-2.0" and r["source"]["path"].startswith("Lib/") for r in rows)
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from build_refactor_workload import build_rows, snake_case
    finally:
        sys.path.pop(0)
    assert snake_case("TextWrapper") == "text_wrapper" and snake_case("HTTPCookie") == "http_cookie"
    if rows[0]["source"]["version"] == platform.python_version():  # the stdlib it was built from
        assert build_rows() == rows


def test_the_held_out_refactorings_ship_with_their_provenance_and_the_script_reads_a_clone(tmp_path):
    """refactor_heldout.jsonl: methods of requests and httpx, each naming repository, commit and path;
    ``build_git_rows`` reads a clone at a commit, the first qualifying method of each file."""
    import re
    import subprocess

    rows = [json.loads(line) for line in workload_path("refactor_heldout").read_text().splitlines()]
    assert len(rows) >= 10 and {r["source"]["repository"] for r in rows} == {
        "https://github.com/psf/requests", "https://github.com/encode/httpx"}
    for r in rows:
        assert re.fullmatch(r"[0-9a-f]{40}", r["source"]["commit"]) and r["source"]["path"].endswith(".py")
        assert r["prediction"].startswith("    def ") and r["prediction"] in r["turns"][0]
    assert len(load_data_file(workload_path("refactor_heldout"))) == len(rows)

    body = "".join(f"        self.x{i} = self.y + {i}\n" for i in range(12))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(f"class Point:\n    def move(self, d):\n{body}")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_mod.py").write_text(f"class T:\n    def move(self, d):\n{body}")
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "m"], check=True)
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from build_refactor_workload import build_git_rows
    finally:
        sys.path.pop(0)
    (row,) = build_git_rows(tmp_path, "https://example.org/pt", "MIT")  # tests/ skipped
    commit = subprocess.run(git + ["rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    assert row["source"] == {"repository": "https://example.org/pt", "license": "MIT", "commit": commit,
                             "path": "pkg/mod.py", "function": "Point.move"}
    assert "named `point` instead of `self`" in row["turns"][0] and row["prediction"].startswith("    def move(self")
