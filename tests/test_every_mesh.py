"""Every mesh trains or is refused (issue 22, item 1): a property over all meshes of 1-8 devices.

A ``(data, model, pipe)`` mesh whose product fits the session's 8 fake CPU devices
(1, 2, 4 or 8 of them) either trains the ViT for two steps, in any precision mode,
either Flax API and any ZeRO stage, or is refused by the one validation pass (a
``ConfigError`` that names the fix; the command then exits 2 and writes nothing).
Never a crash.

``hypothesis`` draws the mesh, the mode, the framework, the ZeRO stage and the number
of heads (which 'model' must divide, or the run is refused). The explicit examples
cover all 20 mesh shapes, each compiled once, with the 8 modes rotated over them so
that every mode trains under both linen and NNX: tensor-only (``1 x m x 1``),
pipe-only, ``model x pipe`` with ``data=1`` included. The same compiles cover ZeRO
(issue 24): every 8-device mesh trains at stage 3 (parameters split over 'data' and
gathered per layer, composed with 'model' and 'pipe'), the 4- and 2-device meshes
alternate stages 1 and 2, the 1-device mesh stays at stage 0. Before the fix in
:mod:`jamp.parallel.data_parallel`, every ``data=1, pipe=1, model>1`` mesh died in
XLA's partitioner ("Cross-partition allreduce must be in (partial) manual
partitioning mode") and every ``bf16_pure`` run with ``data>1`` aborted XLA:CPU.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import tempfile

import flax.linen as nn
import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from jamp import cli, data, experiment, parallel, train
from jamp.config import vit_config

if len(jax.devices()) < 8:  # conftest forces 8 CPU devices
    pytest.skip("needs 8 devices", allow_module_level=True)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("fp32", "fp16", "bf16", "fp16_naive", "fp16_pure", "bf16_pure", "fp8", "fp8_current")
FRAMEWORKS = ("linen", "nnx")
MESHES = [m for n in (1, 2, 4, 8) for m in itertools.product((1, 2, 4, 8), repeat=3)
          if np.prod(m) == n]
"""All 20 (data, model, pipe) shapes of 1, 2, 4 and 8 devices."""
BATCH, STEPS = 16, 2


ZERO_STAGES = (0, 1, 2, 3)


def _zero_stage(mesh, i):
    """Stage 3 on every 8-device mesh, 1 and 2 in turn on 4 and 2 devices, 0 on one device."""
    devices = int(np.prod(mesh))
    return 3 if devices == 8 else 0 if devices == 1 else 1 + i % 2


CASES = [(mesh, MODES[i % len(MODES)], FRAMEWORKS[(i + k) % 2], _zero_stage(mesh, i))
         for k, group in enumerate(([m for m in MESHES if m[0] == 1],
                                    [m for m in MESHES if m[0] > 1]))
         for i, mesh in enumerate(group)]
"""Each mesh once; the modes rotated over the 10 meshes with ``data=1`` and over the 10 with
``data>1``, the framework alternating (the other way round on the second group): every mode
trains with and without a 'data' axis, under linen and NNX. The ZeRO stage by the mesh's
size (:func:`_zero_stage`)."""


def _overrides(mesh, mode, framework, heads, zero_stage=0):
    """The tiny ViT on ``mesh``: 8 heads split over any 'model', one block per pipeline stage."""
    data_, model, pipe = mesh
    fields = {"mesh.data": data_, "mesh.model": model, "mesh.pipe": pipe,
              "zero_stage": zero_stage,
              "framework": framework, "num_heads": heads, "hidden_size": 16, "mlp_dim": 16,
              "num_layers": max(2, pipe), "batch_size": BATCH, "pipeline_microbatches": 2,
              "max_steps": STEPS, "warmup_steps": 0, "learning_rate": 1e-2,
              "progress": False, "plot": False}
    if mode in ("fp16", "fp16_naive"):  # no overflow-skipped first step
        fields["loss_scale.init_scale"] = 2.0**8
    return fields


def _config(mode, fields):
    config = vit_config(mode)
    for key, value in fields.items():
        *parents, leaf = key.split(".")
        node = config
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    return config


@pytest.fixture(scope="module")
def batch():
    loader = data.train_loader(data.get_dataset_info("digits"), image_size=8,
                               global_batch_size=BATCH, seed=0)
    return next(iter(loader))


def _train(exp, local):
    """``STEPS`` steps of the trainer's own jitted step; the metrics and the params before/after."""
    rng = jax.random.key(0)
    with jax.set_mesh(exp.mesh):
        abstract, shardings = experiment.state_shardings(exp, rng)
        state = experiment.init_state(exp, rng, shardings)
    before = jax.device_get(state.params)
    with jax.set_mesh(exp.mesh), nn.logical_axis_rules(parallel.LOGICAL_AXIS_RULES):
        step = train.jit_train_step(exp, shardings, abstract)
        batch = {k: jax.device_put(v, parallel.batch_sharding(exp.mesh)) for k, v in local.items()}
        metrics = []
        for i in range(STEPS):
            state, m = step(state, batch, jax.random.fold_in(rng, i))
            metrics.append(jax.device_get(m))
    return metrics, before, jax.device_get(state.params)


def _refused_by_the_command(mode, fields):
    """``jamp.train`` with the same fields: exit status, stderr, what it wrote."""
    workdir = os.path.join(tempfile.mkdtemp(), "run")
    args = ["jamp.train", f"--config={os.path.join(REPO, 'configs', f'vit_{mode}.py')}",
            f"--workdir={workdir}", *(f"--config.{k}={v}" for k, v in fields.items())]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        cli.main(args)
    return exit_.value.code, err.getvalue(), os.path.exists(workdir)


@st.composite
def meshes(draw):
    devices = draw(st.sampled_from((1, 2, 4, 8)))
    data_ = draw(st.sampled_from([d for d in (1, 2, 4, 8) if devices % d == 0]))
    model = draw(st.sampled_from([m for m in (1, 2, 4, 8) if devices // data_ % m == 0]))
    return data_, model, devices // data_ // model


def _explicit(test):
    for mesh, mode, framework, stage in CASES:
        test = example(mesh=mesh, mode=mode, framework=framework, zero_stage=stage,
                       heads=8)(test)
    return test


@settings(max_examples=1, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(mesh=meshes(), mode=st.sampled_from(MODES), framework=st.sampled_from(FRAMEWORKS),
       zero_stage=st.sampled_from(ZERO_STAGES), heads=st.sampled_from((2, 4, 8)))
@_explicit
def test_every_mesh_trains_in_every_mode_or_is_refused(batch, mesh, mode, framework, zero_stage,
                                                       heads):
    fields = _overrides(mesh, mode, framework, heads, zero_stage)
    if heads % mesh[1]:  # the heads cannot be split over 'model': refused, nothing written
        with pytest.raises(experiment.ConfigError, match=f"num_heads={heads} cannot be split"):
            experiment.build_experiment(_config(mode, fields))
        status, err, wrote = _refused_by_the_command(mode, fields)
        assert status == 2 and f"num_heads={heads} cannot be split" in err and not wrote, err
        return
    exp = experiment.build_experiment(_config(mode, fields))
    assert tuple(exp.mesh.shape.values()) == mesh and exp.config.zero_stage == zero_stage
    metrics, before, after = _train(exp, batch)
    case = (mesh, mode, framework, zero_stage)
    for m in metrics:
        assert np.isfinite(m["loss"]) and bool(m["grad_finite"]), (*case, m)
    moved = [not np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(before),
                                                      jax.tree_util.tree_leaves(after),
                                                      strict=True)]
    assert any(moved), case


def test_the_examples_cover_every_mesh_and_every_mode_under_both_frameworks():
    assert len(MESHES) == 20 and {m for m, *_ in CASES} == set(MESHES)
    assert {(mode, fw) for _, mode, fw, _ in CASES} == set(itertools.product(MODES, FRAMEWORKS))
    assert {(mode, m[0] > 1) for m, mode, *_ in CASES} == set(itertools.product(MODES, (0, 1)))
    assert {m for m in MESHES if m[0] == 1 and m[1] > 1} >= {(1, 2, 1), (1, 4, 1), (1, 8, 1),
                                                              (1, 2, 2), (1, 4, 2), (1, 2, 4)}
    # ZeRO: every 8-device mesh at stage 3; stages 1 and 2 both with a 'data' axis > 1.
    assert all(stage == 3 for m, *_, stage in CASES if np.prod(m) == 8)
    assert all(stage == 0 for m, *_, stage in CASES if np.prod(m) == 1)
    assert {stage for m, *_, stage in CASES if m[0] > 1 and np.prod(m) in (2, 4)} == {1, 2}


@pytest.mark.parametrize("shape, dtype", [((1, 2, 1), "float32"), ((1, 8, 1), "float16"),
                                          ((2, 2, 1), "bfloat16"), ((1, 1, 1), "float32")])
def test_data_parallel_gradients_on_a_data_axis_of_one_and_in_bfloat16(shape, dtype):
    """The two crashes at their source: a 'data' axis of size 1 beside a 'model' axis (no
    manual region, so no all-reduce over 'data'), and a bfloat16 gradient all-reduce."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def loss(w, batch):
        h = jax.lax.with_sharding_constraint(batch["x"] @ w, P(None, "model"))
        return jnp.mean(jnp.square(h.astype(jnp.float32))), {"h": jnp.mean(h)}

    mesh = parallel.make_mesh(dict(zip(parallel.AXES, shape, strict=True)))
    with jax.set_mesh(mesh):
        w = jax.device_put(jnp.ones((4, 8), dtype), NamedSharding(mesh, P(None, "model")))
        batch = {"x": jax.device_put(jnp.ones((8, 4), dtype), parallel.batch_sharding(mesh))}
        (value, aux), grads = jax.jit(parallel.data_parallel.value_and_grad(loss))(w, batch)
        index = jax.jit(lambda: parallel.data_parallel.shard_index())() if shape[0] == 1 else 0
    assert float(value) == 16.0 and float(aux["h"]) == 4.0 and int(index) == 0
    assert grads.dtype == jnp.dtype(dtype) and grads.sharding.spec == P(None, "model")
    np.testing.assert_array_equal(np.asarray(grads, np.float32), np.full((4, 8), 1.0))
