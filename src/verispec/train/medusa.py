"""Training Medusa heads (Medusa-1: frozen target) on teacher-forced target features.

Head k at position t learns the target's greedy token ``a_{t+k}`` (= x_{t+k+1} on the
target's own greedy generations) by cross-entropy through the tied LM head restricted to
the draft vocabulary. After training, per-head rank accuracies on held-out sequences are
stored in the weights; they define the sparse tree (``sparse_tree_paths``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..drafters.medusa import MedusaConfig, MedusaHeads
from .eagle import choose_draft_vocab
from .features import FeatureSet
from .loop import TrainConfig, TrainResult, train


@dataclass(frozen=True)
class MedusaTrainOptions:
    num_heads: int = 4
    seqs_per_step: int = 8
    positions: int = 32  # positions per sequence per step
    draft_vocab_size: int = 8192  # covers 96.1% of held-out greedy tokens on SmolLM2 (16384: 96.6%)
    head_decay: float = 0.8  # loss weight of head k is head_decay ** (k - 1)


def sample_positions(data: FeatureSet, opts: MedusaTrainOptions, gen: torch.Generator
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """([P, H] features, [K, P] target ids ``a_{t+k}``) at random positions ``t`` of
    ``seqs_per_step`` random sequences (positions with all K labels only)."""
    k_heads = opts.num_heads
    feats, labels = [], []
    for s in torch.randint(0, len(data.tokens), (opts.seqs_per_step,), generator=gen).tolist():
        length = len(data.tokens[s])
        if length <= k_heads + 1:
            continue
        t = torch.randperm(length - k_heads, generator=gen)[:opts.positions]  # [P]
        feats.append(data.feats[s][t].float())
        labels.append(torch.stack([data.argmax[s][t + k] for k in range(1, k_heads + 1)]))
    if not feats:
        return torch.zeros(0, data.feats[0].shape[-1]), torch.zeros(k_heads, 0, dtype=torch.long)
    return torch.cat(feats), torch.cat(labels, dim=1)


def medusa_loss(heads: MedusaHeads, lm_rows: torch.Tensor, data: FeatureSet, opts: MedusaTrainOptions,
                gen: torch.Generator, vocab_index: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """Sum over heads of ``head_decay^(k-1)`` x the mean cross-entropy of head k against the
    target's greedy token ``a_{t+k}`` (labels outside the draft vocabulary are skipped);
    all heads and positions go through one [K*P, H] x [H, Vd] matmul."""
    f, target = sample_positions(data, opts, gen)
    labels = vocab_index[target]  # [K, P], -1 = outside the draft vocab
    k_heads, n = labels.shape
    if n == 0 or not (labels >= 0).any():
        return heads.blocks[0].bias.sum() * 0, {"head1_top1": 0.0}
    logits = (heads(f).reshape(k_heads * n, -1) @ lm_rows.T).view(k_heads, n, -1)  # [K, P, Vd]
    ce = F.cross_entropy(logits.flatten(0, 1), labels.clamp(min=0).flatten(), reduction="none").view(k_heads, n)
    ok = (labels >= 0).float()
    weight = opts.head_decay ** torch.arange(k_heads, dtype=torch.float32)
    loss = (weight * (ce * ok).sum(1) / ok.sum(1).clamp(min=1)).sum()
    hit = (logits[0].detach().argmax(-1) == labels[0]).float()
    return loss, {"head1_top1": float((hit * ok[0]).sum() / ok[0].sum().clamp(min=1))}


@torch.inference_mode()
def rank_accuracy(heads: MedusaHeads, lm_rows: torch.Tensor, data: FeatureSet, ranks: int = 10,
                  max_seqs: int = 64) -> torch.Tensor:
    """[K, ranks]: how often head k's rank-i guess is the target's token, on ``data``."""
    k_heads = heads.cfg.num_heads
    hits = torch.zeros(k_heads, ranks)
    total = torch.zeros(k_heads)
    for s in range(min(max_seqs, len(data.tokens))):
        f, am = data.feats[s].float(), data.argmax[s]
        hk = heads(f)  # [K, L, H]
        for k in range(k_heads):
            m = len(am) - k - 1
            if m <= 0:
                continue
            top = heads.draft_vocab[(hk[k, :m] @ lm_rows.T).topk(ranks, -1).indices]  # [m, ranks]
            hits[k] += (top == am[k + 1:k + 1 + m, None]).float().sum(0)
            total[k] += m
    return hits / total.clamp(min=1)[:, None]


def train_medusa(target_dir: str | Path, feature_dirs: list[str | Path], out_dir: str | Path, cfg: TrainConfig,
                 opts: MedusaTrainOptions = MedusaTrainOptions(), resume: bool = False, target_name: str = "",
                 progress: bool = True, stop_at: int | None = None,
                 deadline: float | None = None) -> tuple[MedusaHeads, TrainResult, dict[str, float]]:
    from . import features

    tcfg, state = features.read_target(target_dir)
    embed = state["model.embed_tokens.weight"].float()
    train_set, val_set = features.load_split(feature_dirs)
    vocab = choose_draft_vocab(train_set, opts.draft_vocab_size, tcfg["vocab_size"])
    heads = MedusaHeads(MedusaConfig(tcfg["hidden_size"], opts.num_heads, tcfg["vocab_size"], len(vocab),
                                     target_name))
    with torch.no_grad():
        heads.draft_vocab.copy_(vocab)
    lm_rows = embed[vocab]
    vocab_index = torch.full((tcfg["vocab_size"],), -1, dtype=torch.long)
    vocab_index[vocab] = torch.arange(len(vocab))
    result = train(heads, lambda m, g: medusa_loss(m, lm_rows, train_set, opts, g, vocab_index), cfg, out_dir,
                   resume=resume, progress=progress, stop_at=stop_at, deadline=deadline)
    acc = rank_accuracy(heads, lm_rows, val_set)
    with torch.no_grad():
        heads.rank_acc.copy_(acc)
    metrics = {f"head{k + 1}_top1": float(acc[k, 0]) for k in range(opts.num_heads)}
    metrics |= {f"head{k + 1}_top5": float(acc[k, :5].sum()) for k in range(opts.num_heads)}
    heads.save(Path(out_dir) / "weights", {
        "train": {**asdict(cfg), **asdict(opts), "train_tokens": train_set.num_tokens,
                  "train_sequences": len(train_set.tokens), "final_loss": result.losses[-1],
                  "validation": metrics},
    })
    return heads, result, metrics
