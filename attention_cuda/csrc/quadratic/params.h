// What the host hands the quadratic (tiled) kernels and the row passes around them. Plain C++ (no torch
// headers), so the .cu files build without torch.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

#include "../common/params.h"
#include "../score/score.cuh"

namespace attn {

// Heads per section of a causal grid's block order (block_slot, quadratic/block.cuh) whose blocks
// stream head_bytes per head: as many as stream 64 MB together, about L2's size (the resident blocks of
// a head walk its rows in step, so they hold far less at a time). Longest blocks first over all heads
// at once would keep the grid's tail shortest, but then the resident blocks read every head's
// operands from memory; sections of this size kept the tail short and the operands in L2
// (bench/notes/run-26.md).
inline int section_heads(int heads, int64_t head_bytes) {
  constexpr int64_t kL2Part = int64_t{64} << 20;
  const int64_t fit = kL2Part / (head_bytes > 1 ? head_bytes : 1);
  return fit < 1 ? 1 : fit < heads ? static_cast<int>(fit) : heads;
}

struct Params {
  int B, H, Hkv, I, J;
  int group;  // H / Hkv query heads per kv head

  // q (B,H,I,D), k and v (B,Hkv,J,D), each with its strides.
  const void *q, *k, *v;
  RowStrides qs, ks, vs;
  const uint8_t* mask;  // (B, J) bool, True = keep; null for none
  int64_t mask_sb;
  const void* bias;  // (B,H,I,J) in q's dtype (any strides, 0 on broadcast dims); null for none
  int64_t bias_sb, bias_sh, bias_si, bias_sj;
  // 1 / max(|row|, eps) of q (B,H,i_pad) and k (B,Hkv,j_pad); null when q and k are used as given.
  // With them, k holds the unit rows k * rk (run_row_rnorm), and rk is read only by dK's epilogue.
  float* rq;  // 1/|q|, written by the forward (from its Q tiles), read by run_delta and dQ's epilogue
  const float* rk;
  int i_pad, j_pad;
  bool causal;     // bottom-right aligned: query t sees keys s <= t + J - I
  int section;     // heads per section of the block order (block_slot, quadratic/block.cuh); 1 without causal
  bool normalize;  // divide by l = sum_s A_ts

  ScoreParams score;  // the logit's scales and the score function's constants (score/score.cuh)

  // o and dout (B,H,I,D), each with its strides. The forward writes o as (B,I,H,D) rows, the layout the
  // model's output projection reads (no copy around the op).
  void* o;
  RowStrides os;
  float* stat;  // (B,H,i_pad): 1/l, or with a running max m: m + log2(l) (score/score.cuh)

  const void* dout;
  RowStrides dos;
  // The backward's per-query vectors, (B,H,i_pad) each, written by run_delta from delta = rowsum(dO * O)
  // (0 without normalisation). qscale = alpha rq is the query's logit scale (alpha without the qk norm).
  // dL/dx is linear in dP - delta, and dS~ = dL/dx * qscale, so the kernels take dL/dx of dP dp_scale -
  // dp_offset, one FMA a score, with dp_scale = qscale and dp_offset = delta * qscale: that is dS~
  // (bench/notes/run-40.md). Where dL/dx is stored as the bias gradient, dp_scale = 1 and dp_offset =
  // delta, and the kernels scale by qscale after the store.
  float *qscale, *dp_scale, *dp_offset;
  float* dq_accum;    // fp32, zero on entry: sum of dS K as (B,H,I,D) rows or tiles (dq_tile_slot)
  void *dq, *dk, *dv; // dq (B,H,I,D), dk and dv (B,Hkv,J,D), contiguous
  void* dbias;        // (B,H,I,J) contiguous, zero on entry; null when no gradient is wanted
};

// Whether a call has the inputs a model's training never passes: a key mask, a bias or its gradient.
// The Hopper backwards have an instantiation without them (kExtras false), whose steps test none of
// them (bench/notes/run-45.md).
inline bool has_extras(const Params& p) { return p.mask || p.bias || p.dbias; }

// The Hopper backwards' dQ sums come in tiles of kDqTileRows (64) query rows x D, each laid out as the m64
// accumulator's registers hold them ([column tile of 8][thread][4]; at d128 warpgroup wg holds the D / 16
// column tiles from wg D / 16), so that a thread's four values of a column tile are one 16-byte slot: a
// step's tile goes to global memory with one 16-byte atomic per slot (d64), or to shared memory with
// conflict-free 16-byte stores and on with one bulk reduce per warpgroup (d128). A tile's 16-byte slot k
// holds rows `row` and row + 8 at columns `col` and col + 1, in that order:
constexpr int kDqTileRows = 64;
struct DqSlot {
  int row, col;
};
__host__ __device__ __forceinline__ DqSlot dq_tile_slot(int k) {
  static_assert(kDqTileRows == 64, "four warps of 16 rows");
  const int thread = k % 128;
  return {thread / 32 * 16 + thread % 32 / 4, k / 128 * 8 + thread % 4 * 2};
}
// A head's rows in that layout: I rounded up to whole tiles.
__host__ __device__ __forceinline__ int dq_tiled_rows(int I) {
  return (I + kDqTileRows - 1) / kDqTileRows * kDqTileRows;
}

// Row-wise passes around the tiled kernels (quadratic/rows.cu), for rows of up to kRowMaxDim elements (16
// lanes of 8): every backward runs them, and every forward under a qk norm.
constexpr int kRowMaxDim = 128;
// r = 1 / max(|x_row|, eps) for x (B,H,N,D) with strides xs, into out (B,H,n_pad), and the rows x r in x's
// type into unit (B,H,N,D), contiguous.
cudaError_t run_row_rnorm(Dtype dtype, const void* x, RowStrides xs, int B, int H, int N, int D, int n_pad,
                          float* out, void* unit, cudaStream_t stream);
// qscale, dp_scale and dp_offset (Params) from delta = rowsum(dO * O).
cudaError_t run_delta(Dtype dtype, const Params& p, int D, cudaStream_t stream);
// dq = c (U - rq^2 (q.U) q) from U = p.dq_accum (or c U without qk norm), into p.dq; U in rows, or in the
// Hopper backwards' tiles (`tiles`, dq_tile_slot). Each backward runs it after its kernel.
cudaError_t run_dq_finalize(Dtype dtype, const Params& p, int D, bool tiles, cudaStream_t stream);
// Size of dq_accum (fp32 elements) for either layout: rows, or whole 64-row tiles (the larger).
int64_t dq_accum_size(int B, int H, int I, int D);

}  // namespace attn
