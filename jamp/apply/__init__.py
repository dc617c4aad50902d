"""Where a precision policy meets a model, and nowhere else.

:func:`apply_policy` takes a Flax linen or NNX module and dispatches to its
framework's adapter: :mod:`jamp.apply.linen` (method interception, a
:class:`PolicyModule` wrapper, :func:`policy_scope`) or :mod:`jamp.apply.nnx`
(in place). Both apply the rules of :mod:`jamp.apply.core`, written once: the
floating casts, where softmax runs in float32, which layers get fp8 matmuls, and
the norm override (:data:`jamp.policy.NORMS`), which each adapter resolves to
its own norm classes. A plain JAX function takes :func:`jamp.autocast` instead.

Example:
  >>> import jax.numpy as jnp, flax.linen as nn, jamp
  >>> from flax import nnx
  >>> type(jamp.apply_policy(nn.Dense(2), "bf16")).__name__
  'PolicyModule'
  >>> jamp.apply_policy(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), "bf16")(jnp.ones((1, 3))).dtype
  dtype('float32')
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen
import flax.nnx

# The adapters' module names shadow flax's here: flax.linen / flax.nnx are spelt out.
from jamp.apply import linen, nnx
from jamp.apply.linen import PolicyModule, policy_scope
from jamp.apply.nnx import policy_of
from jamp.policy import OverrideKey, PolicyLike, to_mixed_precision

__all__ = ["PolicyModule", "apply_policy", "policy_of", "policy_scope", "to_mixed_precision"]


def apply_policy(
    module: flax.linen.Module | flax.nnx.Module,
    policy_or_mode: PolicyLike,
    overrides: Mapping[OverrideKey, Any] | None = None,
) -> PolicyModule | flax.nnx.Module:
    """Returns ``module`` wrapped to run under a precision policy.

    The result is a normal Flax module: use ``init``/``apply`` as usual. The
    parameter tree is the same as ``module``'s; parameters are created in the
    param dtype, every submodule computes in the compute dtype (except modules
    with an override: by default the norms run in float32 and return the
    compute dtype, and attention softmax runs in float32), and the top-level
    output is in the output dtype.

    Overrides come in two kinds. A *module class* key applies to that class and
    its subclasses. A *string* key is a regular expression matched in full
    (``re.fullmatch``, as Keras 3's ``DTypePolicyMap``) against each module's
    path, its names joined with ``"/"``: ``"head"``, ``"Conv_0"``,
    ``"Encoder_0/.*"`` (the modules inside ``Encoder_0``); the paths are those of
    ``module.init``'s parameter tree, ``setup`` attribute names and lifted
    modules (``"ScanBlock_0/Dense_0"``) included. A path pattern beats a class
    override, which beats the mode's policy. A key equal to the path wins;
    otherwise a path matched by two patterns is a ``ValueError`` naming both,
    raised when the module is first reached (at ``init``); a pattern matching no
    module called by ``init`` through ``__call__`` is a ``ValueError`` naming it
    and listing the real paths. Values are policies or policy strings
    (``"f32"``, ``"p=f32,c=bf16,o=f32"``); a module under an override returns
    its override's output dtype.

    An ``nnx.Module`` is put under the policy in place and returned (see
    :mod:`jamp.apply.nnx`); its paths are graph paths (``"blocks/0/mlp"``).

    Args:
      module: any ``flax.linen.Module``, with or without dtype arguments, or
        any ``flax.nnx.Module``.
      policy_or_mode: a mode name (``"fp16"``, ``"bf16"``, ``"O2"``...), a
        jmp-style policy string, a ``jamp.Policy`` or a ``jamp.MixedPrecision``.
      overrides: optional ``{module class or path pattern: policy}``. Its classes
        replace the mode's class overrides (the float32 norms, keyed
        :data:`jamp.policy.NORMS`: pass them along to keep them) and its patterns
        the recipe's patterns; a kind it does not
        mention is kept, so ``{"head": "f32"}`` keeps the float32 norms (see
        :func:`jamp.policy.replace_overrides`). A subclass follows its parent's
        override unless it has its own.

    Returns:
      A :class:`PolicyModule` wrapping a linen ``module``; an NNX ``module`` itself.

    Raises:
      TypeError: for anything but a linen or NNX module (a plain function takes
        :func:`jamp.autocast`).
      ValueError: for an override key that is neither a module class nor a valid
        regular expression, or a value that is not a policy.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn, jamp
      >>> model = jamp.apply_policy(nn.Dense(4), "bf16_pure")
      >>> v = model.init(jax.random.key(0), jnp.ones((1, 3)))
      >>> v["params"]["kernel"].dtype
      dtype(bfloat16)

      Keep the classifier head in float32 (bfloat16 elsewhere):

      >>> class Net(nn.Module):
      ...   @nn.compact
      ...   def __call__(self, x):
      ...     return nn.Dense(2, name="head")(nn.relu(nn.Dense(8)(x)))
      >>> model = jamp.apply_policy(Net(), "bf16_pure", overrides={"head": "f32"})
      >>> v = model.init(jax.random.key(0), jnp.ones((1, 3)))
      >>> v["params"]["head"]["kernel"].dtype, v["params"]["Dense_0"]["kernel"].dtype
      (dtype('float32'), dtype(bfloat16))
    """
    if isinstance(module, flax.nnx.Module):
        return nnx.apply_recipe(module, to_mixed_precision(policy_or_mode, overrides))
    if isinstance(module, flax.linen.Module):
        return linen.apply_recipe(module, to_mixed_precision(policy_or_mode, overrides))
    raise TypeError(
        f"apply_policy expects a flax.linen.Module or a flax.nnx.Module, got "
        f"{type(module).__name__}. For a plain JAX function (jnp, Equinox, Haiku), use "
        "jamp.autocast(fn, mode); to cast values, jamp.get_policy(...).cast_to_compute."
    )
