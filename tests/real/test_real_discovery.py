"""``--draft-search`` on the real Qwen2.5-Coder pair: the 1.5B given as a bare GGUF path (no catalog
draft known) finds the 0.5B in a store laid out as Hugging Face's hub cache by its vocabulary (the
two files' names, chat templates and sizes differ), and ``auto``'s greedy output with it is plain
decoding's."""

from __future__ import annotations

import os
import shutil

import pytest

from verispec.api import SpecDecoder, load_model
from verispec.models.discovery import Location, with_found_draft
from verispec.models.resolve import resolve_model
from verispec.registry import best_method
from verispec.types import SamplingParams


@pytest.mark.qwen
def test_the_bare_15b_finds_its_05b_draft_and_greedy_is_plain(tmp_path):
    target_path = resolve_model("qwen2.5-coder-1.5b-instruct").path
    draft_file = resolve_model("qwen2.5-coder-0.5b-instruct").path
    base = tmp_path / "hub" / "models--Qwen--Qwen2.5-Coder-0.5B-Instruct-GGUF"
    blob = base / "blobs" / "1d9614638d18"
    blob.parent.mkdir(parents=True)
    try:
        os.link(draft_file, blob)
    except OSError:
        shutil.copyfile(draft_file, blob)
    snap = base / "snapshots" / "main" / "qwen2.5-coder-0.5b-instruct-q8_0.gguf"
    snap.parent.mkdir(parents=True)
    snap.symlink_to(os.path.relpath(blob, snap.parent))
    said = []
    lm = with_found_draft(load_model(str(target_path)), [Location(tmp_path / "hub", "hf")], said.append)
    assert lm.found_draft is not None and lm.found_draft.path == snap and lm.found_draft.same_vocab, said
    assert said[-1].startswith(f"draft search: drafting {target_path} with Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF/")
    assert best_method(lm)[1]["learned_model"] == str(snap)
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    prompt = "Write a Python function is_prime(n) with a docstring."
    plain = SpecDecoder(lm, "none").generate(prompt, params)
    out = SpecDecoder(lm, "auto", num_draft_tokens=8).generate(prompt, params)
    assert out.token_ids == plain.token_ids and out.stats.drafted > 0
    draft = SpecDecoder(lm, "auto").drafter.learned.model  # Qwen2.5's vocabulary: the catalog draft's FR-Spec head
    assert draft.head_rows is not None and "vocab 32788, q4_0" in draft.info.name
