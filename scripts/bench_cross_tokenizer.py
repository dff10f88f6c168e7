"""A draft model with another tokenizer drafting through text (issue 35 section 3,
``drafters/cross_tokenizer.py``): SmolLM2-135M (49,152-token vocabulary) for the
Qwen2.5-Coder 1.5B (151,936), greedy, on code prompts, beside plain decoding and the
same-tokenizer 0.5B draft. Runs are interleaved per prompt (alternating order) and every output
is checked token-equal to plain. Prints a table (acceptance = accepted / drafted target tokens;
tokens per step; decode tokens/s, the prefill excluded; speed-up over plain); asserts nothing.

    python scripts/bench_cross_tokenizer.py                      # 2 threads, n = 64, k = 3 and 5
    python scripts/bench_cross_tokenizer.py -n 96 --ks 4 --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from verispec.api import SpecDecoder, encode_prompt, load_model
from verispec.types import SamplingParams

CODE = ["Write a Python function that checks whether a string is a palindrome, with tests.",
        "Implement binary search in Python and explain its complexity.",
        "Write a Python class for a stack with push, pop and peek, and a short usage example."]


def run(dec: SpecDecoder, ids: list[int], n: int):
    req = dec.engine.add_request(ids, SamplingParams(max_new_tokens=n, ignore_eos=True))
    t = time.perf_counter()
    while not req.finished:
        dec.engine.step(req)
    return req, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="smollm2-135m-instruct", help="a model with another tokenizer")
    ap.add_argument("--same", default="qwen2.5-coder-0.5b-instruct", help="a same-tokenizer draft beside it ('' none)")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=64)
    ap.add_argument("--ks", default="3,5")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)  # the runtime's pool takes torch's thread count at load
    target = load_model(args.target)
    decs = {"plain": SpecDecoder(target, "none")}
    for k in (int(k) for k in args.ks.split(",")):
        decs[f"{args.draft} k={k}"] = SpecDecoder(target, "draft", {"model": args.draft, "max_draft": k},
                                                    num_draft_tokens=k)
    if args.same:
        decs[f"{args.same} k=4"] = SpecDecoder(target, "draft", {"model": args.same, "stop": "fixed"},
                                               num_draft_tokens=4)
    torch.set_num_threads(1)  # torch's own ops stay off the pool's cores (as the engine does per step)
    stats = {name: [0.0, 0, 0, 0, 0] for name in decs}  # seconds, tokens, steps, accepted, drafted
    mismatches = 0
    for i, ids in enumerate(encode_prompt(target, p) for p in CODE):
        outs = {}
        for name in (list(decs) if i % 2 == 0 else list(reversed(decs))):
            req, secs = run(decs[name], ids, args.max_new_tokens)
            outs[name] = req.generated
            s = stats[name]
            s[0], s[1], s[2] = s[0] + secs, s[1] + len(req.generated), s[2] + req.stats.steps
            s[3], s[4] = s[3] + req.stats.accepted, s[4] + req.stats.drafted
        bad = [name for name, out in outs.items() if out != outs["plain"]]
        mismatches += len(bad)
        print(f"prompt {i + 1}/{len(CODE)}: {'all equal to plain' if not bad else 'MISMATCH ' + ', '.join(bad)}")
    isa = getattr(target.backend, "isa", "?")
    print(f"\n{args.target}, greedy, n = {args.max_new_tokens}, {len(CODE)} code prompts, {args.threads} threads, "
          f"isa {isa}; {mismatches} mismatches\n")
    print("| draft | acceptance | tokens/step | tokens/s | speed-up |")
    print("|---|---|---|---|---|")
    base = stats["plain"][1] / stats["plain"][0]
    for name, (secs, toks, steps, acc, drafted) in stats.items():
        rate = toks / secs
        acceptance = f"{acc / drafted:.2f}" if drafted else "–"
        print(f"| {name} | {acceptance} | {(acc + steps) / max(steps, 1):.2f} | {rate:.1f} | {rate / base:.2f}x |")


if __name__ == "__main__":
    main()
