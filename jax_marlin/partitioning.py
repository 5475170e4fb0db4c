"""Sharding the Marlin kernel over a device mesh: data, column and row parallelism.

:func:`matmul` is the primitive wrapped in ``custom_partitioning``: under
``jax.jit`` with sharded inputs the partitioner runs the kernel on each
device's shard of ``x``, ``qweight``, ``scales``, ``zeros``, ``bias`` and the
fused operands (``residual``, ``norm_weight``) instead of gathering them. On
one device it is the primitive.
:func:`shard_weight` and :func:`weight_specs` place a weight so that every
shard runs on the kernel.

Everything here is about the padded (physical) weight ``[k, n]`` = ``[k_pad,
n_pad]`` that the kernel sees; ``jm.matmul`` pads ``x`` and the bias to it
before this op and drops the padded columns of ``y`` after it.

Layouts (``x [..., m, k] @ W [k, n] + bias [n] -> y [..., m, n]``; ``W`` placed
with :func:`shard_weight`):

* ``m`` (or any leading dimension of ``x``) sharded, data parallel: each device
  multiplies its rows; no communication.
* ``n`` sharded, column parallel: each device holds ``W[:, n_shard]`` and
  ``bias[n_shard]`` and computes ``y[..., n_shard]``; no communication.
* ``k`` sharded, row parallel: each device holds ``W[k_shard, :]`` and the
  matching columns of ``x``, computes a partial product, and ONE all-reduce
  (``psum`` over the mesh axes that shard ``k``) adds the partials. The bias
  is added once, after the all-reduce (in float32, then rounded), not by
  every shard's kernel.
* Combinations on a 2-D mesh, e.g. ``m`` over ``"data"`` and ``n`` or ``k``
  over ``"model"``. A Megatron MLP (``up`` sharded on ``n``, ``down`` on ``k``
  over the same axis) runs with exactly one all-reduce.

Fusions (ffi/ffi_common.h). The residual ``[..., n]`` is sharded like ``y``,
an RMSNorm ``norm_weight [k]`` like ``x``'s ``k``. With ``m`` or ``n`` sharded
every shard holds whole rows of ``x``, so its kernel runs the fused call as
it is. With ``k`` sharded a shard sees part of each row, and the fusions are
not the kernel's per shard: the prologue runs in ``jax.numpy`` on the shard
(``jax_marlin.fusion``; RMSNorm's sum of squares is added over the ``k`` axes:
one more all-reduce, of ``m`` floats), the kernels multiply its ``x'``, and
after the all-reduce the bias and then the residual are added once, each
rounded as the fused call rounds them. SwiGLU's ``x`` is ``[gate | up]``
(``2 k`` columns): a ``k`` shard needs two blocks of its columns, so that ``x``
is replicated along its last dimension and each shard slices its own.

Packed layout. A contiguous shard of ``W`` is itself a valid
:class:`~jax_marlin.MarlinWeight` when its boundaries fall on packed tiles:

* ``qweight [k // 16, 2 n]``: row ``r`` holds weight rows ``16 r .. 16 r + 15``,
  and each 64 weight columns are one contiguous chunk of 128 int32 words. A
  ``k``-shard of a multiple of 16 rows is a row block and an ``n``-shard of a
  multiple of 64 columns is a column block.
* ``scales [k // group_size, n]``: columns are permuted only within runs of 64
  (or 32, per column), so ``n``-shards of multiples of 64 are column blocks;
  row ``g`` covers ``k`` rows ``g group_size .. (g + 1) group_size - 1``
  (``k``-shards are whole groups); per-column scales ``[1, n]`` are replicated
  under ``k`` sharding.

The Shardy ``sharding_rule`` states this with compound factors: ``x``'s ``k``
is ``(k_blocks, k_rows, k_tile)``, ``qweight`` rows are ``(k_blocks,
k_rows)``, ``scales`` rows ``k_blocks`` (grouped); ``n`` is ``(n_chunks,
n_cols)`` in ``scales`` and ``y`` and ``(n_chunks, n_words)`` in ``qweight``.
``bias`` is ``(n_chunks, n_cols)`` like ``y`` (a bias of shape ``[0]``, no
bias, has a factor of its own). Only ``k_blocks`` (``k // group_size``, or
``k // 64`` per column; a reduction factor) and ``n_chunks`` (``n // 64``) and
the leading dimensions of ``x`` may be sharded; the factors inside a tile need
replication.

On top of the rule, the kernel must run on each shard's ``[k_local,
n_local]``: ``n_local`` a multiple of 64, ``k_local`` a multiple of the group
size (of 64 per column), one of them a multiple of 128
(``shapes.check_layer``). :func:`shard_weight` raises ``ValueError`` naming the
dimension, its mesh axes and the local size when a layout breaks this. A weight
placed some other way (``jax.device_put`` with an arbitrary ``PartitionSpec``)
is still computed exactly: the partitioner gathers the offending dimension of
the weight (``k`` first, then ``n``) and emits a ``UserWarning`` saying so.
It never runs the kernel on a misaligned shard.

Imported weights: zero points (``zeros [k // group_size, n // 8]`` int32, or
``[0, 0]`` for none) are an operand of the kernel, placed like the scales:
their rows are the scales' rows and each 64 columns are 8 words, so the rule
maps them to ``(k_blocks, (n_chunks, n_zero_words))`` (``scale_row`` per
column). An act-order weight's ``perm`` is replicated and the weight runs
with ``m`` or ``n`` sharded only (:func:`shard_weight` and the partitioner
refuse ``k``).

Precision of the row-parallel reduction: the kernel rounds each partial
product to ``x``'s dtype and the all-reduce adds them in that dtype. Adding
them in float32 would double the all-reduce's bytes for an error far below
the 4-bit quantization error of the layer (benchmarks/NOTES.md has the
measurement), so the all-reduce stays in float16 (bfloat16). Range: a
float16 reduction can overflow only where a running sum of partials exceeds
65504 while the total does not.
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import (
    BATCHING,
    ArrayMapping,
    CompoundFactor,
    SdyShardingRule,
    custom_partitioning,
)
from jax.sharding import NamedSharding, PartitionSpec

from jax_marlin import fusion, shapes
from jax_marlin._compat import ir
from jax_marlin.packing import MarlinWeight
from jax_marlin.primitive import marlin_matmul_p

__all__ = ["matmul", "shard_weight", "weight_spec_tree", "weight_specs"]

# Packed tiles (packing.py): 16 weight rows per qweight row; 64 weight columns
# (the kernel's narrowest n tile) per chunk of 128 int32 words in qweight and
# of 64 permuted scales.
_ROWS_PER_QROW = shapes.TILE
_COLS_PER_CHUNK = shapes.MIN_THREAD_N
_WORDS_PER_CHUNK = 2 * _COLS_PER_CHUNK
# Per-column scales: the kernel needs k_local to be a multiple of its k tile.
_K_BLOCK_PER_COLUMN = shapes.MIN_THREAD_K


# --- logical (k, n) specs -> packed specs ----------------------------------------


def weight_specs(spec: PartitionSpec, group_size: int) -> tuple[PartitionSpec, PartitionSpec]:
    """The ``(qweight, scales)`` PartitionSpecs for a weight sharded as ``spec``.

    Args:
      spec: a ``PartitionSpec`` over the logical weight ``[k, n]``, e.g.
        ``P(None, "model")`` (column parallel) or ``P("model", None)`` (row
        parallel); missing trailing entries are ``None``.
      group_size: the weight's group size, 32, 64, 128 or -1.

    Returns:
      ``(P(spec[0], spec[1]), P(spec[0], spec[1]))`` for grouped scales
      ``[k // group_size, n]``; per-column scales ``[1, n]`` get
      ``P(None, spec[1])`` (their single row is replicated).
    """
    k_spec, n_spec = _logical_entries(spec)
    shapes.check_group_size(group_size)
    scales_k = None if group_size == -1 else k_spec
    return PartitionSpec(k_spec, n_spec), PartitionSpec(scales_k, n_spec)


def weight_spec_tree(w: MarlinWeight, spec: PartitionSpec) -> MarlinWeight:
    """A ``MarlinWeight`` of PartitionSpecs for ``w`` sharded as ``spec``: one per leaf.

    ``qweight`` and ``scales`` as :func:`weight_specs`; the zero points
    (``[groups, n_pad]``, natural column order) like the scales; an
    act-order ``perm [k]`` replicated. The tree matches ``w``'s, so it can be
    given to ``jax.device_put``, ``with_sharding_constraint`` or as
    ``in_shardings``.
    """
    q_spec, s_spec = weight_specs(spec, w.group_size)
    return MarlinWeight(q_spec, s_spec, w.k, w.n, w.group_size,
                        perm=None if w.perm is None else PartitionSpec(None),
                        zeros=None if w.zeros is None else s_spec)


def shard_weight(w: MarlinWeight, mesh: jax.sharding.Mesh, spec: PartitionSpec) -> MarlinWeight:
    """Places ``w`` on ``mesh``, sharded over its logical ``[k, n]`` as ``spec``.

    Args:
      w: a :class:`~jax_marlin.MarlinWeight` for a ``[k, n]`` weight. A padded
        weight is split on its padded ``[k_pad, n_pad]``: the shards must fit
        that shape.
      mesh: the device mesh.
      spec: a ``PartitionSpec`` over ``(k, n)``: ``P(None, "model")`` splits the
        output columns (column parallel), ``P("model", None)`` the input rows
        (row parallel, one all-reduce per ``jm.matmul``); an entry may name
        several mesh axes, ``P(None, ("data", "model"))``.

    Returns:
      A ``MarlinWeight`` whose ``qweight`` is placed with ``weight_specs(spec)[0]``
      and ``scales`` with ``weight_specs(spec)[1]``; every device's shard is a
      valid ``MarlinWeight`` of ``[k_local, n_local]`` (of the padded weight).

    Raises:
      ValueError: an axis name is not in ``mesh``, a shard would not run on
        the kernel (``n_local`` not a multiple of 64, ``k_local`` not a multiple
        of the group size, ...; the message names the dimension, its mesh axes
        and the local size), or an act-order weight (``w.perm``) is sharded
        along ``k``, which is not supported yet.

    Zero points are sharded like the scales; an act-order ``perm`` is
    replicated (``m`` and ``n`` sharding only).
    """
    if not isinstance(w, MarlinWeight):
        raise TypeError(f"w must be a jax_marlin.MarlinWeight, got {type(w).__name__}")
    k_spec, n_spec = _logical_entries(spec)
    k_axes, n_axes = _axes(k_spec), _axes(n_spec)
    for name in k_axes + n_axes:
        if name not in mesh.shape:
            raise ValueError(f"spec {spec} names mesh axis {name!r}, but the mesh has axes "
                             f"{tuple(mesh.axis_names)}")
    if set(k_axes) & set(n_axes):
        raise ValueError(f"spec {spec} shards both k and n over mesh axes "
                         f"{sorted(set(k_axes) & set(n_axes))}; an axis can split one dimension")
    if w.perm is not None and k_axes:
        raise ValueError(_act_order_k_error(f"cannot shard {w!r} as {spec}", k_axes))
    error = _layout_error(w.k_pad, w.n_pad, w.group_size, k_axes, n_axes, mesh.shape)
    if error is not None:
        raise ValueError(f"cannot shard {w!r} as {spec}: {error}")
    specs = weight_spec_tree(w, spec)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                             is_leaf=lambda s: isinstance(s, PartitionSpec))
    return jax.device_put(w, shardings)


def _act_order_k_error(what: str, k_axes) -> str:
    return (f"{what}: the weight is act-order (it has a perm) and k is sharded over mesh "
            f"axes {tuple(k_axes)}; act-order weights run with m or n sharded only (their "
            f"rows are stored by group, not in x's order), so shard n or replicate k")


def _logical_entries(spec) -> tuple:
    if not isinstance(spec, PartitionSpec):
        raise TypeError(f"spec must be a jax.sharding.PartitionSpec over (k, n), "
                        f"got {type(spec).__name__}")
    if len(spec) > 2:
        raise ValueError(f"spec {spec} has {len(spec)} entries; a weight [k, n] takes at most 2")
    entries = tuple(spec) + (None,) * (2 - len(spec))
    return entries[0], entries[1]


def _axes(entry) -> tuple[str, ...]:
    """A PartitionSpec entry (None, a name, or a tuple of names) as a tuple of names."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def _entry(axes: tuple[str, ...]):
    """Inverse of :func:`_axes`."""
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def _shards(axes: tuple[str, ...], mesh_shape) -> int:
    return math.prod(mesh_shape[a] for a in axes)


def _layout_error(k: int, n: int, group_size: int, k_axes, n_axes, mesh_shape) -> str | None:
    """Why ``[k, n]`` sharded over ``k_axes`` x ``n_axes`` cannot run per shard, or None."""
    n_shards, k_shards = _shards(n_axes, mesh_shape), _shards(k_axes, mesh_shape)
    n_where = f"n = {n} sharded over mesh axes {n_axes} ({n_shards} shards)"
    k_where = f"k = {k} sharded over mesh axes {k_axes} ({k_shards} shards)"
    if n % n_shards:
        return f"{n_where} does not split evenly"
    n_local = n // n_shards
    if n_local % _COLS_PER_CHUNK:
        return (f"{n_where} leaves n_local = {n_local} columns per shard, not a multiple of "
                f"{_COLS_PER_CHUNK} (the packed column chunk)")
    if k % k_shards:
        return f"{k_where} does not split evenly"
    k_local = k // k_shards
    k_block = _K_BLOCK_PER_COLUMN if group_size == -1 else group_size
    if k_local % k_block:
        what = ("the kernel's 64-row k tile" if group_size == -1
                else f"group_size = {group_size}, one row of scales")
        return f"{k_where} leaves k_local = {k_local} rows per shard, not a multiple of {what}"
    try:
        shapes.check_layer(k_local, n_local, group_size)
    except ValueError as e:
        return (f"the per-shard weight [k_local, n_local] = [{k_local}, {n_local}] "
                f"({k_where}, {n_where}) does not run on the kernel: {e}")
    return None


# --- the partitioned op ------------------------------------------------------------


def _full_matmul(x, qweight, scales, zeros, perm, bias, residual, norm_weight, k, n, group_size,
                 poison_output, norm_eps, norm_size, swiglu):
    # The unpartitioned computation: what runs on one device, eagerly, and what
    # the partitioner's shapes are derived from.
    return marlin_matmul_p.bind(x, qweight, scales, zeros, perm, bias, residual, norm_weight,
                                k=k, n=n, group_size=group_size, poison_output=poison_output,
                                norm_eps=norm_eps, norm_size=norm_size, swiglu=swiglu)


def _sharding_rule(k, n, group_size, poison_output, norm_eps, norm_size, swiglu, mesh,
                   operand_types, result_types):
    """The Shardy rule for ``(x [..., k], qweight, scales, zeros, perm, bias, residual,
    norm_weight) -> y [..., n]`` (module doc)."""
    del poison_output, norm_eps, norm_size, mesh, result_types
    has_zeros = _has_elements(operand_types[3])
    has_bias = _has_elements(operand_types[5])
    has_residual = _has_elements(operand_types[6])
    has_norm = _has_elements(operand_types[7])
    k_rows = CompoundFactor("k_blocks", "k_rows", "k_tile")
    q_rows = CompoundFactor("k_blocks", "k_rows")
    y_cols = CompoundFactor("n_chunks", "n_cols")
    q_cols = CompoundFactor("n_chunks", "n_words")
    z_cols = CompoundFactor("n_chunks", "n_zero_words")
    sizes = dict(k_rows=(_K_BLOCK_PER_COLUMN if group_size == -1 else group_size) // _ROWS_PER_QROW,
                 k_tile=_ROWS_PER_QROW, n_chunks=n // _COLS_PER_CHUNK,
                 n_cols=_COLS_PER_CHUNK, n_words=_WORDS_PER_CHUNK)
    # Zero points are placed like the scales: their rows are the scales'
    # rows, and each chunk of 64 columns is 8 words of them.
    scale_row = "scale_row" if group_size == -1 else "k_blocks"
    if group_size == -1:
        # One row of scales for all of k: replicated under k sharding.
        sizes["k_blocks"] = k // _K_BLOCK_PER_COLUMN
        replicated = ("k_rows", "k_tile", "n_words", "scale_row", "n_cols")
    else:
        replicated = ("k_rows", "k_tile", "n_words", "n_cols")
    scales = ArrayMapping(scale_row, y_cols)
    if has_zeros:
        zeros = ArrayMapping(scale_row, z_cols)
        sizes["n_zero_words"] = _COLS_PER_CHUNK // 8
        replicated += ("n_zero_words",)
    else:  # the empty [0, 0] placeholder
        zeros = ArrayMapping("no_zero_rows", "no_zero_cols")
        replicated += ("no_zero_rows", "no_zero_cols")
    # An act-order perm indexes all of x's k: replicated (_choose_layout
    # refuses k sharding for such a weight).
    perm = ArrayMapping("perm_rows")
    replicated += ("perm_rows",)
    if has_bias:
        bias = ArrayMapping(y_cols)
    else:  # the empty [0] placeholder: nothing to shard
        bias = ArrayMapping("no_bias")
        replicated += ("no_bias",)
    if has_residual:  # y's shape, sharded like y
        residual = ArrayMapping(BATCHING, y_cols)
    else:
        residual = ArrayMapping("no_residual")
        replicated += ("no_residual",)
    if has_norm:  # one value per row of k, sharded like x's k
        norm_weight = ArrayMapping(k_rows)
    else:
        norm_weight = ArrayMapping("no_norm")
        replicated += ("no_norm",)
    if swiglu:
        # x is [gate | up]: a k shard is two blocks of its columns, which no
        # sharding of the one dimension gives; it stays whole (module doc).
        x = ArrayMapping(BATCHING, "x_cols")
        replicated = ("x_cols",) + tuple(f for f in replicated if f != "k_tile")
        del sizes["k_tile"]  # only x's (and norm_weight's) k have it
    else:
        x = ArrayMapping(BATCHING, k_rows)
    # Shardy wants each kind's factors in order of first appearance, which is
    # the order listed above.
    return SdyShardingRule(
        operand_mappings=(x, ArrayMapping(q_rows, q_cols), scales, zeros, perm, bias, residual,
                          norm_weight),
        result_mappings=(ArrayMapping(BATCHING, y_cols),),
        reduction_factors=("k_blocks",),
        need_replication_factors=replicated,
        **sizes,
    )


def _choose_layout(k, n, group_size, act_order, mesh, x_sharding, q_sharding, x_ndim, *, warn):
    """``(batch_entries, k_axes, n_axes)`` to run on, from the operands' shardings.

    The weight's sharding decides ``k`` and ``n`` (moving the weight is what
    costs), ``x``'s leading dimensions keep theirs minus any axis the weight
    uses. A weight layout whose shards cannot run on the kernel is gathered
    along ``k``, then ``n``, with a warning if ``warn``.
    """
    if not (isinstance(x_sharding, NamedSharding) and isinstance(q_sharding, NamedSharding)):
        if warn:
            warnings.warn(
                "jm.matmul: the partitioner gave shardings without a mesh "
                f"({type(q_sharding).__name__}); running on replicated operands. Shard with "
                "NamedSharding (jm.shard_weight) to split the work.",
                stacklevel=2)
        return (None,) * (x_ndim - 1), (), ()
    q_entries = tuple(q_sharding.spec) + (None,) * (2 - len(q_sharding.spec))
    k_axes, n_axes = _axes(q_entries[0]), _axes(q_entries[1])
    if act_order and k_axes:
        raise ValueError(_act_order_k_error(
            f"jm.matmul: the weight [k, n] = [{k}, {n}] is sharded as {q_sharding.spec} "
            f"(qweight)", k_axes))
    error = _layout_error(k, n, group_size, k_axes, n_axes, mesh.shape)
    if error is not None:
        # Gathering k first keeps the result free of an all-reduce; the full
        # weight always runs (the primitive's abstract eval checked it).
        candidates = (((), n_axes, "k"), (k_axes, (), "n"), ((), (), "k and n"))
        k_axes, n_axes, dropped = next(
            c for c in candidates if _layout_error(k, n, group_size, c[0], c[1], mesh.shape) is None)
        if warn:
            warnings.warn(
                f"jm.matmul: the weight [k, n] = [{k}, {n}] is sharded as {q_sharding.spec} "
                f"(qweight), which cannot run per shard: {error}. Gathering the weight along "
                f"{dropped} instead; place it with jm.shard_weight to get an "
                f"error at placement.", stacklevel=2)
    used = set(k_axes) | set(n_axes)
    x_entries = tuple(x_sharding.spec) + (None,) * (x_ndim - len(x_sharding.spec))
    batch = tuple(_entry(tuple(a for a in _axes(e) if a not in used)) for e in x_entries[:-1])
    return batch, k_axes, n_axes


def _has_elements(operand_type) -> bool:
    """Whether an optional operand (an aval, a ShapeDtypeStruct or an MLIR type) is not the
    empty placeholder (bias ``[0]``, zeros ``[0, 0]``, perm ``[0]``)."""
    shape = (operand_type.shape if hasattr(operand_type, "shape")
             else ir.RankedTensorType(operand_type).shape)
    return shape[0] > 0


def _shardings(mesh, group_size, batch, k_axes, n_axes, has_zeros, has_bias, has_residual,
               has_norm, swiglu):
    k_entry, n_entry = _entry(k_axes), _entry(n_axes)
    q_spec, s_spec = weight_specs(PartitionSpec(k_entry, n_entry), group_size)
    y_spec = PartitionSpec(*batch, n_entry)
    args = (NamedSharding(mesh, PartitionSpec(*batch, None if swiglu else k_entry)),
            NamedSharding(mesh, q_spec), NamedSharding(mesh, s_spec),
            NamedSharding(mesh, s_spec if has_zeros else PartitionSpec(None, None)),
            NamedSharding(mesh, PartitionSpec(None)),
            NamedSharding(mesh, PartitionSpec(n_entry if has_bias else None)),
            NamedSharding(mesh, y_spec if has_residual else PartitionSpec(None)),
            NamedSharding(mesh, PartitionSpec(k_entry if has_norm else None)))
    return args, NamedSharding(mesh, y_spec)


def _partition(k, n, group_size, poison_output, norm_eps, norm_size, swiglu, mesh, arg_shapes,
               result_shape):
    """Per-shard computation: the kernel on ``[k_local, n_local]``, psum over ``k``'s axes."""
    del result_shape
    x, qweight, _, zeros, perm, bias, residual, norm_weight = arg_shapes
    has_zeros, has_bias = _has_elements(zeros), _has_elements(bias)
    has_residual, has_norm = _has_elements(residual), _has_elements(norm_weight)
    batch, k_axes, n_axes = _choose_layout(k, n, group_size, _has_elements(perm), mesh,
                                           x.sharding, qweight.sharding, x.ndim, warn=True)
    k_local = k // _shards(k_axes, mesh.shape)
    n_local = n // _shards(n_axes, mesh.shape)
    fused = dict(norm_eps=norm_eps, norm_size=norm_size, swiglu=swiglu)

    def local(x, qweight, scales, zeros, perm, bias, residual, norm_weight):
        if not k_axes:  # whole rows of x: the fused call as it is
            return marlin_matmul_p.bind(x, qweight, scales, zeros, perm, bias, residual,
                                        norm_weight, k=k_local, n=n_local, group_size=group_size,
                                        poison_output=poison_output, **fused)
        # Row parallel (module doc): the prologue on this shard's columns, the
        # kernel on its x' alone, then the bias and the residual once, each
        # rounded as the fused call rounds them.
        if has_norm:
            x = fusion.rms_norm(x, norm_weight, norm_eps, norm_size, axis_name=k_axes)
        elif swiglu:  # x [..., 2 k] whole: this shard's columns of gate and up
            start = jax.lax.axis_index(k_axes) * k_local
            x = fusion.silu_gate(jax.lax.dynamic_slice_in_dim(x, start, k_local, axis=-1),
                                 jax.lax.dynamic_slice_in_dim(x, k + start, k_local, axis=-1))
        empty = jnp.zeros((0,), x.dtype)
        y = marlin_matmul_p.bind(x, qweight, scales, zeros, perm, empty, empty, empty,
                                 k=k_local, n=n_local, group_size=group_size,
                                 poison_output=poison_output, norm_eps=0.0, norm_size=0,
                                 swiglu=False)
        # Add the float16 partial products (module doc: precision).
        y = jax.lax.psum(y, k_axes)
        if has_bias:
            y = (y.astype(jnp.float32) + bias.astype(jnp.float32)).astype(y.dtype)
        if has_residual:
            y = fusion.add_residual(y, residual)
        return y

    arg_shardings, result_sharding = _shardings(mesh, group_size, batch, k_axes, n_axes,
                                                has_zeros, has_bias, has_residual, has_norm,
                                                swiglu)
    return mesh, local, result_sharding, arg_shardings


def _infer_sharding_from_operands(k, n, group_size, poison_output, norm_eps, norm_size, swiglu,
                                  mesh, arg_shapes, result_shape):
    # Only used by the GSPMD partitioner (jax_use_shardy_partitioner=False);
    # _partition warns about the same layout.
    del poison_output, norm_eps, norm_size, result_shape
    x, qweight, _, zeros, perm, bias, residual, norm_weight = arg_shapes
    batch, k_axes, n_axes = _choose_layout(k, n, group_size, _has_elements(perm), mesh,
                                           x.sharding, qweight.sharding, x.ndim, warn=False)
    return _shardings(mesh, group_size, batch, k_axes, n_axes, _has_elements(zeros),
                      _has_elements(bias), _has_elements(residual), _has_elements(norm_weight),
                      swiglu)[1]


_partitioned = custom_partitioning(_full_matmul, static_argnums=tuple(range(8, 15)))
_partitioned.def_partition(
    partition=_partition,
    infer_sharding_from_operands=_infer_sharding_from_operands,
    sharding_rule=_sharding_rule,
)


# --- entry ---------------------------------------------------------------------------


def matmul(x, qweight, scales, zeros, perm, bias, residual, norm_weight, k: int, n: int,
           group_size: int, poison_output: bool, norm_eps: float, norm_size: int,
           swiglu: bool) -> jax.Array:
    """``dtype(dtype(x' [..., k] @ W + bias [n]) + residual) -> [..., n]`` on the padded
    shape, partitioned.

    ``k``, ``n`` are the padded sizes; ``zeros`` is ``[groups, n // 8]`` int32
    or ``[0, 0]`` (zero point 8), ``perm`` is ``[k]`` int32 (an act-order
    weight: the kernel multiplies ``x'[..., perm]``; such a weight is never
    split along ``k``) or ``[0]``, ``bias`` is ``[n]`` or ``[0]`` (no bias),
    ``residual`` ``[..., n]`` or ``[0]``. ``x'`` is ``x``, its RMSNorm with a
    ``norm_weight [k]`` (``norm_eps``; ``norm_size`` the logical k), or with
    ``swiglu`` ``dtype(silu(gate) up)`` of ``x [..., 2 k] = [gate | up]``.
    ``jm.matmul`` calls this after it has checked and padded its arguments.
    """
    return _partitioned(x, qweight, scales, zeros, perm, bias, residual, norm_weight, k, n,
                        group_size, poison_output, float(norm_eps), int(norm_size), bool(swiglu))
