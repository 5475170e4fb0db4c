"""One fp16 g128 ``jm.matmul`` of a benchmark layer, for a profiler.

    ncu --clock-control none -k regex:Marlin python benchmarks/profile_case.py 70b.qkv 64

Runs the matmul twice (the first call compiles; profile the launches with
``--launch-skip``/``--launch-count`` or read the last one). Works with older
jax_marlin versions too (fp16 weights are quantized without ``dtype=``), so
that a seed build can be profiled the same way (gpu_session.sh, ``profile``).
"""

import sys

import jax
import jax.numpy as jnp

import jax_marlin as jm
from bench_matmul import LAYERS


def main(layer: str, m: int) -> None:
    k, n = LAYERS[layer]
    w = jm.quantize(jax.random.normal(jax.random.key(0), (k, n), jnp.float32), group_size=128)
    x = jax.random.normal(jax.random.key(1), (m, k), jnp.float32).astype(jnp.float16)
    matmul = jax.jit(jm.matmul)
    for _ in range(2):
        y = jax.block_until_ready(matmul(x, w))
    print(f"{layer} m={m}: y {y.shape} {y.dtype}, finite: {bool(jnp.isfinite(y).all())}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
