"""Two processes x 4 CPU devices (gloo on 127.0.0.1) train like one process with 8.

``python -m jamp.train --coordinator ... --num_processes 2 --process_id i`` runs
the 3D config (data x model x pipe = 2 x 2 x 2): each process holds one 'data'
slice of the mesh with its 2 x 2 tensor/pipeline block, reads only its half of
every global batch, and the gradient all-reduce crosses the process boundary.
The reference is one process on the test session's 8 devices reading the same
global batches: the two halves a 2-process run reads, concatenated
(``train_loader`` with ``process_count=2``, twice).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from jamp import train
from jamp.config import vit_config
from jamp.metrics import read_metrics

if len(jax.devices()) < 8:  # conftest forces 8 CPU devices
    pytest.skip("needs 8 devices", allow_module_level=True)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = dict(num_layers=2, hidden_size=16, num_heads=2, mlp_dim=32, batch_size=32,
              pipeline_microbatches=2, max_steps=6, log_every_steps=2, progress=False,
              plot=False, checkpoint_every_steps=1000, warmup_steps=1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _TwoProcessBatches:
    """The global batches of a 2-process run, read in one process (grain-checkpointable)."""

    def __init__(self, loader, kwargs):
        self.parts = [iter(loader(**{**kwargs, "process_index": i, "process_count": 2}))
                      for i in range(2)]

    def __iter__(self):
        return self

    def __next__(self):
        halves = [next(p) for p in self.parts]
        return {k: np.concatenate([h[k] for h in halves]) for k in halves[0]}

    def get_state(self) -> bytes:
        return json.dumps([p.get_state().decode() for p in self.parts]).encode()

    def set_state(self, state: bytes) -> None:
        for p, s in zip(self.parts, json.loads(state), strict=True):
            p.set_state(s.encode())


def _launch(workdir, port: int) -> list[subprocess.Popen]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    args = [f"--config.{k}={v}" for k, v in FIELDS.items()]
    return [subprocess.Popen(
        [sys.executable, "-m", "jamp.train", "--config=configs/vit_fp16_3d.py", *args,
         f"--workdir={workdir}", f"--coordinator=127.0.0.1:{port}", "--num_processes=2",
         f"--process_id={i}"], cwd=REPO, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for i in range(2)]


def test_two_processes_match_one_process_with_eight_devices(tmp_path, monkeypatch):
    procs = _launch(tmp_path / "multi", _free_port())
    try:
        # The single-process reference trains meanwhile, in this process.
        real_loader = train.data.train_loader
        monkeypatch.setattr(train.data, "train_loader",
                            lambda info, **kw: _TwoProcessBatches(real_loader,
                                                                  {"info": info, **kw}))
        config = vit_config("fp16")
        config.mesh.data, config.mesh.model, config.mesh.pipe = -1, 2, 2
        for key, value in FIELDS.items():
            config[key] = value
        reference = train.train_and_evaluate(config, str(tmp_path / "single"))
        outputs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-4000:]

    with open(tmp_path / "multi" / "summary.json") as f:
        multi = json.load(f)
    assert multi["devices"] == reference["devices"] == 8
    assert multi["mesh"] == {"data": 2, "model": 2, "pipe": 2}
    assert multi["pipeline_bubble"] == pytest.approx(1 / 3)  # (S-1)/(M+S-1), S = M = 2
    assert multi["steps"] == 6 and multi["final_loss_scale"] == reference["final_loss_scale"]
    assert multi["steps_skipped"] == reference["steps_skipped"]
    # gloo and the in-process collectives may sum in different orders: float tolerance.
    for key in ("param_norm", "test_loss", "test_accuracy"):
        assert multi[key] == pytest.approx(reference[key], rel=1e-5), key

    def trajectory(path):
        return [(r["step"], r["train/loss"], r["train/loss_scale"])
                for r in read_metrics(path) if "train/loss" in r]

    got, want = trajectory(tmp_path / "multi"), trajectory(tmp_path / "single")
    assert [s for s, *_ in got] == [2, 4, 6]  # one line per step: only process 0 writes
    assert [s for *_, s in got] == [s for *_, s in want]
    np.testing.assert_allclose([x for _, x, _ in got], [x for _, x, _ in want], rtol=1e-5)
    # Only process 0 prints the summary; both took part in the checkpoint.
    assert "jamp.train summary" in outputs[0] and "jamp.train summary" not in outputs[1]
    assert (tmp_path / "multi" / "checkpoints" / "6").is_dir()
