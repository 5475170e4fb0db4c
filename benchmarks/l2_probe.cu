// How fast can the SMs pull bytes out of L2 with bulk copies, and does it
// matter that they all read the same bytes?
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -Iffi benchmarks/l2_probe.cu -o l2_probe
//   ./l2_probe
//
// The question it answers (benchmarks/NOTES.md, 2026-12-07): at m = 64 the
// prefill kernel's 64-row tiles move 12-16.5 KB per stage and block from L2,
// about 4.5-4.65 TB/s over the chip, half of it the activation tile that
// every block of an m tile reads at about the same moment. If that is what L2
// can deliver, the 64-row tiles are bound by L2 and fewer activation bytes
// per weight byte (wider n tiles, multicast) is the lever; if L2 delivers
// much more, it is not.
//
// One block per SM; its thread 0 keeps `stages` bulk copies of `chunk` bytes
// in flight (cp.async.bulk into a ring of shared memory, each slot on its own
// mbarrier, as the prefill kernel's producer does), and nothing reads them.
// Patterns, each block walking `footprint` bytes in chunks, round and round:
//   shared    every block the same bytes, all starting at offset 0 (the
//             activation tile of an m tile: its blocks request the same
//             lines together);
//   staggered every block the same bytes, block b starting b chunks in;
//   distinct  block b its own `footprint` bytes (all blocks together within
//             L2, then beyond it: HBM for reference).
// Times: bench::time_calls (bench_timing.cuh), the median of 7 rounds after a
// warm-up round (which also brings the L2-sized footprints into L2).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "bench_timing.cuh"
#include "mbarrier.cuh"

namespace {

using bench::check;
using bench::time_calls;
using marlin::bulk_load;
using marlin::mbar_arrive_expect_tx;
using marlin::mbar_init;
using marlin::mbar_wait;
using marlin::smem_addr;

constexpr int kMaxStages = 16;

// Block b reads src + b * block_stride, `iters` chunks, starting `b * start_step`
// chunks into its `footprint` bytes (a multiple of `chunk`) and wrapping.
__global__ void __launch_bounds__(32) probe(const char *src, int64_t block_stride, int64_t footprint,
                                            int chunk, int stages, int iters, int start_step) {
  extern __shared__ __align__(128) char ring[];
  __shared__ __align__(8) uint64_t full[kMaxStages];
  if (threadIdx.x != 0) return;
  for (int s = 0; s < stages; s++) mbar_init(smem_addr(&full[s]), 1);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  const char *base = src + int64_t(blockIdx.x) * block_stride;
  int64_t offset = (int64_t(blockIdx.x) * start_step * chunk) % footprint;
  for (int i = 0; i < iters; i++) {
    const int s = i % stages;
    // The slot's previous copy (round i / stages - 1) has landed.
    if (i >= stages) mbar_wait(smem_addr(&full[s]), (i / stages - 1) & 1);
    mbar_arrive_expect_tx(smem_addr(&full[s]), chunk);
    bulk_load(smem_addr(ring + int64_t(s) * chunk), base + offset, chunk, smem_addr(&full[s]));
    offset += chunk;
    if (offset >= footprint) offset = 0;
  }
  for (int i = iters > stages ? iters - stages : 0; i < iters; i++)
    mbar_wait(smem_addr(&full[i % stages]), (i / stages) & 1);
}

enum Pattern { kShared, kStaggered, kDistinct };

struct Case {
  Pattern pattern;
  int64_t footprint;  // bytes each block walks
  int chunk, stages;
};

const char *name(Pattern p) {
  return p == kShared ? "shared" : p == kStaggered ? "staggered" : "distinct";
}

}  // namespace

int main() {
  int device = 0, sms = 0;
  check(cudaGetDevice(&device), "device");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "attribute");
  cudaDeviceProp prop;
  check(cudaGetDeviceProperties(&prop, device), "properties");
  std::printf("device: %s, %d SMs, L2 %d MB\n", prop.name, sms, prop.l2CacheSize >> 20);
  check(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024), "smem");

  const int64_t kKB = 1024, kMB = 1024 * kKB;
  // A 1 MB footprint is the activations of m = 64, k = 8192 in fp16; the
  // distinct rows fit L2 (sms x 128 KB) or do not (sms x 2 MB).
  const Case cases[] = {
      {kShared, 1 * kMB, 16 * int(kKB), 8},    {kShared, 1 * kMB, 8 * int(kKB), 8},
      {kShared, 1 * kMB, 16 * int(kKB), 4},    {kShared, 64 * kKB, 16 * int(kKB), 8},
      {kStaggered, 1 * kMB, 16 * int(kKB), 8}, {kDistinct, 128 * kKB, 16 * int(kKB), 8},
      {kDistinct, 128 * kKB, 8 * int(kKB), 8}, {kDistinct, 2 * kMB, 16 * int(kKB), 8},
  };
  char *buffer;
  check(cudaMalloc(&buffer, int64_t(sms) * 2 * kMB), "malloc");
  check(cudaMemset(buffer, 1, int64_t(sms) * 2 * kMB), "memset");
  cudaStream_t stream;
  check(cudaStreamCreate(&stream), "stream");

  std::printf("%-10s %10s %8s %7s %10s %9s %8s\n", "pattern", "footprint", "chunk", "stages", "MB moved",
              "us", "TB/s");
  for (const Case &c : cases) {
    const bool distinct = c.pattern == kDistinct;
    const int start_step = c.pattern == kStaggered ? 1 : 0;
    // About 4 MB per block: 0.5 GB in all, tens of microseconds or more.
    const int iters = int(4 * kMB / c.chunk);
    const int shared = c.chunk * c.stages;
    auto one = [&](int) {
      probe<<<sms, 32, shared, stream>>>(buffer, distinct ? c.footprint : 0, c.footprint, c.chunk, c.stages,
                                         iters, start_step);
    };
    const float us = time_calls(one, 20, stream);
    check(cudaGetLastError(), "probe launch");
    const double bytes = double(sms) * iters * c.chunk;
    std::printf("%-10s %8.0fKB %6dKB %7d %10.1f %9.2f %8.3f\n", name(c.pattern), c.footprint / double(kKB),
                c.chunk / int(kKB), c.stages, bytes / 1e6, us, bytes / (us * 1e-6) / 1e12);
  }
  check(cudaStreamSynchronize(stream), "probe");
  cudaFree(buffer);
  return 0;
}
