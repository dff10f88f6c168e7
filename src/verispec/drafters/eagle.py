"""EAGLE: feature-level drafting (Li et al. 2024, arXiv 2401.15077; EAGLE-2 trees, arXiv
2406.16858; EAGLE-3 heads, arXiv 2503.01840: ``Eagle3Head``, the same drafter).

EAGLE-3 in one paragraph: the head's input feature fuses the outputs of a low, a middle
and a high target layer (``EagleConfig.hidden_layers``; the drafter declares them as
``features``, ``Features(layers=...)``, and the engine asks the backend for them) instead of the final hidden
state, and the head is trained with training-time test (``train/eagle3.py``) on its own
chained outputs, so it never regresses target features; at draft time the only
differences are ``features`` (fuse), ``step_out`` (feed back the pre-norm output) and
``readout`` (final norm before the tied LM head).

The head reads the target's hidden state ``f_t`` of the newest position together with
the embedding of the token that followed it, ``e_{t+1}``, and predicts the next hidden
state: ``f_{t+1} ~ g(fc([f_t ; e_{t+1}]))`` where ``g`` is one Llama decoder layer followed
by an RMSNorm. Tokens come from the *target's* LM head applied to the predicted feature
(SmolLM2 ties it to the embedding), so the shipped weights hold only fc + one layer + a
norm; the embedding is read from the target at load time.

Features: verispec backends return the hidden state *after* the target's final norm,
which is exactly what the LM head consumes, so this head is trained to predict post-norm
features (the paper regresses pre-norm features and re-applies the target's norm; with
post-norm features that norm is folded into the head's own final norm).

Optional reduced draft vocabulary (FR-Spec, Zhao et al. 2025, arXiv 2502.14856):
``draft_vocab`` lists the token ids the head may propose (the most frequent in training),
which cuts the per-node LM-head cost. Any drafted token is verified by the full target,
so this never changes the output, only the acceptance rate.

Lossless sampling: chains for sampled requests draw each token from q = the processed
head distribution and attach q (rejection sampling, Leviathan et al. 2023). Trees are the
deterministic top-k expansion of EAGLE-2 (a function of the committed context only), so
they are proposed as point masses (``draft_probs=None``) and verified by recursive
rejection over siblings, which keeps the target distribution exact.

Per-request lifecycle: ``start`` opens the state at position 0. The engine reports the
prefill as a first observation (the prompt as an accepted chain, with the target's hidden
states at every prompt position), so the head attends over the prompt's features and
drafts from the first decode step, as in EAGLE. Every ``observe`` appends (target
feature, following token) pairs for the root and the accepted path; ``propose`` first runs
the pending pairs through the layer (extending the head's own KV cache, which therefore
only ever holds true target features and never needs rollback), then drafts. A request
with no observation yet drafts nothing.

Execution and size: the head runs through a ``HeadRunner`` (``eagle_runner``: PyTorch, or
the compiled CPU runtime when the target runs there, ~10x cheaper per draft step), and
with the target's measured cost curve each draft is cut to the best-first prefix that
maximises committed tokens per unit of target time (``dynamic_tree.size_by_cost``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..models.llama import apply_rope, rms_norm, rope_inv_freq
from ..models.hf_dir import load_target_embedding  # noqa: F401 - re-exported (tests, scripts)
from ..sampling import sample, target_probs
from ..tree import DraftTree
from .base import LAST_HIDDEN, DeclaresFeatures, DraftContext, Features, Observation, RequestTable
from .dynamic_tree import rerank, select_frontier, size_by_cost, tree_from_candidates
from .eagle_runner import HeadRunner, TorchHeadRunner
from ..models.formats import WeightFormat
from .options import option


@dataclass(frozen=True)
class EagleConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int  # rows of the reduced LM head (== vocab_size: full head)
    target: str = ""  # the target this head was trained for (informational)
    # EAGLE-3: the target decoder layers whose outputs are fused into the input feature
    # (low, middle, high); empty = EAGLE(-1), which reads the final post-norm hidden state
    hidden_layers: tuple[int, ...] = ()

    @staticmethod
    def from_target_config(cfg: dict, draft_vocab_size: int | None = None, target: str = "",
                           hidden_layers: tuple[int, ...] = ()) -> "EagleConfig":
        """From an HF Llama config.json dict (the target's)."""
        h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return EagleConfig(
            hidden_size=h, intermediate_size=cfg["intermediate_size"], num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads), head_dim=cfg.get("head_dim") or h // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5), rope_theta=float(theta), vocab_size=cfg["vocab_size"],
            draft_vocab_size=draft_vocab_size or cfg["vocab_size"], target=target, hidden_layers=tuple(hidden_layers),
        )


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """The target's rotate-half RoPE (unscaled ``theta``) at absolute positions. x: [B, heads, T, D]; pos: [B, T]."""
    ang = pos.float()[..., None] * rope_inv_freq(x.shape[-1], theta, device=x.device)  # [B, T, D/2]
    return apply_rope(x, ang.cos()[:, None], ang.sin()[:, None])  # cos, sin [B, 1, T, D/2]


class EagleHead(nn.Module):
    """fc (2H -> H) + one Llama decoder layer + RMSNorm. ``draft_vocab`` [Vd] buffer."""

    def __init__(self, cfg: EagleConfig):
        super().__init__()
        self.cfg = cfg
        h, hd = cfg.hidden_size, cfg.head_dim
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.input_norm = nn.Parameter(torch.ones(h))
        self.q_proj = nn.Linear(h, cfg.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * hd, h, bias=False)
        self.post_norm = nn.Parameter(torch.ones(h))
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.final_norm = nn.Parameter(torch.ones(h))
        self.register_buffer("draft_vocab", torch.arange(cfg.draft_vocab_size), persistent=True)

    def forward(
        self,
        feats: torch.Tensor,  # [B, T, H] target (or predicted) features f_t
        embeds: torch.Tensor,  # [B, T, H] embeddings of the following tokens e_{t+1}
        positions: torch.Tensor,  # [B, T] positions of those following tokens
        past: tuple[torch.Tensor, torch.Tensor] | None = None,  # ([B, kvh, P, D], same)
        mask: torch.Tensor | None = None,  # [T, P + T] bool, True = may attend; None = causal
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Predicted features [B, T, H] (what the next draft step reads: ``step_out``) and
        this call's new keys/values ([B, kvh, T, D] each)."""
        x, q, k, v = self.project(feats, embeds, positions)
        new_kv = (k, v)
        t = q.shape[2]
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        rep = self.cfg.num_heads // self.cfg.num_kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # [B, heads, P+T, D]
        if mask is None and past is None:
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            if mask is None:
                p = k.shape[2] - t
                mask = torch.ones(t, p + t, dtype=torch.bool, device=q.device).tril(p)
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.step_out(self.finish(x, att)), new_kv

    def project(self, feats: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor):
        """fc + input norm + roped Q/K/V: (x [B, T, H], q [B, heads, T, D], k, v [B, kvh, T, D])."""
        cfg = self.cfg
        b, t, _ = feats.shape
        x = self.fc(torch.cat([self.feature_in(feats), embeds], -1))  # [B, T, H]
        hn = rms_norm(x, self.input_norm, cfg.rms_norm_eps)
        q = self.q_proj(hn).view(b, t, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(hn).view(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(hn).view(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        return x, rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta), v

    def finish(self, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        """Attention output [B, heads, T, D] -> o_proj residual + MLP residual: [B, T, H] (pre final norm)."""
        b, _, t, _ = att.shape
        x = x + self.o_proj(att.transpose(1, 2).reshape(b, t, -1))
        hn = rms_norm(x, self.post_norm, self.cfg.rms_norm_eps)
        return x + self.down_proj(F.silu(self.gate_proj(hn)) * self.up_proj(hn))

    # EAGLE(-1) reads and regresses post-norm features; EAGLE-3 (Eagle3Head) overrides these
    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] what the target backend returned -> the head's input feature [..., H]."""
        return hidden

    def feature_in(self, feats: torch.Tensor) -> torch.Tensor:
        return feats

    def step_out(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's output -> the feature fed to the next draft step."""
        return rms_norm(x, self.final_norm, self.cfg.rms_norm_eps)

    def readout(self, pred: torch.Tensor) -> torch.Tensor:
        """A fed-back feature -> the vector the (tied) LM head reads."""
        return pred

    # ---- persistence -------------------------------------------------------------------
    def save(self, out_dir: str | Path, extra_config: dict | None = None) -> None:
        """``model.safetensors`` + ``config.json`` (no target embedding inside)."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(out / "model.safetensors"))
        arch = "eagle3" if self.cfg.hidden_layers else "eagle"
        cfg = {"architecture": arch, **asdict(self.cfg), **(extra_config or {})}
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    @staticmethod
    def load(path: str | Path) -> "EagleHead":
        """EAGLE (``EagleHead``) or EAGLE-3 (``Eagle3Head``) weights, by their config's architecture."""
        from safetensors.torch import load_file

        path = Path(path)
        if not (path / "config.json").exists() or not (path / "model.safetensors").exists():
            raise ValueError(f"{path} has no config.json + model.safetensors (EAGLE weights)")
        raw = json.loads((path / "config.json").read_text())
        if raw.get("architecture") not in ("eagle", "eagle3"):
            raise ValueError(f"{path} does not hold EAGLE weights (architecture={raw.get('architecture')!r})")
        fields = EagleConfig.__dataclass_fields__
        cfg = EagleConfig(**{k: tuple(v) if k == "hidden_layers" else v for k, v in raw.items() if k in fields})
        head = (Eagle3Head if cfg.hidden_layers else EagleHead)(cfg)
        head.load_state_dict(load_file(str(path / "model.safetensors")))
        return head.eval()


class Eagle3Head(EagleHead):
    """EAGLE-3 (Li et al. 2025, arXiv 2503.01840): the input feature fuses the outputs of
    low, middle and high target layers (``cfg.hidden_layers``), each RMS-normalised (the
    residual stream holds outliers of ~1e4) and projected by ``fuse`` (kH -> H); the head
    is trained with training-time test (``train/eagle3.py``) and predicts no target
    feature: each step feeds its own pre-norm output ``x`` to the next step (normalised
    by ``hidden_norm``, like the target features), and the LM head reads ``final_norm(x)``."""

    def __init__(self, cfg: EagleConfig):
        if not cfg.hidden_layers:
            raise ValueError("an EAGLE-3 head needs hidden_layers (the fused target layers)")
        super().__init__(cfg)
        k, h = len(cfg.hidden_layers), cfg.hidden_size
        self.layer_norms = nn.Parameter(torch.ones(k, h))
        self.fuse = nn.Linear(k * h, h, bias=False)
        self.hidden_norm = nn.Parameter(torch.ones(h))

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., k * H] target layer outputs (concatenated) -> fused feature [..., H]."""
        k, h = self.layer_norms.shape
        if hidden.shape[-1] != k * h:
            raise ValueError(f"EAGLE-3 head expects {k} target layers of width {h} concatenated (width {k * h}), "
                             f"got width {hidden.shape[-1]}")
        parts = hidden.view(*hidden.shape[:-1], k, h)
        return self.fuse(rms_norm(parts, self.layer_norms, self.cfg.rms_norm_eps).flatten(-2))

    def feature_in(self, feats: torch.Tensor) -> torch.Tensor:
        return rms_norm(feats, self.hidden_norm, self.cfg.rms_norm_eps)

    def step_out(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def readout(self, pred: torch.Tensor) -> torch.Tensor:
        return rms_norm(pred, self.final_norm, self.cfg.rms_norm_eps)


@dataclass
class _EagleState:
    root_pos: int  # absolute position of the newest committed token (the next root)
    head: Any  # the runner's per-request state (the head's K/V of fed (feature, token) pairs)
    pending_feats: list[torch.Tensor] = field(default_factory=list)  # [H] each
    pending_tokens: list[int] = field(default_factory=list)
    last_pred: torch.Tensor | None = None  # [H] head output for the last fed pair
    last_logits: torch.Tensor | None = None  # [Vd] draft logits read from it


@dataclass(frozen=True)
class EagleOptions:
    """EAGLE feature head on target hidden states, EAGLE-2 dynamic trees (Li et al. 2024); eagle3: EAGLE-3's fused low/mid/high layers."""

    mode: Literal["tree", "chain"] = option("tree", "a dynamic tree or a chain")
    depth: int = option(6, "draft depth")
    top_k: int = option(8, "children expanded per node")
    weights: str | None = option(None, "a directory of trained head weights (default: the shipped ones)")
    runtime: Literal["auto", "compiled", "torch"] = option("auto", "where the head runs (auto: compiled beside a compiled target)")
    head_quant: str = option(WeightFormat.Q8_0.value, "the head's weights on the compiled runtime: q8_0 or f32")
    budget: Literal["measured", "fixed"] = option("measured", "measured: each draft sized by the target's cost curve")

    def __post_init__(self) -> None:
        if self.depth < 1 or self.top_k < 1:
            raise ValueError("eagle needs depth >= 1 and top_k >= 1")
        if self.head_quant not in (WeightFormat.Q8_0, WeightFormat.F32):
            raise ValueError(f"head_quant must be {WeightFormat.Q8_0} or {WeightFormat.F32}, got {self.head_quant!r}")


class EagleDrafter(DeclaresFeatures):
    """EAGLE chains (``mode="chain"``) or EAGLE-2 dynamic trees (``mode="tree"``: expand
    ``top_k`` nodes per depth for ``depth`` levels, rerank to the engine's budget).
    ``runner``: where the head runs (``eagle_runner``); default PyTorch. ``cost``: the
    target's measured cost curve t(n); given, each draft is cut to the size that pays
    most by the head's own confidence (``dynamic_tree.size_by_cost``), else it fills the
    budget."""

    name: ClassVar[str] = "eagle"

    def __init__(self, head: EagleHead, embed: torch.Tensor, mode: Literal["chain", "tree"] = EagleOptions.mode,
                 depth: int = EagleOptions.depth, top_k: int = EagleOptions.top_k, runner: HeadRunner | None = None,
                 cost: dict[int, float] | None = None):
        if mode not in ("chain", "tree"):
            raise ValueError(f"mode must be chain or tree, not {mode!r}")
        cfg = head.cfg
        check_tree_options(cfg, mode, depth, top_k)
        if tuple(embed.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(f"target embedding has shape {tuple(embed.shape)}; the EAGLE head expects "
                             f"({cfg.vocab_size}, {cfg.hidden_size})")
        self.head = head.eval().float()
        self.name = "eagle3" if cfg.hidden_layers else "eagle"  # what stats and benchmarks call it
        # EAGLE: the target's last hidden state; EAGLE-3: the outputs of its fused layers
        self.features = Features(layers=tuple(cfg.hidden_layers)) if cfg.hidden_layers else LAST_HIDDEN
        self.runner: HeadRunner = runner or TorchHeadRunner(self.head, embed.float())
        room = self.runner.max_draft  # draft nodes the runner holds per proposal
        if room is not None and mode == "tree" and (depth - 1) * top_k > room:
            raise ValueError(f"a tree of depth {depth} x top_k {top_k} expands {(depth - 1) * top_k} nodes; "
                             f"the head runner holds {room}")
        self.mode, self.depth, self.top_k, self.cost = mode, depth, top_k, cost
        self._states: RequestTable[_EagleState] = RequestTable()

    def cost_signature(self) -> str:
        """The head's shape and where it runs (the compiled runtime changes c(n) tenfold)."""
        return repr((self.head.cfg, type(self.runner).__name__))

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self, request_id: str, prompt_ids: list[int]) -> None:
        self._states.add(request_id, _EagleState(root_pos=0, head=self.runner.open()))  # prefill starts at prompt[0]

    def finish(self, request_id: str) -> None:
        self._states.pop(request_id)

    def observe(self, obs: Observation) -> None:
        """Queue (feature of node, token that followed it) for the root and accepted path."""
        if obs.hidden is None:
            raise ValueError("the EAGLE drafter needs target hidden states (features)")
        st = self._states.get(obs.request_id)
        nodes = [0, *obs.path]
        if len(obs.new_tokens) != len(nodes):
            raise ValueError(f"expected {len(nodes)} new tokens, got {len(obs.new_tokens)}")
        with torch.inference_mode():
            hidden = self.head.features(obs.hidden[nodes].float())  # [n, H]
        st.pending_feats.extend(hidden)
        st.pending_tokens.extend(obs.new_tokens)
        st.root_pos += len(obs.new_tokens)

    def memory_bytes(self) -> int:
        """The head's weights (and embedding copy) plus every open request's head K/V."""
        return self.runner.weight_bytes + sum(self.runner.memory_bytes(s.head) for s in self._states.values())

    # ---- proposing ---------------------------------------------------------------------
    def _catch_up(self, st: _EagleState) -> None:
        """Run the pending true-feature pairs through the head, extending its KV cache."""
        if not st.pending_tokens:
            return
        n = len(st.pending_tokens)
        st.last_pred, st.last_logits = self.runner.extend(st.head, torch.stack(st.pending_feats), st.pending_tokens,
                                                          st.root_pos - n + 1)  # positions of the tokens
        st.pending_feats.clear()
        st.pending_tokens.clear()

    def propose(self, ctx: DraftContext) -> DraftTree:
        st = self._states.get(ctx.request_id)
        root = ctx.tokens[-1]
        if st.last_pred is None and not st.pending_tokens:
            return DraftTree.chain(root, [])  # nothing observed yet: no features
        if len(ctx.tokens) - 1 != st.root_pos:
            raise ValueError(f"request {ctx.request_id}: context has {len(ctx.tokens)} tokens but the "
                             f"drafter expected {st.root_pos + 1} (missed an observe?)")
        with torch.inference_mode():
            self._catch_up(st)
            if ctx.budget < 1:
                return DraftTree.chain(root, [])
            self.runner.begin(st.head)
            if self.mode == "chain":
                return self._chain(st, ctx)
            return self._tree(st, ctx)

    def _chain(self, st: _EagleState, ctx: DraftContext) -> DraftTree:
        pred, logits, drafts, qs, scores = st.last_pred, st.last_logits, [], [], []
        room = self.runner.max_draft
        budget = ctx.budget if room is None else min(ctx.budget, room + 1)  # the last token needs no step
        for d in range(1, budget + 1):
            prev = scores[-1] if scores else 0.0  # the path's log-probability under the head
            if ctx.params.greedy:
                lp, idx = _top_logprobs(logits.numpy()[None], 1)
                token = int(self.head.draft_vocab[int(idx[0, 0])])
                scores.append(prev + float(lp[0, 0]))
            else:
                full = logits.new_full((self.head.cfg.vocab_size,), float("-inf"))
                full[self.head.draft_vocab] = logits
                q = target_probs(full[None], ctx.params)[0]  # [V]
                token = sample(q, ctx.generator)
                qs.append(q)
                scores.append(prev + float(q[token].clamp_min(1e-30).log()))
            drafts.append(token)
            if d == budget:
                break
            out, lg = self.runner.expand(st.head, pred[None], [token], st.root_pos + d, [list(range(d - 1))])
            pred, logits = out[0], lg[0]
        if self.cost is not None:  # a chain's best-first prefixes are its prefixes
            n = len(size_by_cost(scores, list(range(len(drafts))), self.cost))
            drafts, qs = drafts[:n], qs[:n]
        return DraftTree.chain(ctx.tokens[-1], drafts, torch.stack(qs) if qs else None)

    def _tree(self, st: _EagleState, ctx: DraftContext) -> DraftTree:
        """EAGLE-2: expand the top_k best nodes per depth, then rerank all candidates."""
        tokens, parents, scores = [], [], []
        feats: dict[int, torch.Tensor] = {}  # candidate -> predicted feature (expanded only)
        slot: dict[int, int] = {}  # expanded candidate -> its draft index in the runner
        frontier, logits = [-1], st.last_logits[None]  # the root's draft logits
        vocab = self.head.draft_vocab.tolist()
        for d in range(1, self.depth + 1):
            top_lp, top_idx = _top_logprobs(logits.numpy(), self.top_k)  # [F, k] each
            level = []
            for row, parent in enumerate(frontier):
                base = 0.0 if parent == -1 else scores[parent]
                for lp, idx in zip(top_lp[row].tolist(), top_idx[row].tolist()):
                    level.append(len(tokens))
                    tokens.append(vocab[idx])
                    parents.append(parent)
                    scores.append(base + lp)
            if d == self.depth:
                break
            frontier = select_frontier(scores, level, self.top_k)
            ancestors = []  # each new node sees its expanded ancestors
            for c in frontier:
                anc, a = [], parents[c]
                while a != -1:
                    anc.append(slot[a])
                    a = parents[a]
                ancestors.append(anc)
            in_feats = torch.stack([st.last_pred if parents[c] == -1 else feats[parents[c]] for c in frontier])
            out, logits = self.runner.expand(st.head, in_feats, [tokens[c] for c in frontier], st.root_pos + d, ancestors)
            base = len(slot)
            for r, c in enumerate(frontier):
                feats[c], slot[c] = out[r], base + r
        chosen = rerank(scores, parents, ctx.budget)
        if self.cost is not None:
            chosen = size_by_cost(scores, chosen, self.cost)
        return tree_from_candidates(ctx.tokens[-1], tokens, parents, scores, chosen)


def check_tree_options(cfg: EagleConfig, mode: str, depth: int, top_k: int, max_length: int | None = None) -> None:
    """Refuse (ValueError, one line) options that mean nothing or that the machine cannot
    hold, before anything is allocated: ``top_k`` beyond the head's draft vocabulary (there
    are no more tokens to pick from), ``depth`` beyond the context (``max_length``), and a
    tree whose bytes (``tree_bytes``) exceed the memory available."""
    from ..memory import check_fits

    if not 1 <= top_k <= cfg.draft_vocab_size:
        raise ValueError(f"top_k must be in [1, {cfg.draft_vocab_size}] (the EAGLE head's draft vocabulary), "
                         f"got {top_k}")
    limit = max_length if max_length is not None else 2**31
    if not 1 <= depth <= limit:
        raise ValueError(f"depth must be in [1, {limit}]" + (" (the context)" if max_length else "") + f", got {depth}")
    if mode == "tree":
        check_fits(tree_bytes(cfg, depth, top_k), f"an EAGLE tree of depth {depth} x top_k {top_k}",
                   "lower depth or top_k")


def tree_bytes(cfg: EagleConfig, depth: int, top_k: int) -> int:
    """Bytes one EAGLE-2 proposal needs: ``top_k + (depth - 1) * top_k**2`` candidates (three Python lists:
    token, parent, score; ~64 bytes each), the frontier's draft logits ([top_k, Vd] float32 and
    the numpy copies ``_top_logprobs`` makes) and the head's draft positions (K/V, RoPE, one
    row of attention per expanded node)."""
    candidates = (top_k + (depth - 1) * top_k * top_k) * 64
    logits = top_k * cfg.draft_vocab_size * 4 * 4
    expanded = max(64, depth * top_k)
    per_position = 4 * (2 * cfg.num_kv_heads * cfg.head_dim + 2 * cfg.head_dim + cfg.hidden_size + expanded)
    return candidates + logits + expanded * per_position


def _top_logprobs(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """[F, Vd] logits -> the k best log-probabilities and their indices per row, best
    first (ties: lower index first). In numpy: small torch ops here would wake torch's
    OpenMP threads, which then fight the compiled runtime's threads for the cores (a
    [8, 8192] log_softmax + topk measured 10 ms that way, 0.1 ms in numpy)."""
    k = min(k, logits.shape[-1])
    m = logits.max(-1, keepdims=True)
    logp = logits - (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))
    idx = np.argpartition(-logp, k - 1, axis=-1)[:, :k]
    vals = np.take_along_axis(logp, idx, -1)
    order = np.lexsort((idx, -vals), axis=-1)
    return np.take_along_axis(vals, order, -1), np.take_along_axis(idx, order, -1)
