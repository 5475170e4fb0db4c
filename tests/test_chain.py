"""jm.post_attention: o, RMSNorm, gate_up, SwiGLU and down of a decoder block in one op.

Its definition is the three fused jm.matmul calls (jax_marlin/chain.py); the
CPU runs exactly them, so there the op must equal them bit for bit. On CUDA
at m <= 8 it is one custom call (ffi/post_attention.cc) running the same
kernels: bit-identical again, and within the kernels' tolerance of a float64
evaluation that rounds where the contract rounds.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import BF16_U, FP16_U, imported_weight, random_weight, rel_err

import jax_marlin as jm
from jax_marlin import _ffi, shapes
from jax_marlin.chain import _post_attention

EPS = 1e-5
DTYPES = [np.float16, jnp.bfloat16]
# One block's sizes: attention width k_o, hidden, f (the MLP's width).
SMALL = (384, 256, 512)
# Each of the three steps is within the kernels' own bound of its float64
# value (tests/test_fusion.py: 1e-3 + u in fp16, 8e-3 + u in bf16); the
# steps' errors add along the chain (the RMSNorm and the residuals pass them
# on with gain about 1).
TOLS = {np.dtype(np.float16): 3 * (1e-3 + FP16_U), np.dtype(jnp.bfloat16): 3 * (8e-3 + BF16_U)}


def block_weights(rng, sizes, dtype, group_size=128, device=None):
    """``(o, gate_up, down, norm_weight)`` for ``sizes = (k_o, hidden, f)``."""
    k_o, hidden, f = sizes
    put = (lambda a: a) if device is None else (lambda a: jax.device_put(a, device))
    # Scaled as a model's weights are (k^-1/2), so that activations stay O(1).
    o, gate_up, down = (jm.quantize(put(random_weight(rng, k, n) * np.float32(k ** -0.5)),
                                    group_size=group_size, dtype=dtype)
                        for k, n in ((k_o, hidden), (hidden, 2 * f), (f, hidden)))
    norm_weight = put(rng.uniform(0.5, 2.0, hidden).astype(dtype))
    return o, gate_up, down, norm_weight


def inputs(rng, lead, sizes, dtype):
    """``a [*lead, k_o]`` and ``x [*lead, hidden]``: random, nothing zero; the residual
    stream larger than the product, as in a model."""
    k_o, hidden, _ = sizes
    a = rng.standard_normal(lead + (k_o,)).astype(dtype)
    x = (4 * rng.standard_normal(lead + (hidden,))).astype(dtype)
    return a, x


def three_calls(a, x, o, gate_up, down, norm_weight, poison_output=False):
    """The op's definition: three fused jm.matmul calls."""
    from jax_marlin.ops import _matmul
    h = _matmul(a, o, residual=x, poison_output=poison_output)
    g = _matmul(h, gate_up, rms_norm_weight=norm_weight, rms_norm_eps=EPS,
                poison_output=poison_output)
    return _matmul(g, down, swiglu=True, residual=h, poison_output=poison_output)


def float64_chain(a, x, o, gate_up, down, norm_weight) -> np.ndarray:
    """The contract in float64 with dequantized weights, rounding to the dtype where the
    kernels round (each product, each sum with a residual, each prologue), except the
    result."""
    dt = np.dtype(a.dtype)
    rnd = lambda v: np.asarray(v).astype(dt).astype(np.float64)
    w64 = lambda w: np.asarray(jm.dequantize(w, jnp.float32), np.float64)
    h = rnd(rnd(np.asarray(a, np.float64) @ w64(o)) + np.asarray(x, np.float64))
    r = 1 / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + EPS)
    g = rnd(rnd(h * r * np.asarray(norm_weight, np.float64)) @ w64(gate_up))
    f = g.shape[-1] // 2
    act = rnd(g[..., :f] / (1 + np.exp(-g[..., :f])) * g[..., f:])
    return rnd(act @ w64(down)) + h


def run(a, x, o, gate_up, down, norm_weight, poison_output=True):
    return jax.jit(lambda *args: _post_attention(*args, rms_norm_eps=EPS,
                                                 poison_output=poison_output))(
        a, x, o, gate_up, down, norm_weight)


# --- CPU -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
@pytest.mark.parametrize("lead", [(1,), (5,), (2, 3)])
def test_equals_the_three_calls_and_float64(rng, dtype, lead):
    o, gate_up, down, norm_weight = block_weights(rng, SMALL, dtype)
    a, x = inputs(rng, lead, SMALL, dtype)
    y = run(a, x, o, gate_up, down, norm_weight)
    assert y.shape == x.shape and y.dtype == np.dtype(dtype)
    want = jax.jit(three_calls)(a, x, o, gate_up, down, norm_weight)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))
    err = rel_err(y, float64_chain(a, x, o, gate_up, down, norm_weight))
    assert err <= TOLS[np.dtype(dtype)], err


@pytest.mark.parametrize("kind", ["zeros-act-order", "g-1", "padded"])
def test_other_weights(rng, kind):
    # Zero points with act-order, one scale per column, and shapes the
    # kernels run padded: all take the three calls.
    sizes = (200, 136, 328) if kind == "padded" else SMALL
    if kind == "zeros-act-order":
        k_o, hidden, f = sizes
        o, _ = imported_weight(rng, k_o, hidden, 128, zeros=True, act_order=True)
        gate_up, _ = imported_weight(rng, hidden, 2 * f, 128, zeros=True, act_order=False)
        down, _ = imported_weight(rng, f, hidden, 128, zeros=False, act_order=True)
        norm_weight = rng.uniform(0.5, 2.0, hidden).astype(np.float16)
    else:
        o, gate_up, down, norm_weight = block_weights(rng, sizes, np.float16,
                                                      group_size=-1 if kind == "g-1" else 64)
    a, x = inputs(rng, (3,), sizes, np.float16)
    y = run(a, x, o, gate_up, down, norm_weight)
    want = three_calls(a, x, o, gate_up, down, norm_weight)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))
    err = rel_err(y, float64_chain(a, x, o, gate_up, down, norm_weight))
    assert err <= TOLS[np.dtype(np.float16)], err


def test_eager_jit_and_empty(rng):
    o, gate_up, down, norm_weight = block_weights(rng, SMALL, np.float16)
    a, x = inputs(rng, (2,), SMALL, np.float16)
    eager = jm.post_attention(a, x, o, gate_up, down, norm_weight, rms_norm_eps=EPS)
    jitted = jax.jit(jm.post_attention, static_argnames="rms_norm_eps")(
        a, x, o, gate_up, down, norm_weight, rms_norm_eps=EPS)
    np.testing.assert_array_equal(np.asarray(eager, np.float32), np.asarray(jitted, np.float32))
    empty = jm.post_attention(a[:0], x[:0], o, gate_up, down, norm_weight)
    assert empty.shape == (0, SMALL[1])


@pytest.mark.parametrize("in_axes", [(0, 0), (1, 1), (0, None)])
def test_vmap_folds_rows(rng, in_axes):
    o, gate_up, down, norm_weight = block_weights(rng, SMALL, np.float16)
    a, x = inputs(rng, (3, 2), SMALL, np.float16)
    if in_axes[1] is None:
        x = x[0]
    f = jax.vmap(lambda a, x: jm.post_attention(a, x, o, gate_up, down, norm_weight,
                                                rms_norm_eps=EPS), in_axes=in_axes)
    y = f(a, x)
    want = jax.vmap(lambda a, x: three_calls(a, x, o, gate_up, down, norm_weight),
                    in_axes=in_axes)(a, x)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))
    # Each row is its own: row j equals the op on that row alone.
    a0 = np.moveaxis(a, in_axes[0], 0)[1]
    x0 = x if in_axes[1] is None else np.moveaxis(x, in_axes[1], 0)[1]
    alone = run(a0, x0, o, gate_up, down, norm_weight)
    np.testing.assert_array_equal(np.asarray(y[1], np.float32), np.asarray(alone, np.float32))


def test_vmap_over_norm_weights(rng):
    o, gate_up, down, norm_weight = block_weights(rng, SMALL, np.float16)
    a, x = inputs(rng, (2,), SMALL, np.float16)
    norms = np.stack([norm_weight, norm_weight[::-1]])
    y = jax.vmap(lambda g: jm.post_attention(a, x, o, gate_up, down, g, rms_norm_eps=EPS))(norms)
    for i in range(2):
        np.testing.assert_array_equal(np.asarray(y[i], np.float32),
                                      np.asarray(run(a, x, o, gate_up, down, norms[i]), np.float32))


def test_grad_and_jvp_match_the_three_calls(rng):
    o, gate_up, down, norm_weight = block_weights(rng, SMALL, np.float16)
    a, x = inputs(rng, (3,), SMALL, np.float16)

    def loss(fn):
        return lambda a, x, g: jnp.sum(fn(a, x, g).astype(jnp.float32) ** 2)

    ours = jax.grad(loss(lambda a, x, g: jm.post_attention(a, x, o, gate_up, down, g,
                                                           rms_norm_eps=EPS)), argnums=(0, 1, 2))
    theirs = jax.grad(loss(lambda a, x, g: three_calls(a, x, o, gate_up, down, g)),
                      argnums=(0, 1, 2))
    for got, want in zip(ours(a, x, norm_weight), theirs(a, x, norm_weight)):
        assert got.shape == want.shape
        assert np.isfinite(np.asarray(got, np.float32)).all()
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    tangents = tuple(rng.standard_normal(v.shape).astype(np.float16) for v in (a, x, norm_weight))
    _, ours_dot = jax.jvp(lambda a, x, g: jm.post_attention(a, x, o, gate_up, down, g,
                                                            rms_norm_eps=EPS),
                          (a, x, norm_weight), tangents)
    _, want_dot = jax.jvp(lambda a, x, g: three_calls(a, x, o, gate_up, down, g),
                          (a, x, norm_weight), tangents)
    np.testing.assert_array_equal(np.asarray(ours_dot, np.float32),
                                  np.asarray(want_dot, np.float32))


def test_weights_are_frozen(rng):
    o, gate_up, down, norm_weight = block_weights(rng, SMALL, np.float16)
    a, x = inputs(rng, (1,), SMALL, np.float16)
    with pytest.raises(TypeError, match="frozen"):
        jax.grad(lambda w: jnp.sum(jm.post_attention(a, x, o, w, down, norm_weight)
                                   .astype(jnp.float32)), allow_int=True)(gate_up)


def _bad(name):
    """Each case breaks one argument of a valid call."""
    rng = np.random.default_rng(7)
    o, gate_up, down, norm_weight = block_weights(rng, SMALL, np.float16)
    a, x = inputs(rng, (2,), SMALL, np.float16)
    args = dict(a=a, x=x, o=o, gate_up=gate_up, down=down, rms_norm_weight=norm_weight)
    k_o, hidden, f = SMALL
    other = lambda k, n: jm.quantize(random_weight(rng, k, n), group_size=128)
    changes = {
        "a width": (dict(a=a[:, :256]), r"a.shape\[-1\] = 256 does not match o's k = 384"),
        "x width": (dict(x=x[:, :128]), r"x.shape\[-1\] = 128 does not match o's n = 256"),
        "rows": (dict(x=x[:1]), "same leading dimensions"),
        "gate_up k": (dict(gate_up=other(128, 2 * f)),
                      "gate_up's k = 128 does not match hidden = 256"),
        "gate_up n": (dict(gate_up=other(hidden, f)),
                      "gate_up's n = 512 is not 2 f with down's f = 512"),
        "down n": (dict(down=other(f, 128)), "down's n = 128 does not match hidden = 256"),
        "norm shape": (dict(rms_norm_weight=norm_weight[:100]),
                       r"rms_norm_weight.shape = \(100,\)"),
        "x dtype": (dict(x=x.astype(jnp.bfloat16)), "x.dtype is bfloat16 but a.dtype is float16"),
        "a dtype": (dict(a=a.astype(np.float32)), "float32"),
        "not a weight": (dict(down=np.zeros((f, hidden), np.float16)),
                         "down must be a jax_marlin.MarlinWeight"),
    }
    change, match = changes[name]
    return {**args, **change}, match


@pytest.mark.parametrize("name", ["a width", "x width", "rows", "gate_up k", "gate_up n", "down n",
                                  "norm shape", "x dtype", "a dtype", "not a weight"])
def test_bad_arguments_raise_at_trace_time(name):
    args, match = _bad(name)
    with pytest.raises((ValueError, TypeError), match=match):
        jax.jit(jm.post_attention).trace(**args)


def test_eps_must_be_a_static_non_negative_float(rng):
    o, gate_up, down, norm_weight = block_weights(rng, SMALL, np.float16)
    a, x = inputs(rng, (1,), SMALL, np.float16)
    with pytest.raises(ValueError, match="non-negative"):
        jm.post_attention(a, x, o, gate_up, down, norm_weight, rms_norm_eps=-1.0)
    with pytest.raises(TypeError, match="Python float"):
        jax.jit(lambda e: jm.post_attention(a, x, o, gate_up, down, norm_weight,
                                            rms_norm_eps=e))(1e-5)


# --- the CUDA lowering, checked on any machine -----------------------------------------


def cuda_targets(monkeypatch, fn, *args, stream=False) -> list[str]:
    """The custom-call targets of ``fn`` lowered for CUDA (cross-lowered: no GPU needed)."""
    monkeypatch.setattr(_ffi, "HAS_CUDA", True)
    monkeypatch.setenv("JAX_MARLIN_CHAIN_CALL", "1")
    monkeypatch.setenv("JAX_MARLIN_COMMAND_BUFFER", "0" if stream else "1")
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return re.findall(r"custom_call @(\w+)", lowered.as_text())


@pytest.mark.parametrize("m, kind, targets", [
    (1, "plain", ["jax_marlin_post_attention"]),
    (8, "plain", ["jax_marlin_post_attention"]),
    (8, "stream", ["jax_marlin_post_attention_stream"]),
    (8, "zeros", ["jax_marlin_post_attention"]),
    (9, "plain", ["jax_marlin_matmul"] * 3),
    (4, "act-order", ["jax_marlin_matmul"] * 3),
    (4, "padded", ["jax_marlin_matmul"] * 3),
])
def test_cuda_lowering_route(rng, monkeypatch, m, kind, targets):
    # One custom call at m <= 8 with group-order, unpadded weights (zero
    # points too); the three jm.matmul calls otherwise.
    sizes = (200, 136, 328) if kind == "padded" else SMALL
    o, gate_up, down, norm_weight = block_weights(rng, sizes, np.float16)
    if kind in ("zeros", "act-order"):
        zeros, act_order = kind == "zeros", kind == "act-order"
        gate_up, _ = imported_weight(rng, sizes[1], 2 * sizes[2], 128, zeros=zeros,
                                     act_order=act_order)
    a, x = inputs(rng, (m,), sizes, np.float16)
    fn = lambda a, x: jm.post_attention(a, x, o, gate_up, down, norm_weight)
    assert cuda_targets(monkeypatch, fn, a, x, stream=kind == "stream") == targets


def test_the_single_call_is_opt_in(rng, monkeypatch):
    o, gate_up, down, norm_weight = block_weights(rng, SMALL, np.float16)
    a, x = inputs(rng, (1,), SMALL, np.float16)
    def fn(a, x):  # a new function object for each lowering: none is reused from a cache
        return jm.post_attention(a, x, o, gate_up, down, norm_weight)

    assert cuda_targets(monkeypatch, fn, a, x) == ["jax_marlin_post_attention"]
    monkeypatch.delenv("JAX_MARLIN_CHAIN_CALL")
    lowered = jax.jit(lambda a, x: fn(a, x)).trace(a, x).lower(lowering_platforms=("cuda",))
    assert re.findall(r"custom_call @(\w+)", lowered.as_text()) == ["jax_marlin_matmul"] * 3


def test_cuda_lowering_of_a_sharded_program_takes_the_three_calls(rng, monkeypatch):
    # Split over several devices by XLA's partitioner, the single call (no
    # partitioning rule) would have its operands gathered; the three calls
    # keep jm.matmul's rules.
    o, gate_up, down, norm_weight = block_weights(rng, SMALL, np.float16)
    a, x = inputs(rng, (8,), SMALL, np.float16)
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices("cpu")[:2])
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    a, x = jax.device_put(a, rows), jax.device_put(x, rows)
    fn = lambda a, x: jm.post_attention(a[:4], x[:4], o, gate_up, down, norm_weight)
    # (jm.matmul's calls are lowered inside their custom_partitioning ops,
    # when XLA partitions the program.)
    assert cuda_targets(monkeypatch, fn, a, x) == ["CustomSPMDPartitioning"] * 3


# --- CUDA ------------------------------------------------------------------------------


def gpu(a):
    return jax.device_put(a, jax.devices("gpu")[0])


@pytest.fixture
def single_call(monkeypatch):
    """The GPU tests run the single custom call (opt-in: jax_marlin.chain)."""
    monkeypatch.setenv("JAX_MARLIN_CHAIN_CALL", "1")


# (k_o, hidden, f): a small block, and Llama-3-8B's (the decode table's
# configurations, gate_up on the long-stream schedule at m <= 2).
GPU_SIZES = [(1024, 1024, 2048), (4096, 4096, 14336)]


@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
@pytest.mark.parametrize("sizes", GPU_SIZES, ids=["small", "8b"])
@pytest.mark.parametrize("group_size", [128, -1])
@pytest.mark.gpu
def test_gpu_equals_the_three_calls_and_float64(rng, single_call, sizes, dtype, m, group_size):
    if sizes == GPU_SIZES[1] and (group_size == -1 or np.dtype(dtype) != np.float16):
        pytest.skip("the 8B sizes in float16 g128 only (time)")
    o, gate_up, down, norm_weight = block_weights(rng, sizes, dtype, group_size,
                                                  device=jax.devices("gpu")[0])
    a, x = (gpu(v) for v in inputs(rng, (m,), sizes, dtype))
    y = run(a, x, o, gate_up, down, norm_weight)
    assert np.isfinite(np.asarray(y, np.float32)).all(), "an element was not written"
    want = jax.jit(lambda *v: three_calls(*v, poison_output=True))(a, x, o, gate_up, down,
                                                                    norm_weight)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))
    ref = float64_chain(*(jax.device_get(v) for v in (a, x, o, gate_up, down, norm_weight)))
    err = rel_err(y, ref)
    print(f"gpu post_attention {sizes} {np.dtype(dtype).name} g{group_size} m={m}: {err:.2e}")
    assert err <= TOLS[np.dtype(dtype)], err
    again = run(a, x, o, gate_up, down, norm_weight)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(again, np.float32))


@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.gpu
def test_gpu_one_call_and_the_stream_target(rng, monkeypatch, single_call, m):
    # At m <= 8 the op is one custom call, on either target (command buffers
    # or the stream), with the same result; zero points take the kernels
    # without the early weights.
    o, gate_up, down, norm_weight = block_weights(rng, GPU_SIZES[0], np.float16,
                                                  device=jax.devices("gpu")[0])
    zeros_gate_up, _ = imported_weight(rng, GPU_SIZES[0][1], 2 * GPU_SIZES[0][2], 128,
                                       zeros=True, act_order=False)
    a, x = (gpu(v) for v in inputs(rng, (m,), GPU_SIZES[0], np.float16))
    results = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("JAX_MARLIN_COMMAND_BUFFER", setting)
        for name, w in (("plain", gate_up), ("zeros", jax.tree.map(gpu, zeros_gate_up))):
            f = jax.jit(lambda a, x, w: jm.post_attention(a, x, o, w, down, norm_weight,
                                                          rms_norm_eps=EPS))
            text = f.lower(a, x, w).as_text()
            targets = re.findall(r"custom_call @(jax_marlin_\w+)", text)
            assert targets == ["jax_marlin_post_attention" + ("_stream" if setting == "0" else "")]
            results[setting, name] = np.asarray(f(a, x, w), np.float32)
            want = np.asarray(three_calls(a, x, o, w, down, norm_weight), np.float32)
            np.testing.assert_array_equal(results[setting, name], want)
    np.testing.assert_array_equal(results["1", "plain"], results["0", "plain"])


@pytest.mark.gpu
def test_gpu_handler_rechecks_its_operands(rng):
    # Called directly, past the Python checks, the single call's handler
    # refuses inconsistent buffers with a message instead of reading out of
    # bounds.
    k_o, hidden, f = GPU_SIZES[0]
    o, gate_up, down, norm_weight = block_weights(rng, GPU_SIZES[0], np.float16, 128,
                                                  device=jax.devices("gpu")[0])
    a, x = (gpu(v) for v in inputs(rng, (2,), GPU_SIZES[0], np.float16))
    none = gpu(np.zeros((0, 0), np.int32))

    def call(a=a, x=x, o=o, gate_up=gate_up, down=down, norm_weight=norm_weight, h_size=None,
             scratch=None):
        m = 2
        h_size = m * hidden if h_size is None else h_size
        if scratch is None:
            scratch = sum(_ffi.rules.chained_size(shapes.reduce_scratch_size(m, w.n, w.k, c))
                          for w, c in ((o, False), (gate_up, True), (down, True)))
        workspace = sum(_ffi.rules.chained_size(shapes.workspace_size(m, w.n))
                        for w in (o, gate_up, down))
        out = [jax.ShapeDtypeStruct((m, hidden), jnp.float16),
               jax.ShapeDtypeStruct((h_size,), jnp.float16),
               jax.ShapeDtypeStruct((m * 2 * f,), jnp.float16),
               jax.ShapeDtypeStruct((workspace,), jnp.int32),
               jax.ShapeDtypeStruct((scratch,), jnp.float32)]
        fn = jax.ffi.ffi_call("jax_marlin_post_attention", out)
        y = fn(a, x, o.qweight, o.scales, none, gate_up.qweight, gate_up.scales, none,
               down.qweight, down.scales, none, norm_weight, o_group_size=np.int64(128),
               gate_up_group_size=np.int64(128), down_group_size=np.int64(128),
               norm_eps=np.float32(EPS), poison_output=True)[0]
        return np.asarray(y, np.float32)

    # The valid call: the three calls' result.
    np.testing.assert_array_equal(call(), np.asarray(three_calls(a, x, o, gate_up, down,
                                                                 norm_weight), np.float32))
    for kwargs, match in [
        (dict(a=a[:, :512]), "a.shape\\[-1\\] = 512 but o's qweight packs k = 1024"),
        (dict(x=x[:, :512]), "x.shape\\[-1\\] = 512 but o has n = 1024"),
        (dict(gate_up=down, down=gate_up), "do not chain"),
        (dict(norm_weight=norm_weight[:512]), "norm_weight must have shape \\[1024\\]"),
        (dict(h_size=hidden), "h must hold"),
        (dict(scratch=8), "scratch holds 8 float32"),
    ]:
        with pytest.raises(Exception, match=match):
            call(**kwargs)
