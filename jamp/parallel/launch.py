"""Multi-process launch on JAX's own distributed runtime (``jax.distributed``).

One JAX process per host (or per GPU) joins a run through
``jax.distributed.initialize``; after it, ``jax.devices()`` lists every
process's devices and the mesh spans them all. :func:`detect` decides how this
process was launched, first match wins:

1. explicit ``coordinator``/``num_processes``/``process_id`` (``jamp.train``'s
   ``--coordinator host:port --num_processes N --process_id i``);
2. torchrun-style variables ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``,
   ``RANK`` (``LOCAL_RANK``/``LOCAL_WORLD_SIZE``), which JAX does not read: the
   coordinator is ``MASTER_ADDR:MASTER_PORT`` (``MASTER_PORT + 1`` under
   torchrun itself, whose agent already listens on ``MASTER_PORT``;
   ``JAX_COORDINATOR_PORT`` overrides), and with several processes per host each
   one takes the device ``LOCAL_RANK``;
3. ``JAX_COORDINATOR_ADDRESS``, SLURM (``srun``, more than one task) or Open MPI
   (``mpirun``): JAX detects these itself, so
   ``jax.distributed.initialize()`` is called without arguments.

Anything else is a single-process run and nothing is initialised.
:func:`initialize` must run before anything touches a JAX backend. On CPU the
processes exchange data through gloo (``jax_cpu_collectives_implementation``).

Example:
  >>> from jamp.parallel import launch
  >>> env = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "16",
  ...        "RANK": "9", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8"}
  >>> launch.detect(environ=env)
  Launch(source='torchrun', coordinator_address='10.0.0.1:29500', num_processes=16, \
process_id=9, local_device_ids=(1,))
  >>> launch.detect(environ={}) is None
  True
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import jax

_TORCHRUN = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
# The variables jax._src.clusters checks for SLURM and Open MPI (tests keep them in sync).
_SLURM = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
          "SLURM_LOCALID")
_OMPI = "OMPI_MCA_orte_hnp_uri"


@dataclasses.dataclass(frozen=True)
class Launch:
    """How this process joins a multi-process run.

    Attributes:
      source: "flags", "torchrun", "jax" (``JAX_COORDINATOR_ADDRESS``), "slurm" or "ompi".
      coordinator_address: ``host:port`` of process 0's coordinator; None lets
        JAX find it (SLURM, Open MPI, ``JAX_COORDINATOR_ADDRESS``).
      num_processes: process count, or None for JAX to find.
      process_id: this process's index, or None for JAX to find.
      local_device_ids: the local devices this process uses (one per process),
        or None for all of them.
    """

    source: str
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None


def _int(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise ValueError(f"Environment variable {name}={environ[name]!r} is not an integer.") \
            from None


def _explicit(coordinator: str | None, num_processes: int | None,
              process_id: int | None) -> Launch:
    given = {"--coordinator": coordinator, "--num_processes": num_processes,
             "--process_id": process_id}
    missing = [name for name, value in given.items() if value is None]
    if missing:
        raise ValueError(
            f"A multi-process launch by flags needs all of --coordinator, --num_processes and "
            f"--process_id; missing {', '.join(missing)}. E.g. on every host: --coordinator="
            "host0:1234 --num_processes=2 --process_id=<0 or 1>.")
    host, sep, port = coordinator.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--coordinator={coordinator!r} must be host:port, e.g. 10.0.0.1:1234.")
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(
            f"--process_id={process_id} must be in [0, --num_processes={num_processes}).")
    return Launch("flags", coordinator, num_processes, process_id)


def _torchrun(environ: Mapping[str, str]) -> Launch | None:
    world = _int(environ, "WORLD_SIZE")
    if world <= 1:
        return None
    if "JAX_COORDINATOR_PORT" in environ:
        port = _int(environ, "JAX_COORDINATOR_PORT")
    else:
        # torchrun's agent serves its TCPStore on MASTER_PORT: take the next port.
        agent_store = environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        port = _int(environ, "MASTER_PORT") + int(agent_store)
    local = None
    if "LOCAL_RANK" in environ and int(environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
        local = (_int(environ, "LOCAL_RANK"),)
    return Launch("torchrun", f"{environ['MASTER_ADDR']}:{port}", world,
                  _int(environ, "RANK"), local)


def detect(coordinator: str | None = None, num_processes: int | None = None,
           process_id: int | None = None,
           environ: Mapping[str, str] | None = None) -> Launch | None:
    """Returns how this process was launched, or None for a single-process run.

    Args:
      coordinator, num_processes, process_id: explicit settings (all or none).
      environ: the environment to read (default ``os.environ``).

    Raises:
      ValueError: incomplete or inconsistent explicit settings, or non-integer
        torchrun variables.

    Example:
      >>> from jamp.parallel.launch import detect
      >>> detect("10.0.0.1:1234", 2, 1).source
      'flags'
      >>> detect(environ={"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-2]",
      ...                 "SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"})
      Launch(source='slurm', coordinator_address=None, num_processes=None, \
process_id=None, local_device_ids=None)
    """
    env = os.environ if environ is None else environ
    if (coordinator, num_processes, process_id) != (None, None, None):
        return _explicit(coordinator, num_processes, process_id)
    if all(name in env for name in _TORCHRUN):
        return _torchrun(env)
    if "JAX_COORDINATOR_ADDRESS" in env:
        return Launch("jax")
    if all(name in env for name in _SLURM) and _int(env, "SLURM_NTASKS") > 1:
        return Launch("slurm")
    if _OMPI in env and int(env.get("OMPI_COMM_WORLD_SIZE", "2")) > 1:
        return Launch("ompi")
    return None


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None,
               environ: Mapping[str, str] | None = None) -> Launch | None:
    """Calls ``jax.distributed.initialize`` when :func:`detect` finds a multi-process launch.

    Must run before any JAX computation. Does nothing for a single process or
    when ``jax.distributed`` is already initialised (returns the detection).

    Returns:
      The :class:`Launch` used, or None for a single-process run.

    Example:
      >>> from jamp.parallel import launch
      >>> launch.initialize(environ={}) is None   # a single process: nothing to do
      True
    """
    found = detect(coordinator, num_processes, process_id, environ)
    if found is None or jax.distributed.is_initialized():
        return found
    if jax.config.jax_cpu_collectives_implementation in (None, "none"):
        # Processes on CPU exchange data through gloo (the default since JAX 0.5).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=found.coordinator_address, num_processes=found.num_processes,
        process_id=found.process_id,
        local_device_ids=list(found.local_device_ids) if found.local_device_ids else None)
    return found
