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
//   slice, or without the two residual add + RMSNorm kernels;
//   kernel   the block with the fusions of marlin::Fusion, as jm.matmul's
//            rms_norm_weight, swiglu and residual run it: RMSNorm inside qkv
//            and gate_up, the residual adds inside o and down, SwiGLU inside
//            down; only the slice kernel (attention's stand-in) stays. Where
//            the decode kernel does not run a call (m > 16; m > 8 with k >
//            4096) this is the CUDA handler's own prologue and add passes,
//            which jm.matmul's lowering replaces by XLA's fused ops.
//
// With --layers, each projection alone as well, plain and in each fused
// form, 32 calls of it in a graph (µs per call): where a fused form costs
// more or less than the plain call.
//
// Timed with CUDA events around graph replays (weights in 4 rotated sets,
// 440 MB, so they come from HBM). Prints µs per block and the weight bytes'
// rate in each form. Built like decode_bench (benchmarks/decode_run.sh):
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -Iffi benchmarks/block_bench.cu ffi/decode_kernel.cu \
//        ffi/marlin_kernel.cu ffi/prefill_sm90.cu <the Marlin instance objects> -o block_bench
//   ./block_bench [--reps N] [--layers] m ...
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

// The sum of `v` over the thread block (every thread gets it).
__device__ float block_sum(float v) {
  __shared__ float partial[32];
  for (int o = 16; o; o /= 2) v += __shfl_xor_sync(~0u, v, o);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0;
  for (int w = 0; w < int(blockDim.x / 32); ++w) total += partial[w];
  return total;
}

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
  const float total = block_sum(sum);
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

// xn = dtype(x r gamma), r = 1 / sqrt(mean(x^2) + eps): the RMSNorm the fused
// prologue runs, as a separate kernel, for the check.
__global__ void rms_norm_ref(const half *x, const half *gamma, half *xn, int k, float eps) {
  const half *row = x + size_t(blockIdx.x) * k;
  float sum = 0;
  for (int i = threadIdx.x; i < k; i += blockDim.x) sum += __half2float(row[i]) * __half2float(row[i]);
  const float total = block_sum(sum);
  const float r = 1.f / sqrtf(total / k + eps);
  for (int i = threadIdx.x; i < k; i += blockDim.x)
    xn[size_t(blockIdx.x) * k + i] = __float2half(__half2float(row[i]) * r * __half2float(gamma[i]));
}

// out = dtype(a + b) elementwise.
__global__ void add(const half *a, const half *b, half *out, int count) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += gridDim.x * blockDim.x)
    out[i] = __float2half(__half2float(a[i]) + __half2float(b[i]));
}

// ||a - b|| / ||b|| of two device arrays of `count` halves, and whether a
// holds a NaN.
double rel_diff(const half *a, const half *b, size_t count, bool *nan) {
  std::vector<half> ha(count), hb(count);
  bench::check(cudaMemcpy(ha.data(), a, count * sizeof(half), cudaMemcpyDeviceToHost), "copy");
  bench::check(cudaMemcpy(hb.data(), b, count * sizeof(half), cudaMemcpyDeviceToHost), "copy");
  double num = 0, den = 0;
  *nan = false;
  for (size_t i = 0; i < count; ++i) {
    const double u = __half2float(ha[i]), v = __half2float(hb[i]);
    if (std::isnan(u)) *nan = true;
    num += (u - v) * (u - v), den += v * v;
  }
  return std::sqrt(num / den);
}

struct Layer {
  int k, n;
  void *B[kCopies], *s[kCopies];
  size_t bytes() const { return size_t(k) * n / 2 + size_t(k / 128) * n * 2; }
};

}  // namespace

int main(int argc, char **argv) {
  int reps = 10;
  bool per_layer = false;
  std::vector<int> ms;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--reps" && i + 1 < argc) reps = std::atoi(argv[++i]);
    else if (a == "--layers") per_layer = true;
    else if (std::atoi(a.c_str()) > 0) ms.push_back(std::atoi(a.c_str()));
    else {
      std::fprintf(stderr, "usage: block_bench [--reps N] [--layers] m ...\n");
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
              " block; us per block\n%4s %10s %10s %10s %10s %10s %10s %10s %9s %9s\n",
              kBlocks, block_bytes / 1e6, "m", "unfused", "-swiglu", "-slice", "-norm+add",
              "fused", "kernel", "saved", "unf_TB/s", "ker_TB/s");
  for (int m : ms) {
    half *x, *xn, *qkv, *h, *o, *gu, *act, *down, *x2, *gamma;
    const size_t row = sizeof(half) * m;
    check(cudaMalloc(&x, row * kHidden), "x");
    check(cudaMalloc(&xn, row * kHidden), "xn");
    check(cudaMalloc(&qkv, row * kQkv), "qkv");
    check(cudaMalloc(&h, row * kHidden), "h");
    check(cudaMalloc(&o, row * kHidden), "o");
    check(cudaMalloc(&gu, row * 2 * kFfn), "gu");
    check(cudaMalloc(&act, row * kFfn), "act");
    check(cudaMalloc(&down, row * kHidden), "down");
    check(cudaMalloc(&x2, row * kHidden), "x2");
    check(cudaMalloc(&gamma, sizeof(half) * kHidden), "gamma");
    for (half *p : {x, down})
      bench::fill_float<<<64, 256, 0, stream>>>(reinterpret_cast<uint16_t *>(p), size_t(m) * kHidden,
                                                5, -1.f, 1.f, false);
    bench::fill_float<<<16, 256, 0, stream>>>(reinterpret_cast<uint16_t *>(gamma), kHidden, 6,
                                              0.5f, 1.5f, false);
    int64_t counters = 0, scratch = 0;
    for (const Layer &L : layers) {
      counters = std::max(counters, marlin::workspace_size(m, L.n));
      scratch = std::max(scratch, marlin::reduce_scratch_size(m, L.n, L.k, true));
    }
    int *workspace;
    float *reduce;
    check(cudaMalloc(&workspace, counters * sizeof(int)), "workspace");
    check(cudaMemset(workspace, 0, counters * sizeof(int)), "workspace");
    check(cudaMalloc(&reduce, scratch * sizeof(float)), "scratch");
    check(cudaStreamSynchronize(stream), "fill");
    auto mm = [&](int l, int copy, const half *in, half *out,
                  const marlin::Fusion &fusion = {}) {
      const Layer &L = layers[l];
      check(marlin::matmul(in, L.B[copy], L.s[copy], nullptr, nullptr, nullptr, out, m, L.n, L.k,
                           128, false, workspace, reduce, stream, /*workspace_zeroed=*/true,
                           fusion));
    };
    // The block with marlin::Fusion: x (the residual stream) -> x2 -> x.
    auto fused_block = [&](int b) {
      const int c = b % kCopies;
      const int grid_h = std::min(132, (m * kHidden + 255) / 256);
      marlin::Fusion norm;
      norm.norm_weight = gamma, norm.norm_eps = 1e-5f, norm.norm_size = kHidden;
      mm(0, c, x, qkv, norm);
      slice<<<grid_h, 256, 0, stream>>>(qkv, h, m, kHidden, kQkv);
      marlin::Fusion add;
      add.residual = x;
      mm(1, c, h, x2, add);
      mm(2, c, x2, gu, norm);
      marlin::Fusion swiglu_add;
      swiglu_add.swiglu = true, swiglu_add.residual = x2;
      mm(3, c, gu, x, swiglu_add);
    };
    // The fused calls against their parts run separately (a norm kernel, the
    // plain product, an add kernel, the SwiGLU kernel), outputs poisoned with
    // NaN first: they differ by the prologue's and the adds' fp16 roundings
    // (the norm's sums are added in another order, SwiGLU's exp differs).
    {
      const int k = kHidden;
      auto poison = [&](half *p, size_t count) {
        check(cudaMemsetAsync(p, 0xFF, count * sizeof(half), stream), "poison");
      };
      auto report = [&](const char *what, const half *a, const half *b, size_t count) {
        check(cudaStreamSynchronize(stream), what);
        bool nan;
        const double d = rel_diff(a, b, count, &nan);
        std::printf("# check m=%d %-22s rel diff %.2e%s\n", m, what, d,
                    nan || !(d < 2e-3) ? "  FAILED" : "");
      };
      bench::fill_float<<<64, 256, 0, stream>>>(reinterpret_cast<uint16_t *>(gu), size_t(m) * 2 * kFfn,
                                                7, -3.f, 3.f, false);
      marlin::Fusion norm;
      norm.norm_weight = gamma, norm.norm_eps = 1e-5f, norm.norm_size = k;
      poison(qkv, size_t(m) * kQkv);
      mm(0, 0, x, qkv, norm);
      rms_norm_ref<<<m, 256, 0, stream>>>(x, gamma, xn, k, 1e-5f);
      half *ref = act;  // [m, kFfn] >= [m, kQkv]
      mm(0, 0, xn, ref);
      report("qkv rms_norm", qkv, ref, size_t(m) * kQkv);
      {  // gate_up: the long-stream schedule at m <= 8
        half *g1, *g2;
        check(cudaMalloc(&g1, sizeof(half) * m * 2 * kFfn), "g1");
        check(cudaMalloc(&g2, sizeof(half) * m * 2 * kFfn), "g2");
        poison(g1, size_t(m) * 2 * kFfn);
        mm(2, 0, x, g1, norm);
        mm(2, 0, xn, g2);
        report("gate_up rms_norm", g1, g2, size_t(m) * 2 * kFfn);
        cudaFree(g1), cudaFree(g2);
      }
      marlin::Fusion residual;
      residual.residual = down;
      poison(x2, size_t(m) * k);
      mm(1, 0, xn, x2, residual);
      mm(1, 0, xn, o);
      add<<<64, 256, 0, stream>>>(o, down, h, m * k);
      report("o residual", x2, h, size_t(m) * k);
      marlin::Fusion swiglu_add;
      swiglu_add.swiglu = true, swiglu_add.residual = down;
      poison(x2, size_t(m) * k);
      mm(3, 0, gu, x2, swiglu_add);
      swiglu<<<132, 256, 0, stream>>>(gu, act, m, kFfn);
      mm(3, 0, act, o);
      add<<<64, 256, 0, stream>>>(o, down, h, m * k);
      report("down swiglu residual", x2, h, size_t(m) * k);
    }
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
    float t[2][6];
    for (int round = 0; round < 2; ++round) {
      for (int f = 0; f < 5; ++f)
        t[round][f] = per_block([&](int b) { block(b, forms[f][0], forms[f][1], forms[f][2]); });
      t[round][5] = per_block(fused_block);
    }
    check(cudaGetLastError(), "launch");
    for (int round = 0; round < 2; ++round) {
      std::printf("%4d", m);
      for (int f = 0; f < 6; ++f) std::printf(" %10.2f", t[round][f]);
      std::printf(" %9.1f%% %9.2f %9.2f\n", 100 * (1 - t[round][5] / t[round][0]),
                  block_bytes / (t[round][0] * 1e-6) / 1e12, block_bytes / (t[round][5] * 1e-6) / 1e12);
    }
    if (per_layer) {
      // Each projection alone, 32 calls of it in a graph, plain and fused.
      marlin::Fusion norm, residual, swiglu_only, swiglu_add;
      norm.norm_weight = gamma, norm.norm_eps = 1e-5f, norm.norm_size = kHidden;
      residual.residual = down;
      swiglu_only.swiglu = true;
      swiglu_add.swiglu = true, swiglu_add.residual = down;
      struct Form {
        const char *name;
        int layer;
        const half *in;
        half *out;
        const marlin::Fusion *fusion;
      };
      const marlin::Fusion plain;
      const Form layer_forms[] = {
          {"qkv", 0, xn, qkv, &plain},         {"qkv rms_norm", 0, x, qkv, &norm},
          {"o", 1, h, o, &plain},              {"o residual", 1, h, x2, &residual},
          {"gate_up", 2, xn, gu, &plain},      {"gate_up rms_norm", 2, x, gu, &norm},
          {"down", 3, act, o, &plain},         {"down swiglu", 3, gu, o, &swiglu_only},
          {"down residual", 3, act, x2, &residual}, {"down swiglu residual", 3, gu, x2, &swiglu_add},
      };
      for (const Form &f : layer_forms) {
        float us[2];
        for (float &u : us)
          u = per_block([&](int b) { mm(f.layer, b % kCopies, f.in, f.out, *f.fusion); });
        std::printf("# layer m=%-3d %-22s %8.2f %8.2f us per call\n", m, f.name, us[0], us[1]);
      }
      check(cudaGetLastError(), "launch");
    }
    std::fflush(stdout);
    for (void *p : {(void *)x, (void *)xn, (void *)qkv, (void *)h, (void *)o, (void *)gu,
                    (void *)act, (void *)down, (void *)x2, (void *)gamma, (void *)workspace,
                    (void *)reduce})
      cudaFree(p);
  }
  return 0;
}
