"""The policy applied to Flax modules, checked in the jaxpr (not by reading attributes)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_utils import operand_dtypes

import jamp
from jamp.models import vit


class TransformerBlock(nn.Module):
    """Written with no dtype arguments at all."""

    @nn.compact
    def __call__(self, x):
        y = nn.LayerNorm()(x)
        y = nn.MultiHeadDotProductAttention(num_heads=2)(y, y)
        x = x + y
        y = nn.Dense(16)(nn.LayerNorm()(x))
        return x + nn.Dense(8)(nn.gelu(y))


class SmallCNN(nn.Module):
    """Written with no dtype arguments at all."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(4, (3, 3))(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(x))
        return nn.Dense(3)(x.mean(axis=(1, 2)))


BLOCK_INPUT = jnp.ones((2, 5, 8))
CNN_INPUT = jnp.ones((2, 6, 6, 1))


def _forward(model, x):
    variables = model.init(jax.random.key(0), x)

    def fn(variables, x):
        out, _ = model.apply(variables, x, mutable=["batch_stats"])
        return out

    return variables, fn


def _param_dtypes(variables):
    return {str(a.dtype) for a in jax.tree_util.tree_leaves(variables["params"])}


def test_fp16_transformer_block_matmuls_in_f16_softmax_and_norm_stats_in_f32():
    model = jamp.apply_policy(TransformerBlock(), "fp16")
    variables, fn = _forward(model, BLOCK_INPUT)
    dots = operand_dtypes(fn, variables, BLOCK_INPUT, primitive="dot_general")
    assert len(dots) == 8  # q, k, v, logits, probs @ v, out, 2 MLP
    assert set(dots) == {("float16", "float16")}
    # Softmax: exp and max in f32. LayerNorm: rsqrt of the f32 variance.
    assert set(operand_dtypes(fn, variables, BLOCK_INPUT, primitive="exp")) == {("float32",)}
    assert set(operand_dtypes(fn, variables, BLOCK_INPUT, primitive="rsqrt")) == {("float32",)}
    assert _param_dtypes(variables) == {"float32"}
    assert fn(variables, BLOCK_INPUT).dtype == jnp.float32


def test_fp16_cnn_conv_in_f16_batchnorm_stats_in_f32():
    model = jamp.apply_policy(SmallCNN(), "fp16")
    variables, fn = _forward(model, CNN_INPUT)
    assert operand_dtypes(fn, variables, CNN_INPUT,
                          primitive="conv_general_dilated") == [("float16", "float16")]
    assert operand_dtypes(fn, variables, CNN_INPUT, primitive="dot_general") == [
        ("float16", "float16")]
    assert set(operand_dtypes(fn, variables, CNN_INPUT, primitive="rsqrt")) == {("float32",)}
    means = operand_dtypes(fn, variables, CNN_INPUT, primitive="reduce_sum")
    assert ("float16",) not in means
    assert {str(a.dtype) for a in jax.tree_util.tree_leaves(variables["batch_stats"])} == {
        "float32"}
    assert _param_dtypes(variables) == {"float32"}
    assert fn(variables, CNN_INPUT).dtype == jnp.float32


def test_bf16_pure_params_compute_and_output_bf16():
    model = jamp.apply_policy(TransformerBlock(), "bf16_pure")
    variables, fn = _forward(model, BLOCK_INPUT)
    assert _param_dtypes(variables) == {"bfloat16"}
    assert set(operand_dtypes(fn, variables, BLOCK_INPUT, primitive="dot_general")) == {
        ("bfloat16", "bfloat16")}
    assert fn(variables, BLOCK_INPUT).dtype == jnp.bfloat16


def test_fp16_naive_params_f16_except_norms():
    model = jamp.apply_policy(SmallCNN(), "fp16_naive")
    variables, fn = _forward(model, CNN_INPUT)
    params = variables["params"]
    assert params["Conv_0"]["kernel"].dtype == jnp.float16
    assert params["Dense_0"]["kernel"].dtype == jnp.float16
    assert params["BatchNorm_0"]["scale"].dtype == jnp.float32
    assert fn(variables, CNN_INPUT).dtype == jnp.float32


def test_param_tree_is_the_wrapped_modules_own():
    plain = TransformerBlock().init(jax.random.key(0), BLOCK_INPUT)
    wrapped = jamp.apply_policy(TransformerBlock(), "fp16").init(jax.random.key(0), BLOCK_INPUT)
    assert jax.tree_util.tree_structure(plain) == jax.tree_util.tree_structure(wrapped)
    for a, b in zip(jax.tree_util.tree_leaves(plain), jax.tree_util.tree_leaves(wrapped),
                    strict=True):
        np.testing.assert_array_equal(a, b)


def test_fp32_mode_matches_the_unwrapped_module_exactly():
    plain = TransformerBlock()
    variables = plain.init(jax.random.key(0), BLOCK_INPUT)
    x = jax.random.normal(jax.random.key(1), BLOCK_INPUT.shape)
    np.testing.assert_array_equal(
        plain.apply(variables, x), jamp.apply_policy(plain, "fp32").apply(variables, x))


def test_policy_overrides_explicit_dtype_arguments_and_leaves_user_module_alone():
    dense = nn.Dense(4, dtype=jnp.float32, param_dtype=jnp.float32)
    model = jamp.apply_policy(dense, "bf16_pure")
    variables = model.init(jax.random.key(0), jnp.ones((1, 3)))
    assert _param_dtypes(variables) == {"bfloat16"}
    dots = operand_dtypes(lambda v, x: model.apply(v, x), variables, jnp.ones((1, 3)),
                          primitive="dot_general")
    assert dots == [("bfloat16", "bfloat16")]
    assert dense.dtype == jnp.float32 and dense.param_dtype == jnp.float32


class MyNorm(nn.LayerNorm):
    pass


class UsesMyNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(MyNorm()(x))


def test_subclass_follows_parent_override_unless_given_its_own():
    # fp16_naive stores params in f16 but the norm override keeps norm params in f32.
    x = jnp.ones((2, 4))
    v = jamp.apply_policy(UsesMyNorm(), "fp16_naive").init(jax.random.key(0), x)
    assert v["params"]["MyNorm_0"]["scale"].dtype == jnp.float32
    assert v["params"]["Dense_0"]["kernel"].dtype == jnp.float16
    mp = jamp.mixed_precision("fp16_naive")
    own = {**dict(mp.overrides), MyNorm: jamp.get_policy("f16")}
    v = jamp.apply_policy(UsesMyNorm(), mp, overrides=own).init(jax.random.key(0), x)
    assert v["params"]["MyNorm_0"]["scale"].dtype == jnp.float16


def test_override_can_keep_a_layer_class_in_f32():
    model = jamp.apply_policy(UsesMyNorm(), "fp16", overrides={nn.Dense: "f32"})
    x = jnp.ones((2, 4))
    v = model.init(jax.random.key(0), x)
    assert operand_dtypes(lambda v, x: model.apply(v, x), v, x, primitive="dot_general") == [
        ("float32", "float32")]


def test_policy_string_and_policy_object_are_accepted():
    for spec in ("p=f32,c=bf16,o=f32", jamp.get_policy("p=f32,c=bf16,o=f32")):
        model = jamp.apply_policy(nn.Dense(2), spec)
        v = model.init(jax.random.key(0), jnp.ones((1, 3)))
        assert operand_dtypes(lambda v, x, m=model: m.apply(v, x), v, jnp.ones((1, 3)),
                              primitive="dot_general") == [("bfloat16", "bfloat16")]
        assert model.apply(v, jnp.ones((1, 3))).dtype == jnp.float32


def test_policy_scope_context_manager():
    dense = nn.Dense(2)
    with jamp.policy_scope("fp16") as mp:
        v = dense.init(jax.random.key(0), jnp.ones((1, 3)))
        out = dense.apply(v, jnp.ones((1, 3)))
    assert mp.name == "fp16" and out.dtype == jnp.float16
    assert dense.apply(v, jnp.ones((1, 3))).dtype == jnp.float32  # outside: untouched


def test_gradients_of_f32_params_are_f32_under_fp16():
    model = jamp.apply_policy(TransformerBlock(), "fp16")
    v = model.init(jax.random.key(0), BLOCK_INPUT)
    grads = jax.grad(lambda p: model.apply({"params": p}, BLOCK_INPUT).sum())(v["params"])
    assert {str(g.dtype) for g in jax.tree_util.tree_leaves(grads)} == {"float32"}


def test_scanned_vit_computes_in_f16_inside_the_scan():
    model = jamp.apply_policy(
        vit.create("ti", num_classes=3, patch_size=4, num_layers=2, hidden_size=16,
                   num_heads=2, mlp_dim=32), "fp16")
    x = jnp.ones((2, 8, 8, 1))
    v = model.init(jax.random.key(0), x)
    dots = operand_dtypes(lambda v, x: model.apply(v, x), v, x, primitive="dot_general")
    assert len(dots) >= 8 and set(dots) == {("float16", "float16")}
    assert set(operand_dtypes(lambda v, x: model.apply(v, x), v, x,
                              primitive="rsqrt")) == {("float32",)}
    leaves = jax.tree_util.tree_leaves(nn.unbox(v["params"]))
    assert {str(a.dtype) for a in leaves} == {"float32"}


# What a module's __call__ received: (module, argument, dtype), recorded at trace time.
_seen: list[tuple[str, str, str]] = []


class CustomInner(nn.Module):
    """Plain jnp math, no Flax layers, no dtype fields: only the policy casts its inputs."""

    @nn.compact
    def __call__(self, x, *, bias):
        _seen.extend([("inner", "x", str(x.dtype)), ("inner", "bias", str(bias.dtype))])
        return jnp.tanh(x) * 2 + bias


class CustomOuter(nn.Module):
    @nn.compact
    def __call__(self, x, ids):
        _seen.extend([("outer", "x", str(x.dtype)), ("outer", "ids", str(ids.dtype))])
        w = self.param("w", nn.initializers.normal(), (x.shape[-1], 3))
        y = (x @ w.astype(x.dtype)).astype(jnp.float32)  # hand the submodule float32 on purpose
        return CustomInner()(y, bias=jnp.ones(3, jnp.float32)) + ids[:, None]


@pytest.mark.parametrize("mode,compute,given", [
    ("fp16", "float16", jnp.float32), ("bf16", "bfloat16", jnp.float32),
    ("fp32", "float32", jnp.bfloat16)])
def test_custom_module_inputs_are_cast_to_compute_dtype_at_every_level(mode, compute, given):
    model = jamp.apply_policy(CustomOuter(), mode)
    x, ids = jnp.ones((2, 4), given), jnp.arange(2, dtype=jnp.int32)
    variables = model.init(jax.random.key(0), x, ids)
    _seen.clear()
    out = model.apply(variables, x, ids)
    # The top-level call, and the nested call although its caller passed float32 (both the
    # positional and the keyword argument); integer arguments are left alone.
    assert _seen == [("outer", "x", compute), ("outer", "ids", "int32"),
                     ("inner", "x", compute), ("inner", "bias", compute)]
    assert out.dtype == model.precision.policy.output_dtype
    assert operand_dtypes(lambda v, x, ids: model.apply(v, x, ids), variables, x, ids,
                          primitive="dot_general") == [(compute, compute)]
    assert variables["params"]["w"].dtype == jnp.float32  # the module's own param dtype


def test_bad_inputs_give_clear_errors():
    with pytest.raises(ValueError, match="neither a mode nor a policy"):
        jamp.apply_policy(nn.Dense(2), "fp17")
    with pytest.raises(TypeError, match="expects a flax.linen.Module"):
        jamp.apply_policy(lambda x: x, "fp16")
    with pytest.raises(TypeError, match="Expected a mode name.*Lightning precision"):
        jamp.apply_policy(nn.Dense(2), 16.5)
    # Lightning's precision=16 is a mode (jamp.seed_keys), not a wrong type.
    assert jamp.apply_policy(nn.Dense(2), 16).precision.name == "fp16"


def test_vit_initial_weights_are_the_same_in_every_mode_up_to_rounding():
    module = vit.create("ti", num_classes=3, patch_size=4, num_layers=2, hidden_size=16,
                        num_heads=2, mlp_dim=32)
    x = jnp.ones((1, 8, 8, 1))

    def init(mode):
        variables = jax.jit(jamp.apply_policy(module, mode).init)(jax.random.key(0), x)
        return jax.tree_util.tree_leaves(nn.unbox(variables["params"]))

    reference = init("fp32")
    for mode, dtype in (("fp16_naive", jnp.float16), ("bf16_pure", jnp.bfloat16)):
        leaves = init(mode)
        assert any(a.dtype == dtype for a in leaves)
        for a, ref in zip(leaves, reference, strict=True):
            np.testing.assert_array_equal(a, ref.astype(a.dtype))
