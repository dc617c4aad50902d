"""Gradient statistics (:mod:`jamp.grad_stats`) and the step's ``num_zeros_in_grad``.

- the trainer's ``num_zeros_in_grad`` (the accumulated gradients of k micro-batches) equals
  numpy's count of the exactly-zero elements of plain ``jax.grad`` of the same loss on one
  device, on four meshes x four ZeRO stages: a replicated leaf is counted once (not once per
  device), a split leaf once (some zeros are structural: the zero-initialised head zeroes
  every other gradient on the first step, and the first pixel of each patch is 0 in every
  image);
- ``num_zeros``/``global_norm`` on random trees (hypothesis): NaN/inf are not zero, -0.0 is,
  float16/bfloat16/float32, empty leaves, values that underflow after unscaling are zero;
- ``train/num_zeros_in_grad`` is written to metrics.jsonl with ``log_num_zeros_in_grad``.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from accum_common import host_batches, run, setup
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from test_every_mesh import _config, _overrides

from jamp import experiment, grad_stats, train
from jamp.step import cross_entropy

if len(jax.devices()) < 8:  # conftest forces 8 CPU devices
    pytest.skip("needs 8 devices", allow_module_level=True)

MESHES = [(8, 1, 1), (4, 2, 1), (2, 2, 2), (1, 8, 1)]
K = {(2, 2, 2): 2}  # 32 examples / (2 data shards x 2 accumulated x 2 pipeline microbatches)


def _valid(mesh, stage) -> bool:
    """Whether the config validation accepts ``stage`` on ``mesh`` (else skipped, explicitly)."""
    try:
        setup("fp32", mesh, stage, K.get(mesh, 4))
    except experiment.ConfigError:
        return False
    return True


@functools.cache
def _reference_grad():
    exp = setup("fp32", (8, 1, 1), 0, 1)[0]
    smoothing = exp.config.label_smoothing

    def loss(params, batch):
        logits = exp.model.apply({"params": params}, batch["image"], train=True,
                                 rngs={"dropout": jax.random.key(0)})
        return cross_entropy(logits, batch["label"], smoothing)

    return jax.jit(jax.grad(loss))


def _numpy_zeros(tree) -> int:
    return sum(int(np.count_nonzero(np.asarray(x) == 0)) for x in jax.tree_util.tree_leaves(tree))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("mesh", MESHES)
def test_num_zeros_in_grad_counts_each_element_once_on_every_mesh_and_stage(mesh, stage):
    if not _valid(mesh, stage):
        pytest.skip(f"zero_stage={stage} is refused on mesh {mesh}")
    metrics, params, _ = run("fp32", mesh, stage, K.get(mesh, 4))
    total = sum(int(np.size(x)) for x in jax.tree_util.tree_leaves(params[0]))
    counts = []
    for m, p, batch in zip(metrics, params, host_batches(), strict=True):
        grads = _reference_grad()(p, batch)
        want = _numpy_zeros(grads)
        # The key bias cannot change the attention (softmax is shift-invariant): its gradient
        # is float32 roundoff, which may be exactly 0 on one device or after another order of
        # summation. Every other leaf's zeros are counted exactly.
        bias = grads["encoder"]["layers"]["SelfAttention_0"]["key_bias"]
        other = want - _numpy_zeros(bias)
        got = int(m["num_zeros_in_grad"])
        assert other <= got <= other + np.size(bias), (mesh, stage, len(counts), got, want)
        counts.append(want)
    head = params[0]["head"]
    # First step: only the head (zero-initialised) gets non-zero gradients.
    assert counts[0] == total - np.size(head["kernel"]) - np.size(head["bias"]), counts
    assert int(metrics[0]["num_zeros_in_grad"]) == counts[0]  # exactly, key bias included
    assert 0 < counts[1] < total // 4, counts  # later: the patch kernel's first row (zeros)


# ----------------------------------------------------------------------------- units

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32]


def _reference(leaves, scale):
    """The exactly-zero (or float32-subnormal, before or after: XLA:CPU flushes them)
    elements of leaf * (1 / scale) in float32; the norm of the unscaled leaves."""
    inv = np.float32(1) / np.float32(scale)
    zeros, squares = 0, 0.0
    for x in leaves:
        wide = np.asarray(x).astype(np.float32)
        wide = np.where(np.abs(wide) < np.finfo(np.float32).tiny, 0, wide)  # flushed as well
        u = wide * inv
        zeros += int(np.count_nonzero(np.abs(u) < np.finfo(np.float32).tiny))
        squares += float(np.sum(u.astype(np.float64) ** 2))
    return zeros, np.sqrt(squares)


values = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32),
                   st.sampled_from([0.0, -0.0, 1e-30, -1e-38, 6e-8, 65504.0]))


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(leaves=st.lists(st.tuples(st.sampled_from(DTYPES),
                                 hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=5),
                                 st.data()), min_size=0, max_size=4),
       scale=st.sampled_from([1.0, 2.0**-3, 2.0**15, 2.0**100]))
def test_num_zeros_and_global_norm_match_numpy(leaves, scale):
    arrays = []
    for dtype, shape, data in leaves:
        x = data.draw(hnp.arrays(np.float32, shape, elements=values))
        arrays.append(x.astype(dtype))
    tree = {str(i): jnp.asarray(x) for i, x in enumerate(arrays)}
    zeros, norm = _reference(arrays, scale)
    assert int(grad_stats.num_zeros(tree, jnp.float32(scale))) == zeros
    got = float(grad_stats.global_norm(tree, jnp.float32(scale)))
    if np.isfinite(norm) and norm < 1e-18:  # the float32 squares underflow: 0 or tiny
        assert 0.0 <= got <= 1e-18
    elif np.isfinite(norm) and norm > 1e18:  # the float32 squares overflow: inf (documented
        assert got == np.inf or np.isclose(got, norm, rtol=1e-5)  # "inf if any element is")
    elif np.isfinite(norm):
        np.testing.assert_allclose(got, norm, rtol=1e-5, atol=1e-30)
    else:
        assert not np.isfinite(got)


def test_num_zeros_edge_cases():
    tree = {"nan": jnp.array([jnp.nan, jnp.inf, -jnp.inf], jnp.float16),
            "neg0": jnp.array([-0.0, 0.0], jnp.bfloat16), "empty": jnp.zeros((0, 3)),
            "int": jnp.zeros(4, jnp.int32), "tiny": jnp.array([1e-30, 1.0], jnp.float32)}
    assert int(grad_stats.num_zeros(tree)) == 2
    assert int(grad_stats.num_zeros(tree, 2.0**100)) == 3  # 1e-30 / 2**100 underflows
    assert int(grad_stats.num_zeros({})) == 0
    assert grad_stats.num_zeros(tree).dtype == jnp.int32
    assert float(grad_stats.global_norm({"a": jnp.array([3.0, 4.0], jnp.float16)}, 0.5)) == 10.0
    assert float(grad_stats.global_norm({"e": jnp.zeros((0,))})) == 0.0
    assert np.isnan(float(grad_stats.global_norm(tree)))


# ----------------------------------------------------------------------------- metrics.jsonl


def test_num_zeros_in_grad_is_written_to_metrics_jsonl_when_asked(tmp_path):
    fields = _overrides((8, 1, 1), "fp32", "linen", 2)
    fields.update(max_steps=2, log_every_steps=1, log_num_zeros_in_grad=True,
                  num_layers=1, grad_accum_steps=2)
    train.train_and_evaluate(_config("fp32", fields), str(tmp_path))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(isinstance(r["train/num_zeros_in_grad"], int) for r in steps), steps
    assert steps[0]["train/num_zeros_in_grad"] > 0  # zero head: the first step's grads
