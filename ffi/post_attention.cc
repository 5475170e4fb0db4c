// XLA FFI handler for jax_marlin_post_attention on CUDA: the three
// projections a pre-norm decoder block runs after attention, as one custom
// call:
//
//   h = x + o(a)                                  (residual epilogue)
//   g = gate_up(rms_norm(h))                      (RMSNorm prologue)
//   y = h + down(silu(g[:, :f]) g[:, f:])         (SwiGLU prologue, residual)
//
// each a marlin::matmul with its fusions, exactly as three jax_marlin_matmul
// calls would run them (so the result is bit-identical to them). Why one
// call: XLA records each FFI call into its command buffer as a child graph
// of its own, with full dependencies on its neighbours, so between two
// jax_marlin_matmul calls the decode kernel's programmatic dependent launch
// has no predecessor to overlap with. Inside one call the three launches are
// captured into one child graph and keep their programmatic edges; and since
// the only kernels before the second and third projections are this call's
// own, which write h, g and the scratch, never a weight, those two may load
// their first weights before waiting for the previous kernel (the early
// fill, Fusion::early_weights). Measured in the 8B decode step (H100,
// benchmarks/NOTES.md, 2026-12-07) it is no faster than the three calls at
// m = 1-2 and 2-8% slower at m = 4-8, where those edges cost more than they
// save, so jax_marlin/chain.py lowers to it only with JAX_MARLIN_CHAIN_CALL=1.
//
//   a            f16|bf16 [..., k_o]     attention's output
//   x            f16|bf16 [..., n_o]     the residual stream, a's leading dims
//   o_qweight, o_scales, o_zeros         the o projection [k_o, n_o]
//   gate_up_qweight, _scales, _zeros     [n_o, 2 f]: gate | up columns
//   down_qweight, _scales, _zeros        [f, n_o]
//   norm_weight  f16|bf16 [n_o]          the RMSNorm before gate_up
//   -> y         f16|bf16 [..., n_o]     x's shape
//   -> h, g      f16|bf16 [m n_o], [m 2 f]   the intermediates
//   -> workspace s32, scratch f32        each projection's region in turn
//                                        (chained_size of each, scratch_sizes.h)
//   attrs: o_group_size, gate_up_group_size, down_group_size (i64),
//          norm_eps (f32), poison_output (bool: y, h and g filled with NaN
//          first, so tests see any element not written)
//
// Weights carry no bias, perm or padding here: jax_marlin/chain.py lowers
// to this call only then, and to three jm.matmul calls otherwise.
#include <cuda_runtime_api.h>

#include <memory>

#include "ffi_common.h"
#include "marlin_kernel.h"
#include "zeroed_counters.h"

namespace jax_marlin {
namespace {

constexpr char kTarget[] = "jax_marlin_post_attention";

struct Projection {
  const ffi::Buffer<ffi::S32, 2> &qweight;
  const ffi::AnyBuffer &scales;
  const ffi::Buffer<ffi::S32, 2> &zeros;
  int64_t group_size;
};

ffi::Error PostAttentionCuda(cudaStream_t stream, ZeroedCounters *zeroed, ffi::AnyBuffer a,
                             ffi::AnyBuffer x, ffi::Buffer<ffi::S32, 2> o_qweight,
                             ffi::AnyBuffer o_scales, ffi::Buffer<ffi::S32, 2> o_zeros,
                             ffi::Buffer<ffi::S32, 2> gate_up_qweight,
                             ffi::AnyBuffer gate_up_scales,
                             ffi::Buffer<ffi::S32, 2> gate_up_zeros,
                             ffi::Buffer<ffi::S32, 2> down_qweight, ffi::AnyBuffer down_scales,
                             ffi::Buffer<ffi::S32, 2> down_zeros, ffi::AnyBuffer norm_weight,
                             ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> h,
                             ffi::Result<ffi::AnyBuffer> g,
                             ffi::ResultBuffer<ffi::S32, 1> workspace,
                             ffi::ResultBuffer<ffi::F32, 1> scratch, int64_t o_group_size,
                             int64_t gate_up_group_size, int64_t down_group_size,
                             float norm_eps, bool poison_output) {
  auto s = [](int64_t v) { return std::to_string(v); };
  auto invalid = [](const std::string &why) { return invalid_argument(kTarget, why); };
  const ffi::DataType dtype = a.element_type();
  if (dtype != ffi::DataType::F16 && dtype != ffi::DataType::BF16)
    return invalid("a must be float16 or bfloat16");
  for (const ffi::AnyBuffer *b : {&x, &norm_weight})
    if (b->element_type() != dtype) return invalid("a, x and norm_weight must have one dtype");
  for (const ffi::AnyBuffer *b : {&*y, &*h, &*g})
    if (b->element_type() != dtype) return invalid("y, h and g must have a's dtype");
  auto ad = a.dimensions(), xd = x.dimensions(), yd = y->dimensions();
  if (ad.size() < 1 || xd.size() != ad.size())
    return invalid("a and x must have the same number of dimensions, at least one");
  for (size_t i = 0; i + 1 < ad.size(); ++i)
    if (ad[i] != xd[i]) return invalid("a and x must have the same leading dimensions");
  const int64_t k_o = o_qweight.dimensions()[0] * marlin::kTile;
  if (ad.back() != k_o)
    return invalid("a.shape[-1] = " + s(ad.back()) + " but o's qweight packs k = " + s(k_o));
  const int64_t m = k_o == 0 ? 0 : static_cast<int64_t>(a.element_count()) / k_o;

  auto o = check_weight(kTarget, "o: ", o_qweight, o_scales, o_zeros, dtype, m, o_group_size);
  if (o.has_error()) return o.error();
  auto gate_up = check_weight(kTarget, "gate_up: ", gate_up_qweight, gate_up_scales,
                              gate_up_zeros, dtype, m, gate_up_group_size);
  if (gate_up.has_error()) return gate_up.error();
  auto down = check_weight(kTarget, "down: ", down_qweight, down_scales, down_zeros, dtype, m,
                           down_group_size);
  if (down.has_error()) return down.error();
  const int64_t hidden = o->n, ffn = down->k;
  if (xd.back() != hidden)
    return invalid("x.shape[-1] = " + s(xd.back()) + " but o has n = " + s(hidden));
  if (yd.size() != xd.size()) return invalid("y must have x's shape");
  for (size_t i = 0; i < xd.size(); ++i)
    if (yd[i] != xd[i]) return invalid("y must have x's shape");
  if (gate_up->k != hidden || gate_up->n != 2 * ffn || down->n != hidden)
    return invalid("the weights do not chain: o [" + s(o->k) + ", " + s(hidden) + "], gate_up [" +
                   s(gate_up->k) + ", " + s(gate_up->n) + "], down [" + s(down->k) + ", " +
                   s(down->n) + "]; expected gate_up [n_o, 2 f] and down [f, n_o]");
  auto nd = norm_weight.dimensions();
  if (nd.size() != 1 || nd[0] != hidden)
    return invalid("norm_weight must have shape [" + s(hidden) + "]");
  if (!(norm_eps >= 0.f)) return invalid("norm_eps must be a non-negative number");
  if (static_cast<int64_t>(h->element_count()) != m * hidden ||
      static_cast<int64_t>(g->element_count()) != m * 2 * ffn)
    return invalid("h must hold m * " + s(hidden) + " and g m * " + s(2 * ffn) + " elements");

  // Each projection's regions of the workspace and the scratch, in turn.
  struct Stage {
    int64_t k, n;
    bool x_copy;
  };
  const Stage stages[3] = {{k_o, hidden, false}, {hidden, 2 * ffn, true}, {ffn, hidden, true}};
  int64_t counters_at[3], scratch_at[3], counters_size = 0, scratch_size = 0;
  for (int i = 0; i < 3; ++i) {
    counters_at[i] = counters_size;
    scratch_at[i] = scratch_size;
    counters_size += marlin::chained_size(marlin::workspace_size(m, stages[i].n));
    scratch_size += marlin::chained_size(
        marlin::reduce_scratch_size(m, stages[i].n, stages[i].k, stages[i].x_copy));
  }
  if (static_cast<int64_t>(workspace->element_count()) < counters_size)
    return invalid("workspace holds " + s(workspace->element_count()) + " int32, needs " +
                   s(counters_size));
  if (static_cast<int64_t>(scratch->element_count()) < scratch_size)
    return invalid("scratch holds " + s(scratch->element_count()) + " float32, needs " +
                   s(scratch_size));
  if (m == 0) return ffi::Error::Success();

  if (poison_output)  // 0xFFFF is a NaN in fp16 and in bf16.
    for (ffi::AnyBuffer *b : {&*y, &*h, &*g})
      if (cudaError_t error = cudaMemsetAsync(b->untyped_data(), 0xFF, b->size_bytes(), stream))
        return ffi::Error::Internal(marlin::cuda_error("cudaMemsetAsync", error));

  // The call site's own zeroed counters if they can be had (short of device
  // memory they always can), else the workspace result, zeroed by the
  // launcher before each projection that needs it.
  int *counters = nullptr;
  zeroed->get(counters_size, &counters);
  const bool zeroed_counters = counters != nullptr;
  if (!counters) counters = workspace->typed_data();
  const bool bf16 = dtype == ffi::DataType::BF16;

  auto project = [&](int i, const void *in, const Projection &w, bool has_zeros, void *out,
                     const marlin::Fusion &fusion) {
    return marlin::matmul(in, w.qweight.untyped_data(), w.scales.untyped_data(),
                          has_zeros ? w.zeros.untyped_data() : nullptr, nullptr, nullptr, out, m,
                          stages[i].n, stages[i].k, w.group_size, bf16,
                          counters + counters_at[i], scratch->typed_data() + scratch_at[i],
                          stream, zeroed_counters, fusion);
  };
  marlin::Fusion o_fusion;
  o_fusion.residual = x.untyped_data();
  marlin::Fusion gate_up_fusion;
  gate_up_fusion.norm_weight = norm_weight.untyped_data();
  gate_up_fusion.norm_eps = norm_eps;
  gate_up_fusion.norm_size = hidden;
  gate_up_fusion.early_weights = true;  // after o's kernel, which writes h
  marlin::Fusion down_fusion;
  down_fusion.swiglu = true;
  down_fusion.residual = h->untyped_data();
  down_fusion.early_weights = true;  // after gate_up's, which writes g
  std::string why = project(0, a.untyped_data(), {o_qweight, o_scales, o_zeros, o_group_size},
                            o->has_zeros, h->untyped_data(), o_fusion);
  if (why.empty())
    why = project(1, h->untyped_data(),
                  {gate_up_qweight, gate_up_scales, gate_up_zeros, gate_up_group_size},
                  gate_up->has_zeros, g->untyped_data(), gate_up_fusion);
  if (why.empty())
    why = project(2, g->untyped_data(), {down_qweight, down_scales, down_zeros, down_group_size},
                  down->has_zeros, y->untyped_data(), down_fusion);
  if (!why.empty()) return ffi::Error::Internal(why);
  return ffi::Error::Success();
}

auto bind_post_attention() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::State<ZeroedCounters>>()
      .Arg<ffi::AnyBuffer>()                // a
      .Arg<ffi::AnyBuffer>()                // x
      .Arg<ffi::Buffer<ffi::S32, 2>>()      // o_qweight
      .Arg<ffi::AnyBuffer>()                // o_scales
      .Arg<ffi::Buffer<ffi::S32, 2>>()      // o_zeros
      .Arg<ffi::Buffer<ffi::S32, 2>>()      // gate_up_qweight
      .Arg<ffi::AnyBuffer>()                // gate_up_scales
      .Arg<ffi::Buffer<ffi::S32, 2>>()      // gate_up_zeros
      .Arg<ffi::Buffer<ffi::S32, 2>>()      // down_qweight
      .Arg<ffi::AnyBuffer>()                // down_scales
      .Arg<ffi::Buffer<ffi::S32, 2>>()      // down_zeros
      .Arg<ffi::AnyBuffer>()                // norm_weight
      .Ret<ffi::AnyBuffer>()                // y
      .Ret<ffi::AnyBuffer>()                // h
      .Ret<ffi::AnyBuffer>()                // g
      .Ret<ffi::Buffer<ffi::S32, 1>>()      // workspace
      .Ret<ffi::Buffer<ffi::F32, 1>>()      // scratch
      .Attr<int64_t>("o_group_size")
      .Attr<int64_t>("gate_up_group_size")
      .Attr<int64_t>("down_group_size")
      .Attr<float>("norm_eps")
      .Attr<bool>("poison_output");
}

}  // namespace
}  // namespace jax_marlin

// Like jax_marlin_matmul: two stages (the call site's counters made at
// instantiation, by JaxMarlinMatmulCudaInstantiate), and a variant without
// the command-buffer trait for JAX_MARLIN_COMMAND_BUFFER=0.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMarlinPostAttentionCuda, jax_marlin::PostAttentionCuda,
                              jax_marlin::bind_post_attention(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMarlinPostAttentionCudaStream, jax_marlin::PostAttentionCuda,
                              jax_marlin::bind_post_attention());
