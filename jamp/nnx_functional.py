"""The trainer's view of an NNX model: a linen-style ``(apply_fn, params)`` pair.

``jamp.train_step``, ``jamp.eval_step`` and a flax ``TrainState`` work on a function
of the parameters, as linen's ``model.apply``. :func:`functional` gives that
function for an NNX model (the :mod:`jamp.models.vit_nnx` ViT, or any model whose
state is its parameters, called as ``model(images, train=..., rngs=...)``), and
:func:`fp8_state` the delayed-scaling fp8 state that ``apply_fn`` reads beside them
in mode ``"fp8"`` (a ``jamp.fp8.TrainState``'s ``fp8``). :mod:`jamp.experiment`
builds the NNX run's train state with them; the model module knows nothing of
training (``vit_nnx.functional`` and ``vit_nnx.fp8_state`` still name these functions).

Example:
  >>> import jax.numpy as jnp, jamp
  >>> from flax import nnx
  >>> from jamp.models import vit_nnx
  >>> model = jamp.apply_policy(vit_nnx.create(
  ...     "ti", num_classes=3, image_size=4, channels=1, patch_size=2, num_layers=1,
  ...     hidden_size=8, num_heads=2, mlp_dim=8, rngs=nnx.Rngs(0)), "bf16")
  >>> apply_fn, params = functional(model)
  >>> apply_fn({"params": params}, jnp.ones((2, 4, 4, 1))).shape, fp8_state(model)
  ((2, 3), {})
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
from flax import nnx

from jamp import fp8

ApplyFn = Callable[..., jax.Array]
"""``apply_fn(variables, images, train=False, rngs=None) -> logits``, as linen's ``apply``."""


def fp8_state(model: nnx.Module) -> dict[str, Any]:
    """The model's delayed-scaling fp8 state as a plain nested dict (``{}`` if it has none).

    ``jamp.apply_policy(model, "fp8")`` gives every fp8 matmul a
    ``jamp.fp8.DelayedScalingDot`` holding six ``jamp.fp8.Fp8Meta`` variables;
    this is their values, nested by attribute path down to one dict per matmul
    with the six ``jamp.fp8.META_NAMES`` keys (layers stacked by the scanned
    encoder carry the leading ``layers`` axis, as linen's collection does). It
    is the ``fp8`` of a ``jamp.fp8.TrainState`` for the ``apply_fn`` of
    :func:`functional`, which reads it from ``variables[jamp.fp8.COLLECTION]``.

    Example:
      >>> import jamp
      >>> from flax import nnx
      >>> from jamp import nnx_functional
      >>> from jamp.models import vit_nnx
      >>> vit = lambda mode: nnx.eval_shape(lambda: jamp.apply_policy(vit_nnx.create(
      ...     "ti", num_classes=3, image_size=4, channels=1, patch_size=2, num_layers=2,
      ...     hidden_size=8, num_heads=2, mlp_dim=8, rngs=nnx.Rngs(0)), mode))  # shapes only
      >>> state = nnx_functional.fp8_state(vit("fp8"))
      >>> meta = state["encoder"]["layers"]["mlp"]["fc1"]["dot_general"]
      >>> meta["input_scale"].shape, meta["kernel_amax_history"].shape  # per layer
      ((2, 1), (2, 1024))
      >>> nnx_functional.fp8_state(vit("bf16"))
      {}
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"fp8_state expects an nnx.Module, got {type(model).__name__}.")
    return fp8.nnx_state(model)


def _paths(tree: Any) -> dict[str, tuple[int, ...]]:
    """``{"a/b/c": shape}`` of a nested dict's leaves (shape ``()`` for a non-array)."""
    return {"/".join(str(getattr(k, "key", k)) for k in path): tuple(getattr(v, "shape", ()))
            for path, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _check_fp8(given: Any, expected: dict[str, tuple[int, ...]]) -> None:
    """Raises a ValueError naming the entries where ``given`` is not the model's fp8 state."""
    if not isinstance(given, Mapping):
        raise TypeError(f"variables[{fp8.COLLECTION!r}] must be the nested dict of "
                        f"jamp.nnx_functional.fp8_state(model), got {type(given).__name__}.")
    got = _paths(given)
    # Stacked layers' leading axis may be split over pipeline stages (a stage sees its share).
    fits = lambda have, need: have == need or (len(have) == len(need) > 1
                                               and have[1:] == need[1:])
    missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    shapes = [f"{p}: {got[p]} (needs {expected[p]})" for p in sorted(set(got) & set(expected))
              if not fits(got[p], expected[p])]
    if not (missing or extra or shapes):
        return
    raise ValueError(
        f"variables[{fp8.COLLECTION!r}] is not this model's delayed-scaling fp8 state: "
        f"missing {missing}, unexpected {extra}, mis-shaped {shapes}. Pass "
        "jamp.nnx_functional.fp8_state(model) of the model functional() was given (or the fp8 "
        "of the jamp.fp8.TrainState built from it).")


def functional(model: nnx.Module, *, boxed: bool = False) -> tuple[ApplyFn, dict[str, Any]]:
    """``(apply_fn, params)``: the model as a linen-style function of its parameters.

    ``apply_fn({"params": params}, images, train=False, rngs=None)`` runs the
    model (its policy included) on ``params``, a plain nested dict of arrays like
    linen's, so ``jamp.train_step``, ``jamp.eval_step`` and a ``TrainState`` use it
    as they use the linen ViT's ``model.apply``; ``rngs={"dropout": key}`` as in
    linen. It is ``nnx.merge`` of the model's graph with ``params``: under ``jit``
    it traces to the same program as calling the model. As linen's ``method=``,
    ``apply_fn(..., method=f)`` returns ``f(model, images, train=..., rngs=...)`` of
    the merged model instead of its call (e.g.
    ``functools.partial(jamp.tensor_stats.nnx_activations, reduce=...)``).

    A model under mode ``"fp8"`` (delayed scaling) also reads its fp8 state from
    ``variables[jamp.fp8.COLLECTION]`` (:func:`fp8_state` gives the initial one),
    as the linen ViT does: the passed values, not the model's own, feed its
    ``jamp.fp8.Fp8Meta`` variables, so the gradient of that entry is the new
    state (``jamp.fp8.as_meta`` values included). Train it as linen's, with a
    ``jamp.fp8.TrainState(..., fp8=fp8_state(model))`` and ``jamp.train_step``.

    Args:
      model: an ``nnx.Module`` whose only state is ``nnx.Param`` and
        ``jamp.fp8.Fp8Meta`` (the ViT).
      boxed: wrap each parameter in ``flax.linen.LogicallyPartitioned`` with its
        logical axis names, as linen's ``init`` returns them, so
        ``nn.get_partition_spec`` of a train state built from them gives the
        parameters' and optimizer states' logical specs (``nn.unbox`` them
        before stepping). The fp8 state is never boxed (replicated, as linen's).

    Raises:
      ValueError: if the model holds other state (batch statistics,
        ``nnx.Rngs``): ``apply_fn`` would drop its updates. ``apply_fn`` raises
        one if the fp8 state is missing or not the model's.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jamp
      >>> from flax import nnx
      >>> from flax.training import train_state
      >>> from jamp import nnx_functional
      >>> from jamp.models import vit_nnx
      >>> vit = lambda mode: jamp.apply_policy(vit_nnx.create(
      ...     "ti", num_classes=3, image_size=4, channels=1, patch_size=2, num_layers=1,
      ...     hidden_size=8, num_heads=2, mlp_dim=8, rngs=nnx.Rngs(0)), mode)
      >>> apply_fn, params = nnx_functional.functional(vit("fp16"))
      >>> state = train_state.TrainState.create(
      ...     apply_fn=apply_fn, params=params, tx=jamp.make_optimizer("fp16", optax.sgd(0.1)))
      >>> batch = {"image": jnp.ones((2, 4, 4, 1)), "label": jnp.array([0, 1])}
      >>> state, metrics = jax.jit(jamp.train_step)(state, batch, jax.random.key(1))
      >>> float(metrics["loss_scale"]), params["encoder"]["layers"]["mlp"]["fc1"]["kernel"].shape
      (65536.0, (1, 8, 8))

      Mode ``"fp8"``: the delayed-scaling state trains beside the parameters (traced
      here for its shapes only; ``jax.jit`` runs it).

      >>> model = vit("fp8")
      >>> apply_fn, params = nnx_functional.functional(model)
      >>> state = jamp.fp8.TrainState.create(apply_fn=apply_fn, params=params,
      ...     tx=jamp.make_optimizer("fp8", optax.sgd(0.1)), fp8=nnx_functional.fp8_state(model))
      >>> new, _ = jax.eval_shape(jamp.train_step, state, batch, jax.random.key(1))
      >>> new.fp8["encoder"]["layers"]["mlp"]["fc1"]["dot_general"]["input_amax_history"]
      ShapeDtypeStruct(shape=(1, 1024), dtype=float32)
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"functional expects an nnx.Module, got {type(model).__name__}.")
    graphdef, state, meta, rest = nnx.split(model, nnx.Param, fp8.Fp8Meta, ...)
    if jax.tree_util.tree_leaves(rest):
        kinds = sorted({type(v).__name__ for _, v in nnx.to_flat_state(rest)})
        raise ValueError(f"functional() needs a model whose only state is nnx.Param (and "
                         f"jamp.fp8.Fp8Meta); this one also holds {kinds}, whose updates "
                         "apply_fn would drop. Use nnx.split/nnx.merge and return the new "
                         "state from your step.")
    params = nnx.to_pure_dict(state)
    meta_shapes = _paths(nnx.to_pure_dict(meta))
    if boxed:
        names = {path: tuple(v.get_metadata().get("out_sharding") or (None,) * v.ndim)
                 for path, v in nnx.to_flat_state(state)}
        params = jax.tree_util.tree_map_with_path(
            lambda path, v: nn.LogicallyPartitioned(v, names[tuple(k.key for k in path)]),
            params)

    def apply_fn(variables: Mapping[str, Any], images: jax.Array, train: bool = False,
                 rngs: Mapping[str, jax.Array] | jax.Array | None = None, *,
                 method: Callable[..., Any] | None = None) -> Any:
        if isinstance(rngs, Mapping):
            rngs = rngs.get("dropout")
        given = variables.get(fp8.COLLECTION, {})
        if meta_shapes and fp8.COLLECTION not in variables:
            raise ValueError(
                f"This NNX model runs delayed-scaling fp8 matmuls (mode 'fp8') and reads their "
                f"state from variables[{fp8.COLLECTION!r}], which is missing: pass "
                "{'params': params, jamp.fp8.COLLECTION: "
                "jamp.nnx_functional.fp8_state(model)} (a jamp.fp8.TrainState holds it as "
                ".fp8; jamp.train_step and jamp.eval_step pass it), or use mode 'fp8_current', "
                "which keeps no state.")
        if meta_shapes or not isinstance(given, Mapping) or given:
            _check_fp8(given, meta_shapes)
        inner = nnx.merge(graphdef, nn.unbox(variables["params"]), given, rest)
        if method is not None:
            return method(inner, images, train=train, rngs=rngs)
        return inner(images, train=train, rngs=rngs)

    return apply_fn, params
