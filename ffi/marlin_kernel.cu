// The launcher of the Marlin FP16/BF16 x INT4 GEMM: checks the problem, picks
// the tile and the kernel instantiation (marlin_instance.cu), and splits large
// batches into launches. The kernel itself is in marlin_kernel.cuh; see there
// and NOTICE for its origin and license (Apache-2.0).
#include "marlin_kernel.h"

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

#include "decode_kernel.h"
#include "marlin_launch.h"
#include "prefill_sm90.h"

namespace marlin {
namespace {

// Which kernels the launcher may pick on sm_90, for measurements against the
// Marlin kernel: JAX_MARLIN_DECODE=0 keeps m <= 16 off the decode kernel, and
// "cw,kw,s" forces a decode configuration; JAX_MARLIN_PREFILL=0 keeps m >= 64
// off the prefill kernel; JAX_MARLIN_PDL=0 turns the decode kernel's
// programmatic dependent launch off. Read once per process.
struct KernelPolicy {
  bool decode = true;
  bool prefill = true;
  bool pdl = true;
  DecodeConfig forced;
};

const KernelPolicy &kernel_policy() {
  static const KernelPolicy policy = [] {
    KernelPolicy p;
    auto off = [](const char *name) {
      const char *v = std::getenv(name);
      return v && std::string(v) == "0";
    };
    p.decode = !off("JAX_MARLIN_DECODE");
    p.prefill = !off("JAX_MARLIN_PREFILL");
    p.pdl = !off("JAX_MARLIN_PDL");
    if (const char *v = std::getenv("JAX_MARLIN_DECODE"))
      if (std::sscanf(v, "%d,%d,%d", &p.forced.cw, &p.forced.kw, &p.forced.s) != 3)
        p.forced = DecodeConfig{};
    return p;
  }();
  return policy;
}

template <typename scalar_t, bool has_zeros>
std::string launch_group(int group_blocks, const ThreadConfig &c, int thread_m_blocks,
                         const LaunchArgs &p) {
  switch (group_blocks) {
    case 2: return launch_tile<scalar_t, 2, has_zeros>(c, thread_m_blocks, p);
    case 4: return launch_tile<scalar_t, 4, has_zeros>(c, thread_m_blocks, p);
    case 8: return launch_tile<scalar_t, 8, has_zeros>(c, thread_m_blocks, p);
    case -1: return launch_tile<scalar_t, -1, has_zeros>(c, thread_m_blocks, p);
    default: return "jax_marlin: no kernel for group_blocks = " + std::to_string(group_blocks);
  }
}

template <typename scalar_t>
std::string launch_zeros(int group_blocks, const ThreadConfig &c, int thread_m_blocks,
                         const LaunchArgs &p) {
  return p.zeros ? launch_group<scalar_t, true>(group_blocks, c, thread_m_blocks, p)
                 : launch_group<scalar_t, false>(group_blocks, c, thread_m_blocks, p);
}

}  // namespace

std::string matmul(const void *A, const void *B, const void *s, const void *zeros,
                   const void *bias, void *C, int64_t m, int64_t n, int64_t k, int64_t group_size,
                   bool bf16, int *workspace, float *reduce_scratch, cudaStream_t stream) {
  if (std::string why = check_problem(m, n, k, group_size); !why.empty())
    return "jax_marlin: " + why;
  if (m == 0) return {};

  int device;
  const DeviceInfo *device_attrs;
  if (std::string why = current_device(&device, &device_attrs); !why.empty()) return why;
  const DeviceInfo &info = *device_attrs;
  if (info.major < 8)
    return "jax_marlin: the Marlin kernel needs compute capability 8.0 or newer, this device has " +
           std::to_string(info.major) + "." + std::to_string(info.minor);

  // On Hopper, decode batch sizes run on the decode kernel (one launch, no
  // scratch) where it was measured faster, and batches of 64 rows and more
  // on the wgmma prefill kernel.
  const KernelPolicy &policy = kernel_policy();
  if (info.major == 9 && m <= kDecodeMaxM && policy.decode) {
    const DecodeConfig config = policy.forced.valid()
                                    ? policy.forced
                                    : choose_decode_config(m, n, k, group_size, info.sms);
    if (config.valid())
      return decode_matmul(A, B, s, zeros, bias, C, m, n, k, group_size, bf16, config, policy.pdl,
                           stream);
  }
  if (info.major == 9 && info.minor == 0 && policy.prefill && prefill_supported(m, n, k, group_size))
    return prefill_matmul(A, B, s, zeros, bias, C, m, n, k, group_size, bf16, workspace,
                          reduce_scratch, stream);

  // The locks must be zero when the kernel starts; each launch leaves them at
  // zero again, so one memset per call covers every launch below. The fp32
  // scratch needs no initial value: the first block of a tile writes it.
  if (cudaError_t error = cudaMemsetAsync(workspace, 0, marlin_locks_size(m, n) * sizeof(int), stream))
    return cuda_error("cudaMemsetAsync", error);

  const ThreadConfig &config = *choose_config(m, n, k);
  const int group_blocks = group_size == -1 ? -1 : int(group_size / kTile);
  // One thread block per SM, at most kMaxBlocks: the slot reduction gives
  // each block a slot of the scratch (marlin_scratch_size).
  LaunchArgs p{static_cast<const int4 *>(A), static_cast<const int4 *>(B),
               static_cast<int4 *>(C), reduce_scratch, static_cast<const int4 *>(s),
               static_cast<const int4 *>(zeros), static_cast<const int4 *>(bias), 0, int(n), int(k), workspace,
               info.sms < kMaxBlocks ? info.sms : kMaxBlocks,
               info.max_shared, device, stream};

  // Batches of more than 64 rows run as up to kMaxPar blocks of 64 rows in
  // parallel inside one launch; a remainder of fewer than 64 rows gets its
  // own launch with a smaller m tile (the kernel handles partial 16-row
  // blocks). Launches follow each other on the stream, so each reuses the
  // locks (left at zero) and the fp32 scratch from its start.
  const int64_t m_blocks_total = (m + 15) / 16;
  const int64_t pad = 16 * m_blocks_total - m;
  for (int64_t i = 0; i < m_blocks_total; i += 4) {
    int64_t thread_m_blocks = m_blocks_total - i;
    int64_t rows = m - 16 * i;
    int64_t par = 1;
    if (thread_m_blocks > 4) {
      par = (16 * thread_m_blocks - pad) / 64;
      if (par > kMaxPar) par = kMaxPar;
      rows = 64 * par;
      i += 4 * (par - 1);
      thread_m_blocks = 4;
    }
    p.m = int(rows);
    std::string why = bf16 ? launch_zeros<nv_bfloat16>(group_blocks, config, int(thread_m_blocks), p)
                           : launch_zeros<half>(group_blocks, config, int(thread_m_blocks), p);
    if (!why.empty()) return why;
    p.A += 16 * thread_m_blocks * (k / 8) * par;
    p.C += 16 * thread_m_blocks * (n / 8) * par;
  }
  return {};
}

}  // namespace marlin
