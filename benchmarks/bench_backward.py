"""The cost of gradients through 4-bit layers: the backward product and a QLoRA step.

1. The backward product ``dy [m, n] @ W^T`` (the cotangent of ``x``) of
   ``jm.matmul``, ``jax.vjp`` of ``x -> jm.matmul(x, w)`` (dequantize + dense
   dot, ``jax_marlin.ops._matmul_transposed``), against the float16 model's
   ``jax.vjp`` of ``x -> x @ w``, on the 70B and 8B layers of
   ``bench_matmul.py`` at m in {16, 256, 4096}. The same method as
   ``bench_matmul.py``: ``ROTATE`` weight sets per call, so weights stream from
   memory; median and spread of the time per product. Each jax_marlin row
   carries its relative error against ``dy @ dequantize(w)^T`` in float32.
2. One training step of ``examples/qlora_finetune.py`` (rank-8 LoRA adapters
   trained with Adam, base frozen) on a float16 base and on the same base
   quantized to 4 bits: time per step, the compiled step's memory (arguments +
   temporaries, XLA's memory analysis) and, where the device reports it, its
   peak memory (each base measured in a process of its own).

    python benchmarks/bench_backward.py --out backward.json        # GPU: all of it
    python benchmarks/bench_backward.py --small                    # CPU check: tiny sizes
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_marlin as jm
from bench_matmul import LAYERS, ROTATE, timeit

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))

MS = [16, 256, 4096]
SMALL_LAYERS = {"tiny.qkv": (256, 384), "tiny.down": (512, 256)}
SMALL_MS = [16, 64]
# A Llama-8B-wide decoder of 4 layers for the training step; --small: tiny.
TRAIN = dict(vocab=32000, d=4096, heads=32, ffn=14336, layers=4, batch=4, seq=512)
SMALL_TRAIN = dict(vocab=64, d=128, heads=4, ffn=256, layers=1, batch=4, seq=16)


def bench_backward(layers, ms, log) -> list[dict]:
    records = []
    for name, (k, n) in layers.items():
        # Drawn on the device: the 70B layers' weight sets are 0.5-4 GB each.
        keys = iter(jax.random.split(jax.random.key(0), ROTATE + 2 * len(ms)))
        dense = [(jax.random.normal(next(keys), (k, n)) / np.sqrt(k)).astype(jnp.float16)
                 for _ in range(ROTATE)]
        packed = [jm.quantize(w, group_size=128) for w in dense]
        for m in ms:
            x = jax.random.normal(next(keys), (m, k), jnp.float16)
            dy = jax.random.normal(next(keys), (m, n), jnp.float16)

            def backward(op):
                # jax.vjp inside the jit: the forward is dead code, only dy @ W^T runs.
                return jax.jit(lambda x, dy, ws: [jax.vjp(lambda x: op(x, w), x)[1](dy)[0]
                                                  for w in ws])

            marlin = backward(jm.matmul)
            fp16 = backward(lambda x, w: x @ w)
            dx = marlin(x, dy, packed[:1])[0]
            ref = np.asarray(dy, np.float32) @ np.asarray(jm.dequantize(packed[0], jnp.float32)).T
            err = float(np.linalg.norm(np.asarray(dx, np.float32) - ref) / np.linalg.norm(ref))
            for impl, fn, ws in (("jax_marlin_g128", marlin, packed), ("xla_fp16", fp16, dense)):
                us, spread = timeit(fn, x, dy, ws)
                rec = dict(kind="backward", layer=name, k=k, n=n, m=m, impl=impl, us=us,
                           spread_us=spread, rel_err=err if impl.startswith("jax") else None)
                records.append(rec)
                log(f"{name:12s} m={m:5d} {impl:16s} {us:10.1f} us  (±{spread:.1f})"
                    + (f"  rel err {err:.2e}" if rec["rel_err"] is not None else ""))
    return records


def train_step_record(base: str, config: dict, steps: int) -> dict:
    """Times one QLoRA training step on a float16 (``base="float16"``) or 4-bit base."""
    from flax import nnx
    import optax
    import qlora_finetune as q
    from jax_marlin.flax import quantize_model

    model = q.Decoder(config["vocab"], config["d"], config["heads"], config["ffn"],
                      config["layers"], nnx.Rngs(0))
    if base == "int4":
        model = quantize_model(model, group_size=128, filter=lambda path, module: "base" in path)
    optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.LoRAParam)
    tokens, targets = q.toy_batch(jax.random.key(1), config["batch"], config["seq"],
                                  config["vocab"])
    compiled_bytes = None
    try:
        graphdef, state = nnx.split((model, optimizer))
        analysis = jax.jit(lambda state, t, y: q.train_step(*nnx.merge(graphdef, state), t, y)) \
            .lower(state, tokens, targets).compile().memory_analysis()
        compiled_bytes = int(analysis.argument_size_in_bytes + analysis.temp_size_in_bytes)
    except Exception:  # memory analysis is not available everywhere
        pass
    loss = q.train_step(model, optimizer, tokens, targets)  # compile
    jax.block_until_ready(loss)
    samples = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(q.train_step(model, optimizer, tokens, targets))
        samples.append((time.perf_counter() - t0) * 1e3)
    stats = jax.devices()[0].memory_stats() or {}
    return dict(kind="train_step", base=base, ms=float(np.median(samples)),
                spread_ms=float(max(samples) - min(samples)), compiled_bytes=compiled_bytes,
                peak_bytes=stats.get("peak_bytes_in_use"), loss=float(loss), **config)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny sizes, for a CPU check")
    parser.add_argument("--out", help="write the records as JSON here")
    parser.add_argument("--layers", nargs="*", choices=sorted(LAYERS), help="subset of layers")
    parser.add_argument("--steps", type=int, default=10, help="timed training steps")
    parser.add_argument("--train-only", choices=["float16", "int4"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    config = SMALL_TRAIN if args.small else TRAIN
    if args.train_only:  # one base per process, so that the peak memory is its own
        print(json.dumps(train_step_record(args.train_only, config, args.steps)))
        return 0

    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    layers = SMALL_LAYERS if args.small else {
        name: shape for name, shape in LAYERS.items() if not args.layers or name in args.layers}
    records = bench_backward(layers, SMALL_MS if args.small else MS, print)
    for base in ("float16", "int4"):
        cmd = [sys.executable, __file__, "--train-only", base, "--steps", str(args.steps)]
        out = subprocess.run(cmd + (["--small"] if args.small else []), check=True,
                             capture_output=True, text=True).stdout
        rec = json.loads(out.strip().splitlines()[-1])
        records.append(rec)
        mib = lambda b: "n/a" if b is None else f"{b / 2**20:.0f} MiB"
        print(f"QLoRA step, {base:7s} base: {rec['ms']:8.2f} ms (±{rec['spread_ms']:.2f}), "
              f"compiled args+temps {mib(rec['compiled_bytes'])}, peak {mib(rec['peak_bytes'])}")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
