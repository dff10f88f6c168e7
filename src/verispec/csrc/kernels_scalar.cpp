// Scalar kernels: the reference every SIMD path is tested against, and the fallback for
// CPUs without AVX2. Compiled for baseline x86-64 (fmaf is libm's correctly rounded fma).
#include <cmath>
#include <cstring>

#include "vs.h"

namespace vs {
namespace scalar {
#include "kernels_generic.inc"
static void exp_shifted(float* s, int n, float mx) { exp_shifted_ref(s, n, mx); }
VS_SCORE_PAIR_BY_ONE(score_tiles_ref)
VS_ATTEND(score_tiles_ref, weigh_values_ref, score_pair_by_one)
}  // namespace scalar

const Kernels kernels_scalar = {"scalar", ISA_SCALAR, scalar::attend, scalar::attend_pair, scalar::silu_mul_ref, scalar::quantize_row_ref,
                                scalar::rms_norm};

}  // namespace vs
