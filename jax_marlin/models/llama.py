"""A Llama decoder in Flax NNX: RMSNorm, RoPE, grouped-query attention with a KV cache, SwiGLU.

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_layers=30, num_heads=9, num_kv_heads=3, rope_theta=1e5)
    model = Llama(config, rngs=nnx.Rngs(0))
    logits, _ = model(tokens)                         # tokens [b, s] -> [b, s, vocab] float32
    cache = model.init_cache(batch=b, max_len=256)
    logits, cache = model(prompt, cache=cache, pos=0)  # prefill
    logits, cache = model(next_token, cache=cache, pos=len_prompt)  # one decode step

Every projection is an ``nnx.Linear`` (in x out kernel, no bias), so
``jax_marlin.flax.quantize_model`` and ``jax_marlin.flax.gptq`` turn them into
``MarlinLinear``. The embedding, the norms and the output head stay float.
For decoding, :func:`fuse_projections` then joins each block's q, k, v into
one ``qkv`` layer and gate, up into ``gate_up`` (4 matmuls a block, not 7):

    quantize_model(model)      # or gptq_blocks, or load_quantized: on q, k, v, gate, up
    fuse_projections(model)    # float or 4-bit, in place; the same logits

With 4-bit weights in float16 or bfloat16, the fused block also runs its
RMSNorms, SwiGLU and residual adds inside the four matmuls (``Block.fused``;
the logits then move by float32 rounding), and everything after attention
(``o``, the MLP and both residual adds) as one ``jm.post_attention``.

RoPE rotates the two halves of each head (``x[:d/2]``, ``x[d/2:]``), the
Hugging Face layout of the Q and K projection rows; checkpoints that store
them in the interleaved (GPT-J) layout are permuted on loading
(``jax_marlin.models.gguf``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jax_marlin as jm
from jax_marlin.flax.nnx import MarlinLinear, concatenate_linears

__all__ = ["KVCache", "Llama", "LlamaConfig", "fuse_projections"]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shape and constants of a Llama decoder."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = True

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of "
                             f"num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of "
                             f"num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values of every layer: ``k``, ``v`` tuples of ``[batch, kv_heads, max_len, head_dim]``.

    One array per layer (not one stacked array), so a jitted decode step that
    donates the cache updates each layer's slice in place. Heads before
    positions: the attention's batched dots take (batch, head) as their
    leading batch dimensions, so XLA reads the cache as it is stored instead
    of transposing a copy of it for every layer and step.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotates ``x [..., s, head_dim]`` by ``positions [s]`` (half-split layout), in float32."""
    d = x.shape[-1]
    freqs = 1.0 / theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    angles = positions.astype(jnp.float32)[:, None] * freqs[None, :]  # [s, d / 2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def _linear(din: int, dout: int, dtype, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(din, dout, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)


class Attention(nnx.Module):
    """Grouped-query self-attention: ``num_heads`` queries share ``num_kv_heads`` keys and values."""

    def __init__(self, config: LlamaConfig, dtype, rngs: nnx.Rngs):
        hd = config.head_dim
        self.q = _linear(config.hidden_size, config.num_heads * hd, dtype, rngs)
        self.k = _linear(config.hidden_size, config.num_kv_heads * hd, dtype, rngs)
        self.v = _linear(config.hidden_size, config.num_kv_heads * hd, dtype, rngs)
        self.o = _linear(config.num_heads * hd, config.hidden_size, dtype, rngs)
        self.qkv = nnx.data(None)  # q, k and v joined: fuse()
        self.config = config

    def fuse(self):
        """Replaces ``q``, ``k``, ``v`` by one layer ``qkv [hidden, (heads + 2 kv_heads) hd]``."""
        if self.qkv is None:
            self.qkv = concatenate_linears([self.q, self.k, self.v])
            self.q = self.k = self.v = None

    def _project(self, x, norm=None):
        """``x [b, s, hidden]`` -> ``q [b, s, heads hd]``, ``k``, ``v [b, s, kv_heads hd]``."""
        if norm is not None:  # a joined MarlinLinear: the RMSNorm inside its matmul
            qkv = self.qkv(x, rms_norm_weight=norm.scale[...], rms_norm_eps=norm.epsilon)
        elif self.qkv is None:
            return self.q(x), self.k(x), self.v(x)
        else:
            qkv = self.qkv(x)
        c = self.config
        q_width, kv_width = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        return jnp.split(qkv, [q_width, q_width + kv_width], axis=-1)

    def __call__(self, x, pos, cache_k=None, cache_v=None, *, norm=None, residual=None,
                 project_out=True):
        """``x [b, s, hidden]`` at positions ``pos .. pos + s - 1``.

        Without a cache the keys are this ``x``'s own (causal). With one
        (``[b, kv_heads, max_len, head_dim]``), this ``x``'s keys and values are
        written at ``pos`` and the queries attend to positions ``0 .. pos + i``.
        Returns ``(y [b, s, hidden], cache_k, cache_v)``.

        ``norm`` (an ``nnx.RMSNorm``) and ``residual [b, s, hidden]``: the
        fused block (``Block``, 4-bit joined projections only): ``x`` is then
        the un-normalized stream, normalized inside the ``qkv`` matmul, and
        ``y`` includes ``residual``, added inside the ``o`` matmul.
        ``project_out=False``: ``y`` is the heads' output before ``o``
        (``[b, s, heads hd]``), for a caller that runs ``o`` itself.
        """
        c = self.config
        b, s, _ = x.shape
        positions = pos + jnp.arange(s)
        heads = lambda t, h: t.reshape(b, s, h, c.head_dim).transpose(0, 2, 1, 3)  # [b, h, s, d]
        q, k, v = self._project(x, norm)
        q = rope(heads(q, c.num_heads), positions, c.rope_theta)
        k = rope(heads(k, c.num_kv_heads), positions, c.rope_theta).astype(x.dtype)
        v = heads(v, c.num_kv_heads)
        if cache_k is not None:
            cache_k = jax.lax.dynamic_update_slice_in_dim(cache_k, k.astype(cache_k.dtype), pos, 2)
            cache_v = jax.lax.dynamic_update_slice_in_dim(cache_v, v.astype(cache_v.dtype), pos, 2)
            k, v = cache_k, cache_v
            key_positions = jnp.arange(cache_k.shape[2])
        else:
            key_positions = positions
        # Operands in the model's dtype (the cache is read once, never converted),
        # products accumulated and the softmax taken in float32; query head
        # g * rep + r reads kv head g.
        rep = c.num_heads // c.num_kv_heads
        q = (q / jnp.sqrt(c.head_dim)).astype(k.dtype).reshape(b, c.num_kv_heads, rep * s, c.head_dim)
        scores = jnp.einsum("bgqd,bgtd->bgqt", q, k, preferred_element_type=jnp.float32)
        scores = scores.reshape(b, c.num_kv_heads, rep, s, -1)
        visible = key_positions[None, :] <= positions[:, None]  # [s, t]
        probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
        probs = probs.astype(v.dtype).reshape(b, c.num_kv_heads, rep * s, -1)
        out = jnp.einsum("bgqt,bgtd->bgqd", probs, v, preferred_element_type=jnp.float32)
        out = out.reshape(b, c.num_heads, s, c.head_dim).transpose(0, 2, 1, 3).reshape(b, s, -1)
        out = out.astype(x.dtype)
        if not project_out:
            return out, cache_k, cache_v
        y = self.o(out) if residual is None else self.o(out, residual=residual)
        return y, cache_k, cache_v


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: LlamaConfig, dtype, rngs: nnx.Rngs):
        self.gate = _linear(config.hidden_size, config.intermediate_size, dtype, rngs)
        self.up = _linear(config.hidden_size, config.intermediate_size, dtype, rngs)
        self.down = _linear(config.intermediate_size, config.hidden_size, dtype, rngs)
        self.gate_up = nnx.data(None)  # gate and up joined: fuse()

    def fuse(self):
        """Replaces ``gate``, ``up`` by one ``gate_up`` layer ``[hidden, 2 intermediate]``.

        A 4-bit ``down`` with act-order (``perm``: its kernel multiplies
        ``x[..., perm]``) has that order moved into ``gate`` and ``up``'s
        output columns first (``jax_marlin.permute_columns``, exact), so
        ``down`` gets its input already in its row order and runs without a
        permutation: no gather of ``x`` (a second launch or the kernel's
        gather), and its SwiGLU can run inside the kernel.
        """
        if self.gate_up is None:
            self._fold_act_order()
            self.gate_up = concatenate_linears([self.gate, self.up])
            self.gate = self.up = None

    def _fold_act_order(self):
        if not isinstance(self.down, MarlinLinear):
            return
        w = self.down.weight.get_value()
        if w.perm is None:
            return
        order = np.asarray(w.perm)
        for layer in (self.gate, self.up):  # x of down = silu(gate) * up, column by column
            if isinstance(layer, MarlinLinear):
                layer.weight.set_value(jm.permute_columns(layer.weight.get_value(), order))
            else:
                layer.kernel.set_value(layer.kernel[...][:, order])
            if layer.bias is not None:
                layer.bias.set_value(layer.bias[...][order])
        self.down.weight.set_value(dataclasses.replace(w, perm=None))

    def __call__(self, x, *, norm=None, residual=None):
        """``x [..., hidden]`` -> ``[..., hidden]``.

        ``norm`` and ``residual``: the fused block (``Block``, 4-bit joined
        ``gate_up`` only): ``x`` is normalized inside the ``gate_up`` matmul,
        SwiGLU runs inside ``down``'s (on ``[gate | up]``, in float32), and
        ``residual`` is added to its output.
        """
        if norm is not None:
            gate_up = self.gate_up(x, rms_norm_weight=norm.scale[...], rms_norm_eps=norm.epsilon)
            return self.down(gate_up, swiglu=True, residual=residual)
        if self.gate_up is None:
            gate, up = self.gate(x), self.up(x)
        else:
            gate, up = jnp.split(self.gate_up(x), 2, axis=-1)
        return self.down(jax.nn.silu(gate) * up)


class Block(nnx.Module):
    """Pre-norm residual block: attention, then the MLP."""

    def __init__(self, config: LlamaConfig, dtype, rngs: nnx.Rngs):
        norm = dict(epsilon=config.rms_norm_eps, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.attn_norm = nnx.RMSNorm(config.hidden_size, **norm)
        self.attn = Attention(config, dtype, rngs)
        self.mlp_norm = nnx.RMSNorm(config.hidden_size, **norm)
        self.mlp = MLP(config, dtype, rngs)
        # fuse_projections(elementwise=True) sets it: see fused().
        self.fuse_elementwise = False

    def fused(self, x) -> bool:
        """Whether this call runs the norms, SwiGLU and residual adds inside the matmuls.

        Only where the kernel can and nothing changes but float32 rounding:
        ``fuse_elementwise`` set, the four projections ``qkv``, ``o``,
        ``gate_up`` and ``down`` 4-bit (``MarlinLinear``) in ``x``'s dtype and
        returning it, and both norms scaled. Otherwise the block runs each
        step as its own op (a float32 model with 4-bit weights rounds its
        residual stream differently than the kernel would).
        """
        layers = (self.attn.qkv, self.attn.o, self.mlp.gate_up, self.mlp.down)
        return (self.fuse_elementwise
                and all(isinstance(layer, MarlinLinear)
                        and layer.weight.get_value().dtype == x.dtype
                        and jnp.dtype(layer.dtype or x.dtype) == x.dtype for layer in layers)
                and self.attn_norm.scale is not None and self.mlp_norm.scale is not None)

    def __call__(self, x, pos=0, cache_k=None, cache_v=None):
        """``x [b, s, hidden]`` -> ``(x [b, s, hidden], cache_k, cache_v)``."""
        if self.fused(x):
            if all(layer.bias is None for layer in (self.attn.o, self.mlp.gate_up, self.mlp.down)):
                # Two ops and the attention between them: o, the MLP's RMSNorm,
                # gate_up, SwiGLU, down and both residual adds are one
                # jm.post_attention (the same three kernel calls, or with
                # JAX_MARLIN_CHAIN_CALL=1 one custom call at decode batch
                # sizes on Hopper).
                out, cache_k, cache_v = self.attn(x, pos, cache_k, cache_v,
                                                  norm=self.attn_norm, project_out=False)
                y = jm.post_attention(
                    out, x, self.attn.o.weight.get_value(), self.mlp.gate_up.weight.get_value(),
                    self.mlp.down.weight.get_value(), self.mlp_norm.scale[...].astype(x.dtype),
                    rms_norm_eps=self.mlp_norm.epsilon)
                return y, cache_k, cache_v
            # Four kernel calls, and the attention between them.
            x, cache_k, cache_v = self.attn(x, pos, cache_k, cache_v, norm=self.attn_norm,
                                            residual=x)
            return self.mlp(x, norm=self.mlp_norm, residual=x), cache_k, cache_v
        y, cache_k, cache_v = self.attn(self.attn_norm(x), pos, cache_k, cache_v)
        x = x + y
        return x + self.mlp(self.mlp_norm(x)), cache_k, cache_v


class Llama(nnx.Module):
    """A Llama decoder. ``dtype``: weights and activations (float32, float16 or bfloat16)."""

    def __init__(self, config: LlamaConfig, *, dtype: Any = jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.embed = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype,
                               param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List([Block(config, dtype, rngs) for _ in range(config.num_layers)])
        self.norm = nnx.RMSNorm(config.hidden_size, epsilon=config.rms_norm_eps, dtype=dtype,
                                param_dtype=dtype, rngs=rngs)
        self.lm_head = (None if config.tie_embeddings
                        else _linear(config.hidden_size, config.vocab_size, dtype, rngs))

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty cache for ``batch`` sequences of up to ``max_len`` tokens, in the model's dtype."""
        c = self.config
        shape = (batch, c.num_kv_heads, max_len, c.head_dim)
        zeros = tuple(jnp.zeros(shape, self.dtype) for _ in range(c.num_layers))
        return KVCache(zeros, tuple(jnp.zeros(shape, self.dtype) for _ in range(c.num_layers)))

    def __call__(self, tokens: jax.Array, cache: KVCache | None = None, pos=0):
        """``tokens [b, s]`` int at positions ``pos ..`` -> ``(logits [b, s, vocab] float32, cache)``.

        ``cache=None`` runs the causal forward of ``tokens`` alone (and returns
        ``None``); with a cache, ``tokens`` follow the ``pos`` tokens already in it.
        """
        x = self.embed(tokens)
        new_k, new_v = [], []
        for i, block in enumerate(self.layers):
            if cache is None:
                x, _, _ = block(x, pos)
            else:
                x, k, v = block(x, pos, cache.k[i], cache.v[i])
                new_k.append(k)
                new_v.append(v)
        x = self.norm(x)
        logits = self.embed.attend(x) if self.lm_head is None else self.lm_head(x)
        return logits.astype(jnp.float32), (None if cache is None
                                            else KVCache(tuple(new_k), tuple(new_v)))


def fuse_projections(model: Llama, *, elementwise: bool = True) -> Llama:
    """Joins each block's q, k, v projections into one ``qkv`` layer and gate, up into ``gate_up``.

    In place; returns ``model``. A decode step then runs 4 matmuls per block
    (qkv, o, gate_up, down) instead of 7 over the same weight bytes; at batch
    1 each matmul also costs a few fixed microseconds on the GPU, so a block
    saves three of those. The layers of each group must be all float
    ``nnx.Linear`` or all ``MarlinLinear``
    (``jax_marlin.flax.concatenate_linears``; 4-bit weights are joined
    exactly by ``jax_marlin.concatenate``). Fuse after quantizing:
    ``quantize_model``, ``gptq_blocks`` and ``load_quantized`` work on the
    separate projections (a loaded checkpoint names them). The model's state
    then holds ``qkv`` and ``gate_up`` in place of the parts, so a checkpoint
    of a fused model restores into a fused one. Fusing a fused block does
    nothing.

    ``elementwise``: with 4-bit projections in the model's float16 or
    bfloat16, each block also runs its two RMSNorms, SwiGLU and residual adds
    inside the four matmuls (``jax_marlin.matmul``'s fusions; ``Block.fused``
    says when): a decode step then launches four kernels a block plus
    attention, in place of a dozen. The logits change by float32 rounding
    only (the norm's scale is applied to ``x r`` rather than multiplied into
    ``r``; SwiGLU is computed in float32 and rounded once).
    ``elementwise=False`` keeps every op as the float model has it.

    A 4-bit ``down`` with act-order has its row order moved into ``gate``
    and ``up``'s output columns (``MLP.fuse``), exactly: it then runs
    without permuting its input.
    """
    for block in model.layers:
        block.attn.fuse()
        block.mlp.fuse()
        block.fuse_elementwise = bool(elementwise)
    return model
