"""Data parallelism with the gradient all-reduce in each parameter's own dtype.

Under plain ``jax.jit`` the SPMD partitioner inserts the gradient all-reduce
where the batch contraction happens. In mixed precision that is the
half-precision matmul of the backward pass, *before* the cast back to the
float32 parameter dtype, so float32 parameters get gradients summed across
devices in float16 (jax-ml/jax#27496; jamp's tests read the all-reduce dtypes
out of the compiled HLO). :func:`value_and_grad` makes the reduction explicit
instead: inside ``jax.shard_map`` manual over the 'data' axis every shard
differentiates its own part of the batch, and the parameters are marked
varying over 'data' (``jax.lax.pcast(..., to='varying')``) *in their storage
dtype*, so the transpose of that cast, a ``psum``, sums float32 gradients of
float32 parameters (one fused all-reduce per step). Half-precision parameters
(``fp16_naive``, ``fp16_pure``, ``bf16_pure``) are marked varying as float32
copies, so their gradients are all-reduced in float32 too and cast back to the
parameter's dtype (float32 accumulation, :mod:`jamp.accumulate`), and so are
half-precision losses and aux values (bfloat16 would not even compile on
XLA:CPU: its AllReducePromotion pass aborts on a bfloat16 all-reduce inside a
partly manual ``shard_map``: "Invalid binary instruction opcode copy"). Each
shard differentiates its *share* of the global mean loss (its local mean
divided by the number of shards), so every example's cotangent is the one a
single device would compute and the half-precision weight-gradient sums cover
only the shard's examples: a sum that overflows float16 on one device usually
fits per shard, and the float32 all-reduce completes it (so the loss scale
backs off less often than on one device; it can differ when partial sums
cancel).

Only 'data' is manual: the other mesh axes ('model', 'pipe') stay automatic,
so tensor-parallel layers and the pipeline inside the model work unchanged.

A 'data' axis of size 1 (a tensor-parallel-only mesh, say) has one shard and
nothing to reduce: the loss is differentiated on the whole batch under plain
automatic partitioning, with no ``shard_map``. (JAX lowers a ``shard_map``
whose manual axes all have size 1 without its manual region, but keeps the
collectives over them; with another mesh axis larger than 1, XLA's SPMD
partitioner then refuses that all-reduce: "Cross-partition allreduce must be
in (partial) manual partitioning mode".) :func:`shard_index` is the shard's
index in both cases.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jamp.parallel import make_mesh, data_parallel
  >>> def loss(w, batch):
  ...     err = batch["x"] @ w - batch["y"]
  ...     return jnp.mean(err ** 2), {"err": jnp.mean(err)}
  >>> batch = {"x": jnp.ones((8, 2)), "y": jnp.zeros(8)}
  >>> with jax.set_mesh(make_mesh({"data": -1, "model": 1, "pipe": 1})):
  ...     (value, aux), grads = data_parallel.value_and_grad(loss)(jnp.ones(2), batch)
  >>> float(value), grads.tolist()
  (4.0, [4.0, 4.0])
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jamp import grad_accum
from jamp.parallel import pipeline, zero

DATA = zero.DATA
"""The mesh axis the batch is split over."""


def manual_rules(rules: Any, manual_axes: set[str]) -> tuple[tuple[str, Any], ...]:
    """Logical axis rules with the ``manual_axes`` mesh axes replaced by None.

    Inside ``jax.shard_map`` a manual axis cannot appear in a sharding
    constraint; activations are already split over it.

    Example:
      >>> from jamp.parallel.data_parallel import manual_rules
      >>> manual_rules((("batch", "data"), ("mlp", "model")), {"data"})
      (('batch', None), ('mlp', 'model'))
    """

    def strip(target):
        if isinstance(target, (tuple, list)):
            kept = tuple(a for a in target if a not in manual_axes)
            return kept or None
        return None if target in manual_axes else target

    return tuple((name, strip(target)) for name, target in rules)


def shard_index(axis_name: str = DATA) -> jax.Array | int:
    """This shard's index along ``axis_name`` inside :func:`value_and_grad`'s ``fun``.

    ``jax.lax.axis_index`` where the axis is manual (a ``shard_map`` over it);
    0 where it is not, i.e. the axis has one device and ``fun`` runs on the
    whole batch (or no mesh is set).

    Example:
      >>> import jax
      >>> from jamp.parallel import make_mesh
      >>> from jamp.parallel.data_parallel import shard_index
      >>> with jax.set_mesh(make_mesh({"data": 1, "model": 1, "pipe": 1})):
      ...     shard_index()
      0
    """
    if axis_name in jax.sharding.get_abstract_mesh().manual_axes:
        return jax.lax.axis_index(axis_name)
    if _axis_size(axis_name) != 1:
        raise ValueError(f"shard_index({axis_name!r}) outside a shard_map manual over "
                         f"{axis_name!r}, whose size is {_axis_size(axis_name)}.")
    return 0


def _axis_size(axis_name: str) -> int:
    """The size of the current mesh's ``axis_name`` (1 without a mesh or that axis)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else dict(mesh.shape).get(axis_name, 1)


def _half(x: jax.Array) -> bool:
    """A half-precision value: all-reduced in float32 (float32 accumulation; XLA:CPU cannot
    all-reduce bfloat16 in a partly manual ``shard_map`` at all, module docstring)."""
    return x.dtype in (jnp.float16, jnp.bfloat16)


def _mark_varying(params: Any, axis_name: str) -> Any:
    """``params`` marked varying over ``axis_name``: the transpose is the gradient psum."""

    def one(p):
        if _half(p):  # the psum in float32, the gradient in the parameter's dtype
            return jax.lax.pcast(p.astype(jnp.float32), axis_name, to="varying").astype(p.dtype)
        return jax.lax.pcast(p, axis_name, to="varying")

    return jax.tree_util.tree_map(one, params)


def _reduce(reduce: Callable, tree: Any, axis_name: str) -> Any:
    """``reduce(leaf, axis_name)`` per leaf; half-precision leaves in float32."""

    def one(x):
        if _half(x):
            return reduce(x.astype(jnp.float32), axis_name).astype(x.dtype)
        return reduce(x, axis_name)

    return jax.tree_util.tree_map(one, tree)


def _restrict(spec: P, axes: set[str], data_axis: str) -> P:
    """``spec`` with only the mesh axes in ``axes`` (the others stay automatic)."""

    def one(entry):
        names = entry if isinstance(entry, (tuple, list)) else (entry,)
        if data_axis in names:
            raise ValueError(
                f"A parameter sharded over {data_axis!r} ({spec}) cannot be replicated "
                "across the data-parallel shards; map no parameter axis to it.")
        kept = tuple(n for n in names if n in axes)
        return kept[0] if len(kept) == 1 else (kept or None)

    return P(*(one(e) for e in spec))


def value_and_grad(
    fun: Callable[..., tuple[jax.Array, Any]],
    *,
    axis_name: str = DATA,
    manual_axes: tuple[str, ...] = (),
    param_specs: Any = None,
    plan: zero.Plan | None = None,
    accumulate: int = 1,
    max_leaves: Any = None,
) -> Callable[..., tuple[tuple[jax.Array, Any], Any]]:
    """``jax.value_and_grad(fun, has_aux=True)`` for a batch split over ``axis_name``.

    ``fun(params, batch, *args) -> (value, aux)`` must return the *mean* over the
    examples it is given of the loss and of every ``aux`` leaf (scalars): each
    shard evaluates it on its slice of ``batch`` and the results are averaged
    across shards, the gradients with one ``psum`` in float32 (cast back to each
    parameter's dtype).
    ``args`` (e.g. a dropout key) are the same on every shard. Runs under a mesh
    (``jax.set_mesh``) that has ``axis_name``; Flax logical constraints inside
    ``fun`` keep working (manual axes are dropped from the rules in force).
    When ``axis_name`` and ``manual_axes`` all have size 1 there is one shard:
    ``fun`` is differentiated on the whole batch under automatic partitioning
    and no axis is bound inside it (take the shard's index from
    :func:`shard_index`, not ``jax.lax.axis_index``).

    Args:
      fun: the loss function, differentiated w.r.t. its first argument.
      axis_name: the mesh axis ``batch`` (every leaf's leading axis) is split over.
      manual_axes: further mesh axes that are manual inside ``fun`` (e.g.
        ``("pipe",)``: the pipeline then runs in place, as JAX cannot
        differentiate a ``shard_map`` nested in this one). Parameters are split
        over them as ``param_specs`` say; the batch is replicated over them.
      param_specs: the parameters' mesh ``PartitionSpec`` pytree (e.g. from the
        logical axis rules); only its ``manual_axes`` entries are used.
      plan: a ZeRO stage (:class:`jamp.parallel.zero.Plan`). Stage 2 returns each
        gradient reduce-scattered in float32 over ``axis_name`` along
        ``plan.dims``; stage 3 also takes each parameter split there (this shard's
        block), gathers it in its ``plan.read_dtypes`` entry before ``fun`` runs
        (or, under ``plan.per_layer``, inside the model's
        :class:`~jamp.parallel.zero.GatherPerLayer` runner) and returns its
        gradient split the same way. Stages 0 and 1 change nothing here.
      accumulate: micro-batches per step (gradient accumulation, :mod:`jamp.grad_accum`).
        Each shard runs its slice of the batch as ``accumulate`` micro-batches in a
        ``lax.scan``, differentiating a local copy of the parameters (stage 3: the
        leaves gathered once, in their read dtype), sums the gradients in float32, and
        then reduces once per window: one float32 all-reduce, or at stages 2 and 3 one
        float32 reduce-scatter. The price at stage 3 is the whole parameters (read
        dtype) and a float32 gradient accumulator on each device for the window.
      max_leaves: a prefix tree of bools over the differentiated tree: leaves whose
        "gradients" combine over micro-batches by max (the fp8 delayed-scaling state,
        reduced over the mesh by its own rule), not summed.

    Returns:
      ``f(params, batch, *args) -> ((value, aux), grads)``; ``grads`` are
      sharded like ``params``.

    Raises:
      ValueError: ``manual_axes`` without ``param_specs``.

    Example: see the module docstring.
    """
    manual = {axis_name, *manual_axes}
    if manual_axes and param_specs is None:
        raise ValueError(f"manual_axes={manual_axes} needs the parameters' param_specs.")
    stage = 0 if plan is None else plan.stage
    accumulate = grad_accum.check_steps(accumulate)

    def local(params, batch, *args):
        if accumulate > 1:
            return _accumulated(fun, params, batch, args, axis_name=axis_name, manual=manual,
                                plan=plan, steps=accumulate, max_leaves=max_leaves)
        rules = manual_rules(nn.get_logical_axis_rules(), manual)
        shards = jax.lax.axis_size(axis_name)
        dims = _leafwise(plan.dims if stage >= 2 else None, params)
        dtypes = _leafwise(plan.read_dtypes if stage == 3 else None, params)
        later = zero.subtree(plan.dims, plan.per_layer) if stage == 3 else None

        def shard_loss(p):
            if stage < 2:  # the psum that transposes this cast runs in float32
                p = _mark_varying(p, axis_name)
            elif stage == 2:  # replicated leaves (and e.g. the fp8 state) as at stage 0
                p = _map(lambda x, d: _mark_varying(x, axis_name) if d is None else x, p, dims)
            else:  # this shard's blocks: gathered (backward: reduce-scatter)
                p = _gather_blocks(p, dims, dtypes, plan.per_layer, axis_name)
            with nn.logical_axis_rules(rules), _layer_gathers(plan, later, axis_name):
                value, aux = fun(p, batch, *args)
            # This shard's share of the global mean: every example's cotangent, and so
            # every half-precision partial sum, is what one device would compute.
            return value / shards, aux

        if stage == 2:  # differentiate this shard's own copy: no automatic psum
            params = _map(lambda x, d: x if d is None else jax.lax.pcast(
                x, axis_name, to="varying"), params, dims)
        (share, aux), grads = jax.value_and_grad(shard_loss, has_aux=True)(params)
        if stage == 2:
            grads = _reduce_scatter(grads, dims, axis_name)
        return ((_reduce(jax.lax.psum, share, axis_name),
                 _reduce(jax.lax.pmean, aux, axis_name)), grads)

    def wrapped(params, batch, *args):
        if math.prod(_axis_size(a) for a in manual) == 1:
            # One shard: the reductions are the identity, and a shard_map would lower
            # its collectives without a manual region (see the module docstring).
            return grad_accum.value_and_grad(fun, accumulate, max_leaves)(params, batch, *args)
        specs = P()
        if manual_axes:
            specs = jax.tree_util.tree_map(
                lambda s: _restrict(s, set(manual_axes), axis_name), param_specs,
                is_leaf=lambda s: isinstance(s, P))
        param_in, grad_out = specs, specs
        if stage >= 2:
            _check_plan(params, plan, _axis_size(axis_name))
            if not manual_axes:
                specs = jax.tree_util.tree_map(lambda _: P(), params)
            split = jax.tree_util.tree_map(
                lambda s, d, x: zero.with_data(s, d, jnp.ndim(x)), specs,
                _leafwise(plan.dims, params), params, is_leaf=lambda s: isinstance(s, P))
            grad_out = split
            param_in = split if stage == 3 else specs
        return jax.shard_map(
            local, in_specs=(param_in, P(axis_name), *(P() for _ in args)),
            out_specs=((P(), P()), grad_out), axis_names=manual)(params, batch, *args)

    return wrapped


def _accumulated(fun: Callable, params: Any, batch: Any, args: tuple[Any, ...], *,
                 axis_name: str, manual: set[str], plan: zero.Plan | None, steps: int,
                 max_leaves: Any) -> tuple[tuple[jax.Array, Any], Any]:
    """One shard's window of ``steps`` micro-batches (inside the ``shard_map``).

    The model reads a copy of the parameters marked varying over ``axis_name`` outside
    the differentiation, so each micro-batch's gradients stay on this shard; they are
    summed in float32 and reduced once: an all-reduce, or a reduce-scatter along the
    plan's dims at stages 2 and 3. ``max_leaves`` (the fp8 state) are marked varying
    inside instead: their own rule reduces them per micro-batch, and the window keeps
    the max.
    """
    rules = manual_rules(nn.get_logical_axis_rules(), manual)
    stage = 0 if plan is None else plan.stage
    shards = jax.lax.axis_size(axis_name)
    dims = _leafwise(plan.dims if stage >= 2 else None, params)
    dtypes = _leafwise(plan.read_dtypes if stage == 3 else None, params)
    maxed = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params),
                                         grad_accum.flags_per_leaf(max_leaves, params))

    def local_copy(p, d, t, m):
        if m:
            return p
        if stage == 3 and d is not None:  # gathered once for the window, in its read dtype
            p = jax.lax.all_gather(p.astype(p.dtype if t is None else t), axis_name,
                                   axis=d, tiled=True)
        if axis_name not in pipeline.varying_axes(p):
            p = jax.lax.pcast(p, axis_name, to="varying")
        return p

    copies = _map(local_copy, params, dims, dtypes, maxed)

    def share(p, micro, *rest):
        p = _map(lambda x, m: _mark_varying(x, axis_name) if m else x, p, maxed)
        with nn.logical_axis_rules(rules):
            value, aux = fun(p, micro, *rest)
        return value / (shards * steps), aux

    (value, aux), sums = grad_accum.scan(jax.value_and_grad(share, has_aux=True), copies,
                                         batch, args, steps, max_leaves)

    def reduce(g, p, d, m):
        if m:  # already reduced over the mesh by its own rule, combined by max
            return g.astype(p.dtype)
        if stage >= 2 and d is not None:
            return jax.lax.psum_scatter(g, axis_name, scatter_dimension=d,
                                        tiled=True).astype(p.dtype)
        return jax.lax.psum(g, axis_name).astype(p.dtype)

    grads = _map(reduce, sums, params, dims, maxed)
    return ((_reduce(jax.lax.psum, value, axis_name),
             _reduce(jax.lax.pmean, aux, axis_name)), grads)


def _check_plan(params: Any, plan: zero.Plan, data_size: int) -> None:
    """A plan made for other parameters or another mesh: one error naming the fix."""
    for x, d in zip(jax.tree_util.tree_leaves(params),
                    jax.tree_util.tree_leaves(_leafwise(plan.dims, params),
                                              is_leaf=lambda v: v is None), strict=True):
        if d is not None and (d >= jnp.ndim(x) or jnp.shape(x)[d] % data_size):
            raise ValueError(
                f"The ZeRO plan splits a parameter of shape {jnp.shape(x)} on dimension {d}, "
                f"which the mesh's {data_size} 'data' devices cannot split: make the plan "
                "with zero.make_plan(stage, params, mesh) for these parameters and this mesh.")


def _leafwise(tree: Any, like: Any) -> Any:
    """``tree`` (a per-leaf tree of ints/dtypes with None leaves, or None) flattened up to
    ``like``'s structure: a tree like ``like`` whose leaves may be None."""
    treedef = jax.tree_util.tree_structure(like)
    if tree is None:
        return jax.tree_util.tree_unflatten(treedef, [None] * treedef.num_leaves)
    try:
        leaves = treedef.flatten_up_to(tree)
    except (ValueError, TypeError) as e:
        raise ValueError(f"The ZeRO plan's per-leaf tree does not match the parameters: {e}"
                         ) from None
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _map(f: Callable, tree: Any, *rest: Any) -> Any:
    """``tree_map`` over ``tree``'s leaves with ``rest`` flattened up to it (None leaves)."""
    treedef = jax.tree_util.tree_structure(tree)
    columns = [treedef.flatten_up_to(r) for r in rest]
    leaves = jax.tree_util.tree_leaves(tree)
    return jax.tree_util.tree_unflatten(treedef, [f(*xs) for xs in zip(leaves, *columns,
                                                                         strict=True)])


def _gather_blocks(params: Any, dims: Any, dtypes: Any, per_layer: tuple[Any, ...] | None,
                   axis_name: str) -> Any:
    """Stage 3: every split leaf gathered in its read dtype, except those under
    ``per_layer`` (their runner gathers them layer by layer); replicated leaves marked
    varying in float32 (their gradient is a float32 psum)."""
    later = _per_layer_mask(params, per_layer)

    def one(p, d, t, deferred):
        if d is None:
            return _mark_varying(p, axis_name)
        return p if deferred else zero.gather(p, d, t, axis_name)

    return _map(one, params, dims, dtypes, later)


def _per_layer_mask(params: Any, per_layer: tuple[Any, ...] | None) -> Any:
    """True for the leaves of ``params`` under the ``per_layer`` path."""
    def under(path, _):
        keys = tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path)
        return per_layer is not None and keys[:len(per_layer)] == tuple(per_layer)

    return jax.tree_util.tree_map_with_path(under, params)


@contextlib.contextmanager
def _layer_gathers(plan: zero.Plan | None, dims: Any, axis_name: str):
    """Stage 3 with ``plan.per_layer``: the model's GatherPerLayer gathers those layers."""
    if plan is None or plan.stage != 3 or plan.per_layer is None:
        yield
        return
    layer_dtypes = zero.subtree(plan.read_dtypes, plan.per_layer)
    if dims is None:
        raise ValueError(f"Plan.per_layer={plan.per_layer} names no subtree of Plan.dims.")
    with zero.gathering_layers(dims, layer_dtypes, axis_name):
        yield


def _reduce_scatter(grads: Any, dims: Any, axis_name: str) -> Any:
    """Stage 2: each shard's gradient summed in float32 and split along its dim, cast to
    the gradient's dtype (a replicated leaf's gradient is already summed)."""

    def one(g, d):
        if d is None:  # summed by the transpose of _mark_varying already
            return g
        wide = g.astype(jnp.promote_types(g.dtype, jnp.float32))
        return jax.lax.psum_scatter(wide, axis_name, scatter_dimension=d,
                                    tiled=True).astype(g.dtype)

    return _map(one, grads, dims)
