#include "threads.h"

#include <chrono>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
static inline void cpu_relax() { _mm_pause(); }
#else
static inline void cpu_relax() {}
#endif

namespace vs {

namespace {
using Clock = std::chrono::steady_clock;
constexpr auto kSpin = std::chrono::microseconds(50);
constexpr auto kYield = std::chrono::milliseconds(2);
constexpr uint64_t kMask20 = (1u << 20) - 1;

uint64_t gen_of(uint64_t w) { return w >> 40; }
int count_of(uint64_t w) { return (int)((w >> 20) & kMask20); }
int next_of(uint64_t w) { return (int)(w & kMask20); }

// Wait until done() holds: spin, then yield, then block in sleep() (which rechecks done).
template <class Done, class Sleep>
void wait_for(Done done, Sleep sleep) {
  const auto start = Clock::now();
  for (int i = 0; !done(); i++) {
    if ((i & 63) != 63) {
      cpu_relax();
      continue;
    }
    const auto waited = Clock::now() - start;
    if (waited < kSpin) continue;
    if (waited < kYield) {
      std::this_thread::yield();
      continue;
    }
    sleep();
  }
}
}  // namespace

ThreadPool::ThreadPool(int n_threads) : n_(n_threads < 1 ? 1 : n_threads) {
  for (int t = 1; t < n_; t++) threads_.emplace_back(&ThreadPool::worker, this);
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_.store(true);
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

bool ThreadPool::run_one_chunk(uint64_t job) {
  uint64_t w = work_.load(std::memory_order_acquire);
  for (;;) {
    if (gen_of(w) != gen_of(job) || next_of(w) >= count_of(w)) return false;
    if (work_.compare_exchange_weak(w, w + 1, std::memory_order_acq_rel)) break;
  }
  // A successful claim of chunk `c` of this generation: the caller cannot publish another
  // job before done_ counts it, so fn_ and n_items_ are this job's.
  const int c = next_of(w), n = count_of(w);
  const int begin = (int)((int64_t)n_items_ * c / n), end = (int)((int64_t)n_items_ * (c + 1) / n);
  (*fn_)(begin, end);
  done_.fetch_add(1, std::memory_order_acq_rel);
  return true;
}

std::shared_ptr<ThreadPool> ThreadPool::shared(int n_threads) {
  static std::mutex mu;
  static std::vector<std::weak_ptr<ThreadPool>> pools;  // by size; a pool lives while a model holds it
  std::lock_guard<std::mutex> lock(mu);
  for (auto& w : pools)
    if (auto p = w.lock(); p && p->size() == n_threads) return p;
  auto p = std::make_shared<ThreadPool>(n_threads);
  pools.push_back(p);
  return p;
}

void ThreadPool::parallel_for(int n_items, const std::function<void(int, int)>& fn, int grain) {
  if (n_items <= 0) return;
  int chunks = n_items / (grain < 1 ? 1 : grain);
  if (chunks > 4 * n_) chunks = 4 * n_;
  if (n_ == 1 || chunks <= 1) {  // not worth waking anyone
    fn(0, n_items);
    return;
  }
  std::lock_guard<std::mutex> job_lock(job_mu_);
  fn_ = &fn;
  n_items_ = n_items;
  done_.store(0, std::memory_order_relaxed);
  generation_ = (generation_ + 1) & ((1u << 24) - 1);
  const uint64_t job = (generation_ << 40) | ((uint64_t)chunks << 20);
  work_.store(job);  // seq_cst: pairs with the workers' sleepers_ increment (no lost wake-up)
  if (sleepers_.load() > 0) {
    std::lock_guard<std::mutex> lock(mu_);
    cv_.notify_all();
  }
  while (run_one_chunk(job)) {
  }
  wait_for([&] { return done_.load(std::memory_order_acquire) == chunks; }, [] { std::this_thread::yield(); });
}

void ThreadPool::worker() {
  uint64_t seen = 0;  // the last job word this worker looked at
  for (;;) {
    auto has_work = [&] {
      const uint64_t w = work_.load();
      return stop_.load(std::memory_order_relaxed) || (gen_of(w) != gen_of(seen) && next_of(w) < count_of(w));
    };
    wait_for(has_work, [&] {
      std::unique_lock<std::mutex> lock(mu_);
      sleepers_.fetch_add(1);
      cv_.wait(lock, has_work);
      sleepers_.fetch_sub(1);
    });
    if (stop_.load()) return;
    seen = work_.load(std::memory_order_acquire);
    while (run_one_chunk(seen)) {
    }
  }
}

}  // namespace vs
