"""Derivatives of jm.matmul: JVP and transpose (linear in x), bias, jit, vmap,
sharding on 8 host devices, nnx.grad over frozen quantized layers, and the
error for a derivative with respect to the weight."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jax_marlin as jm
from conftest import BF16_U, FP16_U, random_weight, random_x, rel_err
from jax_marlin.flax import MarlinLinear, QuantizedWeight, quantize_model

# The tangent x_dot @ W goes through the kernel: one rounding of a float32
# accumulation, as the forward (tests/test_ops.py). The cotangent dy @ W^T
# rounds each dequantized weight to the dtype (at most u per element, so at
# most u on the norm) and the result once: 2 u, plus float32 accumulation.
FWD_TOLS = {np.dtype(np.float16): FP16_U + 1e-5, np.dtype(jnp.bfloat16): BF16_U + 1e-5}
BWD_TOLS = {np.dtype(np.float16): 2 * FP16_U + 1e-5, np.dtype(jnp.bfloat16): 2 * BF16_U + 1e-5}
DTYPES = [np.float16, jnp.bfloat16]
DTYPE_IDS = ["f16", "bf16"]
# (k, n, group_size): aligned, per-column, and two shapes stored padded.
LAYERS = [(256, 192, 128), (192, 256, -1), (576, 192, 64), (1000, 130, 32)]


def _dense(w):
    """The dequantized weight in float64: what every derivative is compared with."""
    return np.asarray(jm.dequantize(w, jnp.float32), np.float64)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layer", LAYERS, ids=lambda l: "k%d-n%d-g%d" % l)
def test_grad_and_jvp_match_float64(rng, layer, dtype):
    k, n, g = layer
    w = jm.quantize(random_weight(rng, k, n), group_size=g, dtype=dtype)
    wd = _dense(w)
    x = random_x(rng, 2, 3, k, dtype=dtype)
    x_dot = random_x(rng, 2, 3, k, dtype=dtype)
    bias = random_x(rng, n, dtype=dtype)
    bias_dot = random_x(rng, n, dtype=dtype)
    cotangent = rng.standard_normal((2, 3, n)).astype(np.float32)

    def loss(x, b):
        return jnp.sum(jm.matmul(x, w, bias=b).astype(jnp.float32) * cotangent)

    gx, gb = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, bias)
    assert gx.dtype == dtype and gx.shape == x.shape
    assert rel_err(gx, cotangent.astype(np.float64) @ wd.T) <= BWD_TOLS[np.dtype(dtype)]
    # The bias cotangent sums the float32 cotangent, then rounds once.
    assert rel_err(gb, cotangent.sum((0, 1))) <= FWD_TOLS[np.dtype(dtype)]

    y, y_dot = jax.jit(lambda *a: jax.jvp(lambda x, b: jm.matmul(x, w, bias=b), a[:2], a[2:]))(
        x, bias, x_dot, bias_dot)
    ref_dot = np.asarray(x_dot, np.float64) @ wd + np.asarray(bias_dot, np.float64)
    # x_dot W rounded once, then the bias tangent added and rounded again.
    assert rel_err(y_dot, ref_dot) <= 2 * FWD_TOLS[np.dtype(dtype)]
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jm.matmul(x, w, bias=bias)))


def test_tangent_is_the_same_matmul(rng):
    # Linear in x: the tangent of x is x_dot through the same op, bit for bit.
    w = jm.quantize(random_weight(rng, 256, 192), group_size=128)
    x, x_dot = random_x(rng, 5, 256), random_x(rng, 5, 256)
    _, y_dot = jax.jvp(lambda x: jm.matmul(x, w), (x,), (x_dot,))
    np.testing.assert_array_equal(np.asarray(y_dot), np.asarray(jm.matmul(x_dot, w)))


def test_linear_transpose(rng):
    w = jm.quantize(random_weight(rng, 576, 192), group_size=64)
    x = random_x(rng, 4, 576)
    dy = random_x(rng, 4, 192)
    (dx,) = jax.linear_transpose(lambda x: jm.matmul(x, w), x)(dy)
    assert rel_err(dx, np.asarray(dy, np.float64) @ _dense(w).T) <= BWD_TOLS[np.dtype(np.float16)]
    # <dy, x W> == <dy W^T, x>: the transpose is the adjoint of the op.
    lhs = np.sum(np.asarray(dy, np.float64) * (np.asarray(x, np.float64) @ _dense(w)))
    rhs = np.sum(np.asarray(dx, np.float64) * np.asarray(x, np.float64))
    assert abs(lhs - rhs) <= 4 * FP16_U * np.sqrt(x.size * 192) * np.abs(lhs).max() + 1e-3 * abs(lhs)


def test_check_grads(rng):
    # Finite differences of the op itself. It is linear in x, so central
    # differences are exact up to rounding for any step: eps = 1 keeps the
    # float16 roundings of x + eps v (cast inside) and of y at about u |y| / eps,
    # and check_grads' rtol = atol = 1e-2 is 20 u with room for the projections.
    w = jm.quantize(random_weight(rng, 128, 128), group_size=128)
    x = random_x(rng, 3, 128).astype(np.float32)

    def op(x):
        return jm.matmul(x.astype(jnp.float16), w).astype(jnp.float32)

    check_grads(op, (x,), order=1, modes=("fwd", "rev"), eps=1.0, atol=1e-2, rtol=1e-2)
    # Second order: the gradient of |y|^2 / 2 is y W^T, linear in x; its JVP
    # along x is (x W) W^T.
    hvp = jax.jvp(jax.grad(lambda x: jnp.sum(op(x) ** 2) / 2), (x,), (x,))[1]
    y = np.asarray(x, np.float64) @ _dense(w)
    assert rel_err(hvp, y @ _dense(w).T) <= 4 * FP16_U


def test_grad_under_vmap(rng):
    w = jm.quantize(random_weight(rng, 256, 192), group_size=128)
    xs = random_x(rng, 3, 4, 256)

    def loss(x):
        return jnp.sum(jm.matmul(x, w).astype(jnp.float32) ** 2)

    per_example = jax.jit(jax.vmap(jax.grad(loss)))(xs)
    whole = jax.jit(jax.grad(lambda xs: jnp.sum(jax.vmap(loss)(xs))))(xs)
    np.testing.assert_array_equal(np.asarray(per_example), np.asarray(whole))
    # each example against its own unbatched gradient
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(per_example[i]), np.asarray(jax.grad(loss)(xs[i])))


def test_grad_with_batched_weights(rng):
    ws = [jm.quantize(random_weight(rng, 128, 64), group_size=128) for _ in range(3)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *ws)
    xs = random_x(rng, 3, 2, 128)
    cotangent = random_x(rng, 3, 2, 64).astype(np.float32)

    def loss(x, w, ct):
        return jnp.sum(jm.matmul(x, w).astype(jnp.float32) * ct)

    g = jax.jit(jax.vmap(jax.grad(loss)))(xs, stacked, cotangent)
    for i, w in enumerate(ws):
        ref = cotangent[i].astype(np.float64) @ _dense(w).T
        assert rel_err(g[i], ref) <= BWD_TOLS[np.dtype(np.float16)]
    # jvp of a vmap over the weights
    _, y_dot = jax.jvp(lambda x: jax.vmap(jm.matmul)(x, stacked), (xs,), (xs,))
    np.testing.assert_array_equal(np.asarray(y_dot), np.asarray(jax.vmap(jm.matmul)(xs, stacked)))


# --- the weight is frozen --------------------------------------------------------------


def test_derivative_wrt_weight_raises(rng):
    w = jm.quantize(random_weight(rng, 128, 64), group_size=128)
    x = random_x(rng, 2, 128)

    def loss(x, w):
        return jnp.sum(jm.matmul(x, w).astype(jnp.float32))

    match = "no derivative with respect to the quantized weight.*stop_gradient.*nnx.Param"
    # the scales are float leaves: a gradient would silently be a guess
    with pytest.raises(TypeError, match=match):
        jax.grad(lambda s: loss(x, jm.MarlinWeight(w.qweight, s, w.k, w.n, w.group_size)))(w.scales)
    with pytest.raises(TypeError, match=match):
        jax.grad(loss, argnums=1, allow_int=True)(x, w)
    with pytest.raises(TypeError, match=match):
        jax.vjp(loss, x, w)
    with pytest.raises(TypeError, match=match):
        jax.jvp(lambda s: jm.matmul(x, jm.MarlinWeight(w.qweight, s, w.k, w.n, w.group_size)),
                (w.scales,), (jnp.ones_like(w.scales),))
    # stop_gradient (or closing over the weight) is the way out
    frozen = jax.grad(lambda x, w: loss(x, jax.lax.stop_gradient(w)), allow_int=True)(x, w)
    np.testing.assert_array_equal(np.asarray(frozen), np.asarray(jax.grad(loss)(x, w)))


# --- sharding --------------------------------------------------------------------------

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def _collectives(fn, *args) -> dict[str, int]:
    text = jax.jit(fn).lower(*args).compile().as_text()
    return {c: n for c in COLLECTIVES if (n := len(re.findall(rf" {c}(?:-start)?\(", text)))}


def _mesh(axis_type):
    if len(jax.devices("cpu")) < 8:
        pytest.skip("needs 8 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count)")
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2,
                         devices=jax.devices("cpu")[:8])


@pytest.fixture(scope="module")
def mesh():
    return _mesh(AxisType.Auto)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("layout", ["column", "row"])
def test_sharded_gradient(rng, layout, axis_type):
    # The transpose of a column-parallel layer is row parallel: the cotangent
    # of x sums over the sharded n, one all-reduce. The transpose of a
    # row-parallel layer is column parallel: none (the loss is linear in y,
    # so the forward, with its all-reduce, is not computed).
    k, n, m = 256, 1024, 16
    if layout == "row":
        k, n = n, k
    w = jm.quantize(random_weight(rng, k, n) / np.sqrt(k), group_size=128)
    x = random_x(rng, m, k)
    cotangent = random_x(rng, m, n).astype(np.float32)

    def loss(x, w):
        return jnp.sum(jm.matmul(x, w).astype(jnp.float32) * cotangent)

    mesh = _mesh(axis_type)  # jax.make_mesh's default is Explicit
    spec = P(None, "model") if layout == "column" else P("model", None)
    args = (jax.device_put(x, NamedSharding(mesh, P("data"))), jm.shard_weight(w, mesh, spec))
    expected = {"all-reduce": 1} if layout == "column" else {}
    if layout == "row" and axis_type == AxisType.Explicit:
        # x's type says [m over data, k replicated]: its cotangent, computed
        # with k sharded, is gathered along k to that type.
        expected = {"all-gather": 1}
    assert _collectives(jax.grad(loss), *args) == expected
    g = jax.jit(jax.grad(loss))(*args)
    if axis_type == AxisType.Explicit:  # the cotangent has x's sharding
        assert g.sharding.spec == P("data", None)
    assert rel_err(g, cotangent.astype(np.float64) @ _dense(w).T) <= BWD_TOLS[np.dtype(np.float16)]


def test_megatron_mlp_gradient(rng, mesh):
    # up column parallel, down row parallel: the forward's one all-reduce
    # (down's) and the backward's one (up's cotangent of x).
    d, f, m = 256, 1024, 16
    up = jm.quantize(random_weight(rng, d, f) / np.sqrt(d), group_size=128)
    down = jm.quantize(random_weight(rng, f, d) / np.sqrt(f), group_size=128)
    x = random_x(rng, m, d)

    def loss(x, up, down):
        return jnp.sum(jm.matmul(jax.nn.relu(jm.matmul(x, up)), down).astype(jnp.float32) ** 2)

    args = (jax.device_put(x, NamedSharding(mesh, P("data"))),
            jm.shard_weight(up, mesh, P(None, "model")), jm.shard_weight(down, mesh, P("model", None)))
    assert _collectives(jax.grad(loss), *args) == {"all-reduce": 2}
    expected = np.asarray(jax.jit(jax.grad(loss))(x, up, down), np.float64)
    # Row parallel forward adds float16 partials (tests/test_partitioning.py):
    # a few u on top of the backward's own rounding.
    assert rel_err(jax.jit(jax.grad(loss))(*args), expected) <= 4 * FP16_U


# --- Flax NNX --------------------------------------------------------------------------


class Adapted(nnx.Module):
    """A frozen 4-bit projection with a float LoRA adapter and a float layer before it."""

    def __init__(self, rngs):
        self.pre = nnx.Linear(128, 256, dtype=jnp.float16, param_dtype=jnp.float16, rngs=rngs)
        self.proj = nnx.Linear(256, 192, dtype=jnp.float16, param_dtype=jnp.float16, rngs=rngs)
        self.lora = nnx.LoRA(256, 4, 192, dtype=jnp.float16, param_dtype=jnp.float16, rngs=rngs)

    def __call__(self, x):
        h = jax.nn.silu(self.pre(x))
        return self.proj(h) + self.lora(h)


def test_nnx_grad_through_frozen_layers(rng):
    model = quantize_model(Adapted(nnx.Rngs(0)), filter=lambda path, m: "proj" in path)
    assert isinstance(model.proj, MarlinLinear) and isinstance(model.pre, nnx.Linear)
    x = random_x(rng, 6, 128)
    before = jax.tree.map(np.asarray, nnx.state(model, QuantizedWeight))

    def loss(model):
        return jnp.mean(model(x).astype(jnp.float32) ** 2)

    grads = nnx.jit(nnx.grad(loss))(model)
    assert "weight" not in grads["proj"]
    # the layer before the quantized one gets its gradient through it
    g_pre = np.asarray(grads["pre"]["kernel"][...], np.float32)
    assert np.isfinite(g_pre).all() and np.abs(g_pre).max() > 0
    # ... the same as with the dequantized weight in a float layer
    w = model.proj.weight.get_value()
    dense = Adapted(nnx.Rngs(0))
    dense.proj.kernel.set_value(jm.dequantize(w, jnp.float16))
    nnx.update(dense, nnx.state(model, nnx.Param))
    g_dense = np.asarray(nnx.grad(loss)(dense)["pre"]["kernel"][...], np.float64)
    assert rel_err(g_pre, g_dense) <= 8 * FP16_U
    for name in ("lora_a", "lora_b"):
        assert np.isfinite(np.asarray(grads["lora"][name][...], np.float32)).all()
    after = jax.tree.map(np.asarray, nnx.state(model, QuantizedWeight))
    jax.tree.map(np.testing.assert_array_equal, before, after)


@pytest.mark.parametrize("zeros,act_order", [(True, False), (False, True), (True, True)],
                         ids=["zeros", "act-order", "both"])
def test_grad_of_imported_weights_matches_float64(rng, zeros, act_order):
    # Weights with zero points and act-order: the kernel dequantizes with the
    # zero points and x is permuted, the transpose goes through jm.dequantize,
    # which honours both; the float64 weight is built from the integers.
    from conftest import imported_weight

    w, weight = imported_weight(rng, 256, 128, 64, zeros=zeros, act_order=act_order)
    x = random_x(rng, 3, 256, dtype=np.float16)
    cotangent = rng.standard_normal((3, 128)).astype(np.float32)

    def loss(x):
        return jnp.sum(jm.matmul(x, w).astype(jnp.float32) * cotangent)

    gx = jax.jit(jax.grad(loss))(x)
    assert rel_err(gx, cotangent.astype(np.float64) @ weight.T) <= BWD_TOLS[np.dtype(np.float16)]
    y, y_dot = jax.jvp(lambda x: jm.matmul(x, w), (x,), (x,))
    # One rounding of y, zero points or not (ops.matmul's docstring).
    assert rel_err(y_dot, np.asarray(x, np.float64) @ weight) <= FP16_U + 1e-5
