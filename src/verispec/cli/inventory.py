"""``verispec models``, ``drafters`` and ``info``: what this installation has (the built-in
models, the drafters and their options, the compiled runtime, threads and the model cache)."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .common import emit


def models() -> None:
    """List the built-in models."""
    from ..models.resolve import list_models

    table = Table("name", "description")
    for name, desc in list_models():
        table.add_row(escape(name), escape(desc))
    Console().print(table)


def drafters() -> None:
    """List the drafters and their options (-o key=value), from each drafter's options dataclass."""
    from ..drafters.options import describe, summary
    from ..registry import ALIASES, DRAFTERS

    table = Table("name", "description", "options (-o key=value; default)")
    for name, (_, options) in DRAFTERS.items():
        aliases = [a for a, n in ALIASES.items() if n == name]
        rows = [f"{key}" + (f"={default}" if default else "") + (f" ({kind})" if kind else "") + f": {text}"
                for key, kind, default, text in describe(options)]
        table.add_row(escape(name + (f" ({', '.join(aliases)})" if aliases else "")), escape(summary(options)), escape("\n".join(rows)))
    Console().print(table)


def info(as_json: bool = typer.Option(False, "--json", help="print one JSON object")) -> None:
    """Version, compiled runtime (built? ISA), threads and the model cache of this installation."""
    from ..system import info as system_info

    report = system_info()
    if as_json:
        emit(json.dumps(report))
        return
    rt, cache = report["compiled_runtime"], report["model_cache"]
    lines = [f"verispec {report['version']} (python {report['python']}, torch {report['torch']})",
             f"compiled runtime: {'built, ' + rt['path'] if rt['built'] else 'NOT BUILT'}"]
    if rt["built"]:
        forced = f", forced by VERISPEC_ISA={rt['isa_forced']}" if rt["isa_forced"] else ""
        lines.append(f"ISA: {rt['isa'] or 'none'}{forced} (available here: {', '.join(rt['isas_available'])})")
    if rt["error"]:
        lines.append(f"  {rt['error']}")
    lines += [f"threads: {report['threads']} (of {report['cpus']} CPUs; --threads sets it)",
              f"model cache: {cache['path']} ({cache['bytes'] / 2**20:.1f} MiB; VERISPEC_CACHE moves it)"]
    emit("\n".join(lines))
