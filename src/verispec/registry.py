"""Drafter registry: name -> (factory, options class). An explicit dict, no import-time side
effects; a new method plugs in by adding one entry (the engine never changes). Each drafter's
options are one frozen dataclass beside it (``drafters/options.py``): ``make_drafter`` builds it
from ``-o key=value`` strings by field type, and the factory reads its fields; nothing here
defines an option's name, type, default or help."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .cost_model import CostModel
from .models.catalog import catalog_draft
from .drafters.base import Drafter, NoDrafter
from .drafters.draft_model import DraftModelDrafter, DraftModelOptions
from .drafters.eagle import EagleOptions
from .drafters.hybrid import HybridOptions
from .drafters.lookahead import LookaheadOptions
from .drafters.medusa import MedusaOptions
from .drafters.model_free import ModelFreeOptions
from .drafters.options import AutoOptions, NoOptions, from_strings
from .drafters.prompt_lookup import PromptLookupDrafter, PromptLookupOptions
from .drafters.retrieval import RestOptions
from .drafters.suffix_tree import SuffixOptions
from .drafters.token_recycling import TokenRecyclingOptions
from .models.formats import WeightFormat

if TYPE_CHECKING:
    from .models.load import LoadedModel

DrafterFactory = Callable[["LoadedModel", Any], Drafter]  # (target, the drafter's options) -> drafter


def _draft_model(target: "LoadedModel", o: DraftModelOptions) -> Drafter:
    return _draft_model_costed(target, o)[0]


def _draft_model_costed(target: "LoadedModel", o: DraftModelOptions) -> tuple[Drafter, CostModel | None]:
    """The draft model drafter and the cost model it sizes its drafts by (None: fixed k)."""
    from .engine.prefix_cache import PrefixCache
    from .models.catalog import CATALOG
    from .models.cpu_weights import REQUANTS
    from .models.load import DraftShape, OtherTokenizer, load_draft_model
    from .models.gguf_vocab import vocab_key_of
    from .weights import has_shipped, vocab_ranking

    entry = CATALOG.get(target.name)
    model = o.model
    if model == "auto":
        model = "shipped" if has_shipped("draft", target.name) else entry.draft if entry and entry.draft else "truncated:4"
    # a GGUF draft whose vocabulary has a shipped ranking (a catalog draft, or one found by path) on the compiled runtime
    catalog_gguf = vocab_ranking(model, vocab_key_of) is not None and target.backend_kind == "cpu"
    vocab = o.vocab
    if vocab == "auto":  # an FR-Spec head (its token ranking is shipped)
        vocab = str(DEFAULT_DRAFT_VOCAB) if catalog_gguf else "full"
    quant = o.quant
    if quant == "auto":  # streams Q4_0 (the target checks every token)
        quant = DEFAULT_DRAFT_QUANT if catalog_gguf else "file"
    if quant != "file" and quant not in REQUANTS:
        raise ValueError(f"quant must be auto, file or {', '.join(REQUANTS)}, got {quant!r}")
    requant = None if quant == "file" else WeightFormat(quant)
    shape = DraftShape(skip=layer_list(o.skip), window=o.window)
    shape = None if shape == DraftShape() else shape
    stop = o.stop
    try:
        draft = (_self_draft(target, shape, o) if model == "self"
                 else load_draft_model(target, model, None if vocab == "full" else int(vocab), requant, shape))
    except OtherTokenizer as e:  # another vocabulary: it drafts through text, its file's weights, full head
        if o.vocab not in ("auto", "full") or o.quant not in ("auto", "file") or stop == "cost" or shape:
            raise ValueError(f"{e}: it drafts through text, without vocab=N, quant, skip, window or stop=cost "
                             "(they need the target's tokenizer)") from None
        return _cross_tokenizer(target, model, o), None
    if stop == "auto":  # a separate draft model sizes its drafts by cost; layer-skip and distilled drafts keep k
        stop = "cost" if model not in ("shipped",) and not model.startswith("truncated:") else "fixed"
    cost = None
    if stop == "cost":  # the target's t(n) and the draft's step and feed of the history, each by context
        from .cost_curve import FEED_TOKENS, PROBE_CONTEXT, cached_context_curve, measure_draft_step

        key, room = _cost_key(target), min(target.backend.info.max_length, draft.info.max_length)
        curves = cached_context_curve(target.backend, key, o.contexts, max_length=room)
        steps = cached_context_curve(  # one draft step (size 1) and a feed of the history (FEED_TOKENS)
            draft, f"{key}-draftstep-{draft.info.name}", curves.contexts, sizes=(1, FEED_TOKENS), repeats=7,
            context_repeats=3, max_length=room,
            measure=lambda m, sizes, repeats, context: measure_draft_step(target.backend, m, repeats, context, sizes))
        cost = cost_model(target).with_draft(steps.at(PROBE_CONTEXT)[1])
        if len(curves.contexts) > 1:
            cost = CostModel(cost.curve, cost.draft, curves, steps)
    return DraftModelDrafter(draft, min_confidence=o.min_confidence, cost=cost, pool_rows=o.pool_rows,
                             prefix_cache=PrefixCache.from_mb(o.prefix_cache_mb)), cost


def _self_draft(target: "LoadedModel", shape, o: DraftModelOptions):
    """``model=self``: the target's own layers less ``skip=`` (default ``default_self_skip``), sharing its
    weights (models/self_draft.py: Draft & Verify, Zhang et al. 2023; SWIFT, Xia et al. 2024)."""
    from .models.cpu import CpuLlama
    from .models.self_draft import layer_subset

    if not isinstance(target.backend, CpuLlama):
        raise ValueError("model=self needs the compiled runtime (backend cpu)")
    if o.vocab not in ("auto", "full") or o.quant not in ("auto", "file") or (shape and shape.window):
        raise ValueError("model=self shares the target's weights and head: no vocab=N, quant or window")
    n = target.backend.args.n_layers
    skip = shape.skip if shape else default_self_skip(n)
    if any(not 0 <= i < n for i in skip) or len(set(skip)) != len(skip) or len(skip) >= n:
        raise ValueError(f"skip must name distinct layers in [0, {n}) and keep one, got {list(skip)}")
    return layer_subset(target.backend, tuple(i for i in range(n) if i not in skip))


def default_self_skip(n_layers: int) -> tuple[int, ...]:
    """The layers ``model=self`` leaves out by default: half of them, every other layer of the middle
    (the first and last quarter kept: Draft & Verify's searched skip sets keep both ends)."""
    lo, hi = n_layers // 4, n_layers - n_layers // 4
    return tuple(range(lo + 1, hi, 2)) if hi - lo > 2 else ()


def _cross_tokenizer(target: "LoadedModel", model: str, o: DraftModelOptions) -> Drafter:
    from .drafters.cross_tokenizer import CrossTokenizerDrafter
    from .models.load import load_any_draft

    draft = load_any_draft(target, model)
    return CrossTokenizerDrafter(draft.backend, draft.tokenizer, target.tokenizer, target.backend.info.bos_token_id,
                                 max_draft=o.max_draft, min_confidence=o.min_confidence)


def layer_list(text: str) -> tuple[int, ...]:
    """Layer ids of ``skip=``: numbers and ranges joined by '+' (``3+10-13`` = 3, 10, 11, 12, 13)."""
    ids: list[int] = []
    for part in filter(None, text.split("+")):
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"skip must list layer numbers or ranges joined by '+' (3+10-13), got {text!r}")
        if hi and not 0 <= int(hi) - int(lo) <= 4096:
            raise ValueError(f"skip range {part!r} must run upwards and be shorter than any model")
        ids.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(ids)


DEFAULT_DRAFT_VOCAB = 32768  # FR-Spec head rows of a catalog draft (plus its control tokens)
DEFAULT_DRAFT_QUANT = WeightFormat.Q4_0  # a catalog draft's wider matrices, re-encoded at load (models.cpu_weights.requantize)


def _eagle(target: "LoadedModel", o: EagleOptions, kind: str = "eagle") -> Drafter:
    from .drafters.eagle import EagleDrafter, EagleHead, check_tree_options
    from .models.load import target_embedding
    from .weights import shipped_weights

    path = o.weights or shipped_weights(kind, target.name)
    head, embed = EagleHead.load(path), target_embedding(target)
    runtime, quant, mode, depth, top_k, budget = o.runtime, o.head_quant, o.mode, o.depth, o.top_k, o.budget
    check_tree_options(head.cfg, mode, depth, top_k, target.backend.info.max_length)  # before sizing the runner
    runner = None
    if runtime == "compiled" or (runtime == "auto" and _compiled_head_fits(target, head)):
        from .drafters.eagle_runner import CompiledHeadRunner

        backend = target.backend
        runner = CompiledHeadRunner(head, embed, max_length=backend.info.max_length, quant=quant,
                                    threads=backend.threads,
                                    max_draft=max(64, depth * top_k))  # a chain's or a tree's expanded nodes
    cost = cost_model(target).curve if budget == "measured" else None  # the target's t(n)
    return EagleDrafter(head, embed, mode=mode, depth=depth, top_k=top_k, runner=runner, cost=cost)


def _compiled_head_fits(target: "LoadedModel", head) -> bool:
    """Run an EAGLE head on the compiled runtime when the target runs there too (a CPU
    process) and the head's shapes come in the runtime's 32-blocks."""
    from .models.cpu import CpuLlama

    c = head.cfg
    return isinstance(target.backend, CpuLlama) and all(
        v % 32 == 0 for v in (c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim))


def _medusa(target: "LoadedModel", o: MedusaOptions) -> Drafter:
    from .drafters.medusa import MedusaDrafter, MedusaHeads
    from .models.load import target_embedding
    from .weights import shipped_weights

    path = o.weights or shipped_weights("medusa", target.name)
    tree = o.tree
    cost = cost_model(target).curve if tree == "sequoia" else None  # hardware-aware size: the target's t(n)
    return MedusaDrafter(MedusaHeads.load(path), target_embedding(target), tree=tree, cost=cost)


_COSTS: dict[str, CostModel] = {}  # cost key -> the target's cost model, built once


def cost_model(target: "LoadedModel") -> CostModel:
    """The target's cost model: its t(n) measured once per configuration (``_cost_key``; cached
    on disk, ``cost_curve.cached_cost_curve``) and built once per process; the drafters that size
    their drafts get it here, and the engine gets it from ``built_cost``."""
    key = _cost_key(target)
    if key not in _COSTS:
        from .cost_curve import cached_cost_curve

        _COSTS[key] = CostModel(cached_cost_curve(target.backend, key))
    return _COSTS[key]


def built_cost(target: "LoadedModel") -> CostModel | None:
    """The cost model built for ``target``'s drafters (``cost_model``), or None when none sizes by
    one: what an engine of ``target`` sizes constrained requests' forced tokens by."""
    return _COSTS.get(_cost_key(target))


def _cost_key(target: "LoadedModel") -> str:
    """What a measured cost curve depends on: model, runtime (and its ISA), weights, threads."""
    import torch

    from .models.cpu_abi import build_id

    info = target.backend.info
    isa = target.backend.isa  # the compiled runtime's kernels differ per ISA
    build = f"-b{build_id()}" if target.backend_kind == "cpu" else ""  # new kernels: measured again
    return (f"{target.name}-{target.backend_kind}{isa}-{target.backend.quant}-{info.dtype}-{info.device}"
            f"-t{torch.get_num_threads()}{build}")


def _hybrid(target: "LoadedModel", o: HybridOptions) -> Drafter:
    import hashlib

    from .cost_curve import cached_cost_curve, measure_draft_cost
    from .drafters.hybrid import HybridDrafter

    retrieval, learned, budget, mode, min_match = o.retrieval, o.learned, o.budget, o.mode, o.min_match
    # the hybrid applies its own min_score: the suffix drafter hands over every draft
    r_opts: dict[str, Any] = {"min_score": 0.0} if retrieval == "suffix" else {}
    if not o.global_suffix:  # no global suffix trie over earlier requests: each request's own only
        r_opts["max_global_tokens"] = 0
    l_opts = {k: str(v) for k, v in o.learned_options.items()}
    if learned in ("eagle", "eagle3"):  # the hybrid sizes each step itself
        l_opts.setdefault("budget", "fixed")
    learned_model = None  # the cost model a draft model sizes its own drafts by
    if learned == "draft":
        learned_drafter, learned_model = _draft_model_costed(target, from_strings(DraftModelOptions, l_opts, "draft"))
    else:
        learned_drafter = make_drafter(learned, target, dict(l_opts))
    sub = [make_drafter(retrieval, target, r_opts), learned_drafter]
    # a draft model with its cost rule sizes its own drafts: the hybrid only picks who proposes
    sizing = "self" if learned_model is not None and mode == "fallback" else "hybrid"
    cost = draft_cost = by_context = None
    catch_up = 0.0
    if budget == "measured" and learned_model is not None and sizing == "self":
        cost = learned_model.curve  # the same t(n) the draft model sizes by
        draft_cost = {n: n * learned_model.draft for n in cost}  # c(n): n draft forwards
        catch_up = learned_model.catch_up()  # at the probe context; by context with its curves
        by_context = learned_model if learned_model.curve_by_context is not None else None
    elif budget == "measured":  # t(n) of the target and c(n) of the learned drafter, measured once
        key = _cost_key(target)
        cost = cost_model(target).curve
        tag = hashlib.sha1(repr((learned, sorted(l_opts.items()), sub[1].cost_signature())).encode()).hexdigest()[:8]
        draft_cost = cached_cost_curve(  # a retrained or resized learned drafter gets a new tag
            target.backend, f"{key}-draft-{learned}-{tag}", repeats=3,
            measure=lambda model, sizes, repeats: measure_draft_cost(model, sub[1], sizes, repeats))
    return HybridDrafter(*sub, mode=mode, min_score=o.min_score, cost=cost, learned_cost=draft_cost,
                         min_match=min_match, learned_sizing=sizing, catch_up_cost=catch_up, rent_start=o.rent_start,
                         context_costs=by_context)


def _prompt_lookup(target: "LoadedModel", o: PromptLookupOptions) -> Drafter:
    return PromptLookupDrafter(max_ngram=o.max_ngram, min_ngram=o.min_ngram, num_candidates=o.num_candidates)


def _suffix(target: "LoadedModel", o: SuffixOptions) -> Drafter:
    from .drafters.suffix_tree import SuffixDecodingDrafter

    return SuffixDecodingDrafter(max_depth=o.max_depth, max_match=o.max_match, max_spec_factor=o.max_spec_factor,
                                 min_token_prob=o.min_token_prob, max_global_tokens=o.max_global_tokens,
                                 min_score=o.min_score, max_global_mb=o.max_global_mb)


def _token_recycling(target: "LoadedModel", o: TokenRecyclingOptions) -> Drafter:
    from .drafters.token_recycling import TokenRecyclingDrafter

    cost = cost_model(target).curve if o.budget == "measured" else None  # the target's t(n)
    return TokenRecyclingDrafter(target.backend.info.vocab_size, k=o.k, max_depth=o.max_depth, cost=cost)


def _lookahead(target: "LoadedModel", o: LookaheadOptions) -> Drafter:
    from .drafters.lookahead import LookaheadDrafter

    return LookaheadDrafter(window=o.window, ngram=o.ngram, guesses=o.guesses, max_keys=o.max_keys)


def _model_free(target: "LoadedModel", o: ModelFreeOptions) -> Drafter:
    from .drafters.model_free import model_free_drafter

    return model_free_drafter(target.backend.info.vocab_size, cost_model(target).curve, o)


def _rest(target: "LoadedModel", o: RestOptions) -> Drafter:
    from .drafters.retrieval import Datastore, RetrievalDrafter, tokenizer_fingerprint

    ds = Datastore.load(o.datastore)
    if ds.fingerprint and ds.fingerprint != tokenizer_fingerprint(target.tokenizer):
        raise ValueError(f"the datastore was built with another tokenizer than {target.name}'s")
    return RetrievalDrafter(ds, max_match=o.max_match, min_match=o.min_match, max_candidates=o.max_candidates)


AUTO_MIN_MATCH = 6  # auto's hybrid: suffix drafts only after a 6-token match (drafters/hybrid.py)


def best_method(target: "LoadedModel", batched: bool = False) -> tuple[str, dict[str, Any]]:
    """The default lossless method for ``target`` (``--drafter auto``), from the measured figures
    in docs/benchmarks.md: a target with a catalog draft model on the compiled runtime gets the
    hybrid (suffix first, where the answer copies its context, the draft model where it does
    not); so does one with a draft found on the machine (``--draft-search``, ``target.found_draft``:
    one of another vocabulary drafts through text, not in the batched server); any other target gets
    SuffixDecoding, or prompt lookup in the batched server (``batched``: the server's measured best,
    docs/cpu.md). ``model-free`` (suffix, else cost-sized Token Recycling) is not the default: on the bare
    1.5B and Gemma-3-270M its tokens per step equalled suffix's and its time did not beat it
    (docs/benchmarks.md, "Targets without a draft model")."""
    if catalog_draft(target):
        return "hybrid", {"learned": "draft", "min_match": AUTO_MIN_MATCH}
    found = getattr(target, "found_draft", None)  # --draft-search (models/discovery.py): a same-vocabulary draft first
    if found is not None and target.backend_kind == "cpu" and (found.same_vocab or not batched):
        return "hybrid", {"learned": "draft", "min_match": AUTO_MIN_MATCH, "learned_model": str(found.path)}
    return ("prompt-lookup", {}) if batched else ("suffix", {})


def describe_method(name: str, target: "LoadedModel") -> str:
    """``name`` as run for ``target``: ``auto`` names what it resolved to."""
    if ALIASES.get(name, name) != "auto":
        return ALIASES.get(name, name)
    method, opts = best_method(target)
    return f"auto: {method}" + (f" ({', '.join(f'{k}={v}' for k, v in opts.items())})" if opts else "")


DRAFTERS: dict[str, tuple[DrafterFactory, type]] = {  # name -> (factory, its options dataclass)
    "auto": (lambda target, o: make_drafter("auto", target), AutoOptions),
    "none": (lambda target, o: NoDrafter(), NoOptions),
    "prompt-lookup": (_prompt_lookup, PromptLookupOptions),
    "eagle": (_eagle, EagleOptions),
    "eagle3": (lambda target, o: _eagle(target, o, "eagle3"), EagleOptions),
    "suffix": (_suffix, SuffixOptions),
    "token-recycling": (_token_recycling, TokenRecyclingOptions),
    "lookahead": (_lookahead, LookaheadOptions),
    "model-free": (_model_free, ModelFreeOptions),
    "rest": (_rest, RestOptions),
    "medusa": (_medusa, MedusaOptions),
    "hybrid": (_hybrid, HybridOptions),
    "draft": (_draft_model, DraftModelOptions),
}


ALIASES = {"recycling": "token-recycling", "retrieval": "rest", "pld": "prompt-lookup"}  # the names the issues use


def make_drafter(name: str, target: "LoadedModel", options: dict[str, Any] | None = None,
                 batched: bool = False) -> Drafter:
    """Build a drafter by name (or an alias; ``auto``: ``best_method``, for the batched server
    when ``batched``); unknown names and unknown options raise ValueError."""
    name = ALIASES.get(name, name)
    if name == "auto":
        name, base = best_method(target, batched)
        options = base | dict(options or {})
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter {name!r}; choose one of: {', '.join(DRAFTERS)}")
    factory, options_class = DRAFTERS[name]
    try:
        return factory(target, from_strings(options_class, dict(options or {}), name))
    except (TypeError, ValueError) as e:
        message = str(e)
        raise ValueError(message if message.startswith(f"drafter {name} ") else f"drafter {name}: {message}") from None


def options_markdown() -> str:
    """The docs' table of every drafter's options (docs/usage.md, "Drafter options"), generated
    from the options dataclasses (tests/unit/test_drafter_options.py checks the docs hold it)."""
    from .drafters.options import describe, summary

    cell = lambda text: str(text).replace("|", "\\|")  # noqa: E731
    lines = ["| drafter | option | type | default | what it sets |", "|---|---|---|---|---|"]
    for name, (_, options) in DRAFTERS.items():
        lines.append(f"| `{name}` | | | | {cell(summary(options))} |")
        lines += [f"| | `{key}` | {cell(kind)} | {cell(default)} | {cell(text)} |" for key, kind, default, text in
                  describe(options)]
    return "\n".join(lines)
