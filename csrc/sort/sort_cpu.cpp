// pykernels._cpu_sort: a parallel, stable LSD radix sort for the CPU in the spirit of Onesweep
// (Adinets & Merrill, "Onesweep: A Faster Least Significant Digit Radix Sort for GPUs", 2022).
//
// How one sort runs (radix_engine below):
//   1. One read of the keys builds the histograms of EVERY digit at once, per thread (Onesweep's
//      "global histogram" kernel). The same read encodes keys into order-preserving unsigned integers
//      and notes whether any float would not survive the round trip (-0.0, NaNs with odd payloads).
//   2. A pass whose digit is the same for every key is skipped (its histogram has one full bin).
//   3. One scatter per remaining digit. Each thread owns a contiguous slice of the source; its
//      destination offsets are a prefix over (digit, thread) of the per-thread counts, so the scatter
//      is stable without any synchronisation. Writes go through small per-digit write-combining lines
//      (one 64-byte line per digit, aligned to the destination's cache lines) that are flushed whole,
//      with non-temporal stores when asked: 256/2048 scattered streams would otherwise thrash the TLB
//      and the caches, and the streaming stores avoid the read-for-ownership of the destination.
//   4. While a line is flushed, the thread also counts the NEXT pass's digit of those keys by the
//      destination slice they land in: the next pass's per-thread counts come for free, so every pass
//      moves each key exactly twice (read + write) - Onesweep's 2n instead of 3n.
//   The first pass reads the caller's keys (encoding on the fly); the last writes the caller's output
//   (decoding on the fly) and, for argsort, widens the 32-bit indices it carried to int64.
//
// Keys: every dtype code of pk::DType. Integers are made unsigned by flipping the sign bit; floats by
// flipping the sign bit of positives and every bit of negatives, after canonicalising NaN (all NaNs
// sort after +inf, as torch does) and -0.0 (equal to +0.0, so stable indices match torch.sort). When
// such a canonicalisation changed a key, the output keys are gathered from the input through the
// sorted indices so the exact bits come back. Descending = every encoded bit flipped (still stable).
#include <pybind11/pybind11.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <numeric>
#include <vector>

#include "pk_common.h"
#include "pk_threads.h"
#if PK_X86
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace py = pybind11;

namespace pksort {

using pk::DType;

// ---------------------------------------------------------------------------------------------
// Order-preserving key encodings
// ---------------------------------------------------------------------------------------------
enum class Enc { Xor, Float };

template <class U>
struct Codec {
  static constexpr int BITS = 8 * sizeof(U);
  static constexpr U SIGN = U(U(1) << (BITS - 1));
  static constexpr U ALL = U(~U(0));
  U xor_mask = 0;  // Xor: signed -> SIGN; plus ALL when descending
  U base = 0;      // Xor: subtracted after the xor (the LSD engine's narrow spans, see span_base)
  U flip = 0;      // Float: ALL when descending
  U inf_bits = 0;  // Float: bits of +inf (any larger magnitude is a NaN)
  U qnan_bits = 0; // Float: the default quiet NaN, which every NaN becomes
};

template <class U, Enc E>
struct Coder {
  Codec<U> c;
  inline U enc(U x) const {
    if constexpr (E == Enc::Xor) {
      return U(U(x ^ c.xor_mask) - c.base);
    } else {
      U mag = U(x & U(~Codec<U>::SIGN));
      if (mag > c.inf_bits) x = c.qnan_bits;  // every NaN sorts as one value, after +inf
      // -0.0 == +0.0: -0.0 alone encodes to SIGN - 1, moved to +0.0's SIGN after the xor (a branch on
      // mag == 0 mispredicted on keys with many zeros: 30% of 4M float32 keys, ~15 cycles a key in each
      // read of them)
      const U m = U(U(U(0) - U(x >> (Codec<U>::BITS - 1))) | Codec<U>::SIGN);  // negative: all ones
      U k = U(x ^ m);
      k = U(k + U(k == U(Codec<U>::SIGN - 1)));
      return U(k ^ c.flip);
    }
  }
  inline U dec(U k) const {
    if constexpr (E == Enc::Xor) {
      return U(U(k + c.base) ^ c.xor_mask);
    } else {
      k = U(k ^ c.flip);
      U m = (k & Codec<U>::SIGN) ? Codec<U>::SIGN : Codec<U>::ALL;
      return U(k ^ m);
    }
  }
  // True when enc/dec would not give x back bit for bit.
  inline bool lossy(U x) const {
    if constexpr (E == Enc::Xor) {
      return false;
    } else {
      U mag = U(x & U(~Codec<U>::SIGN));
      return (mag > c.inf_bits && x != c.qnan_bits) || x == Codec<U>::SIGN;
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Offset between arrays written in step (keys and their payloads): half of an L1 way (32 lines).
static constexpr size_t SKEW = 2048;

// Scratch memory: grown on demand and kept per thread, so repeated sorts do not pay page faults.
// ---------------------------------------------------------------------------------------------
// Transparent huge pages for the big arrays a scatter writes all over: 2048 digit streams on 4 KiB
// pages would need more TLB entries than the CPU has (a hint; ignored where THP is off).
static void advise_huge(void* p, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const uintptr_t a = ((uintptr_t)p + (size_t(2) << 20) - 1) & ~uintptr_t((size_t(2) << 20) - 1);
  const uintptr_t e = ((uintptr_t)p + bytes) & ~uintptr_t((size_t(2) << 20) - 1);
  if (e > a) madvise((void*)a, e - a, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

struct Scratch {
  struct Free { void operator()(void* p) const { std::free(p); } };
  std::unique_ptr<char, Free> mem;
  size_t cap = 0;
  char* get(size_t bytes) {
    bytes = (bytes + 4095) & ~size_t(4095);
    if (bytes > cap) {
      mem.reset();
      cap = 0;
      const size_t align = bytes >= (size_t(4) << 20) ? (size_t(2) << 20) : 4096;
      bytes = (bytes + align - 1) & ~(align - 1);
      void* p = std::aligned_alloc(align, bytes);
      if (!p) throw pk::AllocError(bytes, "sort scratch");
      advise_huge(p, bytes);
      mem.reset(static_cast<char*>(p));
      cap = bytes;
    }
    return mem.get();
  }
  void trim(size_t keep) {
    if (cap > keep) { mem.reset(); cap = 0; }
  }
};
static Scratch& thread_scratch() {  // ping-pong keys/payloads of the radix passes
  static thread_local Scratch s;
  return s;
}
static Scratch& thread_own_outputs() {  // outputs the caller did not ask for (index mode)
  static thread_local Scratch s;
  return s;
}
// What a thread keeps after a call: reuse saves the page faults of repeated mid-size sorts, but every
// calling thread (and every pool thread of a segmented sort) keeps its own buffers until it exits, so
// bigger buffers are released after the call (a sort of more than ~8M 32-bit keys pays its page faults
// again, which costs a few % of that sort). 66 MiB: the wide split's 16-byte records of 2^22 keys, 64 MiB
// rounded up to 2 MiB pages past the 64 bytes of slack (with 64 MiB they were released after every call:
// 4M int64 + indices with half one value took 29 ms or, re-faulting 64 MiB, 64-68; medians of 9 calls);
// + 64 KiB: the MSD split's gapped records of 2^24 keys, 64 MiB and a line per bucket (msd_hybrid_sort).
static constexpr size_t SCRATCH_KEEP = (size_t(66) << 20) + (size_t(64) << 10);

// ---------------------------------------------------------------------------------------------
// Arguments of one 1-D sort (keys of n elements, optional int64 indices and/or payload)
// ---------------------------------------------------------------------------------------------
struct SortArgs {
  const void* keys = nullptr;
  int64_t n = 0;
  DType dtype = DType::UInt32;
  void* out_keys = nullptr;      // may be null (argsort)
  int64_t* out_idx = nullptr;    // may be null (sort_keys / sort_pairs)
  const void* pay = nullptr;     // payload (sort_pairs), may be null
  void* out_pay = nullptr;
  int pay_size = 0;              // bytes per payload element
  bool descending = false;
  int begin_bit = 0, end_bit = -1;
  int digit_bits = 0;            // 0 = heuristic
  int threads = 1;
  int nt_stores = -1;            // streaming stores for full write-combining lines: 1 on, 0 off, -1 = where
                                 // they paid (the LSD engine's lines; the MSD split's only into 2048 buckets)
  int wc = -1;                   // software write-combining: 1 on, 0 off (plain stores), -1 = heuristic
  int64_t small_n = 64;          // insertion sort at or below this size
  int64_t grain = 32768;         // at least this many keys per thread
  bool in_order = true;          // check first whether the input is already in order (input_order)
  int msd = -1;                  // MSD split: heuristic (-1), off (0), guarded at any size (1), forced (2)
  int msd_bits = 0;              // the split's digit for 32-bit keys: 8 (256 buckets, 2048 only where a sample
                                 // shows the top byte clusters the keys), 11 (2048), 0 = heuristic
};

struct SortStats {
  int passes = 0, skipped = 0, threads = 1, digit_bits = 0;
  int msd_bits = 0;  // the MSD split's digit width (0: no split)
  int hot_keys = 0;  // the MSD split's equality buckets (HotPlan)
  bool range_digit = false;  // the MSD split's digit spans the keys' central range (RangeDigit)
  bool piece_digit = false;  // the MSD split's digit cuts pieces of the span by their share (PieceDigit)
  bool log_digit = false;    // the MSD split's digit cuts the span by binades (LogDigit)
  bool lossy = false, small = false, wc = false, msd = false;
};

// ---------------------------------------------------------------------------------------------
// Small inputs: stable insertion sort of (encoded key, index), outputs gathered from the input
// (exact bits, so canonicalised floats come back unchanged).
// ---------------------------------------------------------------------------------------------
template <class U, Enc E>
void small_sort(const SortArgs& a, const Coder<U, E>& cd, U kmask) {
  const int64_t n = a.n;
  const U* in = static_cast<const U*>(a.keys);
  U kbuf[128];
  uint32_t ibuf[128];
  std::vector<U> kv;
  std::vector<uint32_t> iv;
  U* k = kbuf;
  uint32_t* ix = ibuf;
  if (n > 128) {
    kv.resize(n);
    iv.resize(n);
    k = kv.data();
    ix = iv.data();
  }
  for (int64_t i = 0; i < n; ++i) {
    U key = U(cd.enc(in[i]) & kmask);
    int64_t j = i;
    while (j > 0 && k[j - 1] > key) {  // strict: equal keys keep their order (stable)
      k[j] = k[j - 1];
      ix[j] = ix[j - 1];
      --j;
    }
    k[j] = key;
    ix[j] = (uint32_t)i;
  }
  U* ok = static_cast<U*>(a.out_keys);
  const char* pin = static_cast<const char*>(a.pay);
  char* pout = static_cast<char*>(a.out_pay);
  for (int64_t i = 0; i < n; ++i) {
    if (ok) ok[i] = in[ix[i]];
    if (a.out_idx) a.out_idx[i] = ix[i];
    if (pout) std::memcpy(pout + i * a.pay_size, pin + (int64_t)ix[i] * a.pay_size, a.pay_size);
  }
}

// ---------------------------------------------------------------------------------------------
// The scatter of one pass for one thread's slice [b, e) of the source.
//   PM: 0 keys only, 1 payload of type PT carried along, 2 indices (generated in the first pass,
//   32-bit in between, written as int64 by the last pass).
// ---------------------------------------------------------------------------------------------
struct PassCtx {
  int shift = 0;
  uint32_t mask = 0;
  // next non-trivial pass's digit, counted per destination slice while flushing (Onesweep-style
  // "histogram for free"); track_next=false when there is no next pass or only one thread.
  bool track_next = false;
  int next_shift = 0;
  uint32_t next_mask = 0;
  const int64_t* bounds = nullptr;  // T+1 slice bounds of the next pass
  int nslices = 1;
  size_t stride = 0;                // counters per slice (R)
  int64_t n = 0;
  bool nt = false;
  bool drop_keys = false;  // last pass of an argsort: only the indices leave
  bool shared = false;     // other threads scatter at the same time (their counters beside ours: OwnCounters)
};

static inline int slice_of(const PassCtx& c, int64_t x) {
  if (c.nslices <= 8) {  // few threads: a short scan beats a 64-bit division
    int s = 0;
    while (s + 1 < c.nslices && c.bounds[s + 1] <= x) ++s;
    return s;
  }
  int s = (int)((x * (int64_t)c.nslices) / c.n);
  while (s + 1 < c.nslices && c.bounds[s + 1] <= x) ++s;
  while (s > 0 && c.bounds[s] > x) --s;
  return s;
}

// Copies one whole 64-byte line with streaming stores (SSE2 is baseline x86-64).
static inline void line_store(void* dst, const void* src, size_t bytes, bool nt) {
#if PK_X86
  if (nt && ((uintptr_t)dst & 15) == 0) {
    const __m128i* s = static_cast<const __m128i*>(src);
    __m128i* d = static_cast<__m128i*>(dst);
    for (size_t i = 0; i < bytes / 16; ++i) _mm_stream_si128(d + i, _mm_load_si128(s + i));
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

// A scatter's running positions and next-digit counts, moved off the caller's shared vectors (run_passes
// keeps every thread's side by side) into a buffer of this thread's own while it runs, and back after:
// each is written once per key, and the neighbouring threads' lines in one vector are pulled across the
// cores (the split's counters had the same fault, see split_scatter). Measured on a 2-core Zen 2, LSD
// engine: 4M int16 keys + indices on 2 threads took 33 ms, one thread 28. (One buffer per counter type and
// thread: at most one OwnCounters of each type may be alive on a thread at a time.) Alone on the data
// (one thread: the segments' sorts) the counters stay where they are: the copies cost 3-10% on rows of
// 97-1024 keys.
template <class C>
struct OwnCounters {
  C* shared;
  size_t m;
  C* own;
  OwnCounters(C* shared_, size_t m_, bool copy_in, bool other_threads) : shared(shared_), m(m_) {
    if (!other_threads) {  // (copy_in false: the callers' shared counters start at zero too)
      own = shared;
      m = 0;  // publish() copies nothing
      return;
    }
    static thread_local std::vector<C> buf;
    if (buf.size() < m + 16) buf.resize(m + 16);
    own = buf.data() + ((64 - ((uintptr_t)buf.data() & 63)) & 63) / sizeof(C);
    if (copy_in) std::memcpy(own, shared, m * sizeof(C));
    else std::memset(own, 0, m * sizeof(C));
  }
  void publish() const { std::memcpy(shared, own, m * sizeof(C)); }
};

// Plain scatter (WC=false): every key goes straight to its destination. With 256 digits the 256 open
// destination lines (x2 with a payload) stay in L1, so the hardware combines the writes; measured on
// Zen 4 it beats the software write-combining below by ~1.5x per pass at 8-bit digits (the line
// bookkeeping and its flush branch cost more than they save). 2048 open lines do not fit L1: 11-bit
// digits need the write-combining lines.
template <class U, Enc E, class PT, int PM, bool FIRST, bool LAST>
void scatter_plain(const Coder<U, E>& cd, const PassCtx& pc, const void* src_keys, const void* src_pay,
                   U* __restrict dst_keys, void* dst_pay, int64_t b, int64_t e, int64_t* shared_pos,
                   uint32_t* shared_next) {
  const OwnCounters<int64_t> own_pos(shared_pos, (size_t)pc.mask + 1, true, pc.shared);
  const OwnCounters<uint32_t> own_next(shared_next, pc.track_next ? (size_t)pc.nslices * pc.stride : 0, false,
                                       pc.shared);
  int64_t* __restrict pos = own_pos.own;
  uint32_t* __restrict next_hist = own_next.own;
  using PI = std::conditional_t<PM == 2, uint32_t, PT>;
  using PO = std::conditional_t<PM == 2 && LAST, int64_t, PI>;
  const U* __restrict sk = static_cast<const U*>(src_keys);
  const PI* __restrict sp = static_cast<const PI*>(src_pay);
  PO* __restrict dp = static_cast<PO*>(dst_pay);
  const int shift = pc.shift;
  const uint32_t mask = pc.mask;
  const bool keys_out = !LAST || !pc.drop_keys;
  auto body = [&](auto track_tag, auto keys_tag) {
    constexpr bool TRACK = decltype(track_tag)::value, KEYS = decltype(keys_tag)::value;
    const int ns = pc.nslices;
    const int64_t* bd = pc.bounds;
    for (int64_t i = b; i < e; ++i) {
      pk::prefetch_stream(sk, i);
      if constexpr (PM != 0 && !(PM == 2 && FIRST)) pk::prefetch_stream(sp, i);  // the payload stream too
      const U k = FIRST ? cd.enc(sk[i]) : sk[i];
      const uint32_t d = (uint32_t)(k >> shift) & mask;
      const int64_t p = pos[d]++;
      if constexpr (KEYS) dst_keys[p] = LAST ? cd.dec(k) : k;
      if constexpr (PM == 2 && FIRST) dp[p] = (PO)i;
      else if constexpr (PM != 0) dp[p] = (PO)sp[i];
      if constexpr (TRACK) {  // next pass's digit, counted by the destination slice (see PassCtx)
        int s = 0;
        while (s + 1 < ns && bd[s + 1] <= p) ++s;
        ++next_hist[(size_t)s * pc.stride + ((uint32_t)(k >> pc.next_shift) & pc.next_mask)];
      }
    }
  };
  using T_ = std::true_type;
  using F_ = std::false_type;
  if (LAST) {
    if (keys_out) body(F_(), T_()); else body(F_(), F_());
  } else {
    if (pc.track_next) body(T_(), T_()); else body(F_(), T_());
  }
  own_pos.publish();
  if (pc.track_next) own_next.publish();
}

template <class U, Enc E, class PT, int PM, bool FIRST, bool LAST>
void scatter_slice(const Coder<U, E>& cd_ref, const PassCtx& pc, const void* src_keys,
                                             const void* src_pay, U* dst_keys, void* dst_pay, int64_t b, int64_t e,
                                             int64_t* shared_pos, const int64_t* lo,
                                             uint32_t* shared_next /* [nslices][R] or null */) {
  const OwnCounters<int64_t> own_pos(shared_pos, (size_t)pc.mask + 1, true, pc.shared);
  const OwnCounters<uint32_t> own_next(shared_next, pc.track_next ? (size_t)pc.nslices * pc.stride : 0, false,
                                       pc.shared);
  int64_t* __restrict pos = own_pos.own;
  uint32_t* __restrict next_hist = own_next.own;
  // A local copy of the codec and restrict pointers: the line buffers are written through U* and the
  // compiler would otherwise reload the codec's masks after every store (and spill around them).
  const Coder<U, E> cd = cd_ref;
  constexpr int L = 64 / sizeof(U);  // keys per write-combining line (one cache line)
  using PI = std::conditional_t<PM == 2, uint32_t, PT>;                  // payload in the source
  using PO = std::conditional_t<PM == 2 && LAST, int64_t, PI>;          // payload in the destination
  constexpr bool HAS_PAY = PM != 0;
  const uint32_t R = pc.mask + 1;
  // Line buffers: R lines of L keys (+ R lines of L payloads), 64-byte aligned, kept per thread.
  static thread_local std::vector<unsigned char> lines;
  const size_t kbytes = (size_t)R * L * sizeof(U), pbytes = HAS_PAY ? (size_t)R * L * sizeof(PO) : 0;
  // The payload lines start SKEW bytes past a multiple of 4 KiB from the key lines, so a digit's key line
  // and payload line never share an L1 set (nor alias 4 KiB apart).
  if (lines.size() < kbytes + SKEW + pbytes + 128) lines.resize(kbytes + SKEW + pbytes + 128);
  unsigned char* lb = lines.data() + ((64 - ((uintptr_t)lines.data() & 63)) & 63);
  U* __restrict kb = reinterpret_cast<U*>(lb);
  PO* __restrict pb = reinterpret_cast<PO*>(lb + kbytes + SKEW);
  const U* __restrict sk = static_cast<const U*>(src_keys);
  const PI* __restrict sp = static_cast<const PI*>(src_pay);
  PO* dp = static_cast<PO*>(dst_pay);
  const int shift = pc.shift;
  const uint32_t mask = pc.mask;

  auto count_next = [&](int64_t from, int64_t to, const U* keys) {  // keys of positions [from, to)
    if (!pc.track_next) return;
    int s0 = slice_of(pc, from), s1 = slice_of(pc, to - 1);
    if (s0 == s1) {
      uint32_t* h = next_hist + (size_t)s0 * pc.stride;
      for (int64_t x = from; x < to; ++x) ++h[(uint32_t)(keys[x - from] >> pc.next_shift) & pc.next_mask];
    } else {
      for (int64_t x = from; x < to; ++x)
        ++next_hist[(size_t)slice_of(pc, x) * pc.stride +
                    ((uint32_t)(keys[x - from] >> pc.next_shift) & pc.next_mask)];
    }
  };

  for (int64_t i = b; i < e; ++i) {
    pk::prefetch_stream(sk, i);
    // the payload stream too: without, its loads stalled the loop (27% of 4M float64 + indices' samples)
    if constexpr (HAS_PAY && !(PM == 2 && FIRST)) pk::prefetch_stream(sp, i);
    U k = FIRST ? cd.enc(sk[i]) : sk[i];
    const uint32_t d = (uint32_t)(k >> shift) & mask;
    const int64_t p = pos[d]++;
    const uint32_t s = (uint32_t)p & (L - 1);
    if (!LAST || !pc.drop_keys) kb[d * L + s] = LAST ? cd.dec(k) : k;
    if constexpr (HAS_PAY) {
      if constexpr (PM == 2 && FIRST) pb[d * L + s] = (PO)i;
      else pb[d * L + s] = (PO)sp[i];
    }
    if (s == L - 1) {  // the line is complete: write it out
      const int64_t s0 = p - (L - 1);
      if (PK_LIKELY(s0 >= lo[d])) {
        if (!LAST || !pc.drop_keys) line_store(dst_keys + s0, kb + d * L, sizeof(U) * L, pc.nt);
        if constexpr (HAS_PAY) line_store(dp + s0, pb + d * L, sizeof(PO) * L, pc.nt);
        if constexpr (!LAST) count_next(s0, p + 1, kb + d * L);
      } else {  // first line of this digit's run starts inside the line: copy only our part
        const int64_t off = lo[d] - s0;
        if (!LAST || !pc.drop_keys) std::memcpy(dst_keys + lo[d], kb + d * L + off, sizeof(U) * (L - off));
        if constexpr (HAS_PAY) std::memcpy(dp + lo[d], pb + d * L + off, sizeof(PO) * (L - off));
        if constexpr (!LAST) count_next(lo[d], p + 1, kb + d * L + off);
      }
    }
  }
  // Partial last lines.
  for (uint32_t d = 0; d < R; ++d) {
    const int64_t end = pos[d];
    if (end <= lo[d]) continue;
    const int64_t line0 = end & ~int64_t(L - 1);
    if (line0 == end) continue;  // ended on a line boundary: already written
    const int64_t from = std::max(line0, lo[d]);
    const int64_t off = from - line0;
    if (!LAST || !pc.drop_keys) std::memcpy(dst_keys + from, kb + d * L + off, sizeof(U) * (end - from));
    if constexpr (HAS_PAY) std::memcpy(dp + from, pb + d * L + off, sizeof(PO) * (end - from));
    if constexpr (!LAST) count_next(from, end, kb + d * L + off);
  }
  own_pos.publish();
  if (pc.track_next) own_next.publish();
#if PK_X86
  if (pc.nt) _mm_sfence();  // streaming stores are weakly ordered: publish before the next pass
#endif
}

// ---------------------------------------------------------------------------------------------
// The engine: histogram read, plan, scatters.
// ---------------------------------------------------------------------------------------------
struct Pass {
  int shift, bits;
};

template <class U, Enc E>
struct Engine {
  const SortArgs& a;
  Coder<U, E> cd;
  SortStats& st;
  std::vector<Pass> passes;
  int T = 1;
  int R = 256;
  std::vector<uint32_t> hist;  // [T][npasses][R]
  std::vector<int64_t> ghist;  // [npasses][R]
  bool lossy = false;
  bool wc = true;              // write-combining lines (scatter_slice) or plain stores (scatter_plain)

  Engine(const SortArgs& args, const Coder<U, E>& c, SortStats& s) : a(args), cd(c), st(s) {}

  void histogram(int db) {
    const int np = (int)passes.size();
    R = 1 << db;
    hist.assign((size_t)T * np * R, 0);
    std::vector<char> lossy_t(T, 0);
    const U* in = static_cast<const U*>(a.keys);
    const int64_t n = a.n;
    pk::parallel_threads(T, [&](int t) {
      const int64_t b = n * t / T, e = n * (t + 1) / T;
      const OwnCounters<uint32_t> own(hist.data() + (size_t)t * np * R, (size_t)np * R, false, T > 1);
      uint32_t* __restrict h = own.own;
      bool ls = false;
      int sh[64];
      uint32_t mk[64];
      for (int j = 0; j < np; ++j) { sh[j] = passes[j].shift; mk[j] = (1u << passes[j].bits) - 1; }
      // One loop per pass count (unrolled over the passes): a loop over a runtime pass count was 2-3x
      // slower for 8-bit digits of 32-bit keys (4 counters per key).
      pk::with_small_int<1, 8>(np, [&](auto np_tag) {
        constexpr int NP = decltype(np_tag)::value;  // 0: the pass count at run time
        const int passes_n = NP > 0 ? NP : np;
        for (int64_t i = b; i < e; ++i) {
          pk::prefetch_stream(in, i);
          U x = in[i];
          if constexpr (E == Enc::Float) ls |= cd.lossy(x);
          U k = cd.enc(x);
#pragma GCC unroll 8
          for (int j = 0; j < passes_n; ++j) ++h[j * R + ((uint32_t)(k >> sh[j]) & mk[j])];
        }
      });
      own.publish();
      lossy_t[t] = ls;
    });
    for (int t = 0; t < T; ++t) lossy |= lossy_t[t] != 0;
    ghist.assign((size_t)np * R, 0);
    for (int t = 0; t < T; ++t)
      for (size_t j = 0; j < (size_t)np * R; ++j) ghist[j] += hist[(size_t)t * np * R + j];
  }

  template <class PT, int PM>
  void run_passes(const std::vector<int>& live, U* out_keys, void* out_pay_final, bool drop_keys = false) {
    const int64_t n = a.n;
    const int Q = (int)live.size();
    const int np = (int)passes.size();
    Scratch& scr = thread_scratch();
    using PI = std::conditional_t<PM == 2, uint32_t, PT>;
    // Scratch layout: keys (n U), payload ping (n PI), payload pong (n PI, only for PM 2).
    size_t kbytes = ((size_t)n * sizeof(U) + 63) & ~size_t(63);
    size_t pbytes = PM ? (((size_t)n * sizeof(PI) + 63) & ~size_t(63)) : 0;
    // Each array starts SKEW bytes past a 4 KiB multiple from the previous one: with keys and payloads
    // at equal offsets of 4 KiB-aligned arrays, the open destination lines of one digit would always
    // share an L1 set (a precaution: no difference was measurable on the shared test machine).
    char* base = scr.get(kbytes + 2 * pbytes + 3 * SKEW + 64);
    U* kscr = reinterpret_cast<U*>(base);
    PI* pscr = reinterpret_cast<PI*>(base + kbytes + SKEW);
    PI* pscr2 = reinterpret_cast<PI*>(base + kbytes + pbytes + 2 * SKEW);

    // per-thread counts of the current pass's digit over the source slices
    std::vector<int64_t> cnt((size_t)T * R, 0);
    for (int t = 0; t < T; ++t)
      for (int d = 0; d < R; ++d) cnt[(size_t)t * R + d] = hist[((size_t)t * np + live[0]) * R + d];
    std::vector<int64_t> bounds(T + 1);
    for (int t = 0; t <= T; ++t) bounds[t] = n * t / T;
    std::vector<uint32_t> nh((size_t)T * T * R);
    std::vector<int64_t> pos((size_t)T * R), lo((size_t)T * R);

    const void* src_k = a.keys;
    const void* src_p = (PM == 1) ? a.pay : nullptr;
    // Software write-combining for wide digits (or when asked); plain stores otherwise (scatter_plain).
    st.wc = wc;
    for (int q = 0; q < Q; ++q) {
      const Pass& ps = passes[live[q]];
      const bool first = q == 0, last = q == Q - 1;
      // Destination: the caller's output for the last pass; ping-pong so that holds.
      const bool to_out = ((Q - 1 - q) % 2) == 0;
      U* dk = to_out ? out_keys : kscr;
      void* dp = nullptr;
      if constexpr (PM == 1) dp = to_out ? out_pay_final : (void*)pscr;
      if constexpr (PM == 2) dp = last ? out_pay_final : (to_out ? (void*)pscr2 : (void*)pscr);
      // Offsets: digit-major prefix over (digit, thread): stable.
      int64_t run = 0;
      for (int d = 0; d < R; ++d) {
        for (int t = 0; t < T; ++t) {
          pos[(size_t)t * R + d] = lo[(size_t)t * R + d] = run;
          run += cnt[(size_t)t * R + d];
        }
      }
      PassCtx pc;
      pc.shift = ps.shift;
      pc.mask = (1u << ps.bits) - 1;
      pc.n = n;
      pc.nt = a.nt_stores != 0 && n >= (int64_t(1) << 18);  // streaming only pays for out-of-cache data
      pc.track_next = !last && T > 1;
      pc.drop_keys = last && drop_keys;
      pc.shared = T > 1;
      if (!last) {
        const Pass& nx = passes[live[q + 1]];
        pc.next_shift = nx.shift;
        pc.next_mask = (1u << nx.bits) - 1;
        pc.bounds = bounds.data();
        pc.nslices = T;
        pc.stride = (size_t)R;
      }
      if (pc.track_next) std::fill(nh.begin(), nh.end(), 0u);
      // Digits narrower than R (last digit of a bit range) still index R-sized tables: fine.
      pk::parallel_threads(T, [&](int t) {
        const int64_t b = bounds[t], e = bounds[t + 1];
        int64_t* pp = pos.data() + (size_t)t * R;
        const int64_t* ll = lo.data() + (size_t)t * R;
        uint32_t* h = pc.track_next ? nh.data() + (size_t)t * T * R : nullptr;
#define PK_SCATTER(F, L_)                                                                  \
  (wc ? scatter_slice<U, E, PT, PM, F, L_>(cd, pc, src_k, src_p, dk, dp, b, e, pp, ll, h) \
      : scatter_plain<U, E, PT, PM, F, L_>(cd, pc, src_k, src_p, dk, dp, b, e, pp, h))
        if (first && last) PK_SCATTER(true, true);
        else if (first) PK_SCATTER(true, false);
        else if (last) PK_SCATTER(false, true);
        else PK_SCATTER(false, false);
#undef PK_SCATTER
      });
      if (!last) {
        const int nd = live[q + 1];
        if (T > 1) {
          for (int s = 0; s < T; ++s)
            for (int d = 0; d < R; ++d) {
              int64_t c = 0;
              for (int t = 0; t < T; ++t) c += nh[((size_t)t * T + s) * R + d];
              cnt[(size_t)s * R + d] = c;
            }
        } else {
          for (int d = 0; d < R; ++d) cnt[d] = ghist[(size_t)nd * R + d];
        }
      }
      src_k = dk;
      src_p = dp;
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Keys that fit 32 bits once their minimum is taken off (all 32-bit keys; 64-bit keys spanning less
// than 2^32): an MSD split, then LSD inside the cache (config "msd"; the default from 32K keys).
//   1. One read of the keys finds their min and max (and lossy floats); for 32-bit keys that a sample
//      shows spread by their top byte (random keys) it also counts that byte, the digit. Otherwise the
//      digit is the top byte of v = key - min (v has w = bit width of max - min bits), counted in a
//      second read: small ints, ids, timestamps spread over the buckets too.
//   2. One stable scatter into 256 buckets by the digit (2048 where the autotuner chose them, or for
//      clustered ones: an 11-bit digit), of records {v} (keys only) or {v, what the key carries: its
//      index or a 4-byte payload} (8 bytes): plain stores into 256 buckets, write-combining lines
//      flushed with streaming stores into 2048 (split_scatter).
//   3. Each bucket (~n/256 records: ~128 KiB at 4M keys, inside one core's L2; up to 4 MiB, from L3:
//      see bucket_ok) is sorted on v's w - MB bits below the digit by LSD passes that never leave the
//      cache (bucket_plan: 3 x 8 or 2 x 12 for random 32-bit keys below 256 buckets, 11 + 10 below 2048;
//      trivial passes skipped), then written to the caller's outputs in order (key = min + v). Buckets
//      go to threads dynamically.
//   DRAM traffic for int32 values + int64 indices: 4 (count) + 4 + 8 (split) + 8 + 4 + 8 (bucket in,
//   outputs out) = 36 bytes per key, against 48 for three 11-bit LSD passes, and only the split scatters
//   into DRAM-resident streams; 64-bit keys of a small span travel as 8-byte records instead of 16.
//   Partition to cache-resident parts first, then sort each in cache: Polychroniou & Ross, "A
//   comprehensive study of main-memory partitioning and its application to large-scale comparison- and
//   radix-sort", SIGMOD 2014. Measured 2x the pure LSD engine at 4M int32 + indices, 3x for int64 keys
//   below 2^31.
//   64-bit keys spanning 2^32 or more take the wide form (msd_wide_sort): 16-byte records, and inside
//   each bucket a second split that leaves random keys in parts of ~2 (insertion-sorted) instead of 5
//   LSD passes over the 56 bits below the digit: ~2x the LSD engine at 4M random int64 + indices.
// ---------------------------------------------------------------------------------------------
// Heuristic (msd = -1) bounds: from MSD_MIN_N keys the split runs on every thread once each has MSD_GRAIN
// keys; below MSD_CACHED_N keys only where that is at least two threads (below 256K keys the LSD engine
// runs on one thread, the default grain: with a barrier per pass a second thread did not pay there; the
// split's buckets go to threads without one, and inside the caches they sort in L1). Measured on a 2-core
// Zen 4 (ns per key, LSD engine / split on 2 threads; int32 keys only, float32 + indices, random int64 +
// indices): 32K 10.5/5.9, 9.5/6.3, 14.6/10.0; 128K 6.4/5.4, 18.3/6.9, 24.5/9.4; 200K 6.2/5.2, 12.3/7.5,
// 18.7/8.9. On one thread the split lost inside the caches for some keys (review: random int32 keys at
// 32-40K 1.5-1.6x slower, a 20-bit span at 200K 1.4x), and at 16-32K keys (on one thread, by the grain)
// with indices 1.4-2x. Uniform random int32 keys (the top byte the digit, buckets of n / 256) on 2 threads,
// split / LSD engine time, keys only and with indices: 32K 1.07-1.10 and 0.95-0.98, 48K 0.85-0.89 and
// 0.83, 64K 0.75 and 0.72, 100K 0.62-0.67 and 0.62-0.66, 128K 0.57 and 0.58 (so they split too; a rule
// that kept them in the LSD engine below 128K came from timing the split on one thread).
static constexpr int64_t MSD_MIN_N = int64_t(1) << 15;
static constexpr int64_t MSD_GRAIN = int64_t(1) << 14;
static constexpr int64_t MSD_CACHED_N = int64_t(1) << 18;  // below: narrow spans take the LSD engine
// When the split is worth it (bucket_ok): a heuristic against skew, not a cache size. Measured on a
// 2-core EPYC (1 MiB L2 per core, 32 MiB L3), best of 5 interleaved runs against the LSD engine:
//  - random keys: buckets well past L2 still win, read once from DRAM and then sorted from L3 (narrow
//    path, int32 + indices: 2.3x at 24M keys, 1.7x at 48M, 2.1x at 128M where buckets are 4 MiB; wide
//    path, int64 + indices: 1.8x at 48M, 1.9x at 128M with 8 MiB buckets), up to the byte budgets below;
//  - a bucket holding most of the keys, all one value (all equal but 1 in 1024): the split moved them for
//    nothing and the LSD engine, which skips passes whose digit never varies, wins (0.85x at 512K keys,
//    0.26x at 8M). So a bucket past L2 size may hold more than 1/MSD_MIN_FANOUT of the keys only when
//    the sampled keys in it differ (and one thread sorting it leaves the others work): randn floats
//    (27% of float32 keys in one top byte, 50% of float64) sort 1.2-1.8x faster split at 512K keys; a
//    quarter of the keys one value and the rest random but sharing its bucket, 1.5x at 1M and 4M. Past
//    the byte budgets (randn from ~2-4M keys) the gain measured 0.95-1.25x, within noise, and the LSD
//    engine keeps them. (Since, a value that fills much of a bucket gets a bucket of its own where that
//    is what bucket_ok refused, from HOT_MIN_N keys: see HotPlan. The one value of most keys is then
//    copied, not sorted: all equal but 1 in 1024 at 512K keys 1.36 ms LSD engine -> 1.26 split.)
static constexpr size_t MSD_MAX_BUCKET_BYTES = size_t(4) << 20;   // narrow path: 4- or 8-byte records
static constexpr size_t WIDE_MAX_BUCKET_BYTES = size_t(8) << 20;  // wide path: 8- or 16-byte records
static constexpr size_t L2_BUCKET_BYTES = size_t(768) << 10;
static constexpr int MSD_MIN_FANOUT = 8;
// The strided sample's fullest bucket overstates an even spread about 2x (the largest of 256 counts of
// ~16), so a sample only refuses (saving the exact count's read) at SAMPLE_SLACK times the limits; the
// exact counts decide the rest. (With no slack, 8M random int64 keys and 16M int32 keys were refused.)
static constexpr double SAMPLE_SLACK = 2.0;

// Whether n keys whose biggest bucket holds `biggest` records of `bytes` each take the MSD split on T
// threads; varied: the sampled keys of the sample's fullest bucket differ (see sample_buckets). A varied
// big bucket must also leave the threads work: one thread sorts it, so it may hold at most twice a
// thread's share (any share on 2 threads, half the keys on 4; from 16 threads the 1/8 rule decides).
static inline bool bucket_ok(double biggest, size_t bytes, int64_t n, size_t budget, bool varied, int T) {
  const double b = biggest * (double)bytes;
  if (b > (double)budget) return false;
  if (b <= (double)L2_BUCKET_BYTES || biggest * MSD_MIN_FANOUT <= (double)n) return true;
  return varied && biggest * T <= 2.0 * (double)n;
}

// The MSD split's digit: the top MB bits of v's w bits; each bucket is then sorted on the w - MB below.
// MB = MSD_BITS (256 buckets) first. 32-bit keys spanning the whole range that the top byte clusters past
// the budgets while their top 11 bits spread them (randn floats: a quarter of them share one top byte),
// as the 256-bucket attempt's 4096-key sample shows before any read, take MSD_BITS_CLUSTERED (2048
// buckets: the top byte and three bits more of the mantissa or value) instead of the LSD engine: 4M
// randn float32 keys + indices 37 -> 27 ms (2 threads). Uniform keys keep 256 buckets at every size (see
// below). Keys refused after the counting read are not retried (a second read).
static constexpr int MSD_BITS = 8;
static constexpr int MSD_BITS_CLUSTERED = 11;
static constexpr int MSD_BUCKETS = 1 << MSD_BITS;
// Uniform 32-bit keys: 256 buckets, not 2048, however many keys. On a 2-core Zen 2 2048 buckets won
// from 8M keys (split with streaming stores both ways: 16M uint32 keys 93.0 / 67.2 ms, int32 + indices
// 106.9 / 94.9), but with the split's plain stores into 256 buckets (see split_scatter) 256 win on the
// 2-core Zen 4 (256 / 2048 buckets, same process, 2 threads, ms): uint32 keys 16M 44.0 / 59.8, 32M 87.7 /
// 105.4, 64M 165 / 204; int32 + indices 16M 53.6 / 67.6, 32M 106 / 134, 64M 206 / 285. The autotuner
// tries both (config msd_bits).
// from here passes of up to bucket_max_digit bits; smaller buckets (skewed keys, small inputs) take three
// of lb / 3 bits
static constexpr int64_t BIG_BUCKET = 2048;
// The widest in-bucket digit. A scatter pass over 64K records in L2, ns per record (Xeon, Emerald
// Rapids VM, one thread): 1.5-1.7 at 6-9 bits, 2.3 at 10, 2.9 at 11, 4.1 at 12 - past ~1K digits the
// destination lines no longer fit the 48 KiB L1 and every record's store misses it. So 24 bits below
// the split take three passes of 8 bits, not two of 12, in such buckets: the bucket phase of 16M random
// uint32 keys 124 -> 103 ms on one thread (paired runs, one process).
// A bucket of at most SMALL_BUCKET_BYTES is another matter: its records and their copy stay inside L1
// and L2 whatever the digit, and fewer passes win. Hist + passes over buckets read from DRAM, ns per
// 4-byte key (Zen 2 EPYC, one thread): 2K keys (11,10) bits 2.95; 4K (10,10) 2.55 vs (7,7,6) 4.16, and
// (12,12) 3.73 vs (8,8,8) 3.45 (two 16 KiB counter arrays per 4K keys cost more than the pass saves);
// 8K (11,10) 2.84 vs (7,7,7) 4.28, (12,12) 3.67 vs (8,8,8) 4.02; 16K (12,12) 3.77 vs (8,8,8) 4.35.
static constexpr int BUCKET_MAX_DIGIT = 10;
static constexpr size_t SMALL_BUCKET_BYTES = size_t(96) << 10;
static inline int bucket_max_digit(int64_t m, size_t rec_bytes) {
  if ((size_t)m * rec_bytes > SMALL_BUCKET_BYTES) return BUCKET_MAX_DIGIT;
  return m >= 6144 ? 12 : 11;  // (12, 12) loses at 4K records and wins at 8K: between them
}

// The in-bucket passes' counters (pass j's at hist + off[j], digits 0..mk[j]) become exclusive prefix
// sums in place; live[] lists the passes whose digit is not the same for all m records (the others
// would move nothing). Returns how many are live.
template <class M>
static int scan_passes(uint32_t* hist, const int* off, const M* mk, int P, int64_t m, int* live) {
  int nl = 0;
  for (int j = 0; j < P; ++j) {
    uint32_t* h = hist + off[j];
    bool trivial = false;
    uint32_t run = 0;
    for (uint64_t d = 0; d <= (uint64_t)mk[j]; ++d) {
      const uint32_t c = h[d];
      trivial |= c == (uint32_t)m;
      h[d] = run;
      run += c;
    }
    if (!trivial) live[nl++] = j;
  }
  return nl;
}

// Records to prefetch while a bucket sorts: the next bucket this thread sorts (see for_each_bucket).
template <class Rec>
struct Ahead {
  const Rec* p;
  int64_t m;
};

// One stable in-cache scatter of m records from s to d by the digit (value(x) >> SH) & MK, its counters
// h already exclusive prefix sums. SH < 0: the shift and mask come at run time (sh, mk: at most 12 bits,
// also for the wide path's 64-bit values). One line of
// pf's records is prefetched per line of records scattered (up to pf.m of them).
template <int SH, uint32_t MK, class Rec, class Value>
static inline void scatter_pass(const Rec* __restrict s, Rec* __restrict d, int64_t m, uint32_t* __restrict h,
                                int sh, uint32_t mk, Value value, Ahead<Rec> pf = {nullptr, 0}) {
  auto one = [&](int64_t i) __attribute__((always_inline)) {
    const Rec x = s[i];
    d[h[(value(x) >> (SH >= 0 ? SH : sh)) & (SH >= 0 ? MK : mk)]++] = x;
  };
  constexpr int64_t PL = 64 / sizeof(Rec) > 0 ? 64 / sizeof(Rec) : 1;  // records per line
  int64_t i = 0;
  const int64_t lined = std::min(m, pf.m) & ~(PL - 1);
  for (; i < lined; i += PL) {
    PK_PREFETCH_R(pf.p + i);
    for (int64_t k = 0; k < PL; ++k) one(i + k);
  }
  for (; i < m; ++i) one(i);
}

// The live passes (see scan_passes) as stable scatters between src and tmp, in cache; value(x) is the
// record's sort value, pass j's digit its bits [sh[j], sh[j] + width) under mask mk[j]. Returns where
// the sorted records ended up. (The wide path's plans; the narrow path's have constant widths, see
// bucket_lsd_n.)
template <class Rec, class M, class Value>
static const Rec* run_live_passes(Rec* __restrict src, Rec* __restrict tmp, int64_t m, uint32_t* __restrict hist,
                                  const int* off, const int* sh, const M* mk, const int* live, int nl, Value value) {
  Rec* s = src;
  Rec* d = tmp;
  for (int q = 0; q < nl; ++q) {
    scatter_pass<-1, 0>(s, d, m, hist + off[live[q]], sh[live[q]], mk[live[q]], value);
    std::swap(s, d);
  }
  return s;
}

// Sorts the m records of one bucket by the low bits of their 32-bit value v = (uint32)(record >> KSHIFT)
// (stable; NP passes of wid[0..NP) bits from bit 0 up), ping-ponging between src and tmp, and hands
// each record with its final position to out(q, record). Passes whose digit is the same for the whole
// bucket are skipped. hist: the caller's 3 x 4096 counters (no thread-local lookup in the loops).
// Returns the passes that ran.
// src is not __restrict: out() may write the caller's outputs over the records it reads (msd_hybrid_sort
// keeps its records in an output array of their size).
// W0, W1, W2 > 0: the plan's widths as constants (the plans of random keys, see bucket_lsd), so every
// shift, mask and counter offset in the counting loop and the scatters is an immediate; 0: from wid at
// run time. x86-64's shift by a register (`shr %cl`) is 2-3 uops on Intel against 1 for an immediate, and
// constant offsets fold into the addressing, on the few uops per record of an in-cache scatter: constant
// shifts took 4M int32 keys + indices 22.0 -> 19.7 ms (2 threads); constant widths, a standalone
// hist + (11, 10) passes over 8K-key buckets 3.91 -> 2.88 ns per key, and the bucket phase of 16M
// uint32 keys 64 -> 61 ms (one thread, Zen 2).
template <int NP, int W0, int W1, int W2, class Rec, int KSHIFT, class Out>
static int bucket_lsd_n(Rec* src, Rec* __restrict tmp, int64_t m, uint32_t* __restrict hist,
                        const int* wid, Ahead<Rec> next, Out&& out_ref) {
  // a local copy: through the reference, the closure's captures (output pointers, the key base) were
  // reloaded after every output store, which may alias them
  const std::decay_t<Out> out = out_ref;
  constexpr bool CW = W0 > 0;
  static_assert(!CW || ((NP < 2 || W1 > 0) && (NP < 3 || W2 > 0)), "a constant width for every pass");
  constexpr int CSH[3] = {0, W0, W0 + W1};
  constexpr uint32_t CMK[3] = {(1u << W0) - 1, (1u << W1) - 1, (1u << W2) - 1};
  constexpr int COFF[4] = {0, 1 << W0, (1 << W0) + (1 << W1), (1 << W0) + (1 << W1) + (1 << W2)};
  const int w[3] = {CW ? W0 : wid[0], CW ? W1 : NP > 1 ? wid[1] : 0, CW ? W2 : NP > 2 ? wid[2] : 0};
  int sh[3] = {0, 0, 0}, off[4] = {0, 0, 0, 0};
  uint32_t mk[3] = {0, 0, 0};
  for (int j = 0; j < NP; ++j) {
    sh[j] = j ? sh[j - 1] + w[j - 1] : 0;
    mk[j] = (1u << w[j]) - 1;
    off[j + 1] = off[j] + (1 << w[j]);
  }
  std::memset(hist, 0, sizeof(uint32_t) * off[NP]);
  for (int64_t i = 0; i < m; ++i) {
    pk::prefetch_stream(src, i);  // the bucket's first read comes from DRAM
    const uint32_t k = (uint32_t)(src[i] >> KSHIFT);
    if constexpr (CW) {
      ++hist[k & CMK[0]];
      if constexpr (NP > 1) ++hist[COFF[1] + ((k >> CSH[1]) & CMK[1])];
      if constexpr (NP > 2) ++hist[COFF[2] + ((k >> CSH[2]) & CMK[2])];
    } else {
      ++hist[k & mk[0]];
      if constexpr (NP > 1) ++hist[off[1] + ((k >> sh[1]) & mk[1])];
      if constexpr (NP > 2) ++hist[off[2] + ((k >> sh[2]) & mk[2])];
    }
  }
  int live[NP];
  const int nl = scan_passes(hist, off, mk, NP, m, live);
  if (nl == 0) {
    for (int64_t i = 0; i < m; ++i) out(i, src[i]);
    return 0;
  }
  bool is_live[3] = {false, false, false};
  for (int q = 0; q < nl; ++q) is_live[live[q]] = true;
  Rec* s = src;
  Rec* d = tmp;
  auto value = [](Rec x) { return (uint32_t)(x >> KSHIFT); };
  // the next bucket's records are prefetched during the first pass that runs, when the buckets are past
  // SMALL_BUCKET_BYTES: 4M int32 keys + indices (128 KiB buckets) 24.2 -> 20.1 ms on 2 threads; keys only
  // in buckets of 32-64 KiB lost 2-3% with it (Zen 2)
  bool ahead = next.m > 0 && (size_t)m * sizeof(Rec) > SMALL_BUCKET_BYTES;
  auto pass = [&](auto j_tag) __attribute__((always_inline)) {
    constexpr int J = decltype(j_tag)::value;
    if (!is_live[J]) return;
    const Ahead<Rec> pf = ahead ? next : Ahead<Rec>{nullptr, 0};
    ahead = false;
    if constexpr (CW) scatter_pass<CSH[J], CMK[J]>(s, d, m, hist + COFF[J], 0, 0, value, pf);
    else scatter_pass<-1, 0>(s, d, m, hist + off[J], sh[J], mk[J], value, pf);
    std::swap(s, d);
  };
  pass(std::integral_constant<int, 0>());
  if constexpr (NP > 1) pass(std::integral_constant<int, 1>());
  if constexpr (NP > 2) pass(std::integral_constant<int, 2>());
  // the outputs are written in order (a last scatter straight into them measured ~20% slower)
  for (int64_t i = 0; i < m; ++i) out(i, s[i]);
  return nl;
}

// The in-bucket plan for a bucket of m records of rec_bytes each and lb bits: its pass count (0-3) and
// widths.
static inline int bucket_plan(int64_t m, size_t rec_bytes, int lb, int wid[3]) {
  if (lb <= 0) return 0;
  const int maxd = bucket_max_digit(m, rec_bytes);
  if (lb <= maxd) {
    wid[0] = lb;
    return 1;
  }
  // passes of up to maxd bits (lb <= 24: at most three) once a bucket has a few thousand records to
  // pay for the counters; smaller buckets (skewed keys, small inputs) take three passes. At most three in
  // any case: the range digit's outlier buckets sort all 32 bits of v (three of <= 11 bits).
  const int np = std::min(3, m >= BIG_BUCKET ? (lb + maxd - 1) / maxd : 3);
  for (int j = 0; j < np; ++j) wid[j] = lb / np + (j < lb % np ? 1 : 0);
  return np;
}

template <class Rec, int KSHIFT, class Out>
static int bucket_lsd(Rec* src, Rec* tmp, int64_t m, int lb, uint32_t* hist, Ahead<Rec> next, Out&& out) {
  int wid[3];
  switch (bucket_plan(m, sizeof(Rec), lb, wid)) {
    case 0:
      for (int64_t i = 0; i < m; ++i) out(i, src[i]);
      return 0;
    case 1: return bucket_lsd_n<1, 0, 0, 0, Rec, KSHIFT>(src, tmp, m, hist, wid, next, out);
    case 2:  // random 32-bit keys: (11, 10) below an 11-bit split, (12, 12) below an 8-bit one
      if (wid[0] == 11 && wid[1] == 10) return bucket_lsd_n<2, 11, 10, 0, Rec, KSHIFT>(src, tmp, m, hist, wid, next, out);
      if (wid[0] == 12 && wid[1] == 12) return bucket_lsd_n<2, 12, 12, 0, Rec, KSHIFT>(src, tmp, m, hist, wid, next, out);
      return bucket_lsd_n<2, 0, 0, 0, Rec, KSHIFT>(src, tmp, m, hist, wid, next, out);
    default:
      if (wid[0] == 8 && wid[1] == 8 && wid[2] == 8) return bucket_lsd_n<3, 8, 8, 8, Rec, KSHIFT>(src, tmp, m, hist, wid, next, out);
      return bucket_lsd_n<3, 0, 0, 0, Rec, KSHIFT>(src, tmp, m, hist, wid, next, out);
  }
}

// In-bucket LSD for the wide path (64-bit v): like bucket_lsd_n, with up to 7 passes of <= 12 bits
// (<= 8 for small buckets) over the lb low bits of v. Rec is uint64_t (keys only) or Wide.
struct Wide {
  uint64_t v;  // key - min
  uint64_t p;  // the index (n < 2^32) or a 4- or 8-byte payload
};
static constexpr int WIDE_MAX_PASSES = 7;
static inline uint64_t v_of(uint64_t r) { return r; }
static inline uint64_t v_of(const Wide& r) { return r.v; }

// src is not __restrict: out() may write over the records it reads (bucket_wide's parts, and outputs
// that hold the records, as in bucket_lsd_n).
template <class Rec, class Out>
static int bucket_lsd_wide(Rec* src, Rec* __restrict tmp, int64_t m, int lb, uint32_t* __restrict hist,
                           int* first_width, Out&& out) {
  if (lb <= 0) {
    for (int64_t i = 0; i < m; ++i) out(i, src[i]);
    return 0;
  }
  // 12-bit counters pay off from a few thousand records (measured on the EPYC; this LSD is the fallback
  // of clustered wide keys, not re-measured with BUCKET_MAX_DIGIT's Xeon numbers)
  const int maxw = m >= 4096 ? 12 : 8;
  const int P = (lb + maxw - 1) / maxw;
  int sh[WIDE_MAX_PASSES], off[WIDE_MAX_PASSES + 1];
  uint64_t mk[WIDE_MAX_PASSES];
  off[0] = 0;
  for (int j = 0, at = 0; j < P; ++j) {
    const int wj = lb / P + (j < lb % P);
    sh[j] = at;
    mk[j] = (uint64_t(1) << wj) - 1;
    off[j + 1] = off[j] + (1 << wj);
    at += wj;
  }
  *first_width = (int)__builtin_popcountll(mk[0]);
  std::memset(hist, 0, sizeof(uint32_t) * off[P]);
  for (int64_t i = 0; i < m; ++i) {
    const uint64_t v = v_of(src[i]);
    for (int j = 0; j < P; ++j) ++hist[off[j] + ((v >> sh[j]) & mk[j])];
  }
  int live[WIDE_MAX_PASSES];
  const int nl = scan_passes(hist, off, mk, P, m, live);
  const Rec* s = run_live_passes(src, tmp, m, hist, off, sh, mk, live, nl, [](const Rec& x) { return v_of(x); });
  for (int64_t i = 0; i < m; ++i) out(i, s[i]);
  return nl;
}

// One wide bucket: a second stable split on the next bit_width(m) - 1 bits of v (8 to 16, into tmp)
// leaves ~2 records per part for random keys, so most parts need only an insertion sort; a part of more
// than 32 records
// (clustered keys) is LSD-sorted on the bits below, with src (already moved out) as its scratch. One
// in-cache scatter instead of ~5 LSD passes over the 48+ bits below the top byte. Returns the passes
// that ran (for the stats) and the first digit's width in *w0.
static constexpr int64_t WIDE_INSERTION = 32;
static constexpr int WIDE_SUB_BITS = 16;  // the second split's widest digit
// counters a thread keeps for bucket_wide: positions and starts of the second split, then <= 7 x 4096
// for an LSD pass plan
static constexpr size_t WIDE_HIST_WORDS = (size_t(2) << WIDE_SUB_BITS) + 64 + WIDE_MAX_PASSES * 4096;

template <class Rec>
static inline void insertion_sort_v(Rec* r, int64_t m) {
  for (int64_t i = 1; i < m; ++i) {
    const Rec x = r[i];
    const uint64_t v = v_of(x);
    int64_t j = i;
    for (; j > 0 && v_of(r[j - 1]) > v; --j) r[j] = r[j - 1];  // strict: equal keys keep their order
    r[j] = x;
  }
}

template <class Rec, class Out>
// (always inlined: called from msd_wide_sort's two splits, with and without hot keys, GCC kept it out of
// line, and random int64 keys sorted ~5% slower)
__attribute__((always_inline)) static inline int bucket_wide(Rec* src, Rec* __restrict tmp, int64_t m, int lb,
                                                             uint32_t* __restrict hist, int* w0, Out&& out) {
  if (m <= WIDE_INSERTION || lb <= 0) {
    insertion_sort_v(src, m);
    for (int64_t i = 0; i < m; ++i) out(i, src[i]);
    *w0 = 0;
    return 0;
  }
  // about two records per part for random keys (12 bits: ~4, whose insertion sorts mispredicted their
  // way to half the bucket's time; 1 or 0.5 per part measured the same as 2 within noise)
  const int d2 = std::min({lb, WIDE_SUB_BITS, std::max(8, 63 - __builtin_clzll((uint64_t)m))});
  const int sh = lb - d2;
  const uint32_t R2 = 1u << d2, mask = R2 - 1;
  uint32_t* pos = hist;                               // R2 running positions
  uint32_t* starts = hist + (1 << WIDE_SUB_BITS);     // R2 + 1 part starts
  uint32_t* inner = starts + (1 << WIDE_SUB_BITS) + 64;  // the LSD fallback's counters
  std::memset(pos, 0, sizeof(uint32_t) * R2);
  for (int64_t i = 0; i < m; ++i) {
    pk::prefetch_stream(src, i);  // the bucket's first read comes from DRAM
    ++pos[(v_of(src[i]) >> sh) & mask];
  }
  uint32_t run = 0;
  for (uint32_t d = 0; d < R2; ++d) {
    const uint32_t c = pos[d];
    if (c == (uint32_t)m) return bucket_lsd_wide(src, tmp, m, sh, hist, w0, out);  // the digit is constant
    starts[d] = pos[d] = run;
    run += c;
  }
  starts[R2] = run;
  for (int64_t i = 0; i < m; ++i) {
    const Rec x = src[i];
    tmp[pos[(v_of(x) >> sh) & mask]++] = x;
  }
  *w0 = d2;
  int most = 1;
  for (uint32_t d = 0; d < R2; ++d) {
    const int64_t b = starts[d], c = (int64_t)starts[d + 1] - b;
    if (c <= 1) continue;
    if (c <= WIDE_INSERTION) {
      insertion_sort_v(tmp + b, c);
      continue;
    }
    int w_inner = 0;
    Rec* part = tmp + b;
    const int live = bucket_lsd_wide(part, src + b, c, sh, inner, &w_inner,
                                     [part](int64_t q, const Rec& x) { part[q] = x; });
    most = std::max(most, 1 + live);
  }
  for (int64_t i = 0; i < m; ++i) out(i, tmp[i]);
  return most;
}

// Counts digit_of(i) for i in [b, e) into out[0..RB) (zeroed here), through four copies of the counters
// that take every fourth key: with one copy each increment waits on the one before it (a load of a
// counter the previous store may have written), four independent chains overlap. The top byte of 4M
// random keys read from L3, 2-core Zen 4: one thread 3.3 -> 1.2 ms, two 1.7 -> 0.6-0.9. digit_of may
// also note things about key i (the lossy-float check): it runs once per key, in order. The counters
// live on the caller's stack (see split_scatter).
template <int RB, class DigitOf>
static inline void count_digits(int64_t b, int64_t e, DigitOf&& digit_of, uint32_t* out) {
  uint32_t h[4][RB];
  std::memset(h, 0, sizeof(h));
  int64_t i = b;
  for (; i + 4 <= e; i += 4) {
    ++h[0][digit_of(i)];
    ++h[1][digit_of(i + 1)];
    ++h[2][digit_of(i + 2)];
    ++h[3][digit_of(i + 3)];
  }
  for (; i < e; ++i) ++h[0][digit_of(i)];
  for (int d = 0; d < RB; ++d) out[d] = h[0][d] + h[1][d] + h[2][d] + h[3][d];
}

// Equality buckets for hot keys (the equality buckets of IPS4o: Axtmann, Witt, Ferizovic & Sanders,
// "In-place Parallel Super Scalar Samplesort", ESA 2017). A key that alone fills much of an MSD bucket
// (Zipf-distributed ids: a quarter of 2M Zipf(1.3) keys are one value; a default or null placeholder
// beside random keys) made the bucket too big for the split (bucket_ok), so such inputs went to the LSD
// engine at ~2x the time of random keys. Instead, the split gives each bucket d's hot key its own
// bucket: d becomes three, keys below the hot key, the hot key, keys above it (extended digit
// 4 * d + (v >= hot[d]) + (v > hot[d])). The middle one is sorted already (one value, in input order:
// the split is stable) and is copied out in parallel; the other two are sorted like any bucket.
// A bucket without a hot key has hot[d] = all ones: its "hot" bucket then holds only v = all ones (one
// value again), so no case needs a branch.
static constexpr int HOT_SAMPLE = 4096;
// The hot path is looked for where the strided sample's fullest bucket holds at least HOT_TRIGGER of its
// HOT_SAMPLE keys (4x an even share of 256 buckets; random keys' fullest is ~30), from HOT_MIN_N keys, and
// only where that bucket would cost: more than 1/MSD_MIN_FANOUT of the keys or past HOT_BUCKET_BYTES
// (hot_worth). It is taken (hot_pays) where the plain split is refused (the LSD engine, ~2.5x slower on
// such keys), where the hot keys are at least HOT_SHARE of the keys, or where a wide bucket is past
// HOT_BUCKET_BYTES (its second split out of L2: 5% of 4M int64 keys one value, 1.15x with the hot
// path). Otherwise the extended digit's compares cost about what they save: they made the count and the
// split ~50% slower (4M int64 ids, keys only, 20% of them -1: 13.5 -> 14.6 ms in all; a bucket of 5% of
// 4M int32 keys + indices, 1.7 MiB, cost nothing over random keys in the plain split).
static constexpr int HOT_TRIGGER = 64;
static constexpr double HOT_SHARE = 0.25;
static constexpr int64_t HOT_MIN_N = int64_t(1) << 18;
static constexpr size_t HOT_BUCKET_BYTES = size_t(2) << 20;
// a hot key: at least HOT_MIN of the sampled keys (an even bucket's share, ~0.4% of the keys)
static constexpr int HOT_MIN = 16;
static constexpr int HOT_BITS = 2;  // the extended digit's extra bits: 4 sub-buckets per bucket (3 used)

template <class V>  // uint32_t (narrow records' v) or uint64_t (wide)
struct HotPlan {
  V hot[MSD_BUCKETS];
  int keys = 0;        // buckets that have a hot key
  double share = 0;    // the hot keys' share of the sample
  double biggest = 0;  // the sample's fullest bucket without its hot key, scaled to n keys, less its noise
  bool varied = false; // whether that bucket's sampled keys differ
  // the extended digit of v, whose plain digit is d
  uint32_t ext(V v, uint32_t d) const {
    const V h = hot[d];
    return (d << HOT_BITS) + (uint32_t)(v >= h) + (uint32_t)(v > h);
  }
};
static inline bool is_hot_bucket(int e) { return (e & ((1 << HOT_BITS) - 1)) == 1; }

// A sample's fullest bucket (scaled to n keys) less three standard deviations of its count c (about
// sqrt(c)): the slack of a sample's fullest bucket against its exact count (see SAMPLE_SLACK) for even
// buckets of ~16 samples, and ~10% for a bucket of a fifth of the samples, which SAMPLE_SLACK would let
// through to a counting read (and a refusal after it: 4M float32 keys of which 30% are 0 and the rest
// randn, 3 reads in vain).
static inline double less_noise(double biggest, int64_t n) {
  const double c = biggest * HOT_SAMPLE / (double)n;
  return std::max(c - 3.0 * std::sqrt(c), 0.0) * (double)n / HOT_SAMPLE;
}

// Whether a sample's fullest bucket (biggest: scaled to n keys, of rec_bytes records) calls for hot keys.
static inline bool hot_worth(double biggest, int64_t n, size_t rec_bytes) {
  return n >= HOT_MIN_N && biggest * HOT_SAMPLE >= (double)HOT_TRIGGER * (double)n &&
         (biggest * MSD_MIN_FANOUT > (double)n || biggest * (double)rec_bytes > (double)HOT_BUCKET_BYTES);
}
// Whether a hot plan hp pays (see above): refused, whether the plain split's sample is refused; wide_big,
// whether it has a wide bucket past HOT_BUCKET_BYTES.
template <class V>
static inline bool hot_pays(const HotPlan<V>& hp, bool refused, bool wide_big) {
  return refused || wide_big || hp.share >= HOT_SHARE;
}

// The strided sample (the positions sample_buckets reads), encoded, and its heavy keys (at least HOT_MIN
// of the samples), counted in a small open-addressing table (a sort of the 4096 samples cost ~0.1 ms,
// a fifth of a 512K-key sort).
template <class U>
struct HotSample {
  bool taken = false;
  std::vector<U> keys;
  std::vector<std::pair<U, uint32_t>> heavy;
  template <Enc E>
  void take(const U* in, int64_t n, const Coder<U, E>& cd) {
    if (taken) return;
    taken = true;
    keys.resize(HOT_SAMPLE);
    constexpr int TB = 13;  // 8192 cells for 4096 samples
    std::vector<U> ck(size_t(1) << TB);
    std::vector<uint32_t> cc(size_t(1) << TB, 0u);  // 0: empty
    for (int64_t j = 0; j < HOT_SAMPLE; ++j) {
      const U k = cd.enc(in[j * n / HOT_SAMPLE]);
      keys[j] = k;
      for (uint64_t x = (uint64_t)k * 0x9E3779B97F4A7C15ull >> (64 - TB);; x = (x + 1) & ((1u << TB) - 1)) {
        if (cc[x] == 0) {
          ck[x] = k;
          cc[x] = 1;
          break;
        }
        if (ck[x] == k) {
          ++cc[x];
          break;
        }
      }
    }
    for (size_t x = 0; x < cc.size(); ++x)
      if (cc[x] >= (uint32_t)HOT_MIN) heavy.emplace_back(ck[x], cc[x]);
  }
};

// The plan for the digit digit_of(v) < 256 of v = v_of(encoded key): each bucket's most frequent heavy key
// as its hot key. Returns false where no bucket has one.
template <class V, class U, class VOf, class DigitOf>
static bool plan_hot(const HotSample<U>& hs, int64_t n, VOf v_of, DigitOf digit_of, HotPlan<V>& hp) {
  uint32_t best[MSD_BUCKETS] = {};
  std::fill(hp.hot, hp.hot + MSD_BUCKETS, V(~V(0)));
  hp.keys = 0;
  for (const auto& [k, c] : hs.heavy) {
    const V v = v_of(k);
    const uint32_t d = digit_of(v);
    if (c > best[d]) {
      hp.keys += best[d] == 0;
      best[d] = c;
      hp.hot[d] = v;
    }
  }
  if (!hp.keys) return false;
  uint32_t hot_samples = 0;
  for (int d = 0; d < MSD_BUCKETS; ++d) hot_samples += best[d];
  hp.share = (double)hot_samples / HOT_SAMPLE;
  // the fullest bucket once its hot key has its own
  uint32_t count[MSD_BUCKETS] = {};
  V first[MSD_BUCKETS];
  bool varied[MSD_BUCKETS] = {};
  for (const U k : hs.keys) {
    const V v = v_of(k);
    const uint32_t d = digit_of(v);
    if (v == hp.hot[d]) continue;
    if (count[d]++ == 0) first[d] = v;
    else varied[d] |= v != first[d];
  }
  const uint32_t most = (uint32_t)(std::max_element(count, count + MSD_BUCKETS) - count);
  hp.biggest = less_noise((double)count[most] * (double)n / HOT_SAMPLE, n);
  hp.varied = varied[most];
  return true;
}

// A digit over the keys' central range, for keys clustered between a few far outliers (timestamps or ids
// beside a 0 or -1 placeholder, ints beside the dtype's min or max, floats beside inf: the span is the
// whole range, its top byte one bucket for nearly all keys, and the LSD engine took them: 4M int64
// nanosecond timestamps with 0.1% zeros 74 ms against 45 without). Wide and narrow records alike.
// From the sample's 0.5% and 99.5% quantiles (lo aligned down to 2^s): bucket 0 holds v < lo, buckets
// 1..254 the 2^s-wide slices of [lo, lo + 254 * 2^s), bucket 255 the rest. Monotone in v; inside a slice
// the keys differ in their low s bits, inside the two outlier buckets in any (sorted on all w bits).
struct RangeDigit {
  uint64_t lo = 0;
  int s = -1;
  uint32_t operator()(uint64_t v) const {
    const uint64_t slice = (v - lo) >> s;
    return v < lo ? 0u : slice >= 254 ? 255u : 1u + (uint32_t)slice;
  }
  int bits_below(uint64_t v, int w) const {
    const uint32_t d = (*this)(v);
    return d == 0 || d == 255 ? w : s;
  }
  // From the sampled encoded keys under v_of; false where the central range is as wide as the span
  // (nothing gained over the top byte).
  template <class U, class VOf>
  bool plan(const std::vector<U>& sampled, VOf v_of, int w) {
    std::vector<uint64_t> v(sampled.size());
    for (size_t i = 0; i < v.size(); ++i) v[i] = v_of(sampled[i]);
    const size_t a = v.size() / 200, b = v.size() - 1 - v.size() / 200;
    std::nth_element(v.begin(), v.begin() + (std::ptrdiff_t)a, v.end());
    const uint64_t q_lo = v[a];
    std::nth_element(v.begin(), v.begin() + (std::ptrdiff_t)b, v.end());
    const uint64_t q_hi = v[b];
    int bits = 0;
    while (bits < 64 && (q_hi >> bits) - (q_lo >> bits) > 253) ++bits;
    if (bits + MSD_BITS >= w) return false;  // slices as wide as the top byte's buckets
    s = bits;
    lo = (q_lo >> bits) << bits;
    return true;
  }
};

// A digit by pieces of the span, for keys that crowd a few of the top byte's buckets however the central
// range is cut: mixed-sign float64 (randn, uniform(-1, 1)): the top byte of the order-preserving bits is
// the sign and 7 of the exponent's 11 bits, so nearly every key falls in one of two buckets, and the
// central range spans the sign flip; clusters far apart (two id ranges, shards in the top bits; on the
// narrow records too: int32 ids in two ranges). The LSD engine took them (4M randn float64 + indices ~90
// ms against ~55 for positive floats).
// The span [umin, umax] of the encoded keys is cut into at most 4096 aligned pieces of 2^sh (mixed-sign
// float64: one binade each, sign and exponent being the top 12 bits); each run of pieces the sample did
// not find gets one bucket, each piece it found a region of buckets, cut one of two ways:
//  - aligned: 2^k buckets cutting the piece evenly by its next k bits, the fullest share halved first
//    while buckets are left (binades: one look-up, a mask and a shift);
//  - ranged: one plus its share of the spare buckets, slices of 2^s across the central range of its
//    sampled keys [lo, hi] (keys below lo in the first, past the last slice in the last: a clamp), for
//    clusters narrower than a piece's slices (two ranges of 2^40 ids 2^60 apart: one aligned bucket each).
// The ranged form where its sample's fullest bucket is at most half the aligned form's (its clamp and
// second look-up cost ~8% on randn float64). So a sample sort's splitters at the granularity of bit
// slices. Monotone in v = key - umin. bits[d]: the bits of v that vary inside bucket d (from its bounds).
struct PiecePlan {
  static constexpr int PB = 12;  // 4096 pieces: 8 KiB of table, in L1 beside the split's 16 KiB of open lines
  struct Region {
    uint64_t lo;    // its first slice's start (u)
    int32_t base;   // its first bucket
    uint16_t cap;   // its last bucket, less base
    uint8_t s;      // log2 of its slices
  };
  uint64_t umin = 0, p0 = 0, low = 0;
  int sh = -1;
  bool ranged = false;
  std::vector<uint16_t> tab;       // aligned: piece -> its first bucket | (the shift of its in-piece bits) << 8
  std::vector<uint8_t> region_of;  // ranged: piece -> its region
  Region reg[MSD_BUCKETS] = {};
  uint8_t bits[MSD_BUCKETS] = {};

  template <class U, class VOf>
  bool plan(const std::vector<U>& sampled, VOf v_of, uint64_t lo_key, uint64_t hi_key);
};

// The digit of a PiecePlan (a view: the split's lambdas copy it).
struct PieceDigit {
  uint64_t umin = 0, p0 = 0, low = 0;
  int sh = -1;
  bool ranged = false;
  const uint16_t* tab = nullptr;
  const uint8_t* region_of = nullptr;
  const PiecePlan::Region* reg = nullptr;
  const uint8_t* bits = nullptr;
  PieceDigit() = default;
  explicit PieceDigit(const PiecePlan& pp)
      : umin(pp.umin), p0(pp.p0), low(pp.low), sh(pp.sh), ranged(pp.ranged), tab(pp.tab.data()),
        region_of(pp.region_of.data()), reg(pp.reg), bits(pp.bits) {}
  uint32_t operator()(uint64_t v) const {
    const uint64_t u = v + umin;
    const size_t p = (size_t)((u >> sh) - p0);
    if (!ranged) {  // (the same way for every key: predicted)
      const uint32_t e = tab[p];
      return (e & 255u) + (uint32_t)((u & low) >> (e >> 8));
    }
    const PiecePlan::Region& g = reg[region_of[p]];
    // (u - lo: below 2^52 in magnitude inside a found piece; an empty run's region has cap 0)
    const int64_t t = (int64_t)(u - g.lo) >> g.s;
    return (uint32_t)(g.base + std::min<int64_t>(std::max<int64_t>(t, 0), g.cap));
  }
  int bits_below(uint64_t v, int) const { return bits[(*this)(v)]; }
};

// A digit by binades of v, as a float's exponent and its top mantissa bits: for keys whose counts fall
// off with their size (power laws: raw Zipf ranks, word and page counts, file sizes; lognormal amounts)
// every linear cut of the span leaves most keys in its first bucket, the pieces' included (4M raw Zipf(1.3)
// int32 ranks: half the keys below 7, the span 2^31; lognormal(8, 3)), and the LSD engine took them
// (~2.5x the time of random keys). With e = max(0, bitlen(u) - mb - 1), code(u) = (e << mb) + (u >> e):
// the values below 2^(mb + 1) one bucket each (e = 0, nothing left to sort inside), then each binade
// [2^(mb + e), 2^(mb + e + 1)) cut into 2^mb even slices whose keys differ in their low e bits. Monotone and
// contiguous: binade e takes codes [(e + 1) << mb, (e + 2) << mb). mb is the largest whose codes for
// u < 2^w fit the 256 buckets ((w - mb + 1) << mb of them: 3 for 32-bit spans, 2 for 64-bit).
// The digit is code(v), or where the keys crowd the top of the span (power laws sorted descending: the
// order-preserving encoding complements them) maxd - code(top - v), top = the largest v. Such a bucket's
// keys share (top - v) >> e, which is their v >> e only where top + 1 is a multiple of 2^e: so the split
// that takes the flipped digit moves the keys' base down to make top = 2^w - 1 (rebase_flip).
// Tried last (after the central range and the pieces), where the plain split is refused or crowded.
struct LogDigit {
  int mb = -1;        // mantissa bits kept below a binade's leading one; -1: not the split's digit
  bool flip = false;  // binades of top - v
  uint64_t top = 0;   // flip: the largest v
  uint32_t maxd = 0;  // flip: code(2^w - 1), the digit of v = top
  static int exponent(uint64_t u, int mb) { return std::max(63 - __builtin_clzll(u | 1) - mb, 0); }
  uint32_t code(uint64_t u) const {
    const int e = exponent(u, mb);
    return (uint32_t)(((uint64_t)e << mb) + (u >> e));
  }
  uint32_t operator()(uint64_t v) const { return flip ? maxd - code(top - v) : code(v); }
  int bits_below(uint64_t v, int) const { return exponent(flip ? top - v : v, mb); }
  // false where the span is within the plain digit's 8 bits (nothing to gain); vmax: the largest v
  bool plan(int w, bool flipped, uint64_t vmax) {
    if (w <= MSD_BITS) return false;
    int m = MSD_BITS - 1;
    while (m > 0 && (w - m + 1) << m > MSD_BUCKETS) --m;
    mb = m;
    flip = flipped;
    top = vmax;
    maxd = code(w >= 64 ? ~uint64_t(0) : (uint64_t(1) << w) - 1);
    return true;
  }
  // The flipped digit's records: v' = v + delta with delta = 2^w - 1 - top (the keys' base moved down by
  // delta), so v' >> e is what the keys of a bucket share; the same digit of each key. The hot keys of hp
  // (planned on v) move with them. Returns delta, for the caller's base.
  template <class V>
  uint64_t rebase_flip(int w, HotPlan<V>& hp) {
    const uint64_t all = w >= 64 ? ~uint64_t(0) : (uint64_t(1) << w) - 1;
    const uint64_t delta = all - top;
    top = all;
    for (V& h : hp.hot)
      if (h != V(~V(0))) h = V(h + V(delta));
    return delta;
  }
};

template <class U, class VOf>
bool PiecePlan::plan(const std::vector<U>& sampled, VOf v_of, uint64_t lo_key, uint64_t hi_key) {
  sh = 0;
  while (sh < 64 && (hi_key >> sh) - (lo_key >> sh) >= (uint64_t(1) << PB)) ++sh;
  umin = lo_key;
  p0 = lo_key >> sh;
  low = sh ? (uint64_t(1) << sh) - 1 : 0;  // sh <= 52 here: the span is < 2^64
  const size_t np = (size_t)((hi_key >> sh) - p0) + 1;
  // each piece's sampled keys: their count and central range (0.5% to 99.5%: a few far keys in the piece
  // of a cluster, such as a 0 beside ids from 2^50, go to its end buckets instead of widening its slices)
  std::vector<uint64_t> us(sampled.size());
  for (size_t i = 0; i < us.size(); ++i) us[i] = v_of(sampled[i]) + umin;
  std::sort(us.begin(), us.end());
  std::vector<uint32_t> cnt(np, 0);
  std::vector<uint64_t> smin(np, 0), smax(np, 0);
  for (size_t i = 0; i < us.size();) {
    const size_t p = (size_t)((us[i] >> sh) - p0);
    size_t j = i;
    while (j < us.size() && (size_t)((us[j] >> sh) - p0) == p) ++j;
    const size_t c = j - i;
    cnt[p] = (uint32_t)c;
    smin[p] = us[i + c / 200];
    smax[p] = us[j - 1 - c / 200];
    i = j;
  }
  // a region for each piece the sample found and for each run of pieces it did not
  int regions = 0;
  for (size_t p = 0; p < np; ++p) regions += cnt[p] > 0 || p == 0 || cnt[p - 1] > 0;
  if (regions > MSD_BUCKETS / 2) return false;  // spread over many pieces: the top byte does as well
  uint8_t bits_aligned[MSD_BUCKETS] = {}, bits_ranged[MSD_BUCKETS] = {};
  auto set_bits = [&](uint8_t* to, int d, uint64_t a, uint64_t b) {  // bucket d holds the keys of [a, b] (u)
    a = std::max(a, lo_key);
    b = std::min(b, hi_key);
    const uint64_t x = (a - umin) ^ (b - umin);
    to[d] = (uint8_t)(x ? 64 - __builtin_clzll(x) : 0);
  };
  // each run of empty pieces [p, q]: one bucket (both forms); returns q
  auto empty_run = [&](size_t p, int d, uint8_t* to) {
    size_t q = p;
    while (q + 1 < np && cnt[q + 1] == 0) ++q;
    set_bits(to, d, (p0 + p) << sh, ((p0 + q) << sh) + low);
    return q;
  };

  // aligned: 2^k buckets for each found piece, the fullest share halved while its doubling fits
  std::vector<uint8_t> kk(np, 0);
  int used = regions;
  const int kmax = std::min(MSD_BITS, sh);
  for (;;) {
    size_t best = np;
    double share = 0.0;
    for (size_t p = 0; p < np; ++p) {
      const double sp = (double)cnt[p] / (double)(1u << kk[p]);
      if (kk[p] < kmax && used + (1 << kk[p]) <= MSD_BUCKETS && sp > share) share = sp, best = p;
    }
    if (best == np || share < 2.0) break;
    used += 1 << kk[best];
    ++kk[best];
  }
  tab.assign(np, 0);
  for (size_t p = 0, d = 0; p < np;) {
    if (cnt[p] == 0) {
      const size_t q = empty_run(p, (int)d, bits_aligned);
      for (size_t t = p; t <= q; ++t) tab[t] = (uint16_t)(d | ((size_t)sh << 8));
      ++d;
      p = q + 1;
      continue;
    }
    const int s = sh - kk[p];
    tab[p] = (uint16_t)(d | ((size_t)s << 8));
    for (int j = 0; j < (1 << kk[p]); ++j) {
      const uint64_t a = ((p0 + p) << sh) + ((uint64_t)j << s);
      set_bits(bits_aligned, (int)d + j, a, a + (low >> kk[p]));
    }
    d += (size_t)1 << kk[p];
    ++p;
  }

  // ranged: one bucket and a share of the spare ones for each found piece, slices across its keys
  const int spare = MSD_BUCKETS - regions;
  region_of.assign(np, 0);
  for (size_t p = 0, r = 0, d = 0; p < np; ++r) {
    const uint64_t first = (p0 + p) << sh;
    Region& g = reg[r];
    g.base = (int32_t)d;
    if (cnt[p] == 0) {
      const size_t q = empty_run(p, (int)d, bits_ranged);
      for (size_t t = p; t <= q; ++t) region_of[t] = (uint8_t)r;
      g.lo = first;
      g.s = 63;
      g.cap = 0;
      ++d;
      p = q + 1;
      continue;
    }
    region_of[p] = (uint8_t)r;
    const uint64_t m = 1 + (uint64_t)cnt[p] * (uint64_t)spare / sampled.size();  // its buckets
    int s = 0;
    while (((smax[p] - smin[p]) >> s) >= m) ++s;
    g.lo = smin[p];
    g.s = (uint8_t)s;
    g.cap = (uint16_t)((smax[p] - smin[p]) >> s);
    for (int j = 0; j <= g.cap; ++j) {
      const uint64_t a = j == 0 ? first : g.lo + ((uint64_t)j << s);
      const uint64_t b = j == g.cap ? first + low : g.lo + ((uint64_t)(j + 1) << s) - 1;
      set_bits(bits_ranged, (int)d + j, a, b);
    }
    d += (size_t)g.cap + 1;
    ++p;
  }

  // the ranged form where its sample's fullest bucket is at most half the aligned form's
  auto fullest = [&](bool as_ranged) {
    ranged = as_ranged;
    const PieceDigit dig(*this);
    uint32_t c[MSD_BUCKETS] = {};
    for (const U& k : sampled) ++c[dig(v_of(k))];
    return *std::max_element(c, c + MSD_BUCKETS);
  };
  ranged = 2 * fullest(true) <= fullest(false);
  std::copy(ranged ? bits_ranged : bits_aligned, (ranged ? bits_ranged : bits_aligned) + MSD_BUCKETS, bits);
  return true;
}

// The hot buckets' records (one value each, in input order) handed to out(position, record) by all
// threads, each bucket cut in T parts: start[e] bounds of the extended buckets, rec_at(b): where bucket
// [b, ...)'s records are.
template <class Rec, class Out>
static void copy_hot_buckets(int T, const std::vector<int64_t>& start, const Rec* rec, Out out) {
  const int RE = (int)start.size() - 1;
  pk::parallel_threads(T, [&](int t) {
    const Out o = out;
    for (int e = 1; e < RE; e += 1 << HOT_BITS) {
      const int64_t b = start[e], m = start[e + 1] - b;
      for (int64_t q = b + m * t / T, qe = b + m * (t + 1) / T; q < qe; ++q) o(q, rec[q]);
    }
  });
}

// The MSD split's per-thread scatter offsets from its per-thread digit counts (hist[t * 2^MB + d]):
// digit by digit, then thread by thread, so the split is stable. Fills start[0..2^MB] (bucket bounds)
// and pos; returns the biggest bucket (skip_hot: of those left to sort, see HotPlan).
template <int MB>
static int64_t split_offsets(const std::vector<uint32_t>& hist, int T, std::vector<int64_t>& start,
                             std::vector<int64_t>& pos, bool skip_hot = false) {
  constexpr int RB = 1 << MB;
  int64_t run = 0, biggest = 0;
  for (int d = 0; d < RB; ++d) {
    start[d] = run;
    for (int t = 0; t < T; ++t) {
      pos[(size_t)t * RB + d] = run;
      run += hist[(size_t)t * RB + d];
    }
    if (!(skip_hot && is_hot_bucket(d))) biggest = std::max(biggest, run - start[d]);
  }
  start[RB] = run;
  return biggest;
}

// The MSD split's scatter: each thread moves its slice of the keys, in order, to its own offsets pos
// (see split_offsets), so the split is stable. vbits: encoded key -> v; digit: v -> bucket; make(v, i):
// the record.
// Two ways to store the records (nt_mode, the config's nt):
//  - streaming: one 64-byte write-combining line per bucket that is flushed whole with streaming stores
//    once full. 256 destination streams in DRAM written with plain stores cost a read-for-ownership each
//    new line, and few of those overlapped on a Xeon VM (5.3 ns per 4-byte key on one thread, 2.1 with the
//    lines). A line shared with a neighbouring bucket or thread (the ends of this thread's range of a
//    bucket) is written record by record, only this thread's records: no byte is written by two threads.
//  - plain stores, record by record. On the 2-core Zen 4 they win for 256 buckets at every size measured
//    (the 256 open destination lines, 16 KiB, stay in its 32 KiB L1 while they fill; the records
//    the buckets' sorts then read partly come from L3 instead of DRAM): 2 threads, old/new processes in
//    turn, ms: int32 + indices 2M 8.1-9.9 -> 7.0-7.4, 4M 15.7-16.2 -> 13.0-13.5, 6M 24-31 -> 19-23,
//    12M 46-61 -> 38-41, 16M 62-64 -> 52; random int64 + indices (16-byte records) 4M 34-36 -> 28-29,
//    16M 152-159 -> 133-136; uint32 + 4-byte payload 4M 15.7-16.0 -> 12.6-13.1. Into 2048 buckets (128
//    KiB of open lines: past L1) they lose: 16M uint32 keys 47-48 -> 56-60 ms, int32 + indices 59-71 ->
//    69-74.
//    Except where the buckets' starts alias in L2: when the average bucket's bytes are within a cache
//    line of a multiple of 128 KiB (the set period of the Zen 4's 1 MiB 8-way L2; Zen 2's 64 KiB divides
//    it), all 256 destination streams start on the same sets and keep moving in step. Keys only, ns per
//    key plain / streaming: 2^23 keys 3.1 / 2.9, 2^24 3.6 / 2.9, 2^24 + 768 (12 bytes a bucket past 256
//    KiB) 3.6 / 3.0, + 3072 (48 bytes) 3.5 / 2.9, + 4096 (64 bytes) 2.6 / 2.9, + 12288 (192) 2.5 / 2.8.
//    msd_hybrid_sort's narrow path places such records with a line of gap per bucket (then plain
//    stores: 2^22 int32 + indices 15.7-16.4 -> 12.6-12.9 ms, 2^23 keys 23.8-24.3 -> 21.0-21.3); the
//    wide path streams.
// nt_mode -1 (default): plain stores into 256 buckets unless they alias, streaming into more; 1:
// streaming; 0: plain. Streaming only past SPLIT_STREAM_MIN_BYTES of records: below, they would push
// cache-resident records out to DRAM.
static constexpr size_t SPLIT_STREAM_MIN_BYTES = size_t(8) << 20;
static constexpr double SPLIT_ALIAS_PERIOD = 128 << 10;

// Whether the average bucket of a split of n records of rec_bytes into nb buckets spans within a cache
// line of a multiple of SPLIT_ALIAS_PERIOD (see above).
static inline bool split_buckets_alias(int64_t n, size_t rec_bytes, int nb) {
  const double r = std::fmod((double)n * (double)rec_bytes / nb, SPLIT_ALIAS_PERIOD);
  return std::min(r, SPLIT_ALIAS_PERIOD - r) < 64.0;
}

// open_bits: log2 of how many buckets records go to (MB, but MSD_BITS for HotPlan::ext's digits: at most
// 3 x 256 buckets, most of the hot and upper ones empty).
template <int MB, class Rec, class U, Enc E, class VBits, class Digit, class Make>
static void split_scatter(int T, int64_t n, std::vector<int64_t>& pos, Rec* rec, const U* in, const Coder<U, E>& cd,
                          int nt_mode, VBits vbits, Digit digit, Make make, int open_bits = MB) {
  constexpr int64_t L = 64 / sizeof(Rec);  // records per line
  static_assert(64 % sizeof(Rec) == 0, "records tile a cache line");
  const bool stream_ok =
      nt_mode > 0 || (nt_mode < 0 && (open_bits > MSD_BITS || split_buckets_alias(n, sizeof(Rec), 1 << open_bits)));
  const bool stream = PK_X86 && stream_ok && (size_t)n * sizeof(Rec) >= SPLIT_STREAM_MIN_BYTES &&
                      (uintptr_t)rec % sizeof(Rec) == 0;
  // record q sits in slot (phase + q) % L of its cache line
  const int64_t phase = (int64_t)(((uintptr_t)rec / sizeof(Rec)) % L);
  pk::parallel_threads(T, [&](int t) {
    const int64_t b = n * t / T, e = n * (t + 1) / T;
    // Each thread's counters (here, and in the counting reads before the split) live on its own stack
    // while it runs. Side by side in one shared vector (1-2 KiB per thread) they did not scale: the
    // top-byte count of 16M keys took 26 ms on one thread and 22 ms on two, 14 ms on two with stack
    // counters (Xeon VM; the threads' neighbouring lines are likely pulled across cores by the
    // adjacent-line prefetcher).
    constexpr int RB = 1 << MB;
    int64_t p[RB];
    std::memcpy(p, pos.data() + (size_t)t * RB, sizeof(p));
    Rec* __restrict r = rec;
    const U* __restrict src = in;
    const Coder<U, E> c = cd;
    // local copies: read through the closure, every capture was reloaded after each record's stores
    const VBits vbits_l = vbits;
    const Digit digit_l = digit;
    const Make make_l = make;
    const int64_t phase_l = phase;
    if (!stream) {
      // each store also asks for the line two lines on in its bucket, for writing: the read-for-ownership
      // of a stream's next line then overlaps this line's stores (a hint: past the array's end it does
      // nothing). 2 threads, old/new processes in turn, best of 4: int32 + indices 4M 12.6 -> 12.0 ms,
      // random int64 + indices 4M 28.6 -> 27.2; 16M uint32 keys, 4M int64 ids + indices unchanged.
      for (int64_t i = b; i < e; ++i) {
        pk::prefetch_stream(src, i);
        const auto v = vbits_l(c.enc(src[i]));
        const int64_t q = p[digit_l(v)]++;
        PK_PREFETCH_W(reinterpret_cast<const char*>(r + q) + 128);
        r[q] = make_l(v, i);
      }
      return;
    }
    struct alignas(64) Line { Rec slot[L]; };
    std::unique_ptr<Line[]> lines(new Line[RB]);
    int64_t first[RB];  // where this thread's records of each bucket begin
    std::memcpy(first, p, sizeof(first));
    Line* __restrict buf = lines.get();
    for (int64_t i = b; i < e; ++i) {
      pk::prefetch_stream(src, i);
      const auto v = vbits_l(c.enc(src[i]));
      const uint32_t d = digit_l(v);
      const int64_t q = p[d]++;
      const int64_t s = (phase_l + q) & (L - 1);
      buf[d].slot[s] = make_l(v, i);
      if (s == L - 1) {
        const int64_t line0 = q - (L - 1);
        if (line0 >= first[d]) {
          line_store(r + line0, &buf[d], 64, true);
        } else {
          for (int64_t j = first[d]; j <= q; ++j) r[j] = buf[d].slot[(phase_l + j) & (L - 1)];
        }
      }
    }
    for (int d = 0; d < RB; ++d) {  // the partial last lines
      const int64_t q = p[d];
      const int64_t from = std::max(first[d], q - ((phase_l + q) & (L - 1)));
      for (int64_t j = from; j < q; ++j) r[j] = buf[d].slot[(phase_l + j) & (L - 1)];
    }
#if PK_X86
    _mm_sfence();  // the streaming stores are visible before the buckets are read
#endif
  });
}

// The MSD split's buckets handed to T threads dynamically: sort_bucket(tmp, hist, b, m, nb, nm) for every
// non-empty bucket [b, b + m), with a per-thread scratch of m records and hist_words counters; biggest: the
// largest bucket's records (split_offsets).
// ahead: each thread claims its next bucket [nb, nb + nm) before sorting this one, so it can prefetch the
// next one's records (written by the split's streaming stores: in DRAM) while this one sorts in cache
// (nm = 0: none). Only while every bucket is small against a thread's share (1/8 of it): two big buckets
// reserved by one thread would run one after the other while another thread idles (review finding).
// skip_hot: the split's digit is HotPlan::ext, and its hot buckets (copy_hot_buckets) are left alone.
template <int MB, class Rec, class SortBucket>
static void for_each_bucket(int T, const std::vector<int64_t>& start, int64_t biggest, size_t hist_words,
                            bool ahead, SortBucket&& sort_bucket, bool skip_hot = false) {
  constexpr int RB = 1 << MB;
  ahead = ahead && biggest * 8 * T <= start[RB];
  std::atomic<int> next_bucket{0};
  pk::parallel_threads(T, [&](int) {
    static thread_local std::vector<Rec> tmp;
    static thread_local std::vector<uint32_t> hist;
    if (hist.size() < hist_words) hist.resize(hist_words);
    auto claim = [&]() {  // the next non-empty bucket, or -1
      for (;;) {
        const int d = next_bucket.fetch_add(1, std::memory_order_relaxed);
        if (d >= RB) return -1;
        if (start[d + 1] > start[d] && !(skip_hot && is_hot_bucket(d))) return d;
      }
    };
    for (int d = claim(); d >= 0;) {
      const int dn = ahead ? claim() : -1;
      const int64_t b = start[d], m = start[d + 1] - b;
      if ((int64_t)tmp.size() < m) tmp.resize((size_t)m);
      sort_bucket(tmp.data(), hist.data(), b, m, dn >= 0 ? start[dn] : 0, dn >= 0 ? start[dn + 1] - start[dn] : 0);
      d = ahead ? dn : claim();
    }
    // kept for the next call only while L2-sized (a large or skewed call's buffer is released)
    if (tmp.size() > L2_BUCKET_BYTES / sizeof(Rec)) std::vector<Rec>().swap(tmp);
  });
}

// After an index-mode sort: keys gathered from the input when canonicalising changed some (exact bits),
// and payloads that were not carried gathered through the indices. Shared by both engines.
template <class U>
static void gather_by_index(const SortArgs& a, const int64_t* idx, bool need_gather) {
  const int64_t n = a.n;
  if (need_gather) {
    const U* in = (const U*)a.keys;
    U* dst = (U*)a.out_keys;
    pk::parallel_ranges(n, a.threads, [&](int, int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) dst[i] = in[idx[i]];
    });
  }
  if (a.out_pay) {
    const char* pin = (const char*)a.pay;
    char* pout = (char*)a.out_pay;
    const int ps = a.pay_size;
    pk::parallel_ranges(n, a.threads, [&](int, int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) std::memcpy(pout + i * ps, pin + idx[i] * ps, ps);
    });
  }
}

// A strided sample of 4096 encoded keys under digit(): the MSD split's cheap first look at whether
// bucket_ok would accept its buckets. biggest: the fullest bucket's count scaled to n keys (see
// SAMPLE_SLACK); varied: whether the sampled keys in that bucket differ.
struct SampleLook {
  double biggest;
  bool varied;
  int span_bits;  // the bit width of max - min of the sampled keys (the span the keys likely have)
};
template <int MB, class U, Enc E, class Digit>
static SampleLook sample_buckets(const U* in, int64_t n, const Coder<U, E>& cd, Digit digit) {
  constexpr int64_t SAMPLE = 4096;
  uint32_t count[1 << MB] = {};
  U first[1 << MB];
  bool varied[1 << MB] = {};
  uint32_t most = 0;
  U lo = U(~U(0)), hi = 0;
  for (int64_t j = 0; j < SAMPLE; ++j) {
    const U k = cd.enc(in[j * n / SAMPLE]);
    lo = std::min(lo, k);
    hi = std::max(hi, k);
    const uint32_t d = digit(k);
    if (count[d]++ == 0) first[d] = k;
    else varied[d] |= k != first[d];
    if (count[d] > count[most]) most = d;
  }
  return {(double)count[most] * (double)n / SAMPLE, varied[most], hi > lo ? 64 - __builtin_clzll((uint64_t)(hi - lo)) : 0};
}

template <class T_>
static void parallel_copy(T_* dst, const T_* src, int64_t n, int threads) {
  pk::parallel_ranges(n, n > (1 << 16) ? threads : 1,
                      [&](int, int64_t b, int64_t e) { std::memcpy(dst + b, src + b, sizeof(T_) * (e - b)); });
}

// Every key has the same sort bits: the input order is the sorted order (keys keep their exact bits).
template <class U>
static void copy_through(const SortArgs& a, int threads) {
  const int64_t n = a.n;
  if (a.out_keys) parallel_copy((U*)a.out_keys, (const U*)a.keys, n, threads);
  if (a.out_idx) pk::parallel_ranges(n, threads, [&](int, int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) a.out_idx[i] = i;
    });
  if (a.out_pay) parallel_copy((char*)a.out_pay, (const char*)a.pay, n * a.pay_size, threads);
}

// The split's alternative digits in turn, for both paths: the central range's (RangeDigit), then, where
// pieces is set, the pieces' (PiecePlan) and the binades' (LogDigit, plain then flipped), each planned from
// the sample hs, looked at through a strided sample and accepted where takes(look, digit) says so (which
// may plan hot keys for it). The first accepted is kept unless its sample's fullest bucket still holds more than `roomy`
// keys: then a later one that halves it replaces it (lognormal amounts: the pieces' fullest bucket
// ~55% of the keys, refused after the counting read; the binades' ~6%). rd.s >= 0, pd.sh >= 0 or
// lg.mb >= 0 says which was kept (look: its sample, and takes' state is the kept digit's); pp holds pd's
// tables.
template <class U, Enc E, class VOf, class Takes>
static void try_other_digits(const U* in, int64_t n, const Coder<U, E>& cd, const HotSample<U>& hs, VOf v_of, int w,
                             U kmin, U kmax, bool pieces, double roomy, Takes takes,
                             RangeDigit& rd, PiecePlan& pp, PieceDigit& pd, LogDigit& lg, SampleLook& look) {
  RangeDigit r;
  PieceDigit p;
  LogDigit g, gf;
  enum { NONE, RANGE, PIECES, BINADES, BINADES_FLIPPED } kept = NONE, last = NONE;
  SampleLook kept_raw{0.0, false, 0};  // the kept digit's sample before takes()
  double kept_big = 0;                 // its fullest bucket after takes()
  // whether digit `dig` (which) is kept: accepted, and first or halving the kept one's fullest
  auto consider = [&](int which, auto dig) {
    const SampleLook raw = sample_buckets<MSD_BITS>(in, n, cd, [&](U k) { return dig(v_of(k)); });
    SampleLook ll = raw;
    last = (decltype(last))which;
    if (!takes(ll, dig) || (kept != NONE && ll.biggest * 2 > kept_big)) return;
    kept = (decltype(kept))which;
    kept_raw = raw;
    kept_big = ll.biggest;
    look = ll;
  };
  auto settled = [&]() { return kept != NONE && kept_big / SAMPLE_SLACK <= roomy; };
  if (r.plan(hs.keys, v_of, w)) consider(RANGE, r);
  if (!settled() && pieces && pp.plan(hs.keys, v_of, (uint64_t)kmin, (uint64_t)kmax)) {
    p = PieceDigit(pp);
    consider(PIECES, p);
  }
  const uint64_t vmax = v_of(kmax);
  if (!settled() && pieces && g.plan(w, false, vmax)) consider(BINADES, g);
  if (!settled() && pieces && gf.plan(w, true, vmax)) consider(BINADES_FLIPPED, gf);
  if (kept != last && kept != NONE) {  // takes' state (hot keys) back to the kept digit's
    SampleLook ll = kept_raw;
    if (kept == RANGE) takes(ll, r);
    else if (kept == PIECES) takes(ll, p);
    else if (kept == BINADES) takes(ll, g);
    else takes(ll, gf);
  }
  if (kept == RANGE) rd = r;
  else if (kept == PIECES) pd = p;
  else if (kept == BINADES) lg = g;
  else if (kept == BINADES_FLIPPED) lg = gf;
}

// The wide MSD path: 64-bit keys spanning 2^32 or more (random int64 keys, hashes, nanosecond
// timestamps). Records are the full v = key - min (8 bytes, keys only) or {v, index or payload} (16
// bytes; 8-byte payloads travel too), split by the top byte of v's width into 256 buckets, each then
// sorted in cache by bucket_wide (a second split, insertion sorts of the small parts), instead of 6 DRAM
// passes of 12-byte (key, index) records. DRAM traffic per key with indices: 8 + 8 + 8 (min/max read,
// digit count, split read) + 16 (records out) + 16 (records back) + 16 (keys and indices out) = 72,
// against ~150 for the LSD engine.
// Returns false (having written nothing) where bucket_ok refuses the buckets (skewed keys).
template <class U, Enc E>
static bool msd_wide_sort(const SortArgs& a, const Coder<U, E>& cd, SortStats& st, int T, U kmin, U kmax,
                          bool lossy, bool guard) {
  static_assert(sizeof(U) == 8, "the wide path is for 64-bit keys");
  const int64_t n = a.n;
  constexpr int RB = MSD_BUCKETS;
  const int w = 64 - __builtin_clzll((uint64_t)(kmax - kmin));
  const int lb = w - MSD_BITS;  // >= 25: the span is at least 2^32
  const U* in = static_cast<const U*>(a.keys);
  const bool need_gather = lossy && a.out_keys;
  const bool keys_only = !need_gather && !a.out_pay && !a.out_idx;
  const bool carry_pay = !need_gather && !a.out_idx && a.out_keys && a.out_pay && (a.pay_size == 4 || a.pay_size == 8);
  if (!keys_only && !carry_pay && !a.out_idx && a.out_pay) return false;  // other payload sizes: LSD engine
  const size_t rec_bytes = keys_only ? 8 : 16;
  auto too_big = [&](double biggest, bool varied) {
    return guard && !bucket_ok(biggest, rec_bytes, n, WIDE_MAX_BUCKET_BYTES, varied, T);
  };
  auto digit = [kmin, lb](U k) { return (uint32_t)((uint64_t)(k - kmin) >> lb); };  // < 256: v < 2^w
  // keys the sample already shows refused (one value filling a bucket past L2, or a bucket past the
  // budget) leave without the counting read; the exact counts below decide the rest
  SampleLook look = sample_buckets<MSD_BITS>(in, n, cd, digit);
  // v of an encoded key: its offset from the keys' base (kmin, moved down where the flipped binades are the
  // split's digit: see LogDigit::rebase_flip)
  struct VBits {
    U base;
    uint64_t operator()(U k) const { return (uint64_t)(k - base); }
  } vbits{kmin};
  auto plain = [lb](uint64_t v) { return (uint32_t)(v >> lb); };
  // keys that fill much of a bucket get buckets of their own (HotPlan)
  HotPlan<uint64_t> hp;
  bool hot = false;
  HotSample<U> hs;
  // whether the digit dig, whose sample is lk, makes buckets the split takes (with hot keys or without)
  auto try_digit = [&](const SampleLook& lk, auto dig) {
    hot = false;
    if (hot_worth(lk.biggest, n, rec_bytes)) {
      hs.take(in, n, cd);
      hot = plan_hot<uint64_t>(hs, n, vbits, dig, hp) && !too_big(hp.biggest, hp.varied) &&
            hot_pays(hp, too_big(less_noise(lk.biggest, n), lk.varied),
                     less_noise(lk.biggest, n) * (double)rec_bytes > (double)HOT_BUCKET_BYTES);
    }
    return hot || !too_big(lk.biggest / SAMPLE_SLACK, lk.varied);
  };
  RangeDigit rd;  // rd.s >= 0: the split's digit is rd's (keys clustered between far outliers)
  PiecePlan pp;   // (pd.sh >= 0: the split's digit is pd's: keys crowding a few pieces of the span)
  PieceDigit pd;
  LogDigit lg;    // (lg.mb >= 0: the binades': power laws)
  const bool plain_ok = try_digit(look, plain);
  // Where the top byte's buckets are not surely taken (the sample's fullest less its noise refused: the
  // exact count would likely refuse them after a read) or one of them would hold more than 1/8 of the
  // keys past L2 (taken only because its keys differ), the central range's digit, else the pieces', where
  // its fullest bucket (hot keys apart) is at most half the top byte's; the central range's also where
  // the fullest would pass 2 MiB. 2 threads, old/new processes in turn, + indices: randn float64 (half
  // the keys in each of two buckets) 1M 17.4 -> 11.4 ms, 2M 44 -> 21, 4M 93 -> 48 (pieces); two clusters
  // of int64 ids 2^60 apart 74 -> 45 (pieces); rand / lognormal / exponential float64 4M 47-52 -> 37 (their
  // top binades over a few 4 MiB buckets, the lower ones skewed; the central range); keys only 1.1-1.9x.
  // (Not the pieces there: 16 shards of ids in the top bits, 16 even buckets of 4 MiB, sorted 36.4 ms
  // by the top byte, 41.5 by pieces.) Uniform keys never get here below 64M (buckets of n / 256).
  auto fullest = [&](const SampleLook& lk) { return hot ? hp.biggest : less_noise(lk.biggest, n); };
  const double plain_big = fullest(look);
  const bool refused = !hot && too_big(plain_big, look.varied);
  const bool crowded = plain_big * (double)rec_bytes > (double)L2_BUCKET_BYTES && plain_big * MSD_MIN_FANOUT > (double)n;
  const bool past_2m = plain_big * (double)rec_bytes > (double)HOT_BUCKET_BYTES;
  if (n >= HOT_MIN_N && (refused || crowded || past_2m)) {
    hs.take(in, n, cd);
    auto takes = [&](const SampleLook& ll, auto dig) {
      return try_digit(ll, dig) && (!plain_ok || fullest(ll) * 2 <= plain_big);
    };
    try_other_digits(in, n, cd, hs, vbits, w, kmin, kmax, refused || crowded,
                     (double)L2_BUCKET_BYTES / (double)rec_bytes, takes, rd, pp, pd, lg, look);
    if (rd.s < 0 && pd.sh < 0 && lg.mb < 0) try_digit(look, plain);  // (the plain digit's hot plan back)
    if (lg.mb >= 0 && lg.flip) {  // the records' v moved up (see LogDigit), the hot keys too
      kmin = U(kmin - U(lg.rebase_flip(w, hp)));
      vbits.base = kmin;
    }
  }
  const bool other_digit = rd.s >= 0 || pd.sh >= 0 || lg.mb >= 0;
  if (!other_digit && !plain_ok) return false;
  if (hot) look.varied = hp.varied;
  // f(digit) with the digit in use
  auto with_digit = [&](auto f) {
    if (rd.s >= 0) f(rd);
    else if (pd.sh >= 0) f(pd);
    else if (lg.mb >= 0) f(lg);
    else f(plain);
  };
  const int RBX = hot ? RB << HOT_BITS : RB;
  std::vector<uint32_t> hist((size_t)T * RBX, 0);
  with_digit([&](auto dig) {
    pk::parallel_threads(T, [&](int t) {
      const int64_t b = n * t / T, e = n * (t + 1) / T;
      const Coder<U, E> c = cd;
      if (hot) {
        count_digits<(RB << HOT_BITS)>(b, e, [&](int64_t i) {
          pk::prefetch_stream(in, i);
          const uint64_t v = vbits(c.enc(in[i]));
          return hp.ext(v, dig(v));
        }, hist.data() + (size_t)t * RBX);
      } else {
        count_digits<RB>(b, e, [&](int64_t i) {
          pk::prefetch_stream(in, i);
          return dig(vbits(c.enc(in[i])));
        }, hist.data() + (size_t)t * RB);
      }
    });
  });
  std::vector<int64_t> start(RBX + 1), pos((size_t)T * RBX);
  const int64_t biggest = hot ? split_offsets<MSD_BITS + HOT_BITS>(hist, T, start, pos, true)
                              : split_offsets<MSD_BITS>(hist, T, start, pos);
  if (too_big((double)biggest, look.varied)) return false;

  st.threads = T;
  st.lossy = lossy;
  st.msd = true;
  st.msd_bits = MSD_BITS;
  st.hot_keys = hot ? hp.keys : 0;
  st.range_digit = rd.s >= 0;
  st.piece_digit = pd.sh >= 0;
  st.log_digit = lg.mb >= 0;
  // keys only, the 8-byte records live in the output keys (in place, as in msd_hybrid_sort); else scratch
  // Where the 256 even buckets' starts alias in L2 (split_buckets_alias: 2^21-2^23 keys), the records go to
  // scratch with a line of gap before each bucket, and plain stores, as on the narrow path (streaming
  // stores at those sizes left powers of two 15-30% slower than their neighbours: 2 threads, random int64,
  // 2^22 keys + indices 36.5 ms against 28.4 at 4.15M, keys only 31.1 against 26.3).
  const int64_t gap = !hot && !other_digit && a.nt_stores < 0 && (size_t)n * rec_bytes >= SPLIT_STREAM_MIN_BYTES &&
                              split_buckets_alias(n, rec_bytes, RB)
                          ? 64 / (int64_t)rec_bytes
                          : 0;
  char* base = keys_only && !gap ? static_cast<char*>(a.out_keys)
                                 : thread_scratch().get((size_t)(n + gap * RB) * rec_bytes + 64);
  std::vector<int64_t> split_pos = pos;  // (bucket d's records from start[d] + d * gap)
  for (int t = 0; gap && t < T; ++t)
    for (int d = 0; d < RB; ++d) split_pos[(size_t)t * RB + d] += d * gap;
  auto rec_at = [&](int64_t b) {  // where bucket [b, ...)'s records are
    if (!gap) return b;
    return b + gap * ((std::upper_bound(start.begin(), start.end(), b) - start.begin()) - 1);
  };
  std::atomic<int> most_live{0}, width{0};
  const Coder<U, E> c0 = cd;
  auto key_of = [c0, kmin](uint64_t v) { return c0.dec(U(kmin + (U)v)); };

  auto split_and_sort = [&](auto* rec, auto make, auto out) {
    using Rec = std::remove_pointer_t<decltype(rec)>;
    auto sort_bucket = [&](Rec* tmp, uint32_t* bh, int64_t b, int64_t m, int64_t, int64_t) {
      int w0 = 0;
      // the bits that vary inside the bucket (rd's outlier buckets: all of them)
      const int64_t rb = rec_at(b);
      const uint64_t v0 = v_of(rec[rb]);
      const int lbb = rd.s >= 0    ? rd.bits_below(v0, w)
                      : pd.sh >= 0 ? pd.bits_below(v0, w)
                      : lg.mb >= 0 ? lg.bits_below(v0, w)
                                   : lb;
      const int live = bucket_wide(rec + rb, tmp, m, lbb, bh, &w0, [out, b](int64_t q, const Rec& x) { out(b + q, x); });
      if (m == biggest) width.store(w0, std::memory_order_relaxed);
      int seen = most_live.load(std::memory_order_relaxed);
      while (live > seen && !most_live.compare_exchange_weak(seen, live, std::memory_order_relaxed)) {}
    };
    // plain stores into uneven buckets unless the config says (the default's aliasing guard is for even ones)
    const int uneven_nt = a.nt_stores < 0 ? 0 : a.nt_stores;
    with_digit([&](auto dig) {
      if (hot) {
        const HotPlan<uint64_t>* h = &hp;
        split_scatter<MSD_BITS + HOT_BITS>(T, n, pos, rec, in, cd, uneven_nt, vbits,
                                           [h, dig](uint64_t v) { return h->ext(v, dig(v)); }, make, MSD_BITS);
        for_each_bucket<MSD_BITS + HOT_BITS, Rec>(T, start, biggest, WIDE_HIST_WORDS, false, sort_bucket, true);
        copy_hot_buckets(T, start, rec, out);
      } else {
        split_scatter<MSD_BITS>(T, n, split_pos, rec, in, cd, gap || other_digit ? uneven_nt : a.nt_stores,
                                 vbits, dig, make);
        for_each_bucket<MSD_BITS, Rec>(T, start, biggest, WIDE_HIST_WORDS, false, sort_bucket);
      }
    });
    st.passes = 1 + most_live.load();
    st.skipped = 0;
    st.digit_bits = width.load();
  };

  if (keys_only) {
    U* ok = static_cast<U*>(a.out_keys);
    split_and_sort(reinterpret_cast<uint64_t*>(base), [](uint64_t v, int64_t) { return v; },
                   [ok, key_of](int64_t q, uint64_t x) { ok[q] = key_of(x); });
    return true;
  }
  Wide* rec = reinterpret_cast<Wide*>(base);
  if (carry_pay) {
    U* ok = static_cast<U*>(a.out_keys);
    if (a.pay_size == 4) {
      const uint32_t* pin = static_cast<const uint32_t*>(a.pay);
      uint32_t* pout = static_cast<uint32_t*>(a.out_pay);
      split_and_sort(rec, [pin](uint64_t v, int64_t i) { return Wide{v, pin[i]}; },
                     [ok, pout, key_of](int64_t q, const Wide& x) {
                       ok[q] = key_of(x.v);
                       pout[q] = (uint32_t)x.p;
                     });
    } else {
      const uint64_t* pin = static_cast<const uint64_t*>(a.pay);
      uint64_t* pout = static_cast<uint64_t*>(a.out_pay);
      split_and_sort(rec, [pin](uint64_t v, int64_t i) { return Wide{v, pin[i]}; },
                     [ok, pout, key_of](int64_t q, const Wide& x) {
                       ok[q] = key_of(x.v);
                       pout[q] = x.p;
                     });
    }
    return true;
  }
  int64_t* idx = a.out_idx;
  if (!idx) idx = reinterpret_cast<int64_t*>(thread_own_outputs().get((size_t)n * 8 + 64));
  U* ok = need_gather ? nullptr : static_cast<U*>(a.out_keys);
  auto make = [](uint64_t v, int64_t i) { return Wide{v, (uint64_t)i}; };
  if (ok) {
    split_and_sort(rec, make, [ok, idx, key_of](int64_t q, const Wide& x) {
      ok[q] = key_of(x.v);
      idx[q] = (int64_t)x.p;
    });
  } else {
    split_and_sort(rec, make, [idx](int64_t q, const Wide& x) { idx[q] = (int64_t)x.p; });
  }
  gather_by_index<U>(a, idx, need_gather);
  return true;
}

// The narrow records (msd_hybrid_sort's buckets, direct_cached_sort's one) by what the call wants: keys
// only {v} (4 bytes), keys with a 4-byte payload {v, payload}, or index mode {v, index} (8 bytes) with the
// keys written unless they are gathered from the input afterwards (need_gather: canonicalised floats) or
// not wanted, and other payloads gathered through the indices. sort(rec, make, out) builds the records with
// make(v, i), sorts them and hands each to out(position, record); records(same_size_output) says where
// they live (the output array of their size where there is one: see msd_hybrid_sort).
template <class U, class KeyOf, class Records, class Sort>
static void by_record_mode(const SortArgs& a, bool keys_only, bool carry_pay, bool need_gather, KeyOf key_of,
                           Records&& records, Sort&& sort) {
  if (keys_only) {
    U* ok = static_cast<U*>(a.out_keys);
    uint32_t* rec = reinterpret_cast<uint32_t*>(records(sizeof(U) == 4 ? ok : nullptr));
    sort(rec, [](uint32_t v, int64_t) { return v; }, [ok, key_of](int64_t q, uint32_t x) { ok[q] = key_of(x); });
    return;
  }
  if (carry_pay) {
    U* ok = static_cast<U*>(a.out_keys);
    const uint32_t* pin = static_cast<const uint32_t*>(a.pay);
    uint32_t* pout = static_cast<uint32_t*>(a.out_pay);
    sort(reinterpret_cast<uint64_t*>(records(nullptr)), [pin](uint32_t v, int64_t i) { return (uint64_t)v << 32 | pin[i]; },
         [ok, pout, key_of](int64_t q, uint64_t x) {
           ok[q] = key_of((uint32_t)(x >> 32));
           pout[q] = (uint32_t)x;
         });
    return;
  }
  int64_t* idx = a.out_idx;
  if (!idx) idx = reinterpret_cast<int64_t*>(thread_own_outputs().get((size_t)a.n * 8 + 64));
  U* ok = need_gather ? nullptr : static_cast<U*>(a.out_keys);
  auto make = [](uint32_t v, int64_t i) { return (uint64_t)v << 32 | (uint32_t)i; };
  uint64_t* rec = reinterpret_cast<uint64_t*>(records(idx));  // 8-byte records in the int64 indices
  if (ok) {
    sort(rec, make, [ok, idx, key_of](int64_t q, uint64_t x) {
      ok[q] = key_of((uint32_t)(x >> 32));
      idx[q] = (int64_t)(uint32_t)x;
    });
  } else {  // argsort, or keys gathered afterwards: only the indices leave
    sort(rec, make, [idx](int64_t q, uint64_t x) { idx[q] = (int64_t)(uint32_t)x; });
  }
  gather_by_index<U>(a, idx, need_gather);
}

// Returns false (having written nothing) where the LSD engine should sort instead.
//   The records hold v = key - min (encoded keys, so order is kept) when max - min < 2^32: all 32-bit
//   keys, and 64-bit keys spanning less than 2^32 (ids, indices, timestamps, small ranges of either
//   sign). The MSD digit is the top byte of v's width, so small ints spread over the buckets too. One
//   read finds min and max (for 32-bit keys it also counts the top byte, which random keys use as the
//   digit with min taken as 0), a second counts the digit where that was not it.
template <class U, Enc E, int MB>
bool msd_hybrid_sort(const SortArgs& a, const Coder<U, E>& cd, SortStats& st, int T, bool* wider) {
  if constexpr (sizeof(U) < 4) {
    return false;
  } else {
    const int64_t n = a.n;
    constexpr int key_bits = 8 * sizeof(U);
    const int eb = a.end_bit < 0 ? key_bits : a.end_bit;
    // msd: 0 off; -1 heuristic (from MSD_MIN_N keys, where bucket_ok accepts the buckets); 1 the same skew guard
    // at any size (what the autotuner may pick on random keys: it must not push skewed keys of the same
    // size and dtype into one DRAM-sized bucket); 2 always where the keys allow it (tests)
    if (a.msd == 0 || a.begin_bit != 0 || eb != key_bits) return false;
    if (a.msd < 0 && (n < MSD_MIN_N || (n < MSD_CACHED_N && T < 2))) return false;
    const bool guard = a.msd < 2;
    // an 8-byte payload travels with its key in the LSD engine; the narrow records carry 4 bytes (the
    // wide path's 16-byte records take 8)
    const bool pay8 = a.out_pay && a.pay_size == 8 && !a.out_idx;
    if (pay8 && key_bits == 32) return false;
    if (!a.out_keys && !a.out_idx) return false;
    constexpr int RB = 1 << MB;
    const U* in = static_cast<const U*>(a.keys);
    const size_t guess_bytes = (!a.out_idx && !a.out_pay) ? 4 : 8;
    // fits: the digit choice (made the same way with or without the guard, so msd=2 runs both plans);
    // too_big: the refusal, off when forced
    auto fits = [&](double biggest, size_t bytes, bool varied) {
      return bucket_ok(biggest, bytes, n, MSD_MAX_BUCKET_BYTES, varied, T);
    };
    auto too_big = [&](double biggest, size_t bytes, bool varied) { return guard && !fits(biggest, bytes, varied); };

    std::vector<uint32_t> hist((size_t)T * RB, 0);
    std::vector<U> min_t(T, U(~U(0))), max_t(T, U(0));
    std::vector<char> lossy_t(T, 0);
    // Keys that fill much of a bucket get buckets of their own (HotPlan; 256-bucket splits only): hp in
    // v-space of the digit in use (the plain digit's shift lb_hot, or rd's).
    HotPlan<uint32_t> hp;
    bool hot = false;
    int lb_hot = 0;
    constexpr int RBX = MB == MSD_BITS ? RB << HOT_BITS : RB;  // the extended digit's buckets
    HotSample<U> hs;  // taken once, where the first digit looks worth it
    RangeDigit rd;  // rd.s >= 0: the split's digit is rd's (see msd_wide_sort)
    PiecePlan pp;   // pd.sh >= 0: the split's digit is pd's (see msd_wide_sort)
    PieceDigit pd;
    LogDigit lg;    // lg.mb >= 0: the binades' (see msd_wide_sort)
    // digit: the plain digit (v >> lb) & 255, rd or pd
    auto try_hot = [&](SampleLook& lk, auto v_of, auto digit, int lb) {
      hot = false;
      if constexpr (MB == MSD_BITS) {
        if (hot_worth(lk.biggest, n, guess_bytes)) {
          hs.take(in, n, cd);
          // (and only where the hot keys' own buckets make the split fit: else the plans without them)
          hot = plan_hot<uint32_t>(hs, n, v_of, digit, hp) &&
                fits(hp.biggest, guess_bytes, hp.varied) &&
                hot_pays(hp, !fits(less_noise(lk.biggest, n), guess_bytes, lk.varied), false);
        }
        if (hot) {  // (hp.biggest already less its noise: the callers' SAMPLE_SLACK undone)
          lb_hot = lb;
          lk.biggest = hp.biggest * SAMPLE_SLACK;
          lk.varied = hp.varied;
        }
      }
      const size_t rb = hot ? RBX : RB;
      hist.assign((size_t)T * rb, 0u);
    };
    // one read: lossy floats, and either the min and max of the encoded keys or (count_top) the top MB
    // bits. Counting the top bits, the min and max are not needed: the sample showed keys spanning more
    // than the bits below the digit (so not all equal), and v = key; should the exact counts then refuse
    // the digit, a second read finds them. (4M int32 keys + indices 20.7 -> 19.4 ms, 16M uint32 keys
    // 70.9 -> 69.6, 2 threads.)
    auto first_read = [&](auto count_top) {  // count_top: std::true_type / std::false_type
      pk::parallel_threads(T, [&](int t) {
        const int64_t b = n * t / T, e = n * (t + 1) / T;
        const Coder<U, E> c = cd;
        U ka = U(~U(0)), ko = 0;
        bool ls = false;
        if constexpr (decltype(count_top)::value) {
          if (hot) {
            count_digits<RBX>(b, e, [&](int64_t i) {
              pk::prefetch_stream(in, i);
              const U x = in[i];
              if constexpr (E == Enc::Float) ls |= c.lossy(x);
              const uint32_t v = (uint32_t)c.enc(x);
              return hp.ext(v, v >> (key_bits - MB));
            }, hist.data() + (size_t)t * RBX);
          } else {
            count_digits<RB>(b, e, [&](int64_t i) {
              pk::prefetch_stream(in, i);
              const U x = in[i];
              if constexpr (E == Enc::Float) ls |= c.lossy(x);
              return (uint32_t)(c.enc(x) >> (key_bits - MB));
            }, hist.data() + (size_t)t * RB);
          }
        } else {
          for (int64_t i = b; i < e; ++i) {
            pk::prefetch_stream(in, i);
            const U x = in[i];
            if constexpr (E == Enc::Float) ls |= c.lossy(x);
            const U k = c.enc(x);
            ka = std::min(ka, k);
            ko = std::max(ko, k);
          }
        }
        min_t[t] = ka;
        max_t[t] = ko;
        lossy_t[t] = ls;
      });
    };
    std::vector<int64_t> start(RB + 1), pos((size_t)T * RB);
    auto offsets = [&]() {
      if constexpr (MB == MSD_BITS) {
        if (hot) {
          start.resize(RBX + 1);
          pos.resize((size_t)T * RBX);
          return split_offsets<MB + HOT_BITS>(hist, T, start, pos, true);
        }
      }
      start.resize(RB + 1);
      pos.resize((size_t)T * RB);
      return split_offsets<MB>(hist, T, start, pos);
    };

    // 32-bit keys: a strided sample says whether the top byte spreads them (random keys): then it is
    // the digit, counted in the first read. Otherwise (and for 64-bit keys) the digit is the top byte of
    // the varying bits, counted in a second read. The top byte is chosen only when it spreads the keys
    // by itself (varied = false below): small ints share one top byte, and a varied bucket of all of
    // them would pass bucket_ok as one bucket, sorted by one thread, where the span's top byte spreads
    // them over 256.
    bool top_digit = false;
    SampleLook look{0.0, false, 0};  // the sample of the digit in use
    if constexpr (key_bits == 32) {
      look = sample_buckets<MB>(in, n, cd, [](U k) { return (uint32_t)(k >> (32 - MB)); });
      if (look.span_bits > 32 - MB)
        try_hot(look, [](U k) { return (uint32_t)k; }, [](uint32_t v) { return v >> (32 - MB); }, 32 - MB);
      // (a sampled span within the bits below the top MB: the top bits barely vary, and below L2 size
      // their one bucket would still pass fits; the span's own top bits are the digit)
      top_digit = look.span_bits > 32 - MB && fits(look.biggest / SAMPLE_SLACK, guess_bytes, false);
      // narrow keys inside the caches (see below), told by the sample before any read
      if (a.msd < 0 && n < MSD_CACHED_N && look.span_bits > 0 && look.span_bits <= 16) return false;
      if constexpr (MB == MSD_BITS) {
        // Keys spanning (nearly) the whole range whose top byte is not surely taken (randn floats;
        // uniform(-1, 1) floats, whose span is 31 bits, and uniform(-1000, 1000), whose top byte's fullest
        // bucket the sample's slack let through to a counting read and a refusal) while their top 11 bits
        // spread them: the caller's 2048-bucket split, before this attempt reads anything (4M floats +
        // indices 35-38 -> 21 ms). (A narrower span keeps this path: the span's top byte spreads them.)
        if (!hot && look.span_bits >= 31 && !fits(less_noise(look.biggest, n), guess_bytes, false) &&
            fits(sample_buckets<MSD_BITS_CLUSTERED>(in, n, cd, [](U k) { return (uint32_t)(k >> (32 - MSD_BITS_CLUSTERED)); })
                         .biggest / SAMPLE_SLACK, guess_bytes, false)) {
          *wider = true;
          return false;
        }
      }
    }
    int64_t biggest = 0;
    if (top_digit) {
      first_read(std::true_type());
      biggest = offsets();
      if (!fits((double)biggest, guess_bytes, false)) top_digit = false;
    }
    if (!top_digit) first_read(std::false_type());
    U kmin = U(~U(0)), kmax = 0;
    bool lossy = false;
    for (int t = 0; t < T; ++t) {
      kmin = std::min(kmin, min_t[t]);
      kmax = std::max(kmax, max_t[t]);
      lossy |= lossy_t[t] != 0;
    }
    if (!top_digit && kmin == kmax) {  // every key the same: copied through here (the LSD engine would read them again)
      st.passes = 0;
      st.skipped = (key_bits + st.digit_bits - 1) / st.digit_bits;
      st.lossy = lossy;
      st.threads = T;
      copy_through<U>(a, a.threads);
      return true;
    }
    U base_key = 0;  // v = key - base_key
    int w = 32;      // bits of v
    if (!top_digit) {
      const uint64_t span = (uint64_t)(kmax - kmin);
      if (span >> 32) {  // 64-bit keys spanning 2^32 or more: full-width records
        if constexpr (key_bits == 64 && MB == MSD_BITS) return msd_wide_sort<U, E>(a, cd, st, T, kmin, kmax, lossy, guard);
        return false;
      }
      if (pay8) return false;
      w = 64 - __builtin_clzll(span);
      // Inside the caches a span of at most 16 bits leaves the LSD engine two passes (it skips the
      // trivial ones), cheaper than the split's second read and scatter: int32 keys below 1000, 100K
      // keys only, 0.68x split; 4 distinct values + indices at 40K, 0.70x.
      if (a.msd < 0 && n < MSD_CACHED_N && w <= 16) return false;
      base_key = kmin;
      // the digit exactly as the split computes it: bits [w - 8, w) of v
      const int lbd = std::max(w - MB, 0);
      auto v_of = [base_key](U k) { return (uint32_t)(k - base_key); };
      auto plain = [lbd](uint32_t v) { return (v >> lbd) & (RB - 1); };
      look = sample_buckets<MB>(in, n, cd, [&](U k) { return plain(v_of(k)); });
      [[maybe_unused]] const SampleLook plain_look = look;  // (before try_hot puts the hot plan's fullest bucket in)
      try_hot(look, v_of, plain, lbd);
      if constexpr (MB == MSD_BITS) {
        // Not surely taken (the sample's fullest less its noise refused), or one bucket past L2 would
        // hold more than 1/8 of the keys: the central range's digit first (keys between far outliers: see
        // RangeDigit), else the pieces' (PieceDigit: clusters far apart, int32 ids in two ranges 2^30
        // apart 4M + indices 31.5 -> 18.8 ms), where the plain one is refused or they halve its fullest.
        auto fullest = [&](const SampleLook& lk) { return hot ? hp.biggest : less_noise(lk.biggest, n); };
        const double plain_big = fullest(look);
        const bool refused = !hot && too_big(plain_big, guess_bytes, look.varied);
        const bool crowded = plain_big * (double)guess_bytes > (double)L2_BUCKET_BYTES && plain_big * MSD_MIN_FANOUT > (double)n;
        if (n >= HOT_MIN_N && (refused || crowded)) {
          hs.take(in, n, cd);
          auto takes = [&](SampleLook& ll, auto dig) {
            ll.span_bits = look.span_bits;
            try_hot(ll, v_of, dig, lbd);
            return (hot || !too_big(ll.biggest / SAMPLE_SLACK, guess_bytes, ll.varied)) &&
                   (refused || fullest(ll) * 2 <= plain_big);
          };
          try_other_digits(in, n, cd, hs, v_of, w, kmin, kmax, true, (double)L2_BUCKET_BYTES / (double)guess_bytes,
                           takes, rd, pp, pd, lg, look);
          if (rd.s < 0 && pd.sh < 0 && lg.mb < 0) {
            look = plain_look;
            try_hot(look, v_of, plain, lbd);  // (the plain digit's hot plan and counters back)
          }
          if (lg.mb >= 0 && lg.flip)  // the records' v moved up (see LogDigit), the hot keys too
            base_key = U(base_key - U(lg.rebase_flip(w, hp)));
        }
      }
      if (too_big(look.biggest / SAMPLE_SLACK, guess_bytes, look.varied))
        return false;  // skewed keys (see bucket_ok): the LSD engine, without this read
      auto count_by = [&](auto digit) {
        pk::parallel_threads(T, [&](int t) {
          const int64_t b = n * t / T, e = n * (t + 1) / T;
          const Coder<U, E> c = cd;
          if (hot) {
            count_digits<RBX>(b, e, [&](int64_t i) {
              pk::prefetch_stream(in, i);
              const uint32_t v = (uint32_t)(c.enc(in[i]) - base_key);
              return hp.ext(v, digit(v));
            }, hist.data() + (size_t)t * RBX);
          } else {
            count_digits<RB>(b, e, [&](int64_t i) {
              pk::prefetch_stream(in, i);
              return digit((uint32_t)(c.enc(in[i]) - base_key));
            }, hist.data() + (size_t)t * RB);
          }
        });
      };
      if (rd.s >= 0) count_by(rd);
      else if (pd.sh >= 0) count_by(pd);
      else if (lg.mb >= 0) count_by(lg);
      else count_by(plain);
      biggest = offsets();
    }
    const bool need_gather = lossy && a.out_keys;
    const bool keys_only = !need_gather && !a.out_pay && !a.out_idx;
    const bool carry_pay = !need_gather && !a.out_idx && a.out_keys && a.out_pay && a.pay_size == 4;
    const size_t rec_bytes = keys_only ? 4 : 8;
    // skewed keys (one bucket past L2 size holding most keys, all one value in the sample, or past the
    // budget): the LSD engine sorts them. (look.varied describes the sample's fullest bucket, which for
    // skewed keys is the exact counts' biggest too.)
    if (too_big((double)biggest, rec_bytes, look.varied)) return false;

    const int lb = std::max(w - MB, 0);  // bits sorted inside a bucket, below the digit
    st.threads = T;
    {
      int wid[3] = {0, 0, 0};
      bucket_plan(biggest, rec_bytes, lb, wid);
      st.digit_bits = wid[0];
    }
    st.lossy = lossy;
    st.msd = true;
    st.msd_bits = MB;
    st.hot_keys = hot ? hp.keys : 0;
    st.range_digit = rd.s >= 0;
    st.piece_digit = pd.sh >= 0;
    st.log_digit = lg.mb >= 0;
    const bool other_digit = rd.s >= 0 || pd.sh >= 0 || lg.mb >= 0;
    // The records live in the output array of their size where there is one: a bucket's records
    // [b, b + m) become its outputs [b, b + m) in place (read into the cache, sorted there, written back
    // to the same lines: no scratch pages and no read-for-ownership of the outputs). Else in scratch.
    // Where the 256 buckets' starts alias in L2 (split_buckets_alias: 2^22 int32 + indices, 2^23 and 2^24
    // keys), the records go to scratch instead, with a line of gap before each bucket (bucket d's records
    // from start[d] + d * gap), so the plain stores win there too rather than the streaming lines.
    // (Not with hot keys or the range digit: their buckets are uneven.)
    const int64_t gap = MB == MSD_BITS && !hot && !other_digit && a.nt_stores < 0 && (size_t)n * rec_bytes >= SPLIT_STREAM_MIN_BYTES &&
                                split_buckets_alias(n, rec_bytes, RB)
                            ? 64 / (int64_t)rec_bytes
                            : 0;
    auto records = [&](void* same_size_output) -> char* {
      if (same_size_output && gap == 0) return static_cast<char*>(same_size_output);
      return thread_scratch().get((size_t)(n + gap * RB) * rec_bytes + 64);
    };
    std::vector<int64_t> gapped_pos;
    if (gap) {
      gapped_pos = pos;
      for (int t = 0; t < T; ++t)
        for (int d = 0; d < RB; ++d) gapped_pos[(size_t)t * RB + d] += d * gap;
    }
    std::vector<int64_t>& split_pos = gap ? gapped_pos : pos;
    // (hot keys, the range digit: plain stores, as into 256 even buckets that do not alias)
    const int split_nt = gap || ((hot || other_digit) && a.nt_stores < 0) ? 0 : a.nt_stores;
    // where bucket [b, ...) of the outputs has its records
    auto rec_at = [&](int64_t b) {
      if (!gap) return b;
      const int64_t d = (std::upper_bound(start.begin(), start.end(), b) - start.begin()) - 1;
      return b + d * gap;
    };
    // stats: the bucket with the most in-bucket passes run (fewest skipped on a tie), packed as
    // live * 8 + (7 - skipped) for one atomic max
    std::atomic<int> most_live{0};
    const Coder<U, E> c0 = cd;
    auto vbits = [base_key](U k) { return (uint32_t)(k - base_key); };
    auto key_of = [c0, base_key](uint32_t v) { return c0.dec(U(base_key + v)); };

    auto split_and_sort = [&](auto* rec, auto make, auto out) {
      using Rec = std::remove_pointer_t<decltype(rec)>;
      // the keys' own top bits (random keys): a constant shift and no base, 16M uint32 keys in 256 buckets
      // 94.7 -> 80.7 ms, in 2048 buckets 72.3 -> 68.5 (2 threads, Zen 2)
      auto sort_bucket = [&](Rec* tmp, uint32_t* bh, int64_t b, int64_t m, int64_t nb, int64_t nm) {
        constexpr int KS = sizeof(Rec) == 8 ? 32 : 0;
        // the bits that vary inside the bucket (the range digit's outlier buckets: all w)
        const uint32_t v0 = (uint32_t)(rec[rec_at(b)] >> KS);
        const int lbb = rd.s >= 0    ? rd.bits_below(v0, w)
                        : pd.sh >= 0 ? pd.bits_below(v0, w)
                        : lg.mb >= 0 ? lg.bits_below(v0, w)
                                     : lb;
        int wid[3];
        const int planned = bucket_plan(m, sizeof(Rec), lbb, wid);
        const int live = bucket_lsd<Rec, KS>(rec + rec_at(b), tmp, m, lbb, bh, {rec + (nm ? rec_at(nb) : 0), nm},
                                             [out, b](int64_t q, Rec x) { out(b + q, x); });
        const int packed = live * 8 + (7 - (planned - live));
        int seen = most_live.load(std::memory_order_relaxed);
        while (packed > seen && !most_live.compare_exchange_weak(seen, packed, std::memory_order_relaxed)) {}
      };
      bool done = false;
      if constexpr (MB == MSD_BITS) {
        auto run = [&](auto digit) {
          if (hot) {  // (gap is 0: the records' positions are the outputs')
            const HotPlan<uint32_t>* h = &hp;
            split_scatter<MB + HOT_BITS>(T, n, split_pos, rec, in, cd, split_nt, vbits,
                                         [h, digit](uint32_t v) { return h->ext(v, digit(v)); }, make, MB);
            for_each_bucket<MB + HOT_BITS, Rec>(T, start, biggest, 3 * 4096, true, sort_bucket, true);
            copy_hot_buckets(T, start, rec, out);
          } else {
            split_scatter<MB>(T, n, split_pos, rec, in, cd, split_nt, vbits, digit, make);
            for_each_bucket<MB, Rec>(T, start, biggest, 3 * 4096, true, sort_bucket);
          }
        };
        if (rd.s >= 0) {
          run(rd);
          done = true;
        } else if (pd.sh >= 0) {
          run(pd);
          done = true;
        } else if (lg.mb >= 0) {
          run(lg);
          done = true;
        } else if (hot) {
          const int lh = lb_hot;
          run([lh](uint32_t v) { return (v >> lh) & (RB - 1); });
          done = true;
        }
      }
      if (!done) {
        if (base_key == 0 && lb == 32 - MB) {
          split_scatter<MB>(T, n, split_pos, rec, in, cd, split_nt, [](U k) { return (uint32_t)k; },
                            [](uint32_t v) { return v >> (32 - MB); }, make);
        } else {
          split_scatter<MB>(T, n, split_pos, rec, in, cd, split_nt, vbits,
                            [lb](uint32_t v) { return (v >> lb) & (RB - 1); }, make);
        }
        for_each_bucket<MB, Rec>(T, start, biggest, 3 * 4096, true, sort_bucket);
      }
      st.passes = 1 + most_live.load() / 8;
      st.skipped = 7 - most_live.load() % 8;
    };

    by_record_mode<U>(a, keys_only, carry_pay, need_gather, key_of, records, split_and_sort);
    return true;
  }
}


// Inputs whose records fit the caches whole (at most SMALL_BUCKET_BYTES, below MSD_MIN_N keys: one
// thread): msd_hybrid_sort's in-bucket sort run on the whole input as its one bucket, without a split.
// One read finds the min, max and lossy floats; the records {v = key - min} (keys only) or {v, index or
// 4-byte payload} are built in one more, then sorted by bucket_lsd's passes of up to 11-12 bits over v's
// bits (trivial ones skipped) and written out in order. The LSD engine, built for DRAM-sized inputs
// (slices, next-pass counting), took 4 passes of 8 bits at ~9 cycles per key each here. Measured on a
// 2-core Zen 3 (one process, best of 7, random keys, the native call from Python, LSD engine -> this):
// int32 + indices 2000 keys 23.1 -> 18.9 us, 8000 77.7 -> 62.5, 12000 113 -> 89; int32 keys only 4000
// 40.4 -> 26.7; int64 + indices 8000 92.3 -> 63.2; randn float32 keys only 12000 153 -> 113; 1.1x at 500
// keys. Returns false where it does not apply (the caller goes on).
template <class U, Enc E>
bool direct_cached_sort(const SortArgs& a, const Coder<U, E>& cd, SortStats& st) {
  if constexpr (sizeof(U) < 4) {
    return false;
  } else {
    const int64_t n = a.n;
    constexpr int key_bits = 8 * sizeof(U);
    const int eb = a.end_bit < 0 ? key_bits : a.end_bit;
    if (a.msd >= 0 || a.digit_bits > 0 || a.begin_bit != 0 || eb != key_bits || n >= MSD_MIN_N) return false;
    if (!a.out_keys && !a.out_idx) return false;
    if (a.out_pay && a.pay_size == 8 && !a.out_idx) return false;  // the engine carries 8-byte payloads
    const bool maybe_keys_only = !a.out_pay && !a.out_idx;
    if ((size_t)n * (maybe_keys_only ? 4 : 8) > SMALL_BUCKET_BYTES) return false;
    const U* in = static_cast<const U*>(a.keys);
    const Coder<U, E> c0 = cd;
    U kmin = U(~U(0)), kmax = 0;
    bool lossy = false;
    for (int64_t i = 0; i < n; ++i) {
      const U x = in[i];
      if constexpr (E == Enc::Float) lossy |= c0.lossy(x);
      const U k = c0.enc(x);
      kmin = std::min(kmin, k);
      kmax = std::max(kmax, k);
    }
    const uint64_t span = (uint64_t)(kmax - kmin);
    if (span >> 32) return false;  // 64-bit keys spanning 2^32 or more
    const int w = span ? 64 - __builtin_clzll(span) : 0;
    const bool need_gather = lossy && a.out_keys;
    const bool keys_only = !need_gather && maybe_keys_only;
    const bool carry_pay = !need_gather && !a.out_idx && a.out_keys && a.out_pay && a.pay_size == 4;
    const size_t rec_bytes = keys_only ? 4 : 8;
    if ((size_t)n * rec_bytes > SMALL_BUCKET_BYTES) return false;
    const U base_key = kmin;
    auto key_of = [c0, base_key](uint32_t v) { return c0.dec(U(base_key + v)); };
    static thread_local std::vector<uint32_t> hist(3 * 4096);
    int wid[3] = {0, 0, 0};
    const int planned = bucket_plan(n, rec_bytes, w, wid);
    int live = 0;
    auto sort_records = [&](auto* rec, auto make, auto out) {
      using Rec = std::remove_pointer_t<decltype(rec)>;
      constexpr int KS = sizeof(Rec) == 8 ? 32 : 0;
      static thread_local std::vector<Rec> tmp;
      if ((int64_t)tmp.size() < n) tmp.resize((size_t)n);
      for (int64_t i = 0; i < n; ++i) rec[i] = make((uint32_t)(c0.enc(in[i]) - base_key), i);
      live = bucket_lsd<Rec, KS>(rec, tmp.data(), n, w, hist.data(), {nullptr, 0}, out);
    };
    auto records = [&](void* same_size_output) -> char* {
      if (same_size_output) return static_cast<char*>(same_size_output);
      return thread_scratch().get((size_t)n * rec_bytes + 64);
    };
    by_record_mode<U>(a, keys_only, carry_pay, need_gather, key_of, records, sort_records);
    st.passes = live;
    st.skipped = planned - live;
    st.digit_bits = wid[0];
    st.threads = 1;
    st.lossy = lossy;
    return true;
  }
}

// 8- and 16-bit keys alone (no indices, no payload, every bit): a counting sort. One read counts every
// key value (256 or 65536 counters per thread, inside L2), then each value is written out as a run of its
// count (sequential stores, no scatter). An LSD sort reads and writes the keys twice for 16-bit keys: 1M
// int16 keys 4.3 -> 1.4 ms, 4M 17.4 -> 3.1, 4M uint8 6.9 -> 2.4 (2 threads, Zen 2). Refused (false) for
// floats whose encoding is lossy (NaN payloads, -0.0 beside +0.0: their outputs must be the input's bits,
// in input order), found in the same read: the LSD engine sorts those, as it does a config that sets
// digit_bits (the autotuner's alternatives).
// What it costs besides the keys is a walk over the counters, so 8-bit keys take it at every size past
// the small sort's (256 counters: uint8 1000 keys 11.8 -> 5.5 us, 40000 129 -> 39 us, one thread, 2-core
// Zen 4) and 16-bit keys from COUNT_FILL_MIN_N16. That walk is kept cheap: the counters live in the
// calling thread's scratch (no page faults: fresh vectors of 256 KiB each cost more than 1000 keys'
// LSD passes), the threads' tables are summed into the first with vector adds, and no per-value start
// offsets are built: 256-value block sums place each thread's share of the output, and the fill walks
// the counts. Every value stores one 16-byte line of copies at its run's start whether the run is empty,
// short or long (the next value's line overwrites what lies past the run), and only runs longer than
// the line take a second, predictable branch; a branch on "is this run empty" mispredicted on about half
// the values where runs are a few keys long (random int16 keys, n near 65536).
static constexpr int64_t COUNT_FILL_MIN_N16 = 1 << 15;

template <class U, Enc E>
bool counting_fill(const SortArgs& a, const Coder<U, E>& cd, SortStats& st, int T) {
  static_assert(sizeof(U) <= 2, "8- and 16-bit keys");
  constexpr int64_t R = int64_t(1) << (8 * sizeof(U));
  constexpr int64_t BLOCK = 256, NB = R / BLOCK;  // value blocks whose sums place the threads' shares
  constexpr int64_t LINE = 16 / sizeof(U);
  const int64_t n = a.n;
  const U* in = static_cast<const U*>(a.keys);
  U* out = static_cast<U*>(a.out_keys);
  uint32_t* counts = reinterpret_cast<uint32_t*>(thread_scratch().get((size_t)T * R * sizeof(uint32_t)));
  std::vector<char> lossy_t(T, 0);
  pk::parallel_threads(T, [&](int t) {
    const int64_t b = n * t / T, e = n * (t + 1) / T;
    uint32_t* __restrict h = counts + (size_t)t * R;  // this thread's own lines (R * 4 bytes: whole lines)
    std::memset(h, 0, R * sizeof(uint32_t));
    const Coder<U, E> c = cd;
    bool ls = false;
    for (int64_t i = b; i < e; ++i) {
      pk::prefetch_stream(in, i);
      const U x = in[i];
      if constexpr (E == Enc::Float) ls |= c.lossy(x);
      ++h[c.enc(x)];
    }
    lossy_t[t] = ls;
  });
  for (int t = 0; t < T; ++t)
    if (lossy_t[t]) return false;
  uint32_t* __restrict cnt = counts;  // every thread's counts summed into the first table
  for (int t = 1; t < T; ++t) {
    const uint32_t* __restrict h = counts + (size_t)t * R;
    for (int64_t v = 0; v < R; ++v) cnt[v] += h[v];
  }
  int64_t block_start[NB + 1];
  block_start[0] = 0;
  for (int64_t b = 0; b < NB; ++b) {
    uint32_t sum = 0;  // (a block holds at most n < 2^32 keys)
    for (int64_t v = 0; v < BLOCK; ++v) sum += cnt[b * BLOCK + v];
    block_start[b + 1] = block_start[b] + sum;
  }
  // each thread fills an equal share [p0, p1) of the output positions
  pk::parallel_threads(T, [&](int t) {
    const int64_t p0 = n * t / T, p1 = n * (t + 1) / T;
    if (p0 >= p1) return;
    U* __restrict o = out;  // locals: through the lambda's references every store reloaded them
    const uint32_t* __restrict cnt_v = cnt;
    const Coder<U, E> c = cd;
    // the value whose run holds position p0, and where that run ends
    const int64_t blk = (std::upper_bound(block_start, block_start + NB + 1, p0) - block_start) - 1;
    int64_t v = blk * BLOCK, s = block_start[blk];
    while (s + cnt_v[v] <= p0) s += cnt_v[v++];
    int64_t p = p0, q = s + cnt_v[v];
    while (q + LINE <= p1) {  // while this value's line stays inside the share
      U line[LINE];
      const U val = c.dec(U(v));
      for (int64_t k = 0; k < LINE; ++k) line[k] = val;
      std::memcpy(o + p, line, sizeof(line));
      if (q - p > LINE) std::fill(o + p + LINE, o + q, val);
      p = q;
      q = p + cnt_v[++v];  // (v < R - 1 here: the last value's run ends at n >= p1)
    }
    for (;;) {  // the share's last line: exact stores
      const int64_t e = std::min(q, p1);
      if (e > p) std::fill(o + p, o + e, c.dec(U(v)));
      p = e;
      if (p >= p1) break;
      q = p + cnt_v[++v];
    }
  });
  st.passes = 1;
  st.digit_bits = 8 * (int)sizeof(U);
  st.threads = T;
  return true;
}

// 8- and 16-bit keys with indices (sort/argsort of int8/uint8/bool/int16/uint16/float16/bfloat16 tensors,
// every bit) or a 4/8-byte payload instead (sort_pairs): the LSD engine's passes stalled on their stores here (~9 cycles a key) and ran
// below torch.sort's own radix sort from 64K to 1M keys (int16 1M: 3.9 vs 2.8 ms). Instead:
//   8-bit keys: one counting scatter. One read counts each thread's keys (4 interleaved tables, so repeated
//     values do not serialize on one counter); each thread writes its keys' indices to its share of their
//     value's run (stable: threads in input order; 256 open lines, in L1) and fills its share of the keys
//     with the value.
//   16-bit keys: an MSD split by the top byte (Polychroniou & Ross, see msd_hybrid_sort), then a counting
//     sort of each bucket by the low byte inside the cache. The split writes 4-byte records (index << 8 |
//     low byte: one open line per digit, 16 KiB in all); the buckets go to threads in contiguous runs of
//     about n / T keys, and each writes its keys (from the two bytes, or from the input through the index
//     where the float encoding is lossy: exact bits) and int64 indices straight to their final places,
//     with the next bucket's output lines prefetched for writing (1M keys on one thread: 6.2 -> 3.5 ms).
//     Refused (false, after one counting read) for integers of a span of up to 11 bits (the LSD engine's
//     one pass over key - min). Skewed keys (a bucket holding most of them: the
//     exponents of bfloat16 randn, half the keys one value) stay here: measured faster than the engine's
//     two passes all the same.
// Measured on the 2-core Zen 4 (2 threads, values + indices, random keys; LSD engine -> this): int16 64K
// 0.25 -> 0.13 ms, 256K 0.98 -> 0.44, 1M 3.9 -> 1.7, 4M 15.8 -> 7.8, 16M 69 -> 49 (torch.sort 0.19, 0.65,
// 2.8, 59, 300); uint8 64K 0.11 -> 0.06, 1M 1.6 -> 0.74, 4M 6.4 -> 4.2, but 8M 13 -> 18: past ~4M keys
// (36 MiB of outputs) plain stores of 1-byte keys' indices lose to the engine's streaming lines.
static constexpr int64_t NARROW_IDX_MIN_N = 24576;  // 16-bit keys (below, 256 buckets of a few keys each cost
                                                   // more than they save: int16 2K 14 -> 36 us, 16K 67 -> 80)
static constexpr int64_t NARROW8_IDX_MIN_N = 2048;  // 8-bit keys (2K 10.0 -> 8.7 us, 16K 38 -> 26, 1 thread)
static constexpr int64_t NARROW_IDX_MAX_N = int64_t(1) << 24;   // 16-bit keys (24-bit record indices)
static constexpr int64_t NARROW8_IDX_MAX_N = int64_t(1) << 22;  // 8-bit keys
// sort_pairs of 16-bit keys with 4/8-byte payloads, measured the same way (LSD engine -> this): int16 keys,
// int32 payload 64K 0.42 -> 0.23 ms, 256K 1.10 -> 0.82, 1M 4.2 -> 3.5, but 2M 8.4 -> 8.6; int64 payload
// 1M 4.5 -> 4.4 (1-byte keys: 2x at every size, they read the payload in order)
static constexpr size_t NARROW_PAY_MAX_BYTES = size_t(4) << 20;  // 16-bit keys' payloads

// P: what the keys carry: int64_t = their indices (out_idx), uint32_t/uint64_t = a 4- or 8-byte payload
// (out_pay, read from a.pay through the index).
template <class U, Enc E, class P>
bool narrow_index_sort(const SortArgs& a, const Coder<U, E>& cd, SortStats& st, int T) {
  static_assert(sizeof(U) <= 2, "8- and 16-bit keys");
  constexpr bool IDX = std::is_same_v<P, int64_t>;
  const int64_t n = a.n;
  const U* in = static_cast<const U*>(a.keys);
  U* ok = static_cast<U*>(a.out_keys);
  P* oi = IDX ? reinterpret_cast<P*>(a.out_idx) : static_cast<P*>(a.out_pay);
  const P* pay = static_cast<const P*>(a.pay);
  constexpr int RB = 256;
  constexpr int HI = 8 * (int)sizeof(U) - 8;  // the split digit's shift (0 for 8-bit keys: the whole key)
  std::vector<uint32_t> counts((size_t)T * RB);
  std::vector<char> lossy_t(T, 0);
  pk::parallel_threads(T, [&](int t) {
    const int64_t b = n * t / T, e = n * (t + 1) / T;
    uint32_t h[4][RB] = {{0}};  // (on the stack: this thread's own lines, see OwnCounters)
    const Coder<U, E> c = cd;
    bool ls = false;
    int64_t i = b;
    for (; i + 4 <= e; i += 4) {
      // (prefetch_stream fires only where i starts a line: a step of 4 from an unaligned b never does)
      pk::prefetch_stream_range(in, i, 4);
      const U x0 = in[i], x1 = in[i + 1], x2 = in[i + 2], x3 = in[i + 3];
      if constexpr (E == Enc::Float) ls |= c.lossy(x0) | c.lossy(x1) | c.lossy(x2) | c.lossy(x3);
      ++h[0][c.enc(x0) >> HI];
      ++h[1][c.enc(x1) >> HI];
      ++h[2][c.enc(x2) >> HI];
      ++h[3][c.enc(x3) >> HI];
    }
    for (; i < e; ++i) {
      if constexpr (E == Enc::Float) ls |= c.lossy(in[i]);
      ++h[0][c.enc(in[i]) >> HI];
    }
    for (int d = 0; d < RB; ++d) counts[(size_t)t * RB + d] = h[0][d] + h[1][d] + h[2][d] + h[3][d];
    lossy_t[t] = ls;
  });
  bool lossy = false;
  for (int t = 0; t < T; ++t) lossy |= lossy_t[t] != 0;
  // offsets[t][d]: where thread t's keys of digit d start; bucket[d]: where digit d starts
  std::vector<int64_t> offsets((size_t)T * RB), bucket(RB + 1);
  int64_t run = 0;
  for (int d = 0; d < RB; ++d) {
    bucket[d] = run;
    for (int t = 0; t < T; ++t) {
      offsets[(size_t)t * RB + d] = run;
      run += counts[(size_t)t * RB + d];
    }
  }
  bucket[RB] = run;
  if constexpr (E == Enc::Xor && sizeof(U) == 2) {  // a narrow span: the LSD engine's one pass over key - min
    int dmin = 0, dmax = RB - 1;
    while (bucket[dmin + 1] == 0) ++dmin;
    while (bucket[dmax] == n) --dmax;
    // a span of up to 11 bits (max - min < 2048, span_base's one pass) meets at most 9 top bytes; at 9
    // the keys' min and max decide (one more read): 2048-2303 values would take the engine's 2 passes
    if (dmax - dmin <= 7) return false;
    if (dmax - dmin == 8) {
      U lo = U(~U(0)), hi = 0;
      for (int64_t i = 0; i < n; ++i) {
        const U k = cd.enc(in[i]);
        lo = std::min(lo, k);
        hi = std::max(hi, k);
      }
      if (hi - lo < 2048) return false;
    }
  }
  static_assert(NARROW_IDX_MAX_N <= (int64_t(1) << 24), "records hold 24-bit indices");
  // 16-bit keys: the split's records (index << 8 | low byte)
  uint32_t* recs =
      sizeof(U) == 2 ? reinterpret_cast<uint32_t*>(thread_scratch().get((size_t)n * 4 + 64)) : nullptr;
  pk::parallel_threads(T, [&](int t) {  // the scatter by the top byte (8-bit keys: the whole key), stable
    const int64_t b = n * t / T, e = n * (t + 1) / T;
    int64_t pos[RB];
    std::memcpy(pos, &offsets[(size_t)t * RB], sizeof(pos));
    const Coder<U, E> c = cd;
    // (local restrict copies: the captured pointers were reloaded after every store)
    const U* __restrict src = in;
    P* __restrict di = oi;
    const P* __restrict sp = pay;
    uint32_t* __restrict rec = recs;
    for (int64_t i = b; i < e; ++i) {
      pk::prefetch_stream(src, i);
      const U k = c.enc(src[i]);
      if constexpr (sizeof(U) == 1) {
        if constexpr (IDX) di[pos[k]++] = i;
        else di[pos[k]++] = sp[i];
      } else {
        rec[pos[k >> HI]++] = (uint32_t)i << 8 | (uint8_t)k;
      }
    }
    if constexpr (sizeof(U) == 1)
      if (ok)
        for (int d = 0; d < RB; ++d) {
          const int64_t p0 = offsets[(size_t)t * RB + d];
          if (pos[d] > p0) std::memset(ok + p0, (int)c.dec(U(d)), (size_t)(pos[d] - p0));
        }
  });
  st.msd = true;  // (stats: the keys went to buckets by their top byte; for 8-bit keys that was all)
  st.msd_bits = 8;
  if constexpr (sizeof(U) == 1) {
    st.passes = 1;
    st.digit_bits = 8;
  } else {
    // buckets to threads: contiguous runs of digits, cut where the keys before reach t * n / T
    std::vector<int> first(T + 1, RB);
    first[0] = 0;
    for (int t = 1, d = 0; t < T; ++t) {
      while (d < RB && bucket[d] < n * t / T) ++d;
      first[t] = d;
    }
    // KEYS: 0 none (argsort), 1 from the digits, 2 from the input (lossy floats: exact bits)
    auto buckets = [&](int t, auto keys_tag) {
      constexpr int KEYS = decltype(keys_tag)::value;
      const Coder<U, E> c = cd;
      const uint32_t* __restrict rec = recs;
      const U* __restrict src = in;
      U* __restrict dk = ok;
      P* __restrict di = oi;
      const P* __restrict sp = pay;
      for (int d = first[t]; d < first[t + 1]; ++d) {
        const int64_t s = bucket[d], e = bucket[d + 1];
        if (e == s) continue;
        uint32_t h[RB] = {0};
        for (int64_t j = s; j < e; ++j) ++h[rec[j] & 255];
        int64_t pos[RB], r = s;
        for (int l = 0; l < RB; ++l) {
          pos[l] = r;
          r += h[l];
        }
        const U hi = U(d << HI);
        // the next bucket's output lines are fetched for writing while this one is sorted: its writes
        // land all over its ~10 bytes a key of outputs, and each line's read-for-ownership otherwise
        // stalls the stores (the same relative position, one line of indices per 8 keys)
        const int64_t s2 = e, e2 = d + 1 < first[t + 1] ? bucket[d + 2] : e;
        for (int64_t j = s; j < e; ++j) {
          const int64_t ahead = s2 + (j - s);
          if (((j - s) & 7) == 0 && ahead < e2) {
            PK_PREFETCH_W(di + ahead);
            if constexpr (KEYS != 0)
              if (((j - s) & (64 / sizeof(U) - 1)) == 0) PK_PREFETCH_W(dk + ahead);
          }
          if constexpr (!IDX)  // the payload of a later record: its index ascends through the input
            if (j + 16 < e) PK_PREFETCH_R(sp + (rec[j + 16] >> 8));
          const uint32_t l = rec[j] & 255, x = rec[j] >> 8;
          const int64_t p = pos[l]++;
          if constexpr (KEYS == 1) dk[p] = c.dec(U(hi | l));
          if constexpr (KEYS == 2) dk[p] = src[x];
          if constexpr (IDX) di[p] = x;
          else di[p] = sp[x];
        }
      }
    };
    pk::parallel_threads(T, [&](int t) {
      if (!ok) buckets(t, std::integral_constant<int, 0>());
      else if (!lossy) buckets(t, std::integral_constant<int, 1>());
      else buckets(t, std::integral_constant<int, 2>());
    });
    st.passes = 2;
    st.digit_bits = 8;
  }
  st.threads = T;
  st.lossy = lossy;
  return true;
}

// Integer keys whose span (max - min) needs fewer passes than their bits vary over: the LSD engine sorts
// key - min (Codec::base), so the digits above the span are constant and skipped. Keys around zero are
// the case: -500..500 as int64 differ in all 64 bits (two's complement), 8 passes of 8 bits, where
// their span is 10 bits, one pass (100K int64 keys + indices: ~2.5 ms, as long as torch.sort, before).
// A strided sample of 256 keys decides whether to read them all for their min and max (random keys of
// the full width spend nothing more); returns false when no pass would be saved. base: the encoded min,
// span_bits: the bit width of the encoded max - min.
template <class U, Enc E>
static bool span_base(const SortArgs& a, const Coder<U, E>& cd, int T, U& base, int& span_bits) {
  const U* in = static_cast<const U*>(a.keys);
  const int64_t n = a.n;
  auto width = [](U v) { return v ? 64 - __builtin_clzll((uint64_t)v) : 0; };
  // the passes a span of `bits` takes: one of up to 11 bits, else 8-bit digits
  auto passes = [](int bits) { return bits <= 11 ? 1 : (bits + 7) / 8; };
  auto digits = [](int bits) { return (bits + 7) / 8; };
  {
    constexpr int64_t SAMPLE = 256;
    const U k0 = cd.enc(in[0]);
    U lo = k0, hi = k0, diff = 0;
    for (int64_t j = 1; j < SAMPLE; ++j) {
      const U k = cd.enc(in[j * n / SAMPLE]);
      lo = std::min(lo, k);
      hi = std::max(hi, k);
      diff = U(diff | (k ^ k0));
    }
    if (passes(width(U(hi - lo))) >= digits(width(diff))) return false;
  }
  std::vector<U> lo_t(T, U(~U(0))), hi_t(T, U(0));
  pk::parallel_threads(T, [&](int t) {
    const int64_t b = n * t / T, e = n * (t + 1) / T;
    U lo = U(~U(0)), hi = 0;
    for (int64_t i = b; i < e; ++i) {
      const U k = cd.enc(in[i]);
      lo = k < lo ? k : lo;
      hi = k > hi ? k : hi;
    }
    lo_t[t] = lo;
    hi_t[t] = hi;
  });
  const U lo = *std::min_element(lo_t.begin(), lo_t.end()), hi = *std::max_element(hi_t.begin(), hi_t.end());
  span_bits = width(U(hi - lo));
  // every key lies in [lo, hi]: their bits above the width of lo ^ hi are all alike (skipped passes)
  if (passes(span_bits) >= digits(width(U(lo ^ hi)))) return false;
  base = lo;
  return true;
}

// Input already in the sort's order: 1 when its keys are non-decreasing on the sort bits after the
// order-preserving transform (a stable sort moves nothing), -1 when strictly decreasing (the sort
// reverses it: no equal keys whose order could matter), else 0. Branch-free compares in blocks that the
// compiler vectorizes, stopping after the first block that is neither: random keys stop within the first
// block (~0.1 us), while sorted input (timestamps, ids, sorting sorted data) skips every radix pass.
// torch.sort's adaptive stable sort was 2-8x faster than our passes on such input (sweep, 2026-12-05).
template <class U, Enc E>
static int input_order(const SortArgs& a, const Coder<U, E>& cd, U kmask) {
  const U* in = static_cast<const U*>(a.keys);
  constexpr int64_t B = 256;
  bool ascending = true, descending = true;
  // one OR-reduction a loop (pairs (in[i - 1], in[i]) for i in [b, e)), so each vectorizes; once one
  // order is ruled out only the other is checked (two reductions in one loop ran scalar: a sorted input
  // disordered at its end cost +27-41% over the sort without the check)
  auto broken = [&](int64_t b, int64_t e, bool up) {
    unsigned r = 0;
    if (up) {
      for (int64_t i = b; i < e; ++i) r |= unsigned(U(cd.enc(in[i - 1]) & kmask) > U(cd.enc(in[i]) & kmask));
    } else {
      for (int64_t i = b; i < e; ++i) r |= unsigned(U(cd.enc(in[i - 1]) & kmask) <= U(cd.enc(in[i]) & kmask));
    }
    return r != 0;
  };
  for (int64_t b = 1; b < a.n && (ascending || descending); b += B) {
    const int64_t e = std::min(a.n, b + B);
    if (ascending) ascending = !broken(b, e, true);
    if (descending) descending = !broken(b, e, false);
  }
  return ascending ? 1 : descending ? -1 : 0;
}

template <class U>
static void reverse_through(const SortArgs& a, int threads) {
  const int64_t n = a.n;
  const U* in = static_cast<const U*>(a.keys);
  pk::parallel_ranges(n, threads, [&](int, int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t src = n - 1 - i;
      if (a.out_keys) static_cast<U*>(a.out_keys)[i] = in[src];
      if (a.out_idx) a.out_idx[i] = src;
      if (a.out_pay) std::memcpy((char*)a.out_pay + i * a.pay_size, (const char*)a.pay + src * a.pay_size, a.pay_size);
    }
  });
}

template <class U, Enc E>
void radix_sort_typed(const SortArgs& a, const Codec<U>& codec, SortStats& st) {
  Coder<U, E> cd{codec};
  const int key_bits = 8 * sizeof(U);
  const int bb = a.begin_bit, eb = a.end_bit < 0 ? key_bits : a.end_bit;
  const int64_t n = a.n;
  st.threads = 1;
  if (n <= 0) return;
  const U kmask = (eb - bb >= key_bits) ? Codec<U>::ALL : U(((U(1) << (eb - bb)) - 1) << bb);
  if (n <= a.small_n || n <= 1) {
    st.small = true;
    small_sort<U, E>(a, cd, kmask);
    return;
  }
  if (n >= (int64_t(1) << 32)) pk::fail_value("sort", "at most 2^32 - 1 keys per CPU sort call");
  int T = std::max(1, a.threads);
  T = (int)std::max<int64_t>(1, std::min<int64_t>(T, n / std::max<int64_t>(1, a.grain)));
  if (const int order = a.in_order ? input_order<U, E>(a, cd, kmask) : 0) {  // (stats: no pass ran)
    if (order > 0) copy_through<U>(a, T);
    else reverse_through<U>(a, T);
    return;
  }
  if (T == 1 && direct_cached_sort<U, E>(a, cd, st)) return;
  if constexpr (sizeof(U) <= 2) {
    if (a.out_keys && !a.out_idx && !a.out_pay && bb == 0 && eb == key_bits && a.digit_bits <= 0 &&
        (sizeof(U) == 1 || n >= COUNT_FILL_MIN_N16) &&
        counting_fill<U, E>(a, cd, st, T))
      return;
    if (bb == 0 && eb == key_bits && a.msd != 0 && a.digit_bits <= 0 &&
        n >= (sizeof(U) == 1 ? NARROW8_IDX_MIN_N : NARROW_IDX_MIN_N) &&
        n <= (sizeof(U) == 1 ? NARROW8_IDX_MAX_N : NARROW_IDX_MAX_N)) {
      if (a.out_idx && !a.out_pay && narrow_index_sort<U, E, int64_t>(a, cd, st, T)) return;
      // a payload instead of the indices, while it fits the caches (16-bit keys read it in index order
      // but bucket by bucket: a line per record where it lies in DRAM)
      const bool pay_fits = sizeof(U) == 1 || (size_t)n * a.pay_size <= NARROW_PAY_MAX_BYTES;
      if (!a.out_idx && a.out_pay && a.out_keys && pay_fits) {
        if (a.pay_size == 4 && narrow_index_sort<U, E, uint32_t>(a, cd, st, T)) return;
        if (a.pay_size == 8 && narrow_index_sort<U, E, uint64_t>(a, cd, st, T)) return;
      }
    }
  }
  // Heuristics for digit_bits = 0 / wc = -1 (the autotuner's default config), measured on a 2-core Zen 4:
  // on one thread, while keys + what they carry fit in 16 MiB, 8-bit digits with plain stores (1.3-2x
  // faster than write-combined 11-bit passes from 2K to 2M keys); otherwise write-combining lines, with
  // 11-bit digits for >= 32-bit keys past 64K keys. Plain stores on two threads ran 2x slower than
  // either on one (measured at 1M-2M keys), so they are only the default on one thread.
  const size_t carried = a.out_idx ? 4 : (a.pay ? (size_t)a.pay_size : 0);
  const bool plain_fits = T == 1 && (size_t)n * (sizeof(U) + carried) <= (size_t(16) << 20);
  int db = a.digit_bits;
  if (db <= 0) db = plain_fits ? 8 : (sizeof(U) >= 4 && n >= (1 << 16)) ? 11 : 8;
  db = std::max(1, std::min({db, 11, eb - bb}));
  st.digit_bits = db;

  if (n >= (int64_t(1) << 20)) {  // the caller's fresh outputs: not yet touched, so the hint still counts
    if (a.out_keys) advise_huge(a.out_keys, (size_t)n * sizeof(U));
    if (a.out_idx) advise_huge(a.out_idx, (size_t)n * 8);
    if (a.out_pay) advise_huge(a.out_pay, (size_t)n * a.pay_size);
  }
  bool wider = false;  // the 256-bucket attempt's sample says 2048 buckets spread the keys (before any read)
  // the heuristic's split takes its own grain (MSD_GRAIN); a chosen msd (0/1/2, a tuned config) the config's
  const int T_msd = a.msd < 0 ? (int)std::max<int64_t>(1, std::min<int64_t>(std::max(1, a.threads), n / MSD_GRAIN)) : T;
  if constexpr (sizeof(U) == 4) {
    // a tuned msd_bits = 11: 2048 buckets of a few thousand records, each sorted by two passes inside
    // L1/L2. A refusal there (skewed keys) would refuse 256 coarser buckets too.
    if (a.msd_bits == MSD_BITS_CLUSTERED) {
      if (msd_hybrid_sort<U, E, MSD_BITS_CLUSTERED>(a, cd, st, T_msd, &wider)) return;
      wider = false;
    } else if (msd_hybrid_sort<U, E, MSD_BITS>(a, cd, st, T_msd, &wider)) {
      return;
    }
    // clustered 32-bit keys: 2048 buckets before the LSD engine (also with msd_bits = 8, which a tuner
    // picks on uniform keys: clustered keys of the same dtype and size still spread this way)
    if (wider && msd_hybrid_sort<U, E, MSD_BITS_CLUSTERED>(a, cd, st, T_msd, &wider)) return;
  } else {
    if (msd_hybrid_sort<U, E, MSD_BITS>(a, cd, st, T_msd, &wider)) return;
  }
  Coder<U, E> lsd_cd = cd;
  int lsd_eb = eb;
  if constexpr (E == Enc::Xor && sizeof(U) >= 2) {
    int span_bits;
    if (bb == 0 && eb == key_bits && a.digit_bits <= 0 && span_base<U>(a, cd, T, lsd_cd.c.base, span_bits)) {
      lsd_eb = std::max(span_bits, 1);
      if (lsd_eb <= 11) db = lsd_eb;  // one pass (write-combined past 8 bits)
      st.digit_bits = db;
    }
  }
  Engine<U, E> eng(a, lsd_cd, st);
  eng.wc = a.wc < 0 ? !(plain_fits && db <= 8) : a.wc > 0;
  for (int s = bb; s < lsd_eb; s += db) eng.passes.push_back({s, std::min(db, lsd_eb - s)});
  while (T > 1 && (int64_t)T * T * (1 << db) > (1 << 22)) --T;  // bounds the next-pass count tables
  eng.T = T;
  st.threads = T;
  eng.histogram(db);
  const int R = eng.R;
  std::vector<int> live;
  for (int j = 0; j < (int)eng.passes.size(); ++j) {
    bool trivial = false;
    for (int d = 0; d < R; ++d)
      if (eng.ghist[(size_t)j * R + d] == n) { trivial = true; break; }
    if (!trivial) live.push_back(j);
  }
  st.passes = (int)live.size();
  st.skipped = (int)eng.passes.size() - st.passes;
  st.lossy = eng.lossy;
  const int threads = a.threads;

  if (live.empty()) {  // every key has the same sort bits
    copy_through<U>(a, threads);
    return;
  }

  // Choose how the payload travels. Exact-bits output of canonicalised floats needs the indices.
  const bool need_gather = eng.lossy && a.out_keys;
  if (!need_gather && a.out_pay == nullptr && a.out_idx == nullptr) {
    eng.template run_passes<uint32_t, 0>(live, (U*)a.out_keys, nullptr);
    return;
  }
  if (!need_gather && !a.out_idx && a.out_keys && a.out_pay && (a.pay_size == 4 || a.pay_size == 8)) {
    if (a.pay_size == 4) eng.template run_passes<uint32_t, 1>(live, (U*)a.out_keys, a.out_pay);
    else eng.template run_passes<uint64_t, 1>(live, (U*)a.out_keys, a.out_pay);
    return;
  }
  // Index mode: sort (key, index), then gather what was not carried.
  Scratch& own = thread_own_outputs();  // outputs the caller did not ask for (uninitialised, reused)
  const size_t ib = ((size_t)n * 8 + 63) & ~size_t(63);
  char* ob = own.get(ib + (size_t)n * sizeof(U) + 64);
  int64_t* idx = a.out_idx ? a.out_idx : reinterpret_cast<int64_t*>(ob);
  U* ok = (U*)a.out_keys;
  if (!ok || need_gather) ok = reinterpret_cast<U*>(ob + ib);
  // argsort (no keys wanted, none to gather): the last pass writes only the indices.
  eng.template run_passes<uint32_t, 2>(live, ok, idx, !a.out_keys && !need_gather);
  gather_by_index<U>(a, idx, need_gather);
}

// Key width and codec of each dtype.
template <class F>
void with_codec(DType dt, bool descending, F&& f) {
  auto fl = [&](auto zero, uint64_t inf, uint64_t qnan) {
    using U = decltype(zero);
    Codec<U> c;
    c.flip = descending ? Codec<U>::ALL : U(0);
    c.inf_bits = (U)inf;
    c.qnan_bits = (U)qnan;
    f(c, std::integral_constant<int, 1>());
  };
  auto xr = [&](auto zero, bool is_signed) {
    using U = decltype(zero);
    Codec<U> c;
    c.xor_mask = U((is_signed ? Codec<U>::SIGN : U(0)) ^ (descending ? Codec<U>::ALL : U(0)));
    f(c, std::integral_constant<int, 0>());
  };
  switch (dt) {
    case DType::Bool: case DType::UInt8: xr(uint8_t(0), false); break;
    case DType::Int8: xr(uint8_t(0), true); break;
    case DType::UInt16: xr(uint16_t(0), false); break;
    case DType::Int16: xr(uint16_t(0), true); break;
    case DType::UInt32: xr(uint32_t(0), false); break;
    case DType::Int32: xr(uint32_t(0), true); break;
    case DType::UInt64: xr(uint64_t(0), false); break;
    case DType::Int64: xr(uint64_t(0), true); break;
    case DType::Float16: fl(uint16_t(0), 0x7C00, 0x7E00); break;
    case DType::BFloat16: fl(uint16_t(0), 0x7F80, 0x7FC0); break;
    case DType::Float32: fl(uint32_t(0), 0x7F800000u, 0x7FC00000u); break;
    case DType::Float64: fl(uint64_t(0), 0x7FF0000000000000ull, 0x7FF8000000000000ull); break;
    default: pk::fail_value("sort", "unsupported key dtype code " + std::to_string((int)dt));
  }
}

SortStats radix_sort(const SortArgs& a) {
  SortStats st;
  with_codec(a.dtype, a.descending, [&](auto codec, auto kind) {
    using U = std::remove_cv_t<decltype(codec.xor_mask)>;
    if constexpr (decltype(kind)::value == 1) {
      if constexpr (sizeof(U) >= 2) radix_sort_typed<U, Enc::Float>(a, codec, st);
    } else {
      radix_sort_typed<U, Enc::Xor>(a, codec, st);
    }
  });
  if (a.n > 0) {
    thread_scratch().trim(SCRATCH_KEEP);
    thread_own_outputs().trim(SCRATCH_KEEP);
  }
  return st;
}

// ---------------------------------------------------------------------------------------------
// Segmented sort: many independent 1-D sorts. Segments are split over threads by element count;
// each segment is sorted on its thread with the path that fits its length: insertion sort for tiny
// segments, a comparison sort of packed (key, index) words for short ones (the index in the low bits
// makes std::sort stable), the single-threaded radix engine for long ones. Very long segments (few
// of them) get every thread through the parallel engine.
// ---------------------------------------------------------------------------------------------
struct SegArgs {
  const void* keys;
  DType dtype;
  const int64_t* offsets;  // nseg + 1 non-decreasing offsets, or null for rows of row_len
  int64_t nseg, row_len, total;
  // rows of row_len whose keys are `inner` elements apart (a tensor's dim of size row_len with inner
  // elements after it): row s starts at (s / inner) * row_len * inner + s % inner. 1: contiguous rows.
  int64_t inner = 1;
  void* out_keys;
  int64_t* out_idx;  // indices relative to the segment start, or null
  const void* pay;
  void* out_pay;
  int pay_size;
  bool descending;
  int threads;
  int digit_bits;
  int nt_stores;
};

// Batcher's odd-even merge sort network on N (a power of two) 64-bit words; padding words are all-ones.
template <int N>
static inline void sort_network(uint64_t* w) {
#pragma GCC unroll 64
  for (int p = 1; p < N; p <<= 1) {
#pragma GCC unroll 64
    for (int k = p; k >= 1; k >>= 1) {
#pragma GCC unroll 64
      for (int j = k % p; j + k < N; j += 2 * k) {
#pragma GCC unroll 64
        for (int i = 0; i < k && i + j + k < N; ++i) {
          if ((i + j) / (2 * p) == (i + j + k) / (2 * p)) {
            const uint64_t a = w[i + j], b = w[i + j + k];
            w[i + j] = a < b ? a : b;
            w[i + j + k] = a < b ? b : a;
          }
        }
      }
    }
  }
}

template <class U, Enc E>
void sort_short_segment(const SegArgs& g, const Coder<U, E>& cd, int64_t start, int64_t len) {
  const U* in = static_cast<const U*>(g.keys) + start;
  U* ok = g.out_keys ? static_cast<U*>(g.out_keys) + start : nullptr;
  int64_t* oi = g.out_idx ? g.out_idx + start : nullptr;
  const char* pin = g.pay ? static_cast<const char*>(g.pay) + start * g.pay_size : nullptr;
  char* pout = g.out_pay ? static_cast<char*>(g.out_pay) + start * g.pay_size : nullptr;
  const int ps = g.pay_size;
  auto emit = [&](int64_t i, uint32_t src) {
    if (ok) ok[i] = in[src];
    if (oi) oi[i] = src;
    if (pout) std::memcpy(pout + i * ps, pin + (int64_t)src * ps, ps);
  };
  if (len <= 1) {  // nothing to order (a network padded to 8 words cost ~30 ns a segment: 1M of length 1, 30 ms)
    if (len == 1) emit(0, 0);
    return;
  }
  if (sizeof(U) <= 4 && len <= 32) {
    // (key << 32 | position) words are distinct, so any sorting network sorts them stably. Batcher's
    // odd-even merge network compiles to branch-free min/max: insertion sort's data-dependent exits
    // mispredict about once per key on random rows.
    uint64_t w[32];
    for (int64_t i = 0; i < len; ++i) w[i] = ((uint64_t)cd.enc(in[i]) << 32) | (uint64_t)i;
    if (len <= 8) { for (int64_t i = len; i < 8; ++i) w[i] = ~uint64_t(0); sort_network<8>(w); }
    else if (len <= 16) { for (int64_t i = len; i < 16; ++i) w[i] = ~uint64_t(0); sort_network<16>(w); }
    else { for (int64_t i = len; i < 32; ++i) w[i] = ~uint64_t(0); sort_network<32>(w); }
    for (int64_t i = 0; i < len; ++i) emit(i, (uint32_t)w[i]);
    return;
  }
  if (len <= 32) {
    U k[32];
    uint32_t ix[32];
    for (int64_t i = 0; i < len; ++i) {
      U key = cd.enc(in[i]);
      int64_t j = i;
      while (j > 0 && k[j - 1] > key) { k[j] = k[j - 1]; ix[j] = ix[j - 1]; --j; }
      k[j] = key;
      ix[j] = (uint32_t)i;
    }
    for (int64_t i = 0; i < len; ++i) emit(i, ix[i]);
    return;
  }
  if constexpr (sizeof(U) <= 4) {
    static thread_local std::vector<uint64_t> w;
    w.resize(len);
    for (int64_t i = 0; i < len; ++i) w[i] = ((uint64_t)cd.enc(in[i]) << 32) | (uint64_t)i;
    std::sort(w.begin(), w.end());
    for (int64_t i = 0; i < len; ++i) emit(i, (uint32_t)w[i]);
  } else {
    struct KI { U k; uint32_t i; };
    static thread_local std::vector<KI> w;
    w.resize(len);
    for (int64_t i = 0; i < len; ++i) w[i] = {cd.enc(in[i]), (uint32_t)i};
    std::sort(w.begin(), w.end(), [](const KI& x, const KI& y) { return x.k < y.k || (x.k == y.k && x.i < y.i); });
    for (int64_t i = 0; i < len; ++i) emit(i, w[i].i);
  }
}

#if PK_X86
// ---------------------------------------------------------------------------------------------
// AVX-512 path for segments of 2..16 keys of 32 bits (1M rows of 16 is the benchmark shape): the row
// is one register. Keys are encoded in-register, packed with their position into 64-bit words
// (key << 32 | position: distinct, so any sorting network is stable), sorted in two registers by
// Batcher's bitonic network (Batcher 1968; in-register as in Chhugani et al., "Efficient
// implementation of sorting on multicore SIMD CPU architecture", VLDB 2008), and the outputs are
// permutes of the row by the sorted positions: exact input bits, no gathers.
// ---------------------------------------------------------------------------------------------
// Lanes of one register (global index BASE + lane) that keep the max in step (J, K) of the bitonic sort.
static constexpr unsigned bitonic_max_lanes(int j, int k, int base) {
  unsigned m = 0;
  for (int i = 0; i < 8; ++i) {
    const bool asc = ((base + i) & k) == 0, lower = (i & j) == 0;
    if (lower != asc) m |= 1u << i;
  }
  return m;
}

template <int J, int K, int BASE>
PK_TARGET_AVX512 static inline __m512i bitonic_step(__m512i v) {
  __m512i p;
  if constexpr (J == 1) p = _mm512_shuffle_epi32(v, _MM_PERM_BADC);     // swap neighbouring words
  else if constexpr (J == 2) p = _mm512_permutex_epi64(v, 0x4E);        // swap word pairs
  else p = _mm512_shuffle_i64x2(v, v, 0x4E);                              // swap halves
  constexpr __mmask8 mx = (__mmask8)bitonic_max_lanes(J, K, BASE);
  return _mm512_mask_blend_epi64(mx, _mm512_min_epu64(v, p), _mm512_max_epu64(v, p));
}

// Steps K = 2, 4, 8 of the bitonic sort: one register holding global lanes BASE..BASE+7.
template <int BASE>
PK_TARGET_AVX512 static inline __m512i bitonic_8(__m512i v) {
  v = bitonic_step<1, 2, BASE>(v);
  v = bitonic_step<2, 4, BASE>(v);
  v = bitonic_step<1, 4, BASE>(v);
  v = bitonic_step<4, 8, BASE>(v);
  v = bitonic_step<2, 8, BASE>(v);
  return bitonic_step<1, 8, BASE>(v);
}

template <Enc E>
PK_TARGET_AVX512 static inline __m512i encode16_avx512(const Coder<uint32_t, E>& cd, __m512i x) {
  if constexpr (E == Enc::Xor) {
    return _mm512_xor_si512(x, _mm512_set1_epi32((int)cd.c.xor_mask));
  } else {  // as Coder::enc: NaNs -> the quiet NaN, -0.0 -> +0.0, then sign-magnitude -> unsigned
    const __m512i mag = _mm512_and_si512(x, _mm512_set1_epi32(0x7FFFFFFF));
    x = _mm512_mask_mov_epi32(x, _mm512_cmpgt_epu32_mask(mag, _mm512_set1_epi32((int)cd.c.inf_bits)),
                              _mm512_set1_epi32((int)cd.c.qnan_bits));
    x = _mm512_maskz_mov_epi32(_mm512_test_epi32_mask(mag, mag), x);
    const __m512i flip = _mm512_mask_blend_epi32(_mm512_test_epi32_mask(x, _mm512_set1_epi32(INT32_MIN)),
                                                 _mm512_set1_epi32(INT32_MIN), _mm512_set1_epi32(-1));
    return _mm512_xor_si512(_mm512_xor_si512(x, flip), _mm512_set1_epi32((int)cd.c.flip));
  }
}

template <Enc E>
PK_TARGET_AVX512 static void sort_row16_avx512(const SegArgs& g, const Coder<uint32_t, E>& cd, int64_t start,
                                               int64_t len) {
  const __mmask16 m = (__mmask16)((1u << len) - 1);
  const uint32_t* in = static_cast<const uint32_t*>(g.keys) + start;
  const __m512i raw = _mm512_maskz_loadu_epi32(m, in);
  __m512i key = encode16_avx512<E>(cd, raw);
  key = _mm512_mask_mov_epi32(_mm512_set1_epi32(-1), m, key);  // padding sorts last (largest positions)
  const __m512i pos_lo = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i pos_hi = _mm512_set_epi64(15, 14, 13, 12, 11, 10, 9, 8);
  __m512i a = _mm512_or_si512(_mm512_slli_epi64(_mm512_cvtepu32_epi64(_mm512_castsi512_si256(key)), 32), pos_lo);
  __m512i b = _mm512_or_si512(_mm512_slli_epi64(_mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(key, 1)), 32),
                              pos_hi);
  a = bitonic_8<0>(a);
  if (len > 8) {
    b = bitonic_8<8>(b);
    const __m512i lo = _mm512_min_epu64(a, b), hi = _mm512_max_epu64(a, b);  // step J = 8, K = 16
    a = bitonic_step<1, 16, 0>(bitonic_step<2, 16, 0>(bitonic_step<4, 16, 0>(lo)));
    b = bitonic_step<1, 16, 8>(bitonic_step<2, 16, 8>(bitonic_step<4, 16, 8>(hi)));
  }
  const __m512i low32 = _mm512_set1_epi64(0xFFFFFFFF);
  const __m512i src_a = _mm512_and_si512(a, low32), src_b = _mm512_and_si512(b, low32);
  const __m512i src16 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi64_epi32(src_a)),
                                           _mm512_cvtepi64_epi32(src_b), 1);
  if (g.out_keys)
    _mm512_mask_storeu_epi32(static_cast<uint32_t*>(g.out_keys) + start, m, _mm512_permutexvar_epi32(src16, raw));
  if (g.out_idx) {
    _mm512_mask_storeu_epi64(g.out_idx + start, (__mmask8)(m & 0xFF), src_a);
    _mm512_mask_storeu_epi64(g.out_idx + start + 8, (__mmask8)(m >> 8), src_b);
  }
  if (g.out_pay) {
    const int ps = g.pay_size;
    const char* pin = static_cast<const char*>(g.pay) + start * ps;
    char* pout = static_cast<char*>(g.out_pay) + start * ps;
    if (ps == 4) {
      _mm512_mask_storeu_epi32(pout, m, _mm512_permutexvar_epi32(src16, _mm512_maskz_loadu_epi32(m, pin)));
    } else if (ps == 8) {
      const __m512i p0 = _mm512_maskz_loadu_epi64((__mmask8)(m & 0xFF), pin);
      const __m512i p1 = _mm512_maskz_loadu_epi64((__mmask8)(m >> 8), pin + 64);
      _mm512_mask_storeu_epi64(pout, (__mmask8)(m & 0xFF), _mm512_permutex2var_epi64(p0, src_a, p1));
      _mm512_mask_storeu_epi64(pout + 64, (__mmask8)(m >> 8), _mm512_permutex2var_epi64(p0, src_b, p1));
    } else {
      alignas(64) uint32_t src[16];
      _mm512_store_si512(src, src16);
      for (int64_t i = 0; i < len; ++i) std::memcpy(pout + i * ps, pin + (int64_t)src[i] * ps, ps);
    }
  }
}

// The same in-register sort for one segment of 17..128 keys of 32 bits, in NR = 4, 8 or 16 registers of
// 8 (key << 32 | position) words: the path of segments of varied lengths, which come one at a time (the
// lanes below need runs of one length). Before, 17-32 keys took the scalar network of sort_short_segment,
// 33-64 the insertion sort of radix_sort's small inputs, 65-128 std::sort: segments of uniform random
// length 0..64, 1M float32 keys in all, 2 threads on the 2-core Zen 4, 11.3 -> 1.5 ms (1-300: 14.5 -> 7.0).
template <int J>
PK_TARGET_AVX512 static inline __m512i bitonic_step_m(__m512i v, __mmask8 mx) {
  __m512i p;
  if constexpr (J == 1) p = _mm512_shuffle_epi32(v, _MM_PERM_BADC);
  else if constexpr (J == 2) p = _mm512_permutex_epi64(v, 0x4E);
  else p = _mm512_shuffle_i64x2(v, v, 0x4E);
  return _mm512_mask_blend_epi64(mx, _mm512_min_epu64(v, p), _mm512_max_epu64(v, p));
}

// Step (J, K) of the bitonic sort over NR registers (global lane r * 8 + i): J >= 8 pairs whole registers.
template <int NR, int J, int K>
PK_TARGET_AVX512 static inline void bitonic_regs_step(__m512i* w) {
  if constexpr (J >= 8) {
    constexpr int d = J / 8;
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) {
      if (r & d) continue;
      const __m512i lo = _mm512_min_epu64(w[r], w[r + d]), hi = _mm512_max_epu64(w[r], w[r + d]);
      const bool asc = ((r * 8) & K) == 0;
      w[r] = asc ? lo : hi;
      w[r + d] = asc ? hi : lo;
    }
  } else {
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) w[r] = bitonic_step_m<J>(w[r], (__mmask8)bitonic_max_lanes(J, K, r * 8));
  }
  if constexpr (J > 1) bitonic_regs_step<NR, J / 2, K>(w);
}

template <int NR, int K>
PK_TARGET_AVX512 static inline void bitonic_regs(__m512i* w) {
  bitonic_regs_step<NR, K / 2, K>(w);
  if constexpr (K < 8 * NR) bitonic_regs<NR, 2 * K>(w);
}

// Keys of 16 lanes from NK registers of 16 raw keys, by position (0 .. 16 * NK - 1).
template <int NK>
PK_TARGET_AVX512 static inline __m512i permute_regs(const __m512i* raw, __m512i idx) {
  if constexpr (NK == 1) {
    return _mm512_permutexvar_epi32(idx, raw[0]);
  } else if constexpr (NK == 2) {
    return _mm512_permutex2var_epi32(raw[0], idx, raw[1]);
  } else {
    const __m512i lo = permute_regs<NK / 2>(raw, idx), hi = permute_regs<NK / 2>(raw + NK / 2, idx);
    return _mm512_mask_blend_epi32(_mm512_test_epi32_mask(idx, _mm512_set1_epi32(8 * NK)), lo, hi);
  }
}

static inline __mmask16 lanes16_mask(int64_t rem) {
  return rem >= 16 ? (__mmask16)0xFFFF : rem <= 0 ? (__mmask16)0 : (__mmask16)((1u << rem) - 1);
}

template <int NR, Enc E>
PK_TARGET_AVX512 static void sort_row_regs_avx512(const SegArgs& g, const Coder<uint32_t, E>& cd, int64_t start,
                                                  int64_t len) {
  constexpr int NK = NR / 2;  // registers of 16 raw keys
  const uint32_t* in = static_cast<const uint32_t*>(g.keys) + start;
  __m512i w[NR];
#pragma GCC unroll 8
  for (int r = 0; r < NK; ++r) {
    const __mmask16 m = lanes16_mask(len - 16 * r);
    // padding: all-ones keys at positions >= len sort after every key
    const __m512i key = _mm512_mask_mov_epi32(_mm512_set1_epi32(-1), m,
                                              encode16_avx512<E>(cd, _mm512_maskz_loadu_epi32(m, in + 16 * r)));
    const __m512i pos = _mm512_add_epi64(_mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi64(16 * r));
    w[2 * r] = _mm512_or_si512(_mm512_slli_epi64(_mm512_cvtepu32_epi64(_mm512_castsi512_si256(key)), 32), pos);
    w[2 * r + 1] = _mm512_or_si512(_mm512_slli_epi64(_mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(key, 1)), 32),
                                   _mm512_add_epi64(pos, _mm512_set1_epi64(8)));
  }
  bitonic_regs<NR, 2>(w);
  const __m512i low32 = _mm512_set1_epi64(0xFFFFFFFF);
  __m512i src[NK], raw[NK];
#pragma GCC unroll 8
  for (int r = 0; r < NK; ++r) {
    src[r] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi64_epi32(w[2 * r])),
                                _mm512_cvtepi64_epi32(w[2 * r + 1]), 1);
    raw[r] = _mm512_maskz_loadu_epi32(lanes16_mask(len - 16 * r), in + 16 * r);
  }
  if (g.out_keys) {
    uint32_t* ok = static_cast<uint32_t*>(g.out_keys) + start;
#pragma GCC unroll 8
    for (int r = 0; r < NK; ++r)
      _mm512_mask_storeu_epi32(ok + 16 * r, lanes16_mask(len - 16 * r), permute_regs<NK>(raw, src[r]));
  }
  if (g.out_idx) {
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) {
      const __mmask16 m = lanes16_mask(len - 8 * r);
      _mm512_mask_storeu_epi64(g.out_idx + start + 8 * r, (__mmask8)m, _mm512_and_si512(w[r], low32));
    }
  }
  if (g.out_pay) {
    const int ps = g.pay_size;
    const char* pin = static_cast<const char*>(g.pay) + start * ps;
    char* pout = static_cast<char*>(g.out_pay) + start * ps;
    if (ps == 4) {
      __m512i praw[NK];
#pragma GCC unroll 8
      for (int r = 0; r < NK; ++r)
        praw[r] = _mm512_maskz_loadu_epi32(lanes16_mask(len - 16 * r), pin + 64 * r);
#pragma GCC unroll 8
      for (int r = 0; r < NK; ++r)
        _mm512_mask_storeu_epi32(pout + 64 * r, lanes16_mask(len - 16 * r), permute_regs<NK>(praw, src[r]));
    } else {
      alignas(64) uint32_t at[16 * NK];
#pragma GCC unroll 8
      for (int r = 0; r < NK; ++r) _mm512_store_si512(at + 16 * r, src[r]);
      if (ps == 8) {
        const uint64_t* p8 = reinterpret_cast<const uint64_t*>(pin);
        for (int64_t i = 0; i < len; ++i) {
          uint64_t x;
          std::memcpy(&x, p8 + at[i], 8);
          std::memcpy(pout + i * 8, &x, 8);
        }
      } else {
        for (int64_t i = 0; i < len; ++i) std::memcpy(pout + i * ps, pin + (int64_t)at[i] * ps, ps);
      }
    }
  }
}
#endif

// ---------------------------------------------------------------------------------------------
// Rows of equal length up to ROW_NET_MAX keys, NV rows at a time in SIMD lanes (sort_rows_simd.h).
// ---------------------------------------------------------------------------------------------
static constexpr int ROW_NET_MAX = 1024;
struct RowNetwork {
  std::vector<uint16_t> a, b;  // comparator c: wires a[c] < b[c], min to a, max to b; in order
};

// Batcher's odd-even merge sort for the power of two N >= L, without the comparators that touch a wire at
// or above L: every comparator puts the min on its lower wire, so +inf padding on those wires would never
// move and the comparators that touch them are no-ops (see sort_rows_simd.h). (A bitonic network with
// its stages reordered to run block by block in L1 measured no faster at 1000 wires, with 17% more
// comparators.)
static void build_row_network(int L, RowNetwork& net) {
  int N = 1;
  while (N < L) N <<= 1;
  for (int p = 1; p < N; p <<= 1)
    for (int k = p; k >= 1; k >>= 1)
      for (int j = k % p; j + k < N; j += 2 * k)
        for (int i = 0; i < k && i + j + k < N; ++i)
          if ((i + j) / (2 * p) == (i + j + k) / (2 * p) && i + j + k < L) {
            net.a.push_back((uint16_t)(i + j));
            net.b.push_back((uint16_t)(i + j + k));
          }
}

// The network of each L, built at its first use, then shared.
static const RowNetwork& row_network(int L) {
  static std::mutex build;
  static std::unique_ptr<RowNetwork> nets[ROW_NET_MAX + 1];
  static std::atomic<const RowNetwork*> ready[ROW_NET_MAX + 1];
  if (const RowNetwork* p = ready[L].load(std::memory_order_acquire)) return *p;
  std::lock_guard<std::mutex> lock(build);
  if (!nets[L]) {
    auto net = std::make_unique<RowNetwork>();
    build_row_network(L, *net);
    nets[L] = std::move(net);
    ready[L].store(nets[L].get(), std::memory_order_release);
  }
  return *nets[L];
}

// The outputs of nv rows sorted in lanes: positions(k, p) fills p[v] with the source position of row v's
// k-th key. The keys are read back from the input by that position (the exact bits of canonicalised floats).
template <class U, int NV, class Positions>
__attribute__((always_inline)) inline void emit_row_lanes(const SegArgs& g, const int64_t* b, int nv, int L,
                                                          int64_t ks, Positions positions) {
  const U* in = static_cast<const U*>(g.keys);
  U* ok = static_cast<U*>(g.out_keys);
  int64_t* oi = g.out_idx;
  const char* pin = static_cast<const char*>(g.pay);
  char* pout = static_cast<char*>(g.out_pay);
  const int ps = g.pay_size;
  for (int k = 0; k < L; ++k) {
    int64_t p[NV];
    positions(k, p);
    for (int v = 0; v < nv; ++v) {
      const int64_t at = b[v] + k * ks, from = b[v] + p[v] * ks;
      if (oi) oi[at] = p[v];
      if (ok) ok[at] = in[from];
      if (pout) std::memcpy(pout + at * ps, pin + from * ps, ps);
    }
  }
}

namespace rows_portable {
static constexpr int kVecBytes = 16;  // SSE2 / NEON width: the baseline every x86-64 has
#include "sort_rows_simd.h"
}  // namespace rows_portable
#if PK_X86
#pragma GCC push_options
#pragma GCC target("avx2")
namespace rows_avx2 {
static constexpr int kVecBytes = 32;
#include "sort_rows_simd.h"
}  // namespace rows_avx2
#pragma GCC pop_options
#endif

// Which segments the comparison sort (sort_short_segment) takes: up to 32 keys (its sorting networks and
// insertion sorts), and from 65 keys up to short_segment_max; the others go to radix_sort, whose small
// inputs (up to 64 keys) take its insertion sort of encoded keys. std::sort's mispredicted compares cost
// ~10-20 ns per key on rows of 33-1024 (Zen 2), where a one-thread LSD radix sort costs, ns per key for
// rows of 1M keys in all, by key bytes: 1 byte 96 keys 7.5-7.9, 256 keys 3.8-4.2; 2 bytes 128 keys
// 10.0-12.5 (std::sort 13.3-13.9), 256 keys 6.2-8.9 (15.1-15.7); 4 bytes 256 keys 12.1-14.0 (14.9-15.4),
// 128 keys 18-21 (13.2-13.7: its four passes' counters cost more than the keys); 8 bytes 512 keys
// 17.6-19.6 (18.2-18.3), 1024 keys 14.5-17.6 (20.1-20.6). rows of 33-64 keys: the insertion sort 5.8-9.2
// ns per key at 33, std::sort 9.6-10.7. (All were std::sort up to 1024 keys: 1000 x 1000 bool rows took
// 1.8x torch.sort's time.)
static inline int64_t short_segment_max(int key_bytes) {
  return key_bytes == 1 ? 32 : key_bytes == 2 ? 96 : key_bytes == 4 ? 192 : 512;
}
static constexpr int64_t HUGE_SEGMENT = 1 << 18;  // parallel engine at or above
static constexpr int64_t REG_SORT_MAX = 256;  // sort_row_regs_avx512 up to
// Segments of 2..row_batch_max keys, NV of one length at a time: the lanes' network (sort_rows_simd.h).
// Measured against the paths below (rows of 2M keys in all, argsort, 2 threads, Zen 2; ns per key,
// network / before): 16 keys of every width 1.2-3.2 / 4.7-6.5; 64 keys 1.5-4.5 / 10-12.8; 256 keys 1-byte
// 1.4-1.7 / 3.9-4.4, 2-byte 1.7 / 6.7, 4-byte 2.6-3.8 / 11.6-13.9, 8-byte 4.4-5.0 / 16.3; 1024 keys 1-byte
// 2.0-3.6 / 2.2-2.5 (the counting passes of 8-bit digits catch up past 512), 2-byte 2.1-3.5 / 3.9,
// 4-byte 3.6-4.3 / 7.0-9.2, 8-byte 7.5-7.9 / 14.6-18.5. Strided rows (a dim other than the last) take it
// up to ROW_BATCH_MAX whatever the key: the other path would be three transposing copies.
// x86-64 without AVX2 (the SSE2 tier: no 64-bit compare, pcmpgtq is SSE4.2, nor unsigned 32-bit min/max)
// emulates the compares: 8-byte keys lost to the paths below at every length (rows of 16: 8.9 against 5.4
// ns per key), 4-byte keys past ~128 (256: 10.4 / 11.7, 1000: 15.4 / 7.1); keys of 1-2 bytes still won
// (rows of 64: 2.7 / 11.6). On AArch64 the same 16-byte tier has NEON's 64-bit compares.
static constexpr int64_t ROW_BATCH_MAX = ROW_NET_MAX;
static inline int64_t row_batch_max(int key_bytes, bool simd_compares) {
  if (!simd_compares) return key_bytes == 8 ? 0 : key_bytes == 4 ? 128 : 512;
  return key_bytes == 1 ? 512 : ROW_BATCH_MAX;
}

void segmented_sort(const SegArgs& g) {
  {
    const int64_t n = g.offsets ? (g.nseg ? g.offsets[g.nseg] : 0) : g.nseg * g.row_len;
    if (n >= (int64_t(1) << 20)) {  // fresh outputs: huge pages mean 512x fewer page faults
      if (g.out_keys) advise_huge(g.out_keys, (size_t)n * pk::dtype_size(g.dtype));
      if (g.out_idx) advise_huge(g.out_idx, (size_t)n * 8);
      if (g.out_pay) advise_huge(g.out_pay, (size_t)n * g.pay_size);
    }
  }
  auto seg_start = [&](int64_t s) {
    return g.offsets ? g.offsets[s] : g.inner > 1 ? (s / g.inner) * g.row_len * g.inner + s % g.inner : s * g.row_len;
  };
  auto seg_len = [&](int64_t s) { return g.offsets ? g.offsets[s + 1] - g.offsets[s] : g.row_len; };
  auto one = [&](int64_t s, int threads) {
    SortArgs a;
    const int64_t st = seg_start(s), len = seg_len(s);
    const int ks = pk::dtype_size(g.dtype);
    a.keys = static_cast<const char*>(g.keys) + st * ks;
    a.n = len;
    a.dtype = g.dtype;
    a.out_keys = g.out_keys ? static_cast<char*>(g.out_keys) + st * ks : nullptr;
    a.out_idx = g.out_idx ? g.out_idx + st : nullptr;
    a.pay = g.pay ? static_cast<const char*>(g.pay) + st * g.pay_size : nullptr;
    a.out_pay = g.out_pay ? static_cast<char*>(g.out_pay) + st * g.pay_size : nullptr;
    a.pay_size = g.pay_size;
    a.descending = g.descending;
    a.threads = threads;
    a.digit_bits = g.digit_bits;
    a.nt_stores = g.nt_stores;
    radix_sort(a);
  };
  // Long segments on all threads, one after another.
  std::vector<int64_t> rest;
  bool any_huge = false;
  for (int64_t s = 0; s < g.nseg && g.offsets; ++s)
    if (seg_len(s) >= HUGE_SEGMENT) { any_huge = true; break; }
  if (!g.offsets && g.row_len >= HUGE_SEGMENT) any_huge = true;
  const int64_t total = g.offsets ? (g.nseg ? g.offsets[g.nseg] - g.offsets[0] : 0) : g.nseg * g.row_len;
  if (any_huge) {
    for (int64_t s = 0; s < g.nseg; ++s)
      if (seg_len(s) >= HUGE_SEGMENT) one(s, g.threads);
  }
  // Split the remaining segments by element count (offsets are sorted) into 8 chunks per thread, handed
  // out in order to whichever thread asks first. (One chunk per thread left threads idle where keys cost
  // unequal time: segments of 0..8 keys with a few of 100K, 1M keys in all, 2 threads, spent ~30% of the
  // time in the barrier; and a worker that wakes late on these VMs held up its whole share.)
  const int T = (int)std::max<int64_t>(1, std::min<int64_t>(g.threads, total / 4096 + 1));
  const int C = T == 1 ? 1 : (int)std::min<int64_t>(8 * T, total / 4096 + 1);
  std::vector<int64_t> cut(C + 1, 0);
  cut[C] = g.nseg;
  for (int t = 1; t < C; ++t) {
    const int64_t target = (g.offsets ? g.offsets[0] : 0) + total * t / C;
    if (g.offsets) cut[t] = std::upper_bound(g.offsets, g.offsets + g.nseg, target) - g.offsets;
    else cut[t] = g.row_len ? std::min<int64_t>(g.nseg, target / g.row_len) : g.nseg * t / C;
    cut[t] = std::max(cut[t], cut[t - 1]);
  }
  std::atomic<int> next_chunk{0};
  const bool v512 = pk::cpu_has_avx512();
  with_codec(g.dtype, g.descending, [&](auto codec, auto kind) {
    using U = std::remove_cv_t<decltype(codec.xor_mask)>;
    const int64_t short_max = short_segment_max(pk::dtype_size(g.dtype));
    auto body = [&](auto enc_tag) {
      constexpr Enc E = decltype(enc_tag)::value;
      Coder<U, E> cd{codec};
      const char* key_bytes = static_cast<const char*>(g.keys);
      const char* pay_bytes = static_cast<const char*>(g.pay);
      const uintptr_t ahead = pk::STREAM_AHEAD_BYTES;
#if PK_X86
      const bool avx2 = pk::cpu_has_avx2();
      const int lanes = avx2 ? rows_avx2::RowLanes<U>::NV : rows_portable::RowLanes<U>::NV;
#else
      const int lanes = rows_portable::RowLanes<U>::NV;
#endif
#if PK_X86
      const bool simd_compares = avx2;
#else
      const bool simd_compares = true;
#endif
      // strided rows must all take the lanes (the other paths read contiguous segments)
      const int64_t batch_max = g.inner > 1 ? ROW_BATCH_MAX : row_batch_max((int)sizeof(U), simd_compares);
      pk::parallel_threads(T, [&](int t) {
        // one contiguous segment on its own: a sorting network or insertion sort in registers, a comparison
        // sort, or the one-thread radix engine, by its length (see short_segment_max)
        auto alone = [&](int64_t s, int64_t len) {
#if PK_X86
          if constexpr (sizeof(U) == 4) {
            if (v512 && len > 16 && len <= REG_SORT_MAX) {
              if (len <= 32) sort_row_regs_avx512<4, E>(g, cd, seg_start(s), len);
              else if (len <= 64) sort_row_regs_avx512<8, E>(g, cd, seg_start(s), len);
              else if (len <= 128) sort_row_regs_avx512<16, E>(g, cd, seg_start(s), len);
              else sort_row_regs_avx512<32, E>(g, cd, seg_start(s), len);
              return;
            }
          }
#endif
          if (len <= 32 || (len > 64 && len <= short_max)) sort_short_segment<U, E>(g, cd, seg_start(s), len);
          else one(s, 1);
        };
        // runs of segments of one length in [2, batch_max] go NV at a time to the lanes' sort; a run of one
        // contiguous segment (segments of varied lengths) is sorted alone: all lanes would cost as much
        int64_t lane_base[16], lane_seg = 0;
        int nv = 0, lane_len = 0;
        auto flush_lanes = [&]() {
          if (nv == 0) return;
          if (nv == 1 && g.inner == 1) {
            alone(lane_seg, lane_len);
            nv = 0;
            return;
          }
          const RowNetwork& net = row_network(lane_len);
#if PK_X86
          if (avx2) rows_avx2::sort_rows_tier<U, E>(g, cd, lane_base, nv, lane_len, g.inner, net);
          else
#endif
            rows_portable::sort_rows_tier<U, E>(g, cd, lane_base, nv, lane_len, g.inner, net);
          nv = 0;
        };
        for (int c = next_chunk.fetch_add(1, std::memory_order_relaxed); c < C;
             c = next_chunk.fetch_add(1, std::memory_order_relaxed)) {
        for (int64_t s = cut[c]; s < cut[c + 1]; ++s) {
          const int64_t len = seg_len(s);
          if (len >= HUGE_SEGMENT) continue;
          // the segments' keys (and payloads) are one sequential stream per thread (pk::prefetch_stream)
          PK_PREFETCH_R((const char*)((uintptr_t)(key_bytes + seg_start(s) * (int64_t)sizeof(U)) + ahead));
          if (pay_bytes) PK_PREFETCH_R((const char*)((uintptr_t)(pay_bytes + seg_start(s) * g.pay_size) + ahead));
          // strided rows (a sort along an inner dim): a row's keys are len streams `inner` keys apart, and
          // its outputs 2 more sets of len; the hardware prefetchers left the loads of the lanes stalled
          // (~30% of the time on the loads of a 16 x 104K int64 sort along dim 0). The same distance
          // ahead in each of them, once per 8 columns (a line of int64 indices).
          const int64_t first = seg_start(s);
          if (g.inner > 1 && first % 8 == 0) {
            for (int64_t k = 0; k < len; ++k) {
              const int64_t at = first + k * g.inner;
              if (k) PK_PREFETCH_R((const char*)((uintptr_t)(key_bytes + at * (int64_t)sizeof(U)) + ahead));
              if (g.out_keys) PK_PREFETCH_W((const char*)((uintptr_t)(static_cast<char*>(g.out_keys) + at * (int64_t)sizeof(U)) + ahead));
              if (g.out_idx) PK_PREFETCH_W((const char*)((uintptr_t)(g.out_idx + at) + ahead));
            }
          }
#if PK_X86
          if constexpr (sizeof(U) == 4) {
            if (v512 && len >= 2 && len <= 16 && g.inner == 1) {
              sort_row16_avx512<E>(g, cd, seg_start(s), len);
              continue;
            }
            // runs of one length too: the registers beat the AVX2 lanes up to 128 keys (rows of 32, 500K
            // keys, one thread: 5.6 -> ~2.5 ns per key; 128: 4.4-5.7 -> ~2.3), not at 256 (5 against 10.5:
            // 32 registers of words spill), where only segments sorted alone take them
            if (v512 && len > 16 && len <= 128 && g.inner == 1) {
              alone(s, len);
              continue;
            }
          }
#endif
          if (len >= 2 && len <= batch_max) {
            if (nv > 0 && len != lane_len) flush_lanes();
            lane_len = (int)len;
            if (nv == 0) lane_seg = s;
            lane_base[nv++] = seg_start(s);
            if (nv == lanes) flush_lanes();
            continue;
          }
          alone(s, len);
        }
        flush_lanes();
        }
      });
    };
    if constexpr (decltype(kind)::value == 1) {
      if constexpr (sizeof(U) >= 2) body(std::integral_constant<Enc, Enc::Float>());
    } else {
      body(std::integral_constant<Enc, Enc::Xor>());
    }
  });
}

}  // namespace pksort

namespace {

py::dict stats_dict(const pksort::SortStats& st) {
  py::dict d;
  d["passes"] = st.passes;
  d["skipped"] = st.skipped;
  d["threads"] = st.threads;
  d["digit_bits"] = st.digit_bits;
  d["lossy"] = st.lossy;
  d["small"] = st.small;
  d["wc"] = st.wc;
  d["msd"] = st.msd;
  d["msd_bits"] = st.msd_bits;
  d["hot_keys"] = st.hot_keys;
  d["range_digit"] = st.range_digit;
  d["piece_digit"] = st.piece_digit;
  d["log_digit"] = st.log_digit;
  return d;
}

// Returns the stats dict only when asked (tests, tuning): the public ops discard it, and building a dict
// per call is measurable on small sorts.
py::object sort_1d(uintptr_t keys, int64_t n, int dtype, uintptr_t out_keys, uintptr_t out_idx, uintptr_t pay,
                 uintptr_t out_pay, int pay_size, bool descending, int begin_bit, int end_bit, int digit_bits,
                 int threads, int nt_stores, int64_t small_n, int64_t grain, bool want_stats, int wc, int msd,
                 int msd_bits, bool in_order) {
  pksort::SortArgs a;
  a.keys = reinterpret_cast<const void*>(keys);
  a.n = n;
  a.dtype = static_cast<pk::DType>(dtype);
  a.out_keys = reinterpret_cast<void*>(out_keys);
  a.out_idx = reinterpret_cast<int64_t*>(out_idx);
  a.pay = reinterpret_cast<const void*>(pay);
  a.out_pay = reinterpret_cast<void*>(out_pay);
  a.pay_size = pay_size;
  a.descending = descending;
  a.begin_bit = begin_bit;
  a.end_bit = end_bit;
  a.digit_bits = digit_bits;
  a.threads = threads;
  a.nt_stores = nt_stores;
  a.small_n = small_n;
  a.grain = grain;
  a.wc = wc;
  a.msd = msd;
  a.in_order = in_order;
  if (msd_bits != 0 && msd_bits != 8 && msd_bits != 11)
    pk::fail_value("sort", "config msd_bits must be 0 (heuristic), 8 or 11, got " + std::to_string(msd_bits));
  a.msd_bits = msd_bits;
  const int kb = 8 * pk::dtype_size(a.dtype);
  if (dtype < 0 || dtype > 12) pk::fail_value("sort", "unknown dtype code");
  if (a.end_bit < 0) a.end_bit = kb;
  if (begin_bit < 0 || a.end_bit > kb || begin_bit > a.end_bit)
    pk::fail_value("sort", "expected 0 <= begin_bit <= end_bit <= " + std::to_string(kb));
  if (pay && pay_size <= 0) pk::fail_value("sort", "payload element size must be positive");
  pksort::SortStats st;
  {
    py::gil_scoped_release release;
    if (begin_bit == a.end_bit) {
      // copy through: identity permutation
      if (n > 0) {
        const int ks = pk::dtype_size(a.dtype);
        if (a.out_keys) std::memcpy(a.out_keys, a.keys, n * ks);
        if (a.out_idx) for (int64_t i = 0; i < n; ++i) a.out_idx[i] = i;
        if (a.out_pay) std::memcpy(a.out_pay, a.pay, n * pay_size);
      }
    } else {
      st = pksort::radix_sort(a);
    }
  }
  if (!want_stats) return py::none();
  return stats_dict(st);
}

void segmented(uintptr_t keys, int dtype, uintptr_t offsets, int64_t nseg, int64_t row_len, uintptr_t out_keys,
               uintptr_t out_idx, uintptr_t pay, uintptr_t out_pay, int pay_size, bool descending, int threads,
               int digit_bits, int nt_stores, int64_t inner) {
  pksort::SegArgs g;
  g.keys = reinterpret_cast<const void*>(keys);
  g.dtype = static_cast<pk::DType>(dtype);
  g.offsets = reinterpret_cast<const int64_t*>(offsets);
  g.nseg = nseg;
  g.row_len = row_len;
  g.total = 0;
  g.out_keys = reinterpret_cast<void*>(out_keys);
  g.out_idx = reinterpret_cast<int64_t*>(out_idx);
  g.pay = reinterpret_cast<const void*>(pay);
  g.out_pay = reinterpret_cast<void*>(out_pay);
  g.pay_size = pay_size;
  g.descending = descending;
  g.threads = threads;
  g.digit_bits = digit_bits;
  g.nt_stores = nt_stores;
  if (dtype < 0 || dtype > 12) pk::fail_value("segmented_sort", "unknown dtype code");
  if (inner < 1) pk::fail_value("segmented_sort", "inner must be at least 1");
  if (inner > 1 && (offsets || pay || row_len > pksort::ROW_BATCH_MAX || nseg % inner))
    pk::fail_value("segmented_sort", "strided rows (inner > 1) need equal rows of at most " +
                                         std::to_string(pksort::ROW_BATCH_MAX) + " keys, no payload, and nseg a multiple of inner");
  g.inner = inner;
  py::gil_scoped_release release;
  pksort::segmented_sort(g);
}

// True when the n int64 offsets never decrease: segmented_sort's check of CPU offsets, one thread, GIL
// released (torch's compare + any() split 125K offsets over the OpenMP threads: ~0.1 ms idle, up to 15 ms
// on the loaded 2-core Zen 4, longer than the sort of their 1M keys).
bool nondecreasing(uintptr_t offsets, int64_t n) {
  const int64_t* o = reinterpret_cast<const int64_t*>(offsets);
  py::gil_scoped_release release;
  bool bad = false;
  for (int64_t i = 1; i < n; ++i) bad |= o[i] < o[i - 1];
  return !bad;
}

}  // namespace

PYBIND11_MODULE(_cpu_sort, m) {
  pk::def_mark_forked(m);
  pk::def_native_errors("sort");
  m.doc() = "pykernels CPU radix sort (Onesweep-style LSD: one histogram read, write-combined scatters)";
  m.def("cpu_has_avx2", &pk::cpu_has_avx2);
  m.def("cpu_has_avx512", &pk::cpu_has_avx512);
  m.def("sort", &sort_1d, py::arg("keys"), py::arg("n"), py::arg("dtype"), py::arg("out_keys"), py::arg("out_idx"),
        py::arg("pay"), py::arg("out_pay"), py::arg("pay_size"), py::arg("descending"), py::arg("begin_bit"),
        py::arg("end_bit"), py::arg("digit_bits"), py::arg("threads"), py::arg("nt_stores") = -1,
        py::arg("small_n") = 64, py::arg("grain") = 32768, py::arg("stats") = false, py::arg("wc") = -1, py::arg("msd") = -1,
        py::arg("msd_bits") = 0, py::arg("in_order") = true,
        "Stable LSD radix sort of n keys (pointers as integers; 0 = absent). Returns a stats dict if stats=True, "
        "else None.");
  m.attr("ROW_BATCH_MAX") = pksort::ROW_BATCH_MAX;
  m.def("nondecreasing", &nondecreasing, py::arg("offsets"), py::arg("n"),
        "True when n contiguous int64 values (a pointer as an integer) never decrease.");
  m.def("segmented", &segmented, py::arg("keys"), py::arg("dtype"), py::arg("offsets"), py::arg("nseg"),
        py::arg("row_len"), py::arg("out_keys"), py::arg("out_idx"), py::arg("pay"), py::arg("out_pay"),
        py::arg("pay_size"), py::arg("descending"), py::arg("threads"), py::arg("digit_bits") = 0,
        py::arg("nt_stores") = -1, py::arg("inner") = 1,
        "Sorts each segment [offsets[i], offsets[i+1]) (or each row of row_len) independently, stably.");
}
