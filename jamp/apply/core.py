"""The rules a policy applies to a model, written once for both adapters.

:mod:`jamp.apply.linen` and :mod:`jamp.apply.nnx` reach a model's layers in
their framework's own way (method interception, graph traversal); what they do
to each layer comes from here:

- which policy a module runs under: :meth:`jamp.MixedPrecision.policy_for`
  (path pattern, then class override, then the recipe's policy), the norm
  override resolved through :data:`jamp.policy.NORMS`, which each adapter fills
  with its framework's norm classes;
- floating casts of arguments, outputs and parameters: :func:`cast_floating`
  (shared with :func:`jamp.autocast`, whose module defines it);
- where softmax runs in float32: :func:`softmax_rules`, the part of
  :func:`~jamp.autocast.rewrite` a policied model runs under;
- which layers get fp8 matmuls: :func:`fp8_recipe_for`.

Example:
  >>> import jamp
  >>> from jamp.apply import core
  >>> mp = jamp.mixed_precision("fp8")
  >>> core.fp8_recipe_for(mp, mp.policy, "Dense_0").scaling
  'delayed'
  >>> core.fp8_recipe_for(mp, mp.policy, "head") is None  # Fp8Recipe.keep_bf16
  True
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp

from jamp.autocast import Rules, cast_floating, is_floating
from jamp.policy import NORMS, MixedPrecision, Policy

if TYPE_CHECKING:  # the recipe comes from the MixedPrecision; only its type is named here
    from jamp.fp8 import Fp8Recipe

__all__ = ["NORMS", "cast_floating", "computes_in_float32", "fp8_recipe_for", "is_floating",
           "softmax_rules"]


def softmax_rules(mp: MixedPrecision) -> Rules | None:
    """The rules of a policied model's call: float32 softmax and float32 sums, where set.

    In the modes whose softmax runs in float32 (the mixed and fp8 modes), every
    softmax of half-precision logits runs in float32 and every sum of
    half-precision values accumulates in float32, forward and backward
    (:mod:`jamp.accumulate`). Dots follow the layers' dtypes and the parameters'
    reads, so the rewrite casts no dot operands and runs no other op in float32;
    ``None`` where the recipe's softmax does not run in float32 (the pure modes:
    nothing to rewrite).

    Example:
      >>> import jamp
      >>> from jamp.apply.core import softmax_rules
      >>> rules = softmax_rules(jamp.mixed_precision("bf16"))
      >>> rules.cast_dots, rules.float32_sums, softmax_rules(jamp.mixed_precision("bf16_pure"))
      (False, True, None)
    """
    rules = Rules.for_recipe(mp)
    if not rules.softmax:
        return None
    return dataclasses.replace(rules, cast_dots=False, float32_ops=False)


def fp8_recipe_for(mp: MixedPrecision, policy: Policy, name: Any) -> Fp8Recipe | None:
    """The fp8 recipe a layer's matmuls run under, or ``None`` (they stay in the compute dtype).

    A layer runs fp8 when the recipe has fp8, no override applies to it (it runs
    under ``mp.policy`` itself) and its name, the last component of its path, is
    not kept in bf16 (:meth:`jamp.fp8.Fp8Recipe.applies_to`). Whether the layer
    has a matmul to replace is the fp8 installer's question.

    Args:
      mp: the recipe in force.
      policy: the policy the layer runs under (``mp.policy_for(...)``).
      name: the layer's name (linen ``module.name``, an NNX path's last entry), or
        ``None`` for the root.

    Example:
      >>> import jamp
      >>> from jamp.apply.core import fp8_recipe_for
      >>> mp = jamp.mixed_precision("fp8_current", overrides={"out": "f32"})
      >>> fp8_recipe_for(mp, mp.policy_for(object, "out"), "out") is None
      True
    """
    if mp.fp8 is None or policy is not mp.policy:
        return None
    return mp.fp8 if mp.fp8.applies_to(None if name is None else str(name)) else None


def computes_in_float32(policy: Policy) -> bool:
    """Whether ``policy`` computes in float32 (elsewhere the adapters install jamp's attention).

    Example:
      >>> import jamp
      >>> from jamp.apply.core import computes_in_float32
      >>> computes_in_float32(jamp.get_policy("c=bf16")), computes_in_float32(
      ...     jamp.get_policy("f32"))
      (False, True)
    """
    return jnp.dtype(policy.compute_dtype) == jnp.float32
