"""The ViT trainer behind the ``jamp.train`` command (:mod:`jamp.cli`): :func:`train_and_evaluate`.

Builds the experiment once (:mod:`jamp.experiment`), creates the train state sharded
(or restores it and the data position from the newest checkpoint), then loops: the
jitted mesh step, metrics every ``log_every_steps``, evaluation every
``eval_every_epochs``, a checkpoint every ``checkpoint_every_steps`` (and one at the
step where SIGINT or SIGTERM stopped it, :mod:`jamp.preemption`); the run ends
with ``summary.json`` and ``training.png`` (process 0 writes them,
:mod:`jamp.run_summary`).

The run directory: ``config.json`` (the resolved config, written at each start),
``metrics.jsonl`` and ``tensorboard/`` (a resumed run drops what was logged after its
checkpoint, so no step appears twice), ``checkpoints/``, ``summary.json`` (its
``outcome`` is ``"completed"`` or ``"diverged"``) and ``training.png``. A workdir
whose run already finished is left as it is: its summary is returned. The config,
the mesh and the workdir are checked by :func:`jamp.experiment.validate_config` before
anything is built or written. The progress bar names the backend and devices the run is on
(``cpu x8``, ``gpu: NVIDIA H100 80GB HBM3 x1``), and its ETA counts steps after the first
(compiling) one.

The loop's pieces can be used by hand: ``build_experiment(config)``, then under
``jax.set_mesh(exp.mesh)`` ``state_shardings``/``init_state``, and under the
logical axis rules ``jit_train_step(exp, shardings)(state, batch, rng)``,
``step_memory_report(exp, state)`` and ``evaluate(exp, state, p_eval)``
(``tests/test_train.py`` and ``tests/test_parallel.py`` run them).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.training import train_state
from tqdm import tqdm

from jamp import data, parallel, run_summary, tensor_stats
from jamp.apply.nnx import iter_modules
from jamp.booster import assemble_step, gradient_function
from jamp.checkpoint import Checkpointer
from jamp.experiment import (
    Config,
    Experiment,
    build_experiment,
    init_state,
    state_shardings,
    writing_workdir,
    zero_plan,
)
from jamp.memory import MemoryReport, memory_report
from jamp.metrics import MetricsWriter, Throughput, read_metrics
from jamp.parallel import zero
from jamp.preemption import Preempted, StopOnSignal
from jamp.run_summary import NonFiniteLossError  # noqa: F401  (jamp.train.NonFiniteLossError)
from jamp.step import (
    ValueAndGrad,
    classification_loss,
    combined_by_max,
    cross_entropy,
    differentiated_variables,
    eval_step,
)

# ----------------------------------------------------------------------------- the step


def param_specs(exp: Experiment, shardings: Any) -> Any:
    """The differentiated tree's mesh partition specs without 'data' (the pipeline's
    manual 'pipe' splits): the params', and the fp8 state's beside them.

    Example: see the module docstring (:func:`jit_train_step` steps with it).
    """
    spec = lambda tree: jax.tree_util.tree_map(lambda s: zero.without_data(s.spec), tree)
    extras = differentiated_variables(shardings)  # e.g. the fp8 state, beside the params
    return (spec(shardings.params), spec(extras)) if extras else spec(shardings.params)


def mesh_value_and_grad(exp: Experiment, shardings: Any, plan: zero.Plan | None = None
                        ) -> ValueAndGrad:
    """The gradient function of the train step on ``exp.mesh`` (:mod:`jamp.parallel.step`);
    ``plan``: the ZeRO stage's (:func:`jamp.experiment.zero_plan`). The same one
    :func:`jit_train_step` builds (through :func:`jamp.booster.assemble_step`).

    Example: see the module docstring (:func:`jit_train_step` steps with it).
    """
    return gradient_function(mesh=exp.mesh, plan=plan, accumulate=exp.config.grad_accum_steps,
                             max_leaves=combined_by_max(shardings),
                             param_specs=param_specs(exp, shardings),
                             pipelined=exp.pipeline is not None)


def _without_layer_runner(module: nn.Module) -> nn.Module:
    """The ViT (inside its ``jamp.PolicyModule``) with its blocks run by a plain scan."""
    if hasattr(module, "layer_runner"):
        return module.clone(layer_runner=None)
    return module.clone(inner=_without_layer_runner(module.inner))


def layer_outputs(exp: Experiment) -> Callable[..., Any] | None:
    """The :class:`jamp.tensor_stats.Collector`'s ``activations`` for the run's model:
    every layer's output, reduced where the forward pass computes it
    (:func:`jamp.tensor_stats.linen_activations`, or
    :func:`jamp.tensor_stats.nnx_activations` with ``--config.framework=nnx``). In a
    pipeline the same parameters run through a plain scan of the blocks (the model
    without its layer runner), sharded by the compiler, so every layer gets its row.

    Example:
      >>> from jamp.config import vit_config
      >>> from jamp.experiment import build_experiment
      >>> config = vit_config("fp16")
      >>> config.framework = "nnx"
      >>> layer_outputs(build_experiment(config)).__name__
      'nnx_outputs'
    """
    # In a pipeline the statistics' extra forward pass runs outside the pipeline's stages:
    # the model without its layer runner (the parameters are the same), its scan over the
    # 'pipe'-sharded layers partitioned by the compiler.
    pipelined = exp.pipeline is not None
    if exp.config.framework == "nnx":
        def nnx_outputs(state, variables, batch, rng, reduce):
            def capture(model, *args, **kwargs):
                if pipelined:
                    model = nnx.clone(model)
                    for _, module in iter_modules(model):
                        if hasattr(module, "layer_runner"):
                            module.layer_runner = None
                return tensor_stats.nnx_activations(model, *args, reduce=reduce, **kwargs)

            return state.apply_fn(variables, batch["image"], train=True, rngs={"dropout": rng},
                                  method=capture)

        return nnx_outputs
    if pipelined:
        plain = _without_layer_runner(exp.model).apply
        return lambda state, variables, batch, rng, reduce: tensor_stats.linen_activations(
            plain, variables, batch["image"], train=True, rngs={"dropout": rng}, reduce=reduce)
    return lambda state, variables, batch, rng, reduce: tensor_stats.linen_activations(
        state.apply_fn, variables, batch["image"], train=True, rngs={"dropout": rng},
        reduce=reduce)


def stats_collector(exp: Experiment) -> tensor_stats.Collector:
    """The run's :class:`jamp.tensor_stats.Collector`: statistics every
    ``config.tensor_stats_every`` steps (also every layer's output,
    :func:`layer_outputs`), and the reason of every skipped or non-finite step.

    Example:
      >>> from jamp.config import vit_config
      >>> from jamp.experiment import build_experiment
      >>> stats_collector(build_experiment(vit_config("fp16"))).every
      0
    """
    c = exp.config
    activations = layer_outputs(exp) if c.tensor_stats_every else None
    return tensor_stats.Collector(
        every=int(c.tensor_stats_every), compute_dtype=exp.precision.policy.compute_dtype,
        scanned=("layers",) if c.scan_layers else (), activations=activations)


def jit_train_step(exp: Experiment, shardings: Any, abstract: Any = None,
                   collector: tensor_stats.Collector | None = None) -> Callable:
    """``step(state, batch, rng) -> (state, metrics)``: the jitted data/tensor/pipeline step.

    Built by :func:`jamp.booster.assemble_step` (the one place jamp assembles a step, as
    ``jamp.boost`` does) from the experiment: the classification loss, the mesh, the
    ZeRO plan, gradient accumulation and the fp8 state's max-combination.
    Call it under ``jax.set_mesh(exp.mesh)`` and ``nn.logical_axis_rules(
    parallel.LOGICAL_AXIS_RULES)``; the state argument is donated. ``abstract`` is the
    state :func:`~jamp.experiment.state_shardings` returned with ``shardings`` (needed
    for ``config.zero_stage`` > 0; built again when not given). ``collector``: the
    statistics and skip reasons (:func:`stats_collector`; None: none).

    Example: see the module docstring.
    """
    plan = None
    if exp.config.zero_stage:
        if abstract is None:  # built outside the logical rules, as _start builds it
            with nn.logical_axis_rules(()):
                abstract, _ = state_shardings(exp, jax.random.key(exp.config.seed))
        plan = zero_plan(exp, abstract)
    return assemble_step(
        classification_loss(exp.config.label_smoothing), mesh=exp.mesh, shardings=shardings,
        plan=plan, accumulate=exp.config.grad_accum_steps,
        max_leaves=combined_by_max(shardings),
        param_specs=param_specs(exp, shardings), pipelined=exp.pipeline is not None,
        log_num_zeros_in_grad=exp.config.log_num_zeros_in_grad, tensor_stats=collector)


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
    # One micro-batch's activations: gradient accumulation runs them one after another.
    per_device = exp.config.batch_size // exp.mesh.shape["data"] // exp.config.grad_accum_steps
    images = jax.ShapeDtypeStruct((per_device, exp.config.image_size, exp.config.image_size,
                                   exp.info.image_shape[-1]), jnp.float32)
    labels = jax.ShapeDtypeStruct((per_device,), jnp.int32)

    collections = differentiated_variables(state)  # e.g. mode "fp8": delayed-scaling state

    def loss_fn(params, x, y):
        logits = state.apply_fn({"params": params, **collections}, x, train=True,
                                 rngs={"dropout": jax.random.key(0)})
        return cross_entropy(logits, y)

    abstract = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state.params)
    grad_shardings = None  # ZeRO-2/3: each device holds its 'data' split of the gradients
    if exp.config.zero_stage >= 2:
        grad_shardings = zero.shardings(
            state.params, exp.mesh,
            jax.tree_util.tree_map(lambda a: zero.without_data(a.sharding.spec), state.params))
    model_state = state.extra_state() if collections else None
    return memory_report(loss_fn, abstract, images, labels, opt_state=state.opt_state,
                         model_state=model_state, grad_shardings=grad_shardings)


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
    stop: StopOnSignal
    start: int = 0
    diverged_at: int | None = None  # the step the divergence guard stopped the run at
    non_finite_at: int | None = None  # first step whose loss was NaN/inf (no loss scale)
    collector: tensor_stats.Collector | None = None  # statistics and skip reasons
    skip_reasons: list[str] = dataclasses.field(default_factory=list)  # "step N skipped: ..."
    non_finite_reason: str | None = None  # what went NaN/inf at non_finite_at

    def close(self) -> None:
        self.progress.close()  # ends the bar's line: an error printed next starts on its own
        self.ckpt.close()
        self.writer.close()


def train_and_evaluate(config: Config, workdir: str) -> dict[str, Any]:
    """Trains and evaluates a ViT as ``config`` says; resumes from ``workdir`` if possible.

    Args:
      config: a config from ``jamp.config.vit_config`` (or a recipe of :mod:`jamp.configs`).
      workdir: run directory for metrics, checkpoints, summary and plot.

    Returns:
      The run summary (also written to ``workdir/summary.json``, see
      :mod:`jamp.run_summary`): outcome, final test accuracy, images/s, memory report,
      steps skipped, final loss scale, label smoothing and the train loss's floor, seed
      and commit. When ``workdir`` holds this run already completed, its saved summary
      (nothing is trained or written).

    Raises:
      ConfigError, DatasetNotFoundError, CheckpointError: with a message that names
        the fix, before anything is written to ``workdir``.
      LossScaleDivergedError: the divergence guard stopped the run; ``summary.json``
        (outcome ``"diverged"``, the step, the loss-scale history) and the plot are
        written first. Its subclass :class:`NonFiniteLossError`: the loss went NaN/inf
        in a mode without loss scaling (``non_finite_at_step`` in the summary).
      Preempted: SIGINT or SIGTERM arrived during the loop: the step in progress was
        finished and checkpointed (every process stops at the same step); rerunning
        resumes there. A second signal exits the process at once (status 128 + signum).

    Example: ``train_and_evaluate(vit_config("fp16"), "runs/vit_fp16")["test_accuracy"]``
    trains the embedded digits (about a minute on 2 CPU cores); the notebook
    ``notebooks/02_vit_training.py`` compares modes with it.
    """
    workdir = os.path.abspath(workdir)
    exp = build_experiment(config, workdir)  # validates the config, mesh and workdir first
    finished = run_summary.finished_summary(exp, workdir)
    if finished is not None:
        return finished
    with jax.set_mesh(exp.mesh):
        run, state = _start(exp, workdir)
    try:
        with (jax.set_mesh(exp.mesh), nn.logical_axis_rules(parallel.LOGICAL_AXIS_RULES),
              run.stop):  # SIGINT/SIGTERM: stop after the step (jamp.preemption)
            memory = step_memory_report(exp, state)
            state, last_eval, rates = _loop(run, state)
            if run.diverged_at is None:
                last_eval = _finish(run, state, last_eval)
            run.ckpt.wait()
            summary = _summary(run, state, last_eval, rates)
    finally:
        run.close()
    return run_summary.report(summary, memory, exp, workdir)


def _start(exp: Experiment, workdir: str) -> tuple[_Run, train_state.TrainState]:
    """The run's pieces and its state: restored with the data position, or new.

    Runs under the mesh, outside the logical rules: Flax's DenseGeneral reshapes boxed
    kernels at init; the rules apply to the activations in the steps.
    """
    c, rng, is_main = exp.config, jax.random.key(exp.config.seed), jax.process_index() == 0
    ckpt_dir = os.path.join(workdir, "checkpoints")
    with writing_workdir(workdir):  # an unusable workdir: one line, before anything is built
        os.makedirs(ckpt_dir, exist_ok=True)
    abstract, shardings = state_shardings(exp, rng)
    loader = data.train_loader(
        exp.info, data_dir=c.data_dir, image_size=c.image_size, global_batch_size=c.batch_size,
        seed=c.seed, augment=c.augment, process_index=jax.process_index(),
        process_count=jax.process_count(), worker_count=c.worker_count)
    p_eval = jax.jit(eval_step, in_shardings=(shardings, parallel.batch_sharding(exp.mesh)))
    iterator = iter(loader)
    with writing_workdir(workdir):
        ckpt = Checkpointer(ckpt_dir, keep=c.keep_checkpoints)
    start, state = 0, None
    try:
        if ckpt.latest_step() is not None:
            start, state = ckpt.restore(abstract, iterator, exp.meta)
        with writing_workdir(workdir):
            if is_main:
                with open(os.path.join(workdir, "config.json"), "w") as f:
                    f.write(c.to_json_best_effort(indent=2) + "\n")
            writer = MetricsWriter(workdir, enabled=is_main, resume_step=start)
    except BaseException:
        ckpt.close()
        raise
    if is_main and start:
        print(f"Resumed from step {start} ({ckpt.directory}).", file=sys.stderr, flush=True)
    collector = stats_collector(exp)
    run = _Run(exp, jit_train_step(exp, shardings, abstract, collector), p_eval, iterator, ckpt,
               writer, progress_bar(exp, start, enabled=is_main and c.progress),
               rng, workdir, StopOnSignal(exp.mesh), start, collector=collector)
    return run, (init_state(exp, rng, shardings) if state is None else state)


def progress_bar(exp: Experiment, start: int = 0, enabled: bool = True, file: Any = None
                 ) -> tqdm:
    """The run's progress line on stderr (``file``): the backend and devices it runs on
    (``exp.hardware``, e.g. ``gpu: NVIDIA H100 80GB HBM3 x1`` or ``cpu x8``), then steps from
    ``start`` of ``exp.total_steps``; :func:`_log` adds loss, images/s and loss scale.

    Example:
      >>> import io
      >>> from jamp.config import vit_config
      >>> from jamp.experiment import build_experiment
      >>> bar = progress_bar(build_experiment(vit_config("fp16")), file=io.StringIO())
      >>> bar.desc  # the tests' 8 CPU devices
      'cpu x8'
      >>> bar.close()
    """
    return tqdm(total=exp.total_steps, initial=start, unit="step", dynamic_ncols=True,
                desc=str(exp.hardware), file=sys.stderr if file is None else file,
                mininterval=0.5, disable=not enabled)


def _loop(run: _Run, state: train_state.TrainState
          ) -> tuple[train_state.TrainState, dict[str, float], list[float]]:
    """Steps to ``total_steps``; logs, evaluates and checkpoints on the config's schedule."""
    exp, config = run.exp, run.exp.config
    pending, throughput, last_eval = [], Throughput(), {}
    for step in range(run.start, exp.total_steps):
        batch = _global_batch(exp, next(run.iterator))
        state, metrics = run.train_step(state, batch, jax.random.fold_in(run.rng, step))
        pending.append(metrics)
        if step == run.start:  # compiled and ran: the clock and the ETA count from here
            jax.block_until_ready(metrics)
            run.progress.unpause()
        throughput.count(config.batch_size)
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
            run.ckpt.save(done, state, run.iterator, exp.meta)
        if run.stop.should_stop():  # SIGINT/SIGTERM: this step's metrics and checkpoint
            if pending:
                _log(run, done, jax.device_get(pending), throughput.lap())
            if run.diverged_at is None:
                _stop(run, done, state)
            break
    return state, last_eval, throughput.rates


def _stop(run: _Run, done: int, state: train_state.TrainState) -> NoReturn:
    """Saves the checkpoint at ``done`` (as a periodic one) and raises :class:`Preempted`."""
    if run.ckpt.latest_step() != done:
        run.ckpt.save(done, state, run.iterator, run.exp.meta, force=True)
    run.ckpt.wait()  # still under the signal handlers: a second signal exits at once
    raise Preempted(done, run.stop.signum, run.ckpt.directory)


def _log(run: _Run, done: int, fetched: list[dict[str, Any]], rate: float | None) -> None:
    """One metrics line for the ``fetched`` steps; marks a run whose loss scale diverged."""
    record = {
        "train/loss": float(np.mean([m["loss"] for m in fetched])),
        "train/accuracy": float(np.mean([m["accuracy"] for m in fetched])),
        "train/loss_scale": float(fetched[-1]["loss_scale"]),
        "train/steps_skipped": int(fetched[-1]["steps_skipped"]),
        "train/images_per_sec": rate,
        "train/grad_norm": float(np.mean([m["grad_norm"] for m in fetched])),
    }
    if "num_zeros_in_grad" in fetched[-1]:
        record["train/num_zeros_in_grad"] = int(fetched[-1]["num_zeros_in_grad"])
    reasons = _skip_reasons(run, done, fetched)
    if reasons:
        record["train/skip_reasons"] = reasons
    run.writer.write(done, record)
    _write_tensor_stats(run, done, fetched)
    skipped = str(record["train/steps_skipped"])
    if run.skip_reasons:  # the last one, shortened: the full sentence is in metrics.jsonl
        last = run.skip_reasons[-1]
        skipped += f" (last: {last if len(last) <= 90 else last[:87] + '...'})"
    run.progress.set_postfix(loss=f"{record['train/loss']:.3f}",
                             img_s="n/a" if rate is None else f"{rate:.0f}",
                             scale=f"{record['train/loss_scale']:g}",
                             skipped=skipped, refresh=False)
    run.progress.update(len(fetched))
    if any(bool(m["diverged"]) for m in fetched):
        run.diverged_at = done
    _check_finite(run, done, fetched)


def _skip_reasons(run: _Run, done: int, fetched: list[dict[str, Any]]) -> list[str]:
    """"step N skipped: <what went non-finite where>" for each skipped step of ``fetched``
    (also kept on the run for the progress line and the summary)."""
    if run.collector is None:
        return []
    reasons = []
    for i, m in enumerate(fetched):
        if "skip" not in m or not bool(m.get("skipped", False)):
            continue
        reasons.append(tensor_stats.skip_line(done - len(fetched) + i + 1,
                                              run.collector.explain(m)))
    run.skip_reasons.extend(reasons)
    return reasons


def _write_tensor_stats(run: _Run, done: int, fetched: list[dict[str, Any]]) -> None:
    """The collected steps' per-layer statistics: tensor_stats.jsonl and TensorBoard."""
    for i, m in enumerate(fetched):
        if bool(m.get("tensor_stats_collected", False)) and run.collector is not None:
            run.writer.write_tensor_stats(done - len(fetched) + i + 1,
                                          tensor_stats.table(m, run.collector.rows),
                                          loss_scale=float(m["loss_scale"]))


def _check_finite(run: _Run, done: int, fetched: list[dict[str, Any]]) -> None:
    """Stops a run whose loss went NaN/inf where no loss scale skips the step (mode bf16...)."""
    if run.exp.precision.loss_scale.kind != "none" or run.diverged_at is not None:
        return
    bad = [i for i, m in enumerate(fetched) if not np.isfinite(float(m["loss"]))]
    if bad:
        run.non_finite_at = done - len(fetched) + bad[0] + 1
        run.diverged_at = done
        if run.collector is not None:
            run.non_finite_reason = run.collector.explain(fetched[bad[0]])


def _finish(run: _Run, state: train_state.TrainState, last_eval: dict[str, float]
            ) -> dict[str, float]:
    """The final evaluation and checkpoint (unless the loop just made them)."""
    exp, done = run.exp, run.exp.total_steps
    if not last_eval or done % exp.steps_per_epoch:
        last_eval = evaluate(exp, state, run.eval_step)
        logged = run.start == done and any(  # resumed from the final checkpoint
            r["step"] == done and "eval/accuracy" in r for r in read_metrics(run.workdir))
        if not logged:
            run.writer.write(done, last_eval)
    if run.ckpt.latest_step() != done:
        run.ckpt.save(done, state, run.iterator, exp.meta, force=True)
    return last_eval


def _summary(run: _Run, state: train_state.TrainState, last_eval: dict[str, float],
             rates: list[float]) -> dict[str, Any]:
    """The run's summary (:mod:`jamp.run_summary`): completed, or stopped at ``diverged_at``."""
    stop = run.diverged_at
    summary = run_summary.summarize(run.exp, state, workdir=run.workdir, start=run.start,
                                    steps=run.exp.total_steps if stop is None else stop,
                                    last_eval=last_eval, rates=rates)
    if run.skip_reasons:  # the first 20 of this run (metrics.jsonl has them all)
        summary["skip_reasons"] = run.skip_reasons[:20]
    if stop is None:
        return summary
    return run_summary.diverged(
        summary, run.exp, workdir=run.workdir, checkpoint_dir=run.ckpt.directory,
        checkpoints=[s for s in run.ckpt.all_steps() if s <= stop],
        non_finite_at=run.non_finite_at, non_finite_reason=run.non_finite_reason)


# `python -m jamp.train` is the jamp.train command. jamp.cli (the one entry point) imports
# this module, so the guard imports it lazily: no import circle at module level.
if __name__ == "__main__":
    from jamp import cli

    cli.main()
