"""The agentic workload of `verispec bench` (-c agentic): the shipped sessions load, every
turn runs in order with the method's own answers in context, drafters that learn across
requests keep their state over turns and sessions (but forget the warm-up), and greedy
outputs equal plain decoding (stories260K through the CLI: seconds)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from verispec.bench.datasets import (AGENTIC, AGENTIC_CATEGORIES, ALL_GROUPS, BenchPrompt, agentic_path,
                                     load_agentic, load_prompts)
from verispec.bench.harness import PromptBuilder, run
from verispec.bench.runners import EngineRunner, Generation
from verispec.cli import app
from verispec.drafters.suffix_tree import SuffixDecodingDrafter
from verispec.drafters.token_recycling import TokenRecyclingDrafter
from verispec.types import SamplingParams


def test_the_workload_ships_and_loads_as_one_group():
    rows = [json.loads(line) for line in agentic_path().read_text().splitlines() if line.strip()]
    assert 8 <= len(rows) <= 16
    assert {r["category"] for r in rows} == set(AGENTIC_CATEGORIES)
    assert len({r["question_id"] for r in rows}) == len(rows)
    sessions = load_agentic()
    assert len(sessions) == len(rows) and all(len(s.turns) >= 4 for s in sessions)
    assert {s.category for s in sessions} == {AGENTIC}
    assert AGENTIC in ALL_GROUPS
    assert [s.question_id for s in load_prompts(None, (AGENTIC,), 3)] == [r["question_id"] for r in rows[:3]]
    first3 = {r["category"] for r in rows[:3]}
    assert first3 == set(AGENTIC_CATEGORIES)  # --limit 3 covers every kind of session
    with pytest.raises(ValueError, match="agentic"):
        load_prompts(None, ("poetry",), 1)


class _Learner:
    """A fake runner that counts warm-up resets."""

    def __init__(self, label):
        self.label, self.resets, self.calls = label, 0, 0

    def generate(self, prompt_ids, params):
        self.calls += 1
        return Generation((7,), "length", 0.1, 0.05, 2, 1, 0, 0, (), ())

    def reset_learned(self):
        assert self.calls == 1  # after the warm-up, before any measured generation
        self.resets += 1

    def memory_bytes(self):
        return 0


def test_warm_up_is_forgotten_then_state_is_kept_across_turns_and_sessions(toy_target):
    learner = _Learner("l")
    builder = PromptBuilder(lambda m: [len(m)], lambda ids: "x", 100)
    run([learner], [BenchPrompt(1, AGENTIC, ("a", "b", "c"))], builder, SamplingParams(max_new_tokens=2), warmup=1)
    assert learner.resets == 1 and learner.calls == 4

    suffix, recycling = SuffixDecodingDrafter(global_prompts=False), TokenRecyclingDrafter(toy_target.info.vocab_size)
    runners = [EngineRunner("suffix", toy_target, suffix, 8), EngineRunner("tr", toy_target, recycling, 8)]
    sessions = [BenchPrompt(i, AGENTIC, ("a", "b")) for i in range(2)]
    # each message is a few ids; a turn sees every earlier message (its own answers included)
    builder = PromptBuilder(lambda m: [1] + [3 + len(x["content"]) % 50 for x in m], lambda ids: "y" * len(ids), 100)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    run(runners, sessions, builder, params, warmup=1)
    assert len(suffix.global_trie.documents) == 4  # 2 sessions x 2 turns; the warm-up's answer is gone
    assert (recycling.adjacency >= 0).any()
    recycling.reset()
    assert not (recycling.adjacency >= 0).any()


@pytest.mark.parametrize("method", ["suffix", "token-recycling"])
def test_agentic_group_runs_every_turn_and_greedy_outputs_equal_the_baseline(tmp_path, method):
    out = tmp_path / "agentic"
    result = CliRunner().invoke(app, ["bench", "-c", "agentic", "--limit", "2", "--model", "stories260k",
                                      "-n", "12", "-m", method, "--output-dir", str(out), "--strict"])
    assert result.exit_code == 0, result.output
    records = json.loads((out / "results.json").read_text())["records"]
    turns = {s.question_id: len(s.turns) for s in load_agentic(2)}
    for label in ("none", method):
        mine = [r for r in records if r["method"] == label]
        assert {(r["question_id"], r["turn"]) for r in mine} == {(q, t) for q, n in turns.items() for t in range(n)}
        assert {r["category"] for r in mine} == {AGENTIC}
    base = {(r["question_id"], r["turn"]): r for r in records if r["method"] == "none"}
    for r in (r for r in records if r["method"] == method):
        ref = base[(r["question_id"], r["turn"])]
        assert r["prompt_ids"] == ref["prompt_ids"] and r["token_ids"] == ref["token_ids"]
    # a later turn's prompt holds the previous turn's answer (truncated prompts keep the latest tokens)
    later = [r for r in base.values() if r["turn"] > 0]
    assert all(len(r["prompt_ids"]) > 12 for r in later)
    assert sum(r["accepted"] for r in records if r["method"] == method) > 0


def test_bad_group_is_one_line_and_exit_2():
    result = CliRunner().invoke(app, ["bench", "-c", "agentic", "-c", "poetry"])
    assert result.exit_code == 2
    assert "unknown categories" in result.output and "agentic" in result.output
    assert "Traceback" not in result.output
