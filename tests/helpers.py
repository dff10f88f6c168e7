"""Test-only drafters and helpers (kept out of the package)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import ClassVar

import torch

from verispec.drafters.base import DraftContext, NoDrafter, StatelessDrafter
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.eagle import Eagle3Head, EagleConfig, EagleDrafter, EagleHead, load_target_embedding
from verispec.engine import Engine
from verispec.sampling import target_probs
from verispec.tree import DraftTree
from verispec.types import SamplingParams


def shared_file(rel: str) -> Path:
    """``shared/<rel>``, the developers' read-only data beside the checkout (tests only: the
    package ships what it needs itself, ``verispec.data``)."""
    for directory in Path(__file__).resolve().parents:
        if (directory / "shared" / rel).is_file():
            return directory / "shared" / rel
    raise FileNotFoundError(f"shared/{rel} not found above {Path(__file__).parent}")


class OracleDrafter(StatelessDrafter):
    """Knows the plain-decoding output; drafts ``correct`` right tokens, then wrong ones."""

    name: ClassVar[str] = "oracle"

    def __init__(self, reference: list[int], correct: int, vocab: int):
        self.reference, self.correct, self.vocab = reference, correct, vocab

    def propose(self, ctx: DraftContext) -> DraftTree:
        pos = len(ctx.tokens)
        truth = self.reference[pos: pos + ctx.budget]
        drafts = [t if i < self.correct else (t + 1) % self.vocab for i, t in enumerate(truth)]
        return DraftTree.chain(ctx.tokens[-1], drafts)


class RandomDrafter(StatelessDrafter):
    """Random chains and trees (nearly always rejected): exercises rollback paths."""

    name: ClassVar[str] = "random"

    def __init__(self, vocab: int, seed: int = 0, tree: bool = False):
        self.vocab, self.tree, self.g = vocab, tree, torch.Generator().manual_seed(seed)

    def propose(self, ctx: DraftContext) -> DraftTree:
        n = ctx.budget
        toks = torch.randint(0, self.vocab, (n,), generator=self.g).tolist()
        if not self.tree:
            return DraftTree.chain(ctx.tokens[-1], toks)
        parents = [-1] + [int(torch.randint(0, i + 1, (), generator=self.g)) for i in range(n)]
        return DraftTree(tokens=(ctx.tokens[-1], *toks), parents=tuple(parents))


def stories_eagle3(model, mode: str = "tree", layers: tuple[int, ...] = (0, 2, 4), favour: int | None = None,
                   sharpness: float = 0.4) -> EagleDrafter:
    """An untrained EAGLE-3 drafter (random head, seed 0) for the stories260K ``model`` (a
    LoadedModel), reading target layers ``layers``. With ``favour`` (a token id) fc's bias
    points at that token's embedding and the final norm is ``sharpness``: q then puts a
    fixed share on ``favour`` whatever the context (often accepted, yet unlike p)."""
    cfg = EagleConfig.from_target_config(json.loads((model.hf_dir / "config.json").read_text()), hidden_layers=layers)
    embed = load_target_embedding(model.hf_dir)  # [V, H]
    torch.manual_seed(0)
    head = Eagle3Head(cfg)
    if favour is not None:
        with torch.no_grad():
            head.fc.bias.add_(30 * embed[favour] / embed[favour].norm())  # dwarfs the layer's residuals
            head.final_norm.fill_(sharpness)
    return EagleDrafter(head, embed, mode=mode, depth=3, top_k=3)


class Recorder:
    """A target that records every forward's logits (delegates everything else)."""

    def __init__(self, model):
        self.model, self.logits = model, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, *args, **kw):
        out = self.model.forward(*args, **kw)
        self.logits.append(out.logits.clone())
        return out


def run(target, drafter, prompt, params: SamplingParams, k: int = 6, policy: str = "fixed"):
    """Generate to completion; returns (generated ids, stats)."""
    engine = Engine(target, drafter, k, policy)
    req = engine.add_request(prompt, params)
    while not req.finished:
        engine.step(req)
    return req.generated, req.stats


def same_first_tokens_law(target, drafter, prompt: list[int], seeds: int = 250, k: int = 3) -> float:
    """p-value of a two-sample chi-square test: the joint law of generated tokens 2-3
    (committed by speculative steps) with ``drafter`` vs plain sampling, each over
    ``seeds`` seeds (disjoint); bins with fewer than 8 pooled counts are merged."""
    from collections import Counter

    from scipy.stats import chi2_contingency

    from verispec.drafters.base import NoDrafter

    def histogram(d, first_seed):
        out = Counter()
        for s in range(first_seed, first_seed + seeds):
            ids, _ = run(target, d, prompt, SamplingParams(temperature=1.0, max_new_tokens=4, seed=s,
                                                           ignore_eos=True), k=k)
            out[tuple(ids[1:3])] += 1
        return out

    plain, spec = histogram(NoDrafter(), 0), histogram(drafter, 1000)
    keys = [key for key in set(plain) | set(spec) if plain[key] + spec[key] >= 8]
    table = [[h[key] for key in keys] + [sum(h.values()) - sum(h[key] for key in keys)] for h in (plain, spec)]
    return chi2_contingency(table).pvalue


def law_pvalue(samples: torch.Tensor, p: torch.Tensor) -> float:
    """Chi-square p-value of token ``samples`` ([S] long) against the exact law ``p`` ([V]);
    cells expecting fewer than 5 draws are pooled (tokens of probability 0 are no cell). Asserts no draw has
    probability 0."""
    from scipy.stats import chisquare

    p = p.double()
    counts = torch.bincount(samples, minlength=p.numel()).double()
    assert counts[p == 0].sum() == 0, "a token with probability 0 was drawn"
    big = p * len(samples) >= 5
    small = ~big & (p > 0)
    pooled = [small] if small.any() else []  # the pooled cell, when some cell with mass is small
    obs = torch.cat([counts[big], *(counts[c].sum()[None] for c in pooled)])
    exp = torch.cat([p[big], *(p[c].sum()[None] for c in pooled)]) * len(samples)
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


def assert_target_law(target, context: list[int], samples: list[int], params: SamplingParams) -> None:
    """``samples`` (tokens drawn after ``context``) follow the target's p(. | context) at
    ``params`` (chi-square, ``law_pvalue``)."""
    ids = torch.tensor([context])
    logits = target.forward(ids, torch.arange(ids.shape[1])[None], target.new_cache()).logits[0, -1:]
    assert law_pvalue(torch.tensor(samples), target_probs(logits, params)[0]) > 1e-3


class TemperedSelfDraft(DraftModelDrafter):
    """The target itself at a lower temperature: q close to but unlike p, so acceptance is
    frequent and any bias in the acceptance rule shows in the law."""

    def propose(self, ctx):
        return super().propose(replace(ctx, params=replace(ctx.params, temperature=0.6)))


def forced_logits(target, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """[len(generated), V] logits that emitted each generated token, computed as plain
    decoding does: a prefill (last logits only), then one-token forwards."""
    cache = target.new_cache()
    rows = [target.forward(torch.tensor([prompt]), torch.arange(len(prompt))[None], cache,
                           last_logits_only=True).logits[0, -1]]
    for i, t in enumerate(generated[:-1]):
        pos = torch.tensor([[len(prompt) + i]])
        rows.append(target.forward(torch.tensor([[t]]), pos, cache).logits[0, -1])
    return torch.stack(rows)


def random_eagle_head(layers: tuple[int, ...], seed: int = 0, vocab: int = 96, draft_vocab: int = 48,
                      hidden: int = 64) -> EagleHead:
    """A random EAGLE (``layers`` empty) or EAGLE-3 head of a ``hidden``-wide target, weights
    jittered away from the init; its reduced vocabulary: ``draft_vocab`` random ids."""
    cfg = EagleConfig(hidden_size=hidden, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
                      rms_norm_eps=1e-5, rope_theta=10000.0, vocab_size=vocab, draft_vocab_size=draft_vocab,
                      hidden_layers=layers)
    torch.manual_seed(seed)
    head = (Eagle3Head if layers else EagleHead)(cfg)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.2)
        head.draft_vocab.copy_(torch.randperm(vocab)[:draft_vocab].sort().values)
    return head.eval()


class AskedDrafter(NoDrafter):
    """A learned drafter (a hybrid's "draft") that drafts token 5 and records the context lengths it is asked for."""

    name = "draft"

    def __init__(self):
        self.asked: list[int] = []

    def propose_batch(self, ctxs):
        self.asked += [len(c.tokens) for c in ctxs]
        return [DraftTree.chain(c.tokens[-1], [5]) for c in ctxs]
