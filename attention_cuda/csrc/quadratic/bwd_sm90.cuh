// Backward on Hopper (sm_90a) at d128 (d64: bwd_ws_sm90.cuh; quadratic/tiles.h says which): the mma.sync
// backward's block and step structure (bwd_sm80.cuh) with every product on warpgroup MMAs reading their
// operands straight from swizzled shared memory.
//
// One block per (batch, kv head, 128 keys): two warpgroups of 64 keys, each warp 16 of them, so the
// transposed scores S^T = K Q^T and dP^T = V dO^T land in exactly the registers the mma.sync kernel
// has them in, and the per-element work (bwd_scores) and the dK/dV epilogue are the same functions.
// Per step of 64 queries: S^T and dP^T (wgmma, both operands in shared memory), then P^T and dS~^T in
// registers feed dV += P^T dO and dK += dS~^T Q as register A operands, while dS~^T goes to shared
// memory for dQ = dS~ K (each warpgroup half of the head dim's columns), at the end of the same step,
// added to the fp32 buffer with a bulk reduce. Q/dO tiles arrive by TMA into two stages, two barriers
// per step. (A producer warpgroup with TMA and mbarrier hand-offs between the warpgroups, as in the
// forward, was slower here (bench/notes/run-14.md). So were the hand-offs without the producer, and
// warpgroup 1 skewed half a step so that its exps run under warpgroup 0's products: two loop bodies,
// one per warpgroup, miss the instruction cache where one shared body does not (bench/notes/run-24.md).)
#pragma once
#include "bwd_sm80.cuh"
#include "maps.cuh"

namespace attn {

template <class T, int D>
struct Sm90Bwd {
  using Tl = Tiles<T, D>;
  static constexpr bool kSupported = Tl::kSm90 && !Tl::kRow.sm90_bwd_ws;
  static cudaError_t run(const Params& p, Score score, cudaStream_t stream);  // the launch, after the kernel
  // Keys per block (64 per warpgroup) and queries per step. dQ for a step's queries is split by head
  // dim columns: each warpgroup kDQ of them.
  static constexpr int kWarps = Tl::kSm90BwdWarps, kCols = Tl::kSm90BwdCols, kRows = Tl::kSm90BwdRows, kDQ = D / 2;
  static constexpr int kTileK = kCols * D * sizeof(T), kTileQ = kRows * D * sizeof(T);
  static constexpr int kTileS = kCols * kRows * sizeof(T);
  // K | V | 2 x Q | 2 x dO | 2 x dS~^T | 2 x the step's vectors | one dQ tile (fp32, dq_tile_slot's
  // order) | two mbarriers, every tile 1024-byte aligned (the swizzle
  // pattern's period), plus the slack to align the dynamic shared memory's start. One dQ tile keeps
  // d128 (199,680 bytes) within the 196 KB shared-memory carve-out, which leaves L1 60 KB; two tiles
  // need the 228 KB one, which leaves 28 KB, and the same kernel ran slower with the smaller L1
  // (bench/notes/run-18.md).
  static constexpr int kK = 0, kV = kTileK, kQ = 2 * kTileK, kDO = kQ + 2 * kTileQ, kDS = kDO + 2 * kTileQ;
  static constexpr int kVec = kDS + 2 * kTileS, kDQS = kVec + 2 * kBwdVecs * kRows * 4, kTileDQ = kRows * D * 4;
  static constexpr int kBar = kDQS + kTileDQ, kBytes = kBar + 16 + kSwizzleSlack;
  static_assert(kRows == kDqTileRows, "dQ's tiles (dq_tile_slot) are one step of queries");
  static_assert(!kSupported || kBytes + 1024 <= 196 * 1024,
                "the 196 KB carve-out, with the 1 KB the system reserves");
};

// dS~^T of this warp's 16 keys from wkey x the step's queries to the step's buffer, for dQ: each A
// fragment of dK's product (c_to_a) holds two column tiles of the accumulator, four 8x8 matrices, which
// is what one stmatrix stores (one st.shared per pair of elements otherwise).
template <class T, int kKQ>
__device__ __forceinline__ void store_ds_sm90(const SwTile& sds, const uint32_t (&da)[kKQ][4], int wkey) {
  const int l = lane_id(), row = wkey + (l & 7) + 8 * ((l >> 3) & 1);
#pragma unroll
  for (int kq = 0; kq < kKQ; ++kq)
    stsm_x4(sds.at(row, (2 * kq + (l >> 4)) * 8 * sizeof(T)), da[kq][0], da[kq][1], da[kq][2], da[kq][3]);
}

// The per-step products and weights of both Hopper backwards (this kernel and bwd_ws_sm90.cuh), for
// warpgroup wg's 64 keys of a block (sK, sV) and a step's kBr queries (the stage's tiles sQ, sDO).
// S^T = K Q^T and dP^T = V dO^T, both operands in shared memory: two wgmma groups, S^T's first.
template <class T, int D, int kNQ>
__device__ __forceinline__ void sm90_bwd_sdp(float (&sc)[kNQ][4], float (&dp)[kNQ][4], const SwTile& sK,
                                             const SwTile& sV, const SwTile& sQ, const SwTile& sDO, int wg) {
  constexpr int kKD = D / 16;
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kKD; ++kk)
    wgmma_ss<0, 0>(sc, desc_k(sK, 64 * wg, kk * 16, sizeof(T)), desc_k(sQ, 0, kk * 16, sizeof(T)), kk > 0, T{});
  wgmma_commit();
#pragma unroll
  for (int kk = 0; kk < kKD; ++kk)
    wgmma_ss<0, 0>(dp, desc_k(sV, 64 * wg, kk * 16, sizeof(T)), desc_k(sDO, 0, kk * 16, sizeof(T)), kk > 0, T{});
  wgmma_commit();
}
// The weights and the dV/dK products go in parts of kPartRows of the step's queries, so that one part's
// products run during the next part's exps.
constexpr int kPartRows = 32;
// Part `part` of the step's queries m0..: P^T and dS~^T in place of S^T and dP^T (bwd_scores, with the
// stage's vectors at vec, StepVecs), then as the A operands of dV's and dK's products.
template <class T, int kBr, bool kExtras, class Policy>
__device__ __forceinline__ void sm90_bwd_weights(const Params& p, const Policy& pol, int part,
                                                 float (&sc)[kBr / 8][4], float (&dp)[kBr / 8][4],
                                                 uint32_t (&pa)[kBr / 16][Mma<T>::kA],
                                                 uint32_t (&da)[kBr / 16][Mma<T>::kA], const float* vec,
                                                 const KeyRows& keys, bool edge, int b, int h, int m0, int key0,
                                                 const uint8_t* mask) {
  constexpr int kTiles = kPartRows / 8;  // column tiles per part
  bwd_scores<T, kPartRows, Policy, NoHook, kExtras>(
      p, pol, *reinterpret_cast<float(*)[kTiles][4]>(sc[part * kTiles]),
      *reinterpret_cast<float(*)[kTiles][4]>(dp[part * kTiles]), StepVecs(vec + part * kPartRows, kBr), keys, edge,
      b, h, m0 + part * kPartRows, key0, mask);
#pragma unroll
  for (int kq = part * kTiles / 2; kq < (part + 1) * kTiles / 2; ++kq) {
    Mma<T>::c_to_a(pa[kq], sc[2 * kq], sc[2 * kq + 1]);
    Mma<T>::c_to_a(da[kq], dp[2 * kq], dp[2 * kq + 1]);
  }
}
// dV += P^T dO and dK += dS~^T Q for part `part` of the step's queries (16 per k-step, dO and Q read
// N-major): one wgmma group.
template <class T, int kND, int kKQ>
__device__ __forceinline__ void sm90_bwd_dvdk(float (&dv)[kND][4], float (&dk)[kND][4],
                                              const uint32_t (&pa)[kKQ][Mma<T>::kA],
                                              const uint32_t (&da)[kKQ][Mma<T>::kA], const SwTile& sQ,
                                              const SwTile& sDO, int part) {
  constexpr int kSteps = kPartRows / 16;
  wgmma_fence();
#pragma unroll
  for (int kq = part * kSteps; kq < (part + 1) * kSteps; ++kq) {
    wgmma_rs<1>(dv, pa[kq], desc_mn(sDO, kq * 16, 0), 1, T{});
    wgmma_rs<1>(dk, da[kq], desc_mn(sQ, kq * 16, 0), 1, T{});
  }
  wgmma_commit();
}

// The kernel's parameter: the Params and the TMA descriptors, which must live in parameter (or constant)
// space.
struct Sm90BwdArgs {
  CUtensorMap q, dout;
  Params p;
};

template <class T, int D, class Policy, bool kExtras>
__global__ void __launch_bounds__(Sm90Bwd<T, D>::kWarps * 32, 1)
    bwd_sm90_kernel(const __grid_constant__ Sm90BwdArgs args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const Params& p = args.p;
  using C = Sm90Bwd<T, D>;
  using M = Mma<T>;
  constexpr int kThreads = C::kWarps * 32, kBc = C::kCols, kBr = C::kRows;
  constexpr int kNQ = kBr / 8, kND = D / 8, kDQ = C::kDQ;
  extern __shared__ __align__(1024) char smem_raw[];
  const uint32_t raw = smem_u32(smem_raw), s0 = swizzle_base(smem_raw);
  const float* s_vec = reinterpret_cast<const float*>(smem_raw + (s0 - raw) + C::kVec);
  const SwTile sK{s0 + C::kK, kBc}, sV{s0 + C::kV, kBc};
  auto q_tile = [&](int stage) { return SwTile{s0 + C::kQ + stage * C::kTileQ, kBr}; };
  auto do_tile = [&](int stage) { return SwTile{s0 + C::kDO + stage * C::kTileQ, kBr}; };
  auto ds_tile = [&](int stage) { return SwTile{s0 + C::kDS + stage * C::kTileS, kBc}; };

  const BwdWalk<T, D, kBc, kBr, kThreads> walk(p);
  const int bhk = walk.bhk, n0 = walk.n0, b = walk.b, hk = walk.hk, steps = walk.steps;
  const uint8_t* mask = kExtras ? walk.mask() : nullptr;
  const int warp = warp_index(), g = threadIdx.x % 32 / 4;
  const int wg = warp / 4, wkey = warp * 16;  // warpgroup wg: keys 64 wg ..; this warp: 16 of them
  using Pos = typename BwdWalk<T, D, kBc, kBr, kThreads>::Pos;
  // A step's Q and dO tiles and vectors (bwd_vec_source) into a stage: TMA boxes, one per 64-byte
  // panel (rows past the end arrive as zeros), and bulk copies of the vectors up to i_pad, all completing
  // on the stage's mbarrier, issued by one thread of warpgroup 1 once its products for the step are out.
  constexpr int kLoader = 128;
  const uint32_t full = s0 + C::kBar;
  auto load_q = [&](Pos at, int stage) {
    const uint32_t vec = s0 + C::kVec + stage * kBwdVecs * kBr * 4;
    const uint32_t bar = full + 8 * stage;
    const int64_t row = static_cast<int64_t>(b * p.H + at.h) * p.i_pad + at.m0;
    const int vec_bytes = min(kBr, p.i_pad - at.m0) * 4;
    mbar_expect_tx(bar, 2 * C::kTileQ + kBwdVecs * vec_bytes);
    tma_load_tile<D / 32>(q_tile(stage), &args.q, bar, at.m0, at.h, b);
    tma_load_tile<D / 32>(do_tile(stage), &args.dout, bar, at.m0, at.h, b);
#pragma unroll
    for (int i = 0; i < kBwdVecs; ++i) bulk_load(vec + i * kBr * 4, bwd_vec_source(p, i) + row, vec_bytes, bar);
  };
  walk.load_kv(sK, sV);
  Pos cur = walk.first(), prev = cur;
  cp_async_commit();
  // The vectors' entries past i_pad are never loaded: finite there, the weights of rows past the end
  // stay 0 (P = 0 * stat).
  float* const vec0 = reinterpret_cast<float*>(smem_raw + (s0 - raw) + C::kVec);
  for (int i = threadIdx.x; i < 2 * kBwdVecs * kBr; i += kThreads) vec0[i] = 0.f;
  if (threadIdx.x == 0) {
    mbar_init(full, 1);
    mbar_init(full + 8, 1);
    mbar_fence_init();
  }
  cp_async_wait<0>();
  fence_proxy_async();
  __syncthreads();
  if (threadIdx.x == kLoader && steps > 0) load_q(cur, 0);
  const KeyRows keys(p, b, hk, mask, n0 + wkey + g);

  // dQ += dS~ K for one step's queries, the reduction over the block's 128 keys: A = dS~ read M-major
  // from the dS~^T tile (keys as rows), B = this warpgroup's kDQ columns of K read N-major. One wgmma
  // group. Issued ahead of the next step's S^T and dP^T, its accumulator live with theirs, it made 255
  // registers and ~120 bytes of spills per thread, so it goes in once both warpgroups' dS~^T is stored,
  // ahead of the second half's dV and dK, its registers those of the consumed S^T and dP^T: no spills
  // (bench/notes/run-25.md).
  // dq_keys: n 16-key slices of the reduction from slice kk0, the first overwriting dqa unless acc.
  float dqa[kDQ / 8][4];
  auto dq_keys = [&](int stage, int kk0, int n, bool acc) {
#pragma unroll
    for (int j = 0; j < n; ++j) {
      const int kk = kk0 + j;
      wgmma_ss<1, 1>(dqa, desc_mn(ds_tile(stage), kk * 16, 0), desc_mn(sK, kk * 16, wg * kDQ / 32), acc || j > 0, T{});
    }
  };
  // dQ leaves the block through a staging tile in shared memory (16-byte stores at the end of the step):
  // after the next step's barrier, one elected thread per warpgroup adds it to dq_accum's tiles with a
  // bulk reduce (the TMA unit). With each thread's vector atomics instead, each step's proxy fence was
  // a memory barrier that held every thread until its atomics had drained (bench/notes/run-17.md).
  constexpr int kStores = kDQ / 8;  // per thread and step
  const uint32_t s_dq = s0 + C::kDQS + (wg * kStores * 128 + threadIdx.x % 128) * 16;
  const bool elected = threadIdx.x % 128 == 0;
  auto dq_stage = [&](int n) {
    if (n == 0) {  // the warpgroup's last reduce has read the tile
      if (elected) bulk_wait_read<0>();
      named_sync(2 + wg, 128);
    }
    sts128(s_dq + n * 128 * 16, dqa[n][0], dqa[n][1], dqa[n][2], dqa[n][3]);
  };
  auto dq_reduce = [&]() {  // the elected thread, after a proxy fence and barrier: step prev's staged dQ
    float* dst = p.dq_accum + (static_cast<int64_t>(b * p.H + prev.h) * dq_tiled_rows(p.I) + prev.m0) * D;
    bulk_reduce_add(dst + wg * kBr * kDQ, s0 + C::kDQS + wg * kBr * kDQ * 4, kBr * kDQ * 4);
    bulk_commit();
  };

  const Policy pol(p.score);
  float dk[kND][4] = {}, dv[kND][4] = {};
  for (int step = 0; step < steps; ++step) {
    // Step-1's dQ staging stores are visible to the async proxy (one fence per step); every warpgroup
    // is done with step-1, so its staging tile is complete and the other stage is free.
    const int stage = step & 1, h = cur.h, m0 = cur.m0;
    fence_proxy_async();
    __syncthreads();
    if (elected && step >= 1) dq_reduce();
    mbar_wait(full + 8 * stage, (step >> 1) & 1);

    // S^T = K Q^T and dP^T = V dO^T for this warpgroup's 64 keys x 64 queries, in flight together; the
    // next step's tiles start loading behind them.
    // Warpgroup 1 issues after warpgroup 0 has (named barrier 1): the tensor cores then finish
    // warpgroup 0's products first, and its exps start while warpgroup 1's run (bench/notes/run-16.md).
    // Both sides bar.sync, warpgroup 1 reaches it first anyway; with bar.arrive racecheck reported
    // warpgroup 0's next loads (then cp.async) as racing with warpgroup 1's reads, which the block
    // barrier already orders.
    float sc[kNQ][4], dp[kNQ][4];
    if (wg == 1) named_sync(1, kThreads);
    sm90_bwd_sdp<T, D>(sc, dp, sK, sV, q_tile(stage), do_tile(stage), wg);
    if (wg == 0) named_sync(1, kThreads);
    if (threadIdx.x == kLoader && step + 1 < steps) load_q(walk.next(cur), stage ^ 1);
    wgmma_wait<0>();
    fence_acc(sc);
    fence_acc(dp);

    // Per half of the queries: P^T and dS~^T, then dV += P^T dO and dK += dS~^T Q issued at once, so the
    // first half's products run during the second half's exps.
    static_assert(kBr == 2 * kPartRows, "two parts a step");
    uint32_t pa[kNQ / 2][M::kA], da[kNQ / 2][M::kA];
    const bool edge = bwd_edge<kBc>(p, n0, m0, kBr, mask);
#pragma unroll
    for (int hq = 0; hq < 2; ++hq) {
      sm90_bwd_weights<T, kBr, kExtras>(p, pol, hq, sc, dp, pa, da, s_vec + stage * kBwdVecs * kBr, keys, edge, b,
                                        h, m0, n0 + wkey + g, mask);
      if (hq == 1) {  // dQ ahead of the second half's dV and dK
        // dQ over this warpgroup's own keys first, behind a barrier of its own: warpgroup 0, a turn
        // ahead, has them in the tensor pipe while it waits for warpgroup 1's dS~^T (bench/notes/run-29.md).
        constexpr int kWgSlices = kBc / 32;  // 16-key slices per warpgroup
        store_ds_sm90<T>(ds_tile(stage), da, wkey);
        fence_proxy_async();
        named_sync(5 + wg, 128);  // this warpgroup's dS~^T is in
        wgmma_fence();
        dq_keys(stage, wg * kWgSlices, kWgSlices, false);
        named_sync(4, kThreads);  // both warpgroups' dS~^T is in
        dq_keys(stage, (wg ^ 1) * kWgSlices, kWgSlices, true);
        wgmma_commit();
      }
      sm90_bwd_dvdk<T>(dv, dk, pa, da, q_tile(stage), do_tile(stage), hq);
    }
    // dQ to the staging tile once its product is in, while the second half's dV and dK run.
    wgmma_wait<1>();
    fence_acc(dqa);
#pragma unroll
    for (int n = 0; n < kStores; ++n) dq_stage(n);
    wgmma_wait<0>();
    fence_acc(dk);
    fence_acc(dv);
    prev = cur;
    cur = walk.next(cur);
  }
  if (steps > 0) {  // the last step's dQ, staged
    fence_proxy_async();
    named_sync(2 + wg, 128);
    if (elected) {
      dq_reduce();
      bulk_wait<0>();
    }
  }
  bwd_store_dkdv<T, D>(p, dk, dv, sK, wkey + g, keys, bhk, n0);
#endif
}

// The launch of both Hopper backwards: one CTA per (key tile of `cols` keys, batch, kv head) of
// kernel_of(policy, extras) for the score's policy and has_extras, then dQ's epilogue over the tiled
// buffer.
template <class T, int D, class Args, class KernelOf>
cudaError_t launch_sm90_bwd(const Params& p, Score score, const Args& args, int cols, int threads, int bytes,
                            KernelOf kernel_of, cudaStream_t stream) {
  const int64_t blocks = static_cast<int64_t>(cdiv(p.J, cols)) * p.B * p.Hkv;
  const bool extras = has_extras(p);
  return with_policy(score, [&](auto policy) {
    const auto kernel = extras ? kernel_of(policy, std::true_type{}) : kernel_of(policy, std::false_type{});
    const cudaError_t err = launch(kernel, blocks, threads, bytes, args, stream);
    return err != cudaSuccess ? err : run_dq_finalize(dtype_of<T>(), p, D, true, stream);
  });
}

// Falls back to the mma.sync backward where TMA cannot describe q or dO.
template <class T, int D>
cudaError_t Sm90Bwd<T, D>::run(const Params& p, Score score, cudaStream_t stream) {
  using C = Sm90Bwd<T, D>;
  Sm90BwdArgs args;
  args.p = p;
  if (!operand_map<T, D>(&args.q, p, Operand::kQ, C::kRows) ||
      !operand_map<T, D>(&args.dout, p, Operand::kDout, C::kRows))
    return run_bwd<T, D>(p, score, stream);
  return launch_sm90_bwd<T, D>(p, score, args, C::kCols, C::kWarps * 32, C::kBytes, [](auto policy, auto extras) {
    return &bwd_sm90_kernel<T, D, typename decltype(policy)::type, decltype(extras)::value>;
  }, stream);
}

}  // namespace attn
