"""The endpoints and fields clients call beyond chat and completions (issue 44, section 3):
/tokenize and /detokenize in vLLM's shapes, ``logprobs: 0`` naming the sampled token, usage's
``prompt_tokens_details.cached_tokens``, OpenAI's wording of a context overflow (what litellm
matches to raise ``ContextWindowExceededError``), and SSE comment lines while a streamed request
waits for its first token. A real server on the stories model (``serving.running_server``)."""

from __future__ import annotations

import json
import time
from typing import ClassVar

import httpx
import openai
import pytest
from serving import MODEL, running_server, stories_native_model, with_chat_template

from verispec.drafters.base import DraftContext, StatelessDrafter
from verispec.tree import DraftTree

# litellm's exception_mapping_utils: a 400 whose message holds this is a ContextWindowExceededError
LITELLM_PHRASE = "this model's maximum context length is"
# serving.TEMPLATE, its generation prompt added only when asked
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


class SlowStart(StatelessDrafter):
    """Takes 2.5 s to start a request (before its prefill): a long prefill, as the client sees it."""

    name: ClassVar[str] = "slow-start"

    def start(self, request_id: str, prompt_ids: list[int]) -> None:
        time.sleep(2.5)

    def propose(self, ctx: DraftContext) -> DraftTree:
        return DraftTree.chain(ctx.tokens[-1], [])


@pytest.fixture(scope="module")
def server():
    model = with_chat_template(stories_native_model(), TEMPLATE)
    with running_server(model, drafters={"slow-start": SlowStart()}) as s:
        yield s


def _post(url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{route}", json=body, timeout=60)


def test_tokenize_and_detokenize_in_vllm_shapes(server) -> None:
    url, state, _ = server
    tok = state.model.tokenizer
    r = _post(url, "/tokenize", {"model": MODEL, "prompt": "Once upon a time"})
    assert r.status_code == 200, r.text
    out = r.json()
    ids = tok("Once upon a time")["input_ids"]  # BOS added, as /v1/completions encodes the prompt
    assert out == {"count": len(ids), "max_model_len": 512, "tokens": ids}
    plain = _post(url, "/tokenize", {"prompt": "Once upon a time", "add_special_tokens": False}).json()
    assert plain["tokens"] == tok("Once upon a time", add_special_tokens=False)["input_ids"] == ids[1:]
    assert _post(url, "/detokenize", {"model": MODEL, "tokens": plain["tokens"]}).json()["prompt"] == "Once upon a time"
    # the prompt the completions endpoint runs is the one /tokenize counts
    r = _post(url, "/v1/completions", {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1,
                                       "return_token_ids": True})
    assert r.json()["choices"][0]["prompt_token_ids"] == ids
    strs = _post(url, "/tokenize", {"prompt": "Once", "return_token_strs": True}).json()["token_strs"]
    assert len(strs) == len(tok("Once")["input_ids"]) and strs[-1].strip() == "Once"


def test_tokenize_a_chat_as_chat_completions_does(server) -> None:
    url, state, _ = server
    messages = [{"role": "user", "content": "Hi <s>there"}]  # a control-token string stays literal text
    out = _post(url, "/tokenize", {"messages": messages}).json()
    r = _post(url, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 1,
                                            "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert out["tokens"] == r.json()["choices"][0]["prompt_token_ids"] and out["count"] == len(out["tokens"])
    assert out["tokens"].count(1) == 2  # <s> of the template's two turns, not the user's
    bare = _post(url, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert bare["tokens"] == out["tokens"][:bare["count"]] and bare["count"] < out["count"]


def test_tokenize_llama_cpp_fields(server) -> None:
    url, state, _ = server
    out = _post(url, "/tokenize", {"content": "Once", "add_special": False, "with_pieces": True}).json()
    ids = state.model.tokenizer("Once", add_special_tokens=False)["input_ids"]
    assert [t["id"] for t in out["tokens"]] == ids and all(isinstance(t["piece"], str) for t in out["tokens"])
    assert _post(url, "/detokenize", {"tokens": ids}).json()["content"] == "Once"


@pytest.mark.parametrize("route, body, status, param", [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, None),
    ("/tokenize", {}, 400, None),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "x" * 200_000}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "model": "gpt-4"}, 404, "model"),
    ("/tokenize", {"prompt": "\ud800"}, 400, None),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/detokenize", {"tokens": [1, 512]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [5] * 513}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
])
def test_token_routes_refuse_bad_input_in_one_line(server, route, body, status, param) -> None:
    r = httpx.post(f"{server[0]}{route}", content=json.dumps(body).encode(), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and "\n" not in err["message"] and (param is None or err["param"] == param)


def test_logprobs_zero_names_the_sampled_token(server) -> None:
    url = server[0]
    for stream in (False, True):
        r = _post(url, "/v1/completions", {"model": MODEL, "prompt": "Once upon", "max_tokens": 4, "logprobs": 0,
                                           "temperature": 0, "stream": stream})
        assert r.status_code == 200, r.text
        if stream:
            chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: {")]
            lps = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
            tokens = [t for lp in lps for t in lp["tokens"]]
            tops = [t for lp in lps for t in lp["top_logprobs"]]
            values = [v for lp in lps for v in lp["token_logprobs"]]
        else:
            lp = r.json()["choices"][0]["logprobs"]
            tokens, tops, values = lp["tokens"], lp["top_logprobs"], lp["token_logprobs"]
        assert len(tokens) == 4 and [list(t) for t in tops] == [[t] for t in tokens]
        assert [next(iter(t.values())) for t in tops] == values


def test_usage_reports_cached_tokens(server) -> None:
    url = server[0]
    r = _post(url, "/v1/completions", {"model": MODEL, "prompt": "Once", "max_tokens": 2})
    usage = r.json()["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": r.json()["verispec"]["cached_tokens"]}
    r = _post(url, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                            "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}})
    last = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")][-1]
    assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # native backend: no prefix cache


def test_context_overflow_in_openai_wording(server) -> None:
    url = server[0]
    r = _post(url, "/v1/completions", {"model": MODEL, "prompt": [5] * 500, "max_tokens": 100})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    assert err["message"] == ("This model's maximum context length is 512 tokens. However, you requested 600 tokens "
                              "(500 in the prompt, 100 in the completion). Please reduce the length of the prompt "
                              "or completion.")
    r = _post(url, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                            "max_tokens": 600})
    assert r.status_code == 400 and "in the messages, 600 in the completion" in r.json()["error"]["message"]
    for body in ({"prompt": [5] * 512}, {"prompt": "x" * 100_000},
                 {"messages": [{"role": "user", "content": "x" * 100_000}]}):
        route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        err = _post(url, route, {"model": MODEL} | body).json()["error"]
        assert LITELLM_PHRASE in err["message"].lower() and err["code"] == "context_length_exceeded", err


def test_stream_says_it_is_alive_before_the_first_token(server) -> None:
    url = server[0]
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 2, "stream": True, "drafter": "slow-start"}
    lines = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line:
                lines.append(line)
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data:"))
    comments = [line for line in lines[:first_data] if line.startswith(":")]
    assert comments and comments[0].startswith(": queued or prefilling"), lines
    assert lines[-1] == "data: [DONE]"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)  # its SSE decoder skips comments
    chunks = list(client.completions.create(model=MODEL, prompt="Once", max_tokens=2, stream=True, temperature=0,
                                            extra_body={"drafter": "slow-start"}))
    assert chunks and chunks[-1].choices[0].finish_reason == "length"
