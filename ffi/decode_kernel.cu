// The decode kernel (decode_kernel.h): m <= 16 on sm_90.
//
// Operands are swapped against the Marlin kernel: each tensor-core product
// is mma.m16n8k16 with the WEIGHT as the A operand (16 columns of n as the
// rows of A) and the activations as B (8 rows of m as its columns), so that
// m <= 8 costs one mma per 16 x 16 weight tile instead of two. The packed
// layout already holds the A fragment: the word of `lane` for a 16 x 16 tile
// has W[k = 2 (lane % 4) + {0, 1} (+ 8)][n = lane / 4 (+ 8)], and the
// dequantization of the Marlin kernel turns it into the pairs
//   dequant(q)      = {(k 0-1, n), (k 8-9, n)}
//   dequant(q >> 8) = {(k 0-1, n + 8), (k 8-9, n + 8)}
// (relative to 2 (lane % 4) and lane / 4), which are the A registers
// {a0a1, a4a5} and {a2a3, a6a7} of the row-major 16 x 16 A fragment.
//
// Work split: a warp streams one 64-column chunk over a range of k. A chunk
// row of 16 k is 128 words, 16 bytes per lane: one coalesced 512-byte load
// per warp and k step, kDepth steps of it in flight per warp (registers, no
// shared-memory staging), the scales of each group fetched with them. A block
// holds `cw` chunks times `kw` ranges of k; the `s` blocks of a cluster split
// k further. x for the block's k range sits in shared memory (loaded once,
// read with ldmatrix). The fp32 partial sums of a block's kw warps of a chunk
// meet in its shared memory; each block then pushes its sums of the outputs
// another block owns into that block's shared memory (st.async, counted on
// the owner's mbarrier), and each owner adds the cluster's s sums in rank
// order (deterministic), applies per-column scales and the bias and writes
// C. No cluster barrier: a block reads only its own shared memory. (Pulling
// the sums through distributed shared memory after a cluster barrier, and a
// second barrier before exit, cost 0.1-0.9 us more per call at m = 1 and
// 0.5-1.6 us at m = 8 on the 8B layers: H100, benchmarks/NOTES.md.)
#include "decode_kernel.h"

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <mutex>

#include "marlin_kernel.cuh"
#include "marlin_problem.h"
#include "mbarrier.cuh"
#include "pdl_launch.cuh"

namespace marlin {

namespace {

constexpr int kDepth = 8;                   // k steps (16 rows) of weights in flight per warp
constexpr int kMaxWarps = 8;                // warps per block (cw * kw)
constexpr int kMaxCluster = 16;             // cluster size (over 8: non-portable, Hopper allows 16)
constexpr int kMaxShared = 100 * 1024;      // shared memory per block we allow, bytes
constexpr int kChunk = 64;                  // columns per warp

struct DecodeParams {
  const int4 *A;     // [m, k], or [m, 2 k] = gate | up with swiglu
  const int4 *B;     // [k / 16, 2 n]
  const int4 *s;     // [k / g, n] or [1, n], permuted
  const void *bias;  // [n] or null
  void *C;           // [m, n]
  int m, n, k;
  int cw, kw;        // chunks and k ranges per block
  int k_warp;        // k rows per warp
  const int *zeros;  // [k / g, n / 8] or [1, n / 8] packed zero points, or null (zero point 8)
  const int *perm;   // [k] act-order: row j of B is x's column perm[j]; or null
  // The fusions (marlin::Fusion; only without perm): an RMSNorm or SwiGLU
  // prologue applied to x in shared memory, and a residual added to C.
  const void *residual;     // [m, n] or null
  const void *norm_weight;  // [k] or null
  bool swiglu;              // A holds gate | up; x' = silu(gate) up
  float norm_eps;
  float norm_size;          // the logical k the mean of squares divides by
};

// Rows of k that each warp's range must be a multiple of: whole groups (the
// scale fetch and the x loads go by groups and pairs of k steps).
inline int64_t k_granule(int64_t group_size) {
  return group_size == -1 ? 32 : (group_size > 32 ? group_size : 32);
}

inline int m_pad_of(int64_t m) { return m <= 8 ? 8 : 16; }

// Which of the kernel's two schedules a launch takes. Warps that stream at
// least 64 k steps (1024 rows) at m <= 8 take the long-stream one: both
// windows' weights requested (and prefetched into L2 before the PDL wait)
// before x arrives, each window's registers refilled as soon as it is
// multiplied, and with g128 symmetric weights the scales applied to each
// group's fp32 sums instead of to every dequantized weight. Measured on an
// H200 (benchmarks/NOTES.md), fp16 g128 in a CUDA graph: 4-15% faster on
// 8192 x 10240, 8192 x 57344, 28672 x 8192 and 4096 x 28672 at m = 1..8,
// but 4-21% slower on the layers whose warps stream 16-32 steps (4096 x
// 6144, 4096 x 4096, 14336 x 4096, 8192 x 8192) and at m = 16, which keep
// the short-stream schedule (the second window requested after x arrives).
inline bool decode_stream(int64_t m, int64_t k_warp) { return m <= 8 && k_warp >= 1024; }

// The inbox of a block in a cluster (s > 1): the partial sums of the outputs
// it owns (item i of the m x cw 64 / 4 float4s to rank i % s), one float4
// from each rank: [s][ceil(m cw 16 / s)] float4.
inline int64_t inbox_bytes(const DecodeConfig &c, int64_t m) {
  if (c.s == 1) return 0;
  const int64_t items = m * c.cw * kChunk / 4;
  return int64_t(c.s) * ((items + c.s - 1) / c.s) * 16;
}

// Shared memory of one block: x for its k range (rows padded by 16 bytes so
// that ldmatrix's eight row addresses fall in distinct banks), later reused
// for the fp32 partial sums of its warps; then the inbox.
inline int64_t shared_bytes(const DecodeConfig &c, int64_t m, int64_t k) {
  const int64_t m_pad = m_pad_of(m);
  const int64_t x = m_pad * (k / c.s + 8) * 2;
  const int64_t red = int64_t(c.kw) * m_pad * (c.cw * kChunk + 4) * 4;
  return (x > red ? x : red) + inbox_bytes(c, m);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900

// 16-byte loads under a predicate written into the asm, so that the compiler
// sees the destination written either way: with `if (p) v = load()` it keeps
// the old value in a copy, whose move back waits for the load, and only one
// step of weights would be in flight. Weights are read once (L1 keeps none).
__device__ inline int4 load_stream(const int4 *p, bool pred) {
  int4 v;
  asm volatile("{\n"
               "  .reg .pred q;\n"
               "  setp.ne.b32 q, %5, 0;\n"
               "  @q ld.global.nc.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];\n"
               "}\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p), "r"(int(pred)));
  return v;
}

// The same for one 32-bit word (a thread's zero points of a group).
__device__ inline int load_stream_word(const int *p, bool pred) {
  int v;
  asm volatile("{\n"
               "  .reg .pred q;\n"
               "  setp.ne.b32 q, %2, 0;\n"
               "  @q ld.global.nc.L1::no_allocate.s32 %0, [%1];\n"
               "}\n"
               : "=r"(v)
               : "l"(p), "r"(int(pred)));
  return v;
}

// A 16-byte load through L1, under a predicate written into the asm (as
// load_stream): for operands the previous kernel wrote (read-only here).
__device__ inline int4 load_cached(const int4 *p, bool pred) {
  int4 v;
  asm volatile("{\n"
               "  .reg .pred q;\n"
               "  setp.ne.b32 q, %5, 0;\n"
               "  @q ld.global.nc.v4.s32 {%0,%1,%2,%3}, [%4];\n"
               "}\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p), "r"(int(pred)));
  return v;
}

// The RMSNorm prologue's exchange of sums of squares between the cluster's
// blocks: each block stores its rows' sums into every block's NormShared with
// st.async, which counts the bytes on the receiving block's mbarrier; a block
// waits only for its own mbarrier. (A cluster barrier there, a release at
// cluster scope, cost 0.7-1.2 us more per call: benchmarks/NOTES.md.)
struct NormShared {
  unsigned long long bar;                  // mbarrier: the m s partial sums to arrive
  float part[kMaxCluster][kDecodeMaxM];    // [rank][row]
  float r[kDecodeMaxM];                    // 1 / rms per row
};
template <bool kFused> struct FusedShared : NormShared {};
template <> struct FusedShared<false> {};

__device__ inline uint32_t map_rank(uint32_t local, int rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(rank));
  return remote;
}
__device__ inline void st_async(uint32_t remote, float v, uint32_t remote_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];\n" ::"r"(remote),
               "r"(__float_as_uint(v)), "r"(remote_bar)
               : "memory");
}
__device__ inline void st_async(uint32_t remote, float4 v, uint32_t remote_bar) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(remote),
      "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(remote_bar)
      : "memory");
}
__device__ inline void prefetch_l2(const void *p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

// cp.async of 16 bytes, or 16 zero bytes when `valid` is false.
__device__ inline void cp_async_zfill(void *smem_ptr, const void *glob_ptr, bool valid) {
  uint32_t smem = static_cast<uint32_t>(__cvta_generic_to_shared(smem_ptr));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(glob_ptr),
               "r"(valid ? 16 : 0));
}

// The prologue of a fused call, on x rows 0..m-1 of the block's k range as
// staged in shared memory (int4 rows of xs_stride), in place:
//   RMSNorm: x' = dtype(x r w), r = 1 / sqrt(sum over all of k of x^2 /
//            norm_size + eps) per row. The block's sums of squares go to
//            every block of the cluster (which hold the rest of k; NormShared
//            above), each adds them in rank order, so every block gets the
//            same r (deterministic);
//   SwiGLU:  x' = dtype(silu(gate) up), up staged as x, gate read from
//            global memory (L2: the previous kernel has just written it).
// The weights already in flight keep streaming meanwhile.
//
// SwiGLU's gates: a thread's are requested together, kGateBatch rows at a
// time, before any is used (8; in the long-stream schedule, whose two
// windows of weights leave no registers for them at 128, one at a time,
// all prefetched into L1 first), and its exp and division are the GPU's
// fast approximations (__expf, __fdividef: a few float32 ulps, far below
// the result's 16-bit rounding). Every column of blocks of the grid computes
// SwiGLU for its k range, 8 elements a thread and row, so the exact library
// calls cost real time. With the loads one row at a time and expf and an
// IEEE division, a SwiGLU call (14336 x 4096) cost 2.3 / 6.1 / 11.8 us more
// than the plain call at m = 1 / 4 / 8, against 1.5 / 1.9 / 2.8 us now
// (H100, benchmarks/NOTES.md).
template <typename scalar_t, int kGateBatch>
__device__ void prologue(const DecodeParams &p, int4 *smem, int xs_stride, int kb0, int k_block,
                         NormShared &ns, cooperative_groups::cluster_group &cluster) {
  using Scalar = ScalarType<scalar_t>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const int row_int4 = k_block / 8;
  auto widen = [](const int4 &v, float (&f)[8]) {
    const scalar_t *e = reinterpret_cast<const scalar_t *>(&v);
#pragma unroll
    for (int i = 0; i < 8; i++) f[i] = Scalar::to_float(e[i]);
  };
  auto narrow = [](const float (&f)[8]) {
    int4 v;
    auto *t = reinterpret_cast<typename Scalar::T2 *>(&v);
#pragma unroll
    for (int i = 0; i < 4; i++) t[i] = Scalar::from_floats(f[2 * i], f[2 * i + 1]);
    return v;
  };
  if (p.norm_weight) {
    asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");  // every block's mbarrier is set up
    const int blocks = int(cluster.num_blocks()), rank = int(cluster.block_rank());
    for (int r = warp; r < p.m; r += warps) {
      float sum = 0.f;
      for (int c = lane; c < row_int4; c += 32) {
        float f[8];
        widen(smem[r * xs_stride + c], f);
#pragma unroll
        for (int i = 0; i < 8; i++) sum = fmaf(f[i], f[i], sum);
      }
#pragma unroll
      for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      if (lane < blocks)  // lane q to rank q
        st_async(map_rank(smem_addr(&ns.part[rank][r]), lane), sum, map_rank(smem_addr(&ns.bar), lane));
    }
    if (int(threadIdx.x) < p.m) {
      mbar_wait(smem_addr(&ns.bar), 0);
      float sum = 0.f;
      for (int q = 0; q < blocks; q++) sum += ns.part[q][threadIdx.x];  // rank order
      ns.r[threadIdx.x] = 1.f / sqrtf(sum / p.norm_size + p.norm_eps);
    }
    __syncthreads();
  }
  // Each thread owns one column c of 8 elements (or a few, for long ranges)
  // and every `lanes`-th row of it: the norm weight of c is loaded once, and
  // a thread waits for its gates about once, not once per row.
  const int lanes = max(1, int(blockDim.x) / row_int4);
  const int4 *w4 = reinterpret_cast<const int4 *>(p.norm_weight) + kb0 / 8;
  const int4 *g4 = p.A + kb0 / 8;
  for (int c = threadIdx.x / lanes; c < row_int4; c += int(blockDim.x) / lanes) {
    if (p.norm_weight) {
      float w[8];
      widen(w4[c], w);
      for (int r = threadIdx.x % lanes; r < p.m; r += lanes) {
        float x[8];
        widen(smem[r * xs_stride + c], x);
#pragma unroll
        for (int e = 0; e < 8; e++) x[e] = x[e] * ns.r[r] * w[e];
        smem[r * xs_stride + c] = narrow(x);
      }
    } else {
      // With one gate at a time (where registers are short), all of them
      // are requested into L1 first: a prefetch holds no register.
      if constexpr (kGateBatch == 1)
        for (int r = threadIdx.x % lanes; r < p.m; r += lanes)
          asm volatile("prefetch.global.L1 [%0];\n" ::"l"(g4 + int64_t(r) * (p.k / 4) + c));
      for (int r0 = threadIdx.x % lanes; r0 < p.m; r0 += kGateBatch * lanes) {
        int4 g[kGateBatch];
#pragma unroll
        for (int b = 0; b < kGateBatch; b++) {
          const int r = r0 + b * lanes;
          g[b] = load_cached(g4 + int64_t(r < p.m ? r : 0) * (p.k / 4) + c, r < p.m);
        }
#pragma unroll
        for (int b = 0; b < kGateBatch; b++) {
          const int r = r0 + b * lanes;
          if (r < p.m) {
            float x[8], gf[8];
            widen(smem[r * xs_stride + c], x);
            widen(g[b], gf);
#pragma unroll
            for (int e = 0; e < 8; e++)
              x[e] = __fdividef(gf[e], 1.f + __expf(-gf[e])) * x[e];
            smem[r * xs_stride + c] = narrow(x);
          }
        }
      }
    }
  }
  __syncthreads();
}

// kStream: the schedule for long streams (decode_stream above), else the one
// for short ones. kFused: the instance that runs the fusions (p.residual,
// p.norm_weight, p.swiglu); the plain instances are compiled without them.
//
// Registers decide how many blocks share an SM, and so how many weight bytes
// are in flight: at 128 a thread two blocks of 8 warps fit, above it one.
// The instances at m <= 8 that fit in 128 (g128, g-1, g64 without zero
// points) are held to it, plain and fused alike. Allowed one block per SM,
// ptxas (nvcc 13.0) gave the plain ones 141-155 registers and the fused ones
// (the prologue runs with both windows' weights in flight) up to 147: a
// Llama-3-8B block's plain projections then took 30-39% longer at m <= 8,
// down (14336 x 4096) twice as long (H200, CUDA graph; benchmarks/NOTES.md).
// The others (g32, g64 with zero points, m > 8) need 157-221 registers and
// run one block per SM.
template <typename scalar_t, int group_blocks, int m_halves, bool has_zeros>
constexpr bool fits_128() {
  return m_halves == 1 &&
         (group_blocks == 8 || group_blocks == -1 || (group_blocks == 4 && !has_zeros));
}
template <typename scalar_t, int group_blocks, int m_halves, bool has_zeros, bool kStream,
          bool kFused, bool kEarly>
__global__ void __launch_bounds__(32 * kMaxWarps,
                                  fits_128<scalar_t, group_blocks, m_halves, has_zeros>() ? 2 : 1)
    decode_kernel(const DecodeParams p) {
  namespace cg = cooperative_groups;
  using Scalar = ScalarType<scalar_t>;
  using T2 = typename Scalar::T2;
  constexpr int m_pad = 8 * m_halves;
  // At m > 8 one thread stages x with bulk copies (the TMA unit, one per
  // row, counted on x_bar) instead of every thread issuing cp.async: per
  // call at m = 16 on an H100, qkv 11.53 -> 11.08 us, o 8.06 -> 7.53,
  // gate_up 31.92 -> 30.98. At m <= 8 it measured slower on the short
  // streams (m = 1: o 6.10 -> 6.56, down 13.73 -> 14.87) and no faster on
  // the long ones in a CUDA graph (benchmarks/NOTES.md, 2026-12-06).
  constexpr bool kXBulk = m_halves == 2;
  constexpr bool grouped = group_blocks != -1;
  // Groups (of group_blocks k steps) met in one window of kDepth steps.
  constexpr int window_groups = grouped ? (kDepth >= group_blocks ? kDepth / group_blocks : 1) : 1;
  static_assert(!grouped || kDepth % group_blocks == 0 || group_blocks % kDepth == 0, "");

  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank());
  const int s_blocks = int(cluster.num_blocks());
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int cw = warp % p.cw, kw = warp / p.cw;
  const int chunk = blockIdx.y * p.cw + cw;
  const int k_block = p.kw * p.k_warp;
  const int kb0 = rank * k_block;          // first k row of this block
  const int k_rel = kw * p.k_warp;         // first k row of this warp, within the block
  const int steps = p.k_warp / 16;         // even (k_granule)

  // The mbarriers that count what the cluster's blocks push into this one's
  // shared memory with st.async: its inbox's partial sums of C (red_bar) and,
  // for RMSNorm, the m s partial sums of squares. Set up and announced to
  // the cluster (a relaxed arrive) before any weight load is in flight; the
  // matching wait comes before the first push, in the prologue or before the
  // reduction, long after every block has arrived. No cluster barrier is
  // left in the kernel: a block reads only its own shared memory, and waits
  // for everything pushed into it before it exits.
  __shared__ FusedShared<kFused> fused_shared;
  __shared__ unsigned long long red_bar;
  __shared__ unsigned long long x_bar;  // kXBulk: x's bulk copies
  // The m x cw 64 outputs of the block as float4 items, item i owned by
  // rank i % s. (Computed again after the main loop: kept live through it,
  // they cost registers the weights need.)
  auto owned_items = [&] {
    const int items = p.m * p.cw * kChunk / 4;
    return rank < items ? (items - rank + s_blocks - 1) / s_blocks : 0;
  };
  // (Set up by the last warp: by thread 0, ptxas spilled 4 bytes in one
  // long-stream fused instance.)
  if (threadIdx.x == blockDim.x - 32) {
    mbar_init(smem_addr(&red_bar), 1);
    mbar_arrive_expect_tx(smem_addr(&red_bar), s_blocks > 1 ? 16 * owned_items() * s_blocks : 0);
    if constexpr (kXBulk) mbar_init(smem_addr(&x_bar), 1);
    if constexpr (kFused) {
      if (p.norm_weight) {
        mbar_init(smem_addr(&fused_shared.bar), 1);
        mbar_arrive_expect_tx(smem_addr(&fused_shared.bar), 4 * p.m * s_blocks);
      }
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");

  // Lane's 16 bytes of the chunk row: words 4 lane .. 4 lane + 3 = tiles 0..3.
  const int w_stride = p.n / 2;  // int4 per row of 16 k
  const int4 *w_ptr = p.B + int64_t((kb0 + k_rel) / 16) * w_stride + 32 * chunk + lane;

  // The first weights do not depend on the previous kernel: pull them into
  // L2 before waiting for it (L2 is coherent, so this is safe even if that
  // kernel writes them). kEarly: the short schedule's first window goes
  // straight into registers before the wait (below), its second into L2
  // here; the long-stream schedule keeps this prefetch of both windows
  // (without it ptxas spilled at 128 registers) and requests both windows'
  // weights into registers as well.
#pragma unroll
  for (int j = kEarly && !kStream ? kDepth : 0; j < (kStream || kEarly ? 2 : 1) * kDepth; j++)
    if (j < steps) prefetch_l2(w_ptr + int64_t(j) * w_stride);
  // Nor does an act-order permutation: this thread's first 8 indices. (The
  // kEarly instances take no permutation: the chain call has none, and its
  // registers go to the early weights.)
  const int *const perm = kEarly ? nullptr : p.perm;
  const int4 *perm4 = reinterpret_cast<const int4 *>(perm + kb0);
  int4 perm_first[2] = {};
  if (perm && int(threadIdx.x) < k_block / 8) {
    perm_first[0] = perm4[2 * threadIdx.x];
    perm_first[1] = perm4[2 * threadIdx.x + 1];
  }
  extern __shared__ int4 smem[];
  const int xs_stride = k_block / 8 + 1;  // int4 per row
  const int x_rows = kStream ? p.m : m_pad;
  if constexpr (kXBulk) {
    // Nor do the zero rows m..m_pad-1 of x (the bulk copies fill rows
    // 0..m-1 only).
    if (perm == nullptr)
      for (int i = p.m * (k_block / 8) + threadIdx.x; i < x_rows * (k_block / 8); i += blockDim.x)
        smem[(i / (k_block / 8)) * xs_stride + i % (k_block / 8)] = make_int4(0, 0, 0, 0);
    __syncthreads();  // x_bar is set up before any thread waits on it
  }
  // Weight and scale rings: step j of the window is in wq[j]; the scales of
  // the window's group q in sq[q] (thread's 8 scales: columns lane / 4 + 8 i
  // of the chunk, i.e. tile t's n and n + 8 at halves 2 t and 2 t + 1), and
  // with zero points those of the same 8 columns, one word, in zq[q].
  // Two windows of kDepth steps, in two sets of registers: while one window
  // is multiplied, the loads of the next are in flight, and each load has a
  // whole window of work to land (a single ring of slots refilled as they
  // free up let ptxas sink every refill to the end of the loop, so the next
  // window waited for its loads). The scales of a window's groups come with
  // its weights.
  const int s_stride = p.n / 8;  // int4 per row of scales
  const int4 *s_ptr = p.s + 8 * chunk + lane / 4;
  const int group_row0 = grouped ? (kb0 + k_rel) / (16 * group_blocks) : 0;
  // Word 8 chunk + lane / 4 of a row of zero points: the same 8 columns.
  const int z_stride = p.n / 8;
  const int *z_ptr = p.zeros + 8 * chunk + lane / 4;
  auto fill_weights = [&](int4 (&w)[kDepth], int base) {
#pragma unroll
    for (int j = 0; j < kDepth; j++)
      w[j] = load_stream(w_ptr + int64_t(base + j) * w_stride, base + j < steps);
  };
  auto fill_scales = [&](int4 (&sg)[window_groups], int (&zg)[window_groups], int base) {
    if constexpr (grouped) {
#pragma unroll
      for (int q = 0; q < window_groups; q++)
        sg[q] = load_stream(s_ptr + int64_t(group_row0 + (base + q * group_blocks) / group_blocks) * s_stride,
                            base + q * group_blocks < steps);
      if constexpr (has_zeros) {
#pragma unroll
        for (int q = 0; q < window_groups; q++)
          zg[q] = load_stream_word(
              z_ptr + int64_t(group_row0 + (base + q * group_blocks) / group_blocks) * z_stride,
              base + q * group_blocks < steps);
      }
    }
  };
  // With zero points, a window's scales and zero points are requested before
  // its weights: the zero-point constants are built at the window's start, so
  // the window would otherwise wait for its last request (Nsight Compute, 4096
  // x 28672 at m = 16: the top stall, 21.5% of the samples, was the first use
  // of the zero-point word), where a symmetric window waits only for its first
  // step's weights. Measured on an H100: 2-4% off the small layers at m <= 4,
  // nothing on the large ones (benchmarks/NOTES.md).
  auto fill = [&](int4 (&w)[kDepth], int4 (&sg)[window_groups], int (&zg)[window_groups],
                  int base) {
    if constexpr (has_zeros) {
      fill_scales(sg, zg, base);
      fill_weights(w, base);
    } else {
      fill_weights(w, base);
      fill_scales(sg, zg, base);
    }
  };
  int4 wa[kDepth], wb[kDepth];
  int4 sa[window_groups], sb[window_groups];
  int za[window_groups], zb[window_groups];
  // kEarly (a kernel of a jax_marlin chain call, after one of its own, which
  // writes activations only): the first window's weights and scales (and in
  // the long-stream schedule the second window's weights; its scales after
  // the wait: requested before it too, ptxas spilled 4 bytes at 128
  // registers) are requested before the wait, so they stream while the
  // previous kernel drains. Only there: after any other kernel the weights
  // might be its output (weights computed in the same jit), and after a
  // plain launch it measured 4-8% slower (benchmarks/NOTES.md, 2026-12-06).
  if constexpr (kEarly) {
    fill(wa, sa, za, 0);
    if constexpr (kStream) fill_weights(wb, kDepth);
  }
  grid_dependency_wait();
  grid_launch_dependents();

  // x rows 0..m_pad-1 of the block's k range, zero past m. The long-stream
  // schedule leaves rows m..m_pad-1 as they are: they are column j >= m of
  // the mma's B operand, which meets only column j of its product, and those
  // columns are never reduced or written. (In a CUDA graph, skipping the zero
  // fill measured 1-3% slower on some short-stream layers at m = 1, and 3%
  // faster on others: benchmarks/NOTES.md. They keep it.)
  if (perm == nullptr) {
    const int row_int4 = k_block / 8;
    // With swiglu a row of A is gate | up, and x is up.
    const bool swiglu = kFused && p.swiglu;
    const int a_row_int4 = (swiglu ? 2 : 1) * p.k / 8;
    const int4 *a = p.A + (swiglu ? p.k / 8 : 0);
    if constexpr (kXBulk) {
      if (threadIdx.x == blockDim.x - 32) {
        mbar_arrive_expect_tx(smem_addr(&x_bar), p.m * row_int4 * 16);
        for (int r = 0; r < p.m; r++)
          bulk_load(smem_addr(&smem[r * xs_stride]), a + int64_t(r) * a_row_int4 + kb0 / 8,
                    row_int4 * 16, smem_addr(&x_bar));
      }
    } else {
      for (int i = threadIdx.x; i < x_rows * row_int4; i += blockDim.x) {
        const int r = i / row_int4, c = i % row_int4;
        const bool valid = r < p.m;
        const int4 *src = a + (valid ? int64_t(r) * a_row_int4 + kb0 / 8 + c : 0);
        cp_async_zfill(&smem[r * xs_stride + c], src, valid);
      }
      cp_async_fence();
    }
    if constexpr (!kEarly) {
      fill(wa, sa, za, 0);
      if constexpr (kStream) fill(wb, sb, zb, kDepth);
    } else if constexpr (kStream) {
      fill_scales(sb, zb, kDepth);
    }
  } else {
    // Act-order: column c of the block's range is x's column perm[kb0 + c],
    // gathered here (x is small and in L2: the previous kernel has just
    // written it), 8 columns of one row per thread and item so that all
    // threads have loads in flight; the first item's indices were read
    // before the wait. The first window's weights (both windows' in the
    // long-stream schedule) are requested first, so that they stream
    // meanwhile. An index out of range is clamped. (Not taken by the kEarly
    // instances, whose perm is null.)
    if constexpr (!kEarly) {
      fill(wa, sa, za, 0);
      if constexpr (kStream) fill(wb, sb, zb, kDepth);
    }
    const uint16_t *a = reinterpret_cast<const uint16_t *>(p.A);
    const int row_int4 = k_block / 8;
#pragma unroll 2
    for (int i = threadIdx.x; i < x_rows * row_int4; i += blockDim.x) {
      const int r = i / row_int4, c8 = i % row_int4;
      int4 v = make_int4(0, 0, 0, 0);
      if (r < p.m) {
        const bool first = i == int(threadIdx.x) && i < row_int4;  // read before the wait
        const int4 p0 = first ? perm_first[0] : perm4[2 * c8];
        const int4 p1 = first ? perm_first[1] : perm4[2 * c8 + 1];
        const int col[8] = {p0.x, p0.y, p0.z, p0.w, p1.x, p1.y, p1.z, p1.w};
        uint16_t e[8];
#pragma unroll
        for (int j = 0; j < 8; j++)
          e[j] = a[int64_t(r) * p.k + (col[j] < 0 ? 0 : col[j] >= p.k ? p.k - 1 : col[j])];
        v = *reinterpret_cast<const int4 *>(e);
      }
      smem[r * xs_stride + c8] = v;
    }
  }
  // Per-column zero points: one row for all of k, read once.
  int z_column = 0;
  if constexpr (has_zeros && !grouped) z_column = load_stream_word(z_ptr, true);

  // With grouped scales, the products of a group's unscaled weights (q - 8,
  // exact in 16 bits) go to acc_g, and the group's scales multiply those
  // fp32 sums once per group: two FFMAs per column pair and group instead of
  // four HMUL2s per tile and step, and a shorter dependency chain from the
  // loaded word to the mma. (The Marlin kernel scales the weights instead:
  // its sums then carry the fp16 rounding of q s.) Not with zero points:
  // applied per group as acc_g - (z - 8) (sum of x), they measured slower at
  // m = 4..8 (benchmarks/NOTES.md).
  constexpr bool kGroupAcc = kStream && grouped && group_blocks == 8 && !has_zeros;
  FragC acc[4][m_halves], acc_g[4][m_halves];
#pragma unroll
  for (int t = 0; t < 4; t++)
#pragma unroll
    for (int h = 0; h < m_halves; h++)
#pragma unroll
      for (int i = 0; i < 4; i++) acc[t][h][i] = acc_g[t][h][i] = 0.f;

  if constexpr (kXBulk) {
    if (perm == nullptr) mbar_wait(smem_addr(&x_bar), 0);
  } else {
    cp_async_wait<0>();
  }
  __syncthreads();
  if constexpr (kFused)
    if (p.norm_weight || p.swiglu)
      prologue<scalar_t, kStream ? 1 : 8>(p, smem, xs_stride, kb0, k_block, fused_shared, cluster);

  const scalar_t *xs = reinterpret_cast<const scalar_t *>(smem);
  // ldmatrix row address of this lane: matrix lane / 8 (k offset 8 (lane / 8)
  // of a pair of steps), row lane % 8 (m).
  const scalar_t *x_lane = xs + (lane % 8) * (8 * xs_stride) + k_rel + 8 * (lane / 8);

  // The window at `base` (its weights in w, its groups' scales in sg), a
  // pair of steps at a time: their x fragments (registers {0, 1} and {2, 3}
  // of one ldmatrix.x4 per 8 rows of m), then per step dequantize, scale and
  // multiply.
  auto window = [&](const int4 (&w)[kDepth], const int4 (&sg)[window_groups],
                    const int (&zg)[window_groups], int base) {
    // The zero points' constants of the window's groups, per tile, once per
    // window (built inside the steps they cost two LOP3s and two shifts per
    // tile and step).
    ZeroPoints<scalar_t> zt[window_groups][4];
    if constexpr (has_zeros) {
#pragma unroll
      for (int q = 0; q < window_groups; q++)
#pragma unroll
        for (int t = 0; t < 4; t++) zt[q][t] = zero_points<scalar_t>(grouped ? zg[q] : z_column, t);
    }
#pragma unroll
    for (int j = 0; j < kDepth; j += 2) {
      if (base + j < steps) {  // steps is even
        FragA<scalar_t> xb[m_halves];
#pragma unroll
        for (int h = 0; h < m_halves; h++)
          ldsm4<scalar_t>(xb[h], x_lane + h * 8 * (8 * xs_stride) + 16 * (base + j));
#pragma unroll
        for (int u = 0; u < 2; u++) {
          const int *q = reinterpret_cast<const int *>(&w[j + u]);
          FragS<scalar_t> sc[4];  // per tile: (scale of n, scale of n + 8)
          if constexpr (grouped) {
            const int4 sv = sg[((j + u) / group_blocks) % window_groups];
#pragma unroll
            for (int t = 0; t < 4; t++) sc[t][0] = reinterpret_cast<const T2 *>(&sv)[t];
          }
          // Column n (h = 0) or n + 8 (h = 1) of tile t, with its zero point.
          auto dequant_column = [&](int qt, int t, int h) {
            if constexpr (has_zeros) {
              const int q = grouped ? ((j + u) / group_blocks) % window_groups : 0;
              return dequant<scalar_t>(qt, zt[q][t], h);
            } else {
              return dequant<scalar_t>(qt);
            }
          };
#pragma unroll
          for (int t = 0; t < 4; t++) {
            FragB<scalar_t> lo = dequant_column(q[t], t, 0);
            FragB<scalar_t> hi = dequant_column(q[t] >> 8, t, 1);
            if constexpr (grouped && !kGroupAcc) {
              const T2 s_n = Scalar::broadcast(reinterpret_cast<const scalar_t *>(&sc[t])[0]);
              const T2 s_n8 = Scalar::broadcast(reinterpret_cast<const scalar_t *>(&sc[t])[1]);
              lo[0] = __hmul2(lo[0], s_n);
              lo[1] = __hmul2(lo[1], s_n);
              hi[0] = __hmul2(hi[0], s_n8);
              hi[1] = __hmul2(hi[1], s_n8);
            }
            FragA<scalar_t> a;
            a[0] = lo[0];
            a[1] = hi[0];
            a[2] = lo[1];
            a[3] = hi[1];
#pragma unroll
            for (int h = 0; h < m_halves; h++) {
              FragB<scalar_t> b;
              b[0] = xb[h][2 * u];
              b[1] = xb[h][2 * u + 1];
              if constexpr (kGroupAcc)
                mma<scalar_t>(a, b, acc_g[t][h]);
              else
                mma<scalar_t>(a, b, acc[t][h]);
            }
          }
          // The group's last step: its unscaled sums, times its scales, into
          // acc (fp32 fused multiply-adds), and the group's sums restart.
          if constexpr (kGroupAcc) {
            if ((j + u + 1) % group_blocks == 0) {
#pragma unroll
              for (int t = 0; t < 4; t++) {
                const float s_n = Scalar::to_float(reinterpret_cast<const scalar_t *>(&sc[t])[0]);
                const float s_n8 = Scalar::to_float(reinterpret_cast<const scalar_t *>(&sc[t])[1]);
#pragma unroll
                for (int h = 0; h < m_halves; h++) {
                  acc[t][h][0] = fmaf(s_n, acc_g[t][h][0], acc[t][h][0]);
                  acc[t][h][1] = fmaf(s_n, acc_g[t][h][1], acc[t][h][1]);
                  acc[t][h][2] = fmaf(s_n8, acc_g[t][h][2], acc[t][h][2]);
                  acc[t][h][3] = fmaf(s_n8, acc_g[t][h][3], acc[t][h][3]);
#pragma unroll
                  for (int i = 0; i < 4; i++) acc_g[t][h][i] = 0.f;
                }
              }
            }
          }
        }
      }
    }
  };
  // Both windows' loads were issued before x arrived; each window's
  // registers are refilled as soon as it is multiplied.
  for (int base = 0; base < steps; base += 2 * kDepth) {
    if constexpr (kStream) {
      window(wa, sa, za, base);
      fill(wa, sa, za, base + 2 * kDepth);
      window(wb, sb, zb, base + kDepth);
      fill(wb, sb, zb, base + 3 * kDepth);
    } else {
      fill(wb, sb, zb, base + kDepth);
      window(wa, sa, za, base);
      fill(wa, sa, za, base + 2 * kDepth);
      window(wb, sb, zb, base + kDepth);
    }
  }

  // Partial sums of every warp into shared memory, rows of m then columns:
  // red[(kw m_pad + m) rs + 64 cw + n]. rs = 64 cw + 4 staggers the rows by
  // 4 banks, so a warp's scattered stores hit 32 banks.
  __syncthreads();  // x is no longer read
  float *red = reinterpret_cast<float *>(smem);
  const int rs = p.cw * kChunk + 4;
#pragma unroll
  for (int t = 0; t < 4; t++)
#pragma unroll
    for (int h = 0; h < m_halves; h++) {
      const int n0 = cw * kChunk + 16 * t + lane / 4, m0 = 8 * h + 2 * (lane % 4);
      float *row0 = red + (kw * m_pad + m0) * rs + n0;
      row0[0] = acc[t][h][0];
      row0[rs] = acc[t][h][1];
      row0[8] = acc[t][h][2];
      row0[rs + 8] = acc[t][h][3];
    }
  __syncthreads();
  const int quads = p.cw * kChunk / 4;  // float4 items of C per row
  const int items = p.m * quads, owned = owned_items();
  // The epilogue of the float4 item i (row i / quads, columns 4 (i % quads)
  // of the block's): per-column scales, bias, rounding, residual, store.
  T2 *C = reinterpret_cast<T2 *>(p.C);
  const T2 *bias = reinterpret_cast<const T2 *>(p.bias);
  const scalar_t *scales = reinterpret_cast<const scalar_t *>(p.s);
  auto store = [&](int i, float (&v)[4]) {
    const int row = i / quads, quad = i % quads;
    const int col = blockIdx.y * p.cw * kChunk + 4 * quad;
#pragma unroll
    for (int e = 0; e < 4; e++) {
      if constexpr (!grouped) {
        // Per-column scales: position 8 i + 2 u + v of each 32 holds column
        // 8 u + 2 i + v.
        const int in32 = (col + e) % 32;
        v[e] *= Scalar::to_float(scales[col + e - in32 + 8 * ((in32 % 8) / 2) + 2 * (in32 / 8) + in32 % 2]);
      }
    }
    if (bias) {
      const float2 b0 = Scalar::to_floats(bias[col / 2]), b1 = Scalar::to_floats(bias[col / 2 + 1]);
      v[0] += b0.x, v[1] += b0.y, v[2] += b1.x, v[3] += b1.y;
    }
    T2 out[2] = {Scalar::from_floats(v[0], v[1]), Scalar::from_floats(v[2], v[3])};
    const int64_t at = (int64_t(row) * p.n + col) / 2;
    if (kFused && p.residual) {
      // Added to the rounded product, as XLA's add after the matmul would.
      const uint2 r = *reinterpret_cast<const uint2 *>(reinterpret_cast<const T2 *>(p.residual) + at);
#pragma unroll
      for (int h = 0; h < 2; h++) {
        const float2 a = Scalar::to_floats(out[h]);
        const float2 b = Scalar::to_floats(reinterpret_cast<const T2 *>(&r)[h]);
        out[h] = Scalar::from_floats(a.x + b.x, a.y + b.y);
      }
    }
    *reinterpret_cast<uint2 *>(&C[at]) = *reinterpret_cast<uint2 *>(out);
  };
  // This block's k ranges summed (in kw order), one float4 of a row of m per
  // thread and item; each pushed to the rank that owns it (item i to rank
  // i % s, slot [this rank][i / s] of its inbox).
  const int per_rank = (items + s_blocks - 1) / s_blocks;
  float4 *inbox = reinterpret_cast<float4 *>(
      reinterpret_cast<char *>(smem) +
      max(m_pad * (p.kw * p.k_warp + 8) * 2, p.kw * m_pad * rs * 4));  // past x and red (shared_bytes)
  if (!(kFused && p.norm_weight)) asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
  for (int i = threadIdx.x; i < items; i += blockDim.x) {
    float4 v = reinterpret_cast<const float4 *>(red + (i / quads) * rs)[i % quads];
    for (int r = 1; r < p.kw; r++) {
      const float4 o = reinterpret_cast<const float4 *>(red + (r * m_pad + i / quads) * rs)[i % quads];
      v.x += o.x, v.y += o.y, v.z += o.z, v.w += o.w;
    }
    if (s_blocks == 1) {
      float w[4] = {v.x, v.y, v.z, v.w};
      store(i, w);
    } else {
      const int to = i % s_blocks;
      st_async(map_rank(smem_addr(&inbox[rank * per_rank + i / s_blocks]), to), v,
               map_rank(smem_addr(&red_bar), to));
    }
  }
  // Then the items this block owns: the cluster's partial sums added in rank
  // order (deterministic), 4 columns each.
  if (s_blocks > 1 && int(threadIdx.x) < owned) {
    mbar_wait(smem_addr(&red_bar), 0);
    for (int j = threadIdx.x; j < owned; j += blockDim.x) {
      float v[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
      for (int q = 0; q < s_blocks; q++) {
        const float4 o = inbox[q * per_rank + j];
        v[0] += o.x, v[1] += o.y, v[2] += o.z, v[3] += o.w;
      }
      store(j * s_blocks + rank, v);
    }
  }
}

#else

// Host pass and devices before sm_90: the launcher never launches it there.
template <typename scalar_t, int group_blocks, int m_halves, bool has_zeros, bool kStream,
          bool kFused, bool kEarly>
__global__ void decode_kernel(const DecodeParams) {}

#endif

template <typename scalar_t, int group_blocks, int m_halves, bool has_zeros, bool kStream,
          bool kFused, bool kEarly>
std::string launch(const DecodeParams &p, const DecodeConfig &c, int64_t shared, bool pdl,
                   cudaStream_t stream) {
  auto *kernel =
      decode_kernel<scalar_t, group_blocks, m_halves, has_zeros, kStream, kFused, kEarly>;
  static std::once_flag once[kMaxDevices];
  static cudaError_t attr_error[kMaxDevices];
  int device;
  const DeviceInfo *info;
  if (std::string why = current_device(&device, &info); !why.empty()) return why;
  std::call_once(once[device], [&] {
    (attr_error[device] =
         cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxShared)) ||
        (attr_error[device] =
             cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  });
  if (attr_error[device]) return cuda_error("cudaFuncSetAttribute", attr_error[device]);

  if (cudaError_t error = launch_kernel(kernel, dim3(c.s, p.n / kChunk / c.cw, 1),
                                        dim3(32 * c.cw * c.kw), size_t(shared), stream, pdl,
                                        unsigned(c.s), p))
    return cuda_error("decode kernel launch", error);
  return {};
}

// kEarly instances exist for the fused calls at m <= 8 without zero points
// or a perm only: the calls of a chain (jax_marlin_post_attention) after its
// first.
template <typename scalar_t, int group_blocks, bool has_zeros, bool kFused, bool kEarly>
std::string launch_m(const DecodeParams &p, const DecodeConfig &c, int64_t shared, bool pdl,
                     cudaStream_t stream) {
  if (p.m > 8)
    return launch<scalar_t, group_blocks, 2, has_zeros, false, kFused, false>(p, c, shared, pdl,
                                                                              stream);
  if (decode_stream(p.m, p.k_warp))
    return launch<scalar_t, group_blocks, 1, has_zeros, true, kFused, kEarly>(p, c, shared, pdl,
                                                                              stream);
  return launch<scalar_t, group_blocks, 1, has_zeros, false, kFused, kEarly>(p, c, shared, pdl,
                                                                             stream);
}

template <typename scalar_t, int group_blocks, bool has_zeros>
std::string launch_fused(const DecodeParams &p, const DecodeConfig &c, int64_t shared, bool pdl,
                         bool early, cudaStream_t stream) {
  if (p.residual || p.norm_weight || p.swiglu) {
    if constexpr (!has_zeros)
      if (early) return launch_m<scalar_t, group_blocks, false, true, true>(p, c, shared, pdl, stream);
    return launch_m<scalar_t, group_blocks, has_zeros, true, false>(p, c, shared, pdl, stream);
  }
  return launch_m<scalar_t, group_blocks, has_zeros, false, false>(p, c, shared, pdl, stream);
}

template <typename scalar_t, bool has_zeros>
std::string launch_group(int64_t group_size, const DecodeParams &p, const DecodeConfig &c,
                         int64_t shared, bool pdl, bool early, cudaStream_t stream) {
  switch (group_size) {
    case -1: return launch_fused<scalar_t, -1, has_zeros>(p, c, shared, pdl, early, stream);
    case 32: return launch_fused<scalar_t, 2, has_zeros>(p, c, shared, pdl, early, stream);
    case 64: return launch_fused<scalar_t, 4, has_zeros>(p, c, shared, pdl, early, stream);
    case 128: return launch_fused<scalar_t, 8, has_zeros>(p, c, shared, pdl, early, stream);
  }
  return "jax_marlin: the decode kernel has no instance for group_size " +
         std::to_string(group_size);
}

}  // namespace

std::string check_decode_config(const DecodeConfig &c, int64_t m, int64_t n, int64_t k,
                                int64_t group_size) {
  auto s = [](int64_t v) { return std::to_string(v); };
  if (m < 1 || m > kDecodeMaxM) return "the decode kernel takes 1 <= m <= 16, got m = " + s(m);
  if (c.cw < 1 || c.kw < 1 || c.s < 1 || c.cw * c.kw > kMaxWarps || c.s > kMaxCluster)
    return "decode configuration (cw " + s(c.cw) + ", kw " + s(c.kw) + ", s " + s(c.s) +
           ") out of range";
  if ((n / kChunk) % c.cw) return "n / 64 = " + s(n / kChunk) + " is not a multiple of cw " + s(c.cw);
  if (k % (k_granule(group_size) * c.s * c.kw))
    return "k = " + s(k) + " does not split into " + s(c.s * c.kw) + " ranges of whole " +
           s(k_granule(group_size)) + "-row units";
  if (shared_bytes(c, m, k) > kMaxShared)
    return "decode configuration needs " + s(shared_bytes(c, m, k)) + " bytes of shared memory";
  return {};
}

namespace {
bool config_fits(const DecodeConfig &c, int64_t m, int64_t n, int64_t k, int64_t group_size) {
  return m >= 1 && m <= kDecodeMaxM && c.cw >= 1 && c.kw >= 1 && c.s >= 1 &&
         c.cw * c.kw <= kMaxWarps && c.s <= kMaxCluster && (n / kChunk) % c.cw == 0 &&
         k % (k_granule(group_size) * c.s * c.kw) == 0 && shared_bytes(c, m, k) <= kMaxShared;
}
}  // namespace

namespace {

// The fastest configuration of the Llama-2/3 70B and 8B projections on an
// H200 (132 SMs), per batch size up to 2, 4, 8 and 16 rows, from
// benchmarks/results/h200-2026-12-03-decode-sweep.txt (fp16 g128), and of
// the Llama-3 8B output head (4096 x 128256) from
// benchmarks/results/h200-2026-12-04-head-sweep.txt. An empty entry: the
// Marlin kernel was faster there (at m = 16 on the 70B layers and
// 14336 x 4096). Those sweeps timed independent calls; 4096 x 6144 at m <= 2
// takes 2,4,4 instead of their 4,1,16, which is 5-7% faster alone but 8%
// slower in a CUDA graph of dependent calls, as a decode step runs it
// (benchmarks/results/h200-2026-12-05-fixed-cost.txt, sections C and G).
struct MeasuredLayer {
  int k, n;
  DecodeConfig by_m[4];  // m <= 2, 4, 8, 16
};
constexpr MeasuredLayer kMeasured[] = {
    {8192, 10240, {{1, 4, 2}, {1, 4, 2}, {4, 2, 4}, {}}},
    {8192, 8192, {{1, 8, 2}, {1, 8, 2}, {1, 8, 2}, {}}},
    {8192, 57344, {{8, 1, 2}, {8, 1, 2}, {8, 1, 2}, {}}},
    {28672, 8192, {{4, 2, 7}, {4, 2, 7}, {4, 2, 7}, {}}},
    {4096, 6144, {{2, 4, 4}, {2, 4, 4}, {2, 4, 4}, {4, 2, 4}}},
    {4096, 4096, {{1, 8, 2}, {1, 8, 2}, {1, 8, 2}, {1, 8, 2}}},
    {4096, 28672, {{4, 1, 4}, {8, 1, 4}, {4, 2, 2}, {8, 1, 2}}},
    {14336, 4096, {{2, 4, 7}, {2, 4, 7}, {2, 4, 7}, {}}},
    {4096, 128256, {{4, 1, 2}, {4, 1, 2}, {4, 1, 2}, {4, 1, 2}}},
};
constexpr int kMeasuredSms = 132;

}  // namespace

DecodeConfig choose_decode_config(int64_t m, int64_t n, int64_t k, int64_t group_size, int sms) {
  if (m < 1 || m > kDecodeMaxM) return {};
  const int bucket = m <= 2 ? 0 : m <= 4 ? 1 : m <= 8 ? 2 : 3;
  if (sms == kMeasuredSms)
    for (const MeasuredLayer &layer : kMeasured)
      if (layer.k == k && layer.n == n) {
        const DecodeConfig &c = layer.by_m[bucket];
        if (!c.valid() || config_fits(c, m, n, k, group_size)) return c;
      }
  // Elsewhere, what the sweep's winners have in common: about 14 resident
  // warps per SM in all (half that at m > 8, where x and the reduction cost
  // more per warp), but at least two warps per chunk (the output head, 2004
  // chunks: one warp per chunk took 93 us at m = 1, two 71 us), blocks of 8
  // warps, at least 256 rows of k per warp; and at m > 8 the Marlin kernel
  // for deep layers (k > 4096), where it won.
  if (m > 8 && k > 4096) return {};
  const int64_t chunks = n / kChunk;
  const double target =
      std::max(2.0, (m > 8 ? 7.0 : 14.0) * sms / double(chunks));  // warps per chunk
  DecodeConfig best;
  double best_cost = 0;
  for (int cw : {8, 4, 2, 1})
    for (int kw : {8, 4, 2, 1})
      for (int s = 1; s <= kMaxCluster; s++) {
        const DecodeConfig c{cw, kw, s};
        if (!config_fits(c, m, n, k, group_size)) continue;
        const int64_t splits = int64_t(kw) * s;
        double cost = std::abs(std::log(splits / target));
        if (k / splits < 256) cost += 1.0;
        if (cw * kw != 8) cost += 0.15;
        if (s > 8) cost += 0.3;  // non-portable clusters
        if (!best.valid() || cost < best_cost) best = c, best_cost = cost;
      }
  return best;
}

// The gather costs an L2 round trip for the indices, then one per 8 columns
// of a row, on the kernel's critical path; the pass costs a second launch,
// which the decode kernel's weight prefetch overlaps. Measured on an H200
// (decode_bench --act-order, the 70B and 8B layers at m = 1, 4, 16;
// benchmarks/NOTES.md): the gather wins at m <= 2 on layers of up to 32M
// weights and at m = 4 on the 28672-deep layer, the pass elsewhere or ties.
bool decode_gathers(const DecodeConfig &config, int64_t m, int64_t n, int64_t k) {
  if (!config.valid()) return false;
  return (m <= 2 && k * n <= (int64_t(32) << 20)) || (m > 2 && m <= 8 && k > 16384);
}

std::string decode_matmul(const void *A, const void *B, const void *s, const void *zeros,
                          const int *perm, const void *bias, void *C, int64_t m, int64_t n,
                          int64_t k, int64_t group_size, bool bf16, const DecodeConfig &config,
                          bool pdl, cudaStream_t stream, const Fusion &fusion) {
  if (std::string why = check_decode_config(config, m, n, k, group_size); !why.empty())
    return "jax_marlin: " + why;
  if (perm && fusion.prologue())
    return "jax_marlin: the decode kernel runs a prologue only on x in its own order (no perm)";
  DecodeParams p{static_cast<const int4 *>(A), static_cast<const int4 *>(B),
                 static_cast<const int4 *>(s), bias, C, int(m), int(n), int(k),
                 config.cw, config.kw, int(k / (config.s * config.kw)),
                 static_cast<const int *>(zeros), perm, fusion.residual,
                 fusion.norm_weight, fusion.swiglu, fusion.norm_eps, float(fusion.norm_size)};
  const int64_t shared = shared_bytes(config, m, k);
  // The early weights only where the launch may overlap the kernel before.
  const bool early = fusion.early_weights && pdl && !perm;
  if (zeros)
    return bf16 ? launch_group<nv_bfloat16, true>(group_size, p, config, shared, pdl, early, stream)
                : launch_group<half, true>(group_size, p, config, shared, pdl, early, stream);
  return bf16 ? launch_group<nv_bfloat16, false>(group_size, p, config, shared, pdl, early, stream)
              : launch_group<half, false>(group_size, p, config, shared, pdl, early, stream);
}

}  // namespace marlin
