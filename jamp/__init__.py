"""jamp: mixed-precision training for JAX/Flax.

Precision policies applied to Flax modules, dynamic loss scaling as an optax
transformation, fp32 master weights, and memory accounting.

Example:
  >>> import jamp
  >>> mp = jamp.mixed_precision("bf16")
  >>> str(mp.policy)
  'p=full,c=bf16,o=full'
"""

from jamp import fp8, optim_state, tensor_stats
from jamp.apply import PolicyModule, apply_policy, policy_scope, to_mixed_precision
from jamp.autocast import autocast
from jamp.booster import Boosted, boost
from jamp.inspect import inspect  # the function; `python -m jamp.inspect` is the command
from jamp.loss_scale import (
    DynamicLossScale,
    LossScaleConfig,
    LossScaleDivergedError,
    LossScaleState,
    NoOpLossScale,
    OverflowStats,
    StaticLossScale,
    check_divergence,
    loss_scale,
    overflow_stats,
    scale_loss,
)
from jamp.master import MasterWeightsState, master_params, master_weights
from jamp.memory import MemoryReport, bytes_per_device, memory_report, tree_bytes
from jamp.optim_state import low_precision_state
from jamp.policy import (
    FP8_MODES,
    MODE_ALIASES,
    MODES,
    STATE_MODES,
    MixedPrecision,
    Policy,
    PolicyLike,
    float32_overrides,
    get_policy,
    mixed_precision,
)
from jamp.seed_keys import AMP_TYPE
from jamp.step import eval_step, make_optimizer, train_step

__version__ = "0.1.0"

__all__ = [
    "AMP_TYPE",
    "Boosted",
    "boost",
    "DynamicLossScale",
    "LossScaleConfig",
    "LossScaleDivergedError",
    "LossScaleState",
    "NoOpLossScale",
    "OverflowStats",
    "StaticLossScale",
    "check_divergence",
    "eval_step",
    "loss_scale",
    "make_optimizer",
    "overflow_stats",
    "scale_loss",
    "train_step",
    "MODES",
    "FP8_MODES",
    "STATE_MODES",
    "low_precision_state",
    "optim_state",
    "MODE_ALIASES",
    "MasterWeightsState",
    "MemoryReport",
    "MixedPrecision",
    "Policy",
    "PolicyLike",
    "PolicyModule",
    "apply_policy",
    "autocast",
    "bytes_per_device",
    "float32_overrides",
    "fp8",
    "get_policy",
    "master_params",
    "master_weights",
    "memory_report",
    "mixed_precision",
    "policy_scope",
    "to_mixed_precision",
    "tree_bytes",
    "inspect",
    "tensor_stats",
]
