"""QLoRA-style fine-tuning: LoRA adapters trained on a frozen 4-bit base model.

    python examples/qlora_finetune.py                  # 300 steps, 2 layers, d_model 256
    python examples/qlora_finetune.py --small --steps 60   # seconds on a CPU (CI)

A small Llama-style decoder (RMSNorm, causal attention, SwiGLU) in float16 has
every projection quantized to 4 bits with ``quantize_model`` and a rank-8
``nnx.LoRA`` adapter next to it. Only the adapters (``nnx.LoRAParam``) train,
with optax's Adam, on a toy next-token task (each token determines the next);
gradients reach them through ``jm.matmul``'s transpose. Prints the first and
last loss and checks that every base weight is unchanged bit for bit.
Needs optax: ``pip install ".[flax,examples]"``.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jax_marlin.flax import QuantizedWeight, quantize_model

DTYPE = jnp.float16
RANK = 8


class Projection(nnx.Module):
    """``base(x) + lora(x)``: the base becomes a frozen MarlinLinear, the adapter trains."""

    def __init__(self, din, dout, rngs):
        self.base = nnx.Linear(din, dout, use_bias=False, dtype=DTYPE, param_dtype=DTYPE, rngs=rngs)
        # lora_b starts at zero: training starts from the base model's output.
        self.lora = nnx.LoRA(din, RANK, dout, dtype=DTYPE, param_dtype=jnp.float32, rngs=rngs)

    def __call__(self, x):
        return self.base(x) + self.lora(x)


class Block(nnx.Module):
    def __init__(self, d, heads, ffn, rngs):
        self.heads = heads
        self.norm1 = nnx.RMSNorm(d, dtype=DTYPE, rngs=rngs)
        self.qkv = Projection(d, 3 * d, rngs)
        self.o = Projection(d, d, rngs)
        self.norm2 = nnx.RMSNorm(d, dtype=DTYPE, rngs=rngs)
        self.gate_up = Projection(d, 2 * ffn, rngs)
        self.down = Projection(ffn, d, rngs)

    def __call__(self, x):
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, axis=-1)
        # Attention in float32 (XLA's CPU backend has no float16 dot with a
        # float32 result, which the float16 attention's backward asks for).
        q, k, v = (a.reshape(b, t, self.heads, d // self.heads).astype(jnp.float32)
                   for a in (q, k, v))
        attn = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        attn = attn.reshape(b, t, d).astype(DTYPE)
        x = x + self.o(attn)
        gate, up = jnp.split(self.gate_up(self.norm2(x)), 2, axis=-1)
        return x + self.down(jax.nn.silu(gate) * up)


class Decoder(nnx.Module):
    def __init__(self, vocab, d, heads, ffn, layers, rngs):
        self.embed = nnx.Embed(vocab, d, dtype=DTYPE, param_dtype=DTYPE, rngs=rngs)
        self.blocks = nnx.List([Block(d, heads, ffn, rngs) for _ in range(layers)])
        self.norm = nnx.RMSNorm(d, dtype=DTYPE, rngs=rngs)
        self.head = nnx.Linear(d, vocab, use_bias=False, dtype=DTYPE, param_dtype=DTYPE, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)).astype(jnp.float32)


def toy_batch(key, batch, seq, vocab):
    """Sequences where token t + 1 = (5 t + 3) mod vocab: each token determines the next."""
    start = jax.random.randint(key, (batch, 1), 0, vocab)
    tokens = [start]
    for _ in range(seq):
        tokens.append((5 * tokens[-1] + 3) % vocab)
    tokens = jnp.concatenate(tokens, axis=1)
    return tokens[:, :-1], tokens[:, 1:]


@nnx.jit
def train_step(model, optimizer, tokens, targets):
    """One Adam step on the adapters (``nnx.LoRAParam``) only; returns the loss."""
    def loss_fn(model):
        logits = model(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
    optimizer.update(model, grads)
    return loss


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="a smaller model, for a quick run")
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    args = parser.parse_args()
    vocab, d, heads, ffn, layers, batch, seq = ((64, 128, 4, 256, 1, 8, 16) if args.small else
                                                (128, 256, 4, 768, 2, 16, 64))

    model = Decoder(vocab, d, heads, ffn, layers, nnx.Rngs(0))
    # Quantize the projections' base layers; embedding and lm head stay float (frozen too).
    model, summary = quantize_model(model, group_size=128, summary=True,
                                    filter=lambda path, module: "base" in path)
    print(summary)
    frozen = jax.tree.map(np.asarray, nnx.state(model, nnx.Not(nnx.LoRAParam)))

    optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.LoRAParam)

    key = jax.random.key(1)
    losses = []
    start = time.perf_counter()
    for step in range(args.steps):
        key, sub = jax.random.split(key)
        losses.append(float(train_step(model, optimizer, *toy_batch(sub, batch, seq, vocab))))
        if step % 50 == 0:
            print(f"step {step:4d}  loss {losses[-1]:.4f}")
    elapsed = time.perf_counter() - start
    print(f"{args.steps} steps on {jax.devices()[0].platform} in {elapsed:.1f} s; "
          f"first loss {losses[0]:.4f}, last loss {losses[-1]:.4f}")

    assert losses[-1] < 0.5 * losses[0], "the loss did not go down"
    after = jax.tree.map(np.asarray, nnx.state(model, nnx.Not(nnx.LoRAParam)))
    jax.tree.map(np.testing.assert_array_equal, frozen, after)
    n_frozen = len(jax.tree.leaves(nnx.state(model, QuantizedWeight)))
    print(f"base weights unchanged bit for bit ({n_frozen} packed arrays, embedding, norms, head)")


if __name__ == "__main__":
    main()
