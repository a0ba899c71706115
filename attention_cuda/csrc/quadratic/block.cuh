// What the quadratic kernels' skeletons (mma.sync and wgmma, forward and backward) share per element and
// per block: which (query, key) pairs are visible, the additive bias, and the order of the blocks.
#pragma once
#include "../common/launch.cuh"
#include "../common/mma.cuh"
#include "../score/score.cuh"
#include "params.h"
#include "tiles.h"

namespace attn {

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

// Block order of the tiled kernels: the grid walks sections of p.section heads one after another,
// and within a section the block rank (0 = the longest block under causal) is slowest and the head
// fastest. Under causal, ranks first to last over all heads at once keep the grid's tail short, but the
// blocks resident at a time then read every head's operands from memory (256 MB of K/V for the
// forward at d128 n16384), so a section holds what L2 can share (section_heads, quadratic/params.h).
// Without causal every block is as long, and a section is one head.
struct BlockSlot {
  int head, rank;
};
__device__ __forceinline__ BlockSlot block_slot(const Params& p, int heads, int ranks) {
  const int first = blockIdx.x / (p.section * ranks) * p.section, n = min(p.section, heads - first);
  const int r = blockIdx.x - first * ranks;
  return {first + r % n, r / n};
}

}  // namespace attn
