"""The rules and pieces of :mod:`jamp.parallel.zero`, on small functions (the trainer's
ZeRO steps are tested in tests/test_zero.py).

- the split rule (property-based): the largest free dimension the 'data' size divides;
- ``gather``: forward in the read dtype, backward a float32 reduce-scatter, the same
  gradient as autodiff of the unsplit function;
- ``data_parallel.value_and_grad`` with a plan: stages 0-3 give the same value and
  gradients, each stage's gradients split as it says; half-precision parameters'
  gradients summed in float32;
- bad plans fail with one error naming the fix.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from jamp.parallel import data_parallel, make_mesh, zero

if len(jax.devices()) < 8:  # conftest forces 8 CPU devices
    pytest.skip("needs 8 devices", allow_module_level=True)

AXES = (None, "model", "pipe")


def _norm(spec: P) -> tuple:
    """A spec's entries without trailing Nones (P('data') and P('data', None) are one)."""
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(entries)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(shape=st.lists(st.integers(0, 24), min_size=0, max_size=4),
       taken=st.lists(st.sampled_from(AXES), min_size=0, max_size=4),
       data_size=st.sampled_from((1, 2, 3, 4, 8)))
def test_split_dim_is_the_largest_free_dimension_the_data_size_divides(shape, taken, data_size):
    spec = P(*taken[:len(shape)])
    dim = zero.split_dim(tuple(shape), spec, data_size)
    entries = list(spec) + [None] * (len(shape) - len(spec))
    free = [d for d, n in enumerate(shape)
            if entries[d] is None and n >= data_size and n % data_size == 0]
    if data_size == 1 or not free:
        assert dim is None
        return
    assert dim in free
    assert shape[dim] == max(shape[d] for d in free)
    assert dim == min(d for d in free if shape[d] == shape[dim])  # the first of equals
    split = zero.with_data(spec, dim, len(shape))
    assert list(split)[dim] == "data"
    assert _norm(zero.without_data(split)) == _norm(spec)


def test_shardings_split_state_where_the_rule_says_and_keep_other_axes():
    mesh = make_mesh({"data": 4, "model": 2, "pipe": 1})
    tree = {"w": jnp.ones((8, 6)), "tp": jnp.ones((8, 6)), "odd": jnp.ones((3,)), "n": jnp.ones(())}
    specs = {"w": P(), "tp": P("model"), "odd": P(), "n": P()}
    got = {k: _norm(s.spec) for k, s in zero.shardings(tree, mesh, specs).items()}
    assert got == {"w": ("data",), "tp": ("model",), "odd": (), "n": ()}
    # 'tp' has no free dimension 'data' divides (6 % 4): it stays replicated over 'data'.


def _mesh():
    return make_mesh({"data": 4, "model": 2, "pipe": 1})


def _collectives(hlo: str) -> list[tuple[str, str]]:
    """(op, dtype) of every all-gather / reduce-scatter / all-reduce in compiled HLO."""
    found = []
    for line in hlo.splitlines():
        m = re.search(r"=\s*\(?([a-z0-9]+)\[[^=]*?\b(all-gather|reduce-scatter|all-reduce)\(",
                      line)
        if m:
            found.append((m.group(2), m.group(1)))
    return found


def test_gather_reads_half_and_reduces_the_gradient_in_float32():
    mesh = _mesh()
    w = jax.random.normal(jax.random.key(0), (16, 3))
    x = jax.random.normal(jax.random.key(1), (8, 16))

    def whole(w, x):
        return jnp.sum(jnp.tanh(x.astype(jnp.float16) @ w.astype(jnp.float16)).astype(
            jnp.float32) ** 2)

    def split(block, x):
        full = zero.gather(block, 0, jnp.float16)
        return jnp.sum(jnp.tanh(x.astype(jnp.float16) @ full).astype(jnp.float32) ** 2)

    f = jax.jit(jax.shard_map(jax.grad(split), in_specs=(P("data"), P()), out_specs=P("data"),
                              axis_names={"data"}))
    with jax.set_mesh(mesh):
        got = f(w, x)
        hlo = f.lower(w, x).compile().as_text()
    want = jax.grad(whole)(w, x)
    # Every shard sees the whole batch here: the summed gradient is 4 shards' worth.
    np.testing.assert_allclose(np.asarray(got), 4 * np.asarray(want), rtol=2e-3)
    ops = _collectives(hlo)
    assert ("all-gather", "f16") in ops and ("reduce-scatter", "f32") in ops
    assert not [o for o in ops if o[1] in ("f16", "bf16") and o[0] != "all-gather"]
    assert got.dtype == jnp.float32


def _mlp_loss(p, batch):
    h = jnp.tanh(batch["x"].astype(jnp.float16) @ p["w1"].astype(jnp.float16))
    y = (h @ p["w2"].astype(jnp.float16)).astype(jnp.float32) + p["b"]
    value = jnp.mean((y - batch["y"]) ** 2)
    return value, {"value": value}


def _mlp(dtype=jnp.float32):
    k = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(k[0], (16, 32)), "w2": jax.random.normal(k[1], (32, 3)),
              "b": jnp.zeros(3)}
    params = jax.tree_util.tree_map(lambda a: a.astype(dtype), params)
    batch = {"x": jax.random.normal(k[2], (16, 16)), "y": jax.random.normal(k[3], (16, 3))}
    return params, batch


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_every_stage_gives_stage_zeros_value_and_gradients_split_as_it_says(dtype):
    mesh = _mesh()
    params, batch = _mlp(dtype)
    dtypes = {"w1": jnp.float16, "w2": jnp.float16, "b": dtype}
    results = {}
    with jax.set_mesh(mesh):
        for stage in range(4):
            plan = zero.make_plan(stage, params, mesh, read_dtypes=dtypes)
            p = jax.device_put(params, zero.shardings(params, mesh)) if stage == 3 else params
            f = jax.jit(data_parallel.value_and_grad(_mlp_loss, plan=plan))
            (value, _), grads = f(p, batch)
            results[stage] = (value, grads)
            split = {k: "data" in str(g.sharding.spec) for k, g in grads.items()}
            assert split == {"w1": stage >= 2, "w2": stage >= 2, "b": False}, stage
            ops = _collectives(f.lower(p, batch).compile().as_text())
            assert not [o for o in ops if o[1] in ("f16", "bf16") and o[0] != "all-gather"]
            assert (("reduce-scatter", "f32") in ops) == (stage >= 2)
            assert all(g.dtype == dtype for g in jax.tree_util.tree_leaves(grads))
    for stage in (1, 2, 3):
        assert float(results[stage][0]) == float(results[0][0])
        for k in params:
            want = np.asarray(results[0][1][k], np.float32)
            # bfloat16 gradients: stage 3 rounds once, after the float32 sum; the others
            # round each shard's float16 cotangent to bfloat16 first (one ulp apart).
            atol = 0 if dtype == jnp.float32 else 2**-7 * np.max(np.abs(want))
            np.testing.assert_allclose(np.asarray(results[stage][1][k], np.float32), want,
                                       rtol=1e-6 if dtype == jnp.float32 else 2**-7, atol=atol)


def test_a_plan_for_another_mesh_or_stage_is_refused_with_the_fix():
    params, batch = _mlp()
    with pytest.raises(ValueError, match="use 0 .none., 1"):
        zero.make_plan(4, params, _mesh())
    with pytest.raises(ValueError, match="does not exist"):
        zero.Plan(stage=True)
    other = zero.make_plan(2, params, make_mesh({"data": 8}))  # w2's 32 rows split 8 ways
    odd = {**params, "w1": jnp.ones((10, 32))}  # 10 rows: not what the plan was made for
    batch = {**batch, "x": jnp.ones((16, 10))}
    with jax.set_mesh(_mesh()), pytest.raises(ValueError, match="zero.make_plan"):
        jax.jit(data_parallel.value_and_grad(_mlp_loss, plan=zero.Plan(
            2, {**other.dims, "w1": 0})))(odd, batch)


def test_gather_per_layer_outside_a_zero_step_applies_the_layers_as_they_are():
    calls = []

    def inner(apply_layers, variables, x, rng):
        calls.append("inner")
        return apply_layers(variables, x, rng)

    apply_layers = lambda w, x, rng: x * jnp.prod(w)
    w = jnp.arange(1.0, 4.0)
    assert float(zero.GatherPerLayer()(apply_layers, w, jnp.ones(()), None)) == 6.0
    assert float(zero.GatherPerLayer(inner)(apply_layers, w, jnp.ones(()), None)) == 6.0
    assert calls == ["inner"]


def test_gather_per_layer_runs_one_layer_at_a_time_and_names_a_mismatched_plan():
    mesh = _mesh()
    stack = {"w": jax.random.normal(jax.random.key(0), (3, 8, 8))}
    x = jax.random.normal(jax.random.key(1), (4, 8))
    seen = []

    def apply_layers(variables, h, key):
        seen.append(variables["params"]["w"].shape)
        return jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), h, variables["params"]["w"])[0]

    def loss(variables, x, dims):
        with zero.gathering_layers(dims, {"w": jnp.float16}):
            return jnp.sum(zero.GatherPerLayer()(apply_layers, variables, x, None) ** 2)

    def run(dims):
        f = jax.shard_map(jax.grad(lambda v, x: loss(v, x, dims)),
                          in_specs=({"params": {"w": P(None, "data")}}, P()),
                          out_specs={"params": {"w": P(None, "data")}}, axis_names={"data"})
        with jax.set_mesh(mesh):
            return jax.jit(f)({"params": stack}, x)

    grads = run({"w": 1})
    assert seen[0] == (1, 8, 8)  # one whole layer per application
    half = lambda s: jax.tree_util.tree_map(lambda w: w.astype(jnp.float16), s)  # as gathered
    want = jax.grad(lambda s: jnp.sum(apply_layers({"params": half(s)}, x, None) ** 2))(stack)
    # 4 shards, each with the whole batch: 4 equal float16 cotangents summed in float32.
    np.testing.assert_allclose(np.asarray(grads["params"]["w"]), 4 * np.asarray(want["w"]),
                               rtol=1e-6)
    with pytest.raises(ValueError, match="Plan.per_layer"):
        run({"w": 1, "extra": 0})
