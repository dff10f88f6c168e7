"""Benchmark the CPU runtimes (compiled ``cpu``, PyTorch ``native``, transformers eager,
llama.cpp) on SmolLM2-135M.

For each configuration: prefill tok/s on a ``--context``-token prompt, then the cost of one
forward over k new tokens at that context (k = 1 is plain decoding), reported as ms and as
the cost curve t(k)/t(1), which is what speculative decoding pays to verify k tokens. The
bandwidth floor is weight bytes / measured memory bandwidth (a large tensor copy). With
``llamacpp`` among the configurations, each one's t(1) and prefill are also given as ratios
to llama.cpp's.

    python scripts/bench_native.py                     # all configurations
    python scripts/bench_native.py --configs cpu cpu-avx2 native-int4 llamacpp --threads 2 --reps 5
    python scripts/bench_native.py --synthetic-1b --threads 2 --reps 5   # cost curve of a ~1B model
    python scripts/bench_native.py --ab --threads 1 --reps 6   # invariance cost, interleaved
    python scripts/bench_native.py --model qwen2.5-coder-1.5b-instruct --configs cpu cpu-avx2 --context 2048 \
        --prefill-logits last      # a long prompt's prefill as the engine runs it

``--prefill``: only the compiled runtime's prefill (last token's logits, as the engine runs it) at
each ``--contexts`` length, as tok/s and as a fraction of the compute roofline: weight MACs at the
int8 peak, attention's QK^T and AV MACs (fp32 in the runtime) at the fp32 FMA peak, the LM head
for the last token only; give the peaks measured by scripts/peak_macs.cpp (``--peaks INT8 FP32``,
GMAC/s on the threads used).

    python scripts/bench_native.py --model qwen2.5-coder-1.5b-instruct --prefill --contexts 512 2048 4096 \
        --peaks 465 116 --reps 3

``cpu`` runs the GGUF file's own Q4_1 blocks with the widest ISA the machine has;
``cpu-avx2`` forces the AVX2 kernels (what an AVX2-only CPU runs). ``--synthetic-1b``: a
random-weight Llama of ~0.85B parameters (dim 2048, 16 layers, 32/8 heads, ffn 5632,
vocab 32000, untied head) quantized to Q4_1 at load, on
``cpu`` and ``cpu-avx2``, to show how the verification cost curve changes with model size.

``--prefill-logits last`` times the prefill as the engine and a draft's feed of new history run it:
logits of the prompt's last token only, so the LM head runs over one row instead of every prompt
token's (on the Qwen2.5-Coder 1.5B, a fifth of a 512-token prefill); llama.cpp keeps computing
every row's logits (``logits_all``, which its steps need). The default, ``all``, keeps earlier
tables comparable.

Times are the minimum over ``--reps`` runs (the machine may be shared; the minimum is the
least disturbed). By default the configurations are interleaved: each rep times every
configuration once per measurement (prefill, then each k), in an order rotated every rep,
so they all see the same machine load; ``--sequential`` runs them one after another. Before
each timed call the script sleeps ``--gap-ms`` so that the previous configuration's waiting
threads (torch's OpenMP, llama.cpp's and the runtime's pools) are idle. Run one benchmark at
a time.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from rich.console import Console
from rich.table import Table

from verispec.models.converted import converted_hf_dir
from verispec.models.resolve import resolve_model
from verispec.models.native import NativeLlama

KS = (1, 2, 4, 8, 16)
CONFIGS = ("cpu", "cpu-avx2", "hf-fp32", "hf-bf16", "native-fp32", "native-fp32-noinv", "native-bf16",
           "native-bf16-noinv", "native-int8", "native-int8-noinv", "native-int4", "native-int4-noinv", "llamacpp")
# the "~1B" shape: 0.85B parameters (TinyLlama-1.1B's widths, 16 layers instead of 22, 8 kv heads)
SYNTHETIC_1B = dict(vocab_size=32000, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=8, intermediate_size=5632, max_position_embeddings=4096,
                    tie_word_embeddings=False, rms_norm_eps=1e-5)


@dataclass(frozen=True)
class Result:
    name: str
    setup: str  # resolved options, e.g. min_rows
    prefill_tok_s: float
    ms: dict[int, float]  # k -> ms per forward of k new tokens
    weight_bytes: int


@dataclass
class Runner:
    """One configuration, loaded: ``prefill()`` runs the ``ctx``-token prompt from an empty
    cache; ``step(k)`` rolls the cache back to ``ctx`` and runs k new tokens."""

    name: str
    setup: str
    ctx: int
    weight_bytes: int
    prefill: Callable[[], None]
    step: Callable[[int], None]
    best: dict = field(default_factory=dict)  # "prefill" or k -> min ms

    def timed(self, key, fn: Callable[[], None], gap_s: float) -> None:
        if gap_s:
            time.sleep(gap_s)
        t = time.perf_counter()
        fn()
        ms = (time.perf_counter() - t) * 1e3
        self.best[key] = min(self.best.get(key, float("inf")), ms)

    def result(self, ks) -> Result:
        return Result(self.name, self.setup, self.ctx / self.best["prefill"] * 1e3,
                      {k: self.best[k] for k in ks}, self.weight_bytes)


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


def measure(runners: list[Runner], ks, reps: int, interleave: bool, gap_s: float, console: Console) -> list[Result]:
    """Min ms of each runner's prefill and k-token steps over ``reps``, after one warm-up of each.
    Interleaved: each rep times every runner once per measurement, in an order rotated every
    rep; sequential: one runner's reps after another's."""
    def one_rep(group: list[Runner]) -> None:
        for r in group:
            r.timed("prefill", r.prefill, gap_s)
        for k in ks:
            for r in group:
                r.timed(k, lambda: r.step(k), gap_s)

    for r in runners:  # warm-up, not timed
        r.prefill()
        for k in ks:
            r.step(k)
        r.best.clear()
    if interleave:
        for rep in range(reps):
            t = time.perf_counter()
            shift = rep % len(runners)
            one_rep(runners[shift:] + runners[:shift])
            console.print(f"rep {rep + 1}/{reps}: {time.perf_counter() - t:.0f} s, load {os.getloadavg()[0]:.2f}")
    else:
        for r in runners:
            t = time.perf_counter()
            for _ in range(reps):
                one_rep([r])
            console.print(f"{r.name}: {time.perf_counter() - t:.0f} s, t(1) = {r.best[ks[0]]:.1f} ms")
    return [r.result(ks) for r in runners]


def native_runner(path, name: str, ids: torch.Tensor, ctx: int, last_logits: bool) -> Runner:
    dtype = torch.float32 if "fp32" in name or "int4" in name else torch.bfloat16
    quant = next((q for q in ("int8", "int4") if q in name), "none")
    model = NativeLlama.from_hf_dir(path, dtype=dtype, max_length=ids.shape[1] + 64, quant=quant,
                                    batch_invariant="noinv" not in name)
    return _cache_runner(model, name, ids, ctx, _native_setup(model), model.weight_bytes, last_logits)


def _native_setup(model) -> str:
    inv = model.invariance
    return f"min_rows={inv.min_rows} attn_min_rows={inv.attn_min_rows}" if inv.on else "invariance off"


def _cache_runner(model, name: str, ids: torch.Tensor, ctx: int, setup: str, weight_bytes: int,
                  last_logits: bool) -> Runner:
    """A runner for a model with ``new_cache()`` / ``cache.truncate`` (native and cpu runtimes);
    ``last_logits``: the prefill computes the last token's logits only."""
    cache = model.new_cache()
    prompt, prompt_pos = ids[:, :ctx], torch.arange(ctx)[None]
    new_ids = {k: ids[:, ctx:ctx + k] for k in range(1, ids.shape[1] - ctx + 1)}
    new_pos = {k: torch.arange(ctx, ctx + k)[None] for k in new_ids}

    def prefill():
        cache.truncate(0)
        model.forward(prompt, prompt_pos, cache, last_logits_only=last_logits)

    def step(k: int):
        cache.truncate(ctx)
        model.forward(new_ids[k], new_pos[k], cache)

    return Runner(name, setup, ctx, weight_bytes, prefill, step)


def cpu_runner(name: str, model, ids: torch.Tensor, ctx: int, last_logits: bool) -> Runner:
    """The compiled runtime (``CpuLlama``)."""
    return _cache_runner(model, name, ids, ctx, model.description, model.weight_bytes, last_logits)


def load_cpu(source, name: str, max_length: int, threads: int):
    from verispec.models.cpu import CpuLlama

    if source.kind != "gguf":
        raise SystemExit(f"{name} needs a GGUF model")
    return CpuLlama.from_hf_dir(converted_hf_dir(source), gguf=source.path, max_length=max_length, threads=threads,
                                isa="avx2" if name.endswith("avx2") else None)


def hf_runner(path, name: str, ids: torch.Tensor, ctx: int, last_logits: bool) -> Runner:
    from transformers import DynamicCache, LlamaForCausalLM

    dtype = torch.float32 if "fp32" in name else torch.bfloat16
    model = LlamaForCausalLM.from_pretrained(path, dtype=dtype).eval()
    state = {}

    @torch.inference_mode()
    def prefill():
        state["cache"] = DynamicCache(config=model.config)
        model(ids[:, :ctx], past_key_values=state["cache"], use_cache=True, logits_to_keep=1 if last_logits else 0)

    @torch.inference_mode()
    def step(k: int):
        extra = state["cache"].get_seq_length() - ctx
        if extra:
            state["cache"].crop(-extra)  # transformers 5: a negative count drops that many tokens
        model(ids[:, ctx:ctx + k], past_key_values=state["cache"], use_cache=True,
              position_ids=torch.arange(ctx, ctx + k)[None])

    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied embedding counted once
    return Runner(name, "eager, DynamicCache", ctx, nbytes, prefill, step)


def llamacpp_runner(source, name: str, ids: torch.Tensor, ctx: int, threads: int) -> Runner:
    """llama.cpp (llama-cpp-python) on the same GGUF file: ``eval`` of k tokens after
    rolling ``n_tokens`` back (it drops the KV entries past it), logits for every token as a
    speculative verifier needs (``logits_all``)."""
    from llama_cpp import Llama

    if source.kind != "gguf":
        raise SystemExit("llamacpp needs a GGUF model")
    llm = Llama(model_path=str(source.path), n_ctx=ids.shape[1] + 64, n_threads=threads, n_threads_batch=threads,
                logits_all=True, verbose=False)
    toks = ids[0].tolist()

    def prefill():
        llm.reset()
        llm.eval(toks[:ctx])

    def step(k: int):
        llm.n_tokens = ctx
        llm.eval(toks[ctx:ctx + k])

    return Runner(name, f"llama-cpp-python, {source.path.name}", ctx, prefill=prefill, step=step,
                  weight_bytes=source.path.stat().st_size)


def synthetic_1b(ids_len: int, threads: int):
    """A random-weight Llama of ~0.85B parameters (``SYNTHETIC_1B``), quantized to Q4_1 once
    and loaded twice: the widest ISA and forced AVX2. Built tensor by tensor (fp32 peak ~3.5 GB)."""
    from transformers import LlamaConfig

    from verispec.models.cpu import CpuLlama
    from verispec.models.cpu_weights import state_dict_weights

    cfg = LlamaConfig(**SYNTHETIC_1B).to_dict()
    g = torch.Generator().manual_seed(0)
    dim, ffn, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["hidden_size"] // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    shapes = {"self_attn.q_proj.weight": (dim, dim), "self_attn.k_proj.weight": (kv, dim),
              "self_attn.v_proj.weight": (kv, dim), "self_attn.o_proj.weight": (dim, dim),
              "mlp.gate_proj.weight": (ffn, dim), "mlp.up_proj.weight": (ffn, dim), "mlp.down_proj.weight": (dim, ffn)}
    state = {"model.embed_tokens.weight": torch.randn(cfg["vocab_size"], dim, generator=g) * 0.02,
             "lm_head.weight": torch.randn(cfg["vocab_size"], dim, generator=g) * 0.02,
             "model.norm.weight": torch.ones(dim)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for n, shape in shapes.items():
            state[p + n] = torch.randn(*shape, generator=g) * 0.02
        state[p + "input_layernorm.weight"] = torch.ones(dim)
        state[p + "post_attention_layernorm.weight"] = torch.ones(dim)
    params = sum(t.numel() for t in state.values())
    weights = state_dict_weights(cfg, state, "q4_1")
    del state
    kw = dict(max_length=ids_len + 64, name="synthetic-1b", threads=threads)
    models = {"cpu": CpuLlama.from_weights(cfg, weights, isa=None, **kw),
              "cpu-avx2": CpuLlama.from_weights(cfg, weights, isa="avx2", **kw)}
    return models, params, cfg["vocab_size"]


def ab_invariance(path, ids: torch.Tensor, ctx: int, rounds: int, console: Console) -> None:
    """Invariance on vs off, interleaved round by round so both see the same machine load."""
    ks = (1, 4, 8, 16)
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


def markdown(results: list[Result]) -> str:
    """The same numbers as ``render``, as markdown tables (for docs)."""
    ks = list(results[0].ms)
    peer = next((r for r in results if r.name == "llamacpp"), None)
    row = lambda cells: "| " + " | ".join(cells) + " |"  # noqa: E731
    head = ["config", *(f"t({k}) ms" for k in ks), *(f"t({k})/t(1)" for k in ks[1:]), "prefill tok/s"]
    lines = [row(head), row(["---"] + ["---:"] * (len(head) - 1))]
    for r in results:
        lines.append(row([r.name, *(f"{r.ms[k]:.2f}" for k in ks), *(f"{r.ms[k] / r.ms[1]:.2f}" for k in ks[1:]),
                          f"{r.prefill_tok_s:.0f}"]))
    if peer is not None:
        head = ["config", *(f"t({k}) / llama.cpp" for k in ks), "prefill / llama.cpp"]
        lines += ["", row(head), row(["---"] + ["---:"] * (len(head) - 1))]
        for r in results:
            lines.append(row([r.name, *(f"{r.ms[k] / peer.ms[k]:.2f}" for k in ks),
                              f"{r.prefill_tok_s / peer.prefill_tok_s:.2f}"]))
    return "\n".join(lines)


def render(results: list[Result], bandwidth: float, console: Console, title: str) -> None:
    ks = list(results[0].ms)
    table = Table(title=f"{title}, {torch.get_num_threads()} threads, copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    for col in ("config", "setup", "ms/step", "tok/s", *(f"t({k})/t(1)" for k in ks[1:]), "prefill tok/s", "floor ms"):
        table.add_column(col, justify="left" if col in ("config", "setup") else "right")
    for r in results:
        t1 = r.ms[1]
        table.add_row(r.name, r.setup, f"{t1:.2f}", f"{1e3 / t1:.1f}", *(f"{r.ms[k] / t1:.2f}" for k in ks[1:]),
                      f"{r.prefill_tok_s:.0f}", f"{r.weight_bytes / bandwidth * 1e3:.2f}")
    console.print(table)
    ms = Table(title="ms per forward of k new tokens (min over reps)")
    ms.add_column("config")
    for k in ks:
        ms.add_column(f"k={k}", justify="right")
    for r in results:
        ms.add_row(r.name, *(f"{r.ms[k]:.2f}" for k in ks))
    console.print(ms)
    peer = next((r for r in results if r.name == "llamacpp"), None)
    if peer is None:
        return
    vs = Table(title="vs llama.cpp (same GGUF, same threads): t(1) ratio < 1 and prefill ratio > 1 are better")
    for col in ("config", "t(1) / llama.cpp t(1)", *(f"t({k}) / llama.cpp t({k})" for k in ks[1:]),
                "prefill / llama.cpp prefill"):
        vs.add_column(col, justify="left" if col == "config" else "right")
    for r in results:
        vs.add_row(r.name, *(f"{r.ms[k] / peer.ms[k]:.2f}" for k in ks), f"{r.prefill_tok_s / peer.prefill_tok_s:.2f}")
    console.print(vs)


def prefill_macs(a, n: int) -> tuple[float, float]:
    """(weight, attention) MACs of an n-token prefill: every token through each layer's matrices,
    the LM head for the last token, token i's QK^T and AV over its i + 1 keys in every query head."""
    per_layer = a.dim * (a.n_heads + 2 * a.n_kv_heads) * a.head_dim + a.n_heads * a.head_dim * a.dim \
        + 3 * a.dim * a.intermediate_size
    keys = n * (n + 1) / 2
    return n * a.n_layers * per_layer + a.vocab_size * a.dim, 2 * a.n_layers * a.n_heads * a.head_dim * keys


def prefill_roofline(source, configs, contexts, peaks, reps: int, threads: int, console: Console) -> None:
    """Prefill tok/s of the compiled runtime at each context, interleaved across ``configs``,
    against the roofline of ``peaks`` (int8, fp32 GMAC/s). Also per CPU second: threads x tokens /
    the process's CPU seconds, what the forward reaches while it has the cores (on a shared
    machine, wall time also counts the time other processes had them)."""
    ids = torch.randint(0, 49152, (1, max(contexts)), generator=torch.Generator().manual_seed(0))
    models = {name: load_cpu(source, name, max(contexts) + 64, threads) for name in configs}
    caches = {name: m.new_cache() for name, m in models.items()}
    for name, m in models.items():  # warm-up (scratch pages, the pool's threads), not timed
        m.forward(ids[:, :64], torch.arange(64)[None], caches[name], last_logits_only=True)
    best: dict = {}
    for rep in range(reps):
        for n in contexts:
            for name, m in models.items():
                caches[name].truncate(0)
                t, c = time.perf_counter(), time.process_time()
                m.forward(ids[:, :n], torch.arange(n)[None], caches[name], last_logits_only=True)
                wall, cpu = best.get((name, n), (1e9, 1e9))
                best[name, n] = min(wall, time.perf_counter() - t), min(cpu, (time.process_time() - c) / threads)
        console.print(f"rep {rep + 1}/{reps}, load {os.getloadavg()[0]:.2f}")
    table = Table(title=f"prefill, {threads} threads, peaks int8 {peaks[0]:g} / fp32 {peaks[1]:g} GMAC/s")
    for col in ("config", "context", "weight GMAC", "attention GMAC", "roofline tok/s", "tok/s", "fraction",
                "tok/s per CPU s", "fraction"):
        table.add_column(col, justify="left" if col == "config" else "right")
    args = next(iter(models.values())).args
    for n in contexts:
        w, att = prefill_macs(args, n)
        roof = n / (w / 1e9 / peaks[0] + att / 1e9 / peaks[1])
        for name in models:
            wall, cpu = best[name, n]
            table.add_row(name, str(n), f"{w / 1e9:.0f}", f"{att / 1e9:.1f}", f"{roof:.0f}", f"{n / wall:.0f}",
                          f"{n / wall / roof:.2f}", f"{n / cpu:.0f}", f"{n / cpu / roof:.2f}")
    console.print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--context", type=int, default=512, help="prompt length (prefill) and decode position")
    ap.add_argument("--ks", type=int, nargs="+", default=list(KS), help="new tokens per forward (must include 1)")
    ap.add_argument("--prefill-logits", choices=("all", "last"), default="all",
                    help="the prefill's logits: every prompt token's, or the last one's as the engine asks")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sequential", action="store_true", help="one configuration after another (default: interleaved)")
    ap.add_argument("--gap-ms", type=float, default=10.0, help="sleep before each timed call (other pools go idle)")
    ap.add_argument("--synthetic-1b", action="store_true",
                    help="only the cost curve of a random ~0.85B Llama in Q4_1 on cpu and cpu-avx2")
    ap.add_argument("--ab", action="store_true", help="only the interleaved invariance on/off comparison")
    ap.add_argument("--markdown", action="store_true", help="also print the tables as markdown")
    ap.add_argument("--prefill", action="store_true", help="only the cpu configs' prefill against the roofline")
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 4096], help="prefill lengths (--prefill)")
    ap.add_argument("--peaks", type=float, nargs=2, default=[465.0, 116.0], metavar=("INT8", "FP32"),
                    help="peak GMAC/s of int8 vpdpbusd and fp32 FMA on the threads used (scripts/peak_macs.cpp)")
    args = ap.parse_args()
    ks = sorted(set(args.ks))
    if ks[0] != 1:
        ap.error("--ks must include 1 (the cost curve is relative to t(1))")
    torch.set_num_threads(args.threads)
    console = Console(width=200)
    ctx = args.context
    last = args.prefill_logits == "last"
    bandwidth = copy_bandwidth()
    console.print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
                  f"{'sequential' if args.sequential else 'interleaved'}, {args.reps} reps, gap {args.gap_ms:g} ms")
    gap_s = args.gap_ms / 1e3
    if args.synthetic_1b:
        models, params, vocab = synthetic_1b(ctx + max(ks), args.threads)
        ids = torch.randint(0, vocab, (1, ctx + max(ks)), generator=torch.Generator().manual_seed(0))
        console.print(f"synthetic Llama: {params / 1e9:.2f} B parameters, Q4_1 (head Q8_0)")
        runners = [cpu_runner(name, m, ids, ctx, last) for name, m in models.items()]
        results = measure(runners, ks, args.reps, not args.sequential, gap_s, console)
        render(results, bandwidth, console, f"synthetic {params / 1e9:.2f} B Llama (Q4_1), context {ctx}")
        if args.markdown:
            print(markdown(results))
        return
    source = resolve_model(args.model)
    if args.prefill:
        configs = [c for c in args.configs if c.startswith("cpu")] or ["cpu"]
        prefill_roofline(source, configs, sorted(args.contexts), args.peaks, args.reps, args.threads, console)
        return
    path = converted_hf_dir(source)
    ids = torch.randint(0, 49152, (1, ctx + max(*ks, 16)), generator=torch.Generator().manual_seed(0))
    console.print(f"model dir {path}")
    if args.ab:
        ab_invariance(path, ids, ctx, args.reps, console)
        return
    runners = []
    for name in args.configs:
        t = time.perf_counter()
        if name == "llamacpp":
            runners.append(llamacpp_runner(source, name, ids, ctx, args.threads))
        elif name.startswith("cpu"):
            runners.append(cpu_runner(name, load_cpu(source, name, ids.shape[1] + 64, args.threads), ids, ctx, last))
        elif name.startswith("hf"):
            runners.append(hf_runner(path, name, ids, ctx, last))
        else:
            runners.append(native_runner(path, name, ids, ctx, last))
        console.print(f"{name}: loaded in {time.perf_counter() - t:.1f} s ({runners[-1].setup})")
    results = measure(runners, ks, args.reps, not args.sequential, gap_s, console)
    render(results, bandwidth, console, f"{args.model}, context {ctx}")
    if args.markdown:
        print(markdown(results))


if __name__ == "__main__":
    main()
