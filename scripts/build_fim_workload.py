"""Rebuild ``src/verispec/bench/data/fim.jsonl`` (``verispec bench -c fim``) from the Python standard
library's source, so anyone can check where every item came from (issue 34, section 3).

Fill-in-the-middle as an editor's autocomplete asks for it: the code before the cursor (``prefix``) and
after it (``suffix``), the model writes what goes between. Each item cuts one real function body out of
a stdlib module: the cursor stands right after the function's signature (and docstring, if any), the
middle is the rest of the body (5 to 25 lines), the prefix is the 60 lines before the cursor and the
suffix the 30 lines after the body (an editor's window). The bench formats them with the model's FIM
tokens (Qwen2.5-Coder: ``<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>``) and sends them
as a plain completion, as ``/v1/completions`` with ``suffix`` does.

    python scripts/build_fim_workload.py                    # this interpreter's stdlib (3.11.7 here)
    python scripts/build_fim_workload.py --out /tmp/fim.jsonl --per-module 1

Material: CPython's Lib/ (PSF-2.0); each item names its file, function and Python version.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import platform
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "src" / "verispec" / "bench" / "data" / "fim.jsonl"
MODULES = ("textwrap", "shlex", "fnmatch", "difflib", "calendar", "ipaddress", "argparse", "configparser",
           "statistics", "gettext", "tarfile", "zipfile", "csv", "pprint", "smtplib")
PREFIX_LINES, SUFFIX_LINES = 60, 30


def cuts(source: str, per_module: int) -> list[tuple[str, int, int]]:
    """(qualified name, first body line, end line) of the first functions whose body after the signature
    and docstring has 5 to 25 lines (1-based, inclusive), in file order."""
    out: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if len(out) >= per_module:
                return
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = child.body
                if (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                        and isinstance(body[0].value.value, str)):
                    body = body[1:]  # the docstring stays in the prefix: an editor's cursor is below it
                if body and 5 <= child.end_lineno - body[0].lineno + 1 <= 25:
                    out.append((prefix + child.name, body[0].lineno, child.end_lineno))
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")

    visit(ast.parse(source), "")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-module", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    version, rows = platform.python_version(), []
    for name in MODULES:
        path = Path(importlib.import_module(name).__file__)
        source = path.read_text()
        lines = source.splitlines(keepends=True)
        for func, first, last in cuts(source, args.per_module):
            indent = lines[first - 1][: len(lines[first - 1]) - len(lines[first - 1].lstrip())]
            prefix = "".join(lines[max(0, first - 1 - PREFIX_LINES): first - 1]) + indent  # cursor at the body's indent
            middle = "".join(lines[first - 1: last])[len(indent):]
            suffix = "".join(lines[last: last + SUFFIX_LINES])
            rows.append({"question_id": f"fim-{name}-{func}", "category": "fim", "prefix": prefix, "suffix": suffix,
                         "reference": middle,
                         "source": {"repository": "https://github.com/python/cpython", "license": "PSF-2.0",
                                    "version": version, "path": f"Lib/{path.name}", "function": func}})
    args.out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"{len(rows)} items -> {args.out}")


if __name__ == "__main__":
    main()
