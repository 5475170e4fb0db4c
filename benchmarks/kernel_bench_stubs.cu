// For gpu_run.sh ab (fp16 g128 only): every (element type, group size, zero
// points) slice of the kernels except symmetric fp16 with group size 128, as
// stubs that refuse to launch, so that a variant build compiles one instance
// file instead of sixteen (kernel_bench times symmetric fp16 g128 only). The
// launcher's Hopper kernels (decode_kernel.cu, prefill_sm90.cu) are stubs too:
// kernel_bench times the Marlin kernel and turns them off (its main).
#include "decode_kernel.h"
#include "marlin_launch.h"
#include "prefill_sm90.h"

namespace marlin {
DecodeConfig choose_decode_config(int64_t, int64_t, int64_t, int64_t, int) { return {}; }
bool decode_gathers(const DecodeConfig &, int64_t, int64_t, int64_t) { return false; }
std::string decode_matmul(const void *, const void *, const void *, const void *, const int *,
                          const void *, void *, int64_t, int64_t, int64_t, int64_t, bool,
                          const DecodeConfig &, bool, cudaStream_t, const Fusion &) {
  return "jax_marlin: the decode kernel is not built in this benchmark";
}
std::string prefill_matmul(const void *, const void *, const void *, const void *, const void *,
                           void *, int64_t, int64_t, int64_t, int64_t, bool, int *, float *,
                           cudaStream_t, bool, bool) {
  return "jax_marlin: the prefill kernel is not built in this benchmark";
}

#define MARLIN_STUB_ZEROS(scalar, group, zeros)                                           \
  template <>                                                                             \
  std::string launch_tile<scalar, group, zeros>(const ThreadConfig &, int,                \
                                                const LaunchArgs &) {                     \
    return "jax_marlin: " #scalar " group_blocks " #group " zeros " #zeros                \
           " is not built in this benchmark";                                             \
  }
#define MARLIN_STUB(scalar, group) \
  MARLIN_STUB_ZEROS(scalar, group, false) MARLIN_STUB_ZEROS(scalar, group, true)
MARLIN_STUB(half, -1)
MARLIN_STUB(half, 2)
MARLIN_STUB(half, 4)
MARLIN_STUB_ZEROS(half, 8, true)
MARLIN_STUB(nv_bfloat16, -1)
MARLIN_STUB(nv_bfloat16, 2)
MARLIN_STUB(nv_bfloat16, 4)
MARLIN_STUB(nv_bfloat16, 8)
}  // namespace marlin
