// pykernels._cuda_sort: the Onesweep GPU radix sort (csrc/sort/sort.cu). No CUDA headers here: the .cu
// side exposes plain functions taking device pointers and the stream handle as integers.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

namespace py = pybind11;

size_t pk_sort_temp_bytes(int64_t n, int key_bytes, int val_bytes, int begin_bit, int end_bit, int bin_items,
                          const std::string& op);
int pk_sort_tile_keys(int bin_items);
int pk_sort_device_count(std::string* why);
void pk_sort_onesweep(uintptr_t keys_in, uintptr_t keys_out, uintptr_t vals_in, uintptr_t vals_out, int64_t n,
                      int key_bytes, int val_bytes, int begin_bit, int end_bit, uintptr_t temp, size_t temp_bytes,
                      uintptr_t stream, int bin_items, int hist_threads, int64_t hist_keys_per_block,
                      int rank, const std::string& op);

// The config defaults are the kernels' untuned constants (SortConfig in sort.cu); `op` names the Python op
// in error messages. Bad configs raise ValueError (std::invalid_argument) without touching the GPU.
PYBIND11_MODULE(_cuda_sort, m) {
  m.doc() = "pykernels Onesweep LSD radix sort on CUDA/HIP (unsigned 32/64-bit keys, 4/8-byte payloads)";
  m.def("device_count", [] {
    std::string why;
    int n = pk_sort_device_count(&why);
    return py::make_tuple(n, why);
  });
  m.def("tile_keys", &pk_sort_tile_keys, py::arg("bin_items") = 15, "keys per binning tile (256 * bin_items)");
  m.def("temp_bytes", &pk_sort_temp_bytes, py::arg("n"), py::arg("key_bytes"), py::arg("val_bytes"),
        py::arg("begin_bit"), py::arg("end_bit"), py::arg("bin_items") = 15, py::arg("op") = "sort",
        "bytes of device scratch a sort of n keys needs (the tile status words depend on bin_items)");
  m.def("onesweep", [](uintptr_t ki, uintptr_t ko, uintptr_t vi, uintptr_t vo, int64_t n, int kb, int vb, int b, int e,
                       uintptr_t temp, size_t temp_bytes, uintptr_t stream, int bin_items, int hist_threads,
                       int64_t hist_keys_per_block, int rank, const std::string& op) {
    py::gil_scoped_release release;
    pk_sort_onesweep(ki, ko, vi, vo, n, kb, vb, b, e, temp, temp_bytes, stream, bin_items, hist_threads,
                     hist_keys_per_block, rank, op);
  }, py::arg("keys_in"), py::arg("keys_out"), py::arg("vals_in"), py::arg("vals_out"), py::arg("n"),
     py::arg("key_bytes"), py::arg("val_bytes"), py::arg("begin_bit"), py::arg("end_bit"), py::arg("temp"),
     py::arg("temp_bytes"), py::arg("stream"), py::arg("bin_items") = 15, py::arg("hist_threads") = 512,
     py::arg("hist_keys_per_block") = 1 << 15, py::arg("rank") = 0, py::arg("op") = "sort",
     "Stable LSD sort of unsigned keys (ascending) on bits [begin_bit, end_bit), payload moved along");
}
