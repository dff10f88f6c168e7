"""How many tokens to draft next step. One policy object per request (state is per request).

fixed      always ``k`` (Leviathan et al. 2023's gamma).
heuristic  transformers' assisted-generation schedule: +2 after a fully accepted draft,
           -1 (not below 1) otherwise.
Model drafters can additionally stop early on low confidence (see DraftModelDrafter)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PolicyName = Literal["fixed", "heuristic"]


@dataclass
class DraftLengthPolicy:
    k: int
    kind: PolicyName = "fixed"
    max_k: int = 32

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"draft length must be >= 1, got {self.k}")
        if self.kind not in ("fixed", "heuristic"):
            raise ValueError(f"unknown draft-length policy {self.kind!r}; use fixed or heuristic")

    def budget(self) -> int:
        return self.k

    def update(self, num_drafted: int, num_accepted: int) -> None:
        if self.kind == "heuristic" and num_drafted > 0:
            self.k = min(self.max_k, self.k + 2) if num_accepted == num_drafted else max(1, self.k - 1)
