// Row-wise passes around the attention kernels: 1/|row| of q and k, delta = rowsum(dO * O) for the
// backward, and the dQ epilogue. Each warp owns kRowsPerWarp rows at a time and issues the loads of
// all of them (two elements per lane per row and step) before it reduces any. The grid is (batch x
// head, row blocks), rows striding past the grid's 65535-block height, so no thread divides a 64-bit
// row index (bench/NOTES.md, run 9, has their times).
#include "mma.cuh"
#include "params.h"

namespace attn {
namespace {

constexpr int kWarps = 8, kRowsPerWarp = 8, kRowsPerBlock = kWarps * kRowsPerWarp;

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

// Element pair d of rows t0 .. t0 + kRowsPerWarp - 1 of a tensor with rows `pitch` elements apart, all
// loads issued before any is used. Rows from n on read row n - 1 instead (callers drop them): loads
// under a per-row `if` stayed in program order in ptxas's schedule, one in flight per warp (~0.7 TB/s).
template <class T>
__device__ __forceinline__ void load_rows(float2 (&v)[kRowsPerWarp], const T* x, int64_t pitch, int t0, int n, int d) {
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) v[r] = ldg_pair(x + min(t0 + r, n - 1) * pitch + d);
}

// f(t0) for the groups of kRowsPerWarp rows t0 .. t0 + kRowsPerWarp - 1 (some may be >= n) of this
// block's (batch, head) that this warp owns.
template <class F>
__device__ __forceinline__ void for_each_row_group(int n, F&& f) {
  for (int t0 = (blockIdx.y * kWarps + threadIdx.x / 32) * kRowsPerWarp; t0 < n; t0 += gridDim.y * kRowsPerBlock)
    f(t0);
}

template <class T>
__global__ void row_rnorm_kernel(const T* x, int64_t sb, int64_t sh, int64_t si, int H, int N, int D, int n_pad,
                                 float* out) {
  const int bh = blockIdx.x, lane = threadIdx.x % 32;
  const T* head = x + (bh / H) * sb + (bh % H) * sh;
  for_each_row_group(n_pad, [&](int t0) {
    float ss[kRowsPerWarp] = {};
    for (int d = 2 * lane; d < D; d += 64) {
      float2 v[kRowsPerWarp];
      load_rows(v, head, si, t0, N, d);
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) ss[r] += v[r].x * v[r].x + v[r].y * v[r].y;
    }
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const float sum = warp_sum(ss[r]);
      const int i = t0 + r;
      if (lane == 0 && i < n_pad)
        out[static_cast<int64_t>(bh) * n_pad + i] = i < N ? 1.f / fmaxf(sqrtf(sum), kNormEps) : 0.f;
    }
  });
}

template <class T>
__global__ void delta_kernel(const Params p, int D) {
  const int bh = blockIdx.x, lane = threadIdx.x % 32;
  const T* o = static_cast<const T*>(p.o) + static_cast<int64_t>(bh) * p.I * D;
  const T* dout = static_cast<const T*>(p.dout) + static_cast<int64_t>(bh) * p.I * D;
  for_each_row_group(p.i_pad, [&](int t0) {
    float acc[kRowsPerWarp] = {};
    if (p.normalize) {
      // dO as the tensor cores see it in dP = dO V^T (TF32 for fp32 inputs), so that delta and
      // rowsum(P * dP) cancel as exactly as they do in the math.
      for (int d = 2 * lane; d < D; d += 64) {
        float2 a[kRowsPerWarp], b[kRowsPerWarp];
        load_rows(a, o, D, t0, p.I, d);
        load_rows(b, dout, D, t0, p.I, d);
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r)
          acc[r] += a[r].x * round_for_mma<T>(b[r].x) + a[r].y * round_for_mma<T>(b[r].y);
      }
    }
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const float sum = warp_sum(acc[r]);
      if (lane == 0 && t0 + r < p.i_pad)
        p.delta[static_cast<int64_t>(bh) * p.i_pad + t0 + r] = t0 + r < p.I ? sum : 0.f;
    }
  });
}

template <class T>
__global__ void dq_finalize_kernel(const Params p, int D) {
  const int bh = blockIdx.x, lane = threadIdx.x % 32;
  const T* q = static_cast<const T*>(p.q) + (bh / p.H) * p.q_sb + (bh % p.H) * p.q_sh;
  const float* u = p.dq_accum + static_cast<int64_t>(bh) * p.I * D;
  T* dq = static_cast<T*>(p.dq) + static_cast<int64_t>(bh) * p.I * D;
  for_each_row_group(p.I, [&](int t0) {
    // dq = c (U - rq^2 (q.U) q), unless |q| <= eps (then the normalisation is linear)
    float proj[kRowsPerWarp] = {};
    if (p.rq) {
      for (int d = 2 * lane; d < D; d += 64) {
        float2 a[kRowsPerWarp], b[kRowsPerWarp];
        load_rows(a, q, p.q_si, t0, p.I, d);
        load_rows(b, u, D, t0, p.I, d);
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) proj[r] += a[r].x * b[r].x + a[r].y * b[r].y;
      }
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const float rq = t0 + r < p.I ? p.rq[static_cast<int64_t>(bh) * p.i_pad + t0 + r] : 0.f;
        proj[r] = warp_sum(proj[r]);
        proj[r] = rq < 1.f / kNormEps ? rq * rq * proj[r] : 0.f;
      }
    }
    for (int d = 2 * lane; d < D; d += 64) {
      float2 a[kRowsPerWarp] = {}, b[kRowsPerWarp];
      if (p.rq) load_rows(a, q, p.q_si, t0, p.I, d);
      load_rows(b, u, D, t0, p.I, d);
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        if (t0 + r < p.I)
          stg_pair(dq + static_cast<int64_t>(t0 + r) * D + d, p.grad_scale * (b[r].x - proj[r] * a[r].x),
                   p.grad_scale * (b[r].y - proj[r] * a[r].y));
      }
    }
  });
}

dim3 row_grid(int heads, int rows) {
  return dim3(heads, std::min((rows + kRowsPerBlock - 1) / kRowsPerBlock, 65535));
}

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
  if (B * H == 0 || n_pad == 0) return cudaSuccess;
  return by_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    row_rnorm_kernel<T><<<row_grid(B * H, n_pad), kWarps * 32, 0, stream>>>(static_cast<const T*>(x), sb, sh,
                                                                                   si, H, N, D, n_pad, out);
    return cudaGetLastError();
  });
}

cudaError_t run_delta(Dtype dtype, const Params& p, int D, cudaStream_t stream) {
  if (p.B * p.H == 0 || p.i_pad == 0) return cudaSuccess;
  return by_dtype(dtype, [&](auto tag) {
    delta_kernel<decltype(tag)><<<row_grid(p.B * p.H, p.i_pad), kWarps * 32, 0, stream>>>(p, D);
    return cudaGetLastError();
  });
}

cudaError_t run_dq_finalize(Dtype dtype, const Params& p, int D, cudaStream_t stream) {
  if (p.B * p.H == 0 || p.I == 0) return cudaSuccess;
  return by_dtype(dtype, [&](auto tag) {
    dq_finalize_kernel<decltype(tag)><<<row_grid(p.B * p.H, p.I), kWarps * 32, 0, stream>>>(p, D);
    return cudaGetLastError();
  });
}

}  // namespace attn
