"""jamp.attention: the custom-VJP float32 softmax and attention give the true gradients.

Guards against a wrong hand-written backward (e.g. a dropped ``- sum(g * y)`` term): the
custom VJP is compared with autodiff of the plain float32 softmax, and attention gradients
with ``flax.linen.dot_product_attention`` run in float32.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jamp.attention import dot_product_attention, softmax_fp32

DTYPES = [jnp.float16, jnp.bfloat16, jnp.float32]


def _logits(dtype):
    """Rows of ordinary, large, widely spread, masked and fully masked logits."""
    rng = np.random.default_rng(0)
    low = float(jnp.finfo(dtype).min)
    top = 60000.0 if dtype == jnp.float16 else 1e30 if dtype == jnp.float32 else 1e20
    rows = [
        *rng.normal(0.0, 3.0, (6, 16)),                   # ordinary, non-degenerate rows
        rng.normal(0.0, 0.1, 16),                         # nearly uniform
        rng.uniform(-1e4, 1e4, 16),                       # 1e4 spread: nearly one-hot
        np.r_[np.full(8, 60000.0), np.full(8, -60000.0)],  # +-60000 (f16 range)
        np.r_[60000.0, 59000.0, rng.uniform(-60000, 60000, 14)],
        np.r_[top, -top, rng.normal(0, 1, 14)],
        np.where(np.arange(16) < 5, rng.normal(0, 2, 16), low),  # masked, like attention
        np.where(np.arange(16) % 3 == 0, 1e4 * rng.normal(0, 1, 16), low),
        np.full(16, low),                                 # every position masked
    ]
    return jnp.asarray(np.stack(rows), dtype)


def _cotangents(shape, dtype):
    normal = jax.random.normal(jax.random.key(1), shape, jnp.float32)
    # Zero-mean, shifted (sum(g * y) far from 0) and constant (true gradient exactly 0).
    return [g.astype(dtype) for g in (normal, normal + 2.0, jnp.ones(shape))]


def _reference_vjp(x, g):
    _, vjp = jax.vjp(lambda x: jax.nn.softmax(x.astype(jnp.float32)), x)
    return np.asarray(vjp(g.astype(jnp.float32))[0], np.float64)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_softmax_fp32_forward_is_the_float32_softmax_rounded(dtype):
    x = _logits(dtype)
    y = softmax_fp32(x)
    assert y.dtype == dtype
    expected = jax.nn.softmax(x.astype(jnp.float32)).astype(dtype)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(expected, np.float32))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_softmax_fp32_vjp_matches_autodiff_of_float32_softmax(dtype):
    x = _logits(dtype)
    eps = float(jnp.finfo(dtype).eps)
    tiny = float(jnp.finfo(dtype).smallest_subnormal)
    y_out, vjp = jax.vjp(softmax_fp32, x)
    y = np.asarray(jax.nn.softmax(x.astype(jnp.float32)), np.float64)
    for g in _cotangents(x.shape, dtype):
        (dx,) = vjp(g)
        assert dx.dtype == dtype and y_out.dtype == dtype
        got = np.asarray(dx.astype(jnp.float32), np.float64)
        expected = _reference_vjp(x, g)
        g64 = np.asarray(g.astype(jnp.float32), np.float64)
        s = np.sum(g64 * y, -1, keepdims=True)
        # The custom backward uses y rounded to `dtype` and returns dx in `dtype`: each
        # term of y * (g - sum(g * y)) is off by about eps relative, elementwise.
        spread = y * (np.abs(g64) + np.abs(s) + np.sum(np.abs(g64) * y, -1, keepdims=True))
        bound = 2 * eps * (np.abs(expected) + spread) + 4 * tiny * np.abs(g64).max()
        error = np.abs(got - expected)
        worst = tuple(int(i) for i in np.unravel_index(np.argmax(error - bound), error.shape))
        assert np.all(error <= bound), (
            f"dx{worst} = {got[worst]}, autodiff of the f32 softmax gives {expected[worst]}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_softmax_fp32_gradient_of_a_constant_sum_is_zero(dtype):
    # sum(softmax(x)) == 1 for every x, so its gradient is exactly 0 (up to rounding).
    x = _logits(dtype)[:7]
    dx = jax.grad(lambda x: jnp.sum(softmax_fp32(x).astype(jnp.float32)))(x)
    np.testing.assert_allclose(np.asarray(dx, np.float32), 0.0, atol=4 * jnp.finfo(dtype).eps)


def test_softmax_fp32_vjp_on_another_axis():
    x = _logits(jnp.float32)[:7].T  # normalise over axis 0
    g = _cotangents(x.shape, jnp.float32)[1]
    _, vjp = jax.vjp(lambda x: softmax_fp32(x, 0), x)
    _, ref_vjp = jax.vjp(lambda x: jax.nn.softmax(x, axis=0), x)
    np.testing.assert_allclose(vjp(g)[0], ref_vjp(g)[0], rtol=1e-5, atol=1e-6)


# Relative L2 error of the attention gradients against float32 flax: f16/bf16 operands round
# q, k, v, the logits and the probabilities; a wrong softmax backward is off by O(1).
ATTENTION_RTOL = {jnp.float16: 5e-3, jnp.bfloat16: 4e-2, jnp.float32: 1e-5}


def _rel_error(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_dot_product_attention_grads_match_flax_in_float32(dtype):
    keys = jax.random.split(jax.random.key(2), 4)
    shape = (2, 6, 2, 8)  # batch, length, heads, head_dim
    q, k, v = (jax.random.normal(kk, shape, jnp.float32) for kk in keys[:3])
    q = q * 3.0  # peaked attention weights: sum(g * y) is not small
    # The first sequence unmasked, the second causally masked.
    mask = jnp.stack([jnp.ones((1, 6, 6), bool), nn.make_causal_mask(jnp.ones(6))])
    ct = jax.random.normal(keys[3], shape, jnp.float32)

    def jamp_attention(q, k, v):
        return dot_product_attention(q, k, v, mask=mask, deterministic=True)

    def flax_attention(q, k, v):
        return nn.dot_product_attention(q, k, v, mask=mask, deterministic=True)

    args = tuple(a.astype(dtype) for a in (q, k, v))
    out, vjp = jax.vjp(jamp_attention, *args)
    assert out.dtype == dtype
    grads = vjp(ct.astype(dtype))
    ref_out, ref_vjp = jax.vjp(flax_attention, *(a.astype(jnp.float32) for a in args))
    ref_grads = ref_vjp(ct.astype(dtype).astype(jnp.float32))
    tol = ATTENTION_RTOL[dtype]
    assert _rel_error(out.astype(jnp.float32), ref_out) < tol
    for name, got, expected in zip("qkv", grads, ref_grads, strict=True):
        assert got.dtype == dtype
        error = _rel_error(got.astype(jnp.float32), expected)
        assert error < tol, f"d{name}: relative error {error:.2e} > {tol:g}"
