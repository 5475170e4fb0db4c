"""Greedy decoding with a KV cache, one jitted step per token.

    decoder = Decoder(model, batch=1, max_len=256)
    tokens = decoder.generate(prompt, steps=128)       # prompt [b, s] int -> [b, steps] int32

The model is split once (``nnx.split``) and its state passed, as a flat
tuple of arrays, to two jitted functions: ``prefill`` (the prompt, all
positions at once) and ``step`` (one token per sequence, the cache donated so
each layer's slice is updated in place). Works for float and quantized
models alike.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jax_marlin.models.llama import KVCache, Llama

__all__ = ["Decoder"]


class Decoder:
    """Jitted prefill and decode step of ``model`` for ``batch`` sequences of up to ``max_len`` tokens."""

    def __init__(self, model: Llama, *, batch: int, max_len: int):
        self.graphdef, state = nnx.split(model)
        # A flat tuple rather than the nnx.State: a jitted call flattens its
        # arguments on the host at every step, and flattening the State's
        # Variables in Python costs more than a small model's whole step.
        leaves, self._treedef = jax.tree.flatten(state)
        self.state = tuple(leaves)
        self.batch = batch
        self.max_len = max_len
        self._init_cache = lambda: model.init_cache(batch, max_len)

    def init_cache(self) -> KVCache:
        return self._init_cache()

    def _model(self, state) -> Llama:
        return nnx.merge(self.graphdef, jax.tree.unflatten(self._treedef, state))

    @functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
    def prefill(self, state, tokens, cache):
        """``tokens [batch, s]`` from position 0 -> (greedy next token ``[batch]``, cache)."""
        logits, cache = self._model(state)(tokens, cache, 0)
        return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache

    @functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
    def step(self, state, token, cache, pos):
        """``token [batch]`` at position ``pos`` -> (greedy next token ``[batch]``, cache)."""
        logits, cache = self._model(state)(token[:, None], cache, pos)
        return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache

    def generate(self, prompt, steps: int) -> jax.Array:
        """Greedy continuation of ``prompt [batch, s]``: ``[batch, steps]`` int32 tokens."""
        prompt = jnp.asarray(prompt, jnp.int32)
        if prompt.ndim != 2 or prompt.shape[0] != self.batch:
            raise ValueError(f"prompt must be [batch={self.batch}, s], got shape {prompt.shape}")
        s = prompt.shape[1]
        if s + steps > self.max_len:
            raise ValueError(f"prompt ({s}) + steps ({steps}) exceeds max_len {self.max_len}")
        token, cache = self.prefill(self.state, prompt, self.init_cache())
        out = [token]
        for pos in range(s, s + steps - 1):
            token, cache = self.step(self.state, token, cache, jnp.int32(pos))
            out.append(token)
        return jnp.stack(out, axis=1)
