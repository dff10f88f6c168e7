"""A real uvicorn server for tests (``running_server``) on the 260K-parameter stories model,
its request helpers, and the guarded server and one-line-error helpers of the hostile-input
tests. Fixtures here (``chatml``, ``guarded``, ``url``) are imported by the modules using them."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import ClassVar

import httpx
import torch
import uvicorn
from typer.testing import CliRunner

from verispec.api import load_model
from verispec.cli import app as cli_app
from verispec.drafters.base import DraftContext, StatelessDrafter
from verispec.server.app import make_server
from verispec.server.state import ServerConfig, build_state
from verispec.tree import DraftTree

MODEL = "stories260k"
BOOM = 509  # a prompt containing this token id makes the "explode" drafter raise


class ExplodingDrafter(StatelessDrafter):
    """Raises in propose for requests whose context holds ``boom``; drafts nothing otherwise."""

    name: ClassVar[str] = "explode"

    def __init__(self, boom: int = BOOM):
        self.boom = boom

    def propose(self, ctx: DraftContext) -> DraftTree:
        if self.boom in ctx.tokens:
            raise RuntimeError("drafter exploded")
        return DraftTree.chain(ctx.tokens[-1], [])



CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@functools.lru_cache(1)
def stories_native_model():
    """stories260k on the native backend (batched), loaded once per session (its load-time
    kernel calibration takes a while); the server tests share it."""
    torch.set_num_threads(2)
    return load_model(MODEL, backend="native")


def with_chat_template(model, template: str = CHAT_TEMPLATE):
    """``model`` given a toy chat template (on its own tokenizer copy), so the chat route can
    be exercised on a 260K-parameter model."""
    tok = copy.deepcopy(model.tokenizer)
    tok.chat_template = template
    return dataclasses.replace(model, tokenizer=tok, has_chat_template=True)



@contextlib.contextmanager
def running_server(model, name: str = MODEL, graceful_timeout: float = 20.0, drafters: dict | None = None,
                   **config) -> Iterator[tuple[str, object, uvicorn.Server]]:
    """A real uvicorn server on 127.0.0.1:<free port> in a thread; yields (base_url, state, server)."""
    cfg = ServerConfig(model=name, **({"max_batch": 8, "max_model_len": 512} | config))
    state = build_state(cfg, model=model, extra_drafters={"explode": ExplodingDrafter()} | (drafters or {}))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = make_server(state, graceful_timeout, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", state, server
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        assert not thread.is_alive()
        assert not state.worker._thread.is_alive()  # the engine thread stopped with the server



def metrics(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics").text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_until(pred, timeout: float = 20.0) -> None:
    deadline = time.time() + timeout
    while not pred():
        assert time.time() < deadline, "condition not reached in time"
        time.sleep(0.05)


def complete(base_url: str, **body) -> dict:
    r = httpx.post(f"{base_url}/v1/completions", json={"model": MODEL} | body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()



KEY = "sk-test-key"
# ChatML-like template on the stories tokenizer, whose added tokens <s> (1) and </s> (2) act as
# the control tokens of the turns
TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}<s>assistant\n"


AUTH = {"authorization": f"Bearer {KEY}"}


def post(url: str, route: str, body: dict | bytes, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps({"model": MODEL} | body).encode()
    return httpx.post(f"{url}/v1/{route}", content=content, timeout=60,
                      headers={"content-type": "application/json"} | AUTH | kw.pop("headers", {}), **kw)


def assert_error(r: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert code is None or err["code"] == code
    assert param is None or err["param"] == param
    return err



runner = CliRunner()


def one_line_exit_2(*args: str, input: bytes | str | None = None, needle: str = "") -> str:
    r = runner.invoke(cli_app, list(args), input=input)
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in r.output, r.output
    assert needle.lower() in lines[0].lower(), lines[0]
    return lines[0]


def wait_for_line(proc: subprocess.Popen, start: str, timeout: float) -> None:
    """Read ``proc``'s stdout until a line starting with ``start`` (asserted within ``timeout`` seconds)."""
    seen: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith(start):
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    assert seen and seen[-1].startswith(start), "".join(seen)
