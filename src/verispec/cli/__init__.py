"""Command line: ``verispec generate | demo | models | drafters | info | train | datastore |
bench | serve``. This module builds the typer app from the commands, one module per group:
``decoding.py`` (generate, demo), ``inventory.py`` (models, drafters, info), ``training.py``
(train, datastore build), ``serving.py`` (serve), ``bench/command.py`` (bench); ``common.py``
holds what they share (one-line failures, prompt input, safe output).

Only typer and rich are imported at module level (each command imports what it runs), so
``verispec --help`` stays instant. ``python -m verispec.cli`` runs ``main`` (``__main__.py``).
"""

from __future__ import annotations

import typer

from ..bench.command import bench
from .decoding import demo, generate
from .inventory import drafters, info, models
from .serving import serve
from .training import datastore_app, train

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="verispec: lossless speculative decoding.")
for command in (generate, demo, models, drafters, info, train):
    app.command()(command)
app.add_typer(datastore_app, name="datastore")
app.command("bench")(bench)
app.command()(serve)


def one_line_warning(message, category, filename, lineno, line=None) -> str:
    """Warnings on the command line are for users: the message, not our source file and line."""
    return f"warning: {message}\n"


def main() -> None:
    """The ``verispec`` entry point (pyproject's ``[project.scripts]``)."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # weight-loading bars of tiny cached models are noise here
    warnings.formatwarning = one_line_warning
    app()
