"""verispec: lossless speculative decoding.

    from verispec import load_model, SpecDecoder, SamplingParams
    model = load_model("smollm2-135m-instruct")
    out = SpecDecoder(model).generate("Summarize: ...", SamplingParams(max_new_tokens=128))

The names below are imported on first use, so ``import verispec`` stays cheap (no torch).
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import TYPE_CHECKING, Any

try:
    __version__ = metadata.version("verispec")
except metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

# public name -> the module that defines it
_EXPORTS = {
    "load_model": "verispec.models.load",
    "SpecDecoder": "verispec.api",
    "LoadedModel": "verispec.models.load",
    "distilled_draft_dir": "verispec.models.load",
    "SamplingParams": "verispec.types",
    "GenerationOutput": "verispec.types",
}

__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:
    from .api import SpecDecoder as SpecDecoder
    from .models.load import LoadedModel as LoadedModel
    from .models.load import distilled_draft_dir as distilled_draft_dir
    from .models.load import load_model as load_model
    from .types import GenerationOutput as GenerationOutput
    from .types import SamplingParams as SamplingParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'verispec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
