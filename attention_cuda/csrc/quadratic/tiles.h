// Every choice of the kernels that depends on the head dim: one row per head dim (kTileTable), which the
// quadratic kernels' configurations (FwdConfig, BwdConfig here; Sm90Fwd, Sm90Bwd in their files, which add the
// shared-memory layouts that follow), the linear form's (LinConfig, LinState90, LinRead90), the registry
// (which kernels a head dim has: binding/register.cuh) and the row passes (quadratic/rows.cu) read; and the
// choices that depend on the element type alone. A head dim without a row does not compile: a new head dim in
// build.py's HEAD_DIMS takes a row here, and nowhere else.
#pragma once

namespace attn {

struct HeadDimTiles {
  int d;
  // mma.sync forward (sm_80+): keys per K/V tile, bounded by the S and O registers a warp holds; and
  // whether a warp's Q fragments stay in registers (else re-read from shared memory each tile).
  int fwd_cols;
  bool fwd_q_in_regs;
  // mma.sync backward: whether a warp's K/V fragments stay in registers (else re-read each step), and
  // the fp32 (TF32) kernel's queries per step.
  bool bwd_kv_in_regs;
  int bwd_rows_f32;
  // The wgmma kernels (sm_90a, fp16/bf16 only), where sm90 is set:
  //  - forward: consumer warpgroups of 64 query rows. At d64 a warpgroup's exps take about as long as
  //    its products, so a third warpgroup keeps the tensor cores fed; d128 has registers for two;
  //  - backward, ws: the warp-specialised kernel (bwd_ws_sm90.cuh: a producer warp, no block barrier,
  //    steps of 128 queries), faster at d64 (bench/notes/run-38.md, run-39.md); at d128 a consumer has
  //    no registers for its accumulators at that step, and the two-warpgroup kernel (bwd_sm90.cuh)
  //    splits dQ by columns.
  bool sm90;
  int sm90_fwd_wgs;
  bool sm90_bwd_ws;
  // Fastmax's linear form (fp16/bf16). A head dim without a kernel of it is left out of the extension's
  // sweep_head_dims or chunked_head_dims, and the plan sends no call there:
  //  - the sweep (linear/linear.cuh), where sweep is set: the second-order rows a warp keeps, 12 registers
  //    per feature group of its state and the state's B fragments; and whether row -1 rides in the part's
  //    CTAs (fold) rather than CTAs of its own. The fold halves the CTAs at d32, where one part holds every
  //    row; at d16 and d64 the registers it takes cost more than the CTAs it saves (bench/notes/run-12.md);
  //  - the chunked kernels (linear/lin_sm90.cuh, sm_90a; their wgmma of N = D + 8 needs its instance in
  //    common/wgmma.cuh), where chunked is set: lin_state's image tiles per warpgroup (its accumulators,
  //    D + 8 columns a tile), and lin_read's blocks per SM for R1: two at d64, where their registers and
  //    shared memory fit and they overlap each other's waits.
  bool sweep;
  int sweep_rows;
  bool sweep_fold;
  bool chunked;
  int chunked_tiles;
  int chunked_r1_blocks;
};

inline constexpr HeadDimTiles kTileTable[] = {
    //    mma.sync fwd: mma.sync bwd:        wgmma:                    sweep:               chunked:
    // D  keys  Q regs  K/V regs  fp32 rows  kernels  fwd WGs  bwd ws  kernel  rows  fold   kernels  tiles  R1 blocks
    {16,  64,   true,   true,     32,        false,   0,       false,  true,   2,    false, false,   0,     0},
    {32,  64,   true,   true,     32,        false,   0,       false,  true,   4,    true,  false,   0,     0},
    {64,  64,   true,   true,     32,        true,    3,       true,   true,   2,    false, true,    3,     2},
    {96,  32,   false,  false,    16,        false,   0,       false,  true,   1,    false, false,   0,     0},
    {128, 32,   false,  false,    16,        true,    2,       false,  true,   1,    false, true,    2,     1},
};

constexpr HeadDimTiles tiles_of(int D) {
  for (const HeadDimTiles& row : kTileTable)
    if (row.d == D) return row;
  return HeadDimTiles{};
}

// The choices by element type, the same at every head dim (T: __half, __nv_bfloat16 or float; fp32 runs
// as TF32, whose operands take twice the bytes per element, so its tiles are smaller).
template <class T, int D>
struct Tiles {
  static constexpr HeadDimTiles kRow = tiles_of(D);
  static_assert(kRow.d == D, "no row for this head dim in kTileTable (quadratic/tiles.h)");
  static constexpr bool k16 = sizeof(T) == 2;
  // mma.sync forward: 4 warps of 32 query rows (K/V fragments serve 2 m-tiles), fp32 16 rows.
  static constexpr int kFwdWarps = 4, kFwdRows = k16 ? 128 : 64;
  // mma.sync backward: a warp per 16 keys, queries per step.
  static constexpr int kBwdWarps = k16 ? 8 : 4, kBwdCols = 16 * kBwdWarps, kBwdRows = k16 ? 64 : kRow.bwd_rows_f32;
  // wgmma: forward K/V tiles of 128 keys; backward blocks of 128 keys (two warpgroups of 64) and steps of
  // 64 queries, one dQ tile (kDqTileRows, quadratic/params.h).
  static constexpr bool kSm90 = k16 && kRow.sm90;
  static constexpr int kSm90FwdWGs = kRow.sm90 ? kRow.sm90_fwd_wgs : 1;  // 1: no kernel (never launched)
  static constexpr int kSm90FwdCols = 128, kSm90BwdWarps = 8, kSm90BwdCols = 128, kSm90BwdRows = 64;
};

// The mma.sync kernels' configurations.
template <class T, int D>
struct FwdConfig {
  using Tl = Tiles<T, D>;
  static constexpr int kWarps = Tl::kFwdWarps, kRows = Tl::kFwdRows, kCols = Tl::kRow.fwd_cols;
  static constexpr bool kQInRegs = Tl::kRow.fwd_q_in_regs;
};
template <class T, int D>
struct BwdConfig {
  using Tl = Tiles<T, D>;
  static constexpr int kWarps = Tl::kBwdWarps, kCols = Tl::kBwdCols, kRows = Tl::kBwdRows;
  static constexpr bool kKVInRegs = Tl::kRow.bwd_kv_in_regs;
};

}  // namespace attn
