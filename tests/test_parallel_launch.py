"""How ``jamp.train`` joins a multi-process run: flags, torchrun variables, SLURM, Open MPI.

``jax.distributed.initialize`` is replaced by a recorder: these tests check what
jamp would pass to it (the real thing runs in tests/test_multiprocess.py).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jamp.parallel import launch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = {"MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500", "WORLD_SIZE": "4", "RANK": "3",
            "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
SLURM = {"SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_NTASKS": "16",
         "SLURM_PROCID": "9", "SLURM_LOCALID": "1"}
OMPI = {"OMPI_MCA_orte_hnp_uri": "123.0;tcp://10.0.0.1:4000", "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}


def test_single_process_needs_nothing():
    assert launch.detect(environ={}) is None
    assert launch.detect(environ={**TORCHRUN, "WORLD_SIZE": "1", "RANK": "0"}) is None
    assert launch.detect(environ={**SLURM, "SLURM_NTASKS": "1"}) is None  # e.g. salloc shell


def test_explicit_flags():
    found = launch.detect("127.0.0.1:1234", 2, 1, environ=TORCHRUN)  # flags win
    assert found == launch.Launch("flags", "127.0.0.1:1234", 2, 1)


@pytest.mark.parametrize("args, needle", [
    (("127.0.0.1:1234", None, None), "missing --num_processes, --process_id"),
    ((None, 2, 0), "missing --coordinator"),
    (("127.0.0.1", 2, 0), "must be host:port"),
    (("127.0.0.1:1234", 2, 2), "--process_id=2 must be in [0, --num_processes=2)"),
])
def test_incomplete_or_inconsistent_flags(args, needle):
    with pytest.raises(ValueError) as info:
        launch.detect(*args, environ={})
    assert needle in str(info.value)


def test_torchrun_variables():
    found = launch.detect(environ=TORCHRUN)
    assert found == launch.Launch("torchrun", "10.1.2.3:29500", 4, 3, (1,))
    # Under torchrun itself the agent's store holds MASTER_PORT: the next port is used.
    agent = launch.detect(environ={**TORCHRUN, "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert agent.coordinator_address == "10.1.2.3:29501"
    port = launch.detect(environ={**TORCHRUN, "JAX_COORDINATOR_PORT": "4321"})
    assert port.coordinator_address == "10.1.2.3:4321"
    # One process per host: it keeps all of the host's devices.
    per_host = launch.detect(environ={**TORCHRUN, "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    assert per_host.local_device_ids is None
    with pytest.raises(ValueError, match="RANK='x' is not an integer"):
        launch.detect(environ={**TORCHRUN, "RANK": "x"})


@pytest.mark.parametrize("env, source", [(SLURM, "slurm"), (OMPI, "ompi"),
                                         ({"JAX_COORDINATOR_ADDRESS": "h:1"}, "jax")])
def test_cluster_environments_are_left_to_jax(env, source):
    assert launch.detect(environ=env) == launch.Launch(source)


@pytest.mark.parametrize("env, cluster", [(SLURM, "SlurmCluster"), (OMPI, "OmpiCluster")])
def test_cluster_detection_agrees_with_jax(monkeypatch, env, cluster):
    # jamp leaves these to JAX's own detection, so it must see them exactly when JAX does.
    from jax._src import clusters

    cluster = getattr(clusters, cluster)
    for name in (*SLURM, *OMPI, *TORCHRUN, "JAX_COORDINATOR_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    for missing in (None, *env):
        for name, value in env.items():
            if name == missing:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        assert cluster.is_env_present() == (launch.detect() is not None), missing


def test_initialize_passes_the_detected_launch(monkeypatch):
    import jax

    calls = []
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    assert launch.initialize(environ={}) is None and calls == []
    launch.initialize(environ=TORCHRUN)
    launch.initialize(environ=SLURM)
    assert calls == [
        dict(coordinator_address="10.1.2.3:29500", num_processes=4, process_id=3,
             local_device_ids=[1]),
        dict(coordinator_address=None, num_processes=None, process_id=None,
             local_device_ids=None),
    ]
    assert jax.config.jax_cpu_collectives_implementation == "gloo"


def test_cli_rejects_incomplete_flags_in_one_paragraph(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "jamp.train", "--config=configs/vit_fp16.py",
         "--coordinator=127.0.0.1:1234", f"--workdir={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert "jamp.train: error: A multi-process launch by flags needs all of" in result.stderr
