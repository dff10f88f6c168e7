"""``ServerConfig`` (and its ``Limits``) is the one place a server default is defined (issue 48):
``verispec serve``'s options take their defaults from its fields, so a Ray deployment built from a
YAML file's ``args`` (``ray_serve.config_from_args``, unset keys keep the field defaults) and
``verispec serve`` (with or without ``--ray``) run the same server."""

from __future__ import annotations

import inspect
from dataclasses import MISSING, fields

from verispec.cli.serving import serve
from verispec.server.config import Cors, Limits, ServerConfig

# the options that set a field of another name
RENAMED = {"drafter": "drafters", "drafter_option": "drafter_options", "chat_template_timeout": "chat_template_timeout_s",
           "header_timeout": "header_timeout_s", "body_timeout": "body_timeout_s"}
# the options that are not the server's configuration: where and how the process runs
PROCESS = {"host", "port", "threads", "graceful_timeout", "ray", "replicas"}
# the options that together set one field: --draft-search / --draft-search-path -> draft_search (None: off)
COMBINED = {"draft_search": None, "draft_search_path": None}


def _defaults(cls) -> dict[str, object]:
    return {f.name: f.default if f.default is not MISSING else f.default_factory() for f in fields(cls)}


def test_every_serve_option_defaults_to_the_server_configs_field() -> None:
    config, limits = _defaults(ServerConfig), _defaults(Limits) | _defaults(Cors)
    checked = set()
    for name, param in inspect.signature(serve).parameters.items():
        field = RENAMED.get(name, name)
        default = param.default.default
        if name in PROCESS:
            continue
        if name in COMBINED:
            assert config["draft_search"] is None and not default, name  # off unless asked
            continue
        assert field in config or field in limits, f"--{name.replace('_', '-')} sets no ServerConfig, Limits or Cors field"
        want = config[field] if field in config else limits[field]
        assert (tuple(default) if isinstance(default, list) else default) == want, (name, default, want)
        checked.add(field)
    assert {"max_model_len", "drafters", "prefix_cache_mb", "fixed_cost_rows", "max_body_bytes", "allowed_origins"} <= checked


def test_the_context_default_is_what_fits_everywhere() -> None:
    """``max_model_len`` was 0 (what fits) on the command line and 2048 in ``ServerConfig``."""
    assert ServerConfig().max_model_len == 0 == inspect.signature(serve).parameters["max_model_len"].default.default
