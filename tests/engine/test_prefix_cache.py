"""Prefix cache across requests (engine/prefix_cache.py).

Unit: block matching (exact keys, the last prompt token always prefilled), LRU order and
leaf-first eviction under a byte budget, counters, integrity. Backend: the compiled CPU
runtime's slot copies across 64-slot tiles, and a prefill split into a reused prefix + the
rest giving bitwise the K/V and logits of one forward (and the native runtime, where it does
not: there the cache stays off). Engine: with and without the cache, multi-turn chains and
eviction under a tiny budget give the same tokens and bitwise the same logits, greedy and
sampled, with every drafter kind (EAGLE and EAGLE-3 too: blocks keep the target features
hidden-state drafters read, so they draft exactly as without the cache); drafters still see
the whole prompt.
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers import RandomDrafter, Recorder, random_eagle_head
from tiny_models import VOCAB, tokens
from verispec.drafters.base import NoDrafter
from verispec.drafters.prompt_lookup import PromptLookupDrafter
from verispec.drafters.suffix_tree import SuffixDecodingDrafter
from verispec.engine import Engine
from verispec.engine.prefix_cache import PrefixCache, prefix_cache_support
from verispec.models import cpu_abi, cpu_cache
from verispec.types import SamplingParams

cpu = pytest.importorskip("verispec.models.cpu")
if not cpu_abi.available():
    pytest.skip("the compiled runtime verispec._vscpu is not built", allow_module_level=True)

B = 16  # block size under test


# ----------------------------------------------------------------------------- unit (fake cache)


class ListCache:
    """A KV cache whose 'K/V' of a slot is the slot's token id: enough to see what was reused."""

    def __init__(self, tokens: list[int] | None = None):
        self.kv = list(tokens or [])

    @property
    def length(self) -> int:
        return len(self.kv)

    def read_kv(self, start: int, n: int):
        assert start + n <= self.length
        return (torch.tensor(self.kv[start:start + n], dtype=torch.float32),)

    def append_kv(self, kv, n: int) -> None:
        assert kv[0].numel() == n
        self.kv += [int(x) for x in kv[0].tolist()]


BLOCK_BYTES = B * 4  # ListCache: one float32 per slot


def test_longest_prefix_is_reused_and_last_token_prefilled():
    pc = PrefixCache(max_bytes=100 * BLOCK_BYTES, block_size=B)
    seq = list(range(100, 150))  # 50 tokens: 3 full blocks
    pc.store(seq, ListCache(seq))
    assert pc.stats.blocks == 3 and pc.stats.bytes == 3 * BLOCK_BYTES
    for prompt, want in [(seq, 48),  # 3 blocks, 2 tokens left to prefill
                         (seq[:48], 32),  # the last token is always prefilled: 2 blocks
                         (seq[:49], 48),
                         (seq[:40] + [7] * 20, 32),  # diverges inside block 3
                         ([0] + seq, 0),  # same tokens, shifted: other keys
                         (seq[:15], 0)]:
        assert pc.cached_length(prompt) == want  # a look that counts nothing
        cache = ListCache()
        assert pc.restore(prompt, cache) == want
        assert cache.kv == prompt[:want]
    s = pc.stats
    assert (s.queries, s.hits, s.reused_tokens) == (6, 4, 48 + 32 + 48 + 32)
    assert s.query_tokens == 50 + 48 + 49 + 60 + 51 + 15
    assert s.hit_rate == pytest.approx(s.reused_tokens / s.query_tokens)
    pc.check_integrity()


def test_a_block_is_keyed_by_everything_before_it():
    pc = PrefixCache(max_bytes=100 * BLOCK_BYTES, block_size=B)
    a, b, tail = [1] * B, [2] * B, [9] * B
    pc.store(a + tail, ListCache(a + tail))
    pc.store(b + tail, ListCache(b + tail))  # same tail tokens after another block: its own K/V
    assert pc.stats.blocks == 4
    cache = ListCache()
    assert pc.restore(b + tail + [5], cache) == 2 * B and cache.kv == b + tail
    pc.store(a + tail, ListCache(a + tail))  # known blocks are not copied again
    assert pc.stats.stored_blocks == 4
    pc.check_integrity()


def test_lru_eviction_is_leaf_first_under_the_budget():
    pc = PrefixCache(max_bytes=4 * BLOCK_BYTES, block_size=B)
    root, x, y = [1] * B, [2] * B, [3] * B
    pc.store(root + x, ListCache(root + x))  # root, root/x
    pc.store(root + y, ListCache(root + y))  # root/y: 3 blocks
    pc.restore(root + x + [0], ListCache())  # x is now more recent than y
    z = [4] * B
    pc.store(root + z + z, ListCache(root + z + z))  # 5 blocks > 4: evict the oldest leaf, y
    pc.check_integrity()
    assert pc.stats.blocks == 4 and pc.stats.evicted_blocks == 1
    assert pc.restore(root + y + [0], ListCache()) == B  # root only
    assert pc.restore(root + x + [0], ListCache()) == 2 * B
    assert pc.restore(root + z + z + [0], ListCache()) == 3 * B
    # a tiny budget keeps evicting (never a parent before its children) and stays consistent
    small = PrefixCache(max_bytes=2 * BLOCK_BYTES, block_size=B)
    for i in range(6):
        seq = root + [10 + i] * (B * (i % 3 + 1))
        small.store(seq, ListCache(seq))
        small.check_integrity()
        assert small.stats.bytes <= 2 * BLOCK_BYTES
    small.clear()
    assert small.stats.blocks == 0 and small.restore(root + [0], ListCache()) == 0


def test_bad_arguments():
    with pytest.raises(ValueError):
        PrefixCache(max_bytes=0)
    with pytest.raises(ValueError):
        PrefixCache.from_mb(-1)
    assert PrefixCache.from_mb(0) is None and PrefixCache.from_mb(None) is None
    assert PrefixCache.from_mb(1).max_bytes == 2**20
    pc = PrefixCache(max_bytes=10 * BLOCK_BYTES, block_size=B)
    with pytest.raises(ValueError, match="empty cache"):
        pc.restore([1] * 40, ListCache([1]))
    with pytest.raises(ValueError, match="cached slots"):
        pc.store([1] * 40, ListCache([1] * 39))
    pc.bind("model a")
    with pytest.raises(ValueError, match="another model"):
        pc.bind("model b")


# ----------------------------------------------------------------------------- the compiled backend


@pytest.fixture(scope="module")
def load(tiny_dirs):
    models = {}

    def get(kind: str = "llama", quant: str = "f32") -> cpu.CpuLlama:
        if (kind, quant) not in models:
            models[kind, quant] = cpu.CpuLlama.from_hf_dir(tiny_dirs[kind][0], max_length=512, quant=quant, threads=2)
        return models[kind, quant]

    return get


def test_tile_spans_example():
    assert cpu_cache._tile_spans(60, 8) == [(0, 60, 64, 0), (1, 0, 4, 4)]
    assert cpu_cache._tile_spans(0, 16) == [(0, 0, 16, 0)]
    assert cpu_cache._tile_spans(32, 170) == [(0, 32, 64, 0), (1, 0, 64, 32), (2, 0, 64, 96), (3, 0, 10, 160)]


@pytest.mark.parametrize("kind", ["llama", "qwen2-bias"])
@pytest.mark.parametrize("quant", ["f32", "q8_0"])  # fp32 and fp16 K/V
def test_split_prefill_is_one_prefill_bitwise(load, kind, quant):
    """K/V copied out (across a tile edge) and into another pool's row, then the rest of the
    prompt: the logits and every K/V slot equal those of one prefill of the whole prompt."""
    model = load(kind, quant)
    ids = tokens(150, seed=3)
    whole = model.new_cache_pool(1, 256).acquire()
    ref = model.forward(ids, torch.arange(150)[None], whole).logits[0]
    src = model.new_cache(256)
    model.forward(ids[:, :100], torch.arange(100)[None], src)
    pool = model.new_cache_pool(3, 512)
    pool.acquire()
    dst = pool.acquire()  # row 1 of 3, a different slot count: layouts must not matter
    for start in (0, 48):  # the second copy crosses the 64-slot tile edge
        dst.append_kv(src.read_kv(start, 48), 48)
    assert dst.length == 96
    rest = model.forward(ids[:, 96:], torch.arange(96, 150)[None], dst).logits[0]
    assert torch.equal(rest, ref[96:])
    for a, b in zip(whole.read_kv(0, 150), dst.read_kv(0, 150)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="not all cached"):
        dst.read_kv(140, 16)
    assert model.prefix_reuse_exact and prefix_cache_support(model) is None


def test_native_runtime_keeps_the_cache_off(tiny_dirs):
    """The native runtime's long prefill takes a fast path whose rounding depends on the
    forward: a split prefill is not bitwise one prefill there, so the engine reuses nothing."""
    from verispec.models.native import NativeLlama

    model = NativeLlama.from_hf_dir(tiny_dirs["llama"][0], dtype=torch.float32)
    assert not model.prefix_reuse_exact and "does not prefill bitwise" in prefix_cache_support(model)
    engine = Engine(model, NoDrafter(), 4, prefix_cache=PrefixCache(1 << 20))
    assert engine.prefix_cache is None
    ids = tokens(150, seed=4)
    one = model.forward(ids, torch.arange(150)[None], model.new_cache()).logits[0, -1]
    split = model.new_cache()
    model.forward(ids[:, :96], torch.arange(96)[None], split)
    two = model.forward(ids[:, 96:], torch.arange(96, 150)[None], split).logits[0, -1]
    assert torch.allclose(one, two, atol=1e-4)  # close, but not claimed equal (see docstring)


def test_transformers_backend_keeps_the_cache_off(toy_target):
    assert "does not prefill bitwise" in prefix_cache_support(toy_target)
    assert Engine(toy_target, NoDrafter(), 4, prefix_cache=PrefixCache(1 << 20)).prefix_cache is None


# ----------------------------------------------------------------------------- engine


def conversation(model, drafter_factory, turns: list[list[int]], params: SamplingParams,
                 prefix_cache: PrefixCache | None, k: int = 6):
    """Turn t's prompt = everything so far (prompts and answers) + turns[t]. Returns
    (answers, logits of every forward, cached tokens per turn)."""
    rec = Recorder(model)
    engine = Engine(rec, drafter_factory(), k, prefix_cache=prefix_cache)
    history, answers, cached = [], [], []
    for t, user in enumerate(turns):
        history += user
        req = engine.add_request(history, params, f"turn-{t}")
        while not req.finished:
            engine.step(req)
        engine.finish(req, req.finished)
        answers.append(req.generated)
        cached.append(req.stats.cached_tokens)
        history += req.generated
        if prefix_cache is not None:
            prefix_cache.check_integrity()
    return answers, rec.logits, cached


TURNS = [tokens(40, seed=10)[0].tolist(), tokens(23, seed=11)[0].tolist(), tokens(9, seed=12)[0].tolist(),
         tokens(30, seed=13)[0].tolist()]
def _eagle(layers: tuple[int, ...], mode: str):
    """An EAGLE (no layers) or EAGLE-3 drafter with a random head, on the compiled runtime."""
    from verispec.drafters.eagle import EagleDrafter
    from verispec.drafters.eagle_runner import CompiledHeadRunner

    head, embed = random_eagle_head(layers, seed=3, vocab=VOCAB, draft_vocab=96), torch.randn(VOCAB, 64, generator=torch.Generator().manual_seed(4)) * 3
    return lambda: EagleDrafter(head, embed, mode=mode, depth=3, top_k=3,
                                runner=CompiledHeadRunner(head, embed, 512, quant="q8_0", max_draft=16))


DRAFTERS = {"none": NoDrafter, "pld": lambda: PromptLookupDrafter(max_ngram=3),
            "suffix": SuffixDecodingDrafter, "random-tree": lambda: RandomDrafter(VOCAB, seed=1, tree=True),
            "eagle-chain": _eagle((), "chain"), "eagle3-tree": _eagle((0, 1), "tree")}


@pytest.mark.parametrize("drafter", list(DRAFTERS))
@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=30, ignore_eos=True),
                                    SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=30, seed=5,
                                                   ignore_eos=True)], ids=["greedy", "sampled"])
def test_multi_turn_with_and_without_cache_bitwise(load, drafter, params):
    model = load()
    plain = conversation(model, DRAFTERS[drafter], TURNS, params, None)
    pc = PrefixCache(max_bytes=1 << 30, block_size=B)
    cached = conversation(model, DRAFTERS[drafter], TURNS, params, pc)
    assert cached[0] == plain[0]
    assert len(cached[1]) == len(plain[1]) and all(torch.equal(a, b) for a, b in zip(cached[1], plain[1]))
    # turn t reuses what turn t-1 cached: its prompt and answer but the newest token
    history, expect = 0, [0]
    for t in range(1, len(TURNS)):
        known = history + len(TURNS[t - 1]) + len(plain[0][t - 1]) - 1
        history += len(TURNS[t - 1]) + len(plain[0][t - 1])
        expect.append(min(known, history + len(TURNS[t]) - 1) // B * B)
    assert cached[2] == expect and plain[2] == [0] * len(TURNS)
    assert pc.stats.reused_tokens == sum(expect) and pc.stats.hits == len(TURNS) - 1
    if drafter.startswith("eagle"):  # the features came with the K/V, and the head drafted from them
        assert all(b.hidden is not None for b in pc._blocks.values())


def test_features_are_kept_and_matched_by_tag():
    """Blocks keep the features given for the tokens they cover; a lookup with a tag reuses
    only blocks with features of that tag (and returns them), one without a tag any block."""
    pc = PrefixCache(max_bytes=100 * BLOCK_BYTES, block_size=B)
    seq = list(range(3 * B + 5))
    feats = torch.arange(len(seq) * 2, dtype=torch.float32).view(-1, 2)
    pc.store(seq, ListCache(seq), feats[:2 * B + 3], "last")  # features cover 2 blocks of 3
    n, got = pc.restore_with_hidden(seq + [0], ListCache(), "last")
    assert n == 2 * B and torch.equal(got, feats[:2 * B])
    assert pc.restore_with_hidden(seq + [0], ListCache(), "layers 0,1") == (0, None)
    assert pc.restore(seq + [0], ListCache()) == 3 * B
    pc.store(seq, ListCache(seq), feats, "layers 0,1")  # other features replace them
    n, got = pc.restore_with_hidden(seq + [0], ListCache(), "layers 0,1")
    assert n == 3 * B and torch.equal(got, feats[:3 * B])
    pc.check_integrity()
    assert pc.stats.bytes == 3 * BLOCK_BYTES + feats[:3 * B].numel() * 4
    with pytest.raises(ValueError, match="hidden_tag"):
        pc.store(seq, ListCache(seq), feats, None)


def test_eviction_under_a_tiny_budget_keeps_outputs(load):
    model = load("qwen2-bias", "q8_0")
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = conversation(model, SuffixDecodingDrafter, TURNS, params, None)
    block_bytes = 2 * model.args.n_layers * model.args.n_kv_heads * model.args.head_dim * B * 2  # K+V, fp16
    pc = PrefixCache(max_bytes=3 * block_bytes, block_size=B)
    cached = conversation(model, SuffixDecodingDrafter, TURNS, params, pc)
    assert cached[0] == plain[0] and all(torch.equal(a, b) for a, b in zip(cached[1], plain[1]))
    s = pc.stats
    assert s.evicted_blocks > 0 and s.blocks <= 3 and 0 < s.reused_tokens <= 3 * B * (len(TURNS) - 1)


def test_drafters_see_the_whole_prompt(load):
    seen = {}

    class Spy(NoDrafter):
        def start(self, request_id, prompt_ids):
            seen[request_id] = list(prompt_ids)

    model = load()
    engine = Engine(model, Spy(), 4, prefix_cache=PrefixCache(1 << 30, B))
    prompt = tokens(50, seed=2)[0].tolist()
    for rid in ("a", "b"):
        req = engine.add_request(prompt, SamplingParams(max_new_tokens=3), rid)
        engine.finish(req, "stop")
    assert seen == {"a": prompt, "b": prompt} and req.stats.cached_tokens == 48


def test_batch_engine_shares_one_cache_and_frees_every_row(load):
    """Requests sharing a system prompt, joining mid-flight in batched forwards, reuse each
    other's prefix and give the tokens of plain decoding alone; afterwards no row is held."""
    from verispec.engine.batch import BatchEngine, SpecSchedule

    model = load()
    system = tokens(40, seed=7)[0].tolist()
    prompts = [system + tokens(5 + 7 * i, seed=30 + i)[0].tolist() for i in range(5)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    plain = Engine(model, NoDrafter(), 1)
    refs = []
    for p in prompts:
        req = plain.add_request(p, params)
        while not req.finished:
            plain.step(req)
        refs.append(req.generated)
    pc = PrefixCache(1 << 30, B)
    engines = {"pl": Engine(model, PromptLookupDrafter(), 4, prefix_cache=pc),
               "none": Engine(model, NoDrafter(), 1, prefix_cache=pc)}
    be = BatchEngine(model, engines, max_batch=3, max_length=128, schedule=SpecSchedule("budget", 0))
    assert be.prefix_cache is pc
    running, done, pending = [], {}, list(enumerate(prompts))
    while pending or running:
        if pending and be.free_slots:
            i, p = pending.pop(0)
            running.append((i, be.add_request(f"r{i}", p, params, "pl" if i % 2 else "none")))
        step = be.step([r for _, r in running])
        assert not any(isinstance(x, Exception) for x in step.results), step.results
        for i, r in list(running):
            if r.finished:
                done[i] = (r.generated, r.stats.cached_tokens)
                be.release(r)
                running.remove((i, r))
    assert [done[i][0] for i in range(5)] == refs
    assert [done[i][1] for i in range(5)] == [0] + [32] * 4  # the system prompt's 2 full blocks
    assert be.cache_rows_in_use == 0 and be.free_slots == 3
    pc.check_integrity()
    with pytest.raises(ValueError, match="share one prefix cache"):
        BatchEngine(model, {"a": Engine(model, NoDrafter(), 1, prefix_cache=PrefixCache(1 << 20)),
                            "b": Engine(model, NoDrafter(), 1)}, max_batch=2, max_length=128)


# ----------------------------------------------------------------------------- server


@pytest.fixture(scope="module")
def tiny_cpu_model(tmp_path_factory):
    """A tiny random Llama on the compiled runtime with stories260K's tokenizer (vocab 512)."""
    import dataclasses

    from transformers import LlamaConfig, LlamaForCausalLM

    from verispec.api import load_model

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2)
    path = tmp_path_factory.mktemp("tiny-cpu")
    LlamaForCausalLM(cfg).save_pretrained(path)
    stories = load_model("stories260k", backend="native")
    backend = cpu.CpuLlama.from_hf_dir(path, max_length=512, threads=2)
    model = dataclasses.replace(stories, name="tiny-cpu", backend=backend,
                                choice=dataclasses.replace(stories.choice, backend="cpu"))
    model.__dict__["hf_dir"] = path  # LoadedModel.hf_dir is a cached property
    return model


def test_server_reuses_prefixes_reports_them_and_returns_to_idle(tiny_cpu_model):
    """Multi-turn style requests (each extends the last) and concurrent repeats: the same text
    as a server without the cache; /metrics counts the reused tokens, and every cache row is
    free again afterwards."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from serving import metrics, running_server, wait_until

    base = "Once upon a time there was a little girl named Lily. She liked to play in the park with her dog. "
    prompts = [base, base + "One day", base + "One day she found a shiny red ball under a big tree."]

    def ask(url: str, prompt: str) -> dict:
        r = httpx.post(f"{url}/v1/completions", timeout=120,
                       json={"model": "tiny-cpu", "prompt": prompt, "max_tokens": 20, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()

    texts = {}
    for mb in (0, 64):
        with running_server(tiny_cpu_model, "tiny-cpu", prefix_cache_mb=mb) as (url, state, _):
            outs = [ask(url, p) for p in prompts]
            with ThreadPoolExecutor(3) as pool:
                outs += list(pool.map(lambda p: ask(url, p), prompts))
            texts[mb] = [o["choices"][0]["text"] for o in outs]
            cached = [o["verispec"]["cached_tokens"] for o in outs]
            assert [o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in outs] == cached  # OpenAI's field
            wait_until(lambda: metrics(url)["verispec_requests_running"] == 0)
            m = metrics(url)
            assert m["verispec_cache_rows_in_use"] == 0 and state.worker.engine.cache_rows_in_use == 0
            assert m["verispec_prefix_cache_enabled"] == (mb > 0)
            assert m["verispec_prefix_cache_hits_total"] == sum(cached)
            if mb:
                assert cached[0] == 0 and all(c >= 16 for c in cached[1:])
                assert m["verispec_prefix_cache_queries_total"] == sum(o["usage"]["prompt_tokens"] for o in outs)
                assert 0 < m["verispec_prefix_cache_hit_rate"] < 1 and m["verispec_prefix_cache_blocks"] > 0
                assert 0 < m["verispec_prefix_cache_bytes"] <= m["verispec_prefix_cache_max_bytes"] == 64 * 2**20
                r = httpx.post(f"{url}/v1/completions", timeout=120, json={
                    "model": "tiny-cpu", "prompt": prompts[2], "max_tokens": 4, "stream": True,
                    "stream_options": {"include_usage": True}})
                usage = [line for line in r.text.splitlines() if line.startswith('data: {"id"')][-1]
                assert '"prompt_tokens_details":{"cached_tokens":' in usage and '"cached_tokens":0}' not in usage
            else:
                assert cached == [0] * 6
    assert texts[0] == texts[64]


# ----------------------------------------------------------------------------- API, CLI, bench


def test_spec_decoder_reuses_across_calls(tiny_cpu_model):
    """The Python API: a second call that extends the first prompt reuses it (default on);
    ``prefix_cache_mb=0`` turns it off, with the same text."""
    from verispec.api import SpecDecoder

    prompt = "Once upon a time there was a little girl named Lily. She liked to play in the park. " * 2
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    outs = {}
    for mb in (0, 8):
        dec = SpecDecoder(tiny_cpu_model, "prompt-lookup", prefix_cache_mb=mb)
        first = dec.generate(prompt, params, chat=False)
        again = dec.generate(prompt + first.text + " The end.", params, chat=False)
        outs[mb] = (first.text, again.text, again.stats.cached_tokens)
    assert outs[0][:2] == outs[8][:2] and outs[0][2] == 0 and outs[8][2] >= 32


def test_cli_flags_and_stats(tiny_cpu_model):
    from typer.testing import CliRunner

    from verispec.cli import app
    from verispec.cli.common import PREFIX_CACHE_MB
    from verispec.engine.prefix_cache import DEFAULT_MAX_MB

    assert PREFIX_CACHE_MB == DEFAULT_MAX_MB
    runner = CliRunner()
    r = runner.invoke(app, ["generate", "--model", "stories260k", "-n", "4", "--json", "Hello"])
    assert r.exit_code == 0, r.output
    stats = json.loads(r.stdout)["stats"]
    assert stats["cached_tokens"] == 0 and stats["prefix_cache"].startswith("off: NativeLlama")
    r = runner.invoke(app, ["generate", "--model", "stories260k", "-n", "4", "--json", "--prefix-cache-mb", "0", "Hi"])
    assert json.loads(r.stdout)["stats"]["prefix_cache"] == "off"
    for bad in ("-1", "nan", "inf"):
        r = runner.invoke(app, ["generate", "--model", "stories260k", "-n", "4", "--prefix-cache-mb", bad, "Hi"])
        assert r.exit_code == 2 and "prefix cache size" in r.output, r.output


def test_bench_runner_reuses_its_own_turns_and_forgets_the_warm_up(tiny_cpu_model):
    from verispec.bench.runners import EngineRunner

    runner = EngineRunner("none", tiny_cpu_model.backend, NoDrafter(), 1, prefix_cache_mb=16)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    prompt = tokens(40, seed=1)[0].tolist()
    g1 = runner.generate(prompt, params)
    g2 = runner.generate(prompt + list(g1.token_ids) + [5, 6, 7], params)
    assert (g1.cached_tokens, g2.cached_tokens) == (0, 32) and g2.target_forwards == 8
    runner.reset_learned()
    assert runner.generate(prompt, params).cached_tokens == 0
