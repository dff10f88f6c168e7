"""The draft's cost c, alone and inside the real loop (issue 33): c alone is one draft forward
of one token over one target decode step (best of --reps); in the loop it is the time the
engine spends in the drafter's ``propose`` per draft forward it pays for, while greedy
generation runs on real prompts, for the Python loop (``one_call=False``: a forward per draft
token through ctypes, torch softmax/argmax between them) and for the compiled runtime's one-call chain
(``CpuLlama.draft_chain``), interleaved prompt by prompt. Greedy outputs are checked equal to
plain decoding; sampled ones (``--temperature``: q over the vocabulary per draft token, in
torch or in the one call) differ by design, their law is tested in tests/. Prints a table;
asserts nothing.

    python scripts/bench_draft_cost.py                     # Qwen2.5-Coder 1.5B + 0.5B (FR-Spec head 32768)
    python scripts/bench_draft_cost.py --limit 4 -n 128
    python scripts/bench_draft_cost.py --temperature 0.7   # the sampled chain
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from verispec.api import SpecDecoder, encode_prompt, load_draft_model, load_model
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.types import SamplingParams

CODE = ["Write a Python function that checks whether a string is a palindrome, with tests.",
        "Implement binary search in Python and explain its complexity.",
        "Write a Python class for a stack with push, pop and peek, and a short usage example."]


def forward_ms(model, context: int = 256, reps: int = 15) -> float:
    """One forward of one token after a ``context``-token prefill, best of ``reps``."""
    cache = model.new_cache(context + 8)
    model.forward(torch.randint(100, 20000, (1, context)), torch.arange(context)[None], cache, last_logits_only=True)
    best = 1e9
    for _ in range(reps):
        t = time.perf_counter()
        model.forward(torch.randint(100, 20000, (1, 1)), torch.tensor([[context]]), cache, last_logits_only=True)
        best = min(best, time.perf_counter() - t)
        cache.truncate(context)
    return best * 1e3


class Timed(DraftModelDrafter):
    """A draft drafter that adds up the time of its proposals and the draft forwards they pay."""

    def __init__(self, model, one_call: bool):
        super().__init__(model, one_call=one_call)
        self.seconds, self.forwards = 0.0, 0

    def propose(self, ctx):
        t = time.perf_counter()
        tree = super().propose(ctx)
        self.seconds += time.perf_counter() - t
        self.forwards += max(tree.num_drafted, 1)  # the root's forward (the feed) and one per draft after the first
        return tree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--vocab", default="32768", help="draft head rows (FR-Spec) or full")
    ap.add_argument("--limit", type=int, default=3, help="prompts per source (code, GSM8K)")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=96)
    ap.add_argument("-k", type=int, default=6, help="draft tokens per step (fixed)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled drafts and decoding")
    args = ap.parse_args()
    target = load_model(args.target)
    draft = load_draft_model(target, args.draft, None if args.vocab == "full" else int(args.vocab))
    torch.set_num_threads(1)
    gsm = Path(__file__).resolve().parents[2] / "shared/data/gsm8k/train.jsonl"
    qs = [json.loads(line)["question"] for line in gsm.read_text().splitlines()[-args.limit:]] if gsm.exists() else []
    prompts = [encode_prompt(target, p) for p in CODE[:args.limit] + qs]
    plain = SpecDecoder(target, "none")
    drafters = {"python loop": Timed(draft, one_call=False), "one call": Timed(draft, one_call=True)}
    decoders = {name: SpecDecoder(target, d, num_draft_tokens=args.k) for name, d in drafters.items()}
    mismatches = 0
    for i, ids in enumerate(prompts):
        params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True, temperature=args.temperature, seed=i)
        ref = plain.engine.add_request(ids, params)
        while not ref.finished:
            plain.engine.step(ref)
        for name in (list(decoders) if i % 2 == 0 else list(reversed(decoders))):
            req = decoders[name].engine.add_request(ids, params)
            while not req.finished:
                decoders[name].engine.step(req)
            mismatches += req.generated != ref.generated
        print(f"prompt {i + 1}/{len(prompts)}")
    t_ms = [forward_ms(target.backend, reps=args.reps) for _ in range(2)]
    d_ms = [forward_ms(draft, reps=args.reps) for _ in range(2)]
    t1, d1 = min(t_ms), min(d_ms)
    print(f"\n{args.target} with {args.draft} (draft head {args.vocab}), k = {args.k}, T = {args.temperature}, "
          f"{target.backend.description}")
    print(f"target decode step {t1:.2f} ms; draft forward alone {d1:.2f} ms: c = {d1 / t1:.3f}\n")
    print("| drafting | draft forwards | ms per draft forward in the loop | c in the loop | loop / alone |")
    print("|---|---|---|---|---|")
    for name, d in drafters.items():
        per = d.seconds * 1e3 / max(d.forwards, 1)
        print(f"| {name} | {d.forwards} | {per:.2f} | {per / t1:.3f} | {per / d1:.2f} |")
    if args.temperature == 0:
        print(f"\noutputs equal to plain decoding: {'all' if not mismatches else f'{mismatches} MISMATCHES'}")


if __name__ == "__main__":
    main()
