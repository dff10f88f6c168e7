"""Training the EAGLE head on teacher-forced target features (Li et al. 2024, Sec. 4.2).

Inputs at position i of a sequence: ``(f_i, e(x_{i+1}))`` at position ``i + 1``; targets:
the next feature ``f_{i+1}`` (smooth-L1, weight 1) and the target's greedy token after it,
``a_{i+1}`` (cross-entropy through the tied LM head restricted to the draft vocabulary,
weight ``ce_weight``; the paper uses 0.1). Input features get uniform noise (EAGLE's
data augmentation against the feature drift of multi-step drafting).

Response weighting: in chat data most prompt tokens are the fixed template and system
prompt, which the head learns quickly and which never get drafted. Positions whose
predicted token lies before the end of the last assistant header (``response_header``,
derived from the target's chat template) get weight ``prompt_weight`` in the feature loss
and in the choice of the CE positions; response positions get weight 1.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..drafters.eagle import EagleConfig, EagleHead
from .features import FeatureSet, random_window
from .loop import TrainConfig, TrainResult, train


@dataclass(frozen=True)
class EagleTrainOptions:
    seqs_per_step: int = 4
    max_len: int = 320  # a random window of each sequence
    ce_positions: int = 96  # positions per sequence that get the (costly) vocab CE
    ce_weight: float = 0.3  # the paper's 0.1 left held-out response top-1 at 13% here
    noise: float = 0.2  # uniform noise amplitude, times the features' RMS
    draft_vocab_size: int = 16384
    prompt_weight: float = 0.1  # weight of prompt positions (response positions: 1)


def response_start(tokens: torch.Tensor, header: list[int] | None) -> int:
    """Index of the first response token: just after the last ``header`` occurrence
    (0 when there is no header, i.e. every position counts as response).

    >>> response_start(torch.tensor([1, 7, 8, 5, 7, 8, 9, 9]), [7, 8])
    6
    >>> response_start(torch.tensor([1, 2, 3]), [7, 8]), response_start(torch.tensor([1, 2]), None)
    (0, 0)
    """
    if not header or len(tokens) < len(header):
        return 0
    h = torch.tensor(header)
    hits = (tokens.unfold(0, len(h), 1) == h).all(-1).nonzero()
    return int(hits[-1]) + len(h) if len(hits) else 0


def chat_response_header(tokenizer) -> list[int] | None:
    """Token ids the chat template puts before an assistant answer (None: no template)."""
    try:
        msg = [{"role": "user", "content": "x"}]
        with_gen = tokenizer.apply_chat_template(msg, add_generation_prompt=True, tokenize=True)
        without = tokenizer.apply_chat_template(msg, add_generation_prompt=False, tokenize=True)
    except Exception:  # noqa: BLE001 - tokenizers without a chat template raise various errors
        return None
    with_gen, without = (list(x["input_ids"] if hasattr(x, "keys") else x) for x in (with_gen, without))
    return with_gen[len(without):] or None if with_gen[:len(without)] == without else None


def choose_draft_vocab(data: FeatureSet, size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` most frequent greedy targets and inputs (ties: lower id), sorted.

    >>> d = FeatureSet([torch.tensor([5, 5, 3])], [torch.zeros(3, 2)], [torch.tensor([5, 3, 9])])
    >>> choose_draft_vocab(d, 2, 10).tolist()
    [3, 5]
    """
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for t, a in zip(data.tokens, data.argmax):
        counts += torch.bincount(torch.cat([t, a]), minlength=vocab_size).double()
    order = torch.argsort(-counts - torch.arange(vocab_size) * 1e-9, stable=True)  # ties -> low id
    return order[:min(size, vocab_size)].sort().values


def init_head(cfg: EagleConfig, target_state: dict[str, torch.Tensor], draft_vocab: torch.Tensor,
              seed: int = 0) -> EagleHead:
    """Head initialised from the target's last decoder layer and final norm, fc = [I | I]
    (so at step 0 the layer reads f_t + e_{t+1})."""
    torch.manual_seed(seed)
    head = EagleHead(cfg)
    layers = sorted({int(k.split(".")[2]) for k in target_state if k.startswith("model.layers.")})
    pre = f"model.layers.{layers[-1]}."
    with torch.no_grad():
        for ours, theirs in [("q_proj", "self_attn.q_proj"), ("k_proj", "self_attn.k_proj"),
                             ("v_proj", "self_attn.v_proj"), ("o_proj", "self_attn.o_proj"),
                             ("gate_proj", "mlp.gate_proj"), ("up_proj", "mlp.up_proj"),
                             ("down_proj", "mlp.down_proj")]:
            getattr(head, ours).weight.copy_(target_state[pre + theirs + ".weight"])
        head.input_norm.copy_(target_state[pre + "input_layernorm.weight"])
        head.post_norm.copy_(target_state[pre + "post_attention_layernorm.weight"])
        head.final_norm.copy_(target_state["model.norm.weight"])
        h = cfg.hidden_size
        head.fc.weight.copy_(torch.cat([torch.eye(h), torch.eye(h)], 1))
        head.fc.bias.zero_()
        head.draft_vocab.copy_(draft_vocab)
    return head


def eagle_loss(head: EagleHead, embed: torch.Tensor, data: FeatureSet, opts: EagleTrainOptions,
               gen: torch.Generator, vocab_index: torch.Tensor, starts: list[int] | None = None
               ) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss over ``opts.seqs_per_step`` random sequences (windows), one at a time.

    ``vocab_index`` [V]: position of each token in the draft vocabulary, -1 if absent;
    ``starts``: each sequence's response start (``response_start``; None = all 0)."""
    rms = 1.0
    lm_rows = embed[head.draft_vocab]  # [Vd, H]
    total, feat_l, ce_l, acc, n_acc = 0.0, 0.0, 0.0, 0, 0
    picks = torch.randint(0, len(data.tokens), (opts.seqs_per_step,), generator=gen).tolist()
    for s in picks:
        a, b = random_window(len(data.tokens[s]), opts.max_len, gen)
        if b - a < 3:
            continue
        f = data.feats[s][a:b].float()  # [L, H]
        x, am = data.tokens[s][a:b], data.argmax[s][a:b]  # [L]
        rms = float(f.pow(2).mean().sqrt())
        inp = f[:-1] + (torch.rand(f[:-1].shape, generator=gen) - 0.5) * 2 * opts.noise * rms
        pos = torch.arange(a + 1, b)[None]
        pred, _ = head(inp[None], embed[x[1:]][None], pos)
        pred = pred[0]  # [L-1, H] ~ f[1:]
        # pred[j] drafts the token at absolute position a + j + 2
        resp = torch.arange(a + 2, b + 1) >= (starts[s] if starts else 0)
        w = torch.where(resp, 1.0, opts.prompt_weight)  # [L-1]
        lf = (F.smooth_l1_loss(pred, f[1:], reduction="none").mean(-1) * w).sum() / w.sum()
        labels = vocab_index[am[1:]]  # [L-1]
        k = min(opts.ce_positions, len(labels))
        sel = torch.multinomial(w.clamp_min(1e-6), k, replacement=False, generator=gen)
        logits = pred[sel] @ lm_rows.T  # [k, Vd]
        valid = labels[sel] >= 0
        lc = F.cross_entropy(logits[valid], labels[sel][valid]) if valid.any() else pred.sum() * 0
        total = total + lf + opts.ce_weight * lc
        feat_l += float(lf.detach())
        ce_l += float(lc.detach())
        acc += int((logits.argmax(-1)[valid] == labels[sel][valid]).sum())
        n_acc += int(valid.sum())
    n = max(1, len(picks))
    return total / n, {"feat": feat_l / n, "ce": ce_l / n, "top1": acc / max(1, n_acc)}


@torch.inference_mode()
def validate(head: EagleHead, embed: torch.Tensor, data: FeatureSet, max_seqs: int = 64,
             starts: list[int] | None = None) -> dict[str, float]:
    """Teacher-forced top-1 agreement with the target's greedy token (full-vocab argmax
    over the draft rows), the same on response positions only (``starts``), and when
    the head's own predicted feature is fed back for one extra step (depth-2 agreement,
    closer to what drafting sees)."""
    head.eval()
    lm_rows = embed[head.draft_vocab]
    hit1 = hit2 = n1 = n2 = hit_r = n_r = 0
    for s in range(min(max_seqs, len(data.tokens))):
        f, x, am = data.feats[s].float(), data.tokens[s], data.argmax[s]
        if len(x) < 4:
            continue
        pos = torch.arange(1, len(x))[None]
        pred = head(f[:-1][None], embed[x[1:]][None], pos)[0][0]  # [L-1, H]
        tok1 = head.draft_vocab[(pred @ lm_rows.T).argmax(-1)]  # guesses for a[1:]
        hit1 += int((tok1 == am[1:]).sum())
        n1 += len(tok1)
        resp = torch.arange(2, len(x) + 1) >= (starts[s] if starts else 0)  # drafted position
        hit_r += int((tok1 == am[1:])[resp].sum())
        n_r += int(resp.sum())
        # depth 2: input (pred_{i+1}, x_{i+2}) instead of (f_{i+1}, x_{i+2}); causal context uses
        # predicted features everywhere (a pessimistic approximation of drafting)
        pred2 = head(pred[:-1][None], embed[x[2:]][None], pos[:, 1:])[0][0]
        tok2 = head.draft_vocab[(pred2 @ lm_rows.T).argmax(-1)]
        hit2 += int((tok2 == am[2:]).sum())
        n2 += len(tok2)
    return {"top1": hit1 / max(1, n1), "response_top1": hit_r / max(1, n_r), "depth2_top1": hit2 / max(1, n2)}


def train_eagle(target_dir: str | Path, feature_dirs: list[str | Path], out_dir: str | Path, cfg: TrainConfig,
                opts: EagleTrainOptions = EagleTrainOptions(), resume: bool = False, target_name: str = "",
                progress: bool = True, stop_at: int | None = None,
                deadline: float | None = None) -> tuple[EagleHead, TrainResult, dict[str, float]]:
    """Train and export ``out_dir/weights`` (safetensors + config.json); returns the head,
    the loss history and validation metrics."""
    from transformers import AutoTokenizer

    from . import features

    tcfg, state = features.read_target(target_dir)
    embed = state["model.embed_tokens.weight"].float()  # [V, H] (tied LM head)
    train_set, val_set = features.load_split(feature_dirs)
    header = chat_response_header(AutoTokenizer.from_pretrained(str(target_dir)))
    train_starts, val_starts = ([response_start(t, header) for t in d.tokens] for d in (train_set, val_set))
    vocab = choose_draft_vocab(train_set, opts.draft_vocab_size, tcfg["vocab_size"])
    ecfg = EagleConfig.from_target_config(tcfg, draft_vocab_size=len(vocab), target=target_name)
    head = init_head(ecfg, state, vocab, seed=cfg.seed)
    vocab_index = torch.full((tcfg["vocab_size"],), -1, dtype=torch.long)
    vocab_index[vocab] = torch.arange(len(vocab))

    def loss_fn(model, gen):
        return eagle_loss(model, embed, train_set, opts, gen, vocab_index, train_starts)

    result = train(head, loss_fn, cfg, out_dir, resume=resume, progress=progress, stop_at=stop_at, deadline=deadline)
    metrics = validate(head, embed, val_set, starts=val_starts)
    head.save(Path(out_dir) / "weights", {
        "train": {**asdict(cfg), **asdict(opts), "train_tokens": train_set.num_tokens,
                  "train_sequences": len(train_set.tokens), "final_loss": result.losses[-1],
                  "validation": metrics},
    })
    return head, result, metrics
