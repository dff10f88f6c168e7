"""More self-distillation answers, fast (the draft model's second training stage, gen3.jsonl):
the target on the native int4 runtime with batch invariance off and continuous batching
(BatchEngine, no drafter, 16 rows), ~55 tok/s on one core (transformers generate: ~25).
Prompts (never Spec-Bench): the templated instructions of ``build_prompts`` with seeds 1-3
that seed 0 (gen.jsonl) did not produce, interleaved with GSM8K train questions 250-999
(disjoint from gen.jsonl's 0-249 and the reference answers 1000-1399). Resumable.

    python scripts/draft_extra_data.py gen3.jsonl --minutes 25
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from verispec.api import load_model
from verispec.drafters.base import NoDrafter
from verispec.engine import Engine
from verispec.engine.batch import BatchEngine
from verispec.models.native import NativeLlama
from verispec.train.data import chat_ids, done_ids
from verispec.train.prompts import build_prompts, read_gsm8k_questions
from verispec.types import SamplingParams

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "train.jsonl"


def extra_prompts() -> list[dict]:
    """New templated instructions (2 per GSM8K question) and GSM8K questions 250-999."""
    seen = {p["content"] for p in build_prompts([], 350, seed=0)}
    inst = []
    for seed in (1, 2, 3):
        for p in build_prompts([], 400, seed=seed):
            if p["content"] not in seen:
                seen.add(p["content"])
                inst.append({**p, "id": f"s{seed}-{p['id']}"})
    qs = read_gsm8k_questions(GSM8K, limit=1000)[250:]
    gsm = iter({"id": f"gsm8k-{250 + i}", "source": "gsm8k", "content": q} for i, q in enumerate(qs))
    out = []
    for i, p in enumerate(inst):
        out.append(p)
        if i % 2 == 1 and (q := next(gsm, None)) is not None:
            out.append(q)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--minutes", type=float, default=25)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = load_model()
    backend = NativeLlama.from_hf_dir(model.hf_dir, dtype=torch.float32, quant="int4", batch_invariant=False)
    batch = BatchEngine(backend, {"none": Engine(backend, NoDrafter(), 1)}, max_batch=16, max_length=1024)
    skip = done_ids(args.out)
    todo = iter(p for p in extra_prompts() if p["id"] not in skip)
    params, running, t0, n, toks = SamplingParams(max_new_tokens=192), {}, time.time(), 0, 0
    with open(args.out, "a") as f:
        while time.time() - t0 < args.minutes * 60:
            while batch.free_slots and (p := next(todo, None)) is not None:
                ids = chat_ids(model.tokenizer, p["content"])
                if len(ids) <= 700:
                    running[p["id"]] = (p, ids, batch.add_request(p["id"], ids, params, "none"))
            if not running:
                break
            batch.step([r for _, _, r in running.values()])
            for rid, (p, ids, req) in list(running.items()):
                if req.finished:
                    f.write(json.dumps({"id": rid, "source": p["source"], "prompt_ids": ids,
                                        "response_ids": req.generated}) + "\n")
                    f.flush()
                    batch.release(req)
                    del running[rid]
                    n, toks = n + 1, toks + len(req.generated)
                    if n % 16 == 0:
                        print(f"{n} answers, {toks} tokens, {toks / (time.time() - t0):.1f} tok/s", flush=True)
    print(f"done: {n} answers, {toks} tokens")


if __name__ == "__main__":
    main()
