"""jm.matmul on the CPU custom call: against the jnp reference and float64."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_marlin as jm
from conftest import FP16_U, float64_reference, random_weight, random_x, rel_err
from jax_marlin.primitive import _bind

# The CPU handler and the reference compute x @ W exactly up to fp32
# accumulation (W's values (q - 8) * scale are exact in fp32) and round once to
# fp16: ||y - ref|| / ||ref|| <= FP16_U plus the fp32 accumulation error,
# far below 1e-5 at these sizes.
TOL = FP16_U + 1e-5

MS = [1, 2, 3, 16, 17, 64, 100, 128, 1024]
LAYERS = [(128, 128, 128), (256, 192, -1), (1024, 512, 128), (512, 320, 128), (192, 256, -1)]


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
    y = jax.jit(lambda x, w: _bind(x, w, poison_output=True))(x, w)
    assert y.shape == (m, n) and y.dtype == jnp.float16
    assert rel_err(y, ref) <= TOL
    assert rel_err(jm.reference.matmul(x, w), ref) <= TOL


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


def test_poison_is_overwritten(rng, weights):
    # A poisoned run writes every element: no NaN survives, same bits as unpoisoned.
    w = weights[(512, 320, 128)]
    x = random_x(rng, 33, 512)
    poisoned = jax.jit(lambda x, w: _bind(x, w, poison_output=True))(x, w)
    np.testing.assert_array_equal(np.asarray(poisoned), np.asarray(jm.matmul(x, w)))


@pytest.mark.parametrize(
    "make,error,match",
    [
        (lambda x, w: (x.astype(np.float32), w), TypeError, "x.dtype is float32"),
        (lambda x, w: (x[:, :100], w), ValueError, r"x.shape\[-1\] = 100"),
        (lambda x, w: (x, w.qweight), TypeError, "MarlinWeight"),
        (lambda x, w: (x, jm.MarlinWeight(w.qweight[:4], w.scales, w.k, w.n, w.group_size)),
         ValueError, "qweight.shape"),
        (lambda x, w: (x, jm.MarlinWeight(w.qweight, w.scales[:1], w.k, w.n, w.group_size)),
         ValueError, "scales.shape"),
        (lambda x, w: (x, jm.MarlinWeight(w.qweight, w.scales.astype(jnp.float32), w.k, w.n,
                                          w.group_size)), TypeError, "scales.dtype"),
        (lambda x, w: (x, jm.MarlinWeight(w.qweight.astype(jnp.uint32), w.scales, w.k, w.n,
                                          w.group_size)), TypeError, "qweight.dtype"),
        (lambda x, w: (x, jm.MarlinWeight(w.qweight, w.scales, w.k, w.n, 64)), ValueError,
         "group_size = 64"),
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


def test_handler_rechecks_buffers(rng, weights):
    # Calling the FFI target directly with inconsistent buffers gets an error
    # from the C++ checks, not a bad memory access.
    w = weights[(1024, 512, 128)]
    x = random_x(rng, 4, 1024)
    call = jax.ffi.ffi_call(
        "jax_marlin_matmul",
        (jax.ShapeDtypeStruct((4, 512), jnp.float16), jax.ShapeDtypeStruct((8192,), jnp.int32)),
    )
    with pytest.raises(Exception, match="scales has shape"):
        jax.block_until_ready(call(x, w.qweight, w.scales[:2], group_size=128, poison_output=False))
    with pytest.raises(Exception, match="workspace holds"):
        small = jax.ffi.ffi_call(
            "jax_marlin_matmul",
            (jax.ShapeDtypeStruct((4, 512), jnp.float16), jax.ShapeDtypeStruct((8,), jnp.int32)),
        )
        jax.block_until_ready(small(x, w.qweight, w.scales, group_size=128, poison_output=False))
