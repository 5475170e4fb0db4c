"""Markdown table and plot from a bench_matmul.py results JSON.

    python benchmarks/report.py benchmarks/results/h200-2026-12-02.json

writes ``<name>.md`` and ``<name>.png`` beside the JSON: per layer and m the
device time of every implementation, jax_marlin's effective bandwidth and its
fraction of the measured copy bandwidth, its speedup over each peer, a decode
step of a Llama-70B block, and a plot of the speedup over ``xla_fp16``
against m with the memory-bound ideal drawn in.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib

# Device-to-device copy of the baseline measurement on an H200 (torch copy
# kernel, bytes read + written; shared/anchors/h200-baseline.md): the
# bandwidth limit for a kernel that mostly reads weights.
COPY_ANCHOR_TBPS = {"NVIDIA H200": 4.25}

# Llama-3-70B: 80 blocks of these four projections.
LLAMA70B_BLOCK = ["70b.qkv", "70b.o", "70b.gate_up", "70b.down"]
LLAMA70B_BLOCKS = 80


def index(records):
    """{(layer, m): {impl_key: record}} with impl_key 'jax_marlin g128' etc."""
    table = collections.defaultdict(dict)
    for r in records:
        key = r["impl"] if r["impl"] != "jax_marlin" else f"jax_marlin g{r['group_size']}"
        table[(r["layer"], r["m"])][key] = r
    return table


def floor_us(k, n, m, copy_tbps, group_size=128):
    """Time to move int4 weights + fp16 scales + x + y once at copy_tbps."""
    groups = 1 if group_size == -1 else k // group_size
    moved = k * n // 2 + 2 * groups * n + 2 * m * k + 2 * m * n
    return moved / (copy_tbps * 1e12) * 1e6


def ideal_speedup(k, n, m):
    """Bytes of the fp16 matmul over bytes of the int4 g128 one: the memory-bound ideal."""
    fp16 = 2 * k * n + 2 * m * k + 2 * m * n
    int4 = k * n // 2 + 2 * (k // 128) * n + 2 * m * k + 2 * m * n
    return fp16 / int4


def limit_tbps(result) -> float:
    """The bandwidth to compare against: the larger of this run's copy and the anchor."""
    return max(result["copy_tbps"], COPY_ANCHOR_TBPS.get(result["gpu"], 0.0))


def markdown(result) -> str:
    table = index(result["records"])
    copy = limit_tbps(result)
    lines = [
        f"# {result['gpu']}, jax {result['jax']}, {result.get('date', '')}",
        "",
        f"Device-to-device copy measured in the run (`copy_tbps`, an XLA elementwise pass): "
        f"{result['copy_tbps']:.2f} TB/s; the limit used below is **{copy:.2f} TB/s** (read + write), "
        "the larger of that and the baseline's copy kernel on this GPU. "
        "Times are device microseconds per matmul (median of "
        f"{result['method']['repeats']}, spread in the JSON; {result['method']['rotate']} weight "
        "sets rotated so weights come from HBM). *floor*: int4 g128 bytes at the limit. "
        "*% limit*: jax_marlin g128's effective bandwidth over the limit. *vs*: speedup of "
        "jax_marlin g128 over the peer. *rel err*: jax_marlin g128 against the float32 reference.",
        "",
        "| layer (k x n) | m | floor | jax_marlin g128 | g-1 | xla_fp16 | xla_int4 g128 | TB/s | % limit "
        "| vs fp16 | vs int4 | rel err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (layer, m), impls in sorted(table.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        g128 = impls.get("jax_marlin g128")
        if g128 is None:
            continue
        k, n = g128["k"], g128["n"]

        def us(key):
            r = impls.get(key)
            return f"{r['median_us']:.1f}" if r else ""

        def ratio(key):
            r = impls.get(key)
            return f"{r['median_us'] / g128['median_us']:.2f}x" if r else ""

        lines.append(
            f"| {layer} ({k}x{n}) | {m} | {floor_us(k, n, m, copy):.1f} | {us('jax_marlin g128')} "
            f"| {us('jax_marlin g-1')} | {us('xla_fp16')} | {us('xla_int4')} | {g128['tbps']:.2f} "
            f"| {100 * g128['tbps'] / copy:.0f}% | {ratio('xla_fp16')} | {ratio('xla_int4')} "
            f"| {g128['rel_err']:.1e} |")
    if result.get("note"):
        lines += ["", result["note"]]
    lines += ["", decode_step(table), ""]
    return "\n".join(lines)


def decode_step(table) -> str:
    """One Llama-70B block's four projections, summed from the per-layer rows."""
    out = ["## Decode step of one Llama-3-70B block (qkv + o + gate_up + down)", "",
           "Sum of the four per-layer medians above (each measured separately).", "",
           "| m | jax_marlin g128 us | xla_fp16 us | speedup | x 80 blocks: jax_marlin ms | xla_fp16 ms |",
           "|---|---|---|---|---|---|"]
    for m in (1, 16, 64):
        try:
            marlin = sum(table[(l, m)]["jax_marlin g128"]["median_us"] for l in LLAMA70B_BLOCK)
            fp16 = sum(table[(l, m)]["xla_fp16"]["median_us"] for l in LLAMA70B_BLOCK)
        except KeyError:
            continue
        out.append(f"| {m} | {marlin:.1f} | {fp16:.1f} | {fp16 / marlin:.2f}x "
                   f"| {marlin * LLAMA70B_BLOCKS / 1e3:.2f} | {fp16 * LLAMA70B_BLOCKS / 1e3:.2f} |")
    params = LLAMA70B_BLOCKS * (8192 * 10240 + 8192 * 8192 + 8192 * 57344 + 28672 * 8192)
    fp16_gb = 2 * params / 1e9
    int4_gb = params * (0.5 + 2 / 128) / 1e9
    out += ["", f"Memory: the 80 blocks' linear layers hold {params / 1e9:.1f} G weights: "
            f"{fp16_gb:.1f} GB in fp16 against {int4_gb:.1f} GB in int4 with g128 scales. The H200 "
            f"reports 143771 MiB (150.8 GB): fp16 weights alone take {100 * fp16_gb / 150.76:.0f}% of it "
            f"before embeddings (4.2 GB), KV cache and activations; int4 leaves "
            f"{150.76 - int4_gb - 4.2:.0f} GB free."]
    return "\n".join(out)


def plot(result, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = index(result["records"])
    layers = sorted({layer for layer, _ in table})
    fig, ax = plt.subplots(figsize=(10.5, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, layer in enumerate(layers):
        ms = sorted(m for (l, m) in table if l == layer
                    and "xla_fp16" in table[(l, m)] and "jax_marlin g128" in table[(l, m)])
        if not ms:
            continue
        speed = [table[(layer, m)]["xla_fp16"]["median_us"]
                 / table[(layer, m)]["jax_marlin g128"]["median_us"] for m in ms]
        rec = table[(layer, ms[0])]["jax_marlin g128"]
        ideal = [ideal_speedup(rec["k"], rec["n"], m) for m in ms]
        c = colors[i % len(colors)]
        ax.plot(ms, speed, "o-", color=c, label=f"{layer} ({rec['k']}x{rec['n']})")
        ax.plot(ms, ideal, ":", color=c, alpha=0.6)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("m (batch rows)")
    ax.set_ylabel("speedup of jax_marlin g128 over XLA fp16 dot")
    ax.set_title(f"{result['gpu']}: jm.matmul vs x @ w_fp16 (dotted: memory-bound ideal)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", type=pathlib.Path)
    args = parser.parse_args(argv)
    result = json.loads(args.results.read_text())
    args.results.with_suffix(".md").write_text(markdown(result))
    plot(result, args.results.with_suffix(".png"))
    print("wrote", args.results.with_suffix(".md"), "and", args.results.with_suffix(".png"))


if __name__ == "__main__":
    main()
