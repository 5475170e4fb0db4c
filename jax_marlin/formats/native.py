"""Marlin weights in a safetensors file of their own: quantize or import once, load fast.

The file holds, for each layer ``<name>``, the packed arrays as they are
(``<name>.qweight`` int32 ``[..., k_pad / 16, 2 n_pad]`` and ``<name>.scales``
float16 or bfloat16 ``[..., groups, n_pad]``; for weights that have them
``<name>.zeros`` int32 ``[..., groups, n_pad / 8]`` and ``<name>.perm`` int32
``[..., k]``), and in the safetensors metadata
``jax_marlin.layers``, a JSON object ``{name: {"k", "n", "group_size"}}`` of
the static fields, with ``jax_marlin.version``. Loading needs no conversion:
the arrays are the kernel's. (Version 2 files stored the zero points
unpacked, uint8 ``[..., groups, n_pad]`` in natural column order; they are
packed on load.)
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

import jax_marlin as jm
from jax_marlin.formats._io import safetensors
from jax_marlin.packing import _check_weight, _pack_zeros

__all__ = ["load", "save"]

# Version 2 added zeros (uint8, natural order) and perm, version 3 stores the
# zero points packed as the kernels read them; versions 1 (qweight and scales
# only) and 2 still load.
_VERSION = "3"
_READS = ("1", "2", _VERSION)
_OPTIONAL = ("perm", "zeros")
_LAYERS = "jax_marlin.layers"
_VERSION_KEY = "jax_marlin.version"


def save(path, weights: Mapping[str, jm.MarlinWeight]) -> None:
    """Writes ``{name: MarlinWeight}`` to one safetensors file at ``path``.

    The arrays are copied to host memory as they are (a sharded weight is
    gathered); :func:`load` gives them back bit for bit.
    """
    _, save_file = safetensors()
    tensors: dict[str, np.ndarray] = {}
    layers = {}
    for name, w in weights.items():
        if not isinstance(w, jm.MarlinWeight):
            raise TypeError(f"weights[{name!r}] is a {type(w).__name__}, expected a MarlinWeight")
        tensors[f"{name}.qweight"] = np.asarray(w.qweight)
        tensors[f"{name}.scales"] = np.asarray(w.scales)
        for field in _OPTIONAL:
            if getattr(w, field) is not None:
                tensors[f"{name}.{field}"] = np.asarray(getattr(w, field))
        layers[name] = {"k": w.k, "n": w.n, "group_size": w.group_size}
    save_file(tensors, str(path), metadata={_LAYERS: json.dumps(layers),
                                            _VERSION_KEY: _VERSION})


def load(path) -> dict[str, jm.MarlinWeight]:
    """Reads a file written by :func:`save`: ``{name: MarlinWeight}``, arrays on the default device.

    Raises ``ValueError`` for a safetensors file that :func:`save` did not
    write (no ``jax_marlin.layers`` metadata), of a newer version, or whose
    arrays do not match the recorded shapes.
    """
    safe_open, _ = safetensors()
    with safe_open(str(path), framework="numpy") as f:
        metadata = f.metadata() or {}
        if _LAYERS not in metadata:
            raise ValueError(f"{path} has no {_LAYERS} metadata: not written by "
                             f"jax_marlin.formats.save (for GPTQ, AWQ or compressed-tensors "
                             f"checkpoints use load_checkpoint)")
        if metadata.get(_VERSION_KEY) not in _READS:
            raise ValueError(f"{path}: {_VERSION_KEY} = {metadata.get(_VERSION_KEY)!r}, "
                             f"this jax_marlin reads versions {', '.join(_READS)}")
        keys = set(f.keys())
        weights = {}
        for name, static in json.loads(metadata[_LAYERS]).items():
            qweight = f.get_tensor(f"{name}.qweight")
            scales = f.get_tensor(f"{name}.scales")
            _check(name, qweight, scales, **static)
            optional = {field: jnp.asarray(f.get_tensor(f"{name}.{field}"))
                        for field in _OPTIONAL if f"{name}.{field}" in keys}
            if metadata[_VERSION_KEY] == "2" and "zeros" in optional:
                optional["zeros"] = _pack_version_2_zeros(name, optional["zeros"], scales.shape)
            w = jm.MarlinWeight(jnp.asarray(qweight), jnp.asarray(scales), **static, **optional)
            if qweight.ndim == 2:  # a single weight: the same checks as every jm function's
                try:
                    _check_weight(w)
                except (ValueError, TypeError) as e:
                    raise ValueError(f"{path}: layer {name!r}: {e}") from None
            weights[name] = w
    return weights


def _check(name: str, qweight: np.ndarray, scales: np.ndarray, k: int, n: int,
           group_size: int) -> None:
    k_pad, n_pad = jm.padded_shape(k, n, group_size)
    groups = 1 if group_size == -1 else k_pad // group_size
    if qweight.dtype != np.int32 or qweight.shape[-2:] != (k_pad // 16, 2 * n_pad):
        raise ValueError(f"{name}.qweight: {qweight.dtype}{list(qweight.shape)}, expected int32 "
                         f"[..., {k_pad // 16}, {2 * n_pad}] for [k, n] = [{k}, {n}]")
    expected = (*qweight.shape[:-2], groups, n_pad)
    if scales.shape != expected:
        raise ValueError(f"{name}.scales.shape = {list(scales.shape)}, expected {list(expected)} "
                         f"for [k, n] = [{k}, {n}], group_size = {group_size}")


def _pack_version_2_zeros(name: str, zeros, scales_shape) -> jnp.ndarray:
    """Version 2's uint8 ``[..., groups, n_pad]`` zero points (natural order) -> int32 packed."""
    if zeros.dtype != jnp.uint8 or zeros.shape != tuple(scales_shape):
        raise ValueError(f"{name}.zeros: {zeros.dtype}{list(zeros.shape)}, expected uint8"
                         f"{list(scales_shape)} (the scales' shape) in a version 2 file")
    flat = zeros.reshape(-1, zeros.shape[-1])
    return _pack_zeros(flat).reshape(*zeros.shape[:-1], zeros.shape[-1] // 8)
