// The warp-per-rows machinery of the row passes around the kernels (quadratic/rows.cu, linear/lin_rows.cu):
// each warp owns kRowsPerWarp rows at a time and issues the loads of all of them before it reduces any.
// The grid is (batch x head, row blocks), rows striding past the grid's 65535-block height, so no
// thread divides a 64-bit row index (bench/notes/run-09.md). Included by those two translation units and
// the decode kernel's (decode/decode.cu, which sums a row's lanes with lanes_sum): the helpers are theirs
// alone (an unnamed namespace), as their kernels are.
#pragma once
#include <algorithm>

#include "mma.cuh"
#include "params.h"

namespace attn {
namespace {

constexpr int kWarps = 8, kRowsPerWarp = 8, kRowsPerBlock = kWarps * kRowsPerWarp;

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

// The grid of a row pass over `rows` rows of each of `heads` (batch, head) pairs.
dim3 row_grid(int heads, int rows) {
  return dim3(heads, std::min((rows + kRowsPerBlock - 1) / kRowsPerBlock, 65535));
}

}  // namespace
}  // namespace attn
