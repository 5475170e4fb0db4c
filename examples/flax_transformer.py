"""A small Llama-style decoder in Flax NNX, its projections quantized to 4 bits.

    python examples/flax_transformer.py            # 4 layers, d_model 512, 2 x 128 tokens
    python examples/flax_transformer.py --small    # 2 layers, d_model 256, 2 x 32 tokens (CI)

Builds the decoder in float16, quantizes every attention and MLP projection
with ``quantize_model`` (the embedding and the lm head stay float), runs both
models under ``jax.jit`` on ``jax.devices()[0]`` and compares their logits. On
a GPU it also times one forward step of each.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jax_marlin as jm
from jax_marlin.flax import quantize_model

# Every projection fits the kernel: 512 and 1408 = 11 * 128 are multiples of
# 128, so k is a multiple of group_size 128 for q/k/v/o, gate/up and down.
VOCAB, D_MODEL, N_HEADS, FFN, N_LAYERS = 1024, 512, 8, 1408, 4
HEAD_DIM = D_MODEL // N_HEADS
BATCH, SEQ = 2, 128
DTYPE = jnp.float16  # weights and activations of the float model, as it would be served


def linear(din, dout, rngs):
    return nnx.Linear(din, dout, use_bias=False, dtype=DTYPE, param_dtype=DTYPE, rngs=rngs)


def rms_norm(rngs):
    # nnx.RMSNorm takes its statistics in float32 whatever the input dtype.
    return nnx.RMSNorm(D_MODEL, dtype=DTYPE, rngs=rngs)


def rope(x, positions):
    """Rotary position embedding of ``x [batch, seq, heads, head_dim]``."""
    freqs = 1.0 / 10000.0 ** (jnp.arange(0, HEAD_DIM, 2, dtype=jnp.float32) / HEAD_DIM)
    angles = positions[:, None] * freqs[None, :]  # [seq, head_dim / 2]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, rngs):
        self.q = linear(D_MODEL, D_MODEL, rngs)
        self.k = linear(D_MODEL, D_MODEL, rngs)
        self.v = linear(D_MODEL, D_MODEL, rngs)
        self.o = linear(D_MODEL, D_MODEL, rngs)

    def __call__(self, x):
        batch, seq, _ = x.shape
        positions = jnp.arange(seq, dtype=jnp.float32)

        def heads(y):
            return y.reshape(batch, seq, N_HEADS, HEAD_DIM)

        q = rope(heads(self.q(x)), positions).astype(jnp.float32)
        k = rope(heads(self.k(x)), positions).astype(jnp.float32)
        v = heads(self.v(x)).astype(jnp.float32)
        # Scores and softmax in float32 (XLA:CPU has no float16 dot with a
        # float32 result, which jax.nn.dot_product_attention would ask for).
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(HEAD_DIM)
        causal = jnp.tril(jnp.ones((seq, seq), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).astype(x.dtype)
        return self.o(out.reshape(batch, seq, D_MODEL))


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, rngs):
        self.gate = linear(D_MODEL, FFN, rngs)
        self.up = linear(D_MODEL, FFN, rngs)
        self.down = linear(FFN, D_MODEL, rngs)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    def __init__(self, rngs):
        self.attn_norm = rms_norm(rngs)
        self.attn = Attention(rngs)
        self.mlp_norm = rms_norm(rngs)
        self.mlp = MLP(rngs)

    def __call__(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, D_MODEL, dtype=DTYPE, param_dtype=DTYPE, rngs=rngs)
        self.layers = nnx.List([Block(rngs) for _ in range(N_LAYERS)])
        self.norm = rms_norm(rngs)
        self.lm_head = linear(D_MODEL, VOCAB, rngs)

    def __call__(self, tokens):
        """``tokens [batch, seq]`` int -> logits ``[batch, seq, VOCAB]`` float16."""
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def at(node, path):
    """The submodule of ``node`` at a ``quantize_model`` path, e.g. ``("layers", 0, "mlp")``."""
    for key in path:
        node = node[key] if isinstance(key, int) else getattr(node, key)
    return node


def dequantized_copy(float_model, int4_model, summary):
    """The float model with each replaced kernel set to the 4-bit weight it became."""
    model = nnx.clone(float_model)
    for layer in summary.replaced:
        weight = at(int4_model, layer.path).weight.get_value()
        at(model, layer.path).kernel.set_value(jm.dequantize(weight, DTYPE))
    return model


def state_bytes(model):
    return sum(a.nbytes for a in jax.tree.leaves(nnx.state(model)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="a smaller model, for a quick run")
    if parser.parse_args().small:
        global VOCAB, D_MODEL, N_HEADS, FFN, N_LAYERS, HEAD_DIM, SEQ
        VOCAB, D_MODEL, N_HEADS, FFN, N_LAYERS, SEQ = 512, 256, 4, 384, 2, 32
        HEAD_DIM = D_MODEL // N_HEADS
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), "
          f"CUDA kernel built: {jm.HAS_CUDA}")
    float_model = Decoder(nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (BATCH, SEQ), 0, VOCAB)

    # quantize_model works in place: quantize a copy, keep the float model.
    int4_model, summary = quantize_model(nnx.clone(float_model), group_size=128,
                                         filter=lambda path, _: path[0] != "lm_head",
                                         summary=True)
    print(summary)
    print(f"model state: {state_bytes(float_model) / 2**20:.2f} MiB float16 -> "
          f"{state_bytes(int4_model) / 2**20:.2f} MiB with 4-bit projections")

    # Split once, jit a pure function of the state: no graph traversal per call.
    float_graph, float_state = nnx.split(float_model)
    int4_graph, int4_state = nnx.split(int4_model)

    @jax.jit
    def float_forward(state, tokens):
        return nnx.merge(float_graph, state)(tokens)

    @jax.jit
    def int4_forward(state, tokens):
        return nnx.merge(int4_graph, state)(tokens)

    ref = np.asarray(float_forward(float_state, tokens), np.float64)
    out = np.asarray(int4_forward(int4_state, tokens), np.float64)
    # The same graph as the float model, with the dequantized 4-bit weights:
    # what is left between it and the 4-bit model is the kernel's rounding.
    same_weights = np.asarray(float_forward(
        nnx.state(dequantized_copy(float_model, int4_model, summary)), tokens), np.float64)

    def rel(a, b):
        return np.linalg.norm(a - b) / np.linalg.norm(b)

    print(f"logits [{BATCH}, {SEQ}, {VOCAB}], max |logit| {np.abs(ref).max():.3f}")
    print(f"  4-bit vs float16 model: max abs error {np.abs(out - ref).max():.3e}, "
          f"relative error ||out - ref|| / ||ref|| {rel(out, ref):.3e}, same argmax at "
          f"{np.mean(out.argmax(-1) == ref.argmax(-1)) * 100:.1f}% of positions")
    print(f"    (random weights: each of the {len(summary.replaced)} 4-bit projections adds "
          f"~0.1 relative error, and they compound)")
    print(f"  4-bit vs float16 model on the same dequantized weights: max abs error "
          f"{np.abs(out - same_weights).max():.3e}, relative error {rel(out, same_weights):.3e}")

    if jax.default_backend() == "gpu":
        steps = 200
        for name, forward, state in [("float16", float_forward, float_state),
                                     ("jax_marlin int4", int4_forward, int4_state)]:
            for _ in range(3):
                jax.block_until_ready(forward(state, tokens))
            t0 = time.perf_counter()
            for _ in range(steps):
                logits = forward(state, tokens)
            jax.block_until_ready(logits)
            print(f"  {name:16s} {(time.perf_counter() - t0) / steps * 1e6:8.1f} us per forward "
                  f"step ({BATCH * SEQ} tokens)")


if __name__ == "__main__":
    main()
