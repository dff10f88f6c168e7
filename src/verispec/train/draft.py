"""Distilling a small draft model from the target (Leviathan et al. 2023's draft, trained as
in DistillSpec, Zhou et al. 2024, arXiv 2310.08461: forward KL to the target's token
distribution on the target's own generations).

The draft is a plain Llama with a few decoder layers, initialised from chosen layers of
the target, and the target's (tied, frozen) embedding and final norm; only the layers and
the norm train. The loss compares distributions over a reduced vocabulary (the most
frequent tokens of the data, as FR-Spec, Zhao et al. 2025, arXiv 2502.14856), which keeps
the 49k-wide head from dominating the CPU time; the teacher's logits come from its stored
post-norm features (``features``), so the target never runs during training.

The exported weights hold the layers, the norm and the reduced vocabulary, not the
embedding (``verispec.models.draft_checkpoint``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .eagle import chat_response_header, choose_draft_vocab, response_start
from .features import FeatureSet, random_window
from ..models.draft_checkpoint import save_draft
from .loop import TrainConfig, TrainResult, train


@dataclass(frozen=True)
class DraftTrainOptions:
    init_layers: tuple[int, ...] = (0, 1, 2, 3)  # target layers the draft's layers start from
    init_weights: str | None = None  # or: continue from these draft weights (a second stage)
    seqs_per_step: int = 4
    max_len: int = 256  # a random window of each sequence
    draft_vocab_size: int = 16384
    prompt_weight: float = 0.1  # weight of prompt positions (response positions: 1)


def draft_config(target_cfg: dict, num_layers: int) -> dict:
    """The target's transformers config with ``num_layers`` decoder layers."""
    cfg = {k: v for k, v in target_cfg.items() if k not in ("transformers_version", "architectures")}
    return cfg | {"num_hidden_layers": num_layers, "architectures": ["LlamaForCausalLM"],
                  "tie_word_embeddings": True}


def init_draft(target_cfg: dict, target_state: dict[str, torch.Tensor], layers: tuple[int, ...]):
    """A ``LlamaForCausalLM`` whose layer i is a copy of target layer ``layers[i]``, with
    the target's embedding (frozen) and final norm."""
    from transformers import LlamaConfig, LlamaForCausalLM

    n = target_cfg["num_hidden_layers"]
    if not layers or any(not 0 <= i < n for i in layers):
        raise ValueError(f"init layers must be target layer indices in [0, {n}), got {list(layers)}")
    model = LlamaForCausalLM(LlamaConfig(**draft_config(target_cfg, len(layers))))
    state = {"model.embed_tokens.weight": target_state["model.embed_tokens.weight"],
             "model.norm.weight": target_state["model.norm.weight"]}
    for i, j in enumerate(layers):
        pre = f"model.layers.{j}."
        state |= {f"model.layers.{i}.{k[len(pre):]}": v for k, v in target_state.items() if k.startswith(pre)}
    missing, _ = model.load_state_dict(state, strict=False)
    if [k for k in missing if k != "lm_head.weight"]:
        raise ValueError(f"target checkpoint lacks draft weights: {missing[:3]}")
    model.model.embed_tokens.weight.requires_grad_(False)
    return model.float()


def load_draft_weights(model, weights_dir: str | Path) -> None:
    """Overwrite ``model``'s layers and norm with exported draft weights (same shape)."""
    from safetensors.torch import load_file

    state = {k: v.float() for k, v in load_file(str(Path(weights_dir) / "model.safetensors")).items()
             if k != "draft_vocab"}
    own = model.state_dict()
    bad = [k for k, v in state.items() if k not in own or own[k].shape != v.shape]
    if bad or len(state) + 2 != len(own):
        raise ValueError(f"{weights_dir} does not fit a {model.config.num_hidden_layers}-layer draft "
                         f"(mismatched: {bad[:3] or 'layer count'})")
    model.load_state_dict(state, strict=False)


def draft_hidden(model, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
    """[L, H] post-norm hidden states of the draft over ``tokens`` at positions start..."""
    pos = torch.arange(start, start + len(tokens))[None]
    return model.model(input_ids=tokens[None], position_ids=pos).last_hidden_state[0]


def distill_loss(model, lm_rows: torch.Tensor, data: FeatureSet, opts: DraftTrainOptions, gen: torch.Generator,
                 starts: list[int]) -> tuple[torch.Tensor, dict[str, float]]:
    """Forward KL(target || draft) over the reduced vocabulary ``lm_rows`` [Vd, H], on
    ``opts.seqs_per_step`` random windows; metric: top-1 agreement on response positions."""
    total, hits, n_resp = model.model.norm.weight.sum() * 0, 0, 0  # a graph even if no window is used
    picks = torch.randint(0, len(data.tokens), (opts.seqs_per_step,), generator=gen).tolist()
    for s in picks:
        a, b = random_window(len(data.tokens[s]), opts.max_len, gen)
        if b - a < 2:
            continue
        logits = draft_hidden(model, data.tokens[s][a:b], a) @ lm_rows.T  # [L, Vd]
        with torch.no_grad():
            teacher = (data.feats[s][a:b].float() @ lm_rows.T).log_softmax(-1)
        kl = F.kl_div(logits.log_softmax(-1), teacher, log_target=True, reduction="none").sum(-1)  # [L]
        resp = torch.arange(a + 1, b + 1) >= starts[s]  # the predicted token is in the response
        w = torch.where(resp, 1.0, opts.prompt_weight)
        total = total + (kl * w).sum() / w.sum()
        hits += int((logits.argmax(-1) == teacher.argmax(-1))[resp].sum())
        n_resp += int(resp.sum())
    return total / max(1, len(picks)), {"top1": hits / max(1, n_resp)}


@torch.inference_mode()
def validate_draft(model, embed: torch.Tensor, data: FeatureSet, starts: list[int], max_seqs: int = 64
                   ) -> dict[str, float]:
    """Teacher-forced agreement of the draft's full-vocabulary argmax with the target's
    greedy token, on all positions and on response positions."""
    model.eval()
    hit = n = hit_r = n_r = 0
    for s in range(min(max_seqs, len(data.tokens))):
        x, am = data.tokens[s], data.argmax[s]
        ok = (draft_hidden(model, x) @ embed.T).argmax(-1) == am  # [L]
        resp = torch.arange(1, len(x) + 1) >= starts[s]
        hit, n = hit + int(ok.sum()), n + len(ok)
        hit_r, n_r = hit_r + int(ok[resp].sum()), n_r + int(resp.sum())
    return {"top1": hit / max(1, n), "response_top1": hit_r / max(1, n_r)}


def train_draft(target_dir: str | Path, feature_dirs: list[str | Path], out_dir: str | Path, cfg: TrainConfig,
                opts: DraftTrainOptions = DraftTrainOptions(), resume: bool = False, target_name: str = "",
                progress: bool = True, stop_at: int | None = None,
                deadline: float | None = None) -> tuple[object, TrainResult, dict[str, float]]:
    """Distil and export ``out_dir/weights``; returns the draft, the loss history and
    validation metrics (held out: every 10th sequence)."""
    from transformers import AutoTokenizer

    from . import features

    tcfg, state = features.read_target(target_dir)
    embed = state["model.embed_tokens.weight"].float()
    train_set, val_set = features.load_split(feature_dirs)
    header = chat_response_header(AutoTokenizer.from_pretrained(str(target_dir)))
    train_starts, val_starts = ([response_start(t, header) for t in d.tokens] for d in (train_set, val_set))
    vocab = choose_draft_vocab(train_set, opts.draft_vocab_size, tcfg["vocab_size"])
    model = init_draft(tcfg, state, opts.init_layers)
    before = {}
    if opts.init_weights:
        load_draft_weights(model, opts.init_weights)
        before = validate_draft(model, embed, val_set, val_starts)  # the same held-out set, before training
    lm_rows = embed[vocab]

    def loss_fn(m, gen):
        return distill_loss(m, lm_rows, train_set, opts, gen, train_starts)

    result = train(model, loss_fn, cfg, out_dir, resume=resume, progress=progress, stop_at=stop_at, deadline=deadline)
    metrics = validate_draft(model, embed, val_set, val_starts) | {f"before_{k}": v for k, v in before.items()}
    save_draft(model, vocab, Path(out_dir) / "weights", {
        "kind": "draft", "target": target_name,
        "train": {**asdict(cfg), **asdict(opts), "train_tokens": train_set.num_tokens,
                  "train_sequences": len(train_set.tokens), "final_loss": result.losses[-1],
                  "validation": metrics},
    })
    return model, result, metrics
