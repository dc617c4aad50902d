"""Per-path precision overrides (issue 13, item 2), for linen and NNX.

``overrides`` keys may be regular expressions matched in full against module paths
("head", "encoder/ScanBlock_0/Dense_0", "blocks/1"). Dtypes are read from the jaxpr of
the forward pass (dot/conv operands, in program order) and from the stored parameters.
"""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jaxpr_utils import iter_eqns

import jamp

F16, F32, BF16 = ("float16",) * 2, ("float32",) * 2, ("bfloat16",) * 2
X = jnp.ones((2, 6, 6, 1))


# ----------------------------------------------------------------------------- linen


class Block(nn.Module):
    @nn.compact
    def __call__(self, carry, _):
        return nn.Dense(8)(carry), None


class Encoder(nn.Module):
    """Compact, with lifted modules: paths Dense_0, ScanBlock_0/Dense_0, CheckpointDense_0."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8)(x)
        scan = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)
        x, _ = scan()(x, None)
        x = nn.remat(nn.Dense)(8)(x)
        return nn.LayerNorm()(x)


class Net(nn.Module):
    """Setup-defined submodules: stem (the first conv), encoder/..., head."""

    def setup(self):
        self.stem = nn.Conv(4, (3, 3))
        self.encoder = Encoder()
        self.head = nn.Dense(3)

    def features(self, x):
        return self.encoder(self.stem(x).mean(axis=(1, 2)))

    def __call__(self, x):
        return self.head(self.features(x))


def _ops(fn, *args):
    """The dot/conv operand dtypes of ``fn``'s jaxpr in program order, and its output dtype."""
    closed = jax.make_jaxpr(fn)(*args)
    ops = {p: [tuple(str(v.aval.dtype) for v in eqn.invars)
               for eqn in iter_eqns(closed) if eqn.primitive.name == p]
           for p in ("conv_general_dilated", "dot_general")}
    return ops, closed.out_avals[0].dtype


def _linen(mode, overrides, method=None):
    model = jamp.apply_policy(Net(), mode, overrides=overrides)
    variables = jax.eval_shape(model.init, jax.random.key(0), X)  # traced, not run
    ops, out = _ops(lambda v, x: model.apply(v, x, method=method), variables, X)
    return variables, ops, out


def _param_dtypes(params) -> dict[str, str]:
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {"/".join(k.key for k in path): str(leaf.dtype) for path, leaf in flat}


# The dots in program order: encoder/Dense_0, encoder/ScanBlock_0/Dense_0 (scan body),
# encoder/CheckpointDense_0 (remat body), head.
@pytest.mark.parametrize("overrides, conv, dots, f32_params", [
    ({"head": "f32", "stem": "f32"}, F32, [F16, F16, F16, F32], {"head", "stem"}),
    ({"encoder/ScanBlock_0/.*": "f32", "encoder/CheckpointDense_0": "f32"}, F16,
     [F16, F32, F32, F16], {"encoder/ScanBlock_0/Dense_0", "encoder/CheckpointDense_0"}),
    ({"encoder/.*Dense_0": "f32"}, F16, [F32, F32, F32, F16],
     {"encoder/Dense_0", "encoder/ScanBlock_0/Dense_0", "encoder/CheckpointDense_0"}),
])
def test_linen_matched_modules_compute_and_store_params_in_their_override(
        overrides, conv, dots, f32_params):
    # fp16_naive stores params in float16: only norms and matched modules hold float32.
    variables, ops, out = _linen("fp16_naive", overrides)
    assert ops["conv_general_dilated"] == [conv]
    assert ops["dot_general"] == dots
    params = _param_dtypes(variables["params"])
    norm = {"encoder/LayerNorm_0/scale", "encoder/LayerNorm_0/bias"}
    f32 = {p for p in params if p.rsplit("/", 1)[0] in f32_params}
    assert f32 and {p for p, d in params.items() if d == "float32"} == f32 | norm
    assert out == jnp.float32


def test_linen_path_overrides_reach_method_calls():
    # method="features" calls no head: no "matches no module" error, stem still float32.
    _, ops, out = _linen("fp16", {"stem": "f32", "head": "f32"}, method="features")
    assert ops["conv_general_dilated"] == [F32]
    assert ops["dot_general"] == [F16, F16, F16]
    assert out == jnp.float32


def test_linen_path_beats_class_beats_mode():
    _, ops, _ = _linen("fp16", {nn.Dense: "f32", "head": "bf16", "encoder/Dense_0": "f16"})
    assert ops["conv_general_dilated"] == [F16]  # the mode's policy
    assert ops["dot_general"] == [F16, F32, F32, BF16]  # path, class, class, path


def test_linen_paths_are_relative_to_the_policied_module_inside_a_bigger_model():
    class Outer(nn.Module):
        net: nn.Module

        @nn.compact
        def __call__(self, x):
            return self.net(x) + 1  # Net's head is at net/head

    outer = Outer(jamp.apply_policy(Net(), "fp16", overrides={"head": "f32"}))
    variables = jax.eval_shape(outer.init, jax.random.key(0), X)
    ops, _ = _ops(outer.apply, variables, X)
    assert ops["dot_general"] == [F16, F16, F16, F32]


def test_linen_ambiguous_match_names_both_patterns_and_the_path():
    model = jamp.apply_policy(Net(), "fp16", overrides={"enc.*/Dense_0": "f32",
                                                        "encoder/.*": "bf16"})
    with pytest.raises(ValueError, match=r"'encoder/Dense_0' matches the override patterns "
                                         r"'enc\.\*/Dense_0' and 'encoder/\.\*'"):
        jax.eval_shape(model.init, jax.random.key(0), X)


def test_a_key_equal_to_the_path_wins_over_a_pattern():
    _, ops, _ = _linen("fp16", {"head": "f32", "(head|stem)": "bf16"})
    assert ops["conv_general_dilated"] == [BF16]
    assert ops["dot_general"][-1] == F32


def test_linen_unmatched_pattern_is_an_error_at_init_listing_paths():
    model = jamp.apply_policy(Net(), "fp16", overrides={"haed": "f32"})
    with pytest.raises(ValueError, match=r"'haed' matches no module of Net.*"
                                         r"'encoder/ScanBlock_0/Dense_0'.*Did you mean 'head'"):
        jax.eval_shape(model.init, jax.random.key(0), X)
    with (pytest.raises(ValueError, match="'Dense_1' matches no module of the modules"),
          jamp.policy_scope("fp16", {"Dense_1": "f32"})):
        jax.eval_shape(nn.Dense(2).init, jax.random.key(0), jnp.ones((1, 3)))


@pytest.mark.parametrize("overrides, message", [
    ({"head[": "f32"}, r"Invalid override pattern 'head\['"),
    ({"(?P<x>": "f32"}, r"Invalid override pattern '\(\?P<x>'"),
    ({3: "f32"}, "overrides keys must be .* or module-path patterns"),
    ({"head": "f33"}, r"overrides\['head'\]: Invalid precision policy 'f33'"),
])
def test_bad_override_keys_and_values_fail_when_the_recipe_is_built(overrides, message):
    with pytest.raises(ValueError, match=message):
        jamp.apply_policy(Net(), "fp16", overrides=overrides)
    with pytest.raises(ValueError, match=message):
        jamp.mixed_precision("fp16", overrides=overrides)
    with pytest.raises(ValueError, match=message):
        jamp.apply_policy(NnxNet(nnx.Rngs(0)), "fp16", overrides=overrides)


def test_path_overrides_keep_the_modes_norm_overrides_and_follow_a_new_policy():
    fp16 = jamp.mixed_precision("fp16")
    for mp in (jamp.mixed_precision("fp16", overrides={"head": "f32"}),
               jamp.to_mixed_precision("fp16", {"head": "f32"})):
        assert mp.policy_for(nn.LayerNorm, "norm") == fp16.policy_for(nn.LayerNorm)
        assert mp.policy_for(nn.Dense, "head") == jamp.get_policy("f32")
        assert mp.policy_for(nn.Dense, "Dense_0") == fp16.policy
    mp = jamp.mixed_precision("fp16", policy="p=f32,c=bf16,o=f32", overrides={"head": "f32"})
    assert mp.policy_for(nnx.LayerNorm, "norm").output_dtype == jnp.bfloat16
    assert mp.policy_for(nnx.Linear, "head") == jamp.get_policy("f32")
    # Classes replace the class overrides; an empty mapping removes every override.
    assert jamp.to_mixed_precision(mp, {nn.Dense: "f32"}).overrides == (
        ("head", jamp.get_policy("f32")), (nn.Dense, jamp.get_policy("f32")))
    assert jamp.to_mixed_precision(mp, {}).overrides == ()


# ----------------------------------------------------------------------------- NNX


class NnxNet(nnx.Module):
    """The NNX twin: stem (first conv), blocks (a list), norm, head."""

    def __init__(self, rngs: nnx.Rngs):
        self.stem = nnx.Conv(1, 4, (3, 3), rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(4 if i == 0 else 8, 8, rngs=rngs) for i in range(2)])
        self.norm = nnx.LayerNorm(8, rngs=rngs)
        self.head = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        x = self.stem(x).mean(axis=(1, 2))
        for block in self.blocks:
            x = nnx.relu(block(x))
        return self.head(self.norm(x))


def _nnx_ops(model):
    graphdef, state = nnx.split(model)
    return _ops(lambda state, x: nnx.merge(graphdef, state)(x), state, X)


def _nnx_params(model) -> dict[str, str]:
    return {jamp.policy.module_path(path): str(v.get_value().dtype)
            for path, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)}


@pytest.mark.parametrize("overrides, conv, dots, f32_modules", [
    ({"head": "f32", "stem": "f32"}, F32, [F16, F16, F32], {"head", "stem"}),
    ({"blocks/1": "f32"}, F16, [F16, F32, F16], {"blocks/1"}),
    ({"blocks/.*": "f32"}, F16, [F32, F32, F16], {"blocks/0", "blocks/1"}),
])
def test_nnx_matched_modules_compute_and_store_params_in_their_override(
        overrides, conv, dots, f32_modules):
    model = jamp.apply_policy(NnxNet(nnx.Rngs(0)), "fp16_naive", overrides=overrides)
    ops, out = _nnx_ops(model)  # through nnx.split/merge
    assert ops["conv_general_dilated"] == [conv]
    assert ops["dot_general"] == dots
    params = _nnx_params(model)
    f32 = {p for p in params if p.rsplit("/", 1)[0] in f32_modules | {"norm"}}
    assert {p for p, d in params.items() if d == "float32"} == f32
    assert out == jnp.float32


def test_nnx_path_beats_class_beats_mode():
    model = jamp.apply_policy(NnxNet(nnx.Rngs(0)), "fp16",
                              overrides={nnx.Linear: "f32", "head": "bf16"})
    ops, _ = _nnx_ops(model)
    assert ops["conv_general_dilated"] == [F16]
    assert ops["dot_general"] == [F32, F32, BF16]


@pytest.mark.parametrize("overrides, message", [
    ({"blocks/.*": "f32", "blocks/[01]": "bf16"},
     r"'blocks/0' matches the override patterns 'blocks/\.\*' and 'blocks/\[01\]'"),
    ({"blocks/2": "f32"}, r"'blocks/2' matches no module of NnxNet.*'blocks/1'"),
    ({"head": "p=f32,c=f32,o=f16"}, "Cannot apply the override .* to Linear at path 'head'"),
])
def test_nnx_pattern_errors_when_the_policy_is_applied(overrides, message):
    model = NnxNet(nnx.Rngs(0))
    with pytest.raises(ValueError, match=message):
        jamp.apply_policy(model, "fp16", overrides=overrides)
    assert model.head.kernel.dtype == jnp.float32 and type(model) is NnxNet  # untouched


# ----------------------------------------------------------------------------- property

NAMES = st.sampled_from(["head", "stem", "Dense_0", "Dense_1", "blocks", "0", "1"])
PATHS = st.lists(NAMES, min_size=1, max_size=3).map("/".join)


@st.composite
def paths_and_patterns(draw):
    """A path, and patterns of which some match it (prefix/.*, .*suffix, itself)."""
    path = draw(PATHS)
    names = path.split("/")
    near = st.one_of(
        st.integers(0, len(names)).map(lambda i: "/".join(names[:i] + [".*"])),
        st.integers(0, len(names) - 1).map(lambda i: ".*" + "/".join(names[i:])),
        st.just(path), st.just(".*"), st.just("Dense_[01]"))
    far = st.one_of(PATHS, PATHS.map(lambda p: p + "/.*"), PATHS.map(lambda p: ".*" + p))
    patterns = draw(st.lists(st.one_of(near, far), min_size=1, max_size=4, unique=True))
    return path, patterns


@settings(max_examples=200, deadline=None)
@given(case=paths_and_patterns())
def test_policy_for_is_the_one_pattern_matching_in_full(case):
    path, patterns = case
    policies = [jamp.get_policy(f"c={d}") for d in ("f16", "bf16", "f32", "f64")]
    mp = jamp.mixed_precision("fp32", overrides=dict(zip(patterns, policies, strict=False)))
    table = dict(mp.path_overrides)
    hits = [p for p in patterns if re.fullmatch(p, path)]
    if path in table:
        assert mp.policy_for(nn.Dense, path) is table[path]
    elif len(hits) > 1:
        with pytest.raises(ValueError, match=" and ".join(re.escape(repr(p)) for p in hits)):
            mp.policy_for(nn.Dense, path)
    else:
        expected = table[hits[0]] if hits else mp.policy
        assert mp.policy_for(nn.Dense, path) is expected
        assert mp.policy_for(nn.Dense) is mp.policy  # without a path: classes only
