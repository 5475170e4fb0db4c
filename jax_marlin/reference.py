"""Pure ``jax.numpy`` reference for :func:`jax_marlin.matmul`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_marlin.packing import MarlinWeight, dequantize

__all__ = ["matmul"]


def matmul(x, w: MarlinWeight, bias=None) -> jax.Array:
    """``x [..., k] @ dequantize(w) [k, n] + bias [n]`` in float32, rounded to ``x.dtype``."""
    x = jnp.asarray(x)
    y = jnp.matmul(x.astype(jnp.float32), dequantize(w, jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
    if bias is not None:
        y = y + jnp.asarray(bias).astype(jnp.float32)
    return y.astype(x.dtype)
