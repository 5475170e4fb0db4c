"""Quantize, pack and unpack 4-bit weights in Marlin's layout.

Layout (bit-identical to the reference Marlin ``Layer.pack``):

* ``qweight``: int32 ``[k_pad // 16, 2 n_pad]``. Row ``tk`` holds weight rows
  ``16 tk .. 16 tk + 15``. The 16x16 tiles of that row band are taken four at a
  time along n (64 columns, 1024 nibbles, 128 int32 words); word ``4 lane + j``
  of such a chunk holds the 8 values that tensor-core lane ``lane`` needs from
  tile ``j`` as the B operand of ``mma.m16n8k16``, in the order
  ``[0, 2, 4, 6, 1, 3, 5, 7]`` of the fragment so that one shift-and-mask
  yields a ``half2`` pair. Nibble ``p`` of that word is the weight at tile row
  ``2 (lane % 4) + (p >= 4) + 8 (p & 1)`` and tile column
  ``lane // 4 + 8 ((p >> 1) & 1)``. Values are unsigned 0..15 with zero point 8.
* ``scales``: float16 or bfloat16 (the dtype the matmul runs in)
  ``[k_pad // group_size, n_pad]`` (``[1, n_pad]`` for ``group_size == -1``),
  each run of 64 columns permuted so that a thread reads the scales of its
  fragment with one 16-byte load (8x8 transpose; the same for group sizes 32,
  64 and 128), or, per column, each run of 32 permuted to match the
  epilogue's output fragment.

Padding. A ``[k, n]`` weight of any shape is stored as the smallest
``[k_pad, n_pad]`` the kernel runs (``shapes.padded_shape``; the same shape
when it already runs). Padded rows and columns hold exactly zero: ``q = 8`` (the
zero point) with scale 0. A partial last group of rows gets its scale from its
real rows only. ``jm.matmul`` pads ``x`` with zeros along k and drops the
padded columns of ``y``; ``unpack`` and ``dequantize`` return the logical
``[k, n]``.

Zero points and act-order (checkpoints from other quantizers). A weight may
carry two more arrays, ``None`` when absent:

* ``zeros``: int32 ``[k_pad // group_size, n_pad // 8]`` (``[1, n_pad // 8]``
  per column), integer zero points 0..15, eight 4-bit values per word along n
  in the order the kernels read them (the grouped scales' permutation and the
  weight fragment's interleave, see "the zero-point layout" below; the same
  for every group size); padded entries hold 8. The weight is then
  ``(q - zeros) * scales``, dequantized that way inside the kernels.
* ``perm``: int32 ``[k]``, act-order. Rows are stored sorted by group
  (``perm`` = the stable argsort of the rows' groups ``g_idx``), so each group
  is a run of ``group_size`` consecutive stored rows, as the kernel needs;
  stored row ``i`` is the weight's row ``perm[i]`` and ``jm.matmul`` takes
  ``x[..., perm]``. ``unpack`` and ``dequantize`` return the original row
  order.

Everything here is written in ``jax.numpy`` with reshapes, transposes and pads
(no gathers, no Python loops over elements), so it is fast on large weights
and traceable: ``jax.eval_shape(quantize, w)`` allocates nothing. The array
work of each function is one ``jit`` (checks stay outside it), so an eager
call compiles once per shape rather than once per operation.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_marlin import shapes
from jax_marlin._compat import Tracer

__all__ = ["MarlinWeight", "concatenate", "dequantize", "pack", "permute_columns", "quantize",
           "unpack"]

_ZERO_POINT = 8
_MAXQ = 15
# A packed word of eight zero points (qweight or zeros): the same word in any
# nibble order, so padding can be written in the packed layout directly.
_PACKED_ZERO_POINTS = int(np.array(0x88888888, np.uint32).view(np.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MarlinWeight:
    """A ``[k, n]`` weight quantized to 4 bits, packed for the Marlin kernel.

    Attributes:
      qweight: int32 ``[k_pad // 16, 2 n_pad]``, 8 nibbles per word in Marlin's
        layout.
      scales: float16 or bfloat16 ``[k_pad // group_size, n_pad]`` (``[1, n_pad]``
        for ``group_size=-1``), in Marlin's permuted column order. Their dtype
        is the dtype ``jm.matmul`` takes and returns.
      k, n: logical weight shape (static); ``k_pad``, ``n_pad`` (from
        ``qweight.shape``) are the padded sizes the kernel sees, equal to
        ``k``, ``n`` for shapes the kernel runs as they are.
      group_size: rows of k sharing one scale (32, 64 or 128), or -1 for one
        scale per column (static).
      perm: ``None``, or int32 ``[k]`` for act-order weights: stored row ``i``
        is the weight's row ``perm[i]`` (module doc).
      zeros: ``None`` (zero point 8), or int32 ``[k_pad // group_size, n_pad // 8]``
        (``[1, n_pad // 8]`` for -1), zero points 0..15 packed 8 per word in
        the kernels' order (module doc).

    A pytree: ``qweight``, ``scales``, ``perm`` and ``zeros`` are leaves (an
    absent one, ``None``, is an empty subtree), ``k``, ``n`` and
    ``group_size`` are static metadata, so a ``MarlinWeight`` passes through
    ``jax.jit``, ``jax.tree.map`` and checkpointing like a group of arrays.
    """

    qweight: Any
    scales: Any
    k: int = dataclasses.field(metadata=dict(static=True))
    n: int = dataclasses.field(metadata=dict(static=True))
    group_size: int = dataclasses.field(metadata=dict(static=True))
    perm: Any = None
    zeros: Any = None

    @property
    def shape(self) -> tuple[int, int]:
        """The logical weight shape ``(k, n)``."""
        return (self.k, self.n)

    @property
    def k_pad(self) -> int:
        """Rows of the packed weight, ``16 * qweight.shape[-2]``: ``k`` padded."""
        return int(self.qweight.shape[-2]) * shapes.TILE

    @property
    def n_pad(self) -> int:
        """Columns of the packed weight, ``qweight.shape[-1] // 2``: ``n`` padded."""
        return int(self.qweight.shape[-1]) // 2

    @property
    def padded_shape(self) -> tuple[int, int]:
        """The physical shape ``(k_pad, n_pad)`` the kernel multiplies by."""
        return (self.k_pad, self.n_pad)

    @property
    def dtype(self) -> np.dtype:
        """The scales' dtype: what ``jm.matmul`` takes as ``x`` and returns."""
        return np.dtype(self.scales.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of ``qweight``, ``scales`` and, when present, ``perm`` and ``zeros``."""
        return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
                   for a in (self.qweight, self.scales, self.perm, self.zeros) if a is not None)

    def __repr__(self) -> str:
        padded = ""
        q_shape = getattr(self.qweight, "shape", None)
        if q_shape is not None and len(q_shape) >= 2 and self.padded_shape != self.shape:
            padded = f", padded to [{self.k_pad}, {self.n_pad}]"
        extra = "".join(f", {name}={_describe(a)}" for name, a in
                        (("perm", self.perm), ("zeros", self.zeros)) if a is not None)
        return (f"MarlinWeight(k={self.k}, n={self.n}, group_size={self.group_size}{padded}, "
                f"qweight={_describe(self.qweight)}, scales={_describe(self.scales)}{extra})")


def _describe(a) -> str:
    shape = getattr(a, "shape", None)
    dtype = getattr(a, "dtype", None)
    if shape is None or dtype is None:
        return repr(a)
    return f"{np.dtype(dtype).name}{list(shape)}"


def _is_concrete(a) -> bool:
    return not isinstance(a, Tracer)


def _group_rows(k: int, group_size: int) -> int:
    return k if group_size == -1 else group_size


def _scale_dtype(dtype, source_dtype) -> np.dtype:
    """``dtype`` if given, else ``source_dtype`` when it is float16/bfloat16, else float16."""
    if dtype is None:
        source_dtype = np.dtype(source_dtype)
        return source_dtype if source_dtype in shapes.DTYPES else np.dtype(np.float16)
    dtype = np.dtype(dtype)
    if dtype not in shapes.DTYPES:
        raise TypeError(f"dtype = {dtype.name}: the kernel runs in float16 or bfloat16")
    return dtype


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


# --- the zero-point layout ---------------------------------------------------
#
# A thread of the kernels reads the grouped scales of columns i + 8 jj
# (jj = 0..7) of a 64-column chunk with one 16-byte load (stored positions
# 8 i .. 8 i + 7, above); the zero points of the same columns are one int32,
# word i of the chunk's 8 (word 8 chunk + i of the row; the same for every
# group size). Its nibble p holds column i + 8 jj with
# jj = [0, 2, 4, 6, 1, 3, 5, 7][p], the weight fragment's interleave: tile t
# of the chunk (columns 16 t + i and 16 t + i + 8, jj = 2 t, 2 t + 1) finds
# its two zero points at bits 4 t and 16 + 4 t, so one shift and one mask put
# them in the two halves of a register. With column 16 t + 8 h + i of the chunk as (t, h, i), nibble
# 4 h + t of word i is the plain transpose (t, h, i) -> (i, h, t).


def _pack_zeros(zeros: jax.Array) -> jax.Array:
    """``zeros [g, n]`` ints in 0..15, natural order -> int32 ``[g, n // 8]`` (above)."""
    g, n = zeros.shape
    t = zeros.astype(jnp.uint32).reshape(g, n // 64, 4, 2, 8)  # g, chunk, t, h, i
    t = t.transpose(0, 1, 4, 3, 2).reshape(g, n // 8, 8)      # -> g, chunk, i, (h, t)
    shifts = jnp.arange(8, dtype=jnp.uint32) * 4
    words = (t << shifts).sum(axis=-1, dtype=jnp.uint32)
    return jax.lax.bitcast_convert_type(words, jnp.int32)


def _unpack_zeros(zeros: jax.Array) -> jax.Array:
    """Inverse of :func:`_pack_zeros`: int32 ``[g, n // 8]`` -> uint8 ``[g, n]``."""
    g, words = zeros.shape
    shifts = jnp.arange(8, dtype=jnp.uint32) * 4
    t = ((jax.lax.bitcast_convert_type(zeros, jnp.uint32)[..., None] >> shifts) & 0xF)
    t = t.astype(jnp.uint8).reshape(g, words // 8, 8, 2, 4)  # g, chunk, i, h, t
    return t.transpose(0, 1, 4, 3, 2).reshape(g, 8 * words)


# --- public API ----------------------------------------------------------------


def pack(q, scales, group_size: int = 128, dtype=None, *, zeros=None,
         g_idx=None) -> MarlinWeight:
    """Packs 4-bit values and their scales into a :class:`MarlinWeight`.

    Args:
      q: ``[k, n]`` integers in 0..15 with zero point 8 (value ``q - 8``),
        in the Flax kernel layout (in_features x out_features); any ``k``, ``n``.
      scales: ``[ceil(k / group_size), n]`` (``[1, n]`` for ``group_size=-1``),
        in natural (unpermuted) column order; a partial last group of rows has
        its own row.
      group_size: 32, 64, 128, or -1 for one scale per column.
      dtype: float16 or bfloat16, the dtype of the stored scales and of the
        matmul; ``None`` keeps ``scales.dtype`` if it is one of them, else
        float16.
      zeros: optional integer zero points 0..15, the shape of ``scales``;
        ``None`` (or all 8) is the kernel's zero point 8.
      g_idx: optional ``[k]`` integers, the group of each row (act-order).
        Sorted (stably), the groups must be runs of ``group_size`` rows:
        ``g_idx[perm] == arange(k) // group_size``. ``None`` (or that order
        already) is ``row // group_size``. Must be concrete.

    The weight represented is ``(q - zeros) * scales`` (zero point 8 without
    ``zeros``) with the scale and zero point of each row's group, padded with
    zeros to ``shapes.padded_shape(k, n, group_size)``. Concrete inputs are
    range-checked; traced ``q`` and ``zeros`` must already lie in 0..15.
    """
    q = jnp.asarray(q)
    scales = jnp.asarray(scales)
    if q.ndim != 2:
        raise ValueError(f"q must be 2-D [k, n], got shape {q.shape}")
    k, n = q.shape
    k_pad, n_pad = shapes.padded_shape(k, n, group_size)
    if not jnp.issubdtype(q.dtype, jnp.integer):
        raise TypeError(f"q.dtype is {q.dtype}; pack takes integers in 0..15")
    expected = (shapes.num_groups(k, group_size), n)
    if scales.shape != expected:
        raise ValueError(f"scales.shape = {scales.shape}, expected {expected} for "
                         f"[k, n] = [{k}, {n}] and group_size = {group_size}")
    dtype = _scale_dtype(dtype, scales.dtype)
    _check_nibbles("q", q)
    if zeros is not None:
        zeros = jnp.asarray(zeros)
        if zeros.shape != expected or not jnp.issubdtype(zeros.dtype, jnp.integer):
            raise ValueError(f"zeros: {zeros.dtype}{list(zeros.shape)}, expected integers of "
                             f"the scales' shape {expected}")
        _check_nibbles("zeros", zeros)
        if _is_concrete(zeros) and bool((zeros == _ZERO_POINT).all()):
            zeros = None  # zero point 8: the symmetric kernels
    perm = None if g_idx is None else _act_order(g_idx, k, group_size)
    if perm is not None:
        q = q[perm]
    qweight, scales = _pack(q, scales, k_pad, n_pad, group_size, dtype)
    if zeros is not None:
        zeros = _pad_zeros(zeros, k_pad, n_pad, group_size)
    return MarlinWeight(qweight, scales, k=k, n=n, group_size=group_size, perm=perm,
                        zeros=zeros)


def _check_nibbles(name: str, a) -> None:
    if _is_concrete(a) and a.size:
        lo, hi = int(a.min()), int(a.max())
        if lo < 0 or hi > _MAXQ:
            raise ValueError(f"{name} holds values in [{lo}, {hi}]; 4-bit values must lie "
                             f"in 0..15")


def _act_order(g_idx, k: int, group_size: int):
    """int32 ``perm [k]`` sorting the rows by group, or ``None`` if they are in order."""
    if not _is_concrete(g_idx):
        raise ValueError("g_idx must be concrete (a numpy or jax array outside jit): the "
                         "row order it gives decides the packed layout")
    g_idx = np.asarray(g_idx)
    if g_idx.shape != (k,) or not np.issubdtype(g_idx.dtype, np.integer):
        raise ValueError(f"g_idx: {g_idx.dtype}{list(g_idx.shape)}, expected integers [{k}], "
                         f"the group of each row")
    perm = np.argsort(g_idx, kind="stable").astype(np.int32)
    in_groups = np.arange(k) // _group_rows(k, group_size)
    if not np.array_equal(g_idx[perm], in_groups):
        sizes = np.bincount(g_idx.clip(0), minlength=int(in_groups[-1]) + 1) if k else []
        raise ValueError(
            f"g_idx does not group the rows in runs of group_size = {group_size}: sorted, "
            f"the groups must be 0, 1, ... with {_group_rows(k, group_size)} rows each (the "
            f"last may be shorter); g_idx holds values in [{int(g_idx.min())}, "
            f"{int(g_idx.max())}] with group sizes {sorted(set(int(c) for c in sizes))}")
    if np.array_equal(perm, np.arange(k)):
        return None
    return jnp.asarray(perm)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _pad_zeros(zeros, k_pad, n_pad, group_size):
    groups_pad = shapes.num_groups(k_pad, group_size)
    zeros = jnp.pad(zeros.astype(jnp.uint8), ((0, groups_pad - zeros.shape[0]),
                                              (0, n_pad - zeros.shape[1])),
                    constant_values=_ZERO_POINT)
    return _pack_zeros(zeros)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _pack(q, scales, k_pad, n_pad, group_size, dtype):
    k, n = q.shape
    q = jnp.pad(q.astype(jnp.uint8), ((0, k_pad - k), (0, n_pad - n)),
                constant_values=_ZERO_POINT)
    groups_pad = shapes.num_groups(k_pad, group_size)
    scales = jnp.pad(scales.astype(dtype), ((0, groups_pad - scales.shape[0]), (0, n_pad - n)))
    return _pack_nibbles(q), _permute_scales(scales, group_size)


def _unpack_padded(qweight, scales, group_size):
    """``(q [k_pad, n_pad] uint8, scales [k_pad // g, n_pad])`` in natural order."""
    k_pad, n_pad = qweight.shape[0] * shapes.TILE, qweight.shape[1] // 2
    return _unpack_nibbles(qweight, k_pad, n_pad), _unpermute_scales(scales, group_size)


def unpack(w: MarlinWeight):
    """Inverse of :func:`pack`, on the logical shape and in the original row order.

    Returns ``(q [k, n] int32 in 0..15, scales [ceil(k / group_size), n])``
    (``[1, n]`` for -1), the scales in their stored dtype and natural order.
    A weight with zero points or act-order (``w.zeros`` or ``w.perm`` set)
    gives ``(q, scales, zeros, g_idx)``: ``zeros`` int32 like ``scales`` (8
    where the weight has none), ``g_idx`` int32 ``[k]``, the group of each
    row, so that ``pack(q, scales, group_size, zeros=zeros, g_idx=g_idx)``
    packs it again.
    """
    _check_weight(w)
    q, scales, zeros, g_idx = _unpack(w.qweight, w.scales, w.perm, w.zeros, w.k, w.n,
                                      w.group_size)
    if w.perm is None and w.zeros is None:
        return q, scales
    return q, scales, zeros, g_idx


@functools.partial(jax.jit, static_argnums=(4, 5, 6))
def _unpack(qweight, scales, perm, zeros, k, n, group_size):
    q, scales = _unpack_padded(qweight, scales, group_size)
    groups = shapes.num_groups(k, group_size)
    q, scales = q[:k, :n].astype(jnp.int32), scales[:groups, :n]
    g_idx = jnp.arange(k, dtype=jnp.int32) // _group_rows(k, group_size)
    if perm is not None:  # stored row i is row perm[i]
        q = jnp.zeros_like(q).at[perm].set(q)
        g_idx = jnp.zeros_like(g_idx).at[perm].set(g_idx)
    zeros = (jnp.full((groups, n), _ZERO_POINT, jnp.int32) if zeros is None
             else _unpack_zeros(zeros)[:groups, :n].astype(jnp.int32))
    return q, scales, zeros, g_idx


def quantize(weight, group_size: int = 128, dtype=None) -> MarlinWeight:
    """Round-to-nearest symmetric 4-bit quantization of a ``[k, n]`` weight.

    Each group of ``group_size`` rows (all k rows for ``group_size=-1``) of each
    column gets the scale ``max|w| / 7.5``, so values map to
    ``round(w / scale) + 8`` clipped to 0..15: the largest magnitude lands on
    -8 or +7 with at most half a step of error, like everywhere else.

    Any ``k``, ``n``: the weight is padded with zeros to
    ``shapes.padded_shape(k, n, group_size)`` (unchanged when the kernel runs
    it as it is). Zeros never raise a group's ``max|w|``, so a partial last
    group's scale comes from its real rows only; an all-zero group gets scale
    0 and ``q = 8``.

    Args:
      weight: ``[k, n]`` float array in the Flax kernel layout (in x out).
      group_size: 32, 64, 128, or -1 for one scale per column.
      dtype: float16 or bfloat16: the dtype of the scales, and so of the
        activations ``jm.matmul`` takes and returns. ``None``: ``weight.dtype``
        if it is one of these, else float16.
    """
    w = jnp.asarray(weight)
    if w.ndim != 2:
        raise ValueError(f"weight must be 2-D [k, n] (in_features, out_features), got shape {w.shape}")
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise TypeError(f"weight.dtype is {w.dtype}; quantize takes a float weight")
    k, n = w.shape
    k_pad, n_pad = shapes.padded_shape(k, n, group_size)
    dtype = _scale_dtype(dtype, w.dtype)
    if _is_concrete(w) and not bool(jnp.isfinite(w).all()):
        raise ValueError("weight contains inf or NaN")
    qweight, scales, range_ = _quantize(w, k_pad, n_pad, group_size, dtype)
    if _is_concrete(w):
        _check_scale_range(*(float(v) for v in range_), dtype=dtype, group_size=group_size)
    return MarlinWeight(qweight, scales, k=k, n=n, group_size=group_size)


# Largest magnitude a group maps to: q - 8 in -8..7, the scale max|w| / 7.5.
_STEPS = (_MAXQ + 1) / 2 - 0.5


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _quantize(w, k_pad, n_pad, group_size, dtype):
    """Packed ``(qweight, scales)`` and the range of the groups' ``max|w|``:
    ``(largest, smallest nonzero, groups whose nonzero scale rounds to 0)``."""
    k, n = w.shape
    g = _group_rows(k_pad, group_size)
    w = jnp.pad(w.astype(jnp.float32), ((0, k_pad - k), (0, n_pad - n)))
    w = w.reshape(k_pad // g, g, n_pad)
    absmax = jnp.max(jnp.abs(w), axis=1)
    scales = jnp.minimum(absmax / _STEPS, jnp.finfo(dtype).max).astype(dtype)
    s = scales.astype(jnp.float32)
    s = jnp.where(s == 0, 1.0, s)[:, None, :]  # all-zero group: any scale, q = 8
    q = jnp.clip(jnp.round(w / s) + _ZERO_POINT, 0, _MAXQ).astype(jnp.uint8)
    nonzero = absmax > 0
    range_ = (jnp.max(absmax), jnp.min(jnp.where(nonzero, absmax, jnp.inf)),
              jnp.sum(nonzero & (scales == 0)))
    return _pack_nibbles(q.reshape(k_pad, n_pad)), _permute_scales(scales, group_size), range_


def _check_scale_range(largest: float, smallest: float, zeroed: float, *, dtype,
                       group_size: int) -> None:
    """Raises (or warns) where the scales' dtype cannot hold a group's scale ``max|w| / 7.5``.

    Too large a scale is clipped to the dtype's maximum, and the group's large
    weights with it: the results are wrong, so that raises. A nonzero group
    whose scale rounds to 0 becomes all zeros: raises when that is every
    nonzero group (the layer would multiply to zero), warns when it is some.
    """
    info = jnp.finfo(dtype)  # numpy 2.5 refuses bfloat16 in np.finfo
    where = (f"the weight's groups (group_size = {group_size}) have max|w| from "
             f"{smallest:.3g} to {largest:.3g}")
    fix = ("quantize with dtype=jnp.bfloat16 (float32's range), or rescale the weight")
    if largest / _STEPS > float(info.max):
        raise ValueError(f"{where}: a scale max|w| / 7.5 above {float(info.max):.6g} overflows "
                         f"{info.dtype.name} (max|w| up to {_STEPS * float(info.max):.4g} fits); "
                         f"{fix}")
    if zeroed and smallest / _STEPS < float(info.smallest_subnormal):
        fits = f"max|w| >= {_STEPS * float(info.smallest_subnormal):.3g}"
        if largest / _STEPS < float(info.smallest_subnormal):
            raise ValueError(f"{where}: every scale max|w| / 7.5 underflows to 0 in "
                             f"{info.dtype.name} ({fits} needed), so the layer would "
                             f"multiply to zero; {fix}")
        warnings.warn(f"jm.quantize: {int(zeroed)} groups of {where} have scales that underflow "
                      f"to 0 in {info.dtype.name} ({fits} needed) and are stored as zeros; "
                      f"{fix}", stacklevel=3)


def dequantize(w: MarlinWeight, dtype=None) -> jax.Array:
    """The weight a :class:`MarlinWeight` represents, ``[k, n]`` (logical) in ``dtype``.

    ``(q - zero) * scale`` row by row, in the original row order (act-order
    undone) and with the weight's zero points (8 without). ``dtype=None``
    gives the scales' dtype. The product is exact in float32 (an integer in
    -15..15 times a float16 or bfloat16), so ``dtype=jnp.float32`` gives the
    exact values ``jm.matmul`` multiplies by.
    """
    _check_weight(w)
    dtype = w.dtype if dtype is None else np.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        # An integer dtype would truncate (q - zero) * scale without a word.
        raise TypeError(f"dequantize: dtype = {dtype}; the weight's values are fractions, "
                        "dequantize to a float dtype (float16, bfloat16, float32)")
    return _dequantize(w.qweight, w.scales, w.perm, w.zeros, w.k, w.n, w.group_size, dtype)


@functools.partial(jax.jit, static_argnums=(4, 5, 6, 7))
def _dequantize(qweight, scales, perm, zeros, k, n, group_size, dtype):
    q, scales = _unpack_padded(qweight, scales, group_size)
    k_pad, n_pad = q.shape
    g = _group_rows(k_pad, group_size)
    zero = _ZERO_POINT if zeros is None else _unpack_zeros(zeros).astype(jnp.float32)[:, None, :]
    vals = q.astype(jnp.float32).reshape(k_pad // g, g, n_pad) - zero
    full = (vals * scales.astype(jnp.float32)[:, None, :]).reshape(k_pad, n_pad)[:k, :n]
    if perm is not None:  # stored row i is row perm[i]
        full = jnp.zeros_like(full).at[perm].set(full)
    return full.astype(dtype)


def concatenate(weights) -> MarlinWeight:
    """Joins ``[k, n_i]`` weights along n into one ``[k, sum n_i]`` weight, exactly.

    ``jm.matmul(x, concatenate([w1, w2]))`` equals
    ``jnp.concatenate([jm.matmul(x, w1), jm.matmul(x, w2)], axis=-1)``: one
    kernel call in place of several that share ``x`` (the q, k and v
    projections of attention, say). The stored 4-bit values, scales and zero
    points are moved, never rounded again, so the result is what
    :func:`pack` gives for the parts' unpacked arrays side by side, stored
    as ``padded_shape(k, sum n_i, group_size)``.

    Args:
      weights: a sequence of :class:`MarlinWeight`, ``[k, n_i]`` each, with
        the same ``k``, ``group_size`` and scale ``dtype``, equal act-order
        ``perm`` (the same row order: all ``None`` or equal arrays, which
        must be concrete), and zero points on all or none.

    Returns:
      A :class:`MarlinWeight` ``[k, sum n_i]``.

    The packed layout keeps each run of 64 columns to itself (the weight's
    tiles, the scales' and zero points' permutations), so where every part
    but the last has ``n_i`` a multiple of 64 the packed arrays are cut to
    their columns and joined as they are (rows of k padding cut or added,
    which hold zeros); otherwise the parts are unpacked, joined and packed
    again.
    """
    weights = list(weights)
    if not weights:
        raise ValueError("concatenate needs at least one MarlinWeight")
    for w in weights:
        _check_weight(w)
    first = weights[0]
    for field in ("k", "group_size", "dtype"):
        values = [getattr(w, field) for w in weights]
        if any(v != values[0] for v in values):
            raise ValueError(f"concatenate: the weights' {field} differ ({_listing(values)}); "
                             f"weights joined along n share k, group_size and dtype")
    has_zeros = [w.zeros is not None for w in weights]
    if any(has_zeros) and not all(has_zeros):
        raise ValueError(f"concatenate: zeros (zero points) on some weights but not all "
                         f"(present: {_listing(has_zeros)}); join all asymmetric or all "
                         f"symmetric weights")
    perms = [w.perm for w in weights]
    if any(p is not None for p in perms):
        if any(p is None or not _is_concrete(p) for p in perms):
            raise ValueError(f"concatenate: perm (act-order) is set on some weights but not all, "
                             f"or is traced ({_listing([_describe(p) for p in perms])}); the "
                             f"joined weight needs one row order, concrete to compare")
        if any(not np.array_equal(np.asarray(p), np.asarray(perms[0])) for p in perms):
            raise ValueError("concatenate: the weights' perm (act-order row orders) differ; "
                             "one weight stores its rows in one order, so only weights with "
                             "equal perm join")
    n = sum(w.n for w in weights)
    k_pad, n_pad = shapes.padded_shape(first.k, n, first.group_size)
    chunk = shapes.MIN_THREAD_N
    repack = any(w.n % chunk for w in weights[:-1])
    widths = tuple(w.n for w in weights[:-1]) + (
        weights[-1].n if repack else -(-weights[-1].n // chunk) * chunk,)
    zeros = tuple(w.zeros for w in weights) if all(has_zeros) else None
    qweight, scales, zeros = _concatenate(tuple(w.qweight for w in weights),
                                          tuple(w.scales for w in weights), zeros, widths,
                                          k_pad, n_pad, first.group_size, repack)
    return MarlinWeight(qweight, scales, k=first.k, n=n, group_size=first.group_size,
                        perm=first.perm, zeros=zeros)


def permute_columns(w: MarlinWeight, order) -> MarlinWeight:
    """The weight whose column ``j`` is ``w``'s column ``order[j]``, exactly.

    ``jm.matmul(x, permute_columns(w, order))`` computes ``jm.matmul(x, w)[..., order]``:
    the stored 4-bit values, scales and zero points are moved, never rounded
    again, and the row order (act-order ``perm``) is kept. A model uses it to
    hand the next layer its input already in that layer's act-order
    (``jax_marlin.models.fuse_projections`` does so for an MLP's gate and up
    projections and its down projection).

    Args:
      w: a :class:`MarlinWeight` ``[k, n]``.
      order: a concrete permutation of ``0 .. n - 1``, ``[n]`` integers.

    Returns:
      A :class:`MarlinWeight` ``[k, n]``.
    """
    _check_weight(w)
    if isinstance(order, Tracer):
        raise ValueError("permute_columns: order must be concrete (a numpy array or an "
                         "array outside jit): it is checked to be a permutation")
    order = np.asarray(order)
    if order.shape != (w.n,) or not np.issubdtype(order.dtype, np.integer):
        raise ValueError(f"permute_columns: order must be integers [n] for the weight's "
                         f"n = {w.n}, got {_describe(order)}")
    if not np.array_equal(np.sort(order), np.arange(w.n)):
        raise ValueError(f"permute_columns: order is not a permutation of 0 .. {w.n - 1} "
                         f"(an index repeated or out of range)")
    q, scales, *rest = unpack(w)
    zeros, g_idx = rest if rest else (None, None)
    return pack(q[:, order], scales[:, order], w.group_size, w.dtype,
                zeros=None if w.zeros is None else zeros[:, order],
                g_idx=None if w.perm is None else g_idx)


def _listing(values) -> str:
    return ", ".join(f"[{i}] {v}" for i, v in enumerate(values))


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6, 7))
def _concatenate(qweights, scales, zeros, widths, k_pad, n_pad, group_size, repack):
    """Packed ``(qweight, scales, zeros)`` of columns ``:widths[i]`` of each part, side by side.

    ``repack``: through the natural order (unpacked arrays), for widths that
    are not whole 64-column chunks; else on the packed arrays, whose column
    counts are 2 words (qweight) and 1/8 word (zeros) per column.
    """
    groups = shapes.num_groups(k_pad, group_size)
    if repack:
        qweights = [_unpack_nibbles(q, q.shape[0] * shapes.TILE, q.shape[1] // 2)
                    for q in qweights]
        scales = [_unpermute_scales(s, group_size) for s in scales]
        if zeros is not None:
            zeros = [_unpack_zeros(z) for z in zeros]
        q_rows, q_per_column, z_per_column, fill = k_pad, 1, 1, _ZERO_POINT
    else:
        q_rows, q_per_column, z_per_column, fill = (k_pad // shapes.TILE, 2, 1 / 8,
                                                    _PACKED_ZERO_POINTS)

    def join(parts, rows, per_column, value):
        cols = [int(w * per_column) for w in widths]
        joined = jnp.concatenate([_fit(a, rows, c, value) for a, c in zip(parts, cols)], axis=1)
        return _fit(joined, rows, int(n_pad * per_column), value)

    qweight = join(qweights, q_rows, q_per_column, fill)
    scales = join(scales, groups, 1, 0)
    if zeros is not None:
        zeros = join(zeros, groups, z_per_column, fill)
    if repack:
        qweight, scales = _pack_nibbles(qweight), _permute_scales(scales, group_size)
        if zeros is not None:
            zeros = _pack_zeros(zeros)
    return qweight, scales, zeros


def _fit(a, rows: int, cols: int, value):
    """``a [r, c]`` cut or padded with ``value`` to ``[rows, cols]``.

    Only padding is ever cut: rows beyond the weight's k (which ``x``'s zero
    padding multiplies) and columns beyond a part's n.
    """
    a = a[:rows, :cols]
    return jnp.pad(a, ((0, rows - a.shape[0]), (0, cols - a.shape[1])), constant_values=value)


def _check_weight(w) -> None:
    """Raises unless ``w`` is a consistent :class:`MarlinWeight` the kernel runs."""
    if not isinstance(w, MarlinWeight):
        raise TypeError(f"expected a jax_marlin.MarlinWeight, got {type(w).__name__}")
    # Valid logical sizes and group size; the padding quantize and pack give.
    padded = shapes.padded_shape(w.k, w.n, w.group_size)
    q_shape = tuple(w.qweight.shape)
    s_shape = tuple(w.scales.shape)
    if len(q_shape) != 2 or q_shape[1] % 2:
        raise ValueError(f"qweight.shape = {q_shape}, expected [k_pad // 16, 2 n_pad]")
    if w.k_pad < w.k or w.n_pad < w.n:
        raise ValueError(f"qweight.shape = {q_shape} packs [k_pad, n_pad] = "
                         f"[{w.k_pad}, {w.n_pad}], smaller than the weight's "
                         f"[k, n] = [{w.k}, {w.n}]")
    if w.padded_shape != padded:  # padded some other way: must still run as it is
        shapes.check_layer(w.k_pad, w.n_pad, w.group_size)
    expected_s = (shapes.num_groups(w.k_pad, w.group_size), w.n_pad)
    if s_shape != expected_s:
        raise ValueError(f"scales.shape = {s_shape}, expected {expected_s} for "
                         f"[k_pad, n_pad] = [{w.k_pad}, {w.n_pad}], group_size = {w.group_size}")
    expected_z = (expected_s[0], w.n_pad // 8)
    if w.zeros is not None and (tuple(w.zeros.shape) != expected_z
                                or np.dtype(w.zeros.dtype) != np.int32):
        raise ValueError(f"zeros: {_describe(w.zeros)}, expected int32{list(expected_z)} "
                         f"(the scales' rows, 8 zero points per word along n_pad = "
                         f"{w.n_pad})")
    if w.perm is not None and (tuple(w.perm.shape) != (w.k,)
                               or np.dtype(w.perm.dtype) != np.int32):
        raise ValueError(f"perm: {_describe(w.perm)}, expected int32[{w.k}] (one stored row "
                         f"per row of k = {w.k})")
