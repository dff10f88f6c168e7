"""Training data for drafters: the target's own generations (self-distillation).

``generate_responses`` runs the target (transformers ``generate``, left-padded batches,
greedy by default) over chat-wrapped prompts and appends one JSON line per response to a
file, so an interrupted run resumes where it stopped. ``sequences_from_jsonl`` turns the
file back into token-id sequences (prompt + response) for teacher forcing.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch


def done_ids(path: Path) -> set[str]:
    """Ids of prompts already answered in ``path`` (a JSONL file; missing = none)."""
    if not path.exists():
        return set()
    out = set()
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    out.add(json.loads(line)["id"])
                except json.JSONDecodeError:
                    continue  # a torn last line from a killed run
    return out


def chat_ids(tokenizer, content: str) -> list[int]:
    """Token ids of one user message wrapped in the chat template, ready for the answer."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@torch.inference_mode()
def generate_responses(
    model, tokenizer, prompts: list[dict], out_path: str | Path, *, batch_size: int = 16,
    max_new_tokens: int = 192, log: Callable[[str], None] = print,
) -> int:
    """Answer every prompt not yet in ``out_path`` greedily; returns how many were added.

    Each line: ``{"id", "source", "prompt_ids", "response_ids"}`` (response cut after the
    first EOS, EOS kept). Batches are length-sorted to limit padding."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    skip = done_ids(out_path)
    todo = [p for p in prompts if p["id"] not in skip]
    todo.sort(key=lambda p: len(p["content"]))
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos_ids))
    added, t0 = 0, time.time()
    for b in range(0, len(todo), batch_size):
        batch = todo[b:b + batch_size]
        ids = [chat_ids(tokenizer, p["content"]) for p in batch]
        width = max(map(len, ids))
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])  # [B, W] left-padded
        attn = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        out = model.generate(input_ids=input_ids, attention_mask=attn, max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad)
        with open(out_path, "a") as f:
            for p, x, row in zip(batch, ids, out[:, width:].tolist()):
                resp = []
                for t in row:
                    resp.append(t)
                    if t in eos_ids:
                        break
                f.write(json.dumps({"id": p["id"], "source": p["source"], "prompt_ids": x,
                                    "response_ids": resp}) + "\n")
        added += len(batch)
        log(f"generated {added}/{len(todo)} responses in {time.time() - t0:.0f}s")
    return added


def sequences_from_jsonl(path: str | Path, max_len: int = 512, vocab_size: int | None = None) -> list[list[int]]:
    """prompt + response token ids per line, truncated to ``max_len``. A line that is not an
    object with ``prompt_ids`` and ``response_ids`` (lists of token ids in [0, vocab_size)),
    an empty sequence or a file without any raise ValueError naming the line (a torn last
    line of an interrupted run is skipped)."""
    from ..paths import read_text_file

    seqs, lines = [], read_text_file(Path(path), "training data").splitlines()
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                continue  # generate_responses was interrupted mid-line
            raise ValueError(f"{path} line {number}: not JSON") from None
        except RecursionError:
            raise ValueError(f"{path} line {number}: JSON nested too deeply") from None
        seqs.append(_token_sequence(row, f"{path} line {number}", vocab_size)[:max_len])
    if not seqs:
        raise ValueError(f"training data {path} has no sequences")
    return seqs


def _token_sequence(row: object, where: str, vocab_size: int | None) -> list[int]:
    ids = [row.get(k) for k in ("prompt_ids", "response_ids")] if isinstance(row, dict) else [None]
    if not all(isinstance(x, list) and all(type(t) is int for t in x) for x in ids):
        raise ValueError(f"{where}: expected prompt_ids and response_ids, lists of token ids")
    seq = ids[0] + ids[1]
    if len(seq) < 2:
        raise ValueError(f"{where}: the token sequence is empty or has one token")
    if vocab_size is not None and not all(0 <= t < vocab_size for t in seq):
        raise ValueError(f"{where}: token ids must be in [0, {vocab_size})")
    return seq


def main_generate(out: str, model_name: str = "smollm2-135m-instruct", gsm8k: str | None = None,
                  n_gsm8k: int = 200, n_instructions: int = 300, seed: int = 0, batch_size: int = 16,
                  max_new_tokens: int = 192, threads: int = 1) -> None:
    """Entry point: build the non-Spec-Bench prompt set and answer it with the target."""
    from transformers import AutoModelForCausalLM

    from ..models.load import load_model
    from .prompts import build_prompts, read_gsm8k_questions

    questions = read_gsm8k_questions(gsm8k, limit=n_gsm8k) if gsm8k else []
    prompts = build_prompts(questions, n_instructions, seed=seed)
    if not {p["id"] for p in prompts} - done_ids(Path(out)):
        return  # every prompt is answered already
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        loaded = load_model(model_name)
        model = AutoModelForCausalLM.from_pretrained(str(loaded.hf_dir), dtype=torch.float32).eval()
        generate_responses(model, loaded.tokenizer, prompts, out, batch_size=batch_size,
                           max_new_tokens=max_new_tokens)
    finally:
        torch.set_num_threads(saved)


def gsm8k_reference_sequences(tokenizer, path: str | Path, first: int = 1000, last: int = 1400) -> list[list[int]]:
    """GSM8K train questions ``first..last-1`` with their reference answers (calculator
    annotations removed), chat-wrapped: teacher-forced data without generation, disjoint
    from ``main_generate``'s questions (the first 250)."""
    import re

    from .prompts import read_gsm8k_pairs

    seqs = []
    for q, a in read_gsm8k_pairs(path)[first:last]:
        a = re.sub(r"<<[^>]*>>", "", a).replace("#### ", "The answer is: ")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                                            tokenize=True)
        seqs.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return seqs


def build_default_data(model_name: str, out_dir: str | Path, gsm8k: str | Path | None = None,
                       threads: int = 1) -> list[Path]:
    """The shipped drafters' training data, from scratch and resumable, in ``out_dir``:
    ``gen.jsonl`` (the target's greedy answers to 250 GSM8K train questions and 350
    templated instructions; hours on one CPU core) and ``feats_gsm`` (400 GSM8K reference
    answers, teacher-forced). Returns the paths to pass to the trainers."""
    from transformers import AutoModelForCausalLM

    from ..models.load import load_model
    from . import features
    from .prompts import gsm8k_file

    out = Path(out_dir)
    gsm8k = gsm8k_file(gsm8k)
    main_generate(str(out / "gen.jsonl"), model_name, gsm8k=str(gsm8k), n_gsm8k=250, n_instructions=350,
                  threads=threads)
    loaded = load_model(model_name)
    hf = AutoModelForCausalLM.from_pretrained(str(loaded.hf_dir), dtype=torch.float32).eval()
    features.extract(hf, gsm8k_reference_sequences(loaded.tokenizer, gsm8k), out / "feats_gsm")
    return [out / "gen.jsonl", out / "feats_gsm"]


@torch.inference_mode()
def continuation_sequences(model, n: int, new_tokens: int, seed: int = 0, start_len: int = 3,
                           bos: int | None = 1) -> list[list[int]]:
    """Greedy continuations of ``n`` random token starts: self-distillation data for a
    base model without a chat template (used for stories260k in tests)."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.get_output_embeddings().weight.shape[0]
    seqs = []
    for _ in range(n):
        start = torch.randint(3, vocab, (start_len,), generator=g).tolist()
        ids = torch.tensor([([bos] if bos is not None else []) + start])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
        seqs.append(out[0].tolist())
    return seqs
