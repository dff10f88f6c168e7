"""Token frequencies of a tokenizer on verispec's tuning text, for FR-Spec draft heads.

FR-Spec (Zhao et al. 2025, "FR-Spec: Accelerating Large-Vocabulary Language Models via
Frequency-Ranked Speculative Sampling") drafts over the most frequent tokens only: a draft
model's LM head is the largest matrix of a small model with a 152 K vocabulary, and the
target still verifies every token, so output is unchanged. This script counts tokens on the
texts the project may tune on (GSM8K train questions and answers in the model's chat
template, and the Python standard library's own source) and writes the token ids in
descending frequency (ties by id) as int32 .npy; ``-o vocab=N`` of the draft drafter keeps
the first N plus every control token.

    python scripts/vocab_frequencies.py --model qwen2.5-coder-1.5b-instruct \
        --out src/verispec/weights/vocab-freq-qwen2.5-coder.npy
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path

import numpy as np


def texts(gsm8k: Path, stdlib: Path, tokenizer, max_files: int) -> list[str]:
    out = []
    for line in gsm8k.read_text().splitlines():
        row = json.loads(line)
        out.append(tokenizer.apply_chat_template([{"role": "user", "content": row["question"]},
                                                  {"role": "assistant", "content": row["answer"]}], tokenize=False))
    files = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    for p in files[:max_files]:
        try:
            out.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--gsm8k", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/gsm8k/train.jsonl")
    ap.add_argument("--max-files", type=int, default=2000)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    from verispec.api import load_model

    tok = load_model(args.model).tokenizer
    corpus = texts(args.gsm8k, Path(sysconfig.get_paths()["stdlib"]), tok, args.max_files)
    counts = np.zeros(len(tok), dtype=np.int64)
    for i in range(0, len(corpus), 256):
        for ids in tok(corpus[i:i + 256], add_special_tokens=False)["input_ids"]:
            np.add.at(counts, np.asarray(ids, dtype=np.int64), 1)
        print(f"\r{min(i + 256, len(corpus))}/{len(corpus)} texts", end="", file=sys.stderr)
    order = np.lexsort((np.arange(len(counts)), -counts))
    seen = order[counts[order] > 0].astype(np.int32)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.save(args.out, seen)
    total = counts.sum()
    print(f"\n{total:,} tokens from {len(corpus):,} texts; {len(seen):,} distinct ids", file=sys.stderr)
    for n in (8192, 16384, 32768, 65536):
        print(f"top {n:>6}: {counts[seen[:n]].sum() / total:.4%} of tokens", file=sys.stderr)


if __name__ == "__main__":
    main()
