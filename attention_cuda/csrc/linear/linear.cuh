// Fastmax's linear form: the moments of the keys carried from chunk to chunk, fp32, in registers.
//
// With x' = [x, 1, 0 ... 0] (Dp = D + 16 columns) the polynomial weight factorises:
//   f(q.k) = c0 + c1 q.k + c2 (q.k)^2 = sum over feature groups of  coef * r_a(q) r_a(k) * q'_b k'_b
// Groups are 16 features wide. Row -1: r = 1, b over all Dp columns (first order, and the constant
// through column D); rows a = 0..D-1 (p = 2): r_a(x) = x_a, b over 0..D-1 (every (a, b) pair, so the
// state is symmetric in a, b). One kernel serves the three sweeps of the linear form:
//   forward   state S = sum_s phi(k_s) w_s^T  (w = [v, 1]),   read R1: y_t = psi(q_t) . S
//   dq        same state,                                     read R2: dq_t = d/dq [psi(q_t)] . S g_t
//   dk, dv    state R = sum_t psi(q_t) g_t^T (reverse order), read R1 (dv) and R2 (dk, with g := w)
// where psi carries the coefficients (c0, c1, c2) of the reading side and phi those of the update side
// (`cr`, `cu`). Causal: the state read at chunk c holds exactly the chunks before c (after c, reversed);
// the chunk's own block is the tiled quadratic kernel's job. Chunk c's read and its update are
// independent (the update only publishes its state for the next chunk), so where shared memory holds
// both their tiles twice they run as one phase (LinConfig::kFuse). Non-causal: every chunk, then
// every read.
//
// Work split: grid.x = (part, m-tile): an m-tile is 16 columns of w (or g); grid.y = (batch, kv head).
// A part's warps each own a few whole second-order rows a (16 x D state, 8 floats per lane per
// 16 x 16 group). Row -1, one group per warp, has CTAs of its own, or at d32 rides in the one part's
// (LinConfig::kFold). The state never leaves the registers: the update accumulates into it with mma
// (M = w's 16 columns, N = the row's features, K = the chunk's rows), and the read takes it straight
// back as the B operand (the m16n8 accumulator layout is the k16n8 B layout, as P is in the forward
// kernels). Per chunk a warp loads its operand fragments once for all its rows. Outputs are partial
// sums over m-tiles and rows: they meet in shared memory, then in fp32 global memory with
// red.global.add.
//
// Range: a row's state enters the tensor cores times both sides' coefficients (applied in fp32) and,
// in fp16, a power of two taken from its own largest product, not from the number of rows it sums:
// the dk/dv state sums psi(q) g^T with g ~ dO / l, which shrinks as the rows grow, so a row-count
// scale left it in fp16's subnormals (digits lost; the dk/dv gradient cases failed). bf16 has fp32's
// exponent range and needs no scale.
#pragma once
#include "../common/launch.cuh"
#include "../common/mma.cuh"
#include "../quadratic/tiles.h"
#include "params.h"

namespace attn {

template <class T, int D>
struct LinConfig {
  static constexpr HeadDimTiles kRow = Tiles<T, D>::kRow;
  static_assert(kRow.sweep, "no sweep at this head dim in kTileTable (quadratic/tiles.h)");
  static constexpr int kWarps = 8, kThreads = kWarps * 32, kL = kLinChunk;
  static constexpr int kJ = D / 16, kJ1 = kJ + 1, kDp = D + 16;  // second-order / first-order groups per row
  // Second-order rows a warp keeps (quadratic/tiles.h). A whole number per warp, so every warp runs the
  // same unrolled code (its rows' mma chains interleave).
  static constexpr int kRows = kRow.sweep_rows;
  static_assert(D % (kWarps * kRows) == 0, "every part's warps own kRows rows each");
  static constexpr int kFirstGroups = (kJ1 + kWarps - 1) / kWarps;  // row -1's groups per warp
  static constexpr int kXPitch = kDp * 2 + 16, kWPitch = 16 * 2 + 16;  // padded tile rows (ldmatrix)
  // Two stages of (x, w) tiles; dq [kL][kDqPitch] in fp32; each warp's row -1 groups as 16 x 16 tiles of T
  // (R2 reads them transposed); every warp's y for kYTiles m16 tiles of rows (fp32 16 x 16, padded), as
  // many as fit. Shared-memory fp32 atomics are CAS loops on sm_90, so partial sums meet without them.
  // Each flush of y costs a barrier (two where the slots are reused within the chunk): a pad of 2
  // floats (not 4) fits all 8 tiles of a chunk at d64, one flush per chunk (bench/notes/run-13.md).
  static constexpr int kYPitch = 16 + 2, kYTile = 16 * kYPitch, kGroupTile = 16 * kWPitch;
  static constexpr int kPair = kL * kXPitch + kL * kWPitch;  // one (x, w) pair of tiles
  // dq's pitch: the R2 stores of a warp (16 rows x its kRows columns) fall in distinct banks or two.
  static constexpr int kDqPitch = D + 4;
  static constexpr int kOther = kL * kDqPitch * 4 + kWarps * kFirstGroups * kGroupTile;
  // A causal chunk's read and update as one phase (kFuse): a stage holds both pairs, and the update's
  // mma interleave with the read's dependent chains. Where two such stages do not fit (d128), the
  // read and the update stay phases of their own.
  static constexpr bool kFuse = 4 * kPair + kOther + 2 * kWarps * kYTile * 4 <= 227 * 1024;
  static constexpr int kStage = (kFuse ? 2 : 1) * kPair;
  static constexpr int kFixed = 2 * kStage + kOther;
  static constexpr int kYFit = (227 * 1024 - kFixed) / (kWarps * kYTile * 4);
  static constexpr int kYTiles = kYFit >= 8 ? 8 : kYFit >= 4 ? 4 : 2;
  static constexpr int kBytes = kFixed + kYTiles * kWarps * kYTile * 4;
  static_assert(kBytes <= 227 * 1024,
                "shared memory: a head dim whose sweep does not fit has none (quadratic/tiles.h)");
  static int parts(bool second) { return second ? D / (kWarps * kRows) : 0; }
  // Row -1 in the part's CTAs rather than CTAs of its own, where quadratic/tiles.h says: a row -1 CTA, with
  // a fraction of a part's products, takes about as long as a full one (the sweep is bound by its per-chunk
  // latency).
  static constexpr bool kFold = kRow.sweep_fold;
};

template <class T>
__device__ __forceinline__ uint32_t mul2(uint32_t a, uint32_t s) {
  if constexpr (std::is_same<T, __half>::value) {
    __half2 r = __hmul2(*reinterpret_cast<__half2*>(&a), *reinterpret_cast<__half2*>(&s));
    return *reinterpret_cast<uint32_t*>(&r);
  } else {
    __nv_bfloat162 r = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&s));
    return *reinterpret_cast<uint32_t*>(&r);
  }
}

// Sums of v[j] over a quad's 4 lanes (tq = lane % 4), scattered over them: with N >= 4 the lane keeps
// the N / 4 sums from index (tq & 1) * N / 2 + (tq >> 1) * N / 4 on (half the shuffles of an
// all-reduce); with N = 2 every lane keeps the sum of v[tq & 1].
template <int N>
__device__ __forceinline__ void quad_reduce_scatter(const float (&v)[N], int tq, float (&out)[N >= 4 ? N / 4 : 1]) {
  const bool b0 = tq & 1, b1 = tq & 2;
  float w[N / 2];
#pragma unroll
  for (int j = 0; j < N / 2; ++j) {
    const float send = b0 ? v[j] : v[j + N / 2], keep = b0 ? v[j + N / 2] : v[j];
    w[j] = keep + __shfl_xor_sync(0xffffffffu, send, 1);
  }
  if constexpr (N == 2) {
    out[0] = w[0] + __shfl_xor_sync(0xffffffffu, w[0], 2);
  } else {
#pragma unroll
    for (int j = 0; j < N / 4; ++j) {
      const float send = b1 ? w[j] : w[j + N / 4], keep = b1 ? w[j + N / 4] : w[j];
      out[j] = keep + __shfl_xor_sync(0xffffffffu, send, 2);
    }
  }
}

// A warp's rows of one kind. kFirst: row -1, its feature groups warp, warp + kWarps, ... of x' (x
// times c1, the constant times c0). Otherwise kRows second-order rows a0 .. from feature group kOwn on:
// kOwn = -1 whole rows; kOwn >= 0 (sweeps without R2) the upper half of the symmetric state, row a
// holding the groups from its own, a / 16, on and reading those after its own at twice the weight (they
// stand for the mirrored pairs too). R2 differentiates by every feature, so those sweeps keep whole
// rows. The group count is a template argument: with a runtime one the slots' mma chains were branches
// apart and the forward ran slower than whole rows.
//
// The state holds the bare moments (sum of w x_a x_b, or of w x'_b); both sides' coefficients are
// applied in fp32 when the state is published for reading, so the update multiplies nothing but
// w's tile by the rows' x_a.
template <class T, int D, bool kFirst, int kOwn>
struct WarpRows {
  using C = LinConfig<T, D>;
  using M = Mma<T>;
  static constexpr int kL = C::kL, kJ = C::kJ;
  static constexpr int kR = kFirst ? 1 : C::kRows, kG = kFirst ? C::kFirstGroups : kOwn < 0 ? kJ : kJ - kOwn;
  static constexpr int kW = (kR + 1) / 2;  // 32-bit words of an x row holding columns a0 .. a0 + kR - 1
  int warp, a0;
  float acc[kR][kG][2][4] = {};     // [row][group][n8 half of the group's features][accumulator]
  uint32_t bs[kR][kG][2][2] = {};   // the same as B fragments of T: [row][group][n8 tile of w's columns]
  float inv[kR] = {};               // what the read multiplies a row's products by: its coefficients / scale

  __device__ int group(int i) const { return kFirst ? warp + i * C::kWarps : (kOwn < 0 ? 0 : kOwn) + i; }
  __device__ bool has_group(int i) const { return group(i) < (kFirst ? C::kJ1 : kJ); }
  // Slot i's weight in the fragments: row -1's coefficients (c1 for x, c0 for the constant) of both
  // sides; a second-order row's share beyond c2 c2', which inv carries: 2 for the mirrored pairs.
  __device__ float weight(const LinParams& p, int i) const {
    if constexpr (kFirst) {
      return group(i) < kJ ? p.cu[1] * p.cr[1] : p.cu[0] * p.cr[0];
    } else {
      return kOwn >= 0 && i > 0 ? 2.f : 1.f;
    }
  }
  // The words of x's row t holding columns a0 .. a0 + kR - 1 (a0 is even where kR > 1), and where row
  // r's value sits in its word (1: the high half).
  __device__ void row_words(Tile x, int t, uint32_t (&w)[kW]) const {
#pragma unroll
    for (int k = 0; k < kW; ++k) w[k] = lds32(x.at(t, ((a0 & ~1) + 2 * k) * 2));
  }
  __device__ int high(int r) const { return kR == 1 ? a0 & 1 : r & 1; }

  // state += phi(x) w^T over the chunk's rows ks * 16 .. ks * 16 + 15 (one k16 step).
  __device__ void accumulate(Tile x, Tile w, int ks) {
    const int tq = lane_id() % 4;
    uint32_t wa[4], bx[kG][2][2];
    M::lda_t(wa, w, ks * 16, 0);
#pragma unroll
    for (int i = 0; i < kG; ++i)
      if (has_group(i)) M::ldb2_t(bx[i][0], bx[i][1], x, ks * 16, group(i) * 16);
    // Second order: w's k pairs (rows s, s + 1 and s + 8, s + 9) times x_a at the same rows, paired
    // from two words by a byte permute.
    uint32_t x0[kW], x1[kW], x8[kW], x9[kW];
    if constexpr (!kFirst) {
      const int s = ks * 16 + 2 * tq;
      row_words(x, s, x0), row_words(x, s + 1, x1), row_words(x, s + 8, x8), row_words(x, s + 9, x9);
    }
#pragma unroll
    for (int r = 0; r < kR; ++r) {
      uint32_t af[4] = {wa[0], wa[1], wa[2], wa[3]};
      if constexpr (!kFirst) {
        const uint32_t sel = high(r) ? 0x7632 : 0x5410;
        const uint32_t lo = __byte_perm(x0[r / 2], x1[r / 2], sel), hi = __byte_perm(x8[r / 2], x9[r / 2], sel);
        af[0] = mul2<T>(wa[0], lo), af[1] = mul2<T>(wa[1], lo);
        af[2] = mul2<T>(wa[2], hi), af[3] = mul2<T>(wa[3], hi);
      }
#pragma unroll
      for (int i = 0; i < kG; ++i) {
        if (!has_group(i)) continue;
        M::mma(acc[r][i][0], af, bx[i][0]);
        M::mma(acc[r][i][1], af, bx[i][1]);
      }
    }
  }

  // The read's B fragments from the state: each slot times its weight, and for fp16 a power of two
  // that puts the row's largest product at [2^13, 2^14), far from fp16's subnormals and its max (bf16
  // has fp32's exponent range: no scale there).
  __device__ void publish(const LinParams& p) {
#pragma unroll
    for (int r = 0; r < kR; ++r) {
      float unit = 1.f;
      if constexpr (std::is_same<T, __half>::value) {
        float m = 0.f;
#pragma unroll
        for (int i = 0; i < kG; ++i) {
          float mi = 0.f;
#pragma unroll
          for (int k = 0; k < 8; ++k) mi = fmaxf(mi, fabsf(acc[r][i][k / 4][k % 4]));
          if (has_group(i)) m = fmaxf(m, fabsf(weight(p, i)) * mi);
        }
#pragma unroll
        for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        int e;
        frexpf(m, &e);  // m = f 2^e, f in [0.5, 1); 0 gives e = 0
        unit = ldexpf(1.f, 14 - e);
      }
      inv[r] = (kFirst ? 1.f : p.cu[2] * p.cr[2]) / unit;
#pragma unroll
      for (int i = 0; i < kG; ++i) {
        if (!has_group(i)) continue;
        const float s = weight(p, i) * unit;
        const float(*a)[4] = acc[r][i];
#pragma unroll
        for (int n = 0; n < 2; ++n) {  // w's columns 8n .. 8n + 7 are the accumulator rows g (+ 8)
          bs[r][i][n][0] = Elem<T>::pack(s * a[0][2 * n], s * a[0][2 * n + 1]);
          bs[r][i][n][1] = Elem<T>::pack(s * a[1][2 * n], s * a[1][2 * n + 1]);
        }
      }
    }
  }

  // Rows t0 .. t0 + 15 of the chunk read from the state: z_a[t][c] = sum_b x[t][b] S_a[b][c] per row
  // (every row's products first, so that they overlap), then R1: y[t][c] += x[t][a] z_a[t][c] (row -1:
  // z), and R2 (second order, g the chunk's weight tile): dq[t][a] (+)= 2 sum_c g[t][c] z_a[t][c] into
  // dq_s, one writer per element in the CTA (kAdd: row -1's share is there already).
  template <bool kAdd>
  __device__ void read(Tile x, Tile g_tile, int t0, bool r1, bool r2, float (&y)[2][4], float* dq_s) const {
    const int lane = lane_id(), g = lane / 4, tq = lane % 4;
    uint32_t xa[kG][4];
#pragma unroll
    for (int i = 0; i < kG; ++i)
      if (has_group(i)) M::lda(xa[i], x, t0, group(i) * 16);
    float z[kR][2][4] = {};
#pragma unroll
    for (int r = 0; r < kR; ++r)
#pragma unroll
      for (int i = 0; i < kG; ++i) {
        if (!has_group(i)) continue;
        M::mma(z[r][0], xa[i], bs[r][i][0]);
        M::mma(z[r][1], xa[i], bs[r][i][1]);
      }
    if constexpr (kFirst) {
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int k = 0; k < 4; ++k) y[n][k] += inv[0] * z[0][n][k];
      return;
    }
    if (r1) {
      uint32_t top[kW], bot[kW];
      row_words(x, t0 + g, top), row_words(x, t0 + g + 8, bot);
#pragma unroll
      for (int r = 0; r < kR; ++r) {
        const float2 ft = Elem<T>::unpack(top[r / 2]), fb = Elem<T>::unpack(bot[r / 2]);
        const float xt = inv[r] * (high(r) ? ft.y : ft.x), xb = inv[r] * (high(r) ? fb.y : fb.x);
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          y[n][0] += xt * z[r][n][0], y[n][1] += xt * z[r][n][1];
          y[n][2] += xb * z[r][n][2], y[n][3] += xb * z[r][n][3];
        }
      }
    }
    if (r2) {
      float gv[2][4];
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const float2 gt = lds_pair<T>(g_tile.at(t0 + g, (8 * n + 2 * tq) * 2));
        const float2 gb = lds_pair<T>(g_tile.at(t0 + g + 8, (8 * n + 2 * tq) * 2));
        gv[n][0] = gt.x, gv[n][1] = gt.y, gv[n][2] = gb.x, gv[n][3] = gb.y;
      }
      float part[2 * kR];  // [row][top, bottom]: this lane's share of 2 g . z_a
#pragma unroll
      for (int r = 0; r < kR; ++r) {
        float pt = 0.f, pb = 0.f;
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          pt += gv[n][0] * z[r][n][0] + gv[n][1] * z[r][n][1];
          pb += gv[n][2] * z[r][n][2] + gv[n][3] * z[r][n][3];
        }
        part[2 * r] = 2.f * inv[r] * pt, part[2 * r + 1] = 2.f * inv[r] * pb;
      }
      constexpr int kKeep = 2 * kR >= 4 ? kR / 2 : 1;
      float sum[kKeep];
      quad_reduce_scatter<2 * kR>(part, tq, sum);
#pragma unroll
      for (int j = 0; j < kKeep; ++j) {
        // The sum's index in part: row r = idx / 2, bottom = idx % 2 (see quad_reduce_scatter).
        const int idx = kR == 1 ? tq & 1 : (tq & 1) * kR + (tq >> 1) * (kR / 2) + j;
        if (kR == 1 && tq >= 2) continue;  // the other two lanes hold the same sums
        float& at = dq_s[(t0 + g + 8 * (idx % 2)) * C::kDqPitch + a0 + idx / 2];
        at = kAdd ? at + sum[j] : sum[j];
      }
    }
  }

  // Row -1's R2, dq[t][b] = sum_c g[t][c] S[b][c] for the whole chunk: a product with S transposed,
  // through this warp's shared tiles (s_first), stored before the second-order rows add theirs.
  __device__ void read_first_r2(Tile w, uint32_t s_first, float* dq_s) const {
    static_assert(kFirst, "row -1 only");
    const int lane = lane_id(), g = lane / 4, tq = lane % 4;
    uint32_t bt[kG][2][2];
#pragma unroll
    for (int i = 0; i < kG; ++i) {
      const Tile st{s_first + i * C::kGroupTile, C::kWPitch};
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int h = 0; h < 2; ++h) sts32(st.at(8 * n + g, (8 * h + 2 * tq) * 2), bs[0][i][n][h]);
      __syncwarp();
      M::ldb2_t(bt[i][0], bt[i][1], st, 0, 0);
    }
#pragma unroll 1
    for (int t0 = 0; t0 < kL; t0 += 16) {
      uint32_t ga[4];
      M::lda(ga, w, t0, 0);
#pragma unroll
      for (int i = 0; i < kG; ++i) {
        if (group(i) >= kJ) continue;  // the constant feature has no gradient
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float d[4] = {};
          M::mma(d, ga, bt[i][h]);
          float* at = dq_s + (t0 + g) * C::kDqPitch + group(i) * 16 + 8 * h + 2 * tq;
          *reinterpret_cast<float2*>(at) = make_float2(inv[0] * d[0], inv[0] * d[1]);
          *reinterpret_cast<float2*>(at + 8 * C::kDqPitch) = make_float2(inv[0] * d[2], inv[0] * d[3]);
        }
      }
    }
  }
};

// One CTA's sweep over one m-tile (16 columns of w) and part. kSecond: the part's warps own kRows
// second-order rows each (from group kOwn on: see WarpRows), spread evenly over all parts' warps;
// kFirst: the warps hold row -1 (alone, or folded into the last part where LinConfig::kFold says).
template <class T, int D, bool kSecond, bool kFirst, int kOwn = -1>
__device__ __forceinline__ void linear_sweep(const LinParams& p, char* smem, int part, int mt, int b, int hkv) {
  using C = LinConfig<T, D>;
  constexpr int kL = C::kL, kDp = C::kDp, kThreads = C::kThreads;
  constexpr int kXBytes = (kFirst ? kDp : D) * 2;  // second-order rows read x's first D columns only
  const int warp = threadIdx.x / 32, lane = lane_id(), g = lane / 4, tq = lane % 4;
  // The outputs this m-tile's CTA adds to: R1 (columns of w) and R2.
  const bool r1 = p.r1 != nullptr && mt < p.r1_tiles, r2 = p.r2 != nullptr;
  const int n_rd = r1 || r2 ? p.rd_heads : 0;
  if (n_rd == 0) return;

  const uint32_t base = smem_u32(smem);
  // Phase i's stage: the read's (x, g) pair, then the update's (x, w) pair where phases are fused.
  auto sX = [&](int i, bool upd) {
    return Tile{base + (i & 1) * C::kStage + (C::kFuse && upd) * C::kPair, C::kXPitch};
  };
  auto sW = [&](int i, bool upd) { return Tile{sX(i, upd).base + kL * C::kXPitch, C::kWPitch}; };
  constexpr int kDq = kL * C::kDqPitch;
  float* dq_s = reinterpret_cast<float*>(smem + 2 * C::kStage);  // R2 [kL][kDqPitch]
  const uint32_t s_first = smem_u32(dq_s + kDq) + warp * C::kFirstGroups * C::kGroupTile;
  float* y_s = dq_s + kDq + C::kWarps * C::kFirstGroups * C::kGroupTile / 4;  // R1 [kYTiles][kWarps][16][kYPitch]
  for (int i = threadIdx.x; i < kDq; i += kThreads) dq_s[i] = 0.f;  // columns no warp here writes stay 0

  WarpRows<T, D, false, kOwn> second;
  WarpRows<T, D, true, -1> first;
  second.warp = first.warp = warp;
  second.a0 = (part * C::kWarps + warp) * C::kRows;
  // The columns of R2 this CTA writes: its rows' (from col0), or all of them with row -1.
  constexpr int kPairs = (kFirst ? D : C::kWarps * C::kRows) / 2;
  const int col0 = kFirst ? 0 : part * C::kWarps * C::kRows;

  // The sweep as a list of phases, each one's tiles loaded while the one before computes. A phase j of
  // chunk step `step` reads with head rd and updates with head up (-1: none). Causal: each step's
  // reads, then its updates, or with kFuse the j-th of each together (the read sees the state before
  // the step: it is published after the step's last phase). Non-causal: every step's updates, then
  // (pass1) every step's reads.
  struct Phase {
    int step, j, rd, up;
    bool pass1;
  };
  auto per_step = [&](bool pass1) {
    return !p.causal ? (pass1 ? n_rd : p.upd_heads) : C::kFuse ? max(n_rd, p.upd_heads) : n_rd + p.upd_heads;
  };
  auto phase = [&](int step, int j, bool pass1) {
    Phase f{step, j, -1, -1, pass1};
    if (!p.causal) {
      (pass1 ? f.rd : f.up) = j;
    } else if (C::kFuse) {
      f.rd = j < n_rd ? j : -1, f.up = j < p.upd_heads ? j : -1;
    } else if (j < n_rd) {
      f.rd = j;
    } else {
      f.up = j - n_rd;
    }
    return f;
  };
  auto next = [&](const Phase& f) {  // by counting: no division on the way
    if (f.j + 1 < per_step(f.pass1)) return phase(f.step, f.j + 1, f.pass1);
    if (f.step + 1 < p.chunks) return phase(f.step + 1, 0, f.pass1);
    return phase(0, 0, true);  // non-causal: the reads after the updates (past the last phase: unused)
  };
  // Row index of row 0 of (chunk, head) in a chunk-major (B, chunks, heads, kL, ...) tensor.
  auto row_at = [&](int step, int head, bool read) {
    const int heads = p.Hkv * (read ? p.rd_heads : p.upd_heads);
    const int h = hkv * (read ? p.rd_heads : p.upd_heads) + head;
    const int chunk = p.reverse ? p.chunks - 1 - step : step;
    return ((static_cast<int64_t>(b) * p.chunks + chunk) * heads + h) * kL;
  };
  // Every row is inside the tensor (chunks are whole), so nothing is zero-filled.
  auto load_pair = [&](const void* xs, const void* ws, int64_t row, int i, bool upd) {
    const T* x = static_cast<const T*>(xs) + row * kDp;
    cp_tile<kL, kXBytes, kThreads>(sX(i, upd), reinterpret_cast<const char*>(x), kDp * 2, kL, x);
    if (ws != nullptr) {
      const T* w = static_cast<const T*>(ws) + row * kDp + mt * 16;
      cp_tile<kL, 32, kThreads>(sW(i, upd), reinterpret_cast<const char*>(w), kDp * 2, kL, w);
    }
  };
  auto load = [&](const Phase& f, int i) {
    if (f.rd >= 0) load_pair(p.rx, r2 ? p.rg : nullptr, row_at(f.step, f.rd, true), i, false);
    if (f.up >= 0) load_pair(p.ux, p.uw, row_at(f.step, f.up, false), i, true);
  };

  // One phase's work, in m16 tiles of the chunk's rows: the update's k16 step and the read's rows, in one
  // basic block (kUp, kRd compile-time) so that their mma chains interleave. The read's y sums over
  // all warps: each warp leaves its share of kYTiles tiles in its slots, and after one barrier the CTA
  // adds them into r1 in global memory. dq meets in dq_s, then goes to r2 in global memory (fp32; every
  // m-tile and part adds its own).
  auto run = [&](auto up, auto rd, const Phase& f, int i) {
    constexpr bool kUp = decltype(up)::value, kRd = decltype(rd)::value;
    const Tile xr = sX(i, false), gr = sW(i, false), xu = sX(i, true), wu = sW(i, true);
    const int64_t row0 = kRd ? row_at(f.step, f.rd, true) : 0;
    if (kRd && kFirst && r2) {
      first.read_first_r2(gr, s_first, dq_s);
      if constexpr (kSecond) __syncthreads();  // row -1's share first; the rows' add to it
    }
#pragma unroll 1
    for (int m = 0; m < kL / 16; ++m) {
      if constexpr (kUp && kSecond) second.accumulate(xu, wu, m);
      if constexpr (kUp && kFirst) first.accumulate(xu, wu, m);
      if constexpr (kRd) {
        const int t0 = m * 16;
        float* y_slot = y_s + (m % C::kYTiles) * C::kWarps * C::kYTile;
        float y[2][4] = {};
        if constexpr (kSecond) second.template read<kFirst>(xr, gr, t0, r1, r2, y, dq_s);
        if constexpr (kFirst) {
          if (r1) first.template read<false>(xr, gr, t0, r1, false, y, dq_s);  // row -1's R2: read_first_r2
        }
        if (r1) {
#pragma unroll
          for (int n = 0; n < 2; ++n) {
            float* at = y_slot + warp * C::kYTile + g * C::kYPitch + 8 * n + 2 * tq;
            *reinterpret_cast<float2*>(at) = make_float2(y[n][0], y[n][1]);
            *reinterpret_cast<float2*>(at + 8 * C::kYPitch) = make_float2(y[n][2], y[n][3]);
          }
        }
        if (r1 && m % C::kYTiles == C::kYTiles - 1) {
          __syncthreads();
          const int m0 = m + 1 - C::kYTiles;
          for (int k = threadIdx.x; k < C::kYTiles * 16 * 8; k += kThreads) {
            const int tile = k / 128, t = (k / 8) % 16, c = (k % 8) * 2;
            const float* at = y_s + tile * C::kWarps * C::kYTile + t * C::kYPitch + c;
            float2 sum = make_float2(0.f, 0.f);
#pragma unroll
            for (int w = 0; w < C::kWarps; ++w) {
              const float2 v = *reinterpret_cast<const float2*>(at + w * C::kYTile);
              sum.x += v.x, sum.y += v.y;
            }
            red_add2(p.r1 + (row0 + (m0 + tile) * 16 + t) * kDp + mt * 16 + c, sum.x, sum.y);
          }
          if (C::kYTiles < kL / 16) __syncthreads();  // the slots are rewritten by the next tiles
        }
      }
    }
    if (kRd && r2) {
      __syncthreads();
      for (int k = threadIdx.x; k < kL * kPairs; k += kThreads) {
        const int t = k / kPairs, c = col0 + (k % kPairs) * 2;
        red_add2(p.r2 + (row0 + t) * D + c, dq_s[t * C::kDqPitch + c], dq_s[t * C::kDqPitch + c + 1]);
      }
    }
  };

  using Yes = std::true_type;
  using No = std::false_type;
  const int phases = p.chunks * (p.causal ? per_step(false) : p.upd_heads + n_rd);
  Phase f = phase(0, 0, false), f_next = next(f);
  load(f, 0);
  cp_async_commit();
  for (int i = 0; i < phases; ++i, f = f_next, f_next = next(f_next)) {
    if (i + 1 < phases) load(f_next, i + 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    if (f.up < 0) {
      run(No{}, Yes{}, f, i);
    } else if (f.rd < 0) {
      run(Yes{}, No{}, f, i);
    } else if constexpr (C::kFuse) {
      run(Yes{}, Yes{}, f, i);
    }
    if (!f.pass1 && f.j + 1 == per_step(false)) {  // the step's updates are in: publish them to the reads
      if constexpr (kSecond) second.publish(p);
      if constexpr (kFirst) first.publish(p);
    }
    __syncthreads();  // the stage's last readers are done before the next load overwrites it
  }
}

// The upper-half sweep of the warps whose rows lie in feature group `own` (a warp-uniform value).
template <class T, int D, bool kFirst, int kOwn = 0>
__device__ __forceinline__ void half_sweep(const LinParams& p, char* smem, int own, int part, int mt, int b, int hkv) {
  if constexpr (kOwn < LinConfig<T, D>::kJ) {
    if (own == kOwn) {
      linear_sweep<T, D, true, kFirst, kOwn>(p, smem, part, mt, b, hkv);
    } else {
      half_sweep<T, D, kFirst, kOwn + 1>(p, smem, own, part, mt, b, hkv);
    }
  }
}

template <class T, int D, bool kFirst>
__device__ __forceinline__ void second_order_sweep(const LinParams& p, char* smem, int part, int mt, int b, int hkv) {
  using C = LinConfig<T, D>;
  if (p.r2 == nullptr) {
    half_sweep<T, D, kFirst>(p, smem, (part * C::kWarps + threadIdx.x / 32) * C::kRows / 16, part, mt, b, hkv);
  } else {
    linear_sweep<T, D, true, kFirst>(p, smem, part, mt, b, hkv);
  }
}

template <class T, int D>
__global__ void __launch_bounds__(LinConfig<T, D>::kThreads, 1) linear_kernel(const LinParams p) {
  using C = LinConfig<T, D>;
  extern __shared__ __align__(16) char smem[];
  const int part = blockIdx.x / C::kJ1, mt = blockIdx.x % C::kJ1;
  const int b = blockIdx.y / p.Hkv, hkv = blockIdx.y % p.Hkv;
  if (part == p.parts) {  // row -1 alone (p = 1, or not folded)
    linear_sweep<T, D, false, true>(p, smem, part, mt, b, hkv);
  } else {
    second_order_sweep<T, D, C::kFold>(p, smem, part, mt, b, hkv);
  }
}

template <class T, int D>
cudaError_t run_linear(LinParams p, cudaStream_t stream) {
  using C = LinConfig<T, D>;
  p.parts = C::parts(p.second);
  if (int64_t{p.B} * p.Hkv > 65535) return cudaErrorInvalidConfiguration;
  const int parts = p.parts + (p.parts == 0 || !C::kFold);
  const int64_t blocks = static_cast<int64_t>(parts) * C::kJ1 * p.B * p.Hkv;
  return launch(linear_kernel<T, D>, dim3(parts * C::kJ1, p.B * p.Hkv), blocks, C::kThreads, C::kBytes, p,
                stream);
}

}  // namespace attn
