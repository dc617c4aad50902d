"""The mixed-precision train step: scaled loss -> grads -> unscale/check -> skip or update.

:func:`make_optimizer` turns a :class:`~jamp.MixedPrecision` recipe and any optax
optimizer into the one transformation the mode needs (fp32 master weights,
then the loss scale outside them). :func:`train_step` is a complete
classification step on a ``flax.training.train_state.TrainState``, on one device
or, given the mesh's gradient function (:mod:`jamp.parallel.step`), on a mesh.

Example:
  >>> import jax, jax.numpy as jnp, flax.linen as nn, optax, jamp
  >>> from flax.training import train_state
  >>> from jamp.models import vit
  >>> mp = jamp.mixed_precision("fp16")
  >>> module = vit.create("ti", num_classes=3, patch_size=2, num_layers=1, hidden_size=8,
  ...                     num_heads=2, mlp_dim=8)
  >>> model = jamp.apply_policy(module, mp)
  >>> params = nn.unbox(model.init(jax.random.key(0), jnp.ones((1, 4, 4, 1))))["params"]
  >>> state = train_state.TrainState.create(
  ...     apply_fn=model.apply, params=params, tx=jamp.make_optimizer(mp, optax.sgd(0.1)))
  >>> batch = {"image": jnp.ones((2, 4, 4, 1)), "label": jnp.array([0, 1])}
  >>> state, metrics = jax.jit(jamp.train_step)(state, batch, jax.random.key(1))
  >>> float(metrics["loss_scale"])
  65536.0
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

from jamp import grad_stats, optim_state
from jamp.loss_scale import loss_scale, overflow_stats, scale_loss

if TYPE_CHECKING:
    from jamp.policy import PolicyLike


class TrainState(train_state.TrainState):
    """A flax ``TrainState`` that may carry variables the step differentiates besides params.

    :func:`train_step` asks the state, and nothing else, what more the forward
    pass reads: :meth:`differentiated_variables` (variable collections, e.g. the
    fp8 delayed-scaling state) are passed to ``apply_fn`` beside the params and
    differentiated with them; their gradients bypass the optimizer and go to
    :meth:`after_update`. A plain ``flax.training.train_state.TrainState`` (or
    this base) has none. :class:`jamp.fp8.TrainState` is the subclass of mode ``"fp8"``.

    Example:
      >>> import jax.numpy as jnp, optax, jamp
      >>> s = jamp.step.TrainState.create(apply_fn=None, params={}, tx=optax.sgd(0.1))
      >>> s.differentiated_variables(), s.after_update({}, s.opt_state, True, 1.0) is s
      ({}, True)
    """

    def differentiated_variables(self) -> dict[str, Any]:
        """``{collection: variables}`` the forward pass reads and the step differentiates."""
        return {}

    def variables_for_gradient(self, variables: dict[str, Any]) -> dict[str, Any]:
        """``variables`` as the differentiated forward pass reads them (base: unchanged).

        Called inside the differentiated function on :meth:`differentiated_variables`;
        a subclass may wrap them (fp8: max-combined uses, max over a mesh).
        """
        return variables

    def after_update(self, new_variables: dict[str, Any], opt_state_before: Any,
                     applied: jax.Array, scale_ratio: jax.Array) -> TrainState:
        """The state after ``apply_gradients``, given the differentiated variables' gradients.

        Args:
          new_variables: the gradients of :meth:`differentiated_variables`.
          opt_state_before: the optimizer state before this step's update.
          applied: whether the loss scale applied the update (``last_finite``).
          scale_ratio: the loss scale after the update over the one used this step.
        """
        del new_variables, opt_state_before, applied, scale_ratio
        return self

    def extra_state(self) -> tuple[Any, ...]:
        """The values of the fields a subclass adds to flax's (e.g. for memory reports).

        Example:
          >>> import optax, jamp
          >>> jamp.step.TrainState.create(apply_fn=None, params={}, tx=optax.sgd(0.1)).extra_state()
          ()
        """
        flax_fields = {f.name for f in dataclasses.fields(train_state.TrainState)}
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self)
                     if f.name not in flax_fields)


def differentiated_variables(state: train_state.TrainState) -> dict[str, Any]:
    """What ``state`` has the step differentiate besides its params; ``{}`` for flax's own.

    Example:
      >>> import optax, jamp
      >>> from flax.training import train_state
      >>> s = train_state.TrainState.create(apply_fn=None, params={}, tx=optax.sgd(0.1))
      >>> jamp.step.differentiated_variables(s)
      {}
    """
    return state.differentiated_variables() if isinstance(state, TrainState) else {}


def combined_by_max(state: Any) -> tuple[bool, bool] | None:
    """The ``max_leaves`` of ``state``'s differentiated tree: ``(False, True)`` when the step
    differentiates ``(params, extras)`` (the extras, e.g. the fp8 state, combine by max over
    accumulated micro-batches), else None (the params alone, summed).

    Example:
      >>> import optax, jamp
      >>> print(combined_by_max(jamp.step.TrainState.create(apply_fn=None, params={},
      ...                                                    tx=optax.sgd(0.1))))
      None
    """
    return (False, True) if differentiated_variables(state) else None


def make_optimizer(
    mp: PolicyLike,
    tx: optax.GradientTransformation,
    *,
    axis_names: tuple[str, ...] = (),
    seed: int = 0,
) -> optax.GradientTransformation:
    """Wraps ``tx`` as the mode requires: clipping, state precision, master weights, then
    the loss scale.

    With ``mp.clip_grad_norm`` > 0, ``tx`` first clips the unscaled gradients
    to that global norm (Colossal-AI naive AMP's ``clip_grad``).

    The mode's :class:`~jamp.loss_scale.LossScaleConfig` builds the scale:
    ``"dynamic"`` gives ``DynamicLossScale(tx)``, ``"static"`` gives
    ``StaticLossScale(tx)``, ``"none"`` gives ``NoOpLossScale(tx)`` (so
    ``jamp.loss_scale``/``jamp.overflow_stats`` work in every mode). With
    ``master_weights`` the optimizer runs on fp32 copies inside the loss scale,
    so a skipped step leaves the master copy untouched.

    Args:
      mp: what :func:`jamp.apply_policy` takes: a mode name (``"fp16"``), a
        ``jamp.mixed_precision(...)`` recipe, or a policy (a bare policy has no
        loss scale: name a mode to get one).
      tx: any optax optimizer (clipping inside it sees unscaled gradients).
      axis_names: mesh axes to reduce the overflow check over inside ``shard_map``.
      seed: the seed of ``master_weights="stochastic"`` rounding.

    With ``mp.optimizer_state`` other than ``"float32"`` the state of ``tx`` is stored
    small (:func:`jamp.low_precision_state`); a ``master_weights`` scheme other than
    True/False wraps it in :func:`jamp.optim_state.bf16_master`.

    Example:
      >>> import optax, jamp
      >>> tx = jamp.make_optimizer("O2", optax.adam(1e-3))
      >>> isinstance(tx, optax.GradientTransformation)
      True
    """
    from jamp.policy import to_mixed_precision  # here: jamp.policy imports jamp.fp8, whose
    # TrainState subclasses this module's
    mp = to_mixed_precision(mp)
    if mp.clip_grad_norm:  # unscaled gradients (in float32 under master weights)
        tx = optax.chain(optax.clip_by_global_norm(mp.clip_grad_norm), tx)
    tx = optim_state.wrap(tx, mp.optimizer_state, mp.master_weights, seed=seed)
    return mp.loss_scale.wrap(tx, axis_names)


def cross_entropy(logits: jax.Array, labels: jax.Array,
                  label_smoothing: float = 0.0) -> jax.Array:
    """Mean softmax cross-entropy in float32 (the loss always runs in float32).

    Example:
      >>> import jax.numpy as jnp, jamp
      >>> round(float(jamp.step.cross_entropy(jnp.zeros((1, 4)), jnp.array([2]))), 4)
      1.3863
    """
    logits = logits.astype(jnp.float32)
    targets = optax.smooth_labels(jax.nn.one_hot(labels, logits.shape[-1]), label_smoothing)
    return optax.softmax_cross_entropy(logits, targets).mean()


def correct_predictions(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """1.0 where the arg-max class is the label and every logit of the row is finite.

    ``argmax`` of a row of NaNs is class 0: without the finiteness test a model
    that outputs NaN would score the share of class 0 in the data.

    Example:
      >>> import jax.numpy as jnp
      >>> logits = jnp.array([[0.1, 2.0], [jnp.nan, jnp.nan]])
      >>> correct_predictions(logits, jnp.array([1, 0])).tolist()
      [1.0, 0.0]
    """
    finite = jnp.all(jnp.isfinite(logits), axis=-1)
    return ((jnp.argmax(logits, -1) == labels) & finite).astype(jnp.float32)


LossFn = Callable[[Any, dict[str, jax.Array], jax.Array],
                  tuple[jax.Array, dict[str, jax.Array]]]
"""``loss_fn(params, batch, rng) -> (scaled_loss, {"loss": ..., "accuracy": ...})``.

Every output is a mean over the examples of ``batch``.
"""

ValueAndGrad = Callable[[LossFn], Callable[..., tuple[tuple[jax.Array, Any], Any]]]
"""Turns a :data:`LossFn` into ``f(params, batch, rng) -> ((value, aux), grads)``."""


def single_device_value_and_grad(
    loss_fn: LossFn,
) -> Callable[..., tuple[tuple[jax.Array, Any], Any]]:
    """``jax.value_and_grad(loss_fn, has_aux=True)``: :func:`train_step`'s default.

    The whole batch is differentiated at once. Under ``jax.jit`` on a mesh the
    partitioner would all-reduce half-precision gradients in half precision
    (jax-ml/jax#27496): use :func:`jamp.parallel.step.value_and_grad` there.

    Example:
      >>> import jax.numpy as jnp
      >>> loss_fn = lambda w, batch, rng: (jnp.sum(w * batch["x"]), {})
      >>> (value, aux), grads = single_device_value_and_grad(loss_fn)(
      ...     jnp.ones(2), {"x": jnp.array([1.0, 2.0])}, None)
      >>> float(value), grads.tolist()
      (3.0, [1.0, 2.0])
    """
    return jax.value_and_grad(loss_fn, has_aux=True)


def train_step(
    state: train_state.TrainState,
    batch: dict[str, jax.Array],
    rng: jax.Array,
    label_smoothing: float = 0.0,
    value_and_grad: ValueAndGrad = single_device_value_and_grad,
    *,
    log_num_zeros_in_grad: bool = False,
) -> tuple[train_state.TrainState, dict[str, Any]]:
    """One classification training step with loss scaling and exact skip-on-overflow.

    The loss is computed in float32 on the model's logits and scaled by the
    current loss scale; ``value_and_grad`` differentiates it; the optimizer
    (from :func:`make_optimizer`) unscales, checks and skips or applies the update.
    :func:`loss_scaled_step` does all but the loss.

    Args:
      state: a ``TrainState`` whose ``apply_fn(variables, images, train=..., rngs=...)``
        returns logits and whose ``tx`` holds a jamp loss scale.
      batch: ``{"image": [B, ...], "label": [B]}``.
      rng: dropout key for this step.
      label_smoothing: optional label smoothing.
      value_and_grad: how the scaled loss is differentiated. The default,
        :func:`single_device_value_and_grad`, takes the whole batch at once; on a
        mesh pass :func:`jamp.parallel.step.value_and_grad`, which
        differentiates each 'data' shard's share and all-reduces the gradients in
        float32 (cast to each parameter's dtype). Gradient accumulation is a
        ``value_and_grad`` too (:func:`jamp.grad_accum.value_and_grad`, or
        ``accumulate=`` of the mesh one).
      log_num_zeros_in_grad: add ``num_zeros_in_grad`` to the metrics.

    Returns:
      The new state and metrics: loss, accuracy, loss_scale (used for this
      step), grad_finite, steps_skipped, diverged, grad_norm (unscaled).

    Example: see the module docstring.
    """
    loss_fn = classification_loss(label_smoothing)
    return loss_scaled_step(state, batch, rng, lambda v, b, r: loss_fn(state, v, b, r),
                            value_and_grad, log_num_zeros_in_grad=log_num_zeros_in_grad)


def classification_loss(label_smoothing: float = 0.0) -> Callable[..., tuple[jax.Array, dict]]:
    """``loss(state, variables, batch, rng) -> (loss, {"accuracy": ...})`` of an image classifier.

    ``state.apply_fn(variables, batch["image"], train=True, rngs={"dropout": rng})``
    gives the logits; the loss is :func:`cross_entropy` (float32, optional label
    smoothing). :func:`train_step` and the trainer's step (``jamp.train``, through
    :func:`jamp.booster.assemble_step`) use it.

    Example:
      >>> import jax.numpy as jnp, optax, jamp
      >>> from flax.training import train_state
      >>> s = train_state.TrainState.create(apply_fn=lambda v, x, **kw: x, params={},
      ...                                   tx=optax.sgd(0.1))
      >>> loss, m = classification_loss()(s, {}, {"image": jnp.zeros((2, 4)),
      ...                                          "label": jnp.array([0, 1])}, None)
      >>> round(float(loss), 4), float(m["accuracy"])
      (1.3863, 0.5)
    """
    def loss_fn(state, variables, batch, rng):
        logits = state.apply_fn(variables, batch["image"], train=True, rngs={"dropout": rng})
        loss = cross_entropy(logits, batch["label"], label_smoothing)
        return loss, {"accuracy": jnp.mean(correct_predictions(logits, batch["label"]))}

    return loss_fn


StepLossFn = Callable[[dict[str, Any], Any, jax.Array], tuple[jax.Array, dict[str, jax.Array]]]
"""``loss_fn(variables, batch, rng) -> (loss, metrics)``: the unscaled mean loss and
further per-step means; ``variables`` is ``{"params": ..., **extra collections}``."""


def _examples(batch: Any) -> int | None:
    """The batch's size: its first array's leading dimension (None: no such array)."""
    leaves = [x for x in jax.tree_util.tree_leaves(batch) if jnp.ndim(x)]
    return int(jnp.shape(leaves[0])[0]) if leaves else None


def loss_scaled_step(
    state: train_state.TrainState,
    batch: Any,
    rng: jax.Array,
    loss_fn: StepLossFn,
    value_and_grad: ValueAndGrad = single_device_value_and_grad,
    *,
    log_num_zeros_in_grad: bool = False,
    tensor_stats: Any = None,
) -> tuple[train_state.TrainState, dict[str, Any]]:
    """The step for any loss: scale, differentiate, unscale/check, skip or update.

    ``loss_fn`` gives the unscaled loss; this function scales it by the state's
    loss scale before ``value_and_grad`` differentiates it, then applies the
    gradients through the state's optimizer (which unscales, checks and skips).

    A :class:`TrainState` subclass (such as :class:`jamp.fp8.TrainState`, whose
    delayed-scaling fp8 state the forward pass reads) names further variables
    to differentiate (:meth:`TrainState.differentiated_variables`); their
    gradients bypass the optimizer and the loss scale and go to
    :meth:`TrainState.after_update` with whether the loss scale applied the step
    and how the loss scale changed (fp8: the new state is written back only for
    an applied step, max-combined over accumulated micro-batches and,
    on a mesh, over the 'data' shards and pipeline microbatches; the gradient
    amax history follows the loss scale).

    Returns:
      The new state and metrics: what ``loss_fn`` returned (``loss`` and its
      metrics), loss_scale (used for this step), grad_finite, steps_skipped,
      diverged, grad_norm (of the unscaled gradients) and, with
      ``log_num_zeros_in_grad``, num_zeros_in_grad (:mod:`jamp.grad_stats`); with a
      ``tensor_stats`` :class:`jamp.tensor_stats.Collector`, what it adds (per-layer
      statistics every N steps, the reason of a skipped or non-finite step).

    Example:
      >>> import jax, jax.numpy as jnp, optax, jamp
      >>> state = jamp.step.TrainState.create(
      ...     apply_fn=None, params={"w": jnp.zeros(2)},
      ...     tx=jamp.make_optimizer("fp16", optax.sgd(0.5)))
      >>> loss = lambda v, b, r: (jnp.mean((b["x"] @ v["params"]["w"] - 1.0) ** 2), {})
      >>> state, m = jamp.step.loss_scaled_step(state, {"x": jnp.ones((4, 2))}, None, loss,
      ...                                       log_num_zeros_in_grad=True)
      >>> float(m["loss"]), float(m["grad_norm"]), int(m["num_zeros_in_grad"])
      (1.0, 2.8284270763397217, 0)
    """
    scale = loss_scale(state.opt_state)
    extras = differentiated_variables(state)
    before = state

    def scaled_loss(differentiated, batch, rng):
        params, more = differentiated if extras else (differentiated, {})
        if extras:  # e.g. fp8 state: max-combined over its uses and over a mesh
            more = state.variables_for_gradient(more)
        loss, metrics = loss_fn({"params": params, **more}, batch, rng)
        return scale_loss(loss, state.opt_state), {"loss": loss, **metrics}

    if not extras:  # the params alone (a plain flax TrainState)
        (_, metrics), grads = value_and_grad(scaled_loss)(state.params, batch, rng)
        state = state.apply_gradients(grads=grads)
    else:
        (_, metrics), (grads, new) = value_and_grad(scaled_loss)((state.params, extras),
                                                                 batch, rng)
        state = state.apply_gradients(grads=grads)
        # Not through the optimizer: the state decides (e.g. kept only for an applied step).
        state = state.after_update(new, before.opt_state,
                                   overflow_stats(state.opt_state).last_finite,
                                   loss_scale(state.opt_state) / scale)
    stats = overflow_stats(state.opt_state)
    metrics = dict(metrics, loss_scale=scale, grad_finite=stats.last_finite,
                   steps_skipped=stats.steps_skipped, diverged=stats.diverged,
                   grad_norm=grad_stats.global_norm(grads, scale))
    if log_num_zeros_in_grad:
        metrics["num_zeros_in_grad"] = grad_stats.num_zeros(grads, scale)
    if tensor_stats is not None and tensor_stats.enabled:  # jamp.tensor_stats.Collector
        forward = None
        if tensor_stats.activations is not None:
            variables = {"params": before.params, **extras}
            forward = lambda reduce: tensor_stats.activations(before, variables, batch, rng,
                                                              reduce)
        bad = ~stats.last_finite | ~jnp.isfinite(metrics["loss"])
        metrics.update(tensor_stats.step_metrics(step=before.step, params=before.params,
                                                 grads=grads, scale=scale, bad=bad,
                                                 forward=forward, batch_size=_examples(batch)))
    return state, metrics


def eval_step(state: train_state.TrainState, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Sums of loss, correct predictions and examples over a (masked) eval batch.

    Example:
      >>> import jax.numpy as jnp, optax, jamp
      >>> from flax.training import train_state
      >>> logits_are_images = lambda variables, images, train: images
      >>> state = train_state.TrainState.create(apply_fn=logits_are_images, params={},
      ...                                       tx=optax.identity())
      >>> batch = {"image": jnp.array([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0]]),
      ...          "label": jnp.array([0, 0, 1]), "mask": jnp.array([True, True, False])}
      >>> metrics = jamp.eval_step(state, batch)
      >>> float(metrics["correct"]), float(metrics["count"])
      (1.0, 2.0)
    """
    variables = {"params": state.params, **differentiated_variables(state)}
    logits = state.apply_fn(variables, batch["image"], train=False)
    mask = batch.get("mask", jnp.ones(batch["label"].shape, bool)).astype(jnp.float32)
    logits = logits.astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    correct = correct_predictions(logits, batch["label"])
    return dict(loss_sum=jnp.sum(losses * mask), correct=jnp.sum(correct * mask),
                count=jnp.sum(mask))
