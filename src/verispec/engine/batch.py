"""Batched speculative decoding with continuous batching (the server's engine).

Each ``BatchEngine.step`` takes the running requests and

1. drafts for every request, the requests of one method together (``Engine.propose_batch``:
   the draft model runs one batched forward per draft step for all of them; the draft
   budget is capped by batch size, see ``draft_cap``);
2. verifies ALL drafts in ONE target forward: the trees are packed into ragged rows
   ``[B, N]`` (``pack_trees``), each row at its own cache length, with per-row positions and
   tree masks and ``num_tokens[b]`` real tokens (BASS, Qian et al. 2024, arXiv 2404.15778;
   EMS-SD, Ni et al. 2024: ragged draft and cache lengths by masking, no padding of caches
   and no recomputation of accepted tokens);
3. verifies, compacts and commits each request on its own (``Engine.complete_step``).

Requests join between steps (``add_request`` prefills them) and leave as soon as they
finish (``release``). Backends with ``forward_batch`` and a cache pool (the compiled CPU
runtime and the native PyTorch runtime: ``models/cache_pool.PooledLM``) run step 2 as one
forward; transformers steps the requests one by one through the same three phases. A failing request never takes the batch down: a drafter
error fails that request only (the batch is drafted again request by request), and a failed batched forward is retried row by row so the
culprit fails alone.

Glossary: as ``engine/engine.py`` (committed, drafted, accepted, root, tree).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from ..drafters.base import features_of
from ..memory import cache_pool_bytes, check_fits, logits_bytes
from ..models.base import CausalLM, KVCache
from ..tree import DraftTree
from ..types import FinishReason, SamplingParams, TokenLogprob
from .engine import Engine, StepResult, host_threads
from .prefix_cache import PrefixCache
from .request import Request
from .scoring import prompt_logprobs


@dataclass(frozen=True)
class SpecSchedule:
    """How long drafts may be this step, given the batch (vLLM turns speculation off by
    batch size; here the draft is shortened first, then turned off).

    policy "goodput" (default): pick the cap k that maximizes expected committed tokens per
        unit of forward cost over the whole batch (SmartSpec, Liu et al. 2024, arXiv
        2406.14066), from each request's acceptance rate so far (``goodput_cap``). The cost
        model is affine in the rows of the batched forward, ``fixed_cost_rows + rows``: the
        fixed part (reading the weights) expressed in rows. If a forward of n token rows
        costs t(n) ~ a + b n, then fixed_cost_rows = a / b. Least-squares fits of the
        compiled runtime's measured t(n) (docs/cpu.md, "Measurements"; docs/benchmarks.md)
        give a / b = 5.8-7.8 for SmolLM2 at 2 threads and contexts of 128-512 (4.0 at 1,500),
        2.3 at 1 thread (short context, also for 1-32 rows of a batched forward), and 4.0 /
        2.2 for the Qwen2.5-Coder 1.5B at contexts 512 / 2,048. The default 6 fits the
        default server (SmolLM2, one thread per core on a 2-core machine, chat contexts up to
        512 tokens); with 1 thread or long contexts set 2-4. (The earlier 18 was measured on
        the fp32 native runtime, whose padded rows make small forwards cost alike.)
    policy "budget": at most ``token_budget`` tokens (roots + drafts) per forward, summed over
        the batch (``draft_cap``); 0 = unlimited.
    disable_at: batch size from which speculation is off (0 = never), under either policy.

    The schedule only applies to batched verification: stepped one by one, a request's
    forward does not get dearer when the batch grows.
    """

    policy: Literal["goodput", "budget"] = "goodput"
    token_budget: int = 32
    disable_at: int = 0
    fixed_cost_rows: float = 6.0

    def __post_init__(self) -> None:
        if self.policy not in ("goodput", "budget"):
            raise ValueError(f"unknown speculation schedule {self.policy!r}; use goodput or budget")
        if self.token_budget < 0 or self.disable_at < 0 or not self.fixed_cost_rows >= 0:
            raise ValueError(f"token_budget, disable_at and fixed_cost_rows must be >= 0, got {self}")

    def max_drafted(self, alphas: Sequence[float], k_max: int, free_tokens: int = 1) -> int | None:
        """The cap for a batch whose requests have acceptance rates ``alphas``."""
        if self.disable_at and len(alphas) >= self.disable_at:
            return 0
        if self.policy == "budget":
            return draft_cap(len(alphas), self.token_budget, 0, free_tokens)
        return goodput_cap(alphas, k_max, self.fixed_cost_rows, free_tokens)


def draft_cap(batch_size: int, token_budget: int, disable_at: int, free_tokens: int = 1) -> int | None:
    """Most draft tokens per request this step under a token budget (None = no cap).

    Each row feeds its root plus its drafts, so a budget of T tokens leaves
    ``T // B - 1`` drafts per row. ``free_tokens``: a backend that pads every row to that
    many tokens anyway (the batch-invariant native runtime's ``min_rows``) verifies up to
    ``free_tokens - 1`` drafts at no extra cost, so the cap never goes below that.
    Examples with T = 32: B=4 -> 7, B=8 -> 3, B=16 -> 1, B=40 -> 0 (plain decoding);
    with free_tokens=4, B=16 -> 3; ``disable_at=8`` makes B=8 -> 0.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if disable_at and batch_size >= disable_at:
        return 0
    if not token_budget:
        return None
    return max(0, free_tokens - 1, token_budget // batch_size - 1)


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens one step commits when drafting k tokens, each accepted with
    probability alpha (Leviathan et al. 2023, eq. 1): (1 - alpha^(k+1)) / (1 - alpha).

    ``expected_tokens(0.5, 2) == 1.75``; alpha = 0 gives 1 (the bonus token); alpha = 1 gives k + 1.
    """
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def goodput_cap(alphas: Sequence[float], k_max: int, fixed_cost_rows: float, free_tokens: int = 1) -> int:
    """The draft cap k in [0, k_max] maximizing batch goodput
    ``sum_b expected_tokens(alpha_b, k) / (fixed_cost_rows + B * max(k + 1, free_tokens))``.

    Example (fixed 18 rows, no padding): one request with alpha 0.8 drafts 8 (goodput
    4.33 / 27 = 0.16 vs 1 / 19 = 0.05 without drafts); 16 requests with alpha 0.3 get
    k = 0, since 16 * 1.3 / 50 = 0.42 < 16 / 34 = 0.47. Ties go to the shorter draft.
    """
    if not alphas:
        raise ValueError("goodput_cap needs at least one request")
    b = len(alphas)
    best_k, best = 0, -1.0
    for k in range(max(0, k_max) + 1):
        value = sum(expected_tokens(a, k) for a in alphas) / (fixed_cost_rows + b * max(k + 1, free_tokens))
        if value > best * (1 + 1e-9):
            best_k, best = k, value
    return best_k


def acceptance_estimate(accepted: int, drafted: int, prior: float = 0.5, weight: float = 4.0) -> float:
    """A request's per-token acceptance rate so far, shrunk toward ``prior`` while it has
    few drafts: ``(accepted + prior * weight) / (drafted + weight)``; (0, 0) -> 0.5."""
    return (accepted + prior * weight) / (drafted + weight)


def pack_trees(
    trees: Sequence[DraftTree], starts: Sequence[int], device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Ragged draft trees -> one batched forward's inputs.

    Returns ``ids [B, N]``, ``positions [B, N]``, ``masks [B, N, N]`` (ancestor masks; False
    in padding) and ``num_tokens`` (real tokens per row), N = the largest tree. Row b's node i
    sits at position ``starts[b] + depth(i)``; padding repeats the row's first position and
    token 0 (the backend ignores tokens past ``num_tokens[b]``).

    Example: a chain 7 -> 3 -> 5 at cache length 10 and a root-only tree 9 at length 4::

        ids       = [[7, 3, 5], [9, 0, 0]]
        positions = [[10, 11, 12], [4, 4, 4]]
        num_tokens = [3, 1]
    """
    if len(trees) != len(starts) or not trees:
        raise ValueError(f"pack_trees: need one start per tree, got {len(trees)} trees, {len(starts)} starts")
    n = max(t.size for t in trees)
    b = len(trees)
    ids = torch.zeros(b, n, dtype=torch.long)
    pos = torch.tensor(list(starts), dtype=torch.long)[:, None].repeat(1, n)  # [B, N]
    masks = torch.zeros(b, n, n, dtype=torch.bool)
    for row, (tree, start) in enumerate(zip(trees, starts)):
        k = tree.size
        ids[row, :k] = torch.tensor(tree.tokens)
        pos[row, :k] = start + torch.tensor(tree.depths)
        masks[row, :k, :k] = tree.ancestor_mask()
    return ids.to(device), pos.to(device), masks.to(device), [t.size for t in trees]


def padded_tokens(target: CausalLM) -> int:
    """Tokens per row a batched forward costs at least (``BackendCaps.min_verify_rows``: native's padding)."""
    return target.caps.min_verify_rows


def supports_batching(target: CausalLM) -> bool:
    """A backend batches when it declares so (``BackendCaps.batched``): it has a cache pool and
    ``forward_batch`` (``PooledLM``: models/cpu.py, models/native.py)."""
    return target.caps.batched


@dataclass(frozen=True)
class BatchStep:
    """What one ``BatchEngine.step`` did. ``results[i]`` belongs to the i-th request: a
    StepResult, or the exception that failed that request (it must then be released)."""

    results: list[StepResult | Exception]
    batch_size: int
    max_drafted: int | None  # the schedule's cap this step (None = uncapped)
    batched: bool  # the verify ran as one batched forward
    forward_s: float


def batch_bytes(target: CausalLM, engines: dict[str, Engine], max_batch: int, max_length: int) -> int:
    """Bytes a full batch needs: its cache-pool rows (measured on one row) and the logits of
    one verify forward (every row's draft plus its root, and their probabilities)."""
    k = max((e.num_draft_tokens for e in engines.values()), default=1)
    return cache_pool_bytes(target, max_batch, max_length) + logits_bytes(max_batch * (k + 1), target.info.vocab_size)


class BatchEngine:
    """Continuous batching over a shared target. ``engines`` maps a drafter name to an
    ``Engine`` (one per drafter, all on ``target``); every request picks one by name.

    Lifecycle of a request: ``add_request`` (validate, take a cache row, prefill) ->
    ``step`` any number of times while unfinished -> ``release`` (exactly once: finishes
    the drafter's state and returns the cache row). Invariant: ``len(active) <= max_batch``.
    """

    def __init__(self, target: CausalLM, engines: dict[str, Engine], max_batch: int,
                 max_length: int, schedule: SpecSchedule = SpecSchedule(), batched: bool | None = None):
        if not engines:
            raise ValueError("BatchEngine needs at least one drafter engine")
        if any(e.target is not target for e in engines.values()):
            raise ValueError("every drafter engine must run on the BatchEngine's target")
        if len({id(e.prefix_cache) for e in engines.values()}) != 1:
            raise ValueError("every drafter engine must share one prefix cache (or none)")
        if max_batch < 1 or not 2 <= max_length <= target.info.max_length:
            raise ValueError(f"need max_batch >= 1 and 2 <= max_length <= {target.info.max_length}, "
                             f"got {max_batch}, {max_length}")
        can_batch = supports_batching(target)
        if batched and not can_batch:
            raise ValueError(f"backend {type(target).__name__} has no forward_batch / cache pool")
        self.target, self.engines, self.schedule = target, dict(engines), schedule
        self.max_batch, self.max_length = max_batch, max_length
        self.batched = can_batch if batched is None else batched
        if self.batched:  # refuse a batch the machine cannot hold before allocating it (one line)
            check_fits(batch_bytes(target, engines, max_batch, max_length), f"a batch of {max_batch} requests x "
                       f"{max_length} tokens", "lower --max-batch or --max-model-len")
        self._pool = target.new_cache_pool(max_batch, max_length) if self.batched else None
        self._active: dict[str, tuple[Request, Engine]] = {}

    # ---- lifecycle ---------------------------------------------------------------------
    @property
    def active(self) -> int:
        return len(self._active)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    drafter: str, draft_limit: int | None = None, fork_of: str | None = None,
                    prediction: tuple[int, ...] = ()) -> Request:
        """Validate, take a cache row and prefill (the first token is committed).
        ``draft_limit`` caps this request's drafts (0 = plain decoding). ``fork_of``: a
        running request with the same prompt whose prefill is shared (``Engine.fork``:
        n > 1 samples); when it is no longer running this request prefills on its own.
        ``prediction``: the predicted output's token ids (Predicted Outputs; a fork shares its parent's)."""
        if request_id in self._active:
            raise ValueError(f"request {request_id!r} is already running")
        if drafter not in self.engines:
            raise ValueError(f"unknown drafter {drafter!r}; this engine has: {', '.join(self.engines)}")
        if len(self._active) >= self.max_batch:
            raise ValueError(f"the batch is full ({self.max_batch} requests)")
        if len(prompt_ids) + params.max_new_tokens > self.max_length:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) "
                             f"exceeds the context of {self.max_length}")
        entry = self._active.get(fork_of) if fork_of is not None else None
        parent = entry[0] if entry is not None else None
        cache = self._new_cache()
        try:
            if parent is not None and parent.prompt_ids == list(prompt_ids):
                req = self.engines[drafter].fork(parent, params, request_id, cache, draft_limit)
            else:
                req = self.engines[drafter].add_request(prompt_ids, params, request_id, cache, draft_limit, prediction)
        except BaseException:
            self._free_cache(cache)
            raise
        self._active[request_id] = (req, self.engines[drafter])
        return req

    def score_prompt(self, prompt_ids: list[int], num_top: int) -> list[TokenLogprob]:
        """The prompt's log-probabilities (``scoring.prompt_logprobs``), computed in a cache row
        taken and returned here (call it where ``add_request`` could take a row)."""
        vocab = self.target.info.vocab_size
        if not prompt_ids or len(prompt_ids) > self.max_length or not 0 <= min(prompt_ids) <= max(prompt_ids) < vocab:
            raise ValueError(f"a scored prompt needs 1 to {self.max_length} token ids in [0, {vocab})")
        cache = self._new_cache()
        try:
            with host_threads(self.target):
                return prompt_logprobs(self.target, cache, prompt_ids, num_top)
        finally:
            self._free_cache(cache)

    def release(self, req: Request, reason: FinishReason = "stop") -> None:
        """Finish ``req`` (if it is not finished yet) and free its drafter state and cache row."""
        if req.request_id not in self._active:
            raise ValueError(f"request {req.request_id!r} is not running")
        _, engine = self._active.pop(req.request_id)
        try:
            engine.finish(req, req.finished or reason)
        finally:
            self._free_cache(req.cache)

    def is_active(self, request_id: str) -> bool:
        return request_id in self._active

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The prefix cache all drafter engines share (None: off or unsupported)."""
        return next(iter(self.engines.values())).prefix_cache

    @property
    def cache_rows_in_use(self) -> int:
        """KV cache rows held by requests (0 when idle: none leaked)."""
        return self._pool.in_use if self._pool is not None else len(self._active)

    @property
    def free_slots(self) -> int:
        """Requests that can still join (= free cache-pool rows when batching)."""
        return self.max_batch - len(self._active)

    def _new_cache(self) -> KVCache:
        return self._pool.acquire() if self._pool is not None else self.target.new_cache(self.max_length)

    def _free_cache(self, cache: KVCache) -> None:
        if self._pool is not None:
            self._pool.release(cache)

    # ---- one step over the batch -------------------------------------------------------
    def step(self, reqs: Sequence[Request]) -> BatchStep:
        """Propose for every request, verify all drafts in one target forward, commit each."""
        with host_threads(self.target):
            return self._step(reqs)

    def _step(self, reqs: Sequence[Request]) -> BatchStep:
        cap = self._draft_cap(reqs)
        results: list[StepResult | Exception | None] = [None] * len(reqs)
        planned: list[tuple[int, Request, Engine, DraftTree, tuple[float, float]]] = []
        by_engine: dict[int, list[tuple[int, Request]]] = {}  # the requests of each engine (method)
        for i, req in enumerate(reqs):
            if req.request_id not in self._active:
                results[i] = ValueError(f"request {req.request_id!r} is not running")
                continue
            by_engine.setdefault(id(self._active[req.request_id][1]), []).append((i, req))
        for rows in by_engine.values():
            engine = self._active[rows[0][1].request_id][1]
            for (i, req), tree, span in self._propose(engine, rows, cap):
                if isinstance(tree, Exception):
                    results[i] = tree
                else:
                    planned.append((i, req, engine, tree, span))
        planned.sort(key=lambda p: p[0])
        t1 = time.perf_counter()
        outputs, batched = self._forward_all([(r, e, t) for _, r, e, t, _ in planned])
        forward_s = time.perf_counter() - t1
        for (i, req, engine, tree, (t_start, t_drafted)), out in zip(planned, outputs):
            if isinstance(out, Exception):
                results[i] = out
                continue
            try:
                results[i] = engine.complete_step(req, tree, out[0], out[1])
                req.stats.record_time(t_drafted - t_start, time.perf_counter() - t_start)
            except Exception as e:  # noqa: BLE001
                results[i] = e
        return BatchStep(results, len(reqs), cap, batched, forward_s)  # type: ignore[arg-type]

    @staticmethod
    def _propose(engine: Engine, rows: list[tuple[int, Request]], cap: int | None):
        """(row, tree or the exception it raised, (start, end) of its drafting) for one engine's
        requests: drafted together (``Engine.propose_batch``: a draft model runs one forward per
        draft step for all), or, if that raises, each alone, so a failing request fails alone."""
        t0 = time.perf_counter()
        try:
            trees = engine.propose_batch([req for _, req in rows], cap)
            t1 = time.perf_counter()
            return [(row, tree, (t0, t1)) for row, tree in zip(rows, trees)]
        except Exception:  # noqa: BLE001 - retried request by request below
            pass
        out = []
        for row in rows:
            t_req = time.perf_counter()
            try:
                out.append((row, engine.propose(row[1], cap), (t_req, time.perf_counter())))
            except Exception as e:  # noqa: BLE001 - isolate the failing request
                out.append((row, e, (t_req, time.perf_counter())))
        return out

    def _draft_cap(self, reqs: Sequence[Request]) -> int | None:
        if not reqs or not self.batched:
            return None
        alphas = [acceptance_estimate(r.stats.accepted, r.stats.drafted) for r in reqs]
        k_max = max(r.policy.budget() for r in reqs)
        return self.schedule.max_drafted(alphas, k_max, padded_tokens(self.target))

    def _forward_all(self, rows: list[tuple[Request, Engine, DraftTree]]):
        """Logits/hidden per row ([N_b, V], [N_b, H] | None) or the row's exception."""
        if not rows:
            return [], False
        if self.batched and len(rows) > 1:
            try:
                return self._forward_batch(rows), True
            except Exception:  # noqa: BLE001 - fall through: find the culprit row by row
                pass
        out: list = []
        for req, engine, tree in rows:
            try:
                out.append(engine.forward_tree(req, tree))
            except Exception as e:  # noqa: BLE001
                out.append(e)
        return out, False

    def _forward_batch(self, rows: list[tuple[Request, Engine, DraftTree]]):
        """ONE target forward over every row's tree (ragged lengths via num_tokens + masks)."""
        trees = [tree for _, _, tree in rows]
        caches = [req.cache for req, _, _ in rows]
        device = self.target.info.device
        ids, pos, masks, num_tokens = pack_trees(trees, [c.length for c in caches], device)
        feats = [features_of(e.drafter) for _, e, _ in rows]
        kw = {"want_hidden": any(f.wanted for f in feats)}
        layers = {f.layers for f in feats} - {()}
        if len(layers) > 1:
            raise ValueError(f"one batch cannot serve drafters reading different target layers: {sorted(layers)}")
        if layers:
            kw["hidden_layers"] = layers.pop()
        out = self.target.forward_batch(ids, pos, caches, masks, num_tokens=num_tokens, **kw)
        return [
            (out.logits[b, :k], self._row_hidden(out, e, b, k))
            for b, ((_, e, _), k) in enumerate(zip(rows, num_tokens))
        ]

    @staticmethod
    def _row_hidden(out, engine: Engine, b: int, k: int) -> torch.Tensor | None:
        """Row b's [k, *] hidden states in the form its drafter asked for (``Features.select``)."""
        src = features_of(engine.drafter).select(out)
        return None if src is None else src[b, :k]
