"""A 2-layer MLP with 4-bit weights, tensor parallel (Megatron-style) over a mesh.

    python examples/tensor_parallel_mlp.py

``up [d, f]`` is split on its output columns (column parallel), ``down [f, d]``
on its input rows (row parallel), so the hidden activation ``[m, f]`` stays
split across the "model" axis and the only collective is one all-reduce of
``down``'s partial products. The batch is split across "data".

Runs on whatever devices exist. On CPU, unless XLA_FLAGS is already set, it
asks for 8 fake host devices so that the mesh is 2 (data) x 4 (model).
"""

import os

if "XLA_FLAGS" not in os.environ:
    # Before jax starts its backends. Only the CPU backend reads it: on a GPU
    # machine jax.devices() are still the GPUs.
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_marlin as jm
from jax_marlin.partitioning import shard_weight

d, f, m = 1024, 4096, 48  # model width, hidden width, tokens

devices = jax.devices()
model = next(s for s in (4, 2, 1) if len(devices) % s == 0)  # f / model must stay a multiple of 128
data = len(devices) // model
mesh = jax.make_mesh((data, model), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
print(f"{len(devices)} {devices[0].platform} devices -> mesh {dict(mesh.shape)}")

key_up, key_down, key_x = jax.random.split(jax.random.key(0), 3)
up = jm.quantize(jax.random.normal(key_up, (d, f), jnp.float32) / np.sqrt(d), group_size=128)
down = jm.quantize(jax.random.normal(key_down, (f, d), jnp.float32) / np.sqrt(f), group_size=128)
x = jax.random.normal(key_x, (m, d), jnp.float16)


def mlp(x, up, down):
    """``x [m, d] -> gelu(x @ up) [m, f] -> [m, d]``, float16."""
    return jm.matmul(jax.nn.gelu(jm.matmul(x, up)), down)


# Unsharded result first (one device), then the same weights placed on the mesh.
expected = jax.jit(mlp)(x, up, down)

up_tp = shard_weight(up, mesh, P(None, "model"))    # column parallel: each device has f / model columns
down_tp = shard_weight(down, mesh, P("model", None))  # row parallel: each device has f / model rows
x_dp = jax.device_put(x, NamedSharding(mesh, P("data")))

for name, a in [("x", x_dp), ("up.qweight", up_tp.qweight), ("up.scales", up_tp.scales),
                ("down.qweight", down_tp.qweight), ("down.scales", down_tp.scales)]:
    local = a.addressable_shards[0].data.shape
    print(f"  {name:13s} {str(a.dtype):8s}{str(list(a.shape)):14s} {str(a.sharding.spec):26s}"
          f" per device {list(local)}")

sharded_mlp = jax.jit(mlp)
hlo = sharded_mlp.lower(x_dp, up_tp, down_tp).compile().as_text()
counts = {c: len(re.findall(rf" {c}(?:-start)?\(", hlo))
          for c in ("all-reduce", "all-gather", "reduce-scatter")}
print("collectives in the compiled program:", counts)
for line in re.findall(r"= (.+?) all-reduce(?:-start)?\(", hlo):
    print(f"  all-reduce of {line}")

y = sharded_mlp(x_dp, up_tp, down_tp)
print(f"  {'y':13s} {str(y.dtype):8s}{str(list(y.shape)):14s} {str(y.sharding.spec)}")
a, b = np.asarray(y, np.float64), np.asarray(expected, np.float64)
print(f"sharded vs unsharded, relative error ||y - y_unsharded|| / ||y_unsharded|| = {np.linalg.norm(a - b) / np.linalg.norm(b):.1e}"
      f"  (float16 partial sums of the row-parallel layer; float16 unit roundoff {2.0**-11:.1e})")
