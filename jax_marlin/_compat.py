"""The semi-internal JAX names jax_marlin uses, in one place.

Everything else imports public JAX (``jax``, ``jax.numpy``, ``jax.ffi``,
``jax.custom_batching``, ``jax.experimental.custom_partitioning``); a JAX
upgrade that moves one of these names touches this file only.
"""

from __future__ import annotations

from jax.core import ShapedArray, Tracer
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax.interpreters.mlir import ir

__all__ = ["Primitive", "ShapedArray", "Tracer", "ir", "mlir"]
