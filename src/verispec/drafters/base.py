"""The Drafter interface: propose a draft tree from the context, learn from what was accepted.

A drafter never touches the target model or its cache. It may keep per-request state
(keyed by request id) that changes only in ``start``, ``observe`` and ``finish``, and,
for model drafters, its own KV cache that ``propose`` brings up to date. Returning a
root-only tree means "no draft this step" (the step is then plain decoding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Generic, Protocol, TypeVar, runtime_checkable

import torch

from ..tree import DraftTree
from ..types import SamplingParams


@dataclass(frozen=True)
class DraftContext:
    request_id: str
    tokens: list[int]  # all committed tokens (prompt + generated); tokens[-1] is the root
    budget: int  # at most this many drafted nodes (root excluded)
    params: SamplingParams
    generator: torch.Generator  # the drafter's own per-request generator


@dataclass(frozen=True)
class Observation:
    """What one verification step taught: handed to ``Drafter.observe``.

    Drafters with ``needs_hidden_states`` also observe the prefill, as the verification
    of a chain draft equal to the prompt: ``tree = chain(prompt[0], prompt[1:])``, every
    node accepted, ``new_tokens = prompt[1:] + [first generated token]``, the target's
    hidden states at every prompt position, and logits of the last position only ([1, V]:
    the LM head over a long prompt is a large share of the prefill). That observation
    comes after ``start`` and before the first ``propose``."""

    request_id: str
    tree: DraftTree
    path: list[int]  # accepted node indices (root excluded)
    new_tokens: list[int]  # tokens committed this step (accepted + recovered/bonus)
    logits: torch.Tensor  # [N, V] target logits at every tree node ([1, V] for the prefill)
    # [N, H] target last hidden states, if requested; [N, k * H] the outputs of the drafter's
    # ``hidden_layers`` (k layers, concatenated) when it declares some (EAGLE-3)
    hidden: torch.Tensor | None


def hidden_request(drafter) -> dict:
    """The target forward's keyword arguments for what ``drafter`` observes: ``want_hidden``,
    plus ``hidden_layers`` only for drafters that declare layers (other backends need not
    know the argument)."""
    layers = tuple(getattr(drafter, "hidden_layers", ()))
    if layers:
        return {"want_hidden": False, "hidden_layers": layers}
    return {"want_hidden": drafter.needs_hidden_states}


def hidden_tag(drafter) -> tuple | None:
    """What ``drafter`` observes as a hashable tag (features a prefix cache may keep for
    it: the last hidden state, or which layers); None when it observes none."""
    req = hidden_request(drafter)
    return tuple(sorted(req.items())) if req.get("want_hidden") or req.get("hidden_layers") else None


def observed_hidden(out) -> torch.Tensor | None:
    """[B, N, *] what the drafter asked for in ``hidden_request``: layer outputs, else hidden."""
    return out.layers if getattr(out, "layers", None) is not None else out.hidden


@runtime_checkable
class Drafter(Protocol):
    name: ClassVar[str]
    needs_hidden_states: ClassVar[bool]  # engine asks the target for hidden states (and reports the prefill)
    provides_probs: ClassVar[bool]  # trees carry draft_probs when sampling

    def start(self, request_id: str, prompt_ids: list[int]) -> None: ...

    def propose(self, ctx: DraftContext) -> DraftTree: ...

    def observe(self, obs: Observation) -> None: ...

    def finish(self, request_id: str) -> None: ...

    def memory_bytes(self) -> int: ...


S = TypeVar("S")


class RequestTable(Generic[S]):
    """Per-request drafter state keyed by request id, with the lifecycle errors every
    stateful drafter raises: starting a request twice, or using one never started."""

    def __init__(self) -> None:
        self._states: dict[str, S] = {}

    def add(self, request_id: str, state: S) -> None:
        if request_id in self._states:
            raise ValueError(f"request {request_id!r} already started")
        self._states[request_id] = state

    def get(self, request_id: str) -> S:
        if request_id not in self._states:
            raise ValueError(f"request {request_id!r} was not started (or already finished)")
        return self._states[request_id]

    def pop(self, request_id: str) -> S | None:
        """Forget a request; finishing an unknown one is a no-op."""
        return self._states.pop(request_id, None)

    def values(self):
        return self._states.values()


class StatelessDrafter:
    """Base for drafters with nothing to set up or learn (they read ``ctx.tokens``)."""

    needs_hidden_states: ClassVar[bool] = False
    provides_probs: ClassVar[bool] = False

    def start(self, request_id: str, prompt_ids: list[int]) -> None:
        pass

    def observe(self, obs: Observation) -> None:
        pass

    def finish(self, request_id: str) -> None:
        pass

    def memory_bytes(self) -> int:
        return 0


class NoDrafter(StatelessDrafter):
    """Plain autoregressive decoding through the same engine: the baseline."""

    name: ClassVar[str] = "none"

    def propose(self, ctx: DraftContext) -> DraftTree:
        return DraftTree.chain(ctx.tokens[-1], [])
