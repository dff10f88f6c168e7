"""Matrix-product kernels of the compiled runtime, per weight format, ISA and token count:
GMAC/s and effective weight bandwidth (GB/s) of one product of T tokens (best of --reps),
weights repacked once (with --threads 1, timed by that thread's CPU time, which other processes on
a shared machine do not stretch). Prints a table; asserts nothing.

    python scripts/bench_kernels.py --rows 8960 --cols 1536 --tokens 1,4,8,16 --threads 2

``--baseline LIB`` times another build's runtime (e.g. a copy of main's ``_vscpu*.so``) on the
same blocks, interleaved with this one (each rep times both), and prints this build's time as a
fraction of the baseline's: a before/after of the kernels alone. A matrix larger than the last-level
cache (``--rows 24576 --cols 4096``) shows whether a product's compute hides behind its weight stream.
"""

from __future__ import annotations

import argparse
import ctypes

import numpy as np

from verispec.models import cpu_abi
from verispec.models.ggml_quants import quantize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="q4_k,q6_k,q5_0,q8_0,q4_0")
    ap.add_argument("--rows", type=int, default=8960)
    ap.add_argument("--cols", type=int, default=1536)
    ap.add_argument("--tokens", default="1,2,4,5,8,16")
    ap.add_argument("--isa", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--baseline", help="another build's _vscpu*.so, timed interleaved with this one")
    args = ap.parse_args()
    lib = bench_library(cpu_abi.library())
    base = bench_library(ctypes.CDLL(args.baseline)) if args.baseline else None
    w = np.random.default_rng(0).standard_normal((args.rows, args.cols)).astype(np.float32)
    tokens = [int(t) for t in args.tokens.split(",")]
    print(f"[{args.rows} x {args.cols}], {args.threads} threads, ISA {cpu_abi.isa_name(args.isa)}")
    width = 22 if base is None else 32
    print(f"{'format':7} " + " ".join(f"{'T=' + str(t):>{width}}" for t in tokens))
    for fmt in args.formats.split(","):
        blocks = np.ascontiguousarray(quantize(w, fmt))
        cells, t1 = [], None
        for t in tokens:
            def run(which: ctypes.CDLL, reps: int) -> float:
                return which.vs_bench_matmul(cpu_abi.FORMATS[fmt].fmt.ggml_type, blocks.ctypes.data, args.rows, args.cols, t,
                                             reps, args.isa.encode(), args.threads)
            if base is None:
                s = run(lib, args.reps)
            else:  # alternately, best of 3 each time (after each call's repack), so both see the same machine
                s, b = (min(x) for x in zip(*((run(lib, 3), run(base, 3)) for _ in range(max(1, args.reps // 3)))))
            t1 = t1 or s
            cell = f"{s * 1e3:6.2f}ms {args.rows * args.cols * t / s / 1e9:5.1f}GMAC/s {s / t1:4.2f}x"
            cells.append(cell if base is None else f"{cell} {s / b:4.2f}xbase")
        gbs = blocks.nbytes / t1 / 1e9
        print(f"{fmt:7} " + " ".join(f"{c:>{width}}" for c in cells) + f"   T=1 streams {gbs:.1f} GB/s")


def bench_library(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.vs_bench_matmul.restype = ctypes.c_double
    lib.vs_bench_matmul.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                    ctypes.c_int, ctypes.c_char_p, ctypes.c_int)
    return lib


if __name__ == "__main__":
    main()
