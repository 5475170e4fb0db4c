// Checks and times the decode kernel (ffi/decode_kernel.h) without JAX.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -Iffi benchmarks/decode_bench.cu ffi/decode_kernel.cu \
//        ffi/marlin_kernel.cu <the Marlin instance objects> -o decode_bench
//   ./decode_bench [--group G] [--bf16] [--zeros] [--act-order] [--check] [--sweep [--graph]
//                  [--any-warps]] [--chain] [--memset-counters] [--reps N] m:k:n ...
//
// For each case m:k:n it prints the time per call of marlin::matmul (what
// the launcher picks: the decode kernel for m <= 16 on sm_90 unless
// JAX_MARLIN_DECODE=0) as independent calls rotating weight copies of more
// than 200 MB (3.3 times the H200's L2, so weights come from HBM), timed with
// CUDA events, median of 7. --chain also times a chain of dependent calls
// (each call's output feeds a small kernel that writes the next call's
// input, as in a decode step), launched on the stream and replayed as a CUDA
// graph; both columns are per call, less the small kernel's time in a graph.
// --sweep times every decode configuration (as independent calls, or
// with --graph per call in that graph of dependent calls): chunks and k
// ranges per block of 1, 2, 4 or 8, the launcher's candidates; with
// --any-warps any counts the kernel's rules allow (cw kw <= 8), such as 7
// k ranges on the 7 x 4096-deep down projections or 5 on a 640-deep layer,
// which the cost model never picks (check them with --check). --check compares the
// output (NaN-poisoned first) with a float64 host product on six 64-column
// chunks (first, last, four spread between) with and without a bias, checks
// that repeats are bit-identical, and does so for every configuration with
// --sweep. --zeros gives every weight copy random zero points (the layout of
// an imported asymmetric checkpoint), to time their cost against the
// symmetric kernels; --act-order a random permutation of x's columns (an
// imported GPTQ desc_act checkpoint). Their correctness is the GPU tests'
// (--check refuses them). The Marlin kernel's locks are zeroed once and left
// zero by every kernel, as a JAX call site's are (ffi/zeroed_counters.h);
// --memset-counters has the launcher zero them before every call instead (a
// second launch, as before 2026-12-04's zeroed counters).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "bench_fill.cuh"
#include "bench_timing.cuh"
#include "decode_kernel.h"
#include "marlin_kernel.h"
#include "scratch_sizes.h"

namespace {

using bench::check;
using bench::fill_bits;
using bench::fill_float;
using bench::time_calls;

bool g_bf16 = false;
bool g_zeros = false;
bool g_act_order = false;
bool g_memset_counters = false;
int g_group = 128;
int g_failures = 0;

// The next call's input from this call's output: the dependency of a decode
// step (the values stay in [-1, 1]).
__global__ void next_input(const uint16_t *y, uint16_t *x, int64_t y_count, int64_t x_count) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < x_count; i += int64_t(gridDim.x) * blockDim.x)
    x[i] = (y[i % y_count] & 0x83ffu) | 0x3800u;  // sign and mantissa bits, magnitude in [0.5, 1)
}

float to_float(uint16_t v) { return bench::to_float(v, g_bf16); }

struct Case {
  int m, k, n;
  int64_t groups() const { return g_group == -1 ? 1 : k / g_group; }
  size_t b_bytes() const { return size_t(k) * n / 2; }
  size_t s_bytes() const { return size_t(groups()) * n * 2; }
  size_t z_bytes() const { return g_zeros ? size_t(groups()) * n / 2 : 0; }  // 4 bits each
};

struct Buffers {
  std::vector<void *> B, s, z;  // z: zero points per copy, or none
  void *A = nullptr, *C = nullptr, *bias = nullptr;
  int *workspace = nullptr;
  float *scratch = nullptr;
  int *perm = nullptr;  // --act-order: one random permutation of k
};

Buffers allocate(const Case &c, cudaStream_t stream) {
  Buffers b;
  const int copies =
      int(std::max<size_t>(2, (200u << 20) / (c.b_bytes() + c.s_bytes() + c.z_bytes()) + 1));
  for (int i = 0; i < copies; ++i) {
    if (g_zeros) {
      void *z;
      check(cudaMalloc(&z, c.z_bytes()), "cudaMalloc zeros");
      fill_bits<<<1024, 256, 0, stream>>>(static_cast<uint32_t *>(z), c.z_bytes() / 4, 53 + i);
      b.z.push_back(z);
    }
    void *B, *s;
    check(cudaMalloc(&B, c.b_bytes()), "cudaMalloc B");
    check(cudaMalloc(&s, c.s_bytes()), "cudaMalloc s");
    fill_bits<<<1024, 256, 0, stream>>>(static_cast<uint32_t *>(B), c.b_bytes() / 4, 17 + i);
    fill_float<<<1024, 256, 0, stream>>>(static_cast<uint16_t *>(s), c.s_bytes() / 2, 91 + i,
                                         1e-3f, 2e-2f, g_bf16);
    b.B.push_back(B);
    b.s.push_back(s);
  }
  check(cudaMalloc(&b.A, size_t(c.m) * c.k * 2), "cudaMalloc A");
  check(cudaMalloc(&b.C, size_t(c.m) * c.n * 2), "cudaMalloc C");
  check(cudaMalloc(&b.bias, size_t(c.n) * 2), "cudaMalloc bias");
  fill_float<<<1024, 256, 0, stream>>>(static_cast<uint16_t *>(b.A), size_t(c.m) * c.k, 5, -1.f, 1.f, g_bf16);
  fill_float<<<64, 256, 0, stream>>>(static_cast<uint16_t *>(b.bias), c.n, 7, -0.5f, 0.5f, g_bf16);
  check(cudaMalloc(&b.workspace, marlin::workspace_size(c.m, c.n) * sizeof(int)), "cudaMalloc locks");
  check(cudaMemset(b.workspace, 0, marlin::workspace_size(c.m, c.n) * sizeof(int)), "memset locks");
  const int64_t scratch = marlin::reduce_scratch_size(c.m, c.n, c.k, g_act_order);
  check(cudaMalloc(&b.scratch, scratch * sizeof(float)), "cudaMalloc scratch");
  if (g_act_order) {
    std::vector<int> perm(c.k);
    for (int i = 0; i < c.k; ++i) perm[i] = i;
    uint64_t state = 12345;
    for (int i = c.k - 1; i > 0; --i) {  // Fisher-Yates with a fixed LCG
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      std::swap(perm[i], perm[int((state >> 33) % uint64_t(i + 1))]);
    }
    check(cudaMalloc(&b.perm, size_t(c.k) * sizeof(int)), "cudaMalloc perm");
    check(cudaMemcpy(b.perm, perm.data(), size_t(c.k) * sizeof(int), cudaMemcpyHostToDevice),
          "perm");
  }
  check(cudaStreamSynchronize(stream), "fill");
  return b;
}

void release(Buffers &b) {
  for (void *p : b.B) cudaFree(p);
  for (void *p : b.s) cudaFree(p);
  for (void *p : b.z) cudaFree(p);
  cudaFree(b.A), cudaFree(b.C), cudaFree(b.bias), cudaFree(b.workspace), cudaFree(b.scratch);
  cudaFree(b.perm);
}

// One call: marlin::matmul (config invalid) or the decode kernel with `config`.
std::string call(const Case &c, const Buffers &b, int copy, const marlin::DecodeConfig &config,
                 bool bias, cudaStream_t stream, const void *A = nullptr) {
  const void *x = A ? A : b.A;
  const void *bp = bias ? b.bias : nullptr;
  const void *z = g_zeros ? b.z[copy] : nullptr;
  if (config.valid())
    return marlin::decode_matmul(x, b.B[copy], b.s[copy], z, b.perm, bp, b.C, c.m, c.n, c.k,
                                 g_group, g_bf16, config, true, stream);
  return marlin::matmul(x, b.B[copy], b.s[copy], z, b.perm, bp, b.C, c.m, c.n, c.k, g_group,
                        g_bf16, b.workspace, b.scratch, stream, !g_memset_counters);
}

// Float64 product on six 64-column chunks, from the packed layout (the facts
// of jax_marlin/packing.py, restated here independently of the kernel).
void check_case(const Case &c, const Buffers &b, const marlin::DecodeConfig &config, const char *label,
                cudaStream_t stream) {
  const int chunks = c.n / 64;
  std::vector<int> picked = {0, chunks - 1, chunks / 5, 2 * chunks / 5, 3 * chunks / 5, 4 * chunks / 5};
  std::sort(picked.begin(), picked.end());
  picked.erase(std::unique(picked.begin(), picked.end()), picked.end());
  std::vector<uint32_t> q(c.b_bytes() / 4);
  std::vector<uint16_t> s(c.s_bytes() / 2), x(size_t(c.m) * c.k), bias(c.n), y(size_t(c.m) * c.n);
  check(cudaMemcpy(q.data(), b.B[0], c.b_bytes(), cudaMemcpyDeviceToHost), "copy");
  check(cudaMemcpy(s.data(), b.s[0], c.s_bytes(), cudaMemcpyDeviceToHost), "copy");
  check(cudaMemcpy(x.data(), b.A, x.size() * 2, cudaMemcpyDeviceToHost), "copy");
  check(cudaMemcpy(bias.data(), b.bias, bias.size() * 2, cudaMemcpyDeviceToHost), "copy");
  auto scale = [&](int group, int col) {
    int stored;
    if (g_group == -1) {
      const int in32 = col % 32;
      stored = col - in32 + 8 * ((in32 % 8) / 2) + 2 * (in32 / 8) + in32 % 2;
    } else {
      const int in64 = col % 64;
      stored = col - in64 + 8 * (in64 % 8) + in64 / 8;
    }
    return double(to_float(s[size_t(group) * c.n + stored]));
  };
  for (int with_bias = 0; with_bias < 2; ++with_bias) {
    check(cudaMemsetAsync(b.C, 0xFF, y.size() * 2, stream), "poison");
    check(call(c, b, 0, config, with_bias, stream));
    check(cudaStreamSynchronize(stream), "check call");
    check(cudaMemcpy(y.data(), b.C, y.size() * 2, cudaMemcpyDeviceToHost), "copy");
    std::vector<uint16_t> again(y.size());
    check(call(c, b, 0, config, with_bias, stream));
    check(cudaMemcpy(again.data(), b.C, y.size() * 2, cudaMemcpyDeviceToHost), "copy");
    const bool identical = again == y;
    double num = 0, den = 0;
    size_t nonfinite = 0, worst_row = 0, worst_col = 0;
    double worst = 0;
    std::vector<double> w(size_t(c.k) * 64);
    for (int chunk : picked) {
      for (int tk = 0; tk < c.k / 16; ++tk)
        for (int word = 0; word < 128; ++word) {
          const uint32_t v = q[size_t(tk) * 2 * c.n + 128 * chunk + word];
          const int lane = word / 4, tile = word % 4;
          for (int p = 0; p < 8; ++p) {
            const int row = 16 * tk + 2 * (lane % 4) + (p >= 4) + 8 * (p & 1);
            const int col = 16 * tile + lane / 4 + 8 * ((p >> 1) & 1);
            const int group = g_group == -1 ? 0 : row / g_group;
            w[size_t(row) * 64 + col] = (int((v >> (4 * p)) & 15) - 8) * scale(group, 64 * chunk + col);
          }
        }
      for (int i = 0; i < c.m; ++i)
        for (int j = 0; j < 64; ++j) {
          double ref = with_bias ? to_float(bias[64 * chunk + j]) : 0.0;
          for (int kk = 0; kk < c.k; ++kk) ref += double(to_float(x[size_t(i) * c.k + kk])) * w[size_t(kk) * 64 + j];
          const double got = to_float(y[size_t(i) * c.n + 64 * chunk + j]);
          if (!std::isfinite(got)) ++nonfinite;
          const double d = std::abs(got - ref);
          if (!(d <= worst)) worst = d, worst_row = i, worst_col = 64 * chunk + j;
          num += (got - ref) * (got - ref);
          den += ref * ref;
        }
    }
    const double err = std::sqrt(num / den);
    const double limit = g_bf16 ? 3e-3 : 1e-3;
    const bool ok = err <= limit && nonfinite == 0 && identical;
    if (!ok) ++g_failures;
    std::printf("  check %-14s m=%d k=%d n=%d g=%d %s bias=%d: rel err %.2e, %zu non-finite, "
                "repeat %s, worst |d| %.3g at (%zu, %zu)%s\n",
                label, c.m, c.k, c.n, g_group, g_bf16 ? "bf16" : "fp16", with_bias, err, nonfinite,
                identical ? "identical" : "DIFFERS", worst, worst_row, worst_col, ok ? "" : "  FAILED");
  }
}

// Microseconds per step of `step` (which enqueues one call and its
// next_input) and of `other` (next_input alone), each in a CUDA graph of 64,
// replayed: {step, other}.
template <typename Step, typename Other>
std::pair<float, float> time_in_graph(Step &&step, Other &&other, cudaStream_t stream) {
  auto capture64 = [&](auto &&call, cudaGraph_t *graph, cudaGraphExec_t *exec) {
    check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "capture");
    for (int i = 0; i < 64; ++i) call(i);
    check(cudaStreamEndCapture(stream, graph), "end capture");
    check(cudaGraphInstantiate(exec, *graph, 0), "instantiate");
  };
  cudaGraph_t graph, graph_other;
  cudaGraphExec_t exec, exec_other;
  capture64(step, &graph, &exec);
  capture64(other, &graph_other, &exec_other);
  const float all = time_calls([&](int) { check(cudaGraphLaunch(exec, stream), "graph"); }, 10, stream);
  const float alone = time_calls([&](int) { check(cudaGraphLaunch(exec_other, stream), "graph"); }, 10, stream);
  cudaGraphExecDestroy(exec), cudaGraphDestroy(graph);
  cudaGraphExecDestroy(exec_other), cudaGraphDestroy(graph_other);
  return {all / 64, alone / 64};
}

bool g_any_warps = false;  // --any-warps

std::vector<marlin::DecodeConfig> all_configs(const Case &c) {
  std::vector<marlin::DecodeConfig> out;
  const int step = g_any_warps ? 1 : 0;  // 1..8, or powers of two
  for (int cw = 1; cw <= 8; cw = step ? cw + 1 : 2 * cw)
    for (int kw = 1; kw <= 8; kw = step ? kw + 1 : 2 * kw)
      for (int s = 1; s <= 16; ++s) {
        marlin::DecodeConfig config{cw, kw, s};
        if (marlin::check_decode_config(config, c.m, c.n, c.k, g_group).empty()) out.push_back(config);
      }
  return out;
}

}  // namespace

int main(int argc, char **argv) {
  bool do_check = false, sweep = false, chain = false, sweep_graph = false;
  int reps = 200;
  std::vector<Case> cases;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--check") do_check = true;
    else if (a == "--sweep") sweep = true;
    else if (a == "--chain") chain = true;
    else if (a == "--graph") sweep_graph = true;
    else if (a == "--any-warps") g_any_warps = true;
    else if (a == "--bf16") g_bf16 = true;
    else if (a == "--zeros") g_zeros = true;
    else if (a == "--act-order") g_act_order = true;
    else if (a == "--memset-counters") g_memset_counters = true;
    else if (a == "--group" && i + 1 < argc) g_group = std::atoi(argv[++i]);
    else if (a == "--reps" && i + 1 < argc) reps = std::atoi(argv[++i]);
    else {
      Case c;
      if (std::sscanf(a.c_str(), "%d:%d:%d", &c.m, &c.k, &c.n) != 3) {
        std::fprintf(stderr, "bad case '%s' (want m:k:n)\n", a.c_str());
        return 2;
      }
      cases.push_back(c);
    }
  }
  if ((g_zeros || g_act_order) && do_check) {
    std::fprintf(stderr,
                 "--check takes symmetric weights only (zero points, act-order: the GPU tests)\n");
    return 2;
  }
  int device, sms;
  check(cudaGetDevice(&device), "device");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "sms");
  const char *env = std::getenv("JAX_MARLIN_DECODE");
  std::printf("# %s g%d%s%s, launcher with JAX_MARLIN_DECODE=%s, JAX_MARLIN_PDL=%s\n",
              g_bf16 ? "bf16" : "fp16", g_group, g_zeros ? " with zero points" : "",
              g_act_order ? " act-order" : "", env ? env : "(unset)",
              std::getenv("JAX_MARLIN_PDL") ? std::getenv("JAX_MARLIN_PDL") : "(unset)");
  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  std::printf("%6s %6s %6s %8s %10s %8s %10s %10s\n", "m", "k", "n", "config", "us", "TB/s",
              "chain_us", "graph_us");
  for (const Case &c : cases) {
    Buffers b = allocate(c, stream);
    const int copies = int(b.B.size());
    const double bytes =
        double(c.b_bytes() + c.s_bytes() + c.z_bytes() + size_t(c.m) * (c.k + c.n) * 2);
    const marlin::DecodeConfig chosen = marlin::choose_decode_config(c.m, c.n, c.k, g_group, sms);
    char label[32];
    std::snprintf(label, sizeof label, "%d,%d,%d", chosen.cw, chosen.kw, chosen.s);
    if (do_check) check_case(c, b, marlin::DecodeConfig{}, "launcher", stream);
    const float us = time_calls([&](int i) { check(call(c, b, i % copies, {}, false, stream)); }, reps, stream);
    float chain_us = 0, graph_us = 0;
    if (chain) {
      // Per dependent call: matmul then next_input, minus next_input alone.
      void *x2;
      check(cudaMalloc(&x2, size_t(c.m) * c.k * 2), "cudaMalloc x2");
      const int64_t yc = int64_t(c.m) * c.n, xc = int64_t(c.m) * c.k;
      auto step = [&](int i) {
        check(call(c, b, i % copies, {}, false, stream, x2));
        next_input<<<32, 256, 0, stream>>>(static_cast<uint16_t *>(b.C), static_cast<uint16_t *>(x2), yc, xc);
      };
      auto alone = [&](int) {
        next_input<<<32, 256, 0, stream>>>(static_cast<uint16_t *>(b.C), static_cast<uint16_t *>(x2), yc, xc);
      };
      // The same chain captured once into a graph of 64 steps (what XLA's
      // command buffers do), replayed.
      const auto [graph_step, graph_other] = time_in_graph(step, alone, stream);
      graph_us = graph_step - graph_other;
      // On the stream, minus next_input's time in the graph: its time alone
      // on the stream is its launch rate (a few us), which the chain hides
      // behind the matmul, so subtracting that gave chain times below the
      // independent calls'.
      chain_us = time_calls(step, reps, stream) - graph_other;
      cudaFree(x2);
    }
    std::printf("%6d %6d %6d %8s %10.2f %8.3f %10.2f %10.2f\n", c.m, c.k, c.n,
                c.m <= marlin::kDecodeMaxM ? label : "marlin", us, bytes / (us * 1e-6) / 1e12,
                chain_us, graph_us);
    if (sweep && c.m <= marlin::kDecodeMaxM) {
      std::vector<std::pair<float, std::string>> rows;
      for (const marlin::DecodeConfig &config : all_configs(c)) {
        char name[32];
        std::snprintf(name, sizeof name, "%d,%d,%d", config.cw, config.kw, config.s);
        if (do_check) check_case(c, b, config, name, stream);
        float t;
        if (sweep_graph) {
          void *x2;
          check(cudaMalloc(&x2, size_t(c.m) * c.k * 2), "cudaMalloc x2");
          const int64_t yc = int64_t(c.m) * c.n, xc = int64_t(c.m) * c.k;
          auto alone = [&](int) {
            next_input<<<32, 256, 0, stream>>>(static_cast<uint16_t *>(b.C), static_cast<uint16_t *>(x2), yc, xc);
          };
          auto step = [&](int i) {
            check(call(c, b, i % copies, config, false, stream, x2));
            alone(i);
          };
          const auto [graph_step, graph_other] = time_in_graph(step, alone, stream);
          t = graph_step - graph_other;
          cudaFree(x2);
        } else {
          t = time_calls([&](int i) { check(call(c, b, i % copies, config, false, stream)); }, reps / 2,
                         stream);
        }
        rows.push_back({t, name});
      }
      std::sort(rows.begin(), rows.end());
      std::printf("  sweep m=%d k=%d n=%d (%zu configs): ", c.m, c.k, c.n, rows.size());
      for (size_t i = 0; i < rows.size() && i < 6; ++i)
        std::printf("%s %.2f%s", rows[i].second.c_str(), rows[i].first, i + 1 < rows.size() && i < 5 ? " | " : "\n");
      std::printf("  sweep-worst %s %.2f\n", rows.back().second.c_str(), rows.back().first);
    }
    std::fflush(stdout);
    release(b);
  }
  check(cudaGetLastError(), "last error");
  if (g_failures) std::printf("%d CHECKS FAILED\n", g_failures);
  return g_failures ? 1 : 0;
}
