"""The semi-internal JAX names jax_marlin uses, and its one private registration, in one place.

Everything else imports public JAX (``jax``, ``jax.numpy``, ``jax.ffi``,
``jax.experimental.custom_partitioning``); a JAX upgrade that moves one of
these names touches this file only.
"""

from __future__ import annotations

from jax.core import ShapedArray, Tracer
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.interpreters.mlir import ir


def requires_devices_during_lowering(primitive) -> None:
    """Marks ``primitive`` as lowered with the program's devices known.

    A primitive whose lowering contains a ``custom_partitioning`` op needs
    them, as ``custom_partitioning`` itself does; JAX finds that op only in
    the jaxprs it sees, not inside another primitive's lowering. JAX has no
    public registration for this.
    """
    from jax._src import dispatch
    dispatch.prim_requires_devices_during_lowering.add(primitive)


__all__ = ["Primitive", "ShapedArray", "Tracer", "ad", "batching", "ir", "mlir",
           "requires_devices_during_lowering"]
