// Which problems the Marlin kernel can run, in plain C++ (no CUDA, no XLA):
// the one statement of the kernel's rules. The CUDA launcher, both FFI
// handlers and, through the nanobind module (module.cc), the Python side at
// trace time all read them from here.
#pragma once

#include <cstdint>
#include <string>

namespace marlin {

constexpr int kTile = 16;         // the kernel works on 16x16 weight tiles
constexpr int kMinThreadN = 64;   // narrowest n tile
constexpr int kMaxThreadN = 256;  // widest n tile
constexpr int kMinThreadK = 64;   // shallowest k tile
constexpr int kMaxPar = 16;       // batch blocks of 64 rows run in one launch
// Largest m the decode kernel (decode_kernel.h) takes: where it runs the
// fusions inside (the Python lowering routes larger fused calls, module.cc).
constexpr int kDecodeMaxM = 16;
constexpr int kMaxBlocks = 256;   // thread blocks a launch runs at most (one per SM)

// Group sizes the kernel is instantiated for: rows of k that share one scale,
// or -1 for one scale per output column.
constexpr int kGroupSizes[] = {-1, 32, 64, 128};

inline bool is_group_size(int64_t g) {
  for (int size : kGroupSizes)
    if (g == size) return true;
  return false;
}

// What a call does around its product, fused into the decode kernel and run
// as passes around the other kernels (marlin_kernel.cu), for the FFI
// handlers of both platforms (ffi_common.h states the contract):
//   x' = x, or dtype(x r norm_weight) with r = rsqrt(sum x^2 / norm_size +
//        norm_eps) per row (RMSNorm), or with swiglu, x = [gate | up] of 2 k
//        columns a row, dtype(silu(gate) up) (SwiGLU), in fp32;
//   y  = dtype(x'[perm] W + bias), plus residual: dtype(y + residual).
// All null: the plain product.
struct Fusion {
  const void *residual = nullptr;     // [m, n], y's dtype
  const void *norm_weight = nullptr;  // [k], x's dtype
  bool swiglu = false;
  float norm_eps = 0.f;
  int64_t norm_size = 0;              // the logical k the mean divides by
  // Not a fusion: the caller vouches that the kernel before this call's on
  // the stream writes nothing the call reads as its weight (it is the
  // previous call of one jax_marlin chain, which writes activations only), so
  // the decode kernel may load its first weights before waiting for it.
  bool early_weights = false;
  bool prologue() const { return norm_weight != nullptr || swiglu; }
};

struct ThreadConfig {
  int thread_k;
  int thread_n;
  int threads;
};

constexpr bool operator==(const ThreadConfig &a, const ThreadConfig &b) {
  return a.thread_k == b.thread_k && a.thread_n == b.thread_n && a.threads == b.threads;
}

// Every tile the kernel is instantiated for (launch_tile in marlin_kernel.cuh
// compiles exactly these, for thread_m_blocks 1..4 and every group size).
// Nothing else reaches the kernel: there are no user-supplied configurations.
constexpr ThreadConfig kTiles[] = {
    {128, 128, 256},
    {128, 64, 128},
    {64, 256, 256},
    {64, 128, 128},
};
constexpr int kNumTiles = sizeof(kTiles) / sizeof(kTiles[0]);

// The order in which the launcher tries the tiles (indices into kTiles): for
// up to 16 rows deep k tiles first, then narrower n; for more rows the wide
// 64x256 tile first, which reuses each loaded A tile across more columns.
constexpr int kSmallBatchOrder[kNumTiles] = {0, 1, 2, 3};
constexpr int kLargeBatchOrder[kNumTiles] = {2, 0, 3, 1};

// The first tile in this batch size's order that divides (k, n), or null.
inline const ThreadConfig *choose_config(int64_t m, int64_t n, int64_t k) {
  const int *order = m <= 16 ? kSmallBatchOrder : kLargeBatchOrder;
  for (int i = 0; i < kNumTiles; ++i) {
    const ThreadConfig &c = kTiles[order[i]];
    if (k % c.thread_k == 0 && n % c.thread_n == 0) return &c;
  }
  return nullptr;
}

// int32 lock counters the kernel needs for an [m, n] output: one per (16-row
// block, 64-column slice) of its largest launch (at most kMaxPar blocks of 64
// rows), as the global reduction hands over each 16-row block separately.
inline int64_t marlin_locks_size(int64_t m, int64_t n) {
  const int64_t row_blocks = (m + kTile - 1) / kTile;
  return n / kMinThreadN * (row_blocks < 4 * kMaxPar ? row_blocks : 4 * kMaxPar);
}

// fp32 partial sums that thread blocks sharing an output tile hand to each
// other (the global reduction), for m rows of x: launches of 16-row tiles
// chain through one 16 x n tile, one per column slice; launches of 32..64-row
// tiles give each thread block a slot of one output tile (at most 64 x kMaxThreadN).
// Launches run one after another on the stream and reuse it.
inline int64_t marlin_scratch_size(int64_t m, int64_t n) {
  const int64_t row_blocks = (m + kTile - 1) / kTile;
  const int64_t slot = kTile * (row_blocks < 4 ? row_blocks : 4) * kMaxThreadN;
  const int64_t slots = row_blocks >= 2 ? kMaxBlocks * slot : 0;
  return slots > kTile * n ? slots : kTile * n;
}

inline std::string group_size_error(int64_t group_size) {
  return "group_size = " + std::to_string(group_size) +
         " is not supported; the kernel takes group_size 32, 64 or 128 (one scale per that "
         "many rows of k) or -1 (one scale per column)";
}

// Empty if the kernel runs a [k, n] weight as it is (k, n: the padded sizes
// it sees) with this group size, otherwise why not, naming the dimension.
inline std::string check_layer(int64_t k, int64_t n, int64_t group_size) {
  auto s = [](int64_t v) { return std::to_string(v); };
  const std::string shape = "[k, n] = [" + s(k) + ", " + s(n) + "]";
  if (!is_group_size(group_size)) return group_size_error(group_size);
  if (k <= 0 || n <= 0) return "weight shape " + shape + " must be positive";
  if (k % kMinThreadK != 0)
    return "k = " + s(k) + " (weight.shape[0], the input features) must be a multiple of " +
           s(kMinThreadK);
  if (n % kMinThreadN != 0)
    return "n = " + s(n) + " (weight.shape[1], the output features) must be a multiple of " +
           s(kMinThreadN);
  if (group_size != -1 && k % group_size != 0)
    return "k = " + s(k) + " must be a multiple of group_size = " + s(group_size);
  if (!choose_config(0, n, k))
    return "k = " + s(k) + " and n = " + s(n) +
           ": one of them must be a multiple of 128 (no kernel tile fits; the tiles are 128 "
           "deep or 128 wide)";
  // Offsets inside the kernel are 32-bit int4 (8 x fp16) indices.
  if (k * n / 8 >= (int64_t(1) << 31))
    return "weight " + shape + " is too large for the kernel's 32-bit offsets";
  return {};
}

// Empty if the kernel can run [m, k] x [k, n] with this group size, otherwise
// why not.
inline std::string check_problem(int64_t m, int64_t n, int64_t k, int64_t group_size) {
  if (std::string why = check_layer(k, n, group_size); !why.empty()) return why;
  if (m < 0) return "m = " + std::to_string(m) + " rows of x must not be negative";
  if (m * (k > n ? k : n) / 8 >= (int64_t(1) << 31))
    return "m = " + std::to_string(m) + " rows of x are too many for the kernel's 32-bit " +
           "offsets at k = " + std::to_string(k) + ", n = " + std::to_string(n) +
           "; split the batch";
  return {};
}

// The smallest [k_pad, n_pad] >= [k, n] the kernel runs with this group size,
// or an error (a group size the kernel does not take, sizes that are not
// positive, a padded weight too large). k rounds up to the k tile and the
// group, n to the n tile; when no tile fits both, the one whose rounding up
// adds fewer weight elements grows by its smallest tile (n on a tie, which
// keeps x as it is). A shape the kernel runs as it is stays unchanged.
struct PaddedShape {
  int64_t k, n;
  std::string error;
};

inline PaddedShape padded_shape(int64_t k, int64_t n, int64_t group_size) {
  if (!is_group_size(group_size)) return {k, n, group_size_error(group_size)};
  if (k <= 0 || n <= 0)
    return {k, n,
            "weight shape [k, n] = [" + std::to_string(k) + ", " + std::to_string(n) +
                "] must be positive"};
  auto round_up = [](int64_t v, int64_t multiple) { return (v + multiple - 1) / multiple * multiple; };
  // Group sizes are powers of two, so the larger of the two is their lcm.
  const int64_t k_multiple = group_size > kMinThreadK ? group_size : kMinThreadK;
  PaddedShape p{round_up(k, k_multiple), round_up(n, kMinThreadN), {}};
  if (!choose_config(0, p.n, p.k)) {
    // Growing k by its smallest tile adds k_multiple * n elements, growing n
    // adds kMinThreadN * k.
    if (k_multiple * p.n < kMinThreadN * p.k)
      p.k += k_multiple;
    else
      p.n += kMinThreadN;
  }
  p.error = check_layer(p.k, p.n, group_size);
  return p;
}

}  // namespace marlin
