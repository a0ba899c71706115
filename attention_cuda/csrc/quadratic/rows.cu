// Row-wise passes around the quadratic kernels: 1/|k| and the unit keys k/|k| that the kernels read,
// delta = rowsum(dO * O) for the backward, and the dQ epilogue (common/rows.cuh: how the rows are split).
#include <iterator>

#include "../common/launch.cuh"
#include "../common/rows.cuh"
#include "params.h"
#include "tiles.h"

namespace attn {
namespace {

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
// schedule, one in flight per warp. Two elements per lane and load left them well below a copy's rate
// (bench/notes/run-30.md).
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
  static_assert(16 * kVec == kRowMaxDim, "16 lanes a row at most");
  if (D <= kRowMaxDim) return f(std::integral_constant<int, 16>{});
  return cudaErrorInvalidValue;  // no head dim of a build (binding/register.cuh)
}

template <class T, int L>
__global__ void row_rnorm_kernel(const T* x, RowStrides xs, int H, int N, int D, int n_pad, float* out, T* unit) {
  using S = RowSlice<L>;
  const int bh = blockIdx.x;
  const T* head = x + xs.offset(bh / H, bh % H);
  const S s;
  for_each_row_group(n_pad, [&](int t0) {
    float v[S::kJ][kVec] = {};
    if (s.col < D) {
#pragma unroll
      for (int j = 0; j < S::kJ; ++j) ldg_vec(v[j], head + min(s.row(t0, j), N - 1) * xs.i + s.col);
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
  const T* o = static_cast<const T*>(p.o) + p.os.offset(bh / p.H, bh % p.H);
  const T* dout = static_cast<const T*>(p.dout) + p.dos.offset(bh / p.H, bh % p.H);
  const S s;
  for_each_row_group(p.i_pad, [&](int t0) {
    float a[S::kJ][kVec] = {}, b[S::kJ][kVec] = {};
    if (p.normalize && s.col < D) {
#pragma unroll
      for (int j = 0; j < S::kJ; ++j) {
        const int64_t row = min(s.row(t0, j), p.I - 1);
        ldg_vec(a[j], o + row * p.os.i + s.col);
        ldg_vec(b[j], dout + row * p.dos.i + s.col);
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
      if (s.leader() && i < p.i_pad) {
        // Zeros past I, like the forward's row vectors: finite, so that rows past the end weigh 0.
        const int64_t at = static_cast<int64_t>(bh) * p.i_pad + i;
        const float qs = i < p.I ? p.score.alpha * (p.rq ? p.rq[at] : 1.f) : 0.f, delta = i < p.I ? acc : 0.f;
        p.qscale[at] = qs;
        p.dp_scale[at] = p.dbias ? 1.f : qs;
        p.dp_offset[at] = p.dbias ? delta : delta * qs;
      }
    }
  });
}

// dq = c (U - rq^2 (q.U) q) from the fp32 accumulator U, unless |q| <= eps (then the normalisation is
// linear): the row-major U of the mma.sync backward and the d64 Hopper one.
template <class T, int L>
__global__ void dq_finalize_kernel(const Params p, int D) {
  using S = RowSlice<L>;
  const int bh = blockIdx.x;
  const T* q = static_cast<const T*>(p.q) + p.qs.offset(bh / p.H, bh % p.H);
  const float* u = p.dq_accum + static_cast<int64_t>(bh) * p.I * D;
  T* dq = static_cast<T*>(p.dq) + static_cast<int64_t>(bh) * p.I * D;
  const S s;
  for_each_row_group(p.I, [&](int t0) {
    float a[S::kJ][kVec] = {}, b[S::kJ][kVec] = {}, rq[S::kJ] = {};
#pragma unroll
    for (int j = 0; j < S::kJ; ++j) {
      const int t = min(s.row(t0, j), p.I - 1);
      if (s.col < D) {
        if (p.rq) ldg_vec(a[j], q + t * p.qs.i + s.col);
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
        for (int e = 0; e < kVec; ++e) out[e] = p.score.grad_scale * (b[j][e] - proj * a[j][e]);
        stg_vec(dq + static_cast<int64_t>(t) * D + s.col, out);
      }
    }
  });
}

// The same epilogue for the Hopper backward's tiles (dq_tile_slot): one block per 64-row tile,
// read whole with 16-byte loads and turned row-major in shared memory, then 8 rows per warp, 4
// columns per lane. Read row by row, each 8-byte read used half of its sectors.
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
  const T* q = static_cast<const T*>(p.q) + p.qs.offset(bh / p.H, bh % p.H);
  float a[kSteps][4] = {}, rq[kSteps] = {};
  if (p.rq) {
#pragma unroll
    for (int j = 0; j < kSteps; ++j) {
      const int t = t0 + r0 + j * kRowsPerLoad;
      ldg_vec(a[j], q + min(t, p.I - 1) * p.qs.i + col);
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
    for (int e = 0; e < 4; ++e) out[e] = p.score.grad_scale * (b[e] - proj * a[j][e]);
    if (t < p.I) stg_vec(dq + static_cast<int64_t>(t) * D + col, out);
  }
}

// The tiled epilogue at the head dims whose row in quadratic/tiles.h has the Hopper backwards (sm90), from
// row I of kTileTable on.
template <class T, size_t I = 0>
cudaError_t dq_finalize_tiles(const Params& p, int D, cudaStream_t stream) {
  if constexpr (I == std::size(kTileTable)) {
    return cudaErrorInvalidValue;
  } else {
    constexpr HeadDimTiles kRow = kTileTable[I];
    if constexpr (kRow.sm90) {
      if (D == kRow.d) {
        const int blocks = p.B * p.H * (dq_tiled_rows(p.I) / kDqTileRows);
        dq_finalize_tiles_kernel<T, kRow.d><<<blocks, kWarps * 32, 0, stream>>>(p);
        return cudaGetLastError();
      }
    }
    return dq_finalize_tiles<T, I + 1>(p, D, stream);
  }
}

}  // namespace

cudaError_t run_row_rnorm(Dtype dtype, const void* x, RowStrides xs, int B, int H, int N, int D, int n_pad,
                          float* out, void* unit, cudaStream_t stream) {
  if (B * H == 0 || n_pad == 0) return cudaSuccess;
  return by_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    return with_row_lanes(D, [&](auto lanes) {
      row_rnorm_kernel<T, lanes><<<row_grid(B * H, n_pad), kWarps * 32, 0, stream>>>(
          static_cast<const T*>(x), xs, H, N, D, n_pad, out, static_cast<T*>(unit));
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
  return static_cast<int64_t>(B) * H * dq_tiled_rows(I) * D;
}

cudaError_t run_dq_finalize(Dtype dtype, const Params& p, int D, bool tiles, cudaStream_t stream) {
  if (p.B * p.H == 0 || p.I == 0) return cudaSuccess;
  return by_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    if (tiles) return dq_finalize_tiles<T>(p, D, stream);
    return with_row_lanes(D, [&](auto lanes) {
      dq_finalize_kernel<T, lanes><<<row_grid(p.B * p.H, p.I), kWarps * 32, 0, stream>>>(p, D);
      return cudaGetLastError();
    });
  });
}

}  // namespace attn
