"""Offline greedy simulation of the hybrid's choice between SuffixDecoding and a draft model,
on a real target/draft pair, from recorded outputs (the ArcticInference simulator idea,
extended to a draft model): under greedy decoding the target's output is fixed, and a draft
chain started at position i is accepted exactly as long as the draft's teacher-forced argmax
along the recorded output spells it (while the chain is right, its context is the recorded
one). One draft forward over prompt + output therefore gives every chain's acceptance, and
SuffixDecoding runs as itself. Costs are the measured curves: the target's t(n) and the
draft's forward of T tokens, both in target decode steps; speed-up = tokens / cost.

Prompts are tuning prompts only (never Spec-Bench, never the benchmark's rewrite functions):
our own code tasks, GSM8K train questions and "repeat this function" on stdlib functions from
modules the benchmark does not use. This chose ``min_match=6`` for ``--drafter auto``.

    python scripts/simulate_hybrid.py --record refs.json -n 192      # generate + draft predictions
    python scripts/simulate_hybrid.py --measure-curves curves.json     # t(n) and the draft's forwards
    python scripts/simulate_hybrid.py --refs refs.json --curves curves.json --min-match 0,4,6,8,12
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
import textwrap
import time
from collections import defaultdict
from pathlib import Path

import torch

from verispec.drafters.base import DraftContext, Observation
from verispec.drafters.draft_model import DraftCost
from verispec.drafters.suffix_tree import SuffixDecodingDrafter
from verispec.policies.draft_budget import best_size, interpolate
from verispec.sampling import make_generator
from verispec.tree import DraftTree
from verispec.types import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_spec_vs_llamacpp import REWRITE, REWRITE_CANDIDATES  # noqa: E402

CODE = ["Write a Python function that checks whether a string is a palindrome, with tests.",
        "Implement binary search in Python and explain its complexity.",
        "Write a Python class for a stack with push, pop and peek, and a short usage example.",
        "Write a Python function that parses a CSV line with quoted fields, without the csv module.",
        "Implement an LRU cache class in Python with get and put in O(1).",
        "Write a Python script that counts word frequencies in a text file and prints the top 10.",
        "Explain the difference between a list and a tuple in Python, with examples.",
        "Write a function that merges two sorted lists into one sorted list, and test it."]
# stdlib modules the benchmark's rewrite workload does not draw from
TUNING_MODULES = ("pprint", "inspect", "tokenize", "locale", "gettext", "mimetypes", "configparser", "zipfile",
                  "csv", "email.utils", "quopri", "base64", "copy", "dis", "pickletools", "platform")


def tuning_prompts(gsm8k: Path | None, n_rewrite: int = 8) -> list[tuple[str, str]]:
    """(kind, prompt): code tasks, rewrites of stdlib functions outside the benchmark, GSM8K."""
    used = {c.split(":")[0] for c in REWRITE_CANDIDATES}
    rewrites = []
    for mod in (m for m in TUNING_MODULES if m not in used):
        module = importlib.import_module(mod)
        for _, obj in sorted(vars(module).items()):
            if inspect.isfunction(obj) and obj.__module__ == module.__name__:
                try:
                    src = textwrap.dedent(inspect.getsource(obj)).rstrip()
                except (OSError, TypeError):
                    continue
                if 10 <= len(src.splitlines()) <= 40 and "return" in src:
                    rewrites.append(REWRITE.format(src=src))
                    break
        if len(rewrites) >= n_rewrite:
            break
    gsm = [json.loads(line)["question"] for line in gsm8k.read_text().splitlines()[:4]] if gsm8k else []
    return [("code", p) for p in CODE] + [("rewrite", p) for p in rewrites] + [("gsm8k", p) for p in gsm]


def record(args) -> None:
    """Greedy outputs (SuffixDecoding: lossless, faster than plain) and the draft's
    teacher-forced argmax and top probability at every position of prompt + output."""
    from verispec.api import SpecDecoder, encode_prompt, load_draft_model, load_model

    lm = load_model(args.target)
    dec = SpecDecoder(lm, "suffix", prefix_cache_mb=0)
    draft = load_draft_model(lm, args.draft, vocab=32768, requant="q4_0")
    out = []
    for i, (kind, prompt) in enumerate(tuning_prompts(args.gsm8k)):
        ids = encode_prompt(lm, prompt)
        t0 = time.perf_counter()
        req = dec.engine.add_request(ids, SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0))
        while not req.finished:
            dec.engine.step(req)
        ref = list(req.generated)
        dec.engine.finish(req, "stop")
        seq = ids + ref
        with torch.inference_mode():
            logits = draft.forward(torch.tensor([seq]), torch.arange(len(seq))[None], draft.new_cache(len(seq) + 1)).logits[0]
        top, arg = logits.float().softmax(-1).max(-1)
        out.append({"kind": kind, "prompt": ids, "ref": ref, "d_arg": arg.tolist(), "d_top": top.tolist()})
        print(f"[{i + 1}] {kind}: {len(ids)} prompt + {len(ref)} tokens, {time.perf_counter() - t0:.1f} s", flush=True)
    Path(args.record).write_text(json.dumps(out))


def measure_curves(args) -> None:
    """Fastest of 9 forwards of T tokens after a 200-token context, target (all logits, as a
    verification) and draft (last logits, as a catch-up feed), over a target decode step."""
    from verispec.api import load_draft_model, load_model

    lm = load_model(args.target)
    draft = load_draft_model(lm, args.draft, vocab=32768, requant="q4_0")
    torch.set_num_threads(1)  # torch's glue only; the runtime keeps its own threads
    ctx, out = 200, {}

    def timed(model, cache, rows: int, last: bool) -> float:
        best = float("inf")
        for _ in range(9):
            t0 = time.perf_counter()
            model.forward(torch.arange(rows)[None] + 50, torch.arange(ctx, ctx + rows)[None], cache, last_logits_only=last)
            best = min(best, time.perf_counter() - t0)
            cache.truncate(ctx)
        return best

    caches = []
    for model in (lm.backend, draft):
        cache = model.new_cache(ctx + 40)
        model.forward(torch.arange(ctx)[None] % 1000 + 5, torch.arange(ctx)[None], cache, last_logits_only=True)
        caches.append(cache)
    for rows in (*range(1, 18), 20, 24, 32):
        out[rows] = (timed(lm.backend, caches[0], rows, False), timed(draft, caches[1], rows, True))
    step = out[1][0]
    Path(args.measure_curves).write_text(json.dumps({r: [a / step, b / step] for r, (a, b) in out.items()}, indent=0))
    print(f"target step {step * 1e3:.1f} ms; " + " ".join(f"t({r - 1})={a / step:.2f}" for r, (a, _) in out.items()))


class Costs:
    """t(n): target forward over the root and n drafted tokens; d(T): draft forward of T tokens;
    both in target decode steps. File: {"T": [target T rows, draft T rows], ...}."""

    def __init__(self, path: Path):
        rows = {int(k): v for k, v in json.loads(path.read_text()).items()}
        self.t_curve = {n - 1: v[0] for n, v in rows.items() if n > 1}
        self.d_curve = {n: v[1] for n, v in rows.items()}

    def t(self, n: int) -> float:
        return 1.0 if n == 0 else interpolate(self.t_curve, n)

    def d(self, rows: int) -> float:
        return interpolate(self.d_curve, max(1, rows), at_zero=0.0)


class Sim:
    """One request replayed: ``pos`` output tokens committed, the draft's cache holding ``fed``."""

    def __init__(self, r: dict):
        self.prompt, self.ref, self.arg, self.top = r["prompt"], r["ref"], r["d_arg"], r["d_top"]
        self.seq, self.pos, self.fed = r["prompt"] + r["ref"], 1, len(r["prompt"])

    def draft_chain(self, costs: Costs, budget: int) -> tuple[list[int], float]:
        """The draft model's chain and its cost, under DraftModelDrafter's cost rule (its
        confidence standing in for acceptance)."""
        root = len(self.prompt) + self.pos - 1
        cost, toks, reach, expected = costs.d(root + 1 - self.fed), [], 1.0, 1.0
        rule = DraftCost(costs.d(1), costs.t_curve)
        for i in range(min(budget, len(self.arg) - root)):
            conf = self.top[root + i]
            if not rule.keeps(i, expected, reach * conf):
                break
            reach, expected = reach * conf, expected + reach * conf
            toks.append(self.arg[root + i])
            if i + 1 < budget:
                if not rule.pays_another(i, expected, reach * conf):
                    break
                cost += rule.draft
        return toks, cost

    def accept(self, tree: DraftTree) -> list[int]:
        node, path = 0, []
        while self.pos + len(path) < len(self.ref):
            want = self.ref[self.pos + len(path)]
            node = next((c for c in tree.children[node] if tree.tokens[c] == want), None)
            if node is None:
                break
            path.append(node)
        return path


def simulate(refs: list[dict], costs: Costs, policy: str, min_match: int = 0, budget: int = 16,
             truncate: bool = True) -> dict:
    """policy: suffix (SuffixDecodingDrafter alone: its whole speculation) | draft | hybrid
    (suffix after a ``min_match`` match when it pays, sized by the cost curve unless not
    ``truncate``; else the draft). The draft model's prompt is prefilled at the request's start
    (``DraftModelDrafter.start``), outside the decode time simulated here."""
    suffix = SuffixDecodingDrafter(max_depth=64, max_match=32, max_spec_factor=2.0, min_token_prob=0.1,
                                   max_global_tokens=100_000, min_score=0.0)
    tot, gen = defaultdict(float), make_generator(0, 1)
    for i, r in enumerate(refs):
        s, rid = Sim(r), f"r{i}"
        suffix.start(rid, s.prompt)
        while s.pos < len(s.ref):
            left = len(s.ref) - s.pos - 1
            ctx = DraftContext(rid, s.seq[:len(s.prompt) + s.pos], min(budget, max(left, 1)), SamplingParams(), gen)
            sd = suffix.speculate(ctx)
            values = list(sd.probs) if sd.match_length >= min_match and sum(sd.probs) >= 1.0 else []
            r_n = best_size(values, costs.t_curve)[0] if values else 0
            draft_cost, src = 0.0, "suffix"
            if policy == "suffix":  # as SuffixDecodingDrafter proposes alone: its whole speculation
                tree = sd.to_tree(ctx.tokens[-1]) if sum(sd.probs) >= 1.5 else DraftTree.chain(ctx.tokens[-1], [])
            elif policy == "hybrid" and r_n:
                full = sd.to_tree(ctx.tokens[-1])
                tree = full if not truncate else DraftTree(full.tokens[:r_n + 1], full.parents[:r_n + 1])
            else:
                toks, draft_cost = s.draft_chain(costs, min(budget, left)) if left > 0 else ([], 0.0)
                tree, src = DraftTree.chain(ctx.tokens[-1], toks), "draft"
            path = s.accept(tree)
            tot["cost"] += costs.t(tree.num_drafted) + draft_cost
            tot["tokens"] += len(path) + 1
            tot["steps"] += 1
            tot[f"steps_{src}"] += 1
            new = [tree.tokens[j] for j in path] + s.ref[s.pos + len(path): s.pos + len(path) + 1]
            suffix.observe(Observation(rid, tree, path, new, torch.zeros(tree.size, 1), None))
            root = len(s.prompt) + s.pos - 1
            if src == "draft":  # the draft's cache: root and the drafted tokens fed, minus rejected ones
                s.fed = min(root + tree.num_drafted, root + 1 + len(path))
            s.pos += len(path) + 1
        suffix.finish(rid)
    return {"speedup": tot["tokens"] / tot["cost"], "tau": tot["tokens"] / tot["steps"],
            "suffix_share": tot["steps_suffix"] / tot["steps"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--record", help="write greedy references + draft predictions here, then stop")
    ap.add_argument("--measure-curves", help="measure the pair's cost curves into this JSON, then stop")
    ap.add_argument("--refs", help="references written by --record")
    ap.add_argument("--curves", help='cost curves JSON: {"T": [target t(T rows), draft forward of T rows], ...}')
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--gsm8k", type=Path, default=None, help="GSM8K train.jsonl (4 questions)")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=192)
    ap.add_argument("--min-match", default="0,4,6,8,12")
    args = ap.parse_args()
    if args.record or args.measure_curves:
        record(args) if args.record else measure_curves(args)
        return
    if not (args.refs and args.curves):
        raise SystemExit("give --record OUT, or --refs and --curves")
    refs, costs = json.loads(Path(args.refs).read_text()), Costs(Path(args.curves))
    print("t(n): " + " ".join(f"{n}:{costs.t(n):.2f}" for n in (1, 2, 4, 7, 8, 16)) + f"; draft step {costs.d(1):.3f}")
    policies = [("suffix", 0, True), ("draft", 0, True)] + [("hybrid", int(m), True) for m in args.min_match.split(",")]
    head = ["workload"] + [p if p != "hybrid" else f"hybrid min_match={m}" for p, m, _ in policies]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for kind in sorted({r["kind"] for r in refs}):
        rows = [r for r in refs if r["kind"] == kind]
        cells = [simulate(rows, costs, p, m, truncate=t) for p, m, t in policies]
        print(f"| {kind} ({len(rows)}) | " + " | ".join(f"{c['speedup']:.2f}x (tau {c['tau']:.2f})" for c in cells) + " |")


if __name__ == "__main__":
    main()
