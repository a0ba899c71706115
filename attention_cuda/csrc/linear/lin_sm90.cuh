// Fastmax's linear form on Hopper (sm_90a), in chunks of L rows with the state written out per chunk.
//
// The sweep of linear.cuh carries the state through a sequence in one CTA per slice, and is bound by
// the latency of its per-chunk steps. Here the two halves of a sweep are kernels of their own:
//   lin_state  S_c = sum over the chunks before c (after c: reverse; all: non-causal) of phi(x) w^T,
//              one CTA per (batch, kv head, 2 x kTiles image tiles) walking the chunks in order, two
//              warpgroups with the state as wgmma accumulators (M = features, N = w's columns, K = rows)
//              reading the same rows, which TMA brings in; before each chunk it
//              writes S_c, coefficients applied, as an "image": tiles of 64 features x the columns,
//              already in the 64-byte-swizzled layout of common/wgmma.cuh, so that a reader copies a tile
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
#include "../common/wgmma.cuh"
#include "linear.cuh"

namespace attn {

template <int D>
struct LinFeatures {
  static constexpr int kNb = D / 16, kFirst = kNb + 1;  // x' = [x, 1, 0 ...] is kNb + 1 blocks
  static constexpr int kSecond = 16 * kNb * (kNb + 1) / 2;
  static constexpr int kDw = D + 8, kPanels = (kDw + 31) / 32;  // w = [v, 1] in whole n8 tiles
  static constexpr int kTileBytes = kPanels * 64 * 64;          // an image tile: 64 features
  // Tiles of four groups: first order (a = -1, bb = 0 .. kNb; the last tile padded), then second order
  // bb-major, each bb's a < 16 (bb + 1) in runs of four. A tile's groups then share bb (one x fragment)
  // and take four consecutive a, which the readers' loops know at compile time (with the groups
  // a-major, bb changed from group to group, and picking its registers had made control flow most of
  // lin_read R2's instructions).
  static constexpr int kFirstTiles = (kFirst + 3) / 4;
  __host__ __device__ static int tiles(bool second) { return kFirstTiles + (second ? kSecond / 4 : 0); }
  // Second-order tile t's bb and first a; bb = -1 for a first-order tile (its group j is (-1, 4 t + j)).
  __device__ static void tile(int t, int& bb, int& a0) {
    bb = -1, a0 = 0;
    if (t < kFirstTiles) return;
    const int s = t - kFirstTiles;  // bb's tiles are s in [2 bb (bb + 1), 2 (bb + 1) (bb + 2))
    bb = 0;
#pragma unroll
    for (int k = 1; k < kNb; ++k) bb += s >= 2 * k * (k + 1);
    a0 = 4 * (s - 2 * bb * (bb + 1));
  }
  // Group j of tile t as (a, bb); bb = -1 for the first-order tile's padding.
  __device__ static void decode(int t, int j, int& a, int& bb) {
    tile(t, bb, a);
    if (bb >= 0) {
      a += j;
    } else {
      a = -1, bb = 4 * t + j < kFirst ? 4 * t + j : -1;
    }
  }
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
  static constexpr HeadDimTiles kRow = Tiles<T, D>::kRow;
  static_assert(kRow.chunked, "no chunked kernels at this head dim in kTileTable (quadratic/tiles.h)");
  static constexpr int kTiles = kRow.chunked_tiles;  // image tiles per warpgroup (accumulators)
  // Two warpgroups, each with its own image tiles, share every stage of 128 rows: each row loaded feeds
  // twice the products it did with one warpgroup per CTA, which then left lin_state waiting on its loads.
  // A stage's x and w rows arrive by TMA, issued by one thread, as swizzled tiles (D + 16 columns, those
  // past the rows' width zero-filled): with cp.async by every thread the address arithmetic and its
  // waits were a quarter of the kernel's stalls.
  static constexpr int kWgs = 2, kRows = 128, kThreads = 128 * kWgs;
  static constexpr int kXPanels = ((D + 16) * 2 + 63) / 64;
  static constexpr int kW = F::kPanels * 64 * kRows, kX = kXPanels * 64 * kRows, kStage = kW + kX;
  // Three stages where they fit (d64), so that the stage a load overwrites was read two steps back and no
  // step drains the tensor pipe; else two (at d128 three stages of 128 rows do not fit, and two of 128 beat
  // three or four of 64: bench/notes/run-37.md).
  static constexpr int kFit = (227 * 1024 - kSwizzleSlack) / (kStage + 8);  // a stage and its mbarrier
  static constexpr int kStages = kFit < 3 ? kFit : 3;
  static_assert(kStages >= 2, "a stage loads while the other is read");
  static constexpr int kBytes = kStages * kStage + 8 * kStages + kSwizzleSlack;  // stages, mbarriers, alignment
};

// The kernel's parameter: the rows' tensor maps, which must live in parameter space, and the Params.
struct LinStateArgs {
  CUtensorMap x, w;
  LinStateParams p;
};

template <class T, int D>
__global__ void __launch_bounds__(LinState90<T, D>::kThreads)
    lin_state_kernel(const __grid_constant__ LinStateArgs args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const LinStateParams& p = args.p;
  using C = LinState90<T, D>;
  using F = LinFeatures<D>;
  using M = Mma<T>;
  constexpr int kN = F::kDw, kTiles = C::kTiles, kRows = C::kRows, kStages = C::kStages;
  extern __shared__ __align__(16) char smem_raw[];
  const uint32_t base = swizzle_base(smem_raw);
  const int warp = warp_index() % 4, lane = lane_id(), g = lane / 4, tq = lane % 4;
  const int tiles = F::tiles(p.second), tile0 = (blockIdx.x * C::kWgs + warp_index() / 4) * kTiles;
  const int b = blockIdx.y / p.Hkv, hkv = blockIdx.y % p.Hkv;
  auto w_tile = [&](int s) { return SwTile{base + s * C::kStage, kRows}; };
  auto x_tile = [&](int s) { return SwTile{base + s * C::kStage + C::kW, kRows}; };
  auto full = [&](int s) { return base + kStages * C::kStage + 8 * s; };

  int ga[kTiles], gb[kTiles];  // this warp's group (a, bb) per tile; bb = -1: none
#pragma unroll
  for (int i = 0; i < kTiles; ++i) {
    F::decode(tile0 + i, warp, ga[i], gb[i]);
    if (tile0 + i >= tiles) gb[i] = -1;
  }
  float acc[kTiles][kN / 8][4] = {};

  const int per_chunk = p.heads * (p.L / kRows);  // stages per chunk
  const int steps = (p.causal ? p.chunks - 1 : p.chunks) * per_chunk;
  const int H = p.Hkv * p.heads;
  auto chunk_of = [&](int i) { return p.reverse ? p.chunks - 1 - i : i; };
  auto load = [&](int i, int s) {  // one thread: step i's rows into stage s
    const int c = chunk_of(i / per_chunk), h = hkv * p.heads + (i % per_chunk) / (p.L / kRows);
    const int row = ((b * p.chunks + c) * H + h) * p.L + (i % (p.L / kRows)) * kRows;
    mbar_expect_tx(full(s), C::kStage);
    tma_load_tile<F::kPanels>(w_tile(s), &args.w, full(s), row, 0, 0);
    tma_load_tile<C::kXPanels>(x_tile(s), &args.x, full(s), row, 0, 0);
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
      for (int k = threadIdx.x % 128; k < 64 * kPad; k += 128)
        *reinterpret_cast<uint4*>(img + at.at(k / kPad, kN * 2 + (k % kPad) * 16)) = make_uint4(0, 0, 0, 0);
    }
  };

  // One stage's products: phi(x)^T w over its rows, k-step by k-step.
  auto products = [&](int i) {
    const SwTile wt = w_tile(i % kStages), xt = x_tile(i % kStages);
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
  };
  // The stage loaded at step i is the one step i - 1 (two stages) or i - 2 (three) read: its products are
  // done once every warpgroup is past step i's barrier (two stages wait for them first; with three,
  // wgmma_wait<1> has left only step i - 1's last k-step in flight).
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) mbar_init(full(s), 1);
    mbar_fence_init();
  }
  __syncthreads();
  if (threadIdx.x == 0 && steps > 0) load(0, 0);
  for (int i = 0; i < steps; ++i) {
    if (p.causal && i % per_chunk == 0) publish(i / per_chunk);
    if constexpr (kStages == 2) wgmma_wait<0>();
    __syncthreads();
    if (threadIdx.x == 0 && i + 1 < steps) load(i + 1, (i + 1) % kStages);
    mbar_wait(full(i % kStages), (i / kStages) & 1);
    products(i);
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
  static_assert(kR1 != kR2, "R1 and R2 are launches of their own (together, ptxas spills at d128)");
  static constexpr int kBlocks = kR1 ? Tiles<T, D>::kRow.chunked_r1_blocks : 1;  // per SM (quadratic/tiles.h)
  static constexpr int kXPitch = (D + 16) * 2 + 16;
  // dq's pitch D + 8: a quad's float2 at columns 2 tq of rows g fill all 32 banks per half warp.
  static constexpr int kDqPitch = D + 8, kX = kRows * kXPitch, kDq = kR2 ? kRows * kDqPitch * 4 : 0;
  static constexpr int kFixed = (kR2 ? 2 : 1) * kX + kDq + kSwizzleSlack + 256;  // x, g, dq, alignment, barriers
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
  const uint32_t base = swizzle_base(smem_raw);
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
  auto stage = [&](int t) { return SwTile{base + (t % kStages) * F::kTileBytes, 64}; };
  // x at this lane's row g (hf = 0) or g + 8 (hf = 1), columns a0 .. a0 + 3: two words of pairs.
  auto x4 = [&](int a0, int hf, uint32_t(&w)[2]) {
    const uint32_t at = xs.at(r0 + g + 8 * hf, a0 * 2);
    w[0] = lds32(at), w[1] = lds32(at + 4);
  };

  // Tile t's R1 operands: x's fragment of block bb times x_a for the tile's four a (one packed multiply
  // per register); first order: x's fragment of block 4 t + j.
  auto gen = [&](int t, uint32_t(&af)[4][4]) {
    if constexpr (kR1) {
      int bb, a0;
      F::tile(t, bb, a0);
      if (bb >= 0) {
        uint32_t xf[4], top[2], bot[2];
        M::lda(xf, xs, r0, 16 * bb);
        x4(a0, 0, top), x4(a0, 1, bot);
#pragma unroll
        for (int j = 0; j < 4; ++j) {  // x_a in both halves of a word
          const uint32_t sel = j % 2 ? 0x3232 : 0x1010;
          const uint32_t u = __byte_perm(top[j / 2], 0, sel), v = __byte_perm(bot[j / 2], 0, sel);
          af[j][0] = mul2<T>(xf[0], u), af[j][1] = mul2<T>(xf[1], v);
          af[j][2] = mul2<T>(xf[2], u), af[j][3] = mul2<T>(xf[3], v);
        }
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          if (4 * t + j < F::kFirst) {
            M::lda(af[j], xs, r0, 16 * (4 * t + j));
          } else {
            af[j][0] = af[j][1] = af[j][2] = af[j][3] = 0;
          }
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
  //  - x_a dx_b: summed in registers (dxb, in x's fragment layout) while the tiles keep bb, added to
  //    dq_s's block bb when bb changes (kNb times: the order is bb-major);
  //  - x_b dx_a: per a, a dot over the group's features, this lane's share summed over the quad so
  //    that lane tq ends with column a0 + tq's (for both rows), added to dq_s per tile.
  // The two kinds add to a column from different lanes: they meet only across __syncwarp.
  float dxb[2][4] = {};
  int bb_run = -1;
  auto add_block = [&](int bb, const float(&d)[2][4]) {
    __syncwarp();
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float* top = dq_s + (r0 + g) * C::kDqPitch + 16 * bb + 8 * e + 2 * tq;
      float* bot = top + 8 * C::kDqPitch;
      top[0] += d[e][0], top[1] += d[e][1], bot[0] += d[e][2], bot[1] += d[e][3];
    }
    __syncwarp();
  };
  auto quad_scatter = [&](const float(&v)[4]) {  // lane tq: the quad's sum of v[tq], in two exchanges
    const bool hi = tq & 2, lo = tq & 1;
    const float k0 = (hi ? v[2] : v[0]) + __shfl_xor_sync(0xffffffffu, hi ? v[0] : v[2], 2);
    const float k1 = (hi ? v[3] : v[1]) + __shfl_xor_sync(0xffffffffu, hi ? v[1] : v[3], 2);
    return (lo ? k1 : k0) + __shfl_xor_sync(0xffffffffu, lo ? k0 : k1, 1);
  };
  auto finish = [&](int t, float(&z)[8][4]) {
    if constexpr (kR2) {
      fence_acc(z);
      int bb, a0;
      F::tile(t, bb, a0);
      if (bb < 0) {  // first order: dq's block 4 t + j gets z (nothing from the constant's group)
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (4 * t + j < kNb) add_block(4 * t + j, *reinterpret_cast<float(*)[2][4]>(&z[2 * j]));
      } else {
        if (bb != bb_run) {
          if (bb_run >= 0) add_block(bb_run, dxb);
#pragma unroll
          for (int e = 0; e < 2; ++e) dxb[e][0] = dxb[e][1] = dxb[e][2] = dxb[e][3] = 0.f;
          bb_run = bb;
        }
        uint32_t xb[4], top[2], bot[2];
        M::lda(xb, xs, r0, 16 * bb);
        x4(a0, 0, top), x4(a0, 1, bot);
        const float2 u[2] = {Elem<T>::unpack(xb[0]), Elem<T>::unpack(xb[2])};  // x_b, row g
        const float2 v[2] = {Elem<T>::unpack(xb[1]), Elem<T>::unpack(xb[3])};  // row g + 8
        const float2 t01 = Elem<T>::unpack(top[0]), t23 = Elem<T>::unpack(top[1]);
        const float2 d01 = Elem<T>::unpack(bot[0]), d23 = Elem<T>::unpack(bot[1]);
        const float xt[4] = {t01.x, t01.y, t23.x, t23.y}, xd[4] = {d01.x, d01.y, d23.x, d23.y};  // x_a
        float pt[4], pd[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          pt[j] = pd[j] = 0.f;
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float* zz = z[2 * j + e];
            pt[j] = fmaf(zz[0], u[e].x, fmaf(zz[1], u[e].y, pt[j]));
            pd[j] = fmaf(zz[2], v[e].x, fmaf(zz[3], v[e].y, pd[j]));
            dxb[e][0] = fmaf(xt[j], zz[0], dxb[e][0]), dxb[e][1] = fmaf(xt[j], zz[1], dxb[e][1]);
            dxb[e][2] = fmaf(xd[j], zz[2], dxb[e][2]), dxb[e][3] = fmaf(xd[j], zz[3], dxb[e][3]);
          }
        }
        const float st = quad_scatter(pt), sd = quad_scatter(pd);
        dq_s[(r0 + g) * C::kDqPitch + a0 + tq] += st;
        dq_s[(r0 + g + 8) * C::kDqPitch + a0 + tq] += sd;
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
    if (bb_run >= 0) add_block(bb_run, dxb);
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
  constexpr int kPerCta = C::kTiles * C::kWgs;
  const int slabs = (LinFeatures<D>::tiles(p.second) + kPerCta - 1) / kPerCta;
  // The chunk-major rows (D + 16 elements each) of x and of w, each one 2-D tensor for TMA.
  const int64_t rows = int64_t{p.B} * p.chunks * p.Hkv * p.heads * p.L;
  if (p.L % C::kRows != 0 || int64_t{p.B} * p.Hkv > 65535 || rows > INT32_MAX) return cudaErrorInvalidConfiguration;
  LinStateArgs args;
  args.p = p;
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  const int n = static_cast<int>(rows);
  if (!make_tensor_map(&args.x, p.x, kBf16, D + 16, n, 1, 1, RowStrides{0, 0, D + 16}, C::kRows) ||
      !make_tensor_map(&args.w, p.w, kBf16, D + 16, n, 1, 1, RowStrides{0, 0, D + 16}, C::kRows))
    return cudaErrorNotSupported;
  return launch(lin_state_kernel<T, D>, dim3(slabs, p.B * p.Hkv), int64_t{slabs} * p.B * p.Hkv, C::kThreads,
                C::kBytes, args, stream);
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
