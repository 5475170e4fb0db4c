"""Pure ``jax.numpy`` reference for :func:`jax_marlin.matmul`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_marlin import fusion
from jax_marlin.packing import MarlinWeight, dequantize

__all__ = ["matmul"]


def matmul(x, w: MarlinWeight, bias=None, *, residual=None, rms_norm_weight=None,
           rms_norm_eps: float = 1e-6, swiglu: bool = False) -> jax.Array:
    """``x' [..., k] @ dequantize(w) [k, n] + bias [n]`` in float32, rounded to ``x.dtype``,
    then ``+ residual [..., n]`` in float32, rounded again.

    ``x'`` is ``x``, its RMSNorm with ``rms_norm_weight [k]`` or, with ``swiglu``,
    ``silu(gate) up`` of ``x [..., 2 k] = [gate | up]``, computed in float32 and
    rounded to ``x.dtype`` (``jax_marlin.fusion``), as :func:`jax_marlin.matmul`
    states.
    """
    x = jnp.asarray(x)
    if rms_norm_weight is not None:
        rms_norm_weight = jnp.asarray(rms_norm_weight)
    x = fusion.prologue(x, rms_norm_weight, rms_norm_eps, w.k, use_swiglu=swiglu)
    y = jnp.matmul(x.astype(jnp.float32), dequantize(w, jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
    if bias is not None:
        y = y + jnp.asarray(bias).astype(jnp.float32)
    y = y.astype(x.dtype)
    return y if residual is None else fusion.add_residual(y, jnp.asarray(residual))
