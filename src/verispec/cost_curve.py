"""Measured costs on this machine, for sizing drafts (Sequoia's hardware-aware size,
``policies.tree_shape``; the draft budgets of ``policies.draft_budget``): the target's
``t(n)`` (``measure_cost_curve``), a drafter's ``c(n)`` (``measure_draft_cost``), a draft
model's decode step against the target's (``measure_draft_step``), each in units of one
target decode step and kept per configuration (``cached_cost_curve``). Above ``drafters``,
``models`` and ``policies`` (it drives a model and a drafter), so none of them imports it
(they hold a ``ContextCostCurve`` they were given and call its methods).

By context (``ContextCostCurve``, ``cached_context_curve``): a step's costs depend on how many
tokens the step attends to. Verifying n tokens reads the weights once and the K/V of the whole
context once per token, so at 2-3k tokens of history t(n) is steeper than at 128 (the compiled
runtime on Qwen2.5-Coder 1.5B: t(4)/t(1) 1.51 at 2048 against 1.24 at 512, ``docs/benchmarks.md``),
and a draft model's step and its feed of the history cost more there. Each curve is timed at a
few contexts (``CONTEXT_GRID``) and read at the request's length, linearly between them."""

from __future__ import annotations

import bisect
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from .policies.draft_budget import interpolate
from .system import load_and_cores

DEFAULT_SIZES = (1, 2, 4, 8, 12, 16, 24, 32)
PROBE_CONTEXT = 128  # the context every curve was timed at before curves by context (and still the first)
CONTEXT_GRID = (PROBE_CONTEXT, 1024, 3072)  # the contexts curves are timed at (``cached_context_curve``)
FEED_TOKENS = 64  # a draft model's feed of the history is timed as one forward over this many tokens


def _bushy_parents(n: int) -> list[int]:
    """Parents of a root + n node tree, 3 children per node (a representative tree mask)."""
    return [-1] + [(i - 1) // 3 for i in range(1, n + 1)]


# stored with cached curves: curves timed another way, or by kernels since changed (the suffix, bumped when
# the compiled runtime's speed changes: 2 = its kernels prefetch 8 KB ahead), are measured again
ESTIMATOR = "min/2"


def _seconds(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Fastest wall time of ``fn()`` over ``repeats`` runs after one warm-up run: other work
    on a shared machine only ever adds delay, so the minimum is the least noisy estimate
    (a median still moved t(1) by 2x under load)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(repeats + 1):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times[1:])


def _probe_context(model, context: int, extra: int, **hidden):
    """A cache holding a ``context``-token prefill (synthetic ids), its ids and output;
    ``hidden``: the forward's hidden-state arguments (``drafters.base.Features.forward_kwargs``)."""
    dev = model.info.device
    cache = model.new_cache(context + extra + 1)
    ids = torch.arange(context, device=dev).remainder(model.info.vocab_size - 1).add(1)[None]
    out = model.forward(ids, torch.arange(context, device=dev)[None], cache, last_logits_only=True, **hidden)
    return cache, ids, out


@torch.inference_mode()
def measure_cost_curve(model, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 5,
                       context: int = 128) -> dict[int, float]:
    """``t(n)``: time of one target forward over root + n tree nodes (tree mask, after a
    ``context``-token prefill) divided by the time of a 1-token decode step (``_seconds``)."""
    from .tree import DraftTree

    dev = model.info.device
    cache, _, _ = _probe_context(model, context, max(sizes, default=0))

    def timed(n: int) -> float:
        tree = DraftTree(tuple(range(1, n + 2)), tuple(_bushy_parents(n)))
        x = torch.tensor([tree.tokens], device=dev)
        pos = torch.tensor([tree.depths], device=dev) + context
        mask = tree.ancestor_mask(dev)

        def step():
            model.forward(x, pos, cache, tree_mask=mask)
            cache.truncate(context)
        return _seconds(step, repeats, dev)

    base = timed(0)
    return {n: timed(n) / base for n in sizes}


@torch.inference_mode()
def measure_draft_cost(model, drafter, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 3,
                       context: int = 128) -> dict[int, float]:
    """``c(n)``: time of ``drafter.propose`` with budget n (``_seconds``; greedy, after a
    ``context``-token prompt was prefilled and, for drafters that read hidden states,
    observed with the features they read, EAGLE-3's target layers included) divided by
    the target's 1-token decode time: what drafting n nodes adds to a step, in the unit of
    ``t(n)``. The probe request is finished afterwards."""
    from .drafters.base import DraftContext, Observation, features_of
    from .sampling import make_generator
    from .types import SamplingParams

    dev = model.info.device
    feats = features_of(drafter)
    cache, ids, out = _probe_context(model, context, 1, **feats.forward_kwargs())
    prompt = ids[0].tolist()
    first = int(out.logits[0, -1].argmax())
    root = torch.tensor([[first]], device=dev)

    def decode():
        model.forward(root, torch.tensor([[context]], device=dev), cache)
        cache.truncate(context)
    base = _seconds(decode, 5, dev)
    rid = "cost-probe"
    drafter.start(rid, prompt)
    try:
        if feats.wanted:
            drafter.observe(Observation.prefill(rid, prompt, first, out.logits[0], feats.select(out)[0]))
        gen = make_generator(0, 1)

        def cost(n: int) -> float:
            ctx = DraftContext(rid, [*prompt, first], n, SamplingParams(), gen)
            return _seconds(lambda: drafter.propose(ctx), repeats, dev) / base
        return {n: cost(n) for n in sizes}
    finally:
        drafter.finish(rid)


def machine_busy() -> str | None:
    """Why timings taken now would be skewed (``"load average 9.8 on 2 cores"``), or None. With more
    runnable processes than 1.5x the cores, even the fastest of several runs waits for a core: a curve
    timed then makes every later draft on this machine look dear, so it is not stored."""
    measured = load_and_cores()
    if measured is None:  # no load average here (Windows): nothing to judge by
        return None
    load, cores = measured
    return f"load average {load:.1f} on {cores} cores" if load > 1.5 * cores else None


def cached_cost_curve(model, key: str, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 5,
                      cache_dir: str | Path | None = None,
                      measure: Callable[..., dict[int, float]] = measure_cost_curve) -> dict[int, float]:
    """``measure(model, sizes, repeats)`` (the target's ``t(n)`` by default; a drafter's
    ``c(n)`` with ``measure_draft_cost``) once per ``key`` (e.g. model/backend/quant/threads),
    stored as JSON under ``<verispec cache>/cost-curves/``; later calls read it back. A curve timed
    while the machine is busy (``machine_busy``) is used but not stored: the next process times it again."""
    from .models.model_cache import default_cache_dir, warn, write_cache_file

    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in key)
    if len(safe) > 200:  # a name under the file system's 255 bytes (keys holding two model paths): kept unique by a hash
        import hashlib

        safe = f"{safe[:150]}-{hashlib.sha256(key.encode()).hexdigest()[:24]}"
    path = Path(cache_dir or default_cache_dir()) / "cost-curves" / f"{safe}.json"
    if path.is_file():
        try:  # the cache is input: a damaged file is measured again and replaced
            stored = json.loads(path.read_text(encoding="utf-8"))
            curve = {int(n): float(t) for n, t in stored["t"].items()}
            if set(sizes) <= set(curve) and stored.get("estimator") == ESTIMATOR:
                return {n: curve[n] for n in sizes}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            warn(f"cached cost curve {path} is damaged ({type(err).__name__}): measuring it again")
    busy = machine_busy()
    curve = measure(model, sizes, repeats)
    busy = busy or machine_busy()
    if busy:
        warn(f"cost curve {key} timed while the machine is busy ({busy}): used now, not stored")
        return curve
    write_cache_file(path, json.dumps({"key": key, "repeats": repeats, "estimator": ESTIMATOR,
                                       "t": {str(n): t for n, t in curve.items()}}, indent=1) + "\n")
    return curve


def measure_draft_step(target, draft, rounds: int = 7, context: int = PROBE_CONTEXT,
                       sizes: Sequence[int] = (1,)) -> dict[int, float]:
    """{n: a draft forward over n tokens / one target decode step}, both after a ``context``-token
    prefill: n = 1 is a draft step, n = FEED_TOKENS a feed of the history (a catch-up). The fastest of
    ``rounds`` each, the models alternating, so that load on a shared machine (which only ever adds
    delay) weighs on both alike."""
    dev = torch.device("cpu")
    cache, _, out = _probe_context(target, context, 1)
    root = out.logits[0, -1:].argmax(-1)[None]

    def target_step():
        target.forward(root, torch.tensor([[context]]), cache)
        cache.truncate(context)
    dcache, _, dout = _probe_context(draft, context, max(sizes))
    droot = dout.logits[0, -1:].argmax(-1)[None]

    def draft_forward(n: int):
        ids = droot if n == 1 else torch.arange(n).remainder(draft.info.vocab_size - 1).add(1)[None]
        draft.forward(ids, torch.arange(context, context + n)[None], dcache, last_logits_only=True)
        dcache.truncate(context)
    steps = [target_step, *(partial(draft_forward, n) for n in sizes)]
    best = [float("inf")] * len(steps)
    for _ in range(rounds):
        for i, step in enumerate(steps):
            best[i] = min(best[i], _seconds(step, 1, dev))
    return {n: b / best[0] for n, b in zip(sizes, best[1:])}


@dataclass(frozen=True)
class ContextCostCurve:
    """``t(n | context)``: cost curves (size n -> cost, in units of one target decode step at that
    context) timed at a few contexts, read at any context linearly between the two timed contexts
    around it and held at the nearest timed one outside them (extrapolating a noisy slope could make
    a long context dearer than it is). Between sizes a curve is read as ``policies.draft_budget.
    interpolate`` reads it. One context (``single``) is one curve at every context: the behaviour
    before curves by context. Every curve has the same sizes.

    >>> c = ContextCostCurve({128: {1: 1.0, 4: 1.2}, 2048: {1: 1.1, 4: 1.6}})
    >>> c.t(4, 1088), c.t(1, 4096), c.at(100), c.contexts
    (1.4, 1.1, {1: 1.0, 4: 1.2}, (128, 2048))
    """

    curves: Mapping[int, Mapping[int, float]]

    def __post_init__(self):
        if not self.curves:
            raise ValueError("a cost curve by context needs at least one context")
        sizes = None
        for context, curve in self.curves.items():
            if context < 0 or not curve or any(n < 0 or not math.isfinite(t) or t < 0 for n, t in curve.items()):
                raise ValueError(f"cost curve at context {context}: needs sizes >= 0 and finite costs >= 0, "
                                 f"got {dict(curve)}")
            if sizes is not None and set(curve) != sizes:
                raise ValueError(f"cost curves by context need the same sizes at every context, got {self.curves}")
            sizes = set(curve)
        object.__setattr__(self, "curves", {c: dict(sorted(self.curves[c].items())) for c in sorted(self.curves)})

    @classmethod
    def single(cls, curve: Mapping[int, float], context: int = PROBE_CONTEXT) -> ContextCostCurve:
        """One curve, used at every context."""
        return cls({context: dict(curve)})

    @property
    def contexts(self) -> tuple[int, ...]:
        return tuple(self.curves)

    def at(self, context: int) -> dict[int, float]:
        """The curve at ``context`` tokens (a new dict)."""
        cs = self.contexts
        if context <= cs[0] or len(cs) == 1:
            return dict(self.curves[cs[0]])
        if context >= cs[-1]:
            return dict(self.curves[cs[-1]])
        i = bisect.bisect_right(cs, context)
        lo, hi = self.curves[cs[i - 1]], self.curves[cs[i]]
        w = (context - cs[i - 1]) / (cs[i] - cs[i - 1])
        return {n: round(t + (hi[n] - t) * w, 12) for n, t in lo.items()}

    def t(self, n: int, context: int, at_zero: float = 1.0) -> float:
        """The cost of size ``n`` at ``context`` tokens (``at_zero`` at size 0: 1 for a verify curve,
        plain decoding; 0 for a drafter's cost, no call)."""
        return interpolate(self.at(context), n, at_zero)


def cached_context_curve(model, key: str, contexts: Sequence[int] = CONTEXT_GRID,
                         sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 5, context_repeats: int = 3,
                         cache_dir: str | Path | None = None, measure: Callable[..., dict[int, float]] = measure_cost_curve,
                         max_length: int | None = None) -> ContextCostCurve:
    """``measure(model, sizes, repeats, context=C)`` at each context C of ``contexts`` whose probe fits
    ``max_length`` (the model's unless given: C plus the largest size and its root), each kept as
    ``cached_cost_curve`` keeps it: at PROBE_CONTEXT under ``key`` with ``repeats`` (the curve cached
    before curves by context), elsewhere under ``key-ctxC`` with ``context_repeats`` (longer forwards,
    fewer repeats: the minimum of few is already the quiet figure). None fits: PROBE_CONTEXT alone."""
    room = (model.info.max_length if max_length is None else max_length) - max(sizes, default=0) - 2
    fitting = sorted(c for c in set(contexts) if 0 < c <= room) or [PROBE_CONTEXT]
    curves = {}
    for c in fitting:
        at_key, r = (key, repeats) if c == PROBE_CONTEXT else (f"{key}-ctx{c}", context_repeats)
        curves[c] = cached_cost_curve(model, at_key, sizes, r, cache_dir, measure=partial(measure, context=c))
    return ContextCostCurve(curves)
