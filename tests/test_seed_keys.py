"""Every seed key under its seed name (jamp.seed_keys): meaning, training, errors, the guide."""

from __future__ import annotations

import dataclasses
import os
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jamp
import jamp.config
import jamp.experiment
from jamp import AMP_TYPE, seed_keys
from jamp.policy import NORMS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
F16, F32, BF16 = jnp.float16, jnp.float32, jnp.bfloat16

# Seed 000's three blocks, with their default values as written there.
TORCH_000 = dict(mode=AMP_TYPE.TORCH, init_scale=2.**16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, enabled=True)
APEX_000 = dict(mode=AMP_TYPE.APEX, enabled=True, opt_level='O1', cast_model_type=None,
                patch_torch_functions=None, keep_batchnorm_fp32=None, master_weights=None,
                loss_scale=None, cast_model_outputs=None, num_losses=1, verbosity=1,
                min_loss_scale=None, max_loss_scale=16777216.0)
PARALLEL_000 = dict(mode=AMP_TYPE.PARALLEL, clip_grad=0, log_num_zeros_in_grad=False,
                    initial_scale=2 ** 32, min_scale=1, growth_factor=2, backoff_factor=0.5,
                    growth_interval=1000, hysteresis=2)


def scale(mp):
    ls = mp.loss_scale
    return (ls.kind, ls.init_scale, ls.growth_factor, ls.backoff_factor, ls.growth_interval,
            ls.hysteresis, ls.min_scale, ls.max_scale)


def dtypes(policy):
    return tuple(jnp.dtype(d) for d in (policy.param_dtype, policy.compute_dtype,
                                         policy.output_dtype))


def norms_f32(mp) -> bool:
    return any(k is NORMS for k, _ in mp.overrides)


# --------------------------------------------------------------------------- training


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16)(x)
        x = nn.LayerNorm()(x)
        return nn.Dense(4)(nn.relu(x))


X = jnp.linspace(-1.0, 1.0, 8 * 8).reshape(8, 8)
Y = jnp.arange(8) % 4


def train(mp, steps=3, x=X):
    """A few steps of the README's ten lines; returns (losses, opt_state, model, params)."""
    model = jamp.apply_policy(MLP(), mp)
    params = model.init(jax.random.key(0), x)["params"]
    tx = jamp.make_optimizer(mp, optax.adam(1e-2))
    opt_state = tx.init(params)

    def loss_fn(p):
        logits = model.apply({"params": p}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(F32), Y).mean()

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(
            lambda p: jamp.scale_loss(loss_fn(p), opt_state))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for _ in range(steps):
        params, opt_state, scaled = step(params, opt_state)
        losses.append(float(loss_fn(params)))
    return losses, opt_state, model, params


def after_overflows(mp, n):
    """The loss scale after ``n`` steps whose gradients are not finite (all skipped)."""
    tx = jamp.make_optimizer(mp, optax.sgd(0.1))
    params = {"w": jnp.ones(4, mp.policy.param_dtype)}
    state = tx.init(params)
    for _ in range(n):
        updates, state = tx.update({"w": jnp.full((4,), jnp.inf, F32)}, state, params)
        assert not jnp.any(updates["w"])  # the step is skipped
    return float(jamp.loss_scale(state))


def dot_dtypes(model, params, x=X) -> set[str]:
    jaxpr = jax.make_jaxpr(lambda p: model.apply({"params": p}, x))(params)
    return {str(v.aval.dtype) for eqn in jaxpr.jaxpr.eqns if eqn.primitive.name == "dot_general"
            for v in eqn.invars}


def test_seed_000_torch_defaults_mean_fp16_and_train():
    mp = jamp.mixed_precision(TORCH_000)
    assert mp.name == "fp16" and dtypes(mp.policy) == (F32, F16, F32) and norms_f32(mp)
    assert scale(mp) == ("dynamic", 2.**16, 2.0, 0.5, 2000, 1, 1.0, 2.**24)
    assert not mp.master_weights
    losses, state, model, params = train(mp)
    assert dot_dtypes(model, params) == {"float16"} and losses[-1] < losses[0]
    assert jamp.overflow_stats(state).steps_skipped == 0  # this model fits 2**16
    assert after_overflows(mp, 1) == 2.**15  # an overflow: skipped, backoff 0.5 at once
    assert jamp.mixed_precision(dict(TORCH_000, enabled=False)).name == "fp32"


def test_seed_000_apex_defaults_mean_apex_o1_and_train():
    mp = jamp.mixed_precision(APEX_000)
    assert mp.name == "fp16" and dtypes(mp.policy) == (F32, F16, F32) and norms_f32(mp)
    assert scale(mp) == ("dynamic", 2.**16, 2.0, 0.5, 2000, 1, 2.0**-126, 2.**24)
    assert not mp.master_weights
    losses, state, model, params = train(mp)
    assert dot_dtypes(model, params) == {"float16"} and all(map(jnp.isfinite, losses))
    assert after_overflows(mp, 1) == 2.**15  # apex's scaler: no hysteresis


def test_seed_000_parallel_defaults_mean_colossalai_naive_and_train():
    mp = jamp.mixed_precision(PARALLEL_000)
    assert mp.name == "fp16_naive" and dtypes(mp.policy) == (F16, F16, F32) and norms_f32(mp)
    assert scale(mp) == ("dynamic", 2.**32, 2.0, 0.5, 1000, 2, 1.0, 2.**32)
    assert mp.master_weights and mp.clip_grad_norm == 0.0 and not mp.log_num_zeros_in_grad
    losses, state, model, params = train(mp, steps=2)
    # 2**32 overflows float16 at once; hysteresis 2: the first overflow is skipped with the
    # scale kept, the second halves it.
    assert jamp.overflow_stats(state).steps_skipped == 2 and losses[0] == losses[1]
    assert float(jamp.loss_scale(state)) == 2.**31
    assert after_overflows(mp, 1) == 2.**32
    assert jax.tree.leaves(params)[0].dtype == F16
    assert dot_dtypes(model, params) == {"float16"}


def test_seed_001_fp16_torch_mixed_precision_example():
    from jamp.seed_keys import FP16TorchMixedPrecision  # the only line that changes

    mixed_precision = FP16TorchMixedPrecision(
        init_scale=2.**16,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=2000)
    assert isinstance(mixed_precision, jamp.MixedPrecision)
    assert mixed_precision == jamp.mixed_precision("fp16")
    custom = FP16TorchMixedPrecision(init_scale=2.**8, growth_factor=4.0, backoff_factor=0.25,
                                     growth_interval=1)
    assert scale(custom) == ("dynamic", 2.**8, 4.0, 0.25, 1, 1, 1.0, 2.**24)
    _, state, _, _ = train(custom, steps=2)
    assert jamp.overflow_stats(state).steps_skipped == 0  # 2**8 does not overflow
    assert float(jamp.loss_scale(state)) == 2.**8 * 4.0 ** 2  # grows x4 after every step


BOOSTER = {"fp16": ("fp16", (F32, F16, F32), "dynamic"),
           "fp16_apex": ("fp16", (F32, F16, F32), "dynamic"),
           "bf16": ("bf16", (F32, BF16, F32), "none"),
           "fp8": ("fp8", (F32, BF16, F32), "none"),
           "fp16_naive": ("fp16_naive", (F16, F16, F32), "dynamic")}


@pytest.mark.parametrize("string", list(BOOSTER))
def test_seed_001_booster_strings(string):
    name, policy, kind = BOOSTER[string]
    mp = jamp.mixed_precision(string)
    assert (mp.name, dtypes(mp.policy), mp.loss_scale.kind) == (name, policy, kind)
    assert (mp.fp8 is not None) == (string == "fp8")
    if string == "fp16_apex":
        assert mp == seed_keys.from_apex("O1") and mp.loss_scale.min_scale == 2.0**-126
    if string != "fp8":  # fp8 state needs its own collection: jamp.fp8's tests train it
        losses, _, model, params = train(mp, steps=2)
        assert all(map(jnp.isfinite, losses))
        assert dot_dtypes(model, params) == {str(jnp.dtype(policy[1]))}


def test_seed_004_trainer_lines(monkeypatch):
    mp16 = jamp.mixed_precision(16)                                       # Trainer(precision=16)
    assert mp16 == jamp.mixed_precision("16-mixed") == jamp.mixed_precision("fp16")
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert jamp.mixed_precision(16).name == "bf16"                        # bf16 on a TPU
    monkeypatch.undo()
    bf = seed_keys.from_lightning(precision="bf16")                       # precision="bf16"
    assert bf.name == "bf16" and bf.loss_scale.kind == "none"
    apex = jamp.mixed_precision(amp_backend="apex", amp_level="O2")       # apex O2
    assert apex == seed_keys.from_apex("O2") == jamp.mixed_precision(amp_backend="apex")
    assert apex.name == "fp16_naive" and apex.master_weights and norms_f32(apex)
    assert scale(apex) == ("dynamic", 2.**16, 2.0, 0.5, 2000, 1, 2.0**-126, 2.**24)
    assert jamp.mixed_precision(amp_backend="native", precision=16) == mp16
    assert jamp.mixed_precision(32).name == "fp32"
    for mp in (mp16, bf, apex):
        losses, _, model, params = train(mp, steps=2)
        assert all(map(jnp.isfinite, losses))
    assert jamp.to_mixed_precision(16) == mp16 and jamp.to_mixed_precision(TORCH_000) == mp16


def test_opt_levels_and_apex_keys():
    o0, o1, o2, o3 = (jamp.mixed_precision(opt_level=f"O{i}") for i in range(4))
    assert (o0.name, o1.name, o2.name, o3.name) == ("fp32", "fp16", "fp16_naive", "fp16_pure")
    assert o0.loss_scale.kind == "none" and scale(o3)[:2] == ("static", 1.0)
    assert dtypes(o2.policy) == (F16, F16, F32) and o2.master_weights and norms_f32(o2)
    assert dtypes(o3.policy) == (F16, F16, F16) and not o3.master_weights and not norms_f32(o3)
    assert jamp.mixed_precision("O2").loss_scale.hysteresis == 2  # jamp's alias keeps its own
    mp = jamp.mixed_precision(opt_level="O1", cast_model_type=jnp.float16,
                              cast_model_outputs="torch.float16", keep_batchnorm_fp32=False,
                              master_weights=True, loss_scale=128.0)
    assert dtypes(mp.policy) == (F16, F16, F16) and not norms_f32(mp) and mp.master_weights
    assert scale(mp)[:2] == ("static", 128.0)
    losses, _, model, params = train(mp, steps=2)
    assert all(map(jnp.isfinite, losses))
    # keep_batchnorm_fp32=False: the LayerNorm's parameters are float16 like the rest.
    assert {str(leaf.dtype) for leaf in jax.tree.leaves(params["LayerNorm_0"])} == {"float16"}
    keep = jamp.mixed_precision(opt_level="O3", keep_batchnorm_fp32="True")
    assert norms_f32(keep)
    dyn = jamp.mixed_precision(opt_level="O3", loss_scale="dynamic", min_loss_scale=4.0,
                               max_loss_scale=2.**20)
    assert scale(dyn) == ("dynamic", 2.**16, 2.0, 0.5, 2000, 1, 4.0, 2.**20)
    assert jamp.mixed_precision(opt_level="O1", enabled=False).name == "fp32"


def test_naive_keys_and_clip_grad():
    mp = jamp.mixed_precision(dict(mode=AMP_TYPE.NAIVE, initial_scale=2**16, min_scale=2.0,
                                   max_scale=2**20, hysteresis=3, clip_grad=1.0,
                                   log_num_zeros_in_grad=True))
    assert scale(mp) == ("dynamic", 2.**16, 2.0, 0.5, 1000, 3, 2.0, 2.**20)
    assert mp.clip_grad_norm == 1.0 and mp.log_num_zeros_in_grad
    assert jamp.mixed_precision("fp16", clip_grad=0.5).clip_grad_norm == 0.5
    # clip_grad clips the unscaled gradient inside the loss scale.
    big = {"w": jnp.full((4,), 100.0)}
    for clip, norm in ((0.0, 200.0), (1.0, 1.0)):
        tx = jamp.make_optimizer(jamp.mixed_precision("fp32", clip_grad_norm=clip), optax.sgd(1.0))
        updates, _ = tx.update(big, tx.init(big), big)
        assert float(optax.global_norm(updates)) == pytest.approx(norm)
    tx = jamp.make_optimizer(mp, optax.sgd(1.0))
    params = {"w": jnp.ones(4, F16)}
    state = tx.init(params)
    updates, _ = tx.update({"w": jnp.full((4,), 100.0 * 2**16, F32)}, state, params)
    assert float(optax.global_norm(updates)) == pytest.approx(1.0, rel=1e-2)


def test_num_losses_reaches_the_loss_scale():
    assert jamp.mixed_precision(opt_level="O1", num_losses=3).loss_scale.num_losses == 3
    assert jamp.mixed_precision(dict(APEX_000, num_losses=2)).loss_scale.num_losses == 2


def test_verbose_reaches_the_loss_scale():
    assert jamp.mixed_precision(dict(mode=AMP_TYPE.NAIVE, verbose=True)).loss_scale.verbose
    assert not jamp.mixed_precision(opt_level="O1", verbosity=0).loss_scale.verbose


BAD = [
    (dict(opt_level="O4"), "'O0', 'O1', 'O2' or 'O3'"),
    (dict(opt_level="O1", num_losses=0), "integer >= 1"),
    (dict(opt_level="O1", patch_torch_functions=True), "jamp.autocast"),
    (dict(opt_level="O1", patch_torch_functions=True), "jamp.apply_policy"),
    (dict(opt_level="O1", cast_model_type="int8"), "floating dtype"),
    (dict(opt_level="O1", keep_batchnorm_fp32=1), "True or False"),
    (dict(precision=64), "no float64 mode"),
    (dict(precision="64-true"), "no float64 mode"),
    (dict(precision=16, amp_level="O2"), "amp_backend='apex'"),
    (dict(amp_backend="deepspeed"), "'native'"),
    (dict(mode="torc"), "AMP_TYPE.TORCH"),
    (dict(mode=AMP_TYPE.TORCH, hysteresis=2), "init_scale, growth_factor"),
    (dict(mode=AMP_TYPE.TORCH, opt_level="O2"), "Keys of other modes: opt_level (APEX)"),
    (dict(mode=AMP_TYPE.NAIVE, growth_interval=10.5), "integer"),
    (dict(mode=AMP_TYPE.NAIVE, initial_scale="big"), "a number"),
    (dict(mode=AMP_TYPE.NAIVE, clip_grad=-1.0), "clip_grad_norm must be a number >= 0"),
]


@pytest.mark.parametrize("keys, needle", BAD)
def test_bad_values_one_clear_error(keys, needle):
    with pytest.raises(ValueError) as error:
        jamp.mixed_precision(**keys)
    assert needle in str(error.value)
    assert "\n" not in str(error.value)


def test_other_bad_forms():
    with pytest.raises(ValueError, match="needs a mode"):
        jamp.mixed_precision()
    with pytest.raises(ValueError, match="has no mode"):
        jamp.mixed_precision({"init_scale": 2.0})
    with pytest.raises(ValueError, match="apex keys go with an apex opt_level"):
        jamp.mixed_precision("bf16", keep_batchnorm_fp32=False)
    with pytest.raises(ValueError, match="no float64"):
        jamp.mixed_precision(64)
    with pytest.raises(ValueError, match="'dynamic'"):
        seed_keys.from_apex("O1", loss_scale="static")
    assert jamp.mixed_precision(dict(mode="torch")) == jamp.mixed_precision(TORCH_000)


# --------------------------------------------------------------------------- property


def reference(mode: str, keys: dict) -> dict:
    """The seeds' meaning, written out independently of jamp.seed_keys."""
    if mode == "torch":
        d = dict(TORCH_000, **keys)
        return dict(name="fp16", kind="dynamic", init=d["init_scale"], growth=d["growth_factor"],
                    backoff=d["backoff_factor"], interval=d["growth_interval"], hyst=1,
                    lo=1.0, hi=2.**24, master=False, params=F32, clip=0.0)
    if mode == "naive":
        d = {**dict(initial_scale=2.**32, growth_factor=2.0, backoff_factor=0.5,
                    growth_interval=1000, hysteresis=2, min_scale=1.0, max_scale=2.**32,
                    clip_grad=0.0), **keys}
        return dict(name="fp16_naive", kind="dynamic", init=d["initial_scale"],
                    growth=d["growth_factor"], backoff=d["backoff_factor"],
                    interval=d["growth_interval"], hyst=d["hysteresis"], lo=d["min_scale"],
                    hi=d["max_scale"], master=True, params=F16, clip=d["clip_grad"])
    level = keys.get("opt_level", "O1")
    name = {"O0": "fp32", "O1": "fp16", "O2": "fp16_naive", "O3": "fp16_pure"}[level]
    ls = keys.get("loss_scale")
    kind = ("dynamic" if ls == "dynamic" else "static" if ls is not None else
            {"O0": "none", "O1": "dynamic", "O2": "dynamic", "O3": "static"}[level])
    init = float(ls) if kind == "static" and ls is not None else 1.0 if kind == "static" else (
        2.**16)
    lo = keys.get("min_loss_scale") or 2.0**-126
    master = keys.get("master_weights")
    master = level == "O2" if master is None else master
    params = keys.get("cast_model_type") or (F16 if level in ("O2", "O3") else F32)
    return dict(name=name, kind=kind, init=init, growth=2.0, backoff=0.5, interval=2000, hyst=1,
                lo=lo, hi=keys.get("max_loss_scale", 2.**24), master=master, params=params,
                clip=0.0)


def observed(mp) -> dict:
    ls = mp.loss_scale
    out = dict(name=mp.name, kind=ls.kind, master=mp.master_weights,
               params=jnp.dtype(mp.policy.param_dtype), clip=mp.clip_grad_norm)
    if ls.kind != "none":
        out["init"] = ls.init_scale
    if ls.kind == "dynamic":
        out.update(growth=ls.growth_factor, backoff=ls.backoff_factor,
                   interval=ls.growth_interval, hyst=ls.hysteresis, lo=ls.min_scale,
                   hi=ls.max_scale)
    return out


def _subset(draw, options):
    return {k: draw(s) for k, s in options.items() if draw(st.booleans())}


@st.composite
def seed_blocks(draw):
    mode = draw(st.sampled_from(["torch", "apex", "naive"]))
    pow2 = st.integers(4, 20).map(lambda e: 2.0**e)
    if mode == "torch":
        keys = _subset(draw, dict(init_scale=pow2, growth_factor=st.sampled_from([2.0, 4.0]),
                                  backoff_factor=st.sampled_from([0.5, 0.25]),
                                  growth_interval=st.integers(1, 5000)))
    elif mode == "naive":
        keys = _subset(draw, dict(initial_scale=pow2, growth_factor=st.sampled_from([2.0, 3.0]),
                                  backoff_factor=st.sampled_from([0.5, 0.1]),
                                  growth_interval=st.integers(1, 5000),
                                  hysteresis=st.integers(1, 5),
                                  min_scale=st.sampled_from([1.0, 2.0**-4]),
                                  max_scale=st.sampled_from([2.0**32, 2.0**40]),
                                  clip_grad=st.sampled_from([0.0, 1.0, 5.0])))
    else:
        keys = _subset(draw, dict(opt_level=st.sampled_from(["O0", "O1", "O2", "O3"]),
                                  master_weights=st.sampled_from([None, True, False]),
                                  loss_scale=st.sampled_from([None, "dynamic", 8.0, 1024.0]),
                                  cast_model_type=st.sampled_from([None, F16, F32]),
                                  min_loss_scale=st.sampled_from([None, 1.0, 2.0**-8]),
                                  max_loss_scale=st.sampled_from([2.0**24, 2.0**17])))
    return mode, keys


@settings(max_examples=150, deadline=None)
@given(seed_blocks())
def test_random_seed_keys_match_the_reference(block):
    mode, keys = block
    mp = jamp.mixed_precision(dict(mode=mode, **keys))
    want = reference(mode, keys)
    got = observed(mp)
    assert got == {k: v for k, v in want.items() if k in got}, (mode, keys)


# --------------------------------------------------------------------------- the guide

GUIDE = os.path.join(REPO, "docs", "guides", "coming_from.md")


def guide_rows() -> list[tuple[str, str]]:
    rows = []
    with open(GUIDE, encoding="utf-8") as f:
        lines = f.readlines()
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if not line.startswith("| `") or len(cells) != 3:
            continue
        seed = re.match(r"`([^`]*)`", cells[0]).group(1)
        rows.append((seed, re.match(r"`([^`]*)`", cells[1]).group(1)))
    return rows


def _refused(needle):
    def check(code):
        with pytest.raises(ValueError, match=needle):
            eval(code, NS)  # noqa: S307  (the guide's own code)
    return check


def _mp(predicate):
    def check(code):
        mp = eval(code, NS)  # noqa: S307
        assert isinstance(mp, jamp.MixedPrecision)
        assert predicate(mp), (code, mp)
    return check


def _flags(expected):
    def check(code):
        args = [seed_keys.cli_alias(a) for a in code.split()]
        for arg in args:
            key, _, value = arg.removeprefix("--config.").partition("=")
            assert key in jamp.config.FIELDS, key
            if value:
                assert expected[key] == eval(value)  # noqa: S307
    return check


def _boost_check(code):
    """The Booster's boost + backward: a NaN batch is skipped, a clean one trains."""
    loss = lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    boosted = jamp.boost(nn.Dense(3), optax.sgd(0.1), loss, "fp16", accumulate=2)
    x, y = jnp.ones((4, 2)), jnp.zeros(4, jnp.int32)
    state = boosted.init(jax.random.key(0), (x, y))
    state, bad = boosted.step(state, (x.at[0, 0].set(jnp.nan), y))
    state, good = boosted.step(state, (x, y))
    assert bool(bad["skipped"]) and not bool(good["skipped"])
    assert float(good["loss_scale"]) == float(bad["loss_scale"]) / 2


def _loss_id_check(code):
    """Each loss is scaled by its own scale, and an overflow backs off that one only."""
    tx = jamp.DynamicLossScale(optax.sgd(0.1), num_losses=2, init_scale=2.0**4)
    state = tx.init({"w": jnp.ones(2)})
    _, state = tx.update(({"w": jnp.ones(2)}, {"w": jnp.array([jnp.inf, 0.0])}), state)
    assert float(jamp.scale_loss(jnp.float32(1.0), state, loss_id=0)) == 16.0
    assert float(jamp.scale_loss(jnp.float32(1.0), state, loss_id=1)) == 8.0
    with pytest.raises(ValueError, match="num_losses"):
        jamp.scale_loss(jnp.float32(1.0), state, loss_id=2)


def _upper_check(code):
    c = seed_keys.config_from_values(dict(BATCH_SIZE=32, LEARNING_RATE=0.01, WEIGHT_DECAY=0.2,
                                          NUM_EPOCHS=3, WARMUP_EPOCHS=1))
    assert (c.batch_size, c.learning_rate, c.weight_decay, c.num_epochs) == (32, 0.01, 0.2, 3)
    assert c.warmup_steps > 1
    for flag in code.split():
        assert flag.removeprefix("--config.") in jamp.config.FIELDS


NS = dict(jamp=jamp, AMP_TYPE=AMP_TYPE, jnp=jnp, fn=lambda x: x, mp=jamp.mixed_precision("fp16"),
          tx=optax.sgd(0.1))

CHECKS = {
    "fp16=dict(mode=AMP_TYPE.TORCH)": _mp(lambda mp: mp == jamp.mixed_precision(TORCH_000)),
    "init_scale, growth_factor, backoff_factor, growth_interval": _mp(
        lambda mp: scale(mp)[:5] == ("dynamic", 2.**10, 4.0, 0.25, 100)),
    "enabled=False": _mp(lambda mp: mp.name == "fp32"),
    "FP16TorchMixedPrecision(init_scale, growth_factor, backoff_factor, growth_interval)": _mp(
        lambda mp: mp == jamp.mixed_precision("fp16")),
    "fp16=dict(mode=AMP_TYPE.APEX)": _mp(lambda mp: mp == seed_keys.from_apex("O1")),
    'opt_level="O0"': _mp(lambda mp: mp.name == "fp32" and mp.loss_scale.kind == "none"),
    'opt_level="O1"': _mp(lambda mp: mp.name == "fp16" and scale(mp)[5:7] == (1, 2.0**-126)),
    'opt_level="O2"': _mp(lambda mp: mp.name == "fp16_naive" and mp.master_weights
                          and norms_f32(mp) and mp.loss_scale.hysteresis == 1),
    'opt_level="O3"': _mp(lambda mp: dtypes(mp.policy) == (F16, F16, F16)
                          and scale(mp)[:2] == ("static", 1.0)),
    'opt_level="O4"': _refused("'O0', 'O1', 'O2' or 'O3'"),
    "cast_model_type=torch.float16": _mp(lambda mp: dtypes(mp.policy)[0] == F16),
    "patch_torch_functions=True": lambda code: (
        callable(eval(code, NS)),  # noqa: S307
        _refused("jamp.autocast")("jamp.mixed_precision(opt_level='O1', "
                                  "patch_torch_functions=True)")),
    "keep_batchnorm_fp32=False": _mp(lambda mp: not norms_f32(mp)),
    "master_weights=False": _mp(lambda mp: not mp.master_weights),
    "loss_scale=128.0": _mp(lambda mp: scale(mp)[:2] == ("static", 128.0)),
    'loss_scale="dynamic"': _mp(lambda mp: mp.loss_scale.kind == "dynamic"),
    "cast_model_outputs=torch.float16": _mp(lambda mp: dtypes(mp.policy)[2] == F16),
    "num_losses=2": _mp(lambda mp: mp.loss_scale.num_losses == 2),
    "num_losses=0": _refused("integer >= 1"),
    "amp.scale_loss(loss, optimizer, loss_id=i)": _loss_id_check,
    "verbosity=0": _mp(lambda mp: not mp.loss_scale.verbose),
    "min_loss_scale=None": _mp(lambda mp: mp.loss_scale.min_scale == 2.0**-126),
    "min_loss_scale, max_loss_scale": _mp(lambda mp: scale(mp)[6:] == (1.0, 2.**20)),
    'amp.initialize(model, optimizer, opt_level="O1")': lambda code: isinstance(
        eval(code, NS), optax.GradientTransformation),  # noqa: S307
    "fp16=dict(mode=AMP_TYPE.NAIVE)": _mp(
        lambda mp: scale(mp) == ("dynamic", 2.**32, 2.0, 0.5, 1000, 2, 1.0, 2.**32)),
    "mode=AMP_TYPE.PARALLEL": _mp(lambda mp: mp == jamp.mixed_precision(dict(mode="naive"))),
    'mode="torch"': _mp(lambda mp: mp == jamp.mixed_precision("fp16")),
    "initial_scale, min_scale, max_scale, hysteresis": _mp(
        lambda mp: scale(mp) == ("dynamic", 2.**16, 2.0, 0.5, 1000, 3, 2.0, 2.**20)),
    "clip_grad=1.0": _mp(lambda mp: mp.clip_grad_norm == 1.0),
    "log_num_zeros_in_grad=True": _mp(lambda mp: mp.log_num_zeros_in_grad),
    "verbose=True": _mp(lambda mp: mp.loss_scale.verbose),
    "Booster(mixed_precision='fp16')": _mp(lambda mp: mp.name == "fp16"),
    "Booster(mixed_precision='fp16_apex')": _mp(lambda mp: mp == seed_keys.from_apex("O1")),
    "Booster(mixed_precision='bf16')": _mp(lambda mp: mp.name == "bf16"),
    "Booster(mixed_precision='fp8')": _mp(lambda mp: mp.fp8 is not None),
    "Booster(mixed_precision='fp16_naive')": _mp(lambda mp: mp.loss_scale.hysteresis == 2),
    "booster.boost(model, optimizer, criterion)": _boost_check,
    "booster.backward(loss, optimizer)": _boost_check,
    "gradient_accumulation = 4": _flags({"grad_accum_steps": 4}),
    "clip_grad_norm = 1.0": _flags({"grad_clip_norm": 1.0}),
    "parallel = dict(pipeline=2, tensor=dict(size=2, mode='1d'))": _flags(
        {"mesh.pipe": 2, "mesh.model": 2}),
    "BATCH_SIZE, LEARNING_RATE, WEIGHT_DECAY, NUM_EPOCHS, WARMUP_EPOCHS": _upper_check,
    "Trainer(precision=16)": _mp(lambda mp: mp.name == "fp16"),
    'Trainer(precision="bf16")': _mp(lambda mp: mp.name == "bf16"),
    "Trainer(precision=32)": _mp(lambda mp: mp.name == "fp32"),
    "Trainer(precision=64)": _refused("no float64 mode"),
    'Trainer(amp_backend="apex", amp_level="O2")': _mp(lambda mp: mp == seed_keys.from_apex("O2")),
}


def test_the_guide_has_a_check_for_every_row_and_a_row_for_every_check():
    seeds = [seed for seed, _ in guide_rows()]
    assert len(seeds) == len(set(seeds))
    assert set(seeds) == set(CHECKS)


@pytest.mark.parametrize("seed, code", guide_rows(), ids=[s for s, _ in guide_rows()])
def test_each_guide_row(seed, code):
    CHECKS[seed](code)


def test_config_values_translate_and_refuse():
    c = seed_keys.config_from_values(dict(
        fp16=dict(mode=AMP_TYPE.APEX, opt_level="O2"), gradient_accumulation=4,
        parallel=dict(pipeline=2, tensor=dict(size=2, mode="1d")), AMP_TYPE=AMP_TYPE))
    assert (c.mode, c.grad_accum_steps, c.mesh.pipe, c.mesh.model, c.grad_clip_norm) == (
        "fp16_naive", 4, 2, 2, 0.0)
    assert (c.loss_scale.hysteresis, c.loss_scale.min_scale) == (1, 2.0**-126)
    want = seed_keys.from_apex("O2")  # apex's verbosity=1: the trainer's progress bar instead
    want = dataclasses.replace(want, loss_scale=dataclasses.replace(want.loss_scale,
                                                                    verbose=False))
    assert jamp.experiment.precision_from_config(c) == want
    assert seed_keys.config_from_values({}).mode == "fp32"
    bad = [(dict(NUM_CLASSES=10), "jamp cannot map NUM_CLASSES"),
           (dict(fp16=dict(mode=AMP_TYPE.APEX, keep_batchnorm_fp32=False)), "cannot express"),
           (dict(parallel=dict(tensor=dict(size=2, mode="2d"))), "'1d'"),
           (dict(clip_grad_norm=2.0, fp16=dict(mode=AMP_TYPE.NAIVE, clip_grad=1.0)), "disagree"),
           (dict(BATCH_SIZE="big"), "batch_size")]
    for values, needle in bad:
        with pytest.raises(ValueError, match=needle):
            seed_keys.config_from_values(values)


def test_the_guide_code_blocks_run():
    """The guide's Python block runs as written; its config-file block translates."""
    with open(os.path.join(REPO, "docs", "guides", "coming_from.md")) as f:
        guide = f.read()
    blocks = re.findall(r"```python\n(.*?)```", guide, re.S)
    assert len(blocks) == 2
    scope: dict = {}
    exec(compile(blocks[0], "coming_from.md", "exec"), scope)
    assert scope["mp"].name == "fp16" and scope["boosted"].precision == scope["mp"]
    values: dict = {}
    exec(compile(blocks[1], "coming_from.md", "exec"), values)
    c = seed_keys.config_from_values({k: v for k, v in values.items()
                                      if not k.startswith("__")})
    assert (c.mode, c.grad_accum_steps, c.grad_clip_norm, c.mesh.pipe, c.mesh.model,
            c.batch_size) == ("fp16_naive", 4, 1.0, 2, 2, 128)
