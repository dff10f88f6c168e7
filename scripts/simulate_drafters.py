"""Offline greedy simulation of model-free drafters on recorded outputs (the
ArcticInference simulator idea): under greedy decoding the target's output is fixed, so
the accepted path of a draft tree is its longest root-to-node path that spells the
recorded continuation, and tau can be computed without running the target.

Only drafters that ignore ``Observation.logits`` are simulated exactly (prompt lookup,
SuffixDecoding, REST); Token Recycling and Lookahead learn from the logits and need real
runs. Combined with a measured forward-cost curve this predicts the speedup of a draft
budget, which is how the budgets in ``bench_drafters.py`` were chosen.

    python scripts/simulate_drafters.py results/issue3/baseline.json \
        --method suffix --method suffix:max_spec_factor=2 --k 8,16 --forward-ms 1:60,8:80,16:100
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch

from verispec.drafters.base import DraftContext, Observation
from verispec.sampling import make_generator
from verispec.types import SamplingParams


def simulate(drafter, rid: str, prompt: list[int], reference: list[int], k: int) -> tuple[int, int, int]:
    """(steps, accepted, drafted) of greedy speculative decoding that reproduces
    ``reference`` (the first token comes from the prefill, as in the engine)."""
    drafter.start(rid, prompt)
    tokens, steps, accepted, drafted = prompt + reference[:1], 0, 0, 0
    dummy = torch.zeros(1, 1)
    try:
        while len(tokens) - len(prompt) < len(reference):
            pos = len(tokens) - len(prompt)  # index of the next reference token
            budget = min(k, len(reference) - pos - 1)
            if budget > 0:
                tree = drafter.propose(DraftContext(rid, tokens, budget, SamplingParams(), make_generator(0, 1)))
            else:
                from verispec.tree import DraftTree

                tree = DraftTree.chain(tokens[-1], [])
            node, path = 0, []
            while pos + len(path) < len(reference):
                want = reference[pos + len(path)]
                child = next((c for c in tree.children[node] if tree.tokens[c] == want), None)
                if child is None:
                    break
                path.append(child)
                node = child
            new = [tree.tokens[i] for i in path] + reference[pos + len(path): pos + len(path) + 1]
            drafter.observe(Observation(rid, tree, path, new, dummy.expand(tree.size, 1), None))
            tokens += new
            steps += 1
            accepted += len(path)
            drafted += tree.num_drafted
    finally:
        drafter.finish(rid)
    return steps, accepted, drafted


def parse_costs(text: str) -> dict[int, float]:
    return {int(a): float(b) for a, b in (p.split(":") for p in text.split(",") if p)}


def cost_at(costs: dict[int, float], n: int) -> float:
    """Piecewise-linear interpolation of forward ms at n tree tokens."""
    xs = sorted(costs)
    if n <= xs[0]:
        return costs[xs[0]]
    for a, b in zip(xs, xs[1:]):
        if n <= b:
            return costs[a] + (costs[b] - costs[a]) * (n - a) / (b - a)
    return costs[xs[-1]] * n / xs[-1]


def main() -> None:
    from verispec.api import load_model
    from verispec.registry import make_drafter

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("records", help="JSON written by bench_drafters.py --output (records of method none)")
    ap.add_argument("--method", action="append", required=True, help="drafter[:k=v,...] (repeatable)")
    ap.add_argument("--k", default="8,16", help="draft budgets to try")
    ap.add_argument("--forward-ms", default="", help="n:ms pairs of the forward cost curve (predicts speedup)")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    args = ap.parse_args()
    data = json.load(open(args.records))
    recs = [r for r in data["records"] if r["method"] == "none"]
    costs = parse_costs(args.forward_ms) or data.get("forward_ms") and {int(a): b for a, b in data["forward_ms"].items()}
    lm = load_model(args.model)  # the tokenizer and vocabulary (options like datastore need it)
    for spec in args.method:
        name, _, rest = spec.partition(":")
        opts = dict(p.split("=", 1) for p in rest.split(",") if p)
        for k in [int(x) for x in args.k.split(",")]:
            drafter = make_drafter(name, lm, opts)
            per = defaultdict(lambda: [0, 0, 0, 0.0])  # steps, accepted, drafted, predicted ms
            for i, r in enumerate(recs):
                s, a, d = simulate(drafter, f"sim-{i}", list(r["prompt_ids"]), list(r["token_ids"]), k)
                row = per[r["category"]]
                row[0] += s
                row[1] += a
                row[2] += d
            for cat, (s, a, d, _) in sorted(per.items()):
                tau = (a + s) / s if s else 0
                line = f"{spec:40s} k={k:<3d} {cat:15s} tau {tau:5.2f} alpha {a / d if d else 0:5.2f}"
                if costs:
                    avg_nodes = 1 + d / s if s else 1
                    line += f"  predicted decode speedup {tau * cost_at(costs, 1) / cost_at(costs, avg_nodes):5.2f}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
