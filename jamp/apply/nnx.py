"""The NNX adapter: a precision policy applied to Flax NNX modules, in place.

NNX layers are mutable objects with per-layer ``dtype``/``param_dtype`` knobs
but no policy mechanism. :func:`apply_policy` (reached through
``jamp.apply_policy``, which takes linen and NNX modules: :mod:`jamp.apply`)
sets them all at a distance, in place, with the rules of :mod:`jamp.apply.core`:

- every floating ``nnx.Param`` is rounded to the param dtype of its module's
  policy (models are created in float32 as usual, so every mode starts from the
  same weights, rounded); every layer with ``dtype``/``param_dtype`` attributes
  (Linear, Conv, Embed, MultiHeadAttention, the norms...) gets the policy's;
- each call of the model casts floating inputs to the compute dtype, reads every
  ``nnx.Param`` in its module's compute dtype (so custom layers doing
  ``x @ self.w`` compute in it too) and casts the output to the output dtype;
- modules of an overridden class (by default ``nnx.LayerNorm``,
  ``nnx.BatchNorm``, ``nnx.GroupNorm``, ``nnx.RMSNorm``) keep float32
  parameters and compute in float32, returning the model's compute dtype;
- modules whose graph path (names and list indices joined with ``"/"``:
  ``"head"``, ``"blocks/0/mlp"``) a path pattern of the overrides matches in
  full run under that pattern's policy, which beats their class's (see
  :class:`jamp.MixedPrecision`); patterns are checked when the policy is
  applied: one matching no module, or a path two patterns match, is an error;
- in modes whose softmax runs in float32, every softmax and log-softmax of
  half-precision logits (``nnx.MultiHeadAttention``, custom attention calling
  ``jax.nn.softmax``) runs in float32 keeping half-precision residuals
  (:func:`~jamp.autocast.rewrite`).

The policy lives in the model's class (a subclass of it, named alike), so it
survives ``nnx.split``/``nnx.merge`` and works under ``nnx.jit``,
``nnx.grad``/``nnx.value_and_grad``, ``nnx.scan``/``nnx.vmap``/``nnx.remat``;
BatchNorm statistics and ``nnx.Rngs`` (held by the model or passed to the call)
advance as without a policy. Only ``__call__`` of the model runs under the
policy: call other methods through it.

A model created directly in half precision (``param_dtype=jnp.float16``) has
weights drawn in half precision: they are converted as they are (widened to
float32 in ``fp16``/``bf16``, kept in ``fp16_naive``), so they differ from the
rounded float32 weights of the same model created in float32.

Example:
  >>> import jax.numpy as jnp, jamp
  >>> from flax import nnx
  >>> model = jamp.apply_policy(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), "fp16_naive")
  >>> model.kernel.dtype, model(jnp.ones((2, 3))).dtype
  (dtype('float16'), dtype('float32'))
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes

from jamp import attention, fp8
from jamp.apply import core
from jamp.autocast import rewrite
from jamp.policy import MixedPrecision, Policy, module_path

M = TypeVar("M", bound=nnx.Module)

NORM_CLASSES: tuple[type, ...] = (nnx.LayerNorm, nnx.BatchNorm, nnx.GroupNorm, nnx.RMSNorm)
"""Flax's NNX norms (what :data:`jamp.policy.NORMS` stands for in an NNX model): their
statistics and normalisation always run in at least float32."""
core.NORMS.register(*NORM_CLASSES)


def norm_in_float32(args: tuple, *, dtype: Any = None, inexact: bool = True) -> tuple:
    """A norm's ``promote_dtype``: the input widened to float32, scale and bias as stored.

    Flax NNX's norms cast input, scale and bias to the layer's ``dtype``, which a
    policy sets to the output dtype (half): the affine would run on half copies of
    the float32 scale and bias, and the backward pass would round the input's two
    gradient paths (statistics, normalisation) to half before adding them. With this
    the norm runs in float32 as linen's norms do under jamp; only the result is
    rounded. ``apply_policy`` installs it on every NNX norm that has Flax's default.

    Example:
      >>> import jax.numpy as jnp, jamp
      >>> x, scale = jnp.ones(2, jnp.float16), jnp.ones(2, jnp.float32)
      >>> [a.dtype for a in jamp.apply.nnx.norm_in_float32((x, scale), dtype=jnp.float16)]
      [dtype('float32'), dtype('float32')]
    """
    del dtype, inexact
    x, *rest = args
    return (x.astype(jnp.promote_types(x.dtype, jnp.float32)), *rest)


def _is_node(x: Any) -> bool:
    return isinstance(x, nnx.Pytree)


def _cast(tree: Any, dtype: Any) -> Any:
    """Casts floating arrays of ``tree`` to ``dtype``; NNX objects (Rngs...) pass untouched."""
    return core.cast_floating(tree, dtype, is_leaf=_is_node)


def _modules(module: nnx.Module) -> dict[tuple, nnx.Module]:
    return {path: node for path, node in nnx.iter_graph(module) if isinstance(node, nnx.Module)}


def _policy(mp: MixedPrecision, path: tuple, node: nnx.Module) -> Policy:
    return mp.policy_for(type(node), module_path(path))


def _params(module: nnx.Module) -> Iterator[tuple[tuple, nnx.Module, nnx.Param]]:
    """``(owner path, owner, param)`` for every floating ``nnx.Param``; the owner is its
    nearest module."""
    modules = _modules(module)
    for path, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Param) and core.is_floating(node.get_value()):
            owner = next(path[:i] for i in reversed(range(len(path))) if path[:i] in modules)
            yield owner, modules[owner], node


def _check(module: nnx.Module, mp: MixedPrecision) -> None:
    """Raises for an already-policied module or an override NNX layers cannot honour."""
    modules = _modules(module)
    for node in modules.values():
        done = getattr(type(node), "_jamp_precision", None)
        if done is not None:
            raise ValueError(
                f"{type(node).__name__} already runs under the jamp policy {done.name!r} "
                f"({done.policy}); apply_policy once, to a model created without one.")
    mp.check_paths((module_path(path) for path in modules), type(module).__name__)
    for path, node in modules.items():
        policy = mp.override_for(type(node), module_path(path))
        if (policy is not None and not isinstance(node, NORM_CLASSES)
                and jnp.dtype(policy.output_dtype) != jnp.dtype(policy.compute_dtype)):
            raise ValueError(
                f"Cannot apply the override {policy} to {type(node).__name__} at path "
                f"{module_path(path)!r}: an NNX layer returns its compute dtype, so its "
                "override needs output == compute (e.g. 'f32'); only the norms compute in "
                "float32 and return another dtype.")


def dot_product_attention(query: jax.Array, key: jax.Array, value: jax.Array, *,
                          float32_softmax: bool = True, module: nnx.Module | None = None,
                          is_causal: bool = False, mask: jax.Array | None = None,
                          **kwargs: Any) -> jax.Array:
    """``nnx.MultiHeadAttention``'s ``attention_fn`` with both matmuls in ``dtype``.

    With ``float32_softmax`` the softmax runs in float32 and saves half-precision
    residuals (:func:`jamp.attention.dot_product_attention`); without, it runs in
    ``dtype``. Unlike ``nnx.dot_product_attention`` (``jax.nn.dot_product_attention``
    on XLA) no matmul accumulates into float32 operands of the backward pass.
    :func:`apply_policy` installs it in half-precision modes.

    Example:
      >>> import jax.numpy as jnp, jamp
      >>> q = jnp.ones((1, 3, 2, 4), jnp.float16)
      >>> jamp.apply.nnx.dot_product_attention(q, q, q, is_causal=True).dtype
      dtype('float16')
    """
    del module  # sow_weights is not supported
    if is_causal:
        causal = nnx.make_causal_mask(jnp.ones(query.shape[:-2]))
        mask = causal if mask is None else nnx.combine_masks(mask, causal)
    if float32_softmax:
        return attention.dot_product_attention(query, key, value, mask=mask, **kwargs)
    weights = nn.dot_product_attention_weights(query, key, mask=mask, **kwargs)
    return jnp.einsum("...hqk,...khd->...qhd", weights, value.astype(weights.dtype),
                      precision=kwargs.get("precision"))


def _configure(module: nnx.Module, mp: MixedPrecision) -> None:
    """Sets layers' dtype attributes and rounds every Param to its param dtype (in place)."""
    for path, node in _modules(module).items():
        policy = _policy(mp, path, node)
        if (isinstance(node, nnx.MultiHeadAttention)
                and not core.computes_in_float32(policy)
                and node.attention_fn is nnx.dot_product_attention):
            node.attention_fn = functools.partial(
                dot_product_attention, float32_softmax=core.softmax_rules(mp) is not None)
        norm = isinstance(node, NORM_CLASSES)
        if "dtype" in vars(node):
            # Flax's norms compute in >= float32 whatever their dtype, which is the output's.
            node.dtype = policy.output_dtype if norm else policy.compute_dtype
        if norm and node.promote_dtype is nnx_dtypes.promote_dtype:
            node.promote_dtype = norm_in_float32
        if "param_dtype" in vars(node):
            node.param_dtype = policy.param_dtype
        name = path[-1] if path else None
        recipe = core.fp8_recipe_for(mp, policy, name)
        if recipe is not None:
            fp8.nnx_install(node, recipe, name)
    for path, owner, param in _params(module):
        param.set_value(param.get_value().astype(_policy(mp, path, owner).param_dtype))


def _read_in_compute_dtype(module: nnx.Module, mp: MixedPrecision) -> None:
    for path, owner, param in list(_params(module)):
        dtype = jnp.dtype(_policy(mp, path, owner).compute_dtype)
        if param.get_value().dtype != dtype:
            param.set_value(param.get_value().astype(dtype))


def _run(module: nnx.Module, call: Callable[..., Any], mp: MixedPrecision,
         args: tuple, kwargs: dict) -> Any:
    """``call(module, *args, **kwargs)`` under ``mp``; state changes land in ``module``/args."""
    leaves, treedef = jax.tree_util.tree_flatten(
        _cast((args, kwargs), mp.policy.compute_dtype), is_leaf=_is_node)
    is_node = [_is_node(x) for x in leaves]
    nodes = [module, *(x for x, n in zip(leaves, is_node, strict=True) if n)]
    # nnx.capture (jamp.tensor_stats.nnx_activations) gives every module a '__captures__'
    # attribute; on an nnx.List (nnx.Sequential's layers) it sits beside the int keys of
    # the items, and nnx.merge and jax.tree_util cannot sort such keys. A list is never
    # called, so it sows nothing: its captures stay out of the call and are put back.
    detached = _detach_list_captures(nodes)
    try:
        graphdef, state = nnx.split(nodes)
    finally:
        for owner, captures in detached:
            vars(owner)["__captures__"] = captures
    values = [x for x, n in zip(leaves, is_node, strict=True) if not n]

    def pure(state, values):
        inner, *inner_nodes = nnx.merge(graphdef, state)
        _read_in_compute_dtype(inner, mp)
        node_it, value_it = iter(inner_nodes), iter(values)
        a, k = treedef.unflatten([next(node_it) if n else next(value_it) for n in is_node])
        out = call(inner, *a, **k)
        return out, nnx.state([inner, *inner_nodes], nnx.Not(nnx.Param))

    rules = core.softmax_rules(mp)
    out, new_state = (pure if rules is None else rewrite(pure, rules))(state, values)
    nnx.update(nodes, new_state)
    return _cast(out, mp.policy.output_dtype)


def iter_modules(module: nnx.Module) -> Iterator[tuple[tuple[Any, ...], nnx.Module]]:
    """``(path, module)`` of ``module`` and every module inside it: ``nnx.iter_modules``
    (flax 0.12), or the ``Module.iter_modules`` method of older flax.

    Example:
      >>> from flax import nnx
      >>> [p for p, _ in iter_modules(nnx.Sequential(nnx.Linear(1, 1, rngs=nnx.Rngs(0))))]
      [('layers', 0), ('layers',), ()]
    """
    if hasattr(nnx, "iter_modules"):
        return iter(nnx.iter_modules(module))
    return iter(module.iter_modules())


def _detach_list_captures(nodes: list[Any]) -> list[tuple[Any, Any]]:
    """Removes nnx.capture's ``__captures__`` from every ``nnx.List`` in ``nodes``;
    returns ``(list, captures)`` pairs to put back."""
    list_type = getattr(nnx, "List", None)
    if list_type is None:
        return []
    detached = []
    for node in (n for n in nodes if isinstance(n, nnx.Module)):
        for _, module in iter_modules(node):
            if isinstance(module, list_type) and "__captures__" in vars(module):
                detached.append((module, vars(module).pop("__captures__")))
    return detached


@functools.cache
def _policy_class(cls: type, mp: MixedPrecision) -> type:
    """A subclass of ``cls`` whose ``__call__`` runs under ``mp`` (cached: one per pair).

    Why :func:`apply_policy` gives the model this class, in place, rather than
    wrapping it: NNX has no method interception (linen's
    ``nn.intercept_methods``) and no call hook on ``nnx.Module`` in flax 0.12
    (its ``nnx.capture`` rewrites the methods of the class itself, for every
    instance), so the model's own ``__call__`` has to run ours. A wrapper module would
    change what users hold: its graph paths and state tree gain a level
    (checkpoints, ``nnx.state(model)`` filters and path overrides move), and
    ``isinstance(model, MyModel)`` fails. A subclass keeps both, and because an
    NNX graphdef records the node's type, the policy survives
    ``nnx.split``/``nnx.merge`` and every NNX transform with no registration.
    """

    def __call__(self, *args, **kwargs):  # noqa: N807
        return _run(self, cls.__call__, mp, args, kwargs)

    def body(ns: dict) -> None:
        ns.update(__call__=__call__, __module__=cls.__module__, __qualname__=cls.__qualname__,
                  __doc__=cls.__doc__, _jamp_precision=mp)

    return types.new_class(cls.__name__, (cls,), {}, body)


def policy_of(module: nnx.Module) -> MixedPrecision | None:
    """The recipe an NNX model runs under (``None`` if :func:`apply_policy` was not applied).

    Example:
      >>> import jamp
      >>> from flax import nnx
      >>> jamp.apply.nnx.policy_of(jamp.apply_policy(
      ...     nnx.Linear(2, 2, rngs=nnx.Rngs(0)), "bf16")).name
      'bf16'
    """
    return getattr(type(module), "_jamp_precision", None)


def apply_recipe(module: M, mp: MixedPrecision) -> M:
    """Puts an NNX model under a recipe, in place, and returns it.

    See the module docstring for what changes. ``jamp.apply_policy`` calls this
    for ``nnx.Module`` arguments, with the recipe its arguments name.

    Args:
      module: any ``nnx.Module``, created as usual (in float32).
      mp: the recipe. Its path patterns are regular expressions matched in full
        against each module's graph path, names and list indices joined with
        ``"/"`` (``"head"``, ``"blocks/0/mlp"``, ``"blocks/.*"``).

    Returns:
      ``module`` itself, whose class is now a policy subclass of its class.

    Raises:
      ValueError: if a module in ``module`` already runs under a policy; an
        override returns a dtype other than its compute dtype on a non-norm
        layer; a path pattern matches no module path (listing them) or a path
        matches two patterns (naming both).

    Example:
      >>> import jax.numpy as jnp, jamp
      >>> from flax import nnx
      >>> model = jamp.apply_policy(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), "bf16_pure")
      >>> model.kernel.dtype, model(jnp.ones((1, 3))).dtype
      (dtype(bfloat16), dtype(bfloat16))

      Keep the classifier head in float32 (bfloat16 elsewhere):

      >>> class Net(nnx.Module):
      ...   def __init__(self, rngs):
      ...     self.blocks = nnx.List([nnx.Linear(3, 3, rngs=rngs) for _ in range(2)])
      ...     self.head = nnx.Linear(3, 2, rngs=rngs)
      >>> net = jamp.apply_policy(Net(nnx.Rngs(0)), "bf16_pure", overrides={"head": "f32"})
      >>> net.head.kernel.dtype, net.blocks[1].kernel.dtype
      (dtype('float32'), dtype(bfloat16))
    """
    _check(module, mp)
    _configure(module, mp)
    # In place, to a subclass of its own class: see _policy_class for why.
    object.__setattr__(module, "__class__", _policy_class(type(module), mp))
    return module

