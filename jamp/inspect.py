"""``jamp.inspect``: a precision doctor. Runs a recipe a few steps per mode and says what to do.

  python -m jamp.inspect --config vit_fp16 --modes fp16,bf16 --steps 8 --out inspect.png
  python -m jamp.inspect --config vit_fp16 --config.num_layers=2 --layer encoder/layers/0

For each candidate mode it trains ``steps`` steps of the recipe (from its initial weights,
on its data) with :mod:`jamp.tensor_stats` collecting every step, then prints:

* a per-layer table: amax (the largest over the steps), headroom in bits to the compute
  dtype's maximum (the smallest; a mode computing in float32 is measured against float16,
  the question being whether float16 would do), the share of gradient elements that
  underflow at the loss scale of the step, and the share of steps on which fp8 delayed
  scaling (a 16-step amax history) would saturate;
* advice: the layers to keep in float32, bf16 or fp16 for this model, the initial loss
  scale that avoids the first overflows, and where fp8 would saturate;
* a heat map (PNG) of log2 amax per layer over the steps (white: all zero, red: inf/NaN),
  with the gradients' underflow.

Bad values (``steps`` <= 0, an unknown statistic or mode, a layer path that matches no
layer) raise ValueError (the CLI: one line, exit 2), and nothing is written.

Example:
  >>> from jamp.config import vit_config
  >>> c = vit_config("fp16")
  >>> c.num_layers, c.hidden_size, c.num_heads, c.mlp_dim, c.batch_size = 1, 16, 2, 32, 16
  >>> c.image_size, c.patch_size = 8, 4
  >>> report = inspect(c, modes=("fp16",), steps=2)  # doctest: +SKIP
  >>> print(report.table("fp16", sort="headroom_bits")); print(report.advice)  # doctest: +SKIP
  >>> report.plot("inspect.png")  # doctest: +SKIP

(Skipped here: it trains; ``tests/test_tensor_stats.py`` runs it.)
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from jamp import tensor_stats

__all__ = ["Inspection", "ModeRun", "inspect", "main"]

FP8_HISTORY = 16  # the delayed-scaling amax history the saturation share assumes
COLUMNS = ("amax", "headroom_bits", "underflow_fraction", "fp8_saturation")


@dataclasses.dataclass
class ModeRun:
    """One mode's steps: per step the statistics table, loss scale and skip reason."""

    mode: str
    compute_dtype: str
    tables: list[dict[str, dict[str, dict[str, float]]]]
    loss_scales: list[float]
    skips: list[str | None]
    init_scale: float

    def series(self, group: str, name: str, stat: str) -> np.ndarray:
        """``stat`` of one row over the steps."""
        return np.array([t.get(group, {}).get(name, {}).get(stat, np.nan) for t in self.tables],
                        np.float64)

    def names(self, group: str) -> list[str]:
        """The group's rows, in the step's order."""
        return list(self.tables[0].get(group, {})) if self.tables else []

    def summary(self, group: str, name: str) -> dict[str, float]:
        """:data:`COLUMNS` of one row over the steps."""
        amax = self.series(group, name, "amax")
        finite = amax[np.isfinite(amax)]
        worst = (np.nan if np.isnan(amax).any() else
                 np.inf if np.isinf(amax).any() else float(finite.max()) if finite.size else 0.0)
        headroom = self.series(group, name, "headroom_bits")
        under = self.series(group, name, "underflow_fraction")
        saturated = [amax[t] > np.max(amax[max(0, t - FP8_HISTORY):t])
                     for t in range(1, len(amax)) if np.isfinite(amax[:t + 1]).all()]
        return {"amax": worst, "headroom_bits": float(np.nanmin(headroom)) if
                (~np.isnan(headroom)).any() else np.nan,
                "underflow_fraction": float(np.nanmean(under)) if group == "grads" and
                (~np.isnan(under)).any() else np.nan,
                "fp8_saturation": float(np.mean(saturated)) if saturated else 0.0}


@dataclasses.dataclass
class Inspection:
    """What :func:`inspect` found: the runs per mode and the advice."""

    runs: dict[str, ModeRun]
    advice: list[str]
    layer: str | None = None

    def table(self, mode: str, sort: str | None = None, limit: int | None = None) -> str:
        """The per-layer table of ``mode`` (sorted by a :data:`COLUMNS` entry, descending
        amax/underflow/saturation, ascending headroom).

        Example: see the module docstring (``print(report.table("fp16"))``).
        """
        run = self.runs[mode]
        if sort is not None and sort not in COLUMNS:
            raise ValueError(f"Unknown statistic {sort!r} to sort by: use one of "
                             f"{', '.join(COLUMNS)}.")
        lines = [f"== {mode} (compute {run.compute_dtype}; {len(run.tables)} steps, "
                 f"{sum(s is not None for s in run.skips)} skipped) ==",
                 f"{'group':<12}{'layer':<52}{'amax':>11}{'headroom':>10}{'underflow':>11}"
                 f"{'fp8 sat':>9}"]
        rows = []
        for group in ("activations", "grads", "params"):
            for name in run.names(group):
                if self.layer and not name.startswith(self.layer):
                    continue
                rows.append((group, name, run.summary(group, name)))
        if sort is not None:
            sign = 1 if sort == "headroom_bits" else -1
            rows.sort(key=lambda r: sign * np.nan_to_num(r[2][sort], nan=-np.inf * sign))
        for group, name, s in rows[:limit]:
            under = "" if math.isnan(s["underflow_fraction"]) else \
                f"{100 * s['underflow_fraction']:.2f}%"
            lines.append(f"{group:<12}{name[-51:]:<52}{s['amax']:>11.3g}"
                         f"{s['headroom_bits']:>10.1f}{under:>11}"
                         f"{100 * s['fp8_saturation']:>8.0f}%")
        return "\n".join(lines)

    def plot(self, path: str) -> str:
        """Writes the heat map of log2 amax per layer over the steps (one panel per mode and
        group) and the gradients' underflow share; returns ``path``.

        Raises:
          ValueError: ``path`` is a directory, its directory does not exist, or its
            extension is not an image format matplotlib writes (``.png``, ``.svg``, ``.pdf``...).

        Example: see the module docstring (``report.plot("inspect.png")``).
        """
        _check_plot_path(path)
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        panels = [(m, g) for m in self.runs for g in ("activations", "grads")
                  if self._names(self.runs[m], g)]
        fig, axes = plt.subplots(1, len(panels) + 1, figsize=(5 * (len(panels) + 1), 8),
                                 squeeze=False)
        for ax, (mode, group) in zip(axes[0], panels, strict=False):
            run, names = self.runs[mode], self._names(self.runs[mode], group)
            grid = np.array([run.series(group, n, "amax") for n in names])
            with np.errstate(divide="ignore", invalid="ignore"):
                image = np.log2(grid)
            im = ax.imshow(np.where(np.isfinite(image), image, np.nan), aspect="auto",
                           cmap="viridis", interpolation="nearest")
            bad = ~np.isfinite(grid)
            if bad.any():  # inf/NaN cells in red
                ax.imshow(np.where(bad, 1.0, np.nan), aspect="auto", cmap="autumn",
                          interpolation="nearest")
            fig.colorbar(im, ax=ax, label="log2 amax")
            step = max(1, len(names) // 40)
            ax.set_yticks(range(0, len(names), step))
            ax.set_yticklabels([n[-40:] for n in names[::step]], fontsize=5)
            ax.set_xlabel("step")
            ax.set_title(f"{mode}: {group} (white: zero, red: inf/NaN)", fontsize=9)
        ax = axes[0][-1]
        for mode, run in self.runs.items():
            names = self._names(run, "grads")
            if names:
                shares = np.nanmean([run.series("grads", n, "underflow_fraction")
                                     for n in names], axis=0)
                ax.plot(range(len(shares)), 100 * shares, marker="o", label=mode)
        ax.set_xlabel("step")
        ax.set_ylabel("gradient elements underflowing at the step's scale (%, mean of layers)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    def _names(self, run: ModeRun, group: str) -> list[str]:
        return [n for n in run.names(group) if not self.layer or n.startswith(self.layer)]


def _check_plot_path(path: str) -> str:
    """``path`` if :meth:`Inspection.plot` can write its picture there; else one clear
    ``ValueError`` naming the fix (checked before any step runs).

    Example:
      >>> _check_plot_path("inspect.svg")
      'inspect.svg'
    """
    from matplotlib.backend_bases import FigureCanvasBase

    name = os.fspath(path)
    where = os.path.dirname(os.path.abspath(name))
    if os.path.isdir(name) or name.endswith(("/", os.sep)):
        raise ValueError(f"--out {name}: that is a directory; give the picture's file name, "
                         f"e.g. {os.path.join(name, 'inspect.png')}.")
    if not os.path.isdir(where):
        raise ValueError(f"--out {name}: the directory {where} does not exist.")
    formats = FigureCanvasBase.get_supported_filetypes()
    extension = os.path.splitext(name)[1].lstrip(".").lower()
    if extension not in formats:
        what = f".{extension} is not an image format" if extension else "no extension"
        raise ValueError(f"--out {name}: {what}; end the name with .png (or one of "
                         f"{', '.join('.' + f for f in sorted(formats))}).")
    return name


def _config(config: Any, overrides: dict[str, Any] | None) -> Any:
    from jamp import configs

    if isinstance(config, str):
        name, _, arg = config.partition(":")
        name = os.path.basename(name).removesuffix(".py")  # configs/vit_fp16.py names it too
        config = configs.get_config(name, arg or None)
    else:
        config = config.copy_and_resolve_references()
    for key, value in (overrides or {}).items():
        target, *path = key.split(".")
        node = config
        for part in [target, *path][:-1]:
            node = node[part]
        node[[target, *path][-1]] = value
    return config


def _check_layer(layer: str | None, rows: dict[str, list[tensor_stats.Row]]) -> None:
    if not layer:
        return
    names = [r.name for group in rows.values() for r in group]
    if not any(n.startswith(layer) for n in names):
        tops = sorted({n.split("/")[0] for n in names})
        raise ValueError(f"No layer path starts with {layer!r}: the model's start with "
                         f"{', '.join(tops[:12])}.")


def _run_mode(config: Any, mode: str, steps: int, layer: str | None = None) -> ModeRun:
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from jamp import data, parallel, train
    from jamp.experiment import build_experiment, init_state, state_shardings

    c = config.copy_and_resolve_references()
    c.mode, c.max_steps, c.progress, c.plot, c.tensor_stats_every = mode, steps, False, False, 1
    exp = build_experiment(c)
    compute = exp.precision.policy.compute_dtype or jnp.float32
    if jnp.dtype(compute) == jnp.float32:  # would float16 do?
        compute = jnp.float16
    collector = tensor_stats.Collector(every=1, compute_dtype=compute,
                                       scanned=("layers",) if c.scan_layers else (),
                                       activations=train.layer_outputs(exp))
    rng = jax.random.key(c.seed)
    with jax.set_mesh(exp.mesh):
        abstract, shardings = state_shardings(exp, rng)
        state = init_state(exp, rng, shardings)
    loader = iter(data.train_loader(
        exp.info, data_dir=c.data_dir, image_size=c.image_size, global_batch_size=c.batch_size,
        seed=c.seed, augment=c.augment, process_index=jax.process_index(),
        process_count=jax.process_count(), worker_count=0))
    tables, scales, skips = [], [], []
    with jax.set_mesh(exp.mesh), nn.logical_axis_rules(parallel.LOGICAL_AXIS_RULES):
        step_fn = train.jit_train_step(exp, shardings, abstract, collector)
        for i in range(steps):
            batch = train._global_batch(exp, next(loader))
            if i == 0:  # traced, not compiled: the rows' names exist, check the layer path
                jax.jit(lambda s, b, r: step_fn(s, b, r)).trace(state, batch, rng)
                _check_layer(layer, collector.rows)
            state, m = step_fn(state, batch, jax.random.fold_in(rng, i))
            m = jax.device_get(m)
            tables.append(tensor_stats.table(m, collector.rows))
            scales.append(float(m["loss_scale"]))
            bad = bool(m["skipped"]) or not np.isfinite(float(m["loss"]))
            skips.append((collector.explain(m) or "non-finite") if bad else None)
    return ModeRun(mode, jnp.dtype(compute).name, tables, scales, skips,
                   float(exp.precision.loss_scale.init_scale or 1.0))


def _advice(runs: dict[str, ModeRun]) -> list[str]:
    advice = []
    f16 = next((r for r in runs.values() if r.compute_dtype == "float16"), None)
    if f16 is not None:
        hot = [n for n in f16.names("activations")
               if f16.summary("activations", n)["headroom_bits"] < 1
               or not np.isfinite(f16.summary("activations", n)["amax"])]
        if hot:
            advice.append("keep in float32 (their outputs come within 1 bit of float16's "
                          f"65504 or overflow): {', '.join(hot[:8])}"
                          + (f" and {len(hot) - 8} more" if len(hot) > 8 else ""))
        else:
            margins = [f16.summary("activations", n)["headroom_bits"]
                       for n in f16.names("activations")]
            if margins:
                advice.append(f"no layer needs float32: the largest layer output is "
                              f"{min(margins):.1f} bits below float16's maximum")
        amaxes = [f16.summary("grads", n)["amax"] for n in f16.names("grads")]
        finite = [a for a in amaxes if np.isfinite(a) and a > 0]
        skipped = sum(s is not None for s in f16.skips)
        if finite:
            g = max(finite)
            safe = 2.0 ** math.floor(math.log2(65504.0 / g) - 1)  # one bit of margin
            advice.append(
                f"initial loss scale {safe:g} (2^{int(math.log2(safe))}) avoids the first "
                f"overflows: the largest unscaled gradient is {g:.3g}; the recipe's "
                f"{f16.init_scale:g} skipped {skipped} of {len(f16.skips)} steps")
        under = [f16.summary("grads", n)["underflow_fraction"] for n in f16.names("grads")]
        mean_under = float(np.nanmean(under)) if under else 0.0
        if hot or skipped == len(f16.skips):
            advice.append("bf16 rather than fp16: float16 overflows in this model's forward "
                          "pass" if hot else "bf16 rather than fp16: every fp16 step "
                          "overflowed")
        elif mean_under > 0.01:
            advice.append(f"bf16, or fp16 with a larger loss scale: {100 * mean_under:.1f}% of "
                          "the gradient elements underflow in float16 at the scale used")
        else:
            advice.append(f"fp16 works for this model ({100 * mean_under:.2f}% of gradient "
                          "elements underflow at the scale used, no layer overflows); bf16 "
                          "works too and needs no loss scale")
    for run in runs.values():
        sat = [n for g in ("activations", "grads") for n in run.names(g)
               if run.summary(g, n)["fp8_saturation"] >= 0.5]
        if sat:
            advice.append(f"fp8 delayed scaling ({FP8_HISTORY}-step amax history) would "
                          f"saturate on half the steps or more in {run.mode} at: "
                          f"{', '.join(sat[:6])}"
                          + (f" and {len(sat) - 6} more" if len(sat) > 6 else "")
                          + " (fp8_current scales each step and does not)")
            break
    return advice


def inspect(config: Any = "vit_fp16", *, modes: Sequence[str] = ("fp16", "bf16"),
            steps: int = 8, layer: str | None = None,
            overrides: dict[str, Any] | None = None) -> Inspection:
    """Runs ``steps`` steps of ``config`` (a recipe name such as ``"vit_fp16"``, or a config)
    in each of ``modes`` with statistics every step; returns the tables and the advice.

    Args:
      config: a recipe of :mod:`jamp.configs` by name (``"vit_fp16"``, ``"vit_fp16:s16,
        cifar10"``) or an ``ml_collections`` config (:func:`jamp.config.vit_config`).
      modes: the candidate precision modes.
      steps: steps per mode (> 0).
      layer: only layers whose path starts with this (must match one).
      overrides: ``{"num_layers": 2, ...}`` set on the config first.

    Raises:
      ValueError: ``steps`` <= 0, an unknown mode or config field, or a ``layer`` that
        matches no layer (its message lists the first few there are).

    Example: see the module docstring.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0:
        raise ValueError(f"steps={steps!r}: use a whole number of steps >= 1, e.g. 8.")
    if not modes:
        raise ValueError("modes is empty: name at least one mode, e.g. fp16,bf16.")
    config = _config(config, overrides)
    runs = {mode: _run_mode(config, mode, steps, layer) for mode in modes}
    return Inspection(runs, _advice(runs), layer)


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def main(argv: Sequence[str] | None = None) -> int:
    """The ``python -m jamp.inspect`` command; returns the exit status (2: bad values).

    Example:
      >>> main(["--config", "vit_fp16", "--steps", "0"])
      2
    """
    parser = argparse.ArgumentParser(prog="python -m jamp.inspect", description=__doc__.split(
        "\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="vit_fp16", help="a recipe (vit_fp16, ...)")
    parser.add_argument("--modes", default="fp16,bf16", help="comma-separated modes")
    parser.add_argument("--steps", type=int, default=8, help="steps per mode (> 0)")
    parser.add_argument("--layer", default=None, help="only layers under this path")
    parser.add_argument("--sort", default="amax", help=f"table order: {', '.join(COLUMNS)}")
    parser.add_argument("--top", type=int, default=40, help="rows per table (0: all)")
    parser.add_argument("--out", default="inspect.png", help="the heat map PNG")
    args, rest = parser.parse_known_args(argv)
    overrides = {}
    for item in rest:
        if not item.startswith("--config.") or "=" not in item:
            print(f"jamp.inspect: error: unknown argument {item!r}; config fields are "
                  "--config.<field>=<value>.", file=sys.stderr)
            return 2
        key, value = item[len("--config."):].split("=", 1)
        overrides[key] = _literal(value)
    try:
        if args.sort not in COLUMNS:
            raise ValueError(f"Unknown statistic {args.sort!r} for --sort: use one of "
                             f"{', '.join(COLUMNS)}.")
        if args.top < 0:
            raise ValueError(f"--top={args.top}: use 0 (all rows) or more.")
        _check_plot_path(args.out)
        modes = list(dict.fromkeys(m.strip() for m in args.modes.split(",") if m.strip()))
        from jamp.policy import mixed_precision
        for mode in modes:
            mixed_precision(mode)  # an unknown mode: its own clear message
        report = inspect(args.config, modes=modes, steps=args.steps, layer=args.layer,
                         overrides=overrides)
    except (ValueError, KeyError, AttributeError, TypeError) as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"jamp.inspect: error: {message}", file=sys.stderr)
        return 2
    for mode in report.runs:
        print(report.table(mode, args.sort, args.top or None))
        print()
    print("advice:")
    for line in report.advice:
        print(f"  - {line}")
    print(f"heat map: {report.plot(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
