// CUDA error checks and event timing shared by the kernel timers
// (decode_bench.cu, stream_probe.cu, l2_probe.cu, kernel_bench.cu).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace bench {

inline void check(cudaError_t error, const char *what) {
  if (error != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(error));
    std::exit(1);
  }
}

// The launchers' way to fail: an empty string, or why.
inline void check(const std::string &why) {
  if (!why.empty()) {
    std::fprintf(stderr, "%s\n", why.c_str());
    std::exit(1);
  }
}

// Microseconds per call of `trials` timings of `reps` calls of one(i) on
// `stream`, after `warm` untimed calls, sorted.
template <typename F>
std::vector<float> timings(F &&one, int reps, int trials, int warm, cudaStream_t stream) {
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "event");
  check(cudaEventCreate(&stop), "event");
  for (int i = 0; i < warm; ++i) one(i);
  check(cudaStreamSynchronize(stream), "warm-up");
  std::vector<float> us;
  for (int t = 0; t < trials; ++t) {
    check(cudaEventRecord(start, stream), "record");
    for (int i = 0; i < reps; ++i) one(i);
    check(cudaEventRecord(stop, stream), "record");
    check(cudaEventSynchronize(stop), "timed calls");
    float ms;
    check(cudaEventElapsedTime(&ms, start, stop), "elapsed");
    us.push_back(1e3f * ms / reps);
  }
  std::sort(us.begin(), us.end());
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return us;
}

// Median microseconds per call over 7 timings of `reps` calls of one(i),
// after one untimed round.
template <typename F>
float time_calls(F &&one, int reps, cudaStream_t stream) {
  return timings(one, reps, 7, reps, stream)[3];
}

}  // namespace bench
