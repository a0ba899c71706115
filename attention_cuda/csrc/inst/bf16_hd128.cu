#include "../kernels.cuh"

ATTN_REGISTER(__nv_bfloat16, kBF16, 128)
