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
tokens the grammar cut before verification and the forced tokens appended after its chains
(a choice's branches included),
the seconds spent drafting (the draft model's prompt prefill included: it starts on its first
draft, on a constrained request only once the steps without it have forgone as much as that prefill
costs), the tokens the draft model ran (its prompt prefill, catch-ups and drafts: 0 when it never
started), the prefill and decode seconds, decode tok/s, the grammar work per decode step and its
share of decode time (``GrammarClock``), and the speed-ups over plain in decode time and end to end.

Decode time is the measure of speculation: the target's prompt prefill (113-584 tokens here, for
answers of 2-138) is the same work in every method and only dilutes the ratio. Both are printed.
llama.cpp's server reports both too (``timings.prompt_ms``, ``predicted_ms``); its answers differ in
length from ours, so it is compared by tokens per second.

"Schema-heavy" is defined on the constrained-plain answer alone, before any speed is looked at: the
share of its tokens the grammar forced (the token is the first of llguidance's forced tokens at that
point, what jump-forward drafts) is at least ``--heavy`` (50%). Totals, for all schemas and for the
schema-heavy ones: sums of seconds (a workload's wall-clock ratio) and geometric means of the
per-schema ratios, decode and end to end; then ours against llama.cpp on the schemas it answered.
Asserts nothing. The schemas are read from a checkout or bare clone of the repository (``--repo``:
``git ls-tree`` / ``git show`` of its HEAD), never shipped.

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
from verispec.constraints import Matcher, speculation
from verispec.constraints.speculation import GrammarDraft
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.hybrid import HybridDrafter
from verispec.engine import engine as engine_module
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


class GrammarClock:
    """The seconds a request spends on grammar work: the engine's per-node masks (``mask_logits``)
    and draft shaping (``shape_draft``: pruning, forced tokens), a draft model's masked chain
    (``GrammarDraft.mask``) and every other call into the grammar engine (a hybrid sizing its
    suffix draft on the grammar: ``Matcher`` methods). Nested calls count once."""

    MATCHER_METHODS = ("fill_bitmask", "advance", "rollback", "valid_prefix", "forced", "allowed")

    def __init__(self) -> None:
        self.seconds, self._depth, self._t0 = 0.0, 0, 0.0
        for name in ("mask_logits", "shape_draft"):
            setattr(engine_module, name, self._timed(getattr(engine_module, name)))
        setattr(GrammarDraft, "mask", self._timed(GrammarDraft.mask))
        for name in self.MATCHER_METHODS:
            setattr(Matcher, name, self._timed(getattr(Matcher, name)))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            if self._depth == 0:
                self._t0 = time.perf_counter()
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.seconds += time.perf_counter() - self._t0
        return timed


@dataclass
class Run:
    """One method's answer to one schema."""

    tokens: list[int] = field(default_factory=list)
    verdict: str = ""
    seconds: float = 0.0  # end to end: prefill + decode
    prefill_s: float = 0.0
    decode_s: float = 0.0
    grammar_s: float = 0.0  # grammar work during decode (``GrammarClock``)
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

    @property
    def decode_tokens(self) -> int:
        """Tokens produced by decode steps: all but the first, which the prefill's logits give."""
        return max(len(self.tokens) - 1, 0)


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


def forced_count(matcher: Matcher, tokens: list[int]) -> int:
    """How many of ``tokens`` (an answer, from the grammar's start) the grammar forced: the token is
    the first of the tokens the grammar forces at that point (llguidance's ``compute_ff_tokens``:
    what jump-forward drafts). The matcher is walked to the answer's end."""
    forced = 0
    for t in tokens:
        if matcher.ends_at(t) or matcher.stopped:
            break
        ff = matcher.forced()
        forced += bool(ff) and ff[0] == t
        if not matcher.advance([t]):
            break
    return forced


def draft_model_of(dec: SpecDecoder) -> DraftModelDrafter | None:
    """The decoder's draft model (alone or a hybrid's learned drafter), if it has one."""
    drafter = dec.drafter.learned if isinstance(dec.drafter, HybridDrafter) else dec.drafter
    return drafter if isinstance(drafter, DraftModelDrafter) else None


def run_ours(dec: SpecDecoder, ids: list[int], params: SamplingParams, plain: bool, shapes: DraftShapes,
             clock: GrammarClock, schema: dict) -> Run:
    shapes.cut = shapes.forced = 0
    draft = draft_model_of(dec)
    fed = draft.fed_tokens if draft is not None else 0
    t0 = time.perf_counter()
    req = dec.engine.add_request(ids, params, draft_limit=0 if plain else None)
    clock.seconds = 0.0  # grammar work of decode steps only (the prefill's first-token mask is prefill)
    try:
        while not req.finished:
            dec.engine.step(req)
    finally:
        dec.engine.finish(req, req.finished or "stop")
    seconds = time.perf_counter() - t0
    s = req.stats
    text = dec.model.tokenizer.decode(req.generated)
    return Run(req.generated, verdict(text, req.finished, schema), seconds, s.prefill_s, seconds - s.prefill_s,
               clock.seconds, s.draft_s, s.steps, s.target_forwards, s.drafted, s.accepted, shapes.cut, shapes.forced,
               draft.fed_tokens - fed if draft is not None else 0)


def run_llama(port: int, ids: list[int], schema: dict, max_new_tokens: int) -> Run:
    """llama.cpp's server under ``schema``, greedy: its verdict, its own ``prompt_ms`` (prefill) and
    ``predicted_ms`` (decode), and placeholder tokens (its ids are not returned; only the count is
    used); verdict "refused: ..." when it cannot turn the schema into a grammar."""
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
        return Run(verdict=f"refused: {err.read().decode(errors='replace')[:60]}")
    t = out["timings"]
    finish = "length" if out.get("stop_type") == "limit" else "eos"
    prefill, decode = t["prompt_ms"] / 1e3, t["predicted_ms"] / 1e3
    # llama.cpp's predicted_n counts the first token too (sampled from the prompt's logits, timed in
    # prompt_ms), so its decode tokens are predicted_n - 1, as ours
    return Run([0] * int(t["predicted_n"]), verdict(out["content"], finish, schema), prefill + decode, prefill,
               decode)


def geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


def totals_table(title: str, names: list[str], results: dict[str, dict[str, Run]], methods: list[str]) -> None:
    """Sums over ``names`` per method: end-to-end and decode seconds, their ratios to plain (sum of
    seconds and geometric mean of per-schema ratios), decode tok/s, grammar share, mismatches."""
    print(f"\n{title}: {len(names)} schemas")
    print("| method | tokens | prefill s | decode s | e2e s | decode tok/s | e2e tok/s | decode vs plain (sum) "
          "| geomean | e2e vs plain (sum) | geomean | grammar share of decode | valid | greedy mismatches |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    plain = [results[n]["plain"] for n in names]
    for m in methods:
        if m == "llama.cpp":
            continue
        runs = [results[n][m] for n in names]
        tokens = sum(len(r.tokens) for r in runs)
        pre, dec, e2e = (sum(getattr(r, a) for r in runs) for a in ("prefill_s", "decode_s", "seconds"))
        dec_ratio = sum(p.decode_s for p in plain) / max(dec, 1e-9)
        e2e_ratio = sum(p.seconds for p in plain) / max(e2e, 1e-9)
        dec_geo = geomean([p.decode_s / r.decode_s for p, r in zip(plain, runs) if r.decode_s and p.decode_s])
        e2e_geo = geomean([p.seconds / r.seconds for p, r in zip(plain, runs) if r.seconds])
        grammar = sum(r.grammar_s for r in runs) / max(dec, 1e-9)
        valid = sum(r.verdict == "valid" for r in runs)
        mism = "" if m == "plain" else sum(r.tokens != p.tokens for p, r in zip(plain, runs))
        print(f"| {m} | {tokens} | {pre:.2f} | {dec:.2f} | {e2e:.2f} | "
              f"{sum(r.decode_tokens for r in runs) / max(dec, 1e-9):.1f} | {tokens / max(e2e, 1e-9):.1f} | "
              f"{dec_ratio:.2f}x | {dec_geo:.2f}x | {e2e_ratio:.2f}x | {e2e_geo:.2f}x | {grammar:.1%} | "
              f"{valid}/{len(runs)} | {mism} |")


def llama_table(names: list[str], results: dict[str, dict[str, Run]], methods: list[str]) -> None:
    """Ours against llama.cpp on the schemas it answered (valid or cut), by tokens per second: the
    answers differ in length (its grammar's whitespace and its tokens differ from ours)."""
    answered = [n for n in names if results[n]["llama.cpp"].tokens]
    print(f"\nagainst llama.cpp constrained plain decoding, on the {len(answered)} schemas it answered; "
          "tok/s = sum of tokens / sum of seconds")
    print("| method | tokens | decode tok/s | vs llama.cpp | e2e tok/s | vs llama.cpp |")
    print("|---|---|---|---|---|---|")
    rates = {}
    for m in ["llama.cpp", *(m for m in methods if m != "llama.cpp")]:
        runs = [results[n][m] for n in answered]
        dec = sum(r.decode_tokens for r in runs) / max(sum(r.decode_s for r in runs), 1e-9)
        e2e = sum(len(r.tokens) for r in runs) / max(sum(r.seconds for r in runs), 1e-9)
        rates[m] = (dec, e2e)
        base = rates["llama.cpp"]
        print(f"| {m} | {sum(len(r.tokens) for r in runs)} | {dec:.1f} | {dec / max(base[0], 1e-9):.2f}x | "
              f"{e2e:.1f} | {e2e / max(base[1], 1e-9):.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, required=True, help="a clone of guidance-ai/jsonschemabench")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--methods", default="none,auto", help="drafters compared with constrained plain decoding")
    ap.add_argument("--per-subset", type=int, default=3)
    ap.add_argument("--max-chars", type=int, default=3000, help="schemas longer than this are passed over")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=320)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--heavy", type=float, default=0.5,
                    help="schema-heavy: at least this share of the plain answer's tokens forced by the grammar")
    ap.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary: adds it as a peer")
    args = ap.parse_args()
    set_threads(args.threads)
    target = load_model(args.target)
    methods = ["plain", *args.methods.split(",")]
    decs = {m: SpecDecoder(target, "none" if m == "plain" else m, prefix_cache_mb=0) for m in methods}
    shapes, clock = DraftShapes(), GrammarClock()
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
          f"max {args.max_new_tokens} new tokens. e2e = prefill + decode; decode tok/s = tokens after the first / "
          "decode s; forced = share of plain's answer the grammar forced (schema-heavy: >= "
          f"{args.heavy:.0%}); grammar = grammar work's share of decode time\n")
    print("| schema | method | tokens | forced | valid | equal | tau | tokens/forward | drafted | accepted "
          "| cut (-) / forced (+) | draft s | draft-model tokens | prefill s | decode s | decode tok/s | grammar ms/step "
          "| grammar share | e2e s | decode vs plain | e2e vs plain |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    results: dict[str, dict[str, Run]] = {}
    shares: dict[str, float] = {}
    for i, (name, schema) in enumerate(work):
        ids = encode_prompt(target, [{"role": "user", "content": PROMPT + json.dumps(schema)}])
        try:
            constrained = decs["plain"].constrained(params, json_schema=schema)
        except ValueError as err:  # the grammar engine refused the schema (a 400 in the server)
            print(f"| {name} | all | refused: {str(err).splitlines()[0][:80]} |||||||||||||||||||")
            continue
        order = methods if i % 2 == 0 else [methods[0], *reversed(methods[1:])]
        runs: dict[str, Run] = {}
        for m in order:
            if m == "llama.cpp":
                runs[m] = run_llama(llama.port, ids, schema, args.max_new_tokens)
            else:
                runs[m] = run_ours(decs[m], ids, constrained, m == "plain", shapes, clock, schema)
        results[name] = runs
        plain = runs["plain"]
        shares[name] = forced_count(constrained.constraint.matcher(), plain.tokens) / max(len(plain.tokens), 1)
        for m in methods:
            r = runs[m]
            ours = m != "llama.cpp"
            equal = "" if m == "plain" or not ours else ("yes" if r.tokens == plain.tokens else "NO")
            # llama.cpp's answers differ in length from ours: it is compared by tok/s (``llama_table``)
            ratios = (f"{plain.decode_s / max(r.decode_s, 1e-9):.2f}x | {plain.seconds / max(r.seconds, 1e-9):.2f}x"
                      if ours else " | ")
            counts = (f"{r.tau:.2f} | {len(r.tokens) / max(r.forwards, 1):.2f} | {r.drafted} | {r.accepted} | "
                      f"-{r.cut} / +{r.forced} | {r.draft_s:.2f} | {r.draft_fed} | ") if ours else "|||||| "
            grammar = (f"{r.grammar_s / max(r.steps, 1) * 1e3:.2f} | {r.grammar_s / max(r.decode_s, 1e-9):.1%} | "
                       if ours else "| | ")
            print(f"| {name} | {m} | {len(r.tokens)} | {shares[name]:.0%} | {r.verdict} | {equal} | {counts}"
                  f"{r.prefill_s:.2f} | {r.decode_s:.2f} | {r.decode_tokens / max(r.decode_s, 1e-9):.1f} | {grammar}"
                  f"{r.seconds:.2f} | {ratios} |", flush=True)
    names = list(results)
    print(f"\n{len(names)} schemas compiled of {len(work)}")
    heavy = [n for n in names if shares[n] >= args.heavy]
    totals_table("all schemas", names, results, methods)
    totals_table(f"schema-heavy (forced share >= {args.heavy:.0%})", heavy, results, methods)
    if llama is not None:
        llama_table(names, results, methods)


if __name__ == "__main__":
    main()
