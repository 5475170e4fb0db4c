"""Quantized checkpoints users already have, in Marlin's layout.

    from jax_marlin import formats
    weights = formats.load_checkpoint("Llama-3-8B-GPTQ")  # {layer name: MarlinWeight}
    formats.save("llama-marlin.safetensors", weights)     # once; then
    weights = formats.load("llama-marlin.safetensors")    # no conversion at all
    formats.save_gptq_checkpoint("out-gptq", weights)     # what GPTQ loaders read

One layer at a time: :func:`from_gptq` (GPTQ v1), :func:`from_awq` (AutoAWQ
GEMM) and :func:`from_compressed_tensors` (``pack-quantized``) take the
checkpoint's tensors as numpy arrays and return a ``[k, n]``
:class:`~jax_marlin.MarlinWeight` whose dequantized values are the format's own.
Symmetric and asymmetric 4-bit weights map exactly, act-order ones too
(``MarlinWeight.zeros`` and ``MarlinWeight.perm``; their cost in ``jm.matmul``);
:func:`to_gptq` is the way back to GPTQ's tensors.

Files need the ``safetensors`` package (``pip install jax-marlin[formats]``).
"""

from jax_marlin.formats.awq import from_awq
from jax_marlin.formats.checkpoint import load_checkpoint, save_gptq_checkpoint
from jax_marlin.formats.compressed_tensors import from_compressed_tensors
from jax_marlin.formats.gptq import from_gptq, to_gptq
from jax_marlin.formats.native import load, save

__all__ = [
    "from_awq",
    "from_compressed_tensors",
    "from_gptq",
    "load",
    "load_checkpoint",
    "save",
    "save_gptq_checkpoint",
    "to_gptq",
]
