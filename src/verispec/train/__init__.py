"""Training drafters for a target (``verispec train``): self-distillation data
(``prompts``, ``data``), teacher-forced target features (``features``), a resumable loop
(``loop``) and one trainer per drafter (``eagle``, ``medusa``).

    run_train("eagle", "smollm2-135m-instruct", ["gen.jsonl"], "runs/eagle", steps=600)
"""

from __future__ import annotations

from pathlib import Path

KINDS = ("eagle", "medusa")


def feature_dirs(model, data: list[str | Path], out_dir: Path, log=print) -> list[Path]:
    """Each data path is a features directory (used as is) or a generations JSONL
    (``data.generate_responses`` output), whose features are extracted into
    ``out_dir/features-<name>`` once (resumable)."""
    from transformers import AutoModelForCausalLM

    from . import data as gen_data
    from . import features

    dirs, hf = [], None
    for item in map(Path, data):
        if item.is_dir():
            dirs.append(item)
            continue
        if not item.exists():
            raise ValueError(f"training data {item} does not exist")
        if hf is None:
            hf = AutoModelForCausalLM.from_pretrained(str(model.hf_dir), dtype="float32").eval()
        target = out_dir / f"features-{item.stem}"
        features.extract(hf, gen_data.sequences_from_jsonl(item), target, log=log)
        dirs.append(target)
    return dirs


def run_train(kind: str, model_name: str, data: list[str | Path], out: str | Path, steps: int,
              resume: bool = False, seed: int = 0, lr: float = 1e-3, progress: bool = True) -> dict:
    """Train a ``kind`` drafter for ``model_name``; weights land in ``out/weights``.
    Returns the validation metrics and final loss."""
    from ..api import load_model
    from .loop import TrainConfig

    if kind not in KINDS:
        raise ValueError(f"unknown trainable drafter {kind!r}; choose one of: {', '.join(KINDS)}")
    if not data:
        raise ValueError("no training data: pass generations (.jsonl) or feature directories")
    out = Path(out)
    model = load_model(model_name)
    dirs = feature_dirs(model, data, out)
    cfg = TrainConfig(steps=steps, lr=lr, seed=seed, warmup=min(40, max(1, steps // 10)),
                      ckpt_every=max(1, min(50, steps // 4)))
    if kind == "eagle":
        from .eagle import train_eagle

        _, result, metrics = train_eagle(model.hf_dir, dirs, out, cfg, resume=resume,
                                         target_name=model.name, progress=progress)
    else:
        from .medusa import train_medusa

        _, result, metrics = train_medusa(model.hf_dir, dirs, out, cfg, resume=resume,
                                          target_name=model.name, progress=progress)
    return {"final_loss": result.losses[-1], "validation": metrics, "weights": str(out / "weights")}
