// The machine's multiply-accumulate peaks, the denominators of the prefill roofline
// (docs/benchmarks.md): independent chains of AVX-512 VNNI vpdpbusd (u8 x s8, 64 MACs per zmm
// instruction) and of fp32 FMA (zmm: 16, ymm: 8 MACs), on 1..N threads, in GMAC/s.
//
//   g++ -O2 -std=c++17 -pthread -mavx512f -mavx512bw -mavx512vnni -mfma scripts/peak_macs.cpp -o /tmp/peak_macs
//   /tmp/peak_macs [threads=2] [seconds=0.5]
//
// Each thread runs 12 independent accumulator chains (more than latency x throughput of the
// pipes on Zen 4/5 and Intel cores) for `seconds` per kernel; the best of 3 runs is printed,
// counted per second of each thread's own CPU time (a shared machine's other processes do not
// lower it: it is what the cores can do while a forward has them).
#include <immintrin.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <thread>
#include <vector>

static volatile int sink;

static double cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

template <class Body>
static double rate(int threads, double seconds, double macs_per_iter, Body body) {
  double best = 0;
  for (int run = 0; run < 3; run++) {
    std::vector<std::thread> ts;
    std::vector<double> per_s(threads);  // each thread's MACs per second of its CPU time
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < threads; i++)
      ts.emplace_back([&, i] {
        long n = 0;
        const double c0 = cpu_seconds();
        while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < seconds) n += body();
        per_s[i] = n * macs_per_iter / (cpu_seconds() - c0);
      });
    for (auto& t : ts) t.join();
    double sum = 0;
    for (double x : per_s) sum += x;
    best = std::max(best, sum / 1e9);
  }
  return best;
}

constexpr int CHAINS = 12, INNER = 4096;

static long vnni() {  // INNER x CHAINS vpdpbusd zmm
  __m512i acc[CHAINS];
  for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_set1_epi32(c);
  const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
  for (int i = 0; i < INNER; i++)
#pragma GCC unroll 12
    for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_dpbusd_epi32(acc[c], a, b);
  __m512i s = acc[0];
  for (int c = 1; c < CHAINS; c++) s = _mm512_add_epi32(s, acc[c]);
  sink = _mm512_reduce_add_epi32(s);
  return INNER;
}

static long fma512() {
  __m512 acc[CHAINS];
  for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_set1_ps((float)c);
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-3f);
  for (int i = 0; i < INNER; i++)
#pragma GCC unroll 12
    for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
  __m512 s = acc[0];
  for (int c = 1; c < CHAINS; c++) s = _mm512_add_ps(s, acc[c]);
  sink = (int)_mm512_reduce_add_ps(s);
  return INNER;
}

static long fma256() {
  __m256 acc[CHAINS];
  for (int c = 0; c < CHAINS; c++) acc[c] = _mm256_set1_ps((float)c);
  const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-3f);
  for (int i = 0; i < INNER; i++)
#pragma GCC unroll 12
    for (int c = 0; c < CHAINS; c++) acc[c] = _mm256_fmadd_ps(acc[c], a, b);
  __m256 s = acc[0];
  for (int c = 1; c < CHAINS; c++) s = _mm256_add_ps(s, acc[c]);
  float f[8];
  _mm256_storeu_ps(f, s);
  sink = (int)f[0];
  return INNER;
}

int main(int argc, char** argv) {
  if (argc > 1 && (!std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h"))) {
    std::puts("usage: peak_macs [threads=2] [seconds=0.5]\n"
              "Peak GMAC/s of AVX-512 VNNI vpdpbusd (int8) and fp32 FMA (zmm, ymm) on 1..threads threads\n"
              "(independent chains; best of 3 runs). Build: see the comment at the top of scripts/peak_macs.cpp.");
    return 0;
  }
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const double seconds = argc > 2 ? std::atof(argv[2]) : 0.5;
  if (threads < 1 || seconds <= 0) {
    std::fprintf(stderr, "threads must be >= 1 and seconds > 0\n");
    return 2;
  }
  std::printf("threads  int8 vpdpbusd zmm  fp32 FMA zmm  fp32 FMA ymm   (GMAC/s)\n");
  for (int t = 1; t <= threads; t++)
    std::printf("%7d  %17.1f  %12.1f  %12.1f\n", t, rate(t, seconds, 64.0 * CHAINS, vnni),
                rate(t, seconds, 16.0 * CHAINS, fma512), rate(t, seconds, 8.0 * CHAINS, fma256));
  return 0;
}
