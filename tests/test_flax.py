"""jax_marlin.flax: MarlinLinear / quantize_model (nnx) and MarlinDense / converters (linen)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# flax and orbax are optional: jax_marlin itself needs neither.
pytest.importorskip("flax")
ocp = pytest.importorskip("orbax.checkpoint")

import flax.linen as nn  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from flax import nnx  # noqa: E402

import jax_marlin as jm  # noqa: E402
from jax_marlin import fusion  # noqa: E402
from conftest import BF16_U, random_x, rel_err  # noqa: E402
from jax_marlin.flax import (  # noqa: E402
    MarlinDense,
    MarlinLinear,
    QuantizedWeight,
    QuantizeSummary,
    concatenate_linears,
    dense_to_marlin,
    matmul_dtype,
    params_to_marlin,
    quantize_model,
)

# 4-bit round-to-nearest with one scale per 128 rows of a Gaussian kernel:
# the step is max|w| / 7.5 ~ 0.35 sigma, the error uniform in half a step,
# so ||y_int4 - y_float|| / ||y_float|| ~ 0.35 / sqrt(12) ~ 0.1.
QUANT_ERR = (0.05, 0.15)
# Against jm.reference.matmul on the same packed weights: float16 rounding of
# the product plus bias only (u = 2^-11; 1e-3 leaves room for casts of the
# result to other dtypes). bfloat16: the same with u = 2^-8.
SAME_WEIGHT_TOL = 1e-3
BF16_SAME_WEIGHT_TOL = 2 * BF16_U

K, N = 256, 512


def normal_init(key, shape, dtype):
    """A bias that is not zero, so adding it is tested."""
    return jax.random.normal(key, shape, dtype)


def ref_linear(x, layer: MarlinLinear):
    """The same quantized layer in float64, from the weight's exact values."""
    w = layer.weight.get_value()
    y = np.asarray(x.astype(w.dtype), np.float64) @ np.asarray(jm.dequantize(w, jnp.float32),
                                                                np.float64)
    if layer.bias is not None:
        y = y + np.asarray(layer.bias[...].astype(w.dtype), np.float64)
    return y


# --- nnx -----------------------------------------------------------------------


def test_marlin_linear_quantizes_the_same_kernel_as_nnx_linear(rng):
    linear = nnx.Linear(K, N, bias_init=normal_init, rngs=nnx.Rngs(3))
    layer = MarlinLinear(K, N, bias_init=normal_init, rngs=nnx.Rngs(3))
    expected = jm.quantize(linear.kernel[...], group_size=128)
    w = layer.weight.get_value()
    assert isinstance(layer.weight, QuantizedWeight) and not isinstance(layer.weight, nnx.Param)
    assert (w.k, w.n, w.group_size) == (K, N, 128)
    np.testing.assert_array_equal(np.asarray(w.qweight), np.asarray(expected.qweight))
    np.testing.assert_array_equal(np.asarray(w.scales), np.asarray(expected.scales))
    np.testing.assert_array_equal(np.asarray(layer.bias[...]), np.asarray(linear.bias[...]))

    x = random_x(rng, 3, 5, K)
    y = layer(x)
    assert y.shape == (3, 5, N) and y.dtype == jnp.float16
    assert rel_err(y, ref_linear(x, layer)) <= SAME_WEIGHT_TOL
    y_float = np.asarray(linear(x.astype(np.float32)), np.float64)
    assert QUANT_ERR[0] <= rel_err(y, y_float) <= QUANT_ERR[1]


def test_marlin_linear_dtypes_and_no_bias(rng):
    x32 = random_x(rng, 4, K).astype(np.float32)
    layer = MarlinLinear(K, N, use_bias=False, group_size=-1, rngs=nnx.Rngs(0))
    assert layer.bias is None and layer.weight.get_value().scales.shape == (1, N)
    y = layer(x32)
    assert y.dtype == jnp.float32  # dtype=None: the dtype of x
    np.testing.assert_array_equal(np.asarray(y), np.asarray(layer(x32.astype(np.float16)),
                                                            np.float32))
    assert MarlinLinear(K, N, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))(x32).dtype == jnp.bfloat16
    with pytest.raises(TypeError, match="inputs.dtype is int32"):
        layer(jnp.ones((2, K), jnp.int32))


@pytest.mark.parametrize("group_size", [-1, 32, 64, 128])
def test_marlin_linear_pads_any_shape(rng, group_size):
    # 200 x 100 is stored padded; the layer still maps [..., 200] -> [..., 100].
    layer = MarlinLinear(200, 100, bias_init=normal_init, group_size=group_size,
                         rngs=nnx.Rngs(0))
    w = layer.weight.get_value()
    assert (w.k, w.n, w.group_size) == (200, 100, group_size) and w.padded_shape != (200, 100)
    x = random_x(rng, 7, 200)
    y = layer(x)
    assert y.shape == (7, 100)
    assert rel_err(y, ref_linear(x, layer)) <= SAME_WEIGHT_TOL


def test_marlin_linear_rejects_what_the_kernel_cannot_take():
    with pytest.raises(ValueError, match="group_size = 96"):
        MarlinLinear(K, N, group_size=96, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="32-bit offsets"):  # refused before drawing 64 GiB
        MarlinLinear(2**17, 2**17, rngs=nnx.Rngs(0))


def test_matmul_dtype():
    assert matmul_dtype(None, jnp.float32) == jnp.float16
    assert matmul_dtype(None, jnp.bfloat16) == jnp.bfloat16
    assert matmul_dtype(jnp.bfloat16, jnp.float32) == jnp.bfloat16
    assert matmul_dtype(jnp.float32, jnp.bfloat16) == jnp.bfloat16
    assert matmul_dtype(jnp.float16, jnp.bfloat16) == jnp.float16


def test_bf16_marlin_linear(rng):
    # A bfloat16 layer keeps bfloat16: scales, activations into the kernel,
    # the fused bias and the result.
    linear = nnx.Linear(K, N, param_dtype=jnp.bfloat16, bias_init=normal_init, rngs=nnx.Rngs(2))
    layer = MarlinLinear.from_linear(linear, group_size=64)
    w = layer.weight.get_value()
    assert w.dtype == jnp.bfloat16 and layer.bias[...].dtype == jnp.bfloat16
    x = random_x(rng, 6, K, dtype=jnp.bfloat16)
    y = layer(x)
    assert y.dtype == jnp.bfloat16
    assert rel_err(y, ref_linear(x, layer)) <= BF16_SAME_WEIGHT_TOL
    y_float = np.asarray(linear(x.astype(np.float32)), np.float64)
    assert QUANT_ERR[0] <= rel_err(y, y_float) <= QUANT_ERR[1]


def test_from_linear_copies_bias_and_config():
    linear = nnx.Linear(K, N, dtype=jnp.float32, param_dtype=jnp.bfloat16, bias_init=normal_init,
                        rngs=nnx.Rngs(1))
    layer = MarlinLinear.from_linear(linear, group_size=-1)
    assert (layer.in_features, layer.out_features, layer.group_size) == (K, N, -1)
    assert layer.dtype == jnp.float32 and layer.param_dtype == jnp.bfloat16
    assert layer.bias[...].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(layer.bias[...]), np.asarray(linear.bias[...]))
    expected = jm.quantize(linear.kernel[...], group_size=-1)
    np.testing.assert_array_equal(np.asarray(layer.weight.get_value().qweight),
                                  np.asarray(expected.qweight))
    with pytest.raises(TypeError, match="nnx.Linear"):
        MarlinLinear.from_linear(nnx.LayerNorm(K, rngs=nnx.Rngs(0)))


class Block(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(K, rngs=rngs)
        self.up = nnx.Linear(K, N, rngs=rngs)
        self.down = nnx.Linear(N, K, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class ScaledLinear(nnx.Linear):
    """A subclass of nnx.Linear that does more than x @ W: quantize_model keeps it."""

    def __call__(self, x):
        return 0.5 * super().__call__(x)


class Model(nnx.Module):
    """Blocks in an nnx.List, layers in a plain dict and a tuple, one shared
    layer, a head of 100 features (stored padded) and a layer quantize_model
    must keep in float."""

    def __init__(self, rngs):
        self.blocks = nnx.List([Block(rngs) for _ in range(2)])
        self.extra = nnx.data({"proj": nnx.Linear(K, K, rngs=rngs)})
        self.pair = nnx.data((nnx.Linear(K, K, rngs=rngs), "not a layer"))
        self.shared = self.blocks[0].up
        self.scaled = ScaledLinear(K, K, rngs=rngs)
        self.head = nnx.Linear(K, 100, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        x = self.scaled(self.pair[0](self.extra["proj"](x)))
        return self.head(x), self.shared(x)


QUANTIZED = ["blocks/0/up", "blocks/0/down", "blocks/1/up", "blocks/1/down", "extra/proj",
             "pair/0", "head"]


def _is_variable(v):
    return isinstance(v, nnx.Variable)


def _paths(layers):
    return ["/".join(map(str, layer.path)) for layer in layers]


def test_concatenate_linears_with_bias(rng):
    # Three layers reading one input, with biases: one layer, the outputs side by side.
    layers = [nnx.Linear(96, n, rngs=nnx.Rngs(i), bias_init=nnx.initializers.normal(1.0))
              for i, n in enumerate((64, 32, 100))]
    x = random_x(rng, 3, 96, dtype=np.float32)
    joined = concatenate_linears(layers)
    assert type(joined) is nnx.Linear and (joined.in_features, joined.out_features) == (96, 196)
    want = np.concatenate([np.asarray(layer(x)) for layer in layers], axis=-1)
    np.testing.assert_allclose(np.asarray(joined(x)), want, rtol=1e-6, atol=1e-6)

    marlin = [MarlinLinear.from_linear(layer, group_size=32) for layer in layers]
    joined = concatenate_linears(marlin)
    assert type(joined) is MarlinLinear and joined.weight.get_value().shape == (96, 196)
    assert joined.bias.shape == (196,) and joined.group_size == 32
    want = np.concatenate([np.asarray(layer(x)) for layer in marlin], axis=-1)
    # The CPU kernel adds the bias to each column's sum before its one rounding: bit for bit.
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda m, x: m(x))(joined, x)), want)

    with pytest.raises(ValueError, match=r"the layers' use_bias differ \(True, False\)"):
        concatenate_linears([layers[0], nnx.Linear(96, 8, use_bias=False, rngs=nnx.Rngs(0))])
    with pytest.raises(TypeError, match="got Linear, MarlinLinear"):
        concatenate_linears([layers[0], marlin[1]])
    with pytest.raises(ValueError, match="at least one layer"):
        concatenate_linears([])


def test_quantize_model_replaces_nested_layers_and_warns_once(rng):
    model = Model(nnx.Rngs(0))
    x = random_x(rng, 8, K).astype(np.float32)
    head_before, shared_before = (np.asarray(a, np.float64) for a in model(x))
    scaled = model.scaled
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, summary = quantize_model(model, summary=True)
    assert out is model
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "scaled: kernel [256, 256]: ScaledLinear is a subclass of nnx.Linear" in message
    for block in model.blocks:
        assert isinstance(block.up, MarlinLinear) and isinstance(block.down, MarlinLinear)
        assert isinstance(block.norm, nnx.LayerNorm)
    assert isinstance(model.extra["proj"], MarlinLinear)
    assert isinstance(model.pair, tuple) and isinstance(model.pair[0], MarlinLinear)
    assert model.pair[1] == "not a layer"
    assert model.shared is model.blocks[0].up  # shared: quantized once, replaced in both places
    assert model.scaled is scaled and type(scaled) is ScaledLinear
    assert isinstance(model.head, MarlinLinear)  # 100 features: stored padded to 128
    assert model.head.weight.get_value().padded_shape == (K, 128)

    assert isinstance(summary, QuantizeSummary)
    assert _paths(summary.replaced) == QUANTIZED
    assert _paths(summary.skipped) == ["scaled"] and summary.excluded == ()
    assert [layer.padded for layer in summary.replaced] == [False] * 6 + [True]
    assert summary.bytes_before == 4 * (4 * K * N + 2 * K * K + K * 100)
    quantized = ([model.extra["proj"], model.pair[0], model.head] +
                 [b.up for b in model.blocks] + [b.down for b in model.blocks])
    assert summary.bytes_after == sum(layer.weight.get_value().nbytes for layer in quantized)
    text = str(summary)
    assert "7 nnx.Linear -> MarlinLinear, 1 kept in float" in text
    assert "padded: head [256, 100] -> [256, 128]" in text

    # Up to six quantized layers lie on the way to an output; their errors add up.
    head_after, shared_after = model(x)
    assert QUANT_ERR[0] <= rel_err(shared_after, shared_before) <= 2 * QUANT_ERR[1]
    assert QUANT_ERR[0] <= rel_err(head_after, head_before) <= 2 * QUANT_ERR[1]


def test_quantize_model_filter_and_root_linear():
    model = Model(nnx.Rngs(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the subclass is excluded, so nothing to warn about
        _, summary = quantize_model(model, filter=lambda path, _: path[0] == "blocks",
                                    group_size=-1, summary=True)
    assert _paths(summary.replaced) == QUANTIZED[:4]
    assert sorted("/".join(map(str, p)) for p in summary.excluded) == ["extra/proj", "head",
                                                                       "pair/0", "scaled"]
    assert model.blocks[1].down.group_size == -1
    assert type(model.extra["proj"]) is nnx.Linear

    layer = quantize_model(nnx.Linear(K, N, rngs=nnx.Rngs(0)), group_size=32)
    assert isinstance(layer, MarlinLinear) and layer.weight.get_value().group_size == 32

    scaled = ScaledLinear(K, N, rngs=nnx.Rngs(0))
    with pytest.warns(UserWarning, match="ScaledLinear is a subclass of nnx.Linear"):
        assert quantize_model(scaled) is scaled
    with pytest.raises(ValueError, match="group_size = 96"):
        quantize_model(Model(nnx.Rngs(0)), group_size=96)


def test_quantize_model_keeps_layers_too_large_for_the_kernel():
    # Padding takes every shape but those past the kernel's 32-bit offsets;
    # nnx.eval_shape builds the 64 GiB layer without allocating it.
    class Big(nnx.Module):
        def __init__(self, rngs):
            self.small = nnx.Linear(K, N, rngs=rngs)
            self.huge = nnx.Linear(2**17, 2**17, rngs=rngs)

    with pytest.warns(UserWarning, match=r"huge: kernel \[131072, 131072\]: .*32-bit offsets"):
        abstract, summary = nnx.eval_shape(lambda: quantize_model(Big(nnx.Rngs(0)), summary=True))
    assert _paths(summary.replaced) == ["small"] and _paths(summary.skipped) == ["huge"]
    assert type(abstract.huge) is nnx.Linear


def test_quantize_model_keeps_a_bf16_model_bf16(rng):
    model = Model(nnx.Rngs(0))
    # Cast the float32 model's parameters to bfloat16 (and so its layers' param_dtype).
    for _, linear in nnx.iter_graph(model):
        if isinstance(linear, nnx.Linear):
            linear.param_dtype = jnp.bfloat16
    nnx.update(model, jax.tree.map(lambda a: a.astype(jnp.bfloat16), nnx.state(model, nnx.Param)))
    x = random_x(rng, 8, K, dtype=jnp.bfloat16)
    _, shared_before = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the subclass
        quantize_model(model, group_size=64)
    for layer in (model.head, model.pair[0], model.blocks[1].down):
        assert layer.weight.get_value().dtype == jnp.bfloat16
    head, shared = model(x)
    assert head.dtype == shared.dtype == jnp.bfloat16 and head.shape == (8, 100)
    # Up to five quantized layers on the way (test above), in bfloat16.
    shared_err = rel_err(shared, np.asarray(shared_before, np.float64))
    assert QUANT_ERR[0] <= shared_err <= 2 * QUANT_ERR[1]


def test_quantize_model_progress_bar(capsys):
    class Many(nnx.Module):
        def __init__(self, count, rngs):
            self.layers = nnx.List([nnx.Linear(128, 64, rngs=rngs) for _ in range(count)])

    # progress=None: a bar from 8 layers up, only on a terminal (captured
    # stderr is not one, as in a log file).
    quantize_model(Many(8, nnx.Rngs(0)))
    assert "quantize_model" not in capsys.readouterr().err
    quantize_model(Many(8, nnx.Rngs(0)), progress=True)
    assert "quantize_model: 100%" in capsys.readouterr().err
    quantize_model(Many(8, nnx.Rngs(0)), progress=False)
    assert "quantize_model" not in capsys.readouterr().err


def test_quantize_model_is_traceable():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the subclass
        abstract, summary = nnx.eval_shape(
            lambda: quantize_model(Model(nnx.Rngs(0)), group_size=128, summary=True))
    assert _paths(summary.replaced) == QUANTIZED
    up = abstract.blocks[1].up
    assert isinstance(up, MarlinLinear)
    w = up.weight.get_value()
    assert isinstance(w, jm.MarlinWeight)
    assert w.qweight == jax.ShapeDtypeStruct((K // 16, 2 * N), jnp.int32)
    assert w.scales == jax.ShapeDtypeStruct((K // 128, N), jnp.float16)
    leaves = jax.tree.leaves(nnx.state(abstract))
    assert leaves and all(isinstance(a, jax.ShapeDtypeStruct) for a in leaves)


def _quantized_model(seed):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the subclass
        return quantize_model(Model(nnx.Rngs(seed)))


def _assert_same_outputs(a, b):
    for ya, yb in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(ya), np.asarray(yb))


def test_jit_split_merge_state_update(rng):
    model = _quantized_model(0)
    x = random_x(rng, 4, K).astype(np.float32)
    expected = model(x)
    _assert_same_outputs(nnx.jit(lambda m, x: m(x))(model, x), expected)

    graphdef, state = nnx.split(model)
    _assert_same_outputs(jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, x), expected)

    # Packed weights are their own filterable kind of state.
    _, weights, rest = nnx.split(model, QuantizedWeight, ...)
    packed = jax.tree.leaves(weights, is_leaf=lambda v: isinstance(v, jm.MarlinWeight))
    assert len(packed) == 7 and all(isinstance(w, jm.MarlinWeight) for w in packed)
    rest_kinds = {type(v) for v in jax.tree.leaves(rest, is_leaf=_is_variable)}
    assert QuantizedWeight not in rest_kinds and nnx.Param in rest_kinds

    other = _quantized_model(1)
    assert not np.array_equal(np.asarray(other(x)[1]), np.asarray(expected[1]))
    nnx.update(other, nnx.state(model))
    _assert_same_outputs(other(x), expected)


class FloatBranch(nnx.Module):
    """A LayerNorm feeding a float head, next to a MarlinLinear on the raw input."""

    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(K, rngs=rngs)
        self.head = nnx.Linear(K, 100, rngs=rngs)
        self.proj = MarlinLinear(K, N, bias_init=normal_init, rngs=rngs)

    def __call__(self, x):
        return self.head(self.norm(x)), self.proj(x)


def test_grad_reaches_float_params_only(rng):
    # nnx.grad over nnx.Param never touches the QuantizedWeight; the bias and
    # the float layers next to a MarlinLinear differentiate as usual.
    model = FloatBranch(nnx.Rngs(0))
    x = random_x(rng, 6, K).astype(np.float32)

    def loss(m):
        head, proj = m(x)
        return jnp.sum(head**2) + jnp.sum(proj)

    grads = nnx.grad(loss)(model)
    kinds = {type(v) for v in jax.tree.leaves(grads, is_leaf=_is_variable)}
    assert kinds == {nnx.Param}
    assert "weight" not in grads["proj"]
    # d sum(proj) / d bias = one per row of x
    np.testing.assert_allclose(np.asarray(grads["proj"]["bias"][...]), np.full(N, 6.0))
    for name in ("scale", "bias"):
        g = np.asarray(grads["norm"][name][...])
        assert np.isfinite(g).all() and np.abs(g).max() > 0
    assert np.abs(np.asarray(grads["head"]["kernel"][...])).max() > 0


def _restore_target(abstract):
    """``abstract`` with the CPU device these tests run on as every leaf's sharding.

    Without a sharding orbax restores onto the device recorded at save time
    (cpu:0), which it looks up among jax.local_devices(): the GPUs on a GPU
    machine.
    """
    sharding = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                        abstract)


def test_orbax_roundtrip_nnx(tmp_path, rng):
    model = _quantized_model(0)
    x = random_x(rng, 4, K).astype(np.float32)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "model", nnx.state(model))
    checkpointer.wait_until_finished()

    abstract = nnx.eval_shape(lambda: _quantized_model(7))
    graphdef, abstract_state = nnx.split(abstract)
    restored_state = checkpointer.restore(tmp_path / "model", _restore_target(abstract_state))
    restored = nnx.merge(graphdef, restored_state)
    assert isinstance(restored.blocks[0].up.weight.get_value(), jm.MarlinWeight)
    _assert_same_outputs(restored(x), model(x))


# --- linen ---------------------------------------------------------------------


def test_marlin_dense_init_apply_under_jit(rng):
    x = random_x(rng, 2, 3, K)
    key = jax.random.key(4)
    dense = nn.Dense(N, bias_init=normal_init)
    layer = MarlinDense(N, bias_init=normal_init)
    variables = jax.jit(layer.init)(key, x)
    float_params = dense.init(key, x)["params"]

    assert set(variables) == {"params", "marlin"}
    assert set(variables["params"]) == {"bias"}
    w = variables["marlin"]["weight"]
    expected = jm.quantize(float_params["kernel"], group_size=128)
    np.testing.assert_array_equal(np.asarray(w.qweight), np.asarray(expected.qweight))
    np.testing.assert_array_equal(np.asarray(w.scales), np.asarray(expected.scales))

    y = jax.jit(layer.apply)(variables, x)
    assert y.shape == (2, 3, N) and y.dtype == jnp.float16
    ref = jm.reference.matmul(x, w, variables["params"]["bias"].astype(jnp.float16))
    assert rel_err(y, np.asarray(ref, np.float64)) <= SAME_WEIGHT_TOL
    y_float = dense.apply({"params": float_params}, x.astype(np.float32))
    assert QUANT_ERR[0] <= rel_err(y, np.asarray(y_float, np.float64)) <= QUANT_ERR[1]

    with pytest.raises(ValueError, match="group_size = 96"):
        MarlinDense(N, group_size=96).init(key, x)


@pytest.mark.parametrize("group_size", [32, 64])
def test_marlin_dense_bf16_any_shape(rng, group_size):
    x = random_x(rng, 5, 200, dtype=jnp.bfloat16)
    layer = MarlinDense(100, param_dtype=jnp.bfloat16, bias_init=normal_init,
                        group_size=group_size)
    variables = layer.init(jax.random.key(0), x)
    w = variables["marlin"]["weight"]
    assert w.dtype == jnp.bfloat16 and (w.k, w.n) == (200, 100) and w.padded_shape != (200, 100)
    y = layer.apply(variables, x)
    assert y.shape == (5, 100) and y.dtype == jnp.bfloat16
    ref = jm.reference.matmul(x, w, variables["params"]["bias"])
    assert rel_err(y, np.asarray(ref, np.float64)) <= BF16_SAME_WEIGHT_TOL


class LinenModel(nn.Module):
    """Float or 4-bit depending on ``dense``; explicit names so the trees match."""

    dense: type = nn.Dense

    @nn.compact
    def __call__(self, x):
        h = jax.nn.gelu(self.dense(N, name="up")(nn.LayerNorm(name="norm")(x)))
        h = self.dense(K, use_bias=False, name="down")(h)
        return nn.Dense(100, name="head")(x + h)


def test_params_to_marlin_converts_a_float_model(rng):
    x = random_x(rng, 5, K).astype(np.float32)
    float_model, marlin_model = LinenModel(), LinenModel(dense=MarlinDense)
    params = float_model.init(jax.random.key(0), x)["params"]

    huge = {"kernel": jax.ShapeDtypeStruct((2**17, 2**17), jnp.float32)}
    with pytest.raises(ValueError, match=r"huge: kernel \[131072, 131072\]"):
        params_to_marlin({**params, "huge": huge})
    everything = params_to_marlin(params, dtype=jnp.bfloat16)
    assert everything["marlin"]["head"]["weight"].padded_shape == (K, 128)  # 100 features
    assert everything["marlin"]["up"]["weight"].dtype == jnp.bfloat16

    def not_head(path, _):
        return path[0] != "head"

    variables = params_to_marlin(params, filter=not_head)
    assert set(variables["marlin"]) == {"up", "down"}
    assert set(variables["params"]["up"]) == {"bias"} and variables["params"]["down"] == {}
    assert variables["params"]["head"]["kernel"] is params["head"]["kernel"]  # left as it was
    assert variables["params"]["norm"]["scale"] is params["norm"]["scale"]

    single = dense_to_marlin(params["up"])
    np.testing.assert_array_equal(np.asarray(single["marlin"]["weight"].qweight),
                                  np.asarray(variables["marlin"]["up"]["weight"].qweight))
    with pytest.raises(ValueError, match="'kernel'"):
        dense_to_marlin(params["norm"])

    y = marlin_model.apply(variables, x)
    y_float = float_model.apply({"params": params}, x)
    assert rel_err(y, np.asarray(y_float, np.float64)) <= QUANT_ERR[1]
    abstract = jax.eval_shape(lambda p: params_to_marlin(p, filter=not_head), params)
    assert abstract["marlin"]["up"]["weight"].qweight == jax.ShapeDtypeStruct((K // 16, 2 * N),
                                                                               jnp.int32)


def test_orbax_roundtrip_linen(tmp_path, rng):
    x = random_x(rng, 5, K).astype(np.float32)
    model = LinenModel(dense=MarlinDense)
    variables = jax.jit(model.init)(jax.random.key(0), x)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "linen", variables)
    checkpointer.wait_until_finished()

    target = _restore_target(jax.eval_shape(model.init, jax.random.key(1), x))
    restored = checkpointer.restore(tmp_path / "linen", target)
    assert isinstance(restored["marlin"]["up"]["weight"], jm.MarlinWeight)
    np.testing.assert_array_equal(np.asarray(model.apply(restored, x)),
                                  np.asarray(model.apply(variables, x)))


@pytest.mark.parametrize("group_size", [128, -1])
def test_megatron_mlp_shards_through_partition_specs(group_size):
    # nnx.with_partitioning on the float kernels -> quantize_model keeps the
    # annotation on QuantizedWeight -> get_partition_spec gives per-leaf specs
    # -> the usual with_sharding_constraint flow: column-parallel up,
    # row-parallel down, exactly one all-reduce and no all-gather.
    from jax.sharding import AxisType

    from jax_marlin.flax import get_partition_spec

    init = nnx.initializers.lecun_normal()

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(256, 1024, kernel_init=nnx.with_partitioning(init, (None, "model")),
                                 rngs=rngs)
            self.down = nnx.Linear(1024, 256, kernel_init=nnx.with_partitioning(init, ("model", None)),
                                   rngs=rngs)

        def __call__(self, x):
            return self.down(jax.nn.relu(self.up(x)))

    mesh = jax.make_mesh((8,), ("model",), axis_types=(AxisType.Auto,), devices=jax.devices("cpu"))
    x = jax.random.normal(jax.random.key(1), (16, 256), jnp.float16)
    with jax.set_mesh(mesh):
        model = quantize_model(MLP(nnx.Rngs(0)), group_size=group_size)
        graphdef, state = nnx.split(model)
        specs = get_partition_spec(state)
        down = specs["down"]["weight"].get_value()
        assert down.qweight == P("model", None)
        assert down.scales == (P("model", None) if group_size == 128 else P(None, None))

        @jax.jit
        def forward(state, x):
            state = jax.lax.with_sharding_constraint(state, specs)
            return nnx.merge(graphdef, state)(x)

        y = forward(state, x)
        hlo = forward.lower(state, x).compile().as_text()
    assert hlo.count("all-reduce(") == 1 and hlo.count("all-gather(") == 0
    single = jax.device_put(state, jax.devices("cpu")[0])
    ref = np.asarray(nnx.merge(graphdef, single)(x), np.float64)
    # 8 float16 partial sums added in float16: a few float16 roundings.
    assert np.linalg.norm(np.asarray(y, np.float64) - ref) / np.linalg.norm(ref) < 4 * 2.0**-11


@pytest.mark.parametrize("form", ["residual", "rms_norm", "swiglu"])
def test_marlin_dense_fusions(rng, form):
    """The fusions of jm.matmul through MarlinDense: the same result as the unfused
    composition (jax_marlin.fusion) around the layer's own weight, in float64; with
    swiglu the layer's k is half the inputs' width."""
    width = 2 * K if form == "swiglu" else K
    x = random_x(rng, 3, width, dtype=np.float32)  # cast to the weight's float16 inside
    layer = MarlinDense(N, bias_init=normal_init)
    kwargs = {"swiglu": True} if form == "swiglu" else {}
    variables = layer.init(jax.random.key(1), x, **kwargs)
    w = variables["marlin"]["weight"]
    assert (w.k, w.n) == (K, N)
    bias = variables["params"]["bias"].astype(jnp.float16)
    x16 = jnp.asarray(x, jnp.float16)
    if form == "residual":
        kwargs["residual"] = random_x(rng, 3, N, dtype=np.float32)
        x_prime = x16
    elif form == "rms_norm":
        kwargs["rms_norm_weight"] = random_x(rng, K, dtype=np.float32)
        kwargs["rms_norm_eps"] = 1e-5
        x_prime = fusion.rms_norm(x16, jnp.asarray(kwargs["rms_norm_weight"], jnp.float16),
                                  1e-5, K)
    else:
        x_prime = fusion.swiglu(x16)
    y = jax.jit(lambda v, x: layer.apply(v, x, **kwargs))(variables, x)
    assert y.shape == (3, N) and y.dtype == jnp.float32  # dtype=None: the inputs' dtype
    ref = np.asarray(x_prime, np.float64) @ np.asarray(jm.dequantize(w, jnp.float32), np.float64)
    ref += np.asarray(bias, np.float64)
    if form == "residual":
        ref += np.asarray(jnp.asarray(kwargs["residual"], jnp.float16), np.float64)
    assert rel_err(y, ref) <= SAME_WEIGHT_TOL
    if form != "swiglu":  # (with swiglu, x [3, 2 K] fits no other k)
        # Without the fusion the layer computes something else: the test can fail.
        assert rel_err(layer.apply(variables, x16), ref) > 10 * SAME_WEIGHT_TOL


def test_marlin_dense_swiglu_odd_width_raises(rng):
    x = random_x(rng, 2, 2 * K + 1)
    with pytest.raises(ValueError, match="odd last dimension 513"):
        MarlinDense(N).init(jax.random.key(0), x, swiglu=True)
