"""jamp.models.norms: flax's LayerNorm values, one residual; the ViT's norms keep their input."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jamp
from jamp.models import vit
from jamp.models.norms import LayerNorm


def _variables(x):
    v = nn.LayerNorm().init(jax.random.key(1), x)
    return jax.tree.map(lambda a: a + 0.1 * jax.random.normal(jax.random.key(2), a.shape), v)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_values_and_gradients_equal_flax_layer_norm(dtype):
    x = (3 * jax.random.normal(jax.random.key(0), (4, 7, 32)) + 1).astype(dtype)
    v = _variables(x)
    ours, theirs = LayerNorm().apply(v, x), nn.LayerNorm().apply(v, x)
    assert ours.dtype == theirs.dtype and (ours == theirs).all()
    grads = [jax.grad(lambda v, x, m=m: (m.apply(v, x).astype(jnp.float32)
                                         * jnp.arange(32)).sum(), argnums=(0, 1))(v, x)
             for m in (LayerNorm(), nn.LayerNorm())]
    for a, b in zip(*(jax.tree_util.tree_leaves(g) for g in grads), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("value", [jnp.inf, -jnp.inf, jnp.nan])
def test_bad_values_pass_like_flax(value):
    x = jnp.ones((2, 4)).at[0, 1].set(value)
    v = _variables(x)
    ours, theirs = LayerNorm().apply(v, x), nn.LayerNorm().apply(v, x)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


def test_keeps_only_input_and_parameters():
    x = jnp.ones((4, 9, 32))
    v = _variables(x)

    def kept(module):
        _, vjp_fn = jax.vjp(lambda v: module.apply(v, x).sum(), v)
        return sorted(a.size for a in jax.tree_util.tree_leaves(vjp_fn) if a.ndim)

    assert kept(LayerNorm()) == [32, 32, x.size]


def test_a_policy_runs_it_as_a_norm_in_float32():
    """A subclass of nn.LayerNorm: the norms' float32 override applies (params and output)."""
    model = jamp.apply_policy(LayerNorm(), "fp16_naive")
    x = jnp.ones((2, 8), jnp.float16)
    variables = model.init(jax.random.key(0), x)
    assert variables["params"]["scale"].dtype == jnp.float32


def test_other_settings_are_refused():
    with pytest.raises(ValueError, match="flax.linen.LayerNorm without them"):
        LayerNorm(use_bias=False).init(jax.random.key(0), jnp.ones((1, 3)))
    with pytest.raises(ValueError, match="flax's LayerNorm for other settings"):
        LayerNorm(use_fast_variance=False).init(jax.random.key(0), jnp.ones((1, 3)))


def test_vit_block_keeps_one_float32_input_per_norm():
    """Under bf16, each of a block's two norms keeps its float32 input, nothing more of
    the [batch, seq, embed] size in float32 (flax's LayerNorm: four here)."""
    block = jamp.apply_policy(vit.EncoderBlock(num_heads=2, mlp_dim=32), "bf16")
    x = jnp.ones((2, 5, 16))
    params = block.init(jax.random.key(0), x)
    _, vjp_fn = jax.vjp(lambda p: block.apply(p, x)[0].astype(jnp.float32).sum(), params)
    wide = [a for a in jax.tree_util.tree_leaves(vjp_fn) if a.shape[-3:] == (2, 5, 16)
            or a.shape == (2, 5, 16)]
    assert sum(a.dtype == jnp.float32 for a in wide) == 2, [(a.shape, a.dtype) for a in wide]


def test_nnx_layer_norm_equals_flax_nnx_and_keeps_its_input():
    from flax import nnx

    from jamp.models.norms import NnxLayerNorm

    x = 3 * jax.random.normal(jax.random.key(0), (4, 9, 32)) + 1
    ours, theirs = NnxLayerNorm(32, rngs=nnx.Rngs(0)), nnx.LayerNorm(32, rngs=nnx.Rngs(0))
    assert (ours(x) == theirs(x)).all()
    _, vjp_fn = jax.vjp(lambda x: ours(x).sum(), x)
    assert sorted(a.size for a in jax.tree_util.tree_leaves(vjp_fn) if a.ndim) == [
        32, 32, x.size]
