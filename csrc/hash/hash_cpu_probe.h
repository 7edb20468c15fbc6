// The lookup and bulk-insert loops of hash_cpu.cpp (lookups: grouped first windows with the long probes
// in rounds, or in a FIFO where few are long; inserts: grouped first windows with a FIFO; AMAC over the
// table's windows for window sizes other than a cache line), included once per SIMD tier
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

// The same masks and a third, "slot TOMBSTONE", all from ONE read of each slot (inserts). During an
// insert a slot changes at most once (free -> some key), so masks from one read per slot are a state
// the CAS on the chosen slot can confirm; masks from two reads are not (review finding: the key CAS'd
// by the other thread into a tombstone between the reads looked like neither, and a later EMPTY slot
// took the key a second time).
template <int CW, class K, class V>
inline uint32_t window_masks3(const Table<K, V>& t, const Slot<K, V>* win, K k, uint32_t& empty, uint32_t& tomb) {
  if constexpr (kSimdLines && CW > 0 && CW * sizeof(Slot<K, V>) == 64) {
    uint32_t hit;
    line_masks3(win, k, hit, empty, tomb);
    return hit;
  }
  const int W = CW > 0 ? CW : t.W;
  uint32_t hit = 0, emp = 0, tmb = 0;
  for (int j = 0; j < W; ++j) {
    const K sk = load_relaxed(&win[j].key);
    hit |= (uint32_t)(sk == k) << j;
    emp |= (uint32_t)(sk == Table<K, V>::EMPTY) << j;
    tmb |= (uint32_t)(sk == Table<K, V>::TOMB) << j;
  }
  empty = emp;
  tomb = tmb;
  return hit;
}

// emit(i, key, slot, hit, special): `slot` is the key's slot when hit, else some valid slot of the table
// (or nullptr), so the caller may read it unconditionally and select with `hit`: a hit-or-miss branch
// costs a misprediction per lookup when hits and misses mix (50% hits: measured ~1.5x slower lookups).
template <int CW, class K, class V, class Emit>
void amac_find_w(const Table<K, V>& t, const K* keys, int64_t b, int64_t e, int G, Emit&& emit);

template <int CW, class K, class V, class Emit>
void grouped_find_w(const Table<K, V>& t, const K* keys, int64_t b, int64_t e, int G, Emit&& emit);

template <int CW, class K, class V, class Emit>
int64_t batched_find_w(const Table<K, V>& t, const K* keys, int64_t b, int64_t e, int G, Emit&& emit);

constexpr int64_t kFindSample = 2048;  // lookups that measure how often a probe leaves its first window

template <class K, class V, class Emit>
void amac_find(const Table<K, V>& t, const K* keys, int64_t b, int64_t e, int G, Emit&& emit) {
  constexpr int kLineSlots = 64 / (int)sizeof(Slot<K, V>);
  if (G > 1 && t.W == kLineSlots && t.window_bytes == 64) {
    // the CPU default window (one cache line of 16-, 8- or 4-byte slots): first windows in groups
    // (windows in rounds, or groups with a FIFO): the rounds' loop runs the first lookups and counts
    // how many went past their first window; the rest of the range takes the FIFO loop when that was
    // under 1 in 16 (a table under ~half full), where its tighter first-window loop wins, else the
    // rounds (see batched_find_w for the measurements)
    const int64_t sample = std::min<int64_t>(e - b, kFindSample);
    const int64_t spills = batched_find_w<kLineSlots>(t, keys, b, b + sample, G, emit);
    if (b + sample == e) return;
    if (spills * 16 < sample) return grouped_find_w<kLineSlots>(t, keys, b + sample, e, G, emit);
    batched_find_w<kLineSlots>(t, keys, b + sample, e, G, emit);
    return;
  }
  switch (t.W) {
    case 4: return amac_find_w<4>(t, keys, b, e, G, emit);
    case 8: return amac_find_w<8>(t, keys, b, e, G, emit);
    case 16: return amac_find_w<16>(t, keys, b, e, G, emit);
    default: return amac_find_w<0>(t, keys, b, e, G, emit);
  }
}

// The first windows of lookups [base, base + nb) into w (one loop the compiler vectorizes), the outputs'
// lines prefetched for writing, and the keys ~4 KiB ahead: with the fill buffers busy on table lines,
// the hardware prefetcher fell behind on this sequential stream (17% of the loop's samples sat on
// loading the keys; 1.10-1.13x faster lookups at load 0.5 with this prefetch; the AMAC loop measured no
// gain from it). Shared by the two group loops (grouped_find_w, batched_find_w).
// hashes (batched_find_w; may be null): each key's whole hash as well, for the probes that go on.
template <class K, class Emit>
__attribute__((always_inline)) inline void hash_group_first(const K* keys, int64_t base, int nb, uint64_t seed,
                                                            uint64_t nw, uint64_t* w, Emit& emit,
                                                            uint64_t* hashes = nullptr) {
  if (hashes) {
    for (int j = 0; j < nb; ++j) {
      hashes[j] = fmix64((uint64_t)keys[base + j] ^ seed);
      w[j] = window_of_hash(hashes[j], nw);
    }
  } else {
    for (int j = 0; j < nb; ++j) w[j] = probe_first_window((uint64_t)keys[base + j], seed, nw);
  }
  emit_ahead(emit, base, nb);
  pk::prefetch_stream_range(keys, base, nb);
}

// A lookup's answer from a window it examined: the hit's slot, or (m == 0) the window's last slot: a
// valid address either way, so the emitter reads it without a branch.
template <int CW, class K, class V, class Emit>
__attribute__((always_inline)) inline void emit_from_window(Emit& emit, int64_t i, K k, const Slot<K, V>* win,
                                                            uint32_t m) {
  emit(i, k, const_cast<Slot<K, V>*>(&win[__builtin_ctz(m | (1u << (CW - 1)))]), m != 0, false);
}

// A lookup whose window w was full without the key: the window's filter byte and the next window it may
// go on to, prefetched together, so it waits once per window, not twice (filter, then window).
template <int CW, class K, class V>
__attribute__((always_inline)) inline void prefetch_filter_and_next(const Table<K, V>& t, const Slot<K, V>* slots,
                                                                    uint64_t nw, Probe p) {
  if (t.ovf) PK_PREFETCH_R(t.ovf + p.w);
  probe_next(p, nw);
  PK_PREFETCH_R(slots + p.w * CW);
}

// Lookup j of a group in the group loops: prefetches the next group's window j (one prefetch per lookup
// examined, G lookups ahead, spread out: issued as a burst of G after hashing the group, the prefetches
// stalled on the line-fill buffers - a third of the loop's samples sat on them - while no lookup went
// on: 1.2-1.5x slower finds at load 0.5, 4M keys, 128 MiB table, 1 and 2 threads, same process), then
// loads key i. A reserved key pattern (kept out of band) is answered here: returns false. Else `win` is
// its first window and the result its "key matches" mask, `empty` the window's EMPTY slots.
template <int CW, class K, class V, class Emit>
__attribute__((always_inline)) inline bool first_window_of(const Table<K, V>& t, const Slot<K, V>* slots,
                                                           const K* keys, int64_t i, uint64_t w,
                                                           const uint64_t* next_first, int j, int next_nb,
                                                           Emit& emit, K& k, const Slot<K, V>*& win,
                                                           uint32_t& m, uint32_t& empty) {
  if (j < next_nb) PK_PREFETCH_R(slots + next_first[j] * CW);
  k = keys[i];
  if (PK_UNLIKELY(is_special(k))) {
    emit(i, k, nullptr, false, true);
    return false;
  }
  win = slots + w * CW;
  m = window_masks<CW>(t, win, k, empty);
  return true;
}

// Group prefetching (Chen, Ailamaki, Gibbons, Mowry, "Improving Hash Join Performance through
// Prefetching", ICDE 2004) for the first window, which ends ~96% of lookups at load 0.5 (~65% at 0.9):
// the first windows of the next G keys are hashed in one loop (vectorized: AVX-512 multiplies 8 hashes
// at once) and prefetched one by one while the current G keys are examined (software pipelining at a
// distance of G lookups), so G lines are in flight with no per-lookup state to save and restore. A
// lookup whose window is full without the key (or an EMPTY) waits in a FIFO of about G such lookups
// for its overflow-filter byte and its next window, both prefetched when it joins the FIFO and read once
// G others went by (the AMAC idea, for the few long probes; a synchronous filter read cost ~12% on
// lookups with half misses).
// Why: the AMAC loop alone (amac_find_w) spent ~100 instructions per lookup on its state machine.
// Misses in very full tables (long probes) ran faster in AMAC until the next window was prefetched with
// the filter byte and the outputs ahead; since, this loop is faster for every mix (4M int64 keys, 2
// threads, this loop / AMAC): load 0.9 all misses 45 / 51 ms, half 52 / 55-60; 0.95 half 56 / 63;
// 0.99 half 64 / 73, all misses 60 / 66. So AMAC (amac_find_w) serves only windows other than a line.
// Since, batched_find_w (below) serves the ranges where many probes are long; this loop the others.
template <int CW, class K, class V, class Emit>
void grouped_find_w(const Table<K, V>& t, const K* keys, int64_t b, int64_t e, int G, Emit&& emit) {
  using S = Slot<K, V>;
  constexpr int kMaxGroup = 64, kQueue = 128;  // the FIFO holds at most kMaxGroup + 1
  const int B = G < kMaxGroup ? G : kMaxGroup;
  // locals: the emitter's byte stores could alias the table's fields and force reloads of them
  const S* const slots = t.slots;
  const uint64_t nw = t.nw, seed = t.seed;
  uint64_t first[2][kMaxGroup];
  // check: the window at p.w was full; its filter byte was prefetched and decides whether to go on.
  struct Pending { int64_t i; K k; Probe p; uint64_t visited; bool check; };
  Pending q[kQueue];
  int qhead = 0, qlen = 0;
  auto hash_group = [&](int64_t base, int nb, uint64_t* w) __attribute__((always_inline)) {
    hash_group_first(keys, base, nb, seed, nw, w, emit);
  };
  auto push = [&](const Pending& pd) __attribute__((always_inline)) { q[(qhead + qlen++) % kQueue] = pd; };
  // A window full without the key: its filter byte and (speculatively) the next window are prefetched
  // together, so a lookup that must go on waits once per window, not twice (filter, then window).
  // Measured at load 0.9 (4M int64 keys, 2 threads, same script in turn): all hits 40-42 -> 37.5-39 ms
  // (misses then ran in AMAC, where the same speculation cost 3-5%; AMAC no longer serves line windows).
  auto wait_filter = [&](Probe p) __attribute__((always_inline)) { prefetch_filter_and_next<CW>(t, slots, nw, p); };
  // The oldest queued lookup: what it waits for was prefetched about G lookups ago.
  auto step_queued = [&]() __attribute__((always_inline)) {
    Pending pd = q[qhead];
    qhead = (qhead + 1) % kQueue;
    --qlen;
    const S* win = slots + pd.p.w * CW;
    if (pd.check) {
      if (!(t.overflowed(pd.p.w, pd.p.tag) && pd.visited + 1 < nw)) {
        emit(pd.i, pd.k, const_cast<S*>(&win[CW - 1]), false, false);
        return;
      }
      // the next window was prefetched with the filter byte: examined now, not after another wait
      probe_next(pd.p, nw);
      ++pd.visited;
      win = slots + pd.p.w * CW;
    }
    uint32_t empty;
    const uint32_t m = window_masks<CW>(t, win, pd.k, empty);
    if ((m | empty) == 0) {
      wait_filter(pd.p);
      pd.check = true;
      push(pd);
      return;
    }
    emit_from_window<CW>(emit, pd.i, pd.k, win, m);
  };
  int64_t base = b;
  int nb = (int)(e - b < B ? e - b : B), cur = 0;
  if (nb > 0) hash_group(base, nb, first[cur]);
  for (int j = 0; j < nb; ++j) PK_PREFETCH_R(slots + first[cur][j] * CW);
  while (nb > 0) {
    const int64_t next_base = base + nb;
    const int next_nb = (int)(e - next_base < B ? e - next_base : B);
    if (next_nb > 0) hash_group(next_base, next_nb, first[cur ^ 1]);
    for (int j = 0; j < nb; ++j) {
      const int64_t i = base + j;
      K k;
      const S* win;
      uint32_t m, empty;
      if (!first_window_of<CW>(t, slots, keys, i, first[cur][j], first[cur ^ 1], j, next_nb, emit, k, win, m, empty))
        continue;
      if (PK_UNLIKELY((m | empty) == 0)) {
        const Probe p = probe_start((uint64_t)k, seed, nw);
        wait_filter(p);
        push(Pending{i, k, p, 0, true});
        // one step either finishes a lookup or re-queues it: step until one finished, so the FIFO
        // never holds more than B + 1 (a step per push would let re-queued lookups pile up)
        while (qlen > B) step_queued();
        continue;
      }
      emit_from_window<CW>(emit, i, k, win, m);
    }
    base = next_base;
    nb = next_nb;
    cur ^= 1;
  }
  while (qlen) step_queued();  // a lookup re-queued goes behind the others, its window in flight
}

// Lookups in rounds, without a branch on whether a lookup ends at its window (the batch-at-a-time,
// branch-free probing of Polychroniou, Raghavan & Ross, "Rethinking SIMD Vectorization for In-Memory
// Databases", SIGMOD 2015, with the group prefetching of grouped_find_w). Each iteration:
//   1. examines the first windows of a group of G lookups (prefetched an iteration ago) and emits every
//      one's answer as if it ended there (a miss when its window holds neither the key nor an EMPTY:
//      written again if a later window holds the key); the undecided ones are appended to a list by
//      index arithmetic (list[n] = j; n += undecided), not a branch;
//   2. prefetches their filter byte and next window;
//   3. runs one round over the list of the previous iteration (prefetched then): lookups whose filter
//      bit says a key like theirs went on examine their next window (again emitting, again appending
//      the undecided ones to the next list); the others are done, their miss already written.
// Why: with hits and misses mixed, or a table nearly full, whether a lookup ends at its window is a
// coin flip; in grouped_find_w that branch, the filter test and the FIFO's bookkeeping mispredicted
// often enough to make the loop compute-bound (a 0.3 MiB table, all in cache, took as long as a 71 MiB
// one). Measured (4M int64 keys, 2 threads, same process, grouped_find_w -> this loop), table of 4M
// keys at load 0.9: all hits 33.0 -> 29.1 ms, half 52.2 -> 35.2, all misses 44.1 -> 33.2; at 0.7:
// 19.9 -> 20.1, 28.7 -> 22.4, 34.1 -> 22.6; at 0.25 the same within 1%. In cache (64K keys) at 0.25
// the tighter first-window loop of grouped_find_w is ~10% faster, hence amac_find's choice.
// Returns how many lookups went past their first window.
template <int CW, class K, class V, class Emit>
int64_t batched_find_w(const Table<K, V>& t, const K* keys, int64_t b, int64_t e, int G, Emit&& emit) {
  using S = Slot<K, V>;
  constexpr int kMaxGroup = 64;
  constexpr int kCarry = 4 * kMaxGroup;  // carry list bound: each round shrinks what came in
  const int B = G < kMaxGroup ? G : kMaxGroup;
  const S* const slots = t.slots;
  const uint64_t nw = t.nw, seed = t.seed;
  uint64_t first[2][kMaxGroup], hashes[2][kMaxGroup];
  struct Pend { int64_t i; K k; Probe p; uint64_t visited; };
  Pend lists[2][kCarry + kMaxGroup];
  int nl[2] = {0, 0};  // the carry list (its lines prefetched a round ago) and the next one
  int64_t spills = 0;
  auto hash_group = [&](int64_t base, int nb, uint64_t* w, uint64_t* h) __attribute__((always_inline)) {
    hash_group_first(keys, base, nb, seed, nw, w, emit, h);
  };
  // The carry list: each lookup's previous window was full without the key; its filter byte and next
  // window were prefetched a round ago. Those whose filter bit says "a key like you went on" examine
  // the next window; undecided ones join `out` with the window after prefetched.
  Pend go[kCarry + kMaxGroup];
  // Both tests of a round are coin flips at high load, so neither is a branch (each mispredicted on
  // about every other long probe): the filter byte is read through a pointer that reads a byte of all
  // ones where the table has no filter, and the next window's prefetch goes to the window just read (in
  // L1) where the lookup ended there. Measured at load 0.9, half hits (same script, builds in turn):
  // 64K keys, 1 thread 16.2 -> 13.8 ns a lookup (all misses 14.2 -> 13.0); 4M keys, 2 threads 36 -> 31 ms.
  static const uint8_t kAllOverflowed = 0xff;
  const uint8_t* const ovf = t.ovf ? t.ovf : &kAllOverflowed;
  const uint64_t ovf_mask = t.ovf ? ~0ULL : 0;
  auto round = [&](Pend* in, int n, Pend* out, int& no) __attribute__((always_inline)) {
    int ng = 0;
    for (int x = 0; x < n; ++x) {
      const Pend& pd = in[x];
      const int on = (int)((load_relaxed(&ovf[pd.p.w & ovf_mask]) & pd.p.tag) != 0) & (int)(pd.visited + 1 < nw);
      go[ng] = pd;
      ng += on;
    }
    for (int x = 0; x < ng; ++x) {
      Pend pd = go[x];
      probe_next(pd.p, nw);
      ++pd.visited;
      const S* win = slots + pd.p.w * CW;
      uint32_t empty;
      const uint32_t m = window_masks<CW>(t, win, pd.k, empty);
      emit_from_window<CW>(emit, pd.i, pd.k, win, m);
      out[no] = pd;
      const int undecided = (m | empty) == 0;
      Probe after = pd.p;
      probe_next(after, nw);
      PK_PREFETCH_R(ovf + (pd.p.w & ovf_mask));
      PK_PREFETCH_R(slots + (undecided ? after.w : pd.p.w) * CW);
      no += undecided;
    }
  };
  int64_t base = b;
  int nb = (int)(e - b < B ? e - b : B), cur = 0, li = 0;
  if (nb > 0) hash_group(base, nb, first[cur], hashes[cur]);
  for (int j = 0; j < nb; ++j) PK_PREFETCH_R(slots + first[cur][j] * CW);
  while (nb > 0 || nl[li] > 0) {
    // a new group only while the carry list has room for its undecided lookups (in a nearly full
    // table they may stay undecided for many rounds); a round alone never lengthens the list
    const bool take = nb > 0 && nl[li] <= kCarry;
    Pend* out = lists[li ^ 1];
    int no = 0;
    int64_t next_base = base;
    int next_nb = nb;
    if (take) {
      next_base = base + nb;
      next_nb = (int)(e - next_base < B ? e - next_base : B);
      if (next_nb > 0) hash_group(next_base, next_nb, first[cur ^ 1], hashes[cur ^ 1]);
      uint8_t und[kMaxGroup];
      int nu = 0;
      for (int j = 0; j < nb; ++j) {
        const int64_t i = base + j;
        K k;
        const S* win;
        uint32_t m, empty;
        if (!first_window_of<CW>(t, slots, keys, i, first[cur][j], first[cur ^ 1], j, next_nb, emit, k, win, m,
                                 empty))
          continue;
        emit_from_window<CW>(emit, i, k, win, m);
        und[nu] = (uint8_t)j;
        nu += (m | empty) == 0;
      }
      // the group's undecided lookups: their probe, and their filter byte and next window prefetched
      for (int x = 0; x < nu; ++x) {
        Pend& pd = out[x];
        pd.i = base + und[x];
        pd.k = keys[pd.i];
        pd.p = probe_of_hash(hashes[cur][und[x]], nw);  // (hashed with the group)
        pd.visited = 0;
        prefetch_filter_and_next<CW>(t, slots, nw, pd.p);
      }
      no = nu;
      spills += nu;
    }
    round(lists[li], nl[li], out, no);
    nl[li] = 0;
    nl[li ^ 1] = no;
    li ^= 1;
    if (take) {
      base = next_base;
      nb = next_nb;
      cur ^= 1;
    }
  }
  return spills;
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


// ---- bulk inserts ---------------------------------------------------------------------------------
// The value of a key the table holds: a count's atomic add (other threads may add to it too), a map's
// store; a set has none.
template <int Mode, class K, class V>
__attribute__((always_inline)) inline void update_value(Slot<K, V>* slot, uint64_t v) {
  if constexpr (Table<K, V>::kHasVal) {
    if (Mode == M_ADD) __atomic_fetch_add(&slot->val, (V)v, __ATOMIC_RELAXED);
    else store_relaxed(&slot->val, (V)v);
  }
}

// The common case of an insert, without a branch per slot: the key's first window (one cache line,
// prefetched for writing) holds the key or an EMPTY slot. The same decisions as Table::ins_step: the
// first of "key" / "EMPTY" in slot order decides, and a new key takes the first free slot (TOMBSTONE or
// EMPTY) before that EMPTY; append mode takes the first free slot. Returns false with nothing written
// when the state machine must decide: the window holds neither, the load budget refuses, or another
// thread's CAS took the slot.
// Why masks: the window compared with one or two vector loads instead of W scalar loads measured 1.3-1.45x
// faster inserts (a standalone loop of 4M int64 inserts into 8M slots, 2 threads: 59 ms with four
// atomic scalar loads per window, 45 with AVX2, 41 with AVX-512): loads waiting on a line still in
// flight are few.
// `own` (append mode): set to the slots holding k itself, for a window that gave no free slot.
template <int Mode, int CW, class K, class V, class Finish>
inline bool insert_first_window(Table<K, V>& t, Slot<K, V>* win, K k, uint64_t v, int64_t i, Budget& budget,
                                int64_t& new_empty, Finish&& finish, uint32_t& own) {
  using T = Table<K, V>;
  uint32_t emp, tomb;
  const uint32_t hit = window_masks3<CW>(t, win, k, emp, tomb);
  own = hit;
  uint32_t limit = ~0u;  // the slots a new key may take: all (append), or those before the first EMPTY
  if (Mode != M_APPEND) {
    const uint32_t decide = hit | emp;
    if (!decide) return false;
    const uint32_t first = decide & (0u - decide);
    if (hit & first) {
      update_value<Mode>(&win[__builtin_ctz(first)], v);
      finish(i, ST_EXISTED);
      return true;
    }
    limit = (first << 1) - 1;  // up to and including the first EMPTY
  }
  const uint32_t freem = (emp | tomb) & limit;
  if (!freem) return false;
  const int j = __builtin_ctz(freem);
  const bool from_empty = (emp >> j) & 1;
  if (from_empty && !budget.take()) return false;
  if (!cas(&win[j].key, from_empty ? T::EMPTY : T::TOMB, k)) {
    if (from_empty) budget.put_back();
    return false;
  }
  if constexpr (T::kHasVal) {
    // counting: a free slot's value is 0 and other threads may add once the key is visible: add, not store
    if (Mode == M_ADD) __atomic_fetch_add(&win[j].val, (V)v, __ATOMIC_RELAXED);
    else store_relaxed(&win[j].val, (V)v);
  }
  new_empty += from_empty;
  finish(i, ST_NEW);
  return true;
}

// Bulk inserts as group prefetching with a FIFO for long probes, the scheme of grouped_find_w for
// the same reason: the first windows of the next G keys are hashed in one loop and prefetched for
// writing, one prefetch per insert examined, so G read-for-ownership misses are in flight without
// per-insert state to save; an insert its first window does not finish becomes a state machine
// (Table::InsState, one window per step) in a FIFO of about G, its next window prefetched when it was
// queued. Round-robin AMAC over all G inserts (insert_impl, still used for other window sizes) took
// 1.0-1.1x the time of this loop with the same scalar window scan; the vector compare above made the
// difference (4M int64 keys, 2 threads: 62 -> 46 ms into 8M slots, ~80 -> 61 ms at load 0.9).
// `hints` (append mode; may be null): this thread's AppendHints, so copies of a repeated key start where
// the last copy went.
template <int Mode, int CW, class K, class V, class ValOf, class Finish>
void grouped_insert_w(Table<K, V>& t, const K* keys, int64_t b, int64_t e, int G, Budget& budget,
                      int64_t& new_empty_out, ValOf&& val_of, Finish&& finish, AppendHints<K>* hints) {
  int64_t new_empty = 0;  // a local: the caller's counter may alias the slots' 64-bit stores (reloaded per insert)
  using St = typename Table<K, V>::InsState;
  using S = Slot<K, V>;
  constexpr int kMaxGroup = 64, kQueue = 128;  // the FIFO holds at most kMaxGroup + 1
  const int B = G < 1 ? 1 : (G < kMaxGroup ? G : kMaxGroup);
  // locals: the status stores (bytes) could alias the table's fields and force reloads of them
  S* const slots = t.slots;
  const uint64_t nw = t.nw, seed = t.seed;
  Probe first[2][kMaxGroup];
  St q[kQueue];
  int qhead = 0, qlen = 0;
  auto hash_group = [&](int64_t base, int nb, Probe* p) {
    for (int j = 0; j < nb; ++j) p[j] = probe_start((uint64_t)keys[base + j], seed, nw);
    emit_ahead(finish, base, nb);
    pk::prefetch_stream_range(keys, base, nb);  // as grouped_find_w's keys
  };
  // A map's upserts on one thread keep each key's last value: a row the main loop decides at its first
  // window by storing over its key, while earlier rows of that key are still queued (they would store
  // their older values after it), hands them its value (review finding: a queued row of k, a row before
  // it placing k in k's first window, a row after it finding k there at once; the queued one finished
  // last). Queued rows keep their order among themselves (one step each per turn of the FIFO). The FIFO
  // is searched only where `queued` shows a row of the same first window (see InFlightByWindow).
  constexpr bool kForward = Mode == M_UPSERT && Table<K, V>::kHasVal;
  InFlightByWindow queued;
  auto mark_queued = [&](const St& s, int d) __attribute__((always_inline)) {
    if constexpr (kForward) queued.add(s.p0.w, d);
  };
  uint64_t row_w = 0;  // the first window of the row the main loop decides
  auto done = [&](int64_t i, uint8_t st) __attribute__((always_inline)) {
    if constexpr (kForward) {
      if (st == ST_EXISTED && PK_UNLIKELY(queued.at(row_w))) {
        const K k = keys[i];
        const uint64_t v = val_of(i);
        for (int x = 0; x < qlen; ++x) {
          St& o = q[(qhead + x) % kQueue];
          if (o.k == k) o.v = v;  // (every queued row is an earlier one)
        }
      }
    }
    finish(i, st);
  };
  // One step of the oldest queued insert: its window was prefetched about G inserts ago.
  auto step_queued = [&]() __attribute__((always_inline)) {
    St& s = q[qhead];
    qhead = (qhead + 1) % kQueue;
    --qlen;
    if (!s.free_slot) {
      // no free slot met so far (no tombstone on the way): this window alone decides, as a first one
      if (s.mark_w) {
        t.mark_overflow(s.mark_w - 1, s.p.tag);
        s.mark_w = 0;
      }
      uint32_t own;
      if (insert_first_window<Mode, CW>(t, slots + s.p.w * CW, s.k, s.v, s.i, budget, new_empty, finish, own)) {
        mark_queued(s, -1);
        // append: true means a slot was taken here. Remembered where earlier copies are, or after a long
        // walk: copies of a key spread one per window (each window's other slots held by other keys) never
        // share a window, and walked ever further (quadratic; review finding). Distinct keys rarely walk
        // kLongWalk windows, so they seldom touch the cache.
        if (Mode == M_APPEND && hints && (own || s.visited >= AppendHints<K>::kLongWalk)) hints->remember(s);
        return;
      }
      if (Mode == M_APPEND && hints && own && hints->resume(s)) {
        // a repeated key whose window holds other keys: on from its last copy's window, prefetched
        t.prefetch_w(s.p.w);
        q[(qhead + qlen++) % kQueue] = s;
        return;
      }
    }
    uint8_t st;
    if (t.template ins_step<Mode>(s, st, budget, new_empty)) {
      if (Mode == M_APPEND && hints && st == ST_NEW) hints->remember(s);
      mark_queued(s, -1);
      finish(s.i, st);
    } else {
      q[(qhead + qlen++) % kQueue] = s;  // behind the others (never the slot just left: qlen < kQueue)
    }
  };
  int64_t base = b;
  int nb = (int)(e - b < B ? e - b : B), cur = 0;
  if (nb > 0) hash_group(base, nb, first[cur]);
  for (int j = 0; j < nb; ++j) PK_PREFETCH_W(slots + first[cur][j].w * CW);
  while (nb > 0) {
    const int64_t next_base = base + nb;
    const int next_nb = (int)(e - next_base < B ? e - next_base : B);
    if (next_nb > 0) hash_group(next_base, next_nb, first[cur ^ 1]);
    for (int j = 0; j < nb; ++j) {
      if (j < next_nb) PK_PREFETCH_W(slots + first[cur ^ 1][j].w * CW);  // spread out, as in grouped_find_w
      const int64_t i = base + j;
      const K k = keys[i];
      const uint64_t v = val_of(i);
      if (PK_UNLIKELY(is_special(k))) {
        finish(i, Mode == M_APPEND ? ST_SKIPPED : t.template insert_special<Mode>(k, v));
        continue;
      }
      const Probe p = first[cur][j];
      uint32_t own;
      row_w = p.w;
      if (PK_LIKELY((insert_first_window<Mode, CW>(t, slots + p.w * CW, k, v, i, budget, new_empty, done, own))))
        continue;
      St& s = q[(qhead + qlen) % kQueue];  // built in the FIFO's next slot: queued without a copy
      t.ins_begin(s, i, k, v, p, false);    // its window is in cache: this step costs no miss
      // a full window holding the key itself: a repeated key (distinct keys never look the hints up)
      // (its last copy's window is prefetched and examined when the FIFO reaches it: a synchronous
      // append there cost a DRAM latency per copy of a key whose copies are far apart)
      if (Mode == M_APPEND && hints && own && hints->resume(s)) {
        t.prefetch_w(s.p.w);
        ++qlen;
        while (qlen > B) step_queued();
        continue;
      }
      uint8_t st;
      if (t.template ins_step<Mode>(s, st, budget, new_empty)) {
        done(i, st);
        continue;
      }
      ++qlen;
      mark_queued(s, +1);
      // one step either finishes an insert or re-queues it: step until one finished (bounded FIFO)
      while (qlen > B) step_queued();
    }
    base = next_base;
    nb = next_nb;
    cur ^= 1;
  }
  while (qlen) step_queued();
  new_empty_out += new_empty;
}

// False (nothing done) where the window is not one cache line: the caller runs AMAC then.
template <int Mode, class K, class V, class ValOf, class Finish>
bool grouped_insert(Table<K, V>& t, const K* keys, int64_t b, int64_t e, int G, Budget& budget, int64_t& new_empty,
                    ValOf&& val_of, Finish&& finish, AppendHints<K>* hints) {
  constexpr int kLineSlots = 64 / (int)sizeof(Slot<K, V>);
  if (G <= 1 || t.W != kLineSlots || t.window_bytes != 64) return false;
  grouped_insert_w<Mode, kLineSlots>(t, keys, b, e, G, budget, new_empty, val_of, finish, hints);
  return true;
}

// Adds and upserts in a lean loop of their own, for the rows their first window decides: the first
// windows of the next G keys hashed and prefetched for writing (G: the insert's prefetch distance), then
// per row one compare of its window and, where it holds the key, an atomic add (a count) or a store of
// the value (a map; a set has nothing to do); else insert_first_window decides from one more read of
// the line (a new key into its first free slot before the first EMPTY, under the load budget). The
// general loop (grouped_insert_w) spent about twice the instructions per row: the full probe state,
// three masks for every row, the FIFO. Measured (4M int64 rows, 2 threads, same script in turn): counts
// of 64K distinct keys 23.5 -> 16 ms, of 1M distinct already in the table 21 -> 15, 1M distinct into an
// empty table (with clear() and items()) 33 -> 26-27.5; HashMap.insert of 4M keys it holds 34-38 ->
// 29-31.5 (inserts of new keys into a fresh table: unchanged, bound by the memory). Rows it does not
// decide (a full window without the key, a reserved key pattern, a refused budget or a lost CAS) are left
// for the general insert: their keys and positions go to rest_k / rest_i in input order, and their
// number is returned. One
// thread's rows keep their order per key in this loop: a window without the key and without an EMPTY
// slot stays without one during the call, so every row of such a key is left for the
// general insert, and a key its window decided once is decided there for every later row. -1 (nothing
// done) where the window is not one cache line or there is no vector compare (portable tier).
// new_keys / new_empty: as the insert counts them (keys placed; EMPTY slots taken).
template <int Mode, class K, class V>
int64_t lean_inserts(Table<K, V>& t, const K* keys, int64_t b, int64_t e, int G, const void* vals, StatusCode* codes,
                     Budget& budget, int64_t& new_keys, int64_t& new_empty, K* rest_k, int64_t* rest_i) {
  static_assert(Mode == M_ADD || Mode == M_UPSERT, "appends keep every row: no lean path");
  using S = Slot<K, V>;
  constexpr int CW = 64 / (int)sizeof(S);
  constexpr int kMaxGroup = 64;
  if (!kSimdLines || t.W != CW || t.window_bytes != 64) return -1;
  const int B = G < 8 ? 8 : (G < kMaxGroup ? G : kMaxGroup);
  S* const slots = t.slots;
  const uint64_t nw = t.nw, seed = t.seed;
  uint64_t first[2][kMaxGroup];
  auto hash_group = [&](int64_t base, int nb, uint64_t* w) __attribute__((always_inline)) {
    for (int j = 0; j < nb; ++j) w[j] = probe_first_window((uint64_t)keys[base + j], seed, nw);
  };
  // the row's status, and new keys counted (insert_first_window decides a row its window holds no
  // match for: a new key into the first free slot before the first EMPTY, under the load budget)
  auto finish = [codes, &new_keys](int64_t i, uint8_t st) __attribute__((always_inline)) {
    codes[i] = StatusCode(st);
    new_keys += st == ST_NEW;
  };
  int64_t left = 0;
  int nb = (int)std::min<int64_t>(B, e - b), cur = 0;
  if (nb > 0) hash_group(b, nb, first[cur]);
  for (int j = 0; j < nb; ++j) PK_PREFETCH_W(slots + first[cur][j] * CW);
  for (int64_t base = b; nb > 0;) {
    const int64_t next_base = base + nb;
    const int next_nb = (int)std::min<int64_t>(B, e - next_base);
    if (next_nb > 0) hash_group(next_base, next_nb, first[cur ^ 1]);
    for (int j = 0; j < nb; ++j) {
      if (j < next_nb) PK_PREFETCH_W(slots + first[cur ^ 1][j] * CW);  // spread out, as in grouped_find_w
      const int64_t i = base + j;
      const K k = keys[i];
      S* const win = slots + first[cur][j] * CW;
      const uint64_t v = insert_value<K, V>(Mode, vals, i);
      const uint32_t hit = is_special(k) ? 0u : line_hit(win, k);
      if (hit) {
        update_value<Mode>(&win[__builtin_ctz(hit)], v);
        codes[i] = StatusCode(ST_EXISTED);
      } else if (uint32_t own; is_special(k) || !insert_first_window<Mode, CW>(t, win, k, v, i, budget,
                                                                                  new_empty, finish, own)) {
        rest_k[left] = k;
        rest_i[left] = i;
        ++left;
      }
    }
    base = next_base;
    nb = next_nb;
    cur ^= 1;
  }
  return left;
}
