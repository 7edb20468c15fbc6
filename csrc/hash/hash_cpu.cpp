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
// distance D is autotuned; lookups and inserts prefetch the first windows of D keys as a group,
// hash_cpu_probe.h).
// A window is one cache line, compared with one AVX-512 instruction per
// mask (hash_cpu_probe.h, per SIMD tier), and the overflow filter (hash_layout.h) lets a miss stop
// at its first full window: DRAM lines per find ~1.04 (load 0.5) and ~1.3-1.4 (load 0.9, hits or
// misses alike; 2.75 for half misses without the filter).
#include <pybind11/pybind11.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "hash_layout.h"
#include "pk_common.h"
#include "pk_threads.h"

namespace py = pybind11;
using namespace pkhash;

namespace {


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
// The insert loops store status codes through this type, not uint8_t: a store through a character type
// may alias any object, so after each one the loop reloaded its captured pointers and counters through
// two or three dependent loads (GCC gives an enum its own alias set; 4M adds, 2 threads: 3-10% faster).
enum class StatusCode : uint8_t {};
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
// Sequential passes over the slots (init_slots, items) run on one thread below this many bytes:
// threads_for's 16K slots (256 KiB of 16-byte slots, ~9 us of stores) waited for a second thread to join,
// 12 ms whenever another process held the other core (CountingTable(16384): clear() and the constructor
// took 8-12 ms on the shared 2-core Zen 4, ~10 us on one thread; items() 55-75 us); where a second
// thread is at hand it saves 10-20 us from 1 to 4 MiB (1 thread 18-31, 37, 72 us at 1, 2, 4 MiB; 2 threads
// 19, 22, 52 us), against the same 8-12 ms wait when it is not (CountingTable(65536): 7.9 ms).
constexpr int64_t kParallelScanBytes = int64_t(4) << 20;

inline int threads_for(int64_t n, int nthreads) {
  if (nthreads < 1) nthreads = 1;
  int64_t by_size = (n + kMinPerThread - 1) / kMinPerThread;
  return (int)std::max<int64_t>(1, std::min<int64_t>(nthreads, by_size));
}

// Dynamic work split: threads claim chunks of `kChunk` items from an atomic counter, so a thread that
// the OS deschedules (these machines are shared) does not hold the others up at the join, as a static
// split would. fn(tid, begin, end) is called once per chunk.
constexpr int64_t kChunk = 1 << 14;
template <class F>
inline void dyn_ranges(int64_t n, int nthreads, F&& fn) {
  if (nthreads <= 1 || n <= kChunk) {
    fn(0, (int64_t)0, n);
    return;
  }
  std::atomic<int64_t> next(0);
  pk::parallel_threads(nthreads, [&](int tid) {
    for (;;) {
      const int64_t b = next.fetch_add(kChunk, std::memory_order_relaxed);
      if (b >= n) break;
      fn(tid, b, std::min(n, b + kChunk));
    }
  });
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

// The load limit of one bulk insert: slots that ever left EMPTY may not pass `limit`. Each thread
// reserves slots from the shared counter in chunks while plenty remain, so the counter's cache line
// does not bounce between the cores on every insert (with two threads, a shared fetch_add per insert
// cost a cross-core line transfer each); near the limit it reserves one at a time. What a thread did
// not use goes back when it is done (insert_impl then retries keys another thread was refused).
struct Budget {
  static constexpr int64_t kChunk = 256;
  std::atomic<int64_t>* used;
  int64_t limit;
  int64_t local = 0;
  Budget(std::atomic<int64_t>& u, int64_t l) : used(&u), limit(l) {}
  Budget(const Budget&) = delete;
  ~Budget() {
    if (local) used->fetch_sub(local, std::memory_order_relaxed);
  }
  bool take() {
    if (local > 0) { --local; return true; }
    int64_t cur = used->load(std::memory_order_relaxed);
    for (;;) {
      const int64_t room = limit - cur;
      if (room <= 0) return false;
      const int64_t want = room > 64 * kChunk ? kChunk : 1;
      if (used->compare_exchange_weak(cur, cur + want, std::memory_order_relaxed)) {
        local = want - 1;
        return true;
      }
    }
  }
  void put_back() { ++local; }  // a reserved slot that was not taken after all
  // No EMPTY slot may be claimed any more (only tombstones can take a new key).
  bool exhausted() const { return local == 0 && used->load(std::memory_order_relaxed) >= limit; }
};

// How many rows of an insert are in flight per first window (its low 10 bits): a map's upserts on one
// thread keep each key's last value by handing a stored value to the earlier rows of its key still in
// flight (grouped_insert_w's `done`, insert_impl's AMAC loop), and search those rows only where this
// count shows another one (searched at every store, upserts of 4M present keys at load 0.9 took 45 ->
// 60 ms; with window 16, in AMAC, 145 -> 220+).
struct InFlightByWindow {
  static constexpr uint64_t kMask = 1023;
  uint8_t n[kMask + 1] = {};  // at most 128 rows are in flight
  void add(uint64_t w, int d) { n[w & kMask] = (uint8_t)(n[w & kMask] + d); }
  int at(uint64_t w) const { return n[w & kMask]; }
};

// Index of key k in a small direct-mapped or set-associative cache of 2^bits sets (Fibonacci hashing).
template <class K>
inline size_t small_index(K k, int bits) {
  return (size_t)(((uint64_t)k * 0x9E3779B97F4A7C15ULL) >> (64 - bits));
}

// Appends of a key that repeats (a multi-value map's hot key, a skewed join's build side). Each copy
// of a key walks the same probe sequence past the windows its earlier copies filled, so r copies cost
// O(r^2 / W) window reads (measured: 200K copies of one key, 27 s; Zipf(1.3) keys, 2M rows, 25 s).
// A thread remembers, for keys whose appends walked, where along the probe sequence the last copy went:
// every window before that one was seen full of live keys (an append takes the first EMPTY or
// TOMBSTONE it meets, and sets the overflow bit of each window it leaves), and during inserts no slot
// becomes EMPTY again, so the next copy may start there, skipping what a lookup walks anyway. A stale
// entry is still such a lower bound (the furthest one known is kept). Losing a key's entry costs its
// next copy the walk of its whole chain, so the cache is set-associative with least-recently-used
// replacement: a key in use keeps its entry (direct-mapped, Zipf keys' long chains evicted each other:
// 0.3 s where this takes ~0.1). Allocated at the first walk (distinct keys rarely walk 2 windows).
template <class K>
struct AppendHints {
  static constexpr int kWays = 4;
  // Sets: 2^set_bits, sized for the appends of one call (for_appends). With 1024 sets (4096 entries) the
  // keys of 2M rows of 16K distinct keys (128 copies each) evicted each other's entries and walked their
  // chains again: 460-550 ms; with 8192 sets 130-165 ms (4096 keys: 195 -> 105-118 ms; 64K keys: 211 ->
  // 135-178; 262K: 80 -> 70-76; MultiValueHashMap.insert, 2 threads, same script in turn). 16K sets
  // (1.5 MiB a thread, past L2) made the lookups slower than the walks they save for 64K-262K keys.
  int set_bits = 10;
  static constexpr uint64_t kMinWalk = 2;   // windows walked before a key is worth an entry
  static constexpr uint64_t kLongWalk = 4;  // ... when no earlier copy was met on the way
  struct Entry {
    K k;
    uint64_t w;        // the window of the key's last copy (the step and tag are the key's own)
    uint32_t visited;  // windows of the probe sequence before w (0: the entry is unused)
    uint32_t tick;     // when it was last used
  };
  std::vector<Entry> e;
  uint32_t now = 0;
  // Sized for n appends: a set per 64 rows (1024 to 8192 sets: 96 to 768 KiB a thread, allocated at
  // the first walk).
  void for_appends(int64_t n) {
    set_bits = 10;
    while (set_bits < 13 && ((int64_t)64 << set_bits) < n) ++set_bits;
  }
  Entry* set_of(K k) { return e.data() + kWays * small_index(k, set_bits); }
  // The key's entry, if it has one.
  Entry* lookup(K k) {
    if (e.empty()) return nullptr;
    Entry* set = set_of(k);
    for (int w = 0; w < kWays; ++w) {
      if (set[w].visited && set[w].k == k) {
        set[w].tick = ++now;
        return &set[w];
      }
    }
    return nullptr;
  }
  // An append about to walk on from its first window: moved to its last copy's window, if known.
  template <class St>
  bool resume(St& s) {
    const Entry* x = lookup(s.k);
    if (!x || x->visited <= s.visited) return false;
    s.p.w = x->w;
    s.visited = x->visited;
    return true;
  }
  // An append that took a slot in the state's current window.
  template <class St>
  void remember(const St& s) {
    if (s.visited < kMinWalk || s.visited >= (1ull << 32)) return;
    if (e.empty()) e.assign((size_t)kWays << set_bits, Entry{});
    Entry* set = set_of(s.k);
    Entry* victim = set;
    for (int w = 0; w < kWays; ++w) {
      Entry& x = set[w];
      if (x.visited && x.k == s.k) {
        victim = &x;
        if (x.visited > s.visited) {  // a copy that started before the entry moved on
          x.tick = ++now;
          return;
        }
        break;
      }
      if (x.tick < victim->tick) victim = &x;  // unused entries have tick 0
    }
    victim->k = s.k; victim->w = s.p.w; victim->visited = (uint32_t)s.visited; victim->tick = ++now;
  }
};

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
  // The overflow filter (hash_layout.h): byte w after the 4 head words of `special`; null for the
  // callers that pass no `special` (items, the source of a rehash), which then never stop early.
  uint8_t* ovf;

  explicit Table(const Geo& g)
      : slots(reinterpret_cast<S*>(g.slots)), special(reinterpret_cast<uint64_t*>(g.special)), nw(g.nw), W(g.W),
        seed(g.seed), geo(g), window_bytes(sizeof(S) * (size_t)g.W),
        ovf(g.special ? reinterpret_cast<uint8_t*>(g.special + 8 * SPECIAL_HEAD_WORDS) : nullptr) {}

  S* window(uint64_t w) const { return slots + w * (uint64_t)W; }

  // True when a probe that met neither the key nor an EMPTY slot in window w must go on.
  bool overflowed(uint64_t w, uint32_t tag) const { return !ovf || (load_relaxed(&ovf[w]) & tag); }
  // An insert leaves window w without a free slot: the key will live beyond it.
  void mark_overflow(uint64_t w, uint32_t tag) const {
    if (ovf && !(load_relaxed(&ovf[w]) & tag)) __atomic_fetch_or(&ovf[w], (uint8_t)tag, __ATOMIC_RELAXED);
  }

  // ---- find: returns the slot holding k, or nullptr ----
  S* find_slot(K k, Probe p) const {
    for (uint64_t t = 0; t < nw; ++t) {
      S* win = window(p.w);
      for (int j = 0; j < W; ++j) {
        const K sk = load_relaxed(&win[j].key);
        if (sk == k) return &win[j];
        if (sk == EMPTY) return nullptr;
      }
      if (!overflowed(p.w, p.tag)) return nullptr;
      probe_next(p, nw);
    }
    return nullptr;
  }

  // ---- insert, as a resumable state machine (one window per step; see amac_insert) ----
  // `used`/`limit`: slots that ever left EMPTY, and the most allowed (max load factor).
  struct InsState {
    int64_t i;
    Probe p0, p;
    uint64_t visited;
    S* free_slot;  // first EMPTY/TOMBSTONE slot met on the probe sequence
    uint64_t v;
    uint64_t mark_w;  // + 1: a window whose overflow bit this key still has to set (0: none)
    K k;
  };

  // prefetch = false: the caller prefetched the first window already (grouped_insert).
  void ins_begin(InsState& s, int64_t i, K k, uint64_t v, Probe p0, bool prefetch = true) const {
    // p0 and p from the register copy: `s.p0 = s.p = p0` re-read s.p with one 16-byte load right after
    // its narrower stores, a store-forwarding stall on every insert
    s.i = i; s.k = k; s.v = v; s.p0 = p0; s.p = p0; s.visited = 0; s.free_slot = nullptr; s.mark_w = 0;
    if (prefetch) prefetch_w(s.p.w);
  }
  void prefetch_w(uint64_t w) const {
    const char* line = reinterpret_cast<const char*>(window(w));
    PK_PREFETCH_W(line);
    if (window_bytes > 64) PK_PREFETCH_W(line + 64);
  }

  // Examines the state's current window. Returns true when the key is done (status in `st`).
  template <int Mode>
  bool ins_step(InsState& s, uint8_t& st, Budget& used, int64_t& new_empty) {
    if (s.mark_w) {  // the filter byte was prefetched with this window: set it before anything else
      mark_overflow(s.mark_w - 1, s.p.tag);
      s.mark_w = 0;
    }
    S* win = window(s.p.w);
    for (int j = 0; j < W; ++j) {
      const K sk = load_relaxed(&win[j].key);
      if (Mode != M_APPEND && sk == s.k) {
        if constexpr (kHasVal) {
          if (Mode == M_ADD) __atomic_fetch_add(&win[j].val, (V)s.v, __ATOMIC_RELAXED);
          else store_relaxed(&win[j].val, (V)s.v);
        }
        st = ST_EXISTED;
        return true;
      }
      if (sk == EMPTY) {
        // Beyond the first EMPTY the key cannot be (inserts always fill the first free slot).
        if (!s.free_slot) s.free_slot = &win[j];
        return claim<Mode>(s, st, used, new_empty);
      }
      if (sk == TOMB && !s.free_slot) {
        s.free_slot = &win[j];
        if (Mode == M_APPEND) return claim<Mode>(s, st, used, new_empty);  // duplicates allowed
      }
    }
    if (++s.visited < nw) {
      if (!s.free_slot) {
        // No free slot so far, and the load limit is reached: if the key is not beyond this window
        // either (or duplicates are allowed), the only slots left for it are tombstones further on.
        // Walking on for them read the whole table for every refused key of a full table at
        // max_load_factor 1.0 (quadratic in the capacity; review finding): refuse it here instead, and
        // the caller purges the tombstones or grows (pykernels/hashing/_tables.py) and inserts it again.
        if (PK_UNLIKELY(used.exhausted()) && (Mode == M_APPEND || !overflowed(s.p.w, s.p.tag))) {
          st = ST_PENDING;
          return true;
        }
        // The key will live beyond this window: set its filter bit at the next step, when the byte
        // is in cache (a synchronous miss here stalled every insert in flight).
        if (ovf) {
          s.mark_w = s.p.w + 1;
          PK_PREFETCH_W(ovf + s.p.w);
        }
      } else if (!overflowed(s.p.w, s.p.tag)) {
        return claim<Mode>(s, st, used, new_empty);  // not beyond either: take the free slot met
      }
      probe_next(s.p, nw);
      prefetch_w(s.p.w);
      return false;
    }
    if (!s.free_slot) { st = ST_PENDING; return true; }  // every slot holds a live key
    return claim<Mode>(s, st, used, new_empty);
  }

  // CAS the key into the chosen free slot; on a lost race, restart the probe (the winner may have
  // inserted this very key) and run it to the end here, or for an append read the same window again
  // (restarting sent the two threads' copies of a hot key back over its whole chain on every lost race).
  // Why to the end: the free slot is lost on one thread too, to another row of the call that took it
  // while this row was queued (grouped_insert_w's FIFO, amac's round robin); a restarted row put back in
  // the queue went behind a later row of its own key, which then was the one flagged new, and this row's
  // value overwrote the later one (review finding; test_single_thread_insert_after_a_lost_free_slot_...).
  template <int Mode>
  bool claim(InsState& s, uint8_t& st, Budget& used, int64_t& new_empty) {
    S* slot = s.free_slot;
    const K expect = load_relaxed(&slot->key);
    if (expect == EMPTY || expect == TOMB) {
      const bool from_empty = expect == EMPTY;
      if (from_empty && !used.take()) {
        st = ST_PENDING;
        return true;
      }
      if (cas(&slot->key, expect, s.k)) {
        if constexpr (kHasVal) {
          // Counting: a free slot's value is 0 (fresh tables are zeroed, erase zeroes it) and other
          // threads may add as soon as the key is visible: add, never store.
          if (Mode == M_ADD) __atomic_fetch_add(&slot->val, (V)s.v, __ATOMIC_RELAXED);
          else store_relaxed(&slot->val, (V)s.v);
        }
        if (from_empty) ++new_empty;
        st = ST_NEW;
        return true;
      }
      if (from_empty) used.put_back();
    }
    s.free_slot = nullptr;
    if (Mode != M_APPEND) {
      s.p = s.p0;
      s.visited = 0;
      prefetch_w(s.p.w);
      while (!ins_step<Mode>(s, st, used, new_empty)) {}  // rare: a synchronous walk costs little
      return true;
    }  // append: duplicates are allowed, so the window just read is still a lower bound: look at it again
    return false;
  }

  // hints: this thread's AppendHints (append mode; may be null).
  template <int Mode>
  uint8_t insert_one(K k, uint64_t v, Probe p0, Budget& used, int64_t& new_empty,
                     AppendHints<K>* hints = nullptr) {
    InsState s;
    ins_begin(s, 0, k, v, p0);
    if (Mode == M_APPEND && hints && hints->resume(s)) prefetch_w(s.p.w);
    uint8_t st = ST_PENDING;
    while (!ins_step<Mode>(s, st, used, new_empty)) {}
    if (Mode == M_APPEND && hints && st == ST_NEW) hints->remember(s);
    return st;
  }

  // Appends m copies of key k (probe p: the start of its sequence) in one run: val_at(0 .. m - 1) go into
  // the free slots (EMPTY or TOMBSTONE) met along k's probe sequence, in order, with the rules of
  // ins_step (the first free slot; the overflow bit of each window left; the load budget). The next
  // kRunAhead windows of the sequence (and their filter bytes) are kept in flight for writing: a hot
  // key's copies fill whole windows one after another, so the run moves at the memory's bandwidth, where
  // copies inserted one by one among other keys paid a hint lookup and a window's latency
  // every W copies. Returns how many were placed: fewer than m when the budget is spent or the table
  // walked (the rest are refused, as ins_step refuses them).
  static constexpr uint64_t kRunAhead = 16;
  template <class ValAt>
  int64_t append_run(K k, Probe p, int64_t m, ValAt&& val_at, Budget& used, int64_t& new_empty) {
    int64_t placed = 0;
    Probe ahead_p = p;
    uint64_t ahead = 0;  // windows prefetched beyond the current one
    for (uint64_t visited = 0;;) {
      for (; ahead < kRunAhead && visited + ahead + 1 < nw; ++ahead) {
        probe_next(ahead_p, nw);
        prefetch_w(ahead_p.w);
        if (ovf) PK_PREFETCH_W(ovf + ahead_p.w);
      }
      S* win = window(p.w);
      for (int j = 0; j < W; ++j) {
        const K sk = load_relaxed(&win[j].key);
        if (sk != EMPTY && sk != TOMB) continue;
        const bool from_empty = sk == EMPTY;
        if (from_empty && !used.take()) return placed;
        if (cas(&win[j].key, sk, k)) {
          if constexpr (kHasVal) store_relaxed(&win[j].val, (V)val_at(placed));
          new_empty += from_empty;
          if (++placed == m) return placed;
        } else if (from_empty) {
          used.put_back();  // taken by another thread a moment ago (it holds a live key now)
        }
      }
      if (visited + 1 >= nw || used.exhausted()) return placed;
      mark_overflow(p.w, p.tag);
      probe_next(p, nw);
      ++visited;
      if (ahead) --ahead;
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

// The value the insert of key i carries: the caller's (none: 0), or 1 for a counting add without counts.
template <class K, class V>
inline uint64_t insert_value(int mode, const void* vals, int64_t i) {
  return (mode == M_ADD && !vals) ? 1 : (vals ? read_val<K, V>(vals, i) : 0);
}

// An emitter for the lookup loops with an `ahead(base, nb)` hook, called as the lookups [base, base + nb)
// are hashed (about a group before they are emitted): the emitter may prefetch its outputs. Emitters
// without one (plain lambdas) skip it.
template <class Emit, class Ahead>
struct WithAhead {
  Emit& emit;
  Ahead& ahead_fn;
  template <class... A>
  __attribute__((always_inline)) void operator()(A&&... a) { emit(std::forward<A>(a)...); }
  __attribute__((always_inline)) void ahead(int64_t base, int nb) { ahead_fn(base, nb); }
};
template <class E, class = void>
struct has_ahead : std::false_type {};
template <class E>
struct has_ahead<E, std::void_t<decltype(std::declval<E&>().ahead(int64_t(0), 0))>> : std::true_type {};
template <class E>
__attribute__((always_inline)) inline void emit_ahead(E& emit, int64_t base, int nb) {
  if constexpr (has_ahead<E>::value) emit.ahead(base, nb);
}

// ------------------------------------------------------------------------------------------------
// Lookups and inserts, compiled per SIMD tier (chosen at run time: amac_find_tiered,
// grouped_insert_tiered). A 64-byte window's "key matches", "slot EMPTY" (and for inserts "slot
// TOMBSTONE") masks come from one AVX-512 compare per mask over the whole cache line, keeping the key
// lanes (every sizeof(Slot)/sizeof(K)-th element) with a PEXT; on the AVX2 tier from one compare of
// the window's keys shuffled into one register (tier_avx2::Keys), or two over the line with the lane
// bits packed by shifts (compress_lanes): Zen 1 and Zen 2 run PEXT in microcode, ~20 cycles per set
// bit of the mask, which was most of the time of an in-cache lookup there.
// ------------------------------------------------------------------------------------------------
template <class K, class V>
constexpr uint32_t key_lanes() {
  constexpr int n = 64 / sizeof(K), stride = sizeof(Slot<K, V>) / sizeof(K);
  uint32_t m = 0;
  for (int j = 0; j < n; j += stride) m |= 1u << j;
  return m;
}

// The bits of m at the key lanes (every STRIDE-th of its NB low bits, from bit 0; STRIDE 1, 2 or 4)
// packed into the low bits, in order, without PEXT: each step halves the number of runs.
template <int STRIDE, int NB>
inline uint32_t compress_lanes(uint32_t m) {
  static_assert(STRIDE == 1 || STRIDE == 2 || STRIDE == 4, "slots of 1, 2 or 4 key widths");
  static_assert(NB == 8 || NB == 16, "a 64-byte line of 8- or 4-byte keys");
  if constexpr (STRIDE == 1) {
    return m;
  } else if constexpr (STRIDE == 2) {  // bits 0, 2, 4, ..., NB - 2
    m &= 0x5555u;
    m = (m | (m >> 1)) & 0x3333u;
    m = (m | (m >> 2)) & 0x0F0Fu;
    return NB == 8 ? m : (m | (m >> 4)) & 0x00FFu;
  } else {  // bits 0, 4, 8, 12 of 16
    m &= 0x1111u;
    m = (m | (m >> 3)) & 0x0303u;
    return (m | (m >> 6)) & 0x000Fu;
  }
}

namespace tier_portable {
constexpr bool kSimdLines = false;
template <class K, class V>
inline void line_masks(const Slot<K, V>*, K, uint32_t&, uint32_t&) {}
template <class K, class V>
inline void line_masks3(const Slot<K, V>*, K, uint32_t&, uint32_t&, uint32_t&) {}
template <class K, class V>
inline uint32_t line_hit(const Slot<K, V>*, K) { return 0; }
#include "hash_cpu_probe.h"
}  // namespace tier_portable

#if PK_X86
#pragma GCC push_options
#pragma GCC target("avx2,bmi,bmi2,popcnt")
namespace tier_avx2 {
constexpr bool kSimdLines = true;
// Bit e: element e (of sizeof(K) bytes) of the 64-byte line lo:hi equals x.
template <class K>
inline uint32_t eq_bits(__m256i lo, __m256i hi, K x) {
  if constexpr (sizeof(K) == 8) {
    const __m256i xx = _mm256_set1_epi64x((long long)x);
    return (uint32_t)_mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpeq_epi64(lo, xx))) |
           (uint32_t)_mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpeq_epi64(hi, xx))) << 4;
  } else {
    const __m256i xx = _mm256_set1_epi32((int)x);
    return (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(lo, xx))) |
           (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(hi, xx))) << 8;
  }
}
// A window's slots of two key widths (an 8-byte key with an 8-byte value, a 4-byte key with a 4-byte
// value: the map and counting tables' usual layouts) hold 4 or 8 keys; one unpack and one permute put
// them in slot order in one register, so each mask is then one compare and one movemask. Other layouts
// compare the whole line and keep the key lanes with compress_lanes.
template <class K, class V>
struct Keys {
  static constexpr int stride = sizeof(Slot<K, V>) / sizeof(K);
  static constexpr bool packed = stride == 2;
  __m256i lo, hi, keys;
  explicit Keys(const Slot<K, V>* win) {
    // one load of each half: every mask sees one state of the line (see window_masks3)
    lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(win));
    hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(win) + 1);
    if constexpr (packed && sizeof(K) == 8) {  // [k0 k2 | k1 k3] -> [k0 k1 k2 k3]
      keys = _mm256_permute4x64_epi64(_mm256_unpacklo_epi64(lo, hi), 0xD8);
    } else if constexpr (packed) {  // [k0 k1 k4 k5 | k2 k3 k6 k7] -> [k0 .. k7]
      keys = _mm256_permute4x64_epi64(
          _mm256_castps_si256(_mm256_shuffle_ps(_mm256_castsi256_ps(lo), _mm256_castsi256_ps(hi), 0x88)), 0xD8);
    }
  }
  // bit j: slot j's key equals x
  uint32_t eq(K x) const {
    if constexpr (packed && sizeof(K) == 8) {
      const __m256i xx = _mm256_set1_epi64x((long long)x);
      return (uint32_t)_mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpeq_epi64(keys, xx)));
    } else if constexpr (packed) {
      const __m256i xx = _mm256_set1_epi32((int)x);
      return (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(keys, xx)));
    } else {
      return compress_lanes<stride, 64 / sizeof(K)>(eq_bits(lo, hi, x));
    }
  }
};
template <class K, class V>
inline void line_masks(const Slot<K, V>* win, K k, uint32_t& hit, uint32_t& empty) {
  const Keys<K, V> line(win);
  hit = line.eq(k);
  empty = line.eq(Sentinel<K>::EMPTY);
}
template <class K, class V>
inline void line_masks3(const Slot<K, V>* win, K k, uint32_t& hit, uint32_t& empty, uint32_t& tomb) {
  const Keys<K, V> line(win);
  hit = line.eq(k);
  empty = line.eq(Sentinel<K>::EMPTY);
  tomb = line.eq(Sentinel<K>::TOMB);
}
template <class K, class V>
inline uint32_t line_hit(const Slot<K, V>* win, K k) { return Keys<K, V>(win).eq(k); }
#include "hash_cpu_probe.h"
}  // namespace tier_avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,bmi,bmi2,popcnt")
namespace tier_avx512 {
constexpr bool kSimdLines = true;
template <class K>
inline uint32_t eq_bits(__m512i line, K x) {
  if constexpr (sizeof(K) == 8) return _mm512_cmpeq_epi64_mask(line, _mm512_set1_epi64((long long)x));
  else return _mm512_cmpeq_epi32_mask(line, _mm512_set1_epi32((int)x));
}
template <class K, class V>
inline void line_masks(const Slot<K, V>* win, K k, uint32_t& hit, uint32_t& empty) {
  const __m512i line = _mm512_loadu_si512(win);
  constexpr uint32_t lanes = key_lanes<K, V>();
  hit = _pext_u32(eq_bits(line, k), lanes);
  empty = _pext_u32(eq_bits(line, Sentinel<K>::EMPTY), lanes);
}
template <class K, class V>
inline void line_masks3(const Slot<K, V>* win, K k, uint32_t& hit, uint32_t& empty, uint32_t& tomb) {
  const __m512i line = _mm512_loadu_si512(win);  // one load: the three masks see one state of the line
  constexpr uint32_t lanes = key_lanes<K, V>();
  hit = _pext_u32(eq_bits(line, k), lanes);
  empty = _pext_u32(eq_bits(line, Sentinel<K>::EMPTY), lanes);
  tomb = _pext_u32(eq_bits(line, Sentinel<K>::TOMB), lanes);
}
template <class K, class V>
inline uint32_t line_hit(const Slot<K, V>* win, K k) {
  return _pext_u32(eq_bits(_mm512_loadu_si512(win), k), key_lanes<K, V>());
}
#include "hash_cpu_probe.h"
}  // namespace tier_avx512
#pragma GCC pop_options
#endif

// The lookup loop for this machine's best tier (PYKERNELS_DISABLE_AVX512 / _AVX2 step down).
template <class K, class V, class Emit>
void amac_find_tiered(const Table<K, V>& t, const K* keys, int64_t b, int64_t e, int G, Emit&& emit) {
#if PK_X86
  if (pk::cpu_has_avx512()) return tier_avx512::amac_find(t, keys, b, e, G, emit);
  if (pk::cpu_has_avx2()) return tier_avx2::amac_find(t, keys, b, e, G, emit);
#endif
  tier_portable::amac_find(t, keys, b, e, G, emit);
}

template <int Mode, class K, class V, class ValOf, class Finish>
bool grouped_insert_tiered(Table<K, V>& t, const K* keys, int64_t b, int64_t e, int G, Budget& budget,
                           int64_t& new_empty, ValOf&& val_of, Finish&& finish, AppendHints<K>* hints) {
#if PK_X86
  if (pk::cpu_has_avx512())
    return tier_avx512::grouped_insert<Mode>(t, keys, b, e, G, budget, new_empty, val_of, finish, hints);
  if (pk::cpu_has_avx2())
    return tier_avx2::grouped_insert<Mode>(t, keys, b, e, G, budget, new_empty, val_of, finish, hints);
#endif
  return tier_portable::grouped_insert<Mode>(t, keys, b, e, G, budget, new_empty, val_of, finish, hints);
}

template <int Mode, class K, class V>
int64_t lean_inserts_tiered(Table<K, V>& t, const K* keys, int64_t b, int64_t e, int G, const void* vals,
                            StatusCode* codes, Budget& budget, int64_t& new_keys, int64_t& new_empty, K* rest_k,
                            int64_t* rest_i) {
#if PK_X86
  if (pk::cpu_has_avx512())
    return tier_avx512::lean_inserts<Mode>(t, keys, b, e, G, vals, codes, budget, new_keys, new_empty, rest_k, rest_i);
  if (pk::cpu_has_avx2())
    return tier_avx2::lean_inserts<Mode>(t, keys, b, e, G, vals, codes, budget, new_keys, new_empty, rest_k, rest_i);
#endif
  return tier_portable::lean_inserts<Mode>(t, keys, b, e, G, vals, codes, budget, new_keys, new_empty, rest_k, rest_i);
}

// ------------------------------------------------------------------------------------------------
// Bulk operations
// ------------------------------------------------------------------------------------------------
// How many times each of up to `count` sampled keys was met: an open-addressing table at most half full
// (L1/L2), not a sort of the samples (sorting 16384 of them took ~0.4-0.5 ms: most of a 130K-row count,
// ~10% of a 4M-row one).
template <class K>
struct SampleCounter {
  int bits = 6;
  size_t mask = 0;
  std::vector<K> seen;
  std::vector<uint32_t> times;
  explicit SampleCounter(int64_t count) {
    while (((int64_t)1 << bits) < 2 * count) ++bits;
    mask = ((size_t)1 << bits) - 1;
    seen.resize(mask + 1);
    times.assign(mask + 1, 0);
  }
  uint32_t add(K k) {  // the times k has been met, this one included
    size_t x = small_index(k, bits);
    while (times[x] && seen[x] != k) x = (x + 1) & mask;
    seen[x] = k;
    return ++times[x];
  }
  template <class F>
  void each(F&& f) const {  // f(key, times) for every key met
    for (size_t x = 0; x <= mask; ++x)
      if (times[x]) f(seen[x], times[x]);
  }
};

// `count` evenly spaced keys of key_at(0..n-1) into out, the reserved patterns (e.g. a table's EMPTY
// slots) left out, sorted; returns how many.
template <class K, class KeyAt>
int sorted_sample(int64_t n, int count, KeyAt&& key_at, K* out) {
  int m = 0;
  for (int j = 0; j < count; ++j) {
    const K k = key_at((int64_t)((uint64_t)j * (uint64_t)n / count));
    if (!is_special(k)) out[m++] = k;
  }
  std::sort(out, out + m);
  return m;
}

// Whether some key makes up more than ~1% of the n keys key_at(0..n-1): 6 or more equal among 512 evenly
// spaced samples.
template <class K, class KeyAt>
bool has_hot_key(int64_t n, KeyAt&& key_at) {
  constexpr int kSamples = 512, kHot = 6;
  if (n < 8 * kSamples) return false;
  K sample[kSamples];
  const int m = sorted_sample(n, kSamples, key_at, sample);
  for (int j = 1, run = 1; j < m; ++j) {
    run = sample[j] == sample[j - 1] ? run + 1 : 1;
    if (run >= kHot) return true;
  }
  return false;
}

// The share of the rows (estimated from the samples) from which adds and upserts of nh hot keys take the
// hot keys' path in insert_impl. Measured (4M rows, 2 threads, 64 or 1024 categories mixed with 1M
// distinct keys, each path in turn): below ~half the rows the path was 1.1-1.6x slower than inserting
// every row (the split looks up every row among the hot keys; the cold rows then cost as much per row
// as before); 64 categories: 1.2x faster from 60% (the rows on the few contended lines cost most), 1.7-4x
// from 80% (and the plain inserts had erratic 90-100 ms runs there: both cores adding to 64 lines);
// 1024 categories: slower up to 75%, 1.3-1.9x faster from 90%. Uniformly repeated keys (16K-128K
// distinct, none hot: a few sampled 4 times by chance) took the path for ~1.4x the time before this
// gate (their share: ~8%).
inline double hot_add_share(size_t nh) { return nh <= 256 ? 0.6 : 0.8; }

// The keys that make up about 0.025% or more of a bulk insert's n keys (kMin or more equal among kSamples
// evenly spaced samples, 1024 in inputs under 8 * kSamples rows: 0.4% of their rows; the reserved patterns
// never), the kMax most frequent at most: insert_impl appends each one's copies as a run (Table::append_run; 0.025% of 2M rows fill ~125 windows), or sums
// (keeps the last of) its adds (upserts) per thread. id(k): its index, or -1, from a small
// open-addressing table (L1/L2).
// Inputs from kMinRows rows on are sampled (1024 samples below 8 * kSamples rows): counting 50K rows of
// 16 values (every add a locked add on one of 16 lines, back to back) took 0.85 ms
// against value_counts' 0.23 ms when only inputs of 8 * kSamples rows or more were sampled.
template <class K>
struct HotKeys {
  static constexpr int kSamples = 16384, kMin = 4, kMax = 1024;
  static constexpr int64_t kMinRows = 16384;
  // the cells: 2^bits >= 8x the hot keys (64 int64 keys: 8 KiB, L1; 1024: 128 KiB, L2). At 4x, a lookup went on
  // to a second cell (a mispredicted branch) often enough to cost CountingTable.add of 4M keys of 1024 hot
  // values 21 -> 15 ms, of 64 values 10.6 -> 9.1 (one thread, old/new builds in turn)
  int bits = 0;
  struct Cell { K k; int32_t id; };  // id -1: empty
  std::vector<K> keys;
  std::vector<int64_t> sampled;  // how many of the samples each one is
  int samples = 0;               // how many rows were sampled
  double share = 0;              // the hot keys' share of the samples (the reserved patterns left out)
  std::vector<Cell> cells;
  template <class KeyAt>
  void detect(int64_t n, KeyAt&& key_at) {
    if (n < kMinRows) return;
    // 1024 of the samples first: no two equal (distinct keys, the common case) leaves the full sample
    // uncounted; a key of 0.1% of the input shows twice there with probability ~0.4. An input under
    // 8 * kSamples rows is judged by those 1024 alone (counting n / 32 samples cost 130K rows of 1000
    // values 25% more time), so its hot keys are those of 0.4% of its rows or more.
    constexpr int kPre = 1024;
    samples = n >= 8 * kSamples ? kSamples : kPre;
    bool repeat = false;
    auto count_samples = [&](int count, SampleCounter<K>& c, bool stop_at_a_repeat) {
      int m = 0;
      for (int j = 0; j < count; ++j) {
        const K k = key_at((int64_t)((uint64_t)j * (uint64_t)n / count));
        if (is_special(k)) continue;
        ++m;
        if (c.add(k) > 1) {
          repeat = true;
          if (stop_at_a_repeat) break;
        }
      }
      return m;
    };
    SampleCounter<K> pre(kPre);
    int sampled_keys = count_samples(kPre, pre, samples > kPre);
    if (!repeat) return;
    SampleCounter<K> full(samples > kPre ? samples : 1);
    if (samples > kPre) sampled_keys = count_samples(samples, full, false);
    std::vector<std::pair<int64_t, K>> found;  // (times sampled, key)
    (samples > kPre ? full : pre).each([&](K k, uint32_t t) {
      if (t >= (uint32_t)kMin) found.emplace_back((int64_t)t, k);
    });
    // in key order, as the sorted sample gave them (the hot keys' ids, hence where a multi-value map's
    // runs go, stay as they were)
    std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
    if (found.size() > (size_t)kMax) {  // the most frequent ones (review finding: the smallest key values were kept)
      std::nth_element(found.begin(), found.begin() + kMax, found.end(),
                       [](const auto& a, const auto& b) { return a.first > b.first; });
      found.resize(kMax);
    }
    int64_t hot_samples = 0;
    for (const auto& f : found) {
      keys.push_back(f.second);
      sampled.push_back(f.first);
      hot_samples += f.first;
    }
    share = sampled_keys <= 0 ? 0.0 : (double)hot_samples / (double)sampled_keys;
    if (keys.empty()) return;
    bits = 6;
    while (((size_t)1 << bits) < 8 * keys.size()) ++bits;
    cells.assign((size_t)1 << bits, Cell{K(), -1});
    const size_t mask = ((size_t)1 << bits) - 1;
    for (size_t h = 0; h < keys.size(); ++h) {
      size_t x = small_index(keys[h], bits);
      while (cells[x].id >= 0) x = (x + 1) & mask;
      cells[x] = Cell{keys[h], (int32_t)h};
    }
    plan_direct();
  }
  // A few hot keys (a column of categories) get a collision-free direct map instead: 16 cells a key and a
  // multiplier tried until no two keys share a cell (64 keys: each try succeeds with probability ~e^-2),
  // so a lookup is one cell and no probe loop (CountingTable.add of 4M keys of 64 values, one thread,
  // old/new builds in turn: 9.4 -> 8.7 ms).
  static constexpr size_t kDirectMaxKeys = 64;
  static constexpr int kDirectTries = 256;
  uint64_t mul = 0;  // nonzero: cells is the direct map of multiplier mul
  void plan_direct() {
    if (keys.size() > kDirectMaxKeys) return;
    const int dbits = bits + 1;
    std::vector<Cell> direct((size_t)1 << dbits);
    uint64_t m = 0x9E3779B97F4A7C15ULL;
    for (int t = 0; t < kDirectTries; ++t, m = (m * 6364136223846793005ULL + 1442695040888963407ULL) | 1) {
      std::fill(direct.begin(), direct.end(), Cell{K(), -1});
      size_t h = 0;
      for (; h < keys.size(); ++h) {
        Cell& c = direct[(size_t)(((uint64_t)keys[h] * m) >> (64 - dbits))];
        if (c.id >= 0) break;
        c = Cell{keys[h], (int32_t)h};
      }
      if (h < keys.size()) continue;
      cells.swap(direct);
      bits = dbits;
      mul = m;
      return;
    }
  }
  bool empty() const { return keys.empty(); }
  // The lookup on a raw copy of the cells' address: a loop that also stores status bytes (which may
  // alias anything) then keeps it in a register instead of reloading the vector's fields per key.
  struct Finder {
    const Cell* cells;
    int bits;
    uint64_t mul;  // nonzero: a direct map (plan_direct)
    int id(K k) const {
      if (mul) {
        const Cell& c = cells[(size_t)(((uint64_t)k * mul) >> (64 - bits))];
        return c.k == k ? c.id : -1;  // (an empty cell: id -1 whatever its key)
      }
      const size_t mask = ((size_t)1 << bits) - 1;
      for (size_t x = small_index(k, bits);; x = (x + 1) & mask) {
        const Cell& c = cells[x];
        if (c.k == k || c.id < 0) return c.id;
      }
    }
  };
  Finder finder() const { return Finder{cells.data(), bits, mul}; }
  int id(K k) const { return finder().id(k); }
};

// The thread that owns key k when appends are split by key (insert_impl, rehash_impl).
template <class K>
inline int owner_of(K k, uint64_t seed, int nt) {
  return (int)((((fmix64((uint64_t)k ^ seed) >> 16) & 0xffff) * (uint64_t)nt) >> 16);
}

// A handler of the hot keys (split_hot_cold's on_hot) with a leaner form for once its state says so
// (HotSums: every hot key's first row seen).
template <class H, class = void>
struct HasSteady : std::false_type {};
template <class H>
struct HasSteady<H, std::void_t<decltype(std::declval<H&>().steady())>> : std::true_type {};

// Each of nt threads takes a contiguous range [b, e) of the n keys key_at(i) (the ranges follow each
// other, and a thread meets its keys in input order): make_on_hot(tid, b, e) gives its handler of the hot
// keys, on_hot(h, i); the other keys go to cold(tid, keys, positions, m) in chunks of kChunk. A handler
// with steady() (HasSteady) is asked before each chunk, and where it says so the chunk's hot keys go to
// its steady_hot(h, i) instead.
template <class K, class KeyAt, class MakeOnHot, class Cold>
void split_hot_cold(int64_t n, int nt, const HotKeys<K>& hot, KeyAt&& key_at, MakeOnHot&& make_on_hot,
                    Cold&& cold) {
  pk::parallel_threads(nt, [&](int tid) {
    const int64_t b = n * tid / nt, e = n * (tid + 1) / nt;
    auto on_hot = make_on_hot(tid, b, e);
    std::vector<K> kbuf(kChunk);
    std::vector<int64_t> ibuf(kChunk);
    K* const kb = kbuf.data();
    int64_t* const ib = ibuf.data();
    const auto find = hot.finder();
    auto chunk = [&](int64_t c0, int64_t c1, auto&& hot_row) __attribute__((always_inline)) {
      int64_t m = 0;
      for (int64_t i = c0; i < c1; ++i) {
        const K k = key_at(i);
        const int h = find.id(k);
        if (h >= 0) {
          hot_row(h, i);
          continue;
        }
        kb[m] = k;
        ib[m] = i;
        ++m;
      }
      if (m) cold(tid, kb, ib, m);
    };
    for (int64_t c0 = b; c0 < e; c0 += kChunk) {
      const int64_t c1 = std::min(e, c0 + kChunk);
      if constexpr (HasSteady<decltype(on_hot)>::value) {
        if (on_hot.steady()) {
          chunk(c0, c1, [&](int h, int64_t i) __attribute__((always_inline)) { on_hot.steady_hot(h, i); });
          continue;
        }
      }
      chunk(c0, c1, on_hot);
    }
  });
}

// The hot keys' handler of adds and upserts (insert_impl): sums each hot key's adds privately (an upsert:
// keeps its last value) and notes its first row. Once every hot key's first row was seen (a column of a
// few categories: within a few hundred rows), steady_hot skips that test; whether it adds and whether
// values come are template arguments, not tests per row. CountingTable.add of 4M keys (one thread, old/new
// builds in turn): 64 values 8.5 -> 6.1 ms, 1024 values 14.9 -> 12.4; HashMap.insert of 2M Zipf(1.3) keys
// 16.4 -> 15.2.
template <class K, class V, bool ADD, bool VALS>
struct HotSums {
  uint64_t* sum;
  int64_t* fst;
  const void* vs;  // the values (VALS); else each add is 1 (an upsert: 0)
  int64_t unseen;  // hot keys whose first row is still to come
  __attribute__((always_inline)) void steady_hot(int h, int64_t i) const {
    const uint64_t x = VALS ? read_val<K, V>(vs, i) : (ADD ? 1 : 0);
    if (ADD) sum[h] += x;
    else sum[h] = x;
  }
  __attribute__((always_inline)) void operator()(int h, int64_t i) {
    steady_hot(h, i);
    if (fst[h] < 0) {
      fst[h] = i;
      --unseen;
    }
  }
  bool steady() const { return unseen == 0; }
};

// Appends n (key, value) pairs with hot keys (HotKeys; a skewed join's build side, or the rehash of its
// table: Zipf(1.3) keys, 2M rows, 200 keys hold 83% of them). First each thread takes a contiguous range
// of the pairs: its other keys go to cold(tid, keys, positions, m) in chunks as they come (split by
// position: with the hot keys out, no two threads often meet at one key's chain tail), the hot keys'
// values are listed per key, in order, and hot(i) told. Then each hot key's copies, in input order, are
// appended by one thread as one run (Table::append_run; the largest keys first, each to the least
// loaded thread). Returns, per hot key, how many copies a full table refused (the last ones in input
// order); placed_by and new_empty_by gain, per thread, the copies placed and the EMPTY slots they took.
template <class K, class V, class KeyAt, class ValAt, class Hot, class Cold>
std::vector<int64_t> append_with_runs(Table<K, V>& t, const Geo& g, std::atomic<int64_t>& used, int64_t limit,
                                      int64_t n, int nt, const HotKeys<K>& hot, KeyAt&& key_at, ValAt&& val_at,
                                      Hot&& hot_seen, Cold&& cold, std::vector<int64_t>& placed_by,
                                      std::vector<int64_t>& new_empty_by) {
  const size_t nh = hot.keys.size();
  // the values per thread and key, in the table's value type: phase two reads nothing of the input (a key
  // with 1% of the rows read one value line per copy there, at DRAM latency: 27 -> 8 ms)
  using LV = typename std::conditional<Table<K, V>::kHasVal, V, uint8_t>::type;
  std::vector<std::vector<std::vector<LV>>> listed(nt, std::vector<std::vector<LV>>(nh));
  // per thread and key, how many values are listed: each list is sized ahead (what the sample predicts)
  // and filled by index, trimmed to its count at the end (push_back, not inlined, was ~10% of building
  // 2M Zipf(1.3) rows)
  std::vector<std::vector<size_t>> filled(nt, std::vector<size_t>(nh, 0));
  split_hot_cold(n, nt, hot, key_at, [&](int tid, int64_t b, int64_t e) {
    auto& mine = listed[tid];
    for (size_t h = 0; h < nh; ++h)
      mine[h].resize((size_t)((e - b) * hot.sampled[h] / hot.samples * 5 / 4 + 64));
    return [&mine, &cnt = filled[tid], &val_at, &hot_seen](int h, int64_t i) __attribute__((always_inline)) {
      auto& list = mine[h];
      if (PK_UNLIKELY(cnt[h] == list.size())) list.resize(2 * list.size());
      list[cnt[h]++] = (LV)val_at(i);
      hot_seen(i);
    };
  }, cold);
  for (int x = 0; x < nt; ++x)
    for (size_t h = 0; h < nh; ++h) listed[x][h].resize(filled[x][h]);
  std::vector<int64_t> copies(nh, 0), load(nt, 0), refused(nh, 0);
  std::vector<int> order(nh), owner(nh);
  for (size_t h = 0; h < nh; ++h) {
    order[h] = (int)h;
    for (int x = 0; x < nt; ++x) copies[h] += (int64_t)listed[x][h].size();
  }
  std::sort(order.begin(), order.end(), [&](int a, int b) { return copies[a] > copies[b]; });
  for (int h : order) {
    const int x = (int)(std::min_element(load.begin(), load.end()) - load.begin());
    owner[h] = x;
    load[x] += copies[h];
  }
  pk::parallel_threads(nt, [&](int tid) {
    Budget budget(used, limit);
    int64_t placed_all = 0, ne = 0;
    for (int h : order) {
      if (owner[h] != tid || !copies[h]) continue;
      const K k = hot.keys[h];
      // the copies' values: the threads' lists one after another (input order); x only grows
      int li = 0;
      int64_t base = 0;
      auto value = [&](int64_t x) __attribute__((always_inline)) {
        while (x - base >= (int64_t)listed[li][h].size()) base += (int64_t)listed[li++][h].size();
        return (uint64_t)listed[li][h][(size_t)(x - base)];
      };
      const int64_t placed = t.append_run(k, probe_start((uint64_t)k, g.seed, g.nw), copies[h], value, budget, ne);
      placed_all += placed;
      refused[h] = copies[h] - placed;
    }
    placed_by[tid] += placed_all;
    new_empty_by[tid] += ne;
  });
  // A thread may have been refused while another still held reserved slots (given back since): the
  // refused copies again, on one thread, so "refused" means what it does single-threaded.
  int64_t total_refused = 0;
  for (int64_t r : refused) total_refused += r;
  if (total_refused && nt > 1) {
    Budget budget(used, limit);
    int64_t placed_all = 0, ne = 0;
    for (int h : order) {
      if (!refused[h]) continue;
      const int64_t skip = copies[h] - refused[h];  // the copies placed: the first ones in input order
      int li = 0;
      int64_t base = 0;
      auto value = [&](int64_t x) __attribute__((always_inline)) {
        x += skip;
        while (x - base >= (int64_t)listed[li][h].size()) base += (int64_t)listed[li++][h].size();
        return (uint64_t)listed[li][h][(size_t)(x - base)];
      };
      const K k = hot.keys[h];
      const int64_t placed = t.append_run(k, probe_start((uint64_t)k, g.seed, g.nw), refused[h], value, budget, ne);
      placed_all += placed;
      refused[h] -= placed;
    }
    placed_by[0] += placed_all;
    new_empty_by[0] += ne;
  }
  return refused;
}

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
  std::vector<AppendHints<K>> hints(mode == M_APPEND ? nt : 0);  // per thread, kept across its ranges
  for (auto& h : hints) h.for_appends(n);
  // Inserts keys ks[b, e) on thread tid; idx: the input position of each (ByIdx false: ks is `keys`, and
  // idx unused: a compile-time choice, as a run-time one cost the common path ~5-9%).
  auto insert_range = [&](int tid, const K* ks, const int64_t* idx, int64_t b, int64_t e, auto by_idx) {
      constexpr bool ByIdx = decltype(by_idx)::value;
      int64_t nn = 0, ne = 0, np = 0;
      Budget budget(used, limit);
      auto run = [&](auto mode_tag) {
        constexpr int Mode = decltype(mode_tag)::value;
        using St = typename Table<K, V>::InsState;
        AppendHints<K>* const hint = Mode == M_APPEND ? hints.data() + tid : nullptr;
        constexpr int kMaxG = 64;
        St sts[kMaxG];
        bool live[kMaxG];
        const int G = std::max(1, std::min(D, kMaxG));
        int64_t next = b;
        auto pos = [&](int64_t j) __attribute__((always_inline)) { return ByIdx ? idx[j] : j; };
        // stores a status code only (counted after the run): see StatusCode
        StatusCode* const codes = reinterpret_cast<StatusCode*>(status);
        auto finish = [codes, idx, by_idx](int64_t j, uint8_t st) __attribute__((always_inline)) {
          codes[decltype(by_idx)::value ? idx[j] : j] = StatusCode(st);
        };
        auto start = [&](St& s) -> bool {
          while (next < e) {
            const int64_t j = next++;
            const K k = ks[j];
            const uint64_t v = insert_value<K, V>(Mode, vals, pos(j));
            if (PK_UNLIKELY(is_special(k))) {
              finish(j, Mode == M_APPEND ? ST_SKIPPED : t.template insert_special<Mode>(k, v));
              continue;
            }
            t.ins_begin(s, j, k, v, probe_start((uint64_t)k, g.seed, g.nw));
            if constexpr (Mode == M_APPEND) {
              if (hint && hint->resume(s)) t.prefetch_w(s.p.w);
            }
            return true;
          }
          return false;
        };
        auto val_of = [&](int64_t j) __attribute__((always_inline)) -> uint64_t {
          return insert_value<K, V>(Mode, vals, pos(j));
        };
        // as lookups do (find_impl): the status bytes about to be written and the values about to be
        // read, prefetched ~4 KiB ahead of the inserts just hashed (input order only)
        auto ahead = [&](int64_t base, int nb) __attribute__((always_inline)) {
          if (ByIdx) return;
          pk::prefetch_stream_range<true>(status, base, nb);
          if constexpr (Table<K, V>::kHasVal) {
            if (vals) pk::prefetch_stream_range(reinterpret_cast<const V*>(vals), base, nb);
          }
        };
        if (grouped_insert_tiered<Mode>(t, ks, b, e, G, budget, ne, val_of,
                                        WithAhead<decltype(finish), decltype(ahead)>{finish, ahead}, hint))
          return;
        // other window sizes: AMAC, up to G inserts in flight, one window per step
        // (a map: a row that stores over its key hands its value to the earlier rows of the key in
        // flight, which would store theirs after it; see InFlightByWindow)
        constexpr bool kForward = Mode == M_UPSERT && Table<K, V>::kHasVal;
        InFlightByWindow in_flight;
        auto begin = [&](int x) __attribute__((always_inline)) {
          live[x] = start(sts[x]);
          if constexpr (kForward) in_flight.add(sts[x].p0.w, live[x]);
          return live[x];
        };
        int active = 0;
        for (int x = 0; x < G; ++x) active += begin(x);
        while (active) {
          for (int x = 0; x < G; ++x) {
            if (!live[x]) continue;
            uint8_t st;
            if (!t.template ins_step<Mode>(sts[x], st, budget, ne)) continue;
            if constexpr (Mode == M_APPEND) {
              if (hint && st == ST_NEW) hint->remember(sts[x]);
            }
            if constexpr (kForward) {
              if (st == ST_EXISTED && in_flight.at(sts[x].p0.w) > 1) {  // (this row is counted too)
                for (int y = 0; y < G; ++y)
                  if (live[y] && y != x && sts[y].k == sts[x].k && sts[y].i < sts[x].i) sts[y].v = sts[x].v;
              }
              in_flight.add(sts[x].p0.w, -1);
            }
            finish(sts[x].i, st);
            if (!begin(x)) --active;
          }
        }
      };
      if (mode == M_UPSERT) run(std::integral_constant<int, M_UPSERT>());
      else if (mode == M_ADD) run(std::integral_constant<int, M_ADD>());
      else run(std::integral_constant<int, M_APPEND>());
      // every key of [b, e) got exactly one status (its position is this call's alone): counted here
      for (int64_t j = b; j < e; ++j) {
        const uint8_t st = status[ByIdx ? idx[j] : j];
        nn += st == ST_NEW;
        np += st == ST_PENDING;
      }
      news[tid] += nn; new_empty[tid] += ne; pending[tid] += np;
  };
  {
    py::gil_scoped_release release;
    HotKeys<K> hot;
    hot.detect(n, [&](int64_t i) { return keys[i]; });
    // Adds and upserts take the hot keys' path only where the hot keys are most of the input (see
    // hot_add_share); else every row is inserted.
    if (!hot.empty() && mode != M_APPEND && hot.share >= hot_add_share(hot.keys.size())) {
      // Adds and upserts with hot keys (a column of few categories): each thread sums its range's adds of
      // each hot key privately (an upsert: keeps its last value), and each hot key then gets one add of
      // its total (one upsert of the last value in input order). Every add or store on one of a few cache
      // lines that both cores write made 4M keys of 64 values take 43-78 ms (pandas' value_counts: 14;
      // HashMap.insert 63 ms, pd.factorize 30). The key's first occurrence in input order gets ST_NEW
      // where the key was new.
      const bool add = mode == M_ADD;
      const size_t nh = hot.keys.size();
      std::vector<std::vector<uint64_t>> sums(nt, std::vector<uint64_t>(nh, 0));
      std::vector<std::vector<int64_t>> first(nt, std::vector<int64_t>(nh, -1));
      auto sum_hot = [&](auto add_tag, auto vals_tag) {
        constexpr bool ADD = decltype(add_tag)::value, VALS = decltype(vals_tag)::value;
        split_hot_cold(n, nt, hot, [&](int64_t i) { return keys[i]; },
                       [&](int tid, int64_t b, int64_t e) {
                         // (the cold keys' inserts overwrite their status)
                         std::memset(status + b, ST_EXISTED, (size_t)(e - b));
                         return HotSums<K, V, ADD, VALS>{sums[tid].data(), first[tid].data(), vals, (int64_t)nh};
                       },
                       [&](int tid, const K* ks, const int64_t* idx, int64_t m) {
                         insert_range(tid, ks, idx, 0, m, std::true_type());
                       });
      };
      if (add && vals) sum_hot(std::true_type(), std::true_type());
      else if (add) sum_hot(std::true_type(), std::false_type());
      else if (vals) sum_hot(std::false_type(), std::true_type());
      else sum_hot(std::false_type(), std::false_type());
      Budget budget(used, limit);
      int64_t ne = 0;
      for (size_t h = 0; h < nh; ++h) {
        uint64_t total = 0;
        int64_t fi = -1;
        for (int x = 0; x < nt; ++x) {  // the threads' ranges are in input order
          if (first[x][h] < 0) continue;
          if (fi < 0) fi = first[x][h];
          total = add ? total + sums[x][h] : sums[x][h];
        }
        if (fi < 0) continue;
        const K k = hot.keys[h];
        const Probe p = probe_start((uint64_t)k, g.seed, g.nw);
        const uint8_t st = add ? t.template insert_one<M_ADD>(k, total, p, budget, ne)
                               : t.template insert_one<M_UPSERT>(k, total, p, budget, ne);
        if (st == ST_NEW) {
          status[fi] = ST_NEW;
          ++news[0];
        } else if (st == ST_PENDING) {  // a full table: every occurrence is refused (and retried by Python)
          for (int64_t i = 0; i < n; ++i) {
            if (keys[i] == k) {
              status[i] = ST_PENDING;
              ++pending[0];
            }
          }
        }
      }
      new_empty[0] += ne;
    } else if (!hot.empty() && mode == M_APPEND) {
      const std::vector<int64_t> refused = append_with_runs(t, g, used, limit, n, nt, hot,
                       [&](int64_t i) { return keys[i]; },
                       [&](int64_t i) { return insert_value<K, V>(M_APPEND, vals, i); },
                       [&](int64_t i) { status[i] = ST_NEW; },
                       [&](int tid, const K* ks, const int64_t* idx, int64_t m) {
                         insert_range(tid, ks, idx, 0, m, std::true_type());
                       },
                       news, new_empty);
      // the copies a full table refused: the last `refused` of each such key, marked in one pass
      int64_t total = 0;
      for (int64_t r : refused) total += r;
      if (total) {
        std::vector<int64_t> left(refused.size(), 0);  // copies of each key placed before its refused ones
        for (int64_t i = 0; i < n; ++i) {
          const int h = hot.id(keys[i]);
          if (h >= 0) ++left[h];
        }
        for (size_t h = 0; h < refused.size(); ++h) left[h] -= refused[h];
        for (int64_t i = 0; i < n; ++i) {
          const int h = hot.id(keys[i]);
          if (h >= 0 && left[h]-- <= 0) status[i] = ST_PENDING;
        }
        pending[0] += total;
      }
    } else if (mode == M_APPEND && nt > 1 && has_hot_key<K>(n, [&](int64_t i) { return keys[i]; })) {
      // Appends of skewed keys split by key, not by position: each thread reads the whole input and
      // inserts the keys whose hash picks it. Two threads appending copies of one hot key met at the tail
      // of its chain (every CAS a cache-line transfer between the cores: Zipf(1.3) keys, 2M rows, 2
      // threads 270 ms, one thread 155, split by key 190); each key has one owner. The price, paid only
      // where a sample shows a hot key: every thread reads and hashes all keys (distinct keys: 1.45x).
      pk::parallel_threads(nt, [&](int tid) {
        std::vector<K> kbuf(kChunk);
        std::vector<int64_t> ibuf(kChunk);
        for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
          const int64_t c1 = std::min(n, c0 + kChunk);
          int64_t m = 0;
          for (int64_t i = c0; i < c1; ++i) {
            const K k = keys[i];
            kbuf[m] = k;
            ibuf[m] = i;
            m += owner_of(k, g.seed, nt) == tid;
          }
          insert_range(tid, kbuf.data(), ibuf.data(), 0, m, std::true_type());
        }
      });
    } else if (mode != M_APPEND) {
      // Adds and upserts: the rows their first window decides go through lean_inserts, the rest (kept in
      // order) through the general loop, a piece of kLeanPiece rows at a time. A piece where most rows were
      // left (a nearly full table) sends the thread's next kLeanSkip pieces straight to the general loop.
      constexpr int64_t kLeanPiece = 2048;
      constexpr int kLeanSkip = 32;
      std::vector<int> skip(nt, 0);
      StatusCode* const codes = reinterpret_cast<StatusCode*>(status);
      dyn_ranges(n, nt, [&](int tid, int64_t b, int64_t e) {
        K rest_k[kLeanPiece];
        int64_t rest_i[kLeanPiece];
        int64_t nn = 0, ne = 0;
        for (int64_t c = b; c < e;) {
          const int64_t ce = std::min(e, c + kLeanPiece);
          int64_t left = -1;
          if (skip[tid] == 0) {
            // (its reserved slots given back before the general insert takes its own: see Budget)
            Budget budget(used, limit);
            left = mode == M_ADD
                       ? lean_inserts_tiered<M_ADD>(t, keys, c, ce, D, vals, codes, budget, nn, ne, rest_k, rest_i)
                       : lean_inserts_tiered<M_UPSERT>(t, keys, c, ce, D, vals, codes, budget, nn, ne, rest_k, rest_i);
          }
          if (left < 0) {
            insert_range(tid, keys, nullptr, c, ce, std::false_type());
            skip[tid] -= skip[tid] > 0;
          } else {
            if (left) insert_range(tid, rest_k, rest_i, 0, left, std::true_type());
            if (2 * left > ce - c) skip[tid] = kLeanSkip;
          }
          c = ce;
        }
        news[tid] += nn;
        new_empty[tid] += ne;
      });
    } else {
      dyn_ranges(n, nt, [&](int tid, int64_t b, int64_t e) { insert_range(tid, keys, nullptr, b, e, std::false_type()); });
    }
  }
  int64_t a = 0, b = 0, c = 0;
  for (int i = 0; i < nt; ++i) { a += news[i]; b += new_empty[i]; c += pending[i]; }
  if (c && nt > 1) {
    // A thread may have been refused while another still held reserved slots (given back since):
    // retry the refused keys alone, so "left out" means what it does single-threaded.
    py::gil_scoped_release release;
    Budget budget(used, limit);
    for (int64_t i = 0; i < n; ++i) {
      if (status[i] != ST_PENDING) continue;
      const K k = keys[i];
      const uint64_t v = insert_value<K, V>(mode, vals, i);
      const Probe p = probe_start((uint64_t)k, g.seed, g.nw);
      uint8_t st;
      if (mode == M_UPSERT) st = t.template insert_one<M_UPSERT>(k, v, p, budget, b);
      else if (mode == M_ADD) st = t.template insert_one<M_ADD>(k, v, p, budget, b);
      else st = t.template insert_one<M_APPEND>(k, v, p, budget, b);
      if (st == ST_PENDING) continue;  // still no room (a key already present is updated, as alone)
      status[i] = st;
      a += st == ST_NEW;
      --c;
    }
  }
  return py::make_tuple(a, b, c);
}


template <class K, class V>
void find_impl(const Geo& g, uintptr_t keys_p, int64_t n, uintptr_t out_vals_p, uintptr_t found_p, uint64_t dflt,
               int nthreads, int D) {
  Table<K, V> t(g);
  const K* keys = reinterpret_cast<const K*>(keys_p);
  uint8_t* found = reinterpret_cast<uint8_t*>(found_p);
  py::gil_scoped_release release;
  V* const out_vals = reinterpret_cast<V*>(out_vals_p);
  dyn_ranges(n, threads_for(n, nthreads), [&](int, int64_t b, int64_t e) {
    // Inlined into the lookup loop, and branch-free on hit/miss: with hits and misses mixed at random a
    // branch mispredicts on every other lookup (measured: 50% hits took ~1.5x the time of 0% or 100%).
    auto emit = [&](int64_t i, K k, Slot<K, V>* s, bool hit, bool special) __attribute__((always_inline)) {
      uint64_t v = dflt;
      if (PK_UNLIKELY(special)) {
        const int si = special_index(k);
        hit = load_relaxed(&t.special[2 * si]) != 0;
        if (hit) v = load_relaxed(&t.special[2 * si + 1]);
      } else if constexpr (Table<K, V>::kHasVal) {
        const uint64_t sv = (uint64_t)load_relaxed(&s->val);  // s is a valid slot even on a miss
        const uint64_t keep = 0 - (uint64_t)hit;                // all ones on a hit: a mask, not a branch
        v = (sv & keep) | (dflt & ~keep);
      }
      if (found) found[i] = hit;
      if constexpr (Table<K, V>::kHasVal) {
        if (out_vals) out_vals[i] = (V)v;
      }
    };
    // The lines emit() will store to, prefetched for writing ~4 KiB ahead of the lookups [base, base + nb)
    // just hashed (which run a group later): with the fill buffers busy on table lines, the stores of
    // values and flags waited on their read-for-ownership. Measured (4M int64 keys, 2 threads, same
    // script in turn): load 0.5 26.4 -> 21.9 ms all hits, 27.7 -> 24.0 half misses; 0.9 all hits
    // 37.9 -> 34.6, half misses unchanged (they run in AMAC, where a prefetch per started lookup cost 5%).
    auto ahead = [&](int64_t base, int nb) __attribute__((always_inline)) {
      if constexpr (Table<K, V>::kHasVal) {
        if (out_vals) pk::prefetch_stream_range<true>(out_vals, base, nb);
      }
      if (found) pk::prefetch_stream_range<true>(found, base, nb);
    };
    amac_find_tiered(t, keys, b, e, D, WithAhead<decltype(emit), decltype(ahead)>{emit, ahead});
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
  // Multi tables: the keys whose chain a thread walked to its end in this call, once the walk passed
  // kRepeatCheck windows. A repeat of such a key on that thread stops there: the walk already tombstoned
  // every value (nothing inserts during an erase), so it erases 0 either way. Without it each repeat
  // walked the whole chain again over the tombstones: one key of 100K values given 100K times took 8 s
  // (review finding), now each thread walks a key's chain at most once. Short chains never look.
  constexpr uint64_t kRepeatCheck = 8;
  std::vector<std::unordered_set<K>> walked_keys(multi ? nt : 0);
  {
    py::gil_scoped_release release;
    dyn_ranges(n, nt, [&](int tid, int64_t b, int64_t e) {
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
          std::unordered_set<K>& walked = walked_keys[tid];
          bool repeat = false;
          uint64_t w = 0;
          for (; w < t.nw; ++w) {
            if (w == kRepeatCheck && (repeat = walked.count(k) != 0)) break;  // this thread walked it: done
            auto* win = t.window(p.w);
            bool stop = false;
            for (int j = 0; j < t.W; ++j) {
              const K sk = load_relaxed(&win[j].key);
              if (sk == k && cas(&win[j].key, k, Table<K, V>::TOMB)) ++erased;
              if (sk == Table<K, V>::EMPTY) { stop = true; break; }
            }
            if (stop || !t.overflowed(p.w, p.tag)) break;
            probe_next(p, t.nw);
          }
          if (w >= kRepeatCheck && !repeat) walked.insert(k);
        }
        out[i] = erased;
        sum += erased;
      });
      tot[tid] += sum;
    });
  }
  int64_t s = 0;
  for (auto v : tot) s += v;
  return s;
}

// Multi-value walks. Every value of key k (probe p), in probe order, through on_value(v); returns the
// number of windows walked. A walk past kWalkFrom windows keeps the next kWalkAhead windows of the
// probe sequence (and their filter bytes) in flight: the sequence is known in advance (double
// hashing), so a key with many values walks at the memory's bandwidth, not one DRAM latency per
// window. Short walks (most keys) prefetch nothing they will not read.
constexpr int kWalkFrom = 2, kWalkAhead = 16;
template <class K, class V, class OnValue>
inline uint64_t multi_walk_key(const Table<K, V>& t, K k, Probe p, OnValue&& on_value) {
  Probe ahead_p = p;
  uint64_t ahead = 0;  // windows prefetched beyond the current one
  uint64_t w = 0;
  for (; w < t.nw; ++w) {
    if (w >= (uint64_t)kWalkFrom) {
      if (w == (uint64_t)kWalkFrom) ahead_p = p;
      for (; ahead < (uint64_t)kWalkAhead && w + ahead + 1 < t.nw; ++ahead) {
        probe_next(ahead_p, t.nw);
        PK_PREFETCH_R(t.window(ahead_p.w));
        if (t.ovf) PK_PREFETCH_R(t.ovf + ahead_p.w);
      }
    }
    const auto* win = t.window(p.w);
    bool stop = false;
    for (int j = 0; j < t.W; ++j) {
      const K sk = load_relaxed(&win[j].key);
      if (sk == k) on_value(win[j].val);
      if (sk == Table<K, V>::EMPTY) { stop = true; break; }
    }
    if (stop || !t.overflowed(p.w, p.tag)) break;
    probe_next(p, t.nw);
    if (ahead) --ahead;
  }
  return w + 1;
}

// A key whose walk was long (many values) and that comes again in the same call is answered from the
// first answer: its count, and a copy of the values already written for it (the table does not change
// during the call: the Python methods hold the table's lock). Walking again cost 64K queries of a key
// with 200K values 31 s (review finding). Direct-mapped, per chunk of keys; short walks not kept.
template <class K>
struct WalkMemo {
  static constexpr int kBits = 8;
  static constexpr uint64_t kLongWalk = 8;
  struct Entry { K k; int64_t at, c; };  // at: where its values were written
  Entry e[1 << kBits];
  WalkMemo() { for (Entry& x : e) x.at = -1; }
  Entry* hit(K k) {
    Entry& x = e[small_index(k, kBits)];
    return x.at >= 0 && x.k == k ? &x : nullptr;
  }
  void keep(K k, int64_t at, int64_t c, uint64_t walked) {
    if (walked > kLongWalk) e[small_index(k, kBits)] = Entry{k, at, c};
  }
};

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
  dyn_ranges(n, threads_for(n, nthreads), [&](int, int64_t b, int64_t e) {
    WalkMemo<K> memo;
    pipelined<K, false>(keys, b, e, D, g, t.window_bytes, [&](int64_t i, K k, Probe p) {
      int64_t c = 0;
      if (!is_special(k)) {
        const int64_t o = vals_out ? offsets[i] : 0;
        if (auto* m = memo.hit(k)) {
          if (vals_out) std::memcpy(vals_out + o, vals_out + m->at, (size_t)m->c * sizeof(V));
          c = m->c;
        } else {
          const uint64_t walked = multi_walk_key(t, k, p, [&](V v) __attribute__((always_inline)) {
            if (vals_out) vals_out[o + c] = v;
            ++c;
          });
          memo.keep(k, o, c, walked);
        }
      }
      if (counts) counts[i] = c;
    });
  });
}

// A multi-value find in one walk per key (the count-then-retrieve of multi_walk_impl walks every chain
// twice): each chunk of keys appends its values to a stream of its own and writes its keys' counts;
// Python then sizes the output from the counts and copy_to lays the streams end to end (a sequential
// copy of the values, where the second walk re-read every window of every chain).
// A stream is a list of blocks (1K values, doubling up to 64K), never reallocated: the values are held
// about twice at the peak (streams + output; copy_to frees each block once copied), where a doubling
// vector held up to 3x (review finding: 762 MB of output, 1.8 GB peak).
struct ValueStream {
  static constexpr int64_t kFirst = 1 << 10, kMax = 1 << 16;  // values per block
  std::vector<std::unique_ptr<char[]>> blocks;
  std::vector<int64_t> starts;  // the first value of each block
  int64_t size = 0;             // values
  int64_t room = 0;             // left in the last block
  char* tail = nullptr;         // where the next value goes
  int64_t block_values(size_t b) const { return std::min<int64_t>(kMax, kFirst << std::min<size_t>(b, 6)); }
  template <class V>
  void grow() {
    const int64_t nv = block_values(blocks.size());
    blocks.emplace_back(new char[(size_t)nv * sizeof(V)]);
    starts.push_back(size);
    room = nv;
    tail = blocks.back().get();
  }
  template <class V>
  __attribute__((always_inline)) void push(V v) {
    if (PK_UNLIKELY(room == 0)) grow<V>();
    std::memcpy(tail, &v, sizeof(V));
    tail += sizeof(V);
    --room;
    ++size;
  }
  // Appends the c values from position at (an earlier key's values: a repeated key).
  template <class V>
  void repeat(int64_t at, int64_t c) {
    while (c > 0) {
      const size_t b = (size_t)(std::upper_bound(starts.begin(), starts.end(), at) - starts.begin()) - 1;
      const int64_t off = at - starts[b];
      int64_t n = std::min(c, block_values(b) - off);
      if (room == 0) grow<V>();
      n = std::min(n, room);
      std::memmove(tail, blocks[b].get() + off * (int64_t)sizeof(V), (size_t)n * sizeof(V));
      tail += n * (int64_t)sizeof(V);
      room -= n;
      size += n;
      at += n;
      c -= n;
    }
  }
  // Copies the values to out and frees the blocks.
  void drain(char* out, int vbytes) {
    for (size_t b = 0; b < blocks.size(); ++b) {
      const int64_t n = std::min(block_values(b), size - starts[b]);
      std::memcpy(out + starts[b] * vbytes, blocks[b].get(), (size_t)(n * vbytes));
      blocks[b].reset();
    }
    blocks.clear();
  }
};

struct MultiCollected {
  std::vector<ValueStream> chunks;  // values of the keys [c * kChunk, (c + 1) * kChunk), in key order
  int64_t total = 0;                // values in all
  int vbytes = 8;
  int nthreads = 1;
  bool drained = false;
  MultiCollected() = default;
  MultiCollected(MultiCollected&&) = default;
  MultiCollected& operator=(MultiCollected&&) = default;
  MultiCollected(const MultiCollected&) = delete;  // (the blocks are owned: pybind11 moves it out)
  void copy_to(uintptr_t out_p) {
    if (drained) pk::fail_runtime("hash.multi_collect", "the collected values were copied out already");
    drained = true;
    char* out = reinterpret_cast<char*>(out_p);
    std::vector<int64_t> at(chunks.size() + 1, 0);
    for (size_t c = 0; c < chunks.size(); ++c) at[c + 1] = at[c] + chunks[c].size;
    py::gil_scoped_release release;
    auto copy = [&](size_t c) { chunks[c].drain(out + at[c] * vbytes, vbytes); };
    const int nt = chunks.size() > 1 ? threads_for(at.back(), nthreads) : 1;
    if (nt <= 1) {
      for (size_t c = 0; c < chunks.size(); ++c) copy(c);
      return;
    }
    std::atomic<size_t> next(0);
    pk::parallel_threads(nt, [&](int) {
      for (size_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks.size();) copy(c);
    });
  }
};

template <class K, class V>
MultiCollected multi_collect_impl(const Geo& g, uintptr_t keys_p, int64_t n, uintptr_t counts_p, int nthreads,
                                  int D) {
  Table<K, V> t(g);
  const K* keys = reinterpret_cast<const K*>(keys_p);
  int64_t* counts = reinterpret_cast<int64_t*>(counts_p);
  MultiCollected out;
  out.chunks.resize((size_t)std::max<int64_t>(1, (n + kChunk - 1) / kChunk));
  out.vbytes = (int)sizeof(V);
  out.nthreads = nthreads;
  py::gil_scoped_release release;
  const int nt = threads_for(n, nthreads);
  std::vector<int64_t> totals(nt, 0);
  dyn_ranges(n, nt, [&](int tid, int64_t b, int64_t e) {
    ValueStream& vs = out.chunks[(size_t)(b / kChunk)];
    WalkMemo<K> memo;
    pipelined<K, false>(keys, b, e, D, g, t.window_bytes, [&](int64_t i, K k, Probe p) {
      int64_t c = 0;
      if (!is_special(k)) {
        if (auto* m = memo.hit(k)) {
          vs.repeat<V>(m->at, m->c);
          c = m->c;
        } else {
          const int64_t at = vs.size;
          const uint64_t walked = multi_walk_key(t, k, p, [&](V v) __attribute__((always_inline)) { vs.push(v); });
          c = vs.size - at;
          memo.keep(k, at, c, walked);
        }
      }
      counts[i] = c;
    });
    totals[tid] += vs.size;
  });
  for (int64_t x : totals) out.total += x;
  return out;
}

// items(): live slots in slot order. Two passes (count per range, then write), parallel.
template <class K, class V>
int64_t items_impl(const Geo& g, uintptr_t keys_out_p, uintptr_t vals_out_p, int64_t max_out, int nthreads) {
  Table<K, V> t(g);
  const int64_t nslots = (int64_t)(g.nw * (uint64_t)g.W);
  // two sequential reads of the slots: one thread below kParallelScanBytes (see there)
  const int nt = nslots * (int64_t)sizeof(Slot<K, V>) < kParallelScanBytes ? 1 : threads_for(nslots, nthreads);
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
    // Branch-free compaction: every slot is written at the next output position, which advances only
    // for a live key (a live-or-not branch mispredicts on half the slots of a half-full table). The
    // range's last live key is followed by dead slots whose writes go to a local sink, never past
    // this range's share of the outputs.
    int64_t o = cnt[tid];
    const int64_t end = cnt[tid + 1];
    K ksink;
    V vsink;
    for (int64_t s = b; s < e; ++s) {
      const K k = t.slots[s].key;
      const bool live = !is_special(k);
      const bool room = o < end;
      K* kd = room ? &ko[o] : &ksink;
      *kd = k;
      if constexpr (Table<K, V>::kHasVal) {
        if (vo) *(room ? &vo[o] : &vsink) = t.slots[s].val;
      }
      o += live;
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
  std::vector<AppendHints<K>> hints(nt);  // a multi-value map's repeated keys (unique tables: never hit)
  for (auto& h : hints) h.for_appends(nslots);
  // Appends the m compacted live keys kbuf (values vbuf) to dst on thread tid.
  auto append_live = [&](int tid, const K* kbuf, const uint64_t* vbuf, int64_t m) {
    int64_t ne = 0, mv = 0, ms = 0;
    Budget budget(used, limit);
    auto tally = [&](int64_t, uint8_t st) __attribute__((always_inline)) { if (st == ST_NEW) ++mv; else ++ms; };
    if (!grouped_insert_tiered<M_APPEND>(d, kbuf, 0, m, D, budget, ne,
                                         [&](int64_t i) __attribute__((always_inline)) { return vbuf[i]; }, tally,
                                         &hints[tid])) {
      pipelined<K, true>(kbuf, 0, m, D, dst, d.window_bytes, [&](int64_t i, K k, Probe p) {
        tally(i, d.template insert_one<M_APPEND>(k, vbuf[i], p, budget, ne, &hints[tid]));
      });
    }
    moved[tid] += mv;
    missed[tid] += ms;
  };
  // Moves the live slots at(0 .. m - 1) of src on thread tid (by_key: only the keys tid owns, as insert_impl):
  // compacted in chunks, then run through the prefetching pipeline.
  auto move_slots = [&](int tid, int64_t m, auto&& at, bool by_key) {
    constexpr int64_t CH = 1024;
    K kbuf[CH];
    uint64_t vbuf[CH];
    for (int64_t c0 = 0; c0 < m; c0 += CH) {
      int64_t c = 0;
      for (int64_t j = c0; j < std::min(m, c0 + CH); ++j) {
        const int64_t x = at(j);
        const K k = s.slots[x].key;
        if (is_special(k) || (by_key && owner_of(k, dst.seed, nt) != tid)) continue;
        kbuf[c] = k;
        if constexpr (Table<K, V>::kHasVal) vbuf[c] = (uint64_t)s.slots[x].val;
        else vbuf[c] = 0;
        ++c;
      }
      append_live(tid, kbuf, vbuf, c);
    }
  };
  auto move_range = [&](int tid, int64_t b, int64_t e, bool by_key) {
    move_slots(tid, e - b, [&](int64_t j) { return b + j; }, by_key);
  };
  {
    py::gil_scoped_release release;
    // a multi-value map's hot keys: their copies appended in runs, as insert_impl (Zipf(1.3) keys, 2M
    // rows grown into in 8 inserts, with grow-ahead's single rehash each time: 770-970 -> 310-340 ms)
    HotKeys<K> hot;
    hot.detect(nslots, [&](int64_t x) { return s.slots[x].key; });
    if (!hot.empty()) {
      std::vector<int64_t> placed(nt, 0), taken(nt, 0);
      const std::vector<int64_t> refused = append_with_runs(d, dst, used, limit, nslots, nt, hot,
                       [&](int64_t x) { return s.slots[x].key; },
                       [&](int64_t x) -> uint64_t {
                         if constexpr (Table<K, V>::kHasVal) return (uint64_t)s.slots[x].val;
                         else return 0;
                       },
                       [](int64_t) {},
                       [&](int tid, const K*, const int64_t* idx, int64_t m) {
                         move_slots(tid, m, [&](int64_t j) { return idx[j]; }, false);
                       },
                       placed, taken);
      for (int x = 0; x < nt; ++x) moved[x] += placed[x];
      for (int64_t r : refused) missed[0] += r;
    } else if (nt > 1 && has_hot_key<K>(nslots, [&](int64_t x) { return s.slots[x].key; }))
      pk::parallel_threads(nt, [&](int tid) { move_range(tid, 0, nslots, true); });
    else
      dyn_ranges(nslots, nt, [&](int tid, int64_t b, int64_t e) { move_range(tid, b, e, false); });
  }
  int64_t a = 0, b = 0;
  for (int i = 0; i < nt; ++i) { a += moved[i]; b += missed[i]; }
  if (b) pk::fail_runtime("hash.rehash", "destination table too small (internal error)");
  return a;
}

// Windows (cache lines on the CPU) a find visits per key: the layout's DRAM accesses per lookup,
// reported by the benchmarks next to the measured rate.
template <class K, class V>
int64_t probe_windows_impl(const Geo& g, uintptr_t keys_p, int64_t n) {
  Table<K, V> t(g);
  const K* keys = reinterpret_cast<const K*>(keys_p);
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    const K k = keys[i];
    if (is_special(k)) continue;
    Probe p = probe_start((uint64_t)k, g.seed, g.nw);
    for (uint64_t w = 0; w < t.nw; ++w) {
      ++total;
      auto* win = t.window(p.w);
      bool stop = false;
      for (int j = 0; j < t.W && !stop; ++j) stop = win[j].key == k || win[j].key == Table<K, V>::EMPTY;
      if (stop || !t.overflowed(p.w, p.tag)) break;
      probe_next(p, t.nw);
    }
  }
  return total;
}

// ------------------------------------------------------------------------------------------------
// Bloom filter
// ------------------------------------------------------------------------------------------------
// Each thread owns a contiguous range of blocks and adds only the keys whose block lies there, with
// plain read-modify-writes: no two threads ever write one block, so no atomics are needed (a
// lock-prefixed OR per bit made an add cost ~80 ns a key on one thread even with the filter in L2,
// 10x a lookup). Every thread reads (and hashes) all the keys to find its own; the blocks of the
// next kAhead keys it owns are prefetched for writing. The filter's bits do not depend on the order
// or the threads.
void bloom_add(uintptr_t words_p, uint64_t nblocks, int k, uint64_t seed, uintptr_t keys_p, int64_t n, int nthreads) {
  uint64_t* words = reinterpret_cast<uint64_t*>(words_p);
  const uint64_t* keys = reinterpret_cast<const uint64_t*>(keys_p);
  py::gil_scoped_release release;
  const int nt = threads_for(n, nthreads);
  auto run = [&](int tid) {
    const uint64_t lo = nblocks * (uint64_t)tid / nt, hi = nblocks * (uint64_t)(tid + 1) / nt;
    pk::with_small_int<3, 8>(k, [&](auto kc) {
      constexpr int KC = decltype(kc)::value;
      constexpr int kAhead = 16;
      uint64_t ring_key[kAhead], ring_blk[kAhead];
      int head = 0, held = 0;
      auto apply = [&]() {
        uint64_t* blk = words + ring_blk[head] * BLOOM_BLOCK_WORDS;
        bloom_positions<KC>(ring_key[head], seed, k, [&](unsigned pos) { blk[pos >> 6] |= 1ULL << (pos & 63); });
        head = (head + 1) % kAhead;
        --held;
      };
      for (int64_t i = 0; i < n; ++i) {
        const uint64_t b = bloom_block(keys[i], seed, nblocks);
        if (b < lo || b >= hi) continue;
        if (held == kAhead) apply();
        const int slot = (head + held) % kAhead;
        ring_key[slot] = keys[i];
        ring_blk[slot] = b;
        ++held;
        PK_PREFETCH_W(words + b * BLOOM_BLOCK_WORDS);
      }
      while (held) apply();
    });
  };
  if (nt <= 1) run(0);
  else pk::parallel_threads(nt, run);
}

// Whether every one of the key's k bits is set in its block, tested one by one in the block's line
// (building the 8-word mask first -- zeroing it, k read-modify-writes of a stack array, 8 compares --
// took 1.5x the time per lookup here). KC > 0: k known at compile time.
template <int KC>
inline bool bloom_test(const uint64_t* blk, uint64_t key_bits, uint64_t seed, int k_run) {
  uint64_t all = 1;
  bloom_positions<KC>(key_bits, seed, k_run, [&](unsigned pos) { all &= load_relaxed(&blk[pos >> 6]) >> (pos & 63); });
  return all & 1;
}

// The smallest of the m HyperLogLog registers: no rank at or below it can raise one, so hll_x8 updates
// registers only for lanes above it, read again per block of keys (registers only grow: an old floor is
// still a safe one).
inline long long hll_floor(const uint8_t* regs, int m) {
  uint8_t lo = 255;
  for (int j = 0; j < m; ++j) lo = regs[j] < lo ? regs[j] : lo;
  return lo;
}

#if PK_X86
// Eight lookups per AVX-512 step: the scalar test above is instruction-bound (~15 ns a lookup even with
// a 20 KiB filter in L1: two fmix64 and k shift/load/shift/and chains), so the same arithmetic runs on
// eight keys at once: fmix64 and the block index with vpmullq, and each of the k bit
// positions tested through one vpgatherqq of the eight keys' words. Same positions, same answers as
// bloom_test (hash_layout.h bloom_positions, mirrored here lane-wise). Blocks are hashed kAhead groups
// ahead and prefetched. Handles [b, b + 8 * floor((e - b) / 8)); returns where it stopped.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,bmi,bmi2,popcnt")
// GCC 12 warns of an uninitialized operand inside its AVX-512 intrinsics (their _mm512_undefined
// pass-through operand) once inlined here: a false positive.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
inline __m512i shr64(__m512i x, int c) { return _mm512_srlv_epi64(x, _mm512_set1_epi64(c)); }

inline __m512i fmix64_x8(__m512i k) {
  k = _mm512_xor_si512(k, shr64(k, 33));
  k = _mm512_mullo_epi64(k, _mm512_set1_epi64((long long)0xff51afd7ed558ccdULL));
  k = _mm512_xor_si512(k, shr64(k, 33));
  k = _mm512_mullo_epi64(k, _mm512_set1_epi64((long long)0xc4ceb9fe1a85ec53ULL));
  return _mm512_xor_si512(k, shr64(k, 33));
}

template <int KC>
int64_t bloom_contains_x8(const uint64_t* words, uint64_t nblocks, int k_run, uint64_t seed,
                          const uint64_t* keys, int64_t b, int64_t e, uint8_t* out) {
  const int k = KC > 0 ? KC : k_run;
  constexpr int kAhead = 4;  // groups of 8 keys whose blocks are in flight
  const int64_t groups = (e - b) / 8;
  const __m512i seed_v = _mm512_set1_epi64((long long)seed);
  const __m512i nblk_v = _mm512_set1_epi64((long long)nblocks);
  const __m512i golden = _mm512_set1_epi64((long long)0x9e3779b97f4a7c15ULL);
  const __m512i one = _mm512_set1_epi64(1), low9 = _mm512_set1_epi64(511), low6 = _mm512_set1_epi64(63);
  // first word of each key's block, for the 8 keys of group g: (h >> 32) * nblocks >> 32, exact in
  // 64 bits (both factors < 2^32), times the 8 words of a block
  alignas(64) uint64_t ring[kAhead + 1][8];
  auto block_words = [&](int64_t g) {
    const __m512i kv = _mm512_loadu_si512(keys + b + 8 * g);
    const __m512i h = fmix64_x8(_mm512_xor_si512(kv, seed_v));
    const __m512i blk = shr64(_mm512_mullo_epi64(shr64(h, 32), nblk_v), 32);
    _mm512_store_si512(ring[g % (kAhead + 1)], _mm512_sllv_epi64(blk, _mm512_set1_epi64(3)));
  };
  for (int64_t g = 0; g < std::min<int64_t>(groups, kAhead); ++g) {
    block_words(g);
    for (int j = 0; j < 8; ++j) PK_PREFETCH_R(words + ring[g % (kAhead + 1)][j]);
  }
  for (int64_t g = 0; g < groups; ++g) {
    const bool ahead = g + kAhead < groups;
    const uint64_t* next = ring[(g + kAhead) % (kAhead + 1)];
    if (ahead) block_words(g + kAhead);
    const __m512i bw = _mm512_load_si512(ring[g % (kAhead + 1)]);
    const __m512i kv = _mm512_loadu_si512(keys + b + 8 * g);
    __m512i h = fmix64_x8(_mm512_xor_si512(_mm512_xor_si512(kv, seed_v), golden));
    __m512i all = one;
    int pf = 0;  // the ahead group's 8 lines, prefetched between the gathers (a burst of 8 stalled)
    for (int i = 0, used = 0; i < k; ++i, ++used) {
      if (used == 7) {
        h = fmix64_x8(_mm512_add_epi64(h, golden));
        used = 0;
      }
      if (ahead && pf < 8) PK_PREFETCH_R(words + next[pf++]);
      const __m512i pos = _mm512_and_si512(shr64(h, 9 * used), low9);
      const __m512i w = _mm512_i64gather_epi64(_mm512_add_epi64(bw, shr64(pos, 6)), words, 8);
      all = _mm512_and_si512(all, _mm512_srlv_epi64(w, _mm512_and_si512(pos, low6)));
    }
    while (ahead && pf < 8) PK_PREFETCH_R(words + next[pf++]);
    const uint64_t bytes = _pdep_u64(_mm512_test_epi64_mask(all, one), 0x0101010101010101ULL);
    std::memcpy(out + b + 8 * g, &bytes, 8);
  }
  return b + 8 * groups;
}

// HyperLogLog (distinct_estimate) on eight keys per step: fmix64 with vpmullq and the ranks (hll_rank)
// with vplzcntq of the isolated lowest bit. Only the lanes whose rank passes the registers' floor
// (hll_floor) can raise a register: a rank r comes with probability 2^-r, so once every register holds a
// few, about one lane in 32 does. Those lanes' (register, rank) pairs are compressed (vpcompressq) into a
// block's buffer without a branch, and the scalar register updates run over the buffer after the block.
// Measured (4M int64 keys, 1M distinct, 1 thread): a scalar update of every lane 4.9 ms; a branch on
// "any lane above the floor" 4.5 ms (it mispredicted on a quarter of the steps, each waiting on the
// whole hash); this 2.4 ms (2 threads: 2.65 -> 1.27 ms; the same estimates). The AVX2 tier (hll_x4_avx2)
// has no compress: the branch made it slower there (4.9 -> 6.9 ms), so it updates every lane. KT: the
// keys' type (4-byte keys are widened). Handles [b, b + 8 * floor((e - b) / 8)); returns where it stopped.
// (vplzcntq is AVX-512 CD: the loop is compiled for it, so the count is inlined; a separate function
// for it was called per step, its argument passed through memory)
template <class KT, int P>
__attribute__((target("avx512f,avx512cd,avx512bw,avx512dq,avx512vl,avx2,bmi,bmi2,popcnt")))
int64_t hll_x8(const KT* keys, int64_t b, int64_t e, uint8_t* regs) {
  constexpr int kBlock = 1024;  // keys per buffer fill: 8 KiB of pairs at most, in L1 with the registers
  const __m512i salt = _mm512_set1_epi64((long long)0x9E3779B97F4A7C15ULL);
  const __m512i low32 = _mm512_set1_epi64(0xffffffffLL), top = _mm512_set1_epi64(0x80000000LL);
  alignas(64) uint64_t pairs[kBlock + 8];  // (register << 8) | rank; + 8: each step stores a whole vector
  int64_t i = b;
  while (i + 8 <= e) {
    const __m512i floor8 = _mm512_set1_epi64(hll_floor(regs, 1 << P));
    const int64_t block_end = i + kBlock < e ? i + kBlock : e;
    int np = 0;
    for (; i + 8 <= block_end; i += 8) {
      __m512i kv;
      if constexpr (sizeof(KT) == 8) kv = _mm512_loadu_si512(keys + i);
      else kv = _mm512_cvtepu32_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(keys + i)));
      const __m512i h = fmix64_x8(_mm512_add_epi64(kv, salt));
      const __m512i low = _mm512_or_si512(_mm512_and_si512(h, low32), top);
      const __m512i lowest = _mm512_and_si512(low, _mm512_sub_epi64(_mm512_setzero_si512(), low));  // 2^ctz
      const __m512i rank = _mm512_sub_epi64(_mm512_set1_epi64(64), _mm512_lzcnt_epi64(lowest));
      const __mmask8 above = _mm512_cmpgt_epu64_mask(rank, floor8);
      const __m512i pair = _mm512_or_si512(_mm512_slli_epi64(shr64(h, 64 - P), 8), rank);
      _mm512_storeu_si512(pairs + np, _mm512_maskz_compress_epi64(above, pair));
      np += __builtin_popcount(above);
    }
    for (int x = 0; x < np; ++x) {
      const uint8_t r = (uint8_t)pairs[x];
      uint8_t& m = regs[pairs[x] >> 8];
      m = r > m ? r : m;
    }
  }
  return i;
}
#pragma GCC diagnostic pop
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,bmi,bmi2,popcnt")
// 64-bit lanes times a constant, the low 64 bits (AVX2 has no vpmullq): lo*c_lo + ((hi*c_lo + lo*c_hi) << 32).
inline __m256i mul64_const_x4(__m256i x, uint64_t c) {
  const __m256i cl = _mm256_set1_epi64x((long long)(c & 0xffffffffULL)), ch = _mm256_set1_epi64x((long long)(c >> 32));
  const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(x, 32), cl), _mm256_mul_epu32(x, ch));
  return _mm256_add_epi64(_mm256_mul_epu32(x, cl), _mm256_slli_epi64(cross, 32));
}

// hll_x8 on AVX2, four keys per step: fmix64 with the multiplies built from vpmuludq, the rank (hll_rank)
// from the exponent of the isolated lowest bit converted to float (a power of two converts exactly;
// 2^31 reads as -2^31, whose exponent field is the same). Measured (4M int64 keys, 2 threads, Zen 2):
// 6.9 -> 4.3 ms. Handles [b, b + 4 * floor((e - b) / 4)); returns where it stopped.
template <class KT, int P>
int64_t hll_x4_avx2(const KT* keys, int64_t b, int64_t e, uint8_t* regs) {
  const __m256i salt = _mm256_set1_epi64x((long long)0x9E3779B97F4A7C15ULL);
  const __m256i top = _mm256_set1_epi64x(0x80000000LL), byte = _mm256_set1_epi64x(0xff);
  alignas(32) uint64_t j4[4], r4[4];
  int64_t i = b;
  for (; i + 4 <= e; i += 4) {
    __m256i k;
    if constexpr (sizeof(KT) == 8) k = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(keys + i));
    else k = _mm256_cvtepu32_epi64(_mm_loadu_si128(reinterpret_cast<const __m128i*>(keys + i)));
    k = _mm256_add_epi64(k, salt);
    k = _mm256_xor_si256(k, _mm256_srli_epi64(k, 33));
    k = mul64_const_x4(k, 0xff51afd7ed558ccdULL);
    k = _mm256_xor_si256(k, _mm256_srli_epi64(k, 33));
    k = mul64_const_x4(k, 0xc4ceb9fe1a85ec53ULL);
    const __m256i h = _mm256_xor_si256(k, _mm256_srli_epi64(k, 33));
    _mm256_store_si256(reinterpret_cast<__m256i*>(j4), _mm256_srli_epi64(h, 64 - P));
    // the low dword of each lane: its lowest set bit (bit 31 set: never 0) as a float's exponent field
    const __m256i x = _mm256_or_si256(h, top);
    const __m256i lowest = _mm256_and_si256(x, _mm256_sub_epi32(_mm256_setzero_si256(), x));
    const __m256i expo = _mm256_srli_epi32(_mm256_castps_si256(_mm256_cvtepi32_ps(lowest)), 23);
    _mm256_store_si256(reinterpret_cast<__m256i*>(r4), _mm256_sub_epi64(_mm256_and_si256(expo, byte),
                                                                        _mm256_set1_epi64x(126)));
    for (int q = 0; q < 4; ++q) {
      const uint8_t r = (uint8_t)r4[q];
      uint8_t& m = regs[j4[q]];
      m = r > m ? r : m;
    }
  }
  return i;
}

inline __m256i fmix64_x4(__m256i k) {
  k = _mm256_xor_si256(k, _mm256_srli_epi64(k, 33));
  k = mul64_const_x4(k, 0xff51afd7ed558ccdULL);
  k = _mm256_xor_si256(k, _mm256_srli_epi64(k, 33));
  k = mul64_const_x4(k, 0xc4ceb9fe1a85ec53ULL);
  return _mm256_xor_si256(k, _mm256_srli_epi64(k, 33));
}

// bloom_contains_x8 on AVX2, four lookups per step: fmix64 through mul64_const_x4, the block index with
// one vpmuludq (both factors < 2^32), each bit position's words through one vpgatherqq of the four keys.
// The scalar test spent ~35 cycles a lookup on its two fmix64 and k dependent shift/load/shift chains
// (4M keys in a 5 MiB filter, 2 threads, Zen 3: 21.5 ms, slower than an exact HashSet's DRAM lookups at
// 20 ms); this loop: 14.8 ms, the same with 4 to 16 groups in flight (compute-bound: the emulated 64-bit
// multiplies and the gathers). Same positions, same answers as bloom_test. Handles [b, b + 4 * floor((e - b) / 4)); returns where it
// stopped.
template <int KC>
int64_t bloom_contains_x4_avx2(const uint64_t* words, uint64_t nblocks, int k_run, uint64_t seed,
                               const uint64_t* keys, int64_t b, int64_t e, uint8_t* out) {
  const int k = KC > 0 ? KC : k_run;
  constexpr int kAhead = 8;  // groups of 4 keys whose blocks are in flight
  const int64_t groups = (e - b) / 4;
  const __m256i seed_v = _mm256_set1_epi64x((long long)seed);
  const __m256i nblk_v = _mm256_set1_epi64x((long long)nblocks);
  const __m256i golden = _mm256_set1_epi64x((long long)0x9e3779b97f4a7c15ULL);
  const __m256i one = _mm256_set1_epi64x(1), low9 = _mm256_set1_epi64x(511), low6 = _mm256_set1_epi64x(63);
  alignas(32) uint64_t ring[kAhead + 1][4];  // first word of each key's block, for the 4 keys of a group
  auto block_words = [&](int64_t g) __attribute__((always_inline)) {
    const __m256i kv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(keys + b + 4 * g));
    const __m256i h = fmix64_x4(_mm256_xor_si256(kv, seed_v));
    const __m256i blk = _mm256_srli_epi64(_mm256_mul_epu32(_mm256_srli_epi64(h, 32), nblk_v), 32);
    _mm256_store_si256(reinterpret_cast<__m256i*>(ring[g % (kAhead + 1)]), _mm256_slli_epi64(blk, 3));
  };
  for (int64_t g = 0; g < std::min<int64_t>(groups, kAhead); ++g) {
    block_words(g);
    for (int j = 0; j < 4; ++j) PK_PREFETCH_R(words + ring[g % (kAhead + 1)][j]);
  }
  for (int64_t g = 0; g < groups; ++g) {
    const bool ahead = g + kAhead < groups;
    if (ahead) {
      block_words(g + kAhead);
      const uint64_t* next = ring[(g + kAhead) % (kAhead + 1)];
      for (int j = 0; j < 4; ++j) PK_PREFETCH_R(words + next[j]);
    }
    const __m256i bw = _mm256_load_si256(reinterpret_cast<const __m256i*>(ring[g % (kAhead + 1)]));
    const __m256i kv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(keys + b + 4 * g));
    __m256i h = fmix64_x4(_mm256_xor_si256(_mm256_xor_si256(kv, seed_v), golden));
    __m256i all = one;
    for (int i = 0, used = 0; i < k; ++i, ++used) {
      if (used == 7) {
        h = fmix64_x4(_mm256_add_epi64(h, golden));
        used = 0;
      }
      const __m256i pos = _mm256_and_si256(_mm256_srl_epi64(h, _mm_cvtsi32_si128(9 * used)), low9);
      const __m256i w = _mm256_i64gather_epi64(reinterpret_cast<const long long*>(words),
                                               _mm256_add_epi64(bw, _mm256_srli_epi64(pos, 6)), 8);
      all = _mm256_and_si256(all, _mm256_srlv_epi64(w, _mm256_and_si256(pos, low6)));
    }
    // bit 0 of each lane to bit 63, the four sign bits to one byte per key
    const unsigned bits = (unsigned)_mm256_movemask_pd(_mm256_castsi256_pd(_mm256_slli_epi64(all, 63)));
    const uint32_t bytes = (uint32_t)_pdep_u32(bits, 0x01010101u);
    std::memcpy(out + b + 4 * g, &bytes, 4);
  }
  return b + 4 * groups;
}
#pragma GCC pop_options
#endif

void bloom_contains(uintptr_t words_p, uint64_t nblocks, int k, uint64_t seed, uintptr_t keys_p, int64_t n,
                    uintptr_t out_p, int nthreads) {
  const uint64_t* words = reinterpret_cast<const uint64_t*>(words_p);
  const uint64_t* keys = reinterpret_cast<const uint64_t*>(keys_p);
  uint8_t* out = reinterpret_cast<uint8_t*>(out_p);
  py::gil_scoped_release release;
  dyn_ranges(n, threads_for(n, nthreads), [&](int, int64_t b, int64_t e) {
    pk::with_small_int<3, 8>(k, [&](auto kc) {
      constexpr int KC = decltype(kc)::value;
#if PK_X86
      if (pk::cpu_has_avx512()) b = bloom_contains_x8<KC>(words, nblocks, k, seed, keys, b, e, out);
      else if (pk::cpu_has_avx2()) b = bloom_contains_x4_avx2<KC>(words, nblocks, k, seed, keys, b, e, out);
#endif
      // each key's block is hashed once, D keys ahead, and kept in a ring until its lookup
      constexpr int D = 16, R = 32;
      uint64_t ring[R];
      const int64_t head = std::min<int64_t>(e, b + D);
      for (int64_t j = b; j < head; ++j) {
        ring[j & (R - 1)] = bloom_block(keys[j], seed, nblocks);
        PK_PREFETCH_R(words + ring[j & (R - 1)] * BLOOM_BLOCK_WORDS);
      }
      for (int64_t i = b; i < e; ++i) {
        if (i + D < e) {
          ring[(i + D) & (R - 1)] = bloom_block(keys[i + D], seed, nblocks);
          PK_PREFETCH_R(words + ring[(i + D) & (R - 1)] * BLOOM_BLOCK_WORDS);
        }
        out[i] = bloom_test<KC>(words + ring[i & (R - 1)] * BLOOM_BLOCK_WORDS, keys[i], seed, k);
      }
    });
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
  // Window masks are 32-bit (window_masks in hash_cpu_probe.h): the Python layer never asks for more.
  if (W < 1 || W > 32) pk::fail_value(op, "window size must be in 1..32");
  return Geo{slots, special, nw, W, seed};
}

int slot_bytes(int kb, int vb) {
  return by_layout("hash.slot_bytes", kb, vb, [](auto k, auto v) { return (int)sizeof(Slot<decltype(k), decltype(v)>); });
}

// Tables from this size up are cleared with streaming stores (init_slots): larger than the caches,
// so a plain store would first fetch every line it overwrites.
constexpr int64_t kStreamClearBytes = int64_t(8) << 20;

// Fresh/cleared storage: keys EMPTY (all ones), values 0 (counting tables add into a fresh slot).
void init_slots(uintptr_t slots_p, int64_t nslots, int kb, int vb, int nthreads) {
  py::gil_scoped_release release;
  by_layout("hash.clear", kb, vb, [&](auto k, auto v) {
    using S = Slot<decltype(k), decltype(v)>;
    S* slots = reinterpret_cast<S*>(slots_p);
    S proto;
    std::memset(&proto, 0, sizeof(S));
    proto.key = Sentinel<decltype(k)>::EMPTY;
    static_assert(16 % sizeof(S) == 0, "a 16-byte store holds whole slots");
    const bool stream = nslots * (int64_t)sizeof(S) >= kStreamClearBytes;
    const int nt = nslots * (int64_t)sizeof(S) < kParallelScanBytes ? 1 : threads_for(nslots, nthreads);
    dyn_ranges(nslots, nt, [&](int, int64_t b, int64_t e) {
#if PK_X86
      if (stream) {
        // 16 bytes (whole slots) a store; the range's unaligned head and any tail slot by slot
        constexpr int64_t per16 = 16 / (int64_t)sizeof(S);
        int64_t i = b;
        for (; i < e && (reinterpret_cast<uintptr_t>(slots + i) & 15); ++i) slots[i] = proto;
        alignas(16) S pat[per16];
        for (int64_t j = 0; j < per16; ++j) pat[j] = proto;
        const __m128i v = _mm_load_si128(reinterpret_cast<const __m128i*>(pat));
        for (; i + per16 <= e; i += per16) _mm_stream_si128(reinterpret_cast<__m128i*>(slots + i), v);
        for (; i < e; ++i) slots[i] = proto;
        _mm_sfence();
        return;
      }
#endif
      for (int64_t i = b; i < e; ++i) slots[i] = proto;
    });
    return 0;
  });
}

// How many of the n keys (kb bytes each) are the reserved EMPTY or TOMBSTONE patterns: one read of the
// keys, where the Python side's two `(keys == bits).any()` made two boolean tensors first (a multi-value
// insert stores those keys' values out of band before the native insert; 2M keys: 5-8 -> ~2 ms).
int64_t reserved_count(uintptr_t keys_p, int64_t n, int kb, int nthreads) {
  const int nt = threads_for(n, nthreads);
  std::vector<int64_t> found(nt, 0);
  py::gil_scoped_release release;
  auto run = [&](int tid, int64_t b, int64_t e, auto key_type) {
    using KT = decltype(key_type);
    const KT* keys = reinterpret_cast<const KT*>(keys_p);
    int64_t c = 0;
    for (int64_t i = b; i < e; ++i) c += is_special(keys[i]);
    found[tid] += c;
  };
  dyn_ranges(n, nt, [&](int tid, int64_t b, int64_t e) {
    if (kb == 8) run(tid, b, e, uint64_t());
    else run(tid, b, e, uint32_t());
  });
  int64_t total = 0;
  for (int64_t c : found) total += c;
  return total;
}

// Among `count` keys of the n (kb bytes each; the reserved patterns left out), one from each of `count`
// equal strides at a pseudo-random offset in it (sample_position): how many distinct values, and how
// many of those were met once. A large sample with no key met once says the keys it missed make up
// little of the input (Good-Turing: the unseen share of the rows is about singletons / count; with
// none, under 3 / count at 95%, the rule of three): _grow_ahead then sizes a bulk insert of a few
// categories by the sample and skips the HyperLogLog pass over every key (4M rows of 64 categories: ~7
// of the add's ~14 ms on a Zen 2). The offsets: evenly spaced samples of tiled keys (arange(2^20)
// repeated 16 times, stride 1024) met 1024 values 16 times each, so 1M distinct keys were taken for a
// few categories and the small table they filled refused the rest, each refusal a walk (16 s instead
// of 0.6; review finding).
inline int64_t sample_position(int64_t j, int64_t n, int64_t count) {
  const int64_t lo = (int64_t)((uint64_t)j * (uint64_t)n / (uint64_t)count);
  const int64_t hi = (int64_t)((uint64_t)(j + 1) * (uint64_t)n / (uint64_t)count);
  return lo + (int64_t)(fmix64((uint64_t)j ^ 0x5851F42D4C957F2DULL) % (uint64_t)(hi - lo));
}

py::tuple sample_distinct(uintptr_t keys_p, int64_t n, int kb, int count) {
  int64_t distinct = 0, once = 0;
  auto run = [&](auto key_type) {
    using KT = decltype(key_type);
    const KT* keys = reinterpret_cast<const KT*>(keys_p);
    SampleCounter<KT> c(count);
    for (int64_t j = 0; j < count; ++j) {
      const KT k = keys[sample_position(j, n, count)];
      if (!is_special(k)) c.add(k);
    }
    c.each([&](KT, uint32_t t) {
      ++distinct;
      once += t == 1;
    });
  };
  {
    py::gil_scoped_release release;
    if (kb == 8) run(uint64_t());
    else run(uint32_t());
  }
  return py::make_tuple(distinct, once);
}

// A key's HyperLogLog rank from its hash h (the register index is h's top kP bits): 1 + the trailing
// zeros of h's low 32 bits, at most 32 (bit 31 set), which bounds the estimate far past any table's size.
// The vector tiers compute the same value (hll_x8, hll_x4_avx2: the lowest set bit isolated).
inline uint8_t hll_rank(uint64_t h) { return (uint8_t)(__builtin_ctz((uint32_t)h | 0x80000000u) + 1); }

// How many distinct values the n keys (kb bytes each) hold, estimated with HyperLogLog (Flajolet et al.
// 2007; 2^12 one-byte registers: ~1.6% standard error, linear counting below 2.5 x 4096). A bulk insert
// that may overflow the table sizes its growth by this rather than by n (_tables.py _grow_ahead): a
// counting table sized for its distinct keys, given 16x as many keys, grew to hold all of them and
// shrank back (4M keys, 4096 distinct: 45 ms of which one 112 MiB table). Per-thread registers, merged
// by max.
#if PK_X86
inline bool has_avx512cd() {
  static const bool has = [] { __builtin_cpu_init(); return (bool)__builtin_cpu_supports("avx512cd"); }();
  return has;
}
#endif
double distinct_estimate(uintptr_t keys_p, int64_t n, int kb, int nthreads) {
  constexpr int kP = 12, kM = 1 << kP;
  const int nt = threads_for(n, nthreads);
  std::vector<std::vector<uint8_t>> regs(nt, std::vector<uint8_t>(kM, 0));
  {
    py::gil_scoped_release release;
    auto run = [&](int tid, int64_t b, int64_t e, auto key_type) {
      using KT = decltype(key_type);
      const KT* keys = reinterpret_cast<const KT*>(keys_p);
      uint8_t* r = regs[tid].data();
#if PK_X86
      if (pk::cpu_has_avx512() && has_avx512cd()) b = hll_x8<KT, kP>(keys, b, e, r);
      else if (pk::cpu_has_avx2()) b = hll_x4_avx2<KT, kP>(keys, b, e, r);
#endif
      for (int64_t i = b; i < e; ++i) {
        const uint64_t h = fmix64((uint64_t)keys[i] + 0x9E3779B97F4A7C15ULL);
        const uint32_t j = (uint32_t)(h >> (64 - kP));
        const uint8_t rank = hll_rank(h);
        if (rank > r[j]) r[j] = rank;
      }
    };
    dyn_ranges(n, nt, [&](int tid, int64_t b, int64_t e) {
      if (kb == 8) run(tid, b, e, uint64_t());
      else run(tid, b, e, uint32_t());
    });
  }
  double sum = 0;
  int zeros = 0;
  for (int j = 0; j < kM; ++j) {
    uint8_t m = 0;
    for (int x = 0; x < nt; ++x) m = std::max(m, regs[x][j]);
    sum += std::ldexp(1.0, -(int)m);
    zeros += m == 0;
  }
  const double est = (0.7213 / (1.0 + 1.079 / kM)) * kM * (double)kM / sum;
  if (est <= 2.5 * kM && zeros) return kM * std::log((double)kM / zeros);
  return est;
}

// The machine's random-access limit, for the benchmarks: read n random 64-byte lines of a buffer
// (xorshift addresses, D lines prefetched ahead, the same memory-level parallelism a find can have).
// A find needs `lines/op` such reads, so rate(find) <= rate(this) / lines_per_op.
uint64_t random_lines(uintptr_t buf, int64_t nbytes, int64_t n, int D, int nthreads) {
  const int64_t nlines = nbytes / 64;
  const char* base = reinterpret_cast<const char*>(buf);
  std::vector<uint64_t> sums(std::max(1, nthreads), 0);
  py::gil_scoped_release release;
  dyn_ranges(n, std::max(1, nthreads), [&](int tid, int64_t b, int64_t e) {
    auto line = [&](uint64_t x) {
      x ^= x << 13; x ^= x >> 7; x ^= x << 17;
      return base + (int64_t)(((x >> 32) * (uint64_t)nlines) >> 32) * 64;
    };
    uint64_t acc = 0;
    for (int64_t i = b; i < e; ++i) {
      if (i + D < e) PK_PREFETCH_R(line((uint64_t)(i + D) * 0x9e3779b97f4a7c15ULL + 1));
      acc += *reinterpret_cast<const uint64_t*>(line((uint64_t)i * 0x9e3779b97f4a7c15ULL + 1));
    }
    sums[tid] += acc;
  });
  uint64_t t = 0;
  for (auto v : sums) t += v;
  return t;
}

}  // namespace

PYBIND11_MODULE(_cpu_hash, m) {
  pk::def_mark_forked(m);
  pk::def_native_errors("hashing");
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
  py::class_<MultiCollected>(m, "MultiCollected")
      .def_readonly("total", &MultiCollected::total)
      .def("copy_to", &MultiCollected::copy_to, py::arg("out"));
  m.def("multi_collect",
        [](uintptr_t slots, uintptr_t special, uint64_t nw, int W, uint64_t seed, int kb, int vb, uintptr_t keys,
           int64_t n, uintptr_t counts, int nthreads, int D) {
          Geo g = geo_of(slots, special, nw, W, seed, "hash.multi_collect");
          if (vb == 0) pk::fail_value("hash.multi_collect", "multi-value tables need values");
          MultiCollected out;
          by_layout("hash.multi_collect", kb, vb, [&](auto k, auto v) {
            if constexpr (!std::is_same<decltype(v), NoVal>::value)
              out = multi_collect_impl<decltype(k), decltype(v)>(g, keys, n, counts, nthreads, D);
            return 0;
          });
          return out;
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
        [](uintptr_t src, uint64_t src_nw, uintptr_t dst, uintptr_t dst_special, uint64_t dst_nw, int W, uint64_t seed,
           int kb, int vb, int nthreads, int D) {
          Geo s = geo_of(src, 0, src_nw, W, seed, "hash.rehash");
          Geo d = geo_of(dst, dst_special, dst_nw, W, seed, "hash.rehash");  // its overflow filter is set
          return by_layout("hash.rehash", kb, vb, [&](auto k, auto v) {
            return rehash_impl<decltype(k), decltype(v)>(s, d, nthreads, D);
          });
        });
  m.def("probe_windows",
        [](uintptr_t slots, uintptr_t special, uint64_t nw, int W, uint64_t seed, int kb, int vb, uintptr_t keys,
           int64_t n) {
          Geo g = geo_of(slots, special, nw, W, seed, "hash.probe_windows");
          return by_layout("hash.probe_windows", kb, vb, [&](auto k, auto v) {
            return probe_windows_impl<decltype(k), decltype(v)>(g, keys, n);
          });
        }, "Total windows visited by finds of these keys (single thread; for the benchmarks)");
  m.def("init_slots", &init_slots, py::arg("slots"), py::arg("nslots"), py::arg("kb"), py::arg("vb"),
        py::arg("nthreads"));
  m.def("reserved_count", [](uintptr_t keys, int64_t n, int kb, int nthreads) {
          if (kb != 4 && kb != 8) pk::fail_value("hash.reserved_count", "expected 4- or 8-byte keys");
          return reserved_count(keys, n, kb, nthreads);
        }, py::arg("keys"), py::arg("n"), py::arg("kb"), py::arg("nthreads"));
  m.def("distinct_estimate", [](uintptr_t keys, int64_t n, int kb, int nthreads) {
          if (kb != 4 && kb != 8) pk::fail_value("hash.distinct_estimate", "expected 4- or 8-byte keys");
          return distinct_estimate(keys, n, kb, nthreads);
        }, py::arg("keys"), py::arg("n"), py::arg("kb"), py::arg("nthreads"));
  m.def("sample_distinct", [](uintptr_t keys, int64_t n, int kb, int count) {
          if (kb != 4 && kb != 8) pk::fail_value("hash.sample_distinct", "expected 4- or 8-byte keys");
          if (count < 1 || count > n) pk::fail_value("hash.sample_distinct", "expected 1 <= count <= n");
          return sample_distinct(keys, n, kb, count);
        }, py::arg("keys"), py::arg("n"), py::arg("kb"), py::arg("count"),
        "(distinct values, values met once) among count keys, one from each of count strides");
  m.def("random_lines", &random_lines, py::arg("buf"), py::arg("nbytes"), py::arg("n"), py::arg("prefetch"),
        py::arg("nthreads"), "Reads n random 64-byte lines of buf (the random-access limit probe)");
  m.def("bloom_add", &bloom_add);
  m.def("bloom_contains", &bloom_contains);
}
