"""jamp.function_activations: a plain function's matmul outputs (jnp, Equinox, Haiku) reduced
where computed, with the values of the forward pass, named by scope or source line, one row
per layer of a scan, and named in a boosted function's skip reason."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jamp
from jamp import tensor_stats as ts
from jamp.function_activations import SCAN, function_activations

F16 = jnp.float16
stats16 = lambda y: ts.array_stats(y, F16)


def _line(marker: str) -> int:
    lines = pathlib.Path(__file__).read_text().splitlines()
    return next(i for i, text in enumerate(lines, 1) if marker in text and "_line(" not in text)


def _head(w, h):
    with jax.named_scope("head"):
        return h @ w


def mlp(p, x):
    with jax.named_scope("mlp"):
        with jax.named_scope("fc1"):
            h = jax.nn.relu(x @ p["w1"])
        with jax.named_scope("attn"):
            h = (h @ h.T) @ h  # two matmuls in one scope
        y = jax.jit(_head)(p["w2"], h)  # a nested jit: evaluated inline, under mlp/
    return y + x @ p["skip"]  # unscoped


P = {"w1": jnp.linspace(-1.0, 2.0, 12).reshape(3, 4),
     "w2": jnp.linspace(0.5, -1.0, 8).reshape(4, 2), "skip": jnp.full((3, 2), 0.25)}
X = jnp.linspace(-2.0, 3.0, 6).reshape(2, 3).at[1, 2].set(300.0)  # attn overflows fp16


def _direct(p, x):
    """The fp16 forward pass written out: autocast's casts, each matmul in float16."""
    p16, x16 = jax.tree_util.tree_map(lambda a: a.astype(F16), p), x.astype(F16)
    fc1 = x16 @ p16["w1"]
    h = jax.nn.relu(fc1)
    s = h @ h.T
    a = s @ h
    head = a @ p16["w2"]
    skip = x16 @ p16["skip"]
    return [fc1, s, a, head, skip, (head + skip).astype(jnp.float32)]


NAMES = ["mlp/fc1/dot_general", "mlp/attn/dot_general", "mlp/attn/dot_general#2",
         "mlp/head/dot_general",
         f"test_tensor_stats_functions.py:{_line('# unscoped')} dot_general", "(output)"]


def test_matmul_outputs_are_the_forward_pass_values_named_in_order():
    fast = jamp.autocast(mlp, "fp16")
    raw = ts.ordered_leaves(function_activations(fast, P, X))
    want = _direct(P, X)
    assert [n for n, _ in raw] == NAMES
    assert np.isinf(np.asarray(want[2])).any()  # the overflow is there to be seen
    for (name, got), expected in zip(raw, want, strict=True):
        assert got.dtype == expected.dtype, name
        np.testing.assert_array_equal(got, expected, err_msg=name)
    np.testing.assert_array_equal(raw[-1][1], fast(P, X))

    reduced = function_activations(fast, P, X, reduce=stats16)
    stats, rows = ts.reduced_stats(ts.ordered_leaves(reduced))
    assert [r.name for r in rows] == NAMES
    want_stats, _ = ts.tree_stats([(n, y) for n, y in zip(NAMES, want, strict=True)], F16)
    for field in ts.STATISTICS:
        np.testing.assert_array_equal(getattr(stats, field), getattr(want_stats, field),
                                      err_msg=field)
    # Deterministic: the same names again, and the same as for the function as written
    # (autocast keeps each equation's scope and source line).
    assert list(function_activations(fast, P, X, reduce=stats16)) == list(reduced)
    assert list(function_activations(mlp, P, X)) == list(reduced)


@jax.custom_vjp
def _custom(h, w):
    with jax.named_scope("custom"):
        return h @ w


_custom.defvjp(lambda h, w: (_custom(h, w), (h, w)), lambda r, g: (g @ r[1].T, r[0].T @ g))


def test_remat_and_custom_vjp_bodies_are_entered_while_and_cond_bodies_run_as_they_are():
    def fn(w, x):
        h = jax.checkpoint(lambda h: _custom(h, w))(x)
        with jax.named_scope("loop"):
            h = jax.lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] @ w),
                                   (0, h))[1]  # no rows
            h = jax.lax.cond(h.sum() > 0, lambda h: h @ w, lambda h: h, h)  # no rows
        with jax.named_scope("last"):
            return h @ w

    w, x = jnp.full((2, 2), 0.5), jnp.ones((1, 2))
    with pytest.warns(UserWarning, match=r"matmuls inside while at loop, cond at loop have no "
                      r"rows"):  # not silently: named, in the order they run
        out = ts.ordered_leaves(function_activations(fn, w, x))
    assert [n for n, _ in out] == ["custom/dot_general", "last/dot_general", "(output)"]
    np.testing.assert_array_equal(out[0][1], x @ w)
    np.testing.assert_array_equal(out[-1][1], fn(w, x))


def test_a_scan_gives_one_row_per_layer():
    def layer(h, w):
        with jax.named_scope("block"):
            with jax.named_scope("fc1"):
                h = jnp.tanh(h @ w)
            with jax.named_scope("fc2"):
                return h @ w.T, None

    def stack(p, x):
        with jax.named_scope("embed"):
            h = x @ p["embed"]
        with jax.named_scope("layers"):
            h, _ = jax.lax.scan(layer, h, p["layers"])
        return h

    p = {"embed": jnp.full((2, 3), 0.5),
         "layers": jnp.stack([jnp.full((3, 3), v) for v in (0.1, -2.0, 3.0)])}
    x = jnp.arange(4.0).reshape(2, 2)
    out = function_activations(jamp.autocast(stack, "fp16"), p, x, reduce=stats16)
    stats, rows = ts.reduced_stats(ts.ordered_leaves(out), scanned=(SCAN,))
    names = [f"layers/scan/{i}/block/{fc}/dot_general" for fc in ("fc1", "fc2") for i in range(3)]
    assert [r.name for r in rows] == ["embed/dot_general", *names, "(output)"]
    # Each layer's row: the statistics of that layer's output, computed one layer at a time.
    h = x.astype(F16) @ p["embed"].astype(F16)
    fc1, fc2 = [], []
    for w in p["layers"].astype(F16):
        fc1.append(h @ w)
        h = jnp.tanh(fc1[-1]) @ w.T
        fc2.append(h)
    want = [float(ts.array_stats(y, F16).amax[0]) for y in (*fc1, *fc2)]
    assert stats.amax[1:7].tolist() == want


def test_equinox_mlp_layers_named_in_order():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(3, 2, 4, depth=2, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    fn = lambda p, x: jax.vmap(eqx.combine(p, static))(x)
    out = ts.ordered_leaves(function_activations(fn, params, X))
    names = [n for n, _ in out]
    # Equinox scopes each layer by its class (eqx.nn.Linear); older ones: this file's line.
    stem = names[0][:-len("dot_general")]
    assert "Linear" in stem or "test_tensor_stats_functions.py:" in stem
    assert names == [f"{stem}dot_general", f"{stem}dot_general#2", f"{stem}dot_general#3",
                     "(output)"]
    h = X
    for i, linear in enumerate(model.layers):
        y = h @ linear.weight.T  # vmap's dot_general holds it transposed: compare values
        np.testing.assert_allclose(np.sort(out[i][1], None), np.sort(y, None), rtol=1e-6,
                                   err_msg=names[i])
        h = jax.nn.relu(y + linear.bias)


def test_haiku_mlp_layers_named_by_their_modules():
    hk = pytest.importorskip("haiku")
    net = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([4, 2])(x)))
    params = net.init(jax.random.key(0), X)
    out = ts.ordered_leaves(function_activations(jamp.autocast(net.apply, "fp16"), params, X))
    assert [n for n, _ in out] == ["mlp/linear_0/dot_general", "mlp/linear_1/dot_general",
                                   "(output)"]
    w0 = params["mlp/~/linear_0"]["w"].astype(F16)
    np.testing.assert_array_equal(out[0][1], X.astype(F16) @ w0)


def test_collecting_holds_one_output_at_a_time_not_all():
    # Reduced where computed (in the scan's body), the scratch memory does not grow with
    # depth; keeping every output and reducing after the forward pass grows with it.
    x = jnp.ones((64, 256))

    def scratch(depth, keep):
        ws = jnp.full((depth, 256, 256), 1e-3)

        def net(ws, x):  # stacked layers: kept outputs are stacked too
            return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]

        if keep:
            f = lambda ws, x: ts.tree_stats(ts.ordered_leaves(function_activations(net, ws, x)),
                                            F16)[0]
        else:
            f = lambda ws, x: function_activations(net, ws, x, reduce=stats16)
        return jax.jit(f).lower(ws, x).compile().memory_analysis().temp_size_in_bytes

    reduced = {d: scratch(d, keep=False) for d in (2, 16)}
    kept = {d: scratch(d, keep=True) for d in (2, 16)}
    assert reduced[16] <= 1.1 * reduced[2] + 2**16, reduced
    # the measure can tell the two apart: kept, the 14 more layers' outputs are held
    assert kept[16] - kept[2] >= 14 * x.size * 4, kept


def test_a_boosted_function_skip_names_the_layer_whose_matmul_overflowed():
    def layer(h, w):
        with jax.named_scope("dense"):
            return jnp.tanh(h) @ w, None

    def net(p, x):
        with jax.named_scope("enc"):
            h = x @ p["enc"]
        with jax.named_scope("layers"):
            h, _ = jax.lax.scan(layer, h, p["layers"])
        with jax.named_scope("head"):
            return h @ p["head"]

    params = {"enc": jnp.full((4, 4), 0.5), "layers": jnp.full((2, 4, 4), 0.1),
              "head": jnp.full((4, 2), 0.1)}
    b = jamp.boost(net, optax.sgd(0.1), lambda y, t: jnp.mean((y - t) ** 2), "fp16",
                   params=params, tensor_stats=1000)
    batch = (jnp.ones((8, 4)), jnp.zeros((8, 2)))
    state = b.init(jax.random.key(0), batch)
    state, m = b.step(state, batch)  # finite: statistics collected (step 0)
    m = jax.device_get(m)
    assert not m["skipped"] and b.explain(m) is None and m["tensor_stats_collected"]
    assert list(b.stats_table(m)["activations"]) == [
        "enc/dot_general", "layers/scan/0/dense/dot_general", "layers/scan/1/dense/dot_general",
        "head/dot_general", "(output)"]

    big = dict(state.params, layers=state.params["layers"].at[1].set(6e4))  # 4*0.37*6e4 > 65504
    state, m = b.step(state.replace(params=big), batch)
    m = jax.device_get(m)
    assert m["skipped"]
    reason = b.explain(m)
    assert reason.endswith("; forward: inf in the output of layers/scan/1/dense/dot_general"), \
        reason


def test_two_scans_in_one_scope_are_two_groups_of_rows_in_forward_order():
    def f(ws, x):
        with jax.named_scope("layers"):
            x = jax.lax.scan(lambda h, w: (h @ w, None), x, ws)[0]
            return jax.lax.scan(lambda h, w: (h @ w, None), x, 2 * ws)[0]

    out = function_activations(f, jnp.ones((2, 2, 2)), jnp.ones((1, 2)), reduce=stats16)
    stats, rows = ts.reduced_stats(ts.ordered_leaves(out), (SCAN,))
    line = _line("(lambda h, w: (h @ w, None), x, ws)")
    assert [r.name for r in rows] == [
        f"layers/scan/0/test_tensor_stats_functions.py:{line} dot_general",
        f"layers/scan/1/test_tensor_stats_functions.py:{line} dot_general",
        f"layers#2/scan/0/test_tensor_stats_functions.py:{line + 1} dot_general",
        f"layers#2/scan/1/test_tensor_stats_functions.py:{line + 1} dot_general", "(output)"]
    assert stats.amax.tolist() == [2.0, 4.0, 16.0, 64.0, 64.0]
    assert ts._forward_order(rows, ts._scanned_prefix((SCAN,))) == [0, 1, 2, 3, 4]
