"""The server's batched step with a draft model: requests drafted together (one draft forward
per draft step for all rows, ``DraftModelDrafter.propose_batch``) against the same requests
drafted one by one (``pool_rows=1``: every request its own draft cache), interleaved, on the
Qwen2.5-Coder pair. Every row's tokens are checked equal to plain decoding's. Prints a table;
asserts nothing.

    python scripts/bench_batched_draft.py --batch 4 -n 64 --method draft --rounds 2
"""

from __future__ import annotations

import argparse
import time

from verispec.api import encode_prompt, load_model
from verispec.engine import Engine
from verispec.engine.batch import BatchEngine, SpecSchedule
from verispec.registry import make_drafter
from verispec.types import SamplingParams

PROMPTS = ["Write a Python function that checks whether a string is a palindrome, with tests.",
           "Implement binary search in Python and explain its complexity.",
           "Write a Python class for a stack with push, pop and peek, and a short usage example.",
           "Write a function that merges two sorted lists into one sorted list, and test it.",
           "Implement an LRU cache class in Python with get and put in O(1).",
           "Write a Python script that counts word frequencies in a text file and prints the top 10.",
           "Explain the difference between a list and a tuple in Python, with examples.",
           "Write a Python function that parses a CSV line with quoted fields, without the csv module."]


def run_batch(lm, drafter, prompts: list[list[int]], n: int, k: int) -> tuple[list[list[int]], float, int]:
    """(each row's tokens, seconds, steps) of the prompts as rows of one BatchEngine."""
    be = BatchEngine(lm.backend, {"m": Engine(lm.backend, drafter, k)}, max_batch=len(prompts),
                     max_length=max(map(len, prompts)) + n + 1, schedule=SpecSchedule("budget", 0))
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    reqs = [be.add_request(f"r{i}", p, params, "m") for i, p in enumerate(prompts)]
    t0, steps = time.perf_counter(), 0
    while not all(r.finished for r in reqs):
        be.step([r for r in reqs if not r.finished])
        steps += 1
    seconds = time.perf_counter() - t0
    out = [r.generated for r in reqs]
    for r in reqs:
        be.release(r)
    return out, seconds, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--method", default="draft", help="draft, or auto (the hybrid: its suffix side learns across rounds)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-k", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    lm = load_model(args.target)
    together = make_drafter(args.method, lm)
    # one shared pool row: the first request drafts in it, every other one alone (its own cache)
    alone = make_drafter(args.method, lm, {"learned_pool_rows": 1} if args.method in ("auto", "hybrid") else {"pool_rows": 1})
    plain = make_drafter("none", lm)
    totals = {"together": [0.0, 0], "alone": [0.0, 0]}
    for r in range(args.rounds):  # each round its own prompts (a suffix drafter's global trie learns answers)
        prompts = [encode_prompt(lm, p) for p in (PROMPTS * 4)[r * args.batch:(r + 1) * args.batch]]
        ref, _, _ = run_batch(lm, plain, prompts, args.n, 1)
        for name, d in (("together", together), ("alone", alone)) if r % 2 == 0 else (("alone", alone), ("together", together)):
            out, seconds, steps = run_batch(lm, d, prompts, args.n, args.k)
            bad = sum(a != b for a, b in zip(out, ref))
            totals[name][0] += seconds
            totals[name][1] += steps
            print(f"round {r + 1} {name:8}: {sum(map(len, out)) / seconds:6.1f} tok/s, {steps} steps, {bad} rows != plain")
    tokens = args.batch * args.n * args.rounds
    print(f"\n| {args.batch} rows, {args.method} | tok/s | steps |\n|---|---|---|")
    for name, (seconds, steps) in totals.items():
        print(f"| drafted {name} | {tokens / seconds:.1f} | {steps} |")
    print(f"\ntogether / alone: {totals['alone'][0] / totals['together'][0]:.2f}x")


if __name__ == "__main__":
    main()
