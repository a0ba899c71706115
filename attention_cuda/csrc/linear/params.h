// What the host hands the linear form's kernels (linear/linear.cuh, linear/lin_sm90.cuh) and the row
// passes around them (linear/lin_rows.cu). Plain C++ (no torch headers).
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

#include "../common/params.h"

namespace attn {

// Fastmax's linear form (linear.cuh): one sweep over the chunks of a sequence, carrying moments.
// The sweep's rows per chunk; the chunk's own (diagonal) block is left to the tiled kernels. Set by
// attention_cuda/build.py (LINEAR_CHUNK), which the Python side sizes its tensors by.
#ifndef ATTN_LIN_CHUNK
#error "ATTN_LIN_CHUNK: compile with attention_cuda/build.py's defines()"
#endif
constexpr int kLinChunk = ATTN_LIN_CHUNK;

struct LinParams {
  int B, Hkv, chunks;
  // Chunk-major (B, chunks, heads, kLinChunk, D + 16) contiguous tensors, rows x' = [x, 1, 0 ...]:
  // the state is built from ux (features) and uw (weights), with upd_heads heads per kv head, and read
  // by rx (features) and rg (R2's weights), with rd_heads heads per kv head.
  const void *ux, *uw, *rx, *rg;
  int upd_heads, rd_heads;
  float* r1;     // (B, chunks, Hkv * rd_heads, kLinChunk, D + 16) fp32, zero on entry, or null: R1 += psi(x) . S
  int r1_tiles;  // 16-column tiles of w whose R1 output is wanted
  float* r2;     // (B, chunks, Hkv * rd_heads, kLinChunk, D) fp32, zero on entry, or null: R2 += d psi(x) . S g
  bool causal, reverse, second;  // second: the x^2 term (p = 2)
  float cu[3], cr[3];            // (c0, c1, c2) of the update's and the read's features
  int parts;                     // set by the launcher: CTAs over the second-order rows (per m-tile)
};

// The Hopper linear form in chunks with the state written out per chunk (lin_sm90.cuh).
struct LinStateParams {
  int B, Hkv, chunks, L, heads;  // heads: the rows' heads per kv head, all summed into one state
  const void *x, *w;             // chunk-major (B, chunks, Hkv * heads, L, D + 16)
  void* image;                   // (B, Hkv, causal ? chunks : 1, tiles, kTileBytes)
  bool causal, reverse, second;
  float coef[3];                 // (c0, c1, c2) of both sides, multiplied
  const float* scale;            // one fp32: the power of two the image holds S at (fp16's range)
};

struct LinReadParams {
  int B, Hkv, chunks, L, heads;  // heads: the readers' heads per kv head
  const void *x, *g;             // chunk-major (B, chunks, Hkv * heads, L, D + 16); g for R2
  const void* image;             // from lin_state
  bool per_chunk, second;
  float* r1;                     // (B, chunks, Hkv * heads, L, D + 16) fp32, or null: y = psi(x) S / scale
  int r1_cols;                   // columns of y written
  float* r2;                     // (B, chunks, Hkv * heads, L, D) fp32, or null: d psi(x) . S g / scale
  const float* scale;
};

// The linear form's row passes (linear/lin_rows.cu), between natural (B,H,n,D) rows (contiguous unless
// strides are given) and chunk-major (B, n_pad / L, H, L, W) ones whose row t holds row t - shift.
// x - mu[b,h] where mask (B,N) keeps the row (else 0); W = D + 16 adds the columns [keep, 0 ... 0].
cudaError_t run_lin_rows(Dtype dtype, const void* x, RowStrides xs, const bool* mask, const float* mu, int B,
                         int H, int N, int D, int W, int n_pad, int L, int shift, void* dst, cudaStream_t stream);
// out = (num + mu l + o / stat) / (l + 1 / stat) from y = [num, l] (fp32, D + 16 wide; the moments of the
// values less mu (B, H, D)) and the diagonal blocks' o and stat (null when there are none);
// inv_l = 1 / (l + 1 / stat) for every chunk row. out is (B,H,n,D) over (B,n,H,D) memory, the tiled
// forward's layout (the model merges the heads with a view).
cudaError_t run_lin_out(Dtype dtype, const float* y, const void* o, const float* stat, const float* mu, int B, int H,
                        int n, int D, int n_pad, int L, int shift, void* out, float* inv_l, cudaStream_t stream);
// g = [dO, -dO . (O - mu)] * inv_l / scale as D + 16 wide rows, scale a power of two from max |g| and
// *cmax; delta (chunk rows) and gmax (one word, zero on entry) are scratch.
cudaError_t run_lin_g(Dtype dtype, const void* dout, RowStrides ds, const void* out, RowStrides os,
                      const float* inv_l, const float* mu, const float* cmax, int B, int H, int n, int D, int n_pad,
                      int L, int shift, float* delta, unsigned* gmax, void* g, float* scale, cudaStream_t stream);
// out = acc[:, :D] * *scale + diag (diag may be null), back to natural rows.
cudaError_t run_lin_grad(Dtype dtype, const float* acc, int W, const float* scale, const void* diag, int B, int H,
                         int n, int D, int n_pad, int L, int shift, void* out, cudaStream_t stream);

}  // namespace attn
