"""Hostile input, round 3 (issue 32, classes 8-10): the model cache is input too.

8. damaged cache entries (a converted stories260k directory, a GGUF tokenizer entry, a cost curve)
   are noticed when read and replaced, with one warning line;
9. an unusable ``VERISPEC_CACHE`` (a regular file, a path under /proc, a symlink loop, a directory
   that cannot be written, a NUL byte) degrades to a temporary directory with one warning line;
10. catalog assembly (fake tiny "parts", never the Qwen packages) removes the temporaries of killed
    assemblies but not those of live ones, and a full disk is one line naming the directory.
"""

from __future__ import annotations

import errno
import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from gguf_fixtures import write_tiny_gguf
from serving import runner

from verispec.cli import app as cli_app
from verispec.models.base import ModelError
from verispec.models.gguf_file import read_gguf
from verispec.models.gguf_tokenizer import gguf_tokenizer, tokenizer_cache_dir
from verispec.models.converted import converted_hf_dir
from verispec.models.package_parts import assemble_file, Part
from verispec.models.resolve import resolve_model
from verispec.models.tokenizer import hf_dir_tokenizer
from verispec.models.model_cache import (
    MANIFEST,
    entry_damage,
    locked_temp,
    remove_stale_temps,
    sound_entry,
    write_manifest,
)


@pytest.fixture(scope="module")
def stories_entry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sound converted stories260k entry, copied by each test that damages one."""
    return converted_hf_dir(resolve_model("stories260k"), tmp_path_factory.mktemp("pristine"))


def _copy_entry(entry: Path, tmp_path: Path) -> Path:
    cache = tmp_path / "cache"
    shutil.copytree(entry, cache / entry.name)
    return cache


def _garbage(path: Path) -> None:
    path.write_bytes(os.urandom(path.stat().st_size))  # same size, other bytes


DAMAGE = {
    "truncated model.safetensors": lambda e: os.truncate(e / "model.safetensors", 1000),
    "garbage model.safetensors": lambda e: _garbage(e / "model.safetensors"),
    "empty model.safetensors": lambda e: os.truncate(e / "model.safetensors", 0),
    "truncated config.json": lambda e: os.truncate(e / "config.json", 10),
    "garbage config.json": lambda e: _garbage(e / "config.json"),
    "truncated tokenizer.json": lambda e: os.truncate(e / "tokenizer.json", 100),
    "missing tokenizer_config.json": lambda e: (e / "tokenizer_config.json").unlink(),
    "missing manifest": lambda e: (e / MANIFEST).unlink(),
    "garbage manifest": lambda e: (e / MANIFEST).write_text('{"files": 7}'),
}


# --------------------------------------------------------------------------- 8. damaged entries


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_stories_entry_is_replaced(stories_entry: Path, tmp_path: Path, damage: str) -> None:
    cache = _copy_entry(stories_entry, tmp_path)
    entry = cache / stories_entry.name
    DAMAGE[damage](entry)
    assert entry_damage(entry) is not None
    with pytest.warns(RuntimeWarning, match=f"cache entry {entry} is damaged .*: replacing it"):
        out = converted_hf_dir(resolve_model("stories260k"), cache)
    assert out == entry and entry_damage(entry) is None
    assert sorted(p.name for p in cache.iterdir()) == [entry.name]  # nothing left aside
    assert (entry / "model.safetensors").read_bytes() == (stories_entry / "model.safetensors").read_bytes()
    assert hf_dir_tokenizer(entry).encode("Once upon a time") == hf_dir_tokenizer(stories_entry).encode("Once upon a time")


def test_sound_entry_is_read_without_rebuilding(stories_entry: Path, tmp_path: Path) -> None:
    cache = _copy_entry(stories_entry, tmp_path)
    before = (cache / stories_entry.name / "model.safetensors").stat().st_mtime_ns
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert converted_hf_dir(resolve_model("stories260k"), cache) == cache / stories_entry.name
    assert (cache / stories_entry.name / "model.safetensors").stat().st_mtime_ns == before


@pytest.mark.parametrize("entry", ["/proc/self", "/proc/self/fdinfo"])
def test_damaged_entry_that_cannot_be_moved_names_the_directory(entry: str) -> None:
    with pytest.raises(ModelError) as err, pytest.warns(RuntimeWarning, match="is damaged"):
        sound_entry(Path(entry))  # a directory without a manifest that nobody, root included, can rename
    assert "\n" not in str(err.value) and str(err.value).endswith(f"delete the directory {entry}"), err.value


def test_cli_generate_repairs_a_truncated_entry(stories_entry: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    cache = _copy_entry(stories_entry, tmp_path)
    os.truncate(cache / stories_entry.name / "model.safetensors", 4096)
    monkeypatch.setenv("VERISPEC_CACHE", str(cache))
    with pytest.warns(RuntimeWarning, match="is damaged") as record:
        r = runner.invoke(cli_app, ["generate", "--model", "stories260k", "-n", "4", "--drafter", "none", "Once"])
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    assert len(record) == 1 and entry_damage(cache / stories_entry.name) is None


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage", "missing", "bad facts"])
def test_damaged_gguf_tokenizer_entry_is_replaced(tmp_path: Path, damage: str) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf", "qwen2")
    info = read_gguf(tmp_path / "tiny.gguf")
    cache = tmp_path / "cache"
    reference, eos = gguf_tokenizer(info, cache)
    entry = tokenizer_cache_dir(info, cache)
    good = (entry / "tokenizer.json").read_bytes()
    if damage == "truncated":
        os.truncate(entry / "tokenizer.json", len(good) // 2)
    elif damage == "empty":
        os.truncate(entry / "tokenizer.json", 0)
    elif damage == "garbage":
        _garbage(entry / "tokenizer.json")
    elif damage == "missing":
        (entry / "verispec.json").unlink()
    else:  # intact files (the manifest rewritten to match) that do not load
        (entry / "verispec.json").write_text('{"eos_ids": 3}')
        (entry / MANIFEST).unlink()
        write_manifest(entry)
    with pytest.warns(RuntimeWarning, match="is damaged"):
        tokenizer, again = gguf_tokenizer(read_gguf(tmp_path / "tiny.gguf"), cache)
    assert again == eos and tokenizer.encode("the thé") == reference.encode("the thé")
    assert (entry / "tokenizer.json").read_bytes() == good and entry_damage(entry) is None
    assert sorted(p.name for p in entry.parent.iterdir()) == [entry.name]


@pytest.mark.parametrize("stored", ["", "{", '{"t": {"1": "x"}}', '["t"]', "\xff"])
def test_damaged_cost_curve_is_measured_again(tmp_path: Path, stored: str, monkeypatch) -> None:
    from verispec.cost_curve import cached_cost_curve

    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # a quiet machine: the curve is stored

    path = tmp_path / "cost-curves" / "toy.json"
    path.parent.mkdir()
    path.write_bytes(stored.encode("latin-1"))
    with pytest.warns(RuntimeWarning, match="is damaged"):
        curve = cached_cost_curve(None, "toy", sizes=(1, 2), cache_dir=tmp_path, measure=lambda m, s, r: {1: 1.0, 2: 1.5})
    assert curve == {1: 1.0, 2: 1.5} and json.loads(path.read_text())["t"] == {"1": 1.0, "2": 1.5}
    assert sorted(p.name for p in path.parent.iterdir()) == ["toy.json"]


# --------------------------------------------------------------------------- 9. unusable VERISPEC_CACHE


def _unusable(kind: str, tmp_path: Path) -> str:
    if kind == "regular file":
        (tmp_path / "file").write_text("x")
        return str(tmp_path / "file")
    if kind == "under a regular file":
        (tmp_path / "file").write_text("x")
        return str(tmp_path / "file" / "cache")
    if kind == "symlink loop":
        (tmp_path / "a").symlink_to(tmp_path / "b")
        (tmp_path / "b").symlink_to(tmp_path / "a")
        return str(tmp_path / "a")
    if kind == "under /proc":
        return "/proc/verispec-cache"
    return "/proc/self"  # an existing directory nobody can write, root included


UNUSABLE = ["regular file", "under a regular file", "symlink loop", "under /proc", "unwritable directory"]


@pytest.mark.parametrize("kind", UNUSABLE)
def test_unusable_cache_converts_into_a_temporary_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           kind: str) -> None:
    monkeypatch.setenv("VERISPEC_CACHE", _unusable(kind, tmp_path))
    with pytest.warns(RuntimeWarning, match="cannot write the model cache .*: .* not kept") as record:
        out = converted_hf_dir(resolve_model("stories260k"))
    assert len(record) == 1 and "\n" not in str(record[0].message)
    assert entry_damage(out) is not None  # no manifest: a directory of this process, not an entry
    tokenizer = hf_dir_tokenizer(out)
    assert tokenizer.decode(tokenizer.encode("Once upon", add_special_tokens=False)) == "Once upon"
    with pytest.warns(RuntimeWarning, match="cannot write the model cache"):
        assert converted_hf_dir(resolve_model("stories260k")) == out  # built once per process


def test_nul_byte_in_cache_path_degrades(tmp_path: Path) -> None:
    with pytest.warns(RuntimeWarning, match="NUL byte"):
        out = converted_hf_dir(resolve_model("stories260k"), Path(str(tmp_path) + "\0x"))
    assert (out / "model.safetensors").is_file()
    write_tiny_gguf(tmp_path / "tiny.gguf", "qwen2")
    with pytest.warns(RuntimeWarning, match="cannot cache the tokenizer"):
        tokenizer, _ = gguf_tokenizer(read_gguf(tmp_path / "tiny.gguf"), Path(str(tmp_path) + "\0x"))
    assert tokenizer.encode("the") != []


def test_empty_cache_variable_means_the_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERISPEC_CACHE", "")
    monkeypatch.setenv("HOME", str(tmp_path))
    out = converted_hf_dir(resolve_model("stories260k"))
    assert out.parent == tmp_path / ".cache" / "verispec" and entry_damage(out) is None


def test_cli_generate_with_unusable_cache_warns_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERISPEC_CACHE", _unusable("symlink loop", tmp_path))
    with pytest.warns(RuntimeWarning, match="cannot write the model cache") as record:
        r = runner.invoke(cli_app, ["generate", "--model", "stories260k", "-n", "4", "--drafter", "none", "Once"])
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    assert len(record) == 1


# --------------------------------------------------------------------------- 10. catalog assembly


def _parts(tmp_path: Path, sizes=(3000, 1000, 17)) -> tuple[list[Part], bytes]:
    parts, data = [], b""
    for i, n in enumerate(sizes, 1):
        chunk = os.urandom(n)
        path = tmp_path / "site" / f"part{i:02d}.bin"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(chunk)
        parts.append(Part(path, f"pip install 'pkg-part{i}==1.0'", n, hashlib.sha256(chunk).hexdigest()))
        data += chunk
    return parts, data


def _hold(dest: Path, conn) -> None:
    with locked_temp(dest) as tmp:
        tmp.write_bytes(b"x" * 4096)
        conn.send(tmp)
        time.sleep(120)


def _holder(dest: Path) -> tuple[multiprocessing.Process, Path]:
    """A process writing a temporary beside ``dest`` (as an assembly does), and that temporary."""
    ours, theirs = multiprocessing.get_context("fork").Pipe()
    proc = multiprocessing.get_context("fork").Process(target=_hold, args=(dest, theirs), daemon=True)
    proc.start()
    return proc, ours.recv()


def test_stale_temporaries_of_dead_assemblies_are_removed_live_ones_kept(tmp_path: Path) -> None:
    parts, data = _parts(tmp_path)
    dest = tmp_path / "cache" / "models" / "m.gguf"
    dest.parent.mkdir(parents=True)
    killed, dead_tmp = _holder(dest)
    live, live_tmp = _holder(dest)
    try:
        os.kill(killed.pid, signal.SIGKILL)  # killed midway: its temporary stays behind
        killed.join()
        legacy = dest.parent / ".m.gguf.tmp-abc123"  # an older verispec's, never locked
        legacy.write_bytes(b"y" * 100)
        assert dead_tmp.is_file() and live_tmp.is_file()
        assert assemble_file(parts, dest, len(data), hashlib.sha256(data).hexdigest(), "pip install x") == dest
        assert dest.read_bytes() == data
        assert not dead_tmp.exists() and not legacy.exists() and live_tmp.is_file()
        assert sorted(p.name for p in dest.parent.iterdir()) == sorted([live_tmp.name, "m.gguf", "m.gguf.verified"])
    finally:
        live.kill()
        live.join()
    assert remove_stale_temps(dest) == [live_tmp]  # gone with its process


def test_temporary_directory_of_a_live_build_is_kept(tmp_path: Path) -> None:
    final = tmp_path / "entry"
    with locked_temp(final, directory=True) as tmp:
        (tmp / "f").write_text("x")
        assert remove_stale_temps(final) == [] and (tmp / "f").is_file()
    assert not tmp.exists()
    stale = tmp_path / ".entry.tmp-old"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"z")
    assert remove_stale_temps(final) == [stale] and not stale.exists()


@pytest.mark.parametrize("free", [0, 100, 4016])
def test_too_little_free_space_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    parts, data = _parts(tmp_path)
    dest = tmp_path / "cache" / "m.gguf"
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=10**9, used=10**9 - free, free=free))
    with pytest.raises(ModelError) as err:
        assemble_file(parts, dest, len(data), hashlib.sha256(data).hexdigest(), "pip install x")
    message = str(err.value)
    assert "\n" not in message and str(dest.parent) in message and f"{len(data):,}" in message, message
    assert sorted(p.name for p in dest.parent.iterdir()) == []


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_disk_filling_during_assembly_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    parts, data = _parts(tmp_path)
    dest = tmp_path / "cache" / "m.gguf"

    def full(fd: int) -> None:  # a write-back that finds the disk full (another writer took the room)
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(ModelError) as err:
        assemble_file(parts, dest, len(data), hashlib.sha256(data).hexdigest(), "pip install x")
    message = str(err.value)
    assert "\n" not in message and str(dest.parent) in message and f"{len(data):,} bytes" in message, message
    assert sorted(p.name for p in dest.parent.iterdir()) == []  # the temporary went with the error


@pytest.mark.parametrize("kind", ["regular file", "symlink loop", "under /proc"])
def test_assembly_into_unusable_cache_is_one_line(tmp_path: Path, kind: str) -> None:
    parts, data = _parts(tmp_path)
    dest = Path(_unusable(kind, tmp_path)) / "models" / "m.gguf"
    with pytest.raises(ModelError) as err:
        assemble_file(parts, dest, len(data), hashlib.sha256(data).hexdigest(), "pip install x")
    assert "\n" not in str(err.value) and "VERISPEC_CACHE" in str(err.value), err.value


def test_damaged_assembled_file_is_replaced(tmp_path: Path) -> None:
    parts, data = _parts(tmp_path)
    dest = tmp_path / "cache" / "m.gguf"
    sha = hashlib.sha256(data).hexdigest()
    dest.mkdir(parents=True)  # a directory where the file belongs
    (dest / "junk").write_text("x")
    with pytest.warns(RuntimeWarning, match="not a regular file"):
        assert assemble_file(parts, dest, len(data), sha, "pip install x").read_bytes() == data
    assert sorted(p.name for p in dest.parent.iterdir()) == ["m.gguf", "m.gguf.verified"]


@pytest.mark.parametrize("damage", ["garbage header", "shifted tail"])
def test_large_safetensors_are_checked_by_their_header(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       damage: str) -> None:
    """Files above HASHED_BYTES (a float32 GGUF conversion) are not hashed on every read: their
    size and safetensors header are."""
    import torch
    from safetensors.torch import save_file

    from verispec.models import model_cache

    monkeypatch.setattr(model_cache, "HASHED_BYTES", 0)
    save_file({"a": torch.zeros(100), "b": torch.ones(50)}, str(tmp_path / "model.safetensors"))
    write_manifest(tmp_path)
    assert entry_damage(tmp_path) is None
    data = (tmp_path / "model.safetensors").read_bytes()
    if damage == "garbage header":
        data = os.urandom(8) + data[8:]
    else:  # same size, the header claims a shorter file
        n = int.from_bytes(data[:8], "little")
        data = data[:8] + data[8:8 + n].replace(b"600", b"599") + data[8 + n:]
    (tmp_path / "model.safetensors").write_bytes(data)
    assert entry_damage(tmp_path) == "model.safetensors has a malformed header"
