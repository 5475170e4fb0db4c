// Kernel-only timing of the Marlin launcher, without JAX: for A/B comparisons
// of Marlin kernel builds (compile flags, source variants) on one GPU machine,
// where a pip build per variant would cost minutes. It turns the launcher's
// Hopper kernels off (JAX_MARLIN_DECODE=0, JAX_MARLIN_PREFILL=0), so every m
// runs the Marlin kernel; decode_bench and prefill_bench time those.
// bench_matmul.py times what users call, through JAX; this tool times the
// launcher alone (benchmarks/gpu_run.sh builds and runs it).
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -Iffi benchmarks/kernel_bench.cu ffi/marlin_kernel.cu \
//        <the instance objects> -o kernel_bench
//   ./kernel_bench [--check] [--reps N] [--trials N] 64:8192:10240 1:8192:10240 ...
//                                                   (m:k:n, fp16, group size 128)
//
// --check compares each case's output with one launch of a thread block per
// output tile (no global reduction) and lists the 16 x 64 blocks that differ.
//
// Method: each call is the launcher's full work (the lock memset and the
// kernel launches) on one stream, timed with CUDA events over `reps` calls
// that rotate through copies of the weights (random bits: every int4 pattern
// is a valid weight) of more than 150 MB together, 2.5 times the H200's L2, so
// weights come from HBM. Median and minimum over `trials` timings.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench_fill.cuh"
#include "bench_timing.cuh"
#include "marlin_kernel.h"
#include "scratch_sizes.h"
#include "marlin_launch.h"

namespace {

using bench::check;


std::string run(const void *A, const void *B, const void *s, void *C, int m, int n, int k,
                int *workspace, float *scratch, cudaStream_t stream) {
  return marlin::matmul(A, B, s, nullptr, nullptr, nullptr, C, m, n, k, 128, false, workspace,
                        scratch, stream);
}

// The same product with one thread block per output tile (grid = column
// tiles x batch blocks): every block runs a whole column of k, so there is no
// global reduction, and the result is the reference for the reduction of the
// normal grid (fp16 g128, m <= 64 or a multiple of 64 up to 1024).
std::string run_unsplit(const void *A, const void *B, const void *s, void *C, int m, int n, int k,
                        int *workspace, float *scratch, cudaStream_t stream) {
  int device, max_shared;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&max_shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  const marlin::ThreadConfig &config = *marlin::choose_config(m, n, k);
  int thread_m_blocks = m <= 64 ? (m + 15) / 16 : 4;
  int par = m <= 64 ? 1 : m / 64;
  marlin::LaunchArgs p{static_cast<const int4 *>(A), static_cast<const int4 *>(B),
                       static_cast<int4 *>(C), scratch, static_cast<const int4 *>(s), nullptr,
                       nullptr, m, n, k, workspace, n / config.thread_n * par, max_shared, device,
                       stream};
  check(cudaMemsetAsync(workspace, 0, marlin::marlin_locks_size(m, n) * sizeof(int), stream), "memset");
  return marlin::launch_tile<half, 8, false>(config, thread_m_blocks, p);
}

// ||a - b|| / ||b|| over m x n halves, and how many elements of a are not finite.
// With n columns, the (16-row, 64-column) blocks holding elements off by more
// than 1% of the rms of b are listed (where a reduction went wrong).
double rel_error(const void *a, const void *b, size_t count, size_t *bad, int n = 0) {
  std::vector<half> ha(count), hb(count);
  check(cudaMemcpy(ha.data(), a, count * 2, cudaMemcpyDeviceToHost), "copy");
  check(cudaMemcpy(hb.data(), b, count * 2, cudaMemcpyDeviceToHost), "copy");
  double num = 0, den = 0;
  *bad = 0;
  for (size_t i = 0; i < count; ++i) {
    double x = __half2float(ha[i]), y = __half2float(hb[i]);
    if (!std::isfinite(x)) ++*bad;
    num += (x - y) * (x - y);
    den += y * y;
  }
  if (n > 0 && num > 1e-6 * den) {
    const double limit = 1e-2 * std::sqrt(den / count);
    std::map<std::pair<size_t, size_t>, int> blocks;
    for (size_t i = 0; i < count; ++i) {
      double x = __half2float(ha[i]), y = __half2float(hb[i]);
      if (!(std::abs(x - y) <= limit)) blocks[{i / n / 16, i % n / 64}]++;
    }
    std::printf("  check: %zu (16 x 64) blocks off:", blocks.size());
    int shown = 0;
    for (auto &[where, c] : blocks)
      if (shown++ < 12) std::printf(" r%zu/c%zu:%d", where.first, where.second, c);
    std::printf("\n");
  }
  return std::sqrt(num / den);
}

}  // namespace

int main(int argc, char **argv) {
  // The Marlin kernel at every m: the launcher's Hopper kernels off (read
  // once, at the first call; gpu_run.sh ab links stubs for them).
  setenv("JAX_MARLIN_DECODE", "0", 1);
  setenv("JAX_MARLIN_PREFILL", "0", 1);
  int reps = 200, trials = 7;
  bool check_result = false;
  std::vector<std::string> cases;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--check") check_result = true;
    else if (a == "--reps" && i + 1 < argc) reps = std::atoi(argv[++i]);
    else if (a == "--trials" && i + 1 < argc) trials = std::atoi(argv[++i]);
    else cases.push_back(a);
  }
  cudaStream_t stream;
  check(cudaStreamCreate(&stream), "cudaStreamCreate");
  std::printf("%6s %6s %6s %10s %10s %8s\n", "m", "k", "n", "median_us", "min_us", "TB/s");
  for (const std::string &c : cases) {
    int m, k, n;
    if (std::sscanf(c.c_str(), "%d:%d:%d", &m, &k, &n) != 3) {
      std::fprintf(stderr, "bad case '%s' (want m:k:n)\n", c.c_str());
      return 2;
    }
    const size_t b_bytes = size_t(k) * n / 2, s_bytes = size_t(k / 128) * n * 2;
    const int copies = int(std::max<size_t>(2, (150u << 20) / (b_bytes + s_bytes) + 1));
    std::vector<void *> Bs(copies), ss(copies);
    void *A, *C;
    int *workspace;
    float *scratch;
    for (int i = 0; i < copies; ++i) {
      check(cudaMalloc(&Bs[i], b_bytes), "cudaMalloc B");
      check(cudaMalloc(&ss[i], s_bytes), "cudaMalloc s");
      bench::fill_bits<<<1024, 256, 0, stream>>>(static_cast<uint32_t *>(Bs[i]), b_bytes / 4, 17 + i);
      bench::fill_float<<<1024, 256, 0, stream>>>(static_cast<uint16_t *>(ss[i]), s_bytes / 2, 91 + i, 1e-3f, 2e-2f, false);
    }
    check(cudaMalloc(&A, size_t(m) * k * 2), "cudaMalloc A");
    check(cudaMalloc(&C, size_t(m) * n * 2), "cudaMalloc C");
    bench::fill_float<<<1024, 256, 0, stream>>>(static_cast<uint16_t *>(A), size_t(m) * k, 5, -1.f, 1.f, false);
    check(cudaMalloc(&workspace, marlin::workspace_size(m, n) * sizeof(int)), "cudaMalloc locks");
    check(cudaMalloc(&scratch, marlin::reduce_scratch_size(m, n, k, false) * sizeof(float)),
          "cudaMalloc scratch");
    auto call = [&](int i) {
      std::string why = run(A, Bs[i % copies], ss[i % copies], C, m, n, k, workspace, scratch, stream);
      if (!why.empty()) {
        std::fprintf(stderr, "%s\n", why.c_str());
        std::exit(1);
      }
    };
    const std::vector<float> us = bench::timings(call, reps, trials, 2 * copies, stream);
    const float med = us[us.size() / 2];
    std::printf("%6d %6d %6d %10.2f %10.2f %8.3f\n", m, k, n, med, us[0],
                (b_bytes + s_bytes) / (med * 1e-6) / 1e12);
    if (check_result && (m <= 64 || (m % 64 == 0 && m <= 1024))) {
      void *C_ref;
      check(cudaMalloc(&C_ref, size_t(m) * n * 2), "cudaMalloc C_ref");
      // Poison both outputs (0xFFFF is a NaN) so unwritten elements show.
      check(cudaMemsetAsync(C, 0xFF, size_t(m) * n * 2, stream), "poison");
      check(cudaMemsetAsync(C_ref, 0xFF, size_t(m) * n * 2, stream), "poison");
      call(0);
      std::string why = run_unsplit(A, Bs[0], ss[0], C_ref, m, n, k, workspace, scratch, stream);
      if (!why.empty()) std::fprintf(stderr, "%s\n", why.c_str()), std::exit(1);
      check(cudaStreamSynchronize(stream), "check");
      size_t bad;
      double err = rel_error(C, C_ref, size_t(m) * n, &bad, n);
      std::printf("  check: |C - C_unsplit| / |C_unsplit| = %.2e, %zu non-finite%s\n", err, bad,
                  err < 1e-3 && bad == 0 ? "" : "  FAILED");
      cudaFree(C_ref);
    }
    std::fflush(stdout);
    for (int i = 0; i < copies; ++i) {
      cudaFree(Bs[i]);
      cudaFree(ss[i]);
    }
    cudaFree(A);
    cudaFree(C);
    cudaFree(workspace);
    cudaFree(scratch);
  }
  return 0;
}
