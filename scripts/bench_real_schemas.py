"""Constrained output on real-world JSON schemas (issue 36): validity, exactness and speed of
constrained speculation against constrained plain decoding, per schema, on schemas from
JSONSchemaBench (Geng et al. 2025, "Generating Structured Outputs from Language Models:
Benchmark and Studies"; github.com/guidance-ai/jsonschemabench, collected from GitHub, JSON
Schema Store, Kubernetes, Snowplow, the Washington Post and Glaive): the first ``--per-subset``
files of each subset in name order that fit ``--max-chars`` (none chosen or written by us).

For each schema the target answers "produce a JSON instance of this schema" under the schema,
greedy, with every method in turn (interleaved: the order alternates per schema, so load on a
shared machine weighs on all alike):

- ``plain``: constrained plain decoding, speculation off (``draft_limit=0``): the baseline;
- each of ``--methods`` (default ``none,auto``): ``none`` drafts only the tokens the grammar
  forces (jump-forward), ``auto`` the default drafter (on the Qwen2.5-Coder pair: suffix + the
  0.5B draft model, whose drafts are masked by the grammar) plus forced tokens;
- ``--llama-server`` (optional): llama.cpp's server on the same GGUF and threads, the same prompt
  tokens and the schema as ``json_schema`` (llama.cpp turns it into a GBNF grammar; its JSON
  allows other whitespace, so its text differs), its own ``prompt_ms`` + ``predicted_ms``.

Per schema and method: valid (``jsonschema``), token-equal to plain, tau (tokens per decode step),
tokens per target forward (prefill included), drafted / accepted tokens, the drafter's draft
tokens the grammar cut before verification and the forced tokens appended after its chains,
the seconds spent drafting (the draft model's prompt prefill included: it starts on its first
draft, on a constrained request only once the steps without it have forgone as much as that prefill
costs), the tokens the draft model ran (its prompt prefill, catch-ups and drafts: 0 when it never
started), and the end-to-end speed-up over plain (prefill included; the target's prefill is the
same for all). Totals: the sums of seconds (a schema-heavy workload's wall-clock ratio) and the
geometric mean of per-schema ratios. Asserts nothing. The schemas are read from a checkout or
bare clone of the repository (``--repo``), never shipped.

    python scripts/bench_real_schemas.py --repo /path/to/jsonschemabench --per-subset 3 -n 320 \\
        --threads 2 --llama-server ~/.cache/verispec/llama.cpp/build/bin/llama-server
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema

from verispec.api import SpecDecoder, encode_prompt, load_model
from verispec.constraints import speculation
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.hybrid import HybridDrafter
from verispec.system import set_threads
from verispec.types import SamplingParams

SUBSETS = ("Github_easy", "Github_medium", "Github_hard", "Glaiveai2K", "Kubernetes", "JsonSchemaStore", "Snowplow",
           "WashingtonPost")
PROMPT = "Produce a JSON instance of this JSON schema, with realistic values:\n"


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


class DraftShapes:
    """Wraps the grammar's two draft edits (``constraints.speculation.prune`` and ``jump_forward``,
    which ``shape_draft`` calls) and sums, over a request's steps, the drafter's tokens the grammar
    cut and the forced tokens it added."""

    def __init__(self) -> None:
        self.cut = self.forced = 0
        for name in ("prune", "jump_forward"):
            setattr(speculation, name, self._counted(name, getattr(speculation, name)))

    def _counted(self, name: str, fn):
        def counted(tree, *args, **kwargs):
            out = fn(tree, *args, **kwargs)
            if name == "prune":
                self.cut += tree.num_drafted - out.num_drafted
            else:
                self.forced += out.num_drafted - tree.num_drafted
            return out
        return counted


@dataclass
class Run:
    """One method's answer to one schema."""

    tokens: list[int] = field(default_factory=list)
    verdict: str = ""
    seconds: float = 0.0
    draft_s: float = 0.0
    steps: int = 0
    forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    cut: int = 0  # the drafter's draft tokens the grammar forbade (cut before verification)
    forced: int = 0  # tokens the grammar forced, drafted after the drafter's chain (jump-forward)
    draft_fed: int = 0  # tokens the draft model ran (prefill, catch-ups, drafts)

    @property
    def tau(self) -> float:
        return (self.accepted + self.steps) / max(self.steps, 1)


def verdict(text: str, finish: str, schema: dict) -> str:
    try:
        jsonschema.validate(json.loads(text), schema)
        return "valid"
    except json.JSONDecodeError:
        return "cut at max tokens" if finish == "length" else "INVALID JSON"
    except jsonschema.ValidationError as err:
        return f"INVALID: {err.message[:60]}"
    except jsonschema.SchemaError:
        return "valid JSON (schema not checkable)"  # the schema itself is not valid JSON Schema


def draft_model_of(dec: SpecDecoder) -> DraftModelDrafter | None:
    """The decoder's draft model (alone or a hybrid's learned drafter), if it has one."""
    drafter = dec.drafter.learned if isinstance(dec.drafter, HybridDrafter) else dec.drafter
    return drafter if isinstance(drafter, DraftModelDrafter) else None


def run_ours(dec: SpecDecoder, ids: list[int], params: SamplingParams, plain: bool, shapes: DraftShapes,
             schema: dict) -> Run:
    shapes.cut = shapes.forced = 0
    draft = draft_model_of(dec)
    fed = draft.fed_tokens if draft is not None else 0
    t0 = time.perf_counter()
    req = dec.engine.add_request(ids, params, draft_limit=0 if plain else None)
    try:
        while not req.finished:
            dec.engine.step(req)
    finally:
        dec.engine.finish(req, req.finished or "stop")
    seconds = time.perf_counter() - t0
    s = req.stats
    text = dec.model.tokenizer.decode(req.generated)
    return Run(req.generated, verdict(text, req.finished, schema), seconds, s.draft_s, s.steps, s.target_forwards,
               s.drafted, s.accepted, shapes.cut, shapes.forced, draft.fed_tokens - fed if draft is not None else 0)


def run_llama(port: int, ids: list[int], schema: dict, max_new_tokens: int) -> tuple[str, float, int]:
    """(verdict, seconds prefill + decode, tokens) of llama.cpp's server under ``schema``, greedy;
    ("refused: ...", 0, 0) when it cannot turn the schema into a grammar."""
    import urllib.error
    import urllib.request

    body = {"prompt": ids, "n_predict": max_new_tokens, "temperature": 0.0, "top_k": 1, "json_schema": schema,
            "cache_prompt": False, "stream": False}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=3600) as r:
            out = json.loads(r.read())
    except urllib.error.HTTPError as err:
        return f"refused: {err.read().decode(errors='replace')[:60]}", 0.0, 0
    t = out["timings"]
    finish = "length" if out.get("stop_type") == "limit" else "eos"
    return verdict(out["content"], finish, schema), (t["prompt_ms"] + t["predicted_ms"]) / 1e3, int(t["predicted_n"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, required=True, help="a clone of guidance-ai/jsonschemabench")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--methods", default="none,auto", help="drafters compared with constrained plain decoding")
    ap.add_argument("--per-subset", type=int, default=3)
    ap.add_argument("--max-chars", type=int, default=3000, help="schemas longer than this are passed over")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=320)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary: adds it as a peer")
    args = ap.parse_args()
    set_threads(args.threads)
    target = load_model(args.target)
    methods = ["plain", *args.methods.split(",")]
    decs = {m: SpecDecoder(target, "none" if m == "plain" else m, prefix_cache_mb=0) for m in methods}
    shapes = DraftShapes()
    llama = None
    if args.llama_server:
        from verispec.bench.peers import LlamaServerRunner

        llama = LlamaServerRunner("llama.cpp", Path(args.llama_server), Path(target.source.path),
                                  target.backend.info.eos_token_ids, args.threads, 4096)
        methods.append("llama.cpp")
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    work = schemas(args.repo, args.per_subset, args.max_chars)
    print(f"{len(work)} schemas from JSONSchemaBench ({args.per_subset} per subset, <= {args.max_chars} chars), "
          f"{args.target} on {target.backend.description}, {args.threads} threads, greedy, "
          f"max {args.max_new_tokens} new tokens; ratio: end-to-end seconds of plain / the method's\n")
    print("| schema | method | tokens | valid | equal | tau | tokens/forward | drafted | accepted | cut (-) / forced (+) "
          "| draft s | draft-model tokens | seconds | vs plain |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    totals = {m: [0.0, 0.0, []] for m in methods[1:]}  # method -> [its seconds, plain's seconds, ratios]
    mismatches = {m: 0 for m in methods[1:]}
    counted = 0
    for i, (name, schema) in enumerate(work):
        ids = encode_prompt(target, [{"role": "user", "content": PROMPT + json.dumps(schema)}])
        try:
            constrained = decs["plain"].constrained(params, json_schema=schema)
        except ValueError as err:  # the grammar engine refused the schema (a 400 in the server)
            print(f"| {name} | all | refused: {str(err).splitlines()[0][:80]} ||||||||||||")
            continue
        order = methods if i % 2 == 0 else [methods[0], *reversed(methods[1:])]
        runs: dict[str, Run] = {}
        for m in order:
            if m == "llama.cpp":
                v, secs, n = run_llama(llama.port, ids, schema, args.max_new_tokens)
                runs[m] = Run([0] * n, v, secs)
            else:
                runs[m] = run_ours(decs[m], ids, constrained, m == "plain", shapes, schema)
        counted += 1
        plain = runs["plain"]
        for m in methods:
            r = runs[m]
            ours = m != "llama.cpp"
            equal = "" if m == "plain" or not ours else ("yes" if r.tokens == plain.tokens else "NO")
            ratio = plain.seconds / r.seconds if r.seconds else float("nan")
            if m != "plain":
                mismatches[m] += equal == "NO"
                if r.seconds:
                    totals[m][0] += r.seconds
                    totals[m][1] += plain.seconds
                    totals[m][2].append(ratio)
            print(f"| {name} | {m} | {len(r.tokens)} | {r.verdict} | {equal} | "
                  + (f"{r.tau:.2f} | {len(r.tokens) / max(r.forwards, 1):.2f} | {r.drafted} | {r.accepted} | -{r.cut} / +{r.forced} | "
                     f"{r.draft_s:.2f} | {r.draft_fed} | " if ours else "|||||||| ")
                  + f"{r.seconds:.2f} | {ratio:.2f}x |", flush=True)
    print(f"\n{counted} schemas compiled of {len(work)}")
    print("| method | seconds, all schemas | plain's | speed-up (sum of seconds) | geometric mean of speed-ups "
          "| greedy mismatches |")
    print("|---|---|---|---|---|---|")
    for m, (secs, plain_secs, ratios) in totals.items():
        geo = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else float("nan")
        print(f"| {m} | {secs:.1f} | {plain_secs:.1f} | {plain_secs / max(secs, 1e-9):.2f}x | {geo:.2f}x | "
              f"{mismatches[m] if m != 'llama.cpp' else ''} |")


if __name__ == "__main__":
    main()
