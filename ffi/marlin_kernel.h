// Plain C++ interface of the Marlin FP16xINT4 GEMM (no XLA, no Python).
//
//   C[m, n] = A[m, k] @ dequant(B, s)       A, C: fp16, row-major
//
// B is the 4-bit weight in Marlin's packed layout, int32 [k / 16, 2 * n]; s the
// fp16 scales, [k / group_size, n] (group_size 128) or [1, n] (group_size -1,
// one scale per column), in Marlin's permuted order. jax_marlin/packing.py
// writes both.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "marlin_problem.h"

namespace marlin {

// Launches the GEMM on `stream`. `workspace` holds workspace_size(n) int32s;
// it is zeroed on the stream before the first launch. Returns an empty string
// on success, otherwise a description of the failure (nothing is thrown).
std::string matmul(const void *A, const void *B, const void *s, void *C,
                   int64_t m, int64_t n, int64_t k, int64_t group_size,
                   int *workspace, cudaStream_t stream);

}  // namespace marlin
