// XLA FFI handler for jax_marlin_matmul on CUDA: read the buffers, re-check
// them, launch the kernels on XLA's stream. Two stages: at instantiation a
// call site gets its ZeroedCounters, which each execution then passes to the
// launcher as its counters instead of zeroing the workspace result.
#include <cuda_runtime_api.h>

#include <memory>

#include "ffi_common.h"
#include "marlin_kernel.h"
#include "zeroed_counters.h"

namespace jax_marlin {
namespace {

ffi::ErrorOr<std::unique_ptr<ZeroedCounters>> InstantiateCuda() {
  return std::make_unique<ZeroedCounters>();
}

ffi::Error MatmulCuda(cudaStream_t stream, ZeroedCounters *zeroed, ffi::AnyBuffer x,
                      ffi::Buffer<ffi::S32, 2> qweight,
                      ffi::AnyBuffer scales, ffi::Buffer<ffi::S32, 2> zeros,
                      ffi::Buffer<ffi::S32, 1> perm, ffi::AnyBuffer bias,
                      ffi::AnyBuffer residual, ffi::AnyBuffer norm_weight,
                      ffi::Result<ffi::AnyBuffer> y,
                      ffi::ResultBuffer<ffi::S32, 1> workspace,
                      ffi::ResultBuffer<ffi::F32, 1> reduce_scratch, int64_t group_size,
                      bool poison_output, float norm_eps, int64_t norm_size, bool swiglu) {
  auto dims = check_matmul(x, qweight, scales, zeros, perm, bias, residual, norm_weight, *y,
                           *workspace, *reduce_scratch, group_size, norm_eps, norm_size, swiglu);
  if (dims.has_error()) return dims.error();
  if (poison_output) {
    // 0xFFFF is a NaN in fp16 and in bf16.
    if (cudaError_t error = cudaMemsetAsync(y->untyped_data(), 0xFF, y->size_bytes(), stream))
      return ffi::Error::Internal(std::string("jax_marlin: cudaMemsetAsync failed: ") +
                                  cudaGetErrorString(error));
  }
  // The call site's own zeroed counters if they can be had (they always can,
  // short of device memory), else the workspace result, zeroed by the
  // launcher.
  int *counters = nullptr;
  zeroed->get(workspace->element_count(), &counters);
  marlin::Fusion fusion;
  if (dims->has_residual) fusion.residual = residual.untyped_data();
  if (dims->has_norm) fusion.norm_weight = norm_weight.untyped_data();
  fusion.swiglu = dims->swiglu;
  fusion.norm_eps = norm_eps;
  fusion.norm_size = norm_size;
  std::string why = marlin::matmul(
      x.untyped_data(), qweight.untyped_data(), scales.untyped_data(),
      dims->has_zeros ? zeros.untyped_data() : nullptr,
      dims->has_perm ? perm.typed_data() : nullptr,
      dims->has_bias ? bias.untyped_data() : nullptr, y->untyped_data(), dims->m, dims->n,
      dims->k, group_size, dims->bf16, counters ? counters : workspace->typed_data(),
      reduce_scratch->typed_data(), stream, counters != nullptr, fusion);
  if (!why.empty()) return ffi::Error::Internal(why);
  return ffi::Error::Success();
}

// MatmulCuda's arguments: XLA's stream and the call site's counters, then
// the operands, results and attributes every platform's handler takes.
auto bind_matmul_cuda() {
  return bind_matmul(ffi::Ffi::Bind()
                         .Ctx<ffi::PlatformStream<cudaStream_t>>()
                         .Ctx<ffi::State<ZeroedCounters>>());
}

}  // namespace
}  // namespace jax_marlin

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMarlinMatmulCudaInstantiate, jax_marlin::InstantiateCuda,
                              xla::ffi::Ffi::BindInstantiate());

// The handler only enqueues kernel launches (and, should its counters be
// missing, a memset) on the given stream; the one allocation, its call
// site's counters at the first execution, stays outside any capture, so XLA
// may capture the handler into a CUDA graph.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMarlinMatmulCuda, jax_marlin::MatmulCuda,
                              jax_marlin::bind_matmul_cuda(),
                              {xla::ffi::Traits::kCmdBufferCompatible});

// The same handler without the command-buffer trait: XLA then leaves the
// call out of its command buffers and runs it on the stream, between them
// (jax_marlin_matmul_stream; jax_marlin/_ffi.py says when it is used).
// Inside a command buffer XLA records each FFI call as a child graph of its
// own, with full dependencies on its neighbours, so a kernel's programmatic
// dependent launch has no predecessor to overlap with; on the stream two
// adjacent calls' kernels keep the programmatic edge.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMarlinMatmulCudaStream, jax_marlin::MatmulCuda,
                              jax_marlin::bind_matmul_cuda());
