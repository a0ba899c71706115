// Cosine's decode step: one query row per head over a key cache, forward only (attention_cuda._kernels.decode).
//
// A step reads each kept key's K and V row once and spends about 4 D FLOPs on it per query head: it is bound
// by memory, so it runs on CUDA cores, which reach the memory's rate at this arithmetic, rather than on the
// tensor cores, whose tiles (16 query rows for mma.sync, 64 for wgmma) would hold one real row. Unit q and k
// bound every logit by |alpha|, so each key's weight is exp2(y - |alpha|) with no running max; the keys are
// split into parts, one block each, whose sums of weights and weighted rows add as they are (a second, small
// kernel divides). The key mask is read as a predicate: a masked key's K and V rows are never loaded, so
// whatever its slot holds (garbage, NaN) meets no product, no copy of K and V zeroes it, and a masked run of
// keys costs its mask bytes alone.
#include <algorithm>
#include <type_traits>

#include "../common/launch.cuh"
#include "../common/rows.cuh"
#include "params.h"

namespace attn {
namespace {

constexpr int kDecodeWarps = 8, kDecodeThreads = kDecodeWarps * 32;
constexpr int kElems = 8;    // elements of a row per lane: 16 bytes of a 16-bit type (two 16-byte loads in fp32)
constexpr int kUnroll = 4;   // key rows each lane loads before it computes any: bytes in flight
constexpr int kMinKeys = 256;  // keys per part at least: a part's fixed cost (q, the block's sums, the merge's share)
constexpr int kMergeThreads = 256;
// Blocks an SM holds at least (__launch_bounds__), from the registers ptxas needs for G query heads (-Xptxas -v):
// 16-bit G = 1 fits 80 registers, three blocks an SM. Without the bound ptxas spent fewer registers there by
// using the first row loaded before it issued the rest, which left one row in flight per lane at a time.
template <class T, int G>
constexpr int kDecodeBlocks = G == 1 ? (sizeof(T) == 2 ? 3 : 2) : G == 2 ? 2 : 1;

// A lane's kElems elements of a row, as loaded.
template <class T>
struct Slice {
  static constexpr int kLoads = static_cast<int>(sizeof(T)) / 2;  // 16-byte loads
  uint4 u[kLoads];
};

// A 16-byte load that streams, where `pred` holds (else zeros): not kept in L1 (no row is read twice), with
// L2 fetching 256-byte sectors ahead. Predicated in PTX rather than branched around: the lanes of a warp
// differ in it (the key mask), and a branch per row cost reconvergence barriers in the loop.
__device__ __forceinline__ uint4 ld_stream(const void* p, bool pred) {
  uint4 r;
  asm volatile(
      "{\n"
      "  .reg .pred p;\n"
      "  setp.ne.b32 p, %5, 0;\n"
      "  mov.b32 %0, 0;\n  mov.b32 %1, 0;\n  mov.b32 %2, 0;\n  mov.b32 %3, 0;\n"
      "  @p ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
      "}\n"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p), "r"(static_cast<int>(pred)));
  return r;
}

template <class T>
__device__ __forceinline__ Slice<T> load_slice(const T* x, bool pred) {
  Slice<T> s;
#pragma unroll
  for (int i = 0; i < Slice<T>::kLoads; ++i) s.u[i] = ld_stream(reinterpret_cast<const uint4*>(x) + i, pred);
  return s;
}

template <class T>
__device__ __forceinline__ void to_floats(float (&f)[kElems], const Slice<T>& s) {
#pragma unroll
  for (int i = 0; i < Slice<T>::kLoads; ++i) {
    const uint32_t w[4] = {s.u[i].x, s.u[i].y, s.u[i].z, s.u[i].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if constexpr (sizeof(T) == 2) {
        const float2 h = Elem<T>::unpack(w[j]);
        f[8 * i + 2 * j] = h.x, f[8 * i + 2 * j + 1] = h.y;
      } else {
        f[4 * i + j] = __uint_as_float(w[j]);
      }
    }
  }
}

__device__ __forceinline__ float rnorm(float sum_squares) {  // 1 / max(|x|, eps), as F.normalize
  return rsqrtf(fmaxf(sum_squares, kNormEps * kNormEps));
}

// One block per (batch, kv head, part of the keys, G of the kv head's query heads): the part's sums of
// weights (den) and weighted value rows (num) for each of the G query heads. L lanes hold a row, kElems
// elements each (L the power of two that covers D), so a warp's load covers R = 32 / L consecutive keys;
// each lane loads kUnroll rows of K and V, R keys apart, before it computes any. A logit is the L lanes'
// sum (every lane of them gets the same bits), so they all compute the same weight. The warps take turns
// over the part's keys; at the end the lanes of a column slice, then the warps, sum their shares.
template <class T, int L, int G, bool kNorm>
__global__ void __launch_bounds__(kDecodeThreads, kDecodeBlocks<T, G>) decode_kernel(const DecodeParams p) {
  constexpr int R = 32 / L, kStep = kUnroll * R, kStride = kDecodeWarps * kStep;
  const int chunks = p.group / G;
  int blk = blockIdx.x;  // query heads fastest: the blocks that read the same K and V run together
  const int chunk = blk % chunks;
  blk /= chunks;
  const int split = blk % p.splits;
  blk /= p.splits;
  const int hkv = blk % p.Hkv, b = blk / p.Hkv, h0 = hkv * p.group + chunk * G;
  const int warp = threadIdx.x / 32, r = lane_id() / L, col = lane_id() % L * kElems;
  const bool has_col = col < p.D;  // L lanes cover D rounded up to a power of two (d96: 12 of 16)

  const int start = split * p.split_keys, end = min(start + p.split_keys, p.J);
  const uint8_t* keep_row = p.mask ? p.mask + b * p.mask_sb : nullptr;
  const auto kept = [&](int j) { return j < end && (!keep_row || __ldg(keep_row + j)); };

  // The u-th row of a warp's step at j0 is key j0 + u R + r, at kp + u k_row (vp + u v_row). The mask of the
  // next step is read while this step's rows arrive, the first step's while q does.
  int j0 = start + warp * kStep;
  const T* kp = static_cast<const T*>(p.k) + p.ks.offset(b, hkv) + (j0 + r) * p.ks.i + col;
  const T* vp = static_cast<const T*>(p.v) + p.vs.offset(b, hkv) + (j0 + r) * p.vs.i + col;
  const int64_t k_row = R * p.ks.i, v_row = R * p.vs.i;
  bool keep[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) keep[u] = kept(j0 + u * R + r);

  // This lane's columns of the query rows, scaled so that a logit is their dot product with k (times 1/|k|).
  float q[G][kElems];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    to_floats(q[g], load_slice(static_cast<const T*>(p.q) + p.qs.offset(b, h0 + g) + col, has_col));
    float c = p.alpha;
    if constexpr (kNorm) {
      float ss = 0.f;
#pragma unroll
      for (int e = 0; e < kElems; ++e) ss += q[g][e] * q[g][e];
      c *= rnorm(lanes_sum<L>(ss));
    }
#pragma unroll
    for (int e = 0; e < kElems; ++e) q[g][e] *= c;
  }

  float acc[G][kElems] = {}, den[G] = {};
  for (; j0 < end; j0 += kStride, kp += kDecodeWarps * kUnroll * k_row, vp += kDecodeWarps * kUnroll * v_row) {
    Slice<T> ks[kUnroll], vs[kUnroll];  // a masked key reads nothing: zeros, so no garbage meets a product
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      ks[u] = load_slice(kp + u * k_row, keep[u] && has_col);
      vs[u] = load_slice(vp + u * v_row, keep[u] && has_col);
    }
    bool next[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) next[u] = kept(j0 + kStride + u * R + r);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float kf[kElems], vf[kElems], dot[G + kNorm];
      to_floats(kf, ks[u]);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        dot[g] = 0.f;
#pragma unroll
        for (int e = 0; e < kElems; ++e) dot[g] = fmaf(q[g][e], kf[e], dot[g]);
      }
      if constexpr (kNorm) {
        dot[G] = 0.f;
#pragma unroll
        for (int e = 0; e < kElems; ++e) dot[G] = fmaf(kf[e], kf[e], dot[G]);
      }
#pragma unroll
      for (int x = 0; x < G + kNorm; ++x) dot[x] = lanes_sum<L>(dot[x]);
      float rk = 1.f;
      if constexpr (kNorm) rk = rnorm(dot[G]);
      to_floats(vf, vs[u]);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float w = keep[u] ? ex2(fmaf(dot[g], rk, -p.shift)) : 0.f;
        den[g] += w;
#pragma unroll
        for (int e = 0; e < kElems; ++e) acc[g][e] = fmaf(w, vf[e], acc[g][e]);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) keep[u] = next[u];
  }

  // The warp's rows, then the warps: every (head, part) row of num and den is written, an empty part's as 0.
#pragma unroll
  for (int o = L; o < 32; o *= 2) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      den[g] += __shfl_xor_sync(0xffffffffu, den[g], o);
#pragma unroll
      for (int e = 0; e < kElems; ++e) acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], o);
    }
  }
  __shared__ __align__(16) float s_num[kDecodeWarps][G][L * kElems];
  __shared__ float s_den[kDecodeWarps][G];
  if (r == 0) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float4* dst = reinterpret_cast<float4*>(&s_num[warp][g][col]);
      dst[0] = make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
      dst[1] = make_float4(acc[g][4], acc[g][5], acc[g][6], acc[g][7]);
    }
    if (lane_id() == 0) {
#pragma unroll
      for (int g = 0; g < G; ++g) s_den[warp][g] = den[g];
    }
  }
  __syncthreads();
  const int64_t row0 = (static_cast<int64_t>(b) * p.H + h0) * p.splits + split;  // head h0 + g: row0 + g splits
  for (int i = threadIdx.x; i < G * p.D; i += kDecodeThreads) {
    const int g = i / p.D, d = i % p.D;
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) s += s_num[w][g][d];
    p.num[(row0 + g * p.splits) * p.D + d] = s;
  }
  if (threadIdx.x < G) {
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) s += s_den[w][threadIdx.x];
    p.den[row0 + threadIdx.x * p.splits] = s;
  }
}

// out = sum num / sum den over the parts, 0 where no key was kept (den 0; a NaN den stays NaN). One block per
// (batch, head): thread (row, quad) sums columns 4 quad .. 4 quad + 3 of the parts row, row + rows, ...
template <class T>
__global__ void __launch_bounds__(kMergeThreads) decode_merge_kernel(const DecodeParams p) {
  const int bh = blockIdx.x, quads = p.D / 4, rows = kMergeThreads / quads;
  const int quad = threadIdx.x % quads, row = threadIdx.x / quads;
  const float4* num = reinterpret_cast<const float4*>(p.num + static_cast<int64_t>(bh) * p.splits * p.D) + quad;
  const float* den = p.den + static_cast<int64_t>(bh) * p.splits;
  float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
  float l = 0.f;
  if (row < rows) {
#pragma unroll 4
    for (int i = row; i < p.splits; i += rows) {
      const float4 x = num[static_cast<int64_t>(i) * quads];
      s.x += x.x, s.y += x.y, s.z += x.z, s.w += x.w;
      l += den[i];
    }
  }
  __shared__ float4 s_num[kMergeThreads];
  __shared__ float s_den[kMergeThreads];
  s_num[threadIdx.x] = s, s_den[threadIdx.x] = l;
  __syncthreads();
  if (row != 0) return;
  for (int i = 1; i < rows; ++i) {
    const float4 x = s_num[i * quads + quad];
    s.x += x.x, s.y += x.y, s.z += x.z, s.w += x.w;
    l += s_den[i * quads + quad];
  }
  if (l == 0.f) s = make_float4(0.f, 0.f, 0.f, 0.f), l = 1.f;
  T* out = static_cast<T*>(p.out) + static_cast<int64_t>(bh) * p.D + 4 * quad;
  if constexpr (sizeof(T) == 2) {
    *reinterpret_cast<uint2*>(out) = make_uint2(Elem<T>::pack(s.x / l, s.y / l), Elem<T>::pack(s.z / l, s.w / l));
  } else {
    *reinterpret_cast<float4*>(out) = make_float4(s.x / l, s.y / l, s.z / l, s.w / l);
  }
}

// f(kernel, G) for the decode kernel of (dtype, D, group, qk_norm): L lanes a row (the power of two of
// kElems-element slices that covers D) and G query heads a block, the most of 8, 4, 2, 1 that divides the
// group (more would not fit the registers; a larger group's blocks of the same keys run side by side, so
// their K and V rows come from L2).
template <class F>
cudaError_t with_decode_kernel(Dtype dtype, const DecodeParams& p, F&& f) {
  return by_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const auto heads = [&](auto lanes) {
      constexpr int L = decltype(lanes)::value;
      const auto norm = [&](auto g) {
        constexpr int G = decltype(g)::value;
        return p.qk_norm ? f(&decode_kernel<T, L, G, true>, G) : f(&decode_kernel<T, L, G, false>, G);
      };
      if (p.group % 8 == 0) return norm(std::integral_constant<int, 8>{});
      if (p.group % 4 == 0) return norm(std::integral_constant<int, 4>{});
      if (p.group % 2 == 0) return norm(std::integral_constant<int, 2>{});
      return norm(std::integral_constant<int, 1>{});
    };
    if (p.D <= 2 * kElems) return heads(std::integral_constant<int, 2>{});
    if (p.D <= 4 * kElems) return heads(std::integral_constant<int, 4>{});
    if (p.D <= 8 * kElems) return heads(std::integral_constant<int, 8>{});
    static_assert(16 * kElems == kDecodeMaxDim, "16 lanes a row at most");
    if (p.D <= kDecodeMaxDim) return heads(std::integral_constant<int, 16>{});
    return cudaErrorInvalidValue;
  });
}

}  // namespace

cudaError_t decode_splits(Dtype dtype, const DecodeParams& p, int* splits) {
  int dev = 0, sms = 0, resident = 0;
  int64_t streams = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (err == cudaSuccess) {
    err = with_decode_kernel(dtype, p, [&](auto kernel, int heads) {
      streams = int64_t{p.B} * p.Hkv * (p.group / heads);
      return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, kDecodeThreads, 0);
    });
  }
  if (err != cudaSuccess) return err;
  // At most one wave: with more blocks than the GPU holds at once, the last wave's few blocks would stream
  // alone at a fraction of the memory's rate.
  const int64_t fill = int64_t{sms} * std::max(resident, 1) / std::max<int64_t>(streams, 1);
  *splits = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(fill, p.J / kMinKeys)));
  return cudaSuccess;
}

cudaError_t run_decode(Dtype dtype, const DecodeParams& p, cudaStream_t stream) {
  if (!decode_takes(p.D) || p.splits < 1 || p.split_keys < 1) return cudaErrorInvalidValue;
  const cudaError_t err = with_decode_kernel(dtype, p, [&](auto kernel, int heads) {
    return launch(kernel, int64_t{p.B} * p.Hkv * (p.group / heads) * p.splits, kDecodeThreads, 0, p, stream);
  });
  if (err != cudaSuccess) return err;
  return by_dtype(dtype, [&](auto tag) {
    return launch(&decode_merge_kernel<decltype(tag)>, int64_t{p.B} * p.H, kMergeThreads, 0, p, stream);
  });
}

}  // namespace attn
