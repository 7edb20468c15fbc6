// pykernels._cuda_hash: Python bindings of the GPU hash tables (hash.cu). Same functions and
// arguments as the CPU module (_cpu_hash), plus the stream handle last; `nthreads`/`prefetch` are
// accepted and ignored so the Python side calls both modules alike.
#include <pybind11/pybind11.h>

#include <cstdint>

namespace py = pybind11;

void pk_hash_insert(uintptr_t slots, uintptr_t special, uint64_t nw, int W, uint64_t seed, int kb, int vb,
                    uintptr_t keys, uintptr_t vals, int64_t n, uintptr_t status, int mode, int64_t used_now,
                    int64_t limit, uintptr_t stream, long long out[3]);
void pk_hash_find(uintptr_t slots, uintptr_t special, uint64_t nw, int W, uint64_t seed, int kb, int vb,
                  uintptr_t keys, int64_t n, uintptr_t out_vals, uintptr_t found, uint64_t dflt, uintptr_t stream);
int64_t pk_hash_erase(uintptr_t slots, uintptr_t special, uint64_t nw, int W, uint64_t seed, int kb, int vb,
                      uintptr_t keys, int64_t n, uintptr_t out, bool multi, bool zero_val, uintptr_t stream);
void pk_hash_multi_walk(uintptr_t slots, uint64_t nw, int W, uint64_t seed, int kb, int vb, uintptr_t keys,
                        int64_t n, uintptr_t counts, uintptr_t offsets, uintptr_t vals_out, uintptr_t stream);
int64_t pk_hash_items(uintptr_t slots, uint64_t nw, int W, int kb, int vb, uintptr_t keys_out, uintptr_t vals_out,
                      int64_t max_out, uintptr_t stream);
int64_t pk_hash_rehash(uintptr_t src, uint64_t src_nw, uintptr_t dst, uintptr_t dst_special, uint64_t dst_nw, int W,
                       uint64_t seed, int kb, int vb, uintptr_t stream);
void pk_hash_bloom_add(uintptr_t words, uint64_t nblocks, int k, uint64_t seed, uintptr_t keys, int64_t n,
                       uintptr_t stream);
void pk_hash_bloom_contains(uintptr_t words, uint64_t nblocks, int k, uint64_t seed, uintptr_t keys, int64_t n,
                            uintptr_t out, uintptr_t stream);

PYBIND11_MODULE(_cuda_hash, m) {
  m.doc() = "pykernels GPU hash tables (WarpCore: cooperative probing groups, double hashing, CAS)";
  m.def("insert", [](uintptr_t slots, uintptr_t special, uint64_t nw, int W, uint64_t seed, int kb, int vb,
                     uintptr_t keys, uintptr_t vals, int64_t n, uintptr_t status, int mode, int64_t used_now,
                     int64_t limit, int /*nthreads*/, int /*prefetch*/, uintptr_t stream) {
    long long out[3];
    {
      py::gil_scoped_release release;
      pk_hash_insert(slots, special, nw, W, seed, kb, vb, keys, vals, n, status, mode, used_now, limit, stream, out);
    }
    return py::make_tuple(out[0], out[1], out[2]);
  });
  m.def("find", [](uintptr_t slots, uintptr_t special, uint64_t nw, int W, uint64_t seed, int kb, int vb,
                   uintptr_t keys, int64_t n, uintptr_t out_vals, uintptr_t found, uint64_t dflt, int, int,
                   uintptr_t stream) {
    py::gil_scoped_release release;
    pk_hash_find(slots, special, nw, W, seed, kb, vb, keys, n, out_vals, found, dflt, stream);
  });
  m.def("erase", [](uintptr_t slots, uintptr_t special, uint64_t nw, int W, uint64_t seed, int kb, int vb,
                    uintptr_t keys, int64_t n, uintptr_t out, bool multi, bool zero_val, int, int, uintptr_t stream) {
    py::gil_scoped_release release;
    return pk_hash_erase(slots, special, nw, W, seed, kb, vb, keys, n, out, multi, zero_val, stream);
  });
  m.def("multi_walk", [](uintptr_t slots, uintptr_t /*special*/, uint64_t nw, int W, uint64_t seed, int kb, int vb,
                         uintptr_t keys, int64_t n, uintptr_t counts, uintptr_t offsets, uintptr_t vals_out, int, int,
                         uintptr_t stream) {
    py::gil_scoped_release release;
    pk_hash_multi_walk(slots, nw, W, seed, kb, vb, keys, n, counts, offsets, vals_out, stream);
  });
  m.def("items", [](uintptr_t slots, uint64_t nw, int W, int kb, int vb, uintptr_t keys_out, uintptr_t vals_out,
                    int64_t max_out, int, uintptr_t stream) {
    py::gil_scoped_release release;
    return pk_hash_items(slots, nw, W, kb, vb, keys_out, vals_out, max_out, stream);
  });
  m.def("rehash", [](uintptr_t src, uint64_t src_nw, uintptr_t dst, uintptr_t dst_special, uint64_t dst_nw, int W,
                     uint64_t seed, int kb, int vb, int, int, uintptr_t stream) {
    py::gil_scoped_release release;
    return pk_hash_rehash(src, src_nw, dst, dst_special, dst_nw, W, seed, kb, vb, stream);
  });
  m.def("bloom_add", [](uintptr_t words, uint64_t nblocks, int k, uint64_t seed, uintptr_t keys, int64_t n, int,
                        uintptr_t stream) {
    py::gil_scoped_release release;
    pk_hash_bloom_add(words, nblocks, k, seed, keys, n, stream);
  });
  m.def("bloom_contains", [](uintptr_t words, uint64_t nblocks, int k, uint64_t seed, uintptr_t keys, int64_t n,
                             uintptr_t out, int, uintptr_t stream) {
    py::gil_scoped_release release;
    pk_hash_bloom_contains(words, nblocks, k, seed, keys, n, out, stream);
  });
}
