// Fastmax's linear form: the moments of the keys carried from chunk to chunk (fp32, in shared memory).
//
// With x' = [x, 1, 0 ... 0] (Dp = D + 16 columns) the polynomial weight factorises:
//   f(q.k) = c0 + c1 q.k + c2 (q.k)^2 = sum over feature groups of  coef * r_a(q) r_a(k) * q'_b k'_b
// Groups are 16 features wide. Row -1: r = 1, b over all Dp columns (first order, and the constant
// through column D); rows a = 0..D-1 (p = 2): r_a(x) = x_a, b over 0..D-1 (every (a, b) pair, so the
// state is symmetric in a, b). One kernel serves the three sweeps of the linear form:
//   forward   state S = sum_s phi(k_s) w_s^T  (w = [v, 1]),   read R1: y_t = psi(q_t) . S
//   dq        same state,                                     read R2: dq_t = d/dq [psi(q_t)] . S g_t
//   dk, dv    state R = sum_t psi(q_t) g_t^T (reverse order), read R1 (dv) and R2 (dk, with g := w)
// where psi carries the coefficients (c0, c1, c2) of the reading side and phi none (`cr`, `cu`).
// Causal: the state read at chunk c holds exactly the chunks before c (after c, reversed); the chunk's
// own block is the tiled quadratic kernel's job. Non-causal: every chunk, then every read.
//
// Work split: grid.x = (part, m-tile): an m-tile is 16 columns of w (or g), and the state of an m-tile
// (16 rows x features) is split into parts of whole feature rows a that fit one CTA's shared memory;
// grid.y = (batch, kv head). Each warp owns whole rows, so no state is shared between warps. Outputs are
// partial sums over m-tiles and parts: they meet in fp32 with red.global.add.
//
// Range: a row's state enters the tensor cores (fp16/bf16) multiplied by a power of two taken from its
// own largest element (`tscale`, set where the update has the row in registers), not from the number
// of rows it sums: the dk/dv state sums psi(q) g^T with g ~ dO / l, which shrinks as the rows grow,
// so a row-count scale left it in fp16's subnormals (digits lost; the dk/dv gradient cases failed).
#pragma once
#include "mma.cuh"
#include "params.h"
#include "score.cuh"

namespace attn {

template <class T, int D>
struct LinConfig {
  static constexpr int kWarps = 8, kL = kLinChunk, kRead = 64;  // rows per chunk, rows per read step
  static constexpr int kJ = D / 16, kDp = D + 16, kJ1 = kJ + 1;  // second-order / first-order groups per row
  static constexpr int kXPitch = kDp * 2 + 16, kWPitch = 16 * 2 + 16;  // padded tile rows (ldmatrix)
  // Bytes of everything but the state: the feature tile, the 16-column tile, the R1 and R2 staging.
  static constexpr int kFixed = kL * kXPitch + kL * kWPitch + 16 * kRead * 4 + kRead * D * 4;
  static constexpr int kGroupBytes = 16 * 16 * 4, kRowBytes = kJ * kGroupBytes + 8;  // + the row's (scale, 1/scale)
  static int smem_bytes(int rows) { return kFixed + (rows * kJ + kJ1) * kGroupBytes + (rows + 1) * 8; }
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

template <class T>
__device__ __forceinline__ float lds_elem(Tile s, int row, int col) {
  const float2 f = lds_pair<T>(s.at(row, (col & ~1) * 2));
  return col & 1 ? f.y : f.x;
}

// A state group: 16 x 16 fp32 in the accumulator layout of two m16n8 tiles, 8 floats per lane.
__device__ __forceinline__ void ld_group(float* acc, const float* g) {
  const float4 a = reinterpret_cast<const float4*>(g)[lane_id() * 2];
  const float4 b = reinterpret_cast<const float4*>(g)[lane_id() * 2 + 1];
  acc[0] = a.x, acc[1] = a.y, acc[2] = a.z, acc[3] = a.w, acc[4] = b.x, acc[5] = b.y, acc[6] = b.z, acc[7] = b.w;
}
__device__ __forceinline__ void st_group(float* g, const float* acc) {
  reinterpret_cast<float4*>(g)[lane_id() * 2] = make_float4(acc[0], acc[1], acc[2], acc[3]);
  reinterpret_cast<float4*>(g)[lane_id() * 2 + 1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
}
// The power of two that puts the largest |element| m of a state row (over the warp, from this lane's
// part of it) at [2^13, 2^14): far from fp16's subnormals and its max. (scale, 1/scale) to s[0], s[1].
__device__ __forceinline__ void set_scale(float* s, float m) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (lane_id() == 0) {
    int e;
    frexpf(m, &e);  // m = f 2^e, f in [0.5, 1); 0 gives e = 0
    s[0] = ldexpf(1.f, 14 - e), s[1] = ldexpf(1.f, e - 14);
  }
}

// Element (row c, column b) of a group, wherever its lane keeps it.
__device__ __forceinline__ float group_elem(const float* g, int c, int b) {
  return g[((c & 7) * 4 + (b & 7) / 2) * 8 + (b / 8) * 4 + (c / 8) * 2 + (b & 1)];
}

template <class T, int D>
__global__ void __launch_bounds__(LinConfig<T, D>::kWarps * 32, 1) linear_kernel(const LinParams p) {
  using C = LinConfig<T, D>;
  using M = Mma<T>;
  constexpr int kL = C::kL, kJ = C::kJ, kJ1 = C::kJ1, kDp = C::kDp, kThreads = C::kWarps * 32;
  extern __shared__ __align__(16) char smem[];
  const Tile sX{smem_u32(smem), C::kXPitch};                   // features: q' or k' rows of the chunk
  const Tile sW{sX.base + kL * C::kXPitch, C::kWPitch};        // this m-tile's 16 columns of w or g
  float* y_s = reinterpret_cast<float*>(smem + kL * C::kXPitch + kL * C::kWPitch);  // R1 [16][kRead]
  float* dq_s = y_s + 16 * C::kRead;                                                // R2 [kRead][D]
  float* state = dq_s + C::kRead * D;

  const int warp = threadIdx.x / 32, lane = lane_id(), g = lane / 4, tq = lane % 4;
  const int part = blockIdx.x / (kJ1), mt = blockIdx.x % kJ1;
  const int b = blockIdx.y / p.Hkv, hkv = blockIdx.y % p.Hkv;
  const int row0 = part * p.rows_per_part, rows = p.second ? max(0, min(D - row0, p.rows_per_part)) : 0;
  const bool has_first = part == 0;  // row -1
  // This warp's rows: local rows warp, warp + 8, ...; row -1 goes to the last warp.
  const bool warp_first = has_first && warp == C::kWarps - 1;
  auto slot = [&](int local_row, int j) { return state + (local_row * kJ + j) * 256; };
  float* first = state + p.rows_per_part * kJ * 256;  // row -1's kJ1 groups
  float* tscale = first + kJ1 * 256;                    // (scale, 1/scale) per local row, row -1 last
  float* first_scale = tscale + 2 * p.rows_per_part;

  for (int i = threadIdx.x; i < (p.rows_per_part * kJ + kJ1) * 256; i += kThreads) state[i] = 0.f;
  for (int i = threadIdx.x; i < 2 * (p.rows_per_part + 1); i += kThreads) tscale[i] = 1.f;
  for (int i = threadIdx.x; i < 16 * C::kRead + C::kRead * D; i += kThreads) y_s[i] = 0.f;

  const T* ux = static_cast<const T*>(p.ux);
  const T* uw = static_cast<const T*>(p.uw);
  const T* rx = static_cast<const T*>(p.rx);
  const T* rg = static_cast<const T*>(p.rg);
  // Element offset of row 0 of (chunk, head) in a chunk-major (B, chunks, heads, kL, kDp) tensor.
  auto chunk_at = [&](int chunk, int heads, int h) {
    return ((static_cast<int64_t>(b) * p.chunks + chunk) * heads + h) * kL * kDp;
  };

  // The chunk's rows of x (all columns) and, when wanted, of w (this m-tile's 16 columns); every row is
  // inside the tensor (chunks are whole), so nothing is zero-filled.
  auto cp_chunk = [&](Tile dx, const T* x, Tile dw, const T* w, bool with_w) {
    cp_tile<kL, kDp * 2, kThreads>(dx, reinterpret_cast<const char*>(x), kDp * 2, kL, x);
    if (with_w) cp_tile<kL, 32, kThreads>(dw, reinterpret_cast<const char*>(w + mt * 16), kDp * 2, kL, w);
  };

  // state += phi(x) w^T over the chunk's rows (coefficients cu), for every row of this warp.
  auto update = [&](int chunk) {
    for (int hu = 0; hu < p.upd_heads; ++hu) {
      const int64_t at = chunk_at(chunk, p.Hkv * p.upd_heads, hkv * p.upd_heads + hu);
      __syncthreads();  // the tiles' last readers are done
      cp_chunk(sX, ux + at, sW, uw + at, true);
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();
      for (int r = warp; r < rows; r += C::kWarps) {
        const int a = row0 + r;
        float acc[kJ][8];
#pragma unroll
        for (int j = 0; j < kJ; ++j) ld_group(acc[j], slot(r, j));
#pragma unroll 2
        for (int ks = 0; ks < kL / 16; ++ks) {
          uint32_t af[4];
          M::lda_t(af, sW, ks * 16, 0);
          const int s = ks * 16 + 2 * tq;
          const uint32_t lo = Elem<T>::pack(p.cu[2] * lds_elem<T>(sX, s, a), p.cu[2] * lds_elem<T>(sX, s + 1, a));
          const uint32_t hi = Elem<T>::pack(p.cu[2] * lds_elem<T>(sX, s + 8, a), p.cu[2] * lds_elem<T>(sX, s + 9, a));
          af[0] = mul2<T>(af[0], lo), af[1] = mul2<T>(af[1], lo);
          af[2] = mul2<T>(af[2], hi), af[3] = mul2<T>(af[3], hi);
#pragma unroll
          for (int j = 0; j < kJ; ++j) {
            uint32_t b0[2], b1[2];
            M::ldb2_t(b0, b1, sX, ks * 16, j * 16);
            M::mma(acc[j], af, b0);
            M::mma(acc[j] + 4, af, b1);
          }
        }
        float m = 0.f;
#pragma unroll
        for (int j = 0; j < kJ; ++j) {
          st_group(slot(r, j), acc[j]);
#pragma unroll
          for (int i = 0; i < 8; ++i) m = fmaxf(m, fabsf(acc[j][i]));
        }
        set_scale(tscale + 2 * r, m);
      }
      if (warp_first) {
        float acc[kJ1][8];
#pragma unroll
        for (int j = 0; j < kJ1; ++j) ld_group(acc[j], first + j * 256);
        const uint32_t c1 = Elem<T>::pack(p.cu[1], p.cu[1]), c0 = Elem<T>::pack(p.cu[0], p.cu[0]);
#pragma unroll 2
        for (int ks = 0; ks < kL / 16; ++ks) {
          uint32_t w[4], af[4];
          M::lda_t(w, sW, ks * 16, 0);
#pragma unroll
          for (int j = 0; j < kJ1; ++j) {
            const uint32_t cj = j < kJ ? c1 : c0;  // column D of x' is the constant feature
#pragma unroll
            for (int i = 0; i < 4; ++i) af[i] = mul2<T>(w[i], cj);
            uint32_t b0[2], b1[2];
            M::ldb2_t(b0, b1, sX, ks * 16, j * 16);
            M::mma(acc[j], af, b0);
            M::mma(acc[j] + 4, af, b1);
          }
        }
        float m = 0.f;
#pragma unroll
        for (int j = 0; j < kJ1; ++j) {
          st_group(first + j * 256, acc[j]);
#pragma unroll
          for (int i = 0; i < 8; ++i) m = fmaxf(m, fabsf(acc[j][i]));
        }
        set_scale(first_scale, m);
      }
    }
  };

  // acc[c][t] += scale * group[c][b] x'[t][b] over the 16 columns b of block j, rows t0 .. t0 + kRead.
  auto read_group = [&](float (*acc)[4], const float* group, float scale, int j, int t0) {
    float s[8];
    ld_group(s, group);
#pragma unroll
    for (int i = 0; i < 8; ++i) s[i] *= scale;
    uint32_t af[4];
    M::c_to_a(af, s, s + 4);
#pragma unroll
    for (int nb = 0; nb < C::kRead / 8; nb += 2) {
      uint32_t b0[2], b1[2];
      M::ldb2(b0, b1, sX, t0 + nb * 8, j * 16);
      M::mma(acc[nb], af, b0);
      M::mma(acc[nb + 1], af, b1);
    }
  };

  // Outputs of the chunk's rows from the current state: R1 (columns of this m-tile) and R2 (all D).
  // Each state row enters the tensor cores times its tscale; its products are multiplied back (by
  // 1/scale, exact) before they meet other rows' in y or dq.
  auto read = [&](int chunk) {
    const bool r1 = p.r1 != nullptr && mt < p.r1_tiles, r2 = p.r2 != nullptr;
    if (!r1 && !r2) return;
    for (int hr = 0; hr < p.rd_heads; ++hr) {
      const int heads = p.Hkv * p.rd_heads, h = hkv * p.rd_heads + hr;
      const int64_t at = chunk_at(chunk, heads, h);
      __syncthreads();
      cp_chunk(sX, rx + at, sW, rg + at, r2);
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();
      for (int t0 = 0; t0 < kL; t0 += C::kRead) {
        float y[C::kRead / 8][4] = {};
        float gv[C::kRead / 8][4];  // g[t][c] at this lane's accumulator positions (R2)
        if (r2) {
#pragma unroll
          for (int nb = 0; nb < C::kRead / 8; ++nb) {
            const int t = t0 + nb * 8 + 2 * tq;
            gv[nb][0] = lds_elem<T>(sW, t, g), gv[nb][1] = lds_elem<T>(sW, t + 1, g);
            gv[nb][2] = lds_elem<T>(sW, t, g + 8), gv[nb][3] = lds_elem<T>(sW, t + 1, g + 8);
          }
        }
        for (int r = warp; r < rows; r += C::kWarps) {
          const int a = row0 + r;
          const float sc = tscale[2 * r], c2 = p.cr[2] * tscale[2 * r + 1];  // c2 carries 1/scale
          float z[C::kRead / 8][4] = {};
#pragma unroll
          for (int j = 0; j < kJ; ++j) read_group(z, slot(r, j), sc, j, t0);
#pragma unroll
          for (int nb = 0; nb < C::kRead / 8; ++nb) {
            const int t = t0 + nb * 8 + 2 * tq;
            if (r1) {  // y[c][t] += c2 x_t[a] z[c][t]
              const float x0 = c2 * lds_elem<T>(sX, t, a), x1 = c2 * lds_elem<T>(sX, t + 1, a);
              y[nb][0] += x0 * z[nb][0], y[nb][1] += x1 * z[nb][1];
              y[nb][2] += x0 * z[nb][2], y[nb][3] += x1 * z[nb][3];
            }
            if (r2) {  // dq[t][a] += 2 c2 sum_c g[t][c] z[c][t]: over c = this lane's g, g + 8, then the 8 g's
              float d0 = gv[nb][0] * z[nb][0] + gv[nb][2] * z[nb][2];
              float d1 = gv[nb][1] * z[nb][1] + gv[nb][3] * z[nb][3];
#pragma unroll
              for (int o = 4; o < 32; o *= 2) {
                d0 += __shfl_xor_sync(0xffffffffu, d0, o);
                d1 += __shfl_xor_sync(0xffffffffu, d1, o);
              }
              if (g == 0) {
                atomicAdd(dq_s + (t - t0) * D + a, 2.f * c2 * d0);
                atomicAdd(dq_s + (t + 1 - t0) * D + a, 2.f * c2 * d1);
              }
            }
          }
        }
        if (warp_first) {
          const float fs = first_scale[0], finv = first_scale[1];
          if (r1) {  // y += sum_j coef_j S_j x'_j^T, accumulated at row -1's scale (y's rows so far: exact)
#pragma unroll
            for (int nb = 0; nb < C::kRead / 8; ++nb)
#pragma unroll
              for (int i = 0; i < 4; ++i) y[nb][i] *= fs;
#pragma unroll
            for (int j = 0; j < kJ1; ++j) read_group(y, first + j * 256, (j < kJ ? p.cr[1] : p.cr[0]) * fs, j, t0);
#pragma unroll
            for (int nb = 0; nb < C::kRead / 8; ++nb)
#pragma unroll
              for (int i = 0; i < 4; ++i) y[nb][i] *= finv;
          }
          if (r2) {  // dq[t][b] += c1 sum_c g[t][c] S[c][b]: S^T as the B operand, gathered from its lanes
#pragma unroll
            for (int j = 0; j < kJ; ++j) {
              uint32_t bs[2][2];
#pragma unroll
              for (int nbb = 0; nbb < 2; ++nbb)
#pragma unroll
                for (int h2 = 0; h2 < 2; ++h2) {
                  const int c = 2 * tq + 8 * h2, col = nbb * 8 + g;
                  bs[nbb][h2] = Elem<T>::pack(fs * group_elem(first + j * 256, c, col),
                                              fs * group_elem(first + j * 256, c + 1, col));
                }
#pragma unroll
              for (int tb = 0; tb < C::kRead / 16; ++tb) {
                uint32_t af[4];
                M::lda(af, sW, t0 + tb * 16, 0);
#pragma unroll
                for (int nbb = 0; nbb < 2; ++nbb) {
                  float hacc[4] = {};
                  M::mma(hacc, af, bs[nbb]);
                  const int col = j * 16 + nbb * 8 + 2 * tq, t = tb * 16 + g;
                  const float c1 = p.cr[1] * finv;
                  atomicAdd(dq_s + t * D + col, c1 * hacc[0]);
                  atomicAdd(dq_s + t * D + col + 1, c1 * hacc[1]);
                  atomicAdd(dq_s + (t + 8) * D + col, c1 * hacc[2]);
                  atomicAdd(dq_s + (t + 8) * D + col + 1, c1 * hacc[3]);
                }
              }
            }
          }
        }
        if (r1) {
#pragma unroll
          for (int nb = 0; nb < C::kRead / 8; ++nb) {
            const int t = nb * 8 + 2 * tq;
            atomicAdd(y_s + g * C::kRead + t, y[nb][0]);
            atomicAdd(y_s + g * C::kRead + t + 1, y[nb][1]);
            atomicAdd(y_s + (g + 8) * C::kRead + t, y[nb][2]);
            atomicAdd(y_s + (g + 8) * C::kRead + t + 1, y[nb][3]);
          }
        }
        __syncthreads();
        // Flush this read step's partial sums (fp32, every m-tile and part adds its share) and re-zero.
        const int64_t row_at = (chunk_at(chunk, heads, h) / kDp) + t0;  // row index of (chunk, head, t0)
        if (r1) {
          for (int i = threadIdx.x; i < 16 * C::kRead / 2; i += kThreads) {
            const int c = (i * 2) % 16, t = (i * 2) / 16;
            red_add2(p.r1 + (row_at + t) * kDp + mt * 16 + c, y_s[c * C::kRead + t], y_s[(c + 1) * C::kRead + t]);
            y_s[c * C::kRead + t] = 0.f, y_s[(c + 1) * C::kRead + t] = 0.f;
          }
        }
        if (r2) {
          for (int i = threadIdx.x; i < C::kRead * D / 2; i += kThreads) {
            red_add2(p.r2 + (row_at * D) + i * 2, dq_s[i * 2], dq_s[i * 2 + 1]);
            dq_s[i * 2] = 0.f, dq_s[i * 2 + 1] = 0.f;
          }
        }
        __syncthreads();
      }
    }
  };

  for (int step = 0; step < p.chunks; ++step) {
    const int chunk = p.reverse ? p.chunks - 1 - step : step;
    if (p.causal) read(chunk);
    update(chunk);
  }
  if (!p.causal)
    for (int chunk = 0; chunk < p.chunks; ++chunk) read(chunk);
}

// The state's rows are split into as few parts as the device's shared memory allows (row -1 in part 0).
template <class T, int D>
cudaError_t run_linear(LinParams p, cudaStream_t stream) {
  using C = LinConfig<T, D>;
  int device = 0, smem_max = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err != cudaSuccess) return err;
  const int rows_max = (smem_max - C::smem_bytes(0)) / C::kRowBytes;
  if (rows_max < 1) return cudaErrorInvalidConfiguration;
  const int parts = p.second ? cdiv(D, rows_max) : 1;
  p.rows_per_part = p.second ? cdiv(D, parts) : 0;
  const int64_t blocks = static_cast<int64_t>(parts) * C::kJ1 * p.B * p.Hkv;
  if (int64_t{p.B} * p.Hkv > 65535) return cudaErrorInvalidConfiguration;
  return launch(linear_kernel<T, D>, dim3(parts * C::kJ1, p.B * p.Hkv), blocks, C::kWarps * 32,
                C::smem_bytes(p.rows_per_part), p, stream);
}

}  // namespace attn
