"""Gradient accumulation: one optimizer step over ``k`` micro-batches, under one loss scale.

The window's batch (every leaf ``[B, ...]``) is split into ``k`` micro-batches of
``B / k`` examples, run one after another in a ``jax.lax.scan`` (the loss is traced
and compiled once, and only one micro-batch's activations are alive at a time).
Each micro-batch differentiates its share of the window's mean loss (its own mean
divided by ``k``), so every example's cotangent is the one the whole batch would
give, and the gradients are **summed in float32** (half-precision gradients too),
never in half precision. What comes out is one gradient per window: the loss scale
then makes one overflow decision for it, so a window with any non-finite micro-batch
is skipped whole (inf, -inf and NaN all survive a float32 sum: ``inf + -inf`` is
NaN) and the scale moves once.

Leaves marked in ``max_leaves`` (the fp8 delayed-scaling state, whose "gradient" is
its new amax history) are combined by elementwise max instead, so the amax sees
every micro-batch. Typed PRNG keys among the extra arguments are folded with the
micro-batch index (a different dropout mask per micro-batch).

:func:`value_and_grad` is the one-device form; on a mesh the same scan runs inside
:func:`jamp.parallel.data_parallel.value_and_grad` (``accumulate=``), before the one
float32 all-reduce or reduce-scatter of the window.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jamp import grad_accum
  >>> loss = lambda w, batch: (jnp.mean((batch["x"] @ w) ** 2), {})
  >>> batch = {"x": jnp.arange(8.0).reshape(4, 2)}
  >>> (value, _), grads = grad_accum.value_and_grad(loss, 2)(jnp.ones(2), batch)
  >>> (_, _), whole = jax.value_and_grad(loss, has_aux=True)(jnp.ones(2), batch)
  >>> bool(jnp.allclose(grads, whole)), float(value)
  (True, 69.0)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["cast_like", "check_steps", "combine", "flags_per_leaf", "micro_batches", "scan",
           "value_and_grad"]

GradFn = Callable[..., tuple[tuple[jax.Array, Any], Any]]
"""``grad_fn(params, batch, *args) -> ((value, aux), grads)``."""


def check_steps(steps: Any, batch_size: int | None = None, *, what: str = "accumulate") -> int:
    """``steps`` as an int >= 1 that divides ``batch_size``; one clear ``ValueError`` otherwise.

    Example:
      >>> check_steps(4, 64)
      4
      >>> try:
      ...     check_steps(3, 64)
      ... except ValueError as e:
      ...     print(str(e).split(":")[0])
      accumulate=3 does not divide the batch of 64 examples
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"{what}={steps!r} must be an int >= 1 (the number of micro-batches "
                         f"per optimizer step; 1: no accumulation), e.g. {what}=4.")
    if batch_size is not None and batch_size % steps:
        good = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
        near = min(good, key=lambda d: (abs(d - steps), d))
        raise ValueError(
            f"{what}={steps} does not divide the batch of {batch_size} examples: every "
            f"micro-batch must have the same size. Use a divisor of {batch_size} (e.g. "
            f"{what}={near}) or a batch that is a multiple of {steps} "
            f"(e.g. {max(steps, batch_size // steps * steps)}).")
    return steps


def micro_batches(batch: Any, steps: int) -> Any:
    """``batch`` with every leaf ``[B, ...]`` reshaped to ``[steps, B // steps, ...]``.

    Example:
      >>> import jax.numpy as jnp
      >>> micro_batches({"x": jnp.zeros((6, 3))}, 3)["x"].shape
      (3, 2, 3)
    """
    leaves = jax.tree_util.tree_leaves(batch)
    if not leaves:
        raise ValueError("Gradient accumulation needs a batch with at least one array.")
    size = jnp.shape(leaves[0])[0] if jnp.ndim(leaves[0]) else None
    for x in leaves:
        if jnp.ndim(x) == 0 or jnp.shape(x)[0] != size:
            shapes = [jnp.shape(v) for v in leaves]
            raise ValueError(f"Gradient accumulation splits every batch leaf along its first "
                             f"axis, and the leaves' shapes {shapes} have no common first "
                             "dimension: give every leaf the batch as its leading axis.")
    check_steps(steps, size)
    return jax.tree_util.tree_map(
        lambda x: jnp.reshape(x, (steps, size // steps, *jnp.shape(x)[1:])), batch)


def _fold_keys(args: Sequence[Any], index: jax.Array) -> tuple[Any, ...]:
    """Typed PRNG keys in ``args`` folded with ``index``; other arguments unchanged."""

    def one(x):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.fold_in(x, index)
        return x

    return tuple(jax.tree_util.tree_map(one, a) for a in args)


def flags_per_leaf(max_leaves: Any, params: Any) -> list[bool]:
    """``max_leaves`` (None, a bool, or a prefix tree of bools) as one bool per leaf of ``params``.

    Example:
      >>> flags_per_leaf((False, True), ({"a": 1, "b": 2}, {"c": 3}))
      [False, False, True]
    """
    treedef = jax.tree_util.tree_structure(params)
    if max_leaves is None or isinstance(max_leaves, bool):
        return [bool(max_leaves)] * treedef.num_leaves
    flags = []
    subtrees = jax.tree_util.tree_structure(max_leaves).flatten_up_to(params)
    for flag, sub in zip(jax.tree_util.tree_leaves(max_leaves), subtrees, strict=True):
        flags += [bool(flag)] * len(jax.tree_util.tree_leaves(sub))
    return flags


def combine(total: Any, new: Any, max_leaves: Any = None) -> Any:
    """``total + new`` leafwise in float32 (``max`` where ``max_leaves`` says so).

    Example:
      >>> import jax.numpy as jnp
      >>> t = combine({"a": jnp.zeros(2), "b": jnp.zeros(2)},
      ...             {"a": jnp.ones(2, jnp.float16), "b": jnp.ones(2)}, {"a": False, "b": True})
      >>> t["a"].dtype, t["b"].tolist()
      (dtype('float32'), [1.0, 1.0])
    """
    flags = flags_per_leaf(max_leaves, new)
    treedef = jax.tree_util.tree_structure(new)
    out = [jnp.maximum(t, n.astype(t.dtype)) if m else t + n.astype(t.dtype)
           for t, n, m in zip(treedef.flatten_up_to(total), jax.tree_util.tree_leaves(new),
                              flags, strict=True)]
    return jax.tree_util.tree_unflatten(treedef, out)


def _initial(like: Any, max_leaves: Any) -> Any:
    """The identity of :func:`combine` for gradients shaped like ``like`` (the params)."""
    flags = flags_per_leaf(max_leaves, like)
    treedef = jax.tree_util.tree_structure(like)

    def one(x, m):
        dtype = jnp.promote_types(jnp.result_type(x), jnp.float32)
        # zeros_like keeps shard_map's varying axes: the scan's carry types must match.
        return jnp.full_like(x, -jnp.inf, dtype) if m else jnp.zeros_like(x, dtype)

    return jax.tree_util.tree_unflatten(
        treedef, [one(x, m) for x, m in zip(jax.tree_util.tree_leaves(like), flags,
                                             strict=True)])


def scan(grad_fn: GradFn, params: Any, batch: Any, args: Sequence[Any], steps: int,
         max_leaves: Any = None, carry_like: Any = None) -> tuple[tuple[jax.Array, Any], Any]:
    """Runs ``grad_fn`` on each of ``steps`` micro-batches of ``batch`` in a ``lax.scan``.

    ``grad_fn`` must already divide its value by ``steps`` (each micro-batch's share).
    Returns the summed value, the mean of every ``aux`` leaf and the gradients summed
    in float32 (max-combined for ``max_leaves``); the caller casts them.
    ``carry_like`` (default ``params``) gives the accumulator's shapes and varying axes.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> g = lambda w, b: jax.value_and_grad(lambda w: (jnp.sum(w * b["x"]) / 2, {}),
      ...                                     has_aux=True)(w)
      >>> (v, _), grads = scan(g, jnp.ones(2), {"x": jnp.ones((4, 2))}, (), 2)
      >>> float(v), grads.tolist()
      (4.0, [2.0, 2.0])
    """
    micro = micro_batches(batch, steps)

    def body(total, xs):
        index, mb = xs
        (value, aux), grads = grad_fn(params, mb, *_fold_keys(args, index))
        return combine(total, grads, max_leaves), (value, aux)

    init = _initial(params if carry_like is None else carry_like, max_leaves)
    grads, (values, auxes) = jax.lax.scan(body, init, (jnp.arange(steps), micro))
    value = jnp.sum(values.astype(jnp.promote_types(values.dtype, jnp.float32)), axis=0)
    aux = jax.tree_util.tree_map(
        lambda a: jnp.mean(a.astype(jnp.promote_types(a.dtype, jnp.float32)), axis=0)
        .astype(a.dtype) if jnp.issubdtype(a.dtype, jnp.inexact) else a[-1], auxes)
    return (value.astype(values.dtype), aux), grads


def cast_like(grads: Any, params: Any) -> Any:
    """``grads`` cast to each parameter's dtype (the accumulator is float32).

    Example:
      >>> import jax.numpy as jnp
      >>> cast_like({"w": jnp.ones(2)}, {"w": jnp.ones(2, jnp.float16)})["w"].dtype
      dtype('float16')
    """
    return jax.tree_util.tree_map(lambda g, p: g.astype(jnp.result_type(p)), grads, params)


def value_and_grad(fun: Callable[..., tuple[jax.Array, Any]], steps: int,
                   max_leaves: Any = None) -> GradFn:
    """``jax.value_and_grad(fun, has_aux=True)`` over ``steps`` micro-batches, on one device.

    ``fun(params, batch, *args) -> (value, aux)`` returns means over its examples;
    the result is the whole batch's value (and mean aux) with gradients summed in
    float32 over the micro-batches and cast to each parameter's dtype. See the
    module docstring.

    Example: see the module docstring.
    """
    steps = check_steps(steps)

    def share(params, batch, *args):
        value, aux = fun(params, batch, *args)
        return value / steps, aux

    grad_fn = jax.value_and_grad(share, has_aux=True)

    def wrapped(params, batch, *args):
        if steps == 1:
            return jax.value_and_grad(fun, has_aux=True)(params, batch, *args)
        (value, aux), grads = scan(grad_fn, params, batch, args, steps, max_leaves)
        return (value, aux), cast_like(grads, params)

    return wrapped
