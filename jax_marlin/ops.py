"""``jm.matmul``: the public op, with argument checks, padding, autodiff and ``vmap``.

The layers, top down: this module checks the user's arguments once (in
logical sizes, naming them), pads ``x`` and the bias to the weight's padded
shape and drops the padded columns of ``y``; ``partitioning`` runs the kernel
per shard under sharded inputs; ``primitive`` is the kernel's abstract
evaluation and lowering; ``shapes`` holds the rules they check.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jax.custom_derivatives import SymbolicZero

from jax_marlin import partitioning, shapes
from jax_marlin.packing import _ZERO_POINT, MarlinWeight, _check_weight, _unpermute_scales

__all__ = ["matmul"]


def matmul(x, w: MarlinWeight, bias=None) -> jax.Array:
    """``x @ W + bias`` with the Marlin kernel, on CPU and CUDA, under ``jit``/``vmap``.

    The bias is added in float32 to the float32 product before its one
    rounding to ``x.dtype``. Under ``jit`` with sharded inputs the kernel runs
    on each device's shard (``jax_marlin.partitioning``): sharding ``m`` or
    ``n`` needs no communication, sharding ``k`` one all-reduce of ``y`` (the
    bias is then added once, after it).

    Args:
      x: ``[..., k]`` float16 or bfloat16 activations, the dtype of the
        weight's scales (``w.dtype``).
      w: a :class:`MarlinWeight` for a ``[k, n]`` weight.
      bias: optional ``[n]`` in ``x.dtype``.

    Returns:
      ``[..., n]`` in ``x.dtype``.

    Differentiable with respect to ``bias`` only; a derivative with respect
    to ``x`` or the weight raises ``NotImplementedError``.

    Weights imported with act-order or zero points (``w.perm``, ``w.zeros``)
    cost a little more, in the same jitted call:

    * act-order: ``x[..., perm]``, a gather of the activations that XLA
      fuses with the padding of ``x`` (``m k`` elements; no pass over the
      weight).
    * zero points: the kernel runs with zero point 8, and
      ``(q - z) s = (q - 8) s + (8 - z) s`` adds ``xs @ Z``: ``xs [..., k /
      group_size]`` the sums of ``x`` over each group's rows, ``Z = (8 - z) s
      [k / group_size, n]``, both in float32 (exact: ``Z`` is an integer
      times a float16/bfloat16). That is a reduction over ``x``, a dense dot
      of ``[m, k / g] x [k / g, n]`` (``1 / g`` of the kernel's flops) and a
      read of the zero points and scales (``3 n k / g`` bytes, ``6 / g`` of
      the packed weight's). The kernel has already rounded its product to
      ``x.dtype``, so ``y`` is rounded twice, ``round(round(x @ W_8) + xs @
      Z)``: the error grows from one rounding of ``y`` to one of ``x @ W_8``
      plus one of ``y`` (measured in ``benchmarks/NOTES.md``).
    """
    return _matmul(x, w, bias, poison_output=False)


def _matmul(x, w: MarlinWeight, bias=None, *, poison_output: bool) -> jax.Array:
    """:func:`matmul`, with ``poison_output`` for tests (``y`` starts as NaN)."""
    x = jnp.asarray(x)
    if bias is not None:
        bias = jnp.asarray(bias)
    _check_arguments(x, w, bias)
    return _differentiable(x, w, bias, bool(poison_output))


def _check_arguments(x, w, bias) -> None:
    """The user's arguments, in the logical sizes ``[k, n]`` they were given in."""
    if not isinstance(w, MarlinWeight):
        raise TypeError(f"w must be a jax_marlin.MarlinWeight (from jm.quantize or jm.pack), "
                        f"got {type(w).__name__}")
    _check_weight(w)
    shapes.check_dtypes(x.dtype, w.scales.dtype, None if bias is None else bias.dtype)
    if x.ndim < 1:
        raise ValueError("x must have at least one dimension, [..., k]")
    if x.shape[-1] != w.k:
        raise ValueError(f"x.shape[-1] = {x.shape[-1]} does not match the weight's k = {w.k} "
                         f"(x has shape {x.shape}, the weight [k, n] = [{w.k}, {w.n}])")
    if bias is not None and bias.shape != (w.n,):
        raise ValueError(f"bias.shape = {bias.shape}, expected ({w.n},): one value per output "
                         f"column of the weight [k, n] = [{w.k}, {w.n}]")


# --- autodiff ------------------------------------------------------------------------


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _differentiable(x, w, bias, poison_output):
    return _padded_matmul(x, w, bias, poison_output)


def _is_zero(tangent) -> bool:
    return all(isinstance(t, SymbolicZero) for t in jax.tree.leaves(tangent))


@functools.partial(_differentiable.defjvp, symbolic_zeros=True)
def _jvp(poison_output, primals, tangents):
    # y is affine in the bias: dy = broadcast(d bias).
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


# --- padding ---------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("poison_output",))
def _padded_matmul(x, w: MarlinWeight, bias, poison_output: bool) -> jax.Array:
    """Pads ``x [..., k]`` and ``bias [n]`` to the weight's padded shape, drops padded columns.

    A ``jit`` so that eager calls on sharded arrays are partitioned too (the
    primitive's own eager path would gather them).
    """
    if w.perm is not None:
        x = _act_order(x, w.perm)
    if w.k_pad > w.k:  # zero activations meet the zero rows of the padded weight
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, w.k_pad - w.k)])
    if bias is not None and w.n_pad > w.n:
        bias = jnp.pad(bias, (0, w.n_pad - w.n))
    kernel_weight = MarlinWeight(w.qweight, w.scales, w.k, w.n, w.group_size)
    y = _vmappable(poison_output, w.perm is not None)(x, kernel_weight, bias)
    if w.zeros is not None:
        y = _zero_point_correction(y, x, w.scales, w.zeros, w.group_size)
    return y[..., :w.n] if w.n_pad > w.n else y


# --- act-order -------------------------------------------------------------------------


def _act_order(x, perm):
    """``x [..., k]`` in the weight's stored row order: ``x[..., perm]``.

    ``perm`` is a permutation of ``0 .. k - 1`` (``jm.pack`` builds it), so the
    gather needs no out-of-bounds fill (XLA clamps indices in any case).
    """
    return x.at[..., perm].get(mode="promise_in_bounds", unique_indices=True)


# --- zero points -----------------------------------------------------------------------


def _zero_point_correction(y, x, scales, zeros, group_size):
    """``y + xs @ Z``, rounded once more to ``y.dtype``: the weight's zero points.

    ``y [..., n_pad]`` is the kernel's ``x @ W_8`` with ``W_8 = (q - 8) s``;
    the weight is ``(q - z) s = W_8 + (8 - z) s``, so the rest of the product
    is ``xs [..., groups] @ Z [groups, n_pad]``, ``xs`` the sums of the padded
    ``x [..., k_pad]`` over each group of rows (all of them per column), ``Z =
    (8 - z) s`` from the natural-order scales. Both in float32, ``Z`` exactly.
    """
    k_pad = x.shape[-1]
    group_rows = k_pad if group_size == -1 else group_size
    xs = x.astype(jnp.float32).reshape(*x.shape[:-1], k_pad // group_rows, group_rows).sum(-1)
    s = _unpermute_scales(scales, group_size).astype(jnp.float32)
    z = (_ZERO_POINT - zeros.astype(jnp.float32)) * s
    correction = jnp.matmul(xs, z, precision=jax.lax.Precision.HIGHEST)
    return (y.astype(jnp.float32) + correction).astype(y.dtype)


# --- vmap ------------------------------------------------------------------------------


@functools.cache
def _vmappable(poison_output: bool, act_order: bool) -> custom_vmap:
    """The partitioned kernel on padded operands, with a batching rule.

    custom_partitioning has no batching rule of its own; this one folds a
    batch of ``x`` into its leading dimensions (the kernel's m) and runs one
    call per element when weights or biases are batched.
    """

    @custom_vmap
    def call(x, w, bias):
        if bias is None:  # the kernel's "no bias": a [0] operand
            bias = jnp.zeros((0,), x.dtype)
        return partitioning.matmul(x, w.qweight, w.scales, bias, w.k_pad, w.n_pad,
                                   w.group_size, poison_output, act_order)

    @call.def_vmap
    def rule(axis_size, in_batched, x, w, bias):
        x_batched, w_batched, bias_batched = in_batched
        if not (w_batched.qweight or w_batched.scales or bias_batched):
            # Only x is batched (at axis 0): one more leading dimension of m.
            return call(x, w, bias), True

        def front(a, batched):
            return a if batched else jnp.broadcast_to(a, (axis_size, *a.shape))

        xs = front(x, x_batched)
        qs, ss = front(w.qweight, w_batched.qweight), front(w.scales, w_batched.scales)
        bs = None if bias is None else front(bias, bias_batched)
        y = jax.lax.map(
            lambda a: call(a[0], MarlinWeight(a[1], a[2], w.k, w.n, w.group_size), a[3]),
            (xs, qs, ss, bs))
        return y, True

    return call
