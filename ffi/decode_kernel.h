// The decode kernel: C[m, n] = A[m, k] @ dequant(B, s, z) + bias for m <= 16 on
// Hopper (sm_90), reading the same packed MarlinWeight as the Marlin kernel
// (marlin_kernel.h states the layout). Plain C++ interface, no XLA, no Python.
//
// Why a second kernel: at decode batch sizes the product is a stream of the
// weights, and its time should be their bytes over the memory bandwidth. The
// Marlin kernel (built for m up to 64 per tile, one block per SM, a cp.async
// pipeline and a cross-block reduction through locks in global memory) pays a
// fixed cost per call that dominates layers of a few MB, and a lock memset
// launch besides. This kernel streams the weights straight into registers
// from many warps per SM, splits k over the blocks of a thread-block cluster
// and reduces the fp32 partial sums through distributed shared memory: one
// launch, no workspace, deterministic.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "marlin_problem.h"

namespace marlin {

// How one decode launch splits the work: `cw` 64-column chunks per block (one
// warp each) times `kw` warps along k per block, and `s` blocks along k per
// cluster. Every warp streams k / (s * kw) rows of one 64-column chunk.
struct DecodeConfig {
  int cw = 0, kw = 0, s = 0;
  bool valid() const { return cw > 0; }
};

// Empty if `config` can run [m, k] x [k, n] with this group size (the shape
// rules of check_problem hold already), otherwise why not.
std::string check_decode_config(const DecodeConfig &config, int64_t m, int64_t n, int64_t k,
                                int64_t group_size);

// The configuration the launcher uses for this problem on a device with `sms`
// multiprocessors; invalid if the decode kernel does not take it.
DecodeConfig choose_decode_config(int64_t m, int64_t n, int64_t k, int64_t group_size, int sms);

// Act-order: whether the decode kernel, run with `config` (invalid: not run),
// gathers x's permuted columns itself as it loads x, rather than read x from
// a permutation pass the launcher runs before it.
bool decode_gathers(const DecodeConfig &config, int64_t m, int64_t n, int64_t k);

// Launches the decode kernel on `stream` (the caller has checked the problem
// with check_problem and that the device is sm_90). With `pdl` the launch may
// start while the previous kernel on the stream finishes (programmatic
// dependent launch): it prefetches its first weights into L2, then waits for
// that kernel before it reads anything else. `zeros` are the packed zero
// points (marlin_kernel.h), or null for zero point 8; `perm` the act-order
// permutation of A's columns (int32 [k]), gathered as A is loaded, or null.
// `fusion` (marlin_problem.h): the RMSNorm or SwiGLU prologue, applied to A
// in shared memory (not with a perm), and the residual added to C.
// Returns an empty string on success, otherwise a description of the failure.
std::string decode_matmul(const void *A, const void *B, const void *s, const void *zeros,
                          const int *perm, const void *bias, void *C, int64_t m, int64_t n,
                          int64_t k, int64_t group_size, bool bf16, const DecodeConfig &config,
                          bool pdl, cudaStream_t stream, const Fusion &fusion = {});

}  // namespace marlin
