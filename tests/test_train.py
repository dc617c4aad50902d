"""The trainer end to end: CLI, errors, checkpoints, SIGKILL resume, divergence guard.

Runs on a tiny ViT (1 block, width 16) for a few dozen steps on the embedded digits,
data-parallel over the session's 8 fake CPU devices.
"""

from __future__ import annotations

import json
import os
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


def test_python_api_short_run_writes_metrics_checkpoint_summary_and_plot(tmp_path):
    from jamp.train import train_and_evaluate

    summary = train_and_evaluate(_tiny_config(max_steps=12, checkpoint_every_steps=10), tmp_path)
    assert summary["steps"] == 12 and summary["devices"] == 8
    assert summary["mode"] == "fp16" and summary["final_loss_scale"] > 0
    assert 0.0 <= summary["test_accuracy"] <= 1.0
    assert summary["memory"]["residual_bytes"] > 0
    assert summary["memory"]["activation_bytes"] > 0
    records = read_metrics(tmp_path)
    train = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train] == [5, 10, 12]
    assert all(np.isfinite(r["train/loss"]) for r in train)
    assert any("eval/accuracy" in r for r in records)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["10", "12"]
    assert (tmp_path / "training.png").stat().st_size > 10_000
    assert _json(tmp_path / "summary.json")["steps"] == 12


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
    for key in ("test_loss", "test_accuracy", "final_loss_scale", "steps_skipped"):
        assert got[key] == ref[key], key


def _assert_one_paragraph_error(result, *needles):
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr
    error = [line for line in result.stderr.splitlines() if "jamp.train: error:" in line]
    assert error, result.stderr[-3000:]
    for needle in needles:
        assert needle in error[0], error[0]


def test_invalid_override_is_rejected_clearly(tmp_path):
    result = _cli("--config=configs/vit_fp16.py", "--config.learning_rat=0.1", workdir=tmp_path)
    _assert_one_paragraph_error(result, "learning_rat")


def test_unknown_dataset_names_where_it_looked_and_how_to_prepare(tmp_path):
    result = _cli("--config=configs/vit_fp16.py:s16,cifar10", f"--config.data_dir={tmp_path}",
                  workdir=tmp_path / "run")
    _assert_one_paragraph_error(result, "cifar10", str(tmp_path), "tfds build")


def test_batch_not_divisible_by_devices(tmp_path):
    result = _cli("--config=configs/vit_fp16.py", "--config.batch_size=60", workdir=tmp_path)
    _assert_one_paragraph_error(result, "batch_size=60", "8 devices", "multiple of 8")


def test_corrupt_checkpoint_gives_the_fix(tmp_path):
    from jamp.train import train_and_evaluate

    train_and_evaluate(_tiny_config(max_steps=5, checkpoint_every_steps=5, plot=False), tmp_path)
    step_dir = tmp_path / "checkpoints" / "5"
    for root, _, files in os.walk(step_dir / "state"):
        for name in files:
            with open(os.path.join(root, name), "wb") as f:
                f.write(b"garbage")
    result = _cli("--config=configs/vit_fp16.py", *TINY, "--config.max_steps=10",
                  workdir=tmp_path)
    _assert_one_paragraph_error(result, str(step_dir), "Delete", "--workdir")


def test_divergence_guard_stops_with_an_explanation(tmp_path, monkeypatch):
    from jamp import data, train
    from jamp.loss_scale import LossScaleDivergedError

    real_loader = data.train_loader

    def nan_loader(*args, **kwargs):
        for batch in real_loader(*args, **kwargs):
            yield {**batch, "image": np.full_like(batch["image"], np.nan)}

    monkeypatch.setattr(train.data, "train_loader", lambda *a, **k: _Iterable(nan_loader, a, k))
    config = _tiny_config(max_steps=40, plot=False)
    config.loss_scale.init_scale = 4.0
    config.loss_scale.divergence_steps = 5
    with pytest.raises(LossScaleDivergedError, match="overflowed for 5 steps in a row"):
        train.train_and_evaluate(config, tmp_path)
    rows = read_metrics(tmp_path)
    assert rows[-1]["train/steps_skipped"] == rows[-1]["step"]  # every step was skipped
    assert rows[-1]["step"] < 40


class _Iterable:
    def __init__(self, fn, args, kwargs):
        self.fn, self.args, self.kwargs = fn, args, kwargs

    def __iter__(self):
        return self.fn(*self.args, **self.kwargs)
