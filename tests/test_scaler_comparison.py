"""``benchmarks/scaler_comparison.py``: its quick mode runs, and its scenarios tell the truth.

The scenario facts are what the README's comparison table claims: jamp's skip is
bit-exact for inf, -inf and NaN gradients (Adam's count included), the gradient
on a growth step is the true one, and the scale lives in the optimizer state.
"""

from __future__ import annotations

import pytest

from benchmarks import scaler_comparison


@pytest.fixture(scope="module")
def quick():
    return scaler_comparison.main(["--quick", "--libs", "jamp,flax", "--no-write"])


def test_jamp_row(quick):
    facts = quick["rows"]["jamp"]["facts"]
    assert [facts[f"skip_exact_{k}"] for k in ("inf", "-inf", "nan")] == [True] * 3
    assert [facts[f"backoff_{k}"] for k in ("inf", "-inf", "nan")] == [True] * 3
    assert facts["growth_steps"] == 3 and facts["growth_grad_exact"] is True
    assert facts["growth_grad_ratio"] == 1.0
    assert facts["scale_in_opt_state"] is True and facts["max_scale"] == 2.0**24


def test_flax_row(quick):
    facts = quick["rows"]["flax"]["facts"]
    assert [facts[f"skip_exact_{k}"] for k in ("inf", "-inf", "nan")] == [True] * 3
    assert facts["growth_grad_exact"] is True and facts["scale_in_opt_state"] is False


def test_quick_mode_times_and_renders(quick):
    assert set(quick["rows"]) == {"f16", "jamp", "flax"}
    assert all(row["ms"]["8"] > 0 for row in quick["rows"].values())
    table = scaler_comparison.to_markdown(quick)
    assert "| jamp.DynamicLossScale | " in table and "| True/True/True | True | 1 |" in table


def test_same_sees_one_bit():
    import jax.numpy as jnp

    a = {"w": jnp.array([1.0, 0.0])}
    assert scaler_comparison.same(a, {"w": jnp.array([1.0, 0.0])})
    assert not scaler_comparison.same(a, {"w": jnp.array([1.0, -0.0])})
    assert not scaler_comparison.same(a, {"w": jnp.array([1, 0], jnp.int32)})


def test_mpx_halves_the_growth_step_gradient():
    pytest.importorskip("mpx")  # mixed-precision-for-jax: not a test dependency
    facts = scaler_comparison.facts("mpx")
    assert facts["growth_grad_ratio"] == 0.5 and facts["max_scale"] == 65504.0
