"""Reading a Hugging Face model directory (``config.json``, ``*.safetensors``) without loading a model:
its config and its input embedding (what EAGLE and Medusa heads read)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def hf_dir_config(hf_dir: Path) -> dict | None:
    """An HF directory's config.json, or None when it cannot be read."""
    try:
        return json.loads((hf_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None


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
