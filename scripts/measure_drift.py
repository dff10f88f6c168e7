"""Measure how much a target's logits move when k tokens share one forward instead of k
single-token forwards (the numerics behind the near-tie rule in the exactness tests).

    python scripts/measure_drift.py --model smollm2-135m-instruct --dtype float32
"""

from __future__ import annotations

import json

import torch
import typer

from verispec.api import load_model
from verispec.bench.datasets import load_spec_bench

app = typer.Typer(add_completion=False)


def drift(backend, prompt: list[int], k: int) -> float:
    """max |logits(k tokens in one forward) - logits(one at a time)| over the k positions."""
    n = len(prompt) - k
    c1, c2 = backend.new_cache(), backend.new_cache()
    ids = torch.tensor([prompt])
    pos = torch.arange(len(prompt))[None]
    backend.forward(ids[:, :n], pos[:, :n], c1)
    backend.forward(ids[:, :n], pos[:, :n], c2)
    batched = backend.forward(ids[:, n:], pos[:, n:], c1).logits[0]
    single = torch.cat([backend.forward(ids[:, i:i + 1], pos[:, i:i + 1], c2).logits[0] for i in range(n, n + k)])
    return float((batched - single).abs().max())


@app.command()
def main(model: str = "smollm2-135m-instruct", dtype: str = "float32", backend: str = "hf",
         prompts: int = 8, k: int = 8) -> None:
    lm = load_model(model, dtype=dtype, backend=backend)
    rows = load_spec_bench(limit_per_category=1)[:prompts]
    diffs = [drift(lm.backend, lm.tokenizer(r.turns[0])["input_ids"][:200], k) for r in rows]
    print(json.dumps({"model": model, "dtype": dtype, "backend": lm.backend_kind, "k": k,
                      "max_abs_logit_diff": max(diffs), "per_prompt": diffs}))


if __name__ == "__main__":
    app()
