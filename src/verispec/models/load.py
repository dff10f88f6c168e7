"""Loading a model: resolve a catalog name or path, pick a backend (``choose_backend``), load
its weights and tokenizer (``load_model``); drafts for it (``load_draft_model``,
``distilled_draft_dir``). ``verispec.api`` re-exports the public names."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from .base import CausalLM, ModelError
from .catalog import DEFAULT_MODEL
from .formats import PYTORCH_FORMATS, WeightFormat
from .loading import ModelSource, default_quant, hf_dir_tokenizer, materialize, resolve_model

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
Prompt = str | list[dict[str, str]]


@dataclass(frozen=True)
class LoadedModel:
    name: str
    backend: CausalLM
    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    source: ModelSource  # what was loaded: an HF dir, a GGUF file, a llama2.c checkpoint
    has_chat_template: bool
    backend_kind: str
    # the PyTorch runtime's format closest to its weights (none, int8, int4): what a draft of it
    # on another backend runs as
    quant: WeightFormat = WeightFormat.NONE

    def __post_init__(self):
        object.__setattr__(self, "quant", WeightFormat.parse(self.quant, PYTORCH_FORMATS))

    @cached_property
    def hf_dir(self) -> Path:
        """A transformers directory of this model, for what needs one (``--backend hf``,
        training, transformers peers). A GGUF loads without it; asking for it converts the
        file to float32 once (cached)."""
        return materialize(self.source)


def _dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use float32 or bfloat16")
    return DTYPES[name]


QUANTS = ("auto", *PYTORCH_FORMATS)  # what --quant takes
BACKENDS = ("auto", "cpu", "native", "hf")


def parse_quant(quant: WeightFormat | str) -> WeightFormat | str:
    """A ``--quant`` value: ``"auto"`` (the checkpoint's own precision) or one of PYTORCH_FORMATS."""
    if quant == "auto":
        return "auto"
    try:
        return WeightFormat.parse(quant, PYTORCH_FORMATS)
    except ValueError:
        raise ValueError(f"unknown quant {quant!r}; use {', '.join(QUANTS)}") from None


def choose_backend(cfg: dict | None, dtype: torch.dtype, device: str, gguf: bool = False) -> str:
    """What ``backend="auto"`` runs a checkpoint of this HF config on: the compiled runtime
    (``cpu``) for a Llama-family model on CPU in float32 when it is built (bf16 asks for
    PyTorch), else the native PyTorch runtime for a Llama-family model (always for a ``gguf``,
    which ``open_gguf`` has checked), else transformers (``hf``). ``cfg`` None: unreadable.
    Only a runtime that is not built or a shape it does not run falls back from ``cpu``; for
    a GGUF (whose blocks the compiled runtime reads) each says so, in one line on stderr. A
    malformed file never gets here: ``open_gguf`` refuses it first."""
    from . import cpu

    llama_family = cfg is not None and _native_supports(cfg)
    if dtype == torch.float32 and torch.device(device).type == "cpu" and llama_family:
        if cpu.supports(cfg):
            if cpu.available():  # if not built, available() says so (once)
                return "cpu"
        elif gguf:
            import warnings

            warnings.warn(f"the compiled runtime does not run this model's shape ({cpu.SHAPES}); running the "
                          "PyTorch runtime instead, 30-100x slower on CPU", RuntimeWarning, stacklevel=2)
    return "native" if gguf or llama_family else "hf"


def _native_supports(cfg: dict) -> bool:
    """Is this HF config a Llama-family model the native runtime runs?"""
    from .llama import LlamaArgs

    try:
        LlamaArgs.from_hf_config(cfg)
    except (ModelError, KeyError, ValueError):
        return False
    return True


def _hf_config(hf_dir: Path) -> dict | None:
    """An HF directory's config.json, or None when it cannot be read."""
    try:
        return json.loads((hf_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None


def _load_backend(hf_dir: Path, name: str, dtype: torch.dtype, backend: str, device: str,
                  num_layers: int | None = None, quant: WeightFormat | str = WeightFormat.NONE,
                  head_rows: torch.Tensor | None = None, gguf: Path | None = None) -> tuple[CausalLM, str]:
    """``auto``: the compiled CPU runtime for Llama-family models on CPU, else the native
    PyTorch runtime, transformers for the rest. ``head_rows`` (cpu and native): a reduced
    LM head over these token ids (a draft's). ``gguf`` (cpu only, with quant ``auto``): read
    the weights from that file's own blocks."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = choose_backend(_hf_config(hf_dir), dtype, device)
    if backend == "cpu":
        from .cpu import CpuLlama

        if torch.device(device).type != "cpu":
            raise ValueError(f"backend cpu runs on the CPU, not {device}; use --backend native")
        if dtype != torch.float32:
            raise ValueError("backend cpu computes in float32 (quantized weights, int8 activations); drop --dtype")
        if quant == "auto" and gguf is None:
            quant = WeightFormat.NONE
        return CpuLlama.from_hf_dir(hf_dir, quant=WeightFormat.F32 if quant == "auto" else quant.compiled,
                                    num_layers=num_layers,
                                    gguf=gguf if quant == "auto" else None, head_rows=head_rows), "cpu"
    if backend == "native":
        from .native import NativeLlama

        kw = {"num_layers": num_layers} if num_layers else {}
        return NativeLlama.from_hf_dir(hf_dir, dtype=dtype, device=device, quant=quant, head_rows=head_rows,
                                       **kw), "native"
    if quant != WeightFormat.NONE:
        raise ValueError(f"quant={quant!s} needs the native backend (transformers runs unquantized weights)")
    from .hf import HFCausalLM

    if num_layers:
        from transformers import AutoModelForCausalLM

        m = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype, num_hidden_layers=num_layers)
        return HFCausalLM(m.to(device), f"{name}[:{num_layers}]"), "hf"
    return HFCausalLM.from_dir(hf_dir, dtype=dtype, device=device, name=name), "hf"


def load_model(name_or_path: str = DEFAULT_MODEL, dtype: str = "float32",
               backend: str = "auto", device: str = "cpu", quant: WeightFormat | str = "auto") -> LoadedModel:
    """Resolve a catalog name or path and load a backend.

    ``backend="auto"`` runs Llama-family models on CPU on the compiled runtime (``cpu``:
    bit-exact speculation by construction), elsewhere on the native PyTorch runtime, and
    others on transformers. ``quant="auto"`` keeps the checkpoint's own precision (a GGUF's
    own blocks on ``cpu``; int4 groups for a Q4 GGUF on ``native``: ``default_quant``);
    ``dtype`` is the activation dtype (and the weights' when unquantized; ``cpu`` is float32).
    A GGUF loads directly (config, tokenizer, chat template and weights from the file); only
    ``backend="hf"`` converts it to a float32 transformers directory (once, cached)."""
    quant = parse_quant(quant)
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use {', '.join(BACKENDS)}")
    source = resolve_model(name_or_path)
    if source.kind == "gguf" and backend != "hf":
        return _load_gguf(source, _dtype(dtype), backend, device, quant)
    hf_dir = materialize(source)
    if backend == "auto":  # resolved once here: _load_backend then need not read the config again
        backend = choose_backend(_hf_config(hf_dir), _dtype(dtype), device)
    gguf = source.path if source.kind == "gguf" else None
    if quant == "auto" and backend == "native":
        quant = default_quant(source)
    elif quant == "auto" and backend == "hf":
        quant = WeightFormat.NONE
    model, kind = _load_backend(hf_dir, source.name, _dtype(dtype), backend, device, quant=quant, gguf=gguf)
    if kind == "cpu" and quant == "auto":  # a draft on another backend keeps the checkpoint's precision
        quant = default_quant(source)
    tokenizer = hf_dir_tokenizer(hf_dir)
    chat = bool(tokenizer.chat_template)
    loaded = LoadedModel(source.name, model, tokenizer, source, chat, kind, quant)
    loaded.__dict__["hf_dir"] = hf_dir  # already there: the property need not look again
    return loaded


def _load_gguf(source: ModelSource, dtype: torch.dtype, backend: str, device: str,
               quant: WeightFormat | str) -> LoadedModel:
    """A GGUF straight from the file: nothing float32 is written. ``cpu`` reads the file's own
    blocks; ``native`` dequantizes them in memory (and says so)."""
    from .loading import load_gguf_tokenizer, open_gguf, prune_stale_entries

    info, cfg = open_gguf(source)  # architecture, metadata, tensors and their data ranges: before any weight
    if backend == "auto":
        backend = choose_backend(cfg, dtype, device, gguf=True)
    tokenizer = load_gguf_tokenizer(info)
    model = _gguf_backend(source, info, cfg, source.name, dtype, backend, device, quant=quant)
    if quant == "auto":  # a draft on another backend keeps the checkpoint's precision
        quant = default_quant(source)
    prune_stale_entries(source)  # float32 directories earlier versions wrote for this file
    return LoadedModel(source.name, model, tokenizer, source, bool(tokenizer.chat_template), backend, quant)


_DEQUANT_WARNED: set[Path] = set()


def _gguf_backend(source: ModelSource, info, cfg: dict, name: str, dtype: torch.dtype, backend: str, device: str,
                  num_layers: int | None = None, quant: WeightFormat | str = "auto",
                  head_rows: torch.Tensor | None = None, requant: WeightFormat | None = None) -> CausalLM:
    """A GGUF on the ``cpu`` or ``native`` runtime (``num_layers``: the first layers only;
    ``requant``: matrices re-encoded at load, ``models.cpu.requantize``)."""
    from .loading import gguf_state_dict

    if num_layers is not None:
        if not 1 <= num_layers <= cfg["num_hidden_layers"]:
            raise ValueError(f"num_layers must be in [1, {cfg['num_hidden_layers']}], got {num_layers}")
        cfg, name = {**cfg, "num_hidden_layers": num_layers}, f"{name}[:{num_layers}]"
    context = gguf_context(source, info, cfg)
    if backend == "cpu":
        from .cpu import CpuLlama, gguf_weights

        if torch.device(device).type != "cpu":
            raise ValueError(f"backend cpu runs on the CPU, not {device}; use --backend native")
        if dtype != torch.float32:
            raise ValueError("backend cpu computes in float32 (quantized weights, int8 activations); drop --dtype")
        if quant == "auto":  # the file's own blocks (head_rows: only those LM-head rows)
            weights = gguf_weights(source.path, cfg, head_rows=head_rows, requant=requant)
            model = CpuLlama.from_weights(cfg, weights, context, name=name, head_rows=head_rows)
            model.gguf_path = source.path
            return model
        fmt = quant.compiled
        _say_dequantized(source, info, f"the compiled runtime requantizes it to {fmt}")
        state = gguf_state_dict(info, cfg)
        return CpuLlama.from_state_dict(cfg, state, context, quant=fmt, name=name, head_rows=head_rows)
    if backend == "native":
        from .native import NativeLlama, NativeOptions

        if quant == "auto":
            quant = default_quant(source)
        _say_dequantized(source, info, f"the PyTorch runtime runs it as {quant}")
        state = gguf_state_dict(info, cfg)
        return NativeLlama.from_state_dict(cfg, state, NativeOptions(dtype=dtype, quant=quant), device, context,
                                           name=name, head_rows=head_rows)
    raise ValueError(f"backend {backend!r} does not read a GGUF directly")


MIN_CONTEXT = 1 << 16  # a GGUF's context is never cut below this many tokens (gguf_context)
_CONTEXT_WARNED: set[Path] = set()


def gguf_context(source: ModelSource, info, cfg: dict) -> int:
    """The context a GGUF runs with: the one it declares (``context_length``), unless the RoPE
    tables of that many positions, built at load for every position a request may reach
    (head_dim floats a position, here and in the compiled runtime), would outweigh the file
    itself: then the largest context whose tables do not, at least MIN_CONTEXT, said once. A
    4.7 MB file declaring 2^24 tokens made ``generate`` build 2.5-20 GiB of tables."""
    import warnings

    declared, per_position = cfg["max_position_embeddings"], 8 * cfg["head_dim"]
    fits = max(MIN_CONTEXT, info.size // per_position)
    if declared <= fits:
        return declared
    if source.path not in _CONTEXT_WARNED:
        _CONTEXT_WARNED.add(source.path)
        warnings.warn(f"{source.path.name} declares a context of {declared:,} tokens, whose RoPE tables "
                      f"({declared * per_position / 2**30:.1f} GiB) would outweigh the file ({info.size / 2**20:.1f} MiB): "
                      f"running with a context of {fits:,} tokens", RuntimeWarning, stacklevel=3)
    return fits


def _say_dequantized(source: ModelSource, info, how: str) -> None:
    """Once per file: a GGUF's blocks were dequantized to float32 in memory (nothing is written)."""
    import warnings

    from .loading import gguf_dequant_bytes

    if source.path in _DEQUANT_WARNED:
        return
    _DEQUANT_WARNED.add(source.path)
    warnings.warn(f"{source.path.name}: dequantizing its blocks to float32 in memory "
                  f"({gguf_dequant_bytes(info) / 2**30:.1f} GiB, nothing written); {how}", RuntimeWarning, stacklevel=3)


def target_embedding(model: LoadedModel) -> torch.Tensor:
    """[V, H] float32 input embedding of the target (what EAGLE and Medusa heads read): from a
    GGUF's ``token_embd`` (dequantized in memory, the rest of the file untouched), else the HF dir."""
    if model.source.kind == "gguf":
        from .loading import gguf_tensor, read_gguf

        return gguf_tensor(read_gguf(model.source.path), "token_embd.weight")
    from .loading import load_target_embedding

    return load_target_embedding(model.hf_dir)


def distilled_draft_dir(target: LoadedModel, weights: str = "shipped") -> Path:
    """A complete transformers checkpoint of a distilled draft for ``target`` (the shipped
    one, or a ``verispec train draft`` weights directory), written once to the cache: what
    transformers' ``generate(assistant_model=...)`` loads."""
    from ..weights import shipped_weights
    from .draft_checkpoint import is_draft_weights, materialize, materialized_dir
    from .loading import default_cache_dir
    from .model_cache import sound_entry

    path = shipped_weights("draft", target.name) if weights == "shipped" else Path(weights)
    if not is_draft_weights(path):
        raise ValueError(f"{path} is not a distilled draft's weights directory (verispec train draft output)")
    if target.source.kind == "gguf":  # the embedding and tokenizer come from the file: no float32 target copy
        out = materialized_dir(path, target.source.path, default_cache_dir())
        if sound_entry(out):
            return out
        return materialize(path, target.source.path, out, embedding=target_embedding(target),
                           tokenizer=target.tokenizer, eos_token_ids=list(target.backend.info.eos_token_ids))
    return materialize(path, target.hf_dir, materialized_dir(path, target.hf_dir, default_cache_dir()))


def load_draft_model(target: LoadedModel, spec: str, vocab: int | None = None,
                     requant: WeightFormat | None = None) -> CausalLM:
    """``shipped`` = the distilled draft shipped for the target (``verispec.weights``);
    ``truncated:N`` = the target's first N layers with its norm and head (an untrained
    layer-skip draft); a draft weights directory (``verispec train draft`` output); anything
    else is a model name or path sharing the target's vocab. The draft runs on the
    target's backend, dtype and weight format. ``vocab`` (a GGUF draft on the compiled
    runtime): an FR-Spec head of the draft's ``vocab`` most frequent tokens plus its control
    tokens (``weights.frequent_tokens``); the draft reads ~8x fewer head bytes per token and
    the target still verifies every token, so output is unchanged. ``requant`` (the same
    drafts): its wider matrices re-encoded at load, e.g. ``q4_0`` (``models.cpu.requantize``),
    for a cheaper draft step, again with output unchanged."""
    from ..weights import shipped_weights
    from .draft_checkpoint import draft_vocab, is_draft_weights

    info = target.backend.info
    if spec.startswith("truncated:"):
        n = int(spec.split(":", 1)[1])
        if n < 1:
            raise ValueError("truncated:N needs N >= 1")
        if target.source.kind == "gguf" and target.backend_kind in ("cpu", "native"):
            from .loading import open_gguf

            gguf_info, cfg = open_gguf(target.source)
            quant = "auto" if target.backend_kind == "cpu" and target.backend.gguf_path else target.quant
            return _gguf_backend(target.source, gguf_info, cfg, target.name, info.dtype, target.backend_kind,
                                 str(info.device), n, quant=quant)
        gguf = target.backend.gguf_path
        return _load_backend(target.hf_dir, target.name, info.dtype, target.backend_kind, str(info.device), n,
                             quant="auto" if gguf else target.quant, gguf=gguf)[0]
    weights = shipped_weights("draft", target.name) if spec == "shipped" else Path(spec)
    if spec == "shipped" or is_draft_weights(weights):
        hf_dir = distilled_draft_dir(target, spec)
        kind = target.backend_kind
        rows = draft_vocab(weights) if kind in ("cpu", "native") else None  # transformers: the full head
        quant = WeightFormat.Q8_0 if kind == "cpu" else target.quant
        return _load_backend(hf_dir, f"draft-{target.name}", info.dtype, kind, str(info.device),
                             quant=quant, head_rows=rows)[0]
    if vocab is not None or requant is not None:
        return _load_gguf_draft(target, spec, vocab, requant)
    source = resolve_model(spec)
    if source.kind == "gguf":  # refused before any weight is read
        from .loading import load_gguf_tokenizer, open_gguf

        _check_same_tokenizer(target, spec, load_gguf_tokenizer(open_gguf(source)[0]))
    draft = load_model(spec, dtype=str(info.dtype).removeprefix("torch."), backend=target.backend_kind,
                       device=str(info.device), quant="auto" if target.backend_kind == "cpu" else target.quant)
    _check_same_tokenizer(target, spec, draft.tokenizer)
    return draft.backend


def _check_same_tokenizer(target: LoadedModel, spec: str, tokenizer) -> None:
    if tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise ValueError(f"draft model {spec} does not share the tokenizer of the target {target.name} "
                         "(drafting across tokenizers is not supported): pick a draft of the same family")


def _load_gguf_draft(target: LoadedModel, spec: str, vocab: int | None,
                     requant: WeightFormat | None) -> CausalLM:
    """A GGUF draft on the compiled runtime with an FR-Spec head and/or requantized (load_draft_model)."""
    from ..weights import frequent_tokens
    from .loading import load_gguf_tokenizer, open_gguf

    source = resolve_model(spec)
    if source.kind != "gguf" or target.backend_kind != "cpu":
        raise ValueError("vocab=N and quant=q4_0 need a GGUF draft on the compiled runtime (backend cpu); "
                         "use vocab=full quant=file")
    info, cfg = open_gguf(source)
    tokenizer = load_gguf_tokenizer(info)
    _check_same_tokenizer(target, spec, tokenizer)
    rows = None if vocab is None else frequent_tokens(source.name, vocab, sorted(tokenizer.added_tokens_decoder))
    tags = ([] if rows is None else [f"vocab {len(rows)}"]) + ([] if requant is None else [requant])
    return _gguf_backend(source, info, cfg, f"{source.name}[{', '.join(tags)}]", target.backend.info.dtype, "cpu",
                         "cpu", head_rows=rows, requant=requant)
