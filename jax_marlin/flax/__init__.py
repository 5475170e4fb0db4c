"""Flax layers for jax-marlin: 4-bit weights in NNX and Linen models.

    from jax_marlin.flax import MarlinLinear, quantize_model      # flax.nnx
    from jax_marlin.flax import MarlinDense, params_to_marlin     # flax.linen

NNX (:mod:`jax_marlin.flax.nnx`): ``MarlinLinear`` keeps its packed
``MarlinWeight`` in a :class:`QuantizedWeight` variable (not an ``nnx.Param``);
``quantize_model`` swaps every fitting ``nnx.Linear`` of a model for one;
``load_quantized`` does so with weights loaded by :mod:`jax_marlin.formats`
(``quantized_weights`` takes them out of a quantized model, to save);
``concatenate_linears`` joins layers that share their input into one.

Linen (:mod:`jax_marlin.flax.linen`): ``MarlinDense`` keeps its packed weight
in the ``"marlin"`` collection; ``dense_to_marlin`` / ``params_to_marlin``
convert float ``nn.Dense`` params.

Needs ``flax`` (and ``tqdm`` for the progress bar of ``quantize_model``); the
core ``jax_marlin`` package does not import this subpackage.
"""

from jax_marlin.flax._dtypes import matmul_dtype
from jax_marlin.flax.linen import MARLIN_COLLECTION, MarlinDense, dense_to_marlin, params_to_marlin
from jax_marlin.flax.loading import load_quantized, quantized_weights
from jax_marlin.flax.nnx import (
    MarlinLinear,
    QuantizedLayer,
    QuantizedWeight,
    QuantizeSummary,
    SkippedLayer,
    concatenate_linears,
    get_partition_spec,
    quantize_model,
)

__all__ = [
    "MARLIN_COLLECTION",
    "MarlinDense",
    "MarlinLinear",
    "QuantizeSummary",
    "QuantizedLayer",
    "QuantizedWeight",
    "SkippedLayer",
    "concatenate_linears",
    "dense_to_marlin",
    "get_partition_spec",
    "load_quantized",
    "matmul_dtype",
    "params_to_marlin",
    "quantize_model",
    "quantized_weights",
]
