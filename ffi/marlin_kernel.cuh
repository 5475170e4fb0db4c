/*
 * Marlin FP16/BF16 x INT4 GEMM kernel, ported to a plain CUDA launcher for
 * jax-marlin. This header holds the kernel template and the per-configuration
 * launch; ffi/marlin_instance.cu instantiates it once per (element type,
 * group size), ffi/marlin_kernel.cu holds the launcher that picks one.
 *
 * The kernel is "upstream Marlin": the Marlin kernel of Elias Frantar
 * (IST-DASLab/marlin, Copyright (C) Marlin.2024 Elias Frantar), as modified
 * by Neural Magic; see NOTICE at the top of this repository. Changes in this
 * port: no torch, errors returned instead of thrown, compile-time checks of
 * every launched configuration, shared memory sized per configuration, the L2
 * evict-first hint for weights behind a flag, and a launcher that only reaches
 * the configurations of marlin_problem.h's tile table. Formats added
 * here: bf16 activations and scales, groups of 32 and 64 rows (several scale
 * rows per k tile), a bias in the epilogue, and the cross-block reduction in
 * fp32 in a scratch buffer instead of fp16 in the output.
 *
 * Licensed under the Apache License, Version 2.0 (the "License");
 * you may not use this file except in compliance with the License.
 * You may obtain a copy of the License at
 *
 *         http://www.apache.org/licenses/LICENSE-2.0
 *
 * Unless required by applicable law or agreed to in writing, software
 * distributed under the License is distributed on an "AS IS" BASIS,
 * WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
 * See the License for the specific language governing permissions and
 * limitations under the License.
 */

#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>

#include "marlin_launch.h"

// L2 evict-first hint on weight loads (Marlin's cp.async ... L2::cache_hint).
// Off by default: ptxas 13.0 miscompiles it in some instantiations (their
// SASS reads uniform registers it never writes, and the kernel stops with
// CUDA_ERROR_ILLEGAL_INSTRUCTION; Triton turned off fractional L2 policies on
// cp.async for the same ptxas bug). Build with -DJAX_MARLIN_B_EVICT_FIRST=1
// only with a ptxas known to compile it correctly (benchmarks/NOTES.md).
#ifndef JAX_MARLIN_B_EVICT_FIRST
#define JAX_MARLIN_B_EVICT_FIRST 0
#endif

// L2 prefetch size of the global->shared copies. ptxas 13.0 adds a 128-byte
// L2 prefetch (SASS LDGSTS...LTC128B) to every copy of upstream Marlin but to
// none of this kernel's, for the same PTX copies; asking for it in the PTX
// keeps it. -DJAX_MARLIN_L2_PREFETCH=0 leaves the choice to ptxas.
#ifndef JAX_MARLIN_L2_PREFETCH
#define JAX_MARLIN_L2_PREFETCH 1
#endif
#if JAX_MARLIN_L2_PREFETCH
#define MARLIN_L2_PREFETCH ".L2::128B"
#else
#define MARLIN_L2_PREFETCH ""
#endif

namespace marlin {

__host__ __device__ constexpr int ceildiv(int a, int b) { return (a + b - 1) / b; }
__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }

// Shared-memory footprint and structural requirements of one kernel
// configuration, in the kernel's own units (int4 = 16 bytes). Upstream Marlin
// launches every configuration with a fixed 96 KiB of dynamic shared memory,
// which thread_m_blocks = 4 with a 128x128 tile overflows (4 stages of 24 KiB
// of A and B tiles plus the scales). Here each instantiation asks for what it
// uses, and a configuration the kernel cannot run does not compile.
template <int threads, int thread_m_blocks, int thread_n_blocks,
          int thread_k_blocks, int stages, int group_blocks, bool has_zeros = false>
struct TileShape {
  static constexpr int a_sh_stage = (16 * thread_k_blocks / 8) * 16 * thread_m_blocks;
  static constexpr int b_sh_stride = 32 * thread_n_blocks / 4;
  static constexpr int b_sh_stage = b_sh_stride * thread_k_blocks;
  static constexpr int s_sh_stride = 16 * thread_n_blocks / 8;
  // Rows of scales one k tile needs: several when groups are shallower than
  // the tile (32 or 64 rows against a 64- or 128-deep tile), else one.
  static constexpr int s_tb_groups =
      group_blocks != -1 && group_blocks < thread_k_blocks ? thread_k_blocks / group_blocks : 1;
  static constexpr int s_sh_stage = s_sh_stride * s_tb_groups;
  // Zero points (weights that have them): 8 per int32 along n, so a row of
  // them is a quarter of a row of scales, fetched with the scales' rows (the
  // one row of per-column zero points with every stage).
  static constexpr int z_sh_stride = s_sh_stride / 4;
  static constexpr int z_sh_stage = has_zeros ? z_sh_stride * s_tb_groups : 0;
  static constexpr int b_sh_wr_iters = b_sh_stage / threads;
  static constexpr int k_warps = (threads / 32) / (thread_n_blocks / 4);
  // k tiles that share one row of scales (1 for per-column scales and for
  // groups no deeper than a tile).
  static constexpr int group_tiles =
      group_blocks == -1 || group_blocks <= thread_k_blocks ? 1 : group_blocks / thread_k_blocks;

  // Global->shared pipeline, then the two phases that reuse its memory: the
  // in-block reduction across k-warps and the reordering before write-out.
  static constexpr int pipeline = stages * (a_sh_stage + b_sh_stage + s_sh_stage + z_sh_stage);
  static constexpr int reduce = (threads / b_sh_stride / 2 >= 1) ? 8 * threads : 0;
  static constexpr int write = (2 * thread_n_blocks + 1) * 16 * thread_m_blocks;
  static constexpr int reused = cmax(pipeline, cmax(reduce, write));
  // The slot reduction stages as many whole fp32 output tiles (16-byte
  // units) as that memory holds, at least one.
  static constexpr int tile_f4 = 16 * thread_m_blocks * 16 * thread_n_blocks / 4;
  static constexpr int slot_stage = cmax(1, reused / tile_f4);
  static constexpr int shared_bytes = 16 * cmax(reused, slot_stage * tile_f4);

  static_assert(threads % 32 == 0 && threads >= 128, "at least 4 whole warps");
  static_assert(thread_m_blocks >= 1 && thread_m_blocks <= 4, "m tile of 16..64 rows");
  static_assert(16 * thread_n_blocks <= kMaxThreadN, "marlin_scratch_size sizes slots for this n tile");
  static_assert(thread_n_blocks % 4 == 0, "warps own n in steps of 64 columns");
  static_assert((threads / 32) % (thread_n_blocks / 4) == 0,
                "warps must split evenly over n, then k");
  static_assert(b_sh_stage % threads == 0, "each thread fetches whole B rows");
  // The register double buffer alternates on k % 2 and the next tile is
  // fetched at sub-tile b_sh_wr_iters - 2: both need an even count >= 2. (A
  // 128x64 tile on 256 threads gives 1, which upstream Marlin accepts as a
  // user configuration and which never fetches its pipeline.)
  static_assert(b_sh_wr_iters >= 2 && b_sh_wr_iters % 2 == 0,
                "B sub-tiles per stage must be even and >= 2");
  static_assert(k_warps * b_sh_wr_iters == thread_k_blocks,
                "k-warps times sub-tiles must cover the k tile");
  static_assert(threads % (2 * thread_k_blocks) == 0, "A rows are fetched by whole thread groups");
  static_assert(stages >= 2, "pipeline needs at least double buffering");
  static_assert(group_blocks == -1 ||
                    (group_blocks % thread_k_blocks == 0 && stages % group_tiles == 0) ||
                    thread_k_blocks % group_blocks == 0,
                "a group must span whole k tiles and divide the pipeline, or a k tile whole groups");
  static_assert(s_sh_stage <= threads, "one thread per 16 bytes of a tile's scales");
  static_assert(z_sh_stage <= threads, "one thread per 16 bytes of a tile's zero points");
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800

// Instances of `Vec` are used to organize groups of >>registers<<, as needed
// for instance as inputs to tensor core operations. Consequently, all
// corresponding index accesses must be compile-time constants, which is why we
// extensively use `#pragma unroll` throughout the kernel code to guarantee
// this.
template <typename T, int n> struct Vec {
  T elems[n];
  __device__ T &operator[](int i) { return elems[i]; }
};

using I4 = Vec<int, 4>;

// What differs between fp16 and bf16: the register pair type, conversions,
// the tensor core instruction and the dequantization trick.
template <typename scalar_t> struct ScalarType;

template <> struct ScalarType<half> {
  using T2 = half2;
  static __device__ float to_float(half v) { return __half2float(v); }
  static __device__ T2 broadcast(half v) { return __half2half2(v); }
  static __device__ T2 from_floats(float a, float b) { return __floats2half2_rn(a, b); }
  static __device__ float2 to_floats(T2 v) { return __half22float2(v); }
};

template <> struct ScalarType<nv_bfloat16> {
  using T2 = nv_bfloat162;
  static __device__ float to_float(nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ T2 broadcast(nv_bfloat16 v) { return __bfloat162bfloat162(v); }
  static __device__ T2 from_floats(float a, float b) { return __floats2bfloat162_rn(a, b); }
  static __device__ float2 to_floats(T2 v) { return __bfloat1622float2(v); }
};

// Matrix fragments for tensor core instructions; their precise layout is
// documented here:
// https://docs.nvidia.com/cuda/parallel-thread-execution/index.html#matrix-fragments-for-mma-m16n8k16-with-floating-point-type
template <typename scalar_t> using FragA = Vec<typename ScalarType<scalar_t>::T2, 4>;
template <typename scalar_t> using FragB = Vec<typename ScalarType<scalar_t>::T2, 2>;
using FragC = Vec<float, 4>;
template <typename scalar_t>
using FragS = Vec<typename ScalarType<scalar_t>::T2, 1>;  // quantization scales

// Predicated asynchronous global->shared copy; used for inputs A where we apply
// predication to handle batchsizes that are not multiples of 16.
__device__ inline void cp_async4_pred(void *smem_ptr, const void *glob_ptr,
                                      bool pred = true) {
  const int BYTES = 16;
  uint32_t smem = static_cast<uint32_t>(__cvta_generic_to_shared(smem_ptr));
  asm volatile("{\n"
               "   .reg .pred p;\n"
               "   setp.ne.b32 p, %0, 0;\n"
               "   @p cp.async.cg.shared.global" MARLIN_L2_PREFETCH " [%1], [%2], %3;\n"
               "}\n" ::"r"((int)pred),
               "r"(smem), "l"(glob_ptr), "n"(BYTES));
}

// Asynchronous global->shared copy with a cache hint indicating that the values
// may be evicted immediately; used for quantized weights B, which are only
// accessed precisely once and should thus not pollute the L2 cache which we
// need for inputs A and outputs C. (See JAX_MARLIN_B_EVICT_FIRST above for why
// it is off by default. `policy` comes from `make_evict_first_policy`, created
// once per thread rather than once per copy.)
#if JAX_MARLIN_B_EVICT_FIRST
__device__ inline uint64_t make_evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n"
               : "=l"(policy));
  return policy;
}

__device__ inline void cp_async4_evict_first(void *smem_ptr,
                                             const void *glob_ptr,
                                             uint64_t policy) {
  const int BYTES = 16;
  uint32_t smem = static_cast<uint32_t>(__cvta_generic_to_shared(smem_ptr));
  asm volatile("cp.async.cg.shared.global.L2::cache_hint" MARLIN_L2_PREFETCH " [%0], [%1], %2, %3;\n"
               ::"r"(smem), "l"(glob_ptr), "n"(BYTES), "l"(policy));
}
#else
__device__ inline uint64_t make_evict_first_policy() { return 0; }

__device__ inline void cp_async4_evict_first(void *smem_ptr,
                                             const void *glob_ptr,
                                             uint64_t) {
  const int BYTES = 16;
  uint32_t smem = static_cast<uint32_t>(__cvta_generic_to_shared(smem_ptr));
  asm volatile("cp.async.cg.shared.global" MARLIN_L2_PREFETCH " [%0], [%1], %2;\n"
               ::"r"(smem), "l"(glob_ptr), "n"(BYTES));
}
#endif

// Plain asynchronous global->shared copy; used for the scales.
__device__ inline void cp_async4(void *smem_ptr, const void *glob_ptr) {
  const int BYTES = 16;
  uint32_t smem = static_cast<uint32_t>(__cvta_generic_to_shared(smem_ptr));
  asm volatile("cp.async.cg.shared.global" MARLIN_L2_PREFETCH " [%0], [%1], %2;\n"
               ::"r"(smem), "l"(glob_ptr), "n"(BYTES));
}

// Async copy fence.
__device__ inline void cp_async_fence() {
  asm volatile("cp.async.commit_group;\n" ::);
}

// Wait until at most `n` async copy stages are still pending.
template <int n> __device__ inline void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(n));
}

// m16n8k16 tensor core mma instruction with fp16 or bf16 inputs and fp32
// output/accumulation.
template <typename scalar_t>
__device__ inline void mma(const FragA<scalar_t> &a_frag, const FragB<scalar_t> &frag_b,
                           FragC &frag_c) {
  const uint32_t *a = reinterpret_cast<const uint32_t *>(&a_frag);
  const uint32_t *b = reinterpret_cast<const uint32_t *>(&frag_b);
  float *c = reinterpret_cast<float *>(&frag_c);
  if constexpr (std::is_same_v<scalar_t, half>) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
                 : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]),
                   "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
                 : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]),
                   "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
  }
}

// Instruction for loading a full 16x16 matrix fragment of operand A from shared
// memory, directly in tensor core layout.
template <typename scalar_t>
__device__ inline void ldsm4(FragA<scalar_t> &frag_a, const void *smem_ptr) {
  uint32_t *a = reinterpret_cast<uint32_t *>(&frag_a);
  uint32_t smem = static_cast<uint32_t>(__cvta_generic_to_shared(smem_ptr));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(smem));
}

// Lookup-table based 3-input logical operation; explicitly used for
// dequantization as the compiler does not seem to automatically recognize it in
// all cases.
template <int lut> __device__ inline int lop3(int a, int b, int c) {
  int res;
  asm volatile("lop3.b32 %0, %1, %2, %3, %4;\n"
               : "=r"(res)
               : "r"(a), "r"(b), "r"(c), "n"(lut));
  return res;
}

// Efficiently dequantize an int32 value into a full B-fragment of 4 fp16
// values. We mostly follow the strategy in the link below, with some small
// changes:
// https://github.com/NVIDIA/FasterTransformer/blob/main/src/fastertransformer/cutlass_extensions/include/cutlass_extensions/interleaved_numeric_conversion.h
template <typename scalar_t> __device__ inline FragB<scalar_t> dequant(int q);

template <> __device__ inline FragB<half> dequant<half>(int q) {
  const int LO = 0x000f000f;
  const int HI = 0x00f000f0;
  const int EX = 0x64006400;
  // Guarantee that the `(a & b) | c` operations are LOP3s.
  int lo = lop3<(0xf0 & 0xcc) | 0xaa>(q, LO, EX);
  int hi = lop3<(0xf0 & 0xcc) | 0xaa>(q, HI, EX);
  // We want signed int4 outputs, hence we fuse the `-8` symmetric zero point
  // directly into `SUB` and `ADD`.
  const int SUB = 0x64086408;
  const int MUL = 0x2c002c00;
  const int ADD = 0xd480d480;
  FragB<half> frag_b;
  frag_b[0] = __hsub2(*reinterpret_cast<half2 *>(&lo),
                      *reinterpret_cast<const half2 *>(&SUB));
  frag_b[1] = __hfma2(*reinterpret_cast<half2 *>(&hi),
                      *reinterpret_cast<const half2 *>(&MUL),
                      *reinterpret_cast<const half2 *>(&ADD));
  return frag_b;
}

// bf16 has 7 mantissa bits, too few for fp16's trick of reading the high
// nibble in place as 16 q: both nibbles are shifted down to bits 0..3 and
// 16..19 instead, where OR-ing them into 0x4300 (128.0) gives 128 + q
// exactly; subtracting 136 (0x4308) leaves q - 8. The packed layout is the
// same as for fp16.
template <> __device__ inline FragB<nv_bfloat16> dequant<nv_bfloat16>(int q) {
  const int MASK = 0x000f000f;
  const int EX = 0x43004300;
  int lo = lop3<(0xf0 & 0xcc) | 0xaa>(q, MASK, EX);
  int hi = lop3<(0xf0 & 0xcc) | 0xaa>(q >> 4, MASK, EX);
  const int SUB = 0x43084308;
  FragB<nv_bfloat16> frag_b;
  frag_b[0] = __hsub2(*reinterpret_cast<nv_bfloat162 *>(&lo),
                      *reinterpret_cast<const nv_bfloat162 *>(&SUB));
  frag_b[1] = __hsub2(*reinterpret_cast<nv_bfloat162 *>(&hi),
                      *reinterpret_cast<const nv_bfloat162 *>(&SUB));
  return frag_b;
}

// Zero points other than 8 (imported asymmetric weights). dequant subtracts
// 1024 + 8 (fp16; the high nibble's fma adds -(64 + 8)) or 128 + 8 (bf16)
// from the values the exponent trick builds; with a zero point z it
// subtracts 1024 + z (adds -(64 + z)) or 128 + z instead, which keeps q - z
// exact (an integer in -15..15) at the same instruction count: only the
// constants become registers. They come from the packed zero points
// (jax_marlin/packing.py): nibbles t and 4 + t of a thread's word are the
// zero points of the two columns (n and n + 8) of its tile t, which one shift
// and one mask put in the two halves of a register, read in place by the
// half2 instructions (.H0_H0 / .H1_H1 operands).
template <typename scalar_t> struct ZeroPoints {
  typename ScalarType<scalar_t>::T2 sub;  // fp16 1024 + z, bf16 128 + z; .x column n, .y n + 8
  typename ScalarType<scalar_t>::T2 add;  // fp16 -(64 + z) (unused for bf16)
};

// Callers build these once per word and tile and keep them: the LOP3s are
// inline asm (volatile), which the compiler may not sink into the branches of
// a loop body and rebuild there per step, as it did with plain C.
template <typename scalar_t>
__device__ inline ZeroPoints<scalar_t> zero_points(int word, int tile) {
  const int z = word >> (4 * tile);
  int sub, add = 0;
  if constexpr (std::is_same_v<scalar_t, half>) {
    sub = lop3<(0xf0 & 0xcc) | 0xaa>(z, 0x000f000f, 0x64006400);
    add = lop3<(0xf0 & 0xcc) | 0xaa>(z << 4, 0x00f000f0, 0xd400d400);
  } else {
    sub = lop3<(0xf0 & 0xcc) | 0xaa>(z, 0x000f000f, 0x43004300);
  }
  ZeroPoints<scalar_t> zp;
  zp.sub = *reinterpret_cast<typename ScalarType<scalar_t>::T2 *>(&sub);
  zp.add = *reinterpret_cast<typename ScalarType<scalar_t>::T2 *>(&add);
  return zp;
}

// dequant<scalar_t>(q) with the zero point of column n (h = 0: q holds the
// tile's column n) or n + 8 (h = 1: q >> 8, column n + 8) of `zp`.
template <typename scalar_t>
__device__ inline FragB<scalar_t> dequant(int q, const ZeroPoints<scalar_t> &zp, int h);

template <>
__device__ inline FragB<half> dequant<half>(int q, const ZeroPoints<half> &zp, int h) {
  const int LO = 0x000f000f;
  const int HI = 0x00f000f0;
  const int EX = 0x64006400;
  int lo = lop3<(0xf0 & 0xcc) | 0xaa>(q, LO, EX);
  int hi = lop3<(0xf0 & 0xcc) | 0xaa>(q, HI, EX);
  const int MUL = 0x2c002c00;
  const half2 sub = h ? __high2half2(zp.sub) : __low2half2(zp.sub);
  const half2 add = h ? __high2half2(zp.add) : __low2half2(zp.add);
  FragB<half> frag_b;
  frag_b[0] = __hsub2(*reinterpret_cast<half2 *>(&lo), sub);
  frag_b[1] = __hfma2(*reinterpret_cast<half2 *>(&hi), *reinterpret_cast<const half2 *>(&MUL), add);
  return frag_b;
}

template <>
__device__ inline FragB<nv_bfloat16> dequant<nv_bfloat16>(int q, const ZeroPoints<nv_bfloat16> &zp,
                                                          int h) {
  const int MASK = 0x000f000f;
  const int EX = 0x43004300;
  int lo = lop3<(0xf0 & 0xcc) | 0xaa>(q, MASK, EX);
  int hi = lop3<(0xf0 & 0xcc) | 0xaa>(q >> 4, MASK, EX);
  const nv_bfloat162 sub = h ? __high2bfloat162(zp.sub) : __low2bfloat162(zp.sub);
  FragB<nv_bfloat16> frag_b;
  frag_b[0] = __hsub2(*reinterpret_cast<nv_bfloat162 *>(&lo), sub);
  frag_b[1] = __hsub2(*reinterpret_cast<nv_bfloat162 *>(&hi), sub);
  return frag_b;
}

// Multiply dequantized values by the corresponding quantization scale; used
// only for grouped quantization.
template <typename scalar_t>
__device__ inline void scale(FragB<scalar_t> &frag_b, FragS<scalar_t> &frag_s, int i) {
  auto s = ScalarType<scalar_t>::broadcast(reinterpret_cast<scalar_t *>(&frag_s)[i]);
  frag_b[0] = __hmul2(frag_b[0], s);
  frag_b[1] = __hmul2(frag_b[1], s);
}

// Wait until barrier reaches `count`, then lock for current threadblock.
__device__ inline void barrier_acquire(int *lock, int count) {
  if (threadIdx.x == 0) {
    int state = -1;
    do
      // Guarantee that subsequent writes by this threadblock will be visible
      // globally.
      asm volatile("ld.global.acquire.gpu.b32 %0, [%1];\n"
                   : "=r"(state)
                   : "l"(lock));
    while (state != count);
  }
  __syncthreads();
}

// Release barrier and increment visitation count.
__device__ inline void barrier_release(int *lock, bool reset = false) {
  __syncthreads();
  if (threadIdx.x == 0) {
    if (reset) {
      lock[0] = 0;
      return;
    }
    int val = 1;
    // Make sure that all writes since acquiring this barrier are visible
    // globally, while releasing the barrier.
    asm volatile("fence.acq_rel.gpu;\n");
    asm volatile("red.relaxed.gpu.global.add.s32 [%0], %1;\n"
                 :
                 : "l"(lock), "r"(val));
  }
}

template <typename scalar_t,        // half or nv_bfloat16: A, C, s and bias
          const int threads,         // number of threads in a threadblock
          const int thread_m_blocks, // number of 16x16 blocks in the m
                                     // dimension (batchsize) of the threadblock
          const int thread_n_blocks, // same for n dimension (output)
          const int thread_k_blocks, // same for k dimension (reduction)
          const int stages, // number of stages for the async global->shared
                            // fetch pipeline
          const int group_blocks = -1, // number of consecutive 16x16 blocks with
                                       // a separate quantization scale
          const bool has_zeros = false // per-group zero points (else 8)
          >
__global__ void
Marlin(const int4 *__restrict__ A, // input matrix of shape mxk
       const int4 *__restrict__ B, // 4bit quantized weight matrix of shape kxn
       int4 *__restrict__ C,       // output buffer of shape mxn
       float *__restrict__ C_tmp,  // fp32 partial sums, marlin_scratch_size(m, n)
       const int4
           *__restrict__ s, // quantization scales of shape (k/groupsize)xn
       const int4 *__restrict__ bias, // [n] added to the output, or null
       int prob_m,          // batch dimension m
       int prob_n,          // output dimension n
       int prob_k,          // reduction dimension k
       int *locks,          // extra global storage for barrier synchronization
       const int4 *__restrict__ zeros // packed zero points [groups, n / 8], if has_zeros
) {
  // Each threadblock processes one "stripe" of the B matrix with (roughly) the
  // same size, which might involve multiple column "slices" (of width 16 *
  // `thread_n_blocks`). Stripes are defined as shown in the 3x3 matrix 5 SM
  // example:
  //   0 1 3
  //   0 2 3
  //   1 2 4
  // While this kind of partitioning makes things somewhat more complicated, it
  // ensures good utilization of all SMs for many kinds of shape and GPU
  // configurations, while requiring as few slow global cross-threadblock
  // reductions as possible.

  // For larger GEMMs we run multiple batchsize 64 versions in parallel for a
  // better partitioning with less reductions
  // Compile-time checks of this configuration (see `TileShape`).
  using Shape = TileShape<threads, thread_m_blocks, thread_n_blocks,
                          thread_k_blocks, stages, group_blocks, has_zeros>;
  static_assert(Shape::shared_bytes > 0, "");
  using Scalar = ScalarType<scalar_t>;
  using T2 = typename Scalar::T2;
  // fp32 scratch of one output tile in the global reduction.
  constexpr int c_tile = 16 * thread_m_blocks * 16 * thread_n_blocks;

  int parallel = 1;
  if (prob_m > 16 * thread_m_blocks) {
    parallel = prob_m / (16 * thread_m_blocks);
    prob_m = 16 * thread_m_blocks;
  }

  int k_tiles = prob_k / 16 / thread_k_blocks;
  int n_tiles = prob_n / 16 / thread_n_blocks;
  int iters = ceildiv(k_tiles * n_tiles * parallel, gridDim.x);
  // Ensure that the number of tiles in each stripe is a multiple of the
  // groupsize; this avoids an annoying special case where a stripe starts in
  // the middle of group.
  if (group_blocks != -1)
    iters = Shape::group_tiles * ceildiv(iters, Shape::group_tiles);

  int slice_row = (iters * blockIdx.x) % k_tiles;
  int slice_col_par = (iters * blockIdx.x) / k_tiles;
  int slice_col = slice_col_par;
  int slice_iters; // number of threadblock tiles in the current slice
  int slice_count =
      0;         // total number of active threadblocks in the current slice
  int slice_idx; // index of threadblock in current slice; numbered bottom to
                 // top

  // We can easily implement parallel problem execution by just remapping
  // indices and advancing global pointers
  if (slice_col_par >= n_tiles) {
    A += (slice_col_par / n_tiles) * 16 * thread_m_blocks * prob_k / 8;
    C += (slice_col_par / n_tiles) * 16 * thread_m_blocks * prob_n / 8;
    slice_col = slice_col_par % n_tiles;
  }

  // Compute all information about the current slice which is required for
  // synchronization.
  auto init_slice = [&]() {
    slice_iters =
        iters * (blockIdx.x + 1) - (k_tiles * slice_col_par + slice_row);
    if (slice_iters < 0 || slice_col_par >= n_tiles * parallel)
      slice_iters = 0;
    if (slice_iters == 0)
      return;
    if (slice_row + slice_iters > k_tiles)
      slice_iters = k_tiles - slice_row;
    slice_count = 1;
    slice_idx = 0;
    int col_first = iters * ceildiv(k_tiles * slice_col_par, iters);
    if (col_first <= k_tiles * (slice_col_par + 1)) {
      int col_off = col_first - k_tiles * slice_col_par;
      slice_count = ceildiv(k_tiles - col_off, iters);
      if (col_off > 0)
        slice_count++;
      int delta_first = iters * blockIdx.x - col_first;
      if (delta_first < 0 || (col_off == 0 && delta_first == 0))
        slice_idx = slice_count - 1;
      else {
        slice_idx = slice_count - 1 - delta_first / iters;
        if (col_off > 0)
          slice_idx--;
      }
    }
    if (slice_col == n_tiles) {
      A += 16 * thread_m_blocks * prob_k / 8;
      C += 16 * thread_m_blocks * prob_n / 8;
      slice_col = 0;
    }
  };
  init_slice();

  int a_gl_stride = prob_k / 8; // stride of the A matrix in global memory
  // We typically use `constexpr` to indicate that this value is a compile-time
  // constant
  constexpr int a_sh_stride =
      16 * thread_k_blocks / 8; // stride of an A matrix tile in shared memory
  constexpr int a_gl_rd_delta_o =
      16 * thread_k_blocks /
      8; // delta between subsequent A tiles in global memory
  int a_gl_rd_delta_i =
      a_gl_stride *
      (threads / a_gl_rd_delta_o); // between subsequent accesses within a tile
  constexpr int a_sh_wr_delta =
      a_sh_stride * (threads / a_gl_rd_delta_o); // between shared memory writes
  constexpr int a_sh_rd_delta_o =
      2 * ((threads / 32) /
           (thread_n_blocks / 4)); // between shared memory tile reads
  constexpr int a_sh_rd_delta_i =
      a_sh_stride * 16; // within a shared memory tile
  constexpr int a_sh_stage =
      a_sh_stride * (16 * thread_m_blocks); // overall size of a tile
  constexpr int a_sh_wr_iters =
      ceildiv(a_sh_stage,
              a_sh_wr_delta); // number of shared write iterations for a tile

  int b_gl_stride = 16 * prob_n / 32;
  constexpr int b_sh_stride = 32 * thread_n_blocks / 4;
  int b_gl_rd_delta_o = b_gl_stride * thread_k_blocks;
  int b_gl_rd_delta_i = b_gl_stride * (threads / b_sh_stride);
  constexpr int b_sh_wr_delta = threads;
  constexpr int b_sh_rd_delta = threads;
  constexpr int b_sh_stage = b_sh_stride * thread_k_blocks;
  constexpr int b_sh_wr_iters = b_sh_stage / b_sh_wr_delta;

  int s_gl_stride = prob_n / 8;
  constexpr int s_sh_stride = Shape::s_sh_stride;
  constexpr int s_sh_stage = Shape::s_sh_stage;
  constexpr int s_tb_groups = Shape::s_tb_groups;
  int s_gl_rd_delta = s_gl_stride * s_tb_groups;

  // Global A read index of current thread.
  int a_gl_rd = a_gl_stride * (threadIdx.x / a_gl_rd_delta_o) +
                (threadIdx.x % a_gl_rd_delta_o);
  a_gl_rd += a_gl_rd_delta_o * slice_row;
  // Shared write index of current thread.
  int a_sh_wr = a_sh_stride * (threadIdx.x / a_gl_rd_delta_o) +
                (threadIdx.x % a_gl_rd_delta_o);
  // Shared read index.
  int a_sh_rd =
      a_sh_stride * ((threadIdx.x % 32) % 16) + (threadIdx.x % 32) / 16;
  a_sh_rd += 2 * ((threadIdx.x / 32) / (thread_n_blocks / 4));

  int b_gl_rd =
      b_gl_stride * (threadIdx.x / b_sh_stride) + (threadIdx.x % b_sh_stride);
  b_gl_rd += b_sh_stride * slice_col;
  b_gl_rd += b_gl_rd_delta_o * slice_row;
  int b_sh_wr = threadIdx.x;
  int b_sh_rd = threadIdx.x;

  // With groups shallower than a tile, thread i fetches scale row
  // i / s_sh_stride of the tile's s_tb_groups rows.
  auto s_gl_start = [&]() {
    const int group_row = group_blocks == -1 ? 0 : (thread_k_blocks * slice_row) / group_blocks;
    return s_gl_stride * (group_row + threadIdx.x / s_sh_stride) +
           s_sh_stride * slice_col + threadIdx.x % s_sh_stride;
  };
  int s_gl_rd = s_gl_start();
  int s_sh_wr = threadIdx.x;
  // Zero points: thread i < z_sh_stage fetches 16 bytes of row
  // i / z_sh_stride of the tile's rows (row 0 per column), like the scales.
  constexpr int z_sh_stride = Shape::z_sh_stride;
  constexpr int z_sh_stage = Shape::z_sh_stage;
  const int z_gl_stride = prob_n / 32;
  auto z_gl_start = [&]() {
    const int group_row = group_blocks == -1 ? 0 : (thread_k_blocks * slice_row) / group_blocks;
    return z_gl_stride * (group_row + threadIdx.x / z_sh_stride) +
           z_sh_stride * slice_col + threadIdx.x % z_sh_stride;
  };
  int z_gl_rd = has_zeros ? z_gl_start() : 0;
  // The word of this thread's 8 columns (those of its scales, n + 8 j):
  // word 8 (64-column chunk) + (column within the chunk's first 8).
  const int z_sh_rd = 8 * ((threadIdx.x / 32) % (thread_n_blocks / 4)) + (threadIdx.x % 32) / 4;
  int s_sh_rd;
  // We use a different scale layout for grouped and column-wise quantization as
  // we scale a `half2` tile in column-major layout in the former and in
  // row-major in the latter case.
  if (group_blocks != -1)
    s_sh_rd = 8 * ((threadIdx.x / 32) % (thread_n_blocks / 4)) +
              (threadIdx.x % 32) / 4;
  else
    s_sh_rd = 8 * ((threadIdx.x / 32) % (thread_n_blocks / 4)) +
              (threadIdx.x % 32) % 4;

  // Precompute which thread should not read memory in which iterations; this is
  // needed if there are more threads than required for a certain tilesize or
  // when the batchsize is not a multiple of 16.
  bool a_sh_wr_pred[a_sh_wr_iters];
#pragma unroll
  for (int i = 0; i < a_sh_wr_iters; i++)
    a_sh_wr_pred[i] = a_sh_wr_delta * i + a_sh_wr < a_sh_stride * prob_m;
  bool s_sh_wr_pred = threadIdx.x < s_sh_stage;

  // To ensure that writing and reading A tiles to/from shared memory, the
  // latter in fragment format, is fully bank conflict free, we need to use a
  // rather fancy XOR-based layout. The key here is that neither reads nor
  // writes of the 16-byte `int4` blocks of 8 consecutive threads involve the
  // same shared memory banks. Further, it seems (based on NSight-Compute) that
  // each warp must also write a consecutive memory segment?
  auto transform_a = [&](int i) {
    int row = i / a_gl_rd_delta_o;
    return a_gl_rd_delta_o * row + (i % a_gl_rd_delta_o) ^ row;
  };
  // Since the computation of this remapping is non-trivial and, due to our main
  // loop unrolls, all shared memory accesses are static, we simply precompute
  // both transformed reads and writes.
  int a_sh_wr_trans[a_sh_wr_iters];
#pragma unroll
  for (int i = 0; i < a_sh_wr_iters; i++)
    a_sh_wr_trans[i] = transform_a(a_sh_wr_delta * i + a_sh_wr);
  int a_sh_rd_trans[b_sh_wr_iters][thread_m_blocks];
#pragma unroll
  for (int i = 0; i < b_sh_wr_iters; i++) {
#pragma unroll
    for (int j = 0; j < thread_m_blocks; j++)
      a_sh_rd_trans[i][j] =
          transform_a(a_sh_rd_delta_o * i + a_sh_rd_delta_i * j + a_sh_rd);
  }

  // Since B-accesses have non-constant stride they have to be computed at
  // runtime; we break dependencies between subsequent accesses with a tile by
  // maintining multiple pointers (we have enough registers), a tiny
  // optimization.
  const int4 *B_ptr[b_sh_wr_iters];
#pragma unroll
  for (int i = 0; i < b_sh_wr_iters; i++)
    B_ptr[i] = B + b_gl_rd_delta_i * i + b_gl_rd;

  extern __shared__ int4 sh[];
  // Shared memory storage for global fetch pipelines.
  int4 *sh_a = sh;
  int4 *sh_b = sh_a + (stages * a_sh_stage);
  int4 *sh_s = sh_b + (stages * b_sh_stage);
  int4 *sh_z = sh_s + (stages * s_sh_stage);
  // Register storage for double buffer of shared memory reads.
  FragA<scalar_t> frag_a[2][thread_m_blocks];
  I4 frag_b_quant[2];
  FragC frag_c[thread_m_blocks][4][2];
  FragS<scalar_t> frag_s[2][4];
  int frag_z[2];  // this thread's word of zero points, per register buffer

  // Zero accumulators.
  auto zero_accums = [&]() {
#pragma unroll
    for (int i = 0; i < thread_m_blocks * 4 * 2 * 4; i++)
      reinterpret_cast<float *>(frag_c)[i] = 0;
  };

  // Asynchronously fetch the next A, B and s tile from global to the next
  // shared memory pipeline location.
  const uint64_t b_policy = make_evict_first_policy();
  auto fetch_to_shared = [&](int pipe, int a_off, bool pred = true) {
    if (pred) {
      int4 *sh_a_stage = sh_a + a_sh_stage * pipe;
#pragma unroll
      for (int i = 0; i < a_sh_wr_iters; i++) {
        cp_async4_pred(
            &sh_a_stage[a_sh_wr_trans[i]],
            &A[a_gl_rd_delta_i * i + a_gl_rd + a_gl_rd_delta_o * a_off],
            a_sh_wr_pred[i]);
      }
      int4 *sh_b_stage = sh_b + b_sh_stage * pipe;
#pragma unroll
      for (int i = 0; i < b_sh_wr_iters; i++) {
        cp_async4_evict_first(&sh_b_stage[b_sh_wr_delta * i + b_sh_wr], B_ptr[i],
                              b_policy);
        B_ptr[i] += b_gl_rd_delta_o;
      }
      // Every stage gets its own copy of its group's scales, fetched with
      // the tile. Fetching them once per group, into the stage of the
      // group's first tile, and reading them there for all its tiles (as
      // upstream Marlin does) is a race with groups of two tiles (g128,
      // 64-deep tiles): the fetch of the group after next, issued in the
      // group's second tile, overwrites the scales that slower warps are
      // still reading, and their last k16 sub-tiles get the wrong group's
      // scales (compute-sanitizer --tool racecheck reports it).
      if (group_blocks != -1) {
        int4 *sh_s_stage = sh_s + s_sh_stage * pipe;
        if (s_sh_wr_pred)
          cp_async4(&sh_s_stage[s_sh_wr], &s[s_gl_rd]);
        if ((pipe + 1) % Shape::group_tiles == 0)  // the group's last tile
          s_gl_rd += s_gl_rd_delta;
      }
      if constexpr (has_zeros) {
        int4 *sh_z_stage = sh_z + z_sh_stage * pipe;
        if (threadIdx.x < z_sh_stage)
          cp_async4(&sh_z_stage[threadIdx.x], &zeros[z_gl_rd]);
        if (group_blocks != -1 && (pipe + 1) % Shape::group_tiles == 0)
          z_gl_rd += z_gl_stride * s_tb_groups;
      }
    }
    // Insert a fence even when we are winding down the pipeline to ensure that
    // waiting is also correct at this point.
    cp_async_fence();
  };

  // Wait until the next thread tile has been loaded to shared memory.
  auto wait_for_stage = [&]() {
    // We only have `stages - 2` active fetches since we are double buffering
    // and can only issue the next fetch when it is guaranteed that the previous
    // shared memory load is fully complete (as it may otherwise be
    // overwritten).
    cp_async_wait<stages - 2>();
    __syncthreads();
  };

  // Load the next sub-tile from the current location in the shared memory pipe
  // into the current register buffer.
  auto fetch_to_registers = [&](int k, int pipe) {
    // It may seem inefficient that we reload the groups for every sub-tile;
    // however, this does not seem to be a significant bottleneck, while some
    // theoretically better attempts have lead to bad instruction ordering by
    // the compiler and correspondingly a noticeable drop in performance.
    if (group_blocks != -1) {
      int4 *sh_s_stage = sh_s + s_sh_stage * pipe;
      // This warp's 16 rows of k in the tile are k block
      // warp_k + k_warps * (k % b_sh_wr_iters) (see a_sh_rd and b_sh_rd);
      // with several groups per tile, pick that block's row of scales.
      int s_row = 0;
      if constexpr (s_tb_groups > 1) {
        constexpr int k_warps = Shape::k_warps;
        int warp_k = (threadIdx.x / 32) / (thread_n_blocks / 4);
        s_row = (warp_k + k_warps * (k % b_sh_wr_iters)) / group_blocks;
      }
      reinterpret_cast<int4 *>(&frag_s[k % 2])[0] = sh_s_stage[s_sh_stride * s_row + s_sh_rd];
    }
    if constexpr (has_zeros) {
      // The same row as the scales' (the one row per column).
      int z_row = 0;
      if constexpr (s_tb_groups > 1) {
        constexpr int k_warps = Shape::k_warps;
        int warp_k = (threadIdx.x / 32) / (thread_n_blocks / 4);
        z_row = (warp_k + k_warps * (k % b_sh_wr_iters)) / group_blocks;
      }
      const int *sh_z_stage = reinterpret_cast<const int *>(sh_z + z_sh_stage * pipe);
      frag_z[k % 2] = sh_z_stage[4 * z_sh_stride * z_row + z_sh_rd];
    }
    int4 *sh_a_stage = sh_a + a_sh_stage * pipe;
#pragma unroll
    for (int i = 0; i < thread_m_blocks; i++)
      ldsm4<scalar_t>(frag_a[k % 2][i], &sh_a_stage[a_sh_rd_trans[k % b_sh_wr_iters][i]]);
    int4 *sh_b_stage = sh_b + b_sh_stage * pipe;
    frag_b_quant[k % 2] = *reinterpret_cast<I4 *>(
        &sh_b_stage[b_sh_rd_delta * (k % b_sh_wr_iters) + b_sh_rd]);
  };

  // Execute the actual tensor core matmul of a sub-tile.
  auto matmul = [&](int k) {
// We have the m dimension as the inner loop in order to encourage overlapping
// dequantization and matmul operations.
#pragma unroll
    for (int j = 0; j < 4; j++) {
      int b_quant = frag_b_quant[k % 2][j];
      int b_quant_shift = b_quant >> 8;
      // Column n (h = 0) or n + 8 (h = 1) of tile j, with its zero point.
      ZeroPoints<scalar_t> zp{};
      if constexpr (has_zeros) zp = zero_points<scalar_t>(frag_z[k % 2], j);
      auto dequant_column = [&](int q, int h) {
        if constexpr (has_zeros)
          return dequant<scalar_t>(q, zp, h);
        else
          return dequant<scalar_t>(q);
      };
      FragB<scalar_t> frag_b0 = dequant_column(b_quant, 0);
      // If there are no groups, we can just scale the final output once and can
      // avoid doing so for each weight.
      if (group_blocks != -1)
        scale<scalar_t>(frag_b0, frag_s[k % 2][j], 0);
      FragB<scalar_t> frag_b1 = dequant_column(b_quant_shift, 1);
      if (group_blocks != -1)
        scale<scalar_t>(frag_b1, frag_s[k % 2][j], 1);
#pragma unroll
      for (int i = 0; i < thread_m_blocks; i++) {
        mma<scalar_t>(frag_a[k % 2][i], frag_b0, frag_c[i][j][0]);
        mma<scalar_t>(frag_a[k % 2][i], frag_b1, frag_c[i][j][1]);
      }
    }
  };

  // Since we slice across the k dimension of a tile in order to increase the
  // number of warps while keeping the n dimension of a tile reasonable, we have
  // multiple warps that accumulate their partial sums of the same output
  // location; which we have to reduce over in the end. We do in shared memory.
  auto thread_block_reduce = [&]() {
    constexpr int red_off = threads / b_sh_stride / 2;
    if (red_off >= 1) {
      // The buffers below overlap the pipeline's A stages, which slower warps
      // may still be reading: the main loop's last step prefetches the next
      // stage's first sub-tile (unused at a slice's end, but a race all the
      // same, which compute-sanitizer's racecheck reports without this
      // barrier).
      __syncthreads();
      int red_idx = threadIdx.x / b_sh_stride;
      constexpr int red_sh_stride = b_sh_stride * 4 * 2;
      constexpr int red_sh_delta = b_sh_stride;
      int red_sh_rd = red_sh_stride * (threadIdx.x / b_sh_stride) +
                      (threadIdx.x % b_sh_stride);

      // Parallel logarithmic shared memory reduction. We make sure to avoid any
      // unnecessary read or write iterations, e.g., for two warps we write only
      // once by warp 1 and read only once by warp 0.

#pragma unroll
      for (int m_block = 0; m_block < thread_m_blocks; m_block++) {
#pragma unroll
        for (int i = red_off; i > 0; i /= 2) {
          if (i <= red_idx && red_idx < 2 * i) {
#pragma unroll
            for (int j = 0; j < 4 * 2; j++) {
              int red_sh_wr =
                  red_sh_delta * j + (red_sh_rd - red_sh_stride * i);
              if (i < red_off) {
                float *c_rd = reinterpret_cast<float *>(
                    &sh[red_sh_delta * j + red_sh_rd]);
                float *c_wr = reinterpret_cast<float *>(&sh[red_sh_wr]);
#pragma unroll
                for (int k = 0; k < 4; k++)
                  reinterpret_cast<FragC *>(frag_c)[4 * 2 * m_block + j][k] +=
                      c_rd[k] + c_wr[k];
              }
              sh[red_sh_wr] =
                  reinterpret_cast<int4 *>(&frag_c)[4 * 2 * m_block + j];
            }
          }
          __syncthreads();
        }
        if (red_idx == 0) {
#pragma unroll
          for (int i = 0; i < 4 * 2; i++) {
            float *c_rd =
                reinterpret_cast<float *>(&sh[red_sh_delta * i + red_sh_rd]);
#pragma unroll
            for (int j = 0; j < 4; j++)
              reinterpret_cast<FragC *>(frag_c)[4 * 2 * m_block + i][j] +=
                  c_rd[j];
          }
        }
        __syncthreads();
      }
    }
  };

  // Since multiple threadblocks may process parts of the same column slice, we
  // finally have to globally reduce over the results. As the striped
  // partitioning minimizes the number of such reductions and our outputs are
  // usually rather small, we perform this reduction serially in L2 cache.
  // Upstream Marlin reduces in the fp16 output buffer, rounding every
  // partial sum; here the partial sums stay fp32, in a scratch tile per (batch block, column slice) laid out in the
  // threads' own fragment order: thread t's float4 number f sits at
  // f * active_threads + t, so every access is one coalesced 16-byte load or
  // store and no reordering is needed.
  // fp32 doubles the bytes each block moves, and the blocks of a slice take
  // turns, so the handoff is per 16-row block, each with its own lock: the
  // next block starts on rows 0..15 while this one is still on the rest, and
  // a chain of c blocks costs c + thread_m_blocks - 1 steps of one row block
  // instead of c steps of all of them. Row blocks wholly past prob_m are
  // skipped (by every thread: the locks synchronize the whole block).
  auto global_reduce = [&](bool first, bool last) {
    constexpr int active_threads = 32 * thread_n_blocks / 4;
    // The scratch tile and the locks of (batch block, column slice) number
    // slice_col_par, found from it here rather than by pointers advanced with
    // A and C: two fewer live 64-bit values in the main loop, whose 64-row
    // tiles use all 255 registers.
    float4 *c_tmp = reinterpret_cast<float4 *>(C_tmp + c_tile * slice_col_par);
    float4 *frag = reinterpret_cast<float4 *>(&frag_c);
#pragma unroll
    for (int i = 0; i < thread_m_blocks; i++) {
      if (16 * i >= prob_m) break;
      int *lock = &locks[thread_m_blocks * slice_col_par + i];
      barrier_acquire(lock, slice_idx);
      // After thread_block_reduce the first active_threads threads hold the
      // tile's sums. The row block's 8 float4s per thread are loaded
      // together (plain L2 loads, in program order after the acquire; staged
      // through shared memory with cp.async they read stale sums now and
      // then), then added and stored.
      if (threadIdx.x < active_threads) {
        float4 *slot = &c_tmp[8 * i * active_threads + threadIdx.x];
        if (!first) {
          float4 partial[8];
#pragma unroll
          for (int j = 0; j < 8; j++) partial[j] = __ldcg(&slot[j * active_threads]);
#pragma unroll
          for (int j = 0; j < 8; j++) {
            frag[8 * i + j].x += partial[j].x;
            frag[8 * i + j].y += partial[j].y;
            frag[8 * i + j].z += partial[j].z;
            frag[8 * i + j].w += partial[j].w;
          }
        }
        if (!last) {
#pragma unroll
          for (int j = 0; j < 8; j++) __stcg(&slot[j * active_threads], frag[8 * i + j]);
        }
      }
      barrier_release(lock, last);
    }
  };

  // The slot reduction, for tiles of 32 rows or more (a chain's handoffs cost
  // a few L2 round trips each, which add up over the row blocks of a tile). Only
  // the stripe that starts a column (its top: slice_idx == slice_count - 1)
  // writes the result. Every other stripe meets the column with its first
  // piece (a stripe's later pieces all start at a column's top), so block b
  // stores that piece's fp32 tile in slot b of the scratch, without waiting
  // for anyone, and counts itself in on the column's counter. The top block,
  // which finishes the column last (it ends its stripe there), waits until
  // the other slice_count - 1 have counted in, then adds their slots b + 1,
  // b + 2, ... in that order: a fixed order, so results are the same from
  // run to run. Slots are in the threads' own fragment order (thread t's
  // float4 f at f * active_threads + t), and each thread stages the slots it
  // needs through shared memory of its own with cp.async, so the loads of a
  // whole tile are in flight at once without registers to hold them.
  // Returns whether this block still has to count itself in (the caller does
  // it once the next slice's first fetches are on their way).
  auto slot_reduce = [&](bool last) -> bool {
    constexpr int active_threads = 32 * thread_n_blocks / 4;
    constexpr int tile_f4 = Shape::tile_f4;
    constexpr int fit = Shape::slot_stage;
    const int row_blocks = prob_m >= 16 * thread_m_blocks ? thread_m_blocks : ceildiv(prob_m, 16);
    float4 *frag = reinterpret_cast<float4 *>(&frag_c);
    float4 *slots = reinterpret_cast<float4 *>(C_tmp);
    if (!last) {
      if (threadIdx.x < active_threads) {
        float4 *slot = &slots[tile_f4 * blockIdx.x + threadIdx.x];
#pragma unroll
        for (int f = 0; f < 8 * thread_m_blocks; f++)
          if (f < 8 * row_blocks) __stcg(&slot[f * active_threads], frag[f]);
      }
      __syncthreads();
      return true;
    }
    if (threadIdx.x == 0) {
      int *counter = &locks[slice_col_par];
      int state;
      do
        asm volatile("ld.global.acquire.gpu.b32 %0, [%1];\n" : "=r"(state) : "l"(counter));
      while (state != slice_count - 1);
      *counter = 0;  // for the next launch
    }
    __syncthreads();
    if (threadIdx.x < active_threads) {
      float4 *stage = reinterpret_cast<float4 *>(sh) + threadIdx.x;
      for (int b = 1; b < slice_count; b += fit) {
        const int count = slice_count - b < fit ? slice_count - b : fit;
        for (int q = 0; q < count; q++) {
          const float4 *slot = &slots[tile_f4 * (blockIdx.x + b + q) + threadIdx.x];
#pragma unroll
          for (int f = 0; f < 8 * thread_m_blocks; f++)
            if (f < 8 * row_blocks)
              cp_async4(&stage[tile_f4 * q + f * active_threads], &slot[f * active_threads]);
        }
        cp_async_fence();
        cp_async_wait<0>();
        for (int q = 0; q < count; q++) {
#pragma unroll
          for (int i = 0; i < thread_m_blocks; i++) {
            if (i < row_blocks) {
#pragma unroll
              for (int j = 0; j < 8; j++) {
                float4 partial = stage[tile_f4 * q + (8 * i + j) * active_threads];
                frag[8 * i + j].x += partial.x;
                frag[8 * i + j].y += partial.y;
                frag[8 * i + j].z += partial.z;
                frag[8 * i + j].w += partial.w;
              }
            }
            // One row block's loads at a time: hoisting all of them would
            // need 128 more registers next to the 128 accumulators.
            asm volatile("" ::: "memory");
          }
        }
      }
    }
    __syncthreads();  // write_result reuses the staging memory
    return false;
  };

  // Write out the reduce final result in the correct layout. We only actually
  // reshuffle matrix fragments in this step, the reduction above is performed
  // in fragment layout.
  auto write_result = [&]() {
    int c_gl_stride = prob_n / 8;
    constexpr int c_sh_stride = 2 * thread_n_blocks + 1;
    int c_gl_wr_delta = c_gl_stride * (threads / (2 * thread_n_blocks));
    constexpr int c_sh_rd_delta =
        c_sh_stride * (threads / (2 * thread_n_blocks));

    int c_gl_wr = c_gl_stride * (threadIdx.x / (2 * thread_n_blocks)) +
                  (threadIdx.x % (2 * thread_n_blocks));
    c_gl_wr += (2 * thread_n_blocks) * slice_col;
    int c_sh_wr =
        (4 * c_sh_stride) * ((threadIdx.x % 32) / 4) + (threadIdx.x % 32) % 4;
    c_sh_wr += 32 * (threadIdx.x / 32);
    int c_sh_rd = c_sh_stride * (threadIdx.x / (2 * thread_n_blocks)) +
                  (threadIdx.x % (2 * thread_n_blocks));

    int c_gl_wr_end = c_gl_stride * prob_m;

    // We first reorder in shared memory to guarantee the most efficient final
    // global write patterns. The per-column scale and the bias are applied in
    // fp32, so each output is rounded to fp16/bf16 once.
    auto write = [&](int idx, float c0, float c1, FragS<scalar_t> &s, float2 b) {
      if constexpr (group_blocks == -1) {
        // for per-column quantization we finally apply the scale here
        float2 sf = Scalar::to_floats(s[0]);
        c0 *= sf.x;
        c1 *= sf.y;
      }
      reinterpret_cast<T2 *>(sh)[idx] = Scalar::from_floats(c0 + b.x, c1 + b.y);
    };
    if (threadIdx.x / 32 < thread_n_blocks / 4) {
      // Column pair 8 j + 4 h (in pairs) of this thread's strip, in the same
      // order as c_sh_wr; the bias is not permuted.
      // Kept as pairs of fp16/bf16 (8 registers, not 16: the 64-row tiles
      // have all 128 accumulators live here).
      T2 bias_pair[4][2];
      const T2 *bias2 = reinterpret_cast<const T2 *>(bias);
      const int bias_col = 8 * thread_n_blocks * slice_col + (threadIdx.x % 32) % 4 +
                           32 * (threadIdx.x / 32);
#pragma unroll
      for (int j = 0; j < 4; j++)
#pragma unroll
        for (int h = 0; h < 2; h++)
          bias_pair[j][h] = bias ? bias2[bias_col + 8 * j + 4 * h] : Scalar::from_floats(0.f, 0.f);
#pragma unroll
      for (int i = 0; i < thread_m_blocks; i++) {
#pragma unroll
        for (int j = 0; j < 4; j++) {
          int wr = c_sh_wr + 8 * j;
          write(wr + (4 * c_sh_stride) * 0 + 0, frag_c[i][j][0][0],
                frag_c[i][j][0][1], frag_s[j / 2][2 * (j % 2) + 0], Scalar::to_floats(bias_pair[j][0]));
          write(wr + (4 * c_sh_stride) * 8 + 0, frag_c[i][j][0][2],
                frag_c[i][j][0][3], frag_s[j / 2][2 * (j % 2) + 0], Scalar::to_floats(bias_pair[j][0]));
          write(wr + (4 * c_sh_stride) * 0 + 4, frag_c[i][j][1][0],
                frag_c[i][j][1][1], frag_s[j / 2][2 * (j % 2) + 1], Scalar::to_floats(bias_pair[j][1]));
          write(wr + (4 * c_sh_stride) * 8 + 4, frag_c[i][j][1][2],
                frag_c[i][j][1][3], frag_s[j / 2][2 * (j % 2) + 1], Scalar::to_floats(bias_pair[j][1]));
        }
        c_sh_wr += 16 * (4 * c_sh_stride);
      }
    }
    __syncthreads();

#pragma unroll
    for (int i = 0;
         i < ceildiv(16 * thread_m_blocks, threads / (2 * thread_n_blocks));
         i++) {
      if (c_gl_wr < c_gl_wr_end) {
        C[c_gl_wr] = sh[c_sh_rd];
        c_gl_wr += c_gl_wr_delta;
        c_sh_rd += c_sh_rd_delta;
      }
    }
  };

  // Start global fetch and register load pipelines.
  auto start_pipes = [&]() {
    // The fetches below overwrite shared memory that write_result of the
    // previous slice may still be reading in slower warps (for stripes that
    // span more than one column slice).
    __syncthreads();
#pragma unroll
    for (int i = 0; i < stages - 1; i++)
      fetch_to_shared(i, i, i < slice_iters);
    zero_accums();
    wait_for_stage();
    fetch_to_registers(0, 0);
    a_gl_rd += a_gl_rd_delta_o * (stages - 1);
  };
  start_pipes();

  // Main loop.
  while (slice_iters) {
// We unroll over both the global fetch and the register load pipeline to ensure
// all shared memory accesses are static. Note that both pipelines have even
// length meaning that the next iteration will always start at index 0.
#pragma unroll
    for (int pipe = 0; pipe < stages;) {
#pragma unroll
      for (int k = 0; k < b_sh_wr_iters; k++) {
        fetch_to_registers(k + 1, pipe % stages);
        if (k == b_sh_wr_iters - 2) {
          fetch_to_shared((pipe + stages - 1) % stages, pipe,
                          slice_iters >= stages);
          pipe++;
          wait_for_stage();
        }
        matmul(k);
      }
      slice_iters--;
      if (slice_iters == 0)
        break;
    }
    a_gl_rd += a_gl_rd_delta_o * stages;

    // Process results and, if necessary, proceed to the next column slice.
    // While this pattern may not be the most readable, other ways of writing
    // the loop seemed to noticeably worse performance after compilation.
    if (slice_iters == 0) {
      cp_async_wait<0>();
      bool last = slice_idx == slice_count - 1;
      // For per-column scales, we only fetch them here in the final step before
      // write-out
      if (group_blocks == -1 && last) {
        if (s_sh_wr_pred)
          cp_async4(&sh_s[s_sh_wr], &s[s_gl_rd]);
        cp_async_fence();
      }
      thread_block_reduce();
      if (group_blocks == -1 && last) {
        cp_async_wait<0>();
        __syncthreads();
        if (threadIdx.x / 32 < thread_n_blocks / 4) {
          reinterpret_cast<int4 *>(&frag_s)[0] = sh_s[s_sh_rd + 0];
          reinterpret_cast<int4 *>(&frag_s)[1] = sh_s[s_sh_rd + 4];
        }
      }
      int *pending_count = &locks[slice_col_par];
      bool pending = false;
      if (slice_count > 1) { // only globally reduce if there is more than one
                             // block in a slice
        if constexpr (thread_m_blocks >= 2)
          pending = slot_reduce(last);
        else
          global_reduce(slice_idx == 0, last);
      }
      if (last) // only the last block in a slice actually writes the result
        write_result();
      slice_row = 0;
      slice_col_par++;
      slice_col++;
      init_slice();
      if (slice_iters) {
        a_gl_rd = a_gl_stride * (threadIdx.x / a_gl_rd_delta_o) +
                  (threadIdx.x % a_gl_rd_delta_o);
#pragma unroll
        for (int i = 0; i < b_sh_wr_iters; i++)
          B_ptr[i] += b_sh_stride - b_gl_rd_delta_o * k_tiles;
        if (slice_col == 0) {
#pragma unroll
          for (int i = 0; i < b_sh_wr_iters; i++)
            B_ptr[i] -= b_gl_stride;
        }
        s_gl_rd = s_gl_start();  // slice_row is 0 again
        if constexpr (has_zeros)
          z_gl_rd = z_gl_start();
        start_pipes();
      }
      // Count in on the column of the slot stored above: the fence makes the
      // slot's stores (ordered before it by the __syncthreads in slot_reduce)
      // visible before the count. Done here, after the next slice's first
      // fetches, the stores have mostly landed and the fence costs little.
      if (pending && threadIdx.x == 0) {
        asm volatile("fence.acq_rel.gpu;\n");
        asm volatile("red.relaxed.gpu.global.add.s32 [%0], %1;\n" : : "l"(pending_count), "r"(1));
      }
    }
  }
}

#else

// Device code for compute capability < 8.0 (and the host pass): the launcher
// refuses such devices before any launch, so this body never runs.
template <typename scalar_t, const int threads, const int thread_m_blocks,
          const int thread_n_blocks, const int thread_k_blocks,
          const int stages, const int group_blocks = -1, const bool has_zeros = false>
__global__ void Marlin(const int4 *__restrict__ A, const int4 *__restrict__ B,
                       int4 *__restrict__ C, float *__restrict__ C_tmp,
                       const int4 *__restrict__ s, const int4 *__restrict__ bias,
                       int prob_m, int prob_n, int prob_k, int *locks,
                       const int4 *__restrict__ zeros) {}

#endif

constexpr int kStages = 4;  // 4 pipeline stages: upstream Marlin's tuned depth

// One kernel instantiation: raise its dynamic shared memory limit once per
// device (not on every call), then launch.
template <typename scalar_t, int threads, int thread_m_blocks, int thread_n_blocks,
          int thread_k_blocks, int group_blocks, bool has_zeros>
std::string launch(const LaunchArgs &p) {
  using Shape = TileShape<threads, thread_m_blocks, thread_n_blocks,
                          thread_k_blocks, kStages, group_blocks, has_zeros>;
  auto *kernel = Marlin<scalar_t, threads, thread_m_blocks, thread_n_blocks,
                        thread_k_blocks, kStages, group_blocks, has_zeros>;
  if (Shape::shared_bytes > p.max_shared)
    return "jax_marlin: the kernel tile needs " + std::to_string(Shape::shared_bytes) +
           " bytes of shared memory per block, the device allows " +
           std::to_string(p.max_shared);
  static std::once_flag once[kMaxDevices];
  static cudaError_t attr_error[kMaxDevices];
  std::call_once(once[p.device], [&] {
    attr_error[p.device] = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Shape::shared_bytes);
  });
  if (attr_error[p.device]) return cuda_error("cudaFuncSetAttribute", attr_error[p.device]);
  kernel<<<p.blocks, threads, Shape::shared_bytes, p.stream>>>(
      p.A, p.B, p.C, p.C_tmp, p.s, p.bias, p.m, p.n, p.k, p.locks, p.zeros);
  if (cudaError_t error = cudaGetLastError()) return cuda_error("kernel launch", error);
  return {};
}

template <typename scalar_t, int threads, int thread_n_blocks, int thread_k_blocks,
          int group_blocks, bool has_zeros>
std::string launch_m(int thread_m_blocks, const LaunchArgs &p) {
  switch (thread_m_blocks) {
    case 1: return launch<scalar_t, threads, 1, thread_n_blocks, thread_k_blocks, group_blocks, has_zeros>(p);
    case 2: return launch<scalar_t, threads, 2, thread_n_blocks, thread_k_blocks, group_blocks, has_zeros>(p);
    case 3: return launch<scalar_t, threads, 3, thread_n_blocks, thread_k_blocks, group_blocks, has_zeros>(p);
    case 4: return launch<scalar_t, threads, 4, thread_n_blocks, thread_k_blocks, group_blocks, has_zeros>(p);
    default: return "jax_marlin: no kernel for thread_m_blocks = " + std::to_string(thread_m_blocks);
  }
}

// The tile of marlin_problem.h's kTiles equal to `c`, instantiated for each
// entry of the table in order (and for nothing else).
template <typename scalar_t, int group_blocks, bool has_zeros, size_t... tile>
std::string launch_tile_of(const ThreadConfig &c, int thread_m_blocks, const LaunchArgs &p,
                           std::index_sequence<tile...>) {
  std::string why = "jax_marlin: no kernel for the tile (thread_k, thread_n, threads) = (" +
                    std::to_string(c.thread_k) + ", " + std::to_string(c.thread_n) + ", " +
                    std::to_string(c.threads) + ")";
  ((c == kTiles[tile] &&
    (why = launch_m<scalar_t, kTiles[tile].threads, kTiles[tile].thread_n / 16,
                    kTiles[tile].thread_k / 16, group_blocks, has_zeros>(thread_m_blocks, p),
     true)) ||
   ...);
  return why;
}

template <typename scalar_t, int group_blocks, bool has_zeros>
std::string launch_tile(const ThreadConfig &c, int thread_m_blocks, const LaunchArgs &p) {
  return launch_tile_of<scalar_t, group_blocks, has_zeros>(c, thread_m_blocks, p,
                                                           std::make_index_sequence<kNumTiles>());
}

}  // namespace marlin
