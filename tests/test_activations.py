"""jamp.models.activations: the same GELU, one residual; and the ViT's MLP keeps two."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jamp.models import vit
from jamp.models.activations import gelu


def _gelu32(v):
    """The reference: jax.nn.gelu in float32, rounded to the input's dtype."""
    return jax.nn.gelu(v.astype(jnp.float32)).astype(v.dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_gelu_values_and_gradients_equal_float32_jax_nn_gelu(dtype):
    x = jnp.concatenate([jnp.linspace(-8.0, 8.0, 101), jnp.array([0.0, -0.0, 1e-4])]).astype(
        dtype)
    assert (gelu(x) == _gelu32(x)).all() and gelu(x).dtype == dtype
    ours, theirs = (jax.grad(lambda v, f=f: (f(v) * jnp.arange(v.size)).sum().astype(
        jnp.float32))(x) for f in (gelu, _gelu32))
    np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(theirs, np.float32))


@pytest.mark.parametrize("value", [jnp.inf, -jnp.inf, jnp.nan])
def test_gelu_passes_bad_values_like_jax_nn_gelu(value):
    x = jnp.array([value, 1.0], jnp.float16)
    grad = lambda f: np.asarray(jax.grad(lambda u: f(u).sum())(x))
    np.testing.assert_array_equal(np.asarray(gelu(x)), np.asarray(_gelu32(x)))
    np.testing.assert_array_equal(grad(gelu), grad(_gelu32))


def _residual_bytes(fn, *args) -> list[int]:
    """The sizes of the arrays (not scalars) the backward pass of ``fn`` keeps."""
    _, vjp_fn = jax.vjp(fn, *args)
    return sorted(a.nbytes for a in jax.tree_util.tree_leaves(vjp_fn) if a.ndim)


def test_gelu_saves_only_its_input():
    x = jnp.ones((4, 64), jnp.bfloat16)
    assert _residual_bytes(lambda v: gelu(v).astype(jnp.float32).sum(), x) == [x.nbytes]
    assert len(_residual_bytes(lambda v: _gelu32(v).astype(jnp.float32).sum(), x)) > 2


def test_vit_mlp_keeps_two_hidden_sized_residuals():
    """fc1's output (GELU's input) and GELU's output (fc2's input): PyTorch's count."""
    block = vit.MlpBlock(mlp_dim=32)
    x = jnp.ones((2, 5, 8), jnp.bfloat16)
    params = block.init(jax.random.key(0), x)
    hidden = 2 * 5 * 32 * 4  # [batch, seq, mlp] in float32 (no policy: float32 params)
    sizes = _residual_bytes(lambda p: block.apply(p, x).astype(jnp.float32).sum(), params)
    assert sizes.count(hidden) == 2, sizes
