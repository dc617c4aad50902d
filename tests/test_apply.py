"""jamp.apply: one dispatching apply_policy over the linen and NNX adapters (issue 21, item 2).

The policy layer (``jamp/policy.py``) names no framework; the norm override is the
symbolic ``jamp.policy.NORMS`` that each adapter resolves to its own classes; the
rules both adapters apply (fp8 eligibility, softmax rules) are written once in
``jamp.apply.core``.
"""

import ast
import pathlib

import flax.linen as nn
import jax.numpy as jnp
import pytest
from flax import nnx

import jamp
from jamp.apply import core

ROOT = pathlib.Path(jamp.__file__).parent


def _imported_modules(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_policy_module_imports_no_framework():
    imported = _imported_modules(ROOT / "policy.py")
    assert not {m for m in imported if m == "flax" or m.startswith("flax.")}, imported
    assert "jamp.apply" not in imported  # the adapters depend on the policy, not back


def test_the_adapters_do_not_import_each_other():
    assert "jamp.apply.nnx" not in _imported_modules(ROOT / "apply" / "linen.py")
    assert "jamp.apply.linen" not in _imported_modules(ROOT / "apply" / "nnx.py")


@pytest.mark.parametrize("thing", [lambda x: x, jnp.ones(2), "model", object()])
def test_apply_policy_refuses_anything_but_a_flax_module_naming_what_it_takes(thing):
    with pytest.raises(TypeError, match=r"flax\.linen\.Module or a flax\.nnx\.Module, got "
                                        rf"{type(thing).__name__}\..*jamp\.autocast\(fn, mode\)"):
        jamp.apply_policy(thing, "bf16")


def test_apply_policy_dispatches_on_the_framework():
    assert isinstance(jamp.apply_policy(nn.Dense(2), "bf16"), jamp.PolicyModule)
    linear = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    assert jamp.apply_policy(linear, "bf16") is linear
    assert jamp.apply.nnx.policy_of(linear).name == "bf16"


def test_norms_key_stands_for_each_frameworks_norms_and_their_subclasses():
    mp = jamp.mixed_precision("fp16")
    assert dict(mp.overrides) == {jamp.policy.NORMS: jamp.get_policy("p=f32,c=f32,o=f16")}

    class MyRMSNorm(nnx.RMSNorm):
        pass

    for cls in (nn.LayerNorm, nn.BatchNorm, nn.GroupNorm, nn.RMSNorm, nnx.LayerNorm,
                nnx.BatchNorm, nnx.GroupNorm, nnx.RMSNorm, MyRMSNorm):
        assert mp.policy_for(cls).compute_dtype == jnp.float32, cls
    for cls in (nn.Dense, nnx.Linear, nn.Module, object):
        assert mp.policy_for(cls) is mp.policy, cls
    # Its own class key beats NORMS, which applies only while the recipe has it.
    own = jamp.to_mixed_precision(mp, {**dict(mp.overrides), MyRMSNorm: "f16"})
    assert own.policy_for(MyRMSNorm) == jamp.get_policy("f16")
    assert jamp.to_mixed_precision(mp, {nn.Dense: "f32"}).policy_for(nn.LayerNorm) == mp.policy


def test_fp8_eligibility_is_one_rule():
    mp = jamp.mixed_precision("fp8", overrides={"out": "p=f32,c=bf16,o=f32"})
    assert core.fp8_recipe_for(mp, mp.policy, "Dense_0") is mp.fp8
    assert core.fp8_recipe_for(mp, mp.policy, 0) is mp.fp8  # an NNX list index
    assert core.fp8_recipe_for(mp, mp.policy, None) is mp.fp8  # the root
    assert core.fp8_recipe_for(mp, mp.policy, "head") is None  # Fp8Recipe.keep_bf16
    assert core.fp8_recipe_for(mp, mp.policy_for(nn.Dense, "out"), "out") is None  # override
    assert core.fp8_recipe_for(mp, mp.policy_for(nn.LayerNorm), "LayerNorm_0") is None
    bf16 = jamp.mixed_precision("bf16")
    assert core.fp8_recipe_for(bf16, bf16.policy, "Dense_0") is None
