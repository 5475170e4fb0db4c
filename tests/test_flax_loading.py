"""jax_marlin.flax.load_quantized: loaded Marlin weights into an nnx model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")

from flax import nnx  # noqa: E402

import jax_marlin as jm  # noqa: E402
from conftest import FP16_U, imported_weight, random_weight, random_x, rel_err  # noqa: E402
from jax_marlin.flax import (  # noqa: E402
    MarlinLinear,
    QuantizedWeight,
    get_partition_spec,
    load_quantized,
    quantized_weights,
)

TOL = FP16_U + 1e-5
K, H = 256, 128


class Block(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(K, H, rngs=rngs)
        self.down = nnx.Linear(H, K, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


class Model(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([Block(rngs), Block(rngs)])
        self.lm_head = nnx.Linear(K, 64, rngs=rngs)

    def __call__(self, x):
        for block in self.layers:
            x = block(x)
        return self.lm_head(x)


def checkpoint(rng) -> dict[str, jm.MarlinWeight]:
    """Weights named as a transformers checkpoint would name them (prefix "model.")."""
    return {f"model.layers.{i}.{name}": jm.quantize(random_weight(rng, *shape), group_size=64)
            for i in range(2) for name, shape in (("up", (K, H)), ("down", (H, K)))}


def assert_same_weight(a: jm.MarlinWeight, b: jm.MarlinWeight):
    assert (a.k, a.n, a.group_size) == (b.k, b.n, b.group_size)
    np.testing.assert_array_equal(np.asarray(a.qweight), np.asarray(b.qweight))
    np.testing.assert_array_equal(np.asarray(a.scales), np.asarray(b.scales))


def to_checkpoint_name(path: str) -> str | None:
    return None if path == "lm_head" else "model." + path


def test_load_quantized_replaces_the_named_layers(rng):
    weights = checkpoint(rng)
    model = Model(nnx.Rngs(0))
    bias = model.layers[0].up.bias[...]
    lm_head = model.lm_head
    load_quantized(model, weights, name_map=to_checkpoint_name)
    for i in range(2):
        for name in ("up", "down"):
            layer = getattr(model.layers[i], name)
            assert isinstance(layer, MarlinLinear)
            assert isinstance(layer.weight, QuantizedWeight)
            assert_same_weight(layer.weight.get_value(), weights[f"model.layers.{i}.{name}"])
    assert model.lm_head is lm_head  # name_map -> None: kept in float
    assert model.layers[0].down.bias is None
    np.testing.assert_array_equal(np.asarray(model.layers[0].up.bias[...]), np.asarray(bias))

    # Against float64 of the exact dequantized weights (the float lm_head taken as it is).
    x = random_x(rng, 3, K)
    y = nnx.jit(lambda m, x: m.layers[0](x))(model, x)
    block = model.layers[0]
    w_up = np.asarray(jm.dequantize(block.up.weight.get_value(), jnp.float32), np.float64)
    w_down = np.asarray(jm.dequantize(block.down.weight.get_value(), jnp.float32), np.float64)
    b_up = np.asarray(block.up.bias[...].astype(jnp.float16), np.float64)
    hidden = np.maximum(np.asarray(x, np.float64) @ w_up + b_up, 0)
    # The hidden activations are rounded to float16 between the layers, in the
    # reference too; the kernel's rounding of them may differ from it by one
    # unit, so two roundings of the first product, and one of the second.
    ref = np.asarray(hidden.astype(np.float16), np.float64) @ w_down
    assert rel_err(y, ref) <= 3 * TOL


def test_load_quantized_into_an_abstract_model(rng):
    weights = checkpoint(rng)
    model = nnx.eval_shape(lambda: Model(nnx.Rngs(0)))
    load_quantized(model, weights, name_map=to_checkpoint_name)
    layer = model.layers[1].up
    assert isinstance(layer, MarlinLinear)
    assert_same_weight(layer.weight.get_value(), weights["model.layers.1.up"])
    assert isinstance(layer.bias.get_value(), jax.ShapeDtypeStruct)  # still to be loaded
    assert isinstance(model.lm_head.kernel.get_value(), jax.ShapeDtypeStruct)


def test_load_quantized_model_splits_and_merges(rng):
    model = load_quantized(Model(nnx.Rngs(0)), checkpoint(rng), name_map=to_checkpoint_name)
    graphdef, quantized, rest = nnx.split(model, QuantizedWeight, ...)
    assert len(jax.tree.leaves(quantized)) == 8  # qweight and scales of four layers
    x = random_x(rng, 2, K)
    np.testing.assert_array_equal(np.asarray(nnx.merge(graphdef, quantized, rest)(x)),
                                  np.asarray(model(x)))


def test_quantized_weights_round_trip_through_a_gptq_checkpoint(rng, tmp_path):
    # A model quantized once -> its weights -> a GPTQ directory -> another
    # instance of the model: the same outputs, bit for bit.
    from jax_marlin import formats

    model = Model(nnx.Rngs(0))
    model.layers[1].down = MarlinLinear.from_linear(model.layers[1].down, group_size=64)
    for block in model.layers:
        block.up = MarlinLinear.from_linear(block.up, group_size=64)
    weights = quantized_weights(model)
    assert sorted(weights) == ["layers.0.up", "layers.1.down", "layers.1.up"]
    formats.save_gptq_checkpoint(tmp_path, weights)
    other = Model(nnx.Rngs(0))  # the same float parameters, the layers in float
    load_quantized(other, formats.load_checkpoint(tmp_path),
                           name_map=lambda path: path if path in weights else None)
    x = jnp.asarray(rng.standard_normal((3, K)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(other(x)), np.asarray(model(x)))
    assert isinstance(other.layers[0].down, nnx.Linear)  # left in float, as in `model`


def test_load_quantized_lists_every_problem(rng):
    weights = checkpoint(rng)
    weights["model.layers.1.down"] = jm.quantize(random_weight(rng, K, H), group_size=64)
    del weights["model.layers.0.up"]
    weights["model.layers.2.up"] = weights["model.layers.1.up"]
    with pytest.raises(ValueError) as e:
        load_quantized(Model(nnx.Rngs(0)), weights, name_map=to_checkpoint_name)
    message = str(e.value)
    assert "layers.0.up: no weight 'model.layers.0.up'" in message
    assert ("layers.1.down: [in_features, out_features] = [128, 256], but "
            "weights['model.layers.1.down'] is [k, n] = [256, 128]") in message
    assert "weights['model.layers.2.up']: no layer maps to it" in message
    # without a name_map the model's own paths are the names: nothing matches
    with pytest.raises(ValueError, match="lm_head: no weight 'lm_head'"):
        load_quantized(Model(nnx.Rngs(0)), checkpoint(rng))


def test_load_quantized_refuses_linear_subclasses(rng):
    class Scaled(nnx.Linear):
        def __call__(self, x):
            return 2 * super().__call__(x)

    model = nnx.Dict(proj=Scaled(K, H, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="proj: a Scaled, a subclass of nnx.Linear"):
        load_quantized(model, {"proj": jm.quantize(random_weight(rng, K, H))})


# --- zero points and act-order -------------------------------------------------------


def imported_checkpoint(rng):
    """As :func:`checkpoint`, with zero points and act-order (as AWQ / GPTQ desc_act give)."""
    weights, dense = {}, {}
    for i in range(2):
        for name, (k, n) in (("up", (K, H)), ("down", (H, K))):
            weights[f"model.layers.{i}.{name}"], dense[f"model.layers.{i}.{name}"] = \
                imported_weight(rng, k, n, 64)
    return weights, dense


def test_load_quantized_zeros_and_act_order_and_orbax(rng, tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    weights, dense = imported_checkpoint(rng)
    model = load_quantized(Model(nnx.Rngs(0)), weights, name_map=to_checkpoint_name)
    x = random_x(rng, 3, K)
    layer = model.layers[0].up
    ref = np.asarray(x, np.float64) @ dense["model.layers.0.up"] + np.asarray(
        layer.bias[...].astype(jnp.float16), np.float64)
    assert rel_err(nnx.jit(lambda m, x: m(x))(layer, x), ref) <= 2 * FP16_U

    graphdef, quantized, rest = nnx.split(model, QuantizedWeight, ...)
    assert len(jax.tree.leaves(quantized)) == 16  # qweight, scales, perm, zeros of four layers

    # orbax: the abstract target comes from loading abstract weights into an abstract model.
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "model", nnx.state(model))
    checkpointer.wait_until_finished()
    abstract = nnx.eval_shape(lambda: load_quantized(
        Model(nnx.Rngs(1)), jax.tree.map(jnp.zeros_like, weights), name_map=to_checkpoint_name))
    graphdef, abstract_state = nnx.split(abstract)
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=cpu),
                          abstract_state)
    restored = nnx.merge(graphdef, checkpointer.restore(tmp_path / "model", target))
    w, w2 = model.layers[1].down.weight.get_value(), restored.layers[1].down.weight.get_value()
    for field in ("qweight", "scales", "perm", "zeros"):
        np.testing.assert_array_equal(np.asarray(getattr(w2, field)), np.asarray(getattr(w, field)))
    np.testing.assert_array_equal(np.asarray(restored(x)), np.asarray(model(x)))


def test_get_partition_spec_covers_zeros_and_perm(rng):
    # Column parallel over 8 host devices: zeros follow the scales, perm is replicated.
    P = jax.sharding.PartitionSpec
    w, dense = imported_weight(rng, K, 512, 64)
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
    mesh = jax.make_mesh((8,), ("model",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices("cpu"))
    x = random_x(rng, 4, K)
    with jax.set_mesh(mesh):
        model = nnx.Dict(up=nnx.Linear(K, 512, use_bias=False, kernel_init=init,
                                       rngs=nnx.Rngs(0)))
        load_quantized(model, {"up": w})
        graphdef, state = nnx.split(model)
        specs = get_partition_spec(state)
        spec = specs["up"]["weight"].get_value()
        assert (spec.qweight, spec.scales, spec.zeros, spec.perm) == (
            P(None, "model"), P(None, "model"), P(None, "model"), P(None))
        # Loaded weights live on one device: place them as the specs say.
        state = jax.device_put(state, jax.tree.map(
            lambda s: jax.sharding.NamedSharding(mesh, s), specs,
            is_leaf=lambda s: isinstance(s, P)))

        @jax.jit
        def forward(state, x):
            state = jax.lax.with_sharding_constraint(state, specs)
            return nnx.merge(graphdef, state)["up"](x)

        y = forward(state, x)
        hlo = forward.lower(state, x).compile().as_text()
    assert "all-reduce(" not in hlo and "all-gather(" not in hlo
    assert rel_err(y, np.asarray(x, np.float64) @ dense) <= 2 * FP16_U
