"""Prefix cache across requests: a new request reuses the K/V of the longest cached prefix
of its prompt and prefills only the rest (vLLM's automatic prefix caching, Kwon et al. 2023,
arXiv 2309.06180; SGLang's RadixAttention, Zheng et al. 2024, arXiv 2312.07104).

Blocks: the tokens of a finished (or just prefilled) request are cut into ``block_size``-token
blocks at block-aligned positions; each block keeps a copy of its slots' K/V (``read_kv``,
memcpy speed). A block's key is ``(parent block id, its token ids)``: exact, no hash to
collide, and a block is found only after the same preceding tokens, i.e. with the same K/V.
Only full blocks are kept, and a request reuses at most ``len(prompt) - 1`` tokens (the last
prompt token is always prefilled: its logits give the first new token).

LRU under a byte budget: lookups and stores touch a chain deepest block first, so a parent
is always more recent than its children, the least recently used block is always a leaf,
and eviction (oldest first) never strands a child. Glossary: as ``models/base.py`` (slot,
cached); reused = prompt tokens whose K/V came from this cache (``RequestStats.cached_tokens``).

Hidden-state drafters (EAGLE, EAGLE-3, Medusa) read the target's features of every prompt
token, so a block may also keep its tokens' observed features (``hidden``, under a
``hidden_tag`` naming what the drafter asks for: the last hidden state or which layers); a
lookup with a tag reuses only blocks that carry features of that tag. On a backend whose
per-token outputs do not depend on the forward's split (``prefix_reuse_exact``), those are
the features the drafter would have observed without the cache, so it drafts the same.

Exactness: K/V is reused only on backends whose prefill is bitwise the same in one forward
or in several (``prefix_reuse_exact``: the compiled CPU runtime). The native PyTorch runtime
prefills long prompts on a fast path whose rounding depends on the forward's size, and
transformers claims nothing, so there this cache stays off rather than change outputs.

    cache = PrefixCache(max_bytes=1 << 30)
    n = cache.restore(prompt_ids, req_cache)   # K/V of prompt_ids[:n] appended
    ...                                        # prefill prompt_ids[n:], decode
    cache.store(committed_ids[:req_cache.length], req_cache)
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..models.base import CausalLM

DEFAULT_MAX_MB = 1024.0  # API, CLI and server default; 0 turns the cache off
DEFAULT_BLOCK_SIZE = 16  # vLLM's default block; divides the compiled runtime's 64-slot tiles


@dataclass
class _Block:
    """Invariants: ``parent`` is -1 or the id of a block in the cache; ``children`` counts
    the cached blocks whose parent is this one; ``nbytes`` is the size of ``kv``."""

    id: int
    key: tuple[int, tuple[int, ...]]  # (parent id, token ids)
    kv: tuple[torch.Tensor, ...]  # the slots' K/V in the backend's layout (read_kv)
    nbytes: int
    children: int = 0
    hidden: torch.Tensor | None = None  # [block_size, F] the tokens' observed features, if kept
    hidden_tag: object = None  # what those features are (``hidden_tag``)

    @property
    def parent(self) -> int:
        return self.key[0]


@dataclass(frozen=True)
class PrefixCacheStats:
    """Cumulative counters (tokens, as vLLM's prefix_cache_queries / _hits) and current size."""

    queries: int  # requests looked up
    hits: int  # requests that reused at least one block
    query_tokens: int  # prompt tokens looked up
    reused_tokens: int  # prompt tokens whose K/V was reused
    stored_blocks: int
    evicted_blocks: int
    blocks: int  # in the cache now
    bytes: int  # in the cache now
    max_bytes: int

    @property
    def hit_rate(self) -> float:
        """Reused / looked-up prompt tokens (0 before any lookup)."""
        return self.reused_tokens / self.query_tokens if self.query_tokens else 0.0


def prefix_cache_support(target: CausalLM) -> str | None:
    """None if ``target`` may reuse K/V across requests, else why not (one line)."""
    if not target.caps.prefix_reuse_exact:
        return (f"{type(target).__name__} does not prefill bitwise the same in one forward and in several, "
                "so reusing a cached prefix could change outputs (the compiled cpu backend can)")
    return None


class PrefixCache:
    """Blocks of K/V of earlier requests, keyed by their exact token prefix; LRU under
    ``max_bytes``. One cache serves one model (``bind``); not thread-safe (the engine thread
    owns it)."""

    def __init__(self, max_bytes: int, block_size: int = DEFAULT_BLOCK_SIZE):
        if max_bytes < 1 or block_size < 1:
            raise ValueError(f"prefix cache: max_bytes and block_size must be >= 1, got {max_bytes}, {block_size}")
        self.max_bytes, self.block_size = int(max_bytes), block_size
        self._blocks: OrderedDict[tuple[int, tuple[int, ...]], _Block] = OrderedDict()  # LRU first
        self._by_id: dict[int, _Block] = {}
        self._ids = itertools.count()
        self._bytes = 0
        self._owner: object | None = None
        self._queries = self._hits = self._query_tokens = self._reused = self._stored = self._evicted = 0

    @classmethod
    def from_mb(cls, max_mb: float | None, block_size: int = DEFAULT_BLOCK_SIZE) -> PrefixCache | None:
        """A cache of ``max_mb`` MiB, or None for 0 / None (off)."""
        if max_mb is None or max_mb == 0:
            return None
        if not 0 < max_mb < float("inf"):
            raise ValueError(f"prefix cache size must be a finite number of MiB >= 0 (0 = off), got {max_mb}")
        return cls(max(1, int(max_mb * 2**20)), block_size)

    def bind(self, target: object) -> None:
        """Tie the cache to one model: K/V of another model's layout must never be reused."""
        if self._owner is not None and self._owner is not target:
            raise ValueError("this prefix cache already serves another model")
        self._owner = target

    # ---- lookup and store ----------------------------------------------------------------
    def restore(self, prompt_ids: Sequence[int], cache) -> int:
        """Append to the empty ``cache`` the K/V of the longest cached prefix of
        ``prompt_ids`` (at most ``len(prompt_ids) - 1`` tokens); returns its length."""
        return self.restore_with_hidden(prompt_ids, cache, None)[0]

    def restore_with_hidden(self, prompt_ids: Sequence[int], cache, hidden_tag: object
                            ) -> tuple[int, torch.Tensor | None]:
        """``restore``; with a ``hidden_tag``, only over blocks that keep features of that
        tag, returned too ([reused, F]; None when nothing is reused or no tag)."""
        if cache.length != 0:
            raise ValueError(f"prefix cache: restore needs an empty cache (length {cache.length})")
        chain = self._match(prompt_ids, (len(prompt_ids) - 1) // self.block_size, hidden_tag)
        for block in chain:
            cache.append_kv(block.kv, self.block_size)
        reused = len(chain) * self.block_size
        self._queries += 1
        self._hits += bool(chain)
        self._query_tokens += len(prompt_ids)
        self._reused += reused
        hidden = torch.cat([b.hidden for b in chain]) if chain and hidden_tag is not None else None
        return reused, hidden

    def cached_length(self, prompt_ids: Sequence[int]) -> int:
        """How many tokens ``restore`` would reuse for ``prompt_ids`` now (nothing counted or touched):
        what a drafter weighs before deciding to start a request."""
        b, parent, n = self.block_size, -1, 0
        for i in range((len(prompt_ids) - 1) // b):
            block = self._blocks.get((parent, tuple(prompt_ids[i * b:(i + 1) * b])))
            if block is None:
                break
            parent, n = block.id, n + b
        return n

    def store(self, token_ids: Sequence[int], cache, hidden: torch.Tensor | None = None,
              hidden_tag: object = None) -> None:
        """Keep the full blocks of ``token_ids``, whose K/V are the first slots of ``cache``
        (new blocks are copied; known ones only become recent); ``hidden`` [n, F]: the
        first n tokens' features (tag ``hidden_tag``), kept with the blocks they cover
        (also for known blocks without them); then evict to the budget."""
        if len(token_ids) > cache.length:
            raise ValueError(f"prefix cache: {len(token_ids)} tokens but only {cache.length} cached slots")
        if hidden is not None and hidden_tag is None:
            raise ValueError("prefix cache: features need a hidden_tag")
        b, parent, chain = self.block_size, -1, []
        covered = 0 if hidden is None else len(hidden) // b  # blocks whose features are all given
        for i in range(len(token_ids) // b):
            key = (parent, tuple(token_ids[i * b:(i + 1) * b]))
            block = self._blocks.get(key)
            if block is None:
                block = self._insert(key, cache.read_kv(i * b, b))
            if i < covered and (block.hidden is None or block.hidden_tag != hidden_tag):
                self._attach(block, hidden[i * b:(i + 1) * b].clone(), hidden_tag)
            chain.append(block)
            parent = block.id
        self._touch(chain)
        self._evict()

    def clear(self) -> None:
        """Drop every block (counters stay)."""
        self._evicted += len(self._blocks)
        self._blocks.clear()
        self._by_id.clear()
        self._bytes = 0

    # ---- facts -----------------------------------------------------------------------------
    @property
    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self._queries, self._hits, self._query_tokens, self._reused, self._stored,
                                self._evicted, len(self._blocks), self._bytes, self.max_bytes)

    def check_integrity(self) -> None:
        """The invariants of ``_Block`` and of the LRU order (every parent after its children)."""
        seen: set[int] = set()
        children: dict[int, int] = {}
        for key, block in self._blocks.items():
            assert block.key == key and self._by_id[block.id] is block, key
            assert len(key[1]) == self.block_size, key
            assert block.id not in seen and block.parent not in seen, f"block {block.id} is newer than its parent"
            assert block.parent == -1 or block.parent in self._by_id, f"block {block.id} lost its parent"
            children[block.parent] = children.get(block.parent, 0) + 1
            seen.add(block.id)
        assert len(self._by_id) == len(self._blocks)
        assert all(b.children == children.get(b.id, 0) for b in self._blocks.values())
        assert all(b.nbytes == sum(t.numel() * t.element_size() for t in (*b.kv, *(() if b.hidden is None else (b.hidden,))))
                   for b in self._blocks.values())
        assert self._bytes == sum(b.nbytes for b in self._blocks.values()) <= self.max_bytes

    # ---- internals ---------------------------------------------------------------------------
    def _match(self, tokens: Sequence[int], max_blocks: int, hidden_tag: object = None) -> list[_Block]:
        """The longest chain of cached blocks that starts ``tokens`` (at most ``max_blocks``),
        with features of ``hidden_tag`` in every block if a tag is given."""
        b, parent, chain = self.block_size, -1, []
        for i in range(max_blocks):
            block = self._blocks.get((parent, tuple(tokens[i * b:(i + 1) * b])))
            if block is None or (hidden_tag is not None and (block.hidden is None or block.hidden_tag != hidden_tag)):
                break
            chain.append(block)
            parent = block.id
        self._touch(chain)
        return chain

    def _insert(self, key: tuple[int, tuple[int, ...]], kv: tuple[torch.Tensor, ...]) -> _Block:
        block = _Block(next(self._ids), key, kv, sum(t.numel() * t.element_size() for t in kv))
        self._blocks[key] = block
        self._by_id[block.id] = block
        if block.parent != -1:
            self._by_id[block.parent].children += 1
        self._bytes += block.nbytes
        self._stored += 1
        return block

    def _attach(self, block: _Block, hidden: torch.Tensor, tag: object) -> None:
        """Give (or replace) a block's features."""
        old = 0 if block.hidden is None else block.hidden.numel() * block.hidden.element_size()
        block.hidden, block.hidden_tag = hidden, tag
        new = hidden.numel() * hidden.element_size()
        block.nbytes += new - old
        self._bytes += new - old

    def _touch(self, chain: list[_Block]) -> None:
        for block in reversed(chain):  # deepest first: each parent ends up after its children
            self._blocks.move_to_end(block.key)

    def _evict(self) -> None:
        while self._bytes > self.max_bytes:
            _, block = self._blocks.popitem(last=False)  # a leaf (parents are more recent)
            del self._by_id[block.id]
            if block.parent != -1:
                self._by_id[block.parent].children -= 1
            self._bytes -= block.nbytes
            self._evicted += 1
