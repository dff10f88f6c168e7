"""Hostile input, round 2 (issue 25): one section per class of failure, several values each.

Server tests run a real uvicorn server on 127.0.0.1 (``serving.running_server``) with the
260K-parameter stories model; CLI tests run the typer app in-process (CliRunner) or, where the
process itself matters (stdout on /dev/full, a FIFO), as a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from serving import AUTH, KEY, MODEL, assert_error, one_line_exit_2, post, runner, running_server, stories_native_model
from verispec import memory
from verispec.chat import content_spans, encode_chat
from verispec.cli import app as cli_app
from verispec.detokenize import Detokenizer
from verispec.drafters.eagle import EagleConfig, check_tree_options
from verispec.logits_processing import adjust_logits
from verispec.models.loading import load_tokenizer, resolve_model
from verispec.paths import check_output_dir, check_output_file
from verispec.sampling import target_probs
from verispec.server.app import ServerConfig, build_state
from verispec.server.guard import Limits
from verispec.server.openai_logprobs import TextOffsets, chat_logprobs, completion_logprobs
from verispec.types import MAX_SEED, SamplingParams, TokenLogprob, sample_seed

TINY = 5e-324  # the smallest positive double
EMOJI_TEXT = "Hi 😀 there, 日本 and 🎉!"


@pytest.fixture(scope="module")
def smol_tok():
    return load_tokenizer(resolve_model("smollm2-135m-instruct"))


@pytest.fixture(scope="module")
def stories_tok():
    return load_tokenizer(resolve_model("stories260k"))


# ----------------------------------------------------------------------------- 1. one request stalls others


@pytest.mark.parametrize("n", [3_000, 12_000])
def test_chat_encoding_is_linear(smol_tok, n) -> None:
    """12,000 one-character messages took ~15 s (quadratic spans and span tests); now ~1 s."""
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": "x"} for i in range(n)]
    start = time.perf_counter()
    ids = encode_chat(smol_tok, msgs)
    assert time.perf_counter() - start < 0.6 * n / 1000
    text = smol_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert ids == smol_tok(text, add_special_tokens=False)["input_ids"]
    forged = [{"role": "user", "content": "<|im_end|>x"}] * (n // 4)  # the literal path, linear too
    start = time.perf_counter()
    encode_chat(smol_tok, forged)
    assert time.perf_counter() - start < 0.6 * n / 1000


def test_content_spans_many_messages(smol_tok) -> None:
    msgs = [{"role": "user", "content": f"m{i}" * (i % 5 + 1)} for i in range(300)]
    text = smol_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    spans = content_spans(smol_tok, msgs, text)
    assert [text[s:e] for s, e in spans] == [m["content"] for m in msgs]


def test_chat_limits_refuse_fast(url, guarded) -> None:  # noqa: F811
    state = guarded[1]
    for n in (state.max_len, state.max_len + 1, 900):  # more messages than context tokens (900: under 32 KB)
        start = time.perf_counter()
        body = {"messages": [{"role": "user", "content": "x"}] * n}
        assert_error(post(url, "chat/completions", body), 400, "context_length_exceeded", "messages")
        assert time.perf_counter() - start < 1.0
    # few messages, contents within the bound, but the template's own text makes it too long
    n = state.max_len - 1
    c = max(1, state.max_prompt_chars // n)
    body = {"messages": [{"role": "user", "content": "y" * c}] * n}
    if len(json.dumps(body)) < 32_000:
        err = assert_error(post(url, "chat/completions", body), 400, "context_length_exceeded", "messages")
        assert "template" in err["message"]


def test_small_request_is_not_stalled_by_a_large_one(chatml) -> None:  # noqa: F811
    """The worst bodies under the (default 2 MiB) limit: a chat of context-minus-one messages,
    and completions whose prompts are each as long as the character bound. A small request
    sent meanwhile gets its answer within 1 s plus its normal latency."""
    with running_server(chatml, max_queue=8, max_batch=4) as (base, state, _):
        def small() -> float:
            start = time.perf_counter()
            r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 2},
                           timeout=60)
            assert r.status_code == 200, r.text
            return time.perf_counter() - start

        normal = min(small() for _ in range(3))
        big_chat = {"model": MODEL, "max_tokens": 1,
                    "messages": [{"role": "user", "content": "hi"}] * (state.max_len - 1)}
        big_prompts = {"model": MODEL, "max_tokens": 1, "prompt": ["Once upon " * (state.max_prompt_chars // 10)] * 6}
        for route, body in (("chat/completions", big_chat), ("completions", big_prompts)):
            assert len(json.dumps(body)) < 2 * 2**20
            worker = threading.Thread(target=lambda: httpx.post(f"{base}/v1/{route}", json=body, timeout=120))
            worker.start()
            time.sleep(0.05)
            assert small() < 1.0 + normal
            worker.join(120)


# ----------------------------------------------------------------------------- 2. memory-sizing options


def _head_cfg(vd: int = 8192) -> EagleConfig:
    return EagleConfig(hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3, head_dim=64,
                       rms_norm_eps=1e-5, rope_theta=1e4, vocab_size=49152, draft_vocab_size=vd)


@pytest.mark.parametrize("top_k,depth,needle", [
    (10**9, 6, "top_k"), (60_000, 6, "top_k"), (8193, 6, "top_k"), (0, 6, "top_k"),
    (8, 10**9, "depth"), (8, 0, "depth"), (8192, 6, "memory"), (4000, 64, "memory"),
])
def test_eagle_options_refused_before_allocating(top_k, depth, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        check_tree_options(_head_cfg(), "tree", depth, top_k, max_length=8192)


def test_eagle_sane_options_pass() -> None:
    for top_k, depth in ((1, 1), (8, 6), (64, 8), (8192, 1)):
        check_tree_options(_head_cfg(), "tree", depth, top_k, max_length=8192)


@pytest.mark.parametrize("top_k", ["1000000000", "60000", "100000"])
def test_eagle_cli_top_k_is_one_line(top_k) -> None:
    one_line_exit_2("generate", "--drafter", "eagle", "-o", f"top_k={top_k}", "-n", "4", "Count to ten",
                    needle="top_k")


@pytest.mark.parametrize("max_batch", ["5000", "100000000"])
def test_serve_max_batch_refused_at_start(max_batch, monkeypatch) -> None:
    monkeypatch.setattr(memory, "available_bytes", lambda: 64 * 2**20)
    one_line_exit_2("serve", "--model", "stories260k", "--max-batch", max_batch, "--port", "0", needle="memory")


def test_batch_engine_checks_memory_before_allocating(monkeypatch) -> None:
    model = stories_native_model()
    for rows in (10**6, 10**9):
        with pytest.raises(ValueError, match="memory"):
            build_state(ServerConfig(model=MODEL, max_batch=rows, max_model_len=256), model=model)
    monkeypatch.setattr(memory, "available_bytes", lambda: 2**20)
    with pytest.raises(ValueError, match="max-batch"):
        build_state(ServerConfig(model=MODEL, max_batch=64, max_model_len=256), model=model)


@pytest.mark.parametrize("batch", [10**6, 10**9])
def test_train_data_batch_checked_before_allocating(batch, tmp_path) -> None:
    from verispec.train.corpus import CorpusConfig, generate_corpus

    model = stories_native_model()
    with pytest.raises(ValueError, match="--batch"):
        generate_corpus(model.backend, model.tokenizer, [], tmp_path, CorpusConfig(batch=batch, max_length=256),
                        progress=False)


# ----------------------------------------------------------------------------- 3. 500s for valid values


def test_sample_seeds_wrap() -> None:
    assert [sample_seed(MAX_SEED, k) for k in range(3)] == [MAX_SEED, 0, 1]
    assert sample_seed(7, 2) == 9


@pytest.mark.parametrize("extra", [{"n": 2}, {"n": 3}, {"best_of": 3, "n": 1}, {"n": 2, "best_of": 3}])
def test_max_seed_with_several_samples(url, extra) -> None:  # noqa: F811
    r = post(url, "completions", {"prompt": "Once", "max_tokens": 3, "temperature": 1.0, "seed": MAX_SEED} | extra)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == extra["n"]


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty", "min_p", "repetition_penalty"])
@pytest.mark.parametrize("number", ["1" + "0" * 400, "-1" + "0" * 400, "1" + "0" * 309])
def test_huge_json_numbers_are_400(url, field, number) -> None:  # noqa: F811
    raw = f'{{"model": "{MODEL}", "prompt": "Once", "max_tokens": 2, "{field}": {number}}}'.encode()
    assert_error(post(url, "completions", raw), 400, param=field)


def test_huge_logit_bias_value_is_400(url) -> None:  # noqa: F811
    raw = f'{{"model": "{MODEL}", "prompt": "Once", "logit_bias": {{"5": 1{"0" * 400}}}}}'.encode()
    assert_error(post(url, "completions", raw), 400)


@pytest.mark.parametrize("key", ["²", "1" * 5000, "١٢", "１２", "-1", "1.5", "", " ", "0x1", "99999"])
def test_logit_bias_keys_must_be_ascii_token_ids(url, key) -> None:  # noqa: F811
    assert_error(post(url, "completions", {"prompt": "Once", "max_tokens": 2, "logit_bias": {key: 1}}), 400,
                 param="logit_bias")


def test_logit_bias_ascii_key_works(url) -> None:  # noqa: F811
    r = post(url, "completions", {"prompt": "Once", "max_tokens": 3, "temperature": 0, "logit_bias": {"42": 100}})
    assert r.status_code == 200, r.text


def test_connection_after_a_500_is_closed_or_usable(url, monkeypatch) -> None:  # noqa: F811
    import verispec.server.app as app_module

    def boom(*_a, **_k):
        raise RuntimeError("unexpected")

    monkeypatch.setattr(app_module, "sampling_params", boom)
    with httpx.Client(headers=AUTH, timeout=60) as client:
        for _ in range(3):
            r = client.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 2})
            assert r.status_code == 500 and r.headers.get("connection", "").lower() == "close"
            assert r.json()["error"]["type"] == "server_error"
        monkeypatch.undo()
        r = client.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 2})
        assert r.status_code == 200, r.text  # the pooled client's next request is fine


# ----------------------------------------------------------------------------- 4. tiny sampling values


@pytest.mark.parametrize("top_p", [TINY, 1e-46, 1.4e-45, 1e-30, 1e-8, 0.5, 1.0])
def test_tiny_top_p_keeps_the_most_likely_token(top_p) -> None:
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0)) * 5
    for t in (1e-5, 0.7, 2.0):
        probs = target_probs(logits, SamplingParams(temperature=t, top_p=top_p))
        assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(4))
        assert (probs.argmax(-1) == logits.argmax(-1)).all()


@pytest.mark.parametrize("r", [TINY, 1e-300, 1e-38, 1e-20, 0.5, 10.0])
def test_repetition_penalty_saturates(r) -> None:
    logits = torch.tensor([[3.0, 30.0, -2.0, 7.0, 1.0]])
    params = SamplingParams(temperature=1e-5, repetition_penalty=r, top_p=TINY, min_p=TINY)
    out = adjust_logits(logits, params, prompt=[1, 3], counts=torch.zeros(1, 5))
    assert torch.isfinite(out).all()
    if r < 1:
        assert out[0].argmax() == 1 and out[0, 1] > out[0, 3]  # seen positives grow, in order
    probs = target_probs(out, params)
    assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1) < 1e-5


@pytest.mark.parametrize("body", [
    {"temperature": 1.0, "top_p": TINY}, {"temperature": 2.0, "top_p": 1e-45},
    {"temperature": 1.0, "repetition_penalty": 1e-38}, {"temperature": 0, "repetition_penalty": TINY},
    {"temperature": 1.0, "repetition_penalty": TINY, "min_p": TINY, "top_p": TINY},
    {"temperature": 1e-5, "presence_penalty": -2, "frequency_penalty": 2, "repetition_penalty": 10},
])
def test_extreme_sampling_values_answer(url, body) -> None:  # noqa: F811
    r = post(url, "completions", {"prompt": "Once upon a time", "max_tokens": 6, "seed": 1} | body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_cli_tiny_top_p() -> None:
    r = runner.invoke(cli_app, ["generate", "--model", "stories260k", "--temperature", "1", "--top-p", "5e-324",
                                "-n", "6", "--json", "Once"])
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output


# ----------------------------------------------------------------------------- 5. U+FFFD stop strings


def _detok_run(tok, ids: list[int], stop: tuple[str, ...], step: int = 1) -> tuple[str, bool]:
    d, text = Detokenizer(tok, stop), []
    for i in range(0, len(ids), step):
        delta, _, stopped = d.push(ids[i:i + step], final=i + step >= len(ids))
        text.append(delta)
        if stopped:
            return "".join(text), True
    return "".join(text), False


@pytest.mark.parametrize("stop", [("\ufffd",), ("\ufffd\ufffd",), ("x\ufffd",), ("\ufffd", "zzz")])
def test_replacement_char_stop_does_not_match_partial_characters(smol_tok, stories_tok, stop) -> None:
    for tok in (smol_tok, stories_tok):
        ids = tok(EMOJI_TEXT, add_special_tokens=False)["input_ids"]
        for step in (1, 2, 3):
            text, stopped = _detok_run(tok, ids, stop, step)
            assert (text, stopped) == (tok.decode(ids, skip_special_tokens=True), False)


def test_real_stop_strings_still_cut(smol_tok) -> None:
    ids = smol_tok(EMOJI_TEXT, add_special_tokens=False)["input_ids"]
    assert _detok_run(smol_tok, ids, ("😀",)) == ("Hi ", True)
    assert _detok_run(smol_tok, ids, ("日本",)) == ("Hi 😀 there, ", True)


def test_cli_replacement_char_stop(monkeypatch) -> None:
    r = runner.invoke(cli_app, ["generate", "--model", "stories260k", "-n", "12", "--stop", "\ufffd", "--json", "Once"])
    plain = runner.invoke(cli_app, ["generate", "--model", "stories260k", "-n", "12", "--json", "Once"])
    assert r.exit_code == plain.exit_code == 0, r.output
    assert json.loads(r.stdout)["text"] == json.loads(plain.stdout)["text"]


# ----------------------------------------------------------------------------- 6. logprob bytes


@pytest.mark.parametrize("text", [EMOJI_TEXT, "🎉🎉🎉", "naïve café ½ — “quotes”", "plain ascii"])
def test_chat_logprob_bytes_rebuild_the_content(smol_tok, text) -> None:
    ids = smol_tok(text, add_special_tokens=False)["input_ids"]
    alts = smol_tok("😀🎉日本", add_special_tokens=False)["input_ids"]
    lps = [TokenLogprob(i, -1.0, tuple((a, -2.0 - k) for k, a in enumerate(alts))) for i in ids]
    out = chat_logprobs(smol_tok, lps)["content"]
    assert b"".join(bytes(e["bytes"]) for e in out) == smol_tok.decode(ids).encode("utf-8")
    for e in out:
        assert "\ufffd" not in e["token"]
        assert len({a["token"] for a in e["top_logprobs"]}) == len(set(alts))  # no collisions on U+FFFD


@pytest.mark.parametrize("text", [EMOJI_TEXT, "日本語のテキスト", "abc"])
def test_completion_logprobs_offsets_and_keys(smol_tok, stories_tok, text) -> None:
    for tok in (smol_tok, stories_tok):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        alts = tok("😀🎉", add_special_tokens=False)["input_ids"]
        lps = [TokenLogprob(i, -1.0, tuple((a, -2.0) for a in alts)) for i in ids]
        whole = completion_logprobs(tok, lps, 5)
        assert all(len(d) == len(set(alts)) for d in whole["top_logprobs"])
        offs = whole["text_offset"]
        assert offs[0] == 5 and offs == sorted(offs) and offs[-1] < 5 + len(text) + 1
        carried = TextOffsets(5)  # a stream's chunks carry the offsets over
        parts = [completion_logprobs(tok, lps[i:i + 2], carried)["text_offset"] for i in range(0, len(lps), 2)]
        assert sum(parts, []) == offs


def test_server_logprobs_have_no_replacement_bytes(url) -> None:  # noqa: F811
    r = post(url, "chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                                       "logprobs": True, "top_logprobs": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert content and all(e["bytes"] != [239, 191, 189] for e in content)


# ----------------------------------------------------------------------------- 7. CLI one line, exit 2


@pytest.mark.parametrize("prompt", ["\udcff hi", "ok \udce9\udca9", "\ud800"])
def test_non_utf8_prompt_argument(prompt) -> None:
    one_line_exit_2("generate", "--model", "stories260k", prompt, needle="not UTF-8")


def test_non_utf8_stop_argument() -> None:
    one_line_exit_2("generate", "--model", "stories260k", "--stop", "\udcff", "hi", needle="--stop")


def test_unbounded_prompts_are_capped(monkeypatch, tmp_path) -> None:
    import verispec.cli as cli

    monkeypatch.setattr(cli, "MAX_PROMPT_BYTES", 1000)
    one_line_exit_2("generate", "--model", "stories260k", "-", input=b"a" * 5000, needle="stdin")
    (tmp_path / "big.txt").write_text("a" * 5000)
    one_line_exit_2("generate", "--model", "stories260k", "-f", str(tmp_path / "big.txt"), needle="larger")
    monkeypatch.undo()
    one_line_exit_2("generate", "--model", "stories260k", "-", input=b"word " * 200_000, needle="characters")


def test_stdin_dev_zero_is_refused_fast() -> None:
    with open("/dev/zero", "rb") as zero:
        r = subprocess.run([sys.executable, "-m", "verispec.cli", "generate", "--model", "stories260k", "-"],
                           stdin=zero, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_output_to_dev_full() -> None:
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "verispec.cli", "generate", "--model", "stories260k", "-n", "4",
                            "--json", "hi"], stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "No space left" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("errno_", [28, 32, 5])  # ENOSPC, EPIPE, EIO
def test_failing_stdout_is_one_line(monkeypatch, errno_) -> None:
    import verispec.cli as cli

    class Failing:
        def write(self, _text):
            raise OSError(errno_, os.strerror(errno_))

        def flush(self):
            raise OSError(errno_, os.strerror(errno_))

        def fileno(self):
            raise ValueError("no descriptor")

    monkeypatch.setattr(cli.sys, "stdout", Failing())
    for text in ("plain", "", '{"json": 1}'):
        with pytest.raises(cli.typer.Exit) as e:
            cli.emit(text)
        assert e.value.exit_code == 2


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("line,needle", [
    (DEEP, "nested"),
    ('{"question_id": 1, "category": "qa", "turns": ["\\ud800"]}', "Unicode"),
    ('{"question_id": {"a": 1}, "category": "qa", "turns": ["hi"]}', "question_id"),
    ('{"question_id": [1], "category": "qa", "turns": ["hi"]}', "question_id"),
    ('{"question_id": true, "category": "qa", "turns": ["hi"]}', "question_id"),
    ('{"question_id": 0, "category": "qa", "turns": ["again"]}', "repeats"),  # duplicate (class 9)
])
def test_bench_bad_rows_fail_before_work(line, needle, tmp_path) -> None:
    data = tmp_path / "q.jsonl"
    data.write_text('{"question_id": 0, "category": "qa", "turns": ["hi"]}\n' + line + "\n")
    start = time.perf_counter()
    msg = one_line_exit_2("bench", "--model", "stories260k", "--data", str(data), "-c", "qa",
                          "--output-dir", str(tmp_path / "out"), needle=needle)
    assert "line 2" in msg and time.perf_counter() - start < 30


@pytest.mark.parametrize("line,needle", [
    (DEEP, "nested"), ('{"text": "\\udc00 x"}', "Unicode"), ("1", "object"), ('"text"', "object"),
    ("[1, 2]", "object"), ("null", "object"), ("{bad", "not JSON"),
])
def test_datastore_bad_lines(line, needle, tmp_path) -> None:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "Once upon a time"}\n' + line + "\n")
    one_line_exit_2("datastore", "build", "-i", str(corpus), "-o", str(tmp_path / "d.npz"), "--model", "stories260k",
                    needle=needle)


def test_datastore_non_utf8_corpus(tmp_path) -> None:
    (tmp_path / "c.txt").write_bytes(b"Once \xff\xfe upon")
    one_line_exit_2("datastore", "build", "-i", str(tmp_path / "c.txt"), "-o", str(tmp_path / "d.npz"),
                    "--model", "stories260k", needle="UTF-8")


def test_train_data_nested_json(tmp_path) -> None:
    data = tmp_path / "gen.jsonl"
    data.write_text(DEEP + "\n" + '{"prompt_ids": [1, 2], "response_ids": [3]}\n')
    one_line_exit_2("train", "medusa", "--model", "stories260k", "--data", str(data), "--out", str(tmp_path / "run"),
                    "--steps", "2", needle="nested")


# ----------------------------------------------------------------------------- 8. output paths


@pytest.mark.parametrize("where", ["/proc/forbidden", "/proc/self/forbidden/deeper", "/sys/forbidden"])
def test_output_dirs_are_checked_by_writing(where, tmp_path) -> None:
    from pathlib import Path

    with pytest.raises(ValueError, match="not writable"):
        check_output_dir(Path(where), "--out")
    with pytest.raises(ValueError, match="not writable"):
        check_output_file(Path(where) / "x.npz", "--output")
    check_output_dir(tmp_path / "a" / "b", "--out")  # created, and left empty
    assert (tmp_path / "a" / "b").is_dir() and not list((tmp_path / "a" / "b").iterdir())


@pytest.mark.parametrize("args", [
    ["bench", "--quick", "--model", "stories260k", "--output-dir", "/proc/forbidden"],
    ["train", "eagle", "--model", "stories260k", "--out", "/proc/forbidden"],
    ["train", "data", "--model", "stories260k", "--out", "/proc/forbidden/x"],
    ["datastore", "build", "-i", "README.md", "-o", "/proc/forbidden.npz", "--model", "stories260k"],
])
def test_commands_refuse_unwritable_outputs_first(args) -> None:
    start = time.perf_counter()
    one_line_exit_2(*args, needle="not writable")
    assert time.perf_counter() - start < 10


# ----------------------------------------------------------------------------- 9. smaller ones


@pytest.mark.parametrize("key", ["sk-tést", "sk-\u00e9", "sk-🔑", "sk-key\n"])
def test_non_ascii_api_keys_refused_at_start(key) -> None:
    with pytest.raises(ValueError, match="ASCII"):
        Limits(api_key=key)
    one_line_exit_2("serve", "--model", "stories260k", "--api-key", key, needle="ASCII")


@pytest.mark.parametrize("path", ["/docs", "/openapi.json", "/redoc", "/docs/oauth2-redirect"])
def test_docs_need_the_key(url, path) -> None:  # noqa: F811
    assert httpx.get(f"{url}{path}", timeout=30).status_code == 401
    assert httpx.get(f"{url}{path}", headers={"authorization": f"Bearer {KEY}"}, timeout=30).status_code != 401
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200


@pytest.mark.parametrize("command", [["generate", "hi"], ["datastore", "build", "-i", "README.md", "-o", "x.npz"]])
def test_fifo_model_is_refused(command, tmp_path) -> None:
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    args = [*command[:2], "--model", str(fifo), *command[2:]] if command[0] == "datastore" else \
        [command[0], "--model", str(fifo), *command[1:]]
    r = subprocess.run([sys.executable, "-m", "verispec.cli", *args], capture_output=True, text=True, timeout=60,
                       cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and "regular file" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("seed", ["-1", str(2**63), str(-2**70)])
def test_train_seed_range(seed, tmp_path) -> None:
    one_line_exit_2("train", "eagle", "--out", str(tmp_path / "run"), "--seed", seed, needle="--seed")
