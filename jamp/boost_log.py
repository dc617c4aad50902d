"""What :meth:`jamp.booster.Boosted.log` writes: one step's metrics, as the trainer writes them.

A loop of your own gets the trainer's files (:class:`jamp.metrics.MetricsWriter`) in the
directory given as ``jamp.boost(..., log_dir=...)``:

- ``metrics.jsonl`` and TensorBoard scalars, every call: the step's ``loss``,
  ``loss_scale``, ``steps_skipped``, ``grad_norm`` (``num_zeros_in_grad`` and the loss
  function's own metrics when the step has them), each under ``prefix`` (``train/``: the
  trainer's names);
- a skipped step's reason (:meth:`jamp.booster.Boosted.explain`) as
  ``train/skip_reasons``: ``["step 12 skipped: inf in the gradient of ..."]`` in
  ``metrics.jsonl`` and TensorBoard text; without a loss scale, a non-finite loss's as
  ``train/non_finite_reason``;
- on a step that collected statistics (``jamp.boost(..., tensor_stats=N)``), the
  per-layer table: ``tensor_stats.jsonl``, TensorBoard scalars and log2-amax histograms
  (:meth:`jamp.metrics.MetricsWriter.write_tensor_stats`).

Only what is written leaves the device: the scalars in one ``jax.device_get`` (which waits
for the step to finish: ``Boosted.log`` calls this one call late, when it has); the
statistics only on a collected step, the skip search's result only on a skipped one (or
a non-finite loss).

Example:
  >>> import tempfile, jax.numpy as jnp
  >>> from jamp.metrics import MetricsWriter, read_metrics
  >>> log_dir = tempfile.mkdtemp()
  >>> writer = MetricsWriter(log_dir)
  >>> write_step(writer, 1, {"loss": jnp.float32(0.5), "loss_scale": jnp.float32(1024.0)})
  >>> writer.close()
  >>> read_metrics(log_dir)
  [{'step': 1, 'train/loss': 0.5, 'train/loss_scale': 1024.0}]
"""

from __future__ import annotations

import math
import operator
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jamp import tensor_stats
from jamp.metrics import MetricsWriter

__all__ = ["NOT_WRITTEN", "check_log_dir", "check_metrics", "check_step", "write_step"]

NOT_WRITTEN = frozenset({"skip", "tensor_stats", "tensor_stats_collected", "grad_finite",
                         "skipped", "diverged"})
"""The step's metrics that :func:`write_step` reads but does not write as scalars: the
statistics and skip search (written as a table and a sentence), and the flags that
``steps_skipped`` and the reason already say."""


def check_log_dir(log_dir: str | os.PathLike | None) -> str | None:
    """``log_dir`` as an absolute path, created if missing (on process 0 only); None stays None.

    Raises:
      ValueError: it is a file, or it cannot be created or written (naming the fix).

    Example:
      >>> import os, tempfile
      >>> path = check_log_dir(os.path.join(tempfile.mkdtemp(), "runs", "a"))
      >>> os.path.isdir(path)
      True
    """
    if log_dir is None:
        return None
    if not isinstance(log_dir, str | os.PathLike):
        raise TypeError(f"log_dir={log_dir!r}: pass a directory path (a str), e.g. "
                        "log_dir='runs/my_run', or None to write nothing.")
    path = os.path.abspath(os.fspath(log_dir))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"log_dir={os.fspath(log_dir)!r} is a file, not a directory: pass a "
                         "directory (it is created if missing), e.g. log_dir='runs/my_run'.")
    if jax.process_index() == 0:
        try:
            os.makedirs(path, exist_ok=True)
            if not os.access(path, os.W_OK | os.X_OK):
                raise PermissionError(13, "Permission denied", path)
        except OSError as e:
            where = e.filename if e.filename is not None else path
            raise ValueError(f"log_dir={os.fspath(log_dir)!r} cannot hold the logs: {where}: "
                             f"{e.strerror or e}. Pass a directory you can write to, e.g. "
                             "log_dir='runs/my_run'.") from None
    return path


def check_step(step: Any) -> int:
    """``step`` as an int >= 0, else one error naming the fix.

    Example:
      >>> check_step(3)
      3
    """
    try:
        if isinstance(step, bool):
            raise TypeError
        value = operator.index(step)
    except TypeError:
        raise TypeError(f"step={step!r}: pass the step number as an int, e.g. the loop's "
                        "counter or int(state.step).") from None
    if value < 0:
        raise ValueError(f"step={value}: pass the number of steps done (>= 0), e.g. the "
                         "loop's counter or int(state.step).")
    return value


def check_metrics(metrics: Mapping[str, Any], prefix: str = "train/") -> dict[str, Any]:
    """The entries of a step's ``metrics`` that are written as scalars (all but
    :data:`NOT_WRITTEN`), checked by shape (nothing is fetched); one error naming the fix
    for metrics that are not a mapping of scalars, or a ``prefix`` that is not a string.

    Example:
      >>> sorted(check_metrics({"loss": 1.0, "skipped": False, "tensor_stats": {}}))
      ['loss']
    """
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be the dict a step returned ({{'loss': ...}}); got "
                        f"{type(metrics).__name__}.")
    if not isinstance(prefix, str):
        raise TypeError(f"prefix={prefix!r}: pass a string such as 'train/' or 'eval/'.")
    out = {}
    for key, value in metrics.items():
        if key in NOT_WRITTEN:
            continue
        if isinstance(value, Mapping) or np.ndim(value) != 0:
            shape = "a mapping" if isinstance(value, Mapping) else f"shape {np.shape(value)}"
            raise ValueError(
                f"metrics[{key!r}] has {shape}: Boosted.log writes scalars. Return scalar "
                f"means from loss_fn (e.g. jnp.mean(...)), or pass the metrics without "
                f"{key!r} and write it yourself.")
        out[key] = value
    return out


def write_step(writer: MetricsWriter, step: int, metrics: Mapping[str, Any], *,
               collector: tensor_stats.Collector | None = None,
               shardings: Sequence[Any] | None = None, prefix: str = "train/") -> None:
    """Writes one step's ``metrics`` (a train step's or an eval step's) at ``step``.

    Args:
      writer: where to write (process 0's; see the module docstring for what).
      step: the step number (>= 0).
      metrics: what the step returned, on the device or fetched.
      collector: the step's :class:`jamp.tensor_stats.Collector` (its rows name the
        statistics and the skip's leaf); None: scalars only.
      shardings: the gradient leaves' shardings, to name the devices of a skip's element.
      prefix: put before each name (``"train/"``, ``"eval/"``, ...).

    Example: see the module docstring.
    """
    step = check_step(step)
    scalars = check_metrics(metrics, prefix)
    flags = {k: metrics[k] for k in ("skipped", "tensor_stats_collected") if k in metrics}
    fetched = jax.device_get({**scalars, **flags})
    record: dict[str, Any] = {prefix + k: v for k, v in fetched.items() if k not in flags}
    collected = bool(fetched.get("tensor_stats_collected", False)) and collector is not None
    skipped = bool(fetched.get("skipped", False))
    loss = fetched.get("loss")
    non_finite = loss is not None and not math.isfinite(float(loss))
    if (skipped or non_finite) and "skip" in metrics and collector is not None:
        why = collector.explain({"skip": jax.device_get(metrics["skip"])}, shardings)
    else:
        why = None
    if skipped:
        record[prefix + "skip_reasons"] = [tensor_stats.skip_line(step, why)]
    elif non_finite:
        record[prefix + "non_finite_reason"] = f"step {step}: loss {float(loss)}" + (
            f": {why}" if why else "")
    writer.write(step, record)
    if collected:
        table = tensor_stats.table({"tensor_stats": jax.device_get(metrics["tensor_stats"])},
                                   collector.rows)
        extra = {"loss_scale": float(fetched["loss_scale"])} if "loss_scale" in fetched else {}
        writer.write_tensor_stats(step, table, **extra)
