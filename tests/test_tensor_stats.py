"""jamp.tensor_stats: statistics equal numpy's, shards combined exactly, nothing added when
off, and a skipped step names the layer (forward) and the gradient leaf that went bad, on
several meshes and at ZeRO-3."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jamp
from jamp import tensor_stats as ts

# ----------------------------------------------------------------------------- numpy's


def numpy_stats(x, dtype, scale=1.0):
    """The reference, written from the definitions in float64."""
    a = np.abs(np.asarray(x, np.float64)).ravel()
    info = ml_dtypes.finfo(dtype)
    nan, inf = np.isnan(a), np.isinf(a)
    finite_nonzero = ~nan & ~inf & (a != 0)
    n = max(a.size, 1)
    amax = np.nan if nan.any() else (a.max() if a.size else 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return dict(
            amax=amax / scale,
            min_nonzero=(a[finite_nonzero].min() if finite_nonzero.any() else np.inf) / scale,
            zero_fraction=np.sum(a == 0) / n,
            underflow_fraction=np.sum(finite_nonzero & (a < float(info.smallest_normal))) / n,
            flush_fraction=np.sum(finite_nonzero & (a <= float(info.smallest_subnormal) / 2)) / n,
            headroom_bits=np.log2(float(info.max)) - np.log2(amax),
            nan_count=int(nan.sum()), inf_count=int(inf.sum()))


def assert_matches(stats, ref, row=0):
    for name in ts.STATISTICS:
        got = np.asarray(getattr(stats, name))[row]
        atol = 1e-6 if name == "headroom_bits" else 0  # a float32 log2
        np.testing.assert_allclose(got, ref[name], rtol=1e-6, atol=atol, err_msg=name)


SPECIALS = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-8, 3e-5, 7e-6, 6e4, 7e4, 1.0])


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("shape", [(0,), (1,), (3, 5), (7, 1, 2)])
def test_statistics_equal_numpys(dtype, shape):
    rng = np.random.default_rng(0)
    x = rng.choice(SPECIALS, size=shape) * rng.uniform(0.5, 2.0, size=shape)
    x = jnp.asarray(x, dtype)  # the array as it is held: values already rounded to dtype
    for against in (jnp.float16, jnp.bfloat16):
        ref = numpy_stats(np.asarray(x, np.float64), against)
        assert_matches(ts.array_stats(x, against), ref)
        assert_matches(jax.jit(ts.array_stats, static_argnums=1)(x, against), ref)  # traced


def test_scaled_gradients_report_unscaled_magnitudes_and_scaled_headroom():
    g = jnp.array([1024.0, 2.0 ** -14, 0.0])  # as differentiated under a loss scale of 1024
    s = ts.array_stats(g, jnp.float16, scale=1024.0)
    assert_matches(s, numpy_stats(np.asarray(g), jnp.float16, 1024.0))
    assert float(s.amax[0]) == 1.0 and float(s.headroom_bits[0]) == pytest.approx(5.999, abs=1e-3)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.one_of(st.sampled_from([0.0, np.inf, -np.inf, np.nan]),
                          st.floats(-1e6, 1e6, allow_nan=False)
                          .filter(lambda v: v == 0 or abs(v) > 1e-30)), min_size=24, max_size=24),
       st.sampled_from([jnp.float16, jnp.bfloat16, jnp.float8_e4m3fn]))
def test_any_values_match_numpy(values, dtype):
    x = np.asarray(values, np.float32)
    assert_matches(ts.array_stats(jnp.asarray(x), dtype), numpy_stats(x, dtype))


def test_scanned_leaves_give_one_row_per_layer_named_with_its_index():
    x = jnp.stack([jnp.array([1.0, 2.0]), jnp.array([jnp.nan, 0.0]), jnp.array([0.0, -8.0])])
    stats, rows = ts.tree_stats(ts.named_leaves({"enc": {"layers": {"w": x}}, "b": x[0]}),
                                jnp.float16, scanned=("layers",))
    assert [r.name for r in rows] == ["b", "enc/layers/0/w", "enc/layers/1/w", "enc/layers/2/w"]
    for i, row in enumerate([x[0], x[0], x[1], x[2]]):
        assert_matches(stats, numpy_stats(np.asarray(row), jnp.float16), i)



class _Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + nn.Dense(x.shape[-1], name="mlp")(nn.LayerNorm(name="norm")(x)), None


class _Stack(nn.Module):
    """An ``nn.scan``-stacked body between two plain layers (outputs per layer stacked)."""

    depth: int = 3
    width: int = 16

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.width, name="embed")(x)
        x, _ = nn.scan(_Block, variable_axes={True: 0}, split_rngs={"params": True},
                       length=self.depth)(name="layers")(x, None)
        return nn.Dense(2, name="head")(x)


def test_reduced_layer_outputs_equal_the_statistics_of_the_captured_outputs():
    model = _Stack()
    x = jnp.linspace(-3.0, 3.0, 4 * 5).reshape(4, 5).at[1, 2].set(1e5)  # > 65504 from embed on
    v = model.init(jax.random.key(0), x)
    raw = ts.linen_activations(model.apply, v, x)
    reduced = ts.linen_activations(model.apply, v, x,
                                   reduce=lambda y: ts.array_stats(y, jnp.float16))
    want, want_rows = ts.tree_stats(ts.ordered_leaves(raw), jnp.float16, scanned=("layers",))
    got, rows = ts.reduced_stats(ts.ordered_leaves(reduced), scanned=("layers",))
    assert [r.name for r in rows] == [r.name for r in want_rows]
    assert [r.name for r in rows][:5] == ["embed", "layers/0/norm", "layers/1/norm",
                                          "layers/2/norm", "layers/0/mlp"]
    for name in ts.STATISTICS:
        np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=1e-6,
                                   err_msg=name)
    # Not listed as scanned: a stacked output's layers merge into one row.
    merged, rows = ts.reduced_stats(ts.ordered_leaves(reduced))
    assert [r.name for r in rows] == ["embed", "layers/norm", "layers/mlp", "layers", "head",
                                      "(output)"]
    assert float(merged.amax[1]) == float(jnp.max(got.amax[1:4]))


class _ThirdPartyStack(nn.Module):
    """An ``nn.scan`` as many models write it: only 'params' stacked, and an int output."""

    declare: bool = False

    @nn.compact
    def __call__(self, x):
        axes = {"params": 0, "intermediates": 0} if self.declare else {"params": 0}
        x = nn.Dense(4, name="embed")(x)
        x, _ = nn.scan(_Block, variable_axes=axes, split_rngs={"params": True},
                       length=2)(name="layers")(x, None)
        _ArgMax(name="ids")(x)  # no floating output: nothing to report, nothing lost
        return nn.Dense(2, name="head")(x)


class _ArgMax(nn.Module):
    def __call__(self, x):
        return jnp.argmax(x, -1)


@pytest.mark.parametrize("reduce", [None, "array_stats"])
def test_layer_outputs_a_scan_drops_are_named_in_a_warning_not_lost_silently(reduce):
    x = jnp.ones((2, 3))
    kw = {} if reduce is None else {"reduce": lambda y: ts.array_stats(y, jnp.float16)}
    model = _ThirdPartyStack()
    v = model.init(jax.random.key(0), x)
    with pytest.warns(UserWarning, match=r"layers/norm, layers/mlp, layers were computed "
                      r"inside a lifted transform .*'intermediates': 0"):
        out = ts.linen_activations(model.apply, v, x, **kw)
    assert [k for k in out if k != "ids"] == ["embed", "head", ""]  # raw capture keeps ints
    declared = _ThirdPartyStack(declare=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # declared: every layer has its row, no warning
        out = ts.linen_activations(declared.apply, v, x, **kw)
    rows = [n for n, _ in ts.ordered_leaves(out)]
    assert rows[:4] == ["embed", "layers/norm", "layers/mlp", "layers"] and "ids" not in rows


def _scratch_bytes(f, *args):
    return jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_collecting_layer_outputs_holds_one_output_at_a_time_not_all():
    # Reduced where computed, the extra forward pass's scratch memory does not grow with
    # depth; keeping every output first grew with it (on the trainer's ViT the step's
    # scratch went from 15 to 64 MiB, and XLA:CPU paid fresh page faults on every step).
    x = jnp.ones((64, 256))

    def scratch(depth, keep):
        model = _Stack(depth=depth, width=256)
        v = model.init(jax.random.key(0), x)
        f32 = lambda y: ts.array_stats(y, jnp.float16)
        if keep:
            f = lambda v, x: ts.tree_stats(ts.ordered_leaves(ts.linen_activations(
                model.apply, v, x)), jnp.float16, scanned=("layers",))[0]
        else:
            f = lambda v, x: ts.linen_activations(model.apply, v, x, reduce=f32)
        return jax.jit(f).lower(v, x).compile().memory_analysis().temp_size_in_bytes

    reduced = {d: scratch(d, keep=False) for d in (2, 16)}
    kept = {d: scratch(d, keep=True) for d in (2, 16)}
    assert reduced[16] <= 1.1 * reduced[2] + 2**16, reduced
    assert kept[16] > 4 * kept[2]  # the measure can tell the two apart

# ----------------------------------------------------------------------------- shards


def test_shards_combine_exactly_nan_and_infs_in_one_shard_and_no_replica_counted_twice():
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    x = np.arange(64, dtype=np.float32).reshape(8, 8) - 20.0
    x[1, 2], x[1, 3], x[0, 0] = np.nan, np.inf, -np.inf  # all in the shard of device 0
    sharded = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
    replicated = jax.device_put(x, NamedSharding(mesh, P()))
    f = jax.jit(lambda a: ts.array_stats(a, jnp.float16))
    for arr in (sharded, replicated):
        assert_matches(f(arr), numpy_stats(x, jnp.float16))
    clean = np.where(np.isfinite(x), x, 1.0)
    clean[7, 7] = np.nan  # NaN in the last shard only: the max must still say NaN
    s = f(jax.device_put(clean, NamedSharding(mesh, P("data", "model"))))
    assert np.isnan(s.amax[0]) and int(s.nan_count[0]) == 1
    # a scanned leaf (a row per layer) split over its layers, or within each layer
    rows = jax.jit(lambda a: ts.array_stats(a, jnp.float16, split=True))
    for spec in (P("data", "model"), P("data"), P(None, "data")):
        s = rows(jax.device_put(x, NamedSharding(mesh, spec)))
        for layer in range(8):
            assert_matches(s, numpy_stats(x[layer], jnp.float16), row=layer)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_the_statistics_read_the_array_once_in_one_integer_reduction(dtype):
    # Seven reductions of each layer output (or one with float operands) made every-step
    # statistics cost 1.54x (2.0x) the plain step on XLA:CPU; one integer pass, 1.33x.
    jaxpr = jax.make_jaxpr(lambda a: ts.array_stats(a, jnp.float16))(jnp.ones((4, 8), dtype))
    reductions = [e for e in jaxpr.eqns if e.primitive.name.startswith(("reduce", "arg"))
                  and e.primitive.name not in ("reduce_precision",)]
    assert [e.primitive.name for e in reductions] == ["reduce"], jaxpr
    assert all(jnp.issubdtype(v.aval.dtype, jnp.integer) for v in reductions[0].invars), jaxpr


# ----------------------------------------------------------------------------- off / on


def _step_jaxpr(collector):
    state = jamp.step.TrainState.create(apply_fn=None, params={"w": jnp.ones(3)},
                                        tx=jamp.make_optimizer("fp16", optax.sgd(0.1)))
    loss = lambda v, b, r: (jnp.mean((b @ v["params"]["w"]) ** 2), {})
    f = lambda s, b: jamp.step.loss_scaled_step(s, b, None, loss, tensor_stats=collector)
    return str(jax.make_jaxpr(f)(state, jnp.ones((2, 3))))


def test_off_adds_no_operation_and_on_adds_conds():
    plain = _step_jaxpr(None)
    assert _step_jaxpr(ts.Collector(every=0, explain_skips=False)) == plain
    skips_only = _step_jaxpr(ts.Collector(every=0))
    assert skips_only.count("cond[") == plain.count("cond[") + 1
    assert _step_jaxpr(ts.Collector(every=100)).count("cond[") == plain.count("cond[") + 2


@pytest.mark.parametrize("bad", [-1, 1.5, "x", True])
def test_bad_every_or_group_is_one_clear_error(bad):
    with pytest.raises(ValueError, match="every="):
        ts.Collector(every=bad)
    with pytest.raises(ValueError, match="Unknown tensor statistics group"):
        ts.Collector(every=1, groups=("grads", "weights"))
    with pytest.raises(ValueError, match="Unknown statistic 'max'"):
        ts.check_statistic("max")


# ----------------------------------------------------------------------------- skip reasons


@jax.custom_vjp
def _poison(gate, flag):
    return gate


def _poison_fwd(gate, flag):
    return gate, flag


def _poison_bwd(flag, g):
    return jnp.where(flag > 0, jnp.nan, 1.0).astype(g.dtype) * g, jnp.zeros_like(flag)


_poison.defvjp(_poison_fwd, _poison_bwd)


class Net(nn.Module):
    """The last input column flags a poisoned example: the gradient of ``gate`` alone goes
    NaN on the shard that holds it. The layers' names do not sort in the order they run."""

    @nn.compact
    def __call__(self, x):
        flag, x = jnp.max(x[:, -1]), x[:, :-1]
        h = nn.relu(nn.Dense(8, name="enc")(x))
        h = nn.Dense(8, name="proj")(h)
        h = h * _poison(self.param("gate", nn.initializers.ones, (8,)), flag)
        return nn.Dense(2, name="head")(h)


MESHES = {"one device": dict(mesh=None), "data=4": dict(mesh={"data": 4}),
          "data=2 x model=2": dict(mesh={"data": 2, "model": 2}),
          "data=4 ZeRO-3": dict(mesh={"data": 4}, zero_stage=3)}


@pytest.mark.parametrize("where", list(MESHES))
def test_a_skip_names_the_forward_layer_and_the_gradient_leaf(where):
    b = jamp.boost(Net(), optax.sgd(0.1), lambda y, t: jnp.mean((y - t) ** 2), "fp16",
                   tensor_stats=1000, **MESHES[where])
    x = jnp.concatenate([jnp.ones((8, 4)), jnp.zeros((8, 1))], axis=1)
    batch = (x, jnp.zeros((8, 2)))
    state = b.init(jax.random.key(0), batch)

    state, m = b.step(state, batch)  # finite: nothing to say, statistics collected (step 0)
    m = jax.device_get(m)
    assert not m["skipped"] and b.explain(m) is None and m["tensor_stats_collected"]
    table = b.stats_table(m)
    # The root's second call: jamp.apply_policy's cast of the output to its output dtype.
    assert list(table["activations"]) == ["enc", "proj", "head", "(output)", "(output)#1"]
    assert table["grads"]["gate"]["nan_count"] == 0

    poisoned = (x.at[5, -1].set(1.0), batch[1])  # example 5: the shard of device 2 of 4
    state, m = b.step(state, poisoned)
    m = jax.device_get(m)
    assert m["skipped"] and not m["tensor_stats_collected"]
    # ZeRO-3 splits gate over 'data': element 0 lives on device 0 (else on every device).
    on = ", on device 0" if MESHES[where].get("zero_stage") else ""
    assert b.explain(m) == f"NaN in the gradient of gate (element (0,){on})"

    big = jax.tree_util.tree_map(lambda p: p, state.params)
    big["proj"]["bias"] = big["proj"]["bias"] + 7e4  # proj's output > 65504: inf, then head's
    state, m = b.step(state.replace(params=big), batch)
    m = jax.device_get(m)
    assert m["skipped"]
    reason = b.explain(m)
    data = (MESHES[where]["mesh"] or {}).get("data", 1)
    in_shard = lambda k: f" (first in data shard {k} of {data})" if data > 1 else ""
    assert reason.endswith(f"; forward: inf in the output of proj{in_shard(0)}"), reason

    # one example overflows in the first layer: the first bad output names its data shard
    hot = (x.at[5, :4].set(6.5e4), batch[1])  # example 5 of 8
    state, m = b.step(state.replace(params=b.init(jax.random.key(0), batch).params), hot)
    m = jax.device_get(m)
    shard = in_shard(5 // (8 // data))
    assert m["skipped"] and b.explain(m).endswith(
        f"forward: inf in the output of enc{shard}"), b.explain(m)
    # NaN (which no max or comparison keeps by itself) in example 3: its shard
    state, m = b.step(state, (x.at[3, 0].set(jnp.nan), batch[1]))
    m = jax.device_get(m)
    assert m["skipped"] and b.explain(m).endswith(
        f"forward: NaN in the output of enc{in_shard(3 // (8 // data))}"), b.explain(m)


# ----------------------------------------------------------------------------- jamp.inspect

TINY = ["--config.image_size=8", "--config.patch_size=4", "--config.num_layers=2",
        "--config.hidden_size=16", "--config.num_heads=2", "--config.mlp_dim=32",
        "--config.batch_size=16", "--config.warmup_steps=1"]


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "steps=0: use a whole number of steps >= 1"),
    (["--sort", "maxx"], "Unknown statistic 'maxx' for --sort"),
    (["--modes", "fp17"], "fp17"),
    (["--config.no_such_field=1"], "no_such_field"),
])
def test_inspect_bad_values_one_line_exit_2_nothing_written(args, message, tmp_path, capsys):
    from jamp.inspect import main

    out = tmp_path / "heat.png"
    assert main(["--config", "vit_fp16", "--out", str(out), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("jamp.inspect: error: ") and message in err
    assert not out.exists()


def test_inspect_refuses_a_picture_it_cannot_write_before_any_step(tmp_path, capsys):
    from jamp.inspect import main

    for out, message in [(f"{tmp_path}", "that is a directory; give the picture's file name"),
                         (f"{tmp_path}/sub/", "that is a directory"),
                         (f"{tmp_path}/no/heat.png", "does not exist"),
                         (f"{tmp_path}/heat.txt", ".txt is not an image format"),
                         (f"{tmp_path}/heat", "no extension; end the name with .png")]:
        # the default recipe and 8 steps per mode: refused before the first one
        assert main(["--config", "vit_fp16", "--out", out]) == 2, out
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err
    assert list(tmp_path.iterdir()) == []


def test_inspect_prints_table_advice_and_writes_the_heat_map(tmp_path, capsys):
    from jamp.inspect import main

    out = tmp_path / "heat.png"
    assert main(["--config", "vit_fp16", "--modes", "fp16", "--steps", "3", "--out", str(out),
                 "--sort", "headroom_bits", "--top", "0", *TINY]) == 0
    text = capsys.readouterr().out
    assert "== fp16 (compute float16; 3 steps, 0 skipped) ==" in text
    # Every scanned layer's output, in the table, with its headroom to float16's max.
    assert "activations encoder/layers/1/MlpBlock_0/Dense_0 " in text
    assert "grads       encoder/layers/0/SelfAttention_0/query_kernel " in text
    assert "no layer needs float32" in text and "initial loss scale " in text
    assert "fp16 works for this model" in text
    assert out.stat().st_size > 10_000
    bad = tmp_path / "bad.png"
    assert main(["--config", "vit_fp16", "--modes", "fp16", "--steps", "1", "--out", str(bad),
                 "--layer", "encoder/layerz", *TINY]) == 2
    assert "No layer path starts with 'encoder/layerz'" in capsys.readouterr().err
    assert not bad.exists()


def test_inspect_advice_keeps_an_overflowing_layer_in_float32_and_picks_bf16():
    """A hand-made run: the fp16 forward's Dense_1 reaches 7e4 (> 65504)."""
    from jamp.inspect import ModeRun, _advice

    step = {"activations": {"Dense_0": dict(amax=3.0, headroom_bits=14.4),
                            "Dense_1": dict(amax=np.inf, headroom_bits=-np.inf)},
            "grads": {"Dense_0/kernel": dict(amax=0.5, headroom_bits=3.0,
                                             underflow_fraction=0.0)}}
    run = ModeRun("fp16", "float16", [step, step], [65536.0] * 2, [None, None], 65536.0)
    advice = _advice({"fp16": run})
    assert advice[0].startswith("keep in float32") and advice[0].endswith(": Dense_1")
    assert any(a.startswith("bf16 rather than fp16") for a in advice)
    assert any("initial loss scale 32768 (2^15)" in a for a in advice)  # 65504 / 0.5 / 2


def test_the_debugging_guide_example_runs_and_prints_what_it_says(capsys):
    import pathlib
    import re

    guide = (pathlib.Path(__file__).parents[1] / "docs/guides/debugging_precision.md")
    code = re.findall(r"```python\n(.*?)```", guide.read_text(), re.S)[0]
    exec(compile(code, str(guide), "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    said = [line[2:] for line in code.splitlines() if line.startswith("# ")]
    assert printed[-1] == said[-1], (printed, said)


def test_a_resumed_run_drops_the_statistics_logged_after_its_checkpoint(tmp_path):
    import json

    from jamp.metrics import MetricsWriter

    w = MetricsWriter(str(tmp_path))
    row = {"w": {"amax": float("nan"), "underflow_fraction": 0.0, "headroom_bits": 1.0,
                 "nan_count": 1, "inf_count": 0}}
    for step in (10, 20, 30):
        w.write_tensor_stats(step, {"grads": row}, loss_scale=2.0)
    w.close()
    MetricsWriter(str(tmp_path), resume_step=20).close()
    lines = (tmp_path / "tensor_stats.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [10, 20]
    assert json.loads(lines[0])["grads"]["w"]["amax"] == "NaN"  # strict JSON


def test_the_gradient_search_prefers_a_leaf_holding_inf_alone_over_an_earlier_nan():
    """An overflow in the backward pass leaves inf where it happened and NaN (inf - inf)
    further down: the leaf with inf alone is named, though 'a' comes first."""
    c = ts.Collector(every=0)
    grads = {"a": jnp.array([jnp.nan, 1.0]), "b": jnp.array([1.0, jnp.inf]),
             "c": jnp.array([jnp.nan, jnp.inf])}
    m = jax.jit(lambda g: c.step_metrics(step=jnp.int32(1), params={}, grads=g, scale=1.0,
                                         bad=jnp.bool_(True)))(grads)
    assert c.explain(jax.device_get(m)) == "inf in the gradient of b (element (1,); 2 more " \
        "non-finite)"
    m = jax.jit(lambda g: c.step_metrics(step=jnp.int32(1), params={}, grads=g, scale=1.0,
                                         bad=jnp.bool_(False)))(grads)
    assert c.explain(jax.device_get(m)) is None  # a finite step: the search never ran


# ----------------------------------------------------------------------------- a pipeline


def _pipeline_config(mesh, framework, mode="fp16"):
    from jamp.config import vit_config

    c = vit_config(mode)
    c.num_layers, c.hidden_size, c.num_heads, c.mlp_dim, c.batch_size = 2, 16, 2, 16, 16
    c.mesh.data, c.mesh.pipe, c.pipeline_microbatches = mesh["data"], mesh.get("pipe", 1), 2
    c.tensor_stats_every, c.max_steps, c.warmup_steps, c.framework = 1, 2, 1, framework
    if mode == "fp16":
        c.loss_scale.init_scale = 2.0**8
    return c


def _plain_layer_outputs(c, variables, images):
    """The reference: the unpipelined model (data=8, no layer runner) on one device, its
    layer outputs' statistics by name (``variables``: the parameters and the fp8 state)."""
    import types

    from jamp import experiment, train

    c = c.copy_and_resolve_references()
    c.mesh.data, c.mesh.pipe = 8, 1
    plain = experiment.build_experiment(c)
    assert plain.pipeline is None
    outputs, names = train.layer_outputs(plain), []

    def forward(variables, images):
        tree = outputs(types.SimpleNamespace(apply_fn=plain.apply_fn), variables,
                       {"image": images}, jax.random.key(0),
                       lambda x: ts.array_stats(x, jnp.float16))
        stats, rows = ts.reduced_stats(ts.ordered_leaves(tree), ("layers",))
        names[:] = [r.name for r in rows]
        return stats.amax

    amax = jax.jit(forward)(variables, images)
    return dict(zip(names, np.asarray(amax).tolist(), strict=True))


@pytest.mark.parametrize("framework,mode", [("linen", "fp16"), ("nnx", "fp16"),
                                            ("linen", "fp8")])
def test_a_pipeline_collects_every_layer_output_as_the_unpipelined_model_does(framework, mode):
    from jamp import data, experiment, parallel, train

    c = _pipeline_config({"data": 4, "pipe": 2}, framework, mode)
    exp = experiment.build_experiment(c)
    assert exp.pipeline is not None
    local = next(iter(data.train_loader(exp.info, image_size=c.image_size,
                                        global_batch_size=c.batch_size, seed=0)))
    rng = jax.random.key(0)
    with jax.set_mesh(exp.mesh):
        abstract, shardings = experiment.state_shardings(exp, rng)
        state = experiment.init_state(exp, rng, shardings)
    variables = {"params": state.params, **jamp.step.differentiated_variables(state)}
    expected = _plain_layer_outputs(c, jax.device_get(variables), local["image"])
    with jax.set_mesh(exp.mesh), nn.logical_axis_rules(parallel.LOGICAL_AXIS_RULES):
        collector = train.stats_collector(exp)
        step = train.jit_train_step(exp, shardings, abstract, collector)
        batch = {k: jax.device_put(v, parallel.batch_sharding(exp.mesh)) for k, v in local.items()}
        state, m = step(state, batch, jax.random.key(1))
    m = jax.device_get(m)
    assert m["tensor_stats_collected"] and not m["skipped"]
    table = ts.table(m, collector.rows)["activations"]
    fc1 = ["mlp", "fc1"] if framework == "nnx" else ["MlpBlock_0", "Dense_0"]
    assert f"encoder/layers/1/{'/'.join(fc1)}" in table
    assert list(table) == list(expected)  # every layer of both stages, in forward order
    # The same up to rounding: another sharding sums in another order. fp8 rounds the
    # matmuls' inputs to 3 mantissa bits, so one flipped rounding moves an output by %.
    rtol = 1.01 * 2.0**-10 if mode == "fp16" else 0.05
    for row, amax in expected.items():
        np.testing.assert_allclose(table[row]["amax"], amax, rtol=rtol, err_msg=row)
    if mode != "fp16":
        return  # fp8 computes in bfloat16: a bias of 7e4 does not overflow it

    # the second stage's first MLP layer overflows: the skip names it
    def hot(path, p):
        keys = [getattr(k, "key", "") for k in path]
        return p.at[1].add(7e4) if keys[-3:] == [*fc1, "bias"] else p
    hot_state = state.replace(params=jax.tree_util.tree_map_with_path(hot, state.params))
    with jax.set_mesh(exp.mesh), nn.logical_axis_rules(parallel.LOGICAL_AXIS_RULES):
        _, m = step(hot_state, batch, jax.random.key(2))
    m = jax.device_get(m)
    assert m["skipped"] and collector.explain(m).endswith(
        f"forward: inf in the output of encoder/layers/1/{'/'.join(fc1)} "
        "(first in data shard 0 of 4)"), collector.explain(m)
