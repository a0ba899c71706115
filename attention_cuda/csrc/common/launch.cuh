// Host-side pieces every launcher uses: grid arithmetic, the Dtype of an element type and back, and the launch.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "params.h"

namespace attn {

__host__ __device__ __forceinline__ int cdiv(int a, int b) { return (a + b - 1) / b; }

template <class T>
constexpr Dtype dtype_of() {
  return sizeof(T) == 4 ? Dtype::kF32 : std::is_same_v<T, __half> ? Dtype::kF16 : Dtype::kBF16;
}

// f(T{}) for the element type T of dtype: a launcher's choice of instantiation.
template <class F>
cudaError_t by_dtype(Dtype dtype, F&& f) {
  switch (dtype) {
    case Dtype::kF16: return f(__half{});
    case Dtype::kBF16: return f(__nv_bfloat16{});
    case Dtype::kF32: return f(float{});
  }
  return cudaErrorInvalidValue;
}

// Launch kernel(p) on `blocks` CTAs (at most 2^31 - 1; a 1-D grid unless one is given) with `smem` bytes
// of dynamic shared memory, on `stream`; an empty grid is a no-op.
template <class Kernel, class P>
cudaError_t launch(Kernel kernel, dim3 grid, int64_t blocks, int threads, int smem, const P& p, cudaStream_t stream) {
  if (blocks == 0) return cudaSuccess;
  if (blocks > INT32_MAX) return cudaErrorInvalidConfiguration;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  kernel<<<grid, threads, smem, stream>>>(p);
  return cudaGetLastError();
}
template <class Kernel, class P>
cudaError_t launch(Kernel kernel, int64_t blocks, int threads, int smem, const P& p, cudaStream_t stream) {
  return launch(kernel, dim3(static_cast<unsigned>(blocks)), blocks, threads, smem, p, stream);
}

}  // namespace attn
