"""The primitive on both handlers: the CUDA kernel against float64, the CPU handler and
the jnp reference, and the run-time re-checks of the FFI handlers.

Tests marked ``gpu`` are skipped unless a CUDA GPU is visible and jax_marlin was
built with CUDA. Every kernel run fills its output with NaN first
(``poison_output``), so an element the kernel fails to write shows up as NaN in
``rel_err``.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_marlin as jm
from conftest import FP16_U, imported_weight, random_weight, rel_err
from jax_marlin.ops import _matmul

DTYPES = ["float16", "bfloat16"]

#: Unit roundoff: float16 keeps 11 significant bits, bfloat16 8.
UNIT_ROUNDOFF = {"float16": FP16_U, "bfloat16": 2.0**-8}

# Error budget of the CUDA kernel against float64 (relative Frobenius norm),
# with the fp32 global reduction:
# * each weight (q - 8) * s is formed in x's dtype before the tensor-core
#   product: one rounding, relative error <= u per weight (group_size -1 applies
#   the per-column scale to the sum in the epilogue instead: again one rounding);
# * products accumulate in fp32 in the tensor cores, and thread blocks sharing
#   an output tile hand each other fp32 partial sums: for random data the
#   rounding errors add like a random walk, ~sqrt(k) 2^-24 ~ 1e-5 at k = 28672;
# * the output is rounded to x's dtype once: <= u.
# Two roundings bound the error by 2u: 2^-10 = 9.8e-4 in float16, 2^-7 = 7.8e-3
# in bfloat16 (u = 2^-8, 8 significant bits). The targets, 1e-3 and 8e-3, are
# these plus the accumulation slack, for every m <= 4096 and
# k <= 28672, so they hold for every case here. Random rounding errors add in
# quadrature, so measured errors sit near 0.6u, a factor ~3 inside the bound;
# a float16 global reduction (upstream Marlin's) exceeds it at m >= 1024, as it
# should.
TOL = {"float16": 1e-3, "bfloat16": 8e-3}

# The CPU handler and the jnp reference multiply the exact dequantized weight
# in fp32 and round once: <= u plus the fp32 accumulation (<< 1e-5 here).
CPU_TOL = {dt: u + 1e-5 for dt, u in UNIT_ROUNDOFF.items()}

# (k, n, group_size), chosen so that every tile of the launcher's table runs
# for small (m <= 16) and large batches (test_every_tile_is_tested checks it
# against the compiled rules). The larger layers add many k-slices per output
# column (28672 x 1024) and wide outputs (1024 x 8192).
LAYERS = [
    (1024, 1024, 128), (1024, 1152, 128), (1024, 1088, -1), (1088, 1024, -1),
    (1088, 1152, -1), (4096, 4096, 128), (8192, 1024, -1), (28672, 1024, 128),
    (1024, 8192, 128),
]
MS = [1, 7, 16, 17, 33, 64, 65, 100, 128, 1024, 1041]

# Group sizes 32 and 64, and -1/128 where LAYERS lacks them, over the five
# tile shapes above: with LAYERS every (tile configuration, group size) pair
# the launcher can reach runs. (128-row groups need k % 128 == 0, so 1088-deep
# weights take no g128.) m = 1: small-batch table, one 16-row block; m = 17:
# large-batch table, two blocks; m = 65: a 64-row launch plus a 1-row one.
TILE_SHAPES = [(1024, 1024), (1024, 1152), (1024, 1088), (1088, 1024), (1088, 1152)]
GROUP_LAYERS = [(k, n, g) for k, n in TILE_SHAPES for g in (-1, 32, 64, 128)
                if (g == -1 or k % g == 0) and (k, n, g) not in LAYERS]
GROUP_MS = [1, 17, 65]

# Shapes the kernel does not take directly: quantize pads them, matmul returns
# the logical [m, n]. Partial last groups at k = 576 (g128), 1000 (g128, g32)
# and 4100 (g128).
ODD_LAYERS = [(576, 192, 128), (576, 192, -1), (576, 1000, 64), (1000, 576, 128),
              (1000, 576, 32), (4100, 130, 128), (4100, 130, -1)]
ODD_MS = [1, 16, 17, 64, 100]

# The accuracy target of the fp32 reduction at realistic sizes (the Llama-70B
# down projection is 28672 x 8192). m = 4096 runs four launches of 1024 rows
# through one reduce scratch; g -1 applies its scales after the reduction.
ACCURACY_LAYERS = [(4096, 4096, 128), (8192, 4096, -1), (28672, 8192, 128)]
ACCURACY_MS = [1, 16, 64, 128, 1024, 4096]


def layer_id(layer):
    return "k%d-n%d-g%d" % layer[:3]


def gpu(a):
    return jax.device_put(a, jax.devices("gpu")[0])


def on(device_kind, a):
    return jax.device_put(a, jax.devices(device_kind)[0])


def activations(rng, dtype, *shape):
    """Random ``x`` in ``dtype`` (float16 or bfloat16), never zero."""
    return rng.standard_normal(shape).astype(np.float32).astype(jnp.dtype(dtype))


@functools.lru_cache(maxsize=None)
def float_weight(k, n, group_size):
    rng = np.random.default_rng(k * 7 + n * 13 + group_size)
    return random_weight(rng, k, n)


@functools.lru_cache(maxsize=None)
def weight(k, n, group_size, dtype):
    """The packed weight, quantized on the GPU (the default device of these tests)."""
    return jm.quantize(float_weight(k, n, group_size), group_size=group_size,
                       dtype=jnp.dtype(dtype))


_dequantize32 = jax.jit(lambda w: jm.dequantize(w, jnp.float32))


def dequantized64(w) -> np.ndarray:
    """The exact weight the kernel multiplies by, ``[k, n]`` float64."""
    # (q - 8) * scale is exact in float32 (a 4-bit integer times an fp16 or bf16).
    return np.asarray(_dequantize32(w), np.float64)


@functools.lru_cache(maxsize=None)  # ~6 GB of host memory once every layer has run
def weight64(k, n, group_size, dtype):
    return dequantized64(weight(k, n, group_size, dtype))


def packed_shape(w) -> tuple[int, int]:
    """The (k, n) the kernel runs: qweight is [k / 16, 2 n]."""
    return w.qweight.shape[0] * 16, w.qweight.shape[1] // 2


@functools.partial(jax.jit, static_argnames="poison")
def marlin(x, w, bias=None, poison=True):
    return _matmul(x, w, bias=bias, poison_output=poison)


def check_against_float64(rng, w, w64, m, *, bias=False):
    """Runs the kernel on random x (and bias), asserts the error bound."""
    dtype = jnp.dtype(w.scales.dtype).name
    x = activations(rng, dtype, m, w.k)
    ref = np.asarray(x, np.float64) @ w64
    b = None
    if bias:
        # As large as the outputs and independent of them: ||x W + b|| is about
        # sqrt(2) ||x W||, so the relative bound carries over, and a bias that is
        # dropped, doubled or applied to permuted columns moves the error to ~1.
        b = (rng.standard_normal(w.n) * ref.std()).astype(np.float32).astype(jnp.dtype(dtype))
        ref = ref + np.asarray(b, np.float64)
        b = gpu(b)
    y = marlin(gpu(x), w, b)
    assert y.shape == (m, w.n) and y.dtype == jnp.dtype(dtype)
    err = rel_err(y, ref)
    print(f"gpu rel err {dtype} k={w.k} n={w.n} g={w.group_size} m={m}"
          f"{' bias' if bias else ''}: {err:.2e} (tol {TOL[dtype]:.0e})")
    assert err <= TOL[dtype]


# Every layer at every m, then every (tile, group size) pair at a few m.
FLOAT64_CASES = ([(layer, m) for layer in LAYERS for m in MS] +
                 [(layer, m) for layer in GROUP_LAYERS for m in GROUP_MS])


@pytest.mark.parametrize("layer,m", FLOAT64_CASES,
                         ids=[f"{layer_id(l)}-m{m}" for l, m in FLOAT64_CASES])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.gpu
def test_gpu_matches_float64(rng, dtype, layer, m):
    check_against_float64(rng, weight(*layer, dtype), weight64(*layer, dtype), m)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.gpu
def test_tile_layers_are_not_padded(dtype):
    # The tile table above holds only if quantize keeps shapes the kernel
    # already takes.
    for k, n, g in [l for l in LAYERS if l[:2] in TILE_SHAPES] + GROUP_LAYERS:
        w = weight(k, n, g, dtype)
        assert (w.k, w.n) == (k, n)
        assert packed_shape(w) == (k, n), f"quantize padded [{k}, {n}] g{g} to {packed_shape(w)}"


@pytest.mark.parametrize("m", ODD_MS)
@pytest.mark.parametrize("layer", ODD_LAYERS, ids=layer_id)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.gpu
def test_odd_shapes_match_float64(rng, dtype, layer, m):
    w = weight(*layer, dtype)
    assert (w.k, w.n) == layer[:2]
    check_against_float64(rng, w, weight64(*layer, dtype), m)


@pytest.mark.parametrize("layer", ODD_LAYERS, ids=layer_id)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.gpu
def test_odd_shapes_dequantize_to_the_weight(dtype, layer):
    # The float64 tests compare the kernel with dequantize(w); this ties
    # dequantize(w) of a padded weight to the weight itself, so a padding that
    # shifts rows, columns or groups cannot pass both. Round-to-nearest with the
    # scale s = max|w| / 7.5 of the element's group, s rounded to the scale
    # dtype (relative change <= u): |w - (q - 8) s| <= s / 2, or, where w / s
    # rounds to +8 and is clipped to 7, <= max|w| (0.5 + 7.5 u) / 7.5; both
    # <= max|w| / 15 * (1 + 16 u). A misplaced row or column errs by ~max|w|.
    k, n, g = layer
    w = weight(k, n, g, dtype)
    deq = dequantized64(w)
    assert deq.shape == (k, n)
    orig = float_weight(k, n, g).astype(np.float64)
    rows = k if g == -1 else g
    pad = -k % rows
    absmax = np.abs(np.pad(orig, ((0, pad), (0, 0)))).reshape(-1, rows, n).max(axis=1)
    bound = np.repeat(absmax, rows, axis=0)[:k] / 15 * (1 + 16 * UNIT_ROUNDOFF[dtype])
    excess = np.abs(deq - orig) - bound
    assert excess.max() <= 0, f"{(excess > 0).sum()} elements off by more than half a step"


@pytest.mark.parametrize("m", [1, 17, 100])
@pytest.mark.parametrize("layer", [(1024, 1024, 128), (1088, 1152, -1), (576, 1000, 128)],
                         ids=layer_id)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.gpu
def test_fused_bias_matches_float64(rng, dtype, layer, m):
    # The bias joins the output in the epilogue: one more rounding at most, a
    # further ~0.4u in the norm, well inside the 2u bound's margin (above).
    check_against_float64(rng, weight(*layer, dtype), weight64(*layer, dtype), m, bias=True)


# jm.concatenate on the GPU: Llama-3-8B's qkv (4096 x [4096, 1024, 1024]) and
# gate_up (4096 x [14336, 14336]), the shapes a fused decode step runs, and
# SmolLM2's qkv, whose parts are stored padded in other shapes than the whole.
CONCAT_LAYERS = [(4096, (4096, 1024, 1024), 128), (4096, (14336, 14336), 128),
                 (576, (576, 192, 192), 64)]


@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("k,widths,group_size", CONCAT_LAYERS,
                         ids=["llama8b-qkv", "llama8b-gate_up", "smollm2-qkv"])
@pytest.mark.gpu
def test_concatenated_weight_matches_float64_and_its_parts(rng, k, widths, group_size, m):
    parts = [weight(k, n, group_size, "float16") for n in widths]
    joined = jm.concatenate(parts)
    check_against_float64(rng, joined, dequantized64(joined), m)
    x = gpu(activations(rng, "float16", m, k))
    fused = np.asarray(marlin(x, joined), np.float64)
    separate = np.concatenate([np.asarray(marlin(x, w), np.float64) for w in parts], axis=-1)
    # Both round an fp32 sum once; the joined shape may take other tiles (another
    # summation order), so outputs differ by one rounding at most: <= u each.
    err = rel_err(fused, separate)
    print(f"concatenated k={k} n={widths} m={m}: {np.mean(fused == separate):.1%} of outputs "
          f"bit-identical to the parts', rel diff {err:.1e}")
    assert err <= 2 * FP16_U


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.gpu
def test_zero_bias_and_no_bias_agree_bitwise(rng, dtype):
    # Adding +0 is exact in any precision, and the bias must not change how the
    # products are summed, so a zero bias gives the very bits of no bias.
    w = weight(1024, 1152, 128, dtype)
    x = gpu(activations(rng, dtype, 65, 1024))
    plain = np.asarray(marlin(x, w))
    assert np.isfinite(plain.astype(np.float32)).all()
    zero = gpu(jnp.zeros((1152,), jnp.dtype(dtype)))
    np.testing.assert_array_equal(np.asarray(marlin(x, w, zero)), plain)
    np.testing.assert_array_equal(np.asarray(jax.jit(jm.matmul)(x, w, bias=None)), plain)
    np.testing.assert_array_equal(np.asarray(jax.jit(jm.matmul)(x, w, bias=zero)), plain)


@pytest.mark.parametrize("m", ACCURACY_MS)
@pytest.mark.parametrize("layer", ACCURACY_LAYERS, ids=layer_id)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.gpu
def test_fp32_reduction_accuracy_target(rng, dtype, layer, m):
    check_against_float64(rng, weight(*layer, dtype), weight64(*layer, dtype), m)


# (k, n, group_size, with bias)
AGREEMENT_LAYERS = [(4096, 4096, 128, False), (28672, 1024, 128, False), (1088, 1152, -1, True),
                    (1000, 576, 32, True)]


@pytest.mark.parametrize("m", [1, 17, 128])
@pytest.mark.parametrize("layer", AGREEMENT_LAYERS, ids=lambda l: layer_id(l) + ("-bias" * l[3]))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.gpu
def test_gpu_matches_cpu_and_reference(rng, dtype, layer, m):
    # The CPU handler and the GPU kernel on the same packed arrays (quantized
    # once, on the GPU, then copied), the same x and bias.
    k, n, g, with_bias = layer
    w = weight(k, n, g, dtype)
    w_cpu = on("cpu", w)
    x = activations(rng, dtype, m, k)
    b = (rng.standard_normal(n) * np.sqrt(k)).astype(np.float32).astype(jnp.dtype(dtype)) \
        if with_bias else None
    y_gpu = marlin(gpu(x), w, None if b is None else gpu(b))
    y_cpu = marlin(on("cpu", x), w_cpu, None if b is None else on("cpu", b))
    assert y_cpu.shape == y_gpu.shape == (m, n) and y_cpu.dtype == y_gpu.dtype == jnp.dtype(dtype)
    ref = np.asarray(x, np.float64) @ weight64(k, n, g, dtype)
    assert rel_err(jm.reference.matmul(on("cpu", x), w_cpu), ref) <= CPU_TOL[dtype]
    if b is not None:
        ref = ref + np.asarray(b, np.float64)
    assert rel_err(y_cpu, ref) <= CPU_TOL[dtype]
    # ||gpu - cpu|| <= (TOL + CPU_TOL) ||ref|| and ||ref|| <= ||cpu|| / (1 - CPU_TOL).
    err = rel_err(y_gpu, np.asarray(y_cpu, np.float64))
    print(f"gpu-vs-cpu diff {dtype} k={k} n={n} g={g} m={m}: {err:.2e}")
    assert err <= (TOL[dtype] + CPU_TOL[dtype]) / (1 - CPU_TOL[dtype])


@pytest.mark.parametrize("x_dtype,w_dtype", [("float32", "float16"), ("bfloat16", "float16"),
                                             ("float16", "bfloat16"), ("float32", "bfloat16")])
@pytest.mark.gpu
def test_bad_dtype_raises_type_error_on_gpu(rng, x_dtype, w_dtype):
    # x must match the scales' dtype (float16 or bfloat16), also when the call
    # would lower for CUDA.
    w = weight(1024, 1024, 128, w_dtype)
    x = gpu(activations(rng, "float16", 4, 1024).astype(jnp.dtype(x_dtype)))
    with pytest.raises(TypeError):
        jax.jit(jm.matmul)(x, w)
    with pytest.raises(TypeError):
        jm.matmul(x, w)


@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.gpu
def test_leading_dims_and_vmap_on_gpu(rng, dtype, with_bias):
    w = weight(1024, 1024, 128, dtype)
    x = gpu(activations(rng, dtype, 3, 5, 1024))
    b = gpu(activations(rng, dtype, 1024)) if with_bias else None
    y = jax.jit(jax.vmap(lambda x: jm.matmul(x, w, bias=b)))(x)
    np.testing.assert_array_equal(np.asarray(y).reshape(15, 1024),
                                  np.asarray(marlin(x.reshape(15, 1024), w, b)))


@pytest.mark.parametrize("dtype,m,k,n", [("float16", 64, 8192, 1024), ("bfloat16", 64, 8192, 1024),
                                         ("float16", 1041, 8192, 1024), ("float16", 64, 4096, 4096),
                                         ("float16", 128, 4096, 4096), ("float16", 512, 8192, 10240),
                                         ("float16", 16, 8192, 10240), ("float16", 33, 14336, 4096),
                                         ("bfloat16", 48, 8192, 1024)])
@pytest.mark.gpu
def test_repeated_calls_are_bit_identical(rng, dtype, m, k, n):
    # 100 calls inside one jitted loop (where XLA may capture the custom call
    # into a CUDA graph) and 100 separate dispatches all give the same bits:
    # the counters, zeroed once per call site (ffi/zeroed_counters.h), are
    # left zero by every kernel, and the fp32 global reduction adds partial
    # sums in a fixed order (m = 1041: several parallel 64-row blocks and two
    # launches through one reduce scratch). A counter left non-zero shows up
    # here as a wrong or unwritten (NaN) output, or a hang of the Marlin
    # kernel's locks; a race as a run that differs (4096 x 4096 g128 at m = 64
    # and 128 caught the scale-fetch race fixed in fetch_to_shared). On sm_90
    # 8192 x 10240 at m = 512 is a stream-K launch of the prefill kernel
    # (tiles cut between blocks), m = 64-1041 split launches of it where its
    # table says so, m = 16, 33 and 48 the Marlin kernel with k split between
    # blocks through its locks.
    w = weight(k, n, 128, dtype)
    x = gpu(activations(rng, dtype, m, k))

    @jax.jit
    def loop(x, w):
        def body(i, ys):
            # The barrier keeps XLA from hoisting the loop-invariant call.
            xi, _ = jax.lax.optimization_barrier((x, i))
            return ys.at[i].set(jm.matmul(xi, w))
        return jax.lax.fori_loop(0, 100, body, jnp.zeros((100, m, n), jnp.dtype(dtype)))

    ys = np.asarray(loop(x, w))
    first = np.asarray(marlin(x, w))
    assert np.isfinite(first.astype(np.float32)).all()
    for i in range(100):
        np.testing.assert_array_equal(ys[i], first)
    for _ in range(100):
        np.testing.assert_array_equal(np.asarray(marlin(x, w, poison=False)), first)


@pytest.mark.gpu
def test_first_call_captured_into_a_cuda_graph():
    # A call site's counters are allocated and zeroed at its first execution,
    # which XLA may run while it captures a CUDA graph (command buffers on
    # for custom calls, even for a one-op graph): the allocation must stay
    # out of the graph and the counters be zero when the kernel runs. A fresh
    # process, so that the call sites are new; the Marlin kernel's locks (m =
    # 16, 8192 x 10240) and the prefill kernel's split counters (m = 64,
    # 8192 x 1024), each called 5 times, against float64.
    script = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        import jax_marlin as jm
        for m, k, n in [(16, 8192, 10240), (64, 8192, 1024)]:
            w = jm.quantize(jax.random.normal(jax.random.key(n), (k, n), jnp.float32),
                            group_size=128, dtype=jnp.float16)
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(jnp.float16)
            f = jax.jit(lambda x, w: jm.matmul(x * 1, w) * 1)
            ref = np.asarray(x, np.float64) @ np.asarray(jm.dequantize(w, jnp.float32), np.float64)
            for _ in range(5):
                y = np.asarray(f(x, w), np.float64)
                err = np.linalg.norm(y - ref) / np.linalg.norm(ref)
                print(m, k, n, f"{err:.2e}")
                assert err <= 1e-3, err
        print("ok")
    """)
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL"
                        " --xla_gpu_graph_min_graph_size=1")
    out = subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True,
                         env=env, timeout=300)
    print(out.stdout, out.stderr[-3000:])
    assert out.returncode == 0 and out.stdout.strip().endswith("ok")


# The decode kernel (m <= 16 on sm_90; the Marlin kernel elsewhere): every m,
# both halves of its 16-row m tile, with and without a bias, over layers that
# split k into many ranges (14336, 28672), a narrow padded one (640 x 192, three
# 64-column chunks) and every group size.
DECODE_LAYERS = [(4096, 4096, 128), (14336, 4096, 128), (28672, 1024, -1), (640, 192, 64),
                 (4096, 6144, 32), (8192, 1024, 64)]


@pytest.mark.parametrize("m", range(1, 17))
@pytest.mark.parametrize("layer", DECODE_LAYERS, ids=layer_id)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.gpu
def test_decode_sizes_match_float64(rng, dtype, layer, m):
    k, n, g = layer
    w = weight(k, n, g, dtype)
    check_against_float64(rng, w, weight64(k, n, g, dtype), m, bias=m % 2 == 1)


@pytest.mark.parametrize("m", [1, 3, 5, 8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.gpu
def test_decode_long_stream_matches_float64(rng, dtype, m):
    # 8192 x 10240 at m <= 8 takes the decode kernel's long-stream schedule
    # (warps of 1024 rows of k; decode_stream in ffi/decode_kernel.cu), where
    # g128 weights are scaled per group of fp32 sums: both of its
    # configurations (m <= 4 and m = 5..8), with and without a bias.
    w = weight(8192, 10240, 128, dtype)
    check_against_float64(rng, w, weight64(8192, 10240, 128, dtype), m, bias=m % 2 == 1)


@pytest.mark.gpu
def test_output_head_matches_float64(rng):
    # The Llama-3 output head (4096 x 128256), a row of the decode kernel's
    # measured table (two warps per 64-column chunk, 2004 chunks): m = 1 and 5
    # (the long-stream schedule) and 16. The weight is drawn on the GPU and the
    # float64 reference is formed by column blocks (the whole dequantized
    # weight in float64 would be 4.2 GB).
    k, n = 4096, 128256
    key = jax.random.key(k + n)
    w_float = jax.random.normal(key, (k, n), jnp.float32) * jax.random.uniform(
        jax.random.fold_in(key, 1), (1, n), jnp.float32, 0.5, 2.0)
    w = jm.quantize(w_float, group_size=128, dtype=jnp.float16)
    del w_float
    w32 = _dequantize32(w)
    xs = [activations(rng, "float16", m, k) for m in (1, 5, 16)]
    x64 = np.concatenate([np.asarray(x, np.float64) for x in xs])
    block = n // 8
    ref = np.concatenate([x64 @ np.asarray(w32[:, c:c + block], np.float64)
                          for c in range(0, n, block)], axis=1)
    del w32
    row = 0
    for x in xs:
        y = marlin(gpu(x), w)
        err = rel_err(y, ref[row:row + len(x)])
        print(f"output head m={len(x)}: rel err {err:.2e}")
        assert err <= TOL["float16"]
        row += len(x)


@pytest.mark.parametrize("m", [1, 8, 9, 16])
@pytest.mark.gpu
def test_decode_repeats_are_bit_identical(rng, m):
    # The partial sums of a column meet in a fixed order (k ranges of a block,
    # then the cluster's blocks by rank), so repeats give the same bits.
    w = weight(14336, 4096, 128, "float16")
    x = gpu(activations(rng, "float16", m, 14336))
    first = np.asarray(marlin(x, w))
    for _ in range(20):
        np.testing.assert_array_equal(np.asarray(marlin(x, w)), first)


# The prefill kernel's measured table (ffi/prefill_sm90.cu): each of its layers
# at m of every bucket and between buckets (a partial last m tile, the nearest
# bucket's tile and k split), against float64 on 64 rows x 512 columns of the
# output, the whole poisoned output checked for unwritten elements.
PREFILL_TABLE_LAYERS = [(8192, 10240), (8192, 8192), (8192, 57344), (28672, 8192),
                        (4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]
PREFILL_TABLE_MS = [64, 100, 128, 200, 256, 384, 512, 700, 1024, 1500, 2048, 4096]
PREFILL_TABLE_CASES = [(layer, m, "float16") for layer in PREFILL_TABLE_LAYERS
                       for m in PREFILL_TABLE_MS]
PREFILL_TABLE_CASES += [((4096, 4096), m, "bfloat16") for m in PREFILL_TABLE_MS]
# The table's stream-K entry (8192 x 10240 at m ~ 363..724) in bf16 too.
PREFILL_TABLE_CASES += [((8192, 10240), m, "bfloat16") for m in (384, 512, 700)]


@functools.lru_cache(maxsize=2)
def table_weight(k, n, dtype):
    """A g128 weight quantized on the GPU from random normal values."""
    return jm.quantize(jax.random.normal(jax.random.key(k + n), (k, n), jnp.float32),
                       group_size=128, dtype=jnp.dtype(dtype))


@functools.lru_cache(maxsize=2)
def table_columns(k, n, dtype, seed=0):
    """512 random columns of the layer and their float64 dequantized weight [k, 512]."""
    cols = np.sort(np.random.default_rng(seed).choice(n, 512, replace=False))
    w = jax.jit(lambda w: jm.dequantize(w, jnp.float32)[:, cols])(table_weight(k, n, dtype))
    return cols, np.asarray(w, np.float64)


@pytest.mark.parametrize("layer,m,dtype", PREFILL_TABLE_CASES,
                         ids=[f"{l[0]}x{l[1]}-m{m}-{dt}" for l, m, dt in PREFILL_TABLE_CASES])
@pytest.mark.gpu
def test_prefill_table_layers_match_float64(rng, layer, m, dtype):
    k, n = layer
    w = table_weight(k, n, dtype)
    cols, w64 = table_columns(k, n, dtype)
    x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(jnp.dtype(dtype))
    y = marlin(x, w)
    assert bool(jnp.isfinite(y.astype(jnp.float32)).all()), "unwritten (NaN) outputs"
    rows = np.sort(rng.choice(m, 64, replace=False))
    ref = np.asarray(x[rows], np.float64) @ w64
    err = rel_err(np.asarray(y[rows][:, cols]), ref)
    print(f"gpu rel err {dtype} k={k} n={n} m={m}: {err:.2e}")
    assert err <= TOL[dtype]


# --- zero points on every kernel path ------------------------------------------------
#
# Weights with random zero points 0..15 (imported_weight: the float64 weight is
# built from the integers, not by jax_marlin), on each kernel the launcher
# picks on sm_90: m = 1..16 the decode kernel (or, where its table says so,
# the Marlin kernel's 16-row tiles: 8192 x 1024 at m > 8), m = 17..63 the
# Marlin kernel's 32..64-row tiles, m >= 64 the prefill kernel (a partial last
# m tile at 100 and 1000; 576 x 1000 has a partial last n tile of 64 columns).
# Every group size, odd padded shapes, act-order on some; outputs poisoned. The
# kernels dequantize (q - z) s with one rounding, as (q - 8) s: the symmetric
# error budget (TOL) holds.
ZP_LAYERS = [(4096, 4096, 128), (4096, 6144, 32), (8192, 1024, 64), (28672, 1024, -1),
             (640, 192, 64), (1000, 576, 128), (576, 1000, 64), (4100, 130, -1)]
ZP_MS = [1, 2, 5, 8, 9, 13, 16, 17, 33, 63, 64, 100, 128, 256, 1000]
# Every m of the decode kernel on two layers (both halves of its 16-row m tile).
ZP_DECODE_CASES = [(layer, m) for layer in [(4096, 4096, 128), (640, 192, 64)]
                   for m in range(1, 17) if m not in ZP_MS]
# Every tile of the Marlin kernel with every group size, at m = 17 and 33
# (its 32- and 48-row tiles), and m = 1 on the decode kernel (the Marlin
# kernel's 16-row tiles elsewhere).
ZP_TILE_CASES = [((k, n, g), m) for k, n in TILE_SHAPES for g in (-1, 32, 64, 128)
                 if g == -1 or k % g == 0 for m in (1, 17, 33)]
# The Marlin kernel's 16-row tiles on sm_90 (m > 8 and k > 4096: not the
# decode kernel), each of the small-batch table's tiles: 128 x 128 (8192 x
# 1024 above), 128 x 64, 64 x 256 and 64 x 128 deep x wide.
ZP_TILE_CASES += [(layer, m) for layer in [(8192, 576, 64), (4160, 1024, 64), (4160, 1152, 32)]
                  for m in (9, 16)]


@functools.lru_cache(maxsize=None)
def zero_point_weight(k, n, group_size, dtype, act_order):
    """``(w, weight float64 [k, n])`` with random zero points (and act-order)."""
    rng = np.random.default_rng(k * 5 + n * 11 + group_size + act_order)
    return imported_weight(rng, k, n, group_size, zeros=True, act_order=act_order,
                           dtype=jnp.dtype(dtype))


def check_zero_points(rng, layer, m, dtype, *, act_order=False, bias=False):
    w, weight = zero_point_weight(*layer, dtype, act_order)
    assert w.zeros is not None and (w.perm is not None) == act_order
    check_against_float64(rng, w, weight, m, bias=bias)


ZP_CASES = [(layer, m) for layer in ZP_LAYERS for m in ZP_MS] + ZP_DECODE_CASES


@pytest.mark.parametrize("layer,m", ZP_CASES, ids=[f"{layer_id(l)}-m{m}" for l, m in ZP_CASES])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.gpu
def test_zero_points_match_float64(rng, dtype, layer, m):
    check_zero_points(rng, layer, m, dtype, bias=m % 2 == 1)


@pytest.mark.parametrize("m", [384, 512])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.gpu
def test_zero_points_stream_k_match_float64(rng, dtype, m):
    # 8192 x 10240 at m ~ 363..724 is a stream-K launch in the prefill table:
    # 128 x 256 tiles whose k stages are shared out among 132 blocks, a tile
    # cut between blocks added up by the last to finish it.
    check_zero_points(rng, (8192, 10240, 128), m, dtype, bias=m % 2 == 0)


@pytest.mark.parametrize("layer,m", ZP_TILE_CASES,
                         ids=[f"{layer_id(l)}-m{m}" for l, m in ZP_TILE_CASES])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.gpu
def test_zero_points_every_tile_match_float64(rng, dtype, layer, m):
    check_zero_points(rng, layer, m, dtype)


@pytest.mark.parametrize("m", [1, 16, 40, 128])
@pytest.mark.parametrize("layer", [(4096, 4096, 128), (1000, 576, 32)], ids=layer_id)
@pytest.mark.gpu
def test_zero_points_with_act_order_match_float64(rng, layer, m):
    check_zero_points(rng, layer, m, "float16", act_order=True, bias=True)


# Act-order without zero points on every path: the decode kernel gathers x as
# it loads it (m <= 2 on layers of up to 32M weights, m = 3..8 with k >
# 16384); the other kernels, and the decode kernel elsewhere, read it from
# the permutation pass, which stages a row in shared memory (up to the 227 KB
# a block may have on the H200: k <= 116224) or gathers it from global memory
# (k = 131072); 1000 x 576 and 4100 x 130 are padded.
AO_LAYERS = [(4096, 4096, 128), (28672, 1024, 128), (131072, 128, 128), (1000, 576, 32),
             (4100, 130, 64)]
AO_MS = [1, 5, 16, 17, 40, 64, 100, 256]


@functools.lru_cache(maxsize=None)
def act_order_weight(k, n, group_size, dtype):
    rng = np.random.default_rng(k * 7 + n * 13 + group_size)
    return imported_weight(rng, k, n, group_size, zeros=False, act_order=True,
                           dtype=jnp.dtype(dtype))


@pytest.mark.parametrize("m", AO_MS)
@pytest.mark.parametrize("layer", AO_LAYERS, ids=layer_id)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.gpu
def test_act_order_matches_float64(rng, dtype, layer, m):
    w, weight = act_order_weight(*layer, dtype)
    assert w.zeros is None and w.perm is not None
    check_against_float64(rng, w, weight, m, bias=m % 2 == 1)


@pytest.mark.parametrize("m", [1, 9, 17, 64, 256])
@pytest.mark.parametrize("layer", [(4096, 4096, 128), (28672, 1024, -1), (576, 1000, 64)],
                         ids=layer_id)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.gpu
def test_zero_points_gpu_matches_cpu(rng, dtype, layer, m):
    # The same packed zero points on both handlers.
    w, weight = zero_point_weight(*layer, dtype, False)
    x = activations(rng, dtype, m, w.k)
    y_gpu = marlin(gpu(x), w)
    y_cpu = marlin(on("cpu", x), on("cpu", w))
    ref = np.asarray(x, np.float64) @ weight
    assert rel_err(y_cpu, ref) <= CPU_TOL[dtype]
    err = rel_err(y_gpu, np.asarray(y_cpu, np.float64))
    print(f"zero points gpu-vs-cpu {dtype} {layer_id(layer)} m={m}: {err:.2e}")
    assert err <= (TOL[dtype] + CPU_TOL[dtype]) / (1 - CPU_TOL[dtype])


def with_zero_points_8(w):
    """``w`` with zero points that are all 8, stored (pack drops them)."""
    z8 = jnp.full((w.scales.shape[0], w.n_pad // 8), 0x88888888 - (1 << 32), jnp.int32)
    return jm.MarlinWeight(w.qweight, w.scales, w.k, w.n, w.group_size, zeros=gpu(z8))


@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.gpu
def test_zero_points_8_are_the_symmetric_kernel(rng, m):
    # The zero-point instances must give the symmetric ones' bits wherever
    # both round alike (every kernel on 4096 x 4096).
    w = weight(4096, 4096, 128, "float16")
    x = gpu(activations(rng, "float16", m, 4096))
    np.testing.assert_array_equal(np.asarray(marlin(x, with_zero_points_8(w))), np.asarray(marlin(x, w)))


@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.gpu
def test_zero_points_8_match_the_long_stream_schedule(rng, m):
    # In the decode kernel's long-stream schedule symmetric g128 weights are
    # scaled per group of fp32 sums, zero-point ones per dequantized weight:
    # the same product, rounded differently, both within TOL of float64.
    w = weight(8192, 10240, 128, "float16")
    x = activations(rng, "float16", m, 8192)
    ref = np.asarray(x, np.float64) @ weight64(8192, 10240, 128, "float16")
    for v in (w, with_zero_points_8(w)):
        assert rel_err(marlin(gpu(x), v), ref) <= TOL["float16"]


@pytest.mark.parametrize("m", [1, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.gpu
def test_zero_points_long_stream_match_float64(rng, dtype, m):
    # Random zero points in the decode kernel's long-stream schedule (8192 x
    # 10240 g128 at m <= 8), with act-order below (x permuted by the pass).
    check_zero_points(rng, (8192, 10240, 128), m, dtype, bias=m % 2 == 1)


@pytest.mark.gpu
def test_zero_points_long_stream_with_act_order_match_float64(rng):
    check_zero_points(rng, (8192, 10240, 128), 1, "float16", act_order=True, bias=True)


@pytest.mark.parametrize("m", [3, 8])
@pytest.mark.gpu
def test_act_order_long_stream_gather_matches_float64(rng, m):
    # 28672 x 8192 at m = 3..8: the decode kernel gathers x itself
    # (decode_gathers) in its long-stream schedule, x's rows past m unwritten.
    w, weight = act_order_weight(28672, 8192, 128, "float16")
    check_against_float64(rng, w, weight, m, bias=m % 2 == 1)


def test_every_tile_is_tested():
    # LAYERS and TILE_SHAPES reach every tile the launcher has, for small and
    # large batches (the tile choice is the C++ launcher's own).
    rules = jm.shapes.rules
    for ms in ([1], [17]):
        reached = {rules.choose_tile(m, n, k) for m in ms for k, n in TILE_SHAPES}
        assert reached == set(rules.TILES), ms
    assert all(jm.padded_shape(k, n, -1) == (k, n) for k, n in TILE_SHAPES)


def test_handler_rechecks_buffers(rng):
    # Calling the FFI target directly with inconsistent buffers gets an error
    # from the C++ checks, not a bad memory access.
    w = jm.quantize(random_weight(rng, 1024, 512), group_size=128)
    x = jnp.asarray(activations(rng, "float16", 4, 1024))
    no_bias = jnp.zeros((0,), jnp.float16)
    no_zeros = jnp.zeros((0, 0), jnp.int32)
    no_perm = jnp.zeros((0,), jnp.int32)
    ws_size, rs_size = jm.shapes.workspace_size(4, 512), jm.shapes.reduce_scratch_size(4, 512, 1024)
    assert rs_size == 16 * 512  # one 16-row block of fp32 partial sums
    assert ws_size == 512 // 64  # one lock per 64 columns of the one 16-row block

    def call(*args, y_dtype=jnp.float16, workspace=ws_size, scratch=rs_size, group_size=128):
        results = (jax.ShapeDtypeStruct((4, 512), y_dtype),
                   jax.ShapeDtypeStruct((workspace,), jnp.int32),
                   jax.ShapeDtypeStruct((scratch,), jnp.float32))
        f = jax.ffi.ffi_call("jax_marlin_matmul", results)
        # No residual, no prologue (tests/test_fusion.py checks those operands).
        return jax.block_until_ready(f(*args, no_bias, no_bias, group_size=group_size,
                                       poison_output=False, norm_eps=np.float32(0),
                                       norm_size=0, swiglu=False))

    y, _, _ = call(x, w.qweight, w.scales, no_zeros, no_perm, no_bias)  # the consistent call runs
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jm.matmul(x, w)))
    cases = [
        (dict(args=(x, w.qweight, w.scales[:2], no_zeros, no_perm, no_bias)), "scales must have shape"),
        (dict(args=(x, w.qweight, w.scales, no_zeros, no_perm, jnp.zeros(7, jnp.float16))), "bias must have shape"),
        (dict(args=(x, w.qweight, w.scales.astype(jnp.bfloat16), no_zeros, no_perm, no_bias)), "one dtype"),
        (dict(args=(x, w.qweight, w.scales, no_zeros, no_perm, no_bias), y_dtype=jnp.bfloat16), "one dtype"),
        (dict(args=(x.astype(jnp.float32), w.qweight, w.scales, no_zeros, no_perm, no_bias)), "float16 or bfloat16"),
        (dict(args=(x, w.qweight, w.scales, no_zeros, no_perm, no_bias), workspace=ws_size - 1), "workspace holds"),
        (dict(args=(x, w.qweight, w.scales, no_zeros, no_perm, no_bias), scratch=rs_size - 1),
         "reduce_scratch holds"),
        (dict(args=(x, w.qweight, w.scales, no_zeros, no_perm, no_bias), group_size=96), "group_size = 96 is not supported"),
        (dict(args=(x, w.qweight, w.scales, jnp.zeros((7, 64), jnp.int32), no_perm, no_bias)),
         r"zeros must have shape \[8, 64\] or \[0, 0\]"),
        (dict(args=(x, w.qweight, w.scales, jnp.zeros((8, 63), jnp.int32), no_perm, no_bias)),
         r"zeros must have shape \[8, 64\] or \[0, 0\]"),
        (dict(args=(x, w.qweight, w.scales, no_zeros, jnp.zeros(1000, jnp.int32), no_bias)),
         r"perm must have shape \[1024\] or \[0\]"),
        # An act-order call needs room for the permuted x in its scratch.
        (dict(args=(x, w.qweight, w.scales, no_zeros, jnp.arange(1024, dtype=jnp.int32), no_bias)),
         "reduce_scratch holds"),
    ]
    for kwargs, match in cases:
        with pytest.raises(Exception, match=match):
            call(*kwargs.pop("args"), **kwargs)


@pytest.mark.parametrize("platform", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
# CUDA: the decode kernel's gather (m = 1), the permutation pass before the
# decode (m = 4) and the prefill kernel (m = 80).
@pytest.mark.parametrize("m", [1, 4, 80])
def test_handler_clamps_perm(rng, m, platform):
    # An act-order index out of range is clamped, never read past x: the
    # Python API builds only permutations, but the FFI target may be called
    # directly.
    k, n = 1024, 512
    w = jm.quantize(random_weight(rng, k, n), group_size=128)
    x = jnp.asarray(activations(rng, "float16", m, k))
    perm = rng.permutation(k).astype(np.int32)
    perm[:3] = [-7, k, 2**30]
    results = (jax.ShapeDtypeStruct((m, n), jnp.float16),
               jax.ShapeDtypeStruct((jm.shapes.workspace_size(m, n),), jnp.int32),
               jax.ShapeDtypeStruct((jm.shapes.reduce_scratch_size(m, n, k, True),), jnp.float32))
    f = jax.ffi.ffi_call("jax_marlin_matmul", results)
    assert x.devices() == {jax.devices(platform)[0]}
    none = jnp.zeros((0,), jnp.float16)
    y, _, _ = f(x, w.qweight, w.scales, jnp.zeros((0, 0), jnp.int32), jnp.asarray(perm), none,
                none, none, group_size=128, poison_output=True, norm_eps=np.float32(0),
                norm_size=0, swiglu=False)
    expected = jm.matmul(x[:, np.clip(perm, 0, k - 1)], w)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(expected))
