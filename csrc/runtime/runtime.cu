// GPU runtime probes shared by every op family: device count, and a clean "no CUDA device" error.
// Built with nvcc (sm_80/sm_90) or hipcc (gfx90a) through pk_gpu.h.
#include <string>

#include "pk_gpu.h"

namespace {
// Smallest kernel that proves the module's device code loads: out[i] = value.
__global__ void fill_u32_kernel(uint32_t* out, int64_t n, uint32_t value) {
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = value;
}
}  // namespace

int pk_runtime_device_count(std::string* why) { return pk::gpu_device_count(why); }

void pk_runtime_fill_u32(uintptr_t out, int64_t n, uint32_t value, uintptr_t stream) {
  const pk::GpuScope gpu_scope("runtime.fill_u32", out);
  if (n <= 0) return;
  const int threads = 256;
  const int64_t blocks = (n + threads - 1) / threads;
  fill_u32_kernel<<<(unsigned)blocks, threads, 0, (pk_stream_t)stream>>>((uint32_t*)out, n, value);
  PK_GPU_CHECK("runtime.fill_u32", pkGetLastError());
}
