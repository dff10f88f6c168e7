"""A model as a Hugging Face directory, converted once and cached: what ``--backend hf``, training
and transformers peers read. A GGUF or llama2.c checkpoint is written as ``config.json``,
``model.safetensors`` (float32, HF Llama parameter names), tokenizer files incl. chat template and
``generation_config.json``, once per source file:

    hf_dir = converted_hf_dir(source)          # ~/.cache/verispec/stories260K-llama2c-<hash>/

Conversions write into a temporary directory beside the cache entry and ``rename`` it into place
only after the weights and tokenizer were checked, so an interrupted conversion never leaves a
half-written entry; an entry is checked against its manifest whenever it is read and a damaged one
replaced (``model_cache.py``). The entry name hashes the converter version and the source files
(size, mtime, first MiB; a GGUF by content), so a changed file or converter gets a fresh entry.
"""

from __future__ import annotations

import glob
import hashlib
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from verispec.models.base import ModelError, one_line
from verispec.models.gguf_tensors import gguf_state_dict
from verispec.models.gguf_tokenizer import load_gguf_tokenizer
from verispec.models.llama2c import build_llama2c_tokenizer, read_llama2c_header, read_llama2c_vocab, read_llama2c_weights
from verispec.models.model_cache import cached_dir, default_cache_dir
from verispec.models.resolve import ModelSource

if TYPE_CHECKING:  # transformers is imported inside functions: `verispec models` stays instant
    from transformers import LlamaConfig, PreTrainedTokenizerBase

CONVERTER_VERSION = 3  # bump when the cached directory layout or a conversion changes
_HASH_PREFIX_BYTES = 1 << 20
_PROBE_TEXT = 'Once upon a time, Lily said: "héllo  wörld" 42!\n\tThe end. ✓'


def converted_hf_dir(source: ModelSource, cache_dir: Path | None = None) -> Path:
    """An HF directory for ``source``: ``hf_dir`` as is, other formats converted once and cached
    (a damaged entry is replaced; an unusable cache converts into a directory of this process)."""
    if source.kind == "hf_dir":
        return source.path
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / cache_entry_name(source)
    convert = _convert_gguf if source.kind == "gguf" else _convert_llama2c
    out = cached_dir(final, lambda out: convert(source, out), f"the converted {source.path.name}")
    if out == final:
        prune_stale_entries(source, root)
    return out


def cache_entry_name(source: ModelSource) -> str:
    """``<stem>-<kind>-<16 hex>``; the hash covers the converter version and every source file.

    A GGUF is identified by its content (size, header and tensor table, first and last MiB of
    data), not its modification time: reinstalling the same file reuses the entry."""
    digest = hashlib.sha256(f"verispec-convert-v{CONVERTER_VERSION}:{source.kind}".encode())
    for path in (source.path, source.tokenizer_path):
        if path is None:
            continue
        if source.kind == "gguf" and path == source.path:  # read from the map the one parse made
            info = source.gguf
            data_start = min((t.offset for t in info.tensors.values()), default=0)
            head = info.data[:max(_HASH_PREFIX_BYTES, data_start)] + info.data[max(0, info.size - _HASH_PREFIX_BYTES):]
            digest.update(f"|{path.name}:{info.size}:0:".encode() + head)  # content, not mtime
            continue
        try:
            stat = path.stat()
            with path.open("rb") as f:
                head = f.read(_HASH_PREFIX_BYTES)
        except OSError as err:
            raise ModelError(f"cannot read {path} ({one_line(err)}): expected an existing model file") from None
        digest.update(f"|{path.name}:{stat.st_size}:{stat.st_mtime_ns}:".encode() + head)
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", source.path.stem)
    return f"{stem}-{source.kind}-{digest.hexdigest()[:16]}"


def _llama_config(**fields: object) -> LlamaConfig:
    """A LlamaConfig with float32 weights; ``rope_theta`` moves into ``rope_parameters`` (transformers 5)."""
    from transformers import LlamaConfig

    theta = fields.pop("rope_theta")
    return LlamaConfig(**fields, rope_parameters={"rope_type": "default", "rope_theta": theta}, dtype="float32")


def _check_weights(config: LlamaConfig, weights: dict[str, torch.Tensor]) -> None:
    """Names and shapes must be exactly what the config's model class expects (meta device, no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    got = {name: tuple(t.shape) for name, t in weights.items()}
    if got != expected:
        diff = sorted(set(got.items()) ^ set(expected.items()))[:3]
        raise ModelError(f"conversion produced unexpected weights (first differences: {diff})")


def _write_hf_dir(
    out: Path, config: LlamaConfig, weights: dict[str, torch.Tensor], tokenizer: PreTrainedTokenizerBase,
    eos_ids: list[int],
) -> None:
    """config.json + model.safetensors (float32) + tokenizer files + generation_config.json."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    _check_weights(config, weights)
    config.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in weights.items()}, out / "model.safetensors", metadata={"format": "pt"})
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=eos_ids, pad_token_id=config.pad_token_id
    ).save_pretrained(out)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out)
    _check_saved_tokenizer(tokenizer, out)


def _check_saved_tokenizer(tokenizer: PreTrainedTokenizerBase, out: Path) -> None:
    """The saved tokenizer must encode like the in-memory one and decode back to the text."""
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(out)
    ids = tokenizer.encode(_PROBE_TEXT, add_special_tokens=False)
    if reloaded.encode(_PROBE_TEXT, add_special_tokens=False) != ids:
        raise ModelError(f"saved tokenizer in {out} encodes differently from the source tokenizer")
    if reloaded.decode(ids) != _PROBE_TEXT:
        raise ModelError(f"saved tokenizer in {out} does not decode {_PROBE_TEXT!r} back")
    if bool(tokenizer.chat_template) != bool(reloaded.chat_template):
        raise ModelError(f"saved tokenizer in {out} lost its chat template")


def _convert_llama2c(source: ModelSource, out: Path) -> None:
    if source.tokenizer_path is None:
        raise ModelError(f"llama2.c model {source.path} has no tokenizer: expected tokenizer_path")
    header = read_llama2c_header(source.path)
    tokenizer = build_llama2c_tokenizer(read_llama2c_vocab(source.tokenizer_path, header.vocab_size))
    config = _llama_config(
        vocab_size=header.vocab_size, hidden_size=header.dim, intermediate_size=header.hidden_dim,
        num_hidden_layers=header.n_layers, num_attention_heads=header.n_heads,
        num_key_value_heads=header.n_kv_heads, head_dim=header.head_dim,
        max_position_embeddings=header.seq_len, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=header.shared_classifier, bos_token_id=1, eos_token_id=2, pad_token_id=None,
    )  # fmt: skip
    # llama2.c's `run` stops when the model emits BOS (stories are BOS-delimited), so 1 ends text too.
    _write_hf_dir(out, config, read_llama2c_weights(source.path, header), tokenizer, eos_ids=[2, 1])


def _transformers_config(cfg: dict):
    """A transformers config (LlamaConfig / Qwen2Config) from ``gguf_hf_config``'s dict."""
    from transformers import AutoConfig

    fields = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "torch_dtype", "rope_theta")}
    config = AutoConfig.for_model(cfg["model_type"], **fields, dtype="float32",
                                  rope_parameters={"rope_type": "default", "rope_theta": cfg["rope_theta"]})
    config.architectures = list(cfg["architectures"])
    return config


def _convert_gguf(source: ModelSource, out: Path) -> None:
    """A float32 transformers directory of a GGUF (only ``--backend hf`` and training read it)."""
    info, cfg = source.gguf, source.config
    tokenizer = load_gguf_tokenizer(info, max_length=cfg["max_position_embeddings"])
    config = _transformers_config(cfg)
    eos = cfg["eos_token_id"]
    _write_hf_dir(out, config, gguf_state_dict(info, cfg), tokenizer, eos_ids=eos if isinstance(eos, list) else [eos])


def prune_stale_entries(source: ModelSource, cache_dir: Path | None = None) -> list[Path]:
    """Remove float32 directories that earlier versions (or an earlier copy of the file) left
    in the cache for this GGUF: ``<stem>-gguf-<hash>`` entries other than the current one."""
    if source.kind != "gguf":
        return []
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if not root.is_dir():
        return []
    current = cache_entry_name(source)
    stem = current.rsplit("-gguf-", 1)[0]
    removed = []
    for entry in root.glob(f"{glob.escape(stem)}-gguf-*"):
        if entry.name != current and entry.is_dir() and re.fullmatch(r"[0-9a-f]{16}", entry.name[len(stem) + 6:]):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed

