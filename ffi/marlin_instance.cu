// One (element type, group size, zero points) slice of the Marlin kernels:
// the 16 instantiations of launch_tile (4 tiles x thread_m_blocks 1..4).
// CMake compiles this file once per MARLIN_SCALAR (half, nv_bfloat16),
// MARLIN_GROUP_BLOCKS (-1, 2, 4, 8) and MARLIN_ZEROS (0: zero point 8, 1:
// per-group zero points), so the slices build in parallel.
#include "marlin_kernel.cuh"

#if !defined(MARLIN_SCALAR) || !defined(MARLIN_GROUP_BLOCKS) || !defined(MARLIN_ZEROS)
#error "compile with -DMARLIN_SCALAR=half|nv_bfloat16 -DMARLIN_GROUP_BLOCKS=-1|2|4|8 -DMARLIN_ZEROS=0|1"
#endif

namespace marlin {
template std::string launch_tile<MARLIN_SCALAR, MARLIN_GROUP_BLOCKS, bool(MARLIN_ZEROS)>(
    const ThreadConfig &, int, const LaunchArgs &);
}  // namespace marlin
