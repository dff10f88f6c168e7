"""Runners: one method, ready to generate for a prompt, timed the same way for everyone.

A runner turns prompt token ids into a :class:`Generation` (generated ids + timings +
whatever speculation counters that engine exposes). Our methods run through
:class:`EngineRunner`; peers (transformers, llama.cpp) live in ``bench/peers.py``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from ..drafters.base import Drafter
from ..drafters.prediction import PredictionDrafter
from ..cost_model import CostModel
from ..engine import Engine
from ..engine.prefix_cache import PrefixCache
from ..models.base import CausalLM
from ..types import SamplingParams


@dataclass(frozen=True)
class Generation:
    """One timed generation. Counters an engine does not expose are ``None``."""

    token_ids: tuple[int, ...]  # generated ids, prompt excluded, EOS excluded
    finish_reason: str
    wall_s: float  # prefill included
    prefill_s: float | None  # time to the first generated token
    target_forwards: int | None  # prefill included
    steps: int | None  # decode steps after prefill (one target forward each)
    drafted: int | None
    accepted: int | None
    accepted_at: tuple[int, ...] | None  # steps that accepted draft depth i+1
    drafted_at: tuple[int, ...] | None  # steps that drafted depth i+1
    cpu_s: float | None = None  # CPU time of this process (all threads) during the call
    cached_tokens: int | None = None  # prompt tokens reused from the prefix cache (not prefilled)


class Runner(Protocol):
    """A method, timed. Runners subclass it (``reset_learned`` defaults to a no-op). One that
    ``predicts`` takes ``generate(..., prediction=ids)`` (Predicted Outputs) where an item has one."""

    label: str
    predicts: bool = False

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation: ...

    def memory_bytes(self) -> int:
        """Bytes this method holds beyond the shared target (draft weights, tables, ...)."""
        ...

    def reset_learned(self) -> None:
        """Forget what was learned across requests: the warm-up's prompts are measured later."""


def sync(device: torch.device) -> None:
    """Wait for queued device work so timers measure it (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class EngineRunner(Runner):
    """A drafter through our engine (the drafter ``none`` is the baseline), with its own
    prefix cache (``prefix_cache_mb``, 0 = off): each method reuses only its own requests.
    ``predicts``: the drafter is wrapped in a ``PredictionDrafter`` and items' predictions are sent;
    ``tokenizer`` (the target's) lets its drafts follow an edit through the text (``edit_align.py``);
    ``prompt_code``: no prediction is sent, the prompt's last code block is aligned instead."""

    def __init__(self, label: str, target: CausalLM, drafter: Drafter, num_draft_tokens: int, policy: str = "fixed",
                 prefix_cache_mb: float = 0, predicts: bool = False, cost: CostModel | None = None,
                 tokenizer=None, prompt_code: bool = False):
        self.label, self.drafter, self.predicts = label, drafter, predicts
        wrapped = (PredictionDrafter(drafter, cost, tokenizer=tokenizer, prompt_code=prompt_code)
                   if predicts or prompt_code else drafter)
        self.engine = Engine(target, wrapped, num_draft_tokens, policy, PrefixCache.from_mb(prefix_cache_mb), cost)
        self._device = target.info.device

    def generate(self, prompt_ids: list[int], params: SamplingParams, prediction: list[int] = ()) -> Generation:
        sync(self._device)
        t0, c0 = time.perf_counter(), time.process_time()
        req = self.engine.add_request(prompt_ids, params, prediction=prediction)
        try:
            while not req.finished:
                self.engine.step(req)
        finally:
            self.engine.finish(req, req.finished or "stop")
        sync(self._device)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        s = req.stats
        return Generation(tuple(req.generated), str(req.finished), wall, s.prefill_s,
                          s.target_forwards, s.steps, s.drafted, s.accepted,
                          tuple(s.accepted_at), tuple(s.drafted_at), cpu, s.cached_tokens)

    def reset_learned(self) -> None:
        """Forget what the drafter learned across requests (its optional ``reset``) and the
        prefix cache: the warm-up's prompts are measured later."""
        self.drafter.reset()
        if self.engine.prefix_cache is not None:
            self.engine.prefix_cache.clear()

    def memory_bytes(self) -> int:
        return int(self.drafter.memory_bytes())
