// Kernel-only timing of the Marlin launcher, without JAX: for A/B comparisons
// of kernel builds (compile flags, source variants, the seed) in one device
// lease, where a pip build per variant would cost minutes. bench_matmul.py
// times what users call, through JAX; this tool times the launcher alone.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -Iffi benchmarks/kernel_bench.cu ffi/marlin_kernel.cu \
//        <the instance objects> -o kernel_bench
//   ./kernel_bench 64:8192:10240 1:8192:10240 ...     (m:k:n, fp16, group size 128)
//
// Built with -DSEED_API against the seed's launcher (ffi/ of commit 2fc3eba).
//
// Method: each call is the launcher's full work (the lock memset and the
// kernel launches) on one stream, timed with CUDA events over `reps` calls
// that rotate through copies of the weights (random bits: every int4 pattern
// is a valid weight) of more than 150 MB together, 2.5 times the H200's L2, so
// weights come from HBM. Median and minimum over `trials` timings.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "marlin_kernel.h"

namespace {

void check(cudaError_t error, const char *what) {
  if (error != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(error));
    std::exit(1);
  }
}

// Deterministic pseudo-random fill: 32 random bits per word (weights), or
// halves in [lo, hi) (activations, scales).
__device__ uint32_t mix(uint64_t i, uint32_t seed) {
  uint64_t x = i * 0x9E3779B97F4A7C15ull + seed;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  return uint32_t(x >> 16);
}
__global__ void fill_bits(uint32_t *p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = mix(i, seed);
}
__global__ void fill_half(half *p, size_t n, uint32_t seed, float lo, float hi) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = __float2half(lo + (hi - lo) * (mix(i, seed) & 0xFFFFFF) / float(1 << 24));
}

// The launcher's API: the seed's has no bias, dtype or fp32 scratch, and
// sizes its locks by n alone.
#ifdef SEED_API
std::string run(const void *A, const void *B, const void *s, void *C, int m, int n, int k,
                int *workspace, float *, cudaStream_t stream) {
  return marlin::matmul(A, B, s, C, m, n, k, 128, workspace, stream);
}
int64_t locks_needed(int64_t, int64_t n) { return marlin::workspace_size(n); }
int64_t scratch_needed(int64_t, int64_t) { return 1; }
#else
std::string run(const void *A, const void *B, const void *s, void *C, int m, int n, int k,
                int *workspace, float *scratch, cudaStream_t stream) {
  return marlin::matmul(A, B, s, nullptr, C, m, n, k, 128, false, workspace, scratch, stream);
}
int64_t locks_needed(int64_t m, int64_t n) { return marlin::workspace_size(m, n); }
int64_t scratch_needed(int64_t m, int64_t n) { return marlin::reduce_scratch_size(m, n); }
#endif

}  // namespace

int main(int argc, char **argv) {
  int reps = 200, trials = 7;
  std::vector<std::string> cases;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--reps" && i + 1 < argc) reps = std::atoi(argv[++i]);
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
      fill_bits<<<1024, 256, 0, stream>>>(static_cast<uint32_t *>(Bs[i]), b_bytes / 4, 17 + i);
      fill_half<<<1024, 256, 0, stream>>>(static_cast<half *>(ss[i]), s_bytes / 2, 91 + i, 1e-3f, 2e-2f);
    }
    check(cudaMalloc(&A, size_t(m) * k * 2), "cudaMalloc A");
    check(cudaMalloc(&C, size_t(m) * n * 2), "cudaMalloc C");
    fill_half<<<1024, 256, 0, stream>>>(static_cast<half *>(A), size_t(m) * k, 5, -1.f, 1.f);
    check(cudaMalloc(&workspace, locks_needed(m, n) * sizeof(int)), "cudaMalloc locks");
    check(cudaMalloc(&scratch, sizeof(float) * scratch_needed(m, n)), "cudaMalloc scratch");
    cudaEvent_t start, stop;
    check(cudaEventCreate(&start), "cudaEventCreate");
    check(cudaEventCreate(&stop), "cudaEventCreate");
    auto call = [&](int i) {
      std::string why = run(A, Bs[i % copies], ss[i % copies], C, m, n, k, workspace, scratch, stream);
      if (!why.empty()) {
        std::fprintf(stderr, "%s\n", why.c_str());
        std::exit(1);
      }
    };
    for (int i = 0; i < 2 * copies; ++i) call(i);
    check(cudaStreamSynchronize(stream), "warm-up");
    std::vector<float> us;
    for (int t = 0; t < trials; ++t) {
      check(cudaEventRecord(start, stream), "cudaEventRecord");
      for (int i = 0; i < reps; ++i) call(i);
      check(cudaEventRecord(stop, stream), "cudaEventRecord");
      check(cudaEventSynchronize(stop), "timed calls");
      float ms;
      check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
      us.push_back(1e3f * ms / reps);
    }
    std::sort(us.begin(), us.end());
    const float med = us[us.size() / 2];
    std::printf("%6d %6d %6d %10.2f %10.2f %8.3f\n", m, k, n, med, us[0],
                (b_bytes + s_bytes) / (med * 1e-6) / 1e12);
    std::fflush(stdout);
    for (int i = 0; i < copies; ++i) {
      cudaFree(Bs[i]);
      cudaFree(ss[i]);
    }
    cudaFree(A);
    cudaFree(C);
    cudaFree(workspace);
    cudaFree(scratch);
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  return 0;
}
