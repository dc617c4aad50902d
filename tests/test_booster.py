"""``jamp.boost`` (jamp/booster.py): the Booster's one call, on every kind of model.

- the same numbers as a hand-written optax step (fp32: equal; linen, NNX, a plain
  function, Equinox through ``eqx.partition``), on one device and on meshes with ZeRO;
- a non-finite batch skips the step: params, optimizer state, loss-scale counters aside,
  fp8 state and batch statistics stay bit-identical; the scale backs off once;
- where state lives: param dtypes per mode (fp16_naive: float16 params, float32 master),
  ZeRO-3 params and optimizer state split over 'data';
- save/restore: the whole state round-trips and the run continues identically;
- every bad argument: one error naming the fix.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jamp

if len(jax.devices()) < 8:  # conftest forces 8 CPU devices
    pytest.skip("needs 8 devices", allow_module_level=True)

X = jax.random.normal(jax.random.key(1), (16, 8))
Y = jax.random.randint(jax.random.key(2), (16,), 0, 4)
BATCH = (X, Y)


def loss_fn(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()


class BatchNormNet(nn.Module):
    """A linen model with batch statistics and dropout, called with ``train``."""

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.BatchNorm(use_running_average=not train)(nn.Dense(16)(x))
        x = nn.Dropout(0.5, deterministic=not train)(nn.relu(x))
        return nn.Dense(4)(x)


class NNXNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(8, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.l2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.bn(self.l1(x))))


MLP = nn.Sequential([nn.Dense(16), nn.relu, nn.Dense(4)])


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def _bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(tree)]


def _hand_written(params, apply, steps=3, lr=0.05):
    """The loop a user writes with optax alone (fp32)."""
    tx = optax.adam(lr)
    opt_state = tx.init(params)
    for _ in range(steps):
        grads = jax.grad(lambda p: loss_fn(apply(p, X), Y))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params


@pytest.mark.parametrize("mesh,stage,accumulate", [
    (None, 0, 1), (None, 0, 4), ({"data": 8}, 3, 2), ({"data": 4, "model": 2}, 2, 1),
    ({"data": 1, "model": 8}, 0, 2)])
def test_linen_fp32_equals_the_hand_written_step(mesh, stage, accumulate):
    boosted = jamp.boost(MLP, optax.adam(0.05), loss_fn, "fp32", mesh=mesh, zero_stage=stage,
                         accumulate=accumulate)
    state = boosted.init(jax.random.key(0), BATCH)
    start = jax.device_get(state.params)
    for _ in range(3):
        state, metrics = boosted.step(state, BATCH)
    if accumulate > 1:  # the micro-batches run in one loop, each a k-th of the batch
        with jax.set_mesh(boosted.mesh) if boosted.mesh is not None else _nothing():
            jaxpr = str(jax.make_jaxpr(boosted._built["step"])(state, BATCH, jax.random.key(0)))
        assert f"length={accumulate}" in jaxpr
    expected = _hand_written(start, lambda p, x: MLP.apply({"params": p}, x))
    for got, want in zip(jax.tree_util.tree_leaves(state.params),
                         jax.tree_util.tree_leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=1e-6)
    assert not bool(metrics["skipped"]) and float(metrics["loss_scale"]) == 1.0


def test_plain_function_and_equinox_equal_the_hand_written_step():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(8, 4, 16, 1, key=jax.random.key(3))
    params, static = eqx.partition(model, eqx.is_array)
    fn = lambda p, x: jax.vmap(eqx.combine(p, static))(x)
    boosted = jamp.boost(fn, optax.adam(0.05), loss_fn, "fp32", params=params,
                         mesh={"data": 4, "model": 2}, accumulate=2)
    state = boosted.init(jax.random.key(0), BATCH)
    for _ in range(3):
        state, _ = boosted.step(state, BATCH)
    expected = _hand_written(params, fn)
    for got, want in zip(jax.tree_util.tree_leaves(state.params),
                         jax.tree_util.tree_leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=1e-6)


def test_plain_function_runs_under_autocast():
    w = {"w": jnp.ones((8, 4))}
    boosted = jamp.boost(lambda p, x: x @ p["w"], optax.sgd(0.1), loss_fn, "fp16", params=w)
    state = boosted.init(jax.random.key(0), BATCH)
    jaxpr = str(jax.make_jaxpr(lambda s: boosted.model.apply(
        {"params": s.params}, X, True, None, {}))(state))
    assert "dot_general" in jaxpr and "f16[16,4]" in jaxpr  # the matmul runs in float16
    assert state.params["w"].dtype == jnp.float32


@pytest.mark.parametrize("kind", ["linen", "nnx"])
@pytest.mark.parametrize("mesh,stage,accumulate", [(None, 0, 2), ({"data": 4, "model": 2}, 3, 2)])
@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
def test_a_non_finite_batch_skips_everything(kind, mesh, stage, accumulate, bad):
    model = BatchNormNet() if kind == "linen" else NNXNet(nnx.Rngs(0))
    boosted = _boosted(kind, model, mesh, stage, accumulate)
    state = boosted.init(jax.random.key(0), BATCH)
    state, _ = boosted.step(state, BATCH)
    before = jax.device_get(state)
    scale = float(jamp.loss_scale(state.opt_state))
    poisoned = (X.at[5, 3].set(bad), Y)  # one example of one micro-batch
    state, metrics = boosted.step(state, poisoned)
    after = jax.device_get(state)
    assert bool(metrics["skipped"])
    assert _bits(after.params) == _bits(before.params)
    assert _bits(after.model_state) == _bits(before.model_state)
    assert _bits(after.opt_state.inner_state) == _bits(before.opt_state.inner_state)
    assert float(jamp.loss_scale(state.opt_state)) == scale / 2
    assert int(jamp.overflow_stats(state.opt_state).steps_skipped) == 1
    state, metrics = boosted.step(state, BATCH)  # and it trains on
    assert not bool(metrics["skipped"])
    assert _bits(jax.device_get(state.model_state)) != _bits(before.model_state)


_BOOSTED: dict = {}


def _boosted(kind, model, mesh, stage, accumulate):
    """One boost per configuration for the module (the poison enters through the batch)."""
    key = (kind, str(mesh), stage, accumulate)
    if key not in _BOOSTED:
        mp = jamp.mixed_precision("fp16", init_scale=256.0)  # no overflow of its own
        _BOOSTED[key] = jamp.boost(model, optax.adam(1e-2), loss_fn, mp, mesh=mesh,
                                   zero_stage=stage, accumulate=accumulate)
    return _BOOSTED[key]


def test_fp16_naive_keeps_float16_params_and_a_float32_master_split_at_zero_3():
    boosted = jamp.boost(MLP, optax.adam(1e-2), loss_fn, "fp16_naive", mesh={"data": 8},
                         zero_stage=3)
    state = boosted.init(jax.random.key(0), BATCH)
    kernel = state.params["layers_0"]["kernel"]
    assert kernel.dtype == jnp.float16 and "data" in str(kernel.sharding.spec)
    master = jamp.master_params(state.opt_state)["layers_0"]["kernel"]
    assert master.dtype == jnp.float32 and "data" in str(master.sharding.spec)
    assert kernel.addressable_shards[0].data.shape == (8, 2)  # its 16 columns over 8 devices
    state, metrics = boosted.step(state, BATCH)
    assert state.params["layers_0"]["kernel"].dtype == jnp.float16


def test_fp8_state_moves_on_applied_steps_only():
    """A skipped step keeps the fp8 state, except that the gradient amax histories follow
    the loss scale (they are of the scaled gradient: jamp.fp8.follow_loss_scale)."""
    boosted = jamp.boost(MLP, optax.adam(1e-2), loss_fn,
                         jamp.mixed_precision("fp8", loss_scale="dynamic"), accumulate=2)
    state = boosted.init(jax.random.key(0), BATCH)
    state, _ = boosted.step(state, BATCH)
    before = jax.device_get(state.fp8)
    assert any(np.any(np.asarray(x) != 0) for x in jax.tree_util.tree_leaves(before))
    state, metrics = boosted.step(state, (X.at[0, 0].set(jnp.nan), Y))
    assert bool(metrics["skipped"])
    after = jax.device_get(state.fp8)
    for path, old in jax.tree_util.tree_leaves_with_path(before):
        new = np.asarray(_at(after, path))
        if "grad_amax_history" in jax.tree_util.keystr(path):
            np.testing.assert_array_equal(new, np.asarray(old) * np.float32(0.5))
        else:
            assert new.tobytes() == np.asarray(old).tobytes(), jax.tree_util.keystr(path)


def _at(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


def test_metrics_and_eval_step():
    boosted = jamp.boost(BatchNormNet(), optax.adam(1e-2), loss_fn, "bf16",
                         log_num_zeros_in_grad=True)
    state = boosted.init(jax.random.key(0), BATCH)
    state, metrics = boosted.step(state, BATCH)
    assert {"loss", "loss_scale", "skipped", "grad_norm", "num_zeros_in_grad",
            "steps_skipped"} <= set(metrics)
    assert float(metrics["grad_norm"]) > 0
    naive = jamp.mixed_precision(dict(mode=jamp.AMP_TYPE.NAIVE, log_num_zeros_in_grad=True,
                                      initial_scale=2.0**8))
    by_seed_key = jamp.boost(MLP, optax.sgd(0.1), loss_fn, naive)
    _, zeros = by_seed_key.step(by_seed_key.init(jax.random.key(0), BATCH), BATCH)
    assert int(zeros["num_zeros_in_grad"]) >= 0
    first, second = boosted.eval_step(state, BATCH), boosted.eval_step(state, BATCH)
    assert float(first["loss"]) == float(second["loss"])  # no dropout, running averages


def test_save_and_restore_continue_identically(tmp_path):
    boosted = jamp.boost(BatchNormNet(), optax.adam(1e-2), loss_fn, "fp16",
                         mesh={"data": 4, "model": 2}, zero_stage=2)
    state = boosted.init(jax.random.key(0), BATCH)
    state, _ = boosted.step(state, (X.at[0, 0].set(jnp.inf), Y))  # counters move too
    state, _ = boosted.step(state, BATCH)
    boosted.save(tmp_path / "ckpt", state)
    restored = boosted.restore(tmp_path / "ckpt")
    assert _bits(jax.device_get(restored)) == _bits(jax.device_get(state))
    assert restored.params["Dense_0"]["kernel"].sharding == state.params["Dense_0"][
        "kernel"].sharding
    a, _ = boosted.step(state, BATCH)
    b, _ = boosted.step(restored, BATCH)
    assert _bits(jax.device_get(a)) == _bits(jax.device_get(b))


@pytest.mark.parametrize("kwargs,match", [
    (dict(zero_stage=3), "no mesh was given"),
    (dict(zero_stage=4, mesh={"data": -1}), "zero_stage|stage"),
    (dict(accumulate=0), "accumulate=0 must be an int >= 1"),
    (dict(accumulate=2.0), "accumulate=2.0 must be an int"),
    (dict(mesh="data"), "mesh='data'"),
    (dict(mixed_precision="fp17"), "fp17"),
])
def test_bad_arguments_are_one_clear_error(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        jamp.boost(MLP, optax.sgd(0.1), loss_fn, **kwargs)


def test_bad_batches_and_calls_are_one_clear_error(tmp_path):
    boosted = jamp.boost(MLP, optax.sgd(0.1), loss_fn, mesh={"data": 4, "model": 2},
                         accumulate=3)
    with pytest.raises(ValueError, match=r"16 examples cannot be split into 4 'data' shard"):
        boosted.init(jax.random.key(0), BATCH)
    with pytest.raises(ValueError, match="call boosted.init"):
        boosted.restore(tmp_path)
    keyed = jamp.boost(MLP, optax.sgd(0.1), loss_fn, inputs="x", targets="y")
    with pytest.raises(ValueError, match=r"batch\['x'\].*keys \['image', 'label'\]"):
        keyed.init(jax.random.key(0), {"image": X, "label": Y})
    with pytest.raises(TypeError, match="flax.linen.Module, a flax.nnx.Module or a function"):
        jamp.boost(42, optax.sgd(0.1), loss_fn)
    with pytest.raises(ValueError, match="params="):
        jamp.boost(lambda p, x: x, optax.sgd(0.1), loss_fn)
    with pytest.warns(UserWarning, match="'data' axis has 1 device splits nothing"):
        jamp.boost(MLP, optax.sgd(0.1), loss_fn, mesh={"data": 1, "model": 8}, zero_stage=2)
    plain = jamp.boost(MLP, optax.sgd(0.1), loss_fn)
    plain.init(jax.random.key(0), BATCH)
    with pytest.raises(ValueError, match="No checkpoint"):
        plain.restore(tmp_path / "missing")


class RNNClassifier(nn.Module):
    """A third-party-style recurrent model: flax's nn.RNN starts its carry from zeros."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.RNN(nn.LSTMCell(8))(x)[:, -1])


def test_a_recurrent_model_trains_on_one_device_and_says_why_not_on_a_data_mesh():
    sequences = jnp.reshape(X, (16, 4, 2))
    one = jamp.boost(RNNClassifier(), optax.adam(1e-2), loss_fn, "fp16", accumulate=2)
    state = one.init(jax.random.key(0), (sequences, Y))
    state, metrics = one.step(state, (sequences.at[3, 1, 0].set(jnp.nan), Y))
    assert bool(metrics["skipped"])
    state, metrics = one.step(state, (sequences, Y))
    assert not bool(metrics["skipped"])
    sharded = jamp.boost(RNNClassifier(), optax.adam(1e-2), loss_fn, "fp16", mesh={"data": 8})
    state = sharded.init(jax.random.key(0), (sequences, Y))
    with pytest.raises(ValueError, match="initial carry is built from constants"):
        sharded.step(state, (sequences, Y))
