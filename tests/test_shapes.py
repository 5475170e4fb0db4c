"""shapes: the kernel's rules as the C++ module exports them, and the FFI API version check."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import jax_marlin as jm
from conftest import ODD
from jax_marlin import _ffi, shapes

GROUP_SIZES = (-1, 32, 64, 128)
# Shapes the kernel runs as they are.
ALIGNED = [(k, n, g) for k, n in [(64, 128), (128, 64), (256, 256), (384, 192), (1024, 512),
                                  (4096, 11008)]
           for g in GROUP_SIZES if g == -1 or k % g == 0] + [(28672, 8192, 32)]


def test_rules_come_from_the_compiled_module():
    assert jm.GROUP_SIZES == (-1, 32, 64, 128) == tuple(_ffi.rules.GROUP_SIZES)
    assert shapes.TILE == 16 and shapes.MIN_THREAD_K == 64 and shapes.MIN_THREAD_N == 64
    # Every tile the launcher dispatches: (thread_k, thread_n, threads).
    assert set(_ffi.rules.TILES) == {(128, 128, 256), (128, 64, 128), (64, 256, 256),
                                     (64, 128, 128)}
    if _ffi.HAS_CUDA:  # both builds export the same rules
        cuda = _ffi._marlin_cuda
        assert cuda.TILES == _ffi.rules.TILES and cuda.GROUP_SIZES == _ffi.rules.GROUP_SIZES
        assert (cuda.reduce_scratch_size(100, 4096, 8192) ==
                _ffi.rules.reduce_scratch_size(100, 4096, 8192))


@pytest.mark.parametrize("m", [0, 1, 16, 17, 63, 64, 65, 1024, 5000])
@pytest.mark.parametrize("n", [64, 4096])
def test_scratch_sizes(m, n):
    # The Marlin kernel: one lock per 16-row block (at most 64 of them) and 64
    # columns; fp32 scratch of one 16 x n tile, or of 256 block slots of a
    # <= 64 x 256 tile. From 64 rows on the prefill kernel may run instead:
    # one counter per 64 x 128 output tile, and the fp32 partial sums of its
    # largest k split.
    k = 8192
    row_blocks = -(-m // 16)
    locks = n // 64 * min(row_blocks, 64)
    slots = 256 * 16 * min(row_blocks, 4) * 256 if row_blocks >= 2 else 0
    scratch = max(slots, 16 * n)
    if m < 64:
        assert shapes.workspace_size(m, n) == locks
        assert shapes.reduce_scratch_size(m, n, k) == scratch
    else:
        assert shapes.workspace_size(m, n) == max(locks, -(-m // 64) * -(-n // 128))
        assert shapes.reduce_scratch_size(m, n, k) >= scratch
    # Act-order: room for x in the weight's row order (m k 16-bit values)
    # after the partial sums, from a 32-byte boundary.
    partials = shapes.reduce_scratch_size(m, n, k)
    assert shapes.reduce_scratch_size(m, n, k, True) == -(-partials // 8) * 8 + m * k // 2


@pytest.mark.parametrize("k,n,group_size,match", [
    (100, 128, 128, r"k = 100 \(weight.shape\[0\], the input features\) must be a multiple of 64"),
    (128, 96, 128, r"n = 96 \(weight.shape\[1\], the output features\) must be a multiple of 64"),
    (192, 128, 128, "k = 192 must be a multiple of group_size = 128"),
    (192, 192, 64, "k = 192 and n = 192: one of them must be a multiple of 128"),
    (128, 128, 96, "group_size = 96 is not supported"),
    (0, 128, 128, r"\[k, n\] = \[0, 128\] must be positive"),
    (2**17, 2**17, 128, "32-bit offsets"),
])
def test_check_layer_names_the_dimension(k, n, group_size, match):
    with pytest.raises(ValueError, match=match):
        shapes.check_layer(k, n, group_size)


def test_check_operands_limits_m():
    shapes.check_operands((4, 128), "float16", (8, 256), "int32", (1, 128), "float16", (0, 0),
                          "int32", (0,), "int32", (0,), "float16", k=128, n=128, group_size=128)
    with pytest.raises(ValueError, match=r"m = 2147483648 rows of x are too many"):
        shapes.check_operands((2**31, 128), "float16", (8, 256), "int32", (1, 128), "float16",
                              (0, 0), "int32", (0,), "int32", (0,), "float16", k=128, n=128,
                              group_size=128)


def test_check_operands_zeros():
    # Zero points: the scales' rows by n // 8 words of int32, or [0, 0] (none).
    args = ((4, 256), "float16", (16, 256), "int32", (2, 128), "float16")
    no_perm = ((0,), "int32")
    shapes.check_operands(*args, (2, 16), "int32", *no_perm, (0,), "float16", k=256, n=128,
                          group_size=128)
    with pytest.raises(ValueError, match=r"zeros.shape = \(2, 128\), expected \(2, 16\) \(the "
                                         r"scales' 2 rows by n // 8 = 16 words for n = 128\)"):
        shapes.check_operands(*args, (2, 128), "int32", *no_perm, (0,), "float16", k=256, n=128,
                              group_size=128)
    with pytest.raises(TypeError, match=r"zeros.dtype is uint8, expected int32"):
        shapes.check_operands(*args, (2, 16), "uint8", *no_perm, (0,), "float16", k=256, n=128,
                              group_size=128)


def test_check_operands_perm():
    # Act-order: one int32 index per row of the padded k, or [0] (none).
    args = ((4, 256), "float16", (16, 256), "int32", (2, 128), "float16", (0, 0), "int32")
    shapes.check_operands(*args, (256,), "int32", (0,), "float16", k=256, n=128, group_size=128)
    with pytest.raises(ValueError, match=r"perm.shape = \(200,\), expected \(256,\)"):
        shapes.check_operands(*args, (200,), "int32", (0,), "float16", k=256, n=128,
                              group_size=128)
    with pytest.raises(TypeError, match=r"perm.dtype is int64, expected int32"):
        shapes.check_operands(*args, (256,), "int64", (0,), "float16", k=256, n=128,
                              group_size=128)


# --- padding: any [k, n] ------------------------------------------------------------


def _padded_shape_by_search(k, n, group_size):
    """The runnable (k', n') >= (k, n) with the fewest elements, by trying them all."""
    def runs(kk, nn):
        try:
            jm.shapes.check_layer(kk, nn, group_size)
            return True
        except ValueError:
            return False
    candidates = [(kk * nn, kk, nn) for kk in range(k, k + 257) for nn in range(n, n + 193)
                  if kk % 64 == 0 and nn % 64 == 0 and runs(kk, nn)]
    return min(candidates)


@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_padded_shape_is_the_smallest_that_runs(group_size):
    for k in range(1, 700, 37):
        for n in range(1, 700, 41):
            k_pad, n_pad = jm.padded_shape(k, n, group_size)
            elements, *_ = _padded_shape_by_search(k, n, group_size)
            assert k_pad >= k and n_pad >= n and k_pad * n_pad == elements, (k, n)
            jm.shapes.check_layer(k_pad, n_pad, group_size)
    for (k, n), padded in ODD.items():
        assert jm.padded_shape(k, n, group_size) == padded[group_size]
    # Aligned shapes cost nothing; on a tie n is padded (x stays as it is).
    for k, n, g in ALIGNED:
        assert jm.padded_shape(k, n, g) == (k, n)
    assert jm.padded_shape(192, 192, -1) == (192, 256)


def test_padded_shape_bad_input():
    with pytest.raises(ValueError, match="group_size = 96"):
        jm.padded_shape(128, 128, 96)
    with pytest.raises(ValueError, match=r"\[0, 128\] must be positive"):
        jm.padded_shape(0, 128, 128)
    with pytest.raises(ValueError, match="32-bit offsets"):
        jm.padded_shape(2**17, 2**17, 128)
    with pytest.raises(TypeError, match="k must be an int"):
        jm.padded_shape(128.0, 128, 128)


# --- the XLA FFI API version -------------------------------------------------------


def test_built_version_runs_on_this_runtime():
    built = tuple(_ffi._marlin_cpu.ffi_api_version())
    runtime = _ffi.runtime_ffi_api_version()
    assert runtime is not None and built[0] == runtime[0] and built[1] <= runtime[1]
    _ffi.check_ffi_api_version(built, runtime)


@pytest.mark.parametrize("built,runtime,ok", [
    ((0, 4), (0, 4), True),
    ((0, 4), (0, 5), True),   # a newer runtime takes an older handler
    ((0, 5), (0, 4), False),  # an older one refuses a newer handler
    ((1, 0), (0, 9), False),
    ((0, 4), (1, 4), False),
])
def test_version_check(built, runtime, ok):
    if ok:
        _ffi.check_ffi_api_version(built, runtime)
        return
    with pytest.raises(ImportError) as info:
        _ffi.check_ffi_api_version(built, runtime)
    message = str(info.value)
    assert f"FFI API {built[0]}.{built[1]}" in message
    assert f"FFI API {runtime[0]}.{runtime[1]}" in message
    assert "--no-build-isolation" in message


def test_import_fails_before_registering_on_an_older_runtime(tmp_path):
    # A runtime whose FFI headers say 0.0: jax_marlin must raise one clear
    # ImportError and register nothing (XLA would otherwise refuse the handler
    # in a way that breaks every later jax call).
    header = tmp_path / "xla" / "ffi" / "api" / "c_api.h"
    header.parent.mkdir(parents=True)
    header.write_text("#define XLA_FFI_API_MAJOR 0\n#define XLA_FFI_API_MINOR 0\n")
    script = textwrap.dedent(f"""
        import jax, jax.numpy as jnp
        registered = []
        jax.ffi.include_dir = lambda: {str(tmp_path)!r}
        jax.ffi.register_ffi_target = lambda *a, **k: registered.append(a[0])
        try:
            import jax_marlin
        except ImportError as e:
            print("ImportError:", e)
        print("registered:", registered)
        print("jax works:", float(jnp.ones(3).sum()))
    """)
    out = subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True,
                         check=True).stdout
    assert "ImportError: jax_marlin was built against XLA FFI API" in out
    assert "provides FFI API 0.0" in out
    assert "registered: []" in out and "jax works: 3.0" in out
