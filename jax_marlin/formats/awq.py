"""AWQ checkpoints (AutoAWQ, GEMM version) to Marlin.

The layout of one ``[k, n]`` linear layer (group ``g``, ``G = ceil(k / g)``):

* ``qweight``: int32 ``[k, n / 8]``, packed along n in AWQ's order: nibble
  ``i`` (bits ``4 i .. 4 i + 3``) of word ``[r, c]`` holds column
  ``8 c + [0, 2, 4, 6, 1, 3, 5, 7][i]`` of row ``r``.
* ``qzeros``: int32 ``[G, n / 8]``, the zero points in the same order, stored
  as they are (no offset).
* ``scales``: ``[G, n]`` float16.

The weight is ``w[r, c] = (q[r, c] - zero[r // g, c]) * scales[r // g, c]``.
"""

from __future__ import annotations

from jax_marlin import MarlinWeight
from jax_marlin.formats._convert import (
    check_group_size,
    check_shape,
    to_marlin,
    unpack_words,
    words,
)
from jax_marlin.shapes import num_groups

__all__ = ["from_awq"]

#: Nibble i of an AWQ word holds column 8 c + AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def from_awq(qweight, qzeros, scales, *, group_size: int) -> MarlinWeight:
    """One AWQ (GEMM) linear layer -> :class:`~jax_marlin.MarlinWeight`.

    Args:
      qweight: int32 ``[k, n / 8]``.
      qzeros: int32 ``[ceil(k / group_size), n / 8]``.
      scales: ``[ceil(k / group_size), n]`` float16 (bfloat16 is kept as it is).
      group_size: the checkpoint's ``q_group_size`` (``group_size``).

    AWQ's zero points are asymmetric, fitted per group; they are kept in
    ``w.zeros`` (the kernels dequantize with them),
    so ``jm.dequantize(w)`` is AWQ's weight exactly. ``ValueError`` for
    shapes that do not match.
    """
    check_group_size(group_size)
    qweight = words("qweight", qweight)
    k, n = qweight.shape[0], 8 * qweight.shape[1]
    groups = num_groups(k, group_size)
    why = f"AWQ layer [k, n] = [{k}, {n}] from qweight [k, n / 8], group_size = {group_size}"
    qzeros = words("qzeros", check_shape("qzeros", qzeros, (groups, n // 8), why))
    scales = check_shape("scales", scales, (groups, n), why)
    q = unpack_words(qweight, axis=1, order=AWQ_ORDER)
    zeros = unpack_words(qzeros, axis=1, order=AWQ_ORDER)
    return to_marlin(q, scales, group_size, zeros=zeros, what="AWQ")
