"""A model's tokenizer, whatever its source: a GGUF's own (built from the file by ``gguf_tokenizer``,
nothing converted), else the one in its Hugging Face directory (a llama2.c model's is written
there at conversion, ``converted.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from verispec.models.converted import converted_hf_dir
from verispec.models.gguf_tokenizer import load_gguf_tokenizer
from verispec.models.resolve import ModelSource

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(source: ModelSource) -> PreTrainedTokenizerBase:
    """The tokenizer of any source: a GGUF's own (nothing converted), else the HF directory's."""
    if source.kind == "gguf":
        return load_gguf_tokenizer(source.gguf, max_length=source.config["max_position_embeddings"])
    return hf_dir_tokenizer(converted_hf_dir(source))


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
