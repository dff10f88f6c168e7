"""Self-speculation's draft on the compiled runtime: the target with a subset of its layers, sharing
its weights (Draft & Verify: Zhang et al. 2023, "Draft & Verify: Lossless Large Language Model
Acceleration via Self-Speculative Decoding", arXiv 2309.08168; SWIFT: Xia et al. 2024, "SWIFT:
On-the-Fly Self-Speculative Decoding for LLM Inference Acceleration", arXiv 2410.06916).

``layer_subset(target, keep)`` is a ``CpuLlama`` whose runtime model (``vs_model_subset``) holds the
target's layers ``keep`` by reference, with the target's embedding, final norm and head: no second
file is read and no weight is copied, so its memory is its own K/V cache alone (of ``len(keep)``
layers), and a decode step reads the kept layers' weights plus the head, about their share of the
target's. The target is kept alive with it. A kept layer computes exactly what it computes in the
target, given the same input; its input differs because the skipped layers are missing, so the draft
only proposes and the target verifies every token (output unchanged, as for any draft).

    draft = layer_subset(target_backend, keep=tuple(range(0, 28, 2)))  # every other layer of 28
"""

from __future__ import annotations

import ctypes
from dataclasses import replace

from verispec.models.base import ModelError
from verispec.models.cpu import CpuLlama
from verispec.models.cpu_abi import ERR_LEN, Config, i32, library


class LayerSubset(CpuLlama):
    """A ``CpuLlama`` over another one's layers (``layer_subset``): it holds no weights of its own."""

    @property
    def resident_bytes(self) -> int:
        """0: its weights are the target's, counted there (``weight_bytes`` is still what a step reads)."""
        return 0


def layer_subset(target: CpuLlama, keep: tuple[int, ...], name: str | None = None) -> CpuLlama:
    """``target`` with only layers ``keep`` (ascending, distinct, at least one), its weights shared."""
    n = target.args.n_layers
    if not keep or any(not 0 <= i < n for i in keep) or list(keep) != sorted(set(keep)):
        raise ValueError(f"a layer subset keeps ascending, distinct layers in [0, {n}), at least one; got {list(keep)}")
    ids = i32(keep)
    err = ctypes.create_string_buffer(ERR_LEN)
    handle = _subset_fn()(target._h, ids.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), len(keep), err, ERR_LEN)
    if not handle:
        raise ModelError(f"compiled runtime: {err.value.decode()}")
    draft = object.__new__(LayerSubset)
    draft.__dict__.update(target.__dict__)  # its facts (formats, head rows, embedding reference), then what differs
    draft._h = ctypes.c_void_p(handle)
    draft._parent = target  # the matrices are the target's: it must outlive the draft
    a = target.args
    windows = tuple(a.layer_windows[i] for i in keep) if a.layer_windows else ()
    draft.args = replace(a, n_layers=len(keep), layer_windows=windows)
    c = target._cfg
    draft._cfg = Config(*(getattr(c, f) if f != "n_layers" else len(keep) for f, _ in Config._fields_))
    skipped = [i for i in range(n) if i not in keep]
    draft.info = replace(target.info, name=name or f"{target.info.name}[skip {_ranges(skipped)}]")
    return draft


def _subset_fn():
    """The runtime's ``vs_model_subset`` (an addition that changes no struct, so no ABI version: a build
    that predates it is one ModelError here)."""
    fn = getattr(library(), "vs_model_subset", None)
    if fn is None:
        raise ModelError("the compiled runtime predates layer subsets (model=self): rebuild it (pip install -e .)")
    fn.restype = ctypes.c_void_p
    fn.argtypes = (ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32), ctypes.c_int, ctypes.c_char_p, ctypes.c_int)
    return fn


def _ranges(ids: list[int]) -> str:
    """3, 10, 11, 12 -> '3+10-12' (the ``skip=`` syntax)."""
    out, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return "+".join(out)
