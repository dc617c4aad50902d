"""``jamp.autocast`` keeps what a function means (issue 23, item 2).

Models written as Equinox and Haiku write them (plain jnp): masked attention with
``finfo.min`` and ``-1e30`` fills on a padded batch, BatchNorm with state, a LayerNorm that
upcasts itself, a ReLU MLP; each compared with float32 and with the model written in half
precision by hand.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_utils import iter_eqns

import jamp
from benchmarks import autocast_meaning as models

HALF = {"fp16": jnp.float16, "bf16": jnp.bfloat16}


def _finite(tree) -> bool:
    return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tree))


def _half(tree, dtype):
    return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating)
                        else a, tree)


# ----------------------------------------------------------------------------- masks


@pytest.mark.parametrize(("mode", "fill"), [("bf16", "finfo"), ("fp16", "finfo"),
                                            ("fp16", -1e30), ("bf16", -1e30)])
def test_masked_attention_with_a_fully_masked_row_is_finite(mode, fill):
    params, x, mask, valid = models.attention_case()
    loss = lambda p, x: models.attention_loss(p, x, mask, valid, fill)
    value, grads = jax.value_and_grad(jamp.autocast(loss, mode))(params, x)
    reference, reference_grads = jax.value_and_grad(loss)(params, x)
    assert _finite(value) and _finite(grads), (value, grads)
    np.testing.assert_allclose(value, reference, rtol=0.02)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(reference_grads), strict=True):
        np.testing.assert_allclose(g, r, rtol=0.1, atol=0.05)
    if fill == "finfo":  # as written in half by hand (finfo of the half dtype)
        by_hand = loss(*_half((params, x), HALF[mode]))
        np.testing.assert_allclose(value, np.float32(by_hand), rtol=0.02)


# ----------------------------------------------------------------------------- state


@functools.cache
def _running_mean(mode):
    return models.running_mean(mode)


@pytest.mark.parametrize("mode", ["fp16", "bf16"])
def test_batch_norm_running_mean_tracks_float32(mode):
    assert abs(_running_mean(mode) - _running_mean(None)) < 1e-3, (
        _running_mean(mode), _running_mean(None))
    closed = jax.make_jaxpr(jamp.autocast(models.batch_norm_step, mode))(
        {"mean": jnp.ones(4), "var": jnp.ones(4)}, jnp.ones((8, 4)))
    muls = [e for e in iter_eqns(closed) if e.primitive.name == "mul"
            and e.outvars[0].aval.shape == (4,)]
    assert muls and all(e.outvars[0].aval.dtype == jnp.float32 for e in muls)


def test_logits_are_not_state():
    """A bias added to a matmul is no EMA: per batch and per example (Equinox's vmap)."""
    params = models.mlp_params((6, 5, 3))
    for fn, x in ((models.relu_mlp, jnp.ones((2, 6))), (models.relu_mlp, jnp.ones(6))):
        closed = jax.make_jaxpr(jamp.autocast(fn, "bf16"))(params, x)
        adds = [e for e in iter_eqns(closed) if e.primitive.name == "add"]
        assert adds and {e.outvars[0].aval.dtype for e in adds} == {jnp.dtype(jnp.bfloat16)}


# ----------------------------------------------------------------------------- norms


@pytest.mark.parametrize("mode", ["fp16", "bf16"])
def test_layer_norm_that_upcasts_itself_runs_in_float32(mode):
    x = jax.random.normal(jax.random.key(0), (4, 16)) * 3 + 100.0
    w, b = jnp.full(16, 1.5), jnp.full(16, 0.25)
    w0 = jnp.eye(16) + 0.01  # a matmul before the norm: its input is no state
    model = lambda x, w, b: models.layer_norm(x @ w0, w, b)
    fast = jamp.autocast(model, mode)
    closed = jax.make_jaxpr(jax.value_and_grad(lambda *a: fast(*a).sum(), (0, 1, 2)))(x, w, b)
    names = ("sub", "square", "integer_pow", "rsqrt", "mul", "add")
    dtypes = {str(e.outvars[0].aval.dtype) for e in iter_eqns(closed) if e.primitive.name in names
              and e.outvars[0].aval.shape}
    assert dtypes == {"float32"}, dtypes  # x - mean, the square, eps, the affine: all float32
    eps = [v.val for e in iter_eqns(closed) if e.primitive.name == "add" for v in e.invars
           if hasattr(v, "val") and np.ndim(v.val) == 0]
    assert eps and np.float32(1e-5) in [np.float32(v) for v in eps]
    half = HALF[mode]
    by_hand = model(*_half((x, w, b), half))  # its own upcast, as written
    np.testing.assert_allclose(fast(x, w, b), np.float32(by_hand),
                               atol=0.02 if mode == "fp16" else 0.3)  # bf16 rounds x = 100
    np.testing.assert_allclose(fast(x, w, b), model(x, w, b),
                               atol=0.02 if mode == "fp16" else 0.3)


def test_square_is_a_power():
    closed = jax.make_jaxpr(jamp.autocast(lambda x: jnp.square(x) @ x, "fp16"))(jnp.ones((2, 2)))
    assert [str(e.invars[0].aval.dtype) for e in iter_eqns(closed)
            if e.primitive.name == "square"] == ["float32"]


# ----------------------------------------------------------------------------- custom_jvp


def test_relu_mlp_saves_no_more_residuals_than_written_in_half():
    params = models.mlp_params((784, 512, 512, 10))
    x, labels = jax.random.normal(jax.random.key(1), (256, 784)), jnp.arange(256) % 10
    auto = models.residual_bytes(jamp.autocast(models.mlp_loss, "fp16"), params, x, labels)
    by_hand = models.residual_bytes(
        lambda p, x, y: models.mlp_loss(*_half((p, x), jnp.float16), y), params, x, labels)
    f32 = models.residual_bytes(models.mlp_loss, params, x, labels)
    assert auto <= by_hand <= 0.55 * f32, (auto, by_hand, f32)
    # relu's own jvp rule is kept: its derivative at 0 is 0, as in float32
    grad = jax.grad(lambda x: jamp.autocast(jax.nn.relu, "fp16")(x).sum())(jnp.zeros(3))
    np.testing.assert_array_equal(grad, jax.grad(lambda x: jax.nn.relu(x).sum())(jnp.zeros(3)))
