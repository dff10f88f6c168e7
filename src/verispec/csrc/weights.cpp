// verispec compiled CPU runtime: the weights side. fp16 conversion, the choice of ISA, and
// repacking row-major GGUF blocks into 16-row panels (one Matrix per row block; a Linear
// stacks the row blocks of one layer).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "model.h"

namespace vs {

// ---------------------------------------------------------------- fp16

float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h >> 15) << 31;
  uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do {
      e++;
      mant <<= 1;
    } while (!(mant & 0x400));
    bits = sign | ((uint32_t)(112 - e) << 23) | ((mant & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_half(float f) {  // round to nearest even, like F16C's vcvtps2ph
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000, exp = (x >> 23) & 0xFF;
  uint32_t mant = x & 0x7FFFFF;
  if (exp == 0xFF) return (uint16_t)(sign | 0x7C00 | (mant ? 0x200 : 0));  // inf / nan
  const int e = (int)exp - 127 + 15;
  if (e >= 31) return (uint16_t)(sign | 0x7C00);  // overflow: inf
  if (e <= 0) {  // a half subnormal (or zero)
    if (e < -10) return (uint16_t)sign;
    mant |= 0x800000;
    const int shift = 14 - e;
    uint32_t h = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (h & 1))) h++;
    return (uint16_t)(sign | h);
  }
  uint32_t h = sign | ((uint32_t)e << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1FFF;
  if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;  // a carry rounds up into the exponent
  return (uint16_t)h;
}

// ---------------------------------------------------------------- ISA dispatch

static bool cpu_has_avx512() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
         __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

static bool cpu_has_avx2() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

const Kernels* select_kernels(const char* want, std::string& err) {
  const std::string w = want && *want ? want : "auto";
  if (w == "scalar") return &kernels_scalar;
  if (w == "avx2" || (w == "auto" && !cpu_has_avx512() && cpu_has_avx2())) {
    if (!cpu_has_avx2()) {
      err = "ISA avx2 is not supported by this CPU (needs AVX2, FMA, F16C)";
      return nullptr;
    }
    return &kernels_avx2;
  }
  if (w == "avx512" || w == "auto") {
    if (cpu_has_avx512()) return &kernels_avx512;
    if (w == "auto") return &kernels_scalar;
    err = "ISA avx512 is not supported by this CPU (needs AVX-512 F/BW/VL/VNNI, FMA, F16C)";
    return nullptr;
  }
  err = "unknown ISA '" + w + "': use auto, avx512, avx2 or scalar";
  return nullptr;
}

// ---------------------------------------------------------------- panels

constexpr size_t PANEL_ALIGN = 64;  // bytes: a cache line, one AVX-512 register

// The 2 MB pages inside [p, p + bytes) are asked for as transparent huge pages (Linux, where THP is
// "madvise" or "always"; elsewhere nothing happens) before the first write touches them: a decode step
// streams every weight once, and with 4 kB pages each 4 kB costs a TLB miss (a Qwen 1.5B step:
// ~240,000 of them); huge pages took ~4% off its time. Only whole aligned 2 MB pages inside the
// block are advised, so no memory is added.
static void advise_huge_pages(void* p, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t HUGE = (uintptr_t)1 << 21;
  const uintptr_t lo = ((uintptr_t)p + HUGE - 1) & ~(HUGE - 1), hi = ((uintptr_t)p + bytes) & ~(HUGE - 1);
  if (hi > lo) madvise((void*)lo, hi - lo, MADV_HUGEPAGE);  // advice: a refusal changes nothing but speed
#else
  (void)p;
  (void)bytes;
#endif
}

void* aligned_zeroed(size_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, PANEL_ALIGN, bytes ? bytes : PANEL_ALIGN) != 0) throw std::bad_alloc();
  advise_huge_pages(p, bytes);
  std::memset(p, 0, bytes);
  return p;
}

// Each panel's bytes are written by one thread; a format's repack may refuse a block (Q4_0
// scales out of range): the error is carried back, never thrown in a worker.
void repack(Matrix& m, const Format* f, const uint8_t* data, int rows, int cols, ThreadPool* pool) {
  m.fmt = f;
  m.rows = rows;
  m.cols = cols;
  m.panels = (rows + PANEL - 1) / PANEL;
  m.panel_bytes = (size_t)(cols / f->block_cols) * f->panel_block_bytes;
  m.data = (uint8_t*)aligned_zeroed(m.panel_bytes * m.panels);
  const size_t rb = (size_t)(cols / f->block_cols) * f->src_block_bytes;
  std::mutex mu;
  std::string error;
  auto panels = [&](int p0, int p1) {
    try {
      for (int row = p0 * PANEL; row < std::min(rows, p1 * PANEL); row++)
        f->repack_row(data + (size_t)row * rb, cols, m.data + (size_t)(row / PANEL) * m.panel_bytes, row % PANEL);
    } catch (const std::exception& ex) {
      std::lock_guard<std::mutex> lock(mu);
      error = ex.what();
    }
  };
  if (pool) pool->parallel_for(m.panels, panels, 4);
  else panels(0, m.panels);
  if (!error.empty()) {
    std::free(m.data);
    m.data = nullptr;
    throw std::runtime_error(error);
  }
}

// ---------------------------------------------------------------- Linear

void Linear::clear() {
  for (Matrix& m : parts) {
    std::free(m.data);
    std::free(m.bias);
  }
  parts.clear();
  row0.clear();
  rows = cols = panels = 0;
  ref = nullptr;
}

size_t Linear::bytes() const {
  size_t b = 0;
  for (const Matrix& m : parts) b += m.panel_bytes * m.panels;
  return b;
}

// The embedding lookup, tied or not. A row by reference goes through a one-row panel, so its
// values are bitwise those of the repacked matrix.
void Linear::row(int r, float* out) const {
  if (ref) {
    static thread_local std::vector<uint8_t> panel;
    const size_t bytes = (size_t)(cols / ref_fmt->block_cols) * ref_fmt->panel_block_bytes;
    panel.assign(bytes, 0);
    ref_fmt->repack_row(ref + (size_t)r * ref_row_bytes, cols, panel.data(), 0);
    ref_fmt->dequant_row(panel.data(), cols, 0, out);
    return;
  }
  size_t i = 0;
  while (i + 1 < parts.size() && r >= row0[i + 1]) i++;
  const Matrix& m = parts[i];
  const int lr = r - row0[i];
  m.fmt->dequant_row(m.data + (size_t)(lr / PANEL) * m.panel_bytes, m.cols, lr % PANEL, out);
}

}  // namespace vs
