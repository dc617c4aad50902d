"""Shared set-up of tests/test_grad_accum.py and tests/test_grad_stats.py: the trainer's own
jitted step of a tiny ViT (hidden 16, MLP 16, 2 layers, 8 heads, 8x8 digits, batch 32) per
(mode, mesh, ZeRO stage, grad_accum_steps, framework), each compiled once (module caches).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from test_every_mesh import _config, _overrides
from test_zero import OPTIONS, _context

from jamp import data, experiment, parallel, train

BATCH = 32
STEPS = 3
INIT_MESH = (4, 2, 1)
"""Every mesh, stage and k starts from the state initialised on this mesh."""


@functools.cache
def setup(mode: str, mesh: tuple[int, ...], stage: int, k: int, framework: str = "linen"):
    """The experiment, abstract state and state shardings."""
    fields = _overrides(mesh, mode, framework, 8)
    fields.update(zero_stage=stage, dropout_rate=0.0, grad_accum_steps=k, batch_size=BATCH,
                  max_steps=STEPS, log_num_zeros_in_grad=True)
    exp = experiment.build_experiment(_config(mode, fields))
    with jax.set_mesh(exp.mesh):
        abstract, shardings = experiment.state_shardings(exp, jax.random.key(0))
    return exp, abstract, shardings


@functools.cache
def host_batches() -> list[dict[str, np.ndarray]]:
    loader = data.train_loader(data.get_dataset_info("digits"), image_size=8,
                               global_batch_size=BATCH, seed=0)
    batches = []
    for batch in loader:
        batch = {k: np.array(v) for k, v in batch.items()}
        # The first pixel of every 2x2 patch is 0: the patch kernel's first row gets exactly
        # zero gradients (tests/test_grad_stats.py counts them).
        batch["image"][:, ::2, ::2, :] = 0.0
        batches.append(batch)
        if len(batches) == STEPS:
            return batches
    raise AssertionError("the digits loader gave fewer than STEPS batches")


@functools.cache
def host_init(mode: str, mesh: tuple[int, ...], framework: str = "linen"):
    """The initial train state's leaves on the host (one init per mode, mesh and framework:
    every stage and k then starts from the same numbers)."""
    exp, _, shardings = setup(mode, mesh, 0, 1, framework)
    with jax.set_mesh(exp.mesh):
        state = experiment.init_state(exp, jax.random.key(0), shardings)
    return jax.device_get(jax.tree_util.tree_leaves(state))


def fresh_state(mode, mesh, stage, k, framework="linen", leaves=None, scale=None):
    exp, abstract, shardings = setup(mode, mesh, stage, k, framework)
    leaves = host_init(mode, INIT_MESH, framework) if leaves is None else leaves
    state = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(abstract), leaves)
    if scale is not None:
        state = state.replace(opt_state=state.opt_state._replace(scale=np.float32(scale)))
    return jax.device_put(state, shardings)


def put_batch(exp, batch):
    return jax.device_put(batch, parallel.batch_sharding(exp.mesh))


def abstract_batch(exp):
    sharding = parallel.batch_sharding(exp.mesh)
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)
            for k, v in host_batches()[0].items()}


@functools.cache
def lowered(mode, mesh, stage, k, framework="linen"):
    exp, abstract, shardings = setup(mode, mesh, stage, k, framework)
    with _context(exp):
        jitted = train.jit_train_step(exp, shardings, abstract)
        return jitted.lower(abstract, abstract_batch(exp), jax.random.key(0))


@functools.cache
def step(mode, mesh, stage, k, framework="linen"):
    """The trainer's jitted step, compiled once."""
    return lowered(mode, mesh, stage, k, framework).compile(OPTIONS)


@functools.cache
def hlo(mode, mesh, stage, k, framework="linen"):
    return step(mode, mesh, stage, k, framework).as_text()


def run(mode, mesh, stage, k, framework="linen", batches=None, leaves=None, scale=None):
    """Steps over ``batches`` (default: the STEPS host batches): the metrics, the host
    params before each step and the final state."""
    exp = setup(mode, mesh, stage, k, framework)[0]
    state = fresh_state(mode, mesh, stage, k, framework, leaves, scale)
    compiled = step(mode, mesh, stage, k, framework)
    metrics, params = [], []
    for i, batch in enumerate(host_batches() if batches is None else batches):
        params.append(jax.device_get(state.params))
        state, m = compiled(state, put_batch(exp, batch), jax.random.fold_in(jax.random.key(1), i))
        metrics.append(jax.device_get(m))
    return metrics, params, state
