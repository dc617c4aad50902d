"""Metrics of a training run: JSONL, TensorBoard, and a PNG plot at the end.

``metrics.jsonl`` is strict JSON: a non-finite value (a NaN loss of a diverging
run) is written as the string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"`` and
read back as a float by :func:`read_metrics`; TensorBoard gets finite values only.

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
from typing import Any

_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


class MetricsWriter:
    """Appends ``{"step": s, **metrics}`` lines to ``metrics.jsonl`` and TensorBoard scalars.

    Only one process (process 0) should write: pass ``enabled=False`` elsewhere.

    Args:
      workdir: the run directory.
      enabled: write anything at all.
    """

    def __init__(self, workdir: str, enabled: bool = True):
        self.enabled = enabled
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._tb = None
        if enabled:
            os.makedirs(workdir, exist_ok=True)
            try:
                from tensorboardX import SummaryWriter

                self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
            except ImportError:  # pragma: no cover - tensorboardX is a dependency
                self._tb = None

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        """Records scalar ``metrics`` at ``step``."""
        if not self.enabled:
            return
        record = {"step": int(step), **{k: _py(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps({k: _json_safe(v) for k, v in record.items()},
                               allow_nan=False) + "\n")
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, int | float) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def close(self) -> None:
        """Flushes and closes TensorBoard."""
        if self._tb is not None:
            self._tb.close()


def _py(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    return value


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    return value


def _from_json(record: dict[str, Any]) -> dict[str, Any]:
    return {k: _NON_FINITE.get(v, v) if isinstance(v, str) else v for k, v in record.items()}


def read_metrics(workdir: str) -> list[dict[str, Any]]:
    """Reads back ``metrics.jsonl`` of a run (missing file: empty list).

    Non-finite values come back as floats (``nan``, ``inf``, ``-inf``).

    Example:
      >>> read_metrics("/nonexistent")
      []
    """
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [_from_json(json.loads(line)) for line in f if line.strip()]


def plot_run(workdir: str, out_path: str | None = None) -> str | None:
    """Plots train/eval loss, accuracy and the loss scale of a run to a PNG.

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
    fig.tight_layout()
    out_path = out_path or os.path.join(workdir, "training.png")
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path
