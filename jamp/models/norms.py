"""LayerNorms (linen and NNX) whose backward pass keeps only their input and parameters.

Autodiff of ``flax.linen.LayerNorm`` saves its float32 intermediates (the input widened to
float32, the centred input, the normalised output) for the backward pass: under jamp's
policy, which runs norms in float32, that is three ``[batch, seq, embed]`` float32 tensors
per norm, 0.3 GiB per ViT-B/16 layer at batch 128. :class:`LayerNorm` computes the same
values with flax's formula and saves only its input (and the two parameter vectors); the
backward pass recomputes the statistics from it, as PyTorch's fused LayerNorm does with its
saved mean and inverse deviation.

Example:
  >>> import jax, jax.numpy as jnp, flax.linen as nn
  >>> from jamp.models.norms import LayerNorm
  >>> x = jax.random.normal(jax.random.key(0), (2, 5))
  >>> variables = LayerNorm().init(jax.random.key(1), x)
  >>> bool((LayerNorm().apply(variables, x) == nn.LayerNorm().apply(variables, x)).all())
  True
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import dtypes
from jax import lax


def _layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, epsilon: float) -> jax.Array:
    """flax's LayerNorm over the last axis (fast variance, float32 statistics)."""
    wide = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    mean = wide.mean(-1)
    var = jnp.maximum(0.0, lax.square(wide).mean(-1) - lax.square(mean))
    mean, var = jnp.expand_dims(mean, -1), jnp.expand_dims(var, -1)
    y = x - mean
    mul = lax.rsqrt(var + epsilon)
    mul *= scale
    y *= mul
    y += bias
    return y


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, epsilon: float) -> jax.Array:
    """``flax.linen.LayerNorm``'s output for ``scale``/``bias`` (shape ``[features]``),
    keeping only ``x``, ``scale`` and ``bias`` for the backward pass.

    Example:
      >>> import jax.numpy as jnp
      >>> from jamp.models.norms import layer_norm
      >>> layer_norm(jnp.array([[1.0, 3.0]]), jnp.ones(2), jnp.zeros(2), 1e-6).round(3)
      Array([[-1.,  1.]], dtype=float32)
    """
    return _layer_norm(x, scale, bias, epsilon)


def _layer_norm_fwd(x, scale, bias, epsilon):
    return _layer_norm(x, scale, bias, epsilon), (x, scale, bias)


def _layer_norm_bwd(epsilon, residuals, g):
    return jax.vjp(functools.partial(_layer_norm, epsilon=epsilon), *residuals)[1](g)


layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


class LayerNorm(nn.LayerNorm):
    """``flax.linen.LayerNorm`` (same parameters, names and values) that keeps only its input
    for the backward pass; a subclass, so precision policies treat it as a norm.

    Supports the defaults of the last-axis form (scale and bias, fast variance, float32
    reductions, no mask or ``axis_name``); other settings are refused.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jamp.models.norms import LayerNorm
      >>> LayerNorm().init(jax.random.key(0), jnp.ones((1, 3)))["params"]["scale"].shape
      (3,)
    """

    @nn.compact
    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        _refuse_other_settings(self, mask)
        if not (self.use_scale and self.use_bias):
            raise ValueError("jamp.models.norms.LayerNorm needs use_scale and use_bias; use "
                             "flax.linen.LayerNorm without them.")
        features = (x.shape[-1],)
        scale = self.param("scale", self.scale_init, features, self.param_dtype)
        bias = self.param("bias", self.bias_init, features, self.param_dtype)
        dtype = dtypes.canonicalize_dtype(x, scale, bias, dtype=self.dtype)
        return jnp.asarray(layer_norm(x, scale, bias, self.epsilon), dtype)


def _refuse_other_settings(norm: nn.LayerNorm | nnx.LayerNorm, mask: jax.Array | None) -> None:
    plain = (mask is None and norm.axis_name is None and norm.use_fast_variance
             and getattr(norm, "force_float32_reductions", True)
             and norm.reduction_axes in (-1, (-1,)) and norm.feature_axes in (-1, (-1,)))
    if not plain:
        raise ValueError(
            "jamp.models.norms supports flax's default last-axis LayerNorm only (scale, "
            "bias, fast variance, no mask/axis_name); use flax's LayerNorm for other "
            "settings.")


class NnxLayerNorm(nnx.LayerNorm):
    """``flax.nnx.LayerNorm`` (same variables and values) that keeps only its input for the
    backward pass, like :class:`LayerNorm`; a subclass, so policies treat it as a norm.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jamp.models.norms import NnxLayerNorm
      >>> norm = NnxLayerNorm(3, rngs=nnx.Rngs(0))
      >>> bool((norm(jnp.arange(6.0).reshape(2, 3)) == nnx.LayerNorm(3, rngs=nnx.Rngs(0))(
      ...     jnp.arange(6.0).reshape(2, 3))).all())
      True
    """

    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        _refuse_other_settings(self, mask)
        if self.scale is None or self.bias is None:
            raise ValueError("NnxLayerNorm needs use_scale=True and use_bias=True; use "
                             "flax.nnx.LayerNorm without them.")
        x, scale, bias = self.promote_dtype((x, self.scale[...], self.bias[...]),
                                            dtype=self.dtype)
        dtype = dtypes.canonicalize_dtype(x, scale, bias, dtype=self.dtype)
        return jnp.asarray(layer_norm(x, scale, bias, self.epsilon), dtype)
