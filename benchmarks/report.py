"""Markdown tables and plot from a bench_matmul.py results JSON; before/after comparison.

    python benchmarks/report.py benchmarks/results/h200-2026-12-03-sweep.json
    python benchmarks/report.py benchmarks/results/h200-2026-12-03-sweep.json --readme README.md
    python benchmarks/report.py --compare OLD.json NEW.json --impl jax_marlin_g128

The first writes ``<name>.md`` and ``<name>.png`` beside the JSON: per layer
and m the device time of every implementation, jax_marlin's effective
bandwidth and its fraction of the measured copy bandwidth, its speedup over
each peer, a decode step of a Llama-70B block, and, where the run has them,
tables for bfloat16 and for the fp16 group sizes. The plot shows the speedup
of fp16 g128 over ``xla_fp16`` against m with the memory-bound ideal drawn in,
beside it the same for bf16 g128 over ``xla_bf16`` and the time of each group
size relative to g128. The markdown ends with the targets' scorecard
(``targets.py``): which of the project's targets the run's rows meet.

``--readme`` also replaces the README's performance table (between the
marker comments ``README_BEGIN`` and ``README_END``) with one generated from
the same JSON, so no table is typed by hand.

``--compare`` prints (markdown) the per-(layer, m) ratio new / old of one
implementation's median time, with both spreads, and its geometric mean per
range of m: e.g. what a kernel change costs against an earlier results file.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import pathlib

import targets  # beside this file

# Device-to-device copy bandwidth of a CUDA copy kernel on an H200 (bytes read
# + written; benchmarks/NOTES.md, Floors): the bandwidth limit for a kernel
# that mostly reads weights.
COPY_ANCHOR_TBPS = {"NVIDIA H200": 4.25}

# Llama-3-70B: 80 blocks of these four projections.
LLAMA70B_BLOCK = ["70b.qkv", "70b.o", "70b.gate_up", "70b.down"]
LLAMA70B_BLOCKS = 80


def impl_key(r) -> str:
    """'jax_marlin g128', 'jax_marlin bf16 g128', 'xla_fp16', ...: one per variant.

    From ``impl``, ``dtype``, ``group_size`` and ``layout`` ('zp g128',
    'act order g128' for imported layouts), so results written before records
    had ``variant`` (or ``layout``) read the same way.
    """
    if r["impl"] != "jax_marlin":
        return r["impl"]
    dtype = "" if r.get("dtype", "float16") == "float16" else "bf16 "
    layout = r.get("layout", "sym")
    layout = "" if layout == "sym" else layout.replace("_", " ") + " "
    return f"jax_marlin {dtype}{layout}g{r['group_size']}"


def normalize_key(name: str) -> str:
    """A bench_matmul.py variant name ('jax_marlin_bf16_g128') or a key -> the key."""
    if name.startswith("jax_marlin_"):
        return "jax_marlin " + " ".join(name[len("jax_marlin_"):].split("_"))
    return name


def index(records):
    """{(layer, m): {impl_key: record}}."""
    table = collections.defaultdict(dict)
    for r in records:
        table[(r["layer"], r["m"])][impl_key(r)] = r
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
        *([f"Kernel: {result['kernel']}", ""] if "kernel" in result else []),
        f"Device-to-device copy measured in the run (`copy_tbps`, an XLA elementwise pass): "
        f"{result['copy_tbps']:.2f} TB/s; the limit used below is **{copy:.2f} TB/s** (read + write), "
        "the larger of that and the baseline's copy kernel on this GPU. "
        "Times are device microseconds per matmul (median of "
        f"{result['method']['repeats']}, spread in the JSON; {result['method']['rotate']} weight "
        f"sets rotated so weights come from HBM; {targets.products_form(result['method'])}). "
        "*floor*: int4 g128 bytes at the limit. "
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
    lines += bf16_table(table, copy) + group_table(table)
    if result.get("note"):
        lines += ["", result["note"]]
    lines += ["", decode_step(table), ""]
    card = targets.markdown(result, table)
    if card:
        lines += [*card, ""]
    return "\n".join(lines)


def _rows(table, key):
    """(layer, m, record of key) for every row that has key, sorted."""
    return [(layer, m, impls[key]) for (layer, m), impls in sorted(table.items())
            if key in impls]


def bf16_table(table, copy) -> list[str]:
    """jax_marlin bf16 g128 against XLA's bf16 dot (and fp16 g128 of the same run)."""
    rows = _rows(table, "jax_marlin bf16 g128")
    if not rows:
        return []
    lines = ["", "## bfloat16", "",
             "*jax_marlin bf16 g128*: bfloat16 x and scales; *vs bf16*: its speedup over XLA's "
             "bfloat16 dot; *bf16 / fp16*: its time over jax_marlin fp16 g128's; *rel err* against "
             "the float32 product.", "",
             "| layer (k x n) | m | floor | jax_marlin bf16 g128 | xla_bf16 | jax_marlin g128 "
             "| TB/s | % limit | vs bf16 | bf16 / fp16 | rel err |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for layer, m, r in rows:
        impls = table[(layer, m)]
        dense, fp16 = impls.get("xla_bf16"), impls.get("jax_marlin g128")
        lines.append(
            f"| {layer} ({r['k']}x{r['n']}) | {m} | {floor_us(r['k'], r['n'], m, copy):.1f} "
            f"| {r['median_us']:.1f} | {_us(dense)} | {_us(fp16)} | {r['tbps']:.2f} "
            f"| {100 * r['tbps'] / copy:.0f}% | {_ratio(dense, r)} | {_ratio(r, fp16)} "
            f"| {r['rel_err']:.1e} |")
    return lines


GROUP_KEYS = ["jax_marlin g128", "jax_marlin g64", "jax_marlin g32", "jax_marlin g-1"]


def group_table(table) -> list[str]:
    """fp16 group sizes: times, and each one's time over g128's."""
    rows = [(layer, m, impls) for (layer, m), impls in sorted(table.items())
            if "jax_marlin g128" in impls
            and any(k in impls for k in ("jax_marlin g64", "jax_marlin g32"))]
    if not rows:
        return []
    lines = ["", "## float16 group sizes", "",
             "Device us of jax_marlin fp16 per group size (rows of k per scale; -1: one scale "
             "per column), then each one's time over g128's; *max rel err*: the largest of the "
             "row. Where weights dominate the traffic the bytes alone predict g64 / g128 = 1.03, "
             "g32 / g128 = 1.09 and g-1 / g128 = 0.97 (0.5 byte per weight plus 2 bytes of scale "
             "per group).", "",
             "| layer (k x n) | m | g128 | g64 | g32 | g-1 | g64 / g128 | g32 / g128 | g-1 / g128 "
             "| max rel err |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for layer, m, impls in rows:
        g128 = impls["jax_marlin g128"]
        times = " | ".join(_us(impls.get(k)) for k in GROUP_KEYS)
        ratios = " | ".join(_ratio(impls.get(k), g128) for k in GROUP_KEYS[1:])
        err = max(impls[k]["rel_err"] for k in GROUP_KEYS if k in impls)
        lines.append(f"| {layer} ({g128['k']}x{g128['n']}) | {m} | {times} | {ratios} "
                     f"| {err:.1e} |")
    return lines


def _us(r) -> str:
    return f"{r['median_us']:.1f}" if r else ""


def _ratio(slow, fast) -> str:
    """slow's time over fast's as '1.23x', empty if either is missing."""
    return f"{slow['median_us'] / fast['median_us']:.2f}x" if slow and fast else ""


def decode_step(table) -> str:
    """One Llama-70B block's four projections, summed from the per-layer rows."""
    rows = []
    for m in (1, 16, 64):
        try:
            marlin = sum(table[(l, m)]["jax_marlin g128"]["median_us"] for l in LLAMA70B_BLOCK)
            fp16 = sum(table[(l, m)]["xla_fp16"]["median_us"] for l in LLAMA70B_BLOCK)
        except KeyError:
            continue
        rows.append(f"| {m} | {marlin:.1f} | {fp16:.1f} | {fp16 / marlin:.2f}x "
                    f"| {marlin * LLAMA70B_BLOCKS / 1e3:.2f} | {fp16 * LLAMA70B_BLOCKS / 1e3:.2f} |")
    out = ["## Decode step of one Llama-3-70B block (qkv + o + gate_up + down)", ""]
    if rows:  # a run without all four layers or without xla_fp16 has none
        out += ["Sum of the four per-layer medians above (each measured separately).", "",
                "| m | jax_marlin g128 us | xla_fp16 us | speedup | x 80 blocks: jax_marlin ms "
                "| xla_fp16 ms |", "|---|---|---|---|---|---|", *rows]
    else:
        out.append("Not in this run: it needs jax_marlin g128 and xla_fp16 on all four layers.")
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
    """Speedup over XLA's dense dot (fp16, and bf16 if run) and group-size cost, against m."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = index(result["records"])
    panels = [p for p in (
        ("jax_marlin g128", "xla_fp16", "fp16"),
        ("jax_marlin bf16 g128", "xla_bf16", "bf16"),
    ) if any(p[0] in impls and p[1] in impls for impls in table.values())]
    has_groups = any("jax_marlin g128" in impls and any(k in impls for k in GROUP_KEYS[1:])
                     for impls in table.values())
    ncols = len(panels) + has_groups
    fig, axes = plt.subplots(1, ncols, figsize=(5.2 * ncols + 2.4, 4.8), squeeze=False)
    axes = list(axes[0])
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    layers = sorted({layer for layer, _ in table})
    handles = {}
    for ax, (fast, peer, dtype) in zip(axes, panels):
        for i, layer in enumerate(layers):
            ms = sorted(m for (l, m) in table if l == layer
                        and peer in table[(l, m)] and fast in table[(l, m)])
            if not ms:
                continue
            speed = [table[(layer, m)][peer]["median_us"] / table[(layer, m)][fast]["median_us"]
                     for m in ms]
            rec = table[(layer, ms[0])][fast]
            ideal = [ideal_speedup(rec["k"], rec["n"], m) for m in ms]
            c = colors[i % len(colors)]
            (handles[layer],) = ax.plot(ms, speed, "o-", color=c,
                                        label=f"{layer} ({rec['k']}x{rec['n']})")
            ax.plot(ms, ideal, ":", color=c, alpha=0.6)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("m (batch rows)")
        ax.set_ylabel(f"speedup of {fast} over XLA {dtype} dot")
        ax.set_title(f"{dtype}: jm.matmul vs x @ w_{dtype} (dotted: ideal)", fontsize=10)
        ax.grid(alpha=0.3)
    if has_groups:
        _group_panel(axes[-1], table)
    fig.suptitle(f"{result['gpu']}, jax {result['jax']}, {result.get('date', '')}")
    if handles:
        fig.legend(handles=list(handles.values()), fontsize=8, loc="upper left",
                   bbox_to_anchor=(1 - 2.3 / fig.get_figwidth(), 0.9))
    fig.tight_layout(rect=(0, 0, 1 - 2.4 / fig.get_figwidth(), 1))
    fig.savefig(path, dpi=120)


def _group_panel(ax, table) -> None:
    """Time of each fp16 group size over g128's: geometric mean over layers, min-max band."""
    for key, marker in zip(GROUP_KEYS[1:], "s^v"):
        ratios = collections.defaultdict(list)
        for (_, m), impls in table.items():
            if key in impls and "jax_marlin g128" in impls:
                ratios[m].append(impls[key]["median_us"] / impls["jax_marlin g128"]["median_us"])
        if not ratios:
            continue
        ms = sorted(ratios)
        ax.plot(ms, [geomean(ratios[m]) for m in ms], marker + "-", label=key.split()[-1])
        ax.fill_between(ms, [min(ratios[m]) for m in ms], [max(ratios[m]) for m in ms], alpha=0.15)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("m (batch rows)")
    ax.set_ylabel("time over jax_marlin fp16 g128")
    ax.set_title("fp16 group sizes (geomean over layers, band: min-max)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def geomean(values) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


# Ranges of m the comparison summarises separately: decode, small batches, larger.
M_RANGES = [("all m", 0, math.inf), ("m <= 16", 0, 16), ("16 < m <= 64", 17, 64),
            ("m > 64", 65, math.inf)]


def compare(old, new, key="jax_marlin g128", max_ratio=1.03) -> str:
    """Markdown: new / old median time of one implementation per (layer, m), and summaries.

    A row gets ``!`` when the ratio exceeds ``max_ratio`` and the slowdown is
    larger than both runs' spreads (max - min over the repeats), ``?`` when it
    exceeds ``max_ratio`` within the spreads (indistinguishable from noise).
    """
    key = normalize_key(key)
    a, b = index(old["records"]), index(new["records"])
    common = sorted(lm for lm in a if lm in b and key in a[lm] and key in b[lm])
    if not common:
        return f"no (layer, m) has {key} in both results"

    def describe(r):
        return (f"{r['gpu']}, jax {r['jax']}, {r.get('date', '')}, "
                f"copy {r['copy_tbps']:.2f} TB/s" +
                (f"; kernel: {r['kernel']}" if "kernel" in r else ""))

    def err(r):
        return f"{r['rel_err']:.1e}" if r.get("rel_err") is not None else ""

    lines = [f"## {key}: new / old median device time", "",
             f"old: {describe(old)}  ", f"new: {describe(new)} "
             f"(copy new / old {new['copy_tbps'] / old['copy_tbps']:.3f})", "",
             f"`!`: new / old > {max_ratio} by more than both spreads; `?`: > {max_ratio} within "
             "the spreads (noise). rel err: as each run measured it (see its method).", "",
             "| layer | m | old us (spread) | new us (spread) | new / old | | old rel err "
             "| new rel err |",
             "|---|---|---|---|---|---|---|---|"]
    ratios = {}
    flags = {}
    for lm in common:
        o, n = a[lm][key], b[lm][key]
        ratio = ratios[lm] = n["median_us"] / o["median_us"]
        flags[lm] = ""
        if ratio > max_ratio:
            slower = n["median_us"] - o["median_us"]
            flags[lm] = "!" if slower > max(o["spread_us"], n["spread_us"]) else "?"
        lines.append(f"| {lm[0]} | {lm[1]} | {o['median_us']:.1f} ({o['spread_us']:.1f}) "
                     f"| {n['median_us']:.1f} ({n['spread_us']:.1f}) | {ratio:.3f} | {flags[lm]} "
                     f"| {err(o)} | {err(n)} |")
    lines += ["", "| m | rows | geomean new / old | min | max | `!` | `?` |",
              "|---|---|---|---|---|---|---|"]
    for label, lo, hi in M_RANGES:
        part = [lm for lm in common if lo <= lm[1] <= hi]
        if not part:
            continue
        rs = [ratios[lm] for lm in part]
        lines.append(f"| {label} | {len(part)} | {geomean(rs):.3f} | {min(rs):.3f} "
                     f"| {max(rs):.3f} | {sum(flags[lm] == '!' for lm in part)} "
                     f"| {sum(flags[lm] == '?' for lm in part)} |")
    return "\n".join(lines) + "\n"


README_BEGIN = "<!-- performance table: generated by benchmarks/report.py --readme; do not edit -->"
README_END = "<!-- end of the generated performance table -->"
# Rows of the README table: every layer at these m (the full table is in the
# results' markdown).
README_MS = (1, 16, 64, 256, 1024)


def readme_table(result, results_path: pathlib.Path, readme_path: pathlib.Path) -> str:
    """The README's performance section body, from one results JSON."""
    table = index(result["records"])
    has_bf16 = any("jax_marlin bf16 g128" in impls for impls in table.values())
    rel = lambda p: pathlib.Path(os.path.relpath(p, readme_path.parent)).as_posix()
    md, png = results_path.with_suffix(".md"), results_path.with_suffix(".png")
    method = result["method"]
    lines = [
        f"{result['gpu']}, jax {result['jax']}, {result.get('date', '')}"
        + (f", copy bandwidth {result['copy_tbps']:.2f} TB/s in this run" if "copy_tbps" in result
           else "")
        + (f"; kernel: {result['kernel']}" if "kernel" in result else "") + ". "
        f"Device µs per matmul, weights streamed from HBM ({method['rotate']} weight sets "
        f"rotated; {targets.products_form(method)}), median of {method['repeats']} "
        "(`benchmarks/bench_matmul.py`; every m, "
        f"spreads and errors in [`{rel(md)}`]({rel(md)}), notes in "
        f"[`benchmarks/NOTES.md`]({rel(readme_path.parent / 'benchmarks' / 'NOTES.md')})). "
        "*XLA int4*: `jnp.int4` weights cast to float16 and scaled per group of 128, then "
        "`x @ w`, what a JAX user writes today. *vs*: speedup of jax_marlin fp16 g128.",
        "",
        "| layer (k x n) | m | jax_marlin g128 | " + ("jax_marlin bf16 g128 | " if has_bf16 else "")
        + "XLA fp16 dot | XLA int4 g128 | vs fp16 | vs int4 |",
        "|---|---|---|---|---|---|---|" + ("---|" if has_bf16 else ""),
    ]
    seen = set()
    for layer in dict.fromkeys(r["layer"] for r in result["records"]):  # the run's order
        for m in README_MS:
            impls = table.get((layer, m), {})
            g128 = impls.get("jax_marlin g128")
            if g128 is None:
                continue
            name = layer if layer in seen else f"{layer} ({g128['k']}x{g128['n']})"
            seen.add(layer)
            bf16 = f"{_us(impls.get('jax_marlin bf16 g128'))} | " if has_bf16 else ""
            lines.append(f"| {name} | {m} | {_us(g128)} | {bf16}{_us(impls.get('xla_fp16'))} "
                         f"| {_us(impls.get('xla_int4'))} | {_ratio(impls.get('xla_fp16'), g128)} "
                         f"| {_ratio(impls.get('xla_int4'), g128)} |")
    lines += ["", f"![speedup over XLA fp16]({rel(png)})"]
    return "\n".join(lines)


def write_readme(result, results_path: pathlib.Path, readme_path: pathlib.Path) -> None:
    """Replaces the text between README_BEGIN and README_END with readme_table()."""
    text = readme_path.read_text()
    if README_BEGIN not in text or README_END not in text:
        raise SystemExit(f"{readme_path} has no performance table markers:\n{README_BEGIN}\n"
                         f"{README_END}")
    head, rest = text.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    body = readme_table(result, results_path, readme_path)
    readme_path.write_text(f"{head}{README_BEGIN}\n{body}\n{README_END}{tail}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", type=pathlib.Path, nargs="?",
                        help="results JSON: writes <name>.md and <name>.png beside it")
    parser.add_argument("--no-plot", action="store_true", help="markdown only (no matplotlib)")
    parser.add_argument("--readme", type=pathlib.Path,
                        help="also regenerate this README's performance table from the results")
    parser.add_argument("--compare", nargs=2, type=pathlib.Path, metavar=("OLD", "NEW"),
                        help="print new / old per (layer, m) for --impl instead")
    parser.add_argument("--impl", default="jax_marlin g128",
                        help="for --compare: a key ('jax_marlin g128') or a bench_matmul.py "
                             "variant name ('jax_marlin_g128'); default: %(default)s")
    parser.add_argument("--max-ratio", type=float, default=1.03,
                        help="for --compare: mark rows slower than this (default %(default)s)")
    args = parser.parse_args(argv)
    if args.compare:
        old, new = (json.loads(p.read_text()) for p in args.compare)
        print(compare(old, new, args.impl, args.max_ratio), end="")
        return
    if args.results is None:
        parser.error("give a results JSON, or --compare OLD NEW")
    result = json.loads(args.results.read_text())
    args.results.with_suffix(".md").write_text(markdown(result))
    written = [args.results.with_suffix(".md")]
    if not args.no_plot:
        plot(result, args.results.with_suffix(".png"))
        written.append(args.results.with_suffix(".png"))
    if args.readme:
        write_readme(result, args.results, args.readme)
        written.append(args.readme)
    print("wrote", ", ".join(map(str, written)))


if __name__ == "__main__":
    main()
