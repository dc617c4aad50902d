"""DynamicLossScale on 8 (fake CPU) devices: an inf in one shard makes every shard skip.

(a) plain ``jax.jit`` over arrays sharded on a ('data', 'model') 2x4 mesh: the
    all-finite reduction is global, no ``axis_names`` needed;
(b) inside ``jax.shard_map`` with ``axis_names=('data', 'model')``: the local
    flag is psum-med, so every shard takes the same decision and holds the same
    scale (and, as a control, without ``axis_names`` the shards disagree).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jamp.loss_scale import DynamicLossScale, loss_scale, overflow_stats

if len(jax.devices()) < 8:  # conftest forces 8 CPU devices
    pytest.skip("needs 8 devices", allow_module_level=True)

SCALE = 2.0**10
# "w" is split over both axes (2x4 blocks of 4x4); "b" over 'model' only.
SPECS = {"w": P("data", "model"), "b": P("model")}


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[:8])


def make_tree(mesh, value, inf_at=None):
    w = jnp.full((8, 16), value, jnp.float32)
    if inf_at is not None:
        w = w.at[inf_at].set(jnp.inf)  # lands in exactly one shard of "w"
    tree = {"w": w, "b": jnp.full((16,), value, jnp.float32)}
    return {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in tree.items()}


def spec_for(x):
    """Partition spec of a params-shaped (or scalar) leaf of the optimizer state."""
    return {2: SPECS["w"], 1: SPECS["b"]}.get(np.ndim(x), P())


def shard_values(x):
    """The distinct values each addressable shard holds (as a sorted list)."""
    return sorted({np.asarray(s.data).tobytes() for s in x.addressable_shards})


def test_plain_jit_global_arrays(mesh):
    params = make_tree(mesh, 1.0)
    tx = DynamicLossScale(optax.adam(1e-2), init_scale=SCALE)
    state = tx.init(params)
    step = jax.jit(tx.update)

    grads = make_tree(mesh, 0.5 * SCALE)
    updates, state = step(grads, state, params)
    assert bool(state.last_finite) and np.all(np.asarray(updates["w"]) != 0)

    before = [np.asarray(x) for x in jax.tree_util.tree_leaves(state.inner_state)]
    bad = make_tree(mesh, 0.5 * SCALE, inf_at=(5, 13))  # shard (data=1, model=3)
    assert sum(np.isinf(np.asarray(s.data)).any() for s in bad["w"].addressable_shards) == 1
    updates, new_state = step(bad, state, params)

    # Every shard of every update is zero; the inner state is untouched everywhere.
    for leaf in jax.tree_util.tree_leaves(updates):
        assert all(not np.asarray(s.data).any() for s in leaf.addressable_shards)
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, SPECS["w"]), 2) or (
            leaf.ndim == 1
        )
    after = [np.asarray(x) for x in jax.tree_util.tree_leaves(new_state.inner_state)]
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    # The scale is replicated and every device holds the same backed-off value.
    scale = new_state.scale
    assert scale.sharding.is_fully_replicated and len(scale.addressable_shards) == 8
    assert shard_values(scale) == [np.float32(SCALE / 2).tobytes()]
    assert int(overflow_stats(new_state).steps_skipped) == 1


def _shard_mapped_step(mesh, tx, check_vma=True):
    """tx.update inside shard_map; also returns each shard's own scale and flag."""
    params = make_tree(mesh, 1.0)
    state = tx.init(params)
    state_specs = jax.tree_util.tree_map(spec_for, state)

    def local(grads, state, params):
        updates, state = tx.update(grads, state, params)
        # Each shard reports its own view, laid out as one element per device.
        view = jnp.stack([loss_scale(state), state.last_finite.astype(jnp.float32)])
        return updates, state, view.reshape(1, 1, 2)

    step = jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(SPECS, state_specs, SPECS),
            out_specs=(SPECS, state_specs, P("data", "model")),
            check_vma=check_vma,
        )
    )
    return step, state, params


def test_shard_map_with_axis_names(mesh):
    tx = DynamicLossScale(optax.adam(1e-2), init_scale=SCALE, axis_names=("data", "model"))
    step, state, params = _shard_mapped_step(mesh, tx)

    updates, state, view = step(make_tree(mesh, 0.5 * SCALE), state, params)
    assert np.all(np.asarray(view)[..., 1] == 1.0) and np.all(np.asarray(updates["w"]) != 0)

    before = [np.asarray(x) for x in jax.tree_util.tree_leaves(state.inner_state)]
    bad = make_tree(mesh, 0.5 * SCALE, inf_at=(0, 2))  # shard (data=0, model=0)
    updates, new_state, view = step(bad, state, params)
    view = np.asarray(view)
    assert view.shape == (2, 4, 2)
    # All 8 shards: same new scale, all saw the overflow, all skipped.
    np.testing.assert_array_equal(view[..., 0], np.full((2, 4), SCALE / 2, np.float32))
    np.testing.assert_array_equal(view[..., 1], np.zeros((2, 4), np.float32))
    assert all(not np.asarray(u).any() for u in jax.tree_util.tree_leaves(updates))
    after = [np.asarray(x) for x in jax.tree_util.tree_leaves(new_state.inner_state)]
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    assert shard_values(new_state.scale) == [np.float32(SCALE / 2).tobytes()]


def test_shard_map_without_axis_names_disagrees(mesh):
    # Control: with a purely local check only the shard holding the inf skips, so the
    # shards end up with different scales. This is why axis_names exists.
    tx = DynamicLossScale(optax.sgd(1.0), init_scale=SCALE)
    step, state, params = _shard_mapped_step(mesh, tx, check_vma=False)
    bad = make_tree(mesh, 0.5 * SCALE, inf_at=(0, 2))
    updates, _, view = step(bad, state, params)
    view = np.asarray(view)
    assert view[0, 0, 1] == 0.0 and view[0, 0, 0] == SCALE / 2
    assert np.sum(view[..., 1] == 1.0) == 7  # the 7 other shards applied their update
    assert np.asarray(updates["w"])[4:, 4:].any()
