// nanobind module exporting the FFI handler capsules; jax_marlin/_ffi.py
// registers them with jax.ffi.register_ffi_target. Built twice: as
// _marlin_cpu (always) and as _marlin_cuda (when CUDA is available).
#include <nanobind/nanobind.h>

#include "xla/ffi/api/api.h"

namespace nb = nanobind;

#ifdef JAX_MARLIN_CUDA_MODULE
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMarlinMatmulCuda);
#define JAX_MARLIN_MODULE _marlin_cuda
#define JAX_MARLIN_MATMUL JaxMarlinMatmulCuda
#else
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMarlinMatmulCpu);
#define JAX_MARLIN_MODULE _marlin_cpu
#define JAX_MARLIN_MATMUL JaxMarlinMatmulCpu
#endif

NB_MODULE(JAX_MARLIN_MODULE, m) {
  m.def("registrations", []() {
    nb::dict targets;
    targets["jax_marlin_matmul"] = nb::capsule(reinterpret_cast<void *>(JAX_MARLIN_MATMUL));
    return targets;
  });
}
