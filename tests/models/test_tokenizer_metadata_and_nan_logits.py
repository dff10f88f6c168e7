"""Hostile input, round 3 (issue 32): malformed tokenizer metadata in a GGUF (class 6) and weights
that make NaN or infinite logits (class 4, at run time).

Tokenizer metadata: each malformed value is one ModelError naming its key, through the library,
the config (``open_gguf``) and the CLI, and leaves no tokenizer cache entry. Logits: NaN, +inf or
a row with no finite value where a token is chosen is ``NonFiniteLogits`` (one line, exit 2 in
the CLI; a 500 / an error event in the server), never a traceback or token 0 forever; -inf alone
(a reduced head, a mask) is legitimate, and a drafter's own NaN only loses its drafts.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from gguf_fixtures import ARRAY, BOOL, FLOAT32, INT32, STRING, UINT32, UINT64, byte_level_vocab, tiny_qwen2, write_gguf
from serving import one_line_exit_2, running_server, stories_native_model

from verispec.api import load_model
from verispec.drafters.base import NoDrafter
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.engine.engine import Engine
from verispec.models.base import BackendCaps, ModelError, ModelOutput, NonFiniteLogits
from verispec.models.gguf_file import read_gguf
from verispec.models.gguf_tokenizer import gguf_tokenizer
from verispec.models.gguf_config import open_gguf
from verispec.sampling import check_logits
from verispec.tree import DraftTree
from verispec.types import SamplingParams
from verispec.verify.rejection import accept_rejection

NAN, INF = float("nan"), float("inf")
TOKENS, TYPES, MERGES = byte_level_vocab()  # 262 tokens
NON_FINITE = "NaN or infinite logits"


def gguf_with(path: Path, **changes: tuple[int, object]) -> Path:
    """The tiny qwen2 GGUF with metadata keys changed (``tokenizer__ggml__bos_token_id`` names
    ``tokenizer.ggml.bos_token_id``)."""
    meta, tensors = tiny_qwen2()
    meta |= {key.replace("__", "."): value for key, value in changes.items()}
    write_gguf(path, meta, tensors)
    return path


# ------------------------------------------------------------------ class 6: tokenizer metadata

SPECIAL = {  # key suffix -> malformed values (GGUF type, value); in range: [0, 262)
    "bos_token_id": [(UINT32, 262), (UINT64, 2**40), (INT32, -1)],
    "eos_token_id": [(UINT32, 10**6), (INT32, -2), (STRING, "abc"), (STRING, "2"), (FLOAT32, 2.0)],
    "padding_token_id": [(UINT32, 999), (BOOL, True)],
    "unknown_token_id": [(INT32, -5), (UINT32, 262)],
}
SCALAR_CASES = [(f"tokenizer.ggml.{k}", v) for k, values in SPECIAL.items() for v in values] + [
    ("tokenizer.ggml.model", (UINT32, 5)),
    ("tokenizer.ggml.pre", (ARRAY, (STRING, ["qwen2"]))),
    ("tokenizer.ggml.add_bos_token", (STRING, "false")),
    ("tokenizer.ggml.add_bos_token", (UINT32, 1)),
    ("tokenizer.chat_template", (UINT32, 7)),
    ("tokenizer.chat_template", (ARRAY, (STRING, ["{{ x }}"]))),
    ("tokenizer.ggml.token_type", (ARRAY, (INT32, TYPES[:10]))),
    ("tokenizer.ggml.token_type", (ARRAY, (INT32, TYPES + [1]))),
    ("tokenizer.ggml.token_type", (STRING, "control")),
]
ARRAY_CASES = [  # malformed only in an array's items: found when the tokenizer is built
    ("tokenizer.ggml.merges", (ARRAY, (STRING, ["Ġ t", "h e", "x yz"]))),  # a side not in the vocabulary
    ("tokenizer.ggml.merges", (ARRAY, (STRING, ["Ġ t", "a b"]))),  # "ab" is not a token (a Rust panic before)
    ("tokenizer.ggml.merges", (ARRAY, (UINT32, [1, 2]))),
    ("tokenizer.ggml.merges", (ARRAY, (ARRAY, [(STRING, ["h e"])]))),
    ("tokenizer.ggml.merges", (UINT32, 3)),
    ("tokenizer.ggml.tokens", (ARRAY, (UINT32, list(range(len(TOKENS)))))),
    ("tokenizer.ggml.tokens", (ARRAY, (ARRAY, [(STRING, [t]) for t in TOKENS]))),
    ("tokenizer.ggml.token_type", (ARRAY, (STRING, [str(t) for t in TYPES]))),
    ("tokenizer.ggml.token_type", (ARRAY, (FLOAT32, [float(t) for t in TYPES]))),
]


def assert_one_line_naming(err: pytest.ExceptionInfo, key: str) -> None:
    text = str(err.value)
    assert key in text and "\n" not in text, text


@pytest.mark.parametrize("key,value", SCALAR_CASES + ARRAY_CASES, ids=lambda v: str(v)[:40])
def test_malformed_tokenizer_metadata_is_one_model_error_naming_the_key(tmp_path: Path, key: str, value) -> None:
    """gguf_tokenizer refuses the file in one line naming the key, and caches nothing for it."""
    path = gguf_with(tmp_path / "bad.gguf", **{key.replace(".", "__"): value})
    cache = tmp_path / "cache"
    with pytest.raises(ModelError) as err:
        gguf_tokenizer(read_gguf(path, tensors=False), cache)
    assert_one_line_naming(err, key)
    assert not (cache / "tokenizers").exists() or not any((cache / "tokenizers").iterdir())


@pytest.mark.parametrize("key,value", SCALAR_CASES, ids=lambda v: str(v)[:40])
def test_malformed_tokenizer_scalars_fail_the_config_too(tmp_path: Path, key: str, value) -> None:
    """open_gguf (the config's EOS / BOS / padding ids, the EOS list) checks them before use."""
    path = gguf_with(tmp_path / "bad.gguf", **{key.replace(".", "__"): value})
    with pytest.raises(ModelError) as err:
        open_gguf(path)
    assert_one_line_naming(err, key)


@pytest.mark.parametrize("value", [(ARRAY, (UINT32, list(range(len(TOKENS))))), (STRING, "abc"),
                                   (ARRAY, (ARRAY, [(STRING, [t]) for t in TOKENS]))], ids=["ints", "string", "nested"])
def test_tokens_of_the_wrong_type_fail_open_gguf_in_one_line(tmp_path: Path, value) -> None:
    """The EOS look-up walks the token texts without decoding the vocabulary: a non-string
    array was a UnicodeDecodeError there."""
    path = gguf_with(tmp_path / "bad.gguf", tokenizer__ggml__tokens=value)
    with pytest.raises(ModelError) as err:
        open_gguf(path)
    assert_one_line_naming(err, "tokenizer.ggml.tokens")


@pytest.mark.parametrize("key,value,needle", [
    ("tokenizer.ggml.bos_token_id", (UINT32, 5000), "tokenizer.ggml.bos_token_id"),
    ("tokenizer.ggml.eos_token_id", (STRING, "abc"), "tokenizer.ggml.eos_token_id"),
    ("tokenizer.ggml.merges", (ARRAY, (STRING, ["Ġ t", "q z"])), "tokenizer.ggml.merges"),
    ("tokenizer.ggml.tokens", (ARRAY, (UINT32, list(range(len(TOKENS))))), "tokenizer.ggml.tokens"),
    ("tokenizer.ggml.model", (STRING, "bert"), "cannot build a tokenizer"),  # transformers' conversion, wrapped
])
def test_cli_malformed_tokenizer_is_one_line_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    key: str, value, needle: str) -> None:
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    path = gguf_with(tmp_path / "bad.gguf", **{key.replace(".", "__"): value})
    one_line_exit_2("generate", "--model", str(path), "-n", "2", "hello", needle=needle)
    assert not any((tmp_path / "cache" / "tokenizers").glob("*/tokenizer.json"))


def test_valid_special_tokens_and_flags_still_load(tmp_path: Path) -> None:
    """In-range ids of every kind, add_bos_token true: the tokenizer adds BOS and names each token."""
    path = gguf_with(tmp_path / "ok.gguf", tokenizer__ggml__padding_token_id=(UINT32, 0),
                     tokenizer__ggml__unknown_token_id=(UINT32, 261), tokenizer__ggml__add_bos_token=(BOOL, True),
                     tokenizer__ggml__bos_token_id=(UINT32, 1))
    tok, eos = gguf_tokenizer(read_gguf(path, tensors=False), tmp_path / "cache")
    assert eos == [2, 0] and tok.pad_token == TOKENS[0] and tok.unk_token == TOKENS[261]
    assert tok.encode("the")[0] == 1 and tok.bos_token == "<|im_start|>"
    again, _ = gguf_tokenizer(read_gguf(path, tensors=False), tmp_path / "cache")  # from the cache
    assert again.encode("the") == tok.encode("the")


# ------------------------------------------------------------------ class 4: non-finite logits

def test_check_logits_refuses_nan_inf_and_rows_without_a_finite_value() -> None:
    ok = torch.tensor([[1.0, -INF, 2.0], [-INF, -INF, 0.0]])  # masked tokens are fine
    check_logits(ok)
    for bad in ([[1.0, NAN, 2.0]], [[INF, 0.0, 0.0]], [[-INF, -INF, -INF]], [[0.0, 1.0, 2.0], [NAN] * 3]):
        with pytest.raises(NonFiniteLogits):
            check_logits(torch.tensor(bad))


class Poisoned:
    """A target (or draft) whose logits from its ``after``-th forward on are ``fill`` in every
    column (NaN, inf), or ``-inf`` outside ``keep`` (a reduced head: legitimate). Steps one
    request at a time (no cache pool)."""

    caps = BackendCaps()

    def __init__(self, inner, fill: float, after: int = 0, keep: int | None = None):
        self.inner, self.fill, self.after, self.keep, self.calls = inner, fill, after, keep, 0
        self.info, self.description, self.formats = inner.info, "poisoned", inner.formats

    def new_cache(self, max_length: int | None = None):
        return self.inner.new_cache(max_length)

    def forward(self, *args, **kwargs) -> ModelOutput:
        out = self.inner.forward(*args, **kwargs)
        self.calls += 1
        if self.calls <= self.after:
            return out
        logits = out.logits.clone()
        logits[..., self.keep or 0:] = self.fill
        return dataclasses.replace(out, logits=logits)


@pytest.fixture(scope="module")
def stories():
    return stories_native_model()


PROMPT = [1, 365, 471, 263]


@pytest.mark.parametrize("fill", [NAN, INF, -INF])
@pytest.mark.parametrize("after", [0, 1, 3])  # at the prefill, at the first and at a later step
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_engine_raises_non_finite_logits_never_token_0(stories, fill: float, after: int, temperature: float) -> None:
    engine = Engine(Poisoned(stories.backend, fill, after), NoDrafter())
    params = SamplingParams(temperature=temperature, max_new_tokens=12, seed=3, ignore_eos=True)
    out = []
    with pytest.raises(NonFiniteLogits, match=NON_FINITE):
        for step in engine.generate(PROMPT, params):
            out += step.new_token_ids
    assert len(out) == after  # the tokens before the poisoned forward, none after


@pytest.mark.parametrize("temperature,top_k", [(0.0, 0), (0.8, 0), (1.0, 5)])
def test_minus_inf_outside_a_reduced_head_is_legitimate(stories, temperature: float, top_k: int) -> None:
    """-inf on every token but the first 50 (FR-Spec's reduced head), then top-k's own -inf: runs."""
    engine = Engine(Poisoned(stories.backend, -INF, keep=50), NoDrafter())
    params = SamplingParams(temperature=temperature, top_k=top_k, max_new_tokens=10, seed=1, ignore_eos=True)
    out = [t for step in engine.generate(PROMPT, params) for t in step.new_token_ids]
    assert len(out) == 10 and all(t < 50 for t in out)


@pytest.mark.parametrize("fill", [NAN, INF])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_drafters_nan_loses_its_drafts_not_the_output(stories, fill: float, temperature: float) -> None:
    """A draft model computing NaN / inf: sampling from it raised (a traceback), now its drafts
    are dropped with one warning and the output is plain decoding's, token for token."""
    params = SamplingParams(temperature=temperature, max_new_tokens=6, seed=7, ignore_eos=True)
    plain = [t for s in Engine(stories.backend, NoDrafter()).generate(PROMPT, params) for t in s.new_token_ids]
    engine = Engine(stories.backend, DraftModelDrafter(Poisoned(stories.backend, fill)), num_draft_tokens=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = [t for s in engine.generate(PROMPT, params) for t in s.new_token_ids]
    assert out == plain
    if temperature:  # a greedy draft takes the argmax without sampling: proposed, then rejected by the target
        assert sum("NaN or infinite" in str(w.message) for w in caught) == 1


@pytest.mark.parametrize("row", [[NAN, 1.0, 0.0, 0.0], [0.0, INF, 0.0, 0.0], [NAN] * 4])
def test_a_draft_distribution_that_is_not_finite_is_rejected_and_p_kept(row: list[float]) -> None:
    """Rejection sampling over two siblings, the first drafted from a q with NaN / inf: that
    sibling is skipped and p left as it is, so the step is the one the second sibling alone
    gives, draw for draw (the second's test and the token after follow p exactly)."""
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.25] * 4, [0.25] * 4])
    q = torch.tensor([[0.25] * 4, row, [0.0, 0.0, 1.0, 0.0]])
    tree = DraftTree(tokens=(3, 1, 2), parents=(-1, 0, 0), draft_probs=q)
    alone = DraftTree(tokens=(3, 2), parents=(-1, 0), draft_probs=q[[0, 2]])
    for seed in range(40):
        acc = accept_rejection(tree, p, torch.Generator().manual_seed(seed))
        want = accept_rejection(alone, p[[0, 2]], torch.Generator().manual_seed(seed))
        assert acc.tokens(tree) == want.tokens(alone)


# ------------------------------------------------------------------ class 4 through the CLI and the server

def nan_gguf(path: Path, fill: float, tensor: str = "output.weight", spare: list[int] | None = None) -> Path:
    """The tiny qwen2 GGUF with ``tensor`` all ``fill``, or (``spare``) only the embedding rows
    of the tokens not in ``spare``: a prompt of spare tokens prefills cleanly and the first
    generated token outside them poisons the next step."""
    meta, tensors = tiny_qwen2()
    if spare is None:
        tensors[tensor][...] = fill
    else:
        rows = np.setdiff1d(np.arange(len(TOKENS)), spare)
        tensors["token_embd.weight"][rows] = fill
    write_gguf(path, meta, tensors)
    return path


@pytest.mark.parametrize("tensor,fill", [("output.weight", NAN), ("output_norm.weight", INF),
                                         ("token_embd.weight", NAN), ("blk.1.ffn_down.weight", -INF)])
@pytest.mark.parametrize("temperature", ["0", "0.8"])
def test_cli_nan_weights_are_one_line_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tensor: str, fill: float,
                                            temperature: str) -> None:
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    path = nan_gguf(tmp_path / "nan.gguf", fill, tensor)
    one_line_exit_2("generate", "--model", str(path), "-n", "8", "--temperature", temperature, "hello",
                    needle=NON_FINITE)


@pytest.mark.parametrize("backend", ["cpu", "native"])
@pytest.mark.parametrize("temperature", ["0", "0.8"])
def test_cli_nan_after_the_prefill_is_one_line_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str,
                                                     temperature: str) -> None:
    """The prompt's tokens are clean, every other token's embedding NaN: the step after the
    first generated token fails (greedy returned token 0 forever here)."""
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    spare = [TOKENS.index(t) for t in ("he", "h", "e", "l", "o")]  # "hello" is "he" "l" "l" "o"
    path = nan_gguf(tmp_path / "nan.gguf", NAN, spare=spare)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one_line_exit_2("generate", "--model", str(path), "--backend", backend, "-n", "8", "--temperature",
                        temperature, "hello", needle=NON_FINITE)


def test_cli_q4_k_block_of_ff_bytes_is_one_line_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's reproduction: a Q4_K tensor of 0xFF bytes has NaN scales (f16 0xFFFF)."""
    from gguf_fixtures import write_tiny_gguf

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "q4k.gguf"
    write_tiny_gguf(path, hidden=256, raw_types={"blk.0.ffn_gate.weight": 12})  # 12: Q4_K
    t = read_gguf(path).tensors["blk.0.ffn_gate.weight"]
    with open(path, "r+b") as f:
        f.seek(t.offset)
        f.write(b"\xff" * t.nbytes)
    for temperature in ("0", "0.8"):
        one_line_exit_2("generate", "--model", str(path), "-n", "4", "--temperature", temperature, "hi",
                        needle=NON_FINITE)


@pytest.fixture(scope="module")
def nan_server(tmp_path_factory: pytest.TempPathFactory):
    """A server on a GGUF whose only clean embeddings are the prompt's tokens (ids 10-12): the
    prefill succeeds, the first step after it computes NaN. Also one all-NaN model."""
    tmp = tmp_path_factory.mktemp("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model(str(nan_gguf(tmp / "nan.gguf", NAN, spare=[10, 11, 12])))
    with running_server(model, name="tiny", max_model_len=64) as (url, _, _):
        yield url


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("prompt", [[10, 11, 12], [0, 1, 2]])  # a NaN at the first step / at the prefill
def test_server_non_finite_logits_are_a_500_not_token_0(nan_server: str, temperature: float, prompt: list[int]) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": temperature, "seed": 1}
    r = httpx.post(f"{nan_server}/v1/completions", json=body, timeout=60)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["type"] == "server_error" and NON_FINITE in err["message"] and "\n" not in err["message"]
    with httpx.stream("POST", f"{nan_server}/v1/completions", json=body | {"stream": True}, timeout=60) as s:
        s.read()
    if s.status_code == 500:  # failed before the first event: a plain error response
        events = [s.json()]
    else:
        events = [json.loads(line[6:]) for line in s.text.splitlines() if line.startswith("data: {")]
    assert events and "error" in events[-1] and NON_FINITE in events[-1]["error"]["message"], s.text
    ok = httpx.get(f"{nan_server}/health", timeout=10)  # the server goes on serving
    assert ok.status_code == 200
