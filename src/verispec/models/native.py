"""Native PyTorch Llama runtime (gpt-fast style) with a static, rollback-able KV cache.

Design
------
* Plain tensors, no ``nn.Module`` tree: weights are loaded from an HF-format directory
  (``config.json`` + ``*.safetensors``) into frozen dataclasses; q/k/v and gate/up are fused
  into one matrix each so a layer runs four matmuls. Llama, Llama-3 RoPE scaling, GQA, tied
  embeddings and Qwen2-style q/k/v biases are supported (the config, RoPE and RMSNorm are
  models/llama.py's, shared with the compiled runtime and EAGLE heads).
* Static cache: one preallocated tensor pair ``k, v [layers, rows, kv_heads, slots, head_dim]``
  (a ``NativeCachePool``, models/native_cache.py); a request's ``NativeCache`` is a handle on one row plus an int
  length. ``truncate`` changes the int; ``compact`` index-copies the accepted slots.
  ``forward_batch`` runs several handles of one pool in a single forward (ragged lengths are
  masks), so a batched server needs no other model code.
* Every forward writes the new tokens' K/V at slots ``length .. length+N-1`` first and then
  attends over a window of the cache with an explicit boolean mask (cached slots visible, new
  tokens per ``tree_mask``, everything past ``length+N`` invisible).

What it promises
----------------
* **CPU: the compiled runtime (models/cpu.py) is the exact path.** Its kernels give a row
  the same bits at every forward size on every ISA, with no calibration and no padding.
  ``backend="auto"`` runs this runtime on CPU only where that one does not (not built,
  bf16), and on CUDA.
* **This runtime's batch invariance is calibrated per machine** (models/invariance.py,
  ``model.invariance``): at load time, and again when torch's thread count changes, it
  measures this machine's kernels and pads forwards until they are row-invariant.
  ``model.exactness`` says whether speculative greedy output is bit-identical to plain
  decoding here, and why not when it cannot hold (no padding helps, invariance switched
  off, or padding set by the caller and so never measured). It never claims it silently.
* **CUDA: only what the calibration measured, on that device.** That is: the first
  layer's four linears and the LM head at their full shapes and RMSNorm gave every row the
  same bits at every row count from ``min_rows`` to ``max_rows`` (a forward of one
  request); the two attention matmuls did so for one chunk's shape and two chunks; and
  chunked attention gave the same result under three splittings of one 2-chunk sequence.
  Nothing else is measured: a batched forward (B requests: B x rows in every linear),
  more chunks (the attention batch grows with the context), another GPU, driver or
  cuBLAS version, or a non-deterministic cuBLAS setting. The reason's text names the
  CPU's ISA even on CUDA, and no test runs this runtime on CUDA.

Batch invariance (why speculative greedy output is bit-identical to plain decoding)
-----------------------------------------------------------------------------------
A token's logits must not depend on how many other tokens share its forward, where it sits,
or where its ancestors sit in the cache. Three things break that in a naive runtime:
(1) GEMM kernels round differently for different row counts (MKL fp32 here, 2 threads:
M=1 is a GEMV and M in 2..3, 5..7, 9..11 differ from M>=12; with 1 thread M>=4 agree);
(2) attention reduces over a key axis whose length is ``length+N`` (``torch.sum`` even
regroups when zeros are appended); (3) in a tree, a node's ancestors sit at other slots
than in sequential decoding (holes for siblings), which changes the reduction order.
With ``batch_invariant=True`` (default) the model's ``invariance`` (a ``BatchInvariance``)
decides:

1. Every decode/verify forward (N <= ``max_rows``) is padded with dummy rows to at least
   ``min_rows`` rows. ``min_rows`` is calibrated at load time on the model's own weights at
   their full shapes (``calibrate_min_rows``): the smallest m such that, for every row count
   in [m, max_rows], every row is bitwise equal to the same row of a ``max_rows``-row forward
   and does not depend on its index. It is valid for one torch thread count and one CPU ISA
   (oneDNN's AVX-512-BF16 GEMV differs from its GEMM at K=1536; its AVX2 path does not); the
   model recalibrates if the thread count changes. ``model.exactness`` reports the outcome:
   where no padding helps, invariance is switched off with the reason (never a silent claim).
2. Attention (``invariant_attention``, fp32) cuts keys into fixed ``attn_chunk``-slot
   chunks. Chunks holding only cached slots are shared by all rows; the tail chunks are
   laid out per new token exactly as sequential decoding would see them (cached slots, then
   its root-to-node path: ``tail_layout``). Every chunk is one canonical fixed-shape
   ``torch.bmm`` (query rows padded to ``attn_min_rows``, also calibrated); masked keys are
   exact zeros; the row max is order-free; chunks are combined by ``pairwise_sum``, whose
   result does not change when zero chunks are appended.
3. RMSNorm, RoPE and the MLP are row-local; logits are computed for all padded rows.

Cost: the padded rows (2 threads: fp32 pays for >= 12 rows on AVX2 and AVX-512, bf16 for 2
on AVX-512-BF16 and 1 on AVX2, int8/int4 for 1; docs/native.md has the per-ISA table) and
the per-token tail gather (small).
Forwards of more than ``max_rows`` tokens (prefill) take the fast path (no padding, SDPA
over the exact window). Plain and speculative decoding share the same prefill, and with the
engine's invariant ``cache.length == len(committed) - 1`` the first decode step (root token
+ drafts) always runs on the invariant path, so it is identical in both. With
``batch_invariant=False`` every forward takes the fast path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from verispec.models.base import Exactness, ModelError, ModelInfo, ModelOutput, check_hidden_layers
from verispec.models.cache_pool import PooledLM
from verispec.models.formats import PYTORCH_FORMATS, WeightFormat
from verispec.models.invariance import BatchInvariance, RowProbe, invariant_attention, tail_layout
from verispec.models.llama import LlamaArgs, apply_rope, check_native, read_safetensors, rms_norm, rope_tables, take
from verispec.models.native_cache import NativeCache, NativeCachePool, round_up
from verispec.models.quant import QuantWeight, quant_linear, quantize_int4, quantize_int8

Weight = torch.Tensor | QuantWeight


# ----------------------------------------------------------------------------- options


@dataclass(frozen=True)
class NativeOptions:
    """Runtime choices (not architecture). ``min_rows=None`` means calibrate at load time;
    what the model runs with is its ``invariance`` (models/invariance.py)."""

    dtype: torch.dtype = torch.bfloat16  # weights + activations (quantized linears: activations)
    # weight-only quantization of the linears (models/quant.py): int8 per channel; int4 in
    # groups of 32 (Q4_1's layout) with an int8 lm_head. Products run with bf16 inputs.
    quant: WeightFormat = WeightFormat.NONE  # one of PYTORCH_FORMATS (a string names one: "int4")
    batch_invariant: bool = True
    max_rows: int = 64  # largest forward on the invariant path; larger ones are prefill
    min_rows: int | None = None  # invariant forwards are padded to at least this many token rows
    attn_min_rows: int | None = None  # invariant attention pads its query rows to at least this
    attn_chunk: int = 128  # key-chunk size of invariant attention

    def __post_init__(self):
        object.__setattr__(self, "quant", WeightFormat.parse(self.quant, PYTORCH_FORMATS))


# ----------------------------------------------------------------------------- weights


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: torch.Tensor  # [dim]
    wqkv: Weight  # [(n_heads + 2 * n_kv_heads) * head_dim, dim]
    bqkv: torch.Tensor | None  # [(n_heads + 2 * n_kv_heads) * head_dim] (Qwen2)
    wo: Weight  # [dim, n_heads * head_dim]
    mlp_norm: torch.Tensor  # [dim]
    w13: Weight  # [2 * intermediate, dim]  (gate; up)
    w2: Weight  # [dim, intermediate]


def _layer_weights(state: dict, i: int, prep) -> LayerWeights:
    p = f"model.layers.{i}."
    qkv = [p + f"self_attn.{n}_proj" for n in "qkv"]
    biases = [state.get(n + ".bias") for n in qkv]
    if state.get(p + "self_attn.o_proj.bias") is not None:
        raise ModelError("native runtime: o_proj bias is not supported")
    return LayerWeights(
        attn_norm=prep(take(state, p + "input_layernorm.weight")),
        wqkv=prep(torch.cat([take(state, n + ".weight") for n in qkv]), linear=True),
        bqkv=prep(torch.cat(biases)) if all(b is not None for b in biases) else None,
        wo=prep(take(state, p + "self_attn.o_proj.weight"), linear=True),
        mlp_norm=prep(take(state, p + "post_attention_layernorm.weight")),
        w13=prep(torch.cat([take(state, p + f"mlp.{n}_proj.weight") for n in ("gate", "up")]), linear=True),
        w2=prep(take(state, p + "mlp.down_proj.weight"), linear=True),
    )


def _weight_preparer(opts: NativeOptions, device: torch.device):
    def prep(t: torch.Tensor, linear: bool = False, head: bool = False) -> Weight:
        t = t.to(device=device, dtype=opts.dtype).contiguous()
        if not linear or opts.quant == WeightFormat.NONE:
            return t
        return quantize_int4(t) if opts.quant == WeightFormat.INT4 and not head else quantize_int8(t)

    return prep


def weight_nbytes(w: Weight | None) -> int:
    if w is None:
        return 0
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes


# ----------------------------------------------------------------------------- math


def linear(x: torch.Tensor, w: Weight, b: torch.Tensor | None = None, dense: bool = False) -> torch.Tensor:
    """x [..., K] @ w[N, K].T (+ b) -> [..., N]. ``dense``: a prefill, where a quantized
    weight may be dequantized for a float GEMM (faster than the int kernels at many rows)."""
    y = F.linear(x, w) if isinstance(w, torch.Tensor) else quant_linear(x, w, dense)
    return y if b is None else y + b


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Fast path: q [B, Hkv, M, D] (already scaled), k, v [B, Hkv, W, D], mask [B, 1, M, W]."""
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=1.0)


# ----------------------------------------------------------------------------- model


@dataclass(frozen=True)
class _Plan:
    """Per-forward attention metadata shared by all layers."""

    pool: NativeCachePool
    rows: tuple[int, ...]  # pool row of each batch row
    row_index: torch.Tensor  # [B] long
    starts: tuple[int, ...]  # cache length of each row = first written slot
    slots: torch.Tensor  # [B, Np] long, slots written by this forward
    window: int  # W: slots 0..W-1 are read
    cos: torch.Tensor  # [B, Np, 1, D/2] fp32 (1: broadcast over heads)
    sin: torch.Tensor  # [B, Np, 1, D/2] fp32
    invariant: bool
    dense: bool  # a prefill (more than max_rows tokens): quantized linears may run dequantized
    mask: torch.Tensor | None = None  # fast path: [B, 1, G * Np, W] bool
    n_shared: int = 0  # invariant path: chunks shared by all rows
    tail_idx: torch.Tensor | None = None  # invariant path: [B, Np, T] slot per virtual position
    tail_valid: torch.Tensor | None = None  # invariant path: [B, Np, T] bool


class NativeLlama(PooledLM):
    """``CausalLM`` backend: Llama-family decoder on plain tensors with a static cache."""

    description = "native"

    def __init__(self, args: LlamaArgs, embed: torch.Tensor, layers: tuple[LayerWeights, ...],
                 norm: torch.Tensor, lm_head: Weight, options: NativeOptions, info: ModelInfo,
                 head_rows: torch.Tensor | None = None):
        if options.max_rows < 1 or options.attn_chunk < 1:
            raise ValueError(f"max_rows and attn_chunk must be >= 1, got {options}")
        self.args, self.info = args, info
        self.embed, self.layers, self.norm, self.lm_head = embed, layers, norm, lm_head
        self.head_rows = head_rows  # token id of each lm_head row (None: all, in order)
        self._cos, self._sin = rope_tables(args, info.max_length, info.device)
        self._heads = torch.arange(args.n_kv_heads, device=info.device)
        self.options = options
        self.invariance = BatchInvariance(options, args, info.device, self._row_probes)

    @property
    def min_verify_rows(self) -> int:
        """Rows an invariant forward is padded to (``invariance.min_rows``): drafts below it are free."""
        return self.invariance.min_rows

    @property
    def exactness(self) -> Exactness:
        """Speculative greedy output == plain decoding, bit for bit, here? (``invariance``)"""
        return self.invariance.exactness

    # ---- construction

    @classmethod
    def from_hf_dir(cls, path: str | Path, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                    max_length: int | None = None, num_layers: int | None = None,
                    head_rows: torch.Tensor | None = None, **options) -> NativeLlama:
        """Load ``config.json`` + ``*.safetensors``. ``num_layers`` keeps only the first layers
        (a truncated self-drafter); ``head_rows`` keeps only those token ids' LM head rows
        (a draft's reduced vocabulary, FR-Spec: the other tokens get logit -inf);
        ``options``: fields of ``NativeOptions``."""
        path = Path(path)
        if not (path / "config.json").is_file():
            raise ModelError(f"{path} is not an HF model directory (no config.json)")
        cfg = json.loads((path / "config.json").read_text())
        LlamaArgs.from_hf_config(cfg)  # unsupported architectures fail before reading weights
        state = read_safetensors(path)
        return cls.from_state_dict(cfg, state, NativeOptions(dtype=dtype, **options), device, max_length,
                                   name=cfg.get("_name_or_path") or path.name, num_layers=num_layers,
                                   head_rows=head_rows)

    @classmethod
    def from_state_dict(cls, cfg: dict, state: dict[str, torch.Tensor], options: NativeOptions,
                        device: str | torch.device = "cpu", max_length: int | None = None,
                        name: str = "native-llama", num_layers: int | None = None,
                        head_rows: torch.Tensor | None = None) -> NativeLlama:
        """Build from an HF config dict and an HF-named state dict."""
        if num_layers is not None:
            if not 1 <= num_layers <= cfg["num_hidden_layers"]:
                raise ValueError(f"num_layers must be in [1, {cfg['num_hidden_layers']}], got {num_layers}")
            cfg, name = {**cfg, "num_hidden_layers": num_layers}, f"{name}[:{num_layers}]"
        args = LlamaArgs.from_hf_config(cfg)
        check_native(args, name)
        device = torch.device(device)
        prep = _weight_preparer(options, device)
        embed = prep(take(state, "model.embed_tokens.weight"))
        head = None if cfg.get("tie_word_embeddings", "lm_head.weight" not in state) else take(state, "lm_head.weight")
        info = ModelInfo(name=name, vocab_size=args.vocab_size, max_length=max_length or args.max_position,
                         bos_token_id=args.bos_token_id, eos_token_ids=args.eos_token_ids, hidden_size=args.dim,
                         dtype=options.dtype, device=device)
        layers = tuple(_layer_weights(state, i, prep) for i in range(args.n_layers))
        head = state["model.embed_tokens.weight"] if head is None else head
        if head_rows is not None:
            head_rows = torch.as_tensor(head_rows, dtype=torch.long)
            if head_rows.dim() != 1 or not len(head_rows) or not 0 <= int(head_rows.min()) <= int(head_rows.max()) < len(head):
                raise ValueError(f"head_rows must be a non-empty 1-D list of token ids in [0, {len(head)})")
            head, head_rows = head[head_rows], head_rows.to(device)
        lm_head = prep(head, linear=True, head=True)
        return cls(args, embed, layers, prep(take(state, "model.norm.weight")), lm_head, options, info, head_rows)

    def _row_probes(self) -> list[RowProbe]:
        """The row-wise kernels of a layer and the head, at their full shapes, to calibrate."""
        a, first, dtype = self.args, self.layers[0], self.options.dtype
        probes = [RowProbe(name, lambda x, w=w: linear(x, w), w.shape[1], dtype, _kernel_key(w))
                  for name, w in [("wqkv", first.wqkv), ("wo", first.wo), ("w13", first.w13),
                                  ("w2", first.w2), ("lm_head", self.lm_head)]]
        probes.append(RowProbe("rms_norm", lambda x: rms_norm(x, first.attn_norm, a.norm_eps), a.dim, dtype,
                               ("rms_norm", a.dim)))
        return probes

    @property
    def kv_dtype(self) -> torch.dtype:
        """Invariant attention computes in fp32: an fp32 cache (exact for bf16 values) saves
        converting the key window in every layer."""
        return torch.float32 if self.invariance.on else self.options.dtype

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights read per decode step (embedding rows excluded)."""
        per_layer = [weight_nbytes(w) for lw in self.layers for w in (lw.attn_norm, lw.wqkv, lw.bqkv, lw.wo, lw.mlp_norm, lw.w13, lw.w2)]
        return sum(per_layer) + weight_nbytes(self.norm) + weight_nbytes(self.lm_head)

    @property
    def resident_bytes(self) -> int:
        """What ``model_bytes`` counts: ``weight_bytes``."""
        return self.weight_bytes

    @property
    def formats(self) -> tuple[WeightFormat, ...]:
        return (self.options.quant,)

    # ---- forward (new_cache, new_cache_pool and one-row forward come from PooledLM)

    @torch.inference_mode()
    def forward_batch(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[NativeCache],
                      tree_masks: torch.Tensor | None = None, want_hidden: bool = False,
                      num_tokens: list[int] | None = None, last_logits_only: bool = False,
                      hidden_layers: tuple[int, ...] = ()) -> ModelOutput:
        """One forward over B requests of one pool. input_ids, positions [B, N];
        tree_masks [B, N, N] bool or None (causal). ``num_tokens[b] <= N`` real tokens in
        row b (the rest is padding: not cached, logits meaningless); default all N.
        ``last_logits_only``: logits [B, 1, V] of each row's last real token.
        ``hidden_layers``: also those decoder layers' outputs ([B, N, len * H], ``layers``)."""
        hidden_layers = check_hidden_layers(hidden_layers, self.args.n_layers)
        n_real = list(num_tokens) if num_tokens is not None else [input_ids.shape[1]] * len(caches)
        self.invariance.check_threads()
        self._validate(input_ids, positions, caches, tree_masks, n_real)
        n = input_ids.shape[1]
        invariant, n_pad = self.invariance.covers(n), self.invariance.padded_rows(n)
        ids, pos, tree = _pad_inputs(input_ids, positions, tree_masks, n_real, n_pad)
        plan = self._plan(caches, pos, tree, invariant)
        taps: dict[int, torch.Tensor] = {i: None for i in hidden_layers}
        hidden = self._run(ids, plan, taps)  # [B, Np, H]
        rows = (torch.arange(len(caches), device=hidden.device), torch.tensor(n_real, device=hidden.device) - 1)
        if last_logits_only and not invariant:  # a prefill: the head over one row per request
            logits = linear(hidden[rows][:, None], self.lm_head).float()  # [B, 1, V]
        else:  # all Np rows: the row count is part of invariance
            logits = linear(hidden, self.lm_head).float()
            logits = logits[rows][:, None] if last_logits_only else logits[:, :n]
        for cache, k in zip(caches, n_real):
            cache._advance(k)
        if self.head_rows is not None:  # scatter the reduced head's logits into the full vocabulary
            full = logits.new_full((*logits.shape[:-1], self.info.vocab_size), float("-inf"))
            logits = full.index_copy_(-1, self.head_rows, logits)
        layers = torch.cat([taps[i][:, :n] for i in hidden_layers], -1).float() if hidden_layers else None
        return ModelOutput(logits, hidden[:, :n].float() if want_hidden else None, layers)

    def _validate(self, ids, pos, caches, tree, n_real) -> None:
        self._check_batch(ids, pos, caches, tree, n_real)
        if int(pos.min()) < 0 or int(pos.max()) >= self._cos.shape[0]:
            raise ValueError(f"forward: positions must be in [0, {self._cos.shape[0]}), got [{int(pos.min())}, {int(pos.max())}]")

    def _plan(self, caches: list[NativeCache], pos: torch.Tensor, tree: torch.Tensor, invariant: bool) -> _Plan:
        b, n_pad = pos.shape
        dev, chunk = self.info.device, self.options.attn_chunk
        starts = tuple(c.length for c in caches)
        lengths = torch.tensor(starts, device=dev)[:, None]  # [B, 1]
        common = dict(pool=caches[0].pool, rows=tuple(c.row for c in caches),
                      row_index=torch.tensor([c.row for c in caches], device=dev), starts=starts,
                      slots=lengths + torch.arange(n_pad, device=dev), cos=self._cos[pos][:, :, None],
                      sin=self._sin[pos][:, :, None], dense=n_pad > self.options.max_rows)
        if invariant:
            n_shared = min(starts) // chunk
            size = round_up(max(starts) + n_pad, chunk) - n_shared * chunk
            idx, valid = tail_layout(tree, lengths, n_shared * chunk, size)  # [B, Np, T]
            return _Plan(**common, window=n_shared * chunk + size, invariant=True, n_shared=n_shared,
                         tail_idx=idx, tail_valid=valid)
        window = max(starts) + n_pad
        mask = window_mask(tree, lengths, window)  # [B, Np, W]
        g = self.args.group
        mask = mask[:, None].expand(b, g, n_pad, window).reshape(b, 1, g * n_pad, window)
        return _Plan(**common, window=window, invariant=False, mask=mask)

    def _run(self, ids: torch.Tensor, plan: _Plan, taps: dict[int, torch.Tensor | None]) -> torch.Tensor:
        """ids [B, Np] -> final-normed hidden [B, Np, H]; ``taps[i]`` gets layer i's output."""
        eps = self.args.norm_eps
        x = F.embedding(ids, self.embed)  # [B, Np, H]
        for i, lw in enumerate(self.layers):
            x = x + self._attention(rms_norm(x, lw.attn_norm, eps), lw, i, plan)
            x = x + self._mlp(rms_norm(x, lw.mlp_norm, eps), lw, plan.dense)
            if i in taps:
                taps[i] = x
        return rms_norm(x, self.norm, eps)

    def _mlp(self, h: torch.Tensor, lw: LayerWeights, dense: bool) -> torch.Tensor:
        gate, up = linear(h, lw.w13, dense=dense).chunk(2, dim=-1)  # [B, Np, I] each
        return linear(F.silu(gate) * up, lw.w2, dense=dense)

    def _attention(self, h: torch.Tensor, lw: LayerWeights, layer: int, plan: _Plan) -> torch.Tensor:
        a = self.args
        b, n, _ = h.shape
        d, hkv = a.head_dim, a.n_kv_heads
        q, k, v = linear(h, lw.wqkv, lw.bqkv, plan.dense).split([a.n_heads * d, hkv * d, hkv * d], dim=-1)
        q = apply_rope(q.view(b, n, a.n_heads, d), plan.cos, plan.sin)  # [B, Np, Hq, D]
        k = apply_rope(k.view(b, n, hkv, d), plan.cos, plan.sin)  # [B, Np, Hkv, D]
        self._write_kv(layer, k, v.view(b, n, hkv, d), plan)
        kw, vw = self._read_kv(layer, plan)  # [B, Hkv, W, D]
        q = q.view(b, n, hkv, a.group, d).permute(0, 2, 3, 1, 4) * d**-0.5  # [B, Hkv, G, Np, D]
        if plan.invariant:
            o = invariant_attention(q, kw, vw, plan.n_shared, plan.tail_idx, plan.tail_valid,
                                    self.options.attn_chunk, self.invariance.attn_min_rows)
        else:  # query heads sharing a kv head are folded into rows: [B, Hkv, G * Np, D]
            o = sdpa_attention(q.reshape(b, hkv, a.group * n, d), kw, vw, plan.mask)
        o = o.reshape(b, hkv, a.group, n, d).permute(0, 3, 1, 2, 4).reshape(b, n, a.n_heads * d)
        return linear(o, lw.wo, dense=plan.dense)

    def _write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, plan: _Plan) -> None:
        """k, v [B, Np, Hkv, D] -> pool slots ``plan.slots`` of rows ``plan.rows``."""
        kc, vc = plan.pool.k[layer], plan.pool.v[layer]  # [P, Hkv, S, D]
        if len(plan.rows) == 1:
            r, s, n = plan.rows[0], plan.starts[0], k.shape[1]
            kc[r, :, s:s + n] = k[0].transpose(0, 1)
            vc[r, :, s:s + n] = v[0].transpose(0, 1)
            return
        idx = (plan.row_index[:, None, None], self._heads[None, :, None], plan.slots[:, None, :])  # [B, Hkv, Np]
        kc.index_put_(idx, k.transpose(1, 2).to(kc.dtype))
        vc.index_put_(idx, v.transpose(1, 2).to(vc.dtype))

    def _read_kv(self, layer: int, plan: _Plan) -> tuple[torch.Tensor, torch.Tensor]:
        kc, vc = plan.pool.k[layer, :, :, :plan.window], plan.pool.v[layer, :, :, :plan.window]
        if len(plan.rows) == 1:
            r = plan.rows[0]
            return kc[r:r + 1], vc[r:r + 1]  # views, no copy
        return kc.index_select(0, plan.row_index), vc.index_select(0, plan.row_index)


# ----------------------------------------------------------------------------- helpers


def _pad_inputs(ids: torch.Tensor, pos: torch.Tensor, tree: torch.Tensor | None, n_real: list[int],
                n_pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad [B, N] inputs to [B, Np] with dummy rows; return ids, positions, tree [B, Np, Np].

    A dummy row (padding, or tokens past ``n_real[b]``) is token 0 at the row's last real
    position; it sees the cached slots and itself, and no real token sees it.
    """
    b, n = ids.shape
    dev = ids.device
    if tree is None:
        tree = torch.ones(n, n, dtype=torch.bool, device=dev).tril().expand(b, n, n)
    real = torch.arange(n_pad, device=dev)[None, :] < torch.tensor(n_real, device=dev)[:, None]  # [B, Np]
    full = torch.zeros(b, n_pad, n_pad, dtype=torch.bool, device=dev)
    full[:, :n, :n] = tree
    full &= real[:, :, None] & real[:, None, :]
    full |= torch.eye(n_pad, dtype=torch.bool, device=dev) & ~real[:, :, None]
    last = pos.gather(1, torch.tensor(n_real, device=dev)[:, None] - 1)  # [B, 1]
    pos_p = torch.where(real, F.pad(pos, (0, n_pad - n)), last)
    ids_p = torch.where(real, F.pad(ids, (0, n_pad - n)), 0)
    return ids_p.long(), pos_p.long(), full


def window_mask(tree: torch.Tensor, lengths: torch.Tensor, window: int) -> torch.Tensor:
    """Visibility of slots 0..W-1 for each new token: [B, Np, W] bool.

    Slot s is visible to new token i of row b iff s < length_b (cached) or s = length_b + j
    with tree[b, i, j] (new token j is an ancestor of i). Example: length 2, chain of 2,
    W = 5 -> rows [1 1 1 0 0], [1 1 1 1 0].
    """
    b, n, _ = tree.shape
    rel = torch.arange(window, device=tree.device)[None, :] - lengths  # [B, W] slot - length
    new = (rel >= 0) & (rel < n)
    from_tree = tree.gather(2, rel.clamp(0, n - 1)[:, None, :].expand(b, n, window))  # [B, Np, W]
    return (rel < 0)[:, None, :] | (from_tree & new[:, None, :])


def _kernel_key(w: Weight) -> tuple:
    """What selects a linear's kernel: the weight's type, dtype, shape and kernel flag."""
    if isinstance(w, torch.Tensor):
        return ("linear", w.dtype, tuple(w.shape))
    return ("linear", type(w).__name__, tuple(w.shape), w.packed_kernel)


NativeLlama.pool_class = NativeCachePool
