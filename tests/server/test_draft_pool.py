"""Hostile serving, round 3 (issue 32, class 12): the draft model's K/V is sized to the
server's context, allocated at start-up and counted against the memory available, so a server
that cannot hold it is refused in one line instead of failing every drafted request later
while /health is green."""

from __future__ import annotations

import asyncio

import httpx
import pytest

import verispec.memory
from verispec.drafters.base import NoDrafter
from verispec.engine import Engine
from verispec.engine.batch import batch_bytes
from verispec.memory import cache_pool_bytes
from verispec.registry import make_drafter
from verispec.server.app import create_app
from verispec.server.state import ServerConfig, build_state

from serving import MODEL, one_line_exit_2, stories_native_model

# stories260K drafting for itself: a draft model with caches of its own; a fixed draft length
# (the cost rule would time both models first)
DRAFT = (("model", MODEL), ("stop", "fixed"))


def _complete(state, body: dict) -> httpx.Response:
    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://server", timeout=60) as client:
            return await client.post("/v1/completions", json={"model": MODEL} | body)

    return asyncio.run(run())


@pytest.mark.parametrize(("max_len", "max_batch"), [(96, 2), (200, 4), (448, 3)])
def test_the_draft_pool_holds_the_server_context_from_start_up(max_len: int, max_batch: int) -> None:
    state = build_state(ServerConfig(model=MODEL, drafters=("draft",), drafter_options=DRAFT, max_batch=max_batch,
                                     max_model_len=max_len), model=stories_native_model())
    drafter = state.worker.engine.engines["draft"].drafter.inner  # inside the Predicted Outputs wrapper
    pool = drafter.pool  # allocated by the start-up, before any request
    assert pool is not None and pool.max_length == max_len and pool.rows == max_batch
    assert pool.nbytes == drafter.context_bytes(max_len, max_batch) == cache_pool_bytes(drafter.model, max_batch, max_len)
    assert pool.nbytes < cache_pool_bytes(drafter.model, max_batch, drafter.model.info.max_length)
    state.start()
    try:  # a request that fills the whole context drafts in that pool
        r = _complete(state, {"prompt": [1] + [403, 261, 153] * ((max_len - 9) // 3), "max_tokens": 8,
                              "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        assert drafter.pool is pool and pool.in_use == 0
    finally:
        state.close()


@pytest.mark.parametrize(("max_len", "max_batch"), [(128, 2), (384, 6)])
def test_a_start_up_without_room_for_the_draft_caches_is_refused(monkeypatch, max_len: int, max_batch: int) -> None:
    """Memory for the target's batch and half the draft's caches: the server without a draft
    model starts, the one with it is refused in one line naming the draft caches."""
    model = stories_native_model()
    target = model.backend
    draft = make_drafter("draft", model, dict(DRAFT)).context_bytes(max_len, max_batch)
    rows = batch_bytes(target, {"none": Engine(target, NoDrafter(), ServerConfig.num_draft_tokens)}, max_batch, max_len)
    monkeypatch.setattr(verispec.memory, "available_bytes", lambda: rows + draft // 2)
    config = ServerConfig(model=MODEL, drafters=("none",), max_batch=max_batch, max_model_len=max_len)
    build_state(config, model=model).close()
    with pytest.raises(ValueError) as refused:
        build_state(ServerConfig(model=MODEL, drafters=("draft",), drafter_options=DRAFT, max_batch=max_batch,
                                 max_model_len=max_len), model=model)
    assert "draft caches" in str(refused.value) and "\n" not in str(refused.value)
    out = one_line_exit_2("serve", "--model", MODEL, "--backend", "native", "--drafter", "draft", "-o", f"model={MODEL}",
                          "-o", "stop=fixed", "--max-batch", str(max_batch), "--max-model-len", str(max_len))
    assert "draft caches" in out and "--max-model-len" in out


@pytest.mark.parametrize("max_batch", [2, 8])
def test_what_fits_counts_the_draft_caches(monkeypatch, max_batch: int) -> None:
    """--max-model-len 0 (what fits): a draft model as large as the target halves the context."""
    from dataclasses import replace

    from verispec.server.state import fits_context

    model = stories_native_model()
    target = model.backend
    drafter = make_drafter("draft", model, dict(DRAFT))
    monkeypatch.setattr(target, "info", replace(target.info, max_length=65536))  # a long-context target
    per_token = cache_pool_bytes(target, max_batch, 64) / 64
    monkeypatch.setattr(verispec.memory, "available_bytes", lambda: int(per_token * 12_000 / 0.6))
    alone, with_draft = fits_context(target, max_batch), fits_context(target, max_batch, [drafter])
    assert 11_900 <= alone <= 12_000 and abs(with_draft - alone // 2) <= 64


@pytest.mark.parametrize("context", [4096, 32768])
def test_without_a_server_the_draft_pool_grows_as_used(tmp_path, monkeypatch, context: int) -> None:
    """``verispec generate`` / SpecDecoder (no reserve): a draft on the compiled runtime gets a pool
    that grows with the request, not one reserved at the draft's whole context (16 rows of
    32,768 tokens for Qwen2.5's 0.5B); its drafts are the same."""
    from gguf_fixtures import tiny_qwen2, write_gguf

    from verispec.api import load_model
    from verispec.drafters.draft_model import DraftModelDrafter
    from verispec.engine import Engine
    from verispec.types import SamplingParams

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_gguf(path, *tiny_qwen2(context=context))
    model = load_model(str(path), backend="cpu")
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    outs = []
    for reserve in (False, True):
        drafter = DraftModelDrafter(model.backend)
        if reserve:
            drafter.reserve(context, 2)
        engine = Engine(model.backend, drafter, 4)
        req = engine.add_request([1, 40, 41, 42, 40, 41], params)
        while not req.finished:
            engine.step(req)
        outs.append((req.generated, req.stats.accepted))
        assert drafter.pool.slots == (context if reserve else 256)
    assert outs[0] == outs[1]
