"""Which dtype a Flax layer's 4-bit matmul runs in, shared by the nnx and linen layers."""

from __future__ import annotations

from typing import Any

import numpy as np

from jax_marlin import shapes


def matmul_dtype(dtype: Any, param_dtype: Any) -> np.dtype:
    """The dtype of a layer's scales, and so of its matmul's input and output.

    ``dtype`` (the layer's computation dtype) if it is float16 or bfloat16,
    else ``param_dtype`` if it is, else float16: a bfloat16 model stays
    bfloat16, a float32 one runs in float16 (the kernel has no float32 path).
    """
    for d in (dtype, param_dtype):
        if d is not None and np.dtype(d) in shapes.DTYPES:
            return np.dtype(d)
    return np.dtype(np.float16)
