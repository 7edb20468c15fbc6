// Shared C++ helpers for every pykernels CPU module: errors, dtype codes, runtime CPU feature checks.
// No torch headers here (a CPU-only torch cannot build CUDA extensions); Python passes raw pointers,
// sizes and dtype codes, and these helpers keep that boundary explicit.
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

namespace pk {

// Dtype codes shared with pykernels/_native.py (DTYPE_CODES). Keep the two in sync.
enum class DType : int {
  Bool = 0, UInt8 = 1, Int8 = 2, Int16 = 3, UInt16 = 4, Int32 = 5, UInt32 = 6,
  Int64 = 7, UInt64 = 8, Float16 = 9, BFloat16 = 10, Float32 = 11, Float64 = 12,
};

inline int dtype_size(DType t) {
  switch (t) {
    case DType::Bool: case DType::UInt8: case DType::Int8: return 1;
    case DType::Int16: case DType::UInt16: case DType::Float16: case DType::BFloat16: return 2;
    case DType::Int32: case DType::UInt32: case DType::Float32: return 4;
    case DType::Int64: case DType::UInt64: case DType::Float64: return 8;
  }
  return 0;
}

// A ValueError-style failure; pybind11 maps std::invalid_argument to ValueError.
[[noreturn]] inline void fail_value(const std::string& op, const std::string& what) {
  throw std::invalid_argument("pykernels." + op + ": " + what);
}
[[noreturn]] inline void fail_runtime(const std::string& op, const std::string& what) {
  throw std::runtime_error("pykernels." + op + ": " + what);
}

// A native allocation that failed, with its size and purpose: the module's translator (def_native_errors in
// pk_threads.h) turns it into a MemoryError naming the op family, where pybind11 alone said "std::bad_alloc".
class AllocError : public std::bad_alloc {
 public:
  AllocError(size_t bytes, const char* what) {
    const double gib = (double)bytes / (double)(size_t(1) << 30);
    char buf[160];
    std::snprintf(buf, sizeof(buf), "cannot allocate %.3g GiB (%zu bytes) of %s", gib, bytes, what);
    msg_ = buf;
  }
  const char* what() const noexcept override { return msg_.c_str(); }

 private:
  std::string msg_;
};

// Runtime SIMD choice: the wheel is built for baseline x86-64, and AVX2 kernels are compiled with
// PK_TARGET_AVX2 and only called when the CPU has AVX2+FMA+BMI2. PYKERNELS_DISABLE_AVX2=1 forces
// the portable path (tests run both).
#if defined(__x86_64__) || defined(_M_X64)
#define PK_X86 1
#define PK_TARGET_AVX2 __attribute__((target("avx2,fma,bmi,bmi2,popcnt,f16c")))
inline bool cpu_has_avx2() {
  static const bool has = [] {
    const char* off = std::getenv("PYKERNELS_DISABLE_AVX2");
    if (off && off[0] == '1') return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("popcnt") &&
           __builtin_cpu_supports("f16c");
  }();
  return has;
}
// AVX-512 tier (Zen 4, Ice Lake and newer): F/BW/DQ/VL plus VNNI, BF16 and VPOPCNTDQ, which the
// quantized GEMMs and bit-serial kernels use. Only chosen when cpu_has_avx2() too, so
// PYKERNELS_DISABLE_AVX2=1 still forces the portable path; PYKERNELS_DISABLE_AVX512=1 forces AVX2.
#define PK_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx512bf16,avx512vpopcntdq," \
                        "avx2,fma,bmi,bmi2,popcnt,f16c")))
// AVX2, AVX-512 F/BW/DQ/VL, and PYKERNELS_DISABLE_AVX512 unset: what every AVX-512 tier needs.
inline bool avx512_base() {
  if (!cpu_has_avx2()) return false;
  const char* off = std::getenv("PYKERNELS_DISABLE_AVX512");
  if (off && off[0] == '1') return false;
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}
inline bool cpu_has_avx512() {
  static const bool has = avx512_base() && __builtin_cpu_supports("avx512vnni") &&
                          __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vpopcntdq");
  return has;
}
// The base and BF16 only (flash attention's bf16 dot-product kernels): also Cooper Lake, which has
// AVX-512 BF16 but not VPOPCNTDQ.
inline bool cpu_has_avx512bf16() {
  static const bool has = avx512_base() && __builtin_cpu_supports("avx512bf16");
  return has;
}
#else
#define PK_X86 0
#define PK_TARGET_AVX2
#define PK_TARGET_AVX512
inline bool cpu_has_avx2() { return false; }
inline bool cpu_has_avx512() { return false; }
inline bool cpu_has_avx512bf16() { return false; }
#endif

#if defined(__GNUC__)
#define PK_PREFETCH_R(p) __builtin_prefetch((p), 0, 1)
#if PK_X86
// PREFETCHW (the line in exclusive state, ready for a store or CAS). __builtin_prefetch(p, 1, ...)
// emits it only when compiled with -mprfchw, else a read prefetch, after which the CAS of a hash insert
// waited for the line's ownership (18% of the insert loop's samples on the lock cmpxchg). Every x86-64
// CPU runs it: AMD since K8, Intel since Broadwell, and as a NOP on the Intel cores before.
#define PK_PREFETCH_W(p) __asm__ volatile("prefetchw %0" : : "m"(*reinterpret_cast<const char*>(p)))
#else
#define PK_PREFETCH_W(p) __builtin_prefetch((p), 1, 1)
#endif
#define PK_LIKELY(x) __builtin_expect(!!(x), 1)
#define PK_UNLIKELY(x) __builtin_expect(!!(x), 0)
#else
#define PK_PREFETCH_R(p)
#define PK_PREFETCH_W(p)
#define PK_LIKELY(x) (x)
#define PK_UNLIKELY(x) (x)
#endif

// Software prefetch of a sequential read stream, STREAM_AHEAD_BYTES ahead, issued once per cache line
// (call it with every element index i of the loop). On the Xeon VMs these libraries are measured on,
// the hardware prefetchers alone left streaming loops stalled on their loads: the sort's counting read of
// 16M uint32 keys from DRAM took 11.4 ms on 2 threads, 8.3 ms with this (2 KiB ahead: no gain); the hash
// lookups' key stream and the qgemm weight stream measured the same effect. Prefetches never fault, so
// the last 4 KiB of a stream may point past its end.
constexpr size_t STREAM_AHEAD_BYTES = 4096;
template <class T>
inline void prefetch_stream(const T* p, int64_t i) {
  static_assert(sizeof(T) <= 64, "one prefetch per cache line");
  if ((i & (int64_t)(64 / sizeof(T) - 1)) == 0)
    PK_PREFETCH_R(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p + i) + STREAM_AHEAD_BYTES));
}

// The same for the elements [i, i + n) of a loop that takes them a group at a time (the hash tables'
// grouped loops): one prefetch per cache line they start, STREAM_AHEAD_BYTES ahead. kWrite: for writing,
// an output stream whose stores otherwise wait on each line's read-for-ownership.
template <bool kWrite = false, class T>
inline void prefetch_stream_range(const T* p, int64_t i, int64_t n) {
  constexpr int64_t per_line = 64 / sizeof(T);
  static_assert(per_line >= 1 && (per_line & (per_line - 1)) == 0, "a power-of-two number of elements per line");
  for (int64_t x = (i + per_line - 1) & ~(per_line - 1); x < i + n; x += per_line) {
    const char* a = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p + x) + STREAM_AHEAD_BYTES);
    if (kWrite) PK_PREFETCH_W(a);
    else PK_PREFETCH_R(a);
  }
}

// f(std::integral_constant<int, v>()) when Lo <= v <= Hi, so a loop over v iterations unrolls; else
// f(std::integral_constant<int, 0>()), which f takes to mean "v at run time".
template <int Lo, int Hi, class F>
inline void with_small_int(int v, F&& f) {
  if constexpr (Lo > Hi) {
    f(std::integral_constant<int, 0>());
  } else {
    if (v == Lo) f(std::integral_constant<int, Lo>());
    else with_small_int<Lo + 1, Hi>(v, std::forward<F>(f));
  }
}

}  // namespace pk
