"""The real Gemma 3 270M (base, Q4_K_M: Q5_0/Q8_0/Q4_K/Q6_K) on the compiled runtime: its
SentencePiece tokenizer gives llama.cpp's ids on a multilingual set, its greedy choices follow
llama.cpp's recorded continuations but for quantization near-ties, and chains (past its
512-token sliding window), trees and batches are bitwise one-at-a-time decoding.

Gemma's terms of use: the model is installed on demand (catalog ``gemma-3-270m``, four pip
parts), never shipped; without the parts this module skips, naming the command. The golden
file (tests/data/gemma_llamacpp_golden.json) says how it was recorded."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest
import torch

from tiny_models import assert_batch_bitwise, assert_chain_bitwise, assert_tree_bitwise
from verispec.api import SpecDecoder, load_model
from verispec.models.catalog import CATALOG
from verispec.types import SamplingParams

NAME = "gemma-3-270m"
try:
    for _dist in CATALOG[NAME].location.distributions():
        importlib.metadata.distribution(_dist)
except importlib.metadata.PackageNotFoundError:
    pytest.skip(f"Gemma 3 270M is installed on demand: {CATALOG[NAME].location.install}", allow_module_level=True)

GOLDEN = json.loads((Path(__file__).resolve().parents[1] / "data" / "gemma_llamacpp_golden.json").read_text())
VOCAB = 262144
# logits (a scale of ~20): llama.cpp rounds GELU's input to fp16 (its lookup table) and quantizes
# activations per 256 (Q8_K) where we use int8 per 32. Recorded: 9 differences in 384 tokens, gaps
# 0.03 to 0.18 and one of 0.42 (our third choice). Transformers in fp32 on the dequantized weights,
# teacher-forced on four of the prompts, picks our token at 189 of 192 positions and llama.cpp's at
# 187 (the 0.42 case: ours)
QUANT_TIE = 0.5


@pytest.fixture(scope="module")
def gemma():
    return load_model(NAME)


def test_loads_from_its_own_blocks(gemma):
    assert gemma.backend_kind == "cpu"
    assert gemma.backend.quant == "q4_k+q5_0+q6_k+q8_0"
    assert gemma.backend.info.vocab_size == VOCAB


def test_tokenizer_ids_are_llama_cpps(gemma):
    """BOS added as the file asks (add_bos_token), SentencePiece pieces on 20 scripts and edge cases."""
    cases = GOLDEN["tokenizer"]
    assert len(cases) >= 20
    for text, ids in cases.items():
        assert gemma.tokenizer.encode(text) == ids, text


def test_greedy_follows_llama_cpp(gemma):
    """Teacher-forced on llama.cpp's greedy continuations (48 tokens each): our greedy choice is
    llama.cpp's token but at a few near-ties, where llama.cpp's token is among our first three and
    within QUANT_TIE of our first."""
    for case in GOLDEN["greedy"]:
        prompt, gold = gemma.tokenizer.encode(case["prompt"]), case["ids"]
        seq = prompt + gold
        logits = gemma.backend.forward(torch.tensor([seq]), torch.arange(len(seq))[None],
                                       gemma.backend.new_cache(len(seq) + 1)).logits[0, len(prompt) - 1:-1]
        differ = [i for i, g in enumerate(gold) if int(logits[i].argmax()) != g]
        assert len(differ) <= 3, f"{case['prompt']!r}: {len(differ)} of {len(gold)} tokens differ"
        for i in differ:
            gap = float(logits[i].max() - logits[i, gold[i]])
            assert gold[i] in logits[i].topk(3).indices.tolist() and gap < QUANT_TIE, f"{case['prompt']!r} token {i}"


def test_chain_tree_batch_bitwise(gemma):
    """Past the sliding window too: a chain at 600, where 15 of the 18 layers see only the last 512 keys."""
    model = gemma.backend
    assert_chain_bitwise(model, VOCAB, prefix_len=12, k=6)
    assert_chain_bitwise(model, VOCAB, prefix_len=600, k=4)
    assert_tree_bitwise(model, VOCAB, prefix_len=60)
    assert_batch_bitwise(model, VOCAB)


def test_speculative_greedy_equals_plain(gemma):
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    prompt = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"
    plain = SpecDecoder(gemma, "none").generate(prompt, params, chat=False)
    spec = SpecDecoder(gemma, "prompt-lookup").generate(prompt, params, chat=False)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.accepted > 0
