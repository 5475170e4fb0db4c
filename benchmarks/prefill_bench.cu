// Correctness and speed of the Hopper prefill kernel (ffi/prefill_sm90.cu),
// standalone: the CUDA toolkit and cuBLAS, no JAX.
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Iffi \
//        benchmarks/prefill_bench.cu ffi/prefill_sm90.cu -lcublas -o prefill_bench
//   ./prefill_bench                      self-test, then check and time every case
//   ./prefill_bench --self-test          the self-test only (--quick: fewer coverage cases)
//   ./prefill_bench --check-only         self-test and checks, no timing
//   ./prefill_bench --shapes 8192x10240 --m 64,128 --dtype fp16 --group 128
//   ./prefill_bench --sweep              time every tile and split per case
//   ./prefill_bench --tile 128x256 --splits 2    force one configuration
//   ./prefill_bench --tile 128x256 --stream-k    force a stream-K launch of that tile
//   ./prefill_bench --memset-counters    zero the counters before every launch (see Scratch)
//   ./prefill_bench --zeros              every weight with random zero points (asymmetric)
// (-DNO_CUBLAS builds without the baseline and the full-output comparison.)
//
// Weights: random 32-bit words (every nibble pattern is a weight) in Marlin's
// packed layout, scales random in [0.5, 1.5] / sqrt(7 k) (outputs of order 1)
// in the permuted order. The reference reads the logical weight out of the
// packed words with the layout's defining formula (jax_marlin/packing.py:
// nibble p of word 4 lane + j of a 64-column chunk is tile j's element at row
// 2 (lane % 4) + (p >= 4) + 8 (p & 1), column lane / 4 + 8 ((p >> 1) & 1)),
// independent of the transpose this file's packer uses (the self-test checks
// one against the other).
//
// Checks per case (C poisoned with NaN first, with NaN guards before and
// after it): ||C - ref|| / ||ref|| against a float64 host reference of the
// dequantized weights (round((q - z) * s) to the dtype, z = 8 without --zeros) on a subsample of rows and
// columns, tolerance 1e-3 (fp16) or 3e-3 (bf16); every element finite; the
// guards untouched; a second call bit-identical; and the whole output against
// cuBLAS on the dense dequantized weight (informative: both round).
//
// Timing: CUDA events around `reps` calls that rotate through copies of the
// weights of at least 200 MB together (the H200's L2 is 60 MB), median of
// `trials`; cuBLAS (cublasGemmEx, fp32 accumulation) on dense [k, n] weights
// of the same values timed the same way.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#ifndef NO_CUBLAS
#include <cublas_v2.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include <time.h>

#include "bench_fill.cuh"
#include "prefill_sm90.h"

namespace {

// The case being run, named by the fatal error of a faulting launch.
std::string current_case = "setup";

void check(cudaError_t error, const char *what) {
  if (error != cudaSuccess) {
    std::fflush(stdout);
    std::fprintf(stderr, "FATAL %s: %s (case: %s)\n", what, cudaGetErrorString(error), current_case.c_str());
    std::printf("FATAL %s: %s (case: %s)\n", what, cudaGetErrorString(error), current_case.c_str());
    std::exit(1);
  }
}

// Waits for the stream, at most 30 s: a kernel that never finishes (a lost
// barrier arrival) ends the run naming its case instead of hanging it.
void finish(cudaStream_t stream, const char *what) {
  for (int ms = 0; ms < 30000; ++ms) {
    const cudaError_t e = cudaStreamQuery(stream);
    if (e != cudaErrorNotReady) return check(e, what);
    struct timespec t = {0, 1000000};
    nanosleep(&t, nullptr);
  }
  std::printf("FATAL %s: still running after 30 s, a hang (case: %s)\n", what, current_case.c_str());
  std::fflush(stdout);
  std::_Exit(3);
}

// --- host numerics -------------------------------------------------------------

using bench::to_float;

uint16_t from_float(float f, bool bf16) {
  if (bf16) {
    __nv_bfloat16 b = __float2bfloat16_rn(f);
    return reinterpret_cast<__nv_bfloat16_raw &>(b).x;
  }
  __half h = __float2half_rn(f);
  return reinterpret_cast<__half_raw &>(h).x;
}

uint64_t splitmix(uint64_t &state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
double uniform(uint64_t &state) { return (splitmix(state) >> 11) * (1.0 / 9007199254740992.0); }

// --- the layout ------------------------------------------------------------------

// The packed word and nibble of logical weight (row, col), by the defining
// formula (the inverse of: nibble p of word 4 lane + j is tile j's element at
// row 2 (lane % 4) + (p >= 4) + 8 (p & 1), column lane / 4 + 8 ((p >> 1) & 1)).
__host__ __device__ inline void locate(int64_t row, int64_t col, int64_t n, int64_t *word, int *shift) {
  const int r = int(row % 16), c = int(col % 64);
  const int j = c / 16, tc = c % 16;
  const int lane = 4 * (tc % 8) + (r % 8) / 2;
  const int p = 4 * (r % 2) + 2 * (tc / 8) + r / 8;
  *word = row / 16 * 2 * n + col / 64 * 128 + 4 * lane + j;
  *shift = 4 * p;
}

// Stored position of logical scale column `col`: grouped, stored 8 i + j of
// each 64 holds logical i + 8 j; per column, stored 8 i + 2 u + v of each 32
// holds logical 8 u + 2 i + v.
__host__ __device__ inline int64_t scale_position(int64_t col, int group_size) {
  if (group_size == -1) {
    const int c = int(col % 32), u = c / 8, i = (c % 8) / 2, v = c % 2;
    return col - c + 8 * i + 2 * u + v;
  }
  const int c = int(col % 64);
  return col - c + 8 * (c % 8) + c / 8;
}

// Logical column `col`'s zero point in row `g` of the packed zero points
// [groups, n / 8] (jax_marlin/packing.py, "the zero-point layout"): column
// 16 t + 8 h + i of a 64-column chunk is nibble 4 h + t of the chunk's word i.
__host__ __device__ inline int zero_point(const uint32_t *zeros, int64_t g, int64_t col, int64_t n) {
  const int c = int(col % 64), t = c / 16, h = (c % 16) / 8, i = c % 8;
  return int(zeros[g * (n / 8) + col / 64 * 8 + i] >> (4 * (4 * h + t))) & 15;
}

int groups_of(int64_t k, int group_size) { return group_size == -1 ? 1 : int(k / group_size); }

// The packer, written as packing.py's reshape-transpose: rows (tk, d, r, a),
// columns (chunk, j, b, c) -> word (tk, chunk, c, r, j) nibble (a, b, d).
std::vector<uint32_t> pack(const std::vector<uint8_t> &q, int64_t k, int64_t n) {
  std::vector<uint32_t> words(k / 16 * 2 * n, 0);
  for (int64_t tk = 0; tk < k / 16; ++tk)
    for (int64_t chunk = 0; chunk < n / 64; ++chunk)
      for (int c = 0; c < 8; ++c)
        for (int r = 0; r < 4; ++r)
          for (int j = 0; j < 4; ++j)
            for (int a = 0; a < 2; ++a)
              for (int b = 0; b < 2; ++b)
                for (int d = 0; d < 2; ++d) {
                  const int64_t row = 16 * tk + 8 * d + 2 * r + a;
                  const int64_t col = 64 * chunk + 16 * j + 8 * b + c;
                  const int64_t w = tk * 2 * n + chunk * 128 + 16 * c + 4 * r + j;
                  words[w] |= uint32_t(q[row * n + col]) << (4 * (4 * a + 2 * b + d));
                }
  return words;
}

// --- a problem on the device -------------------------------------------------------

struct Weight {
  int64_t k, n;
  int group_size;
  bool bf16;
  std::vector<uint32_t> qweight;  // packed
  std::vector<uint16_t> scales;   // [groups, n], stored (permuted) order
  std::vector<uint16_t> bias;     // [n]
  std::vector<uint32_t> zeros;    // [groups, n / 8] packed zero points, or empty (z = 8)
  uint32_t *d_qweight = nullptr, *d_zeros = nullptr;
  uint16_t *d_scales = nullptr, *d_bias = nullptr;

  int nibble(int64_t row, int64_t col) const {
    int64_t w;
    int shift;
    locate(row, col, n, &w, &shift);
    return int(qweight[w] >> shift) & 15;
  }
  float scale(int64_t row, int64_t col) const {
    const int64_t g = group_size == -1 ? 0 : row / group_size;
    return to_float(scales[g * n + scale_position(col, group_size)], bf16);
  }
  int zero(int64_t row, int64_t col) const {
    if (zeros.empty()) return 8;
    return zero_point(zeros.data(), group_size == -1 ? 0 : row / group_size, col, n);
  }
  // The dequantized weight as the kernel multiplies by it, in float64.
  double value(int64_t row, int64_t col) const {
    return to_float(from_float(float(nibble(row, col) - zero(row, col)) * scale(row, col), bf16), bf16);
  }
  void upload() {
    check(cudaMalloc(&d_qweight, qweight.size() * 4), "cudaMalloc qweight");
    check(cudaMalloc(&d_scales, scales.size() * 2), "cudaMalloc scales");
    check(cudaMalloc(&d_bias, bias.size() * 2), "cudaMalloc bias");
    check(cudaMemcpy(d_qweight, qweight.data(), qweight.size() * 4, cudaMemcpyHostToDevice), "copy");
    check(cudaMemcpy(d_scales, scales.data(), scales.size() * 2, cudaMemcpyHostToDevice), "copy");
    check(cudaMemcpy(d_bias, bias.data(), bias.size() * 2, cudaMemcpyHostToDevice), "copy");
    if (!zeros.empty()) {
      check(cudaMalloc(&d_zeros, zeros.size() * 4), "cudaMalloc zeros");
      check(cudaMemcpy(d_zeros, zeros.data(), zeros.size() * 4, cudaMemcpyHostToDevice), "copy");
    }
  }
  void release() {
    cudaFree(d_qweight);
    cudaFree(d_scales);
    cudaFree(d_bias);
    cudaFree(d_zeros);
    d_qweight = d_zeros = nullptr;
    d_scales = d_bias = nullptr;
  }
};

bool g_zeros = false;  // --zeros

Weight random_weight(int64_t k, int64_t n, int group_size, bool bf16, uint64_t seed) {
  Weight w{k, n, group_size, bf16};
  uint64_t state = seed;
  w.qweight.resize(k / 16 * 2 * n);
  for (auto &x : w.qweight) x = uint32_t(splitmix(state));
  const double unit = 1.0 / std::sqrt(7.0 * double(k));
  w.scales.resize(size_t(groups_of(k, group_size)) * n);
  for (auto &x : w.scales) x = from_float(float((0.5 + uniform(state)) * unit), bf16);
  w.bias.resize(n);
  for (auto &x : w.bias) x = from_float(float(2 * uniform(state) - 1), bf16);
  if (g_zeros) {
    // Every nibble of every word a zero point: 0..15, as asymmetric GPTQ and AWQ store them.
    w.zeros.resize(size_t(groups_of(k, group_size)) * (n / 8));
    for (auto &x : w.zeros) x = uint32_t(splitmix(state));
  }
  return w;
}

// --- device helpers ----------------------------------------------------------------

using bench::mix;

__device__ uint16_t dev_bits(float f, bool bf16) {
  if (bf16) {
    __nv_bfloat16 b = __float2bfloat16_rn(f);
    return reinterpret_cast<__nv_bfloat16_raw &>(b).x;
  }
  __half h = __float2half_rn(f);
  return reinterpret_cast<__half_raw &>(h).x;
}

__device__ float dev_float(uint16_t bits, bool bf16) {
  if (bf16) return __uint_as_float(uint32_t(bits) << 16);
  __half_raw r;
  r.x = bits;
  return __half2float(__half(r));
}

// Activations uniform in [-1, 1), rounded to the dtype.
__global__ void fill_x(uint16_t *x, size_t count, uint32_t seed, bool bf16) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count; i += size_t(gridDim.x) * blockDim.x)
    x[i] = dev_bits(2.f * (mix(i, seed) & 0xFFFFFF) / float(1 << 24) - 1.f, bf16);
}

#ifndef NO_CUBLAS
// The dense dequantized weight [k, n] (for cuBLAS), by the layout's formula.
__global__ void dequantize_dense(const uint32_t *qweight, const uint16_t *scales,
                                 const uint32_t *zeros, uint16_t *w, int64_t k, int64_t n,
                                 int group_size, bool bf16) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < k * n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / n, col = i % n;
    int64_t word;
    int shift;
    locate(row, col, n, &word, &shift);
    const int q = int(qweight[word] >> shift) & 15;
    const int64_t g = group_size == -1 ? 0 : row / group_size;
    const float s = dev_float(scales[g * n + scale_position(col, group_size)], bf16);
    const int z = zeros ? zero_point(zeros, g, col, n) : 8;
    w[i] = dev_bits(float(q - z) * s, bf16);
  }
}
#endif

// stats[0] += sum (a - b)^2, stats[1] += sum b^2, stats[2] += non-finite a,
// stats[3] += elements whose bits differ.
__global__ void compare(const uint16_t *a, const uint16_t *b, size_t count, bool bf16, double *stats) {
  double num = 0, den = 0, bad = 0, diff = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count; i += size_t(gridDim.x) * blockDim.x) {
    const float x = dev_float(a[i], bf16), y = dev_float(b[i], bf16);
    if (!isfinite(x)) bad += 1;
    if (a[i] != b[i]) diff += 1;
    if (isfinite(x) && isfinite(y)) {
      num += double(x - y) * double(x - y);
      den += double(y) * double(y);
    }
  }
  atomicAdd(&stats[0], num);
  atomicAdd(&stats[1], den);
  atomicAdd(&stats[2], bad);
  atomicAdd(&stats[3], diff);
}

// Elements of a poisoned (0xFFFF) region that something wrote.
__global__ void count_written(const uint16_t *p, size_t count, unsigned long long *out) {
  unsigned long long c = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count; i += size_t(gridDim.x) * blockDim.x)
    c += p[i] != 0xFFFF;
  atomicAdd(out, c);
}

struct Compared {
  double rel = 0;
  size_t nonfinite = 0, differing = 0;
};

Compared compare_device(const uint16_t *a, const uint16_t *b, size_t count, bool bf16) {
  double *stats;
  check(cudaMalloc(&stats, 4 * sizeof(double)), "cudaMalloc stats");
  check(cudaMemset(stats, 0, 4 * sizeof(double)), "memset stats");
  compare<<<1024, 256>>>(a, b, count, bf16, stats);
  double h[4];
  check(cudaMemcpy(h, stats, sizeof(h), cudaMemcpyDeviceToHost), "compare");
  cudaFree(stats);
  return {h[1] > 0 ? std::sqrt(h[0] / h[1]) : std::sqrt(h[0]), size_t(h[2]), size_t(h[3])};
}

size_t count_written_device(const uint16_t *p, size_t count) {
  unsigned long long *d, h = 0;
  check(cudaMalloc(&d, sizeof(*d)), "cudaMalloc count");
  check(cudaMemset(d, 0, sizeof(*d)), "memset count");
  count_written<<<256, 256>>>(p, count, d);
  check(cudaMemcpy(&h, d, sizeof(h), cudaMemcpyDeviceToHost), "count");
  cudaFree(d);
  return size_t(h);
}

// C [m, n] between two NaN guards of `kGuard` elements.
constexpr size_t kGuard = 1 << 16;
struct Output {
  uint16_t *base = nullptr;
  size_t count = 0;
  uint16_t *c() const { return base + kGuard; }
  void allocate(size_t elements) {
    count = elements;
    check(cudaMalloc(&base, (count + 2 * kGuard) * 2), "cudaMalloc C");
  }
  void poison(cudaStream_t stream) const {
    check(cudaMemsetAsync(base, 0xFF, (count + 2 * kGuard) * 2, stream), "poison C");
  }
  size_t guard_writes() const {
    return count_written_device(base, kGuard) + count_written_device(base + kGuard + count, kGuard);
  }
  void release() { cudaFree(base); }
};

// --memset-counters: the launcher zeroes the counters before every split or
// stream-K launch (a second launch, as before 2026-12-04's zeroed counters);
// by default they are zeroed once here and every kernel leaves them zero, as
// a JAX call site's are (ffi/zeroed_counters.h), so every case after the
// first also checks that the kernels before it left them zero.
bool g_memset_counters = false;

struct Scratch {
  int *counters = nullptr;
  float *partials = nullptr;
  void allocate(int64_t m, int64_t n, int64_t k) {
    const int64_t count = std::max<int64_t>(1, marlin::prefill_counters_size(m, n));
    check(cudaMalloc(&counters, count * 4), "cudaMalloc counters");
    check(cudaMemset(counters, 0, count * 4), "memset counters");
    check(cudaMalloc(&partials, std::max<int64_t>(1, marlin::prefill_partials_size(m, n, k)) * 4), "cudaMalloc partials");
  }
  void release() {
    cudaFree(counters);
    cudaFree(partials);
  }
};

// --- one call ----------------------------------------------------------------------

std::string config_name(const marlin::PrefillConfig &c) {
  return std::to_string(c.block_m) + "x" + std::to_string(c.block_n) + "/" +
         (c.stream_k ? std::string("sk") : std::to_string(c.splits));
}

struct Call {
  marlin::PrefillConfig config{0, 0, 0};  // block_m 0: the launcher chooses
  bool with_bias = true;
};

std::string run(const Call &call, const void *x, const uint32_t *qweight, const uint16_t *scales,
                const uint32_t *zeros, const uint16_t *bias, void *c, int64_t m, int64_t n,
                int64_t k, int group_size, bool bf16, const Scratch &scratch, cudaStream_t stream) {
  const void *b = call.with_bias ? bias : nullptr;
  current_case = std::string(bf16 ? "bf16" : "fp16") + " g" + std::to_string(group_size) + " m " + std::to_string(m) +
                 " k " + std::to_string(k) + " n " + std::to_string(n) + " tile " + config_name(call.config) +
                 (b ? " bias" : "") + (zeros ? " zeros" : "");
  if (call.config.block_m == 0)
    return marlin::prefill_matmul(x, qweight, scales, zeros, b, c, m, n, k, group_size, bf16,
                                  scratch.counters, scratch.partials, stream, false,
                                  !g_memset_counters);
  return marlin::prefill_matmul_config(call.config, x, qweight, scales, zeros, b, c, m, n, k, group_size,
                                       bf16, scratch.counters, scratch.partials, stream, false,
                                       !g_memset_counters);
}


// --- checking against the float64 reference ----------------------------------------

struct CheckResult {
  bool ok = true;
  double rel = 0;             // subsample vs float64
  double rel_cublas = -1;     // whole output vs cuBLAS (-1: not run)
  std::string detail;
};

// Rows and columns to compare: the edges of every tile size and a few at random.
std::vector<int64_t> sample(int64_t size, int count, uint64_t seed, std::initializer_list<int64_t> edges) {
  std::vector<int64_t> v;
  for (int64_t e : edges)
    for (int64_t x : {e - 1, e})
      if (x >= 0 && x < size) v.push_back(x);
  v.push_back(size - 1);
  uint64_t state = seed;
  if (size <= count) {
    v.clear();
    for (int64_t i = 0; i < size; ++i) v.push_back(i);
  } else {
    while (int(v.size()) < count) v.push_back(int64_t(splitmix(state) % uint64_t(size)));
  }
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
  return v;
}

// ||C - ref|| / ||ref|| over rows x cols, and the worst elements when it fails.
CheckResult check_sample(const Weight &w, const uint16_t *d_x, const uint16_t *d_c, int64_t m,
                         bool with_bias, const std::vector<int64_t> &rows,
                         const std::vector<int64_t> &cols, double tolerance, const char *what) {
  const int64_t k = w.k, n = w.n;
  std::vector<uint16_t> x(k), crow(n);
  // Dequantized columns, [cols][k], computed once.
  std::vector<double> wc(cols.size() * k);
  for (size_t j = 0; j < cols.size(); ++j)
    for (int64_t r = 0; r < k; ++r) wc[j * k + r] = w.value(r, cols[j]);
  double num = 0, den = 0;
  struct Bad {
    int64_t row, col;
    double got, want;
  };
  std::vector<Bad> bad;
  std::vector<double> xd(k);
  for (int64_t row : rows) {
    check(cudaMemcpy(x.data(), d_x + row * k, k * 2, cudaMemcpyDeviceToHost), "copy x row");
    check(cudaMemcpy(crow.data(), d_c + row * n, n * 2, cudaMemcpyDeviceToHost), "copy C row");
    for (int64_t r = 0; r < k; ++r) xd[r] = to_float(x[r], w.bf16);
    for (size_t j = 0; j < cols.size(); ++j) {
      double ref = with_bias ? to_float(w.bias[cols[j]], w.bf16) : 0.0;
      const double *wj = &wc[j * k];
      for (int64_t r = 0; r < k; ++r) ref += xd[r] * wj[r];
      const double got = to_float(crow[cols[j]], w.bf16);
      const double d = std::isfinite(got) ? got - ref : 1e30;
      num += d * d;
      den += ref * ref;
      if (!(std::abs(d) <= 4 * tolerance * (std::abs(ref) + 1))) bad.push_back({row, cols[j], got, ref});
    }
  }
  CheckResult result;
  result.rel = std::sqrt(num / std::max(den, 1e-300));
  result.ok = result.rel <= tolerance;
  if (!result.ok || !bad.empty()) {
    char line[256];
    std::snprintf(line, sizeof(line), "    %s: %zu of %zu sampled elements off (rel %.3e, tolerance %.1e); first:", what,
                  bad.size(), rows.size() * cols.size(), result.rel, tolerance);
    result.detail = line;
    for (size_t i = 0; i < bad.size() && i < 12; ++i) {
      std::snprintf(line, sizeof(line), " (m %lld, n %lld: got %.5g want %.5g)", (long long)bad[i].row,
                    (long long)bad[i].col, bad[i].got, bad[i].want);
      result.detail += line;
    }
    // Which (8-row, 16-column) blocks hold the bad elements: layout bugs show as patterns.
    std::map<std::pair<int64_t, int64_t>, int> blocks;
    for (auto &b : bad) blocks[{b.row / 8, b.col / 16}]++;
    result.detail += "\n    bad (row/8, col/16) blocks:";
    int shown = 0;
    for (auto &[where, count] : blocks)
      if (shown++ < 24) {
        std::snprintf(line, sizeof(line), " (%lld,%lld):%d", (long long)where.first, (long long)where.second, count);
        result.detail += line;
      }
    if (!bad.empty()) result.ok = false;
  }
  return result;
}

// --- the self-test: one tile with inputs whose product is known exactly -------------

int self_test_failures = 0;

void report(const char *name, bool ok, const std::string &detail) {
  std::printf("  %-58s %s\n", name, ok ? "ok" : "FAILED");
  if (!ok) {
    ++self_test_failures;
    if (!detail.empty()) std::printf("%s\n", detail.c_str());
  }
  std::fflush(stdout);
}

// The packer against the defining formula, and both scale permutations.
void self_test_layout() {
  const int64_t k = 64, n = 128;
  std::vector<uint8_t> q(k * n);
  uint64_t state = 7;
  for (auto &v : q) v = uint8_t(splitmix(state) & 15);
  Weight w{k, n, 64, false};
  w.qweight = pack(q, k, n);
  int wrong = 0;
  std::string detail;
  for (int64_t r = 0; r < k; ++r)
    for (int64_t c = 0; c < n; ++c)
      if (w.nibble(r, c) != q[r * n + c] && wrong++ < 8)
        detail += "    nibble (" + std::to_string(r) + ", " + std::to_string(c) + ")\n";
  report("layout: packer (transpose) = formula (docstring)", wrong == 0, detail);
  bool perm_ok = true;
  for (int g : {64, -1}) {
    std::vector<int> seen(n, 0);
    for (int64_t c = 0; c < n; ++c) seen[scale_position(c, g)]++;
    for (int64_t c = 0; c < n; ++c) perm_ok &= seen[c] == 1 && scale_position(scale_position(c, g), g) == c;
  }
  report("layout: scale permutations are involutions", perm_ok, "");
}

// One 64 x 64 x 64 tile (one consumer warpgroup, one stage): x one-hot
// (x[i][kk] = [kk == i]) so C[i][j] = W[i][j] exactly: every element of C
// names the weight element the kernel put there. Then grouped scales of
// powers of two (still exact), then random x.
void self_test_tile(bool bf16, cudaStream_t stream) {
  const int64_t m = 64, k = 64, n = 64;
  const char *dt = bf16 ? "bf16" : "fp16";
  for (int group_size : {-1, 64, 32}) {
    Weight w = random_weight(k, n, group_size, bf16, 11 + group_size);
    uint64_t state = 5;
    for (auto &s : w.scales) s = from_float(group_size == -1 ? 1.f : float(1 << (splitmix(state) % 3)) / 2, bf16);
    w.upload();
    std::vector<uint16_t> x(m * k, from_float(0.f, bf16));
    for (int64_t i = 0; i < m; ++i) x[i * k + i] = from_float(1.f, bf16);
    uint16_t *d_x;
    check(cudaMalloc(&d_x, x.size() * 2), "cudaMalloc x");
    check(cudaMemcpy(d_x, x.data(), x.size() * 2, cudaMemcpyHostToDevice), "copy x");
    Output out;
    out.allocate(m * n);
    out.poison(stream);
    Scratch scratch;
    scratch.allocate(m, n, k);
    Call call{{64, 128, 1}, false};
    std::string why = run(call, d_x, w.d_qweight, w.d_scales, w.d_zeros, w.d_bias, out.c(), m, n, k, group_size, bf16, scratch, stream);
    finish(stream, "self-test tile");
    std::vector<uint16_t> c(m * n);
    check(cudaMemcpy(c.data(), out.c(), c.size() * 2, cudaMemcpyDeviceToHost), "copy C");
    int wrong = 0;
    std::string detail = why.empty() ? "" : "    launch: " + why + "\n";
    std::map<std::string, int> kinds;
    for (int64_t i = 0; i < m && why.empty(); ++i)
      for (int64_t j = 0; j < n; ++j) {
        const float want = float(w.value(i, j)), got = to_float(c[i * n + j], bf16);
        if (got != want) {
          if (wrong++ < 16) {
            // Where did the value come from? Search the weight for it in row i and column j.
            std::string from;
            for (int64_t jj = 0; jj < n && from.empty(); ++jj)
              if (float(w.value(i, jj)) == got && jj != j) from = " (= W[" + std::to_string(i) + "][" + std::to_string(jj) + "]?)";
            for (int64_t ii = 0; ii < k && from.empty(); ++ii)
              if (float(w.value(ii, j)) == got && ii != i) from = " (= W[" + std::to_string(ii) + "][" + std::to_string(j) + "]?)";
            detail += "    C[" + std::to_string(i) + "][" + std::to_string(j) + "] = " + std::to_string(got) +
                      ", want W[" + std::to_string(i) + "][" + std::to_string(j) + "] = " + std::to_string(want) + from + "\n";
          }
          kinds[std::isfinite(got) ? "wrong value" : "not written (NaN)"]++;
        }
      }
    for (auto &[kind, count] : kinds) detail += "    " + std::to_string(count) + " x " + kind + "\n";
    char name[128];
    std::snprintf(name, sizeof(name), "tile 64x64x64 %s g%d, x one-hot: C = W exactly", dt, group_size);
    report(name, why.empty() && wrong == 0 && out.guard_writes() == 0, detail);

    // Random activations, bias, same tile: float64 reference.
    fill_x<<<64, 256, 0, stream>>>(d_x, m * k, 3, bf16);
    out.poison(stream);
    call.with_bias = true;
    why = run(call, d_x, w.d_qweight, w.d_scales, w.d_zeros, w.d_bias, out.c(), m, n, k, group_size, bf16, scratch, stream);
    finish(stream, "self-test tile random");
    std::vector<int64_t> all(64);
    for (int i = 0; i < 64; ++i) all[i] = i;
    CheckResult r = check_sample(w, d_x, out.c(), m, true, all, all, bf16 ? 3e-3 : 1e-3, "random x");
    std::snprintf(name, sizeof(name), "tile 64x64x64 %s g%d, random x + bias: rel %.2e", dt, group_size, r.rel);
    report(name, why.empty() && r.ok && out.guard_writes() == 0, why.empty() ? r.detail : "    launch: " + why);
    cudaFree(d_x);
    out.release();
    scratch.release();
    w.release();
  }
}

// Every branch on small shapes: m tails, partial last tiles (n = 320: 5 chunks), both
// warpgroups, several stages, each m tile and split count, groups, bias.
void self_test_coverage(bool bf16, bool quick, cudaStream_t stream) {
  const int64_t k = 2048, n = 320;
  const char *dt = bf16 ? "bf16" : "fp16";
  uint16_t *d_x;
  const int64_t max_m = 300;
  check(cudaMalloc(&d_x, max_m * k * 2), "cudaMalloc x");
  fill_x<<<256, 256, 0, stream>>>(d_x, max_m * k, 9, bf16);
  for (int group_size : {128, 64, 32, -1}) {
    if (quick && group_size != 128) continue;
    Weight w = random_weight(k, n, group_size, bf16, 100 + group_size);
    w.upload();
    for (int64_t m : {1, 7, 64, 65, 100, 129, 200, 256, 300}) {
      if (quick && m != 7 && m != 129 && m != 300) continue;
      for (const marlin::PrefillConfig &tile : marlin::kPrefillTiles) {
        const int block_m = tile.block_m, block_n = tile.block_n;
        for (int splits : {1, 2, 3, 0}) {  // 0: stream-K
          if (splits > marlin::prefill_max_splits(m, n, k, block_m, block_n)) continue;
          if (block_m == 256 && m < 129 && splits != 1) continue;
          if (splits == 0 && !marlin::prefill_stream_k_allowed(m, n, block_m, block_n)) continue;
          Output out;
          out.allocate(m * n);
          out.poison(stream);
          Scratch scratch;
          scratch.allocate(m, n, k);
          Call call{{block_m, block_n, splits ? splits : 1, splits == 0}, (m + splits) % 2 == 0};
          std::string why = run(call, d_x, w.d_qweight, w.d_scales, w.d_zeros, w.d_bias, out.c(), m, n, k, group_size, bf16, scratch, stream);
          finish(stream, "coverage");
          std::vector<int64_t> rows = sample(m, 40, m, {64, 128, 256}), cols = sample(n, 192, 3, {});
          CheckResult r = check_sample(w, d_x, out.c(), m, call.with_bias, rows, cols, bf16 ? 3e-3 : 1e-3, "coverage");
          const size_t guards = out.guard_writes();
          const Compared nan = compare_device(out.c(), out.c(), m * n, bf16);
          char name[160];
          std::snprintf(name, sizeof(name), "%s g%-3d m %3lld k %lld n %lld tile %s%s: rel %.2e", dt, group_size,
                        (long long)m, (long long)k, (long long)n, config_name(call.config).c_str(),
                        call.with_bias ? " bias" : "", r.rel);
          std::string detail = why.empty() ? r.detail : "    launch: " + why;
          if (guards) detail += "\n    " + std::to_string(guards) + " guard elements written (out of bounds)";
          if (nan.nonfinite) detail += "\n    " + std::to_string(nan.nonfinite) + " non-finite outputs";
          report(name, why.empty() && r.ok && guards == 0 && nan.nonfinite == 0, detail);
          out.release();
          scratch.release();
        }
      }
    }
    w.release();
  }
  cudaFree(d_x);
}

// --- timing --------------------------------------------------------------------------

template <typename F> double time_us(F call, int copies, int trials, cudaStream_t stream) {
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  for (int i = 0; i < copies + 2; ++i) call(i);
  finish(stream, "warm-up");
  // Enough calls per trial for about 2 ms, rotating the weight copies.
  check(cudaEventRecord(start, stream), "record");
  for (int i = 0; i < 5; ++i) call(i);
  check(cudaEventRecord(stop, stream), "record");
  check(cudaEventSynchronize(stop), "estimate");
  float ms;
  check(cudaEventElapsedTime(&ms, start, stop), "elapsed");
  const int reps = std::max(copies, std::min(400, int(2.0 / std::max(ms / 5, 1e-4f))));
  std::vector<double> us;
  for (int t = 0; t < trials; ++t) {
    check(cudaEventRecord(start, stream), "record");
    for (int i = 0; i < reps; ++i) call(i);
    check(cudaEventRecord(stop, stream), "record");
    check(cudaEventSynchronize(stop), "timed calls");
    check(cudaEventElapsedTime(&ms, start, stop), "elapsed");
    us.push_back(1e3 * ms / reps);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

// --- the cases -----------------------------------------------------------------------

struct Options {
  bool self_test_only = false, check_only = false, sweep = false, skip_self_test = false, quick = false;
  std::vector<std::pair<int64_t, int64_t>> shapes = {{8192, 10240}, {8192, 57344}, {28672, 8192}, {4096, 6144},
                                                     {4096, 4096},  {4096, 28672}, {14336, 4096}};
  std::vector<int64_t> ms = {64, 128, 256, 512, 1024, 2048, 4096};
  std::vector<bool> dtypes = {false, true};
  std::vector<int> groups = {128, -1};
  marlin::PrefillConfig force{0, 0, 0};
  int trials = 5;
};

double target_for(int64_t m) { return m <= 128 ? 1.5 : m <= 256 ? 1.1 : 1.0; }

struct Row {
  std::string label;
  int64_t m;
  double ours_us, cublas_us;
  bool check_ok;
};

std::vector<std::string> check_failures;
std::vector<Row> rows_out;

void run_cases(const Options &opt, cudaStream_t stream) {
#ifndef NO_CUBLAS
  cublasHandle_t handle;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "FATAL cublasCreate failed\n");
    std::exit(1);
  }
  cublasSetStream(handle, stream);
#endif
  int device, sms;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "attribute");
  const int64_t max_m = *std::max_element(opt.ms.begin(), opt.ms.end());
  std::printf("\n%-5s %-4s %-12s %5s %-7s %9s %7s %9s %7s %7s %9s %9s %4s %s\n", "dtype", "g", "k x n", "m", "tile",
              "ours_us", "TFLOP/s", "cublas_us", "TFLOP/s", "speedup", "err_ref", "err_cublas", "det", "target");
  for (bool bf16 : opt.dtypes)
    for (int group_size : opt.groups)
      for (const auto &shape : opt.shapes) {
        const int64_t k = shape.first, n = shape.second;
        if (group_size != -1 && k % group_size) continue;
        Weight w = random_weight(k, n, group_size, bf16, uint64_t(k * 131 + n * 7 + group_size + 1000 * bf16));
        w.upload();
        const size_t q_bytes = w.qweight.size() * 4 + w.scales.size() * 2;
        const size_t rotate = size_t(200) << 20;
        const int q_copies = int(std::max<size_t>(2, rotate / q_bytes + 1));
        std::vector<uint32_t *> qs(q_copies);
        std::vector<uint16_t *> ss(q_copies);
        qs[0] = w.d_qweight;
        ss[0] = w.d_scales;
        for (int i = 1; i < q_copies; ++i) {
          check(cudaMalloc(&qs[i], w.qweight.size() * 4), "cudaMalloc qweight copy");
          check(cudaMalloc(&ss[i], w.scales.size() * 2), "cudaMalloc scales copy");
          check(cudaMemcpy(qs[i], w.d_qweight, w.qweight.size() * 4, cudaMemcpyDeviceToDevice), "copy");
          check(cudaMemcpy(ss[i], w.d_scales, w.scales.size() * 2, cudaMemcpyDeviceToDevice), "copy");
        }
        uint16_t *d_x;
        check(cudaMalloc(&d_x, max_m * k * 2), "cudaMalloc x");
        fill_x<<<1024, 256, 0, stream>>>(d_x, max_m * k, uint32_t(k + n), bf16);
#ifndef NO_CUBLAS
        const size_t dense_bytes = size_t(k) * n * 2;
        const int dense_copies = opt.check_only ? 1 : int(std::max<size_t>(1, rotate / dense_bytes + 1));
        std::vector<uint16_t *> dense(dense_copies);
        for (int i = 0; i < dense_copies; ++i) {
          check(cudaMalloc(&dense[i], dense_bytes), "cudaMalloc dense weight");
          if (i == 0)
            dequantize_dense<<<4096, 256, 0, stream>>>(w.d_qweight, w.d_scales, w.d_zeros, dense[0], k, n,
                                                        group_size, bf16);
          else
            check(cudaMemcpyAsync(dense[i], dense[0], dense_bytes, cudaMemcpyDeviceToDevice, stream), "copy");
        }
#endif
        for (int64_t m : opt.ms) {
          Output out, again;
          out.allocate(m * n);
          again.allocate(m * n);
          Scratch scratch;
          scratch.allocate(m, n, k);
          const marlin::PrefillConfig chosen =
              opt.force.block_m ? opt.force : marlin::prefill_choose(m, n, k, sms);
          Call call{chosen, true};
          // Correctness: poisoned output and guards, float64 subsample, whole-output
          // finiteness, a bit-identical second call.
          out.poison(stream);
          again.poison(stream);
          std::string why = run(call, d_x, w.d_qweight, w.d_scales, w.d_zeros, w.d_bias, out.c(), m, n, k, group_size, bf16, scratch, stream);
          if (why.empty())
            why = run(call, d_x, w.d_qweight, w.d_scales, w.d_zeros, w.d_bias, again.c(), m, n, k, group_size, bf16, scratch, stream);
          finish(stream, "check calls");
          char label[96];
          std::snprintf(label, sizeof(label), "%-5s %-4d %5lldx%-6lld", bf16 ? "bf16" : "fp16", group_size,
                        (long long)k, (long long)n);
          CheckResult r;
          Compared det;
          size_t guards = 0;
          if (why.empty()) {
            std::vector<int64_t> rows = sample(m, 24, m + 1, {64, 128, 256, 512}),
                                 cols = sample(n, 96, n + 3, {64, 128, 256});
            r = check_sample(w, d_x, out.c(), m, true, rows, cols, bf16 ? 3e-3 : 1e-3, "float64 reference");
            det = compare_device(again.c(), out.c(), m * n, bf16);
            guards = out.guard_writes() + again.guard_writes();
          }
          double rel_cublas = -1;
#ifndef NO_CUBLAS
          {
            // cuBLAS on the dense dequantized weight, whole output, with the bias
            // left out on both sides (a second kernel output without bias).
            Call plain{chosen, false};
            again.poison(stream);
            if (why.empty())
              why = run(plain, d_x, w.d_qweight, w.d_scales, w.d_zeros, w.d_bias, again.c(), m, n, k, group_size, bf16, scratch, stream);
            const float alpha = 1.f, beta = 0.f;
            cublasStatus_t st = cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, int(n), int(m), int(k), &alpha,
                                             dense[0], bf16 ? CUDA_R_16BF : CUDA_R_16F, int(n), d_x,
                                             bf16 ? CUDA_R_16BF : CUDA_R_16F, int(k), &beta, out.c(),
                                             bf16 ? CUDA_R_16BF : CUDA_R_16F, int(n), CUBLAS_COMPUTE_32F,
                                             CUBLAS_GEMM_DEFAULT);
            finish(stream, "cublas check");
            if (st == CUBLAS_STATUS_SUCCESS && why.empty()) rel_cublas = compare_device(again.c(), out.c(), m * n, bf16).rel;
          }
#endif
          const bool ok = why.empty() && r.ok && det.nonfinite == 0 && det.differing == 0 && guards == 0 &&
                          (rel_cublas < 0 || rel_cublas < (bf16 ? 1e-2 : 3e-3));
          std::string detail;
          if (!why.empty()) detail += "    launch: " + why + "\n";
          if (!r.detail.empty()) detail += r.detail + "\n";
          if (det.nonfinite) detail += "    " + std::to_string(det.nonfinite) + " non-finite outputs\n";
          if (det.differing) detail += "    " + std::to_string(det.differing) + " outputs differ between two calls\n";
          if (guards) detail += "    " + std::to_string(guards) + " guard elements written (out of bounds)\n";
          if (!ok) check_failures.push_back(std::string(label) + " m " + std::to_string(m) + " tile " + config_name(chosen));

          double ours = 0, theirs = 0;
          if (!opt.check_only && why.empty()) {
            const double flops = 2.0 * m * n * k;
            std::vector<marlin::PrefillConfig> configs = {chosen};
            marlin::PrefillConfig best = chosen;
            double best_us = 0;
            if (opt.sweep) {
              configs.clear();
              for (const marlin::PrefillConfig &t : marlin::kPrefillTiles) {
                for (int s = 1; s <= marlin::prefill_max_splits(m, n, k, t.block_m, t.block_n); ++s)
                  configs.push_back({t.block_m, t.block_n, s});
                if (marlin::prefill_stream_k_allowed(m, n, t.block_m, t.block_n))
                  configs.push_back({t.block_m, t.block_n, 1, true});
              }
            }
            for (const auto &cfg : configs) {
              Call timed{cfg, false};
              std::string err;
              auto call_ours = [&](int i) {
                // (The zero points, 1/64 of the weights' bytes, are not rotated.)
                std::string e = run(timed, d_x, qs[i % q_copies], ss[i % q_copies], w.d_zeros, nullptr, out.c(), m, n, k,
                                    group_size, bf16, scratch, stream);
                if (!e.empty()) err = e;
              };
              const double us = time_us(call_ours, q_copies, opt.trials, stream);
              if (!err.empty()) {
                std::printf("  timing %s: %s\n", config_name(cfg).c_str(), err.c_str());
                continue;
              }
              if (opt.sweep)
                std::printf("  sweep %s m %lld tile %-7s %9.2f us %7.1f TFLOP/s\n", label, (long long)m,
                            config_name(cfg).c_str(), us, flops / us * 1e-6);
              if (cfg.block_m == chosen.block_m && cfg.block_n == chosen.block_n && cfg.splits == chosen.splits &&
                  cfg.stream_k == chosen.stream_k)
                ours = us;
              if (best_us == 0 || us < best_us) {
                best_us = us;
                best = cfg;
              }
            }
            if (opt.sweep)
              std::printf("  sweep %s m %lld best %-9s %9.2f us (chosen %s: %.2f us, %.3fx the best)\n", label,
                          (long long)m, config_name(best).c_str(), best_us, config_name(chosen).c_str(), ours,
                          ours > 0 ? ours / best_us : 0.0);
#ifndef NO_CUBLAS
            const float alpha = 1.f, beta = 0.f;
            auto call_cublas = [&](int i) {
              cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, int(n), int(m), int(k), &alpha, dense[i % dense_copies],
                           bf16 ? CUDA_R_16BF : CUDA_R_16F, int(n), d_x, bf16 ? CUDA_R_16BF : CUDA_R_16F, int(k),
                           &beta, again.c(), bf16 ? CUDA_R_16BF : CUDA_R_16F, int(n), CUBLAS_COMPUTE_32F,
                           CUBLAS_GEMM_DEFAULT);
            };
            theirs = time_us(call_cublas, dense_copies, opt.trials, stream);
#endif
          }
          const double flops = 2.0 * m * n * k;
          const double speedup = ours > 0 && theirs > 0 ? theirs / ours : 0;
          std::printf("%s %5lld %-7s %9.2f %7.1f %9.2f %7.1f %7.3f %9.2e %9.2e %4s %s%s\n", label, (long long)m,
                      config_name(chosen).c_str(), ours, ours > 0 ? flops / ours * 1e-6 : 0.0, theirs,
                      theirs > 0 ? flops / theirs * 1e-6 : 0.0, speedup, r.rel, rel_cublas,
                      det.differing == 0 && why.empty() ? "yes" : "NO",
                      speedup == 0 ? "-" : speedup >= target_for(m) ? "met" : "MISSED",
                      ok ? "" : "  CHECK FAILED");
          if (!detail.empty()) std::printf("%s", detail.c_str());
          std::fflush(stdout);
          rows_out.push_back({label, m, ours, theirs, ok});
          out.release();
          again.release();
          scratch.release();
        }
        for (int i = 1; i < q_copies; ++i) {
          cudaFree(qs[i]);
          cudaFree(ss[i]);
        }
#ifndef NO_CUBLAS
        for (auto *d : dense) cudaFree(d);
#endif
        cudaFree(d_x);
        w.release();
      }
#ifndef NO_CUBLAS
  cublasDestroy(handle);
#endif
}

std::vector<std::string> split_list(const std::string &s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t end = s.find(',', start);
    if (end == std::string::npos) end = s.size();
    if (end > start) out.push_back(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char **argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--self-test") opt.self_test_only = true;
    else if (a == "--check-only") opt.check_only = true;
    else if (a == "--no-self-test") opt.skip_self_test = true;
    else if (a == "--quick") opt.quick = true;
    else if (a == "--sweep") opt.sweep = true;
    else if (a == "--trials") opt.trials = std::atoi(value().c_str());
    else if (a == "--tile") {
      if (std::sscanf(value().c_str(), "%dx%d", &opt.force.block_m, &opt.force.block_n) != 2) {
        std::fprintf(stderr, "--tile wants BLOCK_MxBLOCK_N, e.g. 128x256\n");
        return 2;
      }
    }
    else if (a == "--splits") opt.force.splits = std::atoi(value().c_str());
    else if (a == "--stream-k") opt.force.stream_k = true;
    else if (a == "--memset-counters") g_memset_counters = true;
    else if (a == "--zeros") g_zeros = true;
    else if (a == "--shapes") {
      opt.shapes.clear();
      for (auto &s : split_list(value())) {
        long long k, n;
        if (std::sscanf(s.c_str(), "%lldx%lld", &k, &n) != 2) {
          std::fprintf(stderr, "bad shape '%s' (want KxN)\n", s.c_str());
          return 2;
        }
        opt.shapes.push_back({k, n});
      }
    } else if (a == "--m") {
      opt.ms.clear();
      for (auto &s : split_list(value())) opt.ms.push_back(std::atoll(s.c_str()));
    } else if (a == "--dtype") {
      std::string d = value();
      opt.dtypes = d == "fp16" ? std::vector<bool>{false} : d == "bf16" ? std::vector<bool>{true} : std::vector<bool>{false, true};
    } else if (a == "--group") {
      opt.groups.clear();
      for (auto &s : split_list(value())) opt.groups.push_back(std::atoi(s.c_str()));
    } else {
      std::fprintf(stderr, "unknown argument '%s'\n", a.c_str());
      return 2;
    }
  }
  if (opt.force.block_m && opt.force.splits == 0) opt.force.splits = 1;
  if (!opt.force.block_m && opt.force.splits) opt.force = {128, 128, opt.force.splits};

  int device;
  cudaDeviceProp prop;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  std::printf("device: %s, sm_%d%d, %d SMs, L2 %d MB\n", prop.name, prop.major, prop.minor,
              prop.multiProcessorCount, prop.l2CacheSize >> 20);
  cudaStream_t stream;
  check(cudaStreamCreate(&stream), "cudaStreamCreate");

  if (!opt.skip_self_test) {
    std::printf("self-test\n");
    self_test_layout();
    for (bool bf16 : {false, true}) self_test_tile(bf16, stream);
    if (self_test_failures == 0)
      for (bool bf16 : {false, true}) self_test_coverage(bf16, opt.quick, stream);
    std::printf("self-test: %d failed\n", self_test_failures);
  }
  if (!opt.self_test_only) run_cases(opt, stream);

  // Summary: last, short.
  std::printf("\nSUMMARY\n");
  std::printf("self-test failures: %d%s\n", self_test_failures, opt.skip_self_test ? " (skipped)" : "");
  if (!opt.self_test_only) {
    std::printf("case checks failed: %zu of %zu\n", check_failures.size(), rows_out.size());
    for (auto &f : check_failures) std::printf("  FAILED %s\n", f.c_str());
    std::map<int64_t, std::vector<double>> by_m;
    std::map<int64_t, int> missed;
    for (auto &r : rows_out)
      if (r.ours_us > 0 && r.cublas_us > 0) {
        by_m[r.m].push_back(r.cublas_us / r.ours_us);
        if (r.cublas_us / r.ours_us < target_for(r.m)) missed[r.m]++;
      }
    for (auto &[m, v] : by_m) {
      double lg = 0;
      for (double x : v) lg += std::log(x);
      std::printf("m %5lld: speedup vs cuBLAS geomean %.3f min %.3f max %.3f, target %.1f missed in %d of %zu\n",
                  (long long)m, std::exp(lg / v.size()), *std::min_element(v.begin(), v.end()),
                  *std::max_element(v.begin(), v.end()), target_for(m), missed[m], v.size());
    }
  }
  const bool failed = self_test_failures > 0 || !check_failures.empty();
  std::printf("RESULT: %s\n", failed ? "CHECKS FAILED" : "all checks passed");
  return failed ? 1 : 0;
}
