"""Cheaper draft forwards, each measured as (acceptance, cost) (issue 33, section 1): a draft
model with layers skipped (``-o skip=``), with its attention over a sliding window (``-o
window=``), requantized lower (``-o quant=``) or with a smaller FR-Spec head (``-o vocab=``),
against the draft as it ships (``auto``: Q4_0, 32,768-row head, every layer, full attention).

Acceptance is counted, not timed, so a busy machine does not move it: the target's greedy
continuation of each tuning prompt is computed once; every draft variant then reads prompt +
continuation in one forward, and its argmax at each position is what it would draft there after
an accepted prefix (greedy speculation conditions the draft on the target's own tokens). A
fixed-k chain started at position i is accepted up to the first disagreement, so the engine's
steps, and tau(k), follow exactly from those argmaxes. The cost c of each variant is its
weight bytes per token scaled from the shipped draft's measured c (``--c0``: 0.35 on AVX-512,
docs/benchmarks.md), and optionally its measured step (``--time``); predicted speed-up over
plain decoding = tau(k) / (k c + t(k+1) / t(1)), with the verify curve t(k) given (``--curve``;
default: the AVX-512 Zen 5 curve of docs/benchmarks.md, issue 33).

Tuning material only (CPython stdlib code, GSM8K train questions); never Spec-Bench.

    python scripts/bench_draft_shapes.py --variants auto skip=11,12 window=256 quant=q3_k vocab=16384
    python scripts/bench_draft_shapes.py --greedy-skip 6     # choose layers to skip, one at a time
"""

from __future__ import annotations

import argparse
import json
import random
import sysconfig
from pathlib import Path

import torch

from verispec.api import SpecDecoder, encode_prompt, load_model
from verispec.cost_curve import measure_draft_step
from verispec.models.formats import WeightFormat
from verispec.models.load import DraftShape, load_draft_model
from verispec.types import SamplingParams


# t(k)/t(1), k = 1..9: AVX-512 Zen 5, Qwen2.5-Coder 1.5B, context 512 (docs/benchmarks.md, issue 33:
# 29.5, 32.8, 36.4, 59.3 ms at k = 1, 2, 4, 8; linear between)
AVX512_CURVE = [1.0, 1.112, 1.173, 1.234, 1.428, 1.622, 1.816, 2.010, 2.25]


def tuning_prompts(target, n_code: int, n_gsm: int, code_context: int, seed: int = 0) -> list[list[int]]:
    """Stdlib files cut at a line after ``code_context`` tokens (continuation, no chat) and GSM8K
    train questions through the chat template."""
    rng = random.Random(seed)
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in lib.glob("*.py") if 4000 < p.stat().st_size < 200_000)
    prompts = []
    for path in rng.sample(files, n_code):
        ids = target.tokenizer.encode(path.read_text(errors="replace"))[:code_context]
        prompts.append(ids)
    gsm = Path(__file__).resolve().parents[2] / "shared/data/gsm8k/train.jsonl"
    if gsm.exists() and n_gsm:
        lines = gsm.read_text().splitlines()
        for line in rng.sample(lines, n_gsm):
            prompts.append(encode_prompt(target, json.loads(line)["question"], chat=True))
    return prompts


def continuations(target, prompts: list[list[int]], n: int) -> list[list[int]]:
    """The target's greedy continuation of each prompt (through speculation: the same tokens)."""
    dec = SpecDecoder(target, "auto")
    out = []
    for i, ids in enumerate(prompts):
        req = dec.engine.add_request(ids, SamplingParams(max_new_tokens=n, ignore_eos=True))
        while not req.finished:
            dec.engine.step(req)
        out.append(list(req.generated))
        print(f"  target continuation {i + 1}/{len(prompts)}", flush=True)
    return out


def draft_argmax(draft, prompt: list[int], cont: list[int]) -> list[int]:
    """The draft's argmax after prompt + cont[:i] for i in 0..len(cont)-1, one forward."""
    seq = prompt + cont[:-1]
    cache = draft.new_cache(len(seq) + 8)
    logits = draft.forward(torch.tensor([seq]), torch.arange(len(seq))[None], cache).logits[0]
    return logits[len(prompt) - 1:].argmax(-1).tolist()


def tau(matches: list[list[bool]], k: int) -> float:
    """Tokens per target step of greedy fixed-k chains over these sequences."""
    tokens = steps = 0
    for m in matches:
        i = 0
        while i < len(m):
            a = 0
            while a < k and i + a < len(m) and m[i + a]:
                a += 1
            i += a + 1  # the accepted drafts plus the target's own token
            tokens += a + 1
            steps += 1
    return tokens / steps


def parse_variant(text: str) -> tuple[str, dict]:
    if text == "auto":
        return text, {}
    opts = dict(part.split("=", 1) for part in text.split(";"))
    return text, opts


def load_variant(target, name: str, opts: dict):
    vocab = opts.get("vocab", "32768")
    quant = opts.get("quant", "q4_0")
    skip = tuple(int(i) for i in opts["skip"].split(",")) if opts.get("skip") else ()
    shape = DraftShape(skip=skip, window=int(opts.get("window", 0)))
    return load_draft_model(target, name, None if vocab == "full" else int(vocab),
                            None if quant == "file" else WeightFormat(quant), shape)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--variants", nargs="*", default=["auto"],
                    help="auto, or options joined by ';': skip=11,12;window=256;quant=q3_k;vocab=16384")
    ap.add_argument("--greedy-skip", type=int, default=0, help="choose this many layers to skip, one at a time")
    ap.add_argument("--code", type=int, default=8, help="stdlib continuation prompts")
    ap.add_argument("--gsm", type=int, default=4, help="GSM8K train questions")
    ap.add_argument("--context", type=int, default=384, help="tokens of stdlib code before the continuation")
    ap.add_argument("-n", type=int, default=128, help="target tokens per prompt")
    ap.add_argument("--ks", type=int, nargs="*", default=[2, 4, 6, 8])
    ap.add_argument("--time", action="store_true", help="also time each variant's step (noisy on a busy machine)")
    ap.add_argument("--curve", type=float, nargs=9, default=AVX512_CURVE, help="t(k)/t(1) for k = 1..9")
    ap.add_argument("--c0", type=float, default=0.35, help="the shipped draft's measured c (a target step's fraction)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    target = load_model(args.target)
    prompts = tuning_prompts(target, args.code, args.gsm, args.context)
    print(f"{len(prompts)} tuning prompts; target continuations of {args.n} tokens", flush=True)
    conts = continuations(target, prompts, args.n)
    curve = dict(enumerate(args.curve, 1))
    base_bytes: list[int] = []

    def evaluate(name: str, opts: dict) -> dict:
        draft = load_variant(target, args.draft, opts)
        matches = []
        for p, c in zip(prompts, conts):
            am = draft_argmax(draft, p, c)
            matches.append([a == b for a, b in zip(am, c)])
        alpha = sum(map(sum, matches)) / sum(map(len, matches))
        context = args.context + args.n  # K/V bytes read per draft token, at the end of a continuation
        cfg = draft.args
        kv = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2 * sum(
            min(context, w or context) for w in (cfg.layer_windows or (0,) * cfg.n_layers)) / cfg.n_layers
        nbytes = draft.weight_bytes + kv
        base_bytes.append(base_bytes[0] if base_bytes else nbytes)
        row = {"variant": name, "alpha": alpha, "tau": {k: tau(matches, k) for k in args.ks},
               "c": args.c0 * nbytes / base_bytes[0], "mb": nbytes / 1e6}
        if args.time:
            row["c_timed"] = measure_draft_step(target.backend, draft)[1]
        del draft
        return row

    rows = [evaluate(*parse_variant(v)) for v in args.variants]
    if args.greedy_skip:
        skip: list[int] = []
        n_layers = 24
        for _ in range(args.greedy_skip):
            best = None
            for i in range(n_layers):
                if i in skip:
                    continue
                trial = sorted(skip + [i])
                r = evaluate(f"skip={','.join(map(str, trial))}", {"skip": ",".join(map(str, trial))})
                print(f"    skip {trial}: alpha {r['alpha']:.3f}", flush=True)
                if best is None or r["alpha"] > best["alpha"]:
                    best, chosen = r, i
            skip.append(chosen)
            rows.append(best)
            print(f"  skip {sorted(skip)}: alpha {best['alpha']:.3f}", flush=True)
    print(f"\n{args.target} verified, {args.draft} drafting; {len(prompts)} tuning prompts x {args.n} tokens; "
          f"{target.backend.description}")
    print("t(k)/t(1): " + ", ".join(f"{k}: {v:.2f}" for k, v in sorted(curve.items())))
    print(f"c by bytes: the first variant's c is --c0 = {args.c0}; the others scale with weight + K/V bytes\n")
    head = ("| variant | MB per draft token | c | alpha | " + " | ".join(f"tau k={k}" for k in args.ks) +
            " | best predicted speed-up |" + (" c timed |" if args.time else ""))
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        cells = " | ".join(f"{r['tau'][k]:.2f}" for k in args.ks)
        best = max((r["tau"][k] / (k * r["c"] + curve[k + 1]), k) for k in args.ks if k + 1 in curve)
        print(f"| {r['variant']} | {r['mb']:.0f} | {r['c']:.3f} | {r['alpha']:.3f} | {cells} | {best[0]:.2f}x (k={best[1]}) |"
              + (f" {r['c_timed']:.3f} |" if args.time else ""))


if __name__ == "__main__":
    main()
