"""Runs jm.matmul on the GPU over every tile configuration and awkward batch
sizes, for compute-sanitizer (benchmarks/gpu_session.sh, stage 'sanitize')."""

import jax
import jax.numpy as jnp

import jax_marlin as jm

key = jax.random.key(0)
for k, n, group_size in [(1024, 1024, 128), (1024, 1152, 128), (1024, 1088, -1),
                         (1088, 1024, -1), (1088, 1152, -1), (4096, 1024, 128)]:
    w = jm.quantize(jax.random.normal(key, (k, n)), group_size=group_size)
    for m in [1, 17, 65, 1024 + 33]:  # small tiles, large tiles, partial blocks, par > 1
        x = jax.random.normal(key, (m, k), jnp.float16)
        y = jax.block_until_ready(jax.jit(jm.matmul)(x, w))
        print(k, n, group_size, m, bool(jnp.isfinite(y).all()), flush=True)
