"""Every feature of jm.matmul at once, on random combinations.

The other tests take the features a few at a time on chosen shapes; here a
seeded random draw combines them: any k, n (padded or not), m from 0 to 40
(with leading dimensions), float16 or bfloat16, each group size, zero
points, act-order, a bias, and one of the fusions (residual, RMSNorm,
SwiGLU). The reference is computed in float64 from the integers the weight
was packed from (``q``, ``scales``, ``zeros``, ``g_idx``), not from
jax_marlin, and the output buffer starts as NaN, so a wrong zero point,
permutation, group, padding or unwritten element is far outside the bound.

Bound: the product is rounded once to the dtype (u relative to it) and the
residual sum once more; x' = rmsnorm(x) or silu(gate) up is rounded to the
dtype before the product, as the unfused composition rounds it, which the
reference does too. So ||y - ref|| / ||ref|| <= 2 u, plus the fp32
accumulation (under 1e-5 here).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import BF16_U, FP16_U, imported_weight, prologue64

from jax_marlin.ops import _matmul

EPS = 1e-5
TOL = {np.dtype(jnp.float16): 2 * FP16_U + 1e-5, np.dtype(jnp.bfloat16): 2 * BF16_U + 1e-5}
CASES = 24


def draw(seed: int) -> dict:
    """One random combination of features."""
    rng = np.random.default_rng(seed)
    group_size = int(rng.choice([32, 64, 128, -1]))
    return dict(
        k=int(rng.integers(1, 700)), n=int(rng.integers(1, 600)),
        lead=(int(rng.integers(0, 41)),) if rng.random() < 0.8 else (2, int(rng.integers(1, 9))),
        dtype=np.dtype(rng.choice([jnp.float16, jnp.bfloat16])), group_size=group_size,
        zeros=bool(rng.random() < 0.5), act_order=bool(group_size != -1 and rng.random() < 0.5),
        bias=bool(rng.random() < 0.5),
        fusion=str(rng.choice(["none", "residual", "rms_norm", "swiglu"])))


def inputs(seed: int, case: dict):
    """``(w, x, kwargs, ref)`` for a drawn case; ``ref`` in float64 from the integers
    (conftest.imported_weight)."""
    rng = np.random.default_rng(seed + 1000)
    k, n, dtype = case["k"], case["n"], case["dtype"]
    w, weight = imported_weight(rng, k, n, case["group_size"], zeros=case["zeros"],
                                act_order=case["act_order"], dtype=dtype)
    lead, swiglu = case["lead"], case["fusion"] == "swiglu"
    x = (rng.standard_normal(lead + ((2 if swiglu else 1) * k,)) * 2).astype(dtype)
    kwargs = {}
    if case["fusion"] == "rms_norm":
        kwargs["rms_norm_weight"] = rng.uniform(0.5, 2.0, k).astype(dtype)
        kwargs["rms_norm_eps"] = EPS
    elif swiglu:
        kwargs["swiglu"] = True
    x64 = prologue64(x, kwargs.get("rms_norm_weight"), swiglu, eps=EPS)
    ref = x64 @ weight
    size = ref.std() if ref.size else 1.0
    if case["bias"]:
        kwargs["bias"] = (rng.standard_normal(n) * size).astype(dtype)
        ref = ref + np.asarray(kwargs["bias"], np.float64)
    if case["fusion"] == "residual":
        kwargs["residual"] = (rng.standard_normal(lead + (n,)) * size).astype(dtype)
        ref = ref + np.asarray(kwargs["residual"], np.float64)
    return w, x, kwargs, ref


def call(seed: int):
    """``(case, y, ref)``: the drawn case run jitted, its output buffer starting as NaN."""
    case = draw(seed)
    w, x, kwargs, ref = inputs(seed, case)
    arrays = {key: v for key, v in kwargs.items() if key in ("bias", "residual", "rms_norm_weight")}
    static = {key: v for key, v in kwargs.items() if key not in arrays}
    y = jax.jit(lambda x, w, a: _matmul(x, w, poison_output=True, **a, **static))(x, w, arrays)
    return case, jax.block_until_ready(y), ref


def run(seed: int):
    case, y, ref = call(seed)
    assert y.shape == case["lead"] + (case["n"],) and y.dtype == case["dtype"], case
    y = np.asarray(y, np.float64)
    assert np.isfinite(y).all(), f"NaN/inf left in the output: {case}"
    if ref.size == 0:
        return
    err = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
    assert err <= TOL[case["dtype"]], f"{err:.2e} against float64: {case}"


@pytest.mark.parametrize("seed", range(CASES))
def test_random_combination(seed):
    run(seed)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(CASES))
def test_random_combination_gpu(seed):
    with jax.default_device(jax.devices("gpu")[0]):
        run(seed)


def test_the_draw_covers_every_feature():
    # So that a change of the draw cannot quietly leave a feature out.
    cases = [draw(seed) for seed in range(CASES)]
    assert {c["group_size"] for c in cases} == {32, 64, 128, -1}
    assert {c["fusion"] for c in cases} == {"none", "residual", "rms_norm", "swiglu"}
    assert {c["dtype"] for c in cases} == {np.dtype(jnp.float16), np.dtype(jnp.bfloat16)}
    assert all(any(c[f] for c in cases) and not all(c[f] for c in cases)
               for f in ("zeros", "act_order", "bias"))
    assert any(c["zeros"] and c["act_order"] for c in cases)
    assert any(c["lead"][0] == 0 for c in cases) or any(len(c["lead"]) == 2 for c in cases)
    assert any(c["k"] % 128 and c["n"] % 64 for c in cases)  # padded on both sides
