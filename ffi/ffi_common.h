// What the CPU and CUDA handlers of `jax_marlin_matmul` share: the binding
// (one buffer contract for both platforms) and the run-time shape checks.
//
//   x         f16|bf16 [..., k]     activations; leading dims are folded into m
//                                   ([..., 2 k] with swiglu: gate | up)
//   qweight   s32 [k / 16, 2 n]     4-bit weights in Marlin's packed layout
//   scales    f16|bf16 [g, n]       g = k / group_size, or 1 for group_size -1
//   zeros     s32 [g, n / 8] or [0, 0]   4-bit zero points, 8 a word in the
//                                   kernels' order (jax_marlin/packing.py);
//                                   [0, 0]: zero point 8 (symmetric)
//   perm      s32 [k] or [0]        act-order: the kernels multiply x[..., perm]
//                                   (the weight's rows are stored in that
//                                   order); [0]: x as it is
//   bias      f16|bf16 [n] or [0]   added to y in the epilogue; [0]: no bias
//   residual  f16|bf16 [..., n] (y's shape) or [0]   added to the rounded
//                                   product: y = dtype(dtype(x' W + bias) +
//                                   residual), as `jm.matmul(...) + residual`
//   norm_weight f16|bf16 [k] or [0] RMSNorm prologue: x' = dtype(x r norm_weight),
//                                   r = rsqrt(sum_j x_j^2 / norm_size + norm_eps)
//                                   per row, in fp32
//   -> y      f16|bf16 [..., n]
//   -> workspace       s32 [>= workspace_size(m, n)]      lock counters (CUDA;
//                      used only if the call site's own zeroed counters,
//                      zeroed_counters.h, cannot be allocated)
//   -> reduce_scratch  f32 [>= reduce_scratch_size(m, n, k, act_order)] fp32
//                      partial sums handed between thread blocks, and with a
//                      perm or a prologue the kernels' x' (CUDA)
//   attrs: group_size (i64), poison_output (bool: fill y with NaN first, so
//          tests see any element the kernel fails to write), norm_eps (f32)
//          and norm_size (i64, the logical k the mean divides by: x's padded
//          columns are zero) of the RMSNorm prologue, swiglu (bool): the
//          SwiGLU prologue, x = [gate | up] of 2 k columns a row and
//          x' = dtype(silu(gate) up), in fp32 (not with norm_weight)
//
// The prologue's x' is x itself without norm_weight or swiglu; with a perm
// the kernels multiply x'[..., perm] (the prologue runs in x's own column
// order).
//
// x, scales, bias and y share one dtype, float16 or bfloat16. The CPU handler
// ignores workspace and reduce_scratch; they are results (not FFI scratch) so
// that XLA allocates them once per call site and the CUDA call stays
// capturable into a CUDA graph.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "marlin_problem.h"
#include "scratch_sizes.h"
#include "xla/ffi/api/ffi.h"

namespace jax_marlin {

namespace ffi = xla::ffi;

template <typename Binding>
auto bind_matmul(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // x
      .template Arg<ffi::Buffer<ffi::S32, 2>>()              // qweight
      .template Arg<ffi::AnyBuffer>()                        // scales
      .template Arg<ffi::Buffer<ffi::S32, 2>>()              // zeros
      .template Arg<ffi::Buffer<ffi::S32, 1>>()              // perm
      .template Arg<ffi::AnyBuffer>()                        // bias
      .template Arg<ffi::AnyBuffer>()                        // residual
      .template Arg<ffi::AnyBuffer>()                        // norm_weight
      .template Ret<ffi::AnyBuffer>()                        // y
      .template Ret<ffi::Buffer<ffi::S32, 1>>()              // workspace
      .template Ret<ffi::Buffer<ffi::F32, 1>>()              // reduce_scratch
      .template Attr<int64_t>("group_size")
      .template Attr<bool>("poison_output")
      .template Attr<float>("norm_eps")
      .template Attr<int64_t>("norm_size")
      .template Attr<bool>("swiglu");
}

struct MatmulDims {
  int64_t m, n, k;
  bool bf16;      // element type of x, scales, bias and y
  bool has_zeros;  // zeros has [g, n / 8] elements (otherwise zero point 8)
  bool has_bias;   // bias has n elements (otherwise none)
  bool has_perm;   // perm has k elements (otherwise x is used as it is)
  bool has_residual;  // residual has y's shape (otherwise none)
  bool has_norm;      // norm_weight has k elements: the RMSNorm prologue
  bool swiglu;        // x is [gate | up], 2 k columns a row: the SwiGLU prologue
  // Whether the kernels multiply a copy of x (its prologue, permuted).
  bool x_copy() const { return has_perm || has_norm || swiglu; }
};

// A weight's sizes, read from its packed buffers.
struct WeightDims {
  int64_t k, n;
  bool has_zeros;  // zeros has [g, n / 8] elements (otherwise zero point 8)
};

// "<target>: <why>" as an invalid-argument error (an ErrorOr holds it too).
inline ffi::Error invalid_argument(const char *target, const std::string &why) {
  return ffi::Error::InvalidArgument(std::string(target) + ": " + why);
}

// A packed weight (qweight, scales in `dtype`, zeros) and its group size: the
// shapes must agree with each other and with the kernels' rules for a
// product of m rows (marlin::check_problem). `name` prefixes the messages
// ("" for jax_marlin_matmul's one weight, "gate_up: " for a chain's).
inline ffi::ErrorOr<WeightDims> check_weight(const char *target, const std::string &name,
                                             const ffi::Buffer<ffi::S32, 2> &qweight,
                                             const ffi::AnyBuffer &scales,
                                             const ffi::Buffer<ffi::S32, 2> &zeros,
                                             ffi::DataType dtype, int64_t m,
                                             int64_t group_size) {
  auto s = [](int64_t v) { return std::to_string(v); };
  auto qd = qweight.dimensions(), sd = scales.dimensions();
  if (scales.element_type() != dtype)
    return invalid_argument(target, name + "scales must have x's dtype");
  if (qd[1] % 2 != 0)
    return invalid_argument(target, name + "qweight.shape[1] = " + s(qd[1]) + " must be even (2 n)");
  const int64_t k = qd[0] * marlin::kTile, n = qd[1] / 2;
  if (std::string why = marlin::check_problem(m, n, k, group_size); !why.empty())
    return invalid_argument(target, name + why);
  const int64_t groups = group_size == -1 ? 1 : k / group_size;
  if (sd.size() != 2 || sd[0] != groups || sd[1] != n)
    return invalid_argument(target, name + "scales must have shape [" + s(groups) + ", " + s(n) + "]");
  auto zd = zeros.dimensions();
  const bool has_zeros = zd[0] != 0 || zd[1] != 0;
  if (has_zeros && (zd[0] != groups || zd[1] != n / 8))
    return invalid_argument(target, name + "zeros must have shape [" + s(groups) + ", " +
                                        s(n / 8) + "] or [0, 0] (zero point 8)");
  return WeightDims{k, n, has_zeros};
}

// Re-checks at run time what jax_marlin/shapes.py checks at trace time, so a
// call that bypasses the Python API gets an error instead of a bad access.
inline ffi::ErrorOr<MatmulDims> check_matmul(const ffi::AnyBuffer &x,
                                             const ffi::Buffer<ffi::S32, 2> &qweight,
                                             const ffi::AnyBuffer &scales,
                                             const ffi::Buffer<ffi::S32, 2> &zeros,
                                             const ffi::Buffer<ffi::S32, 1> &perm,
                                             const ffi::AnyBuffer &bias,
                                             const ffi::AnyBuffer &residual,
                                             const ffi::AnyBuffer &norm_weight,
                                             const ffi::AnyBuffer &y,
                                             const ffi::Buffer<ffi::S32, 1> &workspace,
                                             const ffi::Buffer<ffi::F32, 1> &reduce_scratch,
                                             int64_t group_size, float norm_eps,
                                             int64_t norm_size, bool swiglu) {
  auto s = [](int64_t v) { return std::to_string(v); };
  auto invalid = [](std::string why) { return invalid_argument("jax_marlin_matmul", why); };
  const ffi::DataType dtype = x.element_type();
  if (dtype != ffi::DataType::F16 && dtype != ffi::DataType::BF16)
    return invalid("x must be float16 or bfloat16");
  if (scales.element_type() != dtype || bias.element_type() != dtype ||
      residual.element_type() != dtype || norm_weight.element_type() != dtype ||
      y.element_type() != dtype)
    return invalid("x, scales, bias, residual, norm_weight and y must have one dtype");
  auto xd = x.dimensions(), qd = qweight.dimensions(), bd = bias.dimensions(),
       yd = y.dimensions();
  if (xd.size() < 1) return invalid("x must have at least one dimension");
  const int64_t k = qd[0] * marlin::kTile;
  const int64_t x_cols = swiglu ? 2 * k : k;
  if (xd.back() != x_cols)
    return invalid("x.shape[-1] = " + s(xd.back()) + " but qweight packs k = " + s(k) +
                   (swiglu ? " (with swiglu x holds gate | up, 2 k = " + s(x_cols) + ")" : ""));
  const int64_t m = k == 0 ? 0 : static_cast<int64_t>(x.element_count()) / x_cols;
  auto weight = check_weight("jax_marlin_matmul", "", qweight, scales, zeros, dtype, m, group_size);
  if (weight.has_error()) return weight.error();
  const int64_t n = weight->n;
  const bool has_zeros = weight->has_zeros;
  const int64_t perm_size = perm.dimensions()[0];
  if (perm_size != k && perm_size != 0)
    return invalid("perm must have shape [" + s(k) + "] or [0] (no act-order)");
  const bool has_perm = perm_size == k && k != 0;
  if (bd.size() != 1 || (bd[0] != n && bd[0] != 0))
    return invalid("bias must have shape [" + s(n) + "] or [0] (no bias)");
  bool y_ok = yd.size() == xd.size() && yd.back() == n;
  for (size_t i = 0; y_ok && i + 1 < xd.size(); ++i) y_ok = yd[i] == xd[i];
  if (!y_ok) return invalid("y must have x's leading dimensions and n = " + s(n) + " columns");
  // residual: y's shape or [0]; norm_weight: [k] or [0].
  auto same = [](ffi::Span<const int64_t> a, ffi::Span<const int64_t> b) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i)
      if (a[i] != b[i]) return false;
    return true;
  };
  auto empty = [](ffi::Span<const int64_t> d) { return d.size() == 1 && d[0] == 0; };
  auto rd = residual.dimensions(), nd = norm_weight.dimensions();
  const bool has_residual = !empty(rd);
  if (has_residual && !same(rd, yd)) return invalid("residual must have y's shape or [0] (none)");
  const bool has_norm = !empty(nd);
  if (has_norm && !(nd.size() == 1 && nd[0] == k))
    return invalid("norm_weight must have shape [" + s(k) + "] or [0] (no RMSNorm)");
  if (has_norm && swiglu) return invalid("norm_weight and swiglu cannot both be given");
  if (has_norm && (norm_size < 1 || norm_size > k))
    return invalid("norm_size = " + s(norm_size) + " must be in [1, k = " + s(k) + "]");
  if (has_norm && !(norm_eps >= 0.f))
    return invalid("norm_eps must be a non-negative number");
  if (static_cast<int64_t>(workspace.element_count()) < marlin::workspace_size(m, n))
    return invalid("workspace holds " + s(workspace.element_count()) + " int32, needs " +
                   s(marlin::workspace_size(m, n)));
  const bool x_copy = has_perm || has_norm || swiglu;
  const int64_t scratch = marlin::reduce_scratch_size(m, n, k, x_copy);
  if (static_cast<int64_t>(reduce_scratch.element_count()) < scratch)
    return invalid("reduce_scratch holds " + s(reduce_scratch.element_count()) +
                   " float32, needs " + s(scratch));
  return MatmulDims{m,        n,           k,        dtype == ffi::DataType::BF16,
                    has_zeros, bd[0] == n, has_perm, has_residual,
                    has_norm,  swiglu};
}

}  // namespace jax_marlin
