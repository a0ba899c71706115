// What the host hands cosine's decode kernel (decode/decode.cu): one query row per head over a key cache,
// forward only. Plain C++ (no torch headers).
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

#include "../common/params.h"

namespace attn {

// Head dims the decode kernel takes: multiples of 8 (a lane holds 8 elements of a row) up to 128 (16 lanes
// a row). The extension reports those of the build (decode_head_dims), and the plan sends it no other.
constexpr int kDecodeMaxDim = 128;
constexpr bool decode_takes(int D) { return D > 0 && D % 8 == 0 && D <= kDecodeMaxDim; }

struct DecodeParams {
  int B, H, Hkv, J, D;
  int group;  // H / Hkv query heads per kv head
  // q (B, H, 1, D), k and v (B, Hkv, J, D), each with its strides; every row starts 16-byte aligned.
  const void *q, *k, *v;
  RowStrides qs, ks, vs;
  const uint8_t* mask;  // (B, J) bool, True = keep, contiguous along J; null for none
  int64_t mask_sb;
  // A key's weight is exp2(alpha (q.k) - shift) (log2 units), with q and k scaled to unit rows first when
  // qk_norm: shift = |alpha| bounds every logit of unit rows, so no running max is kept and the parts'
  // sums add as they are.
  float alpha, shift;
  bool qk_norm;
  int splits, split_keys;  // parts of each (batch, kv head)'s keys, and keys per part (the last may be short)
  float* num;              // (B, H, splits, D) fp32: each part's sum of weight x v
  float* den;              // (B, H, splits) fp32: each part's sum of weights
  void* out;               // (B, H, D) in q's dtype: sum num / sum den, 0 where no key is kept
};

// The parts to split the keys of a call with p's shapes and qk_norm into (*splits): as many as one wave of
// the kernel's resident blocks holds, each of at least a few hundred keys.
cudaError_t decode_splits(Dtype dtype, const DecodeParams& p, int* splits);
// The parts' sums (p.num, p.den), then their merge into p.out.
cudaError_t run_decode(Dtype dtype, const DecodeParams& p, cudaStream_t stream);

}  // namespace attn
