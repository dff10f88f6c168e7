"""What a pip user meets first: the public API, cheap imports, the generate path's dependencies."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

from gguf_fixtures import tiny_qwen2, write_gguf


def run_python(code: str) -> str:
    """``code`` in a fresh interpreter (sys.modules starts empty); its stdout."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_public_api_and_version():
    import verispec
    from verispec import SamplingParams, SpecDecoder, load_model
    from verispec.api import SpecDecoder as Dec, load_model as load
    from verispec.types import SamplingParams as Params

    assert (load_model, SpecDecoder, SamplingParams) == (load, Dec, Params)
    assert verispec.__version__ == metadata.version("verispec")
    assert set(verispec.__all__) <= set(dir(verispec))


def test_import_verispec_is_cheap():
    """``import verispec`` loads no torch; the API's names load it on first use."""
    out = run_python("import sys, verispec; a = 'torch' in sys.modules; verispec.SpecDecoder; "
                     "print(a, 'torch' in sys.modules)")
    assert out == "False True"


def test_generate_path_imports_no_bench_or_server_dependencies(tmp_path):
    """matplotlib (plots) and fastapi/uvicorn (serve) are imported by their commands only. The model is
    a tiny GGUF on the default runtime (the compiled one): stories260K would run on the PyTorch runtime,
    whose calibration cost the fresh interpreter 18 s of CPU and its 120 s timeout under load."""
    model = tmp_path / "tiny.gguf"
    write_gguf(model, *tiny_qwen2())
    out = run_python(
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from verispec.cli import app\n"
        f"r = CliRunner().invoke(app, ['generate', '--model', {str(model)!r}, '-n', '4', '--json', 'hi'])\n"
        "assert r.exit_code == 0, r.output\n"
        "print(sorted(m for m in ('matplotlib', 'fastapi', 'uvicorn', 'starlette') if m in sys.modules))")
    assert out == "[]"


def test_shipped_data_is_used_not_a_checkout(tmp_path, monkeypatch):
    """stories260k and the Spec-Bench questions come from the package, whatever the cwd holds."""
    import verispec
    from verispec.bench.datasets import load_spec_bench
    from verispec.models.resolve import resolve_model

    (tmp_path / "shared" / "models" / "stories260K").mkdir(parents=True)  # a decoy beside the cwd
    monkeypatch.chdir(tmp_path)
    package = __import__("pathlib").Path(verispec.__file__).parent
    source = resolve_model("stories260k")
    assert source.path.is_relative_to(package) and source.tokenizer_path.is_relative_to(package)
    assert len(load_spec_bench(categories=("rag",), limit_per_category=2)) == 2


def test_generated_training_data_needs_gsm8k_named(tmp_path):
    from typer.testing import CliRunner

    from verispec.cli import app

    r = CliRunner().invoke(app, ["train", "data", "--out", str(tmp_path / "corpus")], env={"VERISPEC_GSM8K": ""})
    assert r.exit_code == 2 and "--gsm8k" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(app, ["train", "draft", "--out", str(tmp_path / "run"), "--gsm8k", str(tmp_path / "no")])
    assert r.exit_code == 2 and "is not a file" in r.output


def test_info_reports_the_build():
    import json

    from typer.testing import CliRunner

    from verispec.cli import app
    from verispec.models import cpu_abi

    r = CliRunner().invoke(app, ["info", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    rt = report["compiled_runtime"]
    assert report["version"] == metadata.version("verispec") and report["threads"] >= 1
    assert rt["built"] == cpu_abi.available() and report["model_cache"]["path"]
    if rt["built"]:
        assert rt["isa"] in rt["isas_available"] and "scalar" in rt["isas_available"]
    r = CliRunner().invoke(app, ["info"])
    assert r.exit_code == 0 and "compiled runtime" in r.output and "model cache" in r.output


def test_threads_sets_the_runtime_pool_and_is_reported():
    from typer.testing import CliRunner

    from verispec.cli import app

    out = run_python(
        "import json, torch\n"
        "from typer.testing import CliRunner\n"
        "from verispec.cli import app\n"
        "r = CliRunner().invoke(app, ['generate', '--model', 'stories260k', '-n', '4', '--threads', '1', '--json', ''])\n"
        "assert r.exit_code == 0, r.output\n"
        "print(json.loads(r.stdout)['stats']['threads'], torch.get_num_threads())")
    assert out == "1 1"
    r = CliRunner().invoke(app, ["generate", "--model", "stories260k", "--threads", "0", ""])
    assert r.exit_code == 2 and "--threads must be >= 1" in r.output


def test_missing_compiled_runtime_is_one_line_with_slowdown_and_fix():
    """Said once, on one stderr line naming the cost and the fix; the command line's
    warnings show no source line either."""
    code = ("import sys, warnings\n"
            "from verispec.models import cpu_abi\n"
            "def missing():\n"
            "    raise OSError('the compiled runtime verispec._vscpu was not built')\n"
            "cpu_abi._load_library = missing\n"
            "assert not cpu_abi.available() and not cpu_abi.available()\n"
            "from verispec.cli import one_line_warning\n"
            "warnings.formatwarning = one_line_warning\n"
            "warnings.warn('dequantizing', RuntimeWarning)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 2 and lines[1] == "warning: dequantizing", done.stderr
    assert "was not built" in lines[0] and "30-100x" in lines[0]
    assert "pip install --force-reinstall --no-deps verispec" in lines[0]
