"""``jm.post_attention``: what a pre-norm decoder block does after attention, in one op.

::

    h = x + a @ W_o
    g = rms_norm(h) @ W_gate_up                  # [gate | up]
    y = h + swiglu(g) @ W_down

It is exactly the three fused ``jm.matmul`` calls a block would make
(``o`` with the residual ``x``, ``gate_up`` with the RMSNorm prologue,
``down`` with SwiGLU and the residual ``h``), which is how it runs on the CPU
and wherever the fused CUDA call does not apply. On CUDA at decode batch sizes
the three can run as one custom call (``ffi/post_attention.cc``; opt-in,
``single_call_enabled``): XLA records each
custom call into its command buffer as a child graph that starts when the one
before it has finished, so between separate calls a kernel cannot overlap the
previous one's tail; inside one call the kernels keep their programmatic
dependent launch, and ``gate_up`` and ``down`` start streaming their weights
before the previous kernel finishes (safe there: the only kernels before them
are the call's own, which write activations only). The result is bit-identical
to the three calls. Measured (H100, 8B decode step): no faster than the three
calls at m = 1-2 and 2-8% slower at m = 4-8, where the kernels' programmatic
edges cost more than they save (benchmarks/NOTES.md, 2026-12-07).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from jax_marlin import _ffi, ops, shapes
from jax_marlin._compat import (Primitive, ad, batching, lowers_per_device, mlir,
                                requires_devices_during_lowering)
from jax_marlin.packing import MarlinWeight
from jax_marlin.primitive import FUSED_MAX_M

__all__ = ["post_attention"]


def post_attention(a, x, o: MarlinWeight, gate_up: MarlinWeight, down: MarlinWeight,
                   rms_norm_weight, *, rms_norm_eps: float = 1e-6) -> jax.Array:
    """The residual stream after a pre-norm block's attention output ``a``.

    ``h = x + a W_o``, then ``h + swiglu(rms_norm(h) W_gate_up) W_down``, each
    step rounded to ``x.dtype`` as ``jm.matmul``'s fusions round it; equal,
    bit for bit, to::

        h = jm.matmul(a, o, residual=x)
        g = jm.matmul(h, gate_up, rms_norm_weight=rms_norm_weight, rms_norm_eps=rms_norm_eps)
        y = jm.matmul(g, down, swiglu=True, residual=h)

    Why a single op: on Hopper at ``m <= 8`` rows it can run as one custom
    call whose three kernels overlap each other's ramp and tail (see the
    module docstring; only with ``JAX_MARLIN_CHAIN_CALL=1``: measured, it is no
    faster than the three calls); elsewhere (CPU, more rows, act-order or padded
    weights, inputs sharded over several devices) it runs as those three
    calls.

    Args:
      a: ``[..., k_o]`` float16 or bfloat16, the attention output (heads
        concatenated), in the weights' dtype.
      x: ``[..., hidden]``, the residual stream before this block, ``a``'s
        leading dimensions.
      o: :class:`MarlinWeight` ``[k_o, hidden]``.
      gate_up: :class:`MarlinWeight` ``[hidden, 2 f]``, gate columns then up
        columns (``jm.concatenate([w_gate, w_up])``).
      down: :class:`MarlinWeight` ``[f, hidden]``.
      rms_norm_weight: ``[hidden]``, the RMSNorm's scale before the MLP.
      rms_norm_eps: its epsilon (a Python float, ``>= 0``).

    Returns:
      ``[..., hidden]`` in ``x.dtype``.

    Differentiable with respect to ``a``, ``x`` and ``rms_norm_weight``
    (through the three calls' derivatives); works under ``jit`` and
    ``vmap``. The weights are frozen, as in ``jm.matmul``.
    """
    return _post_attention(a, x, o, gate_up, down, rms_norm_weight, rms_norm_eps=rms_norm_eps,
                           poison_output=False)


def _post_attention(a, x, o, gate_up, down, rms_norm_weight, *, rms_norm_eps,
                    poison_output: bool) -> jax.Array:
    """:func:`post_attention`, with ``poison_output`` for tests (outputs start as NaN)."""
    a, x, rms_norm_weight = jnp.asarray(a), jnp.asarray(x), jnp.asarray(rms_norm_weight)
    norm_eps = _check_arguments(a, x, o, gate_up, down, rms_norm_weight, rms_norm_eps)
    weights = (o, gate_up, down)
    leaves, trees = zip(*(jax.tree.flatten(w) for w in weights))
    return post_attention_p.bind(a, x, *(leaf for ls in leaves for leaf in ls), rms_norm_weight,
                                 trees=tuple(trees), norm_eps=norm_eps,
                                 poison_output=bool(poison_output))


def _check_arguments(a, x, o, gate_up, down, norm_weight, norm_eps) -> float:
    """The user's arguments, in logical sizes; returns ``norm_eps`` as a float."""
    for name, w in (("o", o), ("gate_up", gate_up), ("down", down)):
        ops.check_marlin_weight(w, name)
        shapes.check_dtypes(a.dtype, w.scales.dtype)
    norm_eps = ops.checked_norm_eps(norm_eps)
    for name, dtype in (("x", x.dtype), ("rms_norm_weight", norm_weight.dtype)):
        if dtype != a.dtype:
            raise TypeError(f"{name}.dtype is {np.dtype(dtype).name} but a.dtype is "
                            f"{np.dtype(a.dtype).name}: a, x and rms_norm_weight must have the "
                            f"weights' dtype")
    if a.ndim < 1 or x.ndim < 1:
        raise ValueError("a and x must have at least one dimension: a [..., k_o], x [..., hidden]")
    if a.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"a.shape = {a.shape} and x.shape = {x.shape} must have the same "
                         f"leading dimensions (one row of each per token)")
    if a.shape[-1] != o.k:
        raise ValueError(f"a.shape[-1] = {a.shape[-1]} does not match o's k = {o.k} (the weight "
                         f"o [k, n] = [{o.k}, {o.n}])")
    hidden = o.n
    if x.shape[-1] != hidden:
        raise ValueError(f"x.shape[-1] = {x.shape[-1]} does not match o's n = {hidden}: the "
                         f"residual stream has o's output width")
    if gate_up.k != hidden:
        raise ValueError(f"gate_up's k = {gate_up.k} does not match hidden = {hidden} (o's n): "
                         f"gate_up [k, n] = [{gate_up.k}, {gate_up.n}]")
    if gate_up.n != 2 * down.k:
        raise ValueError(f"gate_up's n = {gate_up.n} is not 2 f with down's f = {down.k}: "
                         f"gate_up holds the gate and up columns, f each")
    if down.n != hidden:
        raise ValueError(f"down's n = {down.n} does not match hidden = {hidden} (o's n): "
                         f"down [k, n] = [{down.k}, {down.n}]")
    if norm_weight.shape != (hidden,):
        raise ValueError(f"rms_norm_weight.shape = {norm_weight.shape}, expected ({hidden},): "
                         f"one value per hidden feature")
    return norm_eps


# --- the primitive ---------------------------------------------------------------------

post_attention_p = Primitive("jax_marlin_post_attention")
"""Operands ``(a [..., k_o], x [..., hidden], *leaves of o, *leaves of gate_up, *leaves of
down, norm_weight [hidden])``; params ``trees`` (the three weights' treedefs),
``norm_eps`` and ``poison_output``. Result ``[..., hidden]`` in ``x``'s dtype."""


def _split(operands, trees):
    """``(a, x, o, gate_up, down, norm_weight)`` from the primitive's flat operands."""
    a, x, *rest = operands
    weights = []
    for tree in trees:
        weights.append(jax.tree.unflatten(tree, rest[:tree.num_leaves]))
        rest = rest[tree.num_leaves:]
    (norm_weight,) = rest
    return (a, x, *weights, norm_weight)


def _composed(*operands, trees, norm_eps, poison_output):
    """The three ``jm.matmul`` calls: the op's definition and its general lowering."""
    a, x, o, gate_up, down, norm_weight = _split(operands, trees)
    h = ops._matmul(a, o, residual=x, poison_output=poison_output)
    g = ops._matmul(h, gate_up, rms_norm_weight=norm_weight, rms_norm_eps=norm_eps,
                    poison_output=poison_output)
    return ops._matmul(g, down, swiglu=True, residual=h, poison_output=poison_output)


def _abstract_eval(a, x, *rest, trees, norm_eps, poison_output):
    del a, rest, trees, norm_eps, poison_output
    return x


def _fused_call(*operands, trees, norm_eps, poison_output, target):
    """The single custom call (``ffi/post_attention.cc``); only for the cases
    :func:`_fuses` accepts."""
    a, x, o, gate_up, down, norm_weight = _split(operands, trees)
    m = int(np.prod(a.shape[:-1], dtype=np.int64))
    hidden, f2 = o.n, gate_up.n
    # Each projection's workspace and scratch region, in turn (x_copy: the
    # prologue's x' where a kernel other than the decode kernel runs it).
    workspace = scratch = 0
    for w, x_copy in ((o, False), (gate_up, True), (down, True)):
        workspace += _ffi.rules.chained_size(shapes.workspace_size(m, w.n))
        scratch += _ffi.rules.chained_size(shapes.reduce_scratch_size(m, w.n, w.k, x_copy))
    out_types = [jax.ShapeDtypeStruct(x.shape, x.dtype),
                 jax.ShapeDtypeStruct((m * hidden,), x.dtype),
                 jax.ShapeDtypeStruct((m * f2,), x.dtype),
                 jax.ShapeDtypeStruct((workspace,), jnp.int32),
                 jax.ShapeDtypeStruct((scratch,), jnp.float32)]

    def zeros(w):
        return jnp.zeros((0, 0), jnp.int32) if w.zeros is None else w.zeros

    y, *_ = jax.ffi.ffi_call(target, out_types)(
        a, x, o.qweight, o.scales, zeros(o), gate_up.qweight, gate_up.scales, zeros(gate_up),
        down.qweight, down.scales, zeros(down), norm_weight,
        o_group_size=np.int64(o.group_size), gate_up_group_size=np.int64(gate_up.group_size),
        down_group_size=np.int64(down.group_size), norm_eps=np.float32(norm_eps),
        poison_output=bool(poison_output))
    return y


def single_call_enabled() -> bool:
    """Whether ``JAX_MARLIN_CHAIN_CALL=1`` is set (read when the op is lowered).

    The single custom call is opt-in: its GPU tests pass and it is bit-identical
    to the three calls, but in the 8B decode step on an H100 it was within 1.3%
    of them at m = 1-2 and 2-8% slower at m = 4-8 (benchmarks/NOTES.md,
    2026-12-07). Without the setting the op lowers to the three calls
    everywhere, which is the same function.
    """
    return os.environ.get("JAX_MARLIN_CHAIN_CALL") == "1"


def _fuses(ctx, trees) -> bool:
    """Whether a CUDA lowering takes the single call: enabled, decode batch sizes
    (``m <= 8``, where the decode kernel runs the fusions), weights in group order and
    unpadded, lowered for one device (or per shard in ``shard_map``)."""
    if not single_call_enabled() or not _ffi.HAS_CUDA or not lowers_per_device(ctx):
        return False
    m = int(np.prod(ctx.avals_in[0].shape[:-1], dtype=np.int64))
    if not 1 <= m <= FUSED_MAX_M:
        return False
    # The weights' static parts: unflatten the trees with their avals.
    avals = ctx.avals_in[2:-1]
    for tree in trees:
        w = jax.tree.unflatten(tree, avals[:tree.num_leaves])
        avals = avals[tree.num_leaves:]
        if w.perm is not None or w.padded_shape != (w.k, w.n):
            return False
    return True


def _cuda_lowering(ctx, *operands, trees, norm_eps, poison_output):
    params = dict(trees=trees, norm_eps=norm_eps, poison_output=poison_output)
    if _fuses(ctx, trees):
        stream = _ffi.cuda_target() == _ffi.MATMUL_STREAM_TARGET
        target = "jax_marlin_post_attention" + ("_stream" if stream else "")
        return mlir.lower_fun(functools.partial(_fused_call, target=target),
                              multiple_results=False)(ctx, *operands, **params)
    return mlir.lower_fun(_composed, multiple_results=False)(ctx, *operands, **params)


# --- autodiff and vmap -----------------------------------------------------------------


def _jvp(primals, tangents, *, trees, norm_eps, poison_output):
    # The derivative of the definition: the three calls' own rules (jm.matmul
    # raises for a weight's tangent). The weights are closed over, so their
    # symbolic zero tangents stay symbolic.
    a, x, *leaves, norm_weight = primals
    a_dot, x_dot, *leaf_dots, norm_dot = tangents
    if not all(ops._is_zero(t) for t in leaf_dots):
        raise TypeError("jm.post_attention has no derivative with respect to the quantized "
                        "weights: 4-bit weights are frozen (jax.lax.stop_gradient them, or "
                        "close over them)")

    def f(a, x, norm_weight):
        return _composed(a, x, *leaves, norm_weight, trees=trees, norm_eps=norm_eps,
                         poison_output=poison_output)

    return jax.jvp(f, (a, x, norm_weight), tuple(ad.instantiate_zeros(t)
                                                 for t in (a_dot, x_dot, norm_dot)))


def _batch(operands, dims, *, trees, norm_eps, poison_output):
    """A batch of ``a`` and ``x`` folds into their leading dimensions (each row is its
    own); batched weights or norm weights run one op per element."""
    params = dict(trees=trees, norm_eps=norm_eps, poison_output=poison_output)
    size = next(o.shape[d] for o, d in zip(operands, dims) if d is not None)

    def front(v, d):
        return jnp.broadcast_to(v, (size, *v.shape)) if d is None else jnp.moveaxis(v, d, 0)

    a, x, *rest = operands
    if all(d is None for d in dims[2:]):
        return post_attention_p.bind(front(a, dims[0]), front(x, dims[1]), *rest, **params), 0
    batched = [front(v, d) for v, d in zip(operands, dims)]
    return jax.lax.map(lambda v: post_attention_p.bind(*v, **params), batched), 0


@functools.partial(jax.jit, static_argnames=("trees", "norm_eps", "poison_output"))
def _impl(*operands, **params):
    # Eager binds run the primitive through jit, which lowers it (fused on a GPU).
    return post_attention_p.bind(*operands, **params)


post_attention_p.def_impl(_impl)
post_attention_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(post_attention_p, mlir.lower_fun(_composed, multiple_results=False),
                       cacheable=False)
mlir.register_lowering(post_attention_p, _cuda_lowering, platform="cuda", cacheable=False)
# Its composed lowering holds jm.matmul's custom_partitioning ops.
requires_devices_during_lowering(post_attention_p)
ad.primitive_jvps[post_attention_p] = _jvp
batching.primitive_batchers[post_attention_p] = _batch
