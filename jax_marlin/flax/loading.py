"""Flax NNX: put loaded Marlin weights into a model, ``load_quantized``, and take
them out of one, ``quantized_weights``.

    weights = jax_marlin.formats.load_checkpoint("Llama-3-8B-GPTQ")
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))   # allocates nothing
    load_quantized(model, weights, name_map=lambda path: "model." + path)

Each ``nnx.Linear`` whose name is in ``weights`` becomes a
:class:`~jax_marlin.flax.MarlinLinear` holding that weight; nothing is
quantized here and the float kernel is never read, so the model may be an
abstract one from ``nnx.eval_shape``. ``quantized_weights`` is the way back: a
model quantized once (``quantize_model``, ``gptq_blocks``) gives its weights
to :func:`jax_marlin.formats.save` or
:func:`jax_marlin.formats.save_gptq_checkpoint`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from flax import nnx

from jax_marlin import MarlinWeight
from jax_marlin.flax.nnx import MarlinLinear, QuantizedWeight, _find_linears, _rewrite

__all__ = ["load_quantized", "quantized_weights"]


def load_quantized(model: Any, weights: Mapping[str, MarlinWeight], *,
                   name_map: Callable[[str], str | None] | None = None) -> Any:
    """Replaces the model's ``nnx.Linear`` layers by ``MarlinLinear`` layers holding ``weights``.

    Args:
      model: an ``nnx.Module`` (or any graph of them), concrete or abstract.
      weights: ``{name: MarlinWeight}``, each ``[in_features, out_features]``
        (from :func:`jax_marlin.formats.load_checkpoint` or
        :func:`jax_marlin.formats.load`).
      name_map: ``name_map(path) -> name`` gives the name in ``weights`` of the
        layer at ``path``, the model path joined with dots
        (``"layers.0.mlp.up_proj"``), or ``None`` to keep that layer in float
        (e.g. an ``lm_head`` the checkpoint did not quantize). Default: the
        path itself.

    Returns:
      ``model``, changed in place (a new ``MarlinLinear`` if ``model`` itself
      is an ``nnx.Linear``).

    Every layer keeps its bias (an ``nnx.Param``, loaded with the other float
    parameters as usual), ``dtype`` and ``param_dtype``; its matmul runs in the
    dtype of the loaded weight's scales. Raises one ``ValueError`` listing
    every problem: a layer whose name is not in ``weights``, a name in
    ``weights`` no layer maps to, a weight whose ``[k, n]`` is not the
    layer's ``[in_features, out_features]``, or a subclass of ``nnx.Linear``
    (its ``__call__`` may do more than a matmul).
    """
    name_map = name_map or (lambda path: path)
    new_layers: dict[int, MarlinLinear] = {}
    used: set[str] = set()
    problems: list[str] = []
    for path, linear in _find_linears(model):
        path_str = ".".join(str(p) for p in path)
        name = name_map(path_str)
        if name is None:
            continue
        if name not in weights:
            problems.append(f"{path_str}: no weight {name!r}")
            continue
        used.add(name)
        w = weights[name]
        shape = (linear.in_features, linear.out_features)
        if type(linear) is not nnx.Linear:
            problems.append(f"{path_str}: a {type(linear).__name__}, a subclass of nnx.Linear "
                            f"whose __call__ may do more than x @ W")
        elif not isinstance(w, MarlinWeight):
            problems.append(f"{path_str}: weights[{name!r}] is a {type(w).__name__}, "
                            f"not a MarlinWeight")
        elif w.shape != shape:
            problems.append(f"{path_str}: [in_features, out_features] = {list(shape)}, but "
                            f"weights[{name!r}] is [k, n] = {list(w.shape)}")
        else:
            new_layers[id(linear)] = _marlin_linear(linear, w)
    problems += [f"weights[{name!r}]: no layer maps to it" for name in weights
                 if name not in used]
    if problems:
        raise ValueError("load_quantized:\n  " + "\n  ".join(problems))
    return _rewrite(model, (), lambda path, linear: new_layers.get(id(linear), linear), {})


def _marlin_linear(linear: nnx.Linear, w: MarlinWeight) -> MarlinLinear:
    """A ``MarlinLinear`` with ``linear``'s configuration and bias, holding ``w``."""
    # Built abstract (MarlinLinear would draw and quantize a kernel), then given its arrays.
    layer = nnx.eval_shape(lambda: MarlinLinear(
        linear.in_features, linear.out_features, use_bias=linear.use_bias, dtype=linear.dtype,
        param_dtype=linear.param_dtype, group_size=w.group_size, rngs=nnx.Rngs(0)))
    # Keep nnx.with_partitioning annotations of the float kernel, as from_linear does.
    sharding = linear.kernel.get_metadata().get("out_sharding")
    metadata = {"out_sharding": sharding} if sharding else {}
    layer.weight = QuantizedWeight(w, eager_sharding=False, **metadata)
    if linear.use_bias:
        layer.bias = linear.bias  # the same nnx.Param, with its value and annotations
    return layer


def quantized_weights(model: Any) -> dict[str, MarlinWeight]:
    """``{name: MarlinWeight}`` of every :class:`~jax_marlin.flax.MarlinLinear` in ``model``.

    The names are the layers' model paths joined with dots
    (``"layers.0.mlp.up_proj"``), the names :func:`load_quantized` looks up by
    default, so ``load_quantized(float_model, quantized_weights(model))``
    rebuilds ``model``'s quantized layers in another instance. A layer shared
    between two places is listed once, under its first path.
    """
    weights: dict[str, MarlinWeight] = {}
    seen: set[int] = set()
    for path, node in nnx.iter_graph(model):
        if isinstance(node, MarlinLinear) and id(node) not in seen:
            seen.add(id(node))
            weights[".".join(str(p) for p in path)] = node.weight.get_value()
    return weights
