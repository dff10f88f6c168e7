"""The engine thread: owns the model, admits queued jobs between steps, steps the running
batch, detokenizes, applies stop strings and reports events. No decoding logic lives here
(that is ``engine/batch.py``); no HTTP either (that is ``app.py``).

Job lifecycle: ``submit`` (bounded queue: ``QueueFull`` / ``ShuttingDown``) -> waiting ->
admitted (prefill, first event) -> one event per step -> a final event (``finished`` set,
stats attached) or an error event. ``cancel`` removes a waiting job at once and a running
one before the next step, freeing its cache row. Each job's ``sink`` receives its events
on the engine thread and must not block (the app hands it to the event loop).
"""

from __future__ import annotations

import copy
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..detokenize import Detokenizer  # the one incremental detokenizer (stop strings, UTF-8 hold-back)
from ..engine.batch import BatchEngine
from ..engine.request import Request
from ..errors import NonFiniteLogits
from ..types import RequestStats, SamplingParams, TokenLogprob
from .metrics import ServerMetrics


class QueueFull(RuntimeError):
    """The admission queue is full (HTTP 429)."""


class ShuttingDown(RuntimeError):
    """The worker is stopping or stopped (HTTP 503)."""


@dataclass(frozen=True)
class Event:
    """One increment of a job's output. ``finished`` is the engine's finish reason (eos,
    length, stop, context) or "cancelled" on the last event; ``error`` marks a failed job
    (``status`` is the HTTP status it maps to)."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: str | None = None
    stats: dict[str, Any] | None = None
    error: str | None = None
    status: int = 200
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the job asked for them
    # on the first event of a job that asked for them: the prompt's tokens after the first, scored
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class Job:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    drafter: str
    sink: Callable[[Event], None]
    submitted: float = field(default_factory=time.perf_counter)
    draft_limit: int | None = None  # per-request draft budget cap (0 = no speculation)
    fork_of: str | None = None  # a job of the same prompt whose prefill this one may share (n > 1)
    prediction: tuple[int, ...] | None = None  # the predicted output's token ids (Predicted Outputs): drafts only
    prompt_logprobs: int | None = None  # score the prompt, with this many alternatives per token (echo + logprobs)
    score_only: bool = False  # generate nothing: only the prompt's scores (max_tokens 0), finished "length"


@dataclass
class _Running:
    job: Job
    req: Request
    detok: Detokenizer
    admitted: float
    max_batch_size: int = 1
    sent: int = 0  # generated tokens already reported
    prompt_logprobs: list[TokenLogprob] | None = None  # sent with the first event


class EngineWorker:
    """A single thread stepping a ``BatchEngine``. ``max_queue`` bounds the waiting jobs;
    ``replica`` (when set) is reported in each finished job's statistics."""

    def __init__(self, engine: BatchEngine, tokenizer: Any, metrics: ServerMetrics, max_queue: int = 64,
                 replica: str | None = None):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.engine, self.metrics, self.max_queue, self.replica = engine, metrics, max_queue, replica
        # a private copy: HF fast tokenizers raise "Already borrowed" when two threads share one
        self._tokenizer = copy.deepcopy(tokenizer)
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._cancels: set[str] = set()
        self._running: list[_Running] = []
        self._ids: set[str] = set()  # waiting or running request ids
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ---- control (any thread) -----------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("worker already started")
        self._thread = threading.Thread(target=self._loop, name="verispec-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Fail waiting jobs, cancel running ones, and join the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def submit(self, jobs: list[Job]) -> None:
        """Queue jobs atomically (all or none)."""
        with self._cond:
            if self._stopping or self._thread is None:
                raise ShuttingDown("the server is shutting down")
            if len(self._waiting) + len(jobs) > self.max_queue:
                raise QueueFull(f"the request queue is full ({self.max_queue} waiting)")
            dup = [j.request_id for j in jobs if j.request_id in self._ids]
            if dup or len({j.request_id for j in jobs}) != len(jobs):
                raise ValueError(f"duplicate request id {dup}")
            self._waiting.extend(jobs)
            self._ids.update(j.request_id for j in jobs)
            self.metrics.set_queue(len(self._running), len(self._waiting))
            self._cond.notify_all()

    def cancel(self, request_id: str) -> None:
        """Drop a job: a waiting one now, a running one before the next step (idempotent)."""
        with self._cond:
            if request_id not in self._ids:
                return
            for job in self._waiting:
                if job.request_id == request_id:
                    self._waiting.remove(job)
                    self._ids.discard(request_id)
                    self.metrics.request_done("cancelled")
                    self.metrics.set_queue(len(self._running), len(self._waiting))
                    return
            self._cancels.add(request_id)
            self._cond.notify_all()

    def snapshot(self) -> dict[str, int]:
        with self._cond:
            return {"running": len(self._running), "waiting": len(self._waiting),
                    "free_slots": self.engine.free_slots}

    # ---- the engine thread ----------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._waiting or self._running or self._cancels or self._stopping):
                    self._cond.wait()
                if self._stopping:
                    break
                cancels, self._cancels = self._cancels, set()
                admit = [self._waiting.popleft() for _ in range(min(len(self._waiting), self.engine.free_slots))]
            try:
                self._iteration(cancels, admit)
            except Exception as e:  # noqa: BLE001 - a bug here must not kill the server
                for run in list(self._running):
                    self._fail(run, f"internal error: {type(e).__name__}: {e}", 500)
            with self._cond:
                self.metrics.set_queue(len(self._running), len(self._waiting))
            self._report_caches()
        self._shutdown()

    def _iteration(self, cancels: set[str], admit: list[Job]) -> None:
        for run in [r for r in self._running if r.req.request_id in cancels]:
            self._end(run, "cancelled")
        for job in admit:
            self._admit(job)
        if self._running:
            self._step()

    def _admit(self, job: Job) -> None:
        try:
            scored = (None if job.prompt_logprobs is None
                      else self.engine.score_prompt(job.prompt_ids, job.prompt_logprobs))
            if job.score_only:
                return self._scored(job, scored)
            req = self.engine.add_request(job.request_id, job.prompt_ids, job.params, job.drafter,
                                          draft_limit=job.draft_limit, fork_of=job.fork_of,
                                          prediction=job.prediction or ())
        except Exception as e:  # noqa: BLE001
            self._done_id(job.request_id)
            self.metrics.request_done("failed")
            bad_request = isinstance(e, ValueError) and not isinstance(e, NonFiniteLogits)  # that one: the model's fault
            self._send(job, Event(job.request_id, "", [], error=str(e), status=400 if bad_request else 500))
            return
        now = time.perf_counter()
        run = _Running(job, req, Detokenizer(self._tokenizer, job.params.stop), admitted=now, prompt_logprobs=scored)
        self._running.append(run)
        self.metrics.first_token(len(job.prompt_ids), now - job.submitted)
        self._progress(run, req.generated)

    def _step(self) -> None:
        runs = list(self._running)
        step = self.engine.step([r.req for r in runs])
        drafted = accepted = new = 0
        for run, res in zip(runs, step.results):
            if isinstance(res, Exception):
                self._fail(run, f"{type(res).__name__}: {res}", 500)
                continue
            drafted, accepted, new = drafted + res.num_drafted, accepted + res.num_accepted, new + len(res.new_token_ids)
            run.max_batch_size = max(run.max_batch_size, step.batch_size)
            self._progress(run, res.new_token_ids)
        self.metrics.step(step.batch_size, step.max_drafted, drafted, accepted, new)

    def _progress(self, run: _Running, new_ids: list[int]) -> None:
        """Detokenize the step's tokens, apply stop strings, send the event, end if finished."""
        delta, ids, stopped = run.detok.push(new_ids, final=run.req.finished is not None)
        if stopped:
            run.req.finished = "stop"  # a stop string wins over an EOS in the same step
        logprobs = None
        if run.job.params.logprobs is not None:
            logprobs = run.req.logprobs[run.sent: run.sent + len(ids)]
        run.sent += len(ids)
        scored, run.prompt_logprobs = run.prompt_logprobs, None
        if run.req.finished is None:
            self._send(run.job, Event(run.req.request_id, delta, ids, logprobs=logprobs, prompt_logprobs=scored))
            return
        run.req.stats.new_tokens = len(run.detok.ids)
        self._end(run, run.req.finished, delta, ids, logprobs, scored)

    def _end(self, run: _Running, reason: str, delta: str = "", ids: list[int] | None = None,
             logprobs: list[TokenLogprob] | None = None, prompt_logprobs: list[TokenLogprob] | None = None) -> None:
        self._release(run)
        self._done_id(run.req.request_id)
        if run.job.prediction is not None:  # OpenAI's counts whenever a prediction came, drafted from or not
            run.req.stats.rejected_prediction_tokens = len(run.job.prediction)
        self.engine.engines[run.job.drafter].drafter.record_usage(run.req.request_id, run.req.stats)
        stats = self._stats(run)
        self.metrics.request_stats(run.req.stats, time.perf_counter() - run.job.submitted)
        self.metrics.request_done("cancelled" if reason == "cancelled" else "completed")
        self._send(run.job, Event(run.req.request_id, delta, ids or [], finished=reason, stats=stats, logprobs=logprobs,
                                  prompt_logprobs=prompt_logprobs))

    def _scored(self, job: Job, scored: list[TokenLogprob] | None) -> None:
        """A job that generates nothing (max_tokens 0): its one, final event carries the prompt's scores."""
        self._done_id(job.request_id)
        stats = RequestStats(prompt_tokens=len(job.prompt_ids), target_forwards=int(scored is not None)).as_dict()
        stats |= {"drafter": job.drafter, "queue_s": round(time.perf_counter() - job.submitted, 4), "max_batch_size": 1}
        self.metrics.request_done("completed")
        self._send(job, Event(job.request_id, "", [], finished="length", stats=stats | (
            {"replica": self.replica} if self.replica is not None else {}), prompt_logprobs=scored))

    def _fail(self, run: _Running, message: str, status: int) -> None:
        try:
            self._release(run)
        except Exception:  # noqa: BLE001 - the request is gone either way
            pass
        self._done_id(run.req.request_id)
        self.metrics.request_done("failed")
        self._send(run.job, Event(run.req.request_id, "", [], error=message, status=status))

    def _release(self, run: _Running) -> None:
        """Leave the batch and return the cache row (once: a stop string may have done it)."""
        if run in self._running:
            self._running.remove(run)
        if self.engine.is_active(run.req.request_id):
            self.engine.release(run.req, "stop")

    def _stats(self, run: _Running) -> dict[str, Any]:
        return run.req.stats.as_dict() | {
            "drafter": run.job.drafter,
            "queue_s": round(run.admitted - run.job.submitted, 4),
            "max_batch_size": run.max_batch_size,
            "drafter_memory_bytes": self.engine.engines[run.job.drafter].drafter.memory_bytes(),
        } | ({"replica": self.replica} if self.replica is not None else {}) | (
            {"accepted_prediction_tokens": run.req.stats.accepted_prediction_tokens,
             "rejected_prediction_tokens": run.req.stats.rejected_prediction_tokens}
            if run.job.prediction is not None else {})

    def _send(self, job: Job, event: Event) -> None:
        try:
            job.sink(event)
        except Exception:  # noqa: BLE001 - the client's loop is gone: cancel the job
            if event.finished is None and event.error is None:
                with self._cond:
                    self._cancels.add(job.request_id)

    def _done_id(self, request_id: str) -> None:
        with self._cond:
            self._ids.discard(request_id)

    def _shutdown(self) -> None:
        with self._cond:
            waiting, self._waiting = list(self._waiting), deque()
        for job in waiting:
            self._done_id(job.request_id)
            self.metrics.request_done("cancelled")
            self._send(job, Event(job.request_id, "", [], error="the server is shutting down", status=503))
        for run in list(self._running):
            self._fail(run, "the server is shutting down", 503)
        self.metrics.set_queue(0, 0)
        self._report_caches()

    def _report_caches(self) -> None:
        pc = self.engine.prefix_cache
        self.metrics.set_caches(self.engine.cache_rows_in_use, None if pc is None else pc.stats)

