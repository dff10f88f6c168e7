"""The compiled CPU runtime's C interface (``csrc/c_api.cpp``, ``csrc/vs.h``) as Python sees it:
loading ``verispec._vscpu`` with ctypes, the structs passed to it (``Config``, ``Batch``), the
check that the build matches this verispec (ABI version, struct sizes, tensor slots, formats),
the runtime's weight-format table (``FORMATS``: block sizes, read from the library), and the model
shapes ``vs_model_new`` accepts (``supports``).

Nothing here holds a model: ``cpu.py`` (``CpuLlama``) does, through these functions;
``cpu_weights.py`` prepares the weights it is given.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import hashlib
import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from verispec.models.formats import WeightFormat

if TYPE_CHECKING:
    from verispec.models.llama import LlamaArgs

PANEL_ROWS = 16  # rows per weight panel (csrc/vs.h: PANEL)
ABI_VERSION = 6  # csrc/vs.h: ABI_VERSION
ERR_LEN = 512  # bytes of the buffer a C call writes its error message into


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


class Config(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int32) for n in ("vocab", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn",
                                              "max_pos")] + [("eps", ctypes.c_float), ("kv16", ctypes.c_int32),
                                                                 ("embed_rows", ctypes.c_int32)] + [
        # beyond a plain Llama (csrc/model.h: Config)
        ("act", ctypes.c_int32), ("n_rope", ctypes.c_int32), ("embed_scale", ctypes.c_float),
        ("attn_scale", ctypes.c_float), ("logit_softcap", ctypes.c_float)]


_P = ctypes.POINTER


class Batch(ctypes.Structure):
    _fields_ = [("T", ctypes.c_int32), ("ids", _P(ctypes.c_int32)), ("pos", _P(ctypes.c_int32)),
                ("seq", _P(ctypes.c_int32)), ("slot", _P(ctypes.c_int32)), ("vis_off", _P(ctypes.c_int32)),
                ("vis", _P(ctypes.c_int32)), ("n_seqs", ctypes.c_int32), ("seq_row", _P(ctypes.c_int32)),
                ("seq_cached", _P(ctypes.c_int32)), ("kcache", ctypes.c_void_p), ("vcache", ctypes.c_void_p),
                ("cache_rows", ctypes.c_int32), ("cache_slots", ctypes.c_int32), ("n_logits", ctypes.c_int32),
                ("logit_tokens", _P(ctypes.c_int32)), ("logits", _P(ctypes.c_float)), ("hidden", _P(ctypes.c_float)),
                ("n_layer_out", ctypes.c_int32), ("layer_ids", _P(ctypes.c_int32)), ("layer_out", _P(ctypes.c_float)),
                ("feat", _P(ctypes.c_float))]


class DraftChain(ctypes.Structure):
    """One draft chain in one call, greedy or sampled (csrc/model.h: DraftChain; ``CpuLlama.draft_chain``)."""

    _fields_ = [("n_feed", ctypes.c_int32), ("feed", _P(ctypes.c_int32)), ("row", ctypes.c_int32),
                ("cached", ctypes.c_int32), ("kcache", ctypes.c_void_p), ("vcache", ctypes.c_void_p),
                ("cache_rows", ctypes.c_int32), ("cache_slots", ctypes.c_int32), ("budget", ctypes.c_int32),
                ("min_confidence", ctypes.c_float), ("use_cost", ctypes.c_int32), ("draft_cost", ctypes.c_double),
                ("verify", _P(ctypes.c_double)), ("head_rows", _P(ctypes.c_int32)), ("drafts", _P(ctypes.c_int32)),
                ("n_drafts", ctypes.c_int32), ("n_fed", ctypes.c_int32), ("temperature", ctypes.c_float),
                ("min_p", ctypes.c_float), ("top_p", ctypes.c_float), ("top_k", ctypes.c_int32),
                ("uniforms", _P(ctypes.c_double)), ("q", _P(ctypes.c_float))]


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
    lib.vs_model_new.argtypes = (_P(Config), _P(ctypes.c_float), _P(ctypes.c_float), ctypes.c_char_p, ctypes.c_int, *c_err)
    lib.vs_model_free.argtypes = (ctypes.c_void_p,)
    lib.vs_model_isa.restype = ctypes.c_char_p
    lib.vs_model_isa.argtypes = (ctypes.c_void_p,)
    lib.vs_model_threads.argtypes = (ctypes.c_void_p,)
    lib.vs_model_set_threads.argtypes = (ctypes.c_void_p, ctypes.c_int)
    lib.vs_model_set.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                 ctypes.c_int, _P(ctypes.c_float), *c_err)
    lib.vs_model_finish.argtypes = (ctypes.c_void_p, *c_err)
    lib.vs_model_set_layer.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                       *(_P(ctypes.c_float),) * 4, *c_err)
    lib.vs_model_set_embed_ref.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                           *c_err)
    lib.vs_model_weight_bytes.restype = ctypes.c_size_t
    lib.vs_model_weight_bytes.argtypes = (ctypes.c_void_p,)
    lib.vs_forward.argtypes = (ctypes.c_void_p, _P(Batch), *c_err)
    lib.vs_draft_chain.argtypes = (ctypes.c_void_p, _P(DraftChain), *c_err)
    lib.vs_draft_law.argtypes = (ctypes.c_int, _P(ctypes.c_float), ctypes.c_float, ctypes.c_float, ctypes.c_float,
                                 ctypes.c_int, ctypes.c_double, _P(ctypes.c_float))
    lib.vs_cache_move.argtypes = (_P(Config), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_int, _P(ctypes.c_int32), ctypes.c_int, ctypes.c_int)
    lib.vs_requantize.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_void_p, ctypes.c_int, *c_err)
    _check_abi(lib, spec.origin)
    return lib


def _check_abi(lib: ctypes.CDLL, origin: str) -> None:
    """A stale or mismatched build fails loudly: version, struct sizes, slots and formats."""
    try:
        lib.vs_abi_sizeof.restype = ctypes.c_size_t
        lib.vs_abi_sizeof.argtypes = (ctypes.c_int,)
        lib.vs_formats.argtypes = (ctypes.c_char_p, ctypes.c_int)
        got = (lib.vs_abi_version(), lib.vs_abi_sizeof(0), lib.vs_abi_sizeof(1), lib.vs_abi_sizeof(2), lib.vs_abi_slots())
    except AttributeError:
        got = None
    want = (ABI_VERSION, ctypes.sizeof(Config), ctypes.sizeof(Batch), ctypes.sizeof(DraftChain), len(Slot))
    if got != want:
        raise OSError(f"the compiled runtime {origin} does not match this verispec (ABI {got}, expected {want}): "
                      "rebuild it with `pip install -e .`")
    buf = ctypes.create_string_buffer(4096)
    lib.vs_formats(buf, len(buf))
    FORMATS.clear()
    for item in buf.value.decode().split(","):  # the C table's border: ggml type ids -> WeightFormat
        name, gtype, block, nbytes, quantizes = item.split(":")
        fmt = WeightFormat.from_ggml_type(int(gtype))
        if fmt is None or fmt != name:
            raise OSError(f"the compiled runtime {origin} has format {name} (ggml type {gtype}), which this verispec "
                          "does not name: rebuild it with `pip install -e .`")
        FORMATS[fmt] = RuntimeFormat(fmt, int(block), int(nbytes), quantizes == "1")


@dataclass(frozen=True)
class RuntimeFormat:
    """A weight format the runtime computes with (csrc/formats/table.cpp) and its block size."""

    fmt: WeightFormat
    block: int  # weights per block
    block_bytes: int
    quantizes: bool = False  # its table row has a quantize_row: a re-quantization target (vs_requantize)

    def row_bytes(self, cols: int) -> int:
        return cols // self.block * self.block_bytes


FORMATS: dict[WeightFormat, RuntimeFormat] = {}  # filled from the library at load


@functools.cache
def build_id() -> str:
    """The compiled runtime's identity: a hash of its shared library's bytes. What was measured
    with one build's kernels (a cost curve) is not reused with another's."""
    spec = importlib.util.find_spec("verispec._vscpu")
    if spec is None or not spec.origin:
        return "unbuilt"
    return hashlib.sha256(Path(spec.origin).read_bytes()).hexdigest()[:12]


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
    err = ctypes.create_string_buffer(ERR_LEN)
    name = library().vs_isa_name(want_isa(want), err, ERR_LEN)
    if name is None:
        raise ValueError(err.value.decode())
    return name.decode()


def want_isa(want: str | None) -> bytes:
    return (want or os.environ.get("VERISPEC_ISA") or "auto").encode()


def ptr(t: torch.Tensor | np.ndarray, ctype=ctypes.c_int32):
    addr = t.data_ptr() if isinstance(t, torch.Tensor) else t.ctypes.data
    return ctypes.cast(addr, _P(ctype))


def i32(values) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.int32)


def loaded() -> ctypes.CDLL | None:
    """The library if it is loaded, else None (never built, or already gone at interpreter exit):
    what freeing a model's handle needs, without loading anything."""
    return _LIB


# what ``supports`` asks of a shape (csrc/c_api.cpp: vs_model_new), in words
SHAPES = "hidden size, FFN size and heads x head size multiples of 32, at most 64 query heads per K/V head"


def supports(a: LlamaArgs) -> bool:
    """Can the compiled runtime run a model of these dimensions (a Llama-family config or a GGUF of a
    declared architecture, read by ``LlamaArgs.from_hf_config``)? ``SHAPES`` says what it asks."""
    return (a.dim % 32 == 0 and a.intermediate_size % 32 == 0 and (a.n_heads * a.head_dim) % 32 == 0
            and a.n_heads % a.n_kv_heads == 0 and a.n_heads <= 64 * a.n_kv_heads)
