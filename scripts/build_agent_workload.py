"""Rebuild ``src/verispec/bench/data/agent.jsonl`` (``verispec bench -c agent``) from coding-agent
trajectories published with SWE-agent and mini-SWE-agent, so anyone can check where every session came
from (issue 34, section 3).

A trajectory is what the agent framework sent the model, turn after turn: the system prompt with the
tool documentation, the task, then the model's answers (a thought and one command) and the
environment's outputs (file views, search results, test runs) as the next user message. Each session
keeps those messages verbatim, in order; the bench regenerates every kept assistant turn with the
target from the recorded history before it (the later history stays the recorded one, as a replay).

Kept: trajectories in the classic text format (the command inside the answer, the output as a user
message; function-calling trajectories, whose actions live outside the message text, are not used).
In-context demonstrations (SWE-agent's ``is_demo`` messages, a whole other session pasted in) are left
out, and a session ends at its ``--turns``-th assistant turn or before the first assistant turn whose
history passes ``--max-chars``, so every prompt stays within a CPU's reach.

    git clone https://github.com/SWE-agent/SWE-agent /tmp/swe-agent
    git clone https://github.com/SWE-agent/mini-swe-agent /tmp/mini-swe-agent
    python scripts/build_agent_workload.py --swe-agent /tmp/swe-agent --mini-swe-agent /tmp/mini-swe-agent

A held-out set from another framework (issue 46: agent workloads from sources other than the SWE-agent
repository), written to ``agent_openhands.jsonl`` beside it and never tuned on: OpenHands' CodeAct
sessions, recorded from GPT-4 runs as the mock LLM of its integration tests (each test's last prompt
holds the whole history, its messages joined by ``----------`` lines: the system prompt, the in-context
example, the task, then the model's answers and the observations in turn; the test's last response is
the final answer):

    git clone https://github.com/All-Hands-AI/OpenHands /tmp/openhands
    python scripts/build_agent_workload.py --openhands /tmp/openhands

Material: SWE-agent (MIT, Copyright 2024 John Yang, Carlos E. Jimenez, Alexander Wettig, Shunyu Yao,
Karthik Narasimhan, Ofir Press) and mini-SWE-agent (MIT, Copyright 2025 Kilian A. Lieret and Carlos E.
Jimenez); OpenHands (MIT, Copyright 2023 OpenHands / OpenDevin contributors); each session names its
file and commit.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "src" / "verispec" / "bench" / "data" / "agent.jsonl"
SWE_AGENT_REV = "3ea751c087f32b16e039a2233dd6eefecef325d5"  # SWE-agent/SWE-agent main, 2026-07-16
MINI_REV = "a83fcae82d2a08f0ee0c688f9d137b3566c097f8"  # SWE-agent/mini-swe-agent main, 2026-07-22
SWE_AGENT_FILES = (  # SWE-agent's history format: the model's own runs and its shipped demonstrations
    "tests/test_data/trajectories/gpt4__swe-bench-dev-easy_first_only__default__t-0.00__p-0.95__c-3.00__install-1/"
    "pydicom__pydicom-1458.traj",
    "tests/test_data/trajectories/gpt4__swe-agent__test-repo__default_from_url__t-0.00__p-0.95__c-3.00__install-1/"
    "swe-agent__test-repo-i1.traj",
    "trajectories/demonstrations/replay__marshmallow-code__marshmallow-1867__default_sys-env_window100__t-0.20__"
    "p-0.95__c-2.00__install-1/marshmallow-code__marshmallow-1867.traj",
    "trajectories/demonstrations/human_thought__swe-bench-HumanEvalFix-python__lcb__t-0.00__p-0.95__c-4.00__"
    "install-0/humanevalfix-python-0.traj",
    "trajectories/demonstrations/ctf/rev/rock.traj",
    "trajectories/demonstrations/ctf/pwn/warmup.traj",
    "trajectories/demonstrations/ctf/crypto/katy.traj",
    "trajectories/demonstrations/ctf/web/i_got_id_demo.traj",
    "trajectories/demonstrations/ctf/misc/networking_1.traj",
)
MINI_FILES = ("tests/test_data/github_issue.traj.json",)  # mini-SWE-agent: a list of OpenAI messages
OPENHANDS = "https://github.com/All-Hands-AI/OpenHands"
OPENHANDS_REV = "4f0a454ed6"  # the last commit with the text-format CodeAct mocks, 2024-08-01
OPENHANDS_OUT = OUT.with_name("agent_openhands.jsonl")
OPENHANDS_TESTS = tuple(f"tests/integration/mock/eventstream_runtime/{agent}/{test}" for agent, test in (
    ("CodeActAgent", "test_edits"), ("CodeActAgent", "test_write_simple_script"), ("CodeActAgent", "test_ipython"),
    ("CodeActAgent", "test_ipython_module"), ("CodeActSWEAgent", "test_edits"),
    ("CodeActSWEAgent", "test_write_simple_script"), ("CodeActSWEAgent", "test_ipython_module")))
LICENSES = {"https://github.com/SWE-agent/SWE-agent": "MIT", "https://github.com/SWE-agent/mini-swe-agent": "MIT",
            OPENHANDS: "MIT"}


def show(repo: Path, rev: str, path: str, parse: bool = True):
    git_dir = repo / ".git" if (repo / ".git").exists() else repo
    out = subprocess.run(["git", "--git-dir", str(git_dir), "show", f"{rev}:{path}"], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out) if parse else out


def openhands_session(repo: Path, test: str) -> tuple[list[dict], str]:
    """One OpenHands mock test as messages: its last prompt split at the ``----------`` lines (system prompt,
    in-context example, task, then answers and observations in turn) and its last response; and its path."""
    git_dir = repo / ".git" if (repo / ".git").exists() else repo
    names = subprocess.run(["git", "--git-dir", str(git_dir), "ls-tree", "--name-only", f"{OPENHANDS_REV}:{test}"],
                           check=True, capture_output=True, text=True).stdout.split()
    last = max(n for n in names if n.startswith("prompt_"))
    blocks = show(repo, OPENHANDS_REV, f"{test}/{last}", parse=False).split("\n\n----------\n\n")
    if blocks[0].strip() or len(blocks) < 4:
        raise ValueError(f"{test}/{last}: not the text format (system, example, task, turns)")
    answer = show(repo, OPENHANDS_REV, f"{test}/{last.replace('prompt_', 'response_')}", parse=False)
    messages = [{"role": "system", "content": blocks[1].strip()}, {"role": "user", "content": blocks[2].strip()}]
    for i, block in enumerate(blocks[3:]):  # the task, then the model's answers and the observations in turn
        messages.append({"role": "assistant" if i % 2 else "user", "content": block.strip()})
    if messages[-1]["role"] != "user":
        raise ValueError(f"{test}/{last}: the history does not end with an observation")
    messages.append({"role": "assistant", "content": answer.strip()})
    return messages, f"{test}/{last}"


def session(messages: list[dict], turns: int, max_chars: int) -> list[dict]:
    """The kept messages: no demonstrations, up to the last assistant turn within both bounds."""
    kept, size, answered = [], 0, 0
    for m in messages:
        if m.get("is_demo"):
            continue
        if m["role"] not in ("system", "user", "assistant") or not isinstance(m.get("content"), str):
            raise ValueError(f"unexpected message {str(m)[:80]}")
        if m["role"] == "assistant":
            if size > max_chars or answered == turns:
                break
            answered += 1
        kept.append({"role": m["role"], "content": m["content"]})
        size += len(m["content"])
    while kept and kept[-1]["role"] != "assistant":
        kept.pop()
    return kept


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--swe-agent", type=Path, help="a clone of https://github.com/SWE-agent/SWE-agent")
    ap.add_argument("--mini-swe-agent", type=Path, help="a clone of https://github.com/SWE-agent/mini-swe-agent")
    ap.add_argument("--openhands", type=Path, help=f"a clone of {OPENHANDS}: builds the held-out set instead")
    ap.add_argument("--turns", type=int, default=5, help="assistant turns kept per session")
    ap.add_argument("--max-chars", type=int, default=24_000, help="history before a kept assistant turn, at most")
    ap.add_argument("--out", type=Path, help=f"default {OUT.name} ({OPENHANDS_OUT.name} with --openhands)")
    args = ap.parse_args()
    if args.openhands:
        rows = []
        for test in OPENHANDS_TESTS:
            messages, path = openhands_session(args.openhands, test)
            rows.append({"question_id": f"OpenHands-{test.split('/')[-2]}-{test.split('/')[-1]}", "category": "agent",
                         "messages": messages, "source": {"repository": OPENHANDS, "license": "MIT",
                                                          "commit": OPENHANDS_REV, "path": path}})
        return write(rows, args.out or OPENHANDS_OUT)
    if not (args.swe_agent and args.mini_swe_agent):
        ap.error("needs --swe-agent and --mini-swe-agent (or --openhands)")
    sources = [("https://github.com/SWE-agent/SWE-agent", args.swe_agent, SWE_AGENT_REV, p, "history")
               for p in SWE_AGENT_FILES]
    sources += [("https://github.com/SWE-agent/mini-swe-agent", args.mini_swe_agent, MINI_REV, p, None)
                for p in MINI_FILES]
    rows = []
    for url, repo, rev, path, key in sources:
        data = show(repo, rev, path)
        messages = session(data[key] if key else data, args.turns, args.max_chars)
        name = Path(path).name.split(".traj")[0]
        rows.append({"question_id": f"{url.rsplit('/', 1)[1]}-{name}", "category": "agent", "messages": messages,
                     "source": {"repository": url, "license": LICENSES[url], "commit": rev, "path": path}})
    write(rows, args.out or OUT)


def write(rows: list[dict], out: Path) -> None:
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    turns = sum(m["role"] == "assistant" for r in rows for m in r["messages"])
    print(f"{len(rows)} sessions, {turns} assistant turns -> {out}")


if __name__ == "__main__":
    main()
