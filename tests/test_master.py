import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jamp


def test_master_copy_is_f32_and_keeps_increments_pure_f16_loses():
    params = {"w": jnp.ones((4,), jnp.float16)}
    grads = {"w": jnp.ones((4,), jnp.float16)}
    tx = jamp.master_weights(optax.sgd(1e-4))
    state = tx.init(params)
    assert jamp.master_params(state)["w"].dtype == jnp.float32
    pure_tx = optax.sgd(1e-4)
    pure_state, pure = pure_tx.init(params), params
    for _ in range(100):
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        pure_updates, pure_state = pure_tx.update(grads, pure_state, pure)
        pure = optax.apply_updates(pure, pure_updates)
    np.testing.assert_allclose(jamp.master_params(state)["w"], 1 - 100 * 1e-4, rtol=1e-5)
    np.testing.assert_array_equal(pure["w"], 1.0)  # every 1e-4 step rounds away in f16
    # The f16 params are exactly the rounded master weights.
    np.testing.assert_array_equal(params["w"], jamp.master_params(state)["w"].astype(jnp.float16))
    assert params["w"].dtype == jnp.float16


def test_fp16_naive_model_trains_through_master_weights():
    model = jamp.apply_policy(nn.Dense(1), "fp16_naive")
    x = jax.random.normal(jax.random.key(0), (16, 3))
    y = x @ jnp.array([[1.0], [-2.0], [0.5]])
    params = model.init(jax.random.key(1), x)["params"]
    assert params["kernel"].dtype == jnp.float16
    tx = jamp.master_weights(optax.adam(5e-2))
    state = tx.init(params)

    def loss_fn(p):
        return jnp.mean((model.apply({"params": p}, x) - y) ** 2)

    @jax.jit
    def step(params, state):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        assert grads["kernel"].dtype == jnp.float16  # backward ran on the f16 params
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    first = None
    for _ in range(200):
        params, state, loss = step(params, state)
        first = loss if first is None else first
    assert float(loss) < 0.01 * float(first)
    master = jamp.master_params(state)
    assert master["kernel"].dtype == jnp.float32
    np.testing.assert_array_equal(params["kernel"], master["kernel"].astype(jnp.float16))


def test_errors():
    tx = jamp.master_weights(optax.sgd(0.1))
    state = tx.init({"w": jnp.ones(2, jnp.float16)})
    with pytest.raises(ValueError, match="needs the current params"):
        tx.update({"w": jnp.ones(2, jnp.float16)}, state)
    with pytest.raises(ValueError, match="found 0"):
        jamp.master_params(optax.sgd(0.1).init({"w": jnp.ones(2)}))



def test_the_optimizer_state_is_initialised_on_the_float32_master_copy():
    """Mode fp16_naive: Adam's mu and nu (every floating leaf of the wrapped optimizer's
    state) are float32 like the master copy, not float16 like the parameters, from init on."""
    mp = jamp.mixed_precision("fp16_naive")
    params = {"w": jnp.ones((4, 2), jnp.float16), "b": jnp.zeros((2,), jnp.float16)}
    tx = jamp.make_optimizer(mp, optax.adam(1e-3))
    state = tx.init(params)
    for _ in range(2):
        wrapped = [s for s in jax.tree_util.tree_leaves(
            state, is_leaf=lambda x: isinstance(x, jamp.master.MasterWeightsState))
            if isinstance(s, jamp.master.MasterWeightsState)]
        assert len(wrapped) == 1
        adam = wrapped[0].inner_state[0]
        for moment in (adam.mu, adam.nu):
            assert [str(x.dtype) for x in jax.tree_util.tree_leaves(moment)] == ["float32"] * 2
        floating = [x for x in jax.tree_util.tree_leaves(wrapped[0])
                    if jnp.issubdtype(x.dtype, jnp.floating)]
        assert {str(x.dtype) for x in floating} == {"float32"}
        grads = jax.tree_util.tree_map(lambda p: jnp.full_like(p, 0.5), params)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    assert params["w"].dtype == jnp.float16 and float(params["w"][0, 0]) < 1.0
