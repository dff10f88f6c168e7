"""What a running ``verispec serve`` holds, and its start-up: ``ServerConfig`` (everything the
command line can set) -> ``build_state`` -> ``ServerState`` (the model, the batch engine's worker
thread, the tokenizer and chat-render threads, the compiled chat template, metrics).

Start-up is where memory is counted: ``fits_context`` picks the longest context whose K/V fits
(``--max-model-len 0``) and ``reserve_drafters`` allocates the drafters' context-sized state
beside the target's batch, refusing in one line what cannot fit. The HTTP app (``app.py``) and a
Ray Serve replica (``ray_serve.py``) both serve a ``ServerState``.
"""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from ..api import LoadedModel, load_model
from ..chat import max_text_chars, template_of
from ..chat_template import ChatTemplate, RenderWorker
from ..drafters.base import Drafter
from ..drafters.prediction import PredictionDrafter
from ..engine import Engine
from ..engine.batch import BatchEngine, SpecSchedule
from ..engine.prefix_cache import PrefixCache
from ..registry import best_method, built_cost, make_drafter
from .config import ServerConfig as ServerConfig  # defined there; importable from here too
from .metrics import ServerMetrics
from .worker import EngineWorker


@dataclass
class ServerState:
    config: ServerConfig
    model: LoadedModel
    worker: EngineWorker
    metrics: ServerMetrics
    name: str
    max_len: int
    created: int
    max_prompt_chars: int  # longer text cannot fit the context: refused before tokenizing
    tokenizer_pool: ThreadPoolExecutor  # one thread: a HF fast tokenizer must not be shared across threads
    aliases: dict[str, str] = field(default_factory=dict)  # a drafter name requests may use -> its engine ("auto")
    chat_template: ChatTemplate | None = None  # None: the model has none, or it does not compile (chat_error)
    chat_error: str | None = None  # why a model with a chat template cannot chat
    render_pool: ThreadPoolExecutor = field(  # one thread (started on first use): waits for chat renders
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="verispec-chat-render"))

    def start(self) -> None:
        """Start the engine thread (the app's lifespan, or a Ray replica, calls it)."""
        self.worker.start()

    def close(self) -> None:
        """Stop the engine thread (failing what still runs), the tokenizer and render threads and
        the render process (a render in progress ends now)."""
        self.worker.stop()
        self.tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        self.render_pool.shutdown(wait=False, cancel_futures=True)
        if self.chat_template is not None:
            self.chat_template.worker.stop()


def build_state(config: ServerConfig, model: LoadedModel | None = None,
                extra_drafters: dict[str, Drafter] | None = None, replica: str | None = None) -> ServerState:
    """Load the model (unless given) and drafters, build the batch engine and its worker.
    ``extra_drafters`` adds ready-made drafters by name (tests use it); ``replica`` names this
    engine in every response's ``verispec`` statistics (a Ray Serve replica). Every engine's drafter
    is wrapped in a ``PredictionDrafter``: a request's prediction drafts first (Predicted Outputs)."""
    model = model or load_model(config.model, dtype=config.dtype, backend=config.backend, quant=config.quant)
    if config.draft_search is not None:  # --draft-search: a draft found on the machine, said in one line
        from ..models.discovery import with_found_draft

        model = with_found_draft(model, config.draft_search, lambda line: print(line, file=sys.stderr, flush=True),
                                 batched=True)
    target = model.backend
    prefix = PrefixCache.from_mb(config.prefix_cache_mb)  # one for all drafters: they share the target
    engines: dict[str, Engine] = {}
    aliases = {"auto": best_method(model, batched=True)[0]} if "auto" in config.drafters else {}
    for i, name in enumerate(config.drafters):
        opts = dict(config.drafter_options) if i == 0 else {}
        key = aliases.get(name, name)  # auto runs (and is reported) as the method it resolves to
        if key not in engines:
            drafter = make_drafter(name, model, opts, batched=True)
            cost = built_cost(model)  # the target's cost model, if a drafter was sized by one
            engines[key] = Engine(target, PredictionDrafter(drafter, cost, tokenizer=model.tokenizer),
                                  config.num_draft_tokens, config.policy, prefix, cost)
    config = replace(config, drafters=tuple(dict.fromkeys(aliases.get(n, n) for n in config.drafters)))
    for name, drafter in (extra_drafters or {}).items():
        engines[name] = Engine(target, PredictionDrafter(drafter, tokenizer=model.tokenizer), config.num_draft_tokens,
                               config.policy, prefix)
    drafters = [e.drafter for e in engines.values()]
    max_len = (fits_context(target, config.max_batch, drafters) if config.max_model_len == 0
               else min(config.max_model_len, target.info.max_length))
    reserve_drafters(target, engines, config.max_batch, max_len)
    batch = BatchEngine(target, engines, config.max_batch, max_len,
                        SpecSchedule(config.spec_schedule, config.token_budget, config.disable_spec_at,
                                     config.fixed_cost_rows))
    name = config.served_model_name or config.model
    metrics = ServerMetrics(name)
    worker = EngineWorker(batch, model.tokenizer, metrics, config.max_queue, replica)
    pool = ThreadPoolExecutor(1, thread_name_prefix="verispec-tokenize")
    state = ServerState(config, model, worker, metrics, name, max_len, int(time.time()),
                        max_text_chars(model.tokenizer, max_len), pool, aliases)
    if model.has_chat_template:
        render = RenderWorker()
        try:
            state.chat_template = template_of(model.tokenizer, config.template_bounds(), render)
        except ValueError as e:  # TemplateError: a completion-only user of this model file is still served
            render.stop()  # the process that found the error: reaped now, not left to the garbage collector
            state.chat_error = str(e)
            warnings.warn(f"{e}; /v1/chat/completions will answer 400, /v1/completions is served", stacklevel=2)
    return state


def reserve_drafters(target, engines: dict[str, Engine], max_batch: int, max_len: int) -> None:
    """Size the drafters' context-sized state (a draft model's K/V) to the server's context and
    allocate it now, after checking that it fits beside the target's batch (one line if not):
    sized by the draft's own context on its first request, it took memory nothing had counted,
    and under a memory cap every drafted request failed while /health said ok."""
    from ..engine.batch import batch_bytes, supports_batching
    from ..memory import check_fits

    drafts = sum(e.drafter.context_bytes(max_len, max_batch) for e in engines.values())
    if drafts:  # the batch engine checks the target's rows alone
        rows = batch_bytes(target, engines, max_batch, max_len) if supports_batching(target) else 0
        check_fits(rows + drafts, f"a batch of {max_batch} requests x {max_len} tokens with its draft caches",
                   "lower --max-batch or --max-model-len")
    for engine in engines.values():
        engine.drafter.reserve(max_len, max_batch)


def fits_context(target, max_batch: int, drafters: Sequence[Drafter] = (), share: float = 0.6) -> int:
    """The longest context (a multiple of 64, at most the model's) whose K/V for ``max_batch``
    requests (the target's and the ``drafters``' draft caches) takes at most ``share`` of the
    memory available now; at least 2048 (or the model's context), which the start-up then
    refuses in one line if it cannot hold."""
    from ..memory import available_bytes, cache_pool_bytes

    per_token = (cache_pool_bytes(target, max_batch, 64) + sum(d.context_bytes(64, max_batch) for d in drafters)) / 64
    fit = int(available_bytes() * share / per_token) // 64 * 64
    ctx = target.info.max_length
    return min(ctx, max(fit, 2048))

