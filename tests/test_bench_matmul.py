"""benchmarks/bench_matmul.py's measuring loop on the CPU: its records, their errors, the save
after every m, and the scorecard reading them. (Timings on a CPU mean nothing; the records'
shape and the relative errors do.)
"""

from __future__ import annotations

import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_marlin as jm

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
        assert r["median_us"] > 0 and r["row_s"] >= r["median_us"] * 1e-6
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


def test_summed_products_are_the_sum(tiny):
    # --outputs sum: the call returns the float32 sum of its products, which
    # pass an optimization barrier first (so the dots stay whole).
    records = []
    bench_matmul.bench_layer(tiny, [3], ["jax_marlin_g128", "xla_fp16"], records,
                             log=lambda r: None, outputs="sum")
    assert {r["outputs"] for r in records} == {"sum"}
    k, n = bench_matmul.LAYERS[tiny]
    x = jax.random.normal(jax.random.key(0), (3, k), jnp.float16)
    ws = [jm.quantize(jax.random.normal(jax.random.key(i), (k, n))) for i in range(2)]
    summed = bench_matmul.FUNCTIONS["sum"]["jax_marlin"]([x], ws)
    expected = sum(jm.matmul(x, w).astype(jnp.float32) for w in ws)
    assert summed.shape == (3, n) and summed.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(summed), np.asarray(expected))
    assert "optimization_barrier" in bench_matmul.FUNCTIONS["sum"]["xla_fp16"].lower(
        [x], [w.astype(jnp.float16) for w in (jnp.ones((k, n)),) * 2]).as_text()


@pytest.fixture
def main_on_cpu(tiny, monkeypatch):
    """bench_matmul.main on a CPU: the GPU check passed, the 8 GiB copy measurement skipped."""
    monkeypatch.setattr(bench_matmul.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(bench_matmul.jm, "HAS_CUDA", True)
    monkeypatch.setattr(bench_matmul, "copy_tbps", lambda: 1.0)
    return lambda *argv: bench_matmul.main(["--layers", tiny, "--ms", "1", *argv])


def test_full_sums_and_append_keeps_one_method(main_on_cpu, tmp_path, capsys):
    out = str(tmp_path / "full.json")
    assert main_on_cpu("--impls", "full", "--out", out) == 0
    first = json.loads(pathlib.Path(out).read_text())
    assert first["method"]["outputs"] == "sum"  # the targets' sweep: temporaries, as in a model
    assert {r["outputs"] for r in first["records"]} == {"sum"}
    # A slice measured the other way is refused, and the file is left as it was.
    assert main_on_cpu("--impls", "full", "--outputs", "list", "--out", out, "--append") == 2
    assert "outputs sum there, list here" in capsys.readouterr().err
    assert json.loads(pathlib.Path(out).read_text()) == first
    # The same method appends: the earlier rows of other m stay.
    assert main_on_cpu("--impls", "full", "--ms", "2", "--out", out, "--append") == 0
    both = json.loads(pathlib.Path(out).read_text())
    assert sorted({r["m"] for r in both["records"]}) == [1, 2]
    # So does the imported layouts' side by side; the README's sweep keeps returned products.
    for impls, outputs in (("zp", "sum"), ("sweep", "list")):
        assert main_on_cpu("--impls", impls, "--out", str(tmp_path / f"{impls}.json")) == 0
        assert json.loads((tmp_path / f"{impls}.json").read_text())["method"]["outputs"] == outputs


def test_small_layers_only_when_named(main_on_cpu, tmp_path, monkeypatch, capsys):
    # SmolLM2-135M's projections are measured when named, never by default,
    # and a misspelt layer is refused by name.
    assert not set(bench_matmul.SMALL_LAYERS) & set(bench_matmul.LAYERS)
    monkeypatch.setattr(bench_matmul, "ROTATE", 1)
    out = tmp_path / "small.json"
    assert bench_matmul.main(["--layers", "135m.o", "--ms", "1", "--impls", "jax_marlin_g128",
                              "xla_fp16", "--out", str(out)]) == 0
    records = json.loads(out.read_text())["records"]
    assert {(r["layer"], r["k"], r["n"]) for r in records} == {("135m.o", 576, 576)}
    with pytest.raises(SystemExit):
        bench_matmul.main(["--layers", "135m.0", "--ms", "1"])
    assert "unknown layers ['135m.0']" in capsys.readouterr().err
