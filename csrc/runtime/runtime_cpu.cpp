// pykernels._cpu_runtime: facts about this CPU, the memory-bandwidth probes that benchmarks use to
// say how close an op runs to the machine's limit (measured in the same run as the op), and the
// huge-page advice for large buffers (pykernels/_memory.py).
#include <pybind11/pybind11.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <cstring>
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

void copy_bytes(uintptr_t dst, uintptr_t src, int64_t nbytes, int num_threads) {
  py::gil_scoped_release release;
  char* d = reinterpret_cast<char*>(dst);
  const char* s = reinterpret_cast<const char*>(src);
  pk::parallel_ranges(nbytes, num_threads, [&](int, int64_t b, int64_t e) { std::memcpy(d + b, s + b, e - b); });
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

}  // namespace

PYBIND11_MODULE(_cpu_runtime, m) {
  m.doc() = "pykernels CPU runtime: SIMD detection and memory-bandwidth probes";
  m.def("cpu_has_avx2", &pk::cpu_has_avx2, "True when the AVX2 kernels run on this CPU");
  m.def("cpu_has_avx512", &pk::cpu_has_avx512, "True when the AVX-512 (VNNI, BF16, VPOPCNTDQ) kernels run on this CPU");
  m.def("read_sum", &read_sum, py::arg("src"), py::arg("nbytes"), py::arg("num_threads"),
        "Sum of the 64-bit words at src (reads every byte once, on num_threads threads)");
  m.def("copy_bytes", &copy_bytes, py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("num_threads"),
        "memcpy split over num_threads threads");
  m.def("advise_hugepages", &advise_hugepages, py::arg("ptr"), py::arg("nbytes"),
        "madvise(MADV_HUGEPAGE) over the whole 2 MiB pages of [ptr, ptr + nbytes), before the first touch");
}
