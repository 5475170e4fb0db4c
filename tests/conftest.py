"""Shared test helpers: random data, float64 references, error norms, GPU detection."""

from __future__ import annotations

import os  # 8 fake CPU devices for tests/test_partitioning.py; set before jax starts its backends
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
# Under pytest-xdist every worker is a process of its own; with JAX's default
# preallocation (75% of the GPU's memory each) all but the first fail on a GPU.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import zlib

import jax
import numpy as np
import pytest

import jax_marlin as jm

#: Shapes the kernel runs only padded, with their padded shapes per group size
#: (k_pad a multiple of 64 and of the group, n_pad of 64, one of them of 128).
ODD = {
    (576, 192): {-1: (640, 192), 32: (640, 192), 64: (640, 192), 128: (640, 192)},
    (576, 1000): {-1: (576, 1024), 32: (576, 1024), 64: (576, 1024), 128: (640, 1024)},
    (1000, 576): {-1: (1024, 576), 32: (1024, 576), 64: (1024, 576), 128: (1024, 576)},
    (4100, 130): {-1: (4224, 192), 32: (4224, 192), 64: (4224, 192), 128: (4224, 192)},
}

#: Unit roundoff of float16: rounding one value to fp16 changes it by at most
#: this much relative to itself, so an fp16 output of an otherwise exact
#: product has ||y - ref|| / ||ref|| <= FP16_U.
FP16_U = 2.0**-11
#: The same for bfloat16 (8 significant bits instead of 11).
BF16_U = 2.0**-8


def has_gpu() -> bool:
    try:
        return jm.HAS_CUDA and len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if has_gpu():
        return
    reason = "needs a CUDA GPU and jax_marlin built with CUDA"
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _cpu_unless_gpu_test(request):
    """Tests not marked ``gpu`` exercise the CPU handler, also on a GPU machine."""
    if "gpu" in request.keywords:
        yield
    else:
        with jax.default_device(jax.devices("cpu")[0]):
            yield


@pytest.fixture
def gspmd():
    """Partitions with GSPMD (the sharding rules' other path) instead of Shardy."""
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        yield
    finally:
        jax.config.update("jax_use_shardy_partitioner", True)


@pytest.fixture
def rng(request):
    # A fresh, test-specific stream: every test sees its own random data.
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)


def random_weight(rng, k, n):
    """A float32 [k, n] weight with per-column scale spread, never zero."""
    return (rng.standard_normal((k, n)) * rng.uniform(0.5, 2.0, size=(1, n))).astype(np.float32)


def random_x(rng, *shape, dtype=np.float16):
    """float16 (or ``dtype``) activations, never zero."""
    return rng.standard_normal(shape).astype(dtype)


def float64_reference(x, w, bias=None) -> np.ndarray:
    """x @ dequantize(w) (+ bias) in float64 from the exact dequantized weight."""
    wd = np.asarray(jm.dequantize(w, jax.numpy.float32), np.float64)
    y = np.asarray(x, np.float64) @ wd
    return y if bias is None else y + np.asarray(bias, np.float64)


def rel_err(y, ref) -> float:
    y = np.asarray(y, np.float64)
    assert np.isfinite(y).all(), "output has NaN/inf (an unwritten or overflowed element)"
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def imported_weight(rng, k, n, group_size, *, zeros=True, act_order=True, dtype=np.float16):
    """A ``MarlinWeight`` as imported from an asymmetric / act-order checkpoint.

    Returns ``(w, weight)``, ``weight [k, n]`` float64 the exact
    ``(q - zeros[g_idx]) * scales[g_idx]`` it represents, computed here from
    the integers (not by jax_marlin). Random zero points 0..15; act-order
    rows grouped in a random order.
    """
    rows = k if group_size == -1 else group_size
    groups = -(-k // rows)
    q = rng.integers(0, 16, (k, n))
    scales = rng.uniform(0.5, 2.0, (groups, n)).astype(dtype) / 16
    z = rng.integers(0, 16, (groups, n)) if zeros else np.full((groups, n), 8)
    g_idx = np.arange(k) // rows
    if act_order:
        g_idx = np.empty(k, np.int64)
        g_idx[rng.permutation(k)] = np.arange(k) // rows
    w = jm.pack(q, scales, group_size, zeros=z if zeros else None,
                g_idx=g_idx if act_order else None)
    weight = (q - z[g_idx]).astype(np.float64) * np.asarray(scales, np.float64)[g_idx]
    return w, weight


def prologue64(x, norm_weight=None, swiglu=False, eps=1e-5) -> np.ndarray:
    """The fusions' x' (RMSNorm of x, or silu(gate) up of x = [gate | up]) computed in
    float64 and rounded to x's dtype, as float64; x itself without either."""
    x64 = np.asarray(x, np.float64)
    if norm_weight is not None:
        r = 1 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
        x64 = x64 * r * np.asarray(norm_weight, np.float64)
    elif swiglu:
        k = x64.shape[-1] // 2
        gate, up = x64[..., :k], x64[..., k:]
        x64 = gate / (1 + np.exp(-gate)) * up
    else:
        return x64
    return x64.astype(x.dtype).astype(np.float64)
