"""Side-by-side GPU benchmark: jax_marlin against what a JAX user writes today.

Implementations, all jitted, all fed float16 activations ``x [m, k]``:

* ``jax_marlin``: ``jm.matmul(x, w)``, 4-bit weights in Marlin's layout
  (group size 128, and -1 = one scale per column);
* ``xla_fp16``: ``x @ w`` with float16 weights;
* ``xla_int4``: ``jnp.int4`` weights cast to float16, times their group-128
  scales, then ``x @ w`` (XLA fuses what it can).

Method: each implementation gets ``ROTATE`` distinct weight sets, applied one
after another inside one jitted call, so weights stream from HBM rather than
the 60 MB L2; the call is dispatched ``CALLS`` times back to back and the wall
time (after a block at the end) divided by ``CALLS * ROTATE``; that is the
device time per matmul once the GPU is saturated. Median and spread (max - min)
over ``REPEATS`` repeats, after warm-up. Every jax_marlin row carries its
relative error against ``jm.reference.matmul``, so a fast wrong kernel cannot
report. A device-to-device copy in the same process gives ``copy_tbps``.

    python benchmarks/bench_matmul.py --quick          # 3 layers x m in {1, 16, 64}
    python benchmarks/bench_matmul.py --out results.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np

import jax_marlin as jm

LAYERS = {
    "70b.qkv": (8192, 10240),
    "70b.o": (8192, 8192),
    "70b.gate_up": (8192, 57344),
    "70b.down": (28672, 8192),
    "8b.qkv": (4096, 6144),
    "8b.o": (4096, 4096),
    "8b.gate_up": (4096, 28672),
    "8b.down": (14336, 4096),
}
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
QUICK_LAYERS = ["70b.qkv", "70b.gate_up", "70b.down"]
QUICK_MS = [1, 16, 64]

ROTATE = 8
CALLS = 20
REPEATS = 5


def timeit(fn, *args) -> tuple[float, float]:
    """Median and spread of the per-matmul device time in microseconds."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        for _ in range(CALLS):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / (CALLS * ROTATE) * 1e6)
    return statistics.median(samples), max(samples) - min(samples)


def copy_tbps() -> float:
    """Device-to-device copy bandwidth, bytes read + written per second (TB/s).

    ROTATE distinct 1 GiB arrays, each read once and written once by an
    elementwise pass (distinct inputs, so XLA cannot fuse the passes into one
    read feeding several writes).
    """
    arrays = [jnp.full((2**29,), i, jnp.float16) for i in range(ROTATE)]
    copy = jax.jit(lambda arrays: [a + jnp.float16(1) for a in arrays])
    us, _ = timeit(copy, arrays)
    return 2 * arrays[0].nbytes / (us * 1e-6) / 1e12


def make_weights(k: int, n: int, seed: int):
    """ROTATE weight sets for every implementation, sharing their values where they can."""
    keys = jax.random.split(jax.random.key(seed), ROTATE)
    sets = {"fp16": [], "int4": [], "g128": [], "g-1": []}
    for key in keys:
        w = jax.random.normal(key, (k, n), jnp.float32)
        sets["fp16"].append(w.astype(jnp.float16))
        g128 = jm.quantize(w, group_size=128)
        sets["g128"].append(g128)
        q, s = jm.unpack(g128)
        sets["int4"].append(((q - 8).astype(jnp.int4), s))
        sets["g-1"].append(jm.quantize(w, group_size=-1))
        del w
    return sets


@jax.jit
def _marlin(x, ws):
    return [jm.matmul(x, w) for w in ws]


@jax.jit
def _fp16(x, ws):
    return [x @ w for w in ws]


@jax.jit
def _int4(x, ws):
    out = []
    for q, s in ws:
        k, n = q.shape
        w = (q.astype(jnp.float16).reshape(k // 128, 128, n) * s[:, None, :]).reshape(k, n)
        out.append(x @ w)
    return out


IMPLS = ["jax_marlin", "xla_fp16", "xla_int4"]


def bench_layer(name: str, ms: list[int], impls: list[str], records: list[dict], log) -> None:
    k, n = LAYERS[name]
    sets = make_weights(k, n, seed=zlib.crc32(name.encode()))
    for m in ms:
        x = jax.random.normal(jax.random.key(m), (m, k), jnp.float16)
        row = dict(layer=name, k=k, n=n, m=m, dtype="float16")
        for impl, group_size, fn, ws in [
            ("jax_marlin", 128, _marlin, sets["g128"]),
            ("jax_marlin", -1, _marlin, sets["g-1"]),
            ("xla_fp16", None, _fp16, sets["fp16"]),
            ("xla_int4", 128, _int4, sets["int4"]),
        ]:
            if impl not in impls:
                continue
            median, spread = timeit(fn, x, ws)
            rec = dict(row, impl=impl, group_size=group_size, median_us=round(median, 2),
                       spread_us=round(spread, 2), tbps=None, rel_err=None)
            if impl == "jax_marlin":
                w = ws[0]
                moved = w.nbytes + 2 * m * k + 2 * m * n
                rec["tbps"] = round(moved / (median * 1e-6) / 1e12, 3)
                y = fn(x, ws[:1])[0]
                ref = jm.reference.matmul(x, w).astype(jnp.float32)
                rec["rel_err"] = float(jnp.linalg.norm(y.astype(jnp.float32) - ref)
                                       / jnp.linalg.norm(ref))
            records.append(rec)
            log(rec)
    del sets


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 layers, m in {1, 16, 64}")
    parser.add_argument("--layers", nargs="*", help="subset of layers")
    parser.add_argument("--ms", nargs="*", type=int, help="subset of m")
    parser.add_argument("--impls", nargs="*", choices=IMPLS, default=IMPLS)
    parser.add_argument("--out", help="results JSON, rewritten after every layer")
    args = parser.parse_args(argv)

    if jax.default_backend() != "gpu" or not jm.HAS_CUDA:
        print("bench_matmul needs a CUDA GPU and jax_marlin built with CUDA", file=sys.stderr)
        return 2
    layers = args.layers or (QUICK_LAYERS if args.quick else list(LAYERS))
    ms = args.ms or (QUICK_MS if args.quick else MS)

    device = jax.devices()[0]
    result = dict(gpu=device.device_kind, jax=jax.__version__,
                  date=datetime.date.today().isoformat(),
                  method=dict(rotate=ROTATE, calls=CALLS, repeats=REPEATS),
                  copy_tbps=round(copy_tbps(), 3), records=[])
    print(f"{result['gpu']}  jax {result['jax']}  copy {result['copy_tbps']} TB/s", flush=True)

    def log(rec):
        extra = f"{rec['tbps']:6.2f} TB/s  err {rec['rel_err']:.1e}" if rec["tbps"] else ""
        print(f"{rec['layer']:12s} m={rec['m']:5d} {rec['impl']:10s} g={str(rec['group_size']):4s} "
              f"{rec['median_us']:9.1f} us ±{rec['spread_us']:.1f}  {extra}", flush=True)

    for name in layers:
        bench_layer(name, ms, args.impls, result["records"], log)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
