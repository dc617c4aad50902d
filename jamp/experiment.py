"""From a config to an :class:`Experiment` and its initial train state.

The data flow of a run starts here: config -> mesh -> pipeline (a layer runner when
the mesh has 'pipe' stages) -> dataset info -> policy-wrapped model -> optimizer
with the mode's loss scale -> the train state, sharded by the logical axis rules.
:func:`validate_config` refuses sizes that cannot work before anything is built,
with the fix in the message; :mod:`jamp.train` runs the experiment.

:func:`validate_config` is the one validation pass: field ranges, the batch and the
model against the mesh, the run directory (:func:`check_workdir`), and the modes
known to be unsafe (``fp16_pure`` warns with :class:`UnsafeModeWarning`). It runs
inside :func:`build_experiment`, before anything is built or written.

Example:
  >>> import jax
  >>> from jamp.config import vit_config
  >>> config = vit_config("fp16")
  >>> config.mesh.pipe = 2
  >>> exp = build_experiment(config)
  >>> dict(exp.mesh.shape), exp.pipeline.bubble_fraction, exp.total_steps
  ({'data': 4, 'model': 1, 'pipe': 2}, 0.2, 1100)
  >>> with jax.set_mesh(exp.mesh):
  ...     abstract, shardings = state_shardings(exp, jax.random.key(0))
  ...     state = init_state(exp, jax.random.key(0), shardings)
  >>> kernel = state.params["encoder"]["layers"]["MlpBlock_0"]["Dense_0"]["kernel"]
  >>> tuple(kernel.sharding.spec)  # [layers, embed, mlp]: layers over 'pipe', mlp over 'model'
  ('pipe', None, 'model')
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax
from absl import flags
from flax import nnx
from flax.training import train_state

from jamp import data, nnx_functional, parallel
from jamp.apply import apply_policy
from jamp.config import FIELDS
from jamp.models import vit, vit_nnx
from jamp.models.sizes import vit_dims
from jamp.parallel import zero
from jamp.parallel.pipeline import GPipe
from jamp.parallel.read_dtypes import read_dtypes
from jamp.policy import MixedPrecision, mixed_precision
from jamp.step import differentiated_variables, make_optimizer

Config = ml_collections.ConfigDict


class ConfigError(ValueError):
    """The config cannot be trained as given; the message says what to change."""


class ConfigWarning(UserWarning):
    """The config trains, but likely not as meant: a ZeRO stage that splits nothing, a mesh
    that leaves devices idle, a run shorter than its warm-up. ``jamp.train`` prints it as one
    ``jamp.train: warning:`` line that names the fix."""


class UnsafeModeWarning(ConfigWarning):
    """The precision mode is known to lose updates or diverge (``fp16_pure``)."""


@dataclasses.dataclass
class Experiment:
    """Everything built from a config before the loop runs.

    ``pipeline`` is the layer runner the model was given (None: the mesh has no
    'pipe' stages); the trainer's gradient function makes 'pipe' manual with it.
    ``apply_fn`` is what the train state runs: ``model.apply`` (linen), or the NNX
    ViT as a function of its parameters (``config.framework='nnx'``), built once so
    every state of the run has the same static ``apply_fn``. ``hardware`` is the
    mesh's backend, device kind and count (the progress line and the summary show it).
    """

    config: Config
    precision: MixedPrecision
    mesh: jax.sharding.Mesh
    info: data.DatasetInfo
    model: nn.Module
    pipeline: GPipe | None
    tx: optax.GradientTransformation
    steps_per_epoch: int
    total_steps: int
    apply_fn: Callable[..., Any]
    hardware: parallel.Hardware

    @property
    def meta(self) -> dict[str, Any]:
        """What a checkpoint records of the run, so a restore into another model is refused."""
        c = self.config
        return {"mode": self.precision.name, "dataset": c.dataset, "model": c.model,
                "framework": c.framework, "patch_size": c.patch_size,
                "image_size": c.image_size, "batch_size": c.batch_size, "seed": c.seed,
                "optimizer": c.optimizer, **model_dims(c)}


def precision_from_config(config: Config) -> MixedPrecision:
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
    state = {k: config.get(k) for k in ("optimizer_state", "master_weights")
             if config.get(k) is not None}
    try:
        mp = mixed_precision(config.mode, **fields, **state)
    except ValueError as e:
        flags = " / ".join(["--config.mode", "--config.loss_scale",
                            *(f"--config.{k}" for k in state)])
        raise ConfigError(f"{flags}: {e}") from None
    history = config.get("fp8_amax_history_length")
    if history is not None:
        if mp.fp8 is None or mp.fp8.strategy.collection is None:  # no state, no history
            raise ConfigError(
                f"--config.fp8_amax_history_length={history} is read by --config.mode=fp8 "
                f"(delayed scaling) only, and this run's mode is {config.mode!r}: drop the "
                "flag or use --config.mode=fp8.")
        mp = dataclasses.replace(mp, fp8=dataclasses.replace(mp.fp8,
                                                             amax_history_length=history))
    return mp


def build_optimizer(config: Config, total_steps: int,
                    mp: MixedPrecision) -> optax.GradientTransformation:
    """Clip + AdamW/SGD with linear warm-up and cosine decay, wrapped for the mode.

    Example:
      >>> import optax
      >>> from jamp.config import vit_config
      >>> c = vit_config("bf16")
      >>> tx = build_optimizer(c, 100, precision_from_config(c))
      >>> isinstance(tx, optax.GradientTransformation)
      True
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
    return make_optimizer(mp, opt, seed=config.seed)


def pipeline_from_config(config: Config, mesh: jax.sharding.Mesh) -> GPipe | None:
    """The model's layer runner for the mesh's 'pipe' stages; None without a pipeline.

    Example:
      >>> from jamp.config import vit_config
      >>> pipeline_from_config(vit_config("fp16"), parallel.make_mesh({"data": 4, "pipe": 2}))
      GPipe(stages=2, microbatches=4, axis_name='pipe')
    """
    stages = mesh.shape["pipe"]
    return GPipe(stages, config.pipeline_microbatches) if stages > 1 else None


def model_dims(config: Config) -> dict[str, int]:
    """The ViT's size: the ``config.model`` variant with the dimensions the config sets.

    Example:
      >>> from jamp.config import vit_config
      >>> model_dims(vit_config("fp16", "s16,cifar10"))["hidden_size"]
      384
    """
    try:
        return vit_dims(config.model, **{k: config[k] for k in (
            "num_layers", "hidden_size", "num_heads", "mlp_dim")})
    except ValueError as e:
        raise ConfigError(f"--config.model: {e}") from None


def validate_config(config: Config, mesh: jax.sharding.Mesh, pipeline: GPipe | None,
                    workdir: str | None = None) -> None:
    """Raises a :class:`ConfigError` naming the fix if ``config`` cannot train on ``mesh``.

    Runs before anything is built: every field's range (:func:`check_values`); the
    batch against processes, 'data' shards and microbatches; the model against
    'model' and the pipeline stages; image and patch sizes; the loader's worker
    processes; the run directory, if given (:func:`check_workdir`). A mode that
    keeps float16 parameters without fp32 master weights warns
    (:class:`UnsafeModeWarning`); a mesh that leaves devices idle, and a ZeRO stage
    over a 'data' axis of 1 device (it splits nothing), warn (:class:`ConfigWarning`).

    Example:
      >>> from jamp.config import vit_config
      >>> c = vit_config("fp16"); c.num_heads = 3
      >>> try:
      ...     validate_config(c, parallel.make_mesh({"data": 4, "model": 2}), None)
      ... except ConfigError as e:
      ...     print(str(e).split(" (")[0])
      num_heads=3 cannot be split over the 2 devices of the mesh's 'model' axis
    """
    check_values(config)
    _check_batch(config, mesh, pipeline)
    _check_model(config, mesh, pipeline)
    if config.image_size % config.patch_size:
        raise ConfigError(
            f"--config.image_size={config.image_size} is not divisible by "
            f"--config.patch_size={config.patch_size}.")
    if config.worker_count > 0 and not flags.FLAGS.is_parsed():
        raise ConfigError(
            f"--config.worker_count={config.worker_count}: grain's worker processes read "
            "absl flags, and they are not parsed. Use the jamp.train command (absl.app parses "
            "them), call absl.flags.FLAGS.mark_as_parsed() first, or set worker_count=0.")
    if workdir is not None:
        check_workdir(workdir)
    mp = precision_from_config(config)
    if mp.policy.param_dtype == jnp.float16 and not mp.master_weights:
        warnings.warn(
            f"mode {mp.name} keeps parameters and optimizer state in float16 without fp32 "
            "master weights: small gradients underflow, updates below float16's resolution "
            "are lost, and runs often diverge (the digits benchmark stops at step 70). Use it "
            "for speed baselines only; --config.mode=fp16 trains with fp32 master weights.",
            UnsafeModeWarning, stacklevel=3)
    idle = idle_devices(mesh)
    if idle:
        warnings.warn(idle, ConfigWarning, stacklevel=3)
    unsplit = parallel.zero_splits_nothing(config.get("zero_stage", 0), mesh,
                                           "--config.mesh.data=-1 takes every device")
    if unsplit:
        warnings.warn(unsplit, ConfigWarning, stacklevel=3)


def idle_devices(mesh: jax.sharding.Mesh) -> str | None:
    """The one-line warning for a mesh over fewer devices than exist (None: it uses all).

    Example:
      >>> idle_devices(parallel.make_mesh({"data": 2})).split(":")[0]  # of 8 test devices
      'The mesh data=2 x model=1 x pipe=1 uses 2 of the 8 devices, leaving 6 idle'
    """
    used, devices = mesh.devices.size, jax.device_count()
    if used >= devices:
        return None
    others = mesh.shape["model"] * mesh.shape["pipe"]
    fix = (f"use all {devices} with --config.mesh.data=-1 (data={devices // others})"
           if devices % others == 0 else
           f"make the --config.mesh.* sizes multiply to {devices}")
    return (f"The mesh {_shape(mesh)} uses {used} of the {devices} devices, leaving "
            f"{devices - used} idle: {fix}.")


def _shape(mesh: jax.sharding.Mesh) -> str:
    return " x ".join(f"{k}={v}" for k, v in mesh.shape.items())


RUN_ENTRIES = {"checkpoints": True, "tensorboard": True, "config.json": False,
               "metrics.jsonl": False, "summary.json": False, "training.png": False}
"""What a run writes in its workdir: name -> whether it is a directory."""


def check_workdir(workdir: str) -> None:
    """Raises a :class:`ConfigError` if ``workdir`` cannot hold a run.

    Writes nothing: the directory (or its nearest existing parent) must be a
    writable directory, and what the run writes there (:data:`RUN_ENTRIES`), where it
    exists already, a writable directory or file as the run needs it. What this misses
    (a filesystem that refuses what the permissions allow) is reported as one line when
    the run creates the directory (:func:`writing_workdir`).

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
    for name, is_dir in RUN_ENTRIES.items():
        path = os.path.join(workdir, name)
        if not os.path.lexists(path):
            continue
        if os.path.isdir(path) != is_dir:
            raise ConfigError(
                f"--workdir={workdir} cannot hold the run: {path} is "
                f"{'not a directory' if is_dir else 'a directory'}, and the run writes its "
                f"{name} {'directory' if is_dir else 'file'} there. Move it away or pass "
                "another --workdir.")
        if not os.access(path, os.W_OK | (os.X_OK if is_dir else 0)):
            raise ConfigError(f"--workdir={workdir} cannot hold the run: {path} is read-only "
                              "for this user. Pass a directory you can write to.")


@contextlib.contextmanager
def writing_workdir(workdir: str) -> Iterator[None]:
    """Turns an ``OSError`` from writing the run directory into a one-line
    :class:`ConfigError` naming the path and the reason (what :func:`check_workdir`
    cannot see without writing, e.g. a filesystem that refuses what permissions allow).

    Example:
      >>> import tempfile
      >>> a_file = tempfile.mkstemp()[1]
      >>> try:
      ...     with writing_workdir(a_file):
      ...         os.makedirs(os.path.join(a_file, "checkpoints"))
      ... except ConfigError as e:
      ...     print(str(e).split(": ")[2].split(".")[0])
      Not a directory
    """
    try:
        yield
    except OSError as e:
        where = e.filename if e.filename is not None else workdir
        raise ConfigError(f"--workdir={workdir} cannot hold the run: {where}: "
                          f"{e.strerror or e}. Pass a directory you can write to, e.g. "
                          "--workdir runs/my_run.") from None


def check_values(config: Config) -> None:
    """Raises a :class:`ConfigError` for a field whose value makes no sense on its own.

    Every field with limits in :data:`jamp.config.FIELDS` is range-checked (a batch
    of 0, a negative learning rate or ``max_steps``, a NaN, a dropout of 1), and
    ``optimizer`` must be known; the loss-scale fields are checked by
    :func:`precision_from_config`, the mesh by :func:`build_experiment`. Runs first,
    before anything is built or compiled.

    Example:
      >>> from jamp.config import vit_config
      >>> c = vit_config("fp16"); c.batch_size = -8
      >>> try:
      ...     check_values(c)
      ... except ConfigError as e:
      ...     print(str(e).split(" (")[0])
      --config.batch_size=-8 is out of range: batch_size must be >= 1, e.g. --config.batch_size=64
    """
    for key, field in FIELDS.items():
        value, limits = config.get(key), field.limits
        if limits is None or (value is None and isinstance(field.default, type)):
            continue
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or not math.isfinite(value) or not limits.test(value)):
            raise ConfigError(
                f"--config.{key}={value!r} is out of range: {key} must be "
                f"{limits.requirement}, e.g. --config.{key}={limits.example} ({field.help}).")
    if config.optimizer not in ("adamw", "sgd"):
        raise ConfigError(f"--config.optimizer={config.optimizer!r}: use 'adamw' or 'sgd'.")
    if config.get("framework", "linen") not in ("linen", "nnx"):
        raise ConfigError(f"--config.framework={config.framework!r}: use 'linen' or 'nnx'.")


def _check_batch(config: Config, mesh: jax.sharding.Mesh, pipeline: GPipe | None) -> None:
    """The global batch must split over processes, 'data' shards and pipeline microbatches."""
    data_size, microbatches = mesh.shape["data"], pipeline.microbatches if pipeline else 1
    if microbatches < 1:
        raise ConfigError(
            f"--config.pipeline_microbatches={microbatches} must be at least 1 (at least "
            f"{pipeline.stages}, the pipeline stages, to keep the bubble (S-1)/(M+S-1) small).")
    accum = config.get("grad_accum_steps", 1)
    split = data_size * microbatches * accum
    if config.batch_size <= 0 or config.batch_size % split:
        parts = [f"{data_size} 'data' shards"]
        if accum > 1:
            parts.append(f"{accum} accumulated micro-batches (--config.grad_accum_steps)")
        if microbatches > 1:
            parts.append(f"{microbatches} pipeline microbatches")
        what = (f"the {data_size} devices of the mesh's 'data' axis" if len(parts) == 1 else
                " x ".join(parts) + f" = {split}")
        change = "--config.mesh.data" + (
            " or --config.pipeline_microbatches" if microbatches > 1 else "") + (
            " or --config.grad_accum_steps" if accum > 1 else "")
        used, devices = mesh.devices.size, jax.device_count()
        if used < devices:  # the mesh is the likelier mistake: it leaves devices idle
            raise ConfigError(
                f"The mesh {_shape(mesh)} uses {used} of the {devices} devices, and "
                f"--config.batch_size={config.batch_size} is not divisible by {what}. Use a "
                f"mesh over all {devices} devices (e.g. --config.mesh.data=-1, the rest) or a "
                f"batch that is a multiple of {split} "
                f"(e.g. {max(split, config.batch_size // split * split)}).")
        raise ConfigError(
            f"--config.batch_size={config.batch_size} is not divisible by {what}. Use a "
            f"multiple of {split} (e.g. {max(split, config.batch_size // split * split)}) "
            f"or change {change}.")
    processes = jax.process_count()
    if config.batch_size % processes:
        raise ConfigError(f"--config.batch_size={config.batch_size} is not divisible by the "
                          f"{processes} processes.")
    if data_size % processes:
        raise ConfigError(
            f"The mesh's 'data' axis ({data_size}) is not a multiple of the {processes} "
            "processes: each process feeds its own slice of the batch, so the processes must "
            "split the 'data' axis (keep 'model' and 'pipe' within a process). Change "
            "--config.mesh.*.")


def _check_model(config: Config, mesh: jax.sharding.Mesh, pipeline: GPipe | None) -> None:
    """Heads and MLP units must split over 'model', the layers over the pipeline stages."""
    dims, tp = model_dims(config), mesh.shape["model"]
    for name in ("num_heads", "mlp_dim"):
        if dims[name] % tp:
            raise ConfigError(
                f"{name}={dims[name]} cannot be split over the {tp} devices of the mesh's "
                f"'model' axis (tensor parallelism shards it): change --config.{name} or "
                "--config.mesh.model.")
    if config.get("zero_stage", 0) == 3 and not config.scan_layers:
        raise ConfigError(
            "--config.zero_stage=3 gathers each layer's parameters inside the scanned encoder "
            "(FSDP): set --config.scan_layers=True, or use --config.zero_stage=2 (parameters "
            "whole on every device).")
    if pipeline and not config.scan_layers:
        raise ConfigError(
            f"--config.mesh.pipe={pipeline.stages} needs --config.scan_layers=True: the "
            "pipeline splits the scanned encoder blocks into stages.")
    if pipeline and dims["num_layers"] % pipeline.stages:
        raise ConfigError(
            f"num_layers={dims['num_layers']} cannot be split into {pipeline.stages} pipeline "
            "stages: change --config.num_layers or --config.mesh.pipe to divide it.")
    if dims["hidden_size"] % dims["num_heads"]:
        raise ConfigError(f"hidden_size={dims['hidden_size']} is not divisible by "
                          f"num_heads={dims['num_heads']}.")


def build_experiment(config: Config, workdir: str | None = None) -> Experiment:
    """Validates ``config`` (and ``workdir``) and builds mesh, pipeline, dataset info,
    model and optimizer.

    Raises:
      ConfigError / DatasetNotFoundError with a message naming the fix.

    Example:
      >>> from jamp.config import vit_config
      >>> build_experiment(vit_config("fp16")).info.num_classes
      10
    """
    check_values(config)
    mp = precision_from_config(config)
    try:
        mesh = parallel.make_mesh(config.mesh.to_dict())
    except ValueError as e:
        raise ConfigError(str(e)) from None
    pipeline = pipeline_from_config(config, mesh)
    if pipeline is not None and mp.fp8 is not None:  # e.g. fp8 state: real microbatches only
        pipeline = dataclasses.replace(pipeline, on_tick=mp.fp8.strategy.pipeline_hook())
    validate_config(config, mesh, pipeline, workdir)
    info = data.get_dataset_info(config.dataset, config.data_dir)
    runner = pipeline  # ZeRO-3: each layer's parameters gathered inside the scan
    if config.zero_stage == 3:
        runner = zero.GatherPerLayer(inner=pipeline)
    module = vit.create(config.model, num_classes=info.num_classes, patch_size=config.patch_size,
                        dropout_rate=config.dropout_rate, remat=config.remat,
                        scan_layers=config.scan_layers, layer_runner=runner,
                        **model_dims(config))
    steps_per_epoch = data.steps_per_epoch(info, config.batch_size)
    total_steps = steps_per_epoch * config.num_epochs
    if config.max_steps is not None:
        total_steps = min(total_steps, config.max_steps)
    short = shorter_than_warmup(total_steps, config.warmup_steps)
    if short:
        warnings.warn(short, ConfigWarning, stacklevel=2)
    model = apply_policy(module, mp)
    apply_fn = model.apply
    if config.framework == "nnx":
        abstract = nnx.eval_shape(lambda: apply_policy(vit_nnx.ViT(
            **_fields(module), image_size=config.image_size, channels=info.image_shape[-1],
            rngs=nnx.Rngs(0)), mp))
        apply_fn, _ = nnx_functional.functional(abstract)
    return Experiment(config, mp, mesh, info, model, pipeline,
                      build_optimizer(config, total_steps, mp), steps_per_epoch, total_steps,
                      apply_fn, parallel.hardware(mesh))


def shorter_than_warmup(total_steps: int, warmup_steps: int) -> str | None:
    """The one-line warning for a run of fewer steps than its learning-rate warm-up (None:
    the warm-up fits). Such a run never reaches the cosine decay (:func:`build_optimizer`
    squeezes the warm-up into it), and trains poorly.

    Example:
      >>> print(shorter_than_warmup(22, 50))  # doctest: +ELLIPSIS
      The run has 22 steps, fewer than --config.warmup_steps=50: ...
    """
    if total_steps >= warmup_steps:
        return None
    return (f"The run has {total_steps} steps, fewer than --config.warmup_steps={warmup_steps}: "
            "the learning rate rises for the whole run and never decays. Lower "
            f"--config.warmup_steps (e.g. {max(total_steps // 10, 1)}) or train longer "
            "(--config.num_epochs or --config.max_steps).")


def _fields(module: nn.Module) -> dict[str, Any]:
    """A linen module's dataclass fields (the NNX ViT takes the linen ViT's)."""
    return {f.name: getattr(module, f.name) for f in dataclasses.fields(module)
            if f.name not in ("parent", "name")}


def _create_state(exp: Experiment, rng: jax.Array) -> train_state.TrainState:
    images = jnp.zeros((1, exp.config.image_size, exp.config.image_size,
                        exp.info.image_shape[-1]), jnp.float32)
    variables = exp.model.init({"params": rng}, images)
    if exp.config.get("framework") == "nnx":
        # The NNX ViT gets the linen ViT's initial weights: the same seed trains the
        # same numbers in both APIs. Its policy is applied in place, then it runs as a
        # function of its (logically annotated) parameters like linen's apply.
        with nn.logical_axis_rules(parallel.LOGICAL_AXIS_RULES):  # NNX reads them at build
            model = vit_nnx.from_linen(exp.model, variables["params"],
                                       image_size=exp.config.image_size)
        model = apply_policy(model, exp.precision)
        _, params = nnx_functional.functional(model, boxed=True)
        # The model's fp8 state (if any), per layer as linen's collection, beside the params.
        extra = {} if exp.precision.fp8 is None else exp.precision.fp8.strategy.nnx_variables(model)
        return _new_state(exp, exp.apply_fn, params, extra)
    return _new_state(exp, exp.model.apply, variables["params"], variables)


def _new_state(exp: Experiment, apply_fn: Callable[..., Any], params: Any,
               variables: dict[str, Any]) -> train_state.TrainState:
    """flax's TrainState, or the fp8 strategy's (delayed scaling: its state beside the params)."""
    if exp.precision.fp8 is None:
        return train_state.TrainState.create(apply_fn=apply_fn, params=params, tx=exp.tx)
    extra = {k: _per_layer_axes(v) for k, v in variables.items() if k != "params"}
    return exp.precision.fp8.strategy.create_train_state(apply_fn=apply_fn, params=params,
                                                         tx=exp.tx, variables=extra)


def _per_layer_axes(state: Any) -> Any:
    """The fp8 state with logical axis names: the scanned blocks' ``[layers, n]`` are split
    like their parameters (over 'pipe' stages), every other entry is replicated."""
    return jax.tree_util.tree_map(
        lambda x: nn.LogicallyPartitioned(x, ("layers", None) if x.ndim == 2 else (None,)),
        state)


def state_shardings(exp: Experiment, rng: jax.Array) -> tuple[Any, Any]:
    """Abstract (unboxed) train state and its shardings from the logical axis rules.

    Example: see the module docstring.
    """
    boxed = jax.eval_shape(lambda r: _create_state(exp, r), rng)
    specs = nn.get_partition_spec(boxed)
    shardings = nn.logical_to_mesh_sharding(specs, exp.mesh, parallel.LOGICAL_AXIS_RULES)
    shardings = zero.state_shardings(shardings, nn.unbox(boxed), exp.config.zero_stage)
    abstract = jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        nn.unbox(boxed), shardings)
    return abstract, shardings


def init_state(exp: Experiment, rng: jax.Array, shardings: Any) -> train_state.TrainState:
    """The initial train state, created sharded (call under ``jax.set_mesh(exp.mesh)``).

    Example: see the module docstring.
    """
    return jax.jit(lambda r: nn.unbox(_create_state(exp, r)), out_shardings=shardings)(rng)


def zero_plan(exp: Experiment, abstract: Any) -> zero.Plan:
    """What the step does for ``config.zero_stage`` (:class:`jamp.parallel.zero.Plan`).

    ``abstract`` is the state from :func:`state_shardings`: each parameter's split
    dimension (stage 2 reduce-scatters its gradient there, stage 3 stores it split
    there), the dtype the model reads each parameter in (stage 3 gathers in it), and
    the scanned encoder layers (stage 3 gathers them one at a time).

    Example: see the module docstring (``jamp.train.jit_train_step`` builds the step with it).
    """
    stage = exp.config.zero_stage
    params = abstract.params
    specs = jax.tree_util.tree_map(lambda a: zero.without_data(a.sharding.spec), params)
    return zero.make_plan(
        stage, params, exp.mesh, specs,
        read_dtypes=_read_dtypes(exp, abstract) if stage == 3 else None,
        per_layer=("encoder", "layers") if exp.config.scan_layers else None,
        beside=differentiated_variables(abstract))  # e.g. the fp8 state: never split


def _read_dtypes(exp: Experiment, abstract: Any) -> Any:
    """The dtype the model reads each parameter in (stage 3 gathers it in that dtype),
    from the jaxpr of a forward pass (:func:`jamp.parallel.read_dtypes.read_dtypes`)."""
    plain = lambda tree: jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)
    extras = plain(differentiated_variables(abstract))
    size, channels = exp.config.image_size, exp.info.image_shape[-1]
    # The whole batch: a pipelined model splits it into microbatches.
    images = jax.ShapeDtypeStruct((exp.config.batch_size, size, size, channels), jnp.float32)
    return read_dtypes(lambda p, x, e: exp.apply_fn({"params": p, **e}, x, train=False),
                       plain(abstract.params), images, extras)
