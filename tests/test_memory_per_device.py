"""Per-device memory (issue 24): ``jamp.bytes_per_device`` and ``MemoryReport.per_device``.

fp16 parameters with ``optax.adamw`` under ``jamp.master_weights`` are placed on a
``(data=4, model=2, pipe=1)`` mesh of the session's 8 fake CPU devices (the root
``conftest.py`` forces them): some leaves split over 'data', one over 'model' only,
one (an odd shape) replicated. The figures are checked against hand arithmetic,
byte for byte, and against what XLA says one device receives as arguments
(``compiled.memory_analysis().argument_size_in_bytes``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jamp
from jamp.parallel import make_mesh
from jamp.run_summary import format_summary

if len(jax.devices()) < 8:  # conftest forces 8 CPU devices
    pytest.skip("needs 8 devices", allow_module_level=True)

# name: (shape, params' spec, ZeRO-style spec of the optimizer moments and gradients)
LEAVES = {
    "a": ((64, 32), P("data", None), P("data", None)),      # split over 'data'
    "b": ((16, 64), P(None, "model"), P("data", "model")),  # params over 'model' only
    "c": ((8, 32), P("data", "model"), P("data", "model")),  # over both
    "odd": ((7, 3), P(), P()),                               # 7 is not divisible: replicated
}

# Hand arithmetic, bytes on one device (data=4, model=2). fp16 params:
#   a (16, 32) -> 1024, b (16, 32) -> 1024, c (2, 16) -> 64, odd (7, 3) -> 42.
PARAMS = 1024 + 1024 + 64 + 42
# float32 master copy, sharded like the params: twice the bytes.
MASTER = 2 * PARAMS
# mu and nu (float32, ZeRO-style): a (16, 32) -> 2048, b (4, 32) -> 512, c (2, 16) -> 128,
# odd (7, 3) -> 84; plus adam's int32 count (4).
MOMENT = 2048 + 512 + 128 + 84
OPT_STATE = 2 * MOMENT + 4
# Not split over 'data' (held whole by each of the 4 data devices): params b and odd,
# the gradients alike (sharded as the params), odd's mu and nu, the count, master b and odd.
REPLICATED = (1024 + 42) * 2 + (84 * 2 + 4) + (2048 + 84)
# ZeRO-2 gradients, sharded like the moments (fp16): a 1024, b (4, 32) -> 256, c 64, odd 42.
GRADS_ZERO2 = 1024 + 256 + 64 + 42


def _arguments(*trees) -> int:
    """Bytes XLA gives one device as the arguments of a jitted function reading ``trees``."""
    def touch(*ts):  # reads every leaf, so no argument is pruned
        return sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree_util.tree_leaves(ts))

    shardings = tuple(jax.tree_util.tree_map(lambda x: x.sharding, t) for t in trees)
    compiled = jax.jit(touch, in_shardings=shardings).lower(*trees).compile()
    return compiled.memory_analysis().argument_size_in_bytes


def _spec_of(path, for_moments: bool) -> P:
    name = next(k.key for k in reversed(path) if isinstance(k, jax.tree_util.DictKey))
    return LEAVES[name][2 if for_moments else 1]


@pytest.fixture(scope="module")
def placed():
    """``(mesh, params, opt_state)`` placed with NamedShardings on data=4 x model=2."""
    mesh = make_mesh({"data": 4, "model": 2, "pipe": 1})
    params = {k: jax.device_put(jnp.ones(shape, jnp.float16), NamedSharding(mesh, spec))
              for k, (shape, spec, _) in LEAVES.items()}
    state = jamp.master_weights(optax.adamw(1e-3)).init(params)

    def place(path, x):
        if not any(isinstance(k, jax.tree_util.DictKey) for k in path):
            return jax.device_put(x, NamedSharding(mesh, P()))  # the count
        in_master = isinstance(path[0], jax.tree_util.GetAttrKey) and path[0].name == "master"
        return jax.device_put(x, NamedSharding(mesh, _spec_of(path, not in_master)))

    return mesh, params, jax.tree_util.tree_map_with_path(place, state)


def _loss(p, x):
    return sum(jnp.sum(v.astype(jnp.float32)) for v in p.values()) * x


def _abstract(tree):
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def test_per_device_figures_equal_hand_arithmetic(placed):
    _, params, state = placed
    report = jamp.memory_report(_loss, params, 1.0, opt_state=state)
    d = report.per_device
    assert (d.params, d.grads, d.opt_state, d.master) == (PARAMS, PARAMS, OPT_STATE, MASTER)
    assert d.replicated == REPLICATED
    assert d.total == PARAMS * 2 + OPT_STATE + MASTER
    assert jamp.bytes_per_device(params) == PARAMS
    # The whole-array figures are unchanged: the master copy is part of opt_state_bytes.
    assert report.params_bytes == jamp.tree_bytes(params) == 2 * (64 * 32 + 16 * 64 + 8 * 32 + 21)
    assert report.opt_state_bytes == jamp.tree_bytes(state)


def test_abstract_states_count_as_the_arrays(placed):
    _, params, state = placed
    arrays = jamp.memory_report(_loss, params, 1.0, opt_state=state).per_device
    abstract = jamp.memory_report(_loss, _abstract(params), 1.0,
                                  opt_state=_abstract(state)).per_device
    assert abstract == arrays


def test_zero2_gradients_follow_grad_shardings(placed):
    mesh, params, state = placed
    grad_shardings = {k: NamedSharding(mesh, spec) for k, (_, _, spec) in LEAVES.items()}
    d = jamp.memory_report(_loss, params, 1.0, opt_state=state,
                           grad_shardings=grad_shardings).per_device
    assert d.grads == GRADS_ZERO2
    assert d.params == PARAMS and d.opt_state == OPT_STATE and d.master == MASTER
    assert d.replicated == REPLICATED - (1024 + 42) + 42  # only odd's gradient stays whole
    grads = {k: jax.device_put(jnp.ones(x.shape, x.dtype), grad_shardings[k])
             for k, x in params.items()}
    assert _arguments(grads) == pytest.approx(d.grads, rel=0.05)  # measured: 1,386 B exactly


def test_without_shardings_or_data_parallelism(placed):
    _, params, state = placed
    plain = {k: jax.ShapeDtypeStruct(x.shape, x.dtype) for k, x in params.items()}
    report = jamp.memory_report(_loss, plain, 1.0)
    assert report.per_device is None
    assert report.as_dict()["per_device"] is None
    assert "per device" not in str(report)
    assert jamp.bytes_per_device(plain) == jamp.tree_bytes(plain)
    # data=1: nothing is replicated over 'data' (here everything is split over 'model').
    mesh = make_mesh({"data": 1, "model": 8, "pipe": 1})
    w = jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=NamedSharding(mesh, P(None, "model")))
    d = jamp.memory_report(lambda p, x: jnp.sum(p) * x, w, 1.0).per_device
    assert (d.params, d.grads, d.opt_state, d.master, d.replicated) == (64, 64, 0, 0, 0)


def test_report_dict_and_printed_summary(placed):
    _, params, state = placed
    report = jamp.memory_report(_loss, params, 1.0, opt_state=state)
    assert report.as_dict()["per_device"] == {
        "params": PARAMS, "grads": PARAMS, "opt_state": OPT_STATE, "master": MASTER,
        "replicated": REPLICATED, "model_state": 0, "total": 2 * PARAMS + OPT_STATE + MASTER}
    summary = {"outcome": "completed", "model": "ViT-ti/2", "framework": "linen",
               "dataset": "digits", "mode": "fp16_naive", "test_accuracy": 0.98,
               "test_loss": 0.07, "steps": 10, "steps_skipped": 0, "final_loss_scale": 1.0,
               "loss_scale_kind": "none", "images_per_sec": None, "devices": 8,
               "mesh": {"data": 4, "model": 2, "pipe": 1}}
    lines = format_summary(summary, report).splitlines()
    block = lines[lines.index("  per device (replicated: not split over 'data'):"):]
    assert [line.split()[0] for line in block[1:]] == [
        "params", "grads", "optimizer", "master", "of", "total"]
    assert block[-1].split() == ["total", f"{(2 * PARAMS + OPT_STATE + MASTER) / 2**20:,.1f}",
                                 "MiB"]
    # Its figures line up with the whole-array rows above it.
    width = len(next(line for line in lines if line.startswith("  params")))
    assert {len(line) for line in block[1:]} == {width}


def test_per_device_bytes_match_xla_arguments(placed):
    """What XLA:CPU gives one device as arguments equals the per-device figures (within 5%).

    XLA:CPU computes in float32 where a program upcasts, but its *arguments* keep
    their dtype and shard shape, unpadded: a float16 parameter shard counts 2 bytes
    per element. Measured (jax 0.10.2): params 2,154 B, master copy 4,308 B, params +
    optimizer state + master 12,010 B: exactly PARAMS, MASTER and PARAMS + OPT_STATE +
    MASTER. Counting full shapes instead of shard shapes, float16 as 4 bytes, or the
    master copy twice misses by far more than 5%.
    """
    _, params, state = placed
    d = jamp.memory_report(_loss, params, 1.0, opt_state=state).per_device

    assert _arguments(params, state) == pytest.approx(
        d.params + d.opt_state + d.master, rel=0.05)
    assert _arguments(params) == pytest.approx(d.params, rel=0.05)
    assert _arguments(jamp.master_params(state)) == pytest.approx(d.master, rel=0.05)


def test_model_state_is_counted_per_device_and_as_replicated(placed):
    """The fp8 state is never split over 'data': each device holds all of it."""
    mesh, params, state = placed
    meta = jax.device_put(jamp.fp8.init_meta(16), NamedSharding(mesh, P()))
    report = jamp.memory_report(_loss, params, 1.0, opt_state=state, model_state=meta)
    d = report.per_device
    assert d.model_state == jamp.tree_bytes(meta) == 204
    assert d.replicated == REPLICATED + 204
    assert d.total == 2 * PARAMS + OPT_STATE + MASTER + 204
