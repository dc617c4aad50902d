"""The train step's gradient function on a ('data', 'model', 'pipe') mesh.

:func:`jamp.train_step` differentiates the scaled loss with the ``value_and_grad``
it is given; :func:`value_and_grad` builds the one for a mesh, for ``jax.jit``
under ``jax.set_mesh(mesh)`` and ``nn.logical_axis_rules(LOGICAL_AXIS_RULES)``:

- data: each 'data' shard differentiates its slice of the batch and the
  gradients are all-reduced in float32 (half-precision parameters' too)
  (:func:`jamp.parallel.data_parallel.value_and_grad`);
- tensor: the ViT's heads and MLP hidden units are split over 'model' by the
  logical axis rules (Megatron), the partitioner inserts the collectives;
- pipeline: a model built with a :class:`jamp.parallel.pipeline.GPipe` layer
  runner runs its encoder as a GPipe schedule over 'pipe'; ``pipelined=True``
  makes 'pipe' manual too, so the schedule runs in place on each stage's layers.

The optimizer and loss scale then run on global arrays under plain ``jax.jit``,
so the overflow check is one reduction over every shard of every gradient:
all devices take the same skip-or-step decision and keep the same scale.

Example:
  >>> import functools, jax, jax.numpy as jnp, flax.linen as nn, optax, jamp
  >>> from flax.training import train_state
  >>> from jamp.models import vit
  >>> from jamp.parallel import LOGICAL_AXIS_RULES, make_mesh, step
  >>> mp = jamp.mixed_precision("fp16", init_scale=2.0**10)
  >>> model = jamp.apply_policy(vit.create("ti", num_classes=3, patch_size=2, num_layers=2,
  ...                                      hidden_size=8, num_heads=2, mlp_dim=8), mp)
  >>> variables = jax.jit(model.init)(jax.random.key(0), jnp.ones((1, 4, 4, 1)))
  >>> specs = nn.logical_to_mesh(nn.get_partition_spec(variables)["params"], LOGICAL_AXIS_RULES)
  >>> state = train_state.TrainState.create(apply_fn=model.apply,
  ...     params=nn.unbox(variables)["params"], tx=jamp.make_optimizer(mp, optax.sgd(0.1)))
  >>> batch = {"image": jnp.ones((8, 4, 4, 1)), "label": jnp.zeros(8, jnp.int32)}
  >>> mesh = make_mesh({"data": 2, "model": 2, "pipe": 1})
  >>> with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
  ...     train_step = jax.jit(functools.partial(
  ...         jamp.train_step, value_and_grad=step.value_and_grad(specs)))
  ...     state, metrics = train_step(state, batch, jax.random.key(1))
  >>> float(metrics["loss_scale"]), bool(metrics["grad_finite"])
  (1024.0, True)
"""

from __future__ import annotations

from typing import Any

import jax

from jamp.parallel import data_parallel, pipeline, zero
from jamp.step import LossFn, ValueAndGrad


def value_and_grad(param_specs: Any = None, *, pipelined: bool = False,
                   plan: zero.Plan | None = None, accumulate: int = 1,
                   max_leaves: Any = None) -> ValueAndGrad:
    """The ``value_and_grad`` argument of :func:`jamp.train_step` on a mesh.

    Each 'data' shard differentiates its share of the batch's mean loss with its
    own dropout key (the step's key folded with the shard index); the gradients
    are summed over 'data' in float32 and cast to each parameter's dtype.

    Args:
      param_specs: the parameters' mesh ``PartitionSpec`` pytree (e.g. from the
        logical axis rules); needed with ``pipelined`` (it says which parameters
        are split into stages).
      plan: a ZeRO stage (:class:`jamp.parallel.zero.Plan`): gradients
        reduce-scattered in float32 (stage 2), parameters gathered in their read
        dtype (stage 3); see :func:`jamp.parallel.data_parallel.value_and_grad`.
      pipelined: the model runs its layers as a GPipe pipeline over 'pipe'
        (built with a :class:`jamp.parallel.pipeline.GPipe` layer runner): 'pipe'
        is then manual too and the schedule runs in place on each stage.
      accumulate: micro-batches per step (gradient accumulation): each shard's slice
        runs as that many micro-batches in a ``lax.scan``, gradients summed in float32
        and reduced once per window (:mod:`jamp.grad_accum`).
      max_leaves: prefix tree of bools: differentiated leaves combined by max over the
        micro-batches (the fp8 state; e.g. ``(False, True)`` for ``(params, fp8)``).

    Returns:
      ``value_and_grad(loss_fn) -> f(params, batch, rng) -> ((value, aux), grads)``.

    Raises:
      ValueError: ``pipelined`` without ``param_specs``.

    Example: see the module docstring.
    """
    if pipelined and param_specs is None:
        raise ValueError("A pipelined model needs param_specs (the parameters' mesh "
                         "PartitionSpecs, e.g. from the logical axis rules).")
    manual_axes = (pipeline.PIPE,) if pipelined else ()

    def transform(loss_fn: LossFn):
        def shard_loss(params, batch, rng):
            # Runs once per 'data' shard: a different dropout mask on each.
            rng = jax.random.fold_in(rng, data_parallel.shard_index())
            return loss_fn(params, batch, rng)

        return data_parallel.value_and_grad(shard_loss, manual_axes=manual_axes,
                                            param_specs=param_specs, plan=plan,
                                            accumulate=accumulate, max_leaves=max_leaves)

    return transform
