// One (element type, group size) slice of the Marlin kernels: the 16
// instantiations of launch_tile (4 tiles x thread_m_blocks 1..4). CMake
// compiles this file once per MARLIN_SCALAR (half, nv_bfloat16) and
// MARLIN_GROUP_BLOCKS (-1, 2, 4, 8), so the slices build in parallel.
#include "marlin_kernel.cuh"

#if !defined(MARLIN_SCALAR) || !defined(MARLIN_GROUP_BLOCKS)
#error "compile with -DMARLIN_SCALAR=half|nv_bfloat16 -DMARLIN_GROUP_BLOCKS=-1|2|4|8"
#endif

namespace marlin {
template std::string launch_tile<MARLIN_SCALAR, MARLIN_GROUP_BLOCKS>(const ThreadConfig &, int,
                                                                     const LaunchArgs &);
}  // namespace marlin
