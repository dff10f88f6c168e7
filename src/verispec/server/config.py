"""``ServerConfig``: everything ``verispec serve`` can set, and the one place its defaults
are defined: the command line's options (``cli/serving.py``) and a Ray Serve deployment's
``args`` (``ray_serve.config_from_args``) both take theirs from these fields. ``Limits``: what a
request must satisfy before the app sees it (enforced by ``guard.py``).

Nothing heavy is imported here (no torch, no jinja2, no uvicorn), so ``verispec --help`` can
read the defaults and stay instant.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..models.catalog import DEFAULT_MODEL

if TYPE_CHECKING:
    from ..chat_template import RenderBounds

DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024  # 2 MiB: about 500K tokens of text, far above any context here


@dataclass(frozen=True)
class Limits:
    """``max_body_bytes``: the largest request body (413 above it). ``header_timeout_s``:
    seconds a connection may take to send its request headers. ``body_timeout_s``: seconds
    the whole body may take after the headers (408 after). ``api_key`` (printable ASCII): when
    set, every path but /health and /metrics (so /v1/*, /docs, /openapi.json) needs
    ``Authorization: Bearer <api_key>`` (401 otherwise)."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if not (self.header_timeout_s > 0 and self.body_timeout_s > 0):
            raise ValueError("header and body timeouts must be > 0 seconds")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key must not be empty")
        if self.api_key is not None and not (self.api_key.isascii() and self.api_key.isprintable()):
            # HTTP headers carry bytes; clients encode a non-ASCII key as UTF-8 or latin-1 at will
            raise ValueError("the API key must be printable ASCII (clients encode other characters differently)")


_ORIGIN = re.compile(r"^[a-z][a-z0-9+.-]*://[^/\s?#]+$")  # scheme://host[:port], as browsers send Origin


@dataclass(frozen=True)
class Cors:
    """Cross-origin access (CORS) for browser clients. ``allowed_origins``: origins
    (``scheme://host[:port]``, no path) whose pages may call the server and read its answers, or
    ``"*"`` for any; empty (the default) adds no CORS headers, so a page on another origin cannot
    read answers (nor send the JSON requests, whose preflight fails). With ``"*"`` any web page the
    user opens could use a server on their machine (its compute, and with tools its answers), which
    a default must not allow; an API key does not help there, as a page can ask for it. Methods
    and headers default to any (``*``: the preflight's requested headers are echoed, so
    ``Authorization`` passes); credentials (cookies) are never allowed: the key is a header."""

    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)

    def __post_init__(self) -> None:
        for origin in self.allowed_origins:
            if origin != "*" and not _ORIGIN.match(origin):
                hint = " (drop the trailing '/')" if origin.endswith("/") else ""
                raise ValueError(f"--allowed-origins: {origin!r} is not an origin like http://localhost:3000 "
                                 f"or '*'{hint}")
        for name, values in (("methods", self.allowed_methods), ("headers", self.allowed_headers)):
            bad = [v for v in values if not v or not re.fullmatch(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+", v)]
            if bad:
                raise ValueError(f"--allowed-{name}: {bad[0]!r} is not an HTTP token")

    def middleware_options(self) -> dict[str, Any] | None:
        """``CORSMiddleware``'s options, None when no origin is allowed (no middleware)."""
        if not self.allowed_origins:
            return None
        return {"allow_origins": list(self.allowed_origins), "allow_methods": list(self.allowed_methods),
                "allow_headers": list(self.allowed_headers), "allow_credentials": False,
                "expose_headers": ["Retry-After"], "max_age": 600}


def parse_list_option(values: list[str]) -> tuple[str, ...]:
    """A repeatable list flag: ``--x a --x b``, ``--x a,b`` or vLLM's JSON ``--x '["a", "b"]'``."""
    out: list[str] = []
    for value in values:
        text = value.strip()
        if text.startswith("["):
            try:
                items = json.loads(text)
            except ValueError:
                raise ValueError(f"{value!r} is not a JSON list of strings") from None
            if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
                raise ValueError(f"{value!r} is not a JSON list of strings")
            out += [i.strip() for i in items]
        else:
            out += [part.strip() for part in text.split(",") if part.strip()]
    return tuple(out)



@dataclass(frozen=True)
class ServerConfig:
    """Everything ``verispec serve`` can set. ``drafters``: the drafter names requests may
    pick (the first is the default); ``drafter_options`` apply to the default drafter."""

    model: str = DEFAULT_MODEL
    backend: str = "auto"
    dtype: str = "float32"
    quant: str = "auto"
    drafters: tuple[str, ...] = ("auto", "none")
    drafter_options: tuple[tuple[str, str], ...] = ()
    num_draft_tokens: int = 4
    policy: str = "fixed"
    max_batch: int = 16
    max_queue: int = 64
    max_model_len: int = 0  # 0: what fits (state.fits_context)
    default_max_tokens: int = 256
    spec_schedule: str = "goodput"
    fixed_cost_rows: float = 6.0  # goodput: a forward's fixed cost in token rows (engine/batch.py SpecSchedule)
    token_budget: int = 32
    disable_spec_at: int = 0
    served_model_name: str | None = None
    prefix_cache_mb: float = 1024.0  # 0 = off (engine/prefix_cache.py)
    chat_template_timeout_s: float = 2.0  # one chat's rendering through the template (400 after)
    chat_template_memory_mb: int = 512  # what that rendering may allocate (400 beyond)
    limits: Limits = field(default_factory=Limits)
    cors: Cors = field(default_factory=Cors)  # browser pages of other origins (none by default)
    draft_search: tuple | None = None  # models.discovery.Location's searched for a draft auto runs; None = off

    def __post_init__(self) -> None:
        if not self.drafters:
            raise ValueError("serve needs at least one drafter")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        self.template_bounds()  # checks them

    def template_bounds(self) -> RenderBounds:
        from ..chat_template import RenderBounds

        return RenderBounds(self.chat_template_timeout_s, self.chat_template_memory_mb)
