// The launcher of the Hopper prefill kernel (prefill_sm90.cuh): checks the
// problem and the device, picks the m tile and k split, builds the TMA tensor
// map of the activations and launches one instantiation.
#include "prefill_sm90.h"

#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <mutex>
#include <string>
#include <type_traits>

#include "marlin_launch.h"
#include "pdl_launch.cuh"
#include "prefill_sm90.cuh"

namespace marlin {
namespace {

// cuTensorMapEncodeTiled from the driver the runtime loaded, so that the
// library does not link libcuda itself.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder(std::string *why) {
  static std::once_flag once;
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  static std::string error;
  std::call_once(once, [] {
    void *fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                     cudaEnableDefault, &found);
    if (e != cudaSuccess)
      error = cuda_error("cudaGetDriverEntryPointByVersion(cuTensorMapEncodeTiled)", e);
    else if (found != cudaDriverEntryPointSuccess || !fn)
      error = "jax_marlin: the CUDA driver has no cuTensorMapEncodeTiled (needs 12.0 or newer)";
    else
      encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  });
  *why = error;
  return encode;
}

// The activations [m, k] as TMA sees them: k innermost, boxes of 64 k x
// block_m rows, 128-byte swizzle (prefill_sm90.cuh: the wgmma B layout); rows
// past m read as zeros.
std::string encode_a_map(CUtensorMap *map, const void *A, int64_t m, int64_t k, int block_m,
                         bool bf16) {
  std::string why;
  PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder(&why);
  if (!encode) return why;
  const cuuint64_t dims[2] = {cuuint64_t(k), cuuint64_t(m)};
  const cuuint64_t strides[1] = {cuuint64_t(k) * 2};
  const cuuint32_t box[2] = {cuuint32_t(kPrefillBlockK), cuuint32_t(block_m)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUtensorMapDataType type =
      bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  CUresult r = encode(map, type, 2, const_cast<void *>(A), dims, strides, box, element_strides,
                      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return "jax_marlin: cuTensorMapEncodeTiled failed (CUresult " + std::to_string(int(r)) +
           ") for A [" + std::to_string(m) + ", " + std::to_string(k) + "]";
  return {};
}

template <typename scalar_t, int block_m, int block_n, int group_size, bool has_zeros,
          bool stream_k>
std::string launch(const CUtensorMap &map, const prefill::Args<scalar_t> &args, int device,
                   int max_shared, bool pdl, cudaStream_t stream) {
  constexpr int bytes = prefill::Smem<block_m, block_n, has_zeros>::bytes;
  auto *kernel =
      prefill::prefill_kernel<scalar_t, block_m, block_n, group_size, has_zeros, stream_k>;
  if (bytes > max_shared)
    return "jax_marlin: the prefill tile needs " + std::to_string(bytes) +
           " bytes of shared memory per block, the device allows " + std::to_string(max_shared);
  // Once per device: the image the device runs must be an sm_90 one (a build
  // without sm_90a would run an sm_80 image, whose body has no wgmma; a
  // compute_90 image without the "a" traps), and the shared memory limit raised.
  static std::once_flag once[kMaxDevices];
  static cudaError_t attr_error[kMaxDevices];
  static int image[kMaxDevices];
  std::call_once(once[device], [&] {
    cudaFuncAttributes attr;
    attr_error[device] = cudaFuncGetAttributes(&attr, kernel);
    if (!attr_error[device]) {
      image[device] = attr.binaryVersion;
      attr_error[device] =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    }
  });
  if (attr_error[device]) return cuda_error("cudaFuncSetAttribute", attr_error[device]);
  if (image[device] != 90)
    return "jax_marlin: the prefill kernel was not built for sm_90a (the device runs an sm_" +
           std::to_string(image[device]) +
           " image); build with -gencode=arch=compute_90a,code=sm_90a";
  const dim3 grid = args.stream_k_blocks ? dim3(args.stream_k_blocks, 1, 1)
                                         : dim3(args.m_tiles, (args.n + block_n - 1) / block_n,
                                                args.splits);
  // With `pdl` the blocks may start while the previous kernel finishes: the
  // producer requests its first stages' weights, then waits for that kernel
  // before it loads A (griddepcontrol.wait); nothing is written before.
  if (cudaError_t error = launch_kernel(kernel, grid, dim3(prefill::kThreads), size_t(bytes),
                                        stream, pdl, 0, map, args))
    return cuda_error("prefill kernel launch", error);
  return {};
}

template <typename scalar_t, int block_m, int block_n, bool has_zeros, bool stream_k>
std::string launch_group(int64_t group_size, const CUtensorMap &map,
                         const prefill::Args<scalar_t> &args, int device, int max_shared,
                         bool pdl, cudaStream_t stream) {
  auto run = [&](auto group) {
    return launch<scalar_t, block_m, block_n, decltype(group)::value, has_zeros, stream_k>(
        map, args, device, max_shared, pdl, stream);
  };
  switch (group_size) {
    case 32: return run(std::integral_constant<int, 32>{});
    case 64: return run(std::integral_constant<int, 64>{});
    case 128: return run(std::integral_constant<int, 128>{});
    default: return run(std::integral_constant<int, -1>{});
  }
}

template <int m, int n> struct Tile {
  static constexpr int first = m, second = n;
};

// The tiles of kPrefillTiles, each built with and without zero points, and
// those of prefill_stream_k_tile also as stream-K kernels.
template <typename scalar_t>
std::string launch_tile(const PrefillConfig &config, int64_t group_size, const CUtensorMap &map,
                        const prefill::Args<scalar_t> &args, int device, int max_shared,
                        bool pdl, cudaStream_t stream) {
  auto group = [&](auto tile) {
    constexpr int block_m = decltype(tile)::first, block_n = decltype(tile)::second;
    auto zeros = [&](auto stream_k) {
      constexpr bool sk = decltype(stream_k)::value;
      if (args.zeros)
        return launch_group<scalar_t, block_m, block_n, true, sk>(group_size, map, args, device,
                                                                  max_shared, pdl, stream);
      return launch_group<scalar_t, block_m, block_n, false, sk>(group_size, map, args, device,
                                                                 max_shared, pdl, stream);
    };
    if constexpr (prefill_stream_k_tile(block_m, block_n))
      if (config.stream_k) return zeros(std::true_type{});
    return zeros(std::false_type{});
  };
  switch (config.block_m * 1000 + config.block_n) {
    case 64128: return group(Tile<64, 128>{});
    case 128128: return group(Tile<128, 128>{});
    case 256128: return group(Tile<256, 128>{});
    case 64256: return group(Tile<64, 256>{});
    default: return group(Tile<128, 256>{});
  }
}

// The fastest tile and split of the Llama-2/3 70B and 8B projections on an
// H200 (132 SMs) at m = 64, 128, ..., 4096, measured with every configuration
// (`prefill_bench --sweep`, benchmarks/results/h200-2026-12-03-prefill-sweep.txt):
// the configuration with the least geometric-mean loss over fp16 g128, bf16
// g128 and fp16 g-1 (at most 1.13x the best of one of them, mostly 1.0x).
// Stream-K launches were timed later (h200-2026-12-04-prefill-stream-k.txt):
// they win on 8192 x 10240 at m = 512 (160 tiles of 128 x 256, 1.2 waves:
// -17% fp16 g128, -18% bf16, -12% g-1) and within 1-4% either way on a few
// other rows, which keep their entries.
struct MeasuredPrefill {
  int k, n;
  PrefillConfig by_m[7];  // m = 64, 128, 256, 512, 1024, 2048, 4096
};
constexpr MeasuredPrefill kMeasuredPrefill[] = {
    {8192, 10240, {{64, 256, 3}, {128, 256, 3}, {128, 256, 3}, {128, 256, 1, true}, {256, 128, 1}, {256, 128, 1}, {128, 256, 1}}},
    {8192, 8192, {{64, 256, 4}, {128, 256, 4}, {256, 128, 2}, {256, 128, 1}, {256, 128, 1}, {256, 128, 1}, {256, 128, 1}}},
    {8192, 57344, {{64, 256, 1}, {128, 256, 1}, {256, 128, 1}, {256, 128, 1}, {128, 256, 1}, {128, 256, 1}, {128, 256, 1}}},
    {28672, 8192, {{64, 256, 4}, {128, 256, 4}, {256, 128, 2}, {256, 128, 1}, {256, 128, 1}, {256, 128, 1}, {256, 128, 1}}},
    {4096, 6144, {{64, 256, 5}, {128, 128, 2}, {128, 128, 1}, {128, 256, 1}, {256, 128, 1}, {256, 128, 1}, {128, 256, 1}}},
    {4096, 4096, {{64, 128, 4}, {128, 128, 4}, {128, 128, 2}, {128, 128, 1}, {256, 128, 1}, {256, 128, 1}, {128, 256, 1}}},
    {4096, 28672, {{64, 256, 1}, {128, 256, 1}, {256, 128, 1}, {128, 256, 1}, {256, 128, 1}, {256, 128, 1}, {128, 256, 1}}},
    {14336, 4096, {{64, 256, 8}, {128, 128, 4}, {256, 128, 4}, {256, 128, 2}, {256, 128, 1}, {256, 128, 1}, {128, 256, 1}}},
};
constexpr int kMeasuredPrefillSms = 132;

// The measured configuration of the nearest m (in log scale) for a layer of
// the table, if the rules allow it at this m; an invalid config otherwise.
PrefillConfig measured_prefill(int64_t m, int64_t n, int64_t k) {
  for (const MeasuredPrefill &layer : kMeasuredPrefill) {
    if (layer.k != k || layer.n != n) continue;
    int bucket = 0;  // m = 64 << bucket
    while (bucket < 6 && m * m > (int64_t(64) << bucket) * (int64_t(128) << bucket)) ++bucket;
    const PrefillConfig &c = layer.by_m[bucket];
    if (c.stream_k ? prefill_stream_k_allowed(m, n, c.block_m, c.block_n)
                   : c.splits <= prefill_max_splits(m, n, k, c.block_m, c.block_n))
      return c;
  }
  return {0, 0, 0};
}

}  // namespace

// Elsewhere, a cost model: the relative cost (in SM cycles) of a launch is the
// waves of thread blocks times the cost of one block, k stages times the cost
// of a stage plus the pipeline's fill and epilogue (and the fp32 partial sums
// of a split). A stage costs the most of its tensor-core time (the two
// warpgroups' wgmmas: 4 block_m cycles per 128 columns), its L2 traffic (A
// tile and weights, at about 28 bytes per cycle and SM) and its HBM traffic
// (weights, about 20 bytes per cycle and SM), plus 40 cycles of overhead. It
// picked within 1.1x of the best on the table's layers at m >= 2048 but up to
// 1.5x off on the 4096-deep ones at m = 128-256 and on 8192 x 10240 at
// m = 512-1024 (it prefers 128 x 256 tiles where 256 x 128 or 128 x 128 win).
PrefillConfig prefill_choose(int64_t m, int64_t n, int64_t k, int sms) {
  if (sms == kMeasuredPrefillSms)
    if (const PrefillConfig c = measured_prefill(m, n, k); c.splits > 0) return c;
  const int64_t k_tiles = k / kPrefillBlockK;
  PrefillConfig best = kPrefillTiles[0];
  double best_cost = -1;
  for (const PrefillConfig &t : kPrefillTiles) {
    if (t.block_m > 64 && m <= t.block_m / 2) continue;  // a smaller m tile covers m
    const int64_t tiles = prefill_tiles(m, n, t.block_m, t.block_n);
    const int max_splits = prefill_max_splits(m, n, k, t.block_m, t.block_n);
    const double tensor = 4.0 * t.block_m * t.block_n / 128;
    const double l2 = (128.0 * t.block_m + 32.0 * t.block_n) / 28;
    const double hbm = 32.0 * t.block_n / 20;
    const double stage = std::max(tensor, std::max(l2, hbm)) + 40;
    for (int splits = 1; splits <= max_splits; ++splits) {
      const int64_t waves = (tiles * splits + sms - 1) / sms;
      const int64_t stage_iters = (k_tiles + splits - 1) / splits;
      const double cost = double(waves) * (stage_iters * stage + 3000 + (splits > 1 ? 1000 : 0));
      if (best_cost < 0 || cost < 0.97 * best_cost) {
        best = {t.block_m, t.block_n, splits};
        best_cost = cost;
      }
    }
  }
  return best;
}

std::string prefill_matmul_config(const PrefillConfig &config, const void *A, const void *B,
                                  const void *s, const void *zeros, const void *bias, void *C,
                                  int64_t m, int64_t n, int64_t k, int64_t group_size, bool bf16,
                                  int *counters, float *partials, cudaStream_t stream,
                                  bool pdl, bool counters_zeroed) {
  auto str = [](int64_t v) { return std::to_string(v); };
  if (!is_group_size(group_size))
    return "jax_marlin: group_size must be -1, 32, 64 or 128, got " + str(group_size);
  if (m < 0 || k <= 0 || n <= 0 || k % 64 || n % 64 || (group_size != -1 && k % group_size))
    return "jax_marlin: the prefill kernel needs k, n multiples of 64 and k of the group "
           "size, got m = " + str(m) + ", k = " + str(k) + ", n = " + str(n) +
           ", group_size = " + str(group_size);
  if (k * n / 8 >= (int64_t(1) << 31) || m >= (int64_t(1) << 31) || k >= (int64_t(1) << 31))
    return "jax_marlin: problem too large for the prefill kernel's 32-bit indices";
  bool built = false;
  for (const PrefillConfig &t : kPrefillTiles)
    built |= t.block_m == config.block_m && t.block_n == config.block_n;
  if (!built)
    return "jax_marlin: no prefill tile of " + str(config.block_m) + " x " + str(config.block_n);
  const int max_splits = prefill_max_splits(m, n, k, config.block_m, config.block_n);
  if (config.splits < 1 || config.splits > max_splits)
    return "jax_marlin: prefill splits = " + str(config.splits) + " outside 1.." + str(max_splits);
  if (config.stream_k && config.splits != 1)
    return "jax_marlin: a stream-K prefill launch has splits = 1, got " + str(config.splits);
  if (config.stream_k && !prefill_stream_k_tile(config.block_m, config.block_n))
    return "jax_marlin: no stream-K prefill kernel of " + str(config.block_m) + " x " +
           str(config.block_n);
  if (config.stream_k && !prefill_stream_k_allowed(m, n, config.block_m, config.block_n))
    return "jax_marlin: a stream-K prefill launch runs at most " +
           str(kPrefillMaxSplitBlocks) + " tiles, got " +
           str(prefill_tiles(m, n, config.block_m, config.block_n));
  if (m == 0) return {};
  for (const void *p : {A, B, s, zeros})
    if (reinterpret_cast<uintptr_t>(p) % 16)
      return "jax_marlin: the prefill kernel needs A, B, s and zeros 16-byte aligned";
  const bool shared_tiles = config.splits > 1 || config.stream_k;
  if (shared_tiles && (!counters || !partials))
    return "jax_marlin: a split or stream-K prefill launch needs counters and partials";

  int device;
  const DeviceInfo *device_attrs;
  if (std::string why = current_device(&device, &device_attrs); !why.empty()) return why;
  const DeviceInfo &info = *device_attrs;
  if (info.major != 9 || info.minor != 0)
    return "jax_marlin: the prefill kernel needs compute capability 9.0 (sm_90a), this "
           "device has " + str(info.major) + "." + str(info.minor);

  CUtensorMap map;
  if (std::string why = encode_a_map(&map, A, m, k, config.block_m, bf16); !why.empty()) return why;
  if (shared_tiles && !counters_zeroed)
    if (cudaError_t error = cudaMemsetAsync(
            counters, 0, prefill_tiles(m, n, config.block_m, config.block_n) * sizeof(int), stream))
      return cuda_error("cudaMemsetAsync", error);

  const int mi = int(m), ni = int(n), ki = int(k);
  const int m_tiles = int((m + config.block_m - 1) / config.block_m);
  const int sk_blocks = config.stream_k ? prefill_stream_k_blocks(m, n, k, config.block_m,
                                                                  config.block_n, info.sms)
                                        : 0;
  const int64_t sk_total =
      prefill_tiles(m, n, config.block_m, config.block_n) * (k / kPrefillBlockK);
  if (config.stream_k && sk_total >= (int64_t(1) << 31))
    return "jax_marlin: problem too large for a stream-K prefill launch (" + str(sk_total) +
           " tile stages; 2^31 at most)";
  const int sk_q = sk_blocks ? int(sk_total / sk_blocks) : 0;
  const int sk_r = sk_blocks ? int(sk_total % sk_blocks) : 0;
  if (bf16) {
    prefill::Args<nv_bfloat16> args{static_cast<const uint32_t *>(B),
                                    static_cast<const nv_bfloat16 *>(s),
                                    static_cast<const nv_bfloat16 *>(bias),
                                    static_cast<nv_bfloat16 *>(C), partials, counters, mi, ni, ki,
                                    config.splits, static_cast<const uint32_t *>(zeros), sk_blocks,
                                    m_tiles, sk_q, sk_r};
    return launch_tile(config, group_size, map, args, device, info.max_shared, pdl, stream);
  }
  prefill::Args<half> args{static_cast<const uint32_t *>(B), static_cast<const half *>(s),
                           static_cast<const half *>(bias), static_cast<half *>(C), partials,
                           counters, mi, ni, ki, config.splits,
                           static_cast<const uint32_t *>(zeros), sk_blocks, m_tiles, sk_q, sk_r};
  return launch_tile(config, group_size, map, args, device, info.max_shared, pdl, stream);
}

std::string prefill_matmul(const void *A, const void *B, const void *s, const void *zeros,
                           const void *bias, void *C, int64_t m, int64_t n, int64_t k,
                           int64_t group_size, bool bf16, int *counters, float *partials,
                           cudaStream_t stream, bool pdl, bool counters_zeroed) {
  if (std::string why = check_problem(m, n, k, group_size); !why.empty())
    return "jax_marlin: " + why;
  if (m == 0) return {};
  int device;
  const DeviceInfo *device_attrs;
  if (std::string why = current_device(&device, &device_attrs); !why.empty()) return why;
  const DeviceInfo &info = *device_attrs;
  return prefill_matmul_config(prefill_choose(m, n, k, info.sms), A, B, s, zeros, bias, C, m, n,
                               k, group_size, bf16, counters, partials, stream, pdl,
                               counters_zeroed);
}

}  // namespace marlin
