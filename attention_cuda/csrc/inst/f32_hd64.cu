#include "../kernels.cuh"

ATTN_REGISTER(float, kF32, 64)
