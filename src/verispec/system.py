"""What this installation runs with: the thread count commands set (``--threads``) and the
report of ``verispec info`` (version, compiled runtime, ISA, threads, model cache)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ISAS = ("avx512", "avx2", "scalar")  # the compiled runtime's kernels, widest first


def check_threads(n: int | None) -> None:
    """``--threads`` must be None (the default count) or >= 1 (ValueError)."""
    if n is not None and n < 1:
        raise ValueError(f"--threads must be >= 1, got {n}")


def set_threads(n: int | None) -> int:
    """Run on ``n`` threads (None: keep torch's default, one per core): torch's intra-op pool
    now, and the compiled runtime's pool of every model loaded after this (``models/cpu.py``
    sizes it from ``torch.get_num_threads()`` at load), as llama.cpp's ``-t``. Returns the
    count in effect."""
    import torch

    check_threads(n)
    if n is not None:
        torch.set_num_threads(n)
    return torch.get_num_threads()


@contextmanager
def threads(n: int | None) -> Iterator[int]:
    """``set_threads(n)`` for the duration of the block; torch's count is restored after."""
    import torch

    before = torch.get_num_threads()
    try:
        yield set_threads(n)
    finally:
        torch.set_num_threads(before)


def load_and_cores() -> tuple[float, int] | None:
    """The 1-minute load average and the cores this process may run on, or None where the system
    keeps no load average (Windows). Reads no torch: the test harness asks before torch loads."""
    try:
        load = os.getloadavg()[0]
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    except (OSError, AttributeError):
        return None
    return load, cores


def dir_bytes(path: Path) -> int:
    """Bytes of the regular files under ``path`` (links not followed; 0 if it does not exist)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:  # removed meanwhile
                continue
            total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total


def compiled_runtime() -> dict[str, Any]:
    """Is the compiled runtime built and loadable; which ISA it picks and which run here."""
    import importlib.util

    from .models import cpu_abi

    spec = importlib.util.find_spec("verispec._vscpu")
    out: dict[str, Any] = {"built": False, "path": spec.origin if spec else None, "error": None, "isa": None,
                           "isas_available": [], "isa_forced": os.environ.get("VERISPEC_ISA") or None}
    try:
        cpu_abi.library()
    except OSError as e:
        out["error"] = f"{e}; {cpu_abi.MISSING_FIX}"
        return out
    out["built"] = True
    out["isas_available"] = [isa for isa in ISAS if _supported(cpu_abi, isa)]
    try:
        out["isa"] = cpu_abi.isa_name()
    except ValueError as e:  # VERISPEC_ISA names one this CPU lacks
        out["error"] = str(e)
    return out


def _supported(cpu_abi, isa: str) -> bool:
    try:
        cpu_abi.isa_name(isa)
    except ValueError:
        return False
    return True


def info() -> dict[str, Any]:
    """The report of ``verispec info``, as plain data."""
    import platform

    import torch

    from . import __version__
    from .models.model_cache import default_cache_dir

    cache = default_cache_dir()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "version": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "compiled_runtime": compiled_runtime(),
        "threads": torch.get_num_threads(),
        "cpus": cpus,
        "model_cache": {"path": str(cache), "bytes": dir_bytes(cache)},
    }
