"""The model cache (``$VERISPEC_CACHE``, else ``~/.cache/verispec``): what verispec builds once and
keeps (converted checkpoints, GGUF tokenizers, distilled drafts, assembled catalog files).

The cache is input like any file: a full disk, a killed process or a careless edit can leave a
damaged entry, and ``VERISPEC_CACHE`` can name anything. So:

* an entry is a directory built in a temporary directory beside it (``.<name>.tmp-*``) and renamed
  into place when complete; its last file is a manifest (``verispec-entry.json``: every file's size,
  and sha256 up to ``HASHED_BYTES``), checked whenever the entry is read. An entry whose manifest
  is missing or does not match (truncated, edited, written by an older verispec) is replaced, with
  a one-line warning; one that cannot be moved away is a one-line ``ModelError`` naming it;
* a temporary file or directory is held under an ``flock`` by the process writing it, so the next
  build removes the temporaries of killed processes (unlocked) and never one still being written;
* a cache that cannot be written (a regular file, a path under /proc, a symlink loop, no
  permission, a NUL byte) costs a one-line warning: the entry is built in a directory of this
  process, removed at exit (``scratch_dir``).
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import glob
import hashlib
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from verispec.models.base import ModelError

MANIFEST = "verispec-entry.json"
HASHED_BYTES = 64 << 20  # files up to this size are hashed on every read (a tokenizer, a tiny model): ~ms


def default_cache_dir() -> Path:
    """``$VERISPEC_CACHE`` if set and not empty, else ``~/.cache/verispec``."""
    return Path(os.environ.get("VERISPEC_CACHE") or Path.home() / ".cache" / "verispec").expanduser()


def warn(message: str) -> None:
    """One line on stderr (the CLI prints RuntimeWarnings as ``warning: ...``)."""
    warnings.warn(message.replace("\0", "\\0"), RuntimeWarning, stacklevel=3)  # a NUL byte shown, not written


def reason(err: BaseException) -> str:
    """An OSError's or ValueError's text without a traceback's worth of detail."""
    return (err.strerror if isinstance(err, OSError) else None) or str(err).strip().split("\n")[0]


# --------------------------------------------------------------------------- checking entries


def entry_damage(entry: Path) -> str | None:
    """Why the directory ``entry`` cannot be used (a few words), or None when every file its
    manifest lists is there with its size (and sha256, or a sound safetensors header)."""
    try:
        record = json.loads((entry / MANIFEST).read_text(encoding="utf-8"))
        files = {name: (size, sha) for name, size, sha in record["files"]}
    except FileNotFoundError:
        return f"no {MANIFEST}: incomplete, or written by an older verispec"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"unreadable {MANIFEST} ({reason(err)})"
    for name, (size, sha) in files.items():
        if not isinstance(name, str) or Path(name).name != name or not isinstance(size, int):
            return f"malformed {MANIFEST}"
        path = entry / name
        try:
            actual = path.stat().st_size
            if actual != size:
                return f"{name} has {actual:,} bytes, expected {size:,}"
            if sha is not None and _sha256(path) != sha:
                return f"{name} differs from what was written (sha256)"
            if sha is None and name.endswith(".safetensors") and not _sound_safetensors(path, size):
                return f"{name} has a malformed header"
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as err:
            return f"{name}: {reason(err)}"
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _sound_safetensors(path: Path, size: int) -> bool:
    """Does the header parse and end its last tensor at the end of the file? (A file too large
    to hash on every read: garbage or a shifted tail fails this.)"""
    with path.open("rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 2 <= n <= size - 8:
            return False
        try:
            header = json.loads(f.read(n))
            end = max((t["data_offsets"][1] for key, t in header.items() if key != "__metadata__"), default=0)
            return 8 + n + end == size
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return False


def write_manifest(tmp: Path) -> None:
    """Record every file in the (complete) directory ``tmp``: the last file written."""
    files = []
    for path in sorted(p for p in tmp.iterdir() if p.name != MANIFEST):
        size = path.stat().st_size
        files.append([path.name, size, _sha256(path) if size <= HASHED_BYTES else None])
    (tmp / MANIFEST).write_text(json.dumps({"files": files}, indent=1) + "\n", encoding="utf-8")


def discard(entry: Path, why: str) -> None:
    """Move a damaged entry out of the way (renamed to a temporary name, then removed), with a
    one-line warning; a ModelError naming the directory to delete when it cannot be moved."""
    warn(f"cache entry {entry} is damaged ({why}): replacing it")
    aside = entry.with_name(f".{entry.name}.tmp-damaged-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        os.rename(entry, aside)
    except OSError as err:
        if isinstance(err, FileNotFoundError) and not os.path.lexists(entry):
            return  # another process moved it first
        raise ModelError(f"cache entry {entry} is damaged ({why}) and cannot be replaced ({reason(err)}): "
                         f"delete the directory {entry}") from None
    remove(aside)


def sound_entry(entry: Path) -> bool:
    """Is there a sound entry at ``entry``? A damaged one is discarded (``discard``)."""
    if not os.path.lexists(entry):
        return False
    why = entry_damage(entry) if entry.is_dir() else "not a directory"
    if why is None:
        return True
    discard(entry, why)
    return False


def remove(path: Path) -> None:
    """Remove a file, symlink or directory tree, whatever is there (errors ignored)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


# --------------------------------------------------------------------------- writing entries


def write_entry(final: Path, build: Callable[[Path], None]) -> Path:
    """``final``, built by ``build(tmp)`` into a locked temporary directory beside it and renamed
    into place, unless a sound entry is already there. Raises OSError when the cache cannot be
    written (not a directory, no permission, a full disk): the caller degrades."""
    if sound_entry(final):
        return final
    make_dir(final.parent)
    remove_stale_temps(final)
    with locked_temp(final, directory=True) as tmp:
        build(tmp)
        write_manifest(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it 0700; a cache entry is read by whoever loads the model
        _publish(tmp, final)
    return final


def make_dir(path: Path) -> None:
    """``mkdir -p path``; the OSError of a path that cannot be a directory says why in words."""
    if "\0" in str(path):
        raise OSError(errno.EINVAL, "the path holds a NUL byte")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        loop = os.path.lexists(path) and not path.exists()
        raise OSError(errno.ENOTDIR, "a symlink that does not resolve" if loop else "not a directory") from None


def cached_dir(final: Path, build: Callable[[Path], None], what: str) -> Path:
    """``write_entry``, degrading to a directory of this process (with a one-line warning) when
    the cache cannot be written: the command works, the next one builds again."""
    try:
        return write_entry(final, build)
    except OSError as err:
        warn(f"cannot write the model cache {final.parent} ({reason(err)}): {what} is built in a temporary "
             "directory, not kept (set VERISPEC_CACHE to a writable directory)")
    out = scratch_dir() / final.name
    if not out.is_dir():
        tmp = out.with_name(out.name + ".tmp")
        try:
            remove(tmp)  # an earlier failed try of this process
            tmp.mkdir()
            build(tmp)
            os.rename(tmp, out)
        except OSError as err:
            raise ModelError(f"cannot build {what} in {out.parent} either ({reason(err)}): free some space "
                             "or set VERISPEC_CACHE to a writable directory") from None
    return out


def _publish(tmp: Path, final: Path) -> None:
    """Rename the complete ``tmp`` to ``final``. A sound entry there (a concurrent build that
    finished first) is kept and ours dropped; a damaged one is moved away and the rename retried."""
    for _ in range(3):
        try:
            os.rename(tmp, final)
            return
        except OSError as err:
            if err.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                raise
        if sound_entry(final):
            return
    raise ModelError(f"cache entry {final} keeps being replaced by damaged copies: delete the directory {final}")


_scratch: list[Path] = []


def scratch_dir() -> Path:
    """A directory of this process for what the cache cannot hold, removed at exit."""
    if not _scratch:
        try:
            _scratch.append(Path(tempfile.mkdtemp(prefix="verispec-cache-")))
        except OSError as err:
            raise ModelError(f"no writable directory for the model cache ({reason(err)}): set VERISPEC_CACHE "
                             "to a writable directory") from None
        atexit.register(shutil.rmtree, _scratch[0], ignore_errors=True)
    return _scratch[0]


# --------------------------------------------------------------------------- temporaries


@contextmanager
def locked_temp(final: Path, directory: bool = False) -> Iterator[Path]:
    """A new temporary file (or directory) ``.<final name>.tmp-*`` beside ``final``, under an
    exclusive flock while it exists, removed at the end unless renamed. ``remove_stale_temps``
    of another process removes it only after this process has gone (a killed build)."""
    while True:
        if directory:
            path = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
            fd = os.open(path, os.O_RDONLY)
        else:
            fd, name = tempfile.mkstemp(prefix=f".{final.name}.tmp-", dir=final.parent)
            path = Path(name)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # blocks only while a sweep holds it (and removes it)
        except OSError:  # a file system without flock: nothing is swept there either
            pass
        if os.fstat(fd).st_nlink > 0:
            break
        os.close(fd)  # a sweep found it before we locked it and removed it: take another
    try:
        yield path
    finally:
        remove(path)
        os.close(fd)


def remove_stale_temps(final: Path) -> list[Path]:
    """Remove the temporaries ``.<final name>.tmp-*`` beside ``final`` that no live process holds
    (left by a killed or crashed build); returns what was removed."""
    removed = []
    for path in map(Path, glob.glob(glob.escape(str(final.parent / f".{final.name}.tmp-")) + "*")):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: a build in progress
            os.close(fd)
            continue
        try:
            remove(path)
            removed.append(path)
        finally:
            os.close(fd)
    return removed


def write_cache_file(path: Path, text: str) -> None:
    """Write a small cache file atomically (a locked temporary beside it, then ``os.replace``);
    an unwritable cache costs a warning, nothing else (the value is only not kept)."""
    try:
        make_dir(path.parent)
        remove_stale_temps(path)
        with locked_temp(path) as tmp:
            tmp.write_text(text, encoding="utf-8")
            tmp.chmod(0o644)
            os.replace(tmp, path)
    except OSError as err:
        warn(f"cannot write {path} ({reason(err)}): not cached")
