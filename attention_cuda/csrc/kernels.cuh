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

// What (T, D) registers: the forward and backward for the current device, the linear form's sweep for
// fp16/bf16, and its chunked kernels where they are built: sm_90a, fp16/bf16, the head dims whose
// w = [v, 1] width (D + 8) has a wgmma instance (wgmma.cuh).
template <class T, int D>
Kernels kernels_of() {
  Kernels k{&run_on_device<Sm90Fwd<T, D>, &run_fwd<T, D>>, &run_on_device<Sm90Bwd<T, D>, &run_bwd<T, D>>, nullptr,
            nullptr, nullptr};
  if constexpr (sizeof(T) == 2) k.lin = &run_linear<T, D>;
#if defined(ATTN_SM90A)
  if constexpr (sizeof(T) == 2 && (D == 64 || D == 128)) k.state = &run_lin_state<T, D>, k.read = &run_lin_read<T, D>;
#endif
  return k;
}
}  // namespace attn

#define ATTN_REGISTER(T, DTYPE, D) \
  namespace {                      \
  const bool registered = attn::register_kernels(attn::Dtype::DTYPE, D, attn::kernels_of<T, D>()); \
  }
