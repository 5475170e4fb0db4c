"""quantize / pack / unpack / dequantize and the exact Marlin layout."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_marlin as jm
from conftest import random_weight

SHAPES = [(64, 128), (128, 64), (256, 256), (384, 192), (1024, 512)]
# (k, n, group_size) with k a multiple of the group
LAYERS = [(k, n, g) for k, n in SHAPES for g in (-1, 128) if g == -1 or k % g == 0]


# --- the layout, stated independently -----------------------------------------
#
# How the kernel consumes one int32 word (ffi/marlin_kernel.cu, dequant()):
# q & 0x000f000f gives the half2 (b0, b1) of the B fragment for the tile's left
# 8 columns, q & 0x00f000f0 gives (b2, b3); q >> 8 gives the same for the right
# 8 columns. Per PTX, lane L's B fragment of mma.m16n8k16 holds rows
# 2 (L % 4) + {0, 1} (b0, b1) and 2 (L % 4) + 8 + {0, 1} (b2, b3), column L // 4.
NIBBLE = {  # (right half?, fragment element) -> nibble of the word
    (0, "b0"): 0, (0, "b1"): 4, (0, "b2"): 1, (0, "b3"): 5,
    (1, "b0"): 2, (1, "b1"): 6, (1, "b2"): 3, (1, "b3"): 7,
}
FRAG_ROW = {"b0": 0, "b1": 1, "b2": 8, "b3": 9}


def layout_tile_by_tile(q: np.ndarray) -> np.ndarray:
    """qweight for q [k, n] (ints 0..15), built one 16x16 tile and lane at a time."""
    k, n = q.shape
    out = np.zeros((k // 16, 2 * n), np.uint32)
    for tk in range(k // 16):
        for tn in range(n // 16):
            tile = q[16 * tk:16 * tk + 16, 16 * tn:16 * tn + 16]
            chunk, j = divmod(tn, 4)  # four tiles along n share a 128-word chunk
            for lane in range(32):
                word = 0
                for (half, elem), nibble in NIBBLE.items():
                    row = 2 * (lane % 4) + FRAG_ROW[elem]
                    col = lane // 4 + 8 * half
                    word |= int(tile[row, col]) << (4 * nibble)
                out[tk, 128 * chunk + 4 * lane + j] = word
    return out.view(np.int32)


def marlin_layer_pack(q: np.ndarray, scales: np.ndarray, group_size: int):
    """The reference Marlin ``Layer.pack`` algorithm (perm lists + interleave), in numpy."""
    k, n = q.shape
    perm = []
    for i in range(32):
        perm1 = []
        col = i // 4
        for block in (0, 1):
            for row in (2 * (i % 4), 2 * (i % 4) + 1, 2 * (i % 4 + 4), 2 * (i % 4 + 4) + 1):
                perm1.append(16 * row + col + 8 * block)
        for j in range(4):
            perm.extend(p + 256 * j for p in perm1)
    perm = np.array(perm).reshape(-1, 8)[:, [0, 2, 4, 6, 1, 3, 5, 7]].ravel()
    scale_perm = [i + 8 * j for i in range(8) for j in range(8)]
    scale_perm_single = [2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)]

    w = q.reshape(k // 16, 16, n // 16, 16).transpose(0, 2, 1, 3).reshape(k // 16, n * 16)
    w = w.reshape(-1, perm.size)[:, perm].reshape(w.shape).astype(np.uint32)
    packed = np.zeros((w.shape[0], w.shape[1] // 8), np.uint32)
    for i in range(8):
        packed |= w[:, i::8] << (4 * i)
    sp = scale_perm_single if group_size == -1 else scale_perm
    s = scales.reshape(-1, len(sp))[:, sp].reshape(scales.shape)
    return packed.view(np.int32), s


def random_q(rng, k, n):
    return rng.integers(0, 16, size=(k, n))


@pytest.mark.parametrize("k,n", [(64, 128), (128, 64), (128, 192)])
def test_layout_tile_by_tile(rng, k, n):
    q = random_q(rng, k, n)
    w = jm.pack(q, np.ones((1, n), np.float16), group_size=-1)
    np.testing.assert_array_equal(np.asarray(w.qweight), layout_tile_by_tile(q))


@pytest.mark.parametrize("k,n,group_size", LAYERS)
def test_bit_identical_to_marlin_layer_pack(rng, k, n, group_size):
    groups = 1 if group_size == -1 else k // group_size
    q = random_q(rng, k, n)
    scales = rng.uniform(0.01, 1, size=(groups, n)).astype(np.float16)
    w = jm.pack(q, scales, group_size=group_size)
    want_q, want_s = marlin_layer_pack(q, scales, group_size)
    np.testing.assert_array_equal(np.asarray(w.qweight), want_q)
    np.testing.assert_array_equal(np.asarray(w.scales), want_s)
    assert w.qweight.dtype == jnp.int32 and w.scales.dtype == jnp.float16
    assert (w.k, w.n, w.group_size) == (k, n, group_size)


@pytest.mark.parametrize("k,n,group_size", LAYERS)
def test_pack_unpack_round_trip(rng, k, n, group_size):
    groups = 1 if group_size == -1 else k // group_size
    q = random_q(rng, k, n)
    scales = rng.uniform(0.01, 1, size=(groups, n)).astype(np.float16)
    q2, s2 = jm.unpack(jm.pack(q, scales, group_size=group_size))
    np.testing.assert_array_equal(np.asarray(q2), q)
    np.testing.assert_array_equal(np.asarray(s2), scales)


@pytest.mark.parametrize("group_size", [-1, 128])
def test_quantize_is_rtn_within_half_a_step(rng, group_size):
    k, n = 512, 256
    weight = random_weight(rng, k, n)
    w = jm.quantize(weight, group_size=group_size)
    q, scales = (np.asarray(a) for a in jm.unpack(w))
    g = k if group_size == -1 else group_size
    s = np.repeat(scales.astype(np.float32), g, axis=0)
    # Scale max|w| / 7.5 per group and column, rounded to fp16 (to within one
    # fp16 step: XLA may divide by multiplying with the reciprocal).
    absmax = np.abs(weight).reshape(k // g, g, n).max(axis=1)
    np.testing.assert_allclose(scales, absmax / 7.5, rtol=2**-10)
    deq = np.asarray(jm.dequantize(w, jnp.float32))
    np.testing.assert_array_equal(deq, (q - 8) * s)
    # Every value within half a step of its weight. The largest magnitude sits
    # at 7.5 steps, so rounding the scale to fp16 (relative 2^-11) can move it
    # by up to 7.5 * 2^-11 of a step more.
    assert np.all(np.abs(deq - weight) <= s * (0.5 + 7.5 * 2**-11))
    assert q.min() >= 0 and q.max() <= 15


def test_quantize_all_zero_group():
    weight = np.zeros((128, 64), np.float32)
    weight[:, 1] = -1.0
    w = jm.quantize(weight, group_size=128)
    deq = np.asarray(jm.dequantize(w, jnp.float32))
    np.testing.assert_array_equal(deq[:, [0, *range(2, 64)]], 0.0)  # no 0/0
    step = 1.0 / 7.5
    np.testing.assert_allclose(deq[:, 1], -1.0, atol=step * (0.5 + 7.5 * 2**-11))


def test_dequantize_dtypes(rng):
    w = jm.quantize(random_weight(rng, 128, 128), group_size=128)
    assert jm.dequantize(w).dtype == jnp.float16
    assert jm.dequantize(w, jnp.float32).shape == (128, 128)


def test_quantize_is_traceable(rng):
    weight = jax.ShapeDtypeStruct((1024, 512), jnp.float32)
    w = jax.eval_shape(lambda a: jm.quantize(a, group_size=128), weight)
    assert isinstance(w, jm.MarlinWeight)
    assert w.qweight.shape == (64, 1024) and w.qweight.dtype == jnp.int32
    assert w.scales.shape == (8, 512) and w.scales.dtype == jnp.float16
    # jit gives the same bits as eager.
    real = random_weight(rng, 1024, 512)
    a = jm.quantize(real, group_size=128)
    b = jax.jit(lambda x: jm.quantize(x, group_size=128))(real)
    np.testing.assert_array_equal(np.asarray(a.qweight), np.asarray(b.qweight))


def test_marlin_weight_is_a_pytree(rng):
    w = jm.quantize(random_weight(rng, 128, 64), group_size=128)
    leaves, treedef = jax.tree.flatten(w)
    assert len(leaves) == 2
    w2 = jax.tree.unflatten(treedef, leaves)
    assert (w2.k, w2.n, w2.group_size) == (128, 64, 128)
    assert w.shape == (128, 64)
    assert w.nbytes == 128 * 64 // 2 + 64 * 2
    assert "k=128" in repr(w)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(shape=(100, 128)), ValueError, "k = 100"),
        (dict(shape=(128, 100)), ValueError, "n = 100"),
        (dict(shape=(192, 192), group_size=-1), ValueError, "multiple of 128"),
        (dict(shape=(192, 128)), ValueError, "multiple of group_size"),
        (dict(shape=(128, 128), group_size=64), ValueError, "group_size = 64"),
        (dict(shape=(128,)), ValueError, "2-D"),
        (dict(shape=(128, 128), dtype=np.int32), TypeError, "float"),
    ],
)
def test_quantize_bad_input(kwargs, error, match):
    shape = kwargs.pop("shape")
    dtype = kwargs.pop("dtype", np.float32)
    with pytest.raises(error, match=match):
        jm.quantize(np.ones(shape, dtype), **kwargs)


def test_quantize_rejects_non_finite():
    weight = np.ones((128, 64), np.float32)
    weight[3, 4] = np.nan
    with pytest.raises(ValueError, match="inf or NaN"):
        jm.quantize(weight)


def test_pack_bad_input(rng):
    q = random_q(rng, 128, 64)
    ok = np.ones((1, 64), np.float16)
    with pytest.raises(ValueError, match="values in"):
        jm.pack(q + 1, ok, group_size=128)
    with pytest.raises(ValueError, match="scales.shape"):
        jm.pack(q, np.ones((2, 64), np.float16), group_size=128)
    with pytest.raises(TypeError, match="integers"):
        jm.pack(q.astype(np.float32), ok, group_size=128)
    with pytest.raises(TypeError, match="MarlinWeight"):
        jm.unpack(q)
