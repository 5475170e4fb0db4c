"""GPTQ: 4-bit quantization of one layer that minimises its output error on calibration inputs.

    h = gptq.hessian(x)                               # x [..., k] calibration inputs -> [k, k]
    w = gptq.quantize(weight, h, group_size=128)      # weight [k, n] -> MarlinWeight

GPTQ (Frantar et al., 2022, "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers") quantizes the rows of a ``[k, n]``
weight (the input features) one at a time and spreads each row's rounding
error over the rows not yet quantized, weighted by the inverse of
``H = 2 X^T X / m``, so that ``||X W_q - X W||`` (not ``||W_q - W||``) is small:

1. ``H`` gets ``damp * mean(diag H)`` added to its diagonal; inputs that are
   always zero (``H_ii = 0``) get ``H_ii = 1`` and a zero weight row.
2. ``U``: the upper Cholesky factor of ``H^-1`` (``H^-1 = U^T U``). Row ``i``
   of ``U`` scaled by ``1 / U_ii`` is how the error of row ``i`` moves the rows
   after it.
3. Rows are taken in blocks of ``block_size``: inside a block each row is
   rounded and its error applied to the rest of the block at once; the block's
   errors reach the later rows in one matrix product.
4. Symmetric 4-bit values ``q = clip(round(w / s) + 8, 0, 15)`` with one scale
   ``s = max|w| / 7.5`` per group of ``group_size`` rows and column, taken
   from the group's rows as updated when the group's first row comes up
   (as :func:`jax_marlin.quantize` does for the plain weight), and rounded to
   the scales' dtype before use, so that the error propagated is the error
   of the weight the kernel multiplies by.
5. ``min_clip < 1`` searches each scale (when it is fixed) over
   ``f max|w| / 7.5`` for ``f = 1, 0.99, ..`` down to ``min_clip``, keeping
   per group and column the ``f`` with the least ``sum_i H_ii (w_i - dq_i)^2``
   over the group's rows: clipping a few outliers for a finer step on the
   rest (the GPTQ reference's ``mse`` option weighs the rows alike; ``H_ii``
   makes the sum the layer's output error from this group's rounding alone).
   A symmetric scale never exceeds ``max|w| / 7.5`` (before step 7).
6. ``zero_points=True``: ``q = clip(round(w / s) + z, 0, 15)`` with a zero
   point ``z`` per group and column, ``s`` spanning ``[min(w, 0), max(w, 0)]``
   in 15 steps (the clipping search shrinks that range).
7. ``refits > 0`` repeats, that many times: fit the scales to the ``q`` just
   chosen (for fixed ``q`` the output error ``(w - dq)^T H (w - dq)`` of a
   column is quadratic in its scales: a least-squares solve per column over
   its groups), then run steps 3-4 again with those scales fixed.

``act_order=True`` processes the rows by decreasing ``H_ii`` (the inputs
with the most energy first). Groups stay the rows ``g * group_size ..`` of
the original order ("static groups"), with scales from the weight before any
update, so the result is a plain :class:`~jax_marlin.MarlinWeight`: act-order
changes only the order in which rows are quantized.

Everything runs in float32 under one ``jax.jit`` per layer shape (rows in a
``lax.fori_loop``), on whatever device the inputs live on.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_marlin import shapes
from jax_marlin.packing import MarlinWeight, pack

__all__ = ["hessian", "quantize"]

_ZERO_POINT = 8
_MAXQ = 15
_HALF_RANGE = (_MAXQ + 1) / 2 - 0.5  # 7.5: max|w| maps to -8 or +7 with at most half a step
_CLIP_STEP = 0.01  # the clipping search's grid of shrink factors: 1, 0.99, 0.98, ...


def hessian(x, h=None, count: int = 0):
    """Adds inputs ``x [..., k]`` to a running ``H = 2 X^T X / count``.

    Returns ``(h [k, k] float32, count)``: the mean over all rows seen,
    ``count`` of them. Start with ``h=None``; feed batches as they come, so
    calibration inputs never need to be held all at once.
    """
    x = jnp.asarray(x)
    if x.ndim < 1 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must be a float array [..., k], got {x.dtype} of shape {x.shape}")
    k = x.shape[-1]
    if h is not None and h.shape != (k, k):
        raise ValueError(f"h.shape = {h.shape}, expected ({k}, {k}) for x [..., {k}]")
    rows = int(np.prod(x.shape[:-1]))
    if rows == 0:
        raise ValueError(f"x of shape {x.shape} holds no rows")
    if h is None:
        h = jnp.zeros((k, k), jnp.float32)
    return _add_rows(h, x.reshape(rows, k), count / (count + rows)), count + rows


@jax.jit
def _add_rows(h, x, keep):
    x = x.astype(jnp.float32)
    return h * keep + (2.0 / x.shape[0]) * (1.0 - keep) * (x.T @ x)


def quantize(weight, h, *, group_size: int = 128, act_order: bool = False, damp: float = 0.01,
             block_size: int = 128, dtype=jnp.float16, min_clip: float = 1.0,
             refits: int = 0, zero_points: bool = False) -> MarlinWeight:
    """GPTQ of ``weight [k, n]`` (in x out) against ``h [k, k]`` (:func:`hessian`).

    Args:
      weight: ``[k, n]`` float, the Flax kernel layout.
      h: ``[k, k]`` float, ``2 X^T X / m`` of the layer's inputs ``X [m, k]``.
      group_size: 32, 64 or 128 rows per scale, or -1 for one scale per column.
      act_order: quantize rows by decreasing ``h[i, i]`` (groups stay fixed).
      damp: fraction of ``mean(diag h)`` added to the diagonal; > 0.
      block_size: rows per lazy-update block; a multiple of ``group_size``.
      dtype: float16 or bfloat16, the scales' dtype (and the matmul's).
      min_clip: in (0, 1]; below 1, each group's scale is searched down to
        ``min_clip`` times the max-abs scale (step 5 of the module's
        docstring); 1: the max-abs scale.
      refits: rounds of least-squares scales and requantization (step 7).
      zero_points: asymmetric groups, ``(q - zero) * scale`` with a zero point
        0..15 per group and column (the kernels' zero-point path); each
        group's grid spans ``[min(w, 0), max(w, 0)]`` (times the clipping
        search's ``f``) in 15 steps. ``False``: zero point 8 (symmetric).

    Returns:
      :class:`~jax_marlin.MarlinWeight` of logical shape ``[k, n]``, packed
      with :func:`jax_marlin.pack` (any shape; stored padded where the kernel
      needs it).
    """
    w = jnp.asarray(weight)
    h = jnp.asarray(h)
    if w.ndim != 2 or not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"weight must be a 2-D float [k, n], got {w.dtype} of shape {w.shape}")
    k, n = w.shape
    if h.shape != (k, k):
        raise ValueError(f"h.shape = {h.shape}, expected ({k}, {k}) for weight [{k}, {n}]")
    shapes.padded_shape(k, n, group_size)  # checks the group size and that the kernel takes it
    if block_size <= 0 or (group_size != -1 and block_size % group_size):
        raise ValueError(f"block_size = {block_size} must be a positive multiple of "
                         f"group_size = {group_size}")
    if not damp > 0:
        raise ValueError(f"damp = {damp} must be > 0 (H may be singular)")
    if not 0 < min_clip <= 1:
        raise ValueError(f"min_clip = {min_clip} must be in (0, 1]")
    if refits < 0:
        raise ValueError(f"refits = {refits} must be >= 0")
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.float16, jnp.bfloat16):
        raise TypeError(f"dtype is {dtype}; the scales are float16 or bfloat16")
    q, scales, zeros = _gptq(w, h, group_size, act_order, float(damp), block_size, dtype,
                             float(min_clip), int(refits), bool(zero_points))
    return pack(q, scales, group_size=group_size, dtype=dtype,
                zeros=zeros if zero_points else None)


def _scales(w, dtype, shrinks, row_weight, zero_points):
    """Scales and zero points ``[2, n]`` float32 (scales rounded to ``dtype``) of the group ``w [rows, n]``.

    Symmetric (``zero_points=False``): zero point 8 and scale ``f max|w| / 7.5``;
    with zero points, the range ``[min(w, 0), max(w, 0)]`` shrunk by ``f`` in
    15 steps and the zero point that puts 0 on the grid. For each column the
    ``f`` of ``shrinks [S]`` (1 first) whose rounding error
    ``sum_r row_weight[r] (w - dq(w))^2`` is least; ``row_weight [rows]``.
    """
    if zero_points:
        lo = jnp.minimum(jnp.min(w, axis=0), 0.0)
        span = (jnp.maximum(jnp.max(w, axis=0), 0.0) - lo) / _MAXQ
    else:
        span = jnp.max(jnp.abs(w), axis=0) / _HALF_RANGE
    cand = shrinks[:, None] * span[None, :]  # [S, n]
    cand = jnp.minimum(cand, jnp.finfo(dtype).max).astype(dtype).astype(jnp.float32)
    if zero_points:
        safe = jnp.where(cand == 0, 1.0, cand)
        zeros = jnp.clip(jnp.round(-shrinks[:, None] * lo[None, :] / safe), 0, _MAXQ)
    else:
        zeros = jnp.full_like(cand, _ZERO_POINT)
    cand = jnp.stack([cand, zeros], axis=1)  # [S, 2, n]
    if shrinks.shape[0] == 1:
        return cand[0]

    def error(sz):
        _, dq = _round(w, sz)
        return jnp.sum(row_weight[:, None] * jnp.square(w - dq), axis=0)

    err = jax.lax.map(error, cand)  # [S, n]
    # argmin takes the first minimum: ties keep the larger scale.
    return jnp.take_along_axis(cand, jnp.argmin(err, axis=0)[None, None, :], axis=0)[0]


def _round(w, sz):
    """``w [..., n]`` with scales and zero points ``sz [2, n]`` -> ``(q in 0..15, dequantized)``."""
    s, z = sz[0], sz[1]
    safe = jnp.where(s == 0, 1.0, s)  # an all-zero group: q = z
    q = jnp.clip(jnp.round(w / safe) + z, 0, _MAXQ)
    return q, (q - z) * s


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6, 7, 8, 9))
def _gptq(w, h, group_size, act_order, damp, block_size, dtype, min_clip, refits, zero_points):
    k, n = w.shape
    w = w.astype(jnp.float32)
    h = h.astype(jnp.float32)
    g = k if group_size == -1 else group_size
    num_groups = -(-k // g)

    dead = jnp.diag(h) == 0
    h = jnp.where(jnp.diag(dead), 1.0, h)
    w = jnp.where(dead[:, None], 0.0, w)

    steps = int(round((1.0 - min_clip) / _CLIP_STEP))
    shrinks = 1.0 - _CLIP_STEP * jnp.arange(steps + 1, dtype=jnp.float32)
    h_diag = jnp.diag(h)

    # Static scales (act-order, or one group per column): from the weight as given.
    w_groups = jnp.pad(w, ((0, num_groups * g - k), (0, 0))).reshape(num_groups, g, n)
    hd_groups = jnp.pad(h_diag, (0, num_groups * g - k)).reshape(num_groups, g)
    static_scales = jax.lax.map(lambda a: _scales(a[0], dtype, shrinks, a[1], zero_points),
                                (w_groups, hd_groups))  # [num_groups, 2, n]

    w_given, h_given = w, h
    perm = jnp.argsort(-jnp.diag(h), stable=True) if act_order else jnp.arange(k)
    w = w[perm]
    h = h[perm][:, perm]
    h = h + damp * jnp.mean(jnp.diag(h)) * jnp.eye(k, dtype=jnp.float32)
    # U with H^-1 = U^T U (upper Cholesky of the inverse), through H's own factor.
    lower = jnp.linalg.cholesky(h)
    h_inv = jax.scipy.linalg.cho_solve((lower, True), jnp.eye(k, dtype=jnp.float32))
    u = jnp.linalg.cholesky(h_inv).T

    # Pad to whole blocks: padded rows are zero, with U's identity rows they
    # round to q = 8 without error and move nothing.
    k_pad = -(-k // block_size) * block_size
    w = jnp.pad(w, ((0, k_pad - k), (0, 0)))
    u = jnp.pad(u, ((0, k_pad - k), (0, k_pad - k)))
    u = u.at[jnp.arange(k, k_pad), jnp.arange(k, k_pad)].set(1.0)
    group_of_row = jnp.pad(perm // g, (0, k_pad - k))  # padded rows: any group, w = 0
    h_pad = jnp.pad(h_diag, (0, k_pad - k))

    def block(b, carry, lazy_scales, static_scales):
        w, q_all, scales_all = carry
        start = b * block_size
        w1 = jax.lax.dynamic_slice_in_dim(w, start, block_size, 0)  # [B, n]
        u1 = jax.lax.dynamic_slice(u, (start, start), (block_size, block_size))

        def row(j, carry):
            w1, q1, err1, scales_all = carry
            i = start + j
            if lazy_scales:
                # First row of a group: its scale from the group's rows as updated so far.
                grp = jnp.minimum(i // g, num_groups - 1)  # padded rows: w = 0 in any group
                scales_all = jax.lax.cond(
                    (j % g == 0) & (i < k),
                    lambda sa: sa.at[grp].set(_scales(
                        jax.lax.dynamic_slice_in_dim(w1, j, g, 0), dtype, shrinks,
                        jax.lax.dynamic_slice_in_dim(h_pad, i, g, 0), zero_points)),
                    lambda sa: sa, scales_all)
                s = scales_all[grp]
            else:
                s = static_scales[group_of_row[i]]
            wi = w1[j]
            qi, dqi = _round(wi, s)
            err = (wi - dqi) / u1[j, j]
            # U is upper triangular: rows before j get no update.
            w1 = w1 - u1[j][:, None] * err[None, :]
            return w1, q1.at[j].set(qi), err1.at[j].set(err), scales_all

        zeros = jnp.zeros((block_size, n), jnp.float32)
        _, q1, err1, scales_all = jax.lax.fori_loop(
            0, block_size, row, (w1, zeros, zeros, scales_all))
        # The block's errors move every later row (rows up to the block's end
        # have U = 0 in those columns or are already quantized).
        u_rows = jax.lax.dynamic_slice_in_dim(u, start, block_size, 0)  # [B, k_pad]
        later = jnp.arange(k_pad) >= start + block_size
        w = w - jnp.where(later[:, None], u_rows.T @ err1, 0.0)
        q_all = jax.lax.dynamic_update_slice_in_dim(q_all, q1, start, 0)
        return w, q_all, scales_all

    def run(scales, lazy_scales):
        """One GPTQ pass -> ``(q [k, n] int32 in the original row order, scales)``."""
        q = jnp.zeros((k_pad, n), jnp.float32)
        _, q, scales = jax.lax.fori_loop(
            0, k_pad // block_size,
            functools.partial(block, lazy_scales=lazy_scales, static_scales=scales),
            (w, q, scales))
        return jnp.zeros((k, n), jnp.int32).at[perm].set(q[:k].astype(jnp.int32)), scales

    q, scales = run(static_scales, lazy_scales=not act_order and group_size != -1)
    for _ in range(refits):
        scales = _refit_scales(w_given, h_given, q, scales, g, dtype)
        q, scales = run(scales, lazy_scales=False)
    return q, scales[:, 0].astype(dtype), scales[:, 1].astype(jnp.int32)


def _refit_scales(w, h, q, sz, g, dtype):
    """Scales that minimise ``(w - dq)^T H (w - dq)`` per column for fixed ``q`` and zero points.

    ``w [k, n]``, ``h [k, k]`` undamped, ``q [k, n]`` in 0..15, ``sz [groups,
    2, n]`` scales and zero points of groups of ``g`` rows; returns ``sz``
    with new scales. For column c, ``dq = A s`` with ``A [k, groups]``
    holding ``q - zero`` in each group's rows, so the least-squares scales
    solve ``(A^T H A) s = A^T H w``: a ``[groups, groups]`` system per column.
    A group whose ``q`` all equal its zero point (``A^T H A`` has a zero row
    there), or a solution that is not positive and finite, keeps its scale.
    """
    k, n = w.shape
    scales, zeros = sz[:, 0], sz[:, 1]
    num_groups = scales.shape[0]
    pad = num_groups * g - k
    d = jnp.pad(q.astype(jnp.float32), ((0, pad), (0, 0))).reshape(num_groups, g, n)
    d = d - zeros[:, None, :]  # padded rows: w = 0, their d is never used against w
    d = d * (jnp.arange(num_groups * g) < k).reshape(num_groups, g, 1)
    h4 = jnp.pad(h, ((0, pad), (0, pad))).reshape(num_groups, g, num_groups, g)
    hd = jnp.einsum("aibj,bjc->aibc", h4, d)  # H A, by group of A's columns
    m = jnp.einsum("aic,aibc->cab", d, hd)  # [n, groups, groups]
    hw = jnp.pad(h @ w, ((0, pad), (0, 0))).reshape(num_groups, g, n)
    rhs = jnp.einsum("aic,aic->ca", d, hw)  # [n, groups]
    empty = jnp.diagonal(m, axis1=1, axis2=2) <= 0  # [n, groups]
    eye = jnp.eye(num_groups, dtype=bool)
    m = jnp.where(empty[:, :, None] & eye, 1.0, m)
    rhs = jnp.where(empty, scales.T, rhs)
    s = jnp.linalg.solve(m, rhs[..., None])[..., 0].T  # [groups, n]
    s = jnp.minimum(s, jnp.finfo(dtype).max).astype(dtype).astype(jnp.float32)
    return sz.at[:, 0].set(jnp.where(jnp.isfinite(s) & (s > 0), s, scales))
