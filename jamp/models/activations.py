"""Activations whose backward pass keeps only their input.

Autodiff of ``jax.nn.gelu`` (tanh form) saves intermediates of the formula for the
backward pass: on ViT-B/16 at batch 128 in bfloat16, under jamp's policy (which computes
its powers and ``tanh`` in float32, keeping their half-precision inputs), five
``[batch, seq, mlp]`` tensors per layer besides the input, 0.6 GiB per layer and the
largest share of the step's memory. :func:`gelu` computes the same float32 formula and,
like PyTorch's fused GELU, saves only its input; the backward pass recomputes the
derivative from it (a few elementwise operations on data that is read anyway).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jamp.models.activations import gelu
  >>> x = jnp.linspace(-3.0, 3.0, 7)
  >>> bool((gelu(x) == jax.nn.gelu(x)).all())
  True
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _gelu32(x: jax.Array) -> jax.Array:
    """``jax.nn.gelu`` computed in (at least) float32, returned in ``x``'s dtype."""
    return jax.nn.gelu(x.astype(jnp.promote_types(x.dtype, jnp.float32))).astype(x.dtype)


@jax.custom_vjp
def gelu(x: jax.Array) -> jax.Array:
    """``jax.nn.gelu`` (tanh approximation, flax's ``nn.gelu``) keeping one residual.

    Computed in float32 (a half-precision input is widened, the result rounded back to
    its dtype), so values and gradients equal autodiff of
    ``jax.nn.gelu(x.astype(jnp.float32)).astype(x.dtype)``; for float32 inputs, of
    ``jax.nn.gelu`` itself.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jamp.models.activations import gelu
      >>> x = jnp.array([-1.0, 0.5], jnp.bfloat16)
      >>> gelu(x).dtype, bool((jax.grad(lambda v: gelu(v).sum())(x) == jax.grad(
      ...     lambda v: jax.nn.gelu(v.astype(jnp.float32)).astype(v.dtype).sum())(x)).all())
      (dtype(bfloat16), True)
    """
    return _gelu32(x)


def _gelu_fwd(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    return _gelu32(x), x


def _gelu_bwd(x: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    return jax.vjp(_gelu32, x)[1](g)


gelu.defvjp(_gelu_fwd, _gelu_bwd)
