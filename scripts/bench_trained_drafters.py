"""Spec-Bench (greedy) for the trained drafters vs plain decoding, in one run on the same
target instance: tau and speedup per category, plus token-id equality with plain decoding.
Speedups are over wall time and over the process's CPU time (one torch thread: robust to
other jobs on a shared machine).

    python scripts/bench_trained_drafters.py --per-category 2 --new-tokens 64
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from verispec.api import SpecDecoder, encode_prompt, load_model
from verispec.bench.datasets import load_spec_bench
from verispec.types import SamplingParams

CONFIGS = {
    "none": ("none", {}, 1),
    "eagle-chain": ("eagle", {"mode": "chain"}, 5),
    "eagle-chain3": ("eagle", {"mode": "chain"}, 3),
    "eagle-tree": ("eagle", {"mode": "tree", "depth": "6", "top_k": "6"}, 24),
    "eagle-tree12": ("eagle", {"mode": "tree", "depth": "5", "top_k": "4"}, 12),
    "medusa": ("medusa", {}, 16),
    "medusa8": ("medusa", {}, 8),
    "medusa-sequoia": ("medusa", {"tree": "sequoia"}, 32),  # DP tree, size from the measured t(n)
    "prompt-lookup": ("prompt-lookup", {}, 8),
}


def run_one(dec: SpecDecoder, prompt: list[int], params: SamplingParams):
    t0, c0 = time.perf_counter(), time.process_time()
    req = dec.engine.add_request(prompt, params)
    while not req.finished:
        dec.engine.step(req)
    return req.generated, req.stats, time.perf_counter() - t0, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--backend", default="hf", choices=["hf", "native"])
    ap.add_argument("--eagle-weights", default=None, help="EAGLE weights dir (default: the shipped head)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model("smollm2-135m-instruct", dtype="float32", backend=args.backend)
    rows = load_spec_bench(limit_per_category=args.per_category)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    names = args.configs.split(",")
    def options(n: str) -> dict:
        extra = {"weights": args.eagle_weights} if args.eagle_weights and CONFIGS[n][0] == "eagle" else {}
        return {**CONFIGS[n][1], **extra}

    decs = {n: SpecDecoder(lm, CONFIGS[n][0], options(n), num_draft_tokens=CONFIGS[n][2]) for n in names}
    agg = defaultdict(lambda: defaultdict(lambda: [0.0, 0, 0, 0, 0.0]))  # cat -> cfg -> [time, tokens, steps, acc, cpu]
    mismatches = defaultdict(int)
    for row in rows:
        prompt = encode_prompt(lm, row.turns[0][:3000])
        ref = None
        for n in names:  # interleaved per prompt: contention hits every config alike
            out, stats, dt, cpu = run_one(decs[n], prompt, params)
            if n == "none":
                ref = out
            elif ref is not None and out != ref:
                mismatches[n] += 1
            a = agg[row.category][n]
            a[0] += dt
            a[1] += len(out)
            a[2] += stats.steps
            a[3] += stats.accepted
            a[4] += cpu
        print(f"done {row.category} {row.question_id}", flush=True)
    cats = list(agg)
    print("\n| category | " + " | ".join(f"{n} tau | {n} speedup (wall / CPU)" for n in names if n != "none") + " |")
    print("|---" * (1 + 2 * (len(names) - 1)) + "|")
    total = defaultdict(lambda: [0.0, 0, 0, 0, 0.0])
    for c in cats + ["all"]:
        cells = []
        src = total if c == "all" else agg[c]
        if c != "all":
            for n in names:
                for i in range(5):
                    total[n][i] += agg[c][n][i]
        base, base_cpu = src["none"][1] / src["none"][0], src["none"][1] / src["none"][4]
        for n in names:
            if n == "none":
                continue
            t, toks, steps, acc, cpu = src[n]
            cells += [f"{(acc + steps) / max(1, steps):.2f}", f"{toks / t / base:.2f}x / {toks / cpu / base_cpu:.2f}x"]
        print(f"| {c} | " + " | ".join(cells) + " |")
    print(f"\nplain decoding: {total['none'][1] / total['none'][0]:.1f} tok/s "
          f"({total['none'][1] / total['none'][4]:.1f} per CPU-second); "
          f"outputs differing from plain (near-ties allowed, see tests/exactness.py): {dict(mismatches)}")


if __name__ == "__main__":
    main()
