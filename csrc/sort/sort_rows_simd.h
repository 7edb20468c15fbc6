// Short rows of equal length sorted side by side, one row per SIMD lane (included once per SIMD tier by
// sort_cpu.cpp, inside that tier's namespace and target pragma, with kVecBytes defined: no include guard).
//
// Why: a row of L <= 64 keys sorted on its own (sort_short_segment) is a chain of dependent compares, and
// its fixed costs (encode, pack, unpack, emit) are paid per row: 4-14 ns per key for rows of 4-64 keys on
// Zen 2. A sorting network does the same compare-exchanges whatever the data, so NV rows can run it at
// once, lane v of every vector holding row v: NV (4-8) rows for the price of one, with no shuffles (the
// "column-major" data-parallel form of a network; the classic GPU way of sorting many small arrays, and
// the transposed layout of Chhugani et al., VLDB 2008). The rows of a tensor sorted along a dim other
// than the last are such columns already (element k of rows j..j+NV-1 is contiguous), so those sort in
// place of the two transposes a last-dim sort needed around them.
//
// The network is Batcher's odd-even merge sort (1968) for the power of two N >= L, keeping only the
// comparators whose both wires are below L: the wires at and above L would hold +inf padding, which
// a min/max comparator never moves, so the comparators that touch them are no-ops (row_network).
// Stability: every key is packed with its position k (or compared with it on a tie), so the keys are
// distinct and any network's result is the unique stable order.
// Lanes: keys of 1-2 bytes pack as (key << 16 | k) into 32-bit lanes (unsigned min/max: NV = 8 on AVX2);
// 4-byte keys as (key << 32 | k) into 64-bit lanes (signed compare after flipping the top bit, NV = 4);
// 8-byte keys compare (key, k) pairs of 64-bit lanes lexicographically (NV = 4).

typedef uint32_t VU32 __attribute__((vector_size(kVecBytes)));
typedef int64_t VI64 __attribute__((vector_size(kVecBytes)));
static constexpr int kLanes32 = kVecBytes / 4, kLanes64 = kVecBytes / 8;

template <class U>
struct RowLanes {
  static constexpr int NV = sizeof(U) <= 2 ? kLanes32 : kLanes64;
};

// Sorts nv (<= RowLanes<U>::NV) rows of L keys: row v's key k at keys[base[v] + k * ks]; its outputs at
// the same offsets of out_keys / out_idx (k's source position) / out_pay. Unused lanes repeat row 0.
template <class U, Enc E>
__attribute__((always_inline)) inline void sort_row_lanes(const SegArgs& g, const Coder<U, E>& cd,
                                                          const int64_t* base, int nv, int L, int64_t ks,
                                                          const RowNetwork& net) {
  constexpr int NV = RowLanes<U>::NV;
  const U* in = static_cast<const U*>(g.keys);
  const uint16_t* const na = net.a.data();
  const uint16_t* const nb = net.b.data();
  const int ncmp = (int)net.a.size();
  int64_t b[NV];
  for (int v = 0; v < NV; ++v) b[v] = base[v < nv ? v : 0];
  if constexpr (sizeof(U) <= 2) {
    VU32 w[ROW_NET_MAX];
    for (int k = 0; k < L; ++k)
      for (int v = 0; v < NV; ++v) w[k][v] = (uint32_t)cd.enc(in[b[v] + k * ks]) << 16 | (uint32_t)k;
    for (int c = 0; c < ncmp; ++c) {
      const VU32 x = w[na[c]], y = w[nb[c]];
      w[na[c]] = x < y ? x : y;
      w[nb[c]] = x < y ? y : x;
    }
    emit_row_lanes<U, NV>(g, b, nv, L, ks, [&](int k, int64_t* p) {
      for (int v = 0; v < NV; ++v) p[v] = w[k][v] & 0xFFFF;
    });
  } else if constexpr (sizeof(U) == 4) {
    VI64 w[ROW_NET_MAX];
    for (int k = 0; k < L; ++k)
      for (int v = 0; v < NV; ++v)
        w[k][v] = (int64_t)(((uint64_t)cd.enc(in[b[v] + k * ks]) << 32 | (uint64_t)k) ^ (uint64_t(1) << 63));
    for (int c = 0; c < ncmp; ++c) {
      const VI64 x = w[na[c]], y = w[nb[c]];
      const VI64 gt = x > y;
      w[na[c]] = gt ? y : x;
      w[nb[c]] = gt ? x : y;
    }
    emit_row_lanes<U, NV>(g, b, nv, L, ks, [&](int k, int64_t* p) {
      for (int v = 0; v < NV; ++v) p[v] = w[k][v] & 0xFFFFFFFF;
    });
  } else {
    VI64 key[ROW_NET_MAX], pos[ROW_NET_MAX];
    for (int k = 0; k < L; ++k)
      for (int v = 0; v < NV; ++v) {
        key[k][v] = (int64_t)((uint64_t)cd.enc(in[b[v] + k * ks]) ^ (uint64_t(1) << 63));
        pos[k][v] = k;
      }
    for (int c = 0; c < ncmp; ++c) {
      const int ia = na[c], ib = nb[c];
      const VI64 xk = key[ia], yk = key[ib], xp = pos[ia], yp = pos[ib];
      const VI64 gt = (xk > yk) | ((xk == yk) & (xp > yp));
      key[ia] = gt ? yk : xk;
      key[ib] = gt ? xk : yk;
      pos[ia] = gt ? yp : xp;
      pos[ib] = gt ? xp : yp;
    }
    emit_row_lanes<U, NV>(g, b, nv, L, ks, [&](int k, int64_t* p) {
      for (int v = 0; v < NV; ++v) p[v] = pos[k][v];
    });
  }
}

// The sort of nv rows for this tier, as sort_row_lanes (the entry point the tier dispatch calls).
template <class U, Enc E>
void sort_rows_tier(const SegArgs& g, const Coder<U, E>& cd, const int64_t* base, int nv, int L, int64_t ks,
                    const RowNetwork& net) {
  sort_row_lanes<U, E>(g, cd, base, nv, L, ks, net);
}
