"""Orbax checkpoints of a training run: state, data position and run metadata.

One checkpoint holds the train state (params, optimizer and loss-scale state,
step), the grain iterator position, and JSON metadata (mode, dataset, model)
that must match on resume. A checkpoint that cannot be read gives a
:class:`CheckpointError` that says which directory and what to do.

Usage (in the trainer): ``ckpt.save(step, state, data_iterator, meta)`` every few
steps, ``ckpt.restore(abstract_state, data_iterator, meta)`` on a rerun; see
:class:`Checkpointer` for a runnable example.
"""

from __future__ import annotations

import os
from typing import Any

import grain
import orbax.checkpoint as ocp


class CheckpointError(RuntimeError):
    """A checkpoint exists but cannot be used to resume."""


class Checkpointer:
    """Saves and restores ``{state, data, meta}`` under ``directory`` with orbax.

    Args:
      directory: where checkpoints live (created if missing).
      keep: how many recent checkpoints to keep.

    Example:
      >>> import tempfile
      >>> ckpt = Checkpointer(tempfile.mkdtemp(), keep=1)
      >>> ckpt.latest_step() is None
      True
    """

    def __init__(self, directory: str | os.PathLike, keep: int = 2):
        self.directory = os.path.abspath(os.fspath(directory))
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
            item_names=("state", "data", "meta"),
            item_handlers={"data": grain.checkpoint.CheckpointHandler()},
        )

    def latest_step(self) -> int | None:
        """The step of the newest complete checkpoint, or None."""
        return self._manager.latest_step()

    def save(self, step: int, state: Any, data_iterator: Any, meta: dict[str, Any],
             force: bool = False) -> None:
        """Writes a checkpoint for ``step`` (asynchronously; see :meth:`wait`)."""
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=grain.checkpoint.CheckpointSave(data_iterator),
            meta=ocp.args.JsonSave(meta)), force=force)

    def wait(self) -> None:
        """Blocks until pending saves are on disk."""
        self._manager.wait_until_finished()

    def restore(self, abstract_state: Any, data_iterator: Any,
                expected_meta: dict[str, Any]) -> tuple[int, Any]:
        """Restores the newest checkpoint into ``abstract_state``'s structure and shardings.

        ``data_iterator`` is moved to the saved position in place.

        Returns:
          ``(step, state)``.

        Raises:
          CheckpointError: unreadable, partial or from a different run.
        """
        step = self.latest_step()
        where = os.path.join(self.directory, str(step))
        fix = (f"Delete {where} to resume from the previous checkpoint, or start over with "
               "a new --workdir.")
        try:
            meta = self._manager.restore(step, args=ocp.args.Composite(
                meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # orbax raises many types for damaged files
            raise CheckpointError(
                f"The checkpoint at {where} cannot be read ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else 'no detail'}). It is corrupt or was "
                f"only partly written. {fix}") from None
        different = {k: (meta.get(k), v) for k, v in expected_meta.items() if meta.get(k) != v}
        if different:
            detail = "; ".join(f"{k}: checkpoint has {a!r}, this run has {b!r}"
                               for k, (a, b) in different.items())
            raise CheckpointError(
                f"The checkpoint at {where} belongs to a different run ({detail}). Use a new "
                "--workdir for this configuration, or rerun with the checkpoint's settings.")
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state),
                data=grain.checkpoint.CheckpointRestore(data_iterator)))
        except Exception as e:
            raise CheckpointError(
                f"The checkpoint at {where} cannot be restored ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else 'no detail'}). It is corrupt, partly "
                f"written, or its shapes do not match this model. {fix}") from None
        return step, restored["state"]

    def close(self) -> None:
        """Waits for pending saves and releases the manager."""
        self._manager.wait_until_finished()
        self._manager.close()
