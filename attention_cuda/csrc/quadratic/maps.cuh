// Host: the TMA maps (common/wgmma.cuh, make_tensor_map) over the Hopper quadratic kernels' operands.
#pragma once
#include "../common/wgmma.cuh"
#include "params.h"

namespace attn {

enum class Operand { kQ, kK, kV, kDout };

// A map over operand x of the call, read in boxes of `box` rows; false where TMA cannot describe the
// tensor (alignment, strides), and the caller keeps its mma.sync kernel.
template <class T, int D>
bool operand_map(CUtensorMap* map, const Params& p, Operand x, int box) {
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  switch (x) {
    case Operand::kQ: return make_tensor_map(map, p.q, kBf16, D, p.I, p.H, p.B, p.qs, box);
    case Operand::kK: return make_tensor_map(map, p.k, kBf16, D, p.J, p.Hkv, p.B, p.ks, box);
    case Operand::kV: return make_tensor_map(map, p.v, kBf16, D, p.J, p.Hkv, p.B, p.vs, box);
    case Operand::kDout: return make_tensor_map(map, p.dout, kBf16, D, p.I, p.H, p.B, p.dos, box);
  }
  return false;
}

}  // namespace attn
