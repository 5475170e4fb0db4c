"""Quantized checkpoint directories (config.json + safetensors shards) <-> Marlin weights.

The directory is what ``save_pretrained`` of transformers writes for a GPTQ,
AWQ or compressed-tensors model: ``config.json`` whose ``quantization_config``
names the method and its settings, and one or more ``*.safetensors`` files. A
quantized linear layer is the group of tensors ``<layer>.<suffix>`` the
method stores (``<layer>.qweight``, ``<layer>.qzeros``, ... for GPTQ); a
layer's tensors may lie in different files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jax_marlin import MarlinWeight
from jax_marlin.formats._io import progress, safetensors
from jax_marlin.formats.awq import from_awq
from jax_marlin.formats.compressed_tensors import from_compressed_tensors
from jax_marlin.formats.gptq import from_gptq, to_gptq
from jax_marlin.shapes import num_groups

__all__ = ["load_checkpoint", "save_gptq_checkpoint"]

_CONFIG = "quantization_config"
_REQUIRED = object()


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How a method stores one quantized linear layer.

    ``convert(tensors)`` takes the layer's tensors keyed by suffix (``".qweight"``).
    """

    marker: str  # the suffix that makes a layer: "<layer><marker>" exists for every layer
    required: tuple[str, ...]  # suffixes every layer has, the marker first
    optional: tuple[str, ...]
    convert: Callable[[dict[str, np.ndarray]], MarlinWeight]


def load_checkpoint(path) -> dict[str, MarlinWeight]:
    """Reads every quantized linear layer of a checkpoint directory into Marlin's layout.

    Args:
      path: a directory with ``config.json`` and ``*.safetensors`` files.
        ``config.json`` holds ``quantization_config`` with ``quant_method``
        ``"gptq"`` (``bits``, ``group_size``, ``sym``; the v1
        ``checkpoint_format``), ``"awq"`` (``bits``/``w_bit``,
        ``group_size``/``q_group_size``, ``zero_point``, ``version`` "gemm")
        or ``"compressed-tensors"`` (``config_groups`` of 4-bit integer
        weight-only schemes in the ``pack-quantized`` ``format``).

    Returns:
      ``{layer name: MarlinWeight}``, the names those of the checkpoint
      without the suffix (``"model.layers.0.mlp.up_proj"``), each weight
      ``[k, n]`` (input x output features). Other tensors (embeddings, norms,
      biases, layers left in float) are not read; read them with safetensors.

    The files are opened lazily (memory-mapped) and read one layer at a time,
    file by file, with a progress bar on a terminal. Raises ``ValueError`` for
    an unsupported configuration (naming the ``quantization_config`` key and
    its value) or a layer with missing or mis-shaped tensors (naming the
    layer), ``FileNotFoundError`` without ``config.json`` or safetensors
    files. Asymmetric zero points and act-order are imported exactly
    (``MarlinWeight.zeros``, ``MarlinWeight.perm``).
    """
    path = pathlib.Path(path)
    layout = _layout(_read_quantization_config(path))
    safe_open, _ = safetensors()
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {path}")
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(f), framework="numpy")) for f in files]
        where: dict[str, int] = {}  # tensor name -> index of the file holding it
        for i, handle in enumerate(handles):
            for key in handle.keys():  # from the header: no tensor is read yet
                if key in where:
                    raise ValueError(f"tensor {key!r} is in both {files[where[key]].name} "
                                     f"and {files[i].name}")
                where[key] = i
        layers = _find_layers(where, layout, path)
        weights = {}
        for name in progress(layers, len(layers), "load_checkpoint"):
            tensors = {suffix: handles[where[name + suffix]].get_tensor(name + suffix)
                       for suffix in layout.required + layout.optional if name + suffix in where}
            try:
                weights[name] = layout.convert(tensors)
            except (ValueError, TypeError) as e:
                raise type(e)(f"layer {name!r}: {e}") from e
    return weights


def save_gptq_checkpoint(path, weights: Mapping[str, MarlinWeight],
                         config: Mapping[str, Any] | None = None) -> None:
    """Writes ``{layer name: MarlinWeight}`` as a GPTQ (v1) checkpoint directory.

    Args:
      path: the directory, created if needed. It receives ``model.safetensors``
        (per layer ``<name>.qweight``, ``.qzeros``, ``.scales``, ``.g_idx``:
        :func:`~jax_marlin.formats.to_gptq`) and ``config.json``.
      weights: the quantized layers, each ``[k, n]`` (input x output
        features, ``k`` a multiple of 8), all with one group size.
      config: the model's own configuration (transformers' ``config.json``
        keys), written with ``quantization_config`` set to ``{"quant_method":
        "gptq", "bits": 4, "group_size", "desc_act", "sym",
        "checkpoint_format": "gptq"}``: ``sym`` when no layer has zero
        points, ``desc_act`` when one has act-order.

    :func:`load_checkpoint` gives the weights back with the same 4-bit values,
    scales, zero points and row order, so a model quantized once (e.g. by
    :mod:`jax_marlin.gptq`) runs the same after the round trip. The model's
    float tensors (embeddings, norms, layers left in float) are the caller's
    to save; any other ``*.safetensors`` file in the directory is read too.
    Raises ``ValueError`` for mixed group sizes or a ``k`` that GPTQ cannot
    pack, naming the layers.
    """
    _, save_file = safetensors()
    if not weights:
        raise ValueError("save_gptq_checkpoint: no weights to save")
    for name, w in weights.items():
        if not isinstance(w, MarlinWeight):
            raise TypeError(f"weights[{name!r}] is a {type(w).__name__}, expected a MarlinWeight")
    group_sizes = {w.group_size for w in weights.values()}
    if len(group_sizes) > 1:
        by_size = {g: [name for name, w in weights.items() if w.group_size == g]
                   for g in sorted(group_sizes)}
        raise ValueError("save_gptq_checkpoint: a GPTQ checkpoint has one group_size, the "
                         f"weights have {sorted(group_sizes)}: " +
                         "; ".join(f"{g}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
                                   for g, names in by_size.items()))
    tensors: dict[str, np.ndarray] = {}
    for name, w in progress(weights.items(), len(weights), "save_gptq_checkpoint"):
        try:
            layer = to_gptq(w)
        except ValueError as e:
            raise ValueError(f"layer {name!r}: {e}") from e
        tensors.update({f"{name}.{key}": value for key, value in layer.items()})
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    quantization = {"quant_method": "gptq", "bits": 4,
                    "group_size": group_sizes.pop(),
                    "desc_act": any(w.perm is not None for w in weights.values()),
                    "sym": all(w.zeros is None for w in weights.values()),
                    "checkpoint_format": "gptq"}
    (path / "config.json").write_text(json.dumps({**(config or {}), _CONFIG: quantization},
                                                 indent=2) + "\n")


def _find_layers(where: dict[str, int], layout: _Layout, path: pathlib.Path) -> list[str]:
    """The layer names, in file order; raises listing every layer that lacks a tensor."""
    layers = sorted((key[:-len(layout.marker)] for key in where if key.endswith(layout.marker)),
                    key=lambda name: (where[name + layout.marker], name))
    if not layers:
        raise ValueError(f"no quantized layer in {path}: no tensor is named "
                         f"'<layer>{layout.marker}'")
    problems = [f"{name}: no {name}{suffix}" for name in layers for suffix in layout.required
                if name + suffix not in where]
    known = set(layers)
    problems += [f"{key[:-len(suffix)]}: {key} without {key[:-len(suffix)]}{layout.marker}"
                 for key in where for suffix in layout.required[1:]
                 if key.endswith(suffix) and key[:-len(suffix)] not in known]
    if problems:
        raise ValueError(f"missing tensors in {path}:\n  " + "\n  ".join(problems))
    return layers


def _read_quantization_config(path: pathlib.Path) -> dict[str, Any]:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: a quantized checkpoint directory "
                                f"has a config.json with a {_CONFIG}")
    config = json.loads(config_file.read_text())
    qc = config.get(_CONFIG)
    if not isinstance(qc, dict):
        raise ValueError(f"{config_file} has no {_CONFIG}: not a quantized checkpoint")
    return qc


def _layout(qc: dict[str, Any]) -> _Layout:
    method = qc.get("quant_method")
    readers = {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed_tensors}
    if method not in readers:
        raise ValueError(f"{_CONFIG}.quant_method = {method!r} is not supported; expected one "
                         f"of {', '.join(map(repr, readers))}")
    return readers[method](qc)


def _get(qc: dict[str, Any], *keys: str, default: Any = _REQUIRED, prefix: str = _CONFIG):
    """``(key, value)`` of the first of ``keys`` in ``qc``; raises naming them if none is."""
    for key in keys:
        if key in qc:
            return f"{prefix}.{key}", qc[key]
    if default is _REQUIRED:
        raise ValueError(f"{prefix} has no {' or '.join(keys)}")
    return f"{prefix}.{keys[0]}", default


def _check_bits(key: str, bits) -> None:
    if bits != 4:
        raise ValueError(f"{key} = {bits!r}: only 4-bit weights map onto the Marlin kernel")


def _check_group_size(key: str, group_size) -> int:
    if (isinstance(group_size, bool) or not isinstance(group_size, int)
            or not (group_size == -1 or (group_size > 0 and group_size % 32 == 0))):
        raise ValueError(f"{key} = {group_size!r}: the kernel takes groups of a multiple of 32 "
                         f"rows, or -1 (one scale per column)")
    return group_size


def _gptq(qc: dict[str, Any]) -> _Layout:
    _check_bits(*_get(qc, "bits"))
    group_size = _check_group_size(*_get(qc, "group_size"))
    _, sym = _get(qc, "sym", default=True)
    for key in ("checkpoint_format", "format"):
        if qc.get(key, "gptq") != "gptq":
            raise ValueError(f"{_CONFIG}.{key} = {qc[key]!r} is not supported; expected 'gptq' "
                             f"(the v1 layout)")
    if qc.get("dynamic"):
        raise ValueError(f"{_CONFIG}.dynamic is set: per-layer GPTQ settings are not supported")

    def convert(t):
        return from_gptq(t[".qweight"], t[".qzeros"], t[".scales"], t.get(".g_idx"),
                         group_size=group_size, sym=bool(sym))

    return _Layout(".qweight", (".qweight", ".qzeros", ".scales"), (".g_idx",), convert)


def _awq(qc: dict[str, Any]) -> _Layout:
    _check_bits(*_get(qc, "bits", "w_bit"))
    group_size = _check_group_size(*_get(qc, "group_size", "q_group_size"))
    key, version = _get(qc, "version", default="gemm")
    if str(version).lower() != "gemm":
        raise ValueError(f"{key} = {version!r} is not supported; expected 'gemm' (AutoAWQ's "
                         f"GEMM layout)")
    key, zero_point = _get(qc, "zero_point", default=True)
    if not zero_point:
        raise ValueError(f"{key} = {zero_point!r} is not supported: AWQ checkpoints carry "
                         f"zero points")

    def convert(t):
        return from_awq(t[".qweight"], t[".qzeros"], t[".scales"], group_size=group_size)

    return _Layout(".qweight", (".qweight", ".qzeros", ".scales"), (), convert)


def _compressed_tensors(qc: dict[str, Any]) -> _Layout:
    sparsity = qc.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise ValueError(f"{_CONFIG}.sparsity_config.format = {sparsity['format']!r} is not "
                         f"supported; expected a dense checkpoint")
    _, groups = _get(qc, "config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{_CONFIG}.config_groups = {groups!r}: expected a non-empty dict of "
                         f"quantization schemes")
    group_sizes = {_scheme_group_size(qc, name, scheme) for name, scheme in groups.items()}

    def convert(t):
        return from_compressed_tensors(
            t[".weight_packed"], t[".weight_scale"], t[".weight_shape"],
            t.get(".weight_zero_point"), t.get(".weight_g_idx"),
            group_size=_layer_group_size(group_sizes, t[".weight_shape"], t[".weight_scale"]))

    return _Layout(".weight_packed", (".weight_packed", ".weight_scale", ".weight_shape"),
                   (".weight_zero_point", ".weight_g_idx"), convert)


def _scheme_group_size(qc: dict[str, Any], name: str, scheme: dict[str, Any]) -> int:
    """The group size of one of ``config_groups``; raises unless it is 4-bit, weight-only, packed."""
    prefix = f"{_CONFIG}.config_groups.{name}"
    for key in ("input_activations", "output_activations"):
        if scheme.get(key):
            raise ValueError(f"{prefix}.{key} is set: only weight-only schemes (activations "
                             f"in float) map onto the kernel")
    key, fmt = _get(scheme, "format", default=None, prefix=prefix)
    if fmt is None:
        key, fmt = _get(qc, "format", default=None)
    if fmt != "pack-quantized":
        raise ValueError(f"{key} = {fmt!r} is not supported; expected 'pack-quantized'")
    _, weights = _get(scheme, "weights", prefix=prefix)
    prefix += ".weights"
    _check_bits(*_get(weights, "num_bits", prefix=prefix))
    key, kind = _get(weights, "type", default="int", prefix=prefix)
    if kind != "int":
        raise ValueError(f"{key} = {kind!r} is not supported; expected 'int'")
    key, dynamic = _get(weights, "dynamic", default=False, prefix=prefix)
    if dynamic:
        raise ValueError(f"{key} = {dynamic!r}: dynamic weight quantization is not supported")
    key, strategy = _get(weights, "strategy", prefix=prefix)
    if strategy == "channel":
        return -1
    if strategy != "group":
        raise ValueError(f"{key} = {strategy!r} is not supported; expected 'group' or 'channel'")
    return _check_group_size(*_get(weights, "group_size", prefix=prefix))


def _layer_group_size(group_sizes: set[int], weight_shape, weight_scale) -> int:
    """The group size of the config whose number of groups matches the layer's scales."""
    if len(group_sizes) == 1:
        return next(iter(group_sizes))
    k = int(np.asarray(weight_shape).reshape(-1)[-1])
    groups = np.asarray(weight_scale).shape[-1]
    fits = sorted(g for g in group_sizes if num_groups(k, g) == groups)
    if len(fits) != 1:
        raise ValueError(f"weight_scale has {groups} groups for k = {k}; the config_groups' group "
                         f"sizes {sorted(group_sizes)} give {'none' if not fits else fits}")
    return fits[0]
