"""What ``jm.matmul`` fuses around its product, in ``jax.numpy``.

The one jnp statement of the contract the kernels implement
(ffi/ffi_common.h): the RMSNorm and SwiGLU prologues, computed in float32 and
rounded to ``x``'s dtype (the ``x'`` the kernel multiplies), and the residual
epilogue, added to the rounded product and rounded again. The reference
(``jax_marlin.reference``) is built from it, ``jm.matmul``'s JVP
differentiates it, and row-parallel sharding (``jax_marlin.partitioning``),
where a shard's kernel sees only part of each row, runs it per shard.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["add_residual", "prologue", "rms_norm", "swiglu"]


def rms_norm(x, weight, eps: float, size: int, axis_name=None) -> jax.Array:
    """``x [..., k]``, ``weight [k]`` -> ``dtype(x r weight) [..., k]`` in ``x.dtype``.

    ``r = 1 / sqrt(sum_j x_j^2 / size + eps)`` per row, everything in float32.
    ``size`` is the logical ``k`` the mean divides by: columns of ``x`` past it
    (padding) are zero and add nothing to the sum. ``axis_name``: the mesh
    axes that shard ``x``'s ``k`` (inside a shard_map or a partitioned
    computation); the per-shard sums of squares are added over them.
    """
    xf = x.astype(jnp.float32)
    sum_squares = jnp.sum(xf * xf, axis=-1, keepdims=True)
    if axis_name:
        sum_squares = jax.lax.psum(sum_squares, axis_name)
    r = 1 / jnp.sqrt(sum_squares / size + eps)
    # (x r) w, in the kernels' order.
    return (xf * r * weight.astype(jnp.float32)).astype(x.dtype)


def silu_gate(gate, up) -> jax.Array:
    """``gate [..., k]``, ``up [..., k]`` -> ``dtype(silu(gate) up)``, ``silu(g) = g / (1 +
    exp(-g))`` in float32 (the kernels' formula; ``jax.nn.silu`` rounds differently)."""
    g = gate.astype(jnp.float32)
    return (g / (1 + jnp.exp(-g)) * up.astype(jnp.float32)).astype(up.dtype)


def swiglu(x) -> jax.Array:
    """``x [..., 2 k]`` holding ``[gate | up]`` -> ``dtype(silu(gate) up) [..., k]``."""
    k = x.shape[-1] // 2
    return silu_gate(x[..., :k], x[..., k:])


def prologue(x, norm_weight=None, eps: float = 0.0, size: int = 0, *,
             use_swiglu: bool = False) -> jax.Array:
    """The ``x'`` a call multiplies: ``rms_norm(x, norm_weight, eps, size)`` with a
    ``norm_weight [k]``, ``swiglu(x)`` with ``use_swiglu`` (``x [..., 2 k]``), else ``x``."""
    if norm_weight is not None:
        return rms_norm(x, norm_weight, eps, size)
    return swiglu(x) if use_swiglu else x


def add_residual(y, residual) -> jax.Array:
    """``dtype(y + residual)``, added in float32: ``y [..., n]`` already rounded, as
    ``jm.matmul(...) + residual`` in ``y``'s dtype."""
    return (y.astype(jnp.float32) + residual.astype(jnp.float32)).astype(y.dtype)
