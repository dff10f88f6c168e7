"""A small, resumable training loop shared by the drafter trainers.

Determinism: every random choice of step ``s`` (batch, noise) comes from a generator
seeded with ``(seed, s)``, so a run resumed from a checkpoint at step ``s`` takes exactly
the steps an uninterrupted run would (same model, optimizer state and batches), and the
final weights are identical on the same machine and thread count.

Checkpoints (``checkpoint.pt`` in the output directory, written atomically every
``ckpt_every`` steps and at the end) hold the model and optimizer state, the step and the
loss history.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

LossFn = Callable[[nn.Module, torch.Generator], tuple[torch.Tensor, dict[str, float]]]


@dataclass(frozen=True)
class TrainConfig:
    steps: int
    lr: float = 1e-3
    warmup: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    ckpt_every: int = 50

    def __post_init__(self) -> None:
        if self.steps < 1 or self.lr <= 0 or self.ckpt_every < 1:
            raise ValueError("steps and ckpt_every must be >= 1 and lr > 0")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio * lr``.

    >>> c = TrainConfig(steps=100, lr=1.0, warmup=10)
    >>> lr_at(0, c), lr_at(9, c), round(lr_at(99, c), 3)
    (0.1, 1.0, 0.1)
    """
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, cfg.steps - 1 - cfg.warmup)
    frac = min(1.0, (step - cfg.warmup) / span)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def step_generator(seed: int, step: int) -> torch.Generator:
    """The generator for step ``step``: a function of (seed, step) only."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


@dataclass(frozen=True)
class TrainResult:
    steps: int  # steps done so far (== cfg.steps unless stopped early)
    losses: list[float]  # one per step, from step 0
    metrics: dict[str, float]  # last step's metrics


def _save(path: Path, model: nn.Module, opt: torch.optim.Optimizer, step: int, losses: list[float],
          cfg: TrainConfig) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "losses": losses,
                "config": asdict(cfg)}, tmp)
    os.replace(tmp, path)


def train(model: nn.Module, loss_fn: LossFn, cfg: TrainConfig, out_dir: str | Path, resume: bool = False,
          progress: bool = True, stop_at: int | None = None, deadline: float | None = None) -> TrainResult:
    """Optimise ``model`` with AdamW for ``cfg.steps`` steps, checkpointing to ``out_dir``.

    ``resume=True`` continues from ``out_dir/checkpoint.pt`` when it exists (and refuses a
    checkpoint written with a different config). ``stop_at`` ends the run early after that
    step with a checkpoint (a time-boxed slice of a longer schedule; resume later);
    ``deadline`` (a ``time.time()`` value) does the same once that time has passed."""
    import time

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "checkpoint.pt"
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    start, losses = 0, []
    if resume and ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        if state["config"] != asdict(cfg):
            raise ValueError(f"{ckpt} was written with {state['config']}, not {asdict(cfg)}")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start, losses = state["step"], list(state["losses"])
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=start, desc="train", dynamic_ncols=True)
    metrics: dict[str, float] = {}
    model.train()
    end = cfg.steps if stop_at is None else min(cfg.steps, stop_at)
    for step in range(start, end):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss, metrics = loss_fn(model, step_generator(cfg.seed, step))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.4f}", **{k: f"{v:.3f}" for k, v in metrics.items()})
        late = deadline is not None and time.time() > deadline
        if (step + 1) % cfg.ckpt_every == 0 or step + 1 == end or late:
            _save(ckpt, model, opt, step + 1, losses, cfg)
        if late:
            break
    if bar is not None:
        bar.close()
    model.eval()
    return TrainResult(steps=len(losses), losses=losses, metrics=metrics)
