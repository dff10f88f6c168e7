"""Rebuild the refactoring workloads (``verispec bench --data``) from real code: ``refactor_moves.jsonl`` from the
Python standard library, ``refactor_heldout.jsonl`` from other projects' git clones (``--git``), so anyone can
check where every item came from (issue 46).

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

``--git DIR`` (repeatable) takes the methods from a git checkout or bare clone of another project
instead, at ``--rev`` (default HEAD): the first qualifying method of each ``.py`` file under ``--under``
(default: the whole tree, tests/docs/examples skipped), files in path order; each row names the
repository (``--repository URL``, one per ``--git``, else the clone's origin), the commit and the path.
The held-out set (``refactor_heldout.jsonl``: requests and httpx, measured, never tuned on):

    python scripts/build_refactor_workload.py --out src/verispec/bench/data/refactor_heldout.jsonl \
        --git requests.git --repository https://github.com/psf/requests --license Apache-2.0 \
        --git httpx.git --repository https://github.com/encode/httpx --license BSD-3-Clause
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import platform
import re
import subprocess
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "src" / "verispec" / "bench" / "data" / "refactor_moves.jsonl"
MODULES = ("sched", "queue", "cmd", "netrc", "pstats", "bdb", "timeit", "ftplib", "optparse", "mailbox",
           "wave", "plistlib", "imaplib", "trace", "http.cookiejar", "email.feedparser")
MIN_LINES, MAX_LINES, MIN_SELF = 12, 40, 3
SKIP = re.compile(r"(^|/)(tests?|docs?|examples?)(/|$)|(^|/)(setup|conftest)\.py$|(^|/)test_")
PROMPT = ("Refactor the method `{method}` of the class `{cls}` below (from {path} in {project}) into a top-level function with the same name. The function takes the instance as its "
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
        prompt = PROMPT.format(method=method, cls=cls, path=lib_path, project="the Python standard library",
                               param=snake_case(cls), header=header, code=code)
        rows.append({"question_id": f"refactor-{name}-{cls}.{method}", "category": "edit", "turns": [prompt],
                     "prediction": code,
                     "source": {"repository": "https://github.com/python/cpython", "license": "PSF-2.0",
                                "version": version, "path": lib_path, "function": f"{cls}.{method}"}})
    return rows


def _git(git_dir: Path, *args: str) -> str:
    return subprocess.run(["git", "--git-dir" if (git_dir / "HEAD").is_file() else "-C", str(git_dir), *args],
                          check=True, capture_output=True, text=True, encoding="utf-8").stdout


def build_git_rows(git_dir: Path, repository: str, license_: str, rev: str = "HEAD", under: str = "") -> list[dict]:
    """One item per ``.py`` file of the clone at ``rev`` (under ``under``) that has a qualifying
    method, in path order; provenance: repository, commit, path."""
    commit = _git(git_dir, "rev-parse", rev + "^{commit}").strip()
    project = repository.rstrip("/").rsplit("/", 1)[-1]
    paths = [p for p in _git(git_dir, "ls-tree", "-r", "--name-only", commit, "--", under or ".").splitlines()
             if p.endswith(".py") and not SKIP.search(p)]
    rows = []
    for path in sorted(paths):
        try:
            found = first_method(_git(git_dir, "show", f"{commit}:{path}"))
        except (SyntaxError, UnicodeDecodeError, subprocess.CalledProcessError):
            continue
        if found is None:
            continue
        cls, header, method, code = found
        prompt = PROMPT.format(method=method, cls=cls, path=path, project=project, param=snake_case(cls),
                               header=header, code=code)
        stem = path.rsplit("/", 1)[-1].removesuffix(".py")
        rows.append({"question_id": f"refactor-{project}-{stem}-{cls}.{method}", "category": "edit", "turns": [prompt],
                     "prediction": code,
                     "source": {"repository": repository, "license": license_, "commit": commit, "path": path,
                                "function": f"{cls}.{method}"}})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--git", type=Path, action="append", default=[], help="a clone to take methods from (repeatable)")
    ap.add_argument("--repository", action="append", default=[], help="its URL, one per --git (default: its origin)")
    ap.add_argument("--license", action="append", default=[], help="its license, one per --git")
    ap.add_argument("--rev", default="HEAD")
    ap.add_argument("--under", default="", help="a folder of the clones to read (default: all)")
    args = ap.parse_args()
    if not args.git:
        rows = build_rows()
    else:
        rows = []
        for i, git_dir in enumerate(args.git):
            url = args.repository[i] if i < len(args.repository) else _git(git_dir, "config", "--get", "remote.origin.url").strip()
            lic = args.license[i] if i < len(args.license) else "see the repository"
            rows += build_git_rows(git_dir, url, lic, args.rev, args.under)
    args.out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(f"{len(rows)} items -> {args.out}")


if __name__ == "__main__":
    main()
