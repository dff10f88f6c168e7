"""`verispec serve` and the batched engine.

Unit level: the draft-cap schedule, tree packing, and BatchEngine exactness against the
single-request Engine (batched native forward and the one-by-one fallback). Server level: a
real uvicorn server on 127.0.0.1 (random free port) in a thread of the test process, driven
by the official ``openai`` client and httpx: completions, chat, streaming, concurrent batch
== alone, OpenAI error bodies and status codes, 429 on a full queue, disconnects cancelling
work, a failing request not hurting others, graceful shutdown, metrics, and the CLI.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from helpers import OracleDrafter, RandomDrafter
from serving import (
    BOOM,
    MODEL,
    ExplodingDrafter,
    complete,
    metrics,
    running_server,
    stories_native_model,
    wait_until,
    with_chat_template,
)
from verispec.drafters.base import NoDrafter
from verispec.drafters.prompt_lookup import PromptLookupDrafter
from verispec.engine import Engine
from verispec.engine.batch import (
    BatchEngine,
    SpecSchedule,
    acceptance_estimate,
    draft_cap,
    expected_tokens,
    goodput_cap,
    pack_trees,
)
from verispec.models.native import NativeLlama
from verispec.tree import DraftTree
from verispec.types import SamplingParams

# ----------------------------------------------------------------------------- unit


def test_draft_cap_examples() -> None:
    assert [draft_cap(b, 32, 0) for b in (1, 4, 8, 16, 40)] == [31, 7, 3, 1, 0]
    assert draft_cap(16, 32, 0, free_tokens=4) == 3 and draft_cap(40, 32, 0, free_tokens=4) == 3
    assert draft_cap(7, 64, 8) == 8 and draft_cap(8, 64, 8, free_tokens=4) == 0
    assert draft_cap(100, 0, 0) is None
    with pytest.raises(ValueError):
        draft_cap(0, 64, 0)
    with pytest.raises(ValueError):
        SpecSchedule(token_budget=-1)


def test_goodput_schedule_examples() -> None:
    assert expected_tokens(0.5, 2) == 1.75 and expected_tokens(0.0, 5) == 1.0 and expected_tokens(1.0, 3) == 4.0
    assert goodput_cap([0.8], 8, 18.0) == 8
    assert goodput_cap([0.3] * 16, 8, 18.0) == 0
    assert goodput_cap([0.3] * 16, 8, 18.0, free_tokens=4) == 3  # padded rows are free
    caps = [goodput_cap([0.9] * b, 8, 18.0) for b in (1, 2, 4, 8, 16, 32)]
    assert caps == sorted(caps, reverse=True) and caps[0] == 8 and caps[-1] < 8  # shrinks with the batch
    assert acceptance_estimate(0, 0) == 0.5 and acceptance_estimate(100, 100) > 0.95
    sched = SpecSchedule(disable_at=4)
    assert sched.max_drafted([0.9] * 4, 8) == 0 and sched.max_drafted([0.9], 8) == 8
    assert SpecSchedule("budget", 32).max_drafted([0.1] * 8, 8) == 3
    with pytest.raises(ValueError):
        SpecSchedule("sometimes")
    with pytest.raises(ValueError):
        goodput_cap([], 8, 18.0)


def test_pack_trees_docstring_example() -> None:
    ids, pos, masks, n = pack_trees([DraftTree.chain(7, [3, 5]), DraftTree.chain(9, [])], [10, 4])
    assert ids.tolist() == [[7, 3, 5], [9, 0, 0]]
    assert pos.tolist() == [[10, 11, 12], [4, 4, 4]]
    assert n == [3, 1]
    assert masks[0].tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert masks[1].tolist() == [[1, 0, 0], [0, 0, 0], [0, 0, 0]]
    tree = DraftTree(tokens=(1, 2, 3, 4), parents=(-1, 0, 0, 1))
    _, pos, masks, _ = pack_trees([tree], [5])
    assert pos.tolist() == [[5, 6, 6, 7]]
    assert masks[0, 3].tolist() == [True, True, False, True]


@pytest.fixture(scope="module")
def tiny_native(tmp_path_factory, toy_target):
    path = tmp_path_factory.mktemp("tiny-native")
    toy_target.model.save_pretrained(path)
    return NativeLlama.from_hf_dir(path, dtype=torch.float32)


def _alone(engine: Engine, prompt: list[int], params: SamplingParams) -> list[int]:
    req = engine.add_request(prompt, params)
    while not req.finished:
        engine.step(req)
    return req.generated


def _batched(be: BatchEngine, jobs: list[tuple[list[int], SamplingParams, str]], stagger: int = 0):
    """Run jobs through the BatchEngine; job i joins after i * stagger steps (continuous batching)."""
    pending = list(enumerate(jobs))
    running, done, steps, sizes = [], {}, 0, []
    while pending or running:
        while pending and pending[0][0] * stagger <= steps:
            i, (prompt, params, drafter) = pending.pop(0)
            running.append((i, be.add_request(f"r{i}", prompt, params, drafter)))
        step = be.step([r for _, r in running])
        steps += 1
        sizes.append(step.batch_size)
        assert not any(isinstance(x, Exception) for x in step.results), step.results
        for i, r in list(running):
            if r.finished:
                be.release(r)
                running.remove((i, r))
                done[i] = r.generated
    return [done[i] for i in range(len(jobs))], sizes


def _jobs(vocab: int, n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (int(k),), generator=g).tolist() for k in torch.randint(2, 30, (n,), generator=g)]
    prompts[0] = [5, 6, 7, 8] * 5  # repetitive: prompt lookup accepts long drafts
    return prompts


@pytest.mark.parametrize("backend", ["native", "hf-fallback"])
def test_batch_engine_equals_single_requests(backend, tiny_native, toy_target) -> None:
    """Ragged trees (random trees, oracle chains with j accepted, none) verified in one
    batched forward give exactly the tokens of each request run alone (greedy and seeded
    sampling); requests join mid-flight and leave when done."""
    target = tiny_native if backend == "native" else toy_target
    vocab = target.info.vocab_size
    prompts = _jobs(vocab, 6)
    params = [SamplingParams(temperature=t, max_new_tokens=16, seed=i, ignore_eos=True)
              for i, t in enumerate([0, 0, 0, 0.8, 0, 1.0])]
    plain = Engine(target, NoDrafter(), 1)
    refs = [_alone(plain, p, sp) for p, sp in zip(prompts, params)]

    def engines():
        oracle = {f"oracle{i}": Engine(target, OracleDrafter(prompts[i] + refs[i], j, vocab), 5)
                  for i, j in ((1, 2), (4, 0))}
        return {"pl": Engine(target, PromptLookupDrafter(), 6), "none": Engine(target, NoDrafter(), 1),
                "tree": Engine(target, RandomDrafter(vocab, tree=True), 5), **oracle}

    names = ["pl", "oracle1", "tree", "pl", "oracle4", "none"]
    # references with the same drafters, alone (sampling consumes randomness per draft)
    alone = [_alone(engines()[n], p, sp) for n, p, sp in zip(names, prompts, params)]
    for i in (0, 1, 2, 4, 5):  # greedy rows: lossless -> plain decoding
        assert alone[i] == refs[i]
    be = BatchEngine(target, engines(), max_batch=6, max_length=128, schedule=SpecSchedule("budget", 0),
                     batched=backend == "native")
    got, sizes = _batched(be, list(zip(prompts, params, names)), stagger=2)
    assert max(sizes) >= 4 and be.free_slots == 6
    for i in (0, 1, 4, 5):  # the random tree drafter's draws depend on interleaving: greedy check only
        assert got[i] == alone[i], i
    assert got[2] == refs[2]
    assert got[3] == alone[3]  # seeded sampling with a deterministic drafter: identical too


def test_batch_engine_schedule_caps_drafts(tiny_native) -> None:
    target = tiny_native
    prompts = _jobs(target.info.vocab_size, 4)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    be = BatchEngine(target, {"pl": Engine(target, PromptLookupDrafter(), 8)}, 4, 64,
                     SpecSchedule("budget", token_budget=24, disable_at=4))
    free = target.invariance.min_rows  # rows the invariant runtime pads to: drafts below it are free
    reqs = [be.add_request(f"q{i}", p, params, "pl") for i, p in enumerate(prompts[:3])]
    step = be.step(reqs)
    assert step.max_drafted == max(7, free - 1) and all(r.num_drafted <= step.max_drafted for r in step.results)
    reqs.append(be.add_request("q3", prompts[3], params, "pl"))
    step = be.step(reqs)
    assert step.max_drafted == 0 and all(r.num_drafted == 0 for r in step.results)
    with pytest.raises(ValueError, match="batch is full"):
        be.add_request("q4", prompts[0], params, "pl")
    with pytest.raises(ValueError, match="exceeds the context"):
        be.release(reqs[0]) or be.add_request("q5", prompts[0], SamplingParams(max_new_tokens=60), "pl")
    for r in reqs[1:]:
        be.release(r)
    assert be.free_slots == 4
    with pytest.raises(ValueError, match="not running"):
        be.release(reqs[1])


def test_batch_engine_isolates_a_failing_request(tiny_native) -> None:
    target = tiny_native
    be = BatchEngine(target, {"x": Engine(target, ExplodingDrafter(77), 4)}, 3, 64)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    good = [be.add_request(f"g{i}", [1, 20 + i, 30], params, "x") for i in range(2)]
    bad = be.add_request("bad", [1, 77], params, "x")
    step = be.step([good[0], bad, good[1]])
    assert isinstance(step.results[1], RuntimeError)
    assert all(not isinstance(step.results[i], Exception) for i in (0, 2))
    be.release(bad)
    while not good[0].finished:
        be.step(good)
    plain = Engine(target, NoDrafter(), 1)
    assert [g.generated for g in good] == [_alone(plain, [1, 20 + i, 30], params) for i in range(2)]


# ----------------------------------------------------------------------------- server


@pytest.fixture(scope="module")
def stories():
    return with_chat_template(stories_native_model())


@pytest.fixture(scope="module")
def server(stories):
    with running_server(stories) as s:
        yield s


@pytest.fixture(scope="module")
def base_url(server) -> str:
    return server[0]


def test_openai_client_completions_chat_and_streaming(base_url) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]

    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=32, temperature=0)
    choice = out.choices[0]
    assert choice.text and choice.finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens > 0 and 0 < out.usage.completion_tokens <= 32
    stats = out.model_extra["verispec"]
    assert stats["new_tokens"] == out.usage.completion_tokens and stats["drafter"] == "prompt-lookup"
    assert stats["steps"] >= 1 and 1.0 <= stats["tau"]

    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=32, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens and not chunks[-1].choices
    assert chunks[-1].model_extra["verispec"]["new_tokens"] == out.usage.completion_tokens

    messages = [{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "A cat"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    msg = chat.choices[0].message
    assert msg.role == "assistant" and msg.content and chat.usage.completion_tokens <= 24
    assert chat.model_extra["verispec"]["steps"] >= 1
    stream = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                 stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == msg.content
    assert stream[-1].choices[0].finish_reason == chat.choices[0].finish_reason

    # stop strings cut the text (and are not included), as in the OpenAI API
    stop = choice.text.split()[3]
    cut = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=32, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and choice.text.startswith(cut.choices[0].text)
    assert stop not in cut.choices[0].text
    # several prompts -> one choice each; token-id prompts are accepted
    multi = client.completions.create(model=MODEL, prompt=["Once upon a time", "The dog"], max_tokens=8, temperature=0)
    assert [c.index for c in multi.choices] == [0, 1] and multi.choices[0].text == choice.text[: len(multi.choices[0].text)]
    ids = complete(base_url, prompt=[1, 403, 407, 261, 378], max_tokens=8, temperature=0, return_token_ids=True)
    assert ids["choices"][0]["prompt_token_ids"] == [1, 403, 407, 261, 378]


def test_concurrent_batch_equals_requests_alone(base_url) -> None:
    """N concurrent requests (batched verification) give the same tokens as each alone."""
    prompts = ["Once upon a time", "The little dog", "Lily and Tom went", "One day, a big",
               "The sun was", "Tim had a red ball. Tim had a red ball. Tim"]
    bodies = [dict(prompt=p, max_tokens=48, temperature=0, ignore_eos=True, return_token_ids=True,
                   drafter="none" if i == 4 else "prompt-lookup") for i, p in enumerate(prompts)]
    bodies.append(dict(prompt="Once upon a time", max_tokens=48, temperature=0.9, seed=7, ignore_eos=True,
                       return_token_ids=True))  # seeded sampling: same per-request randomness either way
    alone = [complete(base_url, **b) for b in bodies]
    assert all(a["verispec"]["max_batch_size"] == 1 for a in alone)
    with ThreadPoolExecutor(len(bodies)) as pool:
        together = list(pool.map(lambda b: complete(base_url, **b), bodies))
    assert max(t["verispec"]["max_batch_size"] for t in together) >= 2  # they really were batched
    for a, t in zip(alone, together):
        assert t["choices"][0]["token_ids"] == a["choices"][0]["token_ids"]
        assert len(t["choices"][0]["token_ids"]) == 48


BAD = [
    ("completions", b"{not json", 400, None),
    ("completions", {"prompt": 3}, 400, "prompt"),
    ("completions", {}, 400, "prompt"),
    ("completions", {"prompt": "a", "max_tokens": "ten"}, 400, "max_tokens"),
    ("completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "a", "temperature": -1.0}, 400, "temperature"),
    ("completions", {"prompt": "a", "top_p": 0.0}, 400, "top_p"),
    ("completions", {"prompt": "a", "stream": "yes"}, 400, "stream"),
    ("completions", {"prompt": "a", "n": 0}, 400, "n"),
    ("completions", {"prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ("completions", {"prompt": "a", "echo": True, "logprobs": 1, "suffix": "b"}, 400, "suffix"),
    ("completions", {"prompt": "a", "stop": [""]}, 400, "stop"),
    ("completions", {"prompt": "a", "drafter": "nope"}, 400, "drafter"),
    ("completions", {"prompt": "a", "max_tokens": 100_000}, 400, "max_tokens"),
    ("completions", {"prompt": "word " * 600}, 400, "prompt"),
    ("completions", {"prompt": [1, 100_000]}, 400, "prompt"),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {"prompt": "a", "model": "gpt-4"}, 404, "model"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("chat/completions", {"messages": [{"role": "user", "content": "  "}]}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400, "tools.0.function"),
]


@pytest.mark.parametrize(("route", "body", "status", "param"), BAD, ids=[f"{r}-{i}" for i, (r, *_) in enumerate(BAD)])
def test_bad_requests_get_openai_errors(base_url, route, body, status, param) -> None:
    content = body if isinstance(body, bytes) else json.dumps({"model": MODEL} | body).encode()
    r = httpx.post(f"{base_url}/v1/{route}", content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param


def test_unknown_route_and_health(base_url) -> None:
    r = httpx.get(f"{base_url}/v2/nothing")
    assert r.status_code == 404 and "error" in r.json()
    health = httpx.get(f"{base_url}/health").json()
    assert health["status"] == "ok" and health["free_slots"] == 8


def test_failing_request_does_not_hurt_others(base_url) -> None:
    body = dict(prompt=[1, 403, 407, 261, 378], max_tokens=40, temperature=0, ignore_eos=True, return_token_ids=True)
    ref = complete(base_url, **body)
    before = metrics(base_url)
    with ThreadPoolExecutor(2) as pool:
        good = pool.submit(complete, base_url, **body)
        time.sleep(0.05)
        bad = pool.submit(httpx.post, f"{base_url}/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": [1, BOOM, 300], "max_tokens": 40, "drafter": "explode"})
        assert bad.result().status_code == 500
        assert bad.result().json()["error"]["type"] == "server_error"
        assert good.result()["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
    after = metrics(base_url)
    assert after['verispec_requests_total{outcome="failed"}'] == before['verispec_requests_total{outcome="failed"}'] + 1
    assert httpx.get(f"{base_url}/health").json()["free_slots"] == 8  # its cache row was freed


def test_stream_disconnect_cancels_generation(base_url) -> None:
    before = metrics(base_url)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
    # the client is gone: the engine must cancel the request and free its cache row
    key = 'verispec_requests_total{outcome="cancelled"}'
    wait_until(lambda: metrics(base_url)[key] == before[key] + 1)
    after = metrics(base_url)
    assert after["verispec_requests_running"] == 0
    assert after["verispec_generation_tokens_total"] - before["verispec_generation_tokens_total"] < 400
    assert httpx.get(f"{base_url}/health").json()["free_slots"] == 8


def test_non_stream_disconnect_cancels_generation(base_url) -> None:
    before = metrics(base_url)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base_url}/v1/completions", json=body, timeout=httpx.Timeout(5, read=0.3))
    key = 'verispec_requests_total{outcome="cancelled"}'
    wait_until(lambda: metrics(base_url)[key] == before[key] + 1)
    assert metrics(base_url)["verispec_requests_running"] == 0


def test_metrics_move(base_url) -> None:
    before = metrics(base_url)
    out = complete(base_url, prompt="Tim had a red ball. Tim had a red ball. Tim", max_tokens=40, temperature=0)
    after = metrics(base_url)
    s = out["verispec"]
    assert after['verispec_requests_total{outcome="completed"}'] == before['verispec_requests_total{outcome="completed"}'] + 1
    assert after["verispec_prompt_tokens_total"] - before["verispec_prompt_tokens_total"] == out["usage"]["prompt_tokens"]
    assert after["verispec_draft_tokens_total"] - before["verispec_draft_tokens_total"] == s["drafted"]
    assert after["verispec_accepted_tokens_total"] - before["verispec_accepted_tokens_total"] == s["accepted"]
    assert after["verispec_engine_steps_total"] - before["verispec_engine_steps_total"] == s["steps"]
    assert s["accepted"] > 0 and after["verispec_mean_accepted_tokens"] > 1.0
    assert after['verispec_per_position_acceptance{position="1"}'] > 0
    assert after["verispec_time_to_first_token_seconds_count"] > before["verispec_time_to_first_token_seconds_count"]
    text = httpx.get(f"{base_url}/metrics").text
    assert "# TYPE verispec_requests_waiting gauge" in text and "verispec_step_batch_size_bucket{le=\"+Inf\"}" in text


def test_full_queue_gets_429_and_shutdown_is_graceful(stories) -> None:
    """max_batch=1, max_queue=1: one running, one waiting, the third is refused with 429.
    Shutting down lets the in-flight stream finish (graceful) and stops the engine thread."""
    with running_server(stories, max_batch=1, max_queue=1) as (url, state, server):
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as first:
            lines = first.iter_lines()
            next(lines)
            waiting = threading.Thread(target=lambda: httpx.post(f"{url}/v1/completions", timeout=60,
                                                                 json=body | {"stream": False, "max_tokens": 20}))
            waiting.start()
            wait_until(lambda: metrics(url)["verispec_requests_waiting"] == 1)
            r = httpx.post(f"{url}/v1/completions", json=body | {"stream": False})
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
            assert r.headers["retry-after"] == "1"
            server.should_exit = True  # graceful: the running stream still completes
            rest = [x for x in lines if x]
            assert rest[-1] == "data: [DONE]"
            chunks = [json.loads(x[6:]) for x in rest if x.startswith("data: {")]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            waiting.join(30)
    # leaving running_server joined the server and asserted the engine thread stopped


def test_cli_serve_subprocess_and_sigterm(tmp_path) -> None:
    """`verispec serve` on a free port answers, then exits cleanly on SIGTERM."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    cmd = [sys.executable, "-m", "verispec.cli", "serve", "--model", MODEL, "--backend", "hf", "--port", str(port),
           "--max-batch", "2", "--max-model-len", "256", "--threads", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            assert proc.poll() is None, proc.stdout.read()
            with contextlib.suppress(httpx.TransportError):
                return httpx.get(f"{url}/health").status_code == 200
            return False

        wait_until(up, timeout=120)
        out = complete(url, prompt="Once upon a time", max_tokens=8, temperature=0)
        assert out["choices"][0]["text"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert "Finished server process" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_serve_rejects_bad_config() -> None:
    r = subprocess.run([sys.executable, "-m", "verispec.cli", "serve", "--model", "no-such-model"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "error" in r.stderr
