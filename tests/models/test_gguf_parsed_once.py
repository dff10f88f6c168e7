"""A GGUF is opened once per model load (issue 48) and its header parsed once (issue 37): the ``GGUFInfo`` read when the file is
resolved reaches the config, the tokenizer, the weights and the cache entry's name. The
tokenizer's large arrays are read on a tokenizer-cache miss only, at the offsets that one parse
recorded (no second parse). Counted on the compiled runtime, the PyTorch runtime and drafts."""

from __future__ import annotations

import builtins
import io
import os
from pathlib import Path

import pytest
from gguf_fixtures import write_tiny_gguf

from verispec.api import load_draft_model, load_model
from verispec.models import cpu_abi, gguf_file


@pytest.fixture
def parses(monkeypatch, tmp_path: Path) -> list[Path]:
    """The paths of every GGUF header parse from now on (the model cache is a fresh directory)."""
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    seen: list[Path] = []
    parse = gguf_file._parse

    def counting(path, *args, **kwargs):
        seen.append(Path(path))
        return parse(path, *args, **kwargs)

    monkeypatch.setattr(gguf_file, "_parse", counting)
    return seen


def _backends() -> list[str]:
    return ["native", "cpu"] if cpu_abi.available() else ["native"]


@pytest.mark.parametrize("backend", _backends())
def test_one_header_parse_per_load(backend: str, parses: list[Path], tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "qwen2")
    for cold in (True, False):  # tokenizer built (its arrays read at their offsets), then from the cache
        parses.clear()
        model = load_model(str(path), backend=backend)
        assert parses == [path], f"cold tokenizer cache: {cold}"
        assert model.backend_kind == backend and model.source.gguf is not None


@pytest.mark.parametrize("backend", _backends())
def test_drafts_parse_only_their_own_file(backend: str, parses: list[Path], tmp_path: Path) -> None:
    target_path, draft_path = tmp_path / "target.gguf", tmp_path / "draft.gguf"
    write_tiny_gguf(target_path, "qwen2")
    write_tiny_gguf(draft_path, "qwen2")  # another file of the same model: a draft of the same vocabulary
    target = load_model(str(target_path), backend=backend)
    parses.clear()
    load_draft_model(target, "truncated:1")  # the target's GGUFInfo, passed down
    assert parses == []
    draft = load_draft_model(target, str(draft_path))
    assert parses == [draft_path]
    assert draft.info.vocab_size == target.backend.info.vocab_size


@pytest.fixture
def opens(monkeypatch) -> list[str]:
    """The paths of every file opened from now on (``open``, ``io.open``, ``os.open``)."""
    seen: list[str] = []

    def counting(real):
        def open_(file, *args, **kwargs):
            if isinstance(file, (str, Path)):
                seen.append(str(file))
            return real(file, *args, **kwargs)
        return open_

    for module, name in ((builtins, "open"), (io, "open"), (os, "open")):
        monkeypatch.setattr(module, name, counting(getattr(module, name)))
    return seen


@pytest.mark.parametrize("backend", _backends())
def test_one_open_per_load(backend: str, parses: list[Path], opens: list[str], tmp_path: Path) -> None:
    """One open and one read-only map per load: the tokenizer's texts, the weights (views on the
    compiled runtime, dequantized tensors on the PyTorch one) and the cache entry's name all read
    the map the header parse made."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "qwen2")
    for cold in (True, False):
        opens.clear()
        load_model(str(path), backend=backend)
        assert opens.count(str(path)) == 1, f"cold tokenizer cache: {cold}"
