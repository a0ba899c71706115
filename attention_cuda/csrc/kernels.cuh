// One translation unit per (dtype, head dim) instantiates the forward and backward kernels and
// registers them, so a build can compile a subset (setup.py: ATTN_DTYPES, ATTN_HEADDIMS).
#pragma once
#include "bwd_sm90.cuh"
#include "fwd_sm90.cuh"
#include "lin_sm90.cuh"

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

template <class T, int D>
constexpr LinFn linear_fn() {
  if constexpr (sizeof(T) == 2) {
    return &run_linear<T, D>;
  } else {
    return nullptr;
  }
}

// The chunked linear form's kernels where they are built: sm_90a, fp16/bf16, the head dims whose
// w = [v, 1] width (D + 8) has a wgmma instance (wgmma.cuh).
template <class T, int D>
bool register_chunked_kernels(Dtype dtype) {
#if defined(ATTN_SM90A)
  if constexpr (sizeof(T) == 2 && (D == 64 || D == 128)) return register_chunked(dtype, D, &run_lin_state<T, D>,
                                                                                  &run_lin_read<T, D>);
#endif
  return false;
}
}  // namespace attn

#define ATTN_REGISTER(T, DTYPE, D)                                                                              \
  namespace {                                                                                                   \
  const bool registered = attn::register_kernels(                                                               \
      attn::Dtype::DTYPE, D, &attn::run_on_device<attn::Sm90Fwd<T, D>, &attn::run_fwd<T, D>>,                   \
      &attn::run_on_device<attn::Sm90Bwd<T, D>, &attn::run_bwd<T, D>>, attn::linear_fn<T, D>());                \
  const bool chunked = attn::register_chunked_kernels<T, D>(attn::Dtype::DTYPE);                                \
  }
