"""Per-request state, kept apart from the model call so a scheduler can step many
requests in one batched target forward."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..models.base import KVCache
from ..policies.draft_length import DraftLengthPolicy
from ..sampling import make_generator
from ..types import FinishReason, RequestStats, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from ..constraints import Matcher
    from ..constraints.speculation import JumpForward


@dataclass
class Request:
    """Invariant after prefill and after every step: ``cache.length == len(tokens) - 1``
    (the newest committed token is the root of the next draft and not cached yet)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    cache: KVCache
    policy: DraftLengthPolicy
    tokens: list[int] = field(default_factory=list)  # committed: prompt + generated
    finished: FinishReason | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    draft_limit: int | None = None  # per-request cap on drafted nodes (0 = no speculation)
    prediction: tuple[int, ...] = ()  # the predicted output (Predicted Outputs): drafts, never output
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per generated token, if asked
    prefill_logits: torch.Tensor | None = None  # [1, V] raw target logits after the prompt (for forks)
    # the observed target features of the tokens in the cache, in order, kept for the prefix
    # cache when the drafter reads features (None: not kept)
    hidden_rows: list[torch.Tensor] | None = None
    grammar: Matcher | None = None  # the constraint's state over the committed tokens (params.constraint)
    jump_forward: JumpForward | None = None  # sizes its forced-token drafts by the cost curve (Engine.cost)
    verify_generator: torch.Generator = field(init=False)
    draft_generator: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt_ids)
        self.stats.prompt_tokens = len(self.prompt_ids)
        self.verify_generator = make_generator(self.params.seed, salt=0)
        self.draft_generator = make_generator(self.params.seed, salt=1)

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt_ids) :]

    @property
    def remaining(self) -> int:
        """New tokens still allowed by max_new_tokens."""
        return self.params.max_new_tokens - len(self.generated)
