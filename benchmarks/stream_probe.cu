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
  return 0;
}
