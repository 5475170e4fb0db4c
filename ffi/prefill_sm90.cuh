// The Hopper (sm_90a) prefill kernel: C[m, n] = A[m, k] @ W[k, n] for m >= 64,
// with W the 4-bit weight in Marlin's packed layout (jax_marlin/packing.py),
// on wgmma tensor cores. prefill_sm90.cu holds the launcher.
//
// Operands swapped. wgmma multiplies a 64-row A operand, which may come from
// registers, by an N-column B operand from shared memory, N = 8..256 in steps
// of 8. The kernel computes C^T = W^T A^T: the weight is wgmma's A operand,
// dequantized in registers (64 columns of W per warpgroup), and the
// activations are the B operand (N = the m tile: 64, 128 or 256 rows of A, so
// batches of 64..256 rows waste nothing of the instruction).
//
// Why the packed layout feeds wgmma as it is. The register A operand of
// wgmma.m64nNk16 gives each warp w of the warpgroup rows 16 w .. 16 w + 15 in
// the layout of the mma.m16n8k16 A fragment: lane = 4 g + t holds
//   a0 a1: row g,     columns 2 t, 2 t + 1      a4 a5: row g,     columns 2 t + 8, 2 t + 9
//   a2 a3: row g + 8, columns 2 t, 2 t + 1      a6 a7: row g + 8, columns 2 t + 8, 2 t + 9
// (two 16-bit values per 32-bit register, the lower index in the low half).
// Here a row is a column n of W and a column a row k of W. Marlin's word
// 4 lane + j of a 64-column chunk holds tile j's nibbles p = 0..7 at
// (k, n) = (2 t + (p >= 4) + 8 (p & 1), g + 8 ((p >> 1) & 1)), so
//   nibble 0, 4: k = 2 t, 2 t + 1,     n = g        -> a0 a1
//   nibble 2, 6: k = 2 t, 2 t + 1,     n = g + 8    -> a2 a3
//   nibble 1, 5: k = 2 t + 8, 2 t + 9, n = g        -> a4 a5
//   nibble 3, 7: k = 2 t + 8, 2 t + 9, n = g + 8    -> a6 a7
// Marlin's dequant(q) returns the pairs (nibble 0, 4), (nibble 1, 5) and
// dequant(q >> 8) the pairs (2, 6), (3, 7), each with the lower nibble in the
// low half, so the fragment is {dequant(q)[0], dequant(q >> 8)[0],
// dequant(q)[1], dequant(q >> 8)[1]}, and warp w takes tile j = w, i.e. word
// 4 lane + w: rows 16 w + g, 16 w + g + 8 of the warpgroup are columns
// 16 w + g, 16 w + g + 8 of the chunk.
//
// Data movement. A producer warp issues all copies into a ring of stages in
// shared memory, each guarded by a "full" mbarrier (the copies' bytes) and an
// "empty" one (one arrival per consumer warp once its wgmmas have read the
// stage). Per stage of 64 k:
// - A tile [block_m, 64] by TMA, 128-byte swizzle: one 128-byte row per row
//   of A (k contiguous, wgmma's K-major B layout), rows of m >= prob_m filled
//   with zeros by TMA.
// - W: the four 16-row bands of the tile, each a contiguous 1 or 2 KiB of
//   qweight (block_n / 64 chunks of 64 columns), by 1-D bulk copies: every
//   weight byte is read from global memory once per m tile, in 1-2 KiB
//   transactions. The 4 words of a 16-byte unit are one lane's fragments of
//   the chunk's four 16-column tiles, so a warp reading one tile's words
//   (4 lane + tile) touches 8 banks: four wavefronts per 32-bit load. With
//   two chunks per warpgroup (n tile 256; symmetric weights) a warp takes
//   two adjacent tiles of one chunk instead (see `pair` below): one 8-byte
//   load with 2-way conflicts per k step, half the wavefronts (4-6% faster
//   on 64 x 256 at m = 64, H100 and H200; benchmarks/NOTES.md, 2026-12-07).
// - grouped scales: the tile's one or two rows of scales (block_n x 2 bytes),
//   and with zero points their one or two rows of those (block_n / 2 bytes;
//   per-column zero points are read once, from global memory, instead).
// Two consumer warpgroups each own one or two chunks of the tile (one
// accumulator of 64 x block_m each): they wait for a stage, dequantize and
// scale their weight fragments and issue a wgmma (k = 16) per k step and
// chunk, keeping the rest of a stage's wgmmas in flight while they
// dequantize the next fragment.
//
// Split k: with few output tiles, `splits` thread blocks share one tile, each
// summing a contiguous range of k; each writes its fp32 partial sums, the
// last to finish (a counter per tile) adds all of them in split order (so
// the result does not depend on which finishes last) and writes C.
// Stream-K (the large tiles): one block per SM, each running an equal share
// of all tiles' k stages in sequence, so that no wave is left part empty; a
// tile cut between blocks is added up as a split one is, and the stage ring
// runs on from one tile into the next (the producer does not wait for the
// consumers' epilogue).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "marlin_kernel.cuh"
#include "mbarrier.cuh"
#include "pdl_launch.cuh"
#include "prefill_sm90.h"

namespace marlin {
namespace prefill {

constexpr int kThreads = 384;       // a producer warpgroup and two consumer warpgroups
constexpr int kConsumerThreads = 256;
constexpr int kKSteps = kPrefillBlockK / 16;  // wgmmas (k = 16) per stage and chunk
constexpr int kChunkBytes = 512;    // 16 rows x 64 columns of 4-bit weights

// Shared memory of one tile: the stage ring, then the mbarriers.
template <int block_m, int block_n, bool has_zeros = false> struct Smem {
  static constexpr int chunks = block_n / 64;              // 64-column chunks per tile
  static constexpr int w_band = chunks * kChunkBytes;      // one 16-row band of the tile's weights
  static constexpr int s_row = block_n * 2;                // one row of the tile's scales
  static constexpr int a_stage = block_m * kPrefillBlockK * 2;  // 128 bytes per row of A
  static constexpr int w_stage = kKSteps * w_band;
  static constexpr int s_stage = 2 * s_row;  // groups of 32 rows: two per stage
  static constexpr int z_row = block_n / 2;  // one row of the tile's zero points (4 bits each)
  static constexpr int z_stage = has_zeros ? 2 * z_row : 0;
  static constexpr int stage = a_stage + w_stage + s_stage + z_stage;
  static constexpr int budget = 220 * 1024;
  static constexpr int stages = budget / stage < 16 ? budget / stage : 16;
  static constexpr int a_offset = 0;
  static constexpr int w_offset = stages * a_stage;
  static constexpr int s_offset = w_offset + stages * w_stage;
  static constexpr int z_offset = s_offset + stages * s_stage;
  static constexpr int bar_offset = z_offset + stages * z_stage;
  // 1024 bytes of slack to align the ring: the 128-byte swizzle repeats every
  // 8 rows (1 KiB), and TMA and wgmma agree on it only from a 1 KiB boundary.
  static constexpr int bytes = 1024 + bar_offset + 2 * stages * 8;

  static_assert(block_m % 64 == 0 && block_m <= 256, "m tile: the wgmma N, 64..256");
  static_assert(block_n == 128 || block_n == 256, "n tile: two warpgroups of one or two chunks");
  static_assert(block_m * block_n <= 256 * 128, "accumulators: at most 128 registers per thread");
  static_assert(a_stage % 1024 == 0, "each A stage starts on a swizzle period");
  static_assert(stages >= 3, "at least three stages in flight");
};

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)

// --- copies (mbarriers and the plain bulk copy: mbarrier.cuh) -----------------

// One box of the tensor map (coordinates innermost first) into shared memory.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap *map, int c0, int c1,
                                            uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

// --- wgmma -------------------------------------------------------------------

// Orders this thread's register writes (the dequantized A fragments, the
// zeroed accumulators) before the wgmmas that read them.
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int pending> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(pending) : "memory");
}

// Shared-memory matrix descriptor of a K-major operand in the 128-byte
// swizzle that TMA wrote: rows of 128 bytes (64 k), 8-row swizzle atoms of
// 1 KiB one after another.
//   bits  0-13  start address >> 4
//   bits 16-29  leading byte offset >> 4: unused for K-major swizzled layouts
//               (a k = 16 slice, 32 bytes, never leaves its 128-byte row); 1
//   bits 32-45  stride byte offset >> 4: 1024 bytes from one 8-row atom to the next
//   bits 49-51  base offset: 0, the atoms start on 1 KiB boundaries
//   bits 62-63  swizzle mode: 1 = 128-byte
// The k = 16 slice s of a stage starts 32 s bytes into the row: the hardware
// applies the swizzle (16-byte unit index XOR row % 8) to the address it
// computes, as TMA did when writing, which is why the base must be 1 KiB
// aligned and why advancing the start address by 32 bytes is right.
__device__ __forceinline__ uint64_t kmajor_sw128_desc(uint32_t addr) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}

template <int N> struct Wgmma;

// wgmma.m64nNk16 with A from registers, B from shared memory (K-major:
// imm-trans-b = 0), fp32 accumulators d, always accumulating (scale-d true).
// The accumulator list is the only difference between the sizes.
#define PREFILL_WGMMA_N64(TY)                                                         \
  asm volatile(                                                                  \
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                  \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {"              \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
      "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"   \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc))

#define PREFILL_WGMMA_N128(TY)                                                         \
  asm volatile(                                                                  \
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                  \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {"              \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" \
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"   \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc))

#define PREFILL_WGMMA_N256(TY)                                                         \
  asm volatile(                                                                  \
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                  \
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " {"              \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127" \
      "}, {%128, %129, %130, %131}, %132, p, 1, 1, 0;\n}\n"   \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc))

#define PREFILL_WGMMA_SIZE(N)                                                                \
  template <> struct Wgmma<N> {                                                              \
    template <typename scalar_t>                                                             \
    static __device__ __forceinline__ void mma(float (&d)[N / 2], const uint32_t (&a)[4],    \
                                               uint64_t desc) {                              \
      if constexpr (std::is_same_v<scalar_t, half>)                                          \
        PREFILL_WGMMA_N##N("f16");                                                           \
      else                                                                                   \
        PREFILL_WGMMA_N##N("bf16");                                                          \
    }                                                                                        \
  };
PREFILL_WGMMA_SIZE(64)
PREFILL_WGMMA_SIZE(128)
PREFILL_WGMMA_SIZE(256)
#undef PREFILL_WGMMA_SIZE
#undef PREFILL_WGMMA_N64
#undef PREFILL_WGMMA_N128
#undef PREFILL_WGMMA_N256

#endif  // sm_90a

template <typename scalar_t> struct Args {
  const uint32_t *qweight;  // [k / 16, 2 n] packed weight
  const scalar_t *scales;   // [k / group_size, n] or [1, n], permuted
  const scalar_t *bias;     // [n] or null
  scalar_t *c;              // [m, n]
  float *partials;          // split k: [tiles, splits, block_m block_n / 1024, 256] float4;
                            // stream-K: [blocks, 2, block_m block_n / 1024, 256] float4
  int *counters;            // split k, stream-K: one per tile, zero at launch, left zero
  int m, n, k, splits;
  const uint32_t *zeros;    // [k / group_size, n / 8] or [1, n / 8] packed zero points, if has_zeros
  int stream_k_blocks;      // 0: a block per tile and split; else stream-K over this many blocks
  int m_tiles;              // ceil(m / block_m)
  int sk_q, sk_r;           // stream-K: tiles x k / 64 iterations = sk_q stream_k_blocks + sk_r
};

// Stream-K: the tiles' k stages, tile after tile, form one sequence of
// `total` iterations, cut into `blocks` contiguous shares (q + 1 iterations
// for the first r blocks, q for the others: total = q blocks + r, below 2^31
// by the launcher's check); block b runs iterations [first(b), first(b + 1)).
// A tile whose stages fall to several blocks is finished by the last of them
// to arrive, which adds every block's fp32 partial sums in k order
// (deterministic).
struct StreamK {
  int q, r;
  __device__ __forceinline__ int first(int b) const { return b * q + (b < r ? b : r); }
  // The block that runs iteration u.
  __device__ __forceinline__ int block_of(int u) const {
    const int long_part = r * (q + 1);
    return u < long_part ? u / (q + 1) : r + (u - long_part) / q;
  }
};

// Stored position of logical column `col` among per-column scales: each run
// of 32 is permuted so that stored 8 i + 2 u + v holds logical 8 u + 2 i + v.
__host__ __device__ inline int column_scale_index(int col) {
  const int c = col & 31;
  return (col & ~31) + 8 * ((c & 7) >> 1) + 2 * (c >> 3) + (c & 1);
}

template <typename scalar_t, int block_m, int block_n, int group_size, bool has_zeros,
          bool stream_k>
__global__ void __launch_bounds__(kThreads, 1)
    prefill_kernel(const __grid_constant__ CUtensorMap a_map, const Args<scalar_t> args) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using S = Smem<block_m, block_n, has_zeros>;
  using T2 = typename ScalarType<scalar_t>::T2;
  constexpr int stages = S::stages;
  constexpr int acc_regs = block_m / 2;     // 64 x block_m fp32 over 128 threads, per chunk
  constexpr int wg_chunks = S::chunks / 2;  // chunks per consumer warpgroup
  constexpr int groups = kKSteps * wg_chunks;  // wgmma commit groups per stage

  extern __shared__ uint8_t smem_raw[];
  __shared__ int is_last;
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t base = (raw + 1023) & ~1023u;
  uint8_t *smem = smem_raw + (base - raw);
  const uint32_t full_bar = base + S::bar_offset;    // stage s: full_bar + 8 s
  const uint32_t empty_bar = full_bar + 8 * stages;  // stage s: empty_bar + 8 s

  const int m_tiles = args.m_tiles;
  const int k_tiles = args.k / kPrefillBlockK;
  // The block's iterations (k stages of 64), i = 0 .. iters - 1: stage
  // it_begin + i of one tile (a block per tile and split), or with stream-K
  // iteration u_begin + i of the sequence of all tiles' stages.
  const StreamK sk{args.sk_q, args.sk_r};
  const int split = stream_k ? 0 : blockIdx.z;
  const int it_begin = stream_k ? 0 : int(int64_t(split) * k_tiles / args.splits);
  const int iters = stream_k ? int(sk.first(blockIdx.x + 1) - sk.first(blockIdx.x))
                             : int(int64_t(split + 1) * k_tiles / args.splits) - it_begin;
  // Iteration i's tile (n-major: consecutive tiles share their weights) and k stage.
  auto locate = [&](int i, int &tile, int &kt) {
    if constexpr (stream_k) {
      const int u = sk.first(blockIdx.x) + i;
      tile = u / k_tiles;
      kt = u % k_tiles;
    } else {
      tile = blockIdx.y * m_tiles + blockIdx.x;
      kt = it_begin + i;
    }
  };
  // The last tile may hold fewer chunks than block_n / 64 (n is a multiple
  // of 64 only): only those are copied and written. The consumers multiply
  // by the others' stale shared memory too (no branch in the pipeline), into
  // columns they never write.
  auto valid_chunks_of = [&](int n0) {
    return (args.n - n0) / 64 < S::chunks ? (args.n - n0) / 64 : S::chunks;
  };

  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(full_bar + 8 * s, 1);
      mbar_init(empty_bar + 8 * s, kConsumerThreads / 32);
    }
    // Make the initialized barriers visible to the async proxy (TMA, bulk copies).
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  }
  __syncthreads();

  constexpr int scale_rows =
      group_size != -1 && group_size < kPrefillBlockK ? kPrefillBlockK / group_size : 1;
  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    // Producer: one thread issues every copy; the others leave. 40 registers
    // are plenty, the rest go to the consumers' accumulators.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (threadIdx.x == 0) {
      const size_t row_words = 2 * size_t(args.n);  // one 16-row band of qweight
      // Where an iteration's copies come from, stepped along from stage to
      // stage rather than divided out of the iteration index each time (the
      // lone producer thread issues every copy of the block).
      struct Cursor {
        int kt, m0, n0;
      };
      Cursor start;
      {
        int tile;
        locate(0, tile, start.kt);
        start.m0 = tile % m_tiles * block_m;
        start.n0 = tile / m_tiles * block_n;
      }
      auto advance = [&](Cursor &c) {
        ++c.kt;
        if constexpr (stream_k) {
          if (c.kt == k_tiles) {  // the next tile
            c.kt = 0;
            c.m0 += block_m;
            if (c.m0 >= args.m) {
              c.m0 = 0;
              c.n0 += block_n;
            }
          }
        }
      };
      // The bytes a stage's copies deliver (fewer for a partial last tile).
      auto tx_bytes = [&](const Cursor &c) {
        const uint32_t chunks = valid_chunks_of(c.n0);
        return S::a_stage + kKSteps * chunks * kChunkBytes +
               (group_size == -1 ? 0 : scale_rows * chunks * 64 * 2) +
               (group_size != -1 && has_zeros ? scale_rows * chunks * 64 / 2 : 0);
      };
      // Stage i's weights, scales and zero points: they do not depend on
      // the previous kernel on the stream (only A does), so with
      // programmatic dependent launch the first stages' are requested
      // before waiting for it.
      auto load_weights = [&](int i, const Cursor &c) {
        const int s = i % stages, kt = c.kt, n0 = c.n0;
        const int valid_chunks = valid_chunks_of(n0);
        const uint32_t w_bytes = valid_chunks * kChunkBytes, s_bytes = valid_chunks * 64 * 2;
        const uint32_t z_bytes = valid_chunks * 64 / 2;  // 8 words per chunk
        const uint32_t full = full_bar + 8 * s;
        // Band r of the stage: qweight row 4 kt + r, from word 2 n0 (chunk n0 / 64).
        const uint32_t *w = args.qweight + size_t(kKSteps * kt) * row_words + 2 * n0;
#pragma unroll
        for (int r = 0; r < kKSteps; ++r)
          bulk_load(base + S::w_offset + s * S::w_stage + r * S::w_band, w + r * row_words, w_bytes,
                    full);
        if constexpr (group_size != -1) {
          const int g0 = kt * kPrefillBlockK / group_size;
#pragma unroll
          for (int r = 0; r < scale_rows; ++r)
            bulk_load(base + S::s_offset + s * S::s_stage + r * S::s_row,
                      args.scales + size_t(g0 + r) * args.n + n0, s_bytes, full);
          if constexpr (has_zeros) {
            // Row g0 + r of the zero points from word n0 / 8 (chunk n0 / 64).
#pragma unroll
            for (int r = 0; r < scale_rows; ++r)
              bulk_load(base + S::z_offset + s * S::z_stage + r * S::z_row,
                        args.zeros + size_t(g0 + r) * (args.n / 8) + n0 / 8, z_bytes, full);
          }
        }
      };
      auto load_a = [&](int i, const Cursor &c) {
        const int s = i % stages;
        tma_load_2d(base + S::a_offset + s * S::a_stage, &a_map, c.kt * kPrefillBlockK, c.m0,
                    full_bar + 8 * s);
      };
      const int prologue = iters < stages ? iters : stages;
      Cursor w = start, a = start;
      for (int i = 0; i < prologue; ++i, advance(w)) {
        mbar_arrive_expect_tx(full_bar + 8 * i, tx_bytes(w));
        load_weights(i, w);
      }
      grid_dependency_wait();
      for (int i = 0; i < prologue; ++i, advance(a)) load_a(i, a);
      for (int i = prologue; i < iters; ++i, advance(w)) {
        const int s = i % stages;
        mbar_wait(empty_bar + 8 * s, ((i / stages) - 1) & 1);
        mbar_arrive_expect_tx(full_bar + 8 * s, tx_bytes(w));
        load_a(i, w);
        load_weights(i, w);
      }
    }
    return;
  }

  // Consumers: warpgroup cw owns chunks cw * wg_chunks .. of the tile (64
  // columns each), one accumulator (64 columns) per chunk.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int cw = warpgroup - 1;
  const int ctid = threadIdx.x - 128;
  const int warp = (ctid / 32) % 4, lane = ctid % 32;

  float acc[wg_chunks][acc_regs];
  // Which 16 columns warp `warp` feeds into wgmma c of a k step (its 16 of
  // the wgmma's 64 rows): with one chunk per warpgroup, tile `warp` of it;
  // with two (`pair`), tile 2 (warp % 2) + c of chunk warp / 2, so that a
  // thread's two words of a k step are adjacent (4 lane + 2 (warp % 2) +
  // {0, 1}) and come in one 8-byte shared load. Any assignment of 16-column
  // tiles to a wgmma's rows is a valid product; the scales, zero points and
  // the epilogue follow it. With zero points too: -2 to -6% on the 64 x 256
  // rows at m = 64 (H100, prefill_bench --zeros; benchmarks/NOTES.md).
  constexpr bool pair = wg_chunks == 2;
  auto chunk_of = [&](int c) { return pair ? warp / 2 : c; };      // of the warpgroup's chunks
  auto tile_of = [&](int c) { return pair ? 2 * (warp % 2) + c : warp; };  // 16 columns in it

  // a[r][c] feeds the wgmma of k step r and chunk c; it is rewritten for the
  // next stage only once that wgmma has completed (a register A operand must
  // not change while its wgmma is in flight). One commit group per wgmma:
  // before rewriting a[r][c], wait until at most groups - 1 are pending, i.e.
  // the previous stage's wgmma of (r, c) is done, while the ones after it keep
  // the tensor cores busy.
  uint32_t a[kKSteps][wg_chunks][4];
  // The dequantization's constants from the zero points of this thread's
  // columns, per row of scales and chunk: per-column zero points (one row
  // for all of k) are read once per tile, as its segment starts (a chunk past
  // n, of a partial last tile, reads none: its columns are never written),
  // grouped ones per stage.
  ZeroPoints<scalar_t> zp[scale_rows][wg_chunks];
  // The block's iterations in segments of one tile each (one segment unless
  // stream-K): a segment's sums are the tile's C, or a part of them added by
  // the last block to finish the tile. The stage ring runs on across segments.
  // (Without stream-K the loop body runs once; written so, ptxas keeps the
  // 128-accumulator tiles free of spills, which it does not for i < iters.)
  for (int i = 0, segment = 0; stream_k ? i < iters : segment == 0; ++segment) {
    int tile, kt0;
    locate(i, tile, kt0);
    const int seg_iters = !stream_k ? iters : k_tiles - kt0 < iters - i ? k_tiles - kt0 : iters - i;
    const int seg_end = i + seg_iters;
    const int m0 = tile % m_tiles * block_m, n0 = tile / m_tiles * block_n;
    const int valid_chunks = valid_chunks_of(n0);
#pragma unroll
    for (int c = 0; c < wg_chunks; ++c)
#pragma unroll
      for (int j = 0; j < acc_regs; ++j) acc[c][j] = 0.f;
    if constexpr (has_zeros && group_size == -1) {
#pragma unroll
      for (int c = 0; c < wg_chunks; ++c) {
        const int chunk = cw * wg_chunks + chunk_of(c);
        zp[0][c] = zero_points<scalar_t>(
            chunk < valid_chunks ? int(args.zeros[(n0 + 64 * chunk) / 8 + lane / 4]) : 0,
            tile_of(c));
      }
    }
    for (; i < seg_end; ++i) {
      const int s = i % stages;
      mbar_wait(full_bar + 8 * s, (i / stages) & 1);
      // Word 4 lane + warp of each of this warpgroup's chunks in each band.
      const uint8_t *w_stage = smem + S::w_offset + s * S::w_stage + cw * wg_chunks * kChunkBytes;
      int q[kKSteps][wg_chunks];
#pragma unroll
      for (int r = 0; r < kKSteps; ++r) {
        if constexpr (pair) {
          const int2 v = *reinterpret_cast<const int2 *>(w_stage + r * S::w_band +
                                                         chunk_of(0) * kChunkBytes +
                                                         4 * (4 * lane + 2 * (warp % 2)));
          q[r][0] = v.x;
          q[r][1] = v.y;
        } else {
#pragma unroll
          for (int c = 0; c < wg_chunks; ++c)
            q[r][c] = *reinterpret_cast<const int *>(w_stage + r * S::w_band + c * kChunkBytes +
                                                     4 * (4 * lane + warp));
        }
      }
      // Rows g, g + 8 of this warp in wgmma c are columns 16 t + g (+ 8) of
      // its chunk, t = tile_of(c), whose scales are stored at 8 g + 2 t (+ 1)
      // (the 8x8 transpose): one half2 per row of scales and wgmma holds both.
      T2 s2[scale_rows][wg_chunks];
      if constexpr (group_size != -1) {
        const uint8_t *s_stage = smem + S::s_offset + s * S::s_stage + cw * wg_chunks * 128;
#pragma unroll
        for (int g = 0; g < scale_rows; ++g)
#pragma unroll
          for (int c = 0; c < wg_chunks; ++c)
            s2[g][c] = *reinterpret_cast<const T2 *>(s_stage + g * S::s_row + chunk_of(c) * 128 +
                                                     2 * (8 * (lane / 4) + 2 * tile_of(c)));
      }
      // The same columns' zero points: word lane / 4 of the chunk's 8, tile
      // tile_of(c) (marlin_kernel.cuh, zero_points), built into the dequantization's
      // constants once per stage.
      if constexpr (has_zeros && group_size != -1) {
        const uint8_t *z_stage = smem + S::z_offset + s * S::z_stage + cw * wg_chunks * 32;
#pragma unroll
        for (int g = 0; g < scale_rows; ++g)
#pragma unroll
          for (int c = 0; c < wg_chunks; ++c)
            zp[g][c] = zero_points<scalar_t>(
                *reinterpret_cast<const int *>(z_stage + g * S::z_row + chunk_of(c) * 32 +
                                               4 * (lane / 4)),
                tile_of(c));
      }
      const uint32_t a_tile = base + S::a_offset + s * S::a_stage;
#pragma unroll
      for (int r = 0; r < kKSteps; ++r) {
#pragma unroll
        for (int c = 0; c < wg_chunks; ++c) {
          wgmma_wait<groups - 1>();
          // Every wgmma of the previous stage is done: its memory is free. One
          // arrival per warp, after the warp's own wait (its shared loads fed
          // those wgmmas, so they are done too).
          if (r == kKSteps - 1 && c == wg_chunks - 1 && i > 0 && lane == 0)
            mbar_arrive(empty_bar + 8 * ((i - 1) % stages));
          // Column g (h = 0) or g + 8 (h = 1) of the warp's tile, with its zero point.
          auto dequant_column = [&](int qw, int h) {
            if constexpr (has_zeros) {
              return dequant<scalar_t>(qw, zp[r * 16 * scale_rows / kPrefillBlockK][c], h);
            } else {
              return dequant<scalar_t>(qw);
            }
          };
          FragB<scalar_t> lo = dequant_column(q[r][c], 0), hi = dequant_column(q[r][c] >> 8, 1);
          if constexpr (group_size != -1) {
            // lo holds column g's values, hi column g + 8's.
            const T2 sr = s2[r * 16 * scale_rows / kPrefillBlockK][c];
            const T2 s_lo = T2(sr.x, sr.x), s_hi = T2(sr.y, sr.y);
            lo[0] = __hmul2(lo[0], s_lo);
            lo[1] = __hmul2(lo[1], s_lo);
            hi[0] = __hmul2(hi[0], s_hi);
            hi[1] = __hmul2(hi[1], s_hi);
          }
          a[r][c][0] = reinterpret_cast<uint32_t &>(lo[0]);
          a[r][c][1] = reinterpret_cast<uint32_t &>(hi[0]);
          a[r][c][2] = reinterpret_cast<uint32_t &>(lo[1]);
          a[r][c][3] = reinterpret_cast<uint32_t &>(hi[1]);
          wgmma_fence();
          Wgmma<block_m>::template mma<scalar_t>(acc[c], a[r][c], kmajor_sw128_desc(a_tile + 32 * r));
          wgmma_commit();
        }
      }
    }
    wgmma_wait<0>();

    if (stream_k ? seg_iters < k_tiles : args.splits > 1) {
      // A part of the tile's k: its partial sums go to its slot in the
      // threads' fragment order (coalesced float4s), and the last block of the
      // tile to arrive adds all parts in k order. The parts: the splits of the
      // tile, or with stream-K the blocks whose shares meet the tile, each with
      // two slots (for its first segment and its last).
      constexpr int f4 = wg_chunks * acc_regs / 4;
      constexpr size_t slot_f4 = size_t(f4) * kConsumerThreads;
      float *flat = &acc[0][0];
      const float4 *slots = reinterpret_cast<const float4 *>(args.partials);
      int first_block = 0, parts = args.splits, own = split;
      if constexpr (stream_k) {
        first_block = sk.block_of(tile * k_tiles);
        parts = sk.block_of((tile + 1) * k_tiles - 1) - first_block + 1;
        own = blockIdx.x - first_block;
      }
      auto slot_of = [&](int part) -> size_t {
        if constexpr (!stream_k) {
          return size_t(tile) * args.splits + part;
        } else {
          const int b = first_block + part;
          return 2 * size_t(b) + (sk.first(b) / k_tiles != tile);  // 1: b began in an earlier tile
        }
      };
      float4 *mine = reinterpret_cast<float4 *>(args.partials) + slot_of(own) * slot_f4;
#pragma unroll
      for (int q = 0; q < f4; ++q)
        __stcg(&mine[q * kConsumerThreads + ctid],
               make_float4(flat[4 * q], flat[4 * q + 1], flat[4 * q + 2], flat[4 * q + 3]));
      __threadfence();
      asm volatile("bar.sync 1, %0;\n" ::"n"(kConsumerThreads) : "memory");
      if (ctid == 0) {
        const int done = atomicAdd(&args.counters[tile], 1);
        is_last = done == parts - 1;
        if (is_last) args.counters[tile] = 0;  // ready for the next call
      }
      asm volatile("bar.sync 1, %0;\n" ::"n"(kConsumerThreads) : "memory");
      if (!is_last) continue;
      __threadfence();
#pragma unroll
      for (int j = 0; j < 4 * f4; ++j) flat[j] = 0.f;
      for (int part = 0; part < parts; ++part) {
        const float4 *slot = slots + slot_of(part) * slot_f4;
#pragma unroll
        for (int q = 0; q < f4; ++q) {
          const float4 v = __ldcg(&slot[q * kConsumerThreads + ctid]);
          flat[4 * q] += v.x;
          flat[4 * q + 1] += v.y;
          flat[4 * q + 2] += v.z;
          flat[4 * q + 3] += v.w;
        }
      }
    }

    // Epilogue. Accumulator 4 j + 2 h + e of wgmma c is column 16 tile_of(c)
    // + g + 8 h of chunk chunk_of(c) (column n of C) and column 8 j + 2 t + e
    // of the tile (row m of C), lane = 4 g + t. Per-column scales and the
    // bias are applied in fp32, so each output is rounded once.
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int c = 0; c < wg_chunks; ++c) {
      const int chunk = cw * wg_chunks + chunk_of(c);
      if (chunk >= valid_chunks) continue;
      const int col = n0 + 64 * chunk + 16 * tile_of(c) + g;
      float scale[2] = {1.f, 1.f}, bias[2] = {0.f, 0.f};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if constexpr (group_size == -1)
          scale[h] = ScalarType<scalar_t>::to_float(args.scales[column_scale_index(col + 8 * h)]);
        if (args.bias) bias[h] = ScalarType<scalar_t>::to_float(args.bias[col + 8 * h]);
      }
#pragma unroll
      for (int j = 0; j < block_m / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int row = m0 + 8 * j + 2 * t + e;
          if (row < args.m) {
            scalar_t *out = args.c + size_t(row) * args.n + col;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const float v = acc[c][4 * j + 2 * h + e] * scale[h] + bias[h];
              if constexpr (std::is_same_v<scalar_t, half>)
                out[8 * h] = __float2half_rn(v);
              else
                out[8 * h] = __float2bfloat16_rn(v);
            }
          }
        }
      }
    }
  }  // segments
#elif defined(__CUDA_ARCH__)
  // Built for a device without wgmma (or for sm_90 without the "a"): fail
  // loudly rather than leave C unwritten. The launcher checks the image first.
  __trap();
#endif
}

}  // namespace prefill
}  // namespace marlin
