// pykernels._cuda_qgemm: bindings of the GPU quantized GEMMs (csrc/qgemm/qgemm.cu). No CUDA headers here:
// Python passes device pointers, sizes, dtype codes and the raw stream handle.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

namespace py = pybind11;

void pk_qgemm_wo(uintptr_t x, int xdt, int64_t M, int64_t K, uintptr_t w, int bits, uintptr_t scales,
                 uintptr_t offsets, int64_t N, int64_t group_size, uintptr_t y, uintptr_t stream);
void pk_qgemm_wo_mma(uintptr_t x, int xdt, int64_t M, int64_t K, uintptr_t w, int bits, uintptr_t scales,
                     uintptr_t offsets, int64_t N, int64_t group_size, uintptr_t bias, uintptr_t y, int rg,
                     bool pipe, uintptr_t stream);
void pk_qgemm_bitserial(uintptr_t x, int xdt, int64_t M, int64_t K, int act_bits, uintptr_t wplanes, int bits,
                        uintptr_t scales, uintptr_t offsets, uintptr_t wsum, int64_t N, int64_t group_size,
                        uintptr_t aplanes, uintptr_t usum, uintptr_t sa, uintptr_t ma, uintptr_t y, bool use_mma,
                        uintptr_t stream);

PYBIND11_MODULE(_cuda_qgemm, m) {
  m.doc() = "pykernels quantized GEMMs on GPUs (weight-only cp.async streaming kernel, bit-serial b1 MMA)";
  m.def("wo_gemm", [](uintptr_t x, int xdt, int64_t M, int64_t K, uintptr_t w, int bits, uintptr_t scales,
                      uintptr_t offsets, int64_t N, int64_t group_size, uintptr_t y, uintptr_t stream) {
    py::gil_scoped_release release;
    pk_qgemm_wo(x, xdt, M, K, w, bits, scales, offsets, N, group_size, y, stream);
  }, "y32[M,N] += x @ dequant(W).T (y32 zeroed by the caller; split-K partial sums meet with atomics)");
  m.def("wo_mma", [](uintptr_t x, int xdt, int64_t M, int64_t K, uintptr_t w, int bits, uintptr_t scales,
                     uintptr_t offsets, int64_t N, int64_t group_size, uintptr_t bias, uintptr_t y, int rg,
                     bool pipe, uintptr_t stream) {
    py::gil_scoped_release release;
    pk_qgemm_wo_mma(x, xdt, M, K, w, bits, scales, offsets, N, group_size, bias, y, rg, pipe, stream);
  }, "y[M,N] (x's dtype, written whole) = x @ dequant(W).T (+ bias fp32) on tensor cores: fp16/bf16 x, codes <= 4 bits");
  m.def("bitserial", [](uintptr_t x, int xdt, int64_t M, int64_t K, int act_bits, uintptr_t wplanes, int bits,
                        uintptr_t scales, uintptr_t offsets, uintptr_t wsum, int64_t N, int64_t group_size,
                        uintptr_t aplanes, uintptr_t usum, uintptr_t sa, uintptr_t ma, uintptr_t y, bool use_mma,
                        uintptr_t stream) {
    py::gil_scoped_release release;
    pk_qgemm_bitserial(x, xdt, M, K, act_bits, wplanes, bits, scales, offsets, wsum, N, group_size, aplanes, usum,
                       sa, ma, y, use_mma, stream);
  }, "bit-serial bipolar-INT GEMM on the GPU (use_mma: 1-bit tensor cores, sm_80+ CUDA builds)");
}
