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


def lowers_per_device(ctx) -> bool:
    """Whether the lowering context ``ctx`` lowers code that one device runs on its own data.

    True for a program of one device, inside ``shard_map`` with every mesh
    axis manual (each device runs the body on its shard), and under ``pmap``;
    false where XLA's SPMD partitioner will split the program over several
    devices afterwards (a custom call without a partitioning rule would then
    have its operands gathered).
    """
    context = ctx.module_context.axis_context
    if hasattr(context, "num_devices"):  # ShardingContext: jit
        return context.num_devices == 1
    if hasattr(context, "manual_axes"):  # SPMDAxisContext: shard_map
        return set(context.manual_axes) == set(context.mesh.axis_names)
    return True  # ReplicaAxisContext: pmap


__all__ = ["Primitive", "ShapedArray", "Tracer", "ad", "batching", "ir", "lowers_per_device",
           "mlir", "requires_devices_during_lowering"]
