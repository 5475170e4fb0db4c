// How fast can the decode kernel's weight stream be, with no arithmetic?
//
//   nvcc -O3 -std=c++17 -arch=sm_90 benchmarks/stream_probe.cu -o stream_probe
//   ./stream_probe
//
// For each layer (k x n, packed int4: k n / 2 bytes) it times, with CUDA
// events over weight copies rotated through > 256 MB (so they come from HBM,
// not the 60 MB L2), kernels that only read the packed weight and fold it into
// a register:
//   contiguous  a grid-stride read of the whole array, 8 x 16 bytes in flight
//               per thread (what a copy's read side can do);
//   pattern     the decode kernel's own walk (decode_kernel.cu): one warp per
//               64-column chunk and range of k, 512 bytes per 16-row step at a
//               stride of n / 2 16-byte words, two windows of 8 steps in
//               registers, the same grid and block shape as the decode
//               kernel's configuration for the layer at m = 1;
//   pattern+256 the same loads with the .L2::256B prefetch qualifier;
//   linear      the same grid, warps and windows, each warp reading its
//               share as one contiguous range (what the walk would cost
//               if the layout put a warp's steps next to each other).
// It also times an empty kernel (launch cost on the stream and in a graph).
//
// Then a Llama-3-8B decode step's weight stream (32 blocks of qkv 4096 x 6144,
// o 4096 x 4096, gate_up 4096 x 28672 and down 14336 x 4096: 3.5 GB, from
// HBM) read in the ways a step could be built, to bound what one persistent
// kernel could save over a kernel per projection:
//   one read      the whole stream as one grid-stride read (the floor);
//   kernels       a grid-stride read kernel per projection, 128 in a CUDA
//                 graph (the step's kernel boundaries, no arithmetic);
//   decode grids  the same with the decode kernel's grids (pattern, m = 1);
//   persistent    one kernel for the step, a grid-wide barrier between
//                 projections (an atomic counter; the grid is resident), the
//                 next projection's first loads issued after the barrier
//                 (late) or before it (early: weights do not depend on the
//                 activations the barrier waits for), with the grid of the
//                 kernels above or one 256-thread block per SM (the decode
//                 kernel's 8 warps per SM);
//   barriers      the persistent kernel's 127 barriers alone.
// Times: bench::time_calls (bench_timing.cuh), the median of 7 rounds.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "bench_timing.cuh"

namespace {

using bench::check;
using bench::time_calls;

template <int kHint>
__device__ inline int4 load(const int4 *p, bool pred) {
  int4 v;
  if constexpr (kHint == 256) {
    asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %5, 0;\n"
                 " @q ld.global.nc.L1::no_allocate.L2::256B.v4.s32 {%0,%1,%2,%3}, [%4];\n}\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p), "r"(int(pred)));
  } else {
    asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %5, 0;\n"
                 " @q ld.global.nc.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];\n}\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p), "r"(int(pred)));
  }
  return v;
}

__device__ inline int fold(const int4 (&w)[8]) {
  int a = 0;
#pragma unroll
  for (int j = 0; j < 8; j++) a ^= w[j].x ^ w[j].y ^ w[j].z ^ w[j].w;
  return a;
}

__global__ void empty_kernel() {}

__global__ void contiguous(const int4 *p, long count, int *out) {
  int a = 0;
  const long stride = long(gridDim.x) * blockDim.x;
  for (long i = blockIdx.x * long(blockDim.x) + threadIdx.x; i < count; i += 8 * stride) {
    int4 w[8];
#pragma unroll
    for (int j = 0; j < 8; j++) w[j] = load<0>(p + i + j * stride, i + j * stride < count);
    a ^= fold(w);
  }
  if (a == 0x1234567) *out = a;
}

// kLinear: each warp's steps are consecutive 512-byte pieces.
template <int kHint, bool kLinear>
__global__ void pattern(const int4 *B, int n, int k, int cw, int kw, int s, int *out) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int cwi = warp % cw, kwi = warp / cw;
  const int chunk = blockIdx.y * cw + cwi;
  const int k_warp = k / (s * kw);
  const int steps = k_warp / 16;
  const int row0 = (blockIdx.x * kw + kwi) * k_warp / 16;
  const long w_stride = kLinear ? 32 : n / 2;
  const int4 *ptr;
  if (kLinear) {
    const long warp_id = (long(chunk) * s + blockIdx.x) * kw + kwi;
    ptr = B + warp_id * steps * 32 + lane;
  } else {
    ptr = B + long(row0) * (n / 2) + 32 * chunk + lane;
  }
  int4 wa[8], wb[8];
  int a = 0;
  auto fill = [&](int4 (&w)[8], int base) {
#pragma unroll
    for (int j = 0; j < 8; j++) w[j] = load<kHint>(ptr + long(base + j) * w_stride, base + j < steps);
  };
  fill(wa, 0);
  fill(wb, 8);
  for (int base = 0; base < steps; base += 16) {
    a ^= fold(wa);
    fill(wa, base + 16);
    a ^= fold(wb);
    fill(wb, base + 24);
  }
  if (a == 0x1234567) *out = a;
}

struct Layer {
  int k, n, cw, kw, s;
};

// Waits until every block of the grid has arrived at this barrier: the
// counter only grows, and `target` is its value once all have (the launch's
// base plus the grid size times the barrier's number). The grid must be
// resident, which the launch ensures by its size.
__device__ inline void grid_barrier(unsigned long long *counter, unsigned long long target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(counter, 1ull);
    unsigned long long seen;
    do {
      asm volatile("ld.acquire.gpu.global.u64 %0, [%1];\n" : "=l"(seen) : "l"(counter) : "memory");
    } while (seen < target);
  }
  __syncthreads();
}

// The step's projections read in turn by one grid, a barrier between them:
// projection L is int4s begin[L] .. begin[L + 1] of `stream`, read as
// `contiguous` reads (8 loads of 16 bytes in flight per thread, one group
// folded while the next is in flight). kEarly: the next projection's first
// loads are issued before the barrier. kRead false: the barriers alone.
template <bool kEarly, bool kRead>
__global__ void persistent_step(const int4 *stream, const long *begin, int layers, unsigned long long *counter,
                                unsigned long long base, int *out) {
  const long stride = long(gridDim.x) * blockDim.x;
  const long t0 = blockIdx.x * long(blockDim.x) + threadIdx.x;
  int a = 0;
  int4 w[8];
  auto fill = [&](int layer, long i) {
    const long count = begin[layer + 1] - begin[layer];
#pragma unroll
    for (int j = 0; j < 8; j++) w[j] = load<0>(stream + begin[layer] + i + j * stride, i + j * stride < count);
  };
  if (kRead) fill(0, t0);
  for (int layer = 0; layer < layers; layer++) {
    const long count = begin[layer + 1] - begin[layer];
    if (kRead) {
      for (long i = t0 + 8 * stride; i < count; i += 8 * stride) {
        int4 v[8];
#pragma unroll
        for (int j = 0; j < 8; j++) v[j] = w[j];
        fill(layer, i);
        a ^= fold(v);
      }
      int4 v[8];
#pragma unroll
      for (int j = 0; j < 8; j++) v[j] = w[j];
      if (kEarly && layer + 1 < layers) fill(layer + 1, t0);
      a ^= fold(v);
    }
    if (layer + 1 < layers) {
      grid_barrier(counter, base + (unsigned long long)(layer + 1) * gridDim.x);
      if (kRead && !kEarly) fill(layer + 1, t0);
    }
  }
  if (a == 0x1234567) *out = a;
}

// An 8B decode step's weight stream, read as one grid-stride read, as a
// kernel per projection in a CUDA graph, and by one persistent kernel
// (persistent_step).
void step_stream(int *out) {
  int sms;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "attribute");
  // qkv, o, gate_up, down with the decode kernel's configurations at m = 1.
  const Layer block[] = {{4096, 6144, 4, 1, 16}, {4096, 4096, 1, 8, 2}, {4096, 28672, 4, 1, 4}, {14336, 4096, 2, 4, 7}};
  constexpr int kBlocks = 32;
  std::vector<long> begin{0};
  for (int b = 0; b < kBlocks; b++)
    for (const Layer &l : block) begin.push_back(begin.back() + long(l.k) * l.n / 32);
  const int layers = int(begin.size()) - 1;
  const size_t bytes = size_t(begin.back()) * 16;
  int4 *stream;
  long *begin_d;
  unsigned long long *counter;
  check(cudaMalloc(&stream, bytes), "malloc stream");
  check(cudaMemset(stream, 0x11, bytes), "memset");
  check(cudaMalloc(&begin_d, begin.size() * sizeof(long)), "malloc");
  check(cudaMemcpy(begin_d, begin.data(), begin.size() * sizeof(long), cudaMemcpyHostToDevice), "copy");
  check(cudaMalloc(&counter, 8), "malloc");
  check(cudaMemset(counter, 0, 8), "memset");
  int resident;
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, persistent_step<true, true>, 256, 0), "occupancy");
  const int per_sm = std::min(resident, 4);
  const int grid = sms * per_sm;
  std::printf("\nLlama-3-8B decode step's weights: %d projections, %.1f MB (%.1f MB a block), from HBM; grid %d x "
              "256 (%d a SM)\n",
              layers, bytes / 1e6, bytes / 1e6 / kBlocks, grid, per_sm);
  std::printf("%-34s %10s %12s %8s\n", "read", "us a step", "us a block", "TB/s");
  auto row = [&](const char *name, float us) {
    std::printf("%-34s %10.1f %12.2f %8.3f\n", name, us, us / kBlocks, bytes / us / 1e6);
  };
  row("one read", time_calls([&](int) { contiguous<<<grid, 256>>>(stream, long(bytes / 16), out); }, 5, 0));
  cudaStream_t st;
  check(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "stream");
  auto graph_of = [&](auto launch) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    check(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal), "capture");
    for (int layer = 0; layer < layers; layer++) launch(layer);
    check(cudaStreamEndCapture(st, &g), "end capture");
    check(cudaGraphInstantiate(&ge, g, 0), "instantiate");
    return ge;
  };
  cudaGraphExec_t kernels = graph_of([&](int layer) {
    contiguous<<<grid, 256, 0, st>>>(stream + begin[layer], begin[layer + 1] - begin[layer], out);
  });
  row("kernels (graph)", time_calls([&](int) { check(cudaGraphLaunch(kernels, st), "graph"); }, 5, st));
  cudaGraphExec_t decode_grids = graph_of([&](int layer) {
    const Layer &l = block[layer % 4];
    pattern<0, false><<<dim3(l.s, l.n / 64 / l.cw), 32 * l.cw * l.kw, 0, st>>>(stream + begin[layer], l.n, l.k, l.cw,
                                                                               l.kw, l.s, out);
  });
  row("kernels, decode grids (graph)", time_calls([&](int) { check(cudaGraphLaunch(decode_grids, st), "graph"); }, 5, st));
  // The counter only grows: each launch starts from the value the previous
  // left (grid times barriers).
  unsigned long long base = 0;
  auto persistent = [&](auto kernel, int g) {
    // A grid barrier waits for every block: a grid larger than what stays
    // resident of this instance (its registers may differ from the one the
    // grid was sized for) would never return.
    int fit;
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, kernel, 256, 0), "occupancy");
    if (g > fit * sms) {
      std::printf("(grid %d exceeds the %d blocks that stay resident: not run)\n", g, fit * sms);
      return -1.f;
    }
    return time_calls(
        [&](int) {
          kernel<<<g, 256>>>(stream, begin_d, layers, counter, base, out);
          base += (unsigned long long)(layers - 1) * g;
        },
        5, 0);
  };
  row("persistent, late loads", persistent(persistent_step<false, true>, grid));
  row("persistent, early loads", persistent(persistent_step<true, true>, grid));
  row("persistent, early, 1 block a SM", persistent(persistent_step<true, true>, sms));
  const float barriers = persistent(persistent_step<false, false>, grid);
  std::printf("%-34s %10.1f us, %.2f us a barrier\n", "barriers alone", barriers, barriers / (layers - 1));
  check(cudaGetLastError(), "launch");
  check(cudaFree(stream), "free");
}

}  // namespace

int main() {
  // The decode kernel's configurations at m = 1 (decode_kernel.cu, kMeasured).
  const Layer layers[] = {
      {8192, 10240, 1, 4, 2}, {8192, 8192, 1, 8, 2},  {8192, 57344, 8, 1, 2}, {28672, 8192, 4, 2, 7},
      {4096, 6144, 4, 1, 16}, {4096, 4096, 1, 8, 2},  {4096, 28672, 4, 1, 4}, {14336, 4096, 2, 4, 7},
  };
  int *out;
  check(cudaMalloc(&out, 4), "malloc");
  // Launch cost.
  {
    const float stream_us = time_calls([&](int) { empty_kernel<<<132, 256>>>(); }, 200, 0);
    cudaStream_t st;
    check(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "stream");
    cudaGraph_t g;
    cudaGraphExec_t ge;
    check(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal), "capture");
    for (int i = 0; i < 100; i++) empty_kernel<<<132, 256, 0, st>>>();
    check(cudaStreamEndCapture(st, &g), "end capture");
    check(cudaGraphInstantiate(&ge, g, 0), "instantiate");
    const float graph_us = time_calls([&](int) { check(cudaGraphLaunch(ge, 0), "graph"); }, 5, 0) / 100;
    std::printf("empty kernel (132 x 256): %.2f us per launch on the stream, %.2f us in a graph\n", stream_us,
                graph_us);
  }
  std::printf("%6s %6s %9s %8s | TB/s: %11s %9s %11s %9s | us: pattern\n", "k", "n", "config", "MB",
              "contiguous", "pattern", "pattern+256", "linear");
  for (const Layer &l : layers) {
    const size_t bytes = size_t(l.k) * l.n / 2;
    const int copies = int(std::max<size_t>(2, (size_t(256) << 20) / bytes + 1));
    std::vector<int4 *> bufs(copies);
    for (auto &b : bufs) {
      check(cudaMalloc(&b, bytes), "malloc");
      check(cudaMemset(b, 0x11, bytes), "memset");
    }
    const long count = long(bytes / 16);
    const dim3 grid(l.s, l.n / 64 / l.cw), block(32 * l.cw * l.kw);
    const int calls = 20 * copies;
    const float t_contig =
        time_calls([&](int i) { contiguous<<<132 * 8, 256>>>(bufs[i % copies], count, out); }, calls, 0);
    const float t_pat =
        time_calls([&](int i) { pattern<0, false><<<grid, block>>>(bufs[i % copies], l.n, l.k, l.cw, l.kw, l.s, out); }, calls, 0);
    const float t_256 =
        time_calls([&](int i) { pattern<256, false><<<grid, block>>>(bufs[i % copies], l.n, l.k, l.cw, l.kw, l.s, out); }, calls, 0);
    const float t_lin =
        time_calls([&](int i) { pattern<0, true><<<grid, block>>>(bufs[i % copies], l.n, l.k, l.cw, l.kw, l.s, out); }, calls, 0);
    check(cudaGetLastError(), "launch");
    auto tbs = [&](float us) { return bytes / us / 1e6; };
    std::printf("%6d %6d %3d,%d,%-3d %8.1f | %17.3f %9.3f %11.3f %9.3f | %7.2f %7.2f %7.2f %7.2f\n", l.k, l.n, l.cw,
                l.kw, l.s, bytes / 1e6, tbs(t_contig), tbs(t_pat), tbs(t_256), tbs(t_lin), t_contig, t_pat, t_256,
                t_lin);
    for (auto &b : bufs) check(cudaFree(b), "free");
  }
  step_stream(out);
  return 0;
}
