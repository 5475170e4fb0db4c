"""The optional packages of checkpoint files in one place: safetensors and tqdm."""

from __future__ import annotations

from collections.abc import Iterable


def safetensors():
    """``(safe_open, save_file)`` of the safetensors package, numpy flavour.

    Raises an ``ImportError`` that says what to install when it is missing.
    """
    try:
        from safetensors import safe_open
        from safetensors.numpy import save_file
    except ImportError:
        raise ImportError("reading and writing checkpoints needs the safetensors package: "
                          "pip install safetensors (or jax-marlin[formats])") from None
    # safetensors hands BF16 tensors to numpy as the "bfloat16" dtype, which
    # exists only once ml_dtypes has registered it; without this import they
    # fail with "data type 'bfloat16' not understood".
    import ml_dtypes  # noqa: F401

    return safe_open, save_file


def progress(items: Iterable, total: int, desc: str) -> Iterable:
    """``items`` with a tqdm progress bar when tqdm is installed and stderr is a terminal."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return items
    # disable=None: tqdm shows nothing when its output is not a terminal.
    return tqdm(items, total=total, desc=desc, unit="layer", disable=None)
