"""Tiny random models and bitwise checks for the model runtimes (shared by the engine and
real-model tests: the checks take any runtime, a tiny model or a real one)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from verispec.models.base import causal_tree_mask

VOCAB = 256
# a branching tree: node i's parent; node 0 is the root (last committed token)
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 5]


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[N, N] bool: True where column j is node i itself or one of its ancestors."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def path_to(parents: list[int], i: int) -> list[int]:
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


def tiny_config(kind: str):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    if kind == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False)
    if kind == "llama3-tied":
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        return LlamaConfig(**common, tie_word_embeddings=True, rope_parameters=rope)
    if kind == "qwen2-bias":
        return Qwen2Config(**common, tie_word_embeddings=False)
    raise ValueError(kind)


def tiny_llama(seed: int, vocab: int = 96, layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # sharper logits than the default init: fewer near-ties
        model.lm_head.weight.mul_(20)
    return model.eval()


def make_tiny_dirs(root: Path) -> dict[str, tuple[Path, torch.nn.Module]]:
    """HF dirs of tiny random models (llama, llama3-tied, qwen2-bias) under ``root``, with
    the transformers reference models."""
    out = {}
    for i, kind in enumerate(("llama", "llama3-tied", "qwen2-bias")):
        torch.manual_seed(i)
        cfg = tiny_config(kind)
        model = (Qwen2ForCausalLM if kind.startswith("qwen2") else LlamaForCausalLM)(cfg).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.5)  # HF initializes biases to zero: make them matter
        path = root / kind
        model.save_pretrained(path)
        out[kind] = (path, model)
    return out


def tokens(n: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def prefill(model, ids: torch.Tensor):
    cache = model.new_cache()
    model.forward(ids, torch.arange(ids.shape[1])[None], cache)
    return cache


def feed_one_by_one(model, cache, toks: list[int]) -> list[torch.Tensor]:
    """Logits of each token fed alone; returns [V] float32 per token."""
    out = []
    for t in toks:
        pos = torch.tensor([[cache.length]])
        out.append(model.forward(torch.tensor([[t]]), pos, cache).logits[0, 0])
    return out


def assert_chain_bitwise(model, vocab: int, prefix_len: int = 12, k: int = 8) -> None:
    assert model.exactness.bit_exact, model.exactness.reason  # the claim is what is tested
    ids = tokens(prefix_len + k, vocab=vocab)
    cache = prefill(model, ids[:, :prefix_len])
    chain = ids[0, prefix_len:].tolist()
    seq = feed_one_by_one(model, cache, chain)
    cache.truncate(prefix_len)
    out = model.forward(ids[:, prefix_len:], torch.arange(prefix_len, prefix_len + k)[None], cache,
                        tree_mask=causal_tree_mask(k), want_hidden=True)
    for j in range(k):
        assert torch.equal(out.logits[0, j], seq[j]), f"token {j} of the chain differs"
    assert out.hidden.shape == (1, k, model.info.hidden_size)


def assert_tree_bitwise(model, vocab: int, prefix_len: int = 12) -> None:
    """Each node's logits from one tree forward == feeding its root-to-node path one token
    at a time (depth-first: feed a node, recurse into its children, roll back one slot)."""
    assert model.exactness.bit_exact, model.exactness.reason
    n = len(PARENTS)
    ids = tokens(prefix_len + n, seed=1, vocab=vocab)
    cache = prefill(model, ids[:, :prefix_len])
    node_tokens = ids[0, prefix_len:].tolist()
    mask = ancestor_mask(PARENTS)
    out = model.forward(ids[:, prefix_len:], (prefix_len + mask.sum(1) - 1)[None], cache, tree_mask=mask)
    cache.truncate(prefix_len)

    def visit(i: int) -> None:
        seq = feed_one_by_one(model, cache, [node_tokens[i]])[0]
        assert torch.equal(out.logits[0, i], seq), f"tree node {i} differs from its path"
        for child in (c for c, p in enumerate(PARENTS) if p == i):
            visit(child)
        cache.truncate(cache.length - 1)

    visit(0)
    assert cache.length == prefix_len


def has_isa(isa: str) -> bool:
    """Does this CPU (and the compiled runtime) run ``isa``?"""
    from verispec.models import cpu_abi

    try:
        return cpu_abi.isa_name(isa) == isa
    except (ValueError, OSError):  # OSError: the runtime is not built
        return False


def available_isas() -> list[str]:
    """The ISAs the compiled runtime runs here, scalar (the reference) first, widest last."""
    return [isa for isa in ("scalar", "avx2", "avx512") if has_isa(isa)]


def assert_batch_bitwise(model, vocab: int) -> None:
    """Three requests of one pool with different cache lengths (one past a 64-slot tile),
    rows given out of order, ragged ``num_tokens``: a padded batch prefill and a batched
    tree/chain verify give bitwise the logits and hidden states of each request run alone;
    padding is neither cached nor given logits; ``last_logits_only`` picks each row's last."""
    lengths, n_draft = [9, 70, 21], [3, 5, 4]
    pool = model.new_cache_pool(3, 128)
    caches = [pool.acquire() for _ in lengths]
    order = [2, 0, 1]  # batch row b serves request order[b]
    prompts = [tokens(n, seed=20 + i, vocab=vocab) for i, n in enumerate(lengths)]
    n = max(lengths)
    ids = torch.zeros(3, n, dtype=torch.long)
    for b, r in enumerate(order):
        ids[b, :lengths[r]] = prompts[r][0]
    pre = model.forward_batch(ids, torch.arange(n).expand(3, n), [caches[r] for r in order], want_hidden=True,
                              num_tokens=[lengths[r] for r in order])
    assert [c.length for c in caches] == lengths

    masks_by_req = [torch.ones(3, 3, dtype=torch.bool).tril(), ancestor_mask([-1, 0, 0, 1, 1]),
                    ancestor_mask([-1, 0, 1, 1])]
    drafts = torch.zeros(3, 5, dtype=torch.long)
    masks = torch.zeros(3, 5, 5, dtype=torch.bool)
    positions = torch.zeros(3, 5, dtype=torch.long)
    for b, r in enumerate(order):
        k = n_draft[r]
        drafts[b, :k] = tokens(k, seed=30 + r, vocab=vocab)[0]
        masks[b, :k, :k] = masks_by_req[r]
        positions[b, :k] = lengths[r] + masks_by_req[r].sum(1) - 1
    num_tokens = [n_draft[r] for r in order]
    out = model.forward_batch(drafts, positions, [caches[r] for r in order], masks, want_hidden=True,
                              num_tokens=num_tokens)
    assert [c.length for c in caches] == [a + b for a, b in zip(lengths, n_draft)]
    for c in caches:
        c.truncate(c.length - n_draft[caches.index(c)])
    last = model.forward_batch(drafts, positions, [caches[r] for r in order], masks, num_tokens=num_tokens,
                               last_logits_only=True)
    assert last.logits.shape == (3, 1, vocab)

    for b, r in enumerate(order):
        k, m = n_draft[r], lengths[r]
        assert torch.equal(pre.logits[b, m:], torch.zeros(n - m, vocab)), f"request {r}: padding has logits"
        single = model.new_cache(128)
        alone = model.forward(prompts[r], torch.arange(m)[None], single, want_hidden=True)
        assert torch.equal(pre.logits[b, :m], alone.logits[0]), f"request {r}: batched prefill differs"
        assert torch.equal(pre.hidden[b, :m], alone.hidden[0]), f"request {r}: batched prefill hidden differs"
        ref = model.forward(drafts[b:b + 1, :k], positions[b:b + 1, :k], single, masks[b, :k, :k], want_hidden=True)
        assert torch.equal(out.logits[b, :k], ref.logits[0]), f"request {r} differs in a batch"
        assert torch.equal(out.hidden[b, :k], ref.hidden[0]), f"request {r}: hidden differs in a batch"
        assert torch.equal(out.logits[b, k:], torch.zeros(5 - k, vocab)), f"request {r}: padding has logits"
        assert torch.equal(last.logits[b, 0], ref.logits[0, k - 1]), f"request {r}: last_logits_only differs"


def scenario(model, vocab: int, prompt_len: int = 70) -> list[torch.Tensor]:
    """A fixed sequence of forwards (prompt past a 64-slot tile, a tree verify, a chain step,
    a 2-row batch): every logits and hidden tensor it produced, for cross-ISA comparison."""
    ids = tokens(prompt_len + len(PARENTS), seed=40, vocab=vocab)
    cache = model.new_cache()
    outs = []
    o = model.forward(ids[:, :prompt_len], torch.arange(prompt_len)[None], cache, want_hidden=True)
    outs += [o.logits, o.hidden]
    mask = ancestor_mask(PARENTS)
    o = model.forward(ids[:, prompt_len:], (prompt_len + mask.sum(1) - 1)[None], cache, tree_mask=mask,
                      want_hidden=True)
    outs += [o.logits, o.hidden]
    cache.compact([prompt_len + i for i in path_to(PARENTS, 6)], prompt_len)
    o = model.forward(ids[:, -1:], torch.tensor([[cache.length]]), cache)
    outs.append(o.logits)
    pool = model.new_cache_pool(2, 128)
    caches = [pool.acquire(), pool.acquire()]
    o = model.forward_batch(ids[:, :6].expand(2, 6), torch.arange(6).expand(2, 6), caches, num_tokens=[6, 2])
    outs.append(o.logits)
    return outs


def assert_same_bits(ref: list[torch.Tensor], got: list[torch.Tensor], what: str) -> None:
    assert len(ref) == len(got)
    for i, (a, b) in enumerate(zip(ref, got)):
        assert torch.equal(a, b), f"{what}: output {i} differs (max abs {float((a - b).abs().max()):.3g})"


def runtime_dequant(fmt: str, blocks, rows: int, cols: int):
    """fp32 [rows, cols] numpy array: GGUF blocks of ``fmt`` as the compiled runtime reads them
    (``vs_test_dequant``: repacked into panels, then each row dequantized)."""
    import ctypes

    import numpy as np

    from verispec.models import cpu_abi

    lib = cpu_abi.library()
    fp = ctypes.POINTER(ctypes.c_float)
    lib.vs_test_dequant.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, fp, ctypes.c_char_p,
                                    ctypes.c_int)
    out = np.zeros((rows, cols), dtype=np.float32)
    err = ctypes.create_string_buffer(256)
    data = np.ascontiguousarray(blocks)
    assert lib.vs_test_dequant(cpu_abi.FORMATS[fmt].fmt.ggml_type, data.ctypes.data, rows, cols, out.ctypes.data_as(fp),
                               err, 256) == 0, err.value.decode()
    return out
