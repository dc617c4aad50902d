"""``jamp.parallel.read_dtypes``: the dtype a function reads each parameter in (issue 24).

ZeRO-3 casts a parameter to the dtype the model reads it in *before* the all-gather.
The analysis must find that dtype for any model: jamp's linen and NNX ViTs in every mode
(kernels and embeddings in the compute dtype, LayerNorm scales and biases in float32 where
the policy keeps them there), with ``nn.scan``, remat and the GPipe runner, a third-party
linen model under ``jamp.apply_policy``, and plain JAX functions (autocast, ``cond``,
``scan``, ``while``, ``custom_vjp``, ``shard_map``). Where a test has real numbers it
checks the meaning: casting every leaf to its read dtype and back leaves the outputs
bit-identical, and rounding the float32-read leaves to float16 changes them.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jamp
from jamp import nnx_functional, parallel
from jamp.models import vit, vit_nnx
from jamp.parallel import pipeline
from jamp.parallel.read_dtypes import read_dtypes

F16, BF16, F32 = np.dtype("float16"), np.dtype(jnp.bfloat16), np.dtype("float32")
IMAGES = jax.ShapeDtypeStruct((4, 4, 4, 1), jnp.float32)
TINY = dict(num_classes=3, patch_size=2, num_layers=2, hidden_size=8, num_heads=2, mlp_dim=8)

# mode -> (dtype the kernels, biases and embeddings are read in, dtype the norms are read in)
VIT_READS = {
    "fp32": (F32, F32),
    "fp16": (F16, F32),
    "bf16": (BF16, F32),
    "fp16_naive": (F16, F32),  # params are float16 already, norms stay float32
    "fp16_pure": (F16, F16),
    "bf16_pure": (BF16, BF16),
    "fp8": (BF16, F32),  # fp8 kernels are cast to bf16, then scaled and quantised
    "fp8_current": (BF16, F32),
}


def _by_path(tree) -> dict[str, np.dtype]:
    return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _is_norm(path: str) -> bool:
    return "norm" in path.lower()


def _assert_vit_reads(reads, mode: str) -> None:
    compute, norm = VIT_READS[mode]
    got = _by_path(reads)
    assert sum(map(_is_norm, got)) >= 4, got  # both block norms + the final norm
    want = {path: norm if _is_norm(path) else compute for path in got}
    assert got == want


def _round_trip(params, reads):
    return jax.tree.map(lambda p, d: jnp.asarray(p).astype(d).astype(p.dtype), params, reads)


def _linen_vit(mode: str, **overrides):
    model = jamp.apply_policy(vit.create("ti", **TINY, **overrides), mode)
    variables = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0),
                                                           jnp.ones(IMAGES.shape))))
    rest = {k: v for k, v in variables.items() if k != "params"}  # fp8 state
    return (lambda p, x: model.apply({"params": p, **rest}, x)), variables["params"]


# ----------------------------------------------------------------------------- jamp's ViTs


@pytest.mark.parametrize("mode", list(VIT_READS))
def test_linen_vit_reads_per_mode(mode):
    apply, params = _linen_vit(mode)
    _assert_vit_reads(read_dtypes(apply, params, IMAGES), mode)


def test_linen_vit_fp16_meaning():
    # Real numbers: the read dtypes are exact (round trip = same logits) and the float32
    # reads are needed (rounding the norms' params to float16 changes the logits).
    model = jamp.apply_policy(vit.create("ti", **TINY), "fp16")
    x = jax.random.normal(jax.random.key(1), IMAGES.shape)
    params = jax.jit(model.init)(jax.random.key(0), x)["params"]
    keys = iter(jax.random.split(jax.random.key(2), 100))
    params = jax.tree.map(lambda p: p + 0.1 * jax.random.normal(next(keys), p.shape), params)
    reads = read_dtypes(lambda p, x: model.apply({"params": p}, x), params, x)
    _assert_vit_reads(reads, "fp16")
    apply = jax.jit(lambda p: model.apply({"params": p}, x))
    logits = apply(params)
    np.testing.assert_array_equal(apply(_round_trip(params, reads)), logits)
    as_f16 = jax.tree.map(lambda d: F16, reads)
    assert not np.array_equal(apply(_round_trip(params, as_f16)), logits)


def test_linen_vit_remat_and_gradient():
    apply, params = _linen_vit("fp16", remat=True)
    _assert_vit_reads(read_dtypes(apply, params, IMAGES), "fp16")
    # The backward pass reads no parameter in float32 that the forward reads in float16.
    grad = jax.grad(lambda p, x: apply(p, x).astype(jnp.float32).sum())
    _assert_vit_reads(read_dtypes(grad, params, IMAGES), "fp16")


def test_linen_vit_gpipe_on_two_stages():
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    apply, params = _linen_vit("fp16", layer_runner=pipeline.GPipe(2, microbatches=2))
    with jax.set_mesh(parallel.make_mesh({"data": 1, "model": 1, "pipe": 2})):
        jaxpr = str(jax.make_jaxpr(apply)(params, IMAGES))
        reads = read_dtypes(apply, params, IMAGES)
    assert "shard_map" in jaxpr and "ppermute" in jaxpr  # the blocks run in the pipeline
    _assert_vit_reads(reads, "fp16")


@pytest.mark.parametrize("mode", ["fp16", "fp8"])
def test_nnx_vit_reads(mode):
    model = jamp.apply_policy(vit_nnx.create(
        "ti", **TINY, image_size=4, channels=1, rngs=nnx.Rngs(0)), mode)
    apply_fn, params = nnx_functional.functional(model)
    fp8_state = nnx_functional.fp8_state(model)
    variables = {jamp.fp8.COLLECTION: fp8_state} if fp8_state else {}
    reads = read_dtypes(lambda p, x: apply_fn({"params": p, **variables}, x), params, IMAGES)
    _assert_vit_reads(reads, mode)


# ----------------------------------------------------------------------------- any linen model


class ConvNet(nn.Module):
    """Written without dtype arguments, as a third-party model would be."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(4, (3, 3))(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(x))
        return nn.Dense(3)(x.mean(axis=(1, 2)))


def test_third_party_linen_model_under_fp16():
    model = jamp.apply_policy(ConvNet(), "fp16")
    x = jax.random.normal(jax.random.key(1), IMAGES.shape)
    variables = jax.jit(model.init)(jax.random.key(0), x)
    keys = iter(jax.random.split(jax.random.key(2), 100))
    params = jax.tree.map(lambda p: p + 0.1 * jax.random.normal(next(keys), p.shape),
                          variables["params"])
    stats = variables["batch_stats"]
    reads = read_dtypes(lambda p, x: model.apply({"params": p, "batch_stats": stats}, x),
                        params, x)
    assert _by_path(reads) == {
        "['BatchNorm_0']['bias']": F32, "['BatchNorm_0']['scale']": F32,
        "['Conv_0']['bias']": F16, "['Conv_0']['kernel']": F16,
        "['Dense_0']['bias']": F16, "['Dense_0']['kernel']": F16}
    apply = jax.jit(lambda p: model.apply({"params": p, "batch_stats": stats}, x))
    np.testing.assert_array_equal(apply(_round_trip(params, reads)), apply(params))
    assert not np.array_equal(apply(_round_trip(params, jax.tree.map(lambda d: F16, reads))),
                              apply(params))


# ----------------------------------------------------------------------------- plain JAX


def _mlp(p, x):
    h = x @ p["w1"] + p["b1"]
    mu = h.mean(-1, keepdims=True)
    h = (h - mu) * jax.lax.rsqrt(((h - mu) ** 2).mean(-1, keepdims=True) + 1e-6)
    return jax.nn.relu(h * p["scale"]) @ p["w2"] + p["step"]


MLP_PARAMS = {"w1": jnp.ones((4, 8)), "b1": jnp.zeros(8), "scale": jnp.ones(8),
              "w2": jnp.ones((8, 3)), "step": jnp.zeros((), jnp.int32)}
X = jax.ShapeDtypeStruct((2, 4), jnp.float32)


def test_autocast_function():
    # autocast casts every floating input to the compute dtype on entry (the norm's scale
    # too, unlike apply_policy): everything floating is read in float16.
    reads = read_dtypes(jamp.autocast(_mlp, "fp16"), MLP_PARAMS, X)
    assert reads == {"w1": F16, "b1": F16, "scale": F16, "w2": F16,
                     "step": np.dtype("int32")}
    # Not autocast: read as written.
    assert set(read_dtypes(_mlp, MLP_PARAMS, X).values()) == {F32, np.dtype("int32")}


def _half(w):
    return w.astype(jnp.float16)


def test_cond_branches_must_agree():
    def f(p, x, raw_branch):
        other = (lambda w, x: w @ x) if raw_branch else (lambda w, x: (_half(w) @ _half(x)))
        y = jax.lax.cond(x.sum() > 0, lambda w, x: (_half(w) @ _half(x)).astype(jnp.float32),
                         lambda w, x: other(w, x).astype(jnp.float32), p["w"], x)
        return y + p["b"]

    p, x = {"w": jnp.ones((3, 4)), "b": jnp.ones(())}, jnp.ones((4,))
    assert read_dtypes(f, p, x, raw_branch=True) == {"w": F32, "b": F32}
    assert read_dtypes(f, p, x, raw_branch=False) == {"w": F16, "b": F32}


def test_scan_over_stacked_weights():
    def f(p, x):
        def layer(h, w):
            return jnp.tanh(_half(h) @ _half(w)).astype(jnp.float32), None
        return jax.lax.scan(layer, x, p["layers"])[0]

    p = {"layers": jnp.ones((3, 4, 4))}
    assert read_dtypes(f, p, jnp.ones((2, 4))) == {"layers": F16}
    # The same weights as the scan's carry are read as they are.
    g = lambda p, x: jax.lax.scan(lambda w, _: (_half(w).astype(jnp.float32) * 2, None),
                                  p["layers"], None, length=2)[0]
    assert read_dtypes(g, p, jnp.ones(())) == {"layers": F32}


def test_mixed_uses_and_moves():
    def f(p, x):
        a = _half(p["both"]) @ _half(x)  # read in float16 ...
        b = p["both"].sum()  # ... and as it is
        moved = jnp.transpose(p["moved"].reshape(4, 2))[None]  # only moves, then a cast
        return a.astype(jnp.float32) + b + _half(moved).astype(jnp.float32).sum()

    p = {"both": jnp.ones((3, 4)), "moved": jnp.ones(8), "unused": jnp.ones(2),
         "wide": jnp.ones(3, jnp.float16)}
    g = lambda p, x: f(p, x) + p["wide"].astype(jnp.float32).sum()  # widened: its own
    assert read_dtypes(g, p, jnp.ones(4)) == {
        "both": F32, "moved": F16, "unused": F32, "wide": F16}
    # Casts that disagree keep the leaf's own dtype; a leaf also returned as it is, too.
    h = lambda p: (_half(p["w"]).sum(), p["w"].astype(jnp.bfloat16).sum(),
                   _half(p["r"]).sum(), p["r"].T)
    assert read_dtypes(h, {"w": jnp.ones(2), "r": jnp.ones(2)}) == {"w": F32, "r": F32}


def test_nested_calls_while_custom_vjp_and_shard_map():
    @jax.custom_vjp
    def vjp_half(w):
        return _half(w).astype(jnp.float32) * 2

    vjp_half.defvjp(lambda w: (vjp_half(w), None), lambda _, g: (g * 2,))

    def f(p, x):
        y = jax.jit(lambda w: _half(w) @ _half(x))(p["jit"]).astype(jnp.float32).sum()
        y += jax.checkpoint(lambda w: _half(w).astype(jnp.float32).sum())(p["remat"])
        y += jax.lax.while_loop(lambda c: c < _half(p["while"]).sum(), lambda c: c + 1,
                                jnp.float16(0)).astype(jnp.float32)
        y += vjp_half(p["vjp"]).sum()
        sharded = jax.shard_map(lambda w: _half(w).astype(jnp.float32) * 2,
                                in_specs=P("i"), out_specs=P("i"))(p["shard_map"])
        return y + sharded.sum()

    p = {k: jnp.ones((4, 4)) for k in ("jit", "remat", "while", "vjp", "shard_map")}
    mesh = jax.make_mesh((1,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):
        reads = read_dtypes(f, p, jnp.ones((4,)))
    assert reads == dict.fromkeys(p, F16)
