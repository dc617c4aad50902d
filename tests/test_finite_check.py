"""The overflow check is exact on any mesh: property tests on the 8 fake CPU devices.

``hypothesis`` draws a mesh (1 to 3 axes whose product is 8, ``Auto`` or
``Explicit`` axis types), a few gradient leaves (float16, bfloat16 or float32;
each dimension split over any subset of the mesh axes, or replicated; even
sizes, or uneven ones that only a sharding constraint inside ``jit`` can give)
and 1 to 4 positions in any leaves. Each layout compiles
``DynamicLossScale(adam).update`` once, then runs it on the finite gradients, on
inf, -inf and NaN alone at each position, and on all positions at once with
mixed kinds (so several bad values in different shards):

- under plain ``jax.jit`` over the global arrays (under ``jax.set_mesh``), and
- inside ``jax.shard_map``, manual over every mesh axis or over the first one
  only (the others stay automatic, like the trainer's 'model' axis), with
  ``axis_names`` set to the manual axes.

With a bad value anywhere, every device must skip exactly: every shard of every
update is zero, every optimizer-state leaf is bit-identical, and all 8 devices
hold the same backed-off scale. Without one, the step is applied and equals
Adam's first update computed on the host. Before the fix a NaN in one shard was applied:
the cross-device part of a sharded ``max`` drops NaN (hypothesis's smallest
counterexample: mesh (8,), a bfloat16 leaf of shape (8,) split over 'data', NaN
at element 0), and ``axis_names`` naming an axis the gradients were not split
over failed inside ``psum``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jamp.loss_scale import DynamicLossScale, all_finite, overflow_stats

if len(jax.devices()) < 8:  # conftest forces 8 CPU devices
    pytest.skip("needs 8 devices", allow_module_level=True)

SCALE, LR = 2.0**10, 1e-2
MESH_SHAPES = [(8,), (4, 2), (2, 4), (1, 8), (8, 1), (2, 2, 2), (2, 1, 4), (1, 4, 2)]
AXES = ("data", "model", "pipe")
DTYPES = {"float16": jnp.float16, "bfloat16": jnp.bfloat16, "float32": jnp.float32}
BAD = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}
PROPERTY = settings(max_examples=10, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@functools.cache
def make_mesh(shape: tuple[int, ...], explicit: bool) -> jax.sharding.Mesh:
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh(shape, AXES[:len(shape)], axis_types=(kind,) * len(shape),
                         devices=jax.devices()[:8])


@st.composite
def layouts(draw, *, even: bool, explicit: bool | None = None):
    """A mesh, leaves with partition specs, shapes and dtypes, and bad values to plant."""
    shape = draw(st.sampled_from(MESH_SHAPES))
    names = AXES[:len(shape)]
    sizes = dict(zip(names, shape, strict=True))
    if explicit is None:
        explicit = draw(st.booleans())
    leaves = []
    for _ in range(draw(st.integers(1, 3))):
        rank = draw(st.integers(1, 2))
        # Each mesh axis splits one dimension of this leaf, or none (replicated over it).
        owner = {a: draw(st.sampled_from([None, *range(rank)])) for a in names}
        spec, dims = [], []
        for d in range(rank):
            axes = tuple(a for a in names if owner[a] == d)
            ways = int(np.prod([sizes[a] for a in axes])) if axes else 1
            size = ways * draw(st.integers(1, 3))
            if not even and ways > 1 and draw(st.booleans()):
                size -= draw(st.integers(1, ways - 1))  # uneven: XLA pads the last shards
            spec.append(axes[0] if len(axes) == 1 else (axes or None))
            dims.append(size)
        leaves.append((P(*spec), tuple(dims), draw(st.sampled_from(sorted(DTYPES)))))
    positions = draw(st.lists(st.tuples(st.integers(0, len(leaves) - 1), st.integers(0, 10**6)),
                              min_size=1, max_size=4))
    mixed = draw(st.lists(st.sampled_from(sorted(BAD)), min_size=len(positions),
                          max_size=len(positions)))
    return shape, explicit, leaves, positions, mixed


def host_trees(leaves, seed=0):
    """Params and finite gradients (numpy), values well inside float16's range."""
    rng = np.random.default_rng(seed)
    params, grads = {}, {}
    for i, (_, dims, dtype) in enumerate(leaves):
        params[f"l{i}"] = rng.uniform(-1, 1, dims).astype(DTYPES[dtype])
        grads[f"l{i}"] = (rng.uniform(-1, 1, dims) * SCALE / 4).astype(DTYPES[dtype])
    return params, grads


def plant(grads, positions, kinds):
    """A copy of ``grads`` with ``kinds[i]`` at ``positions[i]`` (leaf, flat index)."""
    poisoned = {k: v.copy() for k, v in grads.items()}
    for (leaf, position), kind in zip(positions, kinds, strict=True):
        flat = poisoned[f"l{leaf}"].reshape(-1)
        flat[position % flat.size] = BAD[kind]
    return poisoned


def bad_patterns(positions, mixed):
    """Each kind alone at each position, then all positions at once with mixed kinds."""
    singles = [([p], [kind]) for p in positions for kind in sorted(BAD)]
    return [*singles, (positions, mixed)]


def check_every_pattern(step, place, params, grads, state, positions, mixed):
    """The finite step is applied; every bad pattern is skipped exactly by every device."""
    updates, new_state = step(place(grads), state)
    assert_applied(grads, new_state, updates)
    for where, kinds in bad_patterns(positions, mixed):
        updates, new_state = step(place(plant(grads, where, kinds)), state)
        assert_exact_skip(state, updates, new_state)


def shard_bytes(x) -> set[bytes]:
    return {np.asarray(s.data).tobytes() for s in x.addressable_shards}


def assert_exact_skip(state, updates, new_state):
    """Every device skipped: zero updates, inner state unchanged, one backed-off scale."""
    for u in jax.tree_util.tree_leaves(updates):
        for s in u.addressable_shards:
            assert not np.asarray(s.data, np.float32).any()
    before = jax.tree_util.tree_leaves(state.inner_state)
    after = jax.tree_util.tree_leaves(new_state.inner_state)
    for old, new in zip(before, after, strict=True):
        assert np.asarray(old).tobytes() == np.asarray(new).tobytes()
        assert old.dtype == new.dtype
    assert len(new_state.scale.addressable_shards) == 8
    assert shard_bytes(new_state.scale) == {np.float32(SCALE / 2).tobytes()}
    stats = overflow_stats(new_state)
    assert not bool(stats.last_finite) and int(stats.steps_skipped) == 1


def assert_applied(grads, new_state, updates):
    """The step went through: Adam's first update, ``-lr * g / (|g| + eps)`` of ``g / scale``."""
    stats = overflow_stats(new_state)
    assert bool(stats.last_finite) and int(stats.steps_skipped) == 0
    assert shard_bytes(new_state.scale) == {np.float32(SCALE).tobytes()}
    for k, g in grads.items():
        g = g.astype(np.float32) / np.float32(SCALE)
        np.testing.assert_allclose(np.asarray(updates[k], np.float32),
                                   -LR * g / (np.abs(g) + np.float32(1e-8)), rtol=1e-5)


def make_tx(axis_names=()):
    return DynamicLossScale(optax.adam(LR), init_scale=SCALE, growth_interval=1000,
                            axis_names=axis_names)


def check_jit(shape, explicit, leaves, positions, mixed):
    mesh = make_mesh(shape, explicit)
    shardings = {f"l{i}": NamedSharding(mesh, spec) for i, (spec, _, _) in enumerate(leaves)}
    even = all(_divides(mesh, spec, dims) for spec, dims, _ in leaves)
    params, grads = host_trees(leaves)
    tx = make_tx()

    def place(tree):
        return {k: jax.device_put(v, shardings[k] if even else None) for k, v in tree.items()}

    def update(g, state, p):
        if not even:  # only a constraint inside jit can lay out an uneven shape
            g = {k: jax.lax.with_sharding_constraint(v, shardings[k]) for k, v in g.items()}
        return tx.update(g, state, p)

    with jax.set_mesh(mesh):
        p = place(params)
        state = jax.jit(tx.init)(p)
        # Uneven layouts exist only inside jit: hand the results back replicated.
        everywhere = None if even else NamedSharding(mesh, P())
        jitted = jax.jit(update, in_shardings=everywhere, out_shardings=everywhere)
        check_every_pattern(lambda g, s: jitted(g, s, p), place, params, grads, state,
                            positions, mixed)


def _divides(mesh, spec, dims) -> bool:
    for entry, size in zip(spec, dims, strict=False):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
        if size % int(np.prod([mesh.shape[a] for a in axes] or [1])):
            return False
    return True


@PROPERTY
@given(layouts(even=False, explicit=False))
def test_global_jit_auto_axes(layout):
    check_jit(*layout)


@PROPERTY
@given(layouts(even=True, explicit=True))
def test_global_jit_explicit_axes(layout):
    check_jit(*layout)


def _manual_spec(spec: P, manual: tuple[str, ...], rank: int) -> P:
    """``spec`` with only the manual axes (shard_map's in/out specs name no others)."""
    out = []
    for entry in (*spec, *(None,) * (rank - len(spec))):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
        kept = tuple(a for a in axes if a in manual)
        out.append(kept[0] if len(kept) == 1 else (kept or None))
    return P(*out)


@PROPERTY
@given(layouts(even=True, explicit=False), st.booleans())
def test_inside_shard_map(layout, all_manual):
    shape, _, leaves, positions, mixed = layout
    mesh = make_mesh(shape, False)
    manual = mesh.axis_names if all_manual else mesh.axis_names[:1]
    shardings = {f"l{i}": NamedSharding(mesh, spec) for i, (spec, _, _) in enumerate(leaves)}
    specs = {f"l{i}": _manual_spec(spec, manual, len(dims))
             for i, (spec, dims, _) in enumerate(leaves)}
    params, grads = host_trees(leaves)
    tx = make_tx(axis_names=manual)
    p = {k: jax.device_put(v, shardings[k]) for k, v in params.items()}
    state = jax.jit(tx.init)(p)
    def spec_of(path, x: Any) -> P:  # adam's mu/nu are keyed like the params
        key = getattr(path[-1], "key", None) if path else None
        return specs[key] if key in specs and np.ndim(x) > 0 else P()

    state_specs = jax.tree_util.tree_map_with_path(spec_of, state)
    step = jax.jit(jax.shard_map(
        lambda g, s, pp: tx.update(g, s, pp), mesh=mesh,
        in_specs=(specs, state_specs, specs), out_specs=(specs, state_specs),
        axis_names=set(manual)))
    with jax.set_mesh(mesh):
        check_every_pattern(
            lambda g, s: step(g, s, p),
            lambda tree: {k: jax.device_put(v, shardings[k]) for k, v in tree.items()},
            params, grads, state, positions, mixed)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("kind", sorted(BAD))
def test_all_finite_on_a_sharded_leaf(dtype, kind):
    # The smallest form of the bug: one bad element in one shard of a 4x2-split leaf.
    mesh = make_mesh((4, 2), False)
    g = np.ones((8, 8), DTYPES[dtype])
    g[5, 3] = BAD[kind]
    x = jax.device_put(g, NamedSharding(mesh, P("data", "model")))
    assert not bool(jax.jit(all_finite)({"g": x}))
    assert bool(jax.jit(all_finite)({"g": jax.device_put(np.ones((8, 8), DTYPES[dtype]),
                                                           x.sharding)}))

