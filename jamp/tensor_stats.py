"""Per-layer statistics inside the jitted step, and why a step was skipped.

Two things, both computed on global arrays under ``jax.jit`` (outside ``shard_map``), so a
leaf split over a mesh is reduced exactly once and a replicated leaf is not counted once
per device:

* **Statistics** of every gradient, every parameter and (where the model lets us, see
  :func:`linen_activations`, :func:`nnx_activations` and, for plain functions,
  :func:`jamp.function_activations.function_activations`) every layer's output:
  :data:`STATISTICS`. A :class:`Collector` gathers them every ``every`` steps under a
  ``lax.cond``; with ``every=0`` the step gains no operation at all.
* **The reason for a skip**: on a step whose gradients (or loss) are not finite, a
  second ``lax.cond`` searches the gradients for the first non-finite leaf (inf vs NaN,
  and the element) and, given the activations, the first layer whose forward output was
  non-finite or above the compute dtype's maximum. A finite step runs none of it.

Exactness: NaN is counted (``nan_count``), never left to a max: ``amax`` is the max of
the magnitudes with NaN set aside, then NaN if the leaf holds any NaN, so neither XLA's
max nor a collective's can drop it. Counts are int32 sums.

Example:
  >>> import jax.numpy as jnp
  >>> from jamp import tensor_stats
  >>> s = tensor_stats.array_stats(jnp.array([0.0, 1e-6, 3.0, jnp.inf]), jnp.float16)
  >>> float(s.amax[0]), float(s.zero_fraction[0]), float(s.underflow_fraction[0])
  (inf, 0.25, 0.25)
  >>> int(s.inf_count[0]), int(s.nan_count[0])
  (1, 0)
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import types
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jamp.apply.nnx import iter_modules

__all__ = ["GROUPS", "STATISTICS", "Collector", "Row", "Stats", "array_stats",
           "check_groups", "check_statistic", "explain", "linen_activations", "named_leaves",
           "nnx_activations", "ordered_leaves", "skip_line", "table", "tree_stats"]

STATISTICS = ("amax", "min_nonzero", "zero_fraction", "underflow_fraction", "flush_fraction",
              "headroom_bits", "nan_count", "inf_count")
"""What :func:`array_stats` computes per row (a leaf, or one layer of a scanned leaf):

* ``amax``: the largest magnitude (unscaled gradients); NaN if any element is NaN.
* ``min_nonzero``: the smallest non-zero finite magnitude (inf if there is none).
* ``zero_fraction``: the share of elements exactly zero.
* ``underflow_fraction``: the share of non-zero finite elements below the dtype's smallest
  normal (they become subnormal or zero in it; gradients at the current loss scale).
* ``flush_fraction``: the share of non-zero finite elements that round to zero in the dtype.
* ``headroom_bits``: ``log2(dtype max / amax)`` (gradients: of the scaled values, so how
  far the loss scale could still grow); negative: overflow.
* ``nan_count``, ``inf_count``: int32 counts of NaN and of +-inf elements.
"""

GROUPS = ("grads", "params", "activations")
"""The tensors a :class:`Collector` can look at."""


class Stats(NamedTuple):
    """:data:`STATISTICS`, each an array with one entry per row."""

    amax: jax.Array
    min_nonzero: jax.Array
    zero_fraction: jax.Array
    underflow_fraction: jax.Array
    flush_fraction: jax.Array
    headroom_bits: jax.Array
    nan_count: jax.Array
    inf_count: jax.Array


class Row(NamedTuple):
    """One row of a group's statistics: a leaf, or layer ``index`` of a scanned leaf."""

    name: str  # e.g. "Encoder/layers/3/MlpBlock_0/Dense_1/kernel"
    leaf: int  # the leaf's position among the group's floating leaves
    index: int | None  # the layer of a scanned leaf (its axis 0), else None
    shape: tuple[int, ...]  # the whole leaf's shape


def check_statistic(name: str) -> str:
    """``name`` if it is one of :data:`STATISTICS`, else a ValueError naming them.

    Example:
      >>> check_statistic("amax")
      'amax'
    """
    if name not in STATISTICS:
        raise ValueError(f"Unknown statistic {name!r}: use one of {', '.join(STATISTICS)}.")
    return name


def check_groups(groups: str | Sequence[str]) -> tuple[str, ...]:
    """``groups`` (a comma-separated string or a sequence) as a tuple, each one of :data:`GROUPS`.

    Example:
      >>> check_groups("grads,params")
      ('grads', 'params')
    """
    if isinstance(groups, str):
        groups = [g.strip() for g in groups.split(",") if g.strip()]
    groups = tuple(groups)
    bad = [g for g in groups if g not in GROUPS]
    if bad or not groups:
        raise ValueError(f"Unknown tensor statistics group(s) {bad or groups!r}: use a "
                         f"comma-separated subset of {','.join(GROUPS)}.")
    return groups


# ----------------------------------------------------------------------------- statistics


def _max_min_sums(a: tuple[jax.Array, ...], b: tuple[jax.Array, ...]
                  ) -> tuple[jax.Array, ...]:
    """The combiner of :func:`array_stats`' reduction: a max, a min, then sums."""
    return (jnp.maximum(a[0], b[0]), jnp.minimum(a[1], b[1]),
            *(x + y for x, y in zip(a[2:], b[2:], strict=True)))


def array_stats(x: jax.Array, dtype: Any = None, scale: jax.Array | float = 1.0,
                split: bool = False) -> Stats:
    """:data:`STATISTICS` of ``x`` against ``dtype`` (default: ``x``'s own); one row, or one
    per index of axis 0 with ``split`` (a scanned leaf's layers).

    ``scale``: ``x`` holds values multiplied by it (scaled gradients): ``amax`` and
    ``min_nonzero`` are divided by it, the fractions and the headroom are of ``x`` itself.
    An empty ``x`` has amax 0, min_nonzero inf and every share 0.

    Example:
      >>> import jax.numpy as jnp
      >>> s = array_stats(jnp.array([[1.0, 0.0], [jnp.nan, 2.0]]), split=True)
      >>> s.amax.tolist(), s.nan_count.tolist(), s.zero_fraction.tolist()
      ([1.0, nan], [0, 1], [0.5, 0.0])
    """
    x = jnp.asarray(x)
    info = jnp.finfo(x.dtype if dtype is None else dtype)
    wide = jnp.promote_types(x.dtype, jnp.float32)
    a = jnp.abs(x.astype(wide))  # no reshape: a sharded leaf keeps its layout
    axes = tuple(range(1 if split else 0, a.ndim))
    size = math.prod(a.shape[1:] if split else a.shape)
    nan, inf = jnp.isnan(a), jnp.isinf(a)
    nonzero = (a != 0) & ~nan & ~inf
    tiny = jnp.asarray(float(info.smallest_normal), wide)
    half_sub = jnp.asarray(float(info.smallest_subnormal) / 2, wide)
    # x cannot hold a value that would flush to zero in dtype: that count is 0, no operand
    flushes = float(jnp.finfo(x.dtype).smallest_subnormal) <= float(info.smallest_subnormal) / 2
    counted = [a == 0, nonzero & (a < tiny), nan, inf] + ([nonzero & (a <= half_sub)]
                                                          if flushes else [])
    # One reduction, one pass over x, of integers only: the bits of a non-negative float
    # order as the float does, so amax and the smallest non-zero are an integer max and
    # min. On XLA:CPU this costs a fifth of seven separate reductions of a layer output
    # (a reduction with float operands is not vectorized there: it cost twice as much).
    # The counts are int32: exact past 2**24.
    bits_type = jnp.int64 if wide == jnp.float64 else jnp.int32
    bits = jax.lax.bitcast_convert_type(a, bits_type)
    no_value = jax.lax.bitcast_convert_type(jnp.asarray(jnp.inf, wide), bits_type)
    top, low, zeros, under, nan_count, inf_count, *flushed = jax.lax.reduce(
        (bits, jnp.where(nonzero, bits, no_value),  # a NaN's max is replaced below
         *(m.astype(jnp.int32) for m in counted)),
        (jnp.zeros((), bits_type), no_value, *[jnp.int32(0)] * len(counted)),
        _max_min_sums, axes)
    top, low = (jax.lax.bitcast_convert_type(v, wide) for v in (top, low))
    flushed = flushed[0] if flushes else jnp.zeros(zeros.shape, jnp.int32)
    amax = jnp.where(nan_count > 0, jnp.nan, top)
    share = lambda c: c.astype(jnp.float32) / max(size, 1)
    inv = 1.0 / jnp.asarray(scale, jnp.float32)
    with np.errstate(divide="ignore"):
        log_max = float(np.log2(float(info.max)))
    stats = Stats(
        amax=(amax * inv).astype(jnp.float32),
        min_nonzero=(low * inv).astype(jnp.float32),
        zero_fraction=share(zeros),
        underflow_fraction=share(under),
        flush_fraction=share(flushed),
        headroom_bits=(log_max - jnp.log2(amax.astype(jnp.float32))),
        nan_count=nan_count,
        inf_count=inf_count,
    )
    return stats if split else Stats(*(jnp.reshape(v, (1,)) for v in stats))


def _key_name(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def named_leaves(tree: Any) -> list[tuple[str, Any]]:
    """``(path, leaf)`` of ``tree``'s floating leaves in JAX's order, paths joined by '/'
    (a box's ``value`` left out).

    Example:
      >>> import jax.numpy as jnp
      >>> [n for n, _ in named_leaves({"b": {"kernel": jnp.ones(1)}, "a": jnp.ones(1)})]
      ['a', 'b/kernel']
    """
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
            continue
        parts = [_key_name(k) for k in path]
        if parts and parts[-1] == "value" and len(path) and hasattr(path[-1], "name"):
            parts = parts[:-1]
        out.append(("/".join(parts), leaf))
    return out


def ordered_leaves(tree: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, Any]]:
    """``(path, leaf)`` of the floating leaves in the order the mappings hold them (the
    order flax records layer outputs in: a layer after the layers it calls), not sorted.

    A linen ``capture_intermediates`` path ``Dense_0/__call__/0`` is named ``Dense_0``.

    Example:
      >>> import jax.numpy as jnp
      >>> t = {"b": {"__call__": (jnp.ones(1),)}, "a": {"__call__": (jnp.ones(1),)}}
      >>> [n for n, _ in ordered_leaves(t)]
      ['b', 'a']
    """
    if isinstance(tree, Stats | _Located):  # a layer output reduced during the forward pass
        return [(_layer_name(prefix), tree)]
    if isinstance(tree, Mapping):
        items = [(str(k), v) for k, v in tree.items()]
    elif isinstance(tree, list | tuple):
        items = [(str(i), v) for i, v in enumerate(tree)]
    elif tree is None:
        return []
    else:
        if hasattr(tree, "dtype") and jnp.issubdtype(tree.dtype, jnp.inexact):
            return [(_layer_name(prefix), tree)]
        return []
    out = []
    for k, v in items:
        out.extend(ordered_leaves(v, (*prefix, k)))
    return out


def _layer_name(parts: tuple[str, ...]) -> str:
    if "__call__" not in parts:
        return "/".join(parts) or "(output)"
    i = parts.index("__call__")
    call, *rest = parts[i + 1:] or ("0",)
    while rest and rest[-1] == "0":  # (x, None) outputs: the first element
        rest = rest[:-1]
    name = "/".join(parts[:i]) or "(output)"  # the model's own output: the root's call
    return name + ("" if call == "0" else f"#{call}") + "".join(f"[{p}]" for p in rest)


def _rows(named: list[tuple[str, Any]], scanned: Sequence[str]) -> list[Row]:
    rows = []
    for i, (name, leaf) in enumerate(named):
        parts = name.split("/")
        at = next((j for j, p in enumerate(parts) if p in scanned), None)
        shape = tuple(jnp.shape(leaf))
        if at is None or not shape:
            rows.append(Row(name, i, None, shape))
            continue
        for layer in range(shape[0]):
            rows.append(Row("/".join([*parts[:at + 1], str(layer), *parts[at + 1:]]), i, layer,
                            shape))
    return rows


def tree_stats(named: list[tuple[str, Any]], dtype: Any = None, scale: Any = 1.0,
               scanned: Sequence[str] = ()) -> tuple[Stats, list[Row]]:
    """:func:`array_stats` of every leaf of ``named`` (:func:`named_leaves` or
    :func:`ordered_leaves`) concatenated into one :class:`Stats`, with its rows.

    A leaf under a path component in ``scanned`` (e.g. ``"layers"``, an ``nn.scan``'s
    name) stacks its layers on axis 0: one row per layer, named with the layer's index.

    Example:
      >>> import jax.numpy as jnp
      >>> stats, rows = tree_stats(named_leaves({"layers": {"w": jnp.ones((2, 3))}}),
      ...                          scanned=("layers",))
      >>> [r.name for r in rows], stats.amax.tolist()
      (['layers/0/w', 'layers/1/w'], [1.0, 1.0])
    """
    rows = _rows(named, scanned)
    parts = []
    for i, (_, leaf) in enumerate(named):
        split = any(r.leaf == i and r.index is not None for r in rows)
        parts.append(array_stats(leaf, dtype, scale, split=split))
    if not parts:
        empty = jnp.zeros((0,), jnp.float32)
        return Stats(*([empty] * 6), jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.int32)), []
    return Stats(*(jnp.concatenate(column) for column in zip(*parts, strict=True))), rows


def _combine(stats: Stats, axis: int) -> Stats:
    """``stats`` of equal-sized parts merged over ``axis`` (a NaN count keeps amax NaN)."""
    nan = jnp.sum(stats.nan_count, axis=axis)
    amax = jnp.where(nan > 0, jnp.nan, jnp.max(jnp.nan_to_num(stats.amax, nan=0.0), axis=axis))
    return Stats(amax=amax, min_nonzero=jnp.min(stats.min_nonzero, axis=axis),
                 zero_fraction=jnp.mean(stats.zero_fraction, axis=axis),
                 underflow_fraction=jnp.mean(stats.underflow_fraction, axis=axis),
                 flush_fraction=jnp.mean(stats.flush_fraction, axis=axis),
                 headroom_bits=jnp.min(stats.headroom_bits, axis=axis),
                 nan_count=nan, inf_count=jnp.sum(stats.inf_count, axis=axis))


def reduced_stats(named: list[tuple[str, Stats]], scanned: Sequence[str] = ()
                  ) -> tuple[Stats, list[Row]]:
    """Rows and one concatenated :class:`Stats` of layer outputs already reduced in the
    forward pass (``linen_activations(..., reduce=array_stats)``).

    A scan stacks the statistics of its body's outputs (``[layers, 1]``): under a path
    component in ``scanned`` each layer is a row, elsewhere the layers merge into one.

    Example:
      >>> import jax.numpy as jnp
      >>> one = array_stats(jnp.array([1.0, 2.0]))
      >>> two = Stats(*(jnp.stack([v, 2 * v]) for v in one))
      >>> stats, rows = reduced_stats([("layers/Dense_0", two), ("head", one)], ("layers",))
      >>> [r.name for r in rows], stats.amax.tolist()
      (['layers/0/Dense_0', 'layers/1/Dense_0', 'head'], [2.0, 4.0, 2.0])
    """
    rows, parts = [], []
    for i, (name, stats) in enumerate(named):
        lead = stats.amax.shape[:-1]
        if not lead:
            rows.append(Row(name, i, None, ()))
            parts.append(stats)
            continue
        flat = Stats(*(jnp.reshape(v, (math.prod(lead), -1)) for v in stats))
        names = name.split("/")
        at = next((j for j, p in enumerate(names) if p in scanned), None)
        if at is None:
            rows.append(Row(name, i, None, ()))
            parts.append(Stats(*(jnp.reshape(v, (1,)) for v in _combine(flat, (0, 1)))))
            continue
        per_layer = _combine(Stats(*(jnp.reshape(v, (lead[0], -1)) for v in flat)), 1)
        rows += [Row("/".join([*names[:at + 1], str(layer), *names[at + 1:]]), i, layer, ())
                 for layer in range(lead[0])]
        parts.append(per_layer)
    if not parts:
        return tree_stats([])[0], []
    return Stats(*(jnp.concatenate(column) for column in zip(*parts, strict=True))), rows


# ----------------------------------------------------------------------------- skips


class _Located(NamedTuple):
    """A layer output reduced for the skip search: its statistics, and the first 'data'
    shard of the batch holding a value that is NaN, inf or above the compute dtype's
    maximum (``[1]`` int32; -1: none, or not known: one shard, or axis 0 is not the batch)."""

    stats: Stats
    shard: jax.Array


def _search_reduce(dtype: Any, batch_size: int | None
                   ) -> tuple[Callable[[jax.Array], _Located], int]:
    """The skip search's ``reduce`` and the number of 'data' shards: :func:`array_stats` and
    the first bad 'data' shard of an output whose axis 0 is the batch (``batch_size``
    examples, split evenly over the mesh's 'data' axis, as the trainer and ``jamp.boost``
    lay out a batch). Call it while tracing under the step's mesh."""
    shards = dict(jax.sharding.get_abstract_mesh().shape).get("data", 1)
    limit = float(jnp.finfo(dtype).max)

    def reduce(x: jax.Array) -> _Located:
        stats = array_stats(x, dtype)
        if (shards <= 1 or not batch_size or batch_size % shards or not jnp.ndim(x)
                or x.shape[0] != batch_size):
            return _Located(stats, jnp.full((1,), -1, jnp.int32))
        a = jnp.abs(x.astype(jnp.promote_types(x.dtype, jnp.float32)))
        bad = jnp.any(jnp.reshape(~(a <= limit), (shards, -1)), axis=1)  # NaN fails <= too
        shard = jnp.where(jnp.any(bad), jnp.argmax(bad), -1).astype(jnp.int32)
        return _Located(stats, jnp.reshape(shard, (1,)))

    return reduce, shards


def _located_rows(located: list[tuple[str, Any]], scanned: Sequence[str]
                  ) -> tuple[Stats, list[Row], jax.Array]:
    """:func:`reduced_stats` of the search's outputs, and each row's first bad shard
    (-1: none or not known). A row merging several calls keeps the lowest bad shard."""
    stats, rows = reduced_stats([(n, getattr(v, "stats", v)) for n, v in located], scanned)
    # The shard rides in min_nonzero (inf: none), so the rows merge as reduced_stats merges.
    as_stats = []
    for name, v in located:
        shard = getattr(v, "shard", None)
        if shard is None:
            shard = jnp.full(v.amax.shape, -1, jnp.int32)
        low = jnp.where(shard >= 0, shard.astype(jnp.float32), jnp.inf)
        zero = jnp.zeros(low.shape, jnp.float32)
        as_stats.append((name, Stats(zero, low, zero, zero, zero, zero,
                                     jnp.zeros(low.shape, jnp.int32),
                                     jnp.zeros(low.shape, jnp.int32))))
    low = reduced_stats(as_stats, scanned)[0].min_nonzero
    return stats, rows, jnp.where(jnp.isfinite(low), low, -1).astype(jnp.int32)


def _first_bad(named: list[tuple[str, Any]], rows: list[Row], order: list[int],
               limit: float | None = None, prefer_inf: bool = False) -> dict[str, jax.Array]:
    """The first row (in ``order``) holding inf or NaN (or a magnitude above ``limit``);
    with ``prefer_inf`` the first holding inf and no NaN if there is one (an overflow in
    the backward pass spreads as NaN, inf - inf, to the leaves computed after it)."""
    stats = Stats(*(jnp.concatenate(c) for c in zip(*(
        _non_finite(leaf, split=any(r.leaf == i and r.index is not None for r in rows))
        for i, (_, leaf) in enumerate(named)), strict=True))) if named else tree_stats([])[0]
    result = _first_bad_row(stats, order, limit, prefer_inf)
    # The first non-finite element of each leaf (flat index in the whole leaf).
    leaf_of_row = jnp.asarray([r.leaf for r in rows] or [0], jnp.int32)
    elements = jnp.stack([jnp.argmax(~jnp.isfinite(jnp.ravel(leaf))).astype(jnp.int32)
                          if jnp.size(leaf) else jnp.zeros((), jnp.int32)
                          for _, leaf in named]) if named else jnp.zeros((1,), jnp.int32)
    element = elements[leaf_of_row[jnp.maximum(result["row"], 0)]]
    return dict(result, element=jnp.where(result["row"] >= 0, element, -1))


def _non_finite(x: jax.Array, split: bool) -> Stats:
    """What a gradient search reads of a leaf (or of each layer): whether it holds inf
    (``inf_count`` 1) and NaN (``nan_count`` 1), in two max reductions rather than
    :func:`array_stats`' eight: the search is compiled into every step. ``amax`` is 0.
    (Max, not bitwise or: a sharded leaf's reduction becomes a collective, and XLA:CPU
    has no bitwise-or all-reduce.)"""
    axes = tuple(range(1 if split else 0, x.ndim))
    flag = lambda m: jnp.reshape(jnp.max(m.astype(jnp.int32), axis=axes, initial=0), (-1,))
    nan, inf = flag(jnp.isnan(x)), flag(jnp.isinf(x))
    zero = jnp.zeros(nan.shape, jnp.float32)
    return Stats(zero, zero, zero, zero, zero, zero, nan, inf)


def _first_bad_row(stats: Stats, order: list[int], limit: float | None = None,
                   prefer_inf: bool = False) -> dict[str, jax.Array]:
    """:func:`_first_bad` on rows' statistics: ``row``, ``kind``, ``count``, ``amax``."""
    if not order:
        return {"row": jnp.int32(-1), "kind": jnp.int32(0), "count": jnp.int32(0),
                "amax": jnp.float32(0.0)}
    kind = (stats.inf_count > 0).astype(jnp.int32) + 2 * (stats.nan_count > 0).astype(jnp.int32)
    if limit is not None:
        kind = kind + 4 * (jnp.nan_to_num(stats.amax, nan=0.0) > limit).astype(jnp.int32)
    at = jnp.asarray(order, jnp.int32)
    kinds_all, amax_all = kind[at], stats.amax[at]
    flags = kinds_all > 0
    pos = jnp.argmax(flags)
    if prefer_inf:
        inf_only = kinds_all == 1
        pos = jnp.where(jnp.any(inf_only), jnp.argmax(inf_only), pos)
    any_bad = jnp.any(flags)
    return {"row": jnp.where(any_bad, at[pos], -1), "kind": jnp.where(any_bad, kinds_all[pos], 0),
            "count": jnp.sum(flags, dtype=jnp.int32),
            "amax": jnp.where(any_bad, amax_all[pos], 0.0).astype(jnp.float32)}


def _forward_order(rows: list[Row], scanned_prefix: Callable[[str], str | None]) -> list[int]:
    """Rows in the order the forward pass produced them: a scanned group's rows at its
    first leaf, layer by layer."""
    first: dict[str, int] = {}
    keys = []
    for r_i, r in enumerate(rows):
        group = scanned_prefix(r.name) if r.index is not None else None
        if group is not None:
            at = first.setdefault(group, r.leaf)
            keys.append(((at, r.index, r.leaf), r_i))
        else:
            keys.append(((r.leaf, -1, r.leaf), r_i))
    return [i for _, i in sorted(keys)]


# ----------------------------------------------------------------------------- collector


def _scanned_prefix(scanned: Sequence[str]) -> Callable[[str], str | None]:
    def prefix(name: str) -> str | None:
        parts = name.split("/")
        at = next((j for j, p in enumerate(parts) if p in scanned), None)
        return None if at is None else "/".join(parts[:at + 1])
    return prefix


@dataclasses.dataclass(frozen=True)
class Collector:
    """What the step gathers: statistics every ``every`` steps, and the reason of a skip.

    Give it to :func:`jamp.step.loss_scaled_step` (or :func:`jamp.booster.assemble_step`,
    ``jamp.boost(tensor_stats_every=...)``, the trainer's ``--config.tensor_stats_every``).
    The step's metrics then hold ``tensor_stats`` (``{group: Stats}``, filled on collected
    steps) and ``tensor_stats_collected``; with ``explain_skips`` also ``skip`` (the search's
    result; :meth:`explain` turns it into a sentence). The rows' names are recorded here
    when the step is traced.

    Attributes:
      every: collect on steps whose number is a multiple of it; 0: never (no op added).
      groups: which of :data:`GROUPS` to collect.
      compute_dtype: the dtype the shares and headroom are measured against.
      scanned: path components of ``nn.scan``-stacked modules (axis 0 is the layer).
      explain_skips: search a skipped step's gradients (and activations) for the culprit.
      activations: ``activations(state, variables, batch, rng, reduce) -> tree`` of
        ``reduce(output)`` for every layer output, in the order they were computed, each
        reduced where the forward pass computes it (:func:`linen_activations`,
        :func:`nnx_activations`, :func:`jamp.function_activations.function_activations`);
        None: no activations.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> c = Collector(every=1, groups=("grads",))
      >>> m = jax.jit(lambda g: c.step_metrics(step=jnp.int32(0), params={}, grads=g,
      ...             scale=1.0, bad=~jnp.isfinite(g["w"]).all()))({"w": jnp.array([1.0, jnp.nan])})
      >>> explain(jax.device_get(m), c.rows)
      'NaN in the gradient of w (element (1,))'
    """

    every: int = 0
    groups: tuple[str, ...] = GROUPS
    compute_dtype: Any = jnp.float16
    scanned: tuple[str, ...] = ()
    explain_skips: bool = True
    activations: Callable[..., Any] | None = None
    rows: dict[str, list[Row]] = dataclasses.field(default_factory=dict, compare=False,
                                                   repr=False)

    def __post_init__(self):
        if not isinstance(self.every, int | np.integer) or isinstance(self.every, bool) \
                or self.every < 0:
            raise ValueError(f"tensor statistics every={self.every!r}: use a whole number of "
                             "steps >= 1 (0: off), e.g. every=100.")
        object.__setattr__(self, "groups", check_groups(self.groups))

    @property
    def enabled(self) -> bool:
        """Whether the step gains anything at all."""
        return bool(self.every) or self.explain_skips

    def step_metrics(self, *, step: jax.Array, params: Any, grads: Any, scale: Any,
                     bad: jax.Array, forward: Callable[[Any], Any] | None = None,
                     batch_size: int | None = None) -> dict[str, Any]:
        """The metrics this collector adds to a step (call it under ``jit``).

        Args:
          step: the step number (``state.step`` before the update).
          params: the parameters the gradients are of.
          grads: the gradients as differentiated (multiplied by ``scale``).
          scale: the loss scale of this step.
          bad: whether the step is skipped (or its loss non-finite): the search's predicate.
          forward: ``forward(reduce) -> tree`` of ``reduce(output)`` of every layer output,
            reduced as the forward pass computes it (None: no activations).
          batch_size: the examples in the step's batch: the search names the 'data' shard
            of the first bad layer output whose axis 0 has this size (None: it does not).
        """
        out: dict[str, Any] = {}
        forward = forward if self.activations is not None else None
        # Each layer output is reduced to its statistics where it is computed, so the
        # extra forward pass holds no more than one output at a time: on XLA:CPU a
        # branch holding them all grew the step's scratch memory past malloc's mmap
        # threshold (32 MiB), and every step, collecting or not, paid fresh page faults.
        reduce = lambda x: array_stats(x, self.compute_dtype)
        if self.every:
            def collect(_):
                result = {}
                trees = {"grads": (grads, scale), "params": (params, 1.0)}
                for group in self.groups:
                    if group == "activations":
                        if forward is None:
                            continue
                        result[group], self.rows[group] = reduced_stats(
                            ordered_leaves(forward(reduce)), self.scanned)
                        continue
                    tree, s = trees[group]
                    result[group], self.rows[group] = tree_stats(
                        named_leaves(tree), self.compute_dtype, s, self.scanned)
                return result

            # A cond even for every=1: it orders the statistics' forward pass after the
            # step's. Without it, XLA:CPU aborted a pipelined step (its collectives and
            # the statistics' ran in different orders on different devices).
            shapes = jax.eval_shape(collect, None)
            empty = lambda _: jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype),
                                                     shapes)
            collected = step % self.every == 0
            out["tensor_stats"] = jax.lax.cond(collected, collect, empty, None)
            out["tensor_stats_collected"] = collected
        if self.explain_skips:
            limit = float(jnp.finfo(self.compute_dtype).max)

            def search(_):
                named = named_leaves(grads)
                rows = _rows(named, self.scanned)
                self.rows.setdefault("grads", rows)
                result = {"grads": _first_bad(named, rows, list(range(len(rows))),
                                              prefer_inf=True)}
                if forward is not None:
                    find, shards = _search_reduce(self.compute_dtype, batch_size)
                    stats, rows, bad_shard = _located_rows(ordered_leaves(forward(find)),
                                                           self.scanned)
                    self.rows["activations"] = rows
                    order = _forward_order(rows, _scanned_prefix(self.scanned))
                    found = _first_bad_row(stats, order, limit)
                    found["shard"] = jnp.where(found["row"] >= 0, bad_shard[
                        jnp.maximum(found["row"], 0)], -1) if rows else jnp.int32(-1)
                    found["shards"] = jnp.int32(shards)
                    result["activations"] = found
                return result

            shapes = jax.eval_shape(search, None)
            none = lambda _: jax.tree_util.tree_map(
                lambda a: jnp.full(a.shape, -1 if a.dtype == jnp.int32 else 0, a.dtype), shapes)
            out["skip"] = jax.lax.cond(bad, search, none, None)
        return out

    def explain(self, metrics: Mapping[str, Any], shardings: Sequence[Any] | None = None
                ) -> str | None:
        """:func:`explain` with this collector's rows."""
        return explain(metrics, self.rows, shardings, self.compute_dtype)


_KINDS = {1: "inf", 2: "NaN", 3: "inf and NaN"}


def _devices(sharding: Any, shape: tuple[int, ...], index: tuple[int, ...]) -> str:
    try:
        where = sharding.devices_indices_map(shape)
    except (AttributeError, TypeError, ValueError):
        return ""
    held = sorted(d.id for d, slices in where.items()
                  if all(s.start is None or s.start <= i < (s.stop or n) for s, i, n
                         in zip(slices, index, shape, strict=True)))
    if not held or len(held) == len(where):  # one device, or every device holds it
        return ""
    return f", on device{'s' if len(held) > 1 else ''} {','.join(map(str, held))}"


def skip_line(step: int, reason: str | None) -> str:
    """The sentence a skipped step gets in metrics.jsonl, TensorBoard, the progress line and
    the run summary (the trainer's and ``jamp.boost``'s logs alike).

    Example:
      >>> skip_line(12, None)
      'step 12 skipped: non-finite gradients'
    """
    return f"step {step} skipped: {reason or 'non-finite gradients'}"


def explain(metrics: Mapping[str, Any], rows: Mapping[str, list[Row]],
            shardings: Sequence[Any] | None = None, compute_dtype: Any = jnp.float16
            ) -> str | None:
    """Why a step was skipped, in words, from its fetched ``metrics["skip"]``; None if the
    step's search found nothing (a finite step).

    ``rows``: the collector's (its ``rows`` field); ``shardings``: the gradient leaves'
    shardings, in leaf order, to name the devices holding the first bad element.

    Example: see :class:`Collector`.
    """
    skip = metrics.get("skip")
    if skip is None:
        return None
    parts = []
    g = skip.get("grads")
    if g is not None and int(g["row"]) >= 0 and rows.get("grads"):
        row = rows["grads"][int(g["row"])]
        what = f"{_KINDS.get(int(g['kind']) & 3, 'non-finite')} in the gradient of {row.name}"
        element = int(g["element"])
        if row.shape and 0 <= element < math.prod(row.shape):
            index = tuple(int(i) for i in np.unravel_index(element, row.shape))
            where = "" if shardings is None else _devices(shardings[row.leaf], row.shape, index)
            what += f" (element {index}{where}"
            what += (f"; {int(g['count']) - 1} more non-finite)" if int(g["count"]) > 1
                     else ")")
        parts.append(what)
    a = skip.get("activations")
    if a is not None and int(a["row"]) >= 0 and rows.get("activations"):
        row = rows["activations"][int(a["row"])]
        kind, amax = int(a["kind"]), float(a["amax"])
        limit = float(jnp.finfo(compute_dtype).max)
        if kind & 3:
            what = f"forward: {_KINDS[kind & 3]} in the output of {row.name}"
        else:
            what = f"forward amax {amax:.3g} > {limit:g} at {row.name}"
        shard, shards = int(a.get("shard", -1)), int(a.get("shards", 1))
        if 0 <= shard < shards:
            what += f" (first in data shard {shard} of {shards})"
        parts.append(what)
    if not parts:
        return None
    return "; ".join(parts)


def table(metrics: Mapping[str, Any], rows: Mapping[str, list[Row]]
          ) -> dict[str, dict[str, dict[str, float]]]:
    """``{group: {row name: {statistic: value}}}`` of a collected step's fetched metrics.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> c = Collector(every=1, groups=("params",), explain_skips=False)
      >>> m = c.step_metrics(step=jnp.int32(0), params={"w": jnp.ones(2)}, grads={},
      ...                    scale=1.0, bad=jnp.bool_(False))
      >>> table(jax.device_get(m), c.rows)["params"]["w"]["amax"]
      1.0
    """
    out = {}
    for group, stats in metrics.get("tensor_stats", {}).items():
        names = [r.name for r in rows.get(group, [])]
        columns = {k: np.asarray(v) for k, v in stats._asdict().items()} \
            if hasattr(stats, "_asdict") else {k: np.asarray(v) for k, v in stats.items()}
        out[group] = {n: {k: (int(c[i]) if k.endswith("_count") else float(c[i]))
                          for k, c in columns.items()} for i, n in enumerate(names)}
    return out


# ----------------------------------------------------------------------------- models


def linen_activations(apply_fn: Callable[..., Any], variables: Mapping[str, Any], *args: Any,
                      mutable: Sequence[str] = (), reduce: Callable[[jax.Array], Any] | None = None,
                      **kwargs: Any) -> dict[str, Any]:
    """Every linen module's ``__call__`` output (but ``nn.Dropout``'s, its input masked), in
    the order the calls finished (a layer after the layers it calls):
    ``{path: {"__call__": outputs}}`` for :func:`ordered_leaves`.

    ``apply_fn`` is a linen ``Module.apply`` (e.g. a ``jamp.apply_policy`` model's);
    ``args``/``kwargs`` go to it; ``mutable``: collections the call updates (batch stats).
    ``reduce``: applied to each floating output where it is computed (e.g.
    :func:`array_stats`), so the outputs themselves are not kept; the tree holds its
    results (stacked over the layers of an ``nn.scan``). The order is recorded as the
    calls finish: flax's collections (and JAX's trees) sort their keys, which is not the
    order of the forward pass.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn
      >>> class Net(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x):  # "b" runs first
      ...         return nn.Dense(1, name="a")(nn.Dense(2, name="b")(x))
      >>> m = Net()
      >>> v = m.init(jax.random.key(0), jnp.ones((1, 3)))
      >>> [n for n, _ in ordered_leaves(linen_activations(m.apply, v, jnp.ones((1, 3))))]
      ['b', 'a', '(output)']
      >>> out = linen_activations(m.apply, v, jnp.ones((1, 3)), reduce=array_stats)
      >>> [(n, s.amax.shape) for n, s in ordered_leaves(out)][0]
      ('b', (1,))
    """
    order: list[tuple[str, ...]] = []
    floating = lambda x: hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)

    def wanted(module: Any, method_name: str) -> bool:
        # nn.Dropout's output is its input, masked
        return method_name == "__call__" and not isinstance(module, nn.Dropout)

    def record(module: Any, y: Any) -> None:
        path = tuple(module.scope.path) if module.scope is not None else ()
        if path not in order and any(floating(x) for x in jax.tree_util.tree_leaves(y)):
            order.append(path)

    def capture(module: Any, method_name: str) -> bool:  # flax's capture_intermediates
        if not wanted(module, method_name):
            return False
        if module.scope is not None and module.scope.path not in order:
            order.append(tuple(module.scope.path))
        return True

    def reduce_floating(y: Any) -> Any:
        return jax.tree_util.tree_map(lambda x: reduce(x) if floating(x) else None, y)

    def interceptor(next_fun, call_args, call_kwargs, context):
        y = next_fun(*call_args, **call_kwargs)
        module = context.module
        if module.scope is not None and wanted(module, context.method_name):
            record(module, y)
            module.sow("intermediates", "__call__", reduce_floating(y))
        return y

    call = dict(capture_intermediates=capture) if reduce is None else {}
    with nn.intercept_methods(interceptor) if reduce is not None else contextlib.nullcontext():
        _, captured = apply_fn(dict(variables), *args, mutable=[*mutable, "intermediates"],
                               **call, **kwargs)
    tree, out, lost = captured.get("intermediates", {}), {}, []
    for path in order:
        node = tree
        for part in path:
            node = node.get(part, {}) if isinstance(node, Mapping) else {}
        if isinstance(node, Mapping) and "__call__" in node:
            out["/".join(path)] = {"__call__": node["__call__"]}
        else:
            lost.append("/".join(path))
    if lost:
        warnings.warn(f"linen_activations: the outputs of {', '.join(lost)} were computed "
                      f"inside a lifted transform that drops the 'intermediates' collection, "
                      f"so they have no rows: {_LINEN_LIFTED}", stacklevel=2)
    return out


_LINEN_LIFTED = ("declare it on the transform, e.g. nn.scan(Block, variable_axes={'params': 0, "
                 "'intermediates': 0}, ...) (likewise nn.vmap), and name the scan in the "
                 "collector's scanned=(...) for a row per layer.")


class _LayerOutput(nnx.Intermediate):
    """What :func:`nnx_activations` sows: a layer's (reduced) ``__call__`` output."""


@dataclasses.dataclass(frozen=True)
class _Capturing:
    reduce: Callable[[Any], Any]
    order: list[tuple[Any, ...]]  # module paths, in the order their calls finished


_CAPTURING: contextvars.ContextVar[_Capturing | None] = contextvars.ContextVar(
    "jamp_nnx_activations", default=None)


def _capturing_class(cls: type, path: tuple[Any, ...]) -> type:
    """A subclass of ``cls`` whose ``__call__`` sows its reduced output (named alike).

    NNX has no method interceptor; a graphdef records each node's type, so a module of
    this class stays one through ``nnx.split``/``nnx.merge`` and the NNX transforms
    (``nnx.scan`` stacks what its layers sow, as it stacks their state).
    """

    def __call__(self, *args, **kwargs):  # noqa: N807
        y = cls.__call__(self, *args, **kwargs)
        active = _CAPTURING.get()
        if active is not None:
            if path not in active.order:
                active.order.append(path)
            self.sow(_LayerOutput, "__call__", active.reduce(y))
        return y

    def body(ns: dict) -> None:
        ns.update(__call__=__call__, __module__=cls.__module__, __qualname__=cls.__qualname__,
                  __doc__=cls.__doc__)

    return types.new_class(cls.__name__, (cls,), {}, body)


def _has_call(cls: type) -> bool:
    return any("__call__" in vars(c) for c in cls.__mro__[:-1])  # object's is not a layer


def nnx_activations(model: nnx.Module, *args: Any,
                    reduce: Callable[[jax.Array], Any] | None = None, **kwargs: Any
                    ) -> dict[str, Any]:
    """Every ``nnx.Module``'s ``__call__`` output in ``model(*args, **kwargs)`` (but
    ``nnx.Dropout``'s, its input masked), in the order the calls finished (a layer after
    the layers it calls): ``{path: {"__call__": outputs}}`` for :func:`ordered_leaves`,
    as :func:`linen_activations` gives for linen.

    Paths are the model's graph paths (``"encoder/layers/mlp/fc1"``, list items by
    index), the model's own output is ``""`` (named ``(output)``). ``reduce``: applied
    to each floating output where it is computed (e.g. :func:`array_stats`), so the
    outputs themselves are not kept; the tree holds its results. A layer called inside
    ``nnx.scan`` or ``nnx.vmap`` over stacked layers gets its results stacked on axis 0
    (name the stacked component in :func:`reduced_stats`' or the :class:`Collector`'s
    ``scanned`` to get a row per layer: ``encoder/layers/3/mlp/fc1``).

    The call runs on ``nnx.clone(model)``, each module's class swapped there for a
    subclass that sows its output (collected with ``nnx.capture``): the model itself is
    left as it was, its state (batch statistics, RNG counts) not advanced.

    Raises:
      TypeError: ``model`` is not an ``nnx.Module``.
      ValueError: a module broadcast into ``nnx.vmap`` (``in_axes=None``) is called
        inside it, so its output cannot leave the transform; the message gives the fix,
        ``nnx.StateAxes({nnx.Intermediate: 0, ...: None})``. Broadcast into ``nnx.scan``,
        its output is dropped by the scan: a warning names the layers left without rows.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> class Net(nnx.Module):
      ...     def __init__(self, rngs):
      ...         self.a, self.b = nnx.Linear(2, 1, rngs=rngs), nnx.Linear(3, 2, rngs=rngs)
      ...     def __call__(self, x):  # "b" runs first
      ...         return self.a(self.b(x))
      >>> model = Net(nnx.Rngs(0))
      >>> [n for n, _ in ordered_leaves(nnx_activations(model, jnp.ones((1, 3))))]
      ['b', 'a', '(output)']
      >>> out = nnx_activations(model, jnp.ones((1, 3)), reduce=array_stats)
      >>> [(n, s.amax.shape) for n, s in ordered_leaves(out)][0]
      ('b', (1,))
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"nnx_activations expects an nnx.Module, got {type(model).__name__}: "
                        "use linen_activations for a linen model's apply.")
    keep = reduce if reduce is not None else (lambda x: x)
    floating = lambda x: hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)
    capturing = _Capturing(
        lambda y: jax.tree_util.tree_map(lambda x: keep(x) if floating(x) else None, y), [])
    copy = nnx.clone(model)  # new Variables, the same arrays: nothing of model changes
    for path, module in list(iter_modules(copy)):
        if _has_call(type(module)) and not isinstance(module, nnx.Dropout):
            object.__setattr__(module, "__class__", _capturing_class(type(module), path))
    token = _CAPTURING.set(capturing)
    try:
        _, sown = nnx.capture(lambda m: m(*args, **kwargs), _LayerOutput)(copy)
    except ValueError as e:
        if "__captures__" not in str(e):
            raise
        raise ValueError(f"nnx_activations cannot carry a layer's output out of an NNX "
                         f"transform: {_BROADCAST}") from e
    finally:
        _CAPTURING.reset(token)
    out, lost = {}, []
    for path in capturing.order:
        node = sown
        for part in path:
            node = node[part] if isinstance(node, Mapping) and part in node else None
        if isinstance(node, Mapping) and "__call__" in node:
            out["/".join(map(str, path))] = {"__call__": node["__call__"].get_value()}
        else:
            lost.append("/".join(map(str, path)))
    if lost:
        warnings.warn(f"nnx_activations: the outputs of {', '.join(lost)} were computed "
                      f"inside a transform that drops their state, so they have no rows: "
                      f"{_BROADCAST}", stacklevel=2)
    return out


_BROADCAST = ("a module passed to nnx.vmap or nnx.scan with in_axes=None (broadcast) is called "
              "inside it. Pass it with in_axes=nnx.StateAxes({nnx.Intermediate: 0, ...: None}) "
              "(its parameters stay broadcast, its outputs are stacked), or collect "
              "statistics without 'activations'.")
