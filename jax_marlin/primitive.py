"""The ``marlin_matmul`` primitive: abstract eval, lowering, batching, autodiff.

``y [..., n] = x [..., k] @ W + bias`` with ``W`` a :class:`MarlinWeight`.
Leading dimensions of ``x`` are folded into the kernel's m. :func:`matmul`
checks the call at trace time on the logical shapes, pads ``x`` (along k) and
the bias to the weight's padded shape, runs the kernel on the padded shape
(``shapes.check_matmul`` checks the primitive again) and drops the padded
columns of ``y``; the FFI handlers re-check at run time.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jax_marlin import _ffi, shapes
from jax_marlin.packing import MarlinWeight, _check_weight

__all__ = ["matmul", "marlin_matmul_p"]

marlin_matmul_p = Primitive("marlin_matmul")
"""Operands ``(x [..., k], qweight, scales, bias [n] or [0])`` on the padded
shape; params ``k``, ``n`` (the padded sizes), ``group_size`` and
``poison_output`` (tests only: fill ``y`` with NaN before the kernel runs, so
an element it fails to write shows). Result ``y [..., n]`` in ``x``'s dtype."""


def matmul(x, w: MarlinWeight, bias=None) -> jax.Array:
    """``x @ W + bias`` with the Marlin kernel, on CPU and CUDA, under ``jit``/``vmap``.

    The bias is added in float32 to the float32 product before its one
    rounding to ``x.dtype``. Under ``jit`` with sharded inputs the kernel runs
    on each device's shard (``jax_marlin.sharding``): sharding ``m`` or ``n``
    needs no communication, sharding ``k`` one all-reduce of ``y`` (the bias is
    then added once, after it).

    Args:
      x: ``[..., k]`` float16 or bfloat16 activations, the dtype of the
        weight's scales (``w.dtype``).
      w: a :class:`MarlinWeight` for a ``[k, n]`` weight.
      bias: optional ``[n]`` in ``x.dtype``.

    Returns:
      ``[..., n]`` in ``x.dtype``.

    Differentiable with respect to ``bias`` only; a derivative with respect
    to ``x`` or the weight raises ``NotImplementedError``.
    """
    return _bind(x, w, bias, poison_output=False)


def _bind(x, w: MarlinWeight, bias=None, *, poison_output: bool) -> jax.Array:
    if not isinstance(w, MarlinWeight):
        raise TypeError(f"w must be a jax_marlin.MarlinWeight (from jm.quantize or jm.pack), "
                        f"got {type(w).__name__}")
    _check_weight(w)
    x = jnp.asarray(x)
    if bias is not None:
        bias = jnp.asarray(bias)
    shapes.check_dtypes(x.dtype, w.scales.dtype, None if bias is None else bias.dtype)
    if x.ndim < 1:
        raise ValueError("x must have at least one dimension, [..., k]")
    if x.shape[-1] != w.k:
        raise ValueError(f"x.shape[-1] = {x.shape[-1]} does not match the weight's k = {w.k} "
                         f"(x has shape {x.shape}, the weight [k, n] = [{w.k}, {w.n}])")
    if bias is not None and bias.shape != (w.n,):
        raise ValueError(f"bias.shape = {bias.shape}, expected ({w.n},): one value per output "
                         f"column of the weight [k, n] = [{w.k}, {w.n}]")
    return _differentiable(x, w, bias, bool(poison_output))


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _differentiable(x, w, bias, poison_output):
    return _padded_matmul(x, w, bias, poison_output)


def _is_zero(tangent) -> bool:
    return all(isinstance(t, SymbolicZero) for t in jax.tree.leaves(tangent))


@functools.partial(_differentiable.defjvp, symbolic_zeros=True)
def _jvp(poison_output, primals, tangents):
    # y is affine in the bias: dy = broadcast(d bias). The kernel has no
    # derivative with respect to x or the weight yet.
    x, w, bias = primals
    x_dot, w_dot, bias_dot = tangents
    if not (_is_zero(x_dot) and _is_zero(w_dot)):
        raise NotImplementedError(
            "jm.matmul is differentiable with respect to the bias only; no derivative "
            "with respect to x or the weight yet (stop_gradient the input of a 4-bit layer)")
    y = _differentiable(x, w, bias, poison_output)
    if bias is None or _is_zero(bias_dot):
        return y, jnp.zeros_like(y)
    return y, jnp.broadcast_to(bias_dot.astype(y.dtype), y.shape)


@functools.partial(jax.jit, static_argnames=("poison_output",))
def _padded_matmul(x, w: MarlinWeight, bias, poison_output: bool) -> jax.Array:
    """Pads ``x [..., k]`` and ``bias [n]`` to the weight's padded shape, drops padded columns.

    A ``jit`` so that eager calls on sharded arrays are partitioned too (the
    primitive's own eager path would gather them).
    """
    # Imported here: sharding.py builds its partitioned op on marlin_matmul_p
    # from this module.
    from jax_marlin.sharding import partitioned_matmul

    if w.k_pad > w.k:  # zero activations meet the zero rows of the padded weight
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, w.k_pad - w.k)])
    if bias is not None and w.n_pad > w.n:
        bias = jnp.pad(bias, (0, w.n_pad - w.n))
    y = partitioned_matmul(x, w, bias, poison_output)
    return y[..., :w.n] if w.n_pad > w.n else y


def _abstract_eval(x, qweight, scales, bias, *, k, n, group_size, poison_output):
    shapes.check_matmul(x.shape, x.dtype, qweight.shape, qweight.dtype, scales.shape,
                        scales.dtype, bias.shape, bias.dtype, k=k, n=n, group_size=group_size)
    return jax.core.ShapedArray(x.shape[:-1] + (n,), x.dtype)


@functools.partial(jax.jit, static_argnames=("k", "n", "group_size", "poison_output"))
def _impl(x, qweight, scales, bias, **params):
    # Eager calls run the primitive through jit, which lowers it.
    return marlin_matmul_p.bind(x, qweight, scales, bias, **params)


def _lowering(ctx, x, qweight, scales, bias, *, k, n, group_size, poison_output):
    # The kernel's lock counters and its fp32 reduction buffer are extra
    # results that XLA allocates, dropped here: a fixed buffer per call site
    # (no allocation in the handler), which keeps the call capturable into a
    # CUDA graph. They stay out of the primitive's abstract value, so batching
    # and partitioning rules deal with y alone.
    m = int(np.prod(ctx.avals_in[0].shape[:-1], dtype=np.int64))
    workspace = jax.core.ShapedArray((shapes.workspace_size(m, n),), jnp.int32)
    scratch = jax.core.ShapedArray((shapes.reduce_scratch_size(m, n),), jnp.float32)
    rule = jax.ffi.ffi_lowering(_ffi.MATMUL_TARGET)
    y, _, _ = rule(ctx.replace(avals_out=[*ctx.avals_out, workspace, scratch]), x, qweight,
                   scales, bias, group_size=group_size, poison_output=bool(poison_output))
    return [y]


def _cuda_lowering(ctx, *args, **params):
    if not _ffi.HAS_CUDA:
        raise RuntimeError(
            "jax_marlin was built without CUDA support, so jm.matmul cannot run on a GPU. "
            "Reinstall with nvcc on PATH and JAX_MARLIN_CUDA=ON (README.md, 'Building')."
        )
    return _lowering(ctx, *args, **params)


def _batch(args, dims, **params):
    x, qweight, scales, bias = args
    x_dim, *rest = dims
    if all(d is None for d in rest):
        # Batching x only adds a leading dimension, which the kernel folds into m.
        return marlin_matmul_p.bind(jnp.moveaxis(x, x_dim, 0), qweight, scales, bias,
                                    **params), 0
    # A batch of weights or biases: one kernel call per batch element.
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    args = [batching.bdim_at_front(a, d, size) for a, d in zip(args, dims)]
    y = jax.lax.map(lambda a: marlin_matmul_p.bind(*a, **params), tuple(args))
    return y, 0


marlin_matmul_p.def_impl(_impl)
marlin_matmul_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(marlin_matmul_p, _lowering, platform="cpu")
mlir.register_lowering(marlin_matmul_p, _cuda_lowering, platform="cuda")
batching.primitive_batchers[marlin_matmul_p] = _batch
