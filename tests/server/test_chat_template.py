"""Hostile chat templates (issue 32, class 7): a chat template is the model file's code.

Runaway templates (nested loops, loops with no output, string multiplication, macro recursion,
huge joins, a string doubled in a namespace) end within their time, memory or size bound with
one line; every template error is one line; a runaway render in a server leaves template-free
requests and shutdown alone; ``verispec generate`` on a GGUF whose template hangs prints one
line and exits 2. Normal templates render exactly as transformers' ``apply_chat_template``.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from gguf_fixtures import STRING, tiny_qwen2, write_gguf
from serving import (CHAT_TEMPLATE, MODEL, TEMPLATE, assert_error, complete, one_line_exit_2, runner, running_server,
                     stories_native_model, with_chat_template)

from verispec.chat import encode_chat, render_chat
from verispec.chat_template import ChatTemplate, ChatTooLong, RenderBounds, TemplateError
from verispec.cli import app as cli_app
from verispec.models.resolve import is_installed, resolve_model
from verispec.models.tokenizer import load_tokenizer
from verispec.server.state import ServerConfig

HI = [{"role": "user", "content": "hi"}]
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}"
SILENT_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
RECURSION = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"
TIME_S = 0.5  # small bounds keep the tests fast...
SLACK_S = 10.0  # ...and renders that end by another bound get time to spare on a loaded machine
MEMORY_MB = 64


def render(source: str, messages=HI, max_chars: int = 10_000, timeout_s: float = SLACK_S,
           memory_mb: int = MEMORY_MB) -> str:
    template = ChatTemplate(source, {"bos_token": "<s>"}, RenderBounds(timeout_s, memory_mb))
    return template.render([(messages, max_chars)])[0]


def one_line(e: pytest.ExceptionInfo) -> str:
    message = str(e.value)
    assert message and "\n" not in message and "Traceback" not in message, message
    return message


# ----------------------------------------------------------------------------- runaways are bounded


@pytest.mark.parametrize("source, error, needle", [
    (NESTED_LOOPS, ChatTooLong, "more than 10000 characters"),  # output: the streamed render stops
    (SILENT_LOOPS, TemplateError, f"did not finish within {TIME_S:g} s"),  # no output: the clock stops it
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% if i < 0 %}x{% endif %}{% endfor %}{% endfor %}",
     TemplateError, "did not finish"),
    ("{{ messages[0].content * 300000000 }}", TemplateError, f"more than {MEMORY_MB} MiB"),  # 600 MB in one call
    ("{{ messages[0].content * 3000000 }}", ChatTooLong, "more than 10000 characters"),  # 6 MB: fits, too long
    ("{% for i in range(100000) %}{{ range(100000) | join(',') }}{% endfor %}", ChatTooLong, "more than 10000"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
     TemplateError, "MiB of memory"),  # 2^41 bytes by doubling
    ("{% set ns = namespace(s=[0]) %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     TemplateError, "MiB of memory"),
    (RECURSION, TemplateError, "recursed too deeply"),
    ("{% macro f(n) %}{% for i in range(100) %}{{ f(n + 1) }}{% endfor %}{% endmacro %}{{ f(0) }}", TemplateError,
     "recursed too deeply"),
])
def test_runaway_templates_are_bounded(source, error, needle) -> None:
    timeout_s = TIME_S if "did not finish" in needle else SLACK_S
    start = time.monotonic()
    with pytest.raises(error) as e:
        render(source, timeout_s=timeout_s)
    assert needle in one_line(e)
    assert time.monotonic() - start < timeout_s + SLACK_S  # the bound, and slack; hours (or swapping) without it
    assert render(CHAT_TEMPLATE) == "user: hi\nassistant:"  # the worker renders again (a fresh one if killed)


@pytest.mark.parametrize("timeout_s", [0.3, 1.0])
def test_the_time_bound_is_the_configured_one(timeout_s) -> None:
    start = time.monotonic()
    with pytest.raises(TemplateError, match=f"within {timeout_s:g} s"):
        render(SILENT_LOOPS, timeout_s=timeout_s)
    assert timeout_s <= time.monotonic() - start < timeout_s + SLACK_S


@pytest.mark.parametrize("max_chars", [5, 100, 4_000])
def test_the_size_bound_is_the_callers(max_chars) -> None:
    """The rendering passes ``max_chars`` by one character: refused; at exactly ``max_chars``: rendered."""
    fits = [{"role": "user", "content": "x" * (max_chars - len("user: \nassistant:"))}] if max_chars > 20 else HI
    text = render(CHAT_TEMPLATE, fits, max_chars=len(render(CHAT_TEMPLATE, fits)))
    with pytest.raises(ChatTooLong, match=f"more than {len(text) - 1} characters"):
        render(CHAT_TEMPLATE, fits, max_chars=len(text) - 1)


def test_render_bounds_are_checked() -> None:
    for bad in ({"timeout_s": 0}, {"timeout_s": -1}, {"timeout_s": float("nan")}, {"memory_mb": 0}):
        with pytest.raises(ValueError):
            RenderBounds(**bad)
        with pytest.raises(ValueError):
            ServerConfig(**{f"chat_template_{k}": v for k, v in bad.items()})
    for bad in ("0", "-1", "nan"):
        one_line_exit_2("serve", "--chat-template-timeout", bad, needle="chat template timeout")


# ----------------------------------------------------------------------------- template errors are one line


@pytest.mark.parametrize("source, needle", [
    ("{% for m in messages %}", "syntax error at line 1"),
    ("{% for m in %}{% endfor %}", "syntax error"),
    ("line one\n{{ messages[0] | nosuchfilter }}", "syntax error at line 2"),
    ("{% generation %}{{ messages[0].content }}", "syntax error"),  # the tag must be closed
])
def test_syntax_errors_fail_at_compile(source, needle) -> None:
    with pytest.raises(TemplateError) as e:
        ChatTemplate(source, {})
    assert needle in one_line(e)


@pytest.mark.parametrize("source, needle", [
    ("{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}",
     "refused the messages: Conversation roles must alternate"),
    ("{{ raise_exception('two\nlines and ' ~ 'x' * 5000) }}", "refused the messages: two lines and xxx"),
    ("{{ nothing.here }}", "UndefinedError: 'nothing' is undefined"),
    ("{{ messages[0].content + 1 }}", "TypeError"),
    ("{{ messages.__class__.__mro__ }}", "SecurityError"),
    ("{{ messages[0].content.__class__.__base__ }}", "SecurityError"),
    ("{% set ns = namespace(_private=1) %}", "underscore-prefixed"),
    ("{{ messages[5].content }}", "UndefinedError"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
])
def test_render_errors_are_one_line(source, needle) -> None:
    with pytest.raises(TemplateError) as e:
        render(source)
    line = one_line(e)
    assert needle in line and len(line) < 400, line


def test_messages_that_are_not_json_are_one_line() -> None:
    with pytest.raises(TemplateError) as e:
        render(CHAT_TEMPLATE, [{"role": "user", "content": b"bytes"}])
    assert "text" in one_line(e)


# ----------------------------------------------------------------------------- normal templates: transformers' text


FEATURES = """{%- set ns = namespace(n=0) -%}
{%- for m in messages %}
  {%- if m.role == 'system' %}{% continue %}{% endif %}
  {%- set ns.n = ns.n + 1 %}
<|im_start|>{{ m.role }} {{ ns.n }} {{ dict(a=1) | tojson }} {{ {'k': m.content} | tojson }}
{% if m.role == 'assistant' %}{% generation %}{{ m.content | trim }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}
  {%- if loop.last %}{% break %}{% endif %}
{%- endfor %}
{%- if tools is none and documents is none %}[no tools]{% endif %}{{ eos_token }}{{ strftime_now('%Y') | length }}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

CHATS = [
    HI,
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo 日本 😀 <b>&amp;</b>"},
     {"role": "assistant", "content": "  ok\n"}, {"role": "user", "content": "again\n\n"}],
    [{"role": "user", "content": f"m{i}"} for i in range(30)],
]


@pytest.fixture(scope="module")
def smol_tok():
    return load_tokenizer(resolve_model("smollm2-135m-instruct"))


@pytest.mark.parametrize("template", [None, TEMPLATE, CHAT_TEMPLATE, FEATURES])
@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_same_text_as_transformers(smol_tok, template, chat) -> None:
    """SmolLM2's own template (None), the tests' ChatML-like ones and one using every feature
    transformers adds (namespace, dict, tojson, loop controls, generation, strftime_now)."""
    if template is not None:
        smol_tok.chat_template = template
    try:
        theirs = smol_tok.apply_chat_template(CHATS[chat], add_generation_prompt=True, tokenize=False)
        assert render_chat(smol_tok, CHATS[chat]).text == theirs
        assert encode_chat(smol_tok, CHATS[chat]) == smol_tok(theirs, add_special_tokens=False)["input_ids"]
    finally:
        smol_tok.chat_template = load_tokenizer(resolve_model("smollm2-135m-instruct")).chat_template


@pytest.mark.skipif(not is_installed("qwen2.5-coder-0.5b-instruct"), reason="the Qwen2.5-Coder parts are not installed")
def test_same_text_as_transformers_qwen() -> None:
    tok = load_tokenizer(resolve_model("qwen2.5-coder-0.5b-instruct"))
    for messages in CHATS:
        theirs = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert render_chat(tok, messages).text == theirs


# ----------------------------------------------------------------------------- the server


@pytest.mark.extended  # waits out a 5 s render bound: run by .ci/run (make test-extended)
def test_runaway_render_leaves_completions_and_shutdown_alone() -> None:
    """A chat whose render runs away (5 s bound) is in progress: /v1/completions still answer
    (before: they queued behind it on the one tokenizer thread forever), the chat gets a
    one-line 400, and shutdown waits for a runaway render no longer than its bound (before:
    forever)."""
    model = with_chat_template(stories_native_model(), SILENT_LOOPS)
    timeout_s = 5.0
    with running_server(model, chat_template_timeout_s=timeout_s) as (url, _, server):
        chat: dict = {}

        def post_chat() -> None:
            chat["response"] = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": HI},
                                          timeout=60)

        thread = threading.Thread(target=post_chat)
        thread.start()
        time.sleep(0.3)  # the render is under way
        for prompt in ("Once upon a time", "The cat"):
            assert complete(url, prompt=prompt, max_tokens=4, temperature=0)["choices"][0]["text"]
        # answered while the render runs: its chat has no answer yet (the order proves it; a clock
        # would also count how slowly a busy machine runs the two completions)
        assert thread.is_alive()
        thread.join(timeout_s + 30)
        err = assert_error(chat["response"], 400, "chat_template_error", "messages")
        assert f"did not finish within {timeout_s:g} s" in err["message"]
        thread = threading.Thread(target=post_chat)  # a second runaway, then shutdown
        thread.start()
        time.sleep(0.3)
        stop = time.monotonic()
        server.should_exit = True
    thread.join(30)
    assert time.monotonic() - stop < timeout_s + 10 and chat["response"].status_code in (400, 503)


@pytest.mark.parametrize("source, needle", [
    ("{% for m in messages %}", "syntax error"),
    ("{% if %}", "syntax error"),
])
def test_server_with_a_broken_template_serves_completions(source, needle) -> None:
    model = with_chat_template(stories_native_model(), source)
    with pytest.warns(UserWarning, match=needle):
        server = running_server(model)
        url = server.__enter__()[0]
    try:
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": HI}, timeout=60)
        assert needle in assert_error(r, 400, "chat_template_error", "messages")["message"]
        assert complete(url, prompt="Once upon a time", max_tokens=2)["choices"][0]["text"]
    finally:
        server.__exit__(None, None, None)


@pytest.mark.parametrize("source, code, needle", [
    ("{{ messages[0].content * 300000000 }}", "chat_template_error", "MiB of memory"),
    ("{{ messages[0].content * 30000 }}", "context_length_exceeded", "characters"),
    ("{{ raise_exception('no system messages') }}", "chat_template_error", "no system messages"),
    ("{{ messages[0].nope.deeper }}", "chat_template_error", "UndefinedError"),
])
def test_server_template_failures_are_400(source, code, needle) -> None:
    model = with_chat_template(stories_native_model(), source)
    with running_server(model, chat_template_memory_mb=MEMORY_MB, chat_template_timeout_s=SLACK_S) as (url, _, _):
        for stream in (False, True):
            r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": HI, "stream": stream},
                           timeout=60)
            assert needle in assert_error(r, 400, code, "messages")["message"]


# ----------------------------------------------------------------------------- the CLI


@pytest.mark.parametrize("source, needle", [
    (SILENT_LOOPS, "did not finish within 2 s"),
    (NESTED_LOOPS, "characters"),
    ("{{ messages[0].content * 300000000 }}", "MiB of memory"),
    ("{% for m in messages %}{{ m.content }", "syntax error"),
    ("{{ raise_exception('only user messages') }}", "only user messages"),
])
def test_generate_with_a_hostile_gguf_template(tmp_path, source, needle) -> None:
    meta, tensors = tiny_qwen2()
    meta["tokenizer.chat_template"] = (STRING, source)
    write_gguf(tmp_path / "t.gguf", meta, tensors)
    args = ["generate", "--model", str(tmp_path / "t.gguf"), "--max-new-tokens", "2", "hi"]
    start = time.monotonic()
    one_line_exit_2(*args, needle=needle)
    assert time.monotonic() - start < 60  # forever before
    r = runner.invoke(cli_app, [*args, "--no-chat"])  # the model file is still usable without its template
    assert r.exit_code == 0, r.output


def test_the_shared_render_process_is_reaped_at_exit() -> None:
    """A process that rendered a chat exits without a ResourceWarning: the render process is reaped
    and its pipes closed at exit (``make test`` printed one after its summary)."""
    import subprocess
    import sys

    code = ("from verispec.chat_template import ChatTemplate\n"
            "print(ChatTemplate(\"{{ messages[0]['content'] }}\", {}).render([([{'role': 'user', 'content': 'hi'}], 100)]))")
    r = subprocess.run([sys.executable, "-W", "always::ResourceWarning", "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "['hi']", r.stderr
    assert "ResourceWarning" not in r.stderr, r.stderr
