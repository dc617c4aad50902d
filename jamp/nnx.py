"""Old home of the NNX adapter, kept so that ``from jamp.nnx import ...`` still works.

The adapter lives in :mod:`jamp.apply.nnx`; ``jamp.apply_policy`` takes NNX modules.

Example:
  >>> import jamp.nnx
  >>> jamp.nnx.policy_of is jamp.apply.nnx.policy_of
  True
"""

from jamp.apply.nnx import dot_product_attention, norm_in_float32, policy_of

__all__ = ["dot_product_attention", "norm_in_float32", "policy_of"]
