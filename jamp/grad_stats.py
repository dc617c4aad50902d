"""Statistics of a step's gradients, after unscaling: zero counts and the global norm.

Megatron's and Colossal-AI's ``log_num_zeros_in_grad`` reports how many gradient
elements are exactly zero: a count that jumps shows gradients flushed to zero (the
loss scale too small for float16) or dead units. :func:`num_zeros` counts them on
the *unscaled* gradients (each element times ``1 / scale`` in float32, so an element
too small to survive the unscale counts as zero, as it does for the optimizer).

Both statistics are reductions over global arrays under ``jax.jit``: a leaf split
over a mesh is counted once (each element lives on one device), and a replicated
leaf is not counted once per device. Call them outside ``shard_map`` (the train step
does, on the gradients its mesh gradient function returned).

Example:
  >>> import jax.numpy as jnp
  >>> from jamp import grad_stats
  >>> grads = {"w": jnp.array([0.0, 2.0, -0.0], jnp.float16), "b": jnp.array([4.0])}
  >>> int(grad_stats.num_zeros(grads, jnp.float32(2.0)))
  2
  >>> float(grad_stats.global_norm(grads, jnp.float32(2.0)))
  2.2360680103302
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

__all__ = ["global_norm", "num_zeros"]


def _floating(tree: Any) -> list[jax.Array]:
    return [x for x in jax.tree_util.tree_leaves(tree)
            if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]


def _unscaled(x: jax.Array, inv_scale: jax.Array) -> jax.Array:
    wide = jnp.promote_types(jnp.result_type(x), jnp.float32)
    return x.astype(wide) * inv_scale.astype(wide)


def num_zeros(grads: Any, scale: jax.Array | float = 1.0) -> jax.Array:
    """The number of exactly-zero elements of ``grads / scale`` (an int32 scalar).

    Counted per leaf in int32 and summed in int32: exact up to 2**31 - 1 elements
    (about two billion parameters). Non-floating leaves are skipped; NaN and inf
    are not zero.

    Example:
      >>> import jax.numpy as jnp
      >>> int(num_zeros({"w": jnp.array([0.0, 1e-30, jnp.nan])}, 2.0**100))
      2
    """
    inv = 1.0 / jnp.asarray(scale, jnp.float32)
    counts = [jnp.sum(_unscaled(x, inv) == 0, dtype=jnp.int32) for x in _floating(grads)]
    return sum(counts, jnp.zeros((), jnp.int32))


def global_norm(grads: Any, scale: jax.Array | float = 1.0) -> jax.Array:
    """The float32 global L2 norm of ``grads / scale`` (inf or NaN if any element is).

    Example:
      >>> import jax.numpy as jnp
      >>> float(global_norm({"a": jnp.array([6.0, 8.0])}, 2.0))
      5.0
    """
    inv = 1.0 / jnp.asarray(scale, jnp.float32)
    return optax.tree_utils.tree_norm([_unscaled(x, inv) for x in _floating(grads)])
