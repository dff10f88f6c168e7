"""Issue 14, end to end on stories260K (seconds): the on-policy corpus (batched, resumable,
greedy answers equal plain decoding), EAGLE-3's training-time test (equal to what chain
drafting computes), a training run (time-boxed, resumable), drafting with the trained
head (greedy equality vs plain decoding, chain and tree) and the exact sampling law of
EAGLE-3 drafting (chi-square, chain and tree)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers import law_pvalue, run, stories_eagle3
from verispec.drafters.base import NoDrafter
from verispec.drafters.eagle import Eagle3Head, EagleConfig, EagleDrafter, EagleHead
from verispec.engine import Engine
from verispec.registry import make_drafter
from verispec.sampling import target_probs
from verispec.train.corpus import (ROLE_ANSWER, ROLE_PROMPT, ConvSpec, CorpusConfig, corpus_specs, generate_corpus,
                                   read_corpus)
from verispec.train.eagle3 import Eagle3TrainOptions, train_eagle3, ttt_unroll
from verispec.train.loop import TrainConfig
from verispec.types import SamplingParams

pytestmark = pytest.mark.extended  # a longer check: out of make test, run by .ci/run (make test-extended)

CFG = CorpusConfig(batch=4, max_answer=16, max_user=8, shard_size=4, max_length=128)


def _specs(n: int) -> list[ConvSpec]:
    texts = ["Tom had a red ball.", "Once upon a time", "The cat sat", "Lily went to the park", "A big dog"]
    specs = [ConvSpec(f"p{i}", "text", texts[i % len(texts)] + " " * (i // len(texts)), 1, 0.0 if i % 2 else 0.8, i)
             for i in range(n)]
    return specs + [ConvSpec(f"m{i}", "magpie", None, 2, 0.0, 100 + i) for i in range(2)]


@pytest.fixture(scope="module")
def corpus(stories_native, tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus")
    generate_corpus(stories_native.backend, stories_native.tokenizer, _specs(10), out, CFG, progress=False,
                    log=lambda s: None)
    return out


def test_corpus_specs_mix_sources_and_temperatures():
    specs = corpus_specs([f"q{i}" for i in range(30)], 30, 30, seed=0)
    assert len({s.id for s in specs}) == len(specs) == 90
    assert [s.source == "magpie" for s in specs[:3]].count(True) == 1  # interleaved
    temps = [s.temperature for s in specs]
    assert 0.0 in temps and all(t == 0.0 or 0.7 <= t <= 1.0 for t in temps)
    assert {s.turns for s in specs} == {1, 2}


def test_corpus_greedy_answers_are_plain_decoding(stories_native, corpus):
    """Batched, ragged generation is on-policy: each greedy answer is the target's own
    plain greedy continuation of its prompt."""
    seqs = {s.id: s for s in read_corpus(corpus)}
    checked = 0
    for sid in ("p1", "p3", "p5"):
        s = seqs[sid]
        start = int(np.argmax(s.roles == ROLE_ANSWER))
        assert (s.roles[:start] == ROLE_PROMPT).all() and s.temperature == 0.0
        params = SamplingParams(max_new_tokens=len(s.tokens) - start)
        plain, _ = run(stories_native.backend, NoDrafter(), s.tokens[:start].tolist(), params)
        assert plain == s.tokens[start:].tolist()
        checked += 1
    assert checked == 3


def test_corpus_resumes_without_repeating(stories_native, corpus, tmp_path):
    rows = [json.loads(x) for x in (corpus / "manifest.jsonl").read_text().splitlines()]
    ids = [i for r in rows for i in r["ids"] + r["dropped"]]
    assert len(ids) == len(set(ids)) == 12  # every spec answered or dropped once
    # a run stopped by its token goal, then resumed: no id twice, more data
    first = generate_corpus(stories_native.backend, stories_native.tokenizer, _specs(6), tmp_path, CFG,
                            target_tokens=20, progress=False, log=lambda s: None)
    assert first["remaining_specs"] > 0
    generate_corpus(stories_native.backend, stories_native.tokenizer, _specs(6), tmp_path, CFG, progress=False,
                    log=lambda s: None)
    ids = [s.id for s in read_corpus(tmp_path)]
    assert len(ids) == len(set(ids)) and len(ids) > first["shards"]


def test_corpus_token_goal_counts_each_token_once(stories_native, tmp_path):
    """The goal counts stored answer tokens plus this run's new ones, each once (it used to
    count a finished row's tokens twice and stop at about half the goal), across a resume."""
    texts = [s for s in _specs(30) if s.source == "text"]
    first = generate_corpus(stories_native.backend, stories_native.tokenizer, texts, tmp_path, CFG,
                            target_tokens=100, progress=False, log=lambda s: None)
    assert 100 <= first["answer_tokens_total"] < 100 + CFG.batch * CFG.max_answer and first["remaining_specs"] > 0
    second = generate_corpus(stories_native.backend, stories_native.tokenizer, texts, tmp_path, CFG,
                             target_tokens=200, progress=False, log=lambda s: None)
    assert 200 <= second["answer_tokens_total"] < 200 + CFG.batch * CFG.max_answer


def _tiny_head(layers: tuple[int, ...], seed: int = 0) -> EagleHead:
    cfg = EagleConfig(hidden_size=16, intermediate_size=32, num_heads=4, num_kv_heads=2, head_dim=4, rms_norm_eps=1e-5,
                      rope_theta=10000.0, vocab_size=40, draft_vocab_size=40, hidden_layers=layers)
    torch.manual_seed(seed)
    head = (Eagle3Head if layers else EagleHead)(cfg)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return head.eval()


@pytest.mark.parametrize("layers", [(), (0, 1)], ids=["eagle", "eagle3"])
def test_ttt_unroll_equals_chain_drafting(layers):
    """Depth d at index j of the training-time test is exactly the d-th step of a chain
    drafted from the committed prefix 0..j-d+1 (true features), feeding the head its own
    outputs with its own keys (``EagleDrafter._step``)."""
    head = _tiny_head(layers)
    j, depth = 7, 4
    torch.manual_seed(1)
    feats = torch.randn(1, j, 16)
    embeds = torch.randn(1, j, 16)
    outs = ttt_unroll(head, feats, embeds, depth)
    with torch.no_grad():
        for end in range(j - depth + 1):  # committed prefix: indices 0..end
            pos = torch.arange(1, end + 2)[None]
            pred, (k, v) = head(feats[:, :end + 1], embeds[:, :end + 1], pos)
            x = pred[0, -1]
            torch.testing.assert_close(x, outs[0][0, end], atol=1e-5, rtol=1e-5)
            for d in range(2, depth + 1):
                idx = end + d - 1  # the draft at depth d reads token idx + 1 at position idx + 1
                mask = torch.ones(1, k.shape[2] + 1, dtype=torch.bool)
                out, (k1, v1) = head(x[None, None], embeds[:, idx:idx + 1], torch.tensor([[idx + 1]]), (k, v), mask)
                k, v = torch.cat([k, k1], 2), torch.cat([v, v1], 2)
                x = out[0, 0]
                torch.testing.assert_close(x, outs[d - 1][0, idx], atol=1e-5, rtol=1e-5)


def test_eagle3_train_then_draft_losslessly(stories_native, corpus, tmp_path):
    """Data -> a few EAGLE-3 steps (time-boxed, resumable) -> drafting with the trained head:
    greedy output equals plain decoding, chain and tree."""
    opts = Eagle3TrainOptions(hidden_layers=(0, 2, 4), seqs_per_step=2, max_len=32, depth=3, ce_positions=8,
                              draft_vocab_size=256)
    cfg = TrainConfig(steps=6, lr=3e-3, warmup=1, ckpt_every=2)
    info = train_eagle3(stories_native, corpus, tmp_path, cfg, opts, progress=False, eval_seqs=8, held_every=4, log=lambda s: None)
    assert info["steps_done"] == 6 and np.isfinite(info["final_loss"])
    assert set(info["held_out_after"]) >= {"top1_d1", "top1_d3"} and info["held_out_after"]["positions"] > 0
    head = EagleHead.load(tmp_path / "weights")
    assert isinstance(head, Eagle3Head) and head.cfg.hidden_layers == (0, 2, 4)
    # a run stopped by its time budget checkpoints, and resumes to the same step count
    short = train_eagle3(stories_native, corpus, tmp_path / "short", cfg, opts, progress=False, max_minutes=1e-6,
                         eval_seqs=2, held_every=4, log=lambda s: None)
    assert short["steps_done"] == 1
    resumed = train_eagle3(stories_native, corpus, tmp_path / "short", cfg, opts, resume=True, progress=False,
                           eval_seqs=2, held_every=4, log=lambda s: None)
    assert resumed["steps_done"] == 6
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    prompt = stories_native.tokenizer("Once upon a time")["input_ids"]
    plain, _ = run(stories_native.backend, NoDrafter(), prompt, params)
    for mode in ("chain", "tree"):
        drafter = make_drafter("eagle3", stories_native, {"weights": str(tmp_path / "weights"), "mode": mode,
                                                          "depth": "3", "top_k": "3"})
        assert isinstance(drafter, EagleDrafter) and drafter.features.layers == (0, 2, 4)
        spec, stats = run(stories_native.backend, drafter, prompt, params)
        assert spec == plain
        assert stats.drafted > 0


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_eagle3_sampling_law(stories_native, mode):
    """Sampled EAGLE-3 drafting keeps the target's law exactly (Leviathan et al. 2023):
    chains attach q (rejection sampling), trees are point masses (recursive rejection).
    The head favours t2, the likeliest token after the likeliest first token t1 (q(t2) ~
    0.5, p(t2 | t1) ~ 0.9, p(t2 | other) small): drafts are both accepted and rejected.
    Chi-square on token 1 (the prefill, which asks for the fused layers), on the pair
    (token 1, token 2) (token 2: the first speculative step) and on token 3 given (t1, t2)
    (that step's second node, or the next step); token 2's samples after t1 reject the
    law a wrong recovery gives (p resampled, not the residual)."""
    backend, prompt = stories_native.backend, [1, 67, 300]
    params = [SamplingParams(temperature=0.8, max_new_tokens=4, seed=s, ignore_eos=True) for s in range(400)]

    def law(context: list[int]) -> torch.Tensor:  # [V] the target's p(. | context)
        ids = torch.tensor([context])
        logits = backend.forward(ids, torch.arange(len(context))[None], backend.new_cache()).logits[0, -1:]
        return target_probs(logits, params[0])[0].double()

    p1 = law(prompt)
    heads = p1.topk(12).indices.tolist()  # the likeliest first tokens; the rest pooled in one cell
    p2 = {t: law(prompt + [t]) for t in heads}
    t1 = heads[0]
    t2 = int(p2[t1].argmax())
    engine = Engine(backend, stories_eagle3(stories_native, mode, favour=t2), 4)
    outs, first = [], []  # generated tokens; each first step's accepted count
    for p in params:
        req = engine.add_request(prompt, p)
        first.append(engine.step(req).num_accepted)
        while not req.finished:
            engine.step(req)
        outs.append(req.generated)
    assert min(first.count(0), len(first) - first.count(0)) >= 50  # both branches, often
    v = p1.numel()
    pairs = torch.cat([p1[t] * p2[t] for t in heads] + [1 - p1[heads].sum()[None]])  # [12 V + 1]
    cells = torch.tensor([heads.index(o[0]) * v + o[1] if o[0] in heads else len(heads) * v for o in outs])
    assert law_pvalue(torch.tensor([o[0] for o in outs]), p1) > 1e-3
    assert law_pvalue(cells, pairs) > 1e-3
    thirds = torch.tensor([o[2] for o in outs if o[:2] == [t1, t2]])
    assert len(thirds) >= 100
    assert law_pvalue(thirds, law(prompt + [t1, t2])) > 1e-3
    seconds = torch.tensor([o[1] for o in outs if o[0] == t1])
    wrong = (1 - p2[t1][t2]) * p2[t1] + p2[t1][t2] * torch.nn.functional.one_hot(torch.tensor(t2), v)
    assert law_pvalue(seconds, wrong) < 1e-3  # the test can tell


@pytest.mark.parametrize("backend", ["cpu", "native", "hf"])
def test_backends_return_asked_layers_without_changing_logits(tiny_dirs, backend):
    """``hidden_layers``: each asked layer's output residual stream, concatenated in the
    asked order (layer 0: transformers' ``hidden_states[1]``; the last layer: what the
    final norm reads); logits and final hidden states bit-identical to a forward that
    asks for none. transformers returns its last layer after the final norm: refused."""
    from verispec.models import cpu
    from verispec.models import cpu_abi
    from verispec.models.hf import HFCausalLM
    from verispec.models.native import NativeLlama

    if backend == "cpu" and not cpu_abi.available():
        pytest.skip("compiled runtime not built")
    path, hf = tiny_dirs["llama"]
    model = {"cpu": cpu.CpuLlama.from_hf_dir, "native": NativeLlama.from_hf_dir,
             "hf": lambda p: HFCausalLM(hf, "tiny")}[backend](path)
    ids = torch.tensor([[1, 45, 30, 12, 99, 7, 25]])
    pos = torch.arange(7)[None]
    plain = model.forward(ids, pos, model.new_cache(), want_hidden=True)
    if backend == "hf":
        with pytest.raises(ValueError, match="last layer"):
            model.forward(ids, pos, model.new_cache(), hidden_layers=(1,))
        layers = (0,)
    else:
        layers = (1, 0)
    out = model.forward(ids, pos, model.new_cache(), want_hidden=True, hidden_layers=layers)
    assert torch.equal(out.logits, plain.logits) and torch.equal(out.hidden, plain.hidden)
    assert plain.layers is None and out.layers.shape == (1, 7, len(layers) * 64)
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(out.layers[..., -64:], ref[1], atol=2e-3, rtol=1e-3)
    if len(layers) == 2:  # the last layer's output, normed by the final norm, is the hidden state
        from verispec.models.llama import rms_norm

        normed = rms_norm(out.layers[..., :64], hf.model.norm.weight.detach(), hf.config.rms_norm_eps)
        torch.testing.assert_close(normed, plain.hidden, atol=1e-2, rtol=1e-2)  # native: another op order
    with pytest.raises(ValueError, match="hidden_layers"):
        model.forward(ids, pos, model.new_cache(), hidden_layers=(2,))


def test_corpus_feeds_the_feature_trainers(stories_native, corpus, tmp_path):
    """A `train data` corpus is valid `--data` for the EAGLE / Medusa / draft trainers: its
    conversations, minus the id-hashed held-out ones, become teacher-forced feature shards,
    computed by the target's own backend in batched ragged forwards (each equal to the
    sequence's own forward); ``corpus_tokens`` keeps the corpus's first sequences only."""
    from verispec.train import feature_dirs
    from verispec.train.corpus import is_held_out, read_corpus
    from verispec.train.features import load

    (out,) = feature_dirs(stories_native, [corpus], tmp_path, log=lambda s: None)
    assert out == tmp_path / f"features-{corpus.name}"
    kept = [s.tokens.tolist() for s in read_corpus(corpus) if not is_held_out(s.id)]
    fs = load([out])
    assert [t.tolist() for t in fs.tokens] == kept and len(kept) > 1
    assert len({len(t) for t in kept}) > 1  # ragged rows were batched
    backend = stories_native.backend
    for ids, feats, argmax in zip(fs.tokens, fs.feats, fs.argmax):
        one = backend.forward(ids[None], torch.arange(len(ids))[None], backend.new_cache(), want_hidden=True)
        assert feats.shape == (len(ids), 64)
        torch.testing.assert_close(feats.float(), one.hidden[0].to(torch.bfloat16).float(), atol=2e-2, rtol=2e-2)
        assert (argmax == one.logits[0].argmax(-1)).float().mean() >= 0.95
    cap = sum(map(len, kept[:2]))
    (few,) = feature_dirs(stories_native, [corpus], tmp_path, log=lambda s: None, corpus_tokens=cap)
    assert few == tmp_path / f"features-{corpus.name}-{cap}"
    assert [t.tolist() for t in load([few]).tokens] == kept[:2]
    with pytest.raises(ValueError, match="shorter than"):
        feature_dirs(stories_native, [corpus], tmp_path, corpus_tokens=1)
