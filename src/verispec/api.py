"""Python API: load a model and a drafter, then ``generate`` or ``stream``.

    from verispec import load_model, SpecDecoder, SamplingParams
    model = load_model("smollm2-135m-instruct")
    dec = SpecDecoder(model)  # suffix drafter, 16-token budget
    out = dec.generate("Summarize: ...", SamplingParams(max_new_tokens=128))
    print(out.text, out.stats.tau)

Loading (``load_model``, ``load_draft_model``, ``LoadedModel``, ``distilled_draft_dir``) lives in
``verispec.models.load``; it is re-exported here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal

from .chat import encode_chat, max_text_chars
from .detokenize import Detokenizer as _Detokenizer  # server.worker's too
from .drafters.base import Drafter
from .drafters.prediction import PredictionDrafter
from .engine import Engine
from .engine.prefix_cache import DEFAULT_MAX_MB, PrefixCache
from .models.load import DTYPES, LoadedModel, distilled_draft_dir, load_draft_model, load_model, target_embedding
from .models.runtime_choice import choose_backend
from .registry import built_cost, make_drafter
from .types import FinishReason, GenerationOutput, RequestStats, SamplingParams, TokenLogprob, sample_seed

__all__ = ["DTYPES", "Chunk", "LoadedModel", "Prompt", "SpecDecoder", "choose_backend", "distilled_draft_dir",
           "encode_prompt", "load_draft_model", "load_model", "target_embedding"]

Prompt = str | list[dict[str, str]]


def encode_prompt(model: LoadedModel, prompt: Prompt, chat: bool | None = None) -> list[int]:
    """Token ids of a prompt. ``chat`` (default: when the model has a chat template) wraps a
    string as one user message; a list of messages always uses the chat template. An
    empty string on a base model means BOS alone."""
    tok = model.tokenizer
    use_chat = isinstance(prompt, list) or (model.has_chat_template if chat is None else chat)
    if use_chat:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not messages or any(not str(m.get("content", "")).strip() for m in messages):
            raise ValueError("chat messages must be non-empty")
        if not model.has_chat_template:
            raise ValueError(f"model {model.name} has no chat template; pass a plain prompt")
        # message contents stay literal text (no forged turns); a rendering longer than the context can hold is
        # refused as soon as the template's output passes that bound
        return encode_chat(tok, messages, max_text_chars(tok, model.backend.info.max_length))
    ids = tok(prompt, add_special_tokens=True)["input_ids"]
    bos = model.backend.info.bos_token_id
    if bos is not None and (not ids or ids[0] != bos) and not prompt:
        ids = [bos]
    if not ids:
        raise ValueError("the prompt is empty and the model has no BOS token")
    return list(ids)


def encode_prediction(model: LoadedModel, prediction: str | list[int] | None) -> list[int]:
    """Token ids of a prediction (Predicted Outputs): text as the model would write it, control-token
    strings kept literal (it is content); token ids as they are (the engine checks their range and
    that they fit the context). Text longer than the context could hold is refused before tokenizing."""
    if prediction is None:
        return []
    if not isinstance(prediction, str):
        return [int(t) for t in prediction]
    tok, context = model.tokenizer, model.backend.info.max_length
    if len(prediction) > max_text_chars(tok, context):
        raise ValueError(f"the prediction has {len(prediction)} characters, more than a context of {context} "
                         "tokens can hold")
    return list(tok(prediction, add_special_tokens=False, split_special_tokens=True)["input_ids"])


@dataclass(frozen=True)
class Chunk:
    """One streamed increment: new text and token ids; ``finished`` on the last chunk.
    ``logprobs``: one per token id when ``SamplingParams.logprobs`` is set."""

    delta: str
    token_ids: list[int]
    finished: FinishReason | None
    stats: RequestStats
    logprobs: list[TokenLogprob] | None = None


class SpecDecoder:
    """A target, a drafter and an engine; generates text losslessly. ``prefix_cache_mb``:
    K/V kept across calls, so a prompt that extends an earlier one (a chat's next turn)
    prefills only what is new (0 = off; the cpu backend, where it is exact)."""

    def __init__(self, model: LoadedModel, drafter: str | Drafter = "auto",
                 drafter_options: dict[str, Any] | None = None, num_draft_tokens: int = 16,
                 policy: Literal["fixed", "heuristic"] = "fixed", prefix_cache_mb: float = DEFAULT_MAX_MB):
        self.model = model
        self.drafter = make_drafter(drafter, model, drafter_options) if isinstance(drafter, str) else drafter
        # a request's prediction (Predicted Outputs) drafts first; the drafter drafts where it has nothing
        cost = built_cost(model)  # the target's cost model, if its drafters were sized by one
        self._predicting = PredictionDrafter(self.drafter, cost, tokenizer=model.tokenizer)
        self.engine = Engine(model.backend, self._predicting, num_draft_tokens, policy,
                             PrefixCache.from_mb(prefix_cache_mb), cost)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               chat: bool | None = None, prediction: str | list[int] | None = None,
               json_schema: dict | str | None = None, grammar: str | None = None) -> Iterator[Chunk]:
        """Yield text deltas as tokens are committed; the last chunk has ``finished`` set.
        ``prediction``: text (or token ids) the answer is expected to repeat, e.g. the file an
        edit applies to (OpenAI's Predicted Outputs): it only drafts, the output is unchanged.
        ``json_schema`` (a dict or JSON text) or ``grammar`` (Lark or GBNF): the answer follows
        it (``constraints/``; a bad one is ``GrammarError``, a ValueError, in one line)."""
        params = self.constrained(params or SamplingParams(), json_schema, grammar)
        ids = encode_prompt(self.model, prompt, chat)
        yield from self._stream(self.engine.add_request(ids, params, prediction=encode_prediction(self.model, prediction)))

    def _stream(self, req) -> Iterator[Chunk]:
        detok = _Detokenizer(self.model.tokenizer, req.params.stop)
        want_lp = req.params.logprobs is not None
        try:
            new_ids, new_lp = req.generated, list(req.logprobs)
            while True:
                delta, new_ids, stopped = detok.push(new_ids, final=req.finished is not None)
                if stopped:
                    self.engine.finish(req, "stop")
                    req.finished = "stop"
                    req.stats.new_tokens = len(detok.ids)
                if req.finished:
                    self._predicting.record_usage(req.request_id, req.stats)
                yield Chunk(delta, new_ids, req.finished, req.stats, new_lp[:len(new_ids)] if want_lp else None)
                if req.finished:
                    return
                res = self.engine.step(req)
                new_ids, new_lp = res.new_token_ids, res.logprobs or []
        finally:
            self.engine.finish(req, req.finished or "stop")

    def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                 chat: bool | None = None, prediction: str | list[int] | None = None,
                 json_schema: dict | str | None = None, grammar: str | None = None) -> GenerationOutput:
        return self._collect(self.stream(prompt, params, chat, prediction, json_schema, grammar),
                             params or SamplingParams())

    def constrained(self, params: SamplingParams, json_schema: dict | str | None = None,
                    grammar: str | None = None) -> SamplingParams:
        """``params`` with the constraint ``json_schema`` or ``grammar`` names, compiled for this model."""
        if json_schema is not None and grammar is not None:
            raise ValueError("give json_schema or grammar, not both")
        if json_schema is None and grammar is None:
            return params
        from .constraints import constraint_for

        kind, spec = ("json_schema", json_schema) if json_schema is not None else ("grammar", grammar)
        return replace(params, constraint=constraint_for(self.model, kind, spec))

    def generate_n(self, prompt: Prompt, n: int, params: SamplingParams | None = None,
                   chat: bool | None = None) -> list[GenerationOutput]:
        """``n`` samples of one prompt sharing its prefill (``Engine.fork``). Sample i is
        seeded ``params.seed + i`` (wrapping past 2^63 - 1 to 0: ``types.sample_seed``; as vLLM
        seeds the children of an n > 1 request), so it
        equals ``generate`` with that seed, and the whole set is reproducible."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        params = params or SamplingParams()
        first = self.engine.add_request(encode_prompt(self.model, prompt, chat), params)
        reqs = [first] + [self.engine.fork(first, replace(params, seed=sample_seed(params.seed, i)))
                          for i in range(1, n)]
        return [self._collect(self._stream(r), r.params) for r in reqs]

    def _collect(self, chunks: Iterator[Chunk], params: SamplingParams) -> GenerationOutput:
        text, ids, reason, stats = [], [], None, RequestStats()
        logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        for chunk in chunks:
            text.append(chunk.delta)
            ids.extend(chunk.token_ids)
            if logprobs is not None:
                logprobs.extend(chunk.logprobs or [])
            reason, stats = chunk.finished, chunk.stats
        stats.drafter_memory_bytes = self.drafter.memory_bytes()
        return GenerationOutput("".join(text), ids, reason or "length", stats, logprobs)
