"""Float32 accumulation of half-precision values, forward and backward: interpreter rules.

XLA accumulates a ``reduce_sum`` in its operand's dtype, and JAX's autodiff
writes such sums of its own: the transpose of every ``broadcast_in_dim`` of a
half-precision value (a bias add, a norm's mean, a mask) is a ``reduce_sum`` of
the half-precision cotangent, as is the transpose of an elementwise op with a
scalar operand, of ``tile``, and the JVP of ``reduce_max``/``reduce_min``. So a
bias gradient is a sum of thousands of float16 terms rounded at every step
(``jax_allow_f16_reductions=False`` makes each such sum raise at trace time).
The sums autodiff writes cannot be changed after differentiation, so these
rules change the *forward* computation that :func:`~jamp.autocast.rewrite`
evaluates, before anything is differentiated:

- a *linear* op on half-precision operands whose own evaluation or whose
  transpose accumulates (:data:`LINEAR`: broadcasts, sums, cumulative and
  windowed sums, ``tile``, gathers, whose transpose is a scatter-add, and
  ``psum``/``psum_scatter``) runs on float32 copies of its operands and casts its result back:
  the values are the same (the casts are exact), the forward sums accumulate in
  float32 and the transpose of the whole is ``convert -> float32 op -> convert``;
- ``reduce_max``/``reduce_min`` (whose JVP counts the maxima with a sum) run
  the same way; the result is exact in any dtype;
- an elementwise op (:data:`ELEMENTWISE`) that broadcasts a scalar operand
  implicitly gets that operand broadcast explicitly by the rule above, when the
  op computes in half precision.

The rules are differentiable in every mode (no custom derivative: ``jax.jvp``
and higher orders still work) and save nothing more for the backward pass; the
price is float32 temporaries that XLA usually fuses away.

Example:
  >>> import jax, jax.numpy as jnp, jamp
  >>> from jamp.autocast import Rules, rewrite
  >>> f = lambda x, b: jnp.sum((x + b).astype(jnp.float32))
  >>> x, b = jnp.ones((4096, 2), jnp.float16), jnp.zeros(2, jnp.float16)
  >>> g = jax.grad(rewrite(f, Rules(jnp.float16, cast_dots=False, float32_ops=False)), 1)
  >>> with jax.allow_f16_reductions(False):
  ...     g(x, b).tolist()  # 4096 > 2048: a float16 running sum would stop at 2048
  [4096.0, 4096.0]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["ELEMENTWISE", "LINEAR", "broadcast_operands", "in_float32"]

HALF = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))

LINEAR = frozenset({"broadcast_in_dim", "reduce_sum", "cumsum", "reduce_window_sum", "tile",
                    "gather", "psum", "psum_invariant", "reduce_scatter", "reduce_max",
                    "reduce_min"})
"""Ops that run on float32 copies of half-precision operands (they or their transposes sum)."""

ELEMENTWISE = frozenset({"add", "add_any", "sub", "mul", "div", "rem", "max", "min", "pow",
                         "atan2", "nextafter", "clamp", "select_n"})
"""Elementwise ops whose scalar operands are broadcast explicitly (their transpose sums)."""

Bind = Callable[..., list]
"""``bind(eqn, invals) -> outvals``: the interpreter's way to run an equation."""


def _half(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    # Extended dtypes (flax's fp8 state, "fp8_meta32"; PRNG keys) are never half.
    return (dtype is not None and not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)
            and jnp.dtype(dtype) in HALF)


def _floating(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def in_float32(eqn: Any, invals: Sequence[Any], bind: Bind) -> list | None:
    """``eqn`` run on float32 copies of its half-precision operands, outputs cast back.

    Each output takes the dtype of the operand it corresponds to (``psum`` of
    several operands), or else the half dtype among the operands. ``None`` when
    no operand is half precision (nothing to change).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jamp.accumulate import in_float32
      >>> eqn = jax.make_jaxpr(lambda x: x.sum())(jnp.ones(3, jnp.float16)).eqns[0]
      >>> bind = lambda e, xs: [e.primitive.bind(*xs, **e.params)]
      >>> in_float32(eqn, [jnp.ones(3, jnp.float16)], bind)[0].dtype
      dtype('float16')
    """
    halves = [jnp.dtype(x.dtype) for x in invals if _half(x)]
    if not halves:
        return None
    outs = bind(eqn, [x.astype(jnp.float32) if _half(x) else x for x in invals])
    if len(outs) == len(invals) and len(outs) > 1:
        like = [x.dtype if _floating(x) else None for x in invals]
    else:
        like = [halves[0]] * len(outs)
    return [y.astype(d) if d is not None and _floating(y) and y.dtype != d else y
            for y, d in zip(outs, like, strict=True)]


def _broadcast(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``x`` (rank 0 or ``len(shape)``) broadcast to ``shape``; half values through float32."""
    if x.ndim == 0:
        dims: tuple[int, ...] = ()
    else:
        dims = tuple(range(len(shape)))
    if not _half(x):
        return jax.lax.broadcast_in_dim(x, shape, dims)
    wide = jax.lax.broadcast_in_dim(x.astype(jnp.float32), shape, dims)
    return wide.astype(x.dtype)


def broadcast_operands(eqn: Any, invals: Sequence[Any]) -> list:
    """``invals`` with every traced operand of an implicitly broadcasting op broadcast.

    For an op of :data:`ELEMENTWISE` whose floating operands meet in a half
    dtype, an array operand of another shape than the output (a scalar) is
    broadcast to it explicitly, with a float32 transpose; literals and NumPy
    constants (no gradient) are left alone, as are all other ops' operands.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jamp.accumulate import broadcast_operands
      >>> eqn = jax.make_jaxpr(lambda x, s: x * s)(jnp.ones(3), jnp.ones(())).eqns[0]
      >>> half = jnp.ones(3, jnp.float16), jnp.asarray(2, jnp.float16)
      >>> [x.shape for x in broadcast_operands(eqn, half)]
      [(3,), (3,)]
    """
    if eqn.primitive.name not in ELEMENTWISE or len(eqn.outvars) != 1:
        return list(invals)
    shape = tuple(eqn.outvars[0].aval.shape)
    floating = [x for x in invals if _floating(x)]
    narrow = min((x.dtype for x in floating), key=lambda d: jnp.dtype(d).itemsize, default=None)
    if narrow is None or jnp.dtype(narrow) not in HALF:
        return list(invals)
    return [_broadcast(x, shape) if isinstance(x, jax.Array) and _floating(x)
            and x.shape != shape else x for x in invals]
