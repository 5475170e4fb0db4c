// Between the launcher (marlin_kernel.cu) and the kernel instantiations
// (marlin_instance.cu, compiled once per element type and group size so that
// the 128 kernels build in parallel).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <string>

#include "marlin_problem.h"

namespace marlin {

constexpr int kMaxDevices = 64;

// "jax_marlin: <what> failed: <name> (<description>)", for the launcher and the launches.
inline std::string cuda_error(const char *what, cudaError_t error) {
  return std::string("jax_marlin: ") + what + " failed: " + cudaGetErrorName(error) + " (" +
         cudaGetErrorString(error) + ")";
}

// One launch: a batch block of at most 64 kMaxPar rows.
struct LaunchArgs {
  const int4 *A;     // [m, k] activations
  const int4 *B;     // [k / 16, 2 n] packed weight
  int4 *C;           // [m, n] output
  float *C_tmp;      // marlin_scratch_size(m, n) fp32 partial sums
  const int4 *s;     // scales
  const int4 *bias;  // [n] or null
  int m, n, k;
  int *locks;        // marlin_locks_size(m, n), zero at launch
  int blocks;        // grid size: one block per SM
  int max_shared;    // opt-in shared memory per block on this device, bytes
  int device;
  cudaStream_t stream;
};

// Launches the kernel for `config` and thread_m_blocks (1..4) with elements
// of type scalar_t (half or nv_bfloat16) and group_blocks = group_size / 16
// (or -1). Defined in marlin_kernel.cuh, instantiated in marlin_instance.cu.
template <typename scalar_t, int group_blocks>
std::string launch_tile(const ThreadConfig &config, int thread_m_blocks, const LaunchArgs &p);

}  // namespace marlin
