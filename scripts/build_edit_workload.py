"""Rebuild ``src/verispec/bench/data/edit.jsonl`` (``verispec bench -c edit``) from pallets/click's git
history, so anyone can check where every item came from (issue 34, section 3).

Each item is a real function and the change a real commit made to it: the function as it was before
the commit, the commit's message as the instruction, and the function after the commit as the
reference answer. The original code is also the item's ``prediction`` (OpenAI Predicted Outputs: an
editor sends the code it expects the answer to repeat). Only the prompt's two framing sentences are
ours; code and instruction are the project's own.

A commit is kept when, walking ``git log --no-merges`` from ``--rev`` newest first, it changes one
Python file of the package, exactly one function or method of that file changes (by its syntax tree:
formatting-only changes are skipped), none is added or removed, the function has 6 to 60 lines, the
diff touches at most 20 lines, and the subject has 4 words or more and does not name a style-only tool
(black, ruff, ...). A function changed by several commits appears once, with its newest change.

    git clone https://github.com/pallets/click /tmp/click
    python scripts/build_edit_workload.py --repo /tmp/click            # the pinned --rev below
    python scripts/build_edit_workload.py --repo /tmp/click --out /tmp/edit.jsonl --limit 5

Material: pallets/click, BSD-3-Clause (Copyright 2014 Pallets); each item names its commit.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import re
import subprocess
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "src" / "verispec" / "bench" / "data" / "edit.jsonl"
REV = "2c8cd3ac958a7eb316d67f2d316c27086c4c0369"  # pallets/click main, 2026-08-20
PACKAGE_DIRS = ("src/click/", "click/")  # the package moved under src/ in 2020
STYLE_ONLY = re.compile(r"\b(black|ruff|flake8|isort|pyupgrade|pre-commit|reformat|format(ting)?|typo|whitespace|"
                        r"E\d{3}|lint)\b", re.IGNORECASE)
TRAILER = re.compile(r"^(Co-authored-by|Signed-off-by|Reviewed-by|Fixes|Closes):", re.IGNORECASE | re.MULTILINE)
PROMPT = ("Apply this change to the function below, from {path} in the click library. The change, as its "
          "commit describes it:\n\n{instruction}\n\n```python\n{code}\n```\n\n"
          "Reply with the complete updated function only, in one Python code block.")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", str(repo), *args], check=True, capture_output=True,
                          text=True, errors="replace").stdout


def git_dir(path: Path) -> Path:
    """A checkout's .git or a bare repository."""
    return path / ".git" if (path / ".git").exists() else path


def functions(source: str) -> dict[str, tuple[str, str]]:
    """Qualified name -> (dedented source with decorators, ast dump) of every function and method."""
    tree = ast.parse(source)
    lines = source.splitlines()
    out: dict[str, tuple[str, str]] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                text = textwrap.dedent("\n".join(lines[first - 1: child.end_lineno]))
                out.setdefault(name, (text, ast.dump(child)))  # the first of a redefined name (overloads)
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")

    visit(tree, "")
    return out


def instruction(message: str) -> str:
    """The commit message without trailers, at most 800 characters."""
    text = TRAILER.split(message)[0].strip()
    return text if len(text) <= 800 else text[:800].rsplit(" ", 1)[0] + " ..."


def item(repo: Path, sha: str) -> dict | None:
    files = [f for f in git(repo, "diff-tree", "--no-commit-id", "-r", "--name-only", sha).split() if f.endswith(".py")]
    src = [f for f in files if f.startswith(PACKAGE_DIRS)]
    if len(src) != 1:
        return None
    path, message = src[0], git(repo, "log", "-1", "--format=%B", sha)
    subject = message.splitlines()[0] if message else ""
    if STYLE_ONLY.search(subject) or len(subject.split()) < 4:  # "Typing", "Fix docs": no instruction
        return None
    try:
        before = functions(git(repo, "show", f"{sha}^:{path}"))
        after = functions(git(repo, "show", f"{sha}:{path}"))
    except (subprocess.CalledProcessError, SyntaxError):  # a new file, Python 2 syntax
        return None
    if set(before) != set(after):
        return None
    changed = [n for n in before if before[n][1] != after[n][1]]
    if len(changed) != 1 or any(changed[0].startswith(n + ".") or n.startswith(changed[0] + ".") for n in changed):
        return None
    name = changed[0]
    old, new = before[name][0], after[name][0]
    diff = [ln for ln in difflib.unified_diff(old.splitlines(), new.splitlines(), lineterm="", n=0)
            if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    if not 6 <= len(old.splitlines()) <= 60 or not 1 <= len(diff) <= 20:
        return None
    text = instruction(message)
    return {"question_id": f"click-{sha[:10]}-{name}", "category": "edit",
            "turns": [PROMPT.format(path=path, instruction=text, code=old)], "prediction": old, "reference": new,
            "source": {"repository": "https://github.com/pallets/click", "license": "BSD-3-Clause",
                       "commit": sha, "path": path, "function": name}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", type=Path, required=True, help="a clone of https://github.com/pallets/click")
    ap.add_argument("--rev", default=REV)
    ap.add_argument("--limit", type=int, default=30)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    repo = git_dir(args.repo)
    shas = git(repo, "log", "--no-merges", "--format=%H", args.rev, "--", *PACKAGE_DIRS).split()
    items, seen = [], set()
    for sha in shas:
        it = item(repo, sha)
        where = it and (it["source"]["path"], it["source"]["function"])
        if it and where not in seen:  # a function changed several times: its newest change only
            seen.add(where)
            items.append(it)
        if len(items) >= args.limit:
            break
    args.out.write_text("".join(json.dumps(it, ensure_ascii=False) + "\n" for it in items))
    print(f"{len(items)} items from {len(shas)} commits -> {args.out}")


if __name__ == "__main__":
    main()
