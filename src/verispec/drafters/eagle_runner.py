"""Where an EAGLE head runs: PyTorch (any device) or the compiled CPU runtime.

The drafting logic (``EagleDrafter``: chains, EAGLE-2 trees) is the same for both; a
runner only executes the head and owns its per-request K/V:

* ``extend`` runs committed (target feature, following token) pairs through the head,
  appending them to the head's cache for good (they are true features: never rolled back);
* ``expand`` runs one depth of draft nodes. Every expanded node gets the next *draft index*
  of the current proposal (0, 1, ...; ``begin`` resets the count) and sees the committed
  cache, the draft nodes listed as its ancestors, and itself. Draft nodes are simply
  overwritten by the next proposal.

Both return, per row, the feature the next step feeds back (``step_out``) and the draft
logits over the head's draft vocabulary.

``CompiledHeadRunner`` is why EAGLE can pay on a CPU: the head is one Llama layer, so in
PyTorch a draft step costs ~1-2 ms of framework overhead, more than a whole decode step of
the compiled target (~3 ms for 30 layers). On the compiled runtime it is one C++ call
(``CpuLlama.forward_slots``) over a 1-layer model whose input projection ``fc`` reads
``[in_norm(feature) ; embedding(token)]`` and whose LM head holds only the draft
vocabulary's rows, all in Q8_0 (or fp32, ``quant="f32"``). Drafts are proposals only:
the target verifies every token, so the head's quantization changes acceptance, never
output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from ..models.formats import WeightFormat

if TYPE_CHECKING:
    from .eagle import EagleHead


class HeadRunner(Protocol):
    max_draft: int | None  # draft nodes ``expand`` holds per proposal (None: no limit)

    def open(self) -> Any: ...  # per-request head state

    def cached(self, st: Any) -> int: ...  # committed pairs in the head's cache

    def extend(self, st: Any, feats: torch.Tensor, tokens: list[int], first_pos: int
               ) -> tuple[torch.Tensor, torch.Tensor]: ...  # last row's ([H] step_out, [Vd] logits)

    def begin(self, st: Any) -> None: ...  # a new proposal: draft indices restart at 0

    def expand(self, st: Any, feats: torch.Tensor, tokens: list[int], pos: int, ancestors: list[list[int]]
               ) -> tuple[torch.Tensor, torch.Tensor]: ...  # ([T, H] step_out, [T, Vd] logits)

    def memory_bytes(self, st: Any) -> int: ...  # the request's head K/V

    @property
    def weight_bytes(self) -> int: ...  # the head's weights and the embedding copy it reads


# ----------------------------------------------------------------------------- PyTorch


@dataclass
class _TorchState:
    k: torch.Tensor | None = None  # [1, kvh, P, D] committed keys
    v: torch.Tensor | None = None
    extra: tuple[torch.Tensor, torch.Tensor] | None = None  # this proposal's draft nodes' K/V


class TorchHeadRunner:
    """The head as an ``nn.Module`` (fp32, any device): the reference runner."""

    max_draft = None  # its draft K/V grows with the proposal

    def __init__(self, head: EagleHead, embed: torch.Tensor):
        self.head, self.embed = head, embed  # embed [V, H] fp32 (the target's, tied LM head)
        self.lm_rows = embed[head.draft_vocab]  # [Vd, H]

    def open(self) -> _TorchState:
        return _TorchState()

    def cached(self, st: _TorchState) -> int:
        return 0 if st.k is None else st.k.shape[2]

    def _logits(self, pred: torch.Tensor) -> torch.Tensor:
        return self.head.readout(pred) @ self.lm_rows.T  # [..., Vd]

    @torch.inference_mode()
    def extend(self, st, feats, tokens, first_pos):
        n = len(tokens)
        embeds = self.embed[torch.tensor(tokens)][None]  # [1, n, H]
        pos = torch.arange(first_pos, first_pos + n)[None]
        past = None if st.k is None else (st.k, st.v)
        pred, (k, v) = self.head(feats[None], embeds, pos, past)
        st.k = k if st.k is None else torch.cat([st.k, k], 2)
        st.v = v if st.v is None else torch.cat([st.v, v], 2)
        return pred[0, -1], self._logits(pred[0, -1])

    def begin(self, st: _TorchState) -> None:
        st.extra = None

    @torch.inference_mode()
    def expand(self, st, feats, tokens, pos, ancestors):
        t = len(tokens)
        n_extra = 0 if st.extra is None else st.extra[0].shape[2]
        vis = torch.zeros(t, self.cached(st) + n_extra + t, dtype=torch.bool)  # [T, committed + extra + T]
        vis[:, :self.cached(st)] = True
        for r, anc in enumerate(ancestors):
            vis[r, [self.cached(st) + a for a in anc]] = True
            vis[r, self.cached(st) + n_extra + r] = True
        past_k, past_v = st.k, st.v
        if st.extra is not None:
            past_k, past_v = torch.cat([past_k, st.extra[0]], 2), torch.cat([past_v, st.extra[1]], 2)
        embeds = self.embed[torch.tensor(tokens)][None]
        pred, kv = self.head(feats[None], embeds, torch.full((1, t), pos), (past_k, past_v), vis)
        st.extra = kv if st.extra is None else (torch.cat([st.extra[0], kv[0]], 2), torch.cat([st.extra[1], kv[1]], 2))
        return pred[0], self._logits(pred[0])

    def memory_bytes(self, st: _TorchState) -> int:
        return 0 if st.k is None else 2 * st.k.numel() * st.k.element_size()

    @property
    def weight_bytes(self) -> int:
        """fp32 head parameters + the fp32 embedding and its draft-vocabulary rows."""
        params = sum(p.numel() for p in self.head.parameters())
        return 4 * (params + self.embed.numel() + self.lm_rows.numel())


# ----------------------------------------------------------------------------- compiled


@dataclass
class _CompiledState:
    pool: Any  # CpuCachePool of the 1-layer head model, one row
    cached: int = 0
    drafted: int = 0  # draft nodes written this proposal (slots cached .. cached + drafted - 1)


HEAD_QUANTS = (WeightFormat.Q8_0, WeightFormat.F32)  # the compiled head's weight formats (head_quant=)


class CompiledHeadRunner:
    """The head on the compiled CPU runtime: a 1-layer ``CpuLlama`` with a feature input
    projection, Q8_0 weights (``quant``) and the draft vocabulary as its LM head. Its K/V
    cache per request is fp16 (fp32 for quant="f32") with room for ``max_length`` committed positions plus
    ``max_draft`` draft nodes."""

    def __init__(self, head: EagleHead, embed: torch.Tensor, max_length: int,
                 quant: WeightFormat | str = WeightFormat.Q8_0, threads: int | None = None, max_draft: int = 128):
        from ..models.cpu import CpuLlama
        from ..models.cpu_weights import quantize_matrix

        cfg = head.cfg
        quant = WeightFormat.parse(quant, HEAD_QUANTS, "compiled EAGLE head quant")
        self.head, self.max_length, self.max_draft = head, max_length, max_draft
        self.eagle3 = bool(cfg.hidden_layers)  # step_out: pre-norm output (EAGLE-3) or final-normed (EAGLE)
        hf_cfg = {"model_type": "llama", "vocab_size": cfg.draft_vocab_size, "hidden_size": cfg.hidden_size,
                  "num_hidden_layers": 1, "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
                  "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size, "rms_norm_eps": cfg.rms_norm_eps,
                  "rope_theta": cfg.rope_theta, "max_position_embeddings": max_length + max_draft}
        q = lambda w: quantize_matrix(w.detach().float(), quant)  # noqa: E731
        h = head
        with torch.no_grad():
            layer = {"attn_norm": h.input_norm.detach(), "ffn_norm": h.post_norm.detach(),
                     "wqkv": q(torch.cat([h.q_proj.weight, h.k_proj.weight, h.v_proj.weight])), "wo": q(h.o_proj.weight),
                     "w13": q(torch.cat([h.gate_proj.weight, h.up_proj.weight])), "w2": q(h.down_proj.weight)}
            weights = {"layers": [layer], "norm": h.final_norm.detach(), "head": q(embed[h.draft_vocab]),
                       "embed": q(embed), "in_proj": q(h.fc.weight), "in_proj_bias": h.fc.bias.detach().float(),
                       "in_norm": h.hidden_norm.detach() if self.eagle3 else None}
        self.model = CpuLlama.from_weights(hf_cfg, weights, max_length + max_draft, name="eagle-head",
                                           threads=threads or 1,
                                           kv_dtype=torch.float32 if quant == WeightFormat.F32 else torch.float16)

    def open(self) -> _CompiledState:
        return _CompiledState(self.model.new_cache_pool(1, self.max_length + self.max_draft))

    def cached(self, st: _CompiledState) -> int:
        return st.cached

    def _run(self, st, feats, tokens, positions, slots, visible, logit_rows=None):
        out = self.model.forward_slots(st.pool, 0, np.asarray(tokens), positions, slots, visible, st.cached,
                                       feats=feats, hidden_layers=(0,) if self.eagle3 else (),
                                       want_hidden=not self.eagle3, logit_rows=logit_rows)
        return (out.layers if self.eagle3 else out.hidden), out.logits

    def extend(self, st, feats, tokens, first_pos):
        n = len(tokens)
        if st.cached + n > self.max_length:
            raise ValueError(f"EAGLE head cache full: {st.cached + n} positions (max {self.max_length})")
        slots = np.arange(st.cached, st.cached + n)
        visible = [slots[: i + 1] for i in range(n)]  # causal among the new pairs
        step_out, logits = self._run(st, feats, tokens, np.arange(first_pos, first_pos + n), slots, visible,
                                     logit_rows=np.array([n - 1]))
        st.cached += n
        return step_out[-1], logits[0]

    def begin(self, st: _CompiledState) -> None:
        st.drafted = 0

    def expand(self, st, feats, tokens, pos, ancestors):
        t = len(tokens)
        if st.drafted + t > self.max_draft:
            raise ValueError(f"EAGLE head: at most {self.max_draft} expanded draft nodes per proposal")
        base = st.cached + st.drafted
        slots = np.arange(base, base + t)
        visible = [np.array(sorted(st.cached + a for a in anc) + [base + r]) for r, anc in enumerate(ancestors)]
        step_out, logits = self._run(st, feats, tokens, np.full(t, pos), slots, visible)
        st.drafted += t
        return step_out, logits

    def memory_bytes(self, st: _CompiledState) -> int:
        return st.pool.nbytes

    @property
    def weight_bytes(self) -> int:
        """Repacked head weights + the Q8_0 input embedding (34 bytes per 32 values)."""
        cfg = self.head.cfg
        return self.model.weight_bytes + cfg.vocab_size * cfg.hidden_size // 32 * 34
