// The lookup loop of hash_cpu.cpp (AMAC over the table's windows), included once per SIMD tier
// (namespaces tier_portable / tier_avx2 / tier_avx512, each compiled for its instruction set and
// defining kSimdLines and line_masks before the include). Not a standalone header.
// NOLINT(build/header_guard): meant to be included several times.

// Lookups as interleaved state machines (AMAC: Kocberber et al., "Asynchronous Memory Access
// Chaining", VLDB 2015): G lookups are in flight; each step examines one lookup's current window,
// and a lookup that must go on to its next window prefetches it and yields to the others. Unlike a
// plain prefetch pipeline, this also overlaps the second and later windows of long probes (misses
// at high load), so every DRAM access of the layout is overlapped with G - 1 others.
// One window examined without a branch per slot: bit masks of "key matches" and "slot EMPTY"
// (the key never sits after an EMPTY slot, so a match anywhere in the window is the answer).
// CW > 0: window size known at compile time (unrolled); CW == 0: t.W at run time.
template <int CW, class K, class V>
inline uint32_t window_masks(const Table<K, V>& t, const Slot<K, V>* win, K k, uint32_t& empty) {
  if constexpr (kSimdLines && CW > 0 && CW * sizeof(Slot<K, V>) == 64) {
    uint32_t hit;
    line_masks(win, k, hit, empty);  // one cache line: a vector compare or two
    return hit;
  }
  const int W = CW > 0 ? CW : t.W;
  uint32_t hit = 0, emp = 0;
  for (int j = 0; j < W; ++j) {
    const K sk = load_relaxed(&win[j].key);
    hit |= (uint32_t)(sk == k) << j;
    emp |= (uint32_t)(sk == Table<K, V>::EMPTY) << j;
  }
  empty = emp;
  return hit;
}

// emit(i, key, slot, hit, special): `slot` is the key's slot when hit, else some valid slot of the table
// (or nullptr), so the caller may read it unconditionally and select with `hit`: a hit-or-miss branch
// costs a misprediction per lookup when hits and misses mix (50% hits: measured ~1.5x slower lookups).
template <int CW, class K, class V, class Emit>
void amac_find_w(const Table<K, V>& t, const K* keys, int64_t b, int64_t e, int G, Emit&& emit);

template <class K, class V, class Emit>
void amac_find(const Table<K, V>& t, const K* keys, int64_t b, int64_t e, int G, Emit&& emit) {
  switch (t.W) {  // the CPU default windows (one cache line of 16-, 8- or 4-byte slots)
    case 4: return amac_find_w<4>(t, keys, b, e, G, emit);
    case 8: return amac_find_w<8>(t, keys, b, e, G, emit);
    case 16: return amac_find_w<16>(t, keys, b, e, G, emit);
    default: return amac_find_w<0>(t, keys, b, e, G, emit);
  }
}

template <int CW, class K, class V, class Emit>
void amac_find_w(const Table<K, V>& t, const K* keys, int64_t b, int64_t e, int G, Emit&& emit) {
  using S = Slot<K, V>;
  if (G <= 1) {
    for (int64_t i = b; i < e; ++i) {
      const K k = keys[i];
      if (PK_UNLIKELY(is_special(k))) { emit(i, k, nullptr, false, true); continue; }
      S* slot = t.find_slot(k, probe_start((uint64_t)k, t.seed, t.nw));
      emit(i, k, slot ? slot : t.slots, slot != nullptr, false);
    }
    return;
  }
  // check: the current window was full without the key; its overflow-filter byte (prefetched, then
  // read at the lookup's next turn) decides whether the lookup goes on to the next window. The next
  // window is prefetched only then, so a miss costs no DRAM line beyond the windows it must read
  // (the filter, nw bytes, stays in cache).
  struct State { int64_t i; Probe p; uint64_t visited; K k; bool check; };
  constexpr int kMaxG = 64;
  State st[kMaxG];
  bool live[kMaxG];
  if (G > kMaxG) G = kMaxG;
  int64_t next = b;
  auto prefetch_window = [&](uint64_t w) {
    const char* line = reinterpret_cast<const char*>(t.window(w));
    PK_PREFETCH_R(line);
    if (t.window_bytes > 64) PK_PREFETCH_R(line + 64);
  };
  auto start = [&](State& s) -> bool {
    while (next < e) {
      const int64_t i = next++;
      const K k = keys[i];
      if (PK_UNLIKELY(is_special(k))) { emit(i, k, nullptr, false, true); continue; }
      s.i = i;
      s.k = k;
      s.p = probe_start((uint64_t)k, t.seed, t.nw);
      s.visited = 0;
      s.check = false;
      prefetch_window(s.p.w);
      return true;
    }
    return false;
  };
  int active = 0;
  for (int g = 0; g < G; ++g) active += (live[g] = start(st[g]));
  while (active) {
    for (int g = 0; g < G; ++g) {
      if (!live[g]) continue;
      State& s = st[g];
      if (PK_UNLIKELY(s.check)) {
        s.check = false;
        if (t.overflowed(s.p.w, s.p.tag) && ++s.visited < t.nw) {
          probe_next(s.p, t.nw);
          prefetch_window(s.p.w);
          continue;
        }
        emit(s.i, s.k, const_cast<S*>(t.window(s.p.w)), false, false);
        if (!(live[g] = start(s))) --active;
        continue;
      }
      const S* win = t.window(s.p.w);
      uint32_t empty;
      const uint32_t m = window_masks<CW>(t, win, s.k, empty);
      if ((m | empty) == 0) {
        // Read the filter byte at this lookup's next turn, not now: a synchronous read (an L2/L3
        // hit at best) measured 25-35% slower lookups than this prefetch-and-yield.
        s.check = true;
        if (t.ovf) PK_PREFETCH_R(t.ovf + s.p.w);
        continue;
      }
      // the hit's slot, or (m == 0) the window's last slot: a valid address either way, no branch
      const int last = (CW > 0 ? CW : t.W) - 1;
      emit(s.i, s.k, const_cast<S*>(&win[__builtin_ctz(m | (1u << last))]), m != 0, false);
      if (!(live[g] = start(s))) --active;
    }
  }
}

