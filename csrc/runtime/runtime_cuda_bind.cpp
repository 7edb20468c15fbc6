// pykernels._cuda_runtime: device count and a minimal kernel launch. No CUDA headers here: the .cu
// side exposes plain functions taking pointers and stream handles as integers.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

namespace py = pybind11;

int pk_runtime_device_count(std::string* why);
void pk_runtime_fill_u32(uintptr_t out, int64_t n, uint32_t value, uintptr_t stream);

PYBIND11_MODULE(_cuda_runtime, m) {
  m.doc() = "pykernels GPU runtime probes (CUDA runtime linked statically)";
  m.def("device_count", [] {
    std::string why;
    int n = pk_runtime_device_count(&why);
    return py::make_tuple(n, why);
  }, "(number of GPUs, reason when 0): never raises, also without a driver");
  m.def("fill_u32", [](uintptr_t out, int64_t n, uint32_t value, uintptr_t stream) {
    py::gil_scoped_release release;
    pk_runtime_fill_u32(out, n, value, stream);
  }, py::arg("out"), py::arg("n"), py::arg("value"), py::arg("stream"),
     "out[i] = value on the GPU; RuntimeError 'no CUDA device' without one");
}
