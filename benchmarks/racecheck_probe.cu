// Does compute-sanitizer's racecheck see mbarrier ordering between a
// consumer's shared-memory reads and a later cp.async.bulk write into the same
// buffer? The prefill kernel (ffi/prefill_sm90.cuh) runs that pattern, and
// racecheck reports WAR hazards on it; this kernel runs it alone, correct by
// construction, so a report on modes 0 and 1 is the tool's, not a race.
// Measured (benchmarks/results/h100-h200-2026-12-06-registers-prologue.txt,
// section G): 3472 WAR hazards in mode 0 and in mode 1, right sums in both;
// mode 2 was not reached in that run. (Measured with this kernel before its
// tidy-up: the same copies, barriers and sums.)
//
//   mode 0: a two-stage ring of 1 KiB stages, as in the prefill kernel: one
//           producer thread waits on a stage's `empty` mbarrier, then
//           cp.async.bulk-copies into it (completing on `full`); a consumer
//           warp waits on `full`, reads the stage, and its lane 0 arrives on
//           `empty`;
//   mode 1: the same with fence.proxy.async.shared::cta before the arrive;
//   mode 2: a real race: the producer never waits on `empty` (wrong sums).
//
//   nvcc -std=c++17 -arch=sm_90 -lineinfo -Iffi benchmarks/racecheck_probe.cu -o racecheck_probe
//   compute-sanitizer --tool racecheck --racecheck-report hazard ./racecheck_probe 0
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "mbarrier.cuh"

namespace {

using marlin::bulk_load;
using marlin::mbar_arrive;
using marlin::mbar_arrive_expect_tx;
using marlin::mbar_init;
using marlin::mbar_wait;
using marlin::smem_addr;

constexpr int kIters = 16;  // stages copied, 64 int4 (1 KiB) each

// 64 threads: warp 0's thread 0 produces, warp 1 consumes; out[lane] = the
// sum of the .x of elements lane and lane + 32 of every stage.
__global__ void ring(const int4 *src, int *out, int mode) {
  __shared__ alignas(128) int4 buf[2][64];
  __shared__ alignas(8) unsigned long long full[2], empty[2];
  if (threadIdx.x == 0) {
    for (int s = 0; s < 2; s++) {
      mbar_init(smem_addr(&full[s]), 1);
      mbar_init(smem_addr(&empty[s]), 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    if (threadIdx.x == 0)
      for (int i = 0; i < kIters; i++) {
        const int s = i % 2;
        if (i >= 2 && mode != 2) mbar_wait(smem_addr(&empty[s]), ((i / 2) - 1) & 1);
        mbar_arrive_expect_tx(smem_addr(&full[s]), 1024);
        bulk_load(smem_addr(buf[s]), src + 64 * i, 1024, smem_addr(&full[s]));
      }
    return;
  }
  const int lane = threadIdx.x % 32;
  int acc = 0;
  for (int i = 0; i < kIters; i++) {
    const int s = i % 2;
    mbar_wait(smem_addr(&full[s]), (i / 2) & 1);
    acc += buf[s][lane].x + buf[s][lane + 32].x;
    __syncwarp();
    if (mode == 1) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    if (lane == 0) mbar_arrive(smem_addr(&empty[s]));
  }
  out[lane] = acc;
}

}  // namespace

int main(int argc, char **argv) {
  const int mode = argc > 1 ? std::atoi(argv[1]) : -1;
  if (mode < 0 || mode > 2) {
    std::fprintf(stderr, "usage: racecheck_probe 0|1|2\n");
    return 2;
  }
  std::vector<int4> host(64 * kIters);
  for (int i = 0; i < 64 * kIters; i++) host[i] = make_int4(i, 0, 0, 0);
  int4 *src;
  int *out;
  cudaMalloc(&src, sizeof(int4) * host.size());
  cudaMalloc(&out, sizeof(int) * 32);
  cudaMemcpy(src, host.data(), sizeof(int4) * host.size(), cudaMemcpyHostToDevice);
  ring<<<1, 64>>>(src, out, mode);
  int sums[32];
  const cudaError_t error = cudaMemcpy(sums, out, sizeof(sums), cudaMemcpyDeviceToHost);
  int wrong = 0;
  for (int lane = 0; lane < 32; lane++) {
    int expected = 0;
    for (int i = 0; i < kIters; i++) expected += (64 * i + lane) + (64 * i + lane + 32);
    wrong += sums[lane] != expected;
  }
  std::printf("mode %d: %s (%s)\n", mode, wrong ? "WRONG sums" : "sums right",
              cudaGetErrorString(error));
  return error != cudaSuccess;
}
