"""Attention with a float32 softmax that keeps only half-precision residuals.

Computing softmax in float32 is what keeps fp16 attention stable, but the naive
way (``softmax(x.astype(f32))``) saves the float32 probabilities for the
backward pass *and* their half-precision copy for the value matmul: 3x the
memory of the half-precision probabilities alone, the largest activation of a
transformer. :func:`softmax_fp32` computes in float32 and saves only its
half-precision output, like Megatron-LM's fused softmax.

:func:`dot_product_attention` is a drop-in ``attention_fn`` for
``flax.linen.MultiHeadDotProductAttention`` built on it; jamp's policy installs
it automatically in modes whose softmax runs in float32.

Example:
  >>> import jax.numpy as jnp, jamp.attention
  >>> jamp.attention.softmax_fp32(jnp.zeros((2, 4), jnp.float16)).dtype
  dtype('float16')
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def softmax_fp32(x: jax.Array, axis: int | tuple[int, ...] = -1) -> jax.Array:
    """Softmax computed in float32, returned (and saved for backward) in ``x.dtype``.

    Args:
      x: logits, any floating dtype.
      axis: the axis (or tuple of axes) to normalise over.

    Returns:
      Probabilities in ``x.dtype``.

    Example:
      >>> import jax.numpy as jnp, jamp.attention
      >>> p = jamp.attention.softmax_fp32(jnp.array([0.0, 0.0], jnp.bfloat16))
      >>> p.dtype, float(p[0])
      (dtype(bfloat16), 0.5)
    """
    return jax.nn.softmax(x.astype(jnp.float32), axis=axis).astype(x.dtype)


def _softmax_fwd(x, axis):
    y = softmax_fp32(x, axis)
    return y, y


def _softmax_bwd(axis, y, g):
    y32, g32 = y.astype(jnp.float32), g.astype(jnp.float32)
    dx = y32 * (g32 - jnp.sum(g32 * y32, axis=axis, keepdims=True))
    return (dx.astype(y.dtype),)


softmax_fp32.defvjp(_softmax_fwd, _softmax_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def log_softmax_fp32(x: jax.Array, axis: int | tuple[int, ...] = -1) -> jax.Array:
    """Log-softmax computed in float32, returned (and saved for backward) in ``x.dtype``.

    Example:
      >>> import jax.numpy as jnp, jamp.attention
      >>> y = jamp.attention.log_softmax_fp32(jnp.zeros(2, jnp.float16))
      >>> y.dtype, round(float(y[0]), 3)
      (dtype('float16'), -0.693)
    """
    return jax.nn.log_softmax(x.astype(jnp.float32), axis=axis).astype(x.dtype)


def _log_softmax_fwd(x, axis):
    y = log_softmax_fp32(x, axis)
    return y, y


def _log_softmax_bwd(axis, y, g):
    g32 = g.astype(jnp.float32)
    dx = g32 - jnp.exp(y.astype(jnp.float32)) * jnp.sum(g32, axis=axis, keepdims=True)
    return (dx.astype(y.dtype),)


log_softmax_fp32.defvjp(_log_softmax_fwd, _log_softmax_bwd)


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
) -> jax.Array:
    """Multi-head attention ``softmax(q k^T / sqrt(d)) v`` with a float32 softmax.

    Same signature and layout as ``flax.linen.dot_product_attention``
    (``[batch..., length, heads, head_dim]``); both matmuls take ``dtype``
    operands, the softmax runs in float32 and saves half-precision residuals.

    Example:
      >>> import jax.numpy as jnp, jamp.attention
      >>> q = jnp.ones((1, 5, 2, 4), jnp.float16)
      >>> jamp.attention.dot_product_attention(q, q, q).shape
      (1, 5, 2, 4)
    """
    query, key, value = nn.dtypes.promote_dtype(query, key, value, dtype=dtype)
    dtype = query.dtype
    query = query / jnp.sqrt(query.shape[-1]).astype(dtype)
    logits = jnp.einsum("...qhd,...khd->...hqk", query, key, precision=precision)
    if bias is not None:
        logits = logits + bias.astype(dtype)
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.finfo(dtype).min)
    weights = softmax_fp32(logits)
    if not deterministic and dropout_rate > 0.0:
        keep_prob = 1.0 - dropout_rate
        shape = list(weights.shape)
        if broadcast_dropout:
            shape[-2] = 1
        keep = jax.random.bernoulli(dropout_rng, keep_prob, shape)
        weights = weights * (keep.astype(dtype) / jnp.asarray(keep_prob, dtype))
    return jnp.einsum("...hqk,...khd->...qhd", weights, value, precision=precision)
