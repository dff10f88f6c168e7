"""Peers' server test suites, adapted: the behaviours of llama.cpp's tools/server/tests/unit
(test_completion, test_chat_completion, test_tokenize, test_security) and of vLLM's
tests/entrypoints/openai/test_completion.py that apply to an OpenAI-compatible server, run
against ``verispec serve`` (``serving.running_server``) on the stories model with an API key
and CORS open to any origin. Written for verispec (the peers' code is not copied); where we
answer differently on purpose, docs/serving.md ("Peers' behaviours we do not match") says why.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from serving import KEY, MODEL, TEMPLATE, running_server, stories_native_model, with_chat_template

from verispec.server.guard import Cors, Limits

PROMPT = "Once upon a time"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    model = with_chat_template(stories_native_model(), TEMPLATE)
    with running_server(model, limits=Limits(api_key=KEY), cors=Cors(("*",))) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=KEY, max_retries=0, timeout=120)


def post(url: str, route: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{url}{route}", json=body, headers=AUTH if headers is None else headers, timeout=120)


def stream_text(chunks) -> dict[int, str]:
    out: dict[int, str] = {}
    for c in chunks:
        for choice in c.choices:
            out[choice.index] = out.get(choice.index, "") + (choice.text or "")
    return out


# ----------------------------------------------------------------- llama.cpp: test_completion


def test_completion_with_openai_library(client) -> None:
    res = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert res.choices[0].finish_reason == "length" and res.choices[0].text
    assert res.usage.completion_tokens == 8 and res.usage.prompt_tokens == len(stories_native_model().tokenizer(PROMPT)["input_ids"])


def test_completion_stream_vs_non_stream(client) -> None:
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True))
    assert stream_text(chunks) == {0: whole.choices[0].text}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_consistent_result_same_seed_and_different_seeds(client) -> None:
    same = {client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=42)
            .choices[0].text for _ in range(3)}
    assert len(same) == 1
    different = {client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=s)
                 .choices[0].text for s in range(4)}
    assert len(different) > 1


def test_completion_with_token_input(server) -> None:
    url = server[0]
    tokens = post(url, "/tokenize", {"content": PROMPT, "add_special": True}).json()["tokens"]
    assert tokens[0] == 1  # BOS
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0}
    one = post(url, "/v1/completions", body | {"prompt": tokens}).json()["choices"][0]["text"]
    batch = post(url, "/v1/completions", body | {"prompt": [tokens, tokens]}).json()["choices"]
    mixed = post(url, "/v1/completions", body | {"prompt": [PROMPT, PROMPT]}).json()["choices"]
    assert [c["text"] for c in batch] == [one, one] == [c["text"] for c in mixed]


def test_prompt_over_the_context_is_400(server) -> None:
    r = post(server[0], "/v1/completions", {"model": MODEL, "prompt": "I believe the meaning of life is " * 200})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_parallel_requests(server) -> None:
    prompts = ["Write a very long book.", "Write another poem.", "What is LLM?", "The sky is blue and I love it."]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: post(server[0], "/v1/completions", {
            "model": MODEL, "prompt": p, "max_tokens": 16, "seed": 42, "temperature": 1.0}), prompts))
    assert all(r.status_code == 200 and r.json()["choices"][0]["text"] for r in results)


# ----------------------------------------------------------- llama.cpp: test_chat_completion


def test_chat_completion_with_openai_library(client) -> None:
    res = client.chat.completions.create(model=MODEL, max_tokens=8, seed=42, temperature=0.8, messages=[
        {"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}])
    assert res.id.startswith("chatcmpl") and res.model == MODEL
    assert res.choices[0].finish_reason == "length" and res.choices[0].message.role == "assistant"
    assert res.choices[0].message.content and res.usage.completion_tokens == 8


def test_chat_completion_stream(client) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, stream=True,
                                                 stream_options={"include_usage": True},
                                                 messages=[{"role": "user", "content": "What is the best book"}]))
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                           messages=[{"role": "user", "content": "What is the best book"}])
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_completion_without_model(server) -> None:
    r = post(server[0], "/v1/chat/completions", {"max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200 and r.json()["model"] == MODEL


@pytest.mark.parametrize("messages", [None, "string", [123], [{}], [{"role": 123}],
                                      [{"role": "system", "content": 123}], [{"role": "system", "content": "t"}, {}]])
def test_invalid_chat_completion_request(server, messages) -> None:
    r = post(server[0], "/v1/chat/completions", {"model": MODEL, "messages": messages})
    assert r.status_code == 400 and "error" in r.json()


@pytest.mark.parametrize("response_format, ok", [
    ({"type": "json_object"}, True),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"const": "42"}}}, True),
    ({"type": "sound"}, False),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "hiccup"}}}, False),
])
def test_chat_completion_with_response_format(server, response_format, ok) -> None:
    r = post(server[0], "/v1/chat/completions", {"model": MODEL, "max_tokens": 10, "response_format": response_format,
                                                 "messages": [{"role": "user", "content": "Write an example"}]})
    assert (r.status_code == 200) == ok, r.text
    if ok and "json_schema" in response_format:
        assert r.json()["choices"][0]["message"]["content"] == '"42"'


# ----------------------------------------------------------------- llama.cpp: test_tokenize


def test_tokenize_detokenize(server) -> None:
    content = "What is the capital of France ?"
    tokens = post(server[0], "/tokenize", {"content": content}).json()["tokens"]
    assert len(tokens) > 5 and tokens[0] != 1  # llama.cpp's content: no BOS unless add_special
    assert post(server[0], "/detokenize", {"tokens": tokens}).json()["content"].strip() == content


def test_tokenize_with_pieces(server) -> None:
    content = "This is a test string with unicode 媽 and emoji 🤗"
    pieces = post(server[0], "/tokenize", {"content": content, "with_pieces": True}).json()["tokens"]
    assert pieces and all(t["id"] > 0 and len(t["piece"]) > 0 for t in pieces)


# ----------------------------------------------------------------- llama.cpp: test_security


@pytest.mark.parametrize("path", ["/health", "/metrics"])
def test_public_endpoints_need_no_key(server, path) -> None:
    assert httpx.get(f"{server[0]}{path}", timeout=30).status_code == 200


@pytest.mark.parametrize("key", [None, "invalid-key"])
def test_incorrect_api_key(server, key) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = post(server[0], "/v1/completions", {"model": MODEL, "prompt": PROMPT}, headers)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server[0]}/v1", api_key=key or "none", max_retries=0).models.list()


def test_correct_api_key(server, client) -> None:
    assert post(server[0], "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}).status_code == 200
    assert [m.id for m in client.models.list()] == [MODEL]


@pytest.mark.parametrize("origin", ["http://localhost", "https://web.mydomain.fr"])
def test_cors_preflight(server, origin) -> None:
    r = httpx.options(f"{server[0]}/v1/completions", timeout=30, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "Authorization"})
    assert r.status_code == 200
    assert r.headers["Access-Control-Allow-Origin"] in ("*", origin)
    assert "POST" in r.headers["Access-Control-Allow-Methods"]
    assert "authorization" in r.headers["Access-Control-Allow-Headers"].lower()


# ----------------------------------------------------------------- vLLM: test_completion.py


def test_single_completion(client) -> None:
    res = client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=5, temperature=0)
    assert res.id and len(res.choices) == 1 and len(res.choices[0].text) >= 5
    assert res.choices[0].finish_reason == "length" and res.usage.completion_tokens == 5
    assert res.usage.total_tokens == res.usage.prompt_tokens + 5
    again = client.completions.create(model=MODEL, prompt=[1, 400, 401], max_tokens=5, temperature=0)  # token ids
    assert again.choices[0].text and again.usage.prompt_tokens == 3


def test_no_logprobs(client) -> None:
    res = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    assert res.choices[0].logprobs is None


def test_zero_logprobs(client) -> None:
    choice = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=0).choices[0]
    assert choice.logprobs.token_logprobs is not None and choice.logprobs.top_logprobs is not None
    assert all(len(top) == 1 for top in choice.logprobs.top_logprobs)


def test_some_logprobs(client) -> None:
    choice = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=5).choices[0]
    assert len(choice.logprobs.token_logprobs) == 5 and all(5 <= len(t) <= 6 for t in choice.logprobs.top_logprobs)


def test_too_many_logprobs(client) -> None:
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, logprobs=21)


@pytest.mark.parametrize("prompt", [PROMPT, [1, 403, 113, 263, 31]])
def test_echo_logprob_completion(client, prompt) -> None:
    res = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, echo=True, logprobs=1)
    text = res.choices[0].text
    lp = res.choices[0].logprobs
    prompt_text = prompt if isinstance(prompt, str) else stories_native_model().tokenizer.decode(prompt)
    assert text.startswith(prompt_text)
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) > 5
    assert len(lp.tokens) == len(lp.text_offset) == len(lp.top_logprobs) == len(lp.token_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)


def test_echo_max_tokens_0(client) -> None:
    res = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    assert res.choices[0].text == PROMPT and res.usage.completion_tokens == 0
    assert res.choices[0].logprobs.token_logprobs[0] is None and len(res.choices[0].logprobs.tokens) > 1


def test_completion_streaming(client) -> None:
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stream=True))
    assert stream_text(chunks)[0] == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_parallel_streaming_n(client) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.0, n=3,
                                            seed=0, stream=True))
    texts = stream_text(chunks)
    assert sorted(texts) == [0, 1, 2] and all(texts.values())
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 3


def test_completion_stream_options(client) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 5
    assert last.usage.total_tokens == last.usage.prompt_tokens + 5
    assert last.usage.prompt_tokens_details.cached_tokens == 0
    none = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, stream=True,
                                          stream_options={"include_usage": False}))
    assert all(c.usage is None for c in none)


def test_batch_completions(client) -> None:
    res = client.completions.create(model=MODEL, prompt=[PROMPT, PROMPT], max_tokens=5, temperature=0)
    assert len(res.choices) == 2 and res.choices[0].text == res.choices[1].text
    res = client.completions.create(model=MODEL, prompt=[PROMPT, PROMPT], max_tokens=5, n=2, temperature=1.0, seed=3)
    assert len(res.choices) == 4
    chunks = list(client.completions.create(model=MODEL, prompt=[PROMPT, PROMPT], max_tokens=5, temperature=0,
                                            stream=True))
    texts = stream_text(chunks)
    assert texts[0] == texts[1]


def test_logit_bias(client) -> None:
    token = 400
    res = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                    logit_bias={str(token): 100}, extra_body={"return_token_ids": True})
    assert res.choices[0].model_extra["token_ids"] == [token] * 5


def test_stop_and_stop_token_ids(client) -> None:
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0).choices[0].text
    word = re.findall(r"[a-z]{3,}", whole)[1]
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stop=[word]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == whole[:whole.index(word)]


def test_guided_choice_and_regex(client) -> None:
    res = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=1,
                                    extra_body={"response_format": {"type": "choice", "choice": ["cat", "dog"]}})
    assert res.choices[0].text in ("cat", "dog")


def test_stream_error_and_done_lines_are_sse(server) -> None:
    r = post(server[0], "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": True})
    data = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "data: [DONE]" and all(json.loads(d[6:]) for d in data[:-1])
