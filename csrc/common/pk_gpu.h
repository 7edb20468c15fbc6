// CUDA/HIP portability: the same .cu sources build with nvcc (sm_80/sm_90) and with hipcc for AMD
// (gfx90a, PYKERNELS_BUILD_HIP=1). Kernels use the pk names below, never cuda*/hip* directly for the
// few things that differ, and never assume 32 lanes: AMD wavefronts have 64 (PK_WARP_SIZE).
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>

#if defined(__HIP__) || defined(__HIP_PLATFORM_AMD__) || defined(PK_BUILD_HIP)
#define PK_HIP 1
#include <hip/hip_runtime.h>
// The kernels' ballots, lane masks and warp-level ranking take 64 lanes; on a wave32 target (RDNA:
// gfx10/gfx11, where HIP refuses -mwavefrontsize64) they would compile and give wrong sorts and probes
// (audit): refused at build time.
// (__AMDGCN_WAVEFRONT_SIZE is deprecated and gone from newer LLVM: the RDNA families' own macros too)
#if defined(__HIP_DEVICE_COMPILE__) && ((defined(__AMDGCN_WAVEFRONT_SIZE) && __AMDGCN_WAVEFRONT_SIZE != 64) || \
                                        defined(__GFX10__) || defined(__GFX11__) || defined(__GFX12__))
#error "pykernels: the HIP kernels need 64-lane wavefronts (CDNA: gfx90a, gfx94x); wave32 GPUs (RDNA) are not supported: set PYKERNELS_HIP_ARCHS to CDNA targets"
#endif
#define PK_WARP_SIZE 64
typedef uint64_t pk_lane_mask_t;  // ballots are 64-bit on a 64-lane wavefront
typedef hipStream_t pk_stream_t;
typedef hipError_t pk_error_t;
#define pk_success hipSuccess
#define pkGetDeviceCount hipGetDeviceCount
#define pkGetErrorString hipGetErrorString
#define pkGetLastError hipGetLastError
#define pkMalloc hipMalloc
#define pkMallocAsync hipMallocAsync
#define pkFree hipFree
#define pkFreeAsync hipFreeAsync
#define pkMemsetAsync hipMemsetAsync
#define pkMemcpyAsync hipMemcpyAsync
#define pkMemcpyDeviceToHost hipMemcpyDeviceToHost
#define pkMemcpyHostToDevice hipMemcpyHostToDevice
#define pkMemcpyDeviceToDevice hipMemcpyDeviceToDevice
#define pkStreamSynchronize hipStreamSynchronize
#define pkDeviceGetAttribute hipDeviceGetAttribute
#define pkDevAttrMultiProcessorCount hipDeviceAttributeMultiprocessorCount
#define pkGetDevice hipGetDevice
#define pkSetDevice hipSetDevice
#define pkPointerGetAttributes hipPointerGetAttributes
typedef hipPointerAttribute_t pk_pointer_attributes_t;
__device__ __forceinline__ pk_lane_mask_t pk_ballot(bool p) { return __ballot(p); }
__device__ __forceinline__ int pk_popc_mask(pk_lane_mask_t m) { return __popcll(m); }
__device__ __forceinline__ pk_lane_mask_t pk_lanemask_lt() {
  const unsigned lane = __lane_id();
  return (lane == 0) ? 0ull : (~0ull >> (64 - lane));
}
#define PK_SYNCWARP() __builtin_amdgcn_wave_barrier()
#define PK_SHFL(v, src) __shfl((v), (src))
#else
#define PK_HIP 0
#include <cuda_runtime.h>
#define PK_WARP_SIZE 32
typedef uint32_t pk_lane_mask_t;
typedef cudaStream_t pk_stream_t;
typedef cudaError_t pk_error_t;
#define pk_success cudaSuccess
#define pkGetDeviceCount cudaGetDeviceCount
#define pkGetErrorString cudaGetErrorString
#define pkGetLastError cudaGetLastError
#define pkMalloc cudaMalloc
#define pkMallocAsync cudaMallocAsync
#define pkFree cudaFree
#define pkFreeAsync cudaFreeAsync
#define pkMemsetAsync cudaMemsetAsync
#define pkMemcpyAsync cudaMemcpyAsync
#define pkMemcpyDeviceToHost cudaMemcpyDeviceToHost
#define pkMemcpyHostToDevice cudaMemcpyHostToDevice
#define pkMemcpyDeviceToDevice cudaMemcpyDeviceToDevice
#define pkStreamSynchronize cudaStreamSynchronize
#define pkDeviceGetAttribute cudaDeviceGetAttribute
#define pkDevAttrMultiProcessorCount cudaDevAttrMultiProcessorCount
#define pkGetDevice cudaGetDevice
#define pkSetDevice cudaSetDevice
#define pkPointerGetAttributes cudaPointerGetAttributes
typedef cudaPointerAttributes pk_pointer_attributes_t;
#ifdef __CUDACC__
__device__ __forceinline__ pk_lane_mask_t pk_ballot(bool p) { return __ballot_sync(0xffffffffu, p); }
__device__ __forceinline__ int pk_popc_mask(pk_lane_mask_t m) { return __popc(m); }
__device__ __forceinline__ pk_lane_mask_t pk_lanemask_lt() {
  pk_lane_mask_t m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}
#define PK_SYNCWARP() __syncwarp()
#define PK_SHFL(v, src) __shfl_sync(0xffffffffu, (v), (src))
#endif
#endif

namespace pk {

// Host-side error check: turns any CUDA/HIP error into std::runtime_error("pykernels.<op>: ...").
// "no CUDA device" (no driver, or no GPU) becomes a clean Python RuntimeError through pybind11.
#define PK_GPU_CHECK(op, expr)                                                             \
  do {                                                                                     \
    pk_error_t pk_err__ = (expr);                                                          \
    if (pk_err__ != pk_success)                                                            \
      throw std::runtime_error(std::string("pykernels.") + (op) + ": GPU error: " +        \
                               pkGetErrorString(pk_err__) + " (" #expr ")");               \
  } while (0)

// Number of usable devices; 0 when there is no driver or no GPU (the error string goes to `why`).
inline int gpu_device_count(std::string* why) {
  int n = 0;
  pk_error_t err = pkGetDeviceCount(&n);
  if (err != pk_success) {
    if (why) *why = pkGetErrorString(err);
    (void)pkGetLastError();  // clear the sticky error so later calls report their own
    return 0;
  }
  if (n == 0 && why) *why = "no CUDA device";
  return n;
}

inline void require_gpu(const char* op) {
  std::string why;
  if (gpu_device_count(&why) == 0)
    throw std::runtime_error(std::string("pykernels.") + op + ": no CUDA device (" + why + ")");
}

// The scope of one entry point: a GPU must exist ("no CUDA device" otherwise), and the device that
// holds `data` (one of the call's tensors) is the current one until the scope ends. Kernels launch on
// the calling thread's current device, and torch does not make a tensor's device current for us (it
// guards its own ops): a tensor on cuda:1 with cuda:0 current would meet a stream of another device.
class GpuScope {
 public:
  GpuScope(const char* op, uintptr_t data) {
    require_gpu(op);
    if (!data) return;
    pk_pointer_attributes_t attr{};
    if (pkPointerGetAttributes(&attr, reinterpret_cast<const void*>(data)) != pk_success) {
      (void)pkGetLastError();  // not a device pointer this runtime knows: leave the device as it is
      return;
    }
    int current = 0;
    PK_GPU_CHECK(op, pkGetDevice(&current));
    if (attr.device >= 0 && attr.device != current) {
      PK_GPU_CHECK(op, pkSetDevice(attr.device));
      previous_ = current;
    }
  }
  ~GpuScope() {
    if (previous_ >= 0) (void)pkSetDevice(previous_);
  }
  GpuScope(const GpuScope&) = delete;
  GpuScope& operator=(const GpuScope&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace pk
