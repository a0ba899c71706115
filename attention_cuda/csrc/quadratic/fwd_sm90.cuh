// Forward on Hopper (sm_90a): the mma.sync forward's math (fwd_sm80.cuh: fwd_scores, the epilogue) on
// warpgroup MMAs, fed by TMA and scheduled FlashAttention-3's way.
//
// One block per (batch, head, kRows query rows) has a producer warpgroup and kWG consumer warpgroups
// of 64 rows (3 at d64, 2 at d128: quadratic/tiles.h). The producer (one thread, its warpgroup's
// registers handed over with setmaxnreg) streams K/V tiles of 128 keys through kStages stages with TMA,
// each stage guarded by full and empty mbarriers, so no consumer ever waits on a block-wide barrier. A
// consumer computes S = Q K^T (wgmma, Q and K K-major in shared memory) into exactly the registers the
// mma.sync kernel has it in, turns it into weights with the shared per-element code, and feeds them back
// as register A operands of O += P V (V read MN-major). Overlaps keep the tensor cores busy through the exps:
//   - the consumers take turns issuing their products (named barriers, round robin), so one's exps
//     run while the others' matrix products do;
//   - at d128, within a warpgroup, P V of tile j - 1 is issued right after S of tile j and runs while
//     S_j's exps are computed; P_j is written into the A registers only once that P V has completed.
//     (Three warpgroups at d64 lack the registers to hold P through the exps; they wait for both.)
#pragma once
#include "fwd_sm80.cuh"
#include "maps.cuh"

namespace attn {

template <class T, int D>
struct Sm90Fwd {
  using Tl = Tiles<T, D>;
  static constexpr bool kSupported = Tl::kSm90;
  static cudaError_t run(const Params& p, Score score, cudaStream_t stream);  // the launch, after the kernel
  static constexpr int kWG = Tl::kSm90FwdWGs, kCols = Tl::kSm90FwdCols;  // consumer warpgroups, keys per tile
  static constexpr int kThreads = (kWG + 1) * 128, kRows = 64 * kWG;
  // Registers per thread after setmaxnreg: the producer keeps 24, the consumers share the rest.
  static constexpr int kProducerRegs = 24, kFree = (65536 / 128 - kProducerRegs) / kWG / 8 * 8;
  static constexpr int kConsumerRegs = kFree < 240 ? kFree : 240;
  static constexpr bool kOverlap = kWG == 2;  // P V of tile j - 1 runs through tile j's exps
  static constexpr int kTileQ = kRows * D * 2, kTileKV = kCols * D * 2;
  // Each V tile is followed by one panel of ones: P V reads it as 8 more columns (N = D + 8), whose
  // accumulators are the row sums of P as rounded for the product, at no instruction cost per weight.
  static constexpr int kTileV = kTileKV + kCols * 64;
  // Stages: as many as fit in the 227 KB a block may have, up to 3 (2 at d128).
  static constexpr int kMaxBytes = 227 * 1024, kStageBytes = kTileKV + kTileV, kBarBytes = 256;
  static constexpr int kFit = (kMaxBytes - kSwizzleSlack - kBarBytes - kTileQ) / kStageBytes;
  static constexpr int kStages = kFit < 3 ? kFit : 3;
  // Q | kStages x K | kStages x (V, ones) | mbarriers, every tile 1024-byte aligned (the swizzle
  // pattern's period), plus the slack to align the dynamic shared memory's start.
  static constexpr int kQ = 0, kK = kTileQ, kV = kK + kStages * kTileKV;
  static constexpr int kBar = kV + kStages * kTileV, kBytes = kBar + kBarBytes + kSwizzleSlack;
  static_assert(!kSupported || (kStages >= 2 && kBytes <= kMaxBytes), "shared memory");
  static_assert((1 + 4 * kStages) * 8 <= kBarBytes, "mbarriers: Q, and full/empty for K and V per stage");
};

// The kernel's parameter: the TMA descriptors must live in parameter (or constant) space.
struct Sm90FwdArgs {
  CUtensorMap q, k, v;
  Params p;
};

template <class T, int D, class Policy>
__global__ void __launch_bounds__(Sm90Fwd<T, D>::kThreads, 1)
    fwd_sm90_kernel(const __grid_constant__ Sm90FwdArgs args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = Sm90Fwd<T, D>;
  using M = Mma<T>;
  const Params& p = args.p;
  constexpr int kWG = C::kWG, kBr = C::kRows, kBc = C::kCols, kStages = C::kStages;
  constexpr int kKD = D / 16, kNC = kBc / 8, kND = D / 8, kPanels = D / 32;
  constexpr int kPair = 256;  // threads at a turn's named barrier: the waiting warpgroup and the one arriving
  extern __shared__ __align__(1024) char smem_raw[];
  const uint32_t s0 = swizzle_base(smem_raw);
  const SwTile sQ{s0 + C::kQ, kBr};
  auto k_tile = [&](int st) { return SwTile{s0 + C::kK + st * C::kTileKV, kBc}; };
  auto v_tile = [&](int st) { return SwTile{s0 + C::kV + st * C::kTileV, kBc}; };
  // mbarriers: Q landed; per stage, K and V landed, and K and V free again.
  const uint32_t q_full = s0 + C::kBar;
  auto k_full = [&](int st) { return q_full + 8 * (1 + st); };
  auto v_full = [&](int st) { return q_full + 8 * (1 + kStages + st); };
  auto k_empty = [&](int st) { return q_full + 8 * (1 + 2 * kStages + st); };
  auto v_empty = [&](int st) { return q_full + 8 * (1 + 3 * kStages + st); };

  const FwdBlock<T, D, kBr, kBc, 128 * kWG> blk(p);
  const int m0 = blk.m0, n_tiles = blk.n_tiles;
  const int warp = warp_index(), lane = threadIdx.x % 32, wg = warp / 4;
  if (threadIdx.x == 0) {
    mbar_init(q_full, 1);
    for (int st = 0; st < kStages; ++st) {
      mbar_init(k_full(st), 1);
      mbar_init(v_full(st), 1);
      mbar_init(k_empty(st), 4 * kWG);  // one arrival per consumer warp
      mbar_init(v_empty(st), 4 * kWG);
    }
    mbar_fence_init();
  }
  {  // the ones panels (whose swizzle is moot), made visible to the tensor cores' reads
    const uint32_t one = Elem<T>::pack(1.f, 1.f);
    for (int i = threadIdx.x; i < kStages * kBc * 16; i += blockDim.x)
      sts32(v_tile(i / (kBc * 16)).base + kPanels * kBc * 64 + i % (kBc * 16) * 4, one);
    fence_proxy_async();
  }
  __syncthreads();

  if (wg == kWG) {  // the producer
    setmaxnreg_dec<C::kProducerRegs>();
    if (warp == 4 * kWG && lane == 0) {
      const int b = blk.bh / p.H, h = blk.bh % p.H, hk = h / p.group;
      mbar_expect_tx(q_full, C::kTileQ);
      tma_load_tile<kPanels>(sQ, &args.q, q_full, m0, h, b);
      for (int j = 0; j < n_tiles; ++j) {
        const int st = j % kStages, n0 = j * kBc;
        if (j >= kStages) mbar_wait(k_empty(st), (j / kStages - 1) & 1);
        mbar_expect_tx(k_full(st), C::kTileKV);
        tma_load_tile<kPanels>(k_tile(st), &args.k, k_full(st), n0, hk, b);
        if (j >= kStages) mbar_wait(v_empty(st), (j / kStages - 1) & 1);
        mbar_expect_tx(v_full(st), C::kTileKV);
        tma_load_tile<kPanels>(v_tile(st), &args.v, v_full(st), n0, hk, b);
      }
    }
    return;
  }
  setmaxnreg_inc<C::kConsumerRegs>();

  const int g = lane / 4, tq = lane % 4, wrow = warp * 16;  // warpgroup wg: rows 64 wg ..; this warp: 16 of them
  const int m0w = m0 + 64 * wg;                              // the warpgroup's first row
  // The keys this warpgroup's rows may see: the tiles from wg_end on are all hidden, skipped.
  const int wg_rows = min(64, p.I - m0w);
  const int wg_end = wg_rows <= 0 ? 0 : p.causal ? min(p.J, m0w + wg_rows + p.J - p.I) : p.J;
  int last[1][2];
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) last[0][hf] = last_key(p, m0 + wrow + g + 8 * hf);
  mbar_wait(q_full, 0);
  float rs[1][2];
  blk.row_scales(sQ, rs, wrow);

  const Policy pol(p.score);
  float o[1][kND + 1][4] = {};  // O, then the row sums: rows g and g + 8 in elements 0 and 2
  float mx[1][2] = {{-INFINITY, -INFINITY}};  // running row max (kRowMax only)
  float s[1][kNC][4];
  uint32_t pa[kNC / 2][M::kA];  // P as A operands, read by the P V wgmmas until they complete

  // Turns on the tensor cores, round robin: warpgroup w issues after named barrier 1 + w, which
  // warpgroup w - 1 arrives at once it has issued; the last warpgroup lets warpgroup 0 start, and skips
  // its last arrival so that every barrier is completed as often as it is waited for. All take a turn
  // for every tile of the block, also one their rows cannot see (causal: the first warpgroups may see
  // one tile fewer).
  auto begin_turn = [&](int j) {
    mbar_wait(k_full(j % kStages), (j / kStages) & 1);
    named_sync(1 + wg, kPair);
  };
  auto end_turn = [&](int j) {
    if (!(wg == kWG - 1 && j == n_tiles - 1)) named_arrive(1 + (wg + 1) % kWG, kPair);
  };
  if (wg == kWG - 1 && n_tiles > 0) named_arrive(1, kPair);
  auto release = [&](uint32_t bar) {  // one arrival per warp, once all its lanes are done with the stage
    __syncwarp();
    if (lane == 0) mbar_arrive(bar);
  };
  auto issue_s = [&](int j) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kKD; ++kk)
      wgmma_ss<0, 0>(s[0], desc_k(sQ, 64 * wg, kk * 16, sizeof(T)), desc_k(k_tile(j % kStages), 0, kk * 16, sizeof(T)),
                     kk > 0, T{});
    wgmma_commit();
  };
  auto issue_pv = [&](int j) {
    const int st = j % kStages;
    mbar_wait(v_full(st), (j / kStages) & 1);
    wgmma_fence();
#pragma unroll
    for (int kc = 0; kc < kNC / 2; ++kc) wgmma_rs<1>(o[0], pa[kc], desc_mn(v_tile(st), kc * 16, 0), 1, T{});
    wgmma_commit();
  };
  // The weights of tile j, once S has landed; then K's stage is free.
  auto scores = [&](int j) {
    fence_acc(s[0]);
    fwd_scores<T, 64>(p, pol, s, o, mx, rs, last, blk.bias, blk.mask, m0 + wrow, j * kBc, m0w, g, tq);
    release(k_empty(j % kStages));
  };
  auto to_p = [&]() {  // P as rounded to T, into the A registers
#pragma unroll
    for (int kc = 0; kc < kNC / 2; ++kc) M::c_to_a(pa[kc], s[0][2 * kc], s[0][2 * kc + 1]);
  };

  // The tiles this warpgroup's rows see, 0 .. n_vis - 1; the steady state is peeled free of branches
  // on whether a P V is in flight, so that no instruction touches O's registers while it is.
  const int n_vis = wg_end > 0 ? min(n_tiles, cdiv(wg_end, kBc)) : 0;
  int j = 0;
  if (n_vis > 0) {
    begin_turn(0);
    issue_s(0);
    end_turn(0);
    wgmma_wait<0>();
    scores(0);
    to_p();
    for (j = 1; j < n_vis; ++j) {
      begin_turn(j);
      issue_s(j);
      issue_pv(j - 1);
      end_turn(j);
      // A running row max rescales O, and three warpgroups have no registers to keep P through the
      // exps: both wait for P V as well.
      if constexpr (Policy::kRowMax || !C::kOverlap) {
        wgmma_wait<0>();
        fence_acc(o[0]);
      } else {
        wgmma_wait<1>();  // S only (the older group); P V keeps running through the exps
      }
      scores(j);
      wgmma_wait<0>();
      fence_acc(o[0]);
      release(v_empty((j - 1) % kStages));
      to_p();
    }
    issue_pv(n_vis - 1);
    wgmma_wait<0>();
    fence_acc(o[0]);
    release(v_empty((n_vis - 1) % kStages));
  }
  for (; j < n_tiles; ++j) {  // tiles hidden from all of this warpgroup's rows
    begin_turn(j);
    end_turn(j);
    release(k_empty(j % kStages));
    release(v_empty(j % kStages));
  }
  // The epilogue stages O in this warp's rows of the Q tile, which only this warpgroup's S read: they
  // are free once all four of its warps are past their last wait.
  named_sync(1 + kWG + wg, 128);
  blk.template store<Policy>(sQ, o, mx, wrow);
#endif
}

// One CTA per (query tile, batch, head); the mma.sync forward where TMA cannot describe q, k or v.
template <class T, int D>
cudaError_t Sm90Fwd<T, D>::run(const Params& p, Score score, cudaStream_t stream) {
  using C = Sm90Fwd<T, D>;
  Sm90FwdArgs args;
  args.p = p;
  if (!operand_map<T, D>(&args.q, p, Operand::kQ, C::kRows) || !operand_map<T, D>(&args.k, p, Operand::kK, C::kCols) ||
      !operand_map<T, D>(&args.v, p, Operand::kV, C::kCols))
    return run_fwd<T, D>(p, score, stream);
  const int64_t blocks = static_cast<int64_t>(cdiv(p.I, C::kRows)) * p.B * p.H;
  return with_policy(score, [&](auto policy) {
    return launch(fwd_sm90_kernel<T, D, typename decltype(policy)::type>, blocks, C::kThreads, C::kBytes, args,
                  stream);
  });
}

}  // namespace attn
