"""Activations whose backward pass keeps only their input.

Autodiff of ``jax.nn.gelu`` (tanh form) saves every intermediate of the formula for the
backward pass: on ViT-B/16 at batch 128 that is five ``[batch, seq, mlp]`` tensors per
layer besides the input, 0.6 GiB per layer in bfloat16 and the largest share of the
step's memory. :func:`gelu` computes the same values and, like PyTorch's fused GELU, saves
only its input; the backward pass recomputes the derivative from it (a few elementwise
operations on data that is read anyway).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jamp.models.activations import gelu
  >>> x = jnp.linspace(-3.0, 3.0, 7)
  >>> bool((gelu(x) == jax.nn.gelu(x)).all())
  True
"""

from __future__ import annotations

import jax


@jax.custom_vjp
def gelu(x: jax.Array) -> jax.Array:
    """``jax.nn.gelu`` (tanh approximation, flax's ``nn.gelu``) keeping one residual.

    Values and gradients equal ``jax.nn.gelu``'s, in ``x``'s dtype.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jamp.models.activations import gelu
      >>> x = jnp.array([-1.0, 0.5], jnp.bfloat16)
      >>> bool((jax.grad(lambda v: gelu(v).sum())(x)
      ...       == jax.grad(lambda v: jax.nn.gelu(v).sum())(x)).all())
      True
    """
    return jax.nn.gelu(x)


def _gelu_fwd(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    return jax.nn.gelu(x), x


def _gelu_bwd(x: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    return jax.vjp(jax.nn.gelu, x)[1](g)


gelu.defvjp(_gelu_fwd, _gelu_bwd)
