// Fastmax's linear form on Hopper (sm_90a), in chunks of L rows with the state written out per chunk.
//
// The sweep of linear.cuh carries the state through a sequence in one CTA per slice, and is bound by
// the latency of its per-chunk steps. Here the two halves of a sweep are kernels of their own:
//   lin_state  S_c = sum over the chunks before c (after c: reverse; all: non-causal) of phi(x) w^T,
//              one CTA per (batch, kv head, 256 features) walking the chunks in order, the state as
//              wgmma accumulators (M = features, N = w's columns, K = rows); before each chunk it
//              writes S_c, coefficients applied, as an "image": tiles of 64 features x the columns,
//              already in the 64-byte-swizzled layout of wgmma.cuh, so that a reader copies a tile
//              into shared memory with one bulk copy;
//   lin_read   every (chunk, 128 rows) at once: R1 y = psi(x) S_c (M = rows, N = w's columns,
//              K = features), R2 dq = d psi(x) . (S_c g) (M = rows, N = features, K = g's columns,
//              then contracted with x in registers).
// phi and psi are never stored: a 16-feature group is one (a, 16-column block bb) pair, and its
// operand fragment is x's (or x^T's) fragment of block bb times x_a (one packed multiply per register).
// Features are packed by symmetry: the second-order groups are (a, bb) with bb >= a / 16, those with
// bb > a / 16 at weight 2 (they stand for (b, a) too); first order: x' = [x, 1, 0 ...] (the constant
// at column D). With L >= 512 the state costs a few percent of the products, and every product is a
// dense GEMM with no per-chunk latency in it.
#pragma once
#include "linear.cuh"
#include "wgmma.cuh"

namespace attn {

template <int D>
struct LinFeatures {
  static constexpr int kNb = D / 16, kFirst = kNb + 1;  // x' = [x, 1, 0 ...] is kNb + 1 blocks
  static constexpr int kSecond = 16 * kNb * (kNb + 1) / 2;
  static constexpr int kDw = D + 8, kPanels = (kDw + 31) / 32;  // w = [v, 1] in whole n8 tiles
  static constexpr int kTileBytes = kPanels * 64 * 64;          // an image tile: 64 features
  __host__ __device__ static int groups(bool second) { return kFirst + (second ? kSecond : 0); }
  __host__ __device__ static int tiles(bool second) { return (groups(second) + 3) / 4; }
  // Group g as (a, bb): first order a = -1, bb = g; second order a-major, bb from a's own block on.
  __device__ static void decode(int g, int& a, int& bb) {
    a = -1, bb = g;
    if (g < kFirst) return;
    int s = g - kFirst;
#pragma unroll
    for (int k = 0; k < kNb; ++k) {
      const int per = kNb - k;
      if (s < 16 * per) {
        a = 16 * k + s / per, bb = k + s % per;
        return;
      }
      s -= 16 * per;
    }
  }
  // The groups in order, one step at a time (readers walk the tiles in order; decode's divisions per group
  // had made integer arithmetic most of lin_read's instructions). bb = -1 past the last group.
  struct Cursor {
    int a = -1, bb = 0, left;
    __device__ explicit Cursor(bool second) : left(groups(second)) {}
    __device__ void next() {
      if (--left <= 0) {
        bb = -1;
      } else if (a < 0) {
        if (++bb == kFirst) a = 0, bb = 0;
      } else if (++bb == kNb) {
        ++a, bb = a / 16;
      }
    }
  };
  // What row b of group (a, bb) is multiplied by in the image: both sides' coefficients and the
  // packing's weight.
  __device__ static float coef(const float* c, int a, int bb, int b) {
    if (a >= 0) return c[2] * (bb == a / 16 ? 1.f : 2.f);
    return bb < kNb ? c[1] : b == 0 ? c[0] : 0.f;
  }
};

template <class T, int D>
struct LinState90 {
  using F = LinFeatures<D>;
  static constexpr int kTiles = D <= 32 ? 2 : D <= 64 ? 3 : 2;  // image tiles per CTA (accumulators)
  static constexpr int kRows = 64, kThreads = 128;              // rows per stage; one warpgroup
  static constexpr int kXPitch = (D + 16) * 2 + 16;
  static constexpr int kW = F::kPanels * 64 * kRows, kX = kRows * kXPitch, kStage = kW + kX;
  static constexpr int kBytes = 2 * kStage + 1024;
};

template <class T, int D>
__global__ void __launch_bounds__(128) lin_state_kernel(const LinStateParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = LinState90<T, D>;
  using F = LinFeatures<D>;
  using M = Mma<T>;
  constexpr int kN = F::kDw, kTiles = C::kTiles, kRows = C::kRows, kDp = D + 16;
  extern __shared__ __align__(16) char smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023) & ~1023u;
  const int warp = warp_index() % 4, lane = lane_id(), g = lane / 4, tq = lane % 4;
  const int tiles = F::tiles(p.second), groups = F::groups(p.second), tile0 = blockIdx.x * kTiles;
  const int b = blockIdx.y / p.Hkv, hkv = blockIdx.y % p.Hkv;
  auto w_tile = [&](int s) { return SwTile{base + s * C::kStage, kRows}; };
  auto x_tile = [&](int s) { return Tile{base + s * C::kStage + C::kW, C::kXPitch}; };

  int ga[kTiles], gb[kTiles];  // this warp's group (a, bb) per tile; bb = -1: none
#pragma unroll
  for (int i = 0; i < kTiles; ++i) {
    const int gi = (tile0 + i) * 4 + warp;
    F::decode(gi, ga[i], gb[i]);
    if (gi >= groups) gb[i] = -1;
  }
  float acc[kTiles][kN / 8][4] = {};

  const int per_chunk = p.heads * (p.L / kRows);  // stages per chunk
  const int steps = (p.causal ? p.chunks - 1 : p.chunks) * per_chunk;
  const int H = p.Hkv * p.heads;
  auto chunk_of = [&](int i) { return p.reverse ? p.chunks - 1 - i : i; };
  auto load = [&](int i, int s) {
    const int c = chunk_of(i / per_chunk), h = hkv * p.heads + (i % per_chunk) / (p.L / kRows);
    const int64_t row = ((static_cast<int64_t>(b) * p.chunks + c) * H + h) * p.L + (i % (p.L / kRows)) * kRows;
    const char* x = static_cast<const char*>(p.x) + row * kDp * 2;
    const char* w = static_cast<const char*>(p.w) + row * kDp * 2;
    cp_tile<kRows, kDp * 2, 128>(x_tile(s), x, kDp * 2, kRows, x);
    cp_tile<kRows, kN * 2, 128>(w_tile(s), w, kDp * 2, kRows, w);
  };
  // The state before chunk i of the walk, as image tiles (rows g, g + 8 of this warp's 16).
  const int n_img = p.causal ? p.chunks : 1;
  const float scale = *p.scale;
  auto publish = [&](int i) {
    wgmma_wait<0>();
#pragma unroll
    for (int t = 0; t < kTiles; ++t) fence_acc(acc[t]);
    const int c = p.causal ? chunk_of(i) : 0;
#pragma unroll
    for (int t = 0; t < kTiles; ++t) {
      if (tile0 + t >= tiles) continue;
      char* img = static_cast<char*>(p.image) +
                  ((static_cast<int64_t>(blockIdx.y) * n_img + c) * tiles + tile0 + t) * F::kTileBytes;
      const SwTile at{0, 64};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = 16 * warp + g + 8 * h;
        const float s = gb[t] < 0 ? 0.f : scale * F::coef(p.coef, ga[t], gb[t], g + 8 * h);
#pragma unroll
        for (int n = 0; n < kN / 8; ++n)
          *reinterpret_cast<uint32_t*>(img + at.at(r, (8 * n + 2 * tq) * 2)) =
              Elem<T>::pack(s * acc[t][n][2 * h], s * acc[t][n][2 * h + 1]);
      }
      // The panels' columns past w's are zeros (R2 reads them as its K padding).
      constexpr int kPad = (F::kPanels * 64 - kN * 2) / 16;
      for (int k = threadIdx.x; k < 64 * kPad; k += 128)
        *reinterpret_cast<uint4*>(img + at.at(k / kPad, kN * 2 + (k % kPad) * 16)) = make_uint4(0, 0, 0, 0);
    }
  };

  if (steps > 0) load(0, 0);
  cp_async_commit();
  for (int i = 0; i < steps; ++i) {
    if (p.causal && i % per_chunk == 0) publish(i / per_chunk);
    if (i + 1 < steps) load(i + 1, (i + 1) & 1);
    cp_async_commit();
    cp_async_wait<1>();
    fence_proxy_async();
    __syncthreads();
    const SwTile wt = w_tile(i & 1);
    const Tile xt = x_tile(i & 1);
    uint32_t af[2][kTiles][4];
#pragma unroll
    for (int ks = 0; ks < kRows / 16; ++ks) {
      // phi(x)^T's fragment: x^T's of block bb times x_a at the same rows (pairs of rows s, s + 1 and
      // s + 8, s + 9, from two words by a byte permute).
      const int s0 = ks * 16 + 2 * tq;
#pragma unroll
      for (int t = 0; t < kTiles; ++t) {
        uint32_t* a = af[ks & 1][t];
        if (gb[t] < 0) {
          a[0] = a[1] = a[2] = a[3] = 0;
          continue;
        }
        M::lda_t(a, xt, ks * 16, gb[t] * 16);
        if (ga[t] >= 0) {
          const int byte = (ga[t] & ~1) * 2;
          const uint32_t sel = ga[t] & 1 ? 0x7632 : 0x5410;
          const uint32_t lo = __byte_perm(lds32(xt.at(s0, byte)), lds32(xt.at(s0 + 1, byte)), sel);
          const uint32_t hi = __byte_perm(lds32(xt.at(s0 + 8, byte)), lds32(xt.at(s0 + 9, byte)), sel);
          a[0] = mul2<T>(a[0], lo), a[1] = mul2<T>(a[1], lo), a[2] = mul2<T>(a[2], hi), a[3] = mul2<T>(a[3], hi);
        }
      }
      wgmma_fence();
#pragma unroll
      for (int t = 0; t < kTiles; ++t) wgmma_rs<1>(acc[t], af[ks & 1][t], desc_mn(wt, ks * 16, 0), 1, T{});
      wgmma_commit();
      wgmma_wait<1>();
    }
    wgmma_wait<0>();
    __syncthreads();  // the stage is read (wgmma done) before the next load overwrites it
  }
  if (p.causal) {
    if (p.chunks > 0) publish(p.chunks - 1);
  } else {
    publish(0);
  }
#endif
}

template <class T, int D, bool kR1, bool kR2>
struct LinRead90 {
  using F = LinFeatures<D>;
  // Two warpgroups of 64 rows; no producer warp: a 288-thread block at two per SM got 80 registers, and
  // ptxas serialised R1's wgmmas for want of them (C7512).
  static constexpr int kRows = 128, kThreads = 2 * 128;
  // R1 at d64: two blocks per SM (registers and shared memory), which overlap each other's waits.
  static_assert(kR1 != kR2, "R1 and R2 are launches of their own (together, ptxas spills at d128)");
  static constexpr int kBlocks = D <= 64 && kR1 ? 2 : 1;
  static constexpr int kXPitch = (D + 16) * 2 + 16;
  // dq's pitch D + 8: a quad's float2 at columns 2 tq of rows g fill all 32 banks per half warp.
  static constexpr int kDqPitch = D + 8, kX = kRows * kXPitch, kDq = kR2 ? kRows * kDqPitch * 4 : 0;
  static constexpr int kFixed = (kR2 ? 2 : 1) * kX + kDq + 1024 + 256;  // x, g, dq, alignment, barriers
  static constexpr int kFit = (227 * 1024 / kBlocks - kFixed) / F::kTileBytes;
  static constexpr int kStages = kFit < 4 ? kFit : 4;
  static constexpr int kBytes = kStages * F::kTileBytes + kFixed;
  static_assert(kStages >= 3, "tile t + 1 is in flight before tile t releases its stage (refill)");
};

template <class T, int D, bool kR1, bool kR2>
__global__ void __launch_bounds__(LinRead90<T, D, kR1, kR2>::kThreads, (LinRead90<T, D, kR1, kR2>::kBlocks))
    lin_read_kernel(const LinReadParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = LinRead90<T, D, kR1, kR2>;
  using F = LinFeatures<D>;
  using M = Mma<T>;
  constexpr int kN = F::kDw, kStages = C::kStages, kDp = D + 16, kNb = F::kNb;
  extern __shared__ __align__(16) char smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023) & ~1023u;
  char* const gbase = smem_raw + (base - smem_u32(smem_raw));
  const int tiles = F::tiles(p.second);
  const int blocks = p.L / C::kRows, c = blockIdx.x / blocks, t0 = (blockIdx.x % blocks) * C::kRows;
  const int H = p.Hkv * p.heads, b = blockIdx.y / H, h = blockIdx.y % H, hkv = h / p.heads;
  const int64_t row0 = ((static_cast<int64_t>(b) * p.chunks + c) * H + h) * p.L + t0;
  const Tile xs{base + kStages * F::kTileBytes, C::kXPitch}, gs{xs.base + C::kX, C::kXPitch};
  float* dq_s = reinterpret_cast<float*>(gbase + kStages * F::kTileBytes + (kR2 ? 2 : 1) * C::kX);
  const uint32_t bars = base + kStages * F::kTileBytes + (kR2 ? 2 : 1) * C::kX + C::kDq;
  auto full = [&](int s) { return bars + 8 * s; };
  auto empty = [&](int s) { return bars + 8 * (kStages + s); };
  const char* img = static_cast<const char*>(p.image) +
                    (static_cast<int64_t>(b * p.Hkv + hkv) * (p.per_chunk ? p.chunks : 1) + (p.per_chunk ? c : 0)) *
                        tiles * F::kTileBytes;

  // Tile t into its stage once the stage's previous tile is released (thread 0 only).
  auto refill = [&](int t) {
    if (threadIdx.x != 0 || t >= tiles) return;
    const int s = t % kStages;
    if (t >= kStages) mbar_wait(empty(s), (t / kStages - 1) & 1);
    mbar_expect_tx(full(s), F::kTileBytes);
    bulk_load(base + s * F::kTileBytes, img + static_cast<int64_t>(t) * F::kTileBytes, F::kTileBytes, full(s));
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) mbar_init(full(s), 1), mbar_init(empty(s), 8);
    mbar_fence_init();
  }
  for (int t = 0; t + 1 < kStages; ++t) refill(t);
  {
    const char* x = static_cast<const char*>(p.x) + row0 * kDp * 2;
    cp_tile<C::kRows, kDp * 2, 256>(xs, x, kDp * 2, C::kRows, x);
    if constexpr (kR2) {
      const char* gp = static_cast<const char*>(p.g) + row0 * kDp * 2;
      cp_tile<C::kRows, kDp * 2, 256>(gs, gp, kDp * 2, C::kRows, gp);
      for (int k = threadIdx.x; k < C::kRows * C::kDqPitch; k += 256) dq_s[k] = 0.f;
    }
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  const int warp = warp_index(), lane = lane_id(), g = lane / 4, tq = lane % 4;
  const int r0 = 16 * warp;  // this warp's 16 rows of the CTA's 128
  uint32_t gf[kN / 16 + 1][4];  // g's A fragments over w's columns (R2's K), the last one zero-padded
  if constexpr (kR2) {
#pragma unroll
    for (int k = 0; k <= kN / 16; ++k) M::lda(gf[k], gs, r0, 16 * k);
  }
  // x_a at this lane's row g (or g + 8), alone in the low half of a word.
  auto x_at = [&](int a, int row) { return lds32(xs.at(r0 + row, (a & ~1) * 2)) >> (a & 1 ? 16 : 0) & 0xffffu; };
  typename F::Cursor cursor(p.second);  // the group of gen's (R1) or finish's (R2) next step
  auto stage = [&](int t) { return SwTile{base + (t % kStages) * F::kTileBytes, 64}; };

  // Tile t's R1 operands: x's fragment of block bb times x_a (x's fragment is reloaded per group: a
  // register array indexed by bb at run time would live in local memory).
  auto gen = [&](int t, uint32_t(&af)[4][4]) {
    if constexpr (kR1) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int a = cursor.a, bb = cursor.bb;
        cursor.next();
        uint32_t* f = af[j];
        if (bb < 0) {
          f[0] = f[1] = f[2] = f[3] = 0;
          continue;
        }
        M::lda(f, xs, r0, 16 * bb);
        if (a >= 0) {
          const uint32_t top = x_at(a, g) * 0x10001u, bot = x_at(a, g + 8) * 0x10001u;
          f[0] = mul2<T>(f[0], top), f[1] = mul2<T>(f[1], bot), f[2] = mul2<T>(f[2], top), f[3] = mul2<T>(f[3], bot);
        }
      }
    }
  };
  float y[kN / 8][4] = {};
  auto issue = [&](int t, const uint32_t(&af)[4][4], float(&z)[8][4]) {
    const SwTile st = stage(t);
    wgmma_fence();
    if constexpr (kR1) {
#pragma unroll
      for (int j = 0; j < 4; ++j) wgmma_rs<1>(y, af[j], desc_mn(st, 16 * j, 0), 1, T{});
    }
    if constexpr (kR2) {
#pragma unroll
      for (int k = 0; k <= kN / 16; ++k) wgmma_rs<0>(z, gf[k], desc_k(st, 0, 16 * k, 2), k > 0, T{});
    }
    wgmma_commit();
  };
  // After tile t's products: R2's contraction with x, then the stage is released; the refill is of tile
  // t - 1's stage, whose warps are done with it by now, so that thread 0 seldom waits.
  // z[2j + e] holds group j's features 8e + (2 tq, +1) of rows g (0, 1), g + 8 (2, 3): exactly where
  // x's fragment of block bb holds x_b. d(x_a x_b) = x_b dx_a + x_a dx_b; first order d x'_b = dx_b.
  // Both parts stay in registers: x_a dx_b in dqr[bb] (x's fragment layout; bb picked by compare, since
  // a register array indexed at run time would live in local memory), x_b dx_a as this lane's share of
  // dq[., a] while the groups keep a (a-major order), reduced over the quad and added to dq_s when a
  // changes. (Shared-memory sums per group had made R2 issue-bound.)
  float dqr[kNb][2][4] = {}, st = 0.f, sd = 0.f, xt = 1.f, xd = 1.f;
  int a_run = -1;
  auto flush = [&]() {
    if (a_run < 0) return;
#pragma unroll
    for (int o = 1; o < 4; o *= 2) {
      st += __shfl_xor_sync(0xffffffffu, st, o);
      sd += __shfl_xor_sync(0xffffffffu, sd, o);
    }
    if (tq == 0) dq_s[(r0 + g) * C::kDqPitch + a_run] += st, dq_s[(r0 + g + 8) * C::kDqPitch + a_run] += sd;
    st = sd = 0.f;
  };
  auto finish = [&](int t, float(&z)[8][4]) {
    if constexpr (kR2) {
      fence_acc(z);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int a = cursor.a, bb = cursor.bb;
        cursor.next();
        if (bb < 0 || (a < 0 && bb == kNb)) continue;  // padding, or the constant
        if (a != a_run) {
          flush();
          a_run = a;
          xt = a < 0 ? 1.f : Elem<T>::unpack(x_at(a, g)).x;
          xd = a < 0 ? 1.f : Elem<T>::unpack(x_at(a, g + 8)).x;
        }
        if (a >= 0) {
          uint32_t xb[4];
          M::lda(xb, xs, r0, 16 * bb);
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float2 u = Elem<T>::unpack(xb[2 * e]), v = Elem<T>::unpack(xb[2 * e + 1]);
            st += z[2 * j + e][0] * u.x + z[2 * j + e][1] * u.y;
            sd += z[2 * j + e][2] * v.x + z[2 * j + e][3] * v.y;
          }
        }
#pragma unroll
        for (int k = 0; k < kNb; ++k) {
          if (k != bb) continue;
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            dqr[k][e][0] += xt * z[2 * j + e][0], dqr[k][e][1] += xt * z[2 * j + e][1];
            dqr[k][e][2] += xd * z[2 * j + e][2], dqr[k][e][3] += xd * z[2 * j + e][3];
          }
        }
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(empty(t % kStages));
    refill(t + kStages - 1);
  };
  // Two tiles in flight: tile t + 1's operands are made and its products issued before tile t's are
  // waited for (buffers A and B alternate; named, so that no register array is indexed at run time).
  uint32_t afA[4][4], afB[4][4];
  float zA[8][4], zB[8][4];
  auto start = [&](int t, uint32_t(&af)[4][4], float(&z)[8][4]) {
    mbar_wait(full(t % kStages), (t / kStages) & 1);
    gen(t, af);
    issue(t, af, z);
  };
  start(0, afA, zA);
  int t = 0;
  for (; t + 2 < tiles; t += 2) {
    start(t + 1, afB, zB);
    wgmma_wait<1>();
    finish(t, zA);
    start(t + 2, afA, zA);
    wgmma_wait<1>();
    finish(t + 1, zB);
  }
  if (t + 1 < tiles) {
    start(t + 1, afB, zB);
    wgmma_wait<1>();
    finish(t, zA);
    wgmma_wait<0>();
    finish(t + 1, zB);
  } else {
    wgmma_wait<0>();
    finish(t, zA);
  }
  fence_acc(y);

  const float inv = 1.f / *p.scale;
  if constexpr (kR1) {
    float* out = p.r1 + (row0 + r0) * kDp;
#pragma unroll
    for (int n = 0; n < kN / 8; ++n) {  // columns from r1_cols on (and past w's: the last 8) are zeros
      const int col = 8 * n + 2 * tq;
      const float s = col < p.r1_cols ? inv : 0.f;
      *reinterpret_cast<float2*>(out + g * kDp + col) = make_float2(s * y[n][0], s * y[n][1]);
      *reinterpret_cast<float2*>(out + (g + 8) * kDp + col) = make_float2(s * y[n][2], s * y[n][3]);
    }
    static_assert(kDp - kN == 8, "one n8 tile past w");
    *reinterpret_cast<float2*>(out + g * kDp + kN + 2 * tq) = make_float2(0.f, 0.f);
    *reinterpret_cast<float2*>(out + (g + 8) * kDp + kN + 2 * tq) = make_float2(0.f, 0.f);
  }
  if constexpr (kR2) {  // this warp's 16 rows of dq_s
    flush();
    __syncwarp();  // the quads' sums in before the lanes add their columns
#pragma unroll
    for (int k = 0; k < kNb; ++k)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float* top = dq_s + (r0 + g) * C::kDqPitch + 16 * k + 8 * e + 2 * tq;
        float* bot = top + 8 * C::kDqPitch;
        top[0] += dqr[k][e][0], top[1] += dqr[k][e][1], bot[0] += dqr[k][e][2], bot[1] += dqr[k][e][3];
      }
    __syncwarp();
    float* out = p.r2 + (row0 + r0) * D;
    for (int k = lane; k < 16 * D / 2; k += 32) {
      const int row = k / (D / 2), col = 2 * (k % (D / 2));
      const float* s = dq_s + (r0 + row) * C::kDqPitch + col;
      *reinterpret_cast<float2*>(out + row * D + col) = make_float2(inv * s[0], inv * s[1]);
    }
  }
#endif
}

template <class T, int D>
cudaError_t run_lin_state(const LinStateParams& p, cudaStream_t stream) {
  using C = LinState90<T, D>;
  const int slabs = (LinFeatures<D>::tiles(p.second) + C::kTiles - 1) / C::kTiles;
  if (p.L % C::kRows != 0 || int64_t{p.B} * p.Hkv > 65535) return cudaErrorInvalidConfiguration;
  return launch(lin_state_kernel<T, D>, dim3(slabs, p.B * p.Hkv), int64_t{slabs} * p.B * p.Hkv, C::kThreads,
                C::kBytes, p, stream);
}

template <class T, int D, bool kR1, bool kR2>
cudaError_t launch_lin_read(const LinReadParams& p, cudaStream_t stream) {
  using C = LinRead90<T, D, kR1, kR2>;
  const int64_t x = int64_t{p.chunks} * (p.L / C::kRows), y = int64_t{p.B} * p.Hkv * p.heads;
  if (p.L % C::kRows != 0 || y > 65535 || x > INT32_MAX) return cudaErrorInvalidConfiguration;
  return launch(lin_read_kernel<T, D, kR1, kR2>, dim3(x, y), x * y, C::kThreads, C::kBytes, p, stream);
}

template <class T, int D>
cudaError_t run_lin_read(const LinReadParams& p, cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  if (p.r1 != nullptr) err = launch_lin_read<T, D, true, false>(p, stream);
  if (p.r2 != nullptr && err == cudaSuccess) err = launch_lin_read<T, D, false, true>(p, stream);
  return err;
}

}  // namespace attn
