// One translation unit per (dtype, head dim) instantiates the forward and backward kernels and
// registers them, so a build can compile a subset (setup.py: ATTN_DTYPES, ATTN_HEADDIMS).
#pragma once
#include "bwd.cuh"
#include "fwd.cuh"

#define ATTN_REGISTER(T, DTYPE, D)                                                                    \
  namespace {                                                                                         \
  const bool registered = attn::register_kernels(attn::Dtype::DTYPE, D, &attn::run_fwd<T, D>,          \
                                                 &attn::run_bwd<T, D>);                               \
  }
