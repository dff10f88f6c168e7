"""Host memory checks made *before* allocating: an option that sizes memory (a batch, a tree's
width, a cache) is estimated in bytes and refused with one line when the machine cannot hold
it, instead of growing until the kernel's out-of-memory killer picks a process (possibly
another user's).

The estimate is compared with what the machine has available now (``MemAvailable``, and the
cgroup's remaining limit when there is one), not with its total.
"""

from __future__ import annotations

import os
from pathlib import Path

GIB = 2**30


def available_bytes() -> int:
    """Bytes this process could still allocate: ``MemAvailable`` from /proc/meminfo, capped by
    the cgroup (v2 or v1) limit minus its usage and by an address-space limit minus the
    address space in use; the free physical pages elsewhere."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        avail = None
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return 2**62  # unknown: no bound
    rooms = [r for r in (avail, _cgroup_room(), _address_space_room()) if r is not None]
    return min(rooms)


def _cgroup_room() -> int | None:
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 2**60:
            return None
        return max(0, int(limit) - usage)
    return None


def _address_space_room() -> int | None:
    """What an address-space limit (``ulimit -v``: RLIMIT_AS) leaves this process, when one is set."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit == resource.RLIM_INFINITY:
        return None
    try:
        used = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
    return max(0, limit - used)


def check_fits(nbytes: int, what: str, hint: str = "") -> None:
    """Raise ValueError (one line, naming ``what``) when ``nbytes`` exceed the memory available
    now. ``hint``: how to ask for less."""
    avail = available_bytes()
    if nbytes > avail:
        raise ValueError(f"{what} needs about {nbytes / GIB:.1f} GiB of memory; this machine has "
                         f"{avail / GIB:.1f} GiB available" + (f" ({hint})" if hint else ""))


def cache_pool_bytes(backend, rows: int, max_length: int) -> int:
    """Bytes of ``backend.new_cache_pool(rows, max_length)``, measured on one row (so a large
    ``rows`` is never allocated to find out)."""
    return backend.new_cache_pool(1, max_length).nbytes * rows


def logits_bytes(rows: int, vocab: int, copies: int = 3) -> int:
    """float32 logits of ``rows`` positions and the ``copies`` made of them (probabilities, ...)."""
    return rows * vocab * 4 * copies
