"""Interleaved measurement of model-free drafters against plain decoding on one target (issue 47:
speculation for a target with no draft model). Prints per method: tokens/s ratio to plain, tau,
alpha per depth, and the predicted speed-up (tau / t(mean nodes)) from the target's cost curve.

    python scripts/nodraft_bench.py --model ~/.cache/verispec/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \\
        --workload gsm8k --prompts 3 -m suffix -m token-recycling -m auto

Workloads: ``gsm8k`` (train questions: tuning material), ``code`` (Python stdlib functions to
annotate: tuning), ``code-heldout`` (other stdlib modules), ``specbench`` (held-out, reporting only).
Greedy; every output is checked against plain decoding (a mismatch is printed and counted).
"""

from __future__ import annotations

import argparse
import inspect
import json
import time
from pathlib import Path

SHARED = Path("/work/shared/data")
TUNE_CODE = ("textwrap.dedent", "shlex.quote", "json.encoder.py_encode_basestring", "fnmatch.translate",
             "string.capwords", "base64.b64encode")
HELDOUT_CODE = ("heapq.nsmallest", "statistics.median", "colorsys.rgb_to_hsv", "calendar.isleap",
                "difflib.get_close_matches", "html.escape")


def _source(dotted: str) -> str:
    import importlib

    mod, _, name = dotted.rpartition(".")
    return inspect.getsource(getattr(importlib.import_module(mod), name))


def prompts(workload: str, count: int, skip: int) -> list[str]:
    if workload == "gsm8k":
        rows = [json.loads(line) for line in (SHARED / "gsm8k" / "train.jsonl").open()][skip: skip + count]
        return [r["question"] + "\nAnswer step by step." for r in rows]
    if workload in ("code", "code-heldout"):
        names = (TUNE_CODE if workload == "code" else HELDOUT_CODE)[skip: skip + count]
        return [f"Add type hints and a Google-style docstring to this function; keep the code:\n\n"
                f"```python\n{_source(n)}```" for n in names]
    if workload == "specbench":
        path = next((SHARED / "spec_bench").glob("*.jsonl"))
        rows = [json.loads(line) for line in path.open()]
        return [r["turns"][0] for r in rows[skip * 10:: max(1, len(rows) // count)]][:count]
    raise SystemExit(f"unknown workload {workload!r}")


def parse_method(text: str) -> tuple[str, dict[str, str]]:
    name, _, rest = text.partition(":")
    return name, dict(kv.split("=", 1) for kv in rest.split(",") if kv)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--workload", default="gsm8k")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--skip", type=int, default=0, help="prompts skipped first (a different slice)")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=96)
    ap.add_argument("-k", "--num-draft-tokens", type=int, default=16)
    ap.add_argument("-m", "--method", action="append", default=[])
    args = ap.parse_args()

    from verispec.api import SpecDecoder, load_model
    from verispec.registry import cost_model, describe_method
    from verispec.policies.draft_budget import interpolate
    from verispec.types import SamplingParams

    lm = load_model(args.model)
    curve = cost_model(lm).curve
    print("t(n):", {n: round(t, 2) for n, t in curve.items()})
    methods = ["none", *args.method]
    decs = {m: SpecDecoder(lm, parse_method(m)[0], parse_method(m)[1], num_draft_tokens=args.num_draft_tokens)
            for m in methods}
    for m in methods:
        print(m, "->", describe_method(parse_method(m)[0], lm))
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    warm = SamplingParams(max_new_tokens=8)
    for d in decs.values():
        d.generate("Hello", warm)
    agg = {m: {"s": 0.0, "tok": 0, "steps": 0, "drafted": 0, "acc": 0, "acc_at": [], "dr_at": [], "mis": 0,
               "per": [], "draft_s": 0.0, "decode_s": 0.0} for m in methods}
    for i, p in enumerate(prompts(args.workload, args.prompts, args.skip)):
        ref = None
        for m in methods:
            t0 = time.perf_counter()
            out = decs[m].generate(p, params)
            wall = time.perf_counter() - t0
            st, a = out.stats, agg[m]
            if ref is None:
                ref = out.token_ids
            elif out.token_ids != ref:
                a["mis"] += 1
            a["s"] += wall
            a["tok"] += len(out.token_ids)
            a["steps"] += st.steps
            a["drafted"] += st.drafted
            a["draft_s"] += st.draft_s
            a["decode_s"] += st.decode_s
            a["acc"] += st.accepted
            for key, src in (("acc_at", st.accepted_at), ("dr_at", st.drafted_at)):
                a[key] += [0] * (len(src) - len(a[key]))
                for j, v in enumerate(src):
                    a[key][j] += v
            a["per"].append(len(out.token_ids) / wall)
        base = agg["none"]["per"][-1]
        print(f"prompt {i}: " + "  ".join(f"{m.split(':')[0]} {agg[m]['per'][-1] / base:.2f}x" for m in methods[1:]),
              flush=True)
    plain = agg["none"]["tok"] / agg["none"]["s"]
    dec_plain = agg["none"]["tok"] / agg["none"]["decode_s"]  # decoding only: the prefill is the same for all
    print(f"{'method':44s} {'x plain':>7s} {'dec x':>5s} {'tau':>5s} {'nodes':>5s} {'pred':>5s} {'worst':>5s} {'ms/st':>6s} {'draft':>5s} mis  alpha/depth")
    for m in methods:
        a = agg[m]
        steps = max(1, a["steps"])
        tau = (a["acc"] + steps) / steps
        nodes = a["drafted"] / steps
        pred = tau / interpolate(curve, nodes) if nodes else 1.0
        alpha = [round(x / y, 2) for x, y in zip(a["acc_at"], a["dr_at"]) if y][:8]
        worst = min(x / y for x, y in zip(a["per"], agg["none"]["per"]))
        print(f"{m:44s} {a['tok'] / a['s'] / plain:7.2f} {a['tok'] / a['decode_s'] / dec_plain:5.2f} {tau:5.2f} {nodes:5.1f} {pred:5.2f} {worst:5.2f} {1e3 * a['decode_s'] / steps:6.1f} {1e3 * a['draft_s'] / steps:5.2f} {a['mis']:3d}  {alpha}")
        sub = getattr(decs[m].drafter, "steps", None)
        if sub:
            print("   hybrid steps:", dict(sub), "accepted:", dict(decs[m].drafter.accepted))


if __name__ == "__main__":
    main()
