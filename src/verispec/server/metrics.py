"""Server metrics in the Prometheus text exposition format (version 0.0.4).

The engine thread records, the HTTP thread renders; one lock guards everything. Names
follow Prometheus conventions (``_total`` counters, ``_seconds`` units) and vLLM's
spec-decode metrics (draft tokens, accepted tokens, per-position acceptance, mean accepted
tokens = tau = (accepted + steps) / steps).
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

from ..engine.prefix_cache import PrefixCacheStats
from ..types import RequestStats

OUTCOMES = ("completed", "cancelled", "failed", "rejected")


@dataclass
class Histogram:
    """Cumulative-bucket histogram. ``bounds`` are the upper bounds (``+Inf`` implied)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, non-cumulative; last = +Inf
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str) -> list[str]:
        out, cum = [], 0
        for bound, c in zip((*self.bounds, float("inf")), self.counts):
            cum += c
            le = "+Inf" if bound == float("inf") else _num(bound)
            out.append(f'{name}_bucket{{le="{le}"}} {cum}')
        return out + [f"{name}_sum {_num(self.total)}", f"{name}_count {self.n}"]


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


class ServerMetrics:
    def __init__(self, model: str):
        self.model = model
        self._lock = threading.Lock()
        self.requests = dict.fromkeys(OUTCOMES, 0)
        self.running = 0
        self.waiting = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.engine_steps = 0  # batched steps (one target verify forward each when batched)
        self.request_steps = 0  # sum over steps of the batch size
        self.drafted = 0
        self.accepted = 0
        self.nospec_steps = 0  # steps where the schedule turned speculation off
        self.last_batch_size = 0
        self.last_draft_cap = -1  # -1 = uncapped
        self.cache_rows_in_use = 0
        self.prefix: PrefixCacheStats | None = None  # None: no prefix cache
        self.drafted_at: list[int] = []
        self.accepted_at: list[int] = []
        self.batch_size = Histogram((1, 2, 4, 8, 16, 32, 64))
        self.ttft = Histogram((0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.latency = Histogram((0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))

    # ---- recording (engine thread) ------------------------------------------------------
    def set_queue(self, running: int, waiting: int) -> None:
        with self._lock:
            self.running, self.waiting = running, waiting

    def set_caches(self, rows_in_use: int, prefix: PrefixCacheStats | None) -> None:
        """KV cache rows held by requests, and the prefix cache's counters (engine thread)."""
        with self._lock:
            self.cache_rows_in_use, self.prefix = rows_in_use, prefix

    def request_done(self, outcome: str) -> None:
        if outcome not in self.requests:
            raise ValueError(f"unknown outcome {outcome!r}")
        with self._lock:
            self.requests[outcome] += 1

    def step(self, batch_size: int, cap: int | None, drafted: int, accepted: int, new_tokens: int) -> None:
        with self._lock:
            self.engine_steps += 1
            self.request_steps += batch_size
            self.drafted += drafted
            self.accepted += accepted
            self.generation_tokens += new_tokens
            self.nospec_steps += cap == 0
            self.last_batch_size = batch_size
            self.last_draft_cap = -1 if cap is None else cap
            self.batch_size.observe(batch_size)

    def first_token(self, prompt_tokens: int, ttft_s: float) -> None:
        """A request was prefilled: its prompt and first (prefill) token."""
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += 1
            self.ttft.observe(ttft_s)

    def request_stats(self, stats: RequestStats, latency_s: float) -> None:
        """Per-position acceptance is accumulated from each request's statistics at its end."""
        with self._lock:
            for mine, theirs in ((self.drafted_at, stats.drafted_at), (self.accepted_at, stats.accepted_at)):
                mine.extend([0] * (len(theirs) - len(mine)))
                for i, v in enumerate(theirs):
                    mine[i] += v
            self.latency.observe(latency_s)

    # ---- rendering (HTTP thread) --------------------------------------------------------
    def _prefix_families(self) -> list[tuple[str, str, str, list]]:
        """Prefix cache families (vLLM's prefix_cache_queries / _hits count tokens); zeros when off."""
        p = self.prefix
        val = (lambda f: 0 if p is None else f(p))  # noqa: E731
        return [
            ("verispec_prefix_cache_enabled", "gauge", "1 if requests reuse cached prompt prefixes",
             [("", int(p is not None))]),
            ("verispec_prefix_cache_queries_total", "counter", "prompt tokens looked up in the prefix cache",
             [("", val(lambda s: s.query_tokens))]),
            ("verispec_prefix_cache_hits_total", "counter", "prompt tokens whose K/V was reused (not prefilled)",
             [("", val(lambda s: s.reused_tokens))]),
            ("verispec_prefix_cache_hit_rate", "gauge", "reused / looked-up prompt tokens",
             [("", val(lambda s: s.hit_rate))]),
            ("verispec_prefix_cache_request_hits_total", "counter", "requests that reused a cached prefix",
             [("", val(lambda s: s.hits))]),
            ("verispec_prefix_cache_evicted_blocks_total", "counter", "blocks evicted (LRU) from the prefix cache",
             [("", val(lambda s: s.evicted_blocks))]),
            ("verispec_prefix_cache_blocks", "gauge", "blocks in the prefix cache", [("", val(lambda s: s.blocks))]),
            ("verispec_prefix_cache_bytes", "gauge", "bytes of K/V in the prefix cache", [("", val(lambda s: s.bytes))]),
            ("verispec_prefix_cache_max_bytes", "gauge", "the prefix cache's budget", [("", val(lambda s: s.max_bytes))]),
        ]

    def render(self) -> str:
        with self._lock:
            tau = (self.accepted + self.request_steps) / self.request_steps if self.request_steps else 0.0
            alpha = self.accepted / self.drafted if self.drafted else 0.0
            ppa = [(i + 1, a / d if d else 0.0) for i, (a, d) in enumerate(zip(self.accepted_at, self.drafted_at))]
            fams = [
                ("verispec_requests_total", "counter", "finished requests by outcome",
                 [(f'{{outcome="{k}"}}', v) for k, v in self.requests.items()]),
                ("verispec_requests_running", "gauge", "requests in the running batch", [("", self.running)]),
                ("verispec_requests_waiting", "gauge", "requests in the admission queue", [("", self.waiting)]),
                ("verispec_prompt_tokens_total", "counter", "prefilled prompt tokens", [("", self.prompt_tokens)]),
                ("verispec_generation_tokens_total", "counter", "committed new tokens", [("", self.generation_tokens)]),
                ("verispec_engine_steps_total", "counter", "batched decode steps", [("", self.engine_steps)]),
                ("verispec_request_steps_total", "counter", "per-request decode steps (sum of batch sizes)",
                 [("", self.request_steps)]),
                ("verispec_draft_tokens_total", "counter", "draft tokens sent to the target", [("", self.drafted)]),
                ("verispec_accepted_tokens_total", "counter", "draft tokens accepted", [("", self.accepted)]),
                ("verispec_nospec_steps_total", "counter", "steps where the batch size turned speculation off",
                 [("", self.nospec_steps)]),
                ("verispec_mean_accepted_tokens", "gauge", "tau: tokens committed per request step, bonus included",
                 [("", tau)]),
                ("verispec_acceptance_rate", "gauge", "alpha: accepted / drafted", [("", alpha)]),
                ("verispec_per_position_acceptance", "gauge",
                 "steps accepting draft position i / steps drafting it (finished requests)",
                 [(f'{{position="{i}"}}', v) for i, v in ppa]),
                ("verispec_batch_size", "gauge", "batch size of the last step", [("", self.last_batch_size)]),
                ("verispec_draft_cap", "gauge", "draft cap of the last step (-1 = uncapped)", [("", self.last_draft_cap)]),
                ("verispec_cache_rows_in_use", "gauge", "KV cache rows held by requests (0 when idle)",
                 [("", self.cache_rows_in_use)]),
                *self._prefix_families(),
            ]
            lines = []
            for name, kind, help_, samples in fams:
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
                lines += [f"{name}{labels} {_num(v)}" for labels, v in samples]
            for name, hist, help_ in ((("verispec_step_batch_size", self.batch_size, "batch size per step")),
                                      ("verispec_time_to_first_token_seconds", self.ttft, "queue + prefill time"),
                                      ("verispec_request_latency_seconds", self.latency, "submission to finish")):
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} histogram", *hist.lines(name)]
        return "\n".join(lines) + "\n"
