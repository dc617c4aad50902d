"""``jamp.autocast`` in the fp8 modes (issue 14): current-scaling projections, delayed refused.

Checked in the jaxpr (operand dtypes of every ``dot_general``, forward and ``jax.grad``) and
against the same functions written by hand with ``jamp.fp8.current_scaling_dot_general``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_utils import iter_eqns

import jamp
from jamp.autocast import cast_floating
from jamp.fp8 import current_scaling_dot_general

E4M3, E5M2, BF16 = "float8_e4m3fn", "float8_e5m2", "bfloat16"
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
DENSE = (((1,), (0,)), ((), ()))  # x @ w for 2-D x
jit = functools.partial(jax.jit, compiler_options=FAST_COMPILE)


def _normal(seed, shape, scale=1.0):
    return scale * jax.random.normal(jax.random.key(seed), shape)


def _dots(closed) -> list[tuple[bool, tuple[str, ...]]]:
    """(has batch dimensions, operand dtypes) of every dot_general, nested jaxprs included."""
    return [(bool(e.params["dimension_numbers"][1][0]), tuple(str(v.aval.dtype) for v in e.invars))
            for e in iter_eqns(closed) if e.primitive.name == "dot_general"]


# ----------------------------------------------------------------------------- jaxpr


def attention_block(p, x):
    """conv -> q/k/v projections (@ and einsum) -> multi-head attention -> output projection."""
    b, n, d = x.shape
    x = jax.lax.conv_general_dilated(x, p["conv"], (1,), "SAME",
                                     dimension_numbers=("NWC", "WIO", "NWC"))
    x = jax.nn.relu(x)  # a custom_jvp: runs as traced, so q/k/v get a float32 operand
    heads = lambda t: t.reshape(b, n, 2, d // 2)
    q = heads(x @ p["wq"])
    k = heads(jnp.einsum("bld,de->ble", x, p["wk"]))
    v = heads(x @ p["wv"])
    a = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // 2), axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(b, n, d)
    return jnp.mean(jnp.tanh(o @ p["wo"]) ** 2)


BLOCK = {"conv": _normal(0, (3, 8, 8), 0.3),
         **{n: _normal(i, (8, 8), 0.35) for i, n in enumerate(("wq", "wk", "wv", "wo"), 1)}}
BLOCK_X = _normal(5, (2, 3, 8))
PROJECTIONS = 4


def test_projections_fp8_batched_dots_and_convs_bf16_forward():
    closed = jax.make_jaxpr(jamp.autocast(attention_block, "fp8_current"))(BLOCK, BLOCK_X)
    dots = _dots(closed)
    assert sorted(dots) == sorted([(False, (E4M3, E4M3))] * PROJECTIONS
                                  + [(True, (BF16, BF16))] * 2), dots
    results = [str(e.outvars[0].aval.dtype) for e in iter_eqns(closed)
               if e.primitive.name == "dot_general"]
    assert set(results) == {BF16}, results  # fp8 products in the compute dtype
    convs = [tuple(str(v.aval.dtype) for v in e.invars) for e in iter_eqns(closed)
             if e.primitive.name == "conv_general_dilated"]
    assert convs == [(BF16, BF16)], convs


def test_gradient_dots_e5m2_and_batched_gradients_bf16():
    closed = jax.make_jaxpr(jax.grad(jamp.autocast(attention_block, "fp8_current")))(
        BLOCK, BLOCK_X)
    dots = _dots(closed)
    projections = [dtypes for batched, dtypes in dots if not batched]
    # forward: both operands E4M3; backward: the E5M2 gradient times a saved E4M3 operand,
    # two per projection (the input's and the kernel's gradient).
    assert sorted(projections) == sorted([(E4M3, E4M3)] * PROJECTIONS
                                         + [(E5M2, E4M3)] * 2 * PROJECTIONS), projections
    batched = [dtypes for batched, dtypes in dots if batched]
    assert len(batched) == 6 and set(batched) == {(BF16, BF16)}, batched  # 2 forward, 4 grads
    convs = {str(v.aval.dtype) for e in iter_eqns(closed)
             if e.primitive.name == "conv_general_dilated" for v in e.invars}
    assert convs == {BF16}, convs


# ----------------------------------------------------------------------------- values


def mlp(p, x):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return h @ p["w2"] + p["b2"]


def _add_bias(h, b):
    """``h + b`` with the bias gradient summed in float32, as autocast sums (jamp.accumulate)."""
    return h + jnp.broadcast_to(b.astype(jnp.float32), h.shape).astype(h.dtype)


def mlp_by_hand(p, x):
    """The same MLP with the fp8 matmul written out, on bf16 copies, returning float32."""
    p, x = cast_floating((p, x), jnp.bfloat16)
    h = jnp.tanh(_add_bias(current_scaling_dot_general(x, p["w1"], DENSE), p["b1"]))
    return _add_bias(current_scaling_dot_general(h, p["w2"], DENSE), p["b2"]).astype(
        jnp.float32)


MLP = {"w1": _normal(10, (16, 32), 0.25), "b1": _normal(11, (32,), 0.1),
       "w2": _normal(12, (32, 4), 0.2), "b2": _normal(13, (4,), 0.1)}
X = _normal(14, (8, 16))


def _with_grads(fn):
    """``fn`` jitted, returning its output and the gradient of a loss on it (one compile)."""
    return jit(lambda p, x: (fn(p, x), jax.grad(lambda p: jnp.sum(fn(p, x) ** 2))(p)))


FAST_MLP = _with_grads(jamp.autocast(mlp, "fp8_current"))
HAND_MLP = _with_grads(mlp_by_hand)


def test_mlp_equals_current_scaling_by_hand_bit_for_bit():
    (out, grads), (hand, hand_grads) = FAST_MLP(MLP, X), HAND_MLP(MLP, X)
    assert out.dtype == hand.dtype == jnp.float32
    np.testing.assert_array_equal(out, hand)
    assert {g.dtype for g in jax.tree_util.tree_leaves(grads)} == {jnp.dtype(jnp.float32)}
    jax.tree_util.tree_map(np.testing.assert_array_equal, grads, hand_grads)


def _cross_entropy(p, x, labels):
    logp = jax.nn.log_softmax(mlp(p, x), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))


LABELS = jnp.argmax(X @ _normal(15, (16, 4)), axis=-1)


@functools.cache
def _sgd_losses(mode: str, steps: int = 6, lr: float = 0.5) -> list[float]:
    loss_fn = jamp.autocast(_cross_entropy, mode)

    @jit
    def step(p):
        loss, grads = jax.value_and_grad(loss_fn)(p, X, LABELS)
        return jax.tree_util.tree_map(lambda w, g: w - lr * g, p, grads), loss

    params, losses = MLP, []
    for _ in range(steps):
        params, loss = step(params)
        losses.append(float(loss))
    return losses


def test_sgd_steps_close_to_bf16():
    fp8, bf16 = _sgd_losses("fp8_current"), _sgd_losses("bf16")
    assert np.all(np.isfinite(fp8)) and fp8[-1] < 0.8 * fp8[0], fp8
    for a, b in zip(fp8, bf16, strict=True):  # measured: at most 3.0% apart (step 5)
        assert abs(a / b - 1) < 0.05, (fp8, bf16)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_non_finite_input_reaches_the_output(bad):
    out, grads = FAST_MLP(MLP, X.at[0, 3].set(bad))
    assert not np.isfinite(out[0]).any(), out  # not saturated at the fp8 maximum
    assert np.isfinite(out[1:]).all(), out  # the other examples are untouched
    assert not np.isfinite(grads["w1"]).all()  # and the gradient sees it too


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("mode", ["fp8", "fp8_delayed",
                                  jamp.mixed_precision("bf16", fp8="delayed")])
def test_delayed_scaling_refused_at_autocast_time(mode):
    with pytest.raises(ValueError, match=r"(?s)delayed scaling keeps an amax history.*stateless"
                       r".*'fp8_current'.*jamp\.apply_policy.*_overwrite_with_gradient.*Fp8Meta"):
        jamp.autocast(mlp, mode)  # before fn is called or traced


def test_keep_bf16_layer_names_refused_default_head_accepted():
    recipe = jamp.fp8.Fp8Recipe("current", keep_bf16=("head", "out"))
    with pytest.raises(ValueError, match=r"autocast sees ops, not named layers.*\('out',\)"):
        jamp.autocast(mlp, jamp.mixed_precision("fp8_current", fp8=recipe))
    for keep in ((), ("head",)):  # every projection is fp8 either way
        mp = jamp.mixed_precision("fp8_current", fp8=jamp.fp8.Fp8Recipe("current", keep_bf16=keep))
        dots = _dots(jax.make_jaxpr(jamp.autocast(mlp, mp))(MLP, X))
        assert dots == [(False, (E4M3, E4M3))] * 2, dots


def test_empty_batch_runs():
    fast = jamp.autocast(lambda p, x: jnp.sum(mlp(p, x)), "fp8_current")  # no amax to take
    grads = jax.jit(jax.grad(fast))(MLP, jnp.ones((0, 16)))
    assert grads["w1"].shape == (16, 32) and grads["w1"].dtype == jnp.float32
    assert not jnp.any(grads["w1"])  # no examples, no gradient (and no NaN)


# ----------------------------------------------------------------------------- composition


def test_vmap_outside_and_inside():
    xs = jnp.stack([X, 2 * X[::-1]])
    fast = jamp.autocast(mlp, "fp8_current")
    mapped = jit(jax.vmap(fast, in_axes=(None, 0)))(MLP, xs)
    # traced per slice: each mapped slice is quantized with its own scales
    per_slice = jnp.stack([HAND_MLP(MLP, x)[0] for x in xs])
    np.testing.assert_allclose(mapped, per_slice, rtol=1e-2, atol=1e-2)
    inside = jamp.autocast(lambda p, xs: jax.vmap(mlp, in_axes=(None, 0))(p, xs), "fp8_current")
    dots = _dots(jax.make_jaxpr(inside)(MLP, xs))  # unbatched kernel: still a projection
    assert dots == [(False, (E4M3, E4M3))] * 2, dots


def stacked(layers, x):
    return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, layers)[0]


def stacked_by_hand(layers, x):
    layers, x = cast_floating((layers, x), jnp.bfloat16)
    step = lambda h, w: (jnp.tanh(current_scaling_dot_general(h, w, DENSE)), None)
    return jax.lax.scan(step, x, layers)[0].astype(jnp.float32)


def test_scan_over_layers_and_grad():
    layers = _normal(20, (3, 16, 16), 0.25)
    fast = jamp.autocast(stacked, "fp8_current")
    scans = [e for e in iter_eqns(jax.make_jaxpr(jax.grad(lambda w: fast(w, X).sum()))(layers))
             if e.primitive.name == "scan"]
    assert scans and {d for s in scans for _, d in _dots(s.params["jaxpr"])} == {
        (E4M3, E4M3), (E5M2, E4M3)}
    swap = lambda f: lambda w, x: f(x, w)  # _with_grads differentiates the first argument
    (out, grad), (hand, hand_grad) = (_with_grads(swap(fast))(X, layers),
                                      _with_grads(swap(stacked_by_hand))(X, layers))
    np.testing.assert_array_equal(out, hand)
    assert grad.dtype == jnp.float32
    np.testing.assert_array_equal(grad, hand_grad)
