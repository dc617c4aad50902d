"""fp8 matmuls (jamp.fp8) and the fp8 state in the train step: dtypes from the jaxprs,
delayed-scaling state against a hand-computed reference, skip/accumulation/mesh/resume."""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jamp
from jamp import fp8
from jamp.parallel import make_mesh
from jamp.parallel import step as parallel_step
from tests.jaxpr_utils import operand_dtypes

E4, E5 = "float8_e4m3fn", "float8_e5m2"
HIST = 4
DELAYED = fp8.Fp8Recipe("delayed", amax_history_length=HIST)
CURRENT = fp8.Fp8Recipe("current")
# Two optimizers for every test, so the jitted step compiles once per (tx, model, batch shape).
TX = jamp.DynamicLossScale(optax.sgd(0.1), init_scale=1.0, min_scale=1.0, divergence_steps=2)
TX_ACC = jamp.DynamicLossScale(optax.MultiSteps(optax.sgd(0.1), 2), init_scale=1.0)


class MLP(nn.Module):
    """A tiny classifier of [B, 4, 4, 1] images, written without dtypes or fp8."""

    @nn.compact
    def __call__(self, x, train=False):
        del train
        x = nn.relu(nn.Dense(16)(x.reshape(x.shape[0], -1)))
        return nn.Dense(3)(x)


def _mode(recipe):
    if recipe is None:
        return jamp.mixed_precision("bf16")
    return jamp.mixed_precision("fp8" if recipe.scaling == "delayed" else "fp8_current",
                                fp8=recipe)


def _batch(seed, n=8):
    x = jax.random.normal(jax.random.key(seed), (n, 4, 4, 1))
    return {"image": x, "label": jnp.arange(n) % 3}


@functools.cache
def _model_and_variables(recipe):
    model = jamp.apply_policy(MLP(), _mode(recipe))  # one per recipe: the jit cache's key
    return model, jax.jit(model.init)(jax.random.key(0), _batch(0)["image"])


def _state(tx, recipe=DELAYED):
    model, v = _model_and_variables(recipe)
    return fp8.TrainState.create(apply_fn=model.apply, params=v["params"], tx=tx,
                                 fp8=v.get(fp8.COLLECTION, {}))


@functools.cache
def _step():
    return jax.jit(jamp.train_step)


def _eq(a, b):
    return all(jax.tree_util.tree_leaves(jax.tree_util.tree_map(
        lambda x, y: bool(jnp.array_equal(x, y)), a, b)))


# --------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("recipe", [DELAYED, CURRENT], ids=["delayed", "current"])
def test_dense_dots_are_e4m3_forward_and_e5m2_backward(recipe):
    state = _state(TX, recipe)
    batch = _batch(1)

    def loss(params):
        variables = {"params": params, **({fp8.COLLECTION: state.fp8} if state.fp8 else {})}
        return state.apply_fn(variables, batch["image"]).sum()

    fwd = operand_dtypes(loss, state.params, primitive="dot_general")
    assert fwd == [(E4, E4)] * 2
    both = operand_dtypes(jax.grad(loss), state.params, primitive="dot_general")
    backward = both[2:]
    assert sorted(both[:2]) == [(E4, E4)] * 2 and len(backward) == 4  # two per Dense
    assert all(E5 in pair and set(pair) <= {E4, E5} for pair in backward), backward


def test_nnx_install_gives_fp8_dots():
    for recipe in (DELAYED, CURRENT):
        layer = nnx.Linear(4, 3, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        einsum = nnx.Einsum("bi,io->bo", (4, 3), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        assert fp8.nnx_install(layer, recipe) and fp8.nnx_install(einsum, recipe)
        assert not fp8.nnx_install(nnx.LayerNorm(4, rngs=nnx.Rngs(0)), recipe)
        for model in (layer, einsum):
            graphdef, state = nnx.split(model)

            def loss(s, graphdef=graphdef):
                return nnx.merge(graphdef, s)(jnp.ones((2, 4))).astype(jnp.float32).sum()

            dots = operand_dtypes(jax.grad(loss), state, primitive="dot_general")
            assert dots[0] == (E4, E4) and all(E5 in d for d in dots[1:]) and len(dots) == 3


def test_nnx_delayed_state_updates_and_skips():
    model = nnx.Linear(4, 3, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    fp8.nnx_install(model, DELAYED)
    loss = lambda m: m(jnp.full((2, 4), 3.0)).astype(jnp.float32).sum()
    grad = nnx.jit(nnx.grad(loss, argnums=nnx.DiffState(0, fp8.PARAMS_AND_META)))
    fp8.nnx_commit(model, grad(model), applied=jnp.bool_(False))
    assert float(model.dot_general.input_amax_history[0]) == 0.0
    param_grads = fp8.nnx_commit(model, grad(model))
    assert float(model.dot_general.input_amax_history[0]) == 3.0
    assert not jax.tree_util.tree_leaves(nnx.filter_state(param_grads, fp8.Fp8Meta))


# --------------------------------------------------------------------------- reference


def _reference(amaxes, fp8_max=448.0, length=HIST):
    """Delayed scaling by hand: the scale of step t from the history before t."""
    hist, scale, out = np.zeros(length, np.float32), np.float32(1.0), []
    for amax in amaxes:
        top = hist.max()
        scale = np.float32(top / np.float32(fp8_max)) if top > 0 else scale
        hist = np.roll(hist, -1)
        hist[0] = amax
        out.append((scale, hist.copy()))
    return out


def test_delayed_state_follows_reference():
    state = _state(TX)
    states, inputs, kernels = [state], [], []
    for t in range(HIST + 2):  # past the history length: the oldest amax drops out
        batch = _batch(10 + t)
        batch["image"] = batch["image"] * (1 + 3 * (t == 1))  # one large step, later forgotten
        inputs.append(float(jnp.abs(batch["image"].astype(jnp.bfloat16)).max()))
        kernels.append(float(jnp.abs(state.params["Dense_0"]["kernel"].astype(jnp.bfloat16)).max()))
        state, _ = _step()(state, batch, jax.random.key(t))
        states.append(state)
    meta = lambda s: s.fp8["Dense_0"]["Fp8DirectDotGeneralOp_0"]
    for t, (scale, hist) in enumerate(_reference(inputs)):
        np.testing.assert_allclose(meta(states[t + 1])["input_scale"], [scale], rtol=1e-6)
        np.testing.assert_array_equal(meta(states[t + 1])["input_amax_history"], hist)
    for t, (scale, hist) in enumerate(_reference(kernels)):
        np.testing.assert_allclose(meta(states[t + 1])["kernel_scale"], [scale], rtol=1e-6)
        np.testing.assert_array_equal(meta(states[t + 1])["kernel_amax_history"], hist)
    grads = [float(meta(s)["output_grad_amax_history"][0]) for s in states[1:]]
    for t, (scale, hist) in enumerate(_reference(grads, fp8_max=57344.0)):  # E5M2
        np.testing.assert_allclose(meta(states[t + 1])["output_grad_scale"], [scale], rtol=1e-6)
        np.testing.assert_array_equal(meta(states[t + 1])["output_grad_amax_history"], hist)
    # the large step's amax is in the history for HIST steps, then forgotten
    assert float(meta(states[-1])["input_amax_history"].max()) < inputs[1]


def test_fp8_close_to_bf16():
    batch = _batch(3)
    losses = {}
    for name, recipe in (("bf16", None), ("delayed", DELAYED), ("current", CURRENT)):
        state = _state(TX, recipe)
        for t in range(4):
            state, metrics = _step()(state, batch, jax.random.key(t))
        losses[name] = float(metrics["loss"])
    assert abs(losses["delayed"] - losses["bf16"]) < 0.05 * losses["bf16"], losses
    assert abs(losses["current"] - losses["bf16"]) < 0.05 * losses["bf16"], losses


# --------------------------------------------------------------------------- interactions


def _poisoned(seed):
    batch = _batch(seed)
    # NaN, not inf: quantizing clips an inf to the fp8 max, a NaN stays NaN
    batch["image"] = batch["image"].at[0, 0, 0, 0].set(jnp.nan)
    return batch


@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
@pytest.mark.parametrize("where", ["input", "gradient"])
@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_fp8_matmul_passes_a_non_finite_value_on_as_nan(bad, where, scaling):
    # Saturating an inf to the fp8 max would hide the overflow from the loss scale.
    if scaling == "current":
        dot = fp8.current_scaling_dot_general
    else:
        dot = lambda a, b, dims: fp8.delayed_scaling_dot_general(a, b, dims, fp8.init_meta(4))
    x, w = jnp.ones((2, 3), jnp.bfloat16), jnp.ones((3, 4), jnp.bfloat16)
    g = jnp.ones((2, 4), jnp.bfloat16)
    if where == "input":
        x = x.at[1, 2].set(bad)
    else:
        g = g.at[0, 1].set(bad)
    dims = (((1,), (0,)), ((), ()))
    y, vjp = jax.vjp(lambda a, b: dot(a, b, dims), x, w)
    dx, dw = vjp(g)
    assert not np.isfinite(np.asarray(dw, np.float32)).all()
    if where == "input":
        assert not np.isfinite(np.asarray(y, np.float32)).all()
    else:
        assert np.isfinite(np.asarray(y, np.float32)).all()
        assert not np.isfinite(np.asarray(dx, np.float32)).all()


def test_skipped_step_keeps_fp8_state():
    state, _ = _step()(_state(TX), _batch(1), jax.random.key(0))
    skipped, metrics = _step()(state, _poisoned(2), jax.random.key(1))
    assert not bool(metrics["grad_finite"])
    assert _eq(skipped.fp8, state.fp8) and _eq(skipped.fp8_pending, state.fp8_pending)
    assert _eq(skipped.params, state.params)
    after, _ = _step()(skipped, _batch(3), jax.random.key(2))
    assert not _eq(after.fp8, state.fp8)
    meta = after.fp8["Dense_0"]["Fp8DirectDotGeneralOp_0"]["input_amax_history"]
    assert np.isfinite(np.asarray(meta)).all()


def test_diverged_steps_keep_fp8_state():
    state, _ = _step()(_state(TX), _batch(1), jax.random.key(0))
    start = state
    for t in range(3):
        state, metrics = _step()(state, _poisoned(5 + t), jax.random.key(t))
    assert bool(metrics["diverged"])
    with pytest.raises(jamp.LossScaleDivergedError):
        jamp.check_divergence(state.opt_state)
    assert _eq(state.fp8, start.fp8) and _eq(state.fp8_pending, start.fp8_pending)


def test_accumulation_combines_amax_by_max():
    start, one = _state(TX_ACC), _state(TX)
    b1, b2 = _batch(21), _batch(22)
    b2["image"] = b2["image"] * 3  # micro-batch 2 holds the larger input amax
    mid, _ = _step()(start, b1, jax.random.key(0))
    assert _eq(mid.fp8, start.fp8)  # the window's micro-batches read the same state
    end, _ = _step()(mid, b2, jax.random.key(1))
    alone = [_step()(one, b, jax.random.key(0))[0].fp8 for b in (b1, b2)]
    expected = jax.tree_util.tree_map(jnp.maximum, *alone)
    assert _eq(end.fp8, expected)
    # forward amaxes equal one step on the whole batch (one window == one big step)
    whole = {k: jnp.concatenate([b1[k], b2[k]]) for k in b1}
    big, _ = _step()(one, whole, jax.random.key(0))
    for layer in ("Dense_0", "Dense_1"):
        for name in ("input_amax_history", "kernel_amax_history", "input_scale"):
            got = end.fp8[layer]["Fp8DirectDotGeneralOp_0"][name]
            np.testing.assert_array_equal(got, big.fp8[layer]["Fp8DirectDotGeneralOp_0"][name])


def test_accumulation_skipped_micro_batch_is_not_combined():
    start = _state(TX_ACC)
    b1, b2 = _batch(31), _batch(32)
    s, _ = _step()(start, b1, jax.random.key(0))
    s, m = _step()(s, _poisoned(33), jax.random.key(1))
    assert not bool(m["grad_finite"])
    s, _ = _step()(s, b2, jax.random.key(2))
    clean, _ = _step()(_step()(start, b1, jax.random.key(0))[0], b2, jax.random.key(2))
    assert _eq(s.fp8, clean.fp8)


def test_checkpoint_resumes_exactly(tmp_path):
    state = _state(TX_ACC)
    for t in range(3):  # stop inside an accumulation window: fp8_pending differs from fp8
        state, _ = _step()(state, _batch(40 + t), jax.random.key(t))
    assert not _eq(state.fp8, state.fp8_pending)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", state)
        ckpt.wait_until_finished()
        restored = ckpt.restore(tmp_path / "ckpt",
                                jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, state))
    assert _eq(restored.fp8, state.fp8) and _eq(restored.fp8_pending, state.fp8_pending)
    a, _ = _step()(state, _batch(50), jax.random.key(9))
    b, _ = _step()(restored, _batch(50), jax.random.key(9))
    assert _eq(a.fp8, b.fp8) and _eq(a.params, b.params)


def test_data_parallel_devices_hold_the_same_scales():
    if jax.device_count() < 8:
        pytest.skip("needs the 8 fake CPU devices of conftest.py")
    state = _state(TX)
    batch = _batch(60)
    single, _ = _step()(state, batch, jax.random.key(0))
    mesh = make_mesh({"data": 8, "model": 1, "pipe": 1})
    with jax.set_mesh(mesh):
        sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))
        step = jax.jit(functools.partial(jamp.train_step,
                                         value_and_grad=parallel_step.value_and_grad()))
        dp, _ = step(state, sharded, jax.random.key(0))
    for got, want in zip(jax.tree_util.tree_leaves(dp.fp8),
                         jax.tree_util.tree_leaves(single.fp8), strict=True):
        shards = [np.asarray(s.data) for s in got.addressable_shards]
        assert len(shards) == 8 and all(np.array_equal(s, shards[0]) for s in shards)
        np.testing.assert_array_equal(shards[0], want)  # max over shards == whole batch


def test_recipe_errors():
    with pytest.raises(ValueError, match="'delayed' or 'current'"):
        fp8.Fp8Recipe("dynamic")
    with pytest.raises(ValueError, match="amax_history_length"):
        fp8.Fp8Recipe(amax_history_length=0)


def test_commit_keeps_state_of_matmuls_off_the_loss_path():
    state = _state(TX)
    unused = jax.tree_util.tree_map(jnp.zeros_like, state.fp8)  # what grad gives them
    new = fp8.commit(state, unused, state.opt_state, jnp.bool_(True))
    assert _eq(new.fp8, state.fp8)


def test_layer_applied_twice_keeps_the_max_not_the_sum():
    class Twice(nn.Module):
        @nn.compact
        def __call__(self, x, train=False):
            dense = nn.Dense(16, dtype=jnp.bfloat16,
                             dot_general_cls=fp8.linen_dot_general_cls(DELAYED))
            return dense(4 * dense(x.reshape(x.shape[0], -1))).sum(-1, keepdims=True)

    model = Twice()
    x = jnp.ones((2, 4, 4, 1))
    v = jax.jit(model.init)(jax.random.key(0), x)
    state = fp8.TrainState.create(apply_fn=model.apply, params=v["params"], tx=TX,
                                  fp8=v[fp8.COLLECTION])
    state, _ = _step()(state, {"image": x, "label": jnp.zeros(2, jnp.int32)}, jax.random.key(0))
    meta = state.fp8["Dense_0"]["Fp8DirectDotGeneralOp_0"]
    first = float(jnp.abs(jnp.ones((2, 16)) @ v["params"]["Dense_0"]["kernel"]).max())
    assert float(meta["input_scale"][0]) == 1.0  # a sum of two uses would say 2
    np.testing.assert_allclose(meta["input_amax_history"][0], 4 * first, rtol=0.1)


def test_memory_report_counts_fp8_state_and_fp8_residuals():
    batch = _batch(0, n=64)  # activations dominate the saved weights
    reports = {}
    for name, recipe in (("bf16", None), ("current", CURRENT)):
        model, v = _model_and_variables(recipe)
        loss = lambda p, x, model=model: model.apply({"params": p}, x).sum()
        reports[name] = jamp.memory_report(loss, v["params"], batch["image"])
    # E4M3 copies of the matmul operands: 1 byte where bf16 keeps 2 (the first layer also
    # keeps its E4M3 kernel, which bf16 does not need: its input has no gradient)
    assert reports["current"].activation_bytes < 0.8 * reports["bf16"].activation_bytes
    state = _state(TX)
    r = jamp.memory_report(lambda p, x: 0.0 * x.sum(), state.params, batch["image"],
                           model_state=(state.fp8, state.fp8_pending))
    # 2 Dense layers x 2 copies x (3 scales + 3 histories of HIST) float32
    assert r.model_state_bytes == 2 * 2 * (3 + 3 * HIST) * 4
    assert r.total_bytes == 2 * r.params_bytes + r.residual_bytes + r.model_state_bytes


def test_modes_reach_linen_and_nnx_projections_not_attention_nor_overridden_layers():
    class Attn(nn.Module):
        @nn.compact
        def __call__(self, x):
            y = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)(x)
            return nn.Dense(2, name="head")(nn.Dense(8, name="out")(y))

    x = jnp.ones((2, 3, 8))
    bf = ("bfloat16", "bfloat16")
    current = jamp.mixed_precision("fp8_current")
    cases = [(jamp.mixed_precision("fp8"), 5), (current, 5),
             (jamp.mixed_precision("fp8_current", overrides={"out": "p=f32,c=bf16,o=f32"}), 4),
             (jamp.mixed_precision("fp8_current",
                                   fp8=dataclasses.replace(current.fp8, keep_bf16=())), 6)]
    for mp, n_fp8 in cases:
        model = jamp.apply_policy(Attn(), mp)
        v = jax.eval_shape(model.init, jax.random.key(0), x)  # shapes are enough for a jaxpr
        fwd = operand_dtypes(lambda v, model=model: model.apply(v, x).sum(), v,
                             primitive="dot_general")
        # q, k, v, out projections and "out" in fp8; scores and values bf16; the head
        # (keep_bf16) and an overridden layer bf16
        assert sorted(fwd) == sorted([(E4, E4)] * n_fp8 + [bf] * (8 - n_fp8)), fwd
        assert (fp8.COLLECTION in v) == (mp.name == "fp8")

    for mode in jamp.FP8_MODES:
        nnx_model = jamp.apply_policy(
            nnx.MultiHeadAttention(2, 8, qkv_features=8, decode=False, rngs=nnx.Rngs(0)), mode)
        graphdef, state = nnx.split(nnx_model)
        f = lambda s, g=graphdef: nnx.merge(g, s)(x).astype(jnp.float32).sum()
        fwd = operand_dtypes(f, state, primitive="dot_general")
        assert sorted(fwd) == sorted([(E4, E4)] * 4 + [("bfloat16", "bfloat16")] * 2), fwd
        metas = nnx.state(nnx_model, fp8.Fp8Meta)
        assert len(jax.tree_util.tree_leaves(metas)) == (4 * 6 if mode == "fp8" else 0)

    class Classifier(nnx.Module):
        def __init__(self):
            self.body, self.head = (nnx.Linear(4, 4, rngs=nnx.Rngs(0)) for _ in range(2))

    model = jamp.apply_policy(Classifier(), "fp8_current")
    assert model.body.dot_general is fp8.current_scaling_dot_general
    assert model.head.dot_general is jax.lax.dot_general  # keep_bf16: the head


def test_fp8_field_errors():
    with pytest.raises(ValueError, match="fp8 must be None, 'delayed', 'current'"):
        jamp.mixed_precision("bf16", fp8=3)
    with pytest.raises(ValueError, match="'delayed' or 'current'"):
        jamp.mixed_precision("fp8", fp8="sometimes")
    with pytest.raises(ValueError, match="keep_bf16 must be a tuple of layer names"):
        fp8.Fp8Recipe(keep_bf16="head")
    assert jamp.mixed_precision("bf16", fp8="current").fp8 == CURRENT
    assert jamp.mixed_precision("fp8_delayed").name == "fp8"


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return nn.relu(nn.Dense(x.shape[-1])(x)), None


class _Scanned(nn.Module):
    axes: tuple = ("params", fp8.COLLECTION)

    @nn.compact
    def __call__(self, x, train=False):
        x = x.reshape(x.shape[0], -1)
        x = nn.scan(_Block, variable_axes=dict.fromkeys(self.axes, 0),
                    split_rngs={"params": True}, length=3)()(x, None)[0]
        return nn.Dense(3)(x)


def test_scanned_layers_keep_one_state_each_and_missing_collection_is_a_clear_error():
    model = jamp.apply_policy(_Scanned(), _mode(DELAYED))
    batch = _batch(70)
    v = jax.jit(model.init)(jax.random.key(0), batch["image"])
    state = fp8.TrainState.create(apply_fn=model.apply, params=v["params"], tx=TX,
                                  fp8=v[fp8.COLLECTION])
    state, _ = jax.jit(jamp.train_step)(state, batch, jax.random.key(0))
    hist = state.fp8["Scan_Block_0"]["Dense_0"]["Fp8DirectDotGeneralOp_0"]["input_amax_history"]
    assert hist.shape == (3, HIST) and len(set(np.asarray(hist[:, 0]).tolist())) == 3
    with pytest.raises(ValueError, match="collection is missing. Under nn.scan add it"):
        jamp.apply_policy(_Scanned(axes=("params",)), _mode(DELAYED)).init(
            jax.random.key(0), batch["image"])
    with pytest.raises(ValueError, match=r"pass variables\[jamp.fp8.COLLECTION\]"):
        model.apply({"params": v["params"]}, batch["image"])


def test_nnx_step_with_loss_scale_keeps_state_of_skipped_steps():
    mp = jamp.mixed_precision("fp8", loss_scale="dynamic",
                              fp8=fp8.Fp8Recipe("delayed", amax_history_length=HIST))
    model = jamp.apply_policy(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), mp)
    optimizer = nnx.Optimizer(model, jamp.make_optimizer(mp, optax.sgd(0.1)), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x):
        loss = lambda m: jamp.scale_loss(m(x).astype(jnp.float32).mean(), optimizer)
        grads = nnx.grad(loss, argnums=nnx.DiffState(0, fp8.PARAMS_AND_META))(model)
        optimizer.update(model, nnx.filter_state(grads, nnx.Param))
        fp8.nnx_commit(model, grads, jamp.overflow_stats(optimizer).last_finite)

    step(model, optimizer, jnp.full((2, 4), 2.0))
    before = jax.tree_util.tree_map(np.asarray, nnx.state(model, fp8.Fp8Meta))
    step(model, optimizer, jnp.full((2, 4), jnp.nan))
    assert not bool(jamp.overflow_stats(optimizer).last_finite)
    assert _eq(nnx.state(model, fp8.Fp8Meta), before)
    step(model, optimizer, jnp.full((2, 4), 3.0))
    hist = model.dot_general.input_amax_history[...]
    assert hist[0] == 3.0 and hist[-1] == 2.0  # the skipped step left no trace


def test_trainer_keeps_the_fp8_state_per_layer_with_its_history_length():
    from jamp import experiment
    from jamp.config import vit_config

    exp = experiment.build_experiment(vit_config("fp8"))
    abstract, _ = experiment.state_shardings(exp, jax.random.key(0))
    assert isinstance(abstract, fp8.TrainState)
    histories = [leaf.shape for path, leaf in jax.tree_util.tree_leaves_with_path(abstract.fp8)
                 if "amax_history" in jax.tree_util.keystr(path)]
    layers = experiment.model_dims(exp.config)["num_layers"]
    assert histories and all(shape == (layers, 1024) for shape in histories), histories
    assert not isinstance(experiment.state_shardings(
        experiment.build_experiment(vit_config("fp8_current")), jax.random.key(0))[0],
        fp8.TrainState)
    config = vit_config("fp8")
    config.fp8_amax_history_length = 16
    assert experiment.build_experiment(config).precision.fp8.amax_history_length == 16
    config = vit_config("bf16")
    config.fp8_amax_history_length = 16
    with pytest.raises(experiment.ConfigError, match="drop the flag or use --config.mode=fp8"):
        experiment.build_experiment(config)
