"""The speculative decoding loop: propose -> verify (one target forward) -> commit ->
cache rollback -> drafter.observe. With the ``none`` drafter every step verifies an
empty draft, which is exactly plain autoregressive decoding through the same code."""

from __future__ import annotations

import itertools
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..constraints.speculation import JumpForward, mask_logits, shape_draft
from ..drafters.base import DraftContext, Drafter, Observation, features_of
from ..logits_processing import adjust_tree_logits
from ..logprobs import step_rows, token_logprobs
from ..cost_model import CostModel
from ..errors import NonFiniteLogits
from ..models.base import CausalLM, KVCache
from ..policies.draft_length import DraftLengthPolicy, PolicyName
from ..sampling import check_logits, sample, target_probs
from ..tree import DraftTree
from ..types import FinishReason, SamplingParams, TokenLogprob
from ..verify import verify_tree
from .prefix_cache import PrefixCache, prefix_cache_support
from .request import Request


@contextmanager
def host_threads(target: CausalLM) -> Iterator[None]:
    """Torch's thread count while a step runs. A backend computing in its own thread pool
    (the compiled CPU runtime) declares ``BackendCaps.host_threads = 1``: the step's small torch
    ops (verification, sampling, drafter glue) then never wake torch's OpenMP threads, which
    would spin on the cores the runtime's threads need (an EAGLE-3 step ran 25% faster)."""
    n = target.caps.host_threads
    prev = torch.get_num_threads()
    if not n or n == prev:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


@dataclass(frozen=True)
class StepResult:
    new_token_ids: list[int]  # tokens committed this step (after EOS / length cuts)
    num_drafted: int
    num_accepted: int
    finished: FinishReason | None
    logprobs: list[TokenLogprob] | None = None  # one per new token, when params.logprobs is set


class Engine:
    """Runs one target with one drafter. ``num_draft_tokens`` is the initial draft budget
    per step (tree nodes for tree drafters); ``policy`` how it changes. ``prefix_cache``
    (engine/prefix_cache.py; several engines on one target may share one): requests reuse
    cached prompt prefixes, where the backend makes that exact (``prefix_cache_support``);
    elsewhere it is left unused."""

    def __init__(
        self,
        target: CausalLM,
        drafter: Drafter,
        num_draft_tokens: int = 8,
        policy: PolicyName = "fixed",
        prefix_cache: PrefixCache | None = None,
        cost: CostModel | None = None,
    ):
        DraftLengthPolicy(num_draft_tokens, policy)  # validate now, not at first request
        self.target, self.drafter = target, drafter
        self.num_draft_tokens, self.policy = num_draft_tokens, policy
        self.prefix_cache = prefix_cache if prefix_cache_support(target) is None else None
        if self.prefix_cache is not None:
            self.prefix_cache.bind(target)
        # the target's cost model (registry.cost_model): sizes a constrained request's forced-token
        # drafts (None: they fill the budget)
        self.cost = cost
        self._ids = itertools.count()
        self._warned_drafter = False  # a drafter's non-finite logits are reported once (``_drafts``)

    # ---- request lifecycle -------------------------------------------------------------
    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache: KVCache | None = None,
        draft_limit: int | None = None,
        prediction: Sequence[int] = (),
    ) -> Request:
        """Validate, then prefill: one target forward over the prompt yields the first token.
        ``cache`` (empty) lets a batch scheduler hand out rows of one cache pool; by default
        the request gets ``target.new_cache()``. ``draft_limit`` caps this request's draft
        budget (0 = plain decoding). ``prediction``: token ids the answer is expected to
        repeat (Predicted Outputs), handed to the drafter with every draft request."""
        req = self._new_request(prompt_ids, params, request_id, cache, draft_limit, prediction)
        self.drafter.start(req.request_id, req.prompt_ids)
        self._prefill(req)
        return req

    def fork(
        self,
        parent: Request,
        params: SamplingParams,
        request_id: str | None = None,
        cache: KVCache | None = None,
        draft_limit: int | None = None,
    ) -> Request:
        """Another sample of ``parent``'s prompt (and prediction) that shares its prefill: the prompt's K/V are
        copied from ``parent.cache`` (which may have moved on: only its first ``len(prompt)``
        slots are read) and the first token is drawn from the parent's prefill logits with
        this request's own generator. Output is that of ``add_request`` with the same
        arguments. Falls back to a fresh prefill when the cache cannot copy or the drafter
        needs the prefill's hidden states."""
        req = self._new_request(parent.prompt_ids, params, request_id, cache, draft_limit, parent.prediction)
        self.drafter.start(req.request_id, req.prompt_ids)
        if (parent.prefill_logits is None or not self.target.caps.copy_prefix
                or features_of(self.drafter).wanted):
            self._prefill(req)
            return req
        t0 = time.perf_counter()
        req.cache.copy_prefix(parent.cache, len(req.prompt_ids))
        req.prefill_logits = parent.prefill_logits
        first, logprobs = self._first_token(req, parent.prefill_logits)
        req.stats.prefill_s = time.perf_counter() - t0
        self._commit(req, [first], logprobs)
        return req

    def _new_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None,
                     cache: KVCache | None, draft_limit: int | None, prediction: Sequence[int] = ()) -> Request:
        info = self.target.info
        if not prompt_ids:
            raise ValueError("the prompt is empty (a base model needs at least BOS)")
        if len(prompt_ids) + 1 > info.max_length:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; the model's context is {info.max_length}"
            )
        if max(prompt_ids) >= info.vocab_size or min(prompt_ids) < 0:
            raise ValueError(f"prompt token ids must be in [0, {info.vocab_size})")
        if cache is not None and cache.length != 0:
            raise ValueError(f"the cache handed to a new request must be empty (length {cache.length})")
        bad = [t for t in (*params.stop_token_ids, *(t for t, _ in params.logit_bias)) if t >= info.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} in stop_token_ids / logit_bias is outside the vocabulary "
                             f"[0, {info.vocab_size})")
        if draft_limit is not None and draft_limit < 0:
            raise ValueError(f"draft_limit must be >= 0, got {draft_limit}")
        prediction = tuple(int(t) for t in prediction)
        if len(prediction) > info.max_length:
            raise ValueError(f"the prediction has {len(prediction)} tokens; the model's context is {info.max_length}")
        if prediction and (max(prediction) >= info.vocab_size or min(prediction) < 0):
            raise ValueError(f"prediction token ids must be in [0, {info.vocab_size})")
        constraint = params.constraint
        if constraint is not None and constraint.vocab_size != info.vocab_size:
            raise ValueError(f"the constraint was compiled for a vocabulary of {constraint.vocab_size} tokens; "
                             f"the model has {info.vocab_size}")
        return Request(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt_ids=list(prompt_ids),
            params=params,
            cache=self.target.new_cache() if cache is None else cache,
            policy=DraftLengthPolicy(self.num_draft_tokens, self.policy),
            draft_limit=draft_limit,
            prediction=prediction,
            grammar=None if constraint is None else constraint.matcher(),
            jump_forward=None if constraint is None or self.cost is None else JumpForward(self.cost.curve),
        )

    def _prefill(self, req: Request) -> None:
        """One forward over the prompt (past a prefix reused from the prefix cache). A
        drafter that needs hidden states observes it as a verified chain: root = the first
        prompt token, the rest of the prompt accepted, the first generated token as bonus
        (``Observation`` of the prefill); it needs the whole prompt's features, so it reuses
        only cached blocks that keep them (``PrefixCache``), and its requests' features are
        kept for the cache (``Request.hidden_rows``)."""
        t0 = time.perf_counter()
        device = self.target.info.device
        prompt = req.prompt_ids
        feats = features_of(self.drafter)
        want, tag = feats.wanted, feats.tag
        pc = self.prefix_cache
        start, reused = pc.restore_with_hidden(prompt, req.cache, tag) if pc is not None else (0, None)
        req.stats.cached_tokens = start
        ids = torch.tensor([prompt[start:]], device=device)
        pos = torch.arange(start, len(prompt), device=device)[None]
        out = self.target.forward(ids, pos, req.cache, last_logits_only=True, **feats.forward_kwargs())
        req.prefill_logits = out.logits[0, -1:]  # [1, V]
        req.stats.target_forwards += 1
        first, logprobs = self._first_token(req, req.prefill_logits)
        hidden = None
        if want:
            hidden = feats.select(out)[0]  # [P - start, F]
            if reused is not None:
                hidden = torch.cat([reused.to(hidden.device), hidden])
            self.drafter.observe(Observation.prefill(req.request_id, prompt, first, out.logits[0], hidden))
            if pc is not None:
                req.hidden_rows = [hidden]
        if pc is not None:  # now, so requests running beside this one can share its prompt
            pc.store(prompt, req.cache, hidden, tag)
        req.stats.prefill_s = time.perf_counter() - t0
        self._commit(req, [first], logprobs)

    @staticmethod
    def _first_token(req: Request, last: torch.Tensor) -> tuple[int, list[TokenLogprob] | None]:
        """The first generated token from the prefill's [1, V] logits (and its logprobs); NaN or
        infinite logits are NonFiniteLogits (``sampling.check_logits``), not token 0."""
        check_logits(last)
        scores = last
        if req.params.adjusts_logits:
            scores = adjust_tree_logits(last, DraftTree.chain(req.prompt_ids[-1], []), req.params, req.prompt_ids, [])
        if req.grammar is not None:
            scores = mask_logits(scores, DraftTree.chain(req.prompt_ids[-1], []), req.grammar)
        first = int(scores.argmax()) if req.params.greedy else sample(
            target_probs(scores, req.params)[0].cpu(), req.verify_generator
        )
        return first, _logprobs(req, last, [first], [0])

    def finish(self, req: Request, reason: FinishReason) -> None:
        """End ``req`` (idempotent); its committed tokens' K/V go to the prefix cache."""
        if req.finished is None:
            req.finished = reason
        self.drafter.finish(req.request_id)
        if self.prefix_cache is not None:
            # slots past len(tokens) - 1 may hold an unverified tree if a step failed midway
            n = min(req.cache.length, len(req.tokens) - 1)
            hidden = None if req.hidden_rows is None else torch.cat(req.hidden_rows)[:n]
            self.prefix_cache.store(req.tokens[:n], req.cache, hidden,
                                    features_of(self.drafter).tag if hidden is not None else None)

    # ---- one step ----------------------------------------------------------------------
    # A step is propose -> forward_tree -> complete_step; a batch scheduler (engine/batch.py)
    # calls the three phases itself to run many requests' trees in one target forward.
    def step(self, req: Request) -> StepResult:
        with host_threads(self.target):
            t0 = time.perf_counter()
            tree = self.propose(req)
            t1 = time.perf_counter()
            logits, hidden = self.forward_tree(req, tree)
            result = self.complete_step(req, tree, logits, hidden)
            req.stats.record_time(t1 - t0, time.perf_counter() - t0)
            return result

    def complete_step(
        self,
        req: Request,
        tree: DraftTree,
        logits: torch.Tensor,  # [N, V] target logits at the tree's nodes
        hidden: torch.Tensor | None,  # [N, H] or None
    ) -> StepResult:
        """Verify, roll the cache back to root + accepted path, observe, commit. Expects
        the tree's K/V to have just been appended to ``req.cache`` (by ``forward_tree`` or
        a batched forward)."""
        scores = logits
        if req.params.adjusts_logits:  # each node scored with its own root-to-node history
            scores = adjust_tree_logits(logits, tree, req.params, req.prompt_ids, req.generated)
        if req.grammar is not None:  # each node masked with its own grammar state
            scores = mask_logits(scores, tree, req.grammar)
        acc = verify_tree(tree, scores, req.params, req.verify_generator)
        if req.jump_forward is not None:
            req.jump_forward.observe(len(acc.path))
        new = acc.tokens(tree)
        logprobs = _logprobs(req, logits, new, step_rows(acc.path))
        self._rollback(req, tree, acc.path)
        req.stats.record_step(max(tree.depths), tree.num_drafted, len(acc.path))
        req.policy.update(tree.num_drafted, len(acc.path))
        self.drafter.observe(Observation(req.request_id, tree, acc.path, new, logits, hidden))
        if req.hidden_rows is not None:  # the root's and the accepted nodes' features, now in the cache
            req.hidden_rows.append(hidden[[0, *acc.path]])
        committed = self._commit(req, new, logprobs)
        return StepResult(committed, tree.num_drafted, len(acc.path), req.finished,
                          None if logprobs is None else req.logprobs[len(req.logprobs) - len(committed):])

    def propose(self, req: Request, max_drafted: int | None = None) -> DraftTree:
        """The drafter's tree for this step; ``max_drafted`` caps the draft budget (a batch
        scheduler lowers it, or sets 0 = plain decoding, when the batch is large)."""
        return self.propose_batch([req], max_drafted)[0]

    def propose_batch(self, reqs: Sequence[Request], max_drafted: int | None = None) -> list[DraftTree]:
        """``propose`` for the requests of one batched step, through one ``propose_batch`` call
        of the drafter (a draft model then runs one forward per draft step for all of them)."""
        ctxs = [self._draft_context(req, max_drafted) for req in reqs]
        asked = [c for c in ctxs if c is not None]
        trees = iter(self._drafts(asked) if asked else [])
        out = []
        for req, ctx in zip(reqs, ctxs):
            tree = DraftTree.chain(req.tokens[-1], []) if ctx is None else next(trees)
            if ctx is not None and (tree.tokens[0] != req.tokens[-1] or tree.num_drafted > ctx.budget):
                raise RuntimeError(
                    f"drafter {self.drafter.name} broke its contract: root {tree.tokens[0]} "
                    f"(expected {req.tokens[-1]}), {tree.num_drafted} nodes (budget {ctx.budget})"
                )
            if ctx is not None and req.grammar is not None:  # forbidden drafts cut, forced tokens drafted
                tree = shape_draft(tree, req.grammar, req.params.greedy, ctx.budget, req.jump_forward)
            out.append(tree)
        return out

    def _drafts(self, ctxs: list[DraftContext]) -> list[DraftTree]:
        """The drafter's trees for ``ctxs``. A drafter whose own logits are NaN or infinite (a
        corrupt draft model: ``sample`` raises NonFiniteLogits) drafts nothing for the request
        concerned, as if its draft were rejected: the target alone picks the step's token, so
        the output's law is untouched; the others keep their drafts (each retried alone)."""
        try:
            return self.drafter.propose_batch(ctxs)
        except NonFiniteLogits:
            if len(ctxs) > 1:
                return [tree for ctx in ctxs for tree in self._drafts([ctx])]
            if not self._warned_drafter:
                self._warned_drafter = True
                warnings.warn(f"drafter {self.drafter.name} computed NaN or infinite logits; such drafts are "
                              "dropped (the output is unchanged, the speed-up lost)", RuntimeWarning, stacklevel=2)
            return [DraftTree.chain(ctxs[0].tokens[-1], [])]

    def _draft_context(self, req: Request, max_drafted: int | None) -> DraftContext | None:
        """What the drafter is asked this step (None: a budget of 0, plain decoding)."""
        if req.finished:
            raise ValueError(f"request {req.request_id} already finished ({req.finished})")
        room = self.target.info.max_length - len(req.tokens)  # cache slots left after root
        budget = min(req.policy.budget(), req.remaining - 1, room)
        for cap in (max_drafted, req.draft_limit):
            if cap is not None:
                budget = min(budget, cap)
        if budget <= 0:
            return None
        return DraftContext(req.request_id, req.tokens, budget, req.params, req.draft_generator, req.prediction,
                            req.grammar)

    def forward_tree(self, req: Request, tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One target forward over all tree nodes; returns [N, V] logits and [N, H] hidden."""
        device = self.target.info.device
        start = req.cache.length
        ids = torch.tensor([tree.tokens], device=device)
        pos = (start + torch.tensor(tree.depths, device=device))[None]
        mask = None if tree.is_chain else tree.ancestor_mask(device)
        feats = features_of(self.drafter)
        out = self.target.forward(ids, pos, req.cache, mask, **feats.forward_kwargs())
        hidden = feats.select(out)
        hidden = hidden[0] if hidden is not None else None
        return out.logits[0], hidden

    @staticmethod
    def _rollback(req: Request, tree: DraftTree, path: list[int]) -> None:
        """Keep root + accepted path in the cache, drop every other tree node."""
        root_slot = req.cache.length - tree.size
        req.cache.compact([root_slot + i for i in path], root_slot + 1)

    def _commit(self, req: Request, new: list[int], logprobs: list[TokenLogprob] | None = None) -> list[int]:
        """Append tokens (and their logprobs), cut at EOS, stop token ids and
        max_new_tokens, and mark the request finished."""
        eos = () if req.params.ignore_eos else self.target.info.eos_token_ids
        stops = req.params.stop_token_ids
        cut, reason = len(new), None
        for i, t in enumerate(new):
            if t in eos or t in stops:
                cut, reason = i, "eos" if t in eos else "stop"
                break
        if cut > req.remaining:
            cut, reason = req.remaining, "length"
        new = new[:cut]
        req.tokens.extend(new)
        if req.grammar is not None:
            if not req.grammar.advance(new):  # masked logits only pick allowed tokens: the engine's limits
                reason = "grammar"  # stopped it there (a step past llguidance's bounds); the answer ends
            elif reason is None and req.grammar.stopped:  # the grammar is complete: EOS is all that may follow
                reason = "eos"
            if reason == "eos" and not req.grammar.accepting:  # EOS where the grammar's mask failed: cut short
                reason = "grammar"
        if logprobs is not None:
            req.logprobs.extend(logprobs[:cut])
        req.stats.new_tokens += len(new)
        if reason is None and req.remaining == 0:
            reason = "length"
        if reason is None and len(req.tokens) >= self.target.info.max_length:
            reason = "context"
        if reason is not None:
            self.finish(req, reason)
        return new

    # ---- convenience -------------------------------------------------------------------
    def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
        prediction: Sequence[int] = (),
    ) -> Iterator[StepResult]:
        """Yield the prefill token, then one StepResult per step, until finished."""
        req = self.add_request(prompt_ids, params, request_id, prediction=prediction)
        try:
            yield StepResult(req.generated, 0, 0, req.finished, list(req.logprobs) if params.logprobs is not None else None)
            while not req.finished:
                yield self.step(req)
        finally:
            self.finish(req, req.finished or "stop")


def _logprobs(req: Request, logits: torch.Tensor, tokens: list[int], rows: list[int]) -> list[TokenLogprob] | None:
    """Logprobs of ``tokens`` from the raw target logits ([N, V]) at ``rows``, which emitted them."""
    if req.params.logprobs is None:
        return None
    return token_logprobs(logits[rows], tokens, req.params.logprobs)
