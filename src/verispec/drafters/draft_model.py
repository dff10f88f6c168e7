"""Draft-model drafting (Leviathan et al. 2023; Chen et al. 2023): a small causal LM that
shares the target's tokenizer proposes a chain autoregressively, with its own KV cache
that is rolled back to the committed prefix before every proposal. Under a constraint its
drafts stay inside the grammar (each draft step's logits masked: ``constraints.speculation.GrammarDraft``).

Its own prefix cache (``prefix_cache``, an ``engine.prefix_cache.PrefixCache`` bound to the draft
model): the turns of an agent session, or a server's requests with one system prompt, send the same
history again and again; the target reuses its K/V from its prefix cache, and without one of its
own the draft model would prefill the whole history again on every request it drafts for. A
request's draft prompt starts from the longest cached prefix, and what it fed is kept when it
finishes (K/V depend only on the tokens before them, so kept draft tokens are reusable too).
Used only on a backend whose prefill is bitwise the same in one forward or in several
(``prefix_reuse_exact``): the drafts, and so the speed, are those without the cache; the
output never depends on it (the target verifies every token)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Literal

import torch

from ..constraints.speculation import GrammarDraft
from ..cost_model import CostModel
from ..models.base import CausalLM, KVCache, model_bytes
from ..memory import cache_pool_bytes
from ..models.cache_pool import CachePool, PooledCache
from ..sampling import sample, target_probs
from ..tree import DraftTree
from .base import DeclaresFeatures, DraftContext, Observation, RequestTable
from .options import option

if TYPE_CHECKING:
    from ..engine.prefix_cache import PrefixCache


@dataclass
class _DraftState:
    cache: KVCache
    fed: list[int] = field(default_factory=list)  # tokens whose K/V are in the cache
    shared: bool = False  # its cache is a row of the drafter's shared pool (batched drafting)


@dataclass
class _Chain:
    """One request's draft in progress (``DraftModelDrafter._next``)."""

    ctx: DraftContext
    budget: int
    drafts: list[int] = field(default_factory=list)
    qs: list[torch.Tensor] = field(default_factory=list)
    accept_all: float = 1.0  # P(every draft so far accepted)
    expected: float = 1.0  # tokens the step yields, expected
    grammar: GrammarDraft | None = None  # a constrained request's grammar, walked along the chain
    forwards: int = 0  # draft forwards whose logits gave a draft (tokens the grammar forces need none)
    ended: bool = False  # a draft ended the answer (EOS, or the grammar is complete)
    cost: CostModel | None = None  # the drafter's costs at this request's context (``CostModel.at``)
    # a sampled chain on a backend that drafts in one call: one uniform per token of the budget, drawn up front (the
    # one call's randomness, and the Python loop's there, so a request drafts the same chain alone or batched)
    uniforms: list[float] | None = None


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass(frozen=True)
class DraftModelOptions:
    """A small LM: the shipped distilled draft, else the catalog's draft for the target, else the target's first 4 layers; a model with another tokenizer drafts through text (Universal Assisted Generation)."""

    model: str = option("auto", "shipped|truncated:N|self|<name|path> (auto: shipped, else the catalog's draft, else "
                               "truncated:4; self: the target's own layers less skip=, its weights shared: "
                               "self-speculation, Draft & Verify / SWIFT)")
    vocab: str = option("auto", "auto|full|N: an FR-Spec head of the N most frequent tokens (auto: 32768 for a catalog GGUF)")
    quant: str = option("auto", "auto|file|q4_0|q3_k|q2_k: the draft's matrices re-encoded at load (auto: q4_0 for a catalog GGUF)")
    skip: str = option("", "layers of a GGUF draft, or of the target with model=self, left out (3+10-12; self's "
                             "default: every other middle layer)")
    window: int = option(0, "each draft layer attends to its last N keys (0: all)")
    stop: Literal["auto", "cost", "fixed"] = option("auto", "cost: each draft sized by the measured costs and its confidence")
    min_confidence: float = option(0.0, "a draft stops below this top probability")
    pool_rows: int = option(16, "requests drafted together in one batched draft forward")
    prefix_cache_mb: float = option(256.0, "the draft's own prefix cache across requests (0: off)")
    # SmolLM2-135M for the Qwen2.5-Coder 1.5B paid most at 2-3 (docs/history/benchmarks-2026-11.md)
    max_draft: int = option(3, "another tokenizer: target tokens drafted a step at most")
    cost_contexts: str = option("128+1024+3072", "the contexts stop=cost times its costs at, joined by '+' (the first "
                                                  "128), read at each request's length; 128 alone: one curve for all")

    def __post_init__(self) -> None:
        if self.vocab not in ("auto", "full") and not self.vocab.isdigit():
            raise ValueError(f"vocab must be auto, full or a token count, got {self.vocab!r}")
        from ..models.cpu_weights import REQUANTS

        if self.quant not in ("auto", "file", *REQUANTS):
            raise ValueError(f"quant must be auto, file or {', '.join(REQUANTS)}, got {self.quant!r}")
        parts = self.cost_contexts.split("+")
        if not all(p.isdigit() for p in parts) or len(parts) > 8 or min(map(int, parts)) != 128:
            raise ValueError("cost_contexts must be at most 8 token counts joined by '+', the least 128 "
                             f"(128+1024+3072), got {self.cost_contexts!r}")
        for name, ok, rule in (("window", self.window >= 0, ">= 0"), ("pool_rows", self.pool_rows >= 1, ">= 1"),
                               ("prefix_cache_mb", self.prefix_cache_mb >= 0, ">= 0"),
                               ("max_draft", self.max_draft >= 1, ">= 1"),
                               ("min_confidence", 0 <= self.min_confidence < 1, "in [0, 1)")):
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)}")

    @property
    def contexts(self) -> tuple[int, ...]:
        """``cost_contexts`` as token counts."""
        return tuple(sorted({int(p) for p in self.cost_contexts.split("+")}))


class DraftModelDrafter(DeclaresFeatures):
    """Chain drafts from ``model``. Greedy requests draft argmax tokens; sampled requests
    draw from the draft's processed distribution q and attach q for rejection sampling.
    ``min_confidence`` > 0 stops drafting when the draft's top probability falls below it
    (a draft-confidence threshold, as transformers' ``assistant_confidence_threshold``).

    ``cost`` sizes each draft by the measured curves instead (cost-aware draft length, the
    rule of SpecDec++, Huang et al. 2024, with the draft's own probabilities standing in for
    its trained acceptance predictor): ``cost.verify(n)`` is a target forward over the root
    and n drafted tokens and ``cost.draft`` one draft forward, both in target decode steps.
    With P the probability that every token drafted so far is accepted and E = 1 + sum of
    those P (the expected tokens of a step), a token is kept while it raises E / time, and
    another draft forward is paid for while the next token, guessed as likely as the last,
    would. Output is unchanged either way: only how much is drafted. Where ``cost`` was timed at
    several contexts (``CostModel.at``) both are read at the request's length.

    ``propose_batch`` drafts for several requests at once on a backend with batched forwards
    (``BackendCaps.batched``): their caches are rows of one pool (``pool_rows`` of them; later
    requests get caches of their own and draft alone), so each draft step is one forward for
    every request still drafting, reading the draft's weights once instead of once per
    request. Each request's chain is the one ``propose`` would draft.

    On a backend that declares ``chain_drafting`` (the compiled runtime) a chain is drafted in
    one call, stop rule included (``one_call=False``: by this class's Python loop, the same
    chains: there a sampled draft's q and draw are the runtime's too, ``draft_sample``, from
    uniforms drawn up front, so batched drafting keeps each request's chain).

    A constrained request (``ctx.grammar``) drafts through the Python loop, each draft step's
    logits masked with the grammar state after the chain so far (``GrammarDraft``), so the
    chain never leaves the grammar: the argmax (or a sample of q) over the allowed tokens, q
    the masked distribution, and the stop rules read the masked probabilities. Tokens the
    grammar forces (a schema's keys and punctuation) join the chain without a draft forward
    of their own (fed with the next one; a sampled chain's q is a point mass there), kept while
    the cost rule says their verification pays (free to draft, not to verify). The one-call
    chain cannot consult a grammar. Output is unchanged (drafts only propose; the target is
    masked at verification), but no draft is cut for leaving the grammar.

    Its caches hold the draft's whole context unless a server sizes them to its own
    (``reserve``): a draft model's context (32,768 tokens for Qwen2.5's) far exceeds what a
    server of ``--max-model-len`` 2048 can ever feed it, and its pool would otherwise be
    reserved, uncounted, on the first request.

    ``prefix_cache``: the draft's own K/V of earlier requests (see the module docstring); left
    unused on a backend where reusing K/V is not exact."""

    name: ClassVar[str] = "draft"

    def __init__(self, model: CausalLM, min_confidence: float = DraftModelOptions.min_confidence,
                 cost: CostModel | None = None, pool_rows: int = DraftModelOptions.pool_rows, one_call: bool = True,
                 prefix_cache: PrefixCache | None = None):
        if not 0.0 <= min_confidence < 1.0:
            raise ValueError("min_confidence must be in [0, 1)")
        if pool_rows < 1:
            raise ValueError("pool_rows must be >= 1")
        self.model, self.min_confidence, self.cost = model, min_confidence, cost
        self._states: RequestTable[_DraftState] = RequestTable()
        self._batched = model.caps.batched
        # chains in one call where the backend can (the compiled runtime); one_call=False: the Python loop
        self._chains = one_call and model.caps.chain_drafting
        self._pool_rows = pool_rows
        self._pool = None  # created by reserve, else by the first request
        self.max_length = model.info.max_length  # each cache's context: the draft's own, or a server's (reserve)
        # without a server's reserve, caches get no length: a backend that can grows them as used (the compiled
        # runtime), instead of reserving the draft's whole context (32,768 tokens x 16 rows for Qwen2.5's 0.5B)
        self._cache_length: int | None = None
        self.fed_tokens = 0  # tokens run through the draft model (prompts, catch-ups, drafts): its work, counted
        self.prefix_cache = prefix_cache if prefix_cache is not None and model.caps.prefix_reuse_exact else None
        if self.prefix_cache is not None:
            self.prefix_cache.bind(model)

    def cost_signature(self) -> str:
        return repr((self.model.info, self.model.description))

    def start(self, request_id: str, prompt_ids: list[int]) -> None:
        """Open the request's draft cache and prefill it with the prompt now, beside the
        target's prefill (as llama.cpp's speculative decoding and vLLM do), not in the first
        proposal's step; past the longest prefix in the prefix cache, if any."""
        if self._batched and self._pool is None:
            self._pool = self.model.new_cache_pool(self._pool_rows, self._cache_length)
        if self._pool is not None and self._pool.in_use < self._pool.rows:
            state = _DraftState(cache=self._pool.acquire(), shared=True)
        else:
            state = _DraftState(cache=self.model.new_cache(self._cache_length))
        self._states.add(request_id, state)
        # the last prompt token is fed with the first proposal (its logits are wanted then)
        reused = self.prefix_cache.restore(prompt_ids, state.cache) if self.prefix_cache is not None else 0
        state.fed.extend(prompt_ids[:reused])
        if len(prompt_ids) - 1 > reused:
            self._feed([state], [list(prompt_ids[reused:-1])])
            if self.prefix_cache is not None:  # now, for the requests beside this one that share its prompt
                self.prefix_cache.store(state.fed, state.cache)

    def prefill_tokens(self, prompt_ids: list[int]) -> int:
        """How many tokens ``start`` would run through the draft model for ``prompt_ids`` now:
        all but the last (fed with the first proposal), less the prefix its prefix cache holds."""
        cached = self.prefix_cache.cached_length(prompt_ids) if self.prefix_cache is not None else 0
        return max(0, len(prompt_ids) - 1 - cached)

    def finish(self, request_id: str) -> None:
        state = self._states.pop(request_id)
        if state is None:
            return
        if self.prefix_cache is not None and state.fed:
            self.prefix_cache.store(state.fed[:state.cache.length], state.cache)
        if state.shared:
            self._pool.release(state.cache)

    def reset(self) -> None:
        """Forget earlier requests' K/V (a benchmark's warm-up)."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def observe(self, obs: Observation) -> None:
        pass  # the cache is re-synchronised lazily in propose()

    @property
    def pool(self) -> CachePool | None:
        """The K/V pool of the requests drafted together (None until ``reserve`` or the first request)."""
        return self._pool

    def context_bytes(self, max_length: int, rows: int) -> int:
        """The draft K/V of ``rows`` requests of ``max_length`` tokens (at most the draft's
        context): the pool's rows and the caches of requests beyond them, measured on one row.
        A backend without a pool grows each cache with its request (nothing to reserve)."""
        return cache_pool_bytes(self.model, rows, min(max_length, self.model.info.max_length)) if self._batched else 0

    def reserve(self, max_length: int, rows: int) -> None:
        """Size every cache to a server's context (``max_length`` tokens, at most the draft's)
        and allocate the pool now, with at most ``rows`` rows (the server's batch), so the
        server counts it at start-up (``context_bytes``) instead of meeting it on a request."""
        if self._states.values():
            raise ValueError("reserve: requests are drafting")
        self.max_length = self._cache_length = min(max_length, self.model.info.max_length)
        self._pool_rows = min(self._pool_rows, rows)
        self._pool = self.model.new_cache_pool(self._pool_rows, self.max_length) if self._batched else None

    def memory_bytes(self) -> int:
        """The draft model's resident weights plus the K/V rows its open requests hold and its prefix cache."""
        pools = {id(st.cache.pool): st.cache.pool for st in self._states.values() if isinstance(st.cache, PooledCache)}
        kept = self.prefix_cache.stats.bytes if self.prefix_cache is not None else 0
        return model_bytes(self.model) + sum(p.nbytes * p.in_use // p.rows for p in pools.values()) + kept

    # ---- one request ---------------------------------------------------------------------
    def propose(self, ctx: DraftContext) -> DraftTree:
        state = self._states.get(ctx.request_id)
        chain = self._begin(state, ctx)
        if self._chains and chain.grammar is None:
            return self._chain_in_one_call(state, chain)
        try:
            logits = self._feed([state], [self._catch_up(state, ctx) + self._forced(chain)])[0]
            while not chain.ended and (feed := self._next(chain, logits)) is not None:
                logits = self._feed([state], [feed])[0]
        finally:
            if chain.grammar is not None:
                chain.grammar.close()
        return self._tree(chain)

    def _chain_in_one_call(self, state: _DraftState, chain: _Chain) -> DraftTree:
        """A chain on a backend that drafts it in one call (``BackendCaps.chain_drafting``): the
        same stop rule as ``_next``, with no Python between draft tokens. A sampled chain's
        uniforms are drawn up front from the request's drafter generator, one per token the
        budget allows (a chain that stops early leaves the rest unused), so the seed alone
        still fixes the drafts; q comes back with them for the rejection sampler."""
        feed, budget, params = self._catch_up(state, chain.ctx), max(chain.budget, 0), chain.ctx.params
        cost = None if chain.cost is None else (chain.cost.draft, [chain.cost.verify(n) for n in range(budget + 2)])
        sampled = None if chain.uniforms is None else (params, chain.uniforms)
        drafts, fed, q = self.model.draft_chain(state.cache, feed, budget, self.min_confidence, cost, sampled)
        state.fed.extend((feed + drafts)[:fed])
        self.fed_tokens += fed
        return DraftTree.chain(chain.ctx.tokens[-1], drafts, None if q is None else q.to(self.model.info.device))

    # ---- several requests: one draft forward per step for all of them ----------------------
    def propose_batch(self, ctxs: Sequence[DraftContext]) -> list[DraftTree]:
        states = [self._states.get(c.request_id) for c in ctxs]
        together = [i for i, st in enumerate(states) if st.shared]
        if len(together) < 2:
            return [self.propose(c) for c in ctxs]
        trees: list[DraftTree | None] = [None] * len(ctxs)
        for i in (i for i in range(len(ctxs)) if not states[i].shared):
            trees[i] = self.propose(ctxs[i])
        rows = [states[i] for i in together]
        chains = [self._begin(st, ctxs[i]) for st, i in zip(rows, together)]
        try:
            logits = self._feed(rows, [self._catch_up(st, ctxs[i]) + self._forced(chain)
                                       for st, i, chain in zip(rows, together, chains)])
            live = [j for j, chain in enumerate(chains) if not chain.ended]  # indices into rows / chains still drafting
            while live:
                feeds = [(j, self._next(chains[j], logits[n])) for n, j in enumerate(live)]
                live = [j for j, feed in feeds if feed is not None]
                if live:
                    logits = self._feed([rows[j] for j in live], [feed for _, feed in feeds if feed is not None])
        finally:
            for chain in chains:
                if chain.grammar is not None:
                    chain.grammar.close()
        for i, chain in zip(together, chains):
            trees[i] = self._tree(chain)
        return trees  # type: ignore[return-value]

    # ---- the pieces both share ---------------------------------------------------------------
    def _begin(self, state: _DraftState, ctx: DraftContext) -> _Chain:
        """Roll the draft cache back to what the context still shares (always re-feeding the root)."""
        keep = min(common_prefix_length(state.fed, ctx.tokens), len(ctx.tokens) - 1)
        state.cache.truncate(keep)
        del state.fed[keep:]
        budget = min(ctx.budget, self.max_length - len(ctx.tokens))
        uniforms = None
        if self.model.caps.chain_drafting and not ctx.params.greedy and ctx.grammar is None:
            uniforms = torch.rand(max(budget, 0), generator=ctx.generator, dtype=torch.float64).tolist()
        grammar = None if ctx.grammar is None else GrammarDraft(ctx.grammar)
        cost = None if self.cost is None else self.cost.at(len(ctx.tokens))
        return _Chain(ctx, budget, grammar=grammar, uniforms=uniforms, cost=cost)

    @staticmethod
    def _catch_up(state: _DraftState, ctx: DraftContext) -> list[int]:
        return ctx.tokens[len(state.fed):]

    def _feed(self, states: list[_DraftState], tokens: list[list[int]]) -> list[torch.Tensor]:
        """Append each request's tokens to its draft cache in one forward; [V] logits after the
        last token of each."""
        device = self.model.info.device
        if len(states) == 1:
            start = states[0].cache.length
            ids = torch.tensor([tokens[0]], device=device)
            pos = torch.arange(start, start + len(tokens[0]), device=device)[None]
            logits = self.model.forward(ids, pos, states[0].cache, last_logits_only=True).logits[:, -1]
        else:
            n = max(len(t) for t in tokens)
            ids = torch.tensor([t + [0] * (n - len(t)) for t in tokens], device=device)
            pos = torch.stack([torch.arange(st.cache.length, st.cache.length + n, device=device) for st in states])
            logits = self.model.forward_batch(ids, pos, [st.cache for st in states], num_tokens=[len(t) for t in tokens],
                                              last_logits_only=True).logits[:, -1]
        for st, t in zip(states, tokens):
            st.fed.extend(t)
        self.fed_tokens += sum(len(t) for t in tokens)
        return list(logits)

    def _next(self, chain: _Chain, logits: torch.Tensor) -> list[int] | None:
        """Draft the next token from the draft's ``logits`` after the chain so far; returns the
        tokens to feed for another draft forward (that token, then any the grammar forces after
        it), or None when the chain is complete."""
        i, ctx = len(chain.drafts), chain.ctx
        if i >= chain.budget:
            return None
        if chain.grammar is not None and (logits := chain.grammar.mask(logits)) is None:
            return None  # nothing the draft can propose is allowed here
        if ctx.params.greedy:
            q, token = None, int(logits.argmax())
        elif chain.uniforms is not None:  # the one call's law and draw (draft_chain), the same chain
            if (drawn := self.model.draft_sample(logits, ctx.params, chain.uniforms[i])) is None:
                return None
            token, q = drawn
        else:
            q = target_probs(logits[None], ctx.params)[0]
            token = sample(q, ctx.generator)
        if self.min_confidence and logits.float().softmax(-1).max() < self.min_confidence:
            return None
        if chain.cost is not None:  # keep token i + 1 only if it raises tokens per unit time
            # acceptance guessed from the top probability of the law drafted from (the argmax's, or q's largest): a
            # sampled draft x is accepted with min(1, p(x) / q(x)), often where q(x) is small (a flat q, a target as
            # flat); q's largest tracks acceptance better than q(x) (Qwen2.5-Coder 0.5B for the 1.5B at T = 0.7:
            # drafts of q(x) < 0.3 accepted ~60% of the time) and sizes chains that yield more per unit time
            conf = float(q.max()) if q is not None else float(logits.float().softmax(-1)[token])
            keep_p = chain.accept_all * conf
            if not chain.cost.keeps(i, chain.expected, keep_p, chain.forwards + 1):
                return None
            chain.accept_all, chain.expected = keep_p, chain.expected + keep_p
        chain.drafts.append(token)
        chain.forwards += 1
        if q is not None:
            chain.qs.append(q)
        if chain.grammar is not None and not chain.grammar.push(token):
            return None  # the chain ended the answer
        feed = [token, *self._forced(chain)]
        if chain.ended or len(chain.drafts) >= chain.budget:
            return None
        if chain.cost is not None and not chain.cost.pays_another(len(chain.drafts) - 1, chain.expected,
                                                                chain.accept_all * conf, chain.forwards):
            return None
        return feed

    def _forced(self, chain: _Chain) -> list[int]:
        """Append the tokens the grammar forces after the chain so far (none without a grammar),
        while the budget and the cost rule keep them: no draft forward is paid for them, their
        verification is (each reached with the chain's probability)."""
        if chain.grammar is None:
            return []
        out = []
        for token in chain.grammar.forced():
            i = len(chain.drafts)
            if i >= chain.budget or (chain.cost is not None
                                     and not chain.cost.keeps(i, chain.expected, chain.accept_all, chain.forwards)):
                break
            if chain.cost is not None:
                chain.expected += chain.accept_all
            chain.drafts.append(token)
            out.append(token)
            if not chain.ctx.params.greedy:  # the point mass it was drawn from
                chain.qs.append(torch.zeros(self.model.info.vocab_size, device=self.model.info.device))
                chain.qs[-1][token] = 1.0
            if not chain.grammar.push(token):
                chain.ended = True
                break
        return out

    @staticmethod
    def _tree(chain: _Chain) -> DraftTree:
        probs = torch.stack(chain.qs) if chain.qs else None
        return DraftTree.chain(chain.ctx.tokens[-1], chain.drafts, probs)
