"""Benchmark the native runtime against transformers eager on SmolLM2-135M (CPU).

For each configuration: prefill tok/s on a ``--context``-token prompt, then the cost of one
forward over k new tokens at that context (k = 1 is plain decoding), reported as ms and as
the cost curve t(k)/t(1), which is what speculative decoding pays to verify k tokens. The
bandwidth floor is weight bytes / measured memory bandwidth (a large tensor copy).

    python scripts/bench_native.py                     # all configurations
    python scripts/bench_native.py --configs native-fp32 native-int8 --reps 5
    python scripts/bench_native.py --ab --threads 1 --reps 6   # invariance cost, interleaved

Times are the minimum over ``--reps`` runs (the machine may be shared; the minimum is the
least disturbed). Run one benchmark at a time.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch
from rich.console import Console
from rich.table import Table

from verispec.models.loading import materialize, resolve_model
from verispec.models.native import NativeLlama

KS = (1, 2, 4, 8, 16, 32)
CONFIGS = ("hf-fp32", "hf-bf16", "native-fp32", "native-fp32-noinv", "native-bf16", "native-bf16-noinv",
           "native-int8", "native-int8-noinv", "native-int4", "native-int4-noinv", "llamacpp")


@dataclass(frozen=True)
class Result:
    name: str
    setup: str  # resolved options, e.g. min_rows
    prefill_tok_s: float
    ms: dict[int, float]  # k -> ms per forward of k new tokens
    weight_bytes: int


def best_of(fn: Callable[[], None], reps: int) -> float:
    """Minimum wall time of ``fn`` in ms, after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def copy_bandwidth(mb: int = 512) -> float:
    """Bytes/s of a large tensor copy (read + write counted)."""
    a = torch.ones(mb * 2**20 // 4)
    b = torch.empty_like(a)
    ms = best_of(lambda: b.copy_(a), 5)
    return 2 * a.numel() * 4 / (ms / 1e3)


def bench_native(path, name: str, ids: torch.Tensor, reps: int) -> Result:
    dtype = torch.float32 if "fp32" in name or "int4" in name else torch.bfloat16
    quant = next((q for q in ("int8", "int4") if q in name), "none")
    model = NativeLlama.from_hf_dir(path, dtype=dtype, max_length=ids.shape[1] + 64, quant=quant,
                                    batch_invariant="noinv" not in name)
    ctx = ids.shape[1] - max(KS)
    cache = model.new_cache()

    def prefill():
        cache.truncate(0)
        model.forward(ids[:, :ctx], torch.arange(ctx)[None], cache)

    prefill_ms = best_of(prefill, max(1, reps // 2))

    def step(k: int) -> Callable[[], None]:
        def run():
            cache.truncate(ctx)
            model.forward(ids[:, ctx:ctx + k], torch.arange(ctx, ctx + k)[None], cache)
        return run

    o = model.options
    setup = f"min_rows={o.min_rows} attn_min_rows={o.attn_min_rows}" if o.batch_invariant else "invariance off"
    return Result(name, setup, ctx / prefill_ms * 1e3, {k: best_of(step(k), reps) for k in KS}, model.weight_bytes)


def bench_hf(path, name: str, ids: torch.Tensor, reps: int) -> Result:
    from transformers import DynamicCache, LlamaForCausalLM

    dtype = torch.float32 if "fp32" in name else torch.bfloat16
    model = LlamaForCausalLM.from_pretrained(path, dtype=dtype).eval()
    ctx = ids.shape[1] - max(KS)
    state = {}

    @torch.inference_mode()
    def prefill():
        state["cache"] = DynamicCache(config=model.config)
        model(ids[:, :ctx], past_key_values=state["cache"], use_cache=True)

    prefill_ms = best_of(prefill, max(1, reps // 2))

    def step(k: int) -> Callable[[], None]:
        @torch.inference_mode()
        def run():
            extra = state["cache"].get_seq_length() - ctx
            if extra:
                state["cache"].crop(-extra)  # transformers 5: a negative count drops that many tokens
            model(ids[:, ctx:ctx + k], past_key_values=state["cache"], use_cache=True,
                  position_ids=torch.arange(ctx, ctx + k)[None])
        return run

    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied embedding counted once
    return Result(name, "eager, DynamicCache", ctx / prefill_ms * 1e3, {k: best_of(step(k), reps) for k in KS}, nbytes)


def bench_llamacpp(source, name: str, ids: torch.Tensor, reps: int, threads: int) -> Result:
    """llama.cpp (llama-cpp-python) on the same GGUF file: ``eval`` of k tokens after
    rolling ``n_tokens`` back (it drops the KV entries past it), logits for every token as a
    speculative verifier needs (``logits_all``)."""
    from llama_cpp import Llama

    if source.kind != "gguf":
        raise SystemExit("llamacpp needs a GGUF model")
    llm = Llama(model_path=str(source.path), n_ctx=ids.shape[1] + 64, n_threads=threads, n_threads_batch=threads,
                logits_all=True, verbose=False)
    toks = ids[0].tolist()
    ctx = ids.shape[1] - max(KS)

    def prefill():
        llm.reset()
        llm.eval(toks[:ctx])

    prefill_ms = best_of(prefill, max(1, reps // 2))

    def step(k: int) -> Callable[[], None]:
        def run():
            llm.n_tokens = ctx
            llm.eval(toks[ctx:ctx + k])
        return run

    return Result(name, f"llama-cpp-python, {source.path.name}", ctx / prefill_ms * 1e3,
                  {k: best_of(step(k), reps) for k in KS}, source.path.stat().st_size)


def ab_invariance(path, ids: torch.Tensor, rounds: int, console: Console) -> None:
    """Invariance on vs off, interleaved round by round so both see the same machine load."""
    ctx, ks = ids.shape[1] - max(KS), (1, 4, 8, 16)
    models = {}
    for name, dtype, quant in (("fp32", torch.float32, "none"), ("int8", torch.bfloat16, "int8"),
                               ("bf16", torch.bfloat16, "none")):
        for inv in (True, False):
            m = NativeLlama.from_hf_dir(path, dtype=dtype, quant=quant, batch_invariant=inv, max_length=ids.shape[1] + 64)
            cache = m.new_cache()
            m.forward(ids[:, :ctx], torch.arange(ctx)[None], cache)
            models[name, inv] = (m, cache)
    best: dict = {}
    for _ in range(rounds):
        for k in ks:
            for key, (m, cache) in models.items():
                cache.truncate(ctx)
                t = time.perf_counter()
                m.forward(ids[:, ctx:ctx + k], torch.arange(ctx, ctx + k)[None], cache)
                best[key, k] = min(best.get((key, k), 1e9), (time.perf_counter() - t) * 1e3)
    table = Table(title=f"batch invariance cost, interleaved A/B ({rounds} rounds, min)")
    for col in ("dtype", "k", "invariant ms", "off ms", "cost"):
        table.add_column(col, justify="right")
    for name in ("fp32", "int8", "bf16"):
        for k in ks:
            a, b = best[(name, True), k], best[(name, False), k]
            table.add_row(name, str(k), f"{a:.1f}", f"{b:.1f}", f"{a / b:.2f}x")
    console.print(table)


def render(results: list[Result], bandwidth: float, console: Console) -> None:
    table = Table(title=f"SmolLM2-135M, {torch.get_num_threads()} threads, copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    for col in ("config", "setup", "ms/step", "tok/s", *(f"t({k})/t(1)" for k in KS[1:]), "prefill tok/s", "floor ms"):
        table.add_column(col, justify="left" if col in ("config", "setup") else "right")
    for r in results:
        t1 = r.ms[1]
        table.add_row(r.name, r.setup, f"{t1:.1f}", f"{1e3 / t1:.1f}", *(f"{r.ms[k] / t1:.2f}" for k in KS[1:]),
                      f"{r.prefill_tok_s:.0f}", f"{r.weight_bytes / bandwidth * 1e3:.1f}")
    console.print(table)
    ms = Table(title="ms per forward of k new tokens")
    ms.add_column("config")
    for k in KS:
        ms.add_column(f"k={k}", justify="right")
    for r in results:
        ms.add_row(r.name, *(f"{r.ms[k]:.1f}" for k in KS))
    console.print(ms)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--context", type=int, default=512, help="prompt length (prefill) and decode position")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ab", action="store_true", help="only the interleaved invariance on/off comparison")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    console = Console()
    path = materialize(resolve_model(args.model))
    ids = torch.randint(0, 49152, (1, args.context + max(KS)), generator=torch.Generator().manual_seed(0))
    bandwidth = copy_bandwidth()
    console.print(f"load average {os.getloadavg()[0]:.1f}; model dir {path}")
    if args.ab:
        ab_invariance(path, ids, args.reps, console)
        return
    results = []
    for name in args.configs:
        t = time.perf_counter()
        if name == "llamacpp":
            results.append(bench_llamacpp(resolve_model(args.model), name, ids, args.reps, args.threads))
        else:
            bench = bench_hf if name.startswith("hf") else bench_native
            results.append(bench(path, name, ids, args.reps))
        console.print(f"{name}: done in {time.perf_counter() - t:.0f} s, t(1) = {results[-1].ms[1]:.1f} ms")
    render(results, bandwidth, console)


if __name__ == "__main__":
    main()
