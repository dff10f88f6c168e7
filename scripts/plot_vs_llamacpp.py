"""Ratios over llama.cpp plain decoding per workload, from `verispec bench` runs, as a table and a plot.

Issue 34's targets are ratios of tokens/s over llama.cpp's plain decoding (``-m llamacpp-server``) in
the same interleaved run: code edits with the prediction >= 3x, without it >= 2x, agent replays
>= 2.5x, FIM >= 1.5x. ``verispec bench`` reports speed-ups over our own plain decoding; this reads
its ``results.json`` files (one per run: each run's methods are compared only with the llama.cpp of
that run) and prints, per workload and method, tokens/s end to end and in decode, tau, and both
ratios over llama.cpp plain, then draws them with the targets marked.

    python scripts/plot_vs_llamacpp.py results/issue34-edit results/issue34-agent results/issue34-fim \
        --png docs/img/issue34-vs-llamacpp.png
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from verispec.bench.harness import Record
from verispec.bench.metrics import Totals, tau, tokens_per_s, totals

PEER = "llamacpp-server"
# (workload, method) -> issue 34's target over llama.cpp plain; the method names are the bench's
TARGETS = {("edit", "auto:prediction=yes"): 3.0, ("edit", "auto"): 2.0, ("agent", "auto"): 2.5,
           ("fim", "auto"): 1.5}


def load(run_dir: Path) -> tuple[dict, list[Record]]:
    data = json.loads((run_dir / "results.json").read_text())
    fields = {f.name for f in dataclasses.fields(Record)}
    return data["meta"], [Record(**{k: v for k, v in r.items() if k in fields}) for r in data["records"]]


def rows(records: list[Record], peer_name: str = PEER) -> list[dict]:
    """One row per (category, method) with llama.cpp plain in the run: tokens/s and ratios over it."""
    groups: dict[tuple[str, str], list[Record]] = {}
    for r in records:
        groups.setdefault((r.category, r.method), []).append(r)
    out = []
    for (category, method), recs in sorted(groups.items()):
        peer = groups.get((category, peer_name))
        if peer is None:
            continue
        mine, theirs = totals(recs), totals(peer)

        def over(decode: bool, a: Totals = mine, b: Totals = theirs) -> float | None:
            x, y = tokens_per_s(a, decode_only=decode), tokens_per_s(b, decode_only=decode)
            return x / y if x is not None and y else None

        out.append({"workload": category, "method": method, "records": len(recs), "tokens": mine.new_tokens,
                    "tok_s": tokens_per_s(mine), "decode_tok_s": tokens_per_s(mine, decode_only=True),
                    "tau": tau(mine), "x_e2e": over(False), "x_decode": over(True),
                    "target": TARGETS.get((category, method))})
    return out


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="output directories of `verispec bench` runs")
    ap.add_argument("--png", type=Path, help="write the plot here")
    ap.add_argument("--peer", default=PEER, help="the method the ratios are over (e.g. llamacpp-server:fa=1)")
    args = ap.parse_args()
    table = []
    for run in args.runs:
        meta, records = load(run)
        for row in rows(records, args.peer):
            table.append(row | {"run": run.name, "backend": meta.get("backend_detail", "")})
    print("| workload | method | items | tokens | tokens/s (decode) | tau | x llama.cpp plain, e2e (decode) | target |")
    print("|---|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['workload']} | `{r['method']}` | {r['records']} | {r['tokens']} | {fmt(r['tok_s'], '.1f')} "
              f"({fmt(r['decode_tok_s'], '.1f')}) | {fmt(r['tau'])} | {fmt(r['x_e2e'])}x ({fmt(r['x_decode'])}x) | "
              f"{'-' if r['target'] is None else format(r['target'], '.1f') + 'x'} |")
    if args.png:
        plot([r for r in table if not r["method"].startswith(PEER)], args.png)
        print(f"plot: {args.png}")


def plot(table: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['workload']}\n{r['method'].replace('auto:prediction=yes', 'auto+pred')}" for r in table]
    xs = range(len(table))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(table)), 4.0))
    ax.bar([x - 0.2 for x in xs], [r["x_e2e"] or 0 for r in table], 0.4, label="end to end")
    ax.bar([x + 0.2 for x in xs], [r["x_decode"] or 0 for r in table], 0.4, label="decode")
    for x, r in zip(xs, table):
        if r["target"] is not None:
            ax.hlines(r["target"], x - 0.45, x + 0.45, colors="k", linestyles="--")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("tokens/s over llama.cpp plain (same run)")
    ax.set_title("verispec over llama.cpp plain decoding (dashed: issue 34's targets)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
