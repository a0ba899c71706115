// How many clusters of two 384-thread blocks with ~220 KB of shared memory each fit at once (and blocks alone).
#include <cstdio>
#include <cuda_runtime.h>
__global__ void __launch_bounds__(384, 1) k(int* x) { extern __shared__ char s[]; if (x) x[0] = s[threadIdx.x]; }
int main() {
  int dev = 0; cudaDeviceProp prop; cudaGetDeviceProperties(&prop, dev);
  for (int smem : {203 * 1024, 220 * 1024}) {
    cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    for (int cl : {1, 2, 4}) {
      cudaLaunchConfig_t c = {}; c.gridDim = dim3(264); c.blockDim = dim3(384); c.dynamicSmemBytes = smem;
      cudaLaunchAttribute a; a.id = cudaLaunchAttributeClusterDimension; a.val.clusterDim.x = cl; a.val.clusterDim.y = 1; a.val.clusterDim.z = 1;
      c.attrs = &a; c.numAttrs = 1; int n = -1;
      cudaError_t e = cudaOccupancyMaxActiveClusters(&n, k, &c);
      printf("%s, %d SMs, smem %d KB, cluster %d: %d clusters = %d blocks (%s)\n", prop.name, prop.multiProcessorCount, smem / 1024, cl, n, n * cl, cudaGetErrorString(e));
    }
  }
}
