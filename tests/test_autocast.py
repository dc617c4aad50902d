"""``jamp.autocast``: a policy for any JAX function, checked in the jaxpr (issue 12, item 7)."""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from jaxpr_utils import iter_eqns

import jamp

FLOAT32_OPS = ("fp16", "bf16", "fp16_naive")
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


# ----------------------------------------------------------------------------- Equinox-style


def _pytree(cls):
    """A frozen dataclass whose fields are pytree children (as Equinox modules are)."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    return jax.tree_util.register_dataclass(
        cls, data_fields=[f.name for f in dataclasses.fields(cls)], meta_fields=[])


@_pytree
class Linear:
    weight: jax.Array
    bias: jax.Array

    def __call__(self, x):
        return x @ self.weight + self.bias


def _linear(key, n_in, n_out, layers=()):
    w = jax.random.normal(key, (*layers, n_in, n_out)) / np.sqrt(n_in)
    return Linear(w, jnp.zeros((*layers, n_out)))


def layer_norm(x, scale, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * scale


@_pytree
class Block:
    qkv: Linear
    out: Linear
    up: Linear
    down: Linear
    scale: jax.Array

    def __call__(self, x):
        q, k, v = jnp.split(self.qkv(layer_norm(x, self.scale)), 3, axis=-1)
        attention = jax.nn.softmax(q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1]), axis=-1)
        x = x + self.out(attention @ v)
        return x + self.down(jax.nn.gelu(self.up(layer_norm(x, self.scale))))


@_pytree
class Transformer:
    embed: Linear
    blocks: Block  # stacked along a leading layer axis, run with lax.scan
    head: Linear

    def __call__(self, x):
        h = self.embed(x)
        h, _ = jax.lax.scan(lambda h, block: (block(h), None), h, self.blocks)
        return self.head(h.mean(1))


def make_transformer(key, dim=8, layers=2, classes=3) -> Transformer:
    k = jax.random.split(key, 6)
    blocks = Block(_linear(k[0], dim, 3 * dim, (layers,)), _linear(k[1], dim, dim, (layers,)),
                   _linear(k[2], dim, 2 * dim, (layers,)), _linear(k[3], 2 * dim, dim, (layers,)),
                   jnp.ones((layers, dim)))
    return Transformer(_linear(k[4], 4, dim), blocks, _linear(k[5], dim, classes))


def loss_fn(model: Transformer, x, labels):
    """Cross-entropy written with jax.nn.log_softmax, inside the autocast function."""
    logp = jax.nn.log_softmax(model(x), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))


X = jax.random.normal(jax.random.key(1), (4, 5, 4))
LABELS = jnp.array([0, 1, 2, 1])
MODEL = make_transformer(jax.random.key(0))


def _operands(closed, names) -> Counter:
    return Counter(str(v.aval.dtype) for e in iter_eqns(closed) if e.primitive.name in names
                   for v in e.invars)


@functools.cache
def _jaxprs(mode: str):
    fast = jamp.autocast(loss_fn, mode)
    return (jax.make_jaxpr(fast)(MODEL, X, LABELS),
            jax.make_jaxpr(jax.grad(fast))(MODEL, X, LABELS))


@pytest.mark.parametrize("mode", jamp.MODES)
def test_matmuls_in_compute_dtype_forward_and_backward(mode):
    compute = str(jnp.dtype(jamp.mixed_precision(mode).policy.compute_dtype))
    for closed in _jaxprs(mode):
        dots = _operands(closed, ("dot_general",))
        assert dots and set(dots) == {compute}, dots


@pytest.mark.parametrize("mode", FLOAT32_OPS)
def test_softmax_log_norm_statistics_and_sums_in_float32(mode):
    forward, backward = _jaxprs(mode)
    for closed in (forward, backward):  # the backward recomputes them (remat)
        operands = _operands(closed, ("exp", "log", "rsqrt"))
        assert operands and set(operands) == {"float32"}, operands
    for ops in (("integer_pow",), ("reduce_sum",)):  # squares and sums of the forward
        assert set(_operands(forward, ops)) == {"float32"}, ops


@pytest.mark.parametrize("mode", ["fp16_pure", "bf16_pure"])
def test_pure_modes_cast_without_float32_rules(mode):
    compute = str(jnp.dtype(jamp.mixed_precision(mode).policy.compute_dtype))
    assert set(_operands(_jaxprs(mode)[0], ("exp", "rsqrt"))) == {compute}


def _rms_norm_by_sqrt(x, w, g, eps):
    """An RMS norm written ``h / sqrt(mean(h * h) + eps)`` (no ``rsqrt``) after a matmul."""
    h = x @ w
    return h / jnp.sqrt(jnp.mean(h * h, -1, keepdims=True) + eps) * g


@pytest.mark.parametrize("scale,eps", [(300.0, 1e-6), (1e-4, 1e-12)])
def test_rms_norm_written_with_sqrt_and_div_runs_its_statistics_in_float32(scale, eps):
    """300**2 = 9e4 overflows float16 (the norm returned zeros), 1e-4**2 and eps = 1e-12
    underflow it (inf): the division by ``sqrt`` is a normalisation like ``* rsqrt``."""
    x, w, g = jnp.linspace(0.5, 1.5, 16).reshape(2, 8), scale * jnp.eye(8), jnp.ones(8)
    norm = functools.partial(_rms_norm_by_sqrt, eps=eps)
    fast = jamp.autocast(norm, "fp16")
    closed = jax.make_jaxpr(fast)(x, w, g)
    assert _operands(closed, ("dot_general",)) == {"float16": 2}  # the matmul stays half
    assert _operands(closed, ("sqrt", "reduce_sum")) == {"float32": 2}
    out, exact = fast(x, w, g), norm(x, w, g)
    assert np.isfinite(out).all() and float(jnp.min(jnp.abs(out))) > 0.3, out
    np.testing.assert_allclose(out, exact, rtol=2e-3)


@pytest.mark.parametrize("mode", FLOAT32_OPS)
def test_square_runs_on_float32_operands_even_of_half_precision_values(mode):
    """``square`` is on autocast's float32 list: a float16 (or bfloat16) value's square is
    computed in float32, not in the dtype it was traced in."""
    half = jnp.dtype(jamp.mixed_precision(mode).policy.compute_dtype)
    for traced in (jnp.float32, half):  # a float32 input, and one already in half precision
        closed = jax.make_jaxpr(jamp.autocast(lambda x: jnp.square(x @ x).sum(), mode))(
            jnp.ones((2, 2), traced))
        assert _operands(closed, ("square",)) == {"float32": 1}, (traced, closed)


def _train(mode: str, updates: int = 6) -> list[float]:
    mp = jamp.mixed_precision(mode)
    params = mp.policy.cast_to_param(MODEL)
    tx = jamp.make_optimizer(mp, optax.adam(1e-2, eps=1e-4))
    fast = jamp.autocast(loss_fn, mp)

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(
            lambda p: jamp.scale_loss(fast(p, X, LABELS), opt_state))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, fast(params, X, LABELS), \
            jamp.overflow_stats(opt_state).last_finite

    losses, opt_state, applied = [], tx.init(params), True
    for _ in range(3 * updates):
        params, opt_state, loss, finite = step(params, opt_state)
        if applied:
            losses.append(float(loss))
        if len(losses) > updates:
            break
        applied = bool(finite)
    return losses


@pytest.mark.parametrize("mode", [m for m in jamp.MODES if m != "fp32"])
def test_training_steps_without_nan_close_to_float32(mode):
    losses, reference = _train(mode), _train_fp32()
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    assert abs(losses[-1] / reference[-1] - 1) < 0.05, (losses, reference)


@functools.cache
def _train_fp32():
    return _train("fp32")


# ----------------------------------------------------------------------------- memory


def attention_loss(q, k):
    return jnp.sum(jax.nn.softmax(q @ k.T, axis=-1) ** 2)


def test_float32_softmax_saves_only_half_precision_residuals():
    q = jnp.ones((64, 16), jnp.float32)
    ratio = {mode: jamp.memory_report(jamp.autocast(attention_loss, mode), q, q).residual_bytes
             for mode in ("fp16", "fp16_pure", "fp32")}
    # fp16 (float32 softmax) saves no more than fp16_pure (float16 softmax): half of fp32.
    assert ratio["fp16"] <= ratio["fp16_pure"] <= 0.55 * ratio["fp32"], ratio


# ----------------------------------------------------------------------------- composition


def f32_reference(x, w):
    return jnp.tanh(x @ w).sum(-1)


def _close(a, b, tol=0.05):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=tol, atol=tol)


W = jax.random.normal(jax.random.key(2), (4, 4)) / 2
XS = jax.random.normal(jax.random.key(3), (3, 2, 4))


def test_composes_with_jit_grad_and_vmap():
    fast = jamp.autocast(f32_reference, "bf16")
    _close(jax.jit(fast)(XS[0], W), f32_reference(XS[0], W))
    grad = jax.grad(lambda w: fast(XS[0], w).sum())(W)
    assert grad.dtype == jnp.float32
    _close(grad, jax.grad(lambda w: f32_reference(XS[0], w).sum())(W))
    _close(jax.vmap(fast, in_axes=(0, None))(XS, W), jax.vmap(f32_reference, (0, None))(XS, W))


def test_scan_inside_and_outside_keeps_carry_dtypes():
    def rnn(x, w):
        def cell(h, xt):
            h = jnp.tanh(xt @ w + h @ w)
            return h, h.sum()

        h0 = jnp.zeros(x.shape[1:], jnp.float32)  # a float32 carry made inside
        return jax.lax.scan(cell, h0, x)

    h, ys = jamp.autocast(rnn, "bf16")(XS, W)
    assert h.dtype == ys.dtype == jnp.float32
    _close(h, rnn(XS, W)[0])
    scanned = jax.lax.scan(lambda c, x: (c + jamp.autocast(f32_reference, "fp16")(x, W), None),
                           jnp.zeros(2), XS)[0]
    _close(scanned, sum(f32_reference(x, W) for x in XS))
    inner = next(e for e in iter_eqns(jax.make_jaxpr(jamp.autocast(rnn, "bf16"))(XS, W))
                 if e.primitive.name == "scan")
    assert [str(v.aval.dtype) for v in inner.outvars[:1]] == ["float32"]


def test_while_fori_and_cond_carries():
    def loop(x, w):
        x = jax.lax.fori_loop(0, 3, lambda i, x: jnp.tanh(x @ w), x)
        return jax.lax.cond(x.sum() > 0, lambda x: x @ w, lambda x: -x, x)

    out = jamp.autocast(loop, "fp16")(XS[0], W)
    assert out.dtype == jnp.float32
    _close(out, loop(XS[0], W))


def test_composes_with_remat_inside_and_outside():
    inside = lambda x, w: jax.checkpoint(f32_reference)(x, w)
    fast = jamp.autocast(inside, "bf16")
    assert set(_operands(jax.make_jaxpr(fast)(XS[0], W), ("dot_general",))) == {"bfloat16"}
    outside = jax.checkpoint(jamp.autocast(f32_reference, "bf16"))
    for f in (fast, outside):
        _close(jax.grad(lambda w, f=f: f(XS[0], w).sum())(W),
               jax.grad(lambda w: f32_reference(XS[0], w).sum())(W))


def test_composes_with_shard_map_inside_and_outside():
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    x = jax.random.normal(jax.random.key(4), (8, 4))
    sharded = lambda f: jax.shard_map(f, mesh=mesh, in_specs=(P("data"), P()),
                                      out_specs=P("data"))
    _close(sharded(jamp.autocast(f32_reference, "bf16"))(x, W), f32_reference(x, W))
    _close(jamp.autocast(sharded(f32_reference), "bf16")(x, W), f32_reference(x, W))


@jax.custom_vjp
def scaled_gradient(x):
    return x


scaled_gradient.defvjp(lambda x: (x, None), lambda _, g: (3.0 * g,))


@jax.custom_jvp
def soft_relu(x):
    return jnp.maximum(x, 0.0)


soft_relu.defjvp(lambda primals, tangents: (soft_relu(primals[0]), 2.0 * tangents[0]))


def test_custom_vjp_and_custom_jvp_rules_are_kept():
    f = lambda x, w: jnp.sum(soft_relu(scaled_gradient(x) @ w))
    g = jax.grad(jamp.autocast(f, "bf16"))(XS[0], W)
    _close(g, jax.grad(f)(XS[0], W))  # 3x and 2x: the user's rules, not autodiff's
    np.testing.assert_allclose(jax.grad(f)(XS[0], W), 6.0 * W.sum(1) * jnp.ones((2, 1)))


def test_rewrite_happens_at_trace_time_only():
    traces = []

    def f(x, w):
        traces.append(1)
        return f32_reference(x, w)

    fast = jax.jit(jamp.autocast(f, "bf16"))
    fast(XS[0], W)
    fast(XS[1], W)
    assert len(traces) == 1


def test_bad_policy_gives_a_clear_error():
    with pytest.raises(ValueError, match="neither a mode nor a policy"):
        jamp.autocast(f32_reference, "fp17")


_SCANS = {
    "const+carry+xs": lambda k, xs: jax.lax.scan(lambda c, x: (c * x + k, x), jnp.zeros(3), xs),
    "two carries, two ys": lambda k, xs: jax.lax.scan(
        lambda c, x: ((c[0] + x, c[1] * 2), (x, x * k)), (jnp.zeros(3), k), xs),
    "no xs": lambda k, xs: jax.lax.scan(lambda c, _: (c + k, None), jnp.zeros(3), None,
                                        length=4),
    "reverse, scalar carry": lambda k, xs: jax.lax.scan(
        lambda c, x: (c + x.sum() * k, c), jnp.zeros(()), xs, reverse=True),
}


@pytest.mark.parametrize("name", list(_SCANS))
def test_scan_counts_without_the_parameters_jax_0_11_dropped(name):
    """JAX 0.11 names neither num_consts nor num_carry on scan (and passes nested jaxprs
    open, which open_jaxpr reads like closed ones): the counts come back from the shapes."""
    from jamp import autocast_regions as regions

    closed = jax.make_jaxpr(_SCANS[name])(1.0, jnp.ones((4, 3)))
    eqn = next(e for e in closed.jaxpr.eqns if e.primitive.name == "scan")
    truth = (eqn.params["num_consts"], eqn.params["num_carry"])
    stripped = eqn.replace(params={k: v for k, v in eqn.params.items()
                                   if k not in ("num_consts", "num_carry")})
    assert regions.scan_counts(stripped) == truth
    body = eqn.params["jaxpr"]
    assert regions.open_jaxpr(body)[0] is regions.open_jaxpr(body.jaxpr)[0]


# --- issue 31: the backward pass grows linearly with depth --------------------------------


def _hlo_counts(fn: Any, *args: Any) -> tuple[int, int]:
    """Instructions and converts of the optimised HLO of ``jax.jit(fn)(*args)``."""
    import re

    text = jax.jit(fn).lower(*args).compile().as_text()
    lines = [line for line in text.splitlines() if re.match(r"\s+(ROOT )?%?\S+ = ", line)]
    return len(lines), sum(" convert(" in line for line in lines)


def _per_block_growth(make_loss: Any, make_params: Any, x: jax.Array,
                      depths: tuple[int, int, int] = (2, 3, 4)) -> dict[str, list]:
    """Per-block increments (instructions, converts) of the gradient's HLO between three
    equally spaced depths: autocast's (fp16) and a hand-written fp16 model's (params and
    input cast to float16)."""
    counts: dict[str, list] = {"autocast": [], "hand": []}
    step = depths[1] - depths[0]
    for depth in depths:
        params = make_params(depth)
        half = jax.tree.map(lambda a: a.astype(jnp.float16), params)
        counts["autocast"].append(_hlo_counts(
            jax.grad(lambda p, x: jamp.autocast(make_loss, "fp16")(p, x)), params, x))
        counts["hand"].append(_hlo_counts(
            jax.grad(lambda p, x: make_loss(p, x.astype(jnp.float16))), half, x))
    return {k: [((b[0] - a[0]) / step, (b[1] - a[1]) / step)
                for a, b in zip(v, v[1:], strict=False)] for k, v in counts.items()}


def _assert_linear_like_hand(growth: dict[str, list]) -> None:
    (ins1, conv1), (ins2, conv2) = growth["autocast"]
    (hand_ins, _), _ = growth["hand"]
    assert abs(ins2 - ins1) <= 0.1 * ins1, growth  # linear: the same increment per block
    assert abs(conv2 - conv1) <= 0.1 * conv1, growth
    assert ins1 <= 1.1 * hand_ins, growth  # per block within 10% of hand-written fp16


def test_backward_grows_linearly_in_depth_on_an_equinox_vit():
    """Issue 31: each norm's input used to be converted to float32 once per reading
    equation; the converts' cotangents then summed in float16 and XLA:CPU re-fused the
    chain into every later block (4 blocks: 2.0x mpx's step, 8 blocks 3.2x float32)."""
    eqx = pytest.importorskip("equinox")

    class Block(eqx.Module):
        ln1: Any
        attn: Any
        ln2: Any
        fc1: Any
        fc2: Any

        def __init__(self, key, width=32, heads=2, mlp=64):
            k = jax.random.split(key, 3)
            self.ln1, self.ln2 = eqx.nn.LayerNorm(width), eqx.nn.LayerNorm(width)
            self.attn = eqx.nn.MultiheadAttention(heads, width, key=k[0])
            self.fc1, self.fc2 = eqx.nn.Linear(width, mlp, key=k[1]), eqx.nn.Linear(
                mlp, width, key=k[2])

        def __call__(self, x):
            y = jax.vmap(self.ln1)(x)
            x = x + self.attn(y, y, y)
            y = jax.vmap(self.ln2)(x)
            return x + jax.vmap(self.fc2)(jax.nn.gelu(jax.vmap(self.fc1)(y)))

    statics = {}

    def make_params(depth):
        blocks = [Block(k) for k in jax.random.split(jax.random.key(0), depth)]
        params, statics[depth] = eqx.partition(blocks, eqx.is_inexact_array)
        return params

    def loss(params, x):
        blocks = eqx.combine(params, statics[len(params)])

        def one(x):
            for block in blocks:
                x = block(x)
            return x

        return jax.vmap(one)(x).astype(jnp.float32).mean()

    _assert_linear_like_hand(_per_block_growth(loss, make_params, jnp.ones((2, 9, 32))))


def test_backward_grows_linearly_in_depth_on_a_haiku_transformer():
    hk = pytest.importorskip("haiku")

    def block(x):
        y = hk.LayerNorm(-1, create_scale=True, create_offset=True)(x)
        x = x + hk.MultiHeadAttention(2, 16, w_init=hk.initializers.VarianceScaling())(y, y, y)
        y = hk.LayerNorm(-1, create_scale=True, create_offset=True)(x)
        return x + hk.Linear(32)(jax.nn.gelu(hk.Linear(64)(y)))

    models = {}

    def make_params(depth):
        models[depth] = hk.without_apply_rng(hk.transform(
            lambda x: functools.reduce(lambda x, _: block(x), range(depth), x)))
        return models[depth].init(jax.random.key(0), jnp.ones((2, 9, 32)))

    def loss(params, x):
        depth = len({k.split("/")[0] for k in params if "layer_norm" in k}) // 2 or 1
        return models[depth].apply(params, x).astype(jnp.float32).mean()

    _assert_linear_like_hand(_per_block_growth(loss, make_params, jnp.ones((2, 9, 32))))


def test_backward_grows_linearly_in_depth_on_a_plain_jnp_residual_mlp():
    def make_params(depth):
        keys = jax.random.split(jax.random.key(0), 2 * depth)
        return [{"w1": 0.1 * jax.random.normal(keys[2 * i], (32, 64)),
                 "w2": 0.1 * jax.random.normal(keys[2 * i + 1], (64, 32)),
                 "g": jnp.ones(32), "b": jnp.zeros(32)} for i in range(depth)]

    def loss(params, x):
        for p in params:
            mean = x.mean(-1, keepdims=True)
            y = (x - mean) / jnp.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5)
            x = x + jax.nn.gelu((y * p["g"] + p["b"]) @ p["w1"]) @ p["w2"]
        return x.astype(jnp.float32).mean()

    # From 4 blocks on; the hand-written model's own HLO grows faster than linearly here
    # (XLA:CPU re-fuses its float16 norm chain), autocast's by 401 instructions a block.
    _assert_linear_like_hand(_per_block_growth(loss, make_params, jnp.ones((4, 9, 32)),
                                               depths=(4, 6, 8)))
