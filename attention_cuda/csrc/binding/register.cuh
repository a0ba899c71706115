// What one (dtype, head dim) of the build registers. attention_cuda/build.py generates one translation
// unit per pair of its build list, each a single ATTN_REGISTER, so a build can compile a subset
// (setup.py: ATTN_DTYPES, ATTN_HEADDIMS) and the pairs compile in parallel.
#pragma once
#include "../linear/lin_sm90.cuh"
#include "../quadratic/bwd_ws_sm90.cuh"
#include "../quadratic/fwd_sm90.cuh"
#include "registry.h"

namespace attn {
// The launch for the current device: the Hopper kernel (Sm90::run) where the build has sm_90a and it
// covers (T, D), else the mma.sync one (kPortable).
template <class Sm90, cudaError_t (*kPortable)(const Params&, Score, cudaStream_t)>
cudaError_t run_on_device(const Params& p, Score score, cudaStream_t stream) {
#if defined(ATTN_SM90A)
  if constexpr (Sm90::kSupported) {
    if (use_sm90()) return Sm90::run(p, score, stream);
  }
#endif
  return kPortable(p, score, stream);
}

// The Hopper backward of (T, D): warp-specialised or with two warpgroups (quadratic/tiles.h says why).
template <class T, int D>
using Sm90BwdOf = std::conditional_t<Tiles<T, D>::kRow.sm90_bwd_ws, Sm90BwdWs<T, D>, Sm90Bwd<T, D>>;

// What (T, D) registers: the forward and backward for the current device; where build.py gives the
// dtype the linear form (kLinear), its sweep and its chunked kernels (sm_90a builds) where D's row in
// quadratic/tiles.h has them.
template <class T, int D, bool kLinear>
Kernels kernels_of() {
  constexpr HeadDimTiles kRow = Tiles<T, D>::kRow;
  static_assert(D <= kRowMaxDim, "the row passes around the tiled kernels take head dims up to kRowMaxDim "
                "(quadratic/params.h): a larger head dim in build.py's HEAD_DIMS needs them wider first");
  Kernels k{&run_on_device<Sm90Fwd<T, D>, &run_fwd<T, D>>, &run_on_device<Sm90BwdOf<T, D>, &run_bwd<T, D>>, nullptr,
            nullptr, nullptr};
  if constexpr (kLinear) {
    static_assert(sizeof(T) == 2, "the linear form's kernels run in fp16 and bf16");
    if constexpr (kRow.sweep) k.lin = &run_linear<T, D>;
#if defined(ATTN_SM90A)
    if constexpr (kRow.chunked) k.state = &run_lin_state<T, D>, k.read = &run_lin_read<T, D>;
#endif
  }
  return k;
}
}  // namespace attn

// T: the C++ element type, DTYPE: its attn::Dtype, D: the head dim, LINEAR: whether the linear form is
// compiled for the dtype (all from build.py's DTYPES and HEAD_DIMS).
#define ATTN_REGISTER(T, DTYPE, D, LINEAR)                                                                       \
  namespace {                                                                                                    \
  const bool registered = attn::register_kernels(attn::Dtype::DTYPE, D, attn::kernels_of<T, D, LINEAR>()); \
  }
