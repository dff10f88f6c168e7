"""The model-backend interface: one forward over new tokens, a KV cache that rolls back.

Glossary (used across verispec):
  committed  tokens that are part of the output (prompt + generated).
  cached     committed tokens whose keys/values are in the KV cache. After every engine
             step ``cache.length == len(committed) - 1``: the newest committed token is
             not cached yet; it is the root of the next draft tree.
  slot       a cache position. Tokens fed in one forward occupy slots
             ``cache.length ... cache.length + N - 1`` in input order.

A backend never knows about drafts or acceptance. The engine asks it for logits over a
flattened tree (``tree_mask``) and then tells the cache which slots to keep (``compact``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from ..errors import ModelError as ModelError  # defined in verispec.errors; importable from here too
from ..errors import NonFiniteLogits as NonFiniteLogits
from .formats import WeightFormat, formats_label


def one_line(err: BaseException) -> str:
    """First line of an exception's text, for ModelError messages that stay one line."""
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


@dataclass(frozen=True)
class ModelInfo:
    """Static facts about a loaded model that the engine and drafters need."""

    name: str
    vocab_size: int
    max_length: int  # longest supported sequence (prompt + generation)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    hidden_size: int
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True)
class Exactness:
    """Is a backend's speculative greedy output bit-identical to plain decoding here, and why
    (not)? Backends measure this on the machine they run on (kernels differ per CPU ISA);
    the CLI reports it next to the speculation statistics so no claim is silent."""

    bit_exact: bool
    reason: str


NOT_CLAIMED = Exactness(False, "this backend does not claim batch invariance: logits may differ in the last "
                               "bits between forwards of different sizes, so a near-tie can flip a token")


@dataclass(frozen=True)
class BackendCaps:
    """What a backend can do, declared by the backend (its ``caps``), so the engine reads
    flags instead of probing for methods. The defaults are what a backend declaring nothing
    gets (``CausalLM.caps``): one request per forward, nothing reused, nothing claimed."""

    batched: bool = False  # forward_batch over rows of one new_cache_pool (PooledLM): one verify for a batch
    # a token's K/V is bitwise the same prefilled in one forward or in several (a reused
    # prefix, then the rest): only then may a prefix cache reuse K/V (engine.prefix_cache)
    prefix_reuse_exact: bool = False
    exactness: Exactness = NOT_CLAIMED  # speculative greedy output == plain decoding, bit for bit, here?
    # torch's thread count while a step runs (the compiled runtime computes in its own pool:
    # 1, so the step's torch glue never wakes OpenMP threads that spin on its cores); None: leave it
    host_threads: int | None = None
    min_verify_rows: int = 1  # tokens per row a batched forward costs at least (native's padded rows)
    copy_prefix: bool = False  # its caches copy a prompt's K/V from another cache (Engine.fork shares a prefill)
    # draft_chain(cache, feed, budget, ...): a greedy or sampled draft chain, stop rule included, in one call (a draft
    # model's tokens without Python between them: models.cpu)
    chain_drafting: bool = False


@dataclass(frozen=True)
class ModelOutput:
    logits: torch.Tensor  # [B, N, V] float32
    hidden: torch.Tensor | None  # [B, N, H] last hidden state (after final norm), if asked
    # [B, N, len(hidden_layers) * H]: the residual stream after each asked decoder layer,
    # concatenated in the order asked (EAGLE-3's low/mid/high features); None if none asked
    layers: torch.Tensor | None = None


def check_hidden_layers(layers: tuple[int, ...], n_layers: int) -> tuple[int, ...]:
    """``layers`` as a tuple of distinct decoder-layer indices in [0, n_layers), or ValueError."""
    layers = tuple(int(i) for i in layers)
    if len(set(layers)) != len(layers) or any(not 0 <= i < n_layers for i in layers):
        raise ValueError(f"hidden_layers must be distinct layer indices in [0, {n_layers}), got {list(layers)}")
    return layers


@runtime_checkable
class KVCache(Protocol):
    """Per-request (or per-batch) key/value store addressed by slot.

    Invariants: slots ``0 .. length-1`` hold keys/values of tokens in sequence order;
    nothing past ``length`` is ever attended to.
    """

    @property
    def length(self) -> int: ...

    def truncate(self, new_length: int) -> int:
        """Drop slots ``new_length..``; returns how many were dropped (0 if already shorter)."""
        ...

    def compact(self, src_slots: list[int], dst_start: int) -> None:
        """Move slots ``src_slots`` (ascending) to ``dst_start, dst_start+1, ...``, then
        truncate to ``dst_start + len(src_slots)``. Used to keep an accepted tree path."""
        ...


@runtime_checkable
class CausalLM(Protocol):
    """A decoder-only LM backend (target or draft).

    ``forward`` runs ``N`` new tokens per row. ``positions`` are absolute positions
    (RoPE). ``tree_mask`` ([N, N] bool, True = may attend) says which new tokens see which
    other new tokens; every new token also sees all cached slots. ``tree_mask=None``
    means causal. The keys/values of the new tokens are appended to the cache.
    ``last_logits_only`` returns logits [1, 1, V] of the last token only (a prefill needs
    no more, and the LM head over a long prompt is a large share of its cost).

    A backend subclasses this protocol and so declares, besides ``info``, what the engine,
    the loader and the statistics read, instead of leaving them to be probed: ``caps``
    (batched forwards, exact prefix reuse, its exactness claim, ...; by default nothing),
    ``description``, ``formats``, ``isa``, ``threads``, ``gguf_path`` and ``resident_bytes``.
    """

    info: ModelInfo
    caps: BackendCaps = BackendCaps()
    description: str  # how statistics name it, e.g. "compiled CPU runtime (q4_1, avx2, 2 threads)"
    formats: tuple[WeightFormat, ...]  # the weight formats its layers compute with, e.g. (Q4_K, Q6_K) or (INT4,)
    isa: str = ""  # the instruction set its own kernels were chosen for (the compiled runtime's); "": torch's
    gguf_path: Path | None = None  # the GGUF whose own blocks it reads in place (None: weights converted)
    resident_bytes: int  # bytes of weights it holds in memory

    @property
    def quant(self) -> str:
        """``formats`` as statistics and cost-curve keys name them: ``int4``, ``q4_k+q6_k``."""
        return formats_label(self.formats)

    @property
    def threads(self) -> int:
        """Threads its forward computes on (torch's, unless the backend has its own pool)."""
        return torch.get_num_threads()

    def set_threads(self, n: int) -> None:
        """Compute on ``n`` threads from now on."""
        if n < 1:
            raise ValueError(f"threads must be >= 1, got {n}")
        torch.set_num_threads(n)

    def new_cache(self, max_length: int | None = None) -> KVCache: ...

    def forward(
        self,
        input_ids: torch.Tensor,  # [1, N] long
        positions: torch.Tensor,  # [1, N] long
        cache: KVCache,
        tree_mask: torch.Tensor | None = None,  # [N, N] bool
        want_hidden: bool = False,
        last_logits_only: bool = False,
        hidden_layers: tuple[int, ...] = (),  # also return these layers' outputs (ModelOutput.layers)
    ) -> ModelOutput: ...


def causal_tree_mask(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[n, n] lower-triangular bool mask: a chain where token i sees tokens 0..i."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


def model_bytes(model: CausalLM | torch.nn.Module) -> int:
    """Resident weight bytes of a model: a backend's declared ``resident_bytes``, or the
    parameters and buffers of a torch module (a transformers peer)."""
    if isinstance(model, torch.nn.Module):
        return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    return int(model.resident_bytes)
