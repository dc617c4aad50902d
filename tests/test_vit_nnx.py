"""The NNX ViT against the linen ViT (issue 13, item 4).

From the same initial weights (``vit_nnx.from_linen``), the NNX ViT trained through
``nnx_functional.functional`` with ``jamp.train_step`` gives bit for bit the losses and loss
scales of the linen ViT over 20 steps in fp32, fp16, bf16 and fp16_naive (the two trace to
the same operations in the same dtypes; tolerance 0 on CPU). The fp16 modes start at a loss
scale that overflows, so the trajectories include skips and growth. Then: the jaxpr dtype
contract in every mode (and the same dot/softmax dtypes as linen), ``nnx.Optimizer`` with
the mode's loss scale (same trajectory, exact skip, exact orbax resume mid growth
interval), sharding from the NNX metadata on a data x model mesh, GPipe through the layer
runner, unscanned and rematted blocks, dropout, and the errors.
"""

from __future__ import annotations

import collections
import functools
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from flax.training import train_state
from jaxpr_utils import iter_eqns

import jamp
from jamp import nnx_functional, parallel
from jamp.models import vit, vit_nnx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = dict(num_classes=10, patch_size=4, num_layers=2, hidden_size=16, num_heads=2,
             mlp_dim=32)
IMAGE = (8, 8, 1)
STEPS = 20
PARITY_MODES = ("fp32", "fp16", "bf16", "fp16_naive")
FLOAT32_SOFTMAX = ("fp16", "bf16", "fp16_naive")
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
"""XLA's CPU compile of a tiny ViT step is ~5x faster so; linen and NNX get the same options."""


def _recipe(mode):
    """fp16 modes start at a scale that overflows (skips), and grow every 4 finite steps."""
    settings = dict(init_scale=2.0**20, growth_interval=4) if "fp16" in mode else {}
    return jamp.mixed_precision(mode, **settings)


_rng = np.random.default_rng(0)
BATCHES = [{"image": _rng.normal(size=(8, *IMAGE)).astype(np.float32),
            "label": _rng.integers(0, 10, 8).astype(np.int32)} for _ in range(4)]
"""Four fixed batches, cycled (NumPy: no eager JAX op to compile)."""


@pytest.fixture(scope="module")
def linen_module():
    return vit.create("ti", **SIZES)


@pytest.fixture(scope="module")
def linen_params(linen_module):
    """The linen ViT's initial weights, float32 (its fp32-mode init)."""
    init = jax.jit(jamp.apply_policy(linen_module, "fp32").init, compiler_options=FAST)
    return nn.unbox(init(jax.random.key(0), jnp.zeros((1, *IMAGE))))["params"]


def _nnx_model(linen_module, linen_params, mode):
    return jamp.apply_policy(vit_nnx.from_linen(linen_module, linen_params), _recipe(mode))


def _bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(nnx.as_pure(tree))]


# ----------------------------------------------------------------------------- weights


def test_from_linen_and_back_is_bit_exact_and_rounds_like_linen(linen_module, linen_params):
    model = vit_nnx.from_linen(linen_module, linen_params)
    assert jax.tree.structure(vit_nnx.to_linen(model)) == jax.tree.structure(linen_params)
    assert _bits(vit_nnx.to_linen(model)) == _bits(linen_params)
    # Under fp16_naive both round the same float32 draws to float16 (norms stay float32).
    naive = jax.jit(jamp.apply_policy(linen_module, "fp16_naive").init, compiler_options=FAST)(
        jax.random.key(0), jnp.zeros((1, *IMAGE)))
    rounded = vit_nnx.to_linen(jamp.apply_policy(model, "fp16_naive"))
    assert jax.tree.map(lambda a: a.dtype, rounded) == jax.tree.map(
        lambda a: a.dtype, nn.unbox(naive)["params"])
    assert _bits(rounded) == _bits(nn.unbox(naive)["params"])


def test_logical_axis_names_are_linens(linen_module):
    boxed = jax.eval_shape(linen_module.init, jax.random.key(0), jnp.zeros((1, *IMAGE)))
    linen_specs = nn.get_partition_spec(boxed)["params"]
    model = nnx.eval_shape(lambda: vit_nnx.create(
        "ti", **SIZES, image_size=IMAGE[0], channels=IMAGE[2], rngs=nnx.Rngs(0)))
    specs = {vit_nnx._linen_path(path): spec.get_value() for path, spec in nnx.to_flat_state(
        nnx.get_partition_spec(nnx.state(model, nnx.Param)))}
    expected = {tuple(k.key for k in path): spec for path, spec in
                jax.tree_util.tree_flatten_with_path(linen_specs)[0]}
    assert specs == expected
    assert expected[("encoder", "layers", "MlpBlock_0", "Dense_0", "kernel")] == jax.P(
        "layers", "embed", "mlp")


# ----------------------------------------------------------------------------- parity


_TRAJECTORIES: dict[tuple[str, str], list[tuple[float, float]]] = {}


def _train(apply_fn, params, mp):
    """``STEPS`` steps of ``jamp.train_step`` (one compile): [(loss, loss scale)]."""
    tx = jamp.make_optimizer(mp, optax.adam(1e-2))
    create = jax.jit(lambda p: train_state.TrainState.create(apply_fn=apply_fn, params=p, tx=tx),
                     compiler_options=FAST)

    @functools.partial(jax.jit, compiler_options=FAST)
    def step(state, batch, i):
        new, metrics = jamp.train_step(state, batch, jax.random.key(i))
        kept = jnp.all(jnp.stack([jnp.array_equal(a, b) for a, b in zip(
            jax.tree.leaves(state.params), jax.tree.leaves(new.params), strict=True)]))
        return new, (metrics["loss"], metrics["loss_scale"], metrics["grad_finite"], kept)

    state, out = create(params), []
    for i in range(STEPS):
        state, metrics = step(state, BATCHES[i % 4], i)
        out.append(metrics)
    losses, scales, finite, kept = np.array(jax.device_get(out)).T
    # A skipped step leaves every parameter as it was (by value: jamp's skip adds +0.0,
    # which turns a float16 -0.0 into +0.0).
    assert kept[finite == 0].all()
    return [(float(a), float(b)) for a, b in zip(losses, scales, strict=True)]


@pytest.mark.parametrize("mode", PARITY_MODES)
def test_linen_and_nnx_train_alike(mode, linen_module, linen_params):
    mp = _recipe(mode)
    model = _nnx_model(linen_module, linen_params, mode)
    # Linen's own init in this mode gives these (rounded) weights: see the test above.
    linen = _train(jamp.apply_policy(linen_module, mp).apply, vit_nnx.to_linen(model), mp)
    ours = _train(*nnx_functional.functional(model), mp)
    assert ours == linen  # bit for bit: losses and loss scales
    losses, scales = np.array(ours).T
    assert losses[-1] < 0.9 * losses[0]  # it trains
    if "fp16" in mode:  # the initial scale overflows: skips (scale halved), then growth
        pairs = list(zip(scales, scales[1:], strict=False))
        assert any(b == a / 2 for a, b in pairs) and any(b == 2 * a for a, b in pairs)
    _TRAJECTORIES[mode, "linen"] = linen


# ----------------------------------------------------------------------------- jaxpr contract


def _dtypes(jaxpr, names):
    return collections.Counter(tuple(str(v.aval.dtype) for v in e.invars)
                               for e in iter_eqns(jaxpr) if e.primitive.name in names)


@pytest.mark.parametrize("mode", jamp.MODES)
def test_jaxpr_dtypes_every_mode_and_as_linen(mode, linen_module, linen_params):
    mp = jamp.mixed_precision(mode)
    compute = str(jnp.dtype(mp.policy.compute_dtype))
    model = nnx.eval_shape(  # abstract: the jaxprs need shapes and dtypes only
        lambda: jamp.apply_policy(vit_nnx.from_linen(linen_module, linen_params), mp))
    apply_fn, params = nnx_functional.functional(model)
    linen = jamp.apply_policy(linen_module, mp)
    linen_params_mode = vit_nnx.to_linen(model)
    x = jnp.linspace(-1.0, 1.0, 2 * np.prod(IMAGE)).reshape(2, *IMAGE)
    loss = lambda f: lambda p: jnp.sum(f({"params": p}, x).astype(jnp.float32))
    fwd, out = jax.make_jaxpr(lambda p: apply_fn({"params": p}, x), return_shape=True)(params)
    grad = jax.make_jaxpr(jax.grad(loss(apply_fn)))(params)
    linen_fwd = jax.make_jaxpr(lambda p: linen.apply({"params": p}, x))(linen_params_mode)
    linen_grad = jax.make_jaxpr(jax.grad(loss(linen.apply)))(linen_params_mode)
    assert out.dtype == mp.policy.output_dtype
    for jaxpr, reference in ((fwd, linen_fwd), (grad, linen_grad)):
        dots = _dtypes(jaxpr, ("dot_general", "conv_general_dilated"))
        assert set(dots) == {(compute, compute)}, (mode, dots)
        softmax = "float32" if compute == "float32" or mode in FLOAT32_SOFTMAX else compute
        assert set(_dtypes(jaxpr, ("exp",))) == {(softmax,)}, mode
        assert set(_dtypes(jaxpr, ("rsqrt",))) == {("float32",)}  # norm statistics
        for names in (("dot_general", "conv_general_dilated"), ("exp",), ("rsqrt",)):
            assert _dtypes(jaxpr, names) == _dtypes(reference, names), (mode, names)
    norms = ("norm1", "norm2", "encoder_norm")
    for path, param in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        norm = any(p in norms for p in path) and mode in FLOAT32_SOFTMAX
        assert param.get_value().dtype == (jnp.float32 if norm else mp.policy.param_dtype)


# ----------------------------------------------------------------------------- nnx.Optimizer


def _loss_and_update(model, optimizer, batch, poison):
    def loss_fn(m):
        loss = jamp.step.cross_entropy(m(batch["image"], train=True), batch["label"])
        return jamp.scale_loss(loss, optimizer), loss

    grads, loss = nnx.grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, jax.tree.map(lambda g: g + poison.astype(g.dtype), grads))
    return loss


def _nnx_step(model, optimizer, batch, poison):
    """``nnx.jit(_loss_and_update)``, spelt with split/merge to pass XLA's options."""
    graphdef, state = nnx.split((model, optimizer))
    loss, state = _jitted_update(graphdef, state, batch, poison)
    nnx.update((model, optimizer), state)
    return loss


@functools.partial(jax.jit, static_argnums=0, compiler_options=FAST)
def _jitted_update(graphdef, state, batch, poison):
    model, optimizer = nnx.merge(graphdef, state)
    loss = _loss_and_update(model, optimizer, batch, poison)
    return loss, nnx.state((model, optimizer))


@pytest.fixture(scope="module")
def nnx_fp16(linen_module, linen_params):
    """``nnx.split`` of a fresh fp16 NNX ViT and its ``nnx.Optimizer`` (built once)."""
    model = _nnx_model(linen_module, linen_params, "fp16")
    tx = jamp.make_optimizer(_recipe("fp16"), optax.adam(1e-2))
    return nnx.split((model, nnx.Optimizer(model, tx, wrt=nnx.Param)))


def _fresh(split):
    graphdef, state = split
    return nnx.merge(graphdef, jax.tree.map(lambda x: x, state))  # new Variables


def _nnx_run(model, optimizer, steps):
    out = []
    for i in steps:
        scale = float(jamp.loss_scale(optimizer))
        out.append((float(_nnx_step(model, optimizer, BATCHES[i % 4], jnp.float32(0))), scale))
    return out


def test_nnx_optimizer_trains_and_skips_exactly(nnx_fp16):
    model, optimizer = _fresh(nnx_fp16)
    trajectory = _nnx_run(model, optimizer, range(STEPS))
    if ("fp16", "linen") in _TRAJECTORIES:  # the parity test ran: same numbers as linen
        assert trajectory == _TRAJECTORIES["fp16", "linen"]
    for bad in (jnp.inf, jnp.nan):  # an injected overflow after the scale has settled
        params, inner = _bits(nnx.state(model)), _bits(optimizer.opt_state.inner_state)
        skipped = int(jamp.overflow_stats(optimizer).steps_skipped)
        scale = float(jamp.loss_scale(optimizer))
        _nnx_step(model, optimizer, BATCHES[0], jnp.float32(bad))
        # Every parameter and every leaf of Adam's state (moments, count) bit-identical.
        assert _bits(nnx.state(model)) == params
        assert _bits(optimizer.opt_state.inner_state) == inner
        assert float(jamp.loss_scale(optimizer)) == scale / 2
        assert int(jamp.overflow_stats(optimizer).steps_skipped) == skipped + 1


def test_nnx_checkpoint_resumes_exactly_mid_growth_interval(nnx_fp16, tmp_path):
    straight = _nnx_run(*_fresh(nnx_fp16), range(10))
    model, optimizer = _fresh(nnx_fp16)
    first = _nnx_run(model, optimizer, range(6))
    assert int(optimizer.opt_state.growth_tracker.get_value()) not in (0, 4)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", nnx.state((model, optimizer)))
    checkpointer.wait_until_finished()
    model, optimizer = _fresh(nnx_fp16)
    nnx.update((model, optimizer),
               checkpointer.restore(tmp_path / "ckpt", nnx.state((model, optimizer))))
    assert first + _nnx_run(model, optimizer, range(6, 10)) == straight


# ----------------------------------------------------------------------------- parallelism


def test_data_and_tensor_parallel_step_from_the_nnx_metadata(linen_module, linen_params):
    """The trainer's recipe, NNX params boxed: shardings from the logical names, one step."""
    tx = jamp.make_optimizer(jamp.mixed_precision("fp16", init_scale=2.0**8), optax.adam(1e-2))
    apply_fn, boxed = nnx_functional.functional(_nnx_model(linen_module, linen_params, "fp16"),
                                         boxed=True)
    create = lambda p: train_state.TrainState.create(apply_fn=apply_fn, params=p, tx=tx)
    state = jax.eval_shape(create, boxed)
    mesh = parallel.make_mesh({"data": 4, "model": 2, "pipe": 1})
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(state), mesh,
                                            parallel.LOGICAL_AXIS_RULES)
    kernel = shardings.params["encoder"]["layers"]["mlp"]["fc1"]["kernel"]
    assert tuple(kernel.spec) == ("pipe", None, "model")  # [layers, embed, mlp]
    assert tuple(shardings.opt_state.inner_state[0].mu["encoder"]["layers"]["mlp"]["fc1"][
        "kernel"].spec) == ("pipe", None, "model")
    specs = jax.tree.map(lambda s: s.spec, shardings.params)
    with jax.set_mesh(mesh), nn.logical_axis_rules(parallel.LOGICAL_AXIS_RULES):
        state = jax.jit(lambda p: nn.unbox(create(p)), out_shardings=shardings,
                        compiler_options=FAST)(boxed)
        step = jax.jit(lambda s, b, r: jamp.train_step(
            s, b, r, value_and_grad=parallel.step.value_and_grad(specs)),
            out_shardings=(shardings, None), compiler_options=FAST)
        for i in range(2):
            state, metrics = step(state, BATCHES[i], jax.random.key(i))
    assert state.params["encoder"]["layers"]["mlp"]["fc1"]["kernel"].sharding.spec == kernel.spec
    assert bool(metrics["grad_finite"]) and np.isfinite(float(metrics["loss"]))


def test_gpipe_layer_runner_matches_the_scan(linen_module, linen_params):
    mesh = parallel.make_mesh({"data": 4, "model": 1, "pipe": 2})
    plain = vit_nnx.from_linen(linen_module, linen_params)
    piped = vit_nnx.from_linen(linen_module.clone(layer_runner=parallel.pipeline.GPipe(2, 2)),
                               linen_params)
    x = BATCHES[0]["image"]
    apply_plain, params = nnx_functional.functional(plain)
    apply_piped, _ = nnx_functional.functional(piped)
    # The head is zero-initialised: compare the features it sees.
    features = lambda f: lambda p, x: f({"params": {**p, "head": {
        "kernel": jnp.eye(16, 10), "bias": jnp.zeros(10)}}}, x)
    expected = jax.jit(features(apply_plain), compiler_options=FAST)(params, x)
    with jax.set_mesh(mesh):
        got = jax.jit(features(apply_piped), compiler_options=FAST)(params, x)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_unscanned_rematted_blocks_and_dropout_match_linen(linen_module, linen_params):
    module = linen_module.clone(scan_layers=False, remat=True)
    # Every weight perturbed (norms and head start as ones/zeros): a misplaced one shows.
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda a: np.asarray(a) + rng.normal(0, 0.1, a.shape).astype(a.dtype),
                          linen_params)
    params["encoder"] = {f"layers_{i}": jax.tree.map(lambda a, i=i: a[i],
                                                     params["encoder"]["layers"])
                         for i in range(2)}
    model = vit_nnx.from_linen(module, params)
    assert sorted(vit_nnx.to_linen(model)["encoder"]) == ["layers_0", "layers_1"]
    # Attention dropout only happens in the encoder blocks; dropout_rate everywhere.
    apply_fn, nnx_params = nnx_functional.functional(model)
    dropouts = [nnx_functional.functional(vit_nnx.from_linen(module.clone(**rate), params))[0]
                for rate in ({"attention_dropout_rate": 0.5}, {"dropout_rate": 0.5})]

    @functools.partial(jax.jit, compiler_options=FAST)
    def outputs(p, linen_p, x):
        train = lambda f, k: f({"params": p}, x, train=True, rngs={"dropout": jax.random.key(k)})
        return (apply_fn({"params": p}, x), module.apply({"params": linen_p}, x),
                [(f({"params": p}, x), train(f, 0), train(f, 0), train(f, 1)) for f in dropouts])

    ours, linen, dropped = outputs(nnx_params, params, BATCHES[0]["image"])
    np.testing.assert_allclose(ours, linen, rtol=1e-5, atol=1e-6)
    for no_dropout, a, b, c in dropped:
        np.testing.assert_array_equal(no_dropout, ours)  # train=False: no dropout
        np.testing.assert_array_equal(a, b)  # the same key, the same masks
        assert not np.allclose(a, c) and not np.allclose(a, ours)


# ----------------------------------------------------------------------------- errors


def test_clear_errors(linen_module, linen_params):
    model = vit_nnx.from_linen(linen_module, linen_params)
    with pytest.raises(ValueError, match="built for 8x8 images"):
        model(jnp.zeros((1, 16, 16, 1)))
    with pytest.raises(ValueError, match="channels=1, got 3"):
        model(jnp.zeros((1, 8, 8, 3)))
    with pytest.raises(ValueError, match=r"shape \[batch, height, width, channels\]"):
        model(jnp.zeros((8, 8, 1)))
    with pytest.raises(ValueError, match="needs rngs"):
        vit_nnx.from_linen(linen_module.clone(dropout_rate=0.1), linen_params)(
            jnp.zeros((1, *IMAGE)), train=True)
    with pytest.raises(ValueError, match="not divisible by patch_size=3"):
        vit_nnx.create("ti", num_classes=2, image_size=8, patch_size=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"Unknown ViT field\(s\) \['depth'\]"):
        vit_nnx.create("ti", num_classes=2, image_size=8, depth=2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="layer_runner runs the scanned blocks"):
        vit_nnx.from_linen(linen_module.clone(scan_layers=False,
                                              layer_runner=parallel.pipeline.GPipe(2, 2)),
                           linen_params)
    wrong = {**linen_params, "head": {"kernel": jnp.zeros((16, 3)), "bias": jnp.zeros(10)}}
    with pytest.raises(ValueError, match=r"params\[head/kernel\] has shape \(16, 3\)"):
        vit_nnx.from_linen(linen_module, wrong)
    with pytest.raises(ValueError, match="missing.*cls.*unexpected.*extra"):
        vit_nnx.from_linen(linen_module, {**{k: v for k, v in linen_params.items()
                                             if k != "cls"}, "extra": jnp.zeros(1)})
    with pytest.raises(ValueError, match="not a square number: pass image_size"):
        odd = {**linen_params, "pos_embedding": jnp.zeros((1, 7, 16))}
        vit_nnx.from_linen(linen_module, odd)
    with pytest.raises(TypeError, match="expects a jamp.models.vit.ViT"):
        vit_nnx.from_linen(nn.Dense(2), linen_params)
    with pytest.raises(ValueError, match=r"only state is nnx.Param.*BatchStat"):
        nnx_functional.functional(nnx.BatchNorm(2, rngs=nnx.Rngs(0)))


def test_the_trainers_view_lives_outside_the_model_module():
    """``jamp.nnx_functional`` holds ``functional``/``fp8_state``; the model module keeps the
    old names as aliases, resolved on use, and imports nothing of the trainer's."""
    assert vit_nnx.functional is nnx_functional.functional
    assert vit_nnx.fp8_state is nnx_functional.fp8_state
    with pytest.raises(AttributeError, match="no attribute 'functionals'"):
        vit_nnx.functionals  # noqa: B018
    code = ("import sys, jamp.models.vit_nnx; "
            "print([m for m in ('jamp.nnx_functional', 'jamp.experiment') if m in sys.modules])")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stdout + run.stderr


def test_trainer_switch_builds_the_nnx_state_from_the_linen_weights():
    from jamp import experiment
    from jamp.config import vit_config

    config = vit_config("fp16")
    config.framework = "nnx"
    exp = experiment.build_experiment(config)
    abstract, shardings = experiment.state_shardings(exp, jax.random.key(0))
    assert abstract.apply_fn is exp.apply_fn  # one static apply_fn for every state of the run
    assert "fc1" in abstract.params["encoder"]["layers"]["mlp"]
    linen = experiment.build_experiment(vit_config("fp16"))
    state = experiment.init_state(exp, jax.random.key(0), shardings)
    linen_state = experiment.init_state(linen, jax.random.key(0), experiment.state_shardings(
        linen, jax.random.key(0))[1])
    assert jax.tree.leaves(vit_nnx.to_linen(vit_nnx.from_linen(
        linen.model, linen_state.params))) == jax.tree.leaves(linen_state.params)
    nnx_kernel = state.params["encoder"]["layers"]["mlp"]["fc1"]["kernel"]
    linen_kernel = linen_state.params["encoder"]["layers"]["MlpBlock_0"]["Dense_0"]["kernel"]
    np.testing.assert_array_equal(nnx_kernel, linen_kernel)
    config = vit_config("fp16")
    config.framework = "flax"
    with pytest.raises(experiment.ConfigError, match="framework"):
        experiment.build_experiment(config)
