"""Chooses the grammar engine behind ``verispec.constraints`` by measurement: xgrammar and
llguidance on our vocabularies (Qwen2.5-Coder's 151,936 tokens and stories260K's 512), one JSON
schema, one valid answer tokenized by the model's tokenizer. Prints, per engine and vocabulary:
the schema's compile time, the token mask's time per token (the cost on every tree node under
speculation), and whether rolling back k tokens restores the exact mask (drafts rejected by
verification are rolled back, never recomputed from the start).

    PYTHONPATH=src python scripts/grammar_engines.py [--models stories260k,qwen2.5-coder-1.5b-instruct]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from verispec.models.gguf_tokenizer import load_gguf_tokenizer
from verispec.models.load import load_model
from verispec.models.resolve import resolve_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}
ANSWER = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines", "poetry"],
          "address": {"city": "London", "zip": "W1"}}


def tokenizer_of(name: str):
    source = resolve_model(name)
    if source.kind == "gguf":
        return load_gguf_tokenizer(source.gguf)
    return load_model(name).tokenizer


def bench_llguidance(tok, eos: int, ids: list[int]) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=eos)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    m = llguidance.LLMatcher(lltok, grammar)
    t_compile = time.perf_counter() - t0
    mask = lt.allocate_token_bitmask(1, len(tok))
    times, masks = [], []
    for t in ids:
        t0 = time.perf_counter()
        lt.fill_next_token_bitmask(m, mask, 0)
        times.append(time.perf_counter() - t0)
        masks.append(mask.clone())
        assert m.consume_token(t), m.get_error()
    k = min(8, len(ids))
    m.rollback(k)
    lt.fill_next_token_bitmask(m, mask, 0)
    rollback_ok = torch.equal(mask, masks[len(ids) - k])
    t0 = time.perf_counter()
    m2 = m.deep_copy()
    t_fork = time.perf_counter() - t0
    del m2
    return {"tokenizer_s": t_tok, "compile_s": t_compile, "times": times, "rollback_ok": rollback_ok, "fork_s": t_fork}


def bench_xgrammar(tok, eos: int, ids: list[int]) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok), stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                           separators=(",", ":"))
    m = xgr.GrammarMatcher(compiled, max_rollback_tokens=-1) if _has_rollback_arg(xgr) else xgr.GrammarMatcher(compiled)
    t_compile = time.perf_counter() - t0
    mask = xgr.allocate_token_bitmask(1, len(tok))
    times, masks = [], []
    for t in ids:
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(mask, 0)
        times.append(time.perf_counter() - t0)
        masks.append(mask.clone())
        assert m.accept_token(t)
    k = min(8, len(ids))
    m.rollback(k)
    m.fill_next_token_bitmask(mask, 0)
    rollback_ok = torch.equal(mask, masks[len(ids) - k])
    t0 = time.perf_counter()
    m2 = m.fork()
    t_fork = time.perf_counter() - t0
    del m2
    return {"tokenizer_s": t_tok, "compile_s": t_compile, "times": times, "rollback_ok": rollback_ok, "fork_s": t_fork}


def _has_rollback_arg(xgr) -> bool:
    import inspect

    return "max_rollback_tokens" in inspect.signature(xgr.GrammarMatcher.__init__).parameters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="stories260k,qwen2.5-coder-1.5b-instruct")
    args = ap.parse_args()
    torch.set_num_threads(1)
    text = json.dumps(ANSWER, separators=(",", ":"))
    print("engine       vocab   tokens  tokenizer_s  compile_ms  mask_us_median  mask_us_p90  fork_us  rollback")
    for name in args.models.split(","):
        tok = tokenizer_of(name)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        while ids and not tok.decode(ids[:1]).strip():  # a SentencePiece vocabulary's leading space piece
            ids = ids[1:]
        eos = tok.eos_token_id if tok.eos_token_id is not None else len(tok) - 1
        for engine, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
            try:
                r = fn(tok, eos, ids)
            except Exception as e:  # an engine that cannot take this vocabulary is a finding, not a crash
                print(f"{engine:12} {len(tok):6}  failed: {type(e).__name__}: {repr(e)[:200]}")
                continue
            ts = sorted(r["times"])
            print(f"{engine:12} {len(tok):6}  {len(ids):6}  {r['tokenizer_s']:11.2f}  {r['compile_s'] * 1e3:10.1f}"
                  f"  {statistics.median(ts) * 1e6:14.0f}  {ts[int(0.9 * (len(ts) - 1))] * 1e6:11.0f}"
                  f"  {r['fork_s'] * 1e6:7.0f}  {'exact' if r['rollback_ok'] else 'WRONG'}")


if __name__ == "__main__":
    main()
