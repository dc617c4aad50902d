"""fp32 master weights for half-precision parameters (apex O2, Colossal-AI naive AMP).

In the ``fp16_naive`` mode the model's parameters are float16 for the forward
and backward pass, but updating them in float16 loses every increment below
half an ulp (about 1e-3 relative): with a learning rate of 1e-4 most updates
vanish. :func:`master_weights` keeps a float32 copy in the optimizer state, runs
the inner optimizer on it, and returns updates that move the half-precision
parameters to the rounded master values.

Example:
  >>> import jax.numpy as jnp, optax, jamp
  >>> tx = jamp.master_weights(optax.sgd(1e-4))
  >>> params = {"w": jnp.ones((2,), jnp.float16)}
  >>> state = tx.init(params)
  >>> for _ in range(10):
  ...   updates, state = tx.update({"w": jnp.ones((2,), jnp.float16)}, state, params)
  ...   params = optax.apply_updates(params, updates)
  >>> round(float(jamp.master_params(state)["w"][0]), 6)  # pure f16 would stay at 1.0
  0.999
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class MasterWeightsState(NamedTuple):
    """State of :func:`master_weights`: the float32 master copy and the inner state.

    Attributes:
      master: the parameters with every floating leaf in float32 (other leaves as
        they are): what the inner optimizer updates.
      inner_state: state of the inner optimizer, initialised on ``master``.
    """

    master: optax.Params
    inner_state: optax.OptState


def _floating(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _to_f32(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: x.astype(jnp.float32) if _floating(x) else x, tree)


def master_weights(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """Wraps ``inner`` so it updates float32 master copies of the parameters.

    ``init`` copies the parameters to float32 and initialises ``inner`` on the
    copy. ``update`` casts gradients to float32, runs ``inner`` against the
    master copy, applies the result to it, and returns updates such that
    ``optax.apply_updates(params, updates)`` equals the new master weights
    rounded to each parameter's dtype. Updates are float32; ``params`` must be
    given to ``update``. Put a loss scale *outside* (``jamp.DynamicLossScale(
    jamp.master_weights(tx))``) so skipped steps leave the master copy untouched.

    Args:
      inner: the optimizer to run in float32.

    Returns:
      An ``optax.GradientTransformation`` with :class:`MasterWeightsState`.

    Example:
      >>> import jax.numpy as jnp, optax, jamp
      >>> tx = jamp.master_weights(optax.adam(1e-3))
      >>> state = tx.init({"w": jnp.zeros((3,), jnp.float16)})
      >>> state.master["w"].dtype
      dtype('float32')
    """

    def init_fn(params: optax.Params) -> MasterWeightsState:
        master = _to_f32(params)
        return MasterWeightsState(master=master, inner_state=inner.init(master))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError(
                "jamp.master_weights needs the current params: call "
                "tx.update(grads, opt_state, params)."
            )
        updates, inner_state = inner.update(_to_f32(updates), state.inner_state, state.master)
        master = optax.apply_updates(state.master, updates)

        def delta(new, p):
            if not _floating(p):
                return jnp.zeros_like(p)
            return new.astype(p.dtype).astype(jnp.float32) - p.astype(jnp.float32)

        deltas = jax.tree_util.tree_map(delta, master, params)
        return deltas, MasterWeightsState(master=master, inner_state=inner_state)

    return optax.GradientTransformation(init_fn, update_fn)


def master_params(opt_state: optax.OptState) -> optax.Params:
    """Returns the float32 master copy held anywhere inside ``opt_state``.

    Raises:
      ValueError: if the state holds no :func:`master_weights` state.

    Example:
      >>> import jax.numpy as jnp, optax, jamp
      >>> s = jamp.master_weights(optax.sgd(0.1)).init({"w": jnp.ones(2, jnp.float16)})
      >>> jamp.master_params(s)["w"].dtype
      dtype('float32')
    """
    found = [
        s for s in jax.tree_util.tree_leaves(
            opt_state, is_leaf=lambda x: isinstance(x, MasterWeightsState))
        if isinstance(s, MasterWeightsState)
    ]
    if len(found) != 1:
        raise ValueError(
            f"Expected one jamp.master_weights state in opt_state, found {len(found)}. "
            "Master weights exist only in modes with master_weights=True (e.g. 'fp16_naive') "
            "or when you wrap your optimizer with jamp.master_weights(tx)."
        )
    return found[0].master
