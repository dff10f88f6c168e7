"""Command line: ``verispec generate | models`` (bench, serve and friends add commands)."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="verispec: lossless speculative decoding.")
err = Console(stderr=True)


def fail(message: str) -> None:
    """One-line error and exit code 2 (bad input), never a traceback."""
    err.print(f"[red]error:[/red] {message}", highlight=False)
    raise typer.Exit(2)


def parse_options(pairs: list[str]) -> dict[str, str]:
    opts = {}
    for pair in pairs:
        if "=" not in pair:
            fail(f"drafter option {pair!r} must look like key=value")
        key, value = pair.split("=", 1)
        opts[key.strip().replace("-", "_")] = value.strip()
    return opts


def read_prompt(prompt: Optional[str], file: Optional[Path]) -> str:
    if file is not None:
        if not file.is_file():
            fail(f"prompt file {file} does not exist")
        return file.read_text()
    if prompt == "-" or (prompt is None and not sys.stdin.isatty()):
        return sys.stdin.read()
    if prompt is None:
        fail("give a prompt argument, --file, or text on stdin")
    return prompt


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def stats_table(stats: dict) -> Table:
    table = Table(title="speculation statistics", show_header=False)
    for key in ("new_tokens", "target_forwards", "steps", "drafted", "accepted", "tau", "alpha",
                "tokens_per_second", "prefill_s", "decode_s", "peak_rss_mb"):
        table.add_row(key, str(stats.get(key)))
    ppa = stats.get("per_position_acceptance") or []
    table.add_row("per_position_acceptance", " ".join(f"{x:.2f}" for x in ppa[:12]))
    return table


@app.command()
def generate(
    prompt: Optional[str] = typer.Argument(None, help="prompt text; '-' or omitted reads stdin"),
    file: Optional[Path] = typer.Option(None, "--file", "-f", help="read the prompt from a file"),
    model: str = typer.Option("smollm2-135m-instruct", help="catalog name or path (see `verispec models`)"),
    drafter: str = typer.Option("prompt-lookup", help="none, prompt-lookup, draft, ..."),
    drafter_option: list[str] = typer.Option([], "--drafter-option", "-o", help="key=value, repeatable"),
    num_draft_tokens: int = typer.Option(8, "-k", "--num-draft-tokens", help="draft budget per step"),
    policy: str = typer.Option("fixed", help="draft length policy: fixed or heuristic"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n"),
    temperature: float = typer.Option(0.0, help="0 = greedy"),
    top_k: int = typer.Option(0, help="0 disables"),
    top_p: float = typer.Option(1.0),
    seed: int = typer.Option(0),
    stop: list[str] = typer.Option([], help="stop string, repeatable"),
    chat: Optional[bool] = typer.Option(None, "--chat/--no-chat", help="wrap the prompt as a user message (default: when the model has a chat template)"),
    stream: bool = typer.Option(False, "--stream", help="print text as it is generated"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    dtype: str = typer.Option("float32", help="float32 or bfloat16"),
    backend: str = typer.Option("hf", help="auto, hf or native"),
) -> None:
    """Generate text with speculative decoding and print speculation statistics."""
    from .api import SpecDecoder, load_model
    from .models.base import ModelError
    from .types import SamplingParams

    text = read_prompt(prompt, file)
    try:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                max_new_tokens=max_new_tokens, seed=seed, stop=tuple(stop))
        lm = load_model(model, dtype=dtype, backend=backend)
        dec = SpecDecoder(lm, drafter, parse_options(drafter_option), num_draft_tokens, policy)
        chunks = []
        for chunk in dec.stream(text, params, chat):
            chunks.append(chunk)
            if stream and not as_json:
                print(chunk.delta, end="", flush=True)
    except (ValueError, ModelError) as e:
        fail(str(e))
    out_text = "".join(c.delta for c in chunks)
    ids = [t for c in chunks for t in c.token_ids]
    stats = chunks[-1].stats.as_dict() | {"peak_rss_mb": round(peak_rss_mb(), 1)}
    stats["drafter_memory_bytes"] = dec.drafter.memory_bytes()
    if as_json:
        print(json.dumps({"text": out_text, "token_ids": ids, "finish_reason": chunks[-1].finished,
                          "model": lm.name, "drafter": dec.drafter.name, "stats": stats}))
        return
    print("" if stream else out_text)
    err.print(stats_table(stats))


@app.command()
def models() -> None:
    """List the built-in models."""
    from .models.loading import list_models

    table = Table("name", "description")
    for name, desc in list_models():
        table.add_row(name, desc)
    Console().print(table)


@app.command()
def drafters() -> None:
    """List the drafters and their options."""
    from .registry import DRAFTERS

    table = Table("name", "description")
    for name, (_, desc) in DRAFTERS.items():
        table.add_row(name, desc)
    Console().print(table)


@app.command()
def train(
    kind: str = typer.Argument(..., help="eagle or medusa"),
    data: list[Path] = typer.Option(..., "--data", help="generations .jsonl or feature directory, repeatable"),
    out: Path = typer.Option(..., "--out", help="run directory (checkpoint.pt, weights/)"),
    steps: int = typer.Option(600, "--steps"),
    model: str = typer.Option("smollm2-135m-instruct", help="the target"),
    lr: float = typer.Option(1e-3),
    seed: int = typer.Option(0),
    resume: bool = typer.Option(False, "--resume", help="continue from out/checkpoint.pt"),
) -> None:
    """Train a drafter on the target's own generations (see verispec.train)."""
    from .models.base import ModelError
    from .train import run_train

    try:
        result = run_train(kind, model, list(data), out, steps, resume=resume, seed=seed, lr=lr)
    except (ValueError, ModelError) as e:
        fail(str(e))
    print(json.dumps(result))


# `verispec bench`: options and logic live in verispec.bench.command (typer/rich imports only).
from .bench.command import bench as _bench  # noqa: E402

app.command("bench")(_bench)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
