"""Flax Linen: ``MarlinDense``, a 4-bit ``nn.Dense``, and converters for ``nn.Dense`` params.

Variables of a ``MarlinDense`` named ``"proj"``::

    {"params": {"proj": {"bias": [n]}},                  # trainable floats only
     "marlin": {"proj": {"weight": MarlinWeight(k, n)}}}  # packed, not trainable

The packed weight lives in its own collection, ``"marlin"``, so an optimizer
over ``variables["params"]`` never sees integers, and ``apply`` needs
``{"params": ..., "marlin": ...}``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax_marlin import shapes
from jax_marlin.flax._dtypes import matmul_dtype
from jax_marlin.packing import MarlinWeight, quantize
from jax_marlin.ops import matmul

__all__ = ["MARLIN_COLLECTION", "MarlinDense", "dense_to_marlin", "params_to_marlin"]

#: The collection holding every ``MarlinDense``'s packed ``weight``.
MARLIN_COLLECTION = "marlin"

Path = tuple[str, ...]


class MarlinDense(nn.Module):
    """``y [..., features] = x [..., k] @ W + bias`` with a 4-bit ``W``, like ``nn.Dense``.

    At ``init`` the float kernel ``[k, features]`` is drawn with ``kernel_init``
    from the ``"params"`` rng (the same draw as ``nn.Dense``) and quantized
    (padded if the kernel does not take its shape as it is); the
    ``MarlinWeight`` is stored as ``variables["marlin"][...]["weight"]``.

    The matmul runs in the dtype of the weight's scales, at ``init``
    ``jax_marlin.flax.matmul_dtype(dtype, param_dtype)`` (float16 or
    bfloat16); inputs and the bias are cast to it and the bias is added inside
    the kernel, before its one rounding.

    Attributes:
      features: n; ``k = x.shape[-1]`` (half of it with ``swiglu``).
      use_bias: add a bias ``[features]``, a ``"params"`` variable in ``param_dtype``.
      dtype: dtype of the result, and of the matmul when float16 or bfloat16;
        ``None`` returns the dtype of ``x``.
      param_dtype: dtype the float kernel is drawn in, and of the bias.
      group_size: 32, 64 or 128 (one scale per that many rows of k) or -1 (one
        per column).
      kernel_init: initializer for the float kernel.
      bias_init: initializer for the bias.

    Differentiable with respect to ``x`` and the bias; the packed weight (in
    the ``"marlin"`` collection) is frozen: differentiate ``"params"`` only.
    """

    features: int
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    group_size: int = 128
    kernel_init: Callable[..., Any] = nn.initializers.lecun_normal()  # as nn.Dense
    bias_init: Callable[..., Any] = nn.initializers.zeros_init()

    @nn.compact
    def __call__(self, inputs: jax.Array, *, residual: jax.Array | None = None,
                 rms_norm_weight: jax.Array | None = None, rms_norm_eps: float = 1e-6,
                 swiglu: bool = False) -> jax.Array:
        """``inputs [..., k]`` float -> ``[..., features]`` in ``dtype``.

        ``residual [..., features]``, ``rms_norm_weight [k]``, ``rms_norm_eps``
        and ``swiglu`` (``inputs [..., 2 k]``, gate then up; the layer's k is
        half their width) are :func:`jax_marlin.matmul`'s fusions, run in the
        weight's dtype like ``inputs`` (the residual too: the sum is rounded to
        it before the cast to ``dtype``). A layer is initialized with the
        ``swiglu`` it is applied with: its k comes from the inputs' width.
        """
        x = jnp.asarray(inputs)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"inputs.dtype is {x.dtype}; MarlinDense takes floating-point inputs")
        k = x.shape[-1]
        if swiglu:
            if k % 2:
                raise ValueError(f"swiglu=True takes inputs [..., 2 k] (gate then up), got an odd "
                                 f"last dimension {k}")
            k //= 2
        shapes.padded_shape(k, self.features, self.group_size)

        def init_weight():
            kernel = self.kernel_init(self.make_rng("params"), (k, self.features),
                                      self.param_dtype)
            return quantize(kernel, group_size=self.group_size,
                            dtype=matmul_dtype(self.dtype, self.param_dtype))

        weight = self.variable(MARLIN_COLLECTION, "weight", init_weight).value
        if not isinstance(weight, MarlinWeight):
            raise TypeError(f"variables['{MARLIN_COLLECTION}'] of {self.name} hold a "
                            f"{type(weight).__name__} as 'weight', expected a MarlinWeight")
        if weight.n != self.features:
            raise ValueError(f"the MarlinWeight has n = {weight.n} columns, but features = "
                             f"{self.features}")
        out_dtype = x.dtype if self.dtype is None else jnp.dtype(self.dtype)
        bias = None
        if self.use_bias:
            bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype)
            bias = bias.astype(weight.dtype)
        residual, rms_norm_weight = (None if a is None else jnp.asarray(a).astype(weight.dtype)
                                     for a in (residual, rms_norm_weight))
        y = matmul(x.astype(weight.dtype), weight, bias=bias, residual=residual,
                   rms_norm_weight=rms_norm_weight, rms_norm_eps=rms_norm_eps, swiglu=swiglu)
        return y.astype(out_dtype)


def _is_dense(tree: Any) -> bool:
    return (isinstance(tree, Mapping) and "kernel" in tree and set(tree) <= {"kernel", "bias"}
            and getattr(tree["kernel"], "ndim", None) == 2)


def dense_to_marlin(params: Mapping[str, Any], *, group_size: int = 128,
                    dtype: Any = None) -> dict[str, Any]:
    """Converts one ``nn.Dense``'s params to a ``MarlinDense``'s variables.

    Args:
      params: ``{"kernel": [k, n], "bias": [n]}`` (``"bias"`` optional).
      group_size: 32, 64, 128 or -1.
      dtype: float16 or bfloat16, the dtype the layer's matmul will run in;
        ``None``: the kernel's dtype if it is one of these, else float16.

    Returns:
      ``{"params": {"bias": [n]}, "marlin": {"weight": MarlinWeight}}``
      (``"params"`` is ``{}`` without a bias). Traceable.
    """
    if not _is_dense(params):
        keys = sorted(params) if isinstance(params, Mapping) else type(params).__name__
        raise ValueError(f"params must be an nn.Dense's {{'kernel': [k, n], 'bias': [n]}}, "
                         f"got {keys}")
    out: dict[str, Any] = {"params": {}, MARLIN_COLLECTION: {
        "weight": quantize(params["kernel"], group_size=group_size, dtype=dtype)}}
    if "bias" in params:
        out["params"]["bias"] = params["bias"]
    return out


def params_to_marlin(
    params: Mapping[str, Any],
    *,
    group_size: int = 128,
    dtype: Any = None,
    filter: Callable[[Path, Mapping[str, Any]], bool] | None = None,
) -> dict[str, Any]:
    """Converts every ``nn.Dense`` in a nested ``params`` tree for ``MarlinDense``.

    A Dense is a dict holding a 2-D ``"kernel"`` and at most a ``"bias"``.
    Selected ones (``filter(path, dense_params)``, all if ``None``) move their
    kernel, quantized, to ``"marlin"``; everything else stays in ``"params"``
    unchanged. The model applying the result must have a ``MarlinDense`` at
    each converted path: give layers explicit names, since auto-names differ
    (``Dense_0`` vs ``MarlinDense_0``).

    Args:
      params: ``variables["params"]`` of a float model.
      group_size: 32, 64, 128 or -1.
      dtype: the dtype of the scales (float16 or bfloat16); ``None``: each
        kernel's dtype if it is one of these, else float16.
      filter: picks layers by their path (tuple of names) and params.

    Returns:
      ``{"params": ..., "marlin": ...}``, both trees nested like ``params``.

    Shapes the kernel does not take as they are are padded. Raises
    ``ValueError`` naming every selected layer it cannot take even so (too
    large; exclude them with ``filter``): unlike nnx, the linen module code
    fixes which layers are ``MarlinDense``, so a layer cannot quietly stay
    float. Traceable: ``jax.eval_shape(params_to_marlin, params)`` allocates nothing.
    """
    shapes.check_group_size(group_size)
    selected: set[Path] = set()
    unfit: list[str] = []

    def find(tree, path):
        if _is_dense(tree):
            if filter is None or filter(path, tree):
                k, n = tree["kernel"].shape
                try:
                    shapes.padded_shape(k, n, group_size)
                except ValueError as e:
                    unfit.append(f"  {'/'.join(path)}: kernel [{k}, {n}]: {e}")
                selected.add(path)
        elif isinstance(tree, Mapping):
            for key, child in tree.items():
                find(child, (*path, key))

    find(params, ())
    if unfit:
        raise ValueError("params_to_marlin: the Marlin kernel cannot take these layers "
                         "(leave them out with filter):\n" + "\n".join(unfit))
    if not selected:
        warnings.warn("params_to_marlin found no nn.Dense params to convert", stacklevel=2)

    def convert(tree, path):
        if path in selected:
            return dense_to_marlin(tree, group_size=group_size, dtype=dtype)
        out: dict[str, Any] = {"params": {}, MARLIN_COLLECTION: {}}
        if not isinstance(tree, Mapping):
            out["params"] = tree
            return out
        for key, child in tree.items():
            sub = convert(child, (*path, key))
            out["params"][key] = sub["params"]
            if sub[MARLIN_COLLECTION]:
                out[MARLIN_COLLECTION][key] = sub[MARLIN_COLLECTION]
        return out

    return convert(params, ())
