"""jax-marlin in one screen: quantize a layer, run it under jit, check it.

    python examples/quickstart.py

Runs on whatever jax.devices() offers (CPU, or a CUDA GPU with the CUDA build).
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_marlin as jm

k, n, m = 4096, 4096, 16
key_w, key_x = jax.random.split(jax.random.key(0))
weight = jax.random.normal(key_w, (k, n), jnp.float32) / np.sqrt(k)  # Flax layout: [in, out]
x = jax.random.normal(key_x, (m, k), jnp.float16)

w = jm.quantize(weight, group_size=128)  # 4-bit, one fp16 scale per 128 rows
print(w)
print(f"weight bytes: {weight.size * 2 / 2**20:.1f} MiB as float16 -> {w.nbytes / 2**20:.1f} MiB packed")

layer = jax.jit(jm.matmul)
y = layer(x, w)  # [m, n] float16, the Marlin kernel on GPU, its CPU twin elsewhere

y_ref = jm.reference.matmul(x, w)  # pure jnp, same quantized weights
y_float = (x.astype(jnp.float32) @ weight).astype(jnp.float16)  # the unquantized layer


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


print(f"device: {jax.devices()[0].device_kind}  (CUDA kernel built: {jm.HAS_CUDA})")
print("relative errors ||y - y_other|| / ||y_other||:")
print(f"  kernel vs jnp reference:        {rel(y, y_ref):.1e}  (same weights: float16 rounding apart at most)")
print(f"  kernel vs unquantized weights:  {rel(y, y_float):.1e}  (4-bit quantization error)")

# bfloat16 (scales and activations), another group size, a shape that is not
# a tile multiple (stored padded, logical shape kept) and a fused bias.
weight_odd = weight[:1000, :576].astype(jnp.bfloat16)
w_odd = jm.quantize(weight_odd, group_size=64)  # bf16 in, bf16 scales
bias = jax.random.normal(key_x, (576,), jnp.bfloat16)
y_odd = layer(x[:, :1000].astype(jnp.bfloat16), w_odd, bias)  # [m, 576] bfloat16
y_odd_ref = jm.reference.matmul(x[:, :1000].astype(jnp.bfloat16), w_odd, bias)
print(f"{w_odd.shape} stored as {w_odd.padded_shape}, {y_odd.dtype} out {y_odd.shape}: "
      f"kernel vs reference relative error {rel(y_odd, y_odd_ref):.1e}  (same weights: at most bfloat16 rounding, 2^-9 = 2.0e-03, apart)")

if jax.default_backend() == "gpu":
    w16 = weight.astype(jnp.float16)
    dense = jax.jit(lambda x, w: x @ w)
    for name, fn, arg in [("jax_marlin int4", layer, w), ("XLA float16", dense, w16)]:
        jax.block_until_ready(fn(x, arg))
        t0 = time.perf_counter()
        for _ in range(200):
            out = fn(x, arg)
        jax.block_until_ready(out)
        print(f"{name:16s} {(time.perf_counter() - t0) / 200 * 1e6:7.1f} us per call "
              f"(host-timed, weight may sit in L2; see benchmarks/ for the real numbers)")
