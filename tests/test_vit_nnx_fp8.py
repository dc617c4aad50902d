"""Delayed-scaling fp8 (mode "fp8") with the NNX ViT, on linen's machinery (issue 14).

``nnx_functional.functional``'s ``apply_fn`` reads the fp8 state from
``variables[jamp.fp8.COLLECTION]`` as the linen ViT does, so ``jamp.fp8.TrainState``,
``jamp.train_step`` and ``jamp.fp8.commit`` train both. From the same weights the NNX
ViT gives bit for bit linen's losses, parameters and fp8 state (the same per-layer
stacking over the scanned blocks) over 6 steps, one of them skipped for an inf in the
batch; the trainer trains ``framework="nnx", mode="fp8"``, checkpoints and resumes
exactly. Mode "fp8" has no loss scale (``'none'``: nothing is ever skipped), so the
parity and skip tests use it with a dynamic loss scale; the trainer runs it as it is.
"""

from __future__ import annotations

import dataclasses
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jamp
from jamp import nnx_functional
from jamp.models import vit, vit_nnx

SIZES = dict(num_classes=10, patch_size=4, num_layers=2, hidden_size=16, num_heads=2,
             mlp_dim=32)
IMAGE = (8, 8, 1)
HISTORY = 4  # shorter than the 5 applied steps: the amax histories roll over
SKIPPED = 3  # the step whose batch holds an inf
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}

# A dynamic loss scale (mode "fp8" has none) that skips the inf step without backing off
# (hysteresis 2): the scale, and so the units of the gradient amax history, stay put.
MP = jamp.mixed_precision("fp8", loss_scale="dynamic", init_scale=2.0**10, hysteresis=2)
MP = dataclasses.replace(MP, fp8=dataclasses.replace(MP.fp8, amax_history_length=HISTORY))

_rng = np.random.default_rng(0)
BATCHES = [{"image": _rng.normal(size=(8, *IMAGE)).astype(np.float32),
            "label": _rng.integers(0, 10, 8).astype(np.int32)} for _ in range(6)]
BATCHES[SKIPPED]["image"][0, 0, 0, 0] = np.inf


def _bits(tree):
    return jax.tree.structure(tree), [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def _params_by_linen_path(params, nnx_tree):
    """``{linen path: array}`` of linen's params or NNX's (names mapped to linen's)."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        path = tuple(str(k.key) for k in path)
        out[vit_nnx._linen_path(path) if nnx_tree else path] = np.asarray(leaf)
    return out


def _meta_nodes(tree, path=()):
    """``(path, node)`` of every per-matmul dict (the six ``jamp.fp8.META_NAMES``)."""
    if isinstance(tree, dict) and set(jamp.fp8.META_NAMES) <= set(tree):
        yield path, tree
    elif isinstance(tree, dict):
        for key, sub in tree.items():
            yield from _meta_nodes(sub, (*path, str(key)))


def _node_bits(node):
    return tuple((n, node[n].dtype.name, node[n].shape, np.asarray(node[n]).tobytes())
                 for n in jamp.fp8.META_NAMES)


def _same_fp8(linen_state, nnx_state):
    """The fp8 states are equal bit for bit, matmul by matmul. Each linen matmul's state sits
    under its layer (``.../MlpBlock_0/Dense_0/Fp8DirectDotGeneralOp_0``; a module with
    several projections has ``Fp8DirectDotGeneralOp_0..n``); NNX's sits under the same
    layer's NNX path (``.../mlp/fc1/dot_general``). Compared per linen owner module: the
    same number of matmuls with the same six arrays (the order of an owner's several
    projections is not compared, so this holds whatever the NNX attributes are named)."""
    linen, nnx_ = {}, {}
    for path, node in _meta_nodes(jax.device_get(linen_state)):
        owner = tuple(p for p in path if not p.startswith("Fp8DirectDotGeneralOp"))
        linen.setdefault(owner, []).append(_node_bits(node))
    for path, node in _meta_nodes(jax.device_get(nnx_state)):
        mapped = vit_nnx._linen_path(path)
        owners = [o for o in linen if mapped[:len(o)] == o]
        owner = max(owners, key=len) if owners else mapped
        nnx_.setdefault(owner, []).append(_node_bits(node))
    return linen.keys() == nnx_.keys() and all(
        sorted(linen[o]) == sorted(nnx_[o]) for o in linen)


def _same_params(linen_params, nnx_params):
    a, b = _params_by_linen_path(linen_params, False), _params_by_linen_path(nnx_params, True)
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes() for k in a)


@pytest.fixture(scope="module")
def linen_module():
    return vit.create("ti", **SIZES)


@pytest.fixture(scope="module")
def linen_variables(linen_module):
    init = jax.jit(jamp.apply_policy(linen_module, MP).init, compiler_options=FAST)
    return nn.unbox(init(jax.random.key(0), jnp.zeros((1, *IMAGE))))


def _nnx_model(linen_module, linen_variables):
    return jamp.apply_policy(vit_nnx.from_linen(linen_module, linen_variables["params"]), MP)


def _train(apply_fn, params, meta):
    """The 6 steps of ``jamp.train_step`` (one compile): [(metrics, state)] on the host."""
    tx = jamp.make_optimizer(MP, optax.adam(1e-2))
    state = jamp.fp8.TrainState.create(apply_fn=apply_fn, params=params, tx=tx, fp8=meta)
    step = jax.jit(lambda s, b, i: jamp.train_step(s, b, jax.random.key(i)),
                   compiler_options=FAST)
    out = []
    for i, batch in enumerate(BATCHES):
        state, metrics = step(state, batch, i)
        out.append(jax.device_get((metrics, state.replace(apply_fn=None, tx=None))))
    return out


@pytest.fixture(scope="module")
def trajectories(linen_module, linen_variables):
    """(linen, NNX): the same 6 steps from the same weights and initial fp8 state."""
    linen = _train(jamp.apply_policy(linen_module, MP).apply, linen_variables["params"],
                   linen_variables[jamp.fp8.COLLECTION])
    model = _nnx_model(linen_module, linen_variables)
    apply_fn, params = nnx_functional.functional(model)
    return linen, _train(apply_fn, params, nnx_functional.fp8_state(model))


# ----------------------------------------------------------------------------- parity


def test_initial_fp8_state_has_linens_layout_stacked_per_layer(linen_module, linen_variables):
    meta = nnx_functional.fp8_state(_nnx_model(linen_module, linen_variables))
    assert _same_fp8(linen_variables[jamp.fp8.COLLECTION], meta)
    node = meta["encoder"]["layers"]["mlp"]["fc1"]["dot_general"]
    assert sorted(node) == sorted(jamp.fp8.META_NAMES)  # what jamp.fp8.commit walks
    assert node["input_amax_history"].shape == (SIZES["num_layers"], HISTORY)
    assert node["kernel_scale"].shape == (SIZES["num_layers"], 1)
    assert "head" not in meta  # the classifier keeps its bf16 matmul, as in linen


def test_nnx_fp8_losses_params_and_state_match_linen_bit_for_bit(trajectories,
                                                                 linen_variables):
    linen, nnx_ = trajectories
    linen_params = linen_variables["params"]
    losses = lambda run: [np.asarray(m["loss"]).tobytes() for m, _ in run]  # NaN included
    assert losses(nnx_) == losses(linen)
    assert np.isnan(nnx_[SKIPPED][0]["loss"]) and np.isfinite(nnx_[SKIPPED + 1][0]["loss"])
    for (_, a), (_, b) in zip(linen, nnx_, strict=True):
        assert _same_fp8(a.fp8, b.fp8) and _same_fp8(a.fp8_pending, b.fp8_pending)
    assert _same_params(linen[-1][1].params, nnx_[-1][1].params)
    # The state moved: 5 applied steps filled the 4-entry histories of both layers.
    history = nnx_[-1][1].fp8["encoder"]["layers"]["mlp"]["fc2"]["dot_general"][
        "output_grad_amax_history"]
    assert history.shape == (SIZES["num_layers"], HISTORY) and np.all(history > 0)
    assert not np.array_equal(history[0], history[1])  # one state per layer
    # The first step read the passed (initial) state and wrote this step's amax in front: the
    # kernel's, in the compute dtype, per layer.
    (_, first), kernel = nnx_[0], linen_params["encoder"]["layers"]["MlpBlock_0"]["Dense_0"][
        "kernel"]
    amax = np.abs(np.asarray(kernel.astype(jnp.bfloat16))).max(axis=(1, 2)).astype(np.float32)
    node = first.fp8["encoder"]["layers"]["mlp"]["fc1"]["dot_general"]
    np.testing.assert_array_equal(node["kernel_amax_history"][:, 0], amax)


def test_skipped_step_leaves_the_nnx_fp8_state_bit_identical(trajectories):
    _, nnx_ = trajectories
    (before_metrics, before), (metrics, after) = nnx_[SKIPPED - 1], nnx_[SKIPPED]
    assert bool(before_metrics["grad_finite"]) and not bool(metrics["grad_finite"])
    assert int(metrics["steps_skipped"]) == 1
    assert _bits(after.fp8) == _bits(before.fp8)
    assert _bits(after.fp8_pending) == _bits(before.fp8_pending)
    assert _bits(after.params) == _bits(before.params)
    assert _bits(nnx_[SKIPPED + 1][1].fp8) != _bits(after.fp8)  # the next step commits again


# ----------------------------------------------------------------------------- apply_fn


def test_apply_fn_says_when_the_fp8_state_is_missing_or_not_the_models(linen_module,
                                                                      linen_variables):
    model = _nnx_model(linen_module, linen_variables)
    apply_fn, params = nnx_functional.functional(model)
    meta = nnx_functional.fp8_state(model)
    images = jnp.asarray(BATCHES[0]["image"])
    with pytest.raises(ValueError, match=r"fp8 matmuls .* variables\['_overwrite_with_grad"):
        jax.eval_shape(apply_fn, {"params": params}, images)
    bad = jax.tree.map(lambda x: x, meta)
    del bad["encoder"]["layers"]["mlp"]["fc2"]
    with pytest.raises(ValueError, match=r"missing \['encoder/layers/mlp/fc2/dot_general/"):
        jax.eval_shape(apply_fn, {"params": params, jamp.fp8.COLLECTION: bad}, images)
    short = jax.tree.map(lambda x: x[..., :1], meta)
    with pytest.raises(ValueError, match=r"mis-shaped .*input_amax_history: \(2, 1\) \(needs "):
        jax.eval_shape(apply_fn, {"params": params, jamp.fp8.COLLECTION: short}, images)
    with pytest.raises(TypeError, match="must be the nested dict of jamp.nnx_functional.fp8_state"):
        jax.eval_shape(apply_fn, {"params": params, jamp.fp8.COLLECTION: jnp.ones(2)}, images)
    bf16 = jamp.apply_policy(vit_nnx.from_linen(linen_module, linen_variables["params"]), "bf16")
    bf16_fn, bf16_params = nnx_functional.functional(bf16)
    assert nnx_functional.fp8_state(bf16) == {}
    with pytest.raises(ValueError, match="unexpected"):
        jax.eval_shape(bf16_fn, {"params": bf16_params, jamp.fp8.COLLECTION: meta}, images)


# ----------------------------------------------------------------------------- the trainer


def _tiny_config(**fields):
    from jamp.config import vit_config

    config = vit_config("fp8")
    config.framework = "nnx"
    config.num_layers, config.hidden_size, config.num_heads, config.mlp_dim = 2, 16, 2, 32
    config.batch_size, config.progress, config.plot, config.log_every_steps = 8, False, False, 2
    for key, value in fields.items():
        config[key] = value
    return config


def test_trainer_builds_the_nnx_fp8_state_per_layer():
    from jamp import experiment

    exp = experiment.build_experiment(_tiny_config())
    abstract, shardings = experiment.state_shardings(exp, jax.random.key(0))
    assert isinstance(abstract, jamp.fp8.TrainState)
    assert abstract.apply_fn is exp.apply_fn  # one static apply_fn for every state of the run
    node = abstract.fp8["encoder"]["layers"]["mlp"]["fc1"]["dot_general"]
    assert node["input_amax_history"].shape == (2, 1024)
    assert node["input_amax_history"].dtype == jnp.float32
    # Split over the pipeline stages like the layers (tests/test_fp8_pipeline.py runs it).
    assert shardings.fp8["encoder"]["layers"]["mlp"]["fc1"]["dot_general"][
        "input_amax_history"].spec == jax.sharding.PartitionSpec("pipe", None)


def test_trainer_nnx_fp8_trains_checkpoints_and_resumes_exactly(tmp_path, monkeypatch):
    """Two in-process runs of the trainer: 4 steps (checkpoints at 2 and 4), then the same
    run with checkpoint 4 deleted, which resumes from step 2 (as after a kill). The states
    saved and restored are recorded on their way to and from orbax."""
    from jamp import train
    from jamp.checkpoint import Checkpointer

    saved, restored = {}, []
    save, restore = Checkpointer.save, Checkpointer.restore

    def record_save(self, step, state, *args, **kwargs):
        saved.setdefault(step, []).append(jax.device_get(state.replace(apply_fn=None, tx=None)))
        return save(self, step, state, *args, **kwargs)

    def record_restore(self, *args, **kwargs):
        step, state = restore(self, *args, **kwargs)
        restored.append((step, jax.device_get(state.replace(apply_fn=None, tx=None))))
        return step, state

    monkeypatch.setattr(Checkpointer, "save", record_save)
    monkeypatch.setattr(Checkpointer, "restore", record_restore)
    config = _tiny_config(max_steps=4, checkpoint_every_steps=2, keep_checkpoints=3)
    config.mesh.data = 2  # the amax of the two 'data' shards is max-reduced
    summary = train.train_and_evaluate(config, str(tmp_path / "first"))
    assert summary["framework"] == "nnx" and summary["mode"] == "fp8"
    assert summary["steps"] == 4 and 0.0 <= summary["test_accuracy"] <= 1.0
    at_2 = saved[2][0]
    # The memory report counts fp8 and fp8_pending: per matmul 3 scales + 3 histories of 1024.
    matmuls = len(list(_meta_nodes(at_2.fp8)))
    assert summary["memory"]["model_state_bytes"] == 2 * jamp.tree_bytes(at_2.fp8) == (
        2 * matmuls * SIZES["num_layers"] * 3 * 1025 * 4)
    history = at_2.fp8["encoder"]["layers"]["mlp"]["fc1"]["dot_general"]["input_amax_history"]
    # Two steps' amax per layer: flax rolls the history back one and writes the new in front.
    assert np.all(history[:, [0, -1]] > 0) and np.all(history[:, 1:-1] == 0)

    shutil.copytree(tmp_path / "first", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "4")
    resumed = train.train_and_evaluate(config, str(tmp_path / "resumed"))
    assert resumed["start_step"] == 2 and resumed["steps"] == 4
    ((step, state),) = restored
    assert step == 2 and _bits(state) == _bits(at_2)  # fp8, fp8_pending, params, opt, step
    assert _bits(saved[4][1]) == _bits(saved[4][0])  # the resumed run continues exactly
    assert resumed["test_loss"] == summary["test_loss"]
