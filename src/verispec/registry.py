"""Drafter registry: name -> factory. An explicit dict, no import-time side effects; a new
method plugs in by adding one entry (the engine never changes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .cost_model import CostModel
from .drafters.base import Drafter, NoDrafter
from .drafters.draft_model import DraftModelDrafter
from .drafters.prompt_lookup import PromptLookupDrafter
from .models.formats import WeightFormat

if TYPE_CHECKING:
    from .models.load import LoadedModel

DrafterFactory = Callable[["LoadedModel", dict[str, Any]], Drafter]
DRAFT_PREFIX_CACHE_MB = 256.0  # the draft model's prefix cache: ~10k tokens of Qwen2.5-Coder 0.5B's K/V


def _draft_model(target: "LoadedModel", opts: dict[str, Any]) -> Drafter:
    return _draft_model_costed(target, opts)[0]


def _draft_model_costed(target: "LoadedModel", opts: dict[str, Any]) -> tuple[Drafter, CostModel | None]:
    """The draft model drafter and the cost model it sizes its drafts by (None: fixed k)."""
    from .engine.prefix_cache import PrefixCache
    from .models.catalog import CATALOG
    from .models.cpu_weights import REQUANTS
    from .models.load import DraftShape, OtherTokenizer, load_draft_model
    from .weights import VOCAB_FREQ, has_shipped

    min_conf = float(opts.pop("min_confidence", 0.0))
    pool_rows = int(opts.pop("pool_rows", 16))
    prefix_mb = float(opts.pop("prefix_cache_mb", DRAFT_PREFIX_CACHE_MB))  # its own K/V of earlier requests; 0 = off
    entry = CATALOG.get(target.name)
    default = "shipped" if has_shipped("draft", target.name) else entry.draft if entry and entry.draft else "truncated:4"
    model = str(opts.pop("model", default))
    catalog_gguf = model in VOCAB_FREQ and target.backend_kind == "cpu"  # a catalog GGUF draft on the compiled runtime
    asked = {key: str(opts[key]) for key in ("vocab", "quant") if key in opts}  # what the user set explicitly
    vocab = str(opts.pop("vocab", "auto"))
    if vocab == "auto":  # an FR-Spec head (its token ranking is shipped)
        vocab = str(DEFAULT_DRAFT_VOCAB) if catalog_gguf else "full"
    if vocab != "full" and not vocab.isdigit():
        raise ValueError(f"vocab must be auto, full or a token count, got {vocab!r}")
    quant = str(opts.pop("quant", "auto"))
    if quant == "auto":  # streams Q4_0 (the target checks every token)
        quant = DEFAULT_DRAFT_QUANT if catalog_gguf else "file"
    if quant != "file" and quant not in REQUANTS:
        raise ValueError(f"quant must be auto, file or {', '.join(REQUANTS)}, got {quant!r}")
    requant = None if quant == "file" else WeightFormat(quant)
    shape = DraftShape(skip=layer_list(str(opts.pop("skip", ""))), window=int(opts.pop("window", 0)))
    shape = None if shape == DraftShape() else shape
    stop = str(opts.pop("stop", "auto"))
    if stop not in ("auto", "cost", "fixed"):
        raise ValueError(f"stop must be auto, cost or fixed, got {stop!r}")
    try:
        draft = load_draft_model(target, model, None if vocab == "full" else int(vocab), requant, shape)
    except OtherTokenizer as e:  # another vocabulary: it drafts through text, its file's weights, full head
        if any(value not in ("auto", "full", "file") for value in asked.values()) or stop == "cost" or shape:
            raise ValueError(f"{e}: it drafts through text, without vocab=N, quant, skip, window or stop=cost "
                             "(they need the target's tokenizer)") from None
        return _cross_tokenizer(target, model, min_conf, opts), None
    if stop == "auto":  # a separate draft model sizes its drafts by cost; layer-skip and distilled drafts keep k
        stop = "cost" if model not in ("shipped",) and not model.startswith("truncated:") else "fixed"
    cost = None
    if stop == "cost":
        from .cost_curve import cached_cost_curve, measure_draft_step

        ratio = cached_cost_curve(draft, f"{_cost_key(target)}-draftstep-{draft.info.name}", sizes=(1,), repeats=7,
                                  measure=lambda m, sizes, repeats: measure_draft_step(target.backend, m, repeats))
        cost = cost_model(target).with_draft(ratio[1])
    return DraftModelDrafter(draft, min_confidence=min_conf, cost=cost, pool_rows=pool_rows,
                             prefix_cache=PrefixCache.from_mb(prefix_mb)), cost


def _cross_tokenizer(target: "LoadedModel", model: str, min_conf: float, opts: dict[str, Any]) -> Drafter:
    from .drafters.cross_tokenizer import DEFAULT_MAX_DRAFT, CrossTokenizerDrafter
    from .models.load import load_any_draft

    max_draft = int(opts.pop("max_draft", DEFAULT_MAX_DRAFT))
    draft = load_any_draft(target, model)
    return CrossTokenizerDrafter(draft.backend, draft.tokenizer, target.tokenizer, target.backend.info.bos_token_id,
                                 max_draft=max_draft, min_confidence=min_conf)


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


def _eagle(target: "LoadedModel", opts: dict[str, Any], kind: str = "eagle") -> Drafter:
    from .drafters.eagle import EagleDrafter, EagleHead, check_tree_options
    from .models.load import target_embedding
    from .weights import shipped_weights

    path = opts.pop("weights", None) or shipped_weights(kind, target.name)
    head, embed = EagleHead.load(path), target_embedding(target)
    runtime, quant = str(opts.pop("runtime", "auto")), str(opts.pop("head_quant", WeightFormat.Q8_0))
    mode, depth, top_k = str(opts.pop("mode", "tree")), int(opts.pop("depth", 6)), int(opts.pop("top_k", 8))
    if runtime not in ("auto", "compiled", "torch"):
        raise ValueError(f"runtime must be auto, compiled or torch, got {runtime!r}")
    budget = str(opts.pop("budget", "measured"))
    if budget not in ("measured", "fixed"):
        raise ValueError(f"budget must be measured or fixed, got {budget!r}")
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


def _medusa(target: "LoadedModel", opts: dict[str, Any]) -> Drafter:
    from .drafters.medusa import MedusaDrafter, MedusaHeads
    from .models.load import target_embedding
    from .weights import shipped_weights

    path = opts.pop("weights", None) or shipped_weights("medusa", target.name)
    tree = str(opts.pop("tree", "sparse"))
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


def _hybrid(target: "LoadedModel", opts: dict[str, Any]) -> Drafter:
    import hashlib

    from .cost_curve import cached_cost_curve, measure_draft_cost
    from .drafters.hybrid import HybridDrafter

    retrieval, learned = str(opts.pop("retrieval", "suffix")), str(opts.pop("learned", "eagle"))
    if retrieval not in ("suffix", "prompt-lookup") or learned not in ("eagle", "eagle3", "draft"):
        raise ValueError("needs retrieval=suffix|prompt-lookup and learned=eagle|eagle3|draft")
    budget, mode = str(opts.pop("budget", "measured")), str(opts.pop("mode", "fallback"))
    if budget not in ("measured", "fixed") or mode not in ("fallback", "fuse"):
        raise ValueError(f"needs budget=measured|fixed and mode=fallback|fuse (got {budget}, {mode})")
    # the hybrid applies its own min_score: the suffix drafter hands over every draft
    r_opts = {"min_score": 0.0} if retrieval == "suffix" else {}
    l_opts = {k.removeprefix("learned_"): opts.pop(k) for k in list(opts) if k.startswith("learned_")}
    if learned in ("eagle", "eagle3"):  # the hybrid sizes each step itself
        l_opts.setdefault("budget", "fixed")
    min_match = int(opts.pop("min_match", 0))
    learned_model = None  # the cost model a draft model sizes its own drafts by
    if learned == "draft":
        rest = dict(l_opts)
        learned_drafter, learned_model = _draft_model_costed(target, rest)
        if rest:
            raise ValueError(f"drafter draft has no option(s) {', '.join(sorted(rest))}")
    else:
        learned_drafter = make_drafter(learned, target, dict(l_opts))
    sub = [make_drafter(retrieval, target, r_opts), learned_drafter]
    # a draft model with its cost rule sizes its own drafts: the hybrid only picks who proposes
    sizing = "self" if learned_model is not None and mode == "fallback" else "hybrid"
    cost = draft_cost = None
    catch_up = 0.0
    if budget == "measured" and learned_model is not None and sizing == "self":
        cost = learned_model.curve  # the same t(n) the draft model sizes by
        draft_cost = {n: n * learned_model.draft for n in cost}  # c(n): n draft forwards
        catch_up = learned_model.catch_up()
    elif budget == "measured":  # t(n) of the target and c(n) of the learned drafter, measured once
        key = _cost_key(target)
        cost = cost_model(target).curve
        tag = hashlib.sha1(repr((learned, sorted(l_opts.items()), sub[1].cost_signature())).encode()).hexdigest()[:8]
        draft_cost = cached_cost_curve(  # a retrained or resized learned drafter gets a new tag
            target.backend, f"{key}-draft-{learned}-{tag}", repeats=3,
            measure=lambda model, sizes, repeats: measure_draft_cost(model, sub[1], sizes, repeats))
    return HybridDrafter(*sub, mode=mode, min_score=float(opts.pop("min_score", 1.0)), cost=cost,
                         learned_cost=draft_cost, min_match=min_match, learned_sizing=sizing, catch_up_cost=catch_up,
                         rent_start=opts.pop("rent_start", "predicted"))


def _prompt_lookup(target: "LoadedModel", opts: dict[str, Any]) -> Drafter:
    return PromptLookupDrafter(
        max_ngram=int(opts.pop("max_ngram", 3)),
        min_ngram=int(opts.pop("min_ngram", 1)),
        num_candidates=int(opts.pop("num_candidates", 1)),
    )


def _suffix(target: "LoadedModel", opts: dict[str, Any]) -> Drafter:
    from .drafters.suffix_tree import SuffixDecodingDrafter

    return SuffixDecodingDrafter(
        max_depth=int(opts.pop("max_depth", 64)), max_match=int(opts.pop("max_match", 32)),
        max_spec_factor=float(opts.pop("max_spec_factor", 2.0)),
        min_token_prob=float(opts.pop("min_token_prob", 0.1)),
        max_global_tokens=int(opts.pop("max_global_tokens", 100_000)),
        min_score=float(opts.pop("min_score", 1.5)),
    )


def _token_recycling(target: "LoadedModel", opts: dict[str, Any]) -> Drafter:
    from .drafters.token_recycling import TokenRecyclingDrafter

    return TokenRecyclingDrafter(target.backend.info.vocab_size, k=int(opts.pop("k", 8)),
                                 max_depth=int(opts.pop("max_depth", 8)))


def _lookahead(target: "LoadedModel", opts: dict[str, Any]) -> Drafter:
    from .drafters.lookahead import LookaheadDrafter

    return LookaheadDrafter(window=int(opts.pop("window", 5)), ngram=int(opts.pop("ngram", 4)),
                            guesses=int(opts.pop("guesses", 5)), max_keys=int(opts.pop("max_keys", 8192)))


def _rest(target: "LoadedModel", opts: dict[str, Any]) -> Drafter:
    from .drafters.retrieval import Datastore, RetrievalDrafter, tokenizer_fingerprint

    if "datastore" not in opts:
        raise ValueError("needs -o datastore=<file.npz> (build one with `verispec datastore build`)")
    ds = Datastore.load(str(opts.pop("datastore")))
    if ds.fingerprint and ds.fingerprint != tokenizer_fingerprint(target.tokenizer):
        raise ValueError(f"the datastore was built with another tokenizer than {target.name}'s")
    return RetrievalDrafter(ds, max_match=int(opts.pop("max_match", 16)), min_match=int(opts.pop("min_match", 2)),
                            max_candidates=int(opts.pop("max_candidates", 256)))


AUTO_MIN_MATCH = 6  # auto's hybrid: suffix drafts only after a 6-token match (drafters/hybrid.py)


def best_method(target: "LoadedModel", batched: bool = False) -> tuple[str, dict[str, Any]]:
    """The default lossless method for ``target`` (``--drafter auto``), from the measured figures
    in docs/benchmarks.md: a target with a catalog draft model on the compiled runtime gets the
    hybrid (suffix first, where the answer copies its context, the draft model where it does
    not); any other target gets SuffixDecoding (the fastest measured on SmolLM2), or prompt
    lookup in the batched server (``batched``: the server's measured best, docs/cpu.md)."""
    from .models.catalog import CATALOG
    from .models.resolve import is_installed

    entry = CATALOG.get(target.name)
    if entry and entry.draft and target.backend_kind == "cpu" and is_installed(entry.draft):
        return "hybrid", {"learned": "draft", "min_match": AUTO_MIN_MATCH}
    return ("prompt-lookup", {}) if batched else ("suffix", {})


def describe_method(name: str, target: "LoadedModel") -> str:
    """``name`` as run for ``target``: ``auto`` names what it resolved to."""
    if ALIASES.get(name, name) != "auto":
        return ALIASES.get(name, name)
    method, opts = best_method(target)
    return f"auto: {method}" + (f" ({', '.join(f'{k}={v}' for k, v in opts.items())})" if opts else "")


DRAFTERS: dict[str, tuple[DrafterFactory, str]] = {
    "auto": (lambda target, opts: make_drafter("auto", target, opts), "the best lossless method measured for the target (the default): with a catalog draft model "
             "(Qwen2.5-Coder 1.5B: the 0.5B) the hybrid of suffix and the draft, else suffix (serve: prompt lookup); "
             "options go to that method"),
    "none": (lambda target, opts: NoDrafter(), "plain autoregressive decoding (the baseline)"),
    "prompt-lookup": (_prompt_lookup, "n-gram match over prompt + output (options: max_ngram, min_ngram, num_candidates)"),
    "eagle": (_eagle, "EAGLE feature head on target hidden states, EAGLE-2 dynamic trees (options: mode=tree|chain, depth, top_k, weights=<dir>, runtime=auto|compiled|torch, head_quant=q8_0|f32, budget=measured|fixed)"),
    "eagle3": (lambda target, opts: _eagle(target, opts, "eagle3"), "EAGLE-3 head: fused low/mid/high target layers, trained with training-time test; EAGLE-2 trees (options: mode=tree|chain, depth, top_k, weights=<dir>, runtime=auto|compiled|torch, head_quant=q8_0|f32, budget=measured|fixed)"),
    "suffix": (_suffix, "SuffixDecoding: per-request + global suffix tries, adaptive trees (options: max_depth, max_match, max_spec_factor, min_token_prob, min_score, max_global_tokens)"),
    "token-recycling": (_token_recycling, "Token Recycling: [V, k] successor matrix from past verifications, static tree template (options: k, max_depth)"),
    "lookahead": (_lookahead, "Lookahead decoding: Jacobi window + n-gram pool in one forward; give -k >= (window+guesses)*(ngram-1) (options: window, ngram, guesses, max_keys)"),
    "rest": (_rest, "REST retrieval from a suffix-array datastore (options: datastore=<file.npz>, max_match, min_match, max_candidates)"),
    "medusa": (_medusa, "Medusa heads on the target's last hidden state, sparse tree from measured head accuracy (options: tree=sparse|sequoia, weights=<dir>)"),
    "hybrid": (_hybrid, "suffix (or prompt lookup) first, EAGLE (or EAGLE-3, or the distilled draft) when that pays more, or both fused (RASD); sizes from the measured cost curves (options: retrieval=suffix|prompt-lookup, learned=eagle|eagle3|draft, mode=fallback|fuse, min_score, min_match (suffix drafts only after a match this long), budget=measured|fixed, rent_start=predicted|always|constrained (when a draft model's first start on a request is deferred), learned_<option> passed to the learned drafter)"),
    "draft": (_draft_model, "a small LM: the shipped distilled draft, else the catalog's draft for the target (Qwen2.5-Coder 1.5B: the 0.5B), else the target's first 4 layers; a model with another tokenizer drafts through text (Universal Assisted Generation: max_draft=N target tokens a step, default 3) (options: model=shipped|truncated:N|<name|path>, vocab=auto|full|N (FR-Spec head of the N most frequent tokens), pool_rows=N (requests drafted together in one batched draft forward, default 16), quant=auto|file|q4_0 (auto: a catalog GGUF draft re-encoded to Q4_0 at load, a cheaper draft step; output unchanged), skip=3+10-12 (layers of a GGUF draft left out), window=N (each draft layer attends to its last N keys), stop=auto|cost|fixed (cost: each draft sized by the measured target and draft costs and the draft's confidence), min_confidence, prefix_cache_mb (the draft's own prefix cache across requests, default 256, 0 = off))"),
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
    opts = dict(options or {})
    try:
        drafter = DRAFTERS[name][0](target, opts)
    except (TypeError, ValueError) as e:
        raise ValueError(f"drafter {name}: {e}") from None
    if opts:
        raise ValueError(f"drafter {name} has no option(s) {', '.join(sorted(opts))}")
    return drafter
