"""``jm.matmul``: the public op, with argument checks, padding, autodiff and ``vmap``.

The layers, top down: this module checks the user's arguments once (in
logical sizes, naming them) and binds ``matmul_p``, the op's primitive, which
holds the derivative rules (linear in ``x`` without a prologue; the cotangent
``dy @ W^T``; a prologue's derivative through its jnp statement in
``fusion``) and the batching rule; its lowering pads ``x``, the bias and the
fused operands to the weight's padded shape and drops the padded columns of
``y``; ``partitioning`` runs the kernel per shard under sharded inputs;
``primitive`` is the kernel's abstract evaluation and lowering; ``shapes``
holds the rules they check.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_marlin import fusion, partitioning, shapes
from jax_marlin._compat import (Primitive, ShapedArray, Tracer, ad, batching, mlir,
                                requires_devices_during_lowering)
from jax_marlin.packing import MarlinWeight, _check_weight, dequantize

__all__ = ["matmul"]


def matmul(x, w: MarlinWeight, bias=None, *, residual=None, rms_norm_weight=None,
           rms_norm_eps: float = 1e-6, swiglu: bool = False) -> jax.Array:
    """``x @ W + bias`` with the Marlin kernel, on CPU and CUDA, under ``jit``/``vmap``.

    The bias is added in float32 to the float32 product before its one
    rounding to ``x.dtype``. Under ``jit`` with sharded inputs the kernel runs
    on each device's shard (``jax_marlin.partitioning``): sharding ``m`` or
    ``n`` needs no communication, sharding ``k`` one all-reduce of ``y`` (the
    bias is then added once, after it).

    Fusions: the elementwise work a transformer block does between its
    projections runs in the same call: with ``y = dtype(x' W + bias)``,

    * ``residual``: returns ``dtype(y + residual)``, added in float32:
      exactly ``jm.matmul(x, w, bias) + residual`` in ``x.dtype``.
    * ``rms_norm_weight`` (RMSNorm prologue): ``x'_j = dtype(x_j r
      rms_norm_weight_j)`` with ``r = 1 / sqrt(sum_j x_j^2 / k +
      rms_norm_eps)`` per row, in float32.
    * ``swiglu=True`` (SwiGLU prologue): ``x`` is ``[..., 2 k]``, ``[gate |
      up]`` (the output of a ``jm.concatenate([w_gate, w_up])`` projection),
      and ``x' = dtype(silu(gate) up)``, ``silu(g) = g / (1 + exp(-g))``, in
      float32.

    Without a prologue ``x' = x``; with an act-order weight the prologue runs
    in ``x``'s own column order. Each result equals the unfused composition
    (``jax_marlin.fusion`` states it in ``jax.numpy``) up to the float32
    rounding of the sum of squares and of SwiGLU's ``exp`` and division (the
    decode kernel uses the GPU's fast ones: a few float32 ulps). Why: a
    decode step spends about a fifth of its time in XLA's small elementwise
    kernels between the projections; on Hopper at m <= 8 the decode kernel
    runs the prologue as it loads ``x`` and adds the residual as it stores
    ``y``, one kernel instead of three. Elsewhere (m > 8, act-order with a
    prologue) the fusions lower to ``jax.numpy`` ops around the plain call,
    which XLA fuses with its neighbours (``jax_marlin.primitive``, measured
    there).

    Args:
      x: ``[..., k]`` float16 or bfloat16 activations, the dtype of the
        weight's scales (``w.dtype``); ``[..., 2 k]`` with ``swiglu``.
      w: a :class:`MarlinWeight` for a ``[k, n]`` weight.
      bias: optional ``[n]`` in ``x.dtype``.
      residual: optional ``[..., n]`` (the result's shape) in ``x.dtype``.
      rms_norm_weight: optional ``[k]`` in ``x.dtype``; not with ``swiglu``.
      rms_norm_eps: the RMSNorm's epsilon (a Python float, ``>= 0``).
      swiglu: whether ``x`` is ``[gate | up]`` and the call multiplies
        ``silu(gate) up``.

    Returns:
      ``[..., n]`` in ``x.dtype``.

    Differentiable with respect to ``x`` (without a prologue linear: the
    tangent is ``jm.matmul(x_dot, w)``, the cotangent ``dy @ W^T``; with one,
    the prologue's derivative, from its jnp statement, times ``W``), ``bias``,
    ``residual`` and ``rms_norm_weight``, under ``jit``, ``vmap`` and
    sharding, forward and reverse mode. The weight is frozen: a derivative
    with respect to its ``qweight`` or ``scales`` raises ``TypeError``
    (``jax.lax.stop_gradient`` it, or close over it).

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
    return _matmul(x, w, bias, residual=residual, rms_norm_weight=rms_norm_weight,
                   rms_norm_eps=rms_norm_eps, swiglu=swiglu, poison_output=False)


def _matmul(x, w: MarlinWeight, bias=None, *, residual=None, rms_norm_weight=None,
            rms_norm_eps: float = 1e-6, swiglu: bool = False,
            poison_output: bool) -> jax.Array:
    """:func:`matmul`, with ``poison_output`` for tests (``y`` starts as NaN)."""
    x = jnp.asarray(x)
    bias, residual, rms_norm_weight = (None if a is None else jnp.asarray(a)
                                       for a in (bias, residual, rms_norm_weight))
    norm_eps = _check_arguments(x, w, bias, residual, rms_norm_weight, rms_norm_eps, swiglu)
    return _bind(x, w, bias, residual, rms_norm_weight, norm_eps, bool(swiglu),
                 bool(poison_output))


def check_marlin_weight(w, name: str) -> None:
    """Raises unless ``w`` (the argument ``name``) is a consistent :class:`MarlinWeight`
    with int32 ``qweight``."""
    if not isinstance(w, MarlinWeight):
        raise TypeError(f"{name} must be a jax_marlin.MarlinWeight (from jm.quantize or "
                        f"jm.pack), got {type(w).__name__}")
    _check_weight(w)
    if w.qweight.dtype != jnp.int32:  # the kernel's abstract eval sees it only when lowered
        raise TypeError(f"qweight.dtype is {w.qweight.dtype}, expected int32 (8 nibbles a word)")


def checked_norm_eps(rms_norm_eps) -> float:
    """``rms_norm_eps`` as a float: static (an attribute of the kernel call, not an
    operand) and non-negative."""
    if isinstance(rms_norm_eps, Tracer) or np.ndim(rms_norm_eps) != 0:
        raise TypeError(f"rms_norm_eps must be a Python float, got {type(rms_norm_eps).__name__}")
    norm_eps = float(rms_norm_eps)
    if not norm_eps >= 0:
        raise ValueError(f"rms_norm_eps = {norm_eps} must be a non-negative number")
    return norm_eps


def _check_arguments(x, w, bias, residual, rms_norm_weight, rms_norm_eps, swiglu) -> float:
    """The user's arguments, in the logical sizes ``[k, n]`` they were given in; returns
    ``rms_norm_eps`` as a float."""
    check_marlin_weight(w, "w")
    if not isinstance(swiglu, (bool, np.bool_)):
        raise TypeError(f"swiglu must be a bool, got {type(swiglu).__name__}")
    norm_eps = checked_norm_eps(rms_norm_eps)
    shapes.check_dtypes(x.dtype, w.scales.dtype, None if bias is None else bias.dtype)
    shapes.check_fusion_dtypes(x.dtype, residual=None if residual is None else residual.dtype,
                               rms_norm_weight=None if rms_norm_weight is None
                               else rms_norm_weight.dtype)
    if x.ndim < 1:
        raise ValueError("x must have at least one dimension, [..., k]")
    if swiglu and x.shape[-1] != 2 * w.k:
        raise ValueError(f"x.shape[-1] = {x.shape[-1]}, expected 2 k = {2 * w.k}: with "
                         f"swiglu=True x is [gate | up], k = {w.k} columns each (x has shape "
                         f"{x.shape}, the weight [k, n] = [{w.k}, {w.n}])")
    if not swiglu and x.shape[-1] != w.k:
        raise ValueError(f"x.shape[-1] = {x.shape[-1]} does not match the weight's k = {w.k} "
                         f"(x has shape {x.shape}, the weight [k, n] = [{w.k}, {w.n}])")
    if bias is not None and bias.shape != (w.n,):
        raise ValueError(f"bias.shape = {bias.shape}, expected ({w.n},): one value per output "
                         f"column of the weight [k, n] = [{w.k}, {w.n}]")
    y_shape = x.shape[:-1] + (w.n,)
    if residual is not None and residual.shape != y_shape:
        raise ValueError(f"residual.shape = {residual.shape}, expected the result's shape "
                         f"{y_shape}: x's leading dimensions {x.shape[:-1]} and the weight's "
                         f"n = {w.n}")
    if rms_norm_weight is not None and swiglu:
        raise ValueError("rms_norm_weight and swiglu cannot both be given: a call runs one "
                         "prologue (RMSNorm of x, or SwiGLU of x = [gate | up])")
    if rms_norm_weight is not None and rms_norm_weight.shape != (w.k,):
        raise ValueError(f"rms_norm_weight.shape = {rms_norm_weight.shape}, expected "
                         f"({w.k},): one value per input feature, the weight's k (the weight "
                         f"[k, n] = [{w.k}, {w.n}])")
    return norm_eps


# --- the op: one primitive with its rules ----------------------------------------------
#
# jm.matmul is a primitive of its own, so that its derivative rules sit above
# the custom_partitioning op (which has none): the JVP of the plain product is
# linear in x (the tangent goes through the same op), a prologue's tangent is
# its jnp derivative through the plain op, the transpose multiplies the
# cotangent by W^T, and the batching rule folds a batch of x into m. Its
# lowering is the padded, partitioned kernel call below. The weight travels as
# its pytree leaves plus the treedef, so fields added to MarlinWeight travel
# with it.

matmul_p = Primitive("jax_marlin_matmul")
"""Operands ``(x [..., k] ([..., 2 k] with swiglu), *leaves of the MarlinWeight,
bias [n] or [0], residual [..., n] or [0], norm_weight [k] or [0])``; params
``weight_tree`` (the weight's treedef: ``k``, ``n``, ``group_size``),
``poison_output``, ``norm_eps`` and ``swiglu``. Result ``[..., n]`` in ``x``'s
dtype, logical sizes."""

# The operands after the weight's leaves: bias, residual, norm_weight.
_FUSED = 3


def _bind(x, w: MarlinWeight, bias, residual, norm_weight, norm_eps: float, swiglu: bool,
          poison_output: bool) -> jax.Array:
    leaves, weight_tree = jax.tree.flatten(w)
    # "none": a [0] operand, as the kernel takes it.
    bias, residual, norm_weight = (jnp.zeros((0,), x.dtype) if a is None else a
                                   for a in (bias, residual, norm_weight))
    return matmul_p.bind(x, *leaves, bias, residual, norm_weight, weight_tree=weight_tree,
                         poison_output=poison_output, norm_eps=norm_eps, swiglu=swiglu)


def _plain(weight_tree, poison_output) -> dict:
    """The params of the plain product ``x W``: no prologue."""
    return dict(weight_tree=weight_tree, poison_output=poison_output, norm_eps=0.0, swiglu=False)


def _abstract_eval(x, *rest, weight_tree, poison_output, norm_eps, swiglu):
    del poison_output, norm_eps, swiglu
    w = jax.tree.unflatten(weight_tree, rest[:-_FUSED])
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


def _padded_matmul(*operands, weight_tree, poison_output: bool, norm_eps: float,
                   swiglu: bool) -> jax.Array:
    """Pads ``x [..., k]``, ``bias [n]``, ``residual [..., n]`` and ``norm_weight [k]`` to the
    weight's padded shape, drops padded columns."""
    x, *leaves, bias, residual, norm_weight = operands
    w = jax.tree.unflatten(weight_tree, leaves)
    if w.k_pad > w.k:
        # Zero activations meet the zero rows of the padded weight; they add
        # nothing to RMSNorm's sum of squares (its mean divides by the logical
        # k), and SwiGLU's silu(0) 0 is 0: each of gate and up is padded.
        halves = (2,) if swiglu else ()
        x = x.reshape(x.shape[:-1] + halves + (w.k,))
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, w.k_pad - w.k)])
        x = x.reshape(x.shape[:-1 - len(halves)] + (x.shape[-1] * (1 + swiglu),))
        if norm_weight.shape != (0,):
            norm_weight = jnp.pad(norm_weight, (0, w.k_pad - w.k))
    if w.n_pad > w.n:
        if bias.shape != (0,):
            bias = jnp.pad(bias, (0, w.n_pad - w.n))
        if residual.shape != (0,):
            residual = jnp.pad(residual, [(0, 0)] * (residual.ndim - 1) + [(0, w.n_pad - w.n)])
    zeros = jnp.zeros((0, 0), jnp.int32) if w.zeros is None else w.zeros  # [0, 0]: none
    perm = jnp.zeros((0,), jnp.int32) if w.perm is None else _padded_perm(w)  # [0]: none
    y = partitioning.matmul(x, w.qweight, w.scales, zeros, perm, bias, residual, norm_weight,
                            w.k_pad, w.n_pad, w.group_size, poison_output, norm_eps, w.k, swiglu)
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
_impl = jax.jit(_padded_matmul,
                static_argnames=("weight_tree", "poison_output", "norm_eps", "swiglu"))


# --- autodiff --------------------------------------------------------------------------


def _is_zero(tangent) -> bool:
    return type(tangent) is ad.Zero or tangent.dtype == jax.dtypes.float0


def _jvp(primals, tangents, *, weight_tree, poison_output, norm_eps, swiglu):
    # y = dtype(dtype(x' W + bias) + residual): x' W is linear in x' and W is
    # frozen, so the tangent is x'_dot W (the plain op, linear in x, which
    # reverse mode transposes) plus the bias and residual tangents, x'_dot
    # being the prologue's jnp derivative (fusion.py) along x and norm_weight.
    x, *leaves, bias, residual, norm_weight = primals
    x_dot, *leaf_dots, bias_dot, residual_dot, norm_dot = tangents
    if not all(_is_zero(t) for t in leaf_dots):
        raise TypeError(
            "jm.matmul has no derivative with respect to the quantized weight (its qweight "
            "and scales): 4-bit weights are frozen. Differentiate with respect to x or the "
            "bias only: wrap the weight in jax.lax.stop_gradient, close over it instead of "
            "passing it as a differentiated argument, or, in Flax NNX, keep it in a "
            "QuantizedWeight (an nnx.Variable that is not an nnx.Param, as MarlinLinear "
            "does) and differentiate with respect to nnx.Param")
    y = matmul_p.bind(*primals, weight_tree=weight_tree, poison_output=poison_output,
                      norm_eps=norm_eps, swiglu=swiglu)
    has_norm = norm_weight.shape != (0,)
    x_prime_dot = None
    if has_norm or swiglu:
        if not (_is_zero(x_dot) and (not has_norm or _is_zero(norm_dot))):
            size = jax.tree.unflatten(weight_tree, leaves).k

            def prologue(x, norm_weight):
                return fusion.prologue(x, norm_weight if has_norm else None, norm_eps, size,
                                       use_swiglu=swiglu)

            _, x_prime_dot = jax.jvp(prologue, (x, norm_weight),
                                     (ad.instantiate_zeros(x_dot), ad.instantiate_zeros(norm_dot)))
    elif not _is_zero(x_dot):
        x_prime_dot = x_dot
    y_dot = None
    if x_prime_dot is not None:
        empty = jnp.zeros((0,), x.dtype)
        y_dot = matmul_p.bind(x_prime_dot, *leaves, empty, empty, empty,
                              **_plain(weight_tree, poison_output))
    for operand, tangent in ((bias, bias_dot), (residual, residual_dot)):
        if operand.shape != (0,) and not _is_zero(tangent):
            t = jnp.broadcast_to(tangent.astype(y.dtype), y.shape)
            y_dot = t if y_dot is None else y_dot + t
    return y, ad.Zero.from_primal_value(y) if y_dot is None else y_dot


def _transpose(ct, x, *rest, weight_tree, poison_output, norm_eps, swiglu):
    # Called on the linear part only: the JVP's x tangent, or a user's
    # jax.linear_transpose of x -> x W. The weight, bias and residual are
    # known there.
    del poison_output, norm_eps
    if any(ad.is_undefined_primal(a) for a in rest):
        raise TypeError("jm.matmul is linear in x only; it cannot be transposed with respect "
                        "to the weight, the bias, the residual or the RMSNorm weight")
    if swiglu or rest[-1].shape != (0,):
        raise TypeError("jm.matmul with a prologue (rms_norm_weight or swiglu) is not linear "
                        "in x, so it has no transpose; differentiate it with jax.grad or "
                        "jax.vjp, which transpose its linearization")
    if type(ct) is ad.Zero:
        return [None] * (1 + len(rest))
    w = jax.tree.unflatten(weight_tree, rest[:-_FUSED])
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


def _batch(operands, dims, **params):
    """A batch of ``x`` and ``residual`` (either or both) folds into their leading
    dimensions (the kernel's m; each row's prologue is its own); batched weights, biases
    or RMSNorm weights run one call per element."""
    x, *leaves, bias, residual, norm_weight = operands
    x_dim, *leaf_dims, bias_dim, residual_dim, norm_dim = dims
    size = next(a.shape[d] for a, d in zip(operands, dims) if d is not None)

    def front(a, d):
        return jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)

    if all(d is None for d in (*leaf_dims, bias_dim, norm_dim)):
        if residual.shape != (0,) or residual_dim is not None:
            residual = front(residual, residual_dim)
        return matmul_p.bind(front(x, x_dim), *leaves, bias, residual, norm_weight,
                             **params), 0
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
