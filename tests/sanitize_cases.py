"""Runs the Marlin kernel over every tile configuration, both dtypes, every
group size, a fused bias, padded odd shapes and awkward batch sizes, weights
with zero points or act-order, and the fused RMSNorm, SwiGLU and residual, on
the decode, Marlin and prefill kernels, for compute-sanitizer
(benchmarks/gpu_run.sh, stage sanitize).
``python sanitize_cases.py zeros`` (or ``act-order``, ``fusion``, ``chain``) runs
those cases alone; ``fusion 16`` the fused cases at m <= 16, ``chain 1`` the
chain cases from the second on. ``random`` (not part of ``all``) runs the
seeded random combinations of tests/test_combinations.py (any k, n and m up to
40, every feature at once). racecheck: ``--racecheck-report hazard``.

Outputs are poisoned with NaN before each run, so a non-finite result marks an
element the kernel did not write; the script exits 1 if any case has one.
"""

import os
import sys

# Under compute-sanitizer, XLA's preallocation of most of the GPU made the
# tool segfault at start (2026-12-07, memcheck, compute-sanitizer 2025.3.1),
# and the orphaned Python process then held the memory. Allocate as needed.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp

import jax_marlin as jm
from jax_marlin.chain import _post_attention
from jax_marlin.ops import _matmul

F16, BF16 = jnp.float16, jnp.bfloat16
# m: 1 (small tiles), 17 (large tiles, partial 16-row block), 65 (a 64-row
# launch and a 1-row one), 100 and 1057 (parallel 64-row blocks, par > 1).
SMALL_LARGE = [1, 17, 65, 1024 + 33]
CASES = [  # (k, n, group_size, dtype, bias, ms)
    # every tile configuration in float16, g128 and g-1
    (1024, 1024, 128, F16, False, SMALL_LARGE),
    (1024, 1152, 128, F16, False, SMALL_LARGE),
    (1024, 1088, -1, F16, False, SMALL_LARGE),
    (1088, 1024, -1, F16, False, SMALL_LARGE),
    (1088, 1152, -1, F16, False, SMALL_LARGE),
    (4096, 1024, 128, F16, False, SMALL_LARGE),
    # bfloat16 on 128- and 64-deep tiles
    (1024, 1024, 128, BF16, False, [1, 65, 1024 + 33]),
    (1088, 1152, -1, BF16, False, [1, 17, 65]),
    # group sizes 32 and 64 on 128- and 64-deep tiles, both dtypes
    (1024, 1152, 32, F16, False, [1, 17, 1024 + 33]),
    (1088, 1024, 64, F16, False, [1, 65]),
    (1088, 1152, 32, BF16, False, [1, 65]),
    (1024, 1088, 64, BF16, False, [17]),
    # fused bias, on a kernel shape and on odd shapes that quantize pads
    (1024, 1088, 128, F16, True, [1, 65]),
    (1000, 576, 128, BF16, True, [1, 17, 100]),
    (4100, 130, -1, F16, True, [1, 33]),
    (576, 1000, 64, F16, False, [16, 1024 + 33]),
]

# Weights with zero points (and act-order on one): (k, n, group_size, dtype,
# bias, ms), m from the decode kernel's 1..16 (k = 8192 at m = 12: the Marlin
# kernel's 16-row tiles) through the Marlin kernel's 17..63 to the prefill
# kernel's >= 64 (partial last m and n tiles).
ZERO_POINT_CASES = [
    (4096, 1024, 128, F16, True, [1, 9, 16, 17, 64, 100]),
    (8192, 512, 64, BF16, False, [1, 12, 33, 65]),
    (2048, 1024, -1, F16, False, [1, 16, 40, 128]),
    (1000, 576, 32, F16, True, [1, 17, 100]),
    (576, 1000, 64, BF16, False, [3, 63, 64, 1024 + 33]),
    (4100, 130, -1, F16, True, [1, 33, 1000]),
]


# Act-order weights without zero points: the decode kernel's gather (m <= 16),
# the permutation pass before the Marlin and prefill kernels, staged in shared
# memory or, for rows longer than it holds (k = 131072), gathered from global
# memory; a padded shape.
ACT_ORDER_CASES = [
    (4096, 1024, 128, F16, True, [1, 9, 16, 17, 64, 100]),
    (131072, 128, 128, BF16, False, [1, 17, 64]),
    (1000, 576, 32, F16, True, [1, 40, 100]),
]


# Fused prologue/epilogue (jm.matmul's residual, rms_norm_weight, swiglu):
# (k, n, group_size, dtype, fusion, ms). On the decode kernel (m <= 16) the
# RMSNorm sums rows over a cluster through distributed shared memory and SwiGLU
# stages `up` from a row stride of 2 k; m = 20 and 64 run the prologue pass and
# the residual pass around the Marlin and prefill kernels; act-order folds the
# permutation into the prologue pass at every m.
FUSION_CASES = [
    (4096, 6144, 128, F16, "norm", [1, 3, 16, 20, 64]),
    (4096, 28672, 128, BF16, "norm", [1, 16]),
    (4096, 4096, 128, F16, "residual", [1, 16, 20, 64]),
    (14336, 4096, 128, F16, "swiglu+residual", [1, 16, 20, 64]),
    (2048, 1024, -1, BF16, "swiglu+residual", [1, 9]),
    (1000, 576, 128, F16, "norm+residual", [1, 17, 100]),
    (4096, 1024, 128, F16, "act-order norm+residual", [1, 16, 64]),
]


# jm.post_attention (o, gate_up, down in one call at m <= 8, the last two
# kernels loading their first weights before the PDL wait): (k_o, hidden, f,
# group_size, dtype, zero points on gate_up, ms); m = 9 takes three calls.
CHAIN_CASES = [
    (4096, 4096, 14336, 128, F16, False, [1, 2, 8]),
    (1024, 1024, 2048, -1, BF16, False, [1, 5, 9]),
    (1024, 1024, 2048, 64, F16, True, [3]),
]


def imported_weight(k, n, group_size, dtype, zeros, act_order):
    kq, kz, ks, kg = jax.random.split(key, 4)
    groups = 1 if group_size == -1 else -(-k // group_size)
    q = jax.random.randint(kq, (k, n), 0, 16)
    z = jax.random.randint(kz, (groups, n), 0, 16) if zeros else None
    scales = jax.random.uniform(ks, (groups, n), minval=0.03, maxval=0.1).astype(dtype)
    rows = k if group_size == -1 else group_size
    g_idx = jax.random.permutation(kg, jnp.arange(k) // rows) if act_order else None
    return jm.pack(q, scales, group_size, zeros=z, g_idx=g_idx)


def finite(y, label) -> bool:
    """Whether every element of ``y`` (poisoned with NaN before the kernel ran) is finite;
    prints the case's line."""
    ok = bool(jnp.isfinite(y.astype(jnp.float32)).all())
    print(f"{label}: {'ok' if ok else 'NOT FINITE'}", flush=True)
    return ok


@jax.jit
def run(x, w, bias):
    return _matmul(x, w, bias=bias, poison_output=True)


@jax.jit(static_argnames="swiglu")
def run_fused(x, w, residual, norm_weight, swiglu):
    return _matmul(x, w, residual=residual, rms_norm_weight=norm_weight, swiglu=swiglu,
                   poison_output=True)


def fused_cases(max_m):
    """Runs FUSION_CASES at m <= max_m; returns (cases, cases with a non-finite output)."""
    total = bad = 0
    for k, n, group_size, dtype, fusion, ms in FUSION_CASES:
        ms = [m for m in ms if m <= max_m]
        if fusion.startswith("act-order"):
            w = imported_weight(k, n, group_size, dtype, False, True)
        else:
            w = jm.quantize(jax.random.normal(key, (k, n)), group_size=group_size, dtype=dtype)
        swiglu = "swiglu" in fusion
        norm_weight = (1 + 0.1 * jax.random.normal(key, (k,))).astype(dtype) \
            if "norm" in fusion else None
        for m in ms:
            x = jax.random.normal(key, (m, 2 * k if swiglu else k), dtype)
            residual = jax.random.normal(key, (m, n), dtype) if "residual" in fusion else None
            y = jax.block_until_ready(run_fused(x, w, residual, norm_weight, swiglu))
            bad += not finite(y, f"k={k} n={n} g={group_size} {jnp.dtype(dtype).name} {fusion} "
                                 f"m={m}")
            total += 1
    return total, bad


@jax.jit
def run_chain(a, x, o, gate_up, down, norm_weight):
    return _post_attention(a, x, o, gate_up, down, norm_weight, rms_norm_eps=1e-5,
                           poison_output=True)


def chain_cases(first=0):
    """Runs CHAIN_CASES[first:] through the single custom call; returns (cases, cases
    with a non-finite output)."""
    os.environ["JAX_MARLIN_CHAIN_CALL"] = "1"  # read when run_chain is lowered
    total = bad = 0
    for k_o, hidden, f, group_size, dtype, zeros, ms in CHAIN_CASES[first:]:
        def weight(k, n, weight_key):
            return jm.quantize(jax.random.normal(weight_key, (k, n)) * k ** -0.5,
                               group_size=group_size, dtype=dtype)
        keys = jax.random.split(key, 4)
        o, down = weight(k_o, hidden, keys[0]), weight(f, hidden, keys[1])
        gate_up = (imported_weight(hidden, 2 * f, group_size, dtype, True, False) if zeros
                   else weight(hidden, 2 * f, keys[2]))
        norm_weight = (1 + 0.1 * jax.random.normal(keys[3], (hidden,))).astype(dtype)
        for m in ms:
            a = jax.random.normal(key, (m, k_o), dtype)
            x = jax.random.normal(keys[3], (m, hidden), dtype)
            y = jax.block_until_ready(run_chain(a, x, o, gate_up, down, norm_weight))
            bad += not finite(y, f"post_attention k_o={k_o} hidden={hidden} f={f} "
                                 f"g={group_size} {jnp.dtype(dtype).name}"
                                 f"{' zeros' if zeros else ''} m={m}")
            total += 1
    return total, bad


key = jax.random.key(0)
bad = 0
total = 0
# (kind, case): "sym" quantized here, "zeros" with zero points (act-order on
# the first), "act-order" without them.
KINDS = {"sym": CASES, "zeros": ZERO_POINT_CASES, "act-order": ACT_ORDER_CASES}
mode = sys.argv[1] if len(sys.argv) > 1 else "all"
if mode in ("all", "fusion"):
    # `fusion 16`: the decode kernel's cases alone (racecheck is slow).
    total, bad = fused_cases(int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 30)
if mode in ("all", "chain"):
    # `chain 1`: from the second case on (racecheck of the 8B case takes minutes).
    chain_total, chain_bad = chain_cases(int(sys.argv[2]) if mode == "chain" and len(sys.argv) > 2
                                         else 0)
    total, bad = total + chain_total, bad + chain_bad
if mode == "random":
    import test_combinations  # beside this file

    for seed in range(test_combinations.CASES):
        case, y, _ = test_combinations.call(seed)
        label = " ".join(f"{k}={v}" for k, v in case.items())
        if y.size:
            bad += not finite(y, label)
        else:
            print(f"{label}: empty output", flush=True)
        total += 1
cases = [(kind, case) for kind, kind_cases in KINDS.items() if mode in ("all", kind)
         for case in kind_cases]
for kind, (k, n, group_size, dtype, with_bias, ms) in cases:
    if kind == "sym":
        w = jm.quantize(jax.random.normal(key, (k, n)), group_size=group_size, dtype=dtype)
    elif kind == "zeros":
        act_order = (k, n, group_size) == ZERO_POINT_CASES[0][:3]
        w = imported_weight(k, n, group_size, dtype, True, act_order)
    else:
        w = imported_weight(k, n, group_size, dtype, False, True)
    bias = jax.random.normal(key, (n,), dtype) if with_bias else None
    for m in ms:
        x = jax.random.normal(key, (m, k), dtype)
        y = jax.block_until_ready(run(x, w, bias))
        bad += not finite(y, f"k={k} n={n} g={group_size} {jnp.dtype(dtype).name}"
                             f"{' bias' if with_bias else ''}"
                             f"{' zeros' if w.zeros is not None else ''}"
                             f"{' act-order' if w.perm is not None else ''} m={m}")
        total += 1
print(f"{total} cases, {bad} with NaN or inf in the output")
sys.exit(1 if bad else 0)
