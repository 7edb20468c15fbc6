// A small persistent thread pool for the CPU kernels.
//
// Each _cpu_<family> module holds its own pool (header-only, hidden visibility); idle workers sleep
// on a condition variable, so extra pools cost memory for their stacks, not CPU time.
//
// Waking a sleeping thread is slow on the VMs we run on: a halted vCPU takes ~0.3-0.6 ms to come back
// (a warm 4096 x 4096 W4 GEMV, 0.48 ms on 2 threads, took 1.1 ms right after 20 ms of idling). So a
// worker spins for kSpinWorker after each job before it sleeps (back-to-back calls, a model's layers,
// find it awake, as OpenMP's spin-wait does), the caller spins for kSpinCaller on the workers' last
// chunk before it sleeps, and parallel_chunks hands out work dynamically: the caller takes the chunks
// a sleeping worker has not come for, and once they are all taken a worker that has not started yet
// skips the job, so its wake-up is not waited for. Spinning yields the core every 64 polls: on an
// oversubscribed machine (4 processes on 2 cores) a pause-only spin kept the woken worker off the core.
//
// Whose threads: torch's own, where the process has them. torch runs its CPU ops on an OpenMP runtime
// (libgomp in the pip wheels) whose workers spin-wait ~5-10 ms after each parallel region (GOMP_SPINCOUNT)
// before they sleep. A pool of our own then shared the second core with a spinning torch worker after
// every torch op and took ~2x as long (qmatmul fp32 M=64 4096^2: 5.9 ms alone, 13.4 ms right after a
// torch add or F.linear; OMP_WAIT_POLICY=PASSIVE made the gap vanish). So a job runs on the OpenMP
// runtime torch loaded (found among the loaded libraries, GOMP_parallel called through its C ABI; we
// link no OpenMP ourselves: two OpenMP runtimes in one process fight over cores), whose workers are
// the very threads spinning for work. The pool below runs jobs where there is no such runtime, in a
// child forked from a process (libgomp's threads do not survive a fork, and its state hangs the child),
// and with PYKERNELS_CPU_THREADS=pool. Python passes `num_threads` (default torch.get_num_threads()),
// so our kernels never use more threads than torch was told to, and the caller releases the GIL.
#pragma once
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "pk_common.h"
#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#endif
#if defined(__linux__)
#include <dlfcn.h>
#include <link.h>
#include <cstdlib>
#include <cstring>
#endif
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define PK_SPIN_PAUSE() _mm_pause()
#else
#define PK_SPIN_PAUSE() std::this_thread::yield()
#endif

namespace pk {

// Spins until pred() or `budget` has passed; returns pred().
template <class P>
inline bool spin_until(P&& pred, std::chrono::microseconds budget) {
  const auto until = std::chrono::steady_clock::now() + budget;
  for (int i = 0;; ++i) {
    if (pred()) return true;
    if ((i & 63) == 63) {
      if (std::chrono::steady_clock::now() >= until) return pred();
      std::this_thread::yield();  // lets a runnable thread (the one we wait for, maybe) have the core
    }
    PK_SPIN_PAUSE();
  }
}

// Set in a child forked after this module was loaded (registered at load, so a fork before our first
// job counts too): the parent's OpenMP team is not there, and libgomp's inherited state hangs the child.
inline std::atomic<bool> forked_since_load{false};
#if defined(__unix__) || defined(__APPLE__)
inline const bool fork_watch = [] {
  return pthread_atfork(nullptr, nullptr, [] { forked_since_load.store(true, std::memory_order_relaxed); }) == 0;
}();
#endif
// A module first loaded in a forked child sees no fork of its own: pykernels._native tells it through
// this binding (its at-fork hook, registered at `import pykernels`; review finding: a child whose parent
// never loaded _cpu_sort hung in its first sort, on the parent's stale OpenMP team).
template <class Module>
inline void def_mark_forked(Module& m) {
  m.def("mark_forked", [] { forked_since_load.store(true, std::memory_order_relaxed); },
        "this process is a fork of one that may have started OpenMP threads: run on our own pool");
}

#ifdef PYBIND11_VERSION_MAJOR
// Native allocation failures (ours: pk::AllocError with the size and purpose; std::vector's and new's: a bare
// std::bad_alloc) raise MemoryError naming the module's ops, e.g. "pykernels.sort: native CPU code: cannot
// allocate 48 GiB (...) of sort scratch"; pybind11 alone said "std::bad_alloc" (review finding). family:
// a string literal.
inline const char*& native_error_family() {  // one per module (.so): the translator is a plain function
  static const char* family = "native";
  return family;
}
inline void def_native_errors(const char* family) {
  native_error_family() = family;
  pybind11::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const AllocError& e) {
      PyErr_Format(PyExc_MemoryError, "pykernels.%s: native CPU code: %s", native_error_family(), e.what());
    } catch (const std::bad_alloc&) {
      PyErr_Format(PyExc_MemoryError, "pykernels.%s: native CPU code: out of memory (std::bad_alloc)",
                   native_error_family());
    }
  });
}
#endif

// The OpenMP runtime already loaded in this process (torch's), through its C ABI: GOMP_parallel runs
// fn(data) on a team of num_threads threads, the caller as thread 0, and returns when all are done
// (libgomp; LLVM's libomp and Intel's libiomp5 export the same entry points). get(): null where the
// process has none loaded (torch built without OpenMP, not Linux) or PYKERNELS_CPU_THREADS=pool.
struct HostOpenMP {
  void (*parallel)(void (*)(void*), void*, unsigned, unsigned) = nullptr;
  int (*thread_num)() = nullptr;
  int (*num_threads)() = nullptr;

  static const HostOpenMP* get() {
    static const HostOpenMP found = find();
    return found.parallel ? &found : nullptr;
  }

 private:
  static HostOpenMP find() {
    HostOpenMP r;
#if defined(__linux__)
    const char* mode = std::getenv("PYKERNELS_CPU_THREADS");
    if (mode && std::strcmp(mode, "pool") == 0) return r;
    dl_iterate_phdr([](dl_phdr_info* info, size_t, void* out) -> int {
      const char* name = info->dlpi_name;
      if (!name || !(std::strstr(name, "libgomp") || std::strstr(name, "libiomp5") || std::strstr(name, "libomp.")))
        return 0;
      void* h = dlopen(name, RTLD_LAZY | RTLD_NOLOAD);  // a reference to the loaded copy; never loads one
      if (!h) return 0;
      auto* r = static_cast<HostOpenMP*>(out);
      r->parallel = reinterpret_cast<decltype(r->parallel)>(dlsym(h, "GOMP_parallel"));
      r->thread_num = reinterpret_cast<int (*)()>(dlsym(h, "omp_get_thread_num"));
      r->num_threads = reinterpret_cast<int (*)()>(dlsym(h, "omp_get_num_threads"));
      if (r->parallel && r->thread_num && r->num_threads) return 1;
      *r = HostOpenMP();
      return 0;
    }, &r);
#endif
    return r;
  }
};

class ThreadPool {
 public:
  static ThreadPool& instance() {
#if defined(__unix__) || defined(__APPLE__)
    static std::once_flag at_fork;
    std::call_once(at_fork, [] { pthread_atfork(nullptr, nullptr, &start_afresh_in_child); });
#endif
    return *current().load(std::memory_order_acquire);
  }

  // Runs fn(tid) for tid in [0, nthreads) and returns when all are done. tid 0 runs on the caller.
  // Calls from several Python threads at once are serialized (one job at a time); nested calls run
  // inline on the calling worker. `skippable`: fn(tid) for tid > 0 may be skipped, because fn(0)
  // returns only when nothing is left to do (parallel_chunks); workers that have not started the job
  // when fn(0) returns then skip it and are not waited for.
  void run(int nthreads, const std::function<void(int)>& fn, bool skippable = false) {
    if (nthreads <= 1 || in_worker_) {
      for (int t = 0; t < std::max(nthreads, 1); ++t) fn(t);
      return;
    }
    std::lock_guard<std::mutex> job_lock(job_mutex_);
    // (more threads than CPUs: the pool, whose failure to start a thread is an error we can report;
    // libgomp's ends the process)
    static const int cpus = (int)std::max(1u, std::thread::hardware_concurrency());
    const HostOpenMP* omp = nthreads <= cpus && !forked_since_load.load(std::memory_order_relaxed)
                                ? HostOpenMP::get() : nullptr;
    if (omp) {
      run_on_openmp(*omp, nthreads, fn);
      return;
    }
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
      job_open_ = true;
      job_skippable_ = skippable;
      // static jobs: every worker's share must run; skippable ones count the workers that start
      pending_.store(skippable ? 0 : nthreads - 1);
      generation_.fetch_add(1);
    }
    cv_.notify_all();
    in_worker_ = true;
    guarded(0);
    in_worker_ = false;
    if (skippable) {  // from now on no worker starts it; pending_ holds those that did
      std::lock_guard<std::mutex> g(mutex_);
      job_open_ = false;
    }
    spin_until([&] { return pending_.load(std::memory_order_acquire) == 0; }, kSpinCaller);
    std::unique_lock<std::mutex> lk(mutex_);
    done_cv_.wait(lk, [&] { return pending_.load() == 0; });
    job_ = nullptr;
    if (first_error) std::rethrow_exception(first_error);
  }

  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

 private:
  ThreadPool() = default;

  // The pool lives as long as the process (never destroyed: at exit its sleeping workers simply end
  // with it). A forked child has none of the parent's worker threads, and maybe a lock that a parent
  // thread held at the fork: it starts a fresh pool and leaves the old one alone (joining threads that
  // do not exist would hang; a job waited forever for them in every op with 2+ threads; review finding).
  static std::atomic<ThreadPool*>& current() {
    static std::atomic<ThreadPool*> pool{new ThreadPool()};
    return pool;
  }
  static void start_afresh_in_child() { current().store(new ThreadPool(), std::memory_order_release); }

  struct OpenMPJob {
    const HostOpenMP* omp;
    const std::function<void(int)>* fn;
    int nthreads;
    std::mutex error_mutex;
    std::exception_ptr first_error;
  };

  // One OpenMP thread's part: tids thread_num, thread_num + team, ... (a team smaller than asked for,
  // under an OpenMP thread limit, still runs every tid). Exceptions stay on this side of the C runtime.
  static void openmp_thread(void* p) {
    auto* job = static_cast<OpenMPJob*>(p);
    const bool was_worker = in_worker_;
    in_worker_ = true;  // a nested run() on this thread runs inline
    const int team = std::max(1, job->omp->num_threads());
    for (int t = job->omp->thread_num(); t < job->nthreads; t += team) {
      try { (*job->fn)(t); } catch (...) {
        std::lock_guard<std::mutex> g(job->error_mutex);
        if (!job->first_error) job->first_error = std::current_exception();
      }
    }
    in_worker_ = was_worker;
  }

  static void run_on_openmp(const HostOpenMP& omp, int nthreads, const std::function<void(int)>& fn) {
    OpenMPJob job{&omp, &fn, nthreads, {}, nullptr};
    omp.parallel(&ThreadPool::openmp_thread, &job, (unsigned)nthreads, 0);
    if (job.first_error) std::rethrow_exception(job.first_error);
  }

  void ensure_workers(int n) {
    while ((int)workers_.size() < n) {
      int index = (int)workers_.size() + 1;  // worker i runs tid i
      uint64_t start_generation;
      {
        // Read under the lock, before run() bumps the generation, so a worker that starts late
        // still sees the job it was created for.
        std::lock_guard<std::mutex> g(mutex_);
        start_generation = generation_.load();
      }
      try {
        workers_.emplace_back([this, index, start_generation] { worker_loop(index, start_generation); });
      } catch (const std::system_error& e) {
        // the OS refused a thread (ulimit, memory): a bare "Resource temporarily unavailable" named
        // nothing (audit finding). The workers already started stay usable by later calls.
        throw std::runtime_error(std::string("pykernels: could not start CPU worker thread ") +
                                 std::to_string(index) + " (" + e.what() +
                                 "); use fewer threads (torch.set_num_threads)");
      }
    }
  }

  void worker_loop(int tid, uint64_t seen) {
    in_worker_ = true;
    for (;;) {
      const std::function<void(int)>* job = nullptr;
      spin_until([&] { return generation_.load(std::memory_order_acquire) != seen; }, kSpinWorker);
      {
        std::unique_lock<std::mutex> lk(mutex_);
        cv_.wait(lk, [&] { return stop_ || generation_.load() != seen; });
        if (stop_) return;
        seen = generation_.load();
        if (tid < job_threads_ && job_open_) {
          job = job_;
          if (job_skippable_) pending_.fetch_add(1);  // under mutex_: the caller closes the job under it
        }
      }
      if (!job) continue;
      (*job)(tid);
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> g(mutex_);  // the caller may be (about to be) asleep on done_cv_
        done_cv_.notify_all();
      }
    }
  }

  std::mutex job_mutex_;
  std::mutex mutex_;
  std::condition_variable cv_, done_cv_;
  std::vector<std::thread> workers_;
  const std::function<void(int)>* job_ = nullptr;
  int job_threads_ = 0;
  bool job_open_ = false, job_skippable_ = false;
  std::atomic<int> pending_{0};
  std::atomic<uint64_t> generation_{0};
  bool stop_ = false;
  static constexpr std::chrono::microseconds kSpinWorker{100}, kSpinCaller{300};
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

// Splits [0, n) into pieces of `grain` handed out in order to whichever thread asks first, and runs
// fn(tid, begin, end) on each: for work whose pieces cost about the same, where a late worker should
// leave its share to the threads already running (see the top of this file).
template <class F>
inline void parallel_chunks(int64_t n, int nthreads, int64_t grain, F&& fn) {
  grain = std::max<int64_t>(1, grain);
  nthreads = (int)std::max<int64_t>(1, std::min<int64_t>(nthreads, (n + grain - 1) / grain));
  std::atomic<int64_t> next{0};
  ThreadPool::instance().run(nthreads, [&](int t) {
    for (;;) {
      const int64_t b = next.fetch_add(grain, std::memory_order_relaxed);
      if (b >= n) return;
      fn(t, b, std::min(n, b + grain));
    }
  }, /*skippable=*/true);
}

// Runs fn(tid) on nthreads threads (for kernels that split their own work).
template <class F>
inline void parallel_threads(int nthreads, F&& fn) {
  ThreadPool::instance().run(std::max(1, nthreads), [&](int t) { fn(t); });
}

}  // namespace pk
