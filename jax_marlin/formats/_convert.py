"""What every importer shares: 4-bit words to nibbles, and natural-order values to a MarlinWeight.

Each format packs eight 4-bit values into an int32 along one axis, in its own
nibble order; :func:`unpack_words` undoes that for any of them. The importers
then bring their tensors to one natural form, ``q [k, n]`` in 0..15, scales
and zero points ``[ceil(k / group_size), n]`` and the group of each row, and
:func:`to_marlin` turns that form into a :class:`~jax_marlin.MarlinWeight`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

import jax_marlin as jm
from jax_marlin.shapes import num_groups

#: The zero point of a symmetric weight: ``(q - 8) * scale``.
ZERO_POINT = 8
#: The group sizes the kernel takes, largest first.
_KERNEL_GROUPS = tuple(sorted((g for g in jm.GROUP_SIZES if g > 0), reverse=True))


def words(name: str, a) -> np.ndarray:
    """``a`` as a 2-D int32 array of packed 4-bit values; raises naming ``name`` otherwise."""
    a = np.asarray(a)
    if a.dtype not in (np.int32, np.uint32):
        raise TypeError(f"{name}.dtype is {a.dtype}; packed 4-bit values come as int32")
    if a.ndim != 2:
        raise ValueError(f"{name} must be 2-D, got shape {a.shape}")
    return a.view(np.int32)


def check_shape(name: str, a, expected: tuple[int, ...], why: str) -> np.ndarray:
    """``np.asarray(a)``; raises ``ValueError`` naming ``name`` unless its shape is ``expected``."""
    a = np.asarray(a)
    if a.shape != expected:
        raise ValueError(f"{name}.shape = {a.shape}, expected {expected} ({why})")
    return a


def unpack_words(words: np.ndarray, axis: int, order: Sequence[int] = range(8)) -> np.ndarray:
    """int32 words ``[r, c]`` -> uint8 values in 0..15, eight per word along ``axis``.

    Nibble ``i`` of a word (bits ``4 i .. 4 i + 3``) is the value at position
    ``8 w + order[i]`` along ``axis``, ``w`` being the word's index on that
    axis: the result is ``[8 r, c]`` for ``axis=0`` and ``[r, 8 c]`` for
    ``axis=1``.
    """
    # Byte b of a little-endian word holds nibbles 2 b (low half) and 2 b + 1
    # (high half): splitting bytes keeps every temporary in uint8.
    b = words.view(np.uint32).astype("<u4", copy=False).view(np.uint8).reshape(*words.shape, 4)
    nibbles = np.stack([b & 0xF, b >> 4], axis=-1).reshape(*words.shape, 8)  # [r, c, nibble]
    if tuple(order) != tuple(range(8)):
        nibbles = nibbles[..., np.argsort(order)]  # [r, c, position in the word's run of 8]
    shape = list(words.shape)
    shape[axis] *= 8
    return np.moveaxis(nibbles, -1, axis + 1).reshape(shape)


def pack_words(values: np.ndarray, axis: int) -> np.ndarray:
    """:func:`unpack_words`' inverse, natural nibble order: values 0..15 -> int32 words.

    The value at position ``8 w + i`` along ``axis`` goes to bits ``4 i .. 4 i
    + 3`` of word ``w``: ``[8 r, c]`` gives ``[r, c]`` for ``axis=0``, ``[r, 8
    c]`` gives ``[r, c]`` for ``axis=1``.
    """
    v = np.moveaxis(np.asarray(values, np.uint32), axis, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // 8, 8)
    words = np.zeros(v.shape[:-1], np.uint32)
    for i in range(8):
        words |= v[..., i] << np.uint32(4 * i)
    return np.ascontiguousarray(np.moveaxis(words, -1, axis)).view(np.int32)


def check_group_size(group_size) -> None:
    if (not isinstance(group_size, (int, np.integer)) or isinstance(group_size, bool)
            or (group_size != -1 and group_size <= 0)):
        raise ValueError(f"group_size = {group_size!r}: expected a positive number of rows "
                         f"per scale, or -1 for one scale per column")


def to_marlin(q: np.ndarray, scales, group_size: int, *, zeros=None, g_idx=None,
              what: str) -> jm.MarlinWeight:
    """Natural-order 4-bit values -> :class:`~jax_marlin.MarlinWeight`.

    Args:
      q: ``[k, n]`` integers in 0..15.
      scales: ``[ceil(k / group_size), n]`` float16, bfloat16 (kept) or
        float32 (rounded to float16).
      group_size: rows per scale, or -1. Besides the kernel's 32, 64 and 128,
        any multiple of 32 is taken exactly by repeating each scale row (a
        group of 256 is two of 128); a group as large as ``k`` is one scale
        per column.
      zeros: ``[ceil(k / group_size), n]`` integer zero points, ``None`` for 8.
      g_idx: ``[k]`` group of each row, ``None`` for ``row // group_size``.
      what: the format, for error messages.

    The weight is ``(q - zeros[g_idx]) * scales[g_idx]`` row by row, exactly:
    zero points other than 8 are stored with the weight (the kernels
    dequantize with them), and act-order rows (``g_idx`` not ``row //
    group_size``) are stored sorted by group with their permutation.
    """
    k = q.shape[0]
    kernel_group, repeat = _kernel_groups(k, group_size, what)
    scales = _repeat_groups(np.asarray(scales), repeat, k, kernel_group)
    if zeros is not None:
        zeros = _repeat_groups(np.asarray(zeros), repeat, k, kernel_group)
    if g_idx is not None:
        g_idx = _kernel_g_idx(np.asarray(g_idx), k, group_size, kernel_group, what)
    return jm.pack(q, scales, group_size=kernel_group, zeros=zeros, g_idx=g_idx)


def _kernel_groups(k: int, group_size: int, what: str) -> tuple[int, int]:
    """``(kernel group size, kernel groups per group)``: the same groups as the kernel takes them."""
    if group_size == -1 or group_size >= k:
        return -1, 1
    for g in _KERNEL_GROUPS:
        if group_size % g == 0:
            return g, group_size // g
    raise ValueError(f"{what}: group_size = {group_size} is not supported; the kernel takes "
                     f"groups of 32, 64 or 128 rows (or multiples of them), or -1 (one scale "
                     f"per column)")


def _repeat_groups(a: np.ndarray, repeat: int, k: int, kernel_group: int) -> np.ndarray:
    """Per-group rows ``[groups, n]`` -> per kernel group: row ``r // g`` of a group of ``g r``."""
    return np.repeat(a, repeat, axis=0)[:num_groups(k, kernel_group)]


def _kernel_g_idx(g_idx: np.ndarray, k: int, group_size: int, kernel_group: int,
                  what: str) -> np.ndarray:
    """The kernel group of each row, from the format's ``g_idx`` (act-order).

    Sorted by group (stably), the format's groups must be runs of
    ``group_size`` rows; a kernel group is then a run of ``kernel_group``
    rows of that order.
    """
    if not np.issubdtype(g_idx.dtype, np.integer):
        raise TypeError(f"{what}: g_idx.dtype is {g_idx.dtype}, expected integers")
    order = np.argsort(g_idx, kind="stable")
    rows = k if group_size == -1 else group_size
    if not np.array_equal(g_idx[order], np.arange(k) // rows):
        counts = np.bincount(g_idx - g_idx.min()) if k else np.zeros(0, int)
        raise ValueError(f"{what}: g_idx does not put group_size = {group_size} rows in each "
                         f"group (groups 0, 1, ...; the last may be shorter): it holds groups "
                         f"{int(g_idx.min())}..{int(g_idx.max())} of {counts.min()} to "
                         f"{counts.max()} rows")
    kernel_g_idx = np.empty(k, np.int32)
    kernel_g_idx[order] = np.arange(k) // (k if kernel_group == -1 else kernel_group)
    return kernel_g_idx
