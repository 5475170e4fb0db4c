// The launcher of the Marlin FP16/BF16 x INT4 GEMM: checks the problem, picks
// the tile and the kernel instantiation (marlin_instance.cu), and splits large
// batches into launches. The kernel itself is in marlin_kernel.cuh; see there
// and NOTICE for its origin and license (Apache-2.0).
#include "marlin_kernel.h"

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

#include "decode_kernel.h"
#include "marlin_launch.h"
#include "pdl_launch.cuh"
#include "prefill_sm90.h"
#include "scratch_sizes.h"

namespace marlin {
namespace {

// Which kernels the launcher may pick on sm_90, for measurements against the
// Marlin kernel: JAX_MARLIN_DECODE=0 keeps m <= 16 off the decode kernel, and
// "cw,kw,s" forces a decode configuration; JAX_MARLIN_PREFILL=0 keeps m >= 64
// off the prefill kernel; JAX_MARLIN_PDL=0 turns programmatic dependent
// launch off (the decode and prefill kernels', the act-order and prologue
// passes'); JAX_MARLIN_EARLY_WEIGHTS=0 the decode kernel's early weights in a
// chain call (Fusion::early_weights). Read once per process. (PDL overlaps a
// kernel with the one before it on the stream: within one call, e.g. the
// act-order pass and its kernel, and between calls on a plain stream. XLA
// records each custom call into its command buffer as a child graph of its
// own, so between two jitted calls it has no effect there; with
// JAX_MARLIN_COMMAND_BUFFER=0 the calls run on the stream and adjacent ones
// keep the edge: benchmarks/NOTES.md.)
struct KernelPolicy {
  bool decode = true;
  bool prefill = true;
  bool pdl = true;
  bool early_weights = true;
  DecodeConfig forced;
};

const KernelPolicy &kernel_policy() {
  static const KernelPolicy policy = [] {
    KernelPolicy p;
    auto off = [](const char *name) {
      const char *v = std::getenv(name);
      return v && std::string(v) == "0";
    };
    p.decode = !off("JAX_MARLIN_DECODE");
    p.prefill = !off("JAX_MARLIN_PREFILL");
    p.pdl = !off("JAX_MARLIN_PDL");
    p.early_weights = !off("JAX_MARLIN_EARLY_WEIGHTS");
    if (const char *v = std::getenv("JAX_MARLIN_DECODE"))
      if (std::sscanf(v, "%d,%d,%d", &p.forced.cw, &p.forced.kw, &p.forced.s) != 3)
        p.forced = DecodeConfig{};
    return p;
  }();
  return policy;
}

// Act-order for the kernels that copy whole rows of A: out[r, j] = A[r,
// perm[j]], A and out [m, k] of 16-bit values. Block (r, s) stages row r of A
// in shared memory (16-byte loads) and writes split s of its columns, 8 (16
// bytes) a thread, so that A is read from HBM once (the splits of a row
// re-read it from L2) and written once, by enough blocks to fill the GPU at
// small m. Rows longer than the shared memory a block may opt into are
// gathered from global memory instead. An index out of range is clamped
// (jm.pack never writes one).
constexpr int kPermuteThreads = 256;
constexpr int kPermuteMinSplitCols = 2048;  // columns a block writes at least

// The row passes (the permutation, the prologue) are launched with
// programmatic dependent launch where the launcher's `pdl` allows: their
// blocks then start while the kernel before them ends (they wait for it
// before they read A), as the decode and prefill kernels do, rather than
// after it, so that a pass does not break the chain of overlapped launches on
// a stream. (H100, act-order as independent calls: up to 10% faster at m =
// 16-64 on the 70B and 8B layers; no change in a CUDA graph of dependent
// calls, where no kernel of the previous call precedes the pass:
// benchmarks/NOTES.md.) The passes run on any device, PDL only on sm_90.
bool pass_pdl(const KernelPolicy &policy, const DeviceInfo &info) {
  return policy.pdl && info.major >= 9;
}

template <bool staged>
__global__ void __launch_bounds__(kPermuteThreads)
    permute_columns(const uint16_t *A, const int *perm, uint16_t *out, int k, int split_cols) {
  extern __shared__ int4 stage[];
  const int64_t row = blockIdx.x;
  const uint16_t *src = A + row * k;
  // The first 8 indices are requested before the row, so both are in flight.
  const int4 *perm4 = reinterpret_cast<const int4 *>(perm);
  const int j8_first = blockIdx.y * split_cols / 8 + threadIdx.x;
  const int end = min(k, int(blockIdx.y + 1) * split_cols);
  int4 p_first[2] = {};
  if (j8_first < end / 8) p_first[0] = perm4[2 * j8_first], p_first[1] = perm4[2 * j8_first + 1];
  // Launched with PDL, this pass may start while the kernel before it ends:
  // A (which that kernel may write) is read only after it has finished.
  // The kernel after this one (launched with PDL) may start from here on: it
  // reads nothing this one writes before it waits for it. Not earlier: with
  // the signal first, 1 x 28672 x 8192 took 53.2 us against 46.5 here (H100),
  // likely because the next kernel's blocks then start beside the kernel
  // before this one and their L2 prefetch of the weights is evicted before use.
  grid_dependency_wait();
  grid_launch_dependents();
  if constexpr (staged) {
    const int4 *a4 = reinterpret_cast<const int4 *>(src);
    for (int i = threadIdx.x; i < k / 8; i += kPermuteThreads) stage[i] = a4[i];
    __syncthreads();
    src = reinterpret_cast<const uint16_t *>(stage);
  }
  int4 *out4 = reinterpret_cast<int4 *>(out + row * k);
  for (int j8 = j8_first; j8 < end / 8; j8 += kPermuteThreads) {
    const int4 p0 = j8 == j8_first ? p_first[0] : perm4[2 * j8];
    const int4 p1 = j8 == j8_first ? p_first[1] : perm4[2 * j8 + 1];
    const int col[8] = {p0.x, p0.y, p0.z, p0.w, p1.x, p1.y, p1.z, p1.w};
    uint16_t v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = src[col[e] < 0 ? 0 : col[e] >= k ? k - 1 : col[e]];
    out4[j8] = *reinterpret_cast<const int4 *>(v);
  }
}

// The row passes (the permutation, the prologue) split each row of k columns
// into runs of this many (a multiple of 8) for about two blocks per SM in all.
int64_t row_split_cols(int64_t m, int64_t k, const DeviceInfo &info) {
  int64_t splits = (2 * info.sms + m - 1) / m;
  const int64_t most = k / kPermuteMinSplitCols > 1 ? k / kPermuteMinSplitCols : 1;
  if (splits > most) splits = most;
  return (k / 8 + splits - 1) / splits * 8;
}

std::string permute(const void *A, const int *perm, void *out, int64_t m, int64_t k,
                    const DeviceInfo &info, int device, bool pdl, cudaStream_t stream) {
  const int64_t row_bytes = 2 * k;
  const bool staged = row_bytes <= info.max_shared;
  if (staged) {
    static std::once_flag once[kMaxDevices];
    static cudaError_t attr_error[kMaxDevices];
    std::call_once(once[device], [&] {
      attr_error[device] = cudaFuncSetAttribute(
          permute_columns<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, info.max_shared);
    });
    if (attr_error[device]) return cuda_error("cudaFuncSetAttribute", attr_error[device]);
  }
  const int64_t split_cols = row_split_cols(m, k, info);
  const int64_t splits = (k + split_cols - 1) / split_cols;
  auto *kernel = staged ? permute_columns<true> : permute_columns<false>;
  if (cudaError_t error = launch_kernel(
          kernel, dim3(unsigned(m), unsigned(splits)), dim3(kPermuteThreads),
          staged ? size_t(row_bytes) : 0, stream, pdl, 0, static_cast<const uint16_t *>(A), perm,
          static_cast<uint16_t *>(out), int(k), int(split_cols)))
    return cuda_error("act-order permutation launch", error);
  return {};
}

// The fusions (marlin::Fusion) around the kernels that do not run them
// themselves: the prologue as a pass that writes x' (permuted, with a perm)
// into the scratch, the residual as a pass over C after the kernel.
//
// Prologue: out[r, j] = x'[r, perm[j]] (or x'[r, j]), x' = dtype(x r w) with
// r = 1 / sqrt(sum_j x[r, j]^2 / norm_size + eps) (RMSNorm), or with swiglu,
// A's row being gate | up, dtype(silu(gate) up) (SwiGLU); A [m, k] ([m, 2 k]
// with swiglu), out [m, k], w [k]. Block (r, s) writes split s of row r; with
// RMSNorm every split first sums the whole row's squares (from L2 after the
// first), in a fixed order.
__device__ inline float to_float(half v) { return __half2float(v); }
__device__ inline float to_float(nv_bfloat16 v) { return __bfloat162float(v); }
template <typename scalar_t> __device__ scalar_t from_float(float v);
template <> __device__ half from_float<half>(float v) { return __float2half_rn(v); }
template <> __device__ nv_bfloat16 from_float<nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename scalar_t>
__global__ void __launch_bounds__(kPermuteThreads)
    prologue_rows(const scalar_t *A, const scalar_t *norm_weight, bool swiglu, const int *perm,
                  scalar_t *out, int k, float norm_size, float eps, int split_cols) {
  grid_dependency_wait();  // A is read from here on
  grid_launch_dependents();  // not earlier: see permute_columns
  __shared__ float warp_sums[kPermuteThreads / 32];
  __shared__ float r_row;
  const int64_t row = blockIdx.x;
  const scalar_t *x = A + row * (swiglu ? 2 * k : k) + (swiglu ? k : 0);  // up with swiglu
  const scalar_t *gate = x - k;
  float r = 1.f;
  if (norm_weight) {
    float sum = 0.f;
    for (int j = threadIdx.x; j < k; j += kPermuteThreads) {
      const float v = to_float(x[j]);
      sum = fmaf(v, v, sum);
    }
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
      float total = 0.f;
      for (int w = 0; w < kPermuteThreads / 32; ++w) total += warp_sums[w];
      r_row = 1.f / sqrtf(total / norm_size + eps);
    }
    __syncthreads();
    r = r_row;
  }
  const int end = min(k, int(blockIdx.y + 1) * split_cols);
  for (int j = blockIdx.y * split_cols + threadIdx.x; j < end; j += kPermuteThreads) {
    const int c = perm ? min(max(perm[j], 0), k - 1) : j;
    const float v = to_float(x[c]);
    float y;
    if (norm_weight) {
      y = v * r * to_float(norm_weight[c]);
    } else {
      const float g = to_float(gate[c]);
      y = g / (1.f + expf(-g)) * v;
    }
    out[row * k + j] = from_float<scalar_t>(y);
  }
}

// C = dtype(C + residual) elementwise, [m, n] (n a multiple of 64): 8 columns
// a thread.
template <typename scalar_t>
__global__ void add_residual(scalar_t *C, const scalar_t *residual, int64_t count8) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count8;
       i += int64_t(gridDim.x) * blockDim.x) {
    int4 c = reinterpret_cast<int4 *>(C)[i];
    const int4 a = reinterpret_cast<const int4 *>(residual)[i];
    scalar_t *ce = reinterpret_cast<scalar_t *>(&c);
    const scalar_t *ae = reinterpret_cast<const scalar_t *>(&a);
#pragma unroll
    for (int e = 0; e < 8; ++e) ce[e] = from_float<scalar_t>(to_float(ce[e]) + to_float(ae[e]));
    reinterpret_cast<int4 *>(C)[i] = c;
  }
}

template <typename scalar_t>
std::string run_prologue(const void *A, const Fusion &f, const int *perm, void *out, int64_t m,
                         int64_t k, const DeviceInfo &info, bool pdl, cudaStream_t stream) {
  const int64_t split_cols = row_split_cols(m, k, info);
  const int64_t splits = (k + split_cols - 1) / split_cols;
  if (cudaError_t error = launch_kernel(
          prologue_rows<scalar_t>, dim3(unsigned(m), unsigned(splits)), dim3(kPermuteThreads), 0,
          stream, pdl, 0, static_cast<const scalar_t *>(A),
          static_cast<const scalar_t *>(f.norm_weight), f.swiglu, perm,
          static_cast<scalar_t *>(out), int(k), float(f.norm_size), f.norm_eps, int(split_cols)))
    return cuda_error("prologue launch", error);
  return {};
}

template <typename scalar_t>
std::string run_residual(void *C, const void *residual, int64_t m, int64_t n,
                         const DeviceInfo &info, cudaStream_t stream) {
  const int64_t count8 = m * n / 8;
  const int64_t blocks = std::min<int64_t>((count8 + 255) / 256, 8 * int64_t(info.sms));
  add_residual<scalar_t><<<unsigned(blocks), 256, 0, stream>>>(
      static_cast<scalar_t *>(C), static_cast<const scalar_t *>(residual), count8);
  if (cudaError_t error = cudaGetLastError()) return cuda_error("residual launch", error);
  return {};
}

template <typename scalar_t, bool has_zeros>
std::string launch_group(int group_blocks, const ThreadConfig &c, int thread_m_blocks,
                         const LaunchArgs &p) {
  switch (group_blocks) {
    case 2: return launch_tile<scalar_t, 2, has_zeros>(c, thread_m_blocks, p);
    case 4: return launch_tile<scalar_t, 4, has_zeros>(c, thread_m_blocks, p);
    case 8: return launch_tile<scalar_t, 8, has_zeros>(c, thread_m_blocks, p);
    case -1: return launch_tile<scalar_t, -1, has_zeros>(c, thread_m_blocks, p);
    default: return "jax_marlin: no kernel for group_blocks = " + std::to_string(group_blocks);
  }
}

template <typename scalar_t>
std::string launch_zeros(int group_blocks, const ThreadConfig &c, int thread_m_blocks,
                         const LaunchArgs &p) {
  return p.zeros ? launch_group<scalar_t, true>(group_blocks, c, thread_m_blocks, p)
                 : launch_group<scalar_t, false>(group_blocks, c, thread_m_blocks, p);
}

// The product, x' given (the prologue done unless `inside` holds it).
std::string matmul_product(const void *A, const void *B, const void *s, const void *zeros,
                           const int *perm, const void *bias, void *C, int64_t m, int64_t n,
                           int64_t k, int64_t group_size, bool bf16, int *workspace,
                           float *reduce_scratch, cudaStream_t stream, bool workspace_zeroed,
                           const DeviceInfo &info, int device, const DecodeConfig &decode,
                           const Fusion &inside) {
  const KernelPolicy &policy = kernel_policy();
  // Act-order: x in the weight's row order, gathered by the decode kernel
  // as it loads x where decode_gathers says so (decode_kernel.cu), or
  // otherwise written by a pass into the scratch, past the partial sums (the
  // next kernel starts during it: PDL).
  if (perm && !decode_gathers(decode, m, n, k)) {
    const bool pdl = pass_pdl(policy, info);
    void *permuted = reduce_scratch + permuted_x_offset(m, n, k);
    if (std::string why = permute(A, perm, permuted, m, k, info, device, pdl, stream);
        !why.empty())
      return why;
    A = permuted;
    perm = nullptr;
  }
  if (decode.valid())
    return decode_matmul(A, B, s, zeros, perm, bias, C, m, n, k, group_size, bf16, decode,
                         policy.pdl, stream, inside);
  if (info.major == 9 && info.minor == 0 && policy.prefill && prefill_supported(m, n, k, group_size))
    return prefill_matmul(A, B, s, zeros, bias, C, m, n, k, group_size, bf16, workspace,
                          reduce_scratch, stream, policy.pdl, workspace_zeroed);

  // The locks must be zero when the kernel starts; each launch leaves them at
  // zero again, so one memset per call (if any) covers every launch below.
  // The fp32 scratch needs no initial value: the first block of a tile
  // writes it.
  if (!workspace_zeroed)
    if (cudaError_t error =
            cudaMemsetAsync(workspace, 0, marlin_locks_size(m, n) * sizeof(int), stream))
      return cuda_error("cudaMemsetAsync", error);

  const ThreadConfig &config = *choose_config(m, n, k);
  const int group_blocks = group_size == -1 ? -1 : int(group_size / kTile);
  // One thread block per SM, at most kMaxBlocks: the slot reduction gives
  // each block a slot of the scratch (marlin_scratch_size).
  LaunchArgs p{static_cast<const int4 *>(A), static_cast<const int4 *>(B),
               static_cast<int4 *>(C), reduce_scratch, static_cast<const int4 *>(s),
               static_cast<const int4 *>(zeros), static_cast<const int4 *>(bias), 0, int(n), int(k), workspace,
               info.sms < kMaxBlocks ? info.sms : kMaxBlocks,
               info.max_shared, device, stream};

  // Batches of more than 64 rows run as up to kMaxPar blocks of 64 rows in
  // parallel inside one launch; a remainder of fewer than 64 rows gets its
  // own launch with a smaller m tile (the kernel handles partial 16-row
  // blocks). Launches follow each other on the stream, so each reuses the
  // locks (left at zero) and the fp32 scratch from its start.
  const int64_t m_blocks_total = (m + 15) / 16;
  const int64_t pad = 16 * m_blocks_total - m;
  for (int64_t i = 0; i < m_blocks_total; i += 4) {
    int64_t thread_m_blocks = m_blocks_total - i;
    int64_t rows = m - 16 * i;
    int64_t par = 1;
    if (thread_m_blocks > 4) {
      par = (16 * thread_m_blocks - pad) / 64;
      if (par > kMaxPar) par = kMaxPar;
      rows = 64 * par;
      i += 4 * (par - 1);
      thread_m_blocks = 4;
    }
    p.m = int(rows);
    std::string why = bf16 ? launch_zeros<nv_bfloat16>(group_blocks, config, int(thread_m_blocks), p)
                           : launch_zeros<half>(group_blocks, config, int(thread_m_blocks), p);
    if (!why.empty()) return why;
    p.A += 16 * thread_m_blocks * (k / 8) * par;
    p.C += 16 * thread_m_blocks * (n / 8) * par;
  }
  return {};
}

}  // namespace

std::string matmul(const void *A, const void *B, const void *s, const void *zeros,
                   const int *perm, const void *bias, void *C, int64_t m, int64_t n, int64_t k,
                   int64_t group_size, bool bf16, int *workspace, float *reduce_scratch,
                   cudaStream_t stream, bool workspace_zeroed, const Fusion &fusion) {
  if (std::string why = check_problem(m, n, k, group_size); !why.empty())
    return "jax_marlin: " + why;
  if (m == 0) return {};

  int device;
  const DeviceInfo *device_attrs;
  if (std::string why = current_device(&device, &device_attrs); !why.empty()) return why;
  const DeviceInfo &info = *device_attrs;
  if (info.major < 8)
    return "jax_marlin: the Marlin kernel needs compute capability 8.0 or newer, this device has " +
           std::to_string(info.major) + "." + std::to_string(info.minor);

  // On Hopper, decode batch sizes run on the decode kernel (one launch, no
  // scratch) where it was measured faster, and batches of 64 rows and more
  // on the wgmma prefill kernel. (Not the decode kernel for every fused call
  // either: forced onto it where the Marlin kernel won, down's 14336 x 4096
  // at m = 16 took 143 us a Llama-3-8B block against 89 with the passes, H100.)
  const KernelPolicy &policy = kernel_policy();
  DecodeConfig decode;
  if (info.major == 9 && m <= kDecodeMaxM && policy.decode)
    decode = policy.forced.valid() ? policy.forced
                                   : choose_decode_config(m, n, k, group_size, info.sms);
  // The decode kernel adds the residual itself, and runs the prologue on x
  // in its own order; otherwise a prologue pass writes x' (permuted, with a
  // perm) into the scratch, past the partial sums, and for the other kernels
  // a pass after them adds the residual.
  Fusion inside;
  if (decode.valid()) {
    inside.residual = fusion.residual;
    if (!perm) inside = fusion;
    inside.early_weights = fusion.early_weights && policy.early_weights;
  }
  if (fusion.prologue() && !inside.prologue()) {
    void *x_prime = reduce_scratch + permuted_x_offset(m, n, k);
    const bool pdl = pass_pdl(policy, info);
    std::string why =
        bf16 ? run_prologue<nv_bfloat16>(A, fusion, perm, x_prime, m, k, info, pdl, stream)
             : run_prologue<half>(A, fusion, perm, x_prime, m, k, info, pdl, stream);
    if (!why.empty()) return why;
    A = x_prime;
    perm = nullptr;
  }
  std::string why = matmul_product(A, B, s, zeros, perm, bias, C, m, n, k, group_size, bf16,
                                   workspace, reduce_scratch, stream, workspace_zeroed, info,
                                   device, decode, inside);
  if (!why.empty() || !fusion.residual || inside.residual) return why;
  return bf16 ? run_residual<nv_bfloat16>(C, fusion.residual, m, n, info, stream)
              : run_residual<half>(C, fusion.residual, m, n, info, stream);
}

}  // namespace marlin
