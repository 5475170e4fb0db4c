// Plain C++ interface of the Marlin FP16/BF16 x INT4 GEMM (no XLA, no Python).
//
//   C[m, n] = A[m, k] @ dequant(B, s, z) + bias     A, C: fp16 or bf16, row-major
//
// B is the 4-bit weight in Marlin's packed layout, int32 [k / 16, 2 * n]; s the
// scales (A's dtype), [k / group_size, n] (group_size 32, 64 or 128) or [1, n]
// (group_size -1, one scale per column), in Marlin's permuted order;
// jax_marlin/packing.py writes both. zeros are the 4-bit zero points, int32
// [k / group_size (or 1), n / 8] in the order packing.py states, or null for
// zero point 8. perm (act-order) is int32 [k]: the product is then
// A[:, perm] @ dequant(B, s, z), the weight's rows being stored in that order;
// null for none. bias is [n] in A's dtype, or null. `fusion`
// (marlin_problem.h) adds an RMSNorm or SwiGLU prologue on A and a residual
// on C.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "marlin_problem.h"

namespace marlin {

// Launches the GEMM on `stream`. `workspace` holds workspace_size(m, n) int32s
// of counters, which must be zero when a kernel starts; every kernel leaves
// them zero. With `workspace_zeroed` the caller vouches that they are (a
// buffer zeroed once and used only by calls in stream order), otherwise the
// launcher zeroes them on the stream first, a second launch where a split
// needs them. `reduce_scratch` holds
// reduce_scratch_size(m, n, k, perm != null) floats (no initial value needed):
// thread blocks that share an output tile sum their partial results there in
// fp32, and with a perm or a prologue (reduce_scratch_size's x_copy) the A
// the kernel multiplies is written there. Returns
// an empty string on success, otherwise a description of the failure
// (nothing is thrown).
std::string matmul(const void *A, const void *B, const void *s, const void *zeros,
                   const int *perm, const void *bias, void *C,
                   int64_t m, int64_t n, int64_t k, int64_t group_size, bool bf16,
                   int *workspace, float *reduce_scratch, cudaStream_t stream,
                   bool workspace_zeroed = false, const Fusion &fusion = {});

}  // namespace marlin
