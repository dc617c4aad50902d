"""Delayed-scaling fp8 under a changing loss scale: the E5M2 gradient history follows it.

The gradient quantized to E5M2 is the loss-scaled gradient. A run whose loss scale
doubles every step must train exactly like one whose scale stays put (the scales are
powers of two), which holds only if the gradient amax history is rescaled with the
loss scale; a stale history saturates the largest gradients at the E5M2 maximum.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jamp
from jamp import fp8

RECIPE = fp8.Fp8Recipe("delayed", amax_history_length=4)
STEPS = 5


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        del train
        x = nn.relu(nn.Dense(32)(x.reshape(x.shape[0], -1)))
        return nn.Dense(4)(x)


def _batch(i):
    x = jax.random.normal(jax.random.key(i), (16, 4, 4, 1))
    return {"image": x, "label": jnp.arange(16) % 4}


def _run(growth_interval: int):
    model = jamp.apply_policy(MLP(), jamp.mixed_precision("fp8", fp8=RECIPE))
    variables = jax.jit(model.init)(jax.random.key(0), _batch(0)["image"])
    tx = jamp.DynamicLossScale(optax.sgd(0.5), init_scale=4.0, growth_interval=growth_interval)
    state = fp8.TrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx,
                                  fp8=variables[fp8.COLLECTION])
    step = jax.jit(jamp.train_step)
    scales = []
    for i in range(STEPS):
        state, metrics = step(state, _batch(i), jax.random.key(i))
        scales.append(float(metrics["loss_scale"]))
    return state, scales


@pytest.fixture(scope="module")
def runs():
    return _run(10_000), _run(1)


def _grad_histories(state):
    return [np.asarray(m["output_grad_amax_history"]) for m in
            (state.fp8["Dense_0"]["Fp8DirectDotGeneralOp_0"],
             state.fp8["Dense_1"]["Fp8DirectDotGeneralOp_0"])]


def test_a_growing_loss_scale_trains_exactly_like_a_constant_one(runs):
    (steady, steady_scales), (growing, growing_scales) = runs
    assert steady_scales == [4.0] * STEPS
    assert growing_scales == [4.0 * 2**i for i in range(STEPS)]
    for a, b in zip(jax.tree_util.tree_leaves(steady.params),
                    jax.tree_util.tree_leaves(growing.params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_gradient_history_is_in_units_of_the_next_loss_scale(runs):
    (steady, _), (growing, _) = runs
    ratio = float(jamp.loss_scale(growing.opt_state)) / float(jamp.loss_scale(steady.opt_state))
    assert ratio == 2.0**STEPS
    for a, b in zip(_grad_histories(steady), _grad_histories(growing), strict=True):
        assert (a > 0).sum() == 4  # the history is full: every slot was recorded
        np.testing.assert_array_equal(b, a * ratio)
    for name in ("input_amax_history", "kernel_amax_history"):  # unscaled: unchanged
        for layer in ("Dense_0", "Dense_1"):
            np.testing.assert_array_equal(
                growing.fp8[layer]["Fp8DirectDotGeneralOp_0"][name],
                steady.fp8[layer]["Fp8DirectDotGeneralOp_0"][name])
