"""Write a benchmark run: results.json (every record), results.md (tables), PNG plots.

    write_all(out_dir, meta, records, summaries, exactness_rows, memory)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from .harness import Record
from .lossless import ExactnessRow, exactness_counts
from .metrics import OVERALL, Spread, Summary

MAX_POSITIONS = 8  # per-position acceptance columns in the Markdown table


def fmt(x: float | None, digits: int = 2) -> str:
    """fmt(1.234) -> "1.23"; fmt(None) -> "–"."""
    return "–" if x is None else f"{x:.{digits}f}"


def fmt_spread(s: Spread) -> str:
    """"1.23×" with one repeat, "1.23× ±0.04" with several; "–" when unknown."""
    if s.mean is None:
        return "–"
    return f"{s.mean:.2f}×" + (f" ±{s.std:.2f}" if s.std else "")


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _ordered(summaries: Sequence[Summary]) -> tuple[list[str], list[str]]:
    methods = list(dict.fromkeys(s.method for s in summaries))
    cats = [c for c in dict.fromkeys(s.category for s in summaries) if c != OVERALL] + [OVERALL]
    return methods, cats


def speedup_table(summaries: Sequence[Summary], kind: str = "speedup") -> list[str]:
    """Methods x categories (+ overall); each cell the mean over repeats of ``kind``:
    "speedup", "decode_speedup" or "cpu_speedup"."""
    methods, cats = _ordered(summaries)
    cell = {(s.method, s.category): s for s in summaries}
    rows = []
    for m in methods:
        row = [f"`{m}`"]
        for c in cats:
            s = cell.get((m, c))
            row.append("–" if s is None else fmt_spread(getattr(s, kind)))
        rows.append(row)
    return _table(["method", *cats], rows)


def method_table(summaries: Sequence[Summary], counts: dict[str, dict[str, int]],
                 memory: dict[str, int], greedy: bool) -> list[str]:
    rows = []
    for s in (s for s in summaries if s.category == OVERALL):
        c = counts.get(s.method)
        exact = ("reference" if c is None and greedy else "not checked (sampling)" if not greedy
                 else f"{c['equal']} equal, {c['near-tie']} near-tie, {c['mismatch']} mismatch")
        rows.append([f"`{s.method}`", fmt(s.tokens_per_s, 1), fmt_spread(s.speedup), fmt_spread(s.decode_speedup),
                     fmt_spread(s.cpu_speedup),
                     fmt(s.tau), fmt(s.alpha), fmt(s.forwards_per_token, 3),
                     fmt(memory.get(s.method, 0) / 2**20, 1), exact])
    header = ["method", "tokens/s", "speedup", "decode speedup", "CPU-time speedup", "tau", "alpha",
              "target fw / token", "extra memory MB", "greedy exactness vs `none`"]
    return _table(header, rows)


def category_table(summaries: Sequence[Summary]) -> list[str]:
    rows = [[s.category, f"`{s.method}`", str(s.records), str(s.new_tokens), fmt(s.wall_s, 1),
             fmt(s.tokens_per_s, 1), fmt_spread(s.speedup), fmt(s.tau), fmt(s.alpha),
             fmt(s.forwards_per_token, 3)] for s in summaries if s.category != OVERALL]
    return _table(["category", "method", "records", "tokens", "wall s", "tokens/s", "speedup",
                   "tau", "alpha", "target fw / token"], rows)


def acceptance_table(summaries: Sequence[Summary]) -> list[str]:
    rows = []
    for s in (s for s in summaries if s.category == OVERALL and s.per_position):
        pp = list(s.per_position[:MAX_POSITIONS])
        rows.append([f"`{s.method}`", *(fmt(p) for p in pp), *(["–"] * (MAX_POSITIONS - len(pp)))])
    return _table(["method", *(f"d{i + 1}" for i in range(MAX_POSITIONS))], rows)


def exactness_section(rows: Sequence[ExactnessRow]) -> list[str]:
    counts = exactness_counts(list(rows))
    table = _table(["method", "compared", "equal", "near-tie", "mismatch", "skipped (earlier turn diverged)"],
                   [[f"`{m}`", str(c["equal"] + c["near-tie"] + c["mismatch"]), str(c["equal"]),
                     str(c["near-tie"]), str(c["mismatch"]), str(c["skipped"])] for m, c in counts.items()])
    details = [f"- `{r.method}` q{r.question_id} turn {r.turn} repeat {r.repeat}: **{r.status}**, {r.detail}"
               for r in rows if r.status in ("near-tie", "mismatch")]
    return table + ([""] + details if details else [])


def markdown(meta: dict, summaries: Sequence[Summary], rows: Sequence[ExactnessRow],
             memory: dict[str, int]) -> str:
    greedy = meta["temperature"] == 0
    mode = "greedy" if greedy else f"sampling T={meta['temperature']} top-p={meta['top_p']} top-k={meta['top_k']}"
    lines = [f"# verispec bench: {meta['model']} ({meta.get('backend_detail', meta['backend'])}, {meta['dtype']}, quant {meta.get('quant', 'none')}), {mode}", "",
             f"{meta['started']} · {meta['machine']} · torch threads {meta['threads']} · "
             f"{meta['prompts']} prompts · max_new_tokens {meta['max_new_tokens']} · k {meta['num_draft_tokens']} · "
             f"repeats {meta['repeats']} · warm-up {meta['warmup']} · peak RSS {meta.get('peak_rss_mb', '?')} MB "
             "(whole process: every method and peer loaded)", "",
             f"Command: `{meta['command']}`", ""]
    for note in meta.get("notices", []):
        lines.append(f"> {note}")
    lines += ["", "## Speedup over plain decoding (tokens/s ratio, prefill included; ± = std over repeats)", "",
              *speedup_table(summaries), "", "## Decode-only speedup (prefill time excluded)", "",
              *speedup_table(summaries, "decode_speedup"), "",
              "## CPU-time speedup (process CPU time instead of wall time; robust to other jobs' load)", "",
              *speedup_table(summaries, "cpu_speedup"), "", "## Per method (all categories)", "",
              *method_table(summaries, exactness_counts(list(rows)), memory, greedy), "",
              "## Per category", "", *category_table(summaries), "",
              "## Per-position acceptance (all categories)", "", *acceptance_table(summaries), ""]
    if greedy:
        lines += ["## Greedy exactness against plain decoding (`none`)", "", *exactness_section(rows), ""]
    return "\n".join(lines)


def to_json(meta: dict, records: Sequence[Record], summaries: Sequence[Summary],
            rows: Sequence[ExactnessRow], memory: dict[str, int]) -> dict:
    return {"meta": meta, "memory_bytes": memory,
            "summaries": [asdict(s) for s in summaries],
            "exactness": {"counts": exactness_counts(list(rows)), "rows": [asdict(r) for r in rows]},
            "records": [asdict(r) | {"new_tokens": r.new_tokens} for r in records]}


def plot_speedup(summaries: Sequence[Summary], path: Path, kind: str = "speedup") -> None:
    """Grouped bars: ``kind`` ("speedup", "decode_speedup", "cpu_speedup") per category (x)
    per method (bars), std over repeats as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods, cats = _ordered(summaries)
    cell = {(s.method, s.category): getattr(s, kind) for s in summaries}
    width = 0.8 / max(len(methods), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(cats) + 2) + 2.5, 4))
    for i, m in enumerate(methods):
        spreads = [cell.get((m, c), Spread(None, None, None, None)) for c in cats]
        xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(cats))]
        ax.bar(xs, [s.mean or 0 for s in spreads], width, yerr=[s.std or 0 for s in spreads], label=m, capsize=2)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(cats)), cats)
    ax.set_ylabel(kind.replace("_", " ") + " over plain decoding")
    if methods:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: never hides a bar
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_acceptance(summaries: Sequence[Summary], path: Path) -> None:
    """Per-position acceptance curves (all categories), one line per method with drafts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for s in (s for s in summaries if s.category == OVERALL and s.per_position):
        ax.plot(range(1, len(s.per_position) + 1), s.per_position, marker="o", label=s.method)
    ax.set_xlabel("draft depth")
    ax.set_ylabel("acceptance rate at depth (given drafted)")
    ax.set_ylim(0, 1)
    if ax.lines:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_all(out_dir: Path, meta: dict, records: Sequence[Record], summaries: Sequence[Summary],
              rows: Sequence[ExactnessRow], memory: dict[str, int]) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "markdown": out_dir / "results.md",
             "speedup_plot": out_dir / "speedup.png", "cpu_speedup_plot": out_dir / "cpu_speedup.png",
             "acceptance_plot": out_dir / "acceptance.png"}
    paths["json"].write_text(json.dumps(to_json(meta, records, summaries, rows, memory), indent=1))
    paths["markdown"].write_text(markdown(meta, summaries, rows, memory))
    plot_speedup(summaries, paths["speedup_plot"])
    plot_speedup(summaries, paths["cpu_speedup_plot"], "cpu_speedup")
    plot_acceptance(summaries, paths["acceptance_plot"])
    return paths
