"""Training drafters for a target (``verispec train``): self-distillation data
(``prompts``, ``data``), teacher-forced target features (``features``), a resumable loop
(``loop``) and one trainer per drafter (``eagle``, ``medusa``, ``draft``).

    run_train("eagle", "smollm2-135m-instruct", ["gen.jsonl"], "runs/eagle", steps=600)
    run_train("draft", "smollm2-135m-instruct", [], "runs/draft", steps=1500)  # data from scratch
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

KINDS = ("eagle", "eagle3", "medusa", "draft")


def feature_dirs(model, data: list[str | Path], out_dir: Path, log=print,
                 corpus_tokens: int | None = None) -> list[Path]:
    """Each data path is a features directory (used as is), a generations JSONL
    (``data.generate_responses`` output; features from the float32 transformers target) or
    an on-policy corpus (``verispec train data`` output, a directory with ``manifest.jsonl``;
    its id-hashed held-out conversations, the EAGLE-3 evaluation set, are left out; features
    from the target's own backend, its first ``corpus_tokens`` tokens only if given), whose
    features are extracted into ``out_dir/features-<name>`` once (resumable)."""
    from transformers import AutoModelForCausalLM

    from . import data as gen_data
    from . import features
    from .corpus import is_held_out, read_corpus

    dirs, hf = [], None
    vocab = model.backend.info.vocab_size
    sequences = {}
    for item in map(Path, data):  # read and check every file before the first (slow) extraction
        if not item.exists():
            raise ValueError(f"training data {item} does not exist")
        if item.is_dir() and (item / "manifest.jsonl").exists():
            sequences[item] = corpus_prefix([s.tokens for s in read_corpus(item) if not is_held_out(s.id)],
                                            corpus_tokens)
        elif not item.is_dir():
            sequences[item] = gen_data.sequences_from_jsonl(item, vocab_size=vocab)
    for item in map(Path, data):
        if item not in sequences:
            dirs.append(item)
            continue
        target = out_dir / f"features-{item.stem}{'' if corpus_tokens is None or not item.is_dir() else f'-{corpus_tokens}'}"
        if item.is_dir():
            features.extract_with_backend(model.backend, sequences[item], target, log=log)
        else:
            if hf is None:
                hf = AutoModelForCausalLM.from_pretrained(str(model.hf_dir), dtype="float32").eval()
            features.extract(hf, sequences[item], target, log=log)
        dirs.append(target)
    return dirs


def corpus_prefix(seqs: list, max_tokens: int | None) -> list:
    """The first sequences of ``seqs`` holding at most ``max_tokens`` tokens in all (all: None)."""
    if max_tokens is None:
        return seqs
    total, out = 0, []
    for s in seqs:
        total += len(s)
        if total > max_tokens:
            break
        out.append(s)
    if not out:
        raise ValueError(f"corpus_tokens={max_tokens} is shorter than the corpus's first sequence")
    return out


def draft_options(model, layers: tuple[int, ...] | None, init: str | Path | None):
    """``DraftTrainOptions`` for ``model`` (a LoadedModel), checked: layer indices exist in
    the target; ``init`` is draft weights with as many layers (default: its layer count)."""
    import json

    from ..models.draft_checkpoint import is_draft_weights
    from .draft import DraftTrainOptions

    n_target = json.loads((model.hf_dir / "config.json").read_text())["num_hidden_layers"]
    opts = DraftTrainOptions()
    if layers is not None:
        if not layers or any(not 0 <= i < n_target for i in layers):
            raise ValueError(f"--layers must be layer indices of the target in [0, {n_target}), got {list(layers)}")
        opts = replace(opts, init_layers=tuple(layers))
    if init is not None:
        if not is_draft_weights(init):
            raise ValueError(f"--init {init} is not a draft weights directory (verispec train draft output)")
        n_init = json.loads((Path(init) / "config.json").read_text())["num_hidden_layers"]
        if layers is None:
            opts = replace(opts, init_layers=tuple(range(n_init)))
        elif len(layers) != n_init:
            raise ValueError(f"--init {init} has {n_init} layers but --layers names {len(layers)}")
        opts = replace(opts, init_weights=str(init))
    return opts


def run_train(kind: str, model_name: str, data: list[str | Path], out: str | Path, steps: int,
              resume: bool = False, seed: int = 0, lr: float = 1e-3, progress: bool = True,
              warmup: int | None = None, layers: tuple[int, ...] | None = None,
              init: str | Path | None = None, max_minutes: float | None = None,
              corpus_tokens: int | None = None, gsm8k: str | Path | None = None) -> dict:
    """Train a ``kind`` drafter for ``model_name``; weights land in ``out/weights``.
    No ``data``: build the default self-distillation data in ``out/data`` first
    (``data.build_default_data``, resumable). ``layers``: the draft model's initial target
    layers; ``init``: draft weights to continue from (a second stage on more data). Returns
    the validation metrics and final loss. ``corpus_tokens``: train on a corpus's first
    tokens only (eagle, medusa, draft). ``gsm8k``: the GSM8K train.jsonl the default data
    starts from (needed without ``data``)."""
    from ..models.load import load_model
    from .loop import TrainConfig
    from .prompts import gsm8k_file

    if kind not in KINDS:
        raise ValueError(f"unknown trainable drafter {kind!r}; choose one of: {', '.join(KINDS)}")
    if layers is not None and kind != "draft":
        raise ValueError("layers applies to the draft model only")
    if corpus_tokens is not None and kind == "eagle3":
        raise ValueError("corpus_tokens (--corpus-tokens) applies to eagle, medusa and draft; eagle3 samples the whole corpus")
    if init is not None and kind not in ("draft", "eagle3"):
        raise ValueError("init applies to the draft model and EAGLE-3 only")
    if warmup is not None and not 0 <= warmup < steps:
        raise ValueError(f"warmup must be in [0, steps={steps}), got {warmup}")
    if not data and kind != "eagle3":
        gsm8k = gsm8k_file(gsm8k)  # before hours of work
    out = Path(out)
    model = load_model(model_name)
    if kind == "eagle3":
        return run_eagle3(model, data, out, steps, resume=resume, seed=seed, lr=lr, progress=progress,
                          warmup=warmup, max_minutes=max_minutes, init=init)
    draft_opts = draft_options(model, layers, init) if kind == "draft" else None  # fail before hours of data
    if not data:
        from .data import build_default_data

        data = build_default_data(model_name, out / "data", gsm8k)
    dirs = feature_dirs(model, data, out, corpus_tokens=corpus_tokens)
    deadline = None if max_minutes is None else time.time() + 60 * max_minutes  # training time only
    warmup = min(40, max(1, steps // 10)) if warmup is None else warmup
    cfg = TrainConfig(steps=steps, lr=lr, seed=seed, warmup=warmup, ckpt_every=max(1, min(50, steps // 4)))
    if kind == "eagle":
        from .eagle import train_eagle

        _, result, metrics = train_eagle(model.hf_dir, dirs, out, cfg, resume=resume,
                                         target_name=model.name, progress=progress, deadline=deadline)
    elif kind == "draft":
        from .draft import train_draft

        _, result, metrics = train_draft(model.hf_dir, dirs, out, cfg, draft_opts, resume=resume,
                                         target_name=model.name, progress=progress, deadline=deadline)
    else:
        from .medusa import train_medusa

        _, result, metrics = train_medusa(model.hf_dir, dirs, out, cfg, resume=resume,
                                          target_name=model.name, progress=progress, deadline=deadline)
    return {"final_loss": result.losses[-1], "validation": metrics, "weights": str(out / "weights")}


def run_eagle3(model, data: list[str | Path], out: Path, steps: int, resume: bool, seed: int, lr: float,
               progress: bool, warmup: int | None, max_minutes: float | None, init: str | Path | None = None) -> dict:
    """EAGLE-3 on one ``verispec train data`` corpus directory, warm-started from ``init``
    (EAGLE-3 weights to continue, or EAGLE weights), else from the shipped EAGLE head when
    there is one; stops (checkpointed) after ``max_minutes``."""
    import torch

    from ..weights import has_shipped, shipped_weights
    from .eagle3 import train_eagle3
    from .loop import TrainConfig

    if len(data) != 1 or not (Path(data[0]) / "manifest.jsonl").exists():
        raise ValueError("eagle3 trains on one corpus directory: --data DIR (the output of `verispec train data`)")
    torch.set_num_threads(1)  # the teacher (compiled runtime) and the head share the cores in turns
    warmup = min(40, max(1, steps // 10)) if warmup is None else warmup
    cfg = TrainConfig(steps=steps, lr=lr, seed=seed, warmup=warmup, ckpt_every=max(1, min(25, steps // 4)))
    warm = init or (shipped_weights("eagle", model.name) if has_shipped("eagle", model.name) else None)
    info = train_eagle3(model, data[0], out, cfg, warm=warm, resume=resume, progress=progress, max_minutes=max_minutes)
    return {**info, "weights": str(out / "weights")}
