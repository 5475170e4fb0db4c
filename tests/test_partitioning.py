"""jm.matmul partitioned over 8 fake CPU devices: results, collectives, alignment errors.

conftest.py gives the CPU backend 8 devices (XLA_FLAGS) before jax starts.
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
from conftest import (
    BF16_U,
    FP16_U,
    float64_reference,
    imported_weight,
    random_weight,
    random_x,
    rel_err,
)
from jax_marlin.partitioning import shard_weight, weight_spec_tree, weight_specs

# Row parallel (k sharded) adds P float16 partial products, each rounded once,
# with P - 1 float16 additions, instead of rounding one float32 sum: measured
# ||y - ref|| / ||ref|| = 0.4 u (unsharded), 0.8 u (4 shards), 1.0 u (8 shards)
# on random data. 2 u leaves room without hiding a wrong shard, which would be
# off by O(1). The same roundings in bfloat16 have u = BF16_U; adding the bias
# after the all-reduce rounds once more (at most u).
K_TOL = 2 * FP16_U
K_TOLS = {np.dtype(np.float16): 3 * FP16_U, np.dtype(jnp.bfloat16): 3 * BF16_U}
# Unsharded rows or columns: the kernel's own single rounding (test_ops.py).
TOLS = {np.dtype(np.float16): FP16_U + 1e-5, np.dtype(jnp.bfloat16): BF16_U + 1e-5}

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def _cpu_devices(count):
    devices = jax.devices("cpu")
    if len(devices) < count:
        pytest.skip(f"needs {count} CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count)")
    return devices[:count]


def make_mesh(shape, names):
    devices = _cpu_devices(int(np.prod(shape)))
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape), devices=devices)


@pytest.fixture(scope="module")
def mesh():
    return make_mesh((2, 4), ("data", "model"))


def collectives(fn, *args) -> dict[str, int]:
    """Collective ops in the compiled (partitioned) program of ``jax.jit(fn)``."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    return {c: len(re.findall(rf" {c}(?:-start)?\(", text)) for c in COLLECTIVES}


def expected_collectives(**expected):
    """``collectives()``'s answer when only the named ones (all_reduce=1) occur."""
    return {c: expected.get(c.replace("-", "_"), 0) for c in COLLECTIVES}


# --- weight specs and placement ------------------------------------------------------


def test_weight_specs():
    assert weight_specs(P(None, "model"), 128) == (P(None, "model"), P(None, "model"))
    assert weight_specs(P("model", None), 128) == (P("model", None), P("model", None))
    # per-column scales [1, n]: their one row is replicated under k sharding
    assert weight_specs(P("model"), -1) == (P("model", None), P(None, None))
    assert weight_specs(P(("data", "model"), None), -1) == (P(("data", "model"), None),
                                                            P(None, None))
    with pytest.raises(ValueError, match="at most 2"):
        weight_specs(P("a", "b", "c"), 128)
    assert weight_specs(P("model", None), 32) == (P("model", None), P("model", None))
    with pytest.raises(ValueError, match="group_size = 96"):
        weight_specs(P(), 96)


@pytest.mark.parametrize("group_size", [128, -1])
def test_every_shard_is_a_marlin_weight(rng, mesh, group_size):
    # The packed layout splits on tile boundaries: each device's (qweight,
    # scales) is the MarlinWeight of its [k_local, n_local] block of the weight.
    k, n = 512, 512
    w = jm.quantize(random_weight(rng, k, n), group_size=group_size)
    full = np.asarray(jm.dequantize(w, jnp.float32))
    ws = shard_weight(w, mesh, P("data", "model"))
    k_local, n_local = k // 2, n // 4
    assert ws.qweight.sharding.spec == P("data", "model")
    scales_by_device = {s.device: s for s in ws.scales.addressable_shards}
    for q_shard in ws.qweight.addressable_shards:
        rows, cols = q_shard.index
        # qweight row r holds weight rows 16 r..; 2 words per weight column
        r0, c0 = (rows.start or 0) * 16, (cols.start or 0) // 2
        local = jm.MarlinWeight(q_shard.data, scales_by_device[q_shard.device].data,
                                k_local, n_local, group_size)
        np.testing.assert_array_equal(np.asarray(jm.dequantize(local, jnp.float32)),
                                      full[r0:r0 + k_local, c0:c0 + n_local])


@pytest.mark.parametrize(
    "k,n,group_size,mesh_shape,spec,match",
    [
        (256, 192, 128, (4, 2), P(None, "model"),
         r"n = 192 sharded over mesh axes \('model',\) \(2 shards\) leaves n_local = 96 columns "
         r"per shard, not a multiple of 64"),
        (256, 256, 128, (2, 4), P("model", None),
         r"k = 256 sharded over mesh axes \('model',\) \(4 shards\) leaves k_local = 64 rows "
         r"per shard, not a multiple of group_size = 128"),
        (256, 64, -1, (2, 4), P("model", None),
         r"the per-shard weight \[k_local, n_local\] = \[64, 64\] .* one of them must be a "
         r"multiple of 128"),
        (256, 128, -1, (2, 4), P(("data", "model"), None),
         r"leaves k_local = 32 rows per shard, not a multiple of the kernel's 64-row k tile"),
        (128, 128, -1, (2, 4), P("data", ("model",)), r"n_local = 32 columns per shard"),
        (128, 128, 128, (1, 3), P(None, "model"), r"n = 128 .* \(3 shards\) does not split evenly"),
        (256, 256, 128, (2, 4), P("tensor", None), r"names mesh axis 'tensor'"),
        (256, 256, 128, (2, 4), P("model", "model"), r"shards both k and n"),
        (256, 256, 128, (2, 4), P(None, None, "model"), r"at most 2"),
    ],
)
def test_misaligned_placement_raises(rng, k, n, group_size, mesh_shape, spec, match):
    mesh = make_mesh(mesh_shape, ("data", "model"))
    w = jm.quantize(random_weight(rng, k, n), group_size=group_size)
    with pytest.raises(ValueError, match=match):
        shard_weight(w, mesh, spec)


# --- partitioned jm.matmul -------------------------------------------------------------

# (x spec, weight spec over (k, n), expected y spec, k sharded?) on the 2 x 4
# ("data", "model") mesh; x is [4, 8, k] so m spans two leading dimensions.
LAYOUTS = {
    "n": (P(), P(None, "model"), P(None, None, "model"), False),
    "k": (P(), P("model", None), P(), True),
    "k-x-sharded": (P(None, None, "model"), P("model", None), P(), True),
    "m": (P("data"), P(), P("data"), False),
    "m-inner": (P(None, "data"), P(), P(None, "data"), False),
    "data-x-n": (P("data"), P(None, "model"), P("data", None, "model"), False),
    "data-x-k": (P("data"), P("model", None), P("data"), True),
    "k-x-n": (P(), P("data", "model"), P(None, None, "model"), True),
    "n-over-both": (P(), P(None, ("data", "model")), P(None, None, ("data", "model")), False),
}


@pytest.mark.parametrize("group_size", [128, -1])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_unsharded(rng, mesh, layout, group_size):
    x_spec, w_spec, y_spec, k_sharded = LAYOUTS[layout]
    k, n = 1024, 512
    w = jm.quantize(random_weight(rng, k, n), group_size=group_size)
    x = random_x(rng, 4, 8, k)
    expected = np.asarray(jm.matmul(x, w))

    ws = shard_weight(w, mesh, w_spec)
    xs = jax.device_put(x, NamedSharding(mesh, x_spec))
    y = jax.jit(jm.matmul)(xs, ws)
    assert y.shape == (4, 8, n) and y.dtype == jnp.float16
    assert y.sharding.spec == y_spec
    assert collectives(jm.matmul, xs, ws) == expected_collectives(all_reduce=int(k_sharded))
    if k_sharded:
        ref = float64_reference(x, w)
        assert rel_err(y, ref) <= K_TOL
        assert rel_err(y, expected.astype(np.float64)) <= K_TOL
    else:
        np.testing.assert_array_equal(np.asarray(y), expected)
    # Eager calls are partitioned the same way.
    y_eager = jm.matmul(xs, ws)
    assert y_eager.sharding.spec == y_spec
    np.testing.assert_array_equal(np.asarray(y_eager), np.asarray(y))


# (layout, bias spec): the bias follows y's columns.
BIAS_LAYOUTS = [("n", P("model")), ("k", P()), ("m", P()), ("data-x-k", P()),
                ("k-x-n", P("model"))]


@pytest.mark.parametrize("dtype", [np.float16, jnp.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("layout,bias_spec", BIAS_LAYOUTS, ids=[b[0] for b in BIAS_LAYOUTS])
def test_bias_under_each_sharding(rng, mesh, layout, bias_spec, dtype):
    # n sharded: each shard's kernel adds its slice of the bias. k sharded: the
    # kernels run without it and it is added once after the all-reduce, which
    # stays the only collective.
    x_spec, w_spec, y_spec, k_sharded = LAYOUTS[layout]
    k, n = 1024, 512
    w = jm.quantize(random_weight(rng, k, n), group_size=64, dtype=dtype)
    x = random_x(rng, 4, 8, k, dtype=dtype)
    # As large as the products: a bias added per shard (4x) or not at all
    # is far outside the tolerance.
    bias = (rng.standard_normal(n) * np.sqrt(k)).astype(dtype)
    args = (jax.device_put(x, NamedSharding(mesh, x_spec)), shard_weight(w, mesh, w_spec),
            jax.device_put(bias, NamedSharding(mesh, bias_spec)))

    def fn(x, w, b):
        return jm.matmul(x, w, bias=b)

    assert collectives(fn, *args) == expected_collectives(all_reduce=int(k_sharded))
    y = jax.jit(fn)(*args)
    assert y.sharding.spec == y_spec and y.dtype == dtype
    tol = (K_TOLS if k_sharded else TOLS)[np.dtype(dtype)]
    assert rel_err(y, float64_reference(x, w, bias)) <= tol


def test_padded_weight_row_parallel(rng, mesh):
    # [1000, 576] is stored as [1024, 576]; k = 1024 splits into 4 shards of
    # 256 rows (the last one holds the 24 padded rows); x is padded to match.
    w = jm.quantize(random_weight(rng, 1000, 576), group_size=128)
    assert w.padded_shape == (1024, 576)
    x = random_x(rng, 16, 1000)
    bias = random_x(rng, 576)
    ws = shard_weight(w, mesh, P("model", None))
    y = jax.jit(lambda x, w, b: jm.matmul(x, w, bias=b))(x, ws, bias)
    assert y.shape == (16, 576)
    assert rel_err(y, float64_reference(x, w, bias)) <= K_TOLS[np.dtype(np.float16)]
    # n = 576 cannot split 4 ways into whole 64-column chunks.
    with pytest.raises(ValueError, match="n_local = 144"):
        shard_weight(w, mesh, P(None, "model"))


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_megatron_mlp_has_one_all_reduce(rng, mesh, activation):
    # up [d, f] column parallel on f, down [f, d] row parallel on f (its k):
    # the hidden activation stays sharded, the only collective is down's psum.
    d, f, m = 256, 1024, 16
    act = {"relu": jax.nn.relu, "gelu": jax.nn.gelu}[activation]
    up = jm.quantize(random_weight(rng, d, f) / np.sqrt(d), group_size=128)
    down = jm.quantize(random_weight(rng, f, d) / np.sqrt(f), group_size=128)
    x = random_x(rng, m, d)

    def mlp(x, up, down):
        return jm.matmul(act(jm.matmul(x, up)), down)

    expected = np.asarray(jax.jit(mlp)(x, up, down), np.float64)
    args = (jax.device_put(x, NamedSharding(mesh, P("data"))),
            shard_weight(up, mesh, P(None, "model")), shard_weight(down, mesh, P("model", None)))
    assert collectives(mlp, *args) == expected_collectives(all_reduce=1)
    y = jax.jit(mlp)(*args)
    assert y.sharding.spec == P("data")
    assert rel_err(y, expected) <= K_TOL


def test_vmap_over_x_with_sharded_weight(rng, mesh):
    w = jm.quantize(random_weight(rng, 256, 512), group_size=128)
    ws = shard_weight(w, mesh, P(None, "model"))
    x = random_x(rng, 3, 5, 256)
    fn = jax.vmap(jm.matmul, in_axes=(1, None))
    assert collectives(fn, x, ws) == expected_collectives()
    y = jax.jit(fn)(x, ws)
    np.testing.assert_array_equal(np.asarray(y),
                                  np.asarray(jm.matmul(x, w)).transpose(1, 0, 2))


def test_vmap_over_sharded_weights(rng, mesh):
    ws = [jm.quantize(random_weight(rng, 256, 512), group_size=128) for _ in range(3)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *ws)
    stacked = jm.MarlinWeight(
        jax.device_put(stacked.qweight, NamedSharding(mesh, P(None, None, "model"))),
        jax.device_put(stacked.scales, NamedSharding(mesh, P(None, None, "model"))),
        256, 512, 128)
    x = random_x(rng, 3, 4, 256)
    assert collectives(jax.vmap(jm.matmul), x, stacked) == expected_collectives()
    y = jax.jit(jax.vmap(jm.matmul))(x, stacked)
    for i, w in enumerate(ws):
        np.testing.assert_array_equal(np.asarray(y[i]), np.asarray(jm.matmul(x[i], w)))


@pytest.mark.parametrize(
    "k,n,q_spec,s_spec,match,k_stays_sharded",
    [
        (256, 192, P(None, "model"), P(None, "model"),
         r"n_local = 48 .* Gathering the weight along n instead", False),
        (256, 256, P("model", None), P(), r"k_local = 64 .* Gathering the weight along k instead",
         False),
        # only n is misaligned: n is gathered, k stays sharded over "data"
        (256, 192, P("data", "model"), P("data", "model"),
         r"n_local = 48 .* Gathering the weight along n instead", True),
    ],
)
def test_misaligned_device_put_gathers_with_warning(rng, k, n, q_spec, s_spec, match,
                                                   k_stays_sharded):
    # A weight placed around shard_weight so that a shard cannot run on the
    # kernel: the partitioner gathers that dimension and says so.
    mesh = make_mesh((2, 4), ("data", "model"))
    w = jm.quantize(random_weight(rng, k, n), group_size=128)
    placed = jm.MarlinWeight(jax.device_put(w.qweight, NamedSharding(mesh, q_spec)),
                             jax.device_put(w.scales, NamedSharding(mesh, s_spec)), k, n, 128)
    x = random_x(rng, 8, k)
    with pytest.warns(UserWarning, match=match):
        y = jax.jit(jm.matmul)(x, placed)
    expected = np.asarray(jm.matmul(x, w))
    if k_stays_sharded:
        assert rel_err(y, expected.astype(np.float64)) <= K_TOL
    else:
        np.testing.assert_array_equal(np.asarray(y), expected)


@pytest.mark.parametrize("layout", ["data-x-n", "data-x-k"])
def test_gspmd_partitioner(rng, mesh, gspmd, layout):
    x_spec, w_spec, y_spec, k_sharded = LAYOUTS[layout]
    w = jm.quantize(random_weight(rng, 512, 256), group_size=128)
    x = random_x(rng, 4, 8, 512)
    ws = shard_weight(w, mesh, w_spec)
    xs = jax.device_put(x, NamedSharding(mesh, x_spec))
    assert collectives(jm.matmul, xs, ws) == expected_collectives(all_reduce=int(k_sharded))
    y = jax.jit(jm.matmul)(xs, ws)
    assert y.sharding.spec == y_spec
    assert rel_err(y, float64_reference(x, w)) <= (K_TOL if k_sharded else FP16_U + 1e-5)


# --- zero points and act-order ----------------------------------------------------------

# Zero points are an operand of the kernel, sharded like the scales: the
# tolerances of a symmetric weight (k sharded: the float16 partial products).


def test_weight_spec_tree(rng):
    w, _ = imported_weight(rng, 256, 128, 64)
    specs = weight_spec_tree(w, P(None, "model"))
    assert (specs.qweight, specs.scales, specs.zeros, specs.perm) == (
        P(None, "model"), P(None, "model"), P(None, "model"), P(None))
    plain = weight_spec_tree(jm.quantize(random_weight(rng, 256, 128), 64), P("model", None))
    assert plain.perm is None and plain.zeros is None
    assert jax.tree.structure(specs, is_leaf=lambda a: isinstance(a, P)) == \
        jax.tree.structure(w)


# Act-order with k sharded is refused (test below).
@pytest.mark.parametrize("layout,act_order", [
    ("n", False), ("m", False), ("data-x-n", False), ("k", False), ("data-x-k", False),
    ("n", True), ("m", True), ("data-x-n", True)])
def test_zeros_and_act_order_sharded(rng, mesh, layout, act_order):
    x_spec, w_spec, y_spec, k_sharded = LAYOUTS[layout]
    k, n = 1024, 512
    w, weight = imported_weight(rng, k, n, 128, act_order=act_order)
    x = random_x(rng, 4, 8, k)
    ws = shard_weight(w, mesh, w_spec)
    assert ws.zeros.sharding.spec == ws.scales.sharding.spec
    if act_order:
        assert ws.perm.sharding.spec == P(None)
    xs = jax.device_put(x, NamedSharding(mesh, x_spec))
    y = jax.jit(jm.matmul)(xs, ws)
    assert y.sharding.spec == y_spec
    ref = np.asarray(x, np.float64) @ weight
    assert rel_err(y, ref) <= (K_TOL if k_sharded else FP16_U + 1e-5)
    found = collectives(jm.matmul, xs, ws)
    if k_sharded:  # one all-reduce of the kernel's partial products, nothing else
        assert found == expected_collectives(all_reduce=1)
    else:
        assert found == expected_collectives()
        np.testing.assert_array_equal(np.asarray(y), np.asarray(jm.matmul(x, w)))


def test_act_order_refuses_k_sharding(rng, mesh):
    w, _ = imported_weight(rng, 1024, 512, 128, zeros=False)
    with pytest.raises(ValueError, match=r"act-order \(it has a perm\) and k is sharded over "
                                         r"mesh axes \('model',\)"):
        shard_weight(w, mesh, P("model", None))
    # Placed around shard_weight: the partitioner refuses it too (XLA hands
    # the ValueError back as a JaxRuntimeError carrying its message).
    placed = jax.device_put(w, jax.tree.map(lambda s: NamedSharding(mesh, s),
                                            weight_spec_tree(w, P("model", None)),
                                            is_leaf=lambda s: isinstance(s, P)))
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"ValueError: jm.matmul: the weight \[k, n\] = \[1024, 512\] "
                             r"is sharded as .* act-order"):
        jax.jit(jm.matmul)(random_x(rng, 8, 1024), placed)
