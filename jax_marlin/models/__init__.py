"""Model definitions that run jax-marlin end to end (need ``flax``).

:mod:`jax_marlin.models.llama`: a Llama decoder in Flax NNX with a KV cache;
``fuse_projections`` joins its q, k, v and gate, up projections for decoding.
:mod:`jax_marlin.models.gguf`: its weights and tokenizer from a GGUF file
(needs ``gguf`` and ``tokenizers``: ``pip install "jax-marlin[examples]"``).
"""

from jax_marlin.models.llama import KVCache, Llama, LlamaConfig, fuse_projections

__all__ = ["KVCache", "Llama", "LlamaConfig", "fuse_projections"]
