// Kernel launches with programmatic dependent launch (PDL, sm_90): the
// decode and prefill kernels (decode_kernel.cu, prefill_sm90.cu) and the
// act-order and prologue passes (marlin_kernel.cu). With `pdl` a kernel's
// blocks may start while the kernel before it on the stream finishes; each
// kernel waits for that one (griddepcontrol.wait) before it reads anything
// it may write. Without `pdl` a plain launch; callers pass `pdl` only on sm_90
// (before it the device functions below compile to nothing).
#pragma once

#include <cuda_runtime.h>

namespace marlin {

// In a kernel launched with PDL: waits for the kernel before it on the stream
// to finish and its writes to be visible (a no-op after a plain launch).
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Lets the kernel after this one on the stream, if launched with PDL, start
// now (it must wait for this one before it reads anything this one writes).
__device__ __forceinline__ void grid_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n");
#endif
}

// Launches kernel<<<grid, block, shared, stream>>>(args...), in clusters of
// `cluster` blocks along x where cluster > 0, and returns the launch's error
// (or cudaSuccess).
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared,
                          cudaStream_t stream, bool pdl, unsigned cluster, Args &&...args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared;
  config.stream = stream;
  cudaLaunchAttribute attrs[2];
  unsigned count = 0;
  if (cluster > 0) {
    attrs[count].id = cudaLaunchAttributeClusterDimension;
    attrs[count].val.clusterDim.x = cluster;
    attrs[count].val.clusterDim.y = 1;
    attrs[count].val.clusterDim.z = 1;
    count++;
  }
  if (pdl) {
    attrs[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[count].val.programmaticStreamSerializationAllowed = 1;
    count++;
  }
  config.attrs = attrs;
  config.numAttrs = count;
  if (cudaError_t error = cudaLaunchKernelEx(&config, kernel, static_cast<Args &&>(args)...))
    return error;
  return cudaGetLastError();
}

}  // namespace marlin
