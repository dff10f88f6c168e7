"""The model-name walk: which verispec modules a load passes through, and how often it comes back.

Runs ``verispec generate --model MODEL`` in this process under ``sys.setprofile`` and records the
module of each verispec function called from ``cli.generate`` to the first runtime forward (a
``forward_batch`` or ``forward_slots`` of a runtime: models.cpu, models.native, models.hf), the first
time it is called: the walk a reader follows, reading each function once (a loop over tensors is one
step; a module's import, a comprehension or lambda inside a function, and a dataclass's generated
methods are not steps). Calls into other packages (torch, transformers, the
standard library) are transparent. Consecutive functions of one module are one visit; a module visited k times was re-entered k - 1 times (issue 37's target: no
module re-entered more than twice).

    python scripts/load_walk.py                       # a tiny GGUF written to a temporary directory
    python scripts/load_walk.py --model stories260k   # any catalog name or path
    python scripts/load_walk.py --backend native
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from pathlib import Path

RUNTIME_MODULES = ("verispec.models.cpu", "verispec.models.native", "verispec.models.hf")
FORWARDS = ("forward_batch", "forward_slots")


class _Reached(Exception):
    """Raised from the profiler when the first runtime forward is called: the walk is over."""


def walk(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the walk from entering ``cli.generate`` to calling the first runtime forward, its part inside
    ``load_model``): the verispec modules visited while ``verispec <argv>`` runs, consecutive
    repeats collapsed. Functions run by an import (a module's top level) are not steps."""
    from typer.main import get_command

    from verispec import cli

    steps: list[tuple[str, bool]] = []  # (module, inside load_model)
    seen: set = set()
    started = False

    def context(frame) -> tuple[bool, bool]:
        """(run by an import, inside models.load.load_model), from the frames below ``frame``."""
        in_load = False
        while frame is not None:
            name = frame.f_code.co_name
            if name == "<module>":
                return True, in_load
            if name == "generate" and _is_cli(frame.f_globals.get("__name__", "")):
                return False, in_load
            in_load = in_load or (name == "load_model" and frame.f_globals.get("__name__") == "verispec.models.load")
            frame = frame.f_back
        return False, in_load

    def profile(frame, event, _arg):
        nonlocal started
        if event != "call":
            return
        module, code = frame.f_globals.get("__name__", ""), frame.f_code
        if not started:
            started = _is_cli(module) and code.co_name == "generate"
            if not started:
                return
        if not module.startswith("verispec") or not _read_as_a_step(code) or code in seen:
            return  # another package, an import, code inside the function that runs it, or a function read once
        seen.add(code)
        importing, in_load = context(frame)
        if not importing:
            steps.append((module, in_load))
        if module in RUNTIME_MODULES and code.co_name in FORWARDS:
            sys.setprofile(None)
            raise _Reached

    sys.setprofile(profile)
    try:
        get_command(cli.app).main(argv, standalone_mode=False)
    except _Reached:
        pass
    finally:
        sys.setprofile(None)
    return _collapse([m for m, _ in steps]), _collapse([m for m, in_load in steps if in_load])


def _read_as_a_step(code) -> bool:
    """Is this code a function a reader opens? Not a module's top level, a comprehension, generator
    expression or lambda (read where it is written, inside the function that runs it; Python 3.12
    inlines comprehensions, PEP 709, so they are not calls there at all), nor a method a decorator
    generated (a dataclass's ``__init__``, compiled from ``<string>``: no source to read)."""
    return not code.co_name.startswith("<") and not code.co_filename.startswith("<")


def _is_cli(module: str) -> bool:
    """The command line's module (``verispec.cli``, or a module of the ``verispec.cli`` package)."""
    return module == "verispec.cli" or module.startswith("verispec.cli.")


def _collapse(modules: list[str]) -> list[str]:
    return [m for i, m in enumerate(modules) if i == 0 or modules[i - 1] != m]


def report(title: str, visits: list[str], show: bool) -> None:
    counts = Counter(visits)
    reentries = {m: n - 1 for m, n in counts.items() if n > 1}
    print(f"{title}: {len(visits)} visits to {len(counts)} modules, {sum(reentries.values())} re-entries; "
          f"most re-entered: {max(reentries.values(), default=0)}")
    if show:
        print("  " + " -> ".join(m.removeprefix("verispec.") for m in visits))
    for module, n in sorted(reentries.items(), key=lambda kv: -kv[1]):
        print(f"  {n:3d}  {module}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="catalog name or path (default: a tiny qwen2 GGUF written for the run)")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--show", action="store_true", help="print the whole walk")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from gguf_fixtures import write_tiny_gguf

            model = str(Path(tmp) / "tiny.gguf")
            write_tiny_gguf(Path(model), "qwen2")
        whole, load = walk(["generate", "hello", "--model", model, "--backend", args.backend, "-n", "2",
                            "--drafter", "none"])
    report("load_model (the model name to a built runtime)", load, args.show)
    report("cli.generate to the first runtime forward", whole, args.show)

if __name__ == "__main__":
    main()
