"""Data shipped with verispec, each beside its license:

* ``models/stories260K/``: Karpathy's stories260K (llama2.c format) and its tokenizer, the
  catalog's ``stories260k`` (MIT, see its LICENSE and README.md);
* ``spec_bench/question.jsonl``: the Spec-Bench questions ``verispec bench`` runs
  (Apache-2.0, see its LICENSE).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).parent


def data_file(rel: str) -> Path:
    """The shipped file ``rel`` (relative to this package); FileNotFoundError if it is missing
    (an install without package data)."""
    path = ROOT / rel
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from this verispec install: reinstall verispec")
    return path
