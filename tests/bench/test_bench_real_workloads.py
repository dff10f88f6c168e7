"""The workloads built from real material (issue 34): edit, agent, fim ship, load and name their
sources; the harness replays agent sessions turn by turn from the recorded history (the prefix
cache reusing it, the suffix drafter drafting from it and from other sessions) with greedy output
equal to plain decoding; edits send their prediction only to methods that take one; FIM items go
through the model's FIM prompt; bad rows are refused naming file and line."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from verispec.bench.datasets import (AGENT, EDIT, FIM, REAL_WORKLOADS, BenchPrompt, load_prompts, load_workload,
                                     workload_path)
from verispec.bench.harness import PromptBuilder, run
from verispec.bench.runners import EngineRunner
from verispec.cli import app
from verispec.drafters.base import NoDrafter
from verispec.drafters.suffix_tree import SuffixDecodingDrafter
from verispec.engine.prefix_cache import DEFAULT_BLOCK_SIZE
from verispec.types import SamplingParams

cpu = pytest.importorskip("verispec.models.cpu")


def test_workloads_ship_with_their_sources():
    for name in REAL_WORKLOADS:
        rows = [json.loads(line) for line in workload_path(name).read_text().splitlines() if line.strip()]
        assert 8 <= len(rows) <= 60 and len({r["question_id"] for r in rows}) == len(rows)
        assert all(r["source"]["license"] and r["source"]["repository"].startswith("https://github.com/")
                   for r in rows)
    edits = load_workload(EDIT)
    assert all(e.prediction and e.prediction in e.turns[0] for e in edits)  # the code is in the prompt too
    sessions = load_workload(AGENT)
    assert sum(s.num_turns for s in sessions) >= 30 and all(s.messages[0]["role"] == "system" for s in sessions)
    assert all(s.messages[i - 1]["role"] == "user" for s in sessions for i in s.replayed)
    fims = load_workload(FIM, 3)
    assert len(fims) == 3 and all(f.fim and f.num_turns == 1 for f in fims)
    assert [p.category for p in load_prompts(None, (EDIT, FIM), 2)] == [EDIT, EDIT, FIM, FIM]


def test_bad_rows_are_refused(tmp_path, monkeypatch):
    from verispec.bench import datasets

    bad = tmp_path / "agent.jsonl"
    bad.write_text(json.dumps({"question_id": "x", "category": "agent",
                               "messages": [{"role": "system", "content": "s"}, {"role": "tool", "content": "t"}]}))
    monkeypatch.setattr(datasets, "workload_path", lambda name: bad)
    with pytest.raises(ValueError, match="line 1"):
        load_workload(AGENT)


def _encode(messages) -> list[int]:
    """A stand-in chat template over a 96-token vocabulary: role marker, then the content's characters."""
    out = [1]
    for m in messages:
        out += [2 + ("system", "user", "assistant").index(m["role"])] + [5 + ord(c) % 90 for c in m["content"]]
    return out + [4]


SESSION = ({"role": "system", "content": "You are an agent. Tools: open, edit, submit."},
           {"role": "user", "content": "Fix the bug in parse(). File: def parse(text): return text.split(',')"},
           {"role": "assistant", "content": "open parse.py"},
           {"role": "user", "content": "def parse(text): return text.split(',')\n# end of parse.py"},
           {"role": "assistant", "content": "edit parse.py"},
           {"role": "user", "content": "def parse(text): return text.split(';')\n# end of parse.py, edited"},
           {"role": "assistant", "content": "submit"})


def test_replays_reuse_history_draft_across_sessions_and_equal_plain(tiny_dirs):
    model = cpu.CpuLlama.from_hf_dir(tiny_dirs["llama"][0], max_length=512, threads=2)
    other = ({"role": "system", "content": "Another agent."},) + SESSION[3:]  # reads the same file
    prompts = [BenchPrompt("a", AGENT, (), messages=SESSION), BenchPrompt("b", AGENT, (), messages=other)]
    builder = PromptBuilder(_encode, lambda ids: "", 400)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    suffix = SuffixDecodingDrafter(min_score=0.0, min_token_prob=0.0)
    runners = [EngineRunner("none", model, NoDrafter(), 8, prefix_cache_mb=64),
               EngineRunner("suffix", model, suffix, 8, prefix_cache_mb=64)]
    records = run(runners, prompts, builder, params, warmup=0)
    by = {(r.method, r.question_id, r.turn): r for r in records}
    assert len(records) == 2 * (3 + 2)
    sessions = {bp.question_id: bp for bp in prompts}
    for (method, qid, turn), r in by.items():
        assert r.token_ids == by["none", qid, turn].token_ids  # greedy: every turn equals plain decoding
        bp = sessions[qid]  # the recorded history before the regenerated turn
        assert r.prompt_ids == tuple(_encode(list(bp.messages[:bp.replayed[turn]])))
    for turn in (1, 2):  # each turn reuses the previous turn's prompt from the prefix cache
        earlier = len(by["suffix", "a", turn - 1].prompt_ids)
        assert by["suffix", "a", turn].cached_tokens >= (earlier - 1) // DEFAULT_BLOCK_SIZE * DEFAULT_BLOCK_SIZE
    assert by["suffix", "a", 0].cached_tokens == 0
    assert sum(r.drafted for r in records if r.method == "suffix") > 0


def test_edit_predictions_go_only_to_methods_that_take_them(tiny_dirs):
    model = cpu.CpuLlama.from_hf_dir(tiny_dirs["llama"][0], max_length=512, threads=2)
    sent = []
    code = "def parse(text): return text.split(',')"
    builder = PromptBuilder(_encode, lambda ids: "", 400,
                            encode_prediction=lambda text: sent.append(text) or _encode([{"role": "user",
                                                                                         "content": text}])[1:])
    prompt = BenchPrompt("e", EDIT, (f"Split on ';'.\n{code}",), prediction=code)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    runners = [EngineRunner("none", model, NoDrafter(), 8),
               EngineRunner("suffix:prediction=yes", model, SuffixDecodingDrafter(), 8, predicts=True)]
    records = run(runners, [prompt], builder, params, warmup=0)
    assert sent == [code, code] and records[0].token_ids == records[1].token_ids


def test_fim_items_need_fim_tokens_and_the_cli_runs_edit_and_agent(tmp_path):
    with pytest.raises(ValueError, match="fill-in-the-middle"):
        PromptBuilder(_encode, lambda ids: "", 400).first_prompt(load_workload(FIM, 1)[0])
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["bench", "--model", "stories260k", "-c", "edit", "-c", "agent", "--limit", "1",
                                 "-n", "4", "--warmup", "0", "-m", "suffix", "-m", "suffix:prediction=yes",
                                 "-m", "suffix:prediction=ids", "-m", "suffix:prediction=prompt",
                                 "--output-dir", str(out), "--strict"])
    assert r.exit_code == 0, r.output
    records = json.loads((out / "results.json").read_text())["records"]
    assert {x["category"] for x in records} == {EDIT, AGENT}
    assert sum(x["category"] == AGENT for x in records) == 5 * load_workload(AGENT, 1)[0].num_turns
    bad = CliRunner().invoke(app, ["bench", "--model", "stories260k", "-c", "fim", "--limit", "1", "-n", "2",
                                   "--warmup", "0", "--output-dir", str(tmp_path / "o2")])
    assert bad.exit_code == 2 and "fill-in-the-middle" in bad.output
    bad = CliRunner().invoke(app, ["bench", "--model", "stories260k", "-c", "edit", "-m", "suffix:prediction=maybe",
                                   "--output-dir", str(tmp_path / "o3")])
    assert bad.exit_code == 2 and "prediction must be yes, ids, prompt or no" in bad.output
