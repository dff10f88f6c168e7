"""Draft discovery (``--draft-search``): a draft model for the target among the GGUF files already on
the machine, in the usual local model stores, chosen by vocabulary and cost, never by name.

Where it looks (``default_locations``; ``--draft-search-path DIR`` replaces them): Hugging Face's hub
cache (``$HF_HUB_CACHE``, ``$HF_HOME/hub``, ``~/.cache/huggingface/hub``), Ollama's store
(``$OLLAMA_MODELS``, ``~/.ollama/models``: its ``blobs/sha256-*`` files, named by its ``manifests``),
LM Studio's folders (``~/.lmstudio/models``, ``~/.cache/lm-studio/models``) and ``~/models``.

What it reads. Directories are walked without following a linked directory; a linked file is
followed only when its target lies inside the same location (a Hugging Face snapshot's link to its
blob does; a link out of the location is skipped with one line). Candidates are files named
``*.gguf`` and Ollama blobs with GGUF's magic; at most ``MAX_ENTRIES`` directory entries, ``MAX_DEPTH``
levels and ``MAX_CANDIDATES`` headers are read in all, each header within its first
``gguf_vocab.MAX_HEADER_BYTES`` (``gguf_vocab.read_vocab_header``), an Ollama manifest within
``MAX_MANIFEST_BYTES``. Weights are never read here. A file that fails to parse is one line
(``say``) and is skipped; so is a file the loader refuses once chosen (``resolve_model``: its tensor
table, its architecture), and the next candidate is tried.

The rule (``choose``):

1. **Same vocabulary** (``VocabHeader.vocab_key`` equal to the target's: the same token ids mean the
   same texts), another file than the target, an architecture verispec runs, and a cost ratio
   ``c`` = its bytes / the target's bytes (a CPU decode step reads every weight once, so bytes are
   its cost) at most ``SAME_MAX_COST``: the **smallest** such file. With acceptance ``a`` unknown
   before a run, the expected speed-up of k-token drafts, (1 - a^(k+1)) / ((1 - a)(1 + ck))
   (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"), falls
   with ``c`` faster than a bigger draft of one family gains in ``a``: Qwen2.5's 0.5B (c = 0.44 of
   the 1.5B Q4_K_M) pays 1.4x-2.6x there (docs/benchmarks.md), and the hybrid then measures
   the draft's c(n) and tracks its acceptance, so a draft that does not pay is asked less.
2. Else, **another vocabulary** drafting through text (``drafters/cross_tokenizer.py``) where it has
   been measured to pay: c at most ``CROSS_MAX_COST`` (SmolLM2-135M, c = 0.09 of the Qwen2.5-Coder
   1.5B, paid 1.27x; Gemma-3-270M, c = 0.23, 1.02x: docs/benchmarks.md); the smallest.
3. Else nothing: ``auto`` runs what it runs without a draft.

    found = search_draft(target_path, default_locations(), say=print)  # FoundDraft | None
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from verispec.models.architectures import ARCHITECTURES
from verispec.models.base import ModelError, one_line
from verispec.models.gguf_vocab import VocabError, VocabHeader, is_gguf, read_vocab_header

SAME_MAX_COST = 0.5  # a same-vocabulary draft at most half the target's bytes
CROSS_MAX_COST = 0.15  # drafting through text paid at c = 0.09, not at 0.23 (module docstring)
MAX_ENTRIES = 20_000  # directory entries looked at, all locations together
MAX_DEPTH = 8  # directory levels below a location (HF: models--o--n/snapshots/<rev>/<dir>/file.gguf)
MAX_CANDIDATES = 256  # GGUF headers read at most
MAX_TRIES = 8  # candidates the loader is asked to take (each a full header parse) at most
MAX_LINES = 20  # lines about skipped files said at most; then one counting the rest
MAX_MANIFEST_BYTES = 1 << 16  # an Ollama manifest (a few hundred bytes of JSON)
_OLLAMA_MODEL = "application/vnd.ollama.image.model"

Say = Callable[[str], None]


@dataclass(frozen=True)
class Location:
    """A folder to search and what lays it out (``hf``, ``ollama``, ``lmstudio`` or ``dir``)."""

    path: Path
    kind: str = "dir"


@dataclass(frozen=True)
class FoundDraft:
    """The draft discovery chose for a target."""

    path: Path  # the file to load (inside its location)
    name: str  # how its store names it: an HF repo and file, an Ollama model:tag, a path in a folder
    store: str  # the location's kind
    cost: float  # its bytes over the target's
    same_vocab: bool  # False: another tokenizer, drafting through text


def default_locations(env: Mapping[str, str] | None = None, home: Path | None = None) -> list[Location]:
    """The usual local model stores (whether or not they exist)."""
    env = os.environ if env is None else env
    home = Path(env.get("HOME") or Path.home()) if home is None else home
    hf = env.get("HF_HUB_CACHE") or (str(Path(env["HF_HOME"]) / "hub") if env.get("HF_HOME") else None)
    ollama = env.get("OLLAMA_MODELS")
    out = [Location(Path(hf) if hf else home / ".cache" / "huggingface" / "hub", "hf"),
           Location(Path(ollama) if ollama else home / ".ollama" / "models", "ollama"),
           Location(home / ".lmstudio" / "models", "lmstudio"),
           Location(home / ".cache" / "lm-studio" / "models", "lmstudio"),
           Location(home / "models", "dir")]
    return list({loc.path: loc for loc in out}.values())


def locations_from_paths(paths: Iterable[str | Path]) -> list[Location]:
    """User-named folders (``--draft-search-path``), each laid out as its contents say."""
    out = []
    for p in paths:
        path = Path(p).expanduser()
        kind = ("ollama" if (path / "blobs").is_dir() and (path / "manifests").is_dir()
                else "hf" if any(path.glob("models--*")) else "dir")
        out.append(Location(path, kind))
    return out


@dataclass
class _Budget:
    entries: int = field(default_factory=lambda: MAX_ENTRIES)
    headers: int = field(default_factory=lambda: MAX_CANDIDATES)


def scan(locations: Iterable[Location], say: Say, skip: Iterable[Path] = ()) -> list[tuple[VocabHeader, Location, str]]:
    """(header, location, name) of every readable GGUF model file in ``locations`` (each file once,
    however many names or links it has; ``skip``: files left out, e.g. the target)."""
    seen = {_file_id(p) for p in skip}
    budget, out = _Budget(), []
    for loc in locations:
        root = os.path.realpath(loc.path)
        if not os.path.isdir(root):
            continue
        names = _ollama_names(Path(root), say) if loc.kind == "ollama" else {}
        for path, real in _files(Path(root), loc, budget, say):
            key = _file_id(real)
            if key in seen:
                continue
            seen.add(key)
            if budget.headers <= 0:
                say(f"draft search: read {MAX_CANDIDATES} GGUF headers, the most it reads; {path} and after skipped")
                return out
            budget.headers -= 1
            try:
                head = replace(read_vocab_header(Path(real)), path=path)  # loaded as found: an HF link keeps its name
            except VocabError as e:
                say(f"draft search: skipped {path}: {e.reason}")
                continue
            if head.vocab_key:  # a file with no vocabulary (a LoRA adapter, a projector) is no draft
                out.append((head, loc, names.get(Path(real).name) or _name(path, Path(root), loc)))
    return out


def _file_id(path: str | Path) -> tuple[int, int] | str:
    """One file's identity across hard and symbolic links: (device, inode)."""
    try:
        st = os.stat(path)
    except OSError:
        return str(path)
    return st.st_dev, st.st_ino


def _files(root: Path, loc: Location, budget: _Budget, say: Say) -> Iterator[tuple[Path, str]]:
    """(path as found, real path) of candidate files under ``root``, depth-first, within the budget."""
    stack: list[tuple[Path, int]] = [(root, 0)]
    while stack:
        folder, depth = stack.pop()
        try:
            with os.scandir(folder) as it:  # no more of a huge directory is listed than the budget allows
                entries = sorted(itertools.islice(it, max(budget.entries, 0) + 1), key=lambda e: e.name)
        except OSError as e:
            say(f"draft search: cannot list {folder} ({e.strerror or e})")
            continue
        dirs = []
        for entry in entries:
            if budget.entries <= 0:
                say(f"draft search: looked at {MAX_ENTRIES:,} entries, the most it reads; the rest of {root} skipped")
                return
            budget.entries -= 1
            try:
                if entry.is_dir(follow_symlinks=False):
                    if depth + 1 <= MAX_DEPTH:
                        dirs.append((Path(entry.path), depth + 1))
                    continue
                blob = loc.kind == "ollama" and folder.name == "blobs" and entry.name.startswith("sha256")
                if not (entry.name.lower().endswith(".gguf") or blob):
                    continue
                real = os.path.realpath(entry.path)
                if os.path.commonpath([real, str(root)]) != str(root):
                    say(f"draft search: skipped {entry.path}: a link out of {root}")
                    continue
                if not os.path.isfile(real):
                    say(f"draft search: skipped {entry.path}: not a regular file")
                    continue
                if blob and not is_gguf(Path(real)):  # Ollama's other layers: templates, licenses, parameters
                    continue
            except (OSError, ValueError) as e:
                say(f"draft search: skipped {entry.path} ({one_line(e)})")
                continue
            yield Path(entry.path), real
        stack.extend(reversed(dirs))


def _name(path: Path, root: Path, loc: Location) -> str:
    """An HF cache file as ``org/repo/file``; elsewhere its path inside the location."""
    rel = path.relative_to(root).parts if path.is_relative_to(root) else (path.name,)
    if loc.kind == "hf" and rel and rel[0].startswith("models--") and len(rel) >= 4 and rel[1] == "snapshots":
        return "/".join([rel[0].removeprefix("models--").replace("--", "/"), *rel[3:]])
    return "/".join(rel)


def _ollama_names(root: Path, say: Say) -> dict[str, str]:
    """Blob file name -> ``model:tag`` from Ollama's manifests (manifests/<host>/<ns>/<model>/<tag>)."""
    names: dict[str, str] = {}
    base = root / "manifests"
    if not base.is_dir():
        return names
    budget = _Budget(entries=MAX_ENTRIES // 4)
    for path, real in _manifests(base, budget, say):
        try:
            with open(real, "rb") as f:
                data = json.loads(f.read(MAX_MANIFEST_BYTES + 1)[:MAX_MANIFEST_BYTES])
            layers = data.get("layers", []) if isinstance(data, dict) else []
            rel = path.relative_to(base).parts
            label = f"{'/'.join(rel[-3:-1]).removeprefix('library/')}:{rel[-1]}"
            for layer in layers:
                if isinstance(layer, dict) and layer.get("mediaType") == _OLLAMA_MODEL:
                    names.setdefault(str(layer.get("digest", "")).replace(":", "-", 1), label)
        except (OSError, ValueError, AttributeError) as e:
            say(f"draft search: skipped Ollama manifest {path} ({one_line(e)})")
    return names


def _manifests(base: Path, budget: _Budget, say: Say) -> Iterator[tuple[Path, str]]:
    stack = [(base, 0)]
    while stack:
        folder, depth = stack.pop()
        try:
            with os.scandir(folder) as it:
                entries = sorted(itertools.islice(it, max(budget.entries, 0) + 1), key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries:
            budget.entries -= 1
            if budget.entries <= 0:
                return
            if entry.is_dir(follow_symlinks=False):
                if depth < 4:
                    stack.append((Path(entry.path), depth + 1))
            elif entry.is_file(follow_symlinks=False):
                yield Path(entry.path), entry.path


def choose(target: VocabHeader, found: Iterable[tuple[VocabHeader, Location, str]]) -> list[FoundDraft]:
    """The candidates the rule admits, best first (the module docstring): same vocabulary, then
    another vocabulary where drafting through text pays; within each, smallest first."""
    same, other = [], []
    for head, loc, name in found:
        if head.architecture not in ARCHITECTURES or not head.size or not target.size:
            continue
        cost = head.size / target.size
        if head.vocab_key == target.vocab_key and cost <= SAME_MAX_COST:
            same.append(FoundDraft(head.path, name, loc.kind, cost, True))
        elif head.vocab_key != target.vocab_key and cost <= CROSS_MAX_COST:
            other.append(FoundDraft(head.path, name, loc.kind, cost, False))
    def order(d: FoundDraft) -> tuple:
        return d.cost, str(d.path)

    return sorted(same, key=order) + sorted(other, key=order)


def search_draft(target_path: Path, locations: Iterable[Location], say: Say,
                 accept: Callable[[FoundDraft], bool] | None = None, same_vocab_only: bool = False) -> FoundDraft | None:
    """The draft the rule picks for the GGUF target at ``target_path``, or None. ``accept`` (default:
    the loader resolves it) may still refuse a candidate, which is said in one line; the next is tried, up to
    ``MAX_TRIES`` of them."""
    locations = list(locations)
    target = read_vocab_header(Path(target_path))
    said = _Capped(say)
    try:
        ranked = [d for d in choose(target, scan(locations, said, skip=[target_path])) if d.same_vocab or not same_vocab_only]
        for tries, draft in enumerate(ranked):
            if tries == MAX_TRIES:
                said(f"draft search: the loader refused {MAX_TRIES} candidates, the most it tries")
                return None
            if accept is None or accept(draft):
                return draft
        return None
    finally:
        said.close()


class _Capped:
    """``say`` for at most ``MAX_LINES`` lines, then one line counting the rest (a store of many bad files)."""

    def __init__(self, say: Say):
        self.say, self.count = say, 0

    def __call__(self, line: str) -> None:
        self.count += 1
        if self.count <= MAX_LINES:
            self.say(line)

    def close(self) -> None:
        if self.count > MAX_LINES:
            self.say(f"draft search: {self.count - MAX_LINES} more files skipped (not said)")


def loadable(draft: FoundDraft, say: Say) -> bool:
    """Whether the loader takes the file (its whole header, tensor table and config checked; no weight read)."""
    from verispec.models.resolve import resolve_model

    try:
        resolve_model(str(draft.path))
    except (ModelError, ValueError) as e:
        say(f"draft search: skipped {draft.name}: {one_line(e)}")
        return False
    return True


def found_line(target_name: str, draft: FoundDraft | None, locations: Iterable[Location]) -> str:
    """The one line that says what discovery chose."""
    if draft is None:
        where = ", ".join(str(loc.path) for loc in locations) or "no location"
        return (f"draft search: no GGUF in {where} drafts for {target_name} (same vocabulary at most "
                f"{SAME_MAX_COST:g}x its size, or another at most {CROSS_MAX_COST:g}x); auto runs without one")
    how = "same vocabulary" if draft.same_vocab else "another vocabulary: drafting through text"
    return (f"draft search: drafting {target_name} with {draft.name} from {draft.store} ({draft.path}; "
            f"{draft.cost:.2f}x its size, {how})")


def with_found_draft(model, locations: Iterable[Location], say: Say, batched: bool = False):
    """``model`` (a ``LoadedModel``) with the draft discovery finds for it (``found_draft``), the choice
    said in one line; unchanged where there is nothing to compare (not a GGUF), where ``auto`` already
    has the target's catalog draft, or off the compiled runtime. ``batched`` (the server): only a draft
    of the same vocabulary (drafting through text is not batched)."""
    from .catalog import catalog_draft

    locations = list(locations)
    if catalog_draft(model):
        say(f"draft search: not needed, {model.name} has its catalog draft {catalog_draft(model)}")
        return model
    if model.source.kind != "gguf" or model.backend_kind != "cpu":
        why = "is not a GGUF file" if model.source.kind != "gguf" else f"runs on the {model.backend_kind} backend"
        say(f"draft search: not searched, {model.name} {why} (auto runs a found draft for a GGUF on the compiled "
            "runtime, backend cpu)")
        return model
    draft = search_draft(model.source.path, locations, say, accept=lambda d: loadable(d, say), same_vocab_only=batched)
    say(found_line(model.name, draft, locations))
    return replace(model, found_draft=draft)
