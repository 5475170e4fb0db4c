"""jm.matmul (ops) on the CPU handler: against the jnp reference and float64, padding,
bias, autodiff, vmap, argument checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_marlin as jm
from conftest import (
    BF16_U,
    FP16_U,
    float64_reference,
    imported_weight,
    random_weight,
    random_x,
    rel_err,
)
from jax_marlin.ops import _matmul

# The CPU handler and the reference compute x @ W (+ bias) exactly up to fp32
# accumulation (W's values (q - 8) * scale are exact in fp32) and round once to
# the output dtype: ||y - ref|| / ||ref|| <= its unit roundoff plus the fp32
# accumulation error, far below 1e-5 at these sizes.
TOL = FP16_U + 1e-5
BF16_TOL = BF16_U + 1e-5
TOLS = {np.dtype(np.float16): TOL, np.dtype(jnp.bfloat16): BF16_TOL}
DTYPES = [np.float16, jnp.bfloat16]
DTYPE_IDS = ["f16", "bf16"]

MS = [1, 2, 3, 16, 17, 64, 100, 128, 1024]
LAYERS = [(128, 128, 128), (256, 192, -1), (1024, 512, 128), (512, 320, 128), (192, 256, -1),
          (256, 320, 32), (512, 192, 64)]
# Shapes the kernel runs only padded (tests/test_packing.py::ODD has their padded shapes).
ODD = [(576, 192), (576, 1000), (1000, 576), (4100, 130)]


def poisoned(x, w, bias=None):
    """jm.matmul whose output buffer starts as NaN: an unwritten element shows."""
    return jax.jit(lambda x, w, b: _matmul(x, w, b, poison_output=True))(x, w, bias)


@pytest.fixture(scope="module")
def weights():
    rng = np.random.default_rng(1234)
    with jax.default_device(jax.devices("cpu")[0]):
        return {layer: jm.quantize(random_weight(rng, layer[0], layer[1]), group_size=layer[2])
                for layer in LAYERS}


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("layer", LAYERS, ids=lambda l: "k%d-n%d-g%d" % l)
def test_cpu_matches_reference_and_float64(rng, weights, m, layer):
    k, n, _ = layer
    w = weights[layer]
    x = random_x(rng, m, k)
    ref = float64_reference(x, w)
    y = poisoned(x, w)
    assert y.shape == (m, n) and y.dtype == jnp.float16
    assert rel_err(y, ref) <= TOL
    assert rel_err(jm.reference.matmul(x, w), ref) <= TOL


@pytest.mark.parametrize("m", [1, 33])
@pytest.mark.parametrize("group_size", [-1, 32, 64, 128])
def test_bf16_and_fp16_on_the_same_inputs(rng, group_size, m):
    # Weights and activations exactly representable in both dtypes (bfloat16
    # values in float16's range): the two products are the same real numbers,
    # and only the rounding of y differs.
    k, n = 512, 384
    groups = 1 if group_size == -1 else k // group_size
    q = rng.integers(0, 16, size=(k, n))
    scales = rng.uniform(0.01, 0.1, size=(groups, n)).astype(jnp.bfloat16)
    x_values = rng.standard_normal((m, k)).astype(jnp.bfloat16)
    refs = []
    for dtype in DTYPES:
        w = jm.pack(q, scales, group_size=group_size, dtype=dtype)
        x = x_values.astype(dtype)
        y = poisoned(x, w)
        assert y.dtype == dtype and w.scales.dtype == dtype
        ref = float64_reference(x, w)
        assert rel_err(y, ref) <= TOLS[np.dtype(dtype)]
        assert rel_err(jm.reference.matmul(x, w), ref) <= TOLS[np.dtype(dtype)]
        refs.append(ref)
    np.testing.assert_array_equal(refs[0], refs[1])


@pytest.mark.parametrize("group_size", [-1, 32, 64, 128])
@pytest.mark.parametrize("k,n", ODD)
def test_odd_shapes_are_padded(rng, k, n, group_size):
    w = jm.quantize(random_weight(rng, k, n), group_size=group_size)
    assert w.padded_shape != (k, n)
    x = random_x(rng, 3, 7, k)  # m = 21: a partial row block of the kernel
    y = poisoned(x, w)
    assert y.shape == (3, 7, n) and y.dtype == jnp.float16
    assert rel_err(y, float64_reference(x, w)) <= TOL


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("k,n,group_size", [(512, 320, 128), (1000, 576, 64), (576, 1000, -1)])
def test_fused_bias(rng, k, n, group_size, dtype):
    w = jm.quantize(random_weight(rng, k, n), group_size=group_size, dtype=dtype)
    x = random_x(rng, 2, 9, k, dtype=dtype)
    # A bias of the size of the products, so that a missing, doubled or
    # misplaced (padded-column) bias is far outside the tolerance.
    bias = (rng.standard_normal(n) * np.sqrt(k)).astype(dtype)
    ref = float64_reference(x, w, bias)
    y = poisoned(x, w, bias)
    assert y.shape == (2, 9, n) and y.dtype == dtype
    # The bias is added to the fp32 product before the one rounding.
    assert rel_err(y, ref) <= TOLS[np.dtype(dtype)]
    assert rel_err(jm.reference.matmul(x, w, bias), ref) <= TOLS[np.dtype(dtype)]
    np.testing.assert_array_equal(np.asarray(jm.matmul(x, w, bias=bias)), np.asarray(y))


def test_bias_with_vmap(rng):
    k, n = 200, 100  # padded: x and the bias are padded under vmap too
    ws = [jm.quantize(random_weight(rng, k, n), group_size=32) for _ in range(3)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *ws)
    x = random_x(rng, 3, 4, k)
    biases = (rng.standard_normal((3, n)) * 8).astype(np.float16)

    def each(fn):
        return [np.asarray(fn(i)) for i in range(3)]

    # over the bias only
    y = jax.vmap(lambda b: jm.matmul(x[0], ws[0], bias=b))(biases)
    np.testing.assert_array_equal(np.asarray(y), each(lambda i: jm.matmul(x[0], ws[0], biases[i])))
    # over x, one bias
    y = jax.vmap(jm.matmul, in_axes=(0, None, None))(x, ws[0], biases[0])
    np.testing.assert_array_equal(np.asarray(y), each(lambda i: jm.matmul(x[i], ws[0], biases[0])))
    # over x, weights and biases together, under jit
    y = jax.jit(jax.vmap(jm.matmul))(x, stacked, biases)
    np.testing.assert_array_equal(np.asarray(y), each(lambda i: jm.matmul(x[i], ws[i], biases[i])))
    for i in range(3):
        assert rel_err(y[i], float64_reference(x[i], ws[i], biases[i])) <= TOL


def test_bias_is_differentiable(rng):
    w = jm.quantize(random_weight(rng, 256, 192), group_size=128)
    x = random_x(rng, 6, 256)
    bias = random_x(rng, 192)
    # Small integers: exact in float16, and so are their sums over the 6 rows.
    cotangent = rng.integers(-8, 8, size=(6, 192)).astype(np.float32)

    def loss(b):
        return jnp.sum(jm.matmul(x, w, bias=b).astype(jnp.float32) * cotangent)

    grad = jax.jit(jax.grad(loss))(bias)
    # d loss / d bias = the cotangent summed over rows
    np.testing.assert_array_equal(np.asarray(grad, np.float32), cotangent.sum(0))
    y, y_dot = jax.jvp(lambda b: jm.matmul(x, w, bias=b), (bias,), (jnp.ones_like(bias),))
    np.testing.assert_array_equal(np.asarray(y_dot), np.ones((6, 192), np.float16))


def test_aligned_shapes_cost_nothing(rng, weights):
    # No pad of x or bias and no slice of y around the kernel when the weight
    # runs unpadded; both for a padded one.
    def ops(w, m=4):
        x = jnp.zeros((m, w.k), w.dtype)
        bias = jnp.zeros((w.n,), w.dtype)
        text = jax.jit(lambda x, w, b: jm.matmul(x, w, bias=b)).lower(x, w, bias).as_text()
        return {op for op in ("pad", "slice") if f"stablehlo.{op}" in text}

    w = weights[(1024, 512, 128)]
    assert w.padded_shape == (1024, 512)
    assert not ops(w) & {"pad", "slice"}
    assert {"pad", "slice"} <= ops(jm.quantize(random_weight(rng, 1000, 500)))


def test_eager_and_jit_agree(rng, weights):
    w = weights[(1024, 512, 128)]
    x = random_x(rng, 5, 1024)
    np.testing.assert_array_equal(np.asarray(jm.matmul(x, w)),
                                  np.asarray(jax.jit(jm.matmul)(x, w)))


def test_leading_dims_fold_into_m(rng, weights):
    w = weights[(256, 192, -1)]
    x = random_x(rng, 2, 3, 5, 256)
    y = jm.matmul(x, w)
    assert y.shape == (2, 3, 5, 192)
    flat = jm.matmul(x.reshape(-1, 256), w)
    np.testing.assert_array_equal(np.asarray(y).reshape(-1, 192), np.asarray(flat))
    assert jm.matmul(x[0, 0, 0], w).shape == (192,)  # a single vector [k]


def test_empty_batch(weights):
    w = weights[(128, 128, 128)]
    y = jax.jit(jm.matmul)(jnp.zeros((0, 128), jnp.float16), w)
    assert y.shape == (0, 128)


def test_vmap_over_x(rng, weights):
    w = weights[(512, 320, 128)]
    x = random_x(rng, 4, 7, 512)
    y = jax.vmap(jm.matmul, in_axes=(0, None))(x, w)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jm.matmul(x, w)))
    # batch axis in the middle of x
    y1 = jax.vmap(jm.matmul, in_axes=(1, None))(x, w)
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(jm.matmul(x, w)).transpose(1, 0, 2))
    # nested vmap under jit
    y2 = jax.jit(jax.vmap(jax.vmap(jm.matmul, in_axes=(0, None)), in_axes=(0, None)))(x[:, :, None], w)
    np.testing.assert_array_equal(np.asarray(y2)[:, :, 0], np.asarray(y))


def test_vmap_over_weights(rng):
    ws = [jm.quantize(random_weight(rng, 128, 64), group_size=128) for _ in range(3)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *ws)
    x = random_x(rng, 3, 2, 128)
    y = jax.vmap(jm.matmul)(x, stacked)
    for i, w in enumerate(ws):
        np.testing.assert_array_equal(np.asarray(y[i]), np.asarray(jm.matmul(x[i], w)))
    # shared x, batched weights
    y_shared = jax.vmap(jm.matmul, in_axes=(None, 0))(x[0], stacked)
    for i, w in enumerate(ws):
        np.testing.assert_array_equal(np.asarray(y_shared[i]), np.asarray(jm.matmul(x[0], w)))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_poison_is_overwritten(rng, dtype):
    # A poisoned run writes every element: no NaN survives, same bits as unpoisoned.
    w = jm.quantize(random_weight(rng, 512, 320), group_size=128, dtype=dtype)
    x = random_x(rng, 33, 512, dtype=dtype)
    np.testing.assert_array_equal(np.asarray(poisoned(x, w)), np.asarray(jm.matmul(x, w)))


@pytest.mark.parametrize(
    "make,error,match",
    [
        (lambda x, w: (x.astype(np.float32), w), TypeError,
         "x.dtype is float32 but the weight's scales are float16"),
        (lambda x, w: (x.astype(jnp.bfloat16), w), TypeError,
         "x.dtype is bfloat16 but the weight's scales are float16.*dtype=jnp.bfloat16"),
        (lambda x, w: (x, w, np.ones(512, np.float32)), TypeError,
         "bias.dtype is float32 but x.dtype is float16"),
        (lambda x, w: (x, w, np.ones(100, np.float16)), ValueError,
         r"bias.shape = \(100,\), expected \(512,\)"),
        (lambda x, w: (x, w, np.ones((1, 512), np.float16)), ValueError,
         r"bias.shape = \(1, 512\)"),
        (lambda x, w: (x[:, :100], w), ValueError, r"x.shape\[-1\] = 100"),
        (lambda x, w: (x, w.qweight), TypeError, "MarlinWeight"),
        (lambda x, w: (x, jm.MarlinWeight(w.qweight[:4], w.scales, w.k, w.n, w.group_size)),
         ValueError, "qweight.shape"),
        (lambda x, w: (x, jm.MarlinWeight(w.qweight, w.scales[:1], w.k, w.n, w.group_size)),
         ValueError, "scales.shape"),
        (lambda x, w: (x.astype(np.float32), jm.MarlinWeight(
            w.qweight, w.scales.astype(jnp.float32), w.k, w.n, w.group_size)), TypeError,
         "scales.dtype is float32, expected float16 or bfloat16"),
        (lambda x, w: (x, jm.MarlinWeight(w.qweight.astype(jnp.uint32), w.scales, w.k, w.n,
                                          w.group_size)), TypeError, "qweight.dtype"),
        (lambda x, w: (x, jm.MarlinWeight(w.qweight, w.scales, w.k, w.n, 96)), ValueError,
         "group_size = 96"),
    ],
)
def test_bad_input_raises_at_trace_time(rng, weights, make, error, match):
    w = weights[(1024, 512, 128)]
    x = random_x(rng, 4, 1024)
    args = make(x, w)
    with pytest.raises(error, match=match):
        jax.jit(jm.matmul).trace(*args)
    with pytest.raises(error, match=match):
        jm.matmul(*args)


def test_each_check_runs_once_per_trace(rng, weights, monkeypatch):
    # The user's arguments are checked once (ops), the kernel's operands once
    # (the primitive's abstract eval); nothing in between re-checks them.
    from jax_marlin import shapes

    calls = {"padded_shape": 0, "check_operands": 0}
    for name in calls:
        def counted(*args, _name=name, _f=getattr(shapes, name), **kwargs):
            calls[_name] += 1
            return _f(*args, **kwargs)
        monkeypatch.setattr(shapes, name, counted)
    w = weights[(512, 320, 128)]
    x, bias = random_x(rng, 5, 512), random_x(rng, 320)
    jax.clear_caches()  # an inner jit traced by an earlier test would skip its checks
    jax.jit(jm.matmul).lower(x, w, bias)
    assert calls == {"padded_shape": 1, "check_operands": 1}


# --- zero points and act-order -------------------------------------------------------
#
# The kernel dequantizes (q - z) s exactly like (q - 8) s, so y is rounded once
# with zero points too: the TOLS of a symmetric weight.


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("zeros, act_order", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("k,n,group_size", [(512, 320, 128), (1000, 576, 64), (576, 1000, -1),
                                          (576, 192, 32)])
def test_zeros_and_act_order_against_float64(rng, k, n, group_size, zeros, act_order, dtype):
    act_order = act_order and group_size != -1  # one group: any row order is the same
    w, weight = imported_weight(rng, k, n, group_size, zeros=zeros, act_order=act_order,
                                dtype=dtype)
    x = random_x(rng, 2, 17, k, dtype=dtype)
    bias = random_x(rng, n, dtype=dtype)
    ref = np.asarray(x, np.float64) @ weight + np.asarray(bias, np.float64)
    y = poisoned(x, w, bias)
    assert y.shape == (2, 17, n) and y.dtype == dtype
    assert rel_err(y, ref) <= TOLS[np.dtype(dtype)]
    np.testing.assert_array_equal(np.asarray(jax.jit(jm.matmul)(x, w, bias)), np.asarray(y))
    # The reference honours both too.
    assert rel_err(jm.reference.matmul(x, w, bias), ref) <= TOLS[np.dtype(dtype)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("group_size", [128, -1])
def test_zero_point_zero_is_rounded_once(rng, group_size, dtype):
    # Zero point 0 everywhere (all-positive weights): (q - 8) s and 8 s are
    # both larger than the weight, so a product of the kernel at zero point 8
    # corrected afterwards would round a larger value first; the kernel's own
    # (q - 0) s rounds y once.
    k, n = 2048, 256
    q = rng.integers(0, 16, (k, n))
    groups = 1 if group_size == -1 else k // group_size
    scales = rng.uniform(0.5, 2.0, (groups, n)).astype(dtype) / 16
    w = jm.pack(q, scales, group_size, zeros=np.zeros((groups, n), np.int64))
    rows = k if group_size == -1 else group_size
    weight = q * np.repeat(np.asarray(scales, np.float64), rows, axis=0)
    x = random_x(rng, 16, k, dtype=dtype)
    err = rel_err(poisoned(x, w, None), np.asarray(x, np.float64) @ weight)
    assert err <= TOLS[np.dtype(dtype)]


def test_zeros_and_act_order_vmap(rng):
    ws, weights = zip(*(imported_weight(rng, 256, 128, 64) for _ in range(3)))
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *ws)
    x = random_x(rng, 3, 5, 256)
    # batched x, one weight
    y = jax.vmap(jm.matmul, in_axes=(0, None))(x, ws[0])
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jm.matmul(x, ws[0])))
    # batched weights (perm and zeros batched with them)
    y = jax.jit(jax.vmap(jm.matmul))(x, stacked)
    for i, w in enumerate(ws):
        np.testing.assert_array_equal(np.asarray(y[i]), np.asarray(jm.matmul(x[i], w)))
        ref = np.asarray(x[i], np.float64) @ weights[i]
        assert rel_err(y[i], ref) <= TOLS[np.dtype(np.float16)]


def test_act_order_permutes_x_inside_the_kernel_call(rng):
    # No gather of x in the jitted call: the kernel call takes the weight's
    # perm and permutes x itself (jm.matmul's docstring).
    w, _ = imported_weight(rng, 256, 128, 64, zeros=False)
    x = random_x(rng, 4, 256)
    text = jax.jit(jm.matmul).lower(x, w).compile().as_text()
    assert "gather" not in text
    calls = [line for line in text.splitlines() if 'custom_call_target="jax_marlin_matmul"' in line]
    assert len(calls) == 1 and "s32[256]" in calls[0]
