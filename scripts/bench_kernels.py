"""Matrix-product kernels of the compiled runtime, per weight format, ISA and token count:
GMAC/s and effective weight bandwidth (GB/s) of one product of T tokens (best of --reps),
weights repacked once. Prints a table; asserts nothing.

    python scripts/bench_kernels.py --rows 8960 --cols 1536 --tokens 1,4,8,16 --threads 2
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
    args = ap.parse_args()
    lib = cpu_abi.library()
    lib.vs_bench_matmul.restype = ctypes.c_double
    lib.vs_bench_matmul.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                    ctypes.c_int, ctypes.c_char_p, ctypes.c_int)
    w = np.random.default_rng(0).standard_normal((args.rows, args.cols)).astype(np.float32)
    tokens = [int(t) for t in args.tokens.split(",")]
    print(f"[{args.rows} x {args.cols}], {args.threads} threads, ISA {cpu_abi.isa_name(args.isa)}")
    print(f"{'format':7} " + " ".join(f"{'T=' + str(t):>22}" for t in tokens))
    for fmt in args.formats.split(","):
        blocks = np.ascontiguousarray(quantize(w, fmt))
        cells, t1 = [], None
        for t in tokens:
            s = lib.vs_bench_matmul(cpu_abi.FORMATS[fmt].ggml_type, blocks.ctypes.data, args.rows, args.cols, t,
                                    args.reps, args.isa.encode(), args.threads)
            t1 = t1 or s
            cells.append(f"{s * 1e3:6.2f}ms {args.rows * args.cols * t / s / 1e9:5.1f}GMAC/s {s / t1:4.2f}x")
        gbs = blocks.nbytes / t1 / 1e9
        print(f"{fmt:7} " + " ".join(f"{c:>22}" for c in cells) + f"   T=1 streams {gbs:.1f} GB/s")


if __name__ == "__main__":
    main()
