"""``jm.matmul``: the public op, with argument checks, padding, autodiff and ``vmap``.

The layers, top down: this module checks the user's arguments once (in
logical sizes, naming them) and binds ``matmul_p``, the op's primitive, which
holds the derivative rules (linear in ``x``; the cotangent ``dy @ W^T``) and
the batching rule; its lowering pads ``x`` and the bias to the weight's padded
shape and drops the padded columns of ``y``; ``partitioning`` runs the kernel
per shard under sharded inputs; ``primitive`` is the kernel's abstract
evaluation and lowering; ``shapes`` holds the rules they check.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_marlin import partitioning, shapes
from jax_marlin._compat import (Primitive, ShapedArray, ad, batching, mlir,
                                requires_devices_during_lowering)
from jax_marlin.packing import MarlinWeight, _check_weight, dequantize

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

    Differentiable with respect to ``x`` (linear: the tangent is
    ``jm.matmul(x_dot, w)``, the cotangent ``dy @ W^T``) and ``bias``, under
    ``jit``, ``vmap`` and sharding, forward and reverse mode. The weight is
    frozen: a derivative with respect to its ``qweight`` or ``scales`` raises
    ``TypeError`` (``jax.lax.stop_gradient`` it, or close over it).

    Weights imported with act-order or zero points (``w.perm``, ``w.zeros``)
    run in the same jitted call:

    * zero points: the kernels dequantize ``(q - z) s`` with the weight's
      zero points (one rounding of each weight, as with zero point 8), so
      ``y`` is rounded once as for a symmetric weight; the zero points add
      ``n k / (2 g)`` bytes to the weight's read (0.8% at ``g = 128``).
    * act-order: the kernels multiply ``x[..., perm]`` (the weight's rows
      are stored sorted by group): the CUDA call first writes the permuted
      ``x`` into its scratch (``m k`` elements read and written once; no
      pass over the weight), or at the smallest batches the decode kernel
      gathers ``x`` as it loads it.
    """
    return _matmul(x, w, bias, poison_output=False)


def _matmul(x, w: MarlinWeight, bias=None, *, poison_output: bool) -> jax.Array:
    """:func:`matmul`, with ``poison_output`` for tests (``y`` starts as NaN)."""
    x = jnp.asarray(x)
    if bias is not None:
        bias = jnp.asarray(bias)
    _check_arguments(x, w, bias)
    return _bind(x, w, bias, bool(poison_output))


def _check_arguments(x, w, bias) -> None:
    """The user's arguments, in the logical sizes ``[k, n]`` they were given in."""
    if not isinstance(w, MarlinWeight):
        raise TypeError(f"w must be a jax_marlin.MarlinWeight (from jm.quantize or jm.pack), "
                        f"got {type(w).__name__}")
    _check_weight(w)
    if w.qweight.dtype != jnp.int32:  # the kernel's abstract eval sees it only when lowered
        raise TypeError(f"qweight.dtype is {w.qweight.dtype}, expected int32 (8 nibbles a word)")
    shapes.check_dtypes(x.dtype, w.scales.dtype, None if bias is None else bias.dtype)
    if x.ndim < 1:
        raise ValueError("x must have at least one dimension, [..., k]")
    if x.shape[-1] != w.k:
        raise ValueError(f"x.shape[-1] = {x.shape[-1]} does not match the weight's k = {w.k} "
                         f"(x has shape {x.shape}, the weight [k, n] = [{w.k}, {w.n}])")
    if bias is not None and bias.shape != (w.n,):
        raise ValueError(f"bias.shape = {bias.shape}, expected ({w.n},): one value per output "
                         f"column of the weight [k, n] = [{w.k}, {w.n}]")


# --- the op: one primitive with its rules ----------------------------------------------
#
# jm.matmul is a primitive of its own, so that its derivative rules sit above
# the custom_partitioning op (which has none): the JVP is linear in x (the
# tangent goes through the same op), the transpose multiplies the cotangent by
# W^T, and the batching rule folds a batch of x into m. Its lowering is the
# padded, partitioned kernel call below. The weight travels as its pytree
# leaves plus the treedef, so fields added to MarlinWeight travel with it.

matmul_p = Primitive("jax_marlin_matmul")
"""Operands ``(x [..., k], *leaves of the MarlinWeight, bias [n] or [0])``;
params ``weight_tree`` (the weight's treedef: ``k``, ``n``, ``group_size``) and
``poison_output``. Result ``[..., n]`` in ``x``'s dtype, logical sizes."""


def _bind(x, w: MarlinWeight, bias, poison_output: bool) -> jax.Array:
    leaves, weight_tree = jax.tree.flatten(w)
    if bias is None:  # "no bias": a [0] operand, as the kernel takes it
        bias = jnp.zeros((0,), x.dtype)
    return matmul_p.bind(x, *leaves, bias, weight_tree=weight_tree,
                         poison_output=poison_output)


def _abstract_eval(x, *rest, weight_tree, poison_output):
    del poison_output
    w = jax.tree.unflatten(weight_tree, rest[:-1])
    # x's type with its last dimension replaced, so that inside shard_map y
    # varies over the mesh axes x does (the transpose's cotangent must match
    # x's type). Sharded in types, y's n follows the weight's n (qweight's
    # columns) when both are typed on one mesh; k is reduced away. (jax 0.12
    # types a weight placed on a mesh with its axes while an unsharded x has
    # none: y then keeps x's type.)
    w_sharding = w.qweight.sharding
    n_spec = w_sharding.spec[1] if w_sharding.mesh == x.sharding.mesh else None
    spec = (*x.sharding.spec[:-1], n_spec)
    return x.update(shape=x.shape[:-1] + (w.n,),
                    sharding=x.sharding.update(spec=x.sharding.spec.update(partitions=spec)))


def _padded_matmul(*operands, weight_tree, poison_output: bool) -> jax.Array:
    """Pads ``x [..., k]`` and ``bias [n]`` to the weight's padded shape, drops padded columns."""
    x, *leaves, bias = operands
    w = jax.tree.unflatten(weight_tree, leaves)
    if w.k_pad > w.k:  # zero activations meet the zero rows of the padded weight
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, w.k_pad - w.k)])
    if bias.shape != (0,) and w.n_pad > w.n:
        bias = jnp.pad(bias, (0, w.n_pad - w.n))
    zeros = jnp.zeros((0, 0), jnp.int32) if w.zeros is None else w.zeros  # [0, 0]: none
    perm = jnp.zeros((0,), jnp.int32) if w.perm is None else _padded_perm(w)  # [0]: none
    y = partitioning.matmul(x, w.qweight, w.scales, zeros, perm, bias, w.k_pad, w.n_pad,
                            w.group_size, poison_output)
    return y[..., :w.n] if w.n_pad > w.n else y


# --- act-order -------------------------------------------------------------------------


def _padded_perm(w: MarlinWeight) -> jax.Array:
    """``w.perm [k]`` extended to ``[k_pad]``: the padded rows keep their place.

    ``perm`` is a permutation of ``0 .. k - 1`` (``jm.pack`` builds it); the
    kernels clamp an index out of range rather than read past ``x``.
    """
    perm = w.perm.astype(jnp.int32)
    if w.k_pad > w.k:
        perm = jnp.concatenate([perm, jnp.arange(w.k, w.k_pad, dtype=jnp.int32)])
    return perm


# Eager binds run through jit, so that eager calls on sharded arrays are
# partitioned too (the kernel primitive's own eager path would gather them).
_impl = jax.jit(_padded_matmul, static_argnames=("weight_tree", "poison_output"))


# --- autodiff --------------------------------------------------------------------------


def _is_zero(tangent) -> bool:
    return type(tangent) is ad.Zero or tangent.dtype == jax.dtypes.float0


def _jvp(primals, tangents, *, weight_tree, poison_output):
    # y = x W + bias is linear in x and affine in the bias; W is frozen.
    x, *leaves, bias = primals
    x_dot, *leaf_dots, bias_dot = tangents
    if not all(_is_zero(t) for t in leaf_dots):
        raise TypeError(
            "jm.matmul has no derivative with respect to the quantized weight (its qweight "
            "and scales): 4-bit weights are frozen. Differentiate with respect to x or the "
            "bias only: wrap the weight in jax.lax.stop_gradient, close over it instead of "
            "passing it as a differentiated argument, or, in Flax NNX, keep it in a "
            "QuantizedWeight (an nnx.Variable that is not an nnx.Param, as MarlinLinear "
            "does) and differentiate with respect to nnx.Param")
    y = matmul_p.bind(*primals, weight_tree=weight_tree, poison_output=poison_output)
    y_dot = None
    if not _is_zero(x_dot):
        empty = jnp.zeros((0,), x.dtype)
        y_dot = matmul_p.bind(x_dot, *leaves, empty, weight_tree=weight_tree,
                              poison_output=poison_output)
    if bias.shape != (0,) and not _is_zero(bias_dot):
        b_dot = jnp.broadcast_to(bias_dot.astype(y.dtype), y.shape)
        y_dot = b_dot if y_dot is None else y_dot + b_dot
    return y, ad.Zero.from_primal_value(y) if y_dot is None else y_dot


def _transpose(ct, x, *rest, weight_tree, poison_output):
    # Called on the linear part only: the JVP's x tangent, or a user's
    # jax.linear_transpose of x -> x W. The weight and bias are known there.
    del poison_output
    if any(ad.is_undefined_primal(a) for a in rest):
        raise TypeError("jm.matmul is linear in x only; it cannot be transposed with respect "
                        "to the weight or the bias")
    if type(ct) is ad.Zero:
        return [None] * (1 + len(rest))
    w = jax.tree.unflatten(weight_tree, rest[:-1])
    mesh = next((m for m in (jax.typeof(a).sharding.mesh for a in (ct, *jax.tree.leaves(w)))
                 if m.explicit_axes), None)
    if mesh is not None:
        # Explicitly sharded types: dequantize's reshapes of the packed tiles
        # do not say how their shards map, so the transposed product runs with
        # the mesh's axes automatic (the partitioner keeps the shards) and
        # gives x's cotangent x's sharding.
        with jax.sharding.use_abstract_mesh(mesh):
            transposed = jax.sharding.auto_axes(_matmul_transposed,
                                                out_sharding=x.aval.sharding.spec)
            return [transposed(ct, w)] + [None] * len(rest)
    return [_matmul_transposed(ct, w)] + [None] * len(rest)


def _matmul_transposed(dy, w: MarlinWeight) -> jax.Array:
    """``dy [..., n] @ W^T -> [..., k]`` in ``dy.dtype``: the cotangent of ``x``.

    Dequantizes the weight to ``dy``'s dtype (float16 or bfloat16), then one
    dense dot accumulated in float32 and rounded once. The Marlin kernel
    multiplies by ``W`` only: its packed layout feeds tensor-core fragments of
    ``W``, not of ``W^T``, so the transposed product has no kernel yet; the
    dequantized ``[k, n]`` weight is transient (the float weight's bytes) and
    the dot runs at the dense dot's speed (benchmarks/bench_backward.py). A
    kernel for the transposed product drops in here, per shape.

    ``jm.dequantize`` is the one statement of what the weight is (including
    any fields a MarlinWeight gains), so the gradient follows it. Rounding the
    weight to ``dy``'s dtype costs at most one unit roundoff per weight
    element, the same order as the output's rounding.
    """
    wd = dequantize(w, dy.dtype)
    dx = jax.lax.dot_general(dy, wd, (((dy.ndim - 1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)
    return dx.astype(dy.dtype)


# --- vmap ------------------------------------------------------------------------------


def _batch(operands, dims, *, weight_tree, poison_output):
    """A batch of ``x`` folds into its leading dimensions (the kernel's m); batched
    weights or biases run one call per element."""
    x, *leaves, bias = operands
    x_dim, *leaf_dims, bias_dim = dims
    params = dict(weight_tree=weight_tree, poison_output=poison_output)
    if all(d is None for d in leaf_dims) and bias_dim is None:
        return matmul_p.bind(jnp.moveaxis(x, x_dim, 0), *leaves, bias, **params), 0
    size = next(a.shape[d] for a, d in zip(operands, dims) if d is not None)

    def front(a, d):
        return jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)

    batched = [front(a, d) for a, d in zip(operands, dims)]
    return jax.lax.map(lambda a: matmul_p.bind(*a, **params), batched), 0


matmul_p.def_impl(_impl)
matmul_p.def_abstract_eval(_abstract_eval)
# The custom_partitioning op inside needs the devices of the program it is
# lowered into, and its lowering must not be cached across programs.
mlir.register_lowering(matmul_p, mlir.lower_fun(_padded_matmul, multiple_results=False),
                       cacheable=False)
requires_devices_during_lowering(matmul_p)
ad.primitive_jvps[matmul_p] = _jvp
ad.primitive_transposes[matmul_p] = _transpose
batching.primitive_batchers[matmul_p] = _batch
