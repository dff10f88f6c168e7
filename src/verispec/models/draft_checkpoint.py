"""The shipped draft-model format: a transformers Llama checkpoint without its embedding.

A distilled draft (``verispec.train.draft``) shares the target's tokenizer and its tied
embedding / LM head, so shipping the 28 M-parameter embedding again would only double the
download. The weights directory holds ``model.safetensors`` (decoder layers, final norm and
``draft_vocab``, the reduced vocabulary of FR-Spec, Zhao et al. 2025) and ``config.json``
(the draft's transformers config plus a ``verispec`` section: target, training record).
``materialize`` adds the target's embedding, tokenizer and generation config and writes a
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


def materialize(weights_dir: str | Path, target_dir: str | Path, out_dir: str | Path) -> Path:
    """A complete float32 transformers checkpoint in ``out_dir``: the shipped draft weights,
    the target's embedding (tied LM head), tokenizer and generation config. Idempotent:
    an existing ``out_dir`` is reused (name it after the weights' content)."""
    from safetensors.torch import load_file, save_file

    weights_dir, target_dir, out = Path(weights_dir), Path(target_dir), Path(out_dir)
    if (out / WEIGHTS_FILE).exists() and (out / "config.json").exists():
        return out
    cfg = json.loads((weights_dir / "config.json").read_text())
    state = {k: v.float() for k, v in load_file(str(weights_dir / WEIGHTS_FILE)).items() if k != "draft_vocab"}
    target = {}
    for f in sorted(target_dir.glob("*.safetensors")):
        target.update(load_file(str(f)))
    state["model.embed_tokens.weight"] = target["model.embed_tokens.weight"].float()
    cfg["dtype"] = "float32"
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in target_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, tmp / f.name)
    save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def draft_vocab(weights_dir: str | Path) -> torch.Tensor | None:
    """The reduced vocabulary stored with the weights (sorted token ids), if any."""
    from safetensors import safe_open

    with safe_open(str(Path(weights_dir) / WEIGHTS_FILE), "pt") as f:
        return f.get_tensor("draft_vocab") if "draft_vocab" in f.keys() else None


def is_draft_weights(path: str | Path) -> bool:
    """Is ``path`` a weights directory in this format (as opposed to a full checkpoint)?"""
    cfg = Path(path) / "config.json"
    return cfg.is_file() and json.loads(cfg.read_text()).get("verispec", {}).get("kind") == "draft"


def materialized_dir(weights_dir: str | Path, target_dir: str | Path, cache_dir: str | Path) -> Path:
    """Where ``materialize`` should write: named after the weights' and target's content."""
    import hashlib

    h = hashlib.sha256(str(Path(target_dir).resolve()).encode())
    with open(Path(weights_dir) / WEIGHTS_FILE, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return Path(cache_dir) / "drafts" / f"{Path(weights_dir).name}-{h.hexdigest()[:12]}"
