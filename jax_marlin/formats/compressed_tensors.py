"""compressed-tensors checkpoints (llm-compressor), ``pack-quantized`` 4-bit, to Marlin.

The layout of one linear layer of ``n`` output and ``k`` input features
(stored like a torch ``Linear.weight``, ``[n, k]``; group ``g``,
``G = ceil(k / g)``, 1 for the ``channel`` strategy):

* ``weight_packed``: int32 ``[n, ceil(k / 8)]``, packed along k: bits
  ``4 j .. 4 j + 3`` of word ``[c, w]`` hold input feature ``8 w + j`` of output
  feature ``c``, as the signed value plus 8 (0..15).
* ``weight_scale``: ``[n, G]``, in the model's dtype (bfloat16 or float16).
* ``weight_shape``: ``[2]`` integers, ``(n, k)``.
* ``weight_zero_point`` (asymmetric schemes): the signed zero points, either
  packed like the weight but along n (int32 ``[ceil(n / 8), G]``, plus 8) or
  as they are (``[n, G]``).
* ``weight_g_idx`` (act-order): int32 ``[k]``, the group of each input feature.

The weight is ``w[c, r] = (v[c, r] - zero[c, g_idx[r]]) * scale[c, g_idx[r]]``
with ``v`` the signed values: in Marlin's terms ``q = v + 8`` with zero point
``zero + 8``, so a symmetric scheme (no zero point, or all zero) maps exactly.
"""

from __future__ import annotations

import numpy as np

from jax_marlin import MarlinWeight
from jax_marlin.formats._convert import (
    ZERO_POINT,
    check_group_size,
    check_shape,
    to_marlin,
    unpack_words,
    words,
)
from jax_marlin.shapes import num_groups

__all__ = ["from_compressed_tensors"]


def from_compressed_tensors(weight_packed, weight_scale, weight_shape, weight_zero_point=None,
                            weight_g_idx=None, *, group_size: int) -> MarlinWeight:
    """One compressed-tensors ``pack-quantized`` layer -> :class:`~jax_marlin.MarlinWeight`.

    Args:
      weight_packed: int32 ``[n, ceil(k / 8)]``.
      weight_scale: ``[n, ceil(k / group_size)]`` (``[n, 1]`` for the channel
        strategy); float16 or bfloat16 are kept.
      weight_shape: ``(n, k)``.
      weight_zero_point: ``None`` (symmetric), int32 ``[ceil(n / 8), G]`` packed
        or ``[n, G]`` signed values.
      weight_g_idx: ``[k]`` or ``None``.
      group_size: the scheme's ``group_size``; -1 for the ``channel`` strategy.

    Returns the ``[k, n]`` weight (the Flax layout, transposed from the
    checkpoint's), zero points other than 0 kept in ``w.zeros`` and
    act-order (``weight_g_idx`` other than ``input feature // group_size``)
    in ``w.perm``. Raises ``ValueError`` for shapes that do not match.
    """
    check_group_size(group_size)
    shape = np.asarray(weight_shape).reshape(-1)
    if shape.size != 2 or not np.issubdtype(shape.dtype, np.integer) or np.any(shape <= 0):
        raise ValueError(f"weight_shape = {shape.tolist()}, expected two positive integers (n, k)")
    n, k = (int(v) for v in shape)
    groups = num_groups(k, group_size)
    why = f"compressed-tensors layer of weight_shape (n, k) = ({n}, {k}), group_size = {group_size}"
    weight_packed = words("weight_packed",
                          check_shape("weight_packed", weight_packed, (n, -(-k // 8)), why))
    scales = check_shape("weight_scale", weight_scale, (n, groups), why).T
    q = unpack_words(weight_packed, axis=1)[:, :k].T
    zeros = None
    if weight_zero_point is not None:
        zeros = _zero_points(np.asarray(weight_zero_point), n, groups, why)
    g_idx = None
    if weight_g_idx is not None:
        g_idx = check_shape("weight_g_idx", weight_g_idx, (k,), why)
    return to_marlin(q, scales, group_size, zeros=zeros, g_idx=g_idx, what="compressed-tensors")


def _zero_points(zp: np.ndarray, n: int, groups: int, why: str) -> np.ndarray:
    """``weight_zero_point`` -> Marlin zero points ``[G, n]`` (the signed value plus 8)."""
    packed = (-(-n // 8), groups)
    if zp.dtype in (np.int32, np.uint32) and zp.shape == packed:
        return unpack_words(zp.view(np.int32), axis=0)[:n].T.astype(np.int32)
    if np.issubdtype(zp.dtype, np.integer) and zp.shape == (n, groups):
        return zp.T.astype(np.int32) + ZERO_POINT
    raise ValueError(f"weight_zero_point: {zp.dtype}{list(zp.shape)}, expected int32 {packed} "
                     f"(packed along n) or integers {(n, groups)} ({why})")
