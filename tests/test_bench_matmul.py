"""benchmarks/bench_matmul.py's measuring loop on the CPU: its records, their errors, the save
after every m, and the scorecard reading them. (Timings on a CPU mean nothing; the records'
shape and the relative errors do.)
"""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_matmul  # noqa: E402
import report  # noqa: E402
import targets  # noqa: E402


@pytest.fixture
def tiny(monkeypatch):
    """A 256 x 128 layer, two weight sets, one call a repeat: seconds on a CPU."""
    monkeypatch.setitem(bench_matmul.LAYERS, "tiny", (256, 128))
    monkeypatch.setattr(bench_matmul, "ROTATE", 2)
    monkeypatch.setattr(bench_matmul, "CALLS", 1)
    monkeypatch.setattr(bench_matmul, "REPEATS", 1)
    return "tiny"


def test_full_variants_records_and_saves(tiny):
    variants = bench_matmul.expand(["full"])
    assert variants == ["jax_marlin_g128", "jax_marlin_g-1", "jax_marlin_bf16_g128",
                        "jax_marlin_bf16_g-1", "xla_fp16", "xla_bf16", "xla_int4"]
    records, saved = [], []
    bench_matmul.bench_layer(tiny, [1, 64], variants, records, log=lambda r: None,
                             save=lambda: saved.append(len(records)))
    assert saved == [7, 14]  # once per m, after its variants
    table = report.index(records)
    assert set(table[(tiny, 64)]) == {"jax_marlin g128", "jax_marlin g-1", "jax_marlin bf16 g128",
                                      "jax_marlin bf16 g-1", "xla_fp16", "xla_bf16", "xla_int4"}
    for r in records:
        assert r["median_us"] > 0
        if r["impl"] == "jax_marlin":
            # Against x @ dequantize(w) in float32: the output's rounding only.
            assert 0 < r["rel_err"] <= (1e-3 if r["dtype"] == "float16" else 3e-3), r
            assert r["tbps"] is not None  # (rounded to 0.001 TB/s: 0.0 on a CPU)
        else:
            assert r["rel_err"] is None
    # Every jax_marlin variant is scored on accuracy, each against its own dtype's dot.
    scored = {(e["target"].name.split(":")[0], e["key"]) for e in targets.score(table)}
    assert {key for name, key in scored if name == "accuracy"} == {
        "jax_marlin g128", "jax_marlin g-1", "jax_marlin bf16 g128", "jax_marlin bf16 g-1"}
    assert {name for name, _ in scored} <= {"accuracy", "decode", "prefill"}
    bf16_rows = [e for e in targets.score(table) if e["key"] == "jax_marlin bf16 g128"
                 and e["target"].name.startswith("prefill: m = 64")]
    (row,) = bf16_rows
    expected = (table[(tiny, 64)]["xla_bf16"]["median_us"]
                / table[(tiny, 64)]["jax_marlin bf16 g128"]["median_us"])
    assert row["worst"][2] == pytest.approx(expected)


def test_full_alias_measures_up_to_4096():
    assert bench_matmul.FULL_MS[-1] == 4096 and bench_matmul.FULL_MS[:-2] == bench_matmul.MS
