// What fusing the elementwise work into the projections could save in a
// decode step: one Llama-3-8B block's four projections (qkv 4096 x 6144,
// o 4096 x 4096, gate_up 4096 x 28672, down 14336 x 4096, 4-bit g128 through
// marlin::matmul) chained in a CUDA graph of 32 blocks, in these forms:
//
//   unfused  the block as XLA runs it (benchmarks/bench_decode_step.py):
//            residual add + RMSNorm -> qkv -> the slice of q -> o -> residual
//            add + RMSNorm -> gate_up -> SwiGLU -> down, each elementwise step
//            its own small kernel, as each is one of XLA's fusions;
//   fused    the four projections back to back, each reading the previous
//            one's output as its x (the bytes a fused prologue would read;
//            the values are not a block's): the bound of a block whose norms,
//            SwiGLU and residual adds live inside the projections, where
//            programmatic dependent launch lets each projection's weight
//            stream start while the one before finishes;
//   and between them, the block without its SwiGLU kernel, without the
//   slice, or without the two residual add + RMSNorm kernels.
//
// Timed with CUDA events around graph replays (weights in 4 rotated sets,
// 440 MB, so they come from HBM). Prints µs per block and the weight bytes'
// rate in each form. Built like decode_bench (benchmarks/decode_run.sh):
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -Iffi benchmarks/block_bench.cu ffi/decode_kernel.cu \
//        ffi/marlin_kernel.cu ffi/prefill_sm90.cu <the Marlin instance objects> -o block_bench
//   ./block_bench [--reps N] m ...
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench_fill.cuh"
#include "bench_timing.cuh"
#include "marlin_kernel.h"
#include "scratch_sizes.h"

namespace {

using bench::check;

constexpr int kHidden = 4096, kQkv = 6144, kFfn = 14336, kCopies = 4, kBlocks = 32;

// x = x + y; xn = x / rms(x), one thread block per row (XLA's reduction
// fusion of the residual add and RMSNorm).
__global__ void add_rms_norm(half *x, const half *y, half *xn, int k) {
  half *row = x + size_t(blockIdx.x) * k;
  const half *add = y + size_t(blockIdx.x) * k;
  float sum = 0;
  for (int i = threadIdx.x; i < k; i += blockDim.x) {
    const float v = __half2float(row[i]) + __half2float(add[i]);
    row[i] = __float2half(v);
    sum += v * v;
  }
  __shared__ float partial[32];
  for (int o = 16; o; o /= 2) sum += __shfl_xor_sync(~0u, sum, o);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = sum;
  __syncthreads();
  float total = 0;
  for (int w = 0; w < int(blockDim.x / 32); ++w) total += partial[w];
  const float r = rsqrtf(total / k + 1e-5f);
  for (int i = threadIdx.x; i < k; i += blockDim.x)
    xn[size_t(blockIdx.x) * k + i] = __float2half(__half2float(row[i]) * r);
}

// h = qkv[:, :k] (the slice of a wider row).
__global__ void slice(const half *in, half *out, int m, int k, int in_k) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < m * k; i += gridDim.x * blockDim.x)
    out[i] = in[size_t(i / k) * in_k + i % k];
}

// act = silu(gu[:, :f]) * gu[:, f:].
__global__ void swiglu(const half *gu, half *act, int m, int f) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < m * f; i += gridDim.x * blockDim.x) {
    const size_t row = i / f, col = i % f;
    const float g = __half2float(gu[row * 2 * f + col]), u = __half2float(gu[row * 2 * f + f + col]);
    act[i] = __float2half(g / (1.f + __expf(-g)) * u);
  }
}

struct Layer {
  int k, n;
  void *B[kCopies], *s[kCopies];
  size_t bytes() const { return size_t(k) * n / 2 + size_t(k / 128) * n * 2; }
};

}  // namespace

int main(int argc, char **argv) {
  int reps = 10;
  std::vector<int> ms;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--reps" && i + 1 < argc) reps = std::atoi(argv[++i]);
    else if (std::atoi(a.c_str()) > 0) ms.push_back(std::atoi(a.c_str()));
    else {
      std::fprintf(stderr, "usage: block_bench [--reps N] m ...\n");
      return 2;
    }
  }
  if (ms.empty()) ms = {1, 4, 16};
  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  Layer layers[4] = {{kHidden, kQkv}, {kHidden, kHidden}, {kHidden, 2 * kFfn}, {kFfn, kHidden}};
  size_t block_bytes = 0;
  for (int l = 0; l < 4; ++l) {
    Layer &L = layers[l];
    block_bytes += L.bytes();
    for (int c = 0; c < kCopies; ++c) {
      check(cudaMalloc(&L.B[c], size_t(L.k) * L.n / 2), "cudaMalloc B");
      check(cudaMalloc(&L.s[c], size_t(L.k / 128) * L.n * 2), "cudaMalloc s");
      bench::fill_bits<<<1024, 256, 0, stream>>>(static_cast<uint32_t *>(L.B[c]),
                                                 size_t(L.k) * L.n / 8, 17 + 4 * c + l);
      // Scales of about 1 / (8 sqrt(k)): outputs of x's size, so the chain
      // stays finite.
      const float sc = 0.125f / std::sqrt(float(L.k));
      bench::fill_float<<<1024, 256, 0, stream>>>(static_cast<uint16_t *>(L.s[c]),
                                                  size_t(L.k / 128) * L.n, 91 + 4 * c + l,
                                                  0.5f * sc, 1.5f * sc, false);
    }
  }
  std::printf("# Llama-3-8B block, fp16 g128, %d blocks in a CUDA graph, 4-bit weights %.1f MB a"
              " block; us per block\n%4s %10s %10s %10s %10s %10s %10s %9s %9s\n",
              kBlocks, block_bytes / 1e6, "m", "unfused", "-swiglu", "-slice", "-norm+add",
              "fused", "saved", "unf_TB/s", "fus_TB/s");
  for (int m : ms) {
    half *x, *xn, *qkv, *h, *o, *gu, *act, *down;
    const size_t row = sizeof(half) * m;
    check(cudaMalloc(&x, row * kHidden), "x");
    check(cudaMalloc(&xn, row * kHidden), "xn");
    check(cudaMalloc(&qkv, row * kQkv), "qkv");
    check(cudaMalloc(&h, row * kHidden), "h");
    check(cudaMalloc(&o, row * kHidden), "o");
    check(cudaMalloc(&gu, row * 2 * kFfn), "gu");
    check(cudaMalloc(&act, row * kFfn), "act");
    check(cudaMalloc(&down, row * kHidden), "down");
    for (half *p : {x, down})
      bench::fill_float<<<64, 256, 0, stream>>>(reinterpret_cast<uint16_t *>(p), size_t(m) * kHidden,
                                                5, -1.f, 1.f, false);
    int64_t counters = 0, scratch = 0;
    for (const Layer &L : layers) {
      counters = std::max(counters, marlin::workspace_size(m, L.n));
      scratch = std::max(scratch, marlin::reduce_scratch_size(m, L.n, L.k, false));
    }
    int *workspace;
    float *reduce;
    check(cudaMalloc(&workspace, counters * sizeof(int)), "workspace");
    check(cudaMemset(workspace, 0, counters * sizeof(int)), "workspace");
    check(cudaMalloc(&reduce, scratch * sizeof(float)), "scratch");
    check(cudaStreamSynchronize(stream), "fill");
    auto mm = [&](int l, int copy, const half *in, half *out) {
      const Layer &L = layers[l];
      check(marlin::matmul(in, L.B[copy], L.s[copy], nullptr, nullptr, nullptr, out, m, L.n, L.k,
                           128, false, workspace, reduce, stream, /*workspace_zeroed=*/true));
    };
    // One block; `fuse_norm`: no residual add + RMSNorm kernels (qkv reads
    // the previous down's output, gate_up o's), `fuse_swiglu`: no SwiGLU kernel
    // (down reads gate_up's output), `fuse_slice`: no slice kernel (o reads
    // qkv's output).
    auto block = [&](int b, bool fuse_norm, bool fuse_swiglu, bool fuse_slice) {
      const int c = b % kCopies;
      const int grid_h = std::min(132, (m * kHidden + 255) / 256);
      const int grid_f = std::min(132, (m * kFfn + 255) / 256);
      if (!fuse_norm) add_rms_norm<<<m, 256, 0, stream>>>(x, down, xn, kHidden);
      mm(0, c, fuse_norm ? down : xn, qkv);
      if (!fuse_slice) slice<<<grid_h, 256, 0, stream>>>(qkv, h, m, kHidden, kQkv);
      mm(1, c, fuse_slice ? qkv : h, o);
      if (!fuse_norm) add_rms_norm<<<m, 256, 0, stream>>>(x, o, xn, kHidden);
      mm(2, c, fuse_norm ? o : xn, gu);
      if (!fuse_swiglu) swiglu<<<grid_f, 256, 0, stream>>>(gu, act, m, kFfn);
      mm(3, c, fuse_swiglu ? gu : act, down);
    };
    auto per_block = [&](auto &&block) {
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "capture");
      for (int b = 0; b < kBlocks; ++b) block(b);
      check(cudaStreamEndCapture(stream, &graph), "end capture");
      check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
      const float us = bench::time_calls(
          [&](int) { check(cudaGraphLaunch(exec, stream), "graph"); }, reps, stream);
      cudaGraphExecDestroy(exec), cudaGraphDestroy(graph);
      return us / kBlocks;
    };
    // Every form twice, alternating, to see the run-to-run spread.
    const bool forms[5][3] = {{0, 0, 0}, {0, 1, 0}, {0, 0, 1}, {1, 0, 0}, {1, 1, 1}};
    float t[2][5];
    for (int round = 0; round < 2; ++round)
      for (int f = 0; f < 5; ++f)
        t[round][f] = per_block([&](int b) { block(b, forms[f][0], forms[f][1], forms[f][2]); });
    check(cudaGetLastError(), "launch");
    for (int round = 0; round < 2; ++round) {
      std::printf("%4d", m);
      for (int f = 0; f < 5; ++f) std::printf(" %10.2f", t[round][f]);
      std::printf(" %9.1f%% %9.2f %9.2f\n", 100 * (1 - t[round][4] / t[round][0]),
                  block_bytes / (t[round][0] * 1e-6) / 1e12, block_bytes / (t[round][4] * 1e-6) / 1e12);
    }
    std::fflush(stdout);
    for (void *p : {(void *)x, (void *)xn, (void *)qkv, (void *)h, (void *)o, (void *)gu,
                    (void *)act, (void *)down, (void *)workspace, (void *)reduce})
      cudaFree(p);
  }
  return 0;
}
