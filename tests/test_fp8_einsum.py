"""fp8 reaches linen ``nn.Einsum`` and the ViT's attention projections (linen and NNX):
dot dtypes from the jaxprs, delayed state per matmul, param trees unchanged."""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jamp
from jamp import fp8
from jamp.models import vit, vit_nnx
from tests.jaxpr_utils import operand_dtypes

E4, E5, BF = "float8_e4m3fn", "float8_e5m2", "bfloat16"
HIST = 4
DELAYED = jamp.mixed_precision("fp8", fp8=fp8.Fp8Recipe("delayed", amax_history_length=HIST))
CURRENT = jamp.mixed_precision("fp8_current")
VIT = dict(num_classes=3, patch_size=4, num_layers=2, hidden_size=8, num_heads=2, mlp_dim=8)
IMAGES = jnp.ones((2, 8, 8, 1))


class Net(nn.Module):
    """An Einsum projection then a Dense "head" (keep_bf16 by default)."""

    @nn.compact
    def __call__(self, x):
        y = nn.Einsum((4, 2, 3), "bi,ihd->bhd", name="proj")(x)
        return nn.Dense(2, name="head")(y.reshape(y.shape[0], -1))


def _linen(module, mp, x):
    model = jamp.apply_policy(module, mp)
    return model, jax.eval_shape(model.init, jax.random.key(0), x)  # shapes: enough for jaxprs


def _dots(model, v, x, grad=False):
    loss = lambda v: model.apply(v, x).astype(jnp.float32).sum()
    return operand_dtypes(jax.grad(loss) if grad else loss, v, primitive="dot_general")


def _shapes(tree):
    return jax.tree_util.tree_map(lambda a: (a.shape, str(a.dtype)), nn.unbox(tree))


# --------------------------------------------------------------------------- linen nn.Einsum


@pytest.mark.parametrize("mp", [DELAYED, CURRENT], ids=["delayed", "current"])
def test_linen_einsum_runs_in_fp8_and_keeps_its_params(mp):
    x = jnp.ones((5, 4))
    model, v = _linen(Net(), mp, x)
    fwd, both = _dots(model, v, x), _dots(model, v, x, grad=True)
    assert fwd == [(E4, E4), (BF, BF)]  # the Einsum in fp8, the head (keep_bf16) in bf16
    einsum_bwd = [d for d in both[2:] if E5 in d]  # E5M2 gradient times an E4M3 operand
    assert len(einsum_bwd) == 2 and all(set(d) == {E4, E5} for d in einsum_bwd), both
    assert _shapes(v["params"]) == _shapes(_linen(Net(), "bf16", x)[1]["params"])
    if mp.name == "fp8":  # one state for the Einsum, under it
        assert list(v[fp8.COLLECTION]) == ["proj"]
        assert v[fp8.COLLECTION]["proj"]["Fp8DirectDotGeneralOp_0"]["input_scale"].shape == (1,)
    else:
        assert fp8.COLLECTION not in v


def test_linen_einsum_keep_bf16_override_and_plain_einsum_equivalence():
    x = jax.random.normal(jax.random.key(1), (5, 4))
    for mp in (dataclasses.replace(CURRENT, fp8=fp8.Fp8Recipe("current", keep_bf16=("proj",))),
               jamp.mixed_precision("fp8_current", overrides={"proj": "p=f32,c=bf16,o=bf16"})):
        model, v = _linen(Net(), mp, x)
        assert _dots(model, v, x)[0] == (BF, BF), mp
    # fp8_current and keep_bf16=("head", "proj"): the Einsum's own call, bit for bit
    plain = jamp.apply_policy(Net(), "bf16")
    v = jax.jit(plain.init)(jax.random.key(0), x)
    both_kept = dataclasses.replace(CURRENT, fp8=fp8.Fp8Recipe("current",
                                                               keep_bf16=("head", "proj")))
    np.testing.assert_array_equal(jax.jit(jamp.apply_policy(Net(), both_kept).apply)(v, x),
                                  jax.jit(plain.apply)(v, x))
    # and linen_einsum with the einsum string given at call time
    out = jamp.apply_policy(nn.Einsum((4, 3)), CURRENT).init_with_output(
        jax.random.key(0), x, "bi,io->bo")[0]
    assert out.shape == (5, 3)
    with pytest.raises(ValueError, match="exactly one comma"):
        jamp.apply_policy(nn.Einsum((4, 3), "bi,io,o->bo"), CURRENT).init(jax.random.key(0), x)


class _EinsumBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return nn.relu(nn.Einsum((x.shape[-1], x.shape[-1]), "bi,io->bo")(x)), None


class _ScannedEinsums(nn.Module):
    @nn.compact
    def __call__(self, x):
        block = nn.remat(_EinsumBlock)
        return nn.scan(block, variable_axes={"params": 0, fp8.COLLECTION: 0},
                       split_rngs={"params": True}, length=3)()(x, None)[0]


def test_linen_einsum_delayed_state_updates_under_scan_and_remat():
    model = jamp.apply_policy(_ScannedEinsums(), DELAYED)
    x = jnp.full((2, 4), 3.0).at[0, 1].set(-5.0)
    v = jax.jit(model.init)(jax.random.key(0), x)
    loss = lambda p, meta: model.apply({"params": p, fp8.COLLECTION: fp8.as_meta(meta)},
                                       x).astype(jnp.float32).sum()
    new = jax.jit(jax.grad(loss, argnums=1))(v["params"], v[fp8.COLLECTION])
    meta = new["ScanCheckpoint_EinsumBlock_0"]["Einsum_0"]["Fp8DirectDotGeneralOp_0"]
    hist = meta["input_amax_history"]
    assert hist.shape == (3, HIST)  # one state per scanned layer, stacked
    assert float(hist[0, 0]) == 5.0 and np.all(np.asarray(hist[:, 1:]) == 0)  # first layer's x
    kernels = nn.unbox(v["params"])["ScanCheckpoint_EinsumBlock_0"]["Einsum_0"]["kernel"]
    want = jnp.abs(kernels.astype(jnp.bfloat16)).max(axis=(1, 2)).astype(jnp.float32)
    np.testing.assert_array_equal(meta["kernel_amax_history"][:, 0], want)


@pytest.mark.parametrize("mp", [DELAYED, CURRENT], ids=["delayed", "current"])
def test_inf_reaching_an_fp8_einsum_is_not_saturated(mp):
    x = jnp.ones((5, 4)).at[2, 1].set(jnp.inf)
    model = jamp.apply_policy(nn.Einsum((4, 3), "bi,io->bo"), mp)
    v = jax.jit(model.init)(jax.random.key(0), jnp.ones((5, 4)))
    y = np.asarray(jax.jit(model.apply)(v, x), np.float32)
    assert not np.isfinite(y[2]).any() and np.isfinite(np.delete(y, 2, axis=0)).all()


# --------------------------------------------------------------------------- the ViT


@functools.cache
def _vit(mp_name):
    mp = {"fp8": DELAYED, "fp8_current": CURRENT}.get(mp_name, mp_name)
    return _linen(vit.create("ti", **VIT), mp, IMAGES)


@pytest.mark.parametrize("mode", ["fp8", "fp8_current"])
def test_linen_vit_projections_are_fp8_scores_values_and_head_bf16(mode):
    model, v = _vit(mode)
    # the scanned block's body appears once: q, k, v (fp8), scores, values (bf16), out (fp8),
    # then the MLP's two Dense (fp8); the head (bf16)
    assert _dots(model, v, IMAGES) == [(E4, E4)] * 3 + [(BF, BF)] * 2 + [(E4, E4)] * 3 + [
        (BF, BF)]
    assert _shapes(v["params"]) == _shapes(_vit("bf16")[1]["params"])
    both = _dots(model, v, IMAGES, grad=True)
    assert sum(E5 in d for d in both) == 2 * 6  # two E5M2 gradient dots per fp8 matmul
    assert all(set(d) <= {E4, E5} for d in both if E5 in d)


def test_linen_vit_delayed_state_per_projection_stacked_by_layer():
    _, v = _vit("fp8")
    attention = v[fp8.COLLECTION]["encoder"]["layers"]["SelfAttention_0"]
    assert sorted(attention) == [f"Fp8DirectDotGeneralOp_{i}" for i in range(4)]
    assert all(m["input_amax_history"].shape == (VIT["num_layers"], HIST)
               for m in attention.values())
    # an update: each projection's history gets this step's input amax in front
    model = jamp.apply_policy(vit.SelfAttention(2), DELAYED)
    x = jax.random.normal(jax.random.key(2), (2, 5, 8))
    v = jax.jit(model.init)(jax.random.key(0), x)
    loss = lambda meta: model.apply({"params": v["params"], fp8.COLLECTION: fp8.as_meta(meta)},
                                    x).astype(jnp.float32).sum()
    new = jax.jit(jax.grad(loss))(v[fp8.COLLECTION])
    hist = {name: m["input_amax_history"] for name, m in new.items()}
    amax = float(jnp.abs(x.astype(jnp.bfloat16)).max())
    for i in range(3):  # query, key, value read x
        assert float(hist[f"Fp8DirectDotGeneralOp_{i}"][0]) == amax
    assert 0 < float(hist["Fp8DirectDotGeneralOp_3"][0]) != amax  # out reads the attention
    assert all(np.all(np.asarray(h[1:]) == 0) for h in hist.values())


def test_selfattention_dot_general_fields_and_nnx_twin_match_linen():
    x = jax.random.normal(jax.random.key(3), (2, 5, 8))
    attn = vit.SelfAttention(2)
    v = jax.jit(attn.init)(jax.random.key(0), x)
    # a dot_general of the convention is called by the four projections (not the scores)
    calls = []
    counting = lambda a, b, dims, **kw: calls.append(dims) or jax.lax.dot_general(a, b, dims)
    np.testing.assert_array_equal(vit.SelfAttention(2, dot_general=counting).apply(v, x),
                                  attn.apply(v, x))
    assert len(calls) == 4
    # the NNX twin with the same params: the same numbers under fp8_current
    twin = vit_nnx.SelfAttention(8, 2, rngs=nnx.Rngs(0))
    for name, value in nn.unbox(v["params"]).items():
        getattr(twin, name).set_value(value)
    twin = jamp.apply_policy(twin, "fp8_current")
    want = jax.jit(jamp.apply_policy(attn, "fp8_current").apply)(v, x)
    np.testing.assert_array_equal(nnx.jit(lambda m, x: m(x))(twin, x), want)


@pytest.mark.parametrize("mode", ["fp8", "fp8_current"])
def test_nnx_vit_projections_are_fp8_with_one_state_each(mode):
    mp = DELAYED if mode == "fp8" else CURRENT
    model = nnx.eval_shape(lambda: jamp.apply_policy(vit_nnx.create(
        "ti", image_size=8, channels=1, rngs=nnx.Rngs(0), **VIT), mp))
    graphdef, state = nnx.split(model)
    fwd = operand_dtypes(lambda s: nnx.merge(graphdef, s)(IMAGES).sum(), state,
                         primitive="dot_general")
    assert fwd == [(E4, E4)] * 3 + [(BF, BF)] * 2 + [(E4, E4)] * 3 + [(BF, BF)]
    meta = nnx.to_pure_dict(nnx.state(model, fp8.Fp8Meta))
    if mode == "fp8_current":
        assert meta == {}
        return
    dots = meta["encoder"]["layers"]["attention"]["dot_general"]
    assert sorted(dots) == ["key", "out", "query", "value"]
    assert all(d["kernel_amax_history"].shape == (VIT["num_layers"], HIST) for d in dots.values())
    bf16 = nnx.eval_shape(lambda: jamp.apply_policy(vit_nnx.create(
        "ti", image_size=8, channels=1, rngs=nnx.Rngs(0), **VIT), "bf16"))
    assert _shapes(nnx.to_pure_dict(nnx.state(model, nnx.Param))) == _shapes(
        nnx.to_pure_dict(nnx.state(bf16, nnx.Param)))


def test_nnx_declared_dot_generals_errors_and_keep_bf16():
    class Bad(nnx.Module):
        dot_general_names = ("a", "a")

    with pytest.raises(TypeError, match="distinct matmul names"):
        fp8.nnx_install(Bad(), fp8.Fp8Recipe())
    attn = vit_nnx.SelfAttention(8, 2, rngs=nnx.Rngs(0))
    assert not fp8.nnx_install(attn, fp8.Fp8Recipe(keep_bf16=("attention",)), "attention")
    assert attn.dot_general is None


def test_nnx_attention_delayed_state_updates_per_projection():
    attn = jamp.apply_policy(vit_nnx.SelfAttention(8, 2, rngs=nnx.Rngs(0)), DELAYED)
    x = jax.random.normal(jax.random.key(5), (2, 5, 8))
    loss = lambda m: m(x).astype(jnp.float32).sum()
    grads = nnx.jit(nnx.grad(loss, argnums=nnx.DiffState(0, fp8.PARAMS_AND_META)))(attn)
    fp8.nnx_commit(attn, grads)
    hist = {n: np.asarray(attn.dot_general[n].input_amax_history[...])
            for n in vit_nnx.SelfAttention.dot_general_names}
    amax = float(jnp.abs(x.astype(jnp.bfloat16)).max())
    assert [float(hist[n][0]) for n in ("query", "key", "value")] == [amax] * 3
    assert 0 < float(hist["out"][0]) != amax  # its own state: the attention output's amax
    assert all(np.all(h[1:] == 0) for h in hist.values())


class _Recurrent(nn.Module):
    """A third-party-style sequence classifier: nn.RNN(LSTMCell) -> attention -> head."""

    @nn.compact
    def __call__(self, x, train=False):
        del train
        y = nn.RNN(nn.LSTMCell(8))(x)
        y = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)(y)
        return nn.Dense(3, name="head")(y.mean(1))


def test_linen_rnn_shares_its_cells_fp8_state_over_the_time_steps():
    """nn.RNN scans its cell; the cell's delayed state is broadcast over the steps, so its new
    input amax is the max over all steps (a per-step sum would be ~5x)."""
    x = jax.random.normal(jax.random.key(3), (4, 5, 6))
    model = jamp.apply_policy(_Recurrent(), DELAYED)
    v = jax.jit(model.init)(jax.random.key(0), x)
    meta = v[fp8.COLLECTION]["LSTMCell_0"]["ii"]["Fp8DirectDotGeneralOp_0"]
    assert meta["input_amax_history"].shape == (HIST,)  # one state, not one per step
    tx = jamp.make_optimizer(DELAYED, optax.sgd(0.1))
    state = fp8.TrainState.create(apply_fn=model.apply, params=v["params"], tx=tx,
                                  fp8=v[fp8.COLLECTION])
    batch = {"image": x, "label": jnp.arange(4) % 3}
    new, metrics = jax.jit(jamp.train_step)(state, batch, jax.random.key(1))
    assert np.isfinite(float(metrics["loss"]))
    hist = new.fp8["LSTMCell_0"]["ii"]["Fp8DirectDotGeneralOp_0"]["input_amax_history"]
    assert float(hist[0]) == float(jnp.abs(x.astype(jnp.bfloat16)).max())
    assert len(jax.tree_util.tree_leaves(new.fp8)) == (8 + 4) * 6  # 8 LSTM + 4 MHA matmuls
    assert not jax.tree_util.tree_leaves(jax.jit(jamp.apply_policy(_Recurrent(), CURRENT).init)(
        jax.random.key(0), x).get(fp8.COLLECTION, {}))


class _NnxRecurrent(nnx.Module):
    def __init__(self, rngs):
        self.rnn = nnx.RNN(nnx.LSTMCell(6, 8, rngs=rngs))
        self.head = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(self.rnn(x).mean(1))


@pytest.mark.parametrize("max_combined", [True, False])
def test_nnx_own_loop_rnn_takes_the_max_over_steps_inside_nnx_max_combined(max_combined):
    x = jax.random.normal(jax.random.key(3), (4, 5, 6))
    model = jamp.apply_policy(_NnxRecurrent(nnx.Rngs(0)), DELAYED)

    def loss(m):
        with fp8.nnx_max_combined(m) if max_combined else contextlib.nullcontext():
            return m(x).astype(jnp.float32).sum()

    grads = nnx.jit(nnx.grad(loss, argnums=nnx.DiffState(0, fp8.PARAMS_AND_META)))(model)
    fp8.nnx_commit(model, grads)
    first = float(model.rnn.cell.ii.dot_general.input_amax_history[...][0])
    amax = float(jnp.abs(x.astype(jnp.bfloat16)).max())
    if max_combined:
        assert first == amax
        assert model.rnn.cell.ii.dot_general.input_scale[...].dtype == jnp.float32  # undone
    else:  # float32 state: the 5 steps' amaxes add up
        assert first > 3 * amax
