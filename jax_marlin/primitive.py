"""The ``marlin_matmul`` primitive: abstract evaluation and lowering only.

``y [..., n] = x' [..., k] @ W + bias`` (plus a residual) on the padded
(physical) weight shape the kernel sees, ``x'`` being ``x`` or its RMSNorm or
SwiGLU prologue. Binding it directly is internal: ``jm.matmul``
(``jax_marlin.ops``) checks the user's arguments, pads them and wires
autodiff, ``vmap`` and sharding around it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_marlin import _ffi, fusion, shapes
from jax_marlin._compat import Primitive, ShapedArray, mlir

__all__ = ["marlin_matmul_p"]

marlin_matmul_p = Primitive("marlin_matmul")
"""Operands ``(x [..., k] ([..., 2 k], [gate | up], with swiglu), qweight [k //
16, 2 n] int32, scales, zeros [groups, n // 8] int32 or [0, 0] (zero point 8),
perm [k] int32 or [0] (act-order: the kernel multiplies ``x'[..., perm]``),
bias [n] or [0], residual [..., n] or [0], norm_weight [k] or [0])`` on the
padded shape; params ``k``, ``n`` (the padded sizes), ``group_size``,
``poison_output`` (tests only: fill ``y`` with NaN before the kernel runs, so
an element it fails to write shows), ``norm_eps`` and ``norm_size`` (the
logical k) of the RMSNorm prologue, and ``swiglu``. Result ``y [..., n]`` in
``x``'s dtype: ``dtype(dtype(x' W + bias) + residual)`` (ffi/ffi_common.h
states the contract)."""

_PARAMS = ("k", "n", "group_size", "poison_output", "norm_eps", "norm_size", "swiglu")


def _abstract_eval(x, qweight, scales, zeros, perm, bias, residual, norm_weight, *, k, n,
                   group_size, poison_output, norm_eps, norm_size, swiglu):
    del poison_output
    shapes.check_operands(x.shape, x.dtype, qweight.shape, qweight.dtype, scales.shape,
                          scales.dtype, zeros.shape, zeros.dtype, perm.shape, perm.dtype,
                          bias.shape, bias.dtype, k=k, n=n, group_size=group_size,
                          residual_shape=residual.shape, residual_dtype=residual.dtype,
                          norm_weight_shape=norm_weight.shape,
                          norm_weight_dtype=norm_weight.dtype, swiglu=swiglu,
                          norm_eps=norm_eps, norm_size=norm_size)
    return ShapedArray(x.shape[:-1] + (n,), x.dtype)


@functools.partial(jax.jit, static_argnames=_PARAMS)
def _impl(*operands, **params):
    # Eager binds run the primitive through jit, which lowers it.
    return marlin_matmul_p.bind(*operands, **params)


def _lowering(ctx, x, qweight, scales, zeros, perm, bias, residual, norm_weight, *, k, n,
              group_size, poison_output, norm_eps, norm_size, swiglu, target=_ffi.MATMUL_TARGET):
    # The kernel's fp32 reduction buffer and a lock-counter buffer are extra
    # results that XLA allocates, dropped here: a fixed buffer per call site,
    # which keeps the call capturable into a CUDA graph. (The CUDA handler
    # uses its call site's own counters, zeroed once, and the workspace only
    # if those cannot be had: ffi/zeroed_counters.h.) They stay out of the
    # primitive's abstract value, so batching and partitioning rules deal
    # with y alone.
    m = int(np.prod(ctx.avals_in[0].shape[:-1], dtype=np.int64))
    workspace = ShapedArray((shapes.workspace_size(m, n),), jnp.int32)
    # With act-order or a prologue the CUDA kernels multiply a copy of x (x'
    # permuted), written into the scratch.
    x_copy = ctx.avals_in[4].shape[0] > 0 or ctx.avals_in[7].shape[0] > 0 or swiglu
    scratch = ShapedArray((shapes.reduce_scratch_size(m, n, k, x_copy),), jnp.float32)
    rule = jax.ffi.ffi_lowering(target)
    y, _, _ = rule(ctx.replace(avals_out=[*ctx.avals_out, workspace, scratch]), x, qweight,
                   scales, zeros, perm, bias, residual, norm_weight, group_size=group_size,
                   poison_output=bool(poison_output), norm_eps=np.float32(norm_eps),
                   norm_size=int(norm_size), swiglu=bool(swiglu))
    return [y]


# The largest m at which the decode kernel runs jm.matmul's fusions (_cuda_lowering).
FUSED_MAX_M = 8


def _composed(x, qweight, scales, zeros, perm, bias, residual, norm_weight, *, norm_eps,
              norm_size, swiglu, **params):
    """The fused call as ``jax.numpy`` ops around the plain one (``jax_marlin.fusion``)."""
    x = fusion.prologue(x, norm_weight if norm_weight.shape[0] else None, norm_eps, norm_size,
                        use_swiglu=swiglu)
    none = jnp.zeros((0,), x.dtype)
    y = marlin_matmul_p.bind(x, qweight, scales, zeros, perm, bias, none, none, norm_eps=0.0,
                             norm_size=0, swiglu=False, **params)
    return fusion.add_residual(y, residual) if residual.shape[0] else y


def _cuda_lowering(ctx, x, qweight, scales, zeros, perm, bias, residual, norm_weight, **params):
    if not _ffi.HAS_CUDA:
        raise RuntimeError(
            "jax_marlin was built without CUDA support, so jm.matmul cannot run on a GPU. "
            "Reinstall with nvcc on PATH and JAX_MARLIN_CUDA=ON (README.md, 'Building')."
        )
    operands = (x, qweight, scales, zeros, perm, bias, residual, norm_weight)
    m = int(np.prod(ctx.avals_in[0].shape[:-1], dtype=np.int64))
    prologue = ctx.avals_in[7].shape[0] > 0 or params["swiglu"]
    fused = prologue or ctx.avals_in[6].shape[0] > 0
    # The decode kernel (m <= FUSED_MAX_M, x in its own order) runs the
    # fusions as it loads x and stores y. Around the other kernels the CUDA
    # handler would run them as passes of their own (a kernel before, one
    # after); written as jnp ops here instead, XLA fuses them into the
    # elementwise kernels next to the call. Measured on a Llama-3-8B decode
    # step (H100, benchmarks/bench_decode_step.py): at m = 64 4.30 ms with
    # the jnp ops against 4.53 unfused, where the passes had taken 5.29
    # against 4.55 (an earlier run of the same step). At m = 9..16 the fused
    # calls go to jnp ops too: there the decode kernel's RMSNorm prologue
    # cost 3.3-3.8 us per call more than the plain call (H100, block_bench
    # --layers) and the fused step was the slower one (2.81 against 2.67 ms
    # pipelined on an H100; 2.68 against 2.62 on an H200), and the Marlin
    # kernel takes m > 8 with k > 4096 anyway (choose_decode_config in
    # ffi/decode_kernel.cu).
    if fused and (m > FUSED_MAX_M or (prologue and ctx.avals_in[4].shape[0] > 0)):
        return mlir.lower_fun(_composed, multiple_results=False)(ctx, *operands, **params)
    return _lowering(ctx, *operands, **params, target=_ffi.cuda_target())


marlin_matmul_p.def_impl(_impl)
marlin_matmul_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(marlin_matmul_p, _lowering, platform="cpu")
mlir.register_lowering(marlin_matmul_p, _cuda_lowering, platform="cuda")
