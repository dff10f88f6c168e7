"""Prompt log-probabilities (``engine/scoring.py``) and /v1/completions ``echo`` with ``logprobs``
(``max_tokens: 0`` too), as lm-evaluation-harness reads a text's log-likelihood: every prompt
token, the first with a null logprob, the others equal to log_softmax of the target's logits
computed directly over the whole prompt; the completion's logprobs after them unchanged."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from serving import MODEL, running_server, stories_native_model

from verispec.engine.scoring import prompt_logprobs

PROMPT = "Once upon a time there was a little girl named Lily. She liked to play"


def direct_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of the target's logits in one forward over the whole prompt: [P, V]."""
    return direct_logprobs_of(model.backend, ids)


@pytest.fixture(scope="module")
def server():
    with running_server(stories_native_model()) as s:
        yield s


def post(url: str, **body) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL} | body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_prompt_logprobs_equal_log_softmax_of_one_forward(chunk) -> None:
    model = stories_native_model()
    ids = model.tokenizer(PROMPT)["input_ids"]
    want = direct_logprobs(model, ids)
    cache = model.backend.new_cache(512)
    got = prompt_logprobs(model.backend, cache, ids, 3, chunk)
    assert cache.length == len(ids) - 1 and [lp.token_id for lp in got] == ids[1:]
    for i, lp in enumerate(got):  # entry i scores token i + 1 from the logits at position i
        assert lp.logprob == pytest.approx(float(want[i, ids[i + 1]]), abs=1e-4)
        top_vals, top_ids = want[i].topk(3)
        assert [t for t, _ in lp.top] == top_ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top_vals.tolist(), abs=1e-4)
    with pytest.raises(ValueError, match="empty cache"):
        prompt_logprobs(model.backend, cache, ids, 0)


def test_echo_logprobs_max_tokens_0_scores_the_prompt(server) -> None:
    url, state, _ = server
    model = state.model
    ids = model.tokenizer(PROMPT)["input_ids"]
    out = post(url, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert out["usage"]["prompt_tokens"] == len(ids) and out["usage"]["completion_tokens"] == 0
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = direct_logprobs(model, ids)
    assert lp["token_logprobs"][1:] == pytest.approx([float(want[i, ids[i + 1]]) for i in range(len(ids) - 1)],
                                                     abs=1e-4)
    assert all(len(top) == 2 for top in lp["top_logprobs"][1:])
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][-1] < len(PROMPT)
    assert state.worker.engine.cache_rows_in_use == 0  # the scoring row went back


def test_echo_logprobs_then_the_completion(server) -> None:
    url = server[0]
    plain = post(url, prompt=PROMPT, max_tokens=5, logprobs=1, temperature=0)["choices"][0]
    echoed = post(url, prompt=PROMPT, max_tokens=5, logprobs=1, temperature=0, echo=True)["choices"][0]
    scored = post(url, prompt=PROMPT, max_tokens=0, logprobs=1, echo=True)["choices"][0]
    assert echoed["text"] == PROMPT + plain["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        assert echoed["logprobs"][key] == scored["logprobs"][key] + plain["logprobs"][key]
    n = len(scored["logprobs"]["tokens"])
    # the completion's offsets continue after the echoed prompt's characters
    assert echoed["logprobs"]["text_offset"][n:] == [o + len(PROMPT) for o in plain["logprobs"]["text_offset"]]


def test_streamed_echo_logprobs_equal_the_whole_answer(server) -> None:
    url = server[0]
    whole = post(url, prompt=PROMPT, max_tokens=4, logprobs=1, temperature=0, echo=True)["choices"][0]
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 4, "logprobs": 1, "temperature": 0, "echo": True,
        "stream": True})
    chunks = [json.loads(line[6:])["choices"][0] for line in r.text.splitlines() if line.startswith("data: {")]
    assert "".join(c["text"] for c in chunks) == whole["text"] and chunks[0]["text"].startswith(PROMPT)
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for c in chunks for v in c["logprobs"][key]] == whole["logprobs"][key]
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 0, "logprobs": 0, "echo": True, "stream": True})
    chunks = [json.loads(line[6:])["choices"][0] for line in r.text.splitlines() if line.startswith("data: {")]
    assert len(chunks) == 1 and chunks[0]["text"] == PROMPT and chunks[0]["finish_reason"] == "length"
    assert chunks[0]["logprobs"]["token_logprobs"][0] is None


def test_loglikelihood_as_lm_evaluation_harness_reads_it(server) -> None:
    """lm-eval's OpenAI completions model: token-id prompts (context + continuation), echo,
    logprobs 1, then sum(token_logprobs[ctxlen:-1]) and is_greedy from top_logprobs."""
    url, state, _ = server
    tok = state.model.tokenizer
    context = tok("Once upon a time")["input_ids"]
    continuation = post(url, prompt=context, max_tokens=3, temperature=0, return_token_ids=True)["choices"][0]["token_ids"]
    other = tok(" purple elephant", add_special_tokens=False)["input_ids"]
    out = post(url, prompt=[context + continuation, context + other], max_tokens=1, logprobs=1, echo=True,
               temperature=0)
    scores = []
    for choice in out["choices"]:
        lp = choice["logprobs"]
        values = lp["token_logprobs"][len(context):-1]  # the last is the generated token
        greedy = all(v == max(top.values()) for v, top in zip(values, lp["top_logprobs"][len(context):-1]))
        scores.append((sum(values), greedy))
    ids = context + continuation
    want = direct_logprobs(state.model, ids)
    assert scores[0][0] == pytest.approx(sum(float(want[i - 1, ids[i]]) for i in range(len(context), len(ids))),
                                         abs=1e-3)
    assert scores[0][0] > scores[1][0] and scores[0][1] and not scores[1][1]


@pytest.mark.parametrize("body, param", [
    ({"prompt": "Once", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "Once", "max_tokens": -1, "echo": True}, "max_tokens"),
    ({"prompt": "Once", "max_tokens": 0, "echo": True, "logprobs": 1, "suffix": "end"}, "suffix"),
])
def test_echo_refusals(server, body, param) -> None:
    r = httpx.post(f"{server[0]}/v1/completions", json={"model": MODEL} | body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_score_prompt_on_the_compiled_runtime(tmp_path) -> None:
    """The compiled CPU runtime (a pooled cache row, as the server's batch holds them): the
    same log-probabilities as log_softmax of one forward, and the row is free again."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from verispec.drafters.base import NoDrafter
    from verispec.engine import Engine
    from verispec.engine.batch import BatchEngine
    from verispec.models import cpu_abi

    assert cpu_abi.available(), "the compiled runtime verispec._vscpu is not built"
    from verispec.models.cpu import CpuLlama

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    target = CpuLlama.from_hf_dir(tmp_path, max_length=512, threads=2)
    batch = BatchEngine(target, {"none": Engine(target, NoDrafter())}, max_batch=2, max_length=256)
    ids = torch.randint(3, 512, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    got = batch.score_prompt(ids, 2)
    assert batch.cache_rows_in_use == 0
    want = direct_logprobs_of(target, ids)
    assert [lp.logprob for lp in got] == pytest.approx([float(want[i, ids[i + 1]]) for i in range(149)], abs=1e-3)
    assert [[t for t, _ in lp.top] for lp in got] == want[:-1].topk(2).indices.tolist()
    for bad in ([], [512], [5] * 257):
        with pytest.raises(ValueError, match="scored prompt"):
            batch.score_prompt(bad, 0)


def direct_logprobs_of(target, ids: list[int]) -> torch.Tensor:
    cache = target.new_cache(256)
    logits = target.forward(torch.tensor([ids]), torch.arange(len(ids))[None], cache).logits[0]
    return torch.log_softmax(logits.float(), -1)
