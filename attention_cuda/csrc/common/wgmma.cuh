// Hopper (sm_90a) building blocks: warpgroup MMA (wgmma) on operands in 64-byte-swizzled shared memory.
//
// One layout serves every tile: rows of D elements are cut into panels of 32 columns (64 bytes); a
// panel holds its rows back to back, and the 16-byte chunk c of row r sits at chunk c ^ ((r >> 1) & 3)
// (the hardware's 64-byte swizzle, so ldmatrix-free wgmma reads and cp.async writes are both free of
// bank conflicts). Such a tile can be read either way round:
//   - K-major, the reduction along the columns (Q K^T: k = head dim): a 16-column step stays within a
//     panel, 8-row groups lie 512 bytes apart;
//   - MN-major, the reduction along the rows (P V: k = keys): 8-row groups 512 bytes apart, panels of
//     32 output columns one panel stride apart.
// The accumulator of m64nNk16 gives each warp of the warpgroup 16 rows in exactly the mma.sync m16n8
// layout (d[n][0..3] = (g, 8n+2t..+1), (g+8, 8n+2t..+1)), and a register A operand is the mma.sync
// m16k16 A fragment: so the per-element code of the mma.sync kernels runs unchanged on these
// fragments, and c_to_a feeds P and dS back into the next product.
#pragma once
#include <cudaTypedefs.h>  // the driver's tensor-map types (the entry point is fetched at run time)

#include "mma.cuh"
#include "params.h"

namespace attn {

// Swizzled tiles start at multiples of 1024 bytes (the swizzle pattern's period): a kernel's layout starts
// at swizzle_base of its dynamic shared memory, which starts 16-byte aligned, so getting there costs at
// most kSwizzleSlack bytes.
constexpr int kSwizzleSlack = 1024 - 16;
__device__ __forceinline__ uint32_t swizzle_base(const void* smem) { return (smem_u32(smem) + 1023) & ~1023u; }

// A tile of `rows` rows in the swizzled panel layout; at() has the interface of Tile::at.
struct SwTile {
  uint32_t base;  // 1024-byte aligned
  int rows;
  __device__ __forceinline__ uint32_t at(int row, int byte) const {
    const int chunk = (byte >> 4) & 3;
    return base + (byte >> 6) * rows * 64 + row * 64 + ((chunk ^ ((row >> 1) & 3)) << 4) + (byte & 15);
  }
  __device__ __forceinline__ int panel_bytes() const { return rows * 64; }
};

// Shared-memory matrix descriptor (PTX ISA, "matrix descriptor format"): start address, leading and
// stride byte offsets (16-byte units), 64-byte swizzle (mode 2). Shared addresses stay below 256 KB,
// so the 14-bit start field holds addr >> 4 unmasked, and an operand's descriptor is its tile's plus
// the offset in the low word (desc_at): one add per wgmma, which the compiler keeps in uniform
// registers when the tile base is warp-uniform (warp_index), instead of rebuilding every field.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lead_bytes, uint32_t stride_bytes) {
  return static_cast<uint64_t>(addr >> 4) | static_cast<uint64_t>((lead_bytes >> 4) & 0x3FFF) << 16 |
         static_cast<uint64_t>((stride_bytes >> 4) & 0x3FFF) << 32 | 2ull << 62;
}
__device__ __forceinline__ uint64_t desc_at(uint64_t d, uint32_t bytes) {
  const uint32_t lo = static_cast<uint32_t>(d) + (bytes >> 4), hi = static_cast<uint32_t>(d >> 32);
  return static_cast<uint64_t>(hi) << 32 | lo;
}
// The 64-row x 16-column (K-major) block of t at (row0, col0): an A or B operand read along its columns.
__device__ __forceinline__ uint64_t desc_k(const SwTile& t, int row0, int col0, int elem_bytes) {
  const int byte = col0 * elem_bytes;
  return desc_at(smem_desc(t.base, 16, 512), (byte >> 6) * t.panel_bytes() + row0 * 64 + (byte & 63));
}
// The 16-row block of t at row0, all columns from panel `panel0` on (MN-major): an operand read along
// its rows.
__device__ __forceinline__ uint64_t desc_mn(const SwTile& t, int row0, int panel0) {
  return desc_at(smem_desc(t.base, t.panel_bytes(), 512), panel0 * t.panel_bytes() + row0 * 64);
}
// stmatrix: four 8x8 matrices of 16-bit values, one register of each per thread (the m16n8 accumulator
// layout); lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void stsm_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}
// The warp's index, broadcast from lane 0 so that the compiler knows it is the same across the warp:
// what is derived from it (the warpgroup's tile offsets, hence the descriptors) then lives in uniform
// registers. From threadIdx.x / 32 alone every descriptor went through vector registers and an R2UR
// per wgmma, and desc_at's one add per wgmma pays off only where the base is uniform (without this,
// desc_at had slowed the d64 forward; bench/notes/run-16.md).
__device__ __forceinline__ int warp_index() { return __shfl_sync(0xffffffffu, threadIdx.x / 32, 0); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Generic-proxy writes to shared memory (st.shared, cp.async) become visible to wgmma's reads (the
// async proxy) after this fence and a barrier.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Keeps the compiler from moving reads or writes of an accumulator across wgmma_wait / wgmma_fence.
template <int kN>
__device__ __forceinline__ void fence_acc(float (&d)[kN][4]) {
#pragma unroll
  for (int n = 0; n < kN; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[n][e])::"memory");
}

// d (64 x N, fp32, accumulate != 0 adds to it) += A B with A (64 x 16) and B (16 x N) in shared memory
// (wgmma_ss; kTA / kTB = 1: the operand is MN-major) or A in registers (wgmma_rs). One overload per
// (N, element type); the PTX type goes in as a string.

// Accumulator operand lists: N/2 fp32 registers per thread, numbered first, in 4-register tiles
// (N = D + 8 carries the row sums after D / 8 tiles of O).
#define ATTN_ACC(n) "+f"(d[n][0]), "+f"(d[n][1]), "+f"(d[n][2]), "+f"(d[n][3])
#define ATTN_R0_15 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define ATTN_R16_31 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define ATTN_R32_47 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
#define ATTN_R48_63 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define ATTN_D32_REGS "{" ATTN_R0_15 "}"
#define ATTN_D32_OPS ATTN_ACC(0), ATTN_ACC(1), ATTN_ACC(2), ATTN_ACC(3)
#define ATTN_D64_REGS "{" ATTN_R0_15 ", " ATTN_R16_31 "}"
#define ATTN_D64_OPS ATTN_D32_OPS, ATTN_ACC(4), ATTN_ACC(5), ATTN_ACC(6), ATTN_ACC(7)
#define ATTN_D72_REGS "{" ATTN_R0_15 ", " ATTN_R16_31 ", %32, %33, %34, %35}"
#define ATTN_D72_OPS ATTN_D64_OPS, ATTN_ACC(8)
#define ATTN_D128_REGS "{" ATTN_R0_15 ", " ATTN_R16_31 ", " ATTN_R32_47 ", " ATTN_R48_63 "}"
#define ATTN_D128_OPS \
  ATTN_D64_OPS, ATTN_ACC(8), ATTN_ACC(9), ATTN_ACC(10), ATTN_ACC(11), ATTN_ACC(12), ATTN_ACC(13), ATTN_ACC(14), \
      ATTN_ACC(15)
#define ATTN_D136_REGS "{" ATTN_R0_15 ", " ATTN_R16_31 ", " ATTN_R32_47 ", " ATTN_R48_63 ", %64, %65, %66, %67}"
#define ATTN_D136_OPS ATTN_D128_OPS, ATTN_ACC(16)

// I0..I6: the operand numbers after the N/2 accumulators (inline asm numbers outputs first).
#define ATTN_WGMMA(N, TY, PT, I0, I1, I2, I3, I4, I5, I6)                                                      \
  template <int kTA, int kTB>                                                                                  \
  __device__ __forceinline__ void wgmma_ss(float(&d)[N / 8][4], uint64_t da, uint64_t db, int accumulate, TY) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" I2 ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N         \
                 "k16.f32." PT "." PT " " ATTN_D##N##_REGS ", %" I0 ", %" I1 ", p, 1, 1, %" I3 ", %" I4 ";\n}\n"  \
                 : ATTN_D##N##_OPS                                                                             \
                 : "l"(da), "l"(db), "r"(accumulate), "n"(kTA), "n"(kTB));                                     \
  }                                                                                                            \
  template <int kTB>                                                                                           \
  __device__ __forceinline__ void wgmma_rs(float(&d)[N / 8][4], const uint32_t(&a)[4], uint64_t db, int accumulate, \
                                           TY) {                                                               \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" I5 ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N         \
                 "k16.f32." PT "." PT " " ATTN_D##N##_REGS ", {%" I0 ", %" I1 ", %" I2 ", %" I3 "}, %" I4      \
                 ", p, 1, 1, %" I6 ";\n}\n"                                                                    \
                 : ATTN_D##N##_OPS                                                                             \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate), "n"(kTB));           \
  }

ATTN_WGMMA(32, __nv_bfloat16, "bf16", "16", "17", "18", "19", "20", "21", "22")
ATTN_WGMMA(32, __half, "f16", "16", "17", "18", "19", "20", "21", "22")
ATTN_WGMMA(64, __nv_bfloat16, "bf16", "32", "33", "34", "35", "36", "37", "38")
ATTN_WGMMA(64, __half, "f16", "32", "33", "34", "35", "36", "37", "38")
ATTN_WGMMA(72, __nv_bfloat16, "bf16", "36", "37", "38", "39", "40", "41", "42")
ATTN_WGMMA(72, __half, "f16", "36", "37", "38", "39", "40", "41", "42")
ATTN_WGMMA(128, __nv_bfloat16, "bf16", "64", "65", "66", "67", "68", "69", "70")
ATTN_WGMMA(128, __half, "f16", "64", "65", "66", "67", "68", "69", "70")
ATTN_WGMMA(136, __nv_bfloat16, "bf16", "68", "69", "70", "71", "72", "73", "74")
ATTN_WGMMA(136, __half, "f16", "68", "69", "70", "71", "72", "73", "74")
#undef ATTN_WGMMA

// ---------------------------------------------------------------------------------------------------
// Asynchronous loads: TMA tensor copies and bulk copies complete on mbarriers (transaction counts),
// which consumers wait on by phase parity; warpgroups hand the register file over with setmaxnreg and
// take turns through named barriers.
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes initialised barriers visible to the async proxy (TMA's completions); a block barrier follows.
__device__ __forceinline__ void mbar_fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Arrives and adds `bytes` to the transactions the current phase waits for.
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Adds `bytes` to the transactions the current phase waits for, without arriving.
__device__ __forceinline__ void mbar_add_tx(uint32_t bar, int bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Blocks until the phase with this parity has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(bar), "r"(parity)
                 : "memory");
  }
}
// One box of a 4-D tensor map at coordinates (c0 innermost .. c3) into shared memory at dst.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1, int c2,
                                            int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}
// Rows row0.. of (head, b) through `map` into a swizzled tile, one box per 64-byte panel of its kPanels.
template <int kPanels>
__device__ __forceinline__ void tma_load_tile(const SwTile& dst, const CUtensorMap* map, uint32_t bar, int row0,
                                              int head, int b) {
#pragma unroll
  for (int c = 0; c < kPanels; ++c) tma_load_4d(dst.base + c * dst.panel_bytes(), map, bar, 32 * c, row0, head, b);
}
// `bytes` (a multiple of 16) from 16-byte aligned global memory into shared memory at dst.
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, int bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
// `bytes` (a multiple of 16) of fp32 values from shared memory at src added to global memory at dst,
// elementwise, by the TMA unit (a bulk async-group: commit, then wait for the reads of src before
// reusing it).
__device__ __forceinline__ void bulk_reduce_add(float* dst, uint32_t src, int bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst), "r"(src),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Host: a 4-D tensor map over x (rows, heads, batch) of D-element rows, the head dim contiguous, with
// strides xs, read in boxes of 32 columns x box_rows rows, each landing as one panel
// of the 64-byte swizzled layout above. False where TMA cannot describe the tensor (alignment,
// strides), or the driver has no tensor maps: the caller keeps a kernel that loads without them.
inline bool make_tensor_map(CUtensorMap* map, const void* x, bool bf16, int D, int rows, int heads, int batch,
                            RowStrides xs, int box_rows) {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  if (encode == nullptr) return false;
  // A dimension of size 1 is never stepped over; its stride only has to pass the encoder's checks.
  auto stride = [](int64_t s, int n) { return static_cast<cuuint64_t>(n == 1 ? 16 : s * 2); };
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(D), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(batch)};
  const cuuint64_t strides[3] = {stride(xs.i, rows), stride(xs.h, heads), stride(xs.b, batch)};
  const cuuint32_t box[4] = {32, static_cast<cuuint32_t>(box_rows), 1, 1}, step[4] = {1, 1, 1, 1};
  return encode(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
                const_cast<void*>(x), dims, strides, box, step, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_64B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace attn
