"""Float32 accumulation in every step jamp builds or wraps (issue 23, item 1).

JAX's autodiff transposes each broadcast of the forward pass (a bias add, a
norm's mean, a mask) into a ``reduce_sum`` of the cotangent in its own dtype, so
half-precision gradients used to be summed in half precision. Under
``jax_allow_f16_reductions=False`` such a sum raises at trace time; every half
mode with float32 rules (fp16, bf16, fp16_naive, fp8, fp8_current) must trace
under it:

- the trainer's step (linen and NNX ViT, single device and data/model/pipe
  meshes), and its jaxpr has no sum or all-reduce of a half-precision value;
- ``jax.grad`` through third-party-style linen models under ``apply_policy``
  (tests/test_any_model.py's models) and NNX models;
- ``jax.grad`` through functions under ``jamp.autocast``;
- and the values: a bias gradient summed over 16384 examples equals the float32
  sum to within one rounding of the final cast (a half-precision running sum is
  off by far more).
"""

from __future__ import annotations

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jaxpr_utils import iter_eqns
from test_any_model import CASES, _batch
from test_autocast import LABELS, MODEL, X
from test_autocast import loss_fn as transformer_loss

import jamp
from jamp import experiment, parallel, train
from jamp.config import vit_config

SAFE = ("fp16", "bf16", "fp16_naive", "fp8", "fp8_current")
HALF = ("float16", "bfloat16")
SUMS = ("reduce_sum", "cumsum", "reduce_window_sum", "psum", "psum_invariant",
        "reduce_scatter", "psum_scatter")
MESHES = {"single": (1, 1, 1), "data": (2, 1, 1), "model": (1, 2, 1), "pipe": (1, 1, 2)}


def half_sums(closed) -> list[str]:
    """Every sum (or all-reduce) of a half-precision operand, nested jaxprs included."""
    return [f"{e.primitive.name}{[str(v.aval) for v in e.invars]}" for e in iter_eqns(closed)
            if e.primitive.name in SUMS
            and any(str(getattr(v.aval, "dtype", "")) in HALF for v in e.invars)]


@contextlib.contextmanager
def no_half_reductions():
    with jax.allow_f16_reductions(False):
        yield


# ----------------------------------------------------------------------------- trainer


def _tiny(mode: str, mesh: tuple[int, int, int], framework: str):
    config = vit_config(mode)
    config.num_layers, config.hidden_size, config.num_heads, config.mlp_dim = 2, 16, 2, 32
    config.batch_size, config.pipeline_microbatches = 8, 2
    config.optimizer, config.progress, config.plot = "sgd", False, False
    config.mesh.data, config.mesh.model, config.mesh.pipe = mesh
    config.framework = framework
    return config


TRAINER = [(fw, mode, "single") for fw in ("linen", "nnx") for mode in SAFE] + [
    (fw, mode, mesh) for fw in ("linen", "nnx") for mode in ("fp16", "fp8")
    for mesh in ("data", "model", "pipe")] + [("linen", "fp16_naive", "data")]


@pytest.mark.parametrize(("framework", "mode", "mesh"), TRAINER)
def test_trainer_step_has_no_half_precision_sum(framework, mode, mesh):
    exp = experiment.build_experiment(_tiny(mode, MESHES[mesh], framework))
    rng = jax.random.key(0)
    with jax.set_mesh(exp.mesh):
        _, shardings = experiment.state_shardings(exp, rng)
        state = jax.eval_shape(lambda: experiment.init_state(exp, rng, shardings))
    batch = {"image": jax.ShapeDtypeStruct((8, 8, 8, 1), jnp.float32),
             "label": jax.ShapeDtypeStruct((8,), jnp.int32)}
    with jax.set_mesh(exp.mesh), nn.logical_axis_rules(parallel.LOGICAL_AXIS_RULES), \
            no_half_reductions():
        traced = train.jit_train_step(exp, shardings).trace(state, batch, rng)
    assert half_sums(traced.jaxpr) == []


# ----------------------------------------------------------------------------- any model


@pytest.mark.parametrize("mode", ("fp16", "bf16", "fp8_current"))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_third_party_linen_models_under_apply_policy(case, mode):
    model = jamp.apply_policy(case.module(), mode)
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in case.inputs]
    variables = model.lazy_init(jax.random.key(0), *shapes)
    batch = _batch(case)

    def loss(params):
        out = model.apply({**variables, "params": params}, *case.inputs,
                          mutable=list(case.mutable))[0]
        return case.loss(out, batch)

    with no_half_reductions():
        closed = jax.make_jaxpr(jax.grad(loss))(variables["params"])
    assert half_sums(closed) == []


class NnxNet(nnx.Module):
    """An NNX model: conv, BatchNorm, attention with a mask, LayerNorm, Dense with bias."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv = nnx.Conv(1, 8, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(2, 8, 8, decode=False, rngs=rngs)
        self.ln = nnx.LayerNorm(8, rngs=rngs)
        self.head = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.bn(self.conv(x))).reshape(x.shape[0], -1, 8)
        mask = nnx.make_causal_mask(jnp.ones(h.shape[:2]))
        h = self.ln(h + self.attn(h, mask=mask))
        return self.head(h.mean(1))


@pytest.mark.parametrize("mode", SAFE)
def test_nnx_model_under_apply_policy(mode):
    model = jamp.apply_policy(NnxNet(nnx.Rngs(0)), mode)
    loss = lambda m: jnp.mean(m(jnp.ones((2, 4, 4, 1))).astype(jnp.float32) ** 2)
    with no_half_reductions():
        closed = jax.make_jaxpr(lambda m: nnx.grad(loss)(m))(model)
    assert half_sums(closed) == []


# ----------------------------------------------------------------------------- autocast


def mlp_layer_norm(params, x):
    """An MLP with biases and a LayerNorm written with jnp."""
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    mean = h.mean(-1, keepdims=True)
    h = (h - mean) / jnp.sqrt(((h - mean) ** 2).mean(-1, keepdims=True) + 1e-5)
    return jnp.mean((h * params["g"] @ params["w2"] + params["b2"]) ** 2)


MLP_PARAMS = {"w1": jnp.ones((4, 8)) / 4, "b1": jnp.zeros(8), "g": jnp.ones(8),
              "w2": jnp.ones((8, 3)), "b2": jnp.zeros(3)}


@pytest.mark.parametrize("mode", ("fp16", "bf16", "fp16_naive", "fp8_current"))
def test_autocast_functions(mode):
    with no_half_reductions():
        mlp = jax.make_jaxpr(jax.grad(jamp.autocast(mlp_layer_norm, mode)))(
            MLP_PARAMS, jnp.ones((16, 4)))
        transformer = jax.make_jaxpr(jax.grad(jamp.autocast(transformer_loss, mode)))(
            MODEL, X, LABELS)
    assert half_sums(mlp) == [] and half_sums(transformer) == []


# ----------------------------------------------------------------------------- values

N = 16384  # examples: a half-precision running sum of them loses many bits
G = np.random.default_rng(0).uniform(0.5, 1.5, (N, 2)).astype(np.float32) / 8  # d loss/d out


def _within_one_rounding(grad, reference, dtype):
    """``grad`` is ``reference`` rounded once to ``dtype`` (up to one unit in the last place)."""
    ulp = np.asarray([float(jnp.finfo(dtype).eps) * 2.0 ** np.floor(np.log2(abs(r)))
                      for r in reference])
    np.testing.assert_array_less(np.abs(np.asarray(grad, np.float32) - reference), ulp * 1.01)


@pytest.mark.parametrize("mode", ("fp16", "bf16", "fp16_naive"))
def test_bias_gradient_summed_in_float32(mode):
    model = jamp.apply_policy(nn.Dense(2), mode)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(N, 3)), jnp.float32)
    params = model.init(jax.random.key(0), x[:1])["params"]
    loss = lambda p: jnp.sum(model.apply({"params": p}, x).astype(jnp.float32) * G)
    with no_half_reductions():
        grad = jax.jit(jax.grad(loss))(params)["bias"]
    reference = G.astype(jnp.dtype(jamp.mixed_precision(mode).policy.compute_dtype)).astype(
        np.float32).sum(0)
    _within_one_rounding(grad, reference, jamp.mixed_precision(mode).policy.compute_dtype)


@pytest.mark.parametrize("mode", ("fp16", "bf16"))
def test_autocast_bias_gradient_summed_in_float32(mode):
    def f(b, x):
        return jnp.sum((x + b) * G)  # the transpose of the broadcast of b: a sum over N

    dtype = jamp.mixed_precision(mode).policy.compute_dtype
    with no_half_reductions():
        grad = jax.jit(jax.grad(jamp.autocast(f, mode)))(jnp.zeros(2), jnp.zeros((N, 2)))
    # autocast computes (x + b) * G in half precision: G rounds to it, the sum is float32.
    reference = G.astype(jnp.dtype(dtype)).astype(np.float32).sum(0)
    _within_one_rounding(grad, reference, dtype)


def test_data_parallel_all_reduces_half_gradients_in_float32():
    """fp16_naive keeps float16 parameters: their gradients are all-reduced in float32."""
    mesh = parallel.make_mesh({"data": 2, "model": 1, "pipe": 1})
    w = jnp.ones(2, jnp.float16)
    batch = {"x": jnp.asarray(G)}
    loss = lambda w, b: (jnp.sum(b["x"] * w.astype(jnp.float32)), {})
    grad_fn = parallel.data_parallel.value_and_grad(loss)
    with jax.set_mesh(mesh), no_half_reductions():
        closed = jax.make_jaxpr(grad_fn)(w, batch)
        (_, _), grad = jax.jit(grad_fn)(w, batch)
    psums = [str(v.aval.dtype) for e in iter_eqns(closed) if e.primitive.name.startswith("psum")
             for v in e.invars]
    assert grad.dtype == jnp.float16 and "float32" in psums and half_sums(closed) == []
    _within_one_rounding(grad, G.sum(0) / 2, jnp.float16)
