"""Hostile GGUF files (issue 32, classes 1-5): a model file is input. Each malformed file is
refused with one line (``ModelError`` in the library, exit 2 on the command line) or loads
and generates; never an abort, a traceback or an allocation the file does not need.

The checks that could abort (a double free in the compiled runtime) run in ONE subprocess
(this module run as a script: ``_drive``) under an address-space cap, fed jobs as JSON lines:
a crash or a runaway allocation ends that process, which the test sees, and one process
start serves every value of a test. The files are tiny qwen2 models (tests/gguf_fixtures.py)
with one metadata value or one header field changed.
"""

from __future__ import annotations

import json
import math
import os
import random
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from gguf_fixtures import ARRAY, BOOL, FLOAT32, FLOAT64, INT32, STRING, UINT32, UINT64, patch, tiny_qwen2, write_gguf

pytestmark = pytest.mark.extended  # a longer check: out of make test, run by .ci/run (make test-extended)

HEADROOM = 3 << 30  # address space the driver may add to what it has after its imports
TESTS = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- files and the driver


def mutated_gguf(path: Path, mutation: dict) -> Path:
    """The tiny model with ``mutation`` applied: ``meta`` {key: [type, value] or None (delete)},
    ``fields`` {header field label: value}, ``model`` keyword arguments of ``tiny_qwen2``."""
    meta, tensors = tiny_qwen2(**mutation.get("model", {}))
    for key, value in mutation.get("meta", {}).items():
        if value is None:
            meta.pop(key, None)
        else:
            meta[key] = (value[0], tuple(value[1]) if value[0] == ARRAY else value[1])
    fields = write_gguf(path, meta, tensors)
    for label, value in mutation.get("fields", {}).items():
        patch(path, fields[label], value)
    return path


def _run_job(job: dict, runner, app) -> dict:
    """One job: ``cli`` args through the command line (in-process), or a ``fuzz`` mutation
    loaded through ``load_model`` and generating up to three greedy tokens after a one-token
    prompt (a context may be as short as two tokens)."""
    if "cli" in job:
        r = runner.invoke(app, job["cli"])
        return {"exit": r.exit_code, "output": r.output}
    from verispec.api import SpecDecoder, load_model
    from verispec.models.base import ModelError
    from verispec.types import SamplingParams

    path = mutated_gguf(Path(job["path"]), job["fuzz"])
    try:
        model = load_model(str(path))
        out = SpecDecoder(model).generate("t", SamplingParams(max_new_tokens=3, temperature=0.0), chat=False)
        return {"outcome": "ok", "tokens": len(out.token_ids)}
    except ModelError as err:
        return {"outcome": "ModelError", "message": str(err)}
    except Exception as err:  # noqa: BLE001 - the test reports any other type as a failure
        return {"outcome": type(err).__name__, "message": str(err)[:300]}


def _drive() -> None:
    """The driver process: caps its address space, then runs the jobs read from stdin (one
    JSON object a line), printing one JSON result a line as each finishes."""
    import warnings

    from typer.testing import CliRunner

    from verispec.cli import app, one_line_warning

    warnings.formatwarning = one_line_warning  # as verispec.cli.main
    with open("/proc/self/statm") as f:
        vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (vm + HEADROOM, resource.RLIM_INFINITY))
    runner = CliRunner()
    for line in sys.stdin:
        job = json.loads(line)
        print(json.dumps({"label": job["label"], **_run_job(job, runner, app)}), flush=True)


def drive(jobs: list[dict], timeout: float = 120) -> list[dict]:
    """Run ``jobs`` in one driver process; assert it ended cleanly (no abort, nothing on its
    stderr such as glibc's 'double free') and answered every job."""
    feed = "".join(json.dumps(j) + "\n" for j in jobs)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, __file__], input=feed, capture_output=True, text=True, timeout=timeout,
                       env=env)
    results = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    last = jobs[len(results)]["label"] if len(results) < len(jobs) else None
    assert r.returncode == 0 and len(results) == len(jobs), (
        f"driver exited {r.returncode} during {last!r}: {r.stderr[-2000:]}")
    assert "double free" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    return results


def assert_one_line_exit_2(result: dict, *words: str) -> str:
    lines = [line for line in result["output"].strip().splitlines() if line.strip()]
    assert result["exit"] == 2 and len(lines) == 1, result
    assert "Traceback" not in result["output"] and "double free" not in result["output"], result
    for word in words:
        assert word in lines[0], (result["label"], lines[0])
    return lines[0]


def cli_checks(tmp_path: Path, cases: dict[str, dict], *extra: str) -> list[tuple[str, str]]:
    """For each named mutation: ``verispec generate --model <file>`` (and, with ``extra``,
    those arguments after it), all in one driver; -> (label, the one error line) each."""
    jobs = []
    for name, mutation in cases.items():
        path = mutated_gguf(tmp_path / f"{name}.gguf", mutation)
        jobs.append({"label": name, "cli": ["generate", "--model", str(path), "-n", "3", *extra, "the"]})
    return [(r["label"], assert_one_line_exit_2(r)) for r in drive(jobs)]


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))  # the driver inherits it


# ----------------------------------------------------------------------------- 1. double free


SHAPE_MISMATCHES = {
    "key_length": {"meta": {"qwen2.attention.key_length": [UINT32, 64]}},
    "vocab_size": {"meta": {"qwen2.vocab_size": [UINT32, 1_000_000]}},
    "norm_dim_zero": {"fields": {"tensor blk.0.attn_norm.weight dim 0": 0}},
    "norm_too_short": {"fields": {"tensor blk.1.ffn_norm.weight dim 0": 32}},
    "head_count_kv": {"meta": {"qwen2.attention.head_count_kv": [UINT32, 4]}},
}


def test_shape_mismatch_is_one_line_not_a_double_free(tmp_path: Path) -> None:
    """Tensors disagreeing with the metadata: `error:` then glibc's 'double free detected',
    exit 134 (the runtime's model was freed on the error, then again when collected)."""
    cli_checks(tmp_path, SHAPE_MISMATCHES)


def test_draft_and_serve_shape_mismatch_one_line(tmp_path: Path) -> None:
    """The same files as the draft model (``-o model=``) of a valid target, and at ``serve`` start-up."""
    good = mutated_gguf(tmp_path / "good.gguf", {})
    jobs = []
    for name in ("key_length", "vocab_size", "norm_dim_zero"):
        bad = str(mutated_gguf(tmp_path / f"{name}.gguf", SHAPE_MISMATCHES[name]))
        jobs += [{"label": f"draft {name}", "cli": ["generate", "--model", str(good), "--drafter", "draft", "-o",
                                                    f"model={bad}", "-n", "3", "the"]},
                 {"label": f"serve {name}", "cli": ["serve", "--model", bad, "--port", "1"]}]
    for result in drive(jobs):
        assert_one_line_exit_2(result)


# ----------------------------------------------------------------------------- 2. tensor dims


def refused(tmp_path: Path, mutation: dict, *words: str) -> str:
    """``load_model`` of the mutated file raises one ModelError line containing ``words``."""
    from verispec.api import load_model
    from verispec.models.base import ModelError

    with pytest.raises(ModelError) as err:
        load_model(str(mutated_gguf(tmp_path / "bad.gguf", mutation)))
    message = str(err.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, message
    return message


@pytest.mark.parametrize("label, value", [("tensor blk.0.attn_norm.weight dim 0", 0),
                                          ("tensor blk.0.attn_k.weight dim 1", 0),
                                          ("tensor output.weight dim 0", 0),
                                          ("tensor blk.1.ffn_down.weight dim 1", 1 << 62),
                                          ("tensor blk.0.attn_q.weight dim 0", 1 << 61),
                                          ("tensor token_embd.weight dim 1", (1 << 64) - 1),
                                          ("tensor blk.0.attn_norm.weight n_dims", 0),
                                          ("tensor blk.0.attn_v.bias n_dims", 5)])
def test_tensor_dims_zero_huge_or_too_many(tmp_path: Path, label: str, value: int) -> None:
    """A zero dim was a ZeroDivisionError; 2^62 an OverflowError or a product wrapping in int64
    past the end-of-file check: now each a one-line refusal naming the tensor."""
    refused(tmp_path, {"fields": {label: value}}, label.split()[1])


@pytest.mark.parametrize("mutation, words", [
    ({"meta": {"qwen2.attention.key_length": [UINT32, 64]}}, ("blk.0.attn_q.weight", "[64, 256]", "key_length")),
    ({"meta": {"qwen2.vocab_size": [UINT32, 1_000_000]}}, ("token_embd.weight", "1000000", "qwen2.vocab_size")),
    ({"meta": {"qwen2.feed_forward_length": [UINT32, 96]}}, ("blk.0.ffn_gate.weight", "feed_forward_length")),
    ({"meta": {"qwen2.embedding_length": [UINT32, 128]}}, ("token_embd.weight", "embedding_length")),
    ({"fields": {"tensor blk.1.ffn_norm.weight dim 0": 32}}, ("blk.1.ffn_norm.weight", "[32]", "[64]")),
    ({"fields": {"tensor blk.1.attn_k.bias dim 0": 16}}, ("blk.1.attn_k.bias", "head_count_kv")),
])
def test_tensor_shape_checked_against_the_config(tmp_path: Path, mutation: dict, words: tuple[str, ...]) -> None:
    """Shapes disagreeing with the metadata reached the compiled runtime (and a double free):
    now refused at read time, naming the tensor, both shapes and the metadata behind them."""
    refused(tmp_path, mutation, *words)


def test_misaligned_tensor_offset_refused(tmp_path: Path) -> None:
    for value in (4, 33):
        refused(tmp_path, {"fields": {"tensor blk.0.attn_q.weight offset": value}}, "blk.0.attn_q.weight", "alignment")


@pytest.mark.parametrize("key", ["qwen2.context_length", "qwen2.block_count", "qwen2.attention.head_count"])
@pytest.mark.parametrize("value", [[ARRAY, [UINT32, [1, 2]]], [ARRAY, [STRING, ["a", "b", "c", "d"]]], [BOOL, True],
                                   [FLOAT32, 2.0], [UINT64, 1 << 62], [INT32, -1]])
def test_sizes_must_be_integers(tmp_path: Path, key: str, value: list) -> None:
    """An array read as its length (2 layers from [1, 2]) or a bool, float, huge or negative value is no size."""
    refused(tmp_path, {"meta": {key: value}}, key.removeprefix("qwen2."), "expected an integer")


# ----------------------------------------------------------------------------- 3. head counts


@pytest.mark.parametrize("heads, kv_heads, key_length, words", [
    (7, 2, None, ("head_count = 7", "embedding_length = 64")),
    (3, 3, None, ("head_count = 3",)),
    (4, 3, None, ("head_count_kv = 3",)),
    (4, 8, None, ("head_count_kv = 8",)),
    (4, 2, 15, ("key_length = 15",)),
    (2, 2, None, ("blk.0.attn_k.weight", "[64, 32]", "[64, 64]", "head_count_kv")),
])
def test_inconsistent_head_counts_refused(tmp_path: Path, heads: int, kv_heads: int, key_length: int | None,
                                          words: tuple[str, ...]) -> None:
    """head_count 7 with hidden 256 loaded: the compiled runtime refused the shape, loading fell
    back to the PyTorch runtime, which raised on every forward (a server looked healthy)."""
    meta = {"qwen2.attention.head_count": [UINT32, heads], "qwen2.attention.head_count_kv": [UINT32, kv_heads]}
    if key_length is not None:
        meta["qwen2.attention.key_length"] = [UINT32, key_length]
    refused(tmp_path, {"meta": meta}, *words)


def test_unsupported_shape_falls_back_and_says_so(tmp_path: Path) -> None:
    """A valid model the compiled runtime cannot run (hidden 48 or FFN 80: not multiples of 32)
    goes to the PyTorch runtime with one warning saying so; a runnable one to the compiled runtime."""
    import torch

    from verispec.api import choose_backend
    from verispec.models.gguf_config import open_gguf

    for shape in ({"hidden": 48, "ffn": 96}, {"ffn": 80}):
        cfg = open_gguf(mutated_gguf(tmp_path / "narrow.gguf", {"model": shape}))[1]
        with pytest.warns(RuntimeWarning, match="compiled runtime does not run this model's shape"):
            assert choose_backend(cfg, torch.float32, "cpu", gguf=True) == "native"
    assert choose_backend(open_gguf(mutated_gguf(tmp_path / "ok.gguf", {}))[1], torch.float32, "cpu", gguf=True) == "cpu"


# ----------------------------------------------------------------------------- 4. NaN-making metadata


@pytest.mark.parametrize("key", ["qwen2.attention.layer_norm_rms_epsilon", "qwen2.rope.freq_base"])
@pytest.mark.parametrize("value", [[FLOAT32, math.nan], [FLOAT32, -1.0], [FLOAT32, 0.0], [FLOAT32, math.inf],
                                   [FLOAT64, 1e300], [FLOAT64, 1e-60], [STRING, "1e-6"], [BOOL, True],
                                   [ARRAY, [FLOAT32, [1.0]]]])
def test_nan_making_metadata_refused(tmp_path: Path, key: str, value: list) -> None:
    """rms_epsilon NaN or -1 and rope.freq_base 0 loaded, then sampling crashed or greedy gave
    token 0 forever: each must be finite and positive (as float32, the runtimes' precision)."""
    refused(tmp_path, {"meta": {key: value}}, key.removeprefix("qwen2."), "finite positive")


CLI_CASES = {  # classes 2-4 through the command line: name -> (mutation, a word of the error line)
    "dim_zero": ({"fields": {"tensor blk.0.attn_k.weight dim 1": 0}}, "blk.0.attn_k.weight"),
    "dim_2^62": ({"fields": {"tensor blk.1.ffn_up.weight dim 1": 1 << 62}}, "blk.1.ffn_up.weight"),
    "n_dims_0": ({"fields": {"tensor output_norm.weight n_dims": 0}}, "output_norm.weight"),
    "heads_7": ({"meta": {"qwen2.attention.head_count": [UINT32, 7]}}, "head_count = 7"),
    "kv_heads_3": ({"meta": {"qwen2.attention.head_count_kv": [UINT32, 3]}}, "head_count_kv = 3"),
    "eps_nan": ({"meta": {"qwen2.attention.layer_norm_rms_epsilon": [FLOAT32, math.nan]}}, "layer_norm_rms_epsilon"),
    "eps_-1": ({"meta": {"qwen2.attention.layer_norm_rms_epsilon": [FLOAT32, -1.0]}}, "layer_norm_rms_epsilon"),
    "theta_0": ({"meta": {"qwen2.rope.freq_base": [FLOAT32, 0.0]}}, "rope.freq_base"),
    "theta_inf": ({"meta": {"qwen2.rope.freq_base": [FLOAT32, math.inf]}}, "rope.freq_base"),
}


def test_malformed_files_through_the_cli_target_and_draft(tmp_path: Path) -> None:
    """Each file as ``--model`` and as the draft of a valid target (``-o model=``): one line
    naming what is wrong, exit 2, under ``generate`` and ``--backend native`` alike."""
    good = str(mutated_gguf(tmp_path / "good.gguf", {}))
    jobs = []
    for name, (mutation, _) in CLI_CASES.items():
        bad = str(mutated_gguf(tmp_path / f"{name}.gguf", mutation))
        jobs += [{"label": f"{name} target", "cli": ["generate", "--model", bad, "-n", "3", "the"]},
                 {"label": f"{name} native", "cli": ["generate", "--model", bad, "--backend", "native", "the"]},
                 {"label": f"{name} draft", "cli": ["generate", "--model", good, "--drafter", "draft",
                                                    "-o", f"model={bad}", "-n", "3", "the"]}]
    for result in drive(jobs):
        assert_one_line_exit_2(result, CLI_CASES[result["label"].split()[0]][1])


# ----------------------------------------------------------------------------- 5. huge contexts


def test_huge_context_runs_with_a_bounded_context(tmp_path: Path) -> None:
    """context_length 2^24 on a 4.7 MB model made generate build 2.5-20 GiB of RoPE tables and
    reserve 8 GiB of K/V: the context is cut to what the file can carry (said once) and K/V
    grows with the request, so generate runs under the driver's address-space cap."""
    contexts, jobs = (1 << 24, 1 << 22, 70_000), []
    for context in contexts:
        model = {"hidden": 256, "heads": 2, "kv_heads": 1, "ffn": 256, "context": context}
        path = mutated_gguf(tmp_path / f"long{context}.gguf", {"model": model})
        jobs.append({"label": str(context), "cli": ["generate", "--model", str(path), "-n", "3", "the"]})
    for context, result in zip(contexts, drive(jobs)):
        assert result["exit"] == 0, result
        assert f"declares a context of {context:,} tokens" in result["output"], result["output"]
        assert "running with a context of 65,536 tokens" in result["output"], result["output"]


def test_kv_cache_grows_with_the_request_and_stays_exact(tmp_path: Path) -> None:
    """A cache not sized by its caller (what generate and a draft get) starts small and grows as
    the request goes on; logits equal those of a cache held at full length from the start."""
    import torch

    from verispec.api import load_model

    backend = load_model(str(mutated_gguf(tmp_path / "ctx.gguf", {"model": {"context": 1 << 16}}))).backend
    assert backend.info.max_length == 1 << 16
    grown, held = backend.new_cache(), backend.new_cache(1 << 16)
    assert grown.pool.nbytes * 64 < held.pool.nbytes  # 256 of 65,536 slots
    ids = torch.randint(0, 262, (1, 700), generator=torch.Generator().manual_seed(0))
    for start, end in ((0, 200), (200, 300), (300, 301), (301, 700)):
        chunk, pos = ids[:, start:end], torch.arange(start, end)[None]
        a, b = backend.forward(chunk, pos, grown).logits, backend.forward(chunk, pos, held).logits
        assert torch.equal(a, b), (start, end)
    assert grown.pool.slots == 1024 and grown.length == held.length == 700


# ----------------------------------------------------------------------------- the fuzz


def _meta_values(vtype: int, value: object) -> list[list]:
    """Replacements for one metadata value: other types, 0, -1, huge, NaN, arrays of the wrong
    item type or count; [type, value] each (an array: [ARRAY, [item type, items]])."""
    if vtype == ARRAY:
        item_type, items = value
        other = [INT32, [0] * len(items)] if item_type == STRING else [STRING, [str(i) for i in items]]
        return [[ARRAY, [item_type, items[: len(items) // 2]]], [ARRAY, [item_type, items + items[:3]]],
                [ARRAY, [item_type, []]], [ARRAY, other], [ARRAY, [ARRAY, [[UINT32, [1]]]]],
                [UINT32, len(items)], [STRING, "x"]]
    common = [[STRING, "7"], [BOOL, True], [ARRAY, [UINT32, [1, 2]]], [UINT32, 0], [INT32, -1]]
    if vtype == STRING:
        return common + [[STRING, ""], [STRING, "é" * 3], [STRING, value * 2]]
    floats = [[FLOAT32, math.nan], [FLOAT32, math.inf], [FLOAT32, -1.0], [FLOAT32, 0.0], [FLOAT64, 1e300],
              [FLOAT32, 1e-45], [FLOAT32, 1e20]]  # finite and positive, but outside any plausible range
    if vtype in (FLOAT32, FLOAT64):
        return common + floats
    return common + floats[:3] + [[UINT64, 1 << 62], [UINT32, (1 << 32) - 1], [UINT32, 1 << 24],
                                  [UINT32, value * 2], [UINT32, value + 1], [FLOAT32, float(value)]]


def _field_values(fmt: str, value: int | float) -> list[int | float]:
    """Replacements for one fixed-size header field (an integer wraps to the field's width)."""
    if fmt in ("<f", "<d"):
        return [math.nan, math.inf, -1.0, 0.0, 1e30]
    if fmt == "<Q":
        return [0, 1, 1 << 62, 1 << 63, (1 << 64) - 1, value + 1, value - 1, value * 2, value + 4096]
    return [0, 1, 3, 13, 1 << 31, (1 << 32) - 1, value + 1, value - 1]


def fuzz_mutations(seed: int, count: int) -> list[dict]:
    """``count`` mutations of the tiny model, deterministic for ``seed``: first one of each
    metadata key and each header field (every key, every tensor's name length, n_dims, each
    dim, type and offset, string lengths, array item types and counts), then others at random."""
    import struct

    from gguf_fixtures import gguf_bytes

    rng = random.Random(seed)
    meta, tensors = tiny_qwen2()
    data, fields = gguf_bytes(meta, tensors)
    targets = [[{"meta": {key: v}} for v in _meta_values(*meta[key])] + [{"meta": {key: None}}] for key in meta]
    for label, f in fields.items():
        original = struct.unpack_from(f.fmt, data, f.offset)[0]
        targets.append([{"fields": {label: v}} for v in _field_values(f.fmt, original)])
    chosen = [rng.choice(options) for options in targets]
    rest = [m for options in targets for m in options if m not in chosen]
    return chosen + rng.sample(rest, max(0, count - len(chosen)))


def test_fuzz_mutated_ggufs_load_or_refuse_in_one_line(tmp_path: Path) -> None:
    """Several hundred single-field mutations of a valid GGUF, loaded through ``load_model``
    in one capped driver process: each loads and generates three greedy tokens, or raises one
    ModelError line; never another exception type, an abort, a hang or a runaway allocation."""
    mutations = fuzz_mutations(seed=32, count=400)
    assert len(mutations) == 400
    path = str(tmp_path / "mutant.gguf")
    jobs = [{"label": json.dumps(m), "fuzz": m, "path": path} for m in mutations]
    results = drive(jobs, timeout=240)
    bad = [r for r in results if r["outcome"] not in ("ok", "ModelError") or "\n" in r.get("message", "")]
    assert not bad, f"{len(bad)} of {len(results)} mutations: " + "; ".join(
        f"{r['label']} -> {r['outcome']}: {r.get('message')}" for r in bad[:8])
    outcomes = {r["outcome"] for r in results}
    assert outcomes == {"ok", "ModelError"}, outcomes  # both kinds are exercised


if __name__ == "__main__":
    _drive()
