"""Gradient accumulation (:mod:`jamp.grad_accum`, ``accumulate=`` of the mesh gradient
function, the trainer's ``grad_accum_steps``) on 8 fake CPU devices.

- k micro-batches give the k-times-larger batch's step in float32 (single device; the
  trainer at every ZeRO stage on ``data=4, model=2``, on ``data=8``, ``data=1, model=8``,
  a pipeline mesh; linen and NNX);
- the compiled HLO reduces the gradients over 'data' once per window (as many gradient
  all-reduces / reduce-scatters as k=1, none inside the accumulation loop), in float32;
- the micro-batch gradients are summed in float32 (a float16 sum would round or overflow);
  the scan's carry is float32 for float16 parameters;
- an inf, -inf or NaN in one micro-batch skips the whole window: params, master copy and
  optimizer state bit-identical, the loss scale moved once, one step skipped;
- fp8 delayed scaling: the amax over the window is the max over its micro-batches; a
  skipped window leaves the fp8 state bit-identical;
- the memory report counts one micro-batch's activations;
- bad values of ``grad_accum_steps`` / ``accumulate`` are refused with one clear error.

Every step is the trainer's own jitted step, compiled once per (mode, mesh, stage, k)
(``accum_common``); bad values enter through the batch, so hypothesis does not recompile.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from accum_common import (
    BATCH,
    abstract_batch,
    fresh_state,
    hlo,
    host_batches,
    put_batch,
    run,
    setup,
    step,
)
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from jaxpr_utils import iter_eqns
from test_every_mesh import _config, _overrides
from test_zero import _context, _shards, collectives

from jamp import experiment, grad_accum, train

if len(jax.devices()) < 8:  # conftest forces 8 CPU devices
    pytest.skip("needs 8 devices", allow_module_level=True)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESH = (4, 2, 1)
PIPE = (2, 2, 2)
MESHES = [(8, 1, 1), MESH, PIPE, (1, 8, 1)]
"""data-only, data x model, data x model x pipe, tensor-only (data=1)."""
K = 4
PIPE_K = 2  # 32 examples / (2 data shards x 2 accumulated x 2 pipeline microbatches)


def k_of(mesh):
    return PIPE_K if mesh[2] > 1 else K


# ----------------------------------------------------------------------------- 1. trajectory


def test_single_device_value_and_grad_gives_the_whole_batch_step():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(24, 5)).astype(np.float32), rng.normal(size=24).astype(np.float32)

    def loss(w, batch):
        err = jnp.tanh(batch["x"] @ w["a"]) @ w["b"] - batch["y"]
        return jnp.mean(err**2), {"err": jnp.mean(err)}

    w0 = {"a": jnp.asarray(rng.normal(size=(5, 3)), jnp.float32), "b": jnp.ones(3)}
    tx = optax.sgd(0.3)
    trajectories = []
    for grad_fn in (jax.value_and_grad(loss, has_aux=True), grad_accum.value_and_grad(loss, 3),
                    grad_accum.value_and_grad(loss, 6)):
        w, opt, seen = w0, tx.init(w0), []
        for _ in range(3):
            (value, aux), g = jax.jit(grad_fn)(w, {"x": x, "y": y})
            updates, opt = tx.update(g, opt)
            w = optax.apply_updates(w, updates)
            seen.append((float(value), float(aux["err"])))
        trajectories.append((seen, w))
    (seen1, w1), *rest = trajectories
    assert not np.allclose(w1["a"], w0["a"])  # it moves
    for seen, w in rest:
        np.testing.assert_allclose(seen, seen1, rtol=1e-5)
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), w, w1)


@pytest.fixture(scope="module")
def reference():
    """k=1 on data=4, model=2 at stage 0 (float32): the whole batch's steps."""
    return run("fp32", MESH, 0, 1)


def _assert_same_params(p, p0, what):
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(p), jax.tree_util.tree_leaves(p0),
                            strict=True):
        # The key bias cannot change the attention (softmax is shift-invariant): its gradient
        # is float32 roundoff, summed in another order, which Adam scales to lr-sized steps
        # of either sign (lr 1e-2, 3 steps).
        if "key_bias" in jax.tree_util.keystr(path):
            assert np.max(np.abs(a)) <= 0.031 and np.max(np.abs(b)) <= 0.031
            continue
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6,
                                   err_msg=f"{what} {jax.tree_util.keystr(path)}")


TRAJECTORY_CASES = [(MESH, s) for s in range(4)] + [((8, 1, 1), 0), ((1, 8, 1), 0), (PIPE, 0)]


@pytest.mark.parametrize("mesh, stage", TRAJECTORY_CASES)
def test_k_micro_batches_give_the_whole_batch_step(reference, mesh, stage):
    m0, p0, s0 = reference
    m, p, s = run("fp32", mesh, stage, k_of(mesh))
    what = (mesh, stage)
    np.testing.assert_allclose([x["loss"] for x in m], [x["loss"] for x in m0], rtol=1e-5,
                               err_msg=str(what))
    np.testing.assert_allclose([x["grad_norm"] for x in m], [x["grad_norm"] for x in m0],
                               rtol=1e-5, err_msg=str(what))
    np.testing.assert_allclose([x["accuracy"] for x in m], [x["accuracy"] for x in m0],
                               rtol=1e-6, err_msg=str(what))
    assert not np.array_equal(p0[1]["head"]["kernel"], p0[0]["head"]["kernel"])  # it moves
    for i in range(1, len(p)):
        _assert_same_params(p[i], p0[i], (what, i))
    _assert_same_params(jax.device_get(s.params), jax.device_get(s0.params), (what, "final"))


def test_nnx_k_micro_batches_give_the_whole_batch_step():
    m0, p0, s0 = run("fp32", (8, 1, 1), 0, 1, "nnx")
    m, p, s = run("fp32", (8, 1, 1), 0, K, "nnx")
    np.testing.assert_allclose([x["loss"] for x in m], [x["loss"] for x in m0], rtol=1e-5)
    after0, after = jax.device_get(s0.params), jax.device_get(s.params)
    leaves0, leaves = jax.tree_util.tree_leaves(p0[0]), jax.tree_util.tree_leaves(after0)
    assert any(not np.array_equal(a, b) for a, b in zip(leaves, leaves0, strict=True))
    _assert_same_params(after, after0, "nnx")


# ----------------------------------------------------------------------------- 2. HLO


def _computations(text: str) -> dict[str, list[str]]:
    found, name = {}, None
    for line in text.splitlines():
        if m := re.match(r"(?:ENTRY )?%?([\w.-]+) \(.*\{\s*$", line):
            name = m.group(1)
            found[name] = []
        elif name:
            found[name].append(line)
    return found


def _in_loops(text: str, trips: int) -> set[str]:
    """The computations run by the ``while`` loops of ``trips`` iterations (and all they call)."""
    comps = _computations(text)
    todo = [m.group(1) for lines in comps.values() for line in lines
            if " while(" in line and f'"known_trip_count":{{"n":"{trips}"}}' in line
            for m in [re.search(r"body=%([\w.-]+)", line)]]
    seen = set()
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for line in comps[name]:
            todo += re.findall(r"(?:body|condition|to_apply|calls|branch_computations)="
                               r"\{?%([\w.-]+)", line)
            todo += re.findall(r", %([\w.-]+)(?=[,}])", line.split("branch_computations=")[-1]
                               ) if "branch_computations=" in line else []
    return seen


def gradient_reductions(text: str, mesh=MESH, trips: int | None = None) -> list[dict]:
    """The summing all-reduces / reduce-scatters over 'data' of arrays (not scalar metrics);
    with ``trips``, only those inside the loops of that many iterations."""
    inside = None if trips is None else {
        line.strip()[:200] for c in _in_loops(text, trips) for line in _computations(text)[c]}
    found = []
    for c in collectives(text, mesh):
        if c["op"] == "all-gather" or not c["over_data"] or c["reducer"] != "add":
            continue
        if not any(shape for _, shape in c["elements"]):
            continue
        if inside is not None and c["line"].strip()[:200] not in inside:
            continue
        found.append(c)
    return found


@pytest.mark.parametrize("stage, op", [(0, "all-reduce"), (2, "reduce-scatter"),
                                       (3, "reduce-scatter")])
def test_one_gradient_reduction_per_window(stage, op):
    one = gradient_reductions(hlo("fp16", MESH, stage, 1))
    text = hlo("fp16", MESH, stage, K)
    many = gradient_reductions(text)
    assert _in_loops(text, K), "no accumulation loop of K iterations in the HLO"
    assert [c for c in many if c["op"] == op], (stage, op)
    assert len(many) == len(one), ([c["line"] for c in many], [c["line"] for c in one])
    assert sorted(c["op"] for c in many) == sorted(c["op"] for c in one)
    looped = gradient_reductions(text, trips=K)
    assert not looped, [c["line"] for c in looped]  # not once per micro-batch


@pytest.mark.parametrize("mode, stage", [(m, s) for m in ("fp16", "fp16_naive") for s in (0, 2, 3)])
def test_every_gradient_reduction_sums_in_float32(mode, stage):
    text = hlo(mode, MESH, stage, K)
    reductions = gradient_reductions(text)
    assert reductions
    for c in collectives(text, MESH):
        if c["over_data"] and c["reducer"] == "add":
            assert not {dt for dt, _ in c["elements"]} & {"f16", "bf16"}, c["line"]
    assert {dt for c in reductions for dt, _ in c["elements"]} == {"f32"}
    assert not gradient_reductions(text, trips=K)


# ----------------------------------------------------------------------------- 3. float32 sums


def test_micro_batch_gradients_are_summed_in_float32_not_rounded():
    """Float16 gradients 2048, 1, 1, ... (64 micro-batches): a float16 running sum stays at
    2048 (2049 rounds back down); the float32 sum is 2111, cast to float16: 2112."""
    k = 64
    x = np.full(k, float(k), np.float32)
    x[0] = 2048.0 * k
    loss = lambda w, b: (jnp.mean(b["x"] * w.astype(jnp.float32)), {})
    (_, _), g = jax.jit(grad_accum.value_and_grad(loss, k))(jnp.float16(1.0), {"x": x})
    assert g.dtype == jnp.float16 and float(g) == 2112.0, float(g)


def test_micro_batch_gradients_that_overflow_float16_only_in_a_half_sum():
    """Shares 40000, 40000, -30000, -30000 (each fits float16): a float16 running sum hits inf
    at 80000; the float32 sum is 20000, which fits."""
    x = np.array([40000.0, 40000.0, -30000.0, -30000.0], np.float32) * 4
    loss = lambda w, b: (jnp.mean(b["x"] * w["w"].astype(jnp.float32)), {})
    (_, _), g = jax.jit(grad_accum.value_and_grad(loss, 4))(
        {"w": jnp.float16(1.0)}, {"x": x})
    assert float(g["w"]) == 20000.0


def test_the_scan_carry_is_float32_for_float16_parameters():
    exp, abstract, shardings = setup("fp16_naive", MESH, 0, K)
    with _context(exp):
        jitted = train.jit_train_step(exp, shardings, abstract)
        traced = jitted.trace(abstract, abstract_batch(exp), jax.random.key(0))
    params = jax.tree_util.tree_leaves(abstract.params)
    assert {p.dtype for p in params} >= {jnp.dtype(jnp.float16)}
    scans = [e for e in iter_eqns(traced.jaxpr) if e.primitive.name == "scan"
             and e.params["length"] == K]
    assert len(scans) == 1, [e.params["length"] for e in scans]
    eqn = scans[0]
    carry = eqn.params["jaxpr"].in_avals[eqn.params["num_consts"]:][:eqn.params["num_carry"]]
    assert len(carry) == len(params)
    assert {str(a.dtype) for a in carry} == {"float32"}, [str(a.dtype) for a in carry]


# ----------------------------------------------------------------------------- 4. poison

BAD = {"inf": np.inf, "-inf": -np.inf, "nan": np.nan}
POISON_CASES = [(m, MESH, s) for m in ("fp16", "fp16_naive") for s in range(4)] + [
    (m, PIPE, 0) for m in ("fp16", "fp16_naive")]


def _clean(mode, mesh, stage):
    """The host leaves after one clean step (so Adam's moments are not zero)."""
    key = (mode, mesh, stage)
    if key not in _CLEAN:
        _, _, state = run(mode, mesh, stage, k_of(mesh), batches=host_batches()[:1])
        _CLEAN[key] = jax.device_get(jax.tree_util.tree_leaves(state))
    return _CLEAN[key]


_CLEAN: dict = {}


def _poison(mesh, shard, micro, position, pixel, value):
    batch = {k: v.copy() for k, v in host_batches()[1].items()}
    per_shard = BATCH // mesh[0]
    per_micro = per_shard // k_of(mesh)
    index = shard * per_shard + micro * per_micro + position % per_micro
    batch["image"].reshape(BATCH, -1)[index, pixel % 64] = value
    return batch


def _explicit(test):
    for i, case in enumerate(POISON_CASES):
        k = k_of(case[1])
        test = example(case=case, shard=i, micro=(0, k // 2, k - 1)[i % 3], position=i,
                       pixel=7 * i, kind=list(BAD)[i % 3])(test)
    return test


@settings(max_examples=6, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(POISON_CASES), shard=st.integers(0, 7), micro=st.integers(0, 3),
       position=st.integers(0, 7), pixel=st.integers(0, 63), kind=st.sampled_from(list(BAD)))
@_explicit
def test_a_bad_value_in_one_micro_batch_skips_the_whole_window(case, shard, micro, position,
                                                               pixel, kind):
    mode, mesh, stage = case
    k = k_of(mesh)
    exp = setup(mode, mesh, stage, k)[0]
    state = fresh_state(mode, mesh, stage, k, leaves=_clean(mode, mesh, stage))
    kept = _shards((state.params, state.opt_state.inner_state))
    before = jax.device_get(state.opt_state)
    batch = _poison(mesh, shard % mesh[0], micro % k, position, pixel, BAD[kind])
    state, m = step(mode, mesh, stage, k)(state, put_batch(exp, batch), jax.random.key(2))
    after = jax.device_get(state.opt_state)
    assert not bool(m["grad_finite"]), m
    assert int(after.steps_skipped) == int(before.steps_skipped) + 1 == int(m["steps_skipped"])
    config = exp.precision.loss_scale
    if int(before.hysteresis_tracker) > 1:  # fp16_naive (hysteresis 2): tolerated once
        assert float(after.scale) == float(before.scale)
        assert int(after.hysteresis_tracker) == int(before.hysteresis_tracker) - 1
    else:  # backed off once
        assert float(after.scale) == float(before.scale) * config.backoff_factor
    assert _shards((state.params, state.opt_state.inner_state)) == kept, (
        "a skipped window changed the params, master copy or optimizer state")


def test_the_poison_cases_cover_every_stage_the_pipeline_and_both_modes():
    assert {(m, s) for m, mesh, s in POISON_CASES if mesh == MESH} == {
        (m, s) for m in ("fp16", "fp16_naive") for s in range(4)}
    assert {m for m, mesh, _ in POISON_CASES if mesh == PIPE} == {"fp16", "fp16_naive"}


# ----------------------------------------------------------------------------- 5. fp8

FP8_MESH = (8, 1, 1)


def _fp8_setup(k):
    """fp8 (delayed scaling) with a dynamic loss scale, so a bad window is skipped."""
    key = ("fp8", k)
    if key not in _FP8:
        fields = _overrides(FP8_MESH, "fp8", "linen", 8)
        fields.update(dropout_rate=0.0, grad_accum_steps=k, batch_size=BATCH, max_steps=3,
                      **{"loss_scale.kind": "dynamic", "loss_scale.init_scale": 2.0**8})
        exp = experiment.build_experiment(_config("fp8", fields))
        with jax.set_mesh(exp.mesh):
            abstract, shardings = experiment.state_shardings(exp, jax.random.key(0))
            state = experiment.init_state(exp, jax.random.key(0), shardings)
        with _context(exp):
            jitted = train.jit_train_step(exp, shardings, abstract)
        _FP8[key] = exp, shardings, jax.device_get(jax.tree_util.tree_leaves(state)), jitted
    return _FP8[key]


_FP8: dict = {}


def _fp8_step(k, leaves, batch):
    exp, shardings, init, jitted = _fp8_setup(k)
    state = jax.device_put(jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(shardings), init if leaves is None else leaves), shardings)
    before = jax.device_get(state)
    with _context(exp):
        state, m = jitted(state, put_batch(exp, batch), jax.random.key(3))
    return before, state, jax.device_get(m)


def test_fp8_amax_over_the_window_is_the_max_over_its_micro_batches():
    batch = host_batches()[0]
    before, s1, m1 = _fp8_step(1, None, batch)
    _, s2, m2 = _fp8_step(2, None, batch)
    assert bool(m1["grad_finite"]) and bool(m2["grad_finite"])
    fp8_0, fp8_1, fp8_2 = (jax.device_get(s.fp8) for s in (before, s1, s2))
    moved = 0
    for (path, a), b, c in zip(jax.tree_util.tree_leaves_with_path(fp8_1),
                               jax.tree_util.tree_leaves(fp8_2), jax.tree_util.tree_leaves(fp8_0),
                               strict=True):
        name = jax.tree_util.keystr(path)
        np.testing.assert_allclose(b, a, rtol=2e-6, err_msg=name)
        moved += "amax_history" in name and not np.array_equal(a, c) and np.max(a) > 0
    assert moved, "no amax history recorded the step"


def test_fp8_state_is_bit_identical_after_a_skipped_window():
    exp, shardings, init, _ = _fp8_setup(2)
    _, clean, _ = _fp8_step(2, None, host_batches()[0])
    leaves = jax.device_get(jax.tree_util.tree_leaves(clean))
    batch = _poison(FP8_MESH, 3, 1, 1, 20, np.nan)
    before, after, m = _fp8_step(2, leaves, batch)
    assert not bool(m["grad_finite"])
    assert _shards((after.fp8, after.fp8_pending, after.params, after.opt_state.inner_state)) == \
        _shards(jax.device_put((before.fp8, before.fp8_pending, before.params,
                                before.opt_state.inner_state),
                               (shardings.fp8, shardings.fp8_pending, shardings.params,
                                shardings.opt_state.inner_state)))


# ----------------------------------------------------------------------------- 6. memory


def test_the_memory_report_counts_one_micro_batch():
    reports = {}
    for k in (1, K):
        exp = setup("fp16", MESH, 0, k)[0]
        state = fresh_state("fp16", MESH, 0, k)
        with _context(exp):
            reports[k] = train.step_memory_report(exp, state)
    one, many = reports[1], reports[K]
    assert (many.params_bytes, many.grads_bytes, many.opt_state_bytes) == (
        one.params_bytes, one.grads_bytes, one.opt_state_bytes)
    assert many.residual_bytes < one.residual_bytes
    if one.activation_bytes is not None:
        ratio = many.activation_bytes / one.activation_bytes
        assert 0.2 <= ratio <= 0.3, (ratio, one, many)
    ratio = many.residual_bytes / one.residual_bytes
    assert ratio < 0.4, (ratio, one, many)


# ----------------------------------------------------------------------------- 7. bad values


@pytest.mark.parametrize("value, batch, match", [
    (0, 32, "grad_accum_steps=0 is out of range"),
    (-1, 32, "grad_accum_steps=-1 is out of range"),
    (True, 32, "grad_accum_steps=True is out of range"),
    (3, 32, "accumulated micro-batches"),
    (4, 8, "accumulated micro-batches"),  # divides 'data' (4), not data x k (16)
])
def test_bad_grad_accum_steps_are_refused_by_the_config(value, batch, match):
    fields = _overrides(MESH, "fp32", "linen", 8)
    fields.update(grad_accum_steps=value, batch_size=batch)
    with pytest.raises(experiment.ConfigError, match=re.escape(match)) as e:
        experiment.build_experiment(_config("fp32", fields))
    assert "grad_accum_steps" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("steps", [0, -1, True, 2.0, "2", None])
def test_check_steps_refuses_what_is_not_a_positive_int(steps):
    with pytest.raises(ValueError, match=r"must be an int >= 1 .* e\.g\. accumulate=4"):
        grad_accum.check_steps(steps)
    with pytest.raises(ValueError, match="must be an int >= 1"):
        grad_accum.value_and_grad(lambda w, b: (jnp.sum(w), {}), steps)


def test_check_steps_names_a_divisor_and_a_batch():
    with pytest.raises(ValueError, match=r"accumulate=3 does not divide the batch of 64 .*"
                                         r"accumulate=2\) or a batch that is a multiple of 3"):
        grad_accum.check_steps(3, 64)
    f = grad_accum.value_and_grad(lambda w, b: (jnp.mean(b["x"] * w), {}), 3)
    with pytest.raises(ValueError, match="does not divide the batch of 8"):
        f(jnp.ones(()), {"x": jnp.ones(8)})
    assert grad_accum.check_steps(4, 64) == 4


def test_the_command_refuses_a_non_divisor_exit_2_nothing_written(tmp_path):
    workdir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "jamp.train", f"--config={REPO}/configs/vit_fp16.py",
         "--config.grad_accum_steps=3", "--config.batch_size=64", f"--workdir={workdir}"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": REPO})
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert done.stderr.count("jamp.train: error: ") == 1, done.stderr
    error = done.stderr[done.stderr.index("jamp.train: error: "):].strip()
    assert "\n\n" not in error and "grad_accum_steps" in error and "64" in error, error
    assert not workdir.exists() and os.listdir(tmp_path) == []
