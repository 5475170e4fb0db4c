"""benchmarks/targets.py: the scorecard of a results JSON against the project's targets.

Synthetic records with known times, so each target's verdict, count and worst
row are known in advance.
"""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import report  # noqa: E402
import targets  # noqa: E402

K_N = {"70b.qkv": (8192, 10240), "70b.o": (8192, 8192), "70b.gate_up": (8192, 57344),
       "70b.down": (28672, 8192), "8b.qkv": (4096, 6144), "8b.o": (4096, 4096),
       "8b.gate_up": (4096, 28672), "8b.down": (14336, 4096)}


def record(layer, m, impl, us, *, dtype="float16", group_size=128, layout="sym", tbps=None,
           rel_err=None):
    k, n = K_N[layer]
    if impl == "jax_marlin":
        rel_err = 2e-4 if rel_err is None else rel_err
        tbps = 3.0 if tbps is None else tbps
    return dict(layer=layer, k=k, n=n, m=m, impl=impl, dtype=dtype, group_size=group_size,
                layout=layout, median_us=us, spread_us=0.1, tbps=tbps, rel_err=rel_err)


def result(records):
    return dict(gpu="NVIDIA H200", jax="0.11.2", copy_tbps=4.1, records=records,
                method=dict(rotate=8, repeats=5))


def entry(records, name_start, key="jax_marlin g128"):
    table = report.index(records)
    found = [e for e in targets.score(table)
             if e["target"].name.startswith(name_start) and e["key"] == key]
    assert len(found) == 1, [(e["target"].name, e["key"]) for e in targets.score(table)]
    return found[0]


def test_prefill_speedups_count_rows_and_name_the_worst():
    records = []
    # m = 64 speedups over the fp16 dot: 1.6, 1.5 (meets: >=), 1.2.
    for layer, marlin in (("70b.qkv", 10.0), ("70b.o", 20.0), ("8b.o", 25.0)):
        records += [record(layer, 64, "jax_marlin", marlin),
                    record(layer, 64, "xla_fp16", {"70b.qkv": 16.0, "70b.o": 30.0,
                                                   "8b.o": 30.0}[layer])]
    e = entry(records, "prefill: m = 64")
    assert (e["met"], e["rows"], e["passed"]) == (2, 3, False)
    assert e["worst"][:2] == ("8b.o", 64) and e["worst"][2] == pytest.approx(1.2)
    assert e["median"] == pytest.approx(1.5)


def test_all_rows_met_passes_and_worst_is_nearest_to_failing():
    records = [record("70b.qkv", 256, "jax_marlin", 10.0), record("70b.qkv", 256, "xla_fp16", 12.0),
               record("8b.qkv", 256, "jax_marlin", 10.0), record("8b.qkv", 256, "xla_fp16", 11.5)]
    e = entry(records, "prefill: m = 256")
    assert (e["met"], e["rows"], e["passed"]) == (2, 2, True)
    assert e["worst"][0] == "8b.qkv"


def test_bfloat16_is_compared_with_the_bfloat16_dot_only():
    records = [record("8b.o", 1, "jax_marlin", 10.0, dtype="bfloat16"),
               record("8b.o", 1, "xla_fp16", 100.0),  # not its peer: must not count
               record("8b.o", 1, "xla_bf16", 15.0)]
    e = entry(records, "decode: 8B layers", key="jax_marlin bf16 g128")
    assert e["worst"][2] == pytest.approx(1.5) and not e["passed"]
    # Without its own dtype's dot a bf16 row is not scored at all.
    table = report.index(records[:2])
    assert not [e for e in targets.score(table) if e["key"] == "jax_marlin bf16 g128"
                and e["target"].name.startswith("decode: 8B")]


def test_bandwidth_target_needs_the_median_as_well_as_every_row():
    # Every row above 2.8 TB/s, but the median below 3.4: not met.
    records = [record(layer, m, "jax_marlin", 10.0, tbps=3.0)
               for layer in targets.LAYERS_70B for m in targets.DECODE_MS]
    e = entry(records, "decode: 70B layers")
    assert (e["met"], e["rows"]) == (20, 20) and not e["passed"]
    records = [dict(r, tbps=3.5) for r in records]
    records[0]["tbps"] = 2.7  # one row below 2.8: not met either
    e = entry(records, "decode: 70B layers")
    assert (e["met"], e["passed"]) == (19, False)
    assert e["worst"][:2] == (records[0]["layer"], records[0]["m"])
    records[0]["tbps"] = 2.9
    assert entry(records, "decode: 70B layers")["passed"]
    # m = 32 is not a decode row of the target.
    assert entry(records + [record("70b.o", 32, "jax_marlin", 1.0, tbps=0.1)],
                 "decode: 70B layers")["rows"] == 20


def test_imported_layouts_against_symmetric_g128():
    records = [record("70b.down", 16, "jax_marlin", 40.0),
               record("70b.down", 16, "jax_marlin", 42.5, layout="zp"),         # +6.25%
               record("70b.down", 16, "jax_marlin", 43.0, layout="act_order"),  # +7.5%
               record("70b.down", 16, "jax_marlin", 39.0, group_size=-1)]
    zp = entry(records, "zero points", key="jax_marlin zp g128")
    assert not zp["passed"] and zp["worst"][2] == pytest.approx(0.0625)
    assert entry(records, "act-order", key="jax_marlin act order g128")["passed"]
    # Imported layouts are not scored as symmetric variants, nor g-1 as an import.
    keys = {e["key"] for e in targets.score(report.index(records))
            if e["target"].name.startswith("decode: every layer")}
    assert keys == set()  # no XLA dot in this run
    keys = {e["key"] for e in targets.score(report.index(records))
            if e["target"].name.startswith("accuracy: float16")}
    assert keys == {"jax_marlin g128", "jax_marlin zp g128", "jax_marlin act order g128",
                    "jax_marlin g-1"}


def test_accuracy_limits_per_dtype():
    records = [record("8b.o", 1, "jax_marlin", 10.0, rel_err=1.1e-3),
               record("8b.o", 1, "jax_marlin", 10.0, dtype="bfloat16", rel_err=2.9e-3)]
    assert not entry(records, "accuracy: float16")["passed"]
    assert entry(records, "accuracy: bfloat16", key="jax_marlin bf16 g128")["passed"]


def test_markdown_card_in_the_report():
    records = [record("70b.qkv", 64, "jax_marlin", 10.0), record("70b.qkv", 64, "xla_fp16", 12.0)]
    text = report.markdown(result(records))
    assert "## Targets" in text
    line = next(l for l in text.splitlines() if l.startswith("| prefill: m = 64"))
    assert "| 0 / 1 |" in line and "70b.qkv m = 64: 1.20x" in line and "**no**" in line
    # A run with no row of any target has no card.
    assert targets.markdown(result([]), report.index([])) == []


def test_decode_step_card():
    step = dict(device="NVIDIA H200", jax="0.11.2", blocks=32, rows=[
        dict(m=1, speedup=2.4, pipelined_speedup=2.5),
        dict(m=16, speedup=2.6),
        dict(m=64, speedup=0.99, pipelined_speedup=1.0, fused_pipelined_speedup=1.2)])
    lines = targets.step_markdown(step)
    rows = [l for l in lines if l.startswith("| 1 ") or l.startswith("| 16 ")
            or l.startswith("| 64 ")]
    assert rows == ["| 1 | >= 2.5x | calls | 2.40x | **no** |",
                    "| 1 | >= 2.5x | pipelined | 2.50x | yes |",
                    "| 16 | >= 2.5x | calls | 2.60x | yes |",
                    "| 64 | >= 1.0x | calls | 0.99x | **no** |",
                    "| 64 | >= 1.0x | pipelined | 1.00x | yes |",
                    "| 64 | >= 1.0x | fused, pipelined | 1.20x | yes |"]
