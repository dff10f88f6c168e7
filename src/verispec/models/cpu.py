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
"""

from __future__ import annotations

import ctypes
import enum
import importlib.util
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from verispec.models.cache_pool import CachePool, PooledCache, PooledLM
from verispec.models.base import Exactness, ModelError, ModelInfo, ModelOutput, check_hidden_layers
from verispec.models.formats import WeightFormat
from verispec.models.llama import SUPPORTED_MODEL_TYPES, LlamaArgs, read_safetensors, rope_tables, take
from verispec.memory import check_fits

SLOT_TILE = 64  # K cache slots per transposed tile (csrc/vs.h: KV_TILE)
GROW_FROM = 4 * SLOT_TILE  # slots a growing cache pool starts with
PANEL_ROWS = 16  # rows per weight panel (csrc/vs.h: PANEL)
ABI_VERSION = 2  # csrc/vs.h: ABI_VERSION
_ERR = 512


class Slot(enum.IntEnum):
    """Tensor slots of the runtime (csrc/vs.h: enum Slot)."""

    ATTN_NORM = 0
    FFN_NORM = 1
    WQKV = 2
    WO = 3
    W13 = 4
    W2 = 5
    NORM = 6
    EMBED = 7
    HEAD = 8
    IN_PROJ = 9
    IN_NORM = 10


# ----------------------------------------------------------------------------- the library


class _Config(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int32) for n in ("vocab", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn",
                                              "max_pos")] + [("eps", ctypes.c_float), ("kv16", ctypes.c_int32),
                                                                 ("embed_rows", ctypes.c_int32)]


_P = ctypes.POINTER


class _Batch(ctypes.Structure):
    _fields_ = [("T", ctypes.c_int32), ("ids", _P(ctypes.c_int32)), ("pos", _P(ctypes.c_int32)),
                ("seq", _P(ctypes.c_int32)), ("slot", _P(ctypes.c_int32)), ("vis_off", _P(ctypes.c_int32)),
                ("vis", _P(ctypes.c_int32)), ("n_seqs", ctypes.c_int32), ("seq_row", _P(ctypes.c_int32)),
                ("seq_cached", _P(ctypes.c_int32)), ("kcache", ctypes.c_void_p), ("vcache", ctypes.c_void_p),
                ("cache_rows", ctypes.c_int32), ("cache_slots", ctypes.c_int32), ("n_logits", ctypes.c_int32),
                ("logit_tokens", _P(ctypes.c_int32)), ("logits", _P(ctypes.c_float)), ("hidden", _P(ctypes.c_float)),
                ("n_layer_out", ctypes.c_int32), ("layer_ids", _P(ctypes.c_int32)), ("layer_out", _P(ctypes.c_float)),
                ("feat", _P(ctypes.c_float))]


_LIB: ctypes.CDLL | None = None
_LIB_ERROR: str | None = None


def _load_library() -> ctypes.CDLL:
    spec = importlib.util.find_spec("verispec._vscpu")
    if spec is None or not spec.origin:
        raise OSError("the compiled runtime verispec._vscpu was not built (pip install needs gcc/g++ for it)")
    lib = ctypes.CDLL(spec.origin)
    c_err = (ctypes.c_char_p, ctypes.c_int)
    lib.vs_isa_name.restype = ctypes.c_char_p
    lib.vs_isa_name.argtypes = (ctypes.c_char_p, *c_err)
    lib.vs_model_new.restype = ctypes.c_void_p
    lib.vs_model_new.argtypes = (_P(_Config), _P(ctypes.c_float), _P(ctypes.c_float), ctypes.c_char_p, ctypes.c_int, *c_err)
    lib.vs_model_free.argtypes = (ctypes.c_void_p,)
    lib.vs_model_isa.restype = ctypes.c_char_p
    lib.vs_model_isa.argtypes = (ctypes.c_void_p,)
    lib.vs_model_threads.argtypes = (ctypes.c_void_p,)
    lib.vs_model_set_threads.argtypes = (ctypes.c_void_p, ctypes.c_int)
    lib.vs_model_set.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                 ctypes.c_int, _P(ctypes.c_float), *c_err)
    lib.vs_model_finish.argtypes = (ctypes.c_void_p, *c_err)
    lib.vs_model_set_embed_ref.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                           *c_err)
    lib.vs_model_weight_bytes.restype = ctypes.c_size_t
    lib.vs_model_weight_bytes.argtypes = (ctypes.c_void_p,)
    lib.vs_forward.argtypes = (ctypes.c_void_p, _P(_Batch), *c_err)
    lib.vs_cache_move.argtypes = (_P(_Config), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_int, _P(ctypes.c_int32), ctypes.c_int, ctypes.c_int)
    lib.vs_requantize_q4_0.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                       ctypes.c_int, *c_err)
    _check_abi(lib, spec.origin)
    return lib


def _check_abi(lib: ctypes.CDLL, origin: str) -> None:
    """A stale or mismatched build fails loudly: version, struct sizes, slots and formats."""
    try:
        lib.vs_abi_sizeof.restype = ctypes.c_size_t
        lib.vs_abi_sizeof.argtypes = (ctypes.c_int,)
        lib.vs_formats.argtypes = (ctypes.c_char_p, ctypes.c_int)
        got = (lib.vs_abi_version(), lib.vs_abi_sizeof(0), lib.vs_abi_sizeof(1), lib.vs_abi_slots())
    except AttributeError:
        got = None
    want = (ABI_VERSION, ctypes.sizeof(_Config), ctypes.sizeof(_Batch), len(Slot))
    if got != want:
        raise OSError(f"the compiled runtime {origin} does not match this verispec (ABI {got}, expected {want}): "
                      "rebuild it with `pip install -e .`")
    buf = ctypes.create_string_buffer(4096)
    lib.vs_formats(buf, len(buf))
    FORMATS.clear()
    for item in buf.value.decode().split(","):  # the C table's border: ggml type ids -> WeightFormat
        name, gtype, block, nbytes = item.split(":")
        fmt = WeightFormat.from_ggml_type(int(gtype))
        if fmt is None or fmt != name:
            raise OSError(f"the compiled runtime {origin} has format {name} (ggml type {gtype}), which this verispec "
                          "does not name: rebuild it with `pip install -e .`")
        FORMATS[fmt] = RuntimeFormat(fmt, int(block), int(nbytes))


@dataclass(frozen=True)
class RuntimeFormat:
    """A weight format the runtime computes with (csrc/formats/table.cpp) and its block size."""

    fmt: WeightFormat
    block: int  # weights per block
    block_bytes: int

    @property
    def ggml_type(self) -> int:
        return self.fmt.ggml_type

    def row_bytes(self, cols: int) -> int:
        return cols // self.block * self.block_bytes


FORMATS: dict[WeightFormat, RuntimeFormat] = {}  # filled from the library at load


def library() -> ctypes.CDLL:
    """The compiled runtime, or OSError saying why it is unavailable."""
    global _LIB, _LIB_ERROR
    if _LIB is None and _LIB_ERROR is None:
        try:
            _LIB = _load_library()
        except OSError as err:
            _LIB_ERROR = str(err)
    if _LIB is None:
        raise OSError(_LIB_ERROR)
    return _LIB


# what a missing runtime costs and how to get it back: said once per process (`verispec info` says it too)
MISSING_FIX = ("running the PyTorch runtime instead, 30-100x slower on CPU. Fix: install gcc and g++ "
               "(e.g. `apt install g++`), then `pip install --force-reinstall --no-deps verispec` "
               "(in a checkout: `pip install -e .`)")


def available() -> bool:
    """Is the compiled runtime built? If not, say so once: one line on stderr (a log record
    of the ``verispec`` logger) with the slowdown and the fix."""
    try:
        library()
        return True
    except OSError as err:
        if not getattr(available, "_warned", False):
            available._warned = True
            logging.getLogger("verispec").warning("verispec: %s; %s", err, MISSING_FIX)
        return False


def isa_name(want: str | None = None) -> str:
    """The ISA the runtime would use: ``want`` or ``$VERISPEC_ISA`` or auto (widest supported)."""
    err = ctypes.create_string_buffer(_ERR)
    name = library().vs_isa_name(_want_isa(want), err, _ERR)
    if name is None:
        raise ValueError(err.value.decode())
    return name.decode()


def _want_isa(want: str | None) -> bytes:
    return (want or os.environ.get("VERISPEC_ISA") or "auto").encode()


def _ptr(t: torch.Tensor | np.ndarray, ctype=ctypes.c_int32):
    addr = t.data_ptr() if isinstance(t, torch.Tensor) else t.ctypes.data
    return ctypes.cast(addr, _P(ctype))


def _i32(values) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.int32)


# ----------------------------------------------------------------------------- weights


@dataclass(frozen=True)
class RawMatrix:
    """A row-major weight matrix in a source format: fp32 values or GGUF blocks (uint8 [rows, bytes])."""

    fmt: WeightFormat  # one of the runtime's FORMATS: f32, q4_0, q4_1, q5_0, q8_0, q4_k, q5_k, q6_k
    data: np.ndarray
    rows: int
    cols: int
    # called once the runtime has repacked the data (a memory-mapped file's pages are dropped)
    release: Callable[[], None] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "fmt", WeightFormat(self.fmt))  # a name ("q4_0") is its format


# A layer's weights: one matrix, or row blocks stacked in order (fused QKV, gate/up), each in
# its own format (a Q4_K_M file mixes Q4_K and Q6_K inside one fused QKV).
Linear = RawMatrix | list[RawMatrix]


def _f32(t: torch.Tensor) -> RawMatrix:
    t = t.float().contiguous()
    return RawMatrix(WeightFormat.F32, t.numpy(), t.shape[0], t.shape[1])


W = WeightFormat
QUANTS = (W.F32, W.Q8_0, W.Q4_1, W.Q4_0, W.Q5_0, W.Q4_K, W.Q5_K, W.Q6_K)  # formats quantize_matrix writes
REQUANTS = (W.Q4_0,)  # formats requantize writes
del W


def quantize_matrix(w: torch.Tensor, fmt: WeightFormat | str) -> RawMatrix:
    """fp32 [rows, cols] -> GGUF blocks of ``fmt`` (one of QUANTS; K formats need cols % 256 == 0)."""
    from verispec.models.ggml_quants import quantize

    fmt = WeightFormat.parse(fmt, QUANTS)
    if fmt == WeightFormat.F32:
        return _f32(w)
    return RawMatrix(fmt, quantize(w.float().numpy(), fmt), w.shape[0], w.shape[1])


def requantize(m: RawMatrix, fmt: WeightFormat | str = WeightFormat.Q4_0) -> RawMatrix:
    """``m`` re-encoded as ``fmt`` (Q4_0, ggml's rule) where that streams fewer bytes: a draft
    model chosen for speed, not fidelity; the target checks every drafted token, so output
    is unchanged. Matrices already at most as wide (Q4_0, Q4_K) come back as they are; the
    source pages are released once read."""
    fmt = WeightFormat.parse(fmt, REQUANTS, "requantization")
    lib, want = library(), FORMATS[fmt]
    if m.cols % want.block or FORMATS[m.fmt].row_bytes(m.cols) <= want.row_bytes(m.cols):
        return m
    out = np.empty((m.rows, want.row_bytes(m.cols)), dtype=np.uint8)
    src = np.ascontiguousarray(m.data)
    err = ctypes.create_string_buffer(_ERR)
    if lib.vs_requantize_q4_0(FORMATS[m.fmt].ggml_type, src.ctypes.data, m.rows, m.cols, out.ctypes.data,
                              max(1, torch.get_num_threads()), err, _ERR):
        raise ModelError(f"requantizing a {m.fmt} matrix to {fmt}: {err.value.decode()}")
    if m.release is not None:
        m.release()
    return RawMatrix(fmt, out, m.rows, m.cols)


# ----------------------------------------------------------------------------- cache


class CpuCachePool(CachePool):
    """K/V of ``rows`` requests, in ``owner.kv_dtype``: k [layers, rows, kv_heads, slots/64, head_dim, 64] (64-slot
    transposed tiles, so a token's scores read contiguous keys), v [layers, rows, kv_heads,
    slots, head_dim]. ``torch.empty``: slots past a request's length are never read.

    A pool sized by its caller (a server's batch) holds all ``max_length`` slots from the start;
    one that ``grow``s (``CpuLlama.new_cache`` / ``new_cache_pool`` without a length: the
    model's whole context, which a GGUF may declare as 2^24 tokens) starts small and at least
    doubles as its requests reach further, so ``generate`` holds what the request needs. Each
    allocation is checked against the memory available first (one line, not an allocator error)."""

    def __init__(self, owner: CpuLlama, rows: int, max_length: int, grow: bool = False):
        super().__init__(owner, rows, max_length)
        self._limit = -(-max_length // SLOT_TILE) * SLOT_TILE  # the slots it may grow to
        self.slots = 0
        self.reserve(min(self._limit, GROW_FROM) if grow else self._limit)

    def reserve(self, slots: int) -> None:
        """Hold at least ``slots`` slots (at most ``max_length`` rounded up to a tile), keeping the K/V held."""
        if slots <= self.slots:
            return
        new = min(self._limit, max(-(-slots // SLOT_TILE) * SLOT_TILE, 2 * self.slots))
        a, dtype = self.owner.args, self.owner.kv_dtype
        per_slot = 2 * a.n_layers * self.rows * a.n_kv_heads * a.head_dim * dtype.itemsize
        check_fits(new * per_slot, f"the K/V cache of {self.rows} x {new:,} tokens", "ask for fewer tokens")
        k = torch.empty(a.n_layers, self.rows, a.n_kv_heads, new // SLOT_TILE, a.head_dim, SLOT_TILE, dtype=dtype)
        v = torch.empty(a.n_layers, self.rows, a.n_kv_heads, new, a.head_dim, dtype=dtype)
        if self.slots:  # numpy copies, as in _read_slots
            k.numpy()[:, :, :, :self.slots // SLOT_TILE] = self.k.numpy()
            v.numpy()[:, :, :, :self.slots] = self.v.numpy()
        self.k, self.v, self.slots = k, v, new

    def _move_slots(self, row: int, src: list[int], dst_start: int) -> None:
        idx = _i32(src)
        library().vs_cache_move(ctypes.byref(self.owner._cfg), self.k.data_ptr(), self.v.data_ptr(),
                                self.rows, self.slots, row, _ptr(idx), len(src), dst_start)

    # prefix-cache copies go through numpy views: torch copies would wake torch's OpenMP
    # threads, which then spin on the cores the runtime's own threads need (see forward_batch)
    def _read_slots(self, row: int, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> k [layers, kv_heads, head_dim, n] (the tiles' slot-minor order), v [layers, kv_heads, n, head_dim]."""
        k, v = self.k.numpy(), self.v.numpy()
        tiles = [k[:, row, :, t, :, lo:hi] for t, lo, hi, _ in _tile_spans(start, n)]
        return (torch.from_numpy(np.concatenate(tiles, axis=-1)),
                torch.from_numpy(v[:, row, :, start:start + n].copy()))  # a copy even where the slice is contiguous

    def _write_slots(self, row: int, start: int, kv: tuple[torch.Tensor, torch.Tensor]) -> None:
        k_in, v_in = (t.numpy() for t in kv)
        self.reserve(start + v_in.shape[2])
        k, v = self.k.numpy(), self.v.numpy()
        for t, lo, hi, at in _tile_spans(start, v_in.shape[2]):
            k[:, row, :, t, :, lo:hi] = k_in[..., at:at + hi - lo]
        v[:, row, :, start:start + v_in.shape[2]] = v_in


def _tile_spans(start: int, n: int) -> list[tuple[int, int, int, int]]:
    """Slots ``start .. start+n-1`` as (tile, first, end, offset in the range) per 64-slot tile.

    Example: _tile_spans(60, 8) -> [(0, 60, 64, 0), (1, 0, 4, 4)].
    """
    spans, s = [], start
    while s < start + n:
        t, lo = divmod(s, SLOT_TILE)
        hi = min(SLOT_TILE, lo + start + n - s)
        spans.append((t, lo, hi, s - start))
        s += hi - lo
    return spans


class CpuCache(PooledCache):
    """A request's view on one row of a ``CpuCachePool``."""


CpuCachePool.cache_class = CpuCache


# ----------------------------------------------------------------------------- model


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

    def __init__(self, args: LlamaArgs, weights: dict, info: ModelInfo, isa: str | None = None,
                 threads: int | None = None, kv_dtype: torch.dtype | None = None,
                 head_rows: torch.Tensor | None = None):
        lib = library()
        self.args, self.info = args, info
        # the formats of its layers' matrices, as they came (the head and embedding may differ)
        self.formats = layer_formats(weights)
        # a reduced LM head (a draft's, FR-Spec): the token id of each head row; logits of
        # other tokens are -inf. The runtime computes args.vocab_size = len(head_rows) rows.
        self.head_rows = head_rows
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
        self._cfg = _Config(args.vocab_size, args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.head_dim,
                            args.intermediate_size, info.max_length, args.norm_eps, int(self.kv_dtype == torch.float16),
                            args.vocab_size if embed is None else sum(p.rows for p in embed_parts))
        _check_rope_fits(args, info.max_length)
        cos, sin = (t.contiguous() for t in rope_tables(args, info.max_length, torch.device("cpu")))
        err = ctypes.create_string_buffer(_ERR)
        threads = threads or torch.get_num_threads()
        handle = lib.vs_model_new(ctypes.byref(self._cfg), _ptr(cos, ctypes.c_float), _ptr(sin, ctypes.c_float),
                                  _want_isa(isa), threads, err, _ERR)
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
        self._set(-1, Slot.NORM, weights["norm"])
        if weights.get("embed") is not None:
            self._set(-1, Slot.EMBED, weights["embed"])
        if self._embed_ref is not None:
            ref, err = self._embed_ref, ctypes.create_string_buffer(_ERR)
            if library().vs_model_set_embed_ref(self._h, FORMATS[ref.fmt].ggml_type, ref.data.ctypes.data, ref.rows,
                                                ref.cols, err, _ERR):
                raise ModelError(f"compiled runtime, embedding: {err.value.decode()}")
        self._set(-1, Slot.HEAD, weights["head"])
        if weights.get("in_proj") is not None:  # feature input (EAGLE heads): forward_slots(feats=...)
            self._set(-1, Slot.IN_PROJ, weights["in_proj"], weights.get("in_proj_bias"))
        if weights.get("in_norm") is not None:
            self._set(-1, Slot.IN_NORM, weights["in_norm"])
        err = ctypes.create_string_buffer(_ERR)
        if library().vs_model_finish(self._h, err, _ERR):
            raise ModelError(f"compiled runtime: {err.value.decode()}")

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
            err = ctypes.create_string_buffer(_ERR)
            rc = library().vs_model_set(self._h, layer, int(slot), fmt.ggml_type, data.ctypes.data, part.rows, part.cols,
                                        None if pb is None else _ptr(pb, ctypes.c_float), err, _ERR)
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
        if h is not None and _LIB is not None:
            _LIB.vs_model_free(h)

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
            model = cls.from_weights(cfg, gguf_weights(Path(gguf), cfg), max_length, name=name, **kw)
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
        layer_ids = _i32(check_hidden_layers(hidden_layers, self.args.n_layers))
        layers = torch.empty(total, len(layer_ids) * self.args.dim) if len(layer_ids) else None
        pool = caches[0].pool
        keep = [_i32(a) for a in (np.concatenate([ids_np[r, :k] for r, k in enumerate(n_real)]),
                                    np.concatenate([pos_np[r, :k] for r, k in enumerate(n_real)]),
                                    np.concatenate(seq), np.concatenate(slot), vis_off, np.concatenate(vis),
                                    [c.row for c in caches], [c.length for c in caches], logit_tokens)]
        batch = _Batch(total, *(_ptr(t) for t in keep[:6]), len(caches), _ptr(keep[6]), _ptr(keep[7]),
                       pool.k.data_ptr(), pool.v.data_ptr(), pool.rows, pool.slots,
                       len(logit_tokens), _ptr(keep[8]), _ptr(logits, ctypes.c_float),
                       None if hidden is None else _ptr(hidden, ctypes.c_float), len(layer_ids), _ptr(layer_ids),
                       None if layers is None else _ptr(layers, ctypes.c_float))
        err = ctypes.create_string_buffer(_ERR)
        if library().vs_forward(self._h, ctypes.byref(batch), err, _ERR):
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
        keep = [_i32(a) for a in (ids, positions, np.zeros(t), slots, vis_off, np.concatenate(visible), [row], [cached],
                                    np.arange(t) if logit_rows is None else logit_rows)]
        logits = torch.empty(len(keep[8]), self.args.vocab_size)
        hidden = torch.empty(t, self.args.dim) if want_hidden else None
        layer_ids = _i32(check_hidden_layers(hidden_layers, self.args.n_layers))
        layers = torch.empty(t, len(layer_ids) * self.args.dim) if len(layer_ids) else None
        f = None if feats is None else feats.float().contiguous()
        if f is not None and tuple(f.shape) != (t, self.args.dim):
            raise ValueError(f"feats must be [{t}, {self.args.dim}], got {tuple(f.shape)}")
        batch = _Batch(t, *(_ptr(a) for a in keep[:6]), 1, _ptr(keep[6]), _ptr(keep[7]), pool.k.data_ptr(),
                       pool.v.data_ptr(), pool.rows, pool.slots, len(keep[8]), _ptr(keep[8]), _ptr(logits, ctypes.c_float),
                       None if hidden is None else _ptr(hidden, ctypes.c_float),
                       len(layer_ids), _ptr(layer_ids), None if layers is None else _ptr(layers, ctypes.c_float),
                       None if f is None else _ptr(f, ctypes.c_float))
        err = ctypes.create_string_buffer(_ERR)
        if library().vs_forward(self._h, ctypes.byref(batch), err, _ERR):
            raise ValueError(f"forward: {err.value.decode()}")
        return ModelOutput(self._full_vocab(logits), hidden, layers)

    def _full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[T, head rows] -> [T, V]: a reduced head's logits scattered, -inf elsewhere."""
        if self.head_rows is None:
            return logits
        full = logits.new_full((len(logits), self.info.vocab_size), float("-inf"))
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


# ----------------------------------------------------------------------------- weight sources


def check_head_rows(head_rows, vocab_size: int) -> torch.Tensor:
    """A reduced LM head's token ids: a non-empty 1-D list of distinct ids in [0, vocab_size)."""
    rows = torch.as_tensor(head_rows, dtype=torch.long)
    if rows.dim() != 1 or not len(rows) or not 0 <= int(rows.min()) <= int(rows.max()) < vocab_size \
            or len(rows.unique()) != len(rows):
        raise ValueError(f"head_rows must be a non-empty 1-D list of distinct token ids in [0, {vocab_size})")
    return rows


def state_dict_weights(cfg: dict, state: dict[str, torch.Tensor], quant: WeightFormat,
                       head_rows: torch.Tensor | None = None) -> dict:
    """HF-named tensors -> the runtime's fused matrices (QKV, gate/up), quantized to ``quant``;
    ``head_rows``: the LM head keeps those rows (the input embedding keeps all of them)."""
    args = LlamaArgs.from_hf_config(cfg)
    q = lambda w: quantize_matrix(w.float(), quant)  # noqa: E731
    layers = []
    for i in range(args.n_layers):
        p = f"model.layers.{i}."
        t = lambda n: take(state, p + n)  # noqa: E731
        layer = {"attn_norm": t("input_layernorm.weight"), "ffn_norm": t("post_attention_layernorm.weight"),
                 "wqkv": q(torch.cat([t("self_attn.q_proj.weight"), t("self_attn.k_proj.weight"),
                                      t("self_attn.v_proj.weight")])),
                 "wo": q(t("self_attn.o_proj.weight")),
                 "w13": q(torch.cat([t("mlp.gate_proj.weight"), t("mlp.up_proj.weight")])),
                 "w2": q(t("mlp.down_proj.weight"))}
        if p + "self_attn.q_proj.bias" in state:
            layer["wqkv_bias"] = torch.cat([t("self_attn.q_proj.bias"), t("self_attn.k_proj.bias"), t("self_attn.v_proj.bias")])
        layers.append(layer)
    embed = take(state, "model.embed_tokens.weight")
    tied = cfg.get("tie_word_embeddings", "lm_head.weight" not in state)
    head = embed if tied else take(state, "lm_head.weight")
    if head_rows is not None:
        head, tied = head[check_head_rows(head_rows, len(head))], False
    # a quantized model's head in Q8_0, as llama.cpp does
    head_fmt = WeightFormat.F32 if quant == WeightFormat.F32 else WeightFormat.Q8_0
    return {"layers": layers, "norm": take(state, "model.norm.weight"), "head": quantize_matrix(head.float(), head_fmt),
            "embed": None if tied else quantize_matrix(embed.float(), head_fmt)}


_CHUNK_BYTES = 32 << 20  # large tensors are set in row blocks of at most this many source bytes


def gguf_weights(path: Path, cfg: dict, head_rows: torch.Tensor | None = None,
                 requant: WeightFormat | None = None) -> dict:
    """The weights of a ``llama`` or ``qwen2`` GGUF file as its own blocks (no dequantization,
    no fp32 copy): every format of ``FORMATS`` (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K, F32).
    Data are views of one read-only memory map; each row block's pages are released once the
    runtime has repacked it, so loading holds the repacked weights plus one block at a time.
    Llama Q/K rows go from GGUF's interleaved RoPE pairs to HF's rotate_half order (a row
    permutation); qwen2 files keep rotate_half order (llama.cpp's NEOX RoPE) and carry Q/K/V biases.
    ``head_rows``: the LM head keeps only those token ids' rows, in that order (a draft's
    reduced head, FR-Spec); the input embedding keeps every row. ``requant``: matrices wider
    than that format are re-encoded to it as they are read (``requantize``: a draft model)."""
    import mmap

    from verispec.models.gguf_file import read_gguf
    from verispec.models.loading import rope_interleaved_to_half

    library()  # FORMATS comes from the library
    args = LlamaArgs.from_hf_config(cfg)
    info = read_gguf(path)
    permute = cfg.get("model_type", "llama") != "qwen2"
    with path.open("rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    page = mmap.PAGESIZE

    def release(start: int, nbytes: int):
        lo = start // page * page
        return lambda: buf.madvise(mmap.MADV_DONTNEED, lo, start + nbytes - lo)

    def tensor(name: str):
        t = info.tensors.get(name)
        if t is None:
            raise ModelError(f"{path}: missing tensor {name}")
        return t

    def matrix(name: str) -> RawMatrix:
        """The whole tensor as a view of the mapped file, in a format of the runtime."""
        t = tensor(name)
        fmt = FORMATS.get(t.format)
        if fmt is None or len(t.shape) != 2:
            raise ModelError(f"{path}: tensor {name} is {t.type_name}; the compiled runtime reads "
                             f"{', '.join(f.label for f in FORMATS)} (try --backend native, which dequantizes)")
        cols, rows = t.shape
        data = np.frombuffer(buf, dtype=np.uint8, count=t.nbytes, offset=t.offset).reshape(rows, fmt.row_bytes(cols))
        return RawMatrix(fmt.fmt, data.view(np.float32) if fmt.fmt == WeightFormat.F32 else data, rows, cols)

    def raw(name: str, heads: int | None = None, rows_wanted: torch.Tensor | None = None) -> Linear:
        out = raw_source(name, heads, rows_wanted)
        if requant is None:
            return out
        return [requantize(p, requant) for p in out] if isinstance(out, list) else requantize(out, requant)

    def raw_source(name: str, heads: int | None, rows_wanted: torch.Tensor | None) -> Linear:
        m = matrix(name)
        if rows_wanted is not None:  # a copy of the chosen rows only
            return RawMatrix(m.fmt, m.data[rows_wanted.numpy()], len(rows_wanted), m.cols)
        if heads is not None and permute:
            return RawMatrix(m.fmt, rope_interleaved_to_half(torch.from_numpy(np.array(m.data)), heads).numpy(),
                             m.rows, m.cols)
        rb, offset = m.data.nbytes // m.rows, tensor(name).offset
        step = max(PANEL_ROWS, _CHUNK_BYTES // rb // PANEL_ROWS * PANEL_ROWS)
        chunks = [RawMatrix(m.fmt, m.data[r:r + step], min(step, m.rows - r), m.cols,
                            release(offset + r * rb, min(step, m.rows - r) * rb)) for r in range(0, m.rows, step)]
        return chunks[0] if len(chunks) == 1 else chunks

    def vec(name: str) -> torch.Tensor:
        t = tensor(name)
        if t.format != WeightFormat.F32:
            raise ModelError(f"{path}: tensor {name} is {t.type_name}: expected F32")
        return torch.from_numpy(np.frombuffer(buf, dtype=np.float32, count=t.nbytes // 4, offset=t.offset).copy())

    layers = []
    for i in range(args.n_layers):
        b = f"blk.{i}."
        layer = {"attn_norm": vec(b + "attn_norm.weight"), "ffn_norm": vec(b + "ffn_norm.weight"),
                 "wqkv": parts(raw(b + "attn_q.weight", args.n_heads), raw(b + "attn_k.weight", args.n_kv_heads),
                               raw(b + "attn_v.weight")),
                 "wo": raw(b + "attn_output.weight"),
                 "w13": parts(raw(b + "ffn_gate.weight"), raw(b + "ffn_up.weight")),
                 "w2": raw(b + "ffn_down.weight")}
        if b + "attn_q.bias" in info.tensors:
            bias = [vec(b + f"attn_{x}.bias") for x in "qkv"]
            if permute:
                bias[:2] = [rope_interleaved_to_half(v[:, None], h)[:, 0] for v, h in
                            zip(bias[:2], (args.n_heads, args.n_kv_heads))]
            layer["wqkv_bias"] = torch.cat(bias)
        layers.append(layer)
    tied = "output.weight" not in info.tensors
    if head_rows is not None:
        head_rows = check_head_rows(head_rows, tensor("token_embd.weight" if tied else "output.weight").shape[1])
    head = raw("token_embd.weight" if tied else "output.weight", rows_wanted=head_rows)
    weights = {"layers": layers, "norm": vec("output_norm.weight"), "head": head, "embed": None}
    if not tied or head_rows is not None:  # the input embedding stays in the mapped file: one row per token
        weights["embed_ref"] = matrix("token_embd.weight")
    return weights


def parts(*linears: Linear) -> list[RawMatrix]:
    """The matrices of linears, row blocks flattened."""
    return [p for w in linears for p in (w if isinstance(w, list) else [w])]


def layer_formats(weights: dict) -> tuple[WeightFormat, ...]:
    """The distinct formats of the layers' matrices (QKV, output, gate/up, down), sorted."""
    return tuple(sorted({m.fmt for layer in weights["layers"]
                         for m in parts(layer["wqkv"], layer["wo"], layer["w13"], layer["w2"])}))


# what ``supports`` asks of a shape (csrc/c_api.cpp: vs_model_new), in words
SHAPES = "hidden size, FFN size and heads x head size multiples of 32, at most 64 query heads per K/V head"


def supports(cfg: dict) -> bool:
    """Can the compiled runtime run this HF config? (Llama family, ``SHAPES``.)"""
    try:
        a = LlamaArgs.from_hf_config(cfg)
    except (ModelError, KeyError, ValueError):
        return False
    return (cfg.get("model_type") in SUPPORTED_MODEL_TYPES and a.dim % 32 == 0 and a.intermediate_size % 32 == 0
            and (a.n_heads * a.head_dim) % 32 == 0 and a.n_heads % a.n_kv_heads == 0 and a.group <= 64)


CpuLlama.pool_class = CpuCachePool
