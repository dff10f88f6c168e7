"""``verispec generate`` (one prompt, speculative decoding, statistics) and ``verispec demo``
(plain and speculative greedy decoding side by side)."""

from __future__ import annotations

import json
import resource
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from .common import (DRAFT_SEARCH_HELP, DRAFT_SEARCH_PATH_HELP, PREFIX_CACHE_HELP, PREFIX_CACHE_MB, QUANT_HELP,
                     THREADS_HELP, check, check_model_arg, check_text_args, draft_search_locations, emit, err, fail,
                     parse_options, read_prompt, say)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def stats_table(stats: dict) -> Table:
    table = Table(title="speculation statistics", show_header=False)
    table.add_row("drafter", escape(str(stats.get("drafter"))))  # what auto ran
    if stats.get("drafted_by"):
        table.add_row("drafted_by", escape(" ".join(f"{k} {v}" for k, v in stats["drafted_by"].items())))
    for key in ("new_tokens", "cached_tokens", "target_forwards", "steps", "drafted", "accepted", "tau", "alpha",
                "tokens_per_second", "prefill_s", "decode_s", "peak_rss_mb", "backend", "threads", "bit_exact",
                "bit_exact_reason", "prefix_cache"):
        table.add_row(key, escape(str(stats.get(key))))
    ppa = stats.get("per_position_acceptance") or []
    table.add_row("per_position_acceptance", " ".join(f"{x:.2f}" for x in ppa[:12]))
    return table


def generate(
    prompt: Optional[str] = typer.Argument(None, help="prompt text; '-' or omitted reads stdin"),
    file: Optional[Path] = typer.Option(None, "--file", "-f", help="read the prompt from a file"),
    prediction: Optional[Path] = typer.Option(None, "--prediction", help="a file the answer is expected to repeat "
                                              "(e.g. the code an edit applies to; OpenAI's Predicted Outputs): it "
                                              "drafts, the output is unchanged"),
    json_schema: Optional[Path] = typer.Option(None, "--json-schema", help="a JSON Schema file: the answer is JSON "
                                               "valid against it (constrained decoding, exact under speculation)"),
    grammar: Optional[Path] = typer.Option(None, "--grammar", help="a Lark or GBNF grammar file the answer follows"),
    model: str = typer.Option("smollm2-135m-instruct", help="catalog name or path (see `verispec models`)"),
    drafter: str = typer.Option("auto", help="auto (default: the best lossless method measured for the model: "
                                "Qwen2.5-Coder 1.5B: hybrid of suffix and the 0.5B draft; others: suffix), "
                                "suffix, prompt-lookup, draft, hybrid, none, ... (`verispec drafters`)"),
    drafter_option: list[str] = typer.Option([], "--drafter-option", "-o", help="key=value, repeatable: an option of the drafter (`verispec drafters` lists them)"),
    num_draft_tokens: int = typer.Option(16, "-k", "--num-draft-tokens", help="draft budget per step (16: the "
                                         "compiled runtime verifies 16 tokens for ~3x one step, docs/cpu.md)"),
    policy: str = typer.Option("fixed", help="draft length policy: fixed or heuristic"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n"),
    temperature: float = typer.Option(0.0, help="0 = greedy"),
    top_k: int = typer.Option(0, help="0 disables"),
    top_p: float = typer.Option(1.0),
    seed: int = typer.Option(0),
    stop: list[str] = typer.Option([], help="stop string, repeatable"),
    chat: Optional[bool] = typer.Option(None, "--chat/--no-chat", help="wrap the prompt as a user message (default: when the model has a chat template)"),
    stream: bool = typer.Option(False, "--stream", help="print text as it is generated"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    dtype: str = typer.Option("float32", help="activation dtype (and weights' when unquantized): float32 or bfloat16"),
    backend: str = typer.Option("auto", help="auto (the compiled CPU runtime for Llama-family models on CPU), "
                                "cpu, native (PyTorch) or hf"),
    quant: str = typer.Option("auto", help=QUANT_HELP),
    prefix_cache_mb: float = typer.Option(PREFIX_CACHE_MB, help=PREFIX_CACHE_HELP),
    threads: Optional[int] = typer.Option(None, "--threads", help=THREADS_HELP),
    draft_search: bool = typer.Option(False, "--draft-search", help=DRAFT_SEARCH_HELP),
    draft_search_path: list[Path] = typer.Option([], "--draft-search-path", help=DRAFT_SEARCH_PATH_HELP),
) -> None:
    """Generate text with speculative decoding and print speculation statistics."""
    from ..api import SpecDecoder, load_model
    from ..engine.prefix_cache import prefix_cache_support
    from ..models.base import ModelError
    from ..system import set_threads
    from ..types import SamplingParams

    from ..registry import ALIASES, DRAFTERS, describe_method

    from ..chat import max_text_chars
    from ..chat_template import TemplateError

    if drafter not in DRAFTERS and drafter not in ALIASES:
        fail(f"unknown drafter {drafter!r}; choose one of: {', '.join(DRAFTERS)}")
    check_text_args(stop, "--stop")
    check_model_arg(model)
    text = read_prompt(prompt, file)
    predicted = read_prompt(None, prediction, "prediction") if prediction is not None else None
    schema_text = read_prompt(None, json_schema, "JSON schema") if json_schema is not None else None
    grammar_text = read_prompt(None, grammar, "grammar") if grammar is not None else None
    try:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                max_new_tokens=max_new_tokens, seed=seed, stop=tuple(stop))
        n_threads = set_threads(threads)  # before loading: the compiled runtime sizes its pool at load
        lm = load_model(model, dtype=dtype, backend=backend, quant=quant)
        locations = draft_search_locations(draft_search, draft_search_path)
        if locations is not None:
            from ..models.discovery import with_found_draft

            lm = with_found_draft(lm, locations, say)
        limit = max_text_chars(lm.tokenizer, lm.backend.info.max_length)
        check(len(text) <= limit, f"the prompt has {len(text)} characters, more than the "
              f"{lm.backend.info.max_length}-token context of {lm.name} can hold (at most {limit})")
        dec = SpecDecoder(lm, drafter, parse_options(drafter_option), num_draft_tokens, policy,
                          prefix_cache_mb=prefix_cache_mb)
        chunks = []
        for chunk in dec.stream(text, params, chat, predicted, schema_text, grammar_text):
            chunks.append(chunk)
            if stream and not as_json:
                emit(chunk.delta, end="")
    except TemplateError as e:  # the model file's chat template: the prompt can still be used as it is
        fail(f"{e} (--no-chat skips the template)")
    except (ValueError, ModelError) as e:
        fail(str(e))
    out_text = "".join(c.delta for c in chunks)
    ids = [t for c in chunks for t in c.token_ids]
    stats = chunks[-1].stats.as_dict() | {"peak_rss_mb": round(peak_rss_mb(), 1)}
    stats["drafter"] = describe_method(drafter, lm)
    if dec.drafter.drafted_by():  # a hybrid (auto): verified steps by who drafted them
        stats["drafted_by"] = dec.drafter.drafted_by()
    stats["drafter_memory_bytes"] = dec.drafter.memory_bytes()
    stats["backend"] = lm.backend.description
    stats["threads"] = n_threads
    exact = lm.backend.caps.exactness  # greedy output == plain decoding, bit for bit, on this machine?
    stats |= {"bit_exact": exact.bit_exact, "bit_exact_reason": exact.reason}
    no_reuse = prefix_cache_support(lm.backend)
    stats["prefix_cache"] = "off" if not prefix_cache_mb else "on" if no_reuse is None else f"off: {no_reuse}"
    if as_json:
        emit(json.dumps({"text": out_text, "token_ids": ids, "finish_reason": chunks[-1].finished,
                         "model": lm.name, "drafter": dec.drafter.name, "stats": stats}))
        return
    emit("" if stream else out_text)
    err.print(stats_table(stats))


DEMO_PROMPT = """Add type hints and a docstring to this function. Keep the code otherwise unchanged.

def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result
"""


def demo_model() -> str:
    """The demo's target: the real Qwen2.5-Coder 1.5B (with its 0.5B draft) once its parts are
    installed, else the built-in default SmolLM2-135M."""
    from ..models.catalog import DEFAULT_MODEL
    from ..models.resolve import is_installed

    qwen = "qwen2.5-coder-1.5b-instruct"
    return qwen if is_installed(qwen) and is_installed("qwen2.5-coder-0.5b-instruct") else DEFAULT_MODEL


def demo(
    prompt: Optional[str] = typer.Argument(None, help="prompt (default: a code edit, where speculation pays)"),
    model: str = typer.Option("auto", help="catalog name or path; auto: Qwen2.5-Coder 1.5B with its 0.5B draft when "
                              "their parts are installed (make install), else SmolLM2-135M"),
    drafter: str = typer.Option("auto", help="the speculative method to compare with plain decoding "
                                "(auto: the best measured for the model)"),
    num_draft_tokens: int = typer.Option(16, "--num-draft-tokens", "-k"),
    max_new_tokens: int = typer.Option(160, "--max-new-tokens", "-n"),
    threads: Optional[int] = typer.Option(None, "--threads", help=THREADS_HELP),
) -> None:
    """Plain and speculative greedy decoding side by side: speed-up, tau, identical output."""
    import time

    from ..api import SpecDecoder, load_model
    from ..models.base import ModelError
    from ..registry import describe_method
    from ..system import set_threads
    from ..types import SamplingParams

    text = prompt or DEMO_PROMPT
    try:
        params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
        n_threads = set_threads(threads)
        lm = load_model(demo_model() if model == "auto" else model)
        runs = {}
        for name, d in (("plain", "none"), (describe_method(drafter, lm), drafter)):
            dec = SpecDecoder(lm, d, num_draft_tokens=num_draft_tokens)
            dec.generate(text, SamplingParams(temperature=0.0, max_new_tokens=8))  # warm-up
            start = time.perf_counter()
            out = dec.generate(text, params)
            runs[name] = (out, time.perf_counter() - start)
    except (ValueError, ModelError) as e:
        fail(str(e))
    (plain, t_plain), (spec, t_spec) = runs.values()
    emit(spec.text)
    backend = lm.backend.description
    table = Table("decoding", "tokens", "seconds", "tokens/s", "tau", "speed-up", title=escape(f"{lm.name} on {backend}")
                  + ("" if "threads" in backend else f", {n_threads} thread{'s' * (n_threads != 1)}"))
    for name, (out, t) in runs.items():
        table.add_row(escape(name), str(len(out.token_ids)), f"{t:.2f}", f"{len(out.token_ids) / t:.1f}",
                      f"{out.stats.tau:.2f}", f"{t_plain / t:.2f}x")
    err.print(table)
    same = plain.token_ids == spec.token_ids
    err.print(f"outputs identical token for token: [{'green' if same else 'red'}]{same}[/]")
    if not same:
        raise typer.Exit(1)
