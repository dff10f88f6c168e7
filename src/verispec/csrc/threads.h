// A small persistent thread pool: the caller plus n-1 workers run one job at a time. A job
// is cut into chunks of consecutive items that threads claim from one atomic word, so a
// descheduled worker never stalls a forward: the caller takes whatever is left. Which
// thread computes a chunk never changes a result (every output is computed whole).
//
// Waiting: spin with pause for ~50 us, then yield for ~2 ms, then sleep on a condition
// variable. A forward's phases are microseconds apart, so workers rarely sleep during one;
// between forwards they stop burning the cores that torch or the drafter need.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace vs {

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // The process-wide pool of n threads: every model (target, draft, EAGLE head) asking for
  // n threads shares it, so models never oversubscribe the cores; jobs run one at a time.
  static std::shared_ptr<ThreadPool> shared(int n_threads);

  int size() const { return n_; }
  // Run fn(begin, end) over [0, n_items) in chunks of at least `grain` items.
  void parallel_for(int n_items, const std::function<void(int, int)>& fn, int grain = 1);

 private:
  void worker();
  bool run_one_chunk(uint64_t job);  // claim and run one chunk of `job`; false when none is left

  int n_;
  std::vector<std::thread> threads_;
  // The job word: generation (24 bits) | chunk count (20 bits) | next unclaimed chunk (20 bits).
  std::atomic<uint64_t> work_{0};
  std::atomic<int> done_{0};  // chunks finished in the current job
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::mutex job_mu_;  // one job at a time (models sharing the pool may be driven from different threads)
  std::condition_variable cv_;
  const std::function<void(int, int)>* fn_ = nullptr;
  int n_items_ = 0;
  uint64_t generation_ = 0;  // caller only
};

}  // namespace vs
