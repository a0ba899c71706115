// Row-wise passes around the attention kernels: 1/|row| of q and k, delta = rowsum(dO * O) for the
// backward, and the dQ epilogue. One warp per row, two elements per lane per step.
#include "mma.cuh"
#include "params.h"

namespace attn {
namespace {

constexpr int kRowsPerBlock = 8;

template <class T>
__device__ __forceinline__ float2 ldg_pair(const T* p) {
  if constexpr (sizeof(T) == 2) {
    return Elem<T>::unpack(*reinterpret_cast<const uint32_t*>(p));
  } else {
    return *reinterpret_cast<const float2*>(p);
  }
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

__device__ __forceinline__ int64_t warp_row() {
  return static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
}

template <class T>
__global__ void row_rnorm_kernel(const T* x, int64_t sb, int64_t sh, int64_t si, int H, int N, int D, int n_pad,
                                 int64_t rows, float* out) {
  const int64_t r = warp_row();
  if (r >= rows) return;
  const int i = r % n_pad, bh = r / n_pad, lane = threadIdx.x % 32;
  float ss = 0.f;
  if (i < N) {
    const T* row = x + (bh / H) * sb + (bh % H) * sh + i * si;
    for (int d = 2 * lane; d < D; d += 64) {
      const float2 v = ldg_pair(row + d);
      ss += v.x * v.x + v.y * v.y;
    }
  }
  ss = warp_sum(ss);
  if (lane == 0) out[r] = i < N ? 1.f / fmaxf(sqrtf(ss), kNormEps) : 0.f;
}

template <class T>
__global__ void delta_kernel(const Params p, int D, int64_t rows) {
  const int64_t r = warp_row();
  if (r >= rows) return;
  const int t = r % p.i_pad, bh = r / p.i_pad, lane = threadIdx.x % 32;
  float acc = 0.f;
  if (t < p.I && p.normalize) {
    const int64_t off = (static_cast<int64_t>(bh) * p.I + t) * D;
    const T* o = static_cast<const T*>(p.o) + off;
    const T* dout = static_cast<const T*>(p.dout) + off;
    // dO as the tensor cores see it in dP = dO V^T (TF32 for fp32 inputs), so that delta and
    // rowsum(P * dP) cancel as exactly as they do in the math.
    for (int d = 2 * lane; d < D; d += 64) {
      const float2 a = ldg_pair(o + d), b = ldg_pair(dout + d);
      acc += a.x * round_for_mma<T>(b.x) + a.y * round_for_mma<T>(b.y);
    }
  }
  acc = warp_sum(acc);
  if (lane == 0) p.delta[r] = acc;
}

template <class T>
__global__ void dq_finalize_kernel(const Params p, int D, int64_t rows) {
  const int64_t r = warp_row();
  if (r >= rows) return;
  const int t = r % p.I, bh = r / p.I, lane = threadIdx.x % 32;
  const float* u = p.dq_accum + r * D;
  T* dq = static_cast<T*>(p.dq) + r * D;
  float proj = 0.f;
  const T* q = static_cast<const T*>(p.q) + (bh / p.H) * p.q_sb + (bh % p.H) * p.q_sh + t * p.q_si;
  if (p.rq) {  // dq = c (U - rq^2 (q.U) q), unless |q| <= eps (then the normalisation is linear)
    const float rq = p.rq[static_cast<int64_t>(bh) * p.i_pad + t];
    float dot = 0.f;
    for (int d = 2 * lane; d < D; d += 64) {
      const float2 a = ldg_pair(q + d), b = *reinterpret_cast<const float2*>(u + d);
      dot += a.x * b.x + a.y * b.y;
    }
    dot = warp_sum(dot);
    proj = rq < 1.f / kNormEps ? rq * rq * dot : 0.f;
  }
  for (int d = 2 * lane; d < D; d += 64) {
    const float2 a = p.rq ? ldg_pair(q + d) : make_float2(0.f, 0.f);
    const float2 b = *reinterpret_cast<const float2*>(u + d);
    stg_pair(dq + d, p.grad_scale * (b.x - proj * a.x), p.grad_scale * (b.y - proj * a.y));
  }
}

unsigned blocks_for(int64_t rows) { return static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock); }

template <class F>
cudaError_t by_dtype(Dtype dtype, F&& f) {
  switch (dtype) {
    case Dtype::kF16: return f(__half{});
    case Dtype::kBF16: return f(__nv_bfloat16{});
    case Dtype::kF32: return f(float{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t run_row_rnorm(Dtype dtype, const void* x, int64_t sb, int64_t sh, int64_t si, int B, int H, int N,
                          int D, int n_pad, float* out, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(B) * H * n_pad;
  if (rows == 0) return cudaSuccess;
  return by_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    row_rnorm_kernel<T><<<blocks_for(rows), kRowsPerBlock * 32, 0, stream>>>(static_cast<const T*>(x), sb, sh, si,
                                                                             H, N, D, n_pad, rows, out);
    return cudaGetLastError();
  });
}

cudaError_t run_delta(Dtype dtype, const Params& p, int D, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(p.B) * p.H * p.i_pad;
  if (rows == 0) return cudaSuccess;
  return by_dtype(dtype, [&](auto tag) {
    delta_kernel<decltype(tag)><<<blocks_for(rows), kRowsPerBlock * 32, 0, stream>>>(p, D, rows);
    return cudaGetLastError();
  });
}

cudaError_t run_dq_finalize(Dtype dtype, const Params& p, int D, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(p.B) * p.H * p.I;
  if (rows == 0) return cudaSuccess;
  return by_dtype(dtype, [&](auto tag) {
    dq_finalize_kernel<decltype(tag)><<<blocks_for(rows), kRowsPerBlock * 32, 0, stream>>>(p, D, rows);
    return cudaGetLastError();
  });
}

}  // namespace attn
