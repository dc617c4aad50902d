"""The delayed-scaling state in training: the train state, its commit, and its gradient's path.

The state of every delayed-scaling matmul (:func:`jamp.fp8.init_meta`) rides in
a :class:`TrainState` (``fp8``) beside the parameters, outside the optimizer:
:func:`jamp.train_step` reads it (its :meth:`TrainState.differentiated_variables`),
differentiates it with the parameters, and hands the gradient -- the new state
-- to :meth:`TrainState.after_update`, which commits it (:func:`commit`) only for a step
the loss scale applied (max-combined over ``optax.MultiSteps`` micro-batches)
and makes the gradient history :func:`follow_loss_scale`. On the way through
the differentiated function, :func:`as_meta` makes every use of one entry
combine by max, :func:`reduce_amax` takes the max over the 'data' shards of a
mesh, and :func:`only_on_real_data` keeps a pipeline's bubble ticks out.

Example:
  >>> import jax.numpy as jnp, optax, jamp
  >>> s = jamp.fp8.TrainState.create(apply_fn=None, params={}, tx=optax.sgd(0.1),
  ...                                fp8={"m": jamp.fp8.init_meta(2)})
  >>> sorted(s.differentiated_variables()) == [jamp.fp8.COLLECTION]
  True
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax.linen import fp8_ops

from jamp import step
from jamp.fp8.ops import COLLECTION, META_NAMES


def _is_meta_node(x: Any) -> bool:
    return isinstance(x, dict) and set(META_NAMES) <= set(x)


def as_meta(tree: Any) -> Any:
    """Converts float32 state leaves to flax's ``fm32`` dtype, whose gradients add by max.

    Call it on the state *before* it enters the model, inside the
    differentiated function: every use of one entry (a layer applied twice, a
    scan over micro-batches, a broadcast across scanned layers) then
    contributes the max of its amaxes, not their sum. Use it under ``jax.jit``
    (flax's ``fm32`` arrays do not run eagerly).

    Example:
      >>> import jax, jax.numpy as jnp, jamp
      >>> x, w = jnp.ones((2, 3), jnp.bfloat16), jnp.ones((3, 3), jnp.bfloat16)
      >>> dot = lambda a, m: jamp.fp8.delayed_scaling_dot_general(a, w, (((1,), (0,)), ((), ())), m)
      >>> twice = lambda m: dot(2 * dot(x, m), m).astype(jnp.float32).sum()
      >>> new = jax.jit(jax.grad(lambda m: twice(jamp.fp8.as_meta(m))))(jamp.fp8.init_meta(2))
      >>> new["input_amax_history"].tolist(), new["input_scale"].tolist()  # sums: 7 and 2
      ([6.0, 0.0], [1.0])
    """
    return jax.tree_util.tree_map(
        lambda x: jax.lax.convert_element_type(x, fp8_ops.fm32), tree)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _max_over(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    return x


def _max_over_fwd(x, axes):
    return x, None


def _max_over_bwd(axes, _, ct):
    # The caller's transpose sums cotangents over ``axes`` (the psum of a pcast): the max on
    # one shard and zeros elsewhere sum to the max, exactly.
    first = functools.reduce(jnp.logical_and, [jax.lax.axis_index(a) == 0 for a in axes])
    return (jnp.where(first, jax.lax.pmax(ct, axes), jnp.zeros_like(ct)),)


_max_over.defvjp(_max_over_fwd, _max_over_bwd)


def reduce_amax(tree: Any, split_axes: Sequence[str] = ("pipe",)) -> Any:
    """Identity whose gradient (the new fp8 state) is max-reduced over the mesh axes it varies on.

    Inside ``jax.shard_map`` (``jamp.parallel.step.value_and_grad``) each 'data'
    shard sees its own examples' amax and the gradients of the state are
    summed over 'data'; through this function that sum is the max, so every
    device gets the same history and scales as one device on the whole batch.
    Under plain ``jax.jit`` (nothing varies) it does nothing: the amax of a
    sharded array is already global.

    Args:
      tree: the fp8 state (float32 leaves), inside the differentiated function.
      split_axes: manual mesh axes a leaf varies on because it is *split* over
        them, not replicated: each shard holds different entries, which must not
        be combined. By default jamp's pipeline axis ``'pipe'``, over which the
        stacked per-layer state is split into stages.

    Example:
      >>> import jax, jax.numpy as jnp, jamp
      >>> float(jax.grad(lambda m: 3 * jamp.fp8.reduce_amax(m))(jnp.float32(1.0)))
      3.0
    """
    def one(x):
        aval = jax.typeof(x)
        manual = getattr(aval, "manual_axis_type", None)  # JAX >= 0.9; .vma before
        varying = manual.varying if manual is not None else getattr(aval, "vma", ())
        axes = tuple(sorted(set(varying) - set(split_axes)))
        return _max_over(x, axes) if axes else x

    return jax.tree_util.tree_map(one, tree)


@jax.custom_vjp
def _gradient_only_when(keep: jax.Array, x: jax.Array) -> jax.Array:
    return x


def _gradient_only_when_fwd(keep, x):
    return x, keep


def _gradient_only_when_bwd(keep, ct):
    # An fm32 cotangent is converted for the select and back; 0 is the identity of max.
    f32 = jax.lax.convert_element_type(ct, jnp.float32)
    gated = jax.lax.convert_element_type(jnp.where(keep, f32, 0.0), ct.dtype)
    return None, gated


_gradient_only_when.defvjp(_gradient_only_when_fwd, _gradient_only_when_bwd)


def only_on_real_data(tree: Any, real: jax.Array) -> Any:
    """Identity on values; the state's gradient (its new value) is dropped where ``real`` is False.

    A pipeline's bubble ticks run the layers on filler (zeros) whose outputs are
    discarded; a parameter's gradient from them is exactly zero, but the fp8
    state's "gradient" is its new amax history, which would take the filler's
    amax. :class:`jamp.parallel.pipeline.GPipe` passes the stage's variables
    through this on every tick, so only real microbatches enter the max.
    Leaves that are not fp8 state (not flax's ``fm32``) pass untouched.

    Example:
      >>> import jax, jax.numpy as jnp, jamp
      >>> x, w = jnp.ones((2, 3), jnp.bfloat16), jnp.ones((3, 1), jnp.bfloat16)
      >>> def loss(m, real):
      ...     m = jamp.fp8.only_on_real_data(jamp.fp8.as_meta(m), real)
      ...     y = jamp.fp8.delayed_scaling_dot_general(x, w, (((1,), (0,)), ((), ())), m)
      ...     return y.astype(jnp.float32).sum()
      >>> new_meta = jax.jit(jax.grad(loss))
      >>> [new_meta(jamp.fp8.init_meta(2), real)["input_amax_history"].tolist()
      ...  for real in (True, False)]
      [[1.0, 0.0], [0.0, 0.0]]
    """
    real = jnp.asarray(real, bool)
    return jax.tree_util.tree_map(
        lambda x: _gradient_only_when(real, x) if x.dtype == fp8_ops.fm32 else x, tree)


def _keep_unused(old: Any, new: Any) -> Any:
    """``new`` with the entries of matmuls the loss never reached (zero scale) kept ``old``."""
    if _is_meta_node(new):
        unused = new["input_scale"] == 0
        return {k: jnp.where(unused, old[k], v) for k, v in new.items()}
    if isinstance(new, dict):
        return {k: _keep_unused(old[k], v) for k, v in new.items()}
    return new


def _multisteps(opt_state: Any) -> Any:
    found = optax.tree_utils.tree_get_all_with_path(opt_state, "MultiStepsState")
    return found[0][1] if found else None


class TrainState(step.TrainState):
    """A train state (:class:`jamp.step.TrainState`) with the delayed-scaling fp8 state.

    Attributes:
      fp8: the model's :data:`COLLECTION` variables (what ``model.init`` returned),
        read by every forward pass; ``{}`` when the model has none.
      fp8_pending: the state being built up over the micro-batches of one
        ``optax.MultiSteps`` window (amax combined by max); becomes ``fp8`` when
        the window's update is applied.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jamp
      >>> s = jamp.fp8.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)},
      ...                                tx=optax.sgd(0.1), fp8={"m": jamp.fp8.init_meta(4)})
      >>> s.fp8_pending["m"]["input_scale"].tolist()
      [1.0]
    """

    fp8: Any = None
    fp8_pending: Any = None

    @classmethod
    def create(cls, *, apply_fn: Any, params: Any, tx: optax.GradientTransformation,
               fp8: Any = None, **kwargs: Any) -> TrainState:
        """``TrainState.create`` with the fp8 collection (``variables.get(COLLECTION, {})``).

        Example: see the class docstring.
        """
        fp8 = {} if fp8 is None else fp8
        return super().create(apply_fn=apply_fn, params=params, tx=tx, fp8=fp8,
                              fp8_pending=fp8, **kwargs)

    def differentiated_variables(self) -> dict[str, Any]:
        """``{COLLECTION: fp8}`` (``{}`` without fp8 state): read and differentiated by the step.

        Example: see the module docstring.
        """
        return {COLLECTION: self.fp8} if self.fp8 else {}

    def variables_for_gradient(self, variables: dict[str, Any]) -> dict[str, Any]:
        """The state as the differentiated forward pass reads it: max over a mesh's shards
        (:func:`reduce_amax`) and over its uses (:func:`as_meta`)."""
        return {k: as_meta(reduce_amax(v)) for k, v in variables.items()}

    def after_update(self, new_variables: dict[str, Any], opt_state_before: Any,
                     applied: jax.Array, scale_ratio: jax.Array) -> TrainState:
        """:func:`commit` the new state (an applied step only), then :func:`follow_loss_scale`.

        Example:
          >>> import jax.numpy as jnp, optax, jamp
          >>> s = jamp.fp8.TrainState.create(apply_fn=None, params={}, tx=optax.sgd(0.1),
          ...                                fp8={"m": jamp.fp8.init_meta(2)})
          >>> new = {jamp.fp8.COLLECTION: s.fp8}
          >>> s.after_update(new, s.opt_state, jnp.bool_(True), 2.0).fp8["m"]["input_scale"]
          Array([1.], dtype=float32)
        """
        state = commit(self, new_variables[COLLECTION], opt_state_before, applied)
        # The gradient amax was of the gradient scaled by the old scale; the next is scaled anew.
        return follow_loss_scale(state, scale_ratio)


def commit(state: TrainState, new_meta: Any, opt_state_before: Any,
           applied: jax.Array) -> TrainState:
    """Writes the new delayed-scaling state back, only for an applied step.

    ``new_meta`` is the gradient of ``state.fp8`` (the state after this batch).
    A step the loss scale skipped (``applied`` False) changes nothing. Without
    ``optax.MultiSteps`` an applied step's state becomes ``fp8``. With it, the
    window's micro-batches all read the window's starting ``fp8`` and their
    new states are combined elementwise by max in ``fp8_pending`` (the same
    rolled history with the window's largest amax in front, the same scales);
    ``fp8`` takes it when the window's update is applied.

    Args:
      state: the train state after ``apply_gradients``.
      new_meta: the gradient of ``state.fp8``.
      opt_state_before: the optimizer state before this step's update.
      applied: whether the optimizer took this (micro-)batch (the loss scale's
        ``last_finite``).

    Returns:
      ``state`` with ``fp8`` and ``fp8_pending`` updated.

    Example:
      >>> import jax.numpy as jnp, optax, jamp
      >>> s = jamp.fp8.TrainState.create(apply_fn=None, params={}, tx=optax.sgd(0.1),
      ...                                fp8={"m": jamp.fp8.init_meta(2)})
      >>> new = {"m": dict(jamp.fp8.init_meta(2), input_amax_history=jnp.array([5.0, 0.0]))}
      >>> jamp.fp8.commit(s, new, s.opt_state, jnp.bool_(False)).fp8["m"]["input_amax_history"]
      Array([0., 0.], dtype=float32)
    """
    new_meta = _keep_unused(state.fp8, new_meta)
    before, after = _multisteps(opt_state_before), _multisteps(state.opt_state)
    if before is None:
        first = boundary = jnp.bool_(True)
    else:
        first = before.mini_step == 0
        boundary = after.mini_step == 0
    where = lambda c, a, b: jax.tree_util.tree_map(lambda x, y: jnp.where(c, x, y), a, b)
    combined = where(first, new_meta, jax.tree_util.tree_map(jnp.maximum, state.fp8_pending,
                                                              new_meta))
    pending = where(applied, combined, state.fp8_pending)
    fp8 = where(applied & boundary, pending, state.fp8)
    return state.replace(fp8=fp8, fp8_pending=pending)


def follow_loss_scale(state: TrainState, ratio: jax.Array) -> TrainState:
    """Multiplies the gradient amax histories by ``ratio``, the loss scale's change this step.

    The E5M2 gradient being quantized is the *loss-scaled* gradient, so its amax
    history is in units of the scale it was recorded at. When the loss scale
    grows (x2 after ``growth_interval`` clean steps) the next gradients are twice
    the history's max, and delayed scaling would saturate their largest entries
    at the E5M2 maximum; after a back-off it would waste a bit of range. The
    train step calls this after every update (skipped or applied) with
    ``new_scale / old_scale``, a power of two for the dynamic loss scale, so the
    history stays exact. ``fp8`` and ``fp8_pending`` both follow.

    Example:
      >>> import jax.numpy as jnp, optax, jamp
      >>> meta = dict(jamp.fp8.init_meta(2), output_grad_amax_history=jnp.array([3.0, 1.0]))
      >>> s = jamp.fp8.TrainState.create(apply_fn=None, params={}, tx=optax.sgd(0.1),
      ...                                fp8={"m": meta})
      >>> jamp.fp8.follow_loss_scale(s, 2.0).fp8["m"]["output_grad_amax_history"].tolist()
      [6.0, 2.0]
    """
    def rescale(tree):
        if _is_meta_node(tree):
            hist = tree["output_grad_amax_history"]
            return dict(tree, output_grad_amax_history=hist * jnp.asarray(ratio, hist.dtype))
        if isinstance(tree, dict):
            return {k: rescale(v) for k, v in tree.items()}
        return tree

    return state.replace(fp8=rescale(state.fp8), fp8_pending=rescale(state.fp8_pending))
