"""ZeRO-1/2/3 (FSDP) with mixed precision on 8 fake CPU devices (issue 24).

The trainer's own jitted step (``jamp.train.jit_train_step``) of a tiny ViT (hidden 16,
MLP 16, 2 layers, 8 heads, 8x8 images, batch 16), per ZeRO stage:

- the compiled HLO: stage 3 all-gathers each parameter over 'data' in the dtype the
  model reads it in (float16 for the fp16 model's kernels, float32 for LayerNorm:
  :func:`jamp.parallel.read_dtypes.read_dtypes` says which), stages 2 and 3
  reduce-scatter the gradients in float32, stage 1 all-reduces them in float32, and
  no collective over 'data' sums in half precision (tensor parallelism's activation
  all-reduces over 'model' are not gradients and are not checked);
- the shard shapes of the parameters, the fp16_naive master copy, AdamW's ``mu``/``nu``
  and the gradients: split over 'data' from stage 1 (optimizer state), 2 (gradients),
  3 (parameters), along :func:`jamp.parallel.zero.split_dim`;
- the per-device argument bytes of the compiled step against the bytes-per-parameter
  arithmetic;
- 20-step trajectories: float32 stages 1-3 equal stage 0; float16 with a loss scale
  that overflows takes the same skips with the same scales at every stage;
- an inf, -inf or NaN in one data shard's gradient (hypothesis over stage x mesh x
  leaf x position x value) skips the step on every device, backs the scale off
  everywhere, and leaves every shard of the parameters and optimizer state
  bit-identical.

Each (mode, mesh, stage) step is compiled once (module caches) and reused; the bad
value, its shard, leaf and position are batch entries, so hypothesis examples do not
recompile.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_every_mesh import _config, _overrides

from jamp import data, experiment, parallel, train
from jamp.loss_scale import LossScaleState
from jamp.parallel import zero
from jamp.parallel.read_dtypes import read_dtypes
from jamp.step import train_step

if len(jax.devices()) < 8:  # conftest forces 8 CPU devices
    pytest.skip("needs 8 devices", allow_module_level=True)

MESH = (4, 2, 1)
"""(data, model, pipe) of the HLO, shard-shape, bytes and float16 trajectory tests."""
STAGES = zero.STAGES
BATCH, STEPS = 16, 20
OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
"""Faster XLA:CPU code generation (the HLO passes, so the collectives, are the same)."""
OVERFLOW_SCALE = {"loss_scale.init_scale": 2.0**30, "loss_scale.max_scale": 2.0**40,
                  "loss_scale.growth_interval": 3,
                  "loss_scale.hysteresis": 1, "loss_scale.backoff_factor": 0.5}
"""A float16 loss scale that overflows for the first steps, then grows into overflow again."""
HALF = ("f16", "bf16")


# ----------------------------------------------------------------------------- set-up


@functools.cache
def setup(mode: str, mesh: tuple[int, ...], stage: int):
    """The experiment, abstract state and state shardings of ``mode`` on ``mesh`` at ``stage``."""
    fields = _overrides(mesh, mode, "linen", 8)
    fields.update(zero_stage=stage, dropout_rate=0.0, max_steps=STEPS)
    if mode in ("fp16", "fp16_naive"):
        fields.update(OVERFLOW_SCALE)
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
        batches.append(batch)
        if len(batches) == STEPS:
            return batches
    raise AssertionError("the digits loader gave fewer than STEPS batches")


@functools.cache
def host_init(mode: str):
    """The initial train state's leaves on the host (created once per mode: every stage and
    mesh then starts from the same numbers)."""
    exp, _, shardings = setup(mode, MESH, 0)
    with jax.set_mesh(exp.mesh):
        state = experiment.init_state(exp, jax.random.key(0), shardings)
    return jax.device_get(jax.tree_util.tree_leaves(state))


def place(setup_, leaves, scale: float | None = None):
    """A train state of ``setup_`` (its stage's shardings) holding the host ``leaves``
    (and loss scale ``scale``, if given)."""
    exp, abstract, shardings = setup_
    state = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(abstract), leaves)
    if scale is not None:
        state = state.replace(opt_state=state.opt_state._replace(scale=np.float32(scale)))
    return jax.device_put(state, shardings)


def fresh_state(mode, mesh, stage, scale=None):
    return place(setup(mode, mesh, stage), host_init(mode), scale)


def put_batch(exp, batch):
    return jax.device_put(batch, parallel.batch_sharding(exp.mesh))


def abstract_batch(exp, keys=("image", "label"), extra=None):
    sharding = parallel.batch_sharding(exp.mesh)
    batch = {k: host_batches()[0][k] for k in keys}
    batch.update(extra or {})
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in batch.items()}


@contextlib.contextmanager
def _context(exp):
    """Where the trainer builds its step: the mesh and the logical axis rules."""
    with jax.set_mesh(exp.mesh), nn.logical_axis_rules(parallel.LOGICAL_AXIS_RULES):
        yield


@functools.cache
def lowered_step(mode: str, mesh: tuple[int, ...], stage: int):
    """The trainer's jitted step, lowered (``jax.stages.Lowered``: the program jamp emits)."""
    exp, abstract, shardings = setup(mode, mesh, stage)
    with _context(exp):
        jitted = train.jit_train_step(exp, shardings, abstract)
        return jitted.lower(abstract, abstract_batch(exp), jax.random.key(0))


@functools.cache
def real_step(mode: str, mesh: tuple[int, ...], stage: int):
    """The trainer's jitted step, compiled (``jax.stages.Compiled``)."""
    return lowered_step(mode, mesh, stage).compile(OPTIONS)


@functools.cache
def hlo(mode, mesh, stage):
    return real_step(mode, mesh, stage).as_text()


# ----------------------------------------------------------------------------- HLO parsing

_OP = re.compile(r"=\s*(?P<type>\([^)]*\)|[a-z0-9]+\[[^\]]*\](?:\{[^}]*\})?)\s+"
                 r"(?P<op>all-gather|all-reduce|reduce-scatter)(?:-start)?\(")


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(dims)).reshape(dims)
    return (ids if perm is None else ids.transpose(perm)).reshape(-1)


def _ints(text: str | None) -> list[int] | None:
    return None if text is None else [int(t) for t in text.split(",") if t]


def replica_groups(line: str, devices: int) -> list[list[int]]:
    """The device groups of a collective, in the three forms XLA prints them."""
    if m := re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line):
        groups = [_ints(g) for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
        return groups or [list(range(devices))]
    if m := re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line):
        ids = _iota(_ints(m.group(3)), _ints(m.group(4)))
        return ids.reshape(int(m.group(1)), int(m.group(2))).tolist()
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\]"
                      r"(?:T\(([\d,]+)\))?\))? \{([^}]*)\}", line):
        axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
        ids = (np.arange(math.prod(sizes)) if m.group(2) is None
               else _iota(_ints(m.group(2)), _ints(m.group(3))))
        reduced = [names.index(a) for a in re.findall(r"'(\w+)'", m.group(4))]
        kept = [i for i in range(len(names)) if i not in reduced]
        grid = ids.reshape(sizes).transpose(kept + reduced)
        return grid.reshape(-1, math.prod(sizes[i] for i in reduced)).tolist()
    raise AssertionError(f"cannot read the replica groups of: {line[:300]}")


def collectives(text: str, mesh_shape: tuple[int, ...]) -> list[dict]:
    """Every all-gather, all-reduce and reduce-scatter: op, element dtypes and shapes, and
    whether it moves data across 'data' shards (``over_data``) or only across them
    (``data_only``: every group varies in the 'data' coordinate alone)."""
    found, roots = [], _roots(text)
    for line in text.splitlines():
        m = _OP.search(line)
        if not m:
            continue
        groups = replica_groups(line, math.prod(mesh_shape))
        coords = [[np.unravel_index(i, mesh_shape) for i in g] for g in groups]
        over_data = any(len({c[0] for c in g}) > 1 for g in coords)
        data_only = over_data and all(len({tuple(c[1:]) for c in g}) == 1 for g in coords)
        elements = [(dt, tuple(_ints(dims) or ()))
                    for dt, dims in re.findall(r"([a-z0-9]+)\[([\d,]*)\]", m.group("type"))]
        reducer = re.search(r"to_apply=%([\w.-]+)", line)
        found.append(dict(op=m.group("op"), elements=elements, over_data=over_data,
                          data_only=data_only, line=line[:200],
                          reducer=reducer and roots.get(reducer.group(1))))
    return found


def _roots(text: str) -> dict[str, str]:
    """The op at the root of each computation (an all-reduce's ``to_apply``: add, maximum)."""
    roots, name = {}, None
    for line in text.splitlines():
        if m := re.match(r"%?([\w.-]+) \(.*\{\s*$", line):
            name = m.group(1)
        elif name and (m := re.search(r"ROOT %[\w.-]+ = \S+ ([a-z-]+)\(", line)):
            roots[name] = m.group(1)
    return roots


def data_collectives(mode, stage, op):
    return [c for c in collectives(hlo(mode, MESH, stage), MESH)
            if c["op"] == op and c["over_data"]]


def _hlo_dtype(dtype) -> str:
    name = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}.get(str(dtype), dtype)
    return {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}[jnp.dtype(name).name]


def _local_shape(shape, spec, mesh_shape: dict, without=()) -> tuple[int, ...]:
    """``shape`` split by the mesh axes ``spec`` names (except ``without``)."""
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    out = []
    for n, entry in zip(shape, entries, strict=True):
        for axis in (entry if isinstance(entry, tuple) else (entry,)):
            if axis is not None and axis not in without:
                n //= mesh_shape[axis]
        out.append(n)
    return tuple(out)


def gathered_candidates(mode, mesh) -> set[tuple[str, tuple[int, ...]]]:
    """(read dtype, shape) an all-gather of each stage-3 split parameter may produce: the
    whole leaf or one layer of the stacked encoder, split by 'model'/'pipe' or not."""
    exp, abstract, shardings = setup(mode, mesh, 3)
    params = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                    abstract.params)
    images = jax.ShapeDtypeStruct((BATCH, 8, 8, 1), jnp.float32)
    reads = read_dtypes(lambda p, x: exp.model.apply({"params": p}, x, train=False),
                        params, images)
    sizes = dict(exp.mesh.shape)
    found = set()
    for (path, p), read, s in zip(jax.tree_util.tree_leaves_with_path(params),
                                  jax.tree_util.tree_leaves(reads),
                                  jax.tree_util.tree_leaves(shardings.params), strict=True):
        spec = zero.without_data(s.spec)
        if zero.split_dim(p.shape, spec, sizes["data"]) is None:
            continue  # replicated over 'data': never gathered
        shapes = {p.shape, _local_shape(p.shape, spec, sizes)}
        if "layers" in jax.tree_util.keystr(path):
            shapes |= {sh[1:] for sh in shapes}
        found |= {(_hlo_dtype(read), sh) for sh in shapes}
    return found


# ----------------------------------------------------------------------------- 1. HLO


def lowered_gathers(text: str) -> list[dict]:
    """The all-gathers of a lowered (StableHLO) program: result dtype and shape, groups."""
    found = []
    for line in text.splitlines():
        if '"stablehlo.all_gather"' not in line:
            continue
        groups = re.search(r"replica_groups = dense<(\[\[[\d, \[\]]*\]\])>", line)
        result = re.search(r"-> tensor<([\dx]*?)x?([a-z]+[0-9]*)>\s*$", line)
        assert groups and result, line[:300]
        shape = tuple(int(n) for n in result.group(1).split("x") if n)
        found.append(dict(elements=[(_hlo_dtype(result.group(2)), shape)],
                          groups=eval(groups.group(1))))  # a list of lists of ints
    return found


def _data_only(groups, mesh_shape) -> bool:
    coords = [[np.unravel_index(i, mesh_shape) for i in g] for g in groups]
    return all(len({c[0] for c in g}) > 1 and len({tuple(c[1:]) for c in g}) == 1
               for g in coords)


def _check_gathers(gathers, candidates, compute):
    seen = {e for c in gathers for e in c["elements"]}
    assert seen, "stage 3 gathers no parameter over 'data'"
    wrong = seen - candidates
    assert not wrong, (f"all-gathers over 'data' of no parameter in its read dtype: {wrong};"
                       f" expected among {sorted(candidates)}")
    # The compute-dtype kernels and the float32 LayerNorms both arrive gathered.
    assert {dt for dt, _ in seen} == {compute, "f32"}, seen
    assert {dt for dt, _ in candidates} == {compute, "f32"}, candidates


@pytest.mark.parametrize("mode, compute", [("fp16", "f16"), ("bf16", "bf16")])
def test_stage3_gathers_each_parameter_in_the_dtype_the_model_reads_it_in(mode, compute):
    """In the compiled HLO (after XLA moved any convert: jax#23543). XLA:CPU widens every
    bfloat16 all-gather to float32 (of the bfloat16-rounded values), so bf16 is read from
    the compiled HLO on other backends only, and from the lowered program everywhere."""
    candidates = gathered_candidates(mode, MESH)
    lowered = [g for g in lowered_gathers(lowered_step(mode, MESH, 3).as_text())
               if _data_only(g["groups"], MESH)]
    _check_gathers(lowered, candidates, compute)
    if mode == "bf16" and jax.default_backend() == "cpu":
        return
    _check_gathers([c for c in collectives(hlo(mode, MESH, 3), MESH)
                    if c["op"] == "all-gather" and c["data_only"]], candidates, compute)


@pytest.mark.parametrize("mode, stage", [("fp16", 2), ("fp16", 3), ("fp16_naive", 2),
                                         ("fp16_naive", 3)])
def test_stages_2_and_3_reduce_scatter_the_gradients_in_float32(mode, stage):
    """fp16: float32 parameters; fp16_naive: float16 ones, float32 sums all the same."""
    scatters = data_collectives(mode, stage, "reduce-scatter")
    assert scatters, f"stage {stage} emits no reduce-scatter over 'data'"
    dtypes = {dt for c in scatters for dt, _ in c["elements"]}
    assert dtypes == {"f32"}, [c["line"] for c in scatters if c["elements"][0][0] != "f32"]


@pytest.mark.parametrize("mode", ["fp16", "fp16_naive"])
def test_stage1_all_reduces_the_gradients_in_float32(mode):
    reduces = data_collectives(mode, 1, "all-reduce")
    arrays = [e for c in reduces for e in c["elements"] if e[1]]  # not the scalar metrics
    assert arrays and {dt for dt, _ in arrays} == {"f32"}, arrays
    # fp16_naive: float16 parameters, float32 gradient sums (and a float32 master copy).
    assert not data_collectives(mode, 1, "reduce-scatter")


@pytest.mark.parametrize("mode, stage", [("fp16", 1), ("fp16", 2), ("fp16", 3), ("fp16_naive", 1),
                                         ("fp16_naive", 2), ("fp16_naive", 3), ("bf16", 3)])
def test_no_half_precision_sum_over_data(mode, stage):
    """(A half-precision ``max``, e.g. of the overflow check over gradient shards, is exact.)"""
    reducers = set()
    for op in ("all-reduce", "reduce-scatter"):
        for c in data_collectives(mode, stage, op):
            assert c["reducer"], c["line"]
            reducers.add(c["reducer"])
            half = any(dt in HALF for dt, _ in c["elements"])
            assert not (half and c["reducer"] == "add"), c["line"]
    assert "add" in reducers


def test_the_hlo_parser_reads_every_form_of_replica_groups():
    assert replica_groups("replica_groups={{0,2,4,6},{1,3,5,7}}, d", 8) == [[0, 2, 4, 6],
                                                                          [1, 3, 5, 7]]
    assert replica_groups("replica_groups=[4,2]<=[8], d", 8) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert replica_groups("replica_groups=[2,4]<=[4,2]T(1,0), d", 8) == [[0, 2, 4, 6],
                                                                         [1, 3, 5, 7]]
    line = "replica_groups=mesh['axis_0'=1,'axis_1'=1,'axis_2'=4,'axis_3'=2] {'axis_2'}, u"
    assert replica_groups(line, 8) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    line = ("replica_groups=mesh['axis_0'=1,'axis_1'=2,'axis_2'=1,'axis_3'=4], "
            "device_ids=([4,2]T(1,0)) {'axis_1'}, u")
    assert replica_groups(line, 8) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    text = ("%add (a: f16[], b: f16[]) -> f16[] {\n  %a = f16[] parameter(0)\n"
            "  ROOT %s = f16[] add(%a, %b)\n}\n\n"
            "  %a = (f32[], f16[4,2]{1,0}) all-reduce(%x, %y), "
            "replica_groups={{0,2,4,6},{1,3,5,7}}, to_apply=%add\n")
    found = collectives(text, MESH)
    assert found[0]["elements"] == [("f32", ()), ("f16", (4, 2))] and found[0]["data_only"]
    assert found[0]["reducer"] == "add"


# ----------------------------------------------------------------------------- 2. shards


def _split_over_data(x, spec0, data_size) -> tuple[int, ...]:
    """The shard shape ``x`` must have when ZeRO splits it (stage-0 spec ``spec0``)."""
    shape = list(_local_shape(x.shape, spec0, x.sharding.mesh.shape))
    dim = zero.split_dim(x.shape, spec0, data_size)
    if dim is not None:
        shape[dim] //= data_size
    return tuple(shape)


def _check_tree(tree, tree0_shardings, split: bool, what: str):
    flat = jax.tree_util.tree_leaves_with_path(tree)
    specs = jax.tree_util.tree_leaves(tree0_shardings)
    assert len(flat) == len(specs)
    data_size = MESH[0]
    split_any = False
    for (path, x), s0 in zip(flat, specs, strict=True):
        if not x.shape:
            continue
        local0 = _local_shape(x.shape, s0.spec, dict(x.sharding.mesh.shape))
        want = _split_over_data(x, s0.spec, data_size) if split else local0
        got = x.sharding.shard_shape(x.shape)
        assert got == want, (what, jax.tree_util.keystr(path), x.shape, got, want)
        split_any |= got != local0
    assert split_any == split, (what, split)


@pytest.mark.parametrize("stage", STAGES)
def test_shard_shapes_of_params_master_mu_nu_per_stage(stage):
    state = fresh_state("fp16_naive", MESH, stage)
    exp = setup("fp16_naive", MESH, stage)[0]
    state, _ = real_step("fp16_naive", MESH, stage)(state, put_batch(exp, host_batches()[0]),
                                                   jax.random.key(0))
    base = setup("fp16_naive", MESH, 0)[2]  # stage 0's shardings: the other axes' splits
    assert isinstance(state.opt_state, LossScaleState)
    master = state.opt_state.inner_state.master
    adam = state.opt_state.inner_state.inner_state[1][0]
    base_inner = base.opt_state.inner_state
    _check_tree(state.params, base.params, stage == 3, "params")
    _check_tree(master, base_inner.master, stage >= 1, "master")
    _check_tree(adam.mu, base_inner.inner_state[1][0].mu, stage >= 1, "mu")
    _check_tree(adam.nu, base_inner.inner_state[1][0].nu, stage >= 1, "nu")


@pytest.mark.parametrize("stage", STAGES)
def test_gradient_shard_shapes_per_stage(stage):
    grads = clean_run(MESH, stage)[2]
    base = setup("fp16", MESH, 0)[2]
    _check_tree(grads, base.params, stage >= 2, "grads")


# ----------------------------------------------------------------------------- 3. bytes


def _tree_bytes(tree, shardings0, split: bool, data_size: int) -> int:
    total = 0
    for x, s0 in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(shardings0),
                     strict=True):
        shape = (_split_over_data(x, s0.spec, data_size) if split
                 else _local_shape(x.shape, s0.spec, dict(s0.mesh.shape)))
        total += math.prod(shape) * np.dtype(x.dtype).itemsize
    return total


def expected_argument_bytes(mode, stage) -> int:
    """Bytes per device of the step's arguments: parameters (split at stage 3), optimizer
    state and master copy (split from stage 1), the step counter, the batch shard, the key."""
    exp, abstract, _ = setup(mode, MESH, stage)
    base = setup(mode, MESH, 0)[2]
    data_size = MESH[0]
    params = _tree_bytes(abstract.params, base.params, stage == 3, data_size)
    opt = _tree_bytes(abstract.opt_state, base.opt_state, stage >= 1, data_size)
    batch = sum(math.prod(v.shape) * jax.dtypes.canonicalize_dtype(v.dtype).itemsize
                for v in host_batches()[0].values()) // data_size
    key = 8  # a threefry key: uint32[2]
    return params + opt + 4 + batch + key


@pytest.mark.parametrize("stage", STAGES)
def test_per_device_argument_bytes_match_the_arithmetic(stage):
    measured = real_step("fp16_naive", MESH, stage).memory_analysis().argument_size_in_bytes
    computed = expected_argument_bytes("fp16_naive", stage)
    assert measured == pytest.approx(computed, rel=0.05), (stage, measured, computed)


def test_the_bytes_fall_with_each_stage():
    b = [expected_argument_bytes("fp16_naive", s) for s in STAGES]
    assert b[0] > b[1] == b[2] > b[3], b  # gradients are no argument of the step


# ----------------------------------------------------------------------------- 4. trajectories


@functools.cache
def trajectory(mode, mesh, stage):
    exp = setup(mode, mesh, stage)[0]
    step = real_step(mode, mesh, stage)
    state = fresh_state(mode, mesh, stage)
    metrics = []
    for i, batch in enumerate(host_batches()):
        state, m = step(state, put_batch(exp, batch), jax.random.fold_in(jax.random.key(1), i))
        metrics.append(jax.device_get(m))
    return metrics, jax.device_get(state.params)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_float32_trajectories_equal_stage_0(stage):
    (m0, p0), (m, p) = trajectory("fp32", MESH, 0), trajectory("fp32", MESH, stage)
    np.testing.assert_allclose([x["loss"] for x in m], [x["loss"] for x in m0], rtol=1e-5)
    assert m0[-1]["loss"] < m0[0]["loss"]  # it trains
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(p), jax.tree_util.tree_leaves(p0),
                            strict=True):
        # The key bias cannot change the attention (softmax is shift-invariant): its gradient
        # is float32 roundoff, summed in another order (any change to the step's fusions
        # moves it), which Adam scales to steps of up to lr each: only that bound holds.
        noise = "key_bias" in jax.tree_util.keystr(path)
        bound = setup("fp32", MESH, stage)[0].config.learning_rate * len(m)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=bound if noise else 1e-6,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_float16_trajectories_skip_and_scale_as_stage_0(stage):
    (m0, p0), (m, p) = trajectory("fp16", MESH, 0), trajectory("fp16", MESH, stage)
    finite0 = [bool(x["grad_finite"]) for x in m0]
    assert not all(finite0) and sum(finite0) >= 3, finite0  # skips and updates both happen
    assert [bool(x["grad_finite"]) for x in m] == finite0
    assert [float(x["loss_scale"]) for x in m] == [float(x["loss_scale"]) for x in m0]
    assert [int(x["steps_skipped"]) for x in m] == [int(x["steps_skipped"]) for x in m0]
    np.testing.assert_allclose([x["loss"] for x in m], [x["loss"] for x in m0], rtol=1e-4)
    bound = setup("fp16", MESH, stage)[0].config.learning_rate * len(m)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(p), jax.tree_util.tree_leaves(p0),
                            strict=True):
        # The key bias's gradient is roundoff that Adam scales to lr-sized steps (see above).
        noise = "key_bias" in jax.tree_util.keystr(path)
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=bound if noise else 1e-5,
                                   err_msg=jax.tree_util.keystr(path))


# ----------------------------------------------------------------------------- dropout


def test_stage3_per_layer_gather_gives_each_layer_its_own_dropout_key():
    """GatherPerLayer runs the stacked layers one at a time on a 'data' mesh: each layer's
    key is the step's key folded with the layer's index (as the plain scan splits it), never
    the step's key for every layer (identical dropout masks in every layer)."""
    layers, width = 3, 16
    mesh = parallel.make_mesh({"data": 8, "model": 1, "pipe": 1})
    params = {"layers": {"w": jnp.ones((layers, 8))}}  # split over 'data' along dim 1
    plan = zero.make_plan(3, params, mesh, per_layer=("layers",))
    assert plan.dims == {"layers": {"w": 1}}

    def apply_layers(stacked, h, key):  # one layer: its random draw pushed onto h
        draw = jax.random.uniform(key, (width,)) * stacked["params"]["w"].mean()
        return jnp.concatenate([draw[None], h[:-1]])

    def loss(p, batch, key):
        h = jnp.zeros((layers, width)) + 0 * batch.mean()
        h = zero.GatherPerLayer()(apply_layers, {"params": p["layers"]}, h, key)
        return h.sum(), h

    key = jax.random.key(3)
    with jax.set_mesh(mesh):
        step = jax.jit(parallel.data_parallel.value_and_grad(loss, plan=plan))
        (_, draws), _ = step(jax.device_put(params, zero.shardings(params, mesh)),
                             jnp.ones((16, 2)), key)
    draws = np.asarray(draws)[::-1]  # layer 0 first
    assert len({row.tobytes() for row in draws}) == layers, draws
    for i, row in enumerate(draws):
        np.testing.assert_allclose(row, jax.random.uniform(jax.random.fold_in(key, i),
                                                           (width,)), rtol=1e-6)


# ----------------------------------------------------------------------------- 5. overflow

POISON_SCALE = 2.0**8
"""The loss scale before the poisoned step (the clean step before it is finite)."""
OVERFLOW_CASES = [*((MESH, s) for s in STAGES), ((8, 1, 1), 3), ((2, 2, 2), 3), ((4, 1, 2), 2)]
"""(mesh, stage) of the overflow property: every stage on the test mesh, FSDP on a
data-only mesh and beside a pipeline, stage 2 beside a pipeline."""
BAD = {"inf": np.inf, "-inf": -np.inf, "nan": np.nan}


def _poisoned(loss_fn):
    """``loss_fn`` plus ``bad * leaf[position]`` on the data shard whose batch slice carries
    ``bad`` (``batch['bad']`` is zero on the other shards): that shard's gradient of that
    element is ``bad``; the other shards' gradients are unchanged."""

    def poisoned(params, batch, rng):
        value, aux = loss_fn(params, batch, rng)
        bad, leaf, position = batch["bad"][0], batch["leaf"][0], batch["position"][0]
        term = 0.0
        for i, p in enumerate(jax.tree_util.tree_leaves(params)):
            element = p.reshape(-1)[position % p.size].astype(jnp.float32)
            term = term + jnp.where(leaf == i, bad, 0.0) * element
        if "pipe" in jax.sharding.get_abstract_mesh().manual_axes:
            # A pipeline stage's own layers: the first stage's, summed to one value.
            term = term + jax.lax.pcast(jnp.zeros((), jnp.float32), "pipe", to="varying")
            first = jax.lax.axis_index("pipe") == 0
            term = jax.lax.psum(jnp.where(first, term, 0.0), "pipe")
        return value + term, aux

    return poisoned


@functools.cache
def poisoned_step(mesh, stage):
    """The trainer's step (its gradient function and ``train_step``) differentiating
    :func:`_poisoned` of the loss; it also returns the gradients."""
    exp, abstract, shardings = setup("fp16", mesh, stage)
    with _context(exp):
        plan = experiment.zero_plan(exp, abstract) if stage else None
        value_and_grad = train.mesh_value_and_grad(exp, shardings, plan)

        def step(state, batch, rng):
            seen = []

            def spy(loss_fn):
                f = value_and_grad(_poisoned(loss_fn))

                def g(*args):
                    out = f(*args)
                    seen.append(out[1])
                    return out

                return g

            state, metrics = train_step(state, batch, rng, 0.0, spy)
            return state, metrics, seen[0]

        jitted = jax.jit(step, in_shardings=(shardings, parallel.batch_sharding(exp.mesh), None),
                         out_shardings=(shardings, None, None), donate_argnums=(0,))
        poison = {"bad": np.zeros(BATCH, np.float32), "leaf": np.zeros(BATCH, np.int32),
                  "position": np.zeros(BATCH, np.int32)}
        lowered = jitted.lower(abstract, abstract_batch(exp, extra=poison), jax.random.key(0))
        return lowered.compile(OPTIONS)


def _poison_batch(exp, shard, leaf, position, value):
    batch = dict(host_batches()[1])
    per_shard = BATCH // exp.mesh.shape["data"]
    bad = np.zeros(BATCH, np.float32)
    bad[shard * per_shard:(shard + 1) * per_shard] = value
    batch.update(bad=bad, leaf=np.full(BATCH, leaf, np.int32),
                 position=np.full(BATCH, position, np.int32))
    return put_batch(exp, batch)


@functools.cache
def clean_run(mesh, stage):
    """One finite step (so ``mu``/``nu`` are not zero): its metrics, the state's host
    leaves after it, the gradients."""
    exp = setup("fp16", mesh, stage)[0]
    state = fresh_state("fp16", mesh, stage, scale=POISON_SCALE)
    state, metrics, grads = poisoned_step(mesh, stage)(
        state, _poison_batch(exp, 0, 0, 0, 0.0), jax.random.key(0))
    assert bool(metrics["grad_finite"]), metrics
    return metrics, jax.device_get(jax.tree_util.tree_leaves(state)), grads


def _shards(tree) -> list[list[tuple]]:
    """Every addressable shard of every leaf: (device, index, bytes)."""
    return [[(s.device, s.index, np.asarray(s.data).tobytes()) for s in x.addressable_shards]
            for x in jax.tree_util.tree_leaves(tree)]


EXPLICIT_LEAVES = (10, 5, 22, 0, 23, 20, 12)
"""Per case of OVERFLOW_CASES, the leaf (in ``tree_leaves`` order) poisoned in its explicit
example: a layer's (stage 3: this shard's block of the stacked layers) or, at stage 3, one
gathered before the model runs (the head's kernel, ``cls``, the position embedding, the final
LayerNorm's float32-gathered scale), whose bad gradient comes through the gather's
reduce-scatter."""


def _explicit(test):
    for i, ((mesh, stage), leaf) in enumerate(zip(OVERFLOW_CASES, EXPLICIT_LEAVES, strict=True)):
        test = example(case=(mesh, stage), shard=i, leaf=leaf, position=5 * i,
                       kind=list(BAD)[i % 3])(test)
    return test


@settings(max_examples=12, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(OVERFLOW_CASES), shard=st.integers(0, 7),
       leaf=st.integers(0, 10**6), position=st.integers(0, 10**6), kind=st.sampled_from(list(BAD)))
@_explicit
def test_a_bad_value_in_one_shards_gradient_skips_on_every_device(case, shard, leaf, position,
                                                                  kind):
    mesh, stage = case
    exp = setup("fp16", mesh, stage)[0]
    before_metrics, leaves, _ = clean_run(mesh, stage)
    state = place(setup("fp16", mesh, stage), leaves)
    n_leaves = len(jax.tree_util.tree_leaves(state.params))
    kept = _shards((state.params, state.opt_state.inner_state))
    scale = float(state.opt_state.scale)
    batch = _poison_batch(exp, shard % mesh[0], leaf % n_leaves, position, BAD[kind])
    state, metrics, grads = poisoned_step(mesh, stage)(state, batch, jax.random.key(2))
    assert not all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree_util.tree_leaves(grads))
    assert not bool(metrics["grad_finite"]) and int(metrics["steps_skipped"]) == 1, metrics
    assert float(metrics["loss_scale"]) == scale
    ls = state.opt_state
    for field in ("scale", "steps_skipped", "last_finite"):
        values = {np.asarray(s.data).item() for s in getattr(ls, field).addressable_shards}
        assert len(values) == 1, (field, values)  # every device holds the same
    assert float(ls.scale) == scale * 0.5 and int(ls.steps_skipped) == 1
    after = _shards((state.params, state.opt_state.inner_state))
    assert after == kept, "a skipped step changed a shard of the params or optimizer state"
