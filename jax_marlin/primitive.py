"""The ``marlin_matmul`` primitive: abstract evaluation and lowering only.

``y [..., n] = x [..., k] @ W + bias`` on the padded (physical) weight shape
the kernel sees. Binding it directly is internal: ``jm.matmul``
(``jax_marlin.ops``) checks the user's arguments, pads them and wires
autodiff, ``vmap`` and sharding around it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_marlin import _ffi, shapes
from jax_marlin._compat import Primitive, ShapedArray, mlir

__all__ = ["marlin_matmul_p"]

marlin_matmul_p = Primitive("marlin_matmul")
"""Operands ``(x [..., k], qweight [k // 16, 2 n] int32, scales, zeros
[groups, n // 8] int32 or [0, 0] (zero point 8), perm [k] int32 or [0]
(act-order: the kernel multiplies ``x[..., perm]``), bias [n] or [0])`` on the
padded shape; params ``k``, ``n`` (the padded sizes),
``group_size`` and ``poison_output`` (tests only: fill ``y`` with NaN before
the kernel runs, so an element it fails to write shows). Result ``y [..., n]``
in ``x``'s dtype."""


def _abstract_eval(x, qweight, scales, zeros, perm, bias, *, k, n, group_size, poison_output):
    del poison_output
    shapes.check_operands(x.shape, x.dtype, qweight.shape, qweight.dtype, scales.shape,
                          scales.dtype, zeros.shape, zeros.dtype, perm.shape, perm.dtype,
                          bias.shape, bias.dtype, k=k, n=n, group_size=group_size)
    return ShapedArray(x.shape[:-1] + (n,), x.dtype)


@functools.partial(jax.jit, static_argnames=("k", "n", "group_size", "poison_output"))
def _impl(x, qweight, scales, zeros, perm, bias, **params):
    # Eager binds run the primitive through jit, which lowers it.
    return marlin_matmul_p.bind(x, qweight, scales, zeros, perm, bias, **params)


def _lowering(ctx, x, qweight, scales, zeros, perm, bias, *, k, n, group_size, poison_output):
    # The kernel's fp32 reduction buffer and a lock-counter buffer are extra
    # results that XLA allocates, dropped here: a fixed buffer per call site,
    # which keeps the call capturable into a CUDA graph. (The CUDA handler
    # uses its call site's own counters, zeroed once, and the workspace only
    # if those cannot be had: ffi/zeroed_counters.h.) They stay out of the
    # primitive's abstract value, so batching and partitioning rules deal
    # with y alone.
    m = int(np.prod(ctx.avals_in[0].shape[:-1], dtype=np.int64))
    workspace = ShapedArray((shapes.workspace_size(m, n),), jnp.int32)
    act_order = ctx.avals_in[4].shape[0] > 0
    scratch = ShapedArray((shapes.reduce_scratch_size(m, n, k, act_order),), jnp.float32)
    rule = jax.ffi.ffi_lowering(_ffi.MATMUL_TARGET)
    y, _, _ = rule(ctx.replace(avals_out=[*ctx.avals_out, workspace, scratch]), x, qweight,
                   scales, zeros, perm, bias, group_size=group_size,
                   poison_output=bool(poison_output))
    return [y]


def _cuda_lowering(ctx, *args, **params):
    if not _ffi.HAS_CUDA:
        raise RuntimeError(
            "jax_marlin was built without CUDA support, so jm.matmul cannot run on a GPU. "
            "Reinstall with nvcc on PATH and JAX_MARLIN_CUDA=ON (README.md, 'Building')."
        )
    return _lowering(ctx, *args, **params)


marlin_matmul_p.def_impl(_impl)
marlin_matmul_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(marlin_matmul_p, _lowering, platform="cpu")
mlir.register_lowering(marlin_matmul_p, _cuda_lowering, platform="cuda")
