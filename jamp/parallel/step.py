"""The mixed-precision train step on a ('data', 'model', 'pipe') mesh.

Same contract and metrics as :func:`jamp.step.train_step`, for ``jax.jit``
under ``jax.set_mesh(mesh)`` and ``nn.logical_axis_rules(LOGICAL_AXIS_RULES)``:

- data: each 'data' shard differentiates its slice of the batch and the
  gradients are all-reduced in each parameter's dtype
  (:func:`jamp.parallel.data_parallel.value_and_grad`);
- tensor: the ViT's heads and MLP hidden units are split over 'model' by the
  logical axis rules (Megatron), the partitioner inserts the collectives;
- pipeline: the encoder runs as a GPipe schedule over 'pipe' (the model
  does it itself when the mesh has a 'pipe' axis, :mod:`jamp.parallel.pipeline`).

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
  >>> mesh = make_mesh({"data": 2, "model": 1, "pipe": 2})
  >>> with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
  ...     train_step = jax.jit(functools.partial(step.train_step, param_specs=specs))
  ...     state, metrics = train_step(state, batch, jax.random.key(1))
  >>> float(metrics["loss_scale"]), bool(metrics["grad_finite"])
  (1024.0, True)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax.training import train_state

from jamp.loss_scale import loss_scale, overflow_stats, scale_loss
from jamp.parallel import data_parallel, pipeline
from jamp.step import correct_predictions, cross_entropy


def grads(state: train_state.TrainState, batch: dict[str, jax.Array], rng: jax.Array,
          label_smoothing: float = 0.0, param_specs: Any = None
          ) -> tuple[Any, dict[str, jax.Array]]:
    """Gradients of the *scaled* loss, all-reduced over 'data'; and loss/accuracy.

    The first half of :func:`train_step`; ``state.apply_gradients(grads=...)``
    is the second (unscale, check, skip or update). Arguments as there.

    Example:
      >>> # g, metrics = jamp.parallel.step.grads(state, batch, rng)
    """

    def loss_fn(params, batch, rng):
        # Runs once per 'data' shard: a different dropout mask on each.
        rng = jax.random.fold_in(rng, jax.lax.axis_index(data_parallel.DATA))
        logits = state.apply_fn({"params": params}, batch["image"], train=True,
                                rngs={"dropout": rng})
        loss = cross_entropy(logits, batch["label"], label_smoothing)
        accuracy = jnp.mean(correct_predictions(logits, batch["label"]))
        return scale_loss(loss, state.opt_state), {"loss": loss, "accuracy": accuracy}

    # With a pipeline, 'pipe' is manual too: the model runs the schedule in place on
    # each stage's slice of the layers (param_specs say which parameters are split).
    pipe = () if pipeline.num_stages() == 1 else (pipeline.PIPE,)
    if pipe and param_specs is None:
        raise ValueError("A mesh with a 'pipe' axis needs param_specs (the parameters' mesh "
                         "PartitionSpecs, e.g. from the logical axis rules).")
    value_and_grad = data_parallel.value_and_grad(loss_fn, manual_axes=pipe,
                                                  param_specs=param_specs)
    (_, metrics), g = value_and_grad(state.params, batch, rng)
    return g, metrics


def train_step(
    state: train_state.TrainState,
    batch: dict[str, jax.Array],
    rng: jax.Array,
    label_smoothing: float = 0.0,
    param_specs: Any = None,
) -> tuple[train_state.TrainState, dict[str, Any]]:
    """One data/tensor/pipeline-parallel training step with exact skip-on-overflow.

    Args:
      state: a ``TrainState`` whose ``tx`` holds a jamp loss scale
        (:func:`jamp.make_optimizer`).
      batch: ``{"image": [B, ...], "label": [B]}``, B divisible by the 'data'
        axis (times the pipeline microbatches when 'pipe' > 1).
      rng: dropout key for this step.
      label_smoothing: optional label smoothing.
      param_specs: the parameters' mesh ``PartitionSpec`` pytree; needed when the
        mesh has a 'pipe' axis > 1 (it says which parameters are split into stages).

    Returns:
      The new state and metrics: loss, accuracy, loss_scale (used for this
      step), grad_finite, steps_skipped, diverged.

    Example: see the module docstring.
    """
    scale = loss_scale(state.opt_state)
    g, metrics = grads(state, batch, rng, label_smoothing, param_specs)
    state = state.apply_gradients(grads=g)
    stats = overflow_stats(state.opt_state)
    return state, dict(metrics, loss_scale=scale, grad_finite=stats.last_finite,
                       steps_skipped=stats.steps_skipped, diverged=stats.diverged)
