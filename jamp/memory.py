"""Memory accounting at the JAX level: the same figures on CPU, GPU and TPU.

XLA:CPU upcasts half precision to float32 and its compiled memory analysis does
not show half-precision savings, so jamp counts bytes from shapes and dtypes:
parameters, gradients (one per parameter, in its dtype), optimizer state, and
the residuals a training step saves for the backward pass (from ``jax.vjp``
under ``jax.eval_shape``: nothing is computed or allocated). Sharded states are
also counted per device (:func:`bytes_per_device`, :class:`PerDevice`): what one
device holds of the parameters, gradients, optimizer state and master copy.

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
from jax.sharding import NamedSharding, Sharding

from jamp.master import MasterWeightsState
from jamp.optim_state.master import Bf16MasterState


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


def _is_array(leaf: Any) -> bool:
    return hasattr(leaf, "shape") and hasattr(leaf, "dtype")


def _leaf_bytes_per_device(leaf: Any) -> int:
    sharding = getattr(leaf, "sharding", None)
    shape = sharding.shard_shape(leaf.shape) if isinstance(sharding, Sharding) else leaf.shape
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize


def bytes_per_device(tree: Any) -> int:
    """Bytes of all array leaves of ``tree`` that one device holds.

    A leaf with a sharding (a ``jax.Array``, or a ``jax.ShapeDtypeStruct`` given
    ``sharding=``) counts its shard shape (``sharding.shard_shape(shape)``: a
    dimension split over a mesh axis of size n holds 1/n of it, rounded up); a leaf
    without one counts in full, as in :func:`tree_bytes`.

    Example:
      >>> import jax, jax.numpy as jnp, jamp
      >>> from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P
      >>> mesh = AbstractMesh((4,), ("data",))
      >>> w = jax.ShapeDtypeStruct((8, 4), jnp.float16, sharding=NamedSharding(mesh, P("data")))
      >>> jamp.tree_bytes(w), jamp.bytes_per_device(w)   # 8 x 4 halves; 2 x 4 per device
      (64, 16)
      >>> jamp.bytes_per_device({"w": w, "b": jax.ShapeDtypeStruct((4,), jnp.float32)})
      32
    """
    return sum(_leaf_bytes_per_device(leaf)
               for leaf in jax.tree_util.tree_leaves(tree) if _is_array(leaf))


def _split_over_data(leaf: Any) -> bool:
    """Whether ``leaf`` is replicated over a 'data' axis of size > 1 (not split over it)."""
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, NamedSharding) or sharding.mesh.shape.get("data", 1) <= 1:
        return True
    named = {a for entry in sharding.spec if entry is not None
             for a in (entry if isinstance(entry, tuple) else (entry,))}
    return "data" in named


def _replicated_bytes(tree: Any) -> int:
    return sum(_leaf_bytes_per_device(leaf) for leaf in jax.tree_util.tree_leaves(tree)
               if _is_array(leaf) and not _split_over_data(leaf))


def _is_master_state(x: Any) -> bool:
    return isinstance(x, MasterWeightsState | Bf16MasterState)


def _split_master(opt_state: Any) -> tuple[Any, list[Any]]:
    """``(opt_state without master copies, [master copies])``: found as :func:`jamp.master_params`
    finds them (by type, not by name)."""
    masters = [s.master for s in jax.tree_util.tree_leaves(opt_state, is_leaf=_is_master_state)
               if _is_master_state(s)]
    rest = jax.tree_util.tree_map(
        lambda s: s._replace(master=None) if _is_master_state(s) else s, opt_state,
        is_leaf=_is_master_state)
    return rest, masters


def _has_sharding(tree: Any) -> bool:
    return any(isinstance(getattr(leaf, "sharding", None), Sharding)
               for leaf in jax.tree_util.tree_leaves(tree))


@dataclasses.dataclass(frozen=True)
class PerDevice:
    """Bytes one device holds of a training step's states (see :func:`bytes_per_device`).

    Attributes:
      params: the parameters' shards.
      grads: the gradients' shards (one per parameter, in its dtype, sharded as the
        step holds them: ``grad_shardings`` of :func:`memory_report`).
      opt_state: the optimizer state's shards, without the master copy.
      master: the float32 master copy of :func:`jamp.master_weights`, or the buffer of a
        :func:`jamp.optim_state.bf16_master` scheme (remainders, Kahan compensation);
        0 if none.
      replicated: the part of the figures here held whole on every device of a 'data'
        axis of size > 1 (leaves whose sharding does not split them over 'data':
        scalars, leaves too small or not divisible); 0 when 'data' has size 1.
      model_state: the non-parameter model state's shards (the fp8 modes' scales and
        amax histories; never split over 'data'); 0 when none was given.
    """

    params: int
    grads: int
    opt_state: int
    master: int
    replicated: int
    model_state: int = 0

    @property
    def total(self) -> int:
        """Params + grads + optimizer state + master copy + model state (``replicated``
        is part of them)."""
        return self.params + self.grads + self.opt_state + self.master + self.model_state

    def as_dict(self) -> dict[str, int]:
        """The figures as a plain dict, with ``total``."""
        return {**dataclasses.asdict(self), "total": self.total}


def per_device_bytes(params: Any, opt_state: Any = None, grad_shardings: Any = None,
                     model_state: Any = None) -> PerDevice:
    """Per-device bytes of ``params``, their gradients, ``opt_state`` and its master copy.

    Args:
      params: parameters (``jax.Array`` or ``jax.ShapeDtypeStruct`` with shardings).
      opt_state: optional optimizer state; a :func:`jamp.master_weights` master copy
        inside it is counted apart, as ``master``.
      grad_shardings: shardings of the gradients, a pytree like ``params`` (ZeRO-2/3
        split them over 'data'); default: the parameters' own shardings.
      model_state: optional non-parameter state (the fp8 state), counted as ``model_state``.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jamp
      >>> from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P
      >>> mesh = AbstractMesh((4,), ("data",))
      >>> p = {"w": jax.ShapeDtypeStruct((8,), jnp.float16, sharding=NamedSharding(mesh, P()))}
      >>> s = {"w": NamedSharding(mesh, P("data"))}
      >>> jamp.memory.per_device_bytes(p, grad_shardings=s)   # 16 B params, 4 B of the grads
      PerDevice(params=16, grads=4, opt_state=0, master=0, replicated=16, model_state=0)
    """
    if grad_shardings is None:
        grads = params
    else:
        grads = jax.tree_util.tree_map(
            lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=s) if _is_array(p)
            else p, params, grad_shardings)
    rest, masters = _split_master(opt_state)
    return PerDevice(
        params=bytes_per_device(params),
        grads=bytes_per_device(grads),
        opt_state=bytes_per_device(rest),
        master=bytes_per_device(masters),
        replicated=_replicated_bytes((params, grads, rest, masters, model_state)),
        model_state=bytes_per_device(model_state) if model_state is not None else 0,
    )


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
      per_device: what one device holds of params, grads, optimizer state and
        master copy (a :class:`PerDevice`), when the params or optimizer state
        carry shardings; ``None`` otherwise. The figures above are whole arrays.
    """

    params_bytes: int
    grads_bytes: int
    opt_state_bytes: int
    residual_bytes: int
    activation_bytes: int | None = None
    model_state_bytes: int = 0
    per_device: PerDevice | None = None

    @property
    def total_bytes(self) -> int:
        """Params + grads + optimizer state + residuals + model state."""
        return (self.params_bytes + self.grads_bytes + self.opt_state_bytes
                + self.residual_bytes + self.model_state_bytes)

    def as_dict(self) -> dict[str, Any]:
        """The report as a plain dict (for JSON), with ``total_bytes``; ``per_device``
        nested (with its ``total``) or ``None``."""
        return {**dataclasses.asdict(self), "total_bytes": self.total_bytes,
                "per_device": self.per_device.as_dict() if self.per_device else None}

    def __str__(self) -> str:
        mib = lambda b: "n/a" if b is None else f"{b / 2**20:,.1f} MiB"
        rows = [("params", self.params_bytes), ("grads", self.grads_bytes),
                ("optimizer state", self.opt_state_bytes), ("residuals", self.residual_bytes),
                ("  of which activations", self.activation_bytes)]
        if self.model_state_bytes:
            rows.append(("model state (fp8)", self.model_state_bytes))
        rows.append(("total", self.total_bytes))
        if self.per_device is not None:
            d = self.per_device
            rows += [("per device (replicated: not split over 'data'):", ""),
                     ("  params", d.params), ("  grads", d.grads),
                     ("  optimizer state", d.opt_state), ("  master copy", d.master)]
            if d.model_state:
                rows.append(("  model state (fp8)", d.model_state))
            rows += [("  of which replicated", d.replicated), ("  total", d.total)]
        return "\n".join(f"{name:<22}{b if isinstance(b, str) else mib(b):>14}".rstrip()
                         for name, b in rows)


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
    grad_shardings: Any = None,
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
      grad_shardings: shardings of the gradients a step holds, a pytree like
        ``params`` (ZeRO-2/3 split them over 'data'); default: the parameters' own.
        Used for ``per_device``, which is computed when ``params`` or ``opt_state``
        carry shardings (``jax.Array`` or ``jax.ShapeDtypeStruct(..., sharding=)``).

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
        per_device=(per_device_bytes(params, opt_state, grad_shardings, model_state)
                    if _has_sharding((params, opt_state)) else None),
    )
