"""Side-by-side GPU benchmark: jax_marlin against what a JAX user writes today.

Variants (``--impls``, one row each per layer and m), all jitted:

* ``jax_marlin_g128``, ``_g-1``, ``_g64``, ``_g32``: ``jm.matmul(x, w)`` with
  float16 ``x`` and 4-bit weights in Marlin's layout, one float16 scale per
  128/64/32 rows of k or per column (-1);
* ``jax_marlin_bf16_g128``: the same in bfloat16 (``x`` and scales);
* ``jax_marlin_zp_g128``, ``jax_marlin_act_order_g128``,
  ``jax_marlin_zp_act_order_g128``: fp16 g128 weights as imported from
  asymmetric (AWQ, GPTQ ``sym=False``) or act-order (GPTQ ``desc_act``)
  checkpoints: random zero points 0..15 (dequantized in the kernels) and/or
  rows grouped in a random order (``x[..., perm]`` inside the call);
* ``xla_fp16``, ``xla_bf16``: ``x @ w`` with float16/bfloat16 weights;
* ``xla_int4``: ``jnp.int4`` weights cast to float16, times their group-128
  scales, then ``x @ w`` (XLA fuses what it can).

Aliases: ``sweep`` (the default: jax_marlin fp16 and bf16 g128, xla_fp16,
xla_int4: the README's table), ``jax_marlin`` (fp16 g128 and g-1),
``formats`` (every symmetric jax_marlin variant, xla_fp16, xla_bf16) and
``zp`` (fp16 g128 symmetric, with zero points, act-order, both: the cost
of imported checkpoints side by side). The records keep ``impl``
(jax_marlin, xla_fp16, xla_bf16, xla_int4), ``dtype``, ``group_size``,
``layout`` (sym, zp, act_order, zp_act_order) and ``variant``.

Method: each variant gets ``ROTATE`` distinct weight sets, applied one
after another inside one jitted call, so weights stream from HBM rather than
the 60 MB L2; the call is dispatched ``CALLS`` times back to back and the wall
time (after a block at the end) divided by ``CALLS * ROTATE``; that is the
device time per matmul once the GPU is saturated. Every call takes ``x
[m, k]`` as an argument of its own, also at m = 1: never a slice of a stacked
``[R, m, k]`` array, for which XLA picks a slower dot at m = 1 (134 against
42 us for the fp16 dot on 8192 x 10240), so the XLA rows get its best
formulation. ``--inner N`` applies the weight sets to N distinct copies of
``x`` in the same call (N * ROTATE matmuls per dispatch), for layers whose
matmul is shorter than the host's dispatch of a call; jax_marlin rows only:
XLA merges dots that share a weight into one dot, so the XLA rows keep one
copy. Rows record their ``inner``. ``--outputs sum`` adds the products
inside the call (they pass an optimization barrier, so that no rewrite of
the consumer reaches into a dot, then one float32 fusion reads them all, the
same for every variant) instead of returning each, so that they are
temporaries of the executable, as a model's projections are. Why it
matters: XLA re-records a command of its command buffer (CUDA graph) when
that command's buffers have moved, and for an FFI custom call that means
tracing the handler into a new nested graph, where a kernel command (XLA's
dots) only updates its arguments; returned products get new buffers at
every dispatch, which on the H200 cost the custom call about 8.8 us and the
dot 4.1 on 4096 x 4096 (benchmarks/NOTES.md), more than either's kernel at m
<= 16. The consumer adds the time of reading each product once to every
variant (2.5 m n bytes per matmul: under 1% of a row at m <= 64, about 2.5%
at m >= 1024). ``--impls full`` (the targets' sweep) and ``zp`` (whose
ratios a returned product's fixed cost would flatten) take ``sum`` unless
told otherwise; the others keep ``list``, the form of the README's earlier
runs. Rows record their ``outputs``. Median and spread (max - min) over
``REPEATS`` repeats, after warm-up. Every jax_marlin row carries its relative
error against ``x @ dequantize(w)`` in float32, unrounded, so a fast wrong
kernel cannot report. A device-to-device copy in the same process gives
``copy_tbps``.

    python benchmarks/bench_matmul.py --out sweep.json   # the full sweep: 8 layers x 11 m
    python benchmarks/bench_matmul.py --quick            # 3 layers x m in {1, 16, 64}
    python benchmarks/bench_matmul.py --quick --impls formats
    python benchmarks/bench_matmul.py --layers 70b.qkv 70b.down 8b.qkv 8b.down --ms 1 16 64 256 \
        --impls zp --out zp.json                        # zero points and act-order vs symmetric
    python benchmarks/bench_matmul.py --impls full --layers 70b.qkv 70b.o --out full.json \
        --append                          # what the targets are stated for, a slice of layers
    python benchmarks/report.py sweep.json --readme README.md   # tables, plot, README table
    python benchmarks/targets.py full.json                      # the targets' scorecard
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
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
# Measured only when named (--layers): the fused projections of SmolLM2-135M
# (hidden 576, 9 heads and 3 KV heads of 64, MLP 1536), whose 4-bit decode
# step at batch 16 ran at 0.62x the float16 step's speed (README, 2026-12-03,
# unfused): layers of 0.2-1 MB of 4-bit weights, where a call's fixed cost is
# nearly all of it. The scorecard scores their rows at m <= 16 against the
# dot (every layer, not slower).
SMALL_LAYERS = {
    "135m.qkv": (576, 960),
    "135m.o": (576, 576),
    "135m.gate_up": (576, 3072),
    "135m.down": (1536, 576),
}
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


def known_layers() -> dict[str, tuple[int, int]]:
    """Every layer --layers may name: {name: (k, n)}."""
    return {**LAYERS, **SMALL_LAYERS}


FULL_MS = MS + [2048, 4096]  # --impls full without --ms
QUICK_LAYERS = ["70b.qkv", "70b.gate_up", "70b.down"]
QUICK_MS = [1, 16, 64]

ROTATE = 8
CALLS = 20
REPEATS = 5


def timeit(fn, *args, inner: int = 1) -> tuple[float, float]:
    """Median and spread of the per-matmul device time in microseconds.

    ``fn`` runs ``inner * ROTATE`` matmuls per call.
    """
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        for _ in range(CALLS):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / (CALLS * ROTATE * inner) * 1e6)
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


# Every row of the results, by the name --impls takes: (impl, dtype,
# group_size, layout) as recorded. jax_marlin rows run jm.matmul on weights
# quantized with that group size and dtype (layout: symmetric, with zero
# points, act-order); xla_fp16/xla_bf16 run x @ w in that dtype; xla_int4
# dequantizes jnp.int4 weights with group-128 fp16 scales, then x @ w.
VARIANTS = {
    "jax_marlin_g128": ("jax_marlin", "float16", 128, "sym"),
    "jax_marlin_g-1": ("jax_marlin", "float16", -1, "sym"),
    "jax_marlin_g64": ("jax_marlin", "float16", 64, "sym"),
    "jax_marlin_g32": ("jax_marlin", "float16", 32, "sym"),
    "jax_marlin_bf16_g128": ("jax_marlin", "bfloat16", 128, "sym"),
    "jax_marlin_bf16_g-1": ("jax_marlin", "bfloat16", -1, "sym"),
    "jax_marlin_zp_g128": ("jax_marlin", "float16", 128, "zp"),
    "jax_marlin_act_order_g128": ("jax_marlin", "float16", 128, "act_order"),
    "jax_marlin_zp_act_order_g128": ("jax_marlin", "float16", 128, "zp_act_order"),
    "xla_fp16": ("xla_fp16", "float16", None, "sym"),
    "xla_bf16": ("xla_bf16", "bfloat16", None, "sym"),
    "xla_int4": ("xla_int4", "float16", 128, "sym"),
}
# Names for several variants: "sweep" is the README's table.
ALIASES = {
    "sweep": ["jax_marlin_g128", "jax_marlin_bf16_g128", "xla_fp16", "xla_int4"],
    "jax_marlin": ["jax_marlin_g128", "jax_marlin_g-1"],
    "formats": ["jax_marlin_g128", "jax_marlin_g-1", "jax_marlin_g64", "jax_marlin_g32",
                "jax_marlin_bf16_g128", "xla_fp16", "xla_bf16"],
    "zp": ["jax_marlin_g128", "jax_marlin_zp_g128", "jax_marlin_act_order_g128",
           "jax_marlin_zp_act_order_g128"],
    # What the targets are stated for (benchmarks/targets.py): both dtypes, g128
    # and g-1, each dtype's XLA dot, and XLA's int4 path; m up to 4096 (FULL_MS).
    "full": ["jax_marlin_g128", "jax_marlin_g-1", "jax_marlin_bf16_g128", "jax_marlin_bf16_g-1",
             "xla_fp16", "xla_bf16", "xla_int4"],
}


def expand(names: list[str]) -> list[str]:
    """Variant names for --impls names (aliases expanded), in VARIANTS order."""
    chosen = {v for name in names for v in ALIASES.get(name, [name])}
    return [v for v in VARIANTS if v in chosen]


def make_weights(k: int, n: int, seed: int, variants: list[str]):
    """ROTATE weight sets per variant, all from the same ROTATE float weights."""
    keys = jax.random.split(jax.random.key(seed), ROTATE)
    sets = {v: [] for v in variants}
    for key in keys:
        w = jax.random.normal(key, (k, n), jnp.float32)
        for v in variants:
            impl, dtype, group_size, layout = VARIANTS[v]
            if impl == "jax_marlin":
                packed = jm.quantize(w, group_size=group_size, dtype=jnp.dtype(dtype))
                if layout != "sym":
                    packed = imported(packed, key, layout)
                sets[v].append(packed)
            elif impl == "xla_int4":
                q, s = jm.unpack(jm.quantize(w, group_size=128, dtype=jnp.float16))
                sets[v].append(((q - 8).astype(jnp.int4), s))
            else:
                sets[v].append(w.astype(jnp.dtype(dtype)))
        del w
    return sets


def imported(w: jm.MarlinWeight, key, layout: str) -> jm.MarlinWeight:
    """``w`` with random zero points (``zp``) and/or rows grouped in a random order (``act_order``).

    The values differ from ``w``'s (the timing does not depend on them); the
    layout is that of an AWQ / asymmetric GPTQ / act-order GPTQ import.
    """
    q, scales = jm.unpack(w)
    zeros = g_idx = None
    if "zp" in layout:
        zeros = jax.random.randint(jax.random.fold_in(key, 1), scales.shape, 0, 16)
    if "act_order" in layout:
        order = np.asarray(jax.random.permutation(jax.random.fold_in(key, 2), w.k))
        g_idx = np.empty(w.k, np.int32)
        g_idx[order] = np.arange(w.k) // w.group_size
    return jm.pack(q, scales, w.group_size, zeros=zeros, g_idx=g_idx)


# Each takes a list of activations (``--inner`` distinct copies for jax_marlin,
# one for XLA) and the ROTATE weight sets, and returns the list of products.
def _marlin(xs, ws):
    return [jm.matmul(x, w) for x in xs for w in ws]


def _dense(xs, ws):
    return [x @ w for x in xs for w in ws]


def _int4(xs, ws):
    out = []
    for x in xs:
        for q, s in ws:
            k, n = q.shape
            w = (q.astype(jnp.float16).reshape(k // 128, 128, n) * s[:, None, :]).reshape(k, n)
            out.append(x @ w)
    return out


def _summed(products):
    # The products added in float32 inside the call (one fusion reading them
    # all), so that they are temporaries of the executable rather than its
    # results. The barrier keeps the consumer out of the dots: without it XLA
    # may rewrite what reads a dot into the dot (a slice into a smaller dot,
    # an add into cuBLAS's epilogue), which it cannot do to a custom call.
    def summed(xs, ws):
        ys = jax.lax.optimization_barrier(products(xs, ws))
        return sum(y.astype(jnp.float32) for y in ys)
    return summed


# --outputs list: the products are the call's results, in buffers that are new
# at every dispatch; sum: see _summed.
FUNCTIONS = {
    outputs: {impl: jax.jit(f if outputs == "list" else _summed(f))
              for impl, f in (("jax_marlin", _marlin), ("xla_fp16", _dense), ("xla_bf16", _dense),
                              ("xla_int4", _int4))}
    for outputs in ("list", "sum")
}


def rel_err(x, w) -> float:
    """||jm.matmul(x, w) - x @ W|| / ||x @ W||, W the exact dequantized weight, in float32."""
    return float(_rel_err(x, w))


@jax.jit
def _rel_err(x, w):
    # One executable per row (eagerly, each of these ops compiled on its own).
    y = jm.matmul(x, w).astype(jnp.float32)
    ref = jnp.matmul(x.astype(jnp.float32), jm.dequantize(w, jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    return jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref)


def bench_layer(name: str, ms: list[int], variants: list[str], records: list[dict], log,
                inner: int = 1, outputs: str = "list", save=lambda: None) -> None:
    """Appends a record per (m, variant) to ``records``; ``save()`` after each m."""
    k, n = known_layers()[name]
    sets = make_weights(k, n, seed=zlib.crc32(name.encode()), variants=variants)
    for m in ms:
        x32 = jax.random.normal(jax.random.key(m), (m, k), jnp.float32)
        xs = {dtype: x32.astype(jnp.dtype(dtype)) for dtype in ("float16", "bfloat16")}
        for v in variants:
            started = time.perf_counter()
            impl, dtype, group_size, layout = VARIANTS[v]
            x, ws = xs[dtype], sets[v]
            # Distinct buffers, so XLA cannot merge the custom calls.
            copies = inner if impl == "jax_marlin" else 1
            xs_inner = [x] + [jnp.array(x, copy=True) for _ in range(copies - 1)]
            median, spread = timeit(FUNCTIONS[outputs][impl], xs_inner, ws, inner=copies)
            rec = dict(layer=name, k=k, n=n, m=m, dtype=dtype, impl=impl, variant=v,
                       group_size=group_size, layout=layout, inner=copies, outputs=outputs,
                       median_us=round(median, 2),
                       spread_us=round(spread, 2), tbps=None, rel_err=None)
            if impl == "jax_marlin":
                moved = ws[0].nbytes + x.dtype.itemsize * (m * k + m * n)
                rec["tbps"] = round(moved / (median * 1e-6) / 1e12, 3)
                rec["rel_err"] = rel_err(x, ws[0])
            # The row's wall time (compiles, timing, error check): where a sweep's
            # device time goes, for planning the next.
            rec["row_s"] = round(time.perf_counter() - started, 2)
            records.append(rec)
            log(rec)
        save()
    del sets


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 layers, m in {1, 16, 64}")
    parser.add_argument("--layers", nargs="*",
                        help=f"layers to measure (default: {' '.join(LAYERS)}; also "
                             f"{' '.join(SMALL_LAYERS)})")
    parser.add_argument("--ms", nargs="*", type=int,
                        help=f"subset of m (default {MS}; with --impls full up to {FULL_MS[-1]})")
    parser.add_argument("--impls", nargs="*", choices=[*VARIANTS, *ALIASES], default=["sweep"],
                        help="variants to run, or aliases: " + "; ".join(
                            f"{a} = {' '.join(v)}" for a, v in ALIASES.items()))
    parser.add_argument("--inner", type=int, default=1,
                        help="jax_marlin rows: distinct copies of x per call (matmuls per dispatch: "
                             "inner x 8); XLA rows always use 1")
    parser.add_argument("--outputs", choices=["list", "sum"],
                        help="list: every product a result of the call; sum: the products added "
                             "inside the call, so that they are temporaries, as in a model (rows "
                             "record it; default sum with --impls full or zp, else list)")
    parser.add_argument("--out", help="results JSON, rewritten after every m of every layer")
    parser.add_argument("--append", action="store_true",
                        help="keep the records of --out that this run does not measure again "
                             "(split a sweep over several runs with --layers)")
    args = parser.parse_args(argv)

    if jax.default_backend() != "gpu" or not jm.HAS_CUDA:
        print("bench_matmul needs a CUDA GPU and jax_marlin built with CUDA", file=sys.stderr)
        return 2
    layers = args.layers or (QUICK_LAYERS if args.quick else list(LAYERS))
    unknown = [name for name in layers if name not in known_layers()]
    if unknown:
        parser.error(f"unknown layers {unknown}: choose from {list(known_layers())}")
    variants = expand(args.impls)
    ms = args.ms or (QUICK_MS if args.quick else FULL_MS if "full" in args.impls else MS)
    # The scored runs (the targets' sweep, and the imported layouts against
    # symmetric weights, whose ratios a returned product's fixed cost would
    # flatten) keep products inside the call; the README's sweep its own form.
    outputs = args.outputs or ("sum" if {"full", "zp"} & set(args.impls) else "list")

    device = jax.devices()[0]
    result = dict(gpu=device.device_kind, jax=jax.__version__,
                  date=datetime.date.today().isoformat(),
                  method=dict(rotate=ROTATE, calls=CALLS, repeats=REPEATS, inner=args.inner,
                              outputs=outputs,
                              rel_err="against x @ dequantize(w) in float32, unrounded",
                              x="one [m, k] argument per call, never a slice of a stacked array"),
                  copy_tbps=round(copy_tbps(), 3), records=[])
    print(f"{result['gpu']}  jax {result['jax']}  copy {result['copy_tbps']} TB/s", flush=True)
    kept = []
    if args.append and args.out and os.path.exists(args.out):
        with open(args.out) as f:
            earlier = json.load(f)
        # One results file holds one GPU model's and jax version's rows, measured one way.
        def how(r):
            return {"gpu": r["gpu"], "jax": r["jax"],
                    **{key: r["method"].get(key)
                       for key in ("rotate", "calls", "repeats", "inner", "outputs")}}
        then, now = how(earlier), how(result)
        mismatch = {key: (then[key], now[key]) for key in now if then[key] != now[key]}
        if mismatch:
            print(f"--append: {args.out} was measured on another card, jax or method ("
                  + ", ".join(f"{key} {a} there, {b} here" for key, (a, b) in mismatch.items())
                  + "); one results file holds one run's kind of rows", file=sys.stderr)
            return 2
        kept = earlier["records"]
    measured = {(name, m, v) for name in layers for m in ms for v in variants}
    result["records"] = [r for r in kept if (r["layer"], r["m"], r.get("variant")) not in measured]

    def log(rec):
        extra = f"{rec['tbps']:6.2f} TB/s  err {rec['rel_err']:.1e}" if rec["tbps"] else ""
        print(f"{rec['layer']:12s} m={rec['m']:5d} {rec['variant']:21s}"
              f"{rec['median_us']:9.1f} us ±{rec['spread_us']:.1f}  {extra}"
              f"  [{rec['row_s']:.1f} s]", flush=True)

    def save():
        # After every m: a run stopped by a time limit keeps what it measured
        # (resume it with --append).
        if args.out:
            with open(args.out + ".tmp", "w") as f:
                json.dump(result, f, indent=1)
            os.replace(args.out + ".tmp", args.out)

    for name in layers:
        bench_layer(name, ms, variants, result["records"], log, inner=args.inner,
                    outputs=outputs, save=save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
