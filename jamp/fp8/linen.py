"""fp8 in linen models: the layers it reaches, and what the policy interceptor installs.

``jamp.apply_policy`` calls :func:`linen_install` on every bound module under the
policy (no override), :func:`linen_share_over_steps` on every module, and runs an
``nn.Einsum``'s call through :func:`linen_einsum`. What is installed comes from the
recipe's strategy (:mod:`jamp.fp8.recipe`): current scaling sets ``dot_general``,
delayed scaling sets ``dot_general_cls`` to flax's ``Fp8DirectDotGeneralOp``
(:func:`linen_dot_general_cls`, one state per matmul in :data:`jamp.fp8.COLLECTION`).

Example:
  >>> import flax.linen as nn, jamp
  >>> layer = nn.Dense(2).clone()
  >>> jamp.fp8.linen_install(layer, jamp.fp8.Fp8Recipe("current")), layer.dot_general.__name__
  (True, 'current_scaling_dot_general')
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import flax.errors
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core.scope import in_filter, union_filters
from flax.linen import fp8_ops

from jamp.fp8.ops import (
    COLLECTION,
    META_NAMES,
    delayed_scaling_dot_general,
    delayed_scaling_einsum_dot,
)

if TYPE_CHECKING:
    from jamp.fp8.recipe import Fp8Recipe


LINEN_LAYERS: tuple[type, ...] = (nn.Dense, nn.DenseGeneral, nn.Einsum)
"""Linen layers whose matmul the fp8 modes replace, by way of the policy interceptor.

Besides these, any linen module declaring both ``dot_general`` and
``dot_general_cls`` dataclass fields (flax's injection convention, as
``nn.Dense``/``nn.DenseGeneral`` do: ``dot_general_cls()`` is instantiated once
per matmul, else ``dot_general`` is called, else ``lax.dot_general``), such as
the ViT's :class:`jamp.models.vit.SelfAttention` (its four projections). Flax's
``nn.Einsum`` has no such hook: the interceptor runs its call through
:func:`linen_einsum` instead.
"""

def linen_dot_general_cls(recipe: Fp8Recipe) -> Any:
    """The linen ``dot_general_cls`` of a delayed recipe: flax's ``Fp8DirectDotGeneralOp``.

    (A subclass of it with the recipe's history length and a clear error when
    the state collection is missing: an ``nn.scan`` without it in
    ``variable_axes``, or ``apply`` without ``variables[COLLECTION]``.)

    Example:
      >>> import jamp
      >>> jamp.fp8.linen_dot_general_cls(jamp.fp8.Fp8Recipe()).__name__
      'Fp8DirectDotGeneralOp'
    """
    return dot_general_op(recipe.amax_history_length)


def _linen_meta(op: nn.Module) -> dict[str, jax.Array]:
    """The six state values of a bound ``Fp8DirectDotGeneralOp`` (runs its ``setup``)."""
    return {n: getattr(op, n).value for n in META_NAMES}


@functools.cache
def dot_general_op(length: int) -> type:
    """flax's ``Fp8DirectDotGeneralOp`` keeping ``length`` steps of amax history.

    (A subclass of it, with a clear error when the state collection is missing.)

    Example:
      >>> import jamp
      >>> jamp.fp8.linen.dot_general_op(16).amax_history_length
      16
    """
    def setup(self):
        try:
            fp8_ops.Fp8DirectDotGeneralOp.setup(self)
        except flax.errors.ScopeCollectionNotFound:
            raise ValueError(
                f"fp8 delayed scaling (mode 'fp8') at {'/'.join(self.scope.path)}: the "
                f"{COLLECTION!r} variable collection is missing. Under nn.scan add it to "
                f"variable_axes (e.g. {{'params': 0, jamp.fp8.COLLECTION: 0}}: one state per "
                "layer); in apply pass variables[jamp.fp8.COLLECTION] from init (the train "
                "step does so for a jamp.fp8.TrainState); or use mode 'fp8_current', which "
                "keeps no state. (An nn.RNN gets the collection in its variable_broadcast "
                "from jamp.apply_policy: one state shared by the time steps.)") from None

    def call(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
        del precision, preferred_element_type  # fp8 has one precision; output: rhs's dtype
        return delayed_scaling_dot_general(lhs, rhs, dimension_numbers, _linen_meta(self))

    # A subclass (not a partial): flax names the submodule after its class.
    return type("Fp8DirectDotGeneralOp", (fp8_ops.Fp8DirectDotGeneralOp,),
                {"__annotations__": {"amax_history_length": int},
                 "amax_history_length": length, "setup": setup, "__call__": call,
                 "__module__": __name__})


def _declares_dot_general(module: nn.Module) -> bool:
    fields = getattr(type(module), "__dataclass_fields__", {})
    return "dot_general" in fields and "dot_general_cls" in fields


def delayed_einsum_dot(amax_history_length: int) -> Any:
    """An ``nn.Einsum``'s ``_dot_general`` for delayed scaling, its state a new child op.

    Call it inside the Einsum's ``__call__`` (:func:`linen_einsum` does): the state is
    read from an ``Fp8DirectDotGeneralOp`` child (as a ``Dense``'s) before ``jnp.einsum``
    traces its contraction under its own ``jit``, where a module must not create variables.

    Example: see :func:`linen_einsum`.
    """
    return delayed_scaling_einsum_dot(_linen_meta(dot_general_op(amax_history_length)()))


def linen_install(module: nn.Module, recipe: Fp8Recipe) -> bool:
    """Gives a bound linen layer its fp8 matmul (called by the policy interceptor).

    Returns whether ``module`` runs its matmuls in fp8: it is an ``nn.Einsum``
    or declares both ``dot_general`` and ``dot_general_cls`` fields (``Dense``,
    ``DenseGeneral``, the ViT's ``SelfAttention``: see :data:`LINEN_LAYERS`),
    and its name is not in ``recipe.keep_bf16``. Delayed scaling sets
    ``dot_general_cls`` to flax's ``Fp8DirectDotGeneralOp`` (one state in
    :data:`COLLECTION` per matmul, under the layer); current scaling sets
    ``dot_general``. An ``nn.Einsum`` has neither field: nothing is set, and
    the interceptor calls :func:`linen_einsum` in place of its ``__call__``.

    Example:
      >>> import flax.linen as nn, jamp
      >>> install = lambda module: jamp.fp8.linen_install(module, jamp.fp8.Fp8Recipe())
      >>> install(nn.LayerNorm()), install(nn.Dense(2)), install(nn.Einsum((2, 3), "bi,io->bo"))
      (False, True, True)
      >>> install(nn.Dense(2, name="head"))  # keep_bf16
      False
    """
    if not recipe.applies_to(module.name):
        return False
    if isinstance(module, nn.Einsum) and not _declares_dot_general(module):
        return True
    if not _declares_dot_general(module):
        return False
    name, value = recipe.strategy.linen_field()
    if getattr(module, name) is not value:
        object.__setattr__(module, name, value)  # bound modules are per-scope clones
    return True


def linen_share_over_steps(module: nn.Module, recipe: Fp8Recipe) -> bool:
    """Makes a bound ``nn.RNN`` share its cell's delayed-scaling state over the time steps.

    ``nn.RNN`` scans its cell with ``nn.scan``, which knows only the collections it
    is told about: the cell's fp8 state (:data:`COLLECTION`) is added to its
    ``variable_broadcast``, so every step reads the same state and its new value is
    the max over the steps (the ``fm32`` combination), as for a layer applied
    several times. The policy interceptor calls this on every module in mode
    ``"fp8"``; returns whether it changed ``module``.

    Example:
      >>> import flax.linen as nn, jamp
      >>> jamp.fp8.linen_share_over_steps(nn.RNN(nn.LSTMCell(4)), jamp.fp8.Fp8Recipe())
      True
    """
    if recipe.strategy.collection is None or not isinstance(module, nn.RNN):
        return False  # no state to share, or no nn.RNN
    broadcast = module.variable_broadcast
    if in_filter(broadcast, COLLECTION) or any(
            in_filter(f, COLLECTION) for f in module.variable_axes):
        return False  # already shared, or stacked per step on purpose
    shared = union_filters(broadcast, COLLECTION)
    object.__setattr__(module, "variable_broadcast", shared)  # bound modules are clones
    return True


def linen_einsum(module: nn.Einsum, recipe: Fp8Recipe, inputs: jax.Array,
                 einsum_str: str | None = None) -> jax.Array:
    """``nn.Einsum.__call__`` with its contraction an fp8 matmul (the policy interceptor's).

    Flax's ``nn.Einsum`` calls ``jnp.einsum`` itself, with no ``dot_general``
    hook (its only injectable field, ``promote_dtype``, runs before the contraction
    and cannot change it), so in the fp8 modes the policy interceptor runs this in place of its
    ``__call__``: the same steps (its ``kernel`` and ``bias`` params through
    ``module.param``, the bias shape from the Einsum's own ``_get_bias_shape``,
    its ``promote_dtype``, ``precision`` and ``preferred_element_type``), the
    same parameter tree, with ``jnp.einsum(..., _dot_general=...)`` doing the
    contraction in fp8. Delayed scaling keeps its state in an
    ``Fp8DirectDotGeneralOp`` child of the Einsum (as a ``Dense``'s: one state
    per Einsum in :data:`COLLECTION`), read before ``jnp.einsum`` (which
    traces its contraction under its own ``jit``, where a flax module must not
    create variables). Where ``jnp.einsum`` puts the kernel first (the output
    lists the kernel's free axes first) the state's ``input_*`` and
    ``kernel_*`` entries trade places; each still scales its own operand.

    Args:
      module: a bound ``nn.Einsum``, inside its ``__call__`` (the interceptor's
        ``next_fun`` context).
      recipe: the fp8 recipe.
      inputs, einsum_str: the arguments of ``nn.Einsum.__call__``.

    Returns:
      The Einsum's output.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn, jamp
      >>> model = jamp.apply_policy(nn.Einsum((3, 2, 4), "bi,ihd->bhd"), "fp8")
      >>> v = jax.jit(model.init)(jax.random.key(0), jnp.ones((5, 3)))
      >>> sorted(v["params"]), sorted(v[jamp.fp8.COLLECTION])
      (['bias', 'kernel'], ['Fp8DirectDotGeneralOp_0'])
    """
    if not isinstance(module, nn.Einsum):
        raise TypeError(f"linen_einsum runs an nn.Einsum's call, got {type(module).__name__}.")
    einsum_str = nn.merge_param("einsum_str", module.einsum_str, einsum_str).replace(" ", "")
    if "->" not in einsum_str:
        raise ValueError('`einsum_str` equation must be explicit and include "->".')
    if einsum_str.count(",") != 1:
        raise ValueError(
            "`einsum_str` equation must have exactly two operands and therefore, exactly one "
            f"comma character, instead of {einsum_str.count(',')}")
    kernel = module.param("kernel", module.kernel_init, module.shape, module.param_dtype)
    bias = None
    if module.use_bias:
        bias_shape, broadcast_shape = module._get_bias_shape(einsum_str, inputs, kernel)
        bias = module.param("bias", module.bias_init, bias_shape, module.param_dtype)
    inputs, kernel, bias = module.promote_dtype(inputs, kernel, bias, dtype=module.dtype)
    dot = recipe.strategy.linen_einsum_dot()  # delayed: its state, a child of ``module``
    y = jnp.einsum(einsum_str, inputs, kernel, precision=module.precision,
                   preferred_element_type=module.preferred_element_type, _dot_general=dot)
    if bias is not None:
        y += jnp.reshape(bias, broadcast_shape)
    return y
