"""WeightFormat: the one name of a weight format, and its borders (ggml type ids, a GGUF's
file type, the gguf package, a user's spelling)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from verispec.models import ggml_quants
from verispec.models.formats import PYTORCH_FORMATS, WeightFormat, formats_label

GGML = [f for f in WeightFormat if f.ggml_type is not None]
SRC = Path(__file__).resolve().parents[2] / "src" / "verispec"


@pytest.mark.parametrize("fmt", GGML)
def test_ggml_type_ids_are_the_gguf_packages(fmt):
    assert GGMLQuantizationType[fmt.label].value == fmt.ggml_type
    assert fmt.gguf_type is GGMLQuantizationType[fmt.label]
    assert WeightFormat.from_ggml_type(fmt.ggml_type) is fmt


def test_bits_per_weight_are_ggmls_block_sizes():
    for fmt in GGML:
        block, nbytes = GGML_QUANT_SIZES[fmt.gguf_type]
        assert fmt.bits == 8 * nbytes / block, fmt
    for fmt, sizes in ggml_quants.FORMATS.items():
        assert isinstance(fmt, WeightFormat) and GGML_QUANT_SIZES[fmt.gguf_type] == sizes


def test_unnamed_ggml_types_are_none():
    assert WeightFormat.from_ggml_type(GGMLQuantizationType.IQ2_XS.value) is None
    assert WeightFormat.from_ggml_type(999) is None


def test_file_types_name_their_main_format():
    """Each llama_ftype (the gguf package's MOSTLY_Q4_K_M, ...) maps to the format its name
    starts with; one verispec does not name (IQ*, TQ*, ...) to F32."""
    mapped = 0
    for ftype in LlamaFileType:
        name = ftype.name.removeprefix("MOSTLY_").removeprefix("ALL_")
        named = [f for f in GGML if name == f.label or name.startswith(f.label + "_")]
        assert WeightFormat.from_file_type(ftype.value) is (named[0] if named else WeightFormat.F32), ftype
        mapped += bool(named)
    assert mapped >= 18
    assert WeightFormat.from_file_type("not a number") is WeightFormat.F32  # a hostile file's metadata


def test_what_the_pytorch_runtime_runs_a_gguf_as():
    """4-bit files run as int4 groups, 5-8 bit ones as int8, float ones unquantized."""
    want = {LlamaFileType.ALL_F32: "none", LlamaFileType.MOSTLY_F16: "none", LlamaFileType.MOSTLY_BF16: "none",
            LlamaFileType.MOSTLY_Q4_0: "int4", LlamaFileType.MOSTLY_Q4_1: "int4", LlamaFileType.MOSTLY_Q2_K: "int4",
            LlamaFileType.MOSTLY_Q3_K_M: "int4", LlamaFileType.MOSTLY_Q4_K_S: "int4",
            LlamaFileType.MOSTLY_Q4_K_M: "int4", LlamaFileType.MOSTLY_Q5_0: "int8", LlamaFileType.MOSTLY_Q5_1: "int8",
            LlamaFileType.MOSTLY_Q5_K_M: "int8", LlamaFileType.MOSTLY_Q6_K: "int8", LlamaFileType.MOSTLY_Q8_0: "int8"}
    for ftype, fmt in want.items():
        assert WeightFormat.from_file_type(ftype.value).pytorch == fmt, ftype
    assert all(f.pytorch is f for f in PYTORCH_FORMATS)


def test_compiled_runtime_quantizes_the_pytorch_formats_to_ggmls_nearest():
    assert [f.compiled for f in PYTORCH_FORMATS] == [WeightFormat.F32, WeightFormat.Q8_0, WeightFormat.Q4_1]
    assert WeightFormat.Q4_K.compiled is WeightFormat.Q4_K


def test_parse_takes_any_case_and_names_the_choices():
    assert WeightFormat.parse(" Q4_K ", GGML) is WeightFormat.Q4_K
    assert WeightFormat.parse(WeightFormat.INT4, PYTORCH_FORMATS) is WeightFormat.INT4
    with pytest.raises(ValueError, match=r"unknown quant 'q4_k'; use none, int8, int4"):
        WeightFormat.parse("q4_k", PYTORCH_FORMATS)
    with pytest.raises(ValueError, match="unknown head_quant 'bogus'"):
        WeightFormat.parse("bogus", GGML, "head_quant")


def test_label_and_str():
    assert formats_label([WeightFormat.Q6_K, WeightFormat.Q4_K, WeightFormat.Q6_K]) == "q4_k+q6_k"
    assert f"{WeightFormat.Q8_0}" == "q8_0" and WeightFormat.Q8_0.label == "Q8_0"
    assert WeightFormat.INT4.label == "int4"
    with pytest.raises(ValueError, match="not a ggml format"):
        WeightFormat.INT8.gguf_type


def test_no_module_spells_a_format_by_its_string():
    """A format is named by WeightFormat everywhere in the package: no string literal equal to
    a format's name outside models/formats.py ("none", "f16" and "bf16" aside: options and
    activation dtypes use them too)."""
    names = {f.value for f in WeightFormat} - {"none", "f16", "bf16"}
    found = []
    for path in SRC.rglob("*.py"):
        if path.name == "formats.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.lower() in names:
                found.append(f"{path.relative_to(SRC)}:{node.lineno}: {node.value!r}")
    assert not found, "\n".join(found)
