// What every kernel and the binding share: the element types and the row conventions. Plain C++ (no
// torch headers), so the .cu files build without torch. The kernels' own parameters are by role:
// quadratic/params.h (the tiled kernels and their row passes), linear/params.h (the linear form).
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

namespace attn {

enum class Dtype { kF16, kBF16, kF32 };

// Float row vectors over (batch, head, row) are stored with rows padded to a multiple of 4 so that every
// tile of them starts 16-byte aligned for cp.async. The pad entries are written too (as for an empty
// row), so the backward never reads an unwritten value.
inline int pad4(int n) { return (n + 3) / 4 * 4; }

// Element strides of batch, head and row of (B,H,n,D) rows whose head dim is contiguous.
struct RowStrides {
  int64_t b, h, i;
  // Elements from the start to (batch, head)'s first row.
  __host__ __device__ int64_t offset(int batch, int head) const { return batch * b + head * h; }
};

constexpr float kNormEps = 1e-12f;  // same clamp as torch.nn.functional.normalize

}  // namespace attn
