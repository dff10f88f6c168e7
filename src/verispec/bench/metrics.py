"""Aggregate Records into per-(method, category) metrics, Spec-Bench conventions.

    tokens_per_s        total generated tokens / total wall time (prefill included)
    speedup             tokens_per_s / the baseline's tokens_per_s over the same records,
                        computed per repeat; reported as the mean over repeats, with the
                        standard deviation and range over repeats as the spread
    decode_speedup      the same ratio with prefill time left out (wall - prefill)
    cpu_speedup         the same ratio over the process's CPU time instead of wall time:
                        on a machine shared with other jobs, time slices taken by them do
                        not count (with 1 thread, CPU time is the work done)
    tau                 mean tokens committed per decode step, bonus included:
                        (accepted + steps) / steps. For peers that expose only target
                        forwards: tokens committed after prefill (EOS included) / decode
                        forwards
    alpha               accepted / drafted
    per_position        accepted_at[i] / drafted_at[i] (acceptance at draft depth i+1)
    forwards_per_token  target forwards (prefill included) / generated tokens

``OVERALL`` is the category of the summary over all records of a method: its speedup is
the ratio of totals over all categories (not a mean of per-category ratios).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from .harness import Record

OVERALL = "overall"


@dataclass(frozen=True)
class Totals:
    records: int
    eos_records: int  # records that ended at an EOS token (committed by a step, not counted)
    new_tokens: int
    wall_s: float
    decode_s: float | None  # None when some record has no prefill time
    cpu_s: float | None  # None when some record has no CPU time
    target_forwards: int | None  # None when some record has no forward count
    steps: int | None
    drafted: int | None
    accepted: int | None
    accepted_at: tuple[int, ...] | None
    drafted_at: tuple[int, ...] | None


def _sum_known(values: Sequence[int | float | None]) -> int | float | None:
    """Sum, or None when any value is unknown: sum_known([1, 2]) -> 3; [1, None] -> None."""
    return None if any(v is None for v in values) else sum(values)


def _sum_lists(rows: Sequence[tuple[int, ...] | None]) -> tuple[int, ...] | None:
    """Elementwise sum of ragged rows: ((1, 1), (1,)) -> (2, 1); None if any is None."""
    if any(r is None for r in rows):
        return None
    out = [0] * max((len(r) for r in rows), default=0)
    for row in rows:
        for i, v in enumerate(row):
            out[i] += v
    return tuple(out)


def totals(records: Sequence[Record]) -> Totals:
    decode = [None if r.prefill_s is None else r.wall_s - r.prefill_s for r in records]
    return Totals(
        records=len(records), eos_records=sum(r.finish_reason == "eos" for r in records),
        new_tokens=sum(r.new_tokens for r in records),
        wall_s=sum(r.wall_s for r in records), decode_s=_sum_known(decode),
        cpu_s=_sum_known([r.cpu_s for r in records]),
        target_forwards=_sum_known([r.target_forwards for r in records]),
        steps=_sum_known([r.steps for r in records]), drafted=_sum_known([r.drafted for r in records]),
        accepted=_sum_known([r.accepted for r in records]),
        accepted_at=_sum_lists([r.accepted_at for r in records]),
        drafted_at=_sum_lists([r.drafted_at for r in records]),
    )


def tokens_per_s(t: Totals, decode_only: bool = False, cpu: bool = False) -> float | None:
    """Generated tokens per second; decode-only drops the prefill time (and, since the
    prefill forward yields each record's first token, that token too); ``cpu`` divides
    by CPU time instead of wall time."""
    if cpu:
        return t.new_tokens / t.cpu_s if t.cpu_s else None
    if decode_only:
        if t.decode_s is None or t.decode_s <= 0:
            return None
        return (t.new_tokens - t.records) / t.decode_s
    return t.new_tokens / t.wall_s if t.wall_s > 0 else None


def tau(t: Totals) -> float | None:
    """Example: 10 steps accepting 15 draft tokens -> (15 + 10) / 10 = 2.5. Without an
    accepted count: tokens committed by decode steps (the prefill commits each record's
    first token; a final EOS was committed but is not in the output) per step."""
    if not t.steps:
        return None
    if t.accepted is not None:
        return (t.accepted + t.steps) / t.steps
    return (t.new_tokens - t.records + t.eos_records) / t.steps


def alpha(t: Totals) -> float | None:
    return t.accepted / t.drafted if t.drafted else None


def per_position(t: Totals) -> tuple[float, ...] | None:
    """Example: accepted_at (8, 4), drafted_at (10, 8) -> (0.8, 0.5)."""
    if t.accepted_at is None or t.drafted_at is None:
        return None
    return tuple(a / d if d else 0.0 for a, d in zip(t.accepted_at, t.drafted_at))


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


@dataclass(frozen=True)
class Spread:
    """Mean, standard deviation and range of one ratio over repeats."""

    mean: float | None
    std: float | None
    min: float | None
    max: float | None

    @staticmethod
    def of(values: Sequence[float | None]) -> "Spread":
        """Spread.of([1.0, 1.2]) -> mean 1.1, std 0.141, min 1.0, max 1.2; Nones ignored."""
        vals = [v for v in values if v is not None and math.isfinite(v)]
        if not vals:
            return Spread(None, None, None, None)
        std = statistics.stdev(vals) if len(vals) > 1 else 0.0
        return Spread(statistics.fmean(vals), std, min(vals), max(vals))


@dataclass(frozen=True)
class Summary:
    method: str
    category: str  # a Spec-Bench group or OVERALL
    records: int
    new_tokens: int
    wall_s: float
    tokens_per_s: float | None
    speedup: Spread  # over repeats, vs the baseline on the same records
    decode_speedup: Spread
    cpu_speedup: Spread
    tau: float | None
    alpha: float | None
    per_position: tuple[float, ...] | None
    forwards_per_token: float | None


def _speedups(mine: Sequence[Record], base: Sequence[Record], decode_only: bool = False,
              cpu: bool = False) -> Spread:
    """One ratio per repeat, each over the records both methods share."""
    per_repeat = []
    for rep in sorted({r.repeat for r in mine}):
        keys = {r.key for r in base if r.repeat == rep} & {r.key for r in mine if r.repeat == rep}
        m = totals([r for r in mine if r.key in keys])
        b = totals([r for r in base if r.key in keys])
        per_repeat.append(ratio(tokens_per_s(m, decode_only, cpu), tokens_per_s(b, decode_only, cpu)))
    return Spread.of(per_repeat)


def summarize_group(method: str, category: str, mine: Sequence[Record], base: Sequence[Record]) -> Summary:
    t = totals(mine)
    return Summary(
        method, category, t.records, t.new_tokens, t.wall_s, tokens_per_s(t),
        _speedups(mine, base), _speedups(mine, base, decode_only=True), _speedups(mine, base, cpu=True),
        tau(t), alpha(t),
        per_position(t), ratio(t.target_forwards, t.new_tokens),
    )


def summarize(records: Sequence[Record], baseline: str) -> list[Summary]:
    """One Summary per (method, category) in first-seen order, then per method OVERALL."""
    methods = list(dict.fromkeys(r.method for r in records))
    categories = list(dict.fromkeys(r.category for r in records))
    out = []
    for cat in [*categories, OVERALL]:
        for m in methods:
            mine = [r for r in records if r.method == m and cat in (OVERALL, r.category)]
            base = [r for r in records if r.method == baseline and cat in (OVERALL, r.category)]
            if mine:
                out.append(summarize_group(m, cat, mine, base))
    return out
