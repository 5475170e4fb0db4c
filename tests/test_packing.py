"""quantize / pack / unpack / dequantize and the exact Marlin layout."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_marlin as jm
from jax_marlin.ops import _matmul
from conftest import ODD, imported_weight, random_weight

SHAPES = [(64, 128), (128, 64), (256, 256), (384, 192), (1024, 512)]
GROUP_SIZES = (-1, 32, 64, 128)
# (k, n, group_size) with k a multiple of the group: shapes the kernel runs unpadded
LAYERS = [(k, n, g) for k, n in SHAPES for g in GROUP_SIZES if g == -1 or k % g == 0]


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


@pytest.mark.parametrize("dtype", [np.float16, jnp.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("k,n,group_size", LAYERS)
def test_bit_identical_to_marlin_layer_pack(rng, k, n, group_size, dtype):
    # The 64-element scale permutation serves every grouped size (32, 64, 128),
    # the 32-element one per column; bfloat16 scales move like float16 ones.
    groups = 1 if group_size == -1 else k // group_size
    q = random_q(rng, k, n)
    scales = rng.uniform(0.01, 1, size=(groups, n)).astype(dtype)
    w = jm.pack(q, scales, group_size=group_size)
    want_q, want_s = marlin_layer_pack(q, scales, group_size)
    np.testing.assert_array_equal(np.asarray(w.qweight), want_q)
    np.testing.assert_array_equal(np.asarray(w.scales), want_s)
    assert w.qweight.dtype == jnp.int32 and w.scales.dtype == dtype
    assert (w.k, w.n, w.group_size) == (k, n, group_size)
    assert w.padded_shape == (k, n)


@pytest.mark.parametrize("k,n,group_size", LAYERS)
def test_pack_unpack_round_trip(rng, k, n, group_size):
    groups = 1 if group_size == -1 else k // group_size
    q = random_q(rng, k, n)
    scales = rng.uniform(0.01, 1, size=(groups, n)).astype(np.float16)
    q2, s2 = jm.unpack(jm.pack(q, scales, group_size=group_size))
    np.testing.assert_array_equal(np.asarray(q2), q)
    np.testing.assert_array_equal(np.asarray(s2), scales)


@pytest.mark.parametrize("dtype", [np.float16, jnp.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_quantize_is_rtn_within_half_a_step(rng, group_size, dtype):
    k, n = 512, 256
    weight = random_weight(rng, k, n)
    w = jm.quantize(weight, group_size=group_size, dtype=dtype)
    assert w.scales.dtype == dtype and w.dtype == dtype
    q, scales = (np.asarray(a) for a in jm.unpack(w))
    g = k if group_size == -1 else group_size
    s = np.repeat(scales.astype(np.float32), g, axis=0)
    # The scale's dtype rounds to relative u = 2^-11 (float16) or 2^-8
    # (bfloat16) of its value.
    u = 2.0**-11 if dtype == np.float16 else 2.0**-8
    # Scale max|w| / 7.5 per group and column, rounded to the dtype (to within
    # one step of it: XLA may divide by multiplying with the reciprocal).
    absmax = np.abs(weight).reshape(k // g, g, n).max(axis=1)
    np.testing.assert_allclose(scales.astype(np.float32), absmax / 7.5, rtol=2 * u)
    deq = np.asarray(jm.dequantize(w, jnp.float32))
    np.testing.assert_array_equal(deq, (q - 8) * s)
    assert jm.dequantize(w).dtype == dtype  # by default, the scales' dtype
    # Every value within half a step of its weight. The largest magnitude sits
    # at 7.5 steps, so rounding the scale (relative u) can move it by up to
    # 7.5 u of a step more.
    assert np.all(np.abs(deq - weight) <= s * (0.5 + 7.5 * u))
    assert q.min() >= 0 and q.max() <= 15


def test_scale_dtype_follows_the_weight(rng):
    weight = random_weight(rng, 128, 64)
    assert jm.quantize(weight).dtype == np.float16  # float32 weight: float16 scales
    assert jm.quantize(weight.astype(jnp.bfloat16)).dtype == jnp.bfloat16
    assert jm.quantize(weight.astype(jnp.bfloat16), dtype=np.float16).dtype == np.float16
    q, scales = random_q(rng, 128, 64), np.ones((1, 64), np.float32)
    assert jm.pack(q, scales).dtype == np.float16
    assert jm.pack(q, scales.astype(jnp.bfloat16)).dtype == jnp.bfloat16
    assert jm.pack(q, scales, dtype=jnp.bfloat16).dtype == jnp.bfloat16
    with pytest.raises(TypeError, match="dtype = float32"):
        jm.quantize(weight, dtype=np.float32)


# --- padding: any [k, n] (the padded shapes themselves: tests/test_shapes.py) ------


@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("k,n", list(ODD))
def test_quantize_pads_odd_shapes(rng, k, n, group_size):
    weight = random_weight(rng, k, n)
    w = jm.quantize(weight, group_size=group_size)
    k_pad, n_pad = ODD[(k, n)][group_size]
    assert (w.k, w.n) == (k, n) and w.padded_shape == (k_pad, n_pad)
    assert w.qweight.shape == (k_pad // 16, 2 * n_pad)
    # The padded weight is exactly the quantization of the zero-padded one...
    padded = jm.quantize(np.pad(weight, ((0, k_pad - k), (0, n_pad - n))), group_size=group_size)
    np.testing.assert_array_equal(np.asarray(w.qweight), np.asarray(padded.qweight))
    np.testing.assert_array_equal(np.asarray(w.scales), np.asarray(padded.scales))
    # ... whose padding is exactly zero, and whose real part dequantizes to the
    # logical [k, n] within half a step.
    full = np.asarray(jm.dequantize(jm.MarlinWeight(w.qweight, w.scales, k_pad, n_pad,
                                                    group_size), jnp.float32))
    assert not full[k:].any() and not full[:, n:].any()
    deq = np.asarray(jm.dequantize(w, jnp.float32))
    assert deq.shape == (k, n)
    np.testing.assert_array_equal(deq, full[:k, :n])
    q, scales = (np.asarray(a) for a in jm.unpack(w))
    g = k_pad if group_size == -1 else group_size
    assert q.shape == (k, n) and scales.shape == (-(-k // g), n)
    step = np.repeat(scales.astype(np.float32), g, axis=0)[:k]
    assert np.all(np.abs(deq - weight) <= step * (0.5 + 7.5 * 2**-11))


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_partial_last_group_scale_comes_from_its_real_rows(rng, group_size):
    # k = 1000: the last group holds 1000 % g real rows (8, 40 or 104) and
    # g - that many padded ones. Make its real rows the largest of the column
    # everywhere else, so a scale taken over a wrong row range shows.
    k, n = 1000, 64
    real = k % group_size
    weight = random_weight(rng, k, n)
    weight[k - real:] *= 0.25
    weight[k - real - 1] = 40.0  # the row just before the last group
    w = jm.quantize(weight, group_size=group_size)
    _, scales = jm.unpack(w)
    expected = np.abs(weight[k - real:]).max(axis=0) / 7.5
    np.testing.assert_allclose(np.asarray(scales[-1], np.float32), expected, rtol=2**-10)
    assert scales.shape == (k // group_size + 1, n)


@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_pack_odd_shapes_round_trip(rng, group_size):
    k, n = 1000, 576
    groups = 1 if group_size == -1 else -(-k // group_size)
    q = random_q(rng, k, n)
    scales = rng.uniform(0.01, 1, size=(groups, n)).astype(jnp.bfloat16)
    w = jm.pack(q, scales, group_size=group_size)
    assert w.padded_shape == ODD[(k, n)][group_size] and w.dtype == jnp.bfloat16
    q2, s2 = jm.unpack(w)
    np.testing.assert_array_equal(np.asarray(q2), q)
    np.testing.assert_array_equal(np.asarray(s2), scales)
    g = k if group_size == -1 else group_size
    deq = (q - 8) * np.repeat(scales.astype(np.float32), g, axis=0)[:k]
    np.testing.assert_array_equal(np.asarray(jm.dequantize(w, jnp.float32)), deq)


@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_quantize_all_zero_group(group_size):
    weight = np.zeros((128, 64), np.float32)
    weight[:, 1] = -1.0
    w = jm.quantize(weight, group_size=group_size)
    deq = np.asarray(jm.dequantize(w, jnp.float32))
    np.testing.assert_array_equal(deq[:, [0, *range(2, 64)]], 0.0)  # no 0/0
    step = 1.0 / 7.5
    np.testing.assert_allclose(deq[:, 1], -1.0, atol=step * (0.5 + 7.5 * 2**-11))


def test_dequantize_dtypes(rng):
    w = jm.quantize(random_weight(rng, 128, 128), group_size=128)
    assert jm.dequantize(w).dtype == jnp.float16
    assert jm.dequantize(w, jnp.float32).shape == (128, 128)
    wb = jm.quantize(random_weight(rng, 128, 100), group_size=32, dtype=jnp.bfloat16)
    assert jm.dequantize(wb).dtype == jnp.bfloat16 and jm.dequantize(wb).shape == (128, 100)
    # An integer dtype would truncate the fractions: refused, naming it.
    for dtype in (jnp.int32, jnp.int8, jnp.bool_):
        with pytest.raises(TypeError, match="float dtype"):
            jm.dequantize(w, dtype)


def test_quantize_is_traceable(rng):
    weight = jax.ShapeDtypeStruct((1024, 512), jnp.float32)
    w = jax.eval_shape(lambda a: jm.quantize(a, group_size=128), weight)
    assert isinstance(w, jm.MarlinWeight)
    assert w.qweight.shape == (64, 1024) and w.qweight.dtype == jnp.int32
    assert w.scales.shape == (8, 512) and w.scales.dtype == jnp.float16
    odd = jax.eval_shape(lambda a: jm.quantize(a, group_size=32),
                         jax.ShapeDtypeStruct((1000, 576), jnp.bfloat16))
    assert odd.qweight.shape == (64, 1152) and odd.scales.shape == (32, 576)
    assert odd.scales.dtype == jnp.bfloat16 and (odd.k, odd.n) == (1000, 576)
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
    assert "k=128" in repr(w) and "padded" not in repr(w)
    # Padded: the logical shape stays; bytes are those stored (padded).
    odd = jm.quantize(random_weight(rng, 100, 64), group_size=32, dtype=jnp.bfloat16)
    assert odd.shape == (100, 64) and odd.padded_shape == (128, 64)
    assert odd.nbytes == 128 * 64 // 2 + 4 * 64 * 2
    assert "padded to [128, 64]" in repr(odd)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(shape=(128, 128), group_size=96), ValueError, "group_size = 96"),
        (dict(shape=(0, 128)), ValueError, r"\[0, 128\] must be positive"),
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
    with pytest.raises(ValueError, match=r"expected \(4, 64\)"):  # ceil(100 / 32) groups
        jm.pack(q[:100], np.ones((3, 64), np.float16), group_size=32)
    with pytest.raises(TypeError, match="integers"):
        jm.pack(q.astype(np.float32), ok, group_size=128)
    with pytest.raises(TypeError, match="MarlinWeight"):
        jm.unpack(q)


# --- the scales' range -------------------------------------------------------------


def test_fp16_scale_overflow_raises(rng):
    w = random_weight(rng, 128, 128) * 1e6  # max|w| ~ 4e6: a scale above 65504
    with pytest.raises(ValueError, match=r"max\|w\| from .* overflows float16.*bfloat16"):
        jm.quantize(w)
    # bfloat16 scales hold it: the dequantized weight is within the 4-bit error.
    wb = jm.quantize(w, dtype=jnp.bfloat16)
    err = np.linalg.norm(np.asarray(jm.dequantize(wb, jnp.float32)) - w) / np.linalg.norm(w)
    assert err < 0.2


def test_fp16_scale_underflow(rng):
    tiny = random_weight(rng, 128, 128) * 1e-9  # every scale below fp16's 6e-8
    with pytest.raises(ValueError, match=r"underflows to 0 in float16.*multiply to zero"):
        jm.quantize(tiny)
    mixed = random_weight(rng, 256, 128)
    mixed[128:] *= 1e-9  # the second group of every column underflows
    with pytest.warns(UserWarning, match=r"128 groups .* underflow to 0 in float16"):
        w = jm.quantize(mixed)
    assert np.all(np.asarray(jm.dequantize(w, jnp.float32))[128:] == 0)
    # Scales inside the range neither raise nor warn.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jm.quantize(random_weight(rng, 128, 128) * 1e3)
        jm.quantize(random_weight(rng, 128, 128) * 1e-5)


# --- zero points and act-order -------------------------------------------------------


@pytest.mark.parametrize("group_size", [32, 128, -1])
@pytest.mark.parametrize("k,n", [(256, 128), (1000, 576)])
def test_zeros_and_act_order_roundtrip(rng, k, n, group_size):
    w, weight = imported_weight(rng, k, n, group_size, act_order=group_size != -1)
    assert w.zeros.dtype == np.int32 and w.zeros.shape == (w.scales.shape[0], w.n_pad // 8)
    assert (w.perm is not None) == (group_size != -1)
    # dequantize: the original row order, the weight's own zero points, exactly.
    np.testing.assert_array_equal(np.asarray(jm.dequantize(w, jnp.float32), np.float64), weight)
    q, scales, zeros, g_idx = jm.unpack(w)
    w2 = jm.pack(q, scales, group_size, zeros=zeros, g_idx=g_idx)
    for field in ("qweight", "scales", "zeros", "perm"):
        a, b = getattr(w, field), getattr(w2, field)
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if w.padded_shape != w.shape:  # padded zero points are 8: padding stays zero
        groups = jm.unpack(w)[1].shape[0]
        natural = zeros_as_kernels_read_them(np.asarray(w.zeros))
        assert (natural[groups:] == 8).all() and (natural[:, n:] == 8).all()
    assert w.nbytes == (w.qweight.nbytes + w.scales.nbytes + w.zeros.nbytes
                        + (0 if w.perm is None else w.perm.nbytes))


def zeros_as_kernels_read_them(packed: np.ndarray) -> np.ndarray:
    """Natural-order zero points ``[g, n]`` from packed ``[g, n // 8]``, as the kernels read them.

    In every kernel the thread that dequantizes column ``i`` (0..7) of tile
    ``t`` (16 columns, 4 per 64-column chunk) of a chunk, and column ``i + 8``
    beside it, reads word ``8 chunk + i`` and takes bits ``4 t`` (column
    ``16 t + i``) and ``16 + 4 t`` (column ``16 t + i + 8``).
    """
    g, words = packed.shape
    packed = packed.view(np.uint32)
    out = np.zeros((g, 8 * words), np.int64)
    for chunk in range(words // 8):
        for i in range(8):
            word = packed[:, 8 * chunk + i]
            for t in range(4):
                out[:, 64 * chunk + 16 * t + i] = (word >> (4 * t)) & 0xF
                out[:, 64 * chunk + 16 * t + i + 8] = (word >> (16 + 4 * t)) & 0xF
    return out


@pytest.mark.parametrize("group_size", [64, -1])
def test_zeros_layout_is_what_the_kernels_read(rng, group_size):
    # An independent statement of the packed zero points (the kernels' reads,
    # above) against pack, on a padded odd shape.
    k, n = 1000, 576
    groups = 1 if group_size == -1 else -(-k // group_size)
    zeros = rng.integers(0, 16, (groups, n))
    w = jm.pack(rng.integers(0, 16, (k, n)), np.ones((groups, n), np.float16), group_size,
                zeros=zeros)
    natural = zeros_as_kernels_read_them(np.asarray(w.zeros))
    assert natural.shape == (groups, w.n_pad)
    np.testing.assert_array_equal(natural[:, :n], zeros)
    assert (natural[:, n:] == 8).all()


def test_trivial_zeros_and_g_idx_store_nothing(rng):
    q = rng.integers(0, 16, (256, 128))
    scales = np.ones((2, 128), np.float16)
    w = jm.pack(q, scales, 128, zeros=np.full((2, 128), 8), g_idx=np.arange(256) // 128)
    assert w.zeros is None and w.perm is None
    q2, s2 = jm.unpack(w)  # a plain weight unpacks to (q, scales)
    np.testing.assert_array_equal(np.asarray(q2), q)


def test_positional_constructor_and_pytree(rng):
    w, _ = imported_weight(rng, 256, 128, 64)
    plain = jm.MarlinWeight(w.qweight, w.scales, w.k, w.n, w.group_size)
    assert plain.perm is None and plain.zeros is None
    assert len(jax.tree.leaves(plain)) == 2 and len(jax.tree.leaves(w)) == 4
    doubled = jax.jit(lambda w: w)(w)
    np.testing.assert_array_equal(np.asarray(doubled.perm), np.asarray(w.perm))
    assert "perm=int32[256], zeros=int32[4, 16]" in repr(w)


@pytest.mark.parametrize("make,error,match", [
    (lambda q, s: jm.pack(q, s, 64, zeros=np.full((4, 128), 16)), ValueError,
     r"zeros holds values in \[16, 16\]"),
    (lambda q, s: jm.pack(q, s, 64, zeros=np.full((2, 128), 8)), ValueError,
     r"zeros: int\d+\[2, 128\], expected integers of the scales' shape \(4, 128\)"),
    (lambda q, s: jm.pack(q, s, 64, g_idx=np.arange(255)), ValueError,
     r"g_idx: int64\[255\], expected integers \[256\]"),
    (lambda q, s: jm.pack(q, s, 64, g_idx=np.arange(256) // 32), ValueError,
     r"g_idx does not group the rows in runs of group_size = 64.*values in \[0, 7\]"),
    (lambda q, s: jax.jit(lambda g: jm.pack(q, s, 64, g_idx=g))(np.arange(256) // 64),
     ValueError, "g_idx must be concrete"),
])
def test_zeros_and_g_idx_errors(rng, make, error, match):
    q = rng.integers(0, 16, (256, 128))
    s = np.ones((4, 128), np.float16)
    with pytest.raises(error, match=match):
        make(q, s)


def test_inconsistent_perm_or_zeros_raise(rng):
    w, _ = imported_weight(rng, 256, 128, 64)
    with pytest.raises(ValueError, match=r"perm: int32\[255\], expected int32\[256\]"):
        jm.dequantize(dataclasses.replace(w, perm=w.perm[1:]))
    with pytest.raises(ValueError, match=r"zeros: uint8\[4, 16\], expected int32\[4, 16\]"):
        jm.matmul(np.ones((1, 256), np.float16),
                  dataclasses.replace(w, zeros=w.zeros.astype(jnp.uint8)))
    with pytest.raises(ValueError, match=r"zeros: int32\[4, 128\], expected int32\[4, 16\]"):
        jm.dequantize(dataclasses.replace(w, zeros=jnp.zeros((4, 128), jnp.int32)))


# --- concatenate along n ---------------------------------------------------------------
#
# (k, widths, group_size): aligned widths join the packed arrays as they are;
# SmolLM2's attention (576 x [576, 192, 192]) and MLP (576 x [1536, 1536])
# have parts stored with other paddings than the joined weight (k_pad 640 or
# 576, n_pad 640 for 576 at g64 and -1); widths that are no multiple of 64
# take the unpack-and-pack route.
CONCAT_CASES = [
    (256, (128, 64, 64), 128),
    (576, (576, 192, 192), 128),
    (576, (576, 192, 192), 64),
    (576, (576, 192, 192), -1),
    (576, (1536, 1536), 64),
    (256, (100, 60, 30), 32),
    (576, (130, 192), 64),
    (1000, (64, 100), -1),
]


def concat_parts(rng, k, widths, group_size, *, zeros=False, act_order=False):
    """Packed ``[k, n_i]`` parts with one shared act-order row order (if any) and their arrays."""
    rows = k if group_size == -1 else group_size
    groups = -(-k // rows)
    g_idx = None
    if act_order:
        g_idx = np.empty(k, np.int64)
        g_idx[rng.permutation(k)] = np.arange(k) // rows
    parts = []
    for n in widths:
        q = rng.integers(0, 16, (k, n))
        scales = rng.uniform(0.5, 2.0, (groups, n)).astype(np.float16) / 16
        z = rng.integers(0, 16, (groups, n)) if zeros else None
        parts.append(jm.pack(q, scales, group_size, zeros=z, g_idx=g_idx))
    return parts


@pytest.mark.parametrize("k,widths,group_size", CONCAT_CASES)
def test_concatenate_equals_separate_matmuls(rng, k, widths, group_size):
    weights = [random_weight(rng, k, n) for n in widths]
    parts = [jm.quantize(w, group_size) for w in weights]
    joined = jm.concatenate(parts)
    assert joined.shape == (k, sum(widths))
    assert joined.padded_shape == jm.padded_shape(k, sum(widths), group_size)
    x = rng.standard_normal((5, k)).astype(np.float16)
    separate = np.concatenate([np.asarray(jm.matmul(x, w)) for w in parts], axis=-1)
    fused = jax.jit(lambda x, w: _matmul(x, w, poison_output=True))(x, joined)
    # The CPU kernel sums each column over k in order; padded rows add exact zeros.
    np.testing.assert_array_equal(np.asarray(fused).view(np.uint16), separate.view(np.uint16))
    # Moved, not rounded again: the unpacked arrays side by side ...
    q, scales = jm.unpack(joined)
    unpacked = [jm.unpack(w) for w in parts]
    np.testing.assert_array_equal(np.asarray(q), np.concatenate([u[0] for u in unpacked], 1))
    np.testing.assert_array_equal(np.asarray(scales), np.concatenate([u[1] for u in unpacked], 1))
    # ... and round to nearest of the joined float weights, bit for bit (its
    # scales are per column, so joining commutes with quantizing).
    requantized = jm.quantize(np.concatenate(weights, 1), group_size, dtype=jnp.float16)
    np.testing.assert_array_equal(np.asarray(joined.qweight), np.asarray(requantized.qweight))
    np.testing.assert_array_equal(np.asarray(joined.scales), np.asarray(requantized.scales))


@pytest.mark.parametrize("k,widths,group_size", [(576, (576, 192, 192), 64),
                                                 (256, (100, 60, 30), 32),
                                                 (1000, (64, 100), -1)])
def test_concatenate_zeros_and_act_order(rng, k, widths, group_size):
    parts = concat_parts(rng, k, widths, group_size, zeros=True,
                         act_order=group_size != -1)
    joined = jm.concatenate(parts)
    assert joined.zeros is not None and (joined.perm is None) == (group_size == -1)
    x = rng.standard_normal((3, k)).astype(np.float16)
    separate = np.concatenate([np.asarray(jm.matmul(x, w)) for w in parts], axis=-1)
    fused = jax.jit(lambda x, w: _matmul(x, w, poison_output=True))(x, joined)
    np.testing.assert_array_equal(np.asarray(fused).view(np.uint16), separate.view(np.uint16))
    unpacked = [jm.unpack(w) for w in parts]
    for got, field in zip(jm.unpack(joined), ("q", "scales", "zeros", "g_idx")):
        want = (np.asarray(unpacked[0][3]) if field == "g_idx" else
                np.concatenate([u[("q", "scales", "zeros").index(field)] for u in unpacked], 1))
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=field)
    np.testing.assert_array_equal(
        np.asarray(jm.dequantize(joined, jnp.float32)),
        np.concatenate([np.asarray(jm.dequantize(w, jnp.float32)) for w in parts], 1))


def test_concatenate_is_traceable(rng):
    parts = [jm.quantize(random_weight(rng, 576, n), 64) for n in (576, 192)]
    joined = jax.jit(jm.concatenate)(parts)
    np.testing.assert_array_equal(np.asarray(joined.qweight),
                                  np.asarray(jm.concatenate(parts).qweight))
    abstract = jax.eval_shape(jm.concatenate, parts)
    assert abstract.shape == (576, 768) and abstract.qweight.shape == (36, 1536)


def test_concatenate_errors(rng):
    w = jm.quantize(random_weight(rng, 256, 128), 64)
    cases = [
        ([], "at least one MarlinWeight"),
        ([w, jm.quantize(random_weight(rng, 320, 128), 64)],
         r"the weights' k differ \(\[0\] 256, \[1\] 320\)"),
        ([w, jm.quantize(random_weight(rng, 256, 128), 128)],
         r"group_size differ \(\[0\] 64, \[1\] 128\)"),
        ([w, jm.quantize(random_weight(rng, 256, 128), 64, dtype=jnp.bfloat16)],
         r"dtype differ \(\[0\] float16, \[1\] bfloat16\)"),
        ([w, concat_parts(rng, 256, (128,), 64, zeros=True)[0]],
         r"zeros \(zero points\) on some weights but not all \(present: \[0\] False, \[1\] True\)"),
        ([w, concat_parts(rng, 256, (128,), 64, act_order=True)[0]],
         r"perm \(act-order\) is set on some weights but not all.*\[1\] int32\[256\]"),
        (concat_parts(rng, 256, (128,), 64, act_order=True)
         + concat_parts(rng, 256, (64,), 64, act_order=True),
         r"perm \(act-order row orders\) differ"),
    ]
    for weights, match in cases:
        with pytest.raises(ValueError, match=match):
            jm.concatenate(weights)
    with pytest.raises(TypeError, match="expected a jax_marlin.MarlinWeight, got ndarray"):
        jm.concatenate([w, np.zeros((256, 128))])
    act = concat_parts(rng, 256, (128,), 64, act_order=True)[0]
    with pytest.raises(ValueError, match="or is traced"):
        jax.jit(lambda a: jm.concatenate([a, a]))(act)


@pytest.mark.parametrize("k,n,group_size,zeros,act_order", [(256, 192, 64, False, False),
                                                            (576, 130, 32, True, True),
                                                            (1000, 100, -1, True, False),
                                                            (512, 256, 128, False, True)])
def test_permute_columns(rng, k, n, group_size, zeros, act_order):
    w = concat_parts(rng, k, (n,), group_size, zeros=zeros, act_order=act_order)[0]
    order = rng.permutation(n)
    p = jm.permute_columns(w, order)
    assert p.shape == (k, n) and (p.zeros is None) == (not zeros)
    # Moved, not rounded again: the unpacked arrays' columns, and the same row order.
    for got, want, field in zip(jm.unpack(p), jm.unpack(w), ("q", "scales", "zeros", "g_idx")):
        want = np.asarray(want) if field == "g_idx" else np.asarray(want)[:, order]
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=field)
    if act_order:
        np.testing.assert_array_equal(np.asarray(p.perm), np.asarray(w.perm))
    x = rng.standard_normal((3, k)).astype(np.float16)
    got = jax.jit(lambda x, w: _matmul(x, w, poison_output=True))(x, p)
    # The CPU kernel computes each column alone: bit for bit the columns of the original.
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16),
                                  np.asarray(jm.matmul(x, w))[:, order].view(np.uint16))


def test_permute_columns_errors(rng):
    w = jm.quantize(random_weight(rng, 256, 128), 64)
    for order, match in [(np.arange(127), r"integers \[n\] for the weight's n = 128, got int64\[127\]"),
                         (np.arange(128.0), r"got float64\[128\]"),
                         (np.r_[0, np.arange(127)], r"not a permutation of 0 \.\. 127"),
                         (np.arange(1, 129), r"not a permutation of 0 \.\. 127")]:
        with pytest.raises(ValueError, match=match):
            jm.permute_columns(w, order)
    with pytest.raises(ValueError, match="order must be concrete"):
        jax.jit(lambda o: jm.permute_columns(w, o))(np.arange(128))
    with pytest.raises(TypeError, match="expected a jax_marlin.MarlinWeight"):
        jm.permute_columns(np.zeros((256, 128)), np.arange(128))
