"""The ViT recipe as an ``ml_collections`` config, shared by ``jamp/configs/vit_*.py``.

Every recipe ``jamp/configs/vit_<mode>.py`` is ``vit_config("<mode>", arg)``: the files differ
only in the precision mode, so runs compare cleanly. ``arg`` selects a model
variant and a TFDS dataset (``"b16,caltech101"``, ``"s16,cifar10"``,
``"b16,imagenet2012"``); no arg trains the embedded offline digits dataset.

Each field is declared once, in :data:`FIELDS`: its default, its one line of help
(``jamp.train --help``) and the range its value must lie in (checked by
:func:`jamp.experiment.check_values` before anything is built). :func:`vit_config`
starts from those defaults and adjusts a few per dataset.

Example:
  >>> from jamp.config import vit_config
  >>> c = vit_config("fp16", "s16,cifar10")
  >>> c.model, c.patch_size, c.dataset, c.batch_size
  ('s', 16, 'cifar10', 128)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import ml_collections
from ml_collections import config_dict

from jamp.models.sizes import parse_variant
from jamp.policy import MODE_ALIASES


class Limit(NamedTuple):
    """The range a numeric field's value must lie in, in code and in words."""

    test: Callable[[Any], bool]
    requirement: str  # e.g. ">= 1", shown in the error
    example: str  # a valid value, shown in the error


class Field(NamedTuple):
    """One config field: its default, one line of help and its limits (None: any value).

    A ``default`` that is a type (``int``, ``str``...) declares a field that is None
    unless set (an ``ml_collections`` placeholder of that type); such a field may stay
    None whatever its limits.
    """

    default: Any
    help: str
    limits: Limit | None = None


def _at_least(low: float, example: str, note: str = "") -> Limit:
    return Limit(lambda v: v >= low, f">= {low}{note}", example)


def _in(low: float, high: float, example: str, words: str | None = None) -> Limit:
    return Limit(lambda v: low <= v < high, words or f"in [{low}, {high})", example)


_SIZE_DEFAULT = " (or None for the size's default)"

FIELDS: dict[str, Field] = {
    # The run.
    "mode": Field("fp16", "precision mode: fp32, fp16, bf16, fp16_naive, fp16_pure (unsafe), "
                  "bf16_pure, fp8 (delayed scaling), fp8_current, or an alias (O1, 16-mixed, "
                  "bf16-mixed, ...)"),
    "seed": Field(0, "seed of the parameter init, dropout and data order (0 <= seed < 2**32)",
                  _in(0, 2**32, "0", "in [0, 2**32)")),
    # Data.
    "dataset": Field("digits", "TFDS dataset name; 'digits' is the embedded offline dataset"),
    "data_dir": Field(str, "where TFDS datasets are prepared (None: $TFDS_DATA_DIR or "
                      "~/tensorflow_datasets)"),
    "image_size": Field(224, "input images are resized/cropped to this many pixels a side",
                        _at_least(1, "32")),
    "worker_count": Field(0, "grain worker processes for the train loader (0: load in this "
                          "process)", _at_least(0, "0")),
    "augment": Field(True, "random crop (+ flip where it keeps the label) on the train split"),
    # Model.
    "framework": Field("linen", "the ViT's Flax API: 'linen' or 'nnx' (same initial weights; "
                       "bit-identical steps until the clipping norm, summed in each API's "
                       "parameter order, rounds differently on a clipped step; then the runs "
                       "part like two seeds)"),
    "model": Field("ti", "ViT size: ti, s, b or l (the :arg's model, e.g. s16 -> s with patch "
                   "16)"),
    "patch_size": Field(16, "patch side in pixels (must divide image_size)", _at_least(1, "4")),
    "num_layers": Field(int, "encoder blocks (None: the size's default)",
                        _at_least(1, "4", _SIZE_DEFAULT)),
    "hidden_size": Field(int, "embedding width (None: the size's default)",
                         _at_least(1, "64", _SIZE_DEFAULT)),
    "num_heads": Field(int, "attention heads; must divide hidden_size (None: the size's "
                       "default)", _at_least(1, "4", _SIZE_DEFAULT)),
    "mlp_dim": Field(int, "MLP hidden units (None: the size's default)",
                     _at_least(1, "128", _SIZE_DEFAULT)),
    "dropout_rate": Field(0.0, "dropout probability in [0, 1)", _in(0, 1, "0.1")),
    "remat": Field(False, "rematerialise each encoder block in the backward pass (less "
                   "memory, more compute)"),
    "scan_layers": Field(True, "run the encoder blocks with nn.scan (needed for pipelining)"),
    # Optimisation (the Colossal-AI ViT recipe: batch 128, linear warm-up).
    "batch_size": Field(128, "global batch size, split over processes, 'data' shards and "
                        "microbatches", _at_least(1, "64")),
    "num_epochs": Field(30, "epochs over the train split", _at_least(1, "10")),
    "optimizer": Field("adamw", "'adamw' or 'sgd'"),
    "learning_rate": Field(1e-3, "peak learning rate (> 0) after linear warm-up, then cosine "
                           "decay", Limit(lambda v: v > 0, "> 0", "0.001")),
    "weight_decay": Field(0.05, "decoupled weight decay (>= 0)", _at_least(0, "0.05")),
    "momentum": Field(0.9, "SGD momentum in [0, 1) (optimizer='sgd' only)", _in(0, 1, "0.9")),
    "warmup_steps": Field(50, "linear warm-up steps (>= 0)", _at_least(0, "50")),
    "grad_clip_norm": Field(1.0, "clip gradients to this global norm (0: no clipping)",
                            _at_least(0, "1.0", " (0: no clipping)")),
    "grad_accum_steps": Field(1, "micro-batches per optimizer step (gradient accumulation; "
                              "Colossal-AI's gradient_accumulation): batch_size is the window's "
                              "batch, split into this many micro-batches run one after another, "
                              "their gradients summed in float32 under one loss scale",
                              _at_least(1, "4")),
    "log_num_zeros_in_grad": Field(False, "log the number of exactly-zero gradient elements "
                                   "after unscaling (Megatron/Colossal-AI's "
                                   "log_num_zeros_in_grad) in metrics.jsonl and TensorBoard"),
    "tensor_stats_every": Field(0, "collect per-layer statistics (amax, underflow, zeros, "
                                "non-finite counts of gradients, params and layer outputs; "
                                "jamp.tensor_stats) every N steps into tensor_stats.jsonl and "
                                "TensorBoard (0: off)", _at_least(0, "100", " (0: off)")),
    "label_smoothing": Field(0.0, "label smoothing in [0, 1) of the train loss (the test loss "
                             "has none, so the train loss cannot fall below a floor > 0)",
                             _in(0, 1, "0.1")),
    # Loss scaling: the Colossal-AI fp16=dict(...) fields, readable names. None keeps the
    # mode's default (e.g. fp16: init 2**16, growth 2, backoff 0.5, 2000 steps, divergence
    # after 50 overflows in a row at min_scale); a field the mode's kind of scaling does not
    # read is an error. jamp.experiment.precision_from_config checks them.
    "loss_scale.kind": Field(str, "'none', 'static' or 'dynamic' (None: the mode's)"),
    "loss_scale.init_scale": Field(float, "initial (or static) loss scale (None: the mode's, "
                                   "fp16: 2**16)"),
    "loss_scale.growth_factor": Field(float, "scale multiplier after growth_interval finite "
                                      "steps (> 1)"),
    "loss_scale.backoff_factor": Field(float, "scale multiplier on overflow, in (0, 1)"),
    "loss_scale.growth_interval": Field(int, "finite steps in a row before the scale grows "
                                        "(>= 1)"),
    "loss_scale.hysteresis": Field(int, "overflows tolerated before the scale backs off (>= 1)"),
    "loss_scale.min_scale": Field(float, "the scale never goes below this"),
    "loss_scale.max_scale": Field(float, "the scale never goes above this"),
    "loss_scale.divergence_steps": Field(int, "overflowing steps in a row at min_scale that "
                                         "stop the run (exit status 3)"),
    # Parallelism: a mesh over all devices; -1 takes the rest.
    "mesh.data": Field(-1, "devices on the 'data' axis (data parallelism; -1: the rest)"),
    "mesh.model": Field(1, "devices on the 'model' axis (tensor parallelism; -1: the rest)"),
    "mesh.pipe": Field(1, "devices on the 'pipe' axis (pipeline stages; -1: the rest)"),
    "pipeline_microbatches": Field(4, "microbatches per step when mesh.pipe > 1 (>= 1)",
                                   _at_least(1, "4")),
    "zero_stage": Field(0, "ZeRO stage over the 'data' axis: 0 none, 1 optimizer state and "
                        "master copy split, 2 + gradients (float32 reduce-scatter), 3 + "
                        "parameters (FSDP: gathered per layer in the compute dtype)",
                        Limit(lambda v: v in (0, 1, 2, 3), "0, 1, 2 or 3", "1")),
    "optimizer_state": Field(str, "how the optimizer state is stored: float32, bf16, fp8 (fp8 "
                             "mu, float16 sqrt(nu)) or name=dtype pairs such as "
                             "'mu=fp8,nu=fp16,*=bf16' (None: the mode's)"),
    "master_weights": Field(str, "master copy of bf16 params: float32, remainders (exact, "
                            "2 B), kahan (2 B), stochastic (0 B), none (lossy) (None: the "
                            "mode's)"),
    "fp8_amax_history_length": Field(int, "mode fp8 (delayed scaling): steps of amax history "
                                     "per tensor (>= 1; None: 1024, Transformer Engine's "
                                     "default)", _at_least(1, "1024", " (or None: 1024)")),
    # Loop.
    "log_every_steps": Field(10, "write train metrics every this many steps (>= 1)",
                             _at_least(1, "10")),
    "eval_every_epochs": Field(1, "evaluate on the test split every this many epochs (>= 1)",
                               _at_least(1, "1")),
    "checkpoint_every_steps": Field(100, "save a checkpoint every this many steps (>= 1)",
                                    _at_least(1, "100")),
    "keep_checkpoints": Field(2, "how many recent checkpoints to keep (>= 1)",
                              _at_least(1, "2")),
    "max_steps": Field(int, "stop after this many steps (None: num_epochs; >= 1)",
                       _at_least(1, "100", " (or None: train num_epochs)")),
    "progress": Field(True, "show a progress bar on stderr"),
    "plot": Field(True, "write training.png at the end"),
}
"""Every field of :func:`vit_config` by its dotted key: default, help and limits."""

FIELD_HELP: dict[str, str] = {key: field.help for key, field in FIELDS.items()}
"""One line of meaning for every field (``jamp.train --help`` lists them with their
defaults; ``tests/test_cli.py`` checks that none is missing)."""

# Image size and patch size per dataset: 224/16 (the defaults above) as in the
# Colossal-AI recipe for large images, smaller patches for small images.
_DATASETS = {
    "digits": dict(image_size=8, patch_size=2),
    "mnist": dict(image_size=28, patch_size=4),
    "fashion_mnist": dict(image_size=28, patch_size=4),
    "cifar10": dict(image_size=32, patch_size=4),
    "cifar100": dict(image_size=32, patch_size=4),
}

# The embedded digits: sized to reach ~98% test accuracy in about a minute on a 2-core
# CPU, with the modes within a point of each other (lr 2e-3 / wd 0.01 gave ~96%, and seed
# noise between modes of about 1.5 points on the 360 test images). 8x8 images: a 1-pixel
# random crop moves a digit by 1/8 of its size, so no augmentation.
_DIGITS = dict(num_layers=4, hidden_size=64, num_heads=4, mlp_dim=128, batch_size=64,
               num_epochs=50, learning_rate=3e-3, weight_decay=0.1, label_smoothing=0.1,
               augment=False, checkpoint_every_steps=200)


def _parse_arg(arg: str | None) -> tuple[str | None, int | None, str]:
    if not arg:
        return None, None, "digits"
    parts = [p.strip() for p in arg.split(",") if p.strip()]
    if len(parts) != 2:
        raise ValueError(
            f"Config argument {arg!r} must be '<model>,<dataset>', e.g. 'b16,caltech101', "
            "'s16,cifar10' or 'b16,imagenet2012' (or nothing for the embedded digits)."
        )
    model, dataset = parts
    return *parse_variant(model, None), dataset


def vit_config(mode: str, arg: str | None = None) -> ml_collections.ConfigDict:
    """Returns the ViT training config for a precision mode.

    Args:
      mode: a jamp mode name (``"fp16"``, ``"bf16"``, ``"fp16_naive"``...).
      arg: ``None`` for the embedded digits, or ``"<model>,<dataset>"``.

    Returns:
      A locked ``ConfigDict`` of the :data:`FIELDS`: unknown keys are rejected on
      override.

    Example:
      >>> from jamp.config import vit_config
      >>> vit_config("bf16").dataset
      'digits'
    """
    if mode not in MODE_ALIASES:
        raise ValueError(f"Unknown mode {mode!r}; valid: {sorted(MODE_ALIASES)}.")
    size, patch, dataset = _parse_arg(arg)
    c = ml_collections.ConfigDict()
    for key, field in FIELDS.items():
        default = field.default
        _set(c, key, config_dict.placeholder(default) if isinstance(default, type) else default)
    changes = dict(mode=mode, dataset=dataset, **_DATASETS.get(dataset, {}))
    if size:
        changes.update(model=size)
    if patch:
        changes.update(patch_size=patch)
    if dataset == "imagenet2012":
        changes.update(num_epochs=90)
    if dataset == "digits":
        changes.update(_DIGITS)
    for key, value in changes.items():
        _set(c, key, value)
    c.lock()
    return c


def _set(config: ml_collections.ConfigDict, key: str, value: Any) -> None:
    """``config[key] = value`` for a dotted key, creating the parents."""
    *parents, leaf = key.split(".")
    for parent in parents:
        if parent not in config:
            config[parent] = ml_collections.ConfigDict()
        config = config[parent]
    config[leaf] = value
