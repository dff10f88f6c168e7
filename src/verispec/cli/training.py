"""``verispec train`` (a drafter on the target's own generations, or generating them) and
``verispec datastore build`` (a REST datastore: a corpus tokenized and indexed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from .common import check, check_model_arg, emit, fail


def train(
    kind: str = typer.Argument(..., help="data (on-policy corpus), eagle, eagle3, medusa or draft"),
    data: Optional[list[Path]] = typer.Option(None, "--data", help="generations .jsonl, feature directory or "
                                              "`train data` corpus, repeatable; none: generate the default data "
                                              "in OUT/data (hours)"),
    out: Path = typer.Option(..., "--out", help="run directory (checkpoint.pt, weights/)"),
    steps: int = typer.Option(600, "--steps"),
    model: str = typer.Option("smollm2-135m-instruct", help="the target"),
    lr: float = typer.Option(1e-3),
    warmup: Optional[int] = typer.Option(None, help="warm-up steps (default: min(40, steps/10))"),
    layers: Optional[str] = typer.Option(None, help="draft only: target layers to start from, e.g. 0,1,2,3"),
    init: Optional[Path] = typer.Option(None, help="draft: continue from these draft weights; eagle3: from these EAGLE-3 (or EAGLE) weights"),
    seed: int = typer.Option(0),
    resume: bool = typer.Option(False, "--resume", help="continue from out/checkpoint.pt"),
    max_minutes: Optional[float] = typer.Option(None, "--max-minutes", help="stop (checkpointed, resumable) after this long"),
    tokens: int = typer.Option(3_000_000, "--tokens", help="data: answer tokens to reach in OUT (resumable)"),
    batch: int = typer.Option(16, "--batch", help="data: conversations decoded together"),
    threads: int = typer.Option(1, "--threads", help="data: compiled-runtime threads"),
    magpie: int = typer.Option(40_000, "--magpie", help="data: self-written (Magpie) user turns to try"),
    corpus_tokens: Optional[int] = typer.Option(None, "--corpus-tokens", help="eagle, medusa, draft: use the first "
                                                "N tokens of a corpus only (features are extracted for them)"),
    gsm8k: Optional[Path] = typer.Option(None, "--gsm8k", envvar="VERISPEC_GSM8K", help="GSM8K train.jsonl, the "
                                         "questions generated data starts from (data, or no --data; not shipped)"),
) -> None:
    """Train a drafter on the target's own generations, or (``data``) generate them (see verispec.train)."""
    from ..models.base import ModelError
    from ..paths import check_output_dir
    from ..train import run_train

    check(steps >= 1, f"--steps must be >= 1, got {steps}")
    check(lr > 0 and lr == lr and lr != float("inf"), f"--lr must be a positive number, got {lr}")
    check(max_minutes is None or max_minutes > 0, f"--max-minutes must be > 0, got {max_minutes}")
    check(tokens >= 1 and batch >= 1 and threads >= 1 and magpie >= 0,
          "--tokens, --batch and --threads must be >= 1 and --magpie >= 0")
    check(corpus_tokens is None or corpus_tokens >= 1, f"--corpus-tokens must be >= 1, got {corpus_tokens}")
    check(0 <= seed <= 2**63 - 1, f"--seed must be in [0, 2^63 - 1], got {seed}")
    check_model_arg(model)
    try:
        check_output_dir(out, "--out")
        for path in data or []:
            check(path.exists(), f"--data {path} does not exist")
        if kind == "data":
            from ..train.corpus import main_corpus

            emit(json.dumps(main_corpus(out, model, tokens=tokens, batch=batch, threads=threads, n_magpie=magpie,
                                        seed=seed, max_minutes=max_minutes, gsm8k=gsm8k)))
            return
        init_layers = None
        if layers:
            try:
                init_layers = tuple(int(x) for x in layers.split(","))
            except ValueError:
                raise ValueError(f"--layers must be comma-separated layer indices, got {layers!r}") from None
        result = run_train(kind, model, list(data or []), out, steps, resume=resume, seed=seed, lr=lr,
                           warmup=warmup, layers=init_layers, init=init, max_minutes=max_minutes,
                           corpus_tokens=corpus_tokens, gsm8k=gsm8k)
    except (ValueError, ModelError) as e:
        fail(str(e))
    emit(json.dumps(result))


datastore_app = typer.Typer(add_completion=False, no_args_is_help=True,
                            help="REST datastores: corpora tokenized and indexed by a suffix array.")


@datastore_app.command("build")
def datastore_build(
    input: Path = typer.Option(..., "--input", "-i", help="corpus .txt (paragraphs) or .jsonl"),
    output: Path = typer.Option(..., "--output", "-o", help="datastore file (.npz)"),
    model: str = typer.Option("smollm2-135m-instruct", help="the target whose tokenizer to use"),
    field: Optional[str] = typer.Option(None, help="jsonl field to read (default: text, else all strings)"),
    max_tokens: int = typer.Option(10_000_000, help="size bound: tokens kept (8 bytes each)"),
    depth: int = typer.Option(64, help="suffix sort depth = longest exact lookup"),
) -> None:
    """Tokenize a corpus with the target's tokenizer and index it for `--drafter rest`."""
    from ..drafters.retrieval import build_datastore, read_documents, tokenizer_fingerprint
    from ..models.base import ModelError
    from ..models.resolve import resolve_model
    from ..models.tokenizer import load_tokenizer
    from ..paths import check_output_file

    check(max_tokens >= 1 and depth >= 1, "--max-tokens and --depth must be >= 1")
    check_model_arg(model)
    output = output if output.suffix == ".npz" else output.with_name(output.name + ".npz")  # numpy adds it
    try:
        check_output_file(output, "--output")
        check(input.is_file(), f"--input {input} does not exist or is not a file")
        tok = load_tokenizer(resolve_model(model))
        docs = (tok(text, add_special_tokens=False)["input_ids"] for text in read_documents(input, field))
        ds = build_datastore(docs, max_tokens=max_tokens, depth=depth, fingerprint=tokenizer_fingerprint(tok))
    except (ValueError, ModelError) as e:
        fail(str(e))
    if ds.suffix_array.size == 0:
        fail(f"corpus {input} has no text")
    try:
        ds.save(output)
    except OSError as e:
        fail(f"cannot write {output}: {e.strerror or e}")
    emit(json.dumps({"output": str(output), "tokens": int(ds.suffix_array.size), "bytes": ds.nbytes}))
