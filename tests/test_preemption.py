"""SIGINT/SIGTERM mid-run: checkpoint at the step, one line, exit 130/143, exact resume.

Each run is a ``python -m jamp.train`` subprocess on a tiny ViT (metrics every step,
the loss scale doubling every 4 steps, no periodic checkpoint before the signal) beside
an uninterrupted reference; the rerun uses the command the stopped run printed, and its
whole metrics trajectory (loss, loss scale, skipped steps) must be the reference's: the
same data position, parameters and loss scale at the step it resumes from. Direct,
fast tests beside them: a second signal while a step runs exits at once (a small loop
under StopOnSignal in a subprocess), and processes agree on a stop by max.
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jamp import preemption
from jamp.checkpoint import Checkpointer
from jamp.metrics import read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--config", "vit_fp16", "--config.num_layers=1", "--config.hidden_size=16",
        "--config.num_heads=2", "--config.mlp_dim=32", "--config.batch_size=32",
        "--config.progress=False", "--config.plot=False", "--config.log_every_steps=1",
        "--config.max_steps=40", "--config.checkpoint_every_steps=1000",
        "--config.loss_scale.growth_interval=4"]
STOPPED = re.compile(r"^jamp\.train: stopped by (SIG\w+) at step (\d+) \(checkpoint in (.+)\); "
                     r"resume with: (.+)$", re.M)
# Runs jamp.train with orbax's write of the data item slowed down by 60 s when the save
# is the one a signal asked for (force=True): a second signal then lands mid-save.
SLOW_SAVE = """
import sys, time, grain, jamp.checkpoint as c
real_save, real_write, slow = c.Checkpointer.save, grain.checkpoint.CheckpointHandler.save, []
def save(self, *a, force=False, **k):
    slow.append(force)
    real_save(self, *a, force=force, **k)
def write(self, *a, **k):
    if slow[-1]:
        print("SAVING", file=sys.stderr, flush=True)
        time.sleep(60)
    real_write(self, *a, **k)
c.Checkpointer.save, grain.checkpoint.CheckpointHandler.save = save, write
from jamp import cli
cli.main(["jamp.train", *sys.argv[1:]])
"""


def _env(devices: int = 8) -> dict[str, str]:
    return {**os.environ, "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}


def _start(workdir, *extra: str, prefix=("-m", "jamp.train"), env=None, log=None
           ) -> subprocess.Popen:
    log = open(log or f"{workdir}.log", "w+")  # noqa: SIM115  (read while it runs)
    proc = subprocess.Popen([sys.executable, *prefix, *TINY, *extra, f"--workdir={workdir}"],
                            cwd=REPO, env=env or _env(), stdout=log, stderr=subprocess.STDOUT,
                            text=True)
    proc.log = log
    return proc


def _output(proc: subprocess.Popen, timeout: float = 240) -> str:
    proc.wait(timeout=timeout)
    proc.log.seek(0)
    return proc.log.read()


def _wait_for(condition, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended first:\n{_output(proc)[-3000:]}"
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def _trained(workdir, steps: int):
    return lambda: os.path.exists(workdir / "metrics.jsonl") and sum(
        "train/loss" in r for r in read_metrics(workdir)) >= steps


def _trajectory(workdir) -> dict[int, tuple[float, float, int]]:
    return {r["step"]: (r["train/loss"], r["train/loss_scale"], r["train/steps_skipped"])
            for r in read_metrics(workdir) if "train/loss" in r}


def _check_stopped(proc, workdir, signum: int, output: str) -> tuple[int, str]:
    """The stopped run's exit status, line and checkpoint; returns (step, resume command)."""
    assert proc.returncode == 128 + signum, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    lines = STOPPED.findall(output)
    assert len(lines) == 1, output[-3000:]
    name, step, where, command = lines[0]
    step = int(step)
    assert name == signal.Signals(signum).name and 3 <= step < 40, lines
    assert where == str(workdir / "checkpoints" / str(step))
    assert Checkpointer(workdir / "checkpoints").all_steps() == [step]
    assert max(_trajectory(workdir)) == step  # every step to it logged, none after
    return step, command


def _rerun(command: str, workdir) -> subprocess.Popen:
    """Runs the printed resume ``command`` (the stopped run's own command line)."""
    assert f"--workdir={workdir}" in command and "--config vit_fp16" in command, command
    return subprocess.Popen(shlex.split(command), cwd=REPO, env=_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _check_resumed(rerun: subprocess.Popen, workdir, reference, step: int) -> None:
    """The rerun resumed at ``step`` and continued exactly as the reference ran."""
    output = rerun.communicate(timeout=240)[0]
    assert rerun.returncode == 0, output[-3000:]
    assert f"Resumed from step {step} " in output, output[-3000:]
    got, want = _trajectory(workdir), _trajectory(reference)
    assert sorted(got) == list(range(1, 41))
    assert got == want, [(s, got[s], want[s]) for s in got if got[s] != want.get(s)][:3]
    scales = {scale for _, scale, _ in want.values()}
    assert len(scales) > 2  # the loss scale moved: a reset one would show


def test_sigint_and_sigterm_checkpoint_the_step_and_resume_exactly(tmp_path):
    reference = _start(tmp_path / "reference")
    runs = {signum: _start(tmp_path / signum.name) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        stopped = {}
        for signum, proc in runs.items():
            _wait_for(_trained(tmp_path / signum.name, 3), proc)
            proc.send_signal(signum)
        for signum, proc in runs.items():
            stopped[signum] = _check_stopped(proc, tmp_path / signum.name, signum, _output(proc))
        assert reference.wait(timeout=240) == 0, _output(reference)[-3000:]
        reruns = {signum: _rerun(command, tmp_path / signum.name)
                  for signum, (_, command) in stopped.items()}
        for signum, (step, _) in stopped.items():
            _check_resumed(reruns[signum], tmp_path / signum.name, tmp_path / "reference", step)
    finally:
        for proc in [reference, *runs.values(), *locals().get("reruns", {}).values()]:
            proc.kill()


def test_second_signal_during_the_save_exits_at_once_and_leaves_no_checkpoint(tmp_path):
    workdir = tmp_path / "run"
    proc = _start(workdir, prefix=("-c", SLOW_SAVE))
    try:
        _wait_for(_trained(workdir, 3), proc)
        proc.send_signal(signal.SIGINT)
        _wait_for(lambda: "SAVING" in pathlib.Path(f"{workdir}.log").read_text(), proc)
        sent = time.time()
        proc.send_signal(signal.SIGINT)
        output = _output(proc, timeout=30)
        assert time.time() - sent < 10  # not after the 60 s save
    finally:
        proc.kill()
    assert proc.returncode == 130, output[-3000:]
    assert "Traceback" not in output and "second SIGINT: exiting at once" in output, output
    assert not STOPPED.search(output)
    assert any("tmp" in d for d in os.listdir(workdir / "checkpoints"))  # a save was under way
    assert Checkpointer(workdir / "checkpoints").all_steps() == []  # and is not taken for one


# A loop under StopOnSignal whose second step runs for 30 s; the test signals during it.
LONG_STEP = """
import sys, time
from jamp.preemption import StopOnSignal
with StopOnSignal() as stop:
    for step in range(1, 4):
        if step == 2:
            print("STEP", flush=True)
            time.sleep(30)  # the step; both signals arrive while it runs
        if stop.should_stop():
            break
print("RAN ON", flush=True)
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_second_signal_while_a_step_runs_exits_at_once(signum, tmp_path):
    """Not only during the save: a second signal mid-step exits with 128 + signum at once
    (the first only asks to stop after the step)."""
    log = open(tmp_path / "log", "w+")  # noqa: SIM115  (read while it runs)
    proc = subprocess.Popen([sys.executable, "-c", LONG_STEP], cwd=REPO, env=_env(1),
                            stdout=log, stderr=subprocess.STDOUT, text=True)
    proc.log = log
    try:
        text = lambda: pathlib.Path(tmp_path / "log").read_text()
        _wait_for(lambda: "STEP" in text(), proc, timeout=60)
        proc.send_signal(signum)
        _wait_for(lambda: "finishing this step" in text(), proc, timeout=10)
        sent = time.time()
        proc.send_signal(signum)
        output = _output(proc, timeout=40)
    finally:
        proc.kill()
    name = signal.Signals(signum).name
    assert proc.returncode == 128 + signum, output
    assert time.time() - sent < 5  # not after the 30 s step
    assert f"second {name}: exiting at once" in output and "RAN ON" not in output, output


class _TwoProcesses(preemption._Agreement):
    """The agreement as two processes would run it on one machine's 8 devices: devices
    4-7 ("process 1") contribute ``other``'s flag, devices 0-3 this process's."""

    other = 0

    def __call__(self, flag: int) -> jax.Array:
        flags = [flag] * 4 + [self.other] * 4
        local = [jax.device_put(np.full((1,), f, np.int32), d)
                 for f, d in zip(flags, self.devices, strict=True)]
        return self.reduce(jax.make_array_from_single_device_arrays(
            (self.size,), self.sharding, local))


@pytest.mark.parametrize("who", ["other", "this"])
def test_processes_agree_to_stop_when_any_of_them_got_the_signal(who, monkeypatch):
    """The flags are combined by max: one process's SIGTERM (15) stops every process, one
    step later, whichever process got it (a min would need all of them to get it)."""
    mesh = jax.make_mesh((8,), ("data",))
    monkeypatch.setattr(preemption, "_Agreement", _TwoProcesses)
    monkeypatch.setattr(preemption, "_multiprocess", lambda mesh: True)
    stop = preemption.StopOnSignal(mesh)
    assert [stop.should_stop() for _ in range(3)] == [False] * 3  # nobody got a signal
    if who == "other":
        stop._agree.other = signal.SIGTERM
    else:
        stop.received = signal.SIGTERM  # what the handler records
    assert [stop.should_stop(), stop.should_stop()] == [False, True]  # read one step later
    assert stop.signum == signal.SIGTERM


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_stop_at_the_same_step_when_one_gets_sigterm(tmp_path):
    """Two processes x 2 CPU devices (gloo on 127.0.0.1); only process 1 gets SIGTERM."""

    def launch(workdir):
        port = _free_port()
        return [_start(workdir, f"--coordinator=127.0.0.1:{port}", "--num_processes=2",
                       f"--process_id={i}", env=_env(2), log=f"{workdir}-{i}.log")
                for i in range(2)]

    reference, run = launch(tmp_path / "reference"), launch(tmp_path / "run")
    try:
        _wait_for(_trained(tmp_path / "run", 3), run[1])
        run[1].send_signal(signal.SIGTERM)
        outputs = [_output(p) for p in run]
        steps = [_check_stopped(p, tmp_path / "run", signal.SIGTERM, out)
                 for p, out in zip(run, outputs, strict=True)]
        assert steps[0][0] == steps[1][0]  # agreed (process 0 got no signal)
        for p in reference:
            assert _output(p) and p.returncode == 0, _output(p)[-3000:]
        procs = [subprocess.Popen(shlex.split(command), cwd=REPO, env=_env(2),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for _, command in steps]
        resumed = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in [*reference, *run]:
            p.kill()
    for p, out in zip(procs, resumed, strict=True):
        assert p.returncode == 0, out[-3000:]
    assert f"Resumed from step {steps[0][0]} " in resumed[0]
    got, want = _trajectory(tmp_path / "run"), _trajectory(tmp_path / "reference")
    assert sorted(got) == list(range(1, 41)) and got == want
