"""Accuracy parity: the trainer's embedded-digits run in each precision mode.

Runs ``jamp.train.train_and_evaluate(vit_config(mode), workdir)`` once per mode and Flax
API, one after the other in fresh run directories, and writes one table of test accuracy,
images/s, steps and skipped steps to ``results/accuracy-<platform>-<date>.md`` and ``.json``,
with the ``training.png`` of one run (``--plot-mode``, fp16 by default) beside them.

Usage::

  python -m benchmarks.accuracy                          # 7 modes x linen/NNX, ~1 min each
  python -m benchmarks.accuracy --seeds 0,1,2            # the same, 3 seeds: mean ± std
  python -m benchmarks.accuracy --seeds 0,1,2 --keep results/accuracy-cpu-<date>.json
                                                         # train only the runs it lacks
  python -m benchmarks.accuracy --modes fp16 --set max_steps=2 --set num_layers=1 \\
      --out-dir /tmp/acc                                 # smoke run
"""

from __future__ import annotations

import ast
import json
import math
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import jamp
from benchmarks import common
from jamp.config import vit_config
from jamp.experiment import ConfigError
from jamp.metrics import read_metrics
from jamp.models import sizes
from jamp.train import train_and_evaluate

DEFAULT_MODES = [m for m in jamp.MODES if m != "bf16_pure"] + list(jamp.FP8_MODES)
"""The modes compared by default: ``jamp.MODES`` but the pure-bf16 one, and the fp8 modes."""


def override(text: str) -> tuple[str, Any]:
    """``"key=value"`` as ``(key, value)``, the value a Python literal where it is one.

    Example:
      >>> override("mesh.data=1"), override("dataset=cifar10")
      (('mesh.data', 1), ('dataset', 'cifar10'))
    """
    key, _, value = (part.strip() for part in text.partition("="))
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def _run_mode(mode: str, overrides: dict[str, Any], workdir: Path,
             framework: str = "linen") -> dict[str, Any] | None:
    """Trains one mode in ``workdir``; its row, or None if the trainer refuses the config."""
    config = vit_config(mode)
    config.progress, config.framework = False, framework
    config.update_from_flattened_dict(overrides)
    t0 = time.perf_counter()
    try:
        s = train_and_evaluate(config, str(workdir))
    except ConfigError as e:
        print(f"accuracy: {mode} with {framework} skipped: {str(e).split(':')[0]}", flush=True)
        return None
    except jamp.LossScaleDivergedError as e:  # a result: how far the mode got
        return dict(diverged_row(mode, workdir, str(e), time.perf_counter() - t0),
                    framework=framework)
    return dict(mode=s["mode"], framework=framework, status="ok", model=s["model"],
                **{k: s[k] for k in ("test_accuracy", "test_loss", "images_per_sec", "steps",
                                     "steps_skipped", "final_loss_scale")},
                wall_s=time.perf_counter() - t0, plot=s.get("plot"), seed=s.get("seed"),
                commit=s.get("commit"))


def diverged_row(mode: str, workdir: Path, message: str, wall_s: float) -> dict[str, Any]:
    """The row of a run stopped by the trainer's divergence guard, from its metrics.jsonl."""
    records = read_metrics(str(workdir))
    last = next((r for r in reversed(records) if "train/loss" in r), {})
    evals = [r for r in records if "eval/accuracy" in r] or [{}]
    rates = sorted(r["train/images_per_sec"] for r in records if "train/loss" in r and isinstance(
        r.get("train/images_per_sec"), float) and r["train/images_per_sec"] > 0)
    summary_path = workdir / "summary.json"  # written before the trainer raises
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return dict(mode=jamp.mixed_precision(mode).name,
                status="diverged: " + message.split(":")[0].strip(),
                test_accuracy=evals[-1].get("eval/accuracy"), test_loss=evals[-1].get("eval/loss"),
                images_per_sec=rates[len(rates) // 2] if rates else None,
                steps=last.get("step", 0), steps_skipped=last.get("train/steps_skipped", 0),
                final_loss_scale=last.get("train/loss_scale", float("nan")),
                wall_s=wall_s, plot=None, seed=summary.get("seed"), commit=summary.get("commit"))


def aggregate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (mode, framework) over its seeds: per-seed accuracy and test loss, their
    mean and sample standard deviation (n - 1; 0 for one seed), in the order first seen.

    Example:
      >>> rows = [dict(mode="fp16", framework="linen", seed=s, test_accuracy=a, test_loss=0.2,
      ...              steps_skipped=4, status="ok") for s, a in ((0, 0.96), (1, 0.98))]
      >>> a = aggregate(rows)[0]
      >>> a["seeds"], round(a["accuracy_mean"], 4), round(a["accuracy_std"], 4)
      ([0, 1], 0.97, 0.0141)
      >>> for r in rows:  # diverged runs: NaN losses are left out of the mean, not an error
      ...     r["test_loss"] = float("nan")
      >>> aggregate(rows)[0]["loss_mean"] is None
      True
    """
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["mode"], r.get("framework", "linen")), []).append(r)
    out = []
    for (mode, framework), runs in groups.items():
        finite = lambda xs: [x for x in xs if x is not None and math.isfinite(x)]
        acc = finite(r["test_accuracy"] for r in runs)  # a diverged run's loss is NaN
        loss = finite(r["test_loss"] for r in runs)
        spread = lambda xs: statistics.stdev(xs) if len(xs) > 1 else 0.0
        out.append(dict(
            mode=mode, framework=framework, seeds=[r.get("seed") for r in runs],
            accuracy=[r["test_accuracy"] for r in runs], test_loss=[r["test_loss"] for r in runs],
            accuracy_mean=statistics.fmean(acc) if acc else None,
            accuracy_std=spread(acc) if acc else None,
            loss_mean=statistics.fmean(loss) if loss else None,
            loss_std=spread(loss) if loss else None,
            steps_skipped=[r["steps_skipped"] for r in runs],
            outcomes=sorted({r["status"] for r in runs})))
    return out


def pm(mean: float | None, std: float | None, scale: float = 100.0, spec: str = ".2f") -> str:
    """``mean ± std`` as a table cell (times ``scale``: percent by default).

    Example:
      >>> pm(0.9769, 0.0032), pm(0.172, 0.001, 1, ".3f"), pm(None, None)
      ('97.69 ± 0.32', '0.172 ± 0.001', 'n/a')
    """
    if mean is None:
        return "n/a"
    return f"{scale * mean:{spec}} ± {scale * (std or 0.0):{spec}}"


def seeds_table(aggregated: list[dict[str, Any]]) -> list[str]:
    """The Markdown lines of the per-seed table: accuracy per seed, mean ± std, test loss."""
    seeds = sorted({s for a in aggregated for s in a["seeds"] if s is not None})
    cell = lambda a, s: next((common.fmt(None if x is None else 100 * x, ".2f") for t, x
                              in zip(a["seeds"], a["accuracy"], strict=True) if t == s), "—")
    return common.table(
        "mode | framework | " + " | ".join(f"seed {s}" for s in seeds)
        + " | mean ± std (%) | test loss mean ± std | steps skipped per seed",
        ([a["mode"], a["framework"], *(cell(a, s) for s in seeds),
          pm(a["accuracy_mean"], a["accuracy_std"]),
          pm(a["loss_mean"], a["loss_std"], 1.0, ".3f"),
          " / ".join(map(str, a["steps_skipped"]))] for a in aggregated))


def _to_markdown(result: dict[str, Any]) -> str:
    """The results file: how it was run, then one row per mode."""
    c, rows = result["config"], result["results"]
    joined = lambda key: ", ".join(sorted({str(r.get(key)) for r in rows})) or "unknown"
    same_seed = lambda row: [r for r in rows if r.get("seed") == row.get("seed")]
    lines = [
        "# Accuracy parity across precision modes (embedded digits)", "",
        f"- command: `{result['command']}`",
        f"- reproduce a row exactly: the same command at commit `{joined('commit')}` "
        f"(seed {joined('seed')})",
        f"- date: {result['date']}; device: {result['device']} ({result['machine']['cpus']} "
        f"CPUs, {result['machine']['processor']}); jax {result['jax']}",
        f"- recipe: `jamp.config.vit_config(mode)` ({c['model']}, {c['layers']}, batch "
        f"{c['batch_size']}, {c['num_epochs']} epochs, lr {c['learning_rate']}); "
        f"overrides: {result['overrides'] or 'none'}; runs one after another on a shared "
        "machine (images/s are noisy and, on CPU, not a measure of half precision)",
        *(f"- runs kept (`--keep`) from an earlier invocation: `{k}`" for k in sorted(
            {r["kept_command"] for r in rows if r.get("kept_command")})),
        f"- plot: `{result['plot']}` (mode {result['plot_mode']})" if result["plot"] else "", "",
        *common.table("seed | mode | framework | test accuracy | Δ vs fp32 | Δ NNX vs linen "
                      "| test loss | images/s | steps | steps skipped | final loss scale "
                      "| wall s | outcome", (
                          [r.get("seed"), r["mode"], r.get("framework", "linen"),
                           *common.accuracy_cells(r, same_seed(r)),
                           common.nnx_vs_linen(r, same_seed(r)),
                           common.fmt(r["test_loss"], ".4f"),
                           common.fmt(r["images_per_sec"], ",.0f"),
                           r["steps"], r["steps_skipped"], f"{r['final_loss_scale']:g}",
                           f"{r['wall_s']:.0f}", r["status"]] for r in rows))]
    if len({r.get("seed") for r in rows}) > 1:
        seeds = sorted({r.get("seed") for r in rows}, key=str)
        lines += ["", f"## Over seeds {', '.join(map(str, seeds))}", "",
                  "Mean and sample standard deviation (n - 1) of the runs above; the test "
                  "split has 360 images (one image = 0.28 pt).", "",
                  *seeds_table(result["aggregate"])]
    if any(r["status"] != "ok" for r in rows):
        lines += ["", "Diverged runs were stopped by the trainer's divergence guard (the loss "
                  "scale at its minimum and every step skipped); their accuracy is the last "
                  "evaluation before the stop."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs every mode; writes the .md/.json (and the plot) to ``--out-dir``."""
    ap = common.parser(__doc__)
    ap.add_argument("--modes", type=common.modes, default=DEFAULT_MODES)
    ap.add_argument("--frameworks", type=common.split, default=["linen", "nnx"],
                    help="the ViT's Flax API(s) to train: linen, nnx or both (default)")
    ap.add_argument("--set", type=override, action="append", default=[], metavar="KEY=VALUE",
                    help="override a config field, e.g. max_steps=2 or mesh.data=1 (repeatable)")
    ap.add_argument("--plot-mode", default="fp16", help="whose training.png to keep")
    ap.add_argument("--seeds", type=lambda t: [int(s) for s in common.split(t)], default=None,
                    help="train every mode once per seed (e.g. 0,1,2) and add mean ± std per "
                         "mode and framework; the results are rewritten after each run "
                         "(default: the recipe's seed, or --set seed=N)")
    ap.add_argument("--keep", action="append", default=[], metavar="RESULTS_JSON",
                    help="an earlier results file of this benchmark: its runs are kept (with "
                         "the commit they name) and not trained again (repeatable)")
    args = ap.parse_args(argv)
    overrides = dict(args.set)
    if args.seeds is not None and "seed" in overrides:
        ap.error("give the seed once: --seeds or --set seed=N, not both")
    head = common.header("accuracy", argv)
    stem = common.results_stem(args.out_dir, "accuracy", head["platform"])
    seeds = args.seeds or [overrides.get("seed", vit_config("fp32").seed)]
    rows, plot = kept_runs(args.keep), None
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="jamp-accuracy-") as tmp:
        for seed in seeds:
            seeded = dict(overrides, seed=seed) if args.seeds else overrides
            for framework, mode in ((f, m) for f in args.frameworks for m in args.modes):
                if any((r.get("seed"), r.get("framework", "linen")) == (seed, framework)
                       and r["mode"] == jamp.mixed_precision(mode).name for r in rows):
                    continue  # kept from --keep
                workdir = Path(tmp) / f"seed{seed}" / framework / mode
                if (row := _run_mode(mode, seeded, workdir, framework)) is None:
                    continue
                rows.append(row)
                same_seed = [r for r in rows if r.get("seed") == row.get("seed")]
                print(f"accuracy: seed {row.get('seed')} {mode:<11} {framework:<5} "
                      f"{common.accuracy_cells(row, same_seed)[0]}  "
                      f"loss {common.fmt(row['test_loss'], '.4f')}  "
                      f"{common.fmt(row['images_per_sec'], ',.0f')} img/s  steps {row['steps']} "
                      f"(skipped {row['steps_skipped']})  {row['wall_s']:.0f} s  {row['status']}",
                      flush=True)
                if not args.no_write:  # after each run: a long run leaves what it finished
                    result = _result(head, args, overrides, seeds, plot, rows)
                    common.write_results(stem, result, _to_markdown(result))
            if plot is None and not args.no_write:
                source = next((r["plot"] for r in rows if r["mode"] == args.plot_mode
                               and r["plot"]), None)  # the first seed's, first framework's run
                if source:
                    plot = Path(f"{stem}-{args.plot_mode}-training.png")
                    plot.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(source, plot)
    result = _result(head, args, overrides, seeds, plot, rows)
    if not args.no_write:
        common.write_results(stem, result, _to_markdown(result))
    return result


def kept_runs(paths: list[str]) -> list[dict[str, Any]]:
    """The runs of earlier results files (``--keep``), each marked with the file it came from.

    Example:
      >>> kept_runs([])
      []
    """
    rows = []
    for path in paths:
        try:
            runs = json.loads(Path(path).read_text())["results"]
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"accuracy: --keep {path}: not a results file of this benchmark "
                             f"({e}); give a .json python -m benchmarks.accuracy wrote.") from None
        command = json.loads(Path(path).read_text()).get("command")
        rows += [dict(r, plot=None, kept_from=r.get("kept_from", Path(path).name),
                      kept_command=r.get("kept_command", command))  # a kept file's own keeps
                 for r in runs]
    return rows


def _result(head: dict[str, Any], args: Any, overrides: dict[str, Any], seeds: list[int],
            plot: Path | None, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The results file's content: header, recipe, the runs so far and their aggregate."""
    config = vit_config(args.modes[0] if args.modes else "fp32")
    config.update_from_flattened_dict(overrides)
    runs = [{k: v for k, v in r.items() if k != "plot"} for r in rows]
    return dict(
        **head, overrides=overrides, seeds=seeds, plot_mode=args.plot_mode,
        plot=plot.name if plot else None,
        config=dict(model=sizes.vit_label(config.model, config.patch_size),
                    layers=f"{config.num_layers} layers, width {config.hidden_size}",
                    batch_size=config.batch_size, num_epochs=config.num_epochs,
                    learning_rate=config.learning_rate, dataset=config.dataset),
        results=runs, aggregate=aggregate(runs))


if __name__ == "__main__":
    main()
