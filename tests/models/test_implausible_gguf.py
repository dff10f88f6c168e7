"""Real-number GGUF metadata outside its plausible range (issue 45, class 6): a gemma3
``final_logit_softcapping`` of 1e-45 passed "finite and positive" and made every logit equal (token
0 forever). Each architecture's real-number keys (norm epsilon, RoPE base, linear RoPE factor,
logit softcap) are checked against ``gguf_config.PLAUSIBLE``: one ModelError line naming the key
(exit 2 on the command line), while values inside the range load; and a fuzz of every metadata
key of each new architecture's file loads or refuses in one line, never another exception."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from arch_fixtures import CASES, write_arch_gguf

from verispec.models.base import ModelError
from verispec.models.gguf_config import PLAUSIBLE, open_gguf

pytestmark = pytest.mark.extended  # a longer check: out of make test, run by .ci/run (make test-extended)

IMPLAUSIBLE = {  # key -> values outside its range (each finite and positive: they passed the old check)
    "final_logit_softcapping": [1e-45, 1e-6, 0.5, 1e5, 3e38],
    "attention.layer_norm_rms_epsilon": [1e-45, 1e-20, 0.5, 7.0, 1e30],
    "rope.freq_base": [1e-45, 1e-3, 1.0, 50.0, 1e12, 3e38],
    "rope.scaling.factor": [1e-45, 1e-4, 1e4, 1e30],
}
PLAUSIBLE_VALUES = {"final_logit_softcapping": [1.0, 30.0, 50.0], "attention.layer_norm_rms_epsilon": [1e-6, 1e-5],
                    "rope.freq_base": [1e4, 5e5, 1e7], "rope.scaling.factor": [2.0, 8.0, 32.0]}
ARCH_KEYS = {  # case -> its keys under test (rope.scaling.factor: with rope.scaling.type = linear)
    "gemma3": ["final_logit_softcapping", "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.scaling.factor"],
    "qwen3": ["attention.layer_norm_rms_epsilon", "rope.freq_base"],
    "llama3-rope": ["attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.scaling.factor"],
    "phi3": ["attention.layer_norm_rms_epsilon", "rope.freq_base"],
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("plausible")
    out = {}
    for kind in ARCH_KEYS:
        write_arch_gguf(root / f"{kind}.gguf", CASES[kind])
        out[kind] = root / f"{kind}.gguf"
    return out


def rewrite(src, out, edit):
    """The GGUF ``src`` written again at ``out`` with ``edit(meta)`` applied to its metadata
    (``meta``: key -> (GGUFValueType, value); a value None deletes the key)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    meta = {k: (f.types[0], f.contents()) for k, f in reader.fields.items()
            if not k.startswith("GGUF.") and k != "general.architecture"}
    edit(meta, arch)
    w = GGUFWriter(str(out), arch)
    for k, (vtype, value) in meta.items():
        if value is None:
            continue
        if vtype == GGUFValueType.ARRAY:
            w.add_array(k, value)
        else:
            w.add_key_value(k, value, vtype)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return out


def with_value(files, tmp_path, kind: str, name: str, value: float):
    from gguf import GGUFValueType

    def edit(meta, arch):
        meta[f"{arch}.{name}"] = (GGUFValueType.FLOAT32, value)
        if name == "rope.scaling.factor":
            meta[f"{arch}.rope.scaling.type"] = (GGUFValueType.STRING, "linear")

    return rewrite(files[kind], tmp_path / f"{kind}.gguf", edit)


@pytest.mark.parametrize("kind,name,value", [(k, n, v) for k, names in ARCH_KEYS.items() for n in names
                                              for v in IMPLAUSIBLE[n]])
def test_an_implausible_value_is_one_line(files, tmp_path, kind, name, value):
    with pytest.raises(ModelError) as e:
        open_gguf(with_value(files, tmp_path, kind, name, value))
    message = str(e.value)
    low, high = PLAUSIBLE[name]
    assert name in message and f"from {low:g} to {high:g}" in message and "\n" not in message


@pytest.mark.parametrize("kind,name,value", [(k, n, v) for k, names in ARCH_KEYS.items() for n in names
                                              for v in PLAUSIBLE_VALUES[n]])
def test_a_plausible_value_loads(files, tmp_path, kind, name, value):
    open_gguf(with_value(files, tmp_path, kind, name, value))


@pytest.mark.parametrize("value", [1e-45, 0.25])
def test_the_cli_refuses_a_flattening_softcap_in_one_line(files, tmp_path, value):
    path = with_value(files, tmp_path, "gemma3", "final_logit_softcapping", value)
    run = subprocess.run([sys.executable, "-m", "verispec.cli", "generate", "--model", str(path), "-n", "2", "hi"],
                         capture_output=True, text=True, timeout=300)
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert any("final_logit_softcapping" in line for line in lines), run.stderr


def _replacements(vtype, value) -> list:
    """Other values for one metadata value: other types, zero, negative, tiny, huge, NaN."""
    from gguf import GGUFValueType as T

    common = [(T.STRING, "7"), (T.BOOL, True), (T.UINT32, 0), (T.INT32, -1)]
    floats = [(T.FLOAT32, math.nan), (T.FLOAT32, math.inf), (T.FLOAT32, -1.0), (T.FLOAT32, 1e-45),
              (T.FLOAT32, 1e20), (T.FLOAT64, 1e300)]
    if vtype in (T.FLOAT32, T.FLOAT64):
        return common + floats
    if vtype in (T.UINT32, T.INT32, T.UINT64):
        return common + floats[:3] + [(T.UINT64, 1 << 62), (T.UINT32, (1 << 32) - 1), (T.UINT32, value * 2),
                                      (T.UINT32, value + 1)]
    return []


@pytest.mark.parametrize("kind", list(ARCH_KEYS))
def test_fuzz_of_each_architectures_keys(files, tmp_path, kind):
    """Every numeric ``<arch>.*`` key of the file (and the absent ones the architecture declares)
    replaced in turn: the config loads or is refused in one ModelError line."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(files[kind])
    arch = reader.fields["general.architecture"].contents()
    keys = {k: (f.types[0], f.contents()) for k, f in reader.fields.items() if k.startswith(f"{arch}.")}
    for extra in ("rope.scaling.factor", "final_logit_softcapping", "attention.sliding_window"):
        keys.setdefault(f"{arch}.{extra}", (GGUFValueType.FLOAT32, 1.0))
    outcomes = set()
    for key, (vtype, value) in keys.items():
        for new in [*_replacements(vtype, value), (vtype, None)]:
            def edit(meta, _, key=key, new=new):
                meta[key] = new
            path = rewrite(files[kind], tmp_path / "fuzz.gguf", edit)
            try:
                open_gguf(path)
                outcomes.add("ok")
            except ModelError as e:
                assert "\n" not in str(e), (key, new, str(e))
                outcomes.add("ModelError")
    assert outcomes == {"ok", "ModelError"}
