// XLA FFI handler for jax_marlin_matmul on the CPU: the same buffers and the
// same packed layout as the CUDA kernel, so everything but GPU speed can be
// tested without a GPU. Each 64-column slice of the weight is dequantized from
// the Marlin layout, (q - zero point) times the group's scale, into an fp32
// panel and multiplied in fp32; the per-column scale and the bias are applied
// in fp32 and the result is rounded to the output dtype (float16 or bfloat16)
// once. The fusions of marlin::Fusion run as the contract states them
// (ffi_common.h): the RMSNorm or SwiGLU prologue on the widened x, rounded to
// the dtype, before the act-order permutation; the residual added to the
// rounded y, rounded again. Slices are spread over threads; every output
// element (and every row's sum of squares) is computed by one thread in a
// fixed order, so results are deterministic. The workspace and reduce_scratch
// results exist for the CUDA kernel and are left untouched here.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "ffi_common.h"

namespace jax_marlin {
namespace {

float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in fp32
    const float magnitude = std::ldexp(float(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  const uint32_t bits = exponent == 31 ? sign | 0x7f800000u | (mantissa << 13)
                                       : sign | ((exponent + 112) << 23) | (mantissa << 13);
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest even, as the GPU's __float2half does.
uint16_t float_to_half(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint16_t sign = (bits >> 16) & 0x8000u;
  uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude >= 0x7f800000u)  // inf or nan
    return sign | 0x7c00u | (magnitude > 0x7f800000u ? 0x200u : 0u);
  if (magnitude >= 0x477ff000u) return sign | 0x7c00u;  // rounds past 65504
  if (magnitude < 0x38800000u) {  // below 2^-14: fp16 subnormal (or zero)
    float scaled;
    std::memcpy(&scaled, &magnitude, sizeof scaled);
    return sign | uint16_t(std::nearbyint(scaled * 16777216.0f));  // * 2^24
  }
  magnitude += 0xfffu + ((magnitude >> 13) & 1u);
  return sign | uint16_t((magnitude - (112u << 23)) >> 13);
}

// bfloat16 is the top half of a float32.
inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest even, as the GPU's __float2bfloat16 does; a NaN stays a
// (quiet) NaN instead of rounding into the infinity next to it.
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return uint16_t(bits >> 16);
}

// x, scales, bias, residual and norm_weight (all of the call's one dtype)
// widened to fp32.
void widen(const void *src, bool bf16, int64_t count, float *dst) {
  const uint16_t *h = static_cast<const uint16_t *>(src);
  if (bf16)
    for (int64_t i = 0; i < count; ++i) dst[i] = bf16_to_float(h[i]);
  else
    for (int64_t i = 0; i < count; ++i) dst[i] = half_to_float(h[i]);
}

// v rounded to the call's dtype (as the GPU stores it) and widened back.
inline uint16_t narrow(float v, bool bf16) { return bf16 ? float_to_bf16(v) : float_to_half(v); }
inline float round_to_dtype(float v, bool bf16) {
  return bf16 ? bf16_to_float(float_to_bf16(v)) : half_to_float(float_to_half(v));
}

// The prologue's x' [m, k], in x's own column order and rounded to the dtype,
// so that it is the x' the GPU multiplies: RMSNorm x' = dtype(x r w) with
// r = 1 / sqrt(sum_j x_j^2 / norm_size + eps) per row (padded columns of x
// are zero and add nothing to the sum), or SwiGLU x' = dtype(silu(gate) up)
// from x's rows [gate | up] of 2 k. The factors are multiplied in the GPU
// passes' order ((x r) w, then g / (1 + exp(-g)) up).
std::vector<float> prologue(const std::vector<float> &xf, const float *norm_weight, bool swiglu,
                            float norm_eps, int64_t norm_size, int64_t m, int64_t k, bool bf16) {
  std::vector<float> out(static_cast<size_t>(m * k));
  for (int64_t i = 0; i < m; ++i) {
    float *o = out.data() + i * k;
    if (swiglu) {
      const float *gate = xf.data() + i * 2 * k, *up = gate + k;
      for (int64_t j = 0; j < k; ++j)
        o[j] = round_to_dtype(gate[j] / (1.f + std::exp(-gate[j])) * up[j], bf16);
    } else {
      const float *xi = xf.data() + i * k;
      float sum = 0.f;
      for (int64_t j = 0; j < k; ++j) sum = std::fma(xi[j], xi[j], sum);
      const float r = 1.f / std::sqrt(sum / float(norm_size) + norm_eps);
      for (int64_t j = 0; j < k; ++j) o[j] = round_to_dtype(xi[j] * r * norm_weight[j], bf16);
    }
  }
  return out;
}

// Marlin's scale permutations (jax_marlin/packing.py): the stored scale at
// position t of each chunk is the logical scale perm[t] of that chunk.
// Grouped scales use chunks of 64 columns, per-column scales chunks of 32.
struct ScalePerms {
  int grouped[64];
  int per_column[32];
  ScalePerms() {
    for (int i = 0; i < 8; ++i)
      for (int j = 0; j < 8; ++j) grouped[8 * i + j] = i + 8 * j;
    const int offsets[8] = {0, 1, 8, 9, 16, 17, 24, 25};
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 8; ++j) per_column[8 * i + j] = 2 * i + offsets[j];
  }
};

// The zero point of column `col` (of n) from its row of packed zeros (n / 8
// words): word 8 (col / 64) + col % 8 of the row, nibble 4 h + t for column
// 16 t + 8 h + col % 8 of the 64-column chunk (jax_marlin/packing.py).
inline int zero_point(const int32_t *row, int64_t col) {
  const int64_t in_chunk = col % 64;
  const int t = int(in_chunk / 16), h = int(in_chunk / 8) % 2;
  const uint32_t word = static_cast<uint32_t>(row[8 * (col / 64) + in_chunk % 8]);
  return int((word >> (4 * (4 * h + t))) & 0xfu);
}

// Where nibble p of packed word `lane` (0..31) of a 16x16 tile lands in the
// tile: the mma.m16n8k16 B-fragment of that lane, with Marlin's
// [0, 2, 4, 6, 1, 3, 5, 7] interleave so that one shift-and-mask yields a
// half2 pair for the tensor cores.
inline int tile_row(int lane, int p) { return 2 * (lane % 4) + (p >= 4) + 8 * (p & 1); }
inline int tile_col(int lane, int p) { return lane / 4 + 8 * ((p >> 1) & 1); }

constexpr int kSlice = 64;  // columns per work item: one 1024-nibble chunk per tile row
constexpr int kRows = 4, kCols = 16;  // register block of the multiply
typedef float Vec8 __attribute__((vector_size(32)));

struct Problem {
  const float *x;          // [m, k]
  const int32_t *qweight;  // [k / 16, 2 n]
  const float *scales;     // [groups, n], logical (unpermuted) order
  const int8_t *zeros;     // [groups, n] zero points, logical order
  const float *bias;       // [n], or null for no bias
  const float *residual;   // [m, n], or null for none
  uint16_t *y;             // [m, n], float16 or bfloat16 bits
  int64_t m, n, k, group_size;
  bool bf16;
};

// On x86-64 also compile an AVX2+FMA version of the hot loop, picked at load
// time when the CPU has it; the baseline build targets plain SSE2.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && defined(__linux__)
#define JAX_MARLIN_CPU_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define JAX_MARLIN_CPU_CLONES
#endif

// y[:, 64 c : 64 c + 64] for one slice c.
JAX_MARLIN_CPU_CLONES void compute_slice(const Problem &p, int64_t c, std::vector<float> &panel) {
  const int64_t k = p.k, n = p.n;
  const bool grouped = p.group_size != -1;
  panel.resize(static_cast<size_t>(k) * kSlice);
  // Dequantize into four contiguous k x 16 strips: one row of qweight holds
  // 16 k-rows of the weight; its 128 words from 128 c on hold the four 16x16
  // tiles of this slice.
  for (int64_t tk = 0; tk < k / 16; ++tk) {
    const int32_t *words = p.qweight + tk * 2 * n + 128 * c;
    for (int lane = 0; lane < 32; ++lane) {
      for (int tile = 0; tile < 4; ++tile) {
        const uint32_t word = static_cast<uint32_t>(words[4 * lane + tile]);
        for (int nib = 0; nib < 8; ++nib) {
          const int64_t row = 16 * tk + tile_row(lane, nib);
          const int col = 16 * tile + tile_col(lane, nib);
          const int64_t group = grouped ? row / p.group_size : 0;
          float w = float(int((word >> (4 * nib)) & 0xfu) - p.zeros[group * n + kSlice * c + col]);
          if (grouped) w *= p.scales[group * n + kSlice * c + col];
          panel[(col / kCols) * k * kCols + row * kCols + col % kCols] = w;
        }
      }
    }
  }
  // Multiply: a 4-row x 16-column block of y at a time, whose accumulators
  // stay in registers while one contiguous 16-column strip of the panel
  // (k x 16 floats, L2-resident) streams by.
  for (int j0 = 0; j0 < kSlice; j0 += kCols) {
    const float *strip = &panel[(j0 / kCols) * k * kCols];
    for (int64_t i = 0; i < p.m; i += kRows) {
      const int rows = int(std::min<int64_t>(kRows, p.m - i));
      const float *xr[kRows];
      for (int r = 0; r < kRows; ++r) xr[r] = p.x + (i + std::min(r, rows - 1)) * k;
      // Accumulators as explicit 8-wide vectors (GCC/Clang vector extension):
      // GCC keeps plain float arrays on the stack, which is many times slower.
      Vec8 acc[kRows][kCols / 8] = {};
      for (int64_t kk = 0; kk < k; ++kk) {
        const float *w = strip + kk * kCols;
        Vec8 wv[kCols / 8];
        std::memcpy(wv, w, sizeof wv);
        for (int r = 0; r < kRows; ++r) {
          const float a = xr[r][kk];
          for (int h = 0; h < kCols / 8; ++h) acc[r][h] += a * wv[h];
        }
      }
      float block[kRows][kCols];
      std::memcpy(block, acc, sizeof block);
      for (int r = 0; r < rows; ++r) {
        uint16_t *out = p.y + (i + r) * n + kSlice * c + j0;
        for (int j = 0; j < kCols; ++j) {
          const int64_t col = kSlice * c + j0 + j;
          float v = block[r][j];
          if (!grouped) v *= p.scales[col];
          if (p.bias) v += p.bias[col];
          // The residual meets the rounded product: jm.matmul(...) + residual.
          if (p.residual) v = round_to_dtype(v, p.bf16) + p.residual[(i + r) * n + col];
          out[j] = narrow(v, p.bf16);
        }
      }
    }
  }
}

ffi::Error MatmulCpu(ffi::AnyBuffer x, ffi::Buffer<ffi::S32, 2> qweight, ffi::AnyBuffer scales,
                     ffi::Buffer<ffi::S32, 2> zeros, ffi::Buffer<ffi::S32, 1> perm,
                     ffi::AnyBuffer bias, ffi::AnyBuffer residual, ffi::AnyBuffer norm_weight,
                     ffi::Result<ffi::AnyBuffer> y, ffi::ResultBuffer<ffi::S32, 1> workspace,
                     ffi::ResultBuffer<ffi::F32, 1> reduce_scratch, int64_t group_size,
                     bool poison_output, float norm_eps, int64_t norm_size, bool swiglu) {
  auto dims = check_matmul(x, qweight, scales, zeros, perm, bias, residual, norm_weight, *y,
                           *workspace, *reduce_scratch, group_size, norm_eps, norm_size, swiglu);
  if (dims.has_error()) return dims.error();
  const int64_t m = dims->m, n = dims->n, k = dims->k;
  const bool bf16 = dims->bf16;
  uint16_t *out = static_cast<uint16_t *>(y->untyped_data());
  // The dtype's quiet NaN.
  if (poison_output) std::fill(out, out + m * n, uint16_t(bf16 ? 0x7fc0u : 0x7e00u));
  if (m == 0) return ffi::Error::Success();

  // x widened ([m, 2 k] with swiglu), then the prologue's x' in its place.
  const int64_t x_cols = dims->swiglu ? 2 * k : k;
  std::vector<float> xf(static_cast<size_t>(m * x_cols));
  widen(x.untyped_data(), bf16, m * x_cols, xf.data());
  if (dims->has_norm || dims->swiglu) {
    std::vector<float> wf;
    if (dims->has_norm) {
      wf.resize(static_cast<size_t>(k));
      widen(norm_weight.untyped_data(), bf16, k, wf.data());
    }
    xf = prologue(xf, wf.data(), dims->swiglu, norm_eps, norm_size, m, k, bf16);
  }
  if (dims->has_perm) {
    // Act-order: x's columns in the weight's stored row order. An index out
    // of range is clamped, as the CUDA kernels do (jm.pack never writes one).
    const int32_t *order = perm.typed_data();
    std::vector<float> row(static_cast<size_t>(k));
    for (int64_t i = 0; i < m; ++i) {
      float *xi = xf.data() + i * k;
      for (int64_t j = 0; j < k; ++j) row[j] = xi[std::clamp<int64_t>(order[j], 0, k - 1)];
      std::copy(row.begin(), row.end(), xi);
    }
  }
  std::vector<float> bf;
  if (dims->has_bias) {
    bf.resize(static_cast<size_t>(n));
    widen(bias.untyped_data(), bf16, n, bf.data());
  }

  std::vector<float> rf;
  if (dims->has_residual) {
    rf.resize(static_cast<size_t>(m * n));
    widen(residual.untyped_data(), bf16, m * n, rf.data());
  }

  static const ScalePerms perms;
  const int64_t groups = scales.dimensions()[0];
  const int chunk = group_size == -1 ? 32 : 64;
  const int *scale_perm = group_size == -1 ? perms.per_column : perms.grouped;
  std::vector<float> stored(static_cast<size_t>(groups * n)), sf(stored.size());
  widen(scales.untyped_data(), bf16, groups * n, stored.data());
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t base = 0; base < n; base += chunk)
      for (int t = 0; t < chunk; ++t) sf[g * n + base + scale_perm[t]] = stored[g * n + base + t];
  // Zero points in logical order: 8 everywhere for a symmetric weight.
  std::vector<int8_t> zf(static_cast<size_t>(groups * n), 8);
  if (dims->has_zeros)
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t col = 0; col < n; ++col)
        zf[g * n + col] = int8_t(zero_point(zeros.typed_data() + g * (n / 8), col));

  const Problem p{xf.data(), qweight.typed_data(), sf.data(), zf.data(),
                  bf.empty() ? nullptr : bf.data(), rf.empty() ? nullptr : rf.data(),
                  out, m, n, k, group_size, bf16};
  const int64_t slices = n / kSlice;
  // Threads only when there is work for them: about 2^22 multiply-adds each.
  const int64_t useful = std::max<int64_t>(1, m * n * k >> 22);
  const int64_t hw = std::max(1u, std::thread::hardware_concurrency());
  const int workers = int(std::min({hw, slices, useful}));
  std::atomic<int64_t> next{0};
  auto work = [&] {
    std::vector<float> panel;
    for (int64_t c; (c = next.fetch_add(1)) < slices;) compute_slice(p, c, panel);
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < workers; ++t) pool.emplace_back(work);
  work();
  for (auto &t : pool) t.join();
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_marlin

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMarlinMatmulCpu, jax_marlin::MatmulCpu,
                              jax_marlin::bind_matmul(xla::ffi::Ffi::Bind()));
