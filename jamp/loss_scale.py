"""Loss scaling as optax gradient transformations.

float16 gradients underflow: small values flush to zero. Loss scaling multiplies
the loss by a factor ``S`` before differentiation and divides the gradients by
``S`` before the optimizer sees them; when ``S`` is too large they overflow to
inf/NaN, and the step must be skipped and ``S`` lowered. Three transformations
share one state type, so every precision mode maps to exactly one of them:

* :func:`DynamicLossScale`: backs off on overflow, grows after
  ``growth_interval`` finite steps (``torch.amp.GradScaler`` with
  ``hysteresis=1``, Megatron-LM's scaler with ``hysteresis > 1``).
* :func:`StaticLossScale`: a fixed scale; still unscales, checks and skips.
* :func:`NoOpLossScale`: scale 1, no check, a pass-through (bf16, fp32).

:class:`LossScaleConfig` holds a mode's choice of the three and its settings.

Wrap the whole optimizer, as ``optax.MultiSteps`` does::

  tx = DynamicLossScale(optax.adamw(3e-4))
  grads = jax.grad(lambda p: scale_loss(loss_fn(p, batch), opt_state))(params)
  updates, opt_state = tx.update(grads, opt_state, params)  # unscale, check, skip

A skipped step is exact: zero updates and the inner state bit-identical (Adam's
moments and count do not move). Put the scale *outside* ``optax.MultiSteps`` for
gradient accumulation, so each micro-batch is checked before it is accumulated.
The overflow check is exact on any mesh: under ``jax.jit`` over global arrays
it is one global reduction; inside ``jax.shard_map`` pass the mesh axes as
``axis_names`` and the per-shard flag is ``psum``-med. Everything that changes
lives in :class:`LossScaleState`, so it jits, checkpoints and resumes exactly.
Its cost is measured by ``python -m benchmarks.scaler_comparison``
(``benchmarks/results/loss_scale_*``).

Several losses, one scale each (apex's ``amp.initialize(num_losses=k)`` and
``amp.scale_loss(loss, optimizer, loss_id=i)``): with ``num_losses=k`` the
state holds ``[k]`` scales and trackers, ``scale_loss(loss_i, state, loss_id=i)``
scales loss ``i`` by its own scale, and ``update`` takes a tuple of ``k``
gradient trees, one per loss::

  tx = DynamicLossScale(optax.adamw(3e-4), num_losses=2)
  g0 = jax.grad(lambda p: scale_loss(loss0(p), opt_state, loss_id=0))(params)
  g1 = jax.grad(lambda p: scale_loss(loss1(p), opt_state, loss_id=1))(params)
  updates, opt_state = tx.update((g0, g1), opt_state, params)

Each tree is unscaled by its own scale and checked on its own; the optimizer
gets their float32 sum, and the step is skipped if any loss overflowed. Each
scale then moves by its own loss's flag alone (apex's rule: a finite loss counts
a growth step even when another loss overflowed and the step was skipped).

``verbose=True`` prints one line to stderr when a dynamic scale changes
(Colossal-AI naive AMP's ``verbose``, apex's ``verbosity``), at most one a second.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

_SCALE_LO, _SCALE_HI = 2.0**-126, 2.0**126


class LossScaleState(NamedTuple):
    """State of :func:`DynamicLossScale`, :func:`StaticLossScale`, :func:`NoOpLossScale`.

    With ``num_losses=k > 1`` the first three fields have shape ``[k]`` (one
    entry per loss); with one loss they are scalars. The others are always
    scalars: they describe the whole step.

    Attributes:
      scale: float32 scalar (or ``[k]``), the current loss scale.
      growth_tracker: int32, consecutive finite steps since the last growth,
        back-off or overflow (torch's ``_growth_tracker``).
      hysteresis_tracker: int32, overflows still tolerated before backing off
        (Megatron's ``_hysteresis_tracker``); reset to ``hysteresis`` on growth.
      steps_skipped: int32, total number of skipped (non-finite) steps.
      consecutive_overflows: int32, non-finite steps in a row up to now.
      last_finite: bool, whether the last step's gradients were all finite.
      min_scale_overflows: int32, consecutive non-finite steps taken while the
        scale was already at ``min_scale`` (backing off could not help; with
        several losses: every overflowing loss's scale was at ``min_scale``).
      diverged: bool, ``min_scale_overflows >= divergence_steps``.
      inner_state: state of the wrapped transformation (``optax.EmptyState()``
        in the bare form).
    """

    scale: jax.Array
    growth_tracker: jax.Array
    hysteresis_tracker: jax.Array
    steps_skipped: jax.Array
    consecutive_overflows: jax.Array
    last_finite: jax.Array
    min_scale_overflows: jax.Array
    diverged: jax.Array
    inner_state: optax.OptState


class OverflowStats(NamedTuple):
    """Overflow statistics read from a loss-scale state by :func:`overflow_stats`.

    Attributes:
      steps_skipped: int32, total number of skipped steps.
      consecutive_overflows: int32, non-finite steps in a row up to now.
      last_finite: bool, whether the last step's gradients were all finite.
      diverged: bool, the scale sat at ``min_scale`` and overflowed for
        ``divergence_steps`` consecutive steps.
    """

    steps_skipped: jax.Array
    consecutive_overflows: jax.Array
    last_finite: jax.Array
    diverged: jax.Array


class LossScaleDivergedError(RuntimeError):
    """Raised by :func:`check_divergence` when training keeps overflowing at ``min_scale``."""


# --------------------------------------------------------------------------- checks


def _check_scale_value(name: str, value: float) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive float, got {value!r}.") from None
    if not (_SCALE_LO <= value <= _SCALE_HI):  # also rejects nan and inf
        raise ValueError(
            f"{name} must be a finite positive float in [2**-126, 2**126], got {value!r}: "
            "the scale and its reciprocal must both be normal float32 numbers (XLA flushes "
            "subnormals to zero, which would silently zero the unscaled gradients); "
            "use a power of two such as 2.**16."
        )
    return value


def _check_int(name: str, value: Any, minimum: int, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}; {hint}.")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}; {hint}.")
    return int(value)


def _normalize_axis_names(axis_names: str | Sequence[str]) -> tuple[str, ...]:
    if isinstance(axis_names, str):
        return (axis_names,)
    try:
        names = tuple(axis_names)
    except TypeError:
        raise ValueError(
            f"axis_names must be a mesh axis name or a sequence of them, got {axis_names!r}; "
            "e.g. axis_names=('data', 'model')."
        ) from None
    return names


def _as_extra_args(inner: Any) -> optax.GradientTransformationExtraArgs:
    # optax.MultiSteps is a class with init/update but not a GradientTransformation.
    if isinstance(inner, optax.MultiSteps):
        return inner.gradient_transformation()
    if not (hasattr(inner, "init") and hasattr(inner, "update")):
        raise ValueError(
            f"inner must be an optax.GradientTransformation (or None), got {type(inner).__name__}; "
            "e.g. DynamicLossScale(optax.adamw(1e-3))."
        )
    if not isinstance(inner, optax.GradientTransformation):
        inner = optax.GradientTransformation(inner.init, inner.update)
    return optax.with_extra_args_support(inner)


# --------------------------------------------------------------------------- numerics


def _finite_flag(tree: Any, inv_scale: jax.Array, axis_names: tuple[str, ...]) -> jax.Array:
    """Whether ``tree * inv_scale`` (computed in >= float32) is finite everywhere.

    Checks ``max|x| * inv_scale`` per leaf instead of unscaling every element:
    float rounding is monotone, so ``round(max|x| * c) == max round(|x| * c)``
    for ``c > 0``, and the max is inf iff some unscaled element is. NaN is
    mapped to +inf *before* the reduction: a max need not propagate NaN once it
    crosses devices (XLA's sharded reduction of a ``jit``-ted global array drops
    it on CPU, and a GPU all-reduce max is not bound to keep it), but every
    max keeps an inf. So the flag is exact however each leaf is laid out. The
    select fuses into the ``max(abs(x))`` reduction, which fuses with its
    producer; the unscaled copy is never materialised.
    """
    return _psum_finite(_local_finite_flag(tree, inv_scale), axis_names)


def _local_finite_flag(tree: Any, inv_scale: jax.Array) -> jax.Array:
    """The local part of :func:`_finite_flag` (no collective)."""
    flags = []
    for x in jax.tree_util.tree_leaves(tree):
        dtype = jnp.result_type(x)
        if not jnp.issubdtype(dtype, jnp.inexact) or jnp.size(x) == 0:
            continue
        wide = jnp.promote_types(dtype, jnp.float32)
        magnitude = jnp.abs(x)
        magnitude = jnp.where(jnp.isnan(magnitude), jnp.inf, magnitude)
        # The max in >= float32: exact either way, but then no collective of a split
        # gradient (ZeRO-2/3) runs in half precision (the convert fuses into the reduction).
        leaf_max = jnp.max(magnitude.astype(wide))
        flags.append(jnp.isfinite(leaf_max * inv_scale.astype(wide)))
    return jnp.all(jnp.stack(flags)) if flags else jnp.asarray(True)


def _psum_finite(finite: jax.Array, axis_names: tuple[str, ...]) -> jax.Array:
    """``finite`` (a flag or a vector of flags) made global over ``axis_names`` by one psum."""
    if axis_names:
        nonfinite = (~finite).astype(jnp.int32)
        # shard_map refuses a psum over an axis the count does not vary over (gradients
        # replicated over 'data', say): adding 0 * axis_index makes it vary over each.
        for name in axis_names:
            nonfinite = nonfinite + 0 * jax.lax.axis_index(name)
        finite = jax.lax.psum(nonfinite, axis_names) == 0
    return finite


def all_finite(tree: Any, axis_names: str | Sequence[str] = ()) -> jax.Array:
    """Whether every floating-point leaf of ``tree`` is finite (no inf, no NaN).

    One fused ``max(|x|)`` reduction per leaf, with NaN counted as inf before
    the reduction so that no NaN has to survive a cross-device max. Inside
    ``jax.shard_map`` the local non-finite flag is ``jax.lax.psum``-med over ``axis_names`` so every
    shard gets the same answer; under plain ``jax.jit`` the reduction over a
    globally sharded array is already global. Integer leaves are ignored.

    Args:
      tree: a pytree of arrays.
      axis_names: mesh axis names to reduce over (only inside ``shard_map``).

    Returns:
      A boolean scalar array.

    Example:
      >>> import jax.numpy as jnp
      >>> bool(all_finite({"w": jnp.ones(3), "b": jnp.array([1.0, jnp.nan])}))
      False
    """
    return _finite_flag(tree, jnp.ones((), jnp.float32), _normalize_axis_names(axis_names))


def _unscale(tree: Any, inv_scale: jax.Array) -> Any:
    """Casts floating leaves to (at least) float32 and multiplies by ``inv_scale``."""

    def one(g):
        if not jnp.issubdtype(jnp.result_type(g), jnp.inexact):
            return g
        dtype = jnp.promote_types(jnp.result_type(g), jnp.float32)
        return jnp.asarray(g, dtype) * inv_scale.astype(dtype)

    return jax.tree_util.tree_map(one, tree)


def _sum_trees(trees: Sequence[Any]) -> Any:
    """Leafwise sum of same-structured trees, in order; non-float leaves from the first."""

    def add(*leaves):
        if not jnp.issubdtype(jnp.result_type(leaves[0]), jnp.inexact):
            return leaves[0]
        return functools.reduce(jnp.add, leaves)

    return jax.tree_util.tree_map(add, *trees)


def _check_num_losses(num_losses: Any) -> int:
    return _check_int("num_losses", num_losses, 1,
                      "give the number of losses that get their own loss scale, e.g. "
                      "num_losses=2 for two losses (1, the default, is one scalar scale)")


def _split_losses(updates: Any, num_losses: int, params: Any) -> tuple[Any, ...]:
    """The ``num_losses`` gradient trees passed to ``update``, checked."""
    if num_losses == 1:
        return (updates,)
    hint = (f"with num_losses={num_losses}, update takes a tuple of {num_losses} gradient "
            "trees, one per loss: tx.update((grads_0, grads_1, ...), state, params), grads_i "
            "from jax.grad of scale_loss(loss_i, state, loss_id=i)")
    if not isinstance(updates, tuple | list):
        raise ValueError(f"got gradients of type {type(updates).__name__}; {hint}.")
    if len(updates) != num_losses:
        raise ValueError(f"got {len(updates)} gradient trees for num_losses={num_losses}; "
                         f"{hint}.")
    structures = [jax.tree_util.tree_structure(g) for g in updates]
    if params is not None and (jax.tree_util.tree_structure(updates)
                               == jax.tree_util.tree_structure(params)):
        raise ValueError(f"got one gradient tree shaped like params; {hint}.")
    if any(t != structures[0] for t in structures[1:]):
        raise ValueError(f"the {num_losses} gradient trees differ in structure ({structures}); "
                         f"they are summed, so each must be shaped like params; {hint}.")
    return tuple(updates)


# --------------------------------------------------------------------------- state


def _init_state(init_scale: float, hysteresis: int, inner_state: Any,
                num_losses: int = 1) -> LossScaleState:
    shape = () if num_losses == 1 else (num_losses,)  # one loss: scalars, as always
    return LossScaleState(
        scale=jnp.full(shape, init_scale, jnp.float32),
        growth_tracker=jnp.zeros(shape, jnp.int32),
        hysteresis_tracker=jnp.full(shape, hysteresis, jnp.int32),
        steps_skipped=jnp.zeros((), jnp.int32),
        consecutive_overflows=jnp.zeros((), jnp.int32),
        last_finite=jnp.asarray(True),
        min_scale_overflows=jnp.zeros((), jnp.int32),
        diverged=jnp.asarray(False),
        inner_state=inner_state,
    )


def _adjust_scale(state: LossScaleState, finite: jax.Array, *, growth_factor: float,
                  backoff_factor: float, growth_interval: int, hysteresis: int,
                  min_scale: float, max_scale: float) -> LossScaleState:
    """The dynamic scale rule, a pure function of the state and the finite flag.

    Finite: count the step; grow on the ``growth_interval``-th in a row. Overflow:
    reset the count, spend one hysteresis; back off when none is left (torch's
    rule for ``hysteresis=1``, Megatron's otherwise). Clamped to the bounds.
    """
    scale, overflow = state.scale, ~finite
    counted = optax.safe_increment(state.growth_tracker)
    grow = finite & (counted >= growth_interval)
    # Floored at 0 so that the int32 tracker cannot wrap; "<= 0" is unchanged by the floor.
    hysteresis_left = jnp.maximum(state.hysteresis_tracker - 1, 0)
    backoff = overflow & (hysteresis_left <= 0)
    grown = jnp.minimum(scale * jnp.float32(growth_factor), jnp.float32(max_scale))
    shrunk = jnp.maximum(scale * jnp.float32(backoff_factor), jnp.float32(min_scale))
    return state._replace(
        scale=jnp.where(grow, grown, jnp.where(backoff, shrunk, scale)),
        growth_tracker=jnp.where(finite & ~grow, counted, 0),
        hysteresis_tracker=jnp.where(
            grow, jnp.int32(hysteresis),
            jnp.where(overflow, hysteresis_left, state.hysteresis_tracker)),
    )


def _count_overflow(state: LossScaleState, finite: jax.Array, min_scale: float,
                    divergence_steps: int) -> LossScaleState:
    """Updates the overflow counters and the divergence flag (before the scale moves).

    ``finite`` is the scalar flag, or the ``[k]`` per-loss flags: the step
    overflowed if any loss did, and it counts as "at ``min_scale``" if every
    overflowing loss's scale was already there (no back-off could help).
    """
    overflowed = ~finite
    overflow = jnp.any(overflowed)
    at_min = overflow & jnp.all(finite | (state.scale <= jnp.float32(min_scale)))
    min_scale_overflows = jnp.where(at_min, optax.safe_increment(state.min_scale_overflows), 0)
    return state._replace(
        steps_skipped=jnp.where(overflow, optax.safe_increment(state.steps_skipped),
                                state.steps_skipped),
        consecutive_overflows=jnp.where(
            overflow, optax.safe_increment(state.consecutive_overflows), 0),
        last_finite=~overflow,
        min_scale_overflows=min_scale_overflows,
        diverged=min_scale_overflows >= divergence_steps,
    )


def _skip_by_select() -> bool:
    """Whether the skip is a fused select (one device) rather than a ``lax.cond``.

    A select fuses ``where(finite, new, old)`` into the optimizer's own elementwise update:
    one pass, in place when the state is donated, and no host read of the predicate. A
    conditional cost a third of AdamW's update on XLA:CPU (issue 31: a 784-512-10 MLP step
    1.21-1.29x mpx's). With several devices the step holds collectives, and XLA:CPU, running
    a select form's independent collectives concurrently from a persistent-cache executable,
    deadlocked in their rendezvous (tests/test_zero.py, second run on a warm cache); the
    conditional orders them. So the select is used only when the process sees one device.
    Both forms skip exactly: the old state and -0.0 updates, bit for bit.
    """
    return jax.device_count() == 1


def _apply_or_skip(inner_tx, finite, unscaled, inner_state, params, extra_args):
    """``inner_tx.update`` on ``unscaled()`` if ``finite``, else -0.0s and the same state.

    Exact either way (see :func:`_skip_by_select` for which form runs): NaN and inf in the
    discarded branch never reach the chosen state. The unscale fuses into the optimizer.
    """
    def apply():
        grads = unscaled()
        new_updates, new_inner = inner_tx.update(grads, inner_state, params, **extra_args)
        # The inner state keeps its dtypes: float32 gradients must not turn the float16
        # moments of a pure-f16 model into float32 (a new type would recompile, break restores).
        return new_updates, optax.tree_utils.tree_cast_like(new_inner, inner_state)

    def skipped(updates_like):
        # -0.0, not 0.0: p + -0.0 is p bit for bit, a -0.0 parameter included.
        return optax.tree_utils.tree_full_like(updates_like, -0.0)

    if _skip_by_select():
        new_updates, new_inner = apply()
        return (optax.tree_utils.tree_where(finite, new_updates, skipped(new_updates)),
                optax.tree_utils.tree_where(finite, new_inner, inner_state))

    def skip():
        # apply() is traced here only for the output types (zeros_like keeps shard_map's
        # varying axes; master weights may change the update dtype); XLA drops it as dead.
        return skipped(apply()[0]), inner_state

    return jax.lax.cond(finite, apply, skip)


# --------------------------------------------------------------------------- transformations


# Host-side rate limit of verbose=True (module globals, read per call, so tests can patch them).
_VERBOSE_MIN_INTERVAL_S = 1.0
_monotonic = time.monotonic


def _format_scale(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e16 else f"{x:g}"


class _ScaleChangePrinter:
    """Prints the scale changes of one transformation to stderr, rate-limited on the host.

    Called (via ``jax.debug.callback``) only on steps where some scale changed.
    A line is printed if at least ``_VERBOSE_MIN_INTERVAL_S`` seconds have passed
    since the last printed line (the first change always prints); the changes
    dropped in between are counted and the count is appended to the next line.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_print = -math.inf
        self._dropped = 0

    def __call__(self, old: Any, new: Any, applied: Any) -> None:
        old, new = np.asarray(old).reshape(-1), np.asarray(new).reshape(-1)
        several = old.size > 1
        skipped = "" if bool(applied) else ", step skipped"
        parts = []
        for i, (o, n) in enumerate(zip(old.tolist(), new.tolist(), strict=True)):
            if o == n:
                continue
            why = "growth" if n > o else "overflow"
            loss = f"loss {i}, " if several else ""
            parts.append(f"{_format_scale(o)} -> {_format_scale(n)} ({loss}{why}{skipped})")
        if not parts:
            return
        with self._lock:
            now = _monotonic()
            if now - self._last_print < _VERBOSE_MIN_INTERVAL_S:
                self._dropped += 1
                return
            line = "jamp: loss scale " + "; ".join(parts)
            if self._dropped:
                line += f" [{self._dropped} earlier change(s) not shown]"
            self._last_print, self._dropped = now, 0
        print(line, file=sys.stderr, flush=True)


def _report_changes(printer: _ScaleChangePrinter, old: jax.Array, new: jax.Array,
                    applied: jax.Array) -> None:
    """Calls ``printer`` on the host, only on steps where some scale changed."""

    def report():
        jax.debug.callback(printer, old, new, applied)

    jax.lax.cond(jnp.any(old != new), report, lambda: None)


def _skipping(inner: Any, *, init_scale: float, hysteresis: int, rule: Any,
              axis_names: tuple[str, ...], min_scale: float,
              divergence_steps: int, num_losses: int = 1,
              verbose: bool = False) -> optax.GradientTransformationExtraArgs:
    """Unscale, check, skip or apply, then the counters and ``rule`` (Dynamic and Static).

    With ``num_losses=k > 1`` the gradients are a tuple of ``k`` trees: tree
    ``i`` is unscaled by ``scale[i]`` and checked on its own (one psum for all
    ``k`` flags), the unscaled trees are summed, the step is applied only if all
    are finite, and ``rule`` moves each scale by its own flag (apex's rule).
    """
    inner_tx = None if inner is None else _as_extra_args(inner)
    printer = _ScaleChangePrinter() if verbose else None

    def init_fn(params):
        inner_state = optax.EmptyState() if inner_tx is None else inner_tx.init(params)
        return _init_state(init_scale, hysteresis, inner_state, num_losses)

    def update_fn(updates, state, params=None, **extra_args):
        trees = _split_losses(updates, num_losses, params)
        inv_scale = 1.0 / jnp.asarray(state.scale, jnp.float32)
        if num_losses == 1:
            finite = _finite_flag(updates, inv_scale, axis_names)
            applied = finite

            def unscaled():
                return _unscale(updates, inv_scale)
        else:
            finite = _psum_finite(jnp.stack([_local_finite_flag(g, inv_scale[i])
                                             for i, g in enumerate(trees)]), axis_names)
            applied = jnp.all(finite)

            def unscaled():
                return _sum_trees([_unscale(g, inv_scale[i]) for i, g in enumerate(trees)])
        if inner_tx is None:  # bare form: the links after this one are not skipped
            unscaled_updates = unscaled()
            new_updates = optax.tree_utils.tree_where(
                applied, unscaled_updates, optax.tree_utils.tree_zeros_like(unscaled_updates))
            new_inner = state.inner_state
        else:
            new_updates, new_inner = _apply_or_skip(
                inner_tx, applied, unscaled, state.inner_state, params, extra_args)
        new_state = rule(_count_overflow(state, finite, min_scale, divergence_steps), finite)
        if printer is not None:
            _report_changes(printer, state.scale, new_state.scale, applied)
        return new_updates, new_state._replace(inner_state=new_inner)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _checked_dynamic_args(init_scale, growth_factor, backoff_factor, growth_interval,
                          hysteresis, min_scale, max_scale, divergence_steps) -> dict[str, Any]:
    """The arguments of :func:`DynamicLossScale`, validated, as plain Python numbers."""
    if isinstance(growth_factor, bool) or not float(growth_factor) > 1.0:
        raise ValueError(
            f"growth_factor must be > 1, got {growth_factor!r}; "
            "use e.g. growth_factor=2.0 (double the scale after growth_interval finite steps)."
        )
    if not math.isfinite(float(growth_factor)):
        raise ValueError(f"growth_factor must be finite, got {growth_factor!r}; use e.g. 2.0.")
    if not 0.0 < float(backoff_factor) < 1.0:
        raise ValueError(
            f"backoff_factor must be in (0, 1), got {backoff_factor!r}; "
            "use e.g. backoff_factor=0.5 (halve the scale on overflow)."
        )
    args = dict(
        init_scale=_check_scale_value("init_scale", init_scale),
        growth_factor=float(growth_factor), backoff_factor=float(backoff_factor),
        growth_interval=_check_int("growth_interval", growth_interval, 1,
                                   "use e.g. growth_interval=2000 (torch's default)"),
        hysteresis=_check_int("hysteresis", hysteresis, 1,
                              "use hysteresis=1 for torch's rule or 2 for Megatron's default"),
        min_scale=_check_scale_value("min_scale", min_scale),
        max_scale=_check_scale_value("max_scale", max_scale),
        divergence_steps=_check_int("divergence_steps", divergence_steps, 1,
                                    "use e.g. divergence_steps=50"),
    )
    if not args["min_scale"] <= args["init_scale"] <= args["max_scale"]:
        raise ValueError(
            f"need min_scale <= init_scale <= max_scale, got min_scale={min_scale!r}, "
            f"init_scale={init_scale!r}, max_scale={max_scale!r}; "
            "move init_scale into the range or widen the bounds."
        )
    return args


# --------------------------------------------------------------------------- public


def DynamicLossScale(  # noqa: N802  (a constructor, named like optax.MultiSteps)
    inner: optax.GradientTransformation | optax.MultiSteps | None = None,
    *,
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    hysteresis: int = 1,
    min_scale: float = 1.0,
    max_scale: float = 2.0**24,
    axis_names: str | Sequence[str] = (),
    divergence_steps: int = 50,
    num_losses: int = 1,
    verbose: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Dynamic loss scaling, optionally wrapping an optimizer.

    ``update`` takes the gradients of ``scale_loss(loss, state)``, casts them to
    float32, unscales them, checks that all are finite and adjusts the scale:

    * overflow: the step is skipped (zero updates, ``inner``'s state untouched),
      the growth counter resets and the hysteresis counter drops by one; when it
      reaches 0 the scale is multiplied by ``backoff_factor``.
    * finite: the growth counter increments; on the ``growth_interval``-th
      consecutive finite step the scale is multiplied by ``growth_factor`` and
      both counters reset.

    With ``hysteresis=1`` this is exactly ``torch.amp.GradScaler``; with
    ``hysteresis > 1`` it is Megatron-LM's ``DynamicGradScaler``. The scale is
    clamped to ``[min_scale, max_scale]`` and is a float32 scalar. See the
    module docstring for the bare (``inner=None``) form, gradient accumulation
    and sharding.

    Several losses (apex's ``num_losses`` / ``loss_id``): with ``num_losses=k``
    each loss has its own scale (the state's ``scale`` and trackers have shape
    ``[k]``) and ``update`` takes a tuple of ``k`` gradient trees, tree ``i``
    being the gradients of ``scale_loss(loss_i, state, loss_id=i)``. Each tree
    is unscaled by its own scale (in float32) and checked on its own; the inner
    optimizer gets the sum of the unscaled trees, and only if *all* are finite
    (otherwise the step is skipped, exactly as above). Then every scale moves by
    its own loss's flag alone, apex's rule (``apex/amp/handle.py``,
    ``scaler.py``: ``loss_scalers[loss_id].update_scale()`` at each
    ``scale_loss`` exit, the step skipped if any of them overflowed): an
    overflowing loss spends hysteresis / backs off, and a finite loss counts a
    finite step (and may grow) even when another loss overflowed and the step
    was skipped. ``steps_skipped``, ``last_finite`` and the divergence counters
    stay scalars for the whole step. Put the scale outside ``optax.MultiSteps``
    (whose accumulator expects one tree).

    Args:
      inner: the optimizer to wrap (recommended), or ``None`` for a bare link
        at the head of an ``optax.chain`` (links after it are not skipped).
      init_scale: initial scale.
      growth_factor: multiplier on growth, > 1.
      backoff_factor: multiplier on overflow, in (0, 1).
      growth_interval: consecutive finite steps before growing, >= 1.
      hysteresis: overflows tolerated before backing off, >= 1 (1 = torch).
      min_scale: lower bound of the scale, >= 2**-126.
      max_scale: upper bound of the scale, <= 2**126 (so that 1/scale is a
        normal float32).
      axis_names: mesh axes to ``psum`` the overflow count over; only needed
        when ``update`` runs inside ``jax.shard_map`` on local gradient blocks.
      divergence_steps: consecutive overflows at ``min_scale`` after which
        :func:`overflow_stats` reports ``diverged`` (see :func:`check_divergence`).
      num_losses: number of losses with their own scale, >= 1 (apex's
        ``num_losses``); above 1, ``update`` takes a tuple of that many
        gradient trees.
      verbose: print one line to stderr when a scale changes, e.g.
        ``jamp: loss scale 65536 -> 32768 (overflow, step skipped)`` (with
        several losses ``(loss 1, overflow, step skipped)``), from inside
        ``jit`` via ``jax.debug.callback`` (called only on steps where a scale
        changed; once per device inside ``shard_map``). Rate-limited on the
        host: at most one line per second per transformation; changes dropped
        in that second are counted on the next line printed. ``False`` adds
        no callback.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state contains a
      :class:`LossScaleState`.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> tx = DynamicLossScale(optax.adam(1e-3), init_scale=2.**15, growth_interval=100)
      >>> params = {"w": jnp.ones(3)}
      >>> state = tx.init(params)
      >>> grads = {"w": jnp.array([1.0, jnp.inf, 0.0])}   # an overflow
      >>> updates, state = tx.update(grads, state, params)
      >>> float(loss_scale(state)), bool(overflow_stats(state).last_finite)
      (16384.0, False)

      Two losses, each with its own scale; loss 1 overflows, so the step is
      skipped and only scale 1 backs off:

      >>> tx = DynamicLossScale(optax.sgd(0.1), init_scale=2.**10, num_losses=2)
      >>> state = tx.init(params)
      >>> g0 = jax.grad(lambda p: scale_loss(p["w"].sum(), state, loss_id=0))(params)
      >>> g1 = {"w": jnp.array([jnp.inf, 1.0, 1.0])}
      >>> updates, state = tx.update((g0, g1), state, params)
      >>> loss_scale(state).tolist(), int(overflow_stats(state).steps_skipped)
      ([1024.0, 512.0], 1)
    """
    args = _checked_dynamic_args(init_scale, growth_factor, backoff_factor, growth_interval,
                                 hysteresis, min_scale, max_scale, divergence_steps)
    num_losses = _check_num_losses(num_losses)
    if not isinstance(verbose, bool | np.bool_):
        raise ValueError(f"verbose must be True or False, got {verbose!r}.")
    rule = functools.partial(_adjust_scale, **{k: v for k, v in args.items()
                                               if k not in ("init_scale", "divergence_steps")})
    return _skipping(inner, init_scale=args["init_scale"], hysteresis=args["hysteresis"],
                     rule=rule, axis_names=_normalize_axis_names(axis_names),
                     min_scale=args["min_scale"], divergence_steps=args["divergence_steps"],
                     num_losses=num_losses, verbose=bool(verbose))


def StaticLossScale(  # noqa: N802
    scale: float,
    inner: optax.GradientTransformation | optax.MultiSteps | None = None,
    *,
    axis_names: str | Sequence[str] = (),
    divergence_steps: int = 50,
    num_losses: int = 1,
) -> optax.GradientTransformationExtraArgs:
    """A fixed loss scale: unscale, check, skip on overflow; the scale never moves.

    The skip semantics (wrapped vs bare form) and the multi-loss form
    (``num_losses``: a tuple of gradient trees, the step skipped if any
    overflows) are those of :func:`DynamicLossScale`; every loss has the same
    fixed scale. Since the scale cannot back off, every overflow counts towards
    ``divergence_steps``.

    Args:
      scale: the loss scale, in [2**-126, 2**126].
      inner: the optimizer to wrap, or ``None`` for a bare chain link.
      axis_names: mesh axes to ``psum`` the overflow count over (``shard_map``).
      divergence_steps: consecutive overflows after which ``diverged`` is set.
      num_losses: number of losses (gradient trees per ``update``), >= 1.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state contains a
      :class:`LossScaleState`.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> tx = StaticLossScale(128.0, optax.sgd(0.1))
      >>> state = tx.init({"w": jnp.ones(2)})
      >>> updates, state = tx.update({"w": jnp.full(2, 128.0)}, state)
      >>> updates["w"].tolist()
      [-0.10000000149011612, -0.10000000149011612]
    """
    scale = _check_scale_value("scale", scale)
    divergence_steps = _check_int(
        "divergence_steps", divergence_steps, 1, "use e.g. divergence_steps=50"
    )
    return _skipping(inner, init_scale=scale, hysteresis=1, rule=lambda state, finite: state,
                     axis_names=_normalize_axis_names(axis_names), min_scale=scale,
                     divergence_steps=divergence_steps,
                     num_losses=_check_num_losses(num_losses))


def NoOpLossScale(  # noqa: N802
    inner: optax.GradientTransformation | optax.MultiSteps | None = None,
    *,
    num_losses: int = 1,
) -> optax.GradientTransformationExtraArgs:
    """Scale 1 and no overflow check: a pure pass-through of ``inner``.

    For bfloat16 / float32 training, so that the same step function (and
    :func:`scale_loss`, :func:`loss_scale`, :func:`overflow_stats`) works for
    every precision mode. The gradients go to ``inner`` untouched (no cast, no
    check); nothing is ever skipped and ``overflow_stats`` stays at zero. With
    ``num_losses=k > 1`` ``update`` takes a tuple of ``k`` gradient trees (as
    :func:`DynamicLossScale` does) and passes on their sum, uncast.

    Args:
      inner: the optimizer to wrap, or ``None`` for a bare chain link.
      num_losses: number of losses (gradient trees per ``update``), >= 1.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state contains a
      :class:`LossScaleState` with scale 1.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> tx = NoOpLossScale(optax.sgd(1.0))
      >>> state = tx.init({"w": jnp.ones(2)})
      >>> float(loss_scale(state))
      1.0
    """
    inner_tx = None if inner is None else _as_extra_args(inner)
    num_losses = _check_num_losses(num_losses)

    def init_fn(params):
        inner_state = optax.EmptyState() if inner_tx is None else inner_tx.init(params)
        return _init_state(1.0, 1, inner_state, num_losses)

    def update_fn(updates, state, params=None, **extra_args):
        if num_losses > 1:
            updates = _sum_trees(_split_losses(updates, num_losses, params))
        if inner_tx is None:
            return updates, state
        updates, inner_state = inner_tx.update(updates, state.inner_state, params, **extra_args)
        return updates, state._replace(inner_state=inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


LossScaleKind = Literal["none", "static", "dynamic"]

_FIELDS_BY_KIND: dict[str, tuple[str, ...]] = {
    "none": ("num_losses",),
    "static": ("init_scale", "divergence_steps", "num_losses"),
    "dynamic": ("init_scale", "growth_factor", "backoff_factor", "growth_interval",
                "hysteresis", "min_scale", "max_scale", "divergence_steps", "num_losses",
                "verbose"),
}


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
    """How a precision mode scales the loss: the kind and every setting, in one place.

    ``kind`` picks the transformation (``"dynamic"``: :func:`DynamicLossScale`,
    ``"static"``: :func:`StaticLossScale` with ``init_scale`` as the fixed scale,
    ``"none"``: :func:`NoOpLossScale`); the other fields are its arguments. The
    values are checked when the config is made, with the transformations' own
    messages. :meth:`wrap` builds the transformation around an optimizer.
    ``num_losses`` (every kind) gives each of that many losses its own scale
    (``update`` then takes a tuple of gradient trees); ``verbose`` (dynamic)
    prints the scale's changes. See :func:`DynamicLossScale`.

    Example:
      >>> import optax
      >>> config = LossScaleConfig("dynamic", init_scale=2.**10, hysteresis=2)
      >>> config.uses("hysteresis"), LossScaleConfig("static").uses("hysteresis")
      (True, False)
      >>> state = config.wrap(optax.sgd(0.1)).init({"w": jnp.ones(2)})
      >>> float(loss_scale(state))
      1024.0
      >>> two = LossScaleConfig("dynamic", num_losses=2).wrap(optax.sgd(0.1))
      >>> loss_scale(two.init({"w": jnp.ones(2)})).shape
      (2,)
    """

    kind: LossScaleKind = "none"
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    divergence_steps: int = 50
    num_losses: int = 1
    verbose: bool = False

    def __post_init__(self):
        if self.kind not in _FIELDS_BY_KIND:
            raise ValueError(
                f"loss scale kind {self.kind!r} is not valid: use 'none', 'static' or 'dynamic'.")
        self.wrap(None)  # checks every field the kind uses

    def uses(self, field: str) -> bool:
        """Whether the transformation of this kind reads ``field``.

        Example:
          >>> LossScaleConfig("none").uses("divergence_steps")
          False
        """
        return field in _FIELDS_BY_KIND[self.kind]

    def wrap(self, inner: optax.GradientTransformation | optax.MultiSteps | None,
             axis_names: str | Sequence[str] = ()) -> optax.GradientTransformationExtraArgs:
        """The loss-scale transformation of this config around ``inner``.

        Args:
          inner: the optimizer to wrap, or ``None`` for a bare chain link.
          axis_names: mesh axes to ``psum`` the overflow check over (inside ``shard_map``).

        Example:
          >>> import optax
          >>> tx = LossScaleConfig("static", init_scale=8.0).wrap(optax.sgd(0.1))
          >>> float(loss_scale(tx.init({"w": jnp.ones(2)})))
          8.0
        """
        if self.kind == "dynamic":
            fields = {f: getattr(self, f) for f in _FIELDS_BY_KIND["dynamic"]}
            return DynamicLossScale(inner, axis_names=axis_names, **fields)
        if self.kind == "static":
            return StaticLossScale(self.init_scale, inner, axis_names=axis_names,
                                   divergence_steps=self.divergence_steps,
                                   num_losses=self.num_losses)
        return NoOpLossScale(inner, num_losses=self.num_losses)


# --------------------------------------------------------------------------- helpers


def _from_nnx(opt_state: Any) -> Any:
    """An ``nnx.Optimizer``, its ``opt_state`` or its ``nnx.state``, as a plain optax state."""
    from flax import nnx  # noqa: PLC0415  (only NNX users pay for it)

    if isinstance(opt_state, nnx.Optimizer):
        opt_state = opt_state.opt_state
    if not isinstance(opt_state, nnx.State):
        return nnx.as_pure(opt_state)
    state = nnx.as_pure(opt_state)  # nnx.state(optimizer): the NamedTuple became a mapping
    state = state.get("opt_state", state)
    if set(LossScaleState._fields) <= set(state):
        return LossScaleState(**{k: state[k] for k in LossScaleState._fields})
    return state


def _find_state(opt_state: Any) -> LossScaleState:
    opt_state = _from_nnx(opt_state)
    found = [state for _, state in
             optax.tree_utils.tree_get_all_with_path(opt_state, "LossScaleState")]
    if not found:
        raise ValueError(
            "no jamp loss-scale state found in opt_state; wrap your optimizer with "
            "jamp.DynamicLossScale(tx) (or jamp.StaticLossScale(scale, tx) / "
            "jamp.NoOpLossScale(tx)) and pass the state its init/update returned. "
            "(A checkpoint restored without a target turns NamedTuples into dicts: "
            "restore it against the abstract state.)"
        )
    if len(found) > 1:
        raise ValueError(
            f"found {len(found)} jamp loss-scale states in opt_state; use exactly one "
            "loss-scale transformation per optimizer (it must wrap the others)."
        )
    return found[0]


def _num_losses_of(state: LossScaleState) -> int:
    shape = jnp.shape(state.scale)
    return 1 if shape == () else int(shape[0])


def _check_loss_id(loss_id: Any, num_losses: int) -> int:
    if (isinstance(loss_id, bool) or not isinstance(loss_id, int | np.integer)
            or not 0 <= loss_id < num_losses):
        fix = ("this loss-scale state has one scale (num_losses=1): drop loss_id, or build "
               "the transformation with num_losses=k (DynamicLossScale(tx, num_losses=k), "
               "LossScaleConfig(..., num_losses=k)) to give k losses their own scale"
               if num_losses == 1 else
               f"pass loss_id=i with i a Python int in 0..{num_losses - 1}, the index of the "
               "loss (and of its gradient tree in update), or raise num_losses")
        raise ValueError(f"loss_id must be an int in [0, num_losses) = [0, {num_losses}), "
                         f"got {loss_id!r}; {fix}.")
    return int(loss_id)


def scale_loss(loss: jax.Array, opt_state: Any, loss_id: int = 0) -> jax.Array:
    """Multiplies ``loss`` by the current loss scale, computing in float32.

    ``opt_state`` may be any optax state (or a tree holding one, like a train
    state) that contains exactly one loss-scale state.

    Args:
      loss: the (scalar) loss, in any floating dtype.
      opt_state: the optimizer state holding a :class:`LossScaleState`.
      loss_id: which loss this is, in ``[0, num_losses)`` (apex's ``loss_id``):
        the loss is multiplied by that loss's own scale. Only 0 with one loss.

    Returns:
      ``loss * scale`` in float32 (float64 if ``loss`` is float64).

    Raises:
      ValueError: ``loss_id`` is not an int in ``[0, num_losses)``.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> state = StaticLossScale(4.0, optax.sgd(0.1)).init({"w": jnp.ones(2)})
      >>> float(scale_loss(jnp.asarray(1.5, jnp.float16), state))
      6.0
      >>> tx = DynamicLossScale(optax.sgd(0.1), init_scale=8.0, num_losses=2)
      >>> float(scale_loss(jnp.asarray(1.5), tx.init({"w": jnp.ones(2)}), loss_id=1))
      12.0
    """
    state = _find_state(opt_state)
    loss_id = _check_loss_id(loss_id, _num_losses_of(state))
    scale = state.scale if jnp.ndim(state.scale) == 0 else state.scale[loss_id]
    loss = jnp.asarray(loss)
    dtype = jnp.promote_types(loss.dtype, jnp.float32)
    return loss.astype(dtype) * jnp.asarray(scale, dtype)


def loss_scale(opt_state: Any, loss_id: int | None = None) -> jax.Array:
    """The current loss scale held in ``opt_state``.

    Args:
      opt_state: the optimizer state holding a :class:`LossScaleState`.
      loss_id: with ``num_losses > 1``, which loss's scale to return; ``None``
        returns all of them. With one loss only ``None`` or 0.

    Returns:
      A float32 scalar array (one loss, or ``loss_id`` given), else the
      ``[num_losses]`` float32 vector of scales.

    Raises:
      ValueError: ``loss_id`` is not an int in ``[0, num_losses)``.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> state = DynamicLossScale(optax.sgd(0.1)).init({"w": jnp.ones(2)})
      >>> float(loss_scale(state))
      65536.0
      >>> state = DynamicLossScale(optax.sgd(0.1), num_losses=3).init({"w": jnp.ones(2)})
      >>> loss_scale(state).shape, float(loss_scale(state, loss_id=2))
      ((3,), 65536.0)
    """
    state = _find_state(opt_state)
    scale = jnp.asarray(state.scale, jnp.float32)
    if loss_id is None:
        return scale
    loss_id = _check_loss_id(loss_id, _num_losses_of(state))
    return scale if scale.ndim == 0 else scale[loss_id]


def overflow_stats(opt_state: Any) -> OverflowStats:
    """Overflow statistics held in ``opt_state``.

    Args:
      opt_state: the optimizer state holding a :class:`LossScaleState`.

    Returns:
      An :class:`OverflowStats` of scalar arrays.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> state = DynamicLossScale(optax.sgd(0.1)).init({"w": jnp.ones(2)})
      >>> int(overflow_stats(state).steps_skipped)
      0
    """
    s = _find_state(opt_state)
    return OverflowStats(
        steps_skipped=s.steps_skipped,
        consecutive_overflows=s.consecutive_overflows,
        last_finite=s.last_finite,
        diverged=s.diverged,
    )


def check_divergence(opt_state: Any) -> None:
    """Raises :class:`LossScaleDivergedError` if the loss scale has diverged.

    Call it on the host (outside ``jit``) every few steps: it reads device
    values. Divergence means the scale sat at ``min_scale`` and the gradients
    still overflowed for ``divergence_steps`` consecutive steps, so loss scaling
    cannot recover and every step is being skipped.

    Args:
      opt_state: the optimizer state holding a :class:`LossScaleState`.

    Raises:
      LossScaleDivergedError: with the scale, the number of consecutive
        overflows and what to try.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> state = DynamicLossScale(optax.sgd(0.1)).init({"w": jnp.ones(2)})
      >>> check_divergence(state)   # fine: nothing raised
    """
    s = _find_state(opt_state)
    if bool(s.diverged):
        scale = ", ".join(f"{x:g}" for x in np.asarray(s.scale, np.float64).reshape(-1))
        raise LossScaleDivergedError(
            f"loss scale diverged: the scale is at its minimum ({scale}) and the "
            f"gradients have been non-finite for {int(s.consecutive_overflows)} consecutive steps "
            f"({int(s.steps_skipped)} skipped in total), so every update is being skipped. "
            "Lower the learning rate (or add warm-up / gradient clipping), train in bfloat16 "
            "instead of float16, keep numerically sensitive ops (softmax, norms, losses) in "
            "float32, and check the input data for NaNs/infs."
        )
