"""The trainer end to end: CLI, errors, checkpoints, SIGKILL resume, divergence guard.

Runs on a tiny ViT (1 block, width 16) for a few dozen steps on the embedded digits,
data-parallel over the session's 8 fake CPU devices.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from jamp.config import vit_config
from jamp.metrics import read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--config.num_layers=1", "--config.hidden_size=16", "--config.num_heads=2",
        "--config.mlp_dim=32", "--config.batch_size=64", "--config.progress=False",
        "--config.plot=False", "--config.log_every_steps=5"]


def _cli(*args: str, workdir, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jamp.train", *args, f"--workdir={workdir}"],
        cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _json(path):
    with open(path) as f:
        return json.load(f)


def _tiny_config(mode="fp16", **fields):
    config = vit_config(mode)
    config.num_layers, config.hidden_size, config.num_heads, config.mlp_dim = 1, 16, 2, 32
    config.batch_size, config.progress, config.plot, config.log_every_steps = 64, False, True, 5
    for key, value in fields.items():
        config[key] = value
    return config


COMPILE_S = 4.0  # a first step this slow must not count in the ETA


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 12-step run through the Python API (checkpoints at 10 and 12), its first step
    slowed by COMPILE_S as a long compilation would; the bar's elapsed time at the first
    log (step 5) is recorded."""
    from jamp import train

    workdir = tmp_path_factory.mktemp("finished")
    config = _tiny_config(max_steps=12, checkpoint_every_steps=10, progress=True)
    real_jit, real_log, seen = train.jit_train_step, train._log, {}

    def slow_first_step(*args):
        step = real_jit(*args)
        calls = []

        def run(*a):
            if not calls:
                time.sleep(COMPILE_S)
            calls.append(1)
            return step(*a)
        return run

    def log(run, *args):
        seen.setdefault("elapsed", run.progress.format_dict["elapsed"])
        seen.setdefault("progress", str(run.progress))
        return real_log(run, *args)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(train, "jit_train_step", slow_first_step)
        m.setattr(train, "_log", log)
        summary = train.train_and_evaluate(config, str(workdir))
    return workdir, config, summary, seen["elapsed"], seen["progress"]


def _copy(run, tmp_path):
    import shutil

    shutil.copytree(run[0], tmp_path / "run")
    return tmp_path / "run"


def _events(workdir):
    return sorted(os.listdir(workdir / "tensorboard"))


def _rows(workdir):
    """(step, kind) of every metrics row: kind 'train' or 'eval'."""
    return [(r["step"], "train" if "train/loss" in r else "eval") for r in read_metrics(workdir)]


def test_python_api_short_run_writes_metrics_checkpoint_summary_and_plot(finished_run):
    from PIL import Image

    tmp_path, config, summary, elapsed, progress = finished_run
    assert summary["steps"] == 12 and summary["devices"] == 8
    # The backend and the devices: in summary.json and on the progress line.
    saved = _json(tmp_path / "summary.json")
    assert {k: saved[k] for k in ("backend", "device_kind", "device_count")} == {
        "backend": "cpu", "device_kind": "cpu", "device_count": 8}
    assert progress.startswith("cpu x8: "), progress
    assert summary["outcome"] == "completed" and summary["seed"] == 0
    assert summary["commit"] is None or len(summary["commit"]) >= 40  # to reproduce the run
    assert summary["mode"] == "fp16" and summary["final_loss_scale"] > 0
    assert summary["framework"] == "linen" and summary["loss_scale_kind"] == "dynamic"
    assert 0.0 <= summary["test_accuracy"] <= 1.0
    assert summary["memory"]["residual_bytes"] > 0
    assert summary["memory"]["activation_bytes"] > 0
    records = read_metrics(tmp_path)
    train = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train] == [5, 10, 12]
    assert all(np.isfinite(r["train/loss"]) for r in train)
    # grad_norm always; num_zeros_in_grad only with log_num_zeros_in_grad=True (it is False
    # here; tests/test_grad_stats.py runs it on).
    assert all(r["train/grad_norm"] > 0 and "train/num_zeros_in_grad" not in r for r in train)
    assert any("eval/accuracy" in r for r in records)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["10", "12"]
    assert len(_events(tmp_path)) == 1
    assert _json(tmp_path / "summary.json")["steps"] == 12
    assert _json(tmp_path / "config.json") == config.to_dict()
    # The train loss includes label smoothing: the summary and the plot say so.
    assert summary["label_smoothing"] == 0.1 and abs(summary["train_loss_floor"] - 0.5) < 1e-3
    assert (tmp_path / "training.png").stat().st_size > 10_000
    note = Image.open(tmp_path / "training.png").text["Description"]
    assert "label smoothing 0.1" in note and "floor 0.50" in note
    # The progress bar's clock starts after the first (compiling) step.
    assert elapsed < COMPILE_S, elapsed


def test_rerun_of_a_finished_run_changes_nothing_and_exits_0(finished_run, tmp_path, capsys):
    from jamp import cli

    workdir = _copy(finished_run, tmp_path)
    before = {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()}
    with pytest.raises(SystemExit) as exit_:
        cli.main(["jamp.train", "--config=configs/vit_fp16.py", *TINY, "--config.max_steps=12",
                  "--config.checkpoint_every_steps=10", f"--workdir={workdir}"])
    out = capsys.readouterr().out
    assert exit_.value.code in (0, None)
    assert f"The run in {workdir} already finished at step 12" in out
    after = {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()}
    assert after == before  # summary (images_per_sec kept), metrics, events, checkpoints


def test_resume_logs_each_step_once_into_one_event_file(finished_run, tmp_path):
    from jamp.train import train_and_evaluate

    workdir = _copy(finished_run, tmp_path)
    # A run killed after logging step 12 but before its checkpoint was written.
    import shutil

    shutil.rmtree(workdir / "checkpoints" / "12")
    assert _rows(workdir).count((12, "train")) == 1
    summary = train_and_evaluate(finished_run[1], str(workdir))
    assert summary["start_step"] == 10 and summary["steps"] == 12
    rows = _rows(workdir)
    assert len(rows) == len(set(rows)), rows
    assert (12, "train") in rows and (12, "eval") in rows
    assert len(_events(workdir)) == 1


def test_restore_after_a_model_change_says_use_the_old_settings(finished_run, tmp_path):
    from jamp.checkpoint import CheckpointError
    from jamp.train import train_and_evaluate

    workdir = _copy(finished_run, tmp_path)
    for field, value, needle in (("hidden_size", 32, "hidden_size: checkpoint has 16"),
                                 ("scan_layers", False, "different model or optimizer")):
        config = _tiny_config(max_steps=20, checkpoint_every_steps=10, **{field: value})
        with pytest.raises(CheckpointError) as error:
            train_and_evaluate(config, str(workdir))
        message = str(error.value)
        assert needle in message and "--workdir" in message, message
        assert str(workdir / "config.json") in message, message
        assert "Delete" not in message  # the previous checkpoint has the same shapes


def test_a_refused_resume_leaves_config_json_with_the_settings_the_run_started_with(
        finished_run, tmp_path):
    """The refusal points at config.json for the old settings: it must still hold them, not
    the refused ones (a metadata refusal, and one of the restore's shape check)."""
    from jamp.checkpoint import CheckpointError
    from jamp.train import train_and_evaluate

    workdir = _copy(finished_run, tmp_path)
    before = (workdir / "config.json").read_bytes()
    assert _json(workdir / "config.json")["hidden_size"] == 16
    for field, value in (("hidden_size", 32), ("scan_layers", False)):
        config = _tiny_config(max_steps=20, checkpoint_every_steps=10, **{field: value})
        with pytest.raises(CheckpointError, match="config.json"):
            train_and_evaluate(config, str(workdir))
        assert (workdir / "config.json").read_bytes() == before, field


def test_resume_restores_the_step_and_the_data_position(finished_run, tmp_path):
    """The restored iterator gives the batch after the checkpoint's (the 11th from step 10),
    not the first again: a resumed run sees the data an uninterrupted one sees."""
    import jax

    from jamp import data, experiment, train

    workdir = _copy(finished_run, tmp_path)
    import shutil

    shutil.rmtree(workdir / "checkpoints" / "12")  # resume from step 10 of 12
    exp = experiment.build_experiment(_tiny_config(max_steps=12, checkpoint_every_steps=10),
                                      str(workdir))
    with jax.set_mesh(exp.mesh):
        run, state = train._start(exp, str(workdir))
    try:
        assert run.start == 10 and int(state.step) == 10
        resumed = next(run.iterator)
    finally:
        run.close()
    c = exp.config
    fresh = iter(data.train_loader(exp.info, data_dir=c.data_dir, image_size=c.image_size,
                                   global_batch_size=c.batch_size, seed=c.seed,
                                   augment=c.augment))
    batches = [next(fresh) for _ in range(11)]
    np.testing.assert_array_equal(resumed["label"], batches[10]["label"])
    np.testing.assert_array_equal(resumed["image"], batches[10]["image"])
    assert not np.array_equal(resumed["image"], batches[0]["image"])


def test_the_stop_checkpoint_is_saved_at_the_step_the_loop_stopped_at(monkeypatch):
    """A signal during the third step after resuming at 7: the loop logs and saves step 10
    with the state after step 10 (here a counter of steps), and raises Preempted(10)."""
    import types

    import jax

    from jamp import train
    from jamp.preemption import Preempted

    class Stop:  # says stop once the third step has run
        signum, calls = signal.SIGTERM, 0

        def should_stop(self):
            self.calls += 1
            return self.calls >= 3

    class Checkpoints:
        directory = "checkpoints"

        def __init__(self):
            self.saved = {}

        def latest_step(self):
            return max(self.saved, default=None)

        def save(self, step, state, iterator, meta, force=False):
            self.saved[step] = state

        def wait(self):
            pass

    class Recorder:  # the metrics writer and the progress bar
        def __init__(self):
            self.steps = []

        def write(self, step, record):
            self.steps.append(step)

        def __getattr__(self, name):
            return lambda *args, **kwargs: None

    metrics = {"loss": 1.0, "accuracy": 0.5, "loss_scale": 1.0, "steps_skipped": 0,
               "grad_norm": 1.0, "diverged": False}
    config = types.SimpleNamespace(batch_size=1, log_every_steps=100, eval_every_epochs=1,
                                   checkpoint_every_steps=100)
    exp = types.SimpleNamespace(config=config, total_steps=50, steps_per_epoch=100, meta={},
                                precision=types.SimpleNamespace(
                                    loss_scale=types.SimpleNamespace(kind="dynamic")))
    monkeypatch.setattr(train, "_global_batch", lambda exp, batch: batch)
    run = train._Run(exp=exp, train_step=lambda state, batch, rng: (state + 1, dict(metrics)),
                     eval_step=None, iterator=iter(range(100)), ckpt=Checkpoints(),
                     writer=Recorder(), progress=Recorder(), rng=jax.random.key(0),
                     workdir="run", stop=Stop(), start=7)
    with pytest.raises(Preempted) as stopped:
        train._loop(run, 7)  # the state after step 7 is 7
    assert stopped.value.step == 10 and run.ckpt.saved == {10: 10}
    assert run.writer.steps == [10]  # the steps since the last log, logged at 10


def test_damaged_checkpoint_points_to_the_previous_one_without_internals(finished_run,
                                                                        tmp_path):
    from jamp.checkpoint import CheckpointError
    from jamp.train import train_and_evaluate

    workdir = _copy(finished_run, tmp_path)
    step_dir = workdir / "checkpoints" / "12"
    for root, _, files in os.walk(step_dir / "state"):
        for name in files:
            if name != "_METADATA":  # the arrays' data, not the tree
                with open(os.path.join(root, name), "wb") as f:
                    f.write(b"garbage")
    with pytest.raises(CheckpointError) as error:
        train_and_evaluate(_tiny_config(max_steps=20, checkpoint_every_steps=10), str(workdir))
    message = str(error.value)
    assert f"Delete {step_dir} and rerun to resume from the previous checkpoint (step 10)" in (
        message), message
    for debris in ("tensorstore", "pybind", "INVALID_ARGUMENT", "Error", "source locations"):
        assert debris.lower() not in message.lower(), message


def test_sigkill_mid_run_resumes_with_same_scale_step_and_data(tmp_path):
    args = ["--config=configs/vit_fp16.py", *TINY, "--config.max_steps=30",
            "--config.checkpoint_every_steps=5", "--config.loss_scale.growth_interval=4"]
    reference = _cli(*args, workdir=tmp_path / "reference")
    assert reference.returncode == 0, reference.stderr[-3000:]

    workdir = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "jamp.train", *args,
                             f"--workdir={workdir}"], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 180
    while not (workdir / "checkpoints" / "15").exists():
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = max(int(d) for d in os.listdir(workdir / "checkpoints") if d.isdigit())
    assert 15 <= killed_at < 30, killed_at

    resumed = _cli(*args, workdir=workdir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Resumed from step {killed_at}" in resumed.stdout + resumed.stderr

    def trajectory(path):
        rows = read_metrics(path)
        return {r["step"]: (r["train/loss"], r["train/loss_scale"], r["train/steps_skipped"])
                for r in rows if "train/loss" in r and r["step"] > killed_at}

    # Same data position, step and loss scale: the continued trajectory is the reference's.
    assert trajectory(workdir) == trajectory(tmp_path / "reference")
    ref = _json(tmp_path / "reference" / "summary.json")
    got = _json(workdir / "summary.json")
    assert got["start_step"] == killed_at
    rows = _rows(workdir)  # whatever the killed run logged past its checkpoint: once
    assert len(rows) == len(set(rows)) and rows == _rows(tmp_path / "reference"), rows
    assert len(_events(workdir)) == 1
    for key in ("test_loss", "test_accuracy", "final_loss_scale", "steps_skipped"):
        assert got[key] == ref[key], key


def _strict_json(text):
    def refuse(token):
        raise ValueError(f"bare {token}: not JSON")

    return json.loads(text, parse_constant=refuse)


def test_divergence_guard_stops_and_leaves_summary_plot_and_json(tmp_path, monkeypatch, capfd,
                                                                 caplog):
    from jamp import data, train
    from jamp.loss_scale import LossScaleDivergedError

    real_loader = data.train_loader

    def nan_loader(*args, **kwargs):
        for batch in real_loader(*args, **kwargs):
            yield {**batch, "image": np.full_like(batch["image"], np.nan)}

    monkeypatch.setattr(train.data, "train_loader", lambda *a, **k: _Iterable(nan_loader, a, k))
    config = _tiny_config(max_steps=40)
    config.loss_scale.init_scale = 4.0
    config.loss_scale.divergence_steps = 5
    with pytest.raises(LossScaleDivergedError, match="overflowed for 5 steps in a row") as e:
        train.train_and_evaluate(config, tmp_path)
    rows = [_strict_json(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["train/steps_skipped"] == rows[-1]["step"]  # every step was skipped
    assert rows[-1]["step"] < 40 and rows[-1]["train/loss"] == "NaN"
    summary = _strict_json((tmp_path / "summary.json").read_text())
    assert summary["outcome"] == "diverged" and summary["steps"] == rows[-1]["step"]
    history = summary["loss_scale_history"]
    assert [s for s, _ in history] == [r["step"] for r in rows]
    assert history[0][1] < 4.0 and history[-1][1] == summary["final_loss_scale"]
    assert (tmp_path / "training.png").stat().st_size > 10_000
    # No checkpoint was due yet (every 200 steps): the message names none.
    assert summary["checkpoint_step"] is None and not os.listdir(tmp_path / "checkpoints")
    assert "No checkpoint was written" in str(e.value) and "last good" not in str(e.value)
    assert "NaN or Inf" not in caplog.text + "".join(capfd.readouterr())
    # Every skipped step says why: NaN images make every gradient NaN; the first leaf is named.
    reasons = [r for row in rows for r in row.get("train/skip_reasons", [])]
    assert len(reasons) == rows[-1]["step"]
    assert reasons[0].startswith("step 1 skipped: NaN in the gradient of "), reasons[0]
    assert summary["skip_reasons"][0] == reasons[0]


def test_nan_loss_without_a_loss_scale_stops_before_saving_a_poisoned_checkpoint(
        tmp_path, monkeypatch):
    """bf16 applies every update: a NaN batch at step 8 makes the parameters NaN. The run
    stops at step 8 (a checkpoint step) without saving it, naming step 4's checkpoint."""
    import jax.numpy as jnp

    from jamp import train
    from jamp.loss_scale import LossScaleDivergedError

    real_jit = train.jit_train_step

    def poisoned(*args):
        step, calls = real_jit(*args), []

        def run(state, batch, rng):
            calls.append(1)
            if len(calls) == 8:
                batch = {**batch, "image": jnp.full_like(batch["image"], jnp.nan)}
            return step(state, batch, rng)
        return run

    monkeypatch.setattr(train, "jit_train_step", poisoned)
    config = _tiny_config("bf16", max_steps=20, checkpoint_every_steps=4, plot=False)
    with pytest.raises(train.NonFiniteLossError, match="non-finite .* at step 8") as e:
        train.train_and_evaluate(config, tmp_path)
    assert isinstance(e.value, LossScaleDivergedError)  # exit status 3, like a diverged scale
    assert "newest checkpoint (step 4" in str(e.value)
    summary = _strict_json((tmp_path / "summary.json").read_text())
    assert summary["outcome"] == "diverged" and summary["non_finite_at_step"] == 8
    assert summary["steps"] == 8 and summary["checkpoint_step"] == 4
    assert summary["loss_scale_kind"] == "none"
    assert summary["non_finite_reason"].startswith("NaN in the gradient of ")
    assert f"at step 8 ({summary['non_finite_reason']})" in str(e.value)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["4"]  # step 8's state not saved
    rows = [_strict_json(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [5]  # finite; 6-8 never logged


def test_tensor_stats_and_skip_reasons_reach_metrics_tensorboard_and_summary(tmp_path):
    """fp16 from a loss scale of 2**24: the first steps overflow in the backward pass and are
    skipped, each with the gradient that went inf; statistics every 2 steps name every
    scanned layer's params, gradients and outputs."""
    from jamp import train

    config = _tiny_config(max_steps=4, tensor_stats_every=2, plot=False, log_every_steps=4)
    config.loss_scale.init_scale = 2.0 ** 24  # the largest allowed
    summary = train.train_and_evaluate(config, tmp_path)
    rows = [_strict_json(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    reasons = [r for row in rows for r in row.get("train/skip_reasons", [])]
    assert re.fullmatch(r"step 1 skipped: (inf|NaN) in the gradient of \S+ \(element .*\)",
                        reasons[0]), reasons
    # Where the scaled loss first overflows in the backward pass: the head, the first layer it
    # reaches (the search prefers a leaf holding inf alone: NaN is inf - inf, downstream).
    assert any(" skipped: inf in the gradient of head/" in r for r in reasons), reasons
    assert len(reasons) == summary["steps_skipped"] and summary["skip_reasons"] == reasons
    stats = [_strict_json(line)
             for line in (tmp_path / "tensor_stats.jsonl").read_text().splitlines()]
    assert [s["step"] for s in stats] == [1, 3]
    assert "encoder/layers/0/MlpBlock_0/Dense_0/kernel" in stats[0]["grads"]
    assert "encoder/layers/0/MlpBlock_0/Dense_0" in stats[0]["activations"]
    assert stats[0]["grads"]["encoder/layers/0/MlpBlock_0/Dense_0/kernel"]["amax"] == "NaN" or \
        stats[0]["grads"]["encoder/layers/0/MlpBlock_0/Dense_0/kernel"]["inf_count"] > 0
    events = b"".join((tmp_path / "tensorboard" / name).read_bytes() for name in _events(tmp_path))
    assert b"tensor_stats/params/log2_amax" in events  # a histogram
    assert b"tensor_stats/activations/amax/encoder/layers/0/MlpBlock_0/Dense_0" in events
    # The reasons reach TensorBoard as text, word for word.
    assert b"train/skip_reasons" in events and reasons[0].encode() in events


class _Iterable:
    def __init__(self, fn, args, kwargs):
        self.fn, self.args, self.kwargs = fn, args, kwargs

    def __iter__(self):
        return self.fn(*self.args, **self.kwargs)
