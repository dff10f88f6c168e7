"""The real target, SmolLM2-135M-Instruct, through the user-facing commands: `verispec serve`
(concurrent chats equal alone), `verispec bench --quick` (outputs checked against plain decoding),
`generate` (the README's draft-model example accepts tokens) and its input checks."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from typer.testing import CliRunner

from serving import runner, running_server
from verispec.api import load_model
from verispec.cli import app


def test_real_smollm2_chat_batched_equals_alone() -> None:
    """SmolLM2 chat through the openai client: greedy, two concurrent requests vs alone."""
    model = load_model("smollm2-135m-instruct", backend="native")
    prompts = ["What is the capital of France?", "Write a haiku about the sea."]
    with running_server(model, "smollm2", max_batch=4, max_model_len=512) as (url, _, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

        def ask(p: str) -> str:
            r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": p}],
                                               max_tokens=24, temperature=0)
            return r.choices[0].message.content

        alone = [ask(p) for p in prompts]
        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(ask, prompts)) == alone
        assert "Paris" in alone[0]


@pytest.mark.slow  # about a minute on 2 cores: loads SmolLM2 and its distilled draft
def test_readme_draft_example_accepts_tokens() -> None:
    """The README's draft-model example, run as written (fewer tokens): the drafter's
    tokens are really accepted (the old truncated:6 example accepted 0 of 242)."""
    import shlex

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    line = next(x for x in readme.splitlines() if x.startswith("verispec generate --drafter draft "))
    args = shlex.split(line.split("#")[0])[1:]
    r = runner.invoke(app, [*args, "-n", "32", "--json"])
    assert r.exit_code == 0, r.output
    stats = json.loads(r.stdout)["stats"]
    assert stats["drafted"] > 0 and stats["accepted"] / stats["drafted"] >= 0.05, stats


def test_empty_chat_message_rejected():
    r = CliRunner().invoke(app, ["generate", "--chat", ""])
    assert r.exit_code == 2 and "non-empty" in r.output


def test_bench_quick_runs_and_greedy_outputs_match(tmp_path):
    out = tmp_path / "quick"
    result = CliRunner().invoke(app, ["bench", "--quick", "--output-dir", str(out), "--strict"])
    assert result.exit_code == 0, result.output
    data = json.loads((out / "results.json").read_text())
    records = data["records"]
    assert {r["method"] for r in records} == {"none", "prompt-lookup"}
    assert {r["category"] for r in records} == {"summarization", "rag"}
    assert len(records) == 4 and all(r["new_tokens"] > 0 for r in records)
    counts = data["exactness"]["counts"]["prompt-lookup"]
    assert counts["mismatch"] == 0 and counts["equal"] + counts["near-tie"] == 2
    assert (out / "results.md").is_file() and (out / "speedup.png").is_file()
