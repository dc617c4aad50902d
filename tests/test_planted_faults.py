"""Faults that once passed the whole suite unseen (issue 22, item 7): one direct test each.

Each test names the wrong result a user would get silently and fails when that
fault is planted: the CLI's exit status for a non-finite loss, float16 gradient
bytes, autocast inside ``cond``/``switch``/``while`` (forward and backward), the
fp8 gradient history of ``fp8_pending`` following the loss scale, the dtype an
overridden linen module returns into the model, fp16 params equal to the master
copy after every step, current scaling's amax of a negative-dominated tensor, and
the float32 norms kept under a path override. Only public names are used.
"""

from __future__ import annotations

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from jaxpr_utils import iter_eqns

import jamp
from jamp import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------- 1. exit status 3, non-finite loss


def test_cli_exits_3_when_the_loss_goes_non_finite_without_a_loss_scale(tmp_path, capsys):
    """fp32 applies every update: a learning rate of 1e30 makes the loss inf/NaN by step 2,
    and the command stops with status 3 (like a diverged loss scale), not 2 (a config error)."""
    args = ["jamp.train", f"--config={os.path.join(REPO, 'configs', 'vit_fp32.py')}",
            f"--workdir={tmp_path / 'run'}", "--config.learning_rate=1e30",
            "--config.warmup_steps=0", "--config.max_steps=4", "--config.log_every_steps=2",
            "--config.num_layers=1", "--config.hidden_size=8", "--config.num_heads=2",
            "--config.mlp_dim=8", "--config.batch_size=8", "--config.mesh.data=1",
            "--config.progress=False", "--config.plot=False"]
    with pytest.raises(SystemExit) as exit_:
        cli.main(args)
    err = capsys.readouterr().err
    assert exit_.value.code == 3, err[-2000:]
    assert "non-finite" in err and "Traceback" not in err


# ------------------------------------------------------------- 2. memory_report, half gradients


def test_memory_report_counts_each_gradient_in_its_parameters_dtype():
    params = {"h": jnp.ones((4, 4), jnp.float16), "b": jnp.ones((8,), jnp.bfloat16),
              "f": jnp.ones((3,), jnp.float32)}
    loss = lambda p, x: (x @ p["h"]).astype(jnp.float32).sum() + p["b"].sum() + p["f"].sum()
    report = jamp.memory_report(loss, params, jnp.ones((2, 4), jnp.float16))
    assert report.grads_bytes == 16 * 2 + 8 * 2 + 3 * 4 == report.params_bytes


# ------------------------------------------------------------- 3. autocast in control flow


def _dot_dtypes(closed) -> list[tuple[str, ...]]:
    return [tuple(str(v.aval.dtype) for v in e.invars) for e in iter_eqns(closed)
            if e.primitive.name == "dot_general"]


def _branchy(x, w):
    y = jax.lax.cond(x.sum() > 0, lambda x: jnp.tanh(x @ w), lambda x: x @ (2 * w), x)
    return jax.lax.switch(1, [lambda y: y @ w, lambda y: jnp.sin(y @ w), lambda y: -y], y).sum()


def _looped(x, w):  # a while loop (not reverse-differentiable): forward only
    y = jax.lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, x))
    return _branchy(y[1], w)


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_autocast_matmuls_inside_cond_switch_and_while_forward_and_backward(mode):
    x, w = jnp.linspace(0.1, 1.2, 12).reshape(3, 4), jnp.linspace(-0.3, 0.6, 16).reshape(4, 4)
    half = str(jnp.dtype(jamp.mixed_precision(mode).policy.compute_dtype))
    forward = jax.make_jaxpr(jamp.autocast(_looped, mode))(x, w)
    assert sorted(e.primitive.name for e in iter_eqns(forward)
                  if e.primitive.name in ("cond", "while")) == ["cond", "cond", "while"]
    assert len(_dot_dtypes(forward)) == 5  # 2 in cond's branches, 2 in switch's, 1 in while's
    fast = jamp.autocast(_branchy, mode)
    backward = _dot_dtypes(jax.make_jaxpr(jax.grad(fast, argnums=(0, 1)))(x, w))
    assert len(backward) == 3 * 4  # each branch's dot, its two transposes
    assert {d for dots in (_dot_dtypes(forward), backward) for op in dots for d in op} == {half}
    np.testing.assert_allclose(jamp.autocast(_looped, mode)(x, w), _looped(x, w), rtol=0.05)
    for ours, exact in zip(jax.grad(fast, argnums=(0, 1))(x, w),
                           jax.grad(_branchy, argnums=(0, 1))(x, w), strict=True):
        np.testing.assert_allclose(ours, exact, rtol=0.05, atol=0.05)


# ------------------------------------------------------------- 4. fp8 history follows the scale


def test_follow_loss_scale_rescales_both_fp8_and_fp8_pending():
    meta = dict(jamp.fp8.init_meta(2), output_grad_amax_history=jnp.array([3.0, 1.0]),
                input_amax_history=jnp.array([5.0, 4.0]))
    s = jamp.fp8.TrainState.create(apply_fn=None, params={}, tx=optax.sgd(0.1),
                                   fp8={"layer": {"dense": meta}})
    s = s.replace(fp8_pending={"layer": {"dense": dict(
        meta, output_grad_amax_history=jnp.array([7.0, 2.0]))}})
    out = jamp.fp8.follow_loss_scale(s, jnp.float32(0.5))
    assert out.fp8["layer"]["dense"]["output_grad_amax_history"].tolist() == [1.5, 0.5]
    assert out.fp8_pending["layer"]["dense"]["output_grad_amax_history"].tolist() == [3.5, 1.0]
    for tree in (out.fp8, out.fp8_pending):  # the forward histories are not loss-scaled
        assert tree["layer"]["dense"]["input_amax_history"].tolist() == [5.0, 4.0]


# ------------------------------------------------------------- 5. overridden modules' outputs


_SEEN: list = []  # what the modules below record at trace time


class _RecordingNorm(nn.LayerNorm):
    """A LayerNorm (so the norm override applies) that records the dtypes it runs with."""

    @nn.compact
    def __call__(self, x, *args, **kwargs):
        _SEEN.append(("norm input", str(x.dtype), str(jnp.dtype(self.dtype))))
        return super().__call__(x, *args, **kwargs)


class _NormNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8)(x)
        n = _RecordingNorm()(h)
        _SEEN.append(("norm output", str(n.dtype)))
        return nn.Dense(2, name="head")(h + n)


def _norm_dtypes(mp) -> list:
    model = jamp.apply_policy(_NormNet(), mp)
    variables = model.init(jax.random.key(0), jnp.ones((2, 4)))
    _SEEN.clear()
    jax.make_jaxpr(model.apply)(variables, jnp.ones((2, 4)))
    return list(_SEEN)


@pytest.mark.parametrize("mode", ["fp16", "bf16", "fp16_naive"])
def test_an_overridden_linen_norm_runs_float32_and_returns_the_models_compute_dtype(mode):
    half = str(jnp.dtype(jamp.mixed_precision(mode).policy.compute_dtype))
    assert _norm_dtypes(mode) == [("norm input", "float32", "float32"), ("norm output", half)]


# ------------------------------------------------------------- weak 1: fp16 params = master


class _Tiny(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        return nn.Dense(3)(nn.LayerNorm()(nn.Dense(8)(x.reshape(x.shape[0], -1))))


def test_fp16_naive_linen_params_equal_the_master_copy_after_every_step():
    mp = jamp.mixed_precision("fp16_naive", init_scale=2.0**4)
    model = jamp.apply_policy(_Tiny(), mp)
    batch = {"image": jax.random.normal(jax.random.key(0), (8, 2, 2, 1)),
             "label": jnp.arange(8) % 3}
    params = model.init(jax.random.key(1), batch["image"])["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                          tx=jamp.make_optimizer(mp, optax.sgd(0.5)))
    step = jax.jit(jamp.train_step)
    previous = jamp.master_params(state.opt_state)
    for i in range(3):
        state, metrics = step(state, batch, jax.random.key(i))
        assert bool(metrics["grad_finite"])
        master = jamp.master_params(state.opt_state)
        for p, m in zip(jax.tree_util.tree_leaves(state.params),
                        jax.tree_util.tree_leaves(master), strict=True):
            if p.dtype == jnp.float16:  # the norm's params stay float32 (its override)
                np.testing.assert_array_equal(p, m.astype(jnp.float16))
            else:
                np.testing.assert_array_equal(p, m)
        kernel = master["Dense_0"]["kernel"]  # the step moved it by more than f16 rounding
        assert float(jnp.max(jnp.abs(kernel - previous["Dense_0"]["kernel"]))) > 1e-2
        previous = master


# ------------------------------------------------------------- weak 2: amax of |x|


def test_current_scaling_takes_the_amax_of_magnitudes_negative_values_included():
    x = jnp.array([-896.0, -3.0, 1.0])
    assert float(jamp.fp8.tensor_scale(x, jamp.fp8.E4M3)) == 2.0
    assert float(jamp.fp8.tensor_scale(-jnp.ones(3), jamp.fp8.E4M3)) == pytest.approx(1 / 448)
    lhs = jnp.array([[-1000.0, 1.0], [-500.0, 2.0]])
    rhs = jnp.array([[1.0, -2.0], [1.0, 3.0]])
    dims = (((1,), (0,)), ((), ()))
    np.testing.assert_allclose(jamp.fp8.current_scaling_dot_general(lhs, rhs, dims), lhs @ rhs,
                               rtol=0.07)
    # Backward: a cotangent whose largest magnitude is negative (-1e5 > E5M2's 57344).
    ct = jnp.array([[-1e5, 1.0], [2.0, -3.0]])
    f = lambda a, b, dot: (dot(a, b) * ct).sum()
    ours = jax.grad(f, argnums=(0, 1))(lhs, rhs, lambda a, b: jamp.fp8.current_scaling_dot_general(
        a, b, dims))
    exact = jax.grad(f, argnums=(0, 1))(lhs, rhs, jnp.matmul)
    for a, b in zip(ours, exact, strict=True):
        np.testing.assert_allclose(a, b, rtol=0.15, atol=1e-3 * float(jnp.max(jnp.abs(b))))


# ------------------------------------------------------------- weak 3: path override + norms


@pytest.mark.parametrize("mode", ["fp16", "bf16"])
def test_a_path_override_keeps_the_modes_float32_norms(mode):
    mp = jamp.mixed_precision(mode, overrides={"head": "p=f32,c=f32,o=f32"})
    half = str(jnp.dtype(mp.policy.compute_dtype))
    assert _norm_dtypes(mp) == [("norm input", "float32", "float32"), ("norm output", half)]
    # ... and the path override itself applies: the head's matmul runs in float32.
    model = jamp.apply_policy(_NormNet(), mp)
    variables = model.init(jax.random.key(0), jnp.ones((2, 4)))
    dots = _dot_dtypes(jax.make_jaxpr(model.apply)(variables, jnp.ones((2, 4))))
    assert dots == [(half, half), ("float32", "float32")]
