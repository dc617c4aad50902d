"""The policy reaches models jamp did not write, in every mode (issue 12).

Models in the style of third-party libraries (written here): RNN cells and
scanned cells (Flax seq2seq/SST-2), an encoder-decoder with encode/decode and a
decoding cache (WMT), custom ``self.param`` layers (big_vision, SST-2, GPT-2),
attention that calls softmax itself (BERT, GPT-2), a BatchNorm CNN (ImageNet
ResNet) and an orthogonal initialiser. For each model and mode, from the jaxpr of
the forward pass and of the gradient: every dot/conv takes compute-dtype operands,
softmax and norm statistics run in float32 where the mode says so; parameters are
in the param dtype, outputs in the output dtype; a few optimizer steps train
without NaN and end close to float32.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jaxpr_utils import iter_eqns

import jamp

FLOAT32_SOFTMAX = ("fp16", "bf16", "fp16_naive")  # modes with softmax_fp32 and norm overrides
# Tiny programs: XLA's cheapest CPU compile (a third of the default's time) is plenty.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
DOTS = ("dot_general", "conv_general_dilated")


# ----------------------------------------------------------------------------- models


class Recurrent(nn.Module):
    """LSTM and GRU under nn.RNN (Flax seq2seq/SST-2 style)."""

    @nn.compact
    def __call__(self, x):
        ys = [nn.RNN(cell)(x)[:, -1] for cell in (nn.LSTMCell(4), nn.GRUCell(4))]
        return nn.Dense(2)(jnp.concatenate(ys, -1))


class AllCells(nn.Module):
    """Every Flax cell, and a bidirectional LSTM; checked at trace level only (fast)."""

    @nn.compact
    def __call__(self, x):
        cells = [nn.LSTMCell(4), nn.OptimizedLSTMCell(4), nn.GRUCell(4), nn.SimpleCell(4),
                 nn.MGUCell(4)]
        ys = [nn.RNN(cell)(x)[:, -1] for cell in cells]
        ys.append(nn.Bidirectional(nn.RNN(nn.LSTMCell(4)), nn.RNN(nn.LSTMCell(4)))(x)[:, -1])
        return jnp.concatenate(ys, -1)


class DecoderStep(nn.Module):
    """A seq2seq decoder: a cell inside an nn.scan-ed method."""

    @functools.partial(nn.scan, variable_broadcast="params", split_rngs={"params": False},
                       in_axes=1, out_axes=1)
    @nn.compact
    def __call__(self, carry, x):
        carry, y = nn.LSTMCell(4)(carry, x)
        return carry, nn.Dense(3)(y)


class ScannedCells(nn.Module):
    """A scanned method with a carry made outside, and nn.scan over a cell class."""

    @nn.compact
    def __call__(self, x):
        carry = nn.LSTMCell(4, parent=None).initialize_carry(jax.random.key(0), x[:, 0].shape)
        _, y = DecoderStep()(carry, x)
        lstm = nn.scan(nn.LSTMCell, variable_broadcast="params", split_rngs={"params": False},
                       in_axes=1, out_axes=1)(4)
        (c, h), _ = lstm(lstm.initialize_carry(jax.random.key(1), x[:, 0].shape), x)
        return nn.Dense(2)(jnp.concatenate([y[:, -1], h, c], -1))


class EncoderDecoder(nn.Module):
    """WMT style: encode/decode methods, a decoding cache, tied embeddings."""

    vocab: int = 11
    decode: bool = False

    def setup(self):
        self.embed = nn.Embed(self.vocab, 8)
        self.encoder = nn.Dense(8)
        self.self_attention = nn.MultiHeadDotProductAttention(num_heads=2, decode=self.decode)
        self.cross_attention = nn.MultiHeadDotProductAttention(num_heads=2)
        self.encoder_norm = nn.LayerNorm()
        self.decoder_norm = nn.LayerNorm()

    def encode(self, src):
        return self.encoder_norm(nn.gelu(self.encoder(self.embed(src))))

    def decode_step(self, encoded, tgt):
        y = self.embed(tgt)
        mask = None if self.decode else nn.make_causal_mask(tgt)
        y = y + self.self_attention(y, y, mask=mask)
        y = y + self.cross_attention(y, encoded)
        return self.embed.attend(self.decoder_norm(y))

    def __call__(self, src, tgt):
        return self.decode_step(self.encode(src), tgt)


class BareDense(nn.Module):
    """No dtype fields at all: ``x @ w`` (big_vision heads, hand-written layers)."""

    features: int

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.normal(0.5), (x.shape[-1], self.features))
        return x @ w + self.param("b", nn.initializers.zeros, (self.features,))


class Conv1D(nn.Module):
    """GPT-2 style: a ``dtype`` field, no ``param_dtype`` field."""

    features: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.normal(0.5), (self.features, x.shape[-1]))
        return jnp.dot(x.astype(self.dtype), kernel.astype(self.dtype).T)


class Embedder(nn.Module):
    """SST-2 style: the table is created from the ``dtype`` field, in setup."""

    vocab: int
    features: int
    dtype: Any = jnp.float32

    def setup(self):
        self.table = self.param("table", nn.initializers.normal(1.0),
                                (self.vocab, self.features), self.dtype)

    def __call__(self, ids):
        return jnp.take(self.table, ids, axis=0)


class CustomParams(nn.Module):
    """Params made by custom code (from a dtype field, in ``x.dtype``, with no dtype at all)
    and by a QR-based (orthogonal) initialiser."""

    @nn.compact
    def __call__(self, ids):
        x = Embedder(11, 8)(ids)
        x = nn.Dense(8, kernel_init=nn.initializers.orthogonal())(x)
        cls = self.param("cls", nn.initializers.normal(0.5), (1, 1, 8), x.dtype)  # big_vision
        pos = self.param("pos_embedding", nn.initializers.normal(0.5), (1, 5, 8), x.dtype)
        x = jnp.concatenate([jnp.broadcast_to(cls, (x.shape[0], 1, 8)), x], 1) + pos
        x = nn.gelu(BareDense(8)(x))
        return Conv1D(2)(x.mean(1))


class SoftmaxAttention(nn.Module):
    """BERT/GPT-2 style attention: softmax called directly, three ways, one masked."""

    @nn.compact
    def __call__(self, x):
        b, s, _ = x.shape
        q, k, v = (nn.Dense(8)(x).reshape(b, s, 2, 4) for _ in range(3))
        w1 = nn.dot_product_attention_weights(q, k)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / 2.0
        w2 = jax.nn.softmax(logits, axis=-1)
        causal = jnp.tril(jnp.ones((s, s), bool))
        w3 = nn.softmax(jnp.where(causal, logits, jnp.finfo(logits.dtype).min))
        y = jnp.einsum("bhqk,bkhd->bqhd", w1 + w2 + w3, v).reshape(b, s, 8)
        return nn.Dense(2)(nn.LayerNorm()(y).mean(1))


class BatchNormCNN(nn.Module):
    """ImageNet-ResNet style: conv, BatchNorm with running statistics, pooling."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Conv(4, (3, 3))(x)))
        x = nn.Conv(8, (3, 3), strides=2)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(x))
        return nn.Dense(2)(x.mean((1, 2)))


# ----------------------------------------------------------------------------- cases

_KEY = jax.random.key(42)
_SEQ = jax.random.normal(_KEY, (4, 3, 3))
_IDS = jax.random.randint(_KEY, (4, 4), 0, 11)
_TARGET = jax.random.normal(jax.random.key(7), (4, 2))


def _mse(out, batch):
    return jnp.mean((out.astype(jnp.float32) - batch["target"]) ** 2)


def _next_token(out, batch):
    return optax.softmax_cross_entropy_with_integer_labels(
        out.astype(jnp.float32), batch["labels"]).mean()


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    module: Callable[[], nn.Module]
    inputs: tuple
    loss: Callable = _mse
    mutable: tuple[str, ...] = ()
    softmaxes: int = 0  # softmaxes in the forward pass
    norms: bool = False
    lr: float = 1e-2


CASES = [
    Case("rnn_cells", Recurrent, (_SEQ,)),
    Case("scanned_cells", ScannedCells, (_SEQ,)),
    Case("encoder_decoder", EncoderDecoder, (_IDS, _IDS), loss=_next_token, softmaxes=2,
         norms=True),
    Case("custom_params", CustomParams, (_IDS,)),
    Case("softmax_attention", SoftmaxAttention, (jax.random.normal(_KEY, (4, 4, 8)),),
         softmaxes=3, norms=True),
    Case("batchnorm_cnn", BatchNormCNN, (jax.random.normal(_KEY, (4, 6, 6, 1)),),
         mutable=("batch_stats",), norms=True),
]
CASE_BY_NAME = {c.name: c for c in CASES}
GRID = [(c.name, m) for c in CASES for m in jamp.MODES]


@dataclasses.dataclass
class Result:
    variables: Any
    out_dtype: Any
    forward: list  # (primitive, operand dtypes) of the forward jaxpr
    backward: list  # ... of the gradient's jaxpr
    losses: list[float]


def _summary(closed) -> list[tuple[str, tuple[str, ...]]]:
    return [(e.primitive.name, tuple(str(v.aval.dtype) for v in e.invars))
            for e in iter_eqns(closed)]


def _batch(case: Case) -> dict:
    return {"inputs": case.inputs, "target": _TARGET,
            "labels": jnp.roll(case.inputs[-1], -1, axis=-1)}


def _train(model, variables, case: Case, mode: str, updates: int = 6) -> list[float]:
    """Losses of Adam steps until ``updates`` were applied (a dynamic scale skips some)."""
    params, extra = variables["params"], {k: v for k, v in variables.items() if k != "params"}
    # eps representable in float16, so the pure modes' half-precision Adam state works too.
    tx = jamp.make_optimizer(jamp.mixed_precision(mode), optax.adam(case.lr, eps=1e-4))
    opt_state = tx.init(params)

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    def step(params, extra, opt_state, batch):
        def loss_fn(p):
            out, new = model.apply({"params": p, **extra}, *batch["inputs"],
                                   mutable=list(case.mutable))
            loss = case.loss(out, batch)
            return jamp.scale_loss(loss, opt_state), (loss, new)

        grads, (loss, new) = jax.grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, {**extra, **new}, opt_state, loss, jamp.overflow_stats(opt_state)

    losses, batch, applied = [], _batch(case), True
    for _ in range(3 * updates):
        params, extra, opt_state, loss, stats = step(params, extra, opt_state, batch)
        if applied:  # the loss after one more applied update
            losses.append(float(loss))
        if len(losses) > updates:
            break
        applied = bool(stats.last_finite)
    return losses


@functools.cache
def result(name: str, mode: str) -> Result:
    case = CASE_BY_NAME[name]
    model = jamp.apply_policy(case.module(), mode)
    # lazy_init: the same variables as init, without compiling the forward pass.
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in case.inputs]
    variables = model.lazy_init(jax.random.key(0), *shapes)
    batch = _batch(case)

    def forward(v):
        return model.apply(v, *case.inputs, mutable=list(case.mutable))[0]

    def loss(params):
        return case.loss(forward({**variables, "params": params}), batch)

    return Result(
        variables=variables,
        out_dtype=jax.eval_shape(forward, variables).dtype,
        forward=_summary(jax.make_jaxpr(forward)(variables)),
        backward=_summary(jax.make_jaxpr(jax.grad(loss))(variables["params"])),
        losses=_train(model, variables, case, mode),
    )


def _operands(summary, primitives) -> Counter:
    return Counter(dt for name, dts in summary if name in primitives for dt in dts)


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name,mode", GRID)
def test_every_dot_and_conv_takes_compute_dtype_operands(name, mode):
    r, compute = result(name, mode), str(jnp.dtype(jamp.mixed_precision(mode).policy.compute_dtype))
    for summary in (r.forward, r.backward):
        operands = _operands(summary, DOTS)
        assert operands and set(operands) == {compute}, operands


@pytest.mark.parametrize("name,mode", GRID)
def test_softmax_and_norm_statistics_in_float32_where_the_mode_says(name, mode):
    r, case = result(name, mode), CASE_BY_NAME[name]
    forward_exps = _operands(r.forward, ("exp",))
    assert sum(forward_exps.values()) >= case.softmaxes
    if mode not in FLOAT32_SOFTMAX:
        return
    for summary in (r.forward, r.backward):
        assert set(_operands(summary, ("exp",))) <= {"float32"}
        assert set(_operands(summary, ("rsqrt",))) <= {"float32"}
    if case.norms:
        assert _operands(r.forward, ("rsqrt",))


def _is_norm(path) -> bool:
    return any("Norm" in str(getattr(k, "key", "")) or "norm" in str(getattr(k, "key", ""))
               for k in path)


@pytest.mark.parametrize("name,mode", GRID)
def test_params_in_param_dtype_and_output_in_output_dtype(name, mode):
    r, policy = result(name, mode), jamp.mixed_precision(mode).policy
    overridden = mode in FLOAT32_SOFTMAX  # norms keep float32 params (the documented exception)
    for path, leaf in jax.tree_util.tree_leaves_with_path(r.variables["params"]):
        expected = jnp.float32 if overridden and _is_norm(path) else policy.param_dtype
        assert leaf.dtype == expected, (jax.tree_util.keystr(path), leaf.dtype)
    assert r.out_dtype == policy.output_dtype


@pytest.mark.parametrize("name,mode", GRID)
def test_a_few_steps_train_without_nan_close_to_float32(name, mode):
    losses, reference = result(name, mode).losses, result(name, "fp32").losses
    assert np.all(np.isfinite(losses)), losses
    assert losses[-1] < losses[0]
    tolerance = 0.05 if mode.endswith("pure") else 0.03  # pure modes: Adam in half precision
    assert abs(losses[-1] / reference[-1] - 1) < tolerance, (losses, reference)


def test_every_mode_starts_from_the_same_weights_up_to_rounding():
    for name in CASE_BY_NAME:
        reference = jax.tree_util.tree_leaves(result(name, "fp32").variables["params"])
        for mode in ("fp16_naive", "bf16_pure"):
            leaves = jax.tree_util.tree_leaves(result(name, mode).variables["params"])
            for a, ref in zip(leaves, reference, strict=True):
                np.testing.assert_array_equal(a, ref.astype(a.dtype))


@pytest.mark.parametrize("mode", jamp.MODES)
def test_every_flax_cell_initialises_and_computes_in_compute_dtype(mode):
    policy = jamp.mixed_precision(mode).policy
    model = jamp.apply_policy(AllCells(), mode)
    variables = jax.eval_shape(model.init, jax.random.key(0), _SEQ)  # traces: no compile
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(variables)} == {
        jnp.dtype(policy.param_dtype)}
    summary = _summary(jax.make_jaxpr(lambda v: model.apply(v, _SEQ))(variables))
    assert set(_operands(summary, DOTS)) == {str(jnp.dtype(policy.compute_dtype))}
    assert jax.eval_shape(model.apply, variables, _SEQ).dtype == policy.output_dtype


@pytest.mark.parametrize("mode", jamp.MODES)
def test_encode_and_cached_decode_through_method(mode):
    policy = jamp.mixed_precision(mode).policy
    params = {"params": result("encoder_decoder", mode).variables["params"]}
    src, tgt = _IDS, _IDS
    model = jamp.apply_policy(EncoderDecoder(), mode)
    encoded = model.apply(params, src, method="encode")
    assert encoded.dtype == policy.output_dtype
    np.testing.assert_array_equal(encoded, model.apply(params, src, method=EncoderDecoder.encode))
    teacher_forced = model.apply(params, src, tgt)

    decoder = jamp.apply_policy(EncoderDecoder(decode=True), mode)
    cache = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(
        decoder.init, jax.random.key(0), src, tgt)["cache"])

    def step(cache, token):
        logits, new = decoder.apply({**params, "cache": cache}, encoded, token,
                                    method=EncoderDecoder.decode_step, mutable=["cache"])
        return new["cache"], logits

    summary = _summary(jax.make_jaxpr(step)(cache, tgt[:, :1]))
    assert set(_operands(summary, DOTS)) == {str(jnp.dtype(policy.compute_dtype))}
    step = jax.jit(step, compiler_options=FAST_COMPILE)
    for i in range(tgt.shape[1]):
        cache, logits = step(cache, tgt[:, i:i + 1])
        assert logits.dtype == policy.output_dtype
        np.testing.assert_allclose(logits[:, 0], teacher_forced[:, i], atol=0.05, rtol=0.05)
