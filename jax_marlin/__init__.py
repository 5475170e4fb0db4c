"""jax-marlin: the Marlin FP16xINT4 GEMM for JAX.

    import jax_marlin as jm
    w = jm.quantize(weight, group_size=128)   # weight [k, n] float -> 4 bits, float16 scales
    y = jm.matmul(x, w, bias=b)               # x [..., k] float16 -> [..., n] float16
    wqkv = jm.concatenate([wq, wk, wv])       # [k, n_i] -> [k, sum n_i]: one call for three
    y = jm.post_attention(a, x, wo, wgate_up, wdown, norm_scale)  # o, RMSNorm, MLP: one op
"""

from jax_marlin import reference
from jax_marlin._ffi import HAS_CUDA
from jax_marlin.chain import post_attention
from jax_marlin.ops import matmul
from jax_marlin.packing import (MarlinWeight, concatenate, dequantize, pack, permute_columns,
                                quantize, unpack)
from jax_marlin.partitioning import shard_weight, weight_spec_tree, weight_specs
from jax_marlin.shapes import GROUP_SIZES, padded_shape

__version__ = "0.1.0"

__all__ = [
    "GROUP_SIZES",
    "HAS_CUDA",
    "MarlinWeight",
    "concatenate",
    "dequantize",
    "matmul",
    "pack",
    "padded_shape",
    "permute_columns",
    "post_attention",
    "quantize",
    "reference",
    "shard_weight",
    "unpack",
    "weight_spec_tree",
    "weight_specs",
]
