"""What a run reports at its end: ``summary.json``, the printed summary and the plot.

:func:`summarize` gathers a run's outcome (final test accuracy, images/s, steps
skipped, final loss scale, label smoothing and the train loss's floor, mesh, the JAX
backend, device kind and count, seed, commit); :func:`diverged` adds what a run that
the divergence guard stopped needs (the step, the loss-scale history, the newest
checkpoint, the message to raise:
:class:`NonFiniteLossError` where a mode without loss scaling got a NaN/inf loss);
:func:`report` writes ``summary.json`` and ``training.png`` on process 0, prints
:func:`format_summary` and raises for a diverged run. :func:`finished_summary`
finds a workdir whose run already completed. :mod:`jamp.train` calls them.

Example:
  >>> from jamp.memory import MemoryReport
  >>> summary = {"outcome": "completed", "model": "ViT-ti/2", "dataset": "digits",
  ...            "framework": "linen", "mode": "bf16", "test_accuracy": 0.98,
  ...            "test_loss": 0.07, "steps": 1100, "steps_skipped": 0,
  ...            "final_loss_scale": 1.0, "loss_scale_kind": "none", "images_per_sec": None,
  ...            "devices": 1, "mesh": {"data": 1, "model": 1, "pipe": 1}}
  >>> for line in format_summary(summary, MemoryReport(0, 0, 0, 0, 0)).splitlines()[:3]:
  ...     print(line)
  == jamp.train summary: ViT-ti/2 (linen) on digits, mode bf16 ==
  test accuracy   98.00%  (loss 0.0700)
  steps           1100 (no loss scale: none skipped)
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.training import train_state

from jamp.checkpoint import Checkpointer
from jamp.experiment import ConfigError, Experiment
from jamp.loss_scale import LossScaleDivergedError, loss_scale, overflow_stats
from jamp.memory import MemoryReport
from jamp.metrics import json_safe, label_smoothing_floor, plot_run, read_metrics
from jamp.parallel import Hardware


class NonFiniteLossError(LossScaleDivergedError):
    """The train loss became NaN/inf in a mode whose loss scale skips nothing (kind 'none').

    bf16, fp32 and fp8 apply every update, so a non-finite loss (and gradient) has
    made the parameters non-finite: the trainer stops at the next log or checkpoint
    step, keeps no checkpoint from after it, and exits with status 3 like a diverged
    loss scale (it is one: ``except LossScaleDivergedError`` catches both).
    """


def finished_summary(exp: Experiment, workdir: str) -> dict[str, Any] | None:
    """The saved summary when ``workdir`` holds this run, completed; None to train.

    Process 0 prints where the summary is. Raises a ``ConfigError`` when the run in
    ``workdir`` is past this config's steps, a ``CheckpointError`` when its newest
    checkpoint is of another model.

    Example:
      >>> import tempfile
      >>> from jamp.config import vit_config
      >>> from jamp.experiment import build_experiment
      >>> print(finished_summary(build_experiment(vit_config("fp16")), tempfile.mkdtemp()))
      None
    """
    ckpt_dir = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(ckpt_dir):
        return None
    ckpt = Checkpointer(ckpt_dir, keep=exp.config.keep_checkpoints)
    try:
        latest = ckpt.latest_step()
        if latest is None:
            return None
        ckpt.check_meta(exp.meta, latest)
        if latest > exp.total_steps:
            raise ConfigError(
                f"The run in {workdir} is already at step {latest}, past this config's "
                f"{exp.total_steps} steps. Raise --config.max_steps (or --config.num_epochs) "
                "to train it further, or use a new --workdir.")
    finally:
        ckpt.close()
    try:
        with open(os.path.join(workdir, "summary.json")) as f:
            summary = json.load(f)
    except (OSError, ValueError):
        return None
    if not (latest == exp.total_steps and summary.get("steps") == latest
            and summary.get("outcome", "completed") == "completed"):
        return None
    if jax.process_index() == 0:
        accuracy = summary.get("test_accuracy")
        print(f"The run in {workdir} already finished at step {summary['steps']} ("
              + (f"test accuracy {100 * accuracy:.2f}%; " if accuracy is not None else "")
              + f"{os.path.join(workdir, 'summary.json')}). Nothing to do: raise "
              "--config.max_steps or --config.num_epochs to train further, or use a new "
              "--workdir.", flush=True)
    return summary


def summarize(exp: Experiment, state: train_state.TrainState, *, workdir: str, start: int,
              steps: int, last_eval: dict[str, float], rates: list[float]) -> dict[str, Any]:
    """The summary of a run that trained ``start..steps`` (outcome ``"completed"``).

    Example: see :func:`jamp.train.train_and_evaluate`, which returns it.
    """
    c = exp.config
    stats = jax.device_get(overflow_stats(state.opt_state))
    return {
        "outcome": "completed",
        "mode": exp.precision.name,
        "dataset": c.dataset,
        "model": f"ViT-{c.model}/{c.patch_size}",
        "framework": c.framework,
        "steps": steps,
        "start_step": start,
        "test_accuracy": float(last_eval["eval/accuracy"]) if last_eval else None,
        "test_loss": float(last_eval["eval/loss"]) if last_eval else None,
        "images_per_sec": float(np.median(rates)) if rates else None,
        "steps_skipped": int(stats.steps_skipped),
        "final_loss_scale": float(jax.device_get(loss_scale(state.opt_state))),
        "loss_scale_kind": exp.precision.loss_scale.kind,
        "label_smoothing": float(c.label_smoothing),
        "train_loss_floor": label_smoothing_floor(c.label_smoothing, exp.info.num_classes),
        "devices": exp.mesh.devices.size,
        "backend": exp.hardware.backend,  # 'cpu', 'gpu', 'tpu'
        "device_kind": exp.hardware.device_kind,  # e.g. 'NVIDIA H100 80GB HBM3', 'cpu'
        "device_count": exp.hardware.device_count,
        "mesh": dict(exp.mesh.shape),
        "zero_stage": exp.config.zero_stage,
        "pipeline_bubble": exp.pipeline.bubble_fraction if exp.pipeline else 0.0,
        "param_norm": float(jax.device_get(_param_norm(state.params))),
        "seed": c.seed,
        "commit": git_commit(),
        "config": os.path.join(workdir, "config.json"),
    }


def diverged(summary: dict[str, Any], exp: Experiment, *, workdir: str, checkpoints: list[int],
             checkpoint_dir: str, non_finite_at: int | None,
             non_finite_reason: str | None = None) -> dict[str, Any]:
    """``summary`` of a run the divergence guard stopped at ``summary["steps"]``, with the
    message to raise; ``checkpoints`` are the saved steps up to it, ``non_finite_at`` the
    first step whose loss was NaN/inf in a mode without loss scaling (None: the loss
    scale diverged), ``non_finite_reason`` what went NaN/inf there (:mod:`jamp.tensor_stats`).

    Example: ``tests/test_train.py`` stops runs both ways and reads the summaries.
    """
    done, rows = summary["steps"], read_metrics(workdir)
    if checkpoints:
        where = (f"Rerunning the command resumes from the newest checkpoint (step "
                 f"{checkpoints[-1]}, {os.path.join(checkpoint_dir, str(checkpoints[-1]))}); a "
                 "new --workdir starts over.")
    else:
        where = (f"No checkpoint was written (the first was due at step "
                 f"{exp.config.checkpoint_every_steps}), so a rerun starts from step 0.")
    evals = [r["step"] for r in rows if "eval/accuracy" in r]
    summary = {**summary, "outcome": "diverged", "evaluated_at_step": evals[-1] if evals else None}
    if non_finite_at is not None:
        message = (
            f"Training stopped at step {done}: the train loss became non-finite (NaN/inf) at "
            f"step {non_finite_at}"
            + (f" ({non_finite_reason})" if non_finite_reason else "")
            + f". Mode {exp.precision.name} has no loss scale that skips "
            "such steps, so that update made the parameters non-finite. Lower "
            "--config.learning_rate, check the input data, or add a scale that skips them: "
            f"--config.loss_scale.kind=dynamic. {where} The losses are in "
            f"{os.path.join(workdir, 'metrics.jsonl')}.")
        return {**summary, "non_finite_at_step": non_finite_at,
                "non_finite_reason": non_finite_reason,
                "checkpoint_step": checkpoints[-1] if checkpoints else None, "message": message}
    message = (
        f"Training stopped at step {done}: the loss scale sits at its minimum "
        f"({summary['final_loss_scale']:g}) and the gradients have overflowed for "
        f"{exp.precision.loss_scale.divergence_steps} steps in a row, so every step is being "
        "skipped. The model has diverged (or the data holds NaN/inf). Lower "
        "--config.learning_rate, use --config.mode=bf16, or check the input data. "
        f"{where} The loss-scale history is in {os.path.join(workdir, 'summary.json')}"
        + (" and training.png." if exp.config.plot else "."))
    history = [[r["step"], r["train/loss_scale"]] for r in rows if "train/loss_scale" in r]
    return {**summary, "loss_scale_history": history,
            "checkpoint_step": checkpoints[-1] if checkpoints else None, "message": message}


def report(summary: dict[str, Any], memory: MemoryReport, exp: Experiment,
           workdir: str) -> dict[str, Any]:
    """Process 0 writes ``training.png`` and ``summary.json`` and prints the summary.

    Returns the summary with its ``memory`` (and ``plot``); raises the run's
    ``LossScaleDivergedError`` (or :class:`NonFiniteLossError`) if it diverged, after
    writing.

    Example: see :func:`jamp.train.train_and_evaluate`, which returns it.
    """
    summary = {**summary, "memory": memory.as_dict()}
    stopped = summary["outcome"] == "diverged"
    if jax.process_index() == 0:
        title = (f"{summary['model']} {summary['mode']}: diverged at step {summary['steps']}"
                 if stopped else None)
        summary["plot"] = plot_run(
            workdir, label_smoothing=exp.config.label_smoothing,
            num_classes=exp.info.num_classes, title=title) if exp.config.plot else None
        path = os.path.join(workdir, "summary.json")
        with open(path + ".tmp", "w") as f:  # strict JSON: NaN/inf as strings
            json.dump(json_safe(summary), f, indent=2, allow_nan=False)
        os.replace(path + ".tmp", path)
        print(format_summary(summary, memory), flush=True)
    if stopped:
        error = (LossScaleDivergedError if summary.get("non_finite_at_step") is None
                 else NonFiniteLossError)
        raise error(summary["message"])
    return summary


def git_commit() -> str | None:
    """The commit of the jamp checkout that runs (with "-dirty" for local changes), if any.

    Example:
      >>> commit = git_commit()   # None outside a git checkout (e.g. an installed wheel)
      >>> commit is None or len(commit) >= 40
      True
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        run = subprocess.run(["git", "-C", root, "describe", "--always", "--dirty",
                              "--abbrev=40"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (run.stdout.strip() or None) if run.returncode == 0 else None


def hardware_text(summary: dict[str, Any]) -> str:
    """The summary's backend, device kind and count as the progress line shows them
    (:class:`jamp.parallel.Hardware`): ``gpu: NVIDIA H100 80GB HBM3 x1``, ``cpu x8``.

    Example:
      >>> hardware_text({"backend": "gpu", "device_kind": "NVIDIA H100 80GB HBM3",
      ...                "device_count": 1})
      'gpu: NVIDIA H100 80GB HBM3 x1'
    """
    return str(Hardware(summary["backend"], summary["device_kind"], summary["device_count"]))


@jax.jit
def _param_norm(params: Any) -> jax.Array:
    """Global L2 norm of the parameters in float32 (a cheap checksum of the final model)."""
    leaves = jax.tree_util.tree_leaves(params)
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))


def format_summary(summary: dict[str, Any], memory: MemoryReport) -> str:
    """A human-readable end-of-run summary (printed by :func:`report`).

    Example:
      >>> from jamp.memory import MemoryReport
      >>> summary = {"outcome": "completed", "model": "ViT-ti/2", "framework": "linen",
      ...            "dataset": "digits", "mode": "fp16", "test_accuracy": 0.98,
      ...            "test_loss": 0.07, "steps": 1100, "steps_skipped": 1,
      ...            "final_loss_scale": 32768.0, "loss_scale_kind": "dynamic",
      ...            "images_per_sec": 900.0, "devices": 1,
      ...            "mesh": {"data": 1, "model": 1, "pipe": 1},
      ...            "label_smoothing": 0.1, "train_loss_floor": 0.5}
      >>> print(format_summary(summary, MemoryReport(0, 0, 0, 0, 0)))  # doctest: +ELLIPSIS
      == jamp.train summary: ViT-ti/2 (linen) on digits, mode fp16 ==
      test accuracy   98.00%  (loss 0.0700)
      train loss      includes label smoothing 0.1 (floor 0.50); the test loss does not
      steps           1100 (skipped 1, final loss scale 32768)
      ...
    """
    ips, accuracy = summary["images_per_sec"], summary.get("test_accuracy")
    framework = f" ({summary['framework']})" if summary.get("framework") else ""
    lines = [f"== jamp.train summary: {summary['model']}{framework} on {summary['dataset']}, "
             f"mode {summary['mode']} =="]
    if summary.get("outcome") == "diverged":
        why = ("the loss scale sat at its minimum and every step overflowed"
               if summary.get("non_finite_at_step") is None else
               f"the train loss became NaN/inf at step {summary['non_finite_at_step']}")
        lines.append(f"outcome         DIVERGED at step {summary['steps']} ({why})")
    lines.append("test accuracy   " + (
        f"{100 * accuracy:.2f}%  (loss {summary['test_loss']:.4f})" if accuracy is not None
        else "not evaluated") + (f", at step {summary['evaluated_at_step']}"
                                 if summary.get("evaluated_at_step") is not None else ""))
    if summary.get("label_smoothing"):
        lines.append(f"train loss      includes label smoothing {summary['label_smoothing']:g} "
                     f"(floor {summary['train_loss_floor']:.2f}); the test loss does not")
    scaled = summary.get("loss_scale_kind") != "none"  # bf16, fp32, fp8 apply every step
    lines += [
        f"steps           {summary['steps']} " + (
            f"(skipped {summary['steps_skipped']}, final loss scale "
            f"{summary['final_loss_scale']:g})" if scaled else "(no loss scale: none skipped)"),
        f"throughput      {'n/a' if ips is None else f'{ips:,.0f} images/s'} on "
        + (hardware_text(summary) if summary.get("backend") else
           f"{summary['devices']} device(s)"),
        "mesh            " + " x ".join(f"{k}={v}" for k, v in summary["mesh"].items())
        + (f", ZeRO stage {summary['zero_stage']}" if summary.get("zero_stage") else "")
        + (f" (pipeline bubble {100 * summary['pipeline_bubble']:.0f}%)"
           if summary.get("pipeline_bubble") else ""),
        "memory (per device-batch, JAX-level):",
        *("  " + line for line in str(memory).splitlines()),
    ]
    if summary.get("skip_reasons"):
        lines.append(f"first skip      {summary['skip_reasons'][0]}")
    if summary.get("plot"):
        lines.append(f"plot            {summary['plot']}")
    return "\n".join(lines)
