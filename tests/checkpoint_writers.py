"""Writers of GPTQ, AWQ and compressed-tensors tensors, stated from the layouts alone (numpy).

Each writer takes known integer weights ``q [k, n]`` (0..15), zero points and
scales ``[groups, n]`` and the group of each row, and returns the tensors of
one layer as the format stores them. They share no code with
``jax_marlin.formats``: a reading error there cannot hide behind the same
error here. ``reference_weight`` is every format's own dequantization.
"""

from __future__ import annotations

import numpy as np

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8 c + AWQ_ORDER[i]


def groups_of_rows(k: int, group_size: int) -> np.ndarray:
    """``g_idx [k]``: group of each row, consecutive rows (no act-order)."""
    return np.arange(k) // (k if group_size == -1 else group_size)


def act_order_groups(rng, k: int, group_size: int) -> np.ndarray:
    """``g_idx`` of an act-order quantization: rows visited in a random order, grouped by visit."""
    order = rng.permutation(k)
    g_idx = np.empty(k, np.int32)
    g_idx[order] = np.arange(k) // group_size
    return g_idx


def quantize(weight: np.ndarray, g_idx: np.ndarray, *, symmetric: bool,
             scale_dtype=np.float16):
    """Round-to-nearest 4-bit quantization per group of rows: ``(q, zeros, scales)``.

    Symmetric: zero point 8, scale ``max|w| / 7``. Asymmetric: the group's
    ``[min, max]`` spread over 0..15, zero point ``round(-min / scale)``.
    ``q``: ``[k, n]`` 0..15, ``zeros``, ``scales``: ``[groups, n]``.
    """
    groups = int(g_idx.max()) + 1
    n = weight.shape[1]
    scales = np.zeros((groups, n), np.float32)
    zeros = np.full((groups, n), 8, np.int32)
    for i in range(groups):
        rows = weight[g_idx == i]
        if symmetric:
            scales[i] = np.abs(rows).max(axis=0) / 7
        else:
            lo, hi = np.minimum(rows.min(axis=0), 0), np.maximum(rows.max(axis=0), 0)
            scales[i] = (hi - lo) / 15
            zeros[i] = np.clip(np.round(-lo / scales[i]), 0, 15)
    scales = scales.astype(scale_dtype)
    s = scales.astype(np.float32)[g_idx]
    q = np.clip(np.round(weight / s) + zeros[g_idx], 0, 15).astype(np.int32)
    return q, zeros, scales


def reference_weight(q, zeros, scales, g_idx) -> np.ndarray:
    """``w[r, c] = (q[r, c] - zeros[g_idx[r], c]) * scales[g_idx[r], c]``, float64 (exact)."""
    return (q - zeros[g_idx]).astype(np.float64) * scales.astype(np.float64)[g_idx]


def _pack_rows(values: np.ndarray) -> np.ndarray:
    """Row ``8 r + j`` of ``values`` into bits ``4 j`` of row ``r`` (rows padded with 0)."""
    values = np.pad(values, ((0, -values.shape[0] % 8), (0, 0))).astype(np.uint32) & 0xF
    out = np.zeros((values.shape[0] // 8, values.shape[1]), np.uint32)
    for j in range(8):
        out |= values[j::8] << (4 * j)
    return out.view(np.int32)


def _pack_columns(values: np.ndarray, order=range(8)) -> np.ndarray:
    """Column ``8 c + order[i]`` of ``values`` into bits ``4 i`` of column ``c`` (padded with 0)."""
    values = np.pad(values, ((0, 0), (0, -values.shape[1] % 8))).astype(np.uint32) & 0xF
    out = np.zeros((values.shape[0], values.shape[1] // 8), np.uint32)
    for i, column in enumerate(order):
        out |= values[:, column::8] << (4 * i)
    return out.view(np.int32)


def gptq_tensors(q, zeros, scales, g_idx) -> dict[str, np.ndarray]:
    """GPTQ v1: qweight [k / 8, n] packed along k, qzeros [groups, n / 8] = zero - 1 along n."""
    return {"qweight": _pack_rows(q), "qzeros": _pack_columns(zeros - 1), "scales": scales,
            "g_idx": np.asarray(g_idx, np.int32)}


def awq_tensors(q, zeros, scales) -> dict[str, np.ndarray]:
    """AutoAWQ GEMM: qweight [k, n / 8] and qzeros [groups, n / 8] along n in AWQ's order."""
    return {"qweight": _pack_columns(q, AWQ_ORDER), "qzeros": _pack_columns(zeros, AWQ_ORDER),
            "scales": scales}


def compressed_tensors_tensors(q, zeros, scales, g_idx=None, *,
                               zero_point: str | None = None) -> dict[str, np.ndarray]:
    """pack-quantized: the torch layout [n, k]; stored value = signed value + 8 = q.

    ``zero_point``: ``None`` (symmetric, no tensor), ``"packed"`` (int32
    ``[n / 8, groups]``, signed + 8, along n) or ``"int8"`` (signed ``[n, groups]``).
    """
    k, n = q.shape
    out = {"weight_packed": _pack_columns(q.T), "weight_scale": np.ascontiguousarray(scales.T),
           "weight_shape": np.array([n, k], np.int64)}
    if zero_point == "packed":
        out["weight_zero_point"] = _pack_rows(zeros.T)
    elif zero_point == "int8":
        out["weight_zero_point"] = np.ascontiguousarray((zeros - 8).T.astype(np.int8))
    if g_idx is not None:
        out["weight_g_idx"] = np.asarray(g_idx, np.int32)
    return out
