// XLA FFI handler for jax_marlin_matmul on CUDA: read the buffers, re-check
// them, launch the Marlin kernel on XLA's stream.
#include <cuda_runtime_api.h>

#include "ffi_common.h"
#include "marlin_kernel.h"

namespace jax_marlin {
namespace {

ffi::Error MatmulCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32, 2> qweight,
                      ffi::AnyBuffer scales, ffi::Buffer<ffi::S32, 2> zeros,
                      ffi::Buffer<ffi::S32, 1> perm, ffi::AnyBuffer bias,
                      ffi::Result<ffi::AnyBuffer> y,
                      ffi::ResultBuffer<ffi::S32, 1> workspace,
                      ffi::ResultBuffer<ffi::F32, 1> reduce_scratch, int64_t group_size,
                      bool poison_output) {
  auto dims = check_matmul(x, qweight, scales, zeros, perm, bias, *y, *workspace,
                           *reduce_scratch, group_size);
  if (dims.has_error()) return dims.error();
  if (poison_output) {
    // 0xFFFF is a NaN in fp16 and in bf16.
    if (cudaError_t error = cudaMemsetAsync(y->untyped_data(), 0xFF, y->size_bytes(), stream))
      return ffi::Error::Internal(std::string("jax_marlin: cudaMemsetAsync failed: ") +
                                  cudaGetErrorString(error));
  }
  std::string why = marlin::matmul(
      x.untyped_data(), qweight.untyped_data(), scales.untyped_data(),
      dims->has_zeros ? zeros.untyped_data() : nullptr,
      dims->has_perm ? perm.typed_data() : nullptr,
      dims->has_bias ? bias.untyped_data() : nullptr, y->untyped_data(), dims->m, dims->n,
      dims->k, group_size, dims->bf16, workspace->typed_data(), reduce_scratch->typed_data(),
      stream);
  if (!why.empty()) return ffi::Error::Internal(why);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_marlin

// The handler only enqueues a memset and kernel launches on the given stream
// and allocates nothing, so XLA may capture it into a CUDA graph.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxMarlinMatmulCuda, jax_marlin::MatmulCuda,
    jax_marlin::bind_matmul(
        xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
