// Row-wise passes around the attention kernels: 1/|k| and the unit keys k/|k| that the kernels read,
// delta = rowsum(dO * O) for the backward, the dQ epilogue, and the linear form's layouts in and out of
// its chunk-major rows. Each warp owns kRowsPerWarp rows at a time and issues the loads of all of them
// before it reduces any. The grid is (batch x head, row blocks), rows striding past the grid's
// 65535-block height, so no thread divides a 64-bit row index (bench/NOTES.md, run 9, has their times).
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

// The sum over each group of L adjacent lanes (a power of two), in every lane of the group.
template <int L>
__device__ __forceinline__ float lanes_sum(float x) {
#pragma unroll
  for (int o = L / 2; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// f(t0) for the groups of kRowsPerWarp rows t0 .. t0 + kRowsPerWarp - 1 (some may be >= n) of this
// block's (batch, head) that this warp owns.
template <class F>
__device__ __forceinline__ void for_each_row_group(int n, F&& f) {
  for (int t0 = (blockIdx.y * kWarps + threadIdx.x / 32) * kRowsPerWarp; t0 < n; t0 += gridDim.y * kRowsPerBlock)
    f(t0);
}

// V consecutive elements of a row as floats and back, in accesses of min(16, V * sizeof(T)) bytes (the
// address aligned to that).
template <int V, class T>
__device__ __forceinline__ void ldg_vec(float (&f)[V], const T* x) {
  constexpr int kWords = V * static_cast<int>(sizeof(T)) / 4, kChunk = kWords < 4 ? kWords : 4;
  static_assert(kChunk == 2 || kChunk == 4, "8- or 16-byte accesses");
  uint32_t w[kWords];
#pragma unroll
  for (int c = 0; c < kWords; c += kChunk) {
    if constexpr (kChunk == 4) {
      const uint4 v = reinterpret_cast<const uint4*>(x)[c / 4];
      w[c] = v.x, w[c + 1] = v.y, w[c + 2] = v.z, w[c + 3] = v.w;
    } else {
      const uint2 v = reinterpret_cast<const uint2*>(x)[c / 2];
      w[c] = v.x, w[c + 1] = v.y;
    }
  }
#pragma unroll
  for (int i = 0; i < kWords; ++i) {
    if constexpr (sizeof(T) == 2) {
      const float2 h = Elem<T>::unpack(w[i]);
      f[2 * i] = h.x, f[2 * i + 1] = h.y;
    } else {
      f[i] = __uint_as_float(w[i]);
    }
  }
}
template <int V, class T>
__device__ __forceinline__ void stg_vec(T* x, const float (&f)[V]) {
  constexpr int kWords = V * static_cast<int>(sizeof(T)) / 4, kChunk = kWords < 4 ? kWords : 4;
  static_assert(kChunk == 2 || kChunk == 4, "8- or 16-byte accesses");
  uint32_t w[kWords];
#pragma unroll
  for (int i = 0; i < kWords; ++i) {
    if constexpr (sizeof(T) == 2) {
      w[i] = Elem<T>::pack(f[2 * i], f[2 * i + 1]);
    } else {
      w[i] = __float_as_uint(f[i]);
    }
  }
#pragma unroll
  for (int c = 0; c < kWords; c += kChunk) {
    if constexpr (kChunk == 4) {
      reinterpret_cast<uint4*>(x)[c / 4] = make_uint4(w[c], w[c + 1], w[c + 2], w[c + 3]);
    } else {
      reinterpret_cast<uint2*>(x)[c / 2] = make_uint2(w[c], w[c + 1]);
    }
  }
}

// The attention ops' row passes read whole rows in 16-byte accesses: L lanes per row, kVec elements
// each, so one load covers 32 / L rows and a lane holds kJ of its warp's kRowsPerWarp. L is the fewest
// lanes whose slices cover D, at least 4 so that a group is whole loads (with_row_lanes). Every row
// start is 16-byte aligned (the op's rows_aligned, or its own outputs). Rows past the end read the
// last row instead (callers drop them): loads under a per-row `if` stayed in program order in ptxas's
// schedule, one in flight per warp. Two elements per lane and load, they ran at 1.6-2.4 TB/s (H200;
// bench/NOTES.md runs 29-30).
constexpr int kVec = 8;
template <int L>
struct RowSlice {
  static constexpr int kRows = 32 / L, kJ = kRowsPerWarp / kRows;
  int r, col;  // the lane's first row in a group and its first column
  __device__ RowSlice() : r(lane_id() / L), col(lane_id() % L * kVec) {}
  __device__ int row(int t0, int j) const { return t0 + r + j * kRows; }
  __device__ bool leader() const { return lane_id() % L == 0; }
};

template <class F>
cudaError_t with_row_lanes(int D, F&& f) {
  if (D <= 4 * kVec) return f(std::integral_constant<int, 4>{});
  if (D <= 8 * kVec) return f(std::integral_constant<int, 8>{});
  if (D <= 16 * kVec) return f(std::integral_constant<int, 16>{});
  return cudaErrorInvalidValue;  // past the head dims that setup.py compiles
}

template <class T, int L>
__global__ void row_rnorm_kernel(const T* x, int64_t sb, int64_t sh, int64_t si, int H, int N, int D, int n_pad,
                                 float* out, T* unit) {
  using S = RowSlice<L>;
  const int bh = blockIdx.x;
  const T* head = x + (bh / H) * sb + (bh % H) * sh;
  const S s;
  for_each_row_group(n_pad, [&](int t0) {
    float v[S::kJ][kVec] = {};
    if (s.col < D) {
#pragma unroll
      for (int j = 0; j < S::kJ; ++j) ldg_vec(v[j], head + min(s.row(t0, j), N - 1) * si + s.col);
    }
#pragma unroll
    for (int j = 0; j < S::kJ; ++j) {
      float ss = 0.f;
#pragma unroll
      for (int e = 0; e < kVec; ++e) ss += v[j][e] * v[j][e];
      ss = lanes_sum<L>(ss);
      const int i = s.row(t0, j);
      const float r = 1.f / fmaxf(sqrtf(ss), kNormEps);
      if (s.leader() && i < n_pad) out[static_cast<int64_t>(bh) * n_pad + i] = i < N ? r : 0.f;
      if (i < N && s.col < D) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) v[j][e] *= r;
        stg_vec(unit + (static_cast<int64_t>(bh) * N + i) * D + s.col, v[j]);
      }
    }
  });
}

template <class T, int L>
__global__ void delta_kernel(const Params p, int D) {
  using S = RowSlice<L>;
  const int bh = blockIdx.x;
  const T* o = static_cast<const T*>(p.o) + static_cast<int64_t>(bh) * p.I * D;
  const T* dout = static_cast<const T*>(p.dout) + static_cast<int64_t>(bh) * p.I * D;
  const S s;
  for_each_row_group(p.i_pad, [&](int t0) {
    float a[S::kJ][kVec] = {}, b[S::kJ][kVec] = {};
    if (p.normalize && s.col < D) {
#pragma unroll
      for (int j = 0; j < S::kJ; ++j) {
        const int64_t at = static_cast<int64_t>(min(s.row(t0, j), p.I - 1)) * D + s.col;
        ldg_vec(a[j], o + at);
        ldg_vec(b[j], dout + at);
      }
    }
#pragma unroll
    for (int j = 0; j < S::kJ; ++j) {
      float acc = 0.f;
#pragma unroll
      for (int e = 0; e < kVec; e += 2) {
        // dO as the tensor cores see it in dP = dO V^T (TF32 for fp32 inputs), so that delta and
        // rowsum(P * dP) cancel as exactly as they do in the math.
        const float2 rb = round_for_mma<T>(make_float2(b[j][e], b[j][e + 1]));
        acc += a[j][e] * rb.x + a[j][e + 1] * rb.y;
      }
      acc = lanes_sum<L>(acc);
      const int i = s.row(t0, j);
      if (s.leader() && i < p.i_pad) p.delta[static_cast<int64_t>(bh) * p.i_pad + i] = i < p.I ? acc : 0.f;
    }
  });
}

// dq = c (U - rq^2 (q.U) q) from the fp32 accumulator U, unless |q| <= eps (then the normalisation is
// linear): the row-major U of the mma.sync backward and the d64 Hopper one.
template <class T, int L>
__global__ void dq_finalize_kernel(const Params p, int D) {
  using S = RowSlice<L>;
  const int bh = blockIdx.x;
  const T* q = static_cast<const T*>(p.q) + (bh / p.H) * p.q_sb + (bh % p.H) * p.q_sh;
  const float* u = p.dq_accum + static_cast<int64_t>(bh) * p.I * D;
  T* dq = static_cast<T*>(p.dq) + static_cast<int64_t>(bh) * p.I * D;
  const S s;
  for_each_row_group(p.I, [&](int t0) {
    float a[S::kJ][kVec] = {}, b[S::kJ][kVec] = {}, rq[S::kJ] = {};
#pragma unroll
    for (int j = 0; j < S::kJ; ++j) {
      const int t = min(s.row(t0, j), p.I - 1);
      if (s.col < D) {
        if (p.rq) ldg_vec(a[j], q + t * p.q_si + s.col);
        ldg_vec(b[j], u + static_cast<int64_t>(t) * D + s.col);
      }
      if (p.rq) rq[j] = p.rq[static_cast<int64_t>(bh) * p.i_pad + t];
    }
#pragma unroll
    for (int j = 0; j < S::kJ; ++j) {
      float proj = 0.f;
#pragma unroll
      for (int e = 0; e < kVec; ++e) proj += a[j][e] * b[j][e];
      proj = lanes_sum<L>(proj);
      proj = rq[j] < 1.f / kNormEps ? rq[j] * rq[j] * proj : 0.f;
      const int t = s.row(t0, j);
      if (s.col < D && t < p.I) {
        float out[kVec];
#pragma unroll
        for (int e = 0; e < kVec; ++e) out[e] = p.grad_scale * (b[j][e] - proj * a[j][e]);
        stg_vec(dq + static_cast<int64_t>(t) * D + s.col, out);
      }
    }
  });
}

// The same epilogue for the d128 Hopper backward's tiles (dq_tile_slot): one block per 64-row tile,
// read whole with 16-byte loads and turned row-major in shared memory, then 8 rows per warp, 4
// columns per lane. Read row by row, each 8-byte read used half of its sectors: 0.34 ms at b1 h32
// 16384 (H200), ~1.6 TB/s.
template <class T, int D>
__global__ void __launch_bounds__(kWarps * 32) dq_finalize_tiles_kernel(const Params p) {
  static_assert(kWarps * kRowsPerWarp == kDqTileRows && D % 8 == 0 && 32 % (D / 4) == 0, "a tile per block");
  constexpr int kPitch = D + 8;  // floats: a half-warp's 8-byte stores (4 rows x 4 pairs) hit 32 banks
  constexpr int kLanes = D / 4, kRowsPerLoad = 32 / kLanes;
  __shared__ __align__(16) float su[kDqTileRows * kPitch];
  const int tiles = dq_tiled_rows(p.I) / kDqTileRows;
  const int bh = blockIdx.x / tiles, t0 = blockIdx.x % tiles * kDqTileRows;
  const float4* u = reinterpret_cast<const float4*>(p.dq_accum + (static_cast<int64_t>(bh) * tiles + t0 / kDqTileRows) *
                                                                     kDqTileRows * D);
  constexpr int kLoads = kDqTileRows * D / 4 / (kWarps * 32), kSteps = kRowsPerWarp / kRowsPerLoad;
  float4 v[kLoads];
#pragma unroll
  for (int i = 0; i < kLoads; ++i) v[i] = u[i * kWarps * 32 + threadIdx.x];
  // This warp's rows of q and rq, loading while U's arrive.
  const int lane = threadIdx.x % 32, col = lane % kLanes * 4, r0 = threadIdx.x / 32 * kRowsPerWarp + lane / kLanes;
  const T* q = static_cast<const T*>(p.q) + (bh / p.H) * p.q_sb + (bh % p.H) * p.q_sh;
  float a[kSteps][4] = {}, rq[kSteps] = {};
  if (p.rq) {
#pragma unroll
    for (int j = 0; j < kSteps; ++j) {
      const int t = t0 + r0 + j * kRowsPerLoad;
      ldg_vec(a[j], q + min(t, p.I - 1) * p.q_si + col);
      rq[j] = p.rq[static_cast<int64_t>(bh) * p.i_pad + min(t, p.i_pad - 1)];
    }
  }
#pragma unroll
  for (int i = 0; i < kLoads; ++i) {
    const DqSlot at = dq_tile_slot(i * kWarps * 32 + threadIdx.x);
    *reinterpret_cast<float2*>(&su[at.row * kPitch + at.col]) = make_float2(v[i].x, v[i].y);
    *reinterpret_cast<float2*>(&su[(at.row + 8) * kPitch + at.col]) = make_float2(v[i].z, v[i].w);
  }
  __syncthreads();
  T* dq = static_cast<T*>(p.dq) + static_cast<int64_t>(bh) * p.I * D;
#pragma unroll
  for (int j = 0; j < kSteps; ++j) {
    const int r = r0 + j * kRowsPerLoad, t = t0 + r;
    const float4 b4 = *reinterpret_cast<const float4*>(&su[r * kPitch + col]);
    const float b[4] = {b4.x, b4.y, b4.z, b4.w};
    float proj = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) proj += a[j][e] * b[e];
    proj = lanes_sum<kLanes>(proj);
    proj = rq[j] < 1.f / kNormEps ? rq[j] * rq[j] * proj : 0.f;
    float out[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) out[e] = p.grad_scale * (b[e] - proj * a[j][e]);
    if (t < p.I) stg_vec(dq + static_cast<int64_t>(t) * D + col, out);
  }
}

// ---- Fastmax's linear form: between natural (B, H, N, D) rows and linear.cuh's chunk-major ones ----
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
__global__ void lin_rows_kernel(const T* x, int64_t sb, int64_t sh, int64_t si, const bool* mask, const float* mu,
                                int H, int N, int D, int W, int n_pad, int L, int shift, T* dst) {
  const int bh = blockIdx.x, b = bh / H, h = bh % H, lane = threadIdx.x % 32;
  const T* head = x + b * sb + h * sh;
  for_each_row_group(n_pad, [&](int t0) {
    bool keep[kRowsPerWarp];
    int64_t src[kRowsPerWarp], row[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int n = t0 + r - shift;
      keep[r] = n >= 0 && n < N && (!mask || mask[static_cast<int64_t>(b) * N + n]);
      src[r] = min(max(n, 0), N - 1) * si;
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
// blocks' output (D wide; zeros where there is none), all loads issued before any is used.
template <class T>
__device__ __forceinline__ void load_sweep_diag(float2 (&acc)[kRowsPerWarp], float2 (&diag)[kRowsPerWarp],
                                                const int64_t (&row)[kRowsPerWarp], const float* a, int pitch,
                                                const T* o, int D, int d) {
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    acc[r] = *reinterpret_cast<const float2*>(a + row[r] * pitch + d);
    diag[r] = o ? ldg_pair(o + row[r] * D + d) : float2{};
  }
}

// out = (num + mu l + o l_d) / (l + l_d) from the moments' y = [num, l] (of the values less mu) and the
// diagonal block's output o and 1 / l_d (stat); 1 / the sum for every chunk row (the backward's), out for
// the rows that exist.
template <class T>
__global__ void lin_out_kernel(const float* y, const T* o, const float* stat, const float* mu, int H, int n, int D,
                               int n_pad, int L, int shift, T* out, float* inv_l) {
  const int bh = blockIdx.x, b = bh / H, h = bh % H, lane = threadIdx.x % 32, Dp = D + 16;
  for_each_row_group(n_pad, [&](int t0) {
    int64_t row[kRowsPerWarp];
    float lm[kRowsPerWarp], ld[kRowsPerWarp], inv[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      row[r] = chunk_row(b, h, H, n_pad, L, min(t0 + r, n_pad - 1));
      const float s = stat ? stat[row[r]] : 0.f;
      ld[r] = s > 0.f ? 1.f / s : 0.f;
      lm[r] = y[row[r] * Dp + D];
      const float l = lm[r] + ld[r];
      inv[r] = l > 0.f ? 1.f / l : 0.f;  // no visible key, or weights that sum to 0: output 0
      if (lane == 0 && t0 + r < n_pad) inv_l[row[r]] = inv[r];
    }
    for (int d = 2 * lane; d < D; d += 64) {
      float2 num[kRowsPerWarp], od[kRowsPerWarp];
      load_sweep_diag(num, od, row, y, Dp, o, D, d);
      const float2 m = *reinterpret_cast<const float2*>(mu + static_cast<int64_t>(bh) * D + d);
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const int i = t0 + r - shift;
        if (i >= 0 && i < n && t0 + r < n_pad)
          stg_pair(out + (static_cast<int64_t>(bh) * n + i) * D + d,
                   (fmaf(m.x, lm[r], num[r].x) + od[r].x * ld[r]) * inv[r],
                   (fmaf(m.y, lm[r], num[r].y) + od[r].y * ld[r]) * inv[r]);
      }
    }
  });
}

// The backward's rows g = [dO, -dO . (O - mu)] / l, first pass: delta = dO . (O - mu) per chunk row, and
// the largest |g| into gmax (a float's bits: non-negative floats order as unsigned integers).
template <class T>
__global__ void lin_delta_kernel(const T* dout, const T* out, const float* inv_l, const float* mu, int H, int n,
                                 int D, int n_pad, int L, int shift, float* delta, unsigned* gmax) {
  const int bh = blockIdx.x, b = bh / H, h = bh % H, lane = threadIdx.x % 32;
  const T* dO = dout + static_cast<int64_t>(bh) * n * D;
  const T* O = out + static_cast<int64_t>(bh) * n * D;
  float top = 0.f;
  for_each_row_group(n_pad, [&](int t0) {
    int64_t src[kRowsPerWarp];
    float dot[kRowsPerWarp] = {}, big[kRowsPerWarp] = {};
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) src[r] = min(max(t0 + r - shift, 0), n - 1) * int64_t{D};
    for (int d = 2 * lane; d < D; d += 64) {
      float2 a[kRowsPerWarp], c[kRowsPerWarp];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) a[r] = ldg_pair(dO + src[r] + d), c[r] = ldg_pair(O + src[r] + d);
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
__global__ void lin_g_kernel(const T* dout, const float* inv_l, const float* delta, const unsigned* gmax,
                             const float* cmax, int H, int n, int D, int n_pad, int L, int shift, T* g,
                             float* scale_out) {
  const int bh = blockIdx.x, b = bh / H, h = bh % H, lane = threadIdx.x % 32, Dp = D + 16;
  const T* dO = dout + static_cast<int64_t>(bh) * n * D;
  const float scale = g_scale(__uint_as_float(*gmax), *cmax);
  if (bh == 0 && blockIdx.y == 0 && threadIdx.x == 0) *scale_out = scale;
  for_each_row_group(n_pad, [&](int t0) {
    int64_t src[kRowsPerWarp], row[kRowsPerWarp];
    float c[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int i = t0 + r - shift;
      src[r] = min(max(i, 0), n - 1) * int64_t{D};
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
      load_sweep_diag(a, c, row, acc, W, diag, D, d);
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r)
        if (i0 + r < n)
          stg_pair(out + (static_cast<int64_t>(bh) * n + i0 + r) * D + d, a[r].x * s + c[r].x, a[r].y * s + c[r].y);
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

cudaError_t run_row_rnorm(Dtype dtype, const void* x, int64_t sb, int64_t sh, int64_t si, int B, int H, int N,
                          int D, int n_pad, float* out, void* unit, cudaStream_t stream) {
  if (B * H == 0 || n_pad == 0) return cudaSuccess;
  return by_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    return with_row_lanes(D, [&](auto lanes) {
      row_rnorm_kernel<T, lanes><<<row_grid(B * H, n_pad), kWarps * 32, 0, stream>>>(
          static_cast<const T*>(x), sb, sh, si, H, N, D, n_pad, out, static_cast<T*>(unit));
      return cudaGetLastError();
    });
  });
}

cudaError_t run_delta(Dtype dtype, const Params& p, int D, cudaStream_t stream) {
  if (p.B * p.H == 0 || p.i_pad == 0) return cudaSuccess;
  return by_dtype(dtype, [&](auto tag) {
    return with_row_lanes(D, [&](auto lanes) {
      delta_kernel<decltype(tag), lanes><<<row_grid(p.B * p.H, p.i_pad), kWarps * 32, 0, stream>>>(p, D);
      return cudaGetLastError();
    });
  });
}

int64_t dq_accum_size(int B, int H, int I, int D) {
  return static_cast<int64_t>(B) * H * dq_tiled_rows(I) * D + D;
}

cudaError_t run_dq_finalize(Dtype dtype, const Params& p, int D, bool tiles, cudaStream_t stream) {
  if (p.B * p.H == 0 || p.I == 0) return cudaSuccess;
  if (tiles && D != 128) return cudaErrorInvalidValue;  // the tiles are the d128 Hopper backward's
  return by_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    if (tiles) {
      dq_finalize_tiles_kernel<T, 128><<<p.B * p.H * (dq_tiled_rows(p.I) / kDqTileRows), kWarps * 32, 0, stream>>>(p);
      return cudaGetLastError();
    }
    return with_row_lanes(D, [&](auto lanes) {
      dq_finalize_kernel<T, lanes><<<row_grid(p.B * p.H, p.I), kWarps * 32, 0, stream>>>(p, D);
      return cudaGetLastError();
    });
  });
}

cudaError_t run_lin_rows(Dtype dtype, const void* x, int64_t sb, int64_t sh, int64_t si, const bool* mask,
                         const float* mu, int B, int H, int N, int D, int W, int n_pad, int L, int shift, void* dst,
                         cudaStream_t stream) {
  if (B * H == 0 || n_pad == 0) return cudaSuccess;
  return by_half_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    lin_rows_kernel<T><<<row_grid(B * H, n_pad), kWarps * 32, 0, stream>>>(
        static_cast<const T*>(x), sb, sh, si, mask, mu, H, N, D, W, n_pad, L, shift, static_cast<T*>(dst));
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

cudaError_t run_lin_g(Dtype dtype, const void* dout, const void* out, const float* inv_l, const float* mu,
                      const float* cmax, int B, int H, int n, int D, int n_pad, int L, int shift, float* delta,
                      unsigned* gmax, void* g, float* scale, cudaStream_t stream) {
  if (B * H == 0 || n_pad == 0) return cudaSuccess;
  return by_half_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const auto* dO = static_cast<const T*>(dout);
    lin_delta_kernel<T><<<row_grid(B * H, n_pad), kWarps * 32, 0, stream>>>(
        dO, static_cast<const T*>(out), inv_l, mu, H, n, D, n_pad, L, shift, delta, gmax);
    lin_g_kernel<T><<<row_grid(B * H, n_pad), kWarps * 32, 0, stream>>>(
        dO, inv_l, delta, gmax, cmax, H, n, D, n_pad, L, shift, static_cast<T*>(g), scale);
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
