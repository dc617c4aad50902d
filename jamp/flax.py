"""Applying a precision policy to Flax linen modules.

Flax has no equivalent of Haiku's ``hk.mixed_precision.set_policy``: users write
``dtype=``/``param_dtype=`` on every layer by hand. jamp does it at a distance
with Flax method interception (``nn.intercept_methods``), so it works on modules
written without any dtype arguments:

- every module whose class has ``dtype``/``param_dtype`` fields (all of Flax's
  layers: Dense, Conv, Embed, MultiHeadDotProductAttention, the norms, ...) is
  run with ``dtype=compute_dtype`` and ``param_dtype=param_dtype`` of the policy
  for its class, so parameters are *created and stored* in the param dtype and
  matmuls/convs take compute-dtype operands. The policy wins over dtype
  arguments written in the module;
- floating-point arguments of every module call are cast to its compute dtype;
- modules of an overridden class (by default the norms) compute in their own
  policy's dtype (float32) and return its output dtype (the model's compute
  dtype); attention softmax runs in float32 when the mode says so;
- the top-level output is cast to the policy's output dtype.

Custom modules that call ``self.param`` directly control their own parameter
dtype: give them ``dtype``/``param_dtype`` fields (the Flax convention) and jamp
sets those too.

Example:
  >>> import jax, jax.numpy as jnp, flax.linen as nn, jamp
  >>> class MLP(nn.Module):
  ...   @nn.compact
  ...   def __call__(self, x):
  ...     return nn.Dense(3)(nn.relu(nn.LayerNorm()(nn.Dense(8)(x))))
  >>> model = jamp.apply_policy(MLP(), "fp16")
  >>> variables = model.init(jax.random.key(0), jnp.ones((2, 4)))
  >>> variables["params"]["Dense_0"]["kernel"].dtype, model.apply(variables, jnp.ones((2, 4))).dtype
  (dtype('float32'), dtype('float32'))
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jamp import attention
from jamp.policy import MixedPrecision, Policy, get_policy, mixed_precision

PolicyLike = str | Policy | MixedPrecision


def to_mixed_precision(
    policy_or_mode: PolicyLike, overrides: Mapping[type, Any] | None = None
) -> MixedPrecision:
    """Normalises a mode name, policy string, ``Policy`` or ``MixedPrecision``.

    A mode name ("fp16", "O2", ...) gives that mode with its default overrides.
    A policy (``Policy`` or jmp-style string such as ``"p=f32,c=f16,o=f32"``)
    gives a recipe with that policy and no overrides. ``overrides``, when given,
    maps module classes to policies (or policy strings) and replaces the
    recipe's overrides.

    Example:
      >>> import jamp
      >>> jamp.to_mixed_precision("p=f32,c=bf16,o=f32").overrides
      ()
    """
    if isinstance(policy_or_mode, MixedPrecision):
        mp = policy_or_mode
    elif isinstance(policy_or_mode, Policy):
        mp = MixedPrecision(name="custom", policy=policy_or_mode)
    elif isinstance(policy_or_mode, str):
        try:
            mp = mixed_precision(policy_or_mode)
        except ValueError as mode_error:
            try:
                mp = MixedPrecision(name="custom", policy=get_policy(policy_or_mode))
            except ValueError as policy_error:
                raise ValueError(
                    f"{policy_or_mode!r} is neither a mode nor a policy.\n"
                    f"As a mode: {mode_error}\nAs a policy: {policy_error}"
                ) from None
    else:
        raise TypeError(
            "Expected a mode name, a policy string, a jamp.Policy or a jamp.MixedPrecision, "
            f"got {type(policy_or_mode).__name__}."
        )
    if overrides is not None:
        mp = dataclasses.replace(mp, overrides=tuple(overrides.items()))
    return mp


def _cast_floating(tree: Any, dtype: Any) -> Any:
    def cast(x):
        if isinstance(x, jax.Array | jnp.ndarray) and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return x

    return jax.tree_util.tree_map(cast, tree)


def _set_field(module: nn.Module, name: str, value: Any) -> None:
    fields = getattr(type(module), "__dataclass_fields__", {})
    if name in fields and getattr(module, name) != value:
        # Bound modules are per-scope clones, so this changes only this use.
        object.__setattr__(module, name, value)


def _make_interceptor(mp: MixedPrecision):
    overridden = tuple(cls for cls, _ in mp.overrides)

    def interceptor(next_fun, args, kwargs, context):
        module = context.module
        policy = mp.policy_for(type(module))
        _set_field(module, "dtype", policy.compute_dtype)
        _set_field(module, "param_dtype", policy.param_dtype)
        if (
            mp.softmax_fp32
            and jnp.dtype(policy.compute_dtype) != jnp.float32
            and getattr(module, "attention_fn", None) is nn.dot_product_attention
        ):
            _set_field(module, "attention_fn", attention.dot_product_attention)
        _set_field(module, "softmax_fp32", mp.softmax_fp32)
        if context.method_name == "setup":
            return next_fun(*args, **kwargs)
        args = _cast_floating(args, policy.compute_dtype)
        kwargs = _cast_floating(kwargs, policy.compute_dtype)
        out = next_fun(*args, **kwargs)
        if overridden and isinstance(module, overridden):
            out = _cast_floating(out, policy.output_dtype)
        return out

    return interceptor


@contextlib.contextmanager
def policy_scope(
    policy_or_mode: PolicyLike, overrides: Mapping[type, Any] | None = None
) -> Iterator[MixedPrecision]:
    """Runs every Flax module call inside the block under a precision policy.

    For code that calls ``module.init``/``module.apply`` itself. Unlike
    :func:`apply_policy` it does not cast the top-level output: use
    ``mp.policy.cast_to_output`` on it.

    Args:
      policy_or_mode: a mode name, policy string, ``Policy`` or ``MixedPrecision``.
      overrides: optional per-class policies replacing the mode's overrides.

    Yields:
      The ``MixedPrecision`` in force.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn, jamp
      >>> dense = nn.Dense(4)
      >>> with jamp.policy_scope("bf16_pure"):
      ...   params = dense.init(jax.random.key(0), jnp.ones((1, 3)))
      >>> params["params"]["kernel"].dtype
      dtype(bfloat16)
    """
    mp = to_mixed_precision(policy_or_mode, overrides)
    with nn.intercept_methods(_make_interceptor(mp)):
        yield mp


class PolicyModule(nn.Module):
    """A Flax module run under a mixed-precision recipe (see :func:`apply_policy`).

    Shares its scope with the wrapped module, so the parameter tree is exactly
    the wrapped module's.

    Attributes:
      inner: the wrapped module.
      precision: the ``MixedPrecision`` recipe in force.
    """

    inner: nn.Module
    precision: MixedPrecision

    def setup(self):
        nn.share_scope(self, self.inner)

    def __call__(self, *args, **kwargs):
        with nn.intercept_methods(_make_interceptor(self.precision)):
            out = self.inner(*args, **kwargs)
        return _cast_floating(out, self.precision.policy.output_dtype)


def apply_policy(
    module: nn.Module,
    policy_or_mode: PolicyLike,
    overrides: Mapping[type, Any] | None = None,
) -> PolicyModule:
    """Returns ``module`` wrapped to run under a precision policy.

    The result is a normal Flax module: use ``init``/``apply`` as usual. The
    parameter tree is the same as ``module``'s; parameters are created in the
    param dtype, every submodule computes in the compute dtype (except classes
    with an override: by default the norms run in float32 and return the
    compute dtype, and attention softmax runs in float32), and the top-level
    output is in the output dtype.

    Args:
      module: any ``flax.linen.Module``, with or without dtype arguments.
      policy_or_mode: a mode name (``"fp16"``, ``"bf16"``, ``"O2"``...), a
        jmp-style policy string, a ``jamp.Policy`` or a ``jamp.MixedPrecision``.
      overrides: optional ``{module class: policy}``; replaces the mode's
        overrides. A subclass follows its parent's override unless it has its own.

    Returns:
      A :class:`PolicyModule` wrapping ``module``.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn, jamp
      >>> model = jamp.apply_policy(nn.Dense(4), "bf16_pure")
      >>> v = model.init(jax.random.key(0), jnp.ones((1, 3)))
      >>> v["params"]["kernel"].dtype
      dtype(bfloat16)
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"apply_policy expects a flax.linen.Module, got {type(module).__name__}. "
            "For a plain function, cast with jamp.get_policy(...).cast_to_compute instead."
        )
    if module.scope is not None:
        raise ValueError(
            "apply_policy needs an unbound module (the one you call .init/.apply on), "
            "not one bound inside another module's scope. Use jamp.policy_scope there."
        )
    return PolicyModule(inner=module, precision=to_mixed_precision(policy_or_mode, overrides))
