"""Metrics of a training run: JSONL, TensorBoard, and a PNG plot at the end.

``metrics.jsonl`` is strict JSON: a non-finite value (a NaN loss of a diverging
run) is written as the string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"`` and
read back as a float by :func:`read_metrics`; TensorBoard gets finite values only
(tensorboardX would warn on each NaN).

A resumed run passes the step it resumes from (``resume_step``): rows logged after
it (a killed run logs past its last checkpoint) are dropped, and the TensorBoard
events are rewritten from the rows kept into one event file, so no step is logged
twice and a run directory holds one event file however often it was resumed.

Example:
  >>> import tempfile
  >>> w = MetricsWriter(tempfile.mkdtemp(), enabled=True)
  >>> w.write(10, {"train/loss": 0.5})
  >>> w.close()
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


class MetricsWriter:
    """Appends ``{"step": s, **metrics}`` lines to ``metrics.jsonl`` and TensorBoard scalars.

    Only one process (process 0) should write: pass ``enabled=False`` elsewhere.

    Args:
      workdir: the run directory.
      enabled: write anything at all.
      resume_step: the step the run (re)starts from: rows after it are dropped and
        the TensorBoard events rewritten from the rest (0: a fresh start, drop all).
        None appends to what is there.

    Example:
      >>> import tempfile
      >>> workdir = tempfile.mkdtemp()
      >>> w = MetricsWriter(workdir)
      >>> for step in (10, 20, 30):
      ...     w.write(step, {"train/loss": 1.0 / step})
      >>> w.close()
      >>> MetricsWriter(workdir, resume_step=20).close()  # a run resumed from step 20
      >>> [r["step"] for r in read_metrics(workdir)]
      [10, 20]
    """

    def __init__(self, workdir: str, enabled: bool = True, resume_step: int | None = None):
        self.enabled = enabled
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._tb = None
        if not enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        kept = None
        if resume_step is not None:
            kept = [r for r in read_metrics(workdir) if r["step"] <= resume_step]
            with open(self.path + ".tmp", "w") as f:
                f.writelines(_line(r) for r in kept)
            os.replace(self.path + ".tmp", self.path)
            _drop_after(os.path.join(workdir, "tensor_stats.jsonl"), resume_step)
        try:
            from tensorboardX import SummaryWriter
        except ImportError:  # pragma: no cover - tensorboardX is a dependency
            return
        tb_dir = os.path.join(workdir, "tensorboard")
        if kept is not None and os.path.isdir(tb_dir):
            for name in os.listdir(tb_dir):
                if name.startswith("events.out.tfevents."):
                    os.remove(os.path.join(tb_dir, name))
        self._tb = SummaryWriter(tb_dir)
        for record in kept or ():
            self._scalars(record)

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        """Records ``metrics`` at ``step``: numbers as scalars, strings (or lists of
        strings) as TensorBoard text."""
        if not self.enabled:
            return
        record = {"step": int(step), **{k: _py(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(_line(record))
        self._scalars(record)

    def write_tensor_stats(self, step: int, table: dict[str, dict[str, dict[str, float]]],
                           **extra: Any) -> None:
        """Appends ``{"step": s, **extra, group: {layer: {statistic: v}}}`` to
        ``tensor_stats.jsonl`` (:func:`jamp.tensor_stats.table`); TensorBoard gets each
        layer's amax and underflow share, each group's worst headroom and non-finite count,
        and a histogram of log2 amax over the group's layers.

        Example:
          >>> import tempfile
          >>> w = MetricsWriter(tempfile.mkdtemp())
          >>> w.write_tensor_stats(1, {"grads": {"w": {"amax": 2.0, "underflow_fraction": 0.0,
          ...                      "headroom_bits": 15.0, "nan_count": 0, "inf_count": 0}}})
          >>> w.close()
        """
        if not self.enabled:
            return
        record = {"step": int(step), **{k: _py(v) for k, v in extra.items()}, **table}
        with open(os.path.join(os.path.dirname(self.path), "tensor_stats.jsonl"), "a") as f:
            f.write(_line(record))
        if self._tb is None:
            return
        import numpy as np

        for group, layers in table.items():
            amax = [v["amax"] for v in layers.values() if math.isfinite(v["amax"]) and v["amax"]]
            if amax:
                self._tb.add_histogram(f"tensor_stats/{group}/log2_amax", np.log2(amax), step)
            headroom = [v["headroom_bits"] for v in layers.values()
                        if math.isfinite(v["headroom_bits"])]
            if headroom:
                self._tb.add_scalar(f"tensor_stats/{group}/min_headroom_bits", min(headroom),
                                    step)
            self._tb.add_scalar(f"tensor_stats/{group}/non_finite", sum(
                v["nan_count"] + v["inf_count"] for v in layers.values()), step)
            for name, v in layers.items():
                for stat in ("amax", "underflow_fraction"):
                    if math.isfinite(v[stat]):
                        self._tb.add_scalar(f"tensor_stats/{group}/{stat}/{name}", v[stat], step)
        self._tb.flush()

    def _scalars(self, record: dict[str, Any]) -> None:
        """TensorBoard: finite numbers as scalars; text (a string, or a list of strings
        such as ``train/skip_reasons``) as TensorBoard text, one paragraph per string."""
        if self._tb is not None:
            for k, v in record.items():
                if k == "step":
                    continue
                if isinstance(v, int | float) and math.isfinite(v):
                    self._tb.add_scalar(k, v, record["step"])
                elif isinstance(v, str) or (isinstance(v, list) and v
                                            and all(isinstance(t, str) for t in v)):
                    self._tb.add_text(k, v if isinstance(v, str) else "\n\n".join(v),
                                      record["step"])
            self._tb.flush()

    def close(self) -> None:
        """Flushes and closes TensorBoard."""
        if self._tb is not None:
            self._tb.close()


class Throughput:
    """Images/s per logging window; the first step (it compiles) only starts the clock.

    Example:
      >>> t = Throughput()
      >>> t.count(64)          # the first (compiling) step: not timed
      >>> t.lap() is None      # nothing timed yet
      True
      >>> t.count(64); t.lap() > 0, len(t.rates)
      (True, 1)
    """

    def __init__(self):
        self.start: float | None = None
        self.images, self.rates = 0, []

    def count(self, images: int) -> None:
        """Counts a finished step's images (call it after the step's results are ready)."""
        if self.start is None:
            self.start = time.perf_counter()
        else:
            self.images += images

    def lap(self) -> float | None:
        """The rate since the last lap (None for the compile-only first window)."""
        rate = self.images / (time.perf_counter() - self.start) if self.images else None
        if rate is not None:
            self.rates.append(rate)
        self.start, self.images = time.perf_counter(), 0
        return rate


def _drop_after(path: str, step: int) -> None:
    """Keeps the rows of the JSONL file ``path`` (if any) logged at or before ``step``."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
        except (ValueError, KeyError, TypeError):  # a line cut short by a killed run
            continue
    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)


def _py(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    return value


def _line(record: dict[str, Any]) -> str:
    return json.dumps(json_safe(record), allow_nan=False) + "\n"


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float, however nested, as ``"NaN"``/``"Infinity"``.

    The convention of ``metrics.jsonl`` and ``summary.json``: strict JSON that any
    parser reads; :func:`read_metrics` turns the strings back into floats.

    Example:
      >>> json_safe({"loss": float("nan"), "history": [[10, float("inf")], [20, 1.0]]})
      {'loss': 'NaN', 'history': [[10, 'Infinity'], [20, 1.0]]}
    """
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def _from_json(record: dict[str, Any]) -> dict[str, Any]:
    return {k: _NON_FINITE.get(v, v) if isinstance(v, str) else v for k, v in record.items()}


def read_metrics(workdir: str) -> list[dict[str, Any]]:
    """Reads back ``metrics.jsonl`` of a run (missing file: empty list).

    Non-finite values come back as floats (``nan``, ``inf``, ``-inf``); a last line
    cut short (a run killed while writing it) is skipped.

    Example:
      >>> read_metrics("/nonexistent")
      []
    """
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(_from_json(json.loads(line)))
        except json.JSONDecodeError:
            if i < len(lines) - 1 or line.endswith("\n"):
                raise
    return records


def label_smoothing_floor(label_smoothing: float, num_classes: int) -> float:
    """The lowest cross-entropy a model can reach against label-smoothed targets.

    The targets put ``1 - s + s/K`` on the label and ``s/K`` on each other class;
    the loss is smallest when the model predicts exactly those, and is then their
    entropy. A train loss that plateaus there has nothing left to learn.

    Example:
      >>> round(label_smoothing_floor(0.1, 10), 3)   # the digits config: train loss >= 0.5
      0.5
      >>> label_smoothing_floor(0.0, 10)
      0.0
    """
    if not label_smoothing:
        return 0.0
    on, off = 1 - label_smoothing + label_smoothing / num_classes, label_smoothing / num_classes
    return float(-on * math.log(on) - (num_classes - 1) * off * math.log(off))


def plot_run(workdir: str, out_path: str | None = None, *, label_smoothing: float = 0.0,
             num_classes: int | None = None, title: str | None = None) -> str | None:
    """Plots train/eval loss, accuracy and the loss scale of a run to a PNG.

    Args:
      workdir: the run directory (its ``metrics.jsonl``).
      out_path: the PNG (default ``workdir/training.png``).
      label_smoothing, num_classes: when the train loss includes label smoothing, the
        loss panel says so and draws the loss's floor (:func:`label_smoothing_floor`);
        the note is also the PNG's ``Description``.
      title: a line above the panels (e.g. "diverged at step 70").

    Returns:
      The PNG path, or None when there is nothing to plot.

    Example:
      >>> plot_run("/nonexistent") is None
      True
    """
    records = read_metrics(workdir)
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(key):
        points = [(r["step"], r[key]) for r in records if key in r and r[key] is not None]
        return zip(*points, strict=True) if points else ((), ())

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for key, label in (("train/loss", "train"), ("eval/loss", "test")):
        axes[0].plot(*series(key), label=label, marker="o" if key.startswith("eval") else None)
    axes[0].set_title("loss")
    note = None
    if label_smoothing:
        note = f"train loss includes label smoothing {label_smoothing:g}"
        if num_classes:
            floor = label_smoothing_floor(label_smoothing, num_classes)
            note += f" (floor {floor:.2f}); test loss has none"
            axes[0].axhline(floor, color="gray", linestyle="--", linewidth=1,
                            label=f"train floor {floor:.2f}")
        axes[0].set_title(f"loss\n({note})", fontsize=10)
    for key, label in (("train/accuracy", "train"), ("eval/accuracy", "test")):
        axes[1].plot(*series(key), label=label, marker="o" if key.startswith("eval") else None)
    axes[1].set_title("accuracy")
    axes[2].plot(*series("train/loss_scale"))
    axes[2].set_yscale("log", base=2)
    axes[2].set_title("loss scale")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend()
    axes[1].legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out_path = out_path or os.path.join(workdir, "training.png")
    fig.savefig(out_path, dpi=100, metadata={"Description": note or "", "Title": title or ""})
    plt.close(fig)
    return out_path
