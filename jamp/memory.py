"""Memory accounting at the JAX level: the same figures on CPU, GPU and TPU.

XLA:CPU upcasts half precision to float32 and its compiled memory analysis does
not show half-precision savings, so jamp counts bytes from shapes and dtypes:
parameters, gradients (one per parameter, in its dtype), optimizer state, and
the residuals a training step saves for the backward pass (from ``jax.vjp``
under ``jax.eval_shape``: nothing is computed or allocated).

Example:
  >>> import jax, jax.numpy as jnp, jamp
  >>> loss = lambda p, x: jnp.sum(jnp.tanh(x @ p["w"]))
  >>> report = jamp.memory_report(loss, {"w": jnp.ones((4, 4))}, jnp.ones((2, 4)))
  >>> report.params_bytes, report.residual_bytes, report.activation_bytes
  (64, 96, 64)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core
import numpy as np


def tree_bytes(tree: Any) -> int:
    """Bytes of all array leaves of ``tree`` (arrays or ``ShapeDtypeStruct``).

    Example:
      >>> import jax.numpy as jnp, jamp
      >>> jamp.tree_bytes({"a": jnp.ones((2, 3), jnp.float16)})
      12
    """
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            total += int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes held by a training step, counted from shapes and dtypes.

    Attributes:
      params_bytes: the model parameters.
      grads_bytes: one gradient per parameter, in the parameter's dtype.
      opt_state_bytes: the optimizer state (moments, master weights, loss scale);
        0 when no optimizer state was given.
      residual_bytes: everything the forward pass saves for the backward pass
        (activations, half-precision copies of parameters, and parameters or
        inputs used directly).
      activation_bytes: the part of ``residual_bytes`` computed in the forward
        pass (excludes parameters and inputs saved as they are); ``None`` when
        this JAX version does not expose the breakdown.
      model_state_bytes: non-parameter model state given as ``model_state``
        (the fp8 modes' scales and amax histories, :class:`jamp.fp8.TrainState`
        ``fp8`` and ``fp8_pending``); 0 when none was given.
    """

    params_bytes: int
    grads_bytes: int
    opt_state_bytes: int
    residual_bytes: int
    activation_bytes: int | None = None
    model_state_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        """Params + grads + optimizer state + residuals + model state."""
        return (self.params_bytes + self.grads_bytes + self.opt_state_bytes
                + self.residual_bytes + self.model_state_bytes)

    def as_dict(self) -> dict[str, int | None]:
        """The report as a plain dict (for JSON), with ``total_bytes``."""
        return {**dataclasses.asdict(self), "total_bytes": self.total_bytes}

    def __str__(self) -> str:
        mib = lambda b: "n/a" if b is None else f"{b / 2**20:,.1f} MiB"
        rows = [("params", self.params_bytes), ("grads", self.grads_bytes),
                ("optimizer state", self.opt_state_bytes), ("residuals", self.residual_bytes),
                ("  of which activations", self.activation_bytes)]
        if self.model_state_bytes:
            rows.append(("model state (fp8)", self.model_state_bytes))
        rows.append(("total", self.total_bytes))
        return "\n".join(f"{name:<22}{mib(b):>14}" for name, b in rows)


def _residuals_of(loss_fn: Callable) -> Callable:
    """``(params, *args) -> residuals``: what ``jax.vjp`` keeps for the backward pass."""

    def residuals_of(p, *a):
        _, vjp_fn = jax.vjp(lambda q: loss_fn(q, *a), p)
        return jax.tree_util.tree_leaves(vjp_fn)

    return residuals_of


def _activation_bytes(loss_fn: Callable, params: Any, args: tuple) -> int:
    """Bytes of the residuals the forward pass computes: not an input, not a constant.

    A residual that *is* a parameter or a batch input (e.g. the float32 kernel
    a matmul keeps for its input gradient) is returned by the jaxpr as one of
    its inputs; everything else (half-precision copies, activations) was computed.
    """
    jaxpr = jax.make_jaxpr(_residuals_of(loss_fn))(params, *args).jaxpr
    given = {*jaxpr.invars, *jaxpr.constvars}
    return sum(tree_bytes(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype))
               for v in jaxpr.outvars
               if not isinstance(v, jax.extend.core.Literal) and v not in given)


def memory_report(
    loss_fn: Callable[..., jax.Array],
    params: Any,
    *args: Any,
    opt_state: Any = None,
    model_state: Any = None,
) -> MemoryReport:
    """Counts the bytes of a training step of ``loss_fn`` at the JAX level.

    Nothing is computed: shapes come from ``jax.eval_shape``, so ``params`` and
    ``args`` may be arrays or ``jax.ShapeDtypeStruct``.

    Args:
      loss_fn: ``loss_fn(params, *args) -> scalar``, differentiated w.r.t. params.
      params: the parameters (in their storage dtype).
      *args: the other inputs of ``loss_fn`` (a batch, labels, ...).
      opt_state: optional optimizer state to count.
      model_state: optional non-parameter state to count (e.g. the fp8 state:
        ``(state.fp8, state.fp8_pending)`` of a :class:`jamp.fp8.TrainState`).
        In the fp8 modes ``loss_fn`` should read it too, so that the residuals
        are the fp8 matmuls' (fp8 operands with current scaling).

    Returns:
      A :class:`MemoryReport`.

    Example:
      >>> import jax.numpy as jnp, jamp
      >>> r = jamp.memory_report(lambda p, x: (x @ p).sum(), jnp.ones((3, 3)), jnp.ones((1, 3)))
      >>> r.grads_bytes
      36
      >>> meta = jamp.fp8.init_meta(16)   # 3 scales of 1 float, 3 amax histories of 16
      >>> jamp.memory_report(lambda p, x: (x @ p).sum(), jnp.ones((3, 3)), jnp.ones((1, 3)),
      ...                    model_state=meta).model_state_bytes
      204
    """
    residual_shapes = jax.eval_shape(_residuals_of(loss_fn), params, *args)
    return MemoryReport(
        params_bytes=tree_bytes(params),
        grads_bytes=tree_bytes(params),
        opt_state_bytes=tree_bytes(opt_state) if opt_state is not None else 0,
        residual_bytes=tree_bytes(residual_shapes),
        activation_bytes=_activation_bytes(loss_fn, params, args),
        model_state_bytes=tree_bytes(model_state) if model_state is not None else 0,
    )
