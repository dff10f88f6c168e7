"""One name for a weight format: ``WeightFormat``.

Every format verispec reads, writes or computes with is one member here, and every other
vocabulary is mapped to it once, at its border:

* a GGUF tensor's ggml type id (``gguf_file.GGUFTensor.format``): ``WeightFormat.from_ggml_type``;
* a GGUF's ``general.file_type`` (llama.cpp's ``enum llama_ftype``, a mix such as Q4_K_M
  named by its main format): ``WeightFormat.from_file_type``;
* the compiled runtime's format table (``csrc/formats/table.cpp``, keyed by ggml type id):
  ``models.cpu_abi`` passes ``fmt.ggml_type`` and reads its table into ``WeightFormat`` keys;
* the gguf package (``GGMLQuantizationType``): ``fmt.gguf_type``;
* a user's option (``--quant``, ``-o quant=``, ``-o head_quant=``): ``WeightFormat.parse``.

The PyTorch runtime's own weight-only formats (``models/quant.py``) are members too: ``none``
(unquantized, the model's dtype), ``int8`` (per output channel) and ``int4`` (groups of 32).

It is a ``StrEnum``: a member is its lower-case name (``WeightFormat.Q4_K == "q4_k"``), which
is how options, statistics and file names spell it.

>>> WeightFormat.from_ggml_type(12), WeightFormat.from_file_type(15).pytorch
(<WeightFormat.Q4_K: 'q4_k'>, <WeightFormat.INT4: 'int4'>)
>>> WeightFormat.parse("Q8_0", (WeightFormat.Q8_0, WeightFormat.F32), "head_quant")
<WeightFormat.Q8_0: 'q8_0'>
>>> WeightFormat.INT4.compiled, WeightFormat.NONE.compiled
(<WeightFormat.Q4_1: 'q4_1'>, <WeightFormat.F32: 'f32'>)
"""

from __future__ import annotations

import enum
from collections.abc import Iterable


class WeightFormat(enum.StrEnum):
    # the PyTorch runtime's (models/native.py, models/quant.py); also what --quant names
    NONE = "none"  # unquantized: the model's dtype (float32 or bfloat16)
    INT8 = "int8"  # int8 per output channel
    INT4 = "int4"  # int4 in groups of 32 (the LM head in int8)
    # ggml's (GGUF files, the compiled runtime, models/ggml_quants.py)
    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"
    Q4_0 = "q4_0"
    Q4_1 = "q4_1"
    Q5_0 = "q5_0"
    Q5_1 = "q5_1"
    Q8_0 = "q8_0"
    Q2_K = "q2_k"
    Q3_K = "q3_k"
    Q4_K = "q4_k"
    Q5_K = "q5_k"
    Q6_K = "q6_k"
    IQ4_NL = "iq4_nl"
    IQ4_XS = "iq4_xs"

    @property
    def ggml_type(self) -> int | None:
        """ggml's type id (``enum ggml_type``, what a GGUF tensor and the C table carry); None
        for the PyTorch runtime's own formats."""
        return _GGML_TYPE.get(self)

    @property
    def gguf_type(self):
        """The gguf package's ``GGMLQuantizationType`` of this format (ggml formats only)."""
        from gguf import GGMLQuantizationType

        if self.ggml_type is None:
            raise ValueError(f"{self} is not a ggml format")
        return GGMLQuantizationType(self.ggml_type)

    @property
    def label(self) -> str:
        """How ggml and llama.cpp print it: Q4_K, F32; the PyTorch formats as they are."""
        return self.value.upper() if self.ggml_type is not None else self.value

    @property
    def bits(self) -> float:
        """Bits per weight, block scales included (ggml's block sizes; the PyTorch formats'
        nominal: none 32, int8 8, int4 4.5)."""
        return _BITS[self]

    @property
    def pytorch(self) -> WeightFormat:
        """What the PyTorch runtime runs weights of this format as, keeping their precision:
        float formats unquantized, at most 4.5 bits per weight int4, the rest int8. (Running a
        Q4 file in fp32 would stream 8x the bytes per token for no gain.)"""
        if self in PYTORCH_FORMATS:
            return self
        if self in (WeightFormat.F32, WeightFormat.F16, WeightFormat.BF16):
            return WeightFormat.NONE
        return WeightFormat.INT4 if self.bits <= 5.0 else WeightFormat.INT8

    @property
    def compiled(self) -> WeightFormat:
        """What the compiled runtime quantizes an HF checkpoint to for this format: the PyTorch
        runtime's formats map to ggml's nearest (none: F32, int8: Q8_0, int4: Q4_1)."""
        return _COMPILED.get(self, self)

    @classmethod
    def from_ggml_type(cls, type_id: int) -> WeightFormat | None:
        """The format of ggml type ``type_id``; None for a type verispec does not name (the
        gguf package may still read it, e.g. the IQ formats)."""
        return _BY_GGML_TYPE.get(int(type_id))

    @classmethod
    def from_file_type(cls, file_type: int) -> WeightFormat:
        """The main format of a GGUF by its ``general.file_type`` (llama_ftype): Q4_K for
        Q4_K_M, F32 for an unknown or missing one."""
        try:
            return _FILE_TYPE.get(int(file_type), WeightFormat.F32)
        except (TypeError, ValueError):  # a hostile file's string or array
            return WeightFormat.F32

    @classmethod
    def parse(cls, text: str, allowed: Iterable[WeightFormat], what: str = "quant") -> WeightFormat:
        """A user's spelling (any case) of one of ``allowed``, or ValueError naming them."""
        allowed = tuple(allowed)
        try:
            fmt = cls(str(text).strip().lower())
        except ValueError:
            fmt = None
        if fmt not in allowed:
            raise ValueError(f"unknown {what} {text!r}; use {', '.join(allowed)}")
        return fmt


W = WeightFormat
_GGML_TYPE = {W.F32: 0, W.F16: 1, W.Q4_0: 2, W.Q4_1: 3, W.Q5_0: 6, W.Q5_1: 7, W.Q8_0: 8, W.Q2_K: 10, W.Q3_K: 11,
              W.Q4_K: 12, W.Q5_K: 13, W.Q6_K: 14, W.IQ4_NL: 20, W.IQ4_XS: 23, W.BF16: 30}
_BY_GGML_TYPE = {t: f for f, t in _GGML_TYPE.items()}
_BITS = {W.NONE: 32.0, W.INT8: 8.0, W.INT4: 4.5, W.F32: 32.0, W.F16: 16.0, W.BF16: 16.0, W.Q4_0: 4.5, W.Q4_1: 5.0,
         W.Q5_0: 5.5, W.Q5_1: 6.0, W.Q8_0: 8.5, W.Q2_K: 2.625, W.Q3_K: 3.4375, W.Q4_K: 4.5, W.Q5_K: 5.5,
         W.Q6_K: 6.5625, W.IQ4_NL: 4.5, W.IQ4_XS: 4.25}
_COMPILED = {W.NONE: W.F32, W.INT8: W.Q8_0, W.INT4: W.Q4_1}
# llama.cpp's enum llama_ftype -> the file's main format (Q3_K_S/M/L -> Q3_K, Q4_K_S/M -> Q4_K, ...)
_FILE_TYPE = {0: W.F32, 1: W.F16, 2: W.Q4_0, 3: W.Q4_1, 7: W.Q8_0, 8: W.Q5_0, 9: W.Q5_1, 10: W.Q2_K, 11: W.Q3_K,
              12: W.Q3_K, 13: W.Q3_K, 14: W.Q4_K, 15: W.Q4_K, 16: W.Q5_K, 17: W.Q5_K, 18: W.Q6_K, 21: W.Q2_K,
              25: W.IQ4_NL, 30: W.IQ4_XS, 32: W.BF16}
del W

# the PyTorch runtime's formats (models/native.py): what --quant names besides auto
PYTORCH_FORMATS = (WeightFormat.NONE, WeightFormat.INT8, WeightFormat.INT4)


def formats_label(formats: Iterable[WeightFormat]) -> str:
    """A model's formats as statistics name them: sorted, joined by ``+`` (``q4_k+q6_k``)."""
    return "+".join(sorted(set(formats)))
