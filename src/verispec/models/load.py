"""Loading a model: resolve a catalog name or path (``models/resolve.py``), decide the runtime and
its weight format once (``runtime_choice.py``), load its weights and tokenizer (``load_model``);
drafts for it (``load_draft_model``, ``distilled_draft_dir``). ``verispec.api`` re-exports the
public names.

A GGUF is parsed and checked once, when it is resolved; its ``GGUFInfo`` and HF-style config
(``ModelSource.gguf``, ``ModelSource.config``) reach the runtime choice, the tokenizer, the weights
and the cache from there."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .base import CausalLM
from .catalog import DEFAULT_MODEL
from .converted import converted_hf_dir, prune_stale_entries
from .formats import WeightFormat
from .gguf_file import GGUFInfo
from .gguf_tensors import gguf_dequant_bytes, gguf_state_dict, gguf_tensor
from .gguf_tokenizer import load_gguf_tokenizer
from .hf_dir import hf_dir_config, load_target_embedding
from .resolve import ModelSource, resolve_model
from .runtime_choice import BACKENDS, RuntimeChoice, checkpoint_format, choose_runtime, parse_quant
from .tokenizer import hf_dir_tokenizer, load_tokenizer

if TYPE_CHECKING:
    from .discovery import FoundDraft

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
Prompt = str | list[dict[str, str]]


@dataclass(frozen=True)
class LoadedModel:
    name: str
    backend: CausalLM
    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    source: ModelSource  # what was loaded: an HF dir, a GGUF file, a llama2.c checkpoint
    has_chat_template: bool
    choice: RuntimeChoice  # the runtime and weight format it runs with
    found_draft: FoundDraft | None = None  # a draft model found on the machine (``--draft-search``: models/discovery.py)

    @property
    def backend_kind(self) -> str:
        return self.choice.backend

    @property
    def pytorch_format(self) -> WeightFormat:
        return self.choice.pytorch_format

    @cached_property
    def hf_dir(self) -> Path:
        """A transformers directory of this model, for what needs one (``--backend hf``,
        training, transformers peers). A GGUF loads without it; asking for it converts the
        file to float32 once (cached)."""
        return converted_hf_dir(self.source)


def _dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use float32 or bfloat16")
    return DTYPES[name]


def load_model(name_or_path: str = DEFAULT_MODEL, dtype: str = "float32",
               backend: str = "auto", device: str = "cpu", quant: WeightFormat | str = "auto") -> LoadedModel:
    """Resolve a catalog name or path and load a backend.

    ``backend="auto"`` runs Llama-family models on CPU on the compiled runtime (``cpu``:
    bit-exact speculation by construction), elsewhere on the native PyTorch runtime, and
    others on transformers. ``quant="auto"`` keeps the checkpoint's own precision
    (``choose_runtime``); ``dtype`` is the activation dtype (and the weights' when
    unquantized; ``cpu`` is float32). A GGUF loads directly (config, tokenizer, chat template
    and weights from the file); only ``backend="hf"`` converts it to a float32 transformers
    directory (once, cached)."""
    torch_dtype, quant = _dtype(dtype), parse_quant(quant)  # the arguments first, then the model
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use {', '.join(BACKENDS)}")
    return _load_source(resolve_model(name_or_path), torch_dtype, backend, device, quant)


def _load_source(source: ModelSource, dtype: torch.dtype, backend: str, device: str,
                 quant: WeightFormat | str) -> LoadedModel:
    """``load_model`` of a resolved source."""
    if source.kind == "gguf" and backend != "hf":
        return _load_gguf(source, dtype, backend, device, quant)
    hf_dir = converted_hf_dir(source)
    choice = choose_runtime(source, hf_dir_config(hf_dir), backend, quant, dtype, device)
    model = _hf_dir_backend(hf_dir, source.name, dtype, choice, device)
    tokenizer = hf_dir_tokenizer(hf_dir)
    loaded = LoadedModel(source.name, model, tokenizer, source, bool(tokenizer.chat_template), choice)
    loaded.__dict__["hf_dir"] = hf_dir  # already there: the property need not look again
    return loaded


def _hf_dir_backend(hf_dir: Path, name: str, dtype: torch.dtype, choice: RuntimeChoice, device: str,
                    num_layers: int | None = None, head_rows: torch.Tensor | None = None) -> CausalLM:
    """The model of an HF directory on the chosen runtime. ``num_layers``: the first layers only;
    ``head_rows`` (cpu and native): a reduced LM head over these token ids (a draft's)."""
    if choice.backend == "cpu":
        from .cpu import CpuLlama

        return CpuLlama.from_hf_dir(hf_dir, quant=choice.weights, num_layers=num_layers, head_rows=head_rows)
    if choice.backend == "native":
        from .native import NativeLlama

        kw = {"num_layers": num_layers} if num_layers else {}
        return NativeLlama.from_hf_dir(hf_dir, dtype=dtype, device=device, quant=choice.weights, head_rows=head_rows,
                                       **kw)
    from .hf import HFCausalLM

    if num_layers:
        from transformers import AutoModelForCausalLM

        m = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype, num_hidden_layers=num_layers)
        return HFCausalLM(m.to(device), f"{name}[:{num_layers}]")
    return HFCausalLM.from_dir(hf_dir, dtype=dtype, device=device, name=name)


def _load_gguf(source: ModelSource, dtype: torch.dtype, backend: str, device: str,
               quant: WeightFormat | str) -> LoadedModel:
    """A GGUF straight from the file: nothing float32 is written. ``cpu`` reads the file's own
    blocks; ``native`` dequantizes them in memory (and says so)."""
    choice = choose_runtime(source, source.config, backend, quant, dtype, device)
    tokenizer = load_gguf_tokenizer(source.gguf, max_length=source.config["max_position_embeddings"])
    model = _gguf_backend(source, source.name, dtype, choice, device)
    prune_stale_entries(source)  # float32 directories earlier versions wrote for this file
    return LoadedModel(source.name, model, tokenizer, source, bool(tokenizer.chat_template), choice)


_DEQUANT_WARNED: set[Path] = set()


def _gguf_backend(source: ModelSource, name: str, dtype: torch.dtype, choice: RuntimeChoice, device: str,
                  num_layers: int | None = None, head_rows: torch.Tensor | None = None,
                  requant: WeightFormat | None = None, shape: DraftShape | None = None) -> CausalLM:
    """A GGUF on the ``cpu`` or ``native`` runtime (``num_layers``: the first layers only;
    ``requant``: matrices re-encoded at load, ``cpu_weights.requantize``; ``shape``: a draft's
    skipped layers and attention window, compiled runtime only)."""
    info, cfg = source.gguf, source.config
    if num_layers is not None:
        if not 1 <= num_layers <= cfg["num_hidden_layers"]:
            raise ValueError(f"num_layers must be in [1, {cfg['num_hidden_layers']}], got {num_layers}")
        cfg, name = {**cfg, "num_hidden_layers": num_layers}, f"{name}[:{num_layers}]"
    layer_ids = None
    if shape is not None and (shape.skip or shape.window):
        if choice.backend != "cpu" or choice.weights is not None:
            raise ValueError("a draft's skip= and window= need its GGUF's own blocks on the compiled runtime")
        cfg, layer_ids = shape.apply(cfg)
    context = gguf_context(source, cfg)
    if choice.backend == "cpu":
        from .cpu import CpuLlama
        from .cpu_weights import gguf_weights

        if choice.weights is None:  # the file's own blocks (head_rows: only those LM-head rows)
            weights = gguf_weights(info, cfg, head_rows=head_rows, requant=requant, layer_ids=layer_ids)
            model = CpuLlama.from_weights(cfg, weights, context, name=name, head_rows=head_rows)
            model.gguf_path = source.path
            return model
        _say_dequantized(source, info, f"the compiled runtime requantizes it to {choice.weights}")
        state = gguf_state_dict(info, cfg)
        return CpuLlama.from_state_dict(cfg, state, context, quant=choice.weights, name=name, head_rows=head_rows)
    if choice.backend == "native":
        from .llama import LlamaArgs, check_native
        from .native import NativeLlama, NativeOptions

        check_native(LlamaArgs.from_hf_config(cfg), name)  # before any weight is dequantized
        _say_dequantized(source, info, f"the PyTorch runtime runs it as {choice.weights}")
        state = gguf_state_dict(info, cfg)
        return NativeLlama.from_state_dict(cfg, state, NativeOptions(dtype=dtype, quant=choice.weights), device,
                                           context, name=name, head_rows=head_rows)
    raise ValueError(f"backend {choice.backend!r} does not read a GGUF directly")


MIN_CONTEXT = 1 << 16  # a GGUF's context is never cut below this many tokens (gguf_context)
_CONTEXT_WARNED: set[Path] = set()


def gguf_context(source: ModelSource, cfg: dict) -> int:
    """The context a GGUF runs with: the one it declares (``context_length``), unless the RoPE
    tables of that many positions, built at load for every position a request may reach
    (head_dim floats a position, here and in the compiled runtime), would outweigh the file
    itself: then the largest context whose tables do not, at least MIN_CONTEXT, said once. A
    4.7 MB file declaring 2^24 tokens made ``generate`` build 2.5-20 GiB of tables."""
    import warnings

    info, declared, per_position = source.gguf, cfg["max_position_embeddings"], 8 * cfg["head_dim"]
    fits = max(MIN_CONTEXT, info.size // per_position)
    if declared <= fits:
        return declared
    if source.path not in _CONTEXT_WARNED:
        _CONTEXT_WARNED.add(source.path)
        warnings.warn(f"{source.path.name} declares a context of {declared:,} tokens, whose RoPE tables "
                      f"({declared * per_position / 2**30:.1f} GiB) would outweigh the file ({info.size / 2**20:.1f} MiB): "
                      f"running with a context of {fits:,} tokens", RuntimeWarning, stacklevel=3)
    return fits


def _say_dequantized(source: ModelSource, info: GGUFInfo, how: str) -> None:
    """Once per file: a GGUF's blocks were dequantized to float32 in memory (nothing is written)."""
    import warnings

    if source.path in _DEQUANT_WARNED:
        return
    _DEQUANT_WARNED.add(source.path)
    warnings.warn(f"{source.path.name}: dequantizing its blocks to float32 in memory "
                  f"({gguf_dequant_bytes(info) / 2**30:.1f} GiB, nothing written); {how}", RuntimeWarning, stacklevel=3)


def target_embedding(model: LoadedModel) -> torch.Tensor:
    """[V, H] float32 input embedding of the target (what EAGLE and Medusa heads read): from a
    GGUF's ``token_embd`` (dequantized in memory, the rest of the file untouched), else the HF dir."""
    if model.source.kind == "gguf":
        return gguf_tensor(model.source.gguf, "token_embd.weight")
    return load_target_embedding(model.hf_dir)


def distilled_draft_dir(target: LoadedModel, weights: str = "shipped") -> Path:
    """A complete transformers checkpoint of a distilled draft for ``target`` (the shipped
    one, or a ``verispec train draft`` weights directory), written once to the cache: what
    transformers' ``generate(assistant_model=...)`` loads."""
    from ..weights import shipped_weights
    from .draft_checkpoint import complete_checkpoint_dir, is_draft_weights, write_complete_checkpoint
    from .model_cache import default_cache_dir, sound_entry

    path = shipped_weights("draft", target.name) if weights == "shipped" else Path(weights)
    if not is_draft_weights(path):
        raise ValueError(f"{path} is not a distilled draft's weights directory (verispec train draft output)")
    if target.source.kind == "gguf":  # the embedding and tokenizer come from the file: no float32 target copy
        out = complete_checkpoint_dir(path, target.source.path, default_cache_dir())
        if sound_entry(out):
            return out
        return write_complete_checkpoint(path, target.source.path, out, embedding=target_embedding(target),
                                         tokenizer=target.tokenizer,
                                         eos_token_ids=list(target.backend.info.eos_token_ids))
    return write_complete_checkpoint(path, target.hf_dir, complete_checkpoint_dir(path, target.hf_dir,
                                                                                  default_cache_dir()))


@dataclass(frozen=True)
class DraftShape:
    """A GGUF draft made cheaper at load, its output still only a proposal: ``skip``, layers of
    the file left out (a self-speculative draft of the draft, after Zhang et al. 2024, "Draft &
    Verify", arXiv 2309.08168); ``window``, every layer attending to its last ``window`` keys
    only (0: all), so a long context does not make each draft token read the whole K/V cache."""

    skip: tuple[int, ...] = ()
    window: int = 0

    def apply(self, cfg: dict) -> tuple[dict, tuple[int, ...] | None]:
        """``cfg`` with the layers kept and the window; the file's ids of the layers kept (None: all)."""
        n = cfg["num_hidden_layers"]
        if any(not 0 <= i < n for i in self.skip) or len(set(self.skip)) != len(self.skip) or len(self.skip) >= n:
            raise ValueError(f"skip must name distinct layers in [0, {n}) and keep one, got {list(self.skip)}")
        if self.window < 0:
            raise ValueError(f"window must be >= 0, got {self.window}")
        keep = tuple(i for i in range(n) if i not in self.skip)
        types = cfg.get("layer_types") or ["sliding_attention" if cfg.get("sliding_window") else "full_attention"] * n
        out = {**cfg, "num_hidden_layers": len(keep), "layer_types": [types[i] for i in keep]}
        if self.window:  # every layer slides: over the file's own window where that is shorter
            own = cfg.get("sliding_window") or 0
            out["layer_types"] = ["sliding_attention"] * len(keep)
            out["sliding_window"] = min(self.window, own) if own else self.window
            if own and any(t != "sliding_attention" for t in types):
                raise ValueError("window= on a draft whose file mixes window sizes is not supported")
        return out, (keep if self.skip else None)


def load_draft_model(target: LoadedModel, spec: str, vocab: int | None = None,
                     requant: WeightFormat | None = None, shape: DraftShape | None = None) -> CausalLM:
    """``shipped`` = the distilled draft shipped for the target (``verispec.weights``);
    ``truncated:N`` = the target's first N layers with its norm and head (an untrained
    layer-skip draft); a draft weights directory (``verispec train draft`` output); anything
    else is a model name or path sharing the target's vocab. The draft runs on the
    target's backend, dtype and weight format. ``vocab`` (a GGUF draft on the compiled
    runtime): an FR-Spec head of the draft's ``vocab`` most frequent tokens plus its control
    tokens (``weights.frequent_tokens``); the draft reads ~8x fewer head bytes per token and
    the target still verifies every token, so output is unchanged. ``requant`` (the same
    drafts): its wider matrices re-encoded at load, e.g. ``q4_0`` (``cpu_weights.requantize``),
    for a cheaper draft step, again with output unchanged; ``shape`` (the same drafts): layers
    skipped and an attention window (``DraftShape``)."""
    from ..weights import shipped_weights
    from .draft_checkpoint import draft_vocab, is_draft_weights

    info = target.backend.info
    if spec.startswith("truncated:"):
        n = int(spec.split(":", 1)[1])
        if n < 1:
            raise ValueError("truncated:N needs N >= 1")
        if target.source.kind == "gguf" and target.backend_kind in ("cpu", "native"):
            return _gguf_backend(target.source, target.name, info.dtype, target.choice, str(info.device), n)
        return _hf_dir_backend(target.hf_dir, target.name, info.dtype, target.choice, str(info.device), n)
    weights = shipped_weights("draft", target.name) if spec == "shipped" else Path(spec)
    if spec == "shipped" or is_draft_weights(weights):
        hf_dir = distilled_draft_dir(target, spec)
        kind = target.backend_kind
        rows = draft_vocab(weights) if kind in ("cpu", "native") else None  # transformers: the full head
        choice = RuntimeChoice(kind, WeightFormat.Q8_0 if kind == "cpu" else target.pytorch_format,
                               target.pytorch_format)
        return _hf_dir_backend(hf_dir, f"draft-{target.name}", info.dtype, choice, str(info.device), head_rows=rows)
    if vocab is not None or requant is not None or shape is not None:
        return _load_gguf_draft(target, spec, vocab, requant, shape)
    source = resolve_model(spec)
    _check_same_tokenizer(target, spec, load_tokenizer(source))  # refused before any weight is read
    return _load_beside(target, source).backend


def load_any_draft(target: LoadedModel, spec: str) -> LoadedModel:
    """The draft model ``spec`` (a name or path) with its own tokenizer, whatever it is, on the
    target's backend: what drafting through text needs (``drafters.cross_tokenizer``)."""
    return _load_beside(target, resolve_model(spec))


def _load_beside(target: LoadedModel, source: ModelSource) -> LoadedModel:
    info = target.backend.info
    return _load_source(source, info.dtype, target.backend_kind, str(info.device),
                        "auto" if target.backend_kind == "cpu" else target.pytorch_format)


class OtherTokenizer(ValueError):
    """A draft model whose vocabulary is not the target's (it can draft through text instead)."""


def _check_same_tokenizer(target: LoadedModel, spec: str, tokenizer) -> None:
    if tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise OtherTokenizer(f"draft model {spec} does not share the tokenizer of the target {target.name}")


def _load_gguf_draft(target: LoadedModel, spec: str, vocab: int | None,
                     requant: WeightFormat | None, shape: DraftShape | None = None) -> CausalLM:
    """A GGUF draft on the compiled runtime with an FR-Spec head and/or requantized (load_draft_model)."""
    from ..weights import frequent_tokens
    from .gguf_vocab import vocab_key_of

    source = resolve_model(spec)
    tokenizer = load_tokenizer(source)
    _check_same_tokenizer(target, spec, tokenizer)  # first: another tokenizer drafts through text (registry)
    if source.kind != "gguf" or target.backend_kind != "cpu":
        raise ValueError("vocab=N, quant=q4_0, skip= and window= need a GGUF draft on the compiled runtime "
                         "(backend cpu); use vocab=full quant=file")
    rows = None if vocab is None else frequent_tokens(source.name, vocab, sorted(tokenizer.added_tokens_decoder), vocab_key_of)
    tags = ([] if rows is None else [f"vocab {len(rows)}"]) + ([] if requant is None else [requant])
    if shape is not None and shape.skip:
        tags.append(f"skip {','.join(map(str, shape.skip))}")
    if shape is not None and shape.window:
        tags.append(f"window {shape.window}")
    choice = RuntimeChoice("cpu", None, checkpoint_format(source))  # the file's own blocks
    return _gguf_backend(source, f"{source.name}[{', '.join(tags)}]", target.backend.info.dtype, choice, "cpu",
                         head_rows=rows, requant=requant, shape=shape)
