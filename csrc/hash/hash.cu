// pykernels._cuda_hash: WarpCore-style hash tables on NVIDIA (nvcc) and AMD (hipcc) GPUs.
//
// Juenger, Kobus, Mueller, Hundt, Xu, Liu, Schmidt: "WarpCore: A Library for fast Hash Tables on
// GPUs" (HiPC 2020). A cooperative probing group of G lanes (G = the table's window W: 1..32; a
// 64-lane AMD wavefront holds 64/G groups) handles one key at a time: lane r loads slot r of the
// current window (one coalesced load for the group), a ballot over the group finds a matching key,
// an EMPTY slot or a TOMBSTONE, and the next window comes from double hashing (hash_layout.h, shared
// with the CPU module and the numba device functions, so every backend probes the same places).
//
// Inserts claim the first free slot in probe order with a CAS, after making sure the key is not
// present further on (a probe stops at the first EMPTY). A 4-byte key with a 4-byte value is one
// 64-bit word: one 64-bit CAS claims key and value together. Wider pairs CAS the key, then store the
// value (other inserters of the same key in the same launch may overwrite it: one of the values wins,
// as the API allows). Counting tables atomically add to the value.
//
// Group control flow depends only on ballot results, so the lanes of a group stay converged; ballots
// and shuffles name only the group's lanes (CUDA: __ballot_sync(group_mask); HIP: the wavefront
// ballot masked to the group), so groups of one warp may follow different paths.
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "pk_gpu.h"  // first: hip_runtime.h defines __host__/__device__ for hash_layout.h
#include "hash_layout.h"

using namespace pkhash;

namespace {


enum : uint8_t { ST_EXISTED = 0, ST_NEW = 1, ST_PENDING = 2, ST_SKIPPED = 3 };
enum : int { M_UPSERT = 0, M_ADD = 1, M_APPEND = 2 };
// counters[]: 0 used slots, 1 new keys, 2 new keys that took an EMPTY slot, 3 pending keys
constexpr int C_USED = 0, C_NEW = 1, C_NEW_EMPTY = 2, C_PENDING = 3;

// A multiple of both warp sizes (32, 64). No __launch_bounds__: with it, ptxas (CUDA 13, sm_90) capped
// some instantiations at 32 registers and spilled; without it they use 30-40 and never spill.
constexpr int kBlock = 256;

// ---- group primitives ------------------------------------------------------------------------
template <int G>
struct Group {
  unsigned lane;        // lane within the warp
  unsigned rank;        // lane within the group
  unsigned base;        // first warp lane of the group
  pk_lane_mask_t mask;  // the group's lanes
  __device__ __forceinline__ Group() {
    lane = threadIdx.x % PK_WARP_SIZE;
    rank = lane % G;
    base = lane - rank;
    mask = (G == PK_WARP_SIZE) ? ~(pk_lane_mask_t)0 : ((((pk_lane_mask_t)1) << G) - 1) << base;
  }
  // bits of the group's lanes where p holds, shifted so bit r = group rank r
  __device__ __forceinline__ unsigned long long ballot(bool p) const {
#if PK_HIP
    return (unsigned long long)((__ballot(p) & mask) >> base);
#else
    return (unsigned long long)((__ballot_sync(mask, p) & mask) >> base);
#endif
  }
  template <class T>
  __device__ __forceinline__ T shfl(T v, unsigned src_rank) const {
#if PK_HIP
    return __shfl(v, (int)(base + src_rank));
#else
    return __shfl_sync(mask, v, (int)(base + src_rank));
#endif
  }
};

__device__ __forceinline__ int first_bit(unsigned long long m) { return __ffsll((long long)m) - 1; }

template <class T>
__device__ __forceinline__ T vload(const T* p) { return *(const volatile T*)p; }

__device__ __forceinline__ uint32_t cas_word(uint32_t* p, uint32_t e, uint32_t d) {
  return atomicCAS((unsigned int*)p, e, d);
}
__device__ __forceinline__ uint64_t cas_word(uint64_t* p, uint64_t e, uint64_t d) {
  return atomicCAS((unsigned long long*)p, (unsigned long long)e, (unsigned long long)d);
}
__device__ __forceinline__ void add_word(uint32_t* p, uint64_t v) { atomicAdd((unsigned int*)p, (unsigned int)v); }
__device__ __forceinline__ void add_word(uint64_t* p, uint64_t v) {
  atomicAdd((unsigned long long*)p, (unsigned long long)v);
}
__device__ __forceinline__ void store_word(uint32_t* p, uint64_t v) { *(volatile uint32_t*)p = (uint32_t)v; }
__device__ __forceinline__ void store_word(uint64_t* p, uint64_t v) { *(volatile uint64_t*)p = v; }

template <class V>
__device__ __forceinline__ uint64_t read_val(const void* vals, int64_t i, uint64_t dflt) {
  if constexpr (std::is_same<V, NoVal>::value) return dflt;
  else return vals ? (uint64_t)((const V*)vals)[i] : dflt;
}

// ---- the overflow filter (hash_layout.h): byte w of the words after special's head ------------
// Every lane of a group reads the same word; rank 0 marks. Lookups and inserts both decide by a ballot:
// another group's mark may land between two lanes' reads (a find overlapping an insert on a user stream
// or through the numba device functions), and a split group would then ballot with lanes missing.
__device__ __forceinline__ bool ovf_has(const unsigned long long* f, uint64_t w, uint32_t tag) {
  return (vload(&f[w >> 3]) >> ((w & 7) * 8)) & tag;
}
__device__ __forceinline__ void ovf_mark(unsigned long long* f, uint64_t w, uint32_t tag) {
  const unsigned long long bit = (unsigned long long)tag << ((w & 7) * 8);
  if (!(vload(&f[w >> 3]) & bit)) atomicOr(&f[w >> 3], bit);
}

// ---- the special (reserved key pattern) store --------------------------------------------------
template <class K, int Mode, bool HasVal>
__device__ __forceinline__ uint8_t insert_special(unsigned long long* special, K k, uint64_t v) {
  const int s = special_index(k);
  const bool fresh = atomicCAS(&special[2 * s], 0ull, 1ull) == 0ull;
  if (Mode == M_ADD) atomicAdd(&special[2 * s + 1], (unsigned long long)v);
  else if (HasVal) *(volatile unsigned long long*)&special[2 * s + 1] = v;
  return fresh ? ST_NEW : ST_EXISTED;
}

// ---- load-limit bookkeeping ------------------------------------------------------------------
// counters[C_USED] counts the table's non-EMPTY slots against `limit`. One atomicAdd on that word per
// claimed slot serialises every insert of a launch on one L2 address (2^26 keys took 75 ms on an
// H200, 0.9 G inserts/s, against 4 ms for the same finds), so each group reserves `chunk` slots at a
// time, spends them without atomics and hands back the rest when the kernel ends; the new-EMPTY count
// is summed per group too. Near the limit a chunk no longer fits and a group reserves single slots;
// a key refused then may only have met the other groups' unspent reservations, so the host launches
// once more over the refused keys with chunk 1, after every reservation has been handed back; with
// chunk 1 a reservation whose CAS lost goes straight back to the counter, so that pass is exact.
// limit < 0: no limit (a rehash into a table that holds every key by construction).
struct SlotBudget {  // lane 0 of a group uses it
  long long* counters;
  long long limit;
  int chunk;
  long long left = 0;       // reserved, not yet spent
  long long new_empty = 0;  // slots this group turned from EMPTY to a key
  __device__ bool take() {
    if (limit < 0) return true;
    if (left > 0) { --left; return true; }
    auto* used = (unsigned long long*)&counters[C_USED];
    if (chunk > 1) {
      if ((long long)atomicAdd(used, (unsigned long long)chunk) + chunk <= limit) { left = chunk - 1; return true; }
      atomicAdd(used, (unsigned long long)(-(long long)chunk));
    }
    if ((long long)atomicAdd(used, 1ull) + 1 <= limit) return true;
    atomicAdd(used, (unsigned long long)-1ll);
    return false;
  }
  __device__ bool exhausted() const {  // no EMPTY slot may be claimed any more (lane 0)
    return limit >= 0 && left == 0 && *(volatile long long*)&counters[C_USED] >= limit;
  }
  __device__ void untake() {  // the CAS lost: the reservation stays with the group (chunk 1: returned)
    if (limit < 0) return;
    if (chunk > 1) ++left;
    else atomicAdd((unsigned long long*)&counters[C_USED], (unsigned long long)-1ll);
  }
  __device__ void close() {             // at the end of the kernel
    if (left) atomicAdd((unsigned long long*)&counters[C_USED], (unsigned long long)(-left));
    if (new_empty) atomicAdd((unsigned long long*)&counters[C_NEW_EMPTY], (unsigned long long)new_empty);
  }
};

// ---- insert of one key by one group -----------------------------------------------------------
template <class K, class V, int G, int Mode>
__device__ __forceinline__ uint8_t group_insert(const Group<G> g, Slot<K, V>* slots, unsigned long long* ovf, uint64_t nw,
                                uint64_t seed, K k, uint64_t v, SlotBudget& budget) {
  using S = Slot<K, V>;
  constexpr bool kHasVal = !std::is_same<V, NoVal>::value;
  constexpr bool kPacked = kHasVal && sizeof(S) == 8;  // 4-byte key + 4-byte value: one 64-bit CAS
  const K EMPTY = Sentinel<K>::EMPTY, TOMB = Sentinel<K>::TOMB;
  const Probe p0 = probe_start((uint64_t)k, seed, nw);
  for (;;) {
    Probe p = p0;
    int64_t free_slot = -1;
    for (uint64_t t = 0; t < nw; ++t) {
      S* win = slots + p.w * G;
      const K sk = vload(&win[g.rank].key);
      const unsigned long long hit = (Mode == M_APPEND) ? 0ull : g.ballot(sk == k);
      if (hit) {
        if ((int)g.rank == first_bit(hit)) {
          if constexpr (kHasVal) {
            if (Mode == M_ADD) add_word((V*)&win[g.rank].val, v);
            else store_word((V*)&win[g.rank].val, v);
          }
        }
        return ST_EXISTED;
      }
      const unsigned long long empty = g.ballot(sk == EMPTY);
      const unsigned long long tomb = g.ballot(sk == TOMB);
      if (free_slot < 0 && (empty | tomb)) {
        free_slot = (int64_t)(p.w * G) + first_bit(empty | tomb);
        if (Mode == M_APPEND) break;  // duplicates allowed: the first free slot is the place
      }
      if (empty) break;  // the key cannot be beyond the first EMPTY
      if (free_slot < 0) {
        // No free slot so far and no EMPTY may be claimed: a key in no later window (any key, when
        // duplicates are allowed) is refused here, as on the CPU (hash_cpu.cpp, ins_step); walking on
        // for a tombstone read every window for every refused key of a full table at load 1.0. The
        // host then purges tombstones or grows. Lane 0 decides (its budget), the ballot tells the group.
        if (g.ballot(g.rank == 0 && budget.exhausted() && (Mode == M_APPEND || !ovf_has(ovf, p.w, p.tag))))
          return ST_PENDING;
        if (g.rank == 0) ovf_mark(ovf, p.w, p.tag);  // the key will live beyond this window
      } else if (!g.ballot(ovf_has(ovf, p.w, p.tag))) {
        break;  // nor is it beyond: take the free slot met
      }
      probe_next(p, nw);
    }
    if (free_slot < 0) return ST_PENDING;  // every slot holds a live key
    // The group's first lane claims the slot; the outcome is broadcast to the group.
    int outcome = 0;  // 0 lost the race (rescan), 1 new, 2 pending (load limit)
    if (g.rank == 0) {
      S* s = slots + free_slot;
      if constexpr (kPacked) {
        uint64_t* word = (uint64_t*)s;
        const uint64_t old = vload(word);
        const K ok = (K)(old & 0xffffffffull);
        if (ok == EMPTY || ok == TOMB) {
          const bool from_empty = ok == EMPTY;
          if (from_empty && !budget.take()) {
            outcome = 2;
          } else {
            const uint64_t desired = ((uint64_t)(uint32_t)v << 32) | (uint64_t)(uint32_t)k;
            if (cas_word(word, old, desired) == old) {
              outcome = 1;
              budget.new_empty += from_empty;
            } else if (from_empty) {
              budget.untake();
            }
          }
        }
      } else {
        const K ok = vload(&s->key);
        if (ok == EMPTY || ok == TOMB) {
          const bool from_empty = ok == EMPTY;
          if (from_empty && !budget.take()) {
            outcome = 2;
          } else {
            if (cas_word(&s->key, ok, k) == ok) {
              if constexpr (kHasVal) {
                if (Mode == M_ADD) add_word((V*)&s->val, v);
                else store_word((V*)&s->val, v);
              }
              outcome = 1;
              budget.new_empty += from_empty;
            } else if (from_empty) {
              budget.untake();
            }
          }
        }
      }
    }
    // broadcast with ballots (not a shuffle): keeps the group's reconvergence simple for ptxas,
    // which otherwise spilled a convergence-barrier register in some instantiations
    const unsigned long long won = g.ballot(outcome == 1), full = g.ballot(outcome == 2);
    if (won) return ST_NEW;
    if (full) return ST_PENDING;
  }
}

template <class K, class V, int G, int Mode>
__global__ void insert_kernel(Slot<K, V>* slots, unsigned long long* special, uint64_t nw,
                                                         uint64_t seed, const K* keys, const void* vals, int64_t n,
                                                         uint8_t* status, long long* counters, long long limit,
                                                         int chunk, bool only_pending) {
  const Group<G> g;
  const int64_t groups = (int64_t)gridDim.x * (kBlock / G);
  long long my_new = 0, my_pending = 0;
  SlotBudget budget{counters, limit, chunk};
  for (int64_t i = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / G; i < n; i += groups) {
    if (only_pending && status[i] != ST_PENDING) continue;  // the whole group reads the same byte
    const K k = keys[i];
    const uint64_t v = read_val<V>(vals, i, Mode == M_ADD ? 1 : 0);
    uint8_t st = ST_SKIPPED;  // only the group's first lane uses it
    if (is_special(k)) {
      if (Mode != M_APPEND && g.rank == 0)
        st = insert_special<K, Mode, !std::is_same<V, NoVal>::value>(special, k, v);
    } else {
      st = group_insert<K, V, G, Mode>(g, slots, special + SPECIAL_HEAD_WORDS, nw, seed, k, v, budget);
    }
    if (g.rank == 0) {
      status[i] = st;
      my_new += st == ST_NEW;
      my_pending += st == ST_PENDING;
    }
  }
  if (g.rank == 0) budget.close();
  if (g.rank == 0 && my_new) atomicAdd((unsigned long long*)&counters[C_NEW], (unsigned long long)my_new);
  if (g.rank == 0 && my_pending) atomicAdd((unsigned long long*)&counters[C_PENDING], (unsigned long long)my_pending);
}

// ---- find / erase / multi-value walks ---------------------------------------------------------
// Returns the slot index holding k, or -1.
template <class K, class V, int G>
__device__ __forceinline__ int64_t group_find(const Group<G> g, const Slot<K, V>* slots, const unsigned long long* ovf,
                                              uint64_t nw, uint64_t seed, K k) {
  Probe p = probe_start((uint64_t)k, seed, nw);
  for (uint64_t t = 0; t < nw; ++t) {
    const Slot<K, V>* win = slots + p.w * G;
    const K sk = vload(&win[g.rank].key);
    const unsigned long long hit = g.ballot(sk == k);
    if (hit) return (int64_t)(p.w * G) + first_bit(hit);
    if (g.ballot(sk == Sentinel<K>::EMPTY)) return -1;
    // no key with this tag went on past this window. Decided by a ballot, as the insert does: lanes that
    // read the filter word apart (a find overlapping an insert, through a user stream or the numba device
    // functions) would otherwise split the group before its next ballot (review finding)
    if (!g.ballot(ovf_has(ovf, p.w, p.tag))) return -1;
    probe_next(p, nw);
  }
  return -1;
}

template <class K, class V, int G>
__global__ void find_kernel(const Slot<K, V>* slots, const unsigned long long* special,
                                                       uint64_t nw, uint64_t seed, const K* keys, int64_t n,
                                                       void* out_vals, uint8_t* found, uint64_t dflt) {
  const Group<G> g;
  const int64_t groups = (int64_t)gridDim.x * (kBlock / G);
  for (int64_t i = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / G; i < n; i += groups) {
    const K k = keys[i];
    bool hit;
    uint64_t v = dflt;
    if (is_special(k)) {
      const int s = special_index(k);
      hit = vload(&special[2 * s]) != 0;
      if (hit) v = vload(&special[2 * s + 1]);
    } else {
      const int64_t at = group_find<K, V, G>(g, slots, special + SPECIAL_HEAD_WORDS, nw, seed, k);
      hit = at >= 0;
      if constexpr (!std::is_same<V, NoVal>::value) {
        if (hit) v = (uint64_t)vload(&slots[at].val);
      }
    }
    if (g.rank == 0) {
      if (found) found[i] = hit;
      if constexpr (!std::is_same<V, NoVal>::value) {
        if (out_vals) ((V*)out_vals)[i] = (V)v;
      }
    }
  }
}

template <class K, class V, int G>
__global__ void erase_kernel(Slot<K, V>* slots, unsigned long long* special, uint64_t nw,
                                                        uint64_t seed, const K* keys, int64_t n, long long* out,
                                                        bool multi, bool zero_val, long long* total) {
  const Group<G> g;
  const int64_t groups = (int64_t)gridDim.x * (kBlock / G);
  long long mine = 0;
  for (int64_t i = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / G; i < n; i += groups) {
    const K k = keys[i];
    long long erased = 0;
    if (is_special(k)) {
      if (!multi && g.rank == 0) {
        const int s = special_index(k);
        if (atomicCAS(&special[2 * s], 1ull, 0ull) == 1ull) {
          erased = 1;
          special[2 * s + 1] = 0;
        }
      }
    } else if (!multi) {
      const int64_t at = group_find<K, V, G>(g, slots, special + SPECIAL_HEAD_WORDS, nw, seed, k);
      if (at >= 0 && g.rank == 0 && cas_word(&slots[at].key, k, Sentinel<K>::TOMB) == k) {
        erased = 1;
        if constexpr (!std::is_same<V, NoVal>::value) {
          if (zero_val) store_word((V*)&slots[at].val, 0);
        }
      }
    } else {
      Probe p = probe_start((uint64_t)k, seed, nw);
      for (uint64_t t = 0; t < nw; ++t) {
        Slot<K, V>* win = slots + p.w * G;
        const K sk = vload(&win[g.rank].key);
        if (sk == k && cas_word(&win[g.rank].key, k, Sentinel<K>::TOMB) == k) ++erased;
        if (g.ballot(sk == Sentinel<K>::EMPTY)) break;
        probe_next(p, nw);
      }
      // every lane erased the matches in its own slots: sum over the group
      long long sum = 0;
      for (int r = 0; r < G; ++r) sum += g.shfl(erased, r);
      erased = sum;
    }
    if (g.rank == 0) {
      out[i] = erased;
      mine += erased;
    }
  }
  if (g.rank == 0 && mine) atomicAdd((unsigned long long*)total, (unsigned long long)mine);
}

// counts (vals_out == nullptr) or CSR retrieve into vals_out[offsets[i] ...]
template <class K, class V, int G>
__global__ void multi_walk_kernel(const Slot<K, V>* slots, uint64_t nw, uint64_t seed,
                                                             const K* keys, int64_t n, long long* counts,
                                                             const long long* offsets, V* vals_out) {
  const Group<G> g;
  const int64_t groups = (int64_t)gridDim.x * (kBlock / G);
  for (int64_t i = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / G; i < n; i += groups) {
    const K k = keys[i];
    long long c = 0;
    if (!is_special(k)) {
      const long long o = vals_out ? offsets[i] : 0;
      Probe p = probe_start((uint64_t)k, seed, nw);
      for (uint64_t t = 0; t < nw; ++t) {
        const Slot<K, V>* win = slots + p.w * G;
        const K sk = vload(&win[g.rank].key);
        const unsigned long long hit = g.ballot(sk == k);
        if (vals_out && ((hit >> g.rank) & 1ull)) {
          const int before = __popcll(hit & ((1ull << g.rank) - 1ull));
          vals_out[o + c + before] = win[g.rank].val;
        }
        c += __popcll(hit);
        if (g.ballot(sk == Sentinel<K>::EMPTY)) break;
        probe_next(p, nw);
      }
    }
    if (counts && g.rank == 0) counts[i] = c;
  }
}

// items(): one thread per slot, compacted through an atomic counter (order unspecified). One atomic
// per warp, not per key: the warp's live slots take consecutive places (same-address atomics serialise).
template <class K, class V>
__global__ void items_kernel(const Slot<K, V>* slots, int64_t nslots, K* keys_out,
                                                        V* vals_out, long long* count, int64_t max_out) {
  const Group<PK_WARP_SIZE> warp;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;  // a multiple of the warp: lanes loop together
  for (int64_t s = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; s - warp.rank < nslots; s += stride) {
    const bool live = s < nslots && !is_special(slots[s].key);
    const unsigned long long mask = warp.ballot(live);
    if (!mask) continue;
    long long first = 0;
    if (warp.rank == 0) first = (long long)atomicAdd((unsigned long long*)count, (unsigned long long)__popcll(mask));
    first = warp.shfl(first, 0);
    if (!live) continue;
    const long long at = first + __popcll(mask & ((1ull << warp.rank) - 1));
    if (at >= max_out) continue;
    keys_out[at] = slots[s].key;
    if constexpr (!std::is_same<V, NoVal>::value) {
      if (vals_out) vals_out[at] = slots[s].val;
    }
  }
}

// rehash: each group loads a window of the old table and inserts its live keys one by one
template <class K, class V, int G>
__global__ void rehash_kernel(const Slot<K, V>* src, uint64_t src_nw, Slot<K, V>* dst, unsigned long long* dst_ovf,
                                                         uint64_t dst_nw, uint64_t seed, long long* counters,
                                                         long long limit, int chunk) {
  const Group<G> g;
  const int64_t groups = (int64_t)gridDim.x * (kBlock / G);
  long long moved = 0;
  SlotBudget budget{counters, limit, chunk};
  for (int64_t w = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / G; w < (int64_t)src_nw; w += groups) {
    const Slot<K, V> mine = src[w * G + g.rank];
    unsigned long long live = g.ballot(!is_special(mine.key));
    while (live) {
      const int r = first_bit(live);
      live &= live - 1;
      const K k = g.shfl(mine.key, r);
      uint64_t v = 0;
      if constexpr (!std::is_same<V, NoVal>::value) v = (uint64_t)g.shfl(mine.val, r);
      if (group_insert<K, V, G, M_APPEND>(g, dst, dst_ovf, dst_nw, seed, k, v, budget) == ST_NEW) ++moved;
    }
  }
  if (g.rank == 0) budget.close();
  if (g.rank == 0 && moved) atomicAdd((unsigned long long*)&counters[C_NEW], (unsigned long long)moved);
}

// ---- Bloom filter: one thread per key, one 64-byte block per key ------------------------------
// Bit positions from bloom_positions (hash_layout.h), generated inline so nothing lives in local memory.
__global__ void bloom_add_kernel(unsigned long long* words, uint64_t nblocks, int k, uint64_t seed,
                                 const uint64_t* keys, int64_t n) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    unsigned long long* blk = words + bloom_block(keys[i], seed, nblocks) * BLOOM_BLOCK_WORDS;
    bloom_positions(keys[i], seed, k, [&](unsigned pos) { atomicOr(&blk[pos >> 6], 1ull << (pos & 63)); });
  }
}

__global__ void bloom_contains_kernel(const unsigned long long* words, uint64_t nblocks, int k, uint64_t seed,
                                      const uint64_t* keys, int64_t n, uint8_t* out) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const unsigned long long* blk = words + bloom_block(keys[i], seed, nblocks) * BLOOM_BLOCK_WORDS;
    bool all = true;
    bloom_positions(keys[i], seed, k, [&](unsigned pos) { all &= (blk[pos >> 6] >> (pos & 63)) & 1ull; });
    out[i] = all;
  }
}

#ifndef PKH_KERNELS_ONLY  // (defined by quick single-kernel register experiments)
// ---- host side ----------------------------------------------------------------------------------
unsigned grid_for(int64_t work_items) {
  int64_t b = (work_items + kBlock - 1) / kBlock;
  if (b < 1) b = 1;
  if (b > (1 << 20)) b = 1 << 20;  // grid-stride loops cover the rest
  return (unsigned)b;
}

// Inserts run a resident grid (as many blocks as the GPU holds at once) so that each group loops over
// many keys and its slot reservations (SlotBudget) pay off; a grid of one group per key would make as
// many reservation atomics as there are keys.
unsigned resident_grid_for(const char* op, int64_t work_items) {
  int dev = 0, sms = 0;
  PK_GPU_CHECK(op, pkGetDevice(&dev));
  PK_GPU_CHECK(op, pkDeviceGetAttribute(&sms, pkDevAttrMultiProcessorCount, dev));
  const int64_t resident = (int64_t)sms * (2048 / kBlock);
  const unsigned b = grid_for(work_items);
  return (int64_t)b < resident ? b : (unsigned)resident;
}

constexpr int kReserveChunk = 32;  // slots a group reserves against the load limit at a time

template <class F>
void by_layout(const char* op, int kb, int vb, F&& f) {
  if (kb == 4 && vb == 0) return f(uint32_t{}, NoVal{});
  if (kb == 4 && vb == 4) return f(uint32_t{}, uint32_t{});
  if (kb == 4 && vb == 8) return f(uint32_t{}, uint64_t{});
  if (kb == 8 && vb == 0) return f(uint64_t{}, NoVal{});
  if (kb == 8 && vb == 4) return f(uint64_t{}, uint32_t{});
  if (kb == 8 && vb == 8) return f(uint64_t{}, uint64_t{});
  throw std::invalid_argument(std::string("pykernels.") + op + ": unsupported key/value widths");
}

// The group size is the table's window; instantiated for the sizes the autotuner may choose.
template <class F>
void by_group(const char* op, int W, F&& f) {
  switch (W) {
    case 1: return f(std::integral_constant<int, 1>());
    case 2: return f(std::integral_constant<int, 2>());
    case 4: return f(std::integral_constant<int, 4>());
    case 8: return f(std::integral_constant<int, 8>());
    case 16: return f(std::integral_constant<int, 16>());
    case 32: return f(std::integral_constant<int, 32>());
  }
  throw std::invalid_argument(std::string("pykernels.") + op + ": GPU tables need a window of 1, 2, 4, 8, 16 or 32");
}

struct Counters {  // a few device words, read back at the end of a call
  long long* d = nullptr;
  pk_stream_t s;
  const char* op;
  Counters(const char* op_, pk_stream_t s_, long long used) : s(s_), op(op_) {
    PK_GPU_CHECK(op, pkMallocAsync((void**)&d, 4 * sizeof(long long), s));
    PK_GPU_CHECK(op, pkMemsetAsync(d, 0, 4 * sizeof(long long), s));
    PK_GPU_CHECK(op, pkMemcpyAsync(d, &used, sizeof(long long), pkMemcpyHostToDevice, s));
    PK_GPU_CHECK(op, pkStreamSynchronize(s));  // `used` lives on the host stack
  }
  void read(long long out[4]) {
    PK_GPU_CHECK(op, pkMemcpyAsync(out, d, 4 * sizeof(long long), pkMemcpyDeviceToHost, s));
    PK_GPU_CHECK(op, pkStreamSynchronize(s));
  }
  ~Counters() {
    if (d) (void)pkFreeAsync(d, s);
  }
};

}  // namespace

// Entry points (hash_cuda_bind.cpp). Pointers and streams arrive as integers.
void pk_hash_insert(uintptr_t slots, uintptr_t special, uint64_t nw, int W, uint64_t seed, int kb, int vb,
                    uintptr_t keys, uintptr_t vals, int64_t n, uintptr_t status, int mode, int64_t used_now,
                    int64_t limit, uintptr_t stream, long long out[3]) {
  const char* op = "HashMap.insert";
  const pk::GpuScope gpu_scope(op, slots);
  out[0] = out[1] = out[2] = 0;
  if (n <= 0) return;
  pk_stream_t s = (pk_stream_t)stream;
  Counters c(op, s, used_now);
  auto launch = [&](int chunk, bool only_pending) {
    by_layout(op, kb, vb, [&](auto k, auto v) {
      using K = decltype(k);
      using V = decltype(v);
      by_group(op, W, [&](auto gsz) {
        constexpr int G = decltype(gsz)::value;
        const unsigned grid = resident_grid_for(op, n * G);
        auto* sl = (Slot<K, V>*)slots;
        auto* sp = (unsigned long long*)special;
        auto* st = (uint8_t*)status;
        if (mode == M_UPSERT)
          insert_kernel<K, V, G, M_UPSERT><<<grid, kBlock, 0, s>>>(sl, sp, nw, seed, (const K*)keys, (const void*)vals, n, st,
                                                                    c.d, limit, chunk, only_pending);
        else if (mode == M_ADD)
          insert_kernel<K, V, G, M_ADD><<<grid, kBlock, 0, s>>>(sl, sp, nw, seed, (const K*)keys, (const void*)vals, n, st,
                                                                 c.d, limit, chunk, only_pending);
        else
          insert_kernel<K, V, G, M_APPEND><<<grid, kBlock, 0, s>>>(sl, sp, nw, seed, (const K*)keys, (const void*)vals, n, st,
                                                                    c.d, limit, chunk, only_pending);
      });
    });
    PK_GPU_CHECK(op, pkGetLastError());
  };
  launch(kReserveChunk, false);
  long long h[4];
  c.read(h);
  // Refused near the limit: again, exactly (see SlotBudget), while that still places keys. Two copies of
  // one new key can both be refused in a pass whose last slot a third key or the other copy took; the
  // copy refused beside its inserted twin is found EXISTED by the next pass, so "left out" counts only
  // keys that do not fit.
  for (long long before = h[C_PENDING]; h[C_PENDING] > 0; before = h[C_PENDING]) {
    PK_GPU_CHECK(op, pkMemsetAsync(c.d + C_PENDING, 0, sizeof(long long), s));
    launch(1, true);
    c.read(h);
    if (h[C_PENDING] >= before) break;
  }
  out[0] = h[C_NEW];
  out[1] = h[C_NEW_EMPTY];
  out[2] = h[C_PENDING];
}

void pk_hash_find(uintptr_t slots, uintptr_t special, uint64_t nw, int W, uint64_t seed, int kb, int vb,
                  uintptr_t keys, int64_t n, uintptr_t out_vals, uintptr_t found, uint64_t dflt, uintptr_t stream) {
  const char* op = "HashMap.find";
  const pk::GpuScope gpu_scope(op, slots);
  if (n <= 0) return;
  pk_stream_t s = (pk_stream_t)stream;
  by_layout(op, kb, vb, [&](auto k, auto v) {
    using K = decltype(k);
    using V = decltype(v);
    by_group(op, W, [&](auto gsz) {
      constexpr int G = decltype(gsz)::value;
      find_kernel<K, V, G><<<grid_for(n * G), kBlock, 0, s>>>((const Slot<K, V>*)slots,
                                                               (const unsigned long long*)special, nw, seed,
                                                               (const K*)keys, n, (void*)out_vals,
                                                               (uint8_t*)found, dflt);
    });
  });
  PK_GPU_CHECK(op, pkGetLastError());
}

int64_t pk_hash_erase(uintptr_t slots, uintptr_t special, uint64_t nw, int W, uint64_t seed, int kb, int vb,
                      uintptr_t keys, int64_t n, uintptr_t out, bool multi, bool zero_val, uintptr_t stream) {
  const char* op = "HashMap.erase";
  const pk::GpuScope gpu_scope(op, slots);
  if (n <= 0) return 0;
  pk_stream_t s = (pk_stream_t)stream;
  Counters c(op, s, 0);
  by_layout(op, kb, vb, [&](auto k, auto v) {
    using K = decltype(k);
    using V = decltype(v);
    by_group(op, W, [&](auto gsz) {
      constexpr int G = decltype(gsz)::value;
      erase_kernel<K, V, G><<<grid_for(n * G), kBlock, 0, s>>>((Slot<K, V>*)slots, (unsigned long long*)special, nw,
                                                                seed, (const K*)keys, n, (long long*)out, multi,
                                                                zero_val, c.d + C_NEW);
    });
  });
  PK_GPU_CHECK(op, pkGetLastError());
  long long h[4];
  c.read(h);
  return h[C_NEW];
}

void pk_hash_multi_walk(uintptr_t slots, uint64_t nw, int W, uint64_t seed, int kb, int vb, uintptr_t keys,
                        int64_t n, uintptr_t counts, uintptr_t offsets, uintptr_t vals_out, uintptr_t stream) {
  const char* op = "MultiValueHashMap.find";
  const pk::GpuScope gpu_scope(op, slots);
  if (n <= 0) return;
  pk_stream_t s = (pk_stream_t)stream;
  by_layout(op, kb, vb, [&](auto k, auto v) {
    using K = decltype(k);
    using V = decltype(v);
    if constexpr (!std::is_same<V, NoVal>::value) {
      by_group(op, W, [&](auto gsz) {
        constexpr int G = decltype(gsz)::value;
        multi_walk_kernel<K, V, G><<<grid_for(n * G), kBlock, 0, s>>>((const Slot<K, V>*)slots, nw, seed,
                                                                       (const K*)keys, n, (long long*)counts,
                                                                       (const long long*)offsets, (V*)vals_out);
      });
    } else {
      throw std::invalid_argument("pykernels.MultiValueHashMap: multi-value tables need values");
    }
  });
  PK_GPU_CHECK(op, pkGetLastError());
}

int64_t pk_hash_items(uintptr_t slots, uint64_t nw, int W, int kb, int vb, uintptr_t keys_out, uintptr_t vals_out,
                      int64_t max_out, uintptr_t stream) {
  const char* op = "HashMap.items";
  const pk::GpuScope gpu_scope(op, slots);
  pk_stream_t s = (pk_stream_t)stream;
  Counters c(op, s, 0);
  const int64_t nslots = (int64_t)(nw * (uint64_t)W);
  by_layout(op, kb, vb, [&](auto k, auto v) {
    using K = decltype(k);
    using V = decltype(v);
    items_kernel<K, V><<<grid_for(nslots), kBlock, 0, s>>>((const Slot<K, V>*)slots, nslots, (K*)keys_out,
                                                           (V*)vals_out, c.d, max_out);
  });
  PK_GPU_CHECK(op, pkGetLastError());
  long long h[4];
  c.read(h);
  return h[0];
}

int64_t pk_hash_rehash(uintptr_t src, uint64_t src_nw, uintptr_t dst, uintptr_t dst_special, uint64_t dst_nw, int W,
                       uint64_t seed, int kb, int vb, uintptr_t stream) {
  const char* op = "HashMap.rehash";
  const pk::GpuScope gpu_scope(op, dst);
  pk_stream_t s = (pk_stream_t)stream;
  Counters c(op, s, 0);
  by_layout(op, kb, vb, [&](auto k, auto v) {
    using K = decltype(k);
    using V = decltype(v);
    by_group(op, W, [&](auto gsz) {
      constexpr int G = decltype(gsz)::value;
      rehash_kernel<K, V, G><<<resident_grid_for(op, (int64_t)src_nw * G), kBlock, 0, s>>>(
          (const Slot<K, V>*)src, src_nw, (Slot<K, V>*)dst, (unsigned long long*)dst_special + SPECIAL_HEAD_WORDS,
          dst_nw, seed, c.d, /*limit: none*/ -1, kReserveChunk);
    });
  });
  PK_GPU_CHECK(op, pkGetLastError());
  long long h[4];
  c.read(h);
  return h[C_NEW];
}

void pk_hash_bloom_add(uintptr_t words, uint64_t nblocks, int k, uint64_t seed, uintptr_t keys, int64_t n,
                       uintptr_t stream) {
  const pk::GpuScope gpu_scope("BloomFilter.add", words);
  if (n <= 0) return;
  bloom_add_kernel<<<grid_for(n), kBlock, 0, (pk_stream_t)stream>>>((unsigned long long*)words, nblocks, k, seed,
                                                                     (const uint64_t*)keys, n);
  PK_GPU_CHECK("BloomFilter.add", pkGetLastError());
}

void pk_hash_bloom_contains(uintptr_t words, uint64_t nblocks, int k, uint64_t seed, uintptr_t keys, int64_t n,
                            uintptr_t out, uintptr_t stream) {
  const pk::GpuScope gpu_scope("BloomFilter.contains", words);
  if (n <= 0) return;
  bloom_contains_kernel<<<grid_for(n), kBlock, 0, (pk_stream_t)stream>>>((const unsigned long long*)words, nblocks,
                                                                          k, seed, (const uint64_t*)keys, n,
                                                                          (uint8_t*)out);
  PK_GPU_CHECK("BloomFilter.contains", pkGetLastError());
}
#endif  // PKH_KERNELS_ONLY
