"""Mesh configs: the recipe files, and the errors for meshes and batches that cannot work.

Nothing here compiles a step: ``build_experiment`` only resolves the mesh, the
model and the optimizer.
"""

from __future__ import annotations

import types

import jax
import pytest

from jamp import configs, experiment, parallel
from jamp.config import vit_config
from jamp.experiment import ConfigError, build_experiment
from jamp.parallel import pipeline

if len(jax.devices()) < 8:  # conftest forces 8 CPU devices
    pytest.skip("needs 8 devices", allow_module_level=True)


def _load(name: str, arg=None):
    return configs.get_config(name, arg)


@pytest.mark.parametrize("name, shape", [("vit_fp16_tp", (4, 2, 1)), ("vit_fp16_pp", (4, 1, 2)),
                                         ("vit_fp16_3d", (2, 2, 2)), ("vit_fp16", (8, 1, 1))])
def test_recipe_meshes_on_eight_devices(name, shape):
    config = _load(name)
    assert config.mode == "fp16"
    exp = build_experiment(config)
    assert tuple(exp.mesh.shape.values()) == shape
    assert tuple(exp.mesh.axis_names) == parallel.AXES


def test_recipes_take_model_and_dataset_arguments():
    config = _load("vit_fp16_3d", "b16,imagenet2012")
    assert (config.model, config.dataset, config.mesh.model, config.mesh.pipe) == \
        ("b", "imagenet2012", 2, 2)


def _config(mesh=None, **fields):
    config = vit_config("fp16")
    for key, value in fields.items():
        config[key] = value
    for key, value in (mesh or {}).items():
        config.mesh[key] = value
    return config


def _error(**fields) -> str:
    with pytest.raises(ConfigError) as info:
        build_experiment(_config(**fields))
    return str(info.value)


def test_mesh_that_does_not_divide_the_devices():
    message = _error(mesh=dict(data=-1, model=3))
    assert "multiple of 3" in message and "--config.mesh" in message
    assert "needs 16 devices" in _error(mesh=dict(data=4, model=2, pipe=2))


def test_pipeline_batch_must_split_into_data_times_microbatches():
    # 8 devices: data 4 x pipe 2; 4 microbatches per data shard -> multiples of 16.
    message = _error(batch_size=40, pipeline_microbatches=4, mesh=dict(pipe=2))
    assert "batch_size=40" in message
    assert "4 'data' shards x 4 pipeline microbatches = 16" in message
    assert "e.g. 32" in message and "--config.pipeline_microbatches" in message
    # Without a pipeline the microbatches do not matter.
    build_experiment(_config(batch_size=40, pipeline_microbatches=3, mesh=dict(data=4)))


def test_a_mesh_that_leaves_devices_idle_is_named_in_the_batch_error():
    message = _error(mesh=dict(data=3))  # 3 of the 8 devices; batch 64
    assert message.startswith("The mesh data=3 x model=1 x pipe=1 uses 3 of the 8 devices")
    assert "--config.mesh.data=-1" in message and "batch_size=64" in message
    build_experiment(_config(batch_size=63, mesh=dict(data=3)))  # fits: it trains
    message = _error(batch_size=60, mesh=dict(data=8))  # a full mesh: the batch is the issue
    assert message.startswith("--config.batch_size=60 is not divisible by the 8 devices")


def test_processes_must_split_the_data_axis(monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 4)
    message = _error(mesh=dict(data=2, model=2, pipe=2))
    assert "'data' axis (2) is not a multiple of the 4 processes" in message


def test_layers_heads_and_mlp_must_split():
    assert "num_layers=3 cannot be split into 2 pipeline stages" in _error(
        num_layers=3, mesh=dict(pipe=2))
    assert "num_heads=4 cannot be split over the 8 devices" in _error(mesh=dict(data=1,
                                                                             model=8))
    assert "scan_layers=True" in _error(scan_layers=False, mesh=dict(pipe=2))
    assert "pipeline_microbatches must be >= 1" in _error(pipeline_microbatches=0,
                                                          mesh=dict(pipe=2))


@pytest.mark.parametrize("parsed", [False, True])
def test_worker_processes_need_parsed_absl_flags(monkeypatch, parsed):
    # grain's workers read absl flags: unparsed (a Python program without absl.app), the
    # config is refused up front instead of failing in a worker.
    flag_values = types.SimpleNamespace(is_parsed=lambda: parsed)
    monkeypatch.setattr(experiment, "flags", types.SimpleNamespace(FLAGS=flag_values))
    if parsed:
        build_experiment(_config(worker_count=2))
    else:
        assert "worker_count=2" in _error(worker_count=2)


def test_bubble_fraction():
    assert pipeline.bubble_fraction(stages=1, microbatches=4) == 0.0
    assert pipeline.bubble_fraction(stages=2, microbatches=4) == pytest.approx(0.2)
    assert pipeline.bubble_fraction(stages=4, microbatches=4) == pytest.approx(3 / 7)


def test_rules_for_manual_axes():
    rules = parallel.data_parallel.manual_rules(parallel.LOGICAL_AXIS_RULES, {"data", "pipe"})
    assert dict(rules)["batch"] is None and dict(rules)["layers"] is None
    assert dict(rules)["heads"] == "model"
