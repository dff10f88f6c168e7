"""Model resolution and conversion into cached HF directories (models/loading.py).

Fast: stories260K golden greedy output (llama2.c reference), llama2.c tokenizer vs a
reference of llama2.c's ``encode``, a tiny synthetic GGUF round trip (HF -> llama.cpp
layout -> materialize -> HF, exact logits), cache atomicity, error messages.
Slow: SmolLM2-135M-Instruct GGUF conversion vs transformers' own (dequantized) GGUF loader.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verispec.data import data_file
from verispec.models.base import ModelError
from verispec.models.catalog import CATALOG, DEFAULT_MODEL, CatalogEntry, PackageFile
from verispec.models.converted import converted_hf_dir
from verispec.models.llama import rope_interleaved_to_half
from verispec.models.llama2c import read_llama2c_vocab
from verispec.models.resolve import list_models, ModelSource, resolve_model
from verispec.models.tokenizer import hf_dir_tokenizer

STORIES_README = data_file("models/stories260K/README.md")


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def stories_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return converted_hf_dir(resolve_model("stories260k"), tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def stories_tokenizer(stories_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(stories_dir)


@pytest.fixture(scope="module")
def stories_vocab() -> list[tuple[bytes, float]]:
    return read_llama2c_vocab(resolve_model("stories260k").tokenizer_path)


def test_a_directory_verispec_wrote_loads_the_tokenizer_autotokenizer_would(stories_dir, stories_tokenizer, tmp_path):
    """The plain fast tokenizer declared by the directories verispec writes loads directly
    (no model-config import): the same class, vocab, special tokens and encodings as
    AutoTokenizer's; a directory declaring another class still goes through AutoTokenizer."""
    tok = hf_dir_tokenizer(stories_dir)
    assert type(tok) is type(stories_tokenizer)
    assert tok.get_vocab() == stories_tokenizer.get_vocab()
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (
        stories_tokenizer.bos_token_id, stories_tokenizer.eos_token_id, stories_tokenizer.unk_token_id)
    for text in ("Once upon a time", "", "  Lily's dog\nran 3 miles!", "\u00e9\u4e2d"):
        assert tok(text)["input_ids"] == stories_tokenizer(text)["input_ids"]
        ids = stories_tokenizer(text)["input_ids"]
        assert tok.decode(ids) == stories_tokenizer.decode(ids)
    import transformers

    asked = []
    auto = transformers.AutoTokenizer.from_pretrained
    other = tmp_path / "other"
    shutil.copytree(stories_dir, other)
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "LlamaTokenizerFast"}))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path, **kw: asked.append(path) or auto(path))
        hf_dir_tokenizer(stories_dir)
        assert asked == []
        text = "Once upon a time"
        assert hf_dir_tokenizer(other)(text)["input_ids"] == stories_tokenizer(text)["input_ids"]
        assert asked == [str(other)]


def golden_text() -> str:
    """The indented block after 'begins exactly:' in the stories260K README."""
    readme = STORIES_README.read_text(encoding="utf-8")
    block = re.search(r"begins exactly:\n\n((?:    .*\n)+)", readme)
    assert block is not None, "golden block not found in README"
    return "\n".join(line[4:] for line in block.group(1).rstrip("\n").split("\n"))


# --------------------------------------------------------------------------- llama2.c


def test_stories260k_golden_greedy(stories_dir: Path, stories_tokenizer) -> None:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(stories_dir, dtype=torch.float32).eval()
    bos = torch.tensor([[1]])  # [1, 1]
    # llama2.c `run -t 0 -n 200`: positions 0..199, i.e. BOS + 199 generated tokens.
    out = model.generate(bos, max_new_tokens=199, do_sample=False, top_p=None, top_k=None)  # [1, <=200]
    text = stories_tokenizer.decode(out[0, 1:], skip_special_tokens=True)
    golden = golden_text()
    assert golden.count("\n") == 1 and golden.startswith("Once upon a time")
    assert text.startswith(golden), f"got {text[:len(golden) + 20]!r}"


def test_stories260k_dir_layout(stories_dir: Path) -> None:
    files = set(os.listdir(stories_dir))
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= files
    config = json.loads((stories_dir / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (64, 5, 4)
    assert config["tie_word_embeddings"] is True
    gen = json.loads((stories_dir / "generation_config.json").read_text())
    assert gen["bos_token_id"] == 1 and 2 in gen["eos_token_id"]
    from safetensors import safe_open

    with safe_open(stories_dir / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    assert "model.layers.4.self_attn.q_proj.weight" in names and "lm_head.weight" not in names


def llama2c_encode(vocab: list[tuple[bytes, float]], text: str, bos: bool = True) -> list[int]:
    """Reference: llama2.c run.c ``encode`` (dummy prefix, codepoints/byte fallback, greedy score merges)."""
    pieces = [p for p, _ in vocab]
    lookup = {p: i for i, p in enumerate(pieces)}
    tokens = [1] if bos else []
    if text:
        tokens.append(lookup[b" "])
    for ch in text:
        raw = ch.encode("utf-8")
        tokens.extend([lookup[raw]] if raw in lookup else [b + 3 for b in raw])
    while True:
        best: tuple[float, int, int] | None = None  # (score, merged id, position)
        for i in range(len(tokens) - 1):
            j = lookup.get(pieces[tokens[i]] + pieces[tokens[i + 1]])
            if j is not None and (best is None or vocab[j][1] > best[0]):
                best = (vocab[j][1], j, i)
        if best is None:
            return tokens
        _, j, i = best
        tokens[i : i + 2] = [j]


LLAMA2C_TEXTS = [
    "",
    "Hello world",
    "Once upon a time, there was a little girl named Lily.",
    "Lily's mom said, \"Let's go to the park.\"\nThey went.",
    "  two leading spaces and trailing  ",
    "naïve café — 日本語 ✓ 123",
    "tab\there",
]


@pytest.mark.parametrize("text", LLAMA2C_TEXTS)
def test_llama2c_tokenizer_matches_reference(text: str, stories_tokenizer, stories_vocab) -> None:
    ids = stories_tokenizer.encode(text)
    assert ids == llama2c_encode(stories_vocab, text)
    assert stories_tokenizer.decode(ids, skip_special_tokens=True) == text


# "<" is left out: HF parses "<s>" in text as the BOS special token, llama2.c does not.
_TEXT_ALPHABET = st.sampled_from(list("abcdefghijklmnopqrstuvwxyz ABCLT.,!?'\"\n-0123456789éñ✓日€"))


@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet=_TEXT_ALPHABET, max_size=48))
def test_llama2c_tokenizer_property(text: str, stories_tokenizer, stories_vocab) -> None:
    ids = stories_tokenizer.encode(text)
    assert ids == llama2c_encode(stories_vocab, text)
    assert stories_tokenizer.decode(ids, skip_special_tokens=True) == text


# --------------------------------------------------------------------------- RoPE permutation


def llamacpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp convert_hf_to_gguf.py ``LlamaModel.permute`` (HF rotate_half -> interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_rope_interleaved_to_half_example_and_inverse() -> None:
    w = torch.arange(8.0).reshape(8, 1)  # two heads of dim 4: rows a0 b0 a1 b1 | c0 d0 c1 d1
    assert rope_interleaved_to_half(w, 2).flatten().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    x = torch.randn(3 * 16, 10)  # [n_heads * head_dim, in]
    assert torch.equal(rope_interleaved_to_half(llamacpp_permute(x, 3), 3), x)


# --------------------------------------------------------------------------- tiny synthetic GGUF

_HF_TO_GGUF = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip
_TINY_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def _gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}  # fmt: skip
    if hf_name in fixed:
        return fixed[hf_name]
    layer, rest = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", hf_name).groups()
    return f"blk.{layer}.{_HF_TO_GGUF[rest]}.weight"


def _tiny_byte_level_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a minimal GPT-2 style byte-level BPE."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merged = ["Ġt", "he", "Ġthe"]
    tokens = specials + sorted(bytes_to_unicode().values()) + merged
    return tokens, [3] * 3 + [1] * (len(tokens) - 3), ["Ġ t", "h e", "Ġt he"]


def write_tiny_gguf(path: Path) -> torch.nn.Module:
    """An untied random Llama in llama.cpp's layout (permuted Q/K, one Q8_0 tensor); returns the HF reference."""
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    tokens, types, merges = _tiny_byte_level_vocab()
    config = LlamaConfig(vocab_size=len(tokens), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rms_norm_eps=1e-6, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2), w.add_context_length(128), w.add_embedding_length(64), w.add_feed_forward_length(96)
    w.add_head_count(4), w.add_head_count_kv(2), w.add_rope_dimension_count(16), w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6), w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2"), w.add_token_list(tokens), w.add_token_types(types), w.add_token_merges(merges)
    w.add_bos_token_id(1), w.add_eos_token_id(2), w.add_chat_template(_TINY_TEMPLATE)
    for name, tensor in model.state_dict().items():
        array = tensor.numpy()
        if "q_proj" in name or "k_proj" in name:
            array = llamacpp_permute(tensor, 4 if "q_proj" in name else 2).numpy()
        if name == "model.layers.1.mlp.up_proj.weight":  # exercise dequantization; reference gets the same values
            packed = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(_gguf_name(name), packed, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            tensor.copy_(torch.from_numpy(gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.Q8_0)))
        else:
            w.add_tensor(_gguf_name(name), np.ascontiguousarray(array))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return model


def test_tiny_gguf_round_trip(tmp_path: Path) -> None:
    from transformers import AutoTokenizer, LlamaForCausalLM

    reference = write_tiny_gguf(tmp_path / "tiny.gguf")
    source = resolve_model(str(tmp_path / "tiny.gguf"))
    assert (source.kind, source.chat) == ("gguf", True)
    hf_dir = converted_hf_dir(source, tmp_path / "cache")
    model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, reference.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    assert tokenizer.chat_template == _TINY_TEMPLATE
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode(" the the", add_special_tokens=False)) == ["Ġthe"] * 2
    generation = json.loads((hf_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2, 0]  # <|im_end|> (GGUF eos) + <|endoftext|> (llama.cpp EOG)
    assert resolve_model(str(hf_dir)).kind == "hf_dir" and resolve_model(str(hf_dir)).chat


# --------------------------------------------------------------------------- cache behaviour


def test_materialize_caches_and_rebuilds_on_change(tmp_path: Path) -> None:
    src = resolve_model("stories260k")
    model, tok = tmp_path / "m" / "stories260K.bin", tmp_path / "m" / "tok512.bin"
    model.parent.mkdir()
    shutil.copy(src.path, model), shutil.copy(src.tokenizer_path, tok)
    cache = tmp_path / "cache"
    first = converted_hf_dir(resolve_model(str(model)), cache)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert converted_hf_dir(resolve_model(str(model)), cache) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    data = bytearray(model.read_bytes())
    data[-1] ^= 0xFF  # flip a byte of the (unused) freq_cis tail: same size, new content
    model.write_bytes(bytes(data))
    second = converted_hf_dir(resolve_model(str(model)), cache)
    assert second != first and sorted(p.name for p in cache.iterdir()) == sorted([first.name, second.name])


def test_failed_conversion_leaves_no_cache_entry(tmp_path: Path) -> None:
    src = resolve_model("stories260k")
    bad_tok = tmp_path / "tok512.bin"
    bad_tok.write_bytes(src.tokenizer_path.read_bytes()[:-10])  # truncated inside the last token
    source = ModelSource("bad", "llama2c", src.path, tokenizer_path=bad_tok)
    with pytest.raises(ModelError):
        converted_hf_dir(source, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_default_cache_dir_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "envcache"))
    out = converted_hf_dir(resolve_model("stories260k"))
    assert out.parent == tmp_path / "envcache"


def test_hf_dir_returned_as_is(stories_dir: Path) -> None:
    source = resolve_model(str(stories_dir))
    assert (source.kind, source.chat) == ("hf_dir", False)
    assert converted_hf_dir(source) == stories_dir


def test_list_models_and_default() -> None:
    names = [name for name, _ in list_models()]
    assert DEFAULT_MODEL == "smollm2-135m-instruct" and names[:2] == [DEFAULT_MODEL, "stories260k"]
    assert all(desc for _, desc in list_models())


# --------------------------------------------------------------------------- errors


def _assert_one_line(err: pytest.ExceptionInfo[ModelError], *words: str) -> None:
    message = str(err.value)
    assert "\n" not in message and "Traceback" not in message, message
    assert "expected" in message or "run `" in message, message
    for word in words:
        assert word in message, message


def test_unknown_model_name() -> None:
    with pytest.raises(ModelError) as err:
        resolve_model("no-such-model")
    _assert_one_line(err, "no-such-model", "stories260k", ".gguf")


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelError) as err:
        resolve_model(str(tmp_path / "missing.gguf"))
    _assert_one_line(err, "missing.gguf")


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelError) as err:
        resolve_model(str(tmp_path))
    _assert_one_line(err, "config.json")


def test_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    entry = CatalogEntry("x", "gguf", PackageFile("verispec-no-such-dist", "a/b.gguf", "pip install nothing"), True)
    monkeypatch.setitem(CATALOG, "ghost", entry)
    with pytest.raises(ModelError) as err:
        resolve_model("ghost")
    _assert_one_line(err, "pip install nothing")


@pytest.mark.parametrize("content", [b"", b"garbage" * 7, b"\x00" * 28 + b"\x01" * 100])
def test_corrupt_llama2c_bin(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(content)
    with pytest.raises(ModelError) as err:
        resolve_model(str(path))
    _assert_one_line(err, "llama2.c")


def test_truncated_llama2c_bin(tmp_path: Path) -> None:
    src = resolve_model("stories260k")
    path = tmp_path / "stories260K.bin"
    path.write_bytes(src.path.read_bytes()[:100_000])
    shutil.copy(src.tokenizer_path, tmp_path / "tok512.bin")
    with pytest.raises(ModelError) as err:
        resolve_model(str(path))
    _assert_one_line(err, "truncated")


def test_llama2c_without_tokenizer(tmp_path: Path) -> None:
    path = tmp_path / "stories260K.bin"
    shutil.copy(resolve_model("stories260k").path, path)
    with pytest.raises(ModelError) as err:
        resolve_model(str(path))
    _assert_one_line(err, "tokenizer")
    shutil.copy(resolve_model("stories260k").tokenizer_path, tmp_path / "other_name.bin")
    assert resolve_model(str(path), tokenizer_path=tmp_path / "other_name.bin").tokenizer_path.name == "other_name.bin"


@pytest.mark.parametrize("content", [b"", b"garbage-not-gguf" * 64, b"GGUF\x03\x00\x00\x00" + b"\xff" * 40])
def test_corrupt_gguf(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelError) as err:
        converted_hf_dir(resolve_model(str(path)), tmp_path / "cache")
    _assert_one_line(err, "GGUF")


def test_truncated_gguf_data(tmp_path: Path) -> None:
    """Metadata intact, tensor data cut: refused in one line by the file's one header parse (when
    it is resolved: every tensor's data range is checked), before anything is written."""
    write_tiny_gguf(tmp_path / "full.gguf")
    data = (tmp_path / "full.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 5000])
    with pytest.raises(ModelError) as err:
        converted_hf_dir(resolve_model(str(tmp_path / "cut.gguf")), tmp_path / "cache")
    _assert_one_line(err, "truncated")
    assert not (tmp_path / "cache").exists() or list((tmp_path / "cache").iterdir()) == []  # found before any write


# --------------------------------------------------------------------------- the real target (slow)
