"""``verispec serve``: its options, checked on the command line, become a ``ServerConfig``
served by one process (``server/app.py``) or by Ray Serve replicas (``--ray``,
``server/ray_serve.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..server.config import Cors, Limits, ServerConfig
from .common import (DRAFT_SEARCH_HELP, DRAFT_SEARCH_PATH_HELP, PREFIX_CACHE_HELP, QUANT_HELP, THREADS_HELP, check,
                     check_model_arg, draft_search_locations, fail, parse_options)

C, L, O = ServerConfig, Limits, Cors()  # the defaults of every option that sets one of their fields (server/config.py)


def serve(
    model: str = typer.Option(C.model, help="catalog name or path (see `verispec models`)"),
    host: str = typer.Option("127.0.0.1", help="bind address"),
    port: int = typer.Option(8000, help="bind port"),
    drafter: list[str] = typer.Option(list(C.drafters), "--drafter", help="drafters requests may pick (repeatable; the first is the default; auto: the hybrid of suffix and the draft model for a target with one, else prompt lookup)"),
    drafter_option: list[str] = typer.Option([], "--drafter-option", "-o", help="key=value for the default drafter, repeatable (`verispec drafters` lists the options)"),
    num_draft_tokens: int = typer.Option(C.num_draft_tokens, "-k", "--num-draft-tokens", help="draft budget per step (prompt lookup: 4 beats 8 on Spec-Bench, docs/cpu.md)"),
    policy: str = typer.Option(C.policy, help="draft length policy: fixed or heuristic"),
    max_batch: int = typer.Option(C.max_batch, help="most requests decoding together (cache-pool rows)"),
    max_queue: int = typer.Option(C.max_queue, help="most requests waiting; more get HTTP 429"),
    max_model_len: int = typer.Option(C.max_model_len, help="context per request (prompt + new tokens); 0 = what fits: up to the model's context (Qwen2.5: 32768) while --max-batch requests' K/V take at most 60% of available memory"),
    default_max_tokens: int = typer.Option(C.default_max_tokens, help="chat max_tokens when the request gives none"),
    spec_schedule: str = typer.Option(C.spec_schedule, help="draft cap per batched step: goodput (acceptance- and cost-aware) or budget"),
    fixed_cost_rows: float = typer.Option(C.fixed_cost_rows, help="goodput cost model: a forward's fixed cost, in token rows (t(n) ~ a + b n: a / b; the compiled runtime measures 2-8: 6 for 2 threads and contexts up to 512, 2-4 for 1 thread or long contexts; engine/batch.py SpecSchedule)"),
    token_budget: int = typer.Option(C.token_budget, help="budget schedule: tokens per batched verify forward (0 = no cap)"),
    disable_spec_at: int = typer.Option(C.disable_spec_at, help="batch size from which speculation is off (0 = never)"),
    served_model_name: Optional[str] = typer.Option(C.served_model_name, help="model id clients send (default: --model)"),
    prefix_cache_mb: float = typer.Option(C.prefix_cache_mb, help=PREFIX_CACHE_HELP),
    dtype: str = typer.Option(C.dtype, help="float32 or bfloat16"),
    backend: str = typer.Option(C.backend, help="auto, cpu, native or hf (cpu and native batch verification)"),
    quant: str = typer.Option(C.quant, help=QUANT_HELP),
    threads: int = typer.Option(0, help=THREADS_HELP.replace("default: ", "0 = ")),
    graceful_timeout: float = typer.Option(30.0, help="seconds in-flight requests get on shutdown; then they end with 503"),
    api_key: Optional[str] = typer.Option(L.api_key, envvar="VERISPEC_API_KEY", show_envvar=True,
                                          help="require 'Authorization: Bearer <key>' on /v1/* (401 otherwise)"),
    max_body_bytes: int = typer.Option(L.max_body_bytes, help="largest request body in bytes; larger get HTTP 413"),
    header_timeout: float = typer.Option(L.header_timeout_s, help="seconds a connection may take to send its request headers"),
    body_timeout: float = typer.Option(L.body_timeout_s, help="seconds a request body may take to arrive (HTTP 408 after)"),
    allowed_origins: list[str] = typer.Option(list(O.allowed_origins), "--allowed-origins", help="origins whose browser pages may call the server and read its answers (CORS), e.g. http://localhost:3000, or '*' for any; repeatable, comma-separated or vLLM's JSON list; default none: pages on other origins cannot read answers"),
    allowed_methods: list[str] = typer.Option(list(O.allowed_methods), "--allowed-methods", help="with --allowed-origins: HTTP methods a page may use (default any)"),
    allowed_headers: list[str] = typer.Option(list(O.allowed_headers), "--allowed-headers", help="with --allowed-origins: request headers a page may send (default any, Authorization included)"),
    chat_template_timeout: float = typer.Option(C.chat_template_timeout_s, help="seconds the model's chat template may take to render one chat (HTTP 400 after; the render runs in a separate process)"),
    ray: bool = typer.Option(False, "--ray", help="serve engine replicas on Ray Serve: a local Ray instance, or the cluster RAY_ADDRESS names (docs/ray.md)"),
    replicas: int = typer.Option(1, help="--ray: engine replicas, each with --threads Ray CPUs (default 1) and as many threads"),
    draft_search: bool = typer.Option(False, "--draft-search", help=DRAFT_SEARCH_HELP),
    draft_search_path: list[Path] = typer.Option([], "--draft-search-path", help=DRAFT_SEARCH_PATH_HELP),
) -> None:
    """Run an OpenAI-compatible server with batched speculative decoding (see verispec.server)."""
    from ..models.base import ModelError
    from ..server.app import serve as run_server
    from ..server.config import parse_list_option

    check(0 <= port <= 65535, f"--port must be in [0, 65535], got {port}")
    check(threads >= 0, f"--threads must be >= 0 (0 = torch default), got {threads}")
    check(graceful_timeout >= 0, f"--graceful-timeout must be >= 0 seconds, got {graceful_timeout}")
    check(max_batch >= 1 and max_queue >= 1 and (max_model_len == 0 or max_model_len >= 2) and num_draft_tokens >= 1,
          "--max-batch, --max-queue and --num-draft-tokens must be >= 1, --max-model-len 0 (what fits) or >= 2")
    check_model_arg(model)
    if threads:
        from ..system import set_threads

        set_threads(threads)  # before loading: the compiled runtime sizes its pool at load
    try:
        cors = Cors(*(parse_list_option(v) for v in (allowed_origins, allowed_methods, allowed_headers)))
        limits = Limits(header_timeout_s=header_timeout, body_timeout_s=body_timeout, api_key=api_key,
                        max_body_bytes=max_body_bytes)
        locations = draft_search_locations(draft_search, draft_search_path)
        config = ServerConfig(model=model, backend=backend, dtype=dtype, quant=quant, drafters=tuple(drafter),
                              drafter_options=tuple(parse_options(drafter_option).items()),
                              num_draft_tokens=num_draft_tokens, policy=policy, max_batch=max_batch,
                              max_queue=max_queue, max_model_len=max_model_len,
                              default_max_tokens=default_max_tokens, spec_schedule=spec_schedule,
                              fixed_cost_rows=fixed_cost_rows, token_budget=token_budget,
                              disable_spec_at=disable_spec_at, served_model_name=served_model_name,
                              prefix_cache_mb=prefix_cache_mb, chat_template_timeout_s=chat_template_timeout,
                              limits=limits, cors=cors, draft_search=None if locations is None else tuple(locations))
        if ray:
            _serve_ray(config, replicas, threads or 1, host, port)
        else:
            run_server(config, host=host, port=port, graceful_timeout=graceful_timeout)
    except (ValueError, ModelError) as e:
        fail(str(e))


def _serve_ray(config, replicas: int, cpus: int, host: str, port: int) -> None:
    try:
        from ..server.ray_serve import RayConfig, serve_ray
    except ImportError as e:
        fail(f"--ray needs Ray Serve ({e}): pip install 'verispec[ray]'")
    serve_ray(RayConfig(config, replicas=replicas, num_cpus=cpus), host=host, port=port)
