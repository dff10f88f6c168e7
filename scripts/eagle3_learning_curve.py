"""EAGLE-3 learning curve for the Qwen2.5-Coder 1.5B target, and whether a head can beat the 0.5B draft model
(issue 33, section 1: "a draft head on the target's own features, if it can pay").

Training data: teacher-forced features of the target (its compiled runtime, the features it serves) on
CPython's own standard library (``Lib/``, no tests, no site-packages): tuning material, never Spec-Bench.
The labels are the target's own next-token distributions at every position (soft labels, as
``train/eagle3.py``), but the text is the library's, not the target's greedy output: a stated proxy for
on-policy data, cheaper per token than generating it. Files are split by a hash of their path; every
training token is seen once (a one-pass curve: constant learning rate after warm-up, the head evaluated
at each token milestone of the same run).

Evaluation, on held-out files only:

* ``greedy`` (exact): the target's own greedy continuations of held-out code prefixes. On text the target
  generated itself, teacher forcing is decoding with every earlier draft accepted, so the head's
  training-time-test unroll (``ttt_unroll``) is exactly its draft chain, and the draft model's
  predictions are exactly its chain: E(k) = 1 + mean accepted length of a k-token chain, for both drafters
  on the same positions.
* ``forced`` (proxy, larger): top-1 agreement of the head's depth-d draft with the target's argmax on
  held-out library text (``train/eagle3.py``'s ``evaluate`` metric).

Cost model (Leviathan et al. 2023, arXiv 2211.17192; the repo's ``E(k) / (k c + t(k+1))``): a chain of k
drafts at c target steps each, verified in one forward of k+1 tokens costing t(k+1)/t(1) steps. t(k) is
the AVX-512 VNNI curve of docs/benchmarks.md (issue 33 section); c of the 0.5B draft as measured there.

    python scripts/eagle3_learning_curve.py --out /tmp/eagle3-qwen --milestones 10000 20000 40000 80000 \
        --max-minutes 55          # trains, evaluates at each milestone, writes results.json
    python scripts/eagle3_learning_curve.py --out /tmp/eagle3-qwen --report --plot docs/img/eagle3_qwen_curve.png
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
import zlib
from pathlib import Path

import numpy as np
import torch

from verispec.api import load_model
from verispec.train.corpus import ROLE_ANSWER, Sequence
from verispec.train.eagle3 import Eagle3TrainOptions, init_eagle3, make_batch, ttt_loss, ttt_unroll
from verispec.train.features import Teacher
from verispec.train.loop import TrainConfig, train

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
LAYERS = (2, 14, 27)  # low / middle / high of 28 (the last: the head starts as an EAGLE head on the final state)
T_CURVE = {1: 1.0, 2: 1.11, 4: 1.23, 8: 2.01, 16: 3.93}  # t(k)/t(1), AVX-512 VNNI, docs/benchmarks.md issue 33
C_DRAFT = 0.35  # the 0.5B draft's cost per token in the loop, same section
TARGET_BYTES = 980e6  # weight bytes streamed per target step


def t_ratio(k: int) -> float:
    """t(k)/t(1), linear between the measured points."""
    pts = sorted(T_CURVE)
    for a, b in zip(pts, pts[1:]):
        if a <= k <= b:
            return T_CURVE[a] + (T_CURVE[b] - T_CURVE[a]) * (k - a) / (b - a)
    raise ValueError(f"k={k} outside the measured t(k) curve")


def speedup(e_of_k: dict[int, float], c: float) -> tuple[int, float]:
    """(best k, E(k) / (k c + t(k+1)/t(1))) over the chain lengths in ``e_of_k``."""
    return max(((k, e / (k * c + t_ratio(k + 1))) for k, e in e_of_k.items()), key=lambda x: x[1])


def iid_e(alpha: float, k: int) -> float:
    """Expected tokens per step of a k-chain with i.i.d. per-token acceptance alpha."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def break_even(c_head: float, target_speedup: float, kmax: int = 8) -> float:
    """The i.i.d. per-token acceptance at which a head of cost c_head matches ``target_speedup``."""
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        s = speedup({k: iid_e(mid, k) for k in range(1, kmax + 1)}, c_head)[1]
        lo, hi = (mid, hi) if s < target_speedup else (lo, mid)
    return (lo + hi) / 2


def iid_alpha(e: float, k: int) -> float:
    """The i.i.d. per-token acceptance that gives E(k) = e (the 'per-token acceptance' of a chain profile)."""
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if iid_e(mid, k) < e else (lo, mid)
    return (lo + hi) / 2


# ----------------------------------------------------------------------------------------------------- data
def stdlib_files() -> tuple[list[Path], list[Path]]:
    """(train, held-out) .py files of this Python's standard library, 1 in 10 held out by a hash of the path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
    files = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
    held = [p for p in files if zlib.crc32(str(p.relative_to(root)).encode()) % 10 == 0]
    return [p for p in files if p not in set(held)], held


def chunks(tokenizer, files: list[Path], length: int, max_tokens: int, seed: int) -> list[np.ndarray]:
    """Disjoint ``length``-token chunks of the files (shuffled, seeded) until ``max_tokens``."""
    order = np.random.default_rng(seed).permutation(len(files))
    out, total = [], 0
    for i in order:
        ids = np.asarray(tokenizer.encode(files[i].read_text(errors="replace")), dtype=np.int64)
        for a in range(0, len(ids) - length // 2, length):
            out.append(ids[a:a + length])
            total += len(out[-1])
        if total >= max_tokens:
            break
    return out


def greedy_continuations(backend, prefixes: list[np.ndarray], new_tokens: int) -> list[np.ndarray]:
    """Each prefix followed by the target's greedy continuation (one batched decode of all rows)."""
    pool = backend.new_cache_pool(len(prefixes), max(map(len, prefixes)) + new_tokens + 1)
    caches = [pool.acquire() for _ in prefixes]
    n = max(map(len, prefixes))
    ids = torch.zeros(len(prefixes), n, dtype=torch.long)
    for r, p in enumerate(prefixes):
        ids[r, :len(p)] = torch.from_numpy(p)
    pos = torch.arange(n)[None].repeat(len(prefixes), 1)
    out = backend.forward_batch(ids, pos, caches, num_tokens=[len(p) for p in prefixes], last_logits_only=True)
    seqs = [list(p) for p in prefixes]
    for _ in range(new_tokens):
        nxt = out.logits[:, -1].argmax(-1)
        for r, s in enumerate(seqs):
            s.append(int(nxt[r]))
        out = backend.forward_batch(nxt[:, None], torch.tensor([[len(s) - 1] for s in seqs]), caches,
                                    last_logits_only=True)
    return [np.asarray(s, dtype=np.int64) for s in seqs]


def target_pass(teacher: Teacher, seqs: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused-layer outputs [N, L, k*H] and the target's argmax [N, L] (ragged rows padded), in teacher batches."""
    rows = len(teacher.caches)
    layers, argmax = [], []
    for i in range(0, len(seqs), rows):
        hid, logits = teacher(seqs[i:i + rows])
        layers.append(hid.float())
        argmax.append(logits.argmax(-1))
    return torch.cat(layers), torch.cat(argmax)


class EvalSet:
    """Held-out positions with their target features cached once (the target is the expensive part)."""

    def __init__(self, name: str, tokens: torch.Tensor, layers: torch.Tensor, truth: torch.Tensor, valid: torch.Tensor):
        # index j (feature of token j, embedding of token j+1) predicts token j+2: truth[:, j], valid[:, j]
        self.name, self.tokens, self.layers, self.truth, self.valid = name, tokens, layers, truth, valid

    @torch.inference_mode()
    def head_correct(self, head, embed: torch.Tensor, lm_rows: torch.Tensor, depth: int) -> torch.Tensor:
        """[depth, N, J] bool: the head's depth-d draft at index j is the truth."""
        head.eval()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            feats = head.features(self.layers[:, :-1])
            outs = ttt_unroll(head, feats, embed[self.tokens[:, 1:]], depth)
            return torch.stack([head.draft_vocab[(head.readout(o) @ lm_rows.T).argmax(-1)][:, :-1] == self.truth
                                for o in outs])


def chain_stats(correct: torch.Tensor, valid: torch.Tensor, span: int = 8) -> dict:
    """E(k) for k = 1..len(correct) and conditional acceptance by depth, over chains starting at every index i
    whose next ``span`` targets are all valid (the same starts for every drafter): depth d of the chain from i
    is index i+d-1 of correct[d-1]."""
    kmax = correct.shape[0]
    n, j = valid.shape
    starts = j - span + 1
    ok = torch.ones(n, starts, dtype=torch.bool)
    for d in range(span):
        ok &= valid[:, d:d + starts]
    run = torch.ones(n, starts, dtype=torch.bool)
    alive = []
    for d in range(kmax):
        run = run & correct[d][:, d:d + starts]
        alive.append(run[ok].float().mean().item())
    e = {k: 1 + sum(alive[:k]) for k in range(1, kmax + 1)}
    cond = [alive[0]] + [alive[d] / max(alive[d - 1], 1e-9) for d in range(1, kmax)]
    return {"E": e, "accept_by_depth": [round(a, 4) for a in cond], "chains": int(ok.sum())}


def draft_correct(draft_backend, es: EvalSet, depth: int) -> torch.Tensor:
    """[depth, N, J]: a draft model's chain, given the accepted (true) prefix, is its own next-token argmax."""
    teacher = Teacher(draft_backend, (), 8, es.tokens.shape[1])
    seqs = [t.numpy() for t in es.tokens]
    _, am = target_pass(teacher, seqs)
    hit = am[:, 1:-1] == es.truth  # logits at position j+1 predict token j+2
    return hit[None].expand(depth, *hit.shape)


# ------------------------------------------------------------------------------------------------- training
def read_target_parts(hf_dir: Path) -> tuple[dict, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """(config, the tensors the head starts from, input embedding, LM head) without loading the whole model."""
    from safetensors import safe_open

    tcfg = json.loads((hf_dir / "config.json").read_text())
    last = f"model.layers.{tcfg['num_hidden_layers'] - 1}."
    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys() if k.startswith(last) or k == "model.norm.weight"}
        embed = f.get_tensor("model.embed_tokens.weight").float()
        lm = f.get_tensor("lm_head.weight").float() if "lm_head.weight" in f.keys() else embed
    return tcfg, state, embed, lm


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.json"
    t0 = time.time()
    model = load_model(TARGET)
    tcfg, state, embed, lm = read_target_parts(model.hf_dir)
    train_files, held_files = stdlib_files()
    opts = Eagle3TrainOptions(hidden_layers=LAYERS, seqs_per_step=args.seqs_per_step, max_len=args.max_len,
                              depth=args.depth, prompt_weight=1.0)
    budget = max(args.milestones)
    train_chunks = chunks(model.tokenizer, train_files, args.max_len, budget + args.max_len * args.seqs_per_step, 0)
    print(f"{len(train_files)} training files -> {len(train_chunks)} chunks; {len(held_files)} held-out files", flush=True)
    vocab = vocab_of(train_chunks, opts.draft_vocab_size, tcfg["vocab_size"])
    head = init_eagle3(tcfg, state, vocab, opts, None, model.name, args.seed)
    lm_rows = lm[vocab]
    teacher = Teacher(model.backend, LAYERS, args.seqs_per_step, max(args.max_len, args.prefix + args.new_tokens))

    # evaluation sets, target features cached once
    held = [c for c in chunks(model.tokenizer, held_files, args.prefix + args.new_tokens, 10 ** 9, 1)
            if len(c) == args.prefix + args.new_tokens]
    rng = np.random.default_rng(2)
    picks = rng.permutation(len(held))
    greedy_src = [held[i][:args.prefix] for i in picks[:args.eval_rows]]
    forced_src = [held[i] for i in picks[args.eval_rows:args.eval_rows + args.forced_rows]]
    tg = time.time()
    greedy = greedy_continuations(model.backend, greedy_src, args.new_tokens)
    print(f"greedy continuations: {args.eval_rows} x {args.new_tokens} tokens in {time.time() - tg:.0f} s", flush=True)
    sets = {}
    for name, seqs in (("greedy", greedy), ("forced", forced_src)):
        layers, am = target_pass(teacher, seqs)
        tokens = torch.from_numpy(np.stack([np.pad(s, (0, layers.shape[1] - len(s))) for s in seqs]))
        lengths = torch.tensor([len(s) for s in seqs])
        idx = torch.arange(layers.shape[1] - 2)[None]
        valid = idx + 2 < lengths[:, None]
        if name == "greedy":
            truth = tokens[:, 2:]
            valid &= idx + 2 >= args.prefix  # predicted tokens the target generated
            agree = (am[:, 1:-1] == truth)[valid].float().mean().item()
            print(f"greedy set: target argmax == its own generated token at {agree:.4f} of positions", flush=True)
        else:
            truth = am[:, 1:-1]
        sets[name] = EvalSet(name, tokens, layers, truth, valid)

    draft = load_model(DRAFT)
    results = {"target": TARGET, "layers": list(LAYERS), "options": vars(args), "train_files": len(train_files),
               "held_files": len(held_files), "points": [],
               "draft": {n: chain_stats(draft_correct(draft.backend, es, 8), es.valid) for n, es in sets.items()}}
    del draft
    print(f"0.5B draft: {results['draft']}", flush=True)

    step_tokens = args.seqs_per_step * args.max_len
    train_seqs = [Sequence(str(i), c, np.full(len(c), ROLE_ANSWER, np.uint8), 0.0) for i, c in enumerate(train_chunks)]
    cfg = TrainConfig(steps=budget // step_tokens + 1, lr=args.lr, warmup=args.warmup, min_lr_ratio=1.0,
                      ckpt_every=10 ** 6, seed=args.seed)
    gen_tokens = {"n": 0}

    def loss_fn(m, gen):
        s = gen_tokens["n"] // step_tokens
        gen_tokens["n"] += step_tokens
        picks = [(s * args.seqs_per_step + r) % len(train_seqs) for r in range(args.seqs_per_step)]
        batch = make_batch(m, teacher, embed, train_seqs, picks, opts, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            return ttt_loss(m, batch, lm_rows, vocab, opts, gen)

    deadline = t0 + 60 * args.max_minutes
    done_steps, losses = 0, []
    for milestone in [0, *sorted(args.milestones)]:
        stop = milestone // step_tokens
        if stop > done_steps:
            gen_tokens["n"] = done_steps * step_tokens
            res = train(head, loss_fn, cfg, out / "ckpt", resume=done_steps > 0, progress=False, stop_at=stop,
                        deadline=deadline)
            done_steps, losses = res.steps, res.losses
        point = {"tokens": done_steps * step_tokens, "steps": done_steps, "minutes": round((time.time() - t0) / 60, 1),
                 "loss": round(float(np.mean(losses[-10:])), 4) if losses else None}
        for name, es in sets.items():
            point[name] = chain_stats(es.head_correct(head, embed, lm_rows, args.depth), es.valid)
        results["points"].append(point)
        results_path.write_text(json.dumps(results, indent=1) + "\n")
        print(f"{point['tokens']} tokens, {point['minutes']} min: loss {point['loss']} greedy E(4) "
              f"{point['greedy']['E'][args.depth]:.3f} by depth {point['greedy']['accept_by_depth']}; forced "
              f"{point['forced']['accept_by_depth']}", flush=True)
        if time.time() > deadline:
            print("stopped at --max-minutes", flush=True)
            break
    head.save(out / "weights", {"train": {"tokens": done_steps * step_tokens, "data": "CPython stdlib, teacher-forced"}})
    if args.measure_cost:
        results["head_cost"] = measure_cost(model, head, embed)
        results_path.write_text(json.dumps(results, indent=1) + "\n")
    report(results, args.plot)


def vocab_of(chunks_: list[np.ndarray], size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` most frequent training tokens (FR-Spec's frequency-ranked draft vocabulary), sorted."""
    counts = np.bincount(np.concatenate(chunks_), minlength=vocab_size)
    order = np.lexsort((np.arange(vocab_size), -counts))
    return torch.from_numpy(np.sort(order[:size]))


def measure_cost(model, head, embed: torch.Tensor, reps: int = 30) -> dict:
    """c of the head on the compiled runtime (Q8_0, a chain step of one token) against one target decode step,
    interleaved, medians; plus c by weight bytes."""
    from verispec.drafters.eagle_runner import CompiledHeadRunner

    runner = CompiledHeadRunner(head, embed, 512, threads=2)
    st = runner.open()
    h = head.cfg.hidden_size
    runner.extend(st, torch.zeros(200, h), [1] * 200, 0)
    pool = model.backend.new_cache_pool(1, 512)
    cache = pool.acquire()
    model.backend.forward_batch(torch.ones(1, 200, dtype=torch.long), torch.arange(200)[None], [cache])
    th, tt = [], []
    for _ in range(reps):
        runner.begin(st)
        a = time.perf_counter()
        runner.expand(st, torch.zeros(1, h), [1], 200, [[]])
        th.append(time.perf_counter() - a)
        a = time.perf_counter()
        model.backend.forward_batch(torch.ones(1, 1, dtype=torch.long), torch.tensor([[cache.length]]), [cache])
        tt.append(time.perf_counter() - a)
        cache.truncate(200)
    per_step = runner.model.weight_bytes  # the layer, fc and the draft-vocabulary LM rows, Q8_0
    return {"head_ms": round(1e3 * float(np.median(th)), 2), "target_ms": round(1e3 * float(np.median(tt)), 2),
            "c_measured": round(float(np.median(th)) / float(np.median(tt)), 3),
            "head_weight_bytes": per_step, "c_bytes": round(per_step / TARGET_BYTES, 3)}


# --------------------------------------------------------------------------------------------------- report
def report(results: dict, plot: str | None) -> None:
    """The table, the fit of acceptance against log tokens, break-even and predicted speed-ups."""
    results = json.loads(json.dumps(results))  # E(k) keys as JSON has them, whether just measured or read back
    e_of = lambda stats: {int(k): v for k, v in stats["E"].items()}  # noqa: E731
    d = results["draft"]["greedy"]
    de = e_of(d)
    depth = max(e_of(results["points"][0]["greedy"]))
    kd, sd = speedup(de, C_DRAFT)
    print(f"0.5B draft (greedy set, {d['chains']} chains): E(4) {de[4]:.3f}, by depth {d['accept_by_depth']}, "
          f"alpha_iid(4) {iid_alpha(de[4], 4):.3f}; predicted {sd:.3f}x at k={kd} (c={C_DRAFT}); forced set top-1 "
          f"{results['draft']['forced']['accept_by_depth'][0]}")
    cost = results.get("head_cost", {})
    c_head = cost.get("c_measured") or cost.get("c_bytes") or 0.07
    print(f"| tokens | loss | greedy: accept by depth | E({depth}) | alpha_iid | predicted (c={c_head}) | "
          "forced: top-1 by depth |")
    print("|---|---|---|---|---|---|---|")
    for p in results["points"]:
        e = e_of(p["greedy"])
        k, s = speedup(e, c_head)
        print(f"| {p['tokens']} | {p['loss']} | {p['greedy']['accept_by_depth']} | {e[depth]:.3f} | "
              f"{iid_alpha(e[depth], depth):.3f} | {s:.3f}x (k={k}) | {p['forced']['accept_by_depth']} |")
    need = break_even(c_head, sd)
    print(f"head cost c = {c_head} ({cost}); break-even i.i.d. acceptance vs the 0.5B's {sd:.3f}x: {need:.3f}")
    pts = [p for p in results["points"] if p["tokens"] > 0]
    if len(pts) < 2:
        return
    x = np.log([p["tokens"] for p in pts])
    y = np.array([iid_alpha(e_of(p["greedy"])[depth], depth) for p in pts])
    b, a = np.polyfit(x, y, 1)
    print(f"fit alpha_iid = {a:.4f} + {b:.4f} ln(tokens)")
    for n in (2.5e5, 5e5, 1e6, 1e7):
        al = min(a + b * math.log(n), 0.999)
        k, s = speedup({k: iid_e(al, k) for k in range(1, 9)}, c_head)
        print(f"  {n:.2g} tokens: alpha {al:.3f}, predicted {s:.3f}x at k={k}")
    if b > 0:
        print(f"  break-even {need:.3f} reached at ~{math.exp((need - a) / b):.3g} tokens")
    if plot:
        draw(x, y, a, b, need, iid_alpha(de[4], 4), plot, depth)


def draw(x, y, a, b, need, alpha_draft, path, depth):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    ax.semilogx(np.exp(x), y, "o", label=f"EAGLE-3 head, held-out greedy (E({depth}) as i.i.d. alpha)")
    xs = np.geomspace(np.exp(x[0]), 1e7, 50)
    ax.semilogx(xs, a + b * np.log(xs), "--", label=f"fit {a:.3f} + {b:.3f} ln N")
    ax.axhline(need, color="r", lw=1, label=f"break-even vs the 0.5B draft ({need:.2f})")
    ax.axhline(alpha_draft, color="g", lw=1, ls=":", label=f"0.5B draft, same positions ({alpha_draft:.2f})")
    ax.set_xlabel("training tokens (one pass, teacher-forced CPython stdlib)")
    ax.set_ylabel("per-token acceptance")
    ax.set_title("Qwen2.5-Coder 1.5B: EAGLE-3 head learning curve")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="results.json, the checkpoint and the head (keep outside the repo)")
    ap.add_argument("--milestones", type=int, nargs="+", default=[10_000, 20_000, 40_000, 80_000])
    ap.add_argument("--max-minutes", type=float, default=55)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--seqs-per-step", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=192)
    ap.add_argument("--depth", type=int, default=4, help="TTT depth, and the longest chain evaluated")
    ap.add_argument("--eval-rows", type=int, default=16, help="held-out prefixes the target continues greedily")
    ap.add_argument("--forced-rows", type=int, default=8, help="held-out library chunks for the teacher-forced set")
    ap.add_argument("--prefix", type=int, default=96, help="held-out code tokens before each greedy continuation")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-bf16", dest="bf16", action="store_false", help="train the head in float32 (3x slower)")
    ap.add_argument("--measure-cost", action="store_true", help="time a compiled head step against a target step")
    ap.add_argument("--report", action="store_true", help="only print the report of --out/results.json")
    ap.add_argument("--plot", default=None, help="PNG of the curve (matplotlib)")
    args = ap.parse_args()
    if args.report:
        report(json.loads((Path(args.out) / "results.json").read_text()), args.plot)
    else:
        run(args)


if __name__ == "__main__":
    main()
