// Plain C++ interface of the Hopper (sm_90a) prefill kernel: the Marlin
// FP16/BF16 x INT4 GEMM for batches of 64 rows and more, on wgmma tensor cores
// (no XLA, no Python).
//
//   C[m, n] = A[m, k] @ dequant(B, s, z) + bias     A, C: fp16 or bf16, row-major
//
// It reads the same packed weight as the Marlin kernel (marlin_kernel.h): B int32
// [k / 16, 2 n] and s [k / group_size, n] (or [1, n]) in Marlin's permuted
// order, as jax_marlin/packing.py writes them, and the packed zero points z
// (marlin_kernel.h), or null for zero point 8.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "prefill_rules.h"

namespace marlin {

// The configuration for a problem on a device with `sms` multiprocessors: a
// cost model of waves of thread blocks times k stages per block
// (prefill_sm90.cu), a start for a table measured per shape.
PrefillConfig prefill_choose(int64_t m, int64_t n, int64_t k, int sms);

// Launches C = A @ dequant(B, s) + bias on `stream` with the chosen
// configuration. `counters` holds prefill_counters_size(m, n) int32s and
// `partials` prefill_partials_size(m, n, k) floats (no initial values needed).
// Split and stream-K launches need the counters zero and leave them zero:
// with `counters_zeroed` the caller vouches that they are, otherwise the
// launcher zeroes them on the stream first (a second launch).
// A, B, s and zeros must be 16-byte aligned. With `pdl` the launch may start
// while the previous kernel on the stream finishes (programmatic dependent
// launch): it requests its first weights, then waits for that kernel before
// it reads A. Returns an empty string on success, otherwise a description of
// the failure (nothing is thrown).
std::string prefill_matmul(const void *A, const void *B, const void *s, const void *zeros,
                           const void *bias, void *C, int64_t m, int64_t n, int64_t k,
                           int64_t group_size, bool bf16, int *counters, float *partials,
                           cudaStream_t stream, bool pdl = false, bool counters_zeroed = false);

// The same with a given configuration (for measurements and tests). It runs
// any m >= 1 and any k, n that are multiples of 64 (k of the group size).
std::string prefill_matmul_config(const PrefillConfig &config, const void *A, const void *B,
                                  const void *s, const void *zeros, const void *bias, void *C,
                                  int64_t m, int64_t n, int64_t k, int64_t group_size, bool bf16,
                                  int *counters, float *partials, cudaStream_t stream,
                                  bool pdl = false, bool counters_zeroed = false);

}  // namespace marlin
