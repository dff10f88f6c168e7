"""The Drafter interface: propose a draft tree from the context, learn from what was accepted.

A drafter never touches the target model or its cache. It may keep per-request state
(keyed by request id) that changes only in ``start``, ``observe`` and ``finish``, and,
for model drafters, its own KV cache that ``propose`` brings up to date. Returning a
root-only tree means "no draft this step" (the step is then plain decoding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar, runtime_checkable

import torch

from ..tree import DraftTree
from ..types import SamplingParams

if TYPE_CHECKING:
    from ..constraints import Matcher


@dataclass(frozen=True)
class DraftContext:
    request_id: str
    tokens: list[int]  # all committed tokens (prompt + generated); tokens[-1] is the root
    budget: int  # at most this many drafted nodes (root excluded)
    params: SamplingParams
    generator: torch.Generator  # the drafter's own per-request generator
    prediction: tuple[int, ...] = ()  # the request's predicted output (Predicted Outputs), if any
    # a constrained request's grammar state after ``tokens``: a drafter may advance it to keep its drafts inside the
    # grammar, and must roll it back to this state before ``propose`` returns (draft_model.py)
    grammar: Matcher | None = None


@dataclass(frozen=True)
class Observation:
    """What one verification step taught: handed to ``Drafter.observe``.

    Drafters reading ``features`` also observe the prefill, as the verification
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
    # what the drafter's ``features`` read, if any: [N, H] target last hidden states, or
    # [N, k * H] the outputs of its k ``Features.layers``, concatenated (EAGLE-3)
    hidden: torch.Tensor | None

    @classmethod
    def prefill(cls, request_id: str, prompt: list[int], first: int, logits: torch.Tensor,
                hidden: torch.Tensor | None) -> Observation:
        """The prefill of ``prompt`` as an observation (see the class docstring): the prompt
        as a verified chain, ``first`` (the first generated token) as its bonus token;
        ``logits`` [1, V] of the last prompt position, ``hidden`` of every prompt position."""
        return cls(request_id, DraftTree.chain(prompt[0], prompt[1:]), list(range(1, len(prompt))),
                   [*prompt[1:], first], logits, hidden)


@dataclass(frozen=True)
class Features:
    """What a drafter reads from the target's forwards besides tokens and logits, declared as
    its ``features``: nothing (``NO_FEATURES``), the last hidden state after the final norm
    (``LAST_HIDDEN``: EAGLE, Medusa), or the outputs of these decoder layers, concatenated in
    this order (``Features(layers=...)``: EAGLE-3). A drafter reading any observes the prefill
    too (``Observation.prefill``); the engine serves whatever is declared, so a new
    feature-reading drafter needs no engine change."""

    last_hidden: bool = False
    layers: tuple[int, ...] = ()

    @property
    def wanted(self) -> bool:
        """Does the drafter read any (and observe the prefill)?"""
        return self.last_hidden or bool(self.layers)

    def forward_kwargs(self) -> dict:
        """The target forward's keyword arguments: ``want_hidden``, plus ``hidden_layers`` only
        when layers are read (other backends need not know the argument)."""
        if self.layers:
            return {"want_hidden": False, "hidden_layers": self.layers}
        return {"want_hidden": self.last_hidden}

    @property
    def tag(self) -> tuple | None:
        """A hashable name of what is read (what a prefix cache may keep for it); None: nothing."""
        return tuple(sorted(self.forward_kwargs().items())) if self.wanted else None

    def select(self, out) -> torch.Tensor | None:
        """[B, N, *] what was read, from a forward's ``ModelOutput``: the layers' outputs, else
        the last hidden state."""
        return out.layers if self.layers else out.hidden


NO_FEATURES = Features()
LAST_HIDDEN = Features(last_hidden=True)


def features_of(drafter: Drafter) -> Features:
    """``drafter.features``, or TypeError naming a drafter that declares something else."""
    declared = drafter.features
    if not isinstance(declared, Features):
        raise TypeError(f"{type(drafter).__name__}.features must be a Features (NO_FEATURES: reads nothing), "
                        f"got {declared!r}")
    return declared


@runtime_checkable
class Drafter(Protocol):
    name: ClassVar[str]
    features: Features  # what it reads from the target's forwards besides logits (and so observes the prefill)

    def start(self, request_id: str, prompt_ids: list[int]) -> None: ...

    def propose(self, ctx: DraftContext) -> DraftTree: ...

    def propose_batch(self, ctxs: Sequence[DraftContext]) -> list[DraftTree]:
        """One tree per context, for the requests of one batched step; each the tree
        ``propose`` would give (a drafter with a model may run one forward for all of them)."""
        ...

    def observe(self, obs: Observation) -> None: ...

    def finish(self, request_id: str) -> None: ...

    def memory_bytes(self) -> int: ...

    def context_bytes(self, max_length: int, rows: int) -> int:
        """Bytes of the per-request state that grows with the context (a draft model's K/V) for
        ``rows`` requests of ``max_length`` tokens: what a server counts before it starts."""
        ...

    def reserve(self, max_length: int, rows: int) -> None:
        """Size that state to a server's context and allocate it now, before any request."""
        ...

    def reset(self) -> None:
        """Forget what was learned across requests (a benchmark's warm-up); most drafters learn nothing."""
        ...

    def cost_signature(self) -> str:
        """What the cost of its proposals depends on besides its options (its model's shape,
        where it runs): a measured cost curve of it is cached under this."""
        ...

    def drafted_by(self) -> dict[str, int]:
        """Verified steps by who drafted them, for a drafter that chooses among others (the
        hybrid: the statistics name them); empty for one that drafts alone."""
        ...


class DeclaresFeatures:
    """Base of the drafters: the ``Drafter`` declarations most of them make, reading no
    ``features`` (``NO_FEATURES``), keeping no state sized by the
    context (``context_bytes`` 0), learning nothing across requests (``reset`` is a no-op) and
    proposing for a batch request by request (``propose_batch``)."""

    features: Features = NO_FEATURES

    def context_bytes(self, max_length: int, rows: int) -> int:
        return 0  # no state sized by the context

    def reserve(self, max_length: int, rows: int) -> None:
        pass

    def reset(self) -> None:
        pass

    def cost_signature(self) -> str:
        return type(self).__name__

    def drafted_by(self) -> dict[str, int]:
        return {}  # drafts alone

    def propose_batch(self, ctxs: Sequence[DraftContext]) -> list[DraftTree]:
        return [self.propose(c) for c in ctxs]  # type: ignore[attr-defined]


class WrappingDrafter(DeclaresFeatures):
    """Base of a drafter that wraps another (``inner``: a drafter, or for a drafter that talks
    to its draft model through text the draft model's own drafter): what the wrapper holds and
    learns is ``inner``'s (memory, context-sized state, ``reset``, its cost signature)."""

    inner: Drafter

    def memory_bytes(self) -> int:
        return self.inner.memory_bytes()

    def context_bytes(self, max_length: int, rows: int) -> int:
        return self.inner.context_bytes(max_length, rows)

    def reserve(self, max_length: int, rows: int) -> None:
        self.inner.reserve(max_length, rows)

    def reset(self) -> None:
        self.inner.reset()

    def cost_signature(self) -> str:
        return self.inner.cost_signature()

    def drafted_by(self) -> dict[str, int]:
        return self.inner.drafted_by()


@runtime_checkable
class Speculates(Protocol):
    """A retrieval drafter whose draft carries its own node values and the length of the
    context match it continues (SuffixDecoding): ``speculate(ctx)`` gives them with the tree
    (``.to_tree(root)``, ``.probs``, ``.match_length``)."""

    def speculate(self, ctx: DraftContext) -> Any: ...


@runtime_checkable
class CountsPrefill(Protocol):
    """A drafter whose ``start`` runs a model over the prompt: ``prefill_tokens(prompt)`` says
    how many tokens that costs now (its prefix cache counted), so a caller can rent the start."""

    def prefill_tokens(self, prompt_ids: list[int]) -> int: ...


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

    def find(self, request_id: str) -> S | None:
        """A request's state, or None when it has none (for drafters that keep state only for some requests)."""
        return self._states.get(request_id)

    def pop(self, request_id: str) -> S | None:
        """Forget a request; finishing an unknown one is a no-op."""
        return self._states.pop(request_id, None)

    def values(self):
        return self._states.values()


class StatelessDrafter(DeclaresFeatures):
    """Base for drafters with nothing to set up or learn (they read ``ctx.tokens``)."""

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
