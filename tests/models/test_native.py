"""Native Llama runtime: agreement with transformers, bit-exact speculation (batch
invariance), static-cache rollback, batched forwards and input validation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import verispec.models.invariance as invariance
import verispec.models.native as native
from tiny_models import (
    PARENTS,
    VOCAB,
    ancestor_mask,
    assert_chain_bitwise,
    assert_tree_bitwise,
    feed_one_by_one,
    path_to,
    prefill,
    tokens,
)
from verispec.models.base import CausalLM, KVCache, ModelError, causal_tree_mask
from verispec.models.invariance import invariant_attention, pairwise_sum, tail_layout
from verispec.models.native import NativeLlama, linear, window_mask


@pytest.fixture(scope="module")
def tiny_path(tiny_dirs):
    return tiny_dirs["llama"][0]


@pytest.fixture(scope="module")
def load(tiny_dirs):
    """Memoized ``NativeLlama.from_hf_dir`` (calibration is the slow part of loading)."""
    models = {}

    def get(kind: str = "llama", **options) -> NativeLlama:
        key = (kind, tuple(sorted((k, str(v)) for k, v in options.items())))
        if key not in models:
            models[key] = NativeLlama.from_hf_dir(tiny_dirs[kind][0], **options)
        return models[key]

    return get


# ----------------------------------------------------------------------------- protocol + reference


def test_implements_protocols(load):
    model = load("llama", dtype=torch.float32)
    assert isinstance(model, CausalLM)
    assert isinstance(model.new_cache(64), KVCache)
    assert model.info.vocab_size == VOCAB and model.info.hidden_size == 64
    assert model.info.max_length == 512


@pytest.mark.parametrize("kind", ["llama", "llama3-tied", "qwen2-bias"])
@pytest.mark.parametrize("batch_invariant", [True, False])
def test_fp32_matches_transformers(load, tiny_dirs, kind, batch_invariant):
    path, hf = tiny_dirs[kind]
    model = load(kind, dtype=torch.float32, batch_invariant=batch_invariant, max_length=256)
    ids = tokens(40, seed=3)
    with torch.no_grad():
        ref = hf(ids).logits  # [1, 40, V]
    cache = model.new_cache()
    first = model.forward(ids[:, :30], torch.arange(30)[None], cache)  # prompt
    rest = model.forward(ids[:, 30:], torch.arange(30, 40)[None], cache)  # a verify-sized forward
    torch.testing.assert_close(torch.cat([first.logits, rest.logits], 1), ref, atol=1e-4, rtol=1e-4)
    assert cache.length == 40


def test_prefill_path_matches_transformers(load, tiny_dirs):
    """Forwards longer than max_rows take the SDPA prefill path."""
    path, hf = tiny_dirs["llama"]
    model = load("llama", dtype=torch.float32, max_rows=16)
    ids = tokens(50, seed=4)
    with torch.no_grad():
        ref = hf(ids).logits
    out = model.forward(ids, torch.arange(50)[None], model.new_cache())
    torch.testing.assert_close(out.logits, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("quant,n", [("none", 50), ("int4", 80), ("int4", 10)])
def test_last_logits_only(load, quant, n):
    """A prefill's last-token logits alone (int4 prefills of >= 64 rows run dequantized)."""
    model = load("llama", dtype=torch.float32, quant=quant, max_rows=16)
    ids, pos = tokens(n, seed=5), torch.arange(n)[None]
    full = model.forward(ids, pos, model.new_cache()).logits
    last = model.forward(ids, pos, model.new_cache(), last_logits_only=True).logits
    assert last.shape == (1, 1, VOCAB)
    torch.testing.assert_close(last[0, 0], full[0, -1], atol=2e-2 if quant == "int4" else 1e-5, rtol=0)


def test_bf16_close_to_transformers(load, tiny_dirs):
    path, hf = tiny_dirs["llama"]
    model = load("llama")  # bf16 default
    assert model.info.dtype == torch.bfloat16
    ids = tokens(20, seed=5)
    with torch.no_grad():
        ref = hf(ids).logits
    out = model.forward(ids, torch.arange(20)[None], model.new_cache())
    assert out.logits.dtype == torch.float32
    torch.testing.assert_close(out.logits, ref, atol=0.1, rtol=0.05)


def test_hidden_is_final_normed_state(load, tiny_dirs):
    path, hf = tiny_dirs["llama"]
    model = load("llama", dtype=torch.float32)
    ids = tokens(10, seed=6)
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True).hidden_states[-1]  # after the final norm
    out = model.forward(ids, torch.arange(10)[None], model.new_cache(), want_hidden=True)
    torch.testing.assert_close(out.hidden, ref, atol=1e-5, rtol=1e-5)
    assert model.forward(ids[:, :1], torch.tensor([[10]]), model.new_cache()).hidden is None


# ----------------------------------------------------------------------------- batch invariance


QUANTS = [(torch.float32, "none"), (torch.bfloat16, "none"), (torch.bfloat16, "int8"), (torch.float32, "int4")]


@pytest.mark.parametrize("dtype,quant", QUANTS)
def test_chain_is_bitwise_equal_to_sequential(load, dtype, quant):
    model = load("llama", dtype=dtype, quant=quant)
    assert_chain_bitwise(model, VOCAB)


@pytest.mark.parametrize("dtype,quant", QUANTS)
def test_tree_is_bitwise_equal_to_paths(load, dtype, quant):
    model = load("llama", dtype=dtype, quant=quant)
    assert_tree_bitwise(model, VOCAB)


def test_invariance_across_attention_chunks(load):
    """Small chunks: the verify window spans more chunks than some sequential steps did."""
    model = load("llama", dtype=torch.float32, attn_chunk=8)
    assert_chain_bitwise(model, VOCAB, prefix_len=5, k=8)  # slots 5..12 cross the boundary at 8
    assert_tree_bitwise(model, VOCAB, prefix_len=13)


def test_calibrated_rows_and_thread_change(tiny_path):
    model = NativeLlama.from_hf_dir(tiny_path, dtype=torch.float32)
    inv = model.invariance
    assert inv.threads == torch.get_num_threads()
    assert 1 <= inv.min_rows <= model.options.max_rows and inv.attn_min_rows >= 1
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert_chain_bitwise(model, VOCAB)  # recalibrates for 1 thread
        assert model.invariance.threads == 1
    finally:
        torch.set_num_threads(threads)


def test_num_layers_truncates(tiny_dirs):
    path, hf = tiny_dirs["llama"]
    model = NativeLlama.from_hf_dir(path, dtype=torch.float32, num_layers=1, min_rows=1, attn_min_rows=1)
    assert model.args.n_layers == 1 and model.info.name.endswith("[:1]")
    with pytest.raises(ValueError, match="num_layers"):
        NativeLlama.from_hf_dir(path, num_layers=3)


def test_batch_invariant_off_is_not_padded(load):
    model = load("llama", dtype=torch.float32, batch_invariant=False)
    assert model.invariance.min_rows == 1 and model.invariance.threads is None
    assert not model.exactness.bit_exact and "batch_invariant=False" in model.exactness.reason


def test_caller_padding_is_not_claimed_exact(tiny_path):
    model = NativeLlama.from_hf_dir(tiny_path, dtype=torch.float32, min_rows=1, attn_min_rows=1)
    assert not model.exactness.bit_exact and "not verified" in model.exactness.reason


def one_row_differs(x: torch.Tensor, w, b=None, dense: bool = False) -> torch.Tensor:
    """A kernel like MKL's or oneDNN's GEMV: one-row products round differently (float64)."""
    rows = x.reshape(-1, x.shape[-1]).shape[0]
    return F.linear(x.double(), w.double()).to(x.dtype) if rows == 1 else linear(x, w, b, dense)


def index_dependent(x: torch.Tensor, w, b=None, dense: bool = False) -> torch.Tensor:
    """A kernel no padding can fix: each row's rounding depends on where it sits."""
    y = linear(x, w, b, dense)
    idx = torch.arange(y.shape[-2], device=y.device, dtype=y.dtype)[:, None]
    return y + idx * torch.finfo(y.dtype).eps * y.abs()


def test_calibration_pads_past_a_one_row_kernel(tiny_path, monkeypatch):
    """A dependence on the row count that shows in a few outputs only is found, and padding
    to 2 rows makes chains and trees bitwise equal to one-at-a-time decoding again."""
    monkeypatch.setattr(invariance, "_CALIBRATED", {})
    monkeypatch.setattr(native, "linear", one_row_differs)
    model = NativeLlama.from_hf_dir(tiny_path, dtype=torch.bfloat16)
    assert model.exactness.bit_exact and model.invariance.min_rows >= 2
    assert_chain_bitwise(model, VOCAB)
    assert_tree_bitwise(model, VOCAB)


def test_index_dependent_kernel_is_reported_not_exact(tiny_path, monkeypatch):
    """The honesty check: a path known not to be invariant is reported, with its reason, and
    the model still runs (fast path)."""
    monkeypatch.setattr(invariance, "_CALIBRATED", {})
    monkeypatch.setattr(native, "linear", index_dependent)
    model = NativeLlama.from_hf_dir(tiny_path, dtype=torch.float32)
    assert not model.exactness.bit_exact
    assert "depend on their index" in model.exactness.reason and "wqkv" in model.exactness.reason
    assert not model.invariance.on
    out = model.forward(tokens(5), torch.arange(5)[None], model.new_cache())
    assert out.logits.shape == (1, 5, VOCAB) and torch.isfinite(out.logits).all()


def test_window_mask_example():
    tree = causal_tree_mask(2)[None]  # [1, 2, 2]
    mask = window_mask(tree, torch.tensor([[2]]), 5)
    assert mask[0].int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]]


def test_pairwise_sum_ignores_trailing_zeros():
    """torch.sum over an outer dim changes its grouping with the length (e.g. 15 vs 16
    rows on CPU); pairwise_sum must not."""
    x = torch.randn(3, 15, 65, generator=torch.Generator().manual_seed(0))
    ref = pairwise_sum(x, dim=1)
    for extra in (1, 2, 17, 50):
        assert torch.equal(pairwise_sum(torch.cat([x, torch.zeros(3, extra, 65)], 1), dim=1), ref)
    torch.testing.assert_close(ref, x.sum(1))


def test_tail_layout_example():
    tree = ancestor_mask([-1, 0, 0])[None]  # root 0 with children 1 and 2
    slots, valid = tail_layout(tree, torch.tensor([[2]]), 0, 6)
    assert slots[0, 2, :4].tolist() == [0, 1, 2, 4] and valid[0, 2].tolist() == [True] * 4 + [False] * 2
    assert slots[0, 0, :3].tolist() == [0, 1, 2] and valid[0, 0].sum() == 3


@pytest.mark.parametrize("seed", range(4))
def test_invariant_attention_depends_only_on_own_keys(seed):
    """Each tree node's output equals the output for the same query fed alone after its
    path was written contiguously (sequential decoding), across chunk boundaries."""
    g = torch.Generator().manual_seed(seed)
    chunk, h, grp, d, length = 8, 2, 3, 16, int(torch.randint(1, 30, (1,), generator=g))
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, 10)]
    tree, n = ancestor_mask(parents), len(parents)
    k, v = (torch.randn(1, h, 64, d, generator=g) for _ in range(2))
    q = torch.randn(1, h, grp, n, d, generator=g)
    start = length // chunk * chunk
    idx, valid = tail_layout(tree[None], torch.tensor([[length]]), start, -(-(length + n) // chunk) * chunk - start)
    out = invariant_attention(q, k, v, length // chunk, idx, valid, chunk, min_rows=4)
    for i in range(n):
        path = path_to(parents, i)
        ks, vs = k.clone(), v.clone()  # the path written contiguously after the prefix
        ks[:, :, length:length + len(path)] = k[:, :, [length + j for j in path]]
        vs[:, :, length:length + len(path)] = v[:, :, [length + j for j in path]]
        pos = length + len(path) - 1  # the node's own slot in sequential decoding
        one = torch.ones(1, 1, dtype=torch.bool)[None]
        s0 = pos // chunk * chunk
        idx1, valid1 = tail_layout(one, torch.tensor([[pos]]), s0, -(-(pos + 1) // chunk) * chunk - s0)
        ref = invariant_attention(q[:, :, :, i:i + 1], ks, vs, pos // chunk, idx1, valid1, chunk, min_rows=4)
        assert torch.equal(out[:, :, :, i], ref[:, :, :, 0]), f"node {i} (path {path}, length {length})"


# ----------------------------------------------------------------------------- cache


def greedy(model, cache, first: int, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    toks, logits, tok = [], [], first
    for _ in range(steps):
        out = model.forward(torch.tensor([[tok]]), torch.tensor([[cache.length]]), cache).logits[0, 0]
        logits.append(out)
        tok = int(out.argmax())
        toks.append(tok)
    return toks, logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_truncate_and_regenerate(load, dtype):
    model = load("llama", dtype=dtype)
    ids = tokens(10, seed=7)
    cache = prefill(model, ids[:, :9])
    toks1, logits1 = greedy(model, cache, int(ids[0, 9]), 6)
    assert cache.length == 15
    assert cache.truncate(9) == 6 and cache.length == 9
    assert cache.truncate(20) == 0 and cache.length == 9
    toks2, logits2 = greedy(model, cache, int(ids[0, 9]), 6)
    assert toks1 == toks2
    assert all(torch.equal(a, b) for a, b in zip(logits1, logits2))


def test_compact_keeps_accepted_path(load):
    """Verify a tree, keep one root-to-leaf path, continue: same logits as never branching."""
    model = load("llama", dtype=torch.float32)
    prefix_len, n = 12, len(PARENTS)
    ids = tokens(prefix_len + n + 1, seed=8)
    node_tokens, nxt = ids[0, prefix_len:prefix_len + n], ids[0, -1:]
    mask = ancestor_mask(PARENTS)
    cache = prefill(model, ids[:, :prefix_len])
    model.forward(node_tokens[None], (prefix_len + mask.sum(1) - 1)[None], cache, tree_mask=mask)
    path = path_to(PARENTS, 7)  # [0, 2, 5, 7]
    cache.compact([prefix_len + i for i in path], prefix_len)
    assert cache.length == prefix_len + len(path)
    after = model.forward(nxt[None], torch.tensor([[cache.length]]), cache).logits[0, 0]

    ref_cache = prefill(model, ids[:, :prefix_len])
    ref = feed_one_by_one(model, ref_cache, node_tokens[path].tolist() + nxt.tolist())[-1]
    assert torch.equal(after, ref)


def test_cache_validation(load):
    model = load("llama", dtype=torch.float32)
    cache = prefill(model, tokens(6))
    with pytest.raises(ValueError, match="ascending"):
        cache.compact([3, 2], 0)
    with pytest.raises(ValueError, match="ascending"):
        cache.compact([6], 0)  # slot 6 is not cached
    with pytest.raises(ValueError, match="dst_start"):
        cache.compact([2, 3], 3)
    with pytest.raises(ValueError, match="new_length"):
        cache.truncate(-1)
    cache.compact([], 4)
    assert cache.length == 4
    cache.check_integrity()


def test_pool_rows(load):
    model = load("llama", dtype=torch.float32)
    pool = model.new_cache_pool(2, 64)
    a, b = pool.acquire(), pool.acquire()
    with pytest.raises(ValueError, match="in use"):
        pool.acquire()
    pool.release(a)
    with pytest.raises(ValueError, match="not acquired"):
        pool.release(a)
    c = pool.acquire()
    assert c.row == a.row and c.length == 0 and b.row != c.row


# ----------------------------------------------------------------------------- batched forward


def test_forward_batch_matches_single_requests(load):
    """Two requests with different cache lengths in one forward: bitwise the same logits as
    running them alone (and the padding tokens of the shorter one are not cached)."""
    model = load("llama", dtype=torch.float32)
    pool = model.new_cache_pool(2, 128)
    prompts = [tokens(9, seed=10), tokens(21, seed=11)]
    caches = [pool.acquire(), pool.acquire()]
    for c, p in zip(caches, prompts):
        model.forward(p, torch.arange(p.shape[1])[None], c)
    drafts = torch.cat([tokens(4, seed=12), tokens(4, seed=13)])  # [2, 4]
    masks = torch.stack([causal_tree_mask(4), ancestor_mask([-1, 0, 0, 1])])
    positions = torch.stack([9 + torch.arange(4), 21 + masks[1].sum(1) - 1])
    out = model.forward_batch(drafts, positions, caches, masks, num_tokens=[3, 4])
    assert [c.length for c in caches] == [12, 25]

    for b, p in enumerate(prompts):
        single = prefill(model, p)
        n = 3 if b == 0 else 4
        ref = model.forward(drafts[b:b + 1, :n], positions[b:b + 1, :n], single, masks[b, :n, :n]).logits
        assert torch.equal(out.logits[b, :n], ref[0]), f"request {b} differs in a batch"


# ----------------------------------------------------------------------------- validation


def test_forward_validation(load):
    model = load("llama", dtype=torch.float32, max_length=16)
    other = load("llama", dtype=torch.float32, max_length=16, min_rows=1, attn_min_rows=1)
    cache = model.new_cache()
    one, pos = torch.tensor([[1]]), torch.tensor([[0]])
    with pytest.raises(ValueError, match="input_ids"):
        model.forward(torch.tensor([1, 2]), torch.tensor([0, 1]), cache)
    with pytest.raises(ValueError, match="positions"):
        model.forward(one, torch.tensor([[0, 1]]), cache)
    with pytest.raises(ValueError, match="tree_mask"):
        model.forward(one, pos, cache, tree_mask=torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="one pool created by this model"):
        other.forward(one, pos, cache)
    with pytest.raises(ValueError, match="positions must be in"):
        model.forward(one, torch.tensor([[10_000]]), cache)
    with pytest.raises(ValueError, match="overflow"):
        model.forward(tokens(17), torch.arange(17)[None], cache)
    assert cache.length == 0  # failed forwards leave the cache alone


def test_load_errors(tmp_path, tiny_path):
    with pytest.raises(ModelError, match="config.json"):
        NativeLlama.from_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ModelError, match="model_type"):
        NativeLlama.from_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text((tiny_path / "config.json").read_text())
    with pytest.raises(ModelError, match="safetensors"):
        NativeLlama.from_hf_dir(tmp_path)


# ----------------------------------------------------------------------------- real SmolLM2
