// What the host hands the kernels. Plain C++ (no torch headers), so the .cu files build without torch.
#pragma once
#include <cstdint>
#include <vector>

#include <cuda_runtime.h>

namespace attn {

enum class Dtype { kF16, kBF16, kF32 };

// Score variants (score.cuh), chosen per call on the host.
enum class Score {
  kExpFixed,   // A = exp2(y - shift) with a fixed shift: bounded logits (unit q, k, no bias) or unnormalised
  kExpRowMax,  // A = exp2(y - running row max): logits with no known bound (attn_bias, raw q/k)
  kPoly,       // A = a0 + a1 x + a2 x^2
};

// Float row vectors over (batch, head, row) are stored with rows padded to a multiple of 4 so that every
// tile of them starts 16-byte aligned for cp.async. The pad entries are written too (as for an empty
// row), so the backward never reads an unwritten value.
inline int pad4(int n) { return (n + 3) / 4 * 4; }

// Heads per section of a causal grid's block order (block_slot, score.cuh) whose blocks stream
// head_bytes per head: as many as stream 64 MB together, about L2's size (the resident blocks of a
// head walk its rows in step, so they hold far less at a time). H200, bf16 d128 n16384 causal forward
// (8 MB of K/V per head): sections of 8 heads 3.33-3.64 ms, of 2 or 4 3.34-3.80, all 32 heads at once
// 3.63-4.02 (bench/NOTES.md run 26).
inline int section_heads(int heads, int64_t head_bytes) {
  constexpr int64_t kL2Part = int64_t{64} << 20;
  const int64_t fit = kL2Part / (head_bytes > 1 ? head_bytes : 1);
  return fit < 1 ? 1 : fit < heads ? static_cast<int>(fit) : heads;
}

constexpr float kNormEps = 1e-12f;  // same clamp as torch.nn.functional.normalize
// Query rows per tile of dq_accum in the Hopper backward's layout (dq_tile_slot, mma.cuh).
constexpr int kDqTileRows = 64;

struct Params {
  int B, H, Hkv, I, J;
  int group;  // H / Hkv query heads per kv head

  // q (B,H,I,D), k and v (B,Hkv,J,D): element strides of batch, head and row; the head dim is contiguous.
  const void *q, *k, *v;
  int64_t q_sb, q_sh, q_si, k_sb, k_sh, k_sj, v_sb, v_sh, v_sj;
  const uint8_t* mask;  // (B, J) bool, True = keep; null for none
  int64_t mask_sb;
  const void* bias;  // (B,H,I,J) in q's dtype (any strides, 0 on broadcast dims); null for none
  int64_t bias_sb, bias_sh, bias_si, bias_sj;
  // 1 / max(|row|, eps) of q (B,H,i_pad) and k (B,Hkv,j_pad); null when q and k are used as given.
  // With them, k holds the unit rows k * rk (run_row_rnorm), and rk is read only by dK's epilogue.
  float* rq;  // 1/|q|, written by the forward (from its Q tiles), read by the backward
  const float* rk;
  int i_pad, j_pad;
  bool causal;     // bottom-right aligned: query t sees keys s <= t + J - I
  int section;     // heads per section of the block order (block_slot, score.cuh); 1 without causal
  bool normalize;  // divide by l = sum_s A_ts

  // Logit y = alpha * (q.k) * rq + beta * bias, k the unit rows under the qk norm (log2 domain for the exp
  // family: alpha, beta carry log2(e)); exp family: A = exp2(y - shift); poly: A = a0 + a1 y + a2 y^2.
  float alpha, beta, shift, a0, a1, a2;
  // The backward's dS~ = dL/dx * d(y)/d(q.k) carries alpha; grad_scale = d(x)/d(q_n.k_n) / alpha turns
  // it into natural units once, in the dq/dk epilogues.
  float grad_scale;

  void* o;      // (B,H,I,D) contiguous
  float* stat;  // (B,H,i_pad): 1/l, or with a running max m: m + log2(l) (score.cuh)

  const void* dout;   // (B,H,I,D) contiguous
  float* delta;       // (B,H,i_pad): rowsum(dO * O) when normalising, else 0
  float* dq_accum;    // fp32, zero on entry: sum of dS K as (B,H,I,D) rows (+ a scratch row) or tiles
  void *dq, *dk, *dv; // dq (B,H,I,D), dk and dv (B,Hkv,J,D), contiguous
  void* dbias;        // (B,H,I,J) contiguous, zero on entry; null when no gradient is wanted
};

// Fastmax's linear form (linear.cuh): one sweep over the chunks of a sequence, carrying moments.
// The sweep's rows per chunk; the chunk's own (diagonal) block is left to the tiled kernels.
constexpr int kLinChunk = 128;

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

using FwdFn = cudaError_t (*)(const Params&, Score, cudaStream_t);
using BwdFn = cudaError_t (*)(const Params&, Score, cudaStream_t);
using LinFn = cudaError_t (*)(LinParams, cudaStream_t);
using LinStateFn = cudaError_t (*)(const LinStateParams&, cudaStream_t);
using LinReadFn = cudaError_t (*)(const LinReadParams&, cudaStream_t);

// Each compiled (dtype, head dim) registers its kernels at load time; builds may compile a subset. The
// linear form exists for fp16 and bf16 only (lin is null for fp32), its chunked Hopper kernels (state,
// read) where the build has them (sm_90a, fp16/bf16, d64 and d128; null elsewhere).
struct Kernels {
  FwdFn fwd;
  BwdFn bwd;
  LinFn lin;
  LinStateFn state;
  LinReadFn read;
};
bool register_kernels(Dtype dtype, int head_dim, const Kernels& kernels);
bool find_kernels(Dtype dtype, int head_dim, FwdFn* fwd, BwdFn* bwd, LinFn* lin = nullptr);
std::vector<int64_t> compiled_head_dims(Dtype dtype);
// The chunked kernels, where registered and the Hopper kernels run (use_sm90).
bool find_chunked(Dtype dtype, int head_dim, LinStateFn* state, LinReadFn* read);
// Whether to run the Hopper (wgmma) kernels where they are built (macro ATTN_SM90A): on a compute
// capability 9.0 device, unless the environment sets ATTN_PORTABLE_KERNELS=1 (the mma.sync kernels).
bool use_sm90();

// Row-wise helpers (aux.cu).
// r = 1 / max(|x_row|, eps) for x (B,H,N,D) with element strides (sb, sh, si), into out (B,H,n_pad), and
// the rows x r in x's type into unit (B,H,N,D), contiguous.
cudaError_t run_row_rnorm(Dtype dtype, const void* x, int64_t sb, int64_t sh, int64_t si, int B, int H, int N,
                          int D, int n_pad, float* out, void* unit, cudaStream_t stream);
// delta = rowsum(dO * O) (0 when not normalising), into p.delta.
cudaError_t run_delta(Dtype dtype, const Params& p, int D, cudaStream_t stream);
// dq = c (U - rq^2 (q.U) q) from U = p.dq_accum (or c U without qk norm), into p.dq; U in rows, or in the
// Hopper backward's tiles (`tiles`, dq_tile_slot). Each backward runs it after its kernel.
cudaError_t run_dq_finalize(Dtype dtype, const Params& p, int D, bool tiles, cudaStream_t stream);
// Size of dq_accum (fp32 elements) for either backward's layout: rows plus the scratch row that takes
// the Hopper backward's atomics for rows past I (so that they need no branch), or whole 64-row tiles.
int64_t dq_accum_size(int B, int H, int I, int D);

// The linear form's row passes (aux.cu), between natural (B,H,n,D) rows (contiguous unless strides are
// given) and chunk-major (B, n_pad / L, H, L, W) ones whose row t holds row t - shift.
// x - mu[b,h] where mask (B,N) keeps the row (else 0); W = D + 16 adds the columns [keep, 0 ... 0].
cudaError_t run_lin_rows(Dtype dtype, const void* x, int64_t sb, int64_t sh, int64_t si, const bool* mask,
                         const float* mu, int B, int H, int N, int D, int W, int n_pad, int L, int shift, void* dst,
                         cudaStream_t stream);
// out = (num + mu l + o / stat) / (l + 1 / stat) from y = [num, l] (fp32, D + 16 wide; the moments of the
// values less mu (B, H, D)) and the diagonal blocks' o and stat (null when there are none);
// inv_l = 1 / (l + 1 / stat) for every chunk row.
cudaError_t run_lin_out(Dtype dtype, const float* y, const void* o, const float* stat, const float* mu, int B, int H,
                        int n, int D, int n_pad, int L, int shift, void* out, float* inv_l, cudaStream_t stream);
// g = [dO, -dO . (O - mu)] * inv_l / scale as D + 16 wide rows, scale a power of two from max |g| and
// *cmax; delta (chunk rows) and gmax (one word, zero on entry) are scratch.
cudaError_t run_lin_g(Dtype dtype, const void* dout, const void* out, const float* inv_l, const float* mu,
                      const float* cmax, int B, int H, int n, int D, int n_pad, int L, int shift, float* delta,
                      unsigned* gmax, void* g, float* scale, cudaStream_t stream);
// out = acc[:, :D] * *scale + diag (diag may be null), back to natural rows.
cudaError_t run_lin_grad(Dtype dtype, const float* acc, int W, const float* scale, const void* diag, int B, int H,
                         int n, int D, int n_pad, int L, int shift, void* out, cudaStream_t stream);

}  // namespace attn
