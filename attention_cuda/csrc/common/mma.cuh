// Warp-level tensor-core building blocks (mma.sync, sm_80+), shared by the forward and backward kernels.
//
// Every product is written in k16 steps: 16 elements of the reduction dim. For fp16/bf16 that is one
// m16n8k16 instruction; for fp32 inputs (run as TF32, 10-bit mantissa, fp32 accumulation) it is two
// m16n8k8 instructions. A fragment is loaded from a shared-memory tile that is either stored
// "straight" (the fragment's own row-major layout: lda, ldb2) or "transposed" (ldb2_t, lda_t).
// Shared-memory rows are padded by 16 bytes, which makes every ldmatrix phase conflict-free.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace attn {

__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// A row-major tile in shared memory: byte address of row 0 and the row pitch in bytes.
struct Tile {
  uint32_t base;
  int pitch;
  __device__ __forceinline__ uint32_t at(int row, int byte) const { return base + row * pitch + byte; }
};

// ---------------------------------------------------------------------------------------------------
// Asynchronous copies global -> shared (cp.async, sm_80+). src_bytes < 16 zero-fills the rest, so
// rows past the end of a sequence arrive as zeros and need no separate branch.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Copy a (kRows x kRowBytes) tile whose rows lie `src_pitch` bytes apart; rows >= valid are zero-filled
// (and read nothing: their source address is the always-valid `fallback`). Fully unrolled: the chunk
// a thread copies is a compile-time function of its index.
template <int kRows, int kRowBytes, int kThreads, class Dst>  // Dst: Tile, or SwTile (wgmma.cuh)
__device__ __forceinline__ void cp_tile(Dst dst, const char* src, int64_t src_pitch, int valid,
                                        const void* fallback) {
  constexpr int kChunks = kRowBytes / 16, kTotal = kRows * kChunks;
#pragma unroll
  for (int i = 0; i < (kTotal + kThreads - 1) / kThreads; ++i) {
    const int c = threadIdx.x + i * kThreads;
    if (kTotal % kThreads == 0 || c < kTotal) {
      const int r = c / kChunks, x = c % kChunks;
      const bool ok = r < valid;
      cp_async16(dst.at(r, x * 16), ok ? src + r * src_pitch + x * 16 : fallback, ok ? 16 : 0);
    }
  }
}

// Copy n floats (n a multiple of 4, src 16-byte aligned) with entries >= valid zero-filled.
template <int kN>
__device__ __forceinline__ void cp_floats(uint32_t dst, const float* src, int valid) {
  const int c = threadIdx.x;
  if (c < kN / 4) {
    const bool ok = c * 4 < valid;
    cp_async16(dst + c * 16, ok ? src + c * 4 : src, ok ? 16 : 0);
  }
}

// ---------------------------------------------------------------------------------------------------
// Shared-memory loads.
__device__ __forceinline__ void ldsm_x4(uint32_t* r, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t* r, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x2_t(uint32_t* r, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
}
__device__ __forceinline__ uint32_t lds32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ void sts32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v));
}
__device__ __forceinline__ void sts64(uint32_t addr, uint32_t a, uint32_t b) {
  asm volatile("st.shared.v2.b32 [%0], {%1, %2};\n" ::"r"(addr), "r"(a), "r"(b));
}
__device__ __forceinline__ void sts128(uint32_t addr, float a, float b, float c, float d) {
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "f"(a), "f"(b), "f"(c), "f"(d));
}
__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr));
  return v;
}

__device__ __forceinline__ float ex2(float x) {  // 2^x on the SFU; ex2(-inf) = 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// fp32 atomics of four neighbouring floats, 16-byte aligned (sm_90).
__device__ __forceinline__ void red_add4(float* p, float a, float b, float c, float d) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}
// fp32 atomics of two neighbouring floats (one vector reduction on sm_90).
__device__ __forceinline__ void red_add2(float* p, float a, float b) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(a), "f"(b) : "memory");
#else
  atomicAdd(p, a);
  atomicAdd(p + 1, b);
#endif
}

// ---------------------------------------------------------------------------------------------------
// Element traits: conversions between fp32 and the storage type.
template <class T>
struct Elem;
template <>
struct Elem<__half> {
  __device__ static float to_float(__half x) { return __half2float(x); }
  __device__ static __half from_float(float x) { return __float2half_rn(x); }
  __device__ static uint32_t pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ static float2 unpack(uint32_t v) { return __half22float2(*reinterpret_cast<__half2*>(&v)); }
};
template <>
struct Elem<__nv_bfloat16> {
  __device__ static float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ static __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
  __device__ static uint32_t pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ static float2 unpack(uint32_t v) {  // bf16 -> fp32 is a shift: two integer ops
    return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
  }
};
template <>
struct Elem<float> {
  __device__ static float to_float(float x) { return x; }
  __device__ static float from_float(float x) { return x; }
};

// A pair of values as the tensor cores see them once converted to T (fp32 inputs run as TF32). bf16:
// one packing conversion per value, of (x, 0), whose 32 bits are bf16(x) as fp32, so nothing unpacks:
// one instruction fewer per pair than one conversion for both and two integer ops back
// (bench/notes/run-41.md). fp16: one packing conversion serves both, and back is a widening half add
// (HADD2.F32). Neither uses the conversion unit, which the backward's exps need (bench/notes/run-16.md).
template <class T>
__device__ __forceinline__ float2 round_for_mma(float2 x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    uint32_t r0, r1;
    asm("cvt.rn.bf16x2.f32 %0, %1, 0f00000000;\n" : "=r"(r0) : "f"(x.x));
    asm("cvt.rn.bf16x2.f32 %0, %1, 0f00000000;\n" : "=r"(r1) : "f"(x.y));
    return make_float2(__uint_as_float(r0), __uint_as_float(r1));
  } else if constexpr (sizeof(T) == 2) {
    return Elem<T>::unpack(Elem<T>::pack(x.x, x.y));
  } else {
    uint32_t r0, r1;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r0) : "f"(x.x));
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r1) : "f"(x.y));
    return make_float2(__uint_as_float(r0), __uint_as_float(r1));
  }
}

// Sum of the squares of the 16 bytes of T elements in u, in fp32.
template <class T>
__device__ __forceinline__ float sum_squares(uint4 u) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (sizeof(T) == 2) {
      const float2 f = Elem<T>::unpack(w[i]);
      s += f.x * f.x + f.y * f.y;
    } else {
      const float f = __uint_as_float(w[i]);
      s += f * f;
    }
  }
  return s;
}

// Store the pair (row, col), (row, col + 1) of fp32 values as T into a shared tile.
template <class T>
__device__ __forceinline__ void sts_pair(uint32_t addr, float a, float b) {
  if constexpr (sizeof(T) == 2) {
    sts32(addr, Elem<T>::pack(a, b));
  } else {
    sts64(addr, __float_as_uint(a), __float_as_uint(b));
  }
}
template <class T>
__device__ __forceinline__ float2 lds_pair(uint32_t addr) {
  if constexpr (sizeof(T) == 2) {
    return Elem<T>::unpack(lds32(addr));
  } else {
    return make_float2(__uint_as_float(lds32(addr)), __uint_as_float(lds32(addr + 4)));
  }
}
// The same for global memory (pairs of T are 4- or 8-byte aligned: columns are even).
template <class T>
__device__ __forceinline__ void stg_pair(T* p, float a, float b) {
  if constexpr (sizeof(T) == 2) {
    *reinterpret_cast<uint32_t*>(p) = Elem<T>::pack(a, b);
  } else {
    *reinterpret_cast<float2*>(p) = make_float2(a, b);
  }
}

// ---------------------------------------------------------------------------------------------------
// Fragment layouts (g = lane / 4, t = lane % 4), per the PTX ISA:
//   accumulator m16n8 (fp32):  c0, c1 = (row g, cols 2t, 2t+1); c2, c3 = (row g+8, same cols)
//   A m16 x k16: kA registers;  B k16 x n8: kB registers.
// An accumulator pair covering 16 columns converts to an A fragment with those columns as k
// (c_to_a): that is how P and dS feed the next product without a trip through shared memory.
template <class T>
struct Mma {  // fp16 / bf16: mma.m16n8k16
  static_assert(sizeof(T) == 2, "16-bit types only; fp32 has its own specialisation");
  static constexpr int kA = 4, kB = 2;

  __device__ static void mma(float* c, const uint32_t* a, const uint32_t* b) {
    if constexpr (std::is_same<T, __half>::value) {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
          "{%0,%1,%2,%3};\n"
          : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    } else {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
          "{%0,%1,%2,%3};\n"
          : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
  }
  // A (m16 x k16) from [m][k] storage, rows m0.., elements k0..
  __device__ static void lda(uint32_t* a, Tile s, int m0, int k0) {
    const int l = lane_id();
    ldsm_x4(a, s.at(m0 + (l & 15), (k0 + (l >> 4) * 8) * 2));
  }
  // A from [k][m] storage (A transposed in memory); any tile with at(row, byte) (a swizzled one too)
  template <class S>
  __device__ static void lda_t(uint32_t* a, S s, int k0, int m0) {
    const int l = lane_id();
    ldsm_x4_t(a, s.at(k0 + (l & 7) + (l >> 4) * 8, (m0 + ((l >> 3) & 1) * 8) * 2));
  }
  // Two B (k16 x n8) fragments, columns n0..n0+15, from [n][k] storage
  __device__ static void ldb2(uint32_t* b0, uint32_t* b1, Tile s, int n0, int k0) {
    const int l = lane_id();
    uint32_t r[4];
    ldsm_x4(r, s.at(n0 + (l & 7) + (l >> 4) * 8, (k0 + ((l >> 3) & 1) * 8) * 2));
    b0[0] = r[0], b0[1] = r[1], b1[0] = r[2], b1[1] = r[3];
  }
  // Two B fragments from [k][n] storage
  __device__ static void ldb2_t(uint32_t* b0, uint32_t* b1, Tile s, int k0, int n0) {
    const int l = lane_id();
    uint32_t r[4];
    ldsm_x4_t(r, s.at(k0 + (l & 7) + ((l >> 3) & 1) * 8, (n0 + (l >> 4) * 8) * 2));
    b0[0] = r[0], b0[1] = r[1], b1[0] = r[2], b1[1] = r[3];
  }
  // One B fragment from [k][n] storage
  __device__ static void ldb1_t(uint32_t* b, Tile s, int k0, int n0) {
    const int l = lane_id();
    ldsm_x2_t(b, s.at(k0 + (l & 7) + ((l >> 3) & 1) * 8, n0 * 2));
  }
  __device__ static void c_to_a(uint32_t* a, const float* c0, const float* c1) {
    a[0] = Elem<T>::pack(c0[0], c0[1]);
    a[1] = Elem<T>::pack(c0[2], c0[3]);
    a[2] = Elem<T>::pack(c1[0], c1[1]);
    a[3] = Elem<T>::pack(c1[2], c1[3]);
  }
  // A B fragment of ones: C += A * ones puts the row sums of A (as rounded) in every column of C.
  __device__ static void ones_b(uint32_t* b) {
    b[0] = b[1] = Elem<T>::pack(1.f, 1.f);
  }
};

// fp32 inputs: TF32 tensor cores (m16n8k8, operands rounded to 10-bit mantissas, fp32 accumulation).
// ldmatrix moves 32-bit elements in pairs of b16, which works for the straight layouts but cannot
// transpose them, so the transposed loads are scalar. Those pair with A fragments made from
// accumulators, which hold columns (2t, 2t+1) rather than the (t, t+4) the k8 instruction names: the
// reduction is a sum, so both operands simply use the k order (2t, 2t+1) (a permutation of 0..7).
template <>
struct Mma<float> {
  static constexpr int kA = 8, kB = 4;

  __device__ static uint32_t tf32(uint32_t x) {
    uint32_t r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(__uint_as_float(x)));
    return r;
  }
  __device__ static void mma8(float* c, const uint32_t* a, const uint32_t* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  __device__ static void mma(float* c, const uint32_t* a, const uint32_t* b) {
    mma8(c, a, b);
    mma8(c, a + 4, b + 2);
  }
  __device__ static void lda(uint32_t* a, Tile s, int m0, int k0) {
    const int l = lane_id();
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      ldsm_x4(a + 4 * w, s.at(m0 + (l & 15), (k0 + w * 8 + (l >> 4) * 4) * 4));
#pragma unroll
      for (int i = 0; i < 4; ++i) a[4 * w + i] = tf32(a[4 * w + i]);
    }
  }
  __device__ static void lda_t(uint32_t* a, Tile s, int k0, int m0) {
    const int l = lane_id(), g = l >> 2, t = l & 3;
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      const int k = k0 + w * 8 + 2 * t;
      a[4 * w + 0] = tf32(lds32(s.at(k, (m0 + g) * 4)));
      a[4 * w + 1] = tf32(lds32(s.at(k, (m0 + g + 8) * 4)));
      a[4 * w + 2] = tf32(lds32(s.at(k + 1, (m0 + g) * 4)));
      a[4 * w + 3] = tf32(lds32(s.at(k + 1, (m0 + g + 8) * 4)));
    }
  }
  __device__ static void ldb2(uint32_t* b0, uint32_t* b1, Tile s, int n0, int k0) {
    const int l = lane_id();
    ldsm_x4(b0, s.at(n0 + (l & 7), (k0 + (l >> 3) * 4) * 4));
    ldsm_x4(b1, s.at(n0 + 8 + (l & 7), (k0 + (l >> 3) * 4) * 4));
#pragma unroll
    for (int i = 0; i < 4; ++i) b0[i] = tf32(b0[i]), b1[i] = tf32(b1[i]);
  }
  __device__ static void ldb1_t(uint32_t* b, Tile s, int k0, int n0) {
    const int l = lane_id(), g = l >> 2, t = l & 3;
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      const int k = k0 + w * 8 + 2 * t;
      b[2 * w + 0] = tf32(lds32(s.at(k, (n0 + g) * 4)));
      b[2 * w + 1] = tf32(lds32(s.at(k + 1, (n0 + g) * 4)));
    }
  }
  __device__ static void ldb2_t(uint32_t* b0, uint32_t* b1, Tile s, int k0, int n0) {
    ldb1_t(b0, s, k0, n0);
    ldb1_t(b1, s, k0, n0 + 8);
  }
  __device__ static void c_to_a(uint32_t* a, const float* c0, const float* c1) {
    const float* c[2] = {c0, c1};
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      a[4 * w + 0] = tf32(__float_as_uint(c[w][0]));
      a[4 * w + 1] = tf32(__float_as_uint(c[w][2]));
      a[4 * w + 2] = tf32(__float_as_uint(c[w][1]));
      a[4 * w + 3] = tf32(__float_as_uint(c[w][3]));
    }
  }
  __device__ static void ones_b(uint32_t* b) {
#pragma unroll
    for (int i = 0; i < kB; ++i) b[i] = __float_as_uint(1.f);
  }
};

}  // namespace attn
