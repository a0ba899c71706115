// Score policies (how a logit becomes a weight, and its derivative) and the per-element pieces that
// the forward and backward kernels share: visibility and the additive bias.
#pragma once
#include "mma.cuh"
#include "params.h"

namespace attn {

// Score policies. The forward computes weights A(y) of logits y and sums them as rounded for the
// P V product into l; the backward recomputes P = A(y) / l from the saved per-row stat:
//  - fixed-shift weights (exp family without a row max, and the polynomial): stat = 1 / l, and
//    P = round(A(y)) * stat: exactly the normalised weights the forward multiplied V with;
//  - exp family with a running row max m: stat = m + log2(l), P = exp2(y - stat).
// dlogit gives dL/dx from P, y and dP - delta (delta = rowsum(dO * O), 0 without normalisation).

// A = exp2(y - shift), y in log2 units (alpha and beta carry log2(e)); dL/dx = P (dP - delta).
template <bool kRowMax_>
struct ExpScore {
  static constexpr bool kExp = true, kRowMax = kRowMax_;
  float shift;
  __device__ explicit ExpScore(const Params& p) : shift(p.shift) {}
  __device__ float weight(float y) const { return ex2(y - shift); }
  __device__ float dlogit(float P, float, float dp_minus_delta, float) const { return P * dp_minus_delta; }
};

// Fastmax: A = a0 + a1 y + a2 y^2 (y in natural units), dL/dx = (dP - delta) / l * f'(y).
struct PolyScore {
  static constexpr bool kExp = false, kRowMax = false;
  float a0, a1, a2;
  __device__ explicit PolyScore(const Params& p) : a0(p.a0), a1(p.a1), a2(p.a2) {}
  __device__ float weight(float y) const { return fmaf(y, fmaf(a2, y, a1), a0); }
  __device__ float dlogit(float, float y, float dp_minus_delta, float stat) const {
    return dp_minus_delta * stat * fmaf(2.f * a2, y, a1);
  }
};

// Visibility of (query t, key s) = s <= last_key(t) and key s is kept. last_key folds in both sequence
// ends and the (bottom-right aligned) causal diagonal; it is -1 for rows past the end.
__device__ __forceinline__ int last_key(const Params& p, int t) {
  return t >= p.I ? -1 : p.causal ? min(t + p.J - p.I, p.J - 1) : p.J - 1;
}

// All kN accumulator tiles' column bits, as visible_cols sets them (two per tile).
template <int kN>
constexpr uint32_t kAllCols = kN == 16 ? ~0u : (1u << 2 * kN) - 1;

// Bit 2*n + c set when key n0 + 8*n + c + 2*tq is inside the sequence and kept by the mask (`mask_row`
// is the batch's row of the key mask, or null): the columns one thread holds in kN accumulator tiles.
// The whole warp calls it for one tile: lane l reads keys n0 + 4 l .. 4 l + 3 (four coalesced byte
// loads, where each thread alone would need 2 kN), and four ballots hand every thread its bits: its
// column 8 n + 2 tq + c lies in lane 2 n + tq / 2, byte 2 (tq % 2) + c.
template <int kN>
__device__ __forceinline__ uint32_t visible_cols(const Params& p, const uint8_t* mask_row, int n0, int tq) {
  static_assert(kN <= 16, "32 bits: at most 128 keys, four per lane");
  const int s0 = n0 + 4 * (threadIdx.x % 32);
  uint32_t by[4];
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    const int s = s0 + b;
    by[b] = __ballot_sync(~0u, s < n0 + 8 * kN && s < p.J && (mask_row == nullptr || mask_row[s]));
  }
  const uint32_t lo = ((tq & 1) ? by[2] : by[0]) >> (tq / 2), hi = ((tq & 1) ? by[3] : by[1]) >> (tq / 2);
  const uint32_t bits = (lo & 0x55555555u) | (hi & 0x55555555u) << 1;
  return bits & kAllCols<kN>;
}

// bias[b, h, t, s] for a visible pair (so t < I and s < J).
template <class T>
__device__ __forceinline__ float bias_at(const Params& p, const T* bias_bh, int t, int s) {
  return Elem<T>::to_float(bias_bh[t * p.bias_si + s * p.bias_sj]);
}

__host__ __device__ __forceinline__ int cdiv(int a, int b) { return (a + b - 1) / b; }

// Block order of the tiled kernels: the grid walks sections of p.section heads one after another,
// and within a section the block rank (0 = the longest block under causal) is slowest and the head
// fastest. Under causal, ranks first to last over all heads at once keep the grid's tail short, but the
// blocks resident at a time then read every head's operands from memory (256 MB of K/V for the
// forward at d128 n16384), so a section holds what L2 can share (section_heads, params.h). Without causal
// every block is as long, and a section is one head.
struct BlockSlot {
  int head, rank;
};
__device__ __forceinline__ BlockSlot block_slot(const Params& p, int heads, int ranks) {
  const int first = blockIdx.x / (p.section * ranks) * p.section, n = min(p.section, heads - first);
  const int r = blockIdx.x - first * ranks;
  return {first + r % n, r / n};
}

template <class T>
constexpr Dtype dtype_of() {
  return sizeof(T) == 4 ? Dtype::kF32 : std::is_same_v<T, __half> ? Dtype::kF16 : Dtype::kBF16;
}

// ---------------------------------------------------------------------------------------------------
// Host side. f(PolicyTag<P>{}) for the score policy P that `score` names: the forward and the backward
// pick their kernel instantiation the same way.
template <class P>
struct PolicyTag {
  using type = P;
};
template <class F>
cudaError_t with_policy(Score score, F&& f) {
  switch (score) {
    case Score::kExpFixed: return f(PolicyTag<ExpScore<false>>{});
    case Score::kExpRowMax: return f(PolicyTag<ExpScore<true>>{});
    case Score::kPoly: return f(PolicyTag<PolyScore>{});
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
