"""The benchmark loop: every method on every prompt, interleaved, one Record per generation.

Methods run *interleaved* prompt by prompt (and repeat by repeat) in one process, with the
method order rotated each time, so slow drifts of a shared machine (other jobs, thermal
state) hit every method alike and cancel in the speed ratios. A prompt may have several
turns (MT-Bench: two; our agentic sessions: four or five): every turn is appended after the
method's own previous answers through the chat template (Spec-Bench convention), so each
turn is one Record and later turns can repeat earlier outputs. A recorded agent session
(``BenchPrompt.messages``) is replayed instead: each assistant turn is regenerated from the
recorded history before it (tool outputs follow the recorded actions, so the history stays the
recording), one Record per turn, in order, as an agent framework would send them. A FIM item
is one completion of the model's fill-in-the-middle prompt. Methods that take predictions
(``Runner.predicts``) get an edit's original code as its prediction.

Each method keeps one drafter for the whole run, so drafters that learn across requests
(SuffixDecoding's global trie, Token Recycling's matrix) carry what they learned from
earlier turns and prompts into later ones, as in a served deployment. What they learned
during the warm-up is forgotten (``reset_learned``): the warm-up runs measured prompts, and
a greedy warm-up answer is the very answer the drafter would later be measured on.

    records = run(runners, prompts, PromptBuilder(encode, decode, limit), params, repeats=3)
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ..types import SamplingParams
from .datasets import BenchPrompt
from .runners import Generation, Runner

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class Record:
    """One timed generation of one method on one turn of one prompt (Spec-Bench's per-
    prompt record, typed). Counters the method's engine does not expose are ``None``."""

    method: str
    question_id: int | str
    category: str
    turn: int  # 0-based
    repeat: int  # 0-based
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]  # generated, EOS excluded
    finish_reason: str
    wall_s: float  # prefill included
    prefill_s: float | None
    target_forwards: int | None
    steps: int | None
    drafted: int | None
    accepted: int | None
    accepted_at: tuple[int, ...] | None
    drafted_at: tuple[int, ...] | None
    rss_mb: float  # resident memory of the whole process right after this generation
    prompt_truncated: bool = False
    cpu_s: float | None = None  # CPU time of the process during the generation (all threads)
    cached_tokens: int | None = None  # prompt tokens reused from the method's prefix cache

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def key(self) -> tuple[int | str, int, int]:
        """Identifies the same prompt turn and repeat across methods."""
        return (self.question_id, self.turn, self.repeat)


def fit_context(ids: list[int], limit: int, keep_first: bool) -> tuple[list[int], bool]:
    """At most ``limit`` ids, keeping the most recent ones (and the first, e.g. BOS, when
    ``keep_first``); returns (ids, truncated).

    Example: fit_context([1, 5, 6, 7, 8], 3, True) -> ([1, 7, 8], True).
    """
    if len(ids) <= limit:
        return ids, False
    if limit < 2:
        raise ValueError(f"no room for the prompt (limit {limit} tokens)")
    return ([ids[0]] + ids[len(ids) - limit + 1:] if keep_first else ids[-limit:]), True


@dataclass(frozen=True)
class PromptBuilder:
    """How conversations become token ids and answers become text for the next turn."""

    encode: Callable[[Messages], list[int]]  # user/assistant messages -> prompt ids
    decode: Callable[[list[int]], str]  # generated ids -> answer text
    max_prompt_tokens: int  # longer prompts keep their most recent tokens
    keep_first: bool = False  # keep ids[0] when truncating (a base model's BOS)
    fim: Callable[[str, str], list[int]] | None = None  # (prefix, suffix) -> FIM prompt ids (verispec.fim)
    encode_prediction: Callable[[str], list[int]] | None = None  # a prediction's text -> token ids

    def prompt(self, messages: Messages) -> tuple[list[int], bool]:
        return fit_context(self.encode(messages), self.max_prompt_tokens, self.keep_first)

    def fim_prompt(self, prefix: str, suffix: str) -> tuple[list[int], bool]:
        if self.fim is None:
            raise ValueError("the fim workload needs a model with fill-in-the-middle tokens")
        ids = self.fim(prefix, suffix)
        if len(ids) > self.max_prompt_tokens:
            raise ValueError(f"a FIM prompt of {len(ids)} tokens does not fit ({self.max_prompt_tokens})")
        return ids, False

    def first_prompt(self, bp: BenchPrompt) -> list[int]:
        """The prompt of a conversation's first turn (the warm-up's)."""
        if bp.fim is not None:
            return self.fim_prompt(*bp.fim)[0]
        if bp.messages is not None:
            return self.prompt(list(bp.messages[:bp.replayed[0]]))[0]
        return self.prompt([{"role": "user", "content": bp.turns[0]}])[0]


def rotated(labels: Sequence[str], shift: int) -> list[str]:
    """``labels`` rotated left by ``shift``: rotated(["a", "b", "c"], 1) -> ["b", "c", "a"]."""
    s = shift % len(labels) if labels else 0
    return list(labels[s:]) + list(labels[:s])


def rss_mb() -> float:
    """Current resident memory of this process in MiB (peak RSS where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _record(label: str, bp: BenchPrompt, turn: int, repeat: int, prompt: list[int],
            truncated: bool, g: Generation) -> Record:
    return Record(label, bp.question_id, bp.category, turn, repeat, tuple(prompt), g.token_ids,
                  g.finish_reason, g.wall_s, g.prefill_s, g.target_forwards, g.steps, g.drafted,
                  g.accepted, g.accepted_at, g.drafted_at, round(rss_mb(), 1), truncated, g.cpu_s,
                  g.cached_tokens)


def _generate(runner: Runner, prompt: list[int], params: SamplingParams, prediction: list[int]) -> Generation:
    if prediction and runner.predicts:
        return runner.generate(prompt, params, prediction=prediction)
    return runner.generate(prompt, params)


def run_conversation(runner: Runner, bp: BenchPrompt, builder: PromptBuilder,
                     params: SamplingParams, repeat: int) -> list[Record]:
    """All turns of one prompt with one method; turn t+1 sees this method's answer to t (a
    replay: the recorded history before turn t+1)."""
    if bp.fim is not None:
        prompt, truncated = builder.fim_prompt(*bp.fim)
        return [_record(runner.label, bp, 0, repeat, prompt, truncated, runner.generate(prompt, params))]
    if bp.messages is not None:
        out = []
        for turn, at in enumerate(bp.replayed):
            prompt, truncated = builder.prompt(list(bp.messages[:at]))
            out.append(_record(runner.label, bp, turn, repeat, prompt, truncated, runner.generate(prompt, params)))
        return out
    prediction = (builder.encode_prediction(bp.prediction)[:builder.max_prompt_tokens]  # bounded like a prompt
                  if bp.prediction and builder.encode_prediction else [])
    messages: Messages = []
    out = []
    for turn, text in enumerate(bp.turns):
        messages.append({"role": "user", "content": text})
        prompt, truncated = builder.prompt(messages)
        gen = _generate(runner, prompt, params, prediction)
        out.append(_record(runner.label, bp, turn, repeat, prompt, truncated, gen))
        messages.append({"role": "assistant", "content": builder.decode(list(gen.token_ids))})
    return out


def num_generations(prompts: Sequence[BenchPrompt], num_methods: int, repeats: int) -> int:
    return sum(p.num_turns for p in prompts) * num_methods * repeats


def run(runners: Sequence[Runner], prompts: Sequence[BenchPrompt], builder: PromptBuilder,
        params: SamplingParams, *, repeats: int = 1, warmup: int = 1,
        on_generation: Callable[[str], None] | None = None) -> list[Record]:
    """Warm every runner up on the first ``warmup`` prompts (first turn, not recorded; then
    every runner forgets what it learned: ``reset_learned``), then run all (prompt, repeat) pairs with the method order rotated each time. Sampling
    repeats use seeds ``params.seed + repeat``; greedy repeats are identical runs."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0 (got {repeats}, {warmup})")
    by_label = {r.label: r for r in runners}
    if len(by_label) != len(runners):
        raise ValueError("two methods have the same label")
    tick = on_generation or (lambda label: None)
    for bp in prompts[:warmup]:
        for r in runners:
            r.generate(builder.first_prompt(bp), params)
            tick(f"warm-up {r.label}")
    for r in runners:  # never measure a drafter on an answer it saw in the warm-up
        r.reset_learned()
    records: list[Record] = []
    for i, bp in enumerate(prompts):
        for rep in range(repeats):
            rep_params = params if params.greedy else replace(params, seed=params.seed + rep)
            for label in rotated(list(by_label), i * repeats + rep):
                for rec in run_conversation(by_label[label], bp, builder, rep_params, rep):
                    records.append(rec)
                    tick(label)
    return records
