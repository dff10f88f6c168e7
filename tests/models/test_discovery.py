"""Draft discovery (``models/discovery.py``, ``models/gguf_vocab.py``) on fixture stores laid out as
Hugging Face's hub cache, Ollama's blob store, LM Studio's folder and a plain ``~/models``: a GGUF is a
draft when its vocabulary (tokens, merges, model) is the target's byte for byte, whatever its name;
the smallest within the cost bound is chosen; another vocabulary only when small enough to pay through
text. Nothing outside a location is read (links out of it are skipped, said in one line) and hostile
files are one line each, never an exception."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from gguf_fixtures import ARRAY, INT32, STRING, UINT32, patch, tiny_qwen2, write_gguf
from verispec.models.base import ModelError
from verispec.models.discovery import (
    CROSS_MAX_COST,
    SAME_MAX_COST,
    FoundDraft,
    Location,
    choose,
    default_locations,
    found_line,
    locations_from_paths,
    scan,
    search_draft,
)
from verispec.models.gguf_vocab import read_vocab_header


def model(path: Path, hidden: int = 32, layers: int = 2, seed: int = 1, other_vocab: bool = False,
          arch: str = "qwen2", name: str = "tiny") -> Path:
    """A tiny qwen2 GGUF: the target's vocabulary unless ``other_vocab`` (one token more)."""
    meta, tensors = tiny_qwen2(hidden=hidden, heads=2 if hidden < 64 else 4, kv_heads=1 if hidden < 64 else 2,
                               ffn=2 * hidden, layers=layers, context=1024, seed=seed)
    meta["general.name"] = (STRING, name)
    if other_vocab:
        meta["tokenizer.ggml.tokens"] = (ARRAY, (STRING, meta["tokenizer.ggml.tokens"][1][1] + ["Ġa"]))
        meta["tokenizer.ggml.token_type"] = (ARRAY, (INT32, meta["tokenizer.ggml.token_type"][1][1] + [1]))
        for key in ("token_embd.weight", "output.weight"):
            tensors[key] = np.concatenate([tensors[key], tensors[key][:1]])
    if arch != "qwen2":  # the same vocabulary in an architecture verispec does not run
        meta = {k.replace("qwen2.", f"{arch}.") if k.startswith("qwen2.") else k: v for k, v in meta.items()}
        meta["general.architecture"] = (STRING, arch)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_gguf(path, meta, tensors)
    return path


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return model(tmp_path_factory.mktemp("target") / "target.gguf", hidden=128, layers=4, seed=0, name="target")


def hf_store(root: Path, repo: str, file: str, **kw) -> Path:
    """``models--org--repo/snapshots/<rev>/<file>`` linked (relatively) to its blob, as huggingface_hub lays it out."""
    base = root / f"models--{repo.replace('/', '--')}"
    blob = model(base / "blobs" / "0f3a9e", **kw)
    snap = base / "snapshots" / "abc123" / file
    snap.parent.mkdir(parents=True)
    snap.symlink_to(os.path.relpath(blob, snap.parent))
    return snap


def ollama_store(root: Path, name: str, tag: str, **kw) -> Path:
    """``blobs/sha256-<hex>`` (a model, a template) and its manifest, as Ollama lays them out."""
    digest = "ab" * 32
    blob = model(root / "blobs" / f"sha256-{digest}", **kw)
    (root / "blobs" / f"sha256-{'cd' * 32}").write_text("{{ .Prompt }}")  # a template layer: no GGUF magic
    manifest = root / "manifests" / "registry.ollama.ai" / "library" / name / tag
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"layers": [
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}"},
        {"mediaType": "application/vnd.ollama.image.template", "digest": f"sha256:{'cd' * 32}"}]}))
    return blob


def test_the_same_vocabulary_is_found_in_each_store_whatever_its_name(tmp_path, target):
    hf = tmp_path / "hub"
    hf_store(hf, "someone/renamed-model", "weights-q8.gguf")
    said: list[str] = []
    found = search_draft(target, [Location(hf, "hf")], said.append)
    assert found == FoundDraft(hf / "models--someone--renamed-model/snapshots/abc123/weights-q8.gguf",
                               "someone/renamed-model/weights-q8.gguf", "hf", pytest.approx(found.cost), True)
    assert found.cost < 0.1 and said == []

    oll = tmp_path / "ollama"
    blob = ollama_store(oll, "tiny", "0.5b")
    found = search_draft(target, [Location(oll, "ollama")], said.append)
    assert (found.path, found.name, found.same_vocab) == (blob, "tiny:0.5b", True) and said == []

    lms = tmp_path / "lmstudio"
    path = model(lms / "publisher" / "repo" / "draft.gguf")
    found = search_draft(target, locations_from_paths([lms]), said.append)
    assert (found.path, found.name, found.store) == (path, "publisher/repo/draft.gguf", "dir") and said == []


def test_the_rule_smallest_same_vocabulary_then_small_other_vocabulary_else_none(tmp_path, target):
    store = tmp_path / "models"
    loc = [Location(store)]
    assert search_draft(target, loc, print) is None  # the folder does not exist: nothing, no error
    model(store / "big-same.gguf", hidden=128, layers=3)  # same vocabulary, more than half the target's bytes
    model(store / "other-arch.gguf", arch="bert")  # same vocabulary, an architecture verispec does not run
    model(store / "other-big.gguf", hidden=64, other_vocab=True)  # another vocabulary, too big to pay through text
    t = read_vocab_header(target)
    costs = {p.name: read_vocab_header(p).size / t.size for p in store.iterdir()}
    assert costs["big-same.gguf"] > SAME_MAX_COST and CROSS_MAX_COST < costs["other-big.gguf"] < SAME_MAX_COST
    assert search_draft(target, loc, print) is None

    model(store / "other-small.gguf", hidden=32, other_vocab=True)
    found = search_draft(target, loc, print)
    assert found.name == "other-small.gguf" and not found.same_vocab  # drafts through text

    model(store / "a" / "same-mid.gguf", hidden=64)
    model(store / "z" / "same-small.gguf", hidden=32)
    ranked = choose(t, scan(loc, print))
    assert [d.name for d in ranked] == ["z/same-small.gguf", "a/same-mid.gguf", "other-small.gguf"]
    assert [d.same_vocab for d in ranked] == [True, True, False]
    assert "z/same-small.gguf" in found_line("t", ranked[0], loc) and "same vocabulary" in found_line("t", ranked[0], loc)
    assert "auto runs without one" in found_line("t", None, loc)


def test_the_target_itself_and_copies_of_one_file_are_not_candidates(tmp_path, target):
    store = tmp_path / "models"
    store.mkdir()
    (store / "target.gguf").hardlink_to(target)  # the target's own file, found in a store
    assert search_draft(target, [Location(store)], print) is None
    model(store / "small.gguf")
    (store / "again.gguf").symlink_to("small.gguf")  # one file under two names: read once
    found = scan([Location(store)], print, skip=[target])
    assert [(h.path, name) for h, _, name in found] == [(store / "again.gguf", "again.gguf")]


def test_links_out_of_a_location_are_never_followed(tmp_path, target):
    outside = tmp_path / "outside"
    good = model(outside / "draft.gguf")  # a perfect draft, but not in the location searched
    store = tmp_path / "models"
    store.mkdir()
    (store / "link.gguf").symlink_to(good)
    (store / "linked-dir").symlink_to(outside, target_is_directory=True)
    said: list[str] = []
    assert search_draft(target, [Location(store)], said.append) is None
    assert said == [f"draft search: skipped {store / 'link.gguf'}: a link out of {store}"]


def hostile(tmp_path: Path) -> dict[str, Path]:
    """Files named like models that are not ones."""
    d = tmp_path / "models"
    d.mkdir()
    out = {}
    (d / "empty.gguf").write_bytes(b"")
    (d / "text.gguf").write_text("not a model")
    (d / "short.gguf").write_bytes(b"GGUF\x03\x00")
    meta, tensors = tiny_qwen2(context=1024)
    for label, field, value in (("keys", "kv count", 1 << 40), ("version", "version", 7),
                                ("tokens", "kv tokenizer.ggml.tokens count", 1 << 60),
                                ("string", "kv general.architecture length", 1 << 62),
                                ("type", "kv general.architecture type", 99),
                                ("item", "kv tokenizer.ggml.merges item type", 9)):
        path = d / f"{label}.gguf"
        patch(path, write_gguf(path, meta, tensors)[field], value)
        out[label] = path
    cut = d / "cut.gguf"
    cut.write_bytes(write_gguf_bytes(meta, tensors)[:3000])  # the header cut inside the token list
    os.mkfifo(d / "fifo.gguf")  # would block a reader that opens it
    (d / "dev.gguf").symlink_to("/dev/zero")  # a device, outside the location anyway
    (d / "loop.gguf").symlink_to("loop.gguf")  # a link to itself
    return {"dir": d, **out}


def write_gguf_bytes(meta, tensors) -> bytes:
    from gguf_fixtures import gguf_bytes

    return gguf_bytes(meta, tensors)[0]


def test_hostile_files_are_one_line_each_and_skipped(tmp_path, target):
    files = hostile(tmp_path)
    store = files["dir"]
    said: list[str] = []
    assert search_draft(target, [Location(store)], said.append) is None
    assert all(line.startswith("draft search: skipped ") and "\n" not in line for line in said), said
    named = {Path(line.split()[3].rstrip(":")).name for line in said}
    assert named >= {"empty.gguf", "text.gguf", "short.gguf", "keys.gguf", "version.gguf", "tokens.gguf",
                     "string.gguf", "type.gguf", "item.gguf", "cut.gguf", "fifo.gguf", "dev.gguf", "loop.gguf"}, said
    # a good draft beside them is still found
    model(store / "zz-good.gguf")
    assert search_draft(target, [Location(store)], lambda line: None).name == "zz-good.gguf"


def test_the_header_is_read_within_its_bound(tmp_path):
    path = model(tmp_path / "m.gguf")
    head = read_vocab_header(path)
    assert head.architecture == "qwen2" and head.n_tokens == 262 and head.vocab_key
    with pytest.raises(ModelError, match="runs past its first 2,000 bytes"):
        read_vocab_header(path, max_bytes=2000)  # the token list lies beyond: refused, not read further


def test_a_gguf_without_a_vocabulary_is_no_draft(tmp_path, target):
    meta, tensors = tiny_qwen2(context=1024)
    meta = {k: v for k, v in meta.items() if not k.startswith("tokenizer.")}
    write_gguf(tmp_path / "adapter.gguf", meta, tensors)  # e.g. a LoRA adapter or a vision projector
    said: list[str] = []
    assert search_draft(target, [Location(tmp_path)], said.append) is None and said == []


def test_names_and_merges_decide_not_names(tmp_path, target):
    """Another name and chat template keep the vocabulary; other merges (same tokens) do not."""
    meta, tensors = tiny_qwen2(hidden=32, heads=2, kv_heads=1, ffn=64, context=1024)
    meta["general.name"] = (STRING, "Completely Different 7B")
    meta["tokenizer.chat_template"] = (STRING, "{{ messages }}")
    meta["tokenizer.ggml.bos_token_id"] = (UINT32, 1)
    write_gguf(tmp_path / "renamed.gguf", meta, tensors)
    meta["tokenizer.ggml.merges"] = (ARRAY, (STRING, ["h e", "Ġ t"]))
    write_gguf(tmp_path / "other-merges.gguf", meta, tensors)
    keys = {p.name: read_vocab_header(p).vocab_key for p in tmp_path.iterdir()}
    assert keys["renamed.gguf"] == read_vocab_header(target).vocab_key != keys["other-merges.gguf"]


def test_default_locations_follow_the_stores_environment(tmp_path):
    home = tmp_path / "home"
    paths = {(loc.path, loc.kind) for loc in default_locations({}, home)}
    assert paths == {(home / ".cache/huggingface/hub", "hf"), (home / ".ollama/models", "ollama"),
                     (home / ".lmstudio/models", "lmstudio"), (home / ".cache/lm-studio/models", "lmstudio"),
                     (home / "models", "dir")}
    env = {"HF_HOME": str(tmp_path / "hf"), "OLLAMA_MODELS": str(tmp_path / "oll")}
    kinds = {loc.kind: loc.path for loc in default_locations(env, home)}
    assert kinds["hf"] == tmp_path / "hf" / "hub" and kinds["ollama"] == tmp_path / "oll"
    assert default_locations({"HF_HUB_CACHE": "/x/hub", "HF_HOME": "/y"}, home)[0].path == Path("/x/hub")


def test_a_found_file_of_a_ranked_vocabulary_gets_its_ranking(tmp_path, target, monkeypatch):
    """A GGUF named by path whose vocabulary has a shipped frequency ranking (Qwen2.5's) drafts with the
    catalog draft's FR-Spec head and Q4_0 weights; other files, names and hostile files have none."""
    from verispec import weights
    from verispec.models.gguf_vocab import vocab_key_of

    path = model(tmp_path / "draft.gguf")
    assert weights.vocab_ranking(str(path), vocab_key_of) is None
    monkeypatch.setitem(weights.VOCAB_FREQ_BY_KEY, read_vocab_header(path).vocab_key, "vocab-freq-qwen2.5-coder.npy")
    assert weights.vocab_ranking(str(path), vocab_key_of) == "vocab-freq-qwen2.5-coder.npy"
    assert weights.vocab_ranking("qwen2.5-coder-0.5b-instruct") == "vocab-freq-qwen2.5-coder.npy"
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\xff" * 40)
    for name in ("self", "truncated:2", "shipped", str(tmp_path / "bad.gguf"), str(tmp_path / "missing.gguf")):
        assert weights.vocab_ranking(name, vocab_key_of) is None
    assert weights.vocab_ranking(str(path)) is None  # without a reader of files: catalog names only
    same = weights.frequent_tokens(str(path), 100, [0, 1], vocab_key_of)
    assert same.tolist() == weights.frequent_tokens("qwen2.5-coder-0.5b-instruct", 100, [0, 1]).tolist()


def test_the_walk_is_bounded(tmp_path, target, monkeypatch):
    """At most MAX_ENTRIES directory entries are looked at (a huge folder is not listed past them), at most
    MAX_DEPTH levels down, at most MAX_CANDIDATES headers read; each limit is said in one line."""
    from verispec.models import discovery

    store = tmp_path / "models"
    for i in range(30):
        (store / f"d{i:02d}").mkdir(parents=True)
    model(store / "zz" / "draft.gguf")
    monkeypatch.setattr(discovery, "MAX_ENTRIES", 10)
    said: list[str] = []
    assert search_draft(target, [Location(store)], said.append) is None
    assert said == [f"draft search: looked at 10 entries, the most it reads; the rest of {store} skipped"]

    monkeypatch.setattr(discovery, "MAX_ENTRIES", 20_000)
    deep = store / "zz" / "/".join(f"l{i}" for i in range(discovery.MAX_DEPTH)) / "deep.gguf"
    model(deep)
    assert search_draft(target, [Location(store)], lambda line: None).name == "zz/draft.gguf"
    (store / "zz" / "draft.gguf").unlink()
    assert search_draft(target, [Location(store)], lambda line: None) is None  # deep.gguf lies below the bound

    monkeypatch.setattr(discovery, "MAX_CANDIDATES", 1)
    model(store / "a.gguf", other_vocab=True, hidden=128)
    model(store / "b.gguf")
    said.clear()
    assert search_draft(target, [Location(store)], said.append) is None
    assert said == [f"draft search: read 1 GGUF headers, the most it reads; {store / 'b.gguf'} and after skipped"]


def test_many_bad_files_are_said_in_a_bounded_number_of_lines(tmp_path, target):
    from verispec.models.discovery import MAX_LINES

    for i in range(MAX_LINES + 15):
        (tmp_path / f"bad{i:02d}.gguf").write_text("no")
    said: list[str] = []
    assert search_draft(target, [Location(tmp_path)], said.append) is None
    assert len(said) == MAX_LINES + 1 and said[-1] == "draft search: 15 more files skipped (not said)"


def test_at_most_max_tries_candidates_are_offered_to_the_loader(tmp_path, target, monkeypatch):
    from verispec.models import discovery

    monkeypatch.setattr(discovery, "MAX_TRIES", 2)
    for name in ("a", "b", "c"):
        model(tmp_path / f"{name}.gguf")
    asked: list[str] = []
    said: list[str] = []
    found = search_draft(target, [Location(tmp_path)], said.append, accept=lambda d: asked.append(d.name) or False)
    assert found is None and asked == ["a.gguf", "b.gguf"]
    assert said == ["draft search: the loader refused 2 candidates, the most it tries"]
