"""fp8 numerics: per-tensor scales, quantization and the two scaled matmuls.

An fp8 matmul quantizes both operands to ``float8_e4m3fn`` (:data:`E4M3`) with one
float32 scale per tensor, multiplies them with the result in the compute dtype,
and in the backward pass quantizes the incoming gradient to ``float8_e5m2``
(:data:`E5M2`) for the two gradient matmuls. The scale of ``x`` is
``amax / fp8_max``; the two kinds of scaling differ in which amax:

- :func:`current_scaling_dot_general` (stateless): the amax of the tensor itself.
- :func:`delayed_scaling_dot_general`: the max of an amax history (:func:`init_meta`),
  flax's ``fp8_ops.fp8_scaled_dot_general``; the "gradient" of the history is its new
  value (see :mod:`jamp.fp8.state`).

The quantization, the fp8 maxima and the transposes of the backward pass are
``flax.linen.fp8_ops``'s; this module adds what flax has not: the current-scaling
custom VJP, and NaN instead of saturation for non-finite values (an overflow must
reach the loss scale's finite check).

Example:
  >>> import jax, jax.numpy as jnp, jamp
  >>> x = jnp.ones((4, 8), jnp.bfloat16); w = jnp.full((8, 2), 0.5, jnp.bfloat16)
  >>> y = jax.jit(jamp.fp8.current_scaling_dot_general, static_argnums=2)(
  ...     x, w, (((1,), (0,)), ((), ())))
  >>> y.dtype, float(y[0, 0])
  (dtype(bfloat16), 4.0)
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

E4M3 = jnp.float8_e4m3fn
"""Forward operands (activations and weights): 4 exponent bits, 3 mantissa bits, max 448."""

E5M2 = jnp.float8_e5m2
"""Gradients in the backward pass: 5 exponent bits, 2 mantissa bits, max 57344."""

COLLECTION = fp8_ops.OVERWRITE_WITH_GRADIENT
"""The linen variable collection of delayed-scaling state (``"_overwrite_with_gradient"``)."""

META_NAMES = ("input_scale", "kernel_scale", "output_grad_scale",
              "input_amax_history", "kernel_amax_history", "output_grad_amax_history")
"""The six entries of one fp8 matmul's delayed-scaling state (flax's names)."""


def tensor_scale(x: jax.Array, fp8_dtype: Any) -> jax.Array:
    """The float32 per-tensor scale ``amax(|x|) / fp8_max`` (1 where the amax is 0 or not finite).

    Example:
      >>> import jax.numpy as jnp, jamp
      >>> float(jamp.fp8.tensor_scale(jnp.array([-896.0, 3.0]), jamp.fp8.E4M3))
      2.0
    """
    amax = jnp.max(jnp.abs(x), initial=0).astype(jnp.float32)  # 0 (scale 1) when empty
    ok = (amax > 0) & jnp.isfinite(amax)
    return jnp.where(ok, amax / fp8_ops.get_fp8_max(fp8_dtype, jnp.float32), jnp.float32(1.0))


def _nan_where_not_finite(x: jax.Array) -> jax.Array:
    return jnp.where(jnp.isfinite(x), x, jnp.asarray(jnp.nan, x.dtype))


def quantize(x: jax.Array, fp8_dtype: Any, scale: jax.Array) -> jax.Array:
    """``x / scale`` in float32, clipped to the fp8 range, cast to ``fp8_dtype``.

    Finite values saturate at the fp8 maximum (``flax.linen.fp8_ops.quantize``);
    inf, -inf and NaN become NaN, so an overflow upstream still reaches the loss
    scale's finite check and the divergence guard instead of turning into a
    plausible large number.

    Example:
      >>> import jax.numpy as jnp, jamp
      >>> x = jnp.array([1000.0, 1.0, jnp.inf])
      >>> q = jamp.fp8.quantize(x, jamp.fp8.E4M3, jnp.float32(1.0))
      >>> q.dtype, q.astype(jnp.float32).tolist()
      (dtype(float8_e4m3fn), [448.0, 1.0, nan])
    """
    x = _nan_where_not_finite(x.astype(jnp.float32))
    return fp8_ops.quantize(x, fp8_dtype, jnp.asarray(scale, jnp.float32), jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _current_dot(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any) -> jax.Array:
    return _current_dot_fwd(lhs, rhs, dimension_numbers)[0]


def _current_dot_fwd(lhs, rhs, dimension_numbers):
    out_dtype = jnp.result_type(lhs, rhs)
    lhs_scale, rhs_scale = tensor_scale(lhs, E4M3), tensor_scale(rhs, E4M3)
    q_lhs, q_rhs = quantize(lhs, E4M3, lhs_scale), quantize(rhs, E4M3, rhs_scale)
    out = jax.lax.dot_general(q_lhs, q_rhs, dimension_numbers, preferred_element_type=out_dtype)
    out = (out * (lhs_scale * rhs_scale).astype(out_dtype)).astype(out_dtype)
    # fp8 residuals: the backward pass keeps a quarter of the float32 (half of the bf16) bytes.
    return out, (q_lhs, lhs_scale, q_rhs, rhs_scale)


def _current_dot_bwd(dimension_numbers, res, g):
    q_lhs, lhs_scale, q_rhs, rhs_scale = res  # the operands had g's dtype
    g_scale = tensor_scale(g, E5M2)
    q_g = quantize(g, E5M2, g_scale)
    transpose = dict(dimension_numbers=dimension_numbers, precision=None,
                     preferred_element_type=jnp.promote_types(g.dtype, jnp.float32))
    grad_lhs = fp8_ops.dot_general_transpose_lhs(q_g, q_lhs, q_rhs, **transpose)
    grad_rhs = fp8_ops.dot_general_transpose_rhs(q_g, q_lhs, q_rhs, **transpose)
    grad_lhs = (grad_lhs * (g_scale * rhs_scale)).astype(g.dtype)
    grad_rhs = (grad_rhs * (g_scale * lhs_scale)).astype(g.dtype)
    return grad_lhs, grad_rhs


_current_dot.defvjp(_current_dot_fwd, _current_dot_bwd)


def current_scaling_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any,
                                precision: Any = None, preferred_element_type: Any = None,
                                **kwargs: Any) -> jax.Array:
    """``lax.dot_general`` as an fp8 matmul with current (just-in-time) scaling.

    Forward: each operand is scaled by its own ``amax / 448`` and cast to E4M3;
    the fp8 dot returns the operands' common (compute) dtype. Backward: the
    incoming gradient is scaled by its own ``amax / 57344``, cast to E5M2, and
    multiplied with the saved E4M3 operands; the gradients come back in the
    operands' dtypes. Stateless: usable as ``dot_general=`` of ``nn.Dense``,
    ``nn.DenseGeneral``, ``nnx.Linear``, ``nnx.LinearGeneral``, or as
    ``jnp.einsum(..., _dot_general=...)``.

    Args:
      lhs, rhs, dimension_numbers: as ``jax.lax.dot_general``.
      precision: ignored (fp8 has one precision).
      preferred_element_type: the output dtype if given (else the operands' dtype).
      **kwargs: ignored (``out_sharding`` from NNX layers).

    Returns:
      The product, in ``preferred_element_type`` or the operands' dtype.

    Example:
      >>> import jax, jax.numpy as jnp, jamp
      >>> x = jnp.array([[1.0, 2.0]], jnp.bfloat16); w = jnp.array([[3.0], [0.5]], jnp.bfloat16)
      >>> jamp.fp8.current_scaling_dot_general(x, w, (((1,), (0,)), ((), ()))).tolist()  # not 4:
      [[3.984375]]

      (0.5 is 74.7 units of the kernel's scale 3/448; E4M3 rounds it to 72.)
    """
    del precision, kwargs
    dtype = jnp.result_type(lhs, rhs)
    out = _current_dot(lhs.astype(dtype), rhs.astype(dtype), dimension_numbers)
    return out if preferred_element_type is None else out.astype(preferred_element_type)


def current_scaling_einsum(subscripts: str, *operands: jax.Array, **kwargs: Any) -> jax.Array:
    """``jnp.einsum`` whose contractions are :func:`current_scaling_dot_general` (``nnx.Einsum``).

    Example:
      >>> import jax.numpy as jnp, jamp
      >>> x, w = jnp.ones((2, 3), jnp.bfloat16), jnp.ones((3, 1), jnp.bfloat16)
      >>> jamp.fp8.current_scaling_einsum("ij,jk->ik", x, w).tolist()
      [[3.0], [3.0]]
    """
    kwargs.pop("out_sharding", None)
    return jnp.einsum(subscripts, *operands, _dot_general=current_scaling_dot_general, **kwargs)


def init_meta(amax_history_length: int = 1024) -> dict[str, jax.Array]:
    """A fresh delayed-scaling state of one matmul: scales 1, histories 0 (flax's layout).

    Example:
      >>> import jamp
      >>> meta = jamp.fp8.init_meta(4)
      >>> meta["kernel_scale"].tolist(), meta["kernel_amax_history"].tolist()
      ([1.0], [0.0, 0.0, 0.0, 0.0])
    """
    scale, hist = jnp.ones((1,), jnp.float32), jnp.zeros((amax_history_length,), jnp.float32)
    return {n: scale if n.endswith("_scale") else hist for n in META_NAMES}


def delayed_scaling_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any,
                                meta: dict[str, jax.Array]) -> jax.Array:
    """An fp8 matmul with delayed scaling: ``flax.linen.fp8_ops.fp8_scaled_dot_general``.

    ``meta`` is one matmul's state (:func:`init_meta`). Each scale is computed
    from the max of its history (before this step's amax is added); the
    gradient of ``meta`` is its new value (history rolled, this step's amax
    in front; scales of this step). ``rhs`` is the kernel: its dtype is the
    compute dtype.

    Example:
      >>> import jax, jax.numpy as jnp, jamp
      >>> x, w = jnp.ones((2, 3), jnp.bfloat16), jnp.ones((3, 1), jnp.bfloat16)
      >>> f = lambda m: jamp.fp8.delayed_scaling_dot_general(x, w, (((1,), (0,)), ((), ())), m)
      >>> new = jax.jit(jax.grad(lambda m: f(m).astype(jnp.float32).sum()))(jamp.fp8.init_meta(2))
      >>> new["input_amax_history"].tolist(), new["output_grad_amax_history"].tolist()
      ([1.0, 0.0], [1.0, 0.0])
    """
    dtype = rhs.dtype
    y = fp8_ops.fp8_scaled_dot_general(
        _non_finite_as_nan(lhs.astype(dtype)), _non_finite_as_nan(rhs), dimension_numbers,
        preferred_element_type=dtype,
        lhs_scale=meta["input_scale"], rhs_scale=meta["kernel_scale"],
        grad_scale=meta["output_grad_scale"], lhs_amax_history=meta["input_amax_history"],
        rhs_amax_history=meta["kernel_amax_history"],
        grad_amax_history=meta["output_grad_amax_history"], quantize_compute_type=dtype)
    return _non_finite_as_nan(y)


def delayed_scaling_einsum_dot(meta: dict[str, jax.Array]) -> Any:
    """``jnp.einsum``'s ``_dot_general`` for delayed scaling on one matmul's read state.

    Example:
      >>> import jax.numpy as jnp, jamp
      >>> dot = jamp.fp8.ops.delayed_scaling_einsum_dot(jamp.fp8.init_meta(2))
      >>> x, w = jnp.ones((2, 3), jnp.bfloat16), jnp.ones((3, 1), jnp.bfloat16)
      >>> jnp.einsum("ij,jk->ik", x, w, _dot_general=dot).tolist()
      [[3.0], [3.0]]
    """
    def dot(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
        del precision  # fp8 has one precision; computed in rhs's (the kernel's) dtype
        y = delayed_scaling_dot_general(lhs.astype(rhs.dtype), rhs, dimension_numbers, meta)
        return y if preferred_element_type is None else y.astype(preferred_element_type)

    return dot


@jax.custom_vjp
def _non_finite_as_nan(x: jax.Array) -> jax.Array:
    """Identity whose value and cotangent have inf/-inf replaced by NaN.

    flax's quantization saturates an inf at the fp8 maximum, which would hide an
    overflow from the loss scale; a NaN stays NaN through the fp8 cast.
    """
    return _nan_where_not_finite(x)


_non_finite_as_nan.defvjp(lambda x: (_nan_where_not_finite(x), None),
                          lambda _, g: (_nan_where_not_finite(g),))
