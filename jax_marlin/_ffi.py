"""Loads the compiled extension modules and registers their XLA FFI targets.

The CPU module is always there; it also carries the kernel's rules
(``shapes`` reads them). The CUDA module exists when the package was built
with CUDA (``JAX_MARLIN_CUDA=AUTO`` finding nvcc, or ``ON``).

Before anything is registered, the XLA FFI API version the handlers were
built with is compared with the running jaxlib's: a runtime older than the
build refuses the handlers, and XLA's own error names neither jax_marlin nor
the fix.
"""

from __future__ import annotations

import importlib.metadata
import os
import re

import jax

from jax_marlin import _marlin_cpu

try:
    from jax_marlin import _marlin_cuda
except ImportError:  # a CPU-only build
    _marlin_cuda = None

#: Name of the custom-call target, the same on every platform.
MATMUL_TARGET = "jax_marlin_matmul"

#: The CUDA target of the same handler without XLA's command-buffer trait:
#: XLA runs such calls on the stream, outside its command buffers.
MATMUL_STREAM_TARGET = "jax_marlin_matmul_stream"


def cuda_target() -> str:
    """The custom-call target ``jm.matmul`` lowers to on CUDA, read at lowering time.

    ``JAX_MARLIN_COMMAND_BUFFER=0`` keeps the calls out of XLA's command
    buffers: XLA runs them on the stream, where adjacent calls keep the
    programmatic dependent launch between their kernels. Otherwise (the
    default) XLA may record them into its command buffers, each as a child
    graph that starts when the commands before it have finished. On a
    Llama-3-8B decode step the two measured the same (H200, m = 1: 1.95-1.98
    ms against 1.93-2.01 fused; ``benchmarks/NOTES.md``), so the default
    stays; the switch is there for kernels that use the edge.
    """
    return MATMUL_STREAM_TARGET if os.environ.get("JAX_MARLIN_COMMAND_BUFFER") == "0" else MATMUL_TARGET


#: Whether this build has the CUDA kernel.
HAS_CUDA = _marlin_cuda is not None

#: The C++ module the Python side reads the kernel's rules from (both modules
#: export the same ones).
rules = _marlin_cpu


def runtime_ffi_api_version() -> tuple[int, int] | None:
    """``(major, minor)`` of the running jaxlib's XLA FFI API, or None if unknown.

    Read from the FFI headers the installed jaxlib ships
    (``jax.ffi.include_dir()``), which are the ones it was built with.
    """
    header = os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h")
    try:
        with open(header) as f:
            text = f.read()
    except OSError:
        return None
    found = [re.search(rf"#define XLA_FFI_API_{part}\s+(\d+)", text) for part in ("MAJOR", "MINOR")]
    if not all(found):
        return None
    return int(found[0].group(1)), int(found[1].group(1))


def _jaxlib_version() -> str:
    try:
        return importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def check_ffi_api_version(built: tuple[int, int], runtime: tuple[int, int] | None) -> None:
    """Raises ``ImportError`` if a runtime with FFI API ``runtime`` refuses handlers built with ``built``.

    A runtime takes handlers of its own major version and of its minor
    version or an older one.
    """
    if runtime is None or (built[0] == runtime[0] and built[1] <= runtime[1]):
        return
    raise ImportError(
        f"jax_marlin was built against XLA FFI API {built[0]}.{built[1]}, but the installed "
        f"jaxlib {_jaxlib_version()} provides FFI API {runtime[0]}.{runtime[1]}, which "
        f"refuses it. Rebuild jax_marlin against the installed jax: pip install "
        f"--no-build-isolation --force-reinstall --no-deps <jax-marlin source> (README.md, "
        f"'Building'), or upgrade jax and jaxlib to the version it was built with.")


for _module in (_marlin_cpu, _marlin_cuda):
    if _module is not None:
        check_ffi_api_version(tuple(_module.ffi_api_version()), runtime_ffi_api_version())

for _name, _capsule in _marlin_cpu.registrations().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")
if HAS_CUDA:
    # State types first: a handler's registration names the type of its state.
    for _name, _registration in _marlin_cuda.types().items():
        jax.ffi.register_ffi_type(_name, _registration, platform="CUDA")
    for _name, _capsule in _marlin_cuda.registrations().items():
        jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")
