"""Training an EAGLE-3 head with training-time test (Li et al. 2025, arXiv 2503.01840).

Data: the on-policy corpus of ``train/corpus.py`` (token ids only). Target features are
recomputed on the fly by the target's own inference backend (``Teacher``: the compiled
CPU runtime, so the head learns the exact features it reads when drafting): per step one
batched forward returns the outputs of the fused layers ([B, L, k*H]) and the logits.

Training-time test (TTT). Index j pairs the feature of token j with token j+1 at position
j+1, as in drafting (``EagleDrafter._catch_up``). Depth 1 reads the fused target feature
g_j; depth d >= 2 reads the head's own depth-(d-1) output at j-1, exactly what a chain
draft feeds itself. A depth-d query at j attends to the depth-1 keys of indices <= j-d+1
(the committed prefix, true features) and to the depth-i key at j-d+i for i = 2..d (its
own earlier drafts): EAGLE-3's diagonal TTT mask, computed here as a causal score matrix
plus d-1 diagonal score vectors. Every depth predicts the target's next-token distribution
at j+1 (soft labels restricted to the draft vocabulary, cross-entropy; depth d weighs
``decay**(d-1)``); answer positions weigh 1, prompt positions ``prompt_weight``.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ..drafters.eagle import Eagle3Head, EagleConfig, EagleHead
from .corpus import ROLE_ANSWER, Sequence, is_held_out, read_corpus
from .features import Teacher
from .loop import TrainConfig, train


@dataclass(frozen=True)
class Eagle3TrainOptions:
    hidden_layers: tuple[int, ...] = (2, 15, 29)  # low / middle / high (the last: warm start from EAGLE)
    seqs_per_step: int = 4
    max_len: int = 192  # a random window of each sequence
    depth: int = 4  # TTT unroll steps
    decay: float = 0.8  # loss weight of depth d: decay ** (d - 1)
    ce_positions: int = 48  # positions per sequence and depth that get the vocab CE
    prompt_weight: float = 0.1
    draft_vocab_size: int = 8192  # 95.6% of held-out answer tokens; half the LM-head cost of 16k


def ttt_unroll(head: EagleHead, feats: torch.Tensor, embeds: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """Outputs of ``depth`` TTT steps, each [B, J, H] (``step_out``, fed to the next step).

    feats [B, J, H]: head input features g_j; embeds [B, J, H]: e(x_{j+1}); positions j+1.
    Entries j < d-1 of depth d have no own prediction to read and are garbage (masked
    out of the loss by the caller)."""
    cfg = head.cfg
    b, j, _ = feats.shape
    pos = torch.arange(1, j + 1)[None].expand(b, j)
    rep = cfg.num_heads // cfg.num_kv_heads
    scale = cfg.head_dim ** -0.5
    ks, vs, outs = [], [], []
    inp = feats
    for d in range(1, depth + 1):
        x, q, k, v = head.project(inp, embeds, pos)  # q [B, h, J, D]; k, v [B, kvh, J, D]
        ks.append(k.repeat_interleave(rep, 1))
        vs.append(v.repeat_interleave(rep, 1))
        # depth-1 keys up to j-d+1 (true features), then the diagonal chain of own drafts
        causal = torch.ones(j, j, dtype=torch.bool).tril(-(d - 1))  # [J, J]
        s1 = (q @ ks[0].transpose(-1, -2)) * scale  # [B, h, J, J]
        s1 = s1.masked_fill(~causal, float("-inf"))
        diag = [(q * _shift(ks[i], d - 1 - i)).sum(-1, keepdim=True) * scale for i in range(1, d)]  # [B, h, J, 1]
        p = torch.cat([s1, *diag], -1).softmax(-1)
        p = torch.nan_to_num(p)  # rows j < d-1 see no key: garbage, never in the loss
        att = p[..., :j] @ vs[0]
        for i in range(1, d):
            att = att + p[..., j + i - 1:j + i] * _shift(vs[i], d - 1 - i)
        out = head.step_out(head.finish(x, att))  # [B, J, H]
        outs.append(out)
        inp = _shift(out, 1)  # depth d+1 at j reads depth d's output at j-1
    return outs


def _shift(t: torch.Tensor, s: int) -> torch.Tensor:
    """t[..., j, :] -> t[..., j - s, :] along dim -2 (zeros for j < s)."""
    if s == 0:
        return t
    pad = torch.zeros_like(t[..., :s, :])
    return torch.cat([pad, t[..., :-s, :]], -2)


@dataclass
class Batch:
    feats: torch.Tensor  # [B, J, H] head input features (fused target layers)
    embeds: torch.Tensor  # [B, J, H] e(x_{j+1})
    target_logits: torch.Tensor  # [B, J, V] the target's logits at j+1
    weight: torch.Tensor  # [B, J] per-position weight (0 = padding)
    answer: torch.Tensor  # [B, J] bool: the predicted token is an answer token


def make_batch(head: EagleHead, teacher: Teacher, embed: torch.Tensor, seqs: list[Sequence], picks: list[int],
               opts: Eagle3TrainOptions, gen: torch.Generator) -> Batch:
    """Random windows of the picked sequences, run through the target."""
    wins, roles = [], []
    for s in picks:
        n = len(seqs[s].tokens)
        a = int(torch.randint(0, max(1, n - opts.max_len + 1), (1,), generator=gen))
        wins.append(seqs[s].tokens[a:a + opts.max_len])
        roles.append(seqs[s].roles[a:a + opts.max_len])
    hidden, logits = teacher(wins)  # [B, L, *], [B, L, V]
    b, n = logits.shape[:2]
    ids = torch.zeros(b, n, dtype=torch.long)
    weight = torch.zeros(b, n - 1)
    answer = torch.zeros(b, n - 1, dtype=torch.bool)
    for r, (w, ro) in enumerate(zip(wins, roles)):
        ids[r, :len(w)] = torch.from_numpy(w)
        # index j predicts the token at j+2 (target logits at j+1): it must exist in the window
        ans = torch.from_numpy(ro[2:] == ROLE_ANSWER)
        answer[r, :len(ans)] = ans
        weight[r, :len(ans)] = torch.where(ans, 1.0, opts.prompt_weight)
    return Batch(head.features(hidden[:, :-1].float()), embed[ids[:, 1:]], logits[:, 1:], weight, answer)


def ttt_loss(head: EagleHead, batch: Batch, lm_rows: torch.Tensor, draft_vocab: torch.Tensor,
             opts: Eagle3TrainOptions, gen: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
    """Soft-label CE of every TTT depth at ``ce_positions`` weighted-sampled positions per row."""
    outs = ttt_unroll(head, batch.feats, batch.embeds, opts.depth)
    b, j = batch.weight.shape
    total, metrics = 0.0, {}
    for d, out in enumerate(outs, 1):
        w = batch.weight.clone()
        w[:, :d - 1] = 0  # no own prediction to read yet
        loss_d, hit, cnt = 0.0, 0, 0
        for r in range(b):
            if w[r].sum() <= 0:
                continue
            k = min(opts.ce_positions, int((w[r] > 0).sum()))
            sel = torch.multinomial(w[r], k, replacement=False, generator=gen)
            logits = head.readout(out[r, sel]) @ lm_rows.T  # [k, Vd]
            target = batch.target_logits[r, sel][:, draft_vocab].softmax(-1)  # [k, Vd] soft labels
            loss_d = loss_d + -(target * logits.log_softmax(-1)).sum(-1).mean()
            hit += int((logits.argmax(-1) == target.argmax(-1)).sum())
            cnt += k
        total = total + opts.decay ** (d - 1) * loss_d / b
        metrics[f"top1_d{d}"] = hit / max(1, cnt)
    return total, metrics


@torch.inference_mode()
def evaluate(head: EagleHead, teacher: Teacher, embed: torch.Tensor, seqs: list[Sequence], depth: int = 4,
             max_len: int = 256) -> dict[str, float]:
    """Held-out top-1 by TTT depth: agreement of the head's d-th chained draft with the
    target's greedy token at answer positions (full-vocabulary argmax of the target;
    the draft's argmax over its draft vocabulary), given the true earlier tokens."""
    head.eval()
    lm_rows = embed[head.draft_vocab]
    hits, counts = [0] * depth, [0] * depth
    opts = Eagle3TrainOptions(max_len=max_len, hidden_layers=tuple(head.cfg.hidden_layers) or (0,))
    rows = len(teacher.caches)
    for i in range(0, len(seqs), rows):
        chunk = [Sequence(s.id, s.tokens[:max_len], s.roles[:max_len], s.temperature) for s in seqs[i:i + rows]]
        batch = make_batch(head, teacher, embed, chunk, list(range(len(chunk))), opts, torch.Generator().manual_seed(0))
        truth = batch.target_logits.argmax(-1)  # [B, J]
        for d, out in enumerate(ttt_unroll(head, batch.feats, batch.embeds, depth), 1):
            guess = head.draft_vocab[(head.readout(out) @ lm_rows.T).argmax(-1)]  # [B, J]
            ok = batch.answer.clone()
            ok[:, :d - 1] = False
            hits[d - 1] += int((guess == truth)[ok].sum())
            counts[d - 1] += int(ok.sum())
    return {f"top1_d{d}": round(hits[d - 1] / max(1, counts[d - 1]), 4) for d in range(1, depth + 1)} | {
        "positions": counts[0]}


def init_eagle3(tcfg: dict, target_state: dict[str, torch.Tensor], draft_vocab: torch.Tensor,
                opts: Eagle3TrainOptions, warm: EagleHead | None, target_name: str, seed: int = 0) -> Eagle3Head:
    """EAGLE-3 head initialised so that, at step 0, it drafts its first token exactly like
    ``warm`` (the shipped EAGLE head) when the last fused layer is the target's last: the
    fuse passes the (normalised) high layer through, ``hidden_norm`` = the target's final
    norm (so the layer reads the post-norm feature EAGLE reads), the layer, fc and final
    norm are the warm head's. Without ``warm``: the target's last layer, as ``eagle.init_head``.
    A ``warm`` EAGLE-3 head with the same fused layers is continued as it is (all its
    weights; the draft vocabulary is the corpus's, as the LM rows are the target's)."""
    from .eagle import init_head

    if isinstance(warm, Eagle3Head):
        if tuple(warm.cfg.hidden_layers) != tuple(opts.hidden_layers):
            raise ValueError(f"the EAGLE-3 head to continue fuses layers {list(warm.cfg.hidden_layers)}, "
                             f"not {list(opts.hidden_layers)}")
        from dataclasses import replace

        head = Eagle3Head(replace(warm.cfg, draft_vocab_size=len(draft_vocab), target=target_name))
        head.load_state_dict({k: v for k, v in warm.state_dict().items() if k != "draft_vocab"}, strict=False)
        with torch.no_grad():
            head.draft_vocab.copy_(draft_vocab)
        return head

    cfg = EagleConfig.from_target_config(tcfg, draft_vocab_size=len(draft_vocab), target=target_name,
                                         hidden_layers=opts.hidden_layers)
    base = warm if warm is not None else init_head(replace_layers(cfg, ()), target_state, draft_vocab, seed)
    torch.manual_seed(seed)
    head = Eagle3Head(cfg)
    state = {k: v for k, v in base.state_dict().items() if k != "draft_vocab"}
    head.load_state_dict(state, strict=False)
    h, k = cfg.hidden_size, len(cfg.hidden_layers)
    with torch.no_grad():
        head.fuse.weight.zero_()
        head.fuse.weight[:, (k - 1) * h:] = torch.eye(h)
        head.hidden_norm.copy_(target_state["model.norm.weight"])
        head.draft_vocab.copy_(draft_vocab)
    return head


def replace_layers(cfg: EagleConfig, layers: tuple[int, ...]) -> EagleConfig:
    from dataclasses import replace

    return replace(cfg, hidden_layers=layers)


def draft_vocab_from(seqs: list[Sequence], size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` most frequent answer tokens (ties: lower id), sorted."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for s in seqs:
        counts += np.bincount(s.tokens[s.roles == ROLE_ANSWER], minlength=vocab_size)
    order = np.lexsort((np.arange(vocab_size), -counts))
    return torch.from_numpy(np.sort(order[:min(size, vocab_size)]))


def split(seqs: list[Sequence], every: int = 50) -> tuple[list[Sequence], list[Sequence]]:
    """(train, held-out) by the id hash (``corpus.is_held_out``): about 1 in ``every`` held out."""
    held = [s for s in seqs if is_held_out(s.id, every)]
    return [s for s in seqs if not is_held_out(s.id, every)], held


def train_eagle3(model, data_dir: str | Path, out_dir: str | Path, cfg: TrainConfig,
                 opts: Eagle3TrainOptions = Eagle3TrainOptions(), warm: str | Path | None = None,
                 resume: bool = False, progress: bool = True, max_minutes: float | None = None,
                 eval_seqs: int = 64, refresh_every: int = 50, held_every: int = 50, log=print) -> dict:
    """Train on ``data_dir`` (a ``verispec train data`` corpus) with the target ``model``
    (a LoadedModel) as teacher; export ``out_dir/weights``. Returns held-out top-1 by depth
    before (``warm``) and after. The corpus is re-read every ``refresh_every`` steps, so
    training can run beside a still-growing ``train data`` (then a resumed run does not
    replay the same batches: the set of sequences differs)."""
    from . import features

    t0 = time.time()
    tcfg, state = features.read_target(model.hf_dir)
    embed = state["model.embed_tokens.weight"].float()  # [V, H] tied LM head
    train_seqs, held = split(read_corpus(data_dir), held_every)
    if not train_seqs or not held:
        raise ValueError(f"{data_dir}: need training and held-out sequences, got {len(train_seqs)} and {len(held)}")
    vocab = draft_vocab_from(train_seqs, opts.draft_vocab_size, tcfg["vocab_size"])
    warm_head = EagleHead.load(warm) if warm else None
    head = init_eagle3(tcfg, state, vocab, opts, warm_head, model.name, cfg.seed)
    teacher = Teacher(model.backend, opts.hidden_layers, opts.seqs_per_step, opts.max_len)
    lm_rows = embed[vocab]

    live = {"seqs": train_seqs, "calls": 0}

    def loss_fn(m, gen):
        live["calls"] += 1
        if live["calls"] % refresh_every == 0:  # shards a running `train data` appended meanwhile
            live["seqs"] = split(read_corpus(data_dir), held_every)[0]
        seqs = live["seqs"]
        picks = torch.randint(0, len(seqs), (opts.seqs_per_step,), generator=gen).tolist()
        return ttt_loss(m, make_batch(m, teacher, embed, seqs, picks, opts, gen), lm_rows, vocab, opts, gen)

    deadline = None if max_minutes is None else t0 + 60 * max_minutes
    result = train(head, loss_fn, cfg, out_dir, resume=resume, progress=progress, deadline=deadline)
    held = split(read_corpus(data_dir), held_every)[1][:eval_seqs]  # the final held-out set, for both heads
    before = {} if warm_head is None else evaluate(
        warm_head, Teacher(model.backend, tuple(warm_head.cfg.hidden_layers), 4, opts.max_len), embed, held,
        opts.depth, opts.max_len)
    after = evaluate(head, teacher, embed, held, opts.depth, opts.max_len)
    log(f"held-out top-1 by depth: before (warm head) {before}; after {after}")
    info = {"steps_done": result.steps, "train_minutes": round((time.time() - t0) / 60, 1),
            "train_sequences": len(live["seqs"]), "held_out_sequences": len(held),
            "train_answer_tokens": int(sum((s.roles == ROLE_ANSWER).sum() for s in live["seqs"])),
            "held_out_before": before, "held_out_after": after, "final_loss": result.losses[-1] if result.losses else None}
    head.save(Path(out_dir) / "weights", {"train": {**asdict(cfg), **asdict(opts), **info}})
    return info
