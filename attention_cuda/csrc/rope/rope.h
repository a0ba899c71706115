// RoPE around the attention (rope.cu): the model's fused qkv projection in, the kernels' q and k out, and the
// gradients back in one pass each way. Rotation of pairs (x_i, x_{i + D/2}) by angles whose cos and sin are
// the tables' rows, in fp32, rounded once to the element type, as model.attention's reference does.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "../common/params.h"

namespace attn {

struct RopeParams {
  int B, T, H, Hkv, D;  // qkv rows hold H query heads, then Hkv key heads, then Hkv value heads, of D each
  const float* cos;     // (T, D / 2), contiguous: the rotation of each of qkv's T positions
  const float* sin;
  void* qkv;            // (B, T, (H + 2 Hkv) D), the head dim contiguous: read by split, written by merge
  int64_t qkv_sb, qkv_st;
  void* q;              // (B, H, T, D) (split: written, contiguous; merge: read, with strides qs)
  void* k;              // (B, Hkv, T, D)
  const void* v;        // merge only: (B, Hkv, T, D)
  RowStrides qs, ks, vs;
};

// q, k = rotate(qkv's query and key heads), in the layout the attention kernels read.
cudaError_t run_rope_split(Dtype dtype, const RopeParams& p, cudaStream_t stream);
// qkv = [rotate^-1(q), rotate^-1(k), v]: the gradient of split (with v's) from the attention's dq, dk, dv.
cudaError_t run_rope_merge(Dtype dtype, const RopeParams& p, cudaStream_t stream);

}  // namespace attn
