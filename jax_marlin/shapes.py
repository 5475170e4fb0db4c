"""Which layers and calls the Marlin kernel can run, checked at trace time.

The C++ side (ffi/marlin_problem.h) re-checks the same rules at run time; here
they are raised as ``ValueError``/``TypeError`` naming the dimension, before
anything is compiled.
"""

from __future__ import annotations

import numpy as np

#: Group sizes the kernel takes: one fp16 scale per ``group_size`` rows of the
#: weight, or -1 for one scale per output column.
GROUP_SIZES = (-1, 128)

TILE = 16  # the kernel's 16x16 weight tiles
_MIN_THREAD_N = 64
_MAX_PAR = 16
_INT32_OFFSETS = 2**31


def num_groups(k: int, group_size: int) -> int:
    """Rows of ``scales``: ``k // group_size``, or 1 for ``group_size == -1``."""
    return 1 if group_size == -1 else k // group_size


def workspace_size(n: int) -> int:
    """int32 lock counters the CUDA kernel needs for ``n`` output columns."""
    return n // _MIN_THREAD_N * _MAX_PAR


def check_layer(k: int, n: int, group_size: int) -> None:
    """Raises ``ValueError`` unless a ``[k, n]`` weight with this group size runs.

    The kernel needs: ``k`` and ``n`` multiples of 64, one of them a multiple of
    128 (its tiles are 64x256, 128x128, 128x64 or 64x128 in (k, n)), ``k`` a
    multiple of ``group_size``, and 32-bit offsets into the packed weight.
    """
    for name, v in (("k", k), ("n", n), ("group_size", group_size)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if group_size not in GROUP_SIZES:
        raise ValueError(
            f"group_size = {group_size} is not supported; the kernel takes "
            f"group_size 128 (one scale per 128 rows of k) or -1 (one scale per column)"
        )
    if k <= 0 or n <= 0:
        raise ValueError(f"weight shape [k, n] = [{k}, {n}] must be positive")
    if k % 64:
        raise ValueError(f"k = {k} (weight.shape[0], the input features) must be a multiple of 64")
    if n % 64:
        raise ValueError(f"n = {n} (weight.shape[1], the output features) must be a multiple of 64")
    if group_size != -1 and k % group_size:
        raise ValueError(f"k = {k} must be a multiple of group_size = {group_size}")
    if k % 128 and n % 128:
        raise ValueError(
            f"k = {k} and n = {n}: one of them must be a multiple of 128 "
            f"(the kernel's tiles are 128 deep or 128 wide)"
        )
    if k * n // 8 >= _INT32_OFFSETS:
        raise ValueError(f"weight [k, n] = [{k}, {n}] is too large for the kernel's 32-bit offsets")


def check_matmul(x_shape, x_dtype, qweight_shape, qweight_dtype, scales_shape, scales_dtype,
                 *, k: int, n: int, group_size: int) -> None:
    """Checks one ``jm.matmul`` call; raises ``TypeError``/``ValueError`` naming what is off.

    Shapes: ``x [..., k] float16``, ``qweight [k // 16, 2 n] int32``,
    ``scales [num_groups(k, group_size), n] float16``.
    """
    check_layer(k, n, group_size)
    if np.dtype(x_dtype) != np.float16:
        raise TypeError(
            f"x.dtype is {np.dtype(x_dtype).name}; jm.matmul takes float16 activations "
            f"(cast with x.astype(jnp.float16))"
        )
    if np.dtype(qweight_dtype) != np.int32:
        raise TypeError(f"qweight.dtype is {np.dtype(qweight_dtype).name}, expected int32")
    if np.dtype(scales_dtype) != np.float16:
        raise TypeError(f"scales.dtype is {np.dtype(scales_dtype).name}, expected float16")
    if len(x_shape) < 1:
        raise ValueError("x must have at least one dimension, [..., k]")
    if x_shape[-1] != k:
        raise ValueError(f"x.shape[-1] = {x_shape[-1]} does not match the weight's k = {k} "
                         f"(x has shape {tuple(x_shape)}, the weight [k, n] = [{k}, {n}])")
    expected_q = (k // TILE, 2 * n)
    if tuple(qweight_shape) != expected_q:
        raise ValueError(f"qweight.shape = {tuple(qweight_shape)}, expected [k // 16, 2 n] = "
                         f"{expected_q} for k = {k}, n = {n}")
    expected_s = (num_groups(k, group_size), n)
    if tuple(scales_shape) != expected_s:
        raise ValueError(f"scales.shape = {tuple(scales_shape)}, expected {expected_s} for "
                         f"k = {k}, n = {n}, group_size = {group_size}")
    m = int(np.prod(x_shape[:-1], dtype=np.int64))
    if m * max(k, n) // 8 >= _INT32_OFFSETS:
        raise ValueError(f"m = {m} rows of x are too many for the kernel's 32-bit offsets "
                         f"at k = {k}, n = {n}; split the batch")
