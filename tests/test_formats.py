"""jax_marlin.formats importers: from_gptq, from_awq, from_compressed_tensors.

Every case quantizes a random float weight in the test, writes the format's
tensors with the independent writers of ``checkpoint_writers``, imports them,
and checks ``jm.dequantize`` against the format's own dequantization (exactly:
a 4-bit integer times a float16 scale is exact in float32) and ``jm.matmul``
against the float64 product.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jax_marlin as jm
from checkpoint_writers import (
    act_order_groups,
    awq_tensors,
    compressed_tensors_tensors,
    gptq_tensors,
    groups_of_rows,
    quantize,
    reference_weight,
)
from conftest import BF16_U, FP16_U, random_weight, random_x, rel_err
from jax_marlin.formats import from_awq, from_compressed_tensors, from_gptq

# An fp16 (bf16) output of an exact product: one rounding, plus float32 accumulation.
TOLS = {np.dtype(np.float16): FP16_U + 1e-5, np.dtype(jnp.bfloat16): BF16_U + 1e-5}
# 256: a multiple of the kernel's 128 (scales repeated); -1: per column.
GROUP_SIZES = (32, 64, 128, 256, -1)
# (k, n): aligned, and odd (a partial last group; padded for the kernel).
SHAPES = [(256, 192), (576, 72)]



def check_imported(rng, w: jm.MarlinWeight, q, zeros, scales, g_idx):
    """``w`` is exactly the format's weight, and ``jm.matmul`` multiplies by it."""
    ref = reference_weight(q, zeros, scales, g_idx)
    assert w.shape == ref.shape
    np.testing.assert_array_equal(np.asarray(jm.dequantize(w, jnp.float32), np.float64), ref)
    x = random_x(rng, 5, ref.shape[0], dtype=w.dtype)
    y = jm.matmul(x, w)
    assert y.dtype == w.dtype
    # Zero points are dequantized in the kernel: one rounding of y either way.
    assert rel_err(y, np.asarray(x, np.float64) @ ref) <= TOLS[w.dtype]


def case(rng, k, n, group_size, *, symmetric=True, act_order=False, scale_dtype=np.float16):
    g_idx = act_order_groups(rng, k, group_size) if act_order else groups_of_rows(k, group_size)
    q, zeros, scales = quantize(random_weight(rng, k, n), g_idx, symmetric=symmetric,
                                scale_dtype=scale_dtype)
    return q, zeros, scales, g_idx


# Each format written by its writer and read by its importer, from the same
# (q, zeros, scales, g_idx); ``symmetric`` is what the checkpoint declares.


def via_gptq(q, zeros, scales, g_idx, group_size, symmetric):
    t = gptq_tensors(q, zeros, scales, g_idx)
    return from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], group_size=group_size,
                     sym=symmetric)


def via_awq(q, zeros, scales, g_idx, group_size, symmetric):
    t = awq_tensors(q, zeros, scales)
    return from_awq(t["qweight"], t["qzeros"], t["scales"], group_size=group_size)


def via_compressed_tensors(q, zeros, scales, g_idx, group_size, symmetric):
    t = compressed_tensors_tensors(q, zeros, scales, g_idx,
                                   zero_point=None if symmetric else "packed")
    return from_compressed_tensors(t["weight_packed"], t["weight_scale"], t["weight_shape"],
                                   t.get("weight_zero_point"), t.get("weight_g_idx"),
                                   group_size=group_size)


# AWQ stores no g_idx and always zero points: with zero points all 8 it maps today.
FORMATS = [via_gptq, via_awq, via_compressed_tensors]
ACT_ORDER_FORMATS = [via_gptq, via_compressed_tensors]


@pytest.mark.parametrize("via", FORMATS, ids=lambda via: via.__name__)
@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_symmetric(rng, via, k, n, group_size):
    q, zeros, scales, g_idx = case(rng, k, n, group_size)
    w = via(q, zeros, scales, g_idx, group_size, True)
    check_imported(rng, w, q, zeros, scales, g_idx)


@pytest.mark.parametrize("via", FORMATS, ids=lambda via: via.__name__)
@pytest.mark.parametrize("group_size", (32, 64, 128))
def test_asymmetric(rng, via, group_size):
    q, zeros, scales, g_idx = case(rng, 256, 192, group_size, symmetric=False)
    w = via(q, zeros, scales, g_idx, group_size, False)
    assert w.zeros is not None and w.perm is None
    check_imported(rng, w, q, zeros, scales, g_idx)


@pytest.mark.parametrize("via", FORMATS, ids=lambda via: via.__name__)
@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("group_size", (256, -1))
def test_asymmetric_large_groups_and_per_column(rng, via, k, n, group_size):
    # 256: zero points repeated with the scales for kernel groups of 128; -1:
    # one zero point per column (the correction sums all of x).
    q, zeros, scales, g_idx = case(rng, k, n, group_size, symmetric=False)
    w = via(q, zeros, scales, g_idx, group_size, False)
    check_imported(rng, w, q, zeros, scales, g_idx)


@pytest.mark.parametrize("via", ACT_ORDER_FORMATS, ids=lambda via: via.__name__)
@pytest.mark.parametrize("symmetric", (True, False))
@pytest.mark.parametrize("group_size", (32, 64, 128))
def test_act_order(rng, via, symmetric, group_size):
    q, zeros, scales, g_idx = case(rng, 256, 192, group_size, symmetric=symmetric,
                                   act_order=True)
    w = via(q, zeros, scales, g_idx, group_size, symmetric)
    assert w.perm is not None
    check_imported(rng, w, q, zeros, scales, g_idx)


@pytest.mark.parametrize("k, n", SHAPES)
def test_act_order_group_256_and_odd_shapes(rng, k, n):
    q, zeros, scales, g_idx = case(rng, k, n, 256, symmetric=False, act_order=True)
    w = via_gptq(q, zeros, scales, g_idx, 256, False)
    check_imported(rng, w, q, zeros, scales, g_idx)


def test_act_order_groups_must_be_runs_of_group_size(rng):
    q, zeros, scales, g_idx = case(rng, 256, 128, 64, act_order=True)
    t = gptq_tensors(q, zeros, scales, g_idx)
    bad = g_idx.copy()
    bad[np.flatnonzero(g_idx == 0)[0]] = 1  # group 0 of 63 rows, group 1 of 65
    with pytest.raises(ValueError, match=r"GPTQ: g_idx does not put group_size = 64 rows in "
                                         r"each group .* of 63 to 65 rows"):
        from_gptq(t["qweight"], t["qzeros"], t["scales"], bad, group_size=64)


# --- GPTQ ---------------------------------------------------------------------


def test_gptq_g_idx_is_optional(rng):
    q, zeros, scales, g_idx = case(rng, 256, 128, 64)
    t = gptq_tensors(q, zeros, scales, g_idx)
    w = from_gptq(t["qweight"], t["qzeros"], t["scales"], group_size=64)
    check_imported(rng, w, q, zeros, scales, g_idx)


def test_gptq_sym_false_with_zero_points_8_is_exact(rng):
    q, zeros, scales, g_idx = case(rng, 256, 128, 128)
    w = via_gptq(q, zeros, scales, g_idx, 128, False)
    assert w.zeros is None  # no correction to pay for
    check_imported(rng, w, q, zeros, scales, g_idx)


def test_gptq_group_as_large_as_k_is_per_column(rng):
    q, zeros, scales, g_idx = case(rng, 256, 128, 256)
    t = gptq_tensors(q, zeros, scales, g_idx)
    w = from_gptq(t["qweight"], t["qzeros"], t["scales"], group_size=256)
    assert w.group_size == -1
    check_imported(rng, w, q, zeros, scales, g_idx)


def test_gptq_errors(rng):
    q, zeros, scales, g_idx = case(rng, 256, 128, 64)
    t = gptq_tensors(q, zeros, scales, g_idx)
    args = t["qweight"], t["qzeros"], t["scales"]
    with pytest.raises(ValueError, match="bits = 8"):
        from_gptq(*args, bits=8, group_size=64)
    with pytest.raises(ValueError, match=r"qzeros.shape = \(4, 16\), expected \(2, 16\)"):
        from_gptq(*args, group_size=128)
    with pytest.raises(ValueError, match=r"scales.shape = \(4, 64\), expected \(4, 128\)"):
        from_gptq(t["qweight"], t["qzeros"], t["scales"][:, :64], group_size=64)
    with pytest.raises(ValueError, match=r"g_idx.shape = \(255,\), expected \(256,\)"):
        from_gptq(*args, t["g_idx"][1:], group_size=64)
    with pytest.raises(TypeError, match="qweight.dtype is float32"):
        from_gptq(t["qweight"].astype(np.float32), t["qzeros"], t["scales"], group_size=64)
    with pytest.raises(ValueError, match="group_size = 0"):
        from_gptq(*args, group_size=0)
    # sym=True promises zero point 8 (stored 7); a checkpoint that breaks it is refused.
    t_asym = gptq_tensors(q, zeros + 1, scales, g_idx)
    with pytest.raises(ValueError, match="sym=True, but qzeros hold zero points in \\[9, 9\\]"):
        from_gptq(t_asym["qweight"], t_asym["qzeros"], t_asym["scales"], group_size=64)


def test_group_sizes_the_kernel_cannot_take(rng):
    q, zeros, scales, g_idx = case(rng, 256, 128, 16)
    t = gptq_tensors(q, zeros, scales, g_idx)
    with pytest.raises(ValueError, match="GPTQ: group_size = 16 is not supported"):
        from_gptq(t["qweight"], t["qzeros"], t["scales"], group_size=16)


# --- AWQ ----------------------------------------------------------------------


def test_awq_nibble_order(rng):
    # One value per word: nibble i of word c is column 8 c + [0, 2, 4, 6, 1, 3, 5, 7][i].
    k, n = 128, 128
    qweight = np.zeros((k, n // 8), np.uint32)
    qweight[0, 0] = 0x3 << 4  # nibble 1: column 2
    qweight[1, 1] = 0xC << 28  # nibble 7 of word 1: column 15
    qzeros = np.full((1, n // 8), 0x88888888, np.uint32)
    w = from_awq(qweight.view(np.int32), qzeros.view(np.int32), np.ones((1, n), np.float16),
                 group_size=128)
    wd = np.asarray(jm.dequantize(w, jnp.float32)) + 8
    expected = np.zeros((k, n))
    expected[0, 2], expected[1, 15] = 3, 12
    np.testing.assert_array_equal(wd, expected)


def test_awq_errors(rng):
    q, zeros, scales, _ = case(rng, 256, 128, 64, symmetric=False)
    t = awq_tensors(q, zeros, scales)
    with pytest.raises(ValueError, match=r"qzeros.shape = \(4, 16\), expected \(8, 16\)"):
        from_awq(t["qweight"], t["qzeros"], t["scales"], group_size=32)


# --- compressed-tensors ---------------------------------------------------------


@pytest.mark.parametrize("k", (579, 1001))
def test_compressed_tensors_k_not_a_multiple_of_8(rng, k):
    q, zeros, scales, g_idx = case(rng, k, 72, 64)
    w = via_compressed_tensors(q, zeros, scales, None, 64, True)
    check_imported(rng, w, q, zeros, scales, g_idx)


def test_compressed_tensors_asymmetric_int8_zero_points(rng):
    q, zeros, scales, g_idx = case(rng, 256, 192, 64, symmetric=False)
    t = compressed_tensors_tensors(q, zeros, scales, zero_point="int8")
    w = from_compressed_tensors(t["weight_packed"], t["weight_scale"], t["weight_shape"],
                                t["weight_zero_point"], group_size=64)
    check_imported(rng, w, q, zeros, scales, g_idx)


@pytest.mark.parametrize("zero_point", ("packed", "int8"))
def test_compressed_tensors_zero_points_0_and_trivial_g_idx(rng, zero_point):
    q, zeros, scales, g_idx = case(rng, 256, 128, 64)
    t = compressed_tensors_tensors(q, zeros, scales, g_idx, zero_point=zero_point)
    w = from_compressed_tensors(t["weight_packed"], t["weight_scale"], t["weight_shape"],
                                t["weight_zero_point"], t["weight_g_idx"], group_size=64)
    check_imported(rng, w, q, zeros, scales, g_idx)


def test_compressed_tensors_bf16_scales_stay_bf16(rng):
    q, zeros, scales, g_idx = case(rng, 256, 128, 128, scale_dtype=jnp.bfloat16)
    t = compressed_tensors_tensors(q, zeros, scales)
    w = from_compressed_tensors(t["weight_packed"], t["weight_scale"], t["weight_shape"],
                                group_size=128)
    assert w.dtype == jnp.bfloat16
    check_imported(rng, w, q, zeros, scales, g_idx)


def test_compressed_tensors_errors(rng):
    q, zeros, scales, _ = case(rng, 256, 128, 64, symmetric=False)
    t = compressed_tensors_tensors(q, zeros, scales, zero_point="packed")
    args = t["weight_packed"], t["weight_scale"], t["weight_shape"]
    with pytest.raises(ValueError, match=r"weight_zero_point: float32\[16, 4\], expected int32 "
                                         r"\(16, 4\) \(packed along n\) or integers \(128, 4\)"):
        from_compressed_tensors(*args, np.zeros((16, 4), np.float32), group_size=64)
    with pytest.raises(ValueError, match=r"weight_packed.shape = \(128, 32\), expected "
                                         r"\(128, 33\)"):
        from_compressed_tensors(t["weight_packed"], t["weight_scale"], [128, 257], group_size=64)
    with pytest.raises(ValueError, match=r"weight_scale.shape = \(128, 4\), expected \(128, 2\)"):
        from_compressed_tensors(*args, group_size=128)
    with pytest.raises(ValueError, match=r"weight_shape = \[128\], expected two positive"):
        from_compressed_tensors(t["weight_packed"], t["weight_scale"], [128], group_size=64)
