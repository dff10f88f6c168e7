"""A pip user's first hour: the built wheel, installed in a fresh venv, run far from the checkout.

Builds the wheel (``pip wheel --no-deps --no-build-isolation``: the C++ objects of an earlier
build are reused), checks what it ships, installs it into a venv that borrows this
interpreter's site-packages for the dependencies (torch is not reinstalled), and runs the
public API, ``verispec info``, ``generate`` and ``bench --quick`` from a temporary directory
with a fresh model cache. Marker ``wheel``: ``make test-wheel`` (run by .ci/run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.wheel

REPO = Path(__file__).resolve().parents[2]
while not (REPO / "pyproject.toml").is_file():  # wherever the test splitter puts this file
    REPO = REPO.parent
GOLDEN_START = "Once upon a time, there was a little girl named Lily."


def sh(*args, cwd: Path, env: dict | None = None, timeout: int = 600) -> str:
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, args))}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", out, REPO, cwd=out,
       timeout=1200)
    (path,) = out.glob("verispec-*.whl")
    return path


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> tuple[Path, dict]:
    """(bin directory, environment) of a fresh venv holding the wheel; cwd-independent."""
    root = tmp_path_factory.mktemp("venv")
    sh(sys.executable, "-m", "venv", "--system-site-packages", root / "venv", cwd=root)
    bin_dir = root / "venv" / "bin"
    sh(bin_dir / "python", "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel, cwd=root)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VERISPEC_ISA", "PYTHONSTARTUP")}
    env |= {"VERISPEC_CACHE": str(root / "cache"), "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"}
    return bin_dir, env


def test_wheel_ships_data_and_runtime_not_tests(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for shipped in ("verispec/data/models/stories260K/stories260K.bin", "verispec/data/models/stories260K/tok512.bin",
                    "verispec/data/models/stories260K/LICENSE", "verispec/data/spec_bench/question.jsonl",
                    "verispec/data/spec_bench/LICENSE", "verispec/bench/data/agentic.jsonl"):
        assert shipped in names, shipped
    assert any(n.startswith("verispec/_vscpu") and n.endswith(".so") for n in names)
    assert any(n.startswith("verispec/weights/draft-smollm2-135m-instruct/") for n in names)
    assert not [n for n in names if n.startswith("tests/") or n.endswith(("conftest.py", "/helpers.py"))]


def test_installed_wheel_runs_far_from_the_checkout(venv, tmp_path):
    bin_dir, env = venv
    where = sh(bin_dir / "python", "-c", "from verispec import load_model, SpecDecoder, SamplingParams\n"
               "import verispec; print(verispec.__file__)", cwd=tmp_path, env=env).strip()
    assert Path(where).is_relative_to(bin_dir.parent) and not Path(where).is_relative_to(REPO), where

    report = json.loads(sh(bin_dir / "verispec", "info", "--json", cwd=tmp_path, env=env))
    assert report["compiled_runtime"]["built"] and report["compiled_runtime"]["isa"]
    assert Path(report["compiled_runtime"]["path"]).is_relative_to(bin_dir.parent)
    assert report["model_cache"]["path"] == env["VERISPEC_CACHE"]

    out = json.loads(sh(bin_dir / "verispec", "generate", "--model", "stories260k", "-n", "12", "--temperature", "0",
                        "--threads", "1", "--json", "", cwd=tmp_path, env=env))
    assert out["text"].startswith(GOLDEN_START[:20]) and out["stats"]["threads"] == 1

    # bench --quick's prompts (the shipped Spec-Bench questions) on the tiny model
    sh(bin_dir / "verispec", "bench", "--quick", "--model", "stories260k", "-n", "8", "--max-prompt-tokens", "96",
       "--output-dir", tmp_path / "bench", cwd=tmp_path, env=env)
    assert (tmp_path / "bench").is_dir() and any((tmp_path / "bench").iterdir())
