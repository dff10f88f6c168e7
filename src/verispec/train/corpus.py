"""On-policy training data at scale: the target's own conversations, generated in batches.

``generate_corpus`` runs the target's fastest backend (the compiled CPU runtime's batched
forward, ``forward_batch``: one weight pass serves every row, ~3x the tokens/s of one row
on 1 core) over conversation specs (``corpus_specs``) from three prompt sources, none from
Spec-Bench:

* ``gsm8k``: GSM8K *train* questions;
* templated instructions (``prompts.make_instruction``: write / explain / QA / translate /
  summarize / rag / rewrite / role-play);
* ``magpie``: user turns the target writes itself (Magpie, Xu et al. 2024, arXiv
  2406.08464: feed the instruct model only its chat template up to the user header and
  sample the user message at T=1), de-duplicated on their text.

Each conversation has one or two turns (a second user turn is again Magpie-sampled after
the first answer), and its answers are greedy or sampled at a temperature in [0.7, 1.0]
(sampled serving needs drafters that know the target's distribution, not only its argmax).

Storage (outside the repository): ``shard-NNNNN.npz`` files, append-only, each holding
``tokens`` (uint16, concatenated), ``roles`` (uint8 per token: 0 template / given prompt,
1 assistant answer, 2 self-written user turn), ``offsets`` [S+1] and per-sequence ``ids``,
``temps``; ``manifest.jsonl`` gets one line per shard (ids, including dropped ones, token
counts, seconds) written after the shard is renamed into place, so a killed run loses at
most one unwritten shard and a resumed run skips every id in the manifest.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

ROLE_PROMPT, ROLE_ANSWER, ROLE_USER = 0, 1, 2


@dataclass(frozen=True)
class ConvSpec:
    """One conversation to generate. ``content`` None: the first user turn is Magpie-sampled."""

    id: str
    source: str
    content: str | None
    turns: int  # 1 or 2 assistant answers
    temperature: float  # of the answers; 0 = greedy
    seed: int


@dataclass(frozen=True)
class CorpusConfig:
    batch: int = 16  # rows decoded together
    max_answer: int = 320  # tokens per assistant answer
    max_user: int = 96  # tokens per self-written user turn
    user_temperature: float = 1.0  # Magpie samples user turns at T=1
    shard_size: int = 64  # conversations per shard
    max_length: int = 1024  # cache slots per row


def corpus_specs(gsm8k: list[str], n_templated: int, n_magpie: int, seed: int = 0,
                 two_turn: float = 0.25, greedy: float = 0.5) -> list[ConvSpec]:
    """Specs interleaved across sources (so a run stopped early keeps the mix), seeded.

    >>> s = corpus_specs(["q1", "q2"], 2, 2, seed=1)
    >>> len(s), sorted({x.source for x in s} - {"gsm8k", "magpie"}) != [], s[0].id != s[1].id
    (6, True, True)
    """
    from .prompts import make_instruction

    rng = random.Random(seed)
    pools: list[list[tuple[str, str, str | None]]] = [[(f"gsm8k-{i}", "gsm8k", q) for i, q in enumerate(gsm8k)]]
    seen, templated, tries = set(gsm8k), [], 0
    while len(templated) < n_templated and tries < 50 * n_templated + 50:
        tries += 1
        kind, text = make_instruction(rng)
        if text not in seen:
            seen.add(text)
            templated.append((f"inst-{len(templated)}", kind, text))
    pools += [templated, [(f"magpie-{i}", "magpie", None) for i in range(n_magpie)]]
    specs, i = [], 0
    while any(pools):
        for pool in pools:
            if pool:
                cid, source, content = pool.pop(0)
                t = 0.0 if rng.random() < greedy else round(rng.uniform(0.7, 1.0), 2)
                specs.append(ConvSpec(cid, source, content, 2 if rng.random() < two_turn else 1, t, seed * 7919 + i))
                i += 1
    return specs


@dataclass(frozen=True)
class ChatFormat:
    """Token ids of the chat template's pieces (from the tokenizer's own template)."""

    user_header: list[int]  # system prompt (if any) + user header: where Magpie starts sampling
    user_end: list[int]  # closes a given user message (the end-of-turn token; none in plain text)
    assistant_header: list[int]  # end-of-user-turn separator + assistant header
    next_user: list[int]  # separator after an answer + user header
    end: int  # end-of-turn token

    @staticmethod
    def from_tokenizer(tok) -> "ChatFormat":
        """From the tokenizer's chat template; without one, plain text: BOS, the prompt, the
        answer right after it (a base model's continuation), turns ended by EOS."""
        if not tok.chat_template:
            bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
            return ChatFormat(bos, [], [], [], tok.eos_token_id)
        mark = "\x00MARK\x00"
        text = tok.apply_chat_template([{"role": "user", "content": mark}], add_generation_prompt=True, tokenize=False)
        before, after = text.split(mark)
        mark2 = "\x00ANSWER\x00"
        two = tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "assistant", "content": mark2},
                                       {"role": "user", "content": mark}], tokenize=False)
        between = two.split(mark2, 1)[1].split(mark)[0]
        end = tok.convert_tokens_to_ids(tok.eos_token)
        enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
        # the end token ends each turn; the pieces after it are fed as template
        after, between = after.removeprefix(tok.eos_token), between.removeprefix(tok.eos_token)
        return ChatFormat(enc(before), [end], enc(after), enc(between), end)


@dataclass
class _Row:
    """A conversation being generated in one cache row."""

    spec: ConvSpec
    tokens: list[int]
    roles: list[int]
    pending: list[int]  # tokens to feed at the next forward (template pieces, sampled token)
    phase: int  # ROLE_ANSWER or ROLE_USER: what the sampled tokens are
    turns_left: int
    rng: np.random.Generator
    segment: int = 0  # tokens sampled in the current turn
    first_user: list[int] = field(default_factory=list)


def _sample(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    """Greedy (T=0) or a draw from softmax(logits / T)."""
    if temperature <= 0:
        return int(logits.argmax())
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    return int(rng.choice(len(p), p=p / p.sum()))


class _Writer:
    """Append-only shards + manifest; ``done`` is every id a previous run recorded."""

    def __init__(self, out: Path, shard_size: int):
        self.out, self.shard_size = out, shard_size
        out.mkdir(parents=True, exist_ok=True)
        self.manifest = out / "manifest.jsonl"
        self.done: set[str] = set()
        self.user_hashes: set[str] = set()
        self.answer_tokens = self.shards = 0
        if self.manifest.exists():
            for line in self.manifest.read_text().splitlines():
                row = json.loads(line)
                self.done.update(row["ids"] + row["dropped"])
                self.user_hashes.update(row["user_hashes"])
                self.answer_tokens += row["answer_tokens"]
                self.shards += 1
        self.rows: list[_Row] = []
        self.dropped: list[str] = []
        self.hashes: list[str] = []
        self.t0 = time.time()

    def add(self, row: _Row) -> None:
        self.rows.append(row)
        if len(self.rows) + len(self.dropped) >= self.shard_size:
            self.flush()

    def drop(self, cid: str) -> None:
        self.dropped.append(cid)

    def flush(self) -> None:
        if not self.rows and not self.dropped:
            return
        path = self.out / f"shard-{self.shards:05d}.npz"
        lens = [len(r.tokens) for r in self.rows]
        answer = sum(int(np.sum(np.asarray(r.roles) == ROLE_ANSWER)) for r in self.rows)
        with open(path.with_suffix(".tmp"), "wb") as f:
            np.savez(f, tokens=np.asarray([t for r in self.rows for t in r.tokens], dtype=np.uint16),
                     roles=np.asarray([x for r in self.rows for x in r.roles], dtype=np.uint8),
                     offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
                     ids=np.asarray([r.spec.id for r in self.rows]), temps=np.asarray([r.spec.temperature for r in self.rows]))
        path.with_suffix(".tmp").rename(path)
        entry = {"shard": path.name, "ids": [r.spec.id for r in self.rows], "dropped": self.dropped,
                 "user_hashes": self.hashes, "tokens": sum(lens), "answer_tokens": answer,
                 "seconds": round(time.time() - self.t0, 1)}
        with open(self.manifest, "a") as f:
            f.write(json.dumps(entry) + "\n")
        self.answer_tokens += answer
        self.shards += 1
        self.t0 = time.time()
        self.rows, self.dropped, self.hashes = [], [], []


def _user_hash(tok, ids: list[int]) -> str:
    text = " ".join(tok.decode(ids, skip_special_tokens=True).lower().split())
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def _new_row(spec: ConvSpec, fmt: ChatFormat, tok) -> _Row:
    rng = np.random.default_rng(spec.seed)
    if spec.content is None:  # Magpie: the model writes the user turn
        return _Row(spec, list(fmt.user_header), [ROLE_PROMPT] * len(fmt.user_header), list(fmt.user_header),
                    ROLE_USER, spec.turns, rng)
    ids = fmt.user_header + tok.encode(spec.content, add_special_tokens=False) + fmt.user_end + fmt.assistant_header
    return _Row(spec, list(ids), [ROLE_PROMPT] * len(ids), list(ids), ROLE_ANSWER, spec.turns, rng)


def _advance(row: _Row, token: int, fmt: ChatFormat, cfg: CorpusConfig) -> str:
    """Append a sampled token; returns "more", "done", "drop" (a user turn that never ended)
    or "check" (a first self-written user turn just ended: de-duplicate it)."""
    row.tokens.append(token)
    row.roles.append(row.phase)
    row.segment += 1
    row.pending = [token]
    limit = cfg.max_answer if row.phase == ROLE_ANSWER else cfg.max_user
    ended = token == fmt.end
    if len(row.tokens) + max(len(fmt.next_user), len(fmt.assistant_header)) + 2 >= cfg.max_length:
        return "done" if row.phase == ROLE_ANSWER else "drop"
    if not ended and row.segment < limit:
        return "more"
    if row.phase == ROLE_USER:
        if not ended or row.segment < 4:
            return "drop"
        first = not row.first_user
        if first:
            row.first_user = row.tokens[-row.segment:-1]
        row.phase, row.segment = ROLE_ANSWER, 0
        row.pending = [token] + fmt.assistant_header
        row.tokens += fmt.assistant_header
        row.roles += [ROLE_PROMPT] * len(fmt.assistant_header)
        return "check" if first else "more"
    row.turns_left -= 1
    if row.turns_left <= 0 or not ended:
        return "done"
    row.phase, row.segment = ROLE_USER, 0
    row.pending = [token] + fmt.next_user
    row.tokens += fmt.next_user
    row.roles += [ROLE_PROMPT] * len(fmt.next_user)
    return "more"


def generate_corpus(backend, tok, specs: list[ConvSpec], out_dir: str | Path, cfg: CorpusConfig = CorpusConfig(),
                    target_tokens: int | None = None, max_minutes: float | None = None, progress: bool = True,
                    log: Callable[[str], None] = print) -> dict:
    """Generate the conversations of ``specs`` not yet in ``out_dir``; stop at ``target_tokens``
    answer tokens in total or after ``max_minutes``. ``backend`` has ``forward_batch`` and a
    cache pool (``CpuLlama``, ``NativeLlama``). Returns counts and throughput."""
    fmt = ChatFormat.from_tokenizer(tok)
    writer = _Writer(Path(out_dir), cfg.shard_size)
    todo = [s for s in specs if s.id not in writer.done]
    from ..memory import cache_pool_bytes, check_fits, logits_bytes

    check_fits(cache_pool_bytes(backend, cfg.batch, cfg.max_length) + logits_bytes(cfg.batch, backend.info.vocab_size),
               f"--batch {cfg.batch} (rows of {cfg.max_length} tokens)", "lower --batch")
    pool = backend.new_cache_pool(cfg.batch, cfg.max_length)
    caches = [pool.acquire() for _ in range(cfg.batch)]
    rows: list[_Row | None] = [None] * cfg.batch
    start, new_answer, new_all = time.time(), 0, 0
    deadline = None if max_minutes is None else start + 60 * max_minutes
    goal = target_tokens or 0
    base = writer.answer_tokens  # stored by earlier runs (the writer's count grows with this run's rows)
    bar = _progress_bar(progress, goal, base)
    try:
        while True:
            stop = (deadline is not None and time.time() > deadline) or (goal and base + new_answer >= goal)
            for r in range(cfg.batch):
                if rows[r] is None and todo and not stop:
                    rows[r] = _new_row(todo.pop(0), fmt, tok)
                    caches[r].truncate(0)
            live = [r for r in range(cfg.batch) if rows[r] is not None]
            if not live:
                break
            logits = _forward(backend, [rows[r] for r in live], [caches[r] for r in live])  # [b, V]
            for j, r in enumerate(live):
                row = rows[r]
                temp = row.spec.temperature if row.phase == ROLE_ANSWER else cfg.user_temperature
                new_answer += row.phase == ROLE_ANSWER
                new_all += 1
                state = _advance(row, _sample(logits[j], temp, row.rng), fmt, cfg)
                if state == "check":
                    state = _check_duplicate(row, writer, tok)
                if state != "more":
                    _finish(row, state, writer)
                    rows[r] = None
            if bar is not None:
                bar.update(base + new_answer, new_answer / max(1e-9, time.time() - start))
    finally:
        writer.flush()
        if bar is not None:
            bar.close()
    secs = time.time() - start
    result = {"answer_tokens_total": writer.answer_tokens, "answer_tokens_new": new_answer, "tokens_new": new_all,
              "seconds": round(secs, 1), "answer_tokens_per_s": round(new_answer / max(secs, 1e-9), 1),
              "shards": writer.shards, "remaining_specs": len(todo)}
    log(json.dumps(result))
    return result


def _check_duplicate(row: _Row, writer: _Writer, tok) -> str:
    h = _user_hash(tok, row.first_user)
    if h in writer.user_hashes:
        return "drop"
    writer.user_hashes.add(h)
    writer.hashes.append(h)
    return "more"


def _finish(row: _Row, state: str, writer: _Writer) -> None:
    if state == "drop" or ROLE_ANSWER not in row.roles:
        writer.drop(row.spec.id)
    else:
        writer.add(row)


def _forward(backend, rows: list[_Row], caches) -> np.ndarray:
    """One batched forward over each row's pending tokens (ragged); [b, V] last logits."""
    n = max(len(r.pending) for r in rows)
    ids = np.zeros((len(rows), n), dtype=np.int64)
    pos = np.zeros((len(rows), n), dtype=np.int64)
    for j, (r, c) in enumerate(zip(rows, caches)):
        k = len(r.pending)
        ids[j, :k] = r.pending
        pos[j, :k] = np.arange(c.length, c.length + k)
    out = backend.forward_batch(torch.from_numpy(ids), torch.from_numpy(pos), list(caches),
                                num_tokens=[len(r.pending) for r in rows], last_logits_only=True)
    for r in rows:
        r.pending = []
    return out.logits[:, 0].numpy()


class _Bar:
    """A rich progress bar over answer tokens, with the throughput of this run."""

    def __init__(self, goal: int, done: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.p = Progress(TextColumn("answer tokens"), BarColumn(), MofNCompleteColumn(),
                          TextColumn("{task.fields[rate]} tok/s"), TimeRemainingColumn())
        self.task = self.p.add_task("gen", total=goal or None, completed=done, rate="-")
        self.p.start()
        self.last = 0.0

    def update(self, done: int, rate: float) -> None:
        if time.time() - self.last > 1.0:
            self.p.update(self.task, completed=done, rate=f"{rate:.0f}")
            self.last = time.time()

    def close(self) -> None:
        self.p.stop()


def _progress_bar(progress: bool, goal: int, done: int) -> _Bar | None:
    return _Bar(goal, done) if progress else None


# ----------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class Sequence:
    id: str
    tokens: np.ndarray  # [L] int64
    roles: np.ndarray  # [L] uint8 (ROLE_*)
    temperature: float


def read_corpus(data_dir: str | Path) -> list[Sequence]:
    """Every sequence of the shards listed in ``data_dir/manifest.jsonl``, in order."""
    data_dir = Path(data_dir)
    manifest = data_dir / "manifest.jsonl"
    if not manifest.exists():
        raise ValueError(f"{data_dir} has no manifest.jsonl (verispec train data output)")
    seqs = []
    for line in manifest.read_text().splitlines():
        sh = np.load(data_dir / json.loads(line)["shard"])
        off = sh["offsets"]
        for i, (a, b) in enumerate(zip(off, off[1:])):
            seqs.append(Sequence(str(sh["ids"][i]), sh["tokens"][a:b].astype(np.int64), sh["roles"][a:b],
                                 float(sh["temps"][i])))
    return seqs


def is_held_out(seq_id: str, every: int = 50) -> bool:
    """A fixed, id-hashed held-out split (independent of generation order and resumes)."""
    return int(hashlib.sha1(seq_id.encode()).hexdigest(), 16) % every == 0


def main_corpus(out: str | Path, model_name: str = "smollm2-135m-instruct", tokens: int = 3_000_000,
                batch: int = 16, threads: int = 1, n_magpie: int = 40_000, n_templated: int = 6_000,
                seed: int = 0, max_minutes: float | None = None, gsm8k: str | Path | None = None,
                progress: bool = True) -> dict:
    """``verispec train data``: the default prompt mix (all GSM8K train questions, templated
    instructions, Magpie turns) answered by ``model_name`` on its default backend."""
    from ..models.load import load_model
    from .prompts import gsm8k_file, read_gsm8k_questions

    if tokens < 1 or batch < 1 or threads < 1 or n_magpie < 0:
        raise ValueError("tokens, batch and threads must be >= 1 and magpie >= 0")
    gsm8k = gsm8k_file(gsm8k)
    torch.set_num_threads(1)  # torch ops here are tiny; the compiled runtime has its own pool (set_threads below)
    loaded = load_model(model_name)
    backend = loaded.backend
    if not backend.caps.batched:
        raise ValueError(f"backend {loaded.backend_kind} has no batched forward; use the cpu or native backend")
    backend.set_threads(threads)  # the compiled runtime's pool; a PyTorch backend's torch threads
    specs = corpus_specs(read_gsm8k_questions(gsm8k), n_templated, n_magpie, seed=seed)
    return generate_corpus(backend, loaded.tokenizer, specs, out, CorpusConfig(batch=batch), target_tokens=tokens,
                           max_minutes=max_minutes, progress=progress)
