"""jax_marlin.formats files: load_checkpoint (config.json + safetensors shards), save / load."""

from __future__ import annotations

import json
import pathlib
import re

import jax.numpy as jnp
import numpy as np
import pytest

safetensors_numpy = pytest.importorskip("safetensors.numpy")

import jax_marlin as jm  # noqa: E402
from checkpoint_writers import (  # noqa: E402
    act_order_groups,
    awq_tensors,
    compressed_tensors_tensors,
    gptq_tensors,
    groups_of_rows,
    quantize,
    reference_weight,
)
from conftest import imported_weight, random_weight  # noqa: E402
from jax_marlin import formats  # noqa: E402

# Three layers: the first whole in the first file, the second in the second,
# the third split across both (transformers shards by tensor, so a layer's
# tensors may lie in different files).
LAYERS = {"model.layers.0.mlp.up_proj": (256, 192), "model.layers.0.mlp.down_proj": (192, 256),
          "model.layers.1.self_attn.q_proj": (256, 128)}
FLOAT_TENSORS = {"model.embed_tokens.weight": np.ones((8, 256), np.float16),
                 "lm_head.weight": np.ones((8, 256), np.float16)}

GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": True,
               "desc_act": False, "checkpoint_format": "gptq"}
AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
              "version": "gemm"}
CT_CONFIG = {"quant_method": "compressed-tensors", "format": "pack-quantized",
             "config_groups": {"group_0": {
                 "targets": ["Linear"], "input_activations": None, "output_activations": None,
                 "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                             "group_size": 64, "actorder": None, "dynamic": False}}},
             "ignore": ["lm_head"], "quantization_status": "compressed"}


def layer_tensors(rng, method, k, n, scale_dtype=np.float16, **kw):
    """One symmetric layer in ``method``'s layout, and its exact float64 weight."""
    g_idx = groups_of_rows(k, 64)
    q, zeros, scales = quantize(random_weight(rng, k, n), g_idx, symmetric=True,
                                scale_dtype=scale_dtype)
    writer = {"gptq": lambda: gptq_tensors(q, zeros, scales, g_idx),
              "awq": lambda: awq_tensors(q, zeros, scales),
              "compressed-tensors": lambda: compressed_tensors_tensors(q, zeros, scales, **kw)}
    return writer[method](), reference_weight(q, zeros, scales, g_idx)


def write_checkpoint(path: pathlib.Path, config, layers: dict[str, dict[str, np.ndarray]]):
    """config.json and two shards: the first layer in one, the second in the other, others split."""
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama",
                                                  "quantization_config": config}))
    shards: list[dict[str, np.ndarray]] = [dict(FLOAT_TENSORS), {}]
    for i, (name, tensors) in enumerate(layers.items()):
        for j, (suffix, t) in enumerate(tensors.items()):
            shard = i if i < 2 else j % 2
            shards[shard][f"{name}.{suffix}"] = t
    for i, shard in enumerate(shards):
        safetensors_numpy.save_file(shard, str(path / f"model-0000{i + 1}-of-00002.safetensors"))


def make_checkpoint(rng, path, method, config, scale_dtype=np.float16):
    layers, refs = {}, {}
    for name, (k, n) in LAYERS.items():
        layers[name], refs[name] = layer_tensors(rng, method, k, n, scale_dtype)
    write_checkpoint(path, config, layers)
    return layers, refs


@pytest.mark.parametrize("method, config", [("gptq", GPTQ_CONFIG), ("awq", AWQ_CONFIG),
                                            ("compressed-tensors", CT_CONFIG)])
def test_load_checkpoint(rng, tmp_path, capsys, method, config):
    _, refs = make_checkpoint(rng, tmp_path, method, config)
    weights = formats.load_checkpoint(tmp_path)
    assert sorted(weights) == sorted(LAYERS)
    for name, ref in refs.items():
        w = weights[name]
        assert w.shape == LAYERS[name] and w.group_size == 64 and w.dtype == np.float16
        np.testing.assert_array_equal(np.asarray(jm.dequantize(w, jnp.float32)), ref)
    # the progress bar stays silent when stderr is not a terminal
    assert capsys.readouterr().err == ""


def test_load_checkpoint_bf16_scales_and_the_awq_key_names(rng, tmp_path):
    config = {"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": True,
              "version": "GEMM"}
    _, refs = make_checkpoint(rng, tmp_path, "awq", config, scale_dtype=jnp.bfloat16)
    weights = formats.load_checkpoint(tmp_path)
    for name, ref in refs.items():
        assert weights[name].dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(jm.dequantize(weights[name], jnp.float32)), ref)


def test_load_checkpoint_picks_each_layers_group_size(rng, tmp_path):
    # Two schemes, groups of 64 and per column: each layer's scales say which is its own.
    config = json.loads(json.dumps(CT_CONFIG))
    config["config_groups"]["group_1"] = json.loads(json.dumps(config["config_groups"]["group_0"]))
    config["config_groups"]["group_1"]["weights"].update(strategy="channel", group_size=None)
    k, n = 256, 128
    q, zeros, scales = quantize(random_weight(rng, k, n), groups_of_rows(k, -1), symmetric=True)
    per_column = compressed_tensors_tensors(q, zeros, scales)
    grouped, ref = layer_tensors(rng, "compressed-tensors", k, n)
    write_checkpoint(tmp_path, config, {"grouped": grouped, "per_column": per_column})
    weights = formats.load_checkpoint(tmp_path)
    assert weights["grouped"].group_size == 64 and weights["per_column"].group_size == -1
    np.testing.assert_array_equal(np.asarray(jm.dequantize(weights["grouped"], jnp.float32)), ref)


def test_load_checkpoint_act_order_and_zero_points(rng, tmp_path):
    k, n = 256, 128
    g_idx = act_order_groups(rng, k, 64)
    q, zeros, scales = quantize(random_weight(rng, k, n), g_idx, symmetric=False)
    write_checkpoint(tmp_path, dict(GPTQ_CONFIG, desc_act=True, sym=False),
                     {"blocks.0.up": gptq_tensors(q, zeros, scales, g_idx)})
    w = formats.load_checkpoint(tmp_path)["blocks.0.up"]
    assert w.perm is not None and w.zeros is not None
    np.testing.assert_array_equal(np.asarray(jm.dequantize(w, jnp.float32)),
                                  reference_weight(q, zeros, scales, g_idx))
    # The Marlin-native file keeps both, bit for bit.
    formats.save(tmp_path / "marlin.safetensors", {"up": w})
    loaded = formats.load(tmp_path / "marlin.safetensors")["up"]
    for field in ("qweight", "scales", "perm", "zeros"):
        np.testing.assert_array_equal(np.asarray(getattr(loaded, field)),
                                      np.asarray(getattr(w, field)))


def test_load_checkpoint_bad_g_idx_names_the_layer(rng, tmp_path):
    k, n = 256, 128
    g_idx = act_order_groups(rng, k, 64)
    q, zeros, scales = quantize(random_weight(rng, k, n), g_idx, symmetric=True)
    g_idx[np.flatnonzero(g_idx == 0)[0]] = 3
    write_checkpoint(tmp_path, dict(GPTQ_CONFIG, desc_act=True),
                     {"blocks.0.up": gptq_tensors(q, zeros, scales, g_idx)})
    with pytest.raises(ValueError, match="layer 'blocks.0.up': GPTQ: g_idx does not put"):
        formats.load_checkpoint(tmp_path)


@pytest.mark.parametrize("method, config, change, message", [
    ("gptq", GPTQ_CONFIG, {"bits": 8}, "quantization_config.bits = 8: only 4-bit"),
    ("gptq", GPTQ_CONFIG, {"checkpoint_format": "gptq_v2"},
     "quantization_config.checkpoint_format = 'gptq_v2' is not supported"),
    ("gptq", GPTQ_CONFIG, {"group_size": 48}, "quantization_config.group_size = 48"),
    ("gptq", GPTQ_CONFIG, {"quant_method": "bitsandbytes"},
     "quantization_config.quant_method = 'bitsandbytes' is not supported"),
    ("awq", AWQ_CONFIG, {"version": "gemv"}, "quantization_config.version = 'gemv'"),
    ("awq", AWQ_CONFIG, {"zero_point": False}, "quantization_config.zero_point = False"),
    ("compressed-tensors", CT_CONFIG, {"format": "float-quantized"},
     "quantization_config.format = 'float-quantized' is not supported"),
    ("compressed-tensors", CT_CONFIG, {"sparsity_config": {"format": "sparse-24-bitmask"}},
     "quantization_config.sparsity_config.format = 'sparse-24-bitmask'"),
])
def test_unsupported_configs_name_the_key(rng, tmp_path, method, config, change, message):
    make_checkpoint(rng, tmp_path, method, dict(config, **change))
    with pytest.raises(ValueError, match=re.escape(message)):
        formats.load_checkpoint(tmp_path)


@pytest.mark.parametrize("weights_change, message", [
    ({"num_bits": 8}, "quantization_config.config_groups.group_0.weights.num_bits = 8"),
    ({"type": "float"}, "quantization_config.config_groups.group_0.weights.type = 'float'"),
    ({"strategy": "tensor"}, ("quantization_config.config_groups.group_0.weights.strategy = "
                              "'tensor' is not supported")),
])
def test_unsupported_compressed_tensors_schemes(rng, tmp_path, weights_change, message):
    config = json.loads(json.dumps(CT_CONFIG))
    config["config_groups"]["group_0"]["weights"].update(weights_change)
    make_checkpoint(rng, tmp_path, "compressed-tensors", config)
    with pytest.raises(ValueError, match=re.escape(message)):
        formats.load_checkpoint(tmp_path)
    config = json.loads(json.dumps(CT_CONFIG))
    config["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int"}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": config}))
    with pytest.raises(ValueError, match="group_0.input_activations is set"):
        formats.load_checkpoint(tmp_path)


def test_missing_tensors_are_listed_by_layer(rng, tmp_path):
    layers = {name: layer_tensors(rng, "gptq", k, n)[0] for name, (k, n) in LAYERS.items()}
    del layers["model.layers.0.mlp.down_proj"]["qzeros"]
    del layers["model.layers.1.self_attn.q_proj"]["qweight"]
    write_checkpoint(tmp_path, GPTQ_CONFIG, layers)
    with pytest.raises(ValueError) as e:
        formats.load_checkpoint(tmp_path)
    assert "model.layers.0.mlp.down_proj: no model.layers.0.mlp.down_proj.qzeros" in str(e.value)
    assert ("model.layers.1.self_attn.q_proj: model.layers.1.self_attn.q_proj.scales without "
            "model.layers.1.self_attn.q_proj.qweight") in str(e.value)


def test_missing_files_and_config(rng, tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        formats.load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="has no quantization_config"):
        formats.load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": GPTQ_CONFIG}))
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors file"):
        formats.load_checkpoint(tmp_path)
    safetensors_numpy.save_file(FLOAT_TENSORS, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="no quantized layer .* '<layer>.qweight'"):
        formats.load_checkpoint(tmp_path)


# --- writing GPTQ checkpoints ---------------------------------------------------------


def assert_same_leaves(a: jm.MarlinWeight, b: jm.MarlinWeight):
    assert (a.k, a.n, a.group_size) == (b.k, b.n, b.group_size)
    for field in ("qweight", "scales", "zeros", "perm"):
        x, y = getattr(a, field), getattr(b, field)
        assert (x is None) == (y is None), field
        if x is not None:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=field)


# Act-order needs groups of rows (group_size -1 has one group).
TO_GPTQ_CASES = [(g, sym, ao) for g in (32, 64, 128, -1) for sym in (True, False)
                 for ao in (False, True) if not (ao and g == -1)]


@pytest.mark.parametrize("group_size,symmetric,act_order", TO_GPTQ_CASES)
def test_to_gptq_writes_the_v1_layout(rng, group_size, symmetric, act_order):
    # Against the independent writer: the same known integers give the same
    # tensors, and from_gptq reads them back into the same packed arrays.
    k, n = 256, 196  # the last qzeros word holds 4 columns
    g_idx = act_order_groups(rng, k, group_size) if act_order else groups_of_rows(k, group_size)
    q, zeros, scales = quantize(random_weight(rng, k, n), g_idx, symmetric=symmetric)
    w = jm.pack(q, scales, group_size, zeros=None if symmetric else zeros,
                g_idx=g_idx if act_order else None)
    got = formats.to_gptq(w)
    expected = gptq_tensors(q, zeros, scales, g_idx)
    assert set(got) == set(expected)
    for key in ("qweight", "scales", "g_idx"):
        assert got[key].dtype == expected[key].dtype, key
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
    # The writer fills the nibbles past n of the last qzeros word with 0, to_gptq with 7
    # (the zero point 8): compare the n columns' nibbles.
    keep = np.uint32((1 << 4 * (n % 8)) - 1)
    np.testing.assert_array_equal(got["qzeros"][:, :n // 8], expected["qzeros"][:, :n // 8])
    np.testing.assert_array_equal(got["qzeros"][:, -1].view(np.uint32) & keep,
                                  expected["qzeros"][:, -1].view(np.uint32) & keep)
    back = formats.from_gptq(**got, group_size=group_size, sym=symmetric)
    assert_same_leaves(back, w)


def test_to_gptq_refuses_k_not_a_multiple_of_8(rng):
    w = jm.quantize(random_weight(rng, 100, 128), group_size=-1)
    with pytest.raises(ValueError, match=r"k = 100 is not a multiple of 8"):
        formats.to_gptq(w)


def test_save_gptq_checkpoint_round_trips(rng, tmp_path):
    # Symmetric, asymmetric and act-order layers in one directory: config.json
    # says sym false and desc_act true, and every layer comes back unchanged.
    weights = {"model.layers.0.mlp.up_proj": jm.quantize(random_weight(rng, 256, 192),
                                                         group_size=64),
               "model.layers.0.mlp.down_proj": imported_weight(rng, 192, 256, 64)[0],
               "model.layers.1.self_attn.q_proj": imported_weight(rng, 256, 128, 64,
                                                                  zeros=False)[0]}
    formats.save_gptq_checkpoint(tmp_path / "ckpt", weights,
                                 config={"model_type": "llama", "hidden_size": 256})
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["hidden_size"] == 256
    assert config["quantization_config"] == {"quant_method": "gptq", "bits": 4, "group_size": 64,
                                             "desc_act": True, "sym": False,
                                             "checkpoint_format": "gptq"}
    loaded = formats.load_checkpoint(tmp_path / "ckpt")
    assert set(loaded) == set(weights)
    for name, w in weights.items():
        assert_same_leaves(loaded[name], w)
    # All symmetric and in row order: sym true, desc_act false.
    formats.save_gptq_checkpoint(tmp_path / "sym", {"up": weights["model.layers.0.mlp.up_proj"]})
    qc = json.loads((tmp_path / "sym" / "config.json").read_text())["quantization_config"]
    assert qc["sym"] is True and qc["desc_act"] is False
    assert_same_leaves(formats.load_checkpoint(tmp_path / "sym")["up"],
                       weights["model.layers.0.mlp.up_proj"])


def test_save_gptq_checkpoint_errors(rng, tmp_path):
    w64 = jm.quantize(random_weight(rng, 256, 128), group_size=64)
    w128 = jm.quantize(random_weight(rng, 256, 128), group_size=128)
    with pytest.raises(ValueError, match=r"one group_size, the weights have \[64, 128\]: "
                                         r"64: a; 128: b"):
        formats.save_gptq_checkpoint(tmp_path, {"a": w64, "b": w128})
    with pytest.raises(ValueError, match=r"layer 'odd': k = 100 is not a multiple of 8"):
        formats.save_gptq_checkpoint(tmp_path, {"odd": jm.quantize(random_weight(rng, 100, 128),
                                                                   group_size=-1)})
    with pytest.raises(ValueError, match="no weights"):
        formats.save_gptq_checkpoint(tmp_path, {})
    with pytest.raises(TypeError, match=r"weights\['b'\] is a ndarray, expected a MarlinWeight"):
        formats.save_gptq_checkpoint(tmp_path, {"a": w64, "b": np.zeros((256, 128))})
    assert not (tmp_path / "config.json").exists()


# --- save / load ------------------------------------------------------------------


def test_save_load_round_trip_is_bit_identical(rng, tmp_path):
    weights = {
        "fp16.g128": jm.quantize(random_weight(rng, 256, 128), group_size=128),
        "bf16.per_column": jm.quantize(random_weight(rng, 128, 192), group_size=-1,
                                       dtype=jnp.bfloat16),
        "padded.g32": jm.quantize(random_weight(rng, 1000, 72), group_size=32),
    }
    formats.save(tmp_path / "w.safetensors", weights)
    loaded = formats.load(tmp_path / "w.safetensors")
    assert list(loaded) == list(weights)
    for name, w in weights.items():
        v = loaded[name]
        assert (v.k, v.n, v.group_size) == (w.k, w.n, w.group_size)
        assert v.scales.dtype == w.scales.dtype
        np.testing.assert_array_equal(np.asarray(v.qweight), np.asarray(w.qweight))
        np.testing.assert_array_equal(np.asarray(v.scales).view(np.uint16),
                                      np.asarray(w.scales).view(np.uint16))
        x = jnp.ones((2, w.k), w.dtype)
        np.testing.assert_array_equal(np.asarray(jm.matmul(x, v)), np.asarray(jm.matmul(x, w)))


def test_load_checkpoint_then_save_and_load(rng, tmp_path):
    make_checkpoint(rng, tmp_path / "gptq", "gptq", GPTQ_CONFIG)
    weights = formats.load_checkpoint(tmp_path / "gptq")
    formats.save(tmp_path / "marlin.safetensors", weights)
    loaded = formats.load(tmp_path / "marlin.safetensors")
    for name, w in weights.items():
        np.testing.assert_array_equal(np.asarray(loaded[name].qweight), np.asarray(w.qweight))
        np.testing.assert_array_equal(np.asarray(loaded[name].scales), np.asarray(w.scales))


def test_load_refuses_other_files(rng, tmp_path):
    safetensors_numpy.save_file(FLOAT_TENSORS, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="no jax_marlin.layers metadata"):
        formats.load(tmp_path / "model.safetensors")
    w = jm.quantize(random_weight(rng, 256, 128), group_size=128)
    layers = json.dumps({"up": {"k": 256, "n": 128, "group_size": 64}})
    safetensors_numpy.save_file({"up.qweight": np.asarray(w.qweight),
                                 "up.scales": np.asarray(w.scales)},
                                str(tmp_path / "bad.safetensors"),
                                metadata={"jax_marlin.layers": layers, "jax_marlin.version": "1"})
    with pytest.raises(ValueError, match=r"up.scales.shape = \[2, 128\], expected \[4, 128\]"):
        formats.load(tmp_path / "bad.safetensors")
    with pytest.raises(TypeError, match=r"weights\['up'\] is a ndarray"):
        formats.save(tmp_path / "x.safetensors", {"up": np.zeros(3)})


def test_load_reads_version_1_and_checks_perm_and_zeros(rng, tmp_path):
    # Version 1 (qweight and scales only) still loads; version 2 adds zeros and perm.
    w = jm.quantize(random_weight(rng, 256, 128), group_size=128)
    layers = json.dumps({"up": {"k": 256, "n": 128, "group_size": 128}})
    tensors = {"up.qweight": np.asarray(w.qweight), "up.scales": np.asarray(w.scales)}
    safetensors_numpy.save_file(tensors, str(tmp_path / "v1.safetensors"),
                                metadata={"jax_marlin.layers": layers, "jax_marlin.version": "1"})
    loaded = formats.load(tmp_path / "v1.safetensors")["up"]
    assert loaded.perm is None and loaded.zeros is None
    np.testing.assert_array_equal(np.asarray(loaded.qweight), np.asarray(w.qweight))
    tensors["up.perm"] = np.arange(255, dtype=np.int32)
    safetensors_numpy.save_file(tensors, str(tmp_path / "bad.safetensors"),
                                metadata={"jax_marlin.layers": layers, "jax_marlin.version": "2"})
    with pytest.raises(ValueError, match=r"layer 'up': perm: int32\[255\], expected int32\[256\]"):
        formats.load(tmp_path / "bad.safetensors")


@pytest.mark.parametrize("group_size", [64, -1])
def test_load_packs_version_2_zeros(rng, tmp_path, group_size):
    # Version 2 stored the zero points unpacked (uint8 [groups, n_pad], natural
    # column order); loading packs them as the kernels read them. A file
    # written as version 2 did, from a padded odd shape with act-order.
    w, weight = imported_weight(rng, 1000, 576, group_size, act_order=group_size != -1)
    q, scales, zeros, g_idx = jm.unpack(w)
    k_pad, n_pad = w.padded_shape
    natural = np.full((w.scales.shape[0], n_pad), 8, np.uint8)
    natural[:zeros.shape[0], :w.n] = np.asarray(zeros)
    tensors = {"up.qweight": np.asarray(w.qweight), "up.scales": np.asarray(w.scales),
               "up.zeros": natural}
    if w.perm is not None:
        tensors["up.perm"] = np.asarray(w.perm)
    layers = json.dumps({"up": {"k": w.k, "n": w.n, "group_size": group_size}})
    safetensors_numpy.save_file(tensors, str(tmp_path / "v2.safetensors"),
                                metadata={"jax_marlin.layers": layers, "jax_marlin.version": "2"})
    loaded = formats.load(tmp_path / "v2.safetensors")["up"]
    for field in ("qweight", "scales", "zeros", "perm"):
        a, b = getattr(loaded, field), getattr(w, field)
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(jm.dequantize(loaded, jnp.float32), np.float64),
                                  weight)
    # Version 3 (what save writes now) stores them packed, and reads them back as they are.
    formats.save(tmp_path / "v3.safetensors", {"up": loaded})
    again = formats.load(tmp_path / "v3.safetensors")["up"]
    np.testing.assert_array_equal(np.asarray(again.zeros), np.asarray(w.zeros))
    tensors["up.zeros"] = natural[:, 1:]
    safetensors_numpy.save_file(tensors, str(tmp_path / "bad.safetensors"),
                                metadata={"jax_marlin.layers": layers, "jax_marlin.version": "2"})
    with pytest.raises(ValueError, match=r"up.zeros: uint8\[\d+, 575\], expected uint8"):
        formats.load(tmp_path / "bad.safetensors")


# --- the README's example -----------------------------------------------------------


def test_readme_example(tmp_path, monkeypatch):
    """The code block of the README's section on checkpoints runs as it is."""
    pytest.importorskip("flax")
    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    section = readme[readme.index("## Checkpoints from GPTQ, AWQ, compressed-tensors"):]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})
