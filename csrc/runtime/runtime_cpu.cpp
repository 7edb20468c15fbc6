// pykernels._cpu_runtime: facts about this CPU, the memory-bandwidth probes that benchmarks use to
// say how close an op runs to the machine's limit (measured in the same run as the op), and the
// huge-page advice for large buffers (pykernels/_memory.py), the element-wise reduction that
// collectives.all_reduce applies to each received piece, and its shared-memory all-reduce among the
// processes of one host (collectives/_shm.py).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#endif

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <climits>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "pk_common.h"
#include "pk_threads.h"
#if PK_X86
#include <immintrin.h>
#endif

namespace py = pybind11;

namespace {

// Sum of 64-bit words: the cheapest loop that still reads every byte (a read-bandwidth probe).
uint64_t sum_words_portable(const uint64_t* p, int64_t n) {
  uint64_t a = 0, b = 0, c = 0, d = 0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) { a += p[i]; b += p[i + 1]; c += p[i + 2]; d += p[i + 3]; }
  for (; i < n; ++i) a += p[i];
  return a + b + c + d;
}

#if PK_X86
PK_TARGET_AVX2 uint64_t sum_words_avx2(const uint64_t* p, int64_t n) {
  __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    a = _mm256_add_epi64(a, _mm256_loadu_si256((const __m256i*)(p + i)));
    b = _mm256_add_epi64(b, _mm256_loadu_si256((const __m256i*)(p + i + 4)));
  }
  a = _mm256_add_epi64(a, b);
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256((__m256i*)lanes, a);
  uint64_t s = lanes[0] + lanes[1] + lanes[2] + lanes[3];
  for (; i < n; ++i) s += p[i];
  return s;
}
#endif

// Flags of n dense float32 (or float64) values: bit 0 some value is NaN or +-inf, bit 1 some value is
// exactly zero. flash_attention's CPU path reads its LSE this way after aten's kernel (aten zeroes a
// row holding NaN with an lse of exactly 0, and an inf gives a NaN lse): one call instead of ~5 numpy
// calls, which right after the kernel (cache-cold interpreter) cost ~25 us of a ~150 us decode step.
int float_flags(uintptr_t src, int64_t n, bool f64) {
  int flags = 0;
  auto scan = [&](auto* p) {
    for (int64_t i = 0; i < n; ++i) {
      const auto x = p[i];
      flags |= std::isfinite(x) ? 0 : 1;
      flags |= x == 0 ? 2 : 0;
    }
  };
  if (f64) scan(reinterpret_cast<const double*>(src));
  else scan(reinterpret_cast<const float*>(src));
  return flags;
}

uint64_t read_sum(uintptr_t src, int64_t nbytes, int num_threads) {
  const uint64_t* p = reinterpret_cast<const uint64_t*>(src);
  const int64_t n = nbytes / 8;
  std::vector<uint64_t> partial(std::max(1, num_threads), 0);
  {
    py::gil_scoped_release release;
    pk::parallel_ranges(n, num_threads, [&](int t, int64_t b, int64_t e) {
#if PK_X86
      partial[t] = pk::cpu_has_avx2() ? sum_words_avx2(p + b, e - b) : sum_words_portable(p + b, e - b);
#else
      partial[t] = sum_words_portable(p + b, e - b);
#endif
    });
  }
  uint64_t s = 0;
  for (auto v : partial) s += v;
  return s;
}

// The fp32 multiply-add rate this machine reaches on num_threads threads of our pool (GFLOP/s, an FMA
// counted as 2): 12 independent chains of 8-lane FMAs per thread (enough to cover the FMA latency of
// two pipes, as a GEMM micro-kernel's 12 accumulators do), ~reps x 12 x 8 x 2 FLOP each. The bench's "% of
// FMA peak" for compute-bound rows divides by it. Without AVX2: 0 (no peak claimed).
#if PK_X86
PK_TARGET_AVX2 static float fma_chains_avx2(int64_t reps) {
  __m256 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_ps(0.001f * (float)i);
  const __m256 mul = _mm256_set1_ps(0.999999f), add = _mm256_set1_ps(1e-7f);
  for (int64_t r = 0; r < reps; ++r) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(acc[i], mul, add);
  }
  __m256 s = acc[0];
  for (int i = 1; i < 12; ++i) s = _mm256_add_ps(s, acc[i]);
  return _mm256_cvtss_f32(s);
}
#endif

double fma_peak_gflops(int num_threads) {
#if PK_X86
  if (!pk::cpu_has_avx2()) return 0.0;
  const int T = std::max(1, num_threads);
  const int64_t reps = int64_t(1) << 22;  // ~400 MFLOP per thread: ~4 ms at 100 GFLOP/s
  py::gil_scoped_release release;
  double best = 0.0;
  for (int trial = 0; trial < 3; ++trial) {  // the best of 3: a descheduled thread only lowers a trial
    std::vector<float> sink(T);
    const auto t0 = std::chrono::steady_clock::now();
    pk::parallel_threads(T, [&](int t) { sink[t] = fma_chains_avx2(reps); });
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    volatile float keep = sink[0];
    (void)keep;
    best = std::max(best, (double)T * reps * 12 * 8 * 2 / s / 1e9);
  }
  return best;
#else
  (void)num_threads;
  return 0.0;
#endif
}

void copy_bytes(uintptr_t dst, uintptr_t src, int64_t nbytes, int num_threads) {
  if (nbytes <= 0) return;  // empty tensors have null data: memcpy(nullptr, nullptr, 0) is undefined
  py::gil_scoped_release release;
  char* d = reinterpret_cast<char*>(dst);
  const char* s = reinterpret_cast<const char*>(src);
  pk::parallel_ranges(nbytes, num_threads, [&](int, int64_t b, int64_t e) { std::memcpy(d + b, s + b, e - b); });
}

// memset(0) split over num_threads threads of our pool: torch.zeros of a large tensor runs on torch's
// OpenMP team, which hangs in a child forked after the parent used it; our pool starts afresh there.
void zero_bytes(uintptr_t dst, int64_t nbytes, int num_threads) {
  if (nbytes <= 0) return;
  py::gil_scoped_release release;
  char* d = reinterpret_cast<char*>(dst);
  pk::parallel_ranges(nbytes, num_threads, [&](int, int64_t b, int64_t e) { std::memset(d + b, 0, e - b); });
}

// Hands the heap's free memory back to the system (glibc's malloc_trim): freed cached buffers of 1-32 MiB
// stay in a fragmented heap otherwise (review finding: 359 MiB of RSS kept after empty_cache()). Returns
// whether any was released; false where the C library has no malloc_trim.
bool trim_heap() {
#if defined(__GLIBC__)
  py::gil_scoped_release release;
  return malloc_trim(0) != 0;
#else
  return false;
#endif
}

// Transparent huge pages for [ptr, ptr + nbytes) (its whole 2 MiB pages), called before the first
// touch. Random probes of a large hash table miss the TLB on nearly every access with 4 KiB pages
// (2 MiB pages keep the page walk cached), and a fresh output's first touch costs one page fault
// per 4 KiB instead of one per 2 MiB. Returns false where the kernel refuses (THP "never") or the
// range holds no whole huge page, which is harmless.
bool advise_hugepages(uintptr_t ptr, int64_t nbytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const uintptr_t huge = uintptr_t(2) << 20;
  const uintptr_t b = (ptr + huge - 1) & ~(huge - 1), e = (ptr + (uintptr_t)nbytes) & ~(huge - 1);
  if (e <= b) return false;
  return madvise(reinterpret_cast<void*>(b), e - b, MADV_HUGEPAGE) == 0;
#else
  (void)ptr;
  (void)nbytes;
  return false;
#endif
}


// dst[i] = dst[i] (op) src[i] for the working buffers of collectives.all_reduce, on the calling thread.
// Why not torch: ATen hands an add of more than 32768 elements to its OpenMP pool, whose spinning
// threads starve gloo's I/O threads when 4 ranks share 2 cores, so the reduction ran in 32768-element
// slices from Python: ~8 us of call overhead per 128 KiB slice, 1.6x the time of one pass over a 1 MiB
// piece. Semantics are torch's: integers wrap (computed unsigned: no signed-overflow UB), max/min
// propagate NaN like torch.maximum/minimum.
enum ReduceOp { kSum = 0, kProd = 1, kMax = 2, kMin = 3 };

template <class T>
struct Wrap { using type = T; };
template <> struct Wrap<int32_t> { using type = uint32_t; };
template <> struct Wrap<int64_t> { using type = uint64_t; };

template <class T, int OP>
__attribute__((always_inline)) inline void reduce_loop(T* __restrict d, const T* __restrict s, int64_t n) {
  using U = typename Wrap<T>::type;
  for (int64_t i = 0; i < n; ++i) {
    const T a = d[i], b = s[i];
    T r;
    if constexpr (OP == kSum) {
      r = (T)(U)((U)a + (U)b);
    } else if constexpr (OP == kProd) {
      r = (T)(U)((U)a * (U)b);
    } else if constexpr (OP == kMax) {
      r = a > b ? a : b;
      if constexpr (std::is_floating_point_v<T>) r = (b != b) ? b : ((a != a) ? a : r);
    } else {
      r = a < b ? a : b;
      if constexpr (std::is_floating_point_v<T>) r = (b != b) ? b : ((a != a) ? a : r);
    }
    d[i] = r;
  }
}

template <class T>
__attribute__((always_inline)) inline void reduce_typed(void* d, const void* s, int64_t n, int op) {
  T* dd = static_cast<T*>(d);
  const T* ss = static_cast<const T*>(s);
  switch (op) {
    case kSum: reduce_loop<T, kSum>(dd, ss, n); break;
    case kProd: reduce_loop<T, kProd>(dd, ss, n); break;
    case kMax: reduce_loop<T, kMax>(dd, ss, n); break;
    default: reduce_loop<T, kMin>(dd, ss, n); break;
  }
}

// dtype: pk::DType (pykernels._native.DTYPE_CODES). Returns false for a type not handled.
__attribute__((always_inline)) inline bool reduce_dispatch(void* d, const void* s, int64_t n, pk::DType dtype,
                                                           int op) {
  switch (dtype) {
    case pk::DType::Float32: reduce_typed<float>(d, s, n, op); return true;
    case pk::DType::Float64: reduce_typed<double>(d, s, n, op); return true;
    case pk::DType::Int32: reduce_typed<int32_t>(d, s, n, op); return true;
    case pk::DType::Int64: reduce_typed<int64_t>(d, s, n, op); return true;
    case pk::DType::UInt8: reduce_typed<uint8_t>(d, s, n, op); return true;
    default: return false;
  }
}

bool reduce_portable(void* d, const void* s, int64_t n, pk::DType dtype, int op) {
  return reduce_dispatch(d, s, n, dtype, op);
}

#if PK_X86
// The same loops compiled for AVX2 (the compiler vectorizes them: 8 floats per instruction).
PK_TARGET_AVX2 bool reduce_avx2(void* d, const void* s, int64_t n, pk::DType dtype, int op) {
  return reduce_dispatch(d, s, n, dtype, op);
}
#endif

// This CPU's best tier; false for a dtype it does not handle.
bool reduce_any(void* d, const void* s, int64_t n, pk::DType dtype, int op) {
#if PK_X86
  if (pk::cpu_has_avx2()) return reduce_avx2(d, s, n, dtype, op);
#endif
  return reduce_portable(d, s, n, dtype, op);
}

void reduce_into(uintptr_t dst, uintptr_t src, int64_t n, int dtype_code, int op) {
  if (n < 0) throw std::invalid_argument("reduce_into: n must be >= 0");
  if (op < kSum || op > kMin) throw std::invalid_argument("reduce_into: op must be 0 (sum), 1 (prod), 2 (max) or 3 (min)");
  const pk::DType dtype = static_cast<pk::DType>(dtype_code);
  bool ok;
  {
    py::gil_scoped_release release;
    ok = reduce_any(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n, dtype, op);
  }
  if (!ok) throw std::invalid_argument("reduce_into: unsupported dtype code " + std::to_string(dtype_code));
}


// ------------------------------------------------------------------------------------------------
// Shared-memory all-reduce among the ranks of one host (collectives/_shm.py makes the segment).
// Ranks on one host that talk through gloo pay for TCP over loopback: every byte is copied into the
// kernel and out again, with a syscall per message and gloo's I/O threads competing for the cores.
// Through one shared segment each byte is copied once each way (NCCL's and MPICH's intra-node
// shared-memory transports do the same). Per chunk of up to slot_bytes:
//   1. every rank copies its vector, except the part it owns, into its slot       (barrier A)
//   2. rank r reduces part r of every other slot into its own vector, and publishes the result
//      in part r of its slot                                                         (barrier B)
//   3. every rank copies the other ranks' results (part j of slot j) into its vector.
// Each part is reduced by one rank only, so every rank ends with the same bits. Two buffer sets
// alternate by chunk: a rank may write set s again (chunk k + 2) only after passing barrier A of
// chunk k + 1, which every rank reaches after finishing chunk k, so no third barrier is needed.
//
// Segment layout (bytes):
//   [64, 68)             barrier counter (uint32, a futex word): barrier b (counted from 0 since the
//                        segment was made, the same count on every rank) completes at (b + 1) * p
//   [72, 76)             poison (uint32): set by a rank that gave up (timeout, a dead peer, an
//                        interrupt), so every other rank fails at once instead of after its timeout
//   [128 + 128 r + 64 s, +8)  rank r's call signature (numel, dtype, op hashed) for a call whose first
//                        chunk uses buffer set s, compared after that chunk's first barrier: ranks
//                        that disagree all fail there. Kept per set like the data: a rank writes set
//                        s's line only after every rank has read it (the argument below), so a rank
//                        that runs ahead into its next call cannot overwrite a line still being read
//   [128 + 128 r + 8, +16) rank r's process id and pid namespace (written by collectives/_shm.py), for
//                        the liveness check (only where every rank shares one pid namespace)
//   data_off + (set * p + r) * slot_bytes: rank r's slot in buffer set `set`
constexpr int64_t kShmCounterOff = 64, kShmPoisonOff = 72, kShmSigOff = 128;
enum ShmStatus { kShmOk = 0, kShmMismatch = 1, kShmTimeout = 2, kShmPeerDied = 3, kShmPoisoned = 4,
                 kShmInterrupted = 5 };

// A peer's process is gone (or a zombie): /proc/<pid>/stat missing or in state Z/X.
bool shm_pid_dead(int64_t pid) {
#if defined(__linux__)
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%lld/stat", (long long)pid);
  FILE* f = std::fopen(path, "r");
  if (!f) return true;
  char buf[512];
  const size_t len = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[len] = 0;
  const char* paren = std::strrchr(buf, ')');  // the command name may hold spaces and parentheses
  return paren && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X');
#else
  (void)pid;
  return false;
#endif
}

struct ShmWaitCtx {
  char* seg;
  int p, rank;
  bool watch_pids;  // the peers' pids are visible here (same pid namespace): checked while waiting
  std::chrono::steady_clock::time_point deadline;
};

void shm_poison(char* seg) {
  __atomic_store_n(reinterpret_cast<uint32_t*>(seg + kShmPoisonOff), 1u, __ATOMIC_RELEASE);
#if defined(__linux__)
  syscall(SYS_futex, seg + kShmCounterOff, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
#endif
}

// Waits until the counter reaches target (wrapping compare). A short spin first (a peer often
// arrives within microseconds), then the futex in 50 ms slices: with more ranks than cores a
// spinning waiter would take the core the last arriver needs. Between slices: the poison word, the
// peers' processes, Ctrl-C (the main thread's signal handlers, under the GIL), the deadline.
int shm_wait(const ShmWaitCtx& c, uint32_t target) {
  uint32_t* counter = reinterpret_cast<uint32_t*>(c.seg + kShmCounterOff);
  const uint32_t* poison = reinterpret_cast<const uint32_t*>(c.seg + kShmPoisonOff);
  // spin, then yield, then sleep. Yielding hands the core to a peer that is runnable but not running
  // (4 ranks on 2 cores): a 4 KiB all-reduce took 0.19 ms with spin + futex, 0.09-0.10 ms with 200
  // yields between them (256 KiB: 0.37-0.53 -> 0.22 ms; 4 ranks / 2 cores, 2026-12-02)
  constexpr int kSpin = 128, kYield = 200;
  for (int i = 0; i < kSpin; ++i) {
    if ((int32_t)(__atomic_load_n(counter, __ATOMIC_ACQUIRE) - target) >= 0) return kShmOk;
#if PK_X86
    _mm_pause();
#endif
  }
  for (int i = 0; i < kYield; ++i) {
    if ((int32_t)(__atomic_load_n(counter, __ATOMIC_ACQUIRE) - target) >= 0) return kShmOk;
    sched_yield();
  }
  for (int slice = 0;; ++slice) {
    const uint32_t v = __atomic_load_n(counter, __ATOMIC_ACQUIRE);
    if ((int32_t)(v - target) >= 0) return kShmOk;
    if (__atomic_load_n(poison, __ATOMIC_ACQUIRE)) return kShmPoisoned;
    if (slice > 0) {
      if (std::chrono::steady_clock::now() >= c.deadline) return kShmTimeout;
      if (c.watch_pids)
        for (int j = 0; j < c.p; ++j)
          if (j != c.rank && shm_pid_dead(*reinterpret_cast<const int64_t*>(c.seg + kShmSigOff + 128 * j + 8)))
            return kShmPeerDied;
      py::gil_scoped_acquire gil;
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();  // KeyboardInterrupt and the like
    }
#if defined(__linux__)
    // not FUTEX_PRIVATE: the word lives in a mapping shared between processes
    timespec ts{0, 50 * 1000 * 1000};
    syscall(SYS_futex, counter, FUTEX_WAIT, v, &ts, nullptr, 0);
#else
    sched_yield();
#endif
  }
}

int shm_barrier(const ShmWaitCtx& c, uint32_t target) {
  uint32_t* counter = reinterpret_cast<uint32_t*>(c.seg + kShmCounterOff);
  const uint32_t v = __atomic_add_fetch(counter, 1u, __ATOMIC_ACQ_REL);
  if ((int32_t)(v - target) >= 0) {
#if defined(__linux__)
    syscall(SYS_futex, counter, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
#endif
    return kShmOk;
  }
  return shm_wait(c, target);
}

// What one call does (kind): the whole all-reduce; or, for the innermost level of the hierarchical
// all-reduce, its reduce-scatter (rank r ends with part r reduced) or the matching all-gather.
enum ShmKind { kShmAllReduce = 0, kShmReduceScatter = 1, kShmAllGather = 2 };

// One call over x split into p parts [begin[j], end[j]) (elements; rank j's part: any order, no
// overlap; the hierarchical algorithm's members own parts in its topology's order). Chunk c moves elements
// [c*cp, (c+1)*cp) of every part (cp = a slot / p, whole cache lines), so a part of any length goes
// through slots of fixed size and rank r's part stays contiguous in x. Per chunk:
//   reduce-scatter: copy the other parts' slices into my slot | barrier | reduce my slice of every slot
//   all-gather:     copy my part's slice into my slot         | barrier | copy the others' slices out
//   all-reduce:     the two in turn (two barriers per chunk).
// Every read of a chunk's buffer set happens before the reader arrives at the next chunk's first
// barrier, and every write after the writer passed the previous chunk's last: so alternating two
// sets by chunk (across calls and kinds, the count kept by the caller) needs no other barrier.
// Returns (status, barriers passed, chunks used): status a ShmStatus. After a mismatch every rank
// has passed the same barriers; after any other failure the barrier count is out of step, the
// segment is poisoned (the other ranks fail at once) and the caller retires it.
py::tuple shm_collective(uintptr_t base, int64_t data_off, int64_t slot_bytes, int p, int rank, uintptr_t x,
                         const std::vector<int64_t>& begin, const std::vector<int64_t>& end, int dtype_code,
                         int op, uint64_t sig, int kind,
                         int64_t barriers_done, int64_t chunks_done, double timeout_s, bool watch_pids) {
  const pk::DType dtype = static_cast<pk::DType>(dtype_code);
  const int64_t es = pk::dtype_size(dtype);
  if (p < 2 || rank < 0 || rank >= p || (int64_t)begin.size() != p || (int64_t)end.size() != p)
    throw std::invalid_argument("shm_collective: bad p, rank or parts");
  if (op < kSum || op > kMin || slot_bytes % 64 || kind < kShmAllReduce || kind > kShmAllGather)
    throw std::invalid_argument("shm_collective: bad op, kind or slot_bytes");
  int64_t longest = 0;
  for (int j = 0; j < p; ++j) {
    if (begin[j] < 0 || end[j] < begin[j]) throw std::invalid_argument("shm_collective: a part ends before it begins");
    longest = std::max(longest, end[j] - begin[j]);
  }
  switch (dtype) {
    case pk::DType::Float32: case pk::DType::Float64: case pk::DType::Int32: case pk::DType::Int64:
    case pk::DType::UInt8: break;
    default: throw std::invalid_argument("shm_collective: unsupported dtype code " + std::to_string(dtype_code));
  }
  const int64_t align = 64 / es;
  const int64_t cp = slot_bytes / es / p / align * align;  // elements of each part per chunk
  if (cp < 1) throw std::invalid_argument("shm_collective: slot_bytes too small for p");
  char* seg = reinterpret_cast<char*>(base);
  char* xs = reinterpret_cast<char*>(x);
  // a call of 0 elements still meets the others once (the signatures are compared there)
  const int64_t nchunks = std::max<int64_t>(1, (longest + cp - 1) / cp);
  int status = kShmOk;
  int64_t barriers = 0, k = 0;
  if (__atomic_load_n(reinterpret_cast<uint32_t*>(seg + kShmPoisonOff), __ATOMIC_ACQUIRE))
    return py::make_tuple((int)kShmPoisoned, 0, 0);
  ShmWaitCtx ctx{seg, p, rank, watch_pids, {}};
  const double wait_s = std::min(std::max(timeout_s, 0.0), 1e7);  // no overflow of the deadline
  auto barrier = [&] {
    ctx.deadline = std::chrono::steady_clock::now() + std::chrono::microseconds((int64_t)(wait_s * 1e6));
    const int st = shm_barrier(ctx, (uint32_t)((barriers_done + barriers + 1) * p));
    if (st == kShmOk) ++barriers;
    return st;
  };
  // the first barrier of a call: the signatures were stored before it; every rank reads the same
  // ones after it, so on a mismatch every rank is here and all pass one more barrier (no rank may
  // start its next call, overwriting its signature, before all have read it), then all fail
  const int64_t sig_set = chunks_done & 1;  // the first chunk's buffer set
  auto sig_line = [&](int r) { return reinterpret_cast<uint64_t*>(seg + kShmSigOff + 128 * r + 64 * sig_set); };
  auto first_barrier = [&] {
    int st = barrier();
    if (st != kShmOk) return st;
    bool agree = true;
    for (int j = 0; j < p; ++j) agree &= __atomic_load_n(sig_line(j), __ATOMIC_RELAXED) == sig;
    if (agree) return (int)kShmOk;
    st = barrier();
    return st == kShmOk ? (int)kShmMismatch : st;
  };
  try {
    py::gil_scoped_release release;
    __atomic_store_n(sig_line(rank), sig, __ATOMIC_RELAXED);
    for (; k < nchunks; ++k) {
      const int64_t rel = k * cp;
      auto len = [&](int j) { return std::clamp<int64_t>(end[j] - begin[j] - rel, 0, cp); };
      auto xpart = [&](int j) { return xs + (begin[j] + rel) * es; };
      const int64_t set = (chunks_done + k) & 1;
      // slice j of rank r's slot in this chunk's buffer set
      auto sub = [&](int r, int j) { return seg + data_off + (set * p + r) * slot_bytes + j * cp * es; };
      auto meet = [&] { return k == 0 ? first_barrier() : barrier(); };
      if (kind != kShmAllGather) {
        for (int j = 0; j < p; ++j)
          if (j != rank) std::memcpy(sub(rank, j), xpart(j), len(j) * es);
        if ((status = meet()) != kShmOk) break;
        // my slice of every other slot into x, a few KiB at a time: the block of x stays in L1
        // across the p - 1 sources (read and written once instead of p - 1 times)
        const int64_t block = 4096 / es, mine = len(rank);
        for (int64_t b0 = 0; b0 < mine; b0 += block)
          for (int j = 0; j < p; ++j)
            if (j != rank)
              reduce_any(xpart(rank) + b0 * es, sub(j, rank) + b0 * es, std::min(block, mine - b0), dtype, op);
      }
      if (kind != kShmReduceScatter) {
        std::memcpy(sub(rank, rank), xpart(rank), len(rank) * es);
        if ((status = (kind == kShmAllGather ? meet() : barrier())) != kShmOk) break;
        for (int j = 0; j < p; ++j)
          if (j != rank) std::memcpy(xpart(j), sub(j, j), len(j) * es);
      }
    }
  } catch (py::error_already_set&) {  // interrupted while waiting: the others must not wait for us
    shm_poison(seg);
    throw;
  }
  if (status != kShmOk && status != kShmMismatch) shm_poison(seg);
  return py::make_tuple(status, barriers, status == kShmOk ? nchunks : k + 1);
}
}  // namespace

PYBIND11_MODULE(_cpu_runtime, m) {
  pk::def_mark_forked(m);
  pk::def_native_errors("runtime");
  m.doc() = "pykernels CPU runtime: SIMD detection and memory-bandwidth probes";
  m.def("cpu_has_avx2", &pk::cpu_has_avx2, "True when the AVX2 kernels run on this CPU");
  m.def("cpu_has_avx512", &pk::cpu_has_avx512, "True when the AVX-512 (VNNI, BF16, VPOPCNTDQ) kernels run on this CPU");
  m.def("float_flags", &float_flags, py::arg("src"), py::arg("n"), py::arg("f64"),
        "bit 0: some of the n dense floats is NaN/inf; bit 1: some is exactly zero");
  m.def("read_sum", &read_sum, py::arg("src"), py::arg("nbytes"), py::arg("num_threads"),
        "Sum of the 64-bit words at src (reads every byte once, on num_threads threads)");
  m.def("fma_peak_gflops", &fma_peak_gflops, py::arg("num_threads"),
        "fp32 FMA rate (GFLOP/s) of 12 independent AVX2 FMA chains per thread on num_threads threads; 0 without AVX2");
  m.def("copy_bytes", &copy_bytes, py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("num_threads"),
        "memcpy split over num_threads threads");
  m.def("zero_bytes", &zero_bytes, py::arg("dst"), py::arg("nbytes"), py::arg("num_threads"),
        "memset(0) split over num_threads threads of our pool (works in a forked child)");
  m.def("trim_heap", &trim_heap, "malloc_trim(0): the heap's free memory back to the system (glibc)");
  m.def("advise_hugepages", &advise_hugepages, py::arg("ptr"), py::arg("nbytes"),
        "madvise(MADV_HUGEPAGE) over the whole 2 MiB pages of [ptr, ptr + nbytes), before the first touch");
  m.def("reduce_into", &reduce_into, py::arg("dst"), py::arg("src"), py::arg("n"), py::arg("dtype"), py::arg("op"),
        "dst[i] = dst[i] (op) src[i] for i < n on this thread; dtype a pk::DType code (float32/64, int32/64, "
        "uint8); op 0 sum, 1 prod, 2 max, 3 min (NaN propagates; integers wrap)");
  m.def("shm_collective", &shm_collective, py::arg("base"), py::arg("data_off"), py::arg("slot_bytes"), py::arg("p"),
        py::arg("rank"), py::arg("x"), py::arg("begin"), py::arg("end"), py::arg("dtype"), py::arg("op"), py::arg("sig"),
        py::arg("kind"), py::arg("barriers_done"), py::arg("chunks_done"), py::arg("timeout_s"), py::arg("watch_pids"),
        "All-reduce (kind 0), reduce-scatter (1) or all-gather (2) of x, split into parts [begin[j], "
        "end[j]) (rank j's), among p processes through the shared segment at base (see collectives/_shm.py); "
        "returns (status, barriers passed, chunks used)");
}
