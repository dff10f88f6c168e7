"""Training-free drafters on SmolLM2 (issue 3): tau, alpha, tokens/s and speedup over plain
decoding in the same run, per Spec-Bench category and on a repetitive "agentic" workload.

Uses the ``verispec bench`` harness (interleaved methods with rotated order, exactness
check with the near-tie rule) but builds the runners itself so every drafter gets its own
draft budget ``k`` (tree drafters need more nodes than chain drafters; one global ``-k``
would favour one family).

The agentic workload (ours, not Spec-Bench): multi-turn sessions in which every turn asks
the model to revise its previous answer and output it again in full (code, a product
text, a JSON record) -- the pattern of coding agents and self-refinement loops, where
SuffixDecoding is designed to lead. The harness feeds each method's previous answers back
through the chat template (greedy answers are identical across methods).

    python scripts/bench_drafters.py --limit 2 --max-new-tokens 128          # all drafters
    python scripts/bench_drafters.py --backend native --methods suffix,lookahead
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from verispec.bench.datasets import GROUPS, BenchPrompt, load_spec_bench

AGENTIC = [
    ("Write a Python function `word_counts(text)` that returns a dictionary mapping each lowercase "
     "word to the number of times it appears in the text. Show a short example of its use.",
     "Rewrite the complete code from your previous answer, adding type hints and a docstring. "
     "Output the whole code again.",
     "Now rename the function to `count_words` and make it ignore punctuation. Output the complete "
     "updated code."),
    ("Write a short product description, about 100 words, for a reusable steel water bottle.",
     "Repeat the description above word for word, but replace 'water bottle' with 'travel mug'.",
     "Write the same description again, unchanged, and add one final sentence about its two-year warranty."),
    ("Create a JSON list describing three employees with the fields name, age, department and email.",
     "Repeat that JSON exactly, adding a field \"manager\" that is true for the first employee and "
     "false for the others.",
     "Output the same JSON again with the employees sorted by age, youngest first."),
]

# label -> (drafter, options, k). k: draft budget per step (tree nodes). Chosen for a CPU
# target whose forward cost grows quickly with the node count (see forward_costs and
# scripts/simulate_drafters.py): SuffixDecoding sizes its trees itself, so its cap is high;
# Token Recycling always fills its template; lookahead runs a CPU-sized window
# (3 columns x 3 levels + 3 guesses of 3 tokens = 18 nodes) instead of the paper's GPU
# setting (W=5, N=4, G=5: 30 nodes).
METHODS = {
    "none": ("none", {}, 1),
    "prompt-lookup": ("prompt-lookup", {}, 8),
    "pld-tree": ("prompt-lookup", {"num_candidates": "4"}, 16),
    "suffix": ("suffix", {}, 32),
    "token-recycling": ("token-recycling", {}, 8),
    "lookahead": ("lookahead", {"window": "3", "ngram": "4", "guesses": "3"}, 18),
    "rest": ("rest", {}, 12),
}


def agentic_prompts(sessions: int) -> list[BenchPrompt]:
    return [BenchPrompt(f"agentic-{i}", "agentic", turns) for i, turns in enumerate(AGENTIC[:sessions])]


def ensure_datastore(path: Path, model: str) -> Path:
    """REST's datastore: GSM8K *train* answers (never Spec-Bench), built once."""
    if path.is_file():
        return path
    from transformers import AutoTokenizer

    from verispec.drafters.retrieval import build_datastore, read_documents, tokenizer_fingerprint
    from verispec.models.converted import converted_hf_dir
    from verispec.models.resolve import resolve_model

    tok = AutoTokenizer.from_pretrained(str(converted_hf_dir(resolve_model(model))))
    texts = read_documents(Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "train.jsonl", "answer")
    ds = build_datastore((tok(t, add_special_tokens=False)["input_ids"] for t in texts),
                         fingerprint=tokenizer_fingerprint(tok))
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.save(path)
    return path


def forward_costs(backend, sizes=(1, 4, 8, 16, 32)) -> dict[int, float]:
    """Median ms of one target forward over n tree tokens after a 300-token prefix."""
    out = {}
    V = backend.info.vocab_size
    prefix = torch.randint(0, V, (1, 300), generator=torch.Generator().manual_seed(0))
    for n in sizes:
        times = []
        for _ in range(5):
            cache = backend.new_cache()
            backend.forward(prefix, torch.arange(300)[None], cache)
            ids = torch.randint(0, V, (1, n))
            t0 = time.perf_counter()
            backend.forward(ids, (300 + torch.arange(n))[None], cache, torch.ones(n, n, dtype=torch.bool).tril())
            times.append(time.perf_counter() - t0)
        out[n] = round(sorted(times)[len(times) // 2] * 1000, 1)
    return out


def long_table(summaries) -> list[str]:
    """One row per (category, method): tau, alpha, tokens/s, speedup vs none."""
    def f(x, d=2):
        return "–" if x is None else f"{x:.{d}f}"

    lines = ["| category | method | tau | alpha | tok/s | speedup |", "|---|---|---|---|---|---|"]
    for s in sorted(summaries, key=lambda s: (s.category == "overall", s.category)):
        lines.append(f"| {s.category} | `{s.method}` | {f(s.tau)} | {f(s.alpha)} | {f(s.tokens_per_s, 1)} "
                     f"| {f(s.speedup.mean)}x |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--backend", default="hf")
    ap.add_argument("--limit", type=int, default=2, help="Spec-Bench prompts per category")
    ap.add_argument("--categories", default=",".join(GROUPS))
    ap.add_argument("--sessions", type=int, default=3, help="agentic sessions (3 turns each)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated labels of METHODS")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--datastore", type=Path, default=Path("results/rest-gsm8k-train.npz"))
    ap.add_argument("--output", type=Path, default=None, help="JSON with summaries and records")
    args = ap.parse_args()

    from verispec.api import encode_prompt, load_model
    from verispec.bench.harness import PromptBuilder, run
    from verispec.bench.lossless import check_records, exactness_counts
    from verispec.bench.metrics import summarize
    from verispec.bench.report import acceptance_table, speedup_table
    from verispec.bench.runners import EngineRunner
    from verispec.registry import make_drafter
    from verispec.types import SamplingParams

    torch.set_num_threads(args.threads)
    lm = load_model(args.model, backend=args.backend)
    labels = ["none"] + [m for m in args.methods.split(",") if m and m != "none"]
    runners = []
    for label in labels:
        name, opts, k = METHODS[label]
        if name == "rest":
            opts = {**opts, "datastore": str(ensure_datastore(args.datastore, args.model))}
        runners.append(EngineRunner(label, lm.backend, make_drafter(name, lm, opts), k))
    cats = tuple(c for c in args.categories.split(",") if c)
    prompts = (load_spec_bench(categories=cats, limit_per_category=args.limit) if cats and args.limit else [])
    prompts += agentic_prompts(args.sessions)
    decode = lambda ids: lm.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    builder = PromptBuilder(lambda msgs: encode_prompt(lm, msgs), decode, 3000)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    costs = forward_costs(lm.backend)
    print(f"forward ms by tree size ({lm.backend_kind}): {costs}", flush=True)
    t0 = time.time()
    records = run(runners, prompts, builder, params, warmup=1,
                  on_generation=lambda label: print(".", end="", flush=True))
    print(f"\n{len(records)} generations in {time.time() - t0:.0f} s")
    summaries = summarize(records, "none")
    rows = check_records(records, "none", lm.backend)
    print("\n".join(long_table(summaries)))
    print("\nspeedup (tokens/s vs none):")
    print("\n".join(speedup_table(summaries)))
    print("\ntau / alpha:")
    print("\n".join(acceptance_table(summaries)))
    for m, c in exactness_counts(rows).items():
        print(f"exactness {m}: {c}")
    print("drafter memory bytes:", {r.label: r.memory_bytes() for r in runners})
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({
            "backend": lm.backend_kind, "forward_ms": costs, "k": {m: METHODS[m][2] for m in labels},
            "summaries": [s.__dict__ | {"speedup": s.speedup.__dict__, "decode_speedup": s.decode_speedup.__dict__}
                          for s in summaries],
            "exactness": exactness_counts(rows),
            "records": [{"method": r.method, "question_id": r.question_id, "category": r.category,
                         "turn": r.turn, "prompt_ids": r.prompt_ids, "token_ids": r.token_ids,
                         "wall_s": r.wall_s, "steps": r.steps, "accepted": r.accepted} for r in records],
        }, default=str))


if __name__ == "__main__":
    main()
