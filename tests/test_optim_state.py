"""jamp.optim_state: low-precision optimizer state and bf16 master-weight schemes."""

import importlib
import os
import tempfile

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jamp
from jamp.optim_state import StateFormat, bf16_master, low_precision_state
from jamp.optim_state.master import join_remainders, split_remainders


def _bits(tree):
    """Every leaf's raw bits (NaN-safe, -0.0 != 0.0), as numpy arrays."""
    def one(x):
        x = np.asarray(x)
        if x.dtype.kind == "f" or x.dtype.name in ("bfloat16", "float8_e4m3fn"):
            return x.view(f"uint{8 * x.dtype.itemsize}")
        return x
    return jax.tree_util.tree_map(one, jax.device_get(tree))


def _same_bits(a, b) -> bool:
    la, lb = jax.tree_util.tree_leaves(_bits(a)), jax.tree_util.tree_leaves(_bits(b))
    return len(la) == len(lb) and all(
        x.dtype == y.dtype and x.shape == y.shape and (x == y).all()
        for x, y in zip(la, lb, strict=True))


def _quantized(state):
    return [x for x in jax.tree_util.tree_leaves(
        state, is_leaf=lambda s: isinstance(s, jamp.optim_state.QuantizedLeaf))
        if isinstance(x, jamp.optim_state.QuantizedLeaf)]


# ------------------------------------------------------------------------- formats


def test_scales_are_powers_of_two_and_requantizing_is_idempotent():
    x = jax.random.normal(jax.random.key(0), (4, 256)) * 1e-3
    for fmt in (StateFormat("fp8"), StateFormat("fp8", block_size=128),
                StateFormat("fp16", sqrt=True), StateFormat("bf16")):
        q = jamp.optim_state.quantize(jnp.abs(x) if fmt.sqrt else x, fmt)
        mantissa, _ = np.frexp(np.asarray(q.scale))
        assert (mantissa == 0.5).all(), fmt
        again = jamp.optim_state.quantize(jamp.optim_state.dequantize(q, fmt), fmt)
        assert _same_bits(q, again), fmt
    q = jamp.optim_state.quantize(x, StateFormat("fp8", block_size=128))
    assert q.scale.shape == (4, 2)
    # The maximum of each block lands in the top binade of E4M3: [224, 448].
    top = np.abs(np.asarray(q.value, np.float32)).reshape(4, 2, 128).max(-1)
    assert ((top > 224) & (top <= 448)).all()


def test_any_chain_sgd_momentum_and_adamw_counts_untouched():
    params = {"w": jax.random.normal(jax.random.key(1), (8, 16)), "b": jnp.zeros(16)}
    grads = jax.tree_util.tree_map(lambda p: jnp.full_like(p, 0.01) + 0.1 * p, params)
    for inner, names in ((optax.sgd(0.1, momentum=0.9), {"trace"}),
                         (optax.chain(optax.clip_by_global_norm(1.0),
                                      optax.adamw(1e-2, weight_decay=0.1)), {"mu", "nu"})):
        tx = low_precision_state(inner, jamp.optim_state.PRESETS["fp8"], strict=False)
        ref_state, state = inner.init(params), tx.init(params)
        assert set(jamp.optim_state.stored_dtypes(state)) == names
        ints = [x for x in jax.tree_util.tree_leaves(state) if x.dtype == jnp.int32]
        assert all(x.shape == () for x in ints)
        for _ in range(3):
            ref_u, ref_state = inner.update(grads, ref_state, params)
            u, state = tx.update(grads, state, params)
        for a, b in zip(jax.tree_util.tree_leaves(u), jax.tree_util.tree_leaves(ref_u),
                        strict=True):
            assert np.allclose(a, b, rtol=0.05, atol=1e-6)


def test_the_fp8_preset_keeps_a_second_moment_spanning_16_decades():
    """Gradients from 1e-7 to 1e1 (rare and frequent features): nu spans 16 decades. Stored
    as is in float16, its small entries flush to zero and their updates explode
    (mu / eps); the preset's nu format (the square root) keeps them."""
    mags = jnp.exp(jax.random.uniform(jax.random.key(9), (128, 128), minval=-7, maxval=1)
                   * jnp.log(10.0))
    params, grads = {"w": jnp.zeros((128, 128))}, {"w": mags}
    ref_tx = optax.adam(1e-3)

    def second_update(tx):  # the first update reads no stored state
        u, state = tx.update(grads, tx.init(params), params)
        return tx.update(grads, state, params)[0]["w"]

    ref = second_update(ref_tx)
    err = lambda fmt: float(jnp.max(jnp.abs(second_update(low_precision_state(
        ref_tx, {"nu": fmt})) - ref) / jnp.abs(ref)))
    assert err(jamp.optim_state.PRESETS["fp8"]["nu"]) < 1e-3
    assert err(StateFormat("fp16")) > 0.1  # measured: 0.41


def test_bad_formats_and_combinations_get_one_clear_error():
    with pytest.raises(ValueError, match="Unknown optimizer-state dtype 'fp4'"):
        low_precision_state(optax.adam(1e-3), {"mu": "fp4"})
    with pytest.raises(ValueError, match="'count' is int32.*floating states only"):
        low_precision_state(optax.adam(1e-3), {"count": "fp8"}).init({"w": jnp.ones(2)})
    with pytest.raises(ValueError, match="'momentum' name no floating.*'mu', 'nu'"):
        low_precision_state(optax.adam(1e-3), {"momentum": "fp8"}).init({"w": jnp.ones(2)})
    with pytest.raises(ValueError, match="block_size=128 applies to the scaled formats"):
        StateFormat("bf16", block_size=128)
    with pytest.raises(ValueError, match="needs bfloat16 parameters"):
        jamp.mixed_precision("bf16", master_weights="remainders")
    with pytest.raises(ValueError, match="Unknown master_weights 'halves'"):
        jamp.mixed_precision("bf16_lowmem", master_weights="halves")
    with pytest.raises(ValueError, match="Unknown optimizer_state 'int8'"):
        jamp.mixed_precision("bf16", optimizer_state="int8")
    with pytest.raises(ValueError, match="works on bfloat16 parameters"):
        bf16_master(optax.sgd(0.1), "remainders").init({"w": jnp.ones(2, jnp.float16)})


def test_a_recipe_with_a_state_mapping_stays_hashable_and_builds():
    mp = jamp.mixed_precision("bf16_lowmem", optimizer_state={"mu": "fp8", "nu": "bf16"})
    assert hash(mp) == hash(jamp.mixed_precision(mp))
    state = jamp.make_optimizer(mp, optax.adam(1e-3)).init({"w": jnp.ones((3, 4),
                                                                          jnp.bfloat16)})
    assert jamp.optim_state.stored_dtypes(state) == {"mu": "float8_e4m3fn", "nu": "bfloat16"}


# -------------------------------------------------------------------- master weights


def test_remainders_split_and_join_exactly():
    x = jax.random.normal(jax.random.key(2), (4096,)) * jnp.exp(
        jax.random.uniform(jax.random.key(3), (4096,), minval=-60, maxval=60))
    ties = jnp.array([1 + 2**-8, -(1 + 2**-8), 1 + 3 * 2**-8, 0.0, -0.0, 2.0**-130])
    x = jnp.concatenate([x, ties]).astype(jnp.float32)
    p, r = split_remainders(x)
    assert p.dtype == jnp.bfloat16 and r.dtype == jnp.uint16
    assert _same_bits(join_remainders(p, r), x)


def _run_master(scheme, steps, lr=1e-3, seed=0):
    params = {"w": (jax.random.normal(jax.random.key(4), (32, 16))).astype(jnp.bfloat16),
              "norm": jnp.ones(16)}
    tx = bf16_master(optax.adamw(lr, weight_decay=0.1), scheme, seed=seed)
    state = tx.init(params)

    @jax.jit
    def run(params, state):
        def body(i, carry):
            params, state = carry
            g = jax.tree_util.tree_map(
                lambda p: (jax.random.normal(jax.random.fold_in(jax.random.key(5), i), p.shape)
                           + p.astype(jnp.float32)).astype(p.dtype), params)
            u, state = tx.update(g, state, params)
            return optax.apply_updates(params, u), state
        return jax.lax.fori_loop(0, steps, body, (params, state))

    params, state = run(params, state)
    return params, state, jamp.optim_state.master_view(state, params)


def test_remainders_are_bit_identical_to_a_float32_master_over_many_steps():
    p32, _, m32 = _run_master("float32", 500)
    prem, srem, mrem = _run_master("remainders", 500)
    assert srem.master["w"].dtype == jnp.uint16
    assert _same_bits(prem, p32) and _same_bits(mrem, m32)
    assert not _same_bits(_run_master("kahan", 500)[0], p32)  # the test can tell


def test_updates_below_half_an_ulp_vanish_without_a_master():
    """lr 1e-4 on parameters near 1 (bf16 ulp 2**-7): each step moves < half an ulp."""
    params = {"w": jnp.ones(4096, jnp.bfloat16)}
    grads = {"w": jnp.ones(4096, jnp.bfloat16)}
    moved = {}
    for scheme in ("none", "stochastic", "kahan", "remainders"):
        tx = bf16_master(optax.sgd(1e-4), scheme)
        p, s = params, tx.init(params)
        step = jax.jit(lambda p, s, tx=tx: (lambda u, s: (optax.apply_updates(p, u), s))(
            *tx.update(grads, s, p)))
        for _ in range(100):
            p, s = step(p, s)
        moved[scheme] = float(jnp.mean(1.0 - p["w"].astype(jnp.float32)))
    assert moved["none"] == 0.0                       # every update lost
    for scheme in ("stochastic", "kahan", "remainders"):  # 100 * 1e-4 = 0.01 on average
        assert abs(moved[scheme] - 0.01) < 0.002, (scheme, moved)


def test_stochastic_rounding_is_deterministic_from_the_seed_and_sharding_free():
    a, _, _ = _run_master("stochastic", 20, seed=1)
    b, _, _ = _run_master("stochastic", 20, seed=1)
    c, _, _ = _run_master("stochastic", 20, seed=2)
    assert _same_bits(a, b) and not _same_bits(a, c)
    # Split over 8 devices (ZeRO-3 style): every shard draws the bits of the whole leaf.
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    params = {"w": jnp.ones((64, 8), jnp.bfloat16)}
    tx = bf16_master(optax.sgd(1e-3), "stochastic", seed=3)
    grads = {"w": jax.random.normal(jax.random.key(6), (64, 8)).astype(jnp.bfloat16)}
    step = jax.jit(lambda p, s, g: tx.update(g, s, p)[0])
    one = step(params, tx.init(params), grads)
    shard = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    sharded_p = jax.device_put(params, shard)
    split = step(sharded_p, tx.init(sharded_p), jax.device_put(grads, shard))
    assert len(split["w"].sharding.device_set) == 8
    assert _same_bits(one, split)


# ------------------------------------------------------------ loss scale, boost, ZeRO


@pytest.mark.parametrize("mode,select", [("bf16_lowmem_exact", False),
                                         ("bf16_lowmem_exact", True), ("bf16_lowmem", True)])
def test_a_skipped_step_leaves_quantized_state_scales_and_remainders_bit_identical(
        mode, select, monkeypatch):
    # Both forms of the skip (a select on one device, a conditional on several).
    monkeypatch.setattr(importlib.import_module("jamp.loss_scale"), "_skip_by_select",
                        lambda: select)
    mp = jamp.mixed_precision(mode, loss_scale="dynamic", init_scale=2.0**8)
    tx = jamp.make_optimizer(mp, optax.adamw(1e-3))
    params = {"w": jax.random.normal(jax.random.key(7), (8, 256)).astype(jnp.bfloat16)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    grads = jax.tree_util.tree_map(lambda p: p * 256, params)
    u, state = update(grads, state, params)  # a real step first: nonzero state and scales
    params = optax.apply_updates(params, u)
    assert any(float(jnp.max(q.scale)) != 1.0 for q in _quantized(state))
    bad = {"w": grads["w"].at[0, 0].set(jnp.inf)}
    u, skipped = update(bad, state, params)
    assert float(jamp.loss_scale(skipped)) == 128.0
    assert _same_bits(optax.apply_updates(params, u), params)
    assert _same_bits(_quantized(skipped), _quantized(state))
    # The whole master-weight state (remainders, step count, inner state) stays as it was.
    rem = lambda s: [x for x in jax.tree_util.tree_leaves(
        s, is_leaf=lambda t: isinstance(t, jamp.optim_state.Bf16MasterState))
        if isinstance(x, jamp.optim_state.Bf16MasterState)]
    assert _same_bits(rem(skipped), rem(state))


def _boosted(mode, **kw):
    model = nn.Sequential([nn.Dense(64), nn.relu, nn.Dense(8)])
    loss = lambda y, t: optax.softmax_cross_entropy_with_integer_labels(
        y.astype(jnp.float32), t).mean()
    return jamp.boost(model, optax.adamw(1e-2), loss, mode, **kw)


BATCH = (jax.random.normal(jax.random.key(8), (16, 32)), jnp.arange(16) % 8)


def test_zero3_splits_the_small_states_and_checkpoints_resume_bit_exact():
    boosted = _boosted("bf16_lowmem_exact", mesh={"data": 8}, zero_stage=3)
    state = boosted.init(jax.random.key(0), BATCH)
    state, _ = boosted.step(state, BATCH)
    per = jamp.memory.per_device_bytes(state.params, state.opt_state)
    n = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
    # bf16 params 2 B, remainders 2 B, fp8 mu 1 B + fp16 nu 2 B (biases: replicated, small).
    # The remainders count as the master copy: 2 B per bf16 parameter, split 8 ways.
    assert 0.9 * 2 * n / 8 <= per.master <= 2 * n / 8 + 2 * 8  # (the 8-wide bias stays whole)
    assert per.params + per.grads + per.opt_state + per.master < 1.3 * 9 * n / 8
    mu = [q for q in _quantized(state.opt_state) if q.value.dtype == jnp.float8_e4m3fn]
    assert any(len(q.value.sharding.device_set) == 8 and q.value.addressable_shards[0]
               .data.shape[0] * 8 == q.value.shape[0] for q in mu)
    path = os.path.join(tempfile.mkdtemp(), "ckpt")
    boosted.save(path, state)
    restored = boosted.restore(path)
    assert _same_bits(restored, state)
    a, _ = boosted.step(state, BATCH)
    b, _ = boosted.step(restored, BATCH)
    assert _same_bits(a.params, b.params) and _same_bits(a.opt_state, b.opt_state)
    # A float32-state checkpoint into this low-precision run: one message naming both.
    plain = _boosted("bf16_pure", mesh={"data": 8}, zero_stage=3)
    path32 = os.path.join(tempfile.mkdtemp(), "ckpt32")
    plain.save(path32, plain.init(jax.random.key(0), BATCH))
    with pytest.raises(ValueError, match="holds float32 optimizer state.*stores low-precision"):
        boosted.restore(path32)
    with pytest.raises(ValueError, match="holds low-precision .*stores float32 optimizer state"):
        plain.restore(path)  # and back


def test_nnx_optimizer_with_low_precision_state_and_remainders():
    model = nnx.Linear(16, 4, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
    tx = jamp.make_optimizer("bf16_lowmem_exact", optax.adamw(1e-2))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    x = jnp.ones((2, 16), jnp.bfloat16)

    @nnx.jit
    def step(model, opt):
        grads = nnx.grad(lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2))(model)
        opt.update(model, grads)

    before = model.kernel[...]
    step(model, opt)
    assert model.kernel[...].dtype == jnp.bfloat16
    assert not _same_bits(before, model.kernel[...])
    dtypes = {str(x.dtype) for x in jax.tree_util.tree_leaves(nnx.as_pure(opt.opt_state))}
    assert {"float8_e4m3fn", "float16", "uint16"} <= dtypes  # mu, sqrt(nu), remainders


# --------------------------------------------------------------------------- jamp.train

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "configs", "vit_fp16.py")
SMALL = ["--config.num_layers=1", "--config.hidden_size=16", "--config.num_heads=2",
         "--config.mlp_dim=32", "--config.mesh.data=1"]


def _train(capsys, *args):
    from jamp import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(["jamp.train", f"--config={CONFIG}", *SMALL, *args])
    return exit_.value.code, capsys.readouterr().err


@pytest.mark.parametrize("args,needle", [
    (["--config.mode=bf16", "--config.master_weights=remainders"], "needs bfloat16 parameters"),
    (["--config.optimizer_state=int8"], "Unknown optimizer_state 'int8'"),
    (["--config.optimizer_state=mu=fp4"], "Unknown optimizer-state dtype 'fp4'"),
    (["--config.mode=bf16_lowmem", "--config.master_weights=halves"],
     "Unknown master_weights 'halves'"),
])
def test_train_bad_state_precision_one_line_exit_2_nothing_written(tmp_path, capsys, args,
                                                                   needle):
    status, err = _train(capsys, *args, f"--workdir={tmp_path / 'run'}")
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1 and needle in lines[0], err
    assert lines[0].startswith("jamp.train: error: --config.mode"), err
    assert not (tmp_path / "run").exists()


def test_train_runs_a_low_memory_mode_with_a_custom_state(tmp_path, capsys):
    import json

    status, err = _train(capsys, "--config.mode=bf16_lowmem_exact", "--config.max_steps=2",
                         "--config.optimizer_state=mu=fp8,nu=bf16", "--config.plot=false",
                         "--config.progress=false", f"--workdir={tmp_path / 'run'}")
    assert status in (0, None), err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["steps"], summary["mode"]) == (2, "bf16_lowmem_exact")
    per_device = summary["memory"]["per_device"]
    # bf16 params (2 B); fp8 mu + bf16 nu (3 B): float32 moments would be 4x the params.
    assert per_device["master"] > 0 and per_device["opt_state"] < 2.5 * per_device["params"]
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (config["optimizer_state"], config["master_weights"]) == ("mu=fp8,nu=bf16", None)


def test_fp8_matmuls_and_accumulation_with_small_state():
    mp = jamp.mixed_precision("fp8", policy="p=bf16,c=bf16,o=f32", optimizer_state="fp8",
                              master_weights="remainders")
    boosted = _boosted(mp, accumulate=2)
    state = boosted.init(jax.random.key(0), BATCH)
    for _ in range(2):
        state, metrics = boosted.step(state, BATCH)
    assert not bool(metrics["skipped"]) and np.isfinite(float(metrics["loss"]))
    assert state.params["layers_0"]["kernel"].dtype == jnp.bfloat16
    assert "float8_e4m3fn" in jamp.optim_state.stored_dtypes(state.opt_state).values()


def test_the_guide_runs():
    import pathlib
    import re

    guide = (pathlib.Path(__file__).parents[1] / "docs/guides/optimizer_state.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", guide, re.S)
    assert len(blocks) == 2
    for code in blocks:
        scope: dict = {}
        exec(compile(code, "docs/guides/optimizer_state.md", "exec"), scope)
    assert scope["opt_state"] is not None
