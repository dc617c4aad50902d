"""The migration examples of docs/guides/migrate.md run and show what the guide says.

- Flax ``TrainState`` + ``DynamicScale`` -> jamp: the same losses step for step
  (both skip the overflowing first step and land on the same scale), and jamp's
  skip leaves Adam's count where it was.
- Equinox -> jamp.autocast: trains in fp16 next to the float32 loop, and a NaN
  batch is skipped exactly.
"""

import importlib.util
import math
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_flax_dynamic_scale_migration_matches_step_for_step():
    out = _load("migrate_flax_dynamic_scale").main(steps=5)
    before, after = out["losses"]["before"], out["losses"]["after"]
    assert math.isnan(before[0]) and math.isnan(after[0])  # the inf batch
    assert before[1:] == after[1:]
    assert out["before_scale"] == out["after_scale"] == 2.0**15
    assert out["after_skipped"] == 1 and out["adam_count"] == 4


def test_equinox_migration_trains_in_fp16_and_skips_nan():
    pytest.importorskip("equinox")
    out = _load("migrate_equinox").main(steps=5)
    before, after = out["losses"]["before"], out["losses"]["after"]
    assert math.isnan(after[1])
    assert out["skipped"] == 2  # 2**16 overflows float16 once, then the NaN batch
    assert out["scale"] == 2.0**14
    assert abs(after[-1] - before[2]) < 2e-2  # two skipped steps behind float32
    assert after[-1] < after[0]
