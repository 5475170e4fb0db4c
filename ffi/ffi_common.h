// What the CPU and CUDA handlers of `jax_marlin_matmul` share: the binding
// (one buffer contract for both platforms) and the run-time shape checks.
//
//   x         f16 [..., k]        activations; leading dims are folded into m
//   qweight   s32 [k / 16, 2 n]   4-bit weights in Marlin's packed layout
//   scales    f16 [g, n]          g = k / group_size, or 1 for group_size -1
//   -> y      f16 [..., n]
//   -> workspace s32 [workspace_size(n)]   lock counters (CUDA); unused on CPU
//   attrs: group_size (i64), poison_output (bool: fill y with NaN first, so
//          tests see any element the kernel fails to write)
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "marlin_problem.h"
#include "xla/ffi/api/ffi.h"

namespace jax_marlin {

namespace ffi = xla::ffi;

template <typename Binding>
auto bind_matmul(Binding binding) {
  return std::move(binding).template Arg<ffi::Buffer<ffi::F16>>()  // x
      .template Arg<ffi::Buffer<ffi::S32, 2>>()             // qweight
      .template Arg<ffi::Buffer<ffi::F16, 2>>()             // scales
      .template Ret<ffi::Buffer<ffi::F16>>()                // y
      .template Ret<ffi::Buffer<ffi::S32, 1>>()             // workspace
      .template Attr<int64_t>("group_size")
      .template Attr<bool>("poison_output");
}

struct MatmulDims {
  int64_t m, n, k;
};

// Re-checks at run time what jax_marlin/shapes.py checks at trace time, so a
// call that bypasses the Python API gets an error instead of a bad access.
inline ffi::ErrorOr<MatmulDims> check_matmul(const ffi::Buffer<ffi::F16> &x,
                                             const ffi::Buffer<ffi::S32, 2> &qweight,
                                             const ffi::Buffer<ffi::F16, 2> &scales,
                                             const ffi::Buffer<ffi::F16> &y,
                                             const ffi::Buffer<ffi::S32, 1> &workspace,
                                             int64_t group_size) {
  auto s = [](int64_t v) { return std::to_string(v); };
  auto invalid = [](std::string why) {
    return ffi::Unexpected(ffi::Error::InvalidArgument("jax_marlin_matmul: " + why));
  };
  auto xd = x.dimensions(), qd = qweight.dimensions(), sd = scales.dimensions(),
       yd = y.dimensions();
  if (xd.size() < 1) return invalid("x must have at least one dimension");
  const int64_t k = qd[0] * marlin::kTile, n = qd[1] / 2;
  if (qd[1] % 2 != 0) return invalid("qweight.shape[1] = " + s(qd[1]) + " must be even (2 n)");
  if (xd.back() != k)
    return invalid("x.shape[-1] = " + s(xd.back()) + " but qweight packs k = " + s(k));
  const int64_t m = k == 0 ? 0 : static_cast<int64_t>(x.element_count()) / k;
  if (std::string why = marlin::check_problem(m, n, k, group_size); !why.empty())
    return invalid(why);
  const int64_t groups = group_size == -1 ? 1 : k / group_size;
  if (sd[0] != groups || sd[1] != n)
    return invalid("scales has shape [" + s(sd[0]) + ", " + s(sd[1]) + "], expected [" +
                   s(groups) + ", " + s(n) + "]");
  bool y_ok = yd.size() == xd.size() && yd.back() == n;
  for (size_t i = 0; y_ok && i + 1 < xd.size(); ++i) y_ok = yd[i] == xd[i];
  if (!y_ok) return invalid("y must have x's leading dimensions and n = " + s(n) + " columns");
  if (static_cast<int64_t>(workspace.element_count()) < marlin::workspace_size(n))
    return invalid("workspace holds " + s(workspace.element_count()) + " int32, needs " +
                   s(marlin::workspace_size(n)));
  return MatmulDims{m, n, k};
}

}  // namespace jax_marlin
