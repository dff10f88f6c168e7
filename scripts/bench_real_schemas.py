"""Constrained output on real-world JSON schemas (issue 36: "100% valid on a set of real-world
JSON schemas not written by us"): schemas from JSONSchemaBench (Geng et al. 2025, "Generating
Structured Outputs from Language Models: Benchmark and Studies"; github.com/guidance-ai/jsonschemabench,
collected from GitHub, JSON Schema Store, Kubernetes, Snowplow, the Washington Post and Glaive),
the first ``--per-subset`` files of each subset in name order (none chosen by us). For each
schema the target answers "produce a JSON instance of this schema" under the schema, with plain
decoding and with speculative ``--method``; every finished answer is validated with the
``jsonschema`` package and both token sequences are compared. Prints a table; asserts nothing.
The schemas are read from a checkout or bare clone of the repository (``--repo``), never shipped.

    python scripts/bench_real_schemas.py --repo /path/to/jsonschemabench --per-subset 4
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import jsonschema

from verispec.api import SpecDecoder, load_model
from verispec.types import SamplingParams

SUBSETS = ("Github_easy", "Github_medium", "Github_hard", "Glaiveai2K", "Kubernetes", "JsonSchemaStore", "Snowplow",
           "WashingtonPost")


def schemas(repo: Path, per_subset: int, max_chars: int) -> list[tuple[str, dict]]:
    """(name, schema) of the first ``per_subset`` schemas of each subset that fit ``max_chars``."""
    git = ["git", "-C", str(repo)]
    names = subprocess.run(git + ["ls-tree", "-r", "--name-only", "HEAD", "data/"], capture_output=True, text=True,
                           check=True).stdout.split()
    out = []
    for subset in SUBSETS:
        taken = 0
        for name in sorted(n for n in names if n.startswith(f"data/{subset}/") and n.endswith(".json")):
            if taken == per_subset:
                break
            text = subprocess.run(git + ["show", f"HEAD:{name}"], capture_output=True, text=True, check=True).stdout
            if len(text) > max_chars:
                continue
            out.append((name.removeprefix("data/"), json.loads(text)))
            taken += 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, required=True, help="a clone of guidance-ai/jsonschemabench")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--method", default="auto")
    ap.add_argument("--per-subset", type=int, default=4)
    ap.add_argument("--max-chars", type=int, default=3000, help="schemas longer than this are passed over")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=384)
    args = ap.parse_args()
    target = load_model(args.target)
    decs = {"plain": SpecDecoder(target, "none"), args.method: SpecDecoder(target, args.method)}
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    rows, stats = [], {name: {"valid": 0, "cut": 0, "invalid": 0, "refused": 0, "secs": 0.0, "tokens": 0} for name in decs}
    mismatches = 0
    work = schemas(args.repo, args.per_subset, args.max_chars)
    for i, (name, schema) in enumerate(work):
        prompt = [{"role": "user", "content": "Produce a JSON instance of this JSON schema, with realistic values:\n"
                   + json.dumps(schema)}]
        outs = {}
        for method, dec in decs.items():
            s = stats[method]
            try:
                t = time.perf_counter()
                out = dec.generate(prompt, params, json_schema=schema)
                s["secs"] += time.perf_counter() - t
            except ValueError as err:  # the grammar engine refused the schema (a 400 in the server)
                s["refused"] += 1
                outs[method] = ("refused", str(err).splitlines()[0][:80])
                continue
            s["tokens"] += len(out.token_ids)
            outs[method] = ("tokens", out.token_ids)
            try:
                jsonschema.validate(json.loads(out.text), schema)
                s["valid"] += 1
                verdict = "valid"
            except json.JSONDecodeError:
                s["cut" if out.finish_reason == "length" else "invalid"] += 1
                verdict = "cut at max tokens" if out.finish_reason == "length" else "INVALID JSON"
            except jsonschema.ValidationError as err:
                s["invalid"] += 1
                verdict = f"INVALID: {err.message[:60]}"
            except jsonschema.SchemaError:
                s["valid"] += 1  # the schema itself is not valid draft JSON Schema: parse succeeded
                verdict = "valid JSON (schema not checkable)"
            outs[method] = outs[method] + (verdict,)
        same = outs["plain"][:2] == outs[args.method][:2]
        mismatches += not same
        rows.append((name, outs["plain"][-1] if outs["plain"][0] == "tokens" else "refused: " + outs["plain"][1],
                     "equal" if same else "DIFFERENT"))
        print(f"[{i + 1}/{len(work)}] {name}: {rows[-1][1]}; {args.method} {rows[-1][2]}")
    print(f"\n{len(work)} schemas from JSONSchemaBench ({args.per_subset} per subset, <= {args.max_chars} chars), "
          f"{args.target}, {target.backend.description}, greedy, max {args.max_new_tokens} new tokens\n")
    print("| method | valid | cut at max tokens | invalid | refused by the grammar engine | tokens/s |")
    print("|---|---|---|---|---|---|")
    for method, s in stats.items():
        print(f"| {method} | {s['valid']} | {s['cut']} | {s['invalid']} | {s['refused']} | "
              f"{s['tokens'] / max(s['secs'], 1e-9):.1f} |")
    print(f"\n{args.method} token-equal to plain on {len(work) - mismatches} of {len(work)} schemas")


if __name__ == "__main__":
    main()
