"""Compiled CPU runtime (``csrc/``): a whole Llama forward in one C++ call.

Python keeps the orchestration (drafters, verification, caches' bookkeeping); each forward
is one ``vs_forward`` call through ctypes, which releases the GIL. Weights stay in their
checkpoint's precision: a GGUF's blocks (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K, F32: the
format table of ``csrc/formats``) are read from the memory-mapped file itself and repacked
into 16-row panels (no fp32 copy; ``requantize`` re-encodes a draft's wider blocks to Q4_0);
HF checkpoints run in fp32 or are quantized at load (``quantize_matrix``). Activations are
quantized per 32-block to int8 (llama.cpp's Q8_1) for quantized weights; their K/V cache is
fp16 (rounded once when written, widened exactly when read).

**Bit-exact by construction.** Every output is one fixed sequence of IEEE operations that
depends only on the token's own inputs: products are vectorised across output rows, never
inside a reduction; integer block dots are exact; attention reduces over the token's own
keys (cached slots, then its root-to-node path) in that order. So a token's logits do not
depend on the other tokens of the forward, their layout, the thread count, or the ISA
(scalar, AVX2 and AVX-512 give the same bits). No calibration and no padding rows.

ISA: chosen at run time (``VERISPEC_ISA`` = auto, avx512, avx2 or scalar forces one).
Threads: a persistent pool, ``torch.get_num_threads()`` at load unless ``threads`` is given.

This module is the model (``CpuLlama``); the C interface (and the shapes it runs, ``supports``) is
``cpu_abi.py``, the K/V cache pool ``cpu_cache.py``, the preparation of weights (quantizing, a GGUF's
blocks read in place) ``cpu_weights.py``.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from verispec.memory import check_fits
from verispec.models.base import Exactness, ModelError, ModelInfo, ModelOutput, check_hidden_layers
from verispec.models.cache_pool import PooledLM
from verispec.models.cpu_abi import ERR_LEN, FORMATS, Batch, Config, DraftChain, Slot, i32, library, loaded, ptr, want_isa
from verispec.models.cpu_cache import CpuCache, CpuCachePool
from verispec.models.cpu_weights import (
    QUANTS,
    Linear,
    RawMatrix,
    check_head_rows,
    gguf_weights,
    layer_formats,
    state_dict_weights,
)
from verispec.models.formats import WeightFormat
from verispec.models.gguf_file import read_gguf
from verispec.models.llama import LlamaArgs, read_safetensors, rope_tables

if TYPE_CHECKING:
    from verispec.types import SamplingParams


class DraftedChain(NamedTuple):
    """``CpuLlama.draft_chain``'s answer: the drafts, the tokens appended to the cache (the feed
    and the drafts fed back: the last draft is not) and, for a sampled chain, the [drafts, V] q
    each draft was drawn from (None when greedy or nothing was drafted)."""

    drafts: list[int]
    fed: int
    q: torch.Tensor | None


def _check_rope_fits(args: LlamaArgs, positions: int) -> None:
    """RoPE tables grow with the context a model declares, not with its weights: a 4.7 MB GGUF
    declaring 2^24 positions of 64-value heads needs 10 GiB of them (angles, cos and sin here,
    cos and sin copied into the runtime). Refused in one line when this machine cannot hold them."""
    try:
        check_fits(5 * 4 * positions * (args.head_dim // 2), f"the RoPE tables of a {positions:,}-token context",
                   "the model declares a longer context (GGUF context_length) than this machine can hold")
    except ValueError as err:
        raise ModelError(str(err)) from None


class CpuLlama(PooledLM):
    """``CausalLM`` backend on the compiled runtime (Llama-family decoders)."""

    # a token's K/V depends only on its own inputs (module docstring), not on how the prompt
    # was split into forwards: a reused prefix plus the rest is bitwise one prefill (tested)
    prefix_reuse_exact = True
    # the engine runs a step's torch glue on one thread: the runtime's own pool does the work
    host_torch_threads = 1
    # a draft model's greedy chain runs in one call (draft_chain)
    chain_drafting = True

    def __init__(self, args: LlamaArgs, weights: dict, info: ModelInfo, isa: str | None = None,
                 threads: int | None = None, kv_dtype: torch.dtype | None = None,
                 head_rows: torch.Tensor | None = None):
        lib = library()
        n_rope = 2 if args.local_rope_theta is not None else 1  # RoPE tables: global, and local (sliding layers)
        _check_rope_fits(args, n_rope * info.max_length)  # refused before anything is built
        self.args, self.info = args, info
        # the formats of its layers' matrices, as they came (the head and embedding may differ)
        self.formats = layer_formats(weights)
        # a reduced LM head (a draft's, FR-Spec): the token id of each head row; logits of
        # other tokens are -inf. The runtime computes args.vocab_size = len(head_rows) rows.
        self.head_rows = head_rows
        self._head_ids = None if head_rows is None else i32(head_rows)  # as draft_chain passes them
        self.gguf_path: Path | None = None
        # a quantized model keeps fp16 K/V (half the attention traffic, as llama.cpp does); fp32 stays fp32
        self.kv_dtype = kv_dtype or (torch.float32 if self.formats == (WeightFormat.F32,) else torch.float16)
        if self.kv_dtype not in (torch.float32, torch.float16):
            raise ValueError(f"kv_dtype must be torch.float32 or torch.float16, got {self.kv_dtype}")
        embed = weights.get("embed")  # an untied input embedding may have more rows than the head (EAGLE heads)
        self._embed_ref = weights.get("embed_ref")  # by reference (a mapped GGUF): kept alive with the model
        embed = embed if self._embed_ref is None else self._embed_ref
        embed_parts = [] if embed is None else embed if isinstance(embed, list) else [embed]
        # resident bytes of the input embedding (by reference: only the looked-up rows' pages)
        self._embed_bytes = 0 if self._embed_ref is not None else sum(int(np.asarray(p.data).nbytes) for p in embed_parts)
        self._cfg = Config(args.vocab_size, args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.head_dim,
                            args.intermediate_size, info.max_length, args.norm_eps, int(self.kv_dtype == torch.float16),
                            args.vocab_size if embed is None else sum(p.rows for p in embed_parts),
                            int(args.activation == "gelu_tanh"), n_rope, args.embed_scale, args.attn_scale or 0.0,
                            args.logit_softcap)
        tables = [rope_tables(args, info.max_length, torch.device("cpu"), local=i == 1) for i in range(n_rope)]
        cos, sin = (torch.cat([t[j] for t in tables]).contiguous() for j in (0, 1))  # [n_rope * max_pos, D / 2]
        err = ctypes.create_string_buffer(ERR_LEN)
        threads = threads or torch.get_num_threads()
        handle = lib.vs_model_new(ctypes.byref(self._cfg), ptr(cos, ctypes.c_float), ptr(sin, ctypes.c_float),
                                  want_isa(isa), threads, err, ERR_LEN)
        if not handle:
            raise ModelError(f"compiled runtime: {err.value.decode()}")
        self._h = ctypes.c_void_p(handle)
        try:
            self._set_all(weights)
        except BaseException:
            self._free()
            raise

    def _set_all(self, weights: dict) -> None:
        for i, layer in enumerate(weights["layers"]):
            self._set(i, Slot.ATTN_NORM, layer["attn_norm"])
            self._set(i, Slot.FFN_NORM, layer["ffn_norm"])
            for slot, name in ((Slot.WQKV, "wqkv"), (Slot.WO, "wo"), (Slot.W13, "w13"), (Slot.W2, "w2")):
                self._set(i, slot, layer[name], layer.get(name + "_bias"))
            self._set_layer(i, layer)
        self._set(-1, Slot.NORM, weights["norm"])
        if weights.get("embed") is not None:
            self._set(-1, Slot.EMBED, weights["embed"])
        if self._embed_ref is not None:
            ref, err = self._embed_ref, ctypes.create_string_buffer(ERR_LEN)
            if library().vs_model_set_embed_ref(self._h, ref.fmt.ggml_type, ref.data.ctypes.data, ref.rows,
                                                ref.cols, err, ERR_LEN):
                raise ModelError(f"compiled runtime, embedding: {err.value.decode()}")
        self._set(-1, Slot.HEAD, weights["head"])
        if weights.get("in_proj") is not None:  # feature input (EAGLE heads): forward_slots(feats=...)
            self._set(-1, Slot.IN_PROJ, weights["in_proj"], weights.get("in_proj_bias"))
        if weights.get("in_norm") is not None:
            self._set(-1, Slot.IN_NORM, weights["in_norm"])
        err = ctypes.create_string_buffer(ERR_LEN)
        if library().vs_model_finish(self._h, err, ERR_LEN):
            raise ModelError(f"compiled runtime: {err.value.decode()}")

    def _set_layer(self, i: int, layer: dict) -> None:
        """Layer ``i``'s window, RoPE table and optional norms (Q/K norms, post-norms: ``LlamaArgs``)."""
        a = self.args
        if not (a.layer_windows or a.qk_norm or a.post_norms):
            return  # a Llama layer: the runtime's defaults
        norms = [layer.get(n) for n in ("q_norm", "k_norm", "post_attn_norm", "post_ffn_norm")]
        keep = [None if v is None else v.float().contiguous() for v in norms]
        err = ctypes.create_string_buffer(ERR_LEN)
        if library().vs_model_set_layer(self._h, i, a.layer_windows[i] if a.layer_windows else 0, a.layer_rope(i),
                                        *(None if v is None else ptr(v, ctypes.c_float) for v in keep), err, ERR_LEN):
            raise ModelError(f"compiled runtime, layer {i}: {err.value.decode()}")

    def _set(self, layer: int, slot: Slot, w: Linear | torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """One tensor; a list of row blocks is set part by part (the bias split by their rows)."""
        if isinstance(w, torch.Tensor):  # a norm vector
            w = RawMatrix(WeightFormat.F32, w.float().contiguous().numpy(), 1, w.numel())
        parts = w if isinstance(w, list) else [w]
        b = None if bias is None else bias.float().contiguous()
        row = 0
        for part in parts:
            fmt = FORMATS.get(part.fmt)
            if fmt is None:
                raise ModelError(f"compiled runtime, layer {layer} tensor {slot.name.lower()}: format {part.fmt} is not "
                                 f"supported (formats: {', '.join(FORMATS)})")
            data = np.ascontiguousarray(part.data)
            if data.nbytes != part.rows * fmt.row_bytes(part.cols) and part.cols % fmt.block == 0:
                raise ModelError(f"compiled runtime, layer {layer} tensor {slot.name.lower()}: {data.nbytes} bytes for "
                                 f"[{part.rows}, {part.cols}] {part.fmt}")
            pb = None if b is None else b[row:row + part.rows].contiguous()
            err = ctypes.create_string_buffer(ERR_LEN)
            rc = library().vs_model_set(self._h, layer, int(slot), part.fmt.ggml_type, data.ctypes.data, part.rows, part.cols,
                                        None if pb is None else ptr(pb, ctypes.c_float), err, ERR_LEN)
            if rc:
                raise ModelError(f"compiled runtime, layer {layer} tensor {slot.name.lower()}: {err.value.decode()}")
            if part.release is not None:
                part.release()
            row += part.rows

    def new_cache_pool(self, rows: int, max_length: int | None = None) -> CpuCachePool:
        """``rows`` caches of ``max_length`` slots each, held from the start; without a length, of
        the model's whole context, grown as used (``CpuCachePool``)."""
        return CpuCachePool(self, rows, max_length or self.info.max_length, grow=max_length is None)

    def _free(self) -> None:
        """Free the runtime's model exactly once: the handle is cleared before it is freed, so a
        load that failed (freed here at once) is not freed again when the object is collected."""
        h, self._h = getattr(self, "_h", None), None
        lib = loaded()
        if h is not None and lib is not None:
            lib.vs_model_free(h)

    def __del__(self):
        self._free()

    # ---- construction

    @classmethod
    def from_hf_dir(cls, path: str | Path, max_length: int | None = None, quant: WeightFormat | str = WeightFormat.F32,
                    gguf: str | Path | None = None, num_layers: int | None = None, **kw) -> CpuLlama:
        """Load an HF dir (config + safetensors), in fp32 or quantized at load to ``quant``
        (q8_0, q4_1, q4_0); or, with ``gguf``, the weights from that GGUF file's own blocks
        (the HF dir then only gives the config). ``num_layers``: keep the first layers;
        ``head_rows`` (not with ``gguf``): keep only those token ids' LM-head rows."""
        path = Path(path)
        if not (path / "config.json").is_file():
            raise ModelError(f"{path} is not an HF model directory (no config.json)")
        cfg = json.loads((path / "config.json").read_text())
        LlamaArgs.from_hf_config(cfg)
        name = cfg.get("_name_or_path") or path.name
        if num_layers is not None:  # the first layers only: a truncated self-drafter
            if not 1 <= num_layers <= cfg["num_hidden_layers"]:
                raise ValueError(f"num_layers must be in [1, {cfg['num_hidden_layers']}], got {num_layers}")
            cfg, name = {**cfg, "num_hidden_layers": num_layers}, f"{name}[:{num_layers}]"
        if gguf is not None:
            if kw.get("head_rows") is not None:
                raise ValueError("a reduced LM head (head_rows) is built from safetensors weights, not a GGUF file")
            model = cls.from_weights(cfg, gguf_weights(read_gguf(Path(gguf)), cfg), max_length, name=name, **kw)
            model.gguf_path = Path(gguf)
            return model
        return cls.from_state_dict(cfg, read_safetensors(path), max_length, quant=quant, name=name, **kw)

    @classmethod
    def from_state_dict(cls, cfg: dict, state: dict[str, torch.Tensor], max_length: int | None = None,
                        quant: WeightFormat | str = WeightFormat.F32, name: str = "cpu-llama", **kw) -> CpuLlama:
        """From an HF config dict and HF-named tensors, quantized at load to ``quant`` (one of QUANTS)."""
        weights = state_dict_weights(cfg, state, WeightFormat.parse(quant, QUANTS), kw.get("head_rows"))
        return cls.from_weights(cfg, weights, max_length, name=name, **kw)

    @classmethod
    def from_weights(cls, cfg: dict, weights: dict, max_length: int | None, name: str,
                     head_rows: torch.Tensor | None = None, **kw) -> CpuLlama:
        args = LlamaArgs.from_hf_config(cfg)
        info = ModelInfo(name=name, vocab_size=args.vocab_size, max_length=max_length or args.max_position,
                         bos_token_id=args.bos_token_id, eos_token_ids=args.eos_token_ids, hidden_size=args.dim,
                         dtype=torch.float32, device=torch.device("cpu"))
        if head_rows is not None:
            head_rows = check_head_rows(head_rows, args.vocab_size)
            args = replace(args, vocab_size=len(head_rows))
        return cls(args, weights, info, head_rows=head_rows, **kw)

    # ---- facts

    @property
    def isa(self) -> str:
        return library().vs_model_isa(self._h).decode()

    @property
    def threads(self) -> int:
        return library().vs_model_threads(self._h)

    def set_threads(self, n: int) -> None:
        if n < 1 or library().vs_model_set_threads(self._h, n):
            raise ValueError(f"threads must be >= 1, got {n}")

    @property
    def weight_bytes(self) -> int:
        """Bytes of repacked weights read per decode step (embedding rows excluded)."""
        return int(library().vs_model_weight_bytes(self._h))

    @property
    def resident_bytes(self) -> int:
        """``weight_bytes`` plus an untied input embedding (its rows are read one per token)."""
        return self.weight_bytes + self._embed_bytes

    @property
    def exactness(self) -> Exactness:
        """Always bit-exact: one fixed reduction order per output (module docstring), tested bitwise."""
        return Exactness(True, f"compiled CPU runtime ({self.isa}): fixed reduction order per token, by construction")

    @property
    def description(self) -> str:
        return f"compiled CPU runtime ({self.quant}, {self.isa}, {self.threads} threads)"

    # ---- forward (new_cache, new_cache_pool and one-row forward come from PooledLM)

    def forward_batch(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[CpuCache],
                      tree_masks: torch.Tensor | None = None, want_hidden: bool = False,
                      num_tokens: list[int] | None = None, last_logits_only: bool = False,
                      hidden_layers: tuple[int, ...] = ()) -> ModelOutput:
        """One forward over B requests of one pool. input_ids, positions [B, N]; tree_masks
        [B, N, N] bool (True = may attend; each token must see itself and only earlier
        tokens) or None (causal). ``num_tokens[b] <= N`` real tokens in row b (the rest is
        padding: not run, logits zero). ``last_logits_only``: logits [B, 1, V] of each
        row's last real token. ``hidden_layers``: also return those decoder layers' output
        residual streams, concatenated ([B, N, len * H], ``ModelOutput.layers``)."""
        b, n = (input_ids.shape if input_ids.dim() == 2 else (0, 0))
        n_real = list(num_tokens) if num_tokens is not None else [n] * len(caches)
        self._validate(input_ids, positions, caches, tree_masks, n_real)
        caches[0].pool.reserve(max(c.length + k for c, k in zip(caches, n_real)))
        # flat per-token arrays, built in numpy: small torch ops here would wake torch's
        # OpenMP threads, which then spin on the cores the runtime's own threads need
        ids_np, pos_np = input_ids.cpu().numpy(), positions.cpu().numpy()
        masks_np = None if tree_masks is None else tree_masks.cpu().numpy()
        seq, slot, vis, counts = [], [], [], []
        for r, (cache, k) in enumerate(zip(caches, n_real)):
            start = cache.length
            seq.append(np.full(k, r))
            slot.append(np.arange(start, start + k))
            mask = np.tri(k, dtype=bool) if masks_np is None else masks_np[r, :k, :k]
            rows_i, cols_j = np.nonzero(mask)  # row-major: each token's visible tokens, ascending
            vis.append(cols_j + start)
            counts.append(np.bincount(rows_i, minlength=k))
        total = sum(n_real)
        vis_off = np.concatenate([[0], np.cumsum(np.concatenate(counts))])
        logit_tokens = np.cumsum(n_real) - 1 if last_logits_only else np.arange(total)
        logits = torch.empty(len(logit_tokens), self.args.vocab_size)
        hidden = torch.empty(total, self.args.dim) if want_hidden else None
        layer_ids = i32(check_hidden_layers(hidden_layers, self.args.n_layers))
        layers = torch.empty(total, len(layer_ids) * self.args.dim) if len(layer_ids) else None
        pool = caches[0].pool
        keep = [i32(a) for a in (np.concatenate([ids_np[r, :k] for r, k in enumerate(n_real)]),
                                    np.concatenate([pos_np[r, :k] for r, k in enumerate(n_real)]),
                                    np.concatenate(seq), np.concatenate(slot), vis_off, np.concatenate(vis),
                                    [c.row for c in caches], [c.length for c in caches], logit_tokens)]
        batch = Batch(total, *(ptr(t) for t in keep[:6]), len(caches), ptr(keep[6]), ptr(keep[7]),
                       pool.k.data_ptr(), pool.v.data_ptr(), pool.rows, pool.slots,
                       len(logit_tokens), ptr(keep[8]), ptr(logits, ctypes.c_float),
                       None if hidden is None else ptr(hidden, ctypes.c_float), len(layer_ids), ptr(layer_ids),
                       None if layers is None else ptr(layers, ctypes.c_float))
        err = ctypes.create_string_buffer(ERR_LEN)
        if library().vs_forward(self._h, ctypes.byref(batch), err, ERR_LEN):
            raise ValueError(f"forward: {err.value.decode()}")
        for cache, k in zip(caches, n_real):
            cache._advance(k)
        logits = self._full_vocab(logits)
        return ModelOutput(self._unflatten(logits, n_real, 1 if last_logits_only else n, last_logits_only),
                           None if hidden is None else self._unflatten(hidden, n_real, n, False),
                           None if layers is None else self._unflatten(layers, n_real, n, False))

    def forward_slots(self, pool: CpuCachePool, row: int, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                      visible: list[np.ndarray], cached: int, feats: torch.Tensor | None = None,
                      hidden_layers: tuple[int, ...] = (), want_hidden: bool = False,
                      logit_rows: np.ndarray | None = None) -> ModelOutput:
        """One forward of T tokens of one sequence at explicit cache slots (a drafter's own
        cache, e.g. an EAGLE head's draft tree): token t writes its K/V to ``slots[t]`` and
        attends to slots ``0 .. cached-1`` then ``visible[t]`` (ascending slots >= cached,
        ending with its own), so earlier draft nodes written by previous calls stay readable
        without a cache rollback. ``feats`` [T, H]: feature input of a model built with
        ``in_proj`` (``x = in_proj @ [in_norm(feat) ; embed(id)]``). Returns logits [T, V]
        of ``logit_rows`` (default all) and, for ``hidden_layers``, those layers' outputs
        [T, len * H], for ``want_hidden`` the final-normed hidden states [T, H]; the pool's
        lengths are not touched (the caller owns the slots)."""
        t = len(ids)
        pool.reserve(max(cached, int(np.max(slots, initial=-1)) + 1))
        vis_off = np.concatenate([[0], np.cumsum([len(v) for v in visible])])
        keep = [i32(a) for a in (ids, positions, np.zeros(t), slots, vis_off, np.concatenate(visible), [row], [cached],
                                    np.arange(t) if logit_rows is None else logit_rows)]
        logits = torch.empty(len(keep[8]), self.args.vocab_size)
        hidden = torch.empty(t, self.args.dim) if want_hidden else None
        layer_ids = i32(check_hidden_layers(hidden_layers, self.args.n_layers))
        layers = torch.empty(t, len(layer_ids) * self.args.dim) if len(layer_ids) else None
        f = None if feats is None else feats.float().contiguous()
        if f is not None and tuple(f.shape) != (t, self.args.dim):
            raise ValueError(f"feats must be [{t}, {self.args.dim}], got {tuple(f.shape)}")
        batch = Batch(t, *(ptr(a) for a in keep[:6]), 1, ptr(keep[6]), ptr(keep[7]), pool.k.data_ptr(),
                       pool.v.data_ptr(), pool.rows, pool.slots, len(keep[8]), ptr(keep[8]), ptr(logits, ctypes.c_float),
                       None if hidden is None else ptr(hidden, ctypes.c_float),
                       len(layer_ids), ptr(layer_ids), None if layers is None else ptr(layers, ctypes.c_float),
                       None if f is None else ptr(f, ctypes.c_float))
        err = ctypes.create_string_buffer(ERR_LEN)
        if library().vs_forward(self._h, ctypes.byref(batch), err, ERR_LEN):
            raise ValueError(f"forward: {err.value.decode()}")
        return ModelOutput(self._full_vocab(logits), hidden, layers)

    def draft_chain(self, cache: CpuCache, feed: list[int], budget: int, min_confidence: float = 0.0,
                    cost: tuple[float, list[float]] | None = None,
                    sampled: tuple[SamplingParams, Sequence[float]] | None = None) -> DraftedChain:
        """A draft chain in one call (csrc/draft_chain.cpp): append ``feed`` (the tokens the cache
        lacks, the chain's root last) to ``cache``, then draft the next token and feed it back
        while the stop rule of ``DraftModelDrafter`` keeps going: at most ``budget`` tokens,
        none while the draft's top probability is below ``min_confidence`` (0: off), and with
        ``cost`` = (one draft forward, [t(0) .. t(budget + 1)]) in target steps, only tokens
        that raise the expected tokens per unit time. Greedy: the argmax tokens. ``sampled`` =
        (params, ``budget`` uniforms in [0, 1)): draft i is drawn with uniform i from q, the
        draft's logits processed by ``params`` as ``sampling.process_logits`` does, and the
        chain's q rows come back over the whole vocabulary (a reduced head's other tokens 0)."""
        if not isinstance(cache, CpuCache) or cache.pool.owner is not self:
            raise ValueError("draft_chain: the cache must be a CpuCache of a pool created by this model")
        if not feed or budget < 0:
            raise ValueError(f"draft_chain: needs tokens to feed (the chain's root at least) and budget >= 0, "
                             f"got {len(feed)} and {budget}")
        if cost is not None and len(cost[1]) < budget + 2:
            raise ValueError(f"draft_chain: the cost rule needs t(0) .. t({budget + 1}), got {len(cost[1])} values")
        if sampled is not None and (sampled[0].greedy or len(sampled[1]) < budget):
            raise ValueError(f"draft_chain: a sampled chain needs a temperature > 0 and {budget} uniforms, got "
                             f"{sampled[0].temperature} and {len(sampled[1])}")
        if cache.length + len(feed) + budget > cache.max_length:
            raise ValueError(f"draft_chain: cache overflow: {cache.length} cached + {len(feed)} fed + {budget} "
                             f"drafted > max_length {cache.max_length}")
        pool = cache.pool
        pool.reserve(cache.length + len(feed) + budget)
        ids = i32(feed)
        verify = np.ascontiguousarray(cost[1] if cost else [0.0], dtype=np.float64)
        drafts = np.zeros(max(budget, 1), dtype=np.int32)
        params, uniforms = sampled if sampled is not None else (None, [0.0])
        u = np.ascontiguousarray(uniforms, dtype=np.float64)
        q = np.empty((max(budget, 1), self.args.vocab_size) if params else (1, 1), dtype=np.float32)
        chain = DraftChain(len(ids), ptr(ids), cache.row, cache.length, pool.k.data_ptr(), pool.v.data_ptr(), pool.rows,
                           pool.slots, budget, min_confidence, int(cost is not None), cost[0] if cost else 0.0,
                           ptr(verify, ctypes.c_double), None if self._head_ids is None else ptr(self._head_ids), ptr(drafts),
                           0, 0, params.temperature if params else 0.0, params.min_p if params else 0.0,
                           params.top_p if params else 1.0, self._head_top_k(params) if params else 0,
                           ptr(u, ctypes.c_double),
                           ptr(q, ctypes.c_float))
        err = ctypes.create_string_buffer(ERR_LEN)
        if library().vs_draft_chain(self._h, ctypes.byref(chain), err, ERR_LEN):
            raise ValueError(err.value.decode())
        cache._advance(chain.n_fed)
        n = chain.n_drafts
        return DraftedChain(drafts[:n].tolist(), chain.n_fed,
                            self._full_vocab(torch.from_numpy(q[:n]), fill=0.0) if params and n else None)

    def draft_sample(self, logits: torch.Tensor, params: SamplingParams, u: float) -> tuple[int, torch.Tensor] | None:
        """One draft of a sampled chain from this model's [V] ``logits`` with uniform ``u``: the token
        and its q over the vocabulary, by ``draft_chain``'s law and draw (the same bits, for the
        same logits); None when the logits name no token (``draft_chain`` ends the chain there)."""
        rows = np.ascontiguousarray((logits if self.head_rows is None else logits[self.head_rows]).float().numpy())
        q = np.empty(len(rows), dtype=np.float32)
        r = library().vs_draft_law(len(rows), ptr(rows, ctypes.c_float), params.temperature, params.min_p,
                                   params.top_p, self._head_top_k(params), u, ptr(q, ctypes.c_float))
        if r < 0:
            return None
        token = r if self.head_rows is None else int(self.head_rows[r])
        return token, self._full_vocab(torch.from_numpy(q)[None], 0.0)[0]

    def _head_top_k(self, params: SamplingParams) -> int:
        """top_k for the runtime's int32: 0 (off) where it keeps every head row anyway (any top_k a request sends)."""
        return params.top_k if params.top_k < self.args.vocab_size else 0

    def _full_vocab(self, logits: torch.Tensor, fill: float = float("-inf")) -> torch.Tensor:
        """[T, head rows] -> [T, V]: a reduced head's logits (or probabilities) scattered, ``fill`` elsewhere."""
        if self.head_rows is None:
            return logits
        full = logits.new_full((len(logits), self.info.vocab_size), fill)
        return full.index_copy_(-1, self.head_rows, logits)

    @staticmethod
    def _unflatten(flat: torch.Tensor, n_real: list[int], n: int, last_only: bool) -> torch.Tensor:
        """[sum(n_real) or B, X] -> [B, n, X], zero rows for padding."""
        if last_only:
            return flat[:, None]
        if all(k == n for k in n_real):  # no padding: a view (a copy of [B, N, V] would wake torch's threads)
            return flat.view(len(n_real), n, flat.shape[-1])
        out = flat.new_zeros(len(n_real), n, flat.shape[-1])
        offset = 0
        for r, k in enumerate(n_real):
            out[r, :k] = flat[offset:offset + k]
            offset += k
        return out

    def _validate(self, ids, pos, caches, tree, n_real) -> None:
        """Shapes and caches here; token ids, positions and the tree's shape (each token sees
        itself and only earlier tokens) are checked by ``vs_forward`` before it writes anything."""
        self._check_batch(ids, pos, caches, tree, n_real)


CpuLlama.pool_class = CpuCachePool
