"""Are the cost curves context-blind where it matters? The hybrid and the draft model size drafts on t(n)
(the target's forward over root + n tree nodes, in decode steps) and price the draft model's catch-ups at
``catch_up_cost`` decode steps a token, all measured after a 128-token prompt (``cost_curve``). An agent
turn verifies and feeds at 2-3.5k tokens of history, where attention is a larger share of each forward.
This prints, per context, t(n) over that context's own decode step (what sizing compares: a draft's rate
(E + 1) / t(n) against plain decoding's 1 at the same context), the draft model's decode step over the
target's, and the draft model's feed of ``--feed`` tokens per token over the target's decode step, beside
the hybrid's estimate (``registry``: the draft step times the target's marginal t(n) per token at its
largest sizes). Minimum of repeats, contexts interleaved round by round, so load weighs on all alike; it
asserts nothing.

    python scripts/cost_at_context.py                          # Qwen2.5-Coder 1.5B + its 0.5B draft, 2 threads
    python scripts/cost_at_context.py --contexts 128,1024,3072 --rounds 3
"""

from __future__ import annotations

import argparse
import time

import torch

from verispec.cost_curve import DEFAULT_SIZES, measure_cost_curve
from verispec.models.load import load_model
from verispec.registry import make_drafter
from verispec.system import threads


def best_seconds(fn, rounds: int) -> float:
    """The fastest of ``rounds`` calls of ``fn()``, seconds (load only ever adds delay)."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@torch.inference_mode()
def step_and_feed(model, context: int, feed: int, rounds: int) -> tuple[float, float]:
    """(one decode step, one forward of ``feed`` tokens) after a ``context``-token prefill, seconds."""
    cache = model.new_cache(context + feed + 1)
    ids = torch.arange(context + feed).remainder(model.info.vocab_size - 1).add(1)[None]
    model.forward(ids[:, :context], torch.arange(context)[None], cache, last_logits_only=True)

    def step():
        model.forward(ids[:, context:context + 1], torch.tensor([[context]]), cache)
        cache.truncate(context)

    def chunk():
        model.forward(ids[:, context:], torch.arange(context, context + feed)[None], cache, last_logits_only=True)
        cache.truncate(context)
    step()
    return best_seconds(step, rounds), best_seconds(chunk, rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--contexts", default="128,1024,3072")
    ap.add_argument("--feed", type=int, default=256, help="tokens of one catch-up feed")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    with threads(args.threads):
        lm = load_model(args.model)
        hybrid = make_drafter("auto", lm, {})
        draft = hybrid.learned.model
        curves = {c: measure_cost_curve(lm.backend, DEFAULT_SIZES, 5, context=c) for c in contexts}
        timed = {c: [step_and_feed(lm.backend, c, args.feed, args.rounds),
                     step_and_feed(draft, c, args.feed, args.rounds)] for c in contexts}
    print(f"hybrid's estimates (context 128): draft step {hybrid.learned.cost.draft:.3f}, "
          f"catch-up {hybrid.catch_up_cost:.4f} decode steps a token")
    print("context  " + " ".join(f"t({n})".rjust(6) for n in DEFAULT_SIZES) + "  target step ms  draft/target step"
          "  draft feed/token (decode steps)")
    for c in contexts:
        (t_step, _), (d_step, d_feed) = timed[c]
        print(f"{c:7d}  " + " ".join(f"{curves[c][n]:6.2f}" for n in DEFAULT_SIZES)
              + f"  {1e3 * t_step:14.1f}  {d_step / t_step:17.3f}  {d_feed / args.feed / t_step:.4f}")


if __name__ == "__main__":
    main()
