"""verispec's compiled CPU runtime vs llama.cpp on the same GGUF file, same thread count.

    python scripts/bench_vs_llamacpp.py                                  # SmolLM2-135M (catalog default)
    python scripts/bench_vs_llamacpp.py --model /tmp/models/qwen1.5b.gguf --threads 2 --reps 5
    python scripts/bench_vs_llamacpp.py --model qwen2.5-coder-0.5b-instruct --ctx 512,2048,8192 --isa avx2
    python scripts/bench_vs_llamacpp.py --markdown /tmp/vs_llamacpp.md

Measured on each side (times are the minimum over ``--reps``; the machine may be shared and
the minimum is the least disturbed run; the median is printed beside it):

* prefill tok/s of a ``--prefill``-token prompt from an empty cache (last token's logits only,
  as llama-bench's ``pp``);
* decode ms/token at each context c of ``--ctx``: ``--decode-n`` single-token forwards from
  position c (llama-bench ``tg N @ d c``);
* t(k) at each context c: one forward of k new tokens (a causal chain) at positions c.., rolled
  back after each (llama-bench ``pp k @ d c``), and t(k)/t(1), the price of verifying k
  drafted tokens. verispec computes the logits of all k tokens (what a speculative verifier
  needs); llama-bench's ``pp k`` only the last token's (``--last-logits-only`` makes verispec
  do the same).

Ratios are verispec / llama.cpp for times (< 1: verispec is faster) and for tok/s (> 1:
verispec is faster). The weight-streaming floor is the bytes of weights read per token
(verispec: ``backend.weight_bytes``; llama.cpp: the model size llama-bench reports) over the
machine's memory read bandwidth (numpy sums over a 1 GiB array on 1 and on ``--threads``
threads, best of 3); decode ms/token is also given as a multiple of that floor. numpy's sum
is partly compute bound and load sensitive (10.7 to 27 GB/s on one thread here), so the
floor is an estimate, not a hard bound.

Interleaving: verispec runs in a worker subprocess that keeps the model loaded (and gets
``VERISPEC_ISA`` from ``--isa``); each repetition runs one verispec pass and one llama-bench
pass (``-r 1``), alternating which goes first (A B B A A B ...), so both see the same machine
load. llama-bench redoes the depth prefill of every ``@ d c`` test in every repetition (not
timed, but it costs wall time: large ``--ctx`` on a large model is slow). Peak RSS: a fresh
subprocess loads the model and generates ``--rss-tokens`` tokens (``resource.getrusage``);
for llama.cpp the same with llama-simple (its RSS counts the mmapped GGUF pages it touched).

Load: run on a machine as quiet as you can get, and read the load average the script prints
before, during and after. llama.cpp's worker threads spin while they wait (llama-bench
``--poll 50``), so when other processes take the cores its times degrade far more than a
fair share would explain (seen here at load 4-6 on 2 cores: single passes 10-100x slower than the best, while
1-thread runs stayed within ~20%); ``--llama-args
"--poll 0"`` makes them sleep instead. Such a run says little about either runtime.

Nothing is asserted: the script prints tables (and writes them with ``--markdown``). If the
verispec side cannot load the model (e.g. a weight format the runtime does not read yet) it
says why and reports llama.cpp alone. Run one benchmark at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

KS = (1, 2, 4, 8, 16)
LLAMA_BENCH = "/work/cache/llama.cpp/build/bin/llama-bench"
RSS_PROMPT = "def fibonacci(n):\n"


def ints(text: str) -> list[int]:
    return sorted({int(x) for x in text.split(",") if x.strip()})


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# ----------------------------------------------------------------------------- memory bandwidth


def read_bandwidth(threads: int, gib: float = 1.0, reps: int = 3) -> float:
    """Bytes/s of summing a ``gib`` GiB float64 array (read only), split over ``threads``
    threads (numpy releases the GIL in reductions); best of ``reps`` after one warm-up."""
    import numpy as np

    a = np.ones(int(gib * 2**30) // 8)
    parts = np.array_split(a, threads)

    def once() -> float:
        out = [0.0] * threads
        def work(i: int) -> None:
            out[i] = float(np.add.reduce(parts[i]))
        ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        t = time.perf_counter()
        for th in ts:
            th.start()
        for th in ts:
            th.join()
        dt = time.perf_counter() - t
        assert sum(out) == a.size  # keep the sums alive
        return dt

    once()
    return a.nbytes / min(once() for _ in range(reps))


# ----------------------------------------------------------------------------- verispec worker


def worker(cfg: dict) -> None:
    """Subprocess: load the model on the compiled runtime, then answer one JSON line per
    ``rep`` line on stdin with that pass's times (ms)."""
    import numpy as np
    import torch

    from verispec.api import load_model

    def emit(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    t0 = time.perf_counter()
    try:
        lm = load_model(cfg["model"], backend="cpu")
    except Exception as err:  # noqa: BLE001 - reported to the parent, which goes on without verispec
        emit({"error": f"{type(err).__name__}: {err}"})
        return
    load_s = time.perf_counter() - t0
    model = lm.backend
    model.set_threads(cfg["threads"])
    torch.set_num_threads(1)  # the runtime's own pool does the work; torch glue stays on one thread
    ctxs, ks, prefill, dn = cfg["ctxs"], cfg["ks"], cfg["prefill"], cfg["decode_n"]
    last_only = cfg["last_logits_only"]
    extra = max(max(ks), dn)
    need = max(prefill, max(ctxs) + extra)
    if need > model.info.max_length:
        emit({"error": f"--ctx/--prefill need {need} positions; the model has {model.info.max_length}"})
        return
    vocab = model.info.vocab_size
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, min(vocab, 32000), need)).long()[None]

    def run(cache, start: int, n: int, last: bool = False) -> None:
        model.forward(ids[:, start:start + n], torch.arange(start, start + n)[None], cache, last_logits_only=last)

    # one cache row per context, each holding real K/V for ctx + extra slots (filled once, untimed)
    pool = model.new_cache_pool(len(ctxs), max(ctxs) + extra)
    rows = {c: pool.acquire() for c in ctxs}
    big = rows[max(ctxs)]
    for s in range(0, max(ctxs) + extra, 512):
        run(big, s, min(512, max(ctxs) + extra - s), last=True)
    for c in ctxs[:-1]:
        try:
            rows[c].copy_prefix(big, c + extra)
        except (NotImplementedError, ValueError):
            for s in range(0, c + extra, 512):
                run(rows[c], s, min(512, c + extra - s), last=True)
    pre_cache = model.new_cache(prefill)

    def one_pass() -> dict:
        out = {}
        pre_cache.truncate(0)
        t = time.perf_counter()
        run(pre_cache, 0, prefill, last=True)
        out["prefill_ms"] = (time.perf_counter() - t) * 1e3
        for c in ctxs:
            cache = rows[c]
            for k in ks:
                cache.truncate(c)
                t = time.perf_counter()
                run(cache, c, k, last=last_only)
                out[f"t{k}@{c}"] = (time.perf_counter() - t) * 1e3
            cache.truncate(c)
            t = time.perf_counter()
            for i in range(dn):
                run(cache, c + i, 1)
            out[f"decode@{c}"] = (time.perf_counter() - t) * 1e3 / dn
        return out

    one_pass()  # warm-up, not reported
    emit({"ready": True, "load_s": load_s, "isa": model.isa, "threads": model.threads,
          "description": getattr(model, "description", type(model).__name__), "backend_kind": lm.backend_kind,
          "weight_bytes": model.weight_bytes, "resident_bytes": getattr(model, "resident_bytes", model.weight_bytes),
          "gguf": str(getattr(model, "gguf_path", "") or "")})
    for line in sys.stdin:
        if line.strip() != "rep":
            break
        emit(one_pass())


def rss_worker(cfg: dict) -> None:
    """Subprocess: peak RSS of loading the model and generating ``rss_tokens`` tokens."""
    import resource

    import torch

    from verispec.api import SpecDecoder, load_model
    from verispec.types import SamplingParams

    lm = load_model(cfg["model"], backend="cpu")
    lm.backend.set_threads(cfg["threads"])
    torch.set_num_threads(1)
    SpecDecoder(lm, drafter="none").generate(RSS_PROMPT, SamplingParams(max_new_tokens=cfg["rss_tokens"],
                                                                        ignore_eos=True))
    print(json.dumps({"maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))


class Verispec:
    """The parent's handle on the worker subprocess."""

    def __init__(self, cfg: dict, isa: str | None):
        env = dict(os.environ)
        if isa:
            env["VERISPEC_ISA"] = isa
        self.proc = subprocess.Popen([sys.executable, __file__, "--_worker", json.dumps(cfg)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            return {"error": f"worker exited with status {self.proc.returncode} (see its stderr above)"}
        return json.loads(line)

    def rep(self) -> dict:
        self.proc.stdin.write("rep\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(60)


# ----------------------------------------------------------------------------- llama.cpp


def llama_bench(exe: str, gguf: str, threads: int, args: list[str], extra: list[str]) -> list[dict]:
    cmd = [exe, "-m", gguf, "-t", str(threads), "-r", "1", "-o", "json", *extra, *args]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr[-2000:]}")
    return json.loads(res.stdout)


def llama_pass(exe: str, gguf: str, threads: int, ctxs: list[int], ks: list[int], prefill: int,
               decode_n: int, extra: list[str]) -> tuple[dict, dict]:
    """One llama-bench repetition of every measurement -> (times in ms keyed like the worker's, facts)."""
    out, facts = {}, {}
    rows = llama_bench(exe, gguf, threads, ["-p", str(prefill), "-n", "0"], extra)
    rows += llama_bench(exe, gguf, threads, ["-p", ",".join(map(str, ks)), "-n", str(decode_n),
                                             "-d", ",".join(map(str, ctxs))], extra)
    for r in rows:
        ms = r["avg_ns"] / 1e6
        if r["n_gen"] == 0 and r["n_depth"] == 0 and r["n_prompt"] == prefill and "prefill_ms" not in out:
            out["prefill_ms"] = ms
        elif r["n_gen"] == 0:
            out[f"t{r['n_prompt']}@{r['n_depth']}"] = ms
        else:
            out[f"decode@{r['n_depth']}"] = ms / r["n_gen"]
        facts = {k: r.get(k) for k in ("build_commit", "build_number", "cpu_info", "model_type", "model_size",
                                         "model_n_params", "n_threads", "n_batch", "n_ubatch", "type_k", "type_v")}
    return out, facts


def llama_rss(llama_bench_exe: str, gguf: str, tokens: int) -> int | None:
    """Peak RSS (KiB) of llama-simple generating ``tokens`` tokens, or None without llama-simple."""
    exe = Path(llama_bench_exe).with_name("llama-simple")
    if not exe.exists():
        return None
    code = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], capture_output=True, check=True); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    res = subprocess.run([sys.executable, "-c", code, str(exe), "-m", gguf, "-n", str(tokens), RSS_PROMPT],
                         capture_output=True, text=True)
    return int(res.stdout.strip()) if res.returncode == 0 else None


# ----------------------------------------------------------------------------- report


def best(samples: list[dict], key: str) -> float | None:
    vals = [s[key] for s in samples if key in s]
    return min(vals) if vals else None


def med(samples: list[dict], key: str) -> float | None:
    vals = [s[key] for s in samples if key in s]
    return statistics.median(vals) if vals else None


def f(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or not b else f"{a / b:.2f}"


def table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def report(a, vs_info: dict, vs: list[dict], ll: list[dict], ll_facts: dict, bw: dict, rss: dict,
           gguf: str, load: tuple[str, str]) -> str:
    P = a.prefill
    out = [f"# verispec vs llama.cpp: {a.model}", ""]
    setup = [
        ["GGUF", f"{gguf} ({Path(gguf).stat().st_size / 2**20:.1f} MiB)"],
        ["threads", str(a.threads)],
        ["verispec", vs_info.get("description", vs_info.get("error", "-"))],
        ["verispec ISA", f"{vs_info.get('isa', '-')} (VERISPEC_ISA={a.isa or 'unset'})"],
        ["verispec weight bytes / token", f"{vs_info['weight_bytes'] / 2**20:.1f} MiB" if "weight_bytes" in vs_info else "-"],
        ["llama.cpp", f"{' '.join([a.llama_bench, *a.llama_args.split()])} (commit {ll_facts.get('build_commit', '-')}, "
                      f"{ll_facts.get('model_type', '-')}, K/V {ll_facts.get('type_k', '-')})"],
        ["llama.cpp model size", f"{ll_facts['model_size'] / 2**20:.1f} MiB" if ll_facts.get("model_size") else "-"],
        ["CPU", str(ll_facts.get("cpu_info", "-"))],
        ["read bandwidth (numpy sum, 1 GiB)", ", ".join(f"{t} thr: {v / 1e9:.1f} GB/s" for t, v in bw.items())],
        ["reps (interleaved)", f"{a.reps}: verispec {len(vs)}, llama.cpp {len(ll)}; min shown, median in ()"],
        ["load average", f"start {load[0]}, end {load[1]}"],
        ["t(k) logits", "verispec: " + ("last token only" if a.last_logits_only else "all k tokens")
                        + "; llama-bench pp k: last token only"],
    ]
    out += [table(["", ""], setup), ""]

    def both(key: str) -> tuple[float | None, float | None]:
        return best(vs, key), best(ll, key)

    vp, lp = both("prefill_ms")
    vtok = None if vp is None else P / vp * 1e3
    ltok = None if lp is None else P / lp * 1e3
    out += [f"## Prefill, {P} tokens", "",
            table(["", "verispec", "llama.cpp", "verispec / llama.cpp"],
                  [["tok/s", f(vtok, ".1f"), f(ltok, ".1f"), ratio(vtok, ltok)],
                   ["ms", f"{f(vp, '.1f')} ({f(med(vs, 'prefill_ms'), '.1f')})",
                    f"{f(lp, '.1f')} ({f(med(ll, 'prefill_ms'), '.1f')})", ratio(vp, lp)]]), ""]

    bw_t = bw[max(bw)]
    v_floor = vs_info["weight_bytes"] / bw_t * 1e3 if "weight_bytes" in vs_info else None
    l_floor = ll_facts["model_size"] / bw_t * 1e3 if ll_facts.get("model_size") else None
    rows = []
    for c in a.ctxs:
        vd, ld = both(f"decode@{c}")
        rows.append([str(c), f"{f(vd)} ({f(med(vs, f'decode@{c}'))})", f"{f(ld)} ({f(med(ll, f'decode@{c}'))})",
                     ratio(vd, ld), f(None if vd is None else 1e3 / vd, ".1f"), f(None if ld is None else 1e3 / ld, ".1f"),
                     ratio(vd, v_floor), ratio(ld, l_floor)])
    out += [f"## Decode ({a.decode_n} single-token forwards from position c)", "",
            f"Floor = weight bytes / {bw_t / 1e9:.1f} GB/s ({max(bw)} threads): verispec {f(v_floor)} ms, "
            f"llama.cpp {f(l_floor)} ms.", "",
            table(["ctx", "verispec ms/tok", "llama.cpp ms/tok", "verispec / llama.cpp", "verispec tok/s", "llama.cpp tok/s",
                   "verispec / floor", "llama.cpp / floor"], rows), ""]

    for c in a.ctxs:
        v1, l1 = both(f"t1@{c}")
        rows = []
        for k in a.ks:
            vk, lk = both(f"t{k}@{c}")
            rows.append([str(k), f"{f(vk)} ({f(med(vs, f't{k}@{c}'))})", f"{f(lk)} ({f(med(ll, f't{k}@{c}'))})",
                         ratio(vk, lk), ratio(vk, v1), ratio(lk, l1)])
        out += [f"## t(k) at context {c}: one forward of k new tokens", "",
                table(["k", "verispec ms", "llama.cpp ms", "verispec / llama.cpp", "verispec t(k)/t(1)", "llama.cpp t(k)/t(1)"], rows),
                ""]

    if rss:
        out += ["## Peak RSS (load + generate "
                f"{a.rss_tokens} tokens)", "",
                table(["", "MiB"], [["GGUF file", f"{Path(gguf).stat().st_size / 2**20:.1f}"],
                                    ["verispec", f(None if rss.get("verispec") is None else rss["verispec"] / 1024, ".1f")],
                                    ["llama.cpp (llama-simple)",
                                     f(None if rss.get("llama.cpp") is None else rss["llama.cpp"] / 1024, ".1f")]]), ""]
    if "error" in vs_info:
        out += [f"verispec side not measured: {vs_info['error']}", ""]
    return "\n".join(out)


# ----------------------------------------------------------------------------- main


def resolve_gguf(model: str) -> str:
    if model.endswith(".gguf"):
        return str(Path(model).expanduser().resolve())
    from verispec.models.resolve import resolve_model

    src = resolve_model(model)
    if src.kind != "gguf":
        raise SystemExit(f"{model} is not a GGUF model; llama.cpp needs one")
    return str(src.path)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] in ("--_worker", "--_rss"):
        cfg = json.loads(sys.argv[2])
        (worker if sys.argv[1] == "--_worker" else rss_worker)(cfg)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="catalog name or .gguf path")
    ap.add_argument("--gguf", help="GGUF file for llama.cpp (default: the model's own file)")
    ap.add_argument("--llama-bench", default=LLAMA_BENCH)
    ap.add_argument("--llama-args", default="", help="extra llama-bench options, e.g. '--poll 0' (threads sleep "
                    "instead of spinning: kinder to a shared machine) or '-fa 1'")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ctx", default="512", help="contexts for decode and t(k), comma-separated (e.g. 512,2048,8192)")
    ap.add_argument("--ks", default=",".join(map(str, KS)), help="k values of t(k), comma-separated (must include 1)")
    ap.add_argument("--prefill", type=int, default=512, help="prompt length of the prefill measurement")
    ap.add_argument("--decode-n", type=int, default=16, help="single-token forwards per decode measurement")
    ap.add_argument("--isa", choices=("auto", "avx512", "avx2", "scalar"), help="VERISPEC_ISA for the verispec worker")
    ap.add_argument("--last-logits-only", action="store_true", help="verispec t(k) computes the last token's logits only")
    ap.add_argument("--rss-tokens", type=int, default=64, help="tokens generated in the peak-RSS runs (0: skip)")
    ap.add_argument("--skip-llamacpp", action="store_true")
    ap.add_argument("--skip-verispec", action="store_true")
    ap.add_argument("--markdown", type=Path, help="also write the report to this file")
    a = ap.parse_args()
    a.ctxs, a.ks = ints(a.ctx), ints(a.ks)
    if not a.ks or a.ks[0] != 1:
        ap.error("--ks must include 1")
    gguf = a.gguf or resolve_gguf(a.model)
    load_start = load_avg()
    print(f"load average {load_start}; {a.model} ({gguf}), {a.threads} threads, {a.reps} reps", flush=True)

    bw = {}
    for t in sorted({1, a.threads}):
        bw[t] = read_bandwidth(t)
        print(f"read bandwidth, {t} thread(s): {bw[t] / 1e9:.1f} GB/s", flush=True)

    cfg = {"model": a.model, "threads": a.threads, "ctxs": a.ctxs, "ks": a.ks, "prefill": a.prefill,
           "decode_n": a.decode_n, "last_logits_only": a.last_logits_only, "rss_tokens": a.rss_tokens}
    vs_proc, vs_info = None, {"error": "skipped (--skip-verispec)"}
    if not a.skip_verispec:
        t = time.perf_counter()
        vs_proc = Verispec(cfg, a.isa)
        vs_info = vs_proc.info
        if "error" in vs_info:
            print(f"verispec: cannot run this model: {vs_info['error']}; llama.cpp only", flush=True)
            vs_proc.close()
            vs_proc = None
        else:
            print(f"verispec: {vs_info['description']}, loaded in {vs_info['load_s']:.1f} s, "
                  f"ready after {time.perf_counter() - t:.1f} s", flush=True)
    run_llama = not a.skip_llamacpp and Path(a.llama_bench).exists()
    if not a.skip_llamacpp and not run_llama:
        print(f"llama-bench not found at {a.llama_bench}; verispec only", flush=True)

    vs, ll, ll_facts = [], [], {}
    try:
        for rep in range(a.reps):
            t = time.perf_counter()
            order = ["verispec", "llama.cpp"] if rep % 2 == 0 else ["llama.cpp", "verispec"]
            for side in order:
                if side == "verispec" and vs_proc is not None:
                    r = vs_proc.rep()
                    if "error" in r:
                        raise RuntimeError(r["error"])
                    vs.append(r)
                elif side == "llama.cpp" and run_llama:
                    r, ll_facts = llama_pass(a.llama_bench, gguf, a.threads, a.ctxs, a.ks, a.prefill, a.decode_n,
                                             a.llama_args.split())
                    ll.append(r)
            c0 = a.ctxs[0]
            print(f"rep {rep + 1}/{a.reps} ({' then '.join(order)}): {time.perf_counter() - t:.0f} s, "
                  f"load {load_avg()}; t(1)@{c0}: verispec {f(vs[-1].get(f't1@{c0}') if vs else None)} ms, "
                  f"llama.cpp {f(ll[-1].get(f't1@{c0}') if ll else None)} ms", flush=True)
    finally:
        if vs_proc is not None:
            vs_proc.close()

    rss = {}
    if a.rss_tokens:
        if not a.skip_verispec and "error" not in vs_info:
            env = dict(os.environ, **({"VERISPEC_ISA": a.isa} if a.isa else {}))
            res = subprocess.run([sys.executable, __file__, "--_rss", json.dumps(cfg)], capture_output=True,
                                 text=True, env=env)
            lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
            rss["verispec"] = json.loads(lines[-1])["maxrss_kib"] if res.returncode == 0 and lines else None
        if run_llama:
            rss["llama.cpp"] = llama_rss(a.llama_bench, gguf, a.rss_tokens)

    text = report(a, vs_info, vs, ll, ll_facts, bw, rss, gguf, (load_start, load_avg()))
    print()
    print(text)
    if a.markdown:
        a.markdown.write_text(text + "\n")
        print(f"\nwrote {a.markdown}")


if __name__ == "__main__":
    main()
