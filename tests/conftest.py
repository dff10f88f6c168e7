"""Shared fixtures. Tests pin torch to 2 threads (CI machines have 2 cores)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from verispec.models.hf import HFCausalLM

torch.set_num_threads(2)


def pytest_sessionstart(session):
    """With VERISPEC_REQUIRE_COMPILED=1 (CI), a compiled runtime that failed to build or load
    fails the run instead of letting its tests skip."""
    import os

    if os.environ.get("VERISPEC_REQUIRE_COMPILED") == "1":
        from verispec.models import cpu

        try:
            cpu.library()
        except OSError as err:
            pytest.exit(f"VERISPEC_REQUIRE_COMPILED=1 but the compiled runtime is unavailable: {err}", returncode=1)


def tiny_llama(seed: int, vocab: int = 96, layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # sharper logits than the default init: fewer near-ties
        model.lm_head.weight.mul_(20)
    return model.eval()


@pytest.fixture(scope="session")
def toy_target() -> HFCausalLM:
    return HFCausalLM(tiny_llama(0), "toy-target")


@pytest.fixture(scope="session")
def toy_draft() -> HFCausalLM:
    return HFCausalLM(tiny_llama(1), "toy-draft")


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
