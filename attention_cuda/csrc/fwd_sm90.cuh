// Forward on Hopper (sm_90a): the mma.sync forward's structure (fwd.cuh) with both products on
// warpgroup MMAs reading K and V straight from swizzled shared memory.
//
// One block per (batch, head, kRows query rows): kWG warpgroups of 64 rows each, each warp 16 of them,
// so S = Q K^T (wgmma, Q and K both K-major in shared memory) lands in exactly the registers the
// mma.sync kernel has it in (kMT = 1) and the per-element work is the same function (fwd_scores). The
// weights go back as register A operands of O += P V (V read MN-major: keys are its rows). K/V tiles
// stream through kStages cp.async stages, kStages - 2 tiles ahead of the math, loaded by all
// threads, one barrier per tile. P V runs asynchronously: a warpgroup issues it and goes on to the
// barrier, the next tile's loads and S = Q K^T; its wait for S also covers the P V before it. Tile
// j + kStages - 2 reuses the stage of tile j - 2, whose P V every warpgroup has waited for before the
// barrier of tile j. Other warpgroups' exps overlap one warpgroup's products. Row sums: FADDs of the
// weights as rounded for P V (unpacked from the A operand registers), so the semantics are the
// mma.sync kernel's. Under causal, a warpgroup skips the tiles its rows cannot see.
#pragma once
#include "fwd.cuh"
#include "wgmma.cuh"

namespace attn {

// Block shape: 3 warpgroups of 64 query rows, K/V tiles of 64 keys, bounded by registers (a warpgroup
// holds S: kCols/2, O: D/2 and P: kCols/4 registers per thread, at most 65536 / (128 kWG)): 3 x 64 fits
// d128 in 168 registers without spills. H200, bf16, b1 h32 N4096 d128: 370 TF (2 x 64: 353; 2 x 128:
// 371 but spills; the mma.sync forward: 330). At d64 the mma.sync forward stays faster (300 vs 282 TF
// at N8192, as long as the exps do not overlap the next tile's S), so this kernel covers d128 only.
template <class T, int D>
struct Sm90Fwd {
  static constexpr bool kSupported = sizeof(T) == 2 && D == 128;
  static cudaError_t run(const Params& p, Score score, cudaStream_t stream);  // the launch, after the kernel
  static constexpr int kWG = 3, kCols = 64;
  static constexpr int kThreads = kWG * 128, kRows = 64 * kWG;
  static constexpr int kTileQ = kRows * D * static_cast<int>(sizeof(T));
  static constexpr int kTileKV = kCols * D * static_cast<int>(sizeof(T));
  // K/V stages: up to 4 (two tiles ahead) within the 227 KB of shared memory a block may have.
  static constexpr int kMaxBytes = 227 * 1024, kStageBytes = 2 * kTileKV + kCols * 4;
  static constexpr int kFit = (kMaxBytes - 1024 - kTileQ) / kStageBytes, kStages = kFit < 4 ? kFit : 4;
  // Q | kStages x K | kStages x V | kStages x 1/|k|, every tile 1024-byte aligned (the swizzle
  // pattern's period), plus the slack to align the dynamic shared memory's start.
  static constexpr int kQ = 0, kK = kTileQ, kV = kK + kStages * kTileKV, kRk = kV + kStages * kTileKV;
  static constexpr int kBytes = kRk + kStages * kCols * 4 + 1024;
  static_assert(!kSupported || (kTileQ % 1024 == 0 && kTileKV % 1024 == 0), "tiles keep the 1024-byte alignment");
  static_assert(!kSupported || (kStages >= 3 && kBytes <= kMaxBytes), "shared memory");
  static_assert(kCols == 64 || kCols == 128, "wgmma N and visible_cols' 32 bits");
};

template <class T, int D, class Policy>
__global__ void __launch_bounds__(Sm90Fwd<T, D>::kThreads, 1) fwd_sm90_kernel(const Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = Sm90Fwd<T, D>;
  using M = Mma<T>;
  constexpr int kThreads = C::kThreads, kBr = C::kRows, kBc = C::kCols, kStages = C::kStages;
  constexpr int kLead = kStages - 2;  // tiles loaded ahead of the one being computed
  constexpr int kKD = D / 16, kNC = kBc / 8, kND = D / 8;
  static_assert(kLead >= 1, "at least one tile ahead");
  extern __shared__ __align__(1024) char smem_raw[];
  const uint32_t raw = smem_u32(smem_raw), s0 = (raw + 1023) & ~1023u;
  const float* s_rk = reinterpret_cast<const float*>(smem_raw + (s0 - raw) + C::kRk);
  const SwTile sQ{s0 + C::kQ, kBr};
  auto k_tile = [&](int stage) { return SwTile{s0 + C::kK + stage * C::kTileKV, kBc}; };
  auto v_tile = [&](int stage) { return SwTile{s0 + C::kV + stage * C::kTileKV, kBc}; };

  const FwdBlock<T, D, kBr, kBc, kThreads> blk(p);
  const int m0 = blk.m0, n_tiles = blk.n_tiles;
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, tq = threadIdx.x % 4;
  const int wg = warp / 4, wrow = warp * 16;  // warpgroup wg: rows 64 wg ..; this warp: 16 of them
  const int m0w = m0 + 64 * wg;               // the warpgroup's first row
  // The keys this warpgroup's rows may see: the tiles from wg_end on are all hidden, skipped.
  const int wg_rows = min(64, p.I - m0w);
  const int wg_end = wg_rows <= 0 ? 0 : p.causal ? min(p.J, m0w + wg_rows + p.J - p.I) : p.J;

  auto load_kv = [&](int tile) {
    const int stage = tile % kStages;
    blk.load_kv(tile, k_tile(stage), v_tile(stage), s0 + C::kRk + stage * kBc * 4);
  };
  blk.load_q(sQ);
#pragma unroll
  for (int t = 0; t < kLead; ++t) {
    if (t < n_tiles) load_kv(t);
    cp_async_commit();
  }

  // The last visible key of this thread's rows wrow + g + 8 hf, and their alpha/|q| once the Q tile (in
  // the first group of loads) has landed.
  int last[1][2];
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) last[0][hf] = last_key(p, m0 + wrow + g + 8 * hf);
  cp_async_wait<kLead - 1>();
  __syncthreads();
  float rs[1][2];
  blk.row_scales(sQ, rs, wrow);

  const Policy pol(p);
  float o[1][kND][4] = {};
  float l[1][4] = {};  // this thread's share of the row sums: rows g and g + 8 in elements 0 and 2
  float mx[1][2] = {{-INFINITY, -INFINITY}};  // running row max (kRowMax only)
  float s[1][kNC][4];
  uint32_t pa[kNC / 2][M::kA];  // P as A operands; read by the P V wgmmas until the next wait

  for (int j = 0; j < n_tiles; ++j) {
    // Tile j has landed for every thread and is visible to the async proxy; every warpgroup has
    // waited for its P V of tile j - 2, whose stage the load of tile j + kLead reuses.
    cp_async_wait<kLead - 1>();
    fence_proxy_async();
    __syncthreads();
    if (j + kLead < n_tiles) load_kv(j + kLead);
    cp_async_commit();
    const int stage = j % kStages, n0 = j * kBc;
    if (n0 >= wg_end) {  // nothing visible to this warpgroup's rows (causal: all later tiles too)
      wgmma_wait<0>();
      continue;
    }

    // S = Q K^T for the warpgroup's 64 rows x kBc keys; the wait also completes P V of tile j - 1.
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kKD; ++kk)
      wgmma_ss<0, 0>(s[0], desc_k(sQ, 64 * wg, kk * 16, sizeof(T)), desc_k(k_tile(stage), 0, kk * 16, sizeof(T)),
                     kk > 0, T{});
    wgmma_commit();
    wgmma_wait<0>();
    fence_acc(s[0]);
    fence_acc(o[0]);

    fwd_scores<T, 64>(p, pol, s, o, l, mx, rs, last, blk.rk != nullptr, s_rk + stage * kBc, blk.bias, blk.mask,
                      m0 + wrow, n0, m0w, g, tq);

    // P as rounded to T, and its row sums from the very same values.
    float ls[2][2] = {};
#pragma unroll
    for (int kc = 0; kc < kNC / 2; ++kc) {
      M::c_to_a(pa[kc], s[0][2 * kc], s[0][2 * kc + 1]);
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float2 w = Elem<T>::unpack(pa[kc][r]);
        ls[r & 1][r >> 1] += w.x + w.y;  // a[0], a[2]: row g; a[1], a[3]: row g + 8
      }
    }
    l[0][0] += ls[0][0] + ls[0][1];
    l[0][2] += ls[1][0] + ls[1][1];

    // O += P V, 16 keys per k-step; left running until the next tile's S is waited for.
    wgmma_fence();
#pragma unroll
    for (int kc = 0; kc < kNC / 2; ++kc) wgmma_rs<1>(o[0], pa[kc], desc_mn(v_tile(stage), kc * 16, 0), 1, T{});
    wgmma_commit();
  }
  wgmma_wait<0>();
  fence_acc(o[0]);
  // The epilogue stages O in this warp's rows of the Q tile, which only this warpgroup's S read: they
  // are free once all four of its warps are past their last wait.
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
  float lsum[1][2];
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    lsum[0][hf] = l[0][2 * hf];
    lsum[0][hf] += __shfl_xor_sync(0xffffffffu, lsum[0][hf], 1);
    lsum[0][hf] += __shfl_xor_sync(0xffffffffu, lsum[0][hf], 2);
  }
  blk.template store<Policy>(sQ, o, lsum, mx, wrow);
#endif
}

// One CTA per (query tile, batch, head).
template <class T, int D>
cudaError_t Sm90Fwd<T, D>::run(const Params& p, Score score, cudaStream_t stream) {
  using C = Sm90Fwd<T, D>;
  const int64_t blocks = static_cast<int64_t>(cdiv(p.I, C::kRows)) * p.B * p.H;
  return with_policy(score, [&](auto policy) {
    return launch(fwd_sm90_kernel<T, D, typename decltype(policy)::type>, blocks, C::kThreads, C::kBytes, p, stream);
  });
}

}  // namespace attn
