// Backward: one block per (batch, kv head, tile of keys); it walks every query tile of every query
// head of its group, so dK and dV are summed in registers and written once.
//
// Each warp owns 16 keys and computes the transposed scores S^T = K Q^T and dP^T = V dO^T: with keys
// as rows, P^T and dS^T come out in the accumulator layout that feeds dV += P^T dO and dK += dS^T Q
// directly, with no shared-memory round trip. Only dQ = dS K needs dS with queries as rows: it goes
// through shared memory once, and each step's dQ is added to an fp32 buffer with vector atomics
// (dq_finalize applies the l2norm backward and converts). No N x N buffer exists anywhere.
// One barrier per step: the next Q/dO tile loads while this one is used, and the dQ product of a step
// runs during the next one, from a second dS buffer.
#pragma once
#include "block.cuh"

namespace attn {

// A backward step's per-query vectors (Params), kBwdVecs runs of the step's query count of floats in
// shared memory, in this order: every backward kernel copies them (bwd_vec_source) in a stage with its
// Q and dO tiles.
enum BwdVec { kVecStat, kVecDpOffset, kVecDpScale, kVecQscale, kBwdVecs };
__device__ __forceinline__ const float* bwd_vec_source(const Params& p, int i) {
  return i == kVecStat ? p.stat : i == kVecDpOffset ? p.dp_offset : i == kVecDpScale ? p.dp_scale : p.qscale;
}
// The same vectors as bwd_scores reads them: `stride` floats apart from `v`.
struct StepVecs {
  const float *stat, *dp_offset, *dp_scale, *qscale;
  __device__ StepVecs(const float* v, int stride)
      : stat(v + kVecStat * stride), dp_offset(v + kVecDpOffset * stride), dp_scale(v + kVecDpScale * stride),
        qscale(v + kVecQscale * stride) {}
};

template <class T, int D>
struct BwdSmem {  // K | V | 2 x Q | 2 x dO | 2 x dS^T | 2 x the step's vectors
  using C = BwdConfig<T, D>;
  static constexpr int kPitch = D * sizeof(T) + 16, kSPitch = C::kRows * sizeof(T) + 16;
  static constexpr int kK = 0, kV = C::kCols * kPitch, kQ = kV + C::kCols * kPitch;
  static constexpr int kDO = kQ + 2 * C::kRows * kPitch, kDS = kDO + 2 * C::kRows * kPitch;
  static constexpr int kVec = kDS + 2 * C::kCols * kSPitch, kBytes = kVec + 2 * kBwdVecs * C::kRows * 4;
};

// What a thread needs about its two keys, key0 and key0 + 8 (rows g and g + 8 of its warp's 16).
struct KeyRows {
  float rk[2];     // 1/|k| (for dK), 1 without the qk norm
  bool kept[2];    // inside the sequence and kept by the mask
  int first_q[2];  // the first query that may see the key under causal
  __device__ KeyRows(const Params& p, int b, int hk, const uint8_t* mask, int key0) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int s = key0 + 8 * hf;
      rk[hf] = p.rk && s < p.J ? p.rk[static_cast<int64_t>(b * p.Hkv + hk) * p.j_pad + s] : 1.f;
      kept[hf] = s < p.J && (mask == nullptr || mask[s]);
      first_q[hf] = p.causal ? s - (p.J - p.I) : 0;
    }
  }
};

// Whether the backward's tile of keys n0 .. n0 + kBc - 1 and queries m0 .. m0 + rows - 1 has an edge: cuts a
// sequence end or the causal diagonal, or has a key mask. Then bwd_scores tests visibility per element and
// takes the offset off after the scale; elsewhere it fuses the two. A kernel asks once a step, for all of
// the step's rows, however it splits them.
template <int kBc>
__device__ __forceinline__ bool bwd_edge(const Params& p, int n0, int m0, int rows, const uint8_t* mask) {
  return n0 + kBc > p.J || m0 + rows > p.I || mask != nullptr || (p.causal && n0 + kBc - 1 > m0 + p.J - p.I);
}

// One warp's 16 keys x kBr queries m0.. of a backward step, from S^T = K Q^T (sc) and dP^T = V dO^T (dp)
// in the m16n8 accumulator layout: on return sc holds P^T and dp holds dS~^T. vec: the queries' vectors
// (Params, StepVecs); edge: bwd_edge of the step; key0 = this thread's first key (g of the warp's 16).
// after_tile(nq) runs once each column tile's weights are done (the Hopper backward spreads its dQ
// atomics there). kExtras false compiles out the bias, its gradient and the mask (has_extras).
struct NoHook {
  __device__ void operator()(int) const {}
};
template <class T, int kBr, class Policy, class Hook = NoHook, bool kExtras = true>
__device__ __forceinline__ void bwd_scores(const Params& p, const Policy& pol, float (&sc)[kBr / 8][4],
                                           float (&dp)[kBr / 8][4], const StepVecs& vec, const KeyRows& keys,
                                           bool edge, int b, int h, int m0, int key0, const uint8_t* mask,
                                           const Hook& after_tile = Hook{}) {
  constexpr int kNQ = kBr / 8;
  const int tq = lane_id() % 4;
  // Logits y with hidden pairs at -inf (the forward's visibility rules), then P and dL/dx per
  // element. With the qk norm the keys are the forward's unit rows k/|k| (attn_fwd), so dS~ = dL/dx *
  // dy/d(q.k) = dL/dx * qscale flows into dK (to k/|k|, which bwd_store_dkdv takes back to k) and dQ.
  // The weights repeat the forward's arithmetic: scale = qscale = alpha rq per query and, for a policy
  // whose backward works on y - offset (kBwdOffset), on tiles without edges or bias one fused FMA
  // s * scale - offset; elsewhere the offset comes off after the bias.
  auto pair = [&](const float* v, int nq) { return *reinterpret_cast<const float2*>(v + nq * 8 + 2 * tq); };
  float2 qs[kNQ];  // qscale of this thread's two queries in each column tile
#pragma unroll
  for (int nq = 0; nq < kNQ; ++nq) qs[nq] = pair(vec.qscale, nq);
  auto scale_of = [&](int nq, int e) { return (e & 1) ? qs[nq].y : qs[nq].x; };
  auto each_score = [&](auto&& f) {  // f(nq, e) for each of the thread's scores
#pragma unroll
    for (int nq = 0; nq < kNQ; ++nq)
#pragma unroll
      for (int e = 0; e < 4; ++e) f(nq, e);
  };
  auto query_of = [&](int nq, int e) { return m0 + nq * 8 + 2 * tq + (e & 1); };
  const T* bias = kExtras && p.bias ? static_cast<const T*>(p.bias) + b * p.bias_sb + h * p.bias_sh : nullptr;
  constexpr bool kOffset = Policy::kBwdOffset;
  const float fused_offset = kOffset && !edge && !bias ? Policy::bwd_offset(p.score) : 0.f;
  each_score([&](int nq, int e) {
    if constexpr (kOffset) sc[nq][e] = fmaf(sc[nq][e], scale_of(nq, e), -fused_offset);  // exactly s * r unfused
    else sc[nq][e] *= scale_of(nq, e);
  });
  if (edge) {
    each_score([&](int nq, int e) {
      const int t = query_of(nq, e);
      if (!keys.kept[e >> 1] || t < keys.first_q[e >> 1] || t >= p.I) sc[nq][e] = -INFINITY;
    });
  }
  if (bias) {
    each_score([&](int nq, int e) {
      if (sc[nq][e] != -INFINITY)
        sc[nq][e] = fmaf(p.score.beta, bias_at(p, bias, query_of(nq, e), key0 + 8 * (e >> 1)), sc[nq][e]);
    });
  }
  // Where the weight has no zero at -inf (!kZeroAtHidden), the hidden pairs are marked here, and their P
  // and dL/dx set to 0 after the per-element loop, so tiles without edges or bias test nothing per element.
  uint32_t hidden = 0;
  if constexpr (!Policy::kZeroAtHidden) {
    static_assert(kNQ * 4 <= 32, "one bit per score");
    if (edge || bias) {
      each_score([&](int nq, int e) {
        if (sc[nq][e] == -INFINITY) hidden |= 1u << (4 * nq + e);
      });
    }
  }
  if (kOffset && (edge || bias)) each_score([&](int nq, int e) { sc[nq][e] -= Policy::bwd_offset(p.score); });
  // P and dS~ per element: dL/dx of g = dP dp_scale - dp_offset, one FMA (Params). That is dS~ itself,
  // or, where dL/dx is stored as the bias gradient, dL/dx, scaled into dS~ after the store.
#pragma unroll
  for (int nq = 0; nq < kNQ; ++nq) {
    const float2 stat2 = pair(vec.stat, nq), off2 = pair(vec.dp_offset, nq), mul2 = pair(vec.dp_scale, nq);
    float P[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) P[e] = pol.bwd_weight(sc[nq][e], (e & 1) ? stat2.y : stat2.x);
    if constexpr (!Policy::kRowMax) {  // the weights as the forward rounded them for P V, over the row sum
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const float2 r = round_for_mma<T>(make_float2(P[e], P[e + 1]));
        P[e] = r.x * stat2.x, P[e + 1] = r.y * stat2.y;
      }
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const bool odd = e & 1;
      const float y = sc[nq][e], stat = odd ? stat2.y : stat2.x;
      dp[nq][e] = pol.dlogit(P[e], y, fmaf(dp[nq][e], odd ? mul2.y : mul2.x, -(odd ? off2.y : off2.x)), stat);
      sc[nq][e] = P[e];
    }
    after_tile(nq);
  }
  if (hidden) {
    each_score([&](int nq, int e) {
      if (hidden >> (4 * nq + e) & 1) sc[nq][e] = 0.f, dp[nq][e] = 0.f;
    });
  }
  if (kExtras && p.dbias) {
    T* dbias = static_cast<T*>(p.dbias) + static_cast<int64_t>(b * p.H + h) * p.I * p.J;
    each_score([&](int nq, int e) {
      const int t = query_of(nq, e), s = key0 + 8 * (e >> 1);
      if (t < p.I && s < p.J) dbias[static_cast<int64_t>(t) * p.J + s] = Elem<T>::from_float(dp[nq][e]);
      dp[nq][e] *= scale_of(nq, e);
    });
  }
}

// dK = c rk (W - (u.W) u) (the l2norm's backward, from W, the gradient to the unit rows u = k/|k| still
// in shared memory; the projection drops out when |k| <= eps, where the normalisation divides by the
// constant eps) and dV, for the thread's keys at rows r0 and r0 + 8 of the block's key tile sK (a Tile
// or SwTile).
template <class T, int D, class KTile>
__device__ __forceinline__ void bwd_store_dkdv(const Params& p, float (&dk)[D / 8][4], float (&dv)[D / 8][4],
                                               const KTile& sK, int r0, const KeyRows& keys, int bhk, int n0) {
  constexpr int kND = D / 8;
  const int tq = lane_id() % 4;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int r = r0 + 8 * hf;
    if (p.rk) {
      float2 kv[kND];
      float dot = 0.f;
#pragma unroll
      for (int nd = 0; nd < kND; ++nd) {
        kv[nd] = lds_pair<T>(sK.at(r, (nd * 8 + 2 * tq) * sizeof(T)));
        dot += kv[nd].x * dk[nd][2 * hf] + kv[nd].y * dk[nd][2 * hf + 1];
      }
      dot += __shfl_xor_sync(0xffffffffu, dot, 1);
      dot += __shfl_xor_sync(0xffffffffu, dot, 2);
      const float proj = keys.rk[hf] < 1.f / kNormEps ? dot : 0.f, rk = keys.rk[hf];
#pragma unroll
      for (int nd = 0; nd < kND; ++nd) {
        dk[nd][2 * hf] = rk * (dk[nd][2 * hf] - proj * kv[nd].x);
        dk[nd][2 * hf + 1] = rk * (dk[nd][2 * hf + 1] - proj * kv[nd].y);
      }
    }
    const int s = n0 + r;
    if (s < p.J) {
      T* dkp = static_cast<T*>(p.dk) + (static_cast<int64_t>(bhk) * p.J + s) * D;
      T* dvp = static_cast<T*>(p.dv) + (static_cast<int64_t>(bhk) * p.J + s) * D;
#pragma unroll
      for (int nd = 0; nd < kND; ++nd) {
        stg_pair(dkp + nd * 8 + 2 * tq, p.score.grad_scale * dk[nd][2 * hf],
                 p.score.grad_scale * dk[nd][2 * hf + 1]);
        stg_pair(dvp + nd * 8 + 2 * tq, dv[nd][2 * hf], dv[nd][2 * hf + 1]);
      }
    }
  }
}

// A backward block: kBc keys from n0 of one (batch, kv head), walking every query tile of every query
// head of the group that sees one of its keys: steps are (query head, query tile), tile-minor, and
// under causal query t sees key n0 once t >= n0 - (J - I). Positions advance without division.
template <class T, int D, int kBc, int kBr, int kThreads>
struct BwdWalk {
  struct Pos {
    int h, m0;
  };
  const Params& p;
  int bhk, n0, b, hk, m_first, m_start, steps;
  __device__ explicit BwdWalk(const Params& p_) : p(p_) {
    // Key blocks first to last (under causal the first see the most queries).
    const BlockSlot slot = block_slot(p, p.B * p.Hkv, cdiv(p.J, kBc));
    bhk = slot.head;
    n0 = slot.rank * kBc;
    b = bhk / p.Hkv, hk = bhk % p.Hkv;
    const int n_mtiles = cdiv(p.I, kBr);
    m_first = p.causal ? min(n_mtiles, max(0, n0 - (p.J - p.I)) / kBr) : 0;
    // Where a block starts its walk over the query tiles (it wraps around to m_first): without causal,
    // rotated by the key block, so that the blocks of a head add to different dQ tiles at a time.
    m_start = p.causal ? m_first : n0 / kBc % n_mtiles;
    steps = p.group * (n_mtiles - m_first);
  }
  __device__ Pos first() const { return {hk * p.group, m_start * kBr}; }
  __device__ Pos next(Pos s) const {
    s.m0 += kBr;
    if (s.m0 >= p.I) s.m0 = m_first * kBr;
    if (s.m0 == m_start * kBr) ++s.h;
    return s;
  }
  __device__ const uint8_t* mask() const { return p.mask ? p.mask + b * p.mask_sb : nullptr; }

  // cp.async of the block's K and V tiles, and of one step's Q and dO tiles with their vectors (kBr
  // floats each from `vec`), into tiles of any layout.
  template <class Tl>
  __device__ void load_kv(Tl sK, Tl sV) const {
    constexpr int kRowBytes = D * sizeof(T);
    const T* k = static_cast<const T*>(p.k) + p.ks.offset(b, hk);
    const T* v = static_cast<const T*>(p.v) + p.vs.offset(b, hk);
    cp_tile<kBc, kRowBytes, kThreads>(sK, reinterpret_cast<const char*>(k + n0 * p.ks.i), p.ks.i * sizeof(T),
                                      p.J - n0, k);
    cp_tile<kBc, kRowBytes, kThreads>(sV, reinterpret_cast<const char*>(v + n0 * p.vs.i), p.vs.i * sizeof(T),
                                      p.J - n0, v);
  }
  template <class Tl>
  __device__ void load_q(Pos at, Tl sQ, Tl sDO, uint32_t vec) const {
    constexpr int kRowBytes = D * sizeof(T);
    const T* q = static_cast<const T*>(p.q) + p.qs.offset(b, at.h);
    const T* dout = static_cast<const T*>(p.dout) + p.dos.offset(b, at.h);
    cp_tile<kBr, kRowBytes, kThreads>(sQ, reinterpret_cast<const char*>(q + at.m0 * p.qs.i), p.qs.i * sizeof(T),
                                      p.I - at.m0, q);
    cp_tile<kBr, kRowBytes, kThreads>(sDO, reinterpret_cast<const char*>(dout + at.m0 * p.dos.i),
                                      p.dos.i * sizeof(T), p.I - at.m0, dout);
    const int64_t row = static_cast<int64_t>(b * p.H + at.h) * p.i_pad + at.m0;
#pragma unroll
    for (int i = 0; i < kBwdVecs; ++i) cp_floats<kBr>(vec + i * kBr * 4, bwd_vec_source(p, i) + row, p.i_pad - at.m0);
  }
};

// dS~^T of this thread's keys `key` (+8) x the step's queries to the step's buffer, for dQ in the next
// step (the Hopper kernel stores with stmatrix instead: store_ds_sm90).
template <class T, int kNQ, class Tile_>
__device__ __forceinline__ void store_ds(const Tile_& sds, const float (&ds)[kNQ][4], int key) {
  const int tq = threadIdx.x % 4;
#pragma unroll
  for (int nq = 0; nq < kNQ; ++nq)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf)
      sts_pair<T>(sds.at(key + 8 * hf, (nq * 8 + 2 * tq) * sizeof(T)), ds[nq][2 * hf], ds[nq][2 * hf + 1]);
}

// Adds this thread's dQ (an m16n8 accumulator: query rows t0 + g (+8) x columns c0 + 8 n + 2 tq (+1))
// to the fp32 buffer dq (rows of D) with vector atomics; rows past the end are skipped.
template <int kN>
__device__ __forceinline__ void add_dq(const Params& p, float* dq, const float (&acc)[kN][4], int t0, int D, int c0) {
  const int g = threadIdx.x % 32 / 4, tq = threadIdx.x % 4;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int t = t0 + g + 8 * hf;
    if (t < p.I) {
#pragma unroll
      for (int n = 0; n < kN; ++n)
        red_add2(dq + static_cast<int64_t>(t) * D + c0 + n * 8 + 2 * tq, acc[n][2 * hf], acc[n][2 * hf + 1]);
    }
  }
}

template <class T, int D, class Policy>
__global__ void __launch_bounds__(BwdConfig<T, D>::kWarps * 32, 1) bwd_kernel(const Params p) {
  using C = BwdConfig<T, D>;
  using S = BwdSmem<T, D>;
  using M = Mma<T>;
  constexpr int kThreads = C::kWarps * 32, kBc = C::kCols, kBr = C::kRows;
  constexpr int kKD = D / 16, kNQ = kBr / 8, kND = D / 8;
  static_assert(kBc == 16 * C::kWarps, "one m16 tile of keys per warp");
  extern __shared__ __align__(16) char smem[];
  const uint32_t s0 = smem_u32(smem);
  const Tile sK{s0 + S::kK, S::kPitch}, sV{s0 + S::kV, S::kPitch};
  const float* s_vec = reinterpret_cast<const float*>(smem + S::kVec);

  const BwdWalk<T, D, kBc, kBr, kThreads> walk(p);
  const int bhk = walk.bhk, n0 = walk.n0, b = walk.b, hk = walk.hk, steps = walk.steps;
  const uint8_t* mask = walk.mask();
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4;
  const int wkey = warp * 16;
  using Pos = typename BwdWalk<T, D, kBc, kBr, kThreads>::Pos;
  auto load_q = [&](Pos at, int stage) {
    walk.load_q(at, Tile{s0 + S::kQ + stage * kBr * S::kPitch, S::kPitch},
                Tile{s0 + S::kDO + stage * kBr * S::kPitch, S::kPitch}, s0 + S::kVec + stage * kBwdVecs * kBr * 4);
  };
  walk.load_kv(sK, sV);
  Pos cur = walk.first(), prev = cur;
  if (steps > 0) load_q(cur, 0);
  cp_async_commit();

  const KeyRows keys(p, b, hk, mask, n0 + wkey + g);

  cp_async_wait<0>();
  __syncthreads();
  uint32_t kf[C::kKVInRegs ? kKD : 1][M::kA], vf[C::kKVInRegs ? kKD : 1][M::kA];
  if constexpr (C::kKVInRegs) {
#pragma unroll
    for (int kk = 0; kk < kKD; ++kk) {
      M::lda(kf[kk], sK, wkey, kk * 16);
      M::lda(vf[kk], sV, wkey, kk * 16);
    }
  }

  // dQ += dS~ K for one step's queries, from the dS~ buffer it wrote: warps split the queries into
  // 16-row groups x column groups, and add their part to the fp32 buffer.
  auto dq_step = [&](Pos at, int stage) {
    constexpr int kQRG = kBr / 16, kQCG = C::kWarps / kQRG, kDC = D / kQCG, kNDC = kDC / 8;
    static_assert(kQRG * kQCG == C::kWarps && kDC % 8 == 0, "dQ warp split");
    const Tile sDS{s0 + S::kDS + stage * kBc * S::kSPitch, S::kSPitch};
    const int rg = warp % kQRG, c0 = warp / kQRG * kDC;
    float dqa[kNDC][4] = {};
#pragma unroll
    for (int kk = 0; kk < kBc / 16; ++kk) {
      // The k-step moves the tiles' bases, so the per-lane part of each address is computed once.
      const Tile ds_k{sDS.base + kk * 16 * sDS.pitch, sDS.pitch}, k_k{sK.base + kk * 16 * sK.pitch, sK.pitch};
      uint32_t a[M::kA];
      M::lda_t(a, ds_k, 0, rg * 16);
#pragma unroll
      for (int nd = 0; nd < kNDC; nd += 2) {
        uint32_t b0[M::kB], b1[M::kB];
        if (nd + 1 < kNDC) {
          M::ldb2_t(b0, b1, k_k, 0, c0 + nd * 8);
          M::mma(dqa[nd], a, b0);
          M::mma(dqa[nd + 1], a, b1);
        } else {
          M::ldb1_t(b0, k_k, 0, c0 + nd * 8);
          M::mma(dqa[nd], a, b0);
        }
      }
    }
    add_dq(p, p.dq_accum + static_cast<int64_t>(b * p.H + at.h) * p.I * D, dqa, at.m0 + rg * 16, D, c0);
  };

  const Policy pol(p.score);
  float dk[kND][4] = {}, dv[kND][4] = {};
  for (int step = 0; step < steps; ++step) {
    // This step's Q/dO tile has landed for every thread, every warp is done with step-1 (so the dS~
    // buffer of step-1 is complete and the other Q/dO stage is free for step+1).
    cp_async_wait<0>();
    __syncthreads();
    const int stage = step & 1, h = cur.h, m0 = cur.m0;
    if (step + 1 < steps) load_q(walk.next(cur), stage ^ 1);
    cp_async_commit();
    const Tile sQ{s0 + S::kQ + stage * kBr * S::kPitch, S::kPitch};
    const Tile sDO{s0 + S::kDO + stage * kBr * S::kPitch, S::kPitch};
    if (step > 0) dq_step(prev, stage ^ 1);

    // S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys x kBr queries.
    float sc[kNQ][4] = {}, dp[kNQ][4] = {};
#pragma unroll
    for (int kk = 0; kk < kKD; ++kk) {
      uint32_t ka[M::kA], va[M::kA];
      const uint32_t *kp, *vp;
      if constexpr (C::kKVInRegs) {
        kp = kf[kk], vp = vf[kk];
      } else {
        M::lda(ka, sK, wkey, kk * 16);
        M::lda(va, sV, wkey, kk * 16);
        kp = ka, vp = va;
      }
#pragma unroll
      for (int nq = 0; nq < kNQ; nq += 2) {
        uint32_t b0[M::kB], b1[M::kB];
        M::ldb2(b0, b1, sQ, nq * 8, kk * 16);
        M::mma(sc[nq], kp, b0);
        M::mma(sc[nq + 1], kp, b1);
        M::ldb2(b0, b1, sDO, nq * 8, kk * 16);
        M::mma(dp[nq], vp, b0);
        M::mma(dp[nq + 1], vp, b1);
      }
    }

    bwd_scores<T, kBr>(p, pol, sc, dp, StepVecs(s_vec + stage * kBwdVecs * kBr, kBr), keys,
                       bwd_edge<kBc>(p, n0, m0, kBr, mask), b, h, m0, n0 + wkey + g, mask);

    // dV += P^T dO and dK += dS~^T Q, 16 queries per k-step.
#pragma unroll
    for (int kq = 0; kq < kNQ / 2; ++kq) {
      uint32_t pa[M::kA], da[M::kA];
      M::c_to_a(pa, sc[2 * kq], sc[2 * kq + 1]);
      M::c_to_a(da, dp[2 * kq], dp[2 * kq + 1]);
#pragma unroll
      for (int nd = 0; nd < kND; nd += 2) {
        uint32_t b0[M::kB], b1[M::kB];
        M::ldb2_t(b0, b1, sDO, kq * 16, nd * 8);
        M::mma(dv[nd], pa, b0);
        M::mma(dv[nd + 1], pa, b1);
        M::ldb2_t(b0, b1, sQ, kq * 16, nd * 8);
        M::mma(dk[nd], da, b0);
        M::mma(dk[nd + 1], da, b1);
      }
    }
    // dS~^T to this step's buffer, for dQ during the next step.
    store_ds<T>(Tile{s0 + S::kDS + stage * kBc * S::kSPitch, S::kSPitch}, dp, wkey + g);
    prev = cur;
    cur = walk.next(cur);
  }
  if (steps > 0) {
    __syncthreads();
    dq_step(prev, (steps - 1) & 1);
  }

  bwd_store_dkdv<T, D>(p, dk, dv, sK, wkey + g, keys, bhk, n0);
}

// One CTA per (key tile, batch, kv head).
template <class T, int D>
cudaError_t run_bwd(const Params& p, Score score, cudaStream_t stream) {
  using C = BwdConfig<T, D>;
  const int64_t blocks = static_cast<int64_t>(cdiv(p.J, C::kCols)) * p.B * p.Hkv;
  return with_policy(score, [&](auto policy) {
    const cudaError_t err = launch(bwd_kernel<T, D, typename decltype(policy)::type>, blocks, C::kWarps * 32,
                                   BwdSmem<T, D>::kBytes, p, stream);
    return err != cudaSuccess ? err : run_dq_finalize(dtype_of<T>(), p, D, false, stream);
  });
}

}  // namespace attn
