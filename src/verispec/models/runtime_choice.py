"""Which runtime runs a model, and with which weights: decided once, for a resolved source and its
HF-style config (``choose_runtime``), before any weight is read. ``load.py`` loads what it says.

``backend="auto"`` (``choose_backend``) prefers the compiled runtime (``cpu``: bit-exact speculation
by construction) for a Llama-family model on CPU in float32 whose shape it runs (``cpu_abi.supports``),
else the native PyTorch runtime for the Llama family, else transformers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .base import ModelError
from .formats import PYTORCH_FORMATS, WeightFormat

if TYPE_CHECKING:
    from .llama import LlamaArgs
    from .resolve import ModelSource

QUANTS = ("auto", *PYTORCH_FORMATS)  # what --quant takes
BACKENDS = ("auto", "cpu", "native", "hf")


@dataclass(frozen=True)
class RuntimeChoice:
    """Which runtime runs a model and with which weights: decided once, by ``choose_runtime``."""

    backend: str  # "cpu" (the compiled runtime), "native" (PyTorch) or "hf" (transformers)
    # what the runtime computes with: None = a GGUF's own blocks, read in place (cpu only); for
    # cpu one of cpu_weights.QUANTS (quantized at load), else one of PYTORCH_FORMATS
    weights: WeightFormat | None
    # the PyTorch runtime's format of the checkpoint's precision (or of the one asked for): what
    # a draft of it on another backend runs as (none, int8, int4)
    pytorch_format: WeightFormat


def parse_quant(quant: WeightFormat | str) -> WeightFormat | str:
    """A ``--quant`` value: ``"auto"`` (the checkpoint's own precision) or one of PYTORCH_FORMATS."""
    if quant == "auto":
        return "auto"
    try:
        return WeightFormat.parse(quant, PYTORCH_FORMATS)
    except ValueError:
        raise ValueError(f"unknown quant {quant!r}; use {', '.join(QUANTS)}") from None


def checkpoint_format(source: ModelSource) -> WeightFormat:
    """The PyTorch runtime's weight format closest to the checkpoint's own precision: a 4-bit
    GGUF (Q4_0, Q4_1, Q4_K, ...) runs as int4 groups, a 5-8 bit one as int8, anything else
    unquantized (``WeightFormat.pytorch`` of the file's main format)."""
    if source.kind != "gguf":
        return WeightFormat.NONE
    return WeightFormat.from_file_type(source.gguf.meta.get("general.file_type", 0)).pytorch


def choose_runtime(source: ModelSource, cfg: dict | None, backend: str, quant: WeightFormat | str,
                   dtype: torch.dtype, device: str) -> RuntimeChoice:
    """The runtime (``backend``: auto, cpu, native or hf) and weights (``quant``: auto or one of
    PYTORCH_FORMATS, ``parse_quant``) a model of HF-style config ``cfg`` runs with, in one place.
    ``quant="auto"`` keeps the checkpoint's own precision: a GGUF's own blocks on ``cpu``, float32
    for other checkpoints there; ``checkpoint_format`` on ``native``; unquantized on ``hf``. A
    PyTorch format asked for runs as itself on ``native`` and as ggml's nearest on ``cpu``
    (``WeightFormat.compiled``: int8 -> Q8_0, int4 -> Q4_1); transformers runs unquantized only."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = choose_backend(cfg, dtype, device, gguf=source.kind == "gguf")
    if backend == "cpu":
        if torch.device(device).type != "cpu":
            raise ValueError(f"backend cpu runs on the CPU, not {device}; use --backend native")
        if dtype != torch.float32:
            raise ValueError("backend cpu computes in float32 (quantized weights, int8 activations); drop --dtype")
    if quant == "auto":
        own = checkpoint_format(source)
        if backend == "cpu":
            return RuntimeChoice("cpu", None if source.kind == "gguf" else WeightFormat.F32, own)
        if backend == "native":
            return RuntimeChoice("native", own, own)
        return RuntimeChoice("hf", WeightFormat.NONE, WeightFormat.NONE)
    if backend == "hf" and quant != WeightFormat.NONE:
        raise ValueError(f"quant={quant!s} needs the native backend (transformers runs unquantized weights)")
    return RuntimeChoice(backend, quant.compiled if backend == "cpu" else quant, quant)


def choose_backend(cfg: dict | None, dtype: torch.dtype, device: str, gguf: bool = False) -> str:
    """What ``backend="auto"`` runs a checkpoint of this HF config on: the compiled runtime
    (``cpu``) for a Llama-family model on CPU in float32 when it is built (bf16 asks for
    PyTorch), else the native PyTorch runtime for a Llama-family model (always for a ``gguf``,
    which ``open_gguf`` has checked), else transformers (``hf``). ``cfg`` None: unreadable.
    Only a runtime that is not built or a shape it does not run falls back from ``cpu``; for
    a GGUF (whose blocks the compiled runtime reads) each says so, in one line on stderr. A
    malformed file never gets here: ``open_gguf`` refuses it first."""
    from . import cpu_abi

    args = _llama_args(cfg)
    if dtype == torch.float32 and torch.device(device).type == "cpu" and args is not None:
        if cpu_abi.supports(args):
            if cpu_abi.available():  # if not built, available() says so (once)
                return "cpu"
        elif gguf:
            import warnings

            warnings.warn(f"the compiled runtime does not run this model's shape ({cpu_abi.SHAPES}); running the "
                          "PyTorch runtime instead, 30-100x slower on CPU", RuntimeWarning, stacklevel=2)
    return "native" if gguf or args is not None else "hf"


def _llama_args(cfg: dict | None) -> LlamaArgs | None:
    """The dimensions of a Llama-family model the native runtime runs; None for another (or unreadable) config."""
    from .llama import LlamaArgs

    if cfg is None:
        return None
    try:
        return LlamaArgs.from_hf_config(cfg)
    except (ModelError, KeyError, ValueError):
        return None
