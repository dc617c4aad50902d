"""Tests for jamp.loss_scale: scale rules, exact skips, composition, helpers, errors."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jamp.loss_scale import (
    DynamicLossScale,
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


def test_exact_skip_leaves_adam_bit_identical():
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
def test_skip_keeps_negative_zero_parameters_bit_identical(mode):
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
