"""Flax NNX: ``MarlinLinear``, a 4-bit ``nnx.Linear``, and ``quantize_model``.

    from jax_marlin.flax import MarlinLinear, QuantizedWeight, quantize_model

    layer = MarlinLinear(4096, 11008, rngs=nnx.Rngs(0))  # y [..., 11008] = x [..., 4096] @ W + b
    model = quantize_model(model)  # every nnx.Linear -> MarlinLinear
    qkv = concatenate_linears([q, k, v])  # one layer [..., k] -> [..., n_q + n_k + n_v]

The packed weight sits in a :class:`QuantizedWeight` variable, not an
``nnx.Param``: ``nnx.grad`` and ``nnx.Optimizer`` (which take ``nnx.Param``)
leave it alone, and ``nnx.split(model, QuantizedWeight, ...)`` picks it out.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable, MutableMapping, MutableSequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_marlin import shapes
from jax_marlin.flax._dtypes import matmul_dtype
from jax_marlin.packing import MarlinWeight, concatenate, quantize
from jax_marlin.ops import matmul
from jax_marlin.partitioning import weight_spec_tree

__all__ = [
    "MarlinLinear",
    "QuantizeSummary",
    "QuantizedLayer",
    "QuantizedWeight",
    "SkippedLayer",
    "concatenate_linears",
    "get_partition_spec",
    "quantize_model",
]

_log = logging.getLogger(__name__)

# The same defaults as nnx.Linear, so a MarlinLinear and an nnx.Linear built
# from the same Rngs start from the same float kernel.
default_kernel_init = nnx.initializers.lecun_normal()
default_bias_init = nnx.initializers.zeros_init()

#: Below this many layers ``quantize_model(progress=None)`` shows no progress bar.
PROGRESS_MIN_LAYERS = 8

Path = tuple[Any, ...]


class QuantizedWeight(nnx.Variable):
    """An ``nnx.Variable`` holding a :class:`~jax_marlin.MarlinWeight`.

    Its value is the whole ``MarlinWeight`` pytree (``qweight`` int32
    ``[k_pad // 16, 2 n_pad]``, ``scales`` float16 or bfloat16 ``[groups, n_pad]``,
    and for weights imported with zero points or act-order ``zeros`` and
    ``perm``; ``k``, ``n``, ``group_size`` static), so ``nnx.state``,
    ``nnx.update``, ``nnx.split`` / ``nnx.merge`` and Orbax see two (to four)
    arrays per layer. Not an ``nnx.Param``: the packed integers are not
    trainable.
    """


class MarlinLinear(nnx.Module):
    """``y [..., out_features] = x [..., in_features] @ W + bias`` with a 4-bit ``W``.

    A drop-in for ``nnx.Linear`` at inference: the kernel is drawn in float
    with ``kernel_init`` (from the same ``rngs.params()`` draw as
    ``nnx.Linear``) and quantized once, here, with :func:`jax_marlin.quantize`.
    Any shape: one the kernel does not run as it is is padded
    (``jax_marlin.padded_shape``), at the cost of the padded weight bytes.

    The matmul runs in float16 or bfloat16, the dtype of the weight's scales:
    ``dtype`` if that is one of them, else ``param_dtype`` if that is, else
    float16 (a float32 layer). Inputs and the bias are cast to it; the bias
    is added inside the kernel, before its one rounding.

    Args:
      in_features: k.
      out_features: n.
      use_bias: add a bias ``[out_features]``, an ``nnx.Param`` in ``param_dtype``.
      dtype: dtype of the result, and of the matmul when float16 or bfloat16;
        ``None`` returns the dtype of ``x``.
      param_dtype: dtype ``kernel_init`` draws the float kernel in, and of the bias.
      group_size: 32, 64 or 128 (one scale per that many rows of k) or -1 (one
        per column).
      kernel_init: initializer for the float ``[in_features, out_features]`` kernel.
      bias_init: initializer for the bias.
      rngs: the ``params`` stream draws the kernel, then the bias.

    Attributes:
      weight: :class:`QuantizedWeight` holding the :class:`~jax_marlin.MarlinWeight`.
      bias: ``nnx.Param [out_features]``, or ``None`` without bias.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = True,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        group_size: int = 128,
        kernel_init: Callable[..., Any] = default_kernel_init,
        bias_init: Callable[..., Any] = default_bias_init,
        rngs: nnx.Rngs,
    ):
        # Refuse a shape the kernel cannot take before drawing anything.
        shapes.padded_shape(in_features, out_features, group_size)
        kernel = kernel_init(rngs.params(), (in_features, out_features), param_dtype)
        # A kernel_init wrapped with nnx.with_partitioning returns the array
        # with its metadata; the metadata (out_sharding over the logical
        # (in, out) dims) moves to the packed weight, see get_partition_spec.
        metadata = {}
        if isinstance(kernel, nnx.VariableMetadata):
            kernel, metadata = kernel.raw_value, dict(kernel.metadata)
        packed = quantize(kernel, group_size=group_size,
                          dtype=matmul_dtype(dtype, param_dtype))
        sharding = metadata.get("out_sharding")
        if sharding and nnx.using_eager_sharding() and not jax.sharding.get_abstract_mesh().empty:
            # Flax's own eager sharding would put one spec on both leaves,
            # which per-column scales ([1, n]) cannot take along k.
            packed = jax.lax.with_sharding_constraint(
                packed, weight_spec_tree(packed, jax.sharding.PartitionSpec(*sharding)))
        self.weight = QuantizedWeight(packed, eager_sharding=False, **metadata)
        self.bias: nnx.Param | None
        if use_bias:
            self.bias = nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype))
        else:
            self.bias = nnx.data(None)
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.group_size = group_size

    @classmethod
    def from_linear(cls, linear: nnx.Linear, *, group_size: int = 128) -> MarlinLinear:
        """Quantizes an ``nnx.Linear``'s kernel ``[in, out]``; copies its bias and dtypes.

        Raises ``ValueError`` (from ``padded_shape``) if the kernel's shape
        does not fit even padded (too large). Traceable: works inside
        ``nnx.eval_shape`` and ``nnx.jit``.
        """
        if not isinstance(linear, nnx.Linear):
            raise TypeError(f"linear must be an nnx.Linear, got {type(linear).__name__}")
        kernel = linear.kernel[...]
        sharding = linear.kernel.get_metadata().get("out_sharding")
        if sharding:  # keep nnx.with_partitioning annotations of the float kernel
            kernel = nnx.VariableMetadata(kernel, metadata=dict(out_sharding=sharding))
        bias = linear.bias[...] if linear.bias is not None else None
        # The initializers hand back the layer's own arrays, so __init__ stays
        # the one place that builds a MarlinLinear; the Rngs is never used for
        # randomness.
        return cls(
            linear.in_features,
            linear.out_features,
            use_bias=linear.use_bias,
            dtype=linear.dtype,
            param_dtype=linear.param_dtype,
            group_size=group_size,
            kernel_init=lambda *_: kernel,
            bias_init=lambda *_: bias,
            rngs=nnx.Rngs(0),
        )

    def __call__(self, inputs: jax.Array, *, residual: jax.Array | None = None,
                 rms_norm_weight: jax.Array | None = None, rms_norm_eps: float = 1e-6,
                 swiglu: bool = False) -> jax.Array:
        """``inputs [..., in_features]`` float -> ``[..., out_features]`` in ``dtype``.

        ``inputs`` and the bias are rounded to the weight's dtype (float16:
        values beyond ±65504 become inf). Differentiable with respect to
        ``inputs`` and the bias; the weight is frozen (a ``QuantizedWeight``,
        which ``nnx.grad`` over ``nnx.Param`` skips).

        ``residual [..., out_features]``, ``rms_norm_weight [in_features]``,
        ``rms_norm_eps`` and ``swiglu`` (``inputs [..., 2 in_features]``, gate
        then up) are :func:`jax_marlin.matmul`'s fusions, run in the weight's
        dtype like ``inputs`` (the residual too: the sum is rounded to it
        before the cast to ``dtype``).
        """
        x = jnp.asarray(inputs)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            width = f"2 * {self.in_features}" if swiglu else self.in_features
            raise TypeError(f"inputs.dtype is {x.dtype}; MarlinLinear takes floating-point "
                            f"inputs [..., {width}]")
        out_dtype = x.dtype if self.dtype is None else jnp.dtype(self.dtype)
        w = self.weight.get_value()
        bias = None if self.bias is None else self.bias[...].astype(w.dtype)
        residual, rms_norm_weight = (None if a is None else jnp.asarray(a).astype(w.dtype)
                                     for a in (residual, rms_norm_weight))
        y = matmul(x.astype(w.dtype), w, bias=bias, residual=residual,
                   rms_norm_weight=rms_norm_weight, rms_norm_eps=rms_norm_eps, swiglu=swiglu)
        return y.astype(out_dtype)


# The configuration two layers must share to become one (besides their kind).
_LINEAR_CONFIG = ("in_features", "use_bias", "dtype", "param_dtype", "precision",
                  "dot_general", "promote_dtype", "preferred_element_type")
_MARLIN_CONFIG = ("in_features", "use_bias", "dtype", "param_dtype")


def concatenate_linears(layers) -> nnx.Linear | MarlinLinear:
    """One layer whose output is ``layers``' outputs side by side, along the last axis.

    ``y [..., sum n_i] = x [..., k] @ [W_1 ... W_j] + [b_1 ... b_j]``, for
    layers that share their input (attention's q, k, v projections; an MLP's
    gate and up): one matmul in place of several, which at batch 1 saves each
    call's fixed cost. All ``nnx.Linear`` (kernels ``[k, n_i]`` and biases
    concatenated: a new ``nnx.Linear``) or all :class:`MarlinLinear` (the
    packed weights joined by :func:`jax_marlin.concatenate`, exactly: a new
    ``MarlinLinear``), with the same ``in_features``, ``use_bias``, dtypes
    and, for ``MarlinLinear``, weights that :func:`jax_marlin.concatenate`
    takes. The layers are left as they are; ``nnx.with_partitioning``
    annotations are not carried over (sharding the joined n would not split
    it where the parts meet).
    """
    layers = list(layers)
    if not layers:
        raise ValueError("concatenate_linears needs at least one layer")
    kinds = {type(layer) for layer in layers}
    if len(kinds) > 1 or not kinds <= {nnx.Linear, MarlinLinear}:
        names = ", ".join(type(layer).__name__ for layer in layers)
        raise TypeError(f"concatenate_linears joins layers that are all nnx.Linear or all "
                        f"MarlinLinear, got {names}")
    first = layers[0]
    quantized = type(first) is MarlinLinear
    for name in _MARLIN_CONFIG if quantized else _LINEAR_CONFIG:
        values = [getattr(layer, name) for layer in layers]
        if any(v != values[0] for v in values):
            raise ValueError(f"concatenate_linears: the layers' {name} differ "
                             f"({', '.join(map(str, values))})")
    out_features = sum(layer.out_features for layer in layers)
    if quantized:
        weight = concatenate([layer.weight.get_value() for layer in layers])
        # Built abstract (MarlinLinear would draw and quantize a kernel), then given its arrays.
        joined = nnx.eval_shape(lambda: MarlinLinear(
            first.in_features, out_features, use_bias=first.use_bias, dtype=first.dtype,
            param_dtype=first.param_dtype, group_size=weight.group_size, rngs=nnx.Rngs(0)))
        joined.weight = QuantizedWeight(weight, eager_sharding=False)
    else:
        joined = nnx.eval_shape(lambda: nnx.Linear(
            first.in_features, out_features,
            **{name: getattr(first, name) for name in _LINEAR_CONFIG[1:]},
            rngs=nnx.Rngs(0)))
        joined.kernel = nnx.Param(jnp.concatenate([layer.kernel[...] for layer in layers], 1))
    if first.use_bias:
        joined.bias = nnx.Param(jnp.concatenate([layer.bias[...] for layer in layers]))
    return joined


def get_partition_spec(tree):
    """``nnx.get_partition_spec`` that knows the packed layout of :class:`QuantizedWeight`.

    A ``QuantizedWeight`` annotated (through ``nnx.with_partitioning`` on the
    kernel) with ``out_sharding`` over the logical ``(in_features,
    out_features)`` dims gets a ``MarlinWeight`` of two specs,
    ``jax_marlin.weight_spec_tree``: ``qweight`` follows (k, n); per-column
    scales stay replicated along k; zero points follow the scales and an
    act-order ``perm`` is replicated. Everything else is as
    ``nnx.get_partition_spec``.
    Use it in place of that in the usual flow::

        specs = get_partition_spec(nnx.state(model))
        state = jax.lax.with_sharding_constraint(nnx.state(model), specs)
    """
    specs = nnx.get_partition_spec(tree)

    def packed(var, spec):
        if not isinstance(var, QuantizedWeight):
            return spec
        w = var.get_value()
        spec_value = spec.get_value()
        if isinstance(w, MarlinWeight) and isinstance(spec_value, jax.sharding.PartitionSpec):
            return spec.replace(weight_spec_tree(w, spec_value))
        return spec

    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    return jax.tree.map(packed, tree, specs, is_leaf=is_var)


# --- quantize_model -------------------------------------------------------------


def _path_str(path: Path) -> str:
    return "/".join(str(p) for p in path) or "<root>"


def _nbytes(a) -> int:
    return int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class QuantizedLayer:
    """An ``nnx.Linear`` at ``path`` replaced by a ``MarlinLinear`` with a ``[k, n]`` weight.

    ``k_pad``, ``n_pad``: the packed (padded) shape, ``k``, ``n`` unless the
    kernel needed padding.
    """

    path: Path
    k: int
    n: int
    bytes_before: int  # the float kernel, in its stored dtype
    bytes_after: int  # qweight + scales, padded
    k_pad: int
    n_pad: int

    @property
    def padded(self) -> bool:
        return (self.k_pad, self.n_pad) != (self.k, self.n)


@dataclasses.dataclass(frozen=True)
class SkippedLayer:
    """An ``nnx.Linear`` at ``path`` (kernel ``[k, n]``) left in float, and why."""

    path: Path
    k: int
    n: int
    reason: str


# Static (no leaves): a summary passes unchanged through nnx.eval_shape and jit.
@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class QuantizeSummary:
    """What :func:`quantize_model` did.

    Attributes:
      group_size: the group size used.
      replaced: layers now ``MarlinLinear`` (``layer.padded``: stored padded).
      skipped: layers the filter selected that stay ``nnx.Linear``, with the reason.
      excluded: paths of layers the filter turned down.

    ``str(summary)`` is a short report; ``bytes_before`` / ``bytes_after``
    total the replaced kernels (biases are unchanged and not counted).
    """

    group_size: int
    replaced: tuple[QuantizedLayer, ...]
    skipped: tuple[SkippedLayer, ...]
    excluded: tuple[Path, ...]

    @property
    def bytes_before(self) -> int:
        return sum(layer.bytes_before for layer in self.replaced)

    @property
    def bytes_after(self) -> int:
        return sum(layer.bytes_after for layer in self.replaced)

    def __str__(self) -> str:
        lines = [f"quantize_model(group_size={self.group_size}): {len(self.replaced)} nnx.Linear "
                 f"-> MarlinLinear, {len(self.skipped)} kept in float, "
                 f"{len(self.excluded)} excluded by filter"]
        if self.replaced:
            ratio = self.bytes_before / max(self.bytes_after, 1)
            lines.append(f"  replaced kernels: {self.bytes_before / 2**20:.2f} MiB -> "
                         f"{self.bytes_after / 2**20:.2f} MiB ({ratio:.1f}x smaller)")
        lines += [f"  padded: {_path_str(q.path)} [{q.k}, {q.n}] -> [{q.k_pad}, {q.n_pad}]"
                  for q in self.replaced if q.padded]
        lines += [f"  kept in float: {_path_str(s.path)} [{s.k}, {s.n}]: {s.reason}"
                  for s in self.skipped]
        if self.excluded:
            lines.append("  excluded: " + ", ".join(_path_str(p) for p in self.excluded))
        return "\n".join(lines)


def _rewrite(node: Any, path: Path, visit: Callable[[Path, nnx.Linear], Any],
             done: dict[int, Any]) -> Any:
    """Returns ``node`` with every ``nnx.Linear`` below it replaced by ``visit(path, linear)``.

    Mutable containers (modules, ``nnx.List``/``nnx.Dict``, lists, dicts) are
    changed in place; a tuple holding a replaced layer is rebuilt. ``done``
    maps ``id`` of every node seen to what replaces it, so a layer shared
    between two places is visited once and replaced in both, and cycles end.
    """
    if id(node) in done:
        return done[id(node)]
    if isinstance(node, nnx.Linear):
        done[id(node)] = visit(path, node)
        return done[id(node)]
    if isinstance(node, nnx.Variable):
        return node
    # nnx.List and nnx.Dict are Modules too; index them, not their attributes.
    if isinstance(node, (MutableSequence, MutableMapping)):
        done[id(node)] = node
        items = enumerate(list(node)) if isinstance(node, MutableSequence) else list(node.items())
        for key, child in items:
            new = _rewrite(child, (*path, key), visit, done)
            if new is not child:
                node[key] = new
        return node
    if isinstance(node, tuple):
        done[id(node)] = node
        children = [_rewrite(c, (*path, i), visit, done) for i, c in enumerate(node)]
        if all(new is old for new, old in zip(children, node)):
            return node
        new_tuple = type(node)(*children) if hasattr(node, "_fields") else type(node)(children)
        done[id(node)] = new_tuple
        return new_tuple
    if isinstance(node, nnx.Pytree):
        done[id(node)] = node
        for name, child in list(vars(node).items()):
            if name.startswith("_pytree__"):  # nnx's own bookkeeping
                continue
            new = _rewrite(child, (*path, name), visit, done)
            if new is not child:
                setattr(node, name, new)
        return node
    return node


def _find_linears(model: Any) -> list[tuple[Path, nnx.Linear]]:
    found: list[tuple[Path, nnx.Linear]] = []

    def record(path, linear):
        found.append((path, linear))
        return linear

    _rewrite(model, (), record, {})
    return found


def _progress_bar(total: int, progress: bool | None):
    show = total >= PROGRESS_MIN_LAYERS if progress is None else progress
    if not show:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        if progress:
            raise ImportError("quantize_model(progress=True) needs tqdm: "
                              "pip install tqdm") from None
        return None
    # disable=None: tqdm turns itself off when stderr is not a terminal (a log
    # file or a pipe), where a bar would print as garbled lines.
    return tqdm(total=total, desc="quantize_model", unit="layer",
                disable=None if progress is None else False)


def quantize_model(
    model: Any,
    *,
    group_size: int = 128,
    filter: Callable[[Path, nnx.Linear], bool] | None = None,
    progress: bool | None = None,
    summary: bool = False,
):
    """Replaces every ``nnx.Linear`` in ``model`` by a :class:`MarlinLinear`, in place.

    Walks modules, ``nnx.List``/``nnx.Dict`` and plain lists, dicts and tuples
    held as data. A layer reachable from several places is quantized once and
    replaced everywhere.

    Args:
      model: an ``nnx.Module`` (or any graph of them).
      group_size: 32, 64, 128 or -1, passed to :func:`jax_marlin.quantize`.
      filter: ``filter(path, linear) -> bool`` picks the layers to quantize,
        ``path`` being the tuple of attribute names / indices from ``model``
        (e.g. ``("blocks", 0, "mlp", "up")``); ``None`` picks all.
      progress: a tqdm progress bar; ``None`` shows one from 8 layers up when
        stderr is a terminal.
      summary: also return a :class:`QuantizeSummary`.

    Returns:
      ``model`` (the same object; a new ``MarlinLinear`` if ``model`` itself is
      an ``nnx.Linear``), or ``(model, summary)`` with ``summary=True``. The
      summary is also logged at INFO level to ``jax_marlin.flax.nnx``.

    Each layer runs in its own dtype when that is float16 or bfloat16
    (``jax_marlin.flax.matmul_dtype``). Shapes the kernel does not take as
    they are are padded (``jax_marlin.padded_shape``; listed in the summary). A picked
    layer too large for the kernel even so, or a subclass of ``nnx.Linear``
    (its ``__call__`` may do more than a matmul), stays as it is; one warning
    lists all such layers with their shapes and the reason.

    Traceable: ``nnx.eval_shape(lambda: quantize_model(Model(rngs=nnx.Rngs(0))))``
    gives the abstract quantized model without allocating any weight.
    """
    shapes.check_group_size(group_size)
    replaced: list[QuantizedLayer] = []
    skipped: list[SkippedLayer] = []
    excluded: list[Path] = []
    new_layers: dict[int, MarlinLinear] = {}

    found = _find_linears(model)
    bar = _progress_bar(len(found), progress)
    try:
        for path, linear in found:
            k, n = linear.in_features, linear.out_features
            if filter is not None and not filter(path, linear):
                excluded.append(path)
            elif type(linear) is not nnx.Linear:
                skipped.append(SkippedLayer(path, k, n, f"{type(linear).__name__} is a subclass "
                                            f"of nnx.Linear; its __call__ may do more than x @ W"))
            else:
                try:
                    shapes.padded_shape(k, n, group_size)
                except ValueError as e:
                    skipped.append(SkippedLayer(path, k, n, str(e)))
                else:
                    layer = MarlinLinear.from_linear(linear, group_size=group_size)
                    new_layers[id(linear)] = layer
                    w = layer.weight.get_value()
                    replaced.append(QuantizedLayer(path, k, n, _nbytes(linear.kernel.get_value()),
                                                   w.nbytes, w.k_pad, w.n_pad))
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()

    model = _rewrite(model, (), lambda path, linear: new_layers.get(id(linear), linear), {})

    result = QuantizeSummary(group_size, tuple(replaced), tuple(skipped), tuple(excluded))
    if skipped:
        listing = "\n".join(f"  {_path_str(s.path)}: kernel [{s.k}, {s.n}]: {s.reason}"
                            for s in skipped)
        warnings.warn(f"quantize_model kept {len(skipped)} nnx.Linear layer(s) in float:\n"
                      f"{listing}", stacklevel=2)
    _log.info("%s", result)
    return (model, result) if summary else model
