"""A decode step as XLA runs it: the four projections of every Llama-3-8B block in one jit.

Each of the 32 blocks runs qkv (4096 x 6144), o (4096 x 4096), gate_up
(4096 x 28672) and down (14336 x 4096) on ``x [m, 4096]``, with RMSNorm
before qkv and gate_up, the residual adds and SwiGLU between them (attention
itself is left out: it is the same for both weight formats). The same step
runs with float16 weights (``x @ w``) and with jax_marlin 4-bit weights
(``jm.matmul``, group 128), and with 4-bit weights and the fused forms of
``jm.matmul`` (``fused``: RMSNorm inside qkv and gate_up, the residual adds
inside o and down, SwiGLU inside down; only the slice of q stays an XLA
op). Every call depends on the one before, as in a real step, so this is
what a model sees, launch gaps included.

Method: the jitted step is called ``--calls`` times after two warm-up calls,
each call blocked on, and the median wall time reported (the step takes
milliseconds, so host timing is exact enough); this includes the host's
dispatch of the call and the wait for its result. ``pipelined``: the same
number of steps dispatched back to back, each fed the previous step's
output (as a decode loop keeps its token on the device), timed to the last
one and divided by their number: the device time per step once the host
keeps ahead. Weights are random; 4-bit weights are quantized from the
float16 ones. Floor: weight bytes over the copy bandwidth measured in the
same process.

``--act-order``: also the step with act-order weights (GPTQ ``desc_act``: a
random ``g_idx`` per projection, packed by ``jm.pack``; one block's weights,
112 MB, reused by every block, so they still stream from HBM), pipelined,
unfused and fused, and fused with ``down``'s row order moved into
``gate_up``'s columns (``jm.permute_columns``, as
``jax_marlin.models.fuse_projections`` does), against the same steps with
those weights in group order.

``--chain N``: also N alternating rounds of the fused step and the step
with ``jm.post_attention`` (``block_chain``, lowered with
``JAX_MARLIN_CHAIN_CALL=1``: its single custom call at m <= 8), pipelined,
with the largest difference between their results (bit-identical on a GPU:
the same kernels).

``--stream N``: also N alternating rounds of the 4-bit steps (pipelined,
unfused and fused) lowered with ``JAX_MARLIN_COMMAND_BUFFER=0`` (jm.matmul's
calls on XLA's stream, outside its command buffers) and with the default
target, compiled side by side in this process.

    python benchmarks/bench_decode_step.py [--ms 1 16 64] [--blocks 32] [--act-order] [--chain 2]
        [--stream 2] [--out step.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_marlin as jm
from jax_marlin import _ffi

HIDDEN, FFN, QKV = 4096, 14336, 6144


def rms_norm(x):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-5)).astype(x.dtype)


def block(x, mm, w):
    """One block's projections; ``mm(x, w)`` is the matmul of the weight format."""
    h = mm(rms_norm(x), w["qkv"])
    x = x + mm(h[:, :HIDDEN], w["o"])  # stands in for attention's output
    gate_up = mm(rms_norm(x), w["gate_up"])
    act = jax.nn.silu(gate_up[:, :FFN].astype(jnp.float32)) * gate_up[:, FFN:].astype(jnp.float32)
    return x + mm(act.astype(x.dtype), w["down"])


def block_fused(x, w):
    """``block`` with jm.matmul's fusions: four custom calls and the slice."""
    ones = jnp.ones((HIDDEN,), x.dtype)  # block's RMSNorm has no weight
    h = jm.matmul(x, w["qkv"], rms_norm_weight=ones, rms_norm_eps=1e-5)
    x = jm.matmul(h[:, :HIDDEN], w["o"], residual=x)
    gate_up = jm.matmul(x, w["gate_up"], rms_norm_weight=ones, rms_norm_eps=1e-5)
    return jm.matmul(gate_up, w["down"], swiglu=True, residual=x)


def block_chain(x, w):
    """``block_fused`` with o, gate_up and down in one op (``jm.post_attention``): on CUDA
    at m <= 8 one custom call, so a block makes two calls and the slice."""
    ones = jnp.ones((HIDDEN,), x.dtype)
    h = jm.matmul(x, w["qkv"], rms_norm_weight=ones, rms_norm_eps=1e-5)
    return jm.post_attention(h[:, :HIDDEN], x, w["o"], w["gate_up"], w["down"], ones,
                             rms_norm_eps=1e-5)


def step_chain(x, weights):
    for w in weights:
        x = block_chain(x, w)
    return x


def step(x, weights, mm):
    for w in weights:
        x = block(x, mm, w)
    return x


def step_fused(x, weights):
    for w in weights:
        x = block_fused(x, w)
    return x


def activations(m: int) -> jax.Array:
    """The step's input ``x [m, 4096]`` float16, the same for every m's runs."""
    return jax.random.normal(jax.random.key(m), (m, HIDDEN), jnp.float16)


def copy_tbps() -> float:
    a = jnp.ones((1 << 28,), jnp.float32)  # 1 GiB
    f = jax.jit(lambda a: a + 1)
    f(a).block_until_ready()
    t = time.perf_counter()
    for _ in range(10):
        b = f(a)
    b.block_until_ready()
    return 2 * a.nbytes * 10 / (time.perf_counter() - t) / 1e12


def timed(fn, *args, calls: int) -> float:
    fn(*args).block_until_ready()
    fn(*args).block_until_ready()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def pipelined(fn, x, weights, *, calls: int) -> float:
    """ms per step over ``calls`` dependent steps dispatched without waiting."""
    fn(x, weights).block_until_ready()
    t = time.perf_counter()
    for _ in range(calls):
        x = fn(x, weights)
    x.block_until_ready()
    return (time.perf_counter() - t) / calls * 1e3


def compiled_with_env(env: dict, fn, *args, targets=None):
    """``fn`` jitted and compiled for ``args`` with the environment variables ``env`` set.

    ``JAX_MARLIN_COMMAND_BUFFER`` and ``JAX_MARLIN_CHAIN_CALL`` are read when
    the ops are lowered, so they are set around the lowering of a function
    traced for this call alone (``fn`` a fresh function object: no cached
    trace or lowering is reused). ``targets``: the custom-call targets the
    lowering must hold (checked on a GPU).
    """
    before = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        lowered = jax.jit(fn).lower(*args)
        if targets is not None and jax.default_backend() == "gpu":
            found = set(re.findall(r"custom_call @(jax_marlin_\w+)", lowered.as_text()))
            assert found == set(targets), found
        return lowered.compile()
    finally:
        for name, value in before.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def compiled_with_target(stream: bool, fn, *args):
    """``fn`` compiled with jm.matmul's calls on XLA's stream or in its command buffers."""
    return compiled_with_env(dict(JAX_MARLIN_COMMAND_BUFFER="0" if stream else "1"), fn, *args,
                             targets=[_ffi.MATMUL_STREAM_TARGET if stream else _ffi.MATMUL_TARGET])


def act_order_blocks(block: dict, blocks: int, seed: int = 0) -> tuple[list, list, list]:
    """``block``'s weights in group order, with a random act-order, and that with down's folded.

    Each weight's 4-bit values and scales are packed again with a random
    ``g_idx`` (groups of 128 rows in a random row order), so the three sets
    hold the same bytes (plus ``perm``) and differ only in the row order.
    """
    rng = np.random.default_rng(seed)
    ordered, shuffled = {}, {}
    for name, w in block.items():
        q, scales = jm.unpack(w)
        g_idx = np.empty(w.k, np.int32)
        g_idx[rng.permutation(w.k)] = np.arange(w.k) // 128
        ordered[name] = w
        shuffled[name] = jm.pack(q, scales, 128, w.dtype, g_idx=g_idx)
    folded = dict(shuffled)
    perm = np.asarray(shuffled["down"].perm)
    folded["gate_up"] = jm.permute_columns(shuffled["gate_up"], np.concatenate([perm, FFN + perm]))
    folded["down"] = dataclasses.replace(shuffled["down"], perm=None)
    return [ordered] * blocks, [shuffled] * blocks, [folded] * blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--blocks", type=int, default=32)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--act-order", action="store_true")
    parser.add_argument("--chain", type=int, default=0, metavar="ROUNDS",
                        help="alternating rounds of the fused step and the jm.post_attention step")
    parser.add_argument("--stream", type=int, default=0, metavar="ROUNDS",
                        help="alternating rounds of the 4-bit steps on XLA's stream and in its "
                             "command buffers")
    parser.add_argument("--out")
    args = parser.parse_args()

    shapes = {"qkv": (HIDDEN, QKV), "o": (HIDDEN, HIDDEN), "gate_up": (HIDDEN, 2 * FFN),
              "down": (FFN, HIDDEN)}
    key = jax.random.key(0)
    fp16, int4 = [], []
    quantize = jax.jit(lambda w: jm.quantize(w, group_size=128))
    for b in range(args.blocks):
        wf, wq = {}, {}
        for name, (k, n) in shapes.items():
            key, sub = jax.random.split(key)
            wf[name] = (jax.random.normal(sub, (k, n), jnp.float32) * k ** -0.5).astype(jnp.float16)
            wq[name] = quantize(wf[name])
        fp16.append(wf)
        int4.append(wq)
    fp16_bytes = sum(w.nbytes for blk in fp16 for w in blk.values())
    int4_bytes = sum(w.nbytes for blk in int4 for w in blk.values())
    tbps = copy_tbps()
    # The settings that change how the step runs (command buffers, the
    # launcher's kernel policy), so that a log says what it measured.
    env = {k: v for k, v in sorted(os.environ.items())
           if k == "XLA_FLAGS" or k.startswith("JAX_MARLIN_")}
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {args.blocks} blocks, "
          f"copy {tbps:.2f} TB/s; weights: float16 {fp16_bytes / 1e9:.2f} GB, "
          f"jax_marlin g128 {int4_bytes / 1e9:.2f} GB"
          + "".join(f"; {k}={v}" for k, v in env.items()))
    f_fp16 = jax.jit(lambda x, w: step(x, w, lambda a, b: a @ b))
    f_int4 = jax.jit(lambda x, w: step(x, w, jm.matmul))
    f_fused = jax.jit(step_fused)
    rows = []
    print(f"{'m':>4} {'float16 ms':>11} {'floor':>7} {'jax_marlin ms':>14} {'floor':>7} {'speedup':>8}"
          f" | pipelined: {'float16 ms':>10} {'jax_marlin ms':>13} {'speedup':>8}"
          f" | fused: {'ms':>7} {'speedup':>8} {'pipelined':>9} {'speedup':>8} {'max diff':>8}")
    for m in args.ms:
        x = activations(m)
        t16 = timed(f_fp16, x, fp16, calls=args.calls)
        t4 = timed(f_int4, x, int4, calls=args.calls)
        p16 = pipelined(f_fp16, x, fp16, calls=args.calls)
        p4 = pipelined(f_int4, x, int4, calls=args.calls)
        tf = timed(f_fused, x, int4, calls=args.calls)
        pf = pipelined(f_fused, x, int4, calls=args.calls)
        # The fused step computes the same block up to roundings: its result
        # against the unfused 4-bit step's, relative to that result's size.
        y4, yf = f_int4(x, int4).astype(jnp.float32), f_fused(x, int4).astype(jnp.float32)
        diff = float(jnp.max(jnp.abs(yf - y4)) / jnp.max(jnp.abs(y4)))
        floor16 = fp16_bytes / tbps / 1e9
        floor4 = int4_bytes / tbps / 1e9
        print(f"{m:>4} {t16:>11.3f} {floor16:>7.3f} {t4:>14.3f} {floor4:>7.3f} {t16 / t4:>7.2f}x"
              f" | pipelined: {p16:>10.3f} {p4:>13.3f} {p16 / p4:>7.2f}x"
              f" | fused: {tf:>7.3f} {t16 / tf:>7.2f}x {pf:>9.3f} {p16 / pf:>7.2f}x {diff:>8.1e}")
        rows.append(dict(m=m, fp16_ms=t16, marlin_ms=t4, fp16_floor_ms=floor16,
                         marlin_floor_ms=floor4, speedup=t16 / t4, fp16_pipelined_ms=p16,
                         marlin_pipelined_ms=p4, pipelined_speedup=p16 / p4, fused_ms=tf,
                         fused_speedup=t16 / tf, fused_pipelined_ms=pf,
                         fused_pipelined_speedup=p16 / pf, fused_max_rel_diff=diff))
    act_rows = []
    if args.act_order:
        ordered, shuffled, folded = act_order_blocks(int4[0], args.blocks)
        print("act-order (one block's weights reused), pipelined ms per step: group order"
              " unfused / fused | act-order unfused / fused / fused, down's order folded")
        for m in args.ms:
            x = activations(m)
            t = dict(ordered_ms=pipelined(f_int4, x, ordered, calls=args.calls),
                     ordered_fused_ms=pipelined(f_fused, x, ordered, calls=args.calls),
                     act_order_ms=pipelined(f_int4, x, shuffled, calls=args.calls),
                     act_order_fused_ms=pipelined(f_fused, x, shuffled, calls=args.calls),
                     folded_fused_ms=pipelined(f_fused, x, folded, calls=args.calls))
            # The folded step computes the act-order step's block exactly but for rounding order.
            y, yf = f_fused(x, shuffled).astype(jnp.float32), f_fused(x, folded).astype(jnp.float32)
            t["folded_max_rel_diff"] = float(jnp.max(jnp.abs(yf - y)) / jnp.max(jnp.abs(y)))
            print(f"{m:>4} {t['ordered_ms']:>8.3f} {t['ordered_fused_ms']:>8.3f} |"
                  f" {t['act_order_ms']:>8.3f} ({t['act_order_ms'] / t['ordered_ms'] - 1:+.1%})"
                  f" {t['act_order_fused_ms']:>8.3f} ({t['act_order_fused_ms'] / t['ordered_fused_ms'] - 1:+.1%})"
                  f" {t['folded_fused_ms']:>8.3f} ({t['folded_fused_ms'] / t['ordered_fused_ms'] - 1:+.1%})"
                  f" max diff {t['folded_max_rel_diff']:.1e}")
            act_rows.append(dict(m=m, **t))
    chain_rows = []
    if args.chain:
        print("fused step (4 calls a block) / jm.post_attention step (2 calls a block: its"
              " single call, JAX_MARLIN_CHAIN_CALL=1, at m <= 8), pipelined ms per step,"
              " alternating rounds")
        for m in args.ms:
            x = activations(m)
            # The targets the step must lower to (the stream twins under
            # JAX_MARLIN_COMMAND_BUFFER=0): the single call at m <= 8 only.
            matmul = _ffi.cuda_target()
            chain = "jax_marlin_post_attention" + matmul[len(_ffi.MATMUL_TARGET):]
            f_chain = compiled_with_env(
                dict(JAX_MARLIN_CHAIN_CALL="1"), lambda x, w: step_chain(x, w), x, int4,
                targets=[matmul, chain] if m <= 8 else [matmul])
            yf, yc = f_fused(x, int4).astype(jnp.float32), f_chain(x, int4).astype(jnp.float32)
            diff = float(jnp.max(jnp.abs(yc - yf)) / jnp.max(jnp.abs(yf)))
            for r in range(args.chain):
                tf = pipelined(f_fused, x, int4, calls=args.calls)
                tc = pipelined(f_chain, x, int4, calls=args.calls)
                t16 = rows[args.ms.index(m)]["fp16_pipelined_ms"]
                print(f"{m:>4} round {r + 1}: {tf:>7.3f} / {tc:>7.3f} ({tc / tf - 1:+.1%};"
                      f" {t16 / tc:.2f}x float16) max diff {diff:.1e}")
                chain_rows.append(dict(m=m, round=r + 1, fused_ms=tf, chain_ms=tc,
                                       chain_max_rel_diff=diff))
    stream_rows = []
    if args.stream:
        print("jm.matmul's calls in XLA's command buffers (default) / on its stream"
              " (JAX_MARLIN_COMMAND_BUFFER=0), pipelined ms per step, alternating rounds:"
              " unfused | fused")
        for m in args.ms:
            x = activations(m)
            steps = {(stream, fused): compiled_with_target(
                         stream, (lambda x, w: step_fused(x, w)) if fused
                         else (lambda x, w: step(x, w, jm.matmul)), x, int4)
                     for stream in (False, True) for fused in (False, True)}
            for r in range(args.stream):
                t = {(stream, fused): pipelined(f, x, int4, calls=args.calls)
                     for (stream, fused), f in steps.items()}
                print(f"{m:>4} round {r + 1}: {t[False, False]:>7.3f} / {t[True, False]:>7.3f}"
                      f" | {t[False, True]:>7.3f} / {t[True, True]:>7.3f}")
                stream_rows.append(dict(m=m, round=r + 1, default_ms=t[False, False],
                                        stream_ms=t[True, False], default_fused_ms=t[False, True],
                                        stream_fused_ms=t[True, True]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                           env=env, blocks=args.blocks, copy_tbps=tbps, fp16_bytes=fp16_bytes,
                           marlin_bytes=int4_bytes, rows=rows, act_order_rows=act_rows,
                           chain_rows=chain_rows, stream_rows=stream_rows), f,
                      indent=1)


if __name__ == "__main__":
    main()
