"""Builds the compiled CPU runtime (src/verispec/csrc) as verispec._vscpu; metadata is in pyproject.toml.

The extension is optional: without a C++ compiler the install still succeeds and verispec
runs its PyTorch runtime (and says so once). Kernels pick their ISA at run time
(`#pragma GCC target` per file, `__builtin_cpu_supports`), so no -march flag is used.
`-ffp-contract=off` keeps every a*b+c as two roundings unless the code asks for fmaf:
the bit-exactness of the runtime depends on it.
"""

from pathlib import Path

from setuptools import Extension, setup

CSRC = Path("src/verispec/csrc")

setup(ext_modules=[Extension(
    "verispec._vscpu",
    sources=[str(CSRC / f) for f in ("runtime.cpp", "threads.cpp", "kernels_scalar.cpp", "kernels_avx2.cpp",
                                      "kernels_avx512.cpp")] + sorted(str(p) for p in (CSRC / "formats").glob("*.cpp")),
    depends=[str(CSRC / f) for f in ("vs.h", "threads.h", "kernels_generic.inc", "formats/layout.h",
                                      "formats/simd_avx2.h", "formats/simd_avx512.h")],
    extra_compile_args=["-std=c++17", "-O3", "-ffp-contract=off", "-fno-math-errno"],
    language="c++",
    optional=True,
)])
