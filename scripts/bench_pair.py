"""Speculation on a real target/draft pair, arithmetic first (issue 23): measure the target's
t(n) (one forward over the root and n drafted tokens, in decode steps) and the draft's cost c
per token, and predict the speed-up of every draft length k as E(k) / (k c + t(k)) from the
tokens per step E(k) each run reached; beside it the measured speed-up of the same runs: interleaved runs of plain decoding and the
draft drafter (fixed k, and cost-sized drafts), every output checked token-equal to plain.
Prints tables; asserts nothing.

    python scripts/bench_pair.py                                  # Qwen2.5-Coder 1.5B + 0.5B, GSM8K/code prompts
    python scripts/bench_pair.py --data spec-bench --limit 2 -n 128 --markdown out.md
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from verispec.api import SpecDecoder, encode_prompt, load_draft_model, load_model
from verispec.types import SamplingParams

CODE = ["Write a Python function that checks whether a string is a palindrome, with tests.",
        "Implement binary search in Python and explain its complexity.",
        "Write a Python class for a stack with push, pop and peek, and a short usage example."]


def prompts(args, model) -> list[list[int]]:
    if args.data == "spec-bench":
        from verispec.bench.datasets import load_spec_bench

        rows = load_spec_bench(limit_per_category=args.limit)
        return [encode_prompt(model, r.turns[0][:2000]) for r in rows]
    gsm = Path(__file__).resolve().parents[2] / "shared/data/gsm8k/train.jsonl"
    qs = [json.loads(line)["question"] for line in gsm.read_text().splitlines()[-args.limit:]]
    return [encode_prompt(model, p) for p in CODE[:args.limit] + qs]


def forward_curve(model, sizes, context=256, reps=7) -> dict[int, float]:
    """t(n) / t(0): a causal chain of 1 + n tokens after a context-token prefill, best of reps."""
    cache = model.new_cache(context + max(sizes) + 8)
    model.forward(torch.randint(100, 20000, (1, context)), torch.arange(context)[None], cache, last_logits_only=True)
    best = {}
    for _ in range(reps):
        for n in sizes:
            x = torch.randint(100, 20000, (1, n + 1))
            t = time.perf_counter()
            model.forward(x, torch.arange(context, context + n + 1)[None], cache)
            best[n] = min(best.get(n, 1e9), time.perf_counter() - t)
            cache.truncate(context)
    return {n: best[n] / best[0] for n in sizes} | {"t0_ms": best[0] * 1e3}


def run(dec, ids, n, temperature=0.0, seed=0):
    engine = dec.engine
    t = time.perf_counter()
    req = engine.add_request(ids, SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=temperature, seed=seed))
    t1 = time.perf_counter()
    while not req.finished:
        engine.step(req)
    return req, time.perf_counter() - t1, t1 - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--vocab", default="32768", help="draft head rows (FR-Spec) or full")
    ap.add_argument("--data", default="tuning", choices=("tuning", "spec-bench"))
    ap.add_argument("--limit", type=int, default=3, help="prompts per source (spec-bench: per category)")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=96)
    ap.add_argument("--ks", default="2,3,4,5,6,8")
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled (outputs differ by design; "
                    "the sampling law is tested in tests/, not here)")
    ap.add_argument("--methods", default="", help="comma-separated extra drafters run as they are by default "
                    "(e.g. auto,draft): the default configuration beside the fixed-k rows")
    ap.add_argument("--markdown", type=Path)
    args = ap.parse_args()
    target = load_model(args.target)  # the runtime's pool takes torch's thread count at load
    vocab = None if args.vocab == "full" else int(args.vocab)
    draft = load_draft_model(target, args.draft, vocab)
    torch.set_num_threads(1)  # then torch's own ops stay off the pool's cores (as the engine does per step)
    ks = [int(k) for k in args.ks.split(",")]
    lines = []
    say = lambda s="": (print(s), lines.append(s))  # noqa: E731

    curve = forward_curve(target.backend, [0, *range(1, max(ks) + 1)])
    dcurve = forward_curve(draft, [0])
    c = dcurve["t0_ms"] / curve["t0_ms"]
    say(f"## {args.target} with {args.draft} (draft head: {args.vocab}), {args.data}\n")
    say(f"target decode step t(0) = {curve['t0_ms']:.1f} ms; draft step = {dcurve['t0_ms']:.1f} ms (c = {c:.3f})\n")
    say("| n drafted | " + " | ".join(str(k) for k in ks) + " |")
    say("|---|" + "---|" * len(ks))
    say("| t(n) / t(0) | " + " | ".join(f"{curve[k]:.2f}" for k in ks) + " |\n")

    ps = prompts(args, target)
    plain = SpecDecoder(target, "none")
    decs = {"plain": plain}
    for k in ks:
        decs[f"k={k}"] = SpecDecoder(target, "draft", {"model": args.draft, "vocab": args.vocab, "stop": "fixed"},
                                     num_draft_tokens=k)
    for name in filter(None, args.methods.split(",")):
        decs[name] = SpecDecoder(target, name, num_draft_tokens=16)  # as `verispec generate`
    decs["cost-sized (k<=12)"] = SpecDecoder(target, "draft", {"model": args.draft, "vocab": args.vocab, "stop": "cost"},
                                             num_draft_tokens=12)
    stats = {name: [0.0, 0, 0, 0, 0] for name in decs}  # seconds, tokens, steps, accepted, drafted
    for i, ids in enumerate(ps):
        order = list(decs) if i % 2 == 0 else list(reversed(decs))  # interleaved, alternating order
        outs = {}
        for name in order:
            req, secs, _ = run(decs[name], ids, args.max_new_tokens, args.temperature, seed=i)
            outs[name] = req.generated
            s = stats[name]
            s[0] += secs
            s[1] += len(req.generated) - 1
            s[2] += req.stats.steps
            s[3] += req.stats.accepted
            s[4] += req.stats.drafted
        ref = outs["plain"]
        bad = [n for n, o in outs.items() if o != ref]
        if args.temperature > 0:
            print(f"prompt {i + 1}/{len(ps)}: sampled at T = {args.temperature}")
        else:
            print(f"prompt {i + 1}/{len(ps)}: {'all equal to plain' if not bad else 'MISMATCH ' + ', '.join(bad)}")
    base = stats["plain"][0] / stats["plain"][1]
    say("| method | tokens/step E | alpha | predicted | measured speed-up | ms/token |")
    say("|---|---|---|---|---|---|")
    for name, (secs, toks, steps, acc, drafted) in stats.items():
        e = (acc + steps) / max(steps, 1)
        pred = "1.00" if name == "plain" else "–"
        if name.startswith("k="):
            k = int(name[2:])
            pred = f"{e / (k * c + curve[k]):.2f}"
        say(f"| {name} | {e:.2f} | {acc / max(drafted, 1):.2f} | {pred} | {base / (secs / toks):.2f}x | "
            f"{secs / toks * 1e3:.1f} |")
    if args.markdown:
        args.markdown.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
