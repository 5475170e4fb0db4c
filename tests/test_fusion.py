"""jm.matmul's fusions: the residual epilogue and the RMSNorm and SwiGLU prologues.

Against a float64 reference (x' computed in float64 from the inputs and rounded
to the dtype as the contract says, then the product in float64), against the
unfused composition ``jm.matmul(prologue(x), w, bias) + residual``, and
through padding, act-order and zero points, jit, vmap, autodiff, sharding on 8
host devices, the argument checks and the FFI handler's re-checks. Tests
marked ``gpu`` run the CUDA kernels (the decode kernel's fusions at m <= 8,
the jnp ops around the others, and the handler's own passes when it is called
directly) with NaN-poisoned outputs.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_marlin as jm
from conftest import BF16_U, FP16_U, imported_weight, prologue64, random_weight, rel_err
from jax_marlin import shapes
from jax_marlin.ops import _matmul

DTYPES = [np.float16, jnp.bfloat16]
DTYPE_IDS = ["f16", "bf16"]
U = {np.dtype(np.float16): FP16_U, np.dtype(jnp.bfloat16): BF16_U}
EPS = 1e-5

# Against float64: y = dtype(x' W + bias) is rounded once (u relative to it)
# and the residual sum once more (u relative to the result), so with a
# residual as large as the product ||y - ref|| / ||ref|| <= 2 u; the fp32
# accumulation adds far less than 1e-5 at these sizes. (x' is rounded to the
# dtype in the reference too.)
TOLS = {dt: 2 * u + 1e-5 for dt, u in U.items()}
# Against the unfused composition: the same roundings, up to the order of the
# fp32 sum of squares (RMSNorm; XLA's reduction and the handler's differ by
# ~sqrt(k) 2^-24) and the fp32 exp (SwiGLU), which move a few elements of x'
# in a thousand by one unit in their last place and so some elements of y by
# one: measured up to 0.13 u on the norm (SwiGLU: 0 on the CPU). A wrong
# formula, scale or term is off by u or far more.
NEAR = {dt: u / 2 for dt, u in U.items()}

# (k, n, group_size): aligned, per-column, and two stored padded (k: x, gate,
# up and the norm weight are padded; n: the residual is padded, y sliced).
LAYERS = [(512, 256, 128), (256, 192, -1), (1000, 576, 32), (576, 1000, 64)]
LAYER_IDS = ["k%d-n%d-g%d" % layer for layer in LAYERS]

# Which fusions a case uses.
FUSIONS = {
    "residual": dict(residual=True),
    "norm": dict(norm=True),
    "swiglu": dict(swiglu=True),
    "norm-bias-residual": dict(norm=True, bias=True, residual=True),
    "swiglu-bias-residual": dict(swiglu=True, bias=True, residual=True),
}


# --- the contract, stated independently of jax_marlin.fusion --------------------------
# (in float64: conftest.prologue64, which tests/test_combinations.py shares)


def prologue32(x, norm_weight=None, swiglu=False, eps=EPS):
    """The contract's x' in jnp: float32, rounded to x's dtype."""
    x = jnp.asarray(x)
    xf = x.astype(jnp.float32)
    if norm_weight is not None:
        r = 1 / jnp.sqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
        return (xf * r * jnp.asarray(norm_weight).astype(jnp.float32)).astype(x.dtype)
    if swiglu:
        k = x.shape[-1] // 2
        gate, up = xf[..., :k], xf[..., k:]
        return (gate / (1 + jnp.exp(-gate)) * up).astype(x.dtype)
    return x


def unfused(x, w, bias=None, *, residual=None, rms_norm_weight=None, swiglu=False):
    """What the fusions replace: the prologue, jm.matmul, then ``+ residual`` in the dtype."""
    y = jm.matmul(prologue32(x, rms_norm_weight, swiglu), w, bias)
    return y if residual is None else y + residual


def dense64(w) -> np.ndarray:
    return np.asarray(jm.dequantize(w, jnp.float32), np.float64)


def make_case(rng, w, lead, dtype, *, norm=False, swiglu=False, bias=False, residual=False,
              weight64=None):
    """Random inputs for one call: ``(x, kwargs, ref)``, ``ref`` the float64 result.

    Rows of x span four decades of scale (RMSNorm undoes it; eps matters for
    the smallest), gates span silu's curved range, bias and residual are as
    large as the product, so that any missing, doubled or misplaced term is
    far outside the tolerance. Nothing is zero.
    """
    dtype = np.dtype(dtype)
    cols = 2 * w.k if swiglu else w.k
    scale = 10.0 ** rng.uniform(-3, 1, size=lead + (1,))
    x = (rng.standard_normal(lead + (cols,)) * (2.0 if swiglu else scale)).astype(dtype)
    kwargs = {}
    if norm:
        kwargs["rms_norm_weight"] = rng.uniform(0.5, 2.0, w.k).astype(dtype)
        kwargs["rms_norm_eps"] = EPS
    if swiglu:
        kwargs["swiglu"] = True
    x64 = prologue64(x, kwargs.get("rms_norm_weight"), swiglu, eps=EPS)
    ref = x64 @ (dense64(w) if weight64 is None else weight64)
    size = ref.std()
    if bias:
        kwargs["bias"] = (rng.standard_normal(w.n) * size).astype(dtype)
        ref = ref + np.asarray(kwargs["bias"], np.float64)
    if residual:
        kwargs["residual"] = (rng.standard_normal(lead + (w.n,)) * size).astype(dtype)
        ref = ref + np.asarray(kwargs["residual"], np.float64)
    return x, kwargs, ref


def split(kwargs):
    """``(bias, the keyword arguments without it)`` for positional-bias calls."""
    kwargs = dict(kwargs)
    return kwargs.pop("bias", None), kwargs


def fused(x, w, kwargs):
    """jm.matmul with the fusions, jitted, its output buffer starting as NaN."""
    arrays = {k: v for k, v in kwargs.items() if k in ("bias", "residual", "rms_norm_weight")}
    static = {k: v for k, v in kwargs.items() if k not in arrays}
    return jax.jit(lambda x, w, a: _matmul(x, w, poison_output=True, **a, **static))(x, w, arrays)


@pytest.fixture(scope="module")
def weights():
    rng = np.random.default_rng(4321)
    with jax.default_device(jax.devices("cpu")[0]):
        return {(layer, np.dtype(dt)): jm.quantize(random_weight(rng, *layer[:2]),
                                                    group_size=layer[2], dtype=dt)
                for layer in LAYERS for dt in DTYPES}


# --- CPU handler: results --------------------------------------------------------------


def check_case(rng, w, lead, dtype, fusion, weight64=None):
    x, kwargs, ref = make_case(rng, w, lead, dtype, weight64=weight64, **FUSIONS[fusion])
    y = fused(x, w, kwargs)
    assert y.shape == lead + (w.n,) and y.dtype == np.dtype(dtype)
    dt = np.dtype(dtype)
    err = rel_err(y, ref)
    assert err <= TOLS[dt], f"{fusion}: {err:.2e} against float64"
    bias, rest = split(kwargs)
    rest.pop("rms_norm_eps", None)
    near = rel_err(y, np.asarray(unfused(x, w, bias, **rest), np.float64))
    print(f"{fusion} {dt.name} k={w.k} n={w.n} g={w.group_size}: {err:.2e} against float64, "
          f"{near:.2e} against the unfused composition")
    assert near <= NEAR[dt], f"{fusion}: {near:.2e} against the unfused composition"
    assert rel_err(jm.reference.matmul(x, w, **kwargs), ref) <= TOLS[dt]
    return x, kwargs, y


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layer", LAYERS, ids=LAYER_IDS)
@pytest.mark.parametrize("fusion", ["norm-bias-residual", "swiglu-bias-residual"])
def test_matches_float64_and_unfused(rng, weights, layer, dtype, fusion):
    # Leading batch dims (2, 17) fold into m = 34.
    check_case(rng, weights[layer, np.dtype(dtype)], (2, 17), dtype, fusion)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("fusion", ["residual", "norm", "swiglu"])
def test_each_fusion_alone(rng, weights, dtype, fusion):
    check_case(rng, weights[LAYERS[2], np.dtype(dtype)], (5,), dtype, fusion)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_residual_is_exactly_matmul_plus_residual(rng, weights, dtype):
    # Without a prologue nothing is reordered: bit for bit jm.matmul + residual.
    w = weights[LAYERS[3], np.dtype(dtype)]
    x, kwargs, _ = make_case(rng, w, (3, 4), dtype, bias=True, residual=True)
    y = jm.matmul(x, w, kwargs["bias"], residual=kwargs["residual"])
    np.testing.assert_array_equal(np.asarray(y),
                                  np.asarray(jm.matmul(x, w, kwargs["bias"]) + kwargs["residual"]))


def test_rms_norm_divides_by_the_logical_k(rng, weights):
    # k = 1000 is stored as 1024: the 24 zero columns must not enter the mean.
    # A kernel dividing by 1024 would scale x' by sqrt(1024 / 1000), 1.2%.
    w = weights[LAYERS[2], np.dtype(np.float16)]
    assert w.k_pad > w.k
    x, kwargs, ref = make_case(rng, w, (8,), np.float16, norm=True)
    assert rel_err(fused(x, w, kwargs), ref) <= TOLS[np.dtype(np.float16)]


@pytest.mark.parametrize("fusion", ["norm-bias-residual", "swiglu-bias-residual"])
@pytest.mark.parametrize("zeros,act_order", [(True, False), (False, True), (True, True)],
                         ids=["zeros", "act-order", "both"])
def test_zeros_and_act_order(rng, zeros, act_order, fusion):
    # The prologue runs in x's own column order, the kernel multiplies
    # x'[perm] by the stored rows: x' W of the logical weight. k = 1000 is
    # padded, with a partial last group.
    w, weight = imported_weight(rng, 1000, 576, 128, zeros=zeros, act_order=act_order)
    check_case(rng, w, (17,), np.float16, fusion, weight64=weight)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_poison_is_overwritten(rng, weights, dtype):
    w = weights[LAYERS[0], np.dtype(dtype)]
    x, kwargs, _ = make_case(rng, w, (33,), dtype, norm=True, bias=True, residual=True)
    y = fused(x, w, kwargs)
    assert np.isfinite(np.asarray(y, np.float32)).all()
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jm.matmul(x, w, **kwargs)))


def test_eager_and_jit_agree(rng, weights):
    w = weights[LAYERS[0], np.dtype(np.float16)]
    x, kwargs, _ = make_case(rng, w, (4,), np.float16, swiglu=True, residual=True)
    np.testing.assert_array_equal(np.asarray(jm.matmul(x, w, **kwargs)),
                                  np.asarray(jax.jit(lambda x: jm.matmul(x, w, **kwargs))(x)))


def test_empty_batch(weights):
    w = weights[LAYERS[0], np.dtype(np.float16)]
    y = jm.matmul(jnp.ones((0, 2 * w.k), jnp.float16), w, swiglu=True,
                  residual=jnp.ones((0, w.n), jnp.float16))
    assert y.shape == (0, w.n)


# --- vmap ------------------------------------------------------------------------------


@pytest.mark.parametrize("in_axes", [(0, 0), (1, None), (None, 0)],
                         ids=["both", "x-only", "residual-only"])
def test_vmap_folds_x_and_residual_into_m(rng, weights, in_axes):
    w = weights[LAYERS[0], np.dtype(np.float16)]
    g = rng.uniform(0.5, 2.0, w.k).astype(np.float16)
    xs = rng.standard_normal((3, 5, w.k)).astype(np.float16)
    rs = rng.standard_normal((3, 5, w.n)).astype(np.float16)
    x_axis, r_axis = in_axes
    x_in = xs if x_axis != 1 else xs.transpose(1, 0, 2)
    x_in = x_in if x_axis is not None else xs[0]
    r_in = rs if r_axis is not None else rs[0]

    def fn(x, r):
        return jm.matmul(x, w, residual=r, rms_norm_weight=g, rms_norm_eps=EPS)

    y = jax.jit(jax.vmap(fn, in_axes=in_axes))(x_in, r_in)
    jaxpr = str(jax.make_jaxpr(jax.vmap(fn, in_axes=in_axes))(x_in, r_in))
    assert "scan" not in jaxpr and "while" not in jaxpr  # folded into m, not one call each
    for i in range(3):
        x_i = xs[i] if x_axis is not None else xs[0]
        r_i = rs[i] if r_axis is not None else rs[0]
        np.testing.assert_array_equal(np.asarray(y[i]), np.asarray(fn(x_i, r_i)))


def test_vmap_over_swiglu_x(rng, weights):
    w = weights[LAYERS[2], np.dtype(np.float16)]
    xs = rng.standard_normal((4, 2, 2 * w.k)).astype(np.float16)
    fn = jax.vmap(lambda x: jm.matmul(x, w, swiglu=True))
    y = jax.jit(fn)(xs)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jm.matmul(xs, w, swiglu=True)))


def test_vmap_over_norm_weights_runs_one_call_each(rng, weights):
    # A batch of RMSNorm weights is no batch of rows: one call per element.
    w = weights[LAYERS[0], np.dtype(np.float16)]
    gs = rng.uniform(0.5, 2.0, (3, w.k)).astype(np.float16)
    x = rng.standard_normal((2, w.k)).astype(np.float16)
    fn = jax.vmap(lambda g: jm.matmul(x, w, rms_norm_weight=g))
    assert "scan" in str(jax.make_jaxpr(fn)(gs))
    y = jax.jit(fn)(gs)
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(y[i]),
                                      np.asarray(jm.matmul(x, w, rms_norm_weight=gs[i])))


# --- autodiff --------------------------------------------------------------------------

# The fused op's derivative is its jnp prologue's derivative times W (the
# plain op, whose transpose multiplies by W^T), plus the bias and residual
# tangents: the unfused composition's, bit for bit. Against a float32
# statement of the same function (no roundings at all), the roundings of
# x', y and the transposed product's weight add a few u.
GRAD_TOLS = {dt: 8 * u for dt, u in U.items()}


def _f32_block(x, w, bias, residual, norm_weight, swiglu):
    """The fused function with no roundings, in float32: the derivatives' reference."""
    xf = x.astype(jnp.float32)
    if norm_weight is not None:
        r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + EPS)
        xf = xf * r * norm_weight.astype(jnp.float32)
    if swiglu:
        k = xf.shape[-1] // 2
        xf = jax.nn.silu(xf[..., :k]) * xf[..., k:]
    y = jnp.matmul(xf, jm.dequantize(w, jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return y + bias.astype(jnp.float32) + residual.astype(jnp.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("prologue", ["norm", "swiglu"])
def test_grad_and_jvp(rng, weights, prologue, dtype):
    w = weights[LAYERS[2], np.dtype(dtype)]
    swiglu = prologue == "swiglu"
    x, kwargs, _ = make_case(rng, w, (2, 3), dtype, norm=not swiglu, swiglu=swiglu,
                             bias=True, residual=True)
    args = (x, kwargs["bias"], kwargs["residual"], kwargs.get("rms_norm_weight",
                                                              np.ones(w.k, dtype)))
    cotangent = rng.standard_normal((2, 3, w.n)).astype(np.float32)

    def fused_fn(x, b, r, g):
        return jm.matmul(x, w, b, residual=r, rms_norm_weight=None if swiglu else g,
                         rms_norm_eps=EPS, swiglu=swiglu)

    def unfused_fn(x, b, r, g):
        return unfused(x, w, b, residual=r, rms_norm_weight=None if swiglu else g,
                       swiglu=swiglu)

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * cotangent)

    argnums = (0, 1, 2) if swiglu else (0, 1, 2, 3)
    grads = jax.jit(jax.grad(loss(fused_fn), argnums=argnums))(*args)
    expected = jax.jit(jax.grad(loss(unfused_fn), argnums=argnums))(*args)
    for g, e in zip(grads, expected):
        assert g.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(e))
    reference = jax.jit(jax.grad(
        lambda x, b, r, g: jnp.sum(_f32_block(x, w, b, r, None if swiglu else g, swiglu)
                                   * cotangent), argnums=argnums))(*args)
    for g, e in zip(grads, reference):
        assert rel_err(g, np.asarray(e, np.float64)) <= GRAD_TOLS[np.dtype(dtype)]

    # Tangents as large as their primals element by element: a unit tangent on
    # a row of x scaled by 1e-3 would overflow y_dot in float16.
    tangents = tuple((np.asarray(a, np.float32) * rng.standard_normal(np.shape(a))).astype(dtype)
                     for a in args)
    y, y_dot = jax.jit(lambda p, t: jax.jvp(fused_fn, p, t))(args, tangents)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(fused_fn(*args)))
    _, e_dot = jax.jit(lambda p, t: jax.jvp(unfused_fn, p, t))(args, tangents)
    # The same roundings, but XLA may keep a bfloat16 sum of the tangents in
    # float32 in one program and not in the other: one rounding apart.
    assert rel_err(y_dot, np.asarray(e_dot, np.float64)) <= U[np.dtype(dtype)]


def test_prologue_has_no_transpose(rng, weights):
    # Linear in x only without a prologue; jax.grad works either way (above).
    w = weights[LAYERS[0], np.dtype(np.float16)]
    x = rng.standard_normal((2, 2 * w.k)).astype(np.float16)
    with pytest.raises(TypeError, match="with a prologue .* is not linear in x"):
        jax.linear_transpose(lambda x: jm.matmul(x, w, swiglu=True), x)(
            jnp.ones((2, w.n), jnp.float16))


def test_grad_under_vmap(rng, weights):
    w = weights[LAYERS[0], np.dtype(np.float16)]
    g = rng.uniform(0.5, 2.0, w.k).astype(np.float16)
    xs = rng.standard_normal((3, 4, w.k)).astype(np.float16)
    rs = rng.standard_normal((3, 4, w.n)).astype(np.float16)

    def loss(x, r):
        y = jm.matmul(x, w, residual=r, rms_norm_weight=g, rms_norm_eps=EPS)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    per_example = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1))))(xs, rs)
    for i in range(3):
        for got, want in zip(per_example, jax.grad(loss, argnums=(0, 1))(xs[i], rs[i])):
            # The batch folds into m: XLA's float32 sums over k (the norm's
            # backward, the transposed product) may run in another order.
            assert rel_err(got[i], np.asarray(want, np.float64)) <= NEAR[np.dtype(np.float16)]


# --- sharding (8 host devices) ---------------------------------------------------------

# Row parallel adds fp16 partial products after rounding each (test_partitioning.py:
# 3 u with the bias), then the residual once more.
K_TOLS = {dt: 4 * u for dt, u in U.items()}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def _collectives(fn, *args) -> dict[str, int]:
    text = jax.jit(fn).lower(*args).compile().as_text()
    return {c: n for c in COLLECTIVES if (n := len(re.findall(rf" {c}(?:-start)?\(", text)))}


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices("cpu")) < 8:
        pytest.skip("needs 8 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count)")
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices("cpu")[:8])


# (x spec, weight spec over (k, n), y spec, k sharded) on the ("data", "model") mesh;
# x is [4, 8, k], so m spans two leading dimensions.
LAYOUTS = {
    "m": (P("data"), P(), P("data"), False),
    "n": (P(), P(None, "model"), P(None, None, "model"), False),
    "k": (P(None, None, "model"), P("model", None), P(), True),
    "data-x-k": (P("data"), P("model", None), P("data"), True),
    "k-over-both": (P(), P(("model", "data"), None), P(), True),
}


@pytest.mark.parametrize("prologue", ["norm", "swiglu"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sharded(rng, mesh, layout, prologue):
    # m or n sharded: each shard's kernel runs the fused call on whole rows,
    # no communication, the unsharded result bit for bit. k sharded: the
    # prologue runs in jnp per shard (RMSNorm's sum of squares all-reduced:
    # one more all-reduce, of m floats; SwiGLU's x stays whole along its
    # [gate | up] columns), the kernels multiply x', and the bias and the
    # residual are added once after the all-reduce.
    x_spec, w_spec, y_spec, k_sharded = LAYOUTS[layout]
    swiglu = prologue == "swiglu"
    w = jm.quantize(random_weight(rng, 1024, 512), group_size=128)
    x, kwargs, ref = make_case(rng, w, (4, 8), np.float16, norm=not swiglu, swiglu=swiglu,
                               bias=True, residual=True)
    if swiglu and k_sharded:  # [gate | up] is not split along k (partitioning.py)
        x_spec = P(*x_spec[:2])
    ws = jm.shard_weight(w, mesh, w_spec)
    args = dict(x=jax.device_put(x, NamedSharding(mesh, x_spec)),
                residual=jax.device_put(kwargs["residual"], NamedSharding(mesh, y_spec)),
                bias=kwargs["bias"])
    if not swiglu:
        args["g"] = kwargs["rms_norm_weight"]

    def fn(x, w, bias, residual, g=None):
        return jm.matmul(x, w, bias, residual=residual, rms_norm_weight=g, rms_norm_eps=EPS,
                         swiglu=swiglu)

    y = jax.jit(fn)(args["x"], ws, args["bias"], args["residual"], args.get("g"))
    assert y.shape == (4, 8, w.n)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, y_spec), y.ndim)
    found = _collectives(fn, args["x"], ws, args["bias"], args["residual"], args.get("g"))
    if k_sharded:
        assert found == {"all-reduce": 1 if swiglu else 2}
        assert rel_err(y, ref) <= K_TOLS[np.dtype(np.float16)]
    else:
        assert found == {}
        np.testing.assert_array_equal(np.asarray(y), np.asarray(jm.matmul(x, w, **kwargs)))


@pytest.mark.parametrize("layout", ["m", "data-x-k"])
def test_gspmd_partitioner(rng, mesh, gspmd, layout):
    x_spec, w_spec, y_spec, k_sharded = LAYOUTS[layout]
    w = jm.quantize(random_weight(rng, 1024, 512), group_size=128)
    x, kwargs, ref = make_case(rng, w, (4, 8), np.float16, norm=True, bias=True, residual=True)
    fn = jax.jit(lambda x, w, b, r, g: jm.matmul(x, w, b, residual=r, rms_norm_weight=g,
                                                 rms_norm_eps=EPS))
    y = fn(jax.device_put(x, NamedSharding(mesh, x_spec)), jm.shard_weight(w, mesh, w_spec),
           kwargs["bias"], kwargs["residual"], kwargs["rms_norm_weight"])
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, y_spec), y.ndim)
    assert rel_err(y, ref) <= (K_TOLS if k_sharded else TOLS)[np.dtype(np.float16)]


def test_norm_weight_is_sharded_like_x_k(rng, mesh):
    # Row parallel with x's k sharded: each shard reads its slice of the norm
    # weight; the mean still divides by the logical k of the whole row.
    w = jm.quantize(random_weight(rng, 1000, 576), group_size=128)
    x, kwargs, ref = make_case(rng, w, (16,), np.float16, norm=True, residual=True)
    ws = jm.shard_weight(w, mesh, P("model", None))
    y = jax.jit(lambda x, w, r, g: jm.matmul(x, w, residual=r, rms_norm_weight=g,
                                             rms_norm_eps=EPS))(
        x, ws, kwargs["residual"], kwargs["rms_norm_weight"])
    assert rel_err(y, ref) <= K_TOLS[np.dtype(np.float16)]


# --- argument checks -------------------------------------------------------------------


@pytest.mark.parametrize(
    "make,error,match",
    [
        (lambda x, x2, w, r, g: dict(x=x, residual=r[:, :100]), ValueError,
         r"residual.shape = \(4, 100\), expected the result's shape \(4, 256\): x's leading "
         r"dimensions \(4,\) and the weight's n = 256"),
        (lambda x, x2, w, r, g: dict(x=x, residual=r[None]), ValueError,
         r"residual.shape = \(1, 4, 256\), expected the result's shape \(4, 256\)"),
        (lambda x, x2, w, r, g: dict(x=x, rms_norm_weight=g[:100]), ValueError,
         r"rms_norm_weight.shape = \(100,\), expected \(512,\): one value per input feature"),
        (lambda x, x2, w, r, g: dict(x=x2, swiglu=True, rms_norm_weight=g), ValueError,
         "rms_norm_weight and swiglu cannot both be given"),
        (lambda x, x2, w, r, g: dict(x=x, swiglu=True), ValueError,
         r"x.shape\[-1\] = 512, expected 2 k = 1024: with swiglu=True x is \[gate \| up\]"),
        (lambda x, x2, w, r, g: dict(x=x2), ValueError,
         r"x.shape\[-1\] = 1024 does not match the weight's k = 512"),
        (lambda x, x2, w, r, g: dict(x=x, residual=r.astype(jnp.bfloat16)), TypeError,
         "residual.dtype is bfloat16 but x.dtype is float16"),
        (lambda x, x2, w, r, g: dict(x=x, rms_norm_weight=g.astype(jnp.float32)), TypeError,
         "rms_norm_weight.dtype is float32 but x.dtype is float16"),
        (lambda x, x2, w, r, g: dict(x=x, rms_norm_weight=g, rms_norm_eps=-1.0), ValueError,
         "rms_norm_eps = -1.0 must be a non-negative number"),
        (lambda x, x2, w, r, g: dict(x=x, rms_norm_weight=g, rms_norm_eps=jnp.ones(2)),
         TypeError, "rms_norm_eps must be a Python float"),
        (lambda x, x2, w, r, g: dict(x=x2, swiglu=1), TypeError, "swiglu must be a bool"),
    ],
)
def test_bad_arguments_raise_at_trace_time(rng, weights, make, error, match):
    w = weights[LAYERS[0], np.dtype(np.float16)]
    x = rng.standard_normal((4, w.k)).astype(np.float16)
    x2 = rng.standard_normal((4, 2 * w.k)).astype(np.float16)
    r = rng.standard_normal((4, w.n)).astype(np.float16)
    g = rng.uniform(0.5, 2.0, w.k).astype(np.float16)
    kwargs = make(x, x2, w, r, g)
    x = kwargs.pop("x")
    with pytest.raises(error, match=match):
        jm.matmul(x, w, **kwargs)
    with pytest.raises(error, match=match):
        jax.jit(lambda x: jm.matmul(x, w, **kwargs)).trace(x)


def test_eps_must_be_static(rng, weights):
    w = weights[LAYERS[0], np.dtype(np.float16)]
    x = rng.standard_normal((4, w.k)).astype(np.float16)
    g = np.ones(w.k, np.float16)
    with pytest.raises(TypeError, match="rms_norm_eps must be a Python float"):
        jax.jit(lambda x, eps: jm.matmul(x, w, rms_norm_weight=g, rms_norm_eps=eps))(x, 1e-5)


def test_check_operands_fusions():
    # The primitive's operands on the padded shape: residual y's shape, the
    # norm weight [k_pad], SwiGLU's x [..., 2 k_pad].
    args = ((4, 256), "float16", (16, 256), "int32", (2, 128), "float16", (0, 0), "int32",
            (0,), "int32", (0,), "float16")
    fine = dict(k=256, n=128, group_size=128, residual_shape=(4, 128), residual_dtype="float16",
                norm_weight_shape=(256,), norm_weight_dtype="float16", norm_eps=1e-6,
                norm_size=200)
    shapes.check_operands(*args, **fine)
    for change, error, match in [
        (dict(residual_shape=(4, 64)), ValueError, r"residual.shape = \(4, 64\), expected y's"),
        (dict(residual_dtype="bfloat16"), TypeError, "residual.dtype is bfloat16"),
        (dict(norm_weight_shape=(200,)), ValueError, r"norm_weight.shape = \(200,\), expected"),
        (dict(norm_size=257), ValueError, r"norm_size = 257 must be in \[1, k = 256\]"),
        (dict(norm_size=0), ValueError, r"norm_size = 0 must be in"),
        (dict(norm_eps=float("nan")), ValueError, "norm_eps = nan must be a non-negative"),
        (dict(swiglu=True), ValueError, r"x.shape\[-1\] = 256 does not match 2 k = 512"),
    ]:
        with pytest.raises(error, match=match):
            shapes.check_operands(*args, **{**fine, **change})
    swiglu_args = ((4, 512),) + args[1:]
    shapes.check_operands(*swiglu_args, k=256, n=128, group_size=128, swiglu=True)
    with pytest.raises(ValueError, match="norm_weight and swiglu cannot both be given"):
        shapes.check_operands(*swiglu_args, **{**fine, "swiglu": True})


def test_handler_rechecks_fused_operands(rng):
    # The FFI target called directly with inconsistent fused operands gets an
    # error from the C++ checks (ffi_common.h), not a bad memory access.
    k, n, m = 1024, 512, 4
    w = jm.quantize(random_weight(rng, k, n), group_size=128)
    x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float16))
    x2 = jnp.asarray(rng.standard_normal((m, 2 * k)).astype(np.float16))
    none = jnp.zeros((0,), jnp.float16)
    residual = jnp.ones((m, n), jnp.float16)
    g = jnp.ones((k,), jnp.float16)
    plain = shapes.reduce_scratch_size(m, n, k)
    copy = shapes.reduce_scratch_size(m, n, k, x_copy=True)
    assert copy > plain  # a prologue's x' needs room in the CUDA scratch

    def call(x, residual, g, *, swiglu=False, norm_size=k, scratch=copy):
        results = (jax.ShapeDtypeStruct((m, n), jnp.float16),
                   jax.ShapeDtypeStruct((shapes.workspace_size(m, n),), jnp.int32),
                   jax.ShapeDtypeStruct((scratch,), jnp.float32))
        f = jax.ffi.ffi_call("jax_marlin_matmul", results)
        return jax.block_until_ready(f(
            x, w.qweight, w.scales, jnp.zeros((0, 0), jnp.int32), jnp.zeros((0,), jnp.int32),
            none, residual, g, group_size=128, poison_output=True, norm_eps=np.float32(EPS),
            norm_size=norm_size, swiglu=swiglu))[0]

    # The consistent calls run, and are jm.matmul's.
    np.testing.assert_array_equal(
        np.asarray(call(x, residual, g)),
        np.asarray(jm.matmul(x, w, residual=residual, rms_norm_weight=g, rms_norm_eps=EPS)))
    np.testing.assert_array_equal(np.asarray(call(x2, none, none, swiglu=True)),
                                  np.asarray(jm.matmul(x2, w, swiglu=True)))
    for args, kwargs, match in [
        ((x, residual[:, :64], none), {}, "residual must have y's shape"),
        ((x, residual.astype(jnp.bfloat16), none), {}, "must have one dtype"),
        ((x, none, g[:512]), {}, r"norm_weight must have shape \[1024\]"),
        ((x2, none, g), dict(swiglu=True), "norm_weight and swiglu cannot both be given"),
        ((x, none, none), dict(swiglu=True), r"with swiglu x holds gate \| up, 2 k = 2048"),
        ((x, none, g), dict(norm_size=k + 1), r"norm_size = 1025 must be in \[1, k = 1024\]"),
        ((x, none, g), dict(scratch=plain), "reduce_scratch holds"),
    ]:
        with pytest.raises(Exception, match=match):
            call(*args, **kwargs)


# --- CUDA ------------------------------------------------------------------------------

# The kernels' error budget against float64 (tests/test_primitive.py: the
# weight rounded to the dtype in the tensor-core product, y rounded once,
# fp32 accumulation) plus one more rounding for the residual sum.
GPU_TOLS = {np.dtype(np.float16): 1e-3 + FP16_U, np.dtype(jnp.bfloat16): 8e-3 + BF16_U}
# Against the unfused composition on the GPU: the same kernel's product of
# x', whose elements may differ by an ulp (the order of the sum of squares,
# exp) and, on the paths that run a prologue pass, the product's own order.
GPU_NEAR = {dt: u for dt, u in U.items()}
# m <= 8: the decode kernel runs the fusions itself; 9..16 it runs the plain
# call, 17..63 the Marlin kernel and >= 64 the prefill kernel (on Hopper),
# with the fusions lowered as jnp ops around them (the handler's own passes:
# the last tests).
GPU_MS = [1, 3, 8, 16, 17, 40, 64, 200]
# (k, n, group_size): g128, per column, g32; a padded k (1000, partial group)
# and a padded n.
GPU_LAYERS = [(4096, 1024, 128), (1024, 2048, -1), (2048, 1152, 32), (1000, 576, 32),
              (576, 1000, 64)]


def gpu(a):
    return None if a is None else jax.device_put(a, jax.devices("gpu")[0])


def check_gpu_case(rng, w, lead, dtype, fusion, weight64=None):
    x, kwargs, ref = make_case(rng, w, lead, dtype, weight64=weight64, **FUSIONS[fusion])
    on_gpu = {k: gpu(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    y = fused(gpu(x), w, on_gpu)
    assert y.shape == lead + (w.n,) and y.dtype == np.dtype(dtype)
    dt = np.dtype(dtype)
    err = rel_err(y, ref)
    print(f"gpu {fusion} {dt.name} k={w.k} n={w.n} g={w.group_size} lead={lead}: {err:.2e}")
    assert err <= GPU_TOLS[dt]
    bias, rest = split(on_gpu)
    rest.pop("rms_norm_eps", None)
    swiglu = rest.pop("swiglu", False)
    expected = jax.jit(lambda x, b, r: unfused(x, w, b, swiglu=swiglu, **r))(gpu(x), bias, rest)
    assert rel_err(y, np.asarray(expected, np.float64)) <= GPU_NEAR[dt]


@pytest.fixture(scope="module")
def gpu_weights():
    cache = {}

    def get(layer, dtype):
        key = (layer, np.dtype(dtype))
        if key not in cache:
            rng = np.random.default_rng(layer[0] * 7 + layer[1])
            cache[key] = jm.quantize(gpu(random_weight(rng, *layer[:2])), group_size=layer[2],
                                     dtype=dtype)
        return cache[key]

    return get


@pytest.mark.parametrize("m", GPU_MS)
@pytest.mark.parametrize("layer", GPU_LAYERS, ids=lambda l: "k%d-n%d-g%d" % l)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("fusion", ["norm-bias-residual", "swiglu-bias-residual"])
@pytest.mark.gpu
def test_gpu_matches_float64(rng, gpu_weights, fusion, dtype, layer, m):
    check_gpu_case(rng, gpu_weights(layer, dtype), (m,), dtype, fusion)


@pytest.mark.parametrize("m", [1, 8, 16, 17, 64])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("fusion", ["residual", "norm", "swiglu"])
@pytest.mark.gpu
def test_gpu_each_fusion_alone(rng, gpu_weights, fusion, dtype, m):
    check_gpu_case(rng, gpu_weights(GPU_LAYERS[0], dtype), (m,), dtype, fusion)


@pytest.mark.parametrize("m", [1, 3, 16, 40, 64])
@pytest.mark.parametrize("fusion", ["norm-bias-residual", "swiglu-bias-residual"])
@pytest.mark.parametrize("zeros,act_order", [(True, False), (False, True), (True, True)],
                         ids=["zeros", "act-order", "both"])
@pytest.mark.gpu
def test_gpu_zeros_and_act_order(rng, zeros, act_order, fusion, m):
    # Act-order at m <= 8: the decode kernel takes x' from jnp ops (the
    # lowering) rather than run the prologue itself.
    w, weight = imported_weight(rng, 4096, 1024, 128, zeros=zeros, act_order=act_order)
    w = jax.tree.map(gpu, w)
    check_gpu_case(rng, w, (m,), np.float16, fusion, weight64=weight)


@pytest.mark.parametrize("fusion", ["norm-bias-residual", "swiglu-bias-residual"])
@pytest.mark.gpu
def test_gpu_leading_dims_and_vmap(rng, gpu_weights, fusion):
    w = gpu_weights(GPU_LAYERS[0], np.float16)
    check_gpu_case(rng, w, (2, 8), np.float16, fusion)
    x, kwargs, ref = make_case(rng, w, (3, 5), np.float16, **FUSIONS[fusion])
    bias, rest = split({k: gpu(v) if isinstance(v, np.ndarray) else v
                        for k, v in kwargs.items()})
    residual = rest.pop("residual")
    y = jax.jit(jax.vmap(lambda x, r: jm.matmul(x, w, bias, residual=r, **rest)))(
        gpu(x), residual)
    assert rel_err(y, ref) <= GPU_TOLS[np.dtype(np.float16)]


@pytest.mark.parametrize("m", [1, 17, 64])
@pytest.mark.gpu
def test_gpu_matches_cpu(rng, gpu_weights, m):
    # The same call on both handlers: the GPU rounds each weight to the dtype
    # in its product, the CPU does not; 2 u apart at most.
    w = gpu_weights(GPU_LAYERS[0], np.float16)
    x, kwargs, _ = make_case(rng, w, (m,), np.float16, norm=True, bias=True, residual=True)
    y_gpu = fused(gpu(x), w, {k: gpu(v) if isinstance(v, np.ndarray) else v
                              for k, v in kwargs.items()})
    cpu = jax.devices("cpu")[0]
    y_cpu = fused(jax.device_put(x, cpu), jax.device_put(w, cpu), kwargs)
    assert rel_err(y_gpu, np.asarray(y_cpu, np.float64)) <= 2 * FP16_U


@pytest.mark.parametrize("m, k, inside", [(1, 4096, True), (8, 4096, True), (9, 4096, False),
                                          (16, 4096, False), (64, 4096, False), (8, 8192, True),
                                          (9, 8192, False)])
@pytest.mark.gpu
def test_gpu_lowering_route(rng, m, k, inside):
    # jm.matmul hands the fusions to the kernel where the decode kernel runs
    # them (m <= 8, x in its own order: the call's norm_size is k); otherwise
    # it lowers them as jnp ops around a plain call (norm_size 0), which XLA
    # fuses with the ops next to it.
    w = jm.quantize(gpu(random_weight(rng, k, 256)), group_size=128)
    x = gpu(rng.standard_normal((m, k)).astype(np.float16))
    g = gpu(np.ones(k, np.float16))
    text = jax.jit(lambda x: jm.matmul(x, w, rms_norm_weight=g)).lower(x).as_text()
    sizes = re.findall(r"norm_size = (\d+)", text)
    assert sizes == ([str(k)] if inside else ["0"]), sizes


@pytest.mark.parametrize("m, act_order", [(4, True), (20, False), (64, False), (64, True)])
@pytest.mark.gpu
def test_gpu_handler_passes_match_the_lowering(rng, m, act_order):
    # Called directly, the CUDA handler runs the prologue and the residual as
    # passes of its own around the Marlin and prefill kernels (and the
    # prologue pass before the decode kernel with an act-order weight, which
    # it permutes on the way); jm.matmul lowers those cases as jnp ops. Both
    # state one contract.
    k, n = 1024, 512
    if act_order:
        w, _ = imported_weight(rng, k, n, 128, zeros=False, act_order=True)
    else:
        w = jm.quantize(random_weight(rng, k, n), group_size=128)
    w = jax.tree.map(gpu, w)
    x = gpu(rng.standard_normal((m, k)).astype(np.float16))
    x2 = gpu(rng.standard_normal((m, 2 * k)).astype(np.float16))
    residual = gpu(rng.standard_normal((m, n)).astype(np.float16))
    g = gpu((1 + 0.1 * rng.standard_normal(k)).astype(np.float16))
    none = gpu(np.zeros((0,), np.float16))
    perm = w.perm if w.perm is not None else gpu(np.zeros((0,), np.int32))
    results = (jax.ShapeDtypeStruct((m, n), jnp.float16),
               jax.ShapeDtypeStruct((shapes.workspace_size(m, n),), jnp.int32),
               jax.ShapeDtypeStruct((shapes.reduce_scratch_size(m, n, k, x_copy=True),),
                                    jnp.float32))
    handler = jax.jit(jax.ffi.ffi_call("jax_marlin_matmul", results),
                      static_argnames=("group_size", "poison_output", "norm_eps", "norm_size",
                                       "swiglu"))

    def direct(x, g, swiglu):
        return handler(x, w.qweight, w.scales, gpu(np.zeros((0, 0), np.int32)), perm, none,
                       residual, g, group_size=128, poison_output=True,
                       norm_eps=np.float32(EPS), norm_size=k, swiglu=swiglu)[0]

    for got, want in [
        (direct(x, g, False), _matmul(x, w, residual=residual, rms_norm_weight=g,
                                      rms_norm_eps=EPS, poison_output=True)),
        (direct(x2, none, True), _matmul(x2, w, residual=residual, swiglu=True,
                                         poison_output=True)),
    ]:
        assert np.isfinite(np.asarray(got, np.float32)).all()
        assert rel_err(got, np.asarray(want, np.float64)) <= GPU_NEAR[np.dtype(np.float16)]


@pytest.mark.parametrize("m", [1, 8, 64])
@pytest.mark.gpu
def test_gpu_stream_target_matches_the_command_buffer_one(rng, monkeypatch, m):
    # JAX_MARLIN_COMMAND_BUFFER=0 lowers every call to the handler without
    # the command-buffer trait, which XLA runs on the stream; the same kernels
    # run, so the results are bit-identical, fusions included.
    w = jm.quantize(gpu(random_weight(rng, 4096, 512)), group_size=128)
    x = gpu(rng.standard_normal((m, 4096)).astype(np.float16))
    g = gpu((1 + 0.1 * rng.standard_normal(4096)).astype(np.float16))
    residual = gpu(rng.standard_normal((m, 512)).astype(np.float16))

    texts, ys = {}, {}
    for setting in ("1", "0"):
        monkeypatch.setenv("JAX_MARLIN_COMMAND_BUFFER", setting)

        def step(x, g, residual):  # a new function each time: no cached lowering
            h = jm.matmul(x, w, rms_norm_weight=g, residual=residual)
            return jm.matmul(jnp.tile(h, (1, 8)), w, residual=residual)

        f = jax.jit(step)
        texts[setting] = re.findall(r"custom_call @(\w+)", f.lower(x, g, residual).as_text())
        ys[setting] = np.asarray(f(x, g, residual))
    assert texts == {"1": ["jax_marlin_matmul"] * 2, "0": ["jax_marlin_matmul_stream"] * 2}
    assert np.isfinite(ys["0"].astype(np.float32)).all()
    np.testing.assert_array_equal(ys["0"], ys["1"])


def test_command_buffer_switch_picks_the_cuda_target(monkeypatch):
    from jax_marlin import _ffi
    for value, target in [(None, "jax_marlin_matmul"), ("1", "jax_marlin_matmul"),
                          ("0", "jax_marlin_matmul_stream")]:
        if value is None:
            monkeypatch.delenv("JAX_MARLIN_COMMAND_BUFFER", raising=False)
        else:
            monkeypatch.setenv("JAX_MARLIN_COMMAND_BUFFER", value)
        assert _ffi.cuda_target() == target
