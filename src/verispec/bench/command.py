"""``verispec bench``: Spec-Bench prompts x methods (ours and peers), interleaved, with
exactness checks, Markdown/JSON results and plots. ``verispec.cli`` registers :func:`bench`.

Only typer/rich are imported at module level, so ``verispec --help`` stays instant.
"""

from __future__ import annotations

import os
import platform
import resource
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.markup import escape

err = Console(stderr=True)


class BenchError(ValueError):
    """Bad input: printed as one line, exit code 2."""


@dataclass(frozen=True)
class BenchOptions:
    data: Path | None
    categories: tuple[str, ...]
    limit: int | None
    methods: tuple[str, ...]
    model: str
    backend: str
    dtype: str
    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_new_tokens: int
    num_draft_tokens: int
    policy: str
    repeats: int
    warmup: int
    threads: int
    ignore_eos: bool
    max_prompt_tokens: int | None
    near_tie: float
    output_dir: Path
    strict: bool
    quick: bool
    quant: str = "auto"
    prefix_cache_mb: float = 1024.0  # per method (0 = off); a method's option prefix_cache_mb overrides it
    draft_search: tuple | None = None  # models.discovery.Location's searched for a draft auto runs; None = off


@dataclass(frozen=True)
class Preset:
    categories: tuple[str, ...]
    limit: int | None
    methods: tuple[str, ...]
    max_new_tokens: int
    warmup: int


DEFAULT = Preset(categories=(), limit=10, methods=("prompt-lookup",), max_new_tokens=128, warmup=1)
# --quick: the CI smoke run (about 3 minutes on 2 busy cores); its speeds mean nothing.
QUICK = Preset(categories=("summarization", "rag"), limit=1, methods=("prompt-lookup",), max_new_tokens=48, warmup=0)


# ----------------------------------------------------------------------------- building runners


@dataclass
class _Shared:
    """Weights loaded once per run and shared by several peer runners."""

    hf_model: Any = None
    notices: list[str] = field(default_factory=list)


def _pop_int(opts: dict[str, str], key: str, default: int) -> int:
    try:
        return int(opts.pop(key, default))
    except ValueError:
        raise BenchError(f"option {key} must be an integer") from None


def _pop_float(opts: dict[str, str], key: str, default: float) -> float:
    try:
        return float(opts.pop(key, default))
    except ValueError:
        raise BenchError(f"option {key} must be a number") from None


def _check_empty(label: str, opts: dict[str, str]) -> None:
    if opts:
        raise BenchError(f"method {label} has no option(s) {', '.join(sorted(opts))}")


def _hf_runner(spec, opts: dict[str, str], k: int, lm, o: BenchOptions, shared: _Shared):
    from ..models.load import DTYPES
    from ..models.draft_checkpoint import is_draft_weights
    from .peers import HFGenerateRunner, configure_assistant, load_hf_model

    dtype = DTYPES[o.dtype]
    if shared.hf_model is None:
        shared.hf_model = load_hf_model(lm.hf_dir, dtype)
    eos = lm.backend.info.eos_token_ids
    if spec.name == "hf-generate":
        _check_empty(spec.label, opts)
        return HFGenerateRunner(spec.label, shared.hf_model, "plain", k, eos)
    if spec.name == "hf-pld":
        ngram = _pop_int(opts, "max_ngram", 2)
        _check_empty(spec.label, opts)
        return HFGenerateRunner(spec.label, shared.hf_model, "pld", k, eos, max_ngram=ngram)
    from ..weights import has_shipped

    draft = opts.pop("model", "shipped" if has_shipped("draft", lm.name) else "truncated:4")
    confidence = float(opts.pop("confidence", 0.4))
    _check_empty(spec.label, opts)
    if draft == "shipped" or is_draft_weights(draft):
        from ..models.load import distilled_draft_dir

        try:
            assistant = load_hf_model(distilled_draft_dir(lm, draft), dtype)
        except ValueError as e:
            raise BenchError(f"{spec.label}: {e}") from None
    elif draft.startswith("truncated:"):
        layers = _pop_int({"layers": draft.removeprefix("truncated:")}, "layers", 0)
        if layers < 1:
            raise BenchError(f"{spec.label}: truncated:N needs N >= 1")
        assistant = load_hf_model(lm.hf_dir, dtype, num_layers=layers)
    else:
        from ..models.converted import converted_hf_dir
        from ..models.resolve import resolve_model

        assistant = load_hf_model(converted_hf_dir(resolve_model(draft)), dtype)
    configure_assistant(assistant, k, confidence)
    return HFGenerateRunner(spec.label, shared.hf_model, "assisted", k, eos, assistant=assistant)


def _llamacpp_runner(spec, opts: dict[str, str], k: int, lm, o: BenchOptions, shared: _Shared):
    from ..models.resolve import resolve_model
    from .peers import LlamaCppRunner, llamacpp_available

    if not llamacpp_available():
        shared.notices.append(f"{spec.label} skipped: llama-cpp-python is not installed "
                              "(pip install 'verispec[llamacpp]')")
        return None
    source = resolve_model(o.model)
    if source.kind != "gguf":
        shared.notices.append(f"{spec.label} skipped: model {o.model} is not a GGUF file")
        return None
    ngram = _pop_int(opts, "max_ngram", 2)
    _check_empty(spec.label, opts)
    n_ctx = min(lm.backend.info.max_length, 4096)
    return LlamaCppRunner(spec.label, source.path, lm.backend.info.eos_token_ids, o.threads, n_ctx,
                          k if spec.name == "llamacpp-pld" else None, ngram)


def _llama_server_runner(spec, opts: dict[str, str], lm, o: BenchOptions, shared: _Shared):
    from ..models.catalog import CATALOG
    from ..models.resolve import resolve_model
    from .peers import LlamaServerRunner, llama_server_bin

    exe = llama_server_bin()
    if exe is None:
        shared.notices.append(f"{spec.label} skipped: no llama-server (run scripts/build_llamacpp.sh or set LLAMACPP_BIN)")
        return None
    source = resolve_model(o.model)
    if source.kind != "gguf":
        shared.notices.append(f"{spec.label} skipped: model {o.model} is not a GGUF file")
        return None
    draft, cfg = None, {"poll": _pop_int(opts, "poll", 50), "fa": _pop_int(opts, "fa", 0)}
    if spec.name == "llamacpp-server-spec":
        entry = CATALOG.get(lm.name)
        name = opts.pop("model", entry.draft if entry is not None and entry.draft else None)
        if name is None:
            raise BenchError(f"{spec.label}: the model has no catalog draft; give model=<draft GGUF>")
        draft_source = resolve_model(name)
        if draft_source.kind != "gguf":
            raise BenchError(f"{spec.label}: the draft {name} is not a GGUF file")
        draft = draft_source.path
        cfg |= {"draft_max": _pop_int(opts, "draft_max", 4), "p_min": _pop_float(opts, "p_min", 0.75),
                "td": _pop_int(opts, "td", o.threads)}
    _check_empty(spec.label, opts)
    if not o.temperature == 0:
        raise BenchError(f"{spec.label} runs greedy only (--temperature 0)")
    return LlamaServerRunner(spec.label, exe, source.path, lm.backend.info.eos_token_ids, o.threads,
                             min(lm.backend.info.max_length, 16384), draft, cfg)


def build_runners(specs, lm, o: BenchOptions) -> tuple[list, list[str]]:
    """One runner per method spec (baseline first); peers that cannot run are skipped
    with a notice. Every method takes the option ``k`` (its own draft budget, default
    ``-k``). Returns (runners, notices)."""
    from ..registry import ALIASES, built_cost, describe_method, make_drafter
    from .runners import EngineRunner

    shared, runners = _Shared(), []
    for spec in specs:
        opts = spec.option_dict()
        k = _pop_int(opts, "k", o.num_draft_tokens)
        if k < 1:
            raise BenchError(f"method {spec.label}: k must be >= 1")
        if spec.kind == "engine":
            mb = _pop_float(opts, "prefix_cache_mb", o.prefix_cache_mb)
            predicts = opts.pop("prediction", "no")
            if predicts not in ("yes", "ids", "prompt", "no"):
                raise BenchError(f"method {spec.label}: prediction must be yes, ids, prompt or no")
            drafter = make_drafter(spec.name, lm, opts)
            if ALIASES.get(spec.name, spec.name) == "auto":  # the statistics name what auto ran
                shared.notices.append(f"method {spec.label}: {describe_method(spec.name, lm)}")
            # ids: token-id places only (no edit alignment); prompt: none sent, the prompt's code block aligned
            tokenizer = lm.tokenizer if predicts in ("yes", "prompt") else None
            runners.append(EngineRunner(spec.label, lm.backend, drafter, k, o.policy, mb, predicts in ("yes", "ids"),
                                        built_cost(lm), tokenizer, prompt_code=predicts == "prompt"))
        elif spec.kind == "hf":
            runners.append(_hf_runner(spec, opts, k, lm, o, shared))
        else:
            server = spec.name.startswith("llamacpp-server")
            runner = (_llama_server_runner(spec, opts, lm, o, shared) if server
                      else _llamacpp_runner(spec, opts, k, lm, o, shared))
            if runner is not None:
                runners.append(runner)
    return runners, shared.notices


def make_builder(lm, o: BenchOptions):
    """Chat models: messages through the chat template. Base models: turns and answers
    joined by blank lines after BOS. FIM items through the model's FIM tokens (none: the fim
    workload is refused); predictions as the API encodes them."""
    from functools import partial

    from ..api import encode_prediction, encode_prompt
    from ..fim import fim_prompt, fim_token_ids
    from .harness import PromptBuilder

    info = lm.backend.info
    room = info.max_length - o.max_new_tokens - o.num_draft_tokens - 1
    limit = min(room, o.max_prompt_tokens or room)
    decode = lambda ids: lm.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    fim = partial(fim_prompt, lm.tokenizer) if fim_token_ids(lm.tokenizer) else None
    extra = {"fim": fim, "encode_prediction": partial(encode_prediction, lm)}
    if lm.has_chat_template:
        return PromptBuilder(lambda msgs: encode_prompt(lm, msgs), decode, limit, **extra)
    encode = lambda msgs: encode_prompt(lm, "\n\n".join(m["content"] for m in msgs), chat=False)  # noqa: E731
    return PromptBuilder(encode, decode, limit, keep_first=info.bos_token_id is not None, **extra)


# ----------------------------------------------------------------------------- the run


def _meta(o: BenchOptions, lm, num_prompts: int, notices: list[str]) -> dict:
    import torch

    return {
        "command": shlex.join(["verispec", *sys.argv[1:]]) if sys.argv[1:2] == ["bench"] else "verispec bench (API)",
        "started": time.strftime("%Y-%m-%d %H:%M:%S"), "model": lm.name, "backend": lm.backend_kind,
        "backend_detail": lm.backend.description,
        "dtype": o.dtype, "quant": lm.backend.quant, "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}",
        "threads": o.threads, "prompts": num_prompts, "categories": list(o.categories), "limit": o.limit,
        "max_new_tokens": o.max_new_tokens, "num_draft_tokens": o.num_draft_tokens, "policy": o.policy,
        "temperature": o.temperature, "top_p": o.top_p, "top_k": o.top_k, "seed": o.seed,
        "repeats": o.repeats, "warmup": o.warmup, "ignore_eos": o.ignore_eos, "near_tie": o.near_tie,
        "quick": o.quick, "notices": notices,
        "found_draft": str(lm.found_draft.path) if getattr(lm, "found_draft", None) else None,  # --draft-search: auto's draft
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),  # whole process
    }


def _progress():
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    return Progress(TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=err)


class _LineLog:
    """One progress line per generation (with an ETA) when stderr is not a terminal."""

    def __init__(self, total: int):
        self.total, self.done, self.t0 = total, 0, time.perf_counter()

    def tick(self, label: str) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / self.done * (self.total - self.done)
        err.print(f"[{self.done}/{self.total}] {escape(label)} · elapsed {elapsed:.0f} s · ETA {eta:.0f} s",
                  highlight=False, soft_wrap=True)


def run_bench(o: BenchOptions) -> tuple[dict, int]:
    """Run the benchmark and write results; returns (paths/summary info, mismatches of
    our methods that are not near-ties). Raises BenchError/ValueError on bad input."""
    from ..registry import DRAFTERS
    from ..system import threads
    from ..types import SamplingParams
    from .datasets import GROUPS, load_data_file, load_prompts
    from .methods import parse_method, with_baseline

    specs = with_baseline([parse_method(m, tuple(DRAFTERS)) for m in o.methods])
    params = SamplingParams(temperature=o.temperature, top_k=o.top_k, top_p=o.top_p,
                            max_new_tokens=o.max_new_tokens, seed=o.seed, ignore_eos=o.ignore_eos)
    prompts = (load_data_file(o.data, o.categories, o.limit) if o.data is not None
               else load_prompts(None, o.categories or GROUPS, o.limit))
    if not prompts:
        raise BenchError("no prompts selected")
    with threads(o.threads):  # before loading: the compiled runtime sizes its pool at load
        return _run_loaded(o, specs, params, prompts)


def _run_loaded(o: BenchOptions, specs, params, prompts) -> tuple[dict, int]:
    from ..models.load import load_model
    from .harness import num_generations, run
    from .lossless import check_records
    from .methods import BASELINE
    from .metrics import summarize
    from .report import write_all

    lm = load_model(o.model, dtype=o.dtype, backend=o.backend, quant=o.quant)
    if o.draft_search is not None:  # --draft-search: auto runs a draft found on the machine
        from ..cli.common import say
        from ..models.discovery import with_found_draft

        lm = with_found_draft(lm, o.draft_search, say)
    runners, notices = build_runners(specs, lm, o)
    for note in notices:
        err.print(f"[yellow]notice:[/yellow] {escape(note)}", highlight=False, soft_wrap=True)
    total = num_generations(prompts, len(runners), o.repeats) + o.warmup * len(runners)
    with _progress() as progress:
        task = progress.add_task("bench", total=total)
        log = _LineLog(total) if not err.is_terminal else None  # rich shows no live bar in a log file

        def tick(label: str) -> None:
            progress.update(task, advance=1, description=label[:28])
            if log:
                log.tick(label)

        records = run(runners, prompts, make_builder(lm, o), params, repeats=o.repeats, warmup=o.warmup,
                      on_generation=tick)
    meta, memory = _meta(o, lm, len(prompts), notices), {r.label: r.memory_bytes() for r in runners}
    write_all(o.output_dir, meta, records, [], [], memory)  # measurements first: never lost to a later error
    rows = check_records(records, BASELINE, lm.backend, o.near_tie) if params.greedy else []
    paths = write_all(o.output_dir, meta, records, summarize(records, BASELINE), rows, memory)
    ours = {s.label for s in specs if not s.is_peer}
    bad = sum(1 for r in rows if r.status == "mismatch" and r.method in ours)
    return {"paths": paths, "summaries": summarize(records, BASELINE), "rows": rows}, bad


def resolve_preset(quick: bool, categories: list[str], limit: Optional[int], methods: list[str],
             max_new_tokens: Optional[int], warmup: Optional[int]) -> Preset:
    """Explicit options win over the preset (--quick or the defaults)."""
    p = QUICK if quick else DEFAULT
    return Preset(tuple(categories) or p.categories, limit if limit is not None else p.limit,
                  tuple(methods) or p.methods, max_new_tokens if max_new_tokens is not None else p.max_new_tokens,
                  warmup if warmup is not None else p.warmup)


def check_options(o: BenchOptions) -> None:
    """Every option, before any model is loaded or prompt run (raises BenchError)."""
    from ..paths import check_output_dir
    from ..types import MAX_SEED

    if o.threads < 1 or o.repeats < 1 or o.warmup < 0 or (o.limit or 0) < 0 or o.num_draft_tokens < 1:
        raise BenchError("threads, repeats and --num-draft-tokens must be >= 1; warmup and limit >= 0")
    if o.max_new_tokens < 1:
        raise BenchError(f"--max-new-tokens must be >= 1, got {o.max_new_tokens}")
    if o.max_prompt_tokens is not None and o.max_prompt_tokens < 1:
        raise BenchError(f"--max-prompt-tokens must be >= 1, got {o.max_prompt_tokens}")
    if not 0 <= o.seed <= MAX_SEED - (o.repeats - 1):
        raise BenchError(f"--seed must be in [0, 2^63 - repeats] (repeat r uses seed + r), got {o.seed}")
    if o.data is not None and not o.data.is_file():
        raise BenchError(f"benchmark file {o.data} not found")
    check_output_dir(o.output_dir, "--output-dir")


def bench(
    data: Optional[Path] = typer.Option(None, "--data", help="a JSONL file of prompts instead of the shipped ones: Spec-Bench rows (question_id, category, turns) and rows of the edit, agent and fim workloads in the shipped format (category edit: turns + prediction; agent: messages; fim: prefix + suffix); -c selects its groups (default: all it has)"),
    category: list[str] = typer.Option([], "--category", "-c", help="Spec-Bench groups mt_bench, translation, summarization, qa, math_reasoning, rag (default: these six), our multi-turn agentic workload `agentic` (code/text revision loops, JSON tool calls), and workloads built from real material: `edit` (click functions + their commit's change; -m NAME:prediction=yes sends the original as the prediction), `agent` (SWE-agent session replays), `fim` (stdlib bodies, the model's FIM tokens); repeatable"),
    limit: Optional[int] = typer.Option(None, "--limit", help="prompts (agentic: sessions) per category (default 10; 0 = all)"),
    method: list[str] = typer.Option([], "--method", "-m", help="drafter[:k=v,...] or a peer (hf-generate, hf-pld, hf-assisted:model=truncated:4, llamacpp, llamacpp-pld); repeatable; the baseline `none` always runs"),
    model: str = typer.Option("smollm2-135m-instruct", help="catalog name or path"),
    backend: str = typer.Option("auto", help="auto (the compiled CPU runtime for Llama-family models on CPU), cpu, native or hf"),
    quant: str = typer.Option("auto", help="weights: auto (the checkpoint's own: a GGUF's blocks on cpu, int4 for a Q4 GGUF on native), none (float32), int8 or int4 (quantized at load: Q8_0 / Q4_1 on cpu, int8 / int4 on native; hf: auto or none)"),
    dtype: str = typer.Option("float32", help="float32 or bfloat16"),
    temperature: float = typer.Option(0.0, help="0 = greedy (exactness is checked); > 0 = sampling"),
    top_p: float = typer.Option(1.0),
    top_k: int = typer.Option(0),
    seed: int = typer.Option(0, help="sampling seed of repeat r is seed + r"),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", "-n", help="default 128 (48 with --quick)"),
    num_draft_tokens: int = typer.Option(8, "--num-draft-tokens", "-k", help="draft budget per step (a method's option k overrides it)"),
    policy: str = typer.Option("fixed", help="draft length policy of our engine: fixed or heuristic"),
    repeats: int = typer.Option(1, help="runs of every prompt per method (spread = std over repeats)"),
    warmup: Optional[int] = typer.Option(None, help="warm-up prompts per method, not recorded (default 1; 0 with --quick)"),
    threads: int = typer.Option(1, help="torch / llama.cpp threads (1 is fastest on a shared 2-core machine)"),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="always generate max_new_tokens"),
    max_prompt_tokens: Optional[int] = typer.Option(None, help="keep only the most recent prompt tokens"),
    near_tie: float = typer.Option(1e-3, help="top-2 logit gap below which a greedy divergence is a near-tie"),
    output_dir: Optional[Path] = typer.Option(None, "--output-dir", help="default results/bench-<timestamp>"),
    strict: bool = typer.Option(False, "--strict", help="exit 1 if one of our methods mismatches (not a near-tie)"),
    quick: bool = typer.Option(False, "--quick", help="CI smoke run: 1 summarization + 1 rag prompt, 48 tokens, none vs prompt-lookup"),
    prefix_cache_mb: float = typer.Option(1024.0, help="MiB of K/V each method keeps across its requests (prefix cache, cpu backend; 0 = off); a method's option prefix_cache_mb overrides it, e.g. -m none:prefix_cache_mb=0"),
    draft_search: bool = typer.Option(False, "--draft-search", help="method auto drafts with a draft model found among the GGUF files on this machine (as `verispec generate --draft-search`)"),
    draft_search_path: list[Path] = typer.Option([], "--draft-search-path", help="a folder --draft-search looks in instead of the usual stores (repeatable; implies --draft-search)"),
) -> None:
    """Benchmark methods on Spec-Bench (and our workloads) against plain decoding (and peer engines)."""
    from transformers.utils import logging as hf_logging

    from ..models.base import ModelError

    hf_logging.set_verbosity_error()  # load reports of truncated drafts and deprecation chatter
    p = resolve_preset(quick, category, limit, method, max_new_tokens, warmup)
    out = output_dir or Path("results") / time.strftime("bench-%Y%m%d-%H%M%S")
    opts = BenchOptions(data, p.categories, p.limit or None, p.methods, model, backend, dtype, temperature,
                        top_p, top_k, seed, p.max_new_tokens, num_draft_tokens, policy, repeats, p.warmup,
                        threads, ignore_eos, max_prompt_tokens, near_tie, out, strict, quick, quant, prefix_cache_mb,
                        _draft_search(draft_search, draft_search_path))
    try:
        check_options(opts)
        result, bad = run_bench(opts)
    except (ValueError, ModelError) as e:
        err.print(f"[red]error:[/red] {escape(str(e).splitlines()[0] if str(e) else type(e).__name__)}",
                  highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    _print_summary(result)
    if strict and bad:
        err.print(f"[red]strict:[/red] {bad} greedy output(s) of verispec methods differ from plain decoding "
                  "beyond a near-tie", highlight=False)
        raise typer.Exit(1)


def _draft_search(search: bool, paths: list[Path]):
    from ..cli.common import draft_search_locations

    return draft_search_locations(search, paths)


def _print_summary(result: dict) -> None:
    from ..cli.common import emit  # a failing stdout is one line and exit 2
    from .lossless import exactness_counts
    from .report import speedup_table

    emit("\n".join(speedup_table(result["summaries"])))
    for m, c in exactness_counts(result["rows"]).items():
        emit(f"exactness {m}: {c['equal']} equal, {c['near-tie']} near-tie, {c['mismatch']} mismatch, "
             f"{c['skipped']} skipped")
    for name, path in result["paths"].items():
        emit(f"{name}: {path}")
