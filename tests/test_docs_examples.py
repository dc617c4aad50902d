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


def test_zero_own_loop_splits_state_per_stage_and_trains_the_same():
    import jax
    from jax.sharding import PartitionSpec as P

    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    example = _load("zero_own_loop")
    runs = {stage: example.main(steps=4, stage=stage) for stage in (0, 1, 2, 3)}
    split, whole = P(None, "data"), P()
    assert [runs[s]["master_or_mu_spec"] for s in range(4)] == [whole, split, split, split]
    assert [runs[s]["param_spec"] for s in range(4)] == [whole, whole, whole, split]
    for stage in (1, 2, 3):  # the NaN batch skipped on every stage; the same losses
        assert runs[stage]["skipped"] == runs[0]["skipped"] == [0, 1, 1, 1]
        assert runs[stage]["losses"][2:] == pytest.approx(runs[0]["losses"][2:], rel=1e-6)
        assert runs[stage]["loss_scale"] == runs[0]["loss_scale"]


def test_the_readme_ten_lines_run_and_print_what_they_say(capsys):
    import pathlib
    import re

    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    section = readme[readme.index("## Ten lines"):readme.index("## Where to read on")]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})
    printed = capsys.readouterr().out.split("\n")[:2]
    promised = [line.split(":")[0].lstrip("# ") for line in code.splitlines()
                if line.startswith("# True") or line.startswith("# False")]
    assert printed == promised == ["True 65536.0 1", "False 32768.0 1"]


def test_the_zero_guide_code_runs():
    import pathlib
    import re

    import jax

    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    guide = (pathlib.Path(__file__).parents[1] / "docs/guides/zero.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", guide, re.S)
    assert blocks
    for code in blocks:
        scope: dict = {}
        exec(compile(code, "docs/guides/zero.md", "exec"), scope)
    kernel = scope["state"].params["layers_0"]["kernel"]
    assert "data" in str(kernel.sharding.spec) and not bool(scope["metrics"]["skipped"])
