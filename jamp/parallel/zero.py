"""ZeRO-1/2/3 (FSDP) over the 'data' mesh axis, with mixed precision and loss scaling.

A ZeRO stage says which per-parameter state each of the ``N`` 'data' shards keeps
only 1/N of (Rajbhandari et al., 2020):

=====  ==================================================  ============================
stage  split over 'data'                                   gradient collective
=====  ==================================================  ============================
0      nothing (plain data parallelism)                    all-reduce, float32
1      optimizer state (AdamW's ``mu``/``nu``, the          all-reduce, float32
       ``fp16_naive`` master copy)
2      ... and the gradients                               reduce-scatter, float32
3      ... and the parameters (FSDP)                       reduce-scatter, float32
=====  ==================================================  ============================

How it runs (:func:`jamp.parallel.data_parallel.value_and_grad` with a :class:`Plan`):

- stages 1 and 2 keep the parameters whole on every shard; the optimizer then runs
  under ``jax.jit`` on state split over 'data', so each device updates its 1/N and
  the partitioner re-assembles the new parameters (one all-gather per leaf);
- stage 2 reduce-scatters each gradient in float32 (``jax.lax.psum_scatter``, never
  an all-reduce and a slice), so a device holds 1/N of it, cast to the parameter's
  dtype;
- stage 3 stores each parameter split over 'data' in its param dtype. Before use it
  is cast to the dtype the model reads it in (float16 for a float16 model's
  kernels, float32 for a norm's scale: :func:`jamp.parallel.read_dtypes.read_dtypes`)
  and *then* all-gathered (:func:`gather`), so the gather moves half the bytes;
  the backward pass of the gather is a float32 reduce-scatter. The stacked layers
  of a scanned model are gathered one layer at a time inside the scan by the
  :class:`GatherPerLayer` layer runner, and re-gathered in the backward pass
  (the gathered copy is not kept as a residual: ``jax.checkpoint`` with a policy
  that saves everything else); the other parameters (embeddings, head) are
  gathered once per step.

The overflow check of the loss scale then runs on the split gradients under
``jax.jit``: one reduction over every shard (NaN counted as inf before any max), so
every device takes the same skip and keeps the same scale, and a skipped step
leaves every shard of every state unchanged.

**Which dimension is split** (:func:`split_dim`): the largest dimension that is
divisible by the 'data' size and that no other mesh axis splits (the first of
equals). A leaf with no such dimension (a scalar, a bias of odd length, a
dimension already split over 'model') stays replicated over 'data'; it is never
padded, so a checkpoint has the same global shapes at every stage and on every
mesh and restores into any of them. ``jamp.memory_report`` counts the replicated
bytes.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jax.sharding import PartitionSpec as P
  >>> from jamp.parallel import zero
  >>> zero.split_dim((768, 3072), P(None, "model"), data_size=8)   # 3072 is 'model''s
  0
  >>> zero.split_dim((3,), P(), data_size=8) is None                # replicated
  True
  >>> zero.with_data(P(None, "model"), 0)
  P('data', 'model')
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jamp.parallel.pipeline import varying_axes

DATA = "data"
"""The mesh axis ZeRO splits state over (the data-parallel axis)."""

STAGES = (0, 1, 2, 3)
"""The ZeRO stages: 0 none, 1 optimizer state, 2 + gradients, 3 + parameters."""

GATHERED = "jamp_zero3_gathered"
"""``jax.checkpoint`` name of a layer's gathered parameters: recomputed (re-gathered) in
the backward pass instead of saved."""


def check_stage(stage: int) -> int:
    """``stage`` if it is a ZeRO stage; a ``ValueError`` naming the choices otherwise.

    Example:
      >>> check_stage(2)
      2
    """
    if isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(f"ZeRO stage {stage!r} does not exist: use 0 (none), 1 (optimizer "
                         "state), 2 (+ gradients) or 3 (+ parameters, FSDP).")
    return int(stage)


def _entries(spec: P, ndim: int) -> tuple[Any, ...]:
    return tuple(spec) + (None,) * (ndim - len(spec))


def split_dim(shape: tuple[int, ...], spec: P, data_size: int) -> int | None:
    """The dimension of a ``shape`` leaf that ZeRO splits over 'data', or None (replicated).

    The largest dimension divisible by ``data_size`` whose ``spec`` entry is None
    (no other mesh axis splits it; a scanned stack's layer axis is named by the
    'pipe' rule, so it is never chosen); the first of equals.

    Example:
      >>> from jax.sharding import PartitionSpec as P
      >>> split_dim((12, 768, 64), P("pipe", None, None), data_size=4)
      1
      >>> split_dim((6,), P(), data_size=4) is None
      True
    """
    if data_size <= 1:
        return None
    best = None
    for d, (n, entry) in enumerate(zip(shape, _entries(spec, len(shape)), strict=True)):
        if entry is None and n >= data_size and n % data_size == 0 and (
                best is None or n > shape[best]):
            best = d
    return best


def with_data(spec: P, dim: int | None, ndim: int | None = None) -> P:
    """``spec`` with dimension ``dim`` split over 'data' (unchanged for None).

    Example:
      >>> from jax.sharding import PartitionSpec as P
      >>> with_data(P("pipe"), 2, ndim=3)
      P('pipe', None, 'data')
    """
    if dim is None:
        return spec
    entries = list(_entries(spec, max(dim + 1, ndim or 0, len(spec))))
    entries[dim] = DATA
    return P(*entries)


def without_data(spec: P) -> P:
    """``spec`` with 'data' taken out (the other mesh axes' splits: stage 0's spec).

    Example:
      >>> from jax.sharding import PartitionSpec as P
      >>> without_data(P("data", "model")), without_data(P(("data", "model"), None))
      (P(None, 'model'), P('model', None))
    """

    def one(entry):
        if isinstance(entry, (tuple, list)):
            kept = tuple(a for a in entry if a != DATA)
            return kept[0] if len(kept) == 1 else (kept or None)
        return None if entry == DATA else entry

    return P(*(one(e) for e in spec))


def split_dims(tree: Any, specs: Any, data_size: int) -> Any:
    """:func:`split_dim` for every leaf of ``tree`` (arrays or ``ShapeDtypeStruct``).

    ``specs`` is a matching pytree of ``PartitionSpec`` (other axes' splits), or None.

    Example:
      >>> import jax.numpy as jnp
      >>> split_dims({"w": jnp.ones((8, 2)), "b": jnp.ones(3)}, None, data_size=4)
      {'b': None, 'w': 0}
    """
    if specs is None:
        specs = jax.tree_util.tree_map(lambda _: P(), tree)
    return jax.tree_util.tree_map(
        lambda x, s: split_dim(tuple(np.shape(x)), s, data_size), tree, specs,
        is_leaf=lambda x: x is None)


def shardings(tree: Any, mesh: jax.sharding.Mesh, specs: Any = None) -> Any:
    """``NamedSharding`` per leaf of ``tree``: split over 'data' where :func:`split_dim` says.

    The library entry point for your own loop: place a parameter or optimizer-state
    pytree with ``jax.device_put(tree, zero.shardings(tree, mesh))`` (or give the
    result to ``jax.jit``'s ``in_shardings``/``out_shardings``).

    Args:
      tree: arrays or ``jax.ShapeDtypeStruct`` (e.g. ``jax.eval_shape(tx.init, params)``).
      mesh: a mesh with a 'data' axis.
      specs: optional matching ``PartitionSpec`` tree of the other axes (tensor or
        pipeline splits); 'data' only goes where they leave a dimension free.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from jamp.parallel import make_mesh, zero
      >>> mesh = make_mesh({"data": 1})
      >>> state = optax.adam(1e-3).init({"w": jnp.ones((4, 2))})
      >>> zero.shardings(state, mesh)[0].mu["w"].spec   # data=1: nothing to split
      P()
    """
    data_size = dict(mesh.shape).get(DATA, 1)
    if specs is None:
        specs = jax.tree_util.tree_map(lambda _: P(), tree)
    return jax.tree_util.tree_map(
        lambda x, s: NamedSharding(mesh, with_data(s, split_dim(tuple(np.shape(x)), s,
                                                                  data_size), np.ndim(x))),
        tree, specs)


def state_shardings(shardings_: Any, abstract: Any, stage: int) -> Any:
    """A train state's shardings at ``stage``: ``opt_state`` split from stage 1, ``params``
    at stage 3; everything else (step, the fp8 state) as given.

    Args:
      shardings_: the state's ``NamedSharding`` tree at stage 0 (a flax ``TrainState``
        of shardings, e.g. from the logical axis rules).
      abstract: the matching state of arrays or ``ShapeDtypeStruct`` (for the shapes).
      stage: the ZeRO stage.

    Example: ``jamp.experiment.state_shardings`` calls it with ``config.zero_stage``.
    """
    stage = check_stage(stage)

    def split(tree_shardings, tree):
        return jax.tree_util.tree_map(
            lambda s, x: NamedSharding(s.mesh, with_data(
                s.spec, split_dim(tuple(x.shape), s.spec, dict(s.mesh.shape).get(DATA, 1)),
                len(x.shape))), tree_shardings, tree)

    if stage >= 1:
        shardings_ = shardings_.replace(opt_state=split(shardings_.opt_state, abstract.opt_state))
    if stage == 3:
        shardings_ = shardings_.replace(params=split(shardings_.params, abstract.params))
    return shardings_


# ------------------------------------------------------------------------- the step's plan


@dataclasses.dataclass(frozen=True)
class Plan:
    """What :func:`jamp.parallel.data_parallel.value_and_grad` does for a ZeRO stage.

    Attributes:
      stage: 0-3.
      dims: per leaf of the differentiated tree, the dimension split over 'data'
        (:func:`split_dims`), None where the leaf is replicated.
      read_dtypes: per leaf, the dtype the model reads it in (stage 3 gathers in it);
        None: each leaf's own dtype.
      per_layer: the path (dict keys) of the subtree :class:`GatherPerLayer` gathers
        layer by layer inside the model (e.g. ``("encoder", "layers")``); None: every
        leaf is gathered when the step starts.
    """

    stage: int
    dims: Any = None
    read_dtypes: Any = None
    per_layer: tuple[Any, ...] | None = None

    def __post_init__(self):
        check_stage(self.stage)


def make_plan(stage: int, params: Any, mesh: jax.sharding.Mesh, specs: Any = None, *,
              read_dtypes: Any = None, per_layer: tuple[Any, ...] | None = None,
              beside: Any = None) -> Plan:
    """The :class:`Plan` of ``stage`` for ``params`` (arrays or ``ShapeDtypeStruct``) on ``mesh``.

    For your own loop: place the parameters with :func:`shardings` (stage 3) and the
    optimizer state with :func:`shardings` (stages 1-3), and differentiate with
    ``jamp.parallel.data_parallel.value_and_grad(loss, plan=plan)`` under ``jax.jit``;
    the optimizer (``jamp.DynamicLossScale`` included) then runs on the split state.

    Args:
      stage: the ZeRO stage.
      params: the parameters.
      mesh: the mesh (its 'data' axis is split over).
      specs: optional ``PartitionSpec`` tree of the other axes' splits.
      read_dtypes: stage 3: the dtype the model reads each leaf in
        (:func:`jamp.parallel.read_dtypes.read_dtypes`); None gathers each leaf
        in its own dtype.
      per_layer: stage 3: the path of stacked layers a :class:`GatherPerLayer`
        runner in the model gathers one at a time.
      beside: variables the step differentiates beside the parameters, as the
        tuple ``(params, beside)`` (the fp8 delayed-scaling state): never split or
        gathered. Empty or None: the plan is for ``params`` alone.

    Example:
      >>> import jax.numpy as jnp
      >>> from jamp.parallel import make_mesh, zero
      >>> plan = zero.make_plan(2, {"w": jnp.ones((4, 2))}, make_mesh({"data": 1}))
      >>> plan.stage, plan.dims
      (2, {'w': None})
      >>> zero.make_plan(2, {"w": jnp.ones(4)}, make_mesh({"data": 1}), beside={"m": 1}).dims
      ({'w': None}, {'m': None})
    """
    dims = split_dims(params, specs, dict(mesh.shape).get(DATA, 1))
    if beside:
        nothing = jax.tree_util.tree_map(lambda _: None, beside)
        dims = (dims, nothing)
        read_dtypes = None if read_dtypes is None else (read_dtypes, nothing)
        per_layer = None if per_layer is None else (0, *per_layer)
    return Plan(check_stage(stage), dims, read_dtypes, per_layer)


def _gatherer(axis_name: str, dim: int, dtype: Any, param_dtype: Any) -> Callable:
    return _gatherer_cached(axis_name, dim, np.dtype(dtype), np.dtype(param_dtype))


@functools.cache
def _gatherer_cached(axis_name: str, dim: int, dtype: np.dtype, param_dtype: np.dtype
                     ) -> Callable:
    @jax.custom_vjp
    def gather_(x):
        return jax.lax.all_gather(x.astype(dtype), axis_name, axis=dim, tiled=True)

    def fwd(x):
        return gather_(x), None

    def bwd(_, cotangent):
        # Every shard's partial gradient, summed in float32 (never in half precision).
        total = jax.lax.psum_scatter(cotangent.astype(jnp.promote_types(cotangent.dtype,
                                                                        jnp.float32)),
                                     axis_name, scatter_dimension=dim, tiled=True)
        return (total.astype(param_dtype),)

    gather_.defvjp(fwd, bwd)
    return gather_


def gather(x: jax.Array, dim: int, dtype: Any = None, axis_name: str = DATA) -> jax.Array:
    """Casts this shard's block ``x`` to ``dtype``, then all-gathers it along ``dim``.

    Inside a ``jax.shard_map`` manual over ``axis_name``. The backward pass
    reduce-scatters the cotangent in float32 and casts it to ``x``'s dtype: the
    half-precision gather moves half the bytes, the gradient sum loses nothing.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from jamp.parallel import make_mesh, zero
      >>> f = jax.shard_map(lambda x: zero.gather(x, 0, jnp.float16), in_specs=P("data"),
      ...                   out_specs=P(), check_vma=False)
      >>> with jax.set_mesh(make_mesh({"data": 1})):
      ...     f(jnp.arange(4.0)).dtype
      dtype('float16')
    """
    if dim is None:
        return x
    dtype = x.dtype if dtype is None else dtype
    return _gatherer(axis_name, dim, dtype, x.dtype)(x)


_ACTIVE: list[tuple[Any, Any, str]] = []  # the per-layer gathers of the step being traced


@contextlib.contextmanager
def gathering_layers(dims: Any, read_dtypes: Any, axis_name: str = DATA) -> Iterator[None]:
    """While tracing the model, :class:`GatherPerLayer` gathers with these per-leaf
    ``[layers, ...]`` dims and dtypes (set by ``data_parallel.value_and_grad``)."""
    _ACTIVE.append((dims, read_dtypes, axis_name))
    try:
        yield
    finally:
        _ACTIVE.pop()


@dataclasses.dataclass(frozen=True)
class GatherPerLayer:
    """A layer runner (:data:`jamp.models.vit.LayerRunner`) that all-gathers one layer at a time.

    Inside a ZeRO-3 step (:func:`jamp.parallel.data_parallel.value_and_grad` with a
    stage-3 :class:`Plan` whose ``per_layer`` names the stacked layers) the stacked
    parameters arrive split over 'data'; this runner scans over the layers and, in
    each iteration, casts the layer's parameters to their read dtype and gathers
    them (:func:`gather`), applies the layer, and lets the gathered copy go: the
    backward pass gathers it again. Anywhere else (initialisation, evaluation under
    plain ``jax.jit``) it applies the layers as they are. ``inner`` composes it with
    another runner (e.g. :class:`jamp.parallel.pipeline.GPipe`: each stage gathers
    its own layers one at a time).

    The dropout key of layer ``i`` is the step's key folded with ``i`` (the plain
    scan splits it): the same distribution, not the same masks as stage 0.

    Example:
      >>> import jax.numpy as jnp
      >>> runner = GatherPerLayer()
      >>> apply_layers = lambda w, x, rng: x * jnp.prod(w)
      >>> float(runner(apply_layers, jnp.arange(1.0, 4.0), jnp.ones(()), None))
      6.0
    """

    inner: Any = None

    def __call__(self, apply_layers: Callable, layer_variables: Any, x: jax.Array,
                 rng: jax.Array | None) -> jax.Array:
        if _ACTIVE:
            dims, dtypes, axis_name = _ACTIVE[-1]
            apply_layers = functools.partial(_apply_per_layer, apply_layers, dims, dtypes,
                                             axis_name)
        if self.inner is None:
            return apply_layers(layer_variables, x, rng)
        return self.inner(apply_layers, layer_variables, x, rng)


def _apply_per_layer(apply_layers: Callable, dims: Any, dtypes: Any, axis_name: str,
                     variables: dict[str, Any], h: jax.Array, key: jax.Array | None
                     ) -> jax.Array:
    """``apply_layers`` one layer at a time, each layer's params gathered just before."""
    params = variables["params"]
    treedef = jax.tree_util.tree_structure(params)
    try:
        dims = treedef.flatten_up_to(dims)
        dtypes = [None] * len(dims) if dtypes is None else treedef.flatten_up_to(dtypes)
    except (ValueError, TypeError) as e:
        raise ValueError("The ZeRO-3 plan's per-layer dims do not match the layer runner's "
                         f"'params' (check Plan.per_layer names the stacked layers): {e}") from None
    length = jax.tree_util.tree_leaves(params)[0].shape[0]
    if axis_name not in varying_axes(h):  # the gathered layers vary over 'data': so will h
        h = jax.lax.pcast(h, axis_name, to="varying")

    def one_layer(carry, xs):
        index, layer = xs
        gathered = jax.tree_util.tree_unflatten(treedef, [
            p if d is None else gather(p, d - 1, t, axis_name)
            for p, d, t in zip(treedef.flatten_up_to(layer["params"]), dims, dtypes,
                               strict=True)])
        gathered = checkpoint_name(gathered, GATHERED)
        # A reshape (its transpose is one too; a broadcast's would sum, and flax's fp8
        # state's dtype has no sum).
        stacked = jax.tree_util.tree_map(lambda v: jnp.reshape(v, (1, *v.shape)),
                                         {**layer, "params": gathered})
        layer_key = None if key is None else jax.random.fold_in(key, index)
        return apply_layers(stacked, carry, layer_key), None

    one_layer = jax.checkpoint(
        one_layer, policy=jax.checkpoint_policies.save_anything_except_these_names(GATHERED))
    h, _ = jax.lax.scan(one_layer, h, (jnp.arange(length), variables))
    return h


def subtree(tree: Any, path: tuple[Any, ...] | None) -> Any:
    """``tree[path[0]][path[1]]...`` (None for a None path or a missing key or index).

    Example:
      >>> subtree({"encoder": {"layers": 1}}, ("encoder", "layers"))
      1
    """
    if path is None:
        return None
    for key in path:
        indexable = isinstance(tree, (tuple, list)) and isinstance(key, int) and key < len(tree)
        if (isinstance(tree, dict) and key in tree) or indexable:
            tree = tree[key]
        else:
            return None
    return tree
