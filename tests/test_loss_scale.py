"""Tests for jamp.loss_scale: scale rules, exact skips, composition, helpers, errors."""


import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jamp.loss_scale import (
    DynamicLossScale,
    LossScaleConfig,
    LossScaleDivergedError,
    LossScaleState,
    NoOpLossScale,
    OverflowStats,
    StaticLossScale,
    all_finite,
    check_divergence,
    loss_scale,
    overflow_stats,
    scale_loss,
)

PARAMS = {"w": jnp.zeros((2,), jnp.float32)}
# The module itself (jamp.loss_scale the attribute is the function of that name).
loss_scale_module = importlib.import_module("jamp.loss_scale")


@pytest.fixture(params=["cond", "select"])
def skip_form(request, monkeypatch):
    """Runs a test with each form of the exact skip (one device selects; several cond)."""
    monkeypatch.setattr(loss_scale_module, "_skip_by_select", lambda: request.param == "select")
    return request.param


def test_skip_form_follows_the_device_count_and_shows_in_the_jaxpr(skip_form):
    tx = DynamicLossScale(optax.adam(1e-2), init_scale=2.0**4)
    jaxpr = str(jax.make_jaxpr(tx.update)(PARAMS, tx.init(PARAMS), PARAMS))
    assert ("cond[" in jaxpr) == (skip_form == "cond")
    assert ("select_n" in jaxpr) or skip_form == "cond"


def test_skip_is_a_select_only_when_the_process_sees_one_device(monkeypatch):
    # Several devices mean collectives, which XLA:CPU deadlocked in the select form.
    assert jax.device_count() == 8 and not loss_scale_module._skip_by_select()
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    assert loss_scale_module._skip_by_select()


def trajectory(tx, flags, params=PARAMS):
    """Runs ``tx`` over finite (True) / overflow (False) steps in one jitted scan.

    The gradients are ``scale * 1`` on finite steps and ``inf`` otherwise, i.e.
    what ``jax.grad`` of ``scale_loss(sum(w * x), state)`` gives. Returns the
    scale after each step, whether each step was applied, and the final state.
    """

    def body(state, ok):
        grads = jax.tree_util.tree_map(
            lambda p: jnp.where(ok, loss_scale(state), jnp.inf) * jnp.ones_like(p), params
        )
        updates, state = tx.update(grads, state, params)
        applied = jnp.any(jnp.stack([jnp.any(u != 0) for u in jax.tree_util.tree_leaves(updates)]))
        return state, (loss_scale(state), applied)

    run = jax.jit(lambda s, f: jax.lax.scan(body, s, f))
    state, (scales, applied) = run(tx.init(params), jnp.asarray(flags, bool))
    return np.asarray(scales), np.asarray(applied), state


def reference(flags, *, init, growth, backoff, interval, hysteresis, min_scale, max_scale):
    """Megatron-LM's DynamicGradScaler.update with jamp's clamps, in float32 numpy."""
    f32 = np.float32
    scale, growth_tracker, hyst = f32(init), 0, hysteresis
    out = []
    for ok in flags:
        if not ok:
            growth_tracker = 0
            hyst -= 1
            if hyst <= 0:
                scale = max(f32(scale * f32(backoff)), f32(min_scale))
        else:
            growth_tracker += 1
            if growth_tracker == interval:
                growth_tracker, hyst = 0, hysteresis
                scale = min(f32(scale * f32(growth)), f32(max_scale))
        out.append(scale)
    return np.asarray(out, np.float32)


def bits(tree):
    """Leaves as raw bytes, for bit-identity checks."""
    return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(tree)]


# --------------------------------------------------------------------------- basics


def test_is_an_optax_transformation_and_composes():
    tx = DynamicLossScale(optax.adam(1e-3))
    assert isinstance(tx, optax.GradientTransformation)
    chained = optax.chain(DynamicLossScale(), optax.sgd(0.1))
    state = chained.init(PARAMS)
    updates, _ = chained.update({"w": jnp.full((2,), 2.0**16)}, state, PARAMS)
    np.testing.assert_allclose(updates["w"], [-0.1, -0.1], rtol=1e-6)


def test_state_layout_and_dtypes():
    state = DynamicLossScale(optax.sgd(0.1), hysteresis=3).init(PARAMS)
    assert isinstance(state, LossScaleState)
    assert state._fields == (
        "scale",
        "growth_tracker",
        "hysteresis_tracker",
        "steps_skipped",
        "consecutive_overflows",
        "last_finite",
        "min_scale_overflows",
        "diverged",
        "inner_state",
    )
    assert state.scale.dtype == jnp.float32 and state.scale.shape == ()
    assert int(state.hysteresis_tracker) == 3
    assert bool(state.last_finite) and not bool(state.diverged)


def test_torch_rule_by_hand():
    # growth_interval=3: grow on the 3rd consecutive finite step, not the 4th.
    tx = DynamicLossScale(optax.sgd(1.0), init_scale=2.0**10, growth_interval=3)
    flags = [1, 1, 1, 1, 0, 1, 1, 1, 0, 0, 1]
    scales, applied, state = trajectory(tx, flags)
    expected = [1024, 1024, 2048, 2048, 1024, 1024, 1024, 2048, 1024, 512, 512]
    np.testing.assert_array_equal(scales, np.asarray(expected, np.float32))
    np.testing.assert_array_equal(applied, np.asarray(flags, bool))
    assert int(state.growth_tracker) == 1
    assert int(overflow_stats(state).steps_skipped) == 3


def test_megatron_hysteresis_by_hand():
    # hysteresis=2, growth_interval=3 (Megatron's DynamicGradScaler):
    # step 1 inf: h 2->1, keep;  2 inf: h->0, back off;  3 inf: h<=0, back off again;
    # 4-6 finite: grow on the 3rd, h reset to 2;  7 inf: h->1, keep;  8 finite: h stays 1
    # (Megatron resets h only on growth);  9 inf: h->0, back off;  10 inf: back off.
    tx = DynamicLossScale(
        optax.sgd(1.0), init_scale=1024.0, growth_interval=3, hysteresis=2, min_scale=1.0
    )
    flags = [0, 0, 0, 1, 1, 1, 0, 1, 0, 0]
    scales, applied, state = trajectory(tx, flags)
    expected = [1024, 512, 256, 256, 256, 512, 512, 512, 256, 128]
    np.testing.assert_array_equal(scales, np.asarray(expected, np.float32))
    # Every non-finite step is skipped, whatever the hysteresis (Megatron does the same).
    np.testing.assert_array_equal(applied, np.asarray(flags, bool))
    assert int(state.hysteresis_tracker) == 0
    stats = overflow_stats(state)
    assert isinstance(stats, OverflowStats)
    assert int(stats.steps_skipped) == 6 and int(stats.consecutive_overflows) == 2
    assert not bool(stats.last_finite)


@pytest.mark.parametrize(
    ("hysteresis", "interval", "p_overflow"), [(1, 1, 0.5), (2, 3, 0.3), (3, 2, 0.4), (2, 5, 0.1)]
)
def test_random_trajectories_match_megatron_reference(hysteresis, interval, p_overflow):
    kw = dict(growth=2.0, backoff=0.5, interval=interval, hysteresis=hysteresis)
    kw |= dict(init=2.0**6, min_scale=1.0, max_scale=2.0**12)
    flags = np.random.default_rng(hysteresis * 10 + interval).random(300) > p_overflow
    tx = DynamicLossScale(
        optax.sgd(1.0),
        init_scale=kw["init"],
        growth_interval=interval,
        hysteresis=hysteresis,
        min_scale=kw["min_scale"],
        max_scale=kw["max_scale"],
    )
    scales, applied, _ = trajectory(tx, flags)
    np.testing.assert_array_equal(scales, reference(flags, **kw))
    np.testing.assert_array_equal(applied, flags)


def test_clamping_never_inf_or_zero():
    # Back-off from min_scale stays at min_scale; growth at max_scale stays at max_scale.
    tx = DynamicLossScale(optax.sgd(1.0), init_scale=1.0, min_scale=1.0, growth_interval=1)
    scales, _, _ = trajectory(tx, [0] * 5 + [1] * 30)
    assert scales[:5].tolist() == [1.0] * 5
    assert scales.max() == 2.0**24 and scales[-1] == 2.0**24  # default max_scale
    # Extreme bounds (2**126 and 2**-126, whose reciprocals are normal float32):
    # growth that would overflow and back-off that would underflow are clamped.
    tx = DynamicLossScale(
        optax.sgd(1.0),
        init_scale=2.0**120,
        growth_interval=1,
        growth_factor=2.0**10,
        backoff_factor=2.0**-100,
        min_scale=2.0**-126,
        max_scale=2.0**126,
    )
    scales, applied, _ = trajectory(tx, [1] * 3 + [0] * 4 + [1])
    assert np.all(np.isfinite(scales)) and np.all(scales > 0)
    assert scales[:3].tolist() == [2.0**126] * 3
    assert scales[3:7].tolist() == [2.0**26, 2.0**-74, 2.0**-126, 2.0**-126]
    # At both extremes the unscaled gradients are still exact (no flush to zero).
    assert applied.tolist() == [True] * 3 + [False] * 4 + [True]


def test_f16_and_bf16_gradients():
    tx = DynamicLossScale(init_scale=2.0**24, max_scale=2.0**24)  # bare link
    state = tx.init({"w": jnp.zeros((3,), jnp.float16)})
    # Finite in float16, but the unscaled value 1.25 * 2**-24 is not representable in
    # float16 (its subnormal step is 2**-24): jamp unscales in float32, exactly.
    g16 = {"w": jnp.asarray([1.25, 60000.0, -3.0], jnp.float16)}
    updates, new_state = jax.jit(tx.update)(g16, state)
    assert updates["w"].dtype == jnp.float32
    np.testing.assert_array_equal(
        updates["w"], np.asarray([1.25, 60000.0, -3.0], np.float32) * np.float32(2.0**-24)
    )
    f16_unscale = g16["w"] * jnp.float16(2.0**-24)
    assert float(f16_unscale[0]) != float(updates["w"][0])  # what a float16 unscale loses
    assert new_state.scale.dtype == jnp.float32 and bool(new_state.last_finite)

    # A float16 overflow (70000 -> inf) and a bfloat16 NaN are both caught.
    g_inf = {"w": jnp.asarray([1.0, 70000.0, 0.0], jnp.float32).astype(jnp.float16)}
    updates, s = jax.jit(tx.update)(g_inf, state)
    assert not bool(s.last_finite) and not np.any(np.asarray(updates["w"]))
    assert s.scale.dtype == jnp.float32 and float(s.scale) == 2.0**23
    g_nan = {"w": jnp.asarray([1.0, jnp.nan, 0.0], jnp.bfloat16)}
    updates, s = jax.jit(tx.update)(g_nan, tx.init({"w": jnp.zeros((3,), jnp.bfloat16)}))
    assert not bool(s.last_finite) and not np.any(np.asarray(updates["w"]))


def test_exact_skip_leaves_adam_bit_identical(skip_form):
    params = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.ones((3,))}
    tx = DynamicLossScale(optax.adamw(1e-2), init_scale=2.0**8)
    step = jax.jit(tx.update)
    state = tx.init(params)
    for i in range(3):
        scale = loss_scale(state)
        grads = jax.tree_util.tree_map(lambda p, i=i, s=scale: (p + i) * s, params)
        updates, state = step(grads, state, params)
        params = optax.apply_updates(params, updates)
    inner_before, params_before = bits(state.inner_state), bits(params)
    bad = {"w": params["w"].at[1, 2].set(jnp.nan), "b": params["b"]}
    updates, new_state = step(bad, state, params)
    new_params = optax.apply_updates(params, updates)
    assert bits(new_state.inner_state) == inner_before  # Adam moments and count unmoved
    assert bits(new_params) == params_before
    assert all(not np.any(np.asarray(u)) for u in jax.tree_util.tree_leaves(updates))
    assert int(new_state.inner_state[0].count) == 3
    assert float(new_state.scale) == 2.0**7


@pytest.mark.parametrize("mode", ["fp16", "fp16_naive"])
def test_skip_keeps_negative_zero_parameters_bit_identical(mode, skip_form):
    # A skip adds -0.0 (p + 0.0 would turn a -0.0 parameter into +0.0).
    import jamp

    dtype = jnp.float16 if mode == "fp16_naive" else jnp.float32
    params = {"b": jnp.asarray([-0.0, 0.0, -1.5, 2.0], dtype)}
    tx = jamp.make_optimizer(mode, optax.adam(1e-2))
    updates, _ = jax.jit(tx.update)({"b": jnp.asarray([jnp.inf, 1, 1, 1], dtype)},
                                    tx.init(params), params)
    assert bits(optax.apply_updates(params, updates)) == bits(params)


def test_inner_clipping_sees_unscaled_gradients():
    tx = DynamicLossScale(
        optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0)), init_scale=2.0**10
    )
    state = tx.init(PARAMS)
    grads = {"w": jnp.asarray([0.3, 0.4]) * 2.0**10}  # unscaled norm 0.5 < 1: no clipping
    updates, _ = tx.update(grads, state, PARAMS)
    np.testing.assert_allclose(updates["w"], [-0.3, -0.4], rtol=1e-6)


def test_bare_form_zeroes_updates_but_later_links_still_step():
    tx = optax.chain(DynamicLossScale(init_scale=4.0), optax.adam(0.1))
    state = tx.init(PARAMS)
    step = jax.jit(tx.update)
    updates, state = step({"w": jnp.asarray([4.0, -4.0])}, state, PARAMS)
    np.testing.assert_allclose(updates["w"], [-0.1, 0.1], rtol=1e-5)
    updates, state = step({"w": jnp.asarray([jnp.inf, 1.0])}, state, PARAMS)
    ls_state, adam_state = state[0], state[1][0]
    assert not bool(ls_state.last_finite) and float(loss_scale(state)) == 2.0
    # Documented caveat: Adam after a bare link counts the step and, through its
    # first moment, still moves the parameters. The wrapped form does neither.
    assert int(adam_state.count) == 2
    assert np.all(np.asarray(updates["w"]) != 0)
    # The bare link itself outputs zeros on overflow and unscaled float32 otherwise.
    bare = DynamicLossScale(init_scale=4.0)
    u, _ = bare.update({"w": jnp.asarray([jnp.inf, 1.0])}, bare.init(PARAMS))
    assert u["w"].tolist() == [0.0, 0.0]
    u, _ = bare.update({"w": jnp.asarray([8.0, 1.0], jnp.bfloat16)}, bare.init(PARAMS))
    assert u["w"].dtype == jnp.float32 and u["w"].tolist() == [2.0, 0.25]


def test_static_loss_scale():
    tx = StaticLossScale(128.0, optax.sgd(1.0), divergence_steps=3)
    scales, applied, state = trajectory(tx, [1, 0, 1, 0, 0, 0])
    assert scales.tolist() == [128.0] * 6
    assert applied.tolist() == [True, False, True, False, False, False]
    assert bool(overflow_stats(state).diverged)  # a static scale cannot back off
    updates, _ = tx.update({"w": jnp.asarray([256.0, 64.0])}, tx.init(PARAMS))
    assert updates["w"].tolist() == [-2.0, -0.5]


def test_noop_loss_scale_is_a_pure_pass_through():
    params = {"w": jnp.asarray([1.0, -2.0]), "b": jnp.asarray([0.5])}
    grads = {"w": jnp.asarray([0.1, jnp.inf]), "b": jnp.asarray([0.2])}
    adam = optax.adam(1e-2)
    tx = NoOpLossScale(adam)
    u_ref, s_ref = adam.update(grads, adam.init(params), params)
    u, s = tx.update(grads, tx.init(params), params)
    assert bits(u) == bits(u_ref) and bits(s.inner_state) == bits(s_ref)
    assert float(loss_scale(s)) == 1.0
    assert int(overflow_stats(s).steps_skipped) == 0 and bool(overflow_stats(s).last_finite)
    g16 = {"w": jnp.asarray([1.0, 2.0], jnp.bfloat16)}
    u, _ = NoOpLossScale().update(g16, NoOpLossScale().init(params))
    assert u["w"].dtype == jnp.bfloat16 and u["w"] is g16["w"]


def test_scale_loss_computes_in_float32():
    state = StaticLossScale(2.0**16).init(PARAMS)
    for dtype in (jnp.float16, jnp.bfloat16, jnp.float32):
        out = scale_loss(jnp.asarray(3.0, dtype), state)
        assert out.dtype == jnp.float32 and float(out) == 3.0 * 2.0**16  # inf in float16
    assert loss_scale(state).dtype == jnp.float32


def test_gradients_of_scaled_loss_are_unscaled_by_update():
    params = {"w": jnp.asarray([1.0, 2.0, 3.0])}
    tx = DynamicLossScale(optax.sgd(1.0), init_scale=2.0**12)
    state = tx.init(params)

    def loss_fn(p):
        return jnp.sum(p["w"] ** 2)

    grads = jax.grad(lambda p: scale_loss(loss_fn(p), state))(params)
    np.testing.assert_array_equal(grads["w"], np.asarray([2.0, 4.0, 6.0]) * 2.0**12)
    updates, _ = tx.update(grads, state, params)
    np.testing.assert_array_equal(updates["w"], [-2.0, -4.0, -6.0])


# --------------------------------------------------------------------------- helpers


def test_helpers_find_state_in_nested_trees():
    inner = DynamicLossScale(optax.adam(1e-3), init_scale=8.0)
    chain = optax.chain(optax.identity(), optax.chain(optax.identity(), inner))
    state = chain.init(PARAMS)
    assert float(loss_scale(state)) == 8.0
    nested = {"opt": (None, {"deep": [state]}), "step": jnp.zeros(())}
    assert float(loss_scale(nested)) == 8.0
    assert int(overflow_stats(nested).steps_skipped) == 0
    assert float(scale_loss(1.5, nested)) == 12.0


def test_inject_hyperparams_both_ways():
    params = {"w": jnp.ones((2,))}
    # Loss scale outside inject_hyperparams ...
    tx1 = DynamicLossScale(optax.inject_hyperparams(optax.adam)(learning_rate=0.1), init_scale=4.0)
    # ... and inside it (the factory builds the whole wrapped optimizer).
    tx2 = optax.inject_hyperparams(
        lambda learning_rate: DynamicLossScale(optax.adam(learning_rate), init_scale=4.0)
    )(learning_rate=0.1)
    for tx in (tx1, tx2):
        state = tx.init(params)
        step = jax.jit(tx.update)
        updates, state = step({"w": jnp.asarray([4.0, -4.0])}, state, params)
        np.testing.assert_allclose(updates["w"], [-0.1, 0.1], rtol=1e-5)
        before = bits(state)
        updates, state = step({"w": jnp.asarray([jnp.nan, 1.0])}, state, params)
        assert float(loss_scale(state)) == 2.0
        assert int(overflow_stats(state).steps_skipped) == 1
        assert not np.any(np.asarray(updates["w"]))
        assert len(bits(state)) == len(before)


def test_helper_errors():
    with pytest.raises(ValueError, match="no jamp loss-scale state found in opt_state"):
        loss_scale(optax.adam(1e-3).init(PARAMS))
    with pytest.raises(ValueError, match="DynamicLossScale"):
        overflow_stats({"x": jnp.ones(())})
    twice = DynamicLossScale(DynamicLossScale(optax.sgd(0.1)))
    with pytest.raises(ValueError, match="found 2 jamp loss-scale states"):
        loss_scale(twice.init(PARAMS))
    chained = optax.chain(DynamicLossScale(), StaticLossScale(2.0, optax.sgd(0.1)))
    with pytest.raises(ValueError, match="exactly one"):
        scale_loss(1.0, chained.init(PARAMS))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(backoff_factor=1.0), r"backoff_factor must be in \(0, 1\), got 1.0"),
        (dict(backoff_factor=0.0), r"backoff_factor must be in \(0, 1\), got 0.0"),
        (dict(growth_factor=1.0), r"growth_factor must be > 1, got 1.0"),
        (dict(growth_factor=0.5), r"growth_factor must be > 1"),
        (dict(growth_interval=0), r"growth_interval must be >= 1, got 0"),
        (dict(growth_interval=2.5), r"growth_interval must be an int >= 1, got 2.5"),
        (dict(hysteresis=0), r"hysteresis must be >= 1, got 0"),
        (dict(divergence_steps=0), r"divergence_steps must be >= 1"),
        (dict(min_scale=0.0), r"min_scale must be a finite positive float in \[2\*\*-126"),
        (dict(min_scale=1e-40), r"min_scale must be .*got 1e-40"),
        (dict(max_scale=float("inf")), r"max_scale must be a finite positive"),
        (dict(max_scale=2.0**127), r"max_scale must be .*subnormals"),
        (dict(min_scale=float("nan")), r"min_scale must be a finite positive"),
        (dict(init_scale=0.5, min_scale=1.0), r"min_scale <= init_scale <= max_scale.*0.5"),
        (dict(init_scale=2.0**30), r"min_scale <= init_scale <= max_scale"),
        (dict(axis_names=3), r"axis_names must be a mesh axis name"),
    ],
)
def test_argument_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynamicLossScale(optax.sgd(0.1), **kwargs)


def test_other_validation():
    with pytest.raises(ValueError, match="scale must be a finite positive"):
        StaticLossScale(0.0)
    with pytest.raises(ValueError, match="inner must be an optax.GradientTransformation"):
        DynamicLossScale("adam")


# --------------------------------------------------------------------------- divergence


def test_divergence_guard():
    tx = DynamicLossScale(optax.sgd(1.0), init_scale=4.0, min_scale=1.0, divergence_steps=5)
    # 4 -> 2 -> 1 (two back-offs), then overflows *at* min_scale count: diverged on the 5th.
    flags = [0] * 6
    _, _, state = trajectory(tx, flags)
    assert float(loss_scale(state)) == 1.0 and not bool(overflow_stats(state).diverged)
    check_divergence(state)  # does not raise yet
    _, _, state = trajectory(tx, flags + [0])
    assert bool(overflow_stats(state).diverged)
    with pytest.raises(LossScaleDivergedError, match=r"minimum \(1\).*7 consecutive steps"):
        check_divergence(state)
    with pytest.raises(RuntimeError, match="Lower the learning rate.*bfloat16.*NaNs/infs"):
        check_divergence({"opt": state})
    # One finite step clears it.
    _, _, state = trajectory(tx, flags + [0, 1])
    assert not bool(overflow_stats(state).diverged)
    assert int(overflow_stats(state).consecutive_overflows) == 0


# --------------------------------------------------------------------------- composition


def test_multisteps_inside_the_loss_scale():
    """DynamicLossScale(MultiSteps(opt, k)): each micro-step is unscaled and checked."""
    params = {"w": jnp.zeros((3,))}
    tx = DynamicLossScale(
        optax.MultiSteps(optax.sgd(1.0), every_k_schedule=3),
        init_scale=2.0**10,
        growth_interval=100,
    )
    step = jax.jit(tx.update)
    state = tx.init(params)
    micro = [
        jnp.asarray([1.0, 2.0, 3.0]),
        jnp.asarray([jnp.inf, 0.0, 0.0]),  # overflow: dropped, scale backs off
        jnp.asarray([-2.0, 0.5, 1.0]),
        jnp.asarray([4.0, 0.25, -1.0]),
    ]
    seen_scales = []
    for i, g in enumerate(micro):
        seen_scales.append(float(loss_scale(state)))
        mini_before = int(state.inner_state.mini_step)
        updates, state = step({"w": g * loss_scale(state)}, state, params)
        if i == 1:
            assert int(state.inner_state.mini_step) == mini_before  # accumulator untouched
        if i < 3:
            assert not np.any(np.asarray(updates["w"]))
    # The scale changed mid-accumulation; the accumulator still holds unscaled gradients.
    assert seen_scales == [1024.0, 1024.0, 512.0, 512.0]
    expected = -(micro[0] + micro[2] + micro[3]) / 3.0
    np.testing.assert_allclose(updates["w"], expected, rtol=1e-6)
    assert int(state.inner_state.gradient_step) == 1
    assert int(overflow_stats(state).steps_skipped) == 1


def test_multisteps_state_is_searched():
    # The wrong (inside) placement still builds; the helpers find its state.
    tx = optax.MultiSteps(DynamicLossScale(optax.sgd(1.0), init_scale=2.0), every_k_schedule=2)
    assert float(loss_scale(tx.init(PARAMS))) == 2.0


def test_pytree_round_trip_keeps_behaviour():
    # Hyper-parameters are closed over, not stored: flatten/unflatten loses nothing
    # (jmp's DynamicLossScale drops min_loss_scale here).
    tx = DynamicLossScale(optax.sgd(1.0), init_scale=2.0, min_scale=2.0, growth_interval=2)
    state = tx.init(PARAMS)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    state = jax.tree_util.tree_unflatten(treedef, [np.asarray(x) for x in leaves])
    _, state = tx.update({"w": jnp.full((2,), jnp.inf)}, state, PARAMS)
    assert float(loss_scale(state)) == 2.0  # clamped at min_scale after the round trip


def test_orbax_checkpoint_mid_growth_interval(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    tx = DynamicLossScale(optax.adam(1e-2), init_scale=2.0**8, growth_interval=5, hysteresis=2)
    params = {"w": jnp.linspace(0.0, 1.0, 4)}
    flags = np.asarray([1, 1, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1], bool)

    def body(carry, ok):
        p, s = carry
        grads = {"w": jnp.where(ok, (p["w"] + 1.0) * loss_scale(s), jnp.inf)}
        u, s = tx.update(grads, s, p)
        return (optax.apply_updates(p, u), s), loss_scale(s)

    run = jax.jit(lambda c, f: jax.lax.scan(body, c, f))
    (p_full, s_full), scales_full = run((params, tx.init(params)), flags)

    (p_mid, s_mid), scales_a = run((params, tx.init(params)), flags[:5])
    assert 0 < int(s_mid.growth_tracker) < 5  # mid growth interval
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "ckpt", {"params": p_mid, "opt_state": s_mid})
    ckpt.wait_until_finished()
    target = jax.tree_util.tree_map(
        ocp.utils.to_shape_dtype_struct, {"params": p_mid, "opt_state": s_mid}
    )
    restored = ckpt.restore(tmp_path / "ckpt", target)
    assert isinstance(restored["opt_state"], LossScaleState)
    assert bits(restored) == bits({"params": p_mid, "opt_state": s_mid})

    (p_end, s_end), scales_b = run((restored["params"], restored["opt_state"]), flags[5:])
    np.testing.assert_array_equal(np.concatenate([scales_a, scales_b]), scales_full)
    assert bits((p_end, s_end)) == bits((p_full, s_full))


def test_all_finite_helper():
    assert bool(all_finite({"a": jnp.ones(3), "i": jnp.arange(3)}))
    assert not bool(all_finite([jnp.ones(3), jnp.asarray([-jnp.inf])]))
    assert not bool(all_finite(jnp.asarray([jnp.nan], jnp.float16)))
    assert bool(all_finite({}))


def test_inner_state_keeps_its_dtypes_with_half_precision_params():
    """Pure-f16 params: Adam's f16 moments stay f16 although the unscaled grads are f32."""
    params = {"w": jnp.ones((3,), jnp.float16)}
    tx = DynamicLossScale(optax.adam(1e-3), init_scale=2.0**4)
    state = tx.init(params)
    before = jax.tree_util.tree_map(lambda a: jnp.result_type(a), state)
    updates, state = jax.jit(tx.update)({"w": jnp.full((3,), 3.0, jnp.float16)}, state, params)
    after = jax.tree_util.tree_map(lambda a: jnp.result_type(a), state)
    assert before == after
    assert state.inner_state[0].mu["w"].dtype == jnp.float16
    assert float(state.inner_state[0].mu["w"][0]) != 0.0  # the step was applied


# --------------------------------------------------------------------------- several losses
#
# apex's num_losses / loss_id: one scale per loss. Gradients of loss i are unscaled by
# scale i and checked on their own; the step is skipped if any loss overflowed; each
# scale moves by its own flag only (a finite loss counts a finite step even when another
# loss overflowed: apex's LossScaler.update_scale runs per loss_id).

POISON = (None, np.inf, -np.inf, np.nan)  # code 0: finite, 1: inf, 2: -inf, 3: NaN
MULTI_PARAMS = {"w": jnp.zeros((2,), jnp.float32)}


def multi_reference(codes, *, init, growth, backoff, interval, hysteresis, min_scale, max_scale,
                    lr, coeffs):
    """Pure-python rule for k losses: per-loss Megatron/torch rule, skip if any overflowed.

    Loss i's gradient (unscaled) is ``coeffs[i]``; SGD with rate ``lr``. Returns per step
    the scales, growth trackers, hysteresis trackers [k], applied, steps_skipped, params.
    """
    f32 = np.float32
    k = len(coeffs)
    scale = [f32(init)] * k
    gt, ht = [0] * k, [hysteresis] * k
    params, skipped = np.zeros(2, f32), 0
    out = []
    for code in codes:
        finite = [c == 0 for c in code]
        applied = all(finite)
        if applied:
            total = functools.reduce(np.add, [np.asarray(c, f32) for c in coeffs])
            params = (params + (-f32(lr)) * total).astype(f32)
        else:
            skipped += 1
        for i in range(k):
            if not finite[i]:
                gt[i] = 0
                ht[i] = max(ht[i] - 1, 0)
                if ht[i] <= 0:
                    scale[i] = max(f32(scale[i] * f32(backoff)), f32(min_scale))
            else:
                gt[i] += 1
                if gt[i] == interval:
                    gt[i], ht[i] = 0, hysteresis
                    scale[i] = min(f32(scale[i] * f32(growth)), f32(max_scale))
        out.append((list(scale), list(gt), list(ht), applied, skipped, params.copy()))
    return out


def multi_scan(tx, coeffs, dtype=jnp.float32, params=MULTI_PARAMS):
    """A jitted run of ``tx`` (num_losses=len(coeffs)) over per-step, per-loss poison codes.

    Loss i is ``sum(w * coeffs[i])``; its gradient comes from ``jax.grad`` of
    ``scale_loss(loss_i, state, loss_id=i)``, cast to ``dtype``, with element ``i % 2``
    replaced by the poison of ``code[i]``.
    """
    k = len(coeffs)
    poison = jnp.asarray([0.0, np.inf, -np.inf, np.nan], jnp.float32)
    coeffs = jnp.asarray(coeffs, jnp.float32)

    def body(carry, code):
        p, state = carry
        trees = []
        for i in range(k):
            g = jax.grad(lambda q, i=i: scale_loss(jnp.sum(q["w"] * coeffs[i]), state,
                                                   loss_id=i))(p)["w"]
            g = g.at[i % 2].set(jnp.where(code[i] > 0, poison[code[i]], g[i % 2]))
            trees.append({"w": g.astype(dtype)})
        updates, state = tx.update(tuple(trees), state, p)
        p = optax.apply_updates(p, updates)
        applied = jnp.any(updates["w"] != 0)
        return (p, state), (state.scale, state.growth_tracker, state.hysteresis_tracker,
                            applied, state.steps_skipped, p["w"])

    return jax.jit(lambda x: jax.lax.scan(body, (params, tx.init(params)), x))


def multi_trajectory(tx, codes, coeffs, dtype=jnp.float32, params=MULTI_PARAMS):
    """Runs :func:`multi_scan` on ``codes``: the per-step outputs as numpy, the final state."""
    (_, state), out = multi_scan(tx, coeffs, dtype, params)(jnp.asarray(codes, jnp.int32))
    return [np.asarray(x) for x in out], state


def assert_matches_reference(out, ref):
    scales, gts, hts, applied, skipped, params = out
    np.testing.assert_array_equal(scales, np.asarray([r[0] for r in ref], np.float32))
    np.testing.assert_array_equal(gts, np.asarray([r[1] for r in ref]))
    np.testing.assert_array_equal(hts, np.asarray([r[2] for r in ref]))
    np.testing.assert_array_equal(applied, np.asarray([r[3] for r in ref]))
    np.testing.assert_array_equal(skipped, np.asarray([r[4] for r in ref]))
    np.testing.assert_array_equal(params, np.asarray([r[5] for r in ref], np.float32))


MULTI_HP = {2: dict(hysteresis=1, interval=2), 3: dict(hysteresis=2, interval=3)}
COEFFS = {2: [[1.0, 2.0], [0.5, 4.0]], 3: [[1.0, 2.0], [0.5, 4.0], [2.0, 0.25]]}


@functools.cache
def multi_runner(k, dtype_name):
    hp = MULTI_HP[k]
    tx = DynamicLossScale(optax.sgd(0.5), init_scale=2.0**4, growth_interval=hp["interval"],
                          hysteresis=hp["hysteresis"], min_scale=2.0**-2, max_scale=2.0**9,
                          num_losses=k)
    dtype = jnp.dtype(dtype_name)
    return multi_scan(tx, COEFFS[k], dtype)


@settings(max_examples=30, deadline=None)
@given(
    k=st.sampled_from([2, 3]),
    dtype_name=st.sampled_from(["float16", "bfloat16", "float32"]),
    data=st.data(),
)
def test_multi_loss_property_matches_python_reference(k, dtype_name, data):
    # Fixed length so that every (k, dtype) compiles once; overflow patterns are drawn
    # with a bias towards finite steps so that growth happens too.
    code = st.sampled_from([0, 0, 0, 1, 2, 3])
    codes = data.draw(st.lists(st.lists(code, min_size=k, max_size=k), min_size=16, max_size=16))
    hp = MULTI_HP[k]
    ref = multi_reference(codes, init=2.0**4, growth=2.0, backoff=0.5, interval=hp["interval"],
                          hysteresis=hp["hysteresis"], min_scale=2.0**-2, max_scale=2.0**9,
                          lr=0.5, coeffs=COEFFS[k])
    _, out = multi_runner(k, dtype_name)(jnp.asarray(codes, jnp.int32))
    assert_matches_reference([np.asarray(x) for x in out], ref)


def test_multi_loss_hysteresis_by_hand():
    # k=2, hysteresis 2, growth every 2 finite steps of that loss, init 16.
    tx = DynamicLossScale(optax.sgd(0.5), init_scale=16.0, growth_interval=2, hysteresis=2,
                          min_scale=1.0, num_losses=2)
    codes = [[1, 0],   # loss 0 spends one hysteresis (no back-off); loss 1 counts 1; skipped
             [3, 0],   # loss 0 backs off 16 -> 8; loss 1 grows 16 -> 32 although skipped
             [0, 2],   # loss 1 spends hysteresis; loss 0 counts 1; skipped
             [0, 0],   # loss 0 grows 8 -> 16 (hysteresis reset); loss 1 counts 1; applied
             [0, 1],   # loss 1 backs off 32 -> 16 (its hysteresis was 1); skipped
             [0, 0]]   # loss 0 grows 16 -> 32 (2nd finite in a row); loss 1 counts; applied
    expected_scales = [[16, 16], [8, 32], [8, 32], [16, 32], [16, 16], [32, 16]]
    expected_growth = [[0, 1], [0, 0], [1, 0], [0, 1], [1, 0], [0, 1]]
    expected_hyst = [[1, 2], [0, 2], [0, 1], [2, 1], [2, 0], [2, 0]]
    expected_applied = [False, False, False, True, False, True]
    (scales, gts, hts, applied, skipped, params), state = multi_trajectory(
        tx, codes, COEFFS[2])
    np.testing.assert_array_equal(scales, np.asarray(expected_scales, np.float32))
    np.testing.assert_array_equal(gts, expected_growth)
    np.testing.assert_array_equal(hts, expected_hyst)
    np.testing.assert_array_equal(applied, expected_applied)
    np.testing.assert_array_equal(skipped, [1, 2, 3, 3, 4, 4])
    # two applied steps of -0.5 * (c0 + c1) = -0.5 * [1.5, 6]
    np.testing.assert_array_equal(params[-1], np.asarray([-1.5, -6.0], np.float32))
    assert state.scale.shape == (2,) and state.steps_skipped.shape == ()
    assert bool(state.last_finite)


def test_multi_loss_state_layout_and_helpers():
    tx = DynamicLossScale(optax.adam(1e-3), init_scale=2.0**8, hysteresis=3, num_losses=3)
    state = tx.init(MULTI_PARAMS)
    assert isinstance(state, LossScaleState)
    for field in ("scale", "growth_tracker", "hysteresis_tracker"):
        assert getattr(state, field).shape == (3,)
    assert state.scale.dtype == jnp.float32 and state.growth_tracker.dtype == jnp.int32
    np.testing.assert_array_equal(state.hysteresis_tracker, [3, 3, 3])
    for field in ("steps_skipped", "consecutive_overflows", "last_finite",
                  "min_scale_overflows", "diverged"):
        assert getattr(state, field).shape == ()
    assert loss_scale(state).shape == (3,)
    assert loss_scale(state, loss_id=1).shape == ()
    assert float(scale_loss(jnp.asarray(2.0, jnp.bfloat16), state, loss_id=2)) == 512.0
    assert scale_loss(jnp.asarray(2.0, jnp.bfloat16), state, loss_id=2).dtype == jnp.float32
    # one loss: unchanged scalar shapes
    one = DynamicLossScale(optax.adam(1e-3), num_losses=1).init(MULTI_PARAMS)
    assert one.scale.shape == () and loss_scale(one, loss_id=0).shape == ()


def test_multi_loss_skip_is_exact_and_sums_unscaled_gradients(skip_form):
    params = {"w": jnp.asarray([1.0, -0.0, 3.0])}
    tx = DynamicLossScale(optax.adam(1e-2), init_scale=2.0**4, num_losses=2)
    state = tx.init(params)
    g0 = {"w": jnp.asarray([16.0, 32.0, 48.0])}   # unscaled: [1, 2, 3]
    good = {"w": jnp.asarray([8.0, 16.0, 0.0])}   # unscaled: [.5, 1, 0]
    bad = {"w": jnp.asarray([8.0, jnp.nan, 0.0])}
    updates, skipped = jax.jit(tx.update)((g0, bad), state, params)
    assert bits(skipped.inner_state) == bits(state.inner_state)
    assert bits(optax.apply_updates(params, updates)) == bits(params)
    updates, stepped = jax.jit(tx.update)((g0, good), state, params)
    _, inner = optax.adam(1e-2).update({"w": jnp.asarray([1.5, 3.0, 3.0])},
                                       optax.adam(1e-2).init(params), params)
    assert bits(stepped.inner_state) == bits(inner)
    # the bare form: zeros on overflow, the sum otherwise
    bare = DynamicLossScale(init_scale=2.0**4, num_losses=2)
    u, _ = bare.update((g0, good), bare.init(params))
    np.testing.assert_array_equal(u["w"], [1.5, 3.0, 3.0])
    u, _ = bare.update((g0, bad), bare.init(params))
    np.testing.assert_array_equal(u["w"], [0.0, 0.0, 0.0])


def test_multi_loss_divergence_counts_only_when_every_overflowing_loss_is_at_min():
    tx = DynamicLossScale(optax.sgd(0.1), init_scale=2.0, min_scale=1.0, num_losses=2,
                          divergence_steps=3)
    state = tx.init(MULTI_PARAMS)
    inf = {"w": jnp.full((2,), jnp.inf)}
    ok = {"w": jnp.ones(2)}
    step = jax.jit(tx.update)
    _, state = step((inf, ok), state, MULTI_PARAMS)   # loss 0: 2 -> 1, not yet at min
    assert int(state.min_scale_overflows) == 0
    _, state = step((inf, ok), state, MULTI_PARAMS)   # loss 0 at min
    assert int(state.min_scale_overflows) == 1
    _, state = step((ok, inf), state, MULTI_PARAMS)   # loss 1 at 2: can still back off
    assert int(state.min_scale_overflows) == 0
    _, state = step((inf, ok), state, MULTI_PARAMS)   # loss 0 at min; a finite step
    _, state = step((inf, inf), state, MULTI_PARAMS)  # both at min
    assert int(state.min_scale_overflows) == 2 and not bool(state.diverged)
    _, state = step((inf, ok), state, MULTI_PARAMS)
    assert bool(state.diverged)
    with pytest.raises(LossScaleDivergedError, match=r"minimum \(1, 1\)"):
        check_divergence(state)


def test_static_and_noop_with_several_losses():
    tx = StaticLossScale(8.0, optax.sgd(1.0), num_losses=2)
    state = tx.init(MULTI_PARAMS)
    np.testing.assert_array_equal(loss_scale(state), [8.0, 8.0])
    u, state = tx.update(({"w": jnp.full((2,), 8.0)}, {"w": jnp.full((2,), 16.0)}), state,
                         MULTI_PARAMS)
    np.testing.assert_array_equal(u["w"], [-3.0, -3.0])
    u, state = tx.update(({"w": jnp.full((2,), 8.0)}, {"w": jnp.full((2,), jnp.inf)}), state,
                         MULTI_PARAMS)
    np.testing.assert_array_equal(u["w"], [0.0, 0.0])
    np.testing.assert_array_equal(loss_scale(state), [8.0, 8.0])
    assert int(overflow_stats(state).steps_skipped) == 1
    noop = NoOpLossScale(optax.sgd(1.0), num_losses=2)
    nstate = noop.init(MULTI_PARAMS)
    np.testing.assert_array_equal(loss_scale(nstate), [1.0, 1.0])
    u, _ = noop.update(({"w": jnp.ones(2)}, {"w": jnp.full((2,), 2.0)}), nstate, MULTI_PARAMS)
    np.testing.assert_array_equal(u["w"], [-3.0, -3.0])


def test_config_num_losses_and_verbose():
    config = LossScaleConfig("dynamic", init_scale=4.0, num_losses=2, verbose=True)
    assert config.uses("num_losses") and config.uses("verbose")
    assert LossScaleConfig("static").uses("num_losses")
    assert not LossScaleConfig("static").uses("verbose")
    state = config.wrap(optax.sgd(0.1)).init(MULTI_PARAMS)
    np.testing.assert_array_equal(loss_scale(state), [4.0, 4.0])
    for kind in ("static", "none"):
        state = LossScaleConfig(kind, init_scale=4.0, num_losses=3).wrap(None).init(MULTI_PARAMS)
        assert loss_scale(state).shape == (3,)
    with pytest.raises(ValueError, match="num_losses must be"):
        LossScaleConfig("dynamic", num_losses=0)
    with pytest.raises(ValueError, match="verbose must be True or False"):
        LossScaleConfig("dynamic", verbose="yes")


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, None, "2"])
def test_num_losses_validation(bad):
    for make in (lambda: DynamicLossScale(optax.sgd(0.1), num_losses=bad),
                 lambda: StaticLossScale(2.0, optax.sgd(0.1), num_losses=bad),
                 lambda: NoOpLossScale(optax.sgd(0.1), num_losses=bad)):
        with pytest.raises(ValueError, match=r"num_losses must be .*num_losses=2"):
            make()


def test_loss_id_validation():
    two = DynamicLossScale(optax.sgd(0.1), num_losses=2).init(MULTI_PARAMS)
    one = DynamicLossScale(optax.sgd(0.1)).init(MULTI_PARAMS)
    loss = jnp.asarray(1.0)
    for bad in (2, -1, True, 1.0, "0"):
        with pytest.raises(ValueError, match=r"loss_id must be an int in \[0, num_losses\) = "
                                             r"\[0, 2\).*0\.\.1"):
            scale_loss(loss, two, loss_id=bad)
        with pytest.raises(ValueError, match=r"\[0, 2\)"):
            loss_scale(two, loss_id=bad)
    with pytest.raises(ValueError, match=r"num_losses=1.*drop loss_id.*num_losses=k"):
        scale_loss(loss, one, loss_id=1)
    with pytest.raises(ValueError, match="num_losses=1"):
        loss_scale(one, loss_id=1)
    assert float(scale_loss(loss, one, loss_id=0)) == 65536.0
    assert float(scale_loss(loss, two, loss_id=np.int32(1))) == 65536.0


def test_wrong_number_of_gradient_trees():
    tx = DynamicLossScale(optax.sgd(0.1), num_losses=2)
    state = tx.init(MULTI_PARAMS)
    g = {"w": jnp.ones(2)}
    with pytest.raises(ValueError, match=r"got 3 gradient trees for num_losses=2.*tuple of 2"):
        tx.update((g, g, g), state, MULTI_PARAMS)
    with pytest.raises(ValueError, match=r"got 1 gradient trees for num_losses=2"):
        tx.update([g], state, MULTI_PARAMS)
    with pytest.raises(ValueError, match=r"got gradients of type dict.*tuple of 2"):
        tx.update(g, state, MULTI_PARAMS)
    with pytest.raises(ValueError, match="differ in structure"):
        tx.update((g, {"v": jnp.ones(2)}), state, MULTI_PARAMS)
    # params that are themselves a 2-tuple: a single gradient tree is recognised
    pair = (jnp.ones(2), jnp.ones(3))
    pstate = tx.init(pair)
    with pytest.raises(ValueError, match="one gradient tree shaped like params"):
        tx.update(pair, pstate, pair)
    tx.update((pair, pair), pstate, pair)  # the right form works
    with pytest.raises(ValueError, match=r"got 3 gradient trees for num_losses=2"):
        NoOpLossScale(optax.sgd(0.1), num_losses=2).update((g, g, g), state, MULTI_PARAMS)


def test_multi_loss_pytree_and_orbax_round_trip(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    tx = DynamicLossScale(optax.adam(1e-2), init_scale=2.0**6, growth_interval=3, hysteresis=2,
                          num_losses=2)
    params = {"w": jnp.asarray([0.25, -1.0])}
    codes = jnp.asarray([[0, 0], [1, 0], [1, 0], [0, 0], [0, 0], [2, 2], [0, 3], [0, 0],
                         [0, 0], [1, 0], [0, 0], [0, 0]], jnp.int32)

    def body(carry, code):
        p, s = carry
        trees = tuple({"w": jnp.where(code[i] > 0, jnp.inf, (p["w"] + i + 1.0) *
                                      loss_scale(s, loss_id=i))} for i in range(2))
        u, s = tx.update(trees, s, p)
        return (optax.apply_updates(p, u), s), loss_scale(s)

    run = jax.jit(lambda c, x: jax.lax.scan(body, c, x))
    (p_full, s_full), scales_full = run((params, tx.init(params)), codes)
    (p_mid, s_mid), scales_a = run((params, tx.init(params)), codes[:5])
    assert np.any(np.asarray(s_mid.growth_tracker) > 0)
    assert len(set(np.asarray(s_mid.scale).tolist())) == 2  # the two scales differ

    leaves, treedef = jax.tree_util.tree_flatten((p_mid, s_mid))
    flat = jax.tree_util.tree_unflatten(treedef, [np.asarray(x) for x in leaves])
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "ckpt", {"params": p_mid, "opt_state": s_mid})
    ckpt.wait_until_finished()
    target = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct,
                                    {"params": p_mid, "opt_state": s_mid})
    restored = ckpt.restore(tmp_path / "ckpt", target)
    assert isinstance(restored["opt_state"], LossScaleState)
    assert restored["opt_state"].scale.shape == (2,)
    for start in (flat, (restored["params"], restored["opt_state"])):
        assert bits(start) == bits((p_mid, s_mid))
        (p_end, s_end), scales_b = run(start, codes[5:])
        np.testing.assert_array_equal(np.concatenate([scales_a, scales_b]), scales_full)
        assert bits((p_end, s_end)) == bits((p_full, s_full))


# --------------------------------------------------------------------------- verbose


def _jaxpr_text(tx, grads, params):
    return str(jax.make_jaxpr(tx.update)(grads, tx.init(params), params))


@pytest.mark.parametrize("num_losses", [1, 2])
def test_verbose_false_adds_no_callback(num_losses):
    g = {"w": jnp.ones(2)}
    grads = g if num_losses == 1 else (g,) * num_losses
    quiet = DynamicLossScale(optax.sgd(0.1), num_losses=num_losses)
    loud = DynamicLossScale(optax.sgd(0.1), num_losses=num_losses, verbose=True)
    assert "debug_callback" not in _jaxpr_text(quiet, grads, MULTI_PARAMS)
    assert "debug_callback" in _jaxpr_text(loud, grads, MULTI_PARAMS)
    cfg = LossScaleConfig("dynamic", num_losses=num_losses)
    assert "debug_callback" not in _jaxpr_text(cfg.wrap(optax.sgd(0.1)), grads, MULTI_PARAMS)


def test_verbose_prints_one_line_per_change(capsys, monkeypatch):
    monkeypatch.setattr(loss_scale_module, "_VERBOSE_MIN_INTERVAL_S", 0.0)
    tx = DynamicLossScale(optax.sgd(0.1), init_scale=2.0**16, growth_interval=2, verbose=True)
    state = tx.init(MULTI_PARAMS)
    step = jax.jit(tx.update)
    inf, ok = {"w": jnp.full((2,), jnp.inf)}, {"w": jnp.ones(2)}
    for g in (inf, ok, ok, ok):
        _, state = step(g, state, MULTI_PARAMS)
    jax.effects_barrier()
    assert capsys.readouterr().err.splitlines() == [
        "jamp: loss scale 65536 -> 32768 (overflow, step skipped)",
        "jamp: loss scale 32768 -> 65536 (growth)",
    ]

    two = DynamicLossScale(optax.sgd(0.1), init_scale=2.0**16, growth_interval=1,
                           hysteresis=2, num_losses=2, verbose=True)
    state = two.init(MULTI_PARAMS)
    step = jax.jit(two.update)
    for gs in ((ok, inf), (ok, inf), (ok, ok)):
        _, state = step(gs, state, MULTI_PARAMS)
    jax.effects_barrier()
    assert capsys.readouterr().err.splitlines() == [
        # loss 1 spends its hysteresis: no change of its scale; loss 0 still grows
        "jamp: loss scale 65536 -> 131072 (loss 0, growth, step skipped)",
        "jamp: loss scale 131072 -> 262144 (loss 0, growth, step skipped); "
        "65536 -> 32768 (loss 1, overflow, step skipped)",
        "jamp: loss scale 262144 -> 524288 (loss 0, growth); 32768 -> 65536 (loss 1, growth)",
    ]


def test_verbose_is_rate_limited_on_the_host(capsys, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(loss_scale_module, "_monotonic", lambda: now[0])
    tx = DynamicLossScale(optax.sgd(0.1), init_scale=2.0**10, min_scale=1.0, verbose=True)
    state = tx.init(MULTI_PARAMS)
    step = jax.jit(tx.update)
    inf = {"w": jnp.full((2,), jnp.inf)}
    for t in (100.0, 100.2, 100.9, 101.5, 101.6):
        now[0] = t
        _, state = step(inf, state, MULTI_PARAMS)
        jax.effects_barrier()
    assert capsys.readouterr().err.splitlines() == [
        "jamp: loss scale 1024 -> 512 (overflow, step skipped)",
        "jamp: loss scale 128 -> 64 (overflow, step skipped) [2 earlier change(s) not shown]",
    ]


def test_verbose_validation():
    with pytest.raises(ValueError, match="verbose must be True or False"):
        DynamicLossScale(optax.sgd(0.1), verbose=1)
