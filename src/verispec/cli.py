"""Command line: ``verispec generate | models`` (bench, serve and friends add commands)."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="verispec: lossless speculative decoding.")
err = Console(stderr=True)
PREFIX_CACHE_MB = 1024.0  # = engine.prefix_cache.DEFAULT_MAX_MB (not imported: `verispec --help` stays instant)
PREFIX_CACHE_HELP = ("MiB of K/V kept across requests so a prompt reuses its longest cached prefix "
                     "(multi-turn chats, shared system prompts); 0 = off; the cpu backend only (exact there)")
THREADS_HELP = "threads of the compiled runtime's pool and of torch (as llama.cpp's -t; default: one per core)"
QUANT_HELP = ("weights: auto (the checkpoint's own: a GGUF's blocks on cpu, int4 for a Q4 GGUF on native), "
              "none (float32), int8 or int4 (quantized at load: Q8_0 / Q4_1 on cpu, int8 / int4 on native; "
              "hf: auto or none)")


def fail(message: str) -> None:
    """One-line error and exit code 2 (bad input), never a traceback."""
    err.print(f"[red]error:[/red] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def parse_options(pairs: list[str]) -> dict[str, str]:
    opts = {}
    for pair in pairs:
        if "=" not in pair:
            fail(f"drafter option {pair!r} must look like key=value")
        key, value = pair.split("=", 1)
        opts[key.strip().replace("-", "_")] = value.strip()
    return opts


MAX_PROMPT_BYTES = 16 * 2**20  # read no more: far above any context here (the model's own bound comes later)


def read_prompt(prompt: Optional[str], file: Optional[Path]) -> str:
    """The prompt from --file, stdin or the argument; unreadable, non-UTF-8 or unbounded input
    (``- < /dev/zero``) fails with one line. At most ``MAX_PROMPT_BYTES`` are read."""
    from .paths import decode_utf8, is_text, read_text_file

    try:
        if file is not None:
            check(not file.is_file() or file.stat().st_size <= MAX_PROMPT_BYTES,
                  f"prompt file {file} is larger than {MAX_PROMPT_BYTES >> 20} MiB")
            return read_text_file(file, "prompt file")
        if prompt == "-" or (prompt is None and not sys.stdin.isatty()):
            stdin = getattr(sys.stdin, "buffer", None)
            data = stdin.read(MAX_PROMPT_BYTES + 1) if stdin is not None else sys.stdin.read(MAX_PROMPT_BYTES + 1)
            check(len(data) <= MAX_PROMPT_BYTES, f"stdin holds more than {MAX_PROMPT_BYTES >> 20} MiB of prompt")
            return decode_utf8(data, "stdin") if isinstance(data, bytes) else data
    except ValueError as e:
        fail(str(e))
    except OSError as e:
        fail(f"cannot read the prompt: {e.strerror or e}")
    if prompt is None:
        fail("give a prompt argument, --file, or text on stdin")
    check(is_text(prompt), "the prompt argument is not UTF-8 text")  # argv bytes like \xff arrive as surrogates
    return prompt


def check_text_args(values: list[str], flag: str) -> None:
    """Command-line strings used as text (stop strings, ...) must be UTF-8."""
    from .paths import is_text

    for v in values:
        check(is_text(v), f"{flag} {v.encode('utf-8', 'backslashreplace').decode()!r} is not UTF-8 text")


def check_model_arg(model: str) -> None:
    """A --model that names an existing path must be a regular file or a directory: a FIFO or
    a device named ``*.gguf`` would block (or never end) when read."""
    path = Path(model)
    try:
        exists = path.exists()
    except (OSError, ValueError):
        return  # not a usable path: the catalog lookup reports it
    if exists and not (path.is_file() or path.is_dir()):
        fail(f"--model {model} is not a regular file or a directory")


def emit(text: str, end: str = "\n") -> None:
    """Print to stdout now; a failing stdout (a full disk, /dev/full, a closed pipe) is one
    line and exit 2, not a traceback (then or at exit, when Python flushes it again)."""
    import os

    try:
        sys.stdout.write(text + end)
        sys.stdout.flush()
    except OSError as e:
        try:  # nothing more can reach stdout: point it at /dev/null so the exit flush is quiet
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        fail(f"cannot write the output: {e.strerror or e}")


def check(condition: bool, message: str) -> None:
    """Fail with ``message`` (one line, exit 2) unless ``condition``."""
    if not condition:
        fail(message)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def stats_table(stats: dict) -> Table:
    table = Table(title="speculation statistics", show_header=False)
    for key in ("new_tokens", "cached_tokens", "target_forwards", "steps", "drafted", "accepted", "tau", "alpha",
                "tokens_per_second", "prefill_s", "decode_s", "peak_rss_mb", "backend", "threads", "bit_exact",
                "bit_exact_reason", "prefix_cache"):
        table.add_row(key, str(stats.get(key)))
    ppa = stats.get("per_position_acceptance") or []
    table.add_row("per_position_acceptance", " ".join(f"{x:.2f}" for x in ppa[:12]))
    return table


@app.command()
def generate(
    prompt: Optional[str] = typer.Argument(None, help="prompt text; '-' or omitted reads stdin"),
    file: Optional[Path] = typer.Option(None, "--file", "-f", help="read the prompt from a file"),
    model: str = typer.Option("smollm2-135m-instruct", help="catalog name or path (see `verispec models`)"),
    drafter: str = typer.Option("auto", help="auto (default: the best lossless method measured for the model: "
                                "Qwen2.5-Coder 1.5B: hybrid of suffix and the 0.5B draft; others: suffix), "
                                "suffix, prompt-lookup, draft, hybrid, none, ... (`verispec drafters`)"),
    drafter_option: list[str] = typer.Option([], "--drafter-option", "-o", help="key=value, repeatable"),
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
) -> None:
    """Generate text with speculative decoding and print speculation statistics."""
    from .api import SpecDecoder, load_model
    from .engine.prefix_cache import prefix_cache_support
    from .models.base import ModelError
    from .system import set_threads
    from .types import SamplingParams

    from .registry import ALIASES, DRAFTERS, describe_method

    from .chat import max_text_chars
    from .chat_template import TemplateError

    if drafter not in DRAFTERS and drafter not in ALIASES:
        fail(f"unknown drafter {drafter!r}; choose one of: {', '.join(DRAFTERS)}")
    check_text_args(stop, "--stop")
    check_model_arg(model)
    text = read_prompt(prompt, file)
    try:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                max_new_tokens=max_new_tokens, seed=seed, stop=tuple(stop))
        n_threads = set_threads(threads)  # before loading: the compiled runtime sizes its pool at load
        lm = load_model(model, dtype=dtype, backend=backend, quant=quant)
        limit = max_text_chars(lm.tokenizer, lm.backend.info.max_length)
        check(len(text) <= limit, f"the prompt has {len(text)} characters, more than the "
              f"{lm.backend.info.max_length}-token context of {lm.name} can hold (at most {limit})")
        dec = SpecDecoder(lm, drafter, parse_options(drafter_option), num_draft_tokens, policy,
                          prefix_cache_mb=prefix_cache_mb)
        chunks = []
        for chunk in dec.stream(text, params, chat):
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
    from .models.catalog import DEFAULT_MODEL
    from .models.loading import is_installed

    qwen = "qwen2.5-coder-1.5b-instruct"
    return qwen if is_installed(qwen) and is_installed("qwen2.5-coder-0.5b-instruct") else DEFAULT_MODEL


@app.command()
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

    from .api import SpecDecoder, load_model
    from .models.base import ModelError
    from .registry import describe_method
    from .system import set_threads
    from .types import SamplingParams

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
    table = Table("decoding", "tokens", "seconds", "tokens/s", "tau", "speed-up", title=f"{lm.name} on {backend}"
                  + ("" if "threads" in backend else f", {n_threads} thread{'s' * (n_threads != 1)}"))
    for name, (out, t) in runs.items():
        table.add_row(name, str(len(out.token_ids)), f"{t:.2f}", f"{len(out.token_ids) / t:.1f}",
                      f"{out.stats.tau:.2f}", f"{t_plain / t:.2f}x")
    err.print(table)
    same = plain.token_ids == spec.token_ids
    err.print(f"outputs identical token for token: [{'green' if same else 'red'}]{same}[/]")
    if not same:
        raise typer.Exit(1)


@app.command()
def models() -> None:
    """List the built-in models."""
    from .models.loading import list_models

    table = Table("name", "description")
    for name, desc in list_models():
        table.add_row(name, desc)
    Console().print(table)


@app.command()
def drafters() -> None:
    """List the drafters and their options."""
    from .registry import ALIASES, DRAFTERS

    table = Table("name", "description")
    for name, (_, desc) in DRAFTERS.items():
        aliases = [a for a, n in ALIASES.items() if n == name]
        table.add_row(name + (f" ({', '.join(aliases)})" if aliases else ""), desc)
    Console().print(table)


@app.command()
def info(as_json: bool = typer.Option(False, "--json", help="print one JSON object")) -> None:
    """Version, compiled runtime (built? ISA), threads and the model cache of this installation."""
    from .system import info as system_info

    report = system_info()
    if as_json:
        emit(json.dumps(report))
        return
    rt, cache = report["compiled_runtime"], report["model_cache"]
    lines = [f"verispec {report['version']} (python {report['python']}, torch {report['torch']})",
             f"compiled runtime: {'built, ' + rt['path'] if rt['built'] else 'NOT BUILT'}"]
    if rt["built"]:
        forced = f", forced by VERISPEC_ISA={rt['isa_forced']}" if rt["isa_forced"] else ""
        lines.append(f"ISA: {rt['isa'] or 'none'}{forced} (available here: {', '.join(rt['isas_available'])})")
    if rt["error"]:
        lines.append(f"  {rt['error']}")
    lines += [f"threads: {report['threads']} (of {report['cpus']} CPUs; --threads sets it)",
              f"model cache: {cache['path']} ({cache['bytes'] / 2**20:.1f} MiB; VERISPEC_CACHE moves it)"]
    emit("\n".join(lines))


@app.command()
def train(
    kind: str = typer.Argument(..., help="data (on-policy corpus), eagle, eagle3, medusa or draft"),
    data: Optional[list[Path]] = typer.Option(None, "--data", help="generations .jsonl, feature directory or "
                                              "`train data` corpus, repeatable; none: generate the default data "
                                              "in OUT/data (hours)"),
    out: Path = typer.Option(..., "--out", help="run directory (checkpoint.pt, weights/)"),
    steps: int = typer.Option(600, "--steps"),
    model: str = typer.Option("smollm2-135m-instruct", help="the target"),
    lr: float = typer.Option(1e-3),
    warmup: Optional[int] = typer.Option(None, help="warm-up steps (default: min(40, steps/10))"),
    layers: Optional[str] = typer.Option(None, help="draft only: target layers to start from, e.g. 0,1,2,3"),
    init: Optional[Path] = typer.Option(None, help="draft: continue from these draft weights; eagle3: from these EAGLE-3 (or EAGLE) weights"),
    seed: int = typer.Option(0),
    resume: bool = typer.Option(False, "--resume", help="continue from out/checkpoint.pt"),
    max_minutes: Optional[float] = typer.Option(None, "--max-minutes", help="stop (checkpointed, resumable) after this long"),
    tokens: int = typer.Option(3_000_000, "--tokens", help="data: answer tokens to reach in OUT (resumable)"),
    batch: int = typer.Option(16, "--batch", help="data: conversations decoded together"),
    threads: int = typer.Option(1, "--threads", help="data: compiled-runtime threads"),
    magpie: int = typer.Option(40_000, "--magpie", help="data: self-written (Magpie) user turns to try"),
    corpus_tokens: Optional[int] = typer.Option(None, "--corpus-tokens", help="eagle, medusa, draft: use the first "
                                                "N tokens of a corpus only (features are extracted for them)"),
    gsm8k: Optional[Path] = typer.Option(None, "--gsm8k", envvar="VERISPEC_GSM8K", help="GSM8K train.jsonl, the "
                                         "questions generated data starts from (data, or no --data; not shipped)"),
) -> None:
    """Train a drafter on the target's own generations, or (``data``) generate them (see verispec.train)."""
    from .models.base import ModelError
    from .paths import check_output_dir
    from .train import run_train

    check(steps >= 1, f"--steps must be >= 1, got {steps}")
    check(lr > 0 and lr == lr and lr != float("inf"), f"--lr must be a positive number, got {lr}")
    check(max_minutes is None or max_minutes > 0, f"--max-minutes must be > 0, got {max_minutes}")
    check(tokens >= 1 and batch >= 1 and threads >= 1 and magpie >= 0,
          "--tokens, --batch and --threads must be >= 1 and --magpie >= 0")
    check(corpus_tokens is None or corpus_tokens >= 1, f"--corpus-tokens must be >= 1, got {corpus_tokens}")
    check(0 <= seed <= 2**63 - 1, f"--seed must be in [0, 2^63 - 1], got {seed}")
    check_model_arg(model)
    try:
        check_output_dir(out, "--out")
        for path in data or []:
            check(path.exists(), f"--data {path} does not exist")
        if kind == "data":
            from .train.corpus import main_corpus

            emit(json.dumps(main_corpus(out, model, tokens=tokens, batch=batch, threads=threads, n_magpie=magpie,
                                        seed=seed, max_minutes=max_minutes, gsm8k=gsm8k)))
            return
        init_layers = None
        if layers:
            try:
                init_layers = tuple(int(x) for x in layers.split(","))
            except ValueError:
                raise ValueError(f"--layers must be comma-separated layer indices, got {layers!r}") from None
        result = run_train(kind, model, list(data or []), out, steps, resume=resume, seed=seed, lr=lr,
                           warmup=warmup, layers=init_layers, init=init, max_minutes=max_minutes,
                           corpus_tokens=corpus_tokens, gsm8k=gsm8k)
    except (ValueError, ModelError) as e:
        fail(str(e))
    emit(json.dumps(result))


datastore_app = typer.Typer(add_completion=False, no_args_is_help=True,
                            help="REST datastores: corpora tokenized and indexed by a suffix array.")
app.add_typer(datastore_app, name="datastore")


@datastore_app.command("build")
def datastore_build(
    input: Path = typer.Option(..., "--input", "-i", help="corpus .txt (paragraphs) or .jsonl"),
    output: Path = typer.Option(..., "--output", "-o", help="datastore file (.npz)"),
    model: str = typer.Option("smollm2-135m-instruct", help="the target whose tokenizer to use"),
    field: Optional[str] = typer.Option(None, help="jsonl field to read (default: text, else all strings)"),
    max_tokens: int = typer.Option(10_000_000, help="size bound: tokens kept (8 bytes each)"),
    depth: int = typer.Option(64, help="suffix sort depth = longest exact lookup"),
) -> None:
    """Tokenize a corpus with the target's tokenizer and index it for `--drafter rest`."""
    from .drafters.retrieval import build_datastore, read_documents, tokenizer_fingerprint
    from .models.base import ModelError
    from .models.loading import load_tokenizer, resolve_model
    from .paths import check_output_file

    check(max_tokens >= 1 and depth >= 1, "--max-tokens and --depth must be >= 1")
    check_model_arg(model)
    output = output if output.suffix == ".npz" else output.with_name(output.name + ".npz")  # numpy adds it
    try:
        check_output_file(output, "--output")
        check(input.is_file(), f"--input {input} does not exist or is not a file")
        tok = load_tokenizer(resolve_model(model))
        docs = (tok(text, add_special_tokens=False)["input_ids"] for text in read_documents(input, field))
        ds = build_datastore(docs, max_tokens=max_tokens, depth=depth, fingerprint=tokenizer_fingerprint(tok))
    except (ValueError, ModelError) as e:
        fail(str(e))
    if ds.suffix_array.size == 0:
        fail(f"corpus {input} has no text")
    try:
        ds.save(output)
    except OSError as e:
        fail(f"cannot write {output}: {e.strerror or e}")
    emit(json.dumps({"output": str(output), "tokens": int(ds.suffix_array.size), "bytes": ds.nbytes}))


# `verispec bench`: options and logic live in verispec.bench.command (typer/rich imports only).
from .bench.command import bench as _bench  # noqa: E402

app.command("bench")(_bench)


@app.command()
def serve(
    model: str = typer.Option("smollm2-135m-instruct", help="catalog name or path (see `verispec models`)"),
    host: str = typer.Option("127.0.0.1", help="bind address"),
    port: int = typer.Option(8000, help="bind port"),
    drafter: list[str] = typer.Option(["auto", "none"], "--drafter", help="drafters requests may pick (repeatable; the first is the default; auto: the hybrid of suffix and the draft model for a target with one, else prompt lookup)"),
    drafter_option: list[str] = typer.Option([], "--drafter-option", "-o", help="key=value for the default drafter, repeatable"),
    num_draft_tokens: int = typer.Option(4, "-k", "--num-draft-tokens", help="draft budget per step (prompt lookup: 4 beats 8 on Spec-Bench, docs/cpu.md)"),
    policy: str = typer.Option("fixed", help="draft length policy: fixed or heuristic"),
    max_batch: int = typer.Option(16, help="most requests decoding together (cache-pool rows)"),
    max_queue: int = typer.Option(64, help="most requests waiting; more get HTTP 429"),
    max_model_len: int = typer.Option(0, help="context per request (prompt + new tokens); 0 = what fits: up to the model's context (Qwen2.5: 32768) while --max-batch requests' K/V take at most 60% of available memory"),
    default_max_tokens: int = typer.Option(256, help="chat max_tokens when the request gives none"),
    spec_schedule: str = typer.Option("goodput", help="draft cap per batched step: goodput (acceptance- and cost-aware) or budget"),
    fixed_cost_rows: float = typer.Option(6.0, help="goodput cost model: a forward's fixed cost, in token rows (t(n) ~ a + b n: a / b; the compiled runtime measures 2-8: 6 for 2 threads and contexts up to 512, 2-4 for 1 thread or long contexts; engine/batch.py SpecSchedule)"),
    token_budget: int = typer.Option(32, help="budget schedule: tokens per batched verify forward (0 = no cap)"),
    disable_spec_at: int = typer.Option(0, help="batch size from which speculation is off (0 = never)"),
    served_model_name: Optional[str] = typer.Option(None, help="model id clients send (default: --model)"),
    prefix_cache_mb: float = typer.Option(PREFIX_CACHE_MB, help=PREFIX_CACHE_HELP),
    dtype: str = typer.Option("float32", help="float32 or bfloat16"),
    backend: str = typer.Option("auto", help="auto, cpu, native or hf (cpu and native batch verification)"),
    quant: str = typer.Option("auto", help=QUANT_HELP),
    threads: int = typer.Option(0, help=THREADS_HELP.replace("default: ", "0 = ")),
    graceful_timeout: float = typer.Option(30.0, help="seconds in-flight requests get on shutdown; then they end with 503"),
    api_key: Optional[str] = typer.Option(None, envvar="VERISPEC_API_KEY", show_envvar=True,
                                          help="require 'Authorization: Bearer <key>' on /v1/* (401 otherwise)"),
    max_body_bytes: Optional[int] = typer.Option(None, help="largest request body in bytes (default 2 MiB); larger get HTTP 413"),
    header_timeout: float = typer.Option(10.0, help="seconds a connection may take to send its request headers"),
    body_timeout: float = typer.Option(30.0, help="seconds a request body may take to arrive (HTTP 408 after)"),
    chat_template_timeout: float = typer.Option(2.0, help="seconds the model's chat template may take to render one chat (HTTP 400 after; the render runs in a separate process)"),
    ray: bool = typer.Option(False, "--ray", help="serve engine replicas on Ray Serve: a local Ray instance, or the cluster RAY_ADDRESS names (docs/ray.md)"),
    replicas: int = typer.Option(1, help="--ray: engine replicas, each with --threads Ray CPUs (default 1) and as many threads"),
) -> None:
    """Run an OpenAI-compatible server with batched speculative decoding (see verispec.server)."""
    from .models.base import ModelError
    from .server.app import ServerConfig, serve as run_server
    from .server.guard import Limits

    check(0 <= port <= 65535, f"--port must be in [0, 65535], got {port}")
    check(threads >= 0, f"--threads must be >= 0 (0 = torch default), got {threads}")
    check(graceful_timeout >= 0, f"--graceful-timeout must be >= 0 seconds, got {graceful_timeout}")
    check(max_batch >= 1 and max_queue >= 1 and (max_model_len == 0 or max_model_len >= 2) and num_draft_tokens >= 1,
          "--max-batch, --max-queue and --num-draft-tokens must be >= 1, --max-model-len 0 (what fits) or >= 2")
    check_model_arg(model)
    if threads:
        from .system import set_threads

        set_threads(threads)  # before loading: the compiled runtime sizes its pool at load
    try:
        limits = Limits(header_timeout_s=header_timeout, body_timeout_s=body_timeout, api_key=api_key,
                        **({} if max_body_bytes is None else {"max_body_bytes": max_body_bytes}))
        config = ServerConfig(model=model, backend=backend, dtype=dtype, quant=quant, drafters=tuple(drafter),
                              drafter_options=tuple(parse_options(drafter_option).items()),
                              num_draft_tokens=num_draft_tokens, policy=policy, max_batch=max_batch,
                              max_queue=max_queue, max_model_len=max_model_len,
                              default_max_tokens=default_max_tokens, spec_schedule=spec_schedule,
                              fixed_cost_rows=fixed_cost_rows, token_budget=token_budget,
                              disable_spec_at=disable_spec_at, served_model_name=served_model_name,
                              prefix_cache_mb=prefix_cache_mb, chat_template_timeout_s=chat_template_timeout,
                              limits=limits)
        if ray:
            _serve_ray(config, replicas, threads or 1, host, port)
        else:
            run_server(config, host=host, port=port, graceful_timeout=graceful_timeout)
    except (ValueError, ModelError) as e:
        fail(str(e))


def _serve_ray(config, replicas: int, cpus: int, host: str, port: int) -> None:
    try:
        from .server.ray_serve import RayConfig, serve_ray
    except ImportError as e:
        fail(f"--ray needs Ray Serve ({e}): pip install 'verispec[ray]'")
    serve_ray(RayConfig(config, replicas=replicas, num_cpus=cpus), host=host, port=port)


def one_line_warning(message, category, filename, lineno, line=None) -> str:
    """Warnings on the command line are for users: the message, not our source file and line."""
    return f"warning: {message}\n"


def main() -> None:
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # weight-loading bars of tiny cached models are noise here
    warnings.formatwarning = one_line_warning
    app()


if __name__ == "__main__":
    main()
