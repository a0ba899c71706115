#include "../kernels.cuh"

ATTN_REGISTER(__half, kF16, 96)
