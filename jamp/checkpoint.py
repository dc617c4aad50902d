"""Orbax checkpoints of a training run: state, data position and run metadata.

One checkpoint holds the train state (params, optimizer and loss-scale state,
step), the grain iterator position, and JSON metadata (mode, dataset, model)
that must match on resume. A checkpoint that cannot be used gives a
:class:`CheckpointError` whose advice fits the failure: a different run (its
metadata or its array shapes differ from this model's: use the old settings or a
new workdir; deleting the checkpoint would not help, the previous one has the same
shapes) or damaged files (delete that step to resume from the one before). The
messages carry no orbax/TensorStore internals.

Usage (in the trainer): ``ckpt.save(step, state, data_iterator, meta)`` every few
steps, ``ckpt.restore(abstract_state, data_iterator, meta)`` on a rerun; see
:class:`Checkpointer` for a runnable example.
"""

from __future__ import annotations

import os
from typing import Any

import grain
import orbax.checkpoint as ocp
from absl import logging


class CheckpointError(RuntimeError):
    """A checkpoint exists but cannot be used to resume."""


class Checkpointer:
    """Saves and restores ``{state, data, meta}`` under ``directory`` with orbax.

    Args:
      directory: where checkpoints live (created if missing).
      keep: how many recent checkpoints to keep.

    Example:
      >>> import tempfile, grain, jax.numpy as jnp
      >>> ckpt = Checkpointer(tempfile.mkdtemp(), keep=2)
      >>> ckpt.latest_step() is None
      True
      >>> data = iter(grain.MapDataset.range(8).to_iter_dataset())
      >>> ckpt.save(5, {"w": jnp.ones(2)}, data, {"mode": "fp16"})
      >>> ckpt.wait()
      >>> ckpt.all_steps(), ckpt.read_meta()
      ([5], {'mode': 'fp16'})
      >>> try:
      ...     ckpt.check_meta({"mode": "bf16"})
      ... except CheckpointError as e:
      ...     print(str(e).split("(")[1].split(")")[0])
      mode: checkpoint has 'fp16', this run has 'bf16'
      >>> ckpt.close()
    """

    def __init__(self, directory: str | os.PathLike, keep: int = 2):
        self.directory = os.path.abspath(os.fspath(directory))
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
            item_names=("state", "data", "meta"),
            item_handlers={"state": ocp.StandardCheckpointHandler(),
                           "meta": ocp.JsonCheckpointHandler(),
                           "data": grain.checkpoint.CheckpointHandler()},
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

    def all_steps(self) -> list[int]:
        """The steps of the complete checkpoints, oldest first."""
        return sorted(self._manager.all_steps())

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        """The run metadata saved with ``step`` (default: the newest checkpoint).

        Raises:
          CheckpointError: the checkpoint's files cannot be read.
        """
        step = self.latest_step() if step is None else step
        try:
            return self._manager.restore(step, args=ocp.args.Composite(
                meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # orbax raises many types for damaged files
            raise self._damaged(step, e) from None

    def check_meta(self, expected_meta: dict[str, Any], step: int | None = None) -> None:
        """Raises a :class:`CheckpointError` if ``step``'s metadata differs from this run's.

        Keys the checkpoint does not hold (written by an older jamp) are not compared.
        """
        step = self.latest_step() if step is None else step
        meta = self.read_meta(step)
        different = {k: (meta[k], v) for k, v in expected_meta.items()
                     if k in meta and meta[k] != v}
        if different:
            detail = "; ".join(f"{k}: checkpoint has {a!r}, this run has {b!r}"
                               for k, (a, b) in different.items())
            raise CheckpointError(
                f"The checkpoint at {self._where(step)} belongs to a different run ({detail}). "
                f"{self._other_run_fix()}")

    def restore(self, abstract_state: Any, data_iterator: Any,
                expected_meta: dict[str, Any]) -> tuple[int, Any]:
        """Restores the newest checkpoint into ``abstract_state``'s structure and shardings.

        ``data_iterator`` is moved to the saved position in place.

        Returns:
          ``(step, state)``.

        Raises:
          CheckpointError: from a different run (metadata or array shapes differ) or
            unreadable (damaged or partly written files), with advice for each.
        """
        step = self.latest_step()
        self.check_meta(expected_meta, step)
        self._check_shapes(step, abstract_state)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state),
                data=grain.checkpoint.CheckpointRestore(data_iterator)))
        except Exception as e:
            raise self._damaged(step, e) from None
        return step, restored["state"]

    def _check_shapes(self, step: int, abstract_state: Any) -> None:
        try:
            stored = self._manager.item_metadata(step)["state"]
            stored = ocp.tree.to_flat_dict(getattr(stored, "tree", stored))
        except Exception as e:
            raise self._damaged(step, e) from None
        wanted = ocp.tree.to_flat_dict(abstract_state)
        missing = sorted(set(wanted) - set(stored))
        extra = sorted(set(stored) - set(wanted))
        shapes = [(k, tuple(stored[k].shape), tuple(v.shape)) for k, v in wanted.items()
                  if k in stored and tuple(stored[k].shape) != tuple(v.shape)]
        if not (missing or extra or shapes):
            return
        if shapes:
            path, theirs, ours = shapes[0]
            what = (f"{'/'.join(map(str, path))} has shape {theirs} there and {ours} in this "
                    f"model" + (f" ({len(shapes) - 1} more arrays differ)" if shapes[1:] else ""))
        else:
            what = "its train state has " + ", ".join(
                [f"no {'/'.join(map(str, missing[0]))}"] * bool(missing)
                + [f"an extra {'/'.join(map(str, extra[0]))}"] * bool(extra))
        raise CheckpointError(
            f"The checkpoint at {self._where(step)} was written for a different model or "
            f"optimizer: {what}. The model or optimizer settings changed since this run "
            f"started, and every checkpoint in {self.directory} has the old shapes. "
            f"{self._other_run_fix()}")

    def _where(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def _other_run_fix(self) -> str:
        config = os.path.join(os.path.dirname(self.directory), "config.json")
        saved = f" (saved in {config})" if os.path.exists(config) else ""
        return ("Use a new --workdir for this configuration, or rerun with the settings the "
                f"run was started with{saved} to resume it.")

    def _damaged(self, step: int, error: BaseException) -> CheckpointError:
        """The error for unreadable files; the orbax/TensorStore detail goes to the debug log."""
        logging.debug("Checkpoint %s: %s: %s", self._where(step), type(error).__name__, error)
        earlier = [s for s in self.all_steps() if s < step]
        fix = (f"Delete {self._where(step)} and rerun to resume from the previous checkpoint "
               f"(step {earlier[-1]})" if earlier else
               f"It is the only checkpoint: delete {self.directory} and rerun to start over")
        return CheckpointError(
            f"The checkpoint at {self._where(step)} cannot be read: its files are damaged or "
            f"were only partly written. {fix}, or use a new --workdir.")

    def close(self) -> None:
        """Waits for pending saves and releases the manager."""
        self._manager.wait_until_finished()
        self._manager.close()
