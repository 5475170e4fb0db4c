"""Which layers and calls the Marlin kernel can run, checked at trace time.

The kernel's rules (tile sizes, group sizes, padding, scratch sizes) are
stated once, in C++ (ffi/marlin_problem.h), and read here from the compiled
module; the FFI handlers re-check the same rules at run time. This module
adds what is about Python: argument types, dtypes, and errors raised as
``ValueError``/``TypeError`` naming the argument, before anything is
compiled.

Two sizes per weight dimension: the *logical* ``k``, ``n`` of the user's
``[k, n]`` weight, and the *physical* (padded) ``k_pad``, ``n_pad`` the kernel
sees (:func:`padded_shape`). They are equal for shapes the kernel runs as they
are.
"""

from __future__ import annotations

import numpy as np

from jax_marlin._ffi import rules

#: Group sizes the kernel takes: one scale per ``group_size`` rows of the
#: weight, or -1 for one scale per output column.
GROUP_SIZES: tuple[int, ...] = tuple(rules.GROUP_SIZES)

#: Activation dtypes the kernel takes; scales, bias and the result share it.
DTYPES = (np.dtype("float16"), np.dtype("bfloat16"))

#: The kernel's 16x16 weight tiles: weight rows per packed ``qweight`` row.
TILE: int = rules.TILE
#: The shallowest k tile and the narrowest n tile (64 columns: one chunk of
#: the packed layout).
MIN_THREAD_K: int = rules.MIN_THREAD_K
MIN_THREAD_N: int = rules.MIN_THREAD_N
#: Largest m (rows of x) of the CUDA decode kernel, which runs the fusions of
#: ``jm.matmul`` as it loads x and stores y.
DECODE_MAX_M: int = rules.DECODE_MAX_M


def num_groups(k: int, group_size: int) -> int:
    """Rows of ``scales`` for ``k`` rows: ``ceil(k / group_size)``, or 1 for -1.

    For a physical ``k`` (a multiple of the group) this is ``k // group_size``;
    for a logical one a partial last group has its own row.
    """
    return 1 if group_size == -1 else -(-k // group_size)


def workspace_size(m: int, n: int) -> int:
    """int32 counters a CUDA call needs for an ``[m, n]`` output (whichever kernel runs it)."""
    return rules.workspace_size(m, n)


def reduce_scratch_size(m: int, n: int, k: int, x_copy: bool = False) -> int:
    """float32 a CUDA call needs for ``[m, k] x [k, n]``: the partial sums handed between
    thread blocks, and with ``x_copy`` (an act-order weight, or an RMSNorm or SwiGLU
    prologue) room for the ``[m, k]`` x the kernels multiply."""
    return rules.reduce_scratch_size(m, n, k, x_copy)


def _check_ints(**values) -> None:
    for name, v in values.items():
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")


def check_group_size(group_size: int) -> None:
    """Raises ``ValueError`` unless ``group_size`` is one of :data:`GROUP_SIZES`."""
    _check_ints(group_size=group_size)
    if group_size not in GROUP_SIZES:
        raise ValueError(rules.check_group_size(int(group_size)))


def padded_shape(k: int, n: int, group_size: int) -> tuple[int, int]:
    """The smallest ``(k_pad, n_pad) >= (k, n)`` the kernel runs with this group size.

    ``k_pad`` is a multiple of 64 and of ``group_size``, ``n_pad`` a multiple of
    64, and one of them a multiple of 128; when neither is, the one whose
    rounding up adds fewer weight elements is rounded up (``n`` on a tie,
    which keeps ``x`` as it is). A shape the kernel runs as it is comes back
    unchanged, so aligned layers pay nothing.

    Raises ``ValueError`` for a group size the kernel does not take, sizes
    that are not positive, or a padded weight too large for the kernel's
    32-bit offsets.
    """
    _check_ints(k=k, n=n, group_size=group_size)
    k_pad, n_pad, error = rules.padded_shape(int(k), int(n), int(group_size))
    if error:
        raise ValueError(error)
    return k_pad, n_pad


def check_layer(k: int, n: int, group_size: int) -> None:
    """Raises ``ValueError`` unless the kernel runs a ``[k, n]`` weight as it is.

    ``k``, ``n`` are physical sizes (see :func:`padded_shape` for any other
    shape). The kernel needs: ``k`` and ``n`` multiples of 64, one of them a
    multiple of 128 (its tiles are 128 deep or 128 wide), ``k`` a multiple of
    ``group_size``, and 32-bit offsets into the packed weight.
    """
    _check_ints(k=k, n=n, group_size=group_size)
    error = rules.check_layer(int(k), int(n), int(group_size))
    if error:
        raise ValueError(error)


def check_dtypes(x_dtype, scales_dtype, bias_dtype=None) -> np.dtype:
    """Checks the activation, scale and bias dtypes of one call; returns the common one.

    ``x`` must be float16 or bfloat16, the dtype of the weight's scales, and
    of the bias when there is one. Raises ``TypeError`` naming both dtypes.
    """
    x_dtype, scales_dtype = np.dtype(x_dtype), np.dtype(scales_dtype)
    if scales_dtype not in DTYPES:
        raise TypeError(f"scales.dtype is {scales_dtype.name}, expected float16 or bfloat16")
    if x_dtype != scales_dtype:
        how = ("" if x_dtype not in DTYPES else
               f", or quantize the weight with dtype=jnp.{x_dtype.name}")
        raise TypeError(
            f"x.dtype is {x_dtype.name} but the weight's scales are {scales_dtype.name}; "
            f"jm.matmul runs in the weight's dtype: cast x with "
            f"x.astype(jnp.{scales_dtype.name}){how}"
        )
    if bias_dtype is not None and np.dtype(bias_dtype) != x_dtype:
        raise TypeError(f"bias.dtype is {np.dtype(bias_dtype).name} but x.dtype is "
                        f"{x_dtype.name}; the bias must have x's dtype")
    return x_dtype


def check_fusion_dtypes(x_dtype, **operands) -> None:
    """Raises ``TypeError`` unless each named dtype (``residual=...``, ``None`` for an absent
    operand) is ``x``'s: the fused operands are read and written in the call's dtype."""
    x_dtype = np.dtype(x_dtype)
    for name, dtype in operands.items():
        if dtype is not None and np.dtype(dtype) != x_dtype:
            raise TypeError(f"{name}.dtype is {np.dtype(dtype).name} but x.dtype is "
                            f"{x_dtype.name}; {name} must have x's dtype")


def x_columns(k: int, swiglu: bool) -> int:
    """Columns of ``x`` for a weight of ``k`` rows: ``k``, or ``2 k`` (``[gate | up]``) with
    the SwiGLU prologue."""
    return 2 * k if swiglu else k


def check_operands(x_shape, x_dtype, qweight_shape, qweight_dtype, scales_shape, scales_dtype,
                   zeros_shape, zeros_dtype, perm_shape, perm_dtype, bias_shape, bias_dtype, *,
                   k: int, n: int, group_size: int, residual_shape=(0,), residual_dtype=None,
                   norm_weight_shape=(0,), norm_weight_dtype=None, swiglu: bool = False,
                   norm_eps: float = 0.0, norm_size: int = 0) -> None:
    """Checks one kernel call on physical sizes; raises ``TypeError``/``ValueError``.

    Shapes: ``x [..., k]`` float16 or bfloat16 (``[..., 2 k]``, ``[gate | up]``,
    with ``swiglu``), ``qweight [k // 16, 2 n] int32``, ``scales [k //
    group_size, n]`` (``[1, n]`` for -1) and ``bias [n]`` or ``[0]`` (no bias),
    both in ``x``'s dtype, ``zeros [k // group_size, n // 8] int32`` (the
    scales' rows, 8 packed zero points per word) or ``[0, 0]`` (zero point 8),
    ``perm [k] int32`` (act-order: the kernel multiplies ``x[..., perm]``) or
    ``[0]``. The fusions, in ``x``'s dtype: ``residual`` ``y``'s shape ``[...,
    n]`` or ``[0]``; ``norm_weight [k]`` or ``[0]`` (RMSNorm over
    ``norm_size`` columns, ``1 <= norm_size <= k``, ``norm_eps >= 0``), not with
    ``swiglu``. ``k``, ``n`` are the padded sizes the kernel sees.
    """
    _check_ints(k=k, n=n, group_size=group_size)
    check_dtypes(x_dtype, scales_dtype, bias_dtype)
    check_fusion_dtypes(x_dtype, residual=residual_dtype, norm_weight=norm_weight_dtype)
    if np.dtype(qweight_dtype) != np.int32:
        raise TypeError(f"qweight.dtype is {np.dtype(qweight_dtype).name}, expected int32")
    if len(x_shape) < 1:
        raise ValueError("x must have at least one dimension, [..., k]")
    if x_shape[-1] != x_columns(k, swiglu):
        what = (f"2 k = {2 * k} columns ([gate | up] for swiglu)" if swiglu
                else f"the weight's k = {k}")
        raise ValueError(f"x.shape[-1] = {x_shape[-1]} does not match {what} (x has shape "
                         f"{tuple(x_shape)}, the weight [k, n] = [{k}, {n}])")
    m = int(np.prod(x_shape[:-1], dtype=np.int64))
    error = rules.check_problem(m, int(n), int(k), int(group_size))
    if error:
        raise ValueError(error)
    expected_q = (k // TILE, 2 * n)
    if tuple(qweight_shape) != expected_q:
        raise ValueError(f"qweight.shape = {tuple(qweight_shape)}, expected [k // 16, 2 n] = "
                         f"{expected_q} for k = {k}, n = {n}")
    expected_s = (num_groups(k, group_size), n)
    if tuple(scales_shape) != expected_s:
        raise ValueError(f"scales.shape = {tuple(scales_shape)}, expected {expected_s} for "
                         f"k = {k}, n = {n}, group_size = {group_size}")
    if np.dtype(zeros_dtype) != np.int32:
        raise TypeError(f"zeros.dtype is {np.dtype(zeros_dtype).name}, expected int32 (8 zero "
                        f"points a word)")
    expected_z = (expected_s[0], n // 8)
    if tuple(zeros_shape) not in (expected_z, (0, 0)):
        raise ValueError(f"zeros.shape = {tuple(zeros_shape)}, expected {expected_z} (the "
                         f"scales' {expected_s[0]} rows by n // 8 = {n // 8} words for n = {n}) "
                         f"or (0, 0) (zero point 8)")
    if np.dtype(perm_dtype) != np.int32:
        raise TypeError(f"perm.dtype is {np.dtype(perm_dtype).name}, expected int32")
    if tuple(perm_shape) not in ((k,), (0,)):
        raise ValueError(f"perm.shape = {tuple(perm_shape)}, expected ({k},) (act-order, the "
                         f"padded k) or (0,) (none)")
    if tuple(bias_shape) not in ((n,), (0,)):
        raise ValueError(f"bias.shape = {tuple(bias_shape)}, expected ({n},) or (0,) (no bias)")
    y_shape = tuple(x_shape[:-1]) + (n,)
    if tuple(residual_shape) not in (y_shape, (0,)):
        raise ValueError(f"residual.shape = {tuple(residual_shape)}, expected y's shape "
                         f"{y_shape} or (0,) (no residual)")
    if tuple(norm_weight_shape) not in ((k,), (0,)):
        raise ValueError(f"norm_weight.shape = {tuple(norm_weight_shape)}, expected ({k},) "
                         f"(RMSNorm over the padded k) or (0,) (none)")
    if tuple(norm_weight_shape) == (k,):
        if swiglu:
            raise ValueError("norm_weight and swiglu cannot both be given: one prologue a call")
        _check_ints(norm_size=norm_size)
        if not 1 <= norm_size <= k:
            raise ValueError(f"norm_size = {norm_size} must be in [1, k = {k}] (the logical k "
                             f"the RMSNorm's mean divides by)")
        if not norm_eps >= 0:
            raise ValueError(f"norm_eps = {norm_eps} must be a non-negative number")
