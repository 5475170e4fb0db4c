// For gpu_run.sh ab (fp16 g128 only): every (element type, group size) slice of the
// kernels except fp16 with group size 128, as stubs that refuse to launch, so
// that a variant build compiles one instance file instead of eight
// (kernel_bench times fp16 g128 only).
#include "marlin_launch.h"

namespace marlin {
#define MARLIN_STUB(scalar, group)                                                        \
  template <>                                                                             \
  std::string launch_tile<scalar, group>(const ThreadConfig &, int, const LaunchArgs &) { \
    return "jax_marlin: " #scalar " group_blocks " #group " is not built in this benchmark"; \
  }
MARLIN_STUB(half, -1)
MARLIN_STUB(half, 2)
MARLIN_STUB(half, 4)
MARLIN_STUB(nv_bfloat16, -1)
MARLIN_STUB(nv_bfloat16, 2)
MARLIN_STUB(nv_bfloat16, 4)
MARLIN_STUB(nv_bfloat16, 8)
}  // namespace marlin
