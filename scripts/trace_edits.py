"""Trace the steps of ``auto`` on the edit workload, with and without the prediction: per step who drafted
(P prediction, S suffix, L the draft model, - nothing), how many tokens it drafted and how many the target
accepted, and per configuration tau, tokens per target forward and the draft model's fed tokens. Every
output is checked token-equal to plain decoding. Counts mean the same on a busy machine; ``--shares`` adds
where each configuration's time went (target prefill and verify forwards, the draft model's forwards and
one-call chains, the rest: Python), as shares of its generation time, which load moves far less than the
seconds themselves.

    python scripts/trace_edits.py --limit 3 -n 512 -k 8,32 --steps     # per-step lines too
    python scripts/trace_edits.py --category agent --limit 2 -n 256    # agent replays, turn by turn
    python scripts/trace_edits.py --category agent --limit 1 -n 128 -k 16 --shares --auto "" --auto learned_window=512
    python scripts/trace_edits.py --category translation --limit 10 -n 256 -k 16 --auto "" --auto rent_start=always

``--category``: the shipped workloads built from real material (edit, agent, fim), a Spec-Bench group
(translation, ...: each conversation's first turn) or an MT-bench category of Spec-Bench (coding, ...).

It prints one line per (item, configuration) and a summary per configuration:
``auto+pred k=32  tau 9.1  tok/fwd 8.9  steps P 40 (drafted 900, acc 850) S 3 (...) L 12 (...)``.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter, defaultdict
from collections.abc import Sequence

from verispec.api import encode_prediction, encode_prompt
from verispec.bench.datasets import GROUPS, MT_BENCH_CATEGORIES, BenchPrompt, load_spec_bench, \
    load_spec_bench_category, load_workload
from verispec.fim import fim_prompt
from verispec.drafters.base import DeclaresFeatures, DraftContext, Drafter, Observation
from verispec.drafters.prediction import PredictionDrafter
from verispec.engine import Engine
from verispec.engine.prefix_cache import PrefixCache
from verispec.models.load import load_model
from verispec.policies.draft_budget import interpolate
from verispec.registry import make_drafter
from verispec.system import threads
from verispec.tree import DraftTree
from verispec.types import SamplingParams


class Tracing(DeclaresFeatures):
    """Wraps the engine's drafter; records (source, drafted, accepted) per verified step. The source comes
    from the counters the prediction and hybrid drafters keep by source (``steps``); "-": a plain step."""

    name = "trace"

    def __init__(self, inner: Drafter, counted: Sequence[object]):
        self.inner, self.features, self.counted = inner, inner.features, counted
        self.trace: list[tuple[str, int, int]] = []
        self._seen: set[str] = set()  # requests whose prefill was observed

    def start(self, request_id: str, prompt_ids: list[int]) -> None:
        self.inner.start(request_id, prompt_ids)

    def finish(self, request_id: str) -> None:
        self.inner.finish(request_id)

    def propose(self, ctx: DraftContext) -> DraftTree:
        return self.inner.propose(ctx)

    def propose_batch(self, ctxs: Sequence[DraftContext]) -> list[DraftTree]:
        return self.inner.propose_batch(ctxs)

    def observe(self, obs: Observation) -> None:
        before = [Counter(c.steps) for c in self.counted]
        self.inner.observe(obs)
        source = "-"
        for c, b in zip(self.counted, before):
            changed = [k for k in c.steps if c.steps[k] != b[k] and k != "none"]
            if changed:
                source = {"prediction": "P", "retrieval": "S", "learned": "L", "fused": "F"}[changed[0]]
                break
        if self.features.wanted and obs.request_id not in self._seen:  # the prefill's observation, not a step
            self._seen.add(obs.request_id)
            return
        self.trace.append((source, obs.tree.num_drafted, len(obs.path)))

    def memory_bytes(self) -> int:
        return self.inner.memory_bytes()


class Clock:
    """Times calls of a model's ``forward`` (and a draft model's ``draft_chain``), wrapped on the instance,
    by what they did: ``parts[name] = [calls, tokens, seconds]``; ``context``: the cached tokens the verify
    forwards attended to; ``drafts``: the tokens the one-call chains drafted."""

    def __init__(self) -> None:
        self.parts: defaultdict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])
        self.context = self.drafts = 0

    def wrap(self, model, role: str) -> None:
        forward = model.forward

        def timed_forward(ids, positions, cache, *args, **kw):
            n, start = ids.shape[-1], cache.length
            t0 = time.perf_counter()
            out = forward(ids, positions, cache, *args, **kw)
            kind = "feed" if role != "target" else "prefill" if kw.get("last_logits_only") else "verify"
            self.add(f"{role} {kind}", n, time.perf_counter() - t0)
            if kind == "verify":
                self.context += start
            return out
        model.forward = timed_forward
        if hasattr(model, "draft_chain"):
            chain = model.draft_chain

            def timed_chain(cache, feed, *args, **kw):
                t0 = time.perf_counter()
                drafts, fed = chain(cache, feed, *args, **kw)
                self.add(f"{role} chain", len(feed), time.perf_counter() - t0)
                self.drafts += len(drafts)
                return drafts, fed
            model.draft_chain = timed_chain

    def add(self, name: str, tokens: int, seconds: float) -> None:
        part = self.parts[name]
        part[0] += 1
        part[1] += tokens
        part[2] += seconds

    def merge(self, other: "Clock") -> None:
        for name, part in other.parts.items():
            mine = self.parts[name]
            for i, value in enumerate(part):
                mine[i] += value
        self.context += other.context
        self.drafts += other.drafts

    def report(self, wall: float) -> str:
        shown = []
        for name, (calls, tokens, seconds) in sorted(self.parts.items()):
            extra = f", {self.drafts / max(1, calls):.1f} drafts" if name.endswith("chain") else ""
            ctx = f", context {self.context / max(1, calls):.0f}" if name == "target verify" else ""
            shown.append(f"{name} {seconds / wall:4.0%} ({calls:.0f} calls, {tokens / max(1, calls):.1f} tok{extra}{ctx})")
        rest = wall - sum(p[2] for p in self.parts.values())
        return "; ".join(shown + [f"rest {rest / wall:4.0%}"]) + f"; {wall:.1f} s"


def items_of(category: str, limit: int) -> list[BenchPrompt]:
    """The first ``limit`` items of a shipped workload, Spec-Bench group or MT-bench category."""
    if category in GROUPS:
        return load_spec_bench(categories=(category,), limit_per_category=limit)
    if category in MT_BENCH_CATEGORIES:
        return load_spec_bench_category(category, limit)
    return load_workload(category, limit)


def draft_cost(hybrid: Drafter, fed: int, drafted: int) -> float:
    """The draft model's time in target decode steps, estimated as the hybrid does: one draft forward
    (``DraftCost.draft``) per drafted token, ``catch_up_cost`` per other token it ran (prompts, catch-ups)."""
    learned = getattr(hybrid, "learned", None)
    if getattr(learned, "cost", None) is None:
        return 0.0
    return drafted * learned.cost.draft + max(0, fed - drafted) * hybrid.catch_up_cost


def options(text: str) -> dict[str, str]:
    """``a=1,b=2`` -> {"a": "1", "b": "2"}."""
    return dict(part.split("=", 1) for part in text.split(",") if part)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--category", default="edit", choices=("edit", "agent", "fim", *GROUPS, *MT_BENCH_CATEGORIES))
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("-n", "--max-new-tokens", type=int, default=512)
    ap.add_argument("-k", "--ks", default="8,32", help="draft budgets to trace, comma-separated")
    ap.add_argument("--steps", action="store_true", help="print every step")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shares", action="store_true", help="print where each configuration's time went")
    ap.add_argument("--auto", action="append", default=None,
                    help="options of one `auto` configuration (key=value,...; repeat for several; default: none)")
    args = ap.parse_args()
    with threads(args.threads):
        run(args)


def run(args: argparse.Namespace) -> None:
    lm = load_model(args.model)
    params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens)
    items = items_of(args.category, args.limit)
    plain = Engine(lm.backend, make_drafter("none", lm, {}), 1, prefix_cache=PrefixCache.from_mb(512))
    configs = []
    clocks: dict[str, Clock] = {}
    for k in (int(k) for k in args.ks.split(",")):
        for predicts in ((False, True) if args.category == "edit" else (False,)):
            for opts in args.auto or [""]:
                hybrid = make_drafter("auto", lm, options(opts))
                top = PredictionDrafter(hybrid)
                tracing = Tracing(top, [top, hybrid])
                label = f"auto{'+pred' if predicts else ''}{':' + opts if opts else ''} k={k}"
                configs.append((label, predicts, Engine(lm.backend, tracing, k, prefix_cache=PrefixCache.from_mb(512)),
                                tracing, hybrid, top))
                if args.shares:  # each configuration's own draft model; the target's calls are told apart below
                    clocks[label] = Clock()
                    clocks[label].wrap(hybrid.learned.model, "draft")
    target_clock = Clock()
    if args.shares:
        target_clock.wrap(lm.backend, "target")
    walls: Counter[str] = Counter()
    totals: dict[str, Counter] = {c[0]: Counter() for c in configs}
    for bp in items:
        prediction = encode_prediction(lm, bp.prediction) if bp.prediction else []
        turns = ([encode_prompt(lm, list(bp.messages[:at])) for at in bp.replayed] if bp.messages is not None
                 else [fim_prompt(lm.tokenizer, *bp.fim)] if bp.fim is not None
                 else [encode_prompt(lm, [{"role": "user", "content": bp.turns[0]}])])
        for turn, prompt in enumerate(turns):
            t0 = time.perf_counter()
            ref = [t for r in plain.generate(prompt, params) for t in r.new_token_ids]
            walls["plain"] += time.perf_counter() - t0
            for label, predicts, engine, tracing, hybrid, top in configs:
                tracing.trace.clear()
                fed0 = getattr(hybrid.learned, "fed_tokens", 0)
                out = []
                target_clock.parts.clear()
                target_clock.context = 0
                t0 = time.perf_counter()
                for r in engine.generate(prompt, params, prediction=prediction if predicts else ()):
                    out.extend(r.new_token_ids)
                walls[label] += time.perf_counter() - t0
                if args.shares:
                    clocks[label].merge(target_clock)
                fed = getattr(hybrid.learned, "fed_tokens", 0) - fed0
                steps = tracing.trace
                tot = totals[label]
                tot["tokens"] += len(out)
                tot["generations"] += 1
                tot["steps"] += len(steps)
                tot["mismatch"] += out != ref
                tot["fed"] += fed
                tot["prompt"] += len(prompt)
                verify = sum(interpolate(top.cost, d) if top.cost else 1.0 for _, d, _ in steps)
                tot["verify"] += verify
                drafting = draft_cost(hybrid, fed, sum(d for src, d, _ in steps if src == "L"))
                tot["drafting"] += drafting
                for src, d, a in steps:
                    tot[f"{src}.steps"] += 1
                    tot[f"{src}.drafted"] += d
                    tot[f"{src}.accepted"] += a
                acc = sum(a for _, _, a in steps)
                print(f"{bp.question_id}#{turn} {label:16s} prompt {len(prompt):5d} pred {len(prediction):4d} "
                      f"out {len(out):4d} steps {len(steps):4d} tau {(acc + len(steps)) / max(1, len(steps)):5.2f} "
                      f"draft-fed {fed:5d} tok/t(n) {len(out) / verify:5.2f} predicted {len(out) / (verify + drafting):5.2f}x "
                      f"{'OK' if out == ref else 'MISMATCH'}", flush=True)
                if args.steps:
                    print("   ", " ".join(f"{s}{d}/{a}" for s, d, a in steps), flush=True)
    print("\nsummary (tau = tokens per verified step after the prefill's token; tok/t(n) = tokens per unit of "
          "the verify steps' measured cost t(n), in plain decode steps: the speed-up over plain decoding if drafting "
          "were free; predicted = the same with the draft model's forwards and feeds at their estimated costs: the "
          "predicted decode speed-up over plain decoding; fed = tokens the draft model ran, of 'prompt' prompt tokens)")
    for label, tot in totals.items():
        by = "  ".join(f"{s} {tot[f'{s}.steps']} ({tot[f'{s}.drafted']} drafted, {tot[f'{s}.accepted']} acc)"
                       for s in "PSLF-" if tot[f"{s}.steps"])
        print(f"{label:16s} tau {(tot['tokens'] - tot['generations']) / max(1, tot['steps']):5.2f} steps {tot['steps']:5d} "
              f"tok/t(n) {tot['tokens'] / max(1e-9, tot['verify']):5.2f} "
              f"predicted {tot['tokens'] / max(1e-9, tot['verify'] + tot['drafting']):5.2f}x "
              f"fed {tot['fed']:6d}/{tot['prompt']:6d}  mismatches {tot['mismatch']}  {by}")
        if args.shares:
            print(f"{'':16s} time: {clocks[label].report(walls[label])}; plain decoding took {walls['plain']:.1f} s "
                  f"(noisy: interleaved turn by turn, the same load on both)")


if __name__ == "__main__":
    main()
