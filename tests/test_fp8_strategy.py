"""The fp8 recipe's strategy answers everything that depends on the kind of scaling."""

from __future__ import annotations

import pathlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from flax.training import train_state

import jamp
from jamp import fp8

DELAYED, CURRENT = fp8.Fp8Recipe("delayed", amax_history_length=8), fp8.Fp8Recipe("current")


def test_each_scaling_has_its_strategy():
    assert isinstance(DELAYED.strategy, fp8.DelayedScaling)
    assert DELAYED.strategy.amax_history_length == 8
    assert isinstance(CURRENT.strategy, fp8.CurrentScaling)
    assert DELAYED.strategy.collection == fp8.COLLECTION and CURRENT.strategy.collection is None


def test_linen_install_sets_what_the_strategy_says():
    for recipe, field in ((DELAYED, "dot_general_cls"), (CURRENT, "dot_general")):
        layer = nn.Dense(2).clone()
        assert fp8.linen_install(layer, recipe)
        name, value = recipe.strategy.linen_field()
        assert name == field and getattr(layer, name) is value
    assert fp8.linen_dot_general_cls(DELAYED) is DELAYED.strategy.linen_field()[1]
    assert fp8.linen_share_over_steps(nn.RNN(nn.LSTMCell(4)), DELAYED)
    assert not fp8.linen_share_over_steps(nn.RNN(nn.LSTMCell(4)), CURRENT)


def test_nnx_install_sets_what_the_strategy_says():
    layers = {r.scaling: nnx.Linear(3, 2, rngs=nnx.Rngs(0)) for r in (DELAYED, CURRENT)}
    for recipe in (DELAYED, CURRENT):
        assert fp8.nnx_install(layers[recipe.scaling], recipe)
    assert isinstance(layers["delayed"].dot_general, fp8.DelayedScalingDot)
    assert layers["delayed"].dot_general.input_amax_history.shape == (8,)
    assert layers["current"].dot_general is fp8.current_scaling_dot_general
    assert fp8.nnx_state(layers["current"]) == {}
    assert set(fp8.nnx_state(layers["delayed"])["dot_general"]) == set(fp8.META_NAMES)
    assert DELAYED.strategy.nnx_variables(layers["delayed"])[fp8.COLLECTION].keys() == {
        "dot_general"}
    assert CURRENT.strategy.nnx_variables(layers["current"]) == {}


def test_the_keep_bf16_rule_is_applies_to():
    recipe = fp8.Fp8Recipe("current", keep_bf16=("proj",))
    assert recipe.applies_to("fc") and not recipe.applies_to("proj") and recipe.applies_to(None)
    assert not fp8.linen_install(nn.Dense(2, name="proj").clone(), recipe)
    assert not fp8.nnx_install(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), recipe, "proj")
    assert fp8.nnx_install(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), recipe, "head")


def test_autocast_dot_and_pipeline_hook():
    assert CURRENT.strategy.autocast_dot_general() is fp8.current_scaling_dot_general
    with pytest.raises(ValueError, match="delayed-scaling fp8"):
        DELAYED.strategy.autocast_dot_general()
    with pytest.raises(ValueError, match="delayed-scaling fp8"):
        jamp.autocast(lambda x: x @ x, "fp8")(jnp.ones((2, 2)))
    assert DELAYED.strategy.pipeline_hook() is fp8.only_on_real_data
    assert CURRENT.strategy.pipeline_hook() is None


def test_the_train_state_comes_from_the_strategy():
    meta = {"Dense_0": {"Fp8DirectDotGeneralOp_0": fp8.init_meta(8)}}
    variables = {fp8.COLLECTION: meta}
    make = lambda r: r.strategy.create_train_state(apply_fn=None, params={"w": jnp.ones(2)},
                                                   tx=optax.sgd(0.1), variables=variables)
    delayed, current = make(DELAYED), make(CURRENT)
    assert isinstance(delayed, fp8.TrainState) and delayed.fp8 is meta
    assert delayed.differentiated_variables() == {fp8.COLLECTION: meta}
    assert type(current) is train_state.TrainState


def test_no_string_switch_on_the_scaling_outside_the_package():
    root = pathlib.Path(jamp.__file__).parent
    switch = re.compile(r"\.scaling\s*(==|!=|\bin\b)|scaling\s*==\s*['\"]")
    found = [f"{path.relative_to(root)}:{i}" for path in root.rglob("*.py")
             if "fp8" not in path.relative_to(root).parts[:1]
             for i, line in enumerate(path.read_text().splitlines(), 1) if switch.search(line)]
    assert found == []


def test_a_delayed_step_commits_through_the_state():
    """End to end: the step differentiates the strategy's state and commits it."""
    model = jamp.apply_policy(nn.Dense(3), "fp8")
    images = jnp.ones((2, 4))
    variables = model.init(jax.random.key(0), images)
    mp = jamp.mixed_precision("fp8")
    state = mp.fp8.strategy.create_train_state(
        apply_fn=lambda v, x, train=False, rngs=None: model.apply(v, x), params=variables["params"],
        tx=jamp.make_optimizer(mp, optax.sgd(0.1)), variables=variables)
    state, _ = jax.jit(jamp.train_step)(state, {"image": images, "label": jnp.array([0, 1])},
                                        jax.random.key(1))
    history = state.fp8["Fp8DirectDotGeneralOp_0"]["input_amax_history"]
    assert float(history[0]) == 1.0
