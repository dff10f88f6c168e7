"""Builds the compiled CPU runtime (src/verispec/csrc) as verispec._vscpu; metadata is in pyproject.toml.

The extension is optional: without a C++ compiler the install still succeeds and verispec
runs its PyTorch runtime, 30-100x slower (it says so once at run time; `verispec info` says
whether the runtime was built). Kernels pick their ISA at run time
(`#pragma GCC target` per file, `__builtin_cpu_supports`), so no -march flag is used.
`-ffp-contract=off` keeps every a*b+c as two roundings unless the code asks for fmaf:
the bit-exactness of the runtime depends on it.
"""

import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CSRC = Path("src/verispec/csrc")

BUILD_FAILED = """
********************************************************************************
verispec: the compiled CPU runtime (verispec._vscpu) could not be built:
  {error}
verispec installs anyway and runs its PyTorch runtime instead, 30-100x slower on CPU.
Fix: install gcc and g++ (e.g. `apt install g++`), then
  pip install --force-reinstall --no-deps verispec      (in a checkout: pip install -e .)
`verispec info` says whether the runtime is built.
********************************************************************************
"""


class BuildExt(build_ext):
    """An optional extension whose build fails says why and how to fix it (pip shows the
    build's output with -v; the package then says so again when it runs)."""

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:  # setuptools then skips the optional extension
            sys.stderr.write(BUILD_FAILED.format(error=str(e).strip() or type(e).__name__))
            raise


setup(cmdclass={"build_ext": BuildExt}, ext_modules=[Extension(
    "verispec._vscpu",
    sources=[str(CSRC / f) for f in ("weights.cpp", "forward.cpp", "c_api.cpp", "c_api_test.cpp", "draft_chain.cpp", "threads.cpp",
                                      "kernels_scalar.cpp", "kernels_avx2.cpp", "kernels_avx512.cpp")]
    + sorted(str(p) for p in (CSRC / "formats").glob("*.cpp")),
    depends=[str(CSRC / f) for f in ("vs.h", "model.h", "threads.h", "kernels_generic.inc", "formats/layout.h",
                                      "formats/simd_avx2.h", "formats/simd_avx512.h")],
    # -Wno-maybe-uninitialized: GCC 12's own avx512fintrin.h trips it (~240 times) in
    # _mm512_undefined_ps() (`__m512 __Y = __Y;`, GCC bug 105593, fixed in GCC 13) inlined
    # into _mm512_cvtph_ps and friends: no variable of ours is involved.
    extra_compile_args=["-std=c++17", "-O3", "-ffp-contract=off", "-fno-math-errno", "-Wno-maybe-uninitialized"],
    language="c++",
    optional=True,
)])
