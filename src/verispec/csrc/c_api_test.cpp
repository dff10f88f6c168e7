// verispec compiled CPU runtime: C entry points for tests and benchmarks, outside any model:
// one format's matrix product on one ISA (every ISA against the scalar reference, every
// format against a dequantized fp32 reference), its row dequantization, and a kernel
// micro-benchmark (scripts/bench_kernels.py).
#include <algorithm>
#include <chrono>
#include <ctime>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "model.h"

using vs::set_err;

extern "C" {

// One matrix product out[T][rows] = W @ x[t] through a format's kernels on one ISA, outside
// any model (tests: every ISA against the scalar reference, every format against a
// dequantized fp32 reference). x is fp32 [T][cols], quantized here as a forward does.
int vs_test_matmul(int ggml_type, const void* data, int rows, int cols, const float* x, int T, float* out,
                   const char* isa, char* err, int n) {
  std::string e;
  const vs::Kernels* k = vs::select_kernels(isa, e);
  const vs::Format* f = vs::format_by_type(ggml_type);
  if (!k || !f || rows < 1 || T < 1 || cols % vs::QK || cols % f->block_cols) {
    set_err(err, n, !k ? e : !f ? "unsupported format" : "bad shape");
    return -1;
  }
  try {
    vs::Matrix m;
    vs::repack(m, f, (const uint8_t*)data, rows, cols);
    vs::Act a(T, cols);
    std::memcpy(a.x.data(), x, (size_t)T * cols * sizeof(float));
    for (int t = 0; t < T; t++) a.quantize(k, t);
    f->matmul[k->isa](m, 0, m.panels, a.view(), T, out, rows);
    std::free(m.data);
  } catch (const std::exception& ex) {
    set_err(err, n, ex.what());
    return -1;
  }
  return 0;
}

// One element-wise kernel of one ISA on n floats (tests: every ISA against the scalar reference,
// bit for bit): which 0, out = silu(a) * b; which 1, a quantized per 32-block into q, d, s, qsum
// and qsum16 (n a multiple of 32), as a forward quantizes a matrix product's input.
int vs_test_elementwise(const char* isa, int which, const float* a, const float* b, int n, float* out, int8_t* q,
                        float* d, float* s, int32_t* qsum, int32_t* qsum16, char* err, int len) {
  std::string e;
  const vs::Kernels* k = vs::select_kernels(isa, e);
  if (!k || n < 1 || (which == 1 && n % vs::QK) || which < 0 || which > 1) {
    set_err(err, len, !k ? e : "bad kernel or size");
    return -1;
  }
  if (which == 0) k->silu_mul(a, b, out, n);
  else k->quantize_row(a, n, q, d, s, qsum, qsum16);
  return 0;
}

// Seconds per matrix product of T tokens (best of `reps`) on `threads` threads: a kernel
// micro-benchmark for scripts/bench_kernels.py (weights repacked once, random activations).
static double thread_cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

double vs_bench_matmul(int ggml_type, const void* data, int rows, int cols, int T, int reps, const char* isa,
                       int threads) {
  std::string e;
  const vs::Kernels* k = vs::select_kernels(isa, e);
  const vs::Format* f = vs::format_by_type(ggml_type);
  if (!k || !f || rows < 1 || T < 1 || reps < 1 || threads < 1 || cols % vs::QK || cols % f->block_cols) return -1.0;
  auto pool = vs::ThreadPool::shared(threads);
  vs::Matrix m;
  vs::repack(m, f, (const uint8_t*)data, rows, cols, pool.get());
  vs::Act a(T, cols);
  for (size_t i = 0; i < a.x.size(); i++) a.x[i] = (float)((i * 2654435761u) % 2001) / 1000.0f - 1.0f;
  for (int t = 0; t < T; t++) a.quantize(k, t);
  std::vector<float> out((size_t)T * rows);
  const vs::QAct qa = a.view();
  double best = 1e30;
  for (int r = 0; r < reps; r++) {
    const auto t0 = std::chrono::steady_clock::now();
    const double c0 = thread_cpu_seconds();
    pool->parallel_for(m.panels, [&](int p0, int p1) { f->matmul[k->isa](m, p0, p1, qa, T, out.data(), rows); }, 2);
    // one thread: its own CPU time, which a shared machine's other processes do not stretch
    best = std::min(best, threads == 1 ? thread_cpu_seconds() - c0
                                       : std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::free(m.data);
  return best;
}

// Rows of a matrix dequantized from its panels (the embedding lookup), fp32 [rows][cols].
int vs_test_dequant(int ggml_type, const void* data, int rows, int cols, float* out, char* err, int n) {
  const vs::Format* f = vs::format_by_type(ggml_type);
  if (!f || rows < 1 || cols % vs::QK || cols % f->block_cols) {
    set_err(err, n, "unsupported format or shape");
    return -1;
  }
  vs::Linear l;
  vs::Matrix m;
  vs::repack(m, f, (const uint8_t*)data, rows, cols);
  l.parts.push_back(m);
  l.row0.push_back(0);
  for (int r = 0; r < rows; r++) l.row(r, out + (size_t)r * cols);
  l.clear();
  return 0;
}

}  // extern "C"
