// Between the launcher (marlin_kernel.cu) and the kernel instantiations
// (marlin_instance.cu, compiled once per element type and group size so that
// the 128 kernels build in parallel).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <mutex>
#include <string>

#include "marlin_problem.h"

namespace marlin {

constexpr int kMaxDevices = 64;

// "jax_marlin: <what> failed: <name> (<description>)", for the launcher and the launches.
inline std::string cuda_error(const char *what, cudaError_t error) {
  return std::string("jax_marlin: ") + what + " failed: " + cudaGetErrorName(error) + " (" +
         cudaGetErrorString(error) + ")";
}

// What the launchers read of a device, once per device (every launcher of
// this library shares the one cache).
struct DeviceInfo {
  cudaError_t error = cudaSuccess;
  int sms = 0;
  int major = 0;
  int minor = 0;
  int max_shared = 0;  // opt-in dynamic shared memory per block, bytes
};

inline const DeviceInfo &device_info(int device) {
  static std::once_flag once[kMaxDevices];
  static DeviceInfo info[kMaxDevices];
  std::call_once(once[device], [device] {
    DeviceInfo &d = info[device];
    (d.error = cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, device)) ||
        (d.error = cudaDeviceGetAttribute(&d.major, cudaDevAttrComputeCapabilityMajor, device)) ||
        (d.error = cudaDeviceGetAttribute(&d.minor, cudaDevAttrComputeCapabilityMinor, device)) ||
        (d.error = cudaDeviceGetAttribute(&d.max_shared,
                                          cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  });
  return info[device];
}

// The current device's ordinal and what the launchers read of it, or why
// either cannot be had.
inline std::string current_device(int *device, const DeviceInfo **info) {
  if (cudaError_t error = cudaGetDevice(device)) return cuda_error("cudaGetDevice", error);
  if (*device < 0 || *device >= kMaxDevices) return "jax_marlin: device ordinal out of range";
  *info = &device_info(*device);
  if ((*info)->error) return cuda_error("cudaDeviceGetAttribute", (*info)->error);
  return {};
}

// One launch: a batch block of at most 64 kMaxPar rows.
struct LaunchArgs {
  const int4 *A;     // [m, k] activations
  const int4 *B;     // [k / 16, 2 n] packed weight
  int4 *C;           // [m, n] output
  float *C_tmp;      // marlin_scratch_size(m, n) fp32 partial sums
  const int4 *s;     // scales
  const int4 *zeros; // packed zero points [groups, n / 8], or null (zero point 8)
  const int4 *bias;  // [n] or null
  int m, n, k;
  int *locks;        // marlin_locks_size(m, n), zero at launch
  int blocks;        // grid size: one block per SM
  int max_shared;    // opt-in shared memory per block on this device, bytes
  int device;
  cudaStream_t stream;
};

// Launches the kernel for `config` and thread_m_blocks (1..4) with elements
// of type scalar_t (half or nv_bfloat16), group_blocks = group_size / 16 (or
// -1) and, with has_zeros, the zero points p.zeros. Defined in
// marlin_kernel.cuh, instantiated in marlin_instance.cu.
template <typename scalar_t, int group_blocks, bool has_zeros>
std::string launch_tile(const ThreadConfig &config, int thread_m_blocks, const LaunchArgs &p);

}  // namespace marlin
