"""jamp.tensor_stats.nnx_activations: NNX layer outputs' statistics equal array_stats of the
same outputs computed by hand, rows named and ordered as the forward pass runs (per layer of
nnx.vmap-stacked, nnx.scan-applied blocks), reduced where computed (scratch memory does not
grow with depth), the model left as it was; a boosted NNX model and the trainer with
framework=nnx name the layer whose output overflowed."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jamp
from jamp import tensor_stats as ts

F16 = lambda y: ts.array_stats(y, jnp.float16)  # noqa: E731


class _Block(nnx.Module):
    def __init__(self, width, rngs):
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.mlp = nnx.Linear(width, width, rngs=rngs)

    def __call__(self, x):
        return x + self.mlp(self.norm(x))


class _Stack(nnx.Module):
    """Blocks stacked by nnx.vmap, applied by nnx.scan, between two plain layers; the names
    do not sort in the order they run (embed, layers, head)."""

    def __init__(self, depth=3, width=4, rngs=None):
        rngs = rngs or nnx.Rngs(0)
        self.embed = nnx.Linear(5, width, rngs=rngs)

        @nnx.split_rngs(splits=depth)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stack(r):
            return _Block(width, r)

        self.layers = stack(rngs)
        self.head = nnx.Linear(width, 2, rngs=rngs)

    def __call__(self, x):
        body = nnx.scan(lambda layer, h: layer(h), in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        return self.head(body(self.layers, self.embed(x)))


def _by_hand(model, x):
    """Every layer's output, computed outside nnx_activations, in the order they run."""
    out = {"embed": model.embed(x)}
    graphdef, state = nnx.split(model.layers)
    h, per_layer = out["embed"], {"norm": [], "mlp": [], "": []}
    for i in range(3):
        block = nnx.merge(graphdef, jax.tree_util.tree_map(lambda a, i=i: a[i], state))
        per_layer["norm"].append(block.norm(h))
        per_layer["mlp"].append(block.mlp(per_layer["norm"][-1]))
        h = h + per_layer["mlp"][-1]
        per_layer[""].append(h)
    for name in ("norm", "mlp", ""):
        for i, y in enumerate(per_layer[name]):
            out[f"layers/{i}" + (f"/{name}" if name else "")] = y
    out["head"] = model.head(h)
    out["(output)"] = out["head"]
    return out


def test_nnx_layer_outputs_equal_array_stats_of_the_outputs_in_forward_order():
    model = _Stack()  # float32: outputs above float16's max show as negative headroom
    x = jnp.linspace(-3.0, 3.0, 4 * 5).reshape(4, 5).at[1, 2].set(1e5)  # > 65504 from embed on
    graphdef, state = nnx.split(model)
    rows, merged_rows = [], []

    def collect(state, x):  # under jit, the model merged from its state as the trainer does
        out = ts.nnx_activations(nnx.merge(graphdef, state), x, reduce=F16)
        stats, r = ts.reduced_stats(ts.ordered_leaves(out), scanned=("layers",))
        merged, m = ts.reduced_stats(ts.ordered_leaves(out))  # stacked layers in one row
        rows.extend(r)
        merged_rows.extend(m)
        return stats, merged

    got, merged = jax.jit(collect)(state, x)
    names = [r.name for r in rows]
    assert names == ["embed", "layers/0/norm", "layers/1/norm", "layers/2/norm",
                     "layers/0/mlp", "layers/1/mlp", "layers/2/mlp",
                     "layers/0", "layers/1", "layers/2", "head", "(output)"]
    want = _by_hand(model, x)
    assert float(got.headroom_bits[0]) < 0 < float(got.headroom_bits[-1])  # embed > 65504
    for i, name in enumerate(names):
        ref = F16(want[name])
        for stat in ts.STATISTICS:
            np.testing.assert_allclose(np.asarray(getattr(got, stat))[i],
                                       np.asarray(getattr(ref, stat))[0], rtol=1e-6,
                                       err_msg=f"{name} {stat}")
    # Not listed as scanned: a stacked output's layers merge into one row.
    assert [r.name for r in merged_rows] == ["embed", "layers/norm", "layers/mlp", "layers",
                                             "head", "(output)"]
    assert float(merged.amax[2]) == float(jnp.max(got.amax[4:7]))


class _Stateful(nnx.Module):
    """State a call would advance: batch statistics and a dropout RNG stream."""

    def __init__(self):
        rngs = nnx.Rngs(0, dropout=1)
        self.dense = nnx.Linear(3, 3, rngs=rngs)
        self.bn = nnx.BatchNorm(3, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.bn(self.dense(x)))


def _snapshot(model):
    as_numpy = lambda a: np.asarray(jax.random.key_data(a) if jnp.issubdtype(  # noqa: E731
        a.dtype, jax.dtypes.prng_key) else a)
    return (nnx.graphdef(model), jax.tree_util.tree_map(as_numpy, nnx.to_pure_dict(
        nnx.state(model))), {p: type(m) for p, m in nnx.iter_modules(model)})


def _assert_same(a, b):
    assert a[0] == b[0] and a[2] == b[2]
    jax.tree_util.tree_map(np.testing.assert_array_equal, a[1], b[1])


def test_the_model_is_left_as_it_was_even_when_the_call_raises():
    model = jamp.apply_policy(_Stateful(), "bf16")
    before = _snapshot(model)
    out = ts.nnx_activations(model, jnp.ones((4, 3)), reduce=F16)
    assert list(out) == ["dense", "bn", ""]  # Dropout's (its input, masked) is left out
    _assert_same(_snapshot(model), before)
    assert not jax.tree_util.tree_leaves(nnx.state(model, nnx.Intermediate))
    with pytest.raises(Exception):  # noqa: B017 (a shape error inside the captured call)
        ts.nnx_activations(model, jnp.ones((4, 7)), reduce=F16)
    _assert_same(_snapshot(model), before)
    model(jnp.ones((4, 3)))  # a plain call does advance the state this one left alone
    assert not np.array_equal(nnx.to_pure_dict(nnx.state(model))["bn"]["mean"],
                              before[1]["bn"]["mean"])
    with pytest.raises(TypeError, match="expects an nnx.Module"):
        ts.nnx_activations(lambda x: x, jnp.ones(1))


class _Listed(nnx.Module):
    """An ``nnx.Sequential`` and an ``nnx.List`` of layers, as NNX models often hold them."""

    def __init__(self, rngs=None):
        rngs = rngs or nnx.Rngs(0)
        self.seq = nnx.Sequential(nnx.Linear(3, 4, rngs=rngs), jax.nn.relu,
                                  nnx.Linear(4, 4, rngs=rngs))
        self.blocks = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(2)])

    def __call__(self, x):
        x = self.seq(x)
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("mode", ["fp16", "bf16", "fp32"])
def test_sequential_and_list_layers_under_every_policy_have_rows(mode):
    # Under a policy with softmax rules (fp16, bf16) the call crosses jamp.autocast's
    # rewrite; nnx.capture's '__captures__' beside an nnx.List's int keys crashed it
    # ("'<' not supported between instances of 'str' and 'int'").
    model = jamp.apply_policy(_Listed(), mode)
    before = _snapshot(model)
    out = ts.nnx_activations(model, jnp.ones((2, 3)), reduce=F16)
    assert list(out) == ["seq/layers/0", "seq/layers/2", "seq", "blocks/0", "blocks/1", ""]
    _assert_same(_snapshot(model), before)
    assert not any("__captures__" in vars(m) for _, m in nnx.iter_modules(model))
    ref = jamp.apply_policy(_Listed(), mode)(jnp.ones((2, 3)))
    np.testing.assert_array_equal(out[""]["__call__"][0].amax, F16(ref).amax)


def test_collecting_nnx_layer_outputs_holds_one_output_at_a_time_not_all():
    # As the linen test: reduced where computed, the scratch memory does not grow with depth.
    x = jnp.ones((64, 5))

    def scratch(depth, keep):
        graphdef, state = nnx.split(_Stack(depth=depth, width=256))
        if keep:
            f = lambda s, x: ts.tree_stats(ts.ordered_leaves(ts.nnx_activations(  # noqa: E731
                nnx.merge(graphdef, s), x)), jnp.float16, scanned=("layers",))[0]
        else:
            f = lambda s, x: ts.nnx_activations(nnx.merge(graphdef, s), x,  # noqa: E731
                                                reduce=F16)
        return jax.jit(f).lower(state, x).compile().memory_analysis().temp_size_in_bytes

    reduced = {d: scratch(d, keep=False) for d in (2, 16)}
    kept = {d: scratch(d, keep=True) for d in (2, 16)}
    assert reduced[16] <= 1.1 * reduced[2] + 2**16, reduced
    assert kept[16] > 4 * kept[2], kept  # the measure can tell the two apart


class _Net(nnx.Module):
    """The layers' names do not sort in the order they run: enc, proj, head."""

    def __init__(self):
        rngs = nnx.Rngs(0)
        self.enc, self.proj = nnx.Linear(4, 8, rngs=rngs), nnx.Linear(8, 8, rngs=rngs)
        self.head = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.head(self.proj(jax.nn.relu(self.enc(x))))


@pytest.mark.parametrize("mesh", [None, {"data": 4}], ids=["one device", "data=4"])
def test_a_boosted_nnx_model_names_the_layer_whose_output_overflowed(mesh):
    b = jamp.boost(_Net(), optax.sgd(0.1), lambda y, t: jnp.mean((y - t) ** 2), "fp16",
                   tensor_stats=1000, mesh=mesh)
    batch = (jnp.full((8, 4), 0.1), jnp.zeros((8, 2)))  # gradients finite at 2**16
    state = b.init(jax.random.key(0), batch)
    state, m = b.step(state, batch)  # finite, statistics collected (step 0)
    m = jax.device_get(m)
    assert not m["skipped"] and b.explain(m) is None
    assert list(b.stats_table(m)["activations"]) == ["enc", "proj", "head", "(output)"]

    big = jax.tree_util.tree_map(lambda p: p, state.params)
    big["proj"]["bias"] = big["proj"]["bias"] + 7e4  # proj's output > 65504: inf, then head's
    state, m = b.step(state.replace(params=big), batch)
    m = jax.device_get(m)
    assert m["skipped"]
    reason = b.explain(m)
    shard = " (first in data shard 0 of 4)" if mesh else ""  # every shard: the first
    assert reason.endswith(f"; forward: inf in the output of proj{shard}"), reason
    hot = (batch[0].at[5].set(6.5e4), batch[1])  # example 5 of 8 overflows enc: shard 2 of 4
    state, m = b.step(state.replace(params=b.init(jax.random.key(0), batch).params), hot)
    shard = " (first in data shard 2 of 4)" if mesh else ""
    assert b.explain(jax.device_get(m)).endswith(f"forward: inf in the output of enc{shard}")


def test_the_trainer_with_framework_nnx_writes_every_layers_output_statistics(tmp_path):
    from jamp import train
    from jamp.config import vit_config

    config = vit_config("fp16")
    config.framework, config.num_layers, config.hidden_size = "nnx", 2, 8
    config.num_heads, config.mlp_dim, config.image_size, config.patch_size = 2, 8, 8, 4
    config.batch_size, config.max_steps, config.tensor_stats_every = 16, 2, 1
    config.progress, config.plot, config.log_every_steps = False, False, 2
    train.train_and_evaluate(config, tmp_path)
    stats = [json.loads(line) for line in (tmp_path / "tensor_stats.jsonl").read_text()
             .splitlines()]
    assert [s["step"] for s in stats] == [1, 2]
    names = list(stats[0]["activations"])
    assert names[:3] == ["embedding", "encoder/layers/0/norm1", "encoder/layers/1/norm1"]
    assert names[-4:] == ["encoder", "encoder_norm", "head", "(output)"]
    for layer in (0, 1):
        assert f"encoder/layers/{layer}/mlp/fc1" in names
        assert f"encoder/layers/{layer}/mlp/fc1/kernel" in stats[0]["grads"]
    assert stats[0]["activations"]["encoder/layers/1/mlp/fc1"]["amax"] > 0


class _Broadcast(nnx.Module):
    """A module broadcast into nnx.vmap (in_axes=None): the pattern whose outputs cannot
    leave the transform, unless its Intermediate state is given an axis."""

    def __init__(self, axes=None):
        self.lin, self.axes = nnx.Linear(3, 3, rngs=nnx.Rngs(0)), axes

    def __call__(self, x):
        return nnx.vmap(lambda lin, x: lin(x), in_axes=(self.axes, 0))(self.lin, x)


def test_a_module_broadcast_into_a_transform_is_one_clear_error_naming_the_fix():
    with pytest.raises(ValueError, match=r"in_axes=None \(broadcast\).*nnx.StateAxes"):
        ts.nnx_activations(_Broadcast(), jnp.ones((2, 3)), reduce=F16)
    fixed = _Broadcast(nnx.StateAxes({nnx.Intermediate: 0, ...: None}))
    out = ts.nnx_activations(fixed, jnp.ones((2, 3)), reduce=F16)
    assert out["lin"]["__call__"][0].amax.shape == (2, 1)  # per vmapped example
