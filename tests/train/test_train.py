"""Training smoke tests on stories260k (seconds): features, the loop (loss decreases,
resume reproduces an uninterrupted run exactly), the trainers and the CLI command."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from verispec.train import features
from verispec.train.eagle import EagleTrainOptions, choose_draft_vocab, train_eagle
from verispec.train.loop import TrainConfig, lr_at, step_generator, train
from verispec.train.medusa import MedusaTrainOptions, train_medusa

SMALL_EAGLE = EagleTrainOptions(max_len=48, ce_positions=24, draft_vocab_size=256)


def test_features_shapes_and_resume(stories_native, stories_features, tmp_path):
    data = features.load([stories_features])
    assert len(data.tokens) == 12
    for t, f, a in zip(data.tokens, data.feats, data.argmax):
        assert f.shape == (len(t), 64) and a.shape == t.shape
    # the target's greedy continuation is its own argmax: a_i == x_{i+1} after the start
    assert torch.equal(data.argmax[0][4:-1], data.tokens[0][5:])
    shards = sorted(stories_features.glob("shard-*"))
    before = [p.stat().st_mtime_ns for p in shards]
    hf = AutoModelForCausalLM.from_pretrained(str(stories_native.hf_dir)).eval()
    features.extract(hf, [t.tolist() for t in data.tokens], stories_features, shard_size=4, log=lambda s: None)
    assert [p.stat().st_mtime_ns for p in shards] == before  # nothing recomputed


def test_lr_schedule_and_step_generators():
    cfg = TrainConfig(steps=50, lr=1.0, warmup=5)
    lrs = [lr_at(s, cfg) for s in range(50)]
    assert lrs[4] == 1.0 and all(a >= b for a, b in zip(lrs[4:], lrs[5:]))
    assert lrs[-1] == pytest.approx(0.1)
    a = torch.rand(3, generator=step_generator(0, 7))
    assert torch.equal(a, torch.rand(3, generator=step_generator(0, 7)))
    assert not torch.equal(a, torch.rand(3, generator=step_generator(0, 8)))
    with pytest.raises(ValueError):
        TrainConfig(steps=0)


def test_choose_draft_vocab_prefers_frequent_tokens(stories_features):
    data = features.load([stories_features])
    vocab = choose_draft_vocab(data, 32, 512)
    assert len(vocab) == 32 and torch.equal(vocab, vocab.sort().values)
    counts = torch.bincount(torch.cat(data.tokens + data.argmax), minlength=512)
    assert counts[vocab].min() >= counts[~torch.isin(torch.arange(512), vocab)].max()


def test_eagle_training_loss_decreases(stories_native, stories_features, tmp_path):
    cfg = TrainConfig(steps=24, lr=3e-3, warmup=2, ckpt_every=8)
    head, result, metrics = train_eagle(stories_native.hf_dir, [stories_features], tmp_path, cfg, SMALL_EAGLE, progress=False)
    first, last = sum(result.losses[:4]) / 4, sum(result.losses[-4:]) / 4
    assert last < 0.8 * first, result.losses
    assert (tmp_path / "weights" / "model.safetensors").exists() and 0 <= metrics["top1"] <= 1


class _Interrupt(Exception):
    pass


def test_resume_reproduces_an_uninterrupted_run(tmp_path):
    """Crash after the step-4 checkpoint, resume, and compare with a straight run."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    cfg = TrainConfig(steps=8, lr=1e-2, warmup=2, ckpt_every=4)

    def make():
        torch.manual_seed(1)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def loss_fn(model, gen):
        idx = torch.randint(0, 64, (16,), generator=gen)
        return torch.nn.functional.mse_loss(model(x[idx]), y[idx]), {}

    straight = make()
    full = train(straight, loss_fn, cfg, tmp_path / "a", progress=False)

    calls = []

    def crashing(model, gen):
        calls.append(1)
        if len(calls) == 6:
            raise _Interrupt
        return loss_fn(model, gen)

    with pytest.raises(_Interrupt):
        train(make(), crashing, cfg, tmp_path / "b", progress=False)
    resumed_model = make()
    resumed = train(resumed_model, loss_fn, cfg, tmp_path / "b", resume=True, progress=False)
    assert resumed.losses == full.losses
    for a, b in zip(straight.state_dict().values(), resumed_model.state_dict().values()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="written with"):
        train(make(), loss_fn, TrainConfig(steps=9, lr=1e-2, warmup=2, ckpt_every=4), tmp_path / "b",
              resume=True, progress=False)


def test_eagle_resume_matches_uninterrupted(stories_native, stories_features, tmp_path):
    cfg = TrainConfig(steps=6, lr=3e-3, warmup=2, ckpt_every=2)
    h1, r1, _ = train_eagle(stories_native.hf_dir, [stories_features], tmp_path / "a", cfg, SMALL_EAGLE, progress=False)
    _, part, _ = train_eagle(stories_native.hf_dir, [stories_features], tmp_path / "b", cfg, SMALL_EAGLE, progress=False, stop_at=3)
    assert part.steps == 3
    h2, r2, _ = train_eagle(stories_native.hf_dir, [stories_features], tmp_path / "b", cfg, SMALL_EAGLE, resume=True,
                            progress=False)
    assert r2.losses == r1.losses
    for a, b in zip(h1.state_dict().values(), h2.state_dict().values()):
        assert torch.equal(a, b)


def test_medusa_training_loss_decreases(stories_native, stories_features, tmp_path):
    cfg = TrainConfig(steps=24, lr=3e-3, warmup=2, ckpt_every=8)
    heads, result, metrics = train_medusa(stories_native.hf_dir, [stories_features], tmp_path, cfg,
                                          MedusaTrainOptions(num_heads=2, draft_vocab_size=256), progress=False)
    assert sum(result.losses[-4:]) < 0.8 * sum(result.losses[:4]), result.losses
    assert heads.rank_acc.shape == (2, 10) and heads.rank_acc.sum() > 0


def test_cli_train_command(stories_features, tmp_path):
    from typer.testing import CliRunner

    from verispec.cli import app

    res = CliRunner().invoke(app, ["train", "eagle", "--model", "stories260k", "--data", str(stories_features),
                                   "--steps", "2", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "weights" / "config.json").exists()
    res = CliRunner().invoke(app, ["train", "draft", "--model", "stories260k", "--data", str(stories_features),
                                   "--steps", "2", "--layers", "0,1", "--out", str(tmp_path / "draft")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "draft" / "weights" / "model.safetensors").exists()
    for bad, word in ((["--layers", "0,9"], "layer"), (["--layers", "a"], "layer"),
                      (["--init", str(tmp_path / "missing")], "draft weights"),
                      (["--init", str(tmp_path / "draft" / "weights"), "--layers", "0"], "layers"),
                      (["--warmup", "-1"], "warmup")):
        res = CliRunner().invoke(app, ["train", "draft", "--model", "stories260k", "--data", str(stories_features),
                                       "--steps", "2", *bad, "--out", str(tmp_path / "bad")])
        assert res.exit_code != 0 and "Traceback" not in res.output and word in res.output, (bad, res.output)
    bad = CliRunner().invoke(app, ["train", "nope", "--model", "stories260k", "--data", str(stories_features),
                                   "--steps", "2", "--out", str(tmp_path)])
    assert bad.exit_code == 2
