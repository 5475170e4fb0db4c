// Counters that are zero whenever a call starts, kept per call site, so that
// a call needs no memset launch before its kernel.
//
// The Marlin kernel's locks and the prefill kernel's per-tile arrival
// counters must be zero when a kernel starts, and every kernel leaves them at
// zero again (the last block of a tile resets its counter). XLA hands a call
// its buffers uninitialized, so until now the launcher zeroed them on the
// stream first: a second launch per matmul (about 0.7 µs of a CUDA graph,
// more on a stream), which also keeps the kernel from overlapping the
// previous one (programmatic dependent launch). Counters zeroed once and
// owned by the call site stay zero from call to call instead.
//
// One ZeroedCounters belongs to one custom call of one executable (XLA FFI's
// per-call-site state, made at instantiation), with a buffer per device:
// XLA runs one call site's launches on a device in stream order, never two
// at once, so the counters are never shared by kernels in flight together.
// Two call sites never share counters either, even when XLA runs them
// concurrently.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <mutex>
#include <string>

#include "marlin_launch.h"
#include "xla/ffi/api/ffi.h"

namespace jax_marlin {

class ZeroedCounters {
 public:
  // XLA FFI's id of this state type, assigned when the type is registered
  // (jax_marlin/_ffi.py, before the handler).
  static xla::ffi::TypeId id;

  ZeroedCounters() = default;
  ZeroedCounters(const ZeroedCounters &) = delete;
  ZeroedCounters &operator=(const ZeroedCounters &) = delete;
  ~ZeroedCounters();

  // At least `count` int32 counters on the current device, zero now and
  // after every kernel that uses them. Allocated and zeroed on first use,
  // also when XLA captures the call into a CUDA graph (the allocation and the
  // zeroing are not part of the graph). Sets *counters to null and returns
  // why if they cannot be had; the caller then zeroes a buffer of its own.
  std::string get(int64_t count, int **counters);

 private:
  std::mutex mutex_;
  int *buffer_[marlin::kMaxDevices] = {};
  int64_t count_[marlin::kMaxDevices] = {};
};

}  // namespace jax_marlin
