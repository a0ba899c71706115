// RoPE around the attention kernels (rope.h): split rotates the fused projection's query and key heads into
// the (B, heads, T, D) rows the kernels read; merge takes the attention's gradients back to the projection's
// layout, rotated back, values copied. Each is one pass over the rows, where the same math in PyTorch ops
// runs about ten (casts, products, the concatenation, and the same again backward): docs/kernels.md#rope.
#include "../common/launch.cuh"
#include "../common/mma.cuh"
#include "rope.h"

namespace attn {
namespace {

constexpr int kPairs = 8;  // pairs per thread: a 16-byte load of 16-bit elements from each half of the row
constexpr int kThreads = 256;

template <class T>
struct alignas(16) Pack {
  T x[kPairs];
};

// A thread's pairs: position t of batch row b, head slot `head` of the row's heads, pairs pair0 .. +kPairs.
// The pairs vary fastest, so a warp reads whole rows.
struct Place {
  int64_t b, t;
  int head, pair0;
};

__device__ __forceinline__ bool place(const RopeParams& p, int heads, Place* at) {
  const int chunks = p.D / (2 * kPairs);
  const int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= static_cast<int64_t>(p.B) * p.T * heads * chunks) return false;
  at->pair0 = static_cast<int>(n % chunks) * kPairs;
  const int64_t row = n / chunks;
  at->head = static_cast<int>(row % heads);
  at->t = row / heads % p.T;
  at->b = row / heads / p.T;
  return true;
}

// (y1, y2) = (x1 cos - x2 sin, x1 sin + x2 cos) for the pairs (x1, x2) = (row[i], row[i + D/2]), in fp32;
// sign -1 rotates back by the same angle, which is the rotation's gradient (its transpose).
template <class T>
__device__ __forceinline__ void rotate(const T* x, T* y, int half, const float* cos, const float* sin, float sign) {
  const Pack<T> x1 = *reinterpret_cast<const Pack<T>*>(x), x2 = *reinterpret_cast<const Pack<T>*>(x + half);
  float c[kPairs], s[kPairs];
  *reinterpret_cast<float4*>(c) = reinterpret_cast<const float4*>(cos)[0];
  *reinterpret_cast<float4*>(c + 4) = reinterpret_cast<const float4*>(cos)[1];
  *reinterpret_cast<float4*>(s) = reinterpret_cast<const float4*>(sin)[0];
  *reinterpret_cast<float4*>(s + 4) = reinterpret_cast<const float4*>(sin)[1];
  Pack<T> y1, y2;
#pragma unroll
  for (int i = 0; i < kPairs; ++i) {
    const float a = Elem<T>::to_float(x1.x[i]), b = Elem<T>::to_float(x2.x[i]), si = sign * s[i];
    y1.x[i] = Elem<T>::from_float(a * c[i] - b * si);
    y2.x[i] = Elem<T>::from_float(a * si + b * c[i]);
  }
  *reinterpret_cast<Pack<T>*>(y) = y1;
  *reinterpret_cast<Pack<T>*>(y + half) = y2;
}

template <class T>
__global__ void __launch_bounds__(kThreads) rope_split_kernel(RopeParams p) {
  Place at;
  if (!place(p, p.H + p.Hkv, &at)) return;
  const int half = p.D / 2;
  const bool query = at.head < p.H;
  const int64_t head = query ? at.head : at.head - p.H, heads = query ? p.H : p.Hkv;
  const T* x = static_cast<const T*>(p.qkv) + at.b * p.qkv_sb + at.t * p.qkv_st + int64_t{at.head} * p.D;
  T* y = static_cast<T*>(query ? p.q : p.k) + ((at.b * heads + head) * p.T + at.t) * p.D;
  const int64_t table = at.t * half + at.pair0;
  rotate(x + at.pair0, y + at.pair0, half, p.cos + table, p.sin + table, 1.f);
}

template <class T>
__global__ void __launch_bounds__(kThreads) rope_merge_kernel(RopeParams p) {
  Place at;
  if (!place(p, p.H + 2 * p.Hkv, &at)) return;
  const int half = p.D / 2;
  T* y = static_cast<T*>(p.qkv) + at.b * p.qkv_sb + at.t * p.qkv_st + int64_t{at.head} * p.D + at.pair0;
  if (at.head >= p.H + p.Hkv) {  // a value head: not rotated
    const T* x = static_cast<const T*>(p.v) + p.vs.offset(at.b, at.head - p.H - p.Hkv) + at.t * p.vs.i + at.pair0;
    *reinterpret_cast<Pack<T>*>(y) = *reinterpret_cast<const Pack<T>*>(x);
    *reinterpret_cast<Pack<T>*>(y + half) = *reinterpret_cast<const Pack<T>*>(x + half);
    return;
  }
  const T* x = at.head < p.H
                   ? static_cast<const T*>(p.q) + p.qs.offset(at.b, at.head) + at.t * p.qs.i
                   : static_cast<const T*>(p.k) + p.ks.offset(at.b, at.head - p.H) + at.t * p.ks.i;
  const int64_t table = at.t * half + at.pair0;
  rotate(x + at.pair0, y, half, p.cos + table, p.sin + table, -1.f);
}

template <class Kernel>
cudaError_t run(Dtype dtype, const RopeParams& p, int heads, Kernel kernel_of, cudaStream_t stream) {
  if (p.D % (2 * kPairs)) return cudaErrorInvalidValue;
  const int64_t threads = static_cast<int64_t>(p.B) * p.T * heads * (p.D / (2 * kPairs));
  return by_dtype(dtype, [&](auto tag) {
    return launch(kernel_of(tag), (threads + kThreads - 1) / kThreads, kThreads, 0, p, stream);
  });
}

}  // namespace

cudaError_t run_rope_split(Dtype dtype, const RopeParams& p, cudaStream_t stream) {
  return run(dtype, p, p.H + p.Hkv, [](auto tag) { return rope_split_kernel<decltype(tag)>; }, stream);
}

cudaError_t run_rope_merge(Dtype dtype, const RopeParams& p, cudaStream_t stream) {
  return run(dtype, p, p.H + 2 * p.Hkv, [](auto tag) { return rope_merge_kernel<decltype(tag)>; }, stream);
}

}  // namespace attn
