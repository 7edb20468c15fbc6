// pykernels._cpu_hash: WarpCore-style open-addressing hash tables on the CPU.
//
// Same layout and probing as the GPU tables (hash_layout.h): windows of W slots (one cache line),
// double hashing between windows, reserved EMPTY/TOMBSTONE key patterns with the colliding user keys
// kept out of band in `special`. Bulk operations run on the pk thread pool; concurrent inserts into
// one table are made safe by CAS on the key (a slot is claimed by the thread whose CAS wins).
//
// Speed on the CPU comes from memory-level parallelism (each probe of a large table is a DRAM miss of
// ~100 ns): keys are processed as a software pipeline -- the window of key i + D is hashed and
// prefetched while key i is probed -- so about D misses are in flight per thread (the prefetch
// distance D is autotuned).
#include <pybind11/pybind11.h>

#include <sys/mman.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "hash_layout.h"
#include "pk_common.h"
#include "pk_threads.h"

namespace py = pybind11;
using namespace pkhash;

namespace {

struct NoVal {};

template <class K, class V>
struct Slot {
  K key;
  V val;
};
template <class K>
struct Slot<K, NoVal> {
  K key;
};

// Table geometry and storage, as Python passes them.
struct Geo {
  uintptr_t slots;
  uintptr_t special;  // 4 x uint64
  uint64_t nw;        // number of windows (prime)
  int W;              // slots per window
  uint64_t seed;
};

// Status codes written per key by inserts (Python reads them).
enum : uint8_t { ST_EXISTED = 0, ST_NEW = 1, ST_PENDING = 2, ST_SKIPPED = 3 };
// Insert modes.
enum : int { M_UPSERT = 0, M_ADD = 1, M_APPEND = 2 };

template <class T>
inline T load_relaxed(const T* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
template <class T>
inline void store_relaxed(T* p, T v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
template <class T>
inline bool cas(T* p, T expected, T desired) {
  return __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED);
}

constexpr int64_t kMinPerThread = 1 << 14;  // below this, one thread (the pool wake-up costs more)

inline int threads_for(int64_t n, int nthreads) {
  if (nthreads < 1) nthreads = 1;
  int64_t by_size = (n + kMinPerThread - 1) / kMinPerThread;
  return (int)std::max<int64_t>(1, std::min<int64_t>(nthreads, by_size));
}

// Runs body(i, key, probe) for i in [b, e) as a software pipeline: the probe of key i + D is
// computed and its first window prefetched D iterations before it is used (D = 0: no prefetch).
template <class K, bool kWrite, class Body>
inline void pipelined(const K* keys, int64_t b, int64_t e, int D, const Geo& g, size_t window_bytes, Body&& body) {
  constexpr int R = 64;  // ring size, >= max D
  Probe ring[R];
  const char* base = reinterpret_cast<const char*>(g.slots);
  if (D > R - 1) D = R - 1;
  auto issue = [&](int64_t j) {
    Probe p = probe_start((uint64_t)keys[j], g.seed, g.nw);
    ring[j & (R - 1)] = p;
    const char* line = base + p.w * window_bytes;
    if (kWrite) PK_PREFETCH_W(line); else PK_PREFETCH_R(line);
    if (window_bytes > 64) {
      if (kWrite) PK_PREFETCH_W(line + 64); else PK_PREFETCH_R(line + 64);
    }
  };
  if (D <= 0) {
    for (int64_t i = b; i < e; ++i) body(i, keys[i], probe_start((uint64_t)keys[i], g.seed, g.nw));
    return;
  }
  const int64_t head = std::min<int64_t>(e, b + D);
  for (int64_t j = b; j < head; ++j) issue(j);
  for (int64_t i = b; i < e; ++i) {
    if (i + D < e) issue(i + D);
    body(i, keys[i], ring[i & (R - 1)]);
  }
}

template <class K, class V>
struct Table {
  using S = Slot<K, V>;
  static constexpr bool kHasVal = !std::is_same<V, NoVal>::value;
  static constexpr K EMPTY = Sentinel<K>::EMPTY;
  static constexpr K TOMB = Sentinel<K>::TOMB;

  S* slots;
  uint64_t* special;
  uint64_t nw;
  int W;
  uint64_t seed;
  Geo geo;
  size_t window_bytes;

  explicit Table(const Geo& g)
      : slots(reinterpret_cast<S*>(g.slots)), special(reinterpret_cast<uint64_t*>(g.special)), nw(g.nw), W(g.W),
        seed(g.seed), geo(g), window_bytes(sizeof(S) * (size_t)g.W) {}

  S* window(uint64_t w) const { return slots + w * (uint64_t)W; }

  // ---- find: returns the slot holding k, or nullptr ----
  S* find_slot(K k, Probe p) const {
    for (uint64_t t = 0; t < nw; ++t) {
      S* win = window(p.w);
      for (int j = 0; j < W; ++j) {
        const K sk = load_relaxed(&win[j].key);
        if (sk == k) return &win[j];
        if (sk == EMPTY) return nullptr;
      }
      probe_next(p, nw);
    }
    return nullptr;
  }

  // ---- insert one key. `used`/`limit`: slots that ever left EMPTY, and the most allowed ----
  template <int Mode>
  uint8_t insert_one(K k, uint64_t v, Probe p0, std::atomic<int64_t>& used, int64_t limit, int64_t& new_empty) {
    for (;;) {
      Probe p = p0;
      S* free_slot = nullptr;
      S* found = nullptr;
      for (uint64_t t = 0; t < nw; ++t) {
        S* win = window(p.w);
        for (int j = 0; j < W; ++j) {
          const K sk = load_relaxed(&win[j].key);
          if (Mode != M_APPEND && sk == k) { found = &win[j]; goto scanned; }
          if (sk == EMPTY) {
            // Beyond the first EMPTY the key cannot be (inserts always fill the first free slot).
            if (!free_slot) free_slot = &win[j];
            goto scanned;
          }
          if (sk == TOMB && !free_slot) {
            free_slot = &win[j];
            if (Mode == M_APPEND) goto scanned;  // duplicates allowed: take the first free slot
          }
        }
        probe_next(p, nw);
      }
    scanned:
      if (found) {
        if constexpr (kHasVal) {
          if (Mode == M_ADD) __atomic_fetch_add(&found->val, (V)v, __ATOMIC_RELAXED);
          else store_relaxed(&found->val, (V)v);
        }
        return ST_EXISTED;
      }
      if (!free_slot) return ST_PENDING;  // every slot holds a live key
      const K expect = load_relaxed(&free_slot->key);
      if (expect != EMPTY && expect != TOMB) continue;  // taken meanwhile: rescan
      const bool from_empty = expect == EMPTY;
      if (from_empty) {
        if (used.fetch_add(1, std::memory_order_relaxed) + 1 > limit) {
          used.fetch_sub(1, std::memory_order_relaxed);
          return ST_PENDING;
        }
      }
      if constexpr (kHasVal) {
        if (Mode == M_ADD) {
          // Counting: the value of a free slot is 0 (fresh tables are zeroed, erase zeroes it), and
          // other threads may add to it as soon as the key is visible: add, never store.
          if (cas(&free_slot->key, expect, k)) {
            __atomic_fetch_add(&free_slot->val, (V)v, __ATOMIC_RELAXED);
            if (from_empty) ++new_empty;
            return ST_NEW;
          }
        } else if (cas(&free_slot->key, expect, k)) {
          store_relaxed(&free_slot->val, (V)v);
          if (from_empty) ++new_empty;
          return ST_NEW;
        }
      } else {
        if (cas(&free_slot->key, expect, k)) {
          if (from_empty) ++new_empty;
          return ST_NEW;
        }
      }
      if (from_empty) used.fetch_sub(1, std::memory_order_relaxed);
      // lost the race for this slot: rescan (the winner may have inserted this very key)
    }
  }

  // Reserved key patterns: a tiny out-of-band store with the same atomic semantics.
  template <int Mode>
  uint8_t insert_special(K k, uint64_t v) {
    const int s = special_index(k);
    uint64_t* present = &special[2 * s];
    uint64_t* value = &special[2 * s + 1];
    const bool fresh = cas(present, (uint64_t)0, (uint64_t)1);
    if (Mode == M_ADD) __atomic_fetch_add(value, v, __ATOMIC_RELAXED);
    else if (kHasVal) store_relaxed(value, v);
    return fresh ? ST_NEW : ST_EXISTED;
  }
};

template <class K, class V>
uint64_t read_val(const void* vals, int64_t i) {
  if constexpr (std::is_same<V, NoVal>::value) { (void)vals; (void)i; return 0; }
  else return (uint64_t)reinterpret_cast<const V*>(vals)[i];
}

// ------------------------------------------------------------------------------------------------
// Bulk operations
// ------------------------------------------------------------------------------------------------
template <class K, class V>
py::tuple insert_impl(const Geo& g, uintptr_t keys_p, uintptr_t vals_p, int64_t n, uintptr_t status_p, int mode,
                      int64_t used_now, int64_t limit, int nthreads, int D) {
  Table<K, V> t(g);
  const K* keys = reinterpret_cast<const K*>(keys_p);
  const void* vals = reinterpret_cast<const void*>(vals_p);
  uint8_t* status = reinterpret_cast<uint8_t*>(status_p);
  std::atomic<int64_t> used(used_now);
  const int nt = threads_for(n, nthreads);
  std::vector<int64_t> news(nt, 0), new_empty(nt, 0), pending(nt, 0);
  {
    py::gil_scoped_release release;
    pk::parallel_ranges(n, nt, [&](int tid, int64_t b, int64_t e) {
      int64_t nn = 0, ne = 0, np = 0;
      auto run = [&](auto mode_tag) {
        constexpr int Mode = decltype(mode_tag)::value;
        pipelined<K, true>(keys, b, e, D, g, t.window_bytes, [&](int64_t i, K k, Probe p) {
          const uint64_t v = (Mode == M_ADD && !vals) ? 1 : (vals ? read_val<K, V>(vals, i) : 0);
          uint8_t st;
          if (PK_UNLIKELY(is_special(k))) {
            st = Mode == M_APPEND ? ST_SKIPPED : t.template insert_special<Mode>(k, v);
          } else {
            st = t.template insert_one<Mode>(k, v, p, used, limit, ne);
          }
          status[i] = st;
          nn += st == ST_NEW;
          np += st == ST_PENDING;
        });
      };
      if (mode == M_UPSERT) run(std::integral_constant<int, M_UPSERT>());
      else if (mode == M_ADD) run(std::integral_constant<int, M_ADD>());
      else run(std::integral_constant<int, M_APPEND>());
      news[tid] = nn; new_empty[tid] = ne; pending[tid] = np;
    });
  }
  int64_t a = 0, b = 0, c = 0;
  for (int i = 0; i < nt; ++i) { a += news[i]; b += new_empty[i]; c += pending[i]; }
  return py::make_tuple(a, b, c);
}

template <class K, class V>
void find_impl(const Geo& g, uintptr_t keys_p, int64_t n, uintptr_t out_vals_p, uintptr_t found_p, uint64_t dflt,
               int nthreads, int D) {
  Table<K, V> t(g);
  const K* keys = reinterpret_cast<const K*>(keys_p);
  uint8_t* found = reinterpret_cast<uint8_t*>(found_p);
  py::gil_scoped_release release;
  pk::parallel_ranges(n, threads_for(n, nthreads), [&](int, int64_t b, int64_t e) {
    pipelined<K, false>(keys, b, e, D, g, t.window_bytes, [&](int64_t i, K k, Probe p) {
      bool hit;
      uint64_t v = dflt;
      if (PK_UNLIKELY(is_special(k))) {
        const int s = special_index(k);
        hit = load_relaxed(&t.special[2 * s]) != 0;
        if (hit) v = load_relaxed(&t.special[2 * s + 1]);
      } else {
        auto* s = t.find_slot(k, p);
        hit = s != nullptr;
        if constexpr (Table<K, V>::kHasVal) {
          if (hit) v = (uint64_t)load_relaxed(&s->val);
        }
      }
      if (found) found[i] = hit;
      if constexpr (Table<K, V>::kHasVal) {
        if (out_vals_p) reinterpret_cast<V*>(out_vals_p)[i] = (V)v;
      }
    });
  });
}

// Erase: unique tables tombstone the key's slot; multi tables every slot holding the key.
// `zero_val`: counting tables reset the value so a reused slot starts at 0.
template <class K, class V>
int64_t erase_impl(const Geo& g, uintptr_t keys_p, int64_t n, uintptr_t out_p, bool multi, bool zero_val,
                   int nthreads, int D) {
  Table<K, V> t(g);
  const K* keys = reinterpret_cast<const K*>(keys_p);
  int64_t* out = reinterpret_cast<int64_t*>(out_p);  // erased count per key
  const int nt = threads_for(n, nthreads);
  std::vector<int64_t> tot(nt, 0);
  {
    py::gil_scoped_release release;
    pk::parallel_ranges(n, nt, [&](int tid, int64_t b, int64_t e) {
      int64_t sum = 0;
      pipelined<K, true>(keys, b, e, D, g, t.window_bytes, [&](int64_t i, K k, Probe p) {
        int64_t erased = 0;
        if (PK_UNLIKELY(is_special(k))) {
          if (!multi) {
            const int s = special_index(k);
            if (cas(&t.special[2 * s], (uint64_t)1, (uint64_t)0)) {
              erased = 1;
              store_relaxed(&t.special[2 * s + 1], (uint64_t)0);
            }
          }
        } else if (!multi) {
          auto* s = t.find_slot(k, p);
          if (s && cas(&s->key, k, Table<K, V>::TOMB)) {
            erased = 1;
            if constexpr (Table<K, V>::kHasVal) {
              if (zero_val) store_relaxed(&s->val, (V)0);
            }
          }
        } else {
          for (uint64_t w = 0; w < t.nw; ++w) {
            auto* win = t.window(p.w);
            bool stop = false;
            for (int j = 0; j < t.W; ++j) {
              const K sk = load_relaxed(&win[j].key);
              if (sk == k && cas(&win[j].key, k, Table<K, V>::TOMB)) ++erased;
              if (sk == Table<K, V>::EMPTY) { stop = true; break; }
            }
            if (stop) break;
            probe_next(p, t.nw);
          }
        }
        out[i] = erased;
        sum += erased;
      });
      tot[tid] = sum;
    });
  }
  int64_t s = 0;
  for (auto v : tot) s += v;
  return s;
}

// Multi-value: count (vals_out == 0) or retrieve into vals_out[offsets[i]...] (CSR).
template <class K, class V>
void multi_walk_impl(const Geo& g, uintptr_t keys_p, int64_t n, uintptr_t counts_p, uintptr_t offsets_p,
                     uintptr_t vals_out_p, int nthreads, int D) {
  Table<K, V> t(g);
  const K* keys = reinterpret_cast<const K*>(keys_p);
  int64_t* counts = reinterpret_cast<int64_t*>(counts_p);
  const int64_t* offsets = reinterpret_cast<const int64_t*>(offsets_p);
  V* vals_out = reinterpret_cast<V*>(vals_out_p);
  py::gil_scoped_release release;
  pk::parallel_ranges(n, threads_for(n, nthreads), [&](int, int64_t b, int64_t e) {
    pipelined<K, false>(keys, b, e, D, g, t.window_bytes, [&](int64_t i, K k, Probe p) {
      int64_t c = 0;
      if (!is_special(k)) {
        int64_t o = vals_out ? offsets[i] : 0;
        for (uint64_t w = 0; w < t.nw; ++w) {
          auto* win = t.window(p.w);
          bool stop = false;
          for (int j = 0; j < t.W; ++j) {
            const K sk = load_relaxed(&win[j].key);
            if (sk == k) {
              if (vals_out) vals_out[o + c] = win[j].val;
              ++c;
            }
            if (sk == Table<K, V>::EMPTY) { stop = true; break; }
          }
          if (stop) break;
          probe_next(p, t.nw);
        }
      }
      if (counts) counts[i] = c;
    });
  });
}

// items(): live slots in slot order. Two passes (count per range, then write), parallel.
template <class K, class V>
int64_t items_impl(const Geo& g, uintptr_t keys_out_p, uintptr_t vals_out_p, int64_t max_out, int nthreads) {
  Table<K, V> t(g);
  const int64_t nslots = (int64_t)(g.nw * (uint64_t)g.W);
  const int nt = threads_for(nslots, nthreads);
  std::vector<int64_t> cnt(nt + 1, 0);
  K* ko = reinterpret_cast<K*>(keys_out_p);
  V* vo = reinterpret_cast<V*>(vals_out_p);
  py::gil_scoped_release release;
  pk::parallel_ranges(nslots, nt, [&](int tid, int64_t b, int64_t e) {
    int64_t c = 0;
    for (int64_t s = b; s < e; ++s) c += !is_special(t.slots[s].key);
    cnt[tid + 1] = c;
  });
  for (int i = 0; i < nt; ++i) cnt[i + 1] += cnt[i];
  if (cnt[nt] > max_out) pk::fail_runtime("hash.items", "table holds more keys than expected (internal error)");
  pk::parallel_ranges(nslots, nt, [&](int tid, int64_t b, int64_t e) {
    int64_t o = cnt[tid];
    for (int64_t s = b; s < e; ++s) {
      const K k = t.slots[s].key;
      if (is_special(k)) continue;
      ko[o] = k;
      if constexpr (Table<K, V>::kHasVal) {
        if (vo) vo[o] = t.slots[s].val;
      }
      ++o;
    }
  });
  return cnt[nt];
}

// Rehash: every live slot of `src` into the empty table `dst` (append mode: keys are already unique,
// or duplicates are wanted for multi-value maps).
template <class K, class V>
int64_t rehash_impl(const Geo& src, const Geo& dst, int nthreads, int D) {
  Table<K, V> s(src), d(dst);
  const int64_t nslots = (int64_t)(src.nw * (uint64_t)src.W);
  const int nt = threads_for(nslots, nthreads);
  std::vector<int64_t> moved(nt, 0), missed(nt, 0);
  std::atomic<int64_t> used(0);
  const int64_t limit = (int64_t)(dst.nw * (uint64_t)dst.W);
  {
    py::gil_scoped_release release;
    pk::parallel_ranges(nslots, nt, [&](int tid, int64_t b, int64_t e) {
      // Compact this range's live keys in chunks, then run them through the prefetching pipeline.
      constexpr int64_t CH = 1024;
      K kbuf[CH];
      uint64_t vbuf[CH];
      int64_t ne = 0, mv = 0, ms = 0;
      for (int64_t c0 = b; c0 < e; c0 += CH) {
        int64_t m = 0;
        for (int64_t x = c0; x < std::min(e, c0 + CH); ++x) {
          const K k = s.slots[x].key;
          if (is_special(k)) continue;
          kbuf[m] = k;
          if constexpr (Table<K, V>::kHasVal) vbuf[m] = (uint64_t)s.slots[x].val;
          else vbuf[m] = 0;
          ++m;
        }
        pipelined<K, true>(kbuf, 0, m, D, dst, d.window_bytes, [&](int64_t i, K k, Probe p) {
          uint8_t st = d.template insert_one<M_APPEND>(k, vbuf[i], p, used, limit, ne);
          if (st == ST_NEW) ++mv; else ++ms;
        });
      }
      moved[tid] = mv;
      missed[tid] = ms;
    });
  }
  int64_t a = 0, b = 0;
  for (int i = 0; i < nt; ++i) { a += moved[i]; b += missed[i]; }
  if (b) pk::fail_runtime("hash.rehash", "destination table too small (internal error)");
  return a;
}

// ------------------------------------------------------------------------------------------------
// Bloom filter
// ------------------------------------------------------------------------------------------------
void bloom_add(uintptr_t words_p, uint64_t nblocks, int k, uint64_t seed, uintptr_t keys_p, int64_t n, int nthreads) {
  uint64_t* words = reinterpret_cast<uint64_t*>(words_p);
  const uint64_t* keys = reinterpret_cast<const uint64_t*>(keys_p);
  py::gil_scoped_release release;
  pk::parallel_ranges(n, threads_for(n, nthreads), [&](int, int64_t b, int64_t e) {
    constexpr int D = 16;
    for (int64_t i = b; i < e; ++i) {
      if (i + D < e) PK_PREFETCH_W(words + bloom_block(keys[i + D], seed, nblocks) * BLOOM_BLOCK_WORDS);
      uint64_t* blk = words + bloom_block(keys[i], seed, nblocks) * BLOOM_BLOCK_WORDS;
      uint64_t mask[BLOOM_BLOCK_WORDS];
      bloom_pattern(keys[i], seed, k, mask);
      for (int w = 0; w < BLOOM_BLOCK_WORDS; ++w)
        if (mask[w] && (load_relaxed(&blk[w]) & mask[w]) != mask[w]) __atomic_fetch_or(&blk[w], mask[w], __ATOMIC_RELAXED);
    }
  });
}

void bloom_contains(uintptr_t words_p, uint64_t nblocks, int k, uint64_t seed, uintptr_t keys_p, int64_t n,
                    uintptr_t out_p, int nthreads) {
  const uint64_t* words = reinterpret_cast<const uint64_t*>(words_p);
  const uint64_t* keys = reinterpret_cast<const uint64_t*>(keys_p);
  uint8_t* out = reinterpret_cast<uint8_t*>(out_p);
  py::gil_scoped_release release;
  pk::parallel_ranges(n, threads_for(n, nthreads), [&](int, int64_t b, int64_t e) {
    constexpr int D = 16;
    for (int64_t i = b; i < e; ++i) {
      if (i + D < e) PK_PREFETCH_R(words + bloom_block(keys[i + D], seed, nblocks) * BLOOM_BLOCK_WORDS);
      const uint64_t* blk = words + bloom_block(keys[i], seed, nblocks) * BLOOM_BLOCK_WORDS;
      uint64_t mask[BLOOM_BLOCK_WORDS];
      bloom_pattern(keys[i], seed, k, mask);
      bool all = true;
      for (int w = 0; w < BLOOM_BLOCK_WORDS; ++w) all &= (load_relaxed(&blk[w]) & mask[w]) == mask[w];
      out[i] = all;
    }
  });
}

// ------------------------------------------------------------------------------------------------
// Dispatch over (key bytes, value bytes)
// ------------------------------------------------------------------------------------------------
template <class F>
auto by_layout(const char* op, int kb, int vb, F&& f) {
  if (kb == 4 && vb == 0) return f(uint32_t{}, NoVal{});
  if (kb == 4 && vb == 4) return f(uint32_t{}, uint32_t{});
  if (kb == 4 && vb == 8) return f(uint32_t{}, uint64_t{});
  if (kb == 8 && vb == 0) return f(uint64_t{}, NoVal{});
  if (kb == 8 && vb == 4) return f(uint64_t{}, uint32_t{});
  if (kb == 8 && vb == 8) return f(uint64_t{}, uint64_t{});
  pk::fail_value(op, "unsupported key/value byte widths " + std::to_string(kb) + "/" + std::to_string(vb));
}

Geo geo_of(uintptr_t slots, uintptr_t special, uint64_t nw, int W, uint64_t seed, const char* op) {
  if (nw < 1 || nw >= (1ULL << 32)) pk::fail_value(op, "window count out of range");
  if (W < 1 || W > 64) pk::fail_value(op, "window size must be in 1..64");
  return Geo{slots, special, nw, W, seed};
}

int slot_bytes(int kb, int vb) {
  return by_layout("hash.slot_bytes", kb, vb, [](auto k, auto v) { return (int)sizeof(Slot<decltype(k), decltype(v)>); });
}

// Random probes of a large table miss the TLB on nearly every access with 4 KiB pages; 2 MiB pages
// make the page walk cheap (its entries stay cached). Python aligns big tables to 2 MiB and calls this
// before the first touch. Returns false where the kernel refuses (THP "never"), which is harmless.
bool advise_hugepages(uintptr_t ptr, int64_t nbytes) {
#ifdef MADV_HUGEPAGE
  const uintptr_t huge = 2u << 20;
  uintptr_t b = (ptr + huge - 1) & ~(huge - 1), e = (ptr + (uintptr_t)nbytes) & ~(huge - 1);
  if (e <= b) return false;
  return madvise(reinterpret_cast<void*>(b), e - b, MADV_HUGEPAGE) == 0;
#else
  (void)ptr; (void)nbytes;
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(_cpu_hash, m) {
  m.doc() = "pykernels CPU hash tables (WarpCore layout: windows, double hashing, CAS, prefetch pipeline)";
  m.def("cpu_has_avx2", &pk::cpu_has_avx2);
  m.def("slot_bytes", &slot_bytes, py::arg("kb"), py::arg("vb"));
  m.def("insert",
        [](uintptr_t slots, uintptr_t special, uint64_t nw, int W, uint64_t seed, int kb, int vb, uintptr_t keys,
           uintptr_t vals, int64_t n, uintptr_t status, int mode, int64_t used_now, int64_t limit, int nthreads,
           int D) {
          Geo g = geo_of(slots, special, nw, W, seed, "hash.insert");
          return by_layout("hash.insert", kb, vb, [&](auto k, auto v) {
            return insert_impl<decltype(k), decltype(v)>(g, keys, vals, n, status, mode, used_now, limit, nthreads, D);
          });
        },
        "Bulk insert; returns (new keys, new keys that took an EMPTY slot, keys left out because the table is full)");
  m.def("find",
        [](uintptr_t slots, uintptr_t special, uint64_t nw, int W, uint64_t seed, int kb, int vb, uintptr_t keys,
           int64_t n, uintptr_t out_vals, uintptr_t found, uint64_t dflt, int nthreads, int D) {
          Geo g = geo_of(slots, special, nw, W, seed, "hash.find");
          by_layout("hash.find", kb, vb, [&](auto k, auto v) {
            find_impl<decltype(k), decltype(v)>(g, keys, n, out_vals, found, dflt, nthreads, D);
            return 0;
          });
        });
  m.def("erase",
        [](uintptr_t slots, uintptr_t special, uint64_t nw, int W, uint64_t seed, int kb, int vb, uintptr_t keys,
           int64_t n, uintptr_t out, bool multi, bool zero_val, int nthreads, int D) {
          Geo g = geo_of(slots, special, nw, W, seed, "hash.erase");
          return by_layout("hash.erase", kb, vb, [&](auto k, auto v) {
            return erase_impl<decltype(k), decltype(v)>(g, keys, n, out, multi, zero_val, nthreads, D);
          });
        });
  m.def("multi_walk",
        [](uintptr_t slots, uintptr_t special, uint64_t nw, int W, uint64_t seed, int kb, int vb, uintptr_t keys,
           int64_t n, uintptr_t counts, uintptr_t offsets, uintptr_t vals_out, int nthreads, int D) {
          Geo g = geo_of(slots, special, nw, W, seed, "hash.multi");
          if (vb == 0) pk::fail_value("hash.multi", "multi-value tables need values");
          by_layout("hash.multi", kb, vb, [&](auto k, auto v) {
            if constexpr (!std::is_same<decltype(v), NoVal>::value)
              multi_walk_impl<decltype(k), decltype(v)>(g, keys, n, counts, offsets, vals_out, nthreads, D);
            return 0;
          });
        });
  m.def("items",
        [](uintptr_t slots, uint64_t nw, int W, int kb, int vb, uintptr_t keys_out, uintptr_t vals_out,
           int64_t max_out, int nthreads) {
          Geo g = geo_of(slots, 0, nw, W, 0, "hash.items");
          return by_layout("hash.items", kb, vb, [&](auto k, auto v) {
            return items_impl<decltype(k), decltype(v)>(g, keys_out, vals_out, max_out, nthreads);
          });
        });
  m.def("rehash",
        [](uintptr_t src, uint64_t src_nw, uintptr_t dst, uint64_t dst_nw, int W, uint64_t seed, int kb, int vb,
           int nthreads, int D) {
          Geo s = geo_of(src, 0, src_nw, W, seed, "hash.rehash");
          Geo d = geo_of(dst, 0, dst_nw, W, seed, "hash.rehash");
          return by_layout("hash.rehash", kb, vb, [&](auto k, auto v) {
            return rehash_impl<decltype(k), decltype(v)>(s, d, nthreads, D);
          });
        });
  m.def("advise_hugepages", &advise_hugepages, py::arg("ptr"), py::arg("nbytes"));
  m.def("bloom_add", &bloom_add);
  m.def("bloom_contains", &bloom_contains);
}
