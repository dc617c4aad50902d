"""The ViT trainer behind the ``jamp.train`` command (:mod:`jamp.cli`): :func:`train_and_evaluate`.

Builds the experiment once (:mod:`jamp.experiment`), creates the train state sharded
(or restores it and the data position from the newest checkpoint), then loops: the
jitted mesh step, metrics every ``log_every_steps``, evaluation every
``eval_every_epochs``, a checkpoint every ``checkpoint_every_steps``; the run ends
with ``summary.json`` and ``training.png`` (process 0 writes them).

The run directory: ``config.json`` (the resolved config, written at each start),
``metrics.jsonl`` and ``tensorboard/`` (a resumed run drops what was logged after its
checkpoint, so no step appears twice), ``checkpoints/``, ``summary.json`` (its
``outcome`` is ``"completed"`` or ``"diverged"``) and ``training.png``. A workdir
whose run already finished is left as it is: its summary is returned. A workdir that
is a file or cannot be written is a :class:`~jamp.experiment.ConfigError` before
anything is written. The progress bar's ETA counts steps after the first (compiling)
one.

The loop's pieces can be used by hand: ``build_experiment(config)``, then under
``jax.set_mesh(exp.mesh)`` ``state_shardings``/``init_state``, and under the
logical axis rules ``jit_train_step(exp, shardings)(state, batch, rng)``,
``step_memory_report(exp, state)`` and ``evaluate(exp, state, p_eval)``
(``tests/test_train.py`` and ``tests/test_parallel.py`` run them).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.training import train_state
from tqdm import tqdm

from jamp import data, parallel
from jamp.checkpoint import Checkpointer
from jamp.experiment import (
    Config,
    ConfigError,
    Experiment,
    build_experiment,
    init_state,
    model_dims,
    state_shardings,
)
from jamp.loss_scale import LossScaleDivergedError, loss_scale, overflow_stats
from jamp.memory import MemoryReport, memory_report
from jamp.metrics import (
    MetricsWriter,
    json_safe,
    label_smoothing_floor,
    plot_run,
    read_metrics,
)
from jamp.step import (
    ValueAndGrad,
    cross_entropy,
    differentiated_variables,
    eval_step,
    train_step,
)

# ----------------------------------------------------------------------------- the step


def mesh_value_and_grad(exp: Experiment, shardings: Any) -> ValueAndGrad:
    """The gradient function of the train step on ``exp.mesh`` (:mod:`jamp.parallel.step`).

    Example: see the module docstring (:func:`jit_train_step` steps with it).
    """
    spec = lambda tree: jax.tree_util.tree_map(lambda s: s.spec, tree)
    param_specs = spec(shardings.params)
    extras = differentiated_variables(shardings)  # e.g. the fp8 state, beside the params
    if extras:  # jamp.train_step differentiates (params, extras)
        param_specs = (param_specs, spec(extras))
    return parallel.step.value_and_grad(param_specs, pipelined=exp.pipeline is not None)


def jit_train_step(exp: Experiment, shardings: Any) -> Callable:
    """``step(state, batch, rng) -> (state, metrics)``: the jitted data/tensor/pipeline step.

    Call it under ``jax.set_mesh(exp.mesh)`` and ``nn.logical_axis_rules(
    parallel.LOGICAL_AXIS_RULES)``; the state argument is donated.

    Example: see the module docstring.
    """
    value_and_grad = mesh_value_and_grad(exp, shardings)
    smoothing = exp.config.label_smoothing
    return jax.jit(
        lambda s, b, r: train_step(s, b, r, smoothing, value_and_grad),
        in_shardings=(shardings, parallel.batch_sharding(exp.mesh), None),
        out_shardings=(shardings, None), donate_argnums=(0,))


# ----------------------------------------------------------------------------- running


def _global_batch(exp: Experiment, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    sharding = parallel.batch_sharding(exp.mesh)
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}


def evaluate(exp: Experiment, state: train_state.TrainState, p_eval: Callable
             ) -> dict[str, float]:
    """Loss and accuracy on the test split (every example exactly once).

    Example: see the module docstring.
    """
    c, totals = exp.config, np.zeros(3)
    for batch in data.eval_batches(exp.info, data_dir=c.data_dir, image_size=c.image_size,
                                   global_batch_size=c.batch_size,
                                   process_index=jax.process_index(),
                                   process_count=jax.process_count()):
        m = p_eval(state, _global_batch(exp, batch))
        totals += np.array([m["loss_sum"], m["correct"], m["count"]])
    count = max(totals[2], 1.0)
    return {"eval/loss": totals[0] / count, "eval/accuracy": totals[1] / count}


def step_memory_report(exp: Experiment, state: train_state.TrainState) -> MemoryReport:
    """JAX-level bytes of one training step per device-batch (params, grads, state, residuals).

    Example: see the module docstring.
    """
    per_device = exp.config.batch_size // exp.mesh.shape["data"]
    images = jax.ShapeDtypeStruct((per_device, exp.config.image_size, exp.config.image_size,
                                   exp.info.image_shape[-1]), jnp.float32)
    labels = jax.ShapeDtypeStruct((per_device,), jnp.int32)

    collections = differentiated_variables(state)  # e.g. mode "fp8": delayed-scaling state

    def loss_fn(params, x, y):
        logits = state.apply_fn({"params": params, **collections}, x, train=True,
                                 rngs={"dropout": jax.random.key(0)})
        return cross_entropy(logits, y)

    abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                      state.params)
    model_state = state.extra_state() if collections else None
    return memory_report(loss_fn, abstract, images, labels, opt_state=state.opt_state,
                         model_state=model_state)


@dataclasses.dataclass
class _Run:
    """What the loop works with besides the train state."""

    exp: Experiment
    train_step: Callable
    eval_step: Callable
    iterator: Iterator  # grain's checkpointable iterator
    ckpt: Checkpointer
    writer: MetricsWriter
    progress: tqdm
    rng: jax.Array
    workdir: str
    start: int = 0
    diverged_at: int | None = None  # the step the divergence guard stopped the run at
    non_finite_at: int | None = None  # first step whose loss was NaN/inf (no loss scale)


class _Throughput:
    """Images/s per logging window; the first step (it compiles) starts the clock."""

    def __init__(self):
        self.start, self.images, self.rates = None, 0, []

    def count(self, metrics: dict[str, jax.Array], images: int) -> None:
        if self.start is None:
            jax.block_until_ready(metrics)
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


def _run_meta(exp: Experiment) -> dict[str, Any]:
    c = exp.config
    return {"mode": exp.precision.name, "dataset": c.dataset, "model": c.model,
            "framework": c.framework, "patch_size": c.patch_size, "image_size": c.image_size,
            "batch_size": c.batch_size, "seed": c.seed, "optimizer": c.optimizer,
            **model_dims(c)}


class NonFiniteLossError(LossScaleDivergedError):
    """The train loss became NaN/inf in a mode whose loss scale skips nothing (kind 'none').

    bf16, fp32 and fp8 apply every update, so a non-finite loss (and gradient) has
    made the parameters non-finite: the trainer stops at the next log or checkpoint
    step, keeps no checkpoint from after it, and exits with status 3 like a diverged
    loss scale (it is one: ``except LossScaleDivergedError`` catches both).
    """


class UnsafeModeWarning(UserWarning):
    """The precision mode is known to lose updates or diverge (``fp16_pure``)."""


def check_workdir(workdir: str) -> None:
    """Raises a :class:`~jamp.experiment.ConfigError` if ``workdir`` cannot hold a run.

    Writes nothing: the directory (or its nearest existing parent) must be a
    writable directory.

    Example:
      >>> import tempfile
      >>> check_workdir(tempfile.mkdtemp() + "/new/run")   # created later, by the run
      >>> try:
      ...     check_workdir(tempfile.mkstemp()[1])
      ... except ConfigError as e:
      ...     print(str(e).split(": ")[1].split(".")[0])
      it is a file, not a directory
    """
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ConfigError(f"--workdir={workdir}: it is a file, not a directory. Pass a "
                          "directory (it is created if missing), e.g. --workdir runs/my_run.")
    parent = workdir
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"--workdir={workdir} cannot be created: {parent} is a file. "
                          "Pass a path under a directory, e.g. --workdir runs/my_run.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"--workdir={workdir} cannot be written: {parent} is read-only for "
                          "this user. Pass a directory you can write to, e.g. --workdir "
                          "runs/my_run (a relative path is under the current directory).")


def _finished_summary(exp: Experiment, workdir: str) -> dict[str, Any] | None:
    """The saved summary when ``workdir`` holds this run, completed; None to train."""
    ckpt_dir = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(ckpt_dir):
        return None
    ckpt = Checkpointer(ckpt_dir, keep=exp.config.keep_checkpoints)
    try:
        latest = ckpt.latest_step()
        if latest is None:
            return None
        ckpt.check_meta(_run_meta(exp), latest)
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
    if latest == exp.total_steps and summary.get("outcome", "completed") == "completed" and (
            summary.get("steps") == latest):
        return summary
    return None


def _git_commit() -> str | None:
    """The commit of the jamp checkout that runs (with "-dirty" for local changes), if any."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        run = subprocess.run(["git", "-C", root, "describe", "--always", "--dirty",
                              "--abbrev=40"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (run.stdout.strip() or None) if run.returncode == 0 else None


def train_and_evaluate(config: Config, workdir: str) -> dict[str, Any]:
    """Trains and evaluates a ViT as ``config`` says; resumes from ``workdir`` if possible.

    Args:
      config: a config from ``jamp.config.vit_config`` (or a ``configs/*.py`` file).
      workdir: run directory for metrics, checkpoints, summary and plot.

    Returns:
      The run summary (also written to ``workdir/summary.json``): outcome, final test
      accuracy, images/s, memory report, steps skipped, final loss scale, label
      smoothing and the train loss's floor, seed and commit. When ``workdir`` holds
      this run already completed, its saved summary (nothing is trained or written).

    Raises:
      ConfigError, DatasetNotFoundError, CheckpointError: with a message that names
        the fix, before anything is written to ``workdir``.
      LossScaleDivergedError: the divergence guard stopped the run; ``summary.json``
        (outcome ``"diverged"``, the step, the loss-scale history) and the plot are
        written first. Its subclass :class:`NonFiniteLossError`: the loss went NaN/inf
        in a mode without loss scaling (``non_finite_at_step`` in the summary).

    Example: ``train_and_evaluate(vit_config("fp16"), "runs/vit_fp16")["test_accuracy"]``
    trains the embedded digits (about a minute on 2 CPU cores); the notebook
    ``notebooks/02_vit_training.py`` compares modes with it.
    """
    workdir, exp = os.path.abspath(workdir), build_experiment(config)
    is_main = jax.process_index() == 0
    check_workdir(workdir)
    finished = _finished_summary(exp, workdir)
    if finished is not None:
        if is_main:
            accuracy = finished.get("test_accuracy")
            print(f"The run in {workdir} already finished at step {finished['steps']} ("
                  + (f"test accuracy {100 * accuracy:.2f}%; " if accuracy is not None else "")
                  + f"{os.path.join(workdir, 'summary.json')}). Nothing to do: raise "
                  "--config.max_steps or --config.num_epochs to train further, or use a new "
                  "--workdir.", flush=True)
        return finished
    mp = exp.precision
    if mp.policy.param_dtype == jnp.float16 and not mp.master_weights:
        warnings.warn(
            f"mode {mp.name} keeps parameters and optimizer state in float16 without fp32 "
            "master weights: small gradients underflow, updates below float16's resolution "
            "are lost, and runs often diverge (the digits benchmark stops at step 70). Use it "
            "for speed baselines only; --config.mode=fp16 trains with fp32 master weights.",
            UnsafeModeWarning, stacklevel=2)
    with jax.set_mesh(exp.mesh):
        run, state = _start(exp, workdir, is_main)
    try:
        with jax.set_mesh(exp.mesh), nn.logical_axis_rules(parallel.LOGICAL_AXIS_RULES):
            memory = step_memory_report(exp, state)
            state, last_eval, rates = _loop(run, state)
            if run.diverged_at is None:
                summary = _finish(run, state, last_eval, rates)
            else:
                run.ckpt.wait()
                summary = _diverged(run, state, last_eval, rates)
            summary["memory"] = memory.as_dict()
    finally:
        run.progress.close()  # ends the bar's line: an error printed next starts on its own
        run.ckpt.close()
        run.writer.close()
    if is_main:
        summary["plot"] = plot_run(
            workdir, label_smoothing=config.label_smoothing, num_classes=exp.info.num_classes,
            title=(f"{summary['model']} {summary['mode']}: diverged at step "
                   f"{summary['steps']}" if run.diverged_at is not None else None),
        ) if config.plot else None
        path = os.path.join(workdir, "summary.json")
        with open(path + ".tmp", "w") as f:  # strict JSON: NaN/inf as strings
            json.dump(json_safe(summary), f, indent=2, allow_nan=False)
        os.replace(path + ".tmp", path)
        print(format_summary(summary, memory), flush=True)
    if run.diverged_at is not None:
        error = LossScaleDivergedError if run.non_finite_at is None else NonFiniteLossError
        raise error(summary["message"])
    return summary


def _start(exp: Experiment, workdir: str, is_main: bool) -> tuple[_Run, train_state.TrainState]:
    """The run's pieces and its state: restored with the data position, or new.

    Runs under the mesh, outside the logical rules: Flax's DenseGeneral reshapes boxed
    kernels at init; the rules apply to the activations in the steps.
    """
    c, rng = exp.config, jax.random.key(exp.config.seed)
    abstract, shardings = state_shardings(exp, rng)
    loader = data.train_loader(
        exp.info, data_dir=c.data_dir, image_size=c.image_size, global_batch_size=c.batch_size,
        seed=c.seed, augment=c.augment, process_index=jax.process_index(),
        process_count=jax.process_count(), worker_count=c.worker_count)
    p_eval = jax.jit(eval_step, in_shardings=(shardings, parallel.batch_sharding(exp.mesh)))
    iterator = iter(loader)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=c.keep_checkpoints)
    start, state = 0, None
    if ckpt.latest_step() is not None:
        try:
            start, state = ckpt.restore(abstract, iterator, _run_meta(exp))
        except BaseException:
            ckpt.close()
            raise
    if is_main:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(c.to_json_best_effort(indent=2) + "\n")
        if start:
            print(f"Resumed from step {start} ({ckpt.directory}).", file=sys.stderr, flush=True)
    run = _Run(exp, jit_train_step(exp, shardings), p_eval, iterator, ckpt,
               MetricsWriter(workdir, enabled=is_main, resume_step=start),
               tqdm(total=exp.total_steps, initial=start, unit="step", dynamic_ncols=True,
                    file=sys.stderr, mininterval=0.5, disable=not (is_main and c.progress)),
               rng, workdir, start)
    return run, (init_state(exp, rng, shardings) if state is None else state)


def _loop(run: _Run, state: train_state.TrainState
          ) -> tuple[train_state.TrainState, dict[str, float], list[float]]:
    """Steps to ``total_steps``; logs, evaluates and checkpoints on the config's schedule."""
    exp, config = run.exp, run.exp.config
    pending, throughput, last_eval = [], _Throughput(), {}
    for step in range(run.start, exp.total_steps):
        batch = _global_batch(exp, next(run.iterator))
        state, metrics = run.train_step(state, batch, jax.random.fold_in(run.rng, step))
        pending.append(metrics)
        throughput.count(metrics, config.batch_size)
        if step == run.start:  # compiled and ran: the ETA counts the steps from here
            run.progress.unpause()
        done = step + 1
        if done % config.log_every_steps == 0 or done == exp.total_steps:
            _log(run, done, jax.device_get(pending), throughput.lap())
            pending = []
            if run.diverged_at is not None:
                break
        if done % config.checkpoint_every_steps == 0 and pending:
            _check_finite(run, done, jax.device_get(pending))  # before saving this state
            if run.diverged_at is not None:
                break
        epoch, rest = divmod(done, exp.steps_per_epoch)
        if not rest and epoch % config.eval_every_epochs == 0:
            last_eval = evaluate(exp, state, run.eval_step)
            run.writer.write(done, {**last_eval, "epoch": epoch})
        if done % config.checkpoint_every_steps == 0:
            run.ckpt.save(done, state, run.iterator, _run_meta(exp))
    return state, last_eval, throughput.rates


def _log(run: _Run, done: int, fetched: list[dict[str, Any]], rate: float | None) -> None:
    """One metrics line for the ``fetched`` steps; marks a run whose loss scale diverged."""
    record = {
        "train/loss": float(np.mean([m["loss"] for m in fetched])),
        "train/accuracy": float(np.mean([m["accuracy"] for m in fetched])),
        "train/loss_scale": float(fetched[-1]["loss_scale"]),
        "train/steps_skipped": int(fetched[-1]["steps_skipped"]),
        "train/images_per_sec": rate,
    }
    run.writer.write(done, record)
    run.progress.set_postfix(loss=f"{record['train/loss']:.3f}",
                             img_s="n/a" if rate is None else f"{rate:.0f}",
                             scale=f"{record['train/loss_scale']:g}",
                             skipped=record["train/steps_skipped"], refresh=False)
    run.progress.update(len(fetched))
    if any(bool(m["diverged"]) for m in fetched):
        run.diverged_at = done
    _check_finite(run, done, fetched)


def _check_finite(run: _Run, done: int, fetched: list[dict[str, Any]]) -> None:
    """Stops a run whose loss went NaN/inf where no loss scale skips the step (mode bf16...)."""
    if run.exp.precision.loss_scale.kind != "none" or run.diverged_at is not None:
        return
    bad = [i for i, m in enumerate(fetched) if not np.isfinite(float(m["loss"]))]
    if bad:
        run.non_finite_at = done - len(fetched) + bad[0] + 1
        run.diverged_at = done


def _diverged(run: _Run, state: train_state.TrainState, last_eval: dict[str, float],
              rates: list[float]) -> dict[str, Any]:
    """The summary of a run the divergence guard stopped, with the message to raise."""
    exp, done = run.exp, run.diverged_at
    summary = _summary(run, state, last_eval, rates, done, outcome="diverged")
    history = [[r["step"], r["train/loss_scale"]] for r in read_metrics(run.workdir)
               if "train/loss_scale" in r]
    saved = [s for s in run.ckpt.all_steps() if s <= done]
    if saved:
        where = (f"Rerunning the command resumes from the newest checkpoint (step {saved[-1]}, "
                 f"{os.path.join(run.ckpt.directory, str(saved[-1]))}); a new --workdir starts "
                 "over.")
    else:
        where = (f"No checkpoint was written (the first was due at step "
                 f"{exp.config.checkpoint_every_steps}), so a rerun starts from step 0.")
    if run.non_finite_at is not None:
        bad, mode = run.non_finite_at, exp.precision.name
        message = (
            f"Training stopped at step {done}: the train loss became non-finite (NaN/inf) at "
            f"step {bad}. Mode {mode} has no loss scale that skips such steps, so that update "
            "made the parameters non-finite. Lower --config.learning_rate, check the input "
            "data, or add a scale that skips them: --config.loss_scale.kind=dynamic. "
            f"{where} The losses are in {os.path.join(run.workdir, 'metrics.jsonl')}.")
        evals = [r["step"] for r in read_metrics(run.workdir) if "eval/accuracy" in r]
        return {**summary, "evaluated_at_step": evals[-1] if evals else None,
                "non_finite_at_step": bad, "checkpoint_step": saved[-1] if saved else None,
                "message": message}
    message = (
        f"Training stopped at step {done}: the loss scale sits at its minimum "
        f"({summary['final_loss_scale']:g}) and the gradients have overflowed for "
        f"{exp.precision.loss_scale.divergence_steps} steps in a row, so every step is being "
        "skipped. The model has diverged (or the data holds NaN/inf). Lower "
        "--config.learning_rate, use --config.mode=bf16, or check the input data. "
        f"{where} The loss-scale history is in {os.path.join(run.workdir, 'summary.json')}"
        + (" and training.png." if exp.config.plot else "."))
    evals = [r["step"] for r in read_metrics(run.workdir) if "eval/accuracy" in r]
    return {**summary, "evaluated_at_step": evals[-1] if evals else None,
            "loss_scale_history": history, "checkpoint_step": (
        saved[-1] if saved else None), "message": message}


def _finish(run: _Run, state: train_state.TrainState, last_eval: dict[str, float],
            rates: list[float]) -> dict[str, Any]:
    """The final evaluation and checkpoint (unless the loop just made them); the summary."""
    exp, done = run.exp, run.exp.total_steps
    if not last_eval or done % exp.steps_per_epoch:
        last_eval = evaluate(exp, state, run.eval_step)
        logged = run.start == done and any(  # resumed from the final checkpoint
            r["step"] == done and "eval/accuracy" in r for r in read_metrics(run.workdir))
        if not logged:
            run.writer.write(done, last_eval)
    if run.ckpt.latest_step() != done:
        run.ckpt.save(done, state, run.iterator, _run_meta(exp), force=True)
    run.ckpt.wait()
    return _summary(run, state, last_eval, rates, done, outcome="completed")


def _summary(run: _Run, state: train_state.TrainState, last_eval: dict[str, float],
             rates: list[float], done: int, outcome: str) -> dict[str, Any]:
    exp, c = run.exp, run.exp.config
    stats = jax.device_get(overflow_stats(state.opt_state))
    return {
        "outcome": outcome,
        "mode": exp.precision.name,
        "dataset": c.dataset,
        "model": f"ViT-{c.model}/{c.patch_size}",
        "framework": c.framework,
        "steps": done,
        "start_step": run.start,
        "test_accuracy": float(last_eval["eval/accuracy"]) if last_eval else None,
        "test_loss": float(last_eval["eval/loss"]) if last_eval else None,
        "images_per_sec": float(np.median(rates)) if rates else None,
        "steps_skipped": int(stats.steps_skipped),
        "final_loss_scale": float(jax.device_get(loss_scale(state.opt_state))),
        "label_smoothing": float(c.label_smoothing),
        "train_loss_floor": label_smoothing_floor(c.label_smoothing, exp.info.num_classes),
        "devices": exp.mesh.devices.size,
        "mesh": dict(exp.mesh.shape),
        "pipeline_bubble": exp.pipeline.bubble_fraction if exp.pipeline else 0.0,
        "param_norm": float(jax.device_get(_param_norm(state.params))),
        "seed": c.seed,
        "commit": _git_commit(),
        "config": os.path.join(run.workdir, "config.json"),
    }


@jax.jit
def _param_norm(params: Any) -> jax.Array:
    """Global L2 norm of the parameters in float32 (a cheap checksum of the final model)."""
    leaves = jax.tree_util.tree_leaves(params)
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))


def format_summary(summary: dict[str, Any], memory: MemoryReport) -> str:
    """A human-readable end-of-run summary (printed by :func:`train_and_evaluate`).

    Example:
      >>> from jamp.memory import MemoryReport
      >>> summary = {"outcome": "completed", "model": "ViT-ti/2", "dataset": "digits",
      ...            "mode": "fp16", "test_accuracy": 0.98, "test_loss": 0.07, "steps": 1100,
      ...            "steps_skipped": 1, "final_loss_scale": 32768.0, "images_per_sec": 900.0,
      ...            "devices": 1, "mesh": {"data": 1, "model": 1, "pipe": 1},
      ...            "label_smoothing": 0.1, "train_loss_floor": 0.5}
      >>> print(format_summary(summary, MemoryReport(0, 0, 0, 0, 0)))  # doctest: +ELLIPSIS
      == jamp.train summary: ViT-ti/2 on digits, mode fp16 ==
      test accuracy   98.00%  (loss 0.0700)
      train loss      includes label smoothing 0.1 (floor 0.50); the test loss does not
      steps           1100 (skipped 1, final loss scale 32768)
      ...
    """
    ips, accuracy = summary["images_per_sec"], summary.get("test_accuracy")
    lines = [f"== jamp.train summary: {summary['model']} on {summary['dataset']}, "
             f"mode {summary['mode']} =="]
    if summary.get("outcome") == "diverged":
        lines.append(f"outcome         DIVERGED at step {summary['steps']} (the loss scale sat "
                     "at its minimum and every step overflowed)")
    lines.append("test accuracy   " + (
        f"{100 * accuracy:.2f}%  (loss {summary['test_loss']:.4f})" if accuracy is not None
        else "not evaluated") + (f", at step {summary['evaluated_at_step']}"
                                 if summary.get("evaluated_at_step") is not None else ""))
    if summary.get("label_smoothing"):
        lines.append(f"train loss      includes label smoothing {summary['label_smoothing']:g} "
                     f"(floor {summary['train_loss_floor']:.2f}); the test loss does not")
    lines += [
        f"steps           {summary['steps']} (skipped {summary['steps_skipped']}, "
        f"final loss scale {summary['final_loss_scale']:g})",
        f"throughput      {'n/a' if ips is None else f'{ips:,.0f} images/s'} "
        f"on {summary['devices']} device(s)",
        "mesh            " + " x ".join(f"{k}={v}" for k, v in summary["mesh"].items())
        + (f" (pipeline bubble {100 * summary['pipeline_bubble']:.0f}%)"
           if summary.get("pipeline_bubble") else ""),
        "memory (per device-batch, JAX-level):",
        *("  " + line for line in str(memory).splitlines()),
    ]
    if summary.get("plot"):
        lines.append(f"plot            {summary['plot']}")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m jamp.train: the jamp.train command
    from jamp import cli

    cli.main()
