// Forward: O_t = sum_s A_ts v_s / l_t, one block per (batch, head, tile of query rows).
//
// K/V tiles stream through three shared-memory stages with cp.async, two tiles ahead of the math, so
// one barrier per tile suffices and warps drift apart (one's exps overlap another's MMAs). Each warp
// owns 16*kMT query rows, keeps S = Q K^T for one key tile in registers, turns it into weights there
// (the score policy) and feeds them straight back into the tensor cores as the A operand of P V.
// With a fixed shift (bounded or unnormalised logits) there is no running max and no rescaling. The
// row sums l come from the tensor cores too (P times a column of ones): they add up the weights as
// rounded for P V, so every output row is exactly the convex combination of v that was computed.
#pragma once
#include "block.cuh"

namespace attn {

template <class T, int D>
struct FwdSmem {  // Q tile | kStages x K tile | kStages x V tile
  using C = FwdConfig<T, D>;
  static constexpr int kStages = 3, kPitch = D * sizeof(T) + 16;
  static constexpr int kQ = 0, kK = C::kRows * kPitch, kV = kK + kStages * C::kCols * kPitch;
  static constexpr int kBytes = kV + kStages * C::kCols * kPitch;
};

// One warp's 16*kMT query rows x 8*kNC keys of a forward step, from S = Q K^T in the m16n8 accumulator
// layout (rows row0 + 16 mt + g (+8), keys n0 + 8 nc + 2 tq (+1)): on return s holds the weights A(y)
// (0 where hidden), and with a running row max, mx is updated and o is rescaled to it (o's last tile
// holds the row sums, P times a column of ones, so they are rescaled with it). rs = alpha/|q| of the
// thread's rows (the logit scale: with the qk norm the keys are unit rows already, attn_fwd), last =
// their last visible key, bias = this (batch, head)'s bias or null. The rows br0 .. br0 + kBr - 1 (the block's
// or warpgroup's) decide whether the tile has an edge: cuts a sequence end, the causal diagonal or a key
// mask (otherwise every pair is visible). Shared by the mma.sync and wgmma forwards.
template <class T, int kBr, int kMT, int kNC, int kND, class Policy>
__device__ __forceinline__ void fwd_scores(const Params& p, const Policy& pol, float (&s)[kMT][kNC][4],
                                           float (&o)[kMT][kND][4], float (&mx)[kMT][2],
                                           const float (&rs)[kMT][2], const int (&last)[kMT][2], const T* bias,
                                           const uint8_t* mask, int row0, int n0, int br0, int g, int tq) {
  constexpr int kBc = 8 * kNC;
  auto each_score = [&](auto&& f) {  // f(score, mt, nc, e) for each of the thread's scores
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nc = 0; nc < kNC; ++nc)
#pragma unroll
        for (int e = 0; e < 4; ++e) f(s[mt][nc][e], mt, nc, e);
  };

  // A tile has an edge where it cuts a sequence end or the causal diagonal, or where the key mask
  // hides one of its keys: a mask that keeps the whole tile costs one ballot, not the per-element tests.
  const bool cut = n0 + kBc > p.J || br0 + kBr > p.I || (p.causal && n0 + kBc - 1 > br0 + p.J - p.I);
  const uint32_t cols = cut || mask != nullptr ? visible_cols<kNC>(p, mask, n0, tq) : kAllCols<kNC>;
  const bool edge = cut || (mask != nullptr && !__all_sync(~0u, cols == kAllCols<kNC>));

  bool fused = false;
  if constexpr (!Policy::kRowMax) {
    if (!edge && !bias) {  // the common case, fused: no hidden pair, no bias
      typename Policy::Row row[kMT][2];  // the rows' constants, once per tile
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) row[mt][hf] = pol.row(rs[mt][hf]);
      each_score([&](float& x, int mt, int, int e) { x = pol.fused(x, row[mt][e >> 1]); });
      fused = true;
    }
  }
  if (!fused) {
    // Logits y, with hidden pairs set to -inf. Only tiles that cut a sequence end, the causal
    // diagonal or a key mask test visibility per element; only bias loads the bias.
    each_score([&](float& x, int mt, int, int e) { x *= rs[mt][e >> 1]; });
    if (edge) {
      each_score([&](float& x, int mt, int nc, int e) {
        if (!(cols >> (2 * nc + (e & 1)) & 1) || nc * 8 + 2 * tq + (e & 1) > last[mt][e >> 1] - n0) x = -INFINITY;
      });
    }
    if (bias) {
      each_score([&](float& x, int mt, int nc, int e) {
        if (x != -INFINITY)
          x = fmaf(p.score.beta, bias_at(p, bias, row0 + mt * 16 + g + 8 * (e >> 1), n0 + nc * 8 + 2 * tq + (e & 1)),
                   x);
      });
    }
    if constexpr (Policy::kRowMax) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          float m = -INFINITY;
#pragma unroll
          for (int nc = 0; nc < kNC; ++nc) m = fmaxf(m, fmaxf(s[mt][nc][2 * hf], s[mt][nc][2 * hf + 1]));
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
          const float m_new = fmaxf(mx[mt][hf], m);
          const float base = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing visible yet stays 0
          const float corr = pol.rebase(mx[mt][hf], base);
          mx[mt][hf] = m_new;
#pragma unroll
          for (int nd = 0; nd < kND; ++nd) o[mt][nd][2 * hf] *= corr, o[mt][nd][2 * hf + 1] *= corr;
#pragma unroll
          for (int nc = 0; nc < kNC; ++nc)
#pragma unroll
            for (int c = 0; c < 2; ++c) s[mt][nc][2 * hf + c] = pol.rebase(s[mt][nc][2 * hf + c], base);
        }
    } else {
      each_score([&](float& y, int, int, int) {  // a hidden pair's weight is 0 (tested unless weight(-inf) is)
        y = Policy::kZeroAtHidden || y != -INFINITY ? pol.weight(y) : 0.f;
      });
    }
  }
}

// One forward block's share of the work and the pieces both forward kernels (mma.sync here, wgmma in
// fwd_sm90.cuh) do the same way: which (batch, head) and kBr query rows it owns, the loads of its Q tile
// and of K/V tiles, each row's logit scale, and the epilogue.
template <class T, int D, int kBr, int kBc, int kThreads>
struct FwdBlock {
  static constexpr int kRowBytes = D * sizeof(T);
  const Params& p;
  int bh, m0, n_tiles;
  const T *k, *v, *bias;
  const uint8_t* mask;
  int64_t row_vec;  // this (batch, head)'s offset in the per-row vectors (1/|q|, stat)

  __device__ explicit FwdBlock(const Params& params) : p(params) {
    // Row blocks latest first (under causal the heaviest first).
    const int m_blocks = cdiv(p.I, kBr);
    const BlockSlot slot = block_slot(p, p.B * p.H, m_blocks);
    bh = slot.head;
    m0 = (m_blocks - 1 - slot.rank) * kBr;
    const int b = bh / p.H, h = bh % p.H, hk = h / p.group;
    k = static_cast<const T*>(p.k) + p.ks.offset(b, hk);
    v = static_cast<const T*>(p.v) + p.vs.offset(b, hk);
    bias = p.bias ? static_cast<const T*>(p.bias) + b * p.bias_sb + h * p.bias_sh : nullptr;
    mask = p.mask ? p.mask + b * p.mask_sb : nullptr;
    row_vec = static_cast<int64_t>(bh) * p.i_pad;
    const int n_end = p.causal ? min(p.J, m0 + min(kBr, p.I - m0) + p.J - p.I) : p.J;  // keys the last row may see
    n_tiles = n_end > 0 ? cdiv(n_end, kBc) : 0;
  }

  template <class Dst>
  __device__ __forceinline__ void load_q(const Dst& sq) const {
    const T* q = static_cast<const T*>(p.q) + p.qs.offset(bh / p.H, bh % p.H);
    cp_tile<kBr, kRowBytes, kThreads>(sq, reinterpret_cast<const char*>(q + m0 * p.qs.i), p.qs.i * sizeof(T),
                                      min(kBr, p.I - m0), q);
  }
  // K/V tile `tile` into one stage.
  template <class Dst>
  __device__ __forceinline__ void load_kv(int tile, const Dst& sk, const Dst& sv) const {
    const int n0 = tile * kBc;
    cp_tile<kBc, kRowBytes, kThreads>(sk, reinterpret_cast<const char*>(k + n0 * p.ks.i), p.ks.i * sizeof(T), p.J - n0,
                                      k);
    cp_tile<kBc, kRowBytes, kThreads>(sv, reinterpret_cast<const char*>(v + n0 * p.vs.i), p.vs.i * sizeof(T), p.J - n0,
                                      v);
  }
  // alpha/|q| (alpha without the qk norm) of this thread's rows wrow + 16 mt + g + 8 hf, from the Q tile
  // sq once it has landed, so q is read once: the four threads of a quad share a row, each summing
  // every fourth 16-byte chunk of it. With the qk norm, 1/|q| also goes to p.rq for the backward (0
  // for the pad rows).
  template <int kMT, class Tile_>
  __device__ __forceinline__ void row_scales(const Tile_& sq, float (&rs)[kMT][2], int wrow) const {
    const int g = threadIdx.x % 32 / 4, tq = threadIdx.x % 4;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = wrow + mt * 16 + g + 8 * hf, t = m0 + r;
        float rq = 1.f;
        if (p.rq) {
          float ss = 0.f;
#pragma unroll
          for (int c = tq; c < kRowBytes / 16; c += 4) ss += sum_squares<T>(lds128(sq.at(r, c * 16)));
          ss += __shfl_xor_sync(0xffffffffu, ss, 1);
          ss += __shfl_xor_sync(0xffffffffu, ss, 2);
          rq = t < p.I ? 1.f / fmaxf(sqrtf(ss), kNormEps) : 0.f;
          if (tq == 0 && t < p.i_pad) p.rq[row_vec + t] = rq;
        }
        rs[mt][hf] = p.score.alpha * (t < p.I ? rq : 1.f);
      }
  }

  // O / l and the row statistic for the 16 kMT rows from wrow on, which only this warp reads in sQ (the
  // Q tile, reused to stage O for 16-byte coalesced stores). o's tile D / 8 holds the rows' complete
  // sums l (P times a column of ones: every column of the tile has them).
  template <class Policy, int kMT, class Tile_>
  __device__ __forceinline__ void store(const Tile_& sq, const float (&o)[kMT][D / 8 + 1][4],
                                        const float (&mx)[kMT][2], int wrow) const {
    const int lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const float l = o[mt][D / 8][2 * hf];
        const float inv = !p.normalize ? 1.f : (l > 0.f ? 1.f / l : 0.f);
        const int r = wrow + mt * 16 + g + 8 * hf;
#pragma unroll
        for (int nd = 0; nd < D / 8; ++nd)
          sts_pair<T>(sq.at(r, (nd * 8 + 2 * tq) * sizeof(T)), o[mt][nd][2 * hf] * inv, o[mt][nd][2 * hf + 1] * inv);
        if (tq == 0 && m0 + r < p.i_pad) {  // the pad rows too: the backward reads whole tiles of stat
          p.stat[row_vec + m0 + r] = Policy::row_stat(l, inv, mx[mt][hf]);
        }
      }
    __syncwarp();
    T* out = static_cast<T*>(p.o) + p.os.offset(bh / p.H, bh % p.H) + m0 * p.os.i;
    constexpr int kChunks = kRowBytes / 16;
#pragma unroll
    for (int c = lane; c < 16 * kMT * kChunks; c += 32) {
      const int r = wrow + c / kChunks, x = c % kChunks;
      if (m0 + r < p.I)
        *reinterpret_cast<uint4*>(reinterpret_cast<char*>(out + r * p.os.i) + x * 16) = lds128(sq.at(r, x * 16));
    }
  }
};

template <class T, int D, class Policy>
__global__ void __launch_bounds__(FwdConfig<T, D>::kWarps * 32) fwd_kernel(const Params p) {
  using C = FwdConfig<T, D>;
  using S = FwdSmem<T, D>;
  using M = Mma<T>;
  constexpr int kThreads = C::kWarps * 32, kBr = C::kRows, kBc = C::kCols;
  constexpr int kMT = kBr / (16 * C::kWarps);
  constexpr int kKD = D / 16, kNC = kBc / 8, kND = D / 8;
  extern __shared__ __align__(16) char smem[];
  const uint32_t s0 = smem_u32(smem);
  const Tile sQ{s0 + S::kQ, S::kPitch};

  const FwdBlock<T, D, kBr, kBc, kThreads> blk(p);
  const int m0 = blk.m0, n_tiles = blk.n_tiles;
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, tq = threadIdx.x % 4;
  const int wrow = warp * 16 * kMT;

  auto load_kv = [&](int tile) {
    const int stage = tile % S::kStages;
    blk.load_kv(tile, Tile{s0 + S::kK + stage * kBc * S::kPitch, S::kPitch},
                Tile{s0 + S::kV + stage * kBc * S::kPitch, S::kPitch});
  };
  blk.load_q(sQ);
  if (n_tiles > 0) load_kv(0);
  cp_async_commit();
  if (n_tiles > 1) load_kv(1);
  cp_async_commit();

  // The last visible key (-1 past the end) of this thread's rows wrow + 16 mt + g + 8 hf.
  int last[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) last[mt][hf] = last_key(p, m0 + wrow + mt * 16 + g + 8 * hf);

  cp_async_wait<1>();
  __syncthreads();
  float rs[kMT][2];
  blk.row_scales(sQ, rs, wrow);
  uint32_t qf[C::kQInRegs ? kMT : 1][C::kQInRegs ? kKD : 1][M::kA];
  if constexpr (C::kQInRegs) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int kk = 0; kk < kKD; ++kk) M::lda(qf[mt][kk], sQ, wrow + mt * 16, kk * 16);
  }

  const Policy pol(p.score);
  float o[kMT][kND + 1][4] = {};  // O, then the row sums (P * ones): rows g and g+8 in elements 0 and 2
  uint32_t ones[M::kB];
  M::ones_b(ones);
  float mx[kMT][2];  // running row max (kRowMax only)
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) mx[mt][0] = mx[mt][1] = -INFINITY;

  for (int j = 0; j < n_tiles; ++j) {
    // Tile j has landed for every thread, and every warp is done with tile j-1, whose stage the
    // load of tile j+2 reuses.
    cp_async_wait<1>();
    __syncthreads();
    if (j + 2 < n_tiles) load_kv(j + 2);
    cp_async_commit();
    const int stage = j % S::kStages, n0 = j * kBc;
    const Tile sK{s0 + S::kK + stage * kBc * S::kPitch, S::kPitch};
    const Tile sV{s0 + S::kV + stage * kBc * S::kPitch, S::kPitch};

    float s[kMT][kNC][4] = {};
#pragma unroll
    for (int kk = 0; kk < kKD; ++kk) {
      uint32_t qa[kMT][M::kA];
      if constexpr (!C::kQInRegs) {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) M::lda(qa[mt], sQ, wrow + mt * 16, kk * 16);
      }
#pragma unroll
      for (int nc = 0; nc < kNC; nc += 2) {
        uint32_t b0[M::kB], b1[M::kB];
        M::ldb2(b0, b1, sK, nc * 8, kk * 16);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          const uint32_t* a;
          if constexpr (C::kQInRegs) a = qf[mt][kk]; else a = qa[mt];
          M::mma(s[mt][nc], a, b0);
          M::mma(s[mt][nc + 1], a, b1);
        }
      }
    }

    fwd_scores<T, kBr>(p, pol, s, o, mx, rs, last, blk.bias, blk.mask, m0 + wrow, n0, m0, g, tq);

    // O += P V and its last tile += P 1 (the row sums), 16 keys (two accumulator tiles) per k-step.
#pragma unroll
    for (int kc = 0; kc < kNC / 2; ++kc) {
      uint32_t pa[kMT][M::kA];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        M::c_to_a(pa[mt], s[mt][2 * kc], s[mt][2 * kc + 1]);
        M::mma(o[mt][kND], pa[mt], ones);
      }
#pragma unroll
      for (int nd = 0; nd < kND; nd += 2) {
        uint32_t b0[M::kB], b1[M::kB];
        M::ldb2_t(b0, b1, sV, kc * 16, nd * 8);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          M::mma(o[mt][nd], pa[mt], b0);
          M::mma(o[mt][nd + 1], pa[mt], b1);
        }
      }
    }
  }

  blk.template store<Policy>(sQ, o, mx, wrow);
}

// One CTA per (query tile, batch, head).
template <class T, int D>
cudaError_t run_fwd(const Params& p, Score score, cudaStream_t stream) {
  using C = FwdConfig<T, D>;
  const int64_t blocks = static_cast<int64_t>(cdiv(p.I, C::kRows)) * p.B * p.H;
  return with_policy(score, [&](auto policy) {
    return launch(fwd_kernel<T, D, typename decltype(policy)::type>, blocks, C::kWarps * 32, FwdSmem<T, D>::kBytes,
                  p, stream);
  });
}

}  // namespace attn
