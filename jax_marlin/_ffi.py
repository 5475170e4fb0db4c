"""Loads the compiled extension modules and registers their XLA FFI targets.

The CPU target is always there. The CUDA target exists when the package was
built with CUDA (``JAX_MARLIN_CUDA=AUTO`` finding nvcc, or ``ON``).
"""

from __future__ import annotations

import jax

from jax_marlin import _marlin_cpu

try:
    from jax_marlin import _marlin_cuda
except ImportError:  # a CPU-only build
    _marlin_cuda = None

#: Name of the custom-call target, the same on every platform.
MATMUL_TARGET = "jax_marlin_matmul"

#: Whether this build has the CUDA kernel.
HAS_CUDA = _marlin_cuda is not None

for _name, _capsule in _marlin_cpu.registrations().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")
if HAS_CUDA:
    for _name, _capsule in _marlin_cuda.registrations().items():
        jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")
