"""fp8 matmuls for the ``"fp8"`` (delayed scaling) and ``"fp8_current"`` modes.

An fp8 matmul quantizes both operands to ``float8_e4m3fn`` (E4M3: 3 mantissa
bits, max 448) with one float32 scale per tensor, multiplies them with the
result in the compute dtype (bfloat16), and in the backward pass quantizes the
incoming gradient to ``float8_e5m2`` (E5M2: more range, max 57344) for the two
gradient matmuls. The scale of a tensor ``x`` is ``amax / fp8_max`` so that
``x / scale`` fills the fp8 range; the modes differ in which ``amax``:

- **current scaling** (:func:`current_scaling_dot_general`, stateless): the
  amax of the tensor itself, computed before each matmul. One extra reduction
  per operand; nothing to store, checkpoint or synchronise.
- **delayed scaling** (Transformer Engine's default, ``flax.linen.fp8_ops``):
  the max of an *amax history* of the last ``amax_history_length`` steps, so
  the scale is known before the tensor is. The state (three scales and three
  histories per matmul: input, kernel, output gradient) lives in the
  ``"_overwrite_with_gradient"`` collection (:data:`COLLECTION`): the backward
  pass returns each entry's *new value* as its "gradient", and the train step
  writes it back (:func:`commit`) instead of giving it to the optimizer.

For linen, delayed scaling is flax's ``Fp8DirectDotGeneralOp`` used as the
``dot_general_cls`` of ``nn.Dense``/``nn.DenseGeneral``; NNX has no fp8 layers,
so :class:`DelayedScalingDot` is its equivalent (flax's same
``fp8_scaled_dot_general`` on the values of :class:`Fp8Meta` variables), and
:func:`current_scaling_dot_general` serves both APIs. :func:`as_meta` makes
every use of one state entry combine by **max** (flax's ``fm32`` dtype), so a
layer applied twice, a scan that broadcasts the state, or several
micro-batches keep the largest amax instead of a sum.

Where fp8 reaches (``jamp.apply_policy``, where no override applies): linen
``nn.Dense``/``nn.DenseGeneral``, ``nn.Einsum`` (its call run by
:func:`linen_einsum`), any linen module declaring ``dot_general`` and
``dot_general_cls`` fields (:data:`LINEN_LAYERS`), NNX
``Linear``/``LinearGeneral``/``Einsum`` and NNX modules declaring
``dot_general_names`` (:func:`nnx_install`): in the jamp ViT (linen and NNX)
the MLP and the four attention projections (query, key, value, out; one
delayed state each). Stay bf16, and why: attention's score and value matmuls
(both operands are activations whose range changes per batch, around a
float32 softmax); layers named in ``Fp8Recipe.keep_bf16`` (the ``head``);
layers under an override; raw ``jnp.einsum``/``@`` on parameters in user code.

The train step (:func:`jamp.train_step` on a :class:`TrainState`) differentiates
the state with the parameters and keeps it out of the optimizer and the loss
scale: the new state is written back only when the loss scale applied the
step, combined by max over the micro-batches of an ``optax.MultiSteps``
window, max-reduced over the 'data' shards of
``jamp.parallel.step.value_and_grad`` (:func:`reduce_amax`), so every device
holds the same scales, and over the microbatches of a GPipe pipeline (whose
stages each hold their own layers' state; its bubble's filler is kept out,
:func:`only_on_real_data`). With loss scaling the E5M2 gradient amax is that
of the *scaled* gradient (the tensor being quantized), and its history follows
the loss scale's changes (:func:`follow_loss_scale`). In an NNX loop of your
own, :func:`nnx_commit` commits each applied step (no accumulation windows;
the trainer's NNX path uses :class:`TrainState` and has them).

Example:
  >>> import jax, jax.numpy as jnp, jamp
  >>> x = jnp.ones((4, 8), jnp.bfloat16); w = jnp.full((8, 2), 0.5, jnp.bfloat16)
  >>> y = jax.jit(jamp.fp8.current_scaling_dot_general, static_argnums=2)(
  ...     x, w, (((1,), (0,)), ((), ())))
  >>> y.dtype, float(y[0, 0])
  (dtype(bfloat16), 4.0)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import flax.errors
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.core.scope import in_filter, union_filters
from flax.linen import fp8_ops
from flax.training import train_state

E4M3 = jnp.float8_e4m3fn
"""Forward operands (activations and weights): 4 exponent bits, 3 mantissa bits, max 448."""

E5M2 = jnp.float8_e5m2
"""Gradients in the backward pass: 5 exponent bits, 2 mantissa bits, max 57344."""

COLLECTION = fp8_ops.OVERWRITE_WITH_GRADIENT
"""The linen variable collection of delayed-scaling state (``"_overwrite_with_gradient"``)."""

META_NAMES = ("input_scale", "kernel_scale", "output_grad_scale",
              "input_amax_history", "kernel_amax_history", "output_grad_amax_history")
"""The six entries of one fp8 matmul's delayed-scaling state (flax's names)."""

Scaling = Literal["delayed", "current"]


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """How a mode runs its fp8 matmuls.

    Attributes:
      scaling: ``"delayed"`` (scale from an amax history, state in
        :data:`COLLECTION`) or ``"current"`` (scale from the tensor itself).
      amax_history_length: steps of amax history kept per tensor (delayed only).
      keep_bf16: names of layers that keep their bf16 matmul (matched against the
        last component of the module path; absent names are fine). By default
        the classifier ``"head"``: like Transformer Engine and torchao recipes,
        the last layer stays in higher precision (its logits feed the loss
        directly and its matmul is too small to gain from fp8).

    Example:
      >>> import jamp
      >>> jamp.fp8.Fp8Recipe("delayed", amax_history_length=16).amax_history_length
      16
    """

    scaling: Scaling = "delayed"
    amax_history_length: int = 1024
    keep_bf16: tuple[str, ...] = ("head",)

    def __post_init__(self):
        if isinstance(self.keep_bf16, str) or not all(
                isinstance(n, str) for n in self.keep_bf16):
            raise ValueError(
                f"keep_bf16 must be a tuple of layer names, got {self.keep_bf16!r}; e.g. "
                "keep_bf16=('head',) or ().")
        object.__setattr__(self, "keep_bf16", tuple(self.keep_bf16))
        if self.scaling not in ("delayed", "current"):
            raise ValueError(
                f"fp8 scaling must be 'delayed' or 'current', got {self.scaling!r}.")
        n = self.amax_history_length
        if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
            raise ValueError(
                f"amax_history_length must be an int >= 1, got {n!r}; e.g. 1024 (Transformer "
                "Engine's default) or 16.")

    def applies_to(self, name: str | None) -> bool:
        """Whether a layer named ``name`` (last path component) runs fp8: not in ``keep_bf16``.

        Example:
          >>> import jamp
          >>> jamp.fp8.Fp8Recipe().applies_to("head"), jamp.fp8.Fp8Recipe().applies_to("out")
          (False, True)
        """
        return name not in self.keep_bf16


# --------------------------------------------------------------------------- current scaling


def _fp8_max(dtype: Any) -> jax.Array:
    return jnp.asarray(float(jnp.finfo(dtype).max), jnp.float32)


def tensor_scale(x: jax.Array, fp8_dtype: Any) -> jax.Array:
    """The float32 per-tensor scale ``amax(|x|) / fp8_max`` (1 where the amax is 0 or not finite).

    Example:
      >>> import jax.numpy as jnp, jamp
      >>> float(jamp.fp8.tensor_scale(jnp.array([-896.0, 3.0]), jamp.fp8.E4M3))
      2.0
    """
    amax = jnp.max(jnp.abs(x), initial=0).astype(jnp.float32)  # 0 (scale 1) when empty
    ok = (amax > 0) & jnp.isfinite(amax)
    return jnp.where(ok, amax / _fp8_max(fp8_dtype), jnp.float32(1.0))


def quantize(x: jax.Array, fp8_dtype: Any, scale: jax.Array) -> jax.Array:
    """``x / scale`` in float32, clipped to the fp8 range, cast to ``fp8_dtype``.

    Finite values saturate at the fp8 maximum; inf, -inf and NaN become NaN, so an
    overflow upstream still reaches the loss scale's finite check and the
    divergence guard instead of turning into a plausible large number.

    Example:
      >>> import jax.numpy as jnp, jamp
      >>> x = jnp.array([1000.0, 1.0, jnp.inf])
      >>> q = jamp.fp8.quantize(x, jamp.fp8.E4M3, jnp.float32(1.0))
      >>> q.dtype, q.astype(jnp.float32).tolist()
      (dtype(float8_e4m3fn), [448.0, 1.0, nan])
    """
    limit = _fp8_max(fp8_dtype)
    x = x.astype(jnp.float32) / scale
    x = jnp.where(jnp.isfinite(x), jnp.clip(x, -limit, limit), jnp.nan)
    return x.astype(fp8_dtype)


def _remaining(n: int, *removed: Sequence[int]) -> list[int]:
    gone = {i for r in removed for i in r}
    return [i for i in range(n) if i not in gone]


def _transpose_lhs(g: jax.Array, x_ndim: int, y: jax.Array, dimension_numbers: Any,
                   out_dtype: Any, swap_ans: bool = False) -> jax.Array:
    """The cotangent of ``x`` in ``dot_general(x, y)`` (as in ``jax.lax``'s transpose rule)."""
    (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
    x_kept = _remaining(x_ndim, x_contract, x_batch)
    y_kept = _remaining(y.ndim, y_contract, y_batch)
    nb = len(x_batch)
    if swap_ans:
        ans_batch = range(nb)
        ans_y = range(nb, nb + len(y_kept))
    else:
        ans_batch = range(nb)
        ans_y = range(nb + len(x_kept), nb + len(x_kept) + len(y_kept))
    dims = ((tuple(ans_y), tuple(y_kept)), (tuple(ans_batch), tuple(y_batch)))
    x_contract_sorted_by_y = list(np.take(x_contract, np.argsort(y_contract)))
    out_axes = np.argsort(list(x_batch) + x_kept + x_contract_sorted_by_y)
    dot = jax.lax.dot_general(g, y, dims, preferred_element_type=out_dtype)
    return jax.lax.transpose(dot, tuple(int(a) for a in out_axes))


def _transpose_rhs(g: jax.Array, x: jax.Array, y_ndim: int, dimension_numbers: Any,
                   out_dtype: Any) -> jax.Array:
    (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
    swapped = ((y_contract, x_contract), (y_batch, x_batch))
    return _transpose_lhs(g, y_ndim, x, swapped, out_dtype, swap_ans=True)


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
    out = jnp.promote_types(g.dtype, jnp.float32)
    grad_lhs = _transpose_lhs(q_g, q_lhs.ndim, q_rhs, dimension_numbers, out)
    grad_rhs = _transpose_rhs(q_g, q_lhs, q_rhs.ndim, dimension_numbers, out)
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


# --------------------------------------------------------------------------- delayed scaling


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


def _nan_where_not_finite(x: jax.Array) -> jax.Array:
    return jnp.where(jnp.isfinite(x), x, jnp.asarray(jnp.nan, x.dtype))


@jax.custom_vjp
def _non_finite_as_nan(x: jax.Array) -> jax.Array:
    """Identity whose value and cotangent have inf/-inf replaced by NaN.

    flax's quantization saturates an inf at the fp8 maximum, which would hide an
    overflow from the loss scale; a NaN stays NaN through the fp8 cast.
    """
    return _nan_where_not_finite(x)


_non_finite_as_nan.defvjp(lambda x: (_nan_where_not_finite(x), None),
                          lambda _, g: (_nan_where_not_finite(g),))


def linen_dot_general_cls(recipe: Fp8Recipe) -> Any:
    """The linen ``dot_general_cls`` of a delayed recipe: flax's ``Fp8DirectDotGeneralOp``.

    (A subclass of it with the recipe's history length and a clear error when
    the state collection is missing: an ``nn.scan`` without it in
    ``variable_axes``, or ``apply`` without ``variables[COLLECTION]``.)

    Example:
      >>> import jamp
      >>> jamp.fp8.linen_dot_general_cls(jamp.fp8.Fp8Recipe()).__name__
      'Fp8DirectDotGeneralOp'
    """
    return _linen_op(recipe.amax_history_length)


def _linen_meta(op: nn.Module) -> dict[str, jax.Array]:
    """The six state values of a bound ``Fp8DirectDotGeneralOp`` (runs its ``setup``)."""
    return {n: getattr(op, n).value for n in META_NAMES}


@functools.cache
def _linen_op(length: int) -> type:
    def setup(self):
        try:
            fp8_ops.Fp8DirectDotGeneralOp.setup(self)
        except flax.errors.ScopeCollectionNotFound:
            raise ValueError(
                f"fp8 delayed scaling (mode 'fp8') at {'/'.join(self.scope.path)}: the "
                f"{COLLECTION!r} variable collection is missing. Under nn.scan add it to "
                f"variable_axes (e.g. {{'params': 0, jamp.fp8.COLLECTION: 0}}: one state per "
                "layer); in apply pass variables[jamp.fp8.COLLECTION] from init (the train "
                "step does so for a jamp.fp8.TrainState); or use mode 'fp8_current', which "
                "keeps no state. (An nn.RNN gets the collection in its variable_broadcast "
                "from jamp.apply_policy: one state shared by the time steps.)") from None

    def call(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
        del precision, preferred_element_type  # fp8 has one precision; output: rhs's dtype
        return delayed_scaling_dot_general(lhs, rhs, dimension_numbers, _linen_meta(self))

    # A subclass (not a partial): flax names the submodule after its class.
    return type("Fp8DirectDotGeneralOp", (fp8_ops.Fp8DirectDotGeneralOp,),
                {"__annotations__": {"amax_history_length": int},
                 "amax_history_length": length, "setup": setup, "__call__": call,
                 "__module__": __name__})


class Fp8Meta(nnx.Variable):
    """An NNX variable of delayed-scaling state (a scale or an amax history).

    Differentiate it (``nnx.DiffState(0, jamp.fp8.PARAMS_AND_META)``): its
    gradient is its new value, written back by :func:`nnx_commit`.
    """


PARAMS_AND_META = nnx.Any(nnx.Param, Fp8Meta)
"""The NNX filter to differentiate for delayed scaling: parameters and :class:`Fp8Meta`."""


class DelayedScalingDot(nnx.Module):
    """NNX delayed-scaling fp8 matmul: a ``dot_general`` (or ``einsum`` op) holding its state.

    Install it as ``linear.dot_general`` of ``nnx.Linear``/``nnx.LinearGeneral``
    or ``einsum.einsum_op`` of ``nnx.Einsum`` (``jamp.apply_policy`` does it in
    mode ``"fp8"``); the six :class:`Fp8Meta` variables hold flax's state.

    Example:
      >>> import jax.numpy as jnp, jamp
      >>> from flax import nnx
      >>> dot = jamp.fp8.DelayedScalingDot(amax_history_length=8)
      >>> dot.input_scale.shape, dot.kernel_amax_history.shape
      ((1,), (8,))
    """

    def __init__(self, amax_history_length: int = 1024):
        for name, value in init_meta(amax_history_length).items():
            setattr(self, name, Fp8Meta(value))

    def meta(self) -> dict[str, jax.Array]:
        """The six state values, read (flax's names).

        Example:
          >>> import jamp
          >>> sorted(jamp.fp8.DelayedScalingDot(4).meta())[0]
          'input_amax_history'
        """
        return {n: getattr(self, n)[...] for n in META_NAMES}

    def __call__(self, *args: Any, **kwargs: Any) -> jax.Array:
        if args and isinstance(args[0], str):  # einsum_op(subscripts, lhs, rhs, ...)
            subscripts, lhs, rhs = args
            dot = lambda a, b, dims, precision=None, preferred_element_type=None: (
                delayed_scaling_dot_general(a, b, dims, self.meta()))
            return jnp.einsum(subscripts, lhs.astype(rhs.dtype), rhs, _dot_general=dot)
        lhs, rhs, dims = args
        return delayed_scaling_dot_general(lhs, rhs, dims, self.meta())


LINEN_LAYERS: tuple[type, ...] = (nn.Dense, nn.DenseGeneral, nn.Einsum)
"""Linen layers whose matmul the fp8 modes replace, by way of the policy interceptor.

Besides these, any linen module declaring both ``dot_general`` and
``dot_general_cls`` dataclass fields (flax's injection convention, as
``nn.Dense``/``nn.DenseGeneral`` do: ``dot_general_cls()`` is instantiated once
per matmul, else ``dot_general`` is called, else ``lax.dot_general``), such as
the ViT's :class:`jamp.models.vit.SelfAttention` (its four projections). Flax's
``nn.Einsum`` has no such hook: the interceptor runs its call through
:func:`linen_einsum` instead.
"""

NNX_LAYERS: tuple[type, ...] = (nnx.Linear, nnx.LinearGeneral, nnx.Einsum)
"""NNX layers whose matmul the fp8 modes replace (and modules with ``dot_general_names``)."""


def _declares_dot_general(module: nn.Module) -> bool:
    fields = getattr(type(module), "__dataclass_fields__", {})
    return "dot_general" in fields and "dot_general_cls" in fields


def linen_install(module: nn.Module, recipe: Fp8Recipe) -> bool:
    """Gives a bound linen layer its fp8 matmul (called by the policy interceptor).

    Returns whether ``module`` runs its matmuls in fp8: it is an ``nn.Einsum``
    or declares both ``dot_general`` and ``dot_general_cls`` fields (``Dense``,
    ``DenseGeneral``, the ViT's ``SelfAttention``: see :data:`LINEN_LAYERS`),
    and its name is not in ``recipe.keep_bf16``. Delayed scaling sets
    ``dot_general_cls`` to flax's ``Fp8DirectDotGeneralOp`` (one state in
    :data:`COLLECTION` per matmul, under the layer); current scaling sets
    ``dot_general``. An ``nn.Einsum`` has neither field: nothing is set, and
    the interceptor calls :func:`linen_einsum` in place of its ``__call__``.

    Example:
      >>> import flax.linen as nn, jamp
      >>> install = lambda module: jamp.fp8.linen_install(module, jamp.fp8.Fp8Recipe())
      >>> install(nn.LayerNorm()), install(nn.Dense(2)), install(nn.Einsum((2, 3), "bi,io->bo"))
      (False, True, True)
      >>> install(nn.Dense(2, name="head"))  # keep_bf16
      False
    """
    if module.name in recipe.keep_bf16:
        return False
    if isinstance(module, nn.Einsum) and not _declares_dot_general(module):
        return True
    if not _declares_dot_general(module):
        return False
    if recipe.scaling == "delayed":
        name, value = "dot_general_cls", linen_dot_general_cls(recipe)
    else:
        name, value = "dot_general", current_scaling_dot_general
    if getattr(module, name) is not value:
        object.__setattr__(module, name, value)  # bound modules are per-scope clones
    return True


def linen_share_over_steps(module: nn.Module, recipe: Fp8Recipe) -> bool:
    """Makes a bound ``nn.RNN`` share its cell's delayed-scaling state over the time steps.

    ``nn.RNN`` scans its cell with ``nn.scan``, which knows only the collections it
    is told about: the cell's fp8 state (:data:`COLLECTION`) is added to its
    ``variable_broadcast``, so every step reads the same state and its new value is
    the max over the steps (the ``fm32`` combination), as for a layer applied
    several times. The policy interceptor calls this on every module in mode
    ``"fp8"``; returns whether it changed ``module``.

    Example:
      >>> import flax.linen as nn, jamp
      >>> jamp.fp8.linen_share_over_steps(nn.RNN(nn.LSTMCell(4)), jamp.fp8.Fp8Recipe())
      True
    """
    if recipe.scaling != "delayed" or not isinstance(module, nn.RNN):
        return False
    broadcast = module.variable_broadcast
    if in_filter(broadcast, COLLECTION) or any(
            in_filter(f, COLLECTION) for f in module.variable_axes):
        return False  # already shared, or stacked per step on purpose
    shared = union_filters(broadcast, COLLECTION)
    object.__setattr__(module, "variable_broadcast", shared)  # bound modules are clones
    return True


def linen_einsum(module: nn.Einsum, recipe: Fp8Recipe, inputs: jax.Array,
                 einsum_str: str | None = None) -> jax.Array:
    """``nn.Einsum.__call__`` with its contraction an fp8 matmul (the policy interceptor's).

    Flax's ``nn.Einsum`` calls ``jnp.einsum`` itself, with no ``dot_general``
    hook, so in the fp8 modes the policy interceptor runs this in place of its
    ``__call__``: the same steps (its ``kernel`` and ``bias`` params through
    ``module.param``, the bias shape from the Einsum's own ``_get_bias_shape``,
    its ``promote_dtype``, ``precision`` and ``preferred_element_type``), the
    same parameter tree, with ``jnp.einsum(..., _dot_general=...)`` doing the
    contraction in fp8. Delayed scaling keeps its state in an
    ``Fp8DirectDotGeneralOp`` child of the Einsum (as a ``Dense``'s: one state
    per Einsum in :data:`COLLECTION`), read before ``jnp.einsum`` (which
    traces its contraction under its own ``jit``, where a flax module must not
    create variables). Where ``jnp.einsum`` puts the kernel first (the output
    lists the kernel's free axes first) the state's ``input_*`` and
    ``kernel_*`` entries trade places; each still scales its own operand.

    Args:
      module: a bound ``nn.Einsum``, inside its ``__call__`` (the interceptor's
        ``next_fun`` context).
      recipe: the fp8 recipe.
      inputs, einsum_str: the arguments of ``nn.Einsum.__call__``.

    Returns:
      The Einsum's output.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn, jamp
      >>> model = jamp.apply_policy(nn.Einsum((3, 2, 4), "bi,ihd->bhd"), "fp8")
      >>> v = jax.jit(model.init)(jax.random.key(0), jnp.ones((5, 3)))
      >>> sorted(v["params"]), sorted(v[jamp.fp8.COLLECTION])
      (['bias', 'kernel'], ['Fp8DirectDotGeneralOp_0'])
    """
    if not isinstance(module, nn.Einsum):
        raise TypeError(f"linen_einsum runs an nn.Einsum's call, got {type(module).__name__}.")
    einsum_str = nn.merge_param("einsum_str", module.einsum_str, einsum_str).replace(" ", "")
    if "->" not in einsum_str:
        raise ValueError('`einsum_str` equation must be explicit and include "->".')
    if einsum_str.count(",") != 1:
        raise ValueError(
            "`einsum_str` equation must have exactly two operands and therefore, exactly one "
            f"comma character, instead of {einsum_str.count(',')}")
    kernel = module.param("kernel", module.kernel_init, module.shape, module.param_dtype)
    bias = None
    if module.use_bias:
        bias_shape, broadcast_shape = module._get_bias_shape(einsum_str, inputs, kernel)
        bias = module.param("bias", module.bias_init, bias_shape, module.param_dtype)
    inputs, kernel, bias = module.promote_dtype(inputs, kernel, bias, dtype=module.dtype)
    if recipe.scaling == "delayed":
        meta = _linen_meta(linen_dot_general_cls(recipe)())  # a child of ``module``
        dot = functools.partial(_einsum_dot, meta=meta)
    else:
        dot = current_scaling_dot_general
    y = jnp.einsum(einsum_str, inputs, kernel, precision=module.precision,
                   preferred_element_type=module.preferred_element_type, _dot_general=dot)
    if bias is not None:
        y += jnp.reshape(bias, broadcast_shape)
    return y


def _einsum_dot(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, precision: Any = None,
                preferred_element_type: Any = None, *, meta: dict[str, jax.Array]) -> jax.Array:
    """``jnp.einsum``'s ``_dot_general`` for delayed scaling on read state values."""
    del precision
    y = delayed_scaling_dot_general(lhs.astype(rhs.dtype), rhs, dimension_numbers, meta)
    return y if preferred_element_type is None else y.astype(preferred_element_type)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _stacked_shape(layer: nnx.Module) -> tuple[int, ...]:
    """The leading axes ``nnx.vmap`` stacked ``layer`` along (``()`` for a single layer).

    A layer created under ``nnx.vmap`` (e.g. the scanned blocks of a ViT) has a
    kernel with extra leading axes; its delayed-scaling state gets the same ones,
    so ``nnx.scan`` gives each layer its own state (as linen's ``nn.scan`` with
    the collection in ``variable_axes``).
    """
    if isinstance(layer, nnx.Einsum):
        own = len(layer.kernel_shape)
    elif isinstance(layer, nnx.LinearGeneral):
        own = len(layer.batch_axis) + len(layer.in_features) + len(layer.out_features)
    else:
        own = 2
    shape = tuple(layer.kernel.shape)
    return shape[:len(shape) - own]


def _delayed_dot(recipe: Fp8Recipe, stacked: tuple[int, ...]) -> DelayedScalingDot:
    """A :class:`DelayedScalingDot` whose state has the leading axes ``stacked``."""
    dot = DelayedScalingDot(recipe.amax_history_length)
    for meta in jax.tree_util.tree_leaves(nnx.state(dot, Fp8Meta), is_leaf=_is_variable):
        meta.set_value(jnp.broadcast_to(meta.get_value(), stacked + meta.shape))
    return dot


def _install_declared(layer: nnx.Module, names: tuple[str, ...], recipe: Fp8Recipe) -> None:
    """fp8 for a module declaring ``dot_general_names`` (see :func:`nnx_install`)."""
    if not names or not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise TypeError(
            f"{type(layer).__name__}.dot_general_names must be a tuple of distinct matmul "
            f"names (e.g. ('query', 'key', 'value', 'out')), got {names!r}.")
    if recipe.scaling == "current":
        layer.dot_general = current_scaling_dot_general
        return
    stacked = getattr(layer, "stacked_shape", lambda: ())()
    layer.dot_general = nnx.data(nnx.Dict({n: _delayed_dot(recipe, tuple(stacked))
                                            for n in names}))


def nnx_install(layer: nnx.Module, recipe: Fp8Recipe, name: Any = None) -> bool:
    """Gives an ``nnx.Linear``/``LinearGeneral``/``Einsum`` an fp8 matmul, in place.

    Returns whether ``layer`` is such a layer or declares ``dot_general_names``
    (and ``name``, the last component of its path, is not in
    ``recipe.keep_bf16``). Delayed scaling installs a
    :class:`DelayedScalingDot` (its :class:`Fp8Meta` state becomes part of the
    layer's state; a layer stacked by ``nnx.vmap`` gets one state per layer, the
    stacked axes leading); current scaling installs :func:`current_scaling_dot_general`.

    Other NNX modules join by declaring their matmuls: a class attribute
    ``dot_general_names`` (e.g. ``("query", "key", "value", "out")``) and an
    attribute ``dot_general`` that each of those matmuls calls (``None``:
    ``lax.dot_general``), or, when ``dot_general`` is a mapping, calls its
    own entry ``dot_general[name]``. Current scaling sets ``dot_general`` to
    :func:`current_scaling_dot_general`; delayed scaling to an ``nnx.Dict``
    of one :class:`DelayedScalingDot` per name. A module that ``nnx.vmap``
    may stack also defines ``stacked_shape()`` (its leading stacked axes) so
    that each stacked layer gets its own state. The NNX ViT's
    :class:`jamp.models.vit_nnx.SelfAttention` is one.

    Example:
      >>> import jax.numpy as jnp, jamp
      >>> from flax import nnx
      >>> layer = nnx.Linear(3, 2, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
      >>> jamp.fp8.nnx_install(layer, jamp.fp8.Fp8Recipe("current"))
      True
      >>> layer.dot_general.__name__
      'current_scaling_dot_general'
    """
    names = getattr(type(layer), "dot_general_names", None)
    if not (isinstance(layer, NNX_LAYERS) or names) or (name is not None and
                                                        str(name) in recipe.keep_bf16):
        return False
    if not isinstance(layer, NNX_LAYERS):  # a module declaring its matmuls (dot_general_names)
        _install_declared(layer, tuple(names), recipe)
        return True
    einsum = isinstance(layer, nnx.Einsum)
    name = "einsum_op" if einsum else "dot_general"
    if recipe.scaling == "delayed":
        setattr(layer, name, nnx.data(_delayed_dot(recipe, _stacked_shape(layer))))
    else:
        setattr(layer, name, current_scaling_einsum if einsum else current_scaling_dot_general)
    return True


# --------------------------------------------------------------------------- state handling


def _is_meta_node(x: Any) -> bool:
    return isinstance(x, dict) and set(META_NAMES) <= set(x)


def as_meta(tree: Any) -> Any:
    """Converts float32 state leaves to flax's ``fm32`` dtype, whose gradients add by max.

    Call it on the state *before* it enters the model, inside the
    differentiated function: every use of one entry (a layer applied twice, a
    scan over micro-batches, a broadcast across scanned layers) then
    contributes the max of its amaxes, not their sum. Use it under ``jax.jit``
    (flax's ``fm32`` arrays do not run eagerly).

    Example:
      >>> import jax, jax.numpy as jnp, jamp
      >>> x, w = jnp.ones((2, 3), jnp.bfloat16), jnp.ones((3, 3), jnp.bfloat16)
      >>> dot = lambda a, m: jamp.fp8.delayed_scaling_dot_general(a, w, (((1,), (0,)), ((), ())), m)
      >>> twice = lambda m: dot(2 * dot(x, m), m).astype(jnp.float32).sum()
      >>> new = jax.jit(jax.grad(lambda m: twice(jamp.fp8.as_meta(m))))(jamp.fp8.init_meta(2))
      >>> new["input_amax_history"].tolist(), new["input_scale"].tolist()  # sums: 7 and 2
      ([6.0, 0.0], [1.0])
    """
    return jax.tree_util.tree_map(
        lambda x: jax.lax.convert_element_type(x, fp8_ops.fm32), tree)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _max_over(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    return x


def _max_over_fwd(x, axes):
    return x, None


def _max_over_bwd(axes, _, ct):
    # The caller's transpose sums cotangents over ``axes`` (the psum of a pcast): the max on
    # one shard and zeros elsewhere sum to the max, exactly.
    first = functools.reduce(jnp.logical_and, [jax.lax.axis_index(a) == 0 for a in axes])
    return (jnp.where(first, jax.lax.pmax(ct, axes), jnp.zeros_like(ct)),)


_max_over.defvjp(_max_over_fwd, _max_over_bwd)


def reduce_amax(tree: Any, split_axes: Sequence[str] = ("pipe",)) -> Any:
    """Identity whose gradient (the new fp8 state) is max-reduced over the mesh axes it varies on.

    Inside ``jax.shard_map`` (``jamp.parallel.step.value_and_grad``) each 'data'
    shard sees its own examples' amax and the gradients of the state are
    summed over 'data'; through this function that sum is the max, so every
    device gets the same history and scales as one device on the whole batch.
    Under plain ``jax.jit`` (nothing varies) it does nothing: the amax of a
    sharded array is already global.

    Args:
      tree: the fp8 state (float32 leaves), inside the differentiated function.
      split_axes: manual mesh axes a leaf varies on because it is *split* over
        them, not replicated: each shard holds different entries, which must not
        be combined. By default jamp's pipeline axis ``'pipe'``, over which the
        stacked per-layer state is split into stages.

    Example:
      >>> import jax, jax.numpy as jnp, jamp
      >>> float(jax.grad(lambda m: 3 * jamp.fp8.reduce_amax(m))(jnp.float32(1.0)))
      3.0
    """
    def one(x):
        aval = jax.typeof(x)
        manual = getattr(aval, "manual_axis_type", None)  # JAX >= 0.9; .vma before
        varying = manual.varying if manual is not None else getattr(aval, "vma", ())
        axes = tuple(sorted(set(varying) - set(split_axes)))
        return _max_over(x, axes) if axes else x

    return jax.tree_util.tree_map(one, tree)


@jax.custom_vjp
def _gradient_only_when(keep: jax.Array, x: jax.Array) -> jax.Array:
    return x


def _gradient_only_when_fwd(keep, x):
    return x, keep


def _gradient_only_when_bwd(keep, ct):
    # An fm32 cotangent is converted for the select and back; 0 is the identity of max.
    f32 = jax.lax.convert_element_type(ct, jnp.float32)
    gated = jax.lax.convert_element_type(jnp.where(keep, f32, 0.0), ct.dtype)
    return None, gated


_gradient_only_when.defvjp(_gradient_only_when_fwd, _gradient_only_when_bwd)


def only_on_real_data(tree: Any, real: jax.Array) -> Any:
    """Identity on values; the state's gradient (its new value) is dropped where ``real`` is False.

    A pipeline's bubble ticks run the layers on filler (zeros) whose outputs are
    discarded; a parameter's gradient from them is exactly zero, but the fp8
    state's "gradient" is its new amax history, which would take the filler's
    amax. :class:`jamp.parallel.pipeline.GPipe` passes the stage's variables
    through this on every tick, so only real microbatches enter the max.
    Leaves that are not fp8 state (not flax's ``fm32``) pass untouched.

    Example:
      >>> import jax, jax.numpy as jnp, jamp
      >>> x, w = jnp.ones((2, 3), jnp.bfloat16), jnp.ones((3, 1), jnp.bfloat16)
      >>> def loss(m, real):
      ...     m = jamp.fp8.only_on_real_data(jamp.fp8.as_meta(m), real)
      ...     y = jamp.fp8.delayed_scaling_dot_general(x, w, (((1,), (0,)), ((), ())), m)
      ...     return y.astype(jnp.float32).sum()
      >>> new_meta = jax.jit(jax.grad(loss))
      >>> [new_meta(jamp.fp8.init_meta(2), real)["input_amax_history"].tolist()
      ...  for real in (True, False)]
      [[1.0, 0.0], [0.0, 0.0]]
    """
    real = jnp.asarray(real, bool)
    return jax.tree_util.tree_map(
        lambda x: _gradient_only_when(real, x) if x.dtype == fp8_ops.fm32 else x, tree)


def _keep_unused(old: Any, new: Any) -> Any:
    """``new`` with the entries of matmuls the loss never reached (zero scale) kept ``old``."""
    if _is_meta_node(new):
        unused = new["input_scale"] == 0
        return {k: jnp.where(unused, old[k], v) for k, v in new.items()}
    if isinstance(new, dict):
        return {k: _keep_unused(old[k], v) for k, v in new.items()}
    return new


def _multisteps(opt_state: Any) -> Any:
    found = optax.tree_utils.tree_get_all_with_path(opt_state, "MultiStepsState")
    return found[0][1] if found else None


class TrainState(train_state.TrainState):
    """``flax.training.train_state.TrainState`` with the delayed-scaling fp8 state.

    Attributes:
      fp8: the model's :data:`COLLECTION` variables (what ``model.init`` returned),
        read by every forward pass; ``{}`` when the model has none.
      fp8_pending: the state being built up over the micro-batches of one
        ``optax.MultiSteps`` window (amax combined by max); becomes ``fp8`` when
        the window's update is applied.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jamp
      >>> s = jamp.fp8.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)},
      ...                                tx=optax.sgd(0.1), fp8={"m": jamp.fp8.init_meta(4)})
      >>> s.fp8_pending["m"]["input_scale"].tolist()
      [1.0]
    """

    fp8: Any = None
    fp8_pending: Any = None

    @classmethod
    def create(cls, *, apply_fn: Any, params: Any, tx: optax.GradientTransformation,
               fp8: Any = None, **kwargs: Any) -> TrainState:
        """``TrainState.create`` with the fp8 collection (``variables.get(COLLECTION, {})``).

        Example: see the class docstring.
        """
        fp8 = {} if fp8 is None else fp8
        return super().create(apply_fn=apply_fn, params=params, tx=tx, fp8=fp8,
                              fp8_pending=fp8, **kwargs)


def commit(state: TrainState, new_meta: Any, opt_state_before: Any,
           applied: jax.Array) -> TrainState:
    """Writes the new delayed-scaling state back, only for an applied step.

    ``new_meta`` is the gradient of ``state.fp8`` (the state after this batch).
    A step the loss scale skipped (``applied`` False) changes nothing. Without
    ``optax.MultiSteps`` an applied step's state becomes ``fp8``. With it, the
    window's micro-batches all read the window's starting ``fp8`` and their
    new states are combined elementwise by max in ``fp8_pending`` (the same
    rolled history with the window's largest amax in front, the same scales);
    ``fp8`` takes it when the window's update is applied.

    Args:
      state: the train state after ``apply_gradients``.
      new_meta: the gradient of ``state.fp8``.
      opt_state_before: the optimizer state before this step's update.
      applied: whether the optimizer took this (micro-)batch (the loss scale's
        ``last_finite``).

    Returns:
      ``state`` with ``fp8`` and ``fp8_pending`` updated.

    Example:
      >>> import jax.numpy as jnp, optax, jamp
      >>> s = jamp.fp8.TrainState.create(apply_fn=None, params={}, tx=optax.sgd(0.1),
      ...                                fp8={"m": jamp.fp8.init_meta(2)})
      >>> new = {"m": dict(jamp.fp8.init_meta(2), input_amax_history=jnp.array([5.0, 0.0]))}
      >>> jamp.fp8.commit(s, new, s.opt_state, jnp.bool_(False)).fp8["m"]["input_amax_history"]
      Array([0., 0.], dtype=float32)
    """
    new_meta = _keep_unused(state.fp8, new_meta)
    before, after = _multisteps(opt_state_before), _multisteps(state.opt_state)
    if before is None:
        first = boundary = jnp.bool_(True)
    else:
        first = before.mini_step == 0
        boundary = after.mini_step == 0
    where = lambda c, a, b: jax.tree_util.tree_map(lambda x, y: jnp.where(c, x, y), a, b)
    combined = where(first, new_meta, jax.tree_util.tree_map(jnp.maximum, state.fp8_pending,
                                                              new_meta))
    pending = where(applied, combined, state.fp8_pending)
    fp8 = where(applied & boundary, pending, state.fp8)
    return state.replace(fp8=fp8, fp8_pending=pending)


def follow_loss_scale(state: TrainState, ratio: jax.Array) -> TrainState:
    """Multiplies the gradient amax histories by ``ratio``, the loss scale's change this step.

    The E5M2 gradient being quantized is the *loss-scaled* gradient, so its amax
    history is in units of the scale it was recorded at. When the loss scale
    grows (x2 after ``growth_interval`` clean steps) the next gradients are twice
    the history's max, and delayed scaling would saturate their largest entries
    at the E5M2 maximum; after a back-off it would waste a bit of range. The
    train step calls this after every update (skipped or applied) with
    ``new_scale / old_scale``, a power of two for the dynamic loss scale, so the
    history stays exact. ``fp8`` and ``fp8_pending`` both follow.

    Example:
      >>> import jax.numpy as jnp, optax, jamp
      >>> meta = dict(jamp.fp8.init_meta(2), output_grad_amax_history=jnp.array([3.0, 1.0]))
      >>> s = jamp.fp8.TrainState.create(apply_fn=None, params={}, tx=optax.sgd(0.1),
      ...                                fp8={"m": meta})
      >>> jamp.fp8.follow_loss_scale(s, 2.0).fp8["m"]["output_grad_amax_history"].tolist()
      [6.0, 2.0]
    """
    def rescale(tree):
        if _is_meta_node(tree):
            hist = tree["output_grad_amax_history"]
            return dict(tree, output_grad_amax_history=hist * jnp.asarray(ratio, hist.dtype))
        if isinstance(tree, dict):
            return {k: rescale(v) for k, v in tree.items()}
        return tree

    return state.replace(fp8=rescale(state.fp8), fp8_pending=rescale(state.fp8_pending))


@contextlib.contextmanager
def nnx_max_combined(model: nnx.Module) -> Iterator[nnx.Module]:
    """Within it, ``model``'s :class:`Fp8Meta` values are flax ``fm32``: every use combines by max.

    :func:`as_meta` for an NNX model, in place and undone on exit (the model's
    state stays float32 outside). Use it inside the function you differentiate,
    around the forward pass, before any ``nnx.scan``/``nnx.RNN`` captures the
    state.

    Example:
      >>> import jax, jax.numpy as jnp, jamp
      >>> from flax import nnx
      >>> layer = nnx.Linear(3, 3, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
      >>> jamp.fp8.nnx_install(layer, jamp.fp8.Fp8Recipe("delayed", amax_history_length=2))
      True
      >>> def loss(m):  # two uses of one matmul: inputs of amax 1 and 3
      ...     with jamp.fp8.nnx_max_combined(m):
      ...         return (m(jnp.ones((1, 3))) + m(jnp.full((1, 3), 3.0))).astype(jnp.float32).sum()
      >>> grads = nnx.jit(nnx.grad(loss, argnums=nnx.DiffState(0, jamp.fp8.PARAMS_AND_META)))(layer)
      >>> _ = jamp.fp8.nnx_commit(layer, grads)
      >>> float(layer.dot_general.input_amax_history[0])  # the max, not the sum (4.0)
      3.0
    """
    metas = [v for _, v in nnx.iter_graph(model) if isinstance(v, Fp8Meta)]
    for meta in metas:
        if meta.get_value().dtype != fp8_ops.fm32:
            meta.set_value(jax.lax.convert_element_type(meta.get_value(), fp8_ops.fm32))
    try:
        yield model
    finally:
        for meta in metas:
            meta.set_value(jax.lax.convert_element_type(meta.get_value(), jnp.float32))


def nnx_commit(model: nnx.Module, grads: nnx.State, applied: jax.Array | bool = True
               ) -> nnx.State:
    """Writes the :class:`Fp8Meta` gradients into ``model`` when ``applied``; returns the Params'.

    For an NNX step differentiating ``PARAMS_AND_META``: give the returned
    parameter gradients to the optimizer, and pass ``applied`` (the loss
    scale's ``last_finite`` after the update) to keep a skipped step's state.

    Run the model inside :func:`nnx_max_combined` in the differentiated
    function: a matmul used several times in one step (an ``nnx.RNN`` cell
    scanned over the time steps, a layer called twice) then keeps the max of
    its uses' amaxes. Without it the float32 state's gradients add up
    (measured: an ``nnx.RNN`` of 5 steps recorded 13.3 where the input's amax
    is 3.2).

    Example:
      >>> import jax.numpy as jnp, jamp
      >>> from flax import nnx
      >>> model = nnx.Linear(4, 2, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
      >>> jamp.fp8.nnx_install(model, jamp.fp8.Fp8Recipe("delayed", amax_history_length=4))
      True
      >>> loss = lambda m: m(jnp.ones((3, 4))).astype(jnp.float32).sum()
      >>> grads = nnx.jit(nnx.grad(loss, argnums=nnx.DiffState(0, jamp.fp8.PARAMS_AND_META)))(model)
      >>> param_grads = jamp.fp8.nnx_commit(model, grads)
      >>> float(model.dot_general.input_amax_history[0])
      1.0
    """
    meta_grads = nnx.filter_state(grads, Fp8Meta)
    old = nnx.state(model, Fp8Meta)
    new = jax.tree_util.tree_map(lambda o, n: jnp.where(applied, n, o), old, meta_grads)
    nnx.update(model, new)
    return nnx.filter_state(grads, nnx.Param)
