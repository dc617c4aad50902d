import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import jamp
from jamp.models import vit


def test_tree_bytes_counts_shapes_and_dtypes():
    tree = {"a": jnp.ones((2, 3), jnp.float16), "b": jax.ShapeDtypeStruct((4,), jnp.float32),
            "c": 3}
    assert jamp.tree_bytes(tree) == 12 + 16


def test_memory_report_exact_on_a_small_function():
    def loss(p, x):
        return jnp.sum(jnp.tanh(x @ p["w"]))

    params = {"w": jnp.ones((4, 4))}
    x = jnp.ones((2, 4))
    opt_state = optax.adam(1e-3).init(params)
    report = jamp.memory_report(loss, params, x, opt_state=opt_state)
    assert report.params_bytes == report.grads_bytes == 64
    assert report.opt_state_bytes == 64 * 2 + 4  # mu, nu, count
    # Saved: x for the matmul's transpose; tanh(x @ w) and 1 - tanh^2 for tanh's derivative.
    assert report.residual_bytes == 3 * 2 * 4 * 4
    assert report.activation_bytes == 2 * 2 * 4 * 4  # the input x is not an activation
    assert report.total_bytes == 64 + 64 + 132 + 96
    assert "residuals" in str(report)


def _vit_step_report(mode: str, batch: int = 2):
    model = jamp.apply_policy(vit.create("s16", num_classes=1000), mode)
    images = jax.ShapeDtypeStruct((batch, 224, 224, 3), jnp.float32)
    labels = jax.ShapeDtypeStruct((batch,), jnp.int32)
    params = jax.eval_shape(
        lambda x: nn.unbox(model.init(jax.random.key(0), x)), images)["params"]

    def loss(p, x, y):
        logits = model.apply({"params": p}, x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return jamp.memory_report(loss, params, images, labels)


@pytest.fixture(scope="module")
def vit_reports():
    return {mode: _vit_step_report(mode) for mode in ("fp32", "fp16", "bf16", "fp16_naive")}


@pytest.mark.parametrize("mode", ["fp16", "bf16", "fp16_naive"])
def test_half_precision_vit_s16_saves_at_most_055x_residuals(vit_reports, mode):
    ratio = vit_reports[mode].residual_bytes / vit_reports["fp32"].residual_bytes
    assert ratio <= 0.55, f"{mode}: {ratio:.3f}"


def test_vit_s16_param_bytes_per_mode(vit_reports):
    fp32 = vit_reports["fp32"].params_bytes
    assert 21_000_000 * 4 < fp32 < 23_000_000 * 4  # ViT-S/16: ~22M parameters
    assert vit_reports["fp16"].params_bytes == fp32
    # fp16_naive: everything f16 but the norms (f32).
    assert 0.5 * fp32 < vit_reports["fp16_naive"].params_bytes < 0.51 * fp32
