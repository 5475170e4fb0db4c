#include "zeroed_counters.h"

namespace jax_marlin {

xla::ffi::TypeId ZeroedCounters::id = {};

ZeroedCounters::~ZeroedCounters() {
  // XLA destroys the state with its executable, after the executable's last
  // run; cudaFree waits for work still using the buffer.
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess) return;
  for (int device = 0; device < marlin::kMaxDevices; ++device) {
    if (!buffer_[device]) continue;
    if (cudaSetDevice(device) == cudaSuccess) cudaFree(buffer_[device]);
  }
  cudaSetDevice(current);
  cudaGetLastError();
}

std::string ZeroedCounters::get(int64_t count, int **counters) {
  *counters = nullptr;
  int device;
  if (cudaError_t error = cudaGetDevice(&device)) return marlin::cuda_error("cudaGetDevice", error);
  if (device < 0 || device >= marlin::kMaxDevices) return "jax_marlin: device ordinal out of range";
  std::lock_guard<std::mutex> lock(mutex_);
  if (buffer_[device]) {
    // A call site's shapes are fixed, so its count is too.
    if (count_[device] < count)
      return "jax_marlin: this call site's counters hold " + std::to_string(count_[device]) +
             ", needs " + std::to_string(count);
    *counters = buffer_[device];
    return {};
  }
  // The first call may run while XLA captures the stream into a CUDA graph
  // (a command buffer), and capture forbids cudaMalloc on this thread.
  // Relaxed mode allows it; the zeroing runs on a stream of its own, which
  // is not captured, and is finished before the kernel is enqueued.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  if (cudaError_t error = cudaThreadExchangeStreamCaptureMode(&mode))
    return marlin::cuda_error("cudaThreadExchangeStreamCaptureMode", error);
  const size_t bytes = size_t(count > 0 ? count : 1) * sizeof(int);
  int *buffer = nullptr;
  cudaStream_t stream = nullptr;
  const char *what = "cudaMalloc";
  cudaError_t error = cudaMalloc(reinterpret_cast<void **>(&buffer), bytes);
  if (!error) {
    what = "cudaStreamCreateWithFlags";
    error = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  }
  if (!error) {
    what = "cudaMemsetAsync";
    error = cudaMemsetAsync(buffer, 0, bytes, stream);
  }
  if (!error) {
    what = "cudaStreamSynchronize";
    error = cudaStreamSynchronize(stream);
  }
  if (stream) cudaStreamDestroy(stream);
  if (error) {
    if (buffer) cudaFree(buffer);
    // Not the launcher's error to report after its kernel: the caller
    // falls back to zeroing a buffer of its own.
    cudaGetLastError();
  }
  cudaThreadExchangeStreamCaptureMode(&mode);
  if (error) return marlin::cuda_error(what, error);
  buffer_[device] = buffer;
  count_[device] = count;
  *counters = buffer;
  return {};
}

}  // namespace jax_marlin
