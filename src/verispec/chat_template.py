"""A model's chat template, rendered in a worker process under time, memory and size bounds.

A chat template is code that comes with the model file (a GGUF's ``tokenizer.chat_template``,
a tokenizer_config.json), and model files come from strangers. jinja2's sandbox, which
transformers renders templates in, stops escapes but not runaways: two nested loops over
``range(100000)`` run for hours, ``{{ content * 300000000 }}`` allocates gigabytes in one C
call, and a Python thread stuck in either can be neither interrupted nor killed (a server's
only tokenizer thread wedges, and shutdown waits for it forever).

So templates are compiled and rendered in a separate process (``python -m
verispec.chat_template``: the standard library and jinja2, nothing of the caller's state),
started on first use, that the caller can kill:

- time: the caller waits at most ``timeout_s`` (wall clock) for a render, then kills the
  worker (the next render starts a fresh one). The worker also caps its own CPU time
  (RLIMIT_CPU) around each render, so it dies by itself if its parent is killed mid-render.
- memory: around each render the worker caps its address space (RLIMIT_AS) at its size plus
  ``memory_mb``, so one huge expression fails with MemoryError (the worker then exits).
- output: the template is rendered as a stream (``Template.generate``) that stops as soon
  as the text passes the caller's character bound (``ChatTooLong``).

Compiling a template (``ChatTemplate``) sends it to the worker once, so a syntax error is one
line at load instead of at every request. The environment is transformers'
``apply_chat_template``'s: ``ImmutableSandboxedEnvironment`` with trim_blocks, lstrip_blocks,
loop controls and ``{% generation %}``; ``raise_exception``, its ``tojson``, ``strftime_now``
and its restricted ``dict`` and ``namespace``; the variables are the tokenizer's special
tokens, ``messages``, ``tools`` and ``documents`` (None) and ``add_generation_prompt``; so the
text is the same (tests compare). Every failure is a ``TemplateError`` (a ValueError) of one
line: what the template got wrong, or which bound it passed.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import resource
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

DEFAULT_TIMEOUT_S = 2.0  # real templates render in milliseconds
DEFAULT_MEMORY_MB = 512  # far above what a chat that fits a context needs
DEFAULT_MAX_CHARS = 1 << 24  # a render's character bound when the caller gives none
START_TIMEOUT_S = 60.0  # a worker's start-up (Python and jinja2: ~0.1 s on an idle machine)
QUOTE_CHARS = 300  # an error line quotes at most this much of the template's own message


class TemplateError(ValueError):
    """The chat template does not compile, failed while rendering, or passed a bound (one line)."""


class ChatTooLong(ValueError):
    """The rendered chat is longer than the caller's character bound (nothing was tokenized)."""


@dataclass(frozen=True)
class RenderBounds:
    """``timeout_s``: wall-clock seconds one render (all the chats of one call) may take;
    ``memory_mb``: memory the worker may allocate during it, beyond its own."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    memory_mb: int = DEFAULT_MEMORY_MB

    def __post_init__(self) -> None:
        if not 0 < self.timeout_s <= 3600:
            raise ValueError(f"the chat template timeout must be in (0, 3600] seconds, got {self.timeout_s}")
        if not 16 <= self.memory_mb <= 1 << 20:
            raise ValueError(f"the chat template memory bound must be in [16, {1 << 20}] MiB, got {self.memory_mb}")


class ChatTemplate:
    """A chat template, compiled once (a syntax error raises ``TemplateError`` here), rendered
    by ``render`` in ``worker`` (default: this process's shared one) under ``bounds``.
    ``variables``: what the template sees besides the messages (the tokenizer's special tokens)."""

    def __init__(self, source: str, variables: dict[str, Any], bounds: RenderBounds = RenderBounds(),
                 worker: RenderWorker | None = None):
        self.source, self.variables, self.bounds = source, variables, bounds
        self.worker = worker or SHARED_WORKER
        self.render([])

    def render(self, chats: list[tuple[list[dict[str, Any]], int]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> list[str]:
        """The text of each chat ``(messages, max_chars)``, in one round trip to the worker;
        ``ChatTooLong`` when one passes its ``max_chars``. Keys whose value is None are
        dropped from messages (as transformers does: templates test for missing keys).
        ``tools``: the functions the template renders for the model (OpenAI's ``tools``)."""
        request = {"source": self.source, "variables": self.variables, "add_generation_prompt": add_generation_prompt,
                   "tools": tools or None,
                   "chats": [[[{k: v for k, v in m.items() if v is not None} for m in messages], max_chars]
                             for messages, max_chars in chats],
                   "timeout_s": self.bounds.timeout_s, "memory_mb": self.bounds.memory_mb}
        answer = self.worker.call(request, self.bounds.timeout_s)
        if "too_long" in answer:
            raise ChatTooLong(answer["too_long"])
        if "error" in answer:
            raise TemplateError(answer["error"])
        return answer["texts"]


class RenderWorker:
    """One render process, used by one call at a time: started on first use, killed when a
    render passes its time bound (or by ``stop``), and started again by the next call."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None

    def call(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """The worker's answer to ``request``; a render past ``timeout_s`` kills the worker."""
        try:
            payload = (json.dumps(request) + "\n").encode()
        except (TypeError, ValueError) as e:  # a message value that is not JSON (bytes, an object)
            raise TemplateError(f"chat messages must hold text, numbers, lists and dicts only: {e}") from None
        with self._lock:
            proc = self._started()
            try:
                proc.stdin.write(payload)
                proc.stdin.flush()
                answer = _read_line(proc, time.monotonic() + timeout_s)
            except TimeoutError:
                self._kill(proc)
                raise TemplateError(f"the chat template did not finish within {timeout_s:g} s") from None
            except (OSError, EOFError):  # the worker died: a signal (RLIMIT_CPU, stop()), a crash
                status = self._kill(proc)
                raise TemplateError(f"the chat template's render process stopped (exit status {status})") from None
            if answer.get("exit"):  # it ran out of memory: the worker ends itself, a fresh one comes next
                self._kill(proc)
            return answer

    def stop(self) -> None:
        """Kill the worker now (a render in progress fails with one line); a later call starts a new one.
        With no render in progress the process is reaped and its pipes closed here (a render in
        progress does that itself when its read fails)."""
        proc = self._proc
        if proc is None:
            return
        proc.kill()
        if self._lock.acquire(blocking=False):
            try:
                if self._proc is proc:
                    self._kill(proc)
            finally:
                self._lock.release()

    def _started(self) -> subprocess.Popen:
        if self._proc is not None:
            if self._proc.poll() is None:
                return self._proc
            self._kill(self._proc)  # stopped (``stop``) or dead: its pipes closed, its status collected
        here = str(Path(__file__).resolve().parents[1])  # the worker imports this verispec, however it was found
        env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
        try:
            proc = subprocess.Popen([sys.executable, "-m", "verispec.chat_template"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0, env=env,
                                    start_new_session=True)  # a terminal's Ctrl-C reaches the caller only
        except OSError as e:
            raise TemplateError(f"cannot start the chat template's render process: {e.strerror or e}") from None
        try:
            _read_line(proc, time.monotonic() + START_TIMEOUT_S)
        except (TimeoutError, OSError, EOFError):
            status = self._kill(proc)
            raise TemplateError(f"the chat template's render process did not start (exit status {status})") from None
        self._proc = proc
        return proc

    def _kill(self, proc: subprocess.Popen) -> int | None:
        proc.kill()
        for pipe in (proc.stdin, proc.stdout):
            pipe.close()
        self._proc = None
        return proc.wait()


def _read_line(proc: subprocess.Popen, deadline: float) -> dict[str, Any]:
    """One JSON line from the worker's stdout, waiting until ``deadline`` at most."""
    fd, buf = proc.stdout.fileno(), bytearray()
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            raise EOFError
        buf += chunk
    return json.loads(buf)


SHARED_WORKER = RenderWorker()  # the library's and the CLI's renders; a server owns its own
atexit.register(SHARED_WORKER.stop)


# ----------------------------------------------------------------------------- the worker process


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks assistant turns with it
    (for its assistant-token masks); rendering keeps the body as it is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: Any) -> str:
        return caller()


class _TemplateDict:
    """transformers' ``dict`` for templates: construction only, no attribute access to abuse."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """transformers' ``namespace``: no underscore-prefixed attributes (no way to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's signature trick: namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot store underscore-prefixed attributes on a "
                                                  f"namespace, got {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' ``tojson`` (jinja's escapes HTML characters, which chat text must not)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=8)
def _compiled(source: str) -> jinja2.Template:
    """The template compiled in transformers' environment (its ``_compile_jinja_template``)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals |= {"raise_exception": _raise_exception, "strftime_now": _strftime_now, "dict": _TemplateDict(),
                    "namespace": _TemplateNamespace}
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"the chat template has a syntax error at line {e.lineno}: {_quote(e.message)}") from None
    except RecursionError:
        raise TemplateError("the chat template is nested too deeply to compile") from None


def _render(template: jinja2.Template, variables: dict[str, Any], max_chars: int) -> str:
    """The template's text, streamed: stops as soon as it passes ``max_chars`` characters."""
    parts, length = [], 0
    for part in template.generate(**variables):
        length += len(part)
        if length > max_chars:
            raise ChatTooLong(f"the chat renders to more than {max_chars} characters through the template, more "
                              "than this context can hold")
        parts.append(part)
    return "".join(parts)


def _quote(message: Any) -> str:
    """A message on one line, at most ``QUOTE_CHARS`` characters of it."""
    line = " ".join(str(message).split())
    return line if len(line) <= QUOTE_CHARS else line[:QUOTE_CHARS] + "..."


def _describe(e: Exception) -> str:
    if type(e) is jinja2.TemplateError:  # raise_exception: the template refuses these messages
        return f"the chat template refused the messages: {_quote(e)}"
    if isinstance(e, RecursionError):
        return "the chat template recursed too deeply"
    return f"the chat template failed: {type(e).__name__}: {_quote(e)}"


class _Bounded:
    """RLIMIT_AS (address space now + ``memory_mb``) and RLIMIT_CPU (CPU time now + the
    timeout + 2 s: the parent kills a render at its timeout; this ends an orphaned one) for
    the span of one render; restored after it, so answering is never short of memory."""

    def __init__(self, memory_mb: int, timeout_s: float):
        self.memory_mb, self.timeout_s = memory_mb, timeout_s

    def __enter__(self) -> None:
        self.saved = {r: resource.getrlimit(r) for r in (resource.RLIMIT_AS, resource.RLIMIT_CPU)}
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu = math.ceil(usage.ru_utime + usage.ru_stime + self.timeout_s) + 2
        self._lower(resource.RLIMIT_CPU, cpu)
        try:
            with open("/proc/self/statm") as f:  # pages of address space (Linux; elsewhere memory is not capped)
                size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            return
        self._lower(resource.RLIMIT_AS, size + self.memory_mb * (1 << 20))

    def __exit__(self, *exc: Any) -> None:
        for r, limits in self.saved.items():
            resource.setrlimit(r, limits)

    def _lower(self, which: int, soft: int) -> None:
        hard = self.saved[which][1]
        resource.setrlimit(which, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _answer(request: dict[str, Any]) -> dict[str, Any]:
    """Compile (cached) and render the request's chats; every failure is an answer of one line."""
    try:
        with _Bounded(request["memory_mb"], request["timeout_s"]):
            template = _compiled(request["source"])
            common = request["variables"] | {"tools": request.get("tools"), "documents": None,
                                             "add_generation_prompt": request["add_generation_prompt"]}
            texts = [_render(template, common | {"messages": messages}, max_chars)
                     for messages, max_chars in request["chats"]]
    except MemoryError:
        return {"error": f"the chat template needed more than {request['memory_mb']} MiB of memory", "exit": True}
    except ChatTooLong as e:
        return {"too_long": str(e)}
    except TemplateError as e:
        return {"error": str(e)}
    except Exception as e:  # noqa: BLE001 - the template's own failures (undefined names, types, sandbox) and ours
        return {"error": _describe(e)}
    return {"texts": texts}


def serve_renders() -> None:
    """The worker's loop: one JSON request per line on stdin, one JSON answer per line on
    stdout (the first, ``{}``, says it is ready); it ends at end of input or after running
    out of memory."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out = sys.stdout.buffer
    out.write(b"{}\n")
    out.flush()
    for line in sys.stdin.buffer:
        answer = _answer(json.loads(line))
        out.write(json.dumps(answer).encode() + b"\n")
        out.flush()
        if answer.get("exit"):
            return


if __name__ == "__main__":
    serve_renders()
