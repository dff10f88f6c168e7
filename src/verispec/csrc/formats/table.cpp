// The one table of weight formats: a new format is its own file (formats/<name>.cpp: layout,
// repack, row dequantization, scalar reference, AVX2 and AVX-512 kernels) plus one row here.
// Python reads the list through vs_formats() (models/cpu.py).
#include "../vs.h"

namespace vs {

extern const Format format_f32, format_q4_0, format_q4_1, format_q5_0, format_q8_0, format_q4_k, format_q5_k,
    format_q6_k, format_q2_k, format_q3_k, format_f16, format_bf16, format_iq4_nl, format_iq4_xs, format_q5_1;

const Format* const FORMATS[] = {&format_f32,  &format_q4_0, &format_q4_1, &format_q5_0,  &format_q8_0,
                                 &format_q4_k, &format_q5_k, &format_q6_k, &format_q2_k,  &format_q3_k,
                                 &format_f16,  &format_bf16, &format_q5_1, &format_iq4_nl, &format_iq4_xs};
const int N_FORMATS = sizeof(FORMATS) / sizeof(FORMATS[0]);

const Format* format_by_type(int ggml_type) {
  for (int i = 0; i < N_FORMATS; i++)
    if (FORMATS[i]->ggml_type == ggml_type) return FORMATS[i];
  return nullptr;
}

}  // namespace vs
