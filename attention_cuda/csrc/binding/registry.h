// The kernels each compiled (dtype, head dim) registers at load time (binding/register.cuh, one generated
// translation unit per pair: attention_cuda/build.py), and the lookups the ops make (binding.cpp). Plain
// C++ (no torch headers).
#pragma once
#include <cstdint>
#include <vector>

#include <cuda_runtime.h>

#include "../common/params.h"
#include "../linear/params.h"
#include "../quadratic/params.h"
#include "../score/score.cuh"

namespace attn {

using FwdFn = cudaError_t (*)(const Params&, Score, cudaStream_t);
using BwdFn = cudaError_t (*)(const Params&, Score, cudaStream_t);
using LinFn = cudaError_t (*)(LinParams, cudaStream_t);
using LinStateFn = cudaError_t (*)(const LinStateParams&, cudaStream_t);
using LinReadFn = cudaError_t (*)(const LinReadParams&, cudaStream_t);

// Each compiled (dtype, head dim) registers its kernels at load time; builds may compile a subset. The
// linear form exists for the dtypes build.py marks linear (fp16 and bf16; lin is null for fp32), its
// chunked Hopper kernels (state, read) where the build has them (sm_90a, fp16/bf16, d64 and d128; null
// elsewhere).
struct Kernels {
  FwdFn fwd;
  BwdFn bwd;
  LinFn lin;
  LinStateFn state;
  LinReadFn read;
};
bool register_kernels(Dtype dtype, int head_dim, const Kernels& kernels);
bool find_kernels(Dtype dtype, int head_dim, FwdFn* fwd, BwdFn* bwd, LinFn* lin = nullptr);
std::vector<int64_t> compiled_head_dims(Dtype dtype);
// The chunked kernels, where registered and the Hopper kernels run (use_sm90).
bool find_chunked(Dtype dtype, int head_dim, LinStateFn* state, LinReadFn* read);
// Whether to run the Hopper (wgmma) kernels where they are built (macro ATTN_SM90A): on a compute
// capability 9.0 device, unless the environment sets ATTN_PORTABLE_KERNELS=1 (the mma.sync kernels).
bool use_sm90();

}  // namespace attn
