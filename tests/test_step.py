"""The numbers the trainer reports and the optimizer it builds from the config.

Guards against silently wrong results: eval counts that include padding rows, and config
fields that the trainer would ignore (grad_clip_norm, learning_rate, warmup_steps,
weight_decay, momentum, optimizer, label_smoothing, loss_scale.*, dropout_rate and the
other model fields, num_epochs, max_steps). Optimizer-level checks on tiny trees, no
training loops.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import jamp
from jamp import data, experiment, train
from jamp.config import vit_config
from jamp.loss_scale import loss_scale, overflow_stats
from jamp.step import cross_entropy, eval_step

NUM_CLASSES = 4


def _state(apply_fn) -> train_state.TrainState:
    return train_state.TrainState.create(apply_fn=apply_fn, params={}, tx=optax.identity())


def _logits_are_the_images(variables, images, train):
    """A stand-in model: the "images" of the batch are its logits."""
    assert not train
    return images


def _reference_eval(logits, labels, mask):
    logits, mask = np.asarray(logits, np.float64), np.asarray(mask, bool)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    losses = -log_probs[np.arange(len(labels)), labels]
    correct = logits.argmax(-1) == labels
    return losses[mask].sum(), int(correct[mask].sum()), int(mask.sum())


# --- eval_step ----------------------------------------------------------------------


@pytest.mark.parametrize("padding_predicted", ["right", "wrong"])
def test_eval_step_counts_only_unmasked_rows(padding_predicted):
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, (8, NUM_CLASSES)).astype(np.float32)
    predicted = logits.argmax(-1)
    # Real rows: 3 of 5 right. Padding rows (mask False): all right, or all wrong.
    labels = predicted.copy()
    labels[[1, 3]] = (predicted[[1, 3]] + 1) % NUM_CLASSES
    if padding_predicted == "wrong":
        labels[5:] = (predicted[5:] + 1) % NUM_CLASSES
    logits[6] *= 50  # a padding row with a huge loss when wrong
    mask = np.arange(8) < 5
    batch = {"image": jnp.asarray(logits), "label": jnp.asarray(labels, jnp.int32),
             "mask": jnp.asarray(mask)}
    metrics = eval_step(_state(_logits_are_the_images), batch)
    loss_sum, correct, count = _reference_eval(logits, labels, mask)
    assert (float(metrics["correct"]), float(metrics["count"])) == (correct, count) == (3, 5)
    np.testing.assert_allclose(float(metrics["loss_sum"]), loss_sum, rtol=1e-6)


def test_eval_step_without_mask_counts_every_row():
    logits = np.random.default_rng(1).normal(0, 2, (6, NUM_CLASSES)).astype(np.float32)
    labels = np.array([0, 1, 2, 3, 0, 1], np.int32)
    metrics = eval_step(_state(_logits_are_the_images),
                        {"image": jnp.asarray(logits), "label": jnp.asarray(labels)})
    loss_sum, correct, count = _reference_eval(logits, labels, np.ones(6, bool))
    assert (float(metrics["correct"]), float(metrics["count"])) == (correct, count)
    np.testing.assert_allclose(float(metrics["loss_sum"]), loss_sum, rtol=1e-6)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_logits_never_count_as_correct(bad):
    # argmax of a row of NaNs is class 0: a NaN model must not score the share of class 0.
    logits = np.zeros((4, NUM_CLASSES), np.float32)
    logits[:, 0] = 1.0
    logits[1:, :] = bad  # rows 1-3 non-finite; all labels are class 0
    batch = {"image": jnp.asarray(logits), "label": jnp.zeros(4, jnp.int32)}
    metrics = eval_step(_state(_logits_are_the_images), batch)
    assert float(metrics["correct"]) == 1.0


# --- the trainer's config -----------------------------------------------------------


@pytest.fixture(scope="module")
def digits_dir(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("tfds")
    data.prepare_digits(data_dir)
    return str(data_dir)


def _config(mode="fp32", **fields):
    """A tiny-ViT config with plain SGD, no clipping, decay, momentum or warm-up."""
    c = vit_config(mode)
    c.num_layers, c.hidden_size, c.num_heads, c.mlp_dim = 1, 16, 2, 32
    c.batch_size, c.progress, c.plot = 64, False, False
    c.optimizer, c.learning_rate, c.momentum = "sgd", 0.5, 0.0
    c.weight_decay, c.warmup_steps, c.grad_clip_norm = 0.0, 0, 0.0
    for key, value in fields.items():
        c[key] = value
    return c


PARAMS = {"w": jnp.array([[1.0, -2.0], [0.5, 3.0]]), "b": jnp.array([4.0, -1.0, 2.0])}
BIG_GRADS = {"w": jnp.array([[30.0, -40.0], [12.0, 5.0]]), "b": jnp.array([-20.0, 0.0, 7.0])}


def _updates(config, grads, steps=1, total_steps=100, params=PARAMS):
    """The updates of ``steps`` optimizer steps (params held fixed), as the trainer builds it.

    Gradients are fed as the train step makes them: of the loss times the loss scale.
    """
    tx = experiment.build_optimizer(config, total_steps, experiment.precision_from_config(config))
    state = tx.init(params)
    out = []
    for _ in range(steps):
        scale = loss_scale(state)
        updates, state = tx.update(jax.tree.map(lambda g, s=scale: g * s, grads), state, params)
        out.append(jax.tree.map(np.asarray, updates))
    return out, state


def _assert_tree_close(got, expected, rtol=1e-6, atol=0.0):
    jax.tree.map(lambda g, e: np.testing.assert_allclose(g, e, rtol=rtol, atol=atol),
                 got, expected)


def _global_norm(tree):
    return math.sqrt(sum(float(np.sum(np.square(np.asarray(x, np.float64))))
                         for x in jax.tree.leaves(tree)))


@pytest.mark.parametrize("mode", ["fp32", "fp16", "bf16"])
def test_grad_clip_norm_clips_the_unscaled_gradient(mode):
    norm = _global_norm(BIG_GRADS)  # about 60; clipped to 2 (not the default 1)
    (clipped,), state = _updates(_config(mode, grad_clip_norm=2.0), BIG_GRADS)
    if mode == "fp16":  # the gradients fed in were 65536x the true ones
        assert float(loss_scale(state)) == 2.0**16 and bool(overflow_stats(state).last_finite)
    _assert_tree_close(clipped, jax.tree.map(lambda g: -0.5 * 2.0 * g / norm, BIG_GRADS))
    assert _global_norm(clipped) == pytest.approx(1.0)
    for off in (0.0, None):
        (unclipped,), _ = _updates(_config(mode, grad_clip_norm=off), BIG_GRADS)
        _assert_tree_close(unclipped, jax.tree.map(lambda g: -0.5 * g, BIG_GRADS))
    # A gradient already inside the norm is left alone.
    small = jax.tree.map(lambda g: g / norm, BIG_GRADS)
    (update,), _ = _updates(_config(mode, grad_clip_norm=2.0), small)
    _assert_tree_close(update, jax.tree.map(lambda g: -0.5 * g, small))


def test_learning_rate_and_warmup_steps_set_the_first_updates():
    # Linear warm-up from 0 to learning_rate over warmup_steps, then cosine decay.
    updates, _ = _updates(_config(learning_rate=0.3, warmup_steps=4), BIG_GRADS, steps=6,
                          total_steps=1000)
    for step, update in enumerate(updates[:5]):
        _assert_tree_close(update, jax.tree.map(lambda g, t=step: -0.3 * t / 4 * g, BIG_GRADS))
    decayed = 0.3 * 0.5 * (1 + math.cos(math.pi * 1 / 996))
    _assert_tree_close(updates[5], jax.tree.map(lambda g: -decayed * g, BIG_GRADS))


def test_learning_rate_decays_to_zero_at_total_steps():
    updates, _ = _updates(_config(learning_rate=0.3, warmup_steps=2), BIG_GRADS, steps=11,
                          total_steps=10)
    _assert_tree_close(updates[2], jax.tree.map(lambda g: -0.3 * g, BIG_GRADS))
    for update in updates[10:]:
        _assert_tree_close(update, jax.tree.map(np.zeros_like, BIG_GRADS), atol=1e-12)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_weight_decay_reaches_the_optimizer(optimizer):
    zero = jax.tree.map(jnp.zeros_like, PARAMS)
    (update,), _ = _updates(_config(optimizer=optimizer, weight_decay=0.03), zero)
    _assert_tree_close(update, jax.tree.map(lambda p: -0.5 * 0.03 * p, PARAMS))


def test_momentum_accumulates_sgd_updates():
    updates, _ = _updates(_config(momentum=0.8), BIG_GRADS, steps=3, total_steps=10**7)
    for update, factor in zip(updates, (1.0, 1.8, 2.44), strict=True):
        _assert_tree_close(update, jax.tree.map(lambda g, f=factor: -0.5 * f * g, BIG_GRADS),
                           rtol=1e-5)


def test_optimizer_field_selects_sgd_or_adamw():
    (sgd,), _ = _updates(_config(optimizer="sgd"), BIG_GRADS)
    _assert_tree_close(sgd, jax.tree.map(lambda g: -0.5 * g, BIG_GRADS))
    # Adam's first step is lr * g / (|g| + eps): the sign of the gradient (up to the float32
    # rounding of the bias corrections).
    (adamw,), _ = _updates(_config(optimizer="adamw"), BIG_GRADS)
    _assert_tree_close(adamw, jax.tree.map(lambda g: -0.5 * np.sign(g), BIG_GRADS), rtol=1e-5)
    with pytest.raises(experiment.ConfigError, match="'adamw' or 'sgd'"):
        _updates(_config(optimizer="lamb"), BIG_GRADS)


def test_loss_scale_fields_reach_the_optimizer():
    config = _config("fp16")
    ls = config.loss_scale
    ls.init_scale, ls.growth_factor, ls.growth_interval, ls.max_scale = 1024.0, 4.0, 2, 4096.0
    ls.hysteresis, ls.backoff_factor, ls.min_scale, ls.divergence_steps = 2, 0.25, 256.0, 2
    tx = experiment.build_optimizer(config, 100, experiment.precision_from_config(config))
    state = tx.init(PARAMS)
    finite = jax.tree.map(jnp.ones_like, PARAMS)
    overflow = {"w": jnp.full((2, 2), jnp.inf), "b": jnp.ones(3)}
    scales, diverged = [float(loss_scale(state))], []
    for grads in [finite] * 4 + [overflow] * 5:
        _, state = tx.update(grads, state, PARAMS)
        scales.append(float(loss_scale(state)))
        diverged.append(bool(overflow_stats(state).diverged))
    # init 1024; x4 after 2 finite steps, capped at 4096; 2 overflows per back-off (x0.25),
    # floored at 256; diverged after 2 overflows in a row at the floor.
    assert scales == [1024, 1024, 4096, 4096, 4096, 4096, 1024, 256, 256, 256]
    assert diverged == [False] * 8 + [True]


def test_fp16_pure_honours_divergence_steps_from_the_config():
    # The static scale of fp16_pure was once built without divergence_steps (issue 10).
    config = _config("fp16_pure")
    config.loss_scale.divergence_steps = 3
    tx = experiment.build_optimizer(config, 100, experiment.precision_from_config(config))
    state = tx.init(PARAMS)
    overflow = {"w": jnp.full((2, 2), jnp.nan), "b": jnp.ones(3)}
    diverged = []
    for _ in range(3):
        _, state = tx.update(overflow, state, PARAMS)
        diverged.append(bool(overflow_stats(state).diverged))
    assert diverged == [False, False, True]


@pytest.mark.parametrize("mode, field", [("bf16", "divergence_steps"), ("fp32", "init_scale"),
                                         ("fp16_pure", "hysteresis")])
def test_a_loss_scale_field_the_mode_cannot_use_is_a_config_error(mode, field):
    config = _config(mode)
    config.loss_scale[field] = 2
    with pytest.raises(experiment.ConfigError, match=rf"{field} does not apply.*mode '{mode}'"):
        experiment.precision_from_config(config)


def test_label_smoothing_reaches_the_train_step(monkeypatch, digits_dir):
    exp = experiment.build_experiment(_config(label_smoothing=0.2, data_dir=digits_dir))
    seen = []

    def fake_loss(label_smoothing):
        seen.append(label_smoothing)
        return lambda *args: (0.0, {})

    class Shardings(NamedTuple):
        params: dict

    monkeypatch.setattr(train, "classification_loss", fake_loss)
    train.jit_train_step(exp, Shardings(params={}))  # built, not traced
    assert seen == [0.2]


def test_cross_entropy_label_smoothing():
    logits = jnp.array([[2.0, 0.0, -1.0, 0.5]])
    log_probs = np.asarray(jax.nn.log_softmax(logits))[0]
    targets = np.full(4, 0.2 / 4)
    targets[1] += 0.8
    np.testing.assert_allclose(float(cross_entropy(logits, jnp.array([1]), 0.2)),
                               -np.sum(targets * log_probs), rtol=1e-6)


def test_model_fields_and_step_counts_reach_the_experiment(digits_dir):
    fields = dict(dropout_rate=0.25, patch_size=4, num_layers=2, hidden_size=24, num_heads=3,
                  mlp_dim=40, remat=True, scan_layers=False)
    exp = experiment.build_experiment(_config("bf16", num_epochs=3, data_dir=digits_dir, **fields))
    assert {k: getattr(exp.model.inner, k) for k in fields} == fields
    assert exp.model.precision.name == exp.precision.name == "bf16"
    assert (exp.steps_per_epoch, exp.total_steps) == (1437 // 64, 3 * (1437 // 64))
    exp = experiment.build_experiment(_config(max_steps=7, data_dir=digits_dir))
    assert exp.total_steps == 7


# --- the trainer's evaluation -------------------------------------------------------


def test_evaluate_counts_each_digits_test_example_once(digits_dir):
    config = _config(data_dir=digits_dir)  # 360 test examples: 5 batches of 64 and 40
    exp = experiment.build_experiment(config)
    top = 3.0

    def predict_zero(variables, images, train):
        # Class 0 for every image, padding too (whose label is 0): padding counted as
        # examples would raise the accuracy.
        return jnp.zeros((images.shape[0], exp.info.num_classes)).at[:, 0].set(top)

    metrics = train.evaluate(exp, _state(predict_zero), jax.jit(eval_step))
    test = data.open_source(exp.info, exp.info.test_split, digits_dir)
    labels = np.array([int(test[i]["label"]) for i in range(len(test))])
    assert len(labels) == 360 and 360 % config.batch_size
    zeros = int(np.sum(labels == 0))
    lse = math.log(math.exp(top) + exp.info.num_classes - 1)
    assert metrics["eval/accuracy"] == pytest.approx(zeros / 360, rel=1e-12)
    expected_loss = (zeros * (lse - top) + (360 - zeros) * lse) / 360
    assert metrics["eval/loss"] == pytest.approx(expected_loss, rel=1e-5)


@pytest.mark.parametrize("mode", ["fp16", "O2", "bf16", "fp16_pure"])
def test_make_optimizer_takes_what_apply_policy_takes(mode):
    from jamp import make_optimizer, mixed_precision

    by_name = make_optimizer(mode, optax.sgd(0.1)).init(PARAMS)
    by_recipe = make_optimizer(mixed_precision(mode), optax.sgd(0.1)).init(PARAMS)
    assert jax.tree.structure(by_name) == jax.tree.structure(by_recipe)
    assert float(loss_scale(by_name)) == float(loss_scale(by_recipe))


class _TemperedState(jamp.step.TrainState):
    """A TrainState whose forward pass also reads (and the step differentiates) a temperature."""

    temperature: Any = None
    seen: Any = None  # the gradient of the temperature, as after_update received it
    applied: Any = None

    def differentiated_variables(self):
        return {"temper": {"t": self.temperature}}

    def after_update(self, new_variables, opt_state_before, applied, scale_ratio):
        return self.replace(seen=new_variables["temper"]["t"], applied=applied)


def test_the_step_differentiates_what_a_train_state_names_and_hands_it_back():
    """A jamp.step.TrainState subclass's extra variables reach apply_fn, are differentiated
    with the params (not given to the optimizer) and come back through after_update."""
    def apply_fn(variables, images, train=False, rngs=None):
        return images @ variables["params"]["w"] * variables["temper"]["t"]

    images, labels = jnp.array([[1.0, 0.0], [0.0, 1.0]]), jnp.array([0, 1])
    w, t = jnp.eye(2), jnp.float32(2.0)
    state = _TemperedState.create(apply_fn=apply_fn, params={"w": w},
                                  tx=jamp.make_optimizer("fp32", optax.sgd(0.1)),
                                  temperature=t, seen=jnp.float32(0), applied=jnp.bool_(False))
    new, _ = jax.jit(jamp.train_step)(state, {"image": images, "label": labels},
                                      jax.random.key(0))
    want = jax.grad(lambda t: cross_entropy(images @ w * t, labels))(t)
    np.testing.assert_allclose(float(new.seen), float(want), rtol=1e-6)
    assert bool(new.applied) and float(new.temperature) == 2.0  # not an optimizer update
    assert int(new.step) == 1
    metrics = eval_step(new, {"image": images, "label": labels})  # reads it too
    assert float(metrics["correct"]) == 2.0
