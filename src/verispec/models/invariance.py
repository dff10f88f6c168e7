"""Batch invariance of the PyTorch runtime (models/native.py): invariant attention and the
calibration that decides, per machine, how many rows a forward is padded to.

``BatchInvariance`` is the one object the model asks: does a forward of n tokens take the
invariant path, how many rows is it padded to, how many query rows does attention pad to,
and is the result bit-exact here (``exactness``, with the reason when it is not). It
measures the kernels at load time and again when torch's thread count changes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from verispec.models.base import Exactness, ModelError
from verispec.models.llama import LlamaArgs

if TYPE_CHECKING:
    from verispec.models.native import NativeOptions


# ----------------------------------------------------------------------------- invariant attention


def pairwise_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over ``dim`` as a binary tree over absolute indices (zero-padded to even at each
    level). Appending zeros never changes the result (a zero subtree sums to exactly 0 and
    ``x + 0 == x``), unlike ``torch.sum``, whose grouping depends on the length.
    Example: [a, b, c] -> [(a+b), (c+0)] -> [(a+b)+c]."""
    dim = dim % x.dim()
    while x.shape[dim] > 1:
        if x.shape[dim] % 2:
            pad = [0, 0] * (x.dim() - dim - 1) + [0, 1]
            x = F.pad(x, pad)
        x = x.unflatten(dim, (-1, 2)).sum(dim + 1)  # a sum of two is one rounding: order-free
    return x.squeeze(dim)


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., M, K] @ b [..., K, N] (same batch dims) as one contiguous 3-D ``torch.bmm``.

    One canonical call: torch picks different kernels for broadcast or strided operands
    (batched GEMM vs a loop of addmm), and those round differently."""
    batch = a.shape[:-2]
    out = torch.bmm(a.reshape(-1, *a.shape[-2:]).contiguous(), b.reshape(-1, *b.shape[-2:]).contiguous())
    return out.view(*batch, *out.shape[-2:])


def _pad_rows(x: torch.Tensor, dim: int, rows: int) -> torch.Tensor:
    """Zero-pad ``dim`` of x up to ``rows`` (matmul kernels may round differently for few rows)."""
    missing = rows - x.shape[dim]
    if missing <= 0:
        return x
    return F.pad(x, [0, 0] * (x.dim() - dim % x.dim() - 1) + [0, missing])


def invariant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_shared: int, tail_idx: torch.Tensor,
                        tail_mask: torch.Tensor, chunk: int, min_rows: int = 1) -> torch.Tensor:
    """Attention whose result for a query row depends only on that row's own key sequence.

    q [B, Hkv, G, Np, D] (already scaled); k, v [B, Hkv, S, D] cache rows. Keys are cut into
    chunks of ``chunk`` absolute slots. The first ``n_shared`` chunks hold only cached slots
    and are shared by all rows; the remaining (tail) chunks are laid out per new token as in
    sequential decoding: ``tail_idx`` [B, Np, T] gives the slot at each virtual position
    (cached slots, then the token's root-to-node path), ``tail_mask`` [B, Np, T] which are real.
    Per chunk: fixed-shape matmuls (query rows padded to ``min_rows``), exact zeros for
    masked keys; across chunks: ``pairwise_sum``. Returns [B, Hkv, G, Np, D] in q.dtype.
    """
    scores_sh, v_sh = _shared_chunks(q, k, v, n_shared, chunk, min_rows)  # [B, Hkv, G, Np, nS, chunk]
    scores_t, v_t = _tail_chunks(q, k, v, tail_idx, tail_mask, chunk, min_rows)  # [B, Hkv, G, Np, nT, chunk]
    scores = torch.cat([scores_sh, scores_t], dim=4)  # [B, Hkv, G, Np, nC, chunk]
    p = torch.exp(scores - scores.amax(dim=(4, 5), keepdim=True))  # amax is order-free; masked -> 0
    out = torch.cat([_weigh_shared(p[:, :, :, :, :n_shared], v_sh, min_rows),
                     _weigh_tail(p[:, :, :, :, n_shared:], v_t, min_rows)], dim=4)  # [B, Hkv, G, Np, nC, D]
    parts = torch.cat([out, p.sum(-1, keepdim=True)], dim=-1)  # [B, Hkv, G, Np, nC, D + 1]
    total = pairwise_sum(parts, dim=4)  # [B, Hkv, G, Np, D + 1]
    return (total[..., :-1] / total[..., -1:]).to(q.dtype)


def _shared_chunks(q, k, v, n_shared, chunk, min_rows):
    """Scores of all rows against the shared chunks -> [B, Hkv, G, Np, nS, chunk], and v chunks."""
    b, h, g, n, d = q.shape
    kc = k[:, :, :n_shared * chunk].float().view(b, h, n_shared, chunk, d)  # [B, Hkv, nS, chunk, D]
    vc = v[:, :, :n_shared * chunk].float().view(b, h, n_shared, chunk, d)
    rows = _pad_rows(q.float().reshape(b, h, 1, g * n, d), 3, min_rows)  # [B, Hkv, 1, M, D]
    rows = rows.expand(b, h, n_shared, *rows.shape[3:])  # [B, Hkv, nS, M, D]
    scores = bmm(rows, kc.transpose(-1, -2))[:, :, :, :g * n]  # [B, Hkv, nS, G * Np, chunk]
    return scores.view(b, h, n_shared, g, n, chunk).permute(0, 1, 3, 4, 2, 5), vc


def _tail_chunks(q, k, v, tail_idx, tail_mask, chunk, min_rows):
    """Scores of each token against its own tail layout -> [B, Hkv, G, Np, nT, chunk], and v."""
    b, h, g, n, d = q.shape
    t = tail_idx.shape[2]
    kt = _gather_slots(k, tail_idx).view(b, h, n, t // chunk, chunk, d)  # [B, Hkv, Np, nT, chunk, D]
    vt = _gather_slots(v, tail_idx).view(b, h, n, t // chunk, chunk, d)
    rows = _pad_rows(q.float().transpose(2, 3), 3, min_rows).unsqueeze(3)  # [B, Hkv, Np, 1, Gp, D]
    rows = rows.expand(b, h, n, t // chunk, *rows.shape[4:])  # [B, Hkv, Np, nT, Gp, D]
    scores = bmm(rows, kt.transpose(-1, -2))[:, :, :, :, :g]  # [B, Hkv, Np, nT, G, chunk]
    mask = tail_mask.view(b, 1, n, t // chunk, 1, chunk)
    return scores.masked_fill(~mask, float("-inf")).permute(0, 1, 4, 2, 3, 5), vt


def _gather_slots(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, Hkv, S, D] at slots idx [B, Np, T] -> [B, Hkv, Np * T, D] fp32."""
    if x.shape[0] == 1:  # index_select is much faster than gather on CPU
        return x[0].index_select(1, idx.reshape(-1)).float().unsqueeze(0)
    rows = torch.arange(x.shape[0], device=x.device)[:, None]
    return x[rows, :, idx.reshape(x.shape[0], -1)].permute(0, 2, 1, 3).float()  # [B, Np*T, Hkv, D] -> ...


def _weigh_shared(p, v_sh, min_rows):
    """p [B, Hkv, G, Np, nS, chunk] @ v [B, Hkv, nS, chunk, D] -> [B, Hkv, G, Np, nS, D]."""
    b, h, g, n, ns, c = p.shape
    rows = _pad_rows(p.permute(0, 1, 4, 2, 3, 5).reshape(b, h, ns, g * n, c), 3, min_rows)  # [B, Hkv, nS, M, chunk]
    out = bmm(rows, v_sh)[:, :, :, :g * n]  # [B, Hkv, nS, G * Np, D]
    return out.view(b, h, ns, g, n, v_sh.shape[-1]).permute(0, 1, 3, 4, 2, 5)


def _weigh_tail(p, v_t, min_rows):
    """p [B, Hkv, G, Np, nT, chunk] @ v [B, Hkv, Np, nT, chunk, D] -> [B, Hkv, G, Np, nT, D]."""
    g = p.shape[2]
    rows = _pad_rows(p.permute(0, 1, 3, 4, 2, 5), 4, min_rows)  # [B, Hkv, Np, nT, Gp, chunk]
    return bmm(rows, v_t)[:, :, :, :, :g].permute(0, 1, 4, 2, 3, 5)


def tail_layout(tree: torch.Tensor, lengths: torch.Tensor, start: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token key layout of slots ``start .. start+size-1`` as sequential decoding sees it.

    tree [B, Np, Np] bool (ancestor-or-self), lengths [B, 1] (cache length before the
    forward). Virtual position w < length is slot w; w = length + r is the r-th node on the
    token's root-to-node path (slot length + that node's index). Returns slot indices and
    validity, both [B, Np, size]. Example: length 2, tree nodes 0 <- 1, 0 <- 2, start 0,
    size 4: token 2 sees slots [0, 1, 2, 4] (its parent 0 sits at slot 2, itself at slot 4).
    """
    b, n, _ = tree.shape
    r = torch.arange(start, start + size, device=tree.device)[None, None, :] - lengths[:, :, None]  # [B, 1, size]
    rank = tree.long().cumsum(-1) - 1  # [B, Np, Np]: position of node j on token i's path
    path = torch.zeros(b, n, n + 1, dtype=torch.long, device=tree.device)  # [B, Np, Np + 1]
    path.scatter_(2, torch.where(tree, rank, n), torch.arange(n, device=tree.device).expand(b, n, n))
    depth = tree.sum(-1, keepdim=True)  # [B, Np, 1] path length
    on_path = (r >= 0) & (r < depth)  # [B, Np, size]
    node = path.gather(2, r.clamp(0, n - 1).expand(b, n, size))
    slots = torch.where(r < 0, r + lengths[:, :, None], torch.where(on_path, lengths[:, :, None] + node, 0))
    return slots, (r < 0) | on_path


# ----------------------------------------------------------------------------- calibration


@dataclass(frozen=True)
class RowProbe:
    """A row-wise function to calibrate: ``fn(x [M, width]) -> [M, ...]``."""

    name: str
    fn: Callable[[torch.Tensor], torch.Tensor]
    width: int
    dtype: torch.dtype
    # what selects the kernel (op, weight type and shape): probes with equal keys share one
    # measurement per process, thread count and ISA; None: always measure
    key: tuple | None = None


class NotInvariant(ModelError):
    """A kernel's rows depend on more than their own input, and no padding fixes that."""


PROBE_ELEMENTS = 1 << 17  # output elements compared per row count and probe (see calibrate_min_rows)


def calibrate_min_rows(probes: list[RowProbe], row_counts: list[int], device: torch.device, seed: int = 0) -> int:
    """Smallest m in ``row_counts`` such that, for every probe and every row count c >= m,
    every row computed in a forward of c rows is bitwise equal to the same row computed in
    a forward of the largest count, and a row's result does not depend on its index.

    Every row is checked at every count (the probe rows are cut into consecutive blocks of
    c), over at least ``PROBE_ELEMENTS`` outputs: a bf16 output hides most fp32 rounding
    differences (oneDNN's AVX-512-BF16 GEMV, K=1536, flips ~2 in 10^4 outputs), so one
    row of a sliced weight is not enough evidence. Raises NotInvariant on index dependence.
    """
    counts = sorted(set(row_counts))
    need = counts[0]
    for p in probes:
        key = None if p.key is None else (p.key, p.dtype, str(device), torch.get_num_threads(), cpu_isa(), tuple(counts), seed)
        if key not in _CALIBRATED:
            _CALIBRATED[key] = _probe_min_rows(p, counts, device, seed)
        found = _CALIBRATED.pop(key) if key is None else _CALIBRATED[key]
        if isinstance(found, str):
            raise NotInvariant(found)
        need = max(need, found)
    return need


_CALIBRATED: dict[tuple | None, int | str] = {}  # kernel signature -> its min rows (or why none)


def _probe_min_rows(p: RowProbe, counts: list[int], device: torch.device, seed: int) -> int | str:
    """One probe's smallest invariant count, or a message saying why there is none."""
    g = torch.Generator().manual_seed(seed)
    x, ref = _probe_reference(p, counts[-1], device, g)
    perm = torch.randperm(counts[-1], generator=g).to(device)
    if not torch.equal(p.fn(x[perm]), ref[perm]):
        return (f"rows of {p.name} ({p.dtype}) depend on their index on {cpu_isa()}; no padding "
                "makes it invariant, so speculative output may differ from plain decoding")
    i = len(counts) - 1
    while i > 0 and _rows_agree(p, x, ref, counts[i - 1]):
        i -= 1
    return counts[i]


def _probe_reference(p: RowProbe, top: int, device: torch.device, g: torch.Generator):
    """Random probe rows (a multiple of ``top``, >= PROBE_ELEMENTS outputs) and their
    outputs computed in blocks of ``top`` rows."""
    x = torch.randn(top, p.width, generator=g).to(device, p.dtype)
    per_row = p.fn(x)[0].numel()
    blocks = max(1, -(-PROBE_ELEMENTS // (top * per_row)))
    x = torch.cat([x, torch.randn((blocks - 1) * top, p.width, generator=g).to(device, p.dtype)])
    return x, torch.cat([p.fn(x[j:j + top]) for j in range(0, len(x), top)])


def _rows_agree(p: RowProbe, x: torch.Tensor, ref: torch.Tensor, count: int) -> bool:
    """Every block of ``count`` consecutive probe rows reproduces the reference bitwise."""
    return all(torch.equal(p.fn(x[j:j + count]), ref[j:j + count]) for j in range(0, len(x) - count + 1, count))


def cpu_isa() -> str:
    """The kernel families in use: ATen's CPU capability and oneDNN's ISA cap, if any."""
    cap = "ATen " + torch.backends.cpu.get_cpu_capability()
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA")
    return f"{cap}, oneDNN max ISA {onednn}" if onednn else cap


def attention_probes(n_kv_heads: int, head_dim: int, chunk: int, device: torch.device) -> list[RowProbe]:
    """The two fp32 matmuls of ``invariant_attention`` (q @ k.T and p @ v) as row probes."""
    g = torch.Generator().manual_seed(2)
    kc = torch.randn(1, n_kv_heads, 2, chunk, head_dim, generator=g).to(device)  # [1, Hkv, C, chunk, D]

    def rows(y: torch.Tensor) -> torch.Tensor:  # [1, Hkv, C, M, X] -> [M, Hkv * C * X]
        return y.permute(3, 0, 1, 2, 4).reshape(y.shape[3], -1)

    def qk(x: torch.Tensor) -> torch.Tensor:  # x [M, D]
        return rows(bmm(x.expand(1, n_kv_heads, 2, *x.shape), kc.transpose(-1, -2)))

    def pv(x: torch.Tensor) -> torch.Tensor:  # x [M, chunk]
        return rows(bmm(x.expand(1, n_kv_heads, 2, *x.shape), kc))

    key = ("bmm", n_kv_heads, head_dim, chunk)
    return [RowProbe("attention q@k", qk, head_dim, torch.float32, key + ("qk",)),
            RowProbe("attention p@v", pv, chunk, torch.float32, key + ("pv",))]


def check_window_invariance(args: LlamaArgs, chunk: int, device: torch.device, min_rows: int) -> None:
    """A chunk must give the same result as a shared or a tail chunk, and trailing masked
    chunks must change nothing: compare three splittings of the same 2-chunk sequence."""
    g = torch.Generator().manual_seed(1)
    b, h, d, n = 1, args.n_kv_heads, args.head_dim, 2
    q = torch.randn(b, h, args.group, n, d, generator=g).to(device)
    k, v = (torch.randn(b, h, 4 * chunk, d, generator=g).to(device) for _ in range(2))
    tree = torch.eye(n, dtype=torch.bool, device=device)[None]
    length = 2 * chunk - 1  # the two tokens sit at slots 2*chunk - 1 and 2*chunk
    outs = []
    for shared, size in ((0, 3 * chunk), (1, 2 * chunk), (1, 3 * chunk)):
        idx, valid = tail_layout(tree, torch.tensor([[length]], device=device), shared * chunk, size)
        outs.append(invariant_attention(q, k, v, shared, idx, valid, chunk, min_rows))
    if not all(torch.equal(outs[0], o) for o in outs[1:]):
        raise NotInvariant(f"chunked attention is not exact under re-splitting on {cpu_isa()}")


# ----------------------------------------------------------------------------- the decisions


class BatchInvariance:
    """One model's invariant-path decisions on this machine (native.py's module docstring).

    ``on``: invariant forwards at all; ``min_rows``: an invariant forward is padded to at
    least this many token rows; ``attn_min_rows``: invariant attention pads its query rows
    to at least this; ``threads``: the torch thread count they were measured with (None: not
    measured); ``exactness``: the claim, with its reason. ``linear_probes()`` gives the
    model's row-wise kernels (its linears and RMSNorm at their full shapes) to measure."""

    def __init__(self, opts: NativeOptions, args: LlamaArgs, device: torch.device,
                 linear_probes: Callable[[], list[RowProbe]]):
        self._opts, self._args, self._device, self._linear_probes = opts, args, device, linear_probes
        self._resolve()

    def covers(self, n: int) -> bool:
        """Does a forward of n tokens take the invariant path? (Else the fast path: a prefill.)"""
        return self.on and n <= self._opts.max_rows

    def padded_rows(self, n: int) -> int:
        """Token rows a forward of n tokens runs with: n plus dummy rows."""
        return max(n, self.min_rows) if self.covers(n) else n

    def check_threads(self) -> None:
        """MKL rounds differently per thread count (fp32, 2 threads: M=5..7 and 9..11 differ
        from M>=12; 1 thread: M>=4 agree), so a calibration holds for one thread count."""
        if self.threads not in (None, torch.get_num_threads()):
            self._resolve()

    def _resolve(self) -> None:
        """Decide from the caller's options, measuring what they leave open: bit-exact only
        when this machine's kernels were measured invariant under that padding."""
        o = self._opts
        if not o.batch_invariant:
            return self._set(False, 1, 1, None, Exactness(False, "batch_invariant=False: every forward takes the "
                                                                  "fast path, whose rows round differently for "
                                                                  "different forward sizes"))
        if o.min_rows is not None and not 1 <= o.min_rows <= o.max_rows:
            raise ValueError(f"min_rows must be in [1, max_rows={o.max_rows}], got {o.min_rows}")
        if o.min_rows is not None and o.attn_min_rows is not None:
            return self._set(True, o.min_rows, o.attn_min_rows, None, Exactness(
                False, f"min_rows={o.min_rows}, attn_min_rows={o.attn_min_rows} were set by the caller, "
                       "not calibrated: invariance is not verified"))
        try:
            rows, attn_rows = self._calibrate()
        except NotInvariant as err:  # no padding helps: run fast, say so
            return self._set(False, 1, 1, None, Exactness(False, str(err)))
        threads = torch.get_num_threads()
        self._set(True, rows, attn_rows, threads, Exactness(
            True, f"every kernel measured row-invariant on {cpu_isa()} with {threads} threads when padded to "
                  f"{rows} rows (attention: {attn_rows})"))

    def _set(self, on: bool, min_rows: int, attn_min_rows: int, threads: int | None, exactness: Exactness) -> None:
        self.on, self.min_rows, self.attn_min_rows = on, min_rows, attn_min_rows
        self.threads, self.exactness = threads, exactness

    def _calibrate(self) -> tuple[int, int]:
        """(min_rows, attn_min_rows), each the caller's or measured at full shapes for every
        kernel the invariant path runs. Raises NotInvariant."""
        o, a, dev = self._opts, self._args, self._device
        rows = o.min_rows
        if rows is None:
            rows = calibrate_min_rows(self._linear_probes(), list(range(1, o.max_rows + 1)), dev)
        attn_rows = o.attn_min_rows
        if attn_rows is None:
            # attention matmuls see G * Np rows (shared chunks) or G rows padded (tail chunks)
            counts = list(range(1, a.group + 1)) + [a.group * n for n in range(1, o.max_rows + 1)]
            attn_rows = calibrate_min_rows(attention_probes(a.n_kv_heads, a.head_dim, o.attn_chunk, dev), counts, dev)
        check_window_invariance(a, o.attn_chunk, dev, attn_rows)
        return rows, attn_rows
