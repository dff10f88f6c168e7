"""Medusa heads (Cai et al. 2024, arXiv 2401.10774): K residual heads on the target's last
hidden state, each reusing the target's (tied) LM head, guess the tokens 2..K+1 positions
ahead; their top-k guesses are combined into a sparse candidate tree given as Medusa's
list of paths (each path = one rank per head), verified in one target forward.

Head k (1-based): ``h_k = f + SiLU(W_k f + b_k)``, ``logits_k = lm_head(h_k)``, where ``f``
is the post-norm hidden state of the newest *verified* position. In verispec's engine that
position is the last accepted node of the previous step, whose next token (the bonus) is
this step's root; so head k proposes depth k of the tree.

Lossless sampling: the tree is a deterministic function of the committed context, so it
is proposed with point-mass semantics (``draft_probs=None``) and verified by recursive
rejection; Medusa's "typical acceptance" (which changes the distribution) is not offered.

Tree shapes: ``tree="sparse"`` (default) is Medusa's greedy sparse tree of ``budget`` nodes;
``tree="sequoia"`` is Sequoia's DP-optimal tree (policies/tree_shape.py) over the same
rank accuracies, sized by the measured verification cost curve ``cost`` when given.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..tree import DraftTree
from .base import LAST_HIDDEN, DeclaresFeatures, DraftContext, Features, Observation, RequestTable
from .options import option


@dataclass(frozen=True)
class MedusaConfig:
    hidden_size: int
    num_heads: int  # K
    vocab_size: int
    draft_vocab_size: int
    target: str = ""


class MedusaHeads(nn.Module):
    """K residual blocks; ``draft_vocab`` [Vd] token ids of the reduced LM head rows."""

    def __init__(self, cfg: MedusaConfig):
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(nn.Linear(cfg.hidden_size, cfg.hidden_size) for _ in range(cfg.num_heads))
        for b in self.blocks:  # zero init: every head starts as the target's own head
            nn.init.zeros_(b.weight)
            nn.init.zeros_(b.bias)
        self.register_buffer("draft_vocab", torch.arange(cfg.draft_vocab_size), persistent=True)
        # measured top-k accuracy per head ([K, R]) for the tree; set after training
        self.register_buffer("rank_acc", torch.zeros(cfg.num_heads, 10), persistent=True)

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        """[..., H] features -> [K, ..., H] head features (apply the LM head rows after)."""
        return torch.stack([f + F.silu(b(f)) for b in self.blocks])

    def save(self, out_dir: str | Path, extra_config: dict | None = None) -> None:
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()},
                  str(out / "model.safetensors"))
        cfg = {"architecture": "medusa", **asdict(self.cfg), **(extra_config or {})}
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    @staticmethod
    def load(path: str | Path) -> "MedusaHeads":
        from safetensors.torch import load_file

        path = Path(path)
        if not (path / "config.json").exists() or not (path / "model.safetensors").exists():
            raise ValueError(f"{path} has no config.json + model.safetensors (Medusa weights)")
        raw = json.loads((path / "config.json").read_text())
        if raw.get("architecture") != "medusa":
            raise ValueError(f"{path} does not hold Medusa weights (architecture={raw.get('architecture')!r})")
        fields = MedusaConfig.__dataclass_fields__
        heads = MedusaHeads(MedusaConfig(**{k: v for k, v in raw.items() if k in fields}))
        heads.load_state_dict(load_file(str(path / "model.safetensors")))
        return heads.eval()


def sparse_tree_paths(rank_acc: list[list[float]], budget: int) -> list[tuple[int, ...]]:
    """Medusa's sparse tree: the ``budget`` rank-paths with the highest estimated
    acceptance probability ``prod_j rank_acc[j][i_j]`` (heads assumed independent),
    grown greedily from the root, so the set is prefix-closed. Paths come out in order of
    decreasing value (parents before children).

    >>> sparse_tree_paths([[0.6, 0.2], [0.5, 0.1]], 3)
    [(0,), (0, 0), (1,)]
    """
    chosen: list[tuple[int, ...]] = []
    frontier = {(i,): rank_acc[0][i] for i in range(len(rank_acc[0]))}
    while frontier and len(chosen) < budget:
        path = max(frontier, key=lambda p: (frontier[p], [-i for i in p]))
        value = frontier.pop(path)
        chosen.append(path)
        d = len(path)
        if d < len(rank_acc):
            for i in range(len(rank_acc[d])):
                frontier[path + (i,)] = value * rank_acc[d][i]
    return chosen


@dataclass
class _MedusaState:
    feature: torch.Tensor | None = None  # [H] newest verified feature (set by the prefill observation)


TREES = ("sparse", "sequoia")


@dataclass(frozen=True)
class MedusaOptions:
    """Medusa heads on the target's last hidden state, sparse tree from measured head accuracy (Cai et al. 2024)."""

    tree: Literal["sparse", "sequoia"] = option("sparse", "the tree: sparse (from head accuracy) or sequoia (sized by the cost curve)")
    weights: str | None = option(None, "a directory of trained heads (default: the shipped ones)")


class MedusaDrafter(DeclaresFeatures):
    """Tree drafts from Medusa heads (``tree``: sparse or sequoia); at most ``budget`` nodes
    per step from the engine."""

    name: ClassVar[str] = "medusa"
    features: ClassVar[Features] = LAST_HIDDEN  # the target's last hidden state

    def __init__(self, heads: MedusaHeads, embed: torch.Tensor, rank_acc: list[list[float]] | None = None,
                 tree: str = MedusaOptions.tree, cost: dict[int, float] | None = None):
        cfg = heads.cfg
        if tuple(embed.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(f"target embedding has shape {tuple(embed.shape)}; the Medusa heads expect "
                             f"({cfg.vocab_size}, {cfg.hidden_size})")
        if tree not in TREES:
            raise ValueError(f"unknown Medusa tree {tree!r}; use one of {', '.join(TREES)}")
        self.heads = heads.eval().float()
        self.lm_rows = embed.float()[heads.draft_vocab]  # [Vd, H]
        acc = rank_acc if rank_acc is not None else heads.rank_acc.tolist()
        if not any(any(row) for row in acc):
            acc = [[0.5 ** (i + 1) / (k + 1) for i in range(len(acc[0]))] for k in range(cfg.num_heads)]
        self.rank_acc = acc
        self.tree, self.cost = tree, cost
        self._paths: dict[int, list[tuple[int, ...]]] = {}  # budget -> tree spec (memoised)
        self._states: RequestTable[_MedusaState] = RequestTable()

    def start(self, request_id: str, prompt_ids: list[int]) -> None:
        self._states.add(request_id, _MedusaState())

    def finish(self, request_id: str) -> None:
        self._states.pop(request_id)

    def observe(self, obs: Observation) -> None:
        if obs.hidden is None:
            raise ValueError("the Medusa drafter needs target hidden states (features)")
        node = obs.path[-1] if obs.path else 0
        self._states.get(obs.request_id).feature = obs.hidden[node].float()

    def memory_bytes(self) -> int:
        """The heads and their copy of the draft vocabulary's LM-head rows (fp32)."""
        tensors = [*self.heads.parameters(), *self.heads.buffers(), self.lm_rows]
        return sum(t.numel() * t.element_size() for t in tensors)

    def paths(self, budget: int) -> list[tuple[int, ...]]:
        """The tree spec (rank paths, parents first) for at most ``budget`` nodes."""
        if budget not in self._paths:
            if self.tree == "sparse":
                self._paths[budget] = sparse_tree_paths(self.rank_acc, budget)
            else:
                self._paths[budget] = self._sequoia_paths(budget)
        return self._paths[budget]

    def _sequoia_paths(self, budget: int) -> list[tuple[int, ...]]:
        """Sequoia's tree over sibling positions, position j at depth d being head d's rank
        with the j-th highest measured accuracy (so the positional acceptances are
        non-increasing and no rank is skipped for a worse one)."""
        from ..policies.tree_shape import conditional_from_marginal, optimal_tree, sequoia_tree

        order = [sorted(range(len(row)), key=lambda i: (-row[i], i)) for row in self.rank_acc]
        p = [conditional_from_marginal([row[i] for i in o]) for row, o in zip(self.rank_acc, order)]
        shape = optimal_tree(p, budget) if self.cost is None else sequoia_tree(p, self.cost, budget)
        return [tuple(order[d][j] for d, j in enumerate(path)) for path in shape.paths]

    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> DraftTree:
        f = self._states.get(ctx.request_id).feature
        root = ctx.tokens[-1]
        spec = self.paths(ctx.budget) if f is not None else []
        if not spec:
            return DraftTree.chain(root, [])
        ranks = max(max(p) for p in spec) + 1
        logits = self.heads(f) @ self.lm_rows.T  # [K, Vd]
        top = self.heads.draft_vocab[logits.topk(ranks, -1).indices].tolist()  # [K, ranks]
        paths = [[top[d][i] for d, i in enumerate(p)] for p in spec]
        return DraftTree.from_paths(root, paths)  # distinct ranks: no sibling duplicates
