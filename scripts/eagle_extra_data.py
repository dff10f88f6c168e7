"""The two extra training sets of the shipped EAGLE head (beside `main_generate`'s gen.jsonl):

1. ``gen2.jsonl``: greedy answers to the builder's summarize / rag / rewrite / translate /
   explain / role-play prompts that gen.jsonl does not answer yet (≤160 new tokens);
2. ``feats_gsm/``: GSM8K train questions 1000-1399 with their reference answers
   (calculator annotations removed), chat-wrapped and teacher-forced through the target.

    python scripts/eagle_extra_data.py --gen gen.jsonl --gsm8k ../shared/data/gsm8k/train.jsonl
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from verispec.api import load_model
from verispec.train.data import done_ids, generate_responses, gsm8k_reference_sequences
from verispec.train.features import extract
from verispec.train.prompts import build_prompts, read_gsm8k_questions

SOURCES = ("summarize", "rag", "rewrite", "translate", "explain", "roleplay")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gen", default="gen.jsonl", help="main_generate's output (prompts to skip)")
    ap.add_argument("--gsm8k", required=True)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    loaded = load_model("smollm2-135m-instruct")
    tok = loaded.tokenizer
    model = AutoModelForCausalLM.from_pretrained(str(loaded.hf_dir), dtype=torch.float32).eval()
    prompts = build_prompts(read_gsm8k_questions(args.gsm8k, limit=250), 350, seed=0)
    done = done_ids(Path(args.gen))
    todo = [p for p in prompts if p["id"] not in done and p["source"] in SOURCES]
    generate_responses(model, tok, todo, out / "gen2.jsonl", batch_size=16, max_new_tokens=160)
    extract(model, gsm8k_reference_sequences(tok, args.gsm8k), out / "feats_gsm", shard_size=32)


if __name__ == "__main__":
    main()
