"""The project's speed and accuracy targets, checked against a bench_matmul.py results JSON.

    python benchmarks/targets.py benchmarks/results/h200-2026-12-04-sweep.json

prints a markdown scorecard: for each target and each jax_marlin variant the
run measured, how many of the target's rows it meets and the worst row. A
target's rows are those of the run that fall in its layers and m (a run
without them shows no line; a partial sweep scores what it has), so the card
says what was measured, not what was meant to be. ``report.py`` appends the
same card to the results' markdown.

The targets are stated for an H200; on another card the TB/s ones meet a
different bandwidth, so the card prints the run's copy bandwidth beside them:

- decode, the four 70B layers at m = 1..16: median >= 3.4 TB/s, no row below
  2.8 TB/s (TB/s: the int4 weights, scales, x and y moved once per call);
- decode, the four 8B layers at m <= 16: >= 2x the XLA dot of the same dtype;
- decode, every layer at m <= 16: not slower than that dot;
- prefill, every layer: >= 1.5x that dot at m = 64 and 128, >= 1.1x at 256,
  >= 1.0x at 512..4096;
- accuracy: relative error <= 1e-3 in float16, <= 3e-3 in bfloat16;
- imported layouts (m in {1, 16, 64, 256}, the 70B and 8B layers): zero
  points within 5% of the symmetric g128 time, act-order within 10%.

Given a bench_decode_step.py JSON instead, it scores the Llama-3-8B decode
step: >= 2.5x the float16 step at m = 1 and 16, not slower at m = 64, for
each form the run timed (host-timed calls, pipelined, and the fused ones).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
from typing import Callable

LAYERS_70B = ("70b.qkv", "70b.o", "70b.gate_up", "70b.down")
LAYERS_8B = ("8b.qkv", "8b.o", "8b.gate_up", "8b.down")
DECODE_MS = (1, 2, 4, 8, 16)
IMPORT_MS = (1, 16, 64, 256)


@dataclasses.dataclass(frozen=True)
class Target:
    """One target: which rows it covers and what each must reach.

    ``value(record, peers)`` gives a row's number (``None`` if the run lacks
    what it is compared with), ``ok(value)`` whether the row meets the
    target; with ``median`` set, the rows' median must meet it as well.
    ``higher``: whether a larger value is better (speedups, TB/s) or worse
    (errors, costs); it decides which row is the worst.
    """

    name: str
    layers: tuple[str, ...] | None  # None: every layer
    ms: Callable[[int], bool]
    variants: Callable[[str], bool]  # over impl keys ('jax_marlin bf16 g128', ...)
    value: Callable[[dict, dict], float | None]
    ok: Callable[[float], bool]
    unit: str  # how a value prints: 'x', 'TB/s', 'err', '%'
    median: Callable[[float], bool] | None = None
    higher: bool = True


def _symmetric(key: str) -> bool:
    return key.startswith("jax_marlin") and " zp " not in f" {key} " and "act order" not in key


def _bf16(key: str) -> bool:
    return " bf16 " in f" {key} "


def _dot_of(key: str) -> str:
    """The XLA dot a jax_marlin variant is compared with: the same dtype's."""
    return "xla_bf16" if _bf16(key) else "xla_fp16"


def _speedup(record: dict, peers: dict) -> float | None:
    dot = peers.get(_dot_of(record["key"]))
    return dot["median_us"] / record["median_us"] if dot else None


def _over_symmetric(record: dict, peers: dict) -> float | None:
    sym = peers.get("jax_marlin g128")
    return record["median_us"] / sym["median_us"] - 1 if sym else None


TARGETS = [
    Target("decode: 70B layers, m 1-16, median >= 3.4 TB/s, none below 2.8", LAYERS_70B,
           lambda m: m in DECODE_MS, _symmetric, lambda r, _: r.get("tbps"),
           lambda v: v >= 2.8, "TB/s", median=lambda v: v >= 3.4),
    Target("decode: 8B layers, m <= 16, >= 2x the XLA dot", LAYERS_8B, lambda m: m <= 16,
           _symmetric, _speedup, lambda v: v >= 2.0, "x"),
    Target("decode: every layer, m <= 16, not slower than the XLA dot", None, lambda m: m <= 16,
           _symmetric, _speedup, lambda v: v >= 1.0, "x"),
    Target("prefill: m = 64, >= 1.5x the XLA dot", None, lambda m: m == 64, _symmetric, _speedup,
           lambda v: v >= 1.5, "x"),
    Target("prefill: m = 128, >= 1.5x the XLA dot", None, lambda m: m == 128, _symmetric,
           _speedup, lambda v: v >= 1.5, "x"),
    Target("prefill: m = 256, >= 1.1x the XLA dot", None, lambda m: m == 256, _symmetric,
           _speedup, lambda v: v >= 1.1, "x"),
    Target("prefill: m = 512-4096, not slower than the XLA dot", None,
           lambda m: 512 <= m <= 4096, _symmetric, _speedup, lambda v: v >= 1.0, "x"),
    Target("accuracy: float16 rel err <= 1e-3", None, lambda m: True,
           lambda key: key.startswith("jax_marlin") and not _bf16(key),
           lambda r, _: r.get("rel_err"), lambda v: v <= 1e-3, "err", higher=False),
    Target("accuracy: bfloat16 rel err <= 3e-3", None, lambda m: True,
           lambda key: key.startswith("jax_marlin") and _bf16(key),
           lambda r, _: r.get("rel_err"), lambda v: v <= 3e-3, "err", higher=False),
    Target("zero points within 5% of symmetric g128", LAYERS_70B + LAYERS_8B,
           lambda m: m in IMPORT_MS, lambda key: key == "jax_marlin zp g128", _over_symmetric,
           lambda v: v <= 0.05, "%", higher=False),
    Target("act-order within 10% of symmetric g128", LAYERS_70B + LAYERS_8B,
           lambda m: m in IMPORT_MS, lambda key: key == "jax_marlin act order g128",
           _over_symmetric, lambda v: v <= 0.10, "%", higher=False),
]


def products_form(method: dict) -> str:
    """How a run's matmul products left the jitted call, in words for the tables' headers."""
    if method.get("outputs", "list") == "sum":
        return ("each call's products summed inside it, so that they are temporaries as in a "
                "model (each row includes reading its product once)")
    return "each product a result of the call"


def _fmt(value: float, unit: str) -> str:
    if unit == "x":
        return f"{value:.2f}x"
    if unit == "TB/s":
        return f"{value:.2f} TB/s"
    if unit == "%":
        return f"{100 * value:+.1f}%"
    return f"{value:.1e}"


def score(table: dict) -> list[dict]:
    """One entry per (target, variant) with rows: counts, worst row, median.

    ``table``: a run's records as report.index gives them, {(layer, m): {impl
    key: record}}.
    """
    lines = []
    for target in TARGETS:
        rows: dict[str, list[tuple[str, int, float]]] = {}
        for (layer, m), impls in sorted(table.items()):
            if target.layers is not None and layer not in target.layers:
                continue
            if not target.ms(m):
                continue
            for key, record in impls.items():
                if not target.variants(key):
                    continue
                value = target.value({**record, "key": key}, impls)
                if value is not None:
                    rows.setdefault(key, []).append((layer, m, value))
        for key, values in rows.items():
            met = [v for v in values if target.ok(v[2])]
            # The worst row: the one furthest on the failing side.
            worst = min(values, key=lambda v: (target.ok(v[2]),
                                               v[2] if target.higher else -v[2]))
            med = statistics.median(v[2] for v in values)
            lines.append(dict(target=target, key=key, rows=len(values), met=len(met),
                              worst=worst, median=med,
                              passed=len(met) == len(values)
                              and (target.median is None or target.median(med))))
    return lines


def markdown(result: dict, table: dict) -> list[str]:
    """The scorecard of ``result`` (its records indexed as ``table``) as markdown lines."""
    entries = score(table)
    if not entries:
        return []
    out = ["## Targets", "",
           f"Each target against this run's rows ({result['gpu']}, copy bandwidth "
           f"{result['copy_tbps']:.2f} TB/s; {products_form(result.get('method', {}))}); "
           "*met*: rows that reach it; *worst*: the row "
           "furthest from it (or, where all meet it, nearest to failing).", "",
           "| target | variant | met | median | worst row | |",
           "|---|---|---|---|---|---|"]
    for e in entries:
        t, (layer, m, v) = e["target"], e["worst"]
        out.append(f"| {t.name} | {e['key']} | {e['met']} / {e['rows']} "
                   f"| {_fmt(e['median'], t.unit)} | {layer} m = {m}: {_fmt(v, t.unit)} "
                   f"| {'yes' if e['passed'] else '**no**'} |")
    return out


# The decode step: (m, least speedup over the float16 step).
STEP_TARGETS = ((1, 2.5), (16, 2.5), (64, 1.0))
# bench_decode_step.py's speedup fields, the forms of the step it times.
STEP_FORMS = (("speedup", "calls"), ("pipelined_speedup", "pipelined"),
              ("fused_speedup", "fused calls"), ("fused_pipelined_speedup", "fused, pipelined"))


def step_markdown(step: dict) -> list[str]:
    """The decode step's card from a bench_decode_step.py JSON, as markdown lines."""
    rows = {r["m"]: r for r in step["rows"]}
    out = ["## Targets: the decode step", "",
           f"Llama-3-8B decode step ({step.get('blocks', '?')} blocks), jax_marlin g128 against "
           f"float16 dots ({step['device']}, jax {step['jax']}).", "",
           "| m | target | form | speedup | |", "|---|---|---|---|---|"]
    for m, least in STEP_TARGETS:
        for field, form in STEP_FORMS:
            if m in rows and field in rows[m]:
                v = rows[m][field]
                out.append(f"| {m} | >= {least}x | {form} | {v:.2f}x "
                           f"| {'yes' if v >= least else '**no**'} |")
    return out


def main(argv=None) -> None:
    import report  # beside this file

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", type=pathlib.Path,
                        help="a bench_matmul.py results JSON or a bench_decode_step.py one")
    args = parser.parse_args(argv)
    result = json.loads(args.results.read_text())
    if "records" in result:
        print("\n".join(markdown(result, report.index(result["records"]))))
    else:
        print("\n".join(step_markdown(result)))


if __name__ == "__main__":
    main()
