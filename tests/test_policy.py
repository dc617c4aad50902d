import jax.numpy as jnp
import pytest

import jamp


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("params=float32,compute=float16,output=float32", (jnp.float32, jnp.float16, jnp.float32)),
        ("p=f32,c=bf16,o=f32", (jnp.float32, jnp.bfloat16, jnp.float32)),
        ("c=f16", (jnp.float32, jnp.float16, jnp.float16)),
        ("p=f16,c=bf16", (jnp.float16, jnp.bfloat16, jnp.bfloat16)),
        ("bf16", (jnp.bfloat16,) * 3),
        ("full", (jnp.float32,) * 3),
        (" p = f32 , c = f16 ", (jnp.float32, jnp.float16, jnp.float16)),
        ("half", (jnp.float16,) * 3),  # CPU: half is float16, resolved at parse time.
    ],
)
def test_get_policy_accepts_jmp_grammar(spec, expected):
    policy = jamp.get_policy(spec)
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == expected


def test_get_policy_returns_existing_policy_unchanged():
    policy = jamp.Policy(jnp.float32, jnp.float16, jnp.float32)
    assert jamp.get_policy(policy) is policy


@pytest.mark.parametrize(
    "spec, problem",
    [
        ("fp16", "unknown dtype 'fp16'"),
        ("p=f33", "unknown dtype 'f33'"),
        ("x=f32", "unknown key 'x'"),
        ("p=f32,c", "'c' is not of the form key=dtype"),
        ("p=f32=f16", "is not of the form key=dtype"),
        ("", "it is empty"),
        (3, "expected a string or jamp.Policy"),
    ],
)
def test_get_policy_rejects_bad_specs_listing_valid_names(spec, problem):
    with pytest.raises(ValueError) as info:
        jamp.get_policy(spec)
    message = str(info.value)
    assert problem in message
    assert "Valid keys: params, compute, output" in message
    for name in ("bfloat16", "float16", "float32", "bf16", "f16", "f32", "half"):
        assert name in message


F32, F16, BF16 = jnp.float32, jnp.float16, jnp.bfloat16


@pytest.mark.parametrize(
    "name, dtypes, scaling, master",
    [
        ("fp32", (F32, F32, F32), "none", False),
        ("fp16", (F32, F16, F32), "dynamic", False),
        ("bf16", (F32, BF16, F32), "none", False),
        ("fp16_naive", (F16, F16, F32), "dynamic", True),
        ("fp16_pure", (F16, F16, F16), "static", False),
        ("bf16_pure", (BF16, BF16, BF16), "none", False),
    ],
)
def test_named_modes(name, dtypes, scaling, master):
    mp = jamp.mixed_precision(name)
    p = mp.policy
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == dtypes
    assert mp.loss_scale.kind == scaling
    assert mp.master_weights is master
    assert mp.name == name


def test_fp16_mode_scaling_recipe_and_fp32_norms():
    import flax.linen as nn

    mp = jamp.mixed_precision("fp16")
    ls = mp.loss_scale
    assert (ls.init_scale, ls.growth_factor, ls.backoff_factor, ls.growth_interval,
            ls.hysteresis, ls.divergence_steps) == (2.0**16, 2.0, 0.5, 2000, 1, 50)
    assert mp.softmax_fp32
    for cls in (nn.LayerNorm, nn.BatchNorm, nn.GroupNorm, nn.RMSNorm):
        policy = mp.policy_for(cls)
        assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (F32, F32, F16)
    assert mp.policy_for(nn.Dense) is mp.policy


def test_naive_mode_has_hysteresis_two_and_pure_modes_no_overrides():
    assert jamp.mixed_precision("fp16_naive").loss_scale.hysteresis == 2
    assert jamp.mixed_precision("fp16_pure").loss_scale.init_scale == 1.0
    assert jamp.mixed_precision("fp16_pure").overrides == ()
    assert jamp.mixed_precision("bf16_pure").overrides == ()


@pytest.mark.parametrize(
    "alias, canonical",
    [("32", "fp32"), ("O0", "fp32"), ("16", "fp16"), ("16-mixed", "fp16"), ("O1", "fp16"),
     ("bf16-mixed", "bf16"), ("O2", "fp16_naive"), ("O3", "fp16_pure"),
     ("bf16-true", "bf16_pure")],
)
def test_aliases(alias, canonical):
    assert jamp.mixed_precision(alias) == jamp.mixed_precision(canonical)


def test_keyword_overrides_replace_fields():
    mp = jamp.mixed_precision("fp16", init_scale=2**15, hysteresis=1, growth_interval=7)
    ls = mp.loss_scale
    assert (ls.init_scale, ls.hysteresis, ls.growth_interval) == (2**15, 1, 7)
    assert jamp.mixed_precision("fp16").loss_scale.init_scale == 2**16  # base not mutated


def test_replacing_the_policy_keeps_norms_returning_compute_dtype():
    import flax.linen as nn

    mp = jamp.mixed_precision("fp16", policy="p=f32,c=bf16,o=f32")
    assert mp.policy_for(nn.LayerNorm).output_dtype == BF16


def test_unknown_mode_and_field_are_rejected():
    with pytest.raises(ValueError, match="Valid modes: fp32, fp16, bf16, fp16_naive"):
        jamp.mixed_precision("fp4")
    with pytest.raises(ValueError, match="Unknown field.*init_scael.*Valid fields:.*init_scale"):
        jamp.mixed_precision("fp16", init_scael=3)
    with pytest.raises(ValueError, match="kind 'sometimes' is not valid"):
        jamp.mixed_precision("fp16", loss_scale="sometimes")


@pytest.mark.parametrize("mode, field, value", [
    ("bf16", "divergence_steps", 5), ("fp32", "init_scale", 8.0), ("bf16_pure", "hysteresis", 2),
    ("fp16_pure", "hysteresis", 2), ("fp16_pure", "min_scale", 0.5),
    ("fp16_pure", "growth_interval", 10)])
def test_a_loss_scale_setting_the_mode_cannot_use_is_an_error_naming_the_mode(mode, field,
                                                                               value):
    with pytest.raises(ValueError, match=rf"{field} does not apply.*mode '{mode}'"):
        jamp.mixed_precision(mode, **{field: value})


@pytest.mark.parametrize("mode, fields", [
    ("fp16", dict(divergence_steps=7, hysteresis=3, min_scale=2.0)),
    ("fp16_naive", dict(divergence_steps=7, max_scale=2.0**20)),
    ("fp16_pure", dict(divergence_steps=7, init_scale=4.0)),
    ("bf16", dict(loss_scale="dynamic", divergence_steps=7, init_scale=2.0**8))])
def test_every_setting_a_mode_uses_reaches_its_config(mode, fields):
    mp = jamp.mixed_precision(mode, **fields)
    for key, value in fields.items():
        got = mp.loss_scale.kind if key == "loss_scale" else getattr(mp.loss_scale, key)
        assert got == value


def test_loss_scale_config_values_are_checked_when_made():
    with pytest.raises(ValueError, match="growth_interval must be >= 1"):
        jamp.mixed_precision("fp16", growth_interval=0)
    with pytest.raises(ValueError, match="divergence_steps must be >= 1"):
        jamp.mixed_precision("fp16_pure", divergence_steps=0)


def test_every_dtype_name_in_the_error_message_parses():
    from jamp.policy import _DTYPE_NAMES

    for name in _DTYPE_NAMES:
        assert jamp.get_policy(f"c={name}").compute_dtype is not None
    with pytest.raises(ValueError, match="Valid dtype names: bf16, bfloat16"):
        jamp.get_policy("c=float8")


def test_policy_like_is_importable_from_jamp():
    """Signatures name PolicyLike; users can import it to annotate their own code."""
    import typing

    from jamp import MixedPrecision, Policy, PolicyLike

    assert {str, MixedPrecision, Policy} <= set(typing.get_args(PolicyLike))
