"""Logits -> the target distribution. The single source of truth for what "sampling from the
target" means: plain decoding, every verifier and every drafter call these functions, so
logit processing is identical on all paths (temperature, then min-p, then top-k, then
top-p, the order of vLLM's sampler). History-dependent adjustments (logit bias, penalties)
come before these, in ``logits_processing.py``."""

from __future__ import annotations

import math

import torch

from .errors import NonFiniteLogits
from .types import SamplingParams

NON_FINITE = ("the model computed NaN or infinite logits: its weights or metadata are corrupt "
              "(NaN or inf weights, quantization scales or norm epsilon); check or replace the model file")


def check_logits(logits: torch.Tensor) -> None:
    """Every row of [N, V] logits must name a token: no NaN, no +inf, and at least one finite
    value; else NonFiniteLogits. -inf alone is legitimate: a token masked by top-k, a logit
    processor or a reduced LM head (FR-Spec). One reduction: a row's max is NaN when it holds
    a NaN, +inf when it holds a +inf, and -inf when nothing in it is finite."""
    if not bool(torch.isfinite(logits.amax(-1)).all()):
        raise NonFiniteLogits(NON_FINITE)


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[N, V] raw logits -> [N, V] float32 logits after temperature, min-p, top-k and top-p
    (filtered entries are -inf). Not for greedy decoding (temperature 0).

    min-p (Nguyen et al. 2024, "Turning Up the Heat: Min-p Sampling"): drop tokens whose
    probability is below ``min_p`` times the most likely token's."""
    logits = logits.float() / params.temperature
    if params.min_p > 0.0:
        top = logits.max(-1, keepdim=True).values  # [N, 1]
        # p(x) < min_p * p_max  <=>  logit(x) < logit_max + log(min_p)
        logits = logits.masked_fill(logits < top + math.log(params.min_p), float("-inf"))
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [N, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)  # [N, V]
        # drop a token when the mass before it already reaches top_p (keeps at least one)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= params.top_p
        # the most likely token always stays: a top_p below float32's smallest value (~1.4e-45)
        # compares as 0.0, and the mass before the first token (0) would drop it too
        drop_sorted[..., 0] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[N, V] logits -> [N, V] probabilities the engine samples from (one-hot when greedy)."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return process_logits(logits, params).softmax(-1)


SAMPLE_BLOCK = 512  # tokens per block of sample's two-level inverse CDF


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token from a [V] distribution with a request's own generator: the inverse CDF at
    one U(0, 1) draw, the cumulative sums in float64 (the law is ``probs``' up to float64
    rounding). Two levels: block sums of SAMPLE_BLOCK tokens locate the block, then the block's
    own running sum the token, so a draw reads the vector once (torch.multinomial draws one
    exponential per token: ~2 ms over a 152k vocabulary, a tenth of a decode step).
    A distribution that is not one (NaN, inf or negative entries, or no mass: what non-finite
    logits give after softmax) raises NonFiniteLogits."""
    p = probs.reshape(-1)
    n, B = p.numel(), SAMPLE_BLOCK
    full = n // B
    blocks = p[:full * B].view(full, B).sum(1, dtype=torch.float64)
    if n % B:
        blocks = torch.cat([blocks, p[full * B:].sum(dtype=torch.float64)[None]])
    cum = blocks.cumsum(0)
    total = float(cum[-1]) if n else 0.0
    if not (math.isfinite(total) and total > 0) or float(p.min()) < 0:
        raise NonFiniteLogits(NON_FINITE)
    u = torch.rand((), generator=generator, dtype=torch.float64, device=generator.device)
    point = u.to(p.device) * total
    b = min(int(torch.searchsorted(cum, point, right=True)), len(cum) - 1)
    seg = p[b * B:(b + 1) * B].to(torch.float64).cumsum(0)
    if b:
        seg += cum[b - 1]
    i = int(torch.searchsorted(seg, point, right=True))
    if i == len(seg):  # rounding put the point past the block's own running sum: its last token with mass
        i = int(torch.nonzero(p[b * B:(b + 1) * B]).max())
    return b * B + i


def uniform(generator: torch.Generator) -> float:
    """One U(0, 1) draw from a request's generator (acceptance tests)."""
    return float(torch.rand((), generator=generator).item())


def make_generator(seed: int, salt: int = 0) -> torch.Generator:
    """A CPU generator per request (and per role: salt 0 verifier, 1 drafter), so requests
    never share randomness and output is reproducible from the seed alone."""
    g = torch.Generator(device="cpu")
    g.manual_seed((seed * 1_000_003 + salt) % (2**63))
    return g
