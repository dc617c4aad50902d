"""``benchmarks/scaler_comparison.py``: its quick mode runs, and its scenarios tell the truth.

The scenario facts are what the README's comparison table claims: jamp's skip is
bit-exact for inf, -inf and NaN gradients (Adam's count included), the gradient
on a growth step is the true one, and the scale lives in the optimizer state.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import common, scaler_comparison

REPO = Path(__file__).resolve().parents[1]


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


def test_vit_one_step(tmp_path):
    result = scaler_comparison.main(["--model", "vit", "--quick", "--libs", "jamp",
                                     "--out-dir", str(tmp_path)])
    jamp_row, f16_row = result["rows"]["jamp"], result["rows"]["f16"]
    assert jamp_row["steps_skipped"] == {"2": 0} and jamp_row["ms"]["2"] / f16_row["ms"]["2"] > 0
    assert (tmp_path / f"scaler_comparison_vit-cpu-{common.today()}.md").exists()


def test_mlp_quick_as_a_module(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.scaler_comparison", "--quick", "--libs", "jamp",
         "--out-dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ratio b8" in proc.stdout
    out = tmp_path / f"scaler_comparison-cpu-{common.today()}.md"
    text = out.read_text()
    assert "python -m benchmarks.scaler_comparison --quick" in text
    assert "\n| jamp.DynamicLossScale | " in text
    assert json.loads(out.with_suffix(".json").read_text())["rows"]["jamp"]["steps_skipped"] == {
        "8": 0}
