"""The linen adapter: a precision policy applied to Flax linen modules.

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
- modules whose path (``module.path`` joined with ``"/"``: ``"head"``,
  ``"Encoder_0/Dense_1"``, ``"ScanBlock_0/Dense_0"`` inside ``nn.scan``) a path
  pattern of the overrides matches in full run under that pattern's policy,
  which beats their class's (see :class:`jamp.MixedPrecision`); when the model
  is initialised through ``__call__``, a pattern that matched no module called
  is an error;
- the top-level output is cast to the policy's output dtype.

Parameters created by any module, custom ``self.param`` calls included, are
drawn in float32, stored rounded to the param dtype and read in the compute
dtype, so every mode starts from the same weights and a custom ``x @ w`` runs
in the compute dtype; RNN carries keep their dtype; in modes with a float32
softmax every softmax of half-precision logits is rewritten to
:func:`jamp.attention.softmax_fp32` (see docs/guides/any_model.md).

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
import functools
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jamp import attention, fp8
from jamp.apply import core
from jamp.autocast import rewrite
from jamp.policy import (
    MixedPrecision,
    OverrideKey,
    Policy,
    PolicyLike,
    module_path,
    to_mixed_precision,
)

NORM_CLASSES: tuple[type, ...] = (nn.LayerNorm, nn.BatchNorm, nn.GroupNorm, nn.RMSNorm)
"""linen's norms: what :data:`jamp.policy.NORMS` stands for in a linen model."""
core.NORMS.register(*NORM_CLASSES)


def _is_float_dtype(arg: Any) -> bool:
    if not (isinstance(arg, np.dtype) or (isinstance(arg, type) and hasattr(arg, "dtype"))):
        return False
    return jnp.issubdtype(jnp.dtype(arg), jnp.floating)


def _draw_in_float32(init_fn: Callable[..., Any], param_dtype: Any) -> Callable[..., Any]:
    """``init_fn`` with floating dtype arguments replaced by float32, rounded to ``param_dtype``."""

    def init(key, *args, **kwargs):
        args = [jnp.float32 if _is_float_dtype(a) else a for a in args]
        kwargs = {k: jnp.float32 if _is_float_dtype(a) else a for k, a in kwargs.items()}
        return core.cast_floating(init_fn(key, *args, **kwargs), param_dtype)

    return init


def _policy_param(module: nn.Module, policy: Policy) -> Callable[..., Any]:
    """``module.param`` under ``policy``: drawn in float32, stored in the param dtype,
    read in the compute dtype."""

    def param(name: str, init_fn: Callable[..., Any], *init_args, unbox: bool = True,
              **init_kwargs):
        value = nn.Module.param(module, name, _draw_in_float32(init_fn, policy.param_dtype),
                                *init_args, unbox=unbox, **init_kwargs)
        return core.cast_floating(value, policy.compute_dtype)

    return param


def _set_field(module: nn.Module, name: str, value: Any) -> None:
    fields = getattr(type(module), "__dataclass_fields__", {})
    if name in fields and getattr(module, name) != value:
        # Bound modules are per-scope clones, so this changes only this use.
        object.__setattr__(module, name, value)


def _keep_carry_dtype(out: Any, args: tuple) -> Any:
    """Returns ``out`` with a ``(carry, ...)`` result cast back to the dtypes of ``args[0]``.

    Flax's convention for RNN cells and ``nn.scan``-ed methods: ``f(carry, x) ->
    (carry, y)``. Casting the inputs to the compute dtype must not change the
    carry's type, or the scan around it fails ("carry input and carry output must
    have equal types").
    """
    if not (args and isinstance(out, tuple) and out):
        return out
    old, new = args[0], out[0]
    old_leaves, old_def = jax.tree_util.tree_flatten(old)
    new_leaves, new_def = jax.tree_util.tree_flatten(new)
    if not old_leaves or old_def != new_def or not all(
            core.is_floating(a) and core.is_floating(b) and a.shape == b.shape
            for a, b in zip(old_leaves, new_leaves, strict=True)):
        return out
    carry = jax.tree_util.tree_map(lambda b, a: b.astype(a.dtype), new, old)
    return (carry, *out[1:])


def _configure(module: nn.Module, mp: MixedPrecision, policy: Policy) -> bool:
    """Sets the policy's dtype fields, attention function and parameter hook on ``module``.

    Returns whether ``module`` runs its matmuls in fp8 (:func:`jamp.fp8.linen_install`).
    """
    _set_field(module, "dtype", policy.compute_dtype)
    _set_field(module, "param_dtype", policy.param_dtype)
    if (
        mp.softmax_fp32
        and not core.computes_in_float32(policy)
        and getattr(module, "attention_fn", None) is nn.dot_product_attention
    ):
        _set_field(module, "attention_fn", attention.dot_product_attention)
    _set_field(module, "softmax_fp32", mp.softmax_fp32)
    # fp8 matmuls where core's rule says so; an nn.RNN shares its cell's state over steps
    recipe = core.fp8_recipe_for(mp, policy, module.name)
    in_fp8 = recipe is not None and fp8.linen_install(module, recipe)
    if mp.fp8 is not None:
        fp8.linen_share_over_steps(module, mp.fp8)
    # An instance attribute shadows Module.param for this bound clone only.
    object.__setattr__(module, "param", _policy_param(module, policy))
    return in_fp8


_EINSUM_CALL = inspect.unwrap(nn.Einsum.__call__)


def _runs_einsum_call(context: Any) -> bool:
    """Whether the intercepted method is ``nn.Einsum``'s own ``__call__`` (not a subclass's)."""
    return getattr(context.orig_method, "func", None) is _EINSUM_CALL


@dataclasses.dataclass
class _Paths:
    """Module paths called while a model initialises, for ``MixedPrecision.check_paths``."""

    seen: set[str] = dataclasses.field(default_factory=set)
    initialised: bool = False  # the root's __call__ ran under init: every module was reached

    def check(self, mp: MixedPrecision, model: str) -> None:
        if self.initialised:
            mp.check_paths(self.seen, model)


def _relative_path(module: nn.Module, root: Sequence[str]) -> str | None:
    """``module``'s path below ``root`` joined with "/" (None for an unbound module)."""
    if module.scope is None:
        return None
    path = module.path
    return module_path(path[len(root):] if tuple(path[:len(root)]) == tuple(root) else path)


def _make_interceptor(mp: MixedPrecision, root: Sequence[str] = (), paths: _Paths | None = None):
    has_patterns = bool(mp.path_overrides)

    def interceptor(next_fun, args, kwargs, context):
        module = context.module
        path = _relative_path(module, root) if has_patterns else None
        if paths is not None and path is not None and module.is_initializing():
            paths.seen.add(path)
            paths.initialised |= path == "" and context.method_name == "__call__"
        override = mp.override_for(type(module), path)
        policy = mp.policy if override is None else override
        in_fp8 = _configure(module, mp, policy)
        if context.method_name == "setup":
            return next_fun(*args, **kwargs)
        call = next_fun
        if in_fp8 and _runs_einsum_call(context):  # nn.Einsum: no dot_general hook
            call = functools.partial(fp8.linen_einsum, module, mp.fp8)
        out = call(*core.cast_floating(args, policy.compute_dtype),
                   **core.cast_floating(kwargs, policy.compute_dtype))
        if override is not None:
            out = core.cast_floating(out, policy.output_dtype)
        return _keep_carry_dtype(out, args)

    return interceptor


@contextlib.contextmanager
def policy_scope(
    policy_or_mode: PolicyLike, overrides: Mapping[OverrideKey, Any] | None = None
) -> Iterator[MixedPrecision]:
    """Runs every Flax module call inside the block under a precision policy.

    For code that calls ``module.init``/``module.apply`` itself. Unlike
    :func:`apply_policy` it does not cast the top-level output: use
    ``mp.policy.cast_to_output`` on it. Path patterns match paths from the root
    module ``init``/``apply`` is called on; a pattern that matched no module is
    reported when the block ends, if a root module was initialised in it.

    Args:
      policy_or_mode: a mode name, policy string, ``Policy`` or ``MixedPrecision``.
      overrides: optional ``{module class or path pattern: policy}``, as for
        :func:`apply_policy`.

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
    paths = _Paths()
    with nn.intercept_methods(_make_interceptor(mp, (), paths)):
        yield mp
    paths.check(mp, "the modules initialised in policy_scope")


def _inner_method(inner: nn.Module, method: Callable[..., Any] | str | None) -> Callable:
    """The unbound function ``method`` names on the wrapped module (``__call__`` for None)."""
    if method is None:
        method = "__call__"
    if isinstance(method, str):
        fn = getattr(type(inner), method, None)
        if not callable(fn):
            raise AttributeError(
                f"apply(..., method={method!r}): {type(inner).__name__} has no method "
                f"{method!r}.")
        return fn
    return getattr(method, "__func__", method)  # a method bound to a module: its function


class PolicyModule(nn.Module):
    """A Flax module run under a mixed-precision recipe (see :func:`apply_policy`).

    Shares its scope with the wrapped module, so the parameter tree is exactly
    the wrapped module's. ``apply``/``init`` accept ``method=`` naming a method
    of the wrapped module (a string, or the wrapped class's function, or any
    function taking the wrapped module first); its output is cast like
    ``__call__``'s.

    Attributes:
      inner: the wrapped module.
      precision: the ``MixedPrecision`` recipe in force.
    """

    inner: nn.Module
    precision: MixedPrecision

    def setup(self):
        nn.share_scope(self, self.inner)

    def __call__(self, *args, **kwargs):
        return self.run(None, *args, **kwargs)

    def run(self, method: Callable[..., Any] | str | None, *args, **kwargs):
        """Runs ``method`` of the wrapped module under the policy; output in the output dtype.

        Example:
          >>> import jax, jax.numpy as jnp, flax.linen as nn, jamp
          >>> model = jamp.apply_policy(nn.Dense(2), "bf16")
          >>> v = model.init(jax.random.key(0), jnp.ones((1, 3)))
          >>> model.bind(v).run("__call__", jnp.ones((1, 3))).dtype
          dtype('float32')
        """
        fn = _inner_method(self.inner, method)
        paths = _Paths()
        with nn.intercept_methods(_make_interceptor(self.precision, self.path, paths)):
            out = fn(self.inner, *args, **kwargs)
        paths.check(self.precision, type(self.inner).__name__)
        return core.cast_floating(out, self.precision.policy.output_dtype)

    def _method(self, method: Any) -> Callable[..., Any]:
        if method is None or getattr(method, "__func__", method) in (
                PolicyModule.__call__, type(self).__call__):
            return type(self).__call__
        return lambda module, *args, **kwargs: module.run(method, *args, **kwargs)

    def apply(self, variables, *args, method=None, **kwargs):
        """``nn.Module.apply``, with ``method`` taken from the wrapped module.

        In modes whose softmax runs in float32, the whole application is
        rewritten by :func:`~jamp.autocast.rewrite` so that every softmax and
        log-softmax of half-precision logits runs in float32, wherever it is
        called from (``nn.softmax``, ``jax.nn.softmax``,
        ``nn.dot_product_attention_weights``...).

        Example:
          >>> import jax, jax.numpy as jnp, flax.linen as nn, jamp
          >>> class Seq2seq(nn.Module):
          ...   def setup(self):
          ...     self.enc, self.dec = nn.Dense(4), nn.Dense(2)
          ...   def encode(self, x):
          ...     return self.enc(x)
          ...   def __call__(self, x):
          ...     return self.dec(self.encode(x))
          >>> model = jamp.apply_policy(Seq2seq(), "fp16")
          >>> v = model.init(jax.random.key(0), jnp.ones((1, 3)))
          >>> model.apply(v, jnp.ones((1, 3)), method="encode").dtype
          dtype('float32')
        """
        apply = functools.partial(super().apply, method=self._method(method))
        rules = core.softmax_rules(self.precision)
        if rules is not None:
            apply = rewrite(apply, rules)
        return apply(variables, *args, **kwargs)

    def init_with_output(self, rngs, *args, method=None, **kwargs):
        """``nn.Module.init_with_output``, with ``method`` taken from the wrapped module.

        Example:
          >>> import jax, jax.numpy as jnp, flax.linen as nn, jamp
          >>> out, v = jamp.apply_policy(nn.Dense(2), "fp16").init_with_output(
          ...     jax.random.key(0), jnp.ones((1, 3)))
          >>> out.dtype, v["params"]["kernel"].dtype
          (dtype('float32'), dtype('float32'))
        """
        return super().init_with_output(rngs, *args, method=self._method(method), **kwargs)


def apply_recipe(module: nn.Module, mp: MixedPrecision) -> PolicyModule:
    """``module`` wrapped in a :class:`PolicyModule` (:func:`jamp.apply_policy` for linen).

    Raises:
      ValueError: for a module bound inside another module's scope.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn, jamp
      >>> from jamp.apply import linen
      >>> model = linen.apply_recipe(nn.Dense(4), jamp.mixed_precision("bf16_pure"))
      >>> model.init(jax.random.key(0), jnp.ones((1, 3)))["params"]["kernel"].dtype
      dtype(bfloat16)
    """
    if module.scope is not None:
        raise ValueError(
            "apply_policy needs an unbound module (the one you call .init/.apply on), "
            "not one bound inside another module's scope. Use jamp.policy_scope there."
        )
    return PolicyModule(inner=module, precision=mp)
