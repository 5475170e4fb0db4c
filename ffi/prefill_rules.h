// Which problems the Hopper prefill kernel (prefill_sm90.h) runs and what
// scratch it needs, in plain C++ (no CUDA): the CPU build exports the sizes
// to Python too.
#pragma once

#include <cstdint>

#include "marlin_problem.h"

namespace marlin {

// Batches from this many rows on go to the prefill kernel; below it the
// Marlin kernel's mma.sync tiles (16..64 rows) fit better.
constexpr int kPrefillMinM = 64;

// One launch of the prefill kernel: the tile of C per thread block, block_m
// rows (the wgmma N: 64, 128 or 256 rows of A) by block_n columns (128 or
// 256: two consumer warpgroups of one or two 64-column chunks each; block_m
// 256 only with block_n 128, for the accumulators' registers), and how many
// thread blocks split k for each tile (1: no split; more: fp32 partial sums,
// added in a fixed order). With `stream_k` (and splits 1) the launch has one
// block per SM instead, each taking an equal share of all tiles' k stages in
// sequence: no wave is left part empty, and a tile cut between blocks is
// added up as a split one is.
struct PrefillConfig {
  int block_m;
  int block_n;
  int splits;
  bool stream_k = false;
};

// Every configuration the kernel is built for.
constexpr PrefillConfig kPrefillTiles[] = {{64, 128, 1}, {128, 128, 1}, {256, 128, 1},
                                           {64, 256, 1}, {128, 256, 1}};

constexpr int kPrefillBlockK = 64;      // k per pipeline stage (one 128-byte swizzle row of A)
constexpr int kPrefillMaxSplits = 8;    // k splits per output tile at most
constexpr int kPrefillMinSplitIters = 8;  // k stages per split at least
constexpr int kPrefillMaxSplitBlocks = 264;  // blocks of a split launch at most (2 waves of 132)
constexpr int kPrefillStreamKMaxBlocks = 132;  // blocks of a stream-K launch at most (Hopper's most SMs)

inline int64_t prefill_tiles(int64_t m, int64_t n, int block_m, int block_n) {
  return (m + block_m - 1) / block_m * ((n + block_n - 1) / block_n);
}

// The tiles built as stream-K kernels too: the large ones (256 x 128 and
// 128 x 256), whose few output tiles at m = 256..1024 leave part of the last
// wave of blocks empty.
constexpr bool prefill_stream_k_tile(int block_m, int block_n) {
  return block_m * block_n == 256 * 128;
}

// Whether a stream-K launch of this tile may run [m, k] x [k, n]: for at most
// two waves' worth of tiles (beyond that the last wave is a small part of
// the time), which also bounds its scratch.
inline bool prefill_stream_k_allowed(int64_t m, int64_t n, int block_m, int block_n) {
  return prefill_stream_k_tile(block_m, block_n) &&
         prefill_tiles(m, n, block_m, block_n) <= kPrefillMaxSplitBlocks;
}

// The blocks of a stream-K launch on `sms` multiprocessors: one per SM, at
// most one per k stage of all tiles.
inline int prefill_stream_k_blocks(int64_t m, int64_t n, int64_t k, int block_m, int block_n,
                                   int sms) {
  const int64_t iterations = prefill_tiles(m, n, block_m, block_n) * (k / kPrefillBlockK);
  int64_t blocks = sms < kPrefillStreamKMaxBlocks ? sms : kPrefillStreamKMaxBlocks;
  if (blocks > iterations) blocks = iterations;
  return blocks < 1 ? 1 : int(blocks);
}

// Whether the prefill kernel runs [m, k] x [k, n] with this group size: the
// Marlin kernel's rules (marlin_problem.h), from kPrefillMinM rows on.
inline bool prefill_supported(int64_t m, int64_t n, int64_t k, int64_t group_size) {
  return m >= kPrefillMinM && check_problem(m, n, k, group_size).empty();
}

// The largest number of k splits the rules allow for a tile (1: none).
inline int prefill_max_splits(int64_t m, int64_t n, int64_t k, int block_m, int block_n) {
  const int64_t tiles = prefill_tiles(m, n, block_m, block_n);
  int64_t s = k / kPrefillBlockK / kPrefillMinSplitIters;
  if (s > kPrefillMaxSplits) s = kPrefillMaxSplits;
  if (s > kPrefillMaxSplitBlocks / tiles) s = kPrefillMaxSplitBlocks / tiles;
  return s < 1 ? 1 : int(s);
}

// int32 counters a call needs (one per output tile of the smallest tile);
// the launcher zeroes them on the stream.
inline int64_t prefill_counters_size(int64_t m, int64_t n) { return prefill_tiles(m, n, 64, 128); }

// fp32 partial sums a call may need, for any configuration the rules allow
// (on any device): splits x tiles x block_m x block_n, or with stream-K two
// tiles' worth per block.
inline int64_t prefill_partials_size(int64_t m, int64_t n, int64_t k) {
  int64_t most = 0;
  for (const PrefillConfig &t : kPrefillTiles) {
    const int splits = prefill_max_splits(m, n, k, t.block_m, t.block_n);
    const int64_t floats =
        splits > 1 ? splits * prefill_tiles(m, n, t.block_m, t.block_n) * t.block_m * t.block_n : 0;
    const int64_t stream_k =
        prefill_stream_k_allowed(m, n, t.block_m, t.block_n)
            ? 2 * int64_t(prefill_stream_k_blocks(m, n, k, t.block_m, t.block_n,
                                                  kPrefillStreamKMaxBlocks)) *
                  t.block_m * t.block_n
            : 0;
    if (floats > most) most = floats;
    if (stream_k > most) most = stream_k;
  }
  return most;
}

}  // namespace marlin
