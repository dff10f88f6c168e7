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

Material: SWE-agent (MIT, Copyright 2024 John Yang, Carlos E. Jimenez, Alexander Wettig, Shunyu Yao,
Karthik Narasimhan, Ofir Press) and mini-SWE-agent (MIT, Copyright 2025 Kilian A. Lieret and Carlos E.
Jimenez); each session names its file and commit.
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
LICENSES = {"https://github.com/SWE-agent/SWE-agent": "MIT", "https://github.com/SWE-agent/mini-swe-agent": "MIT"}


def show(repo: Path, rev: str, path: str):
    git_dir = repo / ".git" if (repo / ".git").exists() else repo
    out = subprocess.run(["git", "--git-dir", str(git_dir), "show", f"{rev}:{path}"], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)


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
    ap.add_argument("--swe-agent", type=Path, required=True, help="a clone of https://github.com/SWE-agent/SWE-agent")
    ap.add_argument("--mini-swe-agent", type=Path, required=True,
                    help="a clone of https://github.com/SWE-agent/mini-swe-agent")
    ap.add_argument("--turns", type=int, default=5, help="assistant turns kept per session")
    ap.add_argument("--max-chars", type=int, default=24_000, help="history before a kept assistant turn, at most")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
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
    args.out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    turns = sum(m["role"] == "assistant" for r in rows for m in r["messages"])
    print(f"{len(rows)} sessions, {turns} assistant turns -> {args.out}")


if __name__ == "__main__":
    main()
