"""Frozen configuration and result types passed between the engine, CLI, server and bench."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from .constraints import Constraint

FinishReason = Literal["eos", "length", "stop", "context", "grammar"]


MAX_TEMPERATURE = 2.0  # the OpenAI API's range; one bound for the CLI, bench and server
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a smaller temperature is greedy decoding
MAX_SEED = 2**63 - 1  # torch generators take 64-bit seeds; larger ones would wrap onto others


def sample_seed(seed: int, k: int) -> int:
    """The seed of sample ``k`` of an ``n > 1`` request seeded ``seed``: ``seed + k``, wrapping
    past ``MAX_SEED`` to 0 (so seed 2^63 - 1 gives samples seeded 2^63 - 1, 0, 1, ...)."""
    return (seed + k) % (MAX_SEED + 1)


class ParameterError(ValueError):
    """An invalid value of the named parameter (``param``, a ``SamplingParams`` field): the
    server's HTTP 400 names it, the command line prints the message."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` (or below ``GREEDY_BELOW``) is greedy decoding.

    top_k = 0, top_p = 1.0 and min_p = 0.0 disable those filters. ``stop`` strings end
    generation and are cut from the text (as in the OpenAI API); ``stop_token_ids`` end it
    like EOS (the token is not emitted), even with ``ignore_eos``.

    History-dependent adjustments (``logits_processing.py``; they change greedy output too):
    ``logit_bias`` ((token id, bias) pairs added to the logits), ``repetition_penalty``
    (CTRL's, over prompt + generated tokens; 1.0 = off), ``presence_penalty`` and
    ``frequency_penalty`` (OpenAI's, over generated tokens; 0.0 = off).

    ``logprobs``: None = none; N >= 0 = report each emitted token's log-probability under
    the target model plus the N most likely alternatives (``logprobs.py``).

    ``constraint``: the output follows this compiled grammar (``constraints/``: a JSON schema, a
    regex, a grammar, a choice list); the grammar's end ends generation.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 128
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:  # also rejects NaN and inf
            raise ParameterError("temperature",
                                 f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if self.temperature < GREEDY_BELOW:
            # logits / 1e-300 overflow to inf and softmax gives NaN; such a temperature means greedy (as in vLLM)
            object.__setattr__(self, "temperature", 0.0)
        if not 0 <= self.seed <= MAX_SEED:
            raise ParameterError("seed", f"seed must be in [0, 2^63 - 1], got {self.seed}")
        if self.top_k < 0:
            raise ParameterError("top_k", f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ParameterError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ParameterError("max_new_tokens", f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if any(not s for s in self.stop):
            raise ParameterError("stop", "stop strings must be non-empty")
        if not 0.0 <= self.min_p <= 1.0:
            raise ParameterError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ParameterError(name, f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 10.0:  # also rejects NaN
            raise ParameterError("repetition_penalty",
                                 f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        if any(not -100.0 <= b <= 100.0 or t < 0 for t, b in self.logit_bias):
            raise ParameterError("logit_bias", "logit_bias maps token ids >= 0 to biases in [-100, 100]")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise ParameterError("logit_bias", "logit_bias names a token id twice")
        if any(t < 0 for t in self.stop_token_ids):
            raise ParameterError("stop_token_ids", "stop_token_ids must be >= 0")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ParameterError("logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Do logits depend on the history (bias, penalties)? False keeps the fast path."""
        return bool(self.logit_bias) or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 \
            or self.repetition_penalty != 1.0


MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the target and the ``top`` most likely
    (token id, log-probability) alternatives at its position, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestStats:
    """Speculation statistics of one request (definitions follow Spec-Bench and vLLM).

    target_forwards   target forward passes, prefill included.
    steps             decode steps (= target forwards after prefill); each verifies one draft.
    drafted           draft tokens sent to the target (tree nodes, root excluded).
    accepted          draft tokens accepted (excluding the recovered/bonus token).
    tau               mean tokens committed per decode step, bonus included:
                      (accepted + steps) / steps. Plain decoding has tau = 1.
    alpha             acceptance rate accepted / drafted (0 when nothing was drafted).
    accepted_at[i]    how many steps accepted a token at draft position i (depth i+1);
                      per-position acceptance = accepted_at[i] / steps_with_depth[i].
    """

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose K/V the prefix cache gave (not prefilled)
    new_tokens: int = 0
    target_forwards: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)
    drafted_at: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0
    drafter_memory_bytes: int = 0
    # Predicted Outputs (a request with a prediction): prediction tokens the target accepted as
    # drafts, and the rest of the prediction (OpenAI's accepted_/rejected_prediction_tokens)
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0

    def record_step(self, depth_drafted: int, num_drafted: int, num_accepted: int) -> None:
        self.steps += 1
        self.target_forwards += 1
        self.drafted += num_drafted
        self.accepted += num_accepted
        grow = max(depth_drafted, num_accepted) - len(self.drafted_at)
        if grow > 0:
            self.drafted_at.extend([0] * grow)
            self.accepted_at.extend([0] * grow)
        for i in range(depth_drafted):
            self.drafted_at[i] += 1
        for i in range(num_accepted):
            self.accepted_at[i] += 1

    def record_time(self, draft_s: float, step_s: float) -> None:
        """One step's drafting time and its whole time (draft, verify, commit)."""
        self.draft_s += draft_s
        self.decode_s += step_s

    @property
    def tau(self) -> float:
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def alpha(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def wall_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second of wall time, prefill included."""
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "steps": self.steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "tau": round(self.tau, 4),
            "alpha": round(self.alpha, 4),
            "per_position_acceptance": [round(x, 4) for x in self.per_position_acceptance],
            "prefill_s": round(self.prefill_s, 4),
            "decode_s": round(self.decode_s, 4),
            "draft_s": round(self.draft_s, 4),
            "wall_s": round(self.wall_s, 4),
            "tokens_per_second": round(self.tokens_per_second, 2),
            "drafter_memory_bytes": self.drafter_memory_bytes,
        } | ({"accepted_prediction_tokens": self.accepted_prediction_tokens,
              "rejected_prediction_tokens": self.rejected_prediction_tokens}
             if self.accepted_prediction_tokens or self.rejected_prediction_tokens else {})


@dataclass(frozen=True)
class GenerationOutput:
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    stats: RequestStats
    logprobs: list[TokenLogprob] | None = None  # one per token id, when asked for
