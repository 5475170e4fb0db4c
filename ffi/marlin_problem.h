// Which problems the Marlin kernel can run, in plain C++ (no CUDA, no XLA), so
// that the CUDA launcher, both FFI handlers and their tests agree on one
// contract. jax_marlin/shapes.py states the same rules at trace time.
#pragma once

#include <cstdint>
#include <string>

namespace marlin {

constexpr int kTile = 16;        // the kernel works on 16x16 weight tiles
constexpr int kMinThreadN = 64;  // narrowest n tile
constexpr int kMaxThreadN = 256; // widest n tile
constexpr int kMinThreadK = 64;  // shallowest k tile
constexpr int kMaxPar = 16;      // batch blocks of 64 rows run in one launch

// int32 lock counters the kernel needs for an [m, n] output: one per (16-row
// block, 64-column slice) of its largest launch (at most kMaxPar blocks of 64
// rows), as the global reduction hands over each 16-row block separately.
inline int64_t workspace_size(int64_t m, int64_t n) {
  const int64_t row_blocks = (m + kTile - 1) / kTile;
  return n / kMinThreadN * (row_blocks < 4 * kMaxPar ? row_blocks : 4 * kMaxPar);
}

// Thread blocks a launch runs at most (one per SM; an H200 has 132).
constexpr int kMaxBlocks = 256;

// fp32 partial sums that thread blocks sharing an output tile hand to each
// other (the global reduction), for m rows of x: launches of 16-row tiles
// chain through one 16 x n tile, one per column slice; launches of 32..64-row
// tiles give each thread block a slot of one output tile (at most 64 x kMaxThreadN).
// Launches run one after another on the stream and reuse it.
inline int64_t reduce_scratch_size(int64_t m, int64_t n) {
  const int64_t row_blocks = (m + kTile - 1) / kTile;
  const int64_t slot = kTile * (row_blocks < 4 ? row_blocks : 4) * kMaxThreadN;
  const int64_t slots = row_blocks >= 2 ? kMaxBlocks * slot : 0;
  return slots > kTile * n ? slots : kTile * n;
}

// Group sizes the kernel is instantiated for: rows of k that share one scale,
// or -1 for one scale per output column.
inline bool is_group_size(int64_t g) { return g == -1 || g == 32 || g == 64 || g == 128; }

struct ThreadConfig {
  int thread_k;
  int thread_n;
  int threads;
};

// The seed's tile tables, ordered by priority. The launcher instantiates every
// entry (for thread_m_blocks 1..4 and both scale layouts) and nothing else
// reaches the kernel: there are no user-supplied thread configurations.
constexpr ThreadConfig kSmallBatchConfigs[] = {
    {128, 128, 256},  // default
    {128, 64, 128},   // reduce n 2x, same k
    {64, 256, 256},   // reduce k 2x, increase n 2x
    {64, 128, 128},   // reduce k 2x, same n
};
constexpr ThreadConfig kLargeBatchConfigs[] = {
    {64, 256, 256},   // default
    {128, 128, 256},  // reduce n 2x, increase k 2x
    {64, 128, 128},   // reduce n 2x, same k
    {128, 64, 128},   // reduce n 4x, increase k 2x
};

// The first tile in the table for this batch size that divides (k, n), or null.
inline const ThreadConfig *choose_config(int64_t m, int64_t n, int64_t k) {
  const ThreadConfig *table = m <= 16 ? kSmallBatchConfigs : kLargeBatchConfigs;
  for (int i = 0; i < 4; ++i)
    if (k % table[i].thread_k == 0 && n % table[i].thread_n == 0) return &table[i];
  return nullptr;
}

// Empty if the kernel can run [m, k] x [k, n] with this group size, otherwise
// why not.
inline std::string check_problem(int64_t m, int64_t n, int64_t k, int64_t group_size) {
  auto s = [](int64_t v) { return std::to_string(v); };
  if (!is_group_size(group_size))
    return "group_size must be -1, 32, 64 or 128, got " + s(group_size);
  if (k <= 0 || n <= 0 || m < 0)
    return "sizes must be positive (m = " + s(m) + ", k = " + s(k) + ", n = " + s(n) + ")";
  if (k % kMinThreadK != 0) return "k = " + s(k) + " must be a multiple of 64";
  if (n % kMinThreadN != 0) return "n = " + s(n) + " must be a multiple of 64";
  if (group_size != -1 && k % group_size != 0)
    return "k = " + s(k) + " must be a multiple of group_size = " + s(group_size);
  if (!choose_config(m, n, k))
    return "no kernel tile fits k = " + s(k) + ", n = " + s(n) +
           ": k or n must be a multiple of 128";
  // Offsets inside the kernel are 32-bit int4 (8 x fp16) indices.
  const int64_t limit = int64_t(1) << 31;
  if (k * n / 8 >= limit || m * k / 8 >= limit || m * n / 8 >= limit)
    return "problem too large for the kernel's 32-bit offsets";
  return {};
}

}  // namespace marlin
