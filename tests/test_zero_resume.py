"""Checkpoints restore across ZeRO stages and meshes (issue 24): through ``train_and_evaluate``.

A ZeRO-3 run on ``data=8`` (its parameters, optimizer state and master copy split over
'data') is stopped at step ``N`` as a preemption stops it (checkpoint at the step,
:class:`jamp.preemption.Preempted`); copies of its workdir are resumed with another
stage and mesh and run to step ``M``. Each resumed run must

- start from the saved state, bit for bit (every leaf: parameters, AdamW's moments, the
  master copy, the loss scale, the fp8 delayed-scaling state), placed in the *new*
  stage's shardings (``jamp.experiment.state_shardings``: the optimizer state split over
  'data' from stage 1, the parameters only at stage 3);
- log the metrics of an uninterrupted stage-0 run on ``data=8``: the loss within rtol
  1e-5 (another mesh sums in another order), the loss scale and skipped steps exactly.

The tiny ViT (2 blocks, width 16) keeps each run to a few seconds on 8 fake CPU devices.
"""

from __future__ import annotations

import shutil
import signal

import jax
import numpy as np
import pytest

from jamp import experiment, master, preemption, train
from jamp.config import vit_config
from jamp.metrics import read_metrics

if len(jax.devices()) < 8:  # conftest forces 8 CPU devices
    pytest.skip("needs 8 devices", allow_module_level=True)

N, M = 3, 6
"""The stage-3 run stops (checkpoints) at step N; every run ends at step M."""


def _config(mode, stage, data=8, model=1):
    config = vit_config(mode)
    config.num_layers, config.hidden_size, config.num_heads, config.mlp_dim = 2, 16, 2, 32
    config.batch_size, config.max_steps, config.warmup_steps = 16, M, 0
    config.learning_rate, config.log_every_steps, config.checkpoint_every_steps = 1e-2, 1, 100
    config.progress, config.plot = False, False
    config.zero_stage, config.mesh.data, config.mesh.model = stage, data, model
    if mode == "fp16_naive":  # no overflow-skipped first step; the scale doubles every 2
        config.loss_scale.init_scale, config.loss_scale.growth_interval = 2.0**8, 2
    return config


class _StopAtN(preemption.StopOnSignal):
    """A SIGTERM that arrives during step N: the loop checkpoints N and raises Preempted."""

    def should_stop(self) -> bool:
        self.calls = getattr(self, "calls", 0) + 1  # once per step
        if self.calls == N:
            self.signum = signal.SIGTERM
        return self.signum is not None


def _run(config, workdir, monkeypatch, stop_at_n=False):
    """Runs ``config`` in ``workdir``; returns the state it started from and what it saved
    at a stop: ``{"start", "restored", "shardings", "saved", "summary"}``."""
    seen = {}
    real_start, real_stop = train._start, train._stop

    def start(exp, workdir):  # under the mesh, outside the logical axis rules
        run, state = real_start(exp, workdir)
        seen.update(start=run.start, restored=jax.device_get(state),
                    state_shardings=jax.tree_util.tree_map(lambda a: a.sharding, state),
                    shardings=experiment.state_shardings(exp, run.rng)[1])
        return run, state

    def stop(run, done, state):
        seen["saved"] = jax.device_get(state)
        seen["saved_shardings"] = jax.tree_util.tree_map(lambda a: a.sharding, state)
        return real_stop(run, done, state)

    with monkeypatch.context() as m:
        m.setattr(train, "_start", start)
        m.setattr(train, "_stop", stop)
        if stop_at_n:
            m.setattr(train, "StopOnSignal", _StopAtN)
            with pytest.raises(preemption.Preempted) as stopped:
                train.train_and_evaluate(config, str(workdir))
            assert stopped.value.step == N
        else:
            seen["summary"] = train.train_and_evaluate(config, str(workdir))
    return seen


def _trajectory(workdir):
    return {r["step"]: (r["train/loss"], r["train/loss_scale"], r["train/steps_skipped"])
            for r in read_metrics(workdir) if "train/loss" in r}


def _split(tree) -> list[bool]:
    """Per array leaf (a tree of shardings): is it split over 'data'?"""
    def over_data(s):
        return any(e == "data" or (isinstance(e, tuple) and "data" in e) for e in s.spec)
    return [over_data(s) for s in jax.tree_util.tree_leaves(tree)]


def _leaves(tree):
    return [np.asarray(x, np.float32) if x.dtype.kind == "V" or "float8" in str(x.dtype)
            else np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def _check_restored(resumed, saved, mode, stage):
    """Bit-identical values, in the resumed stage's shardings."""
    assert resumed["start"] == N
    got, want = _leaves(resumed["restored"]), _leaves(saved["saved"])
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    placed, expected = resumed["state_shardings"], resumed["shardings"]
    for a, b, x in zip(jax.tree_util.tree_leaves(placed), jax.tree_util.tree_leaves(expected),
                       jax.tree_util.tree_leaves(resumed["restored"]), strict=True):
        assert a.is_equivalent_to(b, x.ndim), (a, b)
    params, opt_state = placed.params, placed.opt_state
    assert any(_split(params)) == (stage == 3), (stage, params)
    assert any(_split(opt_state)) == (stage >= 1), (stage, opt_state)
    if mode == "fp16_naive":  # the master copy: split with the rest from stage 1
        assert any(_split(master.master_params(opt_state))) == (stage >= 1)


def _check_trajectory(resumed_dir, reference_dir):
    got, want = _trajectory(resumed_dir), _trajectory(reference_dir)
    assert sorted(got) == sorted(want) == list(range(1, M + 1))
    for step in range(1, M + 1):
        np.testing.assert_allclose(got[step][0], want[step][0], rtol=1e-5, err_msg=str(step))
        assert got[step][1:] == want[step][1:], (step, got[step], want[step])


def _stage3_stopped_at_n(mode, tmp_path, monkeypatch):
    stopped = _run(_config(mode, 3), tmp_path / "stage3", monkeypatch, stop_at_n=True)
    # The stage-3 state as it was saved: parameters and optimizer state split over 'data'.
    assert any(_split(stopped["saved_shardings"].params))
    assert any(_split(stopped["saved_shardings"].opt_state))
    return stopped


def _resume(mode, stage, mesh, tmp_path, monkeypatch, name):
    workdir = tmp_path / name
    shutil.copytree(tmp_path / "stage3", workdir)
    resumed = _run(_config(mode, stage, *mesh), workdir, monkeypatch)
    assert resumed["summary"]["start_step"] == N and resumed["summary"]["steps"] == M
    assert resumed["summary"]["zero_stage"] == stage
    return workdir, resumed


def test_fp32_stage3_resumes_as_stage0_and_as_stage2_on_another_mesh(tmp_path, monkeypatch):
    reference = _run(_config("fp32", 0), tmp_path / "reference", monkeypatch)
    memory = reference["summary"]["memory"]
    whole = memory["per_device"]  # stage 0 on data=8: every device holds everything
    assert (whole["params"], whole["grads"], whole["opt_state"]) == (
        memory["params_bytes"], memory["grads_bytes"], memory["opt_state_bytes"])
    stopped = _stage3_stopped_at_n("fp32", tmp_path, monkeypatch)
    for stage, mesh in ((0, (8, 1)), (2, (4, 2))):
        workdir, resumed = _resume("fp32", stage, mesh, tmp_path, monkeypatch, f"stage{stage}")
        _check_restored(resumed, stopped, "fp32", stage)
        _check_trajectory(workdir, tmp_path / "reference")
    # The summary's per-device bytes (stage 2 on data=4 x model=2): the gradients and AdamW's
    # two moments split over 'data' too, the parameters over 'model' only.
    per_device = resumed["summary"]["memory"]["per_device"]
    assert per_device["params"] < whole["params"]  # 'model' splits the kernels
    assert per_device["grads"] < per_device["params"] / 2, per_device
    assert per_device["opt_state"] < per_device["params"], per_device


def test_fp16_naive_master_copy_and_loss_scale_restore_into_stage1(tmp_path, monkeypatch):
    _run(_config("fp16_naive", 0), tmp_path / "reference", monkeypatch)
    stopped = _stage3_stopped_at_n("fp16_naive", tmp_path, monkeypatch)
    assert any(_split(master.master_params(stopped["saved_shardings"].opt_state)))
    # data=8 again: float16 matmuls split over 'model' would round differently.
    workdir, resumed = _resume("fp16_naive", 1, (8, 1), tmp_path, monkeypatch, "stage1")
    _check_restored(resumed, stopped, "fp16_naive", 1)
    _check_trajectory(workdir, tmp_path / "reference")
    per_device = resumed["summary"]["memory"]["per_device"]  # stage 1: the master copy split
    assert 0 < per_device["master"] < resumed["summary"]["memory"]["params_bytes"], per_device
    assert per_device["params"] == per_device["grads"] == resumed["summary"]["memory"][
        "params_bytes"], per_device
    scales = {scale for _, scale, _ in _trajectory(workdir).values()}
    assert len(scales) > 2, scales  # the scale grew before and after N: a reset one would show


def test_fp8_delayed_scaling_state_restores_from_stage3_into_stage0(tmp_path, monkeypatch):
    stopped = _stage3_stopped_at_n("fp8", tmp_path, monkeypatch)
    assert stopped["saved"].extra_state(), "no fp8 state in the train state"
    workdir, resumed = _resume("fp8", 0, (8, 1), tmp_path, monkeypatch, "stage0")
    _check_restored(resumed, stopped, "fp8", 0)
    trajectory = _trajectory(workdir)
    assert sorted(trajectory) == list(range(1, M + 1))
    assert all(np.isfinite(loss) for loss, _, _ in trajectory.values())
    assert np.isfinite(resumed["summary"]["test_loss"])
