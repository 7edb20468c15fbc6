// Onesweep LSD radix sort for CUDA and HIP (Adinets & Merrill, "Onesweep: A Faster Least Significant
// Digit Radix Sort for GPUs", 2022), built through pk_gpu.h for sm_80/sm_90 and gfx90a.
//
//   global_hist_kernel  one read of the keys -> the 256-bin histograms of EVERY 8-bit digit
//                       (shared-memory atomics per block, then global atomics).
//   host                exclusive scan of each histogram (the "tile -1" prefix of every pass) and
//                       trivial-pass skipping (a pass whose histogram has one full bin moves nothing).
//   onesweep_bin_kernel one launch per remaining digit; per tile of BIN_THREADS * ITEMS keys:
//     1. tile id from an atomic counter (not blockIdx): a tile only waits for tiles already running,
//        which is what makes the spin-waiting of the look-back safe;
//     2. warp-level multisplit ranking: 8 ballots per key give the mask of lanes with the same digit;
//        per-warp 256-bin counts in shared memory give each key its rank (stable: lanes, items and
//        warps are visited in input order);
//     3. the tile's per-digit counts are published at once as AGGREGATE in packed status words
//        (2 flag bits + count in one word: one store publishes both), then one thread per digit walks
//        back over predecessor tiles summing AGGREGATEs until an INCLUSIVE one (decoupled look-back),
//        and publishes its own INCLUSIVE value; the block scan of the tile's counts runs between the
//        AGGREGATE store and the look-back, so predecessor tiles finish meanwhile (less spinning);
//     4. keys (then payloads) are staged in shared memory in digit order and written out in runs,
//        out[global_start[d] + j - local_start[d]], so global writes stay coalesced.
//   Status words are 32-bit (30-bit counts) below 2^28 keys and widened to 64-bit above, so inputs of
//   any size up to 2^32 - 1 keys run in one sort (the histogram counters are 32-bit).
//   The last tile is padded with all-ones keys: they take the largest digit, so stability keeps them
//   after every real key of the tile and they are never written.
//
// Tuning parameters (issue #3; chosen per call by pykernels/sort/_tune.py, checked by check_config):
//   bin_items            keys per thread of the binning kernel, a template parameter (the key, rank and
//                        position arrays live in registers): 8, 11, 15 or 19 when keys and payloads are
//                        4 bytes; 8, 11 or 15 with 8-byte keys or payloads, whose 19-item tile would need
//                        55 KB of static shared memory (the limit is 48 KiB). Default 15 (3840-key tiles).
//   hist_threads         threads per block of the histogram kernel: 256, 512 or 1024 (a template
//                        parameter, for __launch_bounds__). Default 512.
//   hist_keys_per_block  keys each histogram block reads, run time, in [2^10, 2^20]: fewer give more
//                        blocks (small inputs fill the GPU), more give fewer global atomics. Default 2^15.
//   rank                 how a warp finds the lanes holding the same digit: 0 = 8 ballots per key (one per
//                        digit bit; the default), 1 = each lane ORs its bit into a per-warp word of its
//                        digit in shared memory and reads the word back (CUB's "match atomic-or" ranking:
//                        ~6 instructions per key instead of ~32; a tuning candidate until a GPU run has
//                        measured it). On AMD (64-lane wavefronts) both run the ballots.
//   BIN_THREADS stays 256: the look-back and the block scan run one thread per digit (RADIX = 256).
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "pk_gpu.h"

namespace pksort_gpu {

constexpr int RADIX = 256;
constexpr int DIGIT_BITS = 8;
constexpr int MAX_PASSES = 8;                // 64-bit keys
constexpr int BIN_THREADS = 256;             // one thread per digit in the look-back: not a tuning knob
constexpr int WARPS = BIN_THREADS / PK_WARP_SIZE;  // 8 on NVIDIA, 4 wavefronts on AMD
static_assert(BIN_THREADS == RADIX, "the look-back runs one thread per digit");

// The configs compiled below (pykernels/sort/_cuda.py lists the same ones; tests cross-check them).
struct SortConfig {
  int bin_items = 15;                  // keys per thread: tiles of 3840 keys
  int hist_threads = 512;
  int64_t hist_keys_per_block = 1 << 15;
  int rank = 0;                        // 0 ballots, 1 shared-memory atomic OR
};
constexpr int BIN_ITEMS_CHOICES[] = {8, 11, 15, 19};
constexpr int BIN_ITEMS_MAX_WIDE = 15;       // with an 8-byte key or payload (shared memory, see above)
constexpr int HIST_THREADS_CHOICES[] = {256, 512, 1024};
constexpr int64_t HIST_KEYS_MIN = 1 << 10, HIST_KEYS_MAX = 1 << 20;
constexpr size_t STATIC_SMEM_LIMIT = 48 * 1024;  // static __shared__ bytes per block (NVIDIA; AMD has 64 KiB)

// Static shared memory of onesweep_bin_kernel<K, V, ., ., ITEMS>: staging (the wider of key and payload),
// the digit of each staged key, per-warp counts, the scan and the global offsets. launch_bin checks it.
template <class K, class V>
constexpr size_t bin_smem_bytes(int items) {
  const size_t sb = sizeof(K) > sizeof(V) ? sizeof(K) : sizeof(V);
  const size_t tile = (size_t)BIN_THREADS * items;
  return tile * sb + tile + (size_t)WARPS * RADIX * 4 + RADIX * 4 + RADIX * 8 + 16;
}

struct PassTable {
  int shift[MAX_PASSES];
  uint32_t mask[MAX_PASSES];
  int npass;
};

template <class S>
struct StatusWord;
template <>
struct StatusWord<uint32_t> {
  static constexpr int FLAG_SHIFT = 30;
};
template <>
struct StatusWord<unsigned long long> {
  static constexpr int FLAG_SHIFT = 62;
};
constexpr unsigned FLAG_AGGREGATE = 1, FLAG_INCLUSIVE = 2;

__device__ __forceinline__ void publish(uint32_t* p, uint32_t v) { atomicExch(p, v); }
__device__ __forceinline__ void publish(unsigned long long* p, unsigned long long v) { atomicExch(p, v); }

template <class K>
__device__ __forceinline__ uint32_t digit_of(K k, int shift, uint32_t mask) {
  return (uint32_t)(k >> shift) & mask;
}

// ---------------------------------------------------------------------------------------------
// 1. Histograms of every digit in one read.
// ---------------------------------------------------------------------------------------------
template <class K, int THREADS>
__global__ void __launch_bounds__(THREADS) global_hist_kernel(const K* __restrict__ keys, int64_t n,
                                                             int64_t keys_per_block, uint32_t* __restrict__ hist,
                                                             PassTable pt) {
  __shared__ uint32_t sh[MAX_PASSES * RADIX];
  for (int i = threadIdx.x; i < pt.npass * RADIX; i += THREADS) sh[i] = 0;
  __syncthreads();
  const int64_t begin = (int64_t)blockIdx.x * keys_per_block;
  const int64_t end = begin + keys_per_block < n ? begin + keys_per_block : n;
  for (int64_t i = begin + threadIdx.x; i < end; i += THREADS) {
    const K k = keys[i];
#pragma unroll
    for (int p = 0; p < MAX_PASSES; ++p)
      if (p < pt.npass) atomicAdd(&sh[p * RADIX + digit_of(k, pt.shift[p], pt.mask[p])], 1u);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < pt.npass * RADIX; i += THREADS)
    if (sh[i]) atomicAdd(&hist[i], sh[i]);
}

// ---------------------------------------------------------------------------------------------
// 2. One binning pass (one digit) of Onesweep.
// ---------------------------------------------------------------------------------------------
// (The RANK_OR variants say "at least one block per SM": left to its heuristic, ptxas gave one of them 64
// registers and a spill. 0 leaves the ballot variants' allocation as it was when the GPU measured them.)
template <class K, class V, class S, bool PAIRS, int ITEMS, bool RANK_OR>
__global__ void __launch_bounds__(BIN_THREADS, RANK_OR ? 1 : 0) onesweep_bin_kernel(
    const K* __restrict__ kin, K* __restrict__ kout, const V* __restrict__ vin, V* __restrict__ vout, int64_t n,
    int shift, uint32_t dmask, const uint32_t* __restrict__ goff, S* status, uint32_t* counter) {
  constexpr int SB = sizeof(K) > sizeof(V) ? sizeof(K) : sizeof(V);
  constexpr int FS = StatusWord<S>::FLAG_SHIFT;
  constexpr S COUNT_MASK = (S(1) << FS) - 1;
  constexpr int TILE = BIN_THREADS * ITEMS;
  __shared__ uint32_t s_tile;
  __shared__ uint32_t s_whist[WARPS][RADIX];  // per-warp digit counts, then their prefix over warps
  __shared__ uint32_t s_scan[RADIX];
  __shared__ int64_t s_global[RADIX];         // global start of digit d's run minus its local start
  __shared__ uint8_t s_digit[TILE];
  __shared__ __align__(16) unsigned char s_stage[TILE * SB];
  K* stage_k = reinterpret_cast<K*>(s_stage);
  V* stage_v = reinterpret_cast<V*>(s_stage);

  const int tid = threadIdx.x;
  const int lane = tid % PK_WARP_SIZE, warp = tid / PK_WARP_SIZE;
  // rank = 1: per-warp match words (lane bits of each digit), in the staging buffer, which is not used
  // before the ranking ends (TILE * SB >= 256 * 8 * 4 bytes = WARPS * RADIX words)
  constexpr bool MATCH_OR = RANK_OR && PK_WARP_SIZE == 32;
  static_assert(!MATCH_OR || TILE * SB >= WARPS * RADIX * 4, "match words do not fit in the staging buffer");
  uint32_t* s_match = reinterpret_cast<uint32_t*>(s_stage);
  if (tid == 0) s_tile = atomicAdd(counter, 1u);  // start order, not blockIdx
  for (int i = tid; i < WARPS * RADIX; i += BIN_THREADS) {
    (&s_whist[0][0])[i] = 0;
    if (MATCH_OR) s_match[i] = 0;
  }
  __syncthreads();
  const int64_t tile = s_tile;
  const int64_t base = tile * TILE;
  const int64_t valid = n - base < TILE ? n - base : TILE;

  // Load: warp-striped so each warp reads PK_WARP_SIZE consecutive keys per item (coalesced) and the
  // (warp, item, lane) visiting order is the input order.
  K keys[ITEMS];
  uint32_t rank[ITEMS];
  const int64_t wbase = base + (int64_t)warp * (PK_WARP_SIZE * ITEMS) + lane;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int64_t idx = wbase + i * PK_WARP_SIZE;
    keys[i] = idx < n ? kin[idx] : ~K(0);  // padding: largest digit, stays last, never written
  }
  // Warp multisplit: the lanes holding the same digit, from 8 ballots or (MATCH_OR) from the digit's
  // match word, which every lane of the digit ORs its bit into; the group's lowest lane then adds the
  // group's count and clears the word for the next key.
  const pk_lane_mask_t lt = pk_lanemask_lt();
  uint32_t* const warp_match = s_match + warp * RADIX;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const uint32_t d = digit_of(keys[i], shift, dmask);
    pk_lane_mask_t eq;
    if constexpr (MATCH_OR) {
      atomicOr(warp_match + d, 1u << lane);
      PK_SYNCWARP();
      eq = warp_match[d];
    } else {
      eq = ~pk_lane_mask_t(0);
#pragma unroll
      for (int b = 0; b < DIGIT_BITS; ++b) {
        const bool bit = (d >> b) & 1u;
        const pk_lane_mask_t bal = pk_ballot(bit);
        eq &= bit ? bal : ~bal;
      }
    }
    const int before = pk_popc_mask(eq & lt);
    const uint32_t pre = s_whist[warp][d];
    PK_SYNCWARP();
    if (before == 0) {
      s_whist[warp][d] = pre + pk_popc_mask(eq);  // the group's lowest lane adds for all
      if (MATCH_OR) warp_match[d] = 0;
    }
    PK_SYNCWARP();
    rank[i] = pre + before;
  }
  __syncthreads();

  // Thread `tid` owns digit d = tid: prefix over warps, the tile's count, publish, scan, look-back.
  const int d = tid;
  uint32_t count = 0;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) {
    const uint32_t c = s_whist[w][d];
    s_whist[w][d] = count;
    count += c;
  }
  // Padding keys are counted in the largest digit of the last tile; nobody looks back at the last
  // tile, but publish real counts anyway.
  uint32_t real = count;
  if (valid < TILE && (uint32_t)d == dmask) real -= (uint32_t)(TILE - valid);
  S* my = status + tile * RADIX + d;
  if (tile == 0) publish(my, (S(FLAG_INCLUSIVE) << FS) | S(real));
  else publish(my, (S(FLAG_AGGREGATE) << FS) | S(real));
  // Block exclusive scan of the counts (local starts), while predecessors finish.
  s_scan[d] = count;
  __syncthreads();
  for (int off = 1; off < RADIX; off <<= 1) {
    const uint32_t v = d >= off ? s_scan[d - off] : 0u;
    __syncthreads();
    s_scan[d] += v;
    __syncthreads();
  }
  const uint32_t local_start = s_scan[d] - count;
  // Decoupled look-back over predecessor tiles for digit d.
  S excl = 0;
  if (tile > 0) {
    int64_t k = tile - 1;
    for (;;) {
      const S s = *(volatile S*)(status + k * RADIX + d);
      const unsigned flag = (unsigned)(s >> FS);
      if (flag == 0) continue;  // not ready: spin (volatile load is re-issued every iteration)
      excl += s & COUNT_MASK;
      if (flag == FLAG_INCLUSIVE || k == 0) break;
      --k;
    }
    publish(my, (S(FLAG_INCLUSIVE) << FS) | S(excl + real));
  }
  s_global[d] = (int64_t)goff[d] + (int64_t)excl - (int64_t)local_start;
  s_scan[d] = local_start;
  __syncthreads();

  // Stage keys in digit order, then write runs.
  uint32_t pos[ITEMS];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const uint32_t dg = digit_of(keys[i], shift, dmask);
    pos[i] = s_scan[dg] + s_whist[warp][dg] + rank[i];
    stage_k[pos[i]] = keys[i];
    s_digit[pos[i]] = (uint8_t)dg;
  }
  __syncthreads();
  for (int j = tid; j < valid; j += BIN_THREADS) kout[s_global[s_digit[j]] + j] = stage_k[j];
  if constexpr (PAIRS) {
    V vals[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int64_t idx = wbase + i * PK_WARP_SIZE;
      vals[i] = idx < n ? vin[idx] : V(0);
    }
    __syncthreads();  // every key has left the staging buffer
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) stage_v[pos[i]] = vals[i];
    __syncthreads();
    for (int j = tid; j < valid; j += BIN_THREADS) vout[s_global[s_digit[j]] + j] = stage_v[j];
  }
}

// ---------------------------------------------------------------------------------------------
// Host side
// ---------------------------------------------------------------------------------------------
inline size_t align256(size_t x) { return (x + 255) & ~size_t(255); }

PassTable make_passes(int begin_bit, int end_bit) {
  PassTable pt{};
  pt.npass = 0;
  for (int s = begin_bit; s < end_bit && pt.npass < MAX_PASSES; s += DIGIT_BITS) {
    const int bits = end_bit - s < DIGIT_BITS ? end_bit - s : DIGIT_BITS;
    pt.shift[pt.npass] = s;
    pt.mask[pt.npass] = (1u << bits) - 1u;
    ++pt.npass;
  }
  return pt;
}

struct TempLayout {
  size_t alt_keys, alt_vals, hist, goff, counter, status, total;
};

// The status words (one per tile and digit) depend on the tile, so on bin_items.
TempLayout layout(int64_t n, int kb, int vb, int tile) {
  const int64_t tiles = (n + tile - 1) / tile;
  const size_t sword = n >= (int64_t(1) << 28) ? 8 : 4;
  TempLayout t{};
  size_t off = 0;
  t.alt_keys = off; off += align256((size_t)n * kb);
  t.alt_vals = off; off += align256((size_t)n * vb);
  t.hist = off; off += align256((size_t)MAX_PASSES * RADIX * 4);
  t.goff = off; off += align256((size_t)MAX_PASSES * RADIX * 4);
  t.counter = off; off += align256(4);
  t.status = off; off += align256((size_t)tiles * RADIX * sword);
  t.total = off;
  return t;
}

// Argument checks of a config, as std::invalid_argument (ValueError in Python) naming the op and the
// config entry. They need no GPU, so they run before anything touches the device.
std::string join(const int* v, int count) {
  std::string s;
  for (int i = 0; i < count; ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s;
}

void check_bin_items(const std::string& op, int key_bytes, int val_bytes, int bin_items) {
  const bool wide = key_bytes == 8 || val_bytes == 8;
  int allowed[sizeof(BIN_ITEMS_CHOICES) / sizeof(int)], count = 0;
  for (int b : BIN_ITEMS_CHOICES)
    if (!wide || b <= BIN_ITEMS_MAX_WIDE) allowed[count++] = b;
  for (int i = 0; i < count; ++i)
    if (allowed[i] == bin_items) return;
  throw std::invalid_argument("pykernels." + op + ": expected config 'bin_items' in {" + join(allowed, count) +
                              "} for " + std::to_string(key_bytes) + "-byte keys and " +
                              (val_bytes ? std::to_string(val_bytes) + "-byte payloads" : std::string("no payload")) +
                              ", got " + std::to_string(bin_items));
}

void check_config(const std::string& op, int key_bytes, int val_bytes, const SortConfig& cfg) {
  check_bin_items(op, key_bytes, val_bytes, cfg.bin_items);
  bool ok = false;
  for (int t : HIST_THREADS_CHOICES) ok = ok || t == cfg.hist_threads;
  if (!ok)
    throw std::invalid_argument("pykernels." + op + ": expected config 'hist_threads' in {" +
                                join(HIST_THREADS_CHOICES, sizeof(HIST_THREADS_CHOICES) / sizeof(int)) + "}, got " +
                                std::to_string(cfg.hist_threads));
  if (cfg.rank != 0 && cfg.rank != 1)
    throw std::invalid_argument("pykernels." + op + ": expected config 'rank' in {0, 1}, got " +
                                std::to_string(cfg.rank));
  if (cfg.hist_keys_per_block < HIST_KEYS_MIN || cfg.hist_keys_per_block > HIST_KEYS_MAX)
    throw std::invalid_argument("pykernels." + op + ": expected config 'hist_keys_per_block' in [" +
                                std::to_string(HIST_KEYS_MIN) + ", " + std::to_string(HIST_KEYS_MAX) + "], got " +
                                std::to_string(cfg.hist_keys_per_block));
}

template <class K, int THREADS>
void launch_hist(const void* kin, int64_t n, int64_t keys_per_block, uint32_t* hist, const PassTable& pt,
                 pk_stream_t stream) {
  const int64_t blocks = (n + keys_per_block - 1) / keys_per_block;
  global_hist_kernel<K, THREADS><<<(unsigned)blocks, THREADS, 0, stream>>>((const K*)kin, n, keys_per_block, hist, pt);
}

template <class K>
void launch_hist_cfg(const SortConfig& cfg, const void* kin, int64_t n, uint32_t* hist, const PassTable& pt,
                     pk_stream_t stream) {
  switch (cfg.hist_threads) {
    case 256: return launch_hist<K, 256>(kin, n, cfg.hist_keys_per_block, hist, pt, stream);
    case 512: return launch_hist<K, 512>(kin, n, cfg.hist_keys_per_block, hist, pt, stream);
    case 1024: return launch_hist<K, 1024>(kin, n, cfg.hist_keys_per_block, hist, pt, stream);
  }
  throw std::logic_error("pykernels.sort: hist_threads " + std::to_string(cfg.hist_threads) + " is not compiled");
}

template <class K, class V, class S, bool PAIRS, int ITEMS>
void launch_bin(int rank, const void* kin, void* kout, const void* vin, void* vout, int64_t n, int shift,
                uint32_t mask, const uint32_t* goff, void* status, uint32_t* counter, pk_stream_t stream) {
  static_assert(bin_smem_bytes<K, V>(ITEMS) <= STATIC_SMEM_LIMIT, "this tile does not fit in shared memory");
  constexpr int TILE = BIN_THREADS * ITEMS;
  const int64_t tiles = (n + TILE - 1) / TILE;
  if (rank == 1)
    onesweep_bin_kernel<K, V, S, PAIRS, ITEMS, true><<<(unsigned)tiles, BIN_THREADS, 0, stream>>>(
        (const K*)kin, (K*)kout, (const V*)vin, (V*)vout, n, shift, mask, goff, (S*)status, counter);
  else
    onesweep_bin_kernel<K, V, S, PAIRS, ITEMS, false><<<(unsigned)tiles, BIN_THREADS, 0, stream>>>(
        (const K*)kin, (K*)kout, (const V*)vin, (V*)vout, n, shift, mask, goff, (S*)status, counter);
}

// One instantiation per bin_items choice; 19 only where its tile fits in shared memory (4-byte keys and
// payloads). check_config has already refused the others, so the throw is a guard against a mismatch.
template <class K, class V, class S, bool PAIRS>
void launch_bin_cfg(const SortConfig& cfg, const void* kin, void* kout, const void* vin, void* vout, int64_t n,
                    int shift, uint32_t mask, const uint32_t* goff, void* status, uint32_t* counter,
                    pk_stream_t stream) {
  const int items = cfg.bin_items, r = cfg.rank;
  switch (items) {
    case 8:
      return launch_bin<K, V, S, PAIRS, 8>(r, kin, kout, vin, vout, n, shift, mask, goff, status, counter, stream);
    case 11:
      return launch_bin<K, V, S, PAIRS, 11>(r, kin, kout, vin, vout, n, shift, mask, goff, status, counter, stream);
    case 15:
      return launch_bin<K, V, S, PAIRS, 15>(r, kin, kout, vin, vout, n, shift, mask, goff, status, counter, stream);
    case 19:
      if constexpr (bin_smem_bytes<K, V>(19) <= STATIC_SMEM_LIMIT)
        return launch_bin<K, V, S, PAIRS, 19>(r, kin, kout, vin, vout, n, shift, mask, goff, status, counter, stream);
      break;
  }
  throw std::logic_error("pykernels.sort: bin_items " + std::to_string(items) + " is not compiled for these types");
}

template <class K, class V, bool PAIRS>
void run_sort(const char* op, const SortConfig& cfg, const void* kin, void* kout, const void* vin, void* vout,
              int64_t n, int vb, int begin_bit, int end_bit, char* temp, pk_stream_t stream) {
  const PassTable pt = make_passes(begin_bit, end_bit);
  const int tile = BIN_THREADS * cfg.bin_items;
  const TempLayout L = layout(n, sizeof(K), vb, tile);
  uint32_t* hist = (uint32_t*)(temp + L.hist);
  uint32_t* goff = (uint32_t*)(temp + L.goff);
  uint32_t* counter = (uint32_t*)(temp + L.counter);
  void* status = temp + L.status;
  void* alt_k = temp + L.alt_keys;
  void* alt_v = temp + L.alt_vals;
  PK_GPU_CHECK(op, pkMemsetAsync(hist, 0, (size_t)MAX_PASSES * RADIX * 4, stream));
  launch_hist_cfg<K>(cfg, kin, n, hist, pt, stream);
  PK_GPU_CHECK(op, pkGetLastError());
  // Read the histograms back (a few KB) to scan them and skip trivial passes.
  std::vector<uint32_t> h((size_t)MAX_PASSES * RADIX), g((size_t)MAX_PASSES * RADIX, 0);
  PK_GPU_CHECK(op, pkMemcpyAsync(h.data(), hist, h.size() * 4, pkMemcpyDeviceToHost, stream));
  PK_GPU_CHECK(op, pkStreamSynchronize(stream));
  std::vector<int> live;
  for (int p = 0; p < pt.npass; ++p) {
    uint32_t run = 0;
    bool trivial = false;
    for (int d = 0; d < RADIX; ++d) {
      g[(size_t)p * RADIX + d] = run;
      run += h[(size_t)p * RADIX + d];
      if ((int64_t)h[(size_t)p * RADIX + d] == n) trivial = true;
    }
    if (!trivial) live.push_back(p);
  }
  const size_t vbytes = PAIRS ? (size_t)n * vb : 0;
  if (live.empty()) {
    PK_GPU_CHECK(op, pkMemcpyAsync(kout, kin, (size_t)n * sizeof(K), pkMemcpyDeviceToDevice, stream));
    if (PAIRS) PK_GPU_CHECK(op, pkMemcpyAsync(vout, vin, vbytes, pkMemcpyDeviceToDevice, stream));
    return;
  }
  PK_GPU_CHECK(op, pkMemcpyAsync(goff, g.data(), g.size() * 4, pkMemcpyHostToDevice, stream));
#if PK_HIP
  // `g` is pageable and dies with this call: CUDA stages such a copy before returning, and HIP is not
  // documented to on every ROCm, so wait for it there (a few KB, once per sort)
  PK_GPU_CHECK(op, pkStreamSynchronize(stream));
#endif
  const bool wide = n >= (int64_t(1) << 28);
  const int64_t tiles = (n + tile - 1) / tile;
  const void* sk = kin;
  const void* sv = vin;
  const int Q = (int)live.size();
  for (int q = 0; q < Q; ++q) {
    const int p = live[q];
    const bool to_out = ((Q - 1 - q) % 2) == 0;
    void* dk = to_out ? kout : alt_k;
    void* dv = to_out ? vout : alt_v;
    PK_GPU_CHECK(op, pkMemsetAsync(status, 0, (size_t)tiles * RADIX * (wide ? 8 : 4), stream));
    PK_GPU_CHECK(op, pkMemsetAsync(counter, 0, 4, stream));
    if (wide)
      launch_bin_cfg<K, V, unsigned long long, PAIRS>(cfg, sk, dk, sv, dv, n, pt.shift[p], pt.mask[p],
                                                      goff + p * RADIX, status, counter, stream);
    else
      launch_bin_cfg<K, V, uint32_t, PAIRS>(cfg, sk, dk, sv, dv, n, pt.shift[p], pt.mask[p],
                                            goff + p * RADIX, status, counter, stream);
    PK_GPU_CHECK(op, pkGetLastError());
    sk = dk;
    sv = dv;
  }
}

}  // namespace pksort_gpu

// Entry points for sort_cuda_bind.cpp (no CUDA types cross this line). `op` names the calling Python op
// in error messages.
size_t pk_sort_temp_bytes(int64_t n, int key_bytes, int val_bytes, int begin_bit, int end_bit, int bin_items,
                          const std::string& op) {
  pksort_gpu::check_bin_items(op, key_bytes, val_bytes, bin_items);
  (void)begin_bit;  // the layout has room for every pass whatever the bit range
  (void)end_bit;
  return pksort_gpu::layout(n, key_bytes, val_bytes, pksort_gpu::BIN_THREADS * bin_items).total;
}

int pk_sort_tile_keys(int bin_items) {
  // Any choice, whatever the key width: the tile is only BIN_THREADS * bin_items keys.
  pksort_gpu::check_bin_items("sort", 4, 4, bin_items);
  return pksort_gpu::BIN_THREADS * bin_items;
}

int pk_sort_device_count(std::string* why) { return pk::gpu_device_count(why); }

void pk_sort_onesweep(uintptr_t keys_in, uintptr_t keys_out, uintptr_t vals_in, uintptr_t vals_out, int64_t n,
                      int key_bytes, int val_bytes, int begin_bit, int end_bit, uintptr_t temp, size_t temp_bytes,
                      uintptr_t stream, int bin_items, int hist_threads, int64_t hist_keys_per_block,
                      int rank, const std::string& op_name) {
  using namespace pksort_gpu;
  const char* op = op_name.c_str();
  SortConfig cfg;
  cfg.bin_items = bin_items;
  cfg.hist_threads = hist_threads;
  cfg.hist_keys_per_block = hist_keys_per_block;
  cfg.rank = rank;
  if (key_bytes == 4 || key_bytes == 8) check_config(op_name, key_bytes, val_bytes, cfg);  // before the GPU
  const pk::GpuScope gpu_scope(op, keys_in);
  if (n <= 0) return;
  const std::string pre = "pykernels." + op_name + ": ";
  if (n >= (int64_t(1) << 32)) throw std::invalid_argument(pre + "at most 2^32 - 1 keys per GPU sort");
  if (key_bytes != 4 && key_bytes != 8) throw std::invalid_argument(pre + "keys must be 4 or 8 bytes");
  if (val_bytes != 0 && val_bytes != 4 && val_bytes != 8)
    throw std::invalid_argument(pre + "payloads must be 4 or 8 bytes");
  if (begin_bit < 0 || end_bit > 8 * key_bytes || begin_bit > end_bit)
    throw std::invalid_argument(pre + "bad bit range");
  if (temp_bytes < pk_sort_temp_bytes(n, key_bytes, val_bytes, begin_bit, end_bit, bin_items, op_name))
    throw std::invalid_argument(pre + "temporary buffer too small");
  const void* ki = (const void*)keys_in;
  void* ko = (void*)keys_out;
  const void* vi = (const void*)vals_in;
  void* vo = (void*)vals_out;
  char* t = (char*)temp;
  pk_stream_t s = (pk_stream_t)stream;
  if (begin_bit == end_bit) {
    PK_GPU_CHECK(op, pkMemcpyAsync(ko, ki, (size_t)n * key_bytes, pkMemcpyDeviceToDevice, s));
    if (val_bytes) PK_GPU_CHECK(op, pkMemcpyAsync(vo, vi, (size_t)n * val_bytes, pkMemcpyDeviceToDevice, s));
    return;
  }
  using u32 = uint32_t;
  using u64 = unsigned long long;
  if (key_bytes == 4) {
    if (val_bytes == 0) run_sort<u32, u32, false>(op, cfg, ki, ko, vi, vo, n, 0, begin_bit, end_bit, t, s);
    else if (val_bytes == 4) run_sort<u32, u32, true>(op, cfg, ki, ko, vi, vo, n, 4, begin_bit, end_bit, t, s);
    else run_sort<u32, u64, true>(op, cfg, ki, ko, vi, vo, n, 8, begin_bit, end_bit, t, s);
  } else {
    if (val_bytes == 0) run_sort<u64, u32, false>(op, cfg, ki, ko, vi, vo, n, 0, begin_bit, end_bit, t, s);
    else if (val_bytes == 4) run_sort<u64, u32, true>(op, cfg, ki, ko, vi, vo, n, 4, begin_bit, end_bit, t, s);
    else run_sort<u64, u64, true>(op, cfg, ki, ko, vi, vo, n, 8, begin_bit, end_bit, t, s);
  }
}
