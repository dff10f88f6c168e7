"""CI's guard against a failed C++ build: with VERISPEC_REQUIRE_COMPILED=1 (``.ci/run``), a
compiled runtime that did not load fails the whole run (tests/conftest.py) instead of letting
the compiled-runtime tests (models/test_cpu.py, engine/test_prefix_cache.py, test_eagle_runner.py, ...)
skip quietly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
import pytest

pytestmark = pytest.mark.extended  # a longer check: out of make test, run by .ci/run (make test-extended)

TESTS = Path(__file__).resolve().parents[1]
# the runtime "not built": importlib's find_spec gives None for a module set to None in sys.modules
RUN = ("import sys, pytest; sys.modules['verispec._vscpu'] = None; "
       "sys.exit(pytest.main(['-q', '--collect-only', '-p', 'no:cacheprovider', '-o', 'addopts=', {target!r}]))")


def test_a_missing_compiled_runtime_fails_the_run_when_required():
    env = os.environ | {"VERISPEC_REQUIRE_COMPILED": "1"}
    code = RUN.format(target=str(TESTS / "unit" / "test_tree.py"))
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=TESTS.parent, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "VERISPEC_REQUIRE_COMPILED=1 but the compiled runtime is unavailable" in done.stdout + done.stderr
    assert "collected" not in done.stdout  # it stopped before collecting
