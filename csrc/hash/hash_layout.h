// The table layout shared by the CPU (hash_cpu.cpp), CUDA/HIP (hash.cu) and numba.cuda
// (pykernels/hashing/device.py) implementations. A table built by one is probed by the others, so
// everything that decides WHERE a key lives is defined once here (and mirrored, line by line, in
// device.py -- tests/test_hash_device.py checks the two agree).
//
// Layout (WarpCore, Juenger et al. 2020; cuCollections static_map):
//   - an array of `nw * W` slots: `nw` windows of `W` consecutive slots. A slot is {key} (set) or
//     {key, value} (map, counting table, multi-value map) with natural alignment, so a 4-byte key
//     with a 4-byte value is one 64-bit word (GPU inserts CAS key and value together) and other
//     pairs take 16 bytes. A window of 64 bytes is one cache line: one DRAM access per window.
//   - keys are the bit patterns of the user's keys (4 or 8 bytes). Two patterns are reserved inside
//     the slot array: EMPTY = all ones, TOMBSTONE = all ones - 1 (erase writes it; probes pass over
//     it; inserts reuse it). User keys equal to them live out of band in a 4-word `special` array:
//     {present(EMPTY key), value(EMPTY key), present(TOMBSTONE key), value(TOMBSTONE key)}.
//   - probing: a key's first window is fastrange(h >> 32, nw); the next window is the previous one
//     plus a key-dependent step in [1, nw - 1] modulo nw (double hashing between windows). `nw` is a
//     prime, so every step is coprime with it and the probe sequence visits every window exactly
//     once before repeating (a full table is detected, never looped over).
//   - within a window the slots are examined in order 0..W-1 (on the GPU: by W cooperating lanes and a
//     ballot, taking the lowest lane). Inserts take the first free slot (EMPTY or TOMBSTONE) in probe
//     order after checking the key is not already present further on; so a probe for a key can stop
//     at the first EMPTY slot.
//   - overflow filter (F14's per-chunk overflow counts, Bronson & Shi 2019; the "probe further" bit of
//     bucketed tables), after the 4 words of `special`: one byte per window, byte w at bits
//     8*(w%8).. of word 4 + w/8 (little-endian, so the CPU addresses it as bytes). An insert that
//     leaves window w without having met a free slot (so the key will live beyond w) sets bit
//     `tag` (from the key's hash, independent of w) of byte w. So a probe that meets a window with
//     neither the key nor an EMPTY slot may stop there as a miss unless the window's byte has the
//     key's tag bit: at load 0.9 a miss then reads ~1.1 windows (DRAM lines on the CPU) instead of
//     ~4. Every inserter (CPU, GPU, numba) must set the bits; a reader may ignore them. Erase never
//     clears bits (conservative); a rehash or clear starts from zero.
#pragma once
#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define PKH_HD __host__ __device__ __forceinline__
#define PKH_UNROLL8 _Pragma("unroll 8")
#else
#define PKH_HD inline
#define PKH_UNROLL8 _Pragma("GCC unroll 8")
#endif

namespace pkhash {

// MurmurHash3's 64-bit finalizer (Appleby): a bijection with full avalanche, cheap on CPU and GPU.
PKH_HD uint64_t fmix64(uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdULL;
  k ^= k >> 33;
  k *= 0xc4ceb9fe1a85ec53ULL;
  k ^= k >> 33;
  return k;
}

template <class K>
struct Sentinel {
  static constexpr K EMPTY = K(~K(0));
  static constexpr K TOMB = K(~K(0) - 1);
};

// Index into `special` for a reserved key pattern (0: EMPTY, 1: TOMBSTONE).
template <class K>
PKH_HD int special_index(K k) { return k == Sentinel<K>::EMPTY ? 0 : 1; }
template <class K>
PKH_HD bool is_special(K k) { return k >= Sentinel<K>::TOMB; }

struct Probe {
  uint64_t w;     // current window
  uint32_t step;  // distance to the next window (double hashing), coprime with nw (nw prime, < 2^32)
  uint32_t tag;   // the key's bit in an overflow-filter byte
};

// nw < 2^32 (checked in Python), so both fastrange products fit in 64 bits. The window takes the high
// 32 bits of the hash, the step the high bits of the low half, the filter tag its lowest 3 bits.
PKH_HD uint64_t window_of_hash(uint64_t h, uint64_t nw) { return ((h >> 32) * nw) >> 32; }

// The first window alone (batched lookups hash many keys in one loop the compiler vectorizes).
PKH_HD uint64_t probe_first_window(uint64_t key_bits, uint64_t seed, uint64_t nw) {
  return window_of_hash(fmix64(key_bits ^ seed), nw);
}

// The probe of a key whose hash fmix64(key_bits ^ seed) is h (the lookup loops that hashed it already).
PKH_HD Probe probe_of_hash(uint64_t h, uint64_t nw) {
  Probe p;
  p.w = window_of_hash(h, nw);
  p.step = (uint32_t)(1 + (((h & 0xffffffffULL) * (nw - 1)) >> 32));
  p.tag = 1u << (unsigned)(h & 7);
  return p;
}

PKH_HD Probe probe_start(uint64_t key_bits, uint64_t seed, uint64_t nw) {
  return probe_of_hash(fmix64(key_bits ^ seed), nw);
}

// The overflow filter (see the layout notes above): words of `special` before it, and its length.
constexpr int SPECIAL_HEAD_WORDS = 4;
PKH_HD uint64_t special_words(uint64_t nw) { return SPECIAL_HEAD_WORDS + (nw + 7) / 8; }

PKH_HD void probe_next(Probe& p, uint64_t nw) {
  p.w += p.step;
  if (p.w >= nw) p.w -= nw;
}

// Blocked Bloom filter (Putze, Sanders, Singler 2007): all k bits of a key inside one 512-bit block
// (one cache line, one memory access per key). Bit positions take 9 bits each from a re-mixed hash,
// 7 per 64-bit word, re-mixing for more: k independent positions, the model the FPR test assumes.
constexpr int BLOOM_BLOCK_BITS = 512;
constexpr int BLOOM_BLOCK_WORDS = 8;

PKH_HD uint64_t bloom_block(uint64_t key_bits, uint64_t seed, uint64_t nblocks) {
  const uint64_t h = fmix64(key_bits ^ seed);
  return ((h >> 32) * nblocks) >> 32;
}

// The key's k bit positions inside its block (0..511), in order: f(pos) for each. KC > 0: k known at
// compile time (the loop unrolls), else k_run. The one definition add and contains use on every device.
template <int KC = 0, class F>
PKH_HD void bloom_positions(uint64_t key_bits, uint64_t seed, int k_run, F&& f) {
  const int k = KC > 0 ? KC : k_run;
  uint64_t h = fmix64(key_bits ^ seed ^ 0x9e3779b97f4a7c15ULL);
  PKH_UNROLL8
  for (int i = 0, used = 0; i < k; ++i, ++used) {
    if (used == 7) {
      h = fmix64(h + 0x9e3779b97f4a7c15ULL);
      used = 0;
    }
    f((unsigned)(h >> (9 * used)) & 511u);
  }
}

// One slot of the table, the same struct for the CPU and GPU kernels: key, then value (none for sets).
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

}  // namespace pkhash
