// The scratch buffers of one call, whichever kernel the CUDA launcher picks
// for it (the Marlin kernel, the decode kernel, which needs none, or the
// prefill kernel): XLA allocates them as extra results of the custom call, so
// their sizes must be known at trace time. Plain C++: the CPU build exports
// them to Python as well.
#pragma once

#include <cstdint>

#include "marlin_problem.h"
#include "prefill_rules.h"

namespace marlin {

// int32 counters: the Marlin kernel's locks or the prefill kernel's per-tile
// arrival counters (the launcher zeroes them on the stream).
inline int64_t workspace_size(int64_t m, int64_t n) {
  const int64_t locks = marlin_locks_size(m, n);
  const int64_t counters = m >= kPrefillMinM ? prefill_counters_size(m, n) : 0;
  return locks > counters ? locks : counters;
}

// float32 partial sums handed between thread blocks that share output tiles;
// with `x_copy` (act-order, or an RMSNorm or SwiGLU prologue), after them
// (from a 32-byte boundary), the x the kernels multiply: the prologue's x'
// in the weight's row order ([m, k] of 16-bit values, m k / 2 floats' room),
// for the kernels that read x with whole-row copies (the decode kernel
// gathers a permuted x and runs the prologues as it loads x).
inline int64_t partials_size(int64_t m, int64_t n, int64_t k) {
  const int64_t marlin = marlin_scratch_size(m, n);
  const int64_t prefill = m >= kPrefillMinM ? prefill_partials_size(m, n, k) : 0;
  return marlin > prefill ? marlin : prefill;
}

inline int64_t permuted_x_offset(int64_t m, int64_t n, int64_t k) {
  return (partials_size(m, n, k) + 7) / 8 * 8;
}

inline int64_t reduce_scratch_size(int64_t m, int64_t n, int64_t k, bool x_copy) {
  return x_copy ? permuted_x_offset(m, n, k) + (m * k + 1) / 2 : partials_size(m, n, k);
}

// A chain of calls in one custom call (jax_marlin_post_attention) gives each
// call its own region of the workspace and of the scratch: each region's
// size rounded up to 32 elements (128 bytes), so every region starts on a
// 128-byte boundary as XLA's buffers do.
inline int64_t chained_size(int64_t elements) { return (elements + 31) / 32 * 32; }

}  // namespace marlin
