"""Optimizer state in low precision: any optax chain's per-parameter state, stored small.

:func:`low_precision_state` wraps any optax optimizer. Its state holds the inner
optimizer's state with every per-parameter floating leaf (AdamW's ``mu`` and ``nu``,
SGD's momentum ``trace``, ...) stored in the :class:`StateFormat` its name asks for:
float32, bfloat16, float16 with a scale, or float8 (E4M3) with a scale per tensor or
per block. Each ``update`` dequantizes to float32, runs the inner ``update`` in
float32 and quantizes the new state again. Counts, other integers and scalars are
kept as they are.

Scales are powers of two chosen from the tensor's (or block's) absolute maximum
each step, so that the maximum lands in the top binade of the format: dequantizing
is exact, and a state that did not change quantizes to the same bits.

``nu`` (a mean of squared gradients) spans twice the orders of magnitude of the
gradients themselves; ``sqrt=True`` stores its square root instead
(``benchmarks/optimizer_state.py`` measures both: the defaults store the root).

Example:
  >>> import jax.numpy as jnp, optax, jamp
  >>> tx = jamp.low_precision_state(optax.adam(1e-3), {"mu": "fp8", "nu": "fp16"})
  >>> state = tx.init({"w": jnp.ones((4, 8))})
  >>> jamp.optim_state.stored_dtypes(state)
  {'mu': 'float8_e4m3fn', 'nu': 'float16'}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax.core import meta

_DTYPES = {
    "f32": jnp.float32, "float32": jnp.float32, "fp32": jnp.float32,
    "bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16,
    "f16": jnp.float16, "fp16": jnp.float16, "float16": jnp.float16,
    "fp8": jnp.float8_e4m3fn, "e4m3": jnp.float8_e4m3fn, "float8_e4m3fn": jnp.float8_e4m3fn,
}
"""Every dtype name a :class:`StateFormat` accepts."""

_SCALED = (jnp.float16, jnp.float8_e4m3fn)
"""Formats whose range is too small to store a state unscaled."""

ANY = "*"
"""The key of a format mapping that matches every per-parameter floating leaf."""


@dataclasses.dataclass(frozen=True)
class StateFormat:
    """How one kind of optimizer state is stored.

    Attributes:
      dtype: ``"float32"``, ``"bfloat16"`` (no scale: it has float32's range),
        ``"float16"`` or ``"float8_e4m3fn"`` (with a power-of-two scale); short names
        ``f32``, ``bf16``, ``fp16``, ``fp8`` too.
      block_size: float16/fp8 only: one scale per this many consecutive elements of
        the last axis (a leaf whose last axis is not a multiple gets one scale per row);
        None: one scale per tensor.
      sqrt: store the square root of the (non-negative) state and square it back:
        halves the orders of magnitude a second moment spans.

    Raises:
      ValueError: an unknown dtype, a block size that is not a positive int, or a
        block size for a format without scales.

    Example:
      >>> import jamp
      >>> jamp.optim_state.StateFormat("fp8", block_size=128).dtype
      'float8_e4m3fn'
    """

    dtype: str = "float32"
    block_size: int | None = None
    sqrt: bool = False

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise ValueError(
                f"Unknown optimizer-state dtype {self.dtype!r}. Valid: float32 (f32), bfloat16 "
                "(bf16), float16 (fp16, stored with a scale) and float8_e4m3fn (fp8, stored "
                "with a scale per tensor or per block_size elements).")
        object.__setattr__(self, "dtype", jnp.dtype(_DTYPES[self.dtype]).name)
        if self.block_size is not None:
            if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or \
                    self.block_size < 1:
                raise ValueError(f"block_size must be a positive int (or None: one scale per "
                                 f"tensor), got {self.block_size!r}.")
            if not self.scaled:
                raise ValueError(
                    f"block_size={self.block_size} applies to the scaled formats (float16, "
                    f"float8_e4m3fn); {self.dtype} stores no scale: drop block_size.")
        if not isinstance(self.sqrt, bool):
            raise ValueError(f"sqrt must be True or False, got {self.sqrt!r}.")

    @property
    def scaled(self) -> bool:
        """Whether values are stored divided by a scale."""
        return jnp.dtype(self.dtype) in [jnp.dtype(d) for d in _SCALED]

    @property
    def identity(self) -> bool:
        """Whether the state is stored as it is (float32, no square root)."""
        return self.dtype == "float32" and not self.sqrt


FormatLike = str | StateFormat
"""A :class:`StateFormat` or its dtype name (``"fp8"``, ``"bf16"``, ...)."""


def as_format(spec: FormatLike) -> StateFormat:
    """A :class:`StateFormat` from a dtype name (``"fp8"``) or a format.

    Example:
      >>> import jamp
      >>> jamp.optim_state.as_format("bf16")
      StateFormat(dtype='bfloat16', block_size=None, sqrt=False)
    """
    if isinstance(spec, StateFormat):
        return spec
    if isinstance(spec, str):
        return StateFormat(spec.strip())
    raise ValueError(f"An optimizer-state format is a dtype name ('fp8', 'fp16', 'bf16', "
                     f"'f32') or a jamp.optim_state.StateFormat, got {spec!r}.")


class QuantizedLeaf(NamedTuple):
    """One stored state leaf, quantized.

    Attributes:
      value: the leaf in the format's dtype.
      scale: its float32 scale: shape ``()`` per tensor, the leaf's shape with the last axis
        counted in blocks per block; ``()`` ones for unscaled formats.
    """

    value: jax.Array
    scale: jax.Array


class LowPrecisionState(NamedTuple):
    """State of :func:`low_precision_state`.

    Attributes:
      inner_state: the inner optimizer's state, its per-parameter floating leaves replaced
        by :class:`QuantizedLeaf`.
    """

    inner_state: optax.OptState


def _is_box(x: Any) -> bool:
    return isinstance(x, meta.AxisMetadata)


def _is_quantized(x: Any) -> bool:
    return isinstance(x, QuantizedLeaf)


def _scale_shape(shape: tuple[int, ...], fmt: StateFormat) -> tuple[int, ...]:
    if not fmt.scaled or fmt.block_size is None or not shape:
        return ()
    last = shape[-1]
    blocks = last // fmt.block_size if last % fmt.block_size == 0 else 1
    return (*shape[:-1], blocks)


def quantize(x: jax.Array, fmt: StateFormat) -> QuantizedLeaf:
    """``x`` (float32) stored in ``fmt``: the value and its power-of-two scale.

    Example:
      >>> import jax.numpy as jnp, jamp
      >>> fmt = jamp.optim_state.StateFormat("fp8")
      >>> q = jamp.optim_state.quantize(jnp.array([1e-4, 3e-4]), fmt)
      >>> str(q.value.dtype), float(q.scale) == 2.0 ** -20
      ('float8_e4m3fn', True)
    """
    x = jnp.asarray(x, jnp.float32)
    if fmt.sqrt:
        x = jnp.sqrt(jnp.maximum(x, 0.0))
    dtype = jnp.dtype(fmt.dtype)
    if not fmt.scaled:
        return QuantizedLeaf(x.astype(dtype), jnp.ones((), jnp.float32))
    fmax = float(jnp.finfo(dtype).max)
    shape = _scale_shape(x.shape, fmt)
    blocks = x.reshape(*shape, -1) if shape else x.reshape(-1)
    amax = jnp.max(jnp.abs(blocks), axis=-1)
    ok = (amax > 0) & jnp.isfinite(amax)
    # The smallest power of two with amax / scale <= fmax: the maximum lands in the top binade.
    exponent = jnp.ceil(jnp.log2(jnp.where(ok, amax, fmax) / fmax))
    # ldexp, not exp2: XLA's exp2 is not exact at integers, and the scale must be a power
    # of two for dequantizing to be exact.
    exponent = jnp.clip(exponent, -126, 127).astype(jnp.int32)
    scale = jnp.where(ok, jnp.ldexp(jnp.float32(1.0), exponent), 1.0).astype(jnp.float32)
    scaled = blocks / (scale[..., None] if shape else scale)
    value = jnp.clip(scaled, -fmax, fmax).astype(dtype).reshape(x.shape)
    return QuantizedLeaf(value, scale)


def dequantize(q: QuantizedLeaf, fmt: StateFormat) -> jax.Array:
    """The float32 state ``q`` stands for (exact: the scales are powers of two).

    Example:
      >>> import jax.numpy as jnp, jamp
      >>> fmt = jamp.optim_state.StateFormat("fp16", block_size=2)
      >>> x = jnp.array([[2.0 ** -20, 3 * 2.0 ** -21, 3.0, 4.0]])   # two blocks of 2
      >>> q = jamp.optim_state.quantize(x, fmt)
      >>> q.scale.shape, bool((jamp.optim_state.dequantize(q, fmt) == x).all())
      ((1, 2), True)
    """
    value = q.value.astype(jnp.float32)
    if fmt.scaled:
        shape = _scale_shape(value.shape, fmt)
        if shape:
            value = (value.reshape(*shape, -1) * q.scale[..., None]).reshape(q.value.shape)
        else:
            value = value * q.scale
    return value * value if fmt.sqrt else value


def _names(path: tuple[Any, ...]) -> list[str]:
    return [k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey)]


def _quantizable(leaf: Any) -> bool:
    return (hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating)
            and len(getattr(leaf, "shape", ())) >= 1)


def _format_for(names: list[str], formats: Mapping[str, StateFormat]) -> tuple[str, StateFormat]:
    for key, fmt in formats.items():
        if key == ANY or key in names:
            return key, fmt
    return "", StateFormat()


def _check_formats(formats: Any) -> dict[str, StateFormat]:
    if isinstance(formats, str | StateFormat):
        formats = {ANY: formats}
    if not isinstance(formats, Mapping):
        raise ValueError(
            f"low_precision_state formats: a mapping from state names to formats, e.g. "
            f"{{'mu': 'fp8', 'nu': 'fp16', '*': 'bf16'}}, or one format for every state "
            f"('bf16'), got {formats!r}.")
    out = {}
    for key, spec in formats.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"low_precision_state formats: keys are state names such as 'mu', "
                             f"'nu', 'trace' or '*' (any), got {key!r}.")
        try:
            out[key] = as_format(spec)
        except ValueError as e:
            raise ValueError(f"low_precision_state formats[{key!r}]: {e}") from None
    return out


def low_precision_state(
    inner: optax.GradientTransformation,
    formats: Mapping[str, FormatLike] | FormatLike = "bf16",
    *,
    strict: bool = True,
) -> optax.GradientTransformation:
    """Stores ``inner``'s per-parameter floating state in low precision.

    Each floating leaf of ``inner``'s state with at least one dimension gets the format
    of the first key of ``formats`` that names it: a key matches the attribute names on
    the leaf's path in the state (the NamedTuple fields: ``mu``, ``nu``, ``trace``,
    ``inner_state``...); ``"*"`` matches every leaf. A leaf no key matches stays float32.
    Integer leaves (``count``) and scalars are untouched. ``update`` dequantizes the
    state to float32, runs ``inner.update`` on float32 gradients, parameters and state,
    and stores the new state again; the updates it returns are float32.

    Put a loss scale outside it (:func:`jamp.make_optimizer` does): a skipped step
    leaves the stored values and their scales bit-identical.

    Args:
      inner: any optax optimizer (``optax.adamw``, ``optax.sgd(momentum=...)``, a chain).
      formats: ``{state name: format}``, a format being a dtype name (``"fp8"``,
        ``"fp16"``, ``"bf16"``, ``"f32"``) or a :class:`StateFormat` (block scales,
        square root); one format alone applies to every leaf.
      strict: a key of ``formats`` that names no floating per-parameter leaf is an
        error (a key naming an integer leaf always is); False allows keys for other
        optimizers (the presets of :data:`jamp.optim_state.PRESETS`).

    Returns:
      An ``optax.GradientTransformation`` with :class:`LowPrecisionState`.

    Raises:
      ValueError: an unknown dtype or a bad format (at once), a key that names an
        integer state, or (``strict``) a key that names no state of ``inner`` (at
        ``init``).

    Example:
      >>> import jax.numpy as jnp, optax, jamp
      >>> tx = jamp.low_precision_state(optax.sgd(0.1, momentum=0.9), "fp8")
      >>> params = {"w": jnp.ones(3)}
      >>> state = tx.init(params)
      >>> updates, state = tx.update({"w": jnp.full(3, 0.5)}, state, params)
      >>> [round(u, 6) for u in updates["w"].tolist()], jamp.optim_state.stored_dtypes(state)
      ([-0.05, -0.05, -0.05], {'trace': 'float8_e4m3fn'})
    """
    formats = _check_formats(formats)

    def plan(state: Any) -> Any:
        """Per leaf of ``state`` (a flax box counts as one leaf): its format, or None
        where it is kept as it is."""
        used: set[str] = set()

        def one(path, leaf):
            array = leaf.unbox() if _is_box(leaf) else leaf
            names = _names(path)
            key, fmt = _format_for(names, formats)
            if key in names and hasattr(array, "dtype") and \
                    not jnp.issubdtype(array.dtype, jnp.floating):
                raise ValueError(
                    f"low_precision_state: the state {'.'.join(names)!r} is "
                    f"{jnp.dtype(array.dtype).name} of shape {tuple(array.shape)}, and "
                    f"formats[{key!r}]={fmt.dtype} stores floating states only: "
                    "drop the key (counts and other integers are kept as they are).")
            if not _quantizable(array) or not key:
                return None
            used.add(key)
            return None if fmt.identity else fmt

        out = jax.tree_util.tree_map_with_path(one, state, is_leaf=_is_box)
        missing = [k for k in formats if k != ANY and k not in used]
        if strict and missing:
            names = sorted({n for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
                            if _quantizable(leaf) for n in _names(path) if n != "value"})
            raise ValueError(
                f"low_precision_state: formats key(s) {', '.join(map(repr, missing))} name no "
                f"floating per-parameter state of this optimizer; its states are named "
                f"{', '.join(map(repr, names)) or '(none)'}. Use one of those (or '*').")
        return out

    def store(state: Any, fmts: Any) -> Any:
        def one(fmt, leaf):
            if fmt is None:
                return leaf
            if _is_box(leaf):  # flax's partitioning boxes: box the value, not the scale
                q = quantize(leaf.unbox(), fmt)
                return QuantizedLeaf(leaf.replace_boxed(q.value), q.scale)
            return quantize(leaf, fmt)
        return jax.tree_util.tree_map(one, fmts, state, is_leaf=lambda x: x is None)

    def load(stored: Any, fmts: Any) -> Any:
        return jax.tree_util.tree_map(
            lambda fmt, leaf: leaf if fmt is None else dequantize(leaf, fmt), fmts, stored,
            is_leaf=lambda x: x is None)

    def init_fn(params):
        inner_state = inner.init(_to_f32(params))
        return LowPrecisionState(store(inner_state, plan(inner_state)))

    def update_fn(updates, state, params=None, **extra_args):
        stored = state.inner_state
        # The formats follow from the names, dtypes and shapes, as at init.
        twin = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.value.shape, jnp.float32) if _is_quantized(x)
            else x, stored, is_leaf=_is_quantized)
        fmts = plan(twin)
        new_updates, new_inner = inner.update(_to_f32(updates), load(stored, fmts),
                                              _to_f32(params), **extra_args)
        return new_updates, LowPrecisionState(store(new_inner, fmts))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _to_f32(tree: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda x: x.astype(jnp.float32)
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def stored_dtypes(opt_state: Any) -> dict[str, str]:
    """``{state name: stored dtype}`` of every :class:`QuantizedLeaf` in ``opt_state``.

    Example: see :func:`low_precision_state`.
    """
    out: dict[str, str] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=_is_quantized)[0]:
        if _is_quantized(leaf):
            names = [n for n in _names(path) if n not in ("inner_state", "value")]
            value = leaf.value.unbox() if _is_box(leaf.value) else leaf.value
            out.setdefault(names[0] if names else "?", jnp.dtype(value.dtype).name)
    return out
