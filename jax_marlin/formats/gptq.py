"""GPTQ checkpoints (AutoGPTQ, GPTQModel, transformers), v1 layout, to Marlin.

The layout of one ``[k, n]`` linear layer (``k`` input features, ``n`` output
features; group ``g``, ``G = ceil(k / g)`` groups, 1 for ``g = -1``):

* ``qweight``: int32 ``[k / 8, n]``, packed along k: bits ``4 j .. 4 j + 3``
  of word ``[r, c]`` hold the weight's row ``8 r + j``, column ``c``.
* ``qzeros``: int32 ``[G, ceil(n / 8)]``, packed along n: bits ``4 j`` of word
  ``[i, c]`` hold the zero point of group ``i``, column ``8 c + j``, *minus
  one*, modulo 16 (the v1 convention: symmetric checkpoints store 7 for the
  zero point 8).
* ``scales``: ``[G, n]``, float16 as written by the quantizers.
* ``g_idx``: int32 ``[k]``, the group of each row: ``row // g`` unless the
  checkpoint was quantized with act-order (``desc_act``), which groups rows
  out of order.

The weight is ``w[r, c] = (q[r, c] - zero[g_idx[r], c]) * scales[g_idx[r], c]``.
"""

from __future__ import annotations

import numpy as np

import jax_marlin as jm
from jax_marlin import MarlinWeight
from jax_marlin.formats._convert import (
    ZERO_POINT,
    check_group_size,
    check_shape,
    pack_words,
    to_marlin,
    unpack_words,
    words,
)
from jax_marlin.shapes import num_groups

__all__ = ["from_gptq", "to_gptq"]


def from_gptq(qweight, qzeros, scales, g_idx=None, *, bits: int = 4, group_size: int,
              sym: bool = True) -> MarlinWeight:
    """One GPTQ (v1) linear layer -> :class:`~jax_marlin.MarlinWeight`.

    Args:
      qweight: int32 ``[k / 8, n]``.
      qzeros: int32 ``[ceil(k / group_size), ceil(n / 8)]``, zero points minus one.
      scales: ``[ceil(k / group_size), n]`` float16 (bfloat16 is kept as it is).
      g_idx: int32 ``[k]`` or ``None``.
      bits: the checkpoint's ``bits``; only 4 maps onto the kernel.
      group_size: the checkpoint's ``group_size`` (-1: one scale per column).
      sym: the checkpoint's ``sym``. Symmetric GPTQ's zero point is 8, the
        kernel's: its weights are taken exactly.

    Returns the ``[k, n]`` weight with ``jm.dequantize(w)`` equal to GPTQ's
    ``(q - zero) * scale``: asymmetric zero points (``sym=False``) are kept
    in ``w.zeros``, act-order (``g_idx`` other than ``row // group_size``) in
    ``w.perm``. Raises ``ValueError`` for shapes that do not match, a
    ``g_idx`` whose groups are not runs of ``group_size`` rows once sorted, or
    ``sym=True`` with zero points other than 8.
    """
    if bits != 4:
        raise ValueError(f"bits = {bits}: only 4-bit GPTQ weights map onto the Marlin kernel")
    check_group_size(group_size)
    qweight = words("qweight", qweight)
    k, n = 8 * qweight.shape[0], qweight.shape[1]
    groups = num_groups(k, group_size)
    why = f"GPTQ layer [k, n] = [{k}, {n}] from qweight [k / 8, n], group_size = {group_size}"
    qzeros = words("qzeros", check_shape("qzeros", qzeros, (groups, -(-n // 8)), why))
    scales = check_shape("scales", scales, (groups, n), why)
    if g_idx is not None:
        g_idx = check_shape("g_idx", g_idx, (k,), why)

    q = unpack_words(qweight, axis=0)
    # v1 stores zero - 1 in 4 bits; readers add 1 modulo 16 (a stored 15 is the zero point 0).
    zeros = (unpack_words(qzeros, axis=1)[:, :n].astype(np.int32) + 1) & 0xF
    if sym and np.any(zeros != ZERO_POINT):
        raise ValueError(f"sym=True, but qzeros hold zero points in [{int(zeros.min())}, "
                         f"{int(zeros.max())}] (stored minus one); symmetric GPTQ v1 stores 7 "
                         f"for the zero point {ZERO_POINT}. Pass sym=False for an asymmetric "
                         f"checkpoint")
    return to_marlin(q, scales, group_size, zeros=zeros, g_idx=g_idx, what="GPTQ")


def to_gptq(w: MarlinWeight) -> dict[str, np.ndarray]:
    """A :class:`~jax_marlin.MarlinWeight` -> one GPTQ (v1) linear layer, :func:`from_gptq`'s inverse.

    Returns ``{"qweight": int32 [k / 8, n], "qzeros": int32 [G, ceil(n / 8)],
    "scales": [G, n], "g_idx": int32 [k]}`` (module doc; ``G`` groups of
    ``w.group_size`` rows, the scales in ``w``'s dtype, zero point 8 stored
    as 7 for a symmetric weight, the columns past ``n`` of the last qzeros
    word likewise). ``from_gptq(**to_gptq(w), group_size=w.group_size,
    sym=w.zeros is None)`` gives ``w`` back with the same 4-bit values,
    scales, zero points and row order. Raises ``ValueError`` if ``k`` is not
    a multiple of 8 (qweight packs 8 rows a word).
    """
    parts = jm.unpack(w)
    q, scales = np.asarray(parts[0]), np.asarray(parts[1])
    k, n = q.shape
    if k % 8:
        raise ValueError(f"k = {k} is not a multiple of 8: GPTQ's qweight packs 8 rows of the "
                         f"[k, n] = [{k}, {n}] weight into each int32")
    if len(parts) == 4:
        zeros, g_idx = np.asarray(parts[2]), np.asarray(parts[3])
    else:
        zeros = np.full(scales.shape, ZERO_POINT)
        g_idx = np.arange(k) // (k if w.group_size == -1 else w.group_size)
    stored = np.full((zeros.shape[0], 8 * -(-n // 8)), ZERO_POINT - 1, np.uint32)
    stored[:, :n] = (zeros.astype(np.int64) - 1) % 16  # v1: zero point minus one
    return {"qweight": pack_words(q, axis=0), "qzeros": pack_words(stored, axis=1),
            "scales": scales, "g_idx": g_idx.astype(np.int32)}
