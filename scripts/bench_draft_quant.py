"""Decode cost of a GGUF draft model on the compiled runtime by the format its matrices are
re-encoded to at load (``-o quant=``, ``models.cpu_weights.requantize``): the file's own
blocks, Q4_0, Q3_K, Q2_K (issue 33: is a lower-bit draft cheaper per token?). Each model keeps
the FR-Spec head a catalog draft gets (``-o vocab=32768``). Prints, per format, the bytes of
repacked weights one token streams and ms per decoded token at a ``--context``-token cache:
the minimum over ``--reps`` interleaved rounds (each round times every format once, in a
rotated order, so all see the same machine load). Asserts nothing.

    python scripts/bench_draft_quant.py                          # Qwen2.5-Coder 0.5B
    python scripts/bench_draft_quant.py --threads 2 --reps 7 --tokens 32
"""

from __future__ import annotations

import argparse
import time

import torch

from verispec.models.cpu import CpuLlama
from verispec.models.cpu_weights import REQUANTS, gguf_weights
from verispec.models.formats import formats_label
from verispec.models.gguf_tokenizer import load_gguf_tokenizer
from verispec.models.load import gguf_context
from verispec.models.resolve import resolve_model
from verispec.weights import frequent_tokens


def load(name: str, quant: str, vocab: int, threads: int) -> CpuLlama:
    source = resolve_model(name)
    info, cfg = source.gguf, source.config
    specials = sorted(load_gguf_tokenizer(info).added_tokens_decoder)
    rows = frequent_tokens(source.name, vocab, specials)
    weights = gguf_weights(info, cfg, head_rows=rows, requant=None if quant == "file" else quant)
    return CpuLlama.from_weights(cfg, weights, gguf_context(source, cfg), name=f"{name}[{quant}]",
                                 head_rows=rows, threads=threads)


def decode_ms(model: CpuLlama, context: int, tokens: int) -> float:
    """ms per token of ``tokens`` one-token forwards after a ``context``-token prefill."""
    cache = model.new_cache(context + tokens)
    ids = torch.randint(0, 1000, (1, context), generator=torch.Generator().manual_seed(0))
    model.forward(ids, torch.arange(context)[None], cache)
    t0 = time.perf_counter()
    for i in range(tokens):
        model.forward(ids[:, i:i + 1], torch.tensor([[context + i]]), cache)
    return (time.perf_counter() - t0) / tokens * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--quants", nargs="+", default=["file", *REQUANTS])
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    models = {q: load(args.model, q, args.vocab, args.threads) for q in args.quants}
    best = {q: float("inf") for q in models}
    for rep in range(args.reps):
        order = list(models)[rep % len(models):] + list(models)[:rep % len(models)]
        for q in order:
            best[q] = min(best[q], decode_ms(models[q], args.context, args.tokens))
    print(f"{args.model}, vocab {args.vocab}, context {args.context}, {args.threads} threads, isa {models['file'].isa}:")
    for q, model in models.items():
        print(f"  {q:6s} {formats_label(model.formats):28s} {model.weight_bytes / 1e6:7.1f} MB/token  {best[q]:6.2f} ms/token")


if __name__ == "__main__":
    main()
