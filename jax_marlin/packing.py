"""Quantize, pack and unpack 4-bit weights in Marlin's layout.

Layout (bit-identical to the reference Marlin ``Layer.pack``):

* ``qweight``: int32 ``[k // 16, 2 n]``. Row ``tk`` holds weight rows
  ``16 tk .. 16 tk + 15``. The 16x16 tiles of that row band are taken four at a
  time along n (64 columns, 1024 nibbles, 128 int32 words); word ``4 lane + j``
  of such a chunk holds the 8 values that tensor-core lane ``lane`` needs from
  tile ``j`` as the B operand of ``mma.m16n8k16``, in the order
  ``[0, 2, 4, 6, 1, 3, 5, 7]`` of the fragment so that one shift-and-mask
  yields a ``half2`` pair. Nibble ``p`` of that word is the weight at tile row
  ``2 (lane % 4) + (p >= 4) + 8 (p & 1)`` and tile column
  ``lane // 4 + 8 ((p >> 1) & 1)``. Values are unsigned 0..15 with zero point 8.
* ``scales``: float16 ``[k // group_size, n]`` (``[1, n]`` for
  ``group_size == -1``), each run of 64 columns permuted so that a thread reads
  the scales of its fragment with one 16-byte load (8x8 transpose), or, per
  column, each run of 32 permuted to match the epilogue's output fragment.

Everything here is written in ``jax.numpy`` with reshapes and transposes (no
gathers, no Python loops over elements), so it is fast on large weights and
traceable: ``jax.eval_shape(quantize, w)`` allocates nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_marlin import shapes

__all__ = ["MarlinWeight", "quantize", "pack", "unpack", "dequantize"]

_ZERO_POINT = 8
_MAXQ = 15


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MarlinWeight:
    """A ``[k, n]`` weight quantized to 4 bits, packed for the Marlin kernel.

    Attributes:
      qweight: int32 ``[k // 16, 2 n]``, 8 nibbles per word in Marlin's layout.
      scales: float16 ``[k // group_size, n]`` (``[1, n]`` for ``group_size=-1``),
        in Marlin's permuted column order.
      k, n: logical weight shape (static).
      group_size: rows of k sharing one scale, or -1 for one scale per column
        (static).

    A pytree: ``qweight`` and ``scales`` are leaves, ``k``, ``n`` and
    ``group_size`` are static metadata, so a ``MarlinWeight`` passes through
    ``jax.jit``, ``jax.tree.map`` and checkpointing like an array pair.
    """

    qweight: Any
    scales: Any
    k: int = dataclasses.field(metadata=dict(static=True))
    n: int = dataclasses.field(metadata=dict(static=True))
    group_size: int = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        """The logical weight shape ``(k, n)``."""
        return (self.k, self.n)

    @property
    def nbytes(self) -> int:
        """Bytes of ``qweight`` plus ``scales``."""
        return int(np.prod(self.qweight.shape)) * 4 + int(np.prod(self.scales.shape)) * 2

    def __repr__(self) -> str:
        return (f"MarlinWeight(k={self.k}, n={self.n}, group_size={self.group_size}, "
                f"qweight={_describe(self.qweight)}, scales={_describe(self.scales)})")


def _describe(a) -> str:
    shape = getattr(a, "shape", None)
    dtype = getattr(a, "dtype", None)
    if shape is None or dtype is None:
        return repr(a)
    return f"{np.dtype(dtype).name}{list(shape)}"


def _is_concrete(a) -> bool:
    return not isinstance(a, jax.core.Tracer)


def _group_rows(k: int, group_size: int) -> int:
    return k if group_size == -1 else group_size


# --- the weight layout -------------------------------------------------------
#
# In a chunk of four 16x16 tiles (j = 0..3), nibble p = 4 a + 2 b + d of word
# 4 lane + j, lane = 4 c + r, is tile j's element at row 8 d + 2 r + a, column
# 8 b + c. So the chunk is a plain transpose of the tiles' axes
#   (j, d, r, a) x (b, c)   ->   (c, r, j, a, b, d)
# and the whole weight one reshape-transpose-reshape.


def _pack_nibbles(q: jax.Array) -> jax.Array:
    """``q [k, n]`` ints in 0..15 -> int32 ``[k // 16, 2 n]`` in Marlin's layout."""
    k, n = q.shape
    q = q.astype(jnp.uint32)
    # rows: (tk, d, r, a) = (k/16, 2, 4, 2); columns: (chunk, j, b, c) = (n/64, 4, 2, 8)
    t = q.reshape(k // 16, 2, 4, 2, n // 64, 4, 2, 8)
    #              tk      d  r  a  chunk   j  b  c
    t = t.transpose(0, 4, 7, 2, 5, 3, 6, 1)  # -> tk, chunk, c, r, j, a, b, d
    t = t.reshape(k // 16, 2 * n, 8)
    shifts = jnp.arange(8, dtype=jnp.uint32) * 4
    words = (t << shifts).sum(axis=-1, dtype=jnp.uint32)  # nibbles do not overlap: sum == or
    return jax.lax.bitcast_convert_type(words, jnp.int32)


def _unpack_nibbles(qweight: jax.Array, k: int, n: int) -> jax.Array:
    """Inverse of :func:`_pack_nibbles`: int32 ``[k // 16, 2 n]`` -> uint8 ``[k, n]``."""
    words = jax.lax.bitcast_convert_type(qweight, jnp.uint32)
    shifts = jnp.arange(8, dtype=jnp.uint32) * 4
    t = ((words[..., None] >> shifts) & 0xF).astype(jnp.uint8)
    t = t.reshape(k // 16, n // 64, 8, 4, 4, 2, 2, 2)  # tk, chunk, c, r, j, a, b, d
    t = t.transpose(0, 7, 3, 5, 1, 4, 6, 2)  # -> tk, d, r, a, chunk, j, b, c
    return t.reshape(k, n)


# --- the scale layout --------------------------------------------------------
#
# Grouped: stored position 8 i + j of each 64 columns holds logical column
# i + 8 j (an 8x8 transpose). Per column: stored position 8 i + 2 u + v of each
# 32 columns holds logical column 8 u + 2 i + v (axes (u, i, v) -> (i, u, v)).


def _permute_scales(scales: jax.Array, group_size: int) -> jax.Array:
    g, n = scales.shape
    if group_size == -1:
        return scales.reshape(g, n // 32, 4, 4, 2).transpose(0, 1, 3, 2, 4).reshape(g, n)
    return scales.reshape(g, n // 64, 8, 8).transpose(0, 1, 3, 2).reshape(g, n)


def _unpermute_scales(scales: jax.Array, group_size: int) -> jax.Array:
    # Both permutations are their own inverse (a transpose of two equal axes).
    return _permute_scales(scales, group_size)


# --- public API ----------------------------------------------------------------


def pack(q, scales, group_size: int = 128) -> MarlinWeight:
    """Packs 4-bit values and their scales into a :class:`MarlinWeight`.

    Args:
      q: ``[k, n]`` integers in 0..15 with zero point 8 (value ``q - 8``),
        in the Flax kernel layout (in_features x out_features).
      scales: ``[k // group_size, n]`` (``[1, n]`` for ``group_size=-1``), in
        natural (unpermuted) column order; stored as float16.
      group_size: 128, or -1 for one scale per column.

    The weight represented is ``(q - 8) * scales`` broadcast over each group
    of rows. Concrete inputs are range-checked; traced ``q`` must already lie
    in 0..15.
    """
    q = jnp.asarray(q)
    scales = jnp.asarray(scales)
    if q.ndim != 2:
        raise ValueError(f"q must be 2-D [k, n], got shape {q.shape}")
    k, n = q.shape
    shapes.check_layer(k, n, group_size)
    if not jnp.issubdtype(q.dtype, jnp.integer):
        raise TypeError(f"q.dtype is {q.dtype}; pack takes integers in 0..15")
    expected = (shapes.num_groups(k, group_size), n)
    if scales.shape != expected:
        raise ValueError(f"scales.shape = {scales.shape}, expected {expected} for "
                         f"[k, n] = [{k}, {n}] and group_size = {group_size}")
    if _is_concrete(q):
        lo, hi = int(q.min()), int(q.max())
        if lo < 0 or hi > _MAXQ:
            raise ValueError(f"q holds values in [{lo}, {hi}]; 4-bit values must lie in 0..15")
    return MarlinWeight(
        qweight=_pack_nibbles(q),
        scales=_permute_scales(scales.astype(jnp.float16), group_size),
        k=k, n=n, group_size=group_size,
    )


def unpack(w: MarlinWeight) -> tuple[jax.Array, jax.Array]:
    """Inverse of :func:`pack`: ``(q [k, n] int32 in 0..15, scales [groups, n] float16)``."""
    _check_weight(w)
    q = _unpack_nibbles(w.qweight, w.k, w.n).astype(jnp.int32)
    return q, _unpermute_scales(w.scales, w.group_size)


def quantize(weight, group_size: int = 128) -> MarlinWeight:
    """Round-to-nearest symmetric 4-bit quantization of a ``[k, n]`` weight.

    Each group of ``group_size`` rows (all k rows for ``group_size=-1``) of each
    column gets the float16 scale ``max|w| / 7.5``, so values map to
    ``round(w / scale) + 8`` clipped to 0..15: the largest magnitude lands on
    -8 or +7 with at most half a step of error, like everywhere else.

    Args:
      weight: ``[k, n]`` float array in the Flax kernel layout (in x out).
      group_size: 128, or -1 for one scale per column.
    """
    w = jnp.asarray(weight)
    if w.ndim != 2:
        raise ValueError(f"weight must be 2-D [k, n] (in_features, out_features), got shape {w.shape}")
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise TypeError(f"weight.dtype is {w.dtype}; quantize takes a float weight")
    k, n = w.shape
    shapes.check_layer(k, n, group_size)
    if _is_concrete(w) and not bool(jnp.isfinite(w).all()):
        raise ValueError("weight contains inf or NaN")
    g = _group_rows(k, group_size)
    w = w.astype(jnp.float32).reshape(k // g, g, n)
    absmax = jnp.max(jnp.abs(w), axis=1)
    scales = jnp.minimum(absmax / ((_MAXQ + 1) / 2 - 0.5), jnp.finfo(jnp.float16).max)
    scales = scales.astype(jnp.float16)
    s = scales.astype(jnp.float32)
    s = jnp.where(s == 0, 1.0, s)[:, None, :]  # all-zero group: any scale, q = 8
    q = jnp.clip(jnp.round(w / s) + _ZERO_POINT, 0, _MAXQ).astype(jnp.uint8).reshape(k, n)
    return MarlinWeight(
        qweight=_pack_nibbles(q),
        scales=_permute_scales(scales, group_size),
        k=k, n=n, group_size=group_size,
    )


def dequantize(w: MarlinWeight, dtype=jnp.float16) -> jax.Array:
    """The weight a :class:`MarlinWeight` represents, ``[k, n]`` in ``dtype``.

    ``(q - 8) * scale`` is exact in float32 (a 4-bit integer times a float16),
    so ``dtype=jnp.float32`` gives the exact values the kernel multiplies by.
    """
    q, scales = unpack(w)
    g = _group_rows(w.k, w.group_size)
    vals = (q.astype(jnp.float32) - _ZERO_POINT).reshape(w.k // g, g, w.n)
    return (vals * scales.astype(jnp.float32)[:, None, :]).reshape(w.k, w.n).astype(dtype)


def _check_weight(w) -> None:
    if not isinstance(w, MarlinWeight):
        raise TypeError(f"expected a jax_marlin.MarlinWeight, got {type(w).__name__}")
    shapes.check_layer(w.k, w.n, w.group_size)
    q_shape = tuple(w.qweight.shape)
    s_shape = tuple(w.scales.shape)
    if q_shape != (w.k // 16, 2 * w.n):
        raise ValueError(f"qweight.shape = {q_shape}, expected {(w.k // 16, 2 * w.n)}")
    expected_s = (shapes.num_groups(w.k, w.group_size), w.n)
    if s_shape != expected_s:
        raise ValueError(f"scales.shape = {s_shape}, expected {expected_s}")
