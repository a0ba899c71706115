// Backward on Hopper (sm_90a): the mma.sync backward's block and step structure (bwd_sm80.cuh) with every
// product on warpgroup MMAs reading their operands straight from swizzled shared memory.
//
// One block per (batch, kv head, 128 keys): two warpgroups of 64 keys, each warp 16 of them, so the
// transposed scores S^T = K Q^T and dP^T = V dO^T land in exactly the registers the mma.sync kernel
// has them in, and the per-element work (bwd_scores) and the dK/dV epilogue are the same functions.
// Per step of 64 queries: S^T and dP^T (wgmma, both operands in shared memory), then P^T and dS~^T in
// registers feed dV += P^T dO and dK += dS~^T Q as register A operands, while dS~^T goes to shared
// memory for dQ = dS~ K (each warpgroup half of the head dim's columns): at d64 in the next step, added
// to the fp32 buffer with vector atomics; at d128 at the end of the same step, added with a bulk
// reduce. Loads are double-buffered, cp.async at d64 and TMA at d128 (quadratic/tiles.h), one barrier
// per step (two at d128). (A producer warpgroup with TMA and mbarrier hand-offs between the warpgroups,
// as in the forward, was slower here (bench/notes/run-14.md). So were the hand-offs without the
// producer, and warpgroup 1 skewed half a step so that its exps run under warpgroup 0's products: two
// loop bodies, one per warpgroup, miss the instruction cache where one shared body does not
// (bench/notes/run-24.md).)
#pragma once
#include <cstdlib>

#include "../common/wgmma.cuh"
#include "bwd_sm80.cuh"

namespace attn {

template <class T, int D>
struct Sm90Bwd {
  using Tl = Tiles<T, D>;
  static constexpr bool kSupported = Tl::kSm90;
  static cudaError_t run(const Params& p, Score score, cudaStream_t stream);  // the launch, after the kernel
  // Keys per block (64 per warpgroup) and queries per step. dQ for a step's queries is split by head
  // dim columns: each warpgroup kDQ of them. kBulkDQ: how it leaves the block; kTma: a step's tiles
  // arrive by TMA (quadratic/tiles.h says why, the kernel how).
  static constexpr int kWarps = Tl::kSm90BwdWarps, kCols = Tl::kSm90BwdCols, kRows = Tl::kSm90BwdRows, kDQ = D / 2;
  static constexpr bool kBulkDQ = Tl::kRow.sm90_bwd_bulk_dq;
  static constexpr bool kTma = Tl::kRow.sm90_bwd_tma;
  static constexpr int kTileK = kCols * D * sizeof(T), kTileQ = kRows * D * sizeof(T);
  static constexpr int kTileS = kCols * kRows * sizeof(T);
  // K | V | 2 x Q | 2 x dO | 2 x dS~^T | 2 x (stat, delta, 1/|q|) | with kBulkDQ one dQ tile (fp32,
  // dq_tile_slot's order) | two mbarriers (kTma), every tile 1024-byte aligned (the swizzle
  // pattern's period), plus the slack to align the dynamic shared memory's start. One dQ tile keeps
  // d128 (199,184 bytes) within the 196 KB shared-memory carve-out, which leaves L1 60 KB; two tiles
  // need the 228 KB one, which leaves 28 KB, and the same kernel ran slower with the smaller L1
  // (bench/notes/run-18.md).
  static constexpr int kK = 0, kV = kTileK, kQ = 2 * kTileK, kDO = kQ + 2 * kTileQ, kDS = kDO + 2 * kTileQ;
  static constexpr int kVec = kDS + 2 * kTileS, kDQS = kVec + 2 * 3 * kRows * 4, kTileDQ = kRows * D * 4;
  static constexpr int kBar = kDQS + (kBulkDQ ? kTileDQ : 0), kBytes = kBar + 16 + 1024;
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

// The kernel's parameter: with kTma the Params and the TMA descriptors, which must live in parameter
// (or constant) space; otherwise the Params alone (the d64 kernel compiles as it did before kTma).
struct Sm90BwdArgs {
  CUtensorMap q, dout;
  Params p;
};
template <class T, int D>
using Sm90BwdParam = std::conditional_t<Sm90Bwd<T, D>::kTma, Sm90BwdArgs, Params>;
__device__ __forceinline__ const Params& params_of(const Params& p) { return p; }
__device__ __forceinline__ const Params& params_of(const Sm90BwdArgs& a) { return a.p; }

template <class T, int D, class Policy>
__global__ void __launch_bounds__(Sm90Bwd<T, D>::kWarps * 32, 1)
    bwd_sm90_kernel(const __grid_constant__ Sm90BwdParam<T, D> args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const Params& p = params_of(args);
  using C = Sm90Bwd<T, D>;
  using M = Mma<T>;
  constexpr int kThreads = C::kWarps * 32, kBc = C::kCols, kBr = C::kRows;
  constexpr int kKD = D / 16, kNQ = kBr / 8, kND = D / 8, kDQ = C::kDQ;
  extern __shared__ __align__(1024) char smem_raw[];
  const uint32_t raw = smem_u32(smem_raw), s0 = (raw + 1023) & ~1023u;
  const float* s_vec = reinterpret_cast<const float*>(smem_raw + (s0 - raw) + C::kVec);
  const SwTile sK{s0 + C::kK, kBc}, sV{s0 + C::kV, kBc};
  auto q_tile = [&](int stage) { return SwTile{s0 + C::kQ + stage * C::kTileQ, kBr}; };
  auto do_tile = [&](int stage) { return SwTile{s0 + C::kDO + stage * C::kTileQ, kBr}; };
  auto ds_tile = [&](int stage) { return SwTile{s0 + C::kDS + stage * C::kTileS, kBc}; };

  const BwdWalk<T, D, kBc, kBr, kThreads> walk(p);
  const int bhk = walk.bhk, n0 = walk.n0, b = walk.b, hk = walk.hk, steps = walk.steps;
  const uint8_t* mask = walk.mask();
  const int warp = warp_index(), g = threadIdx.x % 32 / 4;
  const int wg = warp / 4, wkey = warp * 16;  // warpgroup wg: keys 64 wg ..; this warp: 16 of them
  using Pos = typename BwdWalk<T, D, kBc, kBr, kThreads>::Pos;
  // A step's Q and dO tiles and (stat, delta, 1/|q|) vectors into a stage. kTma: TMA boxes, one per
  // 64-byte panel (rows past the end arrive as zeros), and bulk copies of the vectors up to i_pad, all
  // completing on the stage's mbarrier, issued by one thread of warpgroup 1 once its products for the
  // step are out. Otherwise cp.async by every thread, after warpgroup 0's products.
  constexpr int kLoader = 128;
  const uint32_t full = s0 + C::kBar;
  auto load_q = [&](Pos at, int stage) {
    const uint32_t vec = s0 + C::kVec + stage * 3 * kBr * 4;
    if constexpr (C::kTma) {
      const uint32_t bar = full + 8 * stage;
      const int64_t row = static_cast<int64_t>(b * p.H + at.h) * p.i_pad + at.m0;
      const int vec_bytes = min(kBr, p.i_pad - at.m0) * 4;
      mbar_expect_tx(bar, 2 * C::kTileQ + (p.rq ? 3 : 2) * vec_bytes);
      tma_load_tile<D / 32>(q_tile(stage), &args.q, bar, at.m0, at.h, b);
      tma_load_tile<D / 32>(do_tile(stage), &args.dout, bar, at.m0, at.h, b);
      bulk_load(vec, p.stat + row, vec_bytes, bar);
      bulk_load(vec + kBr * 4, p.delta + row, vec_bytes, bar);
      if (p.rq) bulk_load(vec + 2 * kBr * 4, p.rq + row, vec_bytes, bar);
    } else {
      walk.load_q(at, q_tile(stage), do_tile(stage), vec);
    }
  };
  walk.load_kv(sK, sV);
  Pos cur = walk.first(), prev = cur;
  if constexpr (C::kTma) {
    cp_async_commit();
    // The vectors' entries past i_pad are never loaded: finite there, the weights of rows past the end
    // stay 0 (P = 0 * stat).
    float* const vec0 = reinterpret_cast<float*>(smem_raw + (s0 - raw) + C::kVec);
    for (int i = threadIdx.x; i < 2 * 3 * kBr; i += kThreads) vec0[i] = 0.f;
    if (threadIdx.x == 0) {
      mbar_init(full, 1);
      mbar_init(full + 8, 1);
      mbar_fence_init();
    }
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
    if (threadIdx.x == kLoader && steps > 0) load_q(cur, 0);
  } else {
    if (steps > 0) load_q(cur, 0);
    cp_async_commit();
  }
  const KeyRows keys(p, b, hk, mask, n0 + wkey + g);

  // dQ += dS~ K for one step's queries, the reduction over the block's 128 keys: A = dS~ read M-major
  // from the dS~^T tile (keys as rows), B = this warpgroup's kDQ columns of K read N-major. One wgmma
  // group. At d64 it is issued ahead of the next step's S^T and dP^T, its accumulator live with theirs.
  // At d128 that makes 255 registers and ~120 bytes of spills per thread, so it goes in once both
  // warpgroups' dS~^T is stored, ahead of the second half's dV and dK, its registers those of the
  // consumed S^T and dP^T: no spills (bench/notes/run-25.md).
  // dq_keys: n 16-key slices of the reduction from slice kk0, the first overwriting dqa unless acc.
  float dqa[kDQ / 8][4];
  auto dq_keys = [&](int stage, int kk0, int n, bool acc) {
#pragma unroll
    for (int j = 0; j < n; ++j) {
      const int kk = kk0 + j;
      wgmma_ss<1, 1>(dqa, desc_mn(ds_tile(stage), kk * 16, 0), desc_mn(sK, kk * 16, wg * kDQ / 32), acc || j > 0, T{});
    }
  };
  auto dq_issue = [&](int stage) {
    dq_keys(stage, 0, kBc / 16, false);
    wgmma_commit();
  };
  // dQ leaves the block one of two ways (kBulkDQ, quadratic/tiles.h). Atomics: each thread adds its
  // accumulator with vector atomics, one per column tile of the next step's exps (all at once back up
  // the memory pipe, and each register they still have to read stalls the next write to it); rows
  // past the end go to the scratch row after dq_accum (no branch, which would rebuild the address per
  // atomic). At d128 each step's proxy fence is a memory barrier that holds every thread until its
  // atomics have drained. kBulkDQ: the accumulator goes to a staging tile in shared memory (16-byte
  // stores at the end of the step) and, after the next step's barrier, one elected thread per
  // warpgroup adds it to dq_accum's tiles with a bulk reduce (the TMA unit); at d64 the atomics hide
  // behind the rest of the step, and the staging would cost more than it saves.
  constexpr int kAtomics = kDQ / 4, kStores = kDQ / 8;  // per thread and step
  float* const dq_scratch = p.dq_accum + static_cast<int64_t>(p.B) * p.H * p.I * D;
  float* dq_ptr[2];  // atomics: this thread's two rows, at its first column
  auto dq_rows = [&](Pos at) {
    float* dq = p.dq_accum + static_cast<int64_t>(b * p.H + at.h) * p.I * D;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int t = at.m0 + warp % 4 * 16 + g + 8 * hf, c = wg * kDQ + 2 * (threadIdx.x % 4);
      dq_ptr[hf] = (t < p.I ? dq + static_cast<int64_t>(t) * D : dq_scratch) + c;
    }
  };
  auto dq_add = [&](int i) {  // after dq_rows: row hf, column tile n
    const int hf = i / (kDQ / 8), n = i % (kDQ / 8);
    red_add2(dq_ptr[hf] + 8 * n, dqa[n][2 * hf], dqa[n][2 * hf + 1]);
  };
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
  // The atomics, after column tile nq of half hq of the exps.
  auto dq_out = [&](int step, int hq, int nq) {
    static_assert(C::kBulkDQ || kAtomics % kNQ == 0, "the same number of atomics after each column tile");
#pragma unroll
    for (int j = 0; j < kAtomics / kNQ; ++j)
      if (!C::kBulkDQ && step > 0) dq_add((hq * kNQ / 2 + nq) * (kAtomics / kNQ) + j);
  };

  const Policy pol(p.score);
  float dk[kND][4] = {}, dv[kND][4] = {};
  for (int step = 0; step < steps; ++step) {
    // This step's tiles have landed for every thread and, like step-1's dS~^T (d64) or dQ staging (d128)
    // stores, are visible to the async proxy (one fence per step); every warpgroup is done with step-1,
    // so its dS~^T or staging tile is complete and the other stage is free.
    const int stage = step & 1, h = cur.h, m0 = cur.m0;
    if (!C::kTma) cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
    if (C::kBulkDQ && elected && step >= 1) dq_reduce();
    if (C::kTma) mbar_wait(full + 8 * stage, (step >> 1) & 1);

    // (d64) The previous step's dQ, then S^T = K Q^T and dP^T = V dO^T for this warpgroup's 64 keys x 64
    // queries, all in flight together; the next step's tiles start loading behind them.
    // Warpgroup 1 issues after warpgroup 0 has (named barrier 1): the tensor cores then finish
    // warpgroup 0's products first, and its exps start while warpgroup 1's run (bench/notes/run-16.md).
    // Both sides bar.sync, warpgroup 1 reaches it first anyway; with bar.arrive racecheck reported
    // warpgroup 0's next cp.async as racing with warpgroup 1's reads, which the block barrier already
    // orders.
    float sc[kNQ][4], dp[kNQ][4];
    if (wg == 1) named_sync(1, kThreads);
    wgmma_fence();
    if (!C::kBulkDQ && step > 0) dq_issue(stage ^ 1);
#pragma unroll
    for (int kk = 0; kk < kKD; ++kk)
      wgmma_ss<0, 0>(sc, desc_k(sK, 64 * wg, kk * 16, sizeof(T)), desc_k(q_tile(stage), 0, kk * 16, sizeof(T)), kk > 0,
                     T{});
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < kKD; ++kk)
      wgmma_ss<0, 0>(dp, desc_k(sV, 64 * wg, kk * 16, sizeof(T)), desc_k(do_tile(stage), 0, kk * 16, sizeof(T)),
                     kk > 0, T{});
    wgmma_commit();
    if (wg == 0) named_sync(1, kThreads);
    if ((!C::kTma || threadIdx.x == kLoader) && step + 1 < steps) load_q(walk.next(cur), stage ^ 1);
    if (!C::kTma) cp_async_commit();
    // (At d64, adding dQ after a wait for its group alone would overlap the atomics too, but ptxas then
    // serialises every wgmma of the kernel: it sees accumulators read inside the pipeline stage.)
    wgmma_wait<0>();
    if (!C::kBulkDQ && step > 0) {
      fence_acc(dqa);
      dq_rows(prev);
    }
    fence_acc(sc);
    fence_acc(dp);

    // Per half of the queries: P^T and dS~^T, then dV += P^T dO and dK += dS~^T Q (16 queries per k-step,
    // dO and Q read N-major) issued at once, so the first half's products run during the second
    // half's exps.
    constexpr int kHalf = kNQ / 2;
    uint32_t pa[kNQ / 2][M::kA], da[kNQ / 2][M::kA];
#pragma unroll
    for (int hq = 0; hq < 2; ++hq) {
      const float* vec = s_vec + stage * 3 * kBr + hq * kBr / 2;
      bwd_scores<T, D, kBc, kBr / 2>(p, pol, *reinterpret_cast<float(*)[kHalf][4]>(sc[hq * kHalf]),
                                     *reinterpret_cast<float(*)[kHalf][4]>(dp[hq * kHalf]), vec, vec + kBr,
                                     vec + 2 * kBr, keys, b, h, n0, m0 + hq * kBr / 2, n0 + wkey + g, mask,
                                     [&](int nq) { dq_out(step, hq, nq); });
#pragma unroll
      for (int kq = hq * kHalf / 2; kq < (hq + 1) * kHalf / 2; ++kq) {
        M::c_to_a(pa[kq], sc[2 * kq], sc[2 * kq + 1]);
        M::c_to_a(da[kq], dp[2 * kq], dp[2 * kq + 1]);
      }
      if (C::kBulkDQ && hq == 1) {  // dQ ahead of the second half's dV and dK
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
      wgmma_fence();
#pragma unroll
      for (int kq = hq * kHalf / 2; kq < (hq + 1) * kHalf / 2; ++kq) {
        wgmma_rs<1>(dv, pa[kq], desc_mn(do_tile(stage), kq * 16, 0), 1, T{});
        wgmma_rs<1>(dk, da[kq], desc_mn(q_tile(stage), kq * 16, 0), 1, T{});
      }
      wgmma_commit();
    }
    // d128: dQ to the staging tile once its product is in, while the second half's dV and dK run. d64:
    // dS~^T to this step's buffer while those run, for dQ during the next step.
    if constexpr (C::kBulkDQ) {
      wgmma_wait<1>();
      fence_acc(dqa);
#pragma unroll
      for (int n = 0; n < kStores; ++n) dq_stage(n);
    } else {
      store_ds_sm90<T>(ds_tile(stage), da, wkey);
    }
    wgmma_wait<0>();
    fence_acc(dk);
    fence_acc(dv);
    prev = cur;
    cur = walk.next(cur);
  }
  if (steps > 0) {  // the last step's dQ: staged at d128, still to compute at d64
    fence_proxy_async();
    if constexpr (C::kBulkDQ) {
      named_sync(2 + wg, 128);
      if (elected) {
        dq_reduce();
        bulk_wait<0>();
      }
    } else {
      __syncthreads();
      wgmma_fence();
      dq_issue((steps - 1) & 1);
      wgmma_wait<0>();
      fence_acc(dqa);
      dq_rows(prev);
#pragma unroll
      for (int i = 0; i < kAtomics; ++i) dq_add(i);
    }
  }
  bwd_store_dkdv<T, D>(p, dk, dv, sK, wkey + g, keys, bhk, n0);
#endif
}

// EXPERIMENT (issue 37, ATTN_BWD_WS=1 at d64): the backward in the shape cuDNN's has (bench/notes/run-37.md).
// Three warpgroups: a producer (one thread) streams K/V once and each step's Q, dO and row vectors by TMA
// through kStages mbarrier stages; two consumers of 64 keys each compute S^T, dP^T, P^T, dS~^T, dV and dK
// as the kernel above does, with no block barrier. A step's whole dQ (N = D, one read of dS~) is computed
// by one consumer, the two taking turns by step; it stages dQ in shared memory and adds it to dq_accum's
// tiles (dq_tile_slot) with one bulk reduce. dS~^T tiles alternate by step; named barriers hand them over:
// ds_full (the other consumer's half is in) and ds_empty (the last dQ that read the buffer is done).
template <class T, int D>
struct Sm90BwdWs {
  static constexpr int kCols = 128, kRows = 64, kStages = 3, kThreads = 384;
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  static constexpr int kTileK = kCols * D * sizeof(T), kTileQ = kRows * D * sizeof(T);
  static constexpr int kTileS = kCols * kRows * sizeof(T), kTileDQ = kRows * D * 4, kVecBytes = 3 * kRows * 4;
  // K | V | kStages x Q | kStages x dO | 2 x dS~^T | 2 x dQ staging | kStages x vectors | mbarriers.
  static constexpr int kK = 0, kV = kTileK, kQ = 2 * kTileK, kDO = kQ + kStages * kTileQ;
  static constexpr int kDS = kDO + kStages * kTileQ, kDQS = kDS + 2 * kTileS, kVec = kDQS + 2 * kTileDQ;
  static constexpr int kBar = kVec + kStages * kVecBytes, kBytes = kBar + 8 * (1 + 2 * kStages) + 1024;
  static_assert(kRows == kDqTileRows, "dQ's tiles (dq_tile_slot) are one step of queries");
  static_assert(kBytes <= 227 * 1024, "shared memory");
};
struct Sm90BwdWsArgs {
  CUtensorMap q, dout, k, v;
  Params p;
};

// EXPERIMENT kVar bits: 1 = a proxy fence before each stage's release; 2 = P^T while dP^T is in flight
// (cuDNN's order within a consumer); 4 = warpgroup 1 issues a step's S^T and dP^T after warpgroup 0 has.
template <class T, int D, class Policy, int kVar>
__global__ void __launch_bounds__(Sm90BwdWs<T, D>::kThreads, 1)
    bwd_sm90_ws_kernel(const __grid_constant__ Sm90BwdWsArgs args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = Sm90BwdWs<T, D>;
  using M = Mma<T>;
  const Params& p = args.p;
  constexpr int kBc = C::kCols, kBr = C::kRows, kStages = C::kStages, kPanels = D / 32;
  constexpr int kKD = D / 16, kNQ = kBr / 8, kND = D / 8;
  constexpr int kDsFull = 1, kDsEmpty = 3, kStaged = 5, kTurn = 7;  // named barriers, + buffer or warpgroup
  constexpr bool kFence = kVar & 1, kSplit = (kVar & 2) && Policy::kZeroAtHidden, kTurns = kVar & 4;
  constexpr bool kRedDQ = kVar & 16;  // EXPERIMENT: dQ by 16-byte atomics into the tiles, no staging
  extern __shared__ __align__(1024) char smem_raw[];
  const uint32_t raw = smem_u32(smem_raw), s0 = (raw + 1023) & ~1023u;
  const SwTile sK{s0 + C::kK, kBc}, sV{s0 + C::kV, kBc};
  auto q_tile = [&](int st) { return SwTile{s0 + C::kQ + st * C::kTileQ, kBr}; };
  auto do_tile = [&](int st) { return SwTile{s0 + C::kDO + st * C::kTileQ, kBr}; };
  auto ds_tile = [&](int buf) { return SwTile{s0 + C::kDS + buf * C::kTileS, kBc}; };
  const uint32_t kv_full = s0 + C::kBar;
  auto q_full = [&](int st) { return kv_full + 8 * (1 + st); };
  auto q_empty = [&](int st) { return kv_full + 8 * (1 + kStages + st); };

  using Walk = BwdWalk<T, D, kBc, kBr, 256>;
  using Pos = typename Walk::Pos;
  const Walk walk(p);
  const int bhk = walk.bhk, n0 = walk.n0, b = walk.b, hk = walk.hk, steps = walk.steps;
  const int warp = warp_index(), wg = warp / 4;
  if (threadIdx.x == 0) {
    mbar_init(kv_full, 1);
    for (int st = 0; st < kStages; ++st) {
      mbar_init(q_full(st), 32);  // the producer warp's lanes, after their vectors (and the tiles' bytes)
      mbar_init(q_empty(st), 8);  // one arrival per consumer warp
    }
    mbar_fence_init();
  }
  __syncthreads();

  if (wg == 2) {  // the producer: one warp
    setmaxnreg_dec<C::kProducerRegs>();
    if (warp == 8) {
      const int lane = lane_id();
      if (lane == 0) {
        mbar_expect_tx(kv_full, 2 * C::kTileK);
        tma_load_tile<kPanels>(sK, &args.k, kv_full, n0, hk, b);
        tma_load_tile<kPanels>(sV, &args.v, kv_full, n0, hk, b);
      }
      // The row vectors go through the lanes' own loads and stores, not a bulk copy: the consumers read
      // them with ordinary loads, and the stage's mbarriers then order every access within one proxy
      // (compute-sanitizer's racecheck flagged the bulk copy's writes against them).
      auto copy_vec = [&](const float* src, uint32_t dst, int n) {  // kBr floats, 16 lanes x 4; 0 from n on
        if (lane < 16) {
          float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
          if (4 * lane < n) x = *reinterpret_cast<const float4*>(src + 4 * lane);
          sts128(dst + 16 * lane, x.x, x.y, x.z, x.w);
        }
      };
      Pos at = walk.first();
      for (int step = 0; step < steps; ++step) {
        const int st = step % kStages;
        if (step >= kStages) mbar_wait(q_empty(st), (step / kStages - 1) & 1);
        const uint32_t bar = q_full(st), vec = s0 + C::kVec + st * C::kVecBytes;
        const int64_t row = static_cast<int64_t>(b * p.H + at.h) * p.i_pad + at.m0;
        const int n = p.i_pad - at.m0;  // a multiple of 4: i_pad is
        if (lane == 0) {
          mbar_add_tx(bar, 2 * C::kTileQ);
          tma_load_tile<kPanels>(q_tile(st), &args.q, bar, at.m0, at.h, b);
          tma_load_tile<kPanels>(do_tile(st), &args.dout, bar, at.m0, at.h, b);
        }
        copy_vec(p.stat + row, vec, n);
        copy_vec(p.delta + row, vec + kBr * 4, n);
        if (p.rq) copy_vec(p.rq + row, vec + 2 * kBr * 4, n);
        mbar_arrive(bar);
        at = walk.next(at);
      }
    }
    return;
  }
  setmaxnreg_inc<C::kConsumerRegs>();

  const int g = threadIdx.x % 32 / 4, wkey = warp * 16;
  const uint8_t* mask = walk.mask();
  const KeyRows keys(p, b, hk, mask, n0 + wkey + g);
  const float* s_vec = reinterpret_cast<const float*>(smem_raw + (s0 - raw) + C::kVec);
  const bool elected = threadIdx.x % 128 == 0;
  const uint32_t s_dq = s0 + C::kDQS + wg * C::kTileDQ + threadIdx.x % 128 * 16;
  const Policy pol(p.score);
  float dk[kND][4] = {}, dv[kND][4] = {};
  mbar_wait(kv_full, 0);
  Pos cur = walk.first();
  for (int step = 0; step < steps; ++step) {
    const int st = step % kStages, buf = step & 1, h = cur.h, m0 = cur.m0;
    const bool mine = wg == buf;  // this warpgroup computes the step's dQ
    mbar_wait(q_full(st), (step / kStages) & 1);
    float sc[kNQ][4], dp[kNQ][4];
    if (kTurns && wg == 1) named_sync(kTurn + buf, 256);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kKD; ++kk)
      wgmma_ss<0, 0>(sc, desc_k(sK, 64 * wg, kk * 16, sizeof(T)), desc_k(q_tile(st), 0, kk * 16, sizeof(T)), kk > 0,
                     T{});
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < kKD; ++kk)
      wgmma_ss<0, 0>(dp, desc_k(sV, 64 * wg, kk * 16, sizeof(T)), desc_k(do_tile(st), 0, kk * 16, sizeof(T)), kk > 0,
                     T{});
    wgmma_commit();
    if (kTurns && wg == 0) named_arrive(kTurn + buf, 256);
    constexpr int kHalf = kNQ / 2;
    if constexpr (kSplit) {
      wgmma_wait<1>();
      fence_acc(sc);
#pragma unroll
      for (int hq = 0; hq < 2; ++hq) {
        const float* vec = s_vec + st * 3 * kBr + hq * kBr / 2;
        bwd_scores<T, D, kBc, kBr / 2>(p, pol, *reinterpret_cast<float(*)[kHalf][4]>(sc[hq * kHalf]),
                                       *reinterpret_cast<float(*)[kHalf][4]>(dp[hq * kHalf]), vec, vec + kBr,
                                       vec + 2 * kBr, keys, b, h, n0, m0 + hq * kBr / 2, n0 + wkey + g, mask,
                                       NoHook{}, std::integral_constant<int, 1>{});
      }
    }
    wgmma_wait<0>();
    fence_acc(sc);
    fence_acc(dp);

    uint32_t pa[kNQ / 2][M::kA], da[kNQ / 2][M::kA];
#pragma unroll
    for (int hq = 0; hq < 2; ++hq) {
      const float* vec = s_vec + st * 3 * kBr + hq * kBr / 2;
      bwd_scores<T, D, kBc, kBr / 2>(p, pol, *reinterpret_cast<float(*)[kHalf][4]>(sc[hq * kHalf]),
                                     *reinterpret_cast<float(*)[kHalf][4]>(dp[hq * kHalf]), vec, vec + kBr,
                                     vec + 2 * kBr, keys, b, h, n0, m0 + hq * kBr / 2, n0 + wkey + g, mask,
                                     NoHook{}, std::integral_constant<int, kSplit ? 2 : 3>{});
#pragma unroll
      for (int kq = hq * kHalf / 2; kq < (hq + 1) * kHalf / 2; ++kq) {
        M::c_to_a(pa[kq], sc[2 * kq], sc[2 * kq + 1]);
        M::c_to_a(da[kq], dp[2 * kq], dp[2 * kq + 1]);
      }
      wgmma_fence();
#pragma unroll
      for (int kq = hq * kHalf / 2; kq < (hq + 1) * kHalf / 2; ++kq) {
        wgmma_rs<1>(dv, pa[kq], desc_mn(do_tile(st), kq * 16, 0), 1, T{});
        wgmma_rs<1>(dk, da[kq], desc_mn(q_tile(st), kq * 16, 0), 1, T{});
      }
      wgmma_commit();
    }
    // dS~^T into this step's buffer, once the dQ that last read it (step - 2's, by the other
    // warpgroup unless this one) is done; then the step's dQ by its warpgroup.
    if (!mine && step >= 2) named_sync(kDsEmpty + buf, 256);
    store_ds_sm90<T>(ds_tile(buf), da, wkey);
    fence_proxy_async();
    float dqa[kND][4];
    if (mine) {
      named_sync(kDsFull + buf, 256);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBc / 16; ++kk)
        wgmma_ss<1, 1>(dqa, desc_mn(ds_tile(buf), kk * 16, 0), desc_mn(sK, kk * 16, 0), kk > 0, T{});
      wgmma_commit();
    } else {
      named_arrive(kDsFull + buf, 256);
    }
    wgmma_wait<0>();
    fence_acc(dk);
    fence_acc(dv);
    if (kFence) fence_proxy_async();
    __syncwarp();
    if (lane_id() == 0) mbar_arrive(q_empty(st));
    if (mine) {
      fence_acc(dqa);
      if (step + 2 < steps) named_arrive(kDsEmpty + buf, 256);
      if constexpr (kRedDQ) {
        float* dst = p.dq_accum + (static_cast<int64_t>(b * p.H + h) * dq_tiled_rows(p.I) + m0) * D;
#pragma unroll
        for (int n = 0; n < kND; ++n)
          red_add4(dst + (n * 128 + threadIdx.x % 128) * 4, dqa[n][0], dqa[n][1], dqa[n][2], dqa[n][3]);
        cur = walk.next(cur);
        continue;
      }
      if (elected) bulk_wait_read<0>();  // this warpgroup's last reduce has read the staging tile
      named_sync(kStaged + wg, 128);
#pragma unroll
      for (int n = 0; n < kND; ++n) sts128(s_dq + n * 128 * 16, dqa[n][0], dqa[n][1], dqa[n][2], dqa[n][3]);
      fence_proxy_async();
      named_sync(kStaged + wg, 128);
      if (elected) {
        float* dst = p.dq_accum + (static_cast<int64_t>(b * p.H + h) * dq_tiled_rows(p.I) + m0) * D;
        bulk_reduce_add(dst, s0 + C::kDQS + wg * C::kTileDQ, C::kTileDQ);
        bulk_commit();
      }
    }
    cur = walk.next(cur);
  }
  if (elected) bulk_wait<0>();
  bwd_store_dkdv<T, D>(p, dk, dv, sK, wkey + g, keys, bhk, n0);
#endif
}

// One CTA per (key tile, batch, kv head); false where TMA cannot describe the tensors.
template <class T, int D>
bool run_bwd_ws(const Params& p, Score score, cudaStream_t stream, cudaError_t* err, int var) {
  using C = Sm90BwdWs<T, D>;
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  Sm90BwdWsArgs args;
  args.p = p;
  if (!make_tensor_map(&args.q, p.q, kBf16, D, p.I, p.H, p.B, p.q_si, p.q_sh, p.q_sb, C::kRows) ||
      !make_tensor_map(&args.dout, p.dout, kBf16, D, p.I, p.H, p.B, D, static_cast<int64_t>(p.I) * D,
                       static_cast<int64_t>(p.H) * p.I * D, C::kRows) ||
      !make_tensor_map(&args.k, p.k, kBf16, D, p.J, p.Hkv, p.B, p.k_sj, p.k_sh, p.k_sb, C::kCols) ||
      !make_tensor_map(&args.v, p.v, kBf16, D, p.J, p.Hkv, p.B, p.v_sj, p.v_sh, p.v_sb, C::kCols))
    return false;
  const int64_t blocks = static_cast<int64_t>(cdiv(p.J, C::kCols)) * p.B * p.Hkv;
  *err = with_policy(score, [&](auto policy) {
    using P = typename decltype(policy)::type;
    auto go = [&](auto kernel) { return launch(kernel, blocks, C::kThreads, C::kBytes, args, stream); };
    const cudaError_t e = var == 3   ? go(bwd_sm90_ws_kernel<T, D, P, 3>)
                          : var == 5 ? go(bwd_sm90_ws_kernel<T, D, P, 5>)
                          : var == 7 ? go(bwd_sm90_ws_kernel<T, D, P, 7>)
                          : var == 8 ? go(bwd_sm90_ws_kernel<T, D, P, 0>)
                          : var == 16 ? go(bwd_sm90_ws_kernel<T, D, P, 16>)
                                     : go(bwd_sm90_ws_kernel<T, D, P, 1>);
    return e != cudaSuccess ? e : run_dq_finalize(dtype_of<T>(), p, D, true, stream);
  });
  return true;
}

// One CTA per (key tile, batch, kv head).
template <class T, int D>
cudaError_t Sm90Bwd<T, D>::run(const Params& p, Score score, cudaStream_t stream) {
  using C = Sm90Bwd<T, D>;
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  if constexpr (D == 64) {  // EXPERIMENT
    const char* e = std::getenv("ATTN_BWD_WS");
    cudaError_t err = cudaSuccess;
    if (e != nullptr && e[0] != '0' && run_bwd_ws<T, D>(p, score, stream, &err, std::atoi(e))) return err;
  }
  Sm90BwdParam<T, D> args;
  if constexpr (C::kTma) {
    args.p = p;
    if (!make_tensor_map(&args.q, p.q, kBf16, D, p.I, p.H, p.B, p.q_si, p.q_sh, p.q_sb, C::kRows) ||
        !make_tensor_map(&args.dout, p.dout, kBf16, D, p.I, p.H, p.B, D, static_cast<int64_t>(p.I) * D,
                         static_cast<int64_t>(p.H) * p.I * D, C::kRows))
      return run_bwd<T, D>(p, score, stream);
  } else {
    args = p;
  }
  const int64_t blocks = static_cast<int64_t>(cdiv(p.J, C::kCols)) * p.B * p.Hkv;
  return with_policy(score, [&](auto policy) {
    const cudaError_t err =
        launch(bwd_sm90_kernel<T, D, typename decltype(policy)::type>, blocks, C::kWarps * 32, C::kBytes, args, stream);
    return err != cudaSuccess ? err : run_dq_finalize(dtype_of<T>(), p, D, C::kBulkDQ, stream);
  });
}

}  // namespace attn
