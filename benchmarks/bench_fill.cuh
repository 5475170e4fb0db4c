// Deterministic pseudo-random device data for the kernel timers
// (kernel_bench.cu, decode_bench.cu, prefill_bench.cu): 32 random bits per
// word (packed weights: every int4 pattern is a valid weight), or float16 /
// bfloat16 values in [lo, hi) (activations, scales, biases); and the host's
// reading of such a value back, for the float64 checks.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace bench {

__device__ inline uint32_t mix(uint64_t i, uint32_t seed) {
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

__global__ void fill_float(uint16_t *p, size_t n, uint32_t seed, float lo, float hi, bool bf16) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float v = lo + (hi - lo) * (mix(i, seed) & 0xFFFFFF) / float(1 << 24);
    if (bf16) {
      __nv_bfloat16 b = __float2bfloat16(v);
      p[i] = *reinterpret_cast<uint16_t *>(&b);
    } else {
      half h = __float2half(v);
      p[i] = *reinterpret_cast<uint16_t *>(&h);
    }
  }
}

// The float16 or bfloat16 value with these bits, on the host.
inline float to_float(uint16_t bits, bool bf16) {
  if (bf16) {
    const uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  __half_raw r;
  r.x = bits;
  return __half2float(__half(r));
}

}  // namespace bench
