"""The config's fields (each declared once: default, help, limits) and the one validation pass.

Nothing here compiles: ``build_experiment`` only resolves the mesh, the model and the
optimizer.
"""

from __future__ import annotations

import warnings

import pytest
from ml_collections import ConfigDict

from jamp import config as config_lib
from jamp import parallel
from jamp.config import FIELD_HELP, FIELDS, vit_config
from jamp.experiment import (
    ConfigError,
    ConfigWarning,
    UnsafeModeWarning,
    build_experiment,
    check_values,
    validate_config,
)


def _flat(config: ConfigDict, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in config.items():
        if isinstance(value, ConfigDict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@pytest.mark.parametrize("arg", [None, "s16,cifar10", "b16,imagenet2012"])
def test_every_field_of_every_recipe_is_declared_in_the_table(arg):
    assert sorted(_flat(vit_config("fp16", arg))) == sorted(FIELDS)
    assert {key: field.help for key, field in FIELDS.items()} == FIELD_HELP


def test_defaults_help_and_limits_come_from_the_table(monkeypatch):
    warmup = FIELDS["warmup_steps"]
    monkeypatch.setitem(FIELDS, "warmup_steps", warmup._replace(
        default=7, limits=config_lib.Limit(lambda v: v >= 8, ">= 8 (test)", "8")))
    config = vit_config("fp16")
    assert config.warmup_steps == 7
    with pytest.raises(ConfigError, match=r"warmup_steps must be >= 8 \(test\), e.g. "
                                          r"--config.warmup_steps=8 \(linear warm-up"):
        check_values(config)


def test_every_limited_field_is_range_checked_with_its_requirement():
    limited = {key: field for key, field in FIELDS.items() if field.limits}
    assert len(limited) == 27  # grad_accum_steps and tensor_stats_every included
    for key, field in limited.items():
        config = vit_config("fp16")
        assert not field.limits.test(-1), key  # every limit refuses -1
        config[key] = -1
        with pytest.raises(ConfigError, match="out of range") as e:
            check_values(config)
        assert f"--config.{key}=" in str(e.value) and field.limits.requirement in str(e.value)
        if isinstance(field.default, type):  # a placeholder may stay None
            config[key] = None
            check_values(config)


def test_one_validation_pass_checks_the_workdir_before_anything_is_built(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for workdir, needle in ((a_file, "it is a file"), (a_file / "run", "is a file")):
        with pytest.raises(ConfigError, match=needle):
            build_experiment(vit_config("fp16"), str(workdir))
    config = vit_config("fp16")
    config.batch_size = 0  # the fields are checked first, the workdir after
    with pytest.raises(ConfigError, match="batch_size=0 is out of range"):
        build_experiment(config, str(a_file))
    assert build_experiment(vit_config("fp16"), str(tmp_path / "new" / "run")).total_steps
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # nothing written


def test_one_validation_pass_checks_what_the_run_writes_in_the_workdir(tmp_path):
    """An entry of the run's (checkpoints/, summary.json, ...) of the wrong kind is refused
    before anything is built, naming its path: orbax would otherwise stall on it."""
    (tmp_path / "checkpoints").write_text("")
    with pytest.raises(ConfigError, match=f"{tmp_path / 'checkpoints'} is not a directory"):
        build_experiment(vit_config("fp16"), str(tmp_path))
    (tmp_path / "checkpoints").unlink()
    (tmp_path / "summary.json").mkdir()
    with pytest.raises(ConfigError, match=f"{tmp_path / 'summary.json'} is a directory"):
        build_experiment(vit_config("fp16"), str(tmp_path))


def _warnings(config, mesh) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        validate_config(config, parallel.make_mesh(mesh), None)
    return [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]


def test_a_zero_stage_over_one_data_device_warns_with_the_fix():
    """ZeRO over a 'data' axis of 1 splits nothing (e.g. one GPU, or one CPU device):
    one line that names the fix, the same message as jamp.boost's."""
    config = vit_config("fp16")
    config.zero_stage = 2
    unsplit = [m for m in _warnings(config, {"data": 1, "model": 2, "pipe": 4})
               if m.startswith("zero_stage=2")]
    assert unsplit == [parallel.zero_splits_nothing(2, parallel.make_mesh({"data": 1}),
                                                    "--config.mesh.data=-1 takes every device")]
    assert "'data' axis has 1 device splits nothing" in unsplit[0]
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=8" in unsplit[0]
    assert "\n" not in unsplit[0]
    assert _warnings(config, {"data": -1}) == []  # 8 'data' devices: it splits
    config.zero_stage = 0
    assert _warnings(config, {"data": 1, "model": 2, "pipe": 4}) == []


def test_a_mesh_that_leaves_devices_idle_warns_with_the_fix():
    config = vit_config("fp16")
    config.batch_size = 63
    assert _warnings(config, {"data": 3}) == [
        "The mesh data=3 x model=1 x pipe=1 uses 3 of the 8 devices, leaving 5 idle: use all "
        "8 with --config.mesh.data=-1 (data=8)."]
    config.batch_size = 64
    assert "use all 8 with --config.mesh.data=-1 (data=4)" in _warnings(
        config, {"data": 1, "model": 2})[0]
    assert _warnings(config, {"data": -1, "model": 2}) == []


def test_a_run_shorter_than_its_warmup_warns_with_both_numbers():
    config = vit_config("fp16")  # digits: 22 steps per epoch, warmup_steps=50
    config.num_epochs = 1
    with pytest.warns(ConfigWarning) as caught:
        exp = build_experiment(config)
    assert exp.total_steps == 22
    assert [str(w.message).split(":")[0] for w in caught] == [
        "The run has 22 steps, fewer than --config.warmup_steps=50"]
    assert "Lower --config.warmup_steps (e.g. 2)" in str(caught[0].message)
    config.warmup_steps = 22
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        build_experiment(config)


def test_one_validation_pass_warns_for_float16_params_without_master_weights():
    for mode in ("fp16_pure", "O3"):
        with pytest.warns(UnsafeModeWarning, match="without fp32 master weights"):
            build_experiment(vit_config(mode))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsafeModeWarning)
        for mode in ("fp16", "bf16", "bf16_pure"):
            build_experiment(vit_config(mode))


@pytest.mark.parametrize("stage", [4, 5])
def test_a_zero_stage_that_does_not_exist_is_refused_with_the_choices(stage):
    config = vit_config("fp16")
    config.zero_stage = stage
    with pytest.raises(ConfigError, match=rf"--config.zero_stage={stage} is out of range: "
                                          r"zero_stage must be 0, 1, 2 or 3, e.g."):
        build_experiment(config)
    for valid in (0, 1, 2, 3):
        config.zero_stage = valid
        check_values(config)
