"""verispec's lossless speculative decoding vs llama.cpp, plain and speculative, on the same
GGUFs, prompts (token ids) and threads, in one interleaved run (issue 23, section 4).

    python scripts/bench_spec_vs_llamacpp.py --quick                     # minutes: 1 prompt per workload, n=32
    python scripts/bench_spec_vs_llamacpp.py --markdown out.md --json out.json \\
        --plot docs/img/spec_vs_llamacpp.png                             # the full run (hours on 2 cores)
    python scripts/bench_spec_vs_llamacpp.py --method none --method draft:stop=fixed -k 4 \\
        --llama-spec draft_max=8,p_min=0.5,td=2 --workloads rewrite     # chosen methods, no sweep

Methods (rows):

* verispec: every ``--method name[:k=v,k=v]`` (a drafter of ``verispec drafters`` with its
  options, ``k=N`` sets that method's draft budget, else ``-k``); default plain (``none``),
  ``draft`` (the target's catalog draft, the 0.5B, with its tuned defaults), ``suffix``,
  ``prompt-lookup`` and ``hybrid:learned=draft``; ``--method auto`` adds the CLI's default;
  the option ``prediction=source`` (e.g. ``--method auto:prediction=source``) sends the
  rewrite workload's function as the prediction (Predicted Outputs; other workloads have none).
  One process, target loaded once, the prefix cache off (every prompt is prefilled whole).
* llama.cpp plain and llama.cpp speculative with the same draft GGUF: ``llama-server``
  (built by scripts/build_llamacpp.sh from the llama-cpp-python 0.3.16 sdist), one server per
  configuration, ``-t``/``-tb`` = ``--threads``, ``-c``/``-cd`` = ``--ctx``, greedy
  (``temperature`` 0, ``top_k`` 1), prompts sent as token ids. The server only speculates
  with ``cache_prompt`` on, so the slot is erased before every request (``POST
  /slots/0?action=erase``): no target K/V is reused between prompts (its draft context still
  reuses the shared chat-template prefix, a few dozen tokens).

llama.cpp's speculative flags are first swept on three code prompts of our own (not from any
workload): the grid of ``--sweep`` (default draft_max 3,4,8,16 x p_min 0,0.5,0.75 x draft
threads ``-td`` = threads or 1), one server at a time; the best decode tok/s is then run on
every workload (``--llama-spec`` skips the sweep).

Workloads:

* ``spec-bench``: the first turn of each Spec-Bench question, ``--limit`` per group (its six
  groups: mt_bench, translation, summarization, qa, math_reasoning, rag);
* ``coding``: Spec-Bench's 10 MT-Bench coding conversations, both turns; turn 2 is asked with
  turn 1 and verispec plain's answer to it in context (as Spec-Bench runs multi-turn), the same
  token ids for every method;
* ``rewrite``: "repeat this function with a new name and a comment above each return" over
  Python stdlib functions of 10 to 40 lines (:func:`code_rewrite_prompts`, built here from
  ``inspect.getsource``; never train on it). Sources follow the running Python's stdlib.

Interleaving: for every prompt all methods run back to back, the order rotated by one method
per prompt, llama.cpp's plain and best speculative servers staying up (idle between their
requests) beside the verispec process, so every method sees the same machine load. The load
average is printed at start and end; run on a quiet machine. llama.cpp's threads spin while
they wait (``--poll 50``): on a loaded machine its times collapse (10x and worse, seen at load
10 on 2 cores) far beyond a fair share; ``--llama-args "--poll 0"`` makes them sleep instead.

Measured per generation (greedy; stops at EOS unless ``--ignore-eos``; at most ``-n`` tokens):
prefill time (verispec: ``add_request``, the prompt forward that also yields the first token;
llama.cpp: the server's ``prompt_ms``) and decode time (everything after: verispec's
``engine.step`` loop; llama.cpp: ``predicted_ms``, which includes its draft model's prompt
prefill). Reported per workload and method:

* decode tok/s = (tokens - 1) / decode time, summed over prompts (prompt excluded), and
  end-to-end tok/s = tokens / (prefill + decode);
* tau = tokens per target decode step (verispec: (accepted + steps) / steps; llama.cpp:
  (tokens - 1) / (tokens - 1 - draft_n_accepted), as every step yields one target token);
* ratios of decode tok/s to llama.cpp plain and to llama.cpp's best speculative config;
* mismatches: prompts whose tokens differ from verispec plain's. For a verispec method that
  is a bug; for llama.cpp it is expected now and then (its kernels round differently, so near
  ties flip); llama.cpp speculative is also compared with llama.cpp plain;
* peak RSS: verispec, a fresh subprocess per method that loads target + drafter and generates
  16 tokens (VmHWM; ``--no-rss`` skips it); llama.cpp, the server's VmHWM after the run.

Outputs: markdown tables on stdout (``--markdown`` writes them), every generation and the
summaries as JSON (``--json``), grouped bars of decode tok/s per method and workload
(``--plot``). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_METHODS = ("none", "draft", "suffix", "prompt-lookup", "hybrid:learned=draft")
DEFAULT_SWEEP = "draft_max=3,4,8,16 p_min=0,0.5,0.75 td=T,1"
QUICK_SWEEP = "draft_max=4,8 p_min=0.75 td=T"
LLAMA_PLAIN, LLAMA_SPEC = "llama.cpp plain", "llama.cpp spec"
# sweep prompts: our own, in none of the workloads
SWEEP_PROMPTS = ("Write a Python function that checks whether a string is a palindrome, with tests.",
                 "Implement binary search in Python and explain its complexity.",
                 "Write a Python class for a stack with push, pop and peek, and a short usage example.")
REWRITE = "Repeat this function with a new name and a comment above each return:\n\n```python\n{src}\n```"
# stdlib functions tried in this order; those with source, 10-40 lines and a return are kept
REWRITE_CANDIDATES = (
    "textwrap:indent", "textwrap:shorten", "shlex:split", "shlex:quote", "json.decoder:JSONArray",
    "json.encoder:py_encode_basestring_ascii", "string:capwords", "fnmatch:filter", "fnmatch:fnmatch",
    "colorsys:rgb_to_hls", "colorsys:rgb_to_hsv", "colorsys:hsv_to_rgb", "statistics:median", "statistics:mode",
    "statistics:_ss", "html:escape", "html:unescape", "urllib.parse:urldefrag", "urllib.parse:urlunsplit",
    "urllib.parse:quote_from_bytes", "graphlib:TopologicalSorter.get_ready", "glob:_iglob", "heapq:_siftup",
    "bisect:bisect_left", "posixpath:normpath", "posixpath:relpath", "posixpath:commonpath", "ntpath:splitdrive",
    "difflib:get_close_matches", "calendar:monthrange", "ipaddress:collapse_addresses",
)


def load_avg() -> str:
    return Path("/proc/loadavg").read_text().strip()


def code_rewrite_prompts(limit: int | None = None) -> list[tuple[str, str, str]]:
    """(name, prompt, source) of the code-rewrite workload: deterministic stdlib functions (the
    running Python's source) of 10 to 40 lines with a ``return``, in REWRITE_CANDIDATES order."""
    import importlib

    out = []
    for cand in REWRITE_CANDIDATES:
        mod, attr = cand.split(":")
        try:
            obj = importlib.import_module(mod)
            for part in attr.split("."):
                obj = getattr(obj, part)
            src = inspect.getsource(obj)
        except (ImportError, AttributeError, OSError, TypeError):  # C builtins, missing sources
            continue
        src = textwrap.dedent(src).rstrip()
        if 10 <= len(src.splitlines()) <= 40 and "return" in src:
            out.append((cand, REWRITE.format(src=src), src))
        if limit is not None and len(out) >= limit:
            break
    return out


# ----------------------------------------------------------------------------- methods and results


@dataclass
class Gen:
    """One generation: what the tables sum."""

    tokens: list[int]
    prefill_s: float
    decode_s: float
    steps: int  # target decode steps
    accepted: int = 0
    drafted: int = 0


@dataclass
class Item:
    """One conversation of a workload; each user turn is one measured prompt."""

    workload: str
    name: str
    turns: tuple[str, ...]
    prediction: str | None = None  # what a method with prediction=source sends as Predicted Outputs


def parse_spec(spec: str, default_k: int) -> tuple[str, dict, int]:
    """``name[:k=v,k=v]`` -> (drafter, options, draft budget); ``k=N`` is the budget."""
    name, _, rest = spec.partition(":")
    opts = {}
    for pair in filter(None, (p.strip() for p in rest.split(","))):
        if "=" not in pair:
            raise SystemExit(f"method {spec!r}: option {pair!r} must look like key=value")
        key, value = pair.split("=", 1)
        opts[key.strip().replace("-", "_")] = value.strip()
    k = int(opts.pop("k", default_k))
    return name.strip(), opts, k


def strip_eos(ids: list[int], eos: set[int]) -> list[int]:
    while ids and ids[-1] in eos:
        ids = ids[:-1]
    return ids


def first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


class VerispecMethod:
    def __init__(self, lm, spec: str, default_k: int):
        from verispec.api import SpecDecoder

        name, opts, k = parse_spec(spec, default_k)
        self.label = "verispec " + spec
        # prediction=source: send the workload's source code as the prediction (Predicted Outputs)
        self.predicts = opts.pop("prediction", None) == "source"
        self.decoder = SpecDecoder(lm, name, opts, num_draft_tokens=k, prefix_cache_mb=0)

    def generate(self, ids: list[int], n: int, ignore_eos: bool, eos: set[int], prediction: list[int] = ()) -> Gen:
        from verispec.types import SamplingParams

        engine = self.decoder.engine
        t0 = time.perf_counter()
        req = engine.add_request(ids, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=ignore_eos),
                                 prediction=prediction if self.predicts else ())
        t1 = time.perf_counter()
        while not req.finished:
            engine.step(req)
        t2 = time.perf_counter()
        toks = list(req.generated) if ignore_eos else strip_eos(list(req.generated), eos)
        return Gen(toks, t1 - t0, t2 - t1, req.stats.steps, req.stats.accepted, req.stats.drafted)


class LlamaServer:
    """One llama-server process (one configuration); ``generate`` posts token ids."""

    def __init__(self, label: str, bin_dir: Path, target: str, threads: int, ctx: int, extra: list[str],
                 draft: str | None = None, cfg: dict | None = None, start_timeout: float = 900):
        self.label, self.cfg = label, cfg or {}
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.tmp = tempfile.TemporaryDirectory(prefix="vs_llama_")
        cmd = [str(bin_dir / "llama-server"), "-m", target, "-t", str(threads), "-tb", str(threads), "-c", str(ctx),
               "-np", "1", "--port", str(self.port), "--host", "127.0.0.1", "--no-webui",
               "--slot-save-path", self.tmp.name]
        if draft:
            td = int(self.cfg.get("td", threads))
            cmd += ["-md", draft, "-cd", str(ctx), "--draft-max", str(self.cfg["draft_max"]), "--draft-min", "0",
                    "--draft-p-min", str(self.cfg["p_min"]), "-td", str(td), "-tbd", str(td)]
        self.cmd = cmd + extra
        self.log = Path(self.tmp.name) / "server.log"
        self.proc = subprocess.Popen(self.cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.time() + start_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}): {' '.join(self.cmd)}\n"
                                   + self.log.read_text()[-3000:])
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:  # refused while starting, 503 while loading
                pass
            if time.time() > deadline:
                self.close()
                raise RuntimeError(f"llama-server did not become healthy in {start_timeout:.0f} s")
            time.sleep(0.5)

    def _post(self, path: str, body: dict | None) -> dict:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=3600) as r:
            return json.loads(r.read())

    def generate(self, ids: list[int], n: int, ignore_eos: bool, eos: set[int]) -> Gen:
        self._post("/slots/0?action=erase", None)  # no K/V reuse between prompts
        out = self._post("/completion", {"prompt": ids, "n_predict": n, "temperature": 0.0, "top_k": 1,
                                         "samplers": ["top_k"], "cache_prompt": True, "return_tokens": True,
                                         "ignore_eos": ignore_eos, "stream": False})
        t = out["timings"]
        toks = [int(x) for x in out.get("tokens", [])]
        toks = toks if ignore_eos else strip_eos(toks, eos)
        n_dec = max(int(t["predicted_n"]) - 1, 0)
        acc = int(t.get("draft_n_accepted", 0))
        return Gen(toks, t["prompt_ms"] / 1e3, t["predicted_ms"] / 1e3, max(n_dec - acc, 0), acc,
                   int(t.get("draft_n", 0)))

    def vmhwm_kib(self) -> int | None:
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
        except OSError:
            return None
        return None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.tmp.cleanup()


# ----------------------------------------------------------------------------- aggregation


@dataclass
class Acc:
    prompts: int = 0
    tokens: int = 0
    dec_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    steps: int = 0
    accepted: int = 0
    drafted: int = 0
    mismatch: int = 0  # vs verispec plain
    mismatch_own: int = 0  # vs the engine's own plain
    diverged_at: list = field(default_factory=list)

    def add(self, g: Gen) -> None:
        self.prompts += 1
        self.tokens += len(g.tokens)
        self.dec_tokens += max(len(g.tokens) - 1, 0)
        self.prefill_s += g.prefill_s
        self.decode_s += g.decode_s
        self.steps += g.steps
        self.accepted += g.accepted
        self.drafted += g.drafted

    def decode_tps(self) -> float:
        return self.dec_tokens / self.decode_s if self.decode_s else 0.0

    def e2e_tps(self) -> float:
        total = self.prefill_s + self.decode_s
        return self.tokens / total if total else 0.0

    def tau(self) -> float:
        return (self.steps + self.accepted) / self.steps if self.steps else 0.0


def table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def ratio(a: float, b: float | None) -> str:
    return f"{a / b:.2f}x" if b else "-"


def summary_tables(acc: dict[str, dict[str, Acc]], methods: list[str], rss: dict[str, int | None]) -> str:
    out = []
    for wl, per in acc.items():
        lp = per.get(LLAMA_PLAIN)
        ls = per.get(LLAMA_SPEC)
        lp_tps = lp.decode_tps() if lp else None
        ls_tps = ls.decode_tps() if ls else None
        lp_e2e = lp.e2e_tps() if lp else None
        rows = []
        for m in methods:
            a = per.get(m)
            if a is None or not a.prompts:
                continue
            own = "-" if m in (LLAMA_PLAIN,) or m.startswith("verispec") else f"{a.mismatch_own}/{a.prompts}"
            first = f" (first at {min(a.diverged_at)})" if a.diverged_at else ""
            r = rss.get(m)
            rows.append([m, str(a.prompts), str(a.tokens), f"{a.decode_tps():.2f}", f"{a.e2e_tps():.2f}",
                         f"{a.tau():.2f}", ratio(a.decode_tps(), lp_tps), ratio(a.decode_tps(), ls_tps),
                         ratio(a.e2e_tps(), lp_e2e), f"{a.mismatch}/{a.prompts}{first}", own,
                         "-" if r is None else f"{r / 1024:.0f}"])
        out += [f"### {wl}", "",
                table(["method", "prompts", "tokens", "decode tok/s", "e2e tok/s", "tau", "x llama plain",
                       "x llama spec", "x llama plain (e2e)", "≠ verispec plain", "≠ llama plain", "peak RSS MiB"],
                      rows), ""]
    return "\n".join(out)


def plot(path: Path, acc: dict[str, dict[str, Acc]], methods: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wls = list(acc)
    width = 0.8 / max(len(methods), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(wls) * len(methods) / 3), 4.5))
    for j, m in enumerate(methods):
        vals = [acc[w][m].decode_tps() if m in acc[w] else 0 for w in wls]
        ax.bar([i + (j - (len(methods) - 1) / 2) * width for i in range(len(wls))], vals, width, label=m)
    ax.set_xticks(range(len(wls)), wls)
    ax.set_ylabel("decode tokens/s")
    ax.set_title("verispec vs llama.cpp (same GGUFs, greedy)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


# ----------------------------------------------------------------------------- RSS subprocess


def rss_worker(cfg: dict) -> None:
    """Subprocess: load target + one method, generate 16 tokens, print VmHWM (KiB)."""
    from verispec.api import encode_prompt, load_model
    from verispec.system import set_threads

    set_threads(cfg["threads"])
    lm = load_model(cfg["target"])
    method = VerispecMethod(lm, cfg["spec"], cfg["k"])
    method.generate(encode_prompt(lm, SWEEP_PROMPTS[0]), 16, True, set())
    hwm = [ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith("VmHWM:")]
    print(json.dumps({"vmhwm_kib": int(hwm[0].split()[1])}))


def verispec_rss(args, spec: str) -> int | None:
    cfg = {"target": args.target, "spec": spec, "k": args.k, "threads": args.threads}
    res = subprocess.run([sys.executable, __file__, "--_rss", json.dumps(cfg)], capture_output=True, text=True)
    if res.returncode:
        print(f"  RSS of {spec} not measured: {res.stderr.strip().splitlines()[-1:]}")
        return None
    return json.loads(res.stdout.strip().splitlines()[-1])["vmhwm_kib"]


# ----------------------------------------------------------------------------- main


def parse_sweep(text: str, threads: int) -> list[dict]:
    """``draft_max=3,4 p_min=0,0.5 td=T,1`` -> the grid's configs (T: --threads)."""
    axes = {"draft_max": ["8"], "p_min": ["0.75"], "td": ["T"]}
    for part in text.replace(";", " ").split():
        key, _, vals = part.partition("=")
        if key not in axes or not vals:
            raise SystemExit(f"--sweep: {part!r}; expected draft_max=..., p_min=..., td=...")
        axes[key] = vals.split(",")
    return [{"draft_max": int(d), "p_min": float(p), "td": threads if t == "T" else int(t)}
            for d in axes["draft_max"] for p in axes["p_min"] for t in axes["td"]]


def cfg_name(cfg: dict) -> str:
    return f"draft_max={cfg['draft_max']} p_min={cfg['p_min']:g} td={cfg['td']}"


def llama_info(bin_dir: Path) -> str:
    res = subprocess.run([str(bin_dir / "llama-server"), "--version"], capture_output=True, text=True)
    return " ".join((res.stdout + res.stderr).split())[-200:]


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--_rss":
        rss_worker(json.loads(sys.argv[2]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="catalog name or .gguf")
    ap.add_argument("--draft", default=None, help="draft for llama.cpp (default: the target's catalog draft)")
    ap.add_argument("--method", action="append", help=f"verispec drafter name[:k=v,...] (repeat; default "
                    f"{' '.join(DEFAULT_METHODS)})")
    ap.add_argument("-k", type=int, default=16, help="verispec draft budget (methods without k=)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-n", "--max-new-tokens", type=int, default=256)
    ap.add_argument("--ignore-eos", action="store_true", help="always generate -n tokens")
    ap.add_argument("--workloads", default="spec-bench,coding,rewrite")
    ap.add_argument("--limit", type=int, default=5, help="Spec-Bench prompts per group")
    ap.add_argument("--coding-limit", type=int, default=None, help="coding conversations (default all 10)")
    ap.add_argument("--rewrite-limit", type=int, default=20, help="stdlib functions to rewrite")
    ap.add_argument("--ctx", type=int, default=4096, help="llama.cpp context; longer prompts are skipped")
    ap.add_argument("--sweep", default=DEFAULT_SWEEP, help="llama.cpp speculative grid (T = --threads)")
    ap.add_argument("--sweep-prompts", type=int, default=3)
    ap.add_argument("--llama-spec", help="skip the sweep: draft_max=N,p_min=P,td=T")
    ap.add_argument("--llama-bin", type=Path, help="llama.cpp bin dir (default: scripts/build_llamacpp.sh's)")
    ap.add_argument("--llama-args", default="", help="extra llama-server options for every server, e.g. '--poll 0'")
    ap.add_argument("--no-rss", action="store_true")
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--quick", action="store_true", help="1 prompt per workload (1 Spec-Bench group), n=32, "
                    "a 2-config sweep on 1 prompt")
    args = ap.parse_args()
    if args.quick:
        args.max_new_tokens, args.limit, args.coding_limit, args.rewrite_limit = 32, 1, 1, 1
        args.sweep_prompts = 1
        if args.sweep == DEFAULT_SWEEP:
            args.sweep = QUICK_SWEEP
    for path in (args.markdown, args.json, args.plot):  # fail before hours of work
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
                raise SystemExit(f"cannot write {path}")
    specs = args.method or list(DEFAULT_METHODS)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in workloads:
        if w not in ("spec-bench", "coding", "rewrite"):
            raise SystemExit(f"unknown workload {w!r}; choose from spec-bench, coding, rewrite")
    if args.llama_bin is None:
        res = subprocess.run([str(REPO / "scripts/build_llamacpp.sh")], capture_output=True, text=True)
        if res.returncode:
            raise SystemExit(f"scripts/build_llamacpp.sh failed: {res.stderr[-2000:]}")
        args.llama_bin = Path(res.stdout.strip().splitlines()[-1])
    extra = args.llama_args.split()
    load_start = load_avg()
    print(f"load average at start: {load_start}")

    from verispec.api import encode_prediction, encode_prompt, load_model
    from verispec.bench.datasets import load_spec_bench, load_spec_bench_category
    from verispec.models.catalog import CATALOG
    from verispec.models.resolve import resolve_model
    from verispec.system import set_threads

    set_threads(args.threads)  # before loading: the compiled runtime sizes its pool at load
    t = time.perf_counter()
    lm = load_model(args.target)
    target_gguf = str(resolve_model(args.target).path)
    draft_name = args.draft or (CATALOG[args.target].draft if args.target in CATALOG else None)
    if not draft_name:
        raise SystemExit("--draft is needed: the target has no catalog draft")
    draft_gguf = str(resolve_model(draft_name).path)
    eos = set(lm.backend.info.eos_token_ids)
    print(f"verispec target {lm.name} ({lm.backend_kind}) loaded in {time.perf_counter() - t:.1f} s; "
          f"llama.cpp: {args.llama_bin}")

    # ---- workloads
    items: list[Item] = []
    if "spec-bench" in workloads:
        groups = ("mt_bench",) if args.quick else None
        rows = load_spec_bench(limit_per_category=args.limit, **({"categories": groups} if groups else {}))
        items += [Item("spec-bench", f"{r.category}/{r.question_id}", r.turns[:1]) for r in rows]
    if "coding" in workloads:
        items += [Item("coding", f"coding/{r.question_id}", r.turns)
                  for r in load_spec_bench_category("coding", args.coding_limit)]
    if "rewrite" in workloads:
        items += [Item("rewrite", name, (p,), src) for name, p, src in code_rewrite_prompts(args.rewrite_limit)]
    n_prompts = sum(len(it.turns) for it in items)
    print(f"{len(items)} conversations, {n_prompts} prompts: "
          + ", ".join(f"{w} {sum(len(i.turns) for i in items if i.workload == w)}" for w in workloads))

    # ---- llama.cpp sweep
    sweep_rows = []
    if args.llama_spec:
        best = parse_sweep(args.llama_spec.replace(",", " "), args.threads)
        if len(best) != 1:
            raise SystemExit("--llama-spec names one configuration")
        best_cfg = best[0]
    else:
        grid = parse_sweep(args.sweep, args.threads)
        sweep_ids = [encode_prompt(lm, p) for p in SWEEP_PROMPTS[:args.sweep_prompts]]
        print(f"sweeping {len(grid)} llama.cpp speculative configs on {len(sweep_ids)} prompts")
        for cfg in grid:
            srv = LlamaServer("sweep", args.llama_bin, target_gguf, args.threads, args.ctx, extra, draft_gguf, cfg)
            a = Acc()
            try:
                for ids in sweep_ids:
                    a.add(srv.generate(ids, args.max_new_tokens, args.ignore_eos, eos))
            finally:
                srv.close()
            sweep_rows.append({**cfg, "decode_tps": a.decode_tps(), "tau": a.tau(),
                               "accept": a.accepted / a.drafted if a.drafted else 0.0})
            print(f"  {cfg_name(cfg)}: {a.decode_tps():.2f} tok/s decode, tau {a.tau():.2f}  (load {load_avg()})")
        best_cfg = max(sweep_rows, key=lambda r: r["decode_tps"])
        best_cfg = {k: best_cfg[k] for k in ("draft_max", "p_min", "td")}
    print(f"llama.cpp speculative config: {cfg_name(best_cfg)}")

    # ---- methods
    vs_methods = {}
    for spec in specs:
        m = VerispecMethod(lm, spec, args.k)
        vs_methods[m.label] = m
    import torch

    torch.set_num_threads(1)  # torch glue off the runtime pool's cores (as bench_pair.py)
    plain_label = next((lab for lab in vs_methods if parse_spec(lab.split(" ", 1)[1], 0)[0] == "none"), None)
    if plain_label is None:
        raise SystemExit("the methods must include verispec plain (--method none): it is the reference")
    servers = {LLAMA_PLAIN: LlamaServer(LLAMA_PLAIN, args.llama_bin, target_gguf, args.threads, args.ctx, extra),
               LLAMA_SPEC: LlamaServer(LLAMA_SPEC, args.llama_bin, target_gguf, args.threads, args.ctx, extra,
                                       draft_gguf, best_cfg)}
    runners = {**vs_methods, **servers}
    labels = list(runners)
    acc: dict[str, dict[str, Acc]] = {w: {m: Acc() for m in labels} for w in workloads}
    records, skipped, done = [], 0, 0
    try:
        for item in items:
            messages = []
            for turn_i, turn in enumerate(item.turns):
                messages.append({"role": "user", "content": turn})
                ids = encode_prompt(lm, messages)
                if len(ids) + args.max_new_tokens + 8 > min(args.ctx, lm.backend.info.max_length):
                    skipped += 1
                    print(f"skip {item.name} turn {turn_i + 1}: {len(ids)} prompt tokens")
                    break
                shift = done % len(labels)
                order = labels[shift:] + labels[:shift]
                gens = {}
                predicted = encode_prediction(lm, item.prediction) if item.prediction else []
                for lab in order:
                    r = runners[lab]
                    gens[lab] = (r.generate(ids, args.max_new_tokens, args.ignore_eos, eos, predicted)
                                 if isinstance(r, VerispecMethod) else r.generate(ids, args.max_new_tokens,
                                                                                 args.ignore_eos, eos))
                done += 1
                ref = gens[plain_label].tokens
                line = []
                for lab in labels:
                    g = gens[lab]
                    a = acc[item.workload][lab]
                    a.add(g)
                    d = first_diff(g.tokens, ref)
                    if d is not None:
                        a.mismatch += 1
                        a.diverged_at.append(d)
                    if lab == LLAMA_SPEC and g.tokens != gens[LLAMA_PLAIN].tokens:
                        a.mismatch_own += 1
                    dec = max(len(g.tokens) - 1, 0) / g.decode_s if g.decode_s else 0
                    line.append(f"{lab.replace('verispec ', '')} {dec:.1f}" + ("" if d is None else f" ≠@{d}"))
                    records.append({"workload": item.workload, "item": item.name, "turn": turn_i + 1,
                                    "prompt_tokens": len(ids), "method": lab, "tokens": len(g.tokens),
                                    "prefill_s": g.prefill_s, "decode_s": g.decode_s, "steps": g.steps,
                                    "accepted": g.accepted, "drafted": g.drafted, "diverged_at": d})
                print(f"[{done}/{n_prompts}] {item.workload} {item.name} t{turn_i + 1} ({len(ids)} tok) decode tok/s: "
                      + ", ".join(line), flush=True)
                answer = lm.tokenizer.decode(ref, skip_special_tokens=True).strip() or "(no answer)"
                messages.append({"role": "assistant", "content": answer})
        rss = {lab: servers[lab].vmhwm_kib() for lab in servers}
    finally:
        for srv in servers.values():
            srv.close()
    if not args.no_rss:
        print("peak RSS of each verispec method (fresh subprocess: load target + drafter, 16 tokens)")
        for lab in vs_methods:
            rss[lab] = verispec_rss(args, lab.split(" ", 1)[1])
    load_end = load_avg()
    print(f"load average at end: {load_end}")

    # ---- report
    setup = [["target", f"{target_gguf} ({Path(target_gguf).stat().st_size / 2**20:.0f} MiB)"],
             ["draft", f"{draft_gguf} ({Path(draft_gguf).stat().st_size / 2**20:.0f} MiB)"],
             ["threads", str(args.threads)],
             ["max new tokens", f"{args.max_new_tokens}" + (" (EOS ignored)" if args.ignore_eos else " (stop at EOS)")],
             ["verispec draft budget -k", str(args.k)],
             ["llama.cpp", f"{args.llama_bin} ({llama_info(args.llama_bin)}) {' '.join(extra)}".strip()],
             ["llama.cpp speculative", cfg_name(best_cfg) + ("" if args.llama_spec else " (best of the sweep)")],
             ["prompts", f"{done} run, {skipped} skipped (too long for --ctx)"],
             ["load average", f"start {load_start}; end {load_end}"]]
    md = ["# verispec vs llama.cpp: speculative decoding", "", table(["", ""], setup), ""]
    if sweep_rows:
        md += [f"## llama.cpp speculative sweep ({args.sweep_prompts} code prompts, not from the workloads)", "",
               table(["config", "decode tok/s", "tau", "accepted / drafted"],
                     [[cfg_name(r), f"{r['decode_tps']:.2f}", f"{r['tau']:.2f}", f"{r['accept']:.2f}"]
                      for r in sorted(sweep_rows, key=lambda r: -r["decode_tps"])]), ""]
    md += ["## Results", "",
           "decode tok/s: (tokens - 1) / time after the prefill; e2e: tokens / (prefill + decode); ratios on "
           "decode tok/s unless marked e2e; ≠: prompts whose tokens differ (a verispec method ≠ verispec plain is a "
           "bug; llama.cpp may flip near ties), first divergence position in ().", "",
           summary_tables(acc, labels, rss)]
    text = "\n".join(md)
    print()
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    if args.json:
        summary = {w: {m: {"prompts": a.prompts, "tokens": a.tokens, "decode_tps": a.decode_tps(),
                           "e2e_tps": a.e2e_tps(), "tau": a.tau(), "mismatch": a.mismatch,
                           "mismatch_own_plain": a.mismatch_own, "peak_rss_kib": rss.get(m)}
                       for m, a in per.items()} for w, per in acc.items()}
        args.json.write_text(json.dumps({"setup": dict(setup), "sweep": sweep_rows, "llama_spec": best_cfg,
                                         "summary": summary, "generations": records}, indent=1) + "\n")
    if args.plot:
        plot(args.plot, acc, labels)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
