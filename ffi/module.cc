// nanobind module of jax_marlin, built twice: as _marlin_cpu (always) and as
// _marlin_cuda (when CUDA is available). It exports the FFI handler capsules
// (jax_marlin/_ffi.py registers them), the XLA FFI API version they were
// built with, and the kernel's rules from marlin_problem.h, which the Python
// side checks at trace time.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <cstdint>
#include <string>
#include <tuple>

#include "marlin_problem.h"
#include "scratch_sizes.h"
#include "xla/ffi/api/api.h"

namespace nb = nanobind;

#ifdef JAX_MARLIN_CUDA_MODULE
#include "zeroed_counters.h"
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMarlinMatmulCudaInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMarlinMatmulCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMarlinMatmulCudaStream);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMarlinPostAttentionCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxMarlinPostAttentionCudaStream);
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
#ifdef JAX_MARLIN_CUDA_MODULE
    // Two stages: instantiation makes the call site's ZeroedCounters.
    auto stages = [](void *execute) {
      nb::dict d;
      d["instantiate"] = nb::capsule(reinterpret_cast<void *>(JaxMarlinMatmulCudaInstantiate));
      d["execute"] = nb::capsule(execute);
      return d;
    };
    targets["jax_marlin_matmul"] = stages(reinterpret_cast<void *>(JAX_MARLIN_MATMUL));
    // The same handler, kept out of XLA's command buffers.
    targets["jax_marlin_matmul_stream"] =
        stages(reinterpret_cast<void *>(JaxMarlinMatmulCudaStream));
    // o, gate_up and down of a decoder block in one call (post_attention.cc),
    // with the same per-call-site counters.
    targets["jax_marlin_post_attention"] =
        stages(reinterpret_cast<void *>(JaxMarlinPostAttentionCuda));
    targets["jax_marlin_post_attention_stream"] =
        stages(reinterpret_cast<void *>(JaxMarlinPostAttentionCudaStream));
#else
    targets["jax_marlin_matmul"] = nb::capsule(reinterpret_cast<void *>(JAX_MARLIN_MATMUL));
#endif
    return targets;
  });
  m.def("types", []() {
    // The FFI state types the handlers use, registered before them.
    nb::dict types;
#ifdef JAX_MARLIN_CUDA_MODULE
    static constexpr XLA_FFI_TypeInfo zeroed_counters_info =
        xla::ffi::MakeTypeInfo<jax_marlin::ZeroedCounters>();
    nb::dict zeroed_counters;
    zeroed_counters["type_id"] = nb::capsule(&jax_marlin::ZeroedCounters::id);
    zeroed_counters["type_info"] =
        nb::capsule(const_cast<XLA_FFI_TypeInfo *>(&zeroed_counters_info));
    types["jax_marlin_zeroed_counters"] = zeroed_counters;
#endif
    return types;
  });
  m.def("ffi_api_version", []() { return std::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR); },
        "(major, minor) of the XLA FFI headers the handlers were built with.");

  m.attr("TILE") = marlin::kTile;
  m.attr("MIN_THREAD_K") = marlin::kMinThreadK;
  m.attr("MIN_THREAD_N") = marlin::kMinThreadN;
  m.attr("DECODE_MAX_M") = marlin::kDecodeMaxM;
  nb::list group_sizes;
  for (int g : marlin::kGroupSizes) group_sizes.append(g);
  m.attr("GROUP_SIZES") = nb::tuple(group_sizes);
  nb::list tiles;
  for (const marlin::ThreadConfig &c : marlin::kTiles)
    tiles.append(nb::make_tuple(c.thread_k, c.thread_n, c.threads));
  m.attr("TILES") = nb::tuple(tiles);

  m.def(
      "choose_tile",
      [](int64_t m, int64_t n, int64_t k) -> nb::object {
        const marlin::ThreadConfig *c = marlin::choose_config(m, n, k);
        if (!c) return nb::none();
        return nb::make_tuple(c->thread_k, c->thread_n, c->threads);
      },
      nb::arg("m"), nb::arg("n"), nb::arg("k"),
      "(thread_k, thread_n, threads) of the tile the launcher runs [m, k] x [k, n] with, or None.");
  m.def("workspace_size", &marlin::workspace_size, nb::arg("m"), nb::arg("n"),
        "int32 counters a CUDA call needs for an [m, n] output.");
  m.def("chained_size", &marlin::chained_size, nb::arg("elements"),
        "A region of a chain call's workspace or scratch: elements rounded up to 32.");
  m.def("reduce_scratch_size", &marlin::reduce_scratch_size, nb::arg("m"), nb::arg("n"),
        nb::arg("k"), nb::arg("x_copy") = false,
        "float32 elements of the CUDA call's reduce_scratch: partial sums handed between thread "
        "blocks, and with x_copy (act-order, or an RMSNorm or SwiGLU prologue) the x the "
        "kernels multiply.");
  m.def(
      "check_group_size",
      [](int64_t g) { return marlin::is_group_size(g) ? std::string() : marlin::group_size_error(g); },
      nb::arg("group_size"), "'' if the kernel takes this group size, else why not.");
  m.def("check_layer", &marlin::check_layer, nb::arg("k"), nb::arg("n"), nb::arg("group_size"),
        "'' if the kernel runs a [k, n] weight as it is, else why not.");
  m.def("check_problem", &marlin::check_problem, nb::arg("m"), nb::arg("n"), nb::arg("k"),
        nb::arg("group_size"), "'' if the kernel runs [m, k] x [k, n], else why not.");
  m.def(
      "padded_shape",
      [](int64_t k, int64_t n, int64_t group_size) {
        marlin::PaddedShape p = marlin::padded_shape(k, n, group_size);
        return std::make_tuple(p.k, p.n, p.error);
      },
      nb::arg("k"), nb::arg("n"), nb::arg("group_size"),
      "(k_pad, n_pad, error): the smallest shape >= [k, n] the kernel runs; error '' if valid.");
}
