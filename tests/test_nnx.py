"""Policies on Flax NNX models, and loss scaling with ``nnx.Optimizer`` (issue 13, items 1, 3).

For an MLP with a custom ``nnx.Param`` layer, an attention block (``nnx.MultiHeadAttention``
and a custom softmax), a BatchNorm CNN with dropout and a scanned/vmapped/rematted stack, in
every mode, from the jaxprs of the forward pass and of the gradient: dot/conv operands in the
compute dtype, softmax in float32 where the mode says so, params in the param dtype (norms in
float32), outputs in the output dtype. Then exact skips, master weights and exact resume.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jaxpr_utils import iter_eqns

import jamp

FLOAT32_SOFTMAX = ("fp16", "bf16", "fp16_naive")
DOTS = ("dot_general", "conv_general_dilated")


# ----------------------------------------------------------------------------- models


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.dense = nnx.Linear(4, 8, rngs=rngs)
        self.norm = nnx.LayerNorm(8, rngs=rngs)
        self.w = nnx.Param(jax.random.normal(rngs.params(), (8, 3)) / 3)  # custom layer

    def __call__(self, x):
        return nnx.relu(self.norm(self.dense(x))) @ self.w


class Attention(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.mha = nnx.MultiHeadAttention(2, 8, decode=False, rngs=rngs)
        self.qk = nnx.Linear(8, 16, rngs=rngs)
        self.norm = nnx.RMSNorm(8, rngs=rngs)

    def __call__(self, x):
        x = self.norm(x + self.mha(x))
        q, k = jnp.split(self.qk(x), 2, axis=-1)
        weights = jax.nn.softmax(q @ k.swapaxes(-1, -2) / 4.0)  # custom attention
        return (weights @ x).mean(axis=1)


class CNN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)
        self.gn = nnx.GroupNorm(4, num_groups=2, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.head = nnx.Linear(4, 3, rngs=rngs)

    def __call__(self, x):
        x = self.drop(nnx.relu(self.gn(self.bn(self.conv(x)))))
        return self.head(x.mean(axis=(1, 2)))


class Stack(nnx.Module):
    """Two blocks created with nnx.vmap, applied with nnx.scan over nnx.remat."""

    def __init__(self, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=2)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs):
            return nnx.Sequential(nnx.Linear(8, 8, rngs=rngs), nnx.LayerNorm(8, rngs=rngs))

        self.blocks = blocks(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        @nnx.remat
        def step(x, block):
            return block(x)

        return step(x, self.blocks)


MODELS = {"mlp": (MLP, (2, 4)), "attention": (Attention, (2, 3, 8)), "cnn": (CNN, (2, 5, 5, 1)),
          "stack": (Stack, (2, 8))}


def _jaxprs(model, shape):
    """The jaxprs of the forward pass and of the gradient, and the forward's output."""
    x = jnp.linspace(-1.0, 1.0, np.prod(shape)).reshape(shape)
    loss = lambda m: jnp.sum(m(x).astype(jnp.float32))
    fwd, out = jax.make_jaxpr(lambda m: m(x), return_shape=True)(model)
    return fwd, jax.make_jaxpr(lambda m: nnx.grad(loss)(m))(model), out


def _dtypes(jaxpr, names):
    return {str(v.aval.dtype) for e in iter_eqns(jaxpr) if e.primitive.name in names
            for v in e.invars}


# ----------------------------------------------------------------------------- policies


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("mode", jamp.MODES)
def test_jaxpr_contract(mode, name):
    mp = jamp.mixed_precision(mode)
    compute = str(jnp.dtype(mp.policy.compute_dtype))
    cls, shape = MODELS[name]
    model = jamp.apply_policy(cls(nnx.Rngs(0)), mode)
    fwd, grad, out = _jaxprs(model, shape)
    assert out.dtype == mp.policy.output_dtype
    for jaxpr in (fwd, grad):
        assert _dtypes(jaxpr, DOTS) == {compute}, (mode, name)
        exp = _dtypes(jaxpr, ("exp",))
        if name == "attention":  # softmax (both attentions); stats of the norms: rsqrt
            half = compute != "float32" and mode not in FLOAT32_SOFTMAX
            assert exp == ({compute} if half else {"float32"}), (mode, exp)
        assert _dtypes(jaxpr, ("rsqrt",)) == {"float32"}
    for path, param in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        norm = any(str(p).endswith("norm") or p in ("bn", "gn") for p in path) or (
            name == "stack" and path[-2] == 1)
        expected = jnp.float32 if norm and mode in FLOAT32_SOFTMAX else mp.policy.param_dtype
        assert param.get_value().dtype == expected, (path, mode)


def test_norms_return_the_compute_dtype_and_dots_follow():
    model = jamp.apply_policy(MLP(nnx.Rngs(0)), "fp16")
    assert model.norm.dtype == jnp.float16 and model.norm.param_dtype == jnp.float32
    assert model.dense.dtype == jnp.float16
    y = nnx.jit(lambda m, x: m.norm(x))(model, jnp.ones((2, 8), jnp.float16))
    assert y.dtype == jnp.float16


def test_same_weights_in_every_mode_rounded():
    ref = nnx.state(MLP(nnx.Rngs(0)), nnx.Param)
    for mode in ("fp16_naive", "bf16_pure"):
        dtype = jamp.mixed_precision(mode).policy.param_dtype
        got = nnx.state(jamp.apply_policy(MLP(nnx.Rngs(0)), mode), nnx.Param)
        np.testing.assert_array_equal(got["w"].get_value(), ref["w"].get_value().astype(dtype))


def test_model_created_in_half():
    make = lambda: nnx.Linear(3, 2, param_dtype=jnp.float16, rngs=nnx.Rngs(0))
    half = make().kernel.get_value()
    assert jamp.apply_policy(make(), "fp16").kernel.dtype == jnp.float32  # widened, exact
    np.testing.assert_array_equal(jamp.apply_policy(make(), "fp16").kernel.get_value(), half)
    assert jamp.apply_policy(make(), "fp16_naive").kernel.dtype == jnp.float16


def test_split_merge_jit_grad_batchnorm_and_dropout():
    model = jamp.apply_policy(CNN(nnx.Rngs(0)), "bf16")
    graphdef, state = nnx.split(model)
    model = nnx.merge(graphdef, state)
    assert jamp.apply.nnx.policy_of(model).name == "bf16" and isinstance(model, CNN)
    x = jax.random.normal(jax.random.key(1), (4, 5, 5, 1))
    mean0 = model.bn.mean.get_value()
    step = nnx.jit(nnx.value_and_grad(lambda m, x: m(x).astype(jnp.float32).sum()))
    (l1, g1), (l2, _) = step(model, x), step(model, x)
    assert model.bn.mean.get_value().dtype == jnp.float32
    assert not np.array_equal(model.bn.mean.get_value(), mean0)  # statistics updated
    assert l1 != l2  # the dropout rng advanced
    assert g1["conv"]["kernel"].get_value().dtype == jnp.float32
    model.eval()
    a, b = nnx.jit(lambda m: m(x))(model), nnx.jit(lambda m: m(x))(model)
    np.testing.assert_array_equal(a, b)


def test_rngs_passed_to_the_call_advance():
    class Noisy(nnx.Module):
        def __init__(self):
            self.dense = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

        def __call__(self, x, rngs):
            return self.dense(x + jax.random.normal(rngs.noise(), x.shape))

    model, rngs = jamp.apply_policy(Noisy(), "fp16"), nnx.Rngs(noise=1)
    call = nnx.jit(lambda m, x, r: m(x, r))
    first, second = call(model, jnp.ones((1, 2)), rngs), call(model, jnp.ones((1, 2)), rngs)
    assert not np.array_equal(first, second)


def test_clear_errors():
    model = jamp.apply_policy(MLP(nnx.Rngs(0)), "fp16")
    with pytest.raises(ValueError, match="already runs under the jamp policy 'fp16'"):
        jamp.apply_policy(model, "bf16")
    with pytest.raises(ValueError, match="already runs under"):
        jamp.apply_policy(nnx.Sequential(jamp.apply_policy(MLP(nnx.Rngs(0)), "bf16")), "fp16")
    with pytest.raises(ValueError, match="Cannot apply the override"):
        jamp.apply_policy(MLP(nnx.Rngs(0)), "fp16", overrides={nnx.Linear: "p=f32,c=f32,o=f16"})
    with pytest.raises(ValueError, match="Unknown mixed-precision mode|neither a mode"):
        jamp.apply_policy(MLP(nnx.Rngs(0)), "fp17")


def test_per_class_override_keeps_a_layer_in_float32():
    model = jamp.apply_policy(MLP(nnx.Rngs(0)), "fp16", overrides={nnx.Linear: "f32"})
    fwd, _, _ = _jaxprs(model, (2, 4))
    assert sorted(_dtypes(fwd, DOTS)) == ["float16", "float32"]  # Linear f32, x @ w in f16
    assert model.norm.scale.dtype == jnp.float32


# ----------------------------------------------------------------------------- loss scaling


def _setup(mode, tx=None, **settings):
    mp = jamp.mixed_precision(mode, **settings)
    model = jamp.apply_policy(MLP(nnx.Rngs(0)), mp)
    optimizer = nnx.Optimizer(model, jamp.make_optimizer(mp, tx or optax.adam(1e-2)),
                              wrt=nnx.Param)
    return model, optimizer


@nnx.jit
def _step(model, optimizer, x, poison):
    def loss_fn(m):
        loss = jnp.mean((m(x).astype(jnp.float32) - 1.0) ** 2)
        return jamp.scale_loss(loss, optimizer), loss

    grads, loss = nnx.grad(loss_fn, has_aux=True)(model)
    grads = jax.tree.map(lambda g: g + poison.astype(g.dtype), grads)
    optimizer.update(model, grads)
    return loss


def _batch(i):
    return jax.random.normal(jax.random.key(i), (4, 4))


def _bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(nnx.as_pure(tree))]


@pytest.mark.parametrize("mode", ["fp16", "fp16_naive"])
def test_skipped_step_is_exact(mode):
    model, optimizer = _setup(mode)
    _step(model, optimizer, _batch(0), jnp.float32(0))
    for bad in (jnp.inf, -jnp.inf, jnp.nan):
        skipped = int(jamp.overflow_stats(optimizer).steps_skipped)
        params, inner = _bits(nnx.state(model)), _bits(optimizer.opt_state.inner_state)
        _step(model, optimizer, _batch(1), jnp.float32(bad))
        assert _bits(nnx.state(model)) == params and _bits(optimizer.opt_state.inner_state) == inner
        stats = jamp.overflow_stats(optimizer)
        assert int(stats.steps_skipped) == skipped + 1 and not bool(stats.last_finite)
    jamp.check_divergence(optimizer)
    assert float(jamp.loss_scale(nnx.state(optimizer))) < 2.0**16


def test_fp16_naive_master_weights():
    model, optimizer = _setup("fp16_naive", optax.sgd(1e-3))
    assert model.dense.kernel.dtype == jnp.float16 and model.norm.scale.dtype == jnp.float32
    for i in range(3):
        _step(model, optimizer, _batch(i), jnp.float32(0))
    master = jamp.master_params(nnx.as_pure(optimizer.opt_state))
    assert master["dense"]["kernel"].dtype == jnp.float32
    np.testing.assert_array_equal(master["dense"]["kernel"].astype(jnp.float16),
                                  model.dense.kernel.get_value())
    np.testing.assert_array_equal(master["w"].astype(jnp.float16), model.w.get_value())
    assert not np.array_equal(master["w"], master["w"].astype(jnp.float16).astype(jnp.float32))


def _run(model, optimizer, steps):
    out = []
    for i in steps:
        loss = _step(model, optimizer, _batch(i), jnp.float32(jnp.inf if i == 4 else 0))
        out.append((float(loss), float(jamp.loss_scale(optimizer))))
    return out


def test_checkpoint_resume_is_exact_mid_growth_interval(tmp_path):
    settings = dict(growth_interval=4, init_scale=2.0**10)
    straight = _run(*_setup("fp16", **settings), range(6))
    model, optimizer = _setup("fp16", **settings)
    first = _run(model, optimizer, range(3))
    assert int(optimizer.opt_state.growth_tracker.get_value()) == 3  # mid growth interval
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", nnx.state((model, optimizer)))
    checkpointer.wait_until_finished()
    model, optimizer = _setup("fp16", **settings)
    restored = checkpointer.restore(tmp_path / "ckpt", nnx.state((model, optimizer)))
    nnx.update((model, optimizer), restored)
    assert first + _run(model, optimizer, range(3, 6)) == straight
    assert straight[3][1] == 2 * straight[2][1] and straight[4][1] == straight[3][1] / 2


@pytest.mark.parametrize("mode", ["fp16", "bf16"])
def test_nnx_norms_run_in_float32_like_linen_norms(mode):
    # Flax's own promote_dtype would run the affine on half copies of the float32 scale
    # and bias and round the input gradient's two paths to half before adding them.
    import flax.linen as nn

    rng = np.random.default_rng(0)
    # As inside a model: the residual stream arrives in the compute dtype.
    x = jnp.asarray(rng.normal(size=(4, 8)) * 3, jamp.mixed_precision(mode).policy.compute_dtype)
    scale, bias = (jnp.asarray(rng.normal(size=8), jnp.float32) for _ in range(2))
    norm = jamp.apply_policy(nnx.LayerNorm(8, rngs=nnx.Rngs(0)), mode)
    norm.scale.set_value(scale)
    norm.bias.set_value(bias)
    linen = jamp.apply_policy(nn.LayerNorm(), mode)
    variables = {"params": {"scale": scale, "bias": bias}}
    g = jnp.asarray(rng.normal(size=(4, 8)), jnp.float32)
    out_nnx, vjp_nnx = jax.vjp(lambda x: norm(x).astype(jnp.float32), x)
    out_linen, vjp_linen = jax.vjp(lambda x: linen.apply(variables, x).astype(jnp.float32), x)
    np.testing.assert_array_equal(out_nnx, out_linen)
    np.testing.assert_array_equal(vjp_nnx(g)[0], vjp_linen(g)[0])
