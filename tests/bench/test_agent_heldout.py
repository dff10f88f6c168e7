"""The held-out agent sessions (``bench/data/agent_openhands.jsonl``, from OpenHands' CodeAct mocks, built by
``scripts/build_agent_workload.py --openhands``) load through ``verispec bench --data`` as agent replays:
each starts with its system prompt, every replayed turn answers a user message, each names its source."""

from __future__ import annotations

import json

from verispec.bench.datasets import load_data_file, workload_path


def test_the_openhands_sessions_load_as_agent_replays():
    path = workload_path("agent").with_name("agent_openhands.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert len(rows) >= 5 and all(r["source"]["repository"] == "https://github.com/All-Hands-AI/OpenHands"
                                  and r["source"]["license"] == "MIT" for r in rows)
    sessions = load_data_file(path)
    assert len(sessions) == len(rows) and all(s.category == "agent" for s in sessions)
    assert sum(s.num_turns for s in sessions) >= 20 and all(s.messages[0]["role"] == "system" for s in sessions)
    assert all(s.messages[i - 1]["role"] == "user" for s in sessions for i in s.replayed)
    assert not {r["question_id"] for r in rows} & {json.loads(line)["question_id"]
                                                    for line in workload_path("agent").read_text().splitlines()}
