"""Rebuild ``src/verispec/bench/data/refactor_moves.jsonl`` (``verispec bench --data``) from the Python
standard library's source, so anyone can check where every item came from (issue 46, section 4).

Code that moves out of a class: each item is a real method of a real stdlib class, and the edit asked
is to make it a top-level function of the same name whose first parameter, the instance, is named
after the class (``TextWrapper`` -> ``text_wrapper``) instead of ``self``. The answer is the method
dedented by 4 spaces with ``self`` renamed: every line's indentation and every ``self`` differ from
the original, which the item sends as its ``prediction`` (OpenAI Predicted Outputs: an editor sends
the code it expects the answer to repeat). There is no reference answer: the benchmark measures speed,
and a greedy answer is the target's own (compared with its plain decoding).

A method is kept when it is a plain ``def`` of a top-level class (no decorator, not a dunder), has 12
to 40 lines, uses ``self`` at least 3 times and does not already name the new parameter; the first
such method of each module in ``MODULES`` (file order), one per module. Only the prompt's framing
sentences are ours; the code is CPython's.

    python scripts/build_refactor_workload.py                       # this interpreter's stdlib (3.11.7)
    python scripts/build_refactor_workload.py --out /tmp/refactor.jsonl

Material: CPython's Lib/ (PSF-2.0); each item names its file, class, method and Python version. These
modules are not the ``fim`` workload's (``build_fim_workload.py``).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import platform
import re
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "src" / "verispec" / "bench" / "data" / "refactor_moves.jsonl"
MODULES = ("sched", "queue", "cmd", "netrc", "pstats", "bdb", "timeit", "ftplib", "optparse", "mailbox",
           "wave", "plistlib", "imaplib", "trace", "http.cookiejar", "email.feedparser")
MIN_LINES, MAX_LINES, MIN_SELF = 12, 40, 3
PROMPT = ("Refactor the method `{method}` of the class `{cls}` below (from {path} in the Python standard "
          "library) into a top-level function with the same name. The function takes the instance as its "
          "first parameter, named `{param}` instead of `self`; keep the rest of the code as it is.\n\n"
          "```python\n{header}\n    ...\n\n{code}\n```\n\n"
          "Reply with the complete function only, in one Python code block.")


def snake_case(name: str) -> str:
    """``TextWrapper`` -> ``text_wrapper``, ``HTTPConnection`` -> ``http_connection``."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


def first_method(source: str) -> tuple[str, str, str, str] | None:
    """(class name, class header line, method name, method source as in the class) of the module's
    first method that qualifies (module docstring), or None."""
    lines = source.splitlines()
    for cls in ast.parse(source).body:
        if not isinstance(cls, ast.ClassDef):
            continue
        for fn in cls.body:
            if (not isinstance(fn, ast.FunctionDef) or fn.decorator_list or fn.name.startswith("__")
                    or not fn.args.args or fn.args.args[0].arg != "self"):
                continue
            text = "\n".join(lines[fn.lineno - 1:fn.end_lineno])
            names = set(re.findall(r"[A-Za-z_]\w*", text))
            if (MIN_LINES <= fn.end_lineno - fn.lineno + 1 <= MAX_LINES and len(re.findall(r"\bself\b", text)) >= MIN_SELF
                    and snake_case(cls.name) not in names and text.startswith("    def ")):
                return cls.name, lines[cls.lineno - 1], fn.name, text
    return None


def build_rows(modules: tuple[str, ...] = MODULES) -> list[dict]:
    """One item per module that has a qualifying method, in ``modules`` order."""
    version = platform.python_version()
    rows = []
    for name in modules:
        path = Path(importlib.import_module(name).__file__)
        found = first_method(path.read_text(encoding="utf-8"))
        if found is None:
            continue
        cls, header, method, code = found
        lib_path = "Lib/" + path.relative_to(sysconfig.get_paths()["stdlib"]).as_posix()
        prompt = PROMPT.format(method=method, cls=cls, path=lib_path, param=snake_case(cls), header=header, code=code)
        rows.append({"question_id": f"refactor-{name}-{cls}.{method}", "category": "edit", "turns": [prompt],
                     "prediction": code,
                     "source": {"repository": "https://github.com/python/cpython", "license": "PSF-2.0",
                                "version": version, "path": lib_path, "function": f"{cls}.{method}"}})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    rows = build_rows()
    args.out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(f"{len(rows)} items -> {args.out}")


if __name__ == "__main__":
    main()
