"""jamp: mixed-precision training for JAX/Flax.

Precision policies applied to Flax modules, dynamic loss scaling as an optax
transformation, fp32 master weights, and memory accounting.

Example:
  >>> import jamp
  >>> mp = jamp.mixed_precision("bf16")
  >>> str(mp.policy)
  'p=full,c=bf16,o=full'
"""

from jamp.flax import PolicyModule, apply_policy, policy_scope, to_mixed_precision
from jamp.master import MasterWeightsState, master_params, master_weights
from jamp.memory import MemoryReport, memory_report, tree_bytes
from jamp.policy import (
    MODE_ALIASES,
    MODES,
    MixedPrecision,
    Policy,
    float32_overrides,
    get_policy,
    mixed_precision,
)

__version__ = "0.1.0"

__all__ = [
    "MODES",
    "MODE_ALIASES",
    "MasterWeightsState",
    "MemoryReport",
    "MixedPrecision",
    "Policy",
    "PolicyModule",
    "apply_policy",
    "float32_overrides",
    "get_policy",
    "master_params",
    "master_weights",
    "memory_report",
    "mixed_precision",
    "policy_scope",
    "to_mixed_precision",
    "tree_bytes",
]
