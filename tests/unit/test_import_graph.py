"""The package's import graph has no circles (issue 24).

Each module of ``verispec`` is parsed (``ast``, nothing is imported) and its imports of other
``verispec`` modules are resolved (relative ones too; ``from .pkg import name`` points at the
submodule ``pkg.name`` when there is one, else at ``pkg``). Two graphs are checked:

- **modules, import time**: the imports that run when a module is imported (module level,
  inside ``if``/``try`` and class bodies; not inside functions, not under ``if TYPE_CHECKING``).
  A circle here is what can fail with a half-initialized module, so there must be none.
  An import inside a function is the usual way to keep a heavy or optional dependency off
  the import path (torch, transformers, the compiled runtime), so it does not count here.
- **packages, every import**: the same with the imports inside functions too, one node per
  subpackage (``verispec.drafters``, ``verispec.models``, ...) or top-level module. This is the
  layering: a lazy import still makes one package depend on another, and a circle between
  packages (drafters <-> policies, api <-> registry, models <-> drafters) means neither can be
  understood, tested or moved without the other. The command line (``verispec.cli`` and the
  ``command`` modules that implement its subcommands, e.g. ``verispec.bench.command``) is one
  node: it is the top of the graph.

A package's ``__init__`` importing its own submodules is not a circle (Python imports the
package first), so a module's implicit import of its parent packages is not an edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import verispec

ROOT = Path(verispec.__file__).parent


def _modules() -> dict[str, tuple[Path, bool]]:
    """module name -> (file, is a package)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def _imports(body: list[ast.stmt], lazy: bool):
    """The import statements of ``body``, recursing into compound statements; into function
    bodies only when ``lazy``; never under ``if TYPE_CHECKING``."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not lazy:
            continue
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _imports(node.orelse, lazy)
        else:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    yield from _imports([child], lazy)
                elif isinstance(child, ast.excepthandler):
                    yield from _imports(child.body, lazy)
                elif lazy:  # a lambda or comprehension cannot hold a statement; match cases can
                    yield from _imports([s for s in ast.walk(child) if isinstance(s, ast.stmt)], lazy)


def import_graph(lazy: bool) -> dict[str, set[str]]:
    """module -> the verispec modules it imports (``lazy``: imports inside functions too)."""
    mods = _modules()
    graph = {}
    for name, (path, is_pkg) in mods.items():
        package = name if is_pkg else name.rpartition(".")[0]
        deps = set()
        for node in _imports(ast.parse(path.read_text(encoding="utf-8")).body, lazy):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                mod = node.module if node.level == 0 else ".".join(p for p in (base, node.module) if p)
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
            deps |= {t for t in targets if t in mods and t != name}
        graph[name] = deps
    return graph


def _node(module: str) -> str:
    """The package-level node of a module: its subpackage or top-level module (the command
    line is one node)."""
    if module == "verispec.cli" or module.endswith(".command"):
        return "verispec.cli"
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for module, deps in graph.items():
        node = out.setdefault(_node(module), set())
        node |= {_node(d) for d in deps} - {_node(module)}
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` as ``[a, b, ..., a]``, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def _edges(graph: dict[str, set[str]], cycle: list[str]) -> str:
    return "\n".join(f"  {a} -> {b}" for a, b in zip(cycle, cycle[1:]))


def test_find_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"x": {"a"}, "a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]


def test_graph_sees_relative_lazy_and_type_checking_imports():
    eager, lazy = import_graph(lazy=False), import_graph(lazy=True)
    assert "verispec.models.load" in eager["verispec.api"]  # from .models.load import ...
    assert "verispec.models.cpu" not in eager["verispec.models.load"]  # inside functions
    assert "verispec.models.cpu" in lazy["verispec.models.load"]  # from . import cpu
    assert "verispec.models.load" in lazy["verispec.registry"]  # lazy and under TYPE_CHECKING
    assert "verispec.models.load" not in eager["verispec.registry"]


def test_no_circle_between_modules_at_import_time():
    cycle = find_cycle(import_graph(lazy=False))
    assert cycle is None, "modules import each other at import time:\n" + _edges(import_graph(lazy=False), cycle)


def test_no_circle_between_packages():
    graph = package_graph(import_graph(lazy=True))
    cycle = find_cycle(graph)
    if cycle:
        modules = import_graph(lazy=True)
        detail = [f"  {a} -> {b}: " + ", ".join(sorted(f"{m} -> {d}" for m in modules for d in modules[m]
                                                       if _node(m) == a and _node(d) == b))
                  for a, b in zip(cycle, cycle[1:])]
        raise AssertionError("packages import each other (counting imports inside functions):\n" + "\n".join(detail))


def test_sampling_and_verification_do_not_import_the_models():
    """The target distribution and the acceptance rules know logits, not backends: the error they
    raise on a corrupt row (``NonFiniteLogits``) lives in ``verispec.errors``."""
    lazy = import_graph(lazy=True)
    for module, deps in lazy.items():
        if module == "verispec.sampling" or module.startswith("verispec.verify"):
            assert not {d for d in deps if d.startswith("verispec.models")}, (module, deps)
