// One translation unit per (dtype, head dim) instantiates the forward and backward kernels and
// registers them, so a build can compile a subset (setup.py: ATTN_DTYPES, ATTN_HEADDIMS).
#pragma once
#include "bwd_sm90.cuh"
#include "fwd_sm90.cuh"
#include "linear.cuh"

namespace attn {
template <class T, int D>
constexpr LinFn linear_fn() {
  if constexpr (sizeof(T) == 2) {
    return &run_linear<T, D>;
  } else {
    return nullptr;
  }
}
}  // namespace attn

#define ATTN_REGISTER(T, DTYPE, D)                                                                   \
  namespace {                                                                                        \
  const bool registered = attn::register_kernels(attn::Dtype::DTYPE, D, &attn::run_fwd_any<T, D>,     \
                                                 &attn::run_bwd_any<T, D>, attn::linear_fn<T, D>()); \
  }
