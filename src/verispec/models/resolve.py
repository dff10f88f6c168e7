"""Finding a model: a catalog name or a path, resolved to files on disk (``ModelSource``); nothing
large is read and nothing converted.

A catalog entry names a file inside an installed pip package, package data, or a file split into
pip parts (assembled once: ``package_parts.py``); a path is a Hugging Face directory, a ``.gguf``
file (or any file with GGUF's magic, such as an Ollama blob) or a llama2.c ``.bin`` checkpoint. A GGUF's header is parsed here, once (``gguf_file.read_gguf``),
and checked and read into an HF-style config once (``gguf_config.open_gguf``); both travel with the
source (``ModelSource.gguf``, ``ModelSource.config``) to everything that reads the file after: the
runtime choice, the tokenizer, the weights, the cache entry's name.

    source = resolve_model("stories260k")      # ModelSource(kind="llama2c", path=..., tokenizer_path=...)
"""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from verispec.models.base import ModelError
from verispec.models.catalog import CATALOG, CatalogEntry, PackageFile, PackageParts
from verispec.models.gguf_config import OPEN_ARRAYS, open_gguf
from verispec.models.gguf_file import GGUFInfo, read_gguf
from verispec.models.gguf_vocab import is_gguf
from verispec.models.llama2c import find_llama2c_tokenizer, read_llama2c_header, read_llama2c_vocab
from verispec.models.model_cache import default_cache_dir
from verispec.models.package_parts import assemble_package_parts, is_verified


@dataclass(frozen=True)
class ModelSource:
    """What a user named, resolved to files on disk (nothing loaded yet)."""

    name: str  # catalog name or the path given
    kind: Literal["hf_dir", "gguf", "llama2c"]
    path: Path  # dir, .gguf file, or llama2.c .bin
    tokenizer_path: Path | None = None  # llama2.c tokenizer .bin
    chat: bool = False  # has a chat template (instruct model)
    # a GGUF's header, metadata and tensor table: the one parse of the file, passed down
    gguf: GGUFInfo | None = field(default=None, compare=False, repr=False)
    # a GGUF's HF-style config (``open_gguf``: every check before a weight is read); None for
    # the other kinds, whose config is read from their HF directory when they are loaded
    config: dict | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.kind == "gguf" and self.gguf is None:
            info, config = _open_model_gguf(self.path)
            object.__setattr__(self, "gguf", info)
            object.__setattr__(self, "config", config)


def _open_model_gguf(path: Path) -> tuple[GGUFInfo, dict]:
    """The one parse of a GGUF model file (header, tensor table and the arrays ``open_gguf``
    reads) and its checked config: a file verispec does not run fails here, before anything large
    is read."""
    return open_gguf(read_gguf(path, OPEN_ARRAYS))


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
    if path.suffix == ".gguf" or (path.suffix != ".bin" and is_gguf(path)):  # an Ollama blob has no suffix
        info, config = _open_model_gguf(path)
        return ModelSource(name_or_path, "gguf", path, chat="tokenizer.chat_template" in info.meta, gguf=info,
                           config=config)
    if path.suffix == ".bin":
        header = read_llama2c_header(path)
        tok = (
            Path(tokenizer_path).expanduser() if tokenizer_path else find_llama2c_tokenizer(path, header.vocab_size)
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
