"""What the commands of the command line share: one-line failures (exit code 2, never a
traceback), reading a prompt and writing the output safely, checks of text and model arguments,
and the help texts of options several commands take.

Only typer and rich are imported at module level, so ``verispec --help`` stays instant.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

err = Console(stderr=True)
PREFIX_CACHE_MB = 1024.0  # = engine.prefix_cache.DEFAULT_MAX_MB (not imported: `verispec --help` stays instant)
PREFIX_CACHE_HELP = ("MiB of K/V kept across requests so a prompt reuses its longest cached prefix "
                     "(multi-turn chats, shared system prompts); 0 = off; the cpu backend only (exact there)")
THREADS_HELP = "threads of the compiled runtime's pool and of torch (as llama.cpp's -t; default: one per core)"
QUANT_HELP = ("weights: auto (the checkpoint's own: a GGUF's blocks on cpu, int4 for a Q4 GGUF on native), "
              "none (float32), int8 or int4 (quantized at load: Q8_0 / Q4_1 on cpu, int8 / int4 on native; "
              "hf: auto or none)")
DRAFT_SEARCH_HELP = ("look for a draft model among the GGUF files already on this machine (Hugging Face's cache, "
                     "Ollama's, LM Studio's, ~/models): a smaller one with the target's vocabulary, else one that "
                     "drafts through text where that pays; auto runs it (models/discovery.py)")
DRAFT_SEARCH_PATH_HELP = "a folder --draft-search looks in instead of the usual stores (repeatable; implies --draft-search)"


def draft_search_locations(search: bool, paths: list[Path]) -> list | None:
    """The locations ``--draft-search`` / ``--draft-search-path`` name; None when neither is given."""
    if not search and not paths:
        return None
    from ..models.discovery import default_locations, locations_from_paths

    return locations_from_paths(paths) if paths else default_locations()


def say(line: str) -> None:
    """One line of what the command chose (stderr)."""
    err.print(line, highlight=False, soft_wrap=True, markup=False)


def fail(message: str) -> None:
    """One-line error and exit code 2 (bad input), never a traceback. The message is printed as
    it is (rich markup escaped: ``verispec[ray]`` keeps its brackets)."""
    err.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def parse_options(pairs: list[str]) -> dict[str, str]:
    opts = {}
    for pair in pairs:
        if "=" not in pair:
            fail(f"drafter option {pair!r} must look like key=value")
        key, value = pair.split("=", 1)
        opts[key.strip().replace("-", "_")] = value.strip()
    return opts


MAX_PROMPT_BYTES = 16 * 2**20  # read no more: far above any context here (the model's own bound comes later)


def read_prompt(prompt: Optional[str], file: Optional[Path], what: str = "prompt") -> str:
    """The prompt (or ``what``) from --file, stdin or the argument; unreadable, non-UTF-8 or
    unbounded input (``- < /dev/zero``) fails with one line. At most ``MAX_PROMPT_BYTES`` are read."""
    from ..paths import decode_utf8, is_text, read_text_file

    try:
        if file is not None:
            check(not file.is_file() or file.stat().st_size <= MAX_PROMPT_BYTES,
                  f"{what} file {file} is larger than {MAX_PROMPT_BYTES >> 20} MiB")
            return read_text_file(file, f"{what} file")
        if prompt == "-" or (prompt is None and not sys.stdin.isatty()):
            stdin = getattr(sys.stdin, "buffer", None)
            data = stdin.read(MAX_PROMPT_BYTES + 1) if stdin is not None else sys.stdin.read(MAX_PROMPT_BYTES + 1)
            check(len(data) <= MAX_PROMPT_BYTES, f"stdin holds more than {MAX_PROMPT_BYTES >> 20} MiB of prompt")
            return decode_utf8(data, "stdin") if isinstance(data, bytes) else data
    except ValueError as e:
        fail(str(e))
    except OSError as e:
        fail(f"cannot read the prompt: {e.strerror or e}")
    if prompt is None:
        fail("give a prompt argument, --file, or text on stdin")
    check(is_text(prompt), "the prompt argument is not UTF-8 text")  # argv bytes like \xff arrive as surrogates
    return prompt


def check_text_args(values: list[str], flag: str) -> None:
    """Command-line strings used as text (stop strings, ...) must be UTF-8."""
    from ..paths import is_text

    for v in values:
        check(is_text(v), f"{flag} {v.encode('utf-8', 'backslashreplace').decode()!r} is not UTF-8 text")


def check_model_arg(model: str) -> None:
    """A --model that names an existing path must be a regular file or a directory: a FIFO or
    a device named ``*.gguf`` would block (or never end) when read."""
    path = Path(model)
    try:
        exists = path.exists()
    except (OSError, ValueError):
        return  # not a usable path: the catalog lookup reports it
    if exists and not (path.is_file() or path.is_dir()):
        fail(f"--model {model} is not a regular file or a directory")


def emit(text: str, end: str = "\n") -> None:
    """Print to stdout now; a failing stdout (a full disk, /dev/full, a closed pipe) is one
    line and exit 2, not a traceback (then or at exit, when Python flushes it again)."""
    import os

    try:
        sys.stdout.write(text + end)
        sys.stdout.flush()
    except OSError as e:
        try:  # nothing more can reach stdout: point it at /dev/null so the exit flush is quiet
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        fail(f"cannot write the output: {e.strerror or e}")


def check(condition: bool, message: str) -> None:
    """Fail with ``message`` (one line, exit 2) unless ``condition``."""
    if not condition:
        fail(message)

