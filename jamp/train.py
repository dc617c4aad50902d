"""The ViT trainer behind the ``jamp.train`` command (:mod:`jamp.cli`): :func:`train_and_evaluate`.

Builds the experiment once (:mod:`jamp.experiment`), creates the train state sharded
(or restores it and the data position from the newest checkpoint), then loops: the
jitted mesh step, metrics every ``log_every_steps``, evaluation every
``eval_every_epochs``, a checkpoint every ``checkpoint_every_steps``; the run ends
with ``summary.json`` and ``training.png`` (process 0 writes them).

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
import sys
import time
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
from jamp.experiment import Config, Experiment, build_experiment, init_state, state_shardings
from jamp.loss_scale import LossScaleDivergedError, loss_scale, overflow_stats
from jamp.memory import MemoryReport, memory_report
from jamp.metrics import MetricsWriter, plot_run
from jamp.step import ValueAndGrad, cross_entropy, eval_step, train_step

# ----------------------------------------------------------------------------- the step


def mesh_value_and_grad(exp: Experiment, shardings: Any) -> ValueAndGrad:
    """The gradient function of the train step on ``exp.mesh`` (:mod:`jamp.parallel.step`).

    Example: see the module docstring (:func:`jit_train_step` steps with it).
    """
    param_specs = jax.tree_util.tree_map(lambda s: s.spec, shardings.params)
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

    def loss_fn(params, x, y):
        logits = exp.model.apply({"params": params}, x, train=True,
                                 rngs={"dropout": jax.random.key(0)})
        return cross_entropy(logits, y)

    abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                      state.params)
    return memory_report(loss_fn, abstract, images, labels, opt_state=state.opt_state)


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
    start: int = 0


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
            "patch_size": c.patch_size, "image_size": c.image_size,
            "batch_size": c.batch_size, "seed": c.seed}


def train_and_evaluate(config: Config, workdir: str) -> dict[str, Any]:
    """Trains and evaluates a ViT as ``config`` says; resumes from ``workdir`` if possible.

    Args:
      config: a config from ``jamp.config.vit_config`` (or a ``configs/*.py`` file).
      workdir: run directory for metrics, checkpoints, summary and plot.

    Returns:
      The run summary (also written to ``workdir/summary.json``): final test
      accuracy, images/s, memory report, steps skipped, final loss scale, ...

    Raises:
      ConfigError, DatasetNotFoundError, CheckpointError, LossScaleDivergedError:
        with a message that names the fix.

    Example: ``train_and_evaluate(vit_config("fp16"), "runs/vit_fp16")["test_accuracy"]``
    trains the embedded digits (about a minute on 2 CPU cores); the notebook
    ``notebooks/02_vit_training.py`` compares modes with it.
    """
    workdir, exp = os.path.abspath(workdir), build_experiment(config)
    is_main = jax.process_index() == 0
    with jax.set_mesh(exp.mesh):
        run, state = _start(exp, workdir, is_main)
    with jax.set_mesh(exp.mesh), nn.logical_axis_rules(parallel.LOGICAL_AXIS_RULES):
        memory = step_memory_report(exp, state)
        summary = {**_finish(run, *_loop(run, state)), "memory": memory.as_dict()}
        run.progress.close()
        run.ckpt.close()
    run.writer.close()
    if is_main:
        summary["plot"] = plot_run(workdir) if config.plot else None
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print(format_summary(summary, memory), flush=True)
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
    run = _Run(exp, jit_train_step(exp, shardings), p_eval, iter(loader),
               Checkpointer(os.path.join(workdir, "checkpoints"), keep=c.keep_checkpoints),
               MetricsWriter(workdir, enabled=is_main),
               tqdm(total=exp.total_steps, unit="step", dynamic_ncols=True, file=sys.stderr,
                    mininterval=0.5, disable=not (is_main and c.progress)), rng)
    if run.ckpt.latest_step() is None:
        return run, init_state(exp, rng, shardings)
    run.start, state = run.ckpt.restore(abstract, run.iterator, _run_meta(exp))
    run.progress.write(f"Resumed from step {run.start} ({run.ckpt.directory}).")
    sys.stdout.flush()
    run.progress.update(run.start)
    return run, state


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
        done = step + 1
        if done % config.log_every_steps == 0 or done == exp.total_steps:
            _log(run, done, jax.device_get(pending), throughput.lap())
            pending = []
        epoch, rest = divmod(done, exp.steps_per_epoch)
        if not rest and epoch % config.eval_every_epochs == 0:
            last_eval = evaluate(exp, state, run.eval_step)
            run.writer.write(done, {**last_eval, "epoch": epoch})
        if done % config.checkpoint_every_steps == 0:
            run.ckpt.save(done, state, run.iterator, _run_meta(exp))
    return state, last_eval, throughput.rates


def _log(run: _Run, done: int, fetched: list[dict[str, Any]], rate: float | None) -> None:
    """One metrics line for the ``fetched`` steps; stops a run whose loss scale diverged."""
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
        run.ckpt.wait()
        raise LossScaleDivergedError(
            f"Training stopped at step {done}: the loss scale sits at its minimum "
            f"({record['train/loss_scale']:g}) and the gradients have overflowed for "
            f"{run.exp.precision.loss_scale.divergence_steps} steps in a row, so every step "
            "is being skipped. The model has diverged (or the data holds NaN/inf). Lower "
            "--config.learning_rate, use --config.mode=bf16, or check the input data; "
            f"the last good checkpoint is in {run.ckpt.directory}.")


def _finish(run: _Run, state: train_state.TrainState, last_eval: dict[str, float],
            rates: list[float]) -> dict[str, Any]:
    """The final evaluation and checkpoint (unless the loop just made them); the summary."""
    exp, done = run.exp, run.exp.total_steps
    if not last_eval or done % exp.steps_per_epoch:
        last_eval = evaluate(exp, state, run.eval_step)
        run.writer.write(done, last_eval)
    if run.ckpt.latest_step() != done:
        run.ckpt.save(done, state, run.iterator, _run_meta(exp), force=True)
    run.ckpt.wait()
    stats = jax.device_get(overflow_stats(state.opt_state))
    return {
        "mode": exp.precision.name,
        "dataset": exp.config.dataset,
        "model": f"ViT-{exp.config.model}/{exp.config.patch_size}",
        "steps": done,
        "start_step": run.start,
        "test_accuracy": float(last_eval["eval/accuracy"]),
        "test_loss": float(last_eval["eval/loss"]),
        "images_per_sec": float(np.median(rates)) if rates else None,
        "steps_skipped": int(stats.steps_skipped),
        "final_loss_scale": float(jax.device_get(loss_scale(state.opt_state))),
        "devices": exp.mesh.devices.size,
        "mesh": dict(exp.mesh.shape),
        "pipeline_bubble": exp.pipeline.bubble_fraction if exp.pipeline else 0.0,
        "param_norm": float(jax.device_get(_param_norm(state.params))),
    }


@jax.jit
def _param_norm(params: Any) -> jax.Array:
    """Global L2 norm of the parameters in float32 (a cheap checksum of the final model)."""
    leaves = jax.tree_util.tree_leaves(params)
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))


def format_summary(summary: dict[str, Any], memory: MemoryReport) -> str:
    """A human-readable end-of-run summary (printed by :func:`train_and_evaluate`)."""
    ips = summary["images_per_sec"]
    lines = [
        f"== jamp.train summary: {summary['model']} on {summary['dataset']}, "
        f"mode {summary['mode']} ==",
        f"test accuracy   {100 * summary['test_accuracy']:.2f}%  "
        f"(loss {summary['test_loss']:.4f})",
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
