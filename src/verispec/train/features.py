"""Teacher-forced target features: one target forward per sequence.

For a token sequence ``x`` (prompt + the target's own response) the target gives, at
every position ``i``, its last hidden state after the final norm ``f_i`` ([H], what the
LM head reads) and its greedy next token ``a_i = argmax(lm_head(f_i))``. Drafters learn
from these: EAGLE maps (f_i, x_{i+1}) to f_{i+1}; Medusa head k maps f_i to a_{i+k}.

Shards ``shard-00000.safetensors`` hold ``tokens`` [T] / ``argmax`` [T] (int64),
``feats`` [T, H] (bfloat16) and ``offsets`` [S+1] for S concatenated sequences, so an
interrupted extraction resumes at the next shard.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass(frozen=True)
class FeatureSet:
    tokens: list[torch.Tensor]  # [L] int64 per sequence
    feats: list[torch.Tensor]  # [L, H] bfloat16
    argmax: list[torch.Tensor]  # [L] int64: target's greedy next token after each position

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    def split(self, every: int) -> tuple["FeatureSet", "FeatureSet"]:
        """(train, validation): every ``every``-th sequence goes to validation."""
        idx = range(len(self.tokens))
        va = [i for i in idx if i % every == every - 1]
        tr = [i for i in idx if i % every != every - 1]
        pick = lambda ids: FeatureSet([self.tokens[i] for i in ids], [self.feats[i] for i in ids],  # noqa: E731
                                      [self.argmax[i] for i in ids])
        return pick(tr), pick(va)


@torch.inference_mode()
def target_features(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """([L, H] post-norm hidden states, [L] greedy next tokens) of an HF causal LM."""
    x = torch.tensor([ids])
    hidden = model.get_decoder()(input_ids=x).last_hidden_state[0]  # [L, H]
    logits = model.get_output_embeddings()(hidden)  # [L, V]
    return hidden, logits.argmax(-1)


def extract(model, seqs: list[list[int]], out_dir: str | Path, shard_size: int = 32,
            log: Callable[[str], None] = print) -> None:
    """Write feature shards for ``seqs`` into ``out_dir`` (one float32 transformers forward
    per sequence), skipping shards already there."""
    write_shards(seqs, out_dir, lambda chunk: [target_features(model, ids) for ids in chunk], shard_size, log)


def write_shards(seqs: list, out_dir: str | Path, features_of: Callable[[list], list[tuple[torch.Tensor, torch.Tensor]]],
                 shard_size: int = 32, log: Callable[[str], None] = print) -> None:
    """Shards of ``shard_size`` sequences: ``features_of(chunk)`` gives each sequence's
    ([L, H] features, [L] greedy next tokens); shards already there are skipped (resume)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0, done = time.time(), 0
    for s, b in enumerate(range(0, len(seqs), shard_size)):
        path = out / f"shard-{s:05d}.safetensors"
        if path.exists():
            continue
        chunk = seqs[b:b + shard_size]
        hs, am = zip(*features_of(chunk))
        offsets = torch.tensor([0, *np.cumsum([len(x) for x in chunk]).tolist()])
        tmp = path.with_suffix(".tmp")
        save_file({"tokens": torch.from_numpy(np.concatenate(chunk).astype(np.int64)), "argmax": torch.cat(am),
                   "feats": torch.cat(hs).to(torch.bfloat16).contiguous(), "offsets": offsets}, str(tmp))
        tmp.rename(path)
        done += sum(map(len, chunk))
        log(f"features: {b + len(chunk)}/{len(seqs)} sequences, {done / (time.time() - t0):.0f} tokens/s")


class Teacher:
    """The target on its inference backend: (layers [B, L, k*H] or hidden [B, L, H], logits
    [B, L, V]) for token windows, one batched forward (ragged rows)."""

    def __init__(self, backend, hidden_layers: tuple[int, ...], rows: int, max_len: int):
        self.backend, self.hidden_layers = backend, tuple(hidden_layers)
        self.pool = backend.new_cache_pool(rows, max_len)
        self.caches = [self.pool.acquire() for _ in range(rows)]

    @torch.inference_mode()
    def __call__(self, windows: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        n = max(map(len, windows))
        ids = torch.zeros(len(windows), n, dtype=torch.long)
        for r, w in enumerate(windows):
            ids[r, :len(w)] = torch.from_numpy(w)
        caches = self.caches[:len(windows)]
        for c in caches:
            c.truncate(0)
        kw = {"hidden_layers": self.hidden_layers} if self.hidden_layers else {"want_hidden": True}
        out = self.backend.forward_batch(ids, torch.arange(n)[None].repeat(len(windows), 1), caches,
                                         num_tokens=[len(w) for w in windows], **kw)
        return (out.layers if self.hidden_layers else out.hidden), out.logits


def extract_with_backend(backend, seqs: list[np.ndarray], out_dir: str | Path, rows: int = 4,
                         shard_size: int = 32, log: Callable[[str], None] = print) -> None:
    """``extract`` with the target's own inference backend (an on-policy corpus: the
    features the served target computes, e.g. the compiled CPU runtime, batched ``rows``
    sequences a forward instead of one float32 transformers forward per sequence).
    Same shard format; shards already there are skipped."""
    teacher = Teacher(backend, (), rows, max(map(len, seqs)))

    def features_of(chunk: list[np.ndarray]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        got = [None] * len(chunk)
        order = sorted(range(len(chunk)), key=lambda i: len(chunk[i]))  # similar lengths share a forward
        for g in range(0, len(order), rows):
            group = order[g:g + rows]
            hidden, logits = teacher([chunk[i] for i in group])  # [R, L, H], [R, L, V]
            for r, i in enumerate(group):
                n = len(chunk[i])
                got[i] = hidden[r, :n].float(), logits[r, :n].argmax(-1)
        return got

    write_shards(seqs, out_dir, features_of, shard_size, log)


def load(dirs: list[str | Path]) -> FeatureSet:
    """All shards of the given directories, in order."""
    from safetensors.torch import load_file

    tokens, feats, argmax = [], [], []
    for d in dirs:
        for path in sorted(Path(d).glob("shard-*.safetensors")):
            sh = load_file(str(path))
            off = sh["offsets"].tolist()
            for a, b in zip(off, off[1:]):
                tokens.append(sh["tokens"][a:b])
                feats.append(sh["feats"][a:b])
                argmax.append(sh["argmax"][a:b])
    if not tokens:
        raise ValueError(f"no feature shards in {', '.join(map(str, dirs))}")
    return FeatureSet(tokens, feats, argmax)


def read_target(target_dir: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config dict, state dict) of a transformers checkpoint directory (the target)."""
    import json

    from safetensors.torch import load_file

    target_dir = Path(target_dir)
    state = {}
    for f in sorted(target_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return json.loads((target_dir / "config.json").read_text()), state


def load_split(dirs: list[str | Path], every: int = 10) -> tuple[FeatureSet, FeatureSet]:
    """(train, validation) of the shards in ``dirs``: every ``every``-th sequence is held
    out (with fewer than ``every`` sequences both are the whole set)."""
    data = load(list(dirs))
    return data.split(every=every) if len(data.tokens) >= every else (data, data)


def random_window(n: int, max_len: int, gen: torch.Generator) -> tuple[int, int]:
    """[a, b): a random window of at most ``max_len`` positions of an ``n``-token sequence."""
    if n <= max_len:
        return 0, n
    a = int(torch.randint(0, n - max_len + 1, (1,), generator=gen))
    return a, a + max_len
