// For gpu_run.sh ab (fp16 g128 only): every (element type, group size, zero
// points) slice of the kernels except symmetric fp16 with group size 128, as
// stubs that refuse to launch, so that a variant build compiles one instance
// file instead of sixteen (kernel_bench times symmetric fp16 g128 only).
#include "marlin_launch.h"

namespace marlin {
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
