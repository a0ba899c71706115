// Row-wise passes around fastmax's linear form: its layouts in and out of the chunk-major rows that
// linear.cuh and lin_sm90.cuh read (common/rows.cuh: how the rows are split).
#include "../common/rows.cuh"
#include "params.h"

namespace attn {
namespace {

template <class T>
__device__ __forceinline__ float2 ldg_pair(const T* p) {
  if constexpr (sizeof(T) == 2) {
    return Elem<T>::unpack(*reinterpret_cast<const uint32_t*>(p));
  } else {
    return *reinterpret_cast<const float2*>(p);
  }
}

// Chunk-major (B, n_pad / L, H, L, W) with L rows per chunk: chunk row t of head (b, h) holds natural row
// t - shift (a causal call with I != J aligns queries and keys by shifting one of them).
__device__ __forceinline__ int64_t chunk_row(int b, int h, int H, int n_pad, int L, int t) {
  return ((static_cast<int64_t>(b) * (n_pad / L) + t / L) * H + h) * L + t % L;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// Columns D .. D + 15 of a [x, c, 0 ... 0] row, from tail = the row + D: lanes 0 .. 7 write a pair each.
template <class T>
__device__ __forceinline__ void stg_tail(T* tail, int lane, float c) {
  if (lane < 8) stg_pair(tail + 2 * lane, lane == 0 ? c : 0.f, 0.f);
}

// The power of two that the backward's g is divided by (linear_attention's backward says why): the
// smallest 2^c >= gmax * cmax, over 2^14.
__device__ __forceinline__ float g_scale(float gmax, float cmax) {
  int e;
  const float f = frexpf(fmaxf(gmax * cmax, 1.17549435e-38f), &e);
  return ldexpf(1.f, (f == 0.5f ? e - 1 : e) - 14);
}

template <class T>
__global__ void lin_rows_kernel(const T* x, RowStrides xs, const bool* mask, const float* mu, int H, int N, int D,
                                int W, int n_pad, int L, int shift, T* dst) {
  const int bh = blockIdx.x, b = bh / H, h = bh % H, lane = threadIdx.x % 32;
  const T* head = x + xs.offset(b, h);
  for_each_row_group(n_pad, [&](int t0) {
    bool keep[kRowsPerWarp];
    int64_t src[kRowsPerWarp], row[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int n = t0 + r - shift;
      keep[r] = n >= 0 && n < N && (!mask || mask[static_cast<int64_t>(b) * N + n]);
      src[r] = min(max(n, 0), N - 1) * xs.i;
      row[r] = chunk_row(b, h, H, n_pad, L, min(t0 + r, n_pad - 1)) * W;
    }
    for (int d = 2 * lane; d < D; d += 64) {
      float2 v[kRowsPerWarp];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) v[r] = ldg_pair(head + src[r] + d);
      const float2 m = mu ? *reinterpret_cast<const float2*>(mu + static_cast<int64_t>(bh) * D + d) : float2{};
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r)
        if (t0 + r < n_pad) stg_pair(dst + row[r] + d, keep[r] ? v[r].x - m.x : 0.f, keep[r] ? v[r].y - m.y : 0.f);
    }
    if (W > D) {  // [x, keep, 0 ... 0]: the 1 that carries the constant and first-order terms
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r)
        if (t0 + r < n_pad) stg_tail(dst + row[r] + D, lane, keep[r] ? 1.f : 0.f);
    }
  });
}

// Pair d of the group's chunk rows of an fp32 sweep output (rows `pitch` wide) and of the diagonal
// blocks' output (rows orow, D wide; zeros where there is none), all loads issued before any is used.
template <class T>
__device__ __forceinline__ void load_sweep_diag(float2 (&acc)[kRowsPerWarp], float2 (&diag)[kRowsPerWarp],
                                                const int64_t (&row)[kRowsPerWarp], const float* a, int pitch,
                                                const T* o, const int64_t (&orow)[kRowsPerWarp], int D, int d) {
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    acc[r] = *reinterpret_cast<const float2*>(a + row[r] * pitch + d);
    diag[r] = o ? ldg_pair(o + orow[r] * D + d) : float2{};
  }
}

// out = (num + mu l + o l_d) / (l + l_d) from the moments' y = [num, l] (of the values less mu) and the
// diagonal block's output o and 1 / l_d (stat); 1 / the sum for every chunk row (the backward's), out for
// the rows that exist. o is attn_cuda::fwd's over the chunks, (B * chunks, H, L, D) over (B * chunks, L, H, D)
// memory: chunk row t of head (b, h) is its row (b n_pad + t) H + h.
template <class T>
__global__ void lin_out_kernel(const float* y, const T* o, const float* stat, const float* mu, int H, int n, int D,
                               int n_pad, int L, int shift, T* out, float* inv_l) {
  const int bh = blockIdx.x, b = bh / H, h = bh % H, lane = threadIdx.x % 32, Dp = D + 16;
  for_each_row_group(n_pad, [&](int t0) {
    int64_t row[kRowsPerWarp], orow[kRowsPerWarp];
    float lm[kRowsPerWarp], ld[kRowsPerWarp], inv[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      row[r] = chunk_row(b, h, H, n_pad, L, min(t0 + r, n_pad - 1));
      orow[r] = (static_cast<int64_t>(b) * n_pad + min(t0 + r, n_pad - 1)) * H + h;
      const float s = stat ? stat[row[r]] : 0.f;
      ld[r] = s > 0.f ? 1.f / s : 0.f;
      lm[r] = y[row[r] * Dp + D];
      const float l = lm[r] + ld[r];
      inv[r] = l > 0.f ? 1.f / l : 0.f;  // no visible key, or weights that sum to 0: output 0
      if (lane == 0 && t0 + r < n_pad) inv_l[row[r]] = inv[r];
    }
    for (int d = 2 * lane; d < D; d += 64) {
      float2 num[kRowsPerWarp], od[kRowsPerWarp];
      load_sweep_diag(num, od, row, y, Dp, o, orow, D, d);
      const float2 m = *reinterpret_cast<const float2*>(mu + static_cast<int64_t>(bh) * D + d);
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const int i = t0 + r - shift;
        if (i >= 0 && i < n && t0 + r < n_pad)
          stg_pair(out + ((static_cast<int64_t>(b) * n + i) * H + h) * D + d,
                   (fmaf(m.x, lm[r], num[r].x) + od[r].x * ld[r]) * inv[r],
                   (fmaf(m.y, lm[r], num[r].y) + od[r].y * ld[r]) * inv[r]);
      }
    }
  });
}

// The backward's rows g = [dO, -dO . (O - mu)] / l, first pass: delta = dO . (O - mu) per chunk row, and
// the largest |g| into gmax (a float's bits: non-negative floats order as unsigned integers).
template <class T>
__global__ void lin_delta_kernel(const T* dout, RowStrides ds, const T* out, RowStrides os, const float* inv_l,
                                 const float* mu, int H, int n, int D, int n_pad, int L, int shift, float* delta,
                                 unsigned* gmax) {
  const int bh = blockIdx.x, b = bh / H, h = bh % H, lane = threadIdx.x % 32;
  const T* dO = dout + ds.offset(b, h);
  const T* O = out + os.offset(b, h);
  float top = 0.f;
  for_each_row_group(n_pad, [&](int t0) {
    int64_t src[kRowsPerWarp];
    float dot[kRowsPerWarp] = {}, big[kRowsPerWarp] = {};
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) src[r] = min(max(t0 + r - shift, 0), n - 1);
    for (int d = 2 * lane; d < D; d += 64) {
      float2 a[kRowsPerWarp], c[kRowsPerWarp];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r)
        a[r] = ldg_pair(dO + src[r] * ds.i + d), c[r] = ldg_pair(O + src[r] * os.i + d);
      const float2 m = *reinterpret_cast<const float2*>(mu + static_cast<int64_t>(bh) * D + d);
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        dot[r] += a[r].x * (c[r].x - m.x) + a[r].y * (c[r].y - m.y);
        big[r] = fmaxf(big[r], fmaxf(fabsf(a[r].x), fabsf(a[r].y)));
      }
    }
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int i = t0 + r - shift;
      const bool real = i >= 0 && i < n && t0 + r < n_pad;
      const float dl = real ? lanes_sum<32>(dot[r]) : 0.f;
      const int64_t row = chunk_row(b, h, H, n_pad, L, min(t0 + r, n_pad - 1));
      if (real) top = fmaxf(top, inv_l[row] * fmaxf(warp_max(big[r]), fabsf(dl)));
      if (lane == 0 && t0 + r < n_pad) delta[row] = dl;
    }
  });
  if (lane == 0) atomicMax(gmax, __float_as_uint(top));
}

// Second pass: g / scale as [x, 1] rows of T, with scale = g_scale(gmax, cmax) (written once, for the
// caller to undo).
template <class T>
__global__ void lin_g_kernel(const T* dout, RowStrides ds, const float* inv_l, const float* delta,
                             const unsigned* gmax, const float* cmax, int H, int n, int D, int n_pad, int L, int shift,
                             T* g, float* scale_out) {
  const int bh = blockIdx.x, b = bh / H, h = bh % H, lane = threadIdx.x % 32, Dp = D + 16;
  const T* dO = dout + ds.offset(b, h);
  const float scale = g_scale(__uint_as_float(*gmax), *cmax);
  if (bh == 0 && blockIdx.y == 0 && threadIdx.x == 0) *scale_out = scale;
  for_each_row_group(n_pad, [&](int t0) {
    int64_t src[kRowsPerWarp], row[kRowsPerWarp];
    float c[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int i = t0 + r - shift;
      src[r] = min(max(i, 0), n - 1) * ds.i;
      row[r] = chunk_row(b, h, H, n_pad, L, min(t0 + r, n_pad - 1));
      c[r] = i >= 0 && i < n ? inv_l[row[r]] / scale : 0.f;
    }
    for (int d = 2 * lane; d < D; d += 64) {
      float2 a[kRowsPerWarp];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) a[r] = ldg_pair(dO + src[r] + d);
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r)
        if (t0 + r < n_pad) stg_pair(g + row[r] * Dp + d, a[r].x * c[r], a[r].y * c[r]);
    }
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r)
      if (t0 + r < n_pad) stg_tail(g + row[r] * Dp + D, lane, -delta[row[r]] * c[r]);
  });
}

// A gradient back in natural rows: acc (chunk-major fp32, rows W wide) times *scale, plus the diagonal
// blocks' share (chunk-major, D wide) where there is one.
template <class T>
__global__ void lin_grad_kernel(const float* acc, int W, const float* scale, const T* diag, int H, int n, int D,
                                int n_pad, int L, int shift, T* out) {
  const int bh = blockIdx.x, b = bh / H, h = bh % H, lane = threadIdx.x % 32;
  const float s = *scale;
  for_each_row_group(n, [&](int i0) {
    int64_t row[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) row[r] = chunk_row(b, h, H, n_pad, L, min(i0 + r, n - 1) + shift);
    for (int d = 2 * lane; d < D; d += 64) {
      float2 a[kRowsPerWarp], c[kRowsPerWarp];
      load_sweep_diag(a, c, row, acc, W, diag, row, D, d);
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r)
        if (i0 + r < n)
          stg_pair(out + (static_cast<int64_t>(bh) * n + i0 + r) * D + d, a[r].x * s + c[r].x, a[r].y * s + c[r].y);
    }
  });
}

// The linear form runs in fp16 and bf16 only.
template <class F>
cudaError_t by_half_dtype(Dtype dtype, F&& f) {
  switch (dtype) {
    case Dtype::kF16: return f(__half{});
    case Dtype::kBF16: return f(__nv_bfloat16{});
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t run_lin_rows(Dtype dtype, const void* x, RowStrides xs, const bool* mask, const float* mu, int B,
                         int H, int N, int D, int W, int n_pad, int L, int shift, void* dst, cudaStream_t stream) {
  if (B * H == 0 || n_pad == 0) return cudaSuccess;
  return by_half_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    lin_rows_kernel<T><<<row_grid(B * H, n_pad), kWarps * 32, 0, stream>>>(
        static_cast<const T*>(x), xs, mask, mu, H, N, D, W, n_pad, L, shift, static_cast<T*>(dst));
    return cudaGetLastError();
  });
}

cudaError_t run_lin_out(Dtype dtype, const float* y, const void* o, const float* stat, const float* mu, int B, int H,
                        int n, int D, int n_pad, int L, int shift, void* out, float* inv_l, cudaStream_t stream) {
  if (B * H == 0 || n_pad == 0) return cudaSuccess;
  return by_half_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    lin_out_kernel<T><<<row_grid(B * H, n_pad), kWarps * 32, 0, stream>>>(
        y, static_cast<const T*>(o), stat, mu, H, n, D, n_pad, L, shift, static_cast<T*>(out), inv_l);
    return cudaGetLastError();
  });
}

cudaError_t run_lin_g(Dtype dtype, const void* dout, RowStrides ds, const void* out, RowStrides os,
                      const float* inv_l, const float* mu, const float* cmax, int B, int H, int n, int D, int n_pad,
                      int L, int shift, float* delta, unsigned* gmax, void* g, float* scale, cudaStream_t stream) {
  if (B * H == 0 || n_pad == 0) return cudaSuccess;
  return by_half_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const auto* dO = static_cast<const T*>(dout);
    lin_delta_kernel<T><<<row_grid(B * H, n_pad), kWarps * 32, 0, stream>>>(
        dO, ds, static_cast<const T*>(out), os, inv_l, mu, H, n, D, n_pad, L, shift, delta, gmax);
    lin_g_kernel<T><<<row_grid(B * H, n_pad), kWarps * 32, 0, stream>>>(
        dO, ds, inv_l, delta, gmax, cmax, H, n, D, n_pad, L, shift, static_cast<T*>(g), scale);
    return cudaGetLastError();
  });
}

cudaError_t run_lin_grad(Dtype dtype, const float* acc, int W, const float* scale, const void* diag, int B, int H,
                         int n, int D, int n_pad, int L, int shift, void* out, cudaStream_t stream) {
  if (B * H == 0 || n == 0) return cudaSuccess;
  return by_half_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    lin_grad_kernel<T><<<row_grid(B * H, n), kWarps * 32, 0, stream>>>(
        acc, W, scale, static_cast<const T*>(diag), H, n, D, n_pad, L, shift, static_cast<T*>(out));
    return cudaGetLastError();
  });
}

}  // namespace attn
