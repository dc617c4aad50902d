"""Moving a Flax ``TrainState`` + ``DynamicScale`` loop to jamp (docs/guides/migrate.md).

``before_step`` is the pattern of Flax's examples (``flax.training.dynamic_scale``):
the model is written with ``dtype=jnp.float16`` on every layer, the scale lives
beside the ``TrainState`` and the skip is a ``jnp.where`` over params and
optimizer state written by hand. ``after_step`` is the same step with jamp: the
policy reaches a model written without dtypes, the scale is an optax
transformation inside ``state.tx`` (so it is checkpointed with the optimizer
state), and the skip is exact (the inner optimizer state does not move).

Run it: ``python docs/examples/migrate_flax_dynamic_scale.py``; the tests run it too.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import dynamic_scale as dynamic_scale_lib
from flax.training import train_state

import jamp


class MLP(nn.Module):  # written once, without dtypes: the policy sets them (jamp)
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64, dtype=self.dtype)(x))
        return nn.Dense(10, dtype=self.dtype)(x)


def cross_entropy(logits, labels):
    logits = logits.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


# --- before: Flax's DynamicScale, by hand ------------------------------------------------
class ScaledState(train_state.TrainState):
    dynamic_scale: dynamic_scale_lib.DynamicScale


@jax.jit
def before_step(state: ScaledState, x, y):
    def loss_fn(params):
        return cross_entropy(state.apply_fn({"params": params}, x), y)

    grad_fn = state.dynamic_scale.value_and_grad(loss_fn)
    dynamic_scale, is_finite, loss, grads = grad_fn(state.params)
    new_state = state.apply_gradients(grads=grads, dynamic_scale=dynamic_scale)
    keep = functools.partial(jnp.where, is_finite)  # the skip, written by hand
    new_state = new_state.replace(
        opt_state=jax.tree.map(keep, new_state.opt_state, state.opt_state),
        params=jax.tree.map(keep, new_state.params, state.params))
    return new_state, loss


# --- after: jamp -------------------------------------------------------------------------
@jax.jit
def after_step(state: train_state.TrainState, x, y):
    def loss_fn(params):
        loss = cross_entropy(state.apply_fn({"params": params}, x), y)
        return jamp.scale_loss(loss, state.opt_state), loss

    grads, loss = jax.grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads), loss  # unscale, check, skip or apply


def main(steps: int = 5) -> dict:
    x = jax.random.normal(jax.random.key(0), (32, 16))
    y = jnp.arange(32) % 10
    x = x.at[0, 0].set(jnp.inf) if steps > 2 else x  # one bad batch at step 0: both skip

    model = MLP(dtype=jnp.float16)
    params = model.init(jax.random.key(1), x[:1])["params"]
    before = ScaledState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3),
                                dynamic_scale=dynamic_scale_lib.DynamicScale())

    mp = jamp.mixed_precision("fp16")
    jamp_model = jamp.apply_policy(MLP(), mp)
    after = train_state.TrainState.create(
        apply_fn=jamp_model.apply, params=jamp_model.init(jax.random.key(1), x[:1])["params"],
        tx=jamp.make_optimizer(mp, optax.adam(1e-3)))

    losses = {"before": [], "after": []}
    for step in range(steps):
        batch = (x, y) if step == 0 else (jnp.nan_to_num(x, posinf=0.0), y)
        before, loss_b = before_step(before, *batch)
        after, loss_a = after_step(after, *batch)
        losses["before"].append(float(loss_b))
        losses["after"].append(float(loss_a))
    return dict(losses=losses, before_scale=float(before.dynamic_scale.scale),
                after_scale=float(jamp.loss_scale(after.opt_state)),
                after_skipped=int(jamp.overflow_stats(after.opt_state).steps_skipped),
                adam_count=int(after.opt_state.inner_state[0].count))


if __name__ == "__main__":
    print(main())
