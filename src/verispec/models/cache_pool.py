"""Row-pooled KV caches shared by the native and compiled runtimes: the bookkeeping only.

A pool preallocates K/V for ``rows`` requests; a request's cache is a handle on one row
plus an int ``length``. ``truncate`` changes the int; ``compact`` checks its arguments and
asks the backend to move the accepted slots (``_move_slots``). ``read_kv`` / ``append_kv``
copy slots out of and into a row (the prefix cache across requests, engine/prefix_cache.py;
``copy_prefix``, n samples sharing a prefill), through the backend's ``_read_slots`` /
``_write_slots``. The tensors and their layout
belong to the backend's subclass.
"""

from __future__ import annotations

import torch

from .base import NOT_CLAIMED, BackendCaps, CausalLM, Exactness


class CachePool:
    """Rows of a preallocated K/V store. Invariant: a row is handed out by ``acquire`` at
    most once until ``release``. Subclasses set ``max_length`` and create the tensors."""

    cache_class: type[PooledCache]

    def __init__(self, owner, rows: int, max_length: int):
        if rows < 1 or not 1 <= max_length <= owner.info.max_length:
            raise ValueError(f"cache pool: need rows >= 1 and 1 <= max_length <= {owner.info.max_length}, "
                             f"got {rows}, {max_length}")
        self.owner, self.max_length = owner, max_length
        self._free = list(range(rows))
        self._rows = rows

    @property
    def rows(self) -> int:
        return self._rows

    @property
    def nbytes(self) -> int:
        """Bytes of the K/V store (subclasses hold it as ``self.k`` and ``self.v``)."""
        return sum(t.numel() * t.element_size() for t in (self.k, self.v))

    def acquire(self) -> PooledCache:
        if not self._free:
            raise ValueError(f"cache pool: all {self.rows} rows are in use")
        return self.cache_class(self, self._free.pop(0))

    def release(self, cache: PooledCache) -> None:
        if cache.pool is not self or cache.row in self._free:
            raise ValueError(f"cache pool: row {cache.row} is not acquired from this pool")
        cache.truncate(0)
        self._free.append(cache.row)
        self._free.sort()

    @property
    def in_use(self) -> int:
        """Rows handed out and not yet released."""
        return self._rows - len(self._free)

    def _move_slots(self, row: int, src: list[int], dst_start: int) -> None:
        """Copy K/V of slots ``src`` (ascending, all >= their targets) to ``dst_start, ...``."""
        raise NotImplementedError

    def _read_slots(self, row: int, start: int, n: int) -> tuple[torch.Tensor, ...]:
        """A copy of the K/V of slots ``start .. start+n-1`` in the backend's own layout."""
        raise NotImplementedError(f"{type(self).__name__} cannot copy K/V out (no prefix cache)")

    def _write_slots(self, row: int, start: int, kv: tuple[torch.Tensor, ...]) -> None:
        """Write ``_read_slots`` output back at slots ``start ..``."""
        raise NotImplementedError(f"{type(self).__name__} cannot copy K/V in (no prefix cache)")


class PooledCache:
    """A request's view on one pool row (implements ``KVCache``). Slots ``0 .. length-1``
    hold K/V in sequence order."""

    def __init__(self, pool: CachePool, row: int):
        self.pool, self.row, self._length = pool, row, 0

    @property
    def length(self) -> int:
        return self._length

    @property
    def max_length(self) -> int:
        return self.pool.max_length

    def truncate(self, new_length: int) -> int:
        if new_length < 0:
            raise ValueError(f"truncate: new_length must be >= 0, got {new_length}")
        dropped = max(0, self._length - new_length)
        self._length = min(self._length, new_length)
        return dropped

    def compact(self, src_slots: list[int], dst_start: int) -> None:
        src = [int(s) for s in src_slots]
        if any(b <= a for a, b in zip(src, src[1:])) or (src and (src[0] < 0 or src[-1] >= self._length)):
            raise ValueError(f"compact: src_slots must be ascending, within [0, {self._length}), got {src}")
        if not 0 <= dst_start <= (src[0] if src else self._length):
            raise ValueError(f"compact: dst_start {dst_start} must be in [0, first src slot]")
        if src and src != list(range(dst_start, dst_start + len(src))):
            self.pool._move_slots(self.row, src, dst_start)
        self._length = dst_start + len(src)

    def read_kv(self, start: int, n: int) -> tuple[torch.Tensor, ...]:
        """A copy of the K/V of cached slots ``start .. start+n-1`` (opaque, backend layout):
        what ``append_kv`` of a cache of the same model takes."""
        if n < 1 or start < 0 or start + n > self._length:
            raise ValueError(f"read_kv: slots [{start}, {start + n}) are not all cached (length {self._length})")
        return self.pool._read_slots(self.row, start, n)

    def append_kv(self, kv: tuple[torch.Tensor, ...], n: int) -> None:
        """Append ``n`` slots copied by ``read_kv`` at ``length`` (a reused prefix)."""
        if self._length + n > self.pool.max_length:
            raise ValueError(f"append_kv: {self._length} cached + {n} > max_length {self.pool.max_length}")
        self.pool._write_slots(self.row, self._length, kv)
        self._length += n

    def copy_prefix(self, src: PooledCache, length: int) -> None:
        """Make this (empty) cache hold ``src``'s first ``length`` slots: n samples of one
        prompt share its prefill (``Engine.fork``)."""
        if not isinstance(src, type(self)) or src.pool.owner is not self.pool.owner or src is self:
            raise ValueError("copy_prefix: the source must be another cache of the same model")
        if self._length != 0 or not 0 <= length <= src.length:
            raise ValueError(f"copy_prefix: need an empty cache and 0 <= length <= {src.length}, "
                             f"got length {self._length}, {length}")
        if length:
            self.append_kv(src.read_kv(0, length), length)

    def _advance(self, n: int) -> None:
        self._length += n

    def check_integrity(self) -> None:
        assert 0 <= self._length <= self.pool.max_length, self._length
        assert self.row not in self.pool._free, f"row {self.row} is used after release"


class PooledLM(CausalLM):
    """Base of a backend whose ``forward_batch`` runs rows of one ``pool_class`` pool:
    single-request caches and ``forward`` are one-row cases of the batched forward."""

    pool_class: type[CachePool]
    # Is a token's K/V bitwise the same whether the prompt was prefilled in one forward or
    # in several (a reused prefix, then the rest)? Only then may a prefix cache reuse K/V.
    prefix_reuse_exact: bool = False
    host_torch_threads: int | None = None  # BackendCaps.host_threads
    min_verify_rows = 1  # BackendCaps.min_verify_rows
    chain_drafting = False  # BackendCaps.chain_drafting
    exactness: Exactness = NOT_CLAIMED

    @property
    def caps(self) -> BackendCaps:
        """Batched, with caches that copy a prefix; the rest as the backend declares it."""
        return BackendCaps(batched=True, prefix_reuse_exact=self.prefix_reuse_exact, exactness=self.exactness,
                           host_threads=self.host_torch_threads, min_verify_rows=self.min_verify_rows,
                           copy_prefix=True, chain_drafting=self.chain_drafting)

    def new_cache(self, max_length: int | None = None) -> PooledCache:
        return self.new_cache_pool(1, max_length).acquire()

    def new_cache_pool(self, rows: int, max_length: int | None = None) -> CachePool:
        return self.pool_class(self, rows, max_length or self.info.max_length)

    def _check_batch(self, ids, pos, caches, tree, n_real: list[int]) -> None:
        """The checks every batched forward makes before touching memory: shapes and dtypes,
        ``num_tokens``, caches that are distinct rows of one pool of this model, overflow."""
        b, n = ids.shape if ids.dim() == 2 else (0, 0)
        if ids.dim() != 2 or n < 1 or b != len(caches) or b < 1 or ids.is_floating_point():
            raise ValueError(f"forward: input_ids must be integer [B={len(caches)}, N>=1], got {tuple(ids.shape)}")
        if pos.shape != ids.shape or pos.is_floating_point():
            raise ValueError(f"forward: positions {tuple(pos.shape)} must be integer and match input_ids {tuple(ids.shape)}")
        if tree is not None and (tree.shape != (b, n, n) or tree.dtype != torch.bool):
            raise ValueError(f"forward: tree_mask must be bool [N={n}, N] per row, got {tuple(tree.shape)} {tree.dtype}")
        if len(n_real) != b or not all(1 <= k <= n for k in n_real):
            raise ValueError(f"forward: num_tokens must be {b} values in [1, {n}], got {n_real}")
        cls = self.pool_class.cache_class
        pool = caches[0].pool if isinstance(caches[0], cls) else None
        if pool is None or pool.owner is not self or any(not isinstance(c, cls) or c.pool is not pool for c in caches):
            raise ValueError(f"forward: caches must be {cls.__name__} handles of one pool created by this model")
        if len({c.row for c in caches}) != b:
            raise ValueError("forward: a cache row appears twice in one batch")
        for c, k in zip(caches, n_real):
            if c.length + k > c.max_length:
                raise ValueError(f"forward: cache overflow: {c.length} cached + {k} new > max_length {c.max_length}")

    def forward(self, input_ids, positions, cache, tree_mask=None, want_hidden: bool = False,
                last_logits_only: bool = False, hidden_layers: tuple[int, ...] = ()):
        """input_ids, positions [1, N]; tree_mask [N, N] bool or None (causal)."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"forward: input_ids must be [1, N], got {tuple(input_ids.shape)}")
        masks = None if tree_mask is None else tree_mask.unsqueeze(0)
        kw = {"hidden_layers": hidden_layers} if hidden_layers else {}
        return self.forward_batch(input_ids, positions, [cache], masks, want_hidden, last_logits_only=last_logits_only,
                                  **kw)
