// Backward on Hopper (sm_90a): the mma.sync backward's block and step structure (bwd.cuh) with every
// product on warpgroup MMAs reading their operands straight from swizzled shared memory.
//
// One block per (batch, kv head, 128 keys): two warpgroups of 64 keys, each warp 16 of them, so the
// transposed scores S^T = K Q^T and dP^T = V dO^T land in exactly the registers the mma.sync kernel
// has them in, and the per-element work (bwd_scores) and the dK/dV epilogue are the same functions.
// Per step of 64 queries (32 at d128): S^T and dP^T (wgmma, both operands in shared memory), then P^T
// and dS~^T in registers feed dV += P^T dO and dK += dS~^T Q as register A operands, while dS~^T goes
// to shared memory for dQ = dS~ K in the next step (each warpgroup half of the head dim's columns,
// added to the fp32 buffer with vector atomics). Loads are cp.async, double-buffered, one barrier per
// step. (A producer warpgroup with TMA and mbarrier hand-offs between the warpgroups, as in the
// forward, was slower here: branch next/bwd-ws, bench/NOTES.md run 14.)
#pragma once
#include "bwd.cuh"
#include "wgmma.cuh"

namespace attn {

template <class T, int D>
struct Sm90Bwd {
  static constexpr bool kSupported = sizeof(T) == 2 && (D == 64 || D == 128);
  static cudaError_t run(const Params& p, Score score, cudaStream_t stream);  // the launch, after the kernel
  // Keys per block (64 per warpgroup) and queries per step. At d128 a warpgroup's dK and dV take 128
  // registers per thread, so steps are 32 queries and dQ is computed transposed (kDQt), dQ^T = K^T dS~^T:
  // M = the warpgroup's 64 columns of the head dim, N = the step's 32 queries.
  static constexpr int kWarps = 8, kCols = 128, kRows = D <= 64 ? 64 : 32;
  static constexpr bool kDQt = D > 64;
  static constexpr int kTileK = kCols * D * sizeof(T), kTileQ = kRows * D * sizeof(T);
  static constexpr int kTileS = kCols * kRows * sizeof(T);
  // K | V | 2 x Q | 2 x dO | 2 x dS~^T | 2 x (stat, delta, 1/|q|), every tile 1024-byte aligned (the
  // swizzle pattern's period), plus the slack to align the dynamic shared memory's start.
  static constexpr int kK = 0, kV = kTileK, kQ = 2 * kTileK, kDO = kQ + 2 * kTileQ, kDS = kDO + 2 * kTileQ;
  static constexpr int kVec = kDS + 2 * kTileS, kBytes = kVec + 2 * 3 * kRows * 4 + 1024;
};

// dS~^T of this warp's 16 keys from wkey x the step's queries to the step's buffer, for dQ in the next
// step: each column tile of the accumulator is two 8x8 matrices, so one stmatrix stores two tiles (one
// st.shared per pair of elements otherwise).
template <class T, int kNQ>
__device__ __forceinline__ void store_ds_sm90(const SwTile& sds, const float (&ds)[kNQ][4], int wkey) {
  const int l = lane_id(), row = wkey + (l & 7) + 8 * ((l >> 3) & 1);
#pragma unroll
  for (int nq = 0; nq < kNQ; nq += 2)
    stsm_x4(sds.at(row, (nq + (l >> 4)) * 8 * sizeof(T)), Elem<T>::pack(ds[nq][0], ds[nq][1]),
            Elem<T>::pack(ds[nq][2], ds[nq][3]), Elem<T>::pack(ds[nq + 1][0], ds[nq + 1][1]),
            Elem<T>::pack(ds[nq + 1][2], ds[nq + 1][3]));
}

template <class T, int D, class Policy>
__global__ void __launch_bounds__(Sm90Bwd<T, D>::kWarps * 32, 1) bwd_sm90_kernel(const Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = Sm90Bwd<T, D>;
  using M = Mma<T>;
  constexpr int kThreads = C::kWarps * 32, kBc = C::kCols, kBr = C::kRows;
  constexpr int kKD = D / 16, kNQ = kBr / 8, kND = D / 8, kDQ = D / 2;  // kDQ: dQ columns per warpgroup
  static_assert(C::kDQt ? kBr == 32 : kDQ == 32, "dQ's N: one 32-column panel (of K, or of dS~^T)");
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
  auto load_q = [&](Pos at, int stage) {
    walk.load_q(at, q_tile(stage), do_tile(stage), s0 + C::kVec + stage * 3 * kBr * 4);
  };
  walk.load_kv(sK, sV);
  Pos cur = walk.first(), prev = cur;
  if (steps > 0) load_q(cur, 0);
  cp_async_commit();
  const KeyRows keys(p, b, hk, mask, n0 + wkey + g);

  // dQ += dS~ K for one step's queries, the reduction over the block's 128 keys: A = dS~ read M-major
  // from the dS~^T tile (keys as rows), B = this warpgroup's 32-column panel of K read N-major; or
  // transposed, A = K^T (the warpgroup's 64 columns of K, read M-major) and B = dS~^T read N-major.
  // One wgmma group, issued ahead of the step's S^T and dP^T.
  float dqa[(C::kDQt ? kBr : kDQ) / 8][4];
  auto dq_issue = [&](int stage) {
#pragma unroll
    for (int kk = 0; kk < kBc / 16; ++kk) {
      if constexpr (C::kDQt)
        wgmma_ss<1, 1>(dqa, desc_mn(sK, kk * 16, 2 * wg), desc_mn(ds_tile(stage), kk * 16, 0), kk > 0, T{});
      else
        wgmma_ss<1, 1>(dqa, desc_mn(ds_tile(stage), kk * 16, 0), desc_mn(sK, kk * 16, wg), kk > 0, T{});
    }
    wgmma_commit();
  };
  // Its atomics go out one per column tile of the next step's exps (dq_one(i), i = 0 .. 7): all of
  // them at once back up the memory pipe, and every register they still have to read stalls the next
  // write to it, as do the loads behind them. Query rows past the end add to the scratch row after
  // dq_accum instead (no branch, which would rebuild the address per atomic).
  static_assert(sizeof(dqa) / sizeof(dqa[0][0]) == 16, "8 vector atomics per thread and step");
  float* const dq_scratch = p.dq_accum + static_cast<int64_t>(p.B) * p.H * p.I * D;
  float* dq_ptr[2];  // !kDQt: this thread's two rows, at its first column; kDQt: its first row and column
  int dq_t = 0;      // kDQt: that first row (its column tile n adds rows dq_t + 8 n)
  auto dq_rows = [&](Pos at) {
    float* dq = p.dq_accum + static_cast<int64_t>(b * p.H + at.h) * p.I * D;
    const int tq = threadIdx.x % 4;
    if constexpr (C::kDQt) {
      const int c = wg * kDQ + warp % 4 * 16 + (g & ~1);
      dq_t = at.m0 + 2 * tq + (g & 1);
      dq_ptr[0] = dq + static_cast<int64_t>(dq_t) * D + c;
      dq_ptr[1] = dq_scratch + c;
    } else {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int t = at.m0 + warp % 4 * 16 + g + 8 * hf, c = wg * kDQ + 2 * tq;
        dq_ptr[hf] = (t < p.I ? dq + static_cast<int64_t>(t) * D : dq_scratch) + c;
      }
    }
  };
  auto dq_one = [&](int i) {  // after dq_rows
    if constexpr (C::kDQt) {  // column tile n = i / 2 of dQ^T, its rows hf = i % 2; lanes g, g ^ 1 swap
      const int n = i / 2, hf = i % 2;
      const bool even = (g & 1) == 0;
      const float a0 = dqa[n][2 * hf], a1 = dqa[n][2 * hf + 1];
      const float x = __shfl_xor_sync(0xffffffffu, even ? a1 : a0, 4);
      red_add2((dq_t + 8 * n < p.I ? dq_ptr[0] + 8 * n * D : dq_ptr[1]) + 8 * hf, even ? a0 : x, even ? x : a1);
    } else {  // row hf = i / 4, column tile n = i % 4
      const int hf = i / 4, n = i % 4;
      red_add2(dq_ptr[hf] + 8 * n, dqa[n][2 * hf], dqa[n][2 * hf + 1]);
    }
  };

  const Policy pol(p);
  float dk[kND][4] = {}, dv[kND][4] = {};
  for (int step = 0; step < steps; ++step) {
    // This step's tiles have landed for every thread and, like step-1's dS~^T stores, are visible to
    // the async proxy (one fence per step); every warpgroup is done with step-1, so its dS~^T is
    // complete and the other stage is free.
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
    const int stage = step & 1, h = cur.h, m0 = cur.m0;

    // The previous step's dQ, then S^T = K Q^T and dP^T = V dO^T for this warpgroup's 64 keys x 64
    // queries, all in flight together; the next step's tiles start loading behind them.
    // Warpgroup 1 issues after warpgroup 0 has (named barrier 1): the tensor cores then finish
    // warpgroup 0's products first, and its exps start while warpgroup 1's run (H200: the cosine
    // backward 3-5% faster, the polynomial's unchanged; bench/NOTES.md run 16). Both sides bar.sync,
    // warpgroup 1 reaches it first anyway; with bar.arrive racecheck reported warpgroup 0's next
    // cp.async as racing with warpgroup 1's reads, which the block barrier already orders.
    float sc[kNQ][4], dp[kNQ][4];
    if (wg == 1) named_sync(1, kThreads);
    wgmma_fence();
    if (step > 0) dq_issue(stage ^ 1);
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
    if (step + 1 < steps) load_q(walk.next(cur), stage ^ 1);
    cp_async_commit();
    // (Adding dQ after a wait for its group alone would overlap the atomics too, but ptxas then
    // serialises every wgmma of the kernel: it sees accumulators read inside the pipeline stage.)
    wgmma_wait<0>();
    fence_acc(dqa);
    if (step > 0) dq_rows(prev);
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
                                     [&](int nq) {
#pragma unroll
                                       for (int j = 0; j < 8 / kNQ; ++j)
                                         if (step > 0) dq_one((hq * kHalf + nq) * (8 / kNQ) + j);
                                     });
#pragma unroll
      for (int kq = hq * kHalf / 2; kq < (hq + 1) * kHalf / 2; ++kq) {
        M::c_to_a(pa[kq], sc[2 * kq], sc[2 * kq + 1]);
        M::c_to_a(da[kq], dp[2 * kq], dp[2 * kq + 1]);
      }
      wgmma_fence();
#pragma unroll
      for (int kq = hq * kHalf / 2; kq < (hq + 1) * kHalf / 2; ++kq) {
        wgmma_rs<1>(dv, pa[kq], desc_mn(do_tile(stage), kq * 16, 0), 1, T{});
        wgmma_rs<1>(dk, da[kq], desc_mn(q_tile(stage), kq * 16, 0), 1, T{});
      }
      wgmma_commit();
    }
    // dS~^T to this step's buffer while those run, for dQ during the next step.
    store_ds_sm90<T>(ds_tile(stage), dp, wkey);
    wgmma_wait<0>();
    fence_acc(dk);
    fence_acc(dv);
    prev = cur;
    cur = walk.next(cur);
  }
  if (steps > 0) {
    fence_proxy_async();
    __syncthreads();
    wgmma_fence();
    dq_issue((steps - 1) & 1);
    wgmma_wait<0>();
    fence_acc(dqa);
    dq_rows(prev);
#pragma unroll
    for (int i = 0; i < 8; ++i) dq_one(i);
  }
  bwd_store_dkdv<T, D>(p, dk, dv, sK, wkey + g, keys, bhk, n0);
#endif
}

// One CTA per (key tile, batch, kv head).
template <class T, int D>
cudaError_t Sm90Bwd<T, D>::run(const Params& p, Score score, cudaStream_t stream) {
  using C = Sm90Bwd<T, D>;
  const int64_t blocks = static_cast<int64_t>(cdiv(p.J, C::kCols)) * p.B * p.Hkv;
  return with_policy(score, [&](auto policy) {
    return launch(bwd_sm90_kernel<T, D, typename decltype(policy)::type>, blocks, C::kWarps * 32, C::kBytes, p, stream);
  });
}

}  // namespace attn
