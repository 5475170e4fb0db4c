"""The ``marlin_matmul`` primitive: abstract eval, lowering, batching.

``y [..., n] = x [..., k] @ W`` with ``W`` a :class:`MarlinWeight`. Leading
dimensions of ``x`` are folded into the kernel's m. Every constraint is checked
at trace time (``shapes.check_matmul``); the FFI handlers re-check at run time.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jax_marlin import _ffi, shapes
from jax_marlin.packing import MarlinWeight

__all__ = ["matmul", "marlin_matmul_p"]

marlin_matmul_p = Primitive("marlin_matmul")
"""Operands ``(x, qweight, scales)``; params ``k``, ``n``, ``group_size`` and
``poison_output`` (tests only: fill ``y`` with NaN before the kernel runs, so
an element it fails to write shows)."""


def matmul(x, w: MarlinWeight) -> jax.Array:
    """``x @ W`` with the Marlin kernel, on CPU and CUDA, under ``jit``/``vmap``.

    Under ``jit`` with sharded inputs the kernel runs on each device's shard
    (``jax_marlin.sharding``): sharding ``m`` or ``n`` needs no communication,
    sharding ``k`` one all-reduce of ``y``.

    Args:
      x: ``[..., k]`` float16 activations.
      w: a :class:`MarlinWeight` for a ``[k, n]`` weight.

    Returns:
      ``[..., n]`` float16.
    """
    return _bind(x, w, poison_output=False)


def _bind(x, w: MarlinWeight, *, poison_output: bool) -> jax.Array:
    if not isinstance(w, MarlinWeight):
        raise TypeError(f"w must be a jax_marlin.MarlinWeight (from jm.quantize or jm.pack), "
                        f"got {type(w).__name__}")
    # Imported here: sharding.py builds its partitioned op on marlin_matmul_p
    # from this module.
    from jax_marlin.sharding import _matmul

    return _matmul(jnp.asarray(x), w, poison_output=bool(poison_output))


def _abstract_eval(x, qweight, scales, *, k, n, group_size, poison_output):
    shapes.check_matmul(x.shape, x.dtype, qweight.shape, qweight.dtype, scales.shape,
                        scales.dtype, k=k, n=n, group_size=group_size)
    return jax.core.ShapedArray(x.shape[:-1] + (n,), jnp.float16)


@functools.partial(jax.jit, static_argnames=("k", "n", "group_size", "poison_output"))
def _impl(x, qweight, scales, **params):
    # Eager calls run the primitive through jit, which lowers it.
    return marlin_matmul_p.bind(x, qweight, scales, **params)


def _lowering(ctx, x, qweight, scales, *, k, n, group_size, poison_output):
    # The kernel's lock counters are an extra result that XLA allocates (and
    # the handler zeroes on the stream): a fixed buffer per call site, which
    # keeps the call capturable into a CUDA graph.
    workspace = jax.core.ShapedArray((shapes.workspace_size(n),), jnp.int32)
    rule = jax.ffi.ffi_lowering(_ffi.MATMUL_TARGET)
    y, _ = rule(ctx.replace(avals_out=[*ctx.avals_out, workspace]), x, qweight, scales,
                group_size=group_size, poison_output=bool(poison_output))
    return [y]


def _cuda_lowering(ctx, *args, **params):
    if not _ffi.HAS_CUDA:
        raise RuntimeError(
            "jax_marlin was built without CUDA support, so jm.matmul cannot run on a GPU. "
            "Reinstall with nvcc on PATH and JAX_MARLIN_CUDA=ON (README.md, 'Building')."
        )
    return _lowering(ctx, *args, **params)


def _batch(args, dims, **params):
    x, qweight, scales = args
    x_dim, q_dim, s_dim = dims
    if q_dim is None and s_dim is None:
        # Batching x only adds a leading dimension, which the kernel folds into m.
        return marlin_matmul_p.bind(jnp.moveaxis(x, x_dim, 0), qweight, scales, **params), 0
    # A batch of weights: one kernel call per weight.
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    args = [batching.bdim_at_front(a, d, size) for a, d in zip(args, dims)]
    y = jax.lax.map(lambda a: marlin_matmul_p.bind(*a, **params), tuple(args))
    return y, 0


marlin_matmul_p.def_impl(_impl)
marlin_matmul_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(marlin_matmul_p, _lowering, platform="cpu")
mlir.register_lowering(marlin_matmul_p, _cuda_lowering, platform="cuda")
batching.primitive_batchers[marlin_matmul_p] = _batch
