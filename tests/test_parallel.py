"""Data, tensor and pipeline parallelism on the session's 8 fake CPU devices.

Every mesh trains the same tiny ViT (2 blocks, width 16) on the same 20 batches
with the trainer's own jitted step (``jamp.train.jit_train_step``) and is compared
with the single-device run (mesh 1x1x1 on one of the 8 devices):

- fp32: the same loss trajectory and final parameters to float tolerance. The
  optimizer is SGD with momentum: Adam divides by sqrt(v), so for a parameter
  whose gradient is ~0 (pure rounding noise) it steps +-lr whatever the noise,
  and two runs that differ only in summation order then differ by lr in that
  parameter. SGD keeps parameter differences proportional to gradient differences.
- fp16: the same loss-scale trajectory (growth every 2 finite steps, back-off on
  the steps whose batch holds a NaN image). Overflows are injected through the
  data because natural fp16 overflows are *not* sharding-invariant: with the
  gradient reduced in float32, a sum that overflows float16 on one device can fit
  in float16 per data shard (see the README, "Scaling out").

An inf, -inf or NaN placed in the gradient of one model shard (tensor), one stage
(pipeline) or one model shard of one stage (3d) makes every device skip the step
and keep the same, backed-off loss scale.

Each step is compiled once per mesh and mode (module-scoped cache) with XLA's
cheap backend options, identical for every mesh.
"""

from __future__ import annotations

import contextlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jamp
from jamp import data, experiment, parallel, train
from jamp.config import vit_config
from jamp.loss_scale import loss_scale, overflow_stats
from jamp.master import master_params
from jamp.parallel import pipeline

if len(jax.devices()) < 8:  # conftest forces 8 CPU devices
    pytest.skip("needs 8 devices", allow_module_level=True)

MESHES = {"single": (1, 1, 1), "data": (8, 1, 1), "tensor": (4, 2, 1),
          "pipeline": (4, 1, 2), "3d": (2, 2, 2)}
STEPS, BATCH, NAN_STEPS = 20, 32, (3, 9, 14)
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
MLP_KERNEL = ("encoder", "layers", "MlpBlock_0", "Dense_0", "kernel")  # [layers, embed, mlp]


def tiny_config(mode: str, mesh: tuple[int, int, int], **fields):
    config = vit_config(mode)
    config.num_layers, config.hidden_size, config.num_heads, config.mlp_dim = 2, 16, 2, 32
    config.batch_size, config.max_steps, config.pipeline_microbatches = BATCH, STEPS, 2
    config.optimizer, config.warmup_steps, config.progress, config.plot = "sgd", 5, False, False
    config.mesh.data, config.mesh.model, config.mesh.pipe = mesh
    if mode != "fp32":  # fp32 has no loss scale (setting one is a config error)
        config.loss_scale.init_scale, config.loss_scale.growth_interval = 2.0**8, 2
    for key, value in fields.items():
        config[key] = value
    return config


@pytest.fixture(scope="module")
def batches():
    it = iter(data.train_loader(data.get_dataset_info("digits"), image_size=8,
                                global_batch_size=BATCH, seed=0))
    return [next(it) for _ in range(STEPS)]


class Run:
    """One mesh and mode: the experiment, its compiled step and a 20-step trajectory."""

    def __init__(self, mode, mesh, batches, initial=None):
        self.exp = experiment.build_experiment(tiny_config(mode, mesh))
        rng = jax.random.key(0)
        with jax.set_mesh(self.exp.mesh):
            _, self.shardings = experiment.state_shardings(self.exp, rng)
            if initial is None:  # created once per mode, then placed on each mesh
                initial = jax.device_get(experiment.init_state(self.exp, rng, self.shardings))
        self.initial = initial.replace(apply_fn=self.exp.model.apply, tx=self.exp.tx)
        self.batch_sharding = parallel.batch_sharding(self.exp.mesh)
        with self.context():
            self.step = train.jit_train_step(self.exp, self.shardings).lower(
                self.state0(), self.batch(batches[0]), rng).compile(FAST)
        self.losses, self.scales, self.finite = [], [], []
        state = self.state0()
        for i, local in enumerate(batches):
            if mode != "fp32" and i in NAN_STEPS:
                local = {**local, "image": local["image"].copy()}
                local["image"][5, 3, 3, 0] = np.nan  # one example, on one data shard
            with self.context():
                state, metrics = self.step(state, self.batch(local), jax.random.fold_in(rng, i))
            self.losses.append(float(metrics["loss"]))
            self.scales.append(float(metrics["loss_scale"]))
            self.finite.append(bool(metrics["grad_finite"]))
        self.final = state

    @contextlib.contextmanager
    def context(self):
        """The mesh and logical axis rules the trainer runs its step under."""
        with jax.set_mesh(self.exp.mesh), nn.logical_axis_rules(parallel.LOGICAL_AXIS_RULES):
            yield

    def state0(self):
        return jax.device_put(self.initial, self.shardings)

    def batch(self, local):
        return {k: jax.device_put(v, self.batch_sharding) for k, v in local.items()}


@pytest.fixture(scope="module")
def runs(batches):
    cache: dict[tuple[str, str], Run] = {}

    def get(mode: str, name: str) -> Run:
        if (mode, name) not in cache:
            single = None if name == "single" else get(mode, "single")
            cache[mode, name] = Run(mode, MESHES[name], batches,
                                    None if single is None else single.initial)
        return cache[mode, name]

    return get


def _leaves(tree):
    return [np.asarray(x, np.float32) for x in jax.tree_util.tree_leaves(jax.device_get(tree))]


@pytest.mark.parametrize("name", ["data", "tensor", "pipeline", "3d"])
def test_fp32_matches_single_device(runs, name):
    ref, run = runs("fp32", "single"), runs("fp32", name)
    assert ref.exp.mesh.devices.size == 1 and run.exp.mesh.devices.size == 8
    np.testing.assert_allclose(run.losses, ref.losses, rtol=1e-5, atol=1e-6)
    assert run.finite == [True] * STEPS
    for got, want in zip(_leaves(run.final.params), _leaves(ref.final.params), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # The state keeps its sharding through the step (output shardings of the trainer).
    for leaf, sharding in zip(jax.tree_util.tree_leaves(run.final),
                              jax.tree_util.tree_leaves(run.shardings), strict=True):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)


@pytest.mark.parametrize("name", ["data", "tensor", "pipeline", "3d"])
def test_fp16_same_loss_scale_trajectory(runs, name):
    ref, run = runs("fp16", "single"), runs("fp16", name)
    assert ref.finite == [i not in NAN_STEPS for i in range(STEPS)]
    assert run.finite == ref.finite
    assert run.scales == ref.scales
    assert len(set(ref.scales)) > 3  # it grew and backed off
    # fp16 rounding depends on where partial sums are taken: close, not bit-equal.
    finite = [i for i in range(STEPS) if ref.finite[i]]
    np.testing.assert_allclose(np.take(run.losses, finite), np.take(ref.losses, finite),
                               rtol=5e-3)
    assert float(loss_scale(run.final.opt_state)) == float(loss_scale(ref.final.opt_state))


def _all_reduces(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
    """(element type, shape) of every all-reduce operand in compiled HLO text."""
    found = []
    for line in hlo.splitlines():
        match = re.search(r"= (.*?) all-reduce(?:-start)?\(", line)
        if match:
            for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", match.group(1)):
                found.append((dtype, tuple(int(d) for d in dims.split(",") if d)))
    return found


def _all_reduce_dtypes(hlo: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for dtype, _ in _all_reduces(hlo):
        counts[dtype] = counts.get(dtype, 0) + 1
    return counts


def test_fp16_gradients_all_reduced_in_float32(runs):
    # fp16: float32 params, float16 compute. The data-parallel step reduces every
    # gradient in float32: no float16 all-reduce in the compiled step at all.
    dtypes = _all_reduce_dtypes(runs("fp16", "data").step.as_text())
    assert dtypes.get("f32", 0) > 0 and "f16" not in dtypes, dtypes


def test_tensor_parallel_is_megatron_style(runs):
    # Over 'model' only activations are all-reduced, in float16: the outputs of the
    # row-parallel matmuls (attention output, second MLP matmul) and, backward, the
    # input gradients of the column-parallel ones: [batch, seq=17, embed=16] blocks.
    # Gradients are all-reduced (over 'data') in float32 only.
    reduces = _all_reduces(runs("fp16", "tensor").step.as_text())
    half = [shape for dtype, shape in reduces if dtype == "f16"]
    assert half and all(shape[-2:] == (17, 16) for shape in half), half
    assert {dtype for dtype, _ in reduces} == {"f16", "f32"}


def test_plain_jit_would_all_reduce_in_float16():
    # jax-ml/jax#27496, the reason for jamp.parallel.data_parallel: the partitioner
    # puts the all-reduce after the float16 weight-gradient matmul, before the cast
    # back to the float32 parameter.
    mesh = parallel.make_mesh({"data": 8})
    model = jamp.apply_policy(nn.Dense(16), "fp16")
    x = jnp.ones((64, 32))
    params = model.init(jax.random.key(0), x)["params"]
    loss = lambda p, batch, *_: (jnp.mean(model.apply({"params": p}, batch) ** 2), {})
    with jax.set_mesh(mesh):
        x = jax.device_put(x, parallel.batch_sharding(mesh))
        plain = jax.jit(jax.grad(lambda p, b: loss(p, b)[0])).lower(params, x).compile(FAST)
        ours = jax.jit(parallel.data_parallel.value_and_grad(loss)).lower(params, x).compile(FAST)
    assert "f16" in _all_reduce_dtypes(plain.as_text())
    assert "f16" not in _all_reduce_dtypes(ours.as_text())
    assert _all_reduce_dtypes(ours.as_text())["f32"] >= 1


def test_sharded_half_precision_sums_overflow_no_sooner_than_one_device():
    # 8 examples whose weight gradients are 51200 each (float16 max: 65504). One
    # device's float16 matmul sums them to 409600: inf. Each data shard holds its
    # share of the mean loss, so it computes one 51200 in float16 and the float32
    # all-reduce forms the sum exactly.
    mesh = parallel.make_mesh({"data": 8})
    model = jamp.apply_policy(nn.Dense(1, use_bias=False), "fp16")
    params = {"kernel": jnp.ones((1, 1))}
    x = jnp.full((8, 1), 100.0)
    loss = lambda p, batch: (jnp.mean(model.apply({"params": p}, batch)) * 2.0**12, {})
    one_device = jax.grad(lambda p: loss(p, x)[0])(params)["kernel"]
    with jax.set_mesh(mesh):
        x = jax.device_put(x, parallel.batch_sharding(mesh))
        _, sharded = jax.jit(parallel.data_parallel.value_and_grad(loss))(params, x)
    assert not np.isfinite(one_device).any()
    assert float(sharded["kernel"][0, 0]) == 409600.0


def _path_get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _skip_with_bad_value_at(run: Run, index: tuple[int, ...], owner: dict[str, int]):
    """grads -> inf, -inf or NaN at ``index`` of the MLP kernel grad -> apply, on ``run``'s mesh.

    The bad value is an argument of the compiled step (one compile per mesh).
    """
    mesh = run.exp.mesh
    leaf_sharding = _path_get(run.shardings.params, MLP_KERNEL)
    shape = _path_get(run.initial.params, MLP_KERNEL).shape
    # The injected element lives only on the devices of one model shard / pipeline stage.
    holds = lambda idx: all(s.start is None or s.start <= i < s.stop
                            for s, i in zip(idx, index, strict=True))
    holders = {d for d, idx in leaf_sharding.devices_indices_map(shape).items() if holds(idx)}
    coords = {d: dict(zip(mesh.axis_names, np.argwhere(mesh.devices == d)[0], strict=True))
              for d in mesh.devices.flat}
    assert holders == {d for d, c in coords.items()
                       if all(c[a] == v for a, v in owner.items())}
    assert len(holders) < mesh.devices.size

    value_and_grad = train.mesh_value_and_grad(run.exp, run.shardings)

    def poisoned_step(state, batch, rng, bad):
        def poisoned_value_and_grad(loss_fn):  # the trainer's gradients, one value replaced
            def f(*args):
                out, grads = value_and_grad(loss_fn)(*args)
                kernel = _path_get(grads, MLP_KERNEL)
                grads["encoder"]["layers"]["MlpBlock_0"]["Dense_0"]["kernel"] = kernel.at[
                    index].set(bad.astype(kernel.dtype))
                return out, grads

            return f

        state, metrics = jamp.train_step(state, batch, rng,
                                         value_and_grad=poisoned_value_and_grad)
        return state, metrics["grad_finite"]

    state = run.state0()
    batch = run.batch(next(iter(data.train_loader(run.exp.info, image_size=8,
                                                  global_batch_size=BATCH, seed=1))))
    with run.context():
        step = jax.jit(poisoned_step,
                       in_shardings=(run.shardings, run.batch_sharding, None, None),
                       out_shardings=(run.shardings, None))
        step = step.lower(state, batch, jax.random.key(0), jnp.float32(0)).compile(FAST)
        for bad in (np.inf, -np.inf, np.nan):
            new, finite = step(state, batch, jax.random.key(0), jnp.float32(bad))
            _assert_every_device_skipped(state, new, finite)


def _assert_every_device_skipped(state, new, finite):
    assert not bool(finite)
    assert int(overflow_stats(new.opt_state).steps_skipped) == 1
    # Every device skipped: each shard of every parameter and optimizer leaf is unchanged...
    before = jax.tree_util.tree_leaves(state.params) + jax.tree_util.tree_leaves(
        state.opt_state.inner_state)
    after = jax.tree_util.tree_leaves(new.params) + jax.tree_util.tree_leaves(
        new.opt_state.inner_state)
    for old, now in zip(before, after, strict=True):
        for a, b in zip(old.addressable_shards, now.addressable_shards, strict=True):
            assert a.device == b.device
            np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
    # ...and all 8 devices hold the same backed-off scale.
    scale = new.opt_state.scale
    values = {float(np.asarray(s.data)) for s in scale.addressable_shards}
    assert len(scale.addressable_shards) == 8 and values == {2.0**8 / 2}


def test_bad_value_in_one_model_shard_every_shard_skips(runs):
    # mlp unit 31 of layer 0 lives on model shard 1 (of 2), on every data shard.
    _skip_with_bad_value_at(runs("fp16", "tensor"), (0, 3, 31), {"model": 1})


def test_bad_value_in_one_pipeline_stage_every_shard_skips(runs):
    # layer 1 (of 2) lives on pipeline stage 1.
    _skip_with_bad_value_at(runs("fp16", "pipeline"), (1, 3, 5), {"pipe": 1})


def test_bad_value_in_one_3d_shard_every_shard_skips(runs):
    # layer 1 lives on stage 1, mlp unit 20 (of 32) on model shard 1: 2 of the 8 devices.
    _skip_with_bad_value_at(runs("fp16", "3d"), (1, 3, 20), {"pipe": 1, "model": 1})


def test_tensor_parallel_shards_params_optimizer_state_and_master_copy():
    # fp16_naive: float16 params + float32 master copy + momentum, all split over 'model'.
    exp = experiment.build_experiment(tiny_config("fp16_naive", (4, 2, 1)))
    with jax.set_mesh(exp.mesh):
        _, shardings = experiment.state_shardings(exp, jax.random.key(0))
        state = experiment.init_state(exp, jax.random.key(0), shardings)
    spec = lambda tree: _path_get(tree, MLP_KERNEL).sharding.spec
    assert spec(state.params) == jax.sharding.PartitionSpec("pipe", None, "model")
    master = master_params(state.opt_state)
    for p, m in zip(jax.tree_util.tree_leaves(state.params), jax.tree_util.tree_leaves(master),
                    strict=True):
        assert m.sharding.spec == p.sharding.spec and m.dtype == jnp.float32
    assert _path_get(master, MLP_KERNEL).dtype == jnp.float32
    assert _path_get(state.params, MLP_KERNEL).dtype == jnp.float16
    heads = state.params["encoder"]["layers"]["SelfAttention_0"]["query_kernel"]
    assert heads.sharding.spec == jax.sharding.PartitionSpec("pipe", None, "model", None)
    # Every params-shaped leaf of the optimizer state is sharded like its parameter.
    by_shape = {}
    for p in jax.tree_util.tree_leaves(state.params):
        by_shape.setdefault(p.shape, set()).add(p.sharding.spec)
    checked = 0
    for leaf in jax.tree_util.tree_leaves(state.opt_state):
        if leaf.ndim and leaf.shape in by_shape:
            assert leaf.sharding.spec in by_shape[leaf.shape], leaf.shape
            checked += 1
    assert checked >= 2 * len(jax.tree_util.tree_leaves(state.params))  # master + momentum
    # The kernel's local block is half the MLP on each device.
    local = _path_get(state.params, MLP_KERNEL).addressable_shards[0].data.shape
    assert local == (2, 16, 16)


def _tiny_vit(mode: str, num_layers: int, layer_runner=None):
    from jamp.models import vit

    module = vit.create("ti", num_classes=10, patch_size=2, num_layers=num_layers,
                        hidden_size=16, num_heads=2, mlp_dim=32, layer_runner=layer_runner)
    model = jamp.apply_policy(module, mode)
    params = nn.unbox(jax.jit(model.init)(jax.random.key(0), jnp.ones((1, 8, 8, 1))))["params"]
    return model, params


def test_pipeline_matches_scan_forward_and_gradients():
    # The model alone: GPipe over 2 and 4 stages (4 microbatches) = the plain nn.scan.
    model, params = _tiny_vit("fp32", num_layers=4)
    params["head"]["kernel"] = jax.random.normal(jax.random.key(2), (16, 10)) * 0.1
    x = jax.random.normal(jax.random.key(1), (8, 8, 8, 1))
    value_and_grad = lambda model: jax.value_and_grad(
        lambda p: jnp.sum(model.apply({"params": p}, x) ** 2))
    f = value_and_grad(model)
    want_value, want_grads = jax.jit(f).lower(params).compile(FAST)(params)
    for stages in (2, 4):
        piped, piped_params = _tiny_vit("fp32", 4, pipeline.GPipe(stages, microbatches=4))
        assert jax.tree.structure(piped_params) == jax.tree.structure(params)
        with jax.set_mesh(parallel.make_mesh({"data": 1, "model": 1, "pipe": stages})):
            # Only the model given the runner pipelines: the mesh alone changes nothing.
            assert "collective_permute" not in jax.jit(f).lower(params).as_text()
            lowered = jax.jit(value_and_grad(piped)).lower(params)
            value, grads = lowered.compile(FAST)(params)
        assert "collective_permute" in lowered.as_text()
        np.testing.assert_allclose(value, want_value, rtol=1e-5)
        # Microbatched sums round differently: compare to 1e-6 of the largest gradient
        # (the key bias's gradient is exactly 0 in theory, rounding noise in practice).
        scale = max(np.abs(g).max() for g in _leaves(want_grads))
        for got, want in zip(_leaves(grads), _leaves(want_grads), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * scale)


def test_pipeline_runs_blocks_under_the_policy():
    model, params = _tiny_vit("fp16", num_layers=2, layer_runner=pipeline.GPipe(2, 2))
    with jax.set_mesh(parallel.make_mesh({"data": 1, "model": 1, "pipe": 2})):
        jaxpr = str(jax.make_jaxpr(lambda p: model.apply({"params": p}, jnp.ones((4, 8, 8, 1))))(
            params))
    # Inside the stages ({V:pipe}: varying over 'pipe') every matmul takes float16.
    assert re.search(r"f16\[[\d,]+\]\{V:pipe\} = dot_general", jaxpr)
    assert not re.search(r"f32\[[\d,]+\]\{V:pipe\} = dot_general", jaxpr)
    assert "ppermute" in jaxpr
