// Backward on Hopper (sm_90a) at d64, warp-specialised in the shape of cuDNN's backward kernel
// (bench/notes/run-38.md): the per-element work (bwd_scores), the per-step products and weights
// (sm90_bwd_sdp, sm90_bwd_weights, sm90_bwd_dvdk) and the dK/dV epilogue of bwd_sm90.cuh, under another schedule.
//
// One block per (batch, kv head, 128 keys) has three warpgroups and no block barrier after its start:
//   - a producer warp loads K and V once, then streams each step's Q and dO tiles by TMA through
//     kStages stages and copies the step's row vectors (bwd_vec_source) with its lanes' own loads
//     and stores. A stage's full mbarrier waits for the tiles' bytes and an arrival from each producer
//     lane, its empty one for an arrival from each consumer thread: an arrival releases only the
//     arriving thread's own accesses, and the vectors are read with ordinary loads;
//   - two consumer warpgroups of 64 keys each compute, for a step of 128 queries, S^T = K Q^T and
//     dP^T = V dO^T (m64n128 products), P^T and dS~^T in registers, and dV += P^T dO, dK += dS~^T Q from
//     register A operands, and store dS~^T for dQ;
//   - once both halves of dS~^T are in (one named barrier a step), each consumer computes dQ = dS~ K
//     of 64 of the step's queries (all D columns, over the block's 128 keys) and adds it to that dQ
//     tile of dq_accum (dq_tile_slot) with one 16-byte atomic per column tile and thread. dS~^T tiles
//     alternate by step: the dQ that last read a tile (two steps back) was done before both consumers
//     passed the previous step's barrier.
// Steps of 64 queries, with one consumer computing a step's whole dQ in turns, were 3-4% slower; the
// two-warpgroup kernel's d64 form (cp.async by every thread and a block barrier per step, dQ split by
// columns) 3-8% slower still (bench/notes/run-38.md, run-39.md). d128's accumulators do not fit a
// consumer's registers at 128 queries a step, so d128 keeps that kernel.
#pragma once
#include "bwd_sm90.cuh"

namespace attn {

template <class T, int D>
struct Sm90BwdWs {
  using Tl = Tiles<T, D>;
  static constexpr bool kSupported = Tl::kSm90 && Tl::kRow.sm90_bwd_ws;
  static cudaError_t run(const Params& p, Score score, cudaStream_t stream);  // the launch, after the kernel
  // Two stages instead of three were 1-3% slower (bench/notes/run-39.md).
  static constexpr int kCols = 128, kRows = 128, kStages = 3, kThreads = 384;
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  static constexpr int kTileK = kCols * D * sizeof(T), kTileQ = kRows * D * sizeof(T);
  static constexpr int kTileS = kCols * kRows * sizeof(T), kVecBytes = kBwdVecs * kRows * 4;
  // K | V | kStages x Q | kStages x dO | 2 x dS~^T | kStages x vectors | mbarriers (K/V, then full and
  // empty per stage), every tile 1024-byte aligned (the swizzle pattern's period), plus the slack to
  // align the dynamic shared memory's start.
  static constexpr int kK = 0, kV = kTileK, kQ = 2 * kTileK, kDO = kQ + kStages * kTileQ;
  static constexpr int kDS = kDO + kStages * kTileQ, kVec = kDS + 2 * kTileS, kBar = kVec + kStages * kVecBytes;
  static constexpr int kBytes = kBar + 8 * (1 + 2 * kStages) + kSwizzleSlack;
  static_assert(kRows == 2 * kDqTileRows, "dQ's tiles (dq_tile_slot): one a consumer");
  static_assert(!kSupported || kBytes <= 227 * 1024, "shared memory");
};

struct Sm90BwdWsArgs {  // the TMA descriptors must live in parameter (or constant) space
  CUtensorMap q, dout, k, v;
  Params p;
};

template <class T, int D, class Policy, bool kExtras>
__global__ void __launch_bounds__(Sm90BwdWs<T, D>::kThreads, 1)
    bwd_ws_sm90_kernel(const __grid_constant__ Sm90BwdWsArgs args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = Sm90BwdWs<T, D>;
  using M = Mma<T>;
  const Params& p = args.p;
  constexpr int kBc = C::kCols, kBr = C::kRows, kStages = C::kStages, kPanels = D / 32;
  constexpr int kNQ = kBr / 8, kND = D / 8;
  constexpr int kDsFull = 1, kPair = 256;  // the consumers' named barrier: both halves of dS~^T are in
  extern __shared__ __align__(1024) char smem_raw[];
  const uint32_t raw = smem_u32(smem_raw), s0 = swizzle_base(smem_raw);
  const SwTile sK{s0 + C::kK, kBc}, sV{s0 + C::kV, kBc};
  auto q_tile = [&](int st) { return SwTile{s0 + C::kQ + st * C::kTileQ, kBr}; };
  auto do_tile = [&](int st) { return SwTile{s0 + C::kDO + st * C::kTileQ, kBr}; };
  auto ds_tile = [&](int buf) { return SwTile{s0 + C::kDS + buf * C::kTileS, kBc}; };
  const uint32_t kv_full = s0 + C::kBar;
  auto q_full = [&](int st) { return kv_full + 8 * (1 + st); };
  auto q_empty = [&](int st) { return kv_full + 8 * (1 + kStages + st); };

  using Walk = BwdWalk<T, D, kBc, kBr, kPair>;  // (its loads, which take the thread count, are unused)
  using Pos = typename Walk::Pos;
  const Walk walk(p);
  const int bhk = walk.bhk, n0 = walk.n0, b = walk.b, hk = walk.hk, steps = walk.steps;
  const int warp = warp_index(), wg = warp / 4;
  if (threadIdx.x == 0) {
    mbar_init(kv_full, 1);
    for (int st = 0; st < kStages; ++st) {
      mbar_init(q_full(st), 32);    // the producer warp's lanes
      mbar_init(q_empty(st), kPair);  // the consumers' threads
    }
    mbar_fence_init();
  }
  __syncthreads();

  if (wg == 2) {  // the producer: its first warp
    setmaxnreg_dec<C::kProducerRegs>();
    if (warp == 8) {
      const int lane = lane_id();
      if (lane == 0) {
        mbar_expect_tx(kv_full, 2 * C::kTileK);
        tma_load_tile<kPanels>(sK, &args.k, kv_full, n0, hk, b);
        tma_load_tile<kPanels>(sV, &args.v, kv_full, n0, hk, b);
      }
      auto copy_vec = [&](const float* src, uint32_t dst, int n) {  // kBr floats, a lane 4 of them; zeros from n
        if (lane < kBr / 4) {
          float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
          if (4 * lane < n) x = *reinterpret_cast<const float4*>(src + 4 * lane);
          sts128(dst + 16 * lane, x.x, x.y, x.z, x.w);
        }
      };
      Pos at = walk.first();
      for (int step = 0; step < steps; ++step) {
        const int st = step % kStages;
        if (step >= kStages) mbar_wait(q_empty(st), (step / kStages - 1) & 1);
        const uint32_t vec = s0 + C::kVec + st * C::kVecBytes;
        if (lane == 0) {
          mbar_add_tx(q_full(st), 2 * C::kTileQ);
          tma_load_tile<kPanels>(q_tile(st), &args.q, q_full(st), at.m0, at.h, b);
          tma_load_tile<kPanels>(do_tile(st), &args.dout, q_full(st), at.m0, at.h, b);
        }
        // Entries past i_pad (a multiple of 4) are zeros: finite, so rows past the end weigh 0.
        const int64_t row = static_cast<int64_t>(b * p.H + at.h) * p.i_pad + at.m0;
        const int n = p.i_pad - at.m0;
#pragma unroll
        for (int i = 0; i < kBwdVecs; ++i) copy_vec(bwd_vec_source(p, i) + row, vec + i * kBr * 4, n);
        mbar_arrive(q_full(st));
        at = walk.next(at);
      }
    }
    return;
  }
  setmaxnreg_inc<C::kConsumerRegs>();

  const int g = threadIdx.x % 32 / 4, wkey = warp * 16;  // warpgroup wg: keys 64 wg ..; this warp: 16 of them
  const uint8_t* mask = kExtras ? walk.mask() : nullptr;
  const KeyRows keys(p, b, hk, mask, n0 + wkey + g);
  const float* s_vec = reinterpret_cast<const float*>(smem_raw + (s0 - raw) + C::kVec);
  const Policy pol(p.score);
  float dk[kND][4] = {}, dv[kND][4] = {};
  mbar_wait(kv_full, 0);
  Pos cur = walk.first();
  for (int step = 0; step < steps; ++step) {
    const int st = step % kStages, buf = step & 1, h = cur.h, m0 = cur.m0;
    mbar_wait(q_full(st), (step / kStages) & 1);
    float sc[kNQ][4], dp[kNQ][4];
    sm90_bwd_sdp<T, D>(sc, dp, sK, sV, q_tile(st), do_tile(st), wg);
    wgmma_wait<0>();
    fence_acc(sc);
    fence_acc(dp);

    // Per part of the queries: P^T and dS~^T, then dV += P^T dO and dK += dS~^T Q issued at once, so a
    // part's products run during the next part's exps.
    uint32_t pa[kNQ / 2][M::kA], da[kNQ / 2][M::kA];
    const bool edge = bwd_edge<kBc>(p, n0, m0, kBr, mask);
#pragma unroll
    for (int part = 0; part < kBr / kPartRows; ++part) {
      sm90_bwd_weights<T, kBr, kExtras>(p, pol, part, sc, dp, pa, da, s_vec + st * kBwdVecs * kBr, keys, edge, b, h,
                                        m0, n0 + wkey + g, mask);
      sm90_bwd_dvdk<T>(dv, dk, pa, da, q_tile(st), do_tile(st), part);
    }
    // dS~^T into the step's buffer, then, with the other half in, dQ of this warpgroup's 64 queries.
    store_ds_sm90<T>(ds_tile(buf), da, wkey);
    fence_proxy_async();
    named_sync(kDsFull, kPair);
    float dqa[kND][4];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBc / 16; ++kk)
      wgmma_ss<1, 1>(dqa, desc_mn(ds_tile(buf), kk * 16, 2 * wg), desc_mn(sK, kk * 16, 0), kk > 0, T{});
    wgmma_commit();
    wgmma_wait<0>();
    fence_acc(dk);
    fence_acc(dv);
    mbar_arrive(q_empty(st));  // Q, dO and the vectors are read
    const int m_dq = m0 + kDqTileRows * wg;  // this warpgroup's dQ tile
    if (m_dq < p.I) {
      fence_acc(dqa);
      // The accumulator's registers are dq_tile_slot's 16-byte slots: column tile n, this thread.
      float* dst = p.dq_accum + (static_cast<int64_t>(b * p.H + h) * dq_tiled_rows(p.I) + m_dq) * D;
#pragma unroll
      for (int n = 0; n < kND; ++n)
        red_add4(dst + (n * 128 + threadIdx.x % 128) * 4, dqa[n][0], dqa[n][1], dqa[n][2], dqa[n][3]);
    }
    cur = walk.next(cur);
  }
  bwd_store_dkdv<T, D>(p, dk, dv, sK, wkey + g, keys, bhk, n0);
#endif
}

// Falls back to the mma.sync backward where TMA cannot describe q, k, v or dO.
template <class T, int D>
cudaError_t Sm90BwdWs<T, D>::run(const Params& p, Score score, cudaStream_t stream) {
  using C = Sm90BwdWs<T, D>;
  Sm90BwdWsArgs args;
  args.p = p;
  if (!operand_map<T, D>(&args.q, p, Operand::kQ, C::kRows) ||
      !operand_map<T, D>(&args.dout, p, Operand::kDout, C::kRows) ||
      !operand_map<T, D>(&args.k, p, Operand::kK, C::kCols) || !operand_map<T, D>(&args.v, p, Operand::kV, C::kCols))
    return run_bwd<T, D>(p, score, stream);
  return launch_sm90_bwd<T, D>(p, score, args, C::kCols, C::kThreads, C::kBytes, [](auto policy, auto extras) {
    return &bwd_ws_sm90_kernel<T, D, typename decltype(policy)::type, decltype(extras)::value>;
  }, stream);
}

}  // namespace attn
