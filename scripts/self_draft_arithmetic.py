"""Self-speculation arithmetic on the Qwen2.5-Coder 1.5B (docs/benchmarks.md, issue 47): acceptance of
layer-skipped drafts of the target (`-o model=self skip=...`, greedy, k fixed) vs the draft step's cost c
(measured interleaved with the target's step); usage: python scripts/self_draft_arithmetic.py [-k K]."""
import argparse

import torch

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("-k", type=int, default=4, help="draft tokens a step (default 4)")
K = parser.parse_args().k
from verispec.api import load_model, SpecDecoder
from verispec.models.self_draft import layer_subset
from verispec.cost_curve import measure_draft_step, cached_cost_curve
from verispec.registry import _cost_key
from verispec.types import SamplingParams
torch.set_num_threads(2)
t = load_model("qwen2.5-coder-1.5b-instruct")
n = t.backend.args.n_layers
prompts = ["Write a Python function is_prime(n) with a docstring.",
           "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May? Think step by step.",
           "Explain what a hash table is in three sentences."]
sets = {"none": (), "every-other-middle(7)": tuple(range(8, 21, 2)), "middle-contig(6)": tuple(range(11, 17)),
        "odd(14)": tuple(range(1, 28, 2)), "middle-contig(10)": tuple(range(9, 19)), "last-quarter-but-last(6)": tuple(range(21, 27))}
params = SamplingParams(max_new_tokens=48, ignore_eos=True)
plain = {p: SpecDecoder(t, "none").generate(p, params).token_ids for p in prompts}
curve = cached_cost_curve(t.backend, _cost_key(t))
print("t(n):", {k: round(v, 2) for k, v in sorted(curve.items())}, flush=True)
for label, skip in sets.items():
    if not skip: continue
    keep = tuple(i for i in range(n) if i not in skip)
    sub = layer_subset(t.backend, keep)
    c = measure_draft_step(t.backend, sub, 5)[1]
    opts = {"model": "self", "skip": "+".join(map(str, skip)), "stop": "fixed"}
    dr = acc = steps = 0; same = True
    for p in prompts:
        out = SpecDecoder(t, "draft", opts, num_draft_tokens=K).generate(p, params)
        same &= out.token_ids == plain[p]
        dr += out.stats.drafted; acc += out.stats.accepted; steps += out.stats.steps
    tau = (acc + steps) / steps
    tk = curve.get(K + 1) or min(curve.items(), key=lambda kv: abs(kv[0] - K - 1))[1]
    est = tau / (K * c + tk)
    print(f"{label:26s} skip {len(skip):2d}/{n}: c={c:.2f} alpha={acc/dr:.2f} tokens/step={tau:.2f} "
          f"est speed-up={est:.2f}x (k={K}, t(k+1)={tk:.2f}) greedy-equal={same}", flush=True)
