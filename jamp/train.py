"""``jamp.train``: train a Vision Transformer in any precision mode.

  jamp.train --config configs/vit_fp16.py                  # embedded digits, offline
  jamp.train --config configs/vit_bf16.py:s16,cifar10 --config.data_dir=/data/tfds
  jamp.train --config configs/vit_fp16.py --config.batch_size=256 --workdir runs/big

Also ``python -m jamp.train``. The config is an ``ml_collections`` file
(``get_config(arg)``, see ``jamp/config.py``); ``--config.key=value`` overrides any
field and unknown keys are rejected. The run directory gets ``metrics.jsonl``,
TensorBoard events, orbax checkpoints (resumed automatically), ``summary.json``
and ``training.png``.

The ``config.mesh`` axes (data, model, pipe) give data, tensor (Megatron) and
GPipe pipeline parallelism (``jamp/parallel``). Multi-host runs start one
process per host (or per GPU) under SLURM, Open MPI, torchrun-style variables
or ``--coordinator host:port --num_processes N --process_id i``; only process
0 writes metrics, plots and the summary. See the README, "Scaling out".

The Python API behind it is :func:`train_and_evaluate`.

Example:
  >>> from jamp.config import vit_config
  >>> config = vit_config("fp16")
  >>> config.max_steps = 2
  >>> # summary = train_and_evaluate(config, "/tmp/run")
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax.training import train_state

from jamp import data, parallel
from jamp.checkpoint import Checkpointer, CheckpointError
from jamp.flax import apply_policy
from jamp.loss_scale import LossScaleDivergedError, loss_scale, overflow_stats
from jamp.memory import MemoryReport, memory_report
from jamp.metrics import MetricsWriter, plot_run
from jamp.models import vit
from jamp.policy import MixedPrecision, mixed_precision
from jamp.step import ValueAndGrad, cross_entropy, eval_step, make_optimizer, train_step


class ConfigError(ValueError):
    """The config cannot be trained as given; the message says what to change."""


USER_ERRORS = (ConfigError, data.DatasetNotFoundError, CheckpointError, LossScaleDivergedError)
"""Errors reported as one paragraph (no traceback) by the CLI."""


@dataclasses.dataclass
class Experiment:
    """Everything built from a config before the loop runs."""

    config: ml_collections.ConfigDict
    precision: MixedPrecision
    mesh: jax.sharding.Mesh
    info: data.DatasetInfo
    model: nn.Module
    pipeline: parallel.pipeline.GPipe | None
    tx: optax.GradientTransformation
    steps_per_epoch: int
    total_steps: int


# ----------------------------------------------------------------------------- building


def precision_from_config(config: ml_collections.ConfigDict) -> MixedPrecision:
    """The config's mode with any ``config.loss_scale.*`` field that is set.

    Example:
      >>> from jamp.config import vit_config
      >>> c = vit_config("fp16"); c.loss_scale.hysteresis = 2
      >>> precision_from_config(c).loss_scale.hysteresis
      2
    """
    fields = {k: v for k, v in config.loss_scale.items() if v is not None}
    if "kind" in fields:
        fields["loss_scale"] = fields.pop("kind")
    try:
        return mixed_precision(config.mode, **fields)
    except ValueError as e:
        raise ConfigError(f"--config.mode / --config.loss_scale: {e}") from None


def build_optimizer(config: ml_collections.ConfigDict, total_steps: int,
                    mp: MixedPrecision) -> optax.GradientTransformation:
    """Clip + AdamW/SGD with linear warm-up and cosine decay, wrapped for the mode.

    Example:
      >>> from jamp.config import vit_config
      >>> c = vit_config("bf16")
      >>> tx = build_optimizer(c, 100, precision_from_config(c))
    """
    warmup = min(config.warmup_steps, max(total_steps - 1, 0))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, config.learning_rate, warmup, max(total_steps, warmup + 1))
    if config.optimizer == "adamw":
        opt = optax.adamw(schedule, weight_decay=config.weight_decay)
    elif config.optimizer == "sgd":
        opt = optax.chain(optax.add_decayed_weights(config.weight_decay),
                          optax.sgd(schedule, momentum=config.momentum))
    else:
        raise ConfigError(f"--config.optimizer={config.optimizer!r}: use 'adamw' or 'sgd'.")
    if config.grad_clip_norm:
        opt = optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), opt)
    return make_optimizer(mp, opt)


def build_experiment(config: ml_collections.ConfigDict) -> Experiment:
    """Validates ``config`` and builds mesh, dataset info, model and optimizer.

    Raises:
      ConfigError / DatasetNotFoundError with a message naming the fix.

    Example:
      >>> from jamp.config import vit_config
      >>> build_experiment(vit_config("fp16")).info.num_classes
      10
    """
    mp = precision_from_config(config)
    try:
        mesh = parallel.make_mesh(config.mesh.to_dict())
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _check_batch(config, mesh)
    stages = mesh.shape["pipe"]
    pipeline = None
    if stages > 1:
        pipeline = parallel.pipeline.GPipe(stages, config.pipeline_microbatches)
    info = data.get_dataset_info(config.dataset, config.data_dir)
    model_overrides = {k: config[k] for k in ("num_layers", "hidden_size", "num_heads",
                                              "mlp_dim") if config[k] is not None}
    try:
        module = vit.create(config.model, num_classes=info.num_classes,
                            patch_size=config.patch_size, dropout_rate=config.dropout_rate,
                            remat=config.remat, scan_layers=config.scan_layers,
                            layer_runner=pipeline,
                            **model_overrides)
    except ValueError as e:
        raise ConfigError(f"--config.model: {e}") from None
    _check_model_split(config, mesh, module)
    if config.image_size % config.patch_size:
        raise ConfigError(
            f"--config.image_size={config.image_size} is not divisible by "
            f"--config.patch_size={config.patch_size}.")
    if module.hidden_size % module.num_heads:
        raise ConfigError(
            f"hidden_size={module.hidden_size} is not divisible by num_heads={module.num_heads}.")
    steps_per_epoch = data.steps_per_epoch(info, config.batch_size)
    total_steps = steps_per_epoch * config.num_epochs
    if config.max_steps is not None:
        total_steps = min(total_steps, config.max_steps)
    tx = build_optimizer(config, total_steps, mp)
    return Experiment(config, mp, mesh, info, apply_policy(module, mp), pipeline, tx,
                      steps_per_epoch, total_steps)


def _check_batch(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh) -> None:
    """The global batch must split over processes, 'data' shards and pipeline microbatches."""
    data_size, stages = mesh.shape["data"], mesh.shape["pipe"]
    microbatches = config.pipeline_microbatches if stages > 1 else 1
    if microbatches < 1:
        raise ConfigError(
            f"--config.pipeline_microbatches={microbatches} must be at least 1 (at least "
            f"{stages}, the pipeline stages, to keep the bubble (S-1)/(M+S-1) small).")
    split = data_size * microbatches
    if config.batch_size <= 0 or config.batch_size % split:
        what = (f"the {data_size} devices of the mesh's 'data' axis" if microbatches == 1 else
                f"{data_size} 'data' shards x {microbatches} pipeline microbatches = {split}")
        change = "--config.mesh.data" + (
            " or --config.pipeline_microbatches" if microbatches > 1 else "")
        raise ConfigError(
            f"--config.batch_size={config.batch_size} is not divisible by {what}. Use a "
            f"multiple of {split} (e.g. {max(split, config.batch_size // split * split)}) "
            f"or change {change}.")
    processes = jax.process_count()
    if config.batch_size % processes:
        raise ConfigError(
            f"--config.batch_size={config.batch_size} is not divisible by the "
            f"{processes} processes.")
    if data_size % processes:
        raise ConfigError(
            f"The mesh's 'data' axis ({data_size}) is not a multiple of the {processes} "
            "processes: each process feeds its own slice of the batch, so the processes must "
            "split the 'data' axis (keep 'model' and 'pipe' within a process). Change "
            "--config.mesh.*.")


def _check_model_split(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh,
                       module: nn.Module) -> None:
    """Heads and MLP units must split over 'model', the layers over 'pipe'."""
    tp, stages = mesh.shape["model"], mesh.shape["pipe"]
    for name, value in (("num_heads", module.num_heads), ("mlp_dim", module.mlp_dim)):
        if value % tp:
            raise ConfigError(
                f"{name}={value} cannot be split over the {tp} devices of the mesh's 'model' "
                f"axis (tensor parallelism shards it): change --config.{name} or "
                "--config.mesh.model.")
    if stages > 1 and not config.scan_layers:
        raise ConfigError(
            f"--config.mesh.pipe={stages} needs --config.scan_layers=True: the pipeline splits "
            "the scanned encoder blocks into stages.")
    if module.num_layers % stages:
        raise ConfigError(
            f"num_layers={module.num_layers} cannot be split into {stages} pipeline stages: "
            "change --config.num_layers or --config.mesh.pipe to divide it.")


def _create_state(exp: Experiment, rng: jax.Array) -> train_state.TrainState:
    images = jnp.zeros((1, exp.config.image_size, exp.config.image_size,
                        exp.info.image_shape[-1]), jnp.float32)
    params = exp.model.init({"params": rng}, images)["params"]
    return train_state.TrainState.create(apply_fn=exp.model.apply, params=params, tx=exp.tx)


def state_shardings(exp: Experiment, rng: jax.Array) -> tuple[Any, Any]:
    """Abstract (unboxed) train state and its shardings from the logical axis rules."""
    boxed = jax.eval_shape(lambda r: _create_state(exp, r), rng)
    specs = nn.get_partition_spec(boxed)
    shardings = nn.logical_to_mesh_sharding(specs, exp.mesh, parallel.LOGICAL_AXIS_RULES)
    abstract = jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        nn.unbox(boxed), shardings)
    return abstract, shardings


def init_state(exp: Experiment, rng: jax.Array, shardings: Any) -> train_state.TrainState:
    """The initial train state, created sharded (call under ``jax.set_mesh(exp.mesh)``).

    Example:
      >>> # with jax.set_mesh(exp.mesh): state = init_state(exp, rng, shardings)
    """
    return jax.jit(lambda r: nn.unbox(_create_state(exp, r)), out_shardings=shardings)(rng)


def mesh_value_and_grad(exp: Experiment, shardings: Any) -> ValueAndGrad:
    """The gradient function of the train step on ``exp.mesh`` (:mod:`jamp.parallel.step`)."""
    param_specs = jax.tree_util.tree_map(lambda s: s.spec, shardings.params)
    return parallel.step.value_and_grad(param_specs, pipelined=exp.pipeline is not None)


def jit_train_step(exp: Experiment, shardings: Any):
    """``step(state, batch, rng) -> (state, metrics)``: the jitted data/tensor/pipeline step.

    Call it under ``jax.set_mesh(exp.mesh)`` and ``nn.logical_axis_rules(
    parallel.LOGICAL_AXIS_RULES)``; the state argument is donated.

    Example:
      >>> # with jax.set_mesh(exp.mesh), nn.logical_axis_rules(parallel.LOGICAL_AXIS_RULES):
      >>> #     state, metrics = jit_train_step(exp, shardings)(state, batch, rng)
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


def evaluate(exp: Experiment, state: train_state.TrainState, p_eval) -> dict[str, float]:
    """Loss and accuracy on the test split (every example exactly once)."""
    totals = np.zeros(3)
    for batch in data.eval_batches(
            exp.config.dataset, data_dir=exp.config.data_dir, image_size=exp.config.image_size,
            global_batch_size=exp.config.batch_size, process_index=jax.process_index(),
            process_count=jax.process_count()):
        m = p_eval(state, _global_batch(exp, batch))
        totals += np.array([m["loss_sum"], m["correct"], m["count"]])
    count = max(totals[2], 1.0)
    return {"eval/loss": totals[0] / count, "eval/accuracy": totals[1] / count}


def step_memory_report(exp: Experiment, state: train_state.TrainState) -> MemoryReport:
    """JAX-level bytes of one training step per device-batch (params, grads, state, residuals)."""
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


class _Progress:
    """A tqdm bar on process 0 (or nothing)."""

    def __init__(self, enabled: bool, total: int, initial: int):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                            file=sys.stderr, mininterval=0.5)

    def update(self, n: int, **postfix: Any) -> None:
        if self.bar is not None:
            self.bar.update(n)
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _run_meta(exp: Experiment) -> dict[str, Any]:
    c = exp.config
    return {"mode": exp.precision.name, "dataset": c.dataset, "model": c.model,
            "patch_size": c.patch_size, "image_size": c.image_size,
            "batch_size": c.batch_size, "seed": c.seed}


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
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

    Example:
      >>> from jamp.config import vit_config
      >>> c = vit_config("bf16"); c.max_steps = 3; c.progress = False
      >>> # train_and_evaluate(c, "/tmp/jamp-run")["steps"]  -> 3
    """
    workdir = os.path.abspath(workdir)
    exp = build_experiment(config)
    is_main = jax.process_index() == 0
    writer = MetricsWriter(workdir, enabled=is_main)
    progress = _Progress(is_main and config.progress, exp.total_steps, 0)
    rng = jax.random.key(config.seed)
    rules = parallel.LOGICAL_AXIS_RULES

    # Parameters are created outside the logical rules (Flax's DenseGeneral reshapes
    # boxed kernels at init); the rules apply to the activations in the steps.
    with jax.set_mesh(exp.mesh):
        abstract, shardings = state_shardings(exp, rng)
        loader = data.train_loader(
            config.dataset, data_dir=config.data_dir, image_size=config.image_size,
            global_batch_size=config.batch_size, seed=config.seed, augment=config.augment,
            process_index=jax.process_index(), process_count=jax.process_count(),
            worker_count=config.worker_count)
        iterator = iter(loader)
        ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=config.keep_checkpoints)
        start = 0
        if ckpt.latest_step() is not None:
            start, state = ckpt.restore(abstract, iterator, _run_meta(exp))
            progress.write(f"Resumed from step {start} ({ckpt.directory}).")
            progress.update(start)
        else:
            state = init_state(exp, rng, shardings)
    with jax.set_mesh(exp.mesh), nn.logical_axis_rules(rules):
        p_train = jit_train_step(exp, shardings)
        p_eval = jax.jit(eval_step, in_shardings=(shardings, parallel.batch_sharding(exp.mesh)))
        memory = step_memory_report(exp, state)

        summary = _loop(exp, state, iterator, p_train, p_eval, ckpt, writer, progress, start,
                        rng)
        summary["memory"] = memory.as_dict()
        progress.close()
        ckpt.close()
    writer.close()
    if is_main:
        summary["plot"] = plot_run(workdir) if config.plot else None
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print(format_summary(summary, memory), flush=True)
    return summary


def _loop(exp, state, iterator: Iterator, p_train, p_eval, ckpt: Checkpointer,
          writer: MetricsWriter, progress: _Progress, start: int, rng) -> dict[str, Any]:
    config = exp.config
    pending: list[dict[str, jax.Array]] = []
    window_start, window_images = None, 0
    images_per_sec: list[float] = []
    last_eval: dict[str, float] = {}
    step = start
    for step in range(start, exp.total_steps):
        batch = _global_batch(exp, next(iterator))
        state, metrics = p_train(state, batch, jax.random.fold_in(rng, step))
        pending.append(metrics)
        done = step + 1
        if window_start is None:  # the first step compiles: time from after it
            jax.block_until_ready(metrics)
            window_start, window_images = time.perf_counter(), 0
        else:
            window_images += config.batch_size
        if done % config.log_every_steps == 0 or done == exp.total_steps:
            fetched = jax.device_get(pending)
            pending = []
            elapsed = time.perf_counter() - window_start
            rate = window_images / elapsed if window_images else None  # first window: compile
            if window_images:
                images_per_sec.append(rate)
            window_start, window_images = time.perf_counter(), 0
            last = fetched[-1]
            record = {
                "train/loss": float(np.mean([m["loss"] for m in fetched])),
                "train/accuracy": float(np.mean([m["accuracy"] for m in fetched])),
                "train/loss_scale": float(last["loss_scale"]),
                "train/steps_skipped": int(last["steps_skipped"]),
                "train/images_per_sec": rate,
            }
            writer.write(done, record)
            progress.update(len(fetched), loss=f"{record['train/loss']:.3f}",
                            img_s="n/a" if rate is None else f"{rate:.0f}",
                            scale=f"{record['train/loss_scale']:g}",
                            skipped=record["train/steps_skipped"])
            if any(bool(m["diverged"]) for m in fetched):
                ckpt.wait()
                raise LossScaleDivergedError(
                    f"Training stopped at step {done}: the loss scale sits at its minimum "
                    f"({record['train/loss_scale']:g}) and the gradients have overflowed for "
                    f"{exp.precision.loss_scale.divergence_steps} steps in a row, so every step is "
                    "being skipped. The model has diverged (or the data holds NaN/inf). Lower "
                    "--config.learning_rate, use --config.mode=bf16, or check the input data; "
                    f"the last good checkpoint is in {ckpt.directory}.")
        if done % exp.steps_per_epoch == 0 and (
                (done // exp.steps_per_epoch) % config.eval_every_epochs == 0):
            last_eval = evaluate(exp, state, p_eval)
            writer.write(done, {**last_eval, "epoch": done // exp.steps_per_epoch})
        if done % config.checkpoint_every_steps == 0:
            ckpt.save(done, state, iterator, _run_meta(exp))
    done = exp.total_steps
    if not last_eval or done % exp.steps_per_epoch:
        last_eval = evaluate(exp, state, p_eval)
        writer.write(done, last_eval)
    if ckpt.latest_step() != done:
        ckpt.save(done, state, iterator, _run_meta(exp), force=True)
    ckpt.wait()
    stats = jax.device_get(overflow_stats(state.opt_state))
    return {
        "mode": exp.precision.name,
        "dataset": config.dataset,
        "model": f"ViT-{config.model}/{config.patch_size}",
        "steps": done,
        "start_step": start,
        "test_accuracy": float(last_eval["eval/accuracy"]),
        "test_loss": float(last_eval["eval/loss"]),
        "images_per_sec": float(np.median(images_per_sec)) if images_per_sec else None,
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
    """A human-readable end-of-run summary."""
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


# ----------------------------------------------------------------------------- CLI


def _default_workdir(config_path: str) -> str:
    path, _, arg = config_path.partition(":")
    name = os.path.splitext(os.path.basename(path))[0]
    return os.path.join("runs", name + (f"-{arg.replace(',', '-')}" if arg else ""))


def _define_flags():
    from absl import flags
    from ml_collections import config_flags

    if "config" not in flags.FLAGS:
        config_flags.DEFINE_config_file(
            "config", None, "Config file, e.g. configs/vit_fp16.py or "
            "configs/vit_fp16.py:b16,caltech101. Override fields with --config.key=value.",
            lock_config=True)
        flags.DEFINE_string("workdir", None, "Run directory (default: runs/<config name>). "
                            "An existing run there is resumed.")
        flags.DEFINE_string("coordinator", None, "Multi-process runs: host:port of process 0's "
                            "jax.distributed coordinator (with --num_processes, --process_id). "
                            "Not needed under SLURM, Open MPI or torchrun-style variables.")
        flags.DEFINE_integer("num_processes", None, "Multi-process runs: number of processes.")
        flags.DEFINE_integer("process_id", None, "Multi-process runs: this process's index.")
    return flags.FLAGS


def _run(argv: list[str]) -> None:
    from absl import logging

    logging.set_verbosity(logging.WARNING)  # orbax logs every file it renames at INFO
    flags = _define_flags()
    if len(argv) > 1:
        raise SystemExit(f"jamp.train: unexpected arguments {argv[1:]}; see jamp.train --help.")
    try:
        config = flags.config
        if config is not None:
            config.mode  # noqa: B018  (absl loads config files lazily: fail here, clearly)
    except _PARSE_ERRORS as e:
        raise _usage_error(e) from None
    if config is None:
        raise SystemExit("jamp.train: --config is required, e.g. "
                         "jamp.train --config configs/vit_fp16.py (see --help).")
    workdir = flags.workdir or _default_workdir(flags["config"].config_filename)
    try:
        parallel.launch.initialize(flags.coordinator, flags.num_processes, flags.process_id)
    except ValueError as e:
        print(f"jamp.train: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    try:
        train_and_evaluate(config, workdir)
    except USER_ERRORS as e:
        print(f"jamp.train: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(3 if isinstance(e, LossScaleDivergedError) else 2) from None


def _usage_error(error: BaseException) -> SystemExit:
    """Prints a config/flag error as one paragraph and returns the exit to raise."""
    text = str(error)
    if "Traceback" in text:  # absl wraps the config file's own exception with its traceback
        text = [line for line in text.splitlines() if line.strip()][-1]
    text = " ".join(text.strip("'\"").replace("\\n", " ").replace("\\'", "'").split())
    print(f"jamp.train: error: {text} -- Check --config (a file such as configs/vit_fp16.py, "
          "optionally with :model,dataset, e.g. :s16,cifar10) and the --config.key=value "
          "overrides: keys must exist in the config (see jamp/config.py) and values must "
          "have the field's type.", file=sys.stderr, flush=True)
    return SystemExit(2)


_PARSE_ERRORS = (AttributeError, KeyError, TypeError, ValueError, OSError, SyntaxError)


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's parser, with config-file and override errors as one paragraph."""
    from absl import flags

    try:
        return flags.FLAGS(argv)
    except (flags.Error, *_PARSE_ERRORS) as e:
        raise _usage_error(e) from None


def main(argv: list[str] | None = None) -> None:
    """Console entry point: ``jamp.train --config configs/vit_fp16.py``."""
    from absl import app

    _define_flags()
    app.run(_run, argv=sys.argv if argv is None else argv, flags_parser=_parse_flags)


if __name__ == "__main__":
    main()
