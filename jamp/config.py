"""The ViT recipe as an ``ml_collections`` config, shared by ``configs/vit_*.py``.

Every ``configs/vit_<mode>.py`` is ``vit_config("<mode>", arg)``: the files differ
only in the precision mode, so runs compare cleanly. ``arg`` selects a model
variant and a TFDS dataset (``"b16,caltech101"``, ``"s16,cifar10"``,
``"b16,imagenet2012"``); no arg trains the embedded offline digits dataset.

Example:
  >>> from jamp.config import vit_config
  >>> c = vit_config("fp16", "s16,cifar10")
  >>> c.model, c.patch_size, c.dataset, c.batch_size
  ('s', 16, 'cifar10', 128)
"""

from __future__ import annotations

import ml_collections
from ml_collections import config_dict

from jamp.models.sizes import parse_variant
from jamp.policy import MODE_ALIASES

# Image size and patch size per dataset: 224/16 as in the Colossal-AI recipe for
# large images, smaller patches for small images.
_DATASETS = {
    "digits": dict(image_size=8, patch_size=2),
    "mnist": dict(image_size=28, patch_size=4),
    "fashion_mnist": dict(image_size=28, patch_size=4),
    "cifar10": dict(image_size=32, patch_size=4),
    "cifar100": dict(image_size=32, patch_size=4),
}
_LARGE = dict(image_size=224, patch_size=16)


FIELD_HELP: dict[str, str] = {
    "mode": "precision mode: fp32, fp16, bf16, fp16_naive, fp16_pure (unsafe), bf16_pure, "
            "fp8 (delayed scaling), fp8_current, or an alias (O1, 16-mixed, bf16-mixed, ...)",
    "seed": "seed of the parameter init, dropout and data order (0 <= seed < 2**32)",
    "dataset": "TFDS dataset name; 'digits' is the embedded offline dataset",
    "data_dir": "where TFDS datasets are prepared (None: $TFDS_DATA_DIR or "
                "~/tensorflow_datasets)",
    "image_size": "input images are resized/cropped to this many pixels a side",
    "worker_count": "grain worker processes for the train loader (0: load in this process)",
    "augment": "random crop (+ flip where it keeps the label) on the train split",
    "framework": "the ViT's Flax API: 'linen' or 'nnx' (same initial weights, same numbers)",
    "model": "ViT size: ti, s, b or l (the :arg's model, e.g. s16 -> s with patch 16)",
    "patch_size": "patch side in pixels (must divide image_size)",
    "num_layers": "encoder blocks (None: the size's default)",
    "hidden_size": "embedding width (None: the size's default)",
    "num_heads": "attention heads; must divide hidden_size (None: the size's default)",
    "mlp_dim": "MLP hidden units (None: the size's default)",
    "dropout_rate": "dropout probability in [0, 1)",
    "remat": "rematerialise each encoder block in the backward pass (less memory, more compute)",
    "scan_layers": "run the encoder blocks with nn.scan (needed for pipelining)",
    "batch_size": "global batch size, split over processes, 'data' shards and microbatches",
    "num_epochs": "epochs over the train split",
    "optimizer": "'adamw' or 'sgd'",
    "learning_rate": "peak learning rate (> 0) after linear warm-up, then cosine decay",
    "weight_decay": "decoupled weight decay (>= 0)",
    "momentum": "SGD momentum in [0, 1) (optimizer='sgd' only)",
    "warmup_steps": "linear warm-up steps (>= 0)",
    "grad_clip_norm": "clip gradients to this global norm (0: no clipping)",
    "label_smoothing": "label smoothing in [0, 1) of the train loss (the test loss has none, "
                       "so the train loss cannot fall below a floor > 0)",
    "loss_scale.kind": "'none', 'static' or 'dynamic' (None: the mode's)",
    "loss_scale.init_scale": "initial (or static) loss scale (None: the mode's, fp16: 2**16)",
    "loss_scale.growth_factor": "scale multiplier after growth_interval finite steps (> 1)",
    "loss_scale.backoff_factor": "scale multiplier on overflow, in (0, 1)",
    "loss_scale.growth_interval": "finite steps in a row before the scale grows (>= 1)",
    "loss_scale.hysteresis": "overflows tolerated before the scale backs off (>= 1)",
    "loss_scale.min_scale": "the scale never goes below this",
    "loss_scale.max_scale": "the scale never goes above this",
    "loss_scale.divergence_steps": "overflowing steps in a row at min_scale that stop the run "
                                   "(exit status 3)",
    "mesh.data": "devices on the 'data' axis (data parallelism; -1: the rest)",
    "mesh.model": "devices on the 'model' axis (tensor parallelism; -1: the rest)",
    "mesh.pipe": "devices on the 'pipe' axis (pipeline stages; -1: the rest)",
    "pipeline_microbatches": "microbatches per step when mesh.pipe > 1 (>= 1)",
    "fp8_amax_history_length": "mode fp8 (delayed scaling): steps of amax history per tensor "
                               "(>= 1; None: 1024, Transformer Engine's default)",
    "log_every_steps": "write train metrics every this many steps (>= 1)",
    "eval_every_epochs": "evaluate on the test split every this many epochs (>= 1)",
    "checkpoint_every_steps": "save a checkpoint every this many steps (>= 1)",
    "keep_checkpoints": "how many recent checkpoints to keep (>= 1)",
    "max_steps": "stop after this many steps (None: num_epochs; >= 1)",
    "progress": "show a progress bar on stderr",
    "plot": "write training.png at the end",
}
"""One line of meaning for every field of :func:`vit_config` (``jamp.train --help`` lists
them with their defaults; ``tests/test_cli.py`` checks that none is missing)."""


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
      A locked ``ConfigDict``: unknown keys are rejected on override.

    Example:
      >>> from jamp.config import vit_config
      >>> vit_config("bf16").dataset
      'digits'
    """
    if mode not in MODE_ALIASES:
        raise ValueError(f"Unknown mode {mode!r}; valid: {sorted(MODE_ALIASES)}.")
    size, patch, dataset = _parse_arg(arg)
    c = ml_collections.ConfigDict()
    c.mode = mode
    c.seed = 0

    # Data.
    c.dataset = dataset
    c.data_dir = config_dict.placeholder(str)
    defaults = _DATASETS.get(dataset, _LARGE)
    c.image_size = defaults["image_size"]
    c.worker_count = 0
    c.augment = True  # random crop (+ flip where it keeps the label)

    # Model.
    c.framework = "linen"  # or "nnx": jamp.models.vit_nnx, from the linen ViT's weights
    c.model = size or "ti"
    c.patch_size = patch or defaults["patch_size"]
    c.num_layers = config_dict.placeholder(int)
    c.hidden_size = config_dict.placeholder(int)
    c.num_heads = config_dict.placeholder(int)
    c.mlp_dim = config_dict.placeholder(int)
    c.dropout_rate = 0.0
    c.remat = False
    c.scan_layers = True

    # Optimisation (the Colossal-AI ViT recipe: batch 128, linear warm-up).
    c.batch_size = 128
    c.num_epochs = 90 if dataset == "imagenet2012" else 30
    c.optimizer = "adamw"
    c.learning_rate = 1e-3
    c.weight_decay = 0.05
    c.momentum = 0.9
    c.warmup_steps = 50
    c.grad_clip_norm = 1.0
    c.label_smoothing = 0.0

    # Loss scaling: the Colossal-AI fp16=dict(...) fields, readable names. None keeps
    # the mode's default (e.g. fp16: init 2**16, growth 2, backoff 0.5, 2000 steps,
    # divergence after 50 overflows in a row at min_scale); a field the mode's kind of
    # scaling does not read is an error. kind: 'none', 'static' or 'dynamic'.
    c.loss_scale = ml_collections.ConfigDict()
    c.loss_scale.kind = config_dict.placeholder(str)
    c.loss_scale.init_scale = config_dict.placeholder(float)
    c.loss_scale.growth_factor = config_dict.placeholder(float)
    c.loss_scale.backoff_factor = config_dict.placeholder(float)
    c.loss_scale.growth_interval = config_dict.placeholder(int)
    c.loss_scale.hysteresis = config_dict.placeholder(int)
    c.loss_scale.min_scale = config_dict.placeholder(float)
    c.loss_scale.max_scale = config_dict.placeholder(float)
    c.loss_scale.divergence_steps = config_dict.placeholder(int)

    # Parallelism: a mesh over all devices; -1 takes the rest.
    c.mesh = ml_collections.ConfigDict(dict(data=-1, model=1, pipe=1))
    c.pipeline_microbatches = 4

    # fp8 (mode fp8): the delayed-scaling amax history; None keeps the recipe's 1024.
    c.fp8_amax_history_length = config_dict.placeholder(int)

    # Loop.
    c.log_every_steps = 10
    c.eval_every_epochs = 1
    c.checkpoint_every_steps = 100
    c.keep_checkpoints = 2
    c.max_steps = config_dict.placeholder(int)  # stop early (tests, smoke runs)
    c.progress = True
    c.plot = True

    if dataset == "digits":
        # Sized to reach ~98% test accuracy in about a minute on a 2-core CPU, with the
        # modes within a point of each other (lr 2e-3 / wd 0.01 gave ~96%, and seed noise
        # between modes of about 1.5 points on the 360 test images). 8x8
        # images: a 1-pixel random crop moves a digit by 1/8 of its size, so no augmentation.
        c.num_layers, c.hidden_size, c.num_heads, c.mlp_dim = 4, 64, 4, 128
        c.batch_size = 64
        c.num_epochs = 50
        c.learning_rate = 3e-3
        c.weight_decay = 0.1
        c.label_smoothing = 0.1
        c.augment = False
        c.checkpoint_every_steps = 200
    c.lock()
    return c
