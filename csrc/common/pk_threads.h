// A small persistent thread pool for the CPU kernels.
//
// Each _cpu_<family> module holds its own pool (header-only, hidden visibility); idle workers sleep
// on a condition variable, so extra pools cost memory for their stacks, not CPU time.
//
// Why not OpenMP: torch ships its own OpenMP runtime (libgomp/libiomp) and two OpenMP runtimes in one
// process fight over cores. Python passes `num_threads` (default torch.get_num_threads()), so our
// kernels never use more threads than torch was told to, and the caller releases the GIL around us.
#pragma once
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace pk {

class ThreadPool {
 public:
  static ThreadPool& instance() {
    static ThreadPool pool;
    return pool;
  }

  // Runs fn(tid) for tid in [0, nthreads) and returns when all are done. tid 0 runs on the caller.
  // Calls from several Python threads at once are serialized (one job at a time); nested calls run
  // inline on the calling worker.
  void run(int nthreads, const std::function<void(int)>& fn) {
    if (nthreads <= 1 || in_worker_) {
      for (int t = 0; t < std::max(nthreads, 1); ++t) fn(t);
      return;
    }
    std::lock_guard<std::mutex> job_lock(job_mutex_);
    ensure_workers(nthreads - 1);
    std::exception_ptr first_error;
    std::mutex error_mutex;
    std::function<void(int)> guarded = [&](int t) {
      try { fn(t); } catch (...) {
        std::lock_guard<std::mutex> g(error_mutex);
        if (!first_error) first_error = std::current_exception();
      }
    };
    {
      std::lock_guard<std::mutex> g(mutex_);
      job_ = &guarded;
      job_threads_ = nthreads;
      pending_ = nthreads - 1;
      ++generation_;
    }
    cv_.notify_all();
    in_worker_ = true;
    guarded(0);
    in_worker_ = false;
    std::unique_lock<std::mutex> lk(mutex_);
    done_cv_.wait(lk, [&] { return pending_ == 0; });
    job_ = nullptr;
    if (first_error) std::rethrow_exception(first_error);
  }

  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> g(mutex_);
      stop_ = true;
      ++generation_;
    }
    cv_.notify_all();
    for (auto& w : workers_) w.join();
  }

 private:
  ThreadPool() = default;

  void ensure_workers(int n) {
    while ((int)workers_.size() < n) {
      int index = (int)workers_.size() + 1;  // worker i runs tid i
      uint64_t start_generation;
      {
        // Read under the lock, before run() bumps the generation, so a worker that starts late
        // still sees the job it was created for.
        std::lock_guard<std::mutex> g(mutex_);
        start_generation = generation_;
      }
      workers_.emplace_back([this, index, start_generation] { worker_loop(index, start_generation); });
    }
  }

  void worker_loop(int tid, uint64_t seen) {
    in_worker_ = true;
    for (;;) {
      const std::function<void(int)>* job = nullptr;
      {
        std::unique_lock<std::mutex> lk(mutex_);
        cv_.wait(lk, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        if (tid < job_threads_) job = job_;
      }
      if (!job) continue;
      (*job)(tid);
      std::lock_guard<std::mutex> g(mutex_);
      if (--pending_ == 0) done_cv_.notify_all();
    }
  }

  std::mutex job_mutex_;
  std::mutex mutex_;
  std::condition_variable cv_, done_cv_;
  std::vector<std::thread> workers_;
  const std::function<void(int)>* job_ = nullptr;
  int job_threads_ = 0;
  int pending_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
  static inline thread_local bool in_worker_ = false;
};

// Splits [0, n) into `nthreads` contiguous ranges and runs fn(tid, begin, end) on each.
template <class F>
inline void parallel_ranges(int64_t n, int nthreads, F&& fn) {
  nthreads = (int)std::max<int64_t>(1, std::min<int64_t>(nthreads, n));
  ThreadPool::instance().run(nthreads, [&](int t) {
    int64_t begin = n * t / nthreads, end = n * (t + 1) / nthreads;
    fn(t, begin, end);
  });
}

// Runs fn(tid) on nthreads threads (for kernels that split their own work).
template <class F>
inline void parallel_threads(int nthreads, F&& fn) {
  ThreadPool::instance().run(std::max(1, nthreads), [&](int t) { fn(t); });
}

}  // namespace pk
