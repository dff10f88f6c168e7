"""Compiled CPU runtime (verispec._vscpu via models/cpu.py): bit-exactness across layouts
(alone, chain, tree, batch rows), threads and ISAs (every available ISA against the scalar
reference), agreement with transformers / the fp32 PyTorch runtime, cache rollback and
compaction, input validation, and (slow) memory safety under valgrind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import tiny_models
from tiny_models import (
    PARENTS,
    VOCAB,
    ancestor_mask,
    assert_batch_bitwise,
    assert_chain_bitwise,
    assert_same_bits,
    assert_tree_bitwise,
    available_isas,
    feed_one_by_one,
    has_isa,
    path_to,
    prefill,
    scenario,
    tokens,
)
from verispec.models import cpu_abi
from verispec.models.base import ModelError
from verispec.models.llama import LlamaArgs

cpu = pytest.importorskip("verispec.models.cpu")
if not cpu_abi.available():
    pytest.skip("the compiled runtime verispec._vscpu is not built", allow_module_level=True)
CpuLlama = cpu.CpuLlama
ISAS = available_isas()  # scalar (the reference) first


KINDS = ("llama", "llama3-tied", "qwen2-bias")
QUANTS = ("f32", "q8_0", "q4_1", "q4_0")


@pytest.fixture(scope="module")
def load(tiny_dirs):
    """Memoized CpuLlama of a tiny model (kind, quant, isa, threads, max_length)."""
    models = {}

    def get(kind: str = "llama", quant: str = "f32", isa: str | None = None, threads: int = 2,
            max_length: int = 512) -> CpuLlama:
        key = (kind, quant, isa, threads, max_length)  # quantized models: fp16 K/V (the default)
        if key not in models:
            models[key] = CpuLlama.from_hf_dir(tiny_dirs[kind][0], max_length=max_length, quant=quant, isa=isa,
                                               threads=threads)
        return models[key]

    return get


# ----------------------------------------------------------------------------- library facts


def test_isa_probe_and_forcing(monkeypatch):
    assert "scalar" in ISAS and cpu_abi.isa_name() in ISAS
    assert cpu_abi.isa_name("auto") == ISAS[-1]  # the widest one
    monkeypatch.setenv("VERISPEC_ISA", "scalar")
    assert cpu_abi.isa_name() == "scalar"
    monkeypatch.setenv("VERISPEC_ISA", "bogus")
    with pytest.raises(ValueError, match="bogus"):
        cpu_abi.isa_name()
    with pytest.raises(ValueError, match="bogus"):
        cpu_abi.isa_name("bogus")


def test_model_facts(load):
    model = load("llama", "q8_0", isa="scalar", threads=1)
    assert model.isa == "scalar" and model.threads == 1 and model.quant == "q8_0"
    assert model.info.vocab_size == VOCAB and model.info.hidden_size == 64 and model.info.max_length == 512
    assert "scalar" in model.description and model.weight_bytes > 0
    model.set_threads(2)
    assert model.threads == 2
    model.set_threads(1)
    with pytest.raises(ValueError, match="threads"):
        model.set_threads(0)
    assert model.threads == 1
    assert load("llama", isa=None).isa == (os.environ.get("VERISPEC_ISA") or ISAS[-1])  # VERISPEC_ISA forces one


def test_forced_isa_from_environment(monkeypatch, tiny_dirs):
    monkeypatch.setenv("VERISPEC_ISA", "scalar")
    assert CpuLlama.from_hf_dir(tiny_dirs["llama"][0], max_length=64).isa == "scalar"
    monkeypatch.setenv("VERISPEC_ISA", "bogus")
    with pytest.raises(ModelError, match="bogus"):
        CpuLlama.from_hf_dir(tiny_dirs["llama"][0], max_length=64)
    monkeypatch.delenv("VERISPEC_ISA")
    with pytest.raises(ModelError, match="bogus"):
        CpuLlama.from_hf_dir(tiny_dirs["llama"][0], max_length=64, isa="bogus")


@pytest.mark.skipif(has_isa("avx512"), reason="this CPU has AVX-512")
def test_missing_isa_is_refused(tiny_dirs):
    with pytest.raises(ValueError):
        cpu_abi.isa_name("avx512")
    with pytest.raises(ModelError):
        CpuLlama.from_hf_dir(tiny_dirs["llama"][0], max_length=64, isa="avx512")


# ----------------------------------------------------------------------------- bitwise invariance


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("kind", KINDS)
def test_chain_tree_batch_bitwise(load, kind, quant, isa):
    """Alone == chain == tree node == batch row, bitwise, with 1 and 2 threads; also with the
    forward spanning a 64-slot K tile boundary (slots 60..67)."""
    model = load(kind, quant, isa)
    for threads in (1, 2):
        model.set_threads(threads)
        assert_chain_bitwise(model, VOCAB, prefix_len=12, k=8)
        assert_chain_bitwise(model, VOCAB, prefix_len=60, k=8)
        assert_tree_bitwise(model, VOCAB, prefix_len=12)
        assert_tree_bitwise(model, VOCAB, prefix_len=60)
        assert_batch_bitwise(model, VOCAB)
    model.set_threads(2)


def test_empty_cache_tree_bitwise(load):
    """A tree as the very first forward (no cached slots)."""
    assert_tree_bitwise(load("llama", "q4_1"), VOCAB, prefix_len=1)
    model = load("llama")
    ids = tokens(len(PARENTS), seed=2)
    mask = ancestor_mask(PARENTS)
    out = model.forward(ids, (mask.sum(1) - 1)[None], model.new_cache(), tree_mask=mask).logits
    for i in range(len(PARENTS)):
        path = path_to(PARENTS, i)
        ref = model.forward(ids[:, path], torch.arange(len(path))[None], model.new_cache()).logits[0, -1]
        assert torch.equal(out[0, i], ref), f"node {i}"


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("kind", KINDS)
def test_isas_and_threads_give_scalar_bits(load, kind, quant):
    """Every available ISA, with 1 and 2 threads, gives the scalar reference's exact bits."""
    ref = scenario(load(kind, quant, "scalar", threads=1), VOCAB)
    for isa in ISAS:
        for threads in (1, 2):
            assert_same_bits(ref, scenario(load(kind, quant, isa, threads=threads), VOCAB), f"{isa}, {threads} threads")


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_kv_cache_dtypes_bitwise_across_isas(tiny_dirs, kv_dtype):
    """A quantized model with an fp32 or fp16 (default) K/V cache: chain, tree and batch stay
    bitwise, and every ISA gives the scalar reference's bits (fp16 widening is exact)."""
    def make(isa):
        return CpuLlama.from_hf_dir(tiny_dirs["llama"][0], max_length=512, quant="q4_1", isa=isa, kv_dtype=kv_dtype)

    model = make(None)
    assert model.new_cache().pool.k.dtype == kv_dtype
    assert_chain_bitwise(model, VOCAB, prefix_len=60, k=8)
    assert_tree_bitwise(model, VOCAB, prefix_len=60)
    assert_batch_bitwise(model, VOCAB)
    ref = scenario(make("scalar"), VOCAB)
    for isa in ISAS:
        assert_same_bits(ref, scenario(make(isa), VOCAB), f"{isa}, kv {kv_dtype}")


def test_fp16_cache_holds_round_to_nearest_even_values(tiny_dirs):
    """The fp16 cache holds exactly torch's round-to-nearest-even of the fp32 cache's K/V."""
    models = {dt: CpuLlama.from_hf_dir(tiny_dirs["llama"][0], max_length=128, quant="q8_0", kv_dtype=dt)
              for dt in (torch.float32, torch.float16)}
    ids = tokens(20, seed=5)
    caches = {}
    for dt, m in models.items():
        caches[dt] = m.new_cache()
        m.forward(ids[:, :1], torch.zeros(1, 1, dtype=torch.long), caches[dt])  # layer 0 sees identical inputs
    k32, k16 = caches[torch.float32].pool.k[0, 0, :, 0, :, 0], caches[torch.float16].pool.k[0, 0, :, 0, :, 0]
    v32, v16 = caches[torch.float32].pool.v[0, 0, :, 0], caches[torch.float16].pool.v[0, 0, :, 0]
    assert torch.equal(k32.half(), k16) and torch.equal(v32.half(), v16)


# ----------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize("kind", KINDS)
def test_f32_matches_transformers(load, tiny_dirs, kind):
    path, hf = tiny_dirs[kind]
    model = load(kind, "f32")
    ids = tokens(90, seed=3)
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
    cache = model.new_cache()
    first = model.forward(ids[:, :70], torch.arange(70)[None], cache, want_hidden=True)
    rest = model.forward(ids[:, 70:], torch.arange(70, 90)[None], cache, want_hidden=True)
    torch.testing.assert_close(torch.cat([first.logits, rest.logits], 1), ref.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat([first.hidden, rest.hidden], 1), ref.hidden_states[-1], atol=1e-4, rtol=1e-4)


# max |logit - f32 logit| over 90 tokens of the tiny random models (their logits have std
# ~0.16; measured worst case over the three configs: q8_0 8e-3, q4_1 5.2e-2, q4_0 6.0e-2,
# weights and activations both quantized): bounds of ~2.5-3x that.
QUANT_ATOL = {"q8_0": 0.02, "q4_1": 0.15, "q4_0": 0.2}


@pytest.mark.parametrize("quant", QUANT_ATOL)
@pytest.mark.parametrize("kind", KINDS)
def test_quantized_close_to_f32(load, kind, quant):
    ids, pos = tokens(90, seed=3), torch.arange(90)[None]
    ref = load(kind, "f32").forward(ids, pos, load(kind, "f32").new_cache()).logits
    out = load(kind, quant).forward(ids, pos, load(kind, quant).new_cache()).logits
    err = float((out - ref).abs().max())
    assert err < QUANT_ATOL[quant], f"{quant}: max abs logit error {err:.3g} (logit std {float(ref.std()):.3g})"
    assert err > 0  # it is really quantized


# ----------------------------------------------------------------------------- cache


@pytest.mark.parametrize("quant", ["f32", "q4_0"])
def test_truncate_and_regenerate(load, quant):
    model = load("llama", quant)
    ids = tokens(10, seed=7)
    cache = prefill(model, ids[:, :9])
    logits1 = feed_one_by_one(model, cache, list(range(30, 36)))
    assert cache.length == 15
    assert cache.truncate(9) == 6 and cache.length == 9
    assert cache.truncate(20) == 0 and cache.length == 9
    logits2 = feed_one_by_one(model, cache, list(range(30, 36)))
    assert all(torch.equal(a, b) for a, b in zip(logits1, logits2))
    cache.check_integrity()


@pytest.mark.parametrize("prefix_len", [12, 60])
def test_compact_keeps_accepted_path(load, prefix_len):
    """Verify a tree, keep one root-to-leaf path, continue: same bits as never branching
    (at 60 the tree and the compacted path straddle a 64-slot tile)."""
    model = load("llama", "q8_0")
    n = len(PARENTS)
    ids = tokens(prefix_len + n + 1, seed=8)
    node_tokens, nxt = ids[0, prefix_len:prefix_len + n], ids[0, -1:]
    mask = ancestor_mask(PARENTS)
    for leaf in (7, 6, 4):  # [0, 2, 5, 7], [0, 1, 3, 6], [0, 1, 4]
        cache = prefill(model, ids[:, :prefix_len])
        model.forward(node_tokens[None], (prefix_len + mask.sum(1) - 1)[None], cache, tree_mask=mask)
        path = path_to(PARENTS, leaf)
        cache.compact([prefix_len + i for i in path], prefix_len)
        assert cache.length == prefix_len + len(path)
        after = feed_one_by_one(model, cache, nxt.tolist() * 2)
        ref_cache = prefill(model, ids[:, :prefix_len])
        ref = feed_one_by_one(model, ref_cache, node_tokens[path].tolist() + nxt.tolist() * 2)[-2:]
        assert all(torch.equal(a, b) for a, b in zip(after, ref)), f"path to {leaf}"


def test_compact_validation_and_pool(load):
    model = load("llama")
    cache = prefill(model, tokens(6))
    for match, call in (("ascending", lambda: cache.compact([3, 2], 0)), ("ascending", lambda: cache.compact([6], 0)),
                        ("dst_start", lambda: cache.compact([2, 3], 3)), ("new_length", lambda: cache.truncate(-1)),
                        ("max_length", lambda: model.new_cache_pool(1, 513)),
                        ("rows", lambda: model.new_cache_pool(0, 64))):
        with pytest.raises(ValueError, match=match):
            call()
    cache.compact([], 4)
    assert cache.length == 4
    pool = model.new_cache_pool(2, 64)
    rows = [pool.acquire().row, pool.acquire()]
    with pytest.raises(ValueError, match="in use"):
        pool.acquire()
    pool.release(rows[1])
    with pytest.raises(ValueError, match="not acquired"):
        pool.release(rows[1])
    with pytest.raises(ValueError, match="not acquired"):
        model.new_cache_pool(2, 64).release(pool.acquire())  # another pool's cache
    assert rows[1].row == 1 and rows[0] == 0


# ----------------------------------------------------------------------------- validation


def _bits(pool) -> tuple[torch.Tensor, torch.Tensor]:
    return pool.k.view(torch.int32).clone(), pool.v.view(torch.int32).clone()


@pytest.mark.parametrize("kind", ["llama", "llama3-tied"])
def test_reduced_head_rows_are_the_full_heads_bits(load, tiny_dirs, kind):
    """``head_rows`` (a distilled draft's FR-Spec head): the runtime computes only those LM-head
    rows, bit for bit the full head's at those ids (chain and tree), -inf at every other id;
    the input embedding keeps every token. Bad row lists are refused."""
    full = load(kind, "q8_0")
    rows = torch.tensor([3, 0, 17, VOCAB - 1, 40])
    small = CpuLlama.from_hf_dir(tiny_dirs[kind][0], max_length=512, quant="q8_0", head_rows=rows)
    assert small.info.vocab_size == VOCAB and small.args.vocab_size == len(rows)
    assert small.resident_bytes > small.weight_bytes  # the full Q8_0 input embedding is resident too
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[rows] = False
    ids = tokens(9)
    for mask in (None, ancestor_mask(PARENTS)):
        x = ids[:, :len(PARENTS)] if mask is not None else ids
        pos = torch.arange(x.shape[1])[None]
        a = small.forward(x, pos, small.new_cache(), tree_mask=mask).logits[0]
        b = full.forward(x, pos, full.new_cache(), tree_mask=mask).logits[0]
        assert a.shape == b.shape and torch.equal(a[:, rows], b[:, rows])
        assert torch.isneginf(a[:, outside]).all()
    for bad in ([], [1, 1], [VOCAB], [[1, 2]]):
        with pytest.raises(ValueError, match="head_rows"):
            CpuLlama.from_hf_dir(tiny_dirs[kind][0], quant="q8_0", head_rows=bad)


def test_forward_validation(load):
    """Bad inputs raise ValueError before any slot of the cache is written."""
    model = load("llama")
    other = load("llama", isa="scalar")
    pool = model.new_cache_pool(2, 16)
    cache, second = pool.acquire(), pool.acquire()
    prefill_ids = tokens(4)
    model.forward(prefill_ids, torch.arange(4)[None], cache)
    before = _bits(pool)
    one, pos = torch.tensor([[1]]), torch.tensor([[4]])
    bad = [
        ("input_ids", lambda: model.forward(torch.tensor([1, 2]), torch.tensor([0, 1]), cache)),
        ("input_ids", lambda: model.forward(torch.tensor([[1.0]]), pos, cache)),
        ("input_ids", lambda: model.forward(torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0, dtype=torch.long), cache)),
        ("positions", lambda: model.forward(one, torch.tensor([[4, 5]]), cache)),
        ("positions", lambda: model.forward(one, torch.tensor([[4.0]]), cache)),
        ("token ids", lambda: model.forward(torch.tensor([[VOCAB]]), pos, cache)),
        ("token ids", lambda: model.forward(torch.tensor([[-1]]), pos, cache)),
        ("positions must be in", lambda: model.forward(one, torch.tensor([[512]]), cache)),
        ("positions must be in", lambda: model.forward(one, torch.tensor([[-1]]), cache)),
        ("overflow", lambda: model.forward(tokens(13), torch.arange(4, 17)[None], cache)),
        ("tree_mask", lambda: model.forward(one, pos, cache, tree_mask=torch.ones(2, 2, dtype=torch.bool))),
        ("tree_mask", lambda: model.forward(tokens(2), torch.tensor([[4, 5]]), cache,
                                            tree_mask=torch.ones(2, 2, dtype=torch.int32).tril())),
        ("see itself", lambda: model.forward(tokens(2), torch.tensor([[4, 5]]), cache,
                                             tree_mask=torch.tensor([[True, False], [True, False]]))),
        ("see itself", lambda: model.forward(tokens(2), torch.tensor([[4, 5]]), cache,
                                             tree_mask=torch.ones(2, 2, dtype=torch.bool))),
        ("one pool created by this model", lambda: other.forward(one, pos, cache)),
        ("one pool created by this model",
         lambda: model.forward_batch(tokens(1).expand(2, 1), pos.expand(2, 1), [cache, model.new_cache(16)])),
        ("one pool created by this model", lambda: model.forward_batch(one, pos, ["not a cache"])),
        ("twice", lambda: model.forward_batch(tokens(1).expand(2, 1), pos.expand(2, 1), [cache, cache])),
        ("input_ids", lambda: model.forward_batch(tokens(1).expand(2, 1), pos.expand(2, 1), [cache])),
        ("num_tokens", lambda: model.forward_batch(tokens(2).expand(2, 2), pos.expand(2, 2), [cache, second],
                                                   num_tokens=[2, 0])),
        ("num_tokens", lambda: model.forward_batch(tokens(2).expand(2, 2), pos.expand(2, 2), [cache, second],
                                                   num_tokens=[2, 3])),
        ("num_tokens", lambda: model.forward_batch(tokens(2).expand(2, 2), pos.expand(2, 2), [cache, second],
                                                   num_tokens=[2])),
    ]
    for match, call in bad:
        with pytest.raises(ValueError, match=match):
            call()
    assert cache.length == 4 and second.length == 0  # failed forwards leave the caches alone
    after = _bits(pool)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1]), "a refused forward wrote the cache"
    # padding is not validated: anything may sit past num_tokens
    ok = torch.tensor([[7, VOCAB + 5]])
    model.forward_batch(ok, torch.tensor([[4, -3]]), [cache], num_tokens=[1])
    assert cache.length == 5


def test_unsupported_shapes(tiny_dirs, tmp_path):
    """dim / heads * head_dim not a multiple of 32 (hidden 48), and stories260K (ffn 172)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from verispec.models.converted import converted_hf_dir
    from verispec.models.resolve import resolve_model

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    assert not cpu_abi.supports(LlamaArgs.from_hf_config(json.loads((tmp_path / "config.json").read_text())))
    with pytest.raises(ModelError, match="multiples of 32"):
        CpuLlama.from_hf_dir(tmp_path)

    stories = converted_hf_dir(resolve_model("stories260k"))
    stories_cfg = json.loads((stories / "config.json").read_text())
    assert stories_cfg["intermediate_size"] % 32 != 0 and not cpu_abi.supports(LlamaArgs.from_hf_config(stories_cfg))
    with pytest.raises(ModelError, match="multiples of 32"):
        CpuLlama.from_hf_dir(stories)

    assert cpu_abi.supports(LlamaArgs.from_hf_config(json.loads((tiny_dirs["llama"][0] / "config.json").read_text())))
    with pytest.raises(ModelError, match="config.json"):
        CpuLlama.from_hf_dir(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="unknown quant"):
        CpuLlama.from_hf_dir(tiny_dirs["llama"][0], quant="q2_k")
    with pytest.raises(ValueError, match="multiple of its block size 256"):  # K-quants need 256-wide rows
        CpuLlama.from_hf_dir(tiny_dirs["llama"][0], quant="q5_k")


def test_unsupported_gguf_tensor_type(tiny_dirs, tmp_path):
    """A GGUF whose attention weights are in a type the runtime has no format for (F64) is refused
    with the tensor's name and type."""
    from gguf import GGMLQuantizationType, GGUFWriter

    path = tmp_path / "f64.gguf"
    writer = GGUFWriter(str(path), "llama")
    for i in range(2):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", torch.ones(64).numpy())
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", torch.ones(64).numpy())
        for name, rows in (("attn_q", 64), ("attn_k", 32), ("attn_v", 32)):
            writer.add_tensor(f"blk.{i}.{name}.weight", torch.zeros(rows, 64, dtype=torch.float64).numpy(),
                              raw_dtype=GGMLQuantizationType.F64)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelError, match="attn_q.weight is F64"):
        CpuLlama.from_hf_dir(tiny_dirs["llama"][0], gguf=path)


# ----------------------------------------------------------------------------- real SmolLM2 (GGUF Q4_1)


# ----------------------------------------------------------------------------- memory safety


VALGRIND_SCRIPT = textwrap.dedent("""
    import sys, torch
    from tiny_models import PARENTS, ancestor_mask
    from verispec.models.cpu import CpuLlama
    torch.set_num_threads(1)
    for quant in ("f32", "q8_0", "q4_1"):
        model = CpuLlama.from_hf_dir(sys.argv[1], max_length=130, quant=quant, threads=2)
        pool = model.new_cache_pool(2, 130)
        a, b = pool.acquire(), pool.acquire()
        model.forward(torch.arange(66)[None], torch.arange(66)[None], a, want_hidden=True)
        mask = ancestor_mask(PARENTS)
        n = len(PARENTS)
        masks = torch.stack([mask, torch.ones(n, n, dtype=torch.bool).tril()])
        pos = torch.stack([66 + mask.sum(1) - 1, torch.arange(n)])
        model.forward_batch(torch.arange(2 * n).view(2, n), pos, [a, b], masks, num_tokens=[n, 5])
        a.compact([66, 68, 71, 73], 66)
        model.forward(torch.tensor([[3]]), torch.tensor([[a.length]]), a, last_logits_only=True)
        print(quant, model.isa, "ok")
""")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/usr/bin/valgrind"), reason="valgrind is not installed")
@pytest.mark.parametrize("isa", [isa for isa in ISAS if isa != "avx512"])
def test_valgrind_memcheck(tiny_dirs, tmp_path, isa):
    """Tiny forwards (prompt past a tile, batched tree with padding, compact) under memcheck;
    ~6 min an ISA here.
    AVX-512 is left out: valgrind (3.x) does not decode AVX-512 instructions and hides the
    feature from CPUID, so the runtime cannot even pick it there."""
    script = tmp_path / "forward.py"
    script.write_text(VALGRIND_SCRIPT)
    env = dict(os.environ, VERISPEC_ISA=isa, PYTHONMALLOC="malloc",
               PYTHONPATH=os.pathsep.join([os.path.dirname(tiny_models.__file__), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(["valgrind", "--leak-check=no", sys.executable, str(script), str(tiny_dirs["llama"][0])],
                          env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert proc.stdout.count(f" {isa} ok") == 3, proc.stdout
    # CPython and libtorch report uninitialised-value noise of their own (seen: ceval.c, at::native::to,
    # Py_FinalizeEx), so --error-exitcode cannot be used: fail on any error record with a frame in our library.
    ours = [r for r in proc.stderr.split("== \n") if "_vscpu" in r or " vs::" in r or " vs_" in r]
    assert not ours, "memcheck errors in the compiled runtime:\n" + "\n".join(ours)[-6000:]
