"""The shipped draft-model format: a transformers Llama checkpoint without its embedding.

A distilled draft (``verispec.train.draft``) shares the target's tokenizer and its tied
embedding / LM head, so shipping the 28 M-parameter embedding again would only double the
download. The weights directory holds ``model.safetensors`` (decoder layers, final norm and
``draft_vocab``, the reduced vocabulary of FR-Spec, Zhao et al. 2025) and ``config.json``
(the draft's transformers config plus a ``verispec`` section: target, training record).
``write_complete_checkpoint`` adds the target's embedding, tokenizer and generation config and writes a
complete transformers checkpoint, which ``AutoModelForCausalLM.from_pretrained`` loads
(e.g. as transformers' ``assistant_model``) as well as verispec's own backends.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

WEIGHTS_FILE = "model.safetensors"


def save_draft(model, draft_vocab: torch.Tensor, out_dir: str | Path, meta: dict,
               dtype: torch.dtype = torch.bfloat16) -> None:
    """Write the trainable weights (no embedding) in ``dtype``, the reduced vocabulary and
    a config: the transformers config of the draft plus a ``verispec`` section (``meta``)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()
             if k not in ("model.embed_tokens.weight", "lm_head.weight")}
    state["draft_vocab"] = draft_vocab.contiguous()
    save_file(state, str(out / WEIGHTS_FILE))
    cfg = model.config.to_dict() | {"verispec": meta}
    (out / "config.json").write_text(json.dumps(cfg, indent=2, default=str) + "\n")


# what a checkpoint directory needs beside weights and config (tokenizer, chat template, ...)
TARGET_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")


def write_complete_checkpoint(weights_dir: str | Path, target_dir: str | Path, out_dir: str | Path,
                embedding: torch.Tensor | None = None, tokenizer=None, eos_token_ids: list[int] | None = None) -> Path:
    """A complete float32 transformers checkpoint in ``out_dir``: the shipped draft weights,
    the target's embedding (tied LM head), tokenizer and generation config. Idempotent
    (name ``out_dir`` after the content: ``complete_checkpoint_dir``) and atomic. A target that is
    no transformers directory (a GGUF) passes its ``embedding`` [V, H], ``tokenizer`` and
    ``eos_token_ids`` instead of reading them from ``target_dir``."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from .model_cache import cached_dir

    weights_dir, target_dir, out = Path(weights_dir), Path(target_dir), Path(out_dir)

    def build(tmp: Path) -> None:
        cfg = json.loads((weights_dir / "config.json").read_text())
        cfg["dtype"] = "float32"
        cfg["verispec_source"] = cfg.pop("verispec", {})  # no longer a weights-only directory
        state = {k: v.float() for k, v in load_file(str(weights_dir / WEIGHTS_FILE)).items() if k != "draft_vocab"}
        if embedding is not None:
            state["model.embed_tokens.weight"] = embedding.float().contiguous()
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            from transformers import GenerationConfig

            GenerationConfig(bos_token_id=cfg.get("bos_token_id"), eos_token_id=eos_token_ids or cfg.get("eos_token_id"),
                             ).save_pretrained(tmp)
        for f in sorted(target_dir.glob("*.safetensors")) if embedding is None else ():
            with safe_open(str(f), "pt") as sf:
                if "model.embed_tokens.weight" in sf.keys():
                    state["model.embed_tokens.weight"] = sf.get_tensor("model.embed_tokens.weight").float()
        if "model.embed_tokens.weight" not in state:
            raise ValueError(f"target checkpoint {target_dir} has no model.embed_tokens.weight")
        for name in TARGET_FILES if embedding is None else ():
            if (target_dir / name).is_file():
                shutil.copy(target_dir / name, tmp / name)
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    return cached_dir(out, build, f"the draft checkpoint {out.name}")


def draft_vocab(weights_dir: str | Path) -> torch.Tensor | None:
    """The reduced vocabulary stored with the weights (sorted token ids), if any."""
    from safetensors import safe_open

    with safe_open(str(Path(weights_dir) / WEIGHTS_FILE), "pt") as f:
        return f.get_tensor("draft_vocab") if "draft_vocab" in f.keys() else None


def is_draft_weights(path: str | Path) -> bool:
    """Is ``path`` a weights directory in this format (as opposed to a full checkpoint)?"""
    cfg = Path(path) / "config.json"
    return cfg.is_file() and json.loads(cfg.read_text()).get("verispec", {}).get("kind") == "draft"


def complete_checkpoint_dir(weights_dir: str | Path, target_dir: str | Path, cache_dir: str | Path) -> Path:
    """Where ``write_complete_checkpoint`` should write: named after the draft weights' content and the
    target checkpoint (its path, size and modification time)."""
    import hashlib

    target = Path(target_dir).resolve()
    h = hashlib.sha256(str(target).encode())
    for f in [target] if target.is_file() else sorted(target.glob("*.safetensors")):  # a GGUF target: the file
        h.update(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}".encode())
    with open(Path(weights_dir) / WEIGHTS_FILE, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return Path(cache_dir) / "drafts" / f"{Path(weights_dir).name}-{h.hexdigest()[:12]}"
