"""Error text reaches the terminal as it is: rich's markup is escaped wherever the command line
prints a message or a user's value (``pip install 'verispec[ray]'`` keeps its brackets; a value
like ``[/]``, which rich would refuse as a tag, is one line, not a traceback)."""

from __future__ import annotations

import sys

import pytest
from serving import one_line_exit_2


def test_serve_ray_without_ray_keeps_the_extras_brackets(monkeypatch):
    monkeypatch.setitem(sys.modules, "verispec.server.ray_serve", None)  # import fails as without Ray
    line = one_line_exit_2("serve", "--ray", "--model", "stories260k", needle="pip install")
    assert "'verispec[ray]'" in line


@pytest.mark.parametrize("name", ["[bold]x[/bold]", "[/]", "a[b]c", "[red]", "models/[ray]", "[link=x]y"])
def test_a_value_with_markup_is_printed_literally(name):
    line = one_line_exit_2("generate", "--model", name, "--no-chat", "-n", "2", "hi")
    assert name in line


@pytest.mark.parametrize("reason", ["needs pip install 'verispec[ray]'", "[/]", "[bold]x"])
def test_the_statistics_table_prints_values_literally(reason):
    from rich.console import Console

    from verispec.cli.decoding import stats_table

    console = Console(record=True, width=200)
    console.print(stats_table({"bit_exact_reason": reason, "new_tokens": 3}))
    assert reason in console.export_text()
