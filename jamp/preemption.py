"""Preemption-safe training loops: SIGINT/SIGTERM become "stop after this step".

:class:`StopOnSignal` is a context manager that replaces the SIGINT and SIGTERM
handlers (Ctrl-C; what SLURM, Kubernetes and cloud preemption send before killing)
with one that only records the signal; the loop asks :meth:`StopOnSignal.should_stop`
once per step, saves a checkpoint at the step it stops at and raises :class:`Preempted`.
A second signal exits the process at once with status ``128 + signum`` (an orbax save
is atomic: a half-written checkpoint is never taken for a complete one).

Processes of a multi-process run agree on the step: each step, every process
contributes its local flag (the signal number, 0 for none) to a tiny max all-reduce over
the mesh, dispatched asynchronously and read one step later, so the host never waits
for it (it stays one step ahead of the devices) and all processes stop at the same step,
whichever of them got the signal. JAX's own preemption sync point
(``multihost_utils.reached_preemption_sync_point``) is not used: it reacts to SIGTERM
only (not Ctrl-C), does nothing in a single-process run, and its notifier is a C-level
SIGTERM handler that Python's ``signal`` module can neither chain nor restore.

Example:
  >>> import os, signal
  >>> with StopOnSignal() as stop:
  ...     for step in range(1, 100):
  ...         if step == 3:
  ...             os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice
  ...         if stop.should_stop():
  ...             break  # save a checkpoint at ``step`` here
  >>> step, signal.Signals(stop.signum).name
  (3, 'SIGTERM')
  >>> Preempted(step, stop.signum, "runs/x/checkpoints").exit_status
  143
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""The signals that stop a run after the current step."""


class Preempted(Exception):  # noqa: N818  (a stop, not a failure)
    """A run stopped on a signal after saving a checkpoint at ``step``.

    Attributes:
      step: the step of the checkpoint; a rerun resumes there.
      signum: the signal (``signal.SIGINT`` or ``signal.SIGTERM``).
      checkpoint_dir: where the checkpoint is.
      exit_status: ``128 + signum`` (130, 143), the shell's status for a signal.

    Example:
      >>> e = Preempted(37, 2, "runs/x/checkpoints")
      >>> print(e, e.exit_status)
      stopped by SIGINT at step 37 (checkpoint in runs/x/checkpoints/37) 130
    """

    def __init__(self, step: int, signum: int, checkpoint_dir: str):
        self.step, self.signum, self.checkpoint_dir = step, signum, checkpoint_dir
        self.exit_status = 128 + signum
        super().__init__(f"stopped by {signal.Signals(signum).name} at step {step} "
                         f"(checkpoint in {os.path.join(checkpoint_dir, str(step))})")


class StopOnSignal:
    """Records SIGINT/SIGTERM while active; :meth:`should_stop` says when to stop.

    Args:
      mesh: the run's device mesh; with devices of several processes, they agree on
        the step through a max all-reduce (see the module docstring). None: this
        process alone.
      signals: the signals to catch.

    Handlers are installed only from the main thread (elsewhere Python cannot; the
    context then never stops), and the previous ones are restored on exit.

    Example: see the module docstring.
    """

    def __init__(self, mesh: Mesh | None = None, signals: tuple[int, ...] = SIGNALS):
        self.signals = signals
        self.received: int | None = None  # the first signal this process got
        self.signum: int | None = None  # the agreed signal, once should_stop() says True
        self._previous: dict[int, Any] = {}
        self._agree = _Agreement(mesh) if mesh is not None and _multiprocess(mesh) else None
        self._pending: jax.Array | None = None

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self._previous.items():
            # None: a handler not installed from Python (e.g. a C library's): the default.
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:  # a second signal: out now, saved or not
            os.write(2, f"\njamp.train: second {name}: exiting at once (checkpoints "
                        "already on disk are intact).\n".encode())
            os._exit(128 + signum)
        self.received = signum
        os.write(2, f"\njamp.train: {name}: finishing this step and saving a checkpoint "
                    f"(send {name} again to exit at once).\n".encode())

    def should_stop(self) -> bool:
        """Whether to stop after the step just run; every process calls it once per step.

        A single process stops at the step during which it got a signal; processes of a
        multi-process run stop together, one step after the first signal among them.
        """
        if self.signum is not None:
            return True
        if self._agree is None:
            self.signum = self.received
        else:
            agreed, self._pending = self._pending, self._agree(self.received or 0)
            if agreed is not None:  # the flags of the previous step, reduced by now
                self.signum = int(agreed.addressable_data(0)) or None
        return self.signum is not None


def _multiprocess(mesh: Mesh) -> bool:
    return len({d.process_index for d in mesh.devices.flat}) > 1


class _Agreement:
    """``flag -> max(flag over every device of mesh)``, asynchronously (a jax.Array)."""

    def __init__(self, mesh: Mesh):
        self.sharding = NamedSharding(mesh, PartitionSpec(mesh.axis_names))
        self.devices = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
        self.size = mesh.devices.size
        self.reduce = jax.jit(jnp.max, out_shardings=NamedSharding(mesh, PartitionSpec()))

    def __call__(self, flag: int) -> jax.Array:
        local = [jax.device_put(np.full((1,), flag, np.int32), d) for d in self.devices]
        return self.reduce(jax.make_array_from_single_device_arrays(
            (self.size,), self.sharding, local))
